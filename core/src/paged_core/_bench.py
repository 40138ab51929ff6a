"""``paged bench``: placeholder until the benchmark lands (issue: paged bench)."""

from __future__ import annotations

import argparse


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backend", action="append", help="only these backends (repeatable or A,B)")


def main(args: argparse.Namespace) -> int:
    print("paged bench is not implemented yet")
    return 2
