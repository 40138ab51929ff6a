"""Caches that are views of an engine's own pool are written in place, through their strides.

Two layouts engines use: FlashInfer's and vLLM's ``[num_blocks, 2, block_size, heads, dim]``
pool with ``k = pool[:, 0]`` and ``v = pool[:, 1]``, and HND storage ``[num_blocks, heads,
block_size, dim]`` seen as NHD through ``.transpose(1, 2)``. ``write_kv`` used to ``reshape``
them, which copies when it cannot view, and wrote the copy: the pool never changed. Each test
checks the pool's storage byte for byte: changed exactly at the written slots, nowhere else.
"""

from __future__ import annotations

import dataclasses

import pytest
import torch
from paged_core import (
    BatchMeta,
    KVCache,
    ReferenceBackend,
    allocate_kv_cache,
    quantize_kv,
    write_kv,
)

NB, BS, H, D = 5, 4, 2, 8
STORE = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn}
DTYPES = [
    (torch.bfloat16, "auto"),
    (torch.float16, "auto"),
    (torch.float32, "auto"),
    (torch.bfloat16, "int8"),
    (torch.float16, "fp8"),
]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bytes of ``t`` (bitwise comparison for every dtype, fp8 included)."""
    return (
        t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int16 if t.element_size() == 2 else torch.int32)
    )


def pool_cache(layout: str, dtype: torch.dtype, kv_dtype: str, device: str = "cpu"):
    """A cache of views over one pool per kind (codes, scales); returns (cache, pools, view_fns)."""
    store = STORE[kv_dtype] or dtype
    g = torch.Generator().manual_seed(1)
    if layout == "pool":
        codes = (torch.randn(NB, 2, BS, H, D, generator=g) * 3).to(store).to(device)
        scales = torch.rand(NB, 2, BS, H, generator=g).to(device)

        def kv(p, i):
            return p[:, i]
    else:  # HND storage, one tensor for k and one for v, seen as NHD
        codes = (torch.randn(2, NB, H, BS, D, generator=g) * 3).to(store).to(device)
        scales = torch.rand(2, NB, H, BS, generator=g).to(device)

        def kv(p, i):
            return p[i].transpose(1, 2)

    quant = kv_dtype != "auto"
    cache = KVCache(
        k=kv(codes, 0),
        v=kv(codes, 1),
        kv_dtype=kv_dtype,
        dtype=dtype,
        k_scale=kv(scales, 0) if quant else None,
        v_scale=kv(scales, 1) if quant else None,
    )
    assert not cache.k.is_contiguous()
    return cache, codes, scales, kv


DEVICES = [
    "cpu",
    pytest.param(
        "cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (the GPU machine)")
    ),
]


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["pool", "hnd"])
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES)
def test_write_kv_writes_through_the_views(layout, dtype, kv_dtype, device):
    cache, codes, scales, kv = pool_cache(layout, dtype, kv_dtype, device)
    codes_before, scales_before = codes.clone().cpu(), scales.clone().cpu()
    # Valid slots in several blocks, a padding row (-1) and slots past the pool (never written).
    slots = torch.tensor([0, 7, -1, 13, NB * BS, 19, NB * BS + 3])
    g = torch.Generator().manual_seed(2)
    k = torch.randn(len(slots), H, D, generator=g).to(dtype)
    v = torch.randn(len(slots), H, D, generator=g).to(dtype)
    write_kv(cache, k.to(device), v.to(device), slots.to(device))
    codes, scales = codes.cpu(), scales.cpu()

    want_codes, want_scales = codes_before.clone(), scales_before.clone()
    for i, s in enumerate(slots.tolist()):
        if not 0 <= s < NB * BS:
            continue
        blk, off = divmod(s, BS)
        for j, x in enumerate((k, v)):
            if kv_dtype == "auto":
                kv(want_codes, j)[blk, off] = x[i]
            else:
                c, sc = quantize_kv(x[i], kv_dtype)
                raw(kv(want_codes, j))[blk, off] = raw(c)
                kv(want_scales, j)[blk, off] = sc
    assert torch.equal(raw(codes), raw(want_codes)), "the pool differs from the written slots"
    assert torch.equal(scales, want_scales)
    assert not torch.equal(raw(codes), raw(codes_before))  # something was written at all


@pytest.mark.parametrize("layout", ["pool", "hnd"])
@pytest.mark.parametrize(("dtype", "kv_dtype"), [(torch.float32, "auto"), (torch.float32, "int8")])
def test_backend_write_then_forward_through_the_views(layout, dtype, kv_dtype):
    cache, codes, _, _ = pool_cache(layout, dtype, kv_dtype)
    meta = BatchMeta.build([3, 1], [6, 5], block_size=BS, num_blocks=NB, seed=3)
    g = torch.Generator().manual_seed(4)
    k, v = torch.randn(2, meta.num_tokens, H, D, generator=g)
    q = torch.randn(meta.num_tokens, 2 * H, D, generator=g)
    backend = ReferenceBackend(validate=True, compute_dtype=torch.float64)
    backend.write(cache, k, v, meta)
    # The same step on a contiguous cache holding the same values gives the same result.
    flat = dataclasses.replace(
        cache,
        k=cache.k.contiguous(),
        v=cache.v.contiguous(),
        k_scale=None if cache.k_scale is None else cache.k_scale.contiguous(),
        v_scale=None if cache.v_scale is None else cache.v_scale.contiguous(),
    )
    assert torch.equal(backend.forward(q, cache, meta), backend.forward(q, flat, meta))
    # And the new rows are in the pool itself (read back through the views).
    blk, off = meta.slot_mapping // BS, meta.slot_mapping % BS
    if kv_dtype == "auto":
        assert torch.equal(cache.k[blk, off], k) and torch.equal(cache.v[blk, off], v)
    else:
        assert torch.equal(cache.k[blk, off], quantize_kv(k, "int8")[0])


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_a_replaced_view_is_written_not_the_old_spill_storage(kv_dtype):
    # dataclasses.replace keeps the hidden spill block of the old tensors: a write used to go to
    # the old storage (through _spill) and leave the new tensors untouched.
    old = allocate_kv_cache(NB, BS, H, D, dtype=torch.float32, kv_dtype=kv_dtype)
    new = dataclasses.replace(old, k=torch.zeros_like(old.k), v=torch.zeros_like(old.v))
    k = torch.ones(1, H, D)
    write_kv(new, k, k, torch.tensor([5]))
    assert new.k[1, 1].float().abs().sum() > 0
    assert not old.k.float().any()
