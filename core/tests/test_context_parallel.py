"""Context-parallel decode: ``shard_decode_batch`` deals a batch's KV blocks out to ranks,
``context_parallel_decode`` attends to each rank's share and merges the shares over gloo (CPU),
and every rank ends with attention over the whole context, equal to the float64 reference of the
unsharded batch."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from paged_conformance.tolerances import assert_close_to_reference, lse_tolerance, output_tolerance
from paged_core import BatchMeta, InputError, allocate_kv_cache, reference_attention, registry
from paged_core.distributed import context_parallel_decode, shard_decode_batch, shard_kv_cache

HQ, HKV, D, BS = 4, 2, 32, 8
# One decode token per request. 0: padding; 1: the new token alone; 5 and 8: one block, so one
# rank only; 83 and 37: 11 and 5 blocks, uneven shares over 2 and 3 ranks (5 + 6, 3 + 4 + 4;
# 2 + 3, 1 + 2 + 2 contiguous) with a partly full last block; 16: a full last block.
SEQ_LENS = [83, 0, 5, 37, 1, 16, 8]
BACKENDS = ["reference", "triton-unified"]  # triton-unified under TRITON_INTERPRET=1 (conftest)
LAYOUTS = ["contiguous", "interleaved"]


def _whole_batch():
    """The unsharded step: its batch (shuffled blocks, junk in the blocks no request owns), the
    cache holding every key including the new tokens', and q, the new K/V and sinks."""
    g = torch.Generator().manual_seed(0)
    meta = BatchMeta.build([1] * len(SEQ_LENS), SEQ_LENS, block_size=BS, num_blocks=40, seed=3)
    cache = allocate_kv_cache(40, BS, HKV, D, dtype=torch.float32)
    cache.k.normal_(generator=g)
    cache.v.normal_(generator=g)
    q = torch.randn(len(SEQ_LENS), HQ, D, generator=g)
    k_new = torch.randn(len(SEQ_LENS), HKV, D, generator=g)
    v_new = torch.randn(len(SEQ_LENS), HKV, D, generator=g)
    # Sinks big enough to matter next to the real keys' mass (log-sum-exp ~ log(83)).
    sinks = torch.tensor([-1.0, 0.5, 2.0, 4.0])
    registry.get("reference").write(cache, k_new, v_new, meta)
    return meta, cache, q, k_new, v_new, sinks


def _stale(cache, meta):
    """The cache before the step: junk where the new tokens go, so a rank that fails to write
    its new token (or writes it elsewhere) shows in the result."""
    stale = allocate_kv_cache(cache.num_blocks, BS, HKV, D, dtype=torch.float32)
    stale.k.copy_(cache.k)
    stale.v.copy_(cache.v)
    junk = torch.full((meta.num_tokens, HKV, D), 7.0)
    registry.get("reference").write(stale, junk, -junk, meta)
    return stale


def _rank(rank: int, world: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        meta, cache, q, k_new, v_new, sinks = _whole_batch()
        stale = _stale(cache, meta)
        for name in BACKENDS:
            backend = registry.get(name, compute_dtype=torch.float64) if name == "reference" else registry.get(name)
            for layout in LAYOUTS:
                # The interpreter is slow: the Triton backend runs the compact pools only.
                for compact in (True, False) if name == "reference" else (True,):
                    shard = shard_decode_batch(meta, rank, world, layout=layout, compact=compact)
                    if compact:
                        pool = shard_kv_cache(stale, meta, rank, world, layout=layout)
                    else:  # a full-size pool of which the rank uses its share
                        pool = allocate_kv_cache(stale.num_blocks, BS, HKV, D, dtype=torch.float32)
                        pool.k.copy_(stale.k)
                        pool.v.copy_(stale.v)
                    backend.write(pool, k_new, v_new, shard)
                    plan = backend.plan(shard)
                    out, lse = context_parallel_decode(backend, q, pool, plan, sinks=sinks)
                    results[(rank, name, layout, compact)] = (out, lse, shard.seq_lens.tolist(), pool.num_blocks)
    finally:
        dist.destroy_process_group()


def _spawn(world: int, tmp_path: pathlib.Path) -> dict:
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_rank, args=(r, world, str(tmp_path / "init"), results)) for r in range(world)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(300)
            assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
        return dict(results)


@pytest.mark.parametrize("world", [2, 3])
def test_every_rank_ends_with_attention_over_the_whole_context(world: int, tmp_path: pathlib.Path):
    results = _spawn(world, tmp_path)
    meta, cache, q, _, _, sinks = _whole_batch()
    want, want_lse = reference_attention(q, cache, meta, sinks=sinks, compute_dtype=torch.float64, return_lse=True)
    real = torch.tensor([s > 0 for s in SEQ_LENS])
    assert len(results) == world * len(LAYOUTS) * 3
    for (rank, name, layout, compact), (out, lse, _shares, pool_blocks) in sorted(results.items()):
        case = f"{world} ranks/rank {rank}/{layout}/{'compact' if compact else 'full pool'}"
        assert_close_to_reference(
            out,
            want,
            backend=name,
            case=case,
            tolerance=output_tolerance(torch.float32),
            query_start_loc=meta.query_start_loc.tolist(),
            seq_lens=SEQ_LENS,
        )
        assert_close_to_reference(
            lse[real], want_lse[real], backend=name, case=case, what="lse", tolerance=lse_tolerance(torch.float32)
        )
        assert (out[~real] == 0).all() and torch.isneginf(lse[~real]).all(), f"[{name}/{case}] padding rows"
        if compact:
            assert pool_blocks < cache.num_blocks, f"[{case}] a compact pool holds the rank's blocks only"
    for layout in LAYOUTS:
        shares = [results[(r, "reference", layout, True)][2] for r in range(world)]
        assert [sum(col) for col in zip(*shares, strict=True)] == SEQ_LENS, f"{layout}: the shares tile each context"
        one_rank = [sum(col[r] > 0 for col in shares) for r in range(len(SEQ_LENS))]
        assert [one_rank[r] for r in (2, 4, 6)] == [1, 1, 1], f"{layout}: a one-block request lives on one rank"
        assert one_rank[0] == world and one_rank[3] == world, f"{layout}: a long request spans every rank"


def test_contiguous_and_interleaved_ownership():
    # A request of 7 blocks (52 tokens: the last block holds 4), its blocks at physical 10 .. 16.
    meta = BatchMeta.from_lists([1], [52], [[10, 11, 12, 13, 14, 15, 16]], block_size=8)
    tables = {}
    for layout in LAYOUTS:
        shards = [shard_decode_batch(meta, r, 3, layout=layout, compact=False) for r in range(3)]
        tables[layout] = [
            (s.block_table[0, : -(-int(s.seq_lens[0]) // 8)].tolist(), int(s.seq_lens[0]), int(s.slot_mapping[0]))
            for s in shards
        ]
    # contiguous: blocks [r * 7 // 3, (r + 1) * 7 // 3); the last rank owns the last block.
    assert tables["contiguous"] == [([10, 11], 16, -1), ([12, 13], 16, -1), ([14, 15, 16], 20, 16 * 8 + 3)]
    # interleaved: block j on rank j % 3.
    assert tables["interleaved"] == [([10, 13, 16], 20, 16 * 8 + 3), ([11, 14], 16, -1), ([12, 15], 16, -1)]
    # Compact ids number each rank's own pool from 0.
    compact = shard_decode_batch(meta, 0, 3, layout="interleaved")
    assert compact.block_table[0].tolist() == [0, 1, 2] and compact.slot_mapping.tolist() == [2 * 8 + 3]


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8", "fp8-static", "fp8_e5m2", "fp8_e5m2-static"])
def test_a_shared_block_is_stored_once_in_a_compact_pool(kv_dtype: str):
    # Two requests share their first block (parallel sampling): one copy in the pool.
    meta = BatchMeta.from_lists([1, 1], [20, 12], [[5, 6, 7], [5, 2]], block_size=8)
    shard = shard_decode_batch(meta, 0, 1)
    assert shard.block_table.tolist() == [[0, 1, 2], [0, 3, 0]]
    kv_dtype, _, static = kv_dtype.partition("-")
    # Static scales (one per KV head) go with the shard unchanged: its codes mean the same values.
    fixed = dict(k_scale=torch.linspace(0.01, 0.02, HKV), v_scale=0.03) if static else {}
    whole = allocate_kv_cache(8, 8, HKV, D, dtype=torch.float32, kv_dtype=kv_dtype, **fixed)
    g = torch.Generator().manual_seed(1)
    every_slot = BatchMeta.from_lists([64], [64], [list(range(8))], block_size=8)
    registry.get("reference").write(
        whole, torch.randn(64, HKV, D, generator=g), torch.randn(64, HKV, D, generator=g), every_slot
    )
    pool = shard_kv_cache(whole, meta, 0, 1)
    assert pool.num_blocks == 4 and pool.kv_dtype == kv_dtype and pool.static_scales == bool(static)
    order = [5, 6, 7, 2]
    for name in ("k", "v", "k_scale", "v_scale"):
        got, want = getattr(pool, name), getattr(whole, name)
        if want is None:
            assert got is None and kv_dtype == "auto"
            continue
        if want.dtype == torch.float8_e4m3fn:  # compare the bytes: CPU indexing lacks float8
            got, want = got.view(torch.uint8), want.view(torch.uint8)
        assert torch.equal(got, want[order]), name
    # Rank 1 of 2, contiguous: request 0's logical blocks 1 and 2 (6, 7), request 1's block 1 (2).
    assert torch.equal(shard_kv_cache(whole, meta, 1, 2).k.view(torch.uint8), whole.k.view(torch.uint8)[[6, 7, 2]])


@pytest.mark.parametrize(
    ("query_lens", "seq_lens", "match"),
    [
        ([1, 4], [30, 40], "request 1 has query_len 4 .*prefill chunk or a verification block"),
        ([1, 9], [30, 9], "request 1 has query_len 9 .*whole prompt"),
        ([0, 1], [30, 9], "request 0 has query_len 0"),
    ],
    ids=["prefill_chunk_or_verification", "whole_prompt", "no_query_row"],
)
def test_refuses_what_is_not_a_decode_step(query_lens, seq_lens, match):
    meta = BatchMeta.build(query_lens, seq_lens, block_size=BS)
    with pytest.raises(InputError, match=match) as err:
        shard_decode_batch(meta, 0, 2)
    assert "accepted: decode steps only" in str(err.value)


def test_refuses_bad_ranks_and_layouts():
    meta = BatchMeta.build([1], [30], block_size=BS)
    with pytest.raises(InputError, match=r"rank is 2; accepted: an int from 0 to world_size - 1 = 1"):
        shard_decode_batch(meta, 2, 2)
    with pytest.raises(InputError, match="world_size is 0"):
        shard_decode_batch(meta, 0, 0)
    with pytest.raises(InputError, match="layout is 'striped'; accepted: 'contiguous' or 'interleaved'"):
        shard_decode_batch(meta, 0, 2, layout="striped")  # type: ignore[arg-type]


def test_the_step_refuses_a_window_and_a_prefill_before_any_collective():
    # No process group exists here: the refusals come before forward and the all-gather.
    backend = registry.get("reference")
    meta = BatchMeta.build([1], [30], block_size=BS)
    cache = allocate_kv_cache(8, BS, HKV, D, dtype=torch.float32)
    q = torch.randn(1, HQ, D)
    with pytest.raises(InputError, match="window=16; accepted: 0"):
        context_parallel_decode(backend, q, cache, meta, window=16)
    prefill = BatchMeta.build([5], [30], block_size=BS)
    with pytest.raises(InputError, match="max_query_len 5; accepted: decode steps"):
        context_parallel_decode(backend, torch.randn(5, HQ, D), cache, prefill)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_every_shard_is_a_valid_batch(layout: str):
    # PAGED_VALIDATE=1 runs validate() in write and forward: a rank that does not own a
    # request's last block has slot -1 on a real row, which a shard must be allowed.
    meta = BatchMeta.build([1] * len(SEQ_LENS), SEQ_LENS, block_size=BS, num_blocks=40, seed=3)
    whole = allocate_kv_cache(40, BS, HKV, D, dtype=torch.float32)
    backend = registry.get("reference", validate=True)
    for rank in range(3):
        for compact in (True, False):
            shard = shard_decode_batch(meta, rank, 3, layout=layout, compact=compact)
            pool = shard_kv_cache(whole, meta, rank, 3, layout=layout) if compact else whole
            shard.validate(num_blocks=pool.num_blocks)
            backend.write(pool, torch.randn(len(SEQ_LENS), HKV, D), torch.randn(len(SEQ_LENS), HKV, D), shard)
            backend.forward(torch.randn(len(SEQ_LENS), HQ, D), pool, shard, return_lse=True)
