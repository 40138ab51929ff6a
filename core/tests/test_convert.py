"""to_flashinfer_pages and to_flash_attn_args against per-request loops."""

from __future__ import annotations

import random

import pytest
import torch
from paged_core import BatchMeta, to_flash_attn_args, to_flashinfer_pages


def random_batch(seed: int, block_size: int) -> BatchMeta:
    """Random mixed batch: padding requests, full and partly full last pages, a wide table."""
    rnd = random.Random(seed)
    qlens, slens = [], []
    for _ in range(rnd.randint(1, 12)):
        kind = rnd.random()
        if kind < 0.2:  # padding
            qlens.append(rnd.randint(0, 2))
            slens.append(0)
        elif kind < 0.35:  # exactly full last page
            s = block_size * rnd.randint(1, 4)
            qlens.append(rnd.randint(1, min(s, 5)))
            slens.append(s)
        else:
            s = rnd.randint(1, 5 * block_size)
            qlens.append(rnd.randint(1, min(s, 6)))
            slens.append(s)
    return BatchMeta.build(qlens, slens, block_size=block_size, seed=seed, table_width=rnd.choice([None, 8]))


def cases():
    return [(seed, bs) for seed in range(12) for bs in (1, 4, 16)]


@pytest.mark.parametrize(("seed", "block_size"), cases())
def test_flashinfer_pages(seed, block_size):
    meta = random_batch(seed, block_size)
    seq_lens = meta.seq_lens.tolist()
    table = meta.block_table.tolist()
    indptr, indices, last = [0], [], []
    for r, s in enumerate(seq_lens):
        pages = -(-s // block_size)
        indptr.append(indptr[-1] + pages)
        indices += table[r][:pages]
        last.append(0 if s == 0 else s - (pages - 1) * block_size)
    p = to_flashinfer_pages(meta)
    for t in (p.indptr, p.indices, p.last_page_len):
        assert t.dtype == torch.int32 and t.device == meta.device
    assert p.indptr.tolist() == indptr
    assert p.indices.shape[0] == meta.num_reqs * meta.block_table.shape[1]  # an upper bound, no sync
    assert p.indices[: indptr[-1]].tolist() == indices
    assert p.last_page_len.tolist() == last
    assert all(1 <= x <= block_size for x, s in zip(last, seq_lens, strict=True) if s)
    assert p.indptr_cpu.device.type == "cpu" and p.indptr_cpu.tolist() == indptr
    assert p.last_page_len_cpu.device.type == "cpu" and p.last_page_len_cpu.tolist() == last


def test_flashinfer_pages_by_hand():
    # seq 17 in blocks [4, 7] (last page holds 1), seq 3 in [2], padding, seq 16 exactly one full page.
    meta = BatchMeta.from_lists([1, 2, 1, 1], [17, 3, 0, 16], [[4, 7], [2], [], [9]], block_size=16, table_width=3)
    p = to_flashinfer_pages(meta)
    assert p.indptr.tolist() == [0, 2, 3, 3, 4]
    assert p.indices[:4].tolist() == [4, 7, 2, 9]
    assert p.last_page_len.tolist() == [1, 3, 0, 16]


def test_flashinfer_pages_without_mirrors():
    meta = random_batch(3, 4)
    meta.seq_lens_cpu = meta.query_start_loc_cpu = None
    p = to_flashinfer_pages(meta)
    assert p.indptr_cpu is None and p.last_page_len_cpu is None
    assert p.indptr.tolist() == to_flashinfer_pages(random_batch(3, 4)).indptr.tolist()


@pytest.mark.parametrize(("seed", "block_size"), cases())
def test_flash_attn_args(seed, block_size):
    meta = random_batch(seed, block_size)
    qlens, slens = meta.host()
    cu_q, cu_k = [0], [0]
    for q, s in zip(qlens, slens, strict=True):
        cu_q.append(cu_q[-1] + q)
        cu_k.append(cu_k[-1] + s)
    a = to_flash_attn_args(meta)
    for t in (a.cu_seqlens_q, a.cu_seqlens_k, a.seqused_k, a.block_table):
        assert t.dtype == torch.int32 and t.device == meta.device
    assert a.cu_seqlens_q.tolist() == cu_q
    assert a.cu_seqlens_k.tolist() == cu_k
    assert a.seqused_k.tolist() == slens
    assert a.max_seqlen_q == max(qlens) and a.max_seqlen_k == max(slens)
    assert torch.equal(a.block_table, meta.block_table)


def test_flash_attn_args_by_hand():
    a = to_flash_attn_args(BatchMeta.from_lists([1, 2, 3], [17, 3, 0], [[4, 7], [2], []], block_size=16))
    assert a.cu_seqlens_q.tolist() == [0, 1, 3, 6]
    assert a.cu_seqlens_k.tolist() == [0, 17, 20, 20]
    assert a.seqused_k.tolist() == [17, 3, 0]
    assert (a.max_seqlen_q, a.max_seqlen_k) == (3, 17)
