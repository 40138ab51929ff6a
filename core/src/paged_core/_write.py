"""The reference write of a :class:`~paged_core.KVCache`: new tokens' K/V at their slots.

Quantized caches quantize on write with the codec (``_quant``): per slot, with the cache's static
scales, or, for ``kivi4``, keys per (block, KV head, channel). A backend that writes with its own
kernel calls :func:`check_write_inputs` and writes exactly what :func:`write_kv` writes.
"""

from __future__ import annotations

from typing import cast

import torch

from ._cache import KVCache
from ._errors import InputError
from ._quant import Q_MAX, SCALE_FLOOR, is_float8, pack_int4, quantize_kv, unpack_int4
from ._spec import PER_CHANNEL_KEYS, dtype_name

__all__ = [
    "write_kv",
    "check_write_inputs",
]


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # PyTorch's CPU index_put_ has no float8 kernel: move fp8 bytes as uint8. A view of the
    # same element size needs only a contiguous last dimension, which check() guarantees.
    return t.view(torch.uint8) if is_float8(t.dtype) else t


def check_write_inputs(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> int:
    """The checks of :func:`write_kv`, before it writes anything; returns ``num_tokens``.

    ``cache`` a :class:`KVCache` whose :meth:`~KVCache.check` passes; ``slot_mapping`` int64 or
    int32 ``[num_tokens]``; ``k`` ``[num_tokens, num_kv_heads, head_dim]`` and ``v`` the same
    with the cache's ``head_dim_v``, of the cache's model dtype, on its device (any strides).
    Host-only (slot values are not read); raises :class:`InputError` saying what is wrong. A
    backend that writes with its own kernel calls this, so every write path refuses the same
    inputs with the same messages.

    >>> from paged_core import allocate_kv_cache
    >>> cache = allocate_kv_cache(2, 4, 1, 2, dtype=torch.float32)
    >>> check_write_inputs(cache, torch.ones(3, 1, 2), torch.ones(3, 1, 2), torch.tensor([0, 1, -1]))
    3
    """
    if not isinstance(cache, KVCache):
        raise InputError(f"cache is a {type(cache).__name__}; accepted: a paged_core.KVCache")
    cache.check()
    if (
        not isinstance(slot_mapping, torch.Tensor)
        or slot_mapping.dim() != 1
        or slot_mapping.dtype not in (torch.int64, torch.int32)
    ):
        found = (
            f"{dtype_name(slot_mapping.dtype)} {list(slot_mapping.shape)}"
            if isinstance(slot_mapping, torch.Tensor)
            else type(slot_mapping).__name__
        )
        raise InputError(f"slot_mapping is {found}; accepted: int64 or int32 [num_tokens]")
    n = slot_mapping.shape[0]
    for name, t, dim in (("k", k, cache.head_dim), ("v", v, cache.head_dim_v)):
        dim_name = "head_dim" if name == "k" or cache.head_dim_v == cache.head_dim else "head_dim_v"
        if not isinstance(t, torch.Tensor):
            raise InputError(
                f"{name} is a {type(t).__name__}; accepted: a tensor [num_tokens={n}, "
                f"num_kv_heads={cache.num_kv_heads}, {dim_name}={dim}]"
            )
        if tuple(t.shape) != (n, cache.num_kv_heads, dim):
            raise InputError(
                f"{name} has shape {list(t.shape)}; accepted: [num_tokens={n}, "
                f"num_kv_heads={cache.num_kv_heads}, {dim_name}={dim}] (one row per slot_mapping entry)"
            )
        if t.dtype != cache.dtype:
            raise InputError(
                f"{name} is {dtype_name(t.dtype)} but the cache was allocated for "
                f"{dtype_name(cache.dtype)}; accepted: {dtype_name(cache.dtype)}"
            )
        if t.device != cache.device:
            raise InputError(f"{name} is on {t.device} but the cache is on {cache.device}; accepted: one device")
    if slot_mapping.device != cache.device:
        raise InputError(
            f"slot_mapping is on {slot_mapping.device} but the cache is on {cache.device}; accepted: one device"
        )
    return n


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' ``k [num_tokens, num_kv_heads, head_dim]`` and ``v [num_tokens,
    num_kv_heads, head_dim_v]`` at ``slot_mapping``.

    Slot -1 (a padding row) writes nothing. Quantized caches quantize on write (with static
    scales: with those, which stay as they are; otherwise each slot gets its own). The write never
    leaves the pool: slots outside ``[0, num_blocks * block_size)`` are treated like -1. Every
    input is checked before anything is written.

    Writes go through the cache tensors' strides (``cache.k[block, offset] = ...``), so a cache
    whose ``k``/``v`` are views of an engine's pool (``pool[:, 0]`` of a ``[num_blocks, 2,
    block_size, heads, dim]`` pool, or HND storage ``.transpose(1, 2)``) is written in place.

    >>> from paged_core import allocate_kv_cache
    >>> cache = allocate_kv_cache(2, 4, 1, 2, dtype=torch.float32)
    >>> write_kv(cache, torch.ones(1, 1, 2), torch.ones(1, 1, 2), torch.tensor([5]))
    >>> cache.k[1, 1].tolist(), int(cache.k.sum())
    ([[1.0, 1.0]], 2)
    """
    n = check_write_inputs(cache, k, v, slot_mapping)
    if n == 0:
        return
    bs = cache.block_size
    num_slots = cache.num_blocks * bs
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < num_slots)
    if cache.kv_dtype in PER_CHANNEL_KEYS:
        if cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise InputError(
                f"a {cache.kv_dtype} cache is being written inside a CUDA-graph capture; its writes find the "
                "blocks they rescale on the host (a sync a capture forbids). Accepted: write outside the "
                "graph, or a per-token format (int4, int8, fp8) inside it"
            )
        keep = valid.nonzero().squeeze(1)  # a sync: the written blocks are found on the host
        _write_per_channel_keys(cache, k[keep], v[keep], slots[keep])
        return
    if cache.static_scales:
        # Quantized with the cache's fixed scales (one per KV head), which stay as they are.
        k_scale, v_scale = cache._scales()
        kc, _ = quantize_kv(k, cache.kv_dtype, k_scale[0, 0])
        vc, _ = quantize_kv(v, cache.kv_dtype, v_scale[0, 0])
        pairs = [(0, kc), (1, vc)]
        views: tuple[torch.Tensor, ...] = (cache.k, cache.v)
    elif cache.quantized:
        kc, ks = quantize_kv(k, cache.kv_dtype)
        vc, vs = quantize_kv(v, cache.kv_dtype)
        pairs = [(0, kc), (1, vc), (2, ks), (3, vs)]
        views = (cache.k, cache.v, *cache._scales())
    else:
        pairs = [(0, k), (1, v)]
        views = (cache.k, cache.v)
    if cache._spill_ok:
        # Invalid slots go to the hidden block past the pool: no host sync, nothing touched.
        target = torch.where(valid, slots, torch.full_like(slots, num_slots))
        blk, off = target // bs, target % bs
        # ``_spill_ok`` holds only when ``_spill`` is set (``_spill_matches``).
        spill = cast(tuple[torch.Tensor, ...], cache._spill)
        for i, src in pairs:
            _as_bytes(spill[i]).index_put_((blk, off), _as_bytes(src))
    else:
        # A cache wrapped around an engine's own tensors has no spill block: filter (syncs).
        keep = valid.nonzero().squeeze(1)
        blk, off = slots[keep] // bs, slots[keep] % bs
        for i, src in pairs:
            _as_bytes(views[i]).index_put_((blk, off), _as_bytes(src)[keep])


def _write_per_channel_keys(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """``kivi4`` writes of valid ``slots``: values per (slot, KV head) as int4; keys per (block, KV
    head, channel) with scale ``max |k| / 7`` over the block's keys so far. A write that holds slot 0
    of a block starts the block afresh; any other write whose keys raise a channel's scale
    requantizes the block's earlier codes of that channel to the new scale (one more rounding of
    those keys, at most half the new step). Blocks are written whole, so a block's codes and its
    scales always agree."""
    if slots.numel() == 0:
        return
    q_max = Q_MAX[cache.kv_dtype]
    k_scale, v_scale = cache._scales()
    bs = cache.block_size
    blk, off = slots // bs, slots % bs
    kf = k.float()
    finite = torch.isfinite(kf)
    vc, vs = quantize_kv(v, "int4")  # values: int4's per-(slot, KV head) rule
    # A key with a non-finite element cannot scale its block's channels (a NaN or inf max would
    # rescale every other slot's keys): it is left out of the channel max, its non-finite
    # elements get code 0, and the slot's own V scale becomes NaN, so every row that reads the
    # slot is NaN and no other slot changes.
    vs = torch.where(finite.all(dim=-1), vs, float("nan"))
    cache.v.index_put_((blk, off), vc)
    v_scale.index_put_((blk, off), vs)
    kf = torch.where(finite, kf, 0.0)
    blocks, row = torch.unique(blk, return_inverse=True)  # [U], and each token's block among them
    u = blocks.shape[0]
    fresh = torch.zeros(u, dtype=torch.bool, device=slots.device).index_fill_(0, row[off == 0], True)
    new_max = torch.zeros(u, *k.shape[1:], dtype=torch.float32, device=k.device)
    k_abs = kf.abs()
    new_max.scatter_reduce_(0, row[:, None, None].expand_as(k_abs), k_abs, "amax")
    old = torch.where(fresh[:, None, None], 0.0, k_scale[blocks])  # [U, heads, channels]
    # Floored as quantize_kv's scales: a channel that is 0 so far keeps a tiny scale, not a
    # coarse one that a later, larger key could not raise.
    scale = torch.clamp_min(torch.maximum(old, new_max / q_max), SCALE_FLOOR)
    earlier = unpack_int4(cache.k[blocks]).float() * old[:, None]  # [U, block_size, heads, channels]
    codes = (earlier / scale[:, None]).round().clamp(-q_max, q_max)
    codes[row, off] = (kf / scale[row]).round().clamp(-q_max, q_max)
    cache.k[blocks] = pack_int4(codes.to(torch.int8))
    k_scale[blocks] = scale
