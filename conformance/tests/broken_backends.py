"""Deliberately broken backends: the reference with one classic kernel bug each.

Each wraps ``paged_core.reference_attention`` (or the reference writer) and changes exactly one
thing, so that the suite's tests can assert which checks catch it, on which cases, and that
everything else still passes. They claim everything the reference claims: a claim is a promise.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from paged_core import (
    PER_CHANNEL_KEYS,
    Backend,
    BatchMeta,
    KVCache,
    ReferenceBackend,
    quantize_kv,
    reference_attention,
    write_kv,
)
from paged_core.hookspecs import hookimpl


class Wrapping(Backend):
    """The reference, computed through :meth:`attend`, which subclasses break."""

    name = "wrapping"
    capabilities = ReferenceBackend.capabilities

    def attend(self, q, cache: KVCache, meta: BatchMeta, **kw):
        return reference_attention(q, cache, meta, return_lse=True, **kw)

    def _forward(self, q, cache, plan, *, out, lse, scale, window, softcap, sinks) -> None:
        res, res_lse = self.attend(q, cache, plan, scale=scale, window=window, softcap=softcap, sinks=sinks)
        out.copy_(res)
        if lse is not None:
            lse.copy_(res_lse)


class CausalOffByOne(Wrapping):
    """Each query also sees the key right after it (``<=`` where ``<`` was meant, or vice versa)."""

    name = "causal-off-by-one"

    def attend(self, q, cache, meta, **kw):
        # One position later for every query of a real request: it sees one key too many.
        longer = meta.seq_lens + (meta.seq_lens > 0).to(meta.seq_lens.dtype)
        shifted = dataclasses.replace(meta, seq_lens=longer, seq_lens_cpu=longer.cpu())
        return super().attend(q, cache, shifted, **kw)


class WindowIgnored(Wrapping):
    """Sliding window accepted but not applied."""

    name = "window-ignored"

    def attend(self, q, cache, meta, **kw):
        return super().attend(q, cache, meta, **{**kw, "window": 0})


class WrongKVHead(Wrapping):
    """Query head h reads KV head ``(h // group + 1) % num_kv_heads`` instead of ``h // group``."""

    name = "wrong-kv-head"

    def attend(self, q, cache, meta, **kw):
        def roll(t, dim=2):
            return None if t is None else t.roll(-1, dims=dim)

        rolled = dataclasses.replace(
            cache,
            k=roll(cache.k),
            v=roll(cache.v),
            # kivi4's key scales are [num_blocks, num_kv_heads, head_dim]: heads on dim 1.
            k_scale=roll(cache.k_scale, 1 if cache.kv_dtype in PER_CHANNEL_KEYS else 2),
            v_scale=roll(cache.v_scale),
            _spill=None,
        )
        return super().attend(q, rolled, meta, **kw)


class ScaleIgnored(Wrapping):
    """Always uses ``head_dim ** -0.5``, whatever ``scale`` the caller passed."""

    name = "scale-ignored"

    def attend(self, q, cache, meta, **kw):
        return super().attend(q, cache, meta, **{**kw, "scale": None})


class PaddingLeftNaN(Wrapping):
    """Padding requests' rows are skipped, so they keep whatever was in ``out`` (NaN here)."""

    name = "padding-nan"

    def attend(self, q, cache, meta, **kw):
        out, lse = super().attend(q, cache, meta, **kw)
        qsl = meta.query_start_loc.tolist()
        for r, s in enumerate(meta.seq_lens.tolist()):
            if s == 0:
                out[qsl[r] : qsl[r + 1]] = math.nan
        return out, lse


class QuantSkipsScale(Wrapping):
    """A quantized cache read as raw codes: the per-(slot, head) scales are never applied."""

    name = "quant-skips-scale"

    def attend(self, q, cache, meta, **kw):
        if cache.quantized:
            cache = dataclasses.replace(
                cache, k_scale=torch.ones_like(cache.k_scale), v_scale=torch.ones_like(cache.v_scale), _spill=None
            )
        return super().attend(q, cache, meta, **kw)


class Base2Lse(Wrapping):
    """Returns the log-sum-exp in base 2 (FlashInfer's convention) without converting."""

    name = "base2-lse"

    def attend(self, q, cache, meta, **kw):
        out, lse = super().attend(q, cache, meta, **kw)
        return out, lse * math.log2(math.e)


class RowsUnwritten(Wrapping):
    """The last query row of every request is never stored (a tile-boundary mask bug)."""

    name = "rows-unwritten"

    def _forward(self, q, cache, plan, *, out, lse, scale, window, softcap, sinks) -> None:
        res, _ = self.attend(q, cache, plan, scale=scale, window=window, softcap=softcap, sinks=sinks)
        keep = torch.ones(q.shape[0], dtype=torch.bool)
        keep[(plan.query_start_loc[1:].cpu() - 1).clamp(min=0).long()] = False
        out[keep] = res[keep].to(out.dtype)


class PaddingSlotsWritten(Wrapping):
    """``write`` clamps slot -1 to 0, so padding rows overwrite slot 0 (block 0)."""

    name = "padding-slots-written"

    def write(self, cache, k, v, meta):
        write_kv(cache, k, v, meta.slot_mapping.clamp(min=0))


class StaticScalesIgnored(Wrapping):
    """``write`` quantizes each vector with its own max|x| / q_max, also into a cache whose static
    scales are fixed (so its codes mean other values than the cache's scales say)."""

    name = "static-scales-ignored"

    def write(self, cache, k, v, meta):
        if not cache.static_scales:
            return write_kv(cache, k, v, meta.slot_mapping)
        slots = meta.slot_mapping.long()
        keep = (slots >= 0).nonzero().squeeze(1)
        blk, off = slots[keep] // cache.block_size, slots[keep] % cache.block_size
        for dst, src in ((cache.k, k), (cache.v, v)):
            codes, _ = quantize_kv(src[keep], cache.kv_dtype)
            dst.view(torch.uint8)[blk, off] = codes.view(torch.uint8)


class LayerScalesReused(Wrapping):
    """Replays one plan's first layer with the later layers' tensors swapped in, but not their
    scales: every layer after the first reads the first layer's k_scale/v_scale."""

    name = "layer-scales-reused"

    def attend(self, q, cache, meta, **kw):
        first = self.__dict__.setdefault("_first_scales", {}).setdefault(id(meta), (cache.k_scale, cache.v_scale))
        if cache.quantized:
            cache = dataclasses.replace(cache, k_scale=first[0], v_scale=first[1])
        return super().attend(q, cache, meta, **kw)


class NotBatchInvariant(Wrapping):
    """Promises bitwise batch invariance but rounds differently when the batch has >1 request."""

    name = "not-batch-invariant"

    def attend(self, q, cache, meta, **kw):
        out, lse = super().attend(q, cache, meta, **kw)
        if meta.num_reqs > 1:
            out = out * (1 + 2**-9)  # a few float16 ulps: within tolerance, not bitwise equal
        return out, lse


class ReadsPastLastBlock(Wrapping):
    """Walks one block past each request's last block and attends to it, unless the table holds 0
    there: the kernel trusts a zero-padded table to end each request's blocks (engines reuse
    tables, whose stale columns hold valid ids)."""

    name = "reads-past-last-block"

    def attend(self, q, cache, meta, **kw):
        bs = cache.block_size
        table = meta.block_table.cpu().tolist()
        seq_lens = meta.seq_lens.cpu().tolist()
        tables, longer = [], []
        for row, s in zip(table, seq_lens, strict=True):
            n = math.ceil(s / bs)
            if s and n < len(row) and row[n] != 0:
                # The extra block's keys come first (positions 0 .. bs-1), seen by every query.
                tables.append([row[n], *row[:n]])
                longer.append(s + bs)
            else:
                tables.append(row[:n])
                longer.append(s)
        qsl = meta.query_start_loc.cpu()
        wider = BatchMeta.from_lists((qsl[1:] - qsl[:-1]).tolist(), longer, tables, block_size=bs, device=q.device)
        return super().attend(q, cache, wider, **kw)


class GridCappedAt32Requests(Wrapping):
    """A grid of at most 32 programs along the request axis: requests 32 and up come out as zeros."""

    name = "grid-capped-at-32-requests"

    def attend(self, q, cache, meta, **kw):
        out, lse = super().attend(q, cache, meta, **kw)
        qsl = meta.query_start_loc.tolist()
        if meta.num_reqs > 32:
            out[qsl[32] :] = 0
        return out, lse


class WritesIntoACopy(Wrapping):
    """``write`` on a strided cache view (an engine's interleaved or HND pool) writes into a
    contiguous copy, which is then dropped: the pool never sees the step's K/V."""

    name = "writes-into-a-copy"

    def write(self, cache, k, v, meta):
        if not (cache.k.is_contiguous() and cache.v.is_contiguous()):
            cache = dataclasses.replace(
                cache,
                k=cache.k.contiguous(),
                v=cache.v.contiguous(),
                k_scale=None if cache.k_scale is None else cache.k_scale.contiguous(),
                v_scale=None if cache.v_scale is None else cache.v_scale.contiguous(),
                _spill=None,
            )
        write_kv(cache, k, v, meta.slot_mapping)


class SinksReadContiguous(Wrapping):
    """Reads ``sinks`` as if it were contiguous (a kernel given its pointer without its stride):
    a strided view's elements come from the wrong places of its buffer."""

    name = "sinks-read-contiguous"

    def forward(self, q, cache, meta, *, sinks=None, **kw):
        if sinks is not None:
            sinks = sinks.as_strided(tuple(sinks.shape), (1,), sinks.storage_offset())
        return super().forward(q, cache, meta, sinks=sinks, **kw)


class SeqLensReadContiguous(Wrapping):
    """Reads ``seq_lens`` as if it were contiguous (a kernel given its pointer without its stride,
    and a contract that passed the view through): a strided view's lengths come from the wrong
    places of its buffer."""

    name = "seq-lens-read-contiguous"

    def plan(self, meta, **layer):
        # The caller's batch, before the contract lays it out, for the forwards of this plan.
        self._given = meta
        self._planned = super().plan(meta, **layer)
        return self._planned

    def forward(self, q, cache, meta, **kw):
        if meta is not getattr(self, "_planned", None):
            self._given = meta
        return super().forward(q, cache, meta, **kw)

    def attend(self, q, cache, meta, **kw):
        sl = self._given.seq_lens
        misread = sl.as_strided(tuple(sl.shape), (1,), sl.storage_offset())
        return super().attend(
            q, cache, dataclasses.replace(meta, seq_lens=misread.clone(), seq_lens_cpu=misread.cpu().clone()), **kw
        )


class PrefixDeclarationTrusted(Wrapping):
    """Takes ``plan(meta, shared_prefix_blocks=k)`` (a cascade's shared prefix) on trust: every
    request reads its first ``k`` blocks through the first request's row, checked or not."""

    name = "prefix-declaration-trusted"

    @dataclasses.dataclass
    class Plan:
        meta: BatchMeta
        prefix: int

    def _plan(self, meta, *, shared_prefix_blocks=None, **layer):
        return self.Plan(meta, int(shared_prefix_blocks or 0))

    def _forward(self, q, cache, plan, *, out, lse, scale, window, softcap, sinks) -> None:
        meta = plan.meta if isinstance(plan, self.Plan) else plan
        if isinstance(plan, self.Plan) and plan.prefix:
            table = meta.block_table.clone()
            table[:, : plan.prefix] = table[0, : plan.prefix]
            meta = dataclasses.replace(meta, block_table=table)
        super()._forward(q, cache, meta, out=out, lse=lse, scale=scale, window=window, softcap=softcap, sinks=sinks)


class PaddingRowsUnwritten(Wrapping):
    """Skips padding requests entirely: their rows of ``out`` keep whatever was there."""

    name = "padding-rows-unwritten"

    def _forward(self, q, cache, plan, *, out, lse, scale, window, softcap, sinks) -> None:
        res, res_lse = self.attend(q, cache, plan, scale=scale, window=window, softcap=softcap, sinks=sinks)
        qsl = plan.query_start_loc.cpu().tolist()
        for r, s in enumerate(plan.seq_lens.cpu().tolist()):
            if s:
                out[qsl[r] : qsl[r + 1]] = res[qsl[r] : qsl[r + 1]].to(out.dtype)
        if lse is not None:
            lse.copy_(res_lse)


#: Every broken backend.
BROKEN: tuple[type[Backend], ...] = (
    CausalOffByOne,
    WindowIgnored,
    ScaleIgnored,
    WrongKVHead,
    PaddingLeftNaN,
    QuantSkipsScale,
    Base2Lse,
    RowsUnwritten,
    PaddingSlotsWritten,
    NotBatchInvariant,
    ReadsPastLastBlock,
    GridCappedAt32Requests,
    WritesIntoACopy,
    SinksReadContiguous,
    PaddingRowsUnwritten,
    StaticScalesIgnored,
    LayerScalesReused,
    SeqLensReadContiguous,
    PrefixDeclarationTrusted,
)


class BackendsPlugin:
    """A paged_core plugin registering the given backend classes (default: the reference and
    every broken backend), for ``Registry.add_plugin``."""

    def __init__(self, *classes: type[Backend]):
        self.classes = classes or (ReferenceBackend, *BROKEN)

    @hookimpl
    def register_backends(self, register):
        for cls in self.classes:
            register(cls.name, cls, priority=-100 if cls is ReferenceBackend else 0)
