"""paged_core.distributed: a decode step over a context sharded across two ranks (gloo, CPU)
equals attention over the whole context."""

from __future__ import annotations

import pathlib

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from paged_core import BatchMeta, InputError, allocate_kv_cache, reference_attention
from paged_core.distributed import merge_across_ranks

HQ, HKV, D, BS = 4, 2, 32, 8
# Context lengths of the batch's decodes; rank 0 holds the first SPLIT[r] keys of request r, rank 1
# the rest. Request 1 lives on rank 1 only, request 3 on rank 0 only, request 4 is padding.
SEQ_LENS = [37, 20, 64, 9, 0]
SPLIT = [16, 0, 40, 9, 0]


def _context(seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    keys = [torch.randn(s, HKV, D, generator=g) for s in SEQ_LENS]
    values = [torch.randn(s, HKV, D, generator=g) for s in SEQ_LENS]
    q = torch.randn(len(SEQ_LENS), HQ, D, generator=g)
    return q, keys, values


def _paged(keys, values, seq_lens, *, seed: int):
    """A paged cache holding key/value positions 0 .. seq_lens[r] - 1 of each request (the
    request's new token is its last), and the decode batch that reads it."""
    meta = BatchMeta.build([1] * len(seq_lens), seq_lens, block_size=BS, num_blocks=64, seed=seed)
    cache = allocate_kv_cache(64, BS, HKV, D, dtype=torch.float32)
    cache.k.normal_(generator=torch.Generator().manual_seed(99))  # junk outside the requests' blocks
    cache.v.normal_(generator=torch.Generator().manual_seed(98))
    table = meta.block_table.tolist()
    for r, n in enumerate(seq_lens):
        for p in range(n):
            cache.k[table[r][p // BS], p % BS] = keys[r][p]
            cache.v[table[r][p // BS], p % BS] = values[r][p]
    return meta, cache


def _rank(rank: int, world: int, init_file: str, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        q, keys, values = _context()
        lo = [0 if rank == 0 else s for s in SPLIT]
        hi = [s if rank == 0 else n for s, n in zip(SPLIT, SEQ_LENS, strict=True)]
        shard_lens = [h - lo_ for lo_, h in zip(lo, hi, strict=True)]
        meta, cache = _paged(
            [k[a:b] for k, a, b in zip(keys, lo, hi, strict=True)],
            [v[a:b] for v, a, b in zip(values, lo, hi, strict=True)],
            shard_lens,
            seed=rank,
        )
        out, lse = reference_attention(q, cache, meta, compute_dtype=torch.float64, return_lse=True)
        sinks = torch.linspace(-1.0, 1.0, HQ)
        merged, merged_lse = merge_across_ranks(out.float(), lse.float(), sinks=sinks)
        results[rank] = (merged, merged_lse)
    finally:
        dist.destroy_process_group()


def test_a_decode_step_over_two_ranks_equals_the_whole_context(tmp_path: pathlib.Path):
    ctx = mp.get_context("spawn")
    with ctx.Manager() as manager:
        results = manager.dict()
        procs = [ctx.Process(target=_rank, args=(r, 2, str(tmp_path / "init"), results)) for r in range(2)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(120)
            assert p.exitcode == 0, f"rank process exited with {p.exitcode}"
        results = dict(results)

    q, keys, values = _context()
    meta, cache = _paged(keys, values, SEQ_LENS, seed=7)
    sinks = torch.linspace(-1.0, 1.0, HQ)
    want, want_lse = reference_attention(q, cache, meta, sinks=sinks, compute_dtype=torch.float64, return_lse=True)
    for rank in (0, 1):
        got, got_lse = results[rank]
        torch.testing.assert_close(got.double(), want, atol=1e-5, rtol=1e-5)
        real = torch.tensor([s > 0 for s in SEQ_LENS])
        torch.testing.assert_close(got_lse[real].double(), want_lse[real], atol=1e-5, rtol=1e-5)
        assert (got[~real] == 0).all() and torch.isneginf(got_lse[~real]).all(), "padding rows stay zero / -inf"


def test_needs_an_initialised_process_group():
    if dist.is_available() and dist.is_initialized():
        pytest.skip("a process group is already initialised in this process")
    out = torch.zeros(2, HQ, D)
    with pytest.raises(InputError, match="init_process_group"):
        merge_across_ranks(out, torch.zeros(2, HQ))
