"""The plugin contract of paged: two hooks, ``register_backends`` and ``register_commands``.

A plugin is a module named by an entry point in the group ``paged_core``::

    [project.entry-points.paged_core]
    mybackend = "paged_mybackend"

whose hook implementation registers dotted paths, so nothing heavy is imported until the
backend is used::

    from paged_core.hookspecs import hookimpl

    @hookimpl
    def register_backends(register):
        register("mybackend", "paged_mybackend.backend:MyBackend")

A plugin may add subcommands to the ``paged`` command line the same way (``register_commands``);
core itself provides only ``paged list``.
"""

from __future__ import annotations

import argparse
from typing import Protocol

import pluggy

__all__ = [
    "PROJECT",
    "HOOK_API_VERSION",
    "hookspec",
    "hookimpl",
    "Register",
    "register_backends",
    "register_commands",
    "pip_install",
]

#: The pluggy project name and the entry-point group plugins are found in.
PROJECT = "paged_core"
#: The version of this hook API. A plugin passes the version it was written for as
#: ``api_version``; one newer than this core is refused with a message, not a traceback.
#: 1: ``register_backends``. 2: adds ``register_commands`` (a plugin that needs it can compare
#: ``paged_core.HOOK_API_VERSION``; an older core never calls it, so the commands are absent).
HOOK_API_VERSION = 2

hookspec = pluggy.HookspecMarker(PROJECT)


def pip_install(requirement: str) -> str:
    """The command that installs ``requirement``, one of paged's own distributions, as a fix hint.

    The distributions are not on a package index: the command installs from the wheels that
    ``nox -s wheels`` builds into ``dist/`` in a clone of paged, and says so.

    >>> pip_install("'paged-core[triton]'")
    "pip install --find-links dist 'paged-core[triton]' (build dist/ in a clone of paged: python3 -m nox -s wheels)"
    """
    return f"pip install --find-links dist {requirement} (build dist/ in a clone of paged: python3 -m nox -s wheels)"


hookimpl = pluggy.HookimplMarker(PROJECT)


class Register(Protocol):
    def __call__(
        self,
        name: str,
        target: str | type,
        *,
        api_version: int = HOOK_API_VERSION,
        priority: int = 0,
        install: str | None = None,
    ) -> None: ...


@hookspec
def register_backends(register: Register) -> None:
    """Register this plugin's backends by calling ``register`` once for each.

    ``register(name, target, *, api_version=1, priority=0, install=None)``:

    - ``name``: the registry key, lowercase words joined by ``-`` (``"triton-unified"``).
    - ``target``: ``"module.path:ClassName"`` of a :class:`paged_core.Backend` subclass, imported
      lazily on first use (so ``paged list`` works without CUDA), or the class itself.
    - ``api_version``: the ``HOOK_API_VERSION`` the plugin was written against.
    - ``priority``: higher wins in ``registry.select(spec)`` among backends that support the spec.
    - ``install``: the command that installs what the backend needs, shown when it cannot load.

    Errors in one plugin are recorded (``registry.problems()``) and never stop the others.
    """


@hookspec
def register_commands(subparsers: argparse._SubParsersAction) -> None:
    """Add this plugin's subcommands to the ``paged`` command line.

    ``subparsers`` is the ``argparse`` subparsers action of ``paged`` (the object
    ``ArgumentParser.add_subparsers`` returns). For each command, call
    ``subparsers.add_parser(name, help=...)``, add its options, and
    ``set_defaults(func=run)``, where ``run(args: argparse.Namespace) -> int`` does the work and
    returns the exit status (0 success, 1 a failed result, 2 a usage error)::

        @hookimpl
        def register_commands(subparsers):
            p = subparsers.add_parser("check", help="run the conformance cases now")
            p.add_argument("--backend", action="append")
            p.set_defaults(func=lambda args: run_checks(args))

    Keep it cheap: it runs for every ``paged`` invocation, ``paged list`` included, so import
    heavy modules inside ``run``. Core owns the ``paged`` entry point and ``list`` (added first);
    do not reuse a name that is taken (argparse refuses it). A plugin whose hook raises is recorded
    (``registry.problems()``, shown by ``paged list``) and the other plugins' commands still
    work. ``PAGED_PLUGINS`` narrows these plugins like any other.
    """
