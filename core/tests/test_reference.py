"""The reference backend against an independent float64 loop (core/tests/oracle.py)."""

from __future__ import annotations

import math

import pytest
import torch
from oracle import loop_attention
from paged_core import (
    BatchMeta,
    InputError,
    ReferenceBackend,
    allocate_kv_cache,
    reference_attention,
    write_kv,
)

# A mid-prefill chunk, a whole 8-token prompt, two decodes, a 3-token verification block,
# a padding request (2 rows, seq_len 0), and a first token.
QLENS = [4, 8, 1, 1, 3, 2, 1]
SLENS = [20, 8, 35, 9, 12, 0, 1]
BS, D = 8, 16
PAD_ROWS = [17, 18]


def setup_batch(num_heads, num_kv_heads, *, kv_dtype="auto", dtype=torch.float32, seed=0, q_scale=1.0):
    """A random mixed batch whose whole context was written through write_kv; returns
    (q, cache, meta, oracle inputs)."""
    meta = BatchMeta.build(QLENS, SLENS, block_size=BS, num_blocks=24, seed=seed)
    assert meta.slot_mapping[PAD_ROWS].tolist() == [-1, -1]
    cache = allocate_kv_cache(24, BS, num_kv_heads, D, dtype=dtype, kv_dtype=kv_dtype)
    tables = [meta.block_table[r].tolist() for r in range(meta.num_reqs)]
    # Every context token is written once, as if each request's whole history were one prefill.
    full = BatchMeta.from_lists(
        SLENS, SLENS, [t[: math.ceil(s / BS)] for t, s in zip(tables, SLENS, strict=True)], block_size=BS
    )
    g = torch.Generator().manual_seed(100 + seed)
    n_ctx = full.num_tokens
    write_kv(
        cache,
        torch.randn(n_ctx, num_kv_heads, D, generator=g).to(dtype),
        torch.randn(n_ctx, num_kv_heads, D, generator=g).to(dtype),
        full.slot_mapping,
    )
    q = (torch.randn(meta.num_tokens, num_heads, D, generator=g) * q_scale).to(dtype)
    return q, cache, meta, tables


def oracle(q, cache, tables, **kw):
    """Run the loop oracle on the cache's values (codes times scales for quantized caches)."""
    if cache.quantized:
        k = cache.k.double() * cache.k_scale.double()[..., None]
        v = cache.v.double() * cache.v_scale.double()[..., None]
    else:
        k, v = cache.k.double(), cache.v.double()
    out, lse = loop_attention(q.double().tolist(), k.tolist(), v.tolist(), QLENS, SLENS, tables, BS, **kw)
    return torch.tensor(out, dtype=torch.float64), torch.tensor(lse, dtype=torch.float64)


CASES = {
    # id: (num_heads, num_kv_heads, options)
    "gqa4": (8, 2, {}),
    "gqa3": (6, 2, {}),
    "mha": (3, 3, {}),
    "gqa4-window5": (8, 2, dict(window=5)),
    "mha-window1": (2, 2, dict(window=1)),
    "gqa3-softcap": (6, 2, dict(softcap=1.5)),
    "gqa4-sinks": (4, 1, dict(sinks=[0.5, -1.0, 2.0, 0.0])),
    "gqa3-everything": (6, 2, dict(window=7, softcap=2.0, sinks=[1.0, -2.0, 0.3, 0.0, 3.0, -0.5], scale=0.4)),
}


def _kw(opts):
    kw = dict(opts)
    if "sinks" in kw:
        kw["sinks"] = torch.tensor(kw["sinks"], dtype=torch.float32)
    return kw


def _oracle_kw(opts):
    # The backend takes sinks as float32: give the oracle the same (rounded) values.
    kw = dict(opts)
    if "sinks" in kw:
        kw["sinks"] = torch.tensor(kw["sinks"], dtype=torch.float32).tolist()
    return kw


@pytest.mark.parametrize("case", list(CASES))
def test_matches_loop_float64(case):
    hq, hkv, opts = CASES[case]
    q, cache, meta, tables = setup_batch(hq, hkv, q_scale=3.0 if "softcap" in opts else 1.0)
    want, want_lse = oracle(q, cache, tables, **_oracle_kw(opts))
    out, lse = reference_attention(q, cache, meta, compute_dtype=torch.float64, return_lse=True, **_kw(opts))
    assert out.dtype == torch.float64 and lse.dtype == torch.float64
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    # Padding rows: exact zeros, lse -inf, never NaN.
    assert torch.equal(out[PAD_ROWS], torch.zeros(2, hq, D, dtype=torch.float64))
    assert torch.isneginf(lse[PAD_ROWS]).all()
    assert not out.isnan().any() and not lse.isnan().any()


@pytest.mark.parametrize("case", ["gqa4", "gqa3-everything"])
def test_backend_float32_and_float64(case):
    hq, hkv, opts = CASES[case]
    q, cache, meta, tables = setup_batch(hq, hkv, seed=1)
    want, want_lse = oracle(q, cache, tables, **_oracle_kw(opts))
    for compute, tol in ((torch.float32, 2e-6), (torch.float64, 1e-7)):
        backend = ReferenceBackend(compute_dtype=compute)
        out, lse = backend.forward(q, cache, meta, return_lse=True, **_kw(opts))
        assert out.dtype == torch.float32 and lse.dtype == torch.float32 and lse.shape == (meta.num_tokens, hq)
        torch.testing.assert_close(out.double(), want, rtol=0, atol=tol)
        torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=tol * 10)
        assert torch.equal(out[PAD_ROWS], torch.zeros(2, hq, D))
    # float64 compute is closer to the float64 loop than float32 compute (it really is used).
    e32 = (reference_attention(q, cache, meta, compute_dtype=torch.float32, **_kw(opts)).double() - want).abs().max()
    e64 = (reference_attention(q, cache, meta, compute_dtype=torch.float64, **_kw(opts)) - want).abs().max()
    assert e64 < 1e-12 < e32


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("heads", [(8, 2), (6, 2)], ids=["gqa4", "gqa3"])
def test_quantized_cache_equals_loop_on_dequantized_values(kv_dtype, heads):
    hq, hkv = heads
    q, cache, meta, tables = setup_batch(hq, hkv, kv_dtype=kv_dtype, dtype=torch.bfloat16, seed=2)
    want, want_lse = oracle(q, cache, tables)
    out, lse = reference_attention(q, cache, meta, compute_dtype=torch.float64, return_lse=True)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    torch.testing.assert_close(lse, want_lse, rtol=0, atol=1e-12)
    # And the backend returns the model dtype.
    # validate=True: out starts as NaN, so an unwritten (padding) row cannot pass as zeros.
    res = ReferenceBackend(compute_dtype=torch.float64, validate=True).forward(q, cache, meta)
    assert res.dtype == torch.bfloat16
    torch.testing.assert_close(res.double(), want, rtol=2**-8, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_forward_returns_input_dtype(dtype):
    q, cache, meta, tables = setup_batch(8, 2, dtype=dtype, seed=3)
    want, _ = oracle(q, cache, tables)
    out = ReferenceBackend(validate=True).forward(q, cache, meta)  # out poisoned first
    assert out.dtype == dtype and out.shape == q.shape
    # The only error left is rounding the float32 result to the model dtype.
    eps = 2**-8 if dtype == torch.bfloat16 else 2**-11
    torch.testing.assert_close(out.double(), want, rtol=eps, atol=1e-5)
    assert torch.equal(out[PAD_ROWS], torch.zeros(2, 8, D, dtype=dtype))


def test_out_is_respected():
    q, cache, meta, _ = setup_batch(6, 2, seed=4)
    backend = ReferenceBackend()
    out = torch.full_like(q, float("nan"))
    res = backend.forward(q, cache, meta, out=out)
    assert res is out
    assert torch.equal(out, backend.forward(q, cache, meta))
    res, lse = backend.forward(q, cache, meta, out=out, return_lse=True)
    assert res is out and lse.shape == q.shape[:2]


def test_default_scale_is_inverse_sqrt_head_dim():
    q, cache, meta, _ = setup_batch(8, 2, seed=5)
    torch.testing.assert_close(
        ReferenceBackend().forward(q, cache, meta),
        ReferenceBackend().forward(q, cache, meta, scale=D**-0.5),
        rtol=0,
        atol=0,
    )
    assert not torch.allclose(
        ReferenceBackend().forward(q, cache, meta, scale=1.0), ReferenceBackend().forward(q, cache, meta)
    )


def test_batch_invariance_through_select():
    q, cache, meta, _ = setup_batch(6, 2, seed=6)
    backend = ReferenceBackend()
    full = backend.forward(q, cache, meta)
    qsl = meta.query_start_loc.tolist()
    for reqs in ([2], [4, 0], [5, 1, 3]):
        rows = [i for r in reqs for i in range(qsl[r], qsl[r + 1])]
        alone = backend.forward(q[rows], cache, meta.select(reqs))
        assert torch.equal(alone, full[rows])


def test_nan_stays_in_its_request():
    q, cache, meta, tables = setup_batch(4, 2, seed=7)
    want, _ = oracle(q, cache, tables)
    q[1, 2, 3] = float("nan")  # request 0 (rows 0..3), head 2
    out = ReferenceBackend().forward(q, cache, meta)
    assert out[1, 2].isnan().all(), "a NaN input must show in the output, not turn into zeros"
    others = [i for i in range(meta.num_tokens) if i != 1]
    assert not out[others].isnan().any()
    torch.testing.assert_close(out[others].double(), want[others], rtol=0, atol=2e-6)


def test_empty_batch():
    meta = BatchMeta.build([], [], block_size=BS)
    cache = allocate_kv_cache(2, BS, 2, D, dtype=torch.float32)
    out, lse = ReferenceBackend().forward(torch.empty(0, 4, D), cache, meta, return_lse=True)
    assert out.shape == (0, 4, D) and lse.shape == (0, 4)


def test_compute_dtype_is_checked():
    with pytest.raises(InputError, match=r"compute_dtype is torch.float16; accepted: torch.float32, torch.float64"):
        ReferenceBackend(compute_dtype=torch.float16)
