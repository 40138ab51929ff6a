"""A toy inference engine's attention path, step by step, on any backend by name.

What an engine does with paged: it owns the KV cache of every layer and a block allocator,
keeps each request's block list as its context grows, builds one BatchMeta per step (a chunked
prefill next to whole prompts and decodes, then decodes), plans once per step, and for each
layer writes the step's new K/V and runs attention. Each step's output is compared with the
float64 reference on the same cache (``paged_core.reference_attention``), and the largest error
printed. With paged-conformance installed too (``pip install --find-links dist
paged-conformance``), the errors are also judged against the conformance suite's tolerance for
the dtype, so the loop doubles as an end-to-end check:

    python examples/engine_loop.py                          # the reference backend, on the CPU
    python examples/engine_loop.py --backend triton-unified # Triton (interpreter without a GPU)
    python examples/engine_loop.py --backend flashinfer --device cuda --dtype bfloat16
    python examples/engine_loop.py --kv-dtype fp8 --static-scale 0.02   # vLLM-style fp8 cache

Exits 1 if any step's output is further from the reference than the dtype's tolerance, and
says where (request, head, position); without paged-conformance it judges nothing and exits 0.
"""

from __future__ import annotations

import argparse
import itertools
import math
import os
import sys

_parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_parser.add_argument("--backend", default="reference", help="a name from `paged list` (default: reference)")
_parser.add_argument("--device", default="cpu", help="cpu (default) or cuda")
_parser.add_argument("--dtype", default="float32", choices=["float32", "float16", "bfloat16"])
_parser.add_argument("--steps", type=int, default=5, help="engine steps to run (default 5)")
_parser.add_argument("--layers", type=int, default=2)
_parser.add_argument(
    "--kv-dtype",
    default="auto",
    choices=["auto", "int8", "fp8", "fp8_e5m2", "int4", "kivi4"],
    help="cache storage: the model dtype (default), or quantized codes with scales (docs/quantization.md)",
)
_parser.add_argument(
    "--static-scale",
    type=float,
    default=None,
    metavar="S",
    help="an int8/fp8 cache with one static scale S for K and V (as vLLM's fp8 caches "
    "have), instead of one scale per slot set by each write",
)
ARGS = _parser.parse_args()
if ARGS.device == "cpu" and ARGS.backend.startswith("triton"):
    os.environ.setdefault("TRITON_INTERPRET", "1")  # before Triton is imported

import torch  # noqa: E402
from paged_core import BatchMeta, BlockAllocator, PagedError, reference_attention, registry  # noqa: E402

try:
    # The suite's tolerance table and its failure messages that say where: one table for the
    # suite and this check. paged-core alone (the README's install) does without them.
    from paged_conformance import tolerances
except ModuleNotFoundError:
    tolerances = None  # type: ignore[assignment]

NUM_HEADS, NUM_KV_HEADS, HEAD_DIM, BLOCK_SIZE = 8, 2, 64, 16
NUM_BLOCKS = 64
CHUNK = 16  # prefill tokens a request may add per step (chunked prefill)


class Request:
    def __init__(self, prompt_len: int):
        self.prompt_len = prompt_len
        self.seq_len = 0  # tokens whose K/V are in the cache after the current step
        self.blocks: list[int] = []

    def next_tokens(self) -> int:
        """New tokens this step: the next prefill chunk, else one decode token."""
        left = self.prompt_len - self.seq_len
        return min(CHUNK, left) if left > 0 else 1


def main() -> int:
    device, dtype = torch.device(ARGS.device), getattr(torch, ARGS.dtype)
    try:
        backend = registry.get(ARGS.backend)
    except PagedError as exc:  # not installed, or cannot run here: say which and what fixes it
        print(f"engine_loop.py: {exc}", file=sys.stderr)
        return 2
    static = {} if ARGS.static_scale is None else dict(k_scale=ARGS.static_scale, v_scale=ARGS.static_scale)
    try:
        caches = [
            backend.allocate(
                NUM_BLOCKS,
                BLOCK_SIZE,
                num_kv_heads=NUM_KV_HEADS,
                head_dim=HEAD_DIM,
                dtype=dtype,
                kv_dtype=ARGS.kv_dtype,
                device=device,
                **static,
            )
            for _ in range(ARGS.layers)
        ]
    except PagedError as exc:  # a static scale for a full-precision cache, a scale <= 0, ...
        print(f"engine_loop.py: {exc}", file=sys.stderr)
        return 2
    allocator = BlockAllocator(NUM_BLOCKS, seed=0)
    requests = [Request(37), Request(5), Request(20)]  # a long prompt prefilled in chunks, two short ones
    gen = torch.Generator().manual_seed(0)
    # Elementwise |out - ref| <= atol + rtol * |ref|; the reference reads the same (quantized) cache.
    tolerance = None if tolerances is None else tolerances.output_tolerance(dtype, ARGS.kv_dtype)
    worst, failures = 0.0, []
    for step in range(ARGS.steps):
        # Schedule: every request gets its next tokens; grow its block list to cover them.
        query_lens = [r.next_tokens() for r in requests]
        for r, t in zip(requests, query_lens, strict=True):
            r.seq_len += t
            r.blocks += allocator.allocate(math.ceil(r.seq_len / BLOCK_SIZE) - len(r.blocks))
        meta = BatchMeta.from_lists(
            query_lens,
            [r.seq_len for r in requests],
            [r.blocks for r in requests],
            block_size=BLOCK_SIZE,
            device=device,
        )
        plan = backend.plan(
            meta, num_heads=NUM_HEADS, num_kv_heads=NUM_KV_HEADS, head_dim=HEAD_DIM, dtype=dtype, kv_dtype=ARGS.kv_dtype
        )
        errors = []
        for layer, cache in enumerate(caches):
            # What the model's projections would produce for this step's tokens.
            q, k, v = (
                torch.randn(meta.num_tokens, h, HEAD_DIM, generator=gen).to(device=device, dtype=dtype)
                for h in (NUM_HEADS, NUM_KV_HEADS, NUM_KV_HEADS)
            )
            backend.write(cache, k, v, meta)
            out = backend.forward(q, cache, plan)
            want = reference_attention(q, cache, meta, compute_dtype=torch.float64)
            if tolerances is None:
                errors.append(max_abs_error(out, want))
                continue
            try:
                errors.append(
                    tolerances.assert_close_to_reference(
                        out,
                        want,
                        backend=backend.name,
                        case=f"step {step}, layer {layer}",
                        tolerance=tolerance,
                        query_start_loc=[0, *itertools.accumulate(query_lens)],
                        seq_lens=[r.seq_len for r in requests],
                    )
                )
            except tolerances.ConformanceFailure as exc:  # says where: request, head, position
                errors.append(exc.max_error if exc.max_error is not None else math.inf)
                failures.append(str(exc))
        worst = max(worst, *errors)
        kinds = ", ".join(f"{t} new/{r.seq_len}" for t, r in zip(query_lens, requests, strict=True))
        print(
            f"step {step}: {meta.num_tokens:3d} tokens ({kinds}); max abs err per layer "
            f"{', '.join(f'{e:.1e}' for e in errors)}",
            flush=True,
        )
    for failure in failures:
        print(failure, file=sys.stderr)
    ok = not failures
    scales = (
        "static scale"
        if ARGS.static_scale is not None
        else "keys per block and channel, values per slot"
        if ARGS.kv_dtype == "kivi4"
        else "per-slot scales"
    )
    cache_kind = "" if ARGS.kv_dtype == "auto" else f", {ARGS.kv_dtype} cache ({scales})"
    verdict = (
        f"not judged: the {ARGS.dtype} tolerance is paged-conformance's; "
        "pip install --find-links dist paged-conformance"
        if tolerance is None
        else f"{'within' if ok else 'BEYOND'} the {ARGS.dtype} tolerance {tolerance}"
    )
    print(
        f"{backend.name}: {ARGS.steps} steps x {ARGS.layers} layers{cache_kind}, worst abs err {worst:.1e} ({verdict})"
    )
    return 0 if ok else 1


def max_abs_error(out: torch.Tensor, want: torch.Tensor) -> float:
    """The largest ``|out - want|`` (NaN counts as infinite)."""
    err = (out.double().cpu() - want.double().cpu()).abs()
    return float(torch.nan_to_num(err, nan=math.inf).max()) if err.numel() else 0.0


if __name__ == "__main__":
    sys.exit(main())
