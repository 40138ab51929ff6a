"""paged_triton_common.write against paged_core.write_kv: the same bytes, the same errors.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below before
Triton is imported). Every comparison is bitwise, over the whole storage the cache views (an
engine's pool included, poisoned with random bytes first), so a write to the wrong place, a
write of a padding row and a code or scale one bit off all fail.
"""

from __future__ import annotations

import dataclasses
import inspect
import os
import pathlib
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

import triton
import triton.language as tl
from paged_core import BatchMeta, InputError, KVCache, allocate_kv_cache, registry, static_scale
from paged_core import write_kv as torch_write_kv
from paged_triton_common import write as triton_write
from paged_triton_common.backend import TritonBackend
from paged_triton_common.write import write_kv

NB, BS, H, D = 5, 4, 3, 24  # 3 heads and head_dim 24: both padded in the kernel (4, 32)
# A head dim the Triton backends' attention claims: Backend.write refuses the caches it does not.
CLAIMED_D = 32
NUM_SLOTS = NB * BS
STORE = {"auto": None, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
DTYPES = [(dt, kv) for kv in STORE for dt in (torch.float32, torch.float16, torch.bfloat16)]
LAYOUTS = ["allocated", "contiguous", "pool", "hnd"]
GPU = pytest.mark.skipif(
    not torch.cuda.is_available(), reason="needs a CUDA GPU (the kernel compiled, not interpreted)"
)
# On a GPU machine Triton runs compiled, and a CPU cache takes paged_core.write_kv itself (which
# sends invalid slots to the spill block): there is no kernel to compare on the CPU there.
INTERPRETED = os.environ.get("TRITON_INTERPRET") == "1"
CPU = pytest.mark.skipif(
    not INTERPRETED,
    reason="the CPU runs the kernel only under TRITON_INTERPRET=1 "
    "(this machine compiles for its GPU; the CPU takes paged_core.write_kv)",
)
DEVICES = [pytest.param("cpu", marks=CPU), pytest.param("cuda", marks=GPU)]
# Valid slots in several blocks, padding (-1), slots past the pool and below -1 (never written).
SLOTS = [0, 7, -1, 13, NUM_SLOTS, 19, NUM_SLOTS + 3, 5, -7, 2**40, 1]


def raw(t: torch.Tensor) -> torch.Tensor:
    """The bits of ``t`` as integers (a bitwise comparison for every dtype, fp8 and NaN included)."""
    return t.view({1: torch.uint8, 2: torch.int16, 4: torch.int32}[t.element_size()])


def poison(t: torch.Tensor, seed: int) -> None:
    """Fill ``t``'s bytes with random ones (NaN bit patterns included)."""
    g = torch.Generator().manual_seed(seed)
    b = t.view(torch.uint8) if t.element_size() == 1 else raw(t).view(torch.uint8)
    b.copy_(torch.randint(0, 256, b.shape, dtype=torch.uint8, generator=g))


def make_cache(layout: str, dtype: torch.dtype, kv_dtype: str, device: str):
    """(cache, storages): a cache in ``layout`` and every tensor its views live in, poisoned."""
    store = STORE[kv_dtype] or dtype
    quant = kv_dtype != "auto"
    if layout == "allocated":  # from allocate_kv_cache: views of storage one (spill) block longer
        cache = allocate_kv_cache(NB, BS, H, D, dtype=dtype, kv_dtype=kv_dtype, device=device)
        storages = list(cache._spill)
    elif layout == "contiguous":  # an engine's own tensors: no spill block
        codes = [torch.empty(NB, BS, H, D, dtype=store, device=device) for _ in range(2)]
        scales = [torch.empty(NB, BS, H, device=device) for _ in range(2)] if quant else [None, None]
        cache = KVCache(k=codes[0], v=codes[1], kv_dtype=kv_dtype, dtype=dtype, k_scale=scales[0], v_scale=scales[1])
        storages = codes + (scales if quant else [])
    elif layout == "pool":  # FlashInfer's / vLLM's [num_blocks, 2, block_size, heads, dim]
        pool = torch.empty(NB, 2, BS, H, D, dtype=store, device=device)
        spool = torch.empty(NB, 2, BS, H, device=device)
        cache = KVCache(
            k=pool[:, 0],
            v=pool[:, 1],
            kv_dtype=kv_dtype,
            dtype=dtype,
            k_scale=spool[:, 0] if quant else None,
            v_scale=spool[:, 1] if quant else None,
        )
        storages = [pool] + ([spool] if quant else [])
    elif layout == "static":  # allocate_kv_cache with static scales: one per KV head for k, one for v
        cache = allocate_kv_cache(
            NB,
            BS,
            H,
            D,
            dtype=dtype,
            kv_dtype=kv_dtype,
            device=device,
            k_scale=torch.tensor([0.02, 0.05, 0.1], device=device),
            v_scale=0.03,
        )
        storages = list(cache._spill[:2])  # the scales are fixed: never written, not poisoned
    elif layout == "static-pool":  # an engine's pool with per-tensor scales (vLLM's fp8 caches)
        pool = torch.empty(NB, 2, BS, H, D, dtype=store, device=device)
        ks, vs = torch.tensor([0.04], device=device), torch.tensor([0.07], device=device)
        cache = KVCache(
            k=pool[:, 0],
            v=pool[:, 1],
            kv_dtype=kv_dtype,
            dtype=dtype,
            k_scale=static_scale(ks, pool[:, 0]),
            v_scale=static_scale(vs, pool[:, 1]),
        )
        storages = [pool]
    else:  # HND storage [num_blocks, heads, block_size, dim] seen as NHD
        pool = torch.empty(2, NB, H, BS, D, dtype=store, device=device)
        spool = torch.empty(2, NB, H, BS, device=device)
        cache = KVCache(
            k=pool[0].transpose(1, 2),
            v=pool[1].transpose(1, 2),
            kv_dtype=kv_dtype,
            dtype=dtype,
            k_scale=spool[0].transpose(1, 2) if quant else None,
            v_scale=spool[1].transpose(1, 2) if quant else None,
        )
        storages = [pool] + ([spool] if quant else [])
    for i, t in enumerate(storages):
        poison(t, seed=10 + i)
    return cache, storages


def clone_cache(cache: KVCache, storages: list[torch.Tensor]):
    """The same cache over copies of its storages (views rebuilt with the same strides)."""
    copies = [s.clone() for s in storages]

    def moved(view):
        for s, c in zip(storages, copies, strict=True):
            if view is not None and view.untyped_storage().data_ptr() == s.untyped_storage().data_ptr():
                return c.as_strided(view.shape, view.stride(), view.storage_offset() - s.storage_offset())
        return view

    index = {id(s): i for i, s in enumerate(storages)}
    # Static scales are not among the storages: the twin shares them.
    spill = None if cache._spill is None else tuple(copies[index[id(s)]] if id(s) in index else s for s in cache._spill)
    twin = dataclasses.replace(
        cache,
        k=moved(cache.k),
        v=moved(cache.v),
        k_scale=moved(cache.k_scale),
        v_scale=moved(cache.v_scale),
        _spill=spill,
    )
    return twin, copies


def rows(n: int, dtype: torch.dtype, device: str, *, seed: int, layout: str = "contiguous"):
    """k, v [n, H, D]: contiguous, slices of a fused qkv projection, or head_dim strided."""
    g = torch.Generator().manual_seed(seed)
    if layout == "contiguous":
        k, v = (torch.randn(2, n, H, D, generator=g) * 4).to(dtype).to(device)
    elif layout == "fused":  # [n, q_heads + 2 * kv_heads, D], k and v slices of it
        qkv = (torch.randn(n, 4 + 2 * H, D, generator=g) * 4).to(dtype).to(device)
        k, v = qkv[:, 4 : 4 + H], qkv[:, 4 + H :]
    else:  # every other element of the head dim, and v's heads reversed in memory order
        big = (torch.randn(n, H, 2 * D, generator=g) * 4).to(dtype).to(device)
        k = big[:, :, ::2]
        v = (torch.randn(n, D, H, generator=g) * 4).to(dtype).to(device).transpose(1, 2)
    if n > 3:
        # A zero vector (the floor scale, 2**-126) and negative zeros (their sign survives in fp8 codes).
        k[1, 0] = 0
        v[2, 1] = -0.0
        # Rounding ties at scale 1 (amax 127 / 448): halves for int8; for fp8 normal midpoints,
        # subnormal ones (1.5 and 3.5 * 2**-9) and the one below the smallest normal (7.5 * 2**-9).
        k[3, 0, :6] = torch.tensor([127.0, 0.5, 1.5, -2.5, 126.5, -0.5], dtype=dtype)
        v[3, 2, :7] = torch.tensor([448.0, 8.5, 9.5, -11.5, 1.5 * 2**-9, -3.5 * 2**-9, 7.5 * 2**-9], dtype=dtype)
    if n > 4:
        # fp8 E5M2 ties at scale 1 (amax 57344): normal midpoints, a subnormal one and the one
        # below the smallest normal.
        k[4, 1, :5] = torch.tensor([57344.0, 1152.0, -1408.0, 3 * 2**-17, 2**-14 - 2**-17], dtype=dtype)
    return k, v


def assert_same_write(cache, storages, k, v, slots, *, spill_untouched=True):
    """write_kv (this module) writes what paged_core.write_kv writes, byte for byte."""
    want_cache, want = clone_cache(cache, storages)
    torch_write_kv(want_cache, k, v, slots)
    before = [s.clone() for s in storages]
    write_kv(cache, k, v, slots)
    if cache._spill is not None:
        # paged_core sends invalid slots to the hidden block past the pool; the kernel writes
        # nothing for them: compare the pool, and check the spill block was never touched.
        for s, w, b in zip(storages, want, before, strict=True):
            assert torch.equal(raw(s[:NB]), raw(w[:NB])), "the pool differs from paged_core.write_kv's"
            if spill_untouched:
                assert torch.equal(raw(s[NB:]), raw(b[NB:])), "the spill block was written"
    else:
        for s, w in zip(storages, want, strict=True):
            assert torch.equal(raw(s), raw(w)), "the storage differs from paged_core.write_kv's"
    assert any(not torch.equal(raw(s), raw(b)) for s, b in zip(storages, before, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize(("dtype", "kv_dtype"), DTYPES)
def test_writes_what_paged_core_writes(dtype, kv_dtype, layout, device):
    cache, storages = make_cache(layout, dtype, kv_dtype, device)
    k, v = rows(len(SLOTS), dtype, device, seed=1)
    assert_same_write(cache, storages, k, v, torch.tensor(SLOTS, device=device))
    # A second step with the same shapes (the cached path) and new values and slots.
    k, v = rows(len(SLOTS), dtype, device, seed=2)
    assert_same_write(cache, storages, k, v, torch.tensor(SLOTS[::-1], device=device))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["static", "static-pool"])
@pytest.mark.parametrize(("dtype", "kv_dtype"), [d for d in DTYPES if d[1] != "auto"])
def test_static_scales_write_what_paged_core_writes(dtype, kv_dtype, layout, device):
    # Codes quantized with the fixed scales (most of these rows saturate at ±q_max * scale),
    # and the scales left as they were.
    cache, storages = make_cache(layout, dtype, kv_dtype, device)
    assert cache.static_scales
    scales = [t.clone() for t in cache._scales()]
    for seed, slots in ((1, SLOTS), (2, SLOTS[::-1])):
        k, v = rows(len(SLOTS), dtype, device, seed=seed)
        assert_same_write(cache, storages, k, v, torch.tensor(slots, device=device))
    assert all(torch.equal(a, b) for a, b in zip(cache._scales(), scales, strict=True))


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("rows_layout", ["fused", "strided"])
@pytest.mark.parametrize(
    ("dtype", "kv_dtype"),
    [(torch.bfloat16, "auto"), (torch.float16, "int8"), (torch.bfloat16, "fp8"), (torch.float16, "fp8_e5m2")],
)
def test_strided_rows(dtype, kv_dtype, rows_layout, device):
    cache, storages = make_cache("pool", dtype, kv_dtype, device)
    k, v = rows(len(SLOTS), dtype, device, seed=3, layout=rows_layout)
    assert not k.is_contiguous() and not v.is_contiguous()
    assert_same_write(cache, storages, k, v, torch.tensor(SLOTS, device=device))


@CPU
@pytest.mark.parametrize("index_dtype", [torch.int64, torch.int32])
def test_int32_and_int64_and_strided_slot_mapping(index_dtype):
    slots = [s if s < 2**31 else -(2**31) for s in SLOTS]  # int32's extreme instead of 2**40
    cache, storages = make_cache("allocated", torch.float16, "int8", "cpu")
    k, v = rows(len(slots), torch.float16, "cpu", seed=4)
    assert_same_write(cache, storages, k, v, torch.tensor(slots, dtype=index_dtype))
    spaced = torch.tensor([s for slot in slots for s in (slot, 0)], dtype=index_dtype)[::2]
    assert spaced.stride(0) == 2
    k, v = rows(len(slots), torch.float16, "cpu", seed=5)
    assert_same_write(cache, storages, k, v, spaced)


def test_a_batch_of_padding_only_writes_nothing():
    cache, storages = make_cache("contiguous", torch.float32, "fp8", "cpu")
    before = [s.clone() for s in storages]
    k, v = rows(4, torch.float32, "cpu", seed=6)
    write_kv(cache, k, v, torch.tensor([-1, NUM_SLOTS, -1, 2**40]))
    assert all(torch.equal(raw(s), raw(b)) for s, b in zip(storages, before, strict=True))


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_empty_batch(kv_dtype):
    cache, storages = make_cache("allocated", torch.bfloat16, kv_dtype, "cpu")
    before = [s.clone() for s in storages]
    k = torch.empty(0, H, D, dtype=torch.bfloat16)
    write_kv(cache, k, k, torch.empty(0, dtype=torch.int64))
    assert all(torch.equal(raw(s), raw(b)) for s, b in zip(storages, before, strict=True))


def _bad_inputs():
    """(id, k, v, slot_mapping) that paged_core.write_kv refuses, on a float16 cache (H, D)."""
    n = 3
    good = torch.zeros(n, H, D, dtype=torch.float16)
    slots = torch.tensor([0, 1, 2])
    return [
        ("k-shape", torch.zeros(n, H + 1, D, dtype=torch.float16), good, slots),
        ("v-rows", good, torch.zeros(n + 1, H, D, dtype=torch.float16), slots),
        ("k-2d", torch.zeros(n, H * D, dtype=torch.float16), good, slots),
        ("k-dtype", good.float(), good, slots),
        ("v-dtype", good, good.bfloat16(), slots),
        ("k-device", good.to("meta"), good, slots),
        ("v-not-a-tensor", good, good.tolist(), slots),
        ("slot-dtype", good, good, slots.float()),
        ("slot-2d", good, good, slots[None]),
        ("slot-rows", good, good, torch.tensor([0, 1])),
        ("slot-device", good, good, slots.to("meta")),
    ]


@pytest.mark.parametrize(("k", "v", "slots"), [c[1:] for c in _bad_inputs()], ids=[c[0] for c in _bad_inputs()])
def test_bad_inputs_give_paged_cores_error(k, v, slots):
    cache = allocate_kv_cache(NB, BS, H, D, dtype=torch.float16)
    with pytest.raises(InputError) as want:
        torch_write_kv(cache, k, v, slots)
    # Twice: after a good write of the same cache (whose signature is then remembered), a bad
    # one is still checked.
    for _ in range(2):
        with pytest.raises(InputError) as got:
            write_kv(cache, k, v, slots)
        assert str(got.value) == str(want.value)
        good = torch.ones(3, H, D, dtype=torch.float16)
        write_kv(cache, good, good, torch.tensor([0, 1, 2]))
    assert not cache.k[:NB, 3:].any(), "a refused write wrote something"


def test_a_cache_that_is_not_a_kvcache():
    k = torch.zeros(1, H, D)
    with pytest.raises(InputError) as want:
        torch_write_kv(object(), k, k, torch.tensor([0]))
    with pytest.raises(InputError) as got:
        write_kv(object(), k, k, torch.tensor([0]))
    assert str(got.value) == str(want.value)


def odd_rows(dtype: torch.dtype, device: str):
    """k, v [6, H, D] with NaN, +inf and -inf in some head vectors (one or several elements), and,
    in float32, a vector of subnormals whose max / q_max underflows to 0."""
    k, v = rows(6, dtype, device, seed=5)
    k[0, 1, 3] = float("nan")
    k[2, 0, 0] = float("-inf")
    k[2, 2, 5] = float("inf")
    v[1, 2, 7] = float("nan")
    v[1, 2, 8] = float("-inf")
    v[4, 0, 1] = float("inf")
    if dtype == torch.float32:
        k[5, 1] = 0.0
        k[5, 1, 0] = 1e-42
        v[5, 0] = 0.0
        v[5, 0, 3] = -3e-45
    return k, v


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("layout", ["contiguous", "static"])
@pytest.mark.parametrize(("dtype", "kv_dtype"), [d for d in DTYPES if d[1] != "auto" and d[0] != torch.float16])
def test_non_finite_and_subnormal_rows_write_what_paged_core_writes(dtype, kv_dtype, layout, device):
    # One rule in every write path (docs/reliability.md §4): a vector with a non-finite element
    # gets codes 0 and scale NaN; with static scales the element becomes fp8's NaN (int8: 0); a
    # vector of subnormals gets the floor scale, never 0. Same bytes as paged_core.write_kv.
    cache, storages = make_cache(layout, dtype, kv_dtype, device)
    k, v = odd_rows(dtype, device)
    assert_same_write(cache, storages, k, v, torch.tensor([0, 7, 13, 19, 5, 1], device=device))
    if layout == "contiguous":
        assert torch.isnan(cache.k_scale[0, 0, 1]) and torch.isnan(cache.v_scale[1, 3, 2])
        assert not bool(raw(cache.k[0, 0, 1]).any())
        if dtype == torch.float32:
            assert cache.k_scale[0, 1, 1].item() == 2.0**-126
    elif kv_dtype != "int8":
        assert int(cache.k.view(torch.uint8)[0, 0, 1, 3]) == 0x7F


@pytest.mark.parametrize("device", DEVICES)
def test_storage_replaced_in_place_is_written_not_the_old_one(device):
    # cache.k.set_(other) keeps the object: the check sees the new address, so the kernel (and
    # paged_core's write) write the new storage, never the old one the allocation still holds.
    cache = allocate_kv_cache(NB, BS, H, D, dtype=torch.float32, device=device)
    k, v = rows(3, torch.float32, device, seed=4)
    write_kv(cache, k, v, torch.tensor([0, 1, 2], device=device))
    old = cache._spill[0].clone()
    new = torch.zeros(NB, BS, H, D, device=device)
    cache.k.set_(new)
    write_kv(cache, k, v, torch.tensor([4, 5, 6], device=device))
    assert torch.equal(new[1, :3], k) and torch.equal(cache._spill[0], old)


def test_a_cache_resized_in_place_is_refused_naming_the_tensor():
    cache = allocate_kv_cache(NB, BS, H, D, dtype=torch.float32)
    k, v = rows(1, torch.float32, "cpu", seed=4)
    write_kv(cache, k, v, torch.tensor([0]))
    cache.k.resize_(0)
    with pytest.raises(InputError, match=r"cache.k is float32 \[0\]; accepted: a 4-D tensor"):
        write_kv(cache, k, v, torch.tensor([0]))


def test_a_new_token_count_is_checked_and_written():
    # The remembered plan is shared by every token count; each count is still checked.
    cache, storages = make_cache("contiguous", torch.float32, "int8", "cpu")
    for n in (5, 2, 7):
        k, v = rows(n, torch.float32, "cpu", seed=n)
        assert_same_write(cache, storages, k, v, torch.arange(n) * 2)
    k, v = rows(3, torch.float32, "cpu", seed=9)
    with pytest.raises(InputError, match="one row per slot_mapping entry"):
        write_kv(cache, k, v, torch.arange(4))


def test_a_replaced_cache_field_is_written_not_the_old_tensor():
    cache, storages = make_cache("allocated", torch.float32, "auto", "cpu")
    k, v = rows(3, torch.float32, "cpu", seed=7)
    write_kv(cache, k, v, torch.tensor([0, 1, 2]))
    new = dataclasses.replace(cache, k=torch.zeros_like(cache.k), v=torch.zeros_like(cache.v))
    before = [s.clone() for s in storages]
    write_kv(new, k, v, torch.tensor([4, 5, 6]))
    assert torch.equal(new.k[1, :3], k) and torch.equal(new.v[1, :3], v)
    assert all(torch.equal(raw(s), raw(b)) for s, b in zip(storages, before, strict=True))


def test_the_triton_backend_writes_with_the_kernel(monkeypatch):
    import paged_triton_common.backend as backend_module

    backend = registry.get("triton-unified")
    assert isinstance(backend, TritonBackend)
    calls = []
    monkeypatch.setattr(backend_module, "write_checked", lambda *args: calls.append(args))
    meta = BatchMeta.build([3, 1], [6, 5], block_size=BS, num_blocks=NB, seed=3)
    cache = backend.allocate(NB, BS, H, CLAIMED_D, dtype=torch.float32)
    k = torch.randn(meta.num_tokens, H, CLAIMED_D)
    backend.write(cache, k, k, meta)
    assert len(calls) == 1 and calls[0][0] is cache and calls[0][3] is meta.slot_mapping


@pytest.mark.parametrize("kv_dtype", ["auto", "fp8", "fp8_e5m2"])
def test_backend_write_equals_paged_core(kv_dtype, monkeypatch):
    monkeypatch.setitem(globals(), "D", CLAIMED_D)
    backend = registry.get("triton-unified")
    meta = BatchMeta.build([3, 1, 2], [6, 4, 2], block_size=BS, num_blocks=NB, seed=7)
    cache, storages = make_cache("hnd", torch.bfloat16, kv_dtype, "cpu")
    want_cache, want = clone_cache(cache, storages)
    k, v = rows(meta.num_tokens, torch.bfloat16, "cpu", seed=8)
    torch_write_kv(want_cache, k, v, meta.slot_mapping)
    backend.write(cache, k, v, meta)
    assert all(torch.equal(raw(s), raw(w)) for s, w in zip(storages, want, strict=True))


@triton.jit
def _codes_kernel(y_ptr, fp8_ptr, int8_ptr, e5m2_ptr, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    mask = offs < n
    y = tl.load(y_ptr + offs, mask=mask, other=0.0)
    fp8 = triton_write._e4m3fn_code(tl.minimum(tl.maximum(y, -448.0), 448.0))
    tl.store(fp8_ptr + offs, fp8.to(tl.uint8), mask=mask)
    r = (y + 12582912.0) - 12582912.0
    tl.store(int8_ptr + offs, tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8), mask=mask)
    e5m2 = triton_write._e5m2_code(tl.minimum(tl.maximum(y, -57344.0), 57344.0))
    tl.store(e5m2_ptr + offs, e5m2.to(tl.uint8), mask=mask)


def _midpoints(code_dtype: torch.dtype, beyond: float) -> torch.Tensor:
    """Every finite non-negative value of ``code_dtype``, the midpoints between neighbours (ties)
    and one float32 step either side of each."""
    values = torch.arange(256, dtype=torch.uint8).view(code_dtype).float()
    values = values[values.isfinite() & (values >= 0)].sort().values
    mids = (values[1:] + values[:-1]) / 2
    return torch.cat([values, mids, mids.nextafter(torch.tensor(0.0)), mids.nextafter(torch.tensor(beyond))])


@pytest.mark.parametrize("device", DEVICES)
def test_code_conversions_equal_torch_on_every_fp8_midpoint(device):
    # Every E4M3 and E5M2 value, the midpoints between neighbours (ties) and one float32 step
    # either side of each, both signs, plus int8 halves and random values: the kernel's
    # conversions of quantized values (y = x / scale) against torch's .clamp().to(float8_*) and
    # .round().clamp().to(int8).
    points = torch.cat([_midpoints(torch.float8_e4m3fn, 500.0), _midpoints(torch.float8_e5m2, 65536.0)])
    halves = torch.arange(-128, 128) + 0.5
    g = torch.Generator().manual_seed(11)
    y = torch.cat(
        [
            points,
            -points,
            halves,
            halves.nextafter(torch.tensor(0.0)),
            torch.tensor([480.0, -1000.0, 61440.0, -1e6]),
            (torch.rand(4000, generator=g) - 0.5) * 300,
            torch.randn(4000, generator=g) * 2**-7,
            (torch.rand(4000, generator=g) - 0.5) * 2**17,
            torch.randn(4000, generator=g) * 2**-15,
        ]
    )
    fp8 = torch.empty(len(y), dtype=torch.uint8, device=device)
    int8 = torch.empty(len(y), dtype=torch.int8, device=device)
    e5m2 = torch.empty(len(y), dtype=torch.uint8, device=device)
    _codes_kernel[(triton.cdiv(len(y), 1024),)](y.to(device), fp8, int8, e5m2, len(y), BLOCK=1024)
    want_fp8 = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn).view(torch.uint8)
    want_int8 = y.round().clamp(-127, 127).to(torch.int8)
    want_e5m2 = y.clamp(-57344.0, 57344.0).to(torch.float8_e5m2).view(torch.uint8)
    assert torch.equal(fp8.cpu(), want_fp8), f"fp8 differs at y = {y[fp8.cpu() != want_fp8][:5].tolist()}"
    assert torch.equal(int8.cpu(), want_int8), f"int8 differs at y = {y[int8.cpu() != want_int8][:5].tolist()}"
    assert torch.equal(e5m2.cpu(), want_e5m2), f"e5m2 differs at y = {y[e5m2.cpu() != want_e5m2][:5].tolist()}"


def test_the_changing_arguments_come_first():
    # The direct launch passes k, v and slot_mapping before the remembered rest of the arguments.
    params = list(inspect.signature(triton_write.write_kv_kernel.fn).parameters)
    assert params[:3] == ["k_ptr", "v_ptr", "slot_mapping_ptr"]


@GPU
@pytest.mark.parametrize(
    ("dtype", "kv_dtype"), [(torch.bfloat16, "auto"), (torch.bfloat16, "int8"), (torch.float16, "fp8")]
)
def test_gpu_first_call_inside_a_cuda_graph_capture(dtype, kv_dtype):
    # A head count no other test uses: the kernel compiles inside the capture (DirectKernel).
    cache = allocate_kv_cache(NB, BS, 5, 40, dtype=dtype, kv_dtype=kv_dtype, device="cuda")
    want = dataclasses.replace(
        cache,
        k=cache.k.clone(),
        v=cache.v.clone(),
        k_scale=None if cache.k_scale is None else cache.k_scale.clone(),
        v_scale=None if cache.v_scale is None else cache.v_scale.clone(),
        _spill=None,
    )
    k = torch.zeros(6, 5, 40, dtype=dtype, device="cuda")
    v = torch.zeros_like(k)
    slots = torch.tensor([3, -1, 17, 0, NUM_SLOTS, 9], device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        write_kv(cache, k, v, slots)
    k.copy_(torch.randn_like(k) * 3)
    v.copy_(torch.randn_like(v))
    graph.replay()
    torch_write_kv(want, k, v, slots)
    for name in ("k", "v", "k_scale", "v_scale"):
        got, ref = getattr(cache, name), getattr(want, name)
        assert (got is None and ref is None) or torch.equal(raw(got), raw(ref)), name
