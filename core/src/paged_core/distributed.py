"""Attention over a KV cache sharded across ranks (context parallelism), on ``torch.distributed``.

Each rank holds part of every request's context in its own paged cache, described by its own
``BatchMeta`` with the same query rows, attends to it with ``return_lse=True``, and the ranks'
partial results merge exactly (:func:`paged_core.merge_states`)::

    shard = shard_decode_batch(meta, rank, world_size)            # this rank's blocks, once per step
    out, lse = context_parallel_decode(backend, q, cache_r, shard)  # every rank: the full attention

which is ``backend.forward(q, cache_r, shard, return_lse=True)`` followed by
:func:`merge_across_ranks`. Shards must be disjoint key sets whose every key each query may see:
by the rule of positions (a request's new tokens are the last of its ``seq_len`` keys) that is
the case for decode steps (one new token per request), the usual context-parallel workload; a
prefill chunk sharded along its context would be masked causally inside each shard, and a
sliding window would count positions inside each shard, so both are refused. Sinks join the
denominator once: pass them to the merge, not to the ranks' ``forward``. Any backend with LSE
output works; NCCL on GPUs, gloo on the CPU.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

import torch
import torch.distributed as dist

from ._batch import BatchMeta, _is_int
from ._cache import KVCache, allocate_kv_cache
from ._errors import InputError
from ._merge import merge_states
from ._quant import is_float8

__all__ = ["LAYOUTS", "context_parallel_decode", "merge_across_ranks", "shard_decode_batch", "shard_kv_cache"]

#: How :func:`shard_decode_batch` deals a request's logical blocks out to the ranks.
LAYOUTS = ("contiguous", "interleaved")
Layout = Literal["contiguous", "interleaved"]


def merge_across_ranks(
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    group: dist.ProcessGroup | None = None,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """All-gather every rank's ``(out, lse)`` over ``group`` and merge them: returns, on every
    rank, attention over the union of the ranks' key sets (and its natural-log LSE).

    ``out [num_tokens, num_heads, head_dim]`` and float32 ``lse [num_tokens, num_heads]`` are
    this rank's ``forward(..., return_lse=True)``, with the same shapes on every rank (a rank
    that holds no key of a request gives ``lse = -inf`` there, and its rows are ignored).
    ``sinks`` (float32 ``[num_heads]``) joins the denominator once.
    """
    if not dist.is_available() or not dist.is_initialized():
        raise InputError(
            "merge_across_ranks needs torch.distributed initialised; call "
            "torch.distributed.init_process_group(...) first (NCCL on GPUs, gloo on the CPU)"
        )
    if not isinstance(out, torch.Tensor) or out.dim() != 3:
        raise InputError(f"out is {_desc(out)}; accepted: [num_tokens, num_heads, head_dim]")
    if not isinstance(lse, torch.Tensor) or tuple(lse.shape) != tuple(out.shape[:2]) or lse.dtype != torch.float32:
        raise InputError(
            f"lse is {_desc(lse)}; accepted: float32 {list(out.shape[:2])} (forward(..., return_lse=True))"
        )
    world = dist.get_world_size(group)
    outs = [torch.empty_like(out) for _ in range(world)]
    lses = [torch.empty_like(lse) for _ in range(world)]
    dist.all_gather(outs, out.contiguous(), group=group)
    dist.all_gather(lses, lse.contiguous(), group=group)
    return merge_states(outs, lses, sinks=sinks)


def shard_decode_batch(
    meta: BatchMeta,
    rank: int,
    world_size: int,
    *,
    layout: Layout = "contiguous",
    compact: bool = True,
) -> BatchMeta:
    """This rank's share of a decode batch whose KV blocks are dealt out to ``world_size`` ranks.

    ``meta`` describes the whole batch as one GPU would see it; every request must be a decode
    (exactly one new token, which sees every earlier key). Logical block ``j`` of a request with
    ``n`` blocks belongs to

    - ``layout="contiguous"``: rank ``r`` with ``r * n // world_size <= j < (r + 1) * n //
      world_size`` (a run of about ``n / world_size`` blocks per rank; short requests live on
      the last ranks only). The split depends on ``n``, so blocks change owner as a context
      grows: it suits a context laid out once (a long prompt), re-sharded when it is refilled.
    - ``layout="interleaved"``: rank ``j % world_size``. A block never changes owner as the
      context grows, and the shares differ by one block at most.

    The result is a batch with the same requests and query rows (the same ``q`` on every
    rank): request ``r``'s block table lists the blocks the rank owns, in order; its
    ``seq_len`` is the number of the request's tokens in them (0 when it owns none: a padding
    request, whose ``lse`` is ``-inf`` and which the merge weighs 0); its ``slot_mapping`` is
    the new token's slot on the rank that owns the last block and -1 elsewhere, so
    ``backend.write(cache_r, k, v, shard)`` stores each new K/V once. Every owned block but the
    request's last is full, so the shard obeys the rule of positions like any batch.

    With ``compact=True`` (the default) block ids are renumbered into the rank's own pool: the
    rank's distinct blocks, in order of first appearance (request by request, then block by
    block), are ``0, 1, 2, ...``; :func:`shard_kv_cache` builds that pool from a whole cache,
    and an engine allocating each rank's pool itself gives it the same numbering. With
    ``compact=False`` the ids are ``meta``'s own: every rank holds a pool of the full size and
    uses its share of it. ``block_size`` is unchanged.

    Reads ``meta``'s block table on the host (a device sync): call it once per step, not per
    layer; every layer of the step shares the shard.

    >>> meta = BatchMeta.from_lists([1, 1], [40, 9], [[7, 3, 5], [2]], block_size=16)
    >>> shard = shard_decode_batch(meta, 0, 2, layout="interleaved", compact=False)
    >>> shard.seq_lens.tolist(), shard.block_table.tolist(), shard.slot_mapping.tolist()
    ([24, 9], [[7, 5], [2, 0]], [87, 40])
    >>> shard_decode_batch(meta, 1, 2, layout="interleaved", compact=False).seq_lens.tolist()
    [16, 0]
    """
    owned, query_lens = _ownership(meta, rank, world_size, layout)
    if not isinstance(compact, bool):
        raise InputError(f"compact is {compact!r}; accepted: True (ids into the rank's own pool) or False")
    bs = meta.block_size
    local: dict[int, int] = {}
    tables: list[list[int]] = []
    seq_lens: list[int] = []
    slots: list[int] = []
    for ids, tokens, last in _per_request(meta, owned):
        if compact:
            ids = [local.setdefault(b, len(local)) for b in ids]
        tables.append(ids)
        seq_lens.append(tokens)
        # The new token sits at the request's last position, in its last block.
        slots.append(ids[-1] * bs + (tokens - 1) % bs if last else -1)
    width = max([len(t) for t in tables] + [1])
    table = torch.zeros(len(tables), width, dtype=torch.int32)
    for r, t in enumerate(tables):
        if t:
            table[r, : len(t)] = torch.tensor(t, dtype=torch.int32)
    return BatchMeta.from_tensors(
        query_lens=query_lens,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_size=bs,
        device=meta.device,
    )


def shard_kv_cache(
    cache: KVCache,
    meta: BatchMeta,
    rank: int,
    world_size: int,
    *,
    layout: Layout = "contiguous",
) -> KVCache:
    """The rank's own compact pool, copied from ``cache`` (a whole cache that ``meta`` reads):
    block ``i`` of the result is the ``i``-th block of the numbering of
    ``shard_decode_batch(meta, rank, world_size, layout=layout)``. Codes and scales of a
    quantized cache are copied as they are. For tests and benchmarks; an engine fills each
    rank's pool itself. Reads ``meta``'s block table on the host.

    >>> meta = BatchMeta.from_lists([1], [40], [[7, 3, 5]], block_size=16)
    >>> whole = allocate_kv_cache(8, 16, 2, 64, dtype=torch.float32)
    >>> shard_kv_cache(whole, meta, 0, 2).num_blocks     # rank 0 owns logical block 0 only
    1
    """
    if not isinstance(cache, KVCache):
        raise InputError(f"cache is {_desc(cache)}; accepted: a paged_core.KVCache")
    owned, _ = _ownership(meta, rank, world_size, layout)
    order: dict[int, None] = {}
    for ids, _tokens, _last in _per_request(meta, owned):
        order.update(dict.fromkeys(ids))
    blocks = list(order)
    bad = [b for b in blocks if not 0 <= b < cache.num_blocks]
    if bad:
        raise InputError(
            f"meta reads block {bad[0]} but cache has {cache.num_blocks} blocks; accepted: the "
            "whole cache that meta's block table indexes"
        )
    # Static scales are shared, not copied: the shard views the whole cache's (one per KV head).
    static = cache.static_scales
    fixed = [t[0, 0] for t in cache._scales()] if static else [None, None]
    shard = allocate_kv_cache(
        max(len(blocks), 1),
        meta.block_size,
        cache.num_kv_heads,
        cache.head_dim,
        dtype=cache.dtype,
        kv_dtype=cache.kv_dtype,
        device=cache.k.device,
        k_scale=fixed[0],
        v_scale=fixed[1],
        head_dim_v=cache.head_dim_v,
    )
    if blocks:
        idx = torch.tensor(blocks, dtype=torch.long, device=cache.k.device)
        pairs = [(shard.k, cache.k), (shard.v, cache.v)]
        for dst_scale, src_scale in ((shard.k_scale, cache.k_scale), (shard.v_scale, cache.v_scale)):
            if dst_scale is not None and src_scale is not None and not static:  # per-slot scales
                pairs.append((dst_scale, src_scale))
        for dst, src in pairs:
            # Through bytes: PyTorch's CPU indexing lacks float8.
            view = torch.uint8 if is_float8(src.dtype) else src.dtype
            dst[: len(blocks)].view(view).copy_(src.view(view).index_select(0, idx))
    return shard


def context_parallel_decode(
    backend: Any,
    q: torch.Tensor,
    cache: KVCache,
    meta: Any,
    *,
    group: dist.ProcessGroup | None = None,
    scale: float | None = None,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    window: int = 0,
) -> tuple[torch.Tensor, torch.Tensor]:
    """One layer's decode attention over a context sharded across the ranks of ``group``.

    ``meta`` is this rank's shard (:func:`shard_decode_batch`, or what ``backend.plan`` made
    of it) and ``cache`` this rank's pool; ``q [num_tokens, num_heads, head_dim]`` is the same
    on every rank. The rank runs ``backend.forward(q, cache, meta, return_lse=True)`` on its
    share and :func:`merge_across_ranks` merges the shares, so every rank returns ``(out,
    lse)`` of attention over the whole context (``out`` in ``q``'s dtype; padding requests:
    zeros and ``-inf``). ``sinks`` join at the merge, once, never in the ranks' ``forward``.
    Every rank of ``group`` must call it (a collective). ``window`` must be 0: a sliding window
    counts positions, which a shard does not know. On every rank, after
    ``torch.distributed.init_process_group`` (NCCL or gloo)::

        shard = shard_decode_batch(meta, dist.get_rank(), dist.get_world_size())
        plan = backend.plan(shard)                       # once per step
        out, lse = context_parallel_decode(backend, q, cache_r, plan)   # per layer
    """
    batch = meta if isinstance(meta, BatchMeta) else getattr(meta, "meta", None)
    if isinstance(batch, BatchMeta) and batch.max_query_len > 1:
        raise InputError(
            f"context_parallel_decode got a batch with max_query_len {batch.max_query_len}; accepted: "
            "decode steps (one new token per request), such as shard_decode_batch's result. A prefill "
            "chunk split along its context would be masked causally inside each shard: run prefill "
            "unsharded"
        )
    if window != 0:
        raise InputError(
            f"context_parallel_decode got window={window!r}; accepted: 0 (full attention). A sliding "
            "window counts positions, which a shard does not know; run windowed layers unsharded"
        )
    out, lse = backend.forward(q, cache, meta, scale=scale, softcap=softcap, return_lse=True)
    return merge_across_ranks(out, lse, group=group, sinks=sinks)


def _ownership(meta: BatchMeta, rank: int, world_size: int, layout: str) -> tuple[list[range], list[int]]:
    """The logical blocks of each request that ``rank`` owns, and the batch's query lengths."""
    if not isinstance(meta, BatchMeta):
        raise InputError(f"meta is {_desc(meta)}; accepted: a paged_core.BatchMeta of the whole batch")
    meta.check_structure()
    if not _is_int(world_size) or world_size < 1:
        raise InputError(f"world_size is {world_size!r}; accepted: a positive int (the number of ranks)")
    if not _is_int(rank) or not 0 <= rank < world_size:
        raise InputError(f"rank is {rank!r}; accepted: an int from 0 to world_size - 1 = {world_size - 1}")
    if layout not in LAYOUTS:
        raise InputError(f"layout is {layout!r}; accepted: {' or '.join(map(repr, LAYOUTS))}")
    query_lens, seq_lens = meta.host()
    for r, (t, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        if t != 1:
            kind = (
                "a request with no query row"
                if t == 0
                else "a whole prompt"
                if t == s
                else "a prefill chunk or a verification block"
            )
            raise InputError(
                f"request {r} has query_len {t} (seq_len {s}): {kind}; accepted: decode steps only, "
                "every request with exactly one new token (padding requests too: seq_len 0, one "
                "row). Its causal mask would cut each shard by local positions: run such steps unsharded"
            )
    bs = meta.block_size
    owned = []
    for s in seq_lens:
        n = -(-s // bs)
        owned.append(
            range(rank * n // world_size, (rank + 1) * n // world_size)
            if layout == "contiguous"
            else range(rank, n, world_size)
        )
    return owned, query_lens


def _per_request(meta: BatchMeta, owned: Sequence[range]) -> Iterator[tuple[list[int], int, bool]]:
    """For each request: the physical ids of its owned blocks, its tokens in them, and whether
    it owns the request's last block."""
    _, seq_lens = meta.host()
    table = meta.block_table.tolist()
    bs = meta.block_size
    for r, (s, blocks) in enumerate(zip(seq_lens, owned, strict=True)):
        n = -(-s // bs)
        ids = [table[r][j] for j in blocks]
        tokens = sum(min(bs, s - j * bs) for j in blocks)
        yield ids, tokens, n > 0 and (n - 1) in blocks


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
    return f"a {type(t).__name__}"
