"""``paged tune``: time the installed backends on this machine and write the table ``auto`` reads.

It runs ``paged bench`` (the same cases, options and checks: a backend whose result is wrong is
never timed, so never chosen) and keeps, for every case, each backend's time as one entry of the
tune table (``paged_core.TuneTable``): the batch's class (decode: requests x longest sequence;
mixed: tokens x longest sequence) and the layer it ran. ``--from-json RUN`` makes the table from a
run recorded with ``paged bench --json`` instead of timing anything.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from paged_core import AttentionSpec, InputError, PagedError, TuneTable, tune_table_path
from paged_core._auto import TuneEntry, layer_key

from . import cli
from .config import DTYPES

__all__ = ["add_arguments", "main", "table_from_run"]

#: How ``paged bench --json`` names a case's scales, as the spec's ``kv_scales``.
_SCALES = {"per_slot": "per_slot", "static": "per_tensor"}


def add_arguments(p: argparse.ArgumentParser) -> None:
    cli.add_arguments(p)
    p.add_argument(
        "--out",
        metavar="PATH",
        help="where to write the table (default: $PAGED_TUNE_TABLE, else ~/.cache/paged/tune/<device>.json, "
        "where auto reads it)",
    )


def table_from_run(result: dict[str, Any]) -> TuneTable:
    """The tune table of a ``paged bench`` result (what ``--json`` writes): one entry per case with
    each backend's plain row that passed its check and was timed."""
    try:
        cfg, env = result["config"], result["env"]
        dtype = DTYPES[cfg["dtype"]]
        by_case: dict[str, dict[str, float]] = {}
        for row in result["rows"]:
            if row["paged"] and row["label"] == row["backend"] and row["status"] == "ok" and row["ms"] is not None:
                by_case.setdefault(row["case"], {})[row["backend"]] = float(row["ms"])
        entries = []
        for case in result["cases"]:
            ms = by_case.get(case["id"])
            if not ms or "error" in case:
                continue
            spec = AttentionSpec(
                num_heads=cfg["heads"],
                num_kv_heads=cfg["kv_heads"],
                head_dim=cfg["head_dim"],
                head_dim_v=cfg.get("head_dim_v"),
                block_size=cfg["block_size"],
                dtype=dtype,
                kv_dtype=case["kv_dtype"],
                kv_scales=_SCALES[case["kv_scales"]],
            )
            decode = case["num_tokens"] == case["num_reqs"]
            kind, size = ("decode", case["num_reqs"]) if decode else ("mixed", case["num_tokens"])
            entries.append(TuneEntry(kind, layer_key(spec), size, case["max_seq_len"], ms))
    except (KeyError, TypeError, ValueError) as exc:
        raise InputError(
            f"not a run written by paged bench --json ({type(exc).__name__}: {exc}); accepted: the file "
            "that `paged bench --json PATH` wrote"
        ) from exc
    # The name auto looks its table up by (paged_core._auto.device_name): "cpu", or the GPU's.
    name = "cpu" if str(cfg["device"]).startswith("cpu") else env["device_name"]
    return TuneTable(name, tuple(entries))


def main(args: argparse.Namespace) -> int:
    """``paged tune``. Exit status 0; 1 if a backend was WRONG or raised (it is left out of the
    table); 2 on bad options or input."""
    try:
        for option in ("json", "out"):
            if getattr(args, option, None):
                cli.check_writable(f"--{option}", getattr(args, option))
        if args.from_json:
            try:
                with open(args.from_json) as f:
                    result = json.load(f)
            except (OSError, ValueError) as exc:
                raise InputError(
                    f"--from-json {args.from_json}: {exc}; accepted: a file paged bench --json wrote"
                ) from exc
            if not isinstance(result, dict):
                raise InputError(f"--from-json {args.from_json}: not a run written by paged bench --json")
        else:
            result = cli.run(args)
        table = table_from_run(result)
        if not table.entries:
            raise InputError(
                "no backend was timed on any case, so there is no table to write (the table above says why)"
            )
    except PagedError as exc:
        print(f"paged tune: {exc}", file=sys.stderr)
        return 2
    path = args.out or tune_table_path(table.device_name)
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    with open(path, "w") as f:
        json.dump({**table.to_json(), "measured": _measured(result)}, f, indent=2)
    print(f"\nauto's choices ({table.device_name}):")
    for e in table.entries:
        best = e.fastest(sorted(e.ms))
        if best is not None:
            print(f"  {e.kind:6s} {e.size:>6d} x {e.context:<7d} {e.layer:40s} {best} ({e.ms[best]:.4g} ms)")
    print(f"wrote {path}")
    bad = [r for r in result["rows"] if r["status"].startswith(("WRONG", "error"))]
    return 1 if bad else 0


def _measured(result: dict[str, Any]) -> dict[str, Any]:
    env = result.get("env", {})
    return {k: env.get(k) for k in ("date", "device_name", "torch", "triton", "backends")}
