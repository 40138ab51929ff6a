"""Hardware counters of the Triton kernels on chosen batches: one Nsight Compute run per case.

Where ``gpu_tune.py`` says how long a config takes, this says why: DRAM throughput against its
peak and the bytes read (an 8-bit cache should read ~0.52 x bf16's; its per-key scales are
gathered 4 bytes out of each 32-byte sector), achieved and theoretical occupancy (and which
resource limits it), registers, shared memory, and the warp stall reasons that dominate.
GPU only (with ``ncu`` on the PATH):
    python scripts/gpu_profile.py                      # every case
    python scripts/gpu_profile.py decode-int8 decode-bf16
    python scripts/gpu_profile.py --list
    TRITON_INTERPRET=1 python scripts/gpu_profile.py --smoke   # CPU: each case runs once, no ncu

Each case runs in its own process under ``ncu --profile-from-start off``: the batch is built, the
call runs twice outside the profiled range (compile, warm caches), then once inside it, so ncu
sees exactly the kernels of one call. Configs are fixed (no autotuning under the profiler); the
raw CSV of every case goes to ``--out`` (default ``$OUT/profile`` or ``/tmp/paged-out/profile``).
Clocks are left alone (``--clock-control none``), so times match ``gpu_tune.py``'s replays.
"""

from __future__ import annotations

import argparse
import csv
import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

SMOKE = "--smoke" in sys.argv

# The sections whose metrics the table reads (the raw CSV holds all of theirs).
SECTIONS = ["SpeedOfLight", "Occupancy", "LaunchStats", "WarpStateStats", "MemoryWorkloadAnalysis"]

# name -> what it is; build() makes its call. It imports torch and the kernels lazily, so that
# --help, --list and the parent process (which only runs ncu) stay cheap.
CASES = {
    "decode-bf16": "triton-unified decode 64 x 4,096, bf16 cache, 128 keys / 4 warps / 2 stages",
    "decode-int8": "the same batch, int8 cache",
    "decode-fp8": "the same batch, fp8 cache",
    "decode-int8-w8": "int8 cache at 128 keys / 8 warps / 2 stages",
    "decode-int8-static": "int8 cache with one static scale per tensor (no per-key scale gather)",
    "split-small": "triton-unified split decode 4 x 4,096, its split count, 64 keys / 4 warps / 3 stages",
    "split-long": "triton-unified split decode 4 x 32,768, its split count, 64 keys / 4 warps / 3 stages",
    "prefill": "triton-unified prefill 8 x 2,048 causal, 128-row tiles, 64 keys / 8 warps / 2 stages",
    "mixed": "triton-unified, the bench's mixed batch (2 chunks of 512 + 30 decodes), fixed configs",
}


def build(case: str):
    """The call to profile, as a closure over its batch."""
    import _harness as H  # a sibling module: a script's own folder is first on sys.path
    import torch
    from paged_triton_unified.split_launch import choose_num_splits

    def split_call(b, n):  # the harness's split call at the split count the backend chooses
        c = H.make_case([1] * b, [n] * b, check_reqs=[0])
        return H.split_call(c, torch.empty_like(c.q), choose_num_splits(b, H.HKV, n, H.BS, H.DEV), (64, 4, 3))

    if case.startswith("decode-"):
        kv = {"bf16": "auto", "int8": "int8", "fp8": "fp8", "int8-w8": "int8", "int8-static": "int8"}[
            case[len("decode-") :]
        ]
        c = H.make_case([1] * 64, [4096] * 64, kv_dtype=kv, static_scales=case.endswith("-static"))
        small = (128, 8, 2) if case.endswith("-w8") else (128, 4, 2)
        return H.unified(c, torch.empty_like(c.q), H.cfg(small))
    if case == "split-small":
        return split_call(4, 4096)
    if case == "split-long":
        return split_call(4, 32768)
    if case == "prefill":
        c = H.make_case([2048] * 8, [2048] * 8, check_reqs=[0])
        return H.unified(c, torch.empty_like(c.q), H.cfg((64, 4, 2), (64, 8, 2), 32))
    if case == "mixed":
        g = torch.Generator().manual_seed(0)
        dec = [2000 + int(x) for x in torch.randint(-100, 101, (30,), generator=g)]
        c = H.make_case([1] * 30 + [512, 512], dec + [1024 + 512, 3072 + 512], check_reqs=[0])
        return H.unified(c, torch.empty_like(c.q), H.cfg((128, 4, 2), (64, 4, 2), 16))
    raise SystemExit(f"unknown case {case!r}; accepted: {', '.join(CASES)}")


def child(case: str) -> None:
    import torch

    fn = build(case)
    fn()
    fn()
    if SMOKE:
        return
    torch.cuda.synchronize()
    torch.cuda.profiler.start()
    fn()
    torch.cuda.synchronize()
    torch.cuda.profiler.stop()


# ------------------------------------------------------------------------------------------
# ncu's raw CSV: a header row of metric names (first field "ID"), a row of units, a row per kernel.
# ------------------------------------------------------------------------------------------

_STALL = re.compile(r"^smsp__average_warps_issue_stalled_(\w+?)_per_issue_active\.ratio$")
# The parent asks for base units (--print-units base); other units are converted all the same.
_TO_US = {"nsecond": 1e-3, "ns": 1e-3, "usecond": 1.0, "us": 1.0, "msecond": 1e3, "ms": 1e3, "second": 1e6, "s": 1e6}
_TO_BYTES = {"byte": 1, "Kbyte": 1e3, "Mbyte": 1e6, "KB": 1e3, "KiB": 1024, "MiB": 1024**2}


def _number(text: str) -> float | None:
    try:
        return float(text.replace(",", ""))
    except ValueError:
        return None


def parse_raw_csv(text: str) -> list[dict]:
    """One dict per profiled kernel: the table's fields, None where ncu did not report them."""
    rows = list(csv.reader(line for line in text.splitlines() if line.startswith('"')))
    start = next((i for i, r in enumerate(rows) if r and r[0] == "ID"), None)
    if start is None or start + 1 >= len(rows):
        return []
    names, units = rows[start], rows[start + 1]
    kernels = []
    for row in rows[start + 2 :]:
        rec = dict(zip(names, row, strict=False))
        unit = dict(zip(names, units, strict=False))

        def val(name, rec=rec, unit=unit, scale=None):
            x = _number(rec.get(name, ""))
            if x is None or scale is None:
                return x
            factor = scale.get(unit.get(name, ""))  # an unknown unit: no number rather than a wrong one
            return None if factor is None else x * factor

        t = val("gpu__time_duration.sum", scale=_TO_US)
        stalls = sorted(
            ((v, m.group(1)) for n in names if (m := _STALL.match(n)) if (v := val(n)) is not None), reverse=True
        )
        smem = sum(val(f"launch__shared_mem_per_block_{kind}", scale=_TO_BYTES) or 0 for kind in ("dynamic", "static"))
        kernels.append(
            {
                "kernel": rec.get("Kernel Name", "?").split("(")[0],
                "us": t,
                # The name differs between Nsight Compute releases.
                "dram_pct": next(
                    (
                        x
                        for x in (
                            val("dram__throughput.avg.pct_of_peak_sustained_elapsed"),
                            val("gpu__dram_throughput.avg.pct_of_peak_sustained_elapsed"),
                        )
                        if x is not None
                    ),
                    None,
                ),
                "dram_mb": None if (b := val("dram__bytes_read.sum", scale=_TO_BYTES)) is None else b / 1e6,
                "occupancy_pct": val("sm__warps_active.avg.pct_of_peak_sustained_active"),
                "theoretical_pct": val("sm__maximum_warps_per_active_cycle_pct"),
                "regs": val("launch__registers_per_thread"),
                "smem_kb": smem / 1024,
                "limits": {
                    k: val(f"launch__occupancy_limit_{k}") for k in ("registers", "shared_mem", "warps", "blocks")
                },
                "grid": rec.get("Grid Size", "?"),
                "block": rec.get("Block Size", "?"),
                "stalls": [(name, v) for v, name in stalls[:3]],
            }
        )
    return kernels


def _fmt(x, spec) -> str:
    return "-" if x is None else format(x, spec)


def table(results: list[tuple[str, list[dict]]]) -> str:
    head = (
        "case",
        "kernel",
        "µs",
        "DRAM %",
        "DRAM MB read",
        "occ % (theor.)",
        "regs",
        "smem KB",
        "CTAs/SM by regs/smem",
        "grid",
        "top stalls (cycles per issue)",
    )
    lines = [" | ".join(head), " | ".join("---" for _ in head)]
    for case, kernels in results:
        if not kernels:
            lines.append(f"{case} | (no kernel profiled)" + " |" * (len(head) - 2))
        for k in kernels:
            lim = k["limits"]
            lines.append(
                " | ".join(
                    [
                        case,
                        k["kernel"][:40],
                        _fmt(k["us"], ".1f"),
                        _fmt(k["dram_pct"], ".1f"),
                        _fmt(k["dram_mb"], ".1f"),
                        f"{_fmt(k['occupancy_pct'], '.1f')} ({_fmt(k['theoretical_pct'], '.1f')})",
                        _fmt(k["regs"], ".0f"),
                        _fmt(k["smem_kb"], ".1f"),
                        f"{_fmt(lim['registers'], '.0f')}/{_fmt(lim['shared_mem'], '.0f')}",
                        k["grid"],
                        ", ".join(f"{n} {v:.1f}" for n, v in k["stalls"]) or "-",
                    ]
                )
            )
    return "\n".join(lines)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("cases", nargs="*", metavar="CASE", help=f"any of {', '.join(CASES)} (default: all)")
    ap.add_argument("--list", action="store_true", help="print the cases and exit")
    ap.add_argument("--out", type=Path, default=Path(os.environ.get("OUT", "/tmp/paged-out")) / "profile")
    ap.add_argument("--timeout", type=int, default=240, help="seconds per case (ncu replays each kernel)")
    ap.add_argument("--smoke", action="store_true", help="run each case once on the CPU, without ncu")
    ap.add_argument("--child", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(f"{name:16s} {what}" for name, what in CASES.items()))
        return 0
    if args.child:
        child(args.child)
        return 0
    unknown = sorted(set(args.cases) - set(CASES))
    if unknown:
        ap.error(f"unknown cases {unknown}; accepted: {', '.join(CASES)}")
    cases = args.cases or list(CASES)
    if args.smoke:
        for case in cases:
            child(case)
            print(f"{case}: ran", flush=True)
        return 0
    ncu = shutil.which("ncu")
    if ncu is None:
        raise SystemExit("ncu (Nsight Compute) is not on the PATH: it comes with the CUDA toolkit")
    args.out.mkdir(parents=True, exist_ok=True)
    results = []
    for case in cases:
        log = args.out / f"{case}.csv"
        cmd = [
            ncu,
            "--clock-control",
            "none",
            "--profile-from-start",
            "off",
            "--csv",
            "--page",
            "raw",
            "--print-units",
            "base",
            "--log-file",
            str(log),
        ]
        for s in SECTIONS:
            cmd += ["--section", s]
        cmd += ["--metrics", "dram__bytes_read.sum"]
        cmd += [sys.executable, __file__, "--child", case]
        try:
            proc = subprocess.run(cmd, capture_output=True, text=True, timeout=args.timeout)
        except subprocess.TimeoutExpired:
            print(f"{case}: ncu ran past {args.timeout} s", flush=True)
            results.append((case, []))
            continue
        if proc.returncode != 0:
            print(f"{case}: ncu exited {proc.returncode}: {(proc.stderr or proc.stdout)[-600:]}", flush=True)
        kernels = parse_raw_csv(log.read_text()) if log.exists() else []
        results.append((case, kernels))
        print(f"{case}: {len(kernels)} kernel(s) profiled", flush=True)
    print(table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
