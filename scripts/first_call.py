"""First-call latency: what a new shape class costs in compile + autotune, cold and cached.

    python scripts/first_call.py [--backends triton-unified,flashinfer]
    python scripts/first_call.py --timings --batches "prefill 8 x 2048"   # each config's time too
    python scripts/first_call.py child BACKEND BATCH HEAD_DIM     # one measurement (JSON line)

For each backend and batch, two fresh processes share one empty ``TRITON_CACHE_DIR``: the first
("cold") compiles and times every config of each kernel it meets; the second ("cached") is a later
process of the same machine, which should find both the binaries and the tuned choices on disk
and time nothing. Each reports the wall time of its first ``write`` + ``forward`` (synchronised)
and how many configs the autotuners timed. 32 query heads, 8 KV heads, bf16, 16-token blocks.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time

import torch

# (name, query lens, seq lens)
BATCHES = {
    "decode 64 x 4096": ([1] * 64, [4096] * 64),
    "mixed 2 x 512 + 30": ([512] * 2 + [1] * 30, [1024] * 2 + [2048] * 30),
    "prefill 4 x 1024": ([1024] * 4, [1024] * 4),
    # Not in the default list: more shape classes for --timings (which configs ever win).
    "prefill 8 x 2048": ([2048] * 8, [2048] * 8),
    "prefill 1 x 8192": ([8192], [8192]),
    "chunk 512 @ 16k + 32": ([512] + [1] * 32, [16384] + [4096] * 32),
    "mixed 2 x 512 + 30 @ 3k": ([512] * 2 + [1] * 30, [1536, 3584] + [2048] * 30),
}
DEFAULT_BATCHES = ("decode 64 x 4096", "mixed 2 x 512 + 30", "prefill 4 x 1024")
HEADS, KV_HEADS, BLOCK_SIZE, DTYPE = 32, 8, 16, torch.bfloat16


def child(backend_name: str, batch: str, head_dim: str) -> int:
    """One first call in this (fresh) process; prints {"seconds", "timed_configs"} as JSON."""
    from paged_core import BatchMeta, registry
    from triton.runtime.autotuner import Autotuner

    timed = [0]
    bench = Autotuner._bench

    def counting(self, *args, **kwargs):
        timed[0] += 1
        return bench(self, *args, **kwargs)

    Autotuner._bench = counting
    d = int(head_dim)
    qlens, slens = BATCHES[batch]
    backend = registry.get(backend_name)
    meta = BatchMeta.build(qlens, slens, block_size=BLOCK_SIZE, device="cuda")
    cache = backend.allocate(int(meta.block_table.max()) + 1, BLOCK_SIZE, KV_HEADS, d, dtype=DTYPE, device="cuda")
    q = torch.randn(meta.num_tokens, HEADS, d, dtype=DTYPE, device="cuda")
    k = torch.randn(meta.num_tokens, KV_HEADS, d, dtype=DTYPE, device="cuda")
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    backend.write(cache, k, torch.randn_like(k), meta)
    backend.forward(q, cache, backend.plan(meta), out=torch.empty_like(q))
    torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    # Each timed config of the attention kernels, fastest first (ms; what --timings prints).
    timings = {}
    for mod in ("paged_triton_unified.kernels", "paged_triton_unified.split_kernels"):
        kernels = sys.modules.get(mod)
        for name in ("unified_attention_kernel", "split_kv_attention_kernel"):
            tuner = getattr(kernels, name, None) if kernels else None
            if getattr(tuner, "configs_timings", None):
                rows = sorted(
                    (float(t[0] if isinstance(t, (list, tuple)) else t), str(c))
                    for c, t in tuner.configs_timings.items()
                )
                timings[name] = rows
    print(json.dumps({"seconds": seconds, "timed_configs": timed[0], "timings": timings}))
    return 0


def _run_child(name: str, batch: str, head_dim: int, cache_dir: str) -> dict:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["TRITON_CACHE_DIR"] = cache_dir
    proc = subprocess.run(
        [sys.executable, __file__, "child", name, batch, str(head_dim)],
        env=env,
        capture_output=True,
        text=True,
        timeout=900,
    )
    if proc.returncode:
        return {"error": (proc.stderr.strip().splitlines() or ["?"])[-1][:120]}
    return json.loads(proc.stdout.strip().splitlines()[-1])


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["child"]:
        return child(*argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backends", default="triton-unified", help="comma-separated backend names")
    p.add_argument(
        "--batches", default=",".join(DEFAULT_BATCHES), help=f"comma-separated batch names, of: {', '.join(BATCHES)}"
    )
    p.add_argument("--timings", action="store_true", help="also print each timed config's time (cold run)")
    p.add_argument("--head-dims", default="128,80", help="comma-separated head dims (default 128,80)")
    args = p.parse_args(argv)
    unknown = sorted(set(args.batches.split(",")) - set(BATCHES))
    if unknown:
        p.error(f"unknown batches {unknown}; accepted: {', '.join(BATCHES)}")
    import triton

    print(
        f"first call: write + forward, synchronised (s), and configs timed; torch {torch.__version__}, "
        f"Triton {triton.__version__}, {torch.cuda.get_device_name()}, PAGED_AUTOTUNE="
        f"{os.environ.get('PAGED_AUTOTUNE', '1')}"
    )
    print(f"{'backend':<16} {'batch':<20} {'head dim':>8} {'cold s':>8} {'timed':>6} {'cached s':>9} {'timed':>6}")
    for name in args.backends.split(","):
        for batch in args.batches.split(","):
            for d in (int(x) for x in args.head_dims.split(",")):
                with tempfile.TemporaryDirectory() as cache_dir:
                    runs = [_run_child(name, batch, d, cache_dir) for _ in range(2)]
                cells = []
                for r in runs:
                    cells += (
                        [f"{r['seconds']:.1f}", str(r["timed_configs"])]
                        if "error" not in r
                        else [f"error: {r['error']}", ""]
                    )
                print(
                    f"{name:<16} {batch:<20} {d:>8} {cells[0]:>8} {cells[1]:>6} {cells[2]:>9} {cells[3]:>6}", flush=True
                )
                for kernel, rows in (runs[0].get("timings") or {}).items() if args.timings else ():
                    best = rows[0][0]
                    for ms, config in rows:
                        print(f"    {kernel}: {ms:.4f} ms ({ms / best:.3f} x best)  {config}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
