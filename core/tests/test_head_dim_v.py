"""A V/output head dim other than the QK head dim (MLA-shaped layers) through the contract."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from paged_core import (
    AttentionSpec,
    Backend,
    BatchMeta,
    Capabilities,
    InputError,
    UnsupportedSpecError,
    allocate_kv_cache,
    kv_bytes_per_token,
    registry,
    write_kv,
)
from paged_core._reference import reference_attention


def _filled(d: int, dv: int, kv_dtype: str = "auto"):
    torch.manual_seed(0)
    meta = BatchMeta.build(query_lens=[5, 1, 3], seq_lens=[5, 40, 20], block_size=16)
    cache = allocate_kv_cache(12, 16, 2, d, dtype=torch.float32, kv_dtype=kv_dtype, head_dim_v=dv)
    slots = torch.arange(12 * 16)
    write_kv(cache, torch.randn(len(slots), 2, d), torch.randn(len(slots), 2, dv), slots)
    return meta, cache, torch.randn(meta.num_tokens, 4, d)


def _by_hand(q, cache, meta, scale):
    """softmax(q k^T * scale) v per request, with V of its own width: the definition."""
    k, v = cache.dequantized()
    k, v = k.double(), v.double()
    out = torch.zeros(q.shape[0], q.shape[1], cache.head_dim_v, dtype=torch.float64)
    qsl, sl = meta.query_start_loc.tolist(), meta.seq_lens.tolist()
    for r in range(meta.num_reqs):
        blocks = meta.block_table[r, : math.ceil(sl[r] / 16)].long()
        keys = k[blocks].reshape(-1, 2, cache.head_dim)[: sl[r]].repeat_interleave(2, dim=1)
        vals = v[blocks].reshape(-1, 2, cache.head_dim_v)[: sl[r]].repeat_interleave(2, dim=1)
        for i, t in enumerate(range(qsl[r], qsl[r + 1])):
            pos = sl[r] - (qsl[r + 1] - qsl[r]) + i
            logits = torch.einsum("hd,khd->hk", q[t].double(), keys[: pos + 1]) * scale
            out[t] = torch.einsum("hk,khd->hd", logits.softmax(-1), vals[: pos + 1])
    return out


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_reference_computes_a_narrower_v(kv_dtype):
    meta, cache, q = _filled(48, 32, kv_dtype)
    assert tuple(cache.v.shape) == (12, 16, 2, 32) and cache.head_dim_v == 32
    if kv_dtype != "auto":
        assert tuple(cache.v_scale.shape) == (12, 16, 2)  # per (slot, head), whatever the dim
    out, lse = registry.get("reference", compute_dtype=torch.float64).forward(q, cache, meta, return_lse=True)
    assert out.shape == (meta.num_tokens, 4, 32) and lse.shape == (meta.num_tokens, 4)
    torch.testing.assert_close(out.double(), _by_hand(q, cache, meta, 48**-0.5), rtol=1e-5, atol=1e-6)


def test_lse_does_not_depend_on_v():
    # The LSE is a property of the scores alone: the same K with V of another width.
    meta, cache, q = _filled(48, 32)
    wide = allocate_kv_cache(12, 16, 2, 48, dtype=torch.float32)
    wide.k.copy_(cache.k)
    _, lse = reference_attention(q, cache, meta, return_lse=True)
    _, lse_wide = reference_attention(q, wide, meta, return_lse=True)
    torch.testing.assert_close(lse, lse_wide, rtol=0, atol=0)


class _Plain(Backend):
    """Claims nothing about V's head dim (the default)."""

    name = "plain"
    capabilities = Capabilities()

    def _forward(self, q, cache, plan, *, out, lse, scale, window, softcap, sinks):
        out.zero_()


def test_a_backend_that_does_not_claim_it_refuses_with_the_reason():
    meta, cache, q = _filled(48, 32)
    with pytest.raises(UnsupportedSpecError) as exc:
        _Plain().forward(q, cache, meta)
    assert "head_dim_v 32 other than head_dim 48 (MLA-shaped heads) is not supported" in str(exc.value)
    assert "accepted (head_dim, head_dim_v): head_dim_v == head_dim" in str(exc.value)
    with pytest.raises(UnsupportedSpecError, match="head_dim_v 32 other than head_dim 48"):
        _Plain().plan(meta, num_heads=4, num_kv_heads=2, head_dim=48, head_dim_v=32)
    # Equal dims, given or not, are what it always served.
    _Plain().plan(meta, num_heads=4, num_kv_heads=2, head_dim=48, head_dim_v=48)


def test_capabilities_name_the_pairs():
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=192, head_dim_v=128, block_size=16)
    assert AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16).head_dim_v == 64
    assert "x192 v128" in spec.describe()
    pairs = Capabilities(head_dim_pairs=frozenset({(192, 128)}))
    assert pairs.reasons(spec) == []
    assert pairs.reasons(AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=96, head_dim_v=64, block_size=16)) == [
        "head_dim_v 64 other than head_dim 96 (MLA-shaped heads) is not supported "
        "(accepted (head_dim, head_dim_v): (192, 128) or head_dim_v == head_dim)"
    ]
    assert "head_dim_v 192/128;" in pairs.summary()
    # A named pair is a claim of its own: 192 need not be a head_dim served with V of 192.
    narrow = Capabilities(head_dims=frozenset({64, 128}), head_dim_pairs=frozenset({(192, 128)}))
    assert narrow.reasons(spec) == []
    assert narrow.reasons(dataclasses.replace(spec, head_dim_v=192)) == [
        "head_dim 192 is not supported (accepted: 64, 128)"
    ]
    assert "head_dim_v" not in Capabilities().summary()
    dims = Capabilities(head_dims=frozenset({64, 192}), head_dim_pairs=None)
    assert dims.reasons(spec) == ["head_dim_v 128 is not supported (accepted: 64, 192)"]
    # paged list states what reasons() accepts: V dims from head_dims, not "any".
    assert "head_dim_v 64,192;" in dims.summary()
    assert "head_dim_v any;" in Capabilities(head_dims=None, head_dim_pairs=None).summary()
    with pytest.raises(InputError, match="head_dim_v is 0"):
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, head_dim_v=0, block_size=16)


def test_out_and_write_take_v_width():
    meta, cache, q = _filled(48, 32)
    ref = registry.get("reference")
    out = torch.empty(meta.num_tokens, 4, 32)
    assert ref.forward(q, cache, meta, out=out) is out
    with pytest.raises(InputError) as exc:
        ref.forward(q, cache, meta, out=torch.empty_like(q))
    assert f"accepted: the shape [num_tokens={meta.num_tokens}, num_heads=4, head_dim_v=32] and dtype" in str(exc.value)
    with pytest.raises(
        InputError,
        match=r"v has shape \[3, 2, 48\]; accepted: \[num_tokens=3, num_kv_heads=2, "
        r"head_dim_v=32\]",
    ):
        write_kv(cache, torch.zeros(3, 2, 48), torch.zeros(3, 2, 48), torch.arange(3))


def test_cache_v_must_match_k_but_for_its_head_dim():
    cache = allocate_kv_cache(4, 16, 2, 48, dtype=torch.float32)
    cache.v = torch.zeros(4, 16, 1, 32)
    with pytest.raises(InputError, match=r"accepted: v of k's \[num_blocks, block_size, num_kv_heads\]"):
        cache.check()


def test_kv_bytes_count_each_width():
    assert kv_bytes_per_token(2, 192, head_dim_v=128, dtype=torch.float16) == 2 * (192 + 128) * 2
    assert kv_bytes_per_token(2, 64) == kv_bytes_per_token(2, 64, head_dim_v=64)


def test_a_context_parallel_shard_keeps_v_width():
    from paged_core.distributed import shard_kv_cache

    meta, cache, _ = _filled(48, 32)
    pool = shard_kv_cache(cache, BatchMeta.from_lists([1], [40], [[7, 3, 5]], block_size=16), 0, 1)
    assert pool.head_dim == 48 and pool.head_dim_v == 32
    assert torch.equal(pool.v, cache.v[[7, 3, 5]])
