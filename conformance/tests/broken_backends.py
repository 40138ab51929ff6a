"""Deliberately broken backends: the reference with one classic kernel bug each.

Each wraps ``paged_core.reference_attention`` (or the reference writer) and changes exactly one
thing, so that the suite's tests can assert which checks catch it, on which cases, and that
everything else still passes. They claim everything the reference claims: a claim is a promise.
"""

from __future__ import annotations

import dataclasses
import math

import torch
from paged_core import Backend, BatchMeta, KVCache, ReferenceBackend, reference_attention, write_kv
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
        def roll(t):
            return None if t is None else t.roll(-1, dims=2)

        rolled = dataclasses.replace(cache, k=roll(cache.k), v=roll(cache.v),
                                     k_scale=roll(cache.k_scale), v_scale=roll(cache.v_scale), _spill=None)
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
            cache = dataclasses.replace(cache, k_scale=torch.ones_like(cache.k_scale),
                                        v_scale=torch.ones_like(cache.v_scale), _spill=None)
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


class NotBatchInvariant(Wrapping):
    """Promises bitwise batch invariance but rounds differently when the batch has >1 request."""

    name = "not-batch-invariant"

    def attend(self, q, cache, meta, **kw):
        out, lse = super().attend(q, cache, meta, **kw)
        if meta.num_reqs > 1:
            out = out * (1 + 2**-9)  # a few float16 ulps: within tolerance, not bitwise equal
        return out, lse


#: Every broken backend.
BROKEN: tuple[type[Backend], ...] = (
    CausalOffByOne, WindowIgnored, ScaleIgnored, WrongKVHead, PaddingLeftNaN, QuantSkipsScale, Base2Lse,
    RowsUnwritten, PaddingSlotsWritten, NotBatchInvariant,
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
