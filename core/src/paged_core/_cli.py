"""The ``paged`` command line. Core owns the entry point and ``list``; every other command comes
from a plugin's ``register_commands`` hook (``check`` from paged-conformance, ``bench`` from paged-bench).
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import sys
from typing import Any, TypedDict

from ._registry import FIRST_PARTY, registry
from .hookspecs import pip_install

__all__ = ["main", "build_parser", "versions", "PROVIDERS"]

#: Commands that this project's other distributions provide, and which one: when a command is
#: missing, ``paged`` says what to install instead of "invalid choice".
PROVIDERS: dict[str, str] = {"check": "paged-conformance", "bench": "paged-bench", "tune": "paged-bench"}


class _Row(TypedDict):
    """One backend in ``paged list`` (and its ``--json``)."""

    name: str
    distribution: str
    version: str
    priority: int
    available: bool
    reasons: list[str]
    capabilities: str | None


def _cmd_list(args: argparse.Namespace) -> int:
    rows: list[_Row] = []
    for name in registry.names():
        reg = registry.registration(name)
        reasons = registry.unavailable(name)
        caps = registry.capabilities(name)
        listing = getattr(registry.backend_class(name), "listing", None) if caps is not None else None
        rows.append(
            {
                "name": name,
                "distribution": reg.distribution or reg.plugin,
                "version": reg.version or "",
                "priority": reg.priority,
                "available": not reasons,
                "reasons": reasons,
                "capabilities": listing or (caps.summary() if caps else None),
            }
        )
    problems = [{"source": p.source, "stage": p.stage, "message": p.message} for p in registry.problems()]
    # The project's backends that are not here at all, with what installs each: a backend that
    # cannot run on this machine because it is missing is one to list, with its fix.
    missing = [{"name": n, "install": cmd} for n, cmd in registry.not_installed().items()]
    left_out = registry.left_out()
    # Installed but narrowed away is not "not installed": pip install would change nothing.
    # Listing nothing for that reason is a misconfiguration, so the exit status says so too.
    code = 1 if left_out and not rows else 0
    if args.json:
        data = {"backends": rows, "not_installed": missing, "left_out": left_out, "problems": problems}
        json.dump(data, sys.stdout, indent=2)
        print()
        return code
    if not rows and left_out:
        example = "reference" if "reference" in left_out else left_out[0]
        print(
            f"No backends loaded: {registry.narrowing()} leaves out the installed plugins "
            f"{', '.join(left_out)}. To fix: name the plugins to load, such as "
            f"{registry.env_var}={example}, or unset {registry.env_var}."
        )
    elif not rows:
        print(f"No backends registered. Install one: {FIRST_PARTY['triton-unified']}")
    width = max([len(r["name"]) for r in rows] + [len(m["name"]) for m in missing] + [7])
    status_width = len("not installed") if missing else len("unavailable")
    for r in rows:
        dist = f"{r['distribution']} {r['version']}".strip()
        status = "available" if r["available"] else "unavailable"
        print(f"{r['name']:<{width}}  {status:<{status_width}}  {dist}".rstrip())
        if r["capabilities"]:
            print(f"{'':<{width}}  {r['capabilities']}")
        for reason in r["reasons"]:
            print(f"{'':<{width}}  ! {reason}")
    for m in missing:
        print(f"{m['name']:<{width}}  not installed")
        print(f"{'':<{width}}  ! to install: {m['install']}")
    if problems:
        print("\nProblems (these plugins were skipped; the others work):")
        for p in problems:
            print(f"  {p['source']} ({p['stage']}): {p['message']}")
    return code


def versions() -> list[tuple[str, str]]:
    """(distribution, version): paged-core first, then every other installed distribution named
    ``paged-*`` or registering a plugin in the registry's entry-point group, by name."""
    from . import __version__

    found: dict[str, tuple[str, str]] = {}
    for d in importlib.metadata.distributions():
        name = d.metadata["Name"] or ""
        key = name.lower().replace("_", "-")
        if key == "paged-core" or key in found:
            continue
        if key.startswith("paged-") or any(ep.group == registry.group for ep in d.entry_points):
            found[key] = (name, d.version)
    return [("paged-core", __version__), *(found[k] for k in sorted(found))]


class _VersionAction(argparse.Action):
    """``paged --version``: read the installed distributions only when asked."""

    def __init__(self, option_strings: list[str], dest: str = argparse.SUPPRESS, **kwargs: Any) -> None:
        super().__init__(option_strings, dest=dest, default=argparse.SUPPRESS, nargs=0, **kwargs)

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: Any,
        option_string: str | None = None,
    ) -> None:
        rows = versions()
        width = max(len(name) for name, _ in rows)
        print("\n".join(f"{name:<{width}}  {version}" for name, version in rows))
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged", description="Paged-attention backends behind one contract.")
    p.add_argument(
        "--version",
        action=_VersionAction,
        help="print the versions of paged-core and every installed paged distribution and plugin",
    )
    sub = p.add_subparsers(dest="command", required=True)

    ls = sub.add_parser("list", help="installed backends, their capabilities and problems")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=_cmd_list)

    # Every other command: the plugins' (a plugin that fails here is a problem `paged list` shows).
    registry.call_hook("register_commands", subparsers=sub)
    for name, dist in PROVIDERS.items():
        if name not in sub.choices:
            _add_missing(p, sub, name, dist)
    return p


def _add_missing(
    parser: argparse.ArgumentParser, sub: argparse._SubParsersAction[argparse.ArgumentParser], name: str, dist: str
) -> None:
    """A stand-in for command ``name`` that says why it is missing and what fixes it (exit 2)."""
    # prefix_chars no argument uses: `paged check --backend x` reaches the message, not
    # "unrecognized arguments".
    stub = sub.add_parser(name, help=f"(needs {dist}: {pip_install(dist)})", add_help=False, prefix_chars="\0")
    stub.add_argument("args", nargs="*", help=argparse.SUPPRESS)
    stub.set_defaults(func=lambda args: parser.error(_why_missing(name, dist)))


def _installed(dist: str) -> tuple[str, list[str]] | None:
    """``(version, its entry-point names in the plugin group)`` of distribution ``dist``, or None."""
    try:
        d = importlib.metadata.distribution(dist)
    except importlib.metadata.PackageNotFoundError:
        return None
    return d.version, sorted(ep.name for ep in d.entry_points if ep.group == registry.group)


def _why_missing(name: str, dist: str) -> str:
    found = _installed(dist)
    if found is None:
        return f"'{name}' is provided by {dist}, which is not installed. To fix: {pip_install(dist)}"
    version, plugins = found
    wanted = os.environ.get(registry.env_var)
    allow = {w.strip() for w in wanted.split(",") if w.strip()} if wanted else None
    left_out = [ep for ep in plugins if allow is not None and ep not in allow]
    if plugins and left_out == plugins:
        return (
            f"'{name}' is provided by {dist} {version}, whose plugin {left_out[0]!r} "
            f"{registry.env_var}={wanted!r} leaves out. To fix: add {left_out[0]} to "
            f"{registry.env_var}, or unset {registry.env_var}"
        )
    failed = [str(p) for p in registry.problems() if p.source in plugins]
    if failed:
        return f"'{name}' is provided by {dist} {version}, but its plugin failed: " + "; ".join(failed)
    return (
        f"'{name}' is provided by {dist}, but the installed {dist} {version} registers no "
        f"'{name}' command. To fix: {pip_install('--force-reinstall ' + dist)}"
    )


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    func = getattr(args, "func", None)
    if func is None:  # a plugin added the command, then raised before it set func
        failed = "; ".join(str(p) for p in registry.problems() if p.stage == "register_commands")
        parser.error(f"'{args.command}' did not finish registering: {failed or 'no func was set'}")
    return func(args)
