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
import io
import json
import os
import sys
from typing import Any, cast

import torch
from paged_conformance import blocks_needed, check_writable, output_tolerance
from paged_core import Backend, InputError, PagedError, Registry

from . import floor, report
from .cases import Case, build_cases
from .config import CPU_NOTE, DTYPES, Config, add_arguments, make_config, split_values
from .data import _bytes_per_token, free, materialize_safely
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

    def __init__(self, path: str | None, env: dict, cfg: Config, not_run: dict[str, str], registry: Registry) -> None:
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
    cases = build_cases(cfg)
    _check_fits(cfg, cases)
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


def _memory_bytes(device: torch.device) -> int | None:
    """The memory of ``device`` (the GPU's, or the host's RAM for the CPU); None if unknown."""
    try:
        if device.type == "cuda":
            return int(torch.cuda.get_device_properties(device).total_memory)
        return int(os.sysconf("SC_PAGE_SIZE")) * int(os.sysconf("SC_PHYS_PAGES"))
    except (AttributeError, OSError, ValueError, RuntimeError):
        return None


def _check_fits(cfg: Config, cases: list[Case]) -> None:
    """Refuse shape options with which not even the smallest case fits the device's memory: a
    PagedError naming the options, instead of an allocator error for every case. A single case
    too large for the device is still reported in its row (the others run)."""
    total = _memory_bytes(cfg.device)
    if total is None or not cases:
        return
    elem = torch.empty(0, dtype=cfg.dtype).element_size()

    def need(case: Case) -> tuple[int, int]:
        """(q and output bytes, K/V bytes) of ``case``."""
        qo = sum(case.query_lens) * cfg.heads * (cfg.head_dim + cfg.dim_v) * elem
        blocks = blocks_needed(case.seq_lens, cfg.block_size, shared_prefix_blocks=case.lengths.shared_prefix_blocks)
        return qo, blocks * cfg.block_size * _bytes_per_token(cfg, case)

    smallest = min(cases, key=lambda c: sum(need(c)))
    qo, kv = need(smallest)
    if qo + kv <= total:
        return
    dims = f"--head-dim {cfg.head_dim}" + ("" if cfg.dim_v == cfg.head_dim else f", --head-dim-v {cfg.dim_v}")
    if qo >= kv:
        what = f"q and the output ({sum(smallest.query_lens)} tokens x --heads {cfg.heads} x {dims})"
    else:
        what = f"the K/V cache (--kv-heads {cfg.kv_heads} x {dims}, blocks of --block-size {cfg.block_size})"
    raise PagedError(
        f"the sizes are too large: the smallest case, {smallest.id}, needs {(qo + kv) / 1e9:.3g} GB, mostly "
        f"{what}, and {cfg.device} has {total / 1e9:.3g} GB; accepted: sizes whose cases fit (lower "
        "--heads, --kv-heads or --head-dim, or leave them at their defaults)"
    )


def replay(path: str, plot: str | None = None) -> dict:
    """The table (and with ``plot`` the sweep's plot) of a run recorded with ``--json``; times nothing."""
    result, env, cfg, cases, rows = _read_run(path)
    if not result.get("complete", True):
        print(f"(a run cut short: {path} holds the cases it finished)")
    # Rendered whole before printing: a field of the wrong kind deep in the file is refused
    # like the others, without half a table above the message.
    table = io.StringIO()
    try:
        report.print_table(env, cfg, cases, rows, result.get("not_run") or {}, out=table)
    except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
        raise _not_a_run(path, f"the table could not be printed from it: {short(exc)}") from exc
    sys.stdout.write(table.getvalue())
    if plot:
        try:
            err = report.plot(plot, env, cfg, rows)
        except (AttributeError, KeyError, TypeError, ValueError, IndexError) as exc:
            raise _not_a_run(path, f"its sweep could not be plotted: {short(exc)}") from exc
        print(f"plot not written: {err}" if err else f"wrote {plot}")
        result["plot_error"] = err
    return result


def _not_a_run(path: str, what: str) -> InputError:
    return InputError(
        f"--from-json {path}: not a run written by paged bench --json ({what}); accepted: the file "
        "that `paged bench --json PATH` wrote (run it again to get one)"
    )


def _read_run(path: str) -> tuple[dict, dict, Config, list[dict], list[Row]]:
    """``(result, env, cfg, cases, rows)`` of a ``--json`` file, or an :class:`InputError` that
    says what in it is not what ``paged bench --json`` writes."""
    try:
        with open(path) as f:
            result = json.load(f)
    except (OSError, ValueError) as exc:
        raise _not_a_run(path, short(exc)) from exc
    if not isinstance(result, dict):
        raise _not_a_run(path, f"it holds a JSON {type(result).__name__}, not an object")
    kinds = {"env": dict, "config": dict, "cases": list, "rows": list}
    for key, kind in kinds.items():
        if not isinstance(result.get(key), kind):
            found = "missing" if key not in result else f"a {type(result[key]).__name__}"
            raise _not_a_run(path, f"{key!r} is {found}; accepted: a JSON {'object' if kind is dict else 'list'}")
    env, conf, cases, raw_rows = result["env"], result["config"], result["cases"], result["rows"]
    missing = [k for k in report.ENV_PRINTED if k not in env]
    if missing:
        raise _not_a_run(path, f"env has no {', '.join(missing)}")
    for key, items, needed in (("cases", cases, ("id", "kind", "group")), ("rows", raw_rows, ())):
        for i, item in enumerate(items):
            if not isinstance(item, dict):
                raise _not_a_run(path, f"{key}[{i}] is {item!r}; accepted: a JSON object")
            lacks = [k for k in needed if k not in item]
            if lacks:
                raise _not_a_run(path, f"{key}[{i}] has no {', '.join(lacks)}")
    fields = {f.name for f in dataclasses.fields(Row)}
    try:
        rows = [Row(**{k: v for k, v in r.items() if k in fields}) for r in raw_rows]
    except TypeError as exc:
        raise _not_a_run(path, f"a row lacks a field: {short(exc)}") from exc
    ids = {c["id"] for c in cases}
    unknown = sorted({str(r.case) for r in rows if r.case not in ids})
    if unknown:
        raise _not_a_run(path, f"rows of cases it does not describe: {', '.join(unknown)}")
    conf = {k: v for k, v in conf.items() if k in {f.name for f in dataclasses.fields(Config)}}
    if conf.get("dtype") not in DTYPES:
        raise _not_a_run(path, f"config.dtype is {conf.get('dtype')!r}; accepted: {', '.join(sorted(DTYPES))}")
    try:
        # The recorded device need not exist here (a GPU run printed on a laptop): only its name is read.
        device = torch.device(cast(str, conf.get("device")))  # whatever it is: a bad one raises
    except (RuntimeError, TypeError) as exc:
        raise _not_a_run(
            path, f"config.device is {conf.get('device')!r}, not a device name such as 'cuda:0' or 'cpu'"
        ) from exc
    try:
        cfg = Config(**{**conf, "device": device, "dtype": DTYPES[conf["dtype"]]})
    except TypeError as exc:
        raise _not_a_run(path, f"config lacks a field: {short(exc)}") from exc
    return result, env, cfg, cases, rows


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
