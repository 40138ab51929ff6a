"""Host cost of one call, and first-call CUDA-graph capture, for every installed backend.

    python scripts/host_cost.py [--calls 2000] [--backends a,b]
    python scripts/host_cost.py capture BACKEND CASE     # one capture check (used by the tests)

The table: microseconds of host time per ``forward`` (plan once per batch, then N calls) and per
``write`` (N calls), on three tiny batches (32 query heads, 8 KV heads, head dim 128, bf16,
16-token blocks), measured with ``time.perf_counter`` around N eager calls that synchronise only
at the end, so the GPU is idle and the queue never fills: what an engine's Python pays per layer.

Then, for every backend that claims ``cuda_graphs``, its *first* ``forward`` on a shape is
captured in a CUDA graph (no warm-up call) and the replay compared with the float64 reference;
each check runs in its own process with an empty ``TRITON_CACHE_DIR`` (so Triton really
compiles inside the capture, and a failed capture cannot poison the next one).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import time
import traceback

import torch

# (name, query lens, seq lens): decode 1 x 512, decode 8 x 512, a 64-token chunk + 4 decodes.
BATCHES = [
    ("decode 1 x 512", [1], [512]),
    ("decode 8 x 512", [1] * 8, [512] * 8),
    ("64-chunk + 4 decodes", [64, 1, 1, 1, 1], [576, 512, 512, 512, 512]),
]
HEADS, KV_HEADS, HEAD_DIM, BLOCK_SIZE, DTYPE = 32, 8, 128, 16, torch.bfloat16
CAPTURE_CASES = ["decode_only-long_and_short", "mixed_prefill_and_decode-g4"]


def _host_us(calls: int, fn, *args, **kwargs) -> float:
    fn(*args, **kwargs)  # compiles / autotunes, not timed
    fn(*args, **kwargs)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(calls):
        fn(*args, **kwargs)
    t1 = time.perf_counter()
    torch.cuda.synchronize()
    return (t1 - t0) / calls * 1e6


def host_table(names: list[str], calls: int) -> None:
    from paged_core import BatchMeta, registry

    print(
        f"host us per call ({calls} calls, sync at the end); {HEADS}/{KV_HEADS} heads, head dim "
        f"{HEAD_DIM}, bf16, block {BLOCK_SIZE}; torch {torch.__version__}, "
        f"{torch.cuda.get_device_name()}"
    )
    print(f"{'backend':<16} {'batch':<22} {'forward us':>10} {'write us':>9}")
    for name in names:
        for label, qlens, slens in BATCHES:
            fwd = wr = "error"
            try:
                backend = registry.get(name)
                meta = BatchMeta.build(qlens, slens, block_size=BLOCK_SIZE, device="cuda")
                n = meta.num_tokens
                num_blocks = int(meta.block_table.max()) + 1
                cache = backend.allocate(num_blocks, BLOCK_SIZE, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
                q = torch.randn(n, HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
                k = torch.randn(n, KV_HEADS, HEAD_DIM, dtype=DTYPE, device="cuda")
                v = torch.randn_like(k)
                out = torch.empty_like(q)
                try:
                    wr = f"{_host_us(calls, backend.write, cache, k, v, meta):.1f}"
                except Exception as exc:  # reported, and the next measurement runs
                    print(f"  {name} / {label}: write failed: {type(exc).__name__}: {exc}")
                plan = backend.plan(meta, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=DTYPE)
                fwd = f"{_host_us(calls, backend.forward, q, cache, plan, out=out):.1f}"
            except Exception as exc:  # reported, and the next backend / batch runs
                print(f"  {name} / {label}: {type(exc).__name__}: {exc}")
            print(f"{name:<16} {label:<22} {fwd:>10} {wr:>9}", flush=True)


def capture(backend_name: str, case_id: str, size: str = "small") -> int:
    """Capture the first ``forward`` of a fresh backend on ``case_id``; compare the replay."""
    from paged_conformance.cases import get_case
    from paged_conformance.tolerances import assert_close_to_reference, output_tolerance
    from paged_conformance.workload import build_workload
    from paged_core import registry

    try:
        device = torch.device("cuda")
        case = get_case(case_id, size)
        wl = build_workload(case, device)
        backend = registry.get(backend_name)
        cache = wl.fresh_cache(backend)
        backend.write(cache, wl.k_new, wl.v_new, wl.meta)
        kw = dict(scale=case.scale, window=case.window, softcap=case.softcap, sinks=wl.sinks)
        # The layers' description, as an engine passes it: FlashInfer plans on the host with it.
        plan = backend.plan(
            wl.meta,
            num_heads=wl.q.shape[1],
            num_kv_heads=cache.num_kv_heads,
            head_dim=wl.q.shape[2],
            dtype=wl.q.dtype,
            window=case.window,
            softcap=case.softcap,
            scale=case.scale,
            sinks=wl.sinks is not None,
        )
        static_q = torch.zeros_like(wl.q)
        static_out = torch.full(tuple(wl.q.shape), float("nan"), dtype=wl.q.dtype, device=device)
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            backend.forward(static_q, cache, plan, out=static_out, **kw)  # the first call of all
        static_q.copy_(wl.q)  # the case's q, so its float64 reference applies
        graph.replay()
        torch.cuda.synchronize()
        err = assert_close_to_reference(
            static_out,
            wl.ref_out,
            backend=backend_name,
            case=case.id,
            what="first-call CUDA-graph capture, replayed",
            tolerance=output_tolerance(case.dtype, case.kv_dtype),
            rows=~wl.padding_rows,
            query_start_loc=wl.query_start_loc,
            seq_lens=wl.seq_lens,
        )
    except Exception as exc:  # one line on stdout (the caller runs many), the traceback on stderr
        traceback.print_exc()
        print(f"FAIL {backend_name} {case_id}: {type(exc).__name__}: {exc}")
        return 1
    print(f"ok {backend_name} {case_id}: max error {err:.3g}")
    return 0


def capture_checks(names: list[str]) -> None:
    from paged_core import registry

    print("\nfirst forward captured in a CUDA graph (fresh process, empty Triton cache):")
    for name in names:
        caps = registry.capabilities(name)
        if caps is None or not caps.cuda_graphs:
            print(f"{name}: does not claim cuda_graphs, not checked")
            continue
        for autotune in ("1", "0"):
            for case in CAPTURE_CASES:
                with tempfile.TemporaryDirectory() as cache_dir:
                    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
                    env.update(TRITON_CACHE_DIR=cache_dir, PAGED_AUTOTUNE=autotune)
                    try:
                        proc = subprocess.run(
                            [sys.executable, __file__, "capture", name, case],
                            env=env,
                            capture_output=True,
                            text=True,
                            timeout=900,
                        )
                        line = (proc.stdout.strip().splitlines() or [proc.stderr.strip()[-500:]])[-1]
                        if proc.returncode:
                            # Where it failed: the end of the traceback (the first error matters).
                            tail = proc.stderr.strip().splitlines()[-12:]
                            line += "".join(f"\n    {t}" for t in tail)
                    except subprocess.TimeoutExpired:
                        line = "FAIL: timed out"
                print(f"PAGED_AUTOTUNE={autotune} {line}", flush=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["capture"]:
        if len(argv) not in (3, 4):
            print("usage: host_cost.py capture BACKEND CASE [small|full]", file=sys.stderr)
            return 2
        return capture(*argv[1:])
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--calls", type=int, default=2000, help="calls per measurement (default 2000)")
    p.add_argument("--backends", help="comma-separated backend names (default: every available one)")
    p.add_argument("--no-capture", action="store_true", help="skip the first-call capture checks")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_cost.py measures CUDA backends: no CUDA device here", file=sys.stderr)
        return 2
    from paged_core import registry

    names = args.backends.split(",") if args.backends else [n for n in registry.names() if not registry.unavailable(n)]
    host_table(names, args.calls)
    if not args.no_capture:
        capture_checks(names)
    return 0


if __name__ == "__main__":
    sys.exit(main())
