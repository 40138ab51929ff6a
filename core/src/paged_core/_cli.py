"""The ``paged`` command line: ``list``, ``check`` and ``bench``."""

from __future__ import annotations

import argparse
import json
import sys

from ._registry import registry

__all__ = ["main"]


def _cmd_list(args: argparse.Namespace) -> int:
    rows = []
    for name in registry.names():
        reg = registry.registration(name)
        reasons = registry.unavailable(name)
        caps = registry.capabilities(name)
        rows.append({
            "name": name,
            "distribution": reg.distribution or reg.plugin,
            "version": reg.version or "",
            "priority": reg.priority,
            "available": not reasons,
            "reasons": reasons,
            "capabilities": caps.summary() if caps else None,
        })
    problems = [{"source": p.source, "stage": p.stage, "message": p.message} for p in registry.problems()]
    if args.json:
        json.dump({"backends": rows, "problems": problems}, sys.stdout, indent=2)
        print()
        return 0
    if not rows:
        print("No backends registered. Install one: pip install 'paged-core[triton]'")
    width = max([len(r["name"]) for r in rows] + [7])
    for r in rows:
        dist = f"{r['distribution']} {r['version']}".strip()
        status = "available" if r["available"] else "unavailable"
        print(f"{r['name']:<{width}}  {status:<11}  {dist}")
        if r["capabilities"]:
            print(f"{'':<{width}}  {r['capabilities']}")
        for reason in r["reasons"]:
            print(f"{'':<{width}}  ! {reason}")
    if problems:
        print("\nProblems (these plugins were skipped; the others work):")
        for p in problems:
            print(f"  {p['source']} ({p['stage']}): {p['message']}")
    return 0


def _cmd_check(args: argparse.Namespace) -> int:
    try:
        from paged_conformance.runner import main as check_main
    except ImportError as exc:
        print(f"paged check needs the conformance suite ({exc}). To fix: pip install paged-conformance",
              file=sys.stderr)
        return 2
    return check_main(args)


def _cmd_bench(args: argparse.Namespace) -> int:
    from ._bench import main as bench_main

    return bench_main(args)


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="paged", description="Paged-attention backends behind one contract.")
    sub = p.add_subparsers(dest="command", required=True)

    ls = sub.add_parser("list", help="installed backends, their capabilities and problems")
    ls.add_argument("--json", action="store_true", help="print JSON instead of a table")
    ls.set_defaults(func=_cmd_list)

    ck = sub.add_parser("check", help="run the conformance cases on installed backends now")
    ck.add_argument("--backend", action="append", help="only this backend (repeatable or A,B)")
    ck.add_argument("--size", choices=["small", "full"], default=None,
                    help="case size: small (CPU default) or full (GPU default)")
    ck.add_argument("--case", action="append", help="only cases whose id contains this text")
    ck.add_argument("--report", default="conformance-report", help="report path without extension")
    ck.add_argument("--json", action="store_true", help="print the matrix as JSON")
    ck.add_argument("--merge", nargs="+", metavar="JSON",
                    help="run nothing: merge these reports of earlier runs (same size and device; for a "
                         "(backend, case, check) in several, the later file wins) into --report")
    ck.set_defaults(func=_cmd_check)

    from ._bench import add_arguments

    bn = sub.add_parser("bench", help="time installed backends against the bandwidth floor")
    add_arguments(bn)
    bn.set_defaults(func=_cmd_bench)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    return args.func(args)
