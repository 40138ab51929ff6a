"""The block-size bridge: 16-token block caches seen as 256-token blocks, same memory, same answers."""

from __future__ import annotations

import math

import pytest
import torch
from fa2_helpers import MIXED, make_batch
from paged_conformance.tolerances import assert_close_to_reference, lse_tolerance, output_tolerance
from paged_core import BatchMeta, BlockAllocator, allocate_kv_cache, reference_attention, write_kv
from paged_flash_attn2 import (
    BridgedAllocator,
    BridgeError,
    big_block_table,
    bridge_cache,
    bridge_meta,
    check_aligned_runs,
    small_block_view,
)
from paged_flash_attn2.backend import FlashAttn2Backend

NUM_BLOCKS_16 = 16 * 24  # 24 big blocks of 256 tokens


def bridged_batch(pairs, *, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16, seed=0):
    """A 16-token cache and batch allocated through the bridge, plus q and fresh K/V for the step."""
    alloc = BridgedAllocator(NUM_BLOCKS_16, seed=seed)
    meta16 = BatchMeta.build([a for a, _ in pairs], [b for _, b in pairs], block_size=16, allocator=alloc)
    g = torch.Generator().manual_seed(seed)
    cache16 = allocate_kv_cache(NUM_BLOCKS_16, 16, num_kv_heads, head_dim, dtype=dtype)
    cache16.k.copy_(torch.randn(cache16.k.shape, generator=g).to(dtype))
    cache16.v.copy_(torch.randn(cache16.v.shape, generator=g).to(dtype))
    q = torch.randn(meta16.num_tokens, num_heads, head_dim, generator=g).to(dtype)
    return q, cache16, meta16


# ---------------------------------------------------------------------------------- allocator
def test_allocator_hands_out_aligned_runs():
    alloc = BridgedAllocator(NUM_BLOCKS_16, seed=3)
    assert alloc.num_free == NUM_BLOCKS_16 - 16  # big block 0 (small blocks 0..15) is reserved
    for n in (1, 15, 16, 17, 40):
        blocks = alloc.allocate(n)
        assert len(blocks) == 16 * math.ceil(n / 16)
        for i in range(0, len(blocks), 16):
            assert blocks[i] % 16 == 0 and blocks[i : i + 16] == list(range(blocks[i], blocks[i] + 16))
        assert 0 not in blocks
        alloc.free(blocks)
    assert alloc.num_free == NUM_BLOCKS_16 - 16
    assert alloc.allocate(0) == []


def test_allocator_refuses_pools_and_frees_that_are_not_whole_runs():
    with pytest.raises(BridgeError, match="multiple of ratio=16"):
        BridgedAllocator(100)
    alloc = BridgedAllocator(64, shuffle=False)
    blocks = alloc.allocate(16)
    with pytest.raises(BridgeError, match="whole runs of 16"):
        alloc.free(blocks[:8])
    with pytest.raises(BridgeError, match="aligned runs"):
        alloc.free(blocks[1:] + [blocks[0]])


# ---------------------------------------------------------------------------------- same memory
def test_both_views_are_the_same_storage():
    cache16 = allocate_kv_cache(NUM_BLOCKS_16, 16, 2, 64, dtype=torch.float16)
    big = bridge_cache(cache16)
    assert tuple(big.k.shape) == (NUM_BLOCKS_16 // 16, 256, 2, 64) and big.block_size == 256
    assert big.k.data_ptr() == cache16.k.data_ptr() and big.v.data_ptr() == cache16.v.data_ptr()
    # write through the 16-token view, read through the 256-token view ...
    cache16.k[16 * 5 + 3, 7] = 1.5  # small block 83 = big block 5, small block 3 of it, token 7
    assert torch.all(big.k[5, 3 * 16 + 7] == 1.5)
    # ... and the other way round
    big.v[2, 255] = -2.0
    assert torch.all(cache16.v[2 * 16 + 15, 15] == -2.0)
    back = small_block_view(big)
    assert back.k.shape == cache16.k.shape and back.k.data_ptr() == cache16.k.data_ptr()


def test_slot_mapping_addresses_the_same_element_in_both_views():
    q, cache16, meta16 = bridged_batch(MIXED)
    meta256 = bridge_meta(meta16, validate=True)
    assert meta256.slot_mapping is meta16.slot_mapping  # unchanged, not merely equal
    cache256 = bridge_cache(cache16)
    g = torch.Generator().manual_seed(9)
    k = torch.randn(meta16.num_tokens, 2, 64, generator=g).to(torch.bfloat16)
    v = torch.randn(meta16.num_tokens, 2, 64, generator=g).to(torch.bfloat16)
    write_kv(cache256, k, v, meta256.slot_mapping)  # padding slots (-1) go to the shared spill block
    qlens, slens = meta16.host()
    qsl = meta16.query_start_loc.tolist()
    for r, (t, s) in enumerate(zip(qlens, slens, strict=True)):
        for i in range(t if s else 0):
            pos = s - t + i
            small = meta16.block_table[r, pos // 16]
            big = meta256.block_table[r, pos // 256]
            assert torch.equal(cache16.k[small, pos % 16], k[qsl[r] + i])
            assert torch.equal(cache256.v[big, pos % 256], v[qsl[r] + i])
    meta256.validate(num_blocks=cache256.num_blocks)


@pytest.mark.parametrize("window", [0, 40])
def test_reference_gives_the_same_numbers_through_both_views(window):
    q, cache16, meta16 = bridged_batch(MIXED + [(1, 1000), (5, 257)])
    meta256 = bridge_meta(meta16, validate=True)
    a, a_lse = reference_attention(q, cache16, meta16, window=window, return_lse=True)
    b, b_lse = reference_attention(q, bridge_cache(cache16), meta256, window=window, return_lse=True)
    assert torch.equal(a, b) and torch.equal(a_lse, b_lse)


def test_backend_accepts_the_bridged_spec():
    q, cache16, meta16 = bridged_batch(MIXED)
    cache256 = bridge_cache(cache16)
    from paged_core import AttentionSpec

    s = AttentionSpec(8, 2, 64, cache256.block_size, dtype=torch.bfloat16, device="cuda")
    assert FlashAttn2Backend.capabilities.reasons(s) == []


def test_adapter_on_the_bridged_view_matches_reference_on_the_16_token_view(fake_flash_attn):
    q, cache16, meta16 = bridged_batch(MIXED + [(1, 1000)])
    backend = FlashAttn2Backend()
    out = torch.full_like(q, float("nan"))  # every row must be written
    lse = torch.full(q.shape[:2], float("nan"))
    backend._forward(
        q,
        bridge_cache(cache16),
        backend.plan(bridge_meta(meta16)),
        out=out,
        lse=lse,
        scale=0.125,
        window=0,
        softcap=0.0,
        sinks=None,
    )
    ref, ref_lse = reference_attention(q, cache16, meta16, scale=0.125, return_lse=True, compute_dtype=torch.float64)
    assert_close_to_reference(out, ref, backend="flash-attn2", case="bridge", tolerance=output_tolerance(q.dtype))
    assert_close_to_reference(
        lse, ref_lse, backend="flash-attn2", case="bridge", what="lse", tolerance=lse_tolerance(q.dtype)
    )


# ---------------------------------------------------------------------------------- conversion
def test_conversion_is_first_of_run_divided_by_ratio():
    table = torch.tensor([[48, 49, 50, 51, 16, 17, 18], [4, 5, 6, 7, 0, 0, 0]], dtype=torch.int32)
    assert big_block_table(table, ratio=4).tolist() == [[12, 4], [1, 0]]
    assert big_block_table(table, ratio=4).dtype == torch.int32


def test_conversion_needs_no_data_on_the_host():
    # Meta tensors have shapes but no values: any .item()/.tolist()/bool() (a device sync on a GPU)
    # would raise here.
    table = torch.empty(7, 40, dtype=torch.int32, device="meta")
    out = big_block_table(table)
    assert out.shape == (7, 3) and out.device.type == "meta"
    meta = BatchMeta(
        num_reqs=7,
        query_start_loc=torch.empty(8, dtype=torch.int32, device="meta"),
        seq_lens=torch.empty(7, dtype=torch.int32, device="meta"),
        block_table=table,
        slot_mapping=torch.empty(9, dtype=torch.int64, device="meta"),
        block_size=16,
        max_query_len=3,
        max_seq_len=600,
    )
    assert bridge_meta(meta, validate=False).block_table.shape == (7, 3)


# ---------------------------------------------------------------------------------- misaligned tables
def test_a_plain_shuffled_allocation_is_refused():
    meta16 = BatchMeta.build([1, 1], [40, 300], block_size=16, allocator=BlockAllocator(64, seed=1))
    with pytest.raises(BridgeError, match=r"request 0: block_table\[0, 0:3\] is \[.*\], not an aligned run"):
        bridge_meta(meta16, validate=True)


@pytest.mark.parametrize(
    "row, bad_entry",
    [
        ([17, 18, 19], 0),  # consecutive, but the run starts at 17, not a multiple of 16
        ([16, 17, 19], 2),  # a gap inside the run
        (list(range(32, 48)) + [80, 96], 17),  # second run's entries are not consecutive
    ],
)
def test_misaligned_runs_raise_naming_request_and_entry(row, bad_entry):
    seq_len = 16 * len(row)
    tables = [[16, 17], row]
    meta16 = BatchMeta.from_lists([1, 1], [20, seq_len], tables, block_size=16)
    with pytest.raises(BridgeError, match=rf"request 1: .*entry {bad_entry} is"):
        check_aligned_runs(meta16.block_table, meta16.seq_lens, block_size=16)


def test_only_used_blocks_must_be_aligned():
    # Request 0 uses 2 small blocks; the rest of its row is padding the engine never filled.
    meta16 = BatchMeta.from_lists([1, 0], [20, 0], [[64, 65, 3, 9], []], block_size=16)
    check_aligned_runs(meta16.block_table, meta16.seq_lens, block_size=16)
    assert bridge_meta(meta16, validate=True).block_table[0, 0].item() == 4


def test_validation_follows_paged_validate(monkeypatch):
    meta16 = BatchMeta.from_lists([1], [20], [[17, 18]], block_size=16)
    monkeypatch.setenv("PAGED_VALIDATE", "0")
    bridge_meta(meta16)  # off the hot path by default: no check, no sync
    monkeypatch.setenv("PAGED_VALIDATE", "1")
    with pytest.raises(BridgeError):
        bridge_meta(meta16)


def test_caches_that_cannot_be_viewed_are_refused():
    with pytest.raises(BridgeError, match="multiple of ratio=16"):
        bridge_cache(allocate_kv_cache(40, 16, 2, 64))
    cache = allocate_kv_cache(32, 16, 2, 64)
    every_other_block = type(cache)(k=cache.k[::2], v=cache.v[::2], dtype=cache.dtype)
    with pytest.raises(BridgeError, match="without copying"):
        bridge_cache(every_other_block)


def test_make_batch_helper_is_unbridged():
    # Guard for the helper used elsewhere: plain batches keep 256-token blocks as built.
    assert make_batch([(1, 5)])[2].block_size == 256
