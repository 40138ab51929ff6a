"""What a run reports: the floors and rates of each row, the run's environment, the records
``--json`` writes, the table and the sweep's plot."""

from __future__ import annotations

import datetime
import os
import platform
import sys
from typing import Any, TextIO

import torch

from .cases import Case
from .config import CPU_NOTE, Config, dtype_name
from .data import CaseData, pool_bytes
from .rows import Row, short
from .timing import HOST_CALLS

__all__ = ["case_record", "failed_case_record", "format_ratios", "make_env", "metrics", "plot", "print_table"]


def metrics(rows: list[Row], case_info: dict, bw: float, mm: float) -> None:
    """The case's floors (bytes / read bandwidth ``bw``, FLOPs / matmul rate ``mm``) into
    ``case_info``, and each timed row's GB/s, TFLOP/s, % of the floors and ratio to the fastest."""
    total_bytes = case_info["kv_bytes"] + case_info["qo_bytes"]
    floor_bw = total_bytes / bw * 1000
    floor_mm = case_info["flops"] / mm * 1000
    case_info.update(floor_ms_bw=floor_bw, floor_ms_mm=floor_mm, floor_ms=max(floor_bw, floor_mm), bytes=total_bytes)
    ok = [(r, r.ms) for r in rows if r.status == "ok" and r.ms]
    best = min((ms for _, ms in ok), default=None)
    for r, ms in ok:
        s = ms / 1000
        r.gbps = total_bytes / s / 1e9
        r.pct_bw_floor = 100 * floor_bw / ms
        r.tflops = case_info["flops"] / s / 1e12
        r.pct_mm_floor = 100 * floor_mm / ms
        r.pct_floor = 100 * max(floor_bw, floor_mm) / ms
        r.x_fastest = ms / best if best else None


def case_record(cfg: Config, case: Case, data: CaseData) -> dict:
    """What ``--json`` records of a case (:func:`metrics` adds its floors)."""
    return {
        "id": case.id,
        "kind": case.kind,
        "shape": case.shape,
        "group": case.group,
        "batch": case.batch,
        "description": case.description,
        "num_reqs": len(case.seq_lens),
        "num_tokens": sum(case.query_lens),
        "max_seq_len": max(case.seq_lens),
        "total_context": sum(case.seq_lens),
        "kv_dtype": case.kv_dtype,
        "kv_scales": "static" if case.static_scales else "per_slot",
        "prefix_tokens": case.lengths.shared_prefix_blocks * cfg.block_size,
        "kv_bytes": data.kv_bytes,
        "kv_bytes_logical": data.kv_bytes_logical,
        "qo_bytes": data.qo_bytes,
        "flops": data.flops,
        "checked_requests": data.checked_reqs,
        "pool_bytes": pool_bytes(data.cache),
    }


def failed_case_record(case: Case, error: str) -> dict:
    """What ``--json`` records of a case that could not be built."""
    return {
        "id": case.id,
        "kind": case.kind,
        "shape": case.shape,
        "group": case.group,
        "batch": case.batch,
        "description": case.description,
        "error": error,
    }


#: The ``env`` fields :func:`print_table` reads (``--from-json`` checks a file has them).
ENV_PRINTED = (
    "device_name",
    "torch",
    "triton",
    "date",
    "read_bandwidth_Bps",
    "read_bandwidth_method",
    "matmul_flops",
    "matmul_method",
)


def make_env(cfg: Config, bw: dict, mm: dict, backends: dict) -> dict:
    """The machine, the versions and the ceilings of this run (the JSON's ``env``)."""
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.UTC).isoformat(timespec="seconds"),
        "host": platform.node(),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "device": str(cfg.device),
        "device_name": "CPU (" + (platform.processor() or platform.machine()) + ")",
        "triton": None,
        "triton_interpret": os.environ.get("TRITON_INTERPRET") == "1",
        "read_bandwidth_Bps": bw["value"],
        "read_bandwidth_method": bw["method"],
        "read_bandwidth_all_GBps": bw.get("all"),
        "matmul_flops": mm["value"],
        "matmul_method": mm["method"],
        "backends": backends,
        "cpu_note": CPU_NOTE if cfg.device.type != "cuda" else None,
    }
    if "triton_error" in bw:
        env["read_bandwidth_triton_error"] = bw["triton_error"]
    try:
        import triton

        env["triton"] = triton.__version__
    except Exception:
        pass
    if cfg.device.type == "cuda":
        p = torch.cuda.get_device_properties(cfg.device)
        env.update(
            device_name=p.name,
            capability=f"sm_{p.major}{p.minor}",
            sms=p.multi_processor_count,
            memory_GB=round(p.total_memory / 1e9, 1),
            l2_MB=round(getattr(p, "L2_cache_size", 0) / 1e6, 1),
            driver=_driver(),
        )
    return env


def _driver() -> str | None:
    try:
        import subprocess

        r = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True,
            text=True,
            timeout=10,
        )
        return r.stdout.strip().splitlines()[0] if r.returncode == 0 and r.stdout.strip() else None
    except Exception:
        return None


def _fmt(v: float | None, width: int, digits: int = 1, suffix: str = "") -> str:
    """Right-aligned number (more decimals for small values), or "-"."""
    if v is None:
        return "-".rjust(width)
    if 0 < abs(v) < 0.01:
        s = f"{v:.1e}"
    elif 0 < abs(v) < 10**-digits * 100:
        s = f"{v:.3g}"
    else:
        s = f"{v:.{max(digits, 0)}f}"
    return (s + suffix).rjust(width)


def print_table(
    env: dict, cfg: Config, cases: list[dict], rows: list[Row], not_run: dict, out: TextIO | None = None
) -> None:
    """The table of a run (timed now or read back from ``--json``) on ``out`` (stdout)."""
    w = (out or sys.stdout).write
    w(
        f"paged bench — {env['device_name']} · torch {env['torch']}"
        + (f" (CUDA {env['cuda']})" if env.get("cuda") and cfg.device.type == "cuda" else "")
        + f" · triton {env['triton'] or 'absent'} · {env['date']}\n"
    )
    w(
        f"floor: read {env['read_bandwidth_Bps'] / 1e12:.3f} TB/s ({env['read_bandwidth_method']}) · "
        f"matmul {env['matmul_flops'] / 1e12:.1f} TFLOP/s ({env['matmul_method']})\n"
    )
    dims = f"{cfg.head_dim}" + ("" if cfg.dim_v == cfg.head_dim else f" (V {cfg.dim_v})")
    w(
        f"shape: {cfg.heads}/{cfg.kv_heads} heads x {dims}, {dtype_name(cfg.dtype)}, "
        f"block {cfg.block_size}" + ("  (tiny CPU sizes)" if cfg.tiny else "") + "\n"
    )
    if cfg.device.type != "cuda":
        w(f"*** {CPU_NOTE} ***\n")
    w(
        "GB/s counts the K/V (+ scales, Q, O) the batch must move (a shared prefix once); "
        "%BW = floor(bytes / read bandwidth) / time; %MM = floor(FLOPs / matmul rate) / time.\n\n"
    )
    w(
        "ms: CUDA-graph replay where the backend claims graph safety (as engines run decode), else eager; "
        "eager ms: one forward() call from Python, host launch cost included; host us: the host's own "
        f"time per forward() ({HOST_CALLS} calls, synchronised only at the end).\n\n"
    )
    head = (
        f"{'case':<18} {'shape':<16} {'backend':<24} {'ms':>9} {'eager ms':>9} {'host us':>8} "
        f"{'GB/s':>8} {'%BW':>6} {'TFLOP/s':>8} {'%MM':>6} {'x best':>7}  status\n"
    )
    w(head)
    w("-" * (len(head) + 10) + "\n")
    info = {c["id"]: c for c in cases}
    last = None
    for r in rows:
        c = info[r.case]
        compute = c["kind"] in ("prefill", "mixed")
        if last is not None and r.case != last:
            w("\n" if not (r.group == "sweep" and info[last]["group"] == "sweep") else "")
        last = r.case
        status = r.status if len(r.status) <= 110 else r.status[:107] + "..."
        if r.status == "ok":
            extra = []
            if r.plan_ms is not None:
                extra.append(f"plan {r.plan_ms:.3f} ms")
            if r.note:
                extra.append(r.note)
            status = "ok" + (f" ({'; '.join(extra)})" if extra else "")
        w(
            f"{r.case:<18} {r.shape:<16} {r.label:<24} {_fmt(r.ms, 9, 4)} {_fmt(r.eager_ms, 9, 4)} "
            f"{_fmt(r.host_us, 8, 1)} {_fmt(r.gbps, 8, 0)} "
            f"{_fmt(r.pct_bw_floor, 6, 1, '%')} {_fmt(r.tflops if compute else None, 8, 1)} "
            f"{_fmt(r.pct_mm_floor if compute else None, 6, 1, '%')} {_fmt(r.x_fastest, 7, 2, 'x')}"
            f"  {status}\n"
        )
    w(
        "\nfloors per case: "
        + "; ".join(
            f"{c['id']} {c['floor_ms_bw']:.4f} ms"
            + (f" (compute {c['floor_ms_mm']:.4f})" if c["kind"] in ("prefill", "mixed") else "")
            for c in cases
            if "floor_ms_bw" in c and c["group"] != "sweep"
        )
        + "\n"
    )
    ratios = format_ratios(cases, rows)
    if ratios:
        w("\ncache formats vs bf16 (ms / the same backend's ms on the bf16 row of the same shape):\n")
        for line in ratios:
            w(f"  {line}\n")
    if not_run:
        w("not run on this machine:\n")
        for name, why in not_run.items():
            w(f"  {name}: {why}\n")
    if cfg.device.type != "cuda":
        w(f"*** {CPU_NOTE} ***\n")


def format_ratios(cases: list[dict], rows: list[Row]) -> list[str]:
    """One line per quantized-cache decode row timed beside a bf16 (``kv_dtype`` auto) decode row
    of the same shape and backend: its time over that row's (what the cache format buys)."""
    info = {c["id"]: c for c in cases}
    timed = [r for r in rows if r.status == "ok" and r.ms and r.case in info and info[r.case]["kind"] == "decode"]
    plain = {(r.shape, r.label): r.ms for r in timed if info[r.case].get("kv_dtype", "auto") == "auto"}
    out = []
    for r in timed:
        c = info[r.case]
        base, ms = plain.get((r.shape, r.label)), r.ms
        if c.get("kv_dtype", "auto") != "auto" and base and ms:
            fmt = c["kv_dtype"] + (" static" if c.get("kv_scales") == "static" else "")
            out.append(f"{fmt:<12} {r.shape:<12} {r.label:<24} {ms / base:.3f}x")
    return out


def plot(path: str, env: dict, cfg: Config, rows: list[Row]) -> str | None:
    """A PNG of the sweep's achieved GB/s against the read floor at ``path``; None, or why not."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except Exception as exc:
        return f"--plot needs matplotlib ({short(exc)}); pip install matplotlib"
    sweep = [r for r in rows if r.group == "sweep"]
    lens = sorted({int(r.shape.split("x")[1]) for r in sweep})
    if not lens:
        return "--plot draws the batch-size sweep; it was not run (add --cases sweep)"
    fig, axes = plt.subplots(1, len(lens), figsize=(7 * len(lens), 4.8), squeeze=False)
    bw = env["read_bandwidth_Bps"] / 1e9
    for ax, n in zip(axes[0], lens, strict=True):
        pts = [r for r in sweep if int(r.shape.split("x")[1]) == n]
        for label in dict.fromkeys(r.label for r in pts):
            xs = [(r.batch, r.gbps) for r in pts if r.label == label and r.gbps]
            if xs:
                ax.plot(
                    [x for x, _ in xs],
                    [y for _, y in xs],
                    marker="o",
                    linestyle="--" if "non-paged" in label else "-",
                    label=label,
                )
        ax.axhline(bw, color="black", linestyle=":", label=f"floor: read bandwidth {bw:.0f} GB/s")
        ax.set_xscale("log", base=2)
        batches = sorted({r.batch for r in pts})
        ax.set_xticks(batches)
        ax.set_xticklabels([str(b) for b in batches])
        ax.set_xlabel("decode batch size (requests)")
        ax.set_ylabel("achieved GB/s of K/V needed")
        ax.set_title(
            f"decode at {n} tokens · {cfg.heads}/{cfg.kv_heads}x{cfg.head_dim} "
            f"{dtype_name(cfg.dtype)} block {cfg.block_size}"
        )
        ax.set_ylim(bottom=0)
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=8)
    fig.suptitle(
        f"paged bench · {env['device_name']} · {env['date'][:10]}"
        + (" · CPU timings, not representative" if cfg.device.type != "cuda" else ""),
        fontsize=10,
    )
    fig.tight_layout()
    os.makedirs(os.path.dirname(os.path.abspath(path)), exist_ok=True)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return None
