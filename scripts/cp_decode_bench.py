"""Context-parallel decode: time a decode step whose KV cache is sharded across GPUs.

Each rank holds its share of every request's blocks (``paged_core.distributed.
shard_decode_batch``) in its own compact pool, attends to it with LSE output and the ranks merge
over NCCL (``context_parallel_decode``). The same step on one GPU holding the whole context is
the baseline (where it fits) and the oracle: the sharded result must equal it within the bf16
tolerance of ``paged_conformance.tolerances``. Qwen3-8B attention (32 query heads, 8 KV heads,
head_dim 128, bf16, 16-token blocks); cases 1 x 1,048,576 and 8 x 262,144 tokens::

    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 8 scripts/cp_decode_bench.py
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 4 scripts/cp_decode_bench.py
    NCCL_NVLS_ENABLE=0 TORCH_SYMM_MEM_DISABLE_MULTICAST=1 torchrun --nproc-per-node 2 scripts/cp_decode_bench.py
    torchrun --standalone --nproc-per-node 2 scripts/cp_decode_bench.py --smoke     # CPU, gloo, tiny

Times are medians over ``--iters`` steps (CUDA events on GPUs, after a barrier), the largest
median over the ranks (a step is as slow as its slowest rank): the whole step, the rank's
attention alone and the merge (all-gather + merge) alone, with the merge's share of the step.
Each rank generates the whole context from one seed and keeps its share, so every rank needs the
memory of the whole cache once (8 GiB for the 8 x 262,144 case).
"""

from __future__ import annotations

import argparse
import functools
import json
import os
import statistics
import time

import torch
import torch.distributed as dist
from paged_conformance.tolerances import output_tolerance
from paged_core import BatchMeta, allocate_kv_cache, registry
from paged_core.distributed import (
    LAYOUTS,
    context_parallel_decode,
    merge_across_ranks,
    shard_decode_batch,
    shard_kv_cache,
)

HEADS, KV_HEADS, HEAD_DIM, BLOCK = 32, 8, 128, 16  # Qwen3-8B attention, 16-token blocks
CASES = "1x1048576,8x262144"
SMOKE_CASES = "1x300,3x70"


def _cases(text: str) -> list[tuple[int, int]]:
    out = []
    for item in text.split(","):
        reqs, _, tokens = item.strip().partition("x")
        if not reqs.isdigit() or not tokens.isdigit():
            raise SystemExit(f"--cases item {item!r}; accepted: REQUESTSxTOKENS, e.g. 8x262144")
        out.append((int(reqs), int(tokens)))
    return out


def _timer(device: torch.device):
    """A function timing ``fn`` once, in milliseconds: CUDA events on GPUs, the clock on the CPU."""
    if device.type == "cuda":

        def run(fn):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            fn()
            end.record()
            end.synchronize()
            return start.elapsed_time(end)
    else:

        def run(fn):
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3

    return run


def _median(fn, *, iters: int, warmup: int, device: torch.device, group=None) -> float:
    timer = _timer(device)
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(iters):
        if group is not False:
            dist.barrier()  # every rank starts the step together, as in a model's layer
        times.append(timer(fn))
    return statistics.median(times)


def _slowest(ms: float, device: torch.device) -> float:
    t = torch.tensor([ms], dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _whole_cache(reqs: int, tokens: int, device: torch.device, dtype: torch.dtype):
    """The unsharded step, the same on every rank: its batch, the whole cache and q."""
    blocks = reqs * -(-tokens // BLOCK) + 1
    meta = BatchMeta.build([1] * reqs, [tokens] * reqs, block_size=BLOCK, num_blocks=blocks, device=device)
    cache = allocate_kv_cache(blocks, BLOCK, KV_HEADS, HEAD_DIM, dtype=dtype, device=device)
    g = torch.Generator(device=device).manual_seed(0)
    for t in (cache.k, cache.v):
        for i in range(0, blocks, 4096):  # in chunks: a float32 temporary of the whole pool would not fit
            t[i : i + 4096].copy_(torch.randn(t[i : i + 4096].shape, generator=g, device=device))
    q = torch.randn(reqs, HEADS, HEAD_DIM, generator=g, device=device).to(dtype)
    return meta, cache, q


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--cases", default=None, help=f"REQUESTSxTOKENS, comma-separated (default {CASES})")
    parser.add_argument(
        "--backend", default=None, help="registry name (default: triton-unified on GPUs, reference on the CPU)"
    )
    parser.add_argument("--layouts", default=",".join(LAYOUTS), help="contiguous, interleaved or both")
    parser.add_argument("--iters", type=int, default=None, help="timed steps per measurement (default 20)")
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument(
        "--smoke",
        action="store_true",
        help=f"tiny cases ({SMOKE_CASES}), 2 steps: checks the script runs, on the CPU with gloo too",
    )
    parser.add_argument("--json", default=None, help="write the rows here (rank 0)")
    args = parser.parse_args()

    cuda = torch.cuda.is_available()
    local = int(os.environ.get("LOCAL_RANK", "0"))
    device = torch.device("cuda", local) if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    dist.init_process_group("nccl" if cuda else "gloo", device_id=device if cuda else None)
    rank, world = dist.get_rank(), dist.get_world_size()
    try:
        cases = _cases(args.cases or (SMOKE_CASES if args.smoke else CASES))
        iters = args.iters or (2 if args.smoke else 20)
        warmup = min(args.warmup, 1) if args.smoke else args.warmup
        name = args.backend or ("triton-unified" if cuda else "reference")
        backend = registry.get(name)
        dtype = torch.bfloat16
        rows = []
        for reqs, tokens in cases:
            meta, whole, q = _whole_cache(reqs, tokens, device, dtype)
            layer = dict(num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, dtype=dtype)
            single_ms = float("nan")
            want = None
            if rank == 0:
                plan = backend.plan(meta, **layer)
                want = backend.forward(q, whole, plan)
                single_ms = _median(
                    functools.partial(backend.forward, q, whole, plan),
                    iters=iters,
                    warmup=warmup,
                    device=device,
                    group=False,
                )
            for layout in args.layouts.split(","):
                shard = shard_decode_batch(meta, rank, world, layout=layout)
                pool = shard_kv_cache(whole, meta, rank, world, layout=layout)
                plan = backend.plan(shard, **layer)
                out, lse = backend.forward(q, pool, plan, return_lse=True)
                step_ms = _median(
                    functools.partial(context_parallel_decode, backend, q, pool, plan),
                    iters=iters,
                    warmup=warmup,
                    device=device,
                )
                attn_ms = _median(
                    functools.partial(backend.forward, q, pool, plan, return_lse=True),
                    iters=iters,
                    warmup=warmup,
                    device=device,
                )
                merge_ms = _median(
                    functools.partial(merge_across_ranks, out, lse), iters=iters, warmup=warmup, device=device
                )
                got, _ = context_parallel_decode(backend, q, pool, plan)
                step_ms, attn_ms, merge_ms = (_slowest(t, device) for t in (step_ms, attn_ms, merge_ms))
                if rank == 0:
                    assert want is not None
                    err = float((got.double() - want.double()).abs().max())
                    tol = output_tolerance(dtype)
                    close = torch.allclose(got.double(), want.double(), atol=tol.atol, rtol=tol.rtol)
                    rows.append(
                        dict(
                            case=f"{reqs} x {tokens:,}",
                            ranks=world,
                            layout=layout,
                            backend=name,
                            single_ms=single_ms,
                            step_ms=step_ms,
                            attn_ms=attn_ms,
                            merge_ms=merge_ms,
                            merge_share=merge_ms / step_ms,
                            speedup=single_ms / step_ms,
                            max_err=err,
                            ok=close,
                        )
                    )
                del pool, plan, out, lse
            del whole, q
            if cuda:
                torch.cuda.empty_cache()
        if rank == 0:
            _print(rows, device, world)
            if args.json:
                with open(args.json, "w") as f:
                    json.dump(rows, f, indent=2)
            if not all(r["ok"] for r in rows):
                raise SystemExit("the sharded result differs from the single-device result (see max err)")
    finally:
        dist.destroy_process_group()


def _print(rows: list[dict], device: torch.device, world: int) -> None:
    what = torch.cuda.get_device_name(device) if device.type == "cuda" else "CPU (gloo)"
    print(
        f"context-parallel decode, {world} ranks, {what}, torch {torch.__version__}; "
        f"{HEADS}/{KV_HEADS} heads, head_dim {HEAD_DIM}, bf16, {BLOCK}-token blocks; ms = median per step"
    )
    head = ["case", "layout", "1 device ms", "CP step ms", "attn ms", "merge ms", "merge %", "speedup", "max err", "ok"]
    body = [
        [
            r["case"],
            r["layout"],
            f"{r['single_ms']:.3f}",
            f"{r['step_ms']:.3f}",
            f"{r['attn_ms']:.3f}",
            f"{r['merge_ms']:.3f}",
            f"{100 * r['merge_share']:.0f}",
            f"{r['speedup']:.2f}x",
            f"{r['max_err']:.2e}",
            "ok" if r["ok"] else "DIFFERS",
        ]
        for r in rows
    ]
    widths = [max(len(x) for x in col) for col in zip(head, *body, strict=True)]
    for line in [head, ["-" * w for w in widths], *body]:
        print("  ".join(x.rjust(w) for x, w in zip(line, widths, strict=True)))


if __name__ == "__main__":
    main()
