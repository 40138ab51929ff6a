"""The block-size bridge: run flash-attn 2 (256-token blocks) on an engine's 16-token block cache.

FlashAttention 2's paged path requires ``block_size % 256 == 0``; most engines page their cache
in blocks of 16. The bridge makes both true at once, on the *same memory*, without a copy:

1. **Allocate in aligned runs.** :class:`BridgedAllocator` hands out 16-token blocks only in
   runs of ``ratio = 16`` consecutive ids that start at a multiple of 16: small blocks
   ``16*B .. 16*B + 15`` are exactly big block ``B``.
2. **View the pool both ways.** A contiguous ``[num_blocks, 16, H, D]`` pool *is* a
   ``[num_blocks // 16, 256, H, D]`` pool (:func:`bridge_cache`, :func:`small_block_view`):
   ``.view`` only, same storage. A flat slot index addresses the same element in both views,
   because ``(16*B + j) * 16 + o == B * 256 + (16*j + o)``, so ``slot_mapping`` is unchanged and
   K/V writes may go through either view.
3. **Convert the table per step.** :func:`big_block_table` takes the first entry of each run and
   divides by 16: one strided slice and one division on the device, no host sync, shapes from
   host ints (CUDA-graph safe). :func:`bridge_meta` wraps it into a 256-token ``BatchMeta``.

The conversion is correct only when every request's *used* 16-token blocks come in aligned runs;
:func:`check_aligned_runs` (called by :func:`bridge_meta` when validation is on) raises
:class:`BridgeError` naming the request and the entries otherwise, never computing from the wrong
blocks silently.

**Cost.** Memory granularity becomes 256 tokens: a request holds whole big blocks, so up to 255
token slots per request stay reserved but unused (about 128 on average, versus up to 15 with
16-token allocation). For Qwen3-8B (36 layers, 8 KV heads x 128, bf16: 144 KiB per token) that is
about 18 MiB per request on average. Prefix sharing works at 256-token granularity only. There is
no copy and no extra kernel on the per-layer path: the table conversion is once per step,
O(num_reqs x max_blocks / 16) int32 elements.

>>> import torch
>>> from paged_core import BatchMeta, allocate_kv_cache
>>> alloc = BridgedAllocator(64, shuffle=False)          # 64 blocks of 16 = 4 big blocks
>>> meta16 = BatchMeta.build([3, 1], [20, 300], block_size=16, allocator=alloc)
>>> meta256 = bridge_meta(meta16, validate=True)
>>> meta256.block_size, meta256.block_table.tolist()
(256, [[1, 0], [2, 3]])
>>> cache16 = allocate_kv_cache(64, 16, 2, 64, dtype=torch.float16)
>>> bridge_cache(cache16).k.shape
torch.Size([4, 256, 2, 64])
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from typing import overload

import torch
from paged_core import BatchMeta, BatchMetaError, BlockAllocator, InputError, KVCache, validation_enabled

__all__ = [
    "RATIO",
    "BridgeError",
    "BridgedAllocator",
    "big_block_table",
    "bridge_cache",
    "bridge_meta",
    "check_aligned_runs",
    "small_block_view",
]

#: Small blocks per big block: 16 blocks of 16 tokens = flash-attn 2's minimum page of 256.
RATIO = 16


class BridgeError(BatchMetaError):
    """A block table or cache cannot be bridged (blocks not in aligned runs, pool not divisible)."""


def _check_ratio(ratio: int) -> None:
    if not isinstance(ratio, int) or ratio < 1:
        raise InputError(f"ratio is {ratio!r}; accepted: a positive int (small blocks per big block)")


# --------------------------------------------------------------------------------- allocation
class BridgedAllocator:
    """A block allocator of small blocks that hands them out only in aligned runs of ``ratio``.

    ``num_blocks`` counts *small* blocks (the engine's 16-token blocks) and must be a multiple of
    ``ratio``. Underneath, a :class:`paged_core.BlockAllocator` manages ``num_blocks // ratio``
    big blocks (shuffled by default; big block 0, i.e. small blocks ``0 .. ratio - 1``, reserved
    like vLLM's null block). It duck-types ``BlockAllocator``, so
    ``BatchMeta.build(..., allocator=BridgedAllocator(...))`` works.

    ``allocate(n)`` rounds up to whole big blocks: it returns ``ratio * ceil(n / ratio)`` ids, the
    extra ones being the request's reserve for its next tokens (the bridge's memory cost).

    >>> a = BridgedAllocator(64, shuffle=False)
    >>> a.allocate(3)[:4], len(a.allocate(17)), a.num_free
    ([16, 17, 18, 19], 32, 0)
    """

    def __init__(
        self,
        num_blocks: int,
        *,
        ratio: int = RATIO,
        shuffle: bool = True,
        seed: int = 0,
        reserve_zero: bool = True,
    ) -> None:
        _check_ratio(ratio)
        if num_blocks < ratio or num_blocks % ratio:
            raise BridgeError(
                f"num_blocks is {num_blocks}; accepted: a positive multiple of ratio={ratio}, so "
                f"that the pool is whole big blocks of {ratio} small blocks (allocate "
                f"{max(ratio, math.ceil(num_blocks / ratio) * ratio)} blocks)"
            )
        self.ratio = ratio
        self.num_blocks = num_blocks
        self._big = BlockAllocator(num_blocks // ratio, shuffle=shuffle, seed=seed, reserve_zero=reserve_zero)

    @property
    def num_free(self) -> int:
        """Free small blocks (always whole runs)."""
        return self._big.num_free * self.ratio

    def allocate(self, n: int) -> list[int]:
        """Small block ids for ``n`` small blocks, rounded up to whole aligned runs."""
        bigs = self._big.allocate(math.ceil(n / self.ratio))
        return [b * self.ratio + j for b in bigs for j in range(self.ratio)]

    def free(self, blocks: Sequence[int]) -> None:
        """Return small blocks; they must be whole aligned runs, as :meth:`allocate` gave them."""
        blocks = list(blocks)
        r = self.ratio
        if len(blocks) % r:
            raise BridgeError(f"free() got {len(blocks)} blocks; accepted: whole runs of {r}, as allocated")
        bigs = []
        for i in range(0, len(blocks), r):
            run = blocks[i : i + r]
            if run[0] % r or run != list(range(run[0], run[0] + r)):
                raise BridgeError(
                    f"free() got blocks {run} at position {i}; accepted: aligned runs of {r} "
                    f"consecutive ids starting at a multiple of {r}, as allocate() returned them"
                )
            bigs.append(run[0] // r)
        self._big.free(bigs)


# --------------------------------------------------------------------------------- block table
def big_block_table(block_table: torch.Tensor, ratio: int = RATIO) -> torch.Tensor:
    """The big-block table of a small-block table whose used entries come in aligned runs.

    ``block_table``: int32 ``[num_reqs, max_blocks]`` of small blocks. Returns int32
    ``[num_reqs, ceil(max_blocks / ratio)]``: entry ``J`` is ``block_table[:, J * ratio] // ratio``.
    Pure PyTorch on the table's device, shapes from host ints: no sync, CUDA-graph safe. It
    trusts the runs; :func:`check_aligned_runs` verifies them.

    >>> big_block_table(torch.tensor([[32, 33, 34, 35, 8, 9]], dtype=torch.int32), ratio=4).tolist()
    [[8, 2]]
    """
    _check_ratio(ratio)
    if block_table.dim() != 2:
        raise InputError(f"block_table has shape {list(block_table.shape)}; accepted: [num_reqs, max_blocks]")
    # Column J * ratio is the first small block of big block J; padding columns past a request's
    # blocks hold whatever the engine left there, and so does the result: flash-attn reads only
    # the ceil(seq_len / 256) columns it needs.
    first = block_table[:, ::ratio]
    return torch.div(first, ratio, rounding_mode="floor").to(torch.int32).contiguous()


def check_aligned_runs(
    block_table: torch.Tensor, seq_lens: torch.Tensor, *, block_size: int, ratio: int = RATIO
) -> None:
    """Raise :class:`BridgeError` unless each request's used blocks form aligned runs of ``ratio``.

    Request ``r`` uses small blocks ``0 .. ceil(seq_lens[r] / block_size) - 1`` of its row; for the
    bridge, entry ``j`` must equal ``ratio * B + j % ratio`` where ``B`` is the big block of run
    ``j // ratio``. Copies a boolean summary to the host (a sync): call it while debugging, from
    tests, or through :func:`bridge_meta` with validation on.
    """
    _check_ratio(ratio)
    R, width = block_table.shape
    if R == 0:
        return
    dev = block_table.device
    nblk = (seq_lens.to(torch.int64) + block_size - 1) // block_size  # [R]
    too_narrow = nblk > width
    if bool(too_narrow.any()):
        r = int(too_narrow.nonzero()[0, 0])
        raise BridgeError(
            f"request {r}: seq_len {int(seq_lens[r])} needs {int(nblk[r])} blocks of {block_size} but "
            f"block_table has {width} columns"
        )
    j = torch.arange(width, device=dev)
    table = block_table.to(torch.int64)
    first = table[:, (j // ratio) * ratio]  # [R, width]: first block of each entry's run
    expected = first + (j % ratio)[None, :]
    used = j[None, :] < nblk[:, None]
    bad = used & ((table != expected) | (first % ratio != 0))
    if bool(bad.any()):
        r, col = (int(x) for x in bad.nonzero()[0])
        start = (col // ratio) * ratio
        stop = min(start + ratio, int(nblk[r]))
        run = table[r, start:stop].tolist()
        raise BridgeError(
            f"request {r}: block_table[{r}, {start}:{stop}] is {run}, not an aligned run (the run "
            f"of big block {col // ratio} must be {ratio} consecutive block ids starting at a "
            f"multiple of {ratio}; entry {col} is {int(table[r, col])}); allocate the cache blocks "
            "with paged_flash_attn2.BridgedAllocator, or use a backend that takes 16-token blocks"
        )


def bridge_meta(meta: BatchMeta, ratio: int = RATIO, *, validate: bool | None = None) -> BatchMeta:
    """The same batch described with big blocks of ``meta.block_size * ratio`` tokens.

    Everything but ``block_table`` and ``block_size`` is shared unchanged, ``slot_mapping``
    included (a flat slot is the same element in both views of the pool). No sync unless
    validation is on (``validate=True`` or ``PAGED_VALIDATE=1``), which runs
    :func:`check_aligned_runs`.
    """
    if validation_enabled(validate):
        check_aligned_runs(meta.block_table, meta.seq_lens, block_size=meta.block_size, ratio=ratio)
    return dataclasses.replace(
        meta, block_table=big_block_table(meta.block_table, ratio), block_size=meta.block_size * ratio
    )


# --------------------------------------------------------------------------------- cache views
@overload
def _regroup(t: torch.Tensor, num_blocks: int, block_size: int) -> torch.Tensor: ...
@overload
def _regroup(t: None, num_blocks: int, block_size: int) -> None: ...
@overload
def _regroup(t: torch.Tensor | None, num_blocks: int, block_size: int) -> torch.Tensor | None: ...
def _regroup(t: torch.Tensor | None, num_blocks: int, block_size: int) -> torch.Tensor | None:
    if t is None:
        return None
    try:
        return t.view(num_blocks, block_size, *t.shape[2:])
    except RuntimeError as exc:  # a non-contiguous pool cannot be re-viewed without a copy
        raise BridgeError(
            f"cannot view a pool of shape {list(t.shape)} and strides {list(t.stride())} as "
            f"[{num_blocks}, {block_size}, ...] without copying ({exc}); accepted: a contiguous pool "
            "(as paged_core.allocate_kv_cache makes)"
        ) from exc


def bridge_cache(cache: KVCache, ratio: int = RATIO) -> KVCache:
    """View a small-block cache ``[num_blocks, bs, H, D]`` as ``[num_blocks // ratio, bs * ratio, H, D]``.

    Same storage (no copy): a write through either view is visible through the other. The
    hidden spill block of :func:`paged_core.allocate_kv_cache` is shared too, since padding
    writes address it by flat slot index, which both views share.
    """
    _check_ratio(ratio)
    if cache.num_blocks % ratio:
        raise BridgeError(
            f"the cache has {cache.num_blocks} blocks, not a multiple of ratio={ratio}; allocate a "
            f"multiple of {ratio} blocks so that the pool is whole big blocks"
        )
    nb, bs = cache.num_blocks // ratio, cache.block_size * ratio
    return _regrouped(cache, nb, bs)


def _regrouped(cache: KVCache, num_blocks: int, block_size: int) -> KVCache:
    """The same memory as ``num_blocks`` blocks of ``block_size`` tokens (scales too)."""
    return dataclasses.replace(
        cache,
        k=_regroup(cache.k, num_blocks, block_size),
        v=_regroup(cache.v, num_blocks, block_size),
        k_scale=_regroup(cache.k_scale, num_blocks, block_size),
        v_scale=_regroup(cache.v_scale, num_blocks, block_size),
    )


def small_block_view(cache: KVCache, ratio: int = RATIO) -> KVCache:
    """The inverse of :func:`bridge_cache`: view big blocks as ``ratio`` times more small ones."""
    _check_ratio(ratio)
    if cache.block_size % ratio:
        raise BridgeError(f"block_size {cache.block_size} is not divisible by ratio={ratio}")
    nb, bs = cache.num_blocks * ratio, cache.block_size // ratio
    return _regrouped(cache, nb, bs)
