#!/usr/bin/env python
"""GPU smoke test of the flash-attn2 backend against paged_core.reference_attention.

Run on a CUDA machine where flash-attn 2 imports (see ../build_sm90.sh for a source build)::

    python plugins/flash-attn2/tests/smoke_flash_attn2_gpu.py            # correctness cases, PASS/FAIL
    python plugins/flash-attn2/tests/smoke_flash_attn2_gpu.py --bench    # plus decode/prefill timings

Works from a checkout without installing: it puts core/src, conformance/src and
plugins/flash-attn2/src on sys.path when paged_core / paged_conformance / paged_flash_attn2 are
not importable. Tolerances are the conformance suite's (``paged_conformance.tolerances``). Exit
status 0 only if every case passes. The headline case is the mixed batch at 32 query / 8 KV
heads x 128, bf16, blocks of 256.
"""

from __future__ import annotations

import argparse
import dataclasses
import math
import sys
from pathlib import Path

_HERE = Path(__file__).resolve()
_ROOT = _HERE.parents[3] if len(_HERE.parents) > 3 else _HERE.parent  # the checkout, if run from one
for _src in (_ROOT / "core" / "src", _ROOT / "conformance" / "src", _ROOT / "plugins" / "flash-attn2" / "src"):
    if _src.is_dir() and str(_src) not in sys.path:
        sys.path.append(str(_src))

import torch  # noqa: E402
from paged_conformance.tolerances import lse_tolerance, output_tolerance  # noqa: E402
from paged_core import BatchMeta, allocate_kv_cache, kv_bytes_per_token, reference_attention  # noqa: E402
from paged_flash_attn2 import BridgedAllocator, bridge_cache, bridge_meta  # noqa: E402
from paged_flash_attn2.backend import FlashAttn2Backend  # noqa: E402

#: (query_len, seq_len): mid-prefill chunk, whole 16/21-token prompts, decodes at 70 and 130,
#: a padding request, long decodes and a prefill chunk crossing several 256-token blocks.
MIXED = [(40, 300), (16, 16), (21, 21), (1, 70), (1, 130), (3, 0), (1, 1000), (1, 4097), (100, 700)]
DECODE = [(1, s) for s in (70, 130, 256, 257, 1000, 3000, 1)] + [(1, 0)]
DECODE_WITH_EMPTY = [(1, 70), (0, 300), (0, 0), (1, 1000), (1, 5)]


@dataclasses.dataclass
class Result:
    name: str
    ok: bool
    detail: str

    def __str__(self) -> str:
        return f"{'PASS' if self.ok else 'FAIL'}  {self.name:<34} {self.detail}"


def _batch(pairs, *, num_heads, num_kv_heads, head_dim, block_size, dtype, seed, bridged=False):
    g = torch.Generator().manual_seed(seed)
    qlens, slens = [a for a, _ in pairs], [b for _, b in pairs]
    if bridged:  # the engine's 16-token cache, allocated in aligned runs, viewed as 256-token blocks
        nb16 = 16 * (sum(math.ceil(s / 256) for s in slens) + 2)
        meta16 = BatchMeta.build(qlens, slens, block_size=16, allocator=BridgedAllocator(nb16, seed=seed))
        cache16 = allocate_kv_cache(nb16, 16, num_kv_heads, head_dim, dtype=dtype, device="cuda")
        cache16.k.copy_(torch.randn(cache16.k.shape, generator=g).to(dtype))
        cache16.v.copy_(torch.randn(cache16.v.shape, generator=g).to(dtype))
        meta16 = meta16.to("cuda")
        q = torch.randn(meta16.num_tokens, num_heads, head_dim, generator=g).to(dtype).to("cuda")
        return q, (cache16, meta16), (bridge_cache(cache16), bridge_meta(meta16, validate=True))
    meta = BatchMeta.build(
        qlens, slens, block_size=block_size, seed=seed, num_blocks=sum(math.ceil(s / block_size) for s in slens) + 4
    )
    nb = int(meta.block_table.max()) + 2
    cache = allocate_kv_cache(nb, block_size, num_kv_heads, head_dim, dtype=dtype, device="cuda")
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    meta = meta.to("cuda")
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=g).to(dtype).to("cuda")
    return q, (cache, meta), (cache, meta)


def run_case(
    name,
    pairs,
    *,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    block_size=256,
    dtype=torch.bfloat16,
    window=0,
    softcap=0.0,
    bridged=False,
    seed=0,
) -> Result:
    try:
        q, (ref_cache, ref_meta), (cache, meta) = _batch(
            pairs,
            num_heads=num_heads,
            num_kv_heads=num_kv_heads,
            head_dim=head_dim,
            block_size=block_size,
            dtype=dtype,
            seed=seed,
            bridged=bridged,
        )
        backend = FlashAttn2Backend(validate=True)  # validation: out and lse start as NaN
        plan = backend.plan(meta)
        out, lse = backend.forward(q, cache, plan, window=window, softcap=softcap, return_lse=True)
        torch.cuda.synchronize()
        ref, ref_lse = reference_attention(
            q, ref_cache, ref_meta, window=window, softcap=softcap, return_lse=True, compute_dtype=torch.float64
        )
        tol, lt = output_tolerance(dtype), lse_tolerance(dtype)
        err = (out.double() - ref).abs()
        bad = err > tol.atol + tol.rtol * ref.abs()
        finite = torch.isfinite(ref_lse)
        lse_diff = (lse - ref_lse)[finite].abs()
        lse_err = lse_diff.max().item() if finite.any() else 0.0
        lse_ok = bool((lse_diff <= lt.atol + lt.rtol * ref_lse[finite].abs()).all())
        pad = plan.pad_rows
        pad_ok = bool((out[pad] == 0).all()) and bool(torch.isneginf(lse[pad]).all())
        lse_inf_ok = bool(torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)))
        nan = bool(out.isnan().any() or lse.isnan().any())
        ok = not bad.any() and lse_ok and pad_ok and lse_inf_ok and not nan
        detail = (
            f"max|out-ref| {err.max().item():.2e} (mean {err.mean().item():.1e}), "
            f"max|lse-ref| {lse_err:.1e}, padding rows {'exact' if pad_ok else 'WRONG'}"
            + (", NaN!" if nan else "")
            + ("" if lse_inf_ok else ", -inf pattern differs")
        )
        return Result(name, ok, detail)
    except Exception as exc:  # report and keep going: one failure should not hide the others
        return Result(name, False, f"{type(exc).__name__}: {exc}")


def run_all() -> list[Result]:
    bf16, fp16 = torch.bfloat16, torch.float16
    return [
        run_case("mixed 32/8x128 bf16 bs256", MIXED),
        run_case("mixed 32/8x128 fp16 bs256", MIXED, dtype=fp16),
        run_case("mixed 32/8x128 bf16 bs512", MIXED, block_size=512),
        run_case("decode-only 32/8x128 (swapped path)", DECODE),
        run_case("decode + empty requests", DECODE_WITH_EMPTY),
        run_case("mixed window 64", MIXED, window=64),
        run_case("decode window 300", DECODE, window=300),
        run_case("mixed softcap 30", MIXED, softcap=30.0),
        run_case("mixed group 3 (24/8x128)", MIXED, num_heads=24),
        run_case("mixed MHA 8/8x64", MIXED, num_heads=8, head_dim=64),
        run_case("mixed 16/2x256", MIXED, num_heads=16, num_kv_heads=2, head_dim=256),
        run_case("mixed 12/4x96", MIXED, num_heads=12, num_kv_heads=4, head_dim=96),
        run_case("bridge: 16-token cache, mixed", MIXED, bridged=True),
        run_case("bridge: 16-token cache, decode", DECODE, bridged=True, dtype=bf16),
    ]


def _time(fn, iters=50) -> float:
    for _ in range(5):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    times = []
    for _ in range(iters):
        start.record()
        fn()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end))
    times.sort()
    return times[len(times) // 2]


def bench() -> None:
    """Median ms of one layer's forward (32/8x128 bf16, blocks of 256) and achieved K/V bandwidth."""
    for name, pairs in [
        ("decode 64x4096", [(1, 4096)] * 64),
        ("decode 4x32768", [(1, 32768)] * 4),
        ("decode 256x1024", [(1, 1024)] * 256),
        ("prefill 8x2048", [(2048, 2048)] * 8),
    ]:
        g = torch.Generator(device="cuda").manual_seed(0)
        meta = BatchMeta.build([a for a, _ in pairs], [b for _, b in pairs], block_size=256).to("cuda")
        nb = int(meta.block_table.max()) + 2
        cache = allocate_kv_cache(nb, 256, 8, 128, dtype=torch.bfloat16, device="cuda")
        cache.k.normal_(generator=g)
        cache.v.normal_(generator=g)
        q = torch.randn(meta.num_tokens, 32, 128, device="cuda", dtype=torch.bfloat16, generator=g)
        backend = FlashAttn2Backend()
        plan = backend.plan(meta)
        out = torch.empty_like(q)
        ms = _time(lambda b=backend, q=q, c=cache, p=plan, o=out: b.forward(q, c, p, out=o))
        kv_bytes = sum(s for _, s in pairs) * kv_bytes_per_token(8, 128)
        flops = sum(4 * a * b * 128 * 32 for a, b in pairs) / (2 if pairs[0][0] > 1 else 1)
        # decode 64x4096 reads 1.07 GB of K/V: ~0.25 ms at 4.3 TB/s (DESIGN.md section 5).
        print(f"bench  {name:<18} {ms:8.3f} ms  {kv_bytes / ms / 1e6:8.0f} GB/s  {flops / ms / 1e9:7.1f} TFLOP/s")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--bench", action="store_true", help="also time decode/prefill cases")
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("FAIL  no CUDA device")
        return 2
    reasons = FlashAttn2Backend.unavailable()
    if reasons:
        print("FAIL  flash-attn2 unavailable: " + "; ".join(reasons))
        return 2
    import flash_attn

    print(f"flash-attn {flash_attn.__version__}, torch {torch.__version__}, {torch.cuda.get_device_name()}")
    results = run_all()
    for r in results:
        print(r)
    ok = all(r.ok for r in results)
    print("PASS" if ok else f"FAIL ({sum(not r.ok for r in results)} of {len(results)} cases)")
    if args.bench:
        bench()
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
