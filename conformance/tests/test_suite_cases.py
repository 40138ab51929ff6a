"""The case table covers what the suite promises, and its data is what the cases say."""

from __future__ import annotations

import dataclasses
import doctest
import math

import paged_conformance.cases
import paged_conformance.tolerances
import paged_conformance.workload
import pytest
import torch
from paged_conformance.cases import SIZES, cases, default_size, get_case
from paged_conformance.tolerances import ConformanceFailure, Tolerance, assert_close_to_reference
from paged_conformance.workload import build_workload, clear_workloads


@pytest.mark.parametrize("size", SIZES)
def test_ids_are_unique_and_the_same_at_every_size(size):
    ids = [c.id for c in cases(size)]
    assert len(ids) == len(set(ids))
    assert ids == [c.id for c in cases("small")]


@pytest.mark.parametrize("size", SIZES)
def test_the_table_covers_the_promised_features(size):
    table = cases(size)
    mixed = get_case("mixed_prefill_and_decode-g4", size)
    pairs = set(zip(mixed.query_lens, mixed.seq_lens, strict=True))
    assert any(1 < q < s for q, s in pairs), "a mid-prefill chunk"
    assert {(16, 16), (21, 21), (1, 70), (1, 130)} <= pairs, "prompts of 16 and 21, decodes at 70 and 130"
    assert {c.group_size for c in table if c.id.startswith("mixed")} == {4, 3, 1}
    assert {16, 32, 64, 256} <= {c.block_size for c in table}
    assert {64, 96, 128, 256} <= {c.head_dim for c in table}
    assert {c.kv_dtype for c in table} == {"auto", "int8", "fp8", "fp8_e5m2", "int4", "kivi4"}
    assert {c.dtype for c in table} == {torch.float32, torch.float16, torch.bfloat16}
    assert {dict(c.options).get("num_splits") for c in table} == {None, 1, 3, 8}
    window = get_case("sliding_window", size)
    assert 0 < window.window < max(window.query_lens), "a window shorter than the prefill chunk"
    assert get_case("padding_rows", size).padding_requests
    assert 5 in get_case("spec_verify_5", size).query_lens
    assert 1 in get_case("first_token", size).seq_lens
    decode = get_case("decode_only-long_and_short", size)
    assert decode.decode_only and max(decode.seq_lens) >= 10 * min(decode.seq_lens)
    assert any(c.softcap for c in table) and any(c.sinks for c in table)
    assert any(c.q_layout == "qkv_view" for c in table)
    assert any(c.num_reqs > 32 for c in table) and any(c.num_reqs > 128 for c in table)
    assert {c.cache_layout for c in table} == {"nhd", "kv_interleaved", "hnd_view"}
    assert all(c.num_kv_heads > 1 for c in table if c.cache_layout != "nhd"), "head strides must matter"
    assert any(c.sinks and c.sinks_layout == "every_other" for c in table)


def test_full_size_is_gpu_sized():
    case = get_case("mixed_prefill_and_decode-g4", "full")
    assert (case.num_heads, case.num_kv_heads, case.head_dim) == (32, 8, 128)
    assert case.num_reqs >= 32 and max(case.seq_lens) >= 2048


def test_size_from_the_environment(monkeypatch):
    monkeypatch.setenv("PAGED_CONFORMANCE_SIZE", "full")
    assert default_size() == "full"
    monkeypatch.setenv("PAGED_CONFORMANCE_SIZE", "huge")
    with pytest.raises(ValueError, match="accepted: small, full"):
        default_size()


@pytest.mark.parametrize("case_id", ["mixed_prefill_and_decode-g3", "padding_rows", "kv_fp8", "qkv_view"])
def test_workload_is_random_paged_and_reproducible(case_id, cpu):
    case = get_case(case_id, "small")
    wl = build_workload(case, cpu)
    table = wl.meta.block_table.tolist()
    used = [b for r in case.real_requests for b in table[r][: math.ceil(case.seq_lens[r] / case.block_size)]]
    assert 0 not in used, "block 0 is reserved"
    assert len(used) == len(set(used))
    assert used != sorted(used), "blocks are shuffled, not contiguous"
    assert bool((wl.q != 0).all()) and bool((wl.k_new != 0).all())
    assert wl.ref_out.dtype == torch.float64
    assert not bool(wl.ref_out[wl.padding_rows].any())
    if case.q_layout == "qkv_view":
        assert not wl.q.is_contiguous()
    # The same seed draws the same data; another kv_dtype shares q, K and V.
    clear_workloads(case.id)
    again = build_workload(case, cpu)
    assert again is not wl and torch.equal(again.q, wl.q) and torch.equal(again.k_new, wl.k_new)


def test_garbage_outside_the_context(cpu):
    """Slots past each request's tokens hold non-zero garbage, so reading them shows."""
    case = get_case("decode_only-long_and_short", "small")
    wl = build_workload(case, cpu)
    k = wl.cache_after.k.reshape(-1, case.num_kv_heads, case.head_dim)
    assert bool((k != 0).all())


def test_assert_close_reports_where_and_how_much():
    ref = torch.zeros(5, 2, 4, dtype=torch.float64)
    out = ref.clone().to(torch.float16)
    out[3, 1, 2] = 0.25
    out[0, 0, 0] = 0.01
    with pytest.raises(ConformanceFailure) as err:
        assert_close_to_reference(
            out, ref, backend="b", case="c", tolerance=Tolerance(1e-3, 0), query_start_loc=[0, 2, 5], seq_lens=[10, 3]
        )
    msg = str(err.value)
    assert msg.startswith("[b/c] output differs from the float64 reference: max abs error 2.5e-01")
    assert "request 1, head 1, row 3 (token 1 of 3, position 1 of seq_len 3)" in msg
    assert "exceeded by 2 of 40 elements" in msg and "mean abs error" in msg
    assert err.value.max_error == 0.25


def test_assert_close_treats_nan_as_failure_and_masks_rows():
    ref = torch.zeros(3, 1, 2, dtype=torch.float64)
    out = torch.full((3, 1, 2), math.nan)
    with pytest.raises(ConformanceFailure, match="max abs error inf"):
        assert_close_to_reference(out, ref, backend="b", case="c", tolerance=Tolerance(1, 1))
    assert (
        assert_close_to_reference(
            out, ref, backend="b", case="c", tolerance=Tolerance(1, 1), rows=torch.tensor([False, False, False])
        )
        == 0.0
    )


def test_equal_infinities_match():
    lse = torch.tensor([[-math.inf, 1.0]])
    assert (
        assert_close_to_reference(lse, lse.double(), backend="b", case="c", what="lse", tolerance=Tolerance(1e-6, 0))
        == 0.0
    )
    with pytest.raises(ConformanceFailure, match="lse differs"):
        assert_close_to_reference(
            torch.tensor([[0.0, 1.0]]), lse.double(), backend="b", case="c", what="lse", tolerance=Tolerance(1e-6, 0)
        )


@pytest.mark.parametrize("module", [paged_conformance.cases, paged_conformance.tolerances, paged_conformance.workload])
def test_doctests(module):
    result = doctest.testmod(module)
    assert result.attempted > 0 and result.failed == 0


def test_random_batches_at_full_size_vary_batches_not_shapes():
    """On a GPU every new shape is a compile (FlashInfer's JIT: minutes); the table covers shapes.
    At full size the draws keep one model shape and vary the batch; on the CPU they roam."""
    from hypothesis import given, settings
    from paged_conformance.checks import random_cases
    from paged_core import ReferenceBackend

    caps = ReferenceBackend.capabilities
    _, (groups, head_dims, block_sizes, dtypes, kv_dtypes) = random_cases(caps, "small")
    assert len(head_dims) > 1 and len(dtypes) > 1 and len(kv_dtypes) > 1 and len(block_sizes) > 1
    strategy, menus = random_cases(caps, "full")
    assert menus == ([1, 4], [128], [16], [torch.bfloat16], ["auto"])
    seen = set()

    @settings(max_examples=25, derandomize=True, database=None, deadline=None)
    @given(case=strategy)
    def draws(case):
        assert (case.head_dim, case.block_size, case.dtype, case.kv_dtype, case.softcap) == (
            128,
            16,
            torch.bfloat16,
            "auto",
            0.0,
        )
        seen.add((len(case.seq_lens), case.query_lens))

    draws()
    assert len(seen) > 10  # the batches do vary


def test_block_tables_share_the_prefix_and_nothing_else():
    """The table builder of the suite's workloads and of ``paged bench``."""
    from paged_conformance.workload import allocate_tables, blocks_needed
    from paged_core import BlockAllocator

    seq_lens = [40, 36, 0, 20]  # blocks of 16: 3, 3, none (padding), 2
    assert blocks_needed(seq_lens, 16, shared_prefix_blocks=2) == 2 + 1 + 1 + 0
    assert blocks_needed(seq_lens, 16) == 8
    tables = allocate_tables(seq_lens, 16, BlockAllocator(9, shuffle=True, seed=1), shared_prefix_blocks=2)
    assert [len(t) for t in tables] == [3, 3, 0, 2]
    assert tables[0][:2] == tables[1][:2] == tables[3]
    own = tables[0][2:] + tables[1][2:]
    assert len(set(own)) == 2 and not set(own) & set(tables[3])


@pytest.mark.parametrize("case_id", ["mixed_prefill_and_decode-g4", "padding_rows", "shared_prefix"])
def test_block_tables_hold_stale_valid_ids_past_every_requests_blocks(case_id, cpu):
    """As an engine's reused tables do: a kernel that stops at a zero pad reads garbage."""
    from paged_conformance.workload import STALE_COLUMNS

    case = get_case(case_id, "small")
    wl = build_workload(case, cpu)
    table = wl.meta.block_table.tolist()
    own = [math.ceil(s / case.block_size) for s in case.seq_lens]
    assert len(table[0]) >= max(own) + STALE_COLUMNS >= max(own) + 1
    stale = [b for row, n in zip(table, own, strict=True) for b in row[n:]]
    assert len(stale) == sum(len(row) - n for row, n in zip(table, own, strict=True))
    assert all(0 < b < wl.num_blocks for b in stale), "stale ids are valid block ids, never the zero pad"
    assert len(set(stale)) > 1


@pytest.mark.parametrize("case_id", ["cache-kv_interleaved", "cache-hnd_view"])
def test_strided_cache_cases_are_views_of_an_engine_pool(case_id, cpu):
    from paged_core import ReferenceBackend

    case = get_case(case_id, "small")
    wl = build_workload(case, cpu)
    cache = wl.fresh_cache(ReferenceBackend())
    nb, bs, h, d = wl.num_blocks, case.block_size, case.num_kv_heads, case.head_dim
    assert tuple(cache.k.shape) == tuple(cache.v.shape) == (nb, bs, h, d)
    assert not cache.k.is_contiguous() and not cache.v.is_contiguous()
    if case.cache_layout == "kv_interleaved":
        assert cache.k.stride() == (2 * bs * h * d, h * d, d, 1)
        assert cache.v.data_ptr() - cache.k.data_ptr() == bs * h * d * cache.k.element_size()
    else:
        assert cache.k.stride() == (h * bs * d, d, bs * d, 1)
    # It holds the context like the NHD cache of the reference.
    assert torch.equal(cache.k, wl.cache_before.k) and torch.equal(cache.v, wl.cache_before.v)


def test_strided_sinks_are_every_other_element_of_a_buffer(cpu):
    wl = build_workload(get_case("sinks-strided", "small"), cpu)
    assert wl.sinks.stride() == (2,)
    plain = build_workload(get_case("sinks", "small"), cpu)
    assert plain.sinks.is_contiguous()
    base = wl.sinks.as_strided(tuple(wl.sinks.shape), (1,), wl.sinks.storage_offset())
    assert not torch.equal(base, wl.sinks), "reading the buffer as contiguous gives other numbers"


def test_the_quantization_bound_follows_the_static_int8_step():
    # One static scale per KV head must cover every token's largest element, so int8 rounds to a
    # coarser step than per-slot scales (~2x at the small size's head dim 64, ~3x at 128); fp8
    # rounds relative to each element either way.
    import paged_conformance.checks as checks

    for case_id, grows in (("kv_int8-static", True), ("kv_fp8-static-decode_only", False), ("kv_int8", False)):
        case = get_case(case_id, "small")
        wl = build_workload(case, torch.device("cpu"))
        full = build_workload(dataclasses.replace(case, kv_dtype="auto", kv_scales="per_slot"), torch.device("cpu"))
        stated = paged_conformance.tolerances.QUANTIZED_VS_FULL_PRECISION[case.kv_dtype]
        bound = checks._quantization_bound(case, wl, full)
        assert (bound.atol > 1.5 * stated.atol) if grows else (bound == stated), (case_id, bound)
    clear_workloads()


def test_the_reference_meets_the_static_int8_bound_at_full_size():
    # At full size the per-slot bound failed the reference itself on this case (H200 and CPU
    # alike, 2026-12-01: 6.6e-2 on a row that sees two keys, against 6e-2).
    from paged_conformance.checks import check_close_to_full_precision
    from paged_core import registry

    result = check_close_to_full_precision(
        registry.get("reference"), get_case("kv_int8-static", "full"), torch.device("cpu")
    )
    assert 0 < result.max_error < 0.1
    clear_workloads()
