"""The paged KV cache: allocation, int8/fp8 quantization bounds, write-then-read, byte counts.

Quantization bounds (per element, per (token, head) vector x with amax = max|x|):

* int8: scale = amax / 127, code = round(x / scale) in [-127, 127], so
  |x - code * scale| <= scale / 2.
* fp8 E4M3 (3 mantissa bits, max 448, min normal 2**-6, subnormal step 2**-9): scale = amax / 448
  and y = x / scale lies in [-448, 448]. Round-to-nearest of a normal y errs by at most half a step,
  2**(e-4) <= 2**-4 * |y| (e = floor(log2 |y|)); a subnormal y (|y| < 2**-6) errs by at most
  2**-10. So |x - dequantized| <= max(2**-4 * |x|, 2**-10 * scale) <= 2**-4 * |x| + 2**-10 * scale,
  which is <= 2**-4 * amax: fp8 keeps every element within 1/16 of the vector's max.
* fp8 E5M2 (2 mantissa bits, max 57344, min normal 2**-14, subnormal step 2**-16): the same
  argument with half a step 2**(e-3) <= 2**-3 * |y| and 2**-17 below the normals, so
  |x - dequantized| <= 2**-3 * |x| + 2**-17 * scale <= 2**-3 * amax (within 1/8 of the max).

All get a float32 slack of 1e-5 * scale for the division and the multiplication.
"""

from __future__ import annotations

import pytest
import torch
from paged_core import (
    Q_MAX,
    BatchMeta,
    InputError,
    KVCache,
    allocate_kv_cache,
    dequantize_kv,
    kv_bytes_per_token,
    pack_int4,
    quantize_kv,
    static_scale,
    unpack_int4,
    write_kv,
)

SLACK = 1e-5
#: fp8 formats: kv_dtype -> (code dtype, q_max, mantissa bits, exponent of the smallest normal).
FP8 = {"fp8": (torch.float8_e4m3fn, 448.0, 3, -6), "fp8_e5m2": (torch.float8_e5m2, 57344.0, 2, -14)}


def fp8_bound(kv_dtype, x, scale):
    """The round-trip bound of the module docstring: 2**-(m+1) * |x| + half a subnormal step * scale."""
    _, _, m, emin = FP8[kv_dtype]
    return 2.0 ** -(m + 1) * x.abs() + (2.0 ** (emin - m - 1) + SLACK) * scale


def spread(shape, seed) -> torch.Tensor:
    """Random values over many magnitudes (so fp8 subnormals occur), a few exact zero vectors."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(shape, generator=g) * torch.exp(4 * torch.randn(shape, generator=g))
    x[0] = 0.0  # every head vector of token 0 is zero
    x[5, 1] = 0.0  # and one single head vector
    return x


# ---------------------------------------------------------------------------------- allocate
@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "store"),
    [
        (torch.bfloat16, "auto", torch.bfloat16),
        (torch.float16, "auto", torch.float16),
        (torch.float32, "auto", torch.float32),
        (torch.bfloat16, "int8", torch.int8),
        (torch.float16, "fp8", torch.float8_e4m3fn),
        (torch.bfloat16, "fp8_e5m2", torch.float8_e5m2),
    ],
)
def test_allocate(dtype, kv_dtype, store):
    cache = allocate_kv_cache(5, 16, 3, 32, dtype=dtype, kv_dtype=kv_dtype)
    for t in (cache.k, cache.v):
        assert t.shape == (5, 16, 3, 32) and t.dtype == store and t.device.type == "cpu"
        assert not t.float().any()
    assert (cache.num_blocks, cache.block_size, cache.num_kv_heads, cache.head_dim) == (5, 16, 3, 32)
    assert cache.dtype == dtype and cache.kv_dtype == kv_dtype
    assert cache.quantized == (kv_dtype != "auto")
    if kv_dtype == "auto":
        assert cache.k_scale is None and cache.v_scale is None
    else:
        for s in (cache.k_scale, cache.v_scale):
            assert s.shape == (5, 16, 3) and s.dtype == torch.float32
    k, v = cache.dequantized()
    assert k.dtype == torch.float32 and k.shape == (5, 16, 3, 32)


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        (dict(kv_dtype="fp4"), ["kv_dtype 'fp4' is not one of auto, int8, fp8, fp8_e5m2"]),
        (dict(dtype=torch.int32), ["dtype is torch.int32", "torch.float32, torch.float16, torch.bfloat16"]),
        (dict(num_blocks=0), ["num_blocks is 0", "accepted: a positive int"]),
        (dict(head_dim=2.5), ["head_dim is 2.5", "accepted: a positive int"]),
    ],
)
def test_allocate_rejects(kwargs, needles):
    args = dict(num_blocks=4, block_size=16, num_kv_heads=2, head_dim=8)
    args.update(kwargs)
    with pytest.raises(InputError) as exc:
        allocate_kv_cache(
            args.pop("num_blocks"),
            args.pop("block_size"),
            args.pop("num_kv_heads"),
            args.pop("head_dim"),
            **args,
        )
    for n in needles:
        assert n in str(exc.value)


# ---------------------------------------------------------------------------------- quantize
@pytest.mark.parametrize("seed", range(3))
def test_int8_round_trip(seed):
    x = spread((64, 4, 48), seed)
    codes, scale = quantize_kv(x, "int8")
    assert codes.dtype == torch.int8 and codes.shape == x.shape
    assert scale.dtype == torch.float32 and scale.shape == x.shape[:-1]
    amax = x.double().abs().amax(-1)
    nz = amax > 0
    torch.testing.assert_close(scale.double()[nz], amax[nz] / 127, rtol=1e-6, atol=0)
    assert (scale > 0).all() and torch.isfinite(scale).all()
    assert codes.abs().max() <= 127
    # The largest element of each non-zero vector maps to the extreme code.
    assert (codes.abs().amax(-1)[nz] == 127).all()
    err = (dequantize_kv(codes, scale).double() - x.double()).abs()
    bound = scale.double()[..., None] * (0.5 + SLACK)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    # Zero vectors come back exactly zero.
    assert not dequantize_kv(codes, scale)[~nz].any()


@pytest.mark.parametrize("kv_dtype", list(FP8))
@pytest.mark.parametrize("seed", range(3))
def test_fp8_round_trip(seed, kv_dtype):
    code_dtype, q_max, m, emin = FP8[kv_dtype]
    x = spread((64, 4, 48), seed)
    codes, scale = quantize_kv(x, kv_dtype)
    assert codes.dtype == code_dtype and scale.dtype == torch.float32
    amax = x.double().abs().amax(-1)
    nz = amax > 0
    torch.testing.assert_close(scale.double()[nz], amax[nz] / q_max, rtol=1e-6, atol=0)
    assert codes.float().abs().max() <= q_max
    # The largest element of each non-zero vector maps to the largest code.
    assert (codes.float().abs().amax(-1)[nz] == q_max).all()
    xd, s = x.double(), scale.double()[..., None]
    err = (dequantize_kv(codes, scale).double() - xd).abs()
    bound = fp8_bound(kv_dtype, xd, s)
    assert (err <= bound).all(), f"worst excess {(err - bound).max().item()}"
    assert (err <= (2.0 ** -(m + 1) + SLACK) * amax[..., None]).all()
    assert not dequantize_kv(codes, scale)[~nz].any()
    # The spread inputs do reach the format's subnormal range, so that branch of the bound is exercised.
    y = (xd / s).abs()
    assert ((y > 0) & (y < 2.0**emin)).any()


def test_e5m2_is_coarser_and_wider_than_e4m3():
    # 1 + 2**-3 (times the max / 448) is an E4M3 code, but a tie between E5M2's codes 1 and
    # 1.25 (rounds to even: 1); 2**-20 of the max is below E4M3's subnormals (0), not E5M2's.
    x = torch.tensor([[57344.0, 128.0 * (1 + 2**-3), 57344.0 * 2**-20]])
    e4, s4 = quantize_kv(x, "fp8")
    e5, s5 = quantize_kv(x, "fp8_e5m2")
    assert s4.item() == 128.0 and e4.float().tolist() == [[448.0, 1.125, 0.0]]
    assert s5.item() == 1.0 and e5.float().tolist() == [[57344.0, 128.0, 57344.0 * 2**-20]]


def test_quantize_known_values():
    codes, scale = quantize_kv(torch.tensor([[1.0, -2.0, 0.5, 0.0]]), "int8")
    assert codes.tolist() == [[64, -127, 32, 0]]  # 0.5 * 127 = 63.5 -> 64, 0.25 * 127 = 31.75 -> 32
    assert scale.item() == pytest.approx(2.0 / 127, rel=1e-7)
    codes, scale = quantize_kv(torch.tensor([[448.0, -224.0, 1.0]]), "fp8")
    assert scale.item() == 1.0 and codes.float().tolist() == [[448.0, -224.0, 1.0]]
    codes, scale = quantize_kv(torch.tensor([[57344.0, -0.375, 1.0]]), "fp8_e5m2")
    assert codes.dtype == torch.float8_e5m2
    assert scale.item() == 1.0 and codes.float().tolist() == [[57344.0, -0.375, 1.0]]
    assert Q_MAX == {"int8": 127.0, "fp8": 448.0, "fp8_e5m2": 57344.0, "int4": 7.0, "kivi4": 7.0}
    with pytest.raises(InputError, match="kv_dtype 'auto' cannot be quantized to; accepted: int8, fp8, fp8_e5m2, int4"):
        quantize_kv(torch.ones(2, 4), "auto")


# ---------------------------------------------------------------------------------- write
def fill_random(cache: KVCache, seed: int) -> None:
    """Give every slot some random prior content, so 'untouched' means something."""
    g = torch.Generator().manual_seed(seed)
    for t in (cache.k, cache.v):
        vals = torch.randn(t.shape, generator=g)
        if t.dtype == torch.int8:
            t.copy_(torch.randint(-127, 128, t.shape, generator=g, dtype=torch.int8))
        elif t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t.view(torch.uint8).copy_(vals.to(t.dtype).view(torch.uint8))
        else:
            t.copy_(vals)
    for s in (cache.k_scale, cache.v_scale):
        if s is not None:
            s.copy_(torch.rand(s.shape, generator=g) + 0.1)


def snapshot(cache: KVCache) -> list[torch.Tensor]:
    """Raw bits of every store, flattened to [num_slots, ...]."""
    out = []
    for t in (cache.k, cache.v, cache.k_scale, cache.v_scale):
        if t is None:
            continue
        if t.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            t = t.view(torch.uint8)
        out.append(t.reshape(t.shape[0] * t.shape[1], *t.shape[2:]).clone())
    return out


def assert_only_slots_changed(before, after, written: set[int]):
    keep = torch.tensor([i not in written for i in range(before[0].shape[0])])
    for b, a in zip(before, after, strict=True):
        assert torch.equal(b[keep], a[keep]), "a slot that was not written changed"


def check_slot(cache: KVCache, slot: int, k_row: torch.Tensor, v_row: torch.Tensor):
    """The cache at ``slot`` holds (k_row, v_row): exactly, or within the quantization bound."""
    bs = cache.block_size
    b, o = divmod(slot, bs)
    for store, scales, row in ((cache.k, cache.k_scale, k_row), (cache.v, cache.v_scale, v_row)):
        x = row.double()  # [Hkv, D]
        if not cache.quantized:
            assert torch.equal(store[b, o], row)
            continue
        codes = store[b, o].double()
        s = scales[b, o].double()  # [Hkv]
        amax = x.abs().amax(-1)
        nz = amax > 0
        torch.testing.assert_close(s[nz], amax[nz] / Q_MAX[cache.kv_dtype], rtol=1e-6, atol=0)
        got = codes * s[:, None]
        if cache.kv_dtype == "int8":
            bound = s[:, None] * (0.5 + SLACK)
        else:
            bound = fp8_bound(cache.kv_dtype, x, s[:, None])
        assert ((got - x).abs() <= bound).all()


KV_CASES = [
    (torch.bfloat16, "auto"),
    (torch.float32, "auto"),
    (torch.float16, "int8"),
    (torch.bfloat16, "fp8"),
    (torch.float16, "fp8_e5m2"),
]


@pytest.mark.parametrize(("dtype", "kv_dtype"), KV_CASES, ids=[f"{d}-{k}" for d, k in KV_CASES])
def test_write_through_slot_mapping(dtype, kv_dtype):
    # Mixed batch with a padding request (rows 6..7 of 12: slot -1).
    meta = BatchMeta.build([3, 1, 2, 5, 1], [19, 9, 0, 5, 30], block_size=8, num_blocks=16, seed=4)
    cache = allocate_kv_cache(16, 8, 2, 16, dtype=dtype, kv_dtype=kv_dtype)
    fill_random(cache, seed=1)
    g = torch.Generator().manual_seed(2)
    k = (torch.randn(meta.num_tokens, 2, 16, generator=g) * 3).to(dtype)
    v = (torch.randn(meta.num_tokens, 2, 16, generator=g) * 3).to(dtype)
    k[0, 1] = 0.0  # a zero head vector
    before = snapshot(cache)
    write_kv(cache, k, v, meta.slot_mapping)
    slots = meta.slot_mapping.tolist()
    assert slots.count(-1) == 2
    written = {s for s in slots if s >= 0}
    assert len(written) == meta.num_tokens - 2
    for row, s in enumerate(slots):
        if s >= 0:
            check_slot(cache, s, k[row], v[row])
    assert_only_slots_changed(before, snapshot(cache), written)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize("spill", [True, False], ids=["allocated", "wrapped"])
def test_out_of_range_slots_are_ignored(kv_dtype, spill):
    cache = allocate_kv_cache(4, 4, 1, 8, dtype=torch.float32, kv_dtype=kv_dtype)
    if not spill:
        # A cache wrapped around an engine's own tensors has no hidden spill block.
        cache = KVCache(
            k=cache.k.clone(),
            v=cache.v.clone(),
            kv_dtype=kv_dtype,
            k_scale=None if cache.k_scale is None else cache.k_scale.clone(),
            v_scale=None if cache.v_scale is None else cache.v_scale.clone(),
            dtype=torch.float32,
        )
        assert cache._spill is None
    fill_random(cache, seed=5)
    before = snapshot(cache)
    slots = torch.tensor([16, 3, -1, 1000, -7, 15])  # 16 slots in the pool: 0..15
    k = torch.randn(6, 1, 8) + 1
    v = torch.randn(6, 1, 8) - 1
    write_kv(cache, k, v, slots)
    check_slot(cache, 3, k[1], v[1])
    check_slot(cache, 15, k[5], v[5])
    assert_only_slots_changed(before, snapshot(cache), {3, 15})


def test_backend_write_uses_meta():
    from paged_core import ReferenceBackend

    meta = BatchMeta.build([2, 1], [2, 0], block_size=4, num_blocks=3, seed=0)
    be = ReferenceBackend()
    cache = be.allocate(3, 4, 1, 4, dtype=torch.float32)
    k, v = torch.arange(12.0).reshape(3, 1, 4), -torch.arange(12.0).reshape(3, 1, 4)
    be.write(cache, k, v, meta)
    blk = meta.block_table[0, 0].item()
    assert torch.equal(cache.k[blk, :2], k[:2]) and torch.equal(cache.v[blk, :2], v[:2])
    assert cache.k.count_nonzero() == k[:2].count_nonzero()


def test_write_empty_is_a_no_op():
    cache = allocate_kv_cache(2, 4, 1, 4, dtype=torch.float32)
    write_kv(cache, torch.empty(0, 1, 4), torch.empty(0, 1, 4), torch.empty(0, dtype=torch.int64))
    assert not cache.k.any()


@pytest.mark.parametrize(
    ("change", "needles"),
    [
        ("k-heads", ["k has shape [3, 3, 8]", "accepted: [num_tokens=3, num_kv_heads=2, head_dim=8]"]),
        ("v-rows", ["v has shape [2, 2, 8]", "accepted: [num_tokens=3, num_kv_heads=2, head_dim=8]"]),
        ("k-dtype", ["k is float16 but the cache was allocated for bfloat16", "accepted: bfloat16"]),
        ("v-device", ["v is on meta but the cache is on cpu"]),
        ("slots-device", ["slot_mapping is on meta but the cache is on cpu"]),
        ("slots-2d", ["slot_mapping is int64 [3, 1]", "accepted: int64 or int32 [num_tokens]"]),
        ("slots-float", ["slot_mapping is float32 [3]", "accepted: int64 or int32 [num_tokens]"]),
    ],
)
def test_write_rejects(change, needles):
    cache = allocate_kv_cache(4, 4, 2, 8, dtype=torch.bfloat16, kv_dtype="int8")
    k = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    v = torch.randn(3, 2, 8, dtype=torch.bfloat16)
    slots = torch.tensor([0, 1, 2])
    if change == "k-heads":
        k = torch.randn(3, 3, 8, dtype=torch.bfloat16)
    elif change == "v-rows":
        v = v[:2]
    elif change == "k-dtype":
        k = k.half()
    elif change == "v-device":
        v = v.to("meta")
    elif change == "slots-device":
        slots = slots.to("meta")
    elif change == "slots-2d":
        slots = slots[:, None]
    elif change == "slots-float":
        slots = slots.float()
    before = snapshot(cache)
    with pytest.raises(InputError) as exc:
        write_kv(cache, k, v, slots)
    for n in needles:
        assert n in str(exc.value), str(exc.value)
    assert_only_slots_changed(before, snapshot(cache), set())


# ---------------------------------------------------------------------------------- bytes
def test_kv_bytes_per_token():
    # Qwen3-8B: 8 KV heads of 128, 36 layers, bf16: 2 (K and V) * 8 * 128 * 2 bytes * 36.
    assert kv_bytes_per_token(8, 128, num_layers=36) == 147_456
    assert kv_bytes_per_token(8, 128, dtype=torch.bfloat16, num_layers=36) == 147_456
    assert kv_bytes_per_token(8, 128, dtype=torch.float32) == 8_192
    assert kv_bytes_per_token(8, 128, dtype=torch.float16) == 4_096
    # int8 / fp8: one byte per element plus a float32 scale per (K or V, head).
    assert kv_bytes_per_token(8, 128, kv_dtype="int8", num_layers=36) == 36 * (2048 + 64) == 76_032
    assert kv_bytes_per_token(8, 128, kv_dtype="fp8") == 2048 + 64
    assert kv_bytes_per_token(8, 128, kv_dtype="fp8_e5m2") == 2048 + 64


def test_kv_bytes_matches_allocation():
    for kv_dtype in ("auto", "int8", "fp8", "fp8_e5m2"):
        cache = allocate_kv_cache(3, 16, 4, 64, dtype=torch.float16, kv_dtype=kv_dtype)
        stores = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if cache.quantized else [])
        total = sum(t.numel() * t.element_size() for t in stores)
        assert total == 3 * 16 * kv_bytes_per_token(4, 64, dtype=torch.float16, kv_dtype=kv_dtype)


# ------------------------------------------------------------------------------ static scales


def test_static_scales_are_views_one_per_kv_head():
    per_head = torch.tensor([0.5, 0.25])
    cache = allocate_kv_cache(4, 16, 2, 8, kv_dtype="int8", k_scale=per_head, v_scale=0.125)
    assert cache.static_scales
    assert tuple(cache.k_scale.shape) == (4, 16, 2) and cache.k_scale.stride()[:2] == (0, 0)
    assert cache.k_scale[3, 15].tolist() == [0.5, 0.25] and cache.v_scale[0, 0].tolist() == [0.125, 0.125]
    # A view of the engine's tensor: a scale updated in place is the cache's scale.
    per_head.mul_(2)
    assert cache.k_scale[1, 2].tolist() == [1.0, 0.5]
    assert not allocate_kv_cache(4, 16, 2, 8, kv_dtype="int8").static_scales
    assert not allocate_kv_cache(4, 16, 2, 8).static_scales


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "fp8_e5m2"])
def test_a_static_write_quantizes_with_the_scale_and_leaves_it(kv_dtype):
    ks, vs = torch.tensor([0.01, 0.02]), torch.tensor([0.05])
    ks0, vs0 = ks.clone(), vs.clone()
    cache = allocate_kv_cache(3, 4, 2, 4, dtype=torch.float32, kv_dtype=kv_dtype, k_scale=ks, v_scale=vs)
    k = torch.tensor([[[0.5, -0.123, 5000.0, 0.0], [1.0, -1.0, 0.017, 2000.0]]])  # [1 token, 2 heads, 4]
    v = torch.tensor([[[0.25, 0.1, -0.5, 100.0], [0.0, 0.07, -0.3, 1.0]]])
    write_kv(cache, k, v, torch.tensor([6]))  # block 1, slot 2
    q_max = Q_MAX[kv_dtype]
    # Hand-written expectations: x / scale, rounded (int8) or cast (fp8), clamped to ±q_max.
    for codes, x, scale in ((cache.k, k, ks.view(1, 2, 1)), (cache.v, v, vs.view(1, 1, 1))):
        y = (x / scale).clamp(-q_max, q_max)
        want = y.round().to(torch.int8) if kv_dtype == "int8" else y.to(FP8[kv_dtype][0])
        assert torch.equal(codes[1, 2:3].view(torch.uint8), want.view(torch.uint8))
        assert int(codes.view(torch.uint8).count_nonzero()) == int(want.view(torch.uint8).count_nonzero())
    assert torch.equal(ks, ks0) and torch.equal(vs, vs0)
    # 5000 / 0.01 and 2000 / 0.02 (1e5, beyond every format) saturate: the values read back are
    # the format's edge.
    kf, _ = cache.dequantized()
    assert kf[1, 2, 0, 2].item() == pytest.approx(q_max * 0.01) and kf[1, 2, 1, 3].item() == pytest.approx(q_max * 0.02)


def test_attention_on_a_static_cache_is_attention_on_its_values():
    # The reference reads codes * the static scale: the same answer as attention over those
    # values in a full-precision cache (their float32 products: within float32 rounding).
    torch.manual_seed(0)
    meta = BatchMeta.build([3, 1], [3, 9], block_size=4, num_blocks=8)
    cache = allocate_kv_cache(
        8, 4, 2, 8, dtype=torch.float32, kv_dtype="int8", k_scale=torch.tensor([0.02, 0.03]), v_scale=0.04
    )
    k, v = torch.randn(meta.num_tokens, 2, 8), torch.randn(meta.num_tokens, 2, 8)
    write_kv(cache, k, v, meta.slot_mapping)
    kf, vf = cache.dequantized()
    plain = KVCache(k=kf, v=vf, kv_dtype="auto", dtype=torch.float32)
    q = torch.randn(meta.num_tokens, 4, 8)
    from paged_core import reference_attention

    got = reference_attention(q, cache, meta, compute_dtype=torch.float64)
    want = reference_attention(q, plain, meta, compute_dtype=torch.float64)
    assert torch.allclose(got, want, rtol=0, atol=1e-6)
    assert kf.abs().max() > 0  # the write put codes there


@pytest.mark.parametrize(
    ("kwargs", "needles"),
    [
        (dict(kv_dtype="int8", k_scale=0.1), ["k_scale is given but v_scale is not"]),
        (dict(kv_dtype="auto", k_scale=0.1, v_scale=0.1), ["kv_dtype 'auto'", "int8, fp8, fp8_e5m2"]),
        (dict(kv_dtype="fp8", k_scale=0.0, v_scale=0.1), ["k_scale holds [0.0]", "positive, finite"]),
        (dict(kv_dtype="fp8", k_scale=0.1, v_scale=float("nan")), ["v_scale holds", "positive, finite"]),
        (dict(kv_dtype="fp8_e5m2", k_scale=-1.0, v_scale=0.1), ["k_scale holds [-1.0]", "positive, finite"]),
        (
            dict(kv_dtype="int8", k_scale=torch.tensor([0.1, 0.2, 0.3]), v_scale=0.1),
            ["k_scale is float32 [3]", "[num_kv_heads=2]"],
        ),
        (
            dict(kv_dtype="int8", k_scale=torch.tensor([0.1], dtype=torch.float64), v_scale=0.1),
            ["k_scale is float64 [1]", "a float32 tensor"],
        ),
        (dict(kv_dtype="int8", k_scale="0.1", v_scale=0.1), ["k_scale is '0.1'", "a positive float"]),
        (dict(kv_dtype="int8", k_scale=True, v_scale=0.1), ["k_scale is True"]),
    ],
)
def test_static_scales_that_cannot_be_used_are_refused(kwargs, needles):
    with pytest.raises(InputError) as exc:
        allocate_kv_cache(4, 16, 2, 8, **kwargs)
    assert all(n in str(exc.value) for n in needles), str(exc.value)


def test_a_cache_mixing_static_and_per_slot_scales_is_refused():
    static = allocate_kv_cache(4, 16, 2, 8, kv_dtype="int8", k_scale=0.1, v_scale=0.1)
    per_slot = allocate_kv_cache(4, 16, 2, 8, kv_dtype="int8")
    mixed = KVCache(k=static.k, v=static.v, kv_dtype="int8", k_scale=static.k_scale, v_scale=per_slot.v_scale)
    with pytest.raises(InputError, match="k_scale is static but cache.v_scale is per slot"):
        mixed.check()
    # Per-slot scales in shared memory (an expanded head dimension) would take several slots'
    # writes on one float.
    overlapping = per_slot.k_scale[:, :, :1].expand(4, 16, 2)
    bad = KVCache(k=per_slot.k, v=per_slot.v, kv_dtype="int8", k_scale=overlapping, v_scale=per_slot.v_scale)
    with pytest.raises(InputError, match=r"strides \(32, 2, 0\)"):
        bad.check()


def test_quantize_with_a_scale_that_does_not_broadcast_is_refused():
    with pytest.raises(InputError, match="does not broadcast"):
        quantize_kv(torch.ones(3, 2, 4), "int8", torch.ones(3))
    with pytest.raises(InputError, match="a float32 tensor"):
        quantize_kv(torch.ones(3, 2, 4), "int8", 0.5)


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "fp8_e5m2"])
@pytest.mark.parametrize(("num_blocks", "block_size", "heads"), [(5, 1, 4), (1, 1, 2), (1, 4, 1), (3, 1, 1)])
def test_a_static_cache_with_size_one_dimensions_is_usable(kv_dtype, num_blocks, block_size, heads):
    # allocate(..., block_size=1, kv_dtype="fp8", k_scale=...) returned a cache its own write
    # refused: expand keeps a stride of 1 on the size-1 slot dimension.
    from paged_core import BatchMeta, ReferenceBackend

    cache = allocate_kv_cache(
        num_blocks, block_size, heads, 8, dtype=torch.float32, kv_dtype=kv_dtype, k_scale=0.05, v_scale=0.02
    )
    assert cache.static_scales and cache.kv_scales == "per_tensor"
    meta = BatchMeta.build([1], [1], block_size=block_size, allocator=_Counting(num_blocks))
    k = torch.randn(1, heads, 8)
    b = ReferenceBackend(validate=True)
    b.write(cache, k, k, meta)
    assert torch.equal(cache.k_scale, torch.full_like(cache.k_scale, 0.05))  # the scales stay
    out = b.forward(torch.randn(1, heads, 8), cache, meta)
    assert torch.isfinite(out).all()


def test_a_per_slot_cache_of_one_slot_stays_per_slot():
    cache = allocate_kv_cache(1, 1, 2, 8, kv_dtype="int8")
    assert not cache.static_scales and cache.kv_scales == "per_slot"


class _Counting:
    """Blocks 0 .. n - 1 in order (a one-block cache has only block 0)."""

    def __init__(self, n):
        self.free = list(range(n))

    def allocate(self, n):
        out, self.free = self.free[:n], self.free[n:]
        return out


def test_int4_codes_pack_two_to_a_byte_low_nibble_first():
    codes, scale = quantize_kv(torch.tensor([[7.0, -7.0, 1.0, -0.5, 0.0, 3.0]]), "int4")
    # Codes 7, -7, 1, -0.5 -> -0 (round half to even), 0, 3; element 2i in the low nibble.
    assert scale.item() == 1.0 and codes.dtype == torch.uint8 and codes.shape == (1, 3)
    assert codes.tolist() == [[0x97, 0x01, 0x30]]
    assert unpack_int4(codes).tolist() == [[7, -7, 1, 0, 0, 3]]
    assert dequantize_kv(codes, scale).tolist() == [[7.0, -7.0, 1.0, 0.0, 0.0, 3.0]]
    every = torch.arange(-8, 8, dtype=torch.int8).repeat(2)
    assert torch.equal(unpack_int4(pack_int4(every)), every)


def test_int4_round_trip_within_half_a_step():
    x = torch.randn(64, 4, 128, generator=torch.Generator().manual_seed(0))
    codes, scale = quantize_kv(x, "int4")
    assert torch.allclose(scale, x.abs().amax(-1) / 7)
    err = (dequantize_kv(codes, scale) - x).abs()
    assert (err <= scale[..., None] / 2 * (1 + 1e-6)).all()


def test_an_int4_cache_stores_half_the_bytes_of_its_head_dim():
    cache = allocate_kv_cache(3, 16, 2, 64, kv_dtype="int4", head_dim_v=32, dtype=torch.float32)
    assert cache.k.shape == (3, 16, 2, 32) and cache.v.shape == (3, 16, 2, 16) and cache.k.dtype == torch.uint8
    assert (cache.head_dim, cache.head_dim_v) == (64, 32)
    assert kv_bytes_per_token(8, 128, kv_dtype="int4") == 8 * 128 + 2 * 8 * 4
    with pytest.raises(
        InputError, match="head_dim is 63, but a int4 cache stores 2 codes per byte; accepted: a multiple of 2"
    ):
        allocate_kv_cache(3, 16, 2, 63, kv_dtype="int4")
    x = torch.randn(5, 2, 64)
    write_kv(cache, x, x[..., :32], torch.tensor([0, 3, 17, -1, 47]))
    k, v = cache.dequantized()
    assert (k.reshape(-1, 2, 64)[[0, 3, 17, 47]] - x[[0, 1, 2, 4]]).abs().max() <= x.abs().max() / 14 + 1e-6


def _kivi_cache(num_blocks=4, block_size=8, heads=2, dim=16):
    return allocate_kv_cache(num_blocks, block_size, heads, dim, kv_dtype="kivi4", dtype=torch.float32)


def test_kivi4_scales_keys_per_block_and_channel_and_values_per_slot():
    cache = _kivi_cache()
    assert cache.k_scale.shape == (4, 2, 16) and cache.v_scale.shape == (4, 8, 2)
    assert cache.kv_scales == "per_slot" and not cache.static_scales
    g = torch.Generator().manual_seed(1)
    k, v = torch.randn(8, 2, 16, generator=g), torch.randn(8, 2, 16, generator=g)
    write_kv(cache, k, v, torch.arange(8, 16))  # block 1, whole
    assert torch.equal(cache.k_scale[1], k.abs().amax(0) / 7)
    kd, vd = cache.dequantized()
    assert ((kd[1] - k).abs() <= cache.k_scale[1] / 2 + 1e-6).all()
    assert ((vd[1] - v).abs() <= cache.v_scale[1][..., None] / 2 + 1e-6).all()


def test_kivi4_token_by_token_writes_rescale_the_block_and_a_new_block_starts_afresh():
    cache = _kivi_cache()
    g = torch.Generator().manual_seed(2)
    k = torch.randn(8, 2, 16, generator=g) * torch.linspace(0.1, 2.0, 8)[:, None, None]  # growing keys
    for t in range(8):
        write_kv(cache, k[t : t + 1], k[t : t + 1], torch.tensor([16 + t]))  # block 2, in order
    assert torch.allclose(cache.k_scale[2], k.abs().amax(0) / 7)
    kd, _ = cache.dequantized()
    # Each key within one step of its block's final scale (half a step per rounding, two at most
    # that matter: its own and the last rescale).
    assert ((kd[2] - k).abs() <= cache.k_scale[2] * (1 + 1e-5)).all()
    # A write at slot 0 of a block starts it afresh: the old, large scales are not kept.
    small = torch.full((1, 2, 16), 0.07)
    write_kv(cache, small, small, torch.tensor([16]))
    assert torch.allclose(cache.k_scale[2], torch.full((2, 16), 0.01))


def test_kivi4_keeps_an_outlier_channel_from_flattening_the_others():
    # Keys with one channel 30x the others (KIVI's observation): int4 per token spends its 15 levels
    # on the outlier; per channel, every channel keeps its own step.
    g = torch.Generator().manual_seed(3)
    k = torch.randn(8, 2, 16, generator=g)
    k[..., 5] *= 30
    per_token = allocate_kv_cache(4, 8, 2, 16, kv_dtype="int4", dtype=torch.float32)
    per_channel = _kivi_cache()
    for cache in (per_token, per_channel):
        write_kv(cache, k, k, torch.arange(8, 16))
    err = {
        name: (c.dequantized()[0][1] - k)[..., :5].abs().mean()
        for name, c in (("token", per_token), ("channel", per_channel))
    }
    assert err["channel"] < err["token"] / 5


def test_kivi4_refusals_say_what_is_accepted():
    with pytest.raises(InputError, match="k_scale/v_scale are given for a kivi4 cache; accepted: none"):
        allocate_kv_cache(4, 8, 2, 16, kv_dtype="kivi4", k_scale=0.1, v_scale=0.1)
    with pytest.raises(InputError, match=r"kivi4 cache's key scales are per block; accepted: block_size="):
        kv_bytes_per_token(8, 128, kv_dtype="kivi4")
    # int4 codes, one float per (block, channel) of K over 16 slots, one per slot of V.
    assert kv_bytes_per_token(8, 128, kv_dtype="kivi4", block_size=16) == 8 * 128 + 8 * 4 + 8 * 128 * 4 // 16
    with pytest.raises(InputError, match="kivi4 scales keys per block: write_kv quantizes them"):
        quantize_kv(torch.ones(2, 4), "kivi4")
    cache = _kivi_cache()
    wrong = KVCache(
        cache.k, cache.v, kv_dtype="kivi4", k_scale=cache.v_scale, v_scale=cache.v_scale, dtype=torch.float32
    )
    with pytest.raises(
        InputError, match=r"kivi4 cache needs float32 \[num_blocks, num_kv_heads, head_dim\] = \[4, 2, 16\]"
    ):
        wrong.check()


@pytest.mark.skipif(not torch.cuda.is_available(), reason="a CUDA-graph capture needs a CUDA GPU (the GPU machine)")
def test_kivi4_writes_refuse_a_cuda_graph_capture_with_the_reason():
    cache = allocate_kv_cache(4, 8, 2, 16, kv_dtype="kivi4", dtype=torch.bfloat16, device="cuda")
    k = torch.randn(2, 2, 16, device="cuda", dtype=torch.bfloat16)
    slots = torch.tensor([0, 1], device="cuda")
    with pytest.raises(InputError, match="kivi4 cache is being written inside a CUDA-graph capture"):
        with torch.cuda.graph(torch.cuda.CUDAGraph()):
            write_kv(cache, k, k, slots)


# ------------------------------------------------------------- non-finite input, scale floors
#: float32's smallest normal: the least scale a write stores (SCALE_FLOOR).
FLOOR = 2.0**-126
PER_SLOT = ["int8", "fp8", "fp8_e5m2", "int4"]


def _bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.element_size() == 1 else t.view(torch.int32)


@pytest.mark.parametrize("where", ["k", "v"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
@pytest.mark.parametrize("kv_dtype", [*PER_SLOT, "kivi4"])
def test_a_non_finite_element_stays_in_its_slot(kv_dtype, bad, where):
    # Token 3 (slot 11, block 1) gets one non-finite element in KV head 1. Every other slot's codes
    # and scales are the bytes of the same write without it (that element 0 there, so kivi4's
    # channel max is the same); the slot's own vector reads back NaN: per-slot formats through its
    # NaN scale, kivi4 through the slot's V scale (its keys share the block's channel scales).
    g = torch.Generator().manual_seed(7)
    k, v = torch.randn(6, 2, 8, generator=g), torch.randn(6, 2, 8, generator=g)
    (k if where == "k" else v)[3, 1, 2] = 0.0
    slots = torch.arange(8, 14)
    clean = allocate_kv_cache(3, 8, 2, 8, kv_dtype=kv_dtype, dtype=torch.float32)
    dirty = allocate_kv_cache(3, 8, 2, 8, kv_dtype=kv_dtype, dtype=torch.float32)
    write_kv(clean, k, v, slots)
    (k if where == "k" else v)[3, 1, 2] = bad
    write_kv(dirty, k, v, slots)
    kivi = kv_dtype == "kivi4"
    marked = "v_scale" if kivi else f"{where}_scale"
    # The marked vector's codes are 0 (kivi4 keys: only the non-finite element's).
    zeroed = where if not kivi or where == "v" else None
    for name in ("k", "v", "k_scale", "v_scale"):
        a, b = _bytes(getattr(clean, name)).clone(), _bytes(getattr(dirty, name)).clone()
        if name == marked:
            assert torch.isnan(getattr(dirty, name)[1, 3, 1])
            a[1, 3, 1] = b[1, 3, 1] = 0
        if name == zeroed:
            assert not bool(b[1, 3, 1].any())
            a[1, 3, 1] = 0
        assert torch.equal(a, b), f"cache.{name} changed outside slot 11, KV head 1"
    kd, vd = dirty.dequantized()
    kc, vc = clean.dequantized()
    nan_k = torch.zeros(3, 8, 2, dtype=torch.bool)
    nan_v = nan_k.clone()
    (nan_v if kivi or where == "v" else nan_k)[1, 3, 1] = True
    assert torch.equal(kd.isnan().all(-1), nan_k) and torch.equal(kd.isnan().any(-1), nan_k)
    assert torch.equal(vd.isnan().all(-1), nan_v) and torch.equal(vd.isnan().any(-1), nan_v)
    assert torch.equal(kd[~nan_k], kc[~nan_k]) and torch.equal(vd[~nan_v], vc[~nan_v])


@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "fp8_e5m2", "int4"])
@pytest.mark.parametrize("bad", [float("nan"), float("inf"), float("-inf")])
def test_a_static_cache_keeps_a_non_finite_element_in_that_element(kv_dtype, bad):
    # A static scale is shared: fp8 stores its NaN code in the element itself (one byte, 0x7f,
    # whatever the sign); int8 and int4 have no NaN code and store 0 there (the documented
    # exception). The other elements are quantized as without it.
    cache = allocate_kv_cache(2, 4, 1, 4, kv_dtype=kv_dtype, dtype=torch.float32, k_scale=0.5, v_scale=0.5)
    x = torch.tensor([[[1.0, bad, -2.0, 0.5]]])
    write_kv(cache, x, x, torch.tensor([5]))
    kd, _ = cache.dequantized()
    got = kd[1, 1, 0]
    assert got[[0, 2, 3]].tolist() == [1.0, -2.0, 0.5]
    if kv_dtype.startswith("fp8"):
        assert torch.isnan(got[1]) and int(cache.k.view(torch.uint8)[1, 1, 0, 1]) == 0x7F
    else:
        assert got[1].item() == 0.0
    assert cache.k_scale[0, 0].item() == 0.5


@pytest.mark.parametrize("kv_dtype", [*PER_SLOT, "kivi4"])
def test_a_row_of_float32_subnormals_reads_back_finite(kv_dtype):
    # max / q_max of [1e-42, 0, ...] underflows to 0 (57344 for fp8_e5m2): 0/0 codes read back
    # NaN. The scale floor (float32's smallest normal) keeps every scale positive.
    x = torch.zeros(1, 1, 32)
    x[0, 0, 0] = 1e-42
    cache = allocate_kv_cache(2, 4, 1, 32, kv_dtype=kv_dtype, dtype=torch.float32)
    write_kv(cache, x, x, torch.tensor([0]))
    k, v = cache.dequantized()
    for got, scale in (
        (k[0, 0, 0], cache.k_scale[0, 0] if kv_dtype == "kivi4" else cache.k_scale[0, 0, 0]),
        (v[0, 0, 0], cache.v_scale[0, 0, 0]),
    ):
        assert bool(torch.isfinite(got).all())
        assert bool((scale == FLOOR).all())
        # Within half a step of the floored scale (fp8: within a subnormal step).
        assert float((got.double() - x[0, 0].double()).abs().max()) <= FLOOR


def test_a_zero_channel_does_not_coarsen_a_kivi4_block():
    # A channel that is 0 in a block's first key keeps the floor as its scale, so a later key of
    # 0.5 there is stored within half its own step (a scale of 1.0 would have rounded it to 0).
    cache = _kivi_cache(dim=2)
    write_kv(cache, torch.tensor([[[0.0, 1.0]] * 2]), torch.ones(1, 2, 2), torch.tensor([8]))
    write_kv(cache, torch.tensor([[[0.5, 1.0]] * 2]), torch.ones(1, 2, 2), torch.tensor([9]))
    kd, _ = cache.dequantized()
    assert abs(float(kd[1, 1, 0, 0]) - 0.5) <= 0.5 / 7 / 2 + 1e-6


def test_kivi4_refuses_a_static_v_scale():
    # One shared V scale would be overwritten by every write (kivi4 sets V's scale per slot).
    cache = _kivi_cache()
    shared = torch.tensor([0.05])
    with pytest.raises(InputError, match=r"cache.v_scale is a static scale .* for a kivi4 cache; accepted: per-slot"):
        KVCache(
            cache.k,
            cache.v,
            kv_dtype="kivi4",
            k_scale=cache.k_scale,
            v_scale=static_scale(shared, cache.v),
            dtype=torch.float32,
        ).check()
    assert shared.item() == pytest.approx(0.05)


def _growth_bound(keys: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """float64 model of kivi4's keys grown one token a step in one block: each channel's scale
    after write ``t`` is max |k[:t+1]| / 7 (floored); a key is within half of each scale its
    channel held from its own write on (one rounding per rescale). Returns (bound, final scale)."""
    k = keys.double()
    scales = torch.stack([k[: t + 1].abs().amax(0) / 7 for t in range(block_size)]).clamp_min(FLOOR)
    bound = torch.stack([scales[t:].unique_consecutive(dim=0).sum(0) / 2 for t in range(block_size)])
    return bound, scales[-1]


@pytest.mark.parametrize("growth", ["normal", "2% a token", "1/15 a token"])
def test_kivi4_keys_grown_token_by_token_stay_within_the_stated_bound(growth):
    # docs/quantization.md: within half of each scale the channel held from the key's write on;
    # a block written at once: half a step. "1/15 a token" is the worst case for 16-token blocks:
    # each rescale is too small to move a code, so a 7 stays 7 while the scale grows.
    g = torch.Generator().manual_seed(11)
    bs = 16
    if growth == "normal":
        keys = torch.randn(bs, 2, 32, generator=g)
    else:
        rate = 1.02 if growth == "2% a token" else 1 + 1 / 15
        keys = rate ** torch.arange(bs, dtype=torch.float64)[:, None, None] * (
            1 + 0.01 * torch.rand(bs, 2, 32, generator=g, dtype=torch.float64)
        )
        keys = keys.float()
    cache = allocate_kv_cache(2, bs, 2, 32, kv_dtype="kivi4", dtype=torch.float32)
    for t in range(bs):
        write_kv(cache, keys[t : t + 1], keys[t : t + 1], torch.tensor([bs + t]))
    bound, scale = _growth_bound(keys, bs)
    assert torch.allclose(cache.k_scale[1].double(), scale, rtol=1e-6, atol=0)
    err = (cache.dequantized()[0][1].double() - keys.double()).abs()
    assert bool((err <= bound * (1 + 1e-5)).all())
    steps = float((err / scale).max())
    # What docs/quantization.md states, in final steps: at most 1.61 / 1.85 / 4.37 measured.
    assert steps <= {"normal": 2.0, "2% a token": 2.0, "1/15 a token": 4.5}[growth]
    # Written at once, the same keys are within half a step.
    once = allocate_kv_cache(2, bs, 2, 32, kv_dtype="kivi4", dtype=torch.float32)
    write_kv(once, keys, keys, torch.arange(bs, 2 * bs))
    assert float(((once.dequantized()[0][1].double() - keys.double()).abs() / scale).max()) <= 0.5 + 1e-5


def test_a_cache_whose_storage_is_replaced_in_place_is_written_there():
    # cache.k.set_(...) keeps the tensor object: the check sees the new address and writes go
    # to the new storage (not to the allocation's spill storage, which still holds the old one).
    cache = allocate_kv_cache(2, 4, 1, 2, dtype=torch.float32)
    x = torch.ones(1, 1, 2)
    write_kv(cache, x, x, torch.tensor([1]))
    old = cache._spill[0]
    new = torch.zeros(2, 4, 1, 2)
    cache.k.set_(new)
    write_kv(cache, 2 * x, 2 * x, torch.tensor([5]))
    assert new[1, 1].tolist() == [[2.0, 2.0]] and cache.k.data_ptr() == new.data_ptr()
    assert float(old[1, 1].abs().sum()) == 0.0


def test_a_cache_resized_in_place_is_refused_naming_the_tensor():
    cache = allocate_kv_cache(2, 4, 1, 2, dtype=torch.float32)
    x = torch.ones(1, 1, 2)
    write_kv(cache, x, x, torch.tensor([1]))
    cache.k.resize_(0)
    with pytest.raises(InputError, match=r"cache.k is float32 \[0\]; accepted: a 4-D tensor"):
        write_kv(cache, x, x, torch.tensor([1]))


def test_kv_bytes_per_token_refuses_an_odd_int4_head_dim():
    for kv_dtype in ("int4", "kivi4"):
        with pytest.raises(InputError, match=f"head_dim is 63, but a {kv_dtype} cache stores 2 codes per byte"):
            kv_bytes_per_token(8, 63, kv_dtype=kv_dtype, block_size=16)
    with pytest.raises(InputError, match="head_dim_v is 7, but a int4 cache stores 2 codes per byte"):
        kv_bytes_per_token(8, 64, head_dim_v=7, kv_dtype="int4")
