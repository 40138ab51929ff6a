"""GPU smoke test of the flashinfer backend at Qwen3-8B attention shape (32/8 heads, head_dim 128,
bf16, block 16): a decode batch, a mixed batch and a prefill batch against paged-core's reference,
with and without LSE, sliding window and soft-cap; then a CUDA graph captured on a padded decode
batch and replayed after a re-plan with new data. Prints one PASS/FAIL line per check and exits
non-zero if any failed.

    python3 plugins/flashinfer/tests/smoke_flashinfer_gpu.py            # from the repository root

The first plan of each kind JIT-compiles FlashInfer modules (about 15-85 s each on the H200).
The GPU tests (test_flashinfer_gpu.py) import the helpers below. Tolerances are the conformance
suite's (``paged_conformance.tolerances``), so paged-conformance must be installed too.
"""

from __future__ import annotations

import math
import sys
import time

import torch
from paged_conformance.tolerances import lse_tolerance, output_tolerance
from paged_core import BatchMeta, BlockAllocator, allocate_kv_cache, reference_attention


def make_case(
    query_lens,
    seq_lens,
    *,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    dtype=torch.bfloat16,
    block_size=16,
    table_width=None,
    num_blocks=None,
    seed=0,
    device="cuda",
):
    """A batch, a cache filled with random K/V over shuffled blocks, and q."""
    g = torch.Generator(device="cpu").manual_seed(seed)
    nblocks = num_blocks or sum(math.ceil(s / block_size) for s in seq_lens) + 8
    meta = BatchMeta.build(
        query_lens,
        seq_lens,
        block_size=block_size,
        allocator=BlockAllocator(nblocks, seed=seed),
        device=device,
        table_width=table_width,
    )
    cache = allocate_kv_cache(nblocks, block_size, num_kv_heads, head_dim, dtype=dtype, device=device)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=g).to(device=device, dtype=dtype)
    return meta, cache, q


def pad_rows_of(meta: BatchMeta) -> torch.Tensor:
    """bool [num_tokens]: rows that belong to padding requests (seq_len 0)."""
    qlens, slens = meta.host()
    return torch.tensor(
        [s == 0 for q, s in zip(qlens, slens, strict=True) for _ in range(q)], dtype=torch.bool, device=meta.device
    )


def compare(
    backend, meta_or_plan, meta, cache, q, *, window=0, softcap=0.0, return_lse=True, compute_dtype=torch.float64
) -> tuple[bool, str]:
    """Run the backend (into a NaN-poisoned out: an unwritten row fails) and the reference;
    (ok, a one-line summary with the errors)."""
    res = backend.forward(
        q,
        cache,
        meta_or_plan,
        window=window,
        softcap=softcap,
        return_lse=return_lse,
        out=torch.full_like(q, float("nan")),
    )
    out, lse = res if return_lse else (res, None)
    ref_out, ref_lse = reference_attention(
        q, cache, meta, window=window, softcap=softcap, compute_dtype=compute_dtype, return_lse=True
    )
    tol = output_tolerance(q.dtype)
    diff = (out.to(compute_dtype) - ref_out).abs()
    bound = tol.atol + tol.rtol * ref_out.abs()
    ok = bool(torch.isfinite(out).all()) and bool((diff <= bound).all())
    msg = f"out max|err| {diff.max().item():.2e} mean {diff.mean().item():.2e}"
    pad = pad_rows_of(meta)
    if pad.any():
        zero = bool((out[pad] == 0).all())
        ok &= zero
        msg += f"; padding rows exact zeros: {zero}"
    if lse is not None:
        real = ~pad
        lerr = (lse[real].to(compute_dtype) - ref_lse[real]).abs()
        lse_ok = lse.dtype == torch.float32 and tuple(lse.shape) == tuple(q.shape[:2])
        lt = lse_tolerance(q.dtype)
        lse_ok &= bool((lerr <= lt.atol + lt.rtol * ref_lse[real].abs()).all()) if real.any() else True
        if pad.any():
            lse_ok &= bool(torch.isneginf(lse[pad]).all())
        ok &= lse_ok
        msg += f"; lse max|err| {lerr.max().item() if lerr.numel() else 0.0:.2e} ok: {lse_ok}"
    return ok, msg


def graph_replay(
    backend_cls,
    *,
    num_reqs=16,
    num_heads=32,
    num_kv_heads=8,
    head_dim=128,
    dtype=torch.bfloat16,
    block_size=16,
    width=64,
) -> tuple[bool, str]:
    """Plan outside, capture forward on a padded decode batch, re-plan with new lengths and new
    q/K/V values, replay; the replay must equal an eager run of the same plan bit for bit, and
    the reference within tolerance."""
    backend = backend_cls(cuda_graph=True)
    kw = dict(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        dtype=dtype,
        block_size=block_size,
        table_width=width,
        num_blocks=num_reqs * width + 8,
    )
    g = torch.Generator(device="cpu").manual_seed(1)
    lens_a = [int(x) for x in torch.randint(1, width * block_size, (num_reqs,), generator=g)]
    lens_b = [int(x) for x in torch.randint(1, width * block_size, (num_reqs,), generator=g)]
    lens_a[-3:] = [0, 0, 0]  # padding requests at the end (as a graph-padded batch has them)
    lens_b[1] = lens_b[-1] = 0  # and elsewhere after the re-plan
    meta_a, cache, q_a = make_case([1] * num_reqs, lens_a, seed=2, **kw)
    meta_b, cache_b, q_b = make_case([1] * num_reqs, lens_b, seed=3, **kw)
    pk = dict(num_heads=num_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, dtype=dtype)

    # Static buffers the graph reads and writes: q, out and the cache (refilled with B's values).
    q_static = q_a.clone()
    out_static = torch.empty_like(q_static)
    plan_a = backend.plan(meta_a, **pk)
    backend.forward(q_static, cache, plan_a, out=out_static)  # warm-up: JIT, lazy buffers
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        backend.forward(q_static, cache, plan_a, out=out_static)
    graph.replay()
    torch.cuda.synchronize()
    same_a = torch.equal(out_static, backend.forward(q_static, cache, plan_a))

    # The next step: new lengths (same batch size and table width), new q and K/V values.
    plan_b = backend.plan(meta_b, **pk)
    q_static.copy_(q_b)
    cache.k.copy_(cache_b.k)
    cache.v.copy_(cache_b.v)
    out_static.fill_(float("nan"))  # replay A's rows must not pass for replay B's
    graph.replay()
    torch.cuda.synchronize()
    replayed = out_static.clone()
    same_b = torch.equal(replayed, backend.forward(q_static, cache, plan_b))
    replay_ok, replay_msg = compare_tensor(replayed, meta_b, cache, q_static)
    ok = same_a and same_b and replay_ok
    return ok, (f"replay A == eager A: {same_a}; replay B == eager B: {same_b}; replay B vs reference: {replay_msg}")


def compare_tensor(out, meta, cache, q) -> tuple[bool, str]:
    ref = reference_attention(q, cache, meta, compute_dtype=torch.float64)
    tol = output_tolerance(q.dtype)
    diff = (out.double() - ref).abs()
    ok = bool((diff <= tol.atol + tol.rtol * ref.abs()).all())
    pad = pad_rows_of(meta)
    if pad.any():
        ok &= bool((out[pad] == 0).all())
    return ok, f"max|err| {diff.max().item():.2e}"


def _path_of(backend) -> str:
    """Which FlashInfer wrappers ran so far (for the log)."""
    seen = []
    for slot in backend._slots.values():
        resolved = getattr(slot.wrapper, "_backend", None)
        seen.append(f"{slot.path}{'[graph]' if slot.graph else ''}{f'/{resolved}' if resolved else ''}")
    return ", ".join(sorted(set(seen)))


def main() -> int:
    from paged_flashinfer.backend import FlashInferBackend

    if not torch.cuda.is_available():
        print("FAIL setup: torch.cuda.is_available() is False")
        return 1
    reasons = FlashInferBackend.unavailable()
    if reasons:
        print("FAIL setup: " + "; ".join(reasons))
        return 1
    import flashinfer

    print(
        f"flashinfer {getattr(flashinfer, '__version__', '?')}, torch {torch.__version__}, "
        f"{torch.cuda.get_device_name()}"
    )
    g = torch.Generator().manual_seed(0)
    decode_lens = [int(x) for x in torch.randint(100, 4096, (64,), generator=g)]
    decode_lens[-4:] = [0, 0, 0, 0]  # padding requests
    cases = {
        # name: (query_lens, seq_lens)
        "decode_64": ([1] * 64, decode_lens),
        "mixed_2x512_chunks_30_decodes": (
            [512, 512] + [1] * 30,
            [1536, 512] + [int(x) for x in torch.randint(64, 4096, (30,), generator=g)],
        ),
        "mixed_with_padding": ([300, 1, 1, 1, 17], [900, 70, 0, 130, 17]),
        "prefill_4x1024_and_chunk": ([1024, 1024, 1024, 1024, 333], [1024, 1024, 1024, 1024, 2000]),
    }
    variants = {
        "plain": dict(),
        "window=256": dict(window=256),
        "softcap=30": dict(softcap=30.0),
        "window=1": dict(window=1),
    }
    failures = 0
    backend = FlashInferBackend()
    for name, (ql, sl) in cases.items():
        meta, cache, q = make_case(ql, sl, seed=len(name))
        for vname, kw in variants.items():
            t0 = time.perf_counter()
            try:
                # BatchMeta path (implicit plan), then the explicit plan path.
                ok, msg = compare(backend, meta, meta, cache, q, **kw)
                plan = backend.plan(
                    meta,
                    num_heads=q.shape[1],
                    num_kv_heads=cache.num_kv_heads,
                    head_dim=q.shape[2],
                    dtype=q.dtype,
                    **kw,
                )
                ok2, msg2 = compare(backend, plan, meta, cache, q, return_lse=False, **kw)
                ok, msg = ok and ok2, f"{msg}; explicit plan: {msg2}"
            except Exception as exc:  # report and keep going: one line per check
                ok, msg = False, f"{type(exc).__name__}: {exc}"
            failures += not ok
            print(
                f"{'PASS' if ok else 'FAIL'} {name} {vname}: {msg} "
                f"[{time.perf_counter() - t0:.1f}s; paths: {_path_of(backend)}]",
                flush=True,
            )
    for mixed in ("prefill",):
        b2 = FlashInferBackend(mixed=mixed)
        meta, cache, q = make_case(*cases["mixed_2x512_chunks_30_decodes"], seed=7)
        try:
            ok, msg = compare(b2, meta, meta, cache, q)
        except Exception as exc:
            ok, msg = False, f"{type(exc).__name__}: {exc}"
        failures += not ok
        print(f"{'PASS' if ok else 'FAIL'} mixed via mixed={mixed!r}: {msg} [paths: {_path_of(b2)}]")
    try:
        ok, msg = graph_replay(FlashInferBackend)
    except Exception as exc:
        ok, msg = False, f"{type(exc).__name__}: {exc}"
    failures += not ok
    print(f"{'PASS' if ok else 'FAIL'} cuda_graph_padded_decode_replay: {msg}")
    print(f"{'ALL PASSED' if not failures else f'{failures} FAILED'}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
