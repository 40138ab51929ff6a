"""Batches for paged-flash-attn2's tests (a module, not conftest, so its name is unique)."""

from __future__ import annotations

import torch
from paged_core import BatchMeta, allocate_kv_cache

#: (query_len, seq_len) of the mixed batch: a mid-prefill chunk, whole 16- and 21-token prompts,
#: decodes at 70 and 130, a padding request (seq_len 0) and a decode spanning three 256-blocks.
MIXED = [(8, 40), (16, 16), (21, 21), (1, 70), (1, 130), (3, 0), (1, 600)]


def make_batch(
    pairs,
    *,
    num_heads=8,
    num_kv_heads=2,
    head_dim=64,
    block_size=256,
    dtype=torch.bfloat16,
    seed=0,
    allocator=None,
    num_blocks=None,
):
    """A filled cache, q and BatchMeta for ``pairs`` of (query_len, seq_len); shuffled blocks."""
    g = torch.Generator().manual_seed(seed)
    qlens = [a for a, _ in pairs]
    slens = [b for _, b in pairs]
    meta = BatchMeta.build(qlens, slens, block_size=block_size, allocator=allocator, seed=seed, num_blocks=num_blocks)
    nb = num_blocks or max([int(meta.block_table.max()) + 1, 2])
    cache = allocate_kv_cache(nb, block_size, num_kv_heads, head_dim, dtype=dtype)
    # Fill the whole pool (not only the slots of this batch) so a wrong block id reads garbage.
    cache.k.copy_(torch.randn(cache.k.shape, generator=g).to(dtype))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g).to(dtype))
    q = torch.randn(meta.num_tokens, num_heads, head_dim, generator=g).to(dtype)
    return q, cache, meta
