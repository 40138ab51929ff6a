"""``paged check``: the conformance checks without pytest, with progress and a verdict table.

It runs exactly what ``pytest --pyargs paged_conformance`` runs (the same cases, the same check
functions, the same skip decisions), so the two agree on every cell.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import traceback
from collections.abc import Sequence
from typing import TextIO

import torch
from paged_core import InputError, PagedError, Registry

from . import checks
from .backends import BackendPool, parse_backend_names, use_triton_interpreter_on_cpu
from .cases import SIZES, Case, default_device, default_size
from .cases import cases as all_cases
from .report import FAIL, PASS, SKIP, Matrix, Outcome, check_writable, report_paths
from .tolerances import ConformanceFailure

__all__ = ["add_arguments", "main", "merge", "run"]


def _one(pool: BackendPool, backend: str, check: str, case: Case | None, device: torch.device, size: str) -> Outcome:
    case_id = case.id if case is not None else checks.RANDOM_BATCHES
    start = time.perf_counter()
    try:
        result = checks.run(pool, backend, check, case, device, size)
    except checks.NotApplicable as exc:
        return Outcome(backend, case_id, check, SKIP, str(exc), seconds=time.perf_counter() - start)
    except ConformanceFailure as exc:
        return Outcome(backend, case_id, check, FAIL, str(exc), exc.max_error, time.perf_counter() - start)
    except Exception as exc:  # a crash is a failure of that cell, never of the whole run
        msg = f"[{backend}/{case_id}] {check} raised {type(exc).__name__}: {exc}\n{traceback.format_exc()}"
        return Outcome(backend, case_id, check, FAIL, msg, None, time.perf_counter() - start)
    return Outcome(
        backend,
        case_id,
        check,
        PASS,
        result.note,
        result.max_error,
        time.perf_counter() - start,
        block_size=result.block_size,
    )


def run(
    backends: Sequence[str] | None = None,
    *,
    size: str | None = None,
    case_filter: Sequence[str] | None = None,
    device: torch.device | str | None = None,
    registry: Registry | None = None,
    progress: TextIO | bool = True,
) -> Matrix:
    """Run every check of every selected backend on every selected case; return the matrix.

    ``backends``: names (entries may be ``"a,b"``), default ``$PAGED_BACKENDS`` or every
    registered backend. ``case_filter``: substrings of case ids (``random_batches`` included).
    ``progress``: where to print one line per (backend, case): True for stderr, False for nowhere.
    """
    stream = sys.stderr if progress is True else progress or None
    use_triton_interpreter_on_cpu()
    size = size or default_size()
    device = torch.device(device) if device is not None else default_device()
    pool = BackendPool(parse_backend_names(backends), registry=registry)
    selected = [c for c in all_cases(size) if not case_filter or any(f in c.id for f in case_filter)]
    with_random = not case_filter or any(f in checks.RANDOM_BATCHES for f in case_filter)
    if not selected and not with_random:
        ids = [c.id for c in all_cases(size)] + [checks.RANDOM_BATCHES]
        raise InputError(f"no case id contains {' or '.join(map(repr, case_filter or ()))}; case ids: {', '.join(ids)}")
    matrix = Matrix(
        size=size,
        device=str(device),
        backends={b: pool.unavailable(b) for b in pool.names},
        problems=pool.problems(),
        expected_checks=expected_checks(size),
    )
    # The counter counts the (backend, case) pairs that run. A backend that runs none (unavailable
    # here) gets one line, first and uncounted ("-"), so the counter starts at 1.
    idle = [b for b in pool.names if pool.unavailable(b)]
    total = (len(pool.names) - len(idle)) * (len(selected) + with_random)
    done = 0

    def say(backend: str, case_id: str, outs: list[Outcome], *, counted: bool = True) -> None:
        nonlocal done
        done += counted
        if stream is None:
            return
        statuses = {o.status for o in outs}
        verdict = FAIL.upper() if FAIL in statuses else PASS if PASS in statuses else SKIP
        secs = sum(o.seconds for o in outs)
        detail = ""
        if verdict == SKIP:
            detail = outs[0].message.splitlines()[0][:80]
        elif verdict == FAIL.upper():
            detail = "; ".join(f"{o.check}" for o in outs if o.status == FAIL)
        counter = done if counted else "-"
        print(
            f"[{counter:>{len(str(total))}}/{total}] {backend:<16} {case_id:<34} {verdict:<4} "
            f"{secs:6.2f}s  {detail}".rstrip(),
            file=stream,
            flush=True,
        )

    for backend in idle:
        unavailable = pool.unavailable(backend)
        # Every cell has the same outcome: one progress line, not one per case. Skipped for the
        # backend's reasons, or failed when it was named and cannot even be imported.
        refused = pool.refused(backend)
        status = SKIP if refused is None else FAIL
        for case in selected:
            for check in checks.applicable_checks(case):
                message = "; ".join(unavailable) if refused is None else f"[{backend}/{case.id}] {refused}"
                matrix.add(Outcome(backend, case.id, check, status, message))
        if with_random:
            message = "; ".join(unavailable) if refused is None else f"[{backend}/{checks.RANDOM_BATCHES}] {refused}"
            matrix.add(Outcome(backend, checks.RANDOM_BATCHES, checks.RANDOM_BATCHES, status, message))
        say(backend, "(every case)", [matrix.outcomes[-1]], counted=False)
    for backend in pool.names:
        if backend in idle:
            continue
        for case in selected:
            outs = [_one(pool, backend, check, case, device, size) for check in checks.applicable_checks(case)]
            for o in outs:
                matrix.add(o)
            say(backend, case.id, outs)
        if with_random:
            o = _one(pool, backend, checks.RANDOM_BATCHES, None, device, size)
            matrix.add(o)
            say(backend, checks.RANDOM_BATCHES, [o])
    return matrix


def expected_checks(size: str) -> dict[str, int]:
    """Case id -> the number of checks that apply to it (``random_batches``: 1)."""
    return {**{c.id: len(checks.applicable_checks(c)) for c in all_cases(size)}, checks.RANDOM_BATCHES: 1}


def merge(paths: Sequence[str]) -> Matrix:
    """The reports at ``paths`` (``.json``) as one matrix, in the case table's order."""
    matrices = []
    for path in paths:
        try:
            with open(path) as f:
                matrices.append(Matrix.from_json(json.load(f)))
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise InputError(
                f"{path} is not a readable conformance report (.json written by paged check "
                f"or pytest --paged-report): {type(exc).__name__}: {exc}"
            ) from None
    sizes = {m.size for m in matrices}
    order = None
    if len(sizes) == 1 and (size := sizes.pop()) in SIZES:
        order = [c.id for c in all_cases(size)] + [checks.RANDOM_BATCHES]
        for m in matrices:
            m.expected_checks = m.expected_checks or expected_checks(size)
    try:
        return Matrix.merged(matrices, case_order=order)
    except ValueError as exc:
        raise InputError(str(exc)) from None


def add_arguments(p: argparse.ArgumentParser) -> None:
    """The options of ``paged check``."""
    p.description = (
        "Run the conformance cases on every installed backend (or --backend A,B) now and "
        "print the backend x case verdict table; writes the report as Markdown and JSON."
    )
    p.add_argument(
        "--backend",
        "--backends",
        action="append",
        help="only this backend (repeatable or A,B; --backends as in pytest's option)",
    )
    p.add_argument(
        "--size", choices=["small", "full"], default=None, help="case size: small (CPU default) or full (GPU default)"
    )
    p.add_argument("--case", action="append", help="only cases whose id contains this text")
    p.add_argument("--report", default="conformance-report", help="report path without extension")
    p.add_argument("--json", action="store_true", help="print the matrix as JSON")
    p.add_argument(
        "--merge",
        nargs="+",
        metavar="JSON",
        help="run nothing: merge these reports of earlier runs (same size and device; for a "
        "(backend, case, check) in several, the later file wins) into --report",
    )


def main(args: argparse.Namespace) -> int:
    """``paged check`` (registered by :mod:`.commands`): 0 if nothing failed, 1 if something did,
    2 on a usage error."""
    started = time.perf_counter()
    report = getattr(args, "report", None) or "conformance-report"
    try:
        for path in report_paths(report):
            check_writable("--report", path)
        if getattr(args, "merge", None):
            matrix = merge(args.merge)
        else:
            matrix = run(
                getattr(args, "backend", None),
                size=getattr(args, "size", None),
                case_filter=getattr(args, "case", None),
            )
    except PagedError as exc:  # an unknown backend or case, an unreadable report: a usage error
        print(f"paged check: {exc}", file=sys.stderr)
        return 2
    md, js = matrix.write(report)
    if getattr(args, "json", False):
        json.dump(matrix.to_json(), sys.stdout, indent=2)
        print()
    else:
        print(matrix.to_text())
        print(f"Report: {md} and {js} ({time.perf_counter() - started:.0f} s)")
    return 1 if matrix.failed else 0
