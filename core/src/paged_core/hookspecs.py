"""The plugin contract of paged: one hook, ``register_backends``.

A plugin is a module named by an entry point in the group ``paged_core``::

    [project.entry-points.paged_core]
    mybackend = "paged_mybackend"

whose hook implementation registers dotted paths, so nothing heavy is imported until the
backend is used::

    from paged_core.hookspecs import hookimpl

    @hookimpl
    def register_backends(register):
        register("mybackend", "paged_mybackend.backend:MyBackend")
"""

from __future__ import annotations

from typing import Protocol

import pluggy

__all__ = ["PROJECT", "HOOK_API_VERSION", "hookspec", "hookimpl", "Register", "register_backends"]

#: The pluggy project name and the entry-point group plugins are found in.
PROJECT = "paged_core"
#: The version of this hook API. A plugin passes the version it was written for as
#: ``api_version``; one newer than this core is refused with a message, not a traceback.
HOOK_API_VERSION = 1

hookspec = pluggy.HookspecMarker(PROJECT)
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
