"""Bad input at every public entry point of core: a PagedError that names the input, never a raw
exception from torch, difflib or Python, and never a silent acceptance or a partial write.

Each test failed before the check it covers existed (the comment says how). Shapes are tiny;
the Triton comparisons run under ``TRITON_INTERPRET=1`` on a CPU.
"""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch
from paged_core import (
    AttentionSpec,
    BatchMeta,
    BatchMetaError,
    BlockAllocator,
    InputError,
    KVCache,
    PagedError,
    ReferenceBackend,
    UnsupportedSpecError,
    allocate_kv_cache,
    dequantize_kv,
    kv_bytes_per_token,
    reference_attention,
    registry,
    write_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


def small(kv_dtype="auto", dtype=torch.float32, block_size=4):
    meta = BatchMeta.build([2, 1], [5, 9], block_size=block_size, num_blocks=8, seed=0)
    cache = allocate_kv_cache(8, block_size, 2, 8, dtype=dtype, kv_dtype=kv_dtype)
    g = torch.Generator().manual_seed(0)
    q = torch.randn(3, 4, 8, generator=g).to(dtype)
    return q, cache, meta


def stores(cache: KVCache) -> list[torch.Tensor]:
    views = [cache.k, cache.v] + ([cache.k_scale, cache.v_scale] if cache.k_scale is not None else [])
    return [t.clone() for t in views]


# ---------------------------------------------------------------------------------- BatchMeta
def test_build_on_cuda_without_a_gpu(monkeypatch):
    # Used to be torch's AssertionError ("Torch not compiled with CUDA enabled").
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    with pytest.raises(InputError, match="device 'cuda' was asked for but this machine has no usable CUDA GPU"):
        BatchMeta.build([1], [5], block_size=4, device="cuda")
    with pytest.raises(InputError, match="device 'cuda' was asked for"):
        BatchMeta.from_lists([1], [5], [[1]], block_size=4, device="cuda")
    with pytest.raises(InputError, match="device 'cuda' was asked for"):
        BatchMeta.build([1], [5], block_size=4).to("cuda")


def test_build_on_a_bogus_device():
    # Used to be torch's RuntimeError ("Expected one of cpu, cuda, ... device type").
    with pytest.raises(InputError, match="device 'bogus' is not a device"):
        BatchMeta.build([1], [5], block_size=4, device="bogus")


@pytest.mark.parametrize(
    ("qlens", "slens", "needle"),
    [
        ([1], [2**31], "request 0: seq_len 2147483648 does not fit the int32 seq_lens; accepted: below 2**31"),
        ([2**30, 2**30], [0, 0], "the batch has 2147483648 query tokens, past the int32 query_start_loc"),
    ],
)
def test_host_ints_are_bounded_to_int32(qlens, slens, needle):
    # Used to be torch's RuntimeError (value cannot be converted to int32 without overflow).
    with pytest.raises(BatchMetaError) as exc:
        BatchMeta.from_lists(qlens, slens, [[0]] * len(qlens), block_size=2**30)
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    ("tables", "needle"),
    [
        ([[1, "2"]], "request 0: block '2' in its block list; accepted: block ids, ints from 0 to 2**31 - 1"),
        ([[1, 2**31]], "request 0: block 2147483648 in its block list"),
        ([[1, -1]], "request 0: block -1 in its block list"),
    ],
)
def test_from_lists_checks_block_ids(tables, needle):
    with pytest.raises(BatchMetaError) as exc:
        BatchMeta.from_lists([1], [5], tables, block_size=4)
    assert needle in str(exc.value)


@pytest.mark.parametrize("reqs", [[5], [-1], [0, 2], [True], [0.0]])
def test_select_out_of_range(reqs):
    # [5] used to be an IndexError; [-1] silently selected the last request.
    meta = BatchMeta.build([2, 1], [5, 9], block_size=4)
    with pytest.raises(
        InputError,
        match=r"select\(\): request .* is not in the batch; accepted: request "
        r"indices 0 \.\. 1",
    ):
        meta.select(reqs)
    assert meta.select([1, 0]).seq_lens.tolist() == [9, 5]


def test_max_query_len_below_the_pigeonhole_bound():
    # 2 requests of at most 1 token cannot hold 3 rows: no mirror needed to know it is a lie.
    meta = dataclasses.replace(BatchMeta.build([2, 1], [5, 9], block_size=4), max_query_len=1, query_start_loc_cpu=None)
    with pytest.raises(BatchMetaError, match="max_query_len is 1 but 2 requests share 3 query tokens"):
        meta.check_structure()


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("max_seq_len", 8, "max_seq_len is 8 but seq_lens_cpu reaches 9"),
        ("max_query_len", 1, "max_query_len is 1 but query_start_loc_cpu has a request of 2 tokens"),
    ],
)
def test_host_ints_below_their_mirrors_are_refused_with_validation_off(field, value, needle):
    # Used to run with validation off and silently skip keys or queries past the bound.
    q, cache, meta = small()
    meta = dataclasses.replace(meta, **{field: value})
    if field == "max_query_len":  # 2 requests, 3 tokens: keep the pigeonhole bound satisfied
        meta = dataclasses.replace(
            meta,
            slot_mapping=meta.slot_mapping[:2],
            query_start_loc=torch.tensor([0, 2, 2], dtype=torch.int32),
            query_start_loc_cpu=torch.tensor([0, 2, 2], dtype=torch.int32),
        )
        q = q[:2]
    with pytest.raises(BatchMetaError, match=needle):
        ReferenceBackend(validate=False).forward(q, cache, meta)


def test_host_ints_without_mirrors_are_promises():
    # Without mirrors a lie cannot be seen without a sync: accepted with validation off (the
    # documented contract), refused with it on.
    q, cache, meta = small()
    meta = dataclasses.replace(meta, max_seq_len=8, seq_lens_cpu=None, query_start_loc_cpu=None)
    ReferenceBackend(validate=False).forward(q, cache, meta)
    with pytest.raises(BatchMetaError, match="max_seq_len is 8 but seq_lens reach 9"):
        ReferenceBackend(validate=True).forward(q, cache, meta)


def test_copy_rechecks_the_host_ints():
    static = BatchMeta.build([1, 1], [5, 9], block_size=4, table_width=4)
    static.check_structure()
    static.copy_(BatchMeta.build([1, 1], [13, 2], block_size=4))
    static.max_seq_len = 13
    static.seq_lens_cpu[0] = 15  # in place: the next check_structure must see it after copy_
    static._checked = None
    with pytest.raises(BatchMetaError, match="max_seq_len is 13 but seq_lens_cpu reaches 15"):
        static.check_structure()


# ---------------------------------------------------------------------------------- allocator
def test_allocator_refuses_negative_counts():
    # allocate(-1) used to hand out every block but the last.
    alloc = BlockAllocator(4, shuffle=False)
    for bad in (-1, 1.5, True):
        with pytest.raises(InputError, match=rf"allocate\({bad!r}\): accepted: a number of blocks"):
            alloc.allocate(bad)
    assert alloc.num_free == 3


@pytest.mark.parametrize(
    ("blocks", "needle"),
    [
        ([99], "block 99 cannot be freed: it is outside the pool 0 .. 3"),
        ([0], "block 0 cannot be freed: it is not allocated"),
        ([2, 2], "block 2 cannot be freed: it is given twice"),
        (["1"], "block '1' cannot be freed: it is not an int"),
    ],
)
def test_allocator_free_checks_every_block_first(blocks, needle):
    # free([99]) used to put block 99 in the pool, handed out later; double frees went unseen.
    alloc = BlockAllocator(4, shuffle=False)
    got = alloc.allocate(2)
    with pytest.raises(InputError, match=needle):
        alloc.free(blocks)
    assert alloc.num_free == 1  # nothing was freed
    alloc.free(got)
    with pytest.raises(InputError, match="block 1 cannot be freed: it is not allocated"):
        alloc.free([1])  # a double free
    assert sorted(alloc.allocate(3)) == [1, 2, 3]


# ---------------------------------------------------------------------------------- cache
@pytest.mark.parametrize("bad", [True, 2.0, 2**31, -1])
def test_allocate_kv_cache_refuses_non_ints(bad):
    # allocate_kv_cache(True, ...) used to be a 1-block cache.
    with pytest.raises(InputError, match=rf"num_blocks is {bad!r}; accepted: a positive int"):
        allocate_kv_cache(bad, 16, 2, 8)


@pytest.mark.parametrize(
    ("kwargs", "needle"),
    [
        (dict(dtype=torch.float64), "dtype is torch.float64; accepted: torch.float32, torch.float16, torch.bfloat16"),
        (
            dict(dtype="float16"),
            "dtype is the string 'float16'; accepted: torch.float32, torch.float16, torch.bfloat16 "
            "(a torch.dtype, not a string: torch.float16)",
        ),
        (dict(kv_dtype="int2"), "kv_dtype 'int2' is not one of auto, int8, fp8, fp8_e5m2, int4, kivi4"),
        (dict(num_layers=0), "num_layers is 0; accepted: a positive int"),
    ],
)
def test_kv_bytes_per_token_refuses(kwargs, needle):
    # float64 used to be a KeyError, an unknown format returned a number.
    with pytest.raises(InputError) as exc:
        kv_bytes_per_token(8, 128, **kwargs)
    assert needle in str(exc.value)


def test_dequantize_kv_with_mismatched_scales():
    # Used to broadcast silently (or raise torch's RuntimeError for other shapes).
    codes = torch.zeros(4, 2, 8, dtype=torch.int8)
    for scales in (torch.ones(4, 1), torch.ones(2, 4), torch.ones(4, 2, 1)):
        with pytest.raises(InputError, match=r"one scale per head vector, shape codes.shape\[:-1\] = \[4, 2\]"):
            dequantize_kv(codes, scales)
    with pytest.raises(InputError, match="scales is a NoneType"):
        dequantize_kv(codes, None)


def _hand_built(change):
    cache = allocate_kv_cache(8, 4, 2, 8, dtype=torch.float32, kv_dtype="int8" if change.startswith("int8") else "auto")
    if change == "3-d":
        return KVCache(k=cache.k[:, 0], v=cache.v[:, 0], dtype=torch.float32)
    if change == "v-unlike-k":
        return KVCache(k=cache.k, v=cache.v[:, :2].contiguous(), dtype=torch.float32)
    if change == "dtype-mismatch":
        return KVCache(k=cache.k, v=cache.v, dtype=torch.bfloat16)
    if change == "head-dim-strided":
        return KVCache(k=cache.k[..., ::2], v=cache.v[..., ::2], dtype=torch.float32)
    if change == "int8-no-scales":
        return dataclasses.replace(cache, k_scale=None, v_scale=None)
    if change == "int8-scale-dtype":
        return dataclasses.replace(cache, k_scale=cache.k_scale.half())
    if change == "int8-scale-shape":
        return dataclasses.replace(cache, v_scale=cache.v_scale[:, :2])
    if change == "int8-scale-device":
        return dataclasses.replace(cache, k_scale=cache.k_scale.to("meta"))
    raise AssertionError(change)


HAND_BUILT = {
    "3-d": "cache.k is float32 [8, 2, 8]; accepted: a 4-D tensor [num_blocks, block_size, num_kv_heads, head_dim]",
    "v-unlike-k": "cache.v is float32 [8, 2, 2, 8] on cpu but cache.k is float32 [8, 4, 2, 8]",
    "dtype-mismatch": "cache.k is float32 [8, 4, 2, 8] but kv_dtype 'auto' with dtype bfloat16 stores bfloat16",
    "head-dim-strided": "cache.k's last dimension has stride 2; accepted: stride 1",
    "int8-no-scales": "cache.k_scale is None; an int8 cache needs float32 [num_blocks, block_size, num_kv_heads]",
    "int8-scale-dtype": "cache.k_scale is float16 [8, 4, 2] on cpu; an int8 cache needs float32",
    "int8-scale-shape": "cache.v_scale is float32 [8, 2, 2] on cpu; an int8 cache needs float32 "
    "[num_blocks, block_size, num_kv_heads] = [8, 4, 2] on cpu",
    "int8-scale-device": "cache.k_scale is float32 [8, 4, 2] on meta",
}


@pytest.mark.parametrize("change", list(HAND_BUILT))
@pytest.mark.parametrize("entry", ["forward", "write", "write_kv", "reference_attention"])
def test_hand_built_caches_are_checked_before_use(change, entry):
    # 3-D tensors used to be an IndexError, scales None an AttributeError in the reference, a
    # v unlike k was read out of bounds or broadcast.
    from paged_core import reference_attention

    cache = _hand_built(change)
    q, _, meta = small()
    k = torch.randn(3, 2, 8)
    before = [t.clone() for t in (cache.k, cache.v) if t.device.type != "meta"]
    with pytest.raises(InputError) as exc:
        if entry == "forward":
            ReferenceBackend().forward(q, cache, meta)
        elif entry == "write":
            ReferenceBackend(validate=True).write(cache, k, k, meta)
        elif entry == "write_kv":
            write_kv(cache, k, k, meta.slot_mapping)
        else:
            reference_attention(q, cache, meta)
    assert HAND_BUILT[change] in str(exc.value), str(exc.value)
    after = [t for t in (cache.k, cache.v) if t.device.type != "meta"]
    assert all(torch.equal(a, b) for a, b in zip(before, after, strict=True))  # nothing written


def test_cache_check_is_cached_per_object_and_sees_reassignment():
    cache = allocate_kv_cache(8, 4, 2, 8, dtype=torch.float32)
    assert cache.check() is cache and cache._checked is not None
    first = cache._checked
    cache.check()
    assert cache._checked is first  # the second call compared identities only
    cache.k = cache.k[:, 0]  # assigning a field makes the next call check again
    with pytest.raises(InputError, match="cache.k is float32 \\[8, 2, 8\\]"):
        cache.check()


# ---------------------------------------------------------------------------------- write
@pytest.mark.parametrize("validate", [False, True])
def test_write_with_a_batch_of_another_block_size(validate):
    # Used to write at slots computed for block size 8 into a cache of block size 4, even with
    # validation on (forward refused the same pair).
    _, cache, _ = small()
    meta8 = BatchMeta.build([2, 1], [5, 9], block_size=8, num_blocks=4, seed=0)
    before = stores(cache)
    k = torch.randn(3, 2, 8)
    with pytest.raises(InputError, match="the batch was built for block_size 8 but the cache has block_size 4"):
        ReferenceBackend(validate=validate).write(cache, k, k, meta8)
    assert all(torch.equal(a, b) for a, b in zip(before, stores(cache), strict=True))


def test_a_refused_write_into_an_int8_cache_writes_nothing():
    # With k_scale missing, the codes used to be written before the scales raised.
    _, cache, meta = small(kv_dtype="int8")
    broken = dataclasses.replace(cache, k_scale=None)
    before = stores(cache)
    k = torch.randn(3, 2, 8)
    with pytest.raises(InputError, match="cache.k_scale is None"):
        ReferenceBackend().write(broken, k, k, meta)
    assert all(torch.equal(a, b) for a, b in zip(before, stores(cache), strict=True))


class _AutoOnly(ReferenceBackend):
    """A backend that claims only full-precision caches (as FlashInfer's and flash-attn2's
    classes claim few formats) and keeps the base class's write."""

    name = "auto-only"
    capabilities = dataclasses.replace(ReferenceBackend.capabilities, kv_dtypes=frozenset({"auto"}))


@pytest.mark.parametrize("kv_dtype", ["int4", "kivi4", "int8"])
def test_write_refuses_a_cache_the_backend_does_not_claim(kv_dtype):
    # Backend.write checked only the cache's kv_scales: a backend that claims kv_dtypes {"auto"}
    # wrote int4 and kivi4 codes, which its forward then refused to read.
    _, cache, meta = small(kv_dtype)
    before = stores(cache)
    k = torch.randn(3, 2, 8)
    with pytest.raises(UnsupportedSpecError) as exc:
        _AutoOnly().write(cache, k, k, meta)
    assert exc.value.backend == "auto-only"
    assert exc.value.reasons == [f"kv_dtype {kv_dtype!r} is not supported (accepted: auto)"]
    assert all(torch.equal(a, b) for a, b in zip(before, stores(cache), strict=True))  # nothing written
    _, plain, _ = small()
    _AutoOnly().write(plain, k, k, meta)  # what it claims is written


@pytest.mark.parametrize("kv_dtype", ["int4", "kivi4"])
def test_flashinfer_built_directly_refuses_a_write_into_a_4_bit_cpu_cache(kv_dtype):
    # docs/quantization.md: FlashInfer reads no 4-bit cache, and it runs on CUDA only; its
    # class, built without the registry, wrote such a CPU cache anyway.
    backend_module = pytest.importorskip("paged_flashinfer.backend")
    _, cache, meta = small(kv_dtype)
    before = stores(cache)
    k = torch.randn(3, 2, 8)
    with pytest.raises(UnsupportedSpecError) as exc:
        backend_module.FlashInferBackend().write(cache, k, k, meta)
    assert any(r.startswith(f"kv_dtype {kv_dtype!r} is not supported (accepted: auto") for r in exc.value.reasons)
    assert all(torch.equal(a, b) for a, b in zip(before, stores(cache), strict=True))


def test_attention_spec_refuses_an_unknown_kv_dtype():
    # AttentionSpec(kv_dtype="int3") was accepted, and every backend then said only that it
    # does not support 'int3'.
    from paged_core import AttentionSpec

    with pytest.raises(InputError, match="AttentionSpec.kv_dtype is 'int3'; accepted: auto, int8, fp8, fp8_e5m2, int4"):
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, kv_dtype="int3")  # type: ignore[arg-type]


# ---------------------------------------------------------------------------------- forward
@pytest.mark.parametrize("bad", [math.inf, math.nan, "0.1", True])
@pytest.mark.parametrize("field", ["scale", "softcap"])
def test_scale_and_softcap_must_be_finite_numbers(field, bad):
    q, cache, meta = small()
    with pytest.raises(InputError, match=f"{field} is {bad!r}; accepted:"):
        ReferenceBackend().forward(q, cache, meta, **{field: bad})


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda q: {"q": q[:, 0]}, "q is float32 [3, 8] on cpu; accepted: a tensor [num_tokens, num_heads, head_dim]"),
        (lambda q: {"q": q[..., :4]}, "q has head_dim 4 but the cache has head_dim 8"),
        (lambda q: {"q": q[:, :3]}, "q has 3 heads, not a multiple of the cache's 2 KV heads"),
        (
            lambda q: {"compute_dtype": torch.int32},
            "compute_dtype is torch.int32; accepted: torch.float32, torch.float64",
        ),
        (lambda q: {"q": q[:2]}, "q has 2 rows but the batch has 3 query tokens"),
        (lambda q: {"window": -1}, "window is -1; accepted:"),
    ],
    ids=["2d_q", "wrong_head_dim", "heads_not_a_multiple", "int32_compute_dtype", "wrong_rows", "negative_window"],
)
def test_reference_attention_checks_q_as_forward_does(change, needle):
    # A 2-D q, a wrong head dim, 3 heads over 2 KV heads and compute_dtype=torch.int32 gave an
    # unnamed ValueError (unpacking) or a torch RuntimeError from inside the einsum.
    from paged_core import reference_attention

    q, cache, meta = small()
    kw = change(q)
    with pytest.raises(InputError) as exc:
        reference_attention(kw.pop("q", q), cache, meta, **kw)
    assert needle in str(exc.value)
    if "q" in change(q):  # the very message Backend.forward gives
        with pytest.raises(InputError) as fwd:
            ReferenceBackend().forward(change(q)["q"], cache, meta)
        assert str(fwd.value) == str(exc.value)


@pytest.mark.parametrize(
    ("func", "bad", "needle"),
    [
        ("pack_int4", [1, -1, 7, -7], "codes is a list; accepted: int8 codes in [-8, 7], [..., 2n]"),
        ("pack_int4", torch.tensor([1.5, -1.0]), "codes is float32 [2]; accepted: int8 codes"),
        ("unpack_int4", [241, 151], "packed is a list; accepted: uint8 [..., n], two int4 codes a byte"),
        ("unpack_int4", torch.tensor([-15, 105], dtype=torch.int8), "packed is int8 [2]; accepted: uint8"),
    ],
    ids=["pack_list", "pack_float", "unpack_list", "unpack_int8"],
)
def test_int4_packing_checks_its_input(func, bad, needle):
    # Lists were an AttributeError ('list' object has no attribute 'shape'); float codes were
    # truncated and signed bytes unpacked into wrong codes without a word.
    import paged_core

    with pytest.raises(InputError) as exc:
        getattr(paged_core, func)(bad)
    assert needle in str(exc.value)


@pytest.mark.parametrize("convert", ["to_flashinfer_pages", "to_flash_attn_args"])
@pytest.mark.parametrize("bad", [None, {"seq_lens": [5]}], ids=["none", "dict"])
def test_converters_refuse_what_is_not_a_batch(convert, bad):
    # Used to be an AttributeError ('NoneType' object has no attribute 'block_size').
    import paged_core

    with pytest.raises(InputError, match=f"meta is a {type(bad).__name__}; accepted: a paged_core.BatchMeta"):
        getattr(paged_core, convert)(bad)


@pytest.mark.parametrize(
    ("args", "needle"),
    [
        (([[3, 4]], [8], 4), "block_table is a list; accepted: an integer tensor"),
        ((torch.tensor([[3, 4]]), [8], 4), "seq_lens is a list; accepted: an integer tensor"),
        ((torch.tensor([[3.0, 4.0]]), torch.tensor([8]), 4), "block_table is float32; accepted: an integer tensor"),
        ((torch.tensor([[3, 4]]), torch.tensor([8]), 0), "block_size is 0; accepted: a positive int below 2**31"),
        ((torch.tensor([[3, 4]]), torch.tensor([8]), 2.5), "block_size is 2.5; accepted: a positive int"),
    ],
    ids=["list_table", "list_seq_lens", "float_table", "block_size_0", "float_block_size"],
)
def test_shared_prefix_blocks_checks_its_arguments(args, needle):
    # Lists were an AttributeError ('list' object has no attribute 'dim'), block_size=0 a
    # ZeroDivisionError.
    from paged_core import shared_prefix_blocks

    with pytest.raises(PagedError) as exc:
        shared_prefix_blocks(*args)
    assert needle in str(exc.value)


@pytest.mark.parametrize("bad", [None, "32/8x128", {"num_heads": 32}], ids=["none", "str", "dict"])
def test_reasons_of_something_that_is_not_a_spec(bad):
    # Capabilities.reasons(None) was an AttributeError; Backend.reasons({...}) a TypeError.
    from paged_core import Capabilities

    needle = f"spec is {bad!r} (a {type(bad).__name__}); accepted: a paged_core.AttentionSpec"
    with pytest.raises(InputError) as exc:
        Capabilities().reasons(bad)
    assert needle in str(exc.value)
    with pytest.raises(InputError) as exc:
        ReferenceBackend().reasons(bad)
    assert needle in str(exc.value)


def test_every_refusal_is_a_paged_error():
    assert issubclass(InputError, PagedError) and issubclass(BatchMetaError, PagedError)


# ---------------------------------------------------------------------------------- plan
class Planner(ReferenceBackend):
    """Records what reached its ``_plan``: nothing must, for a spec it cannot serve."""

    name = "planner"
    capabilities = dataclasses.replace(
        ReferenceBackend.capabilities, head_dims=frozenset({64}), dtypes=frozenset({torch.float16})
    )

    def __init__(self, **kw):
        super().__init__(**kw)
        self.calls = []

    def _plan(self, meta, *, num_heads=None, head_dim=None, chunk=1):
        self.calls.append((num_heads, head_dim, chunk))
        return meta


def test_plan_refuses_a_spec_before_the_backend_plans():
    meta = BatchMeta.build([1], [5], block_size=16)
    b = Planner()
    with pytest.raises(UnsupportedSpecError) as exc:
        b.plan(meta, num_heads=4, num_kv_heads=2, head_dim=96, dtype=torch.bfloat16)
    assert exc.value.reasons == [
        "head_dim 96 is not supported (accepted: 64)",
        "dtype bfloat16 is not supported (accepted: float16)",
    ]
    with pytest.raises(UnsupportedSpecError, match="num_heads 5 is not a multiple of num_kv_heads 2"):
        b.plan(meta, num_heads=5, num_kv_heads=2, head_dim=64)
    assert b.calls == []
    # Given only the shape, dtype is not held against it; _plan gets what it declares.
    assert b.plan(meta, num_heads=4, num_kv_heads=2, head_dim=64, window=3, chunk=2) is meta
    assert b.calls == [(4, 64, 2)]


@pytest.mark.parametrize(
    ("layer", "needle"),
    [
        (
            dict(num_head=8),
            "planner.plan() got unknown keyword(s) num_head; accepted: num_heads, num_kv_heads, "
            "head_dim, head_dim_v, dtype, kv_dtype, kv_scales, window, softcap, scale, sinks, chunk",
        ),
        (dict(num_heads=0), "num_heads is 0; accepted: a positive int"),
        (dict(dtype="bf16"), "dtype is the string 'bf16'; accepted: torch.float16 (a torch.dtype, not a string)"),
        (dict(kv_dtype="int2"), "kv_dtype is 'int2'; accepted: auto, int8, fp8, fp8_e5m2, int4, kivi4"),
        (dict(window=-2), "window is -2; accepted: 0 (no window) or a positive int"),
        (dict(softcap=math.inf), "softcap is inf; accepted: 0 (off) or a positive finite float"),
        (dict(scale="x"), "scale is 'x'; accepted: None (head_dim ** -0.5) or a finite float"),
        (dict(sinks=1), "sinks is 1; accepted: True or False"),
    ],
)
def test_plan_keywords_are_checked(layer, needle):
    # A misspelt keyword used to be a bare TypeError; bad values reached the vendor's plan.
    b = Planner()
    with pytest.raises(InputError) as exc:
        b.plan(BatchMeta.build([1], [5], block_size=16), **layer)
    assert needle in str(exc.value)
    assert b.calls == []


@pytest.mark.parametrize(
    ("make", "needle"),
    [
        (
            lambda: ReferenceBackend(compute_dtype="float64"),
            "compute_dtype is the string 'float64'; accepted: torch.float32, torch.float64 (a torch.dtype, "
            "not a string: torch.float64; ",
        ),
        (
            lambda: reference_attention(*small(), compute_dtype="float64"),
            "compute_dtype is the string 'float64'; accepted: torch.float32, torch.float64 (a torch.dtype, "
            "not a string: torch.float64; ",
        ),
        (
            lambda: AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, dtype="float32"),
            "AttentionSpec.dtype is the string 'float32'; accepted: torch.float32, torch.float16, "
            "torch.bfloat16 (a torch.dtype, not a string: torch.float32)",
        ),
    ],
    ids=["ReferenceBackend", "reference_attention", "AttentionSpec"],
)
def test_a_dtype_given_as_a_string_is_named_a_string(make, needle):
    # compute_dtype="float64" read "compute_dtype is 'float64'; accepted: torch.float32,
    # torch.float64", and AttentionSpec(dtype="float32") was accepted, then refused as "dtype
    # float32 is not supported (accepted: ..., float32)": each refused the value it listed.
    with pytest.raises(InputError) as exc:
        make()
    assert needle in str(exc.value)


def test_plan_of_something_that_is_not_a_batch():
    for name in registry.available():
        with pytest.raises(InputError, match=r"meta is a dict; accepted: a paged_core.BatchMeta"):
            registry.get(name).plan({})


def test_triton_unified_plan_of_a_dict():
    pytest.importorskip("paged_triton_unified")
    from paged_triton_unified.backend import TritonUnifiedBackend

    with pytest.raises(InputError, match="meta is a dict"):
        TritonUnifiedBackend().plan({})
    meta = BatchMeta.build([1], [5], block_size=16)
    assert TritonUnifiedBackend().plan(meta, shared_prefix_blocks=0, num_heads=4).meta is meta


def test_flashinfer_plan_refuses_before_flashinfer_is_called(monkeypatch):
    fib = pytest.importorskip("paged_flashinfer.backend")
    b = fib.FlashInferBackend()

    def vendor(*a, **k):
        raise AssertionError("FlashInfer was called for a spec it does not support")

    monkeypatch.setattr(b, "_load", vendor)
    meta = BatchMeta.build([1], [5], block_size=16).to(DEVICE)
    with pytest.raises(UnsupportedSpecError, match="head_dim 96 is not supported"):
        b.plan(meta, num_heads=4, num_kv_heads=2, head_dim=96, dtype=torch.bfloat16)


# ---------------------------------------------------------------------------------- trust: the contract's edges
def tiny(validate=None, **kw):
    """4 query heads over 2 KV heads, head_dim 32, a mixed batch of three requests, K/V written."""
    meta = BatchMeta.build([3, 1, 2], [5, 9, 6], block_size=4, num_blocks=12, seed=1)
    cache = allocate_kv_cache(12, 4, 2, 32, dtype=torch.float32, **kw)
    g = torch.Generator().manual_seed(3)
    q = torch.randn(6, 4, 32, generator=g)
    ReferenceBackend().write(cache, torch.randn(6, 2, 32, generator=g), torch.randn(6, 2, 32, generator=g), meta)
    # The context before the step, so every key is a real number.
    ctx = BatchMeta.from_lists([5, 9, 6], [5, 9, 6], meta.block_table.tolist(), block_size=4)
    ReferenceBackend().write(cache, torch.randn(20, 2, 32, generator=g), torch.randn(20, 2, 32, generator=g), ctx)
    ReferenceBackend().write(cache, torch.randn(6, 2, 32, generator=g), torch.randn(6, 2, 32, generator=g), meta)
    return q, cache, meta


def backends_here() -> list[str]:
    return [n for n in ("reference", "triton-unified") if n in registry.available()]


def strided(t: torch.Tensor, fill: int) -> torch.Tensor:
    """``t`` as a stride-2 view of a buffer twice its size; the other elements hold ``fill``."""
    buf = torch.full((t.numel() * 2,), fill, dtype=t.dtype, device=t.device)
    view = buf[::2]
    view.copy_(t.reshape(-1))
    return view.view(t.shape) if t.dim() == 1 else buf.view(t.shape[0], -1)[:, ::2]


@pytest.mark.parametrize(
    "field",
    ["query_start_loc", "seq_lens", "slot_mapping", "block_table", "query_start_loc_cpu", "seq_lens_cpu", "all"],
)
@pytest.mark.parametrize("name", ["reference", "triton-unified"])
def test_metadata_as_strided_views_of_persistent_buffers(name, field):
    # A stride-2 seq_lens gave a relative error of 0.735 on both Triton backends; a stride-2
    # query_start_loc left rows unwritten. The contract makes such views contiguous.
    if name not in registry.available():
        pytest.skip(f"{name} cannot run here: {registry.unavailable(name)}")
    q, cache, meta = tiny()
    want = ReferenceBackend().forward(q, cache, meta)
    names = (
        [field]
        if field != "all"
        else ["query_start_loc", "seq_lens", "slot_mapping", "block_table", "query_start_loc_cpu", "seq_lens_cpu"]
    )
    views = dataclasses.replace(meta, **{f: strided(getattr(meta, f), 7) for f in names})
    for f in names:
        assert not getattr(views, f).is_contiguous()
    backend = registry.get(name)
    got = backend.forward(q, cache, views)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    got = backend.forward(q, cache, backend.plan(views))
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    # The views are the caller's: nothing of them is replaced.
    assert all(not getattr(views, f).is_contiguous() for f in names)


@pytest.mark.parametrize("name", ["reference", "triton-unified"])
def test_expanded_seq_lens_and_query_start_loc(name):
    # seq_lens = tensor([9]).expand(3) gave wrong rows 1-2 on the Triton backends.
    if name not in registry.available():
        pytest.skip(f"{name} cannot run here: {registry.unavailable(name)}")
    meta = BatchMeta.build([1, 1, 1], [9, 9, 9], block_size=4, num_blocks=12, seed=2)
    cache = allocate_kv_cache(12, 4, 2, 32, dtype=torch.float32)
    g = torch.Generator().manual_seed(0)
    ctx = BatchMeta.from_lists([9, 9, 9], [9, 9, 9], meta.block_table.tolist(), block_size=4)
    ReferenceBackend().write(cache, torch.randn(27, 2, 32, generator=g), torch.randn(27, 2, 32, generator=g), ctx)
    q = torch.randn(3, 4, 32, generator=g)
    want = ReferenceBackend().forward(q, cache, meta)
    views = dataclasses.replace(meta, seq_lens=torch.tensor([9], dtype=torch.int32).expand(3))
    torch.testing.assert_close(registry.get(name).forward(q, cache, views), want, atol=1e-4, rtol=1e-4)


def test_a_contiguous_batch_is_used_as_it_is():
    _, _, meta = tiny()
    assert meta.contiguous() is meta
    views = dataclasses.replace(meta, seq_lens=strided(meta.seq_lens, 0))
    dense = views.contiguous()
    assert dense is not views and dense.seq_lens.is_contiguous() and dense.seq_lens.tolist() == [5, 9, 6]
    assert dense.block_table is views.block_table  # the kernels read the table through its strides


@pytest.mark.parametrize("name", ["reference", "triton-unified"])
def test_sinks_of_plus_infinity_give_zeros(name):
    # The limit of a sink that absorbs all the mass: exact zeros for that head, the other heads
    # unchanged. The reference gave zeros, both Triton backends NaN.
    if name not in registry.available():
        pytest.skip(f"{name} cannot run here: {registry.unavailable(name)}")
    q, cache, meta = tiny()
    sinks = torch.tensor([0.5, math.inf, -math.inf, 0.0])
    want = ReferenceBackend().forward(q, cache, meta, sinks=torch.tensor([0.5, 0.0, -math.inf, 0.0]))
    for validate in (False, True):
        got = registry.get(name, validate=validate).forward(q, cache, meta, sinks=sinks)
        assert torch.equal(got[:, 1], torch.zeros_like(got[:, 1])), got[:, 1]
        torch.testing.assert_close(got[:, [0, 2, 3]], want[:, [0, 2, 3]], atol=1e-4, rtol=1e-4)


def test_nan_sinks_are_refused_with_validation_on():
    q, cache, meta = tiny()
    with pytest.raises(InputError, match=r"sinks holds NaN at heads \[1\]"):
        ReferenceBackend(validate=True).forward(q, cache, meta, sinks=torch.tensor([0.0, math.nan, 0.0, 0.0]))


@pytest.mark.parametrize("name", ["reference", "triton-unified"])
def test_outputs_whose_rows_overlap_are_refused(name):
    # out=torch.empty(1, 4, 32).expand(6, 4, 32) was accepted by the Triton backends (every row
    # held the last row written) and a raw RuntimeError in the reference.
    if name not in registry.available():
        pytest.skip(f"{name} cannot run here: {registry.unavailable(name)}")
    q, cache, meta = tiny()
    b = registry.get(name)
    for out in (
        torch.empty(1, 4, 32).expand(6, 4, 32),
        torch.empty(6, 1, 32).expand(6, 4, 32),
        torch.empty(6 * 32 + 32).as_strided((6, 4, 32), (32, 8, 1)),
    ):
        with pytest.raises(InputError, match="out's elements overlap each other"):
            b.forward(q, cache, meta, out=out)
    # Strided but not overlapping: accepted.
    wide = torch.empty(6, 8, 32)[:, ::2]
    b.forward(q, cache, meta, out=wide)


@pytest.mark.parametrize("name", ["reference", "triton-unified"])
def test_outputs_inside_the_cache_are_refused(name):
    if name not in registry.available():
        pytest.skip(f"{name} cannot run here: {registry.unavailable(name)}")
    q, cache, meta = tiny()
    b = registry.get(name)
    for pool in (cache.k, cache.v):
        out = pool.view(-1)[: 6 * 4 * 32].view(6, 4, 32)
        with pytest.raises(InputError, match="out overlaps the cache's memory"):
            b.forward(q, cache, meta, out=out)
    b.forward(q, cache, meta, out=torch.empty_like(q))


@pytest.mark.parametrize(
    ("field", "value", "needle"),
    [
        ("softcap", 1e39, "softcap is 1e+39; accepted: 0 (off) or a positive finite float32"),
        ("softcap", 1e-300, "softcap is 1e-300; accepted: 0 (off) or a positive finite float32"),
        ("scale", 1e39, "scale is 1e+39; accepted: None (head_dim ** -0.5) or a finite float32"),
        ("scale", -1e39, "scale is -1e+39; accepted: None"),
        ("window", 2**64, "window is 18446744073709551616; accepted: 0 (no window) or a positive int below 2**31"),
        ("window", 2**31, "window is 2147483648; accepted:"),
    ],
)
def test_scalars_are_checked_against_float32_and_int32(field, value, needle):
    # softcap=1e39 was wrong on every backend, scale=1e39 NaN on the reference (float32 math);
    # window=2**64 a raw OverflowError.
    q, cache, meta = tiny()
    for name in backends_here():
        with pytest.raises(InputError) as exc:
            registry.get(name).forward(q, cache, meta, **{field: value})
        assert needle in str(exc.value)
        with pytest.raises(InputError) as exc:
            registry.get(name).plan(meta, **{field: value})
        assert needle in str(exc.value)


def test_the_largest_float32_scalars_are_accepted():
    q, cache, meta = tiny()
    ReferenceBackend().forward(q, cache, meta, softcap=1.7e38, scale=1e-3, window=2**31 - 1)


def test_merge_states_checks_its_lists():
    from paged_core import merge_states

    o, lse = torch.zeros(2, 3, 4, 8), torch.zeros(2, 3, 4)
    with pytest.raises(InputError, match=r"sinks is a list; accepted: None or a float32 tensor \[num_heads=4\]"):
        merge_states(o, lse, sinks=[0.0] * 4)
    with pytest.raises(InputError, match="sinks is float64"):
        merge_states(o, lse, sinks=torch.zeros(4, dtype=torch.float64))
    with pytest.raises(InputError, match="outputs no parts to merge"):
        merge_states([], [])


def test_triton_merge_states_checks_its_lists():
    launch = pytest.importorskip("paged_triton_unified.split_launch")
    with pytest.raises(InputError, match="outputs is an empty list"):
        launch.merge_states([], [])
    with pytest.raises(InputError, match=r"outputs: the parts differ in shape \(\[3, 4, 8\], \[2, 4, 8\]\)"):
        launch.merge_states([torch.zeros(3, 4, 8), torch.zeros(2, 4, 8)], [torch.zeros(3, 4), torch.zeros(2, 4)])
    with pytest.raises(InputError, match=r"lses: the parts differ in shape"):
        launch.merge_states([torch.zeros(3, 4, 8)] * 2, [torch.zeros(3, 4), torch.zeros(2, 4)])
    with pytest.raises(InputError, match="outputs is a str"):
        launch.merge_states("x", [torch.zeros(3, 4)])


def test_build_gives_back_its_blocks_when_the_allocator_runs_out():
    # num_free went 5 -> 2: request 0's blocks were never returned.
    a = BlockAllocator(6, shuffle=False)
    with pytest.raises(BatchMetaError, match="out of KV blocks"):
        BatchMeta.build([1, 1], [9, 13], block_size=4, allocator=a)
    assert a.num_free == 5
    assert a.allocate(5) == [1, 2, 3, 4, 5]


def test_from_tensors_refuses_a_bool_block_table():
    with pytest.raises(BatchMetaError, match="block_table is bool"):
        BatchMeta.from_tensors(
            query_lens=[1],
            seq_lens=[2],
            block_table=torch.tensor([[True, False]]),
            slot_mapping=torch.tensor([1]),
            block_size=4,
        )
    with pytest.raises(BatchMetaError, match="slot_mapping is bool"):
        BatchMeta.from_tensors(
            query_lens=[1],
            seq_lens=[2],
            block_table=torch.tensor([[1, 0]]),
            slot_mapping=torch.tensor([True]),
            block_size=4,
        )


def test_allocator_hands_back_python_ints_after_numpy_ids_are_freed():
    np = pytest.importorskip("numpy")
    a = BlockAllocator(4, shuffle=False)
    ids = a.allocate(2)
    a.free([np.int64(i) for i in ids])
    got = a.allocate(3)
    assert got == [3, 1, 2] and all(type(b) is int for b in got)


def test_registry_get_lists_the_accepted_options():
    # registry.get("reference", num_splits=4) quoted a bare TypeError.
    needle = r"Backend 'reference' does not accept options \['num_splits'\]; accepted: compute_dtype, validate"
    with pytest.raises(InputError, match=needle):
        registry.get("reference", num_splits=4)
