"""``paged bench``: every installed backend, side by side, against the bandwidth floor.

For each case the batch (random, non-contiguous blocks) and the cache (random data, never zeros)
are built once; then, in this one process, every backend in turn:

1. is skipped with its own reasons if it cannot serve the case's :class:`AttentionSpec`;
2. plans once (outside the timed region; a nontrivial ``plan`` is timed on its own);
3. runs once into a NaN-poisoned output, which is **checked against the reference** (float32, on
   a subset of the requests): a wrong answer is reported ``WRONG`` and never timed;
4. is timed: ``triton.testing.do_bench`` (median, L2 flushed before each repetition), CUDA events
   without Triton, a host clock on the CPU.

The floors come from the same run: the read bandwidth of a streaming-read kernel and the dense
matrix rate (see :mod:`.floor`). Each row reports ms, GB/s of the K/V (and scales, Q and O) the
batch must move, the percentage of the bandwidth floor, TFLOP/s where the case computes, and the
ratio to the fastest row of the case. PyTorch's ``scaled_dot_product_attention`` (flash and
cuDNN) on the same data laid out contiguously runs beside them, labelled non-paged.

The correctness check uses the suite's output tolerances (``paged_conformance.output_tolerance``)
and the cases' per-request lengths are the suite's ``paged_conformance.Batch``; the batches
themselves are the benchmark's own (large, timed), not the suite's (small, exhaustive).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
from typing import Any

import torch
from paged_conformance import check_writable, output_tolerance
from paged_core import Backend, InputError, PagedError, Registry

from . import floor, report
from .cases import Case, build_cases
from .config import CPU_NOTE, DTYPES, Config, add_arguments, make_config, split_values
from .data import free, materialize_safely
from .rows import PRODUCERS, SDPA_BASELINES, Lineup, Row, short, tolerance_label

__all__ = ["add_arguments", "main", "replay", "run"]


def _progress(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _case_progress(step: str, case: Case, text: str, label: str | None = None) -> None:
    """The progress line of one result of a case: ``step`` is ``[i/n]``, ``label`` the row's."""
    _progress(f"{step} {case.id:<16} {case.shape:<14} " + ("" if label is None else f"{label:<24} ") + text)


def _outcome(row: Row) -> str:
    return f"{row.ms:.4f} ms" if row.status == "ok" else row.status[:140]


def _lineup(args: argparse.Namespace, cfg: Config, registry: Registry) -> tuple[Lineup, dict, dict[str, str]]:
    """The backends and baselines to run, their versions, and why the others asked for do not run."""
    asked = split_values(args.backend)
    names = registry.names()
    baselines = [] if args.no_baselines else [b for b in SDPA_BASELINES if not asked or b in asked]
    not_run: dict[str, str] = {}
    if cfg.device.type != "cuda" and "sdpa-cudnn" in baselines:
        baselines.remove("sdpa-cudnn")
        not_run["sdpa-cudnn"] = "cuDNN attention needs a CUDA device"
    if asked:
        missing = [a for a in asked if a not in names and a not in SDPA_BASELINES]
        if missing:
            registry.registration(missing[0])  # raises BackendNotFoundError: which, and what to install
        chosen = [a for a in asked if a in names]
    else:
        chosen = [n for n in names if not (n == "reference" and cfg.device.type == "cuda")]
    if not asked and "reference" in names and cfg.device.type == "cuda":
        not_run["reference"] = "the oracle (host loops, slow) is not timed on a GPU; --backend reference times it"
    backends: dict[str, Backend] = {}
    versions: dict[str, Any] = {}
    for name in chosen:
        reg = registry.registration(name)
        versions[name] = {"distribution": reg.distribution or reg.plugin, "version": reg.version}
        try:
            reasons = registry.unavailable(name)
            if reasons:
                not_run[name] = "; ".join(reasons)
                continue
            backends[name] = registry.get(name)
        except Exception as exc:
            not_run[name] = short(exc)
    return Lineup(cfg, registry, backends, baselines), versions, not_run


class _Record:
    """The result of a run (what ``--json`` writes), rewritten after every case: a run cut short
    still leaves its results."""

    def __init__(self, path: str | None, env: dict, cfg: Config, not_run: dict[str, str], registry: Registry):
        self.path, self.not_run, self.registry = path, not_run, registry
        self.cases: list[dict] = []
        self.rows: list[Row] = []
        self.result: dict[str, Any] = {"env": env, "config": cfg.public(), "complete": False}

    def add(self, case_info: dict, rows: list[Row]) -> None:
        self.cases.append(case_info)
        self.rows.extend(rows)
        self.snapshot(False)

    def snapshot(self, complete: bool) -> dict:
        self.result.update(
            cases=self.cases,
            rows=[dataclasses.asdict(r) for r in self.rows],
            not_run=self.not_run,
            complete=complete,
            problems=[{"source": p.source, "stage": p.stage, "message": p.message} for p in self.registry.problems()],
        )
        if self.path:
            os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
            with open(self.path, "w") as f:
                json.dump(self.result, f, indent=2, default=str)
        return self.result


def run(args: argparse.Namespace, *, registry: Registry | None = None) -> dict:
    """Run the benchmark and return everything (what ``--json`` writes); prints the table."""
    if not torch.cuda.is_available() and "TRITON_INTERPRET" not in os.environ:
        # No GPU: the Triton backends can only run under Triton's interpreter (set before any
        # kernel module is imported, which happens lazily in registry.get below). With
        # --device cpu on a GPU machine it stays off: Triton backends then skip with their reason.
        os.environ["TRITON_INTERPRET"] = "1"
    if registry is None:
        from paged_core import registry as default_registry

        registry = default_registry
    cfg = make_config(args)
    lineup, versions, not_run = _lineup(args, cfg, registry)
    for name, why in not_run.items():
        _progress(f"[bench] {name}: not run: {why}")

    _progress(f"[bench] device {cfg.device}; measuring the read bandwidth and the matmul rate ...")
    bw = floor.read_bandwidth(cfg.device, gbytes=1.0 if cfg.quick else 4.0)
    mm = floor.matmul_rate(cfg.device, cfg.dtype)
    env = report.make_env(cfg, bw, mm, versions)
    _progress(
        f"[bench] read {bw['value'] / 1e9:.0f} GB/s ({bw['method']}); "
        f"matmul {mm['value'] / 1e12:.1f} TFLOP/s ({mm['method']})"
    )
    if cfg.device.type != "cuda":
        _progress(f"[bench] {CPU_NOTE}; Triton backends run under TRITON_INTERPRET=1 (slow)")

    cases = build_cases(cfg)
    record = _Record(args.json, env, cfg, not_run, registry)
    for i, (case, data) in enumerate(materialize_safely(cfg, cases)):
        step = f"[{i + 1}/{len(cases)}]"
        if isinstance(data, BaseException):
            msg = f"error: building the case failed: {short(data)}"
            _case_progress(step, case, msg)
            record.add(
                report.failed_case_record(case, msg),
                [Row.of(case, "-", "-", True, status=msg)],
            )
            continue
        info = report.case_record(cfg, case, data)
        tol = output_tolerance(cfg.dtype, case.kv_dtype)
        info["tolerance"] = tolerance_label(tol)
        rows: list[Row] = []
        for produce in PRODUCERS:
            for row in produce(lineup, case, data, tol):
                rows.append(row)
                _case_progress(step, case, _outcome(row), row.label)
        report.metrics(rows, info, bw["value"], mm["value"])
        del data
        record.add(info, rows)
    free(cfg.device)

    result = record.snapshot(True)
    report.print_table(env, cfg, record.cases, record.rows, not_run)
    if args.json:
        print(f"wrote {args.json}")
    if args.plot:
        err = report.plot(args.plot, env, cfg, record.rows)
        print(f"plot not written: {err}" if err else f"wrote {args.plot}")
        result["plot_error"] = err
    return result


def replay(path: str, plot: str | None = None) -> dict:
    """The table (and with ``plot`` the sweep's plot) of a run recorded with ``--json``; times nothing."""
    try:
        with open(path) as f:
            result = json.load(f)
        env, conf, cases, rows = result["env"], result["config"], result["cases"], result["rows"]
        fields = {f.name for f in dataclasses.fields(Row)}
        rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in rows]
        conf = {k: v for k, v in conf.items() if k in {f.name for f in dataclasses.fields(Config)}}
        cfg = Config(**{**conf, "device": torch.device(conf["device"]), "dtype": DTYPES[conf["dtype"]]})
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise InputError(f"--from-json {path}: not a run written by paged bench --json ({short(exc)})") from exc
    if not result.get("complete", True):
        print(f"(a run cut short: {path} holds the cases it finished)")
    report.print_table(env, cfg, cases, rows, result.get("not_run", {}))
    if plot:
        err = report.plot(plot, env, cfg, rows)
        print(f"plot not written: {err}" if err else f"wrote {plot}")
        result["plot_error"] = err
    return result


def main(args: argparse.Namespace, *, registry: Registry | None = None) -> int:
    """``paged bench``. Exit status 0; 1 if any backend was WRONG or raised; 2 on bad options."""
    try:
        for option in ("json", "plot"):
            if getattr(args, option, None):
                check_writable(f"--{option}", getattr(args, option))
        if getattr(args, "from_json", None):
            result = replay(args.from_json, args.plot)
        else:
            result = run(args, registry=registry)
    except PagedError as exc:
        print(f"paged bench: {exc}", file=sys.stderr)
        return 2
    bad = [r for r in result["rows"] if r["status"].startswith(("WRONG", "error"))]
    if bad:
        print(f"paged bench: {len(bad)} result(s) WRONG or failed (see status); they were not timed", file=sys.stderr)
        return 1
    return 0
