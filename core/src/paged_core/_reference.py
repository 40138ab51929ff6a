"""The PyTorch reference backend: correct by construction, slow, and the oracle for all others.

It gathers each request's keys through the block table, repeats KV heads for GQA, applies the
causal (and window) mask of the rule of positions, and takes a plain softmax, all in float32 or
float64. Block ids outside the pool are treated as masked keys, the behaviour the kernels
promise for bad metadata, so every backend agrees even on garbage.
"""

from __future__ import annotations

import math
from typing import Any, Literal, overload

import torch

from ._backend import Backend
from ._batch import BatchMeta
from ._cache import KVCache
from ._checks import check_inputs
from ._errors import InputError
from ._quant import unpack_int4
from ._spec import KV_DTYPES, KV_SCALES, PER_CHANNEL_KEYS, Capabilities, check_dtype

__all__ = ["ReferenceBackend", "reference_attention"]


@overload
def reference_attention(
    q: torch.Tensor,
    cache: KVCache,
    meta: BatchMeta,
    *,
    scale: float | None = ...,
    window: int = ...,
    softcap: float = ...,
    sinks: torch.Tensor | None = ...,
    compute_dtype: torch.dtype = ...,
    return_lse: Literal[False] = ...,
) -> torch.Tensor: ...
@overload
def reference_attention(
    q: torch.Tensor,
    cache: KVCache,
    meta: BatchMeta,
    *,
    scale: float | None = ...,
    window: int = ...,
    softcap: float = ...,
    sinks: torch.Tensor | None = ...,
    compute_dtype: torch.dtype = ...,
    return_lse: Literal[True],
) -> tuple[torch.Tensor, torch.Tensor]: ...
@overload
def reference_attention(
    q: torch.Tensor,
    cache: KVCache,
    meta: BatchMeta,
    *,
    scale: float | None = ...,
    window: int = ...,
    softcap: float = ...,
    sinks: torch.Tensor | None = ...,
    compute_dtype: torch.dtype = ...,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
def reference_attention(
    q: torch.Tensor,
    cache: KVCache,
    meta: BatchMeta,
    *,
    scale: float | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    compute_dtype: torch.dtype = torch.float32,
    return_lse: bool = False,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention computed request by request in ``compute_dtype``.

    Returns ``out [num_tokens, num_heads, cache.head_dim_v]`` in ``compute_dtype`` (cast it
    yourself; the backend casts to ``q.dtype``), plus ``lse [num_tokens, num_heads]``
    (natural log, ``compute_dtype``) with ``return_lse``.

    Metadata that validation would refuse is masked the way the Triton kernels mask it, from
    the device tensors (never the host mirrors, which the kernels do not read): a request whose
    ``query_start_loc`` decreases has no rows; rows outside ``0 .. num_tokens - 1`` are not
    written; a request with ``seq_len <= 0`` sees no key (zeros, ``lse`` -inf); block ids outside
    the pool and keys past the table are absent.
    """
    # The checks of Backend.forward; the oracle reads no host int (max_*), so holds none to account.
    check_inputs(q, cache, meta, window, softcap, scale, sinks, mirrors=False)
    _check_compute_dtype(compute_dtype)
    if not isinstance(return_lse, bool):
        raise InputError(f"return_lse is {return_lse!r}; accepted: True or False")
    out, lse = _attention(
        q, cache, meta, scale=scale, window=window, softcap=softcap, sinks=sinks, compute_dtype=compute_dtype
    )
    return (out, lse) if return_lse else out


def _check_compute_dtype(compute_dtype: Any) -> None:
    """The oracle computes in float32 or float64 (``reference_attention``, ``ReferenceBackend``)."""
    check_dtype(
        "compute_dtype",
        compute_dtype,
        (torch.float32, torch.float64),
        "the oracle computes in floating point; q and out keep their own dtype",
    )


def _attention(
    q: torch.Tensor,
    cache: KVCache,
    meta: BatchMeta,
    *,
    scale: float | None,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    compute_dtype: torch.dtype,
) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`reference_attention` on checked inputs: ``(out, lse)``."""
    n, hq, d = q.shape
    dv = cache.head_dim_v
    hkv, bs = cache.num_kv_heads, cache.block_size
    group = hq // hkv
    scale = d**-0.5 if scale is None else scale
    if cache.quantized:
        # Dequantize in compute_dtype: code * scale needs ~31 bits, so a float32 product would
        # round the values a float64 oracle is meant to use exactly.
        k_scale, v_scale = cache._scales()
        kc, vc = (unpack_int4(t) if t.dtype == torch.uint8 else t for t in (cache.k, cache.v))
        if cache.kv_dtype in PER_CHANNEL_KEYS:  # one scale per (block, KV head, channel)
            kf = kc.to(compute_dtype) * k_scale.to(compute_dtype)[:, None]
        else:
            kf = kc.to(compute_dtype) * k_scale.to(compute_dtype)[..., None]
        vf = vc.to(compute_dtype) * v_scale.to(compute_dtype)[..., None]
    else:
        kf, vf = cache.k.to(compute_dtype), cache.v.to(compute_dtype)
    out = torch.zeros(n, hq, dv, dtype=compute_dtype, device=q.device)
    lse = torch.full((n, hq), -math.inf, dtype=compute_dtype, device=q.device)
    qsl = meta.query_start_loc.tolist()
    slens = meta.seq_lens.tolist()
    width = meta.block_table.shape[1]
    for r in range(meta.num_reqs):
        t, s = qsl[r + 1] - qsl[r], slens[r]
        if t <= 0 or s <= 0:
            continue  # padding request (or a negative length): zeros, lse -inf
        nblk = min(math.ceil(s / bs), width)
        blocks = meta.block_table[r, :nblk].long()
        bad = (blocks < 0) | (blocks >= cache.num_blocks)
        blocks = blocks.clamp(0, cache.num_blocks - 1)
        keys = kf[blocks].reshape(nblk * bs, hkv, d)[:s]
        vals = vf[blocks].reshape(nblk * bs, hkv, dv)[:s]
        key_ok = (~bad).repeat_interleave(bs)[:s]  # [s]; keys past the table are absent too
        keys = keys.repeat_interleave(group, dim=1)  # [s, hq, d]
        vals = vals.repeat_interleave(group, dim=1)
        # Rows outside q are not computed; the positions still follow the request's own length.
        lo, hi = max(qsl[r], 0), min(qsl[r] + t, n)
        if lo >= hi:
            continue
        qr = q[lo:hi].to(compute_dtype)  # [t', hq, d]
        logits = torch.einsum("thd,khd->htk", qr, keys) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        kpos = torch.arange(keys.shape[0], device=q.device)
        qpos = s - t + torch.arange(lo - qsl[r], hi - qsl[r], device=q.device)
        visible = (kpos[None, :] <= qpos[:, None]) & key_ok[None, :]
        if window:
            visible &= kpos[None, :] > qpos[:, None] - window
        logits = logits.masked_fill(~visible[None], -math.inf)  # [hq, t, k]
        if sinks is not None:
            sink = sinks.to(compute_dtype)[:, None, None].expand(hq, hi - lo, 1)
            total = torch.logsumexp(torch.cat([logits, sink], dim=-1), dim=-1)  # [hq, t]
            # A row that sees no key is empty whatever its sink (zeros, lse -inf), as in the kernels.
            total = total.masked_fill(~visible.any(dim=-1)[None], -math.inf)
        else:
            total = torch.logsumexp(logits, dim=-1)
        # exp(-inf - -inf) is NaN: a row with nothing visible keeps zeros. Only those rows: a NaN
        # from the inputs must reach the output, never turn into plausible zeros.
        probs = torch.exp(logits - total[..., None])
        probs = probs.masked_fill(torch.isneginf(total)[..., None], 0.0)
        out[lo:hi] = torch.einsum("htk,khd->thd", probs, vals)
        lse[lo:hi] = total.transpose(0, 1)
    return out, lse


def _rows_written(meta: BatchMeta, n: int) -> torch.Tensor | None:
    """bool [n]: the rows the kernels write (those of some request, clipped to q); None: all."""
    qsl = meta.query_start_loc.tolist()
    written = torch.zeros(n, dtype=torch.bool)
    for r in range(meta.num_reqs):
        lo, hi = max(qsl[r], 0), min(qsl[r + 1], n)
        if lo < hi:
            written[lo:hi] = True
    return None if bool(written.all()) else written.to(meta.device)


class ReferenceBackend(Backend):
    """The oracle: every feature, any shape, any device; computes in float32 or float64.

    Options: ``compute_dtype`` (``torch.float32`` or ``torch.float64``, default float32).
    Host loops make it slow and not CUDA-graph safe; it syncs on every call.
    """

    name = "reference"
    capabilities = Capabilities(
        kv_dtypes=frozenset(KV_DTYPES),
        kv_scales=frozenset(KV_SCALES),
        sliding_window=True,
        softcap=True,
        sinks=True,
        returns_lse=True,
        head_dim_pairs=None,
        # plan() is the batch itself.
        device_plan=True,
        batch_invariant=True,
    )

    def __init__(self, *, compute_dtype: torch.dtype = torch.float32, validate: bool | None = None) -> None:
        super().__init__(validate=validate)
        _check_compute_dtype(compute_dtype)
        self.compute_dtype = compute_dtype

    def _forward(
        self,
        q: torch.Tensor,
        cache: KVCache,
        plan: Any,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> None:
        # forward checked the inputs (against this backend's claims too): not again per layer.
        res, res_lse = _attention(
            q, cache, plan, scale=scale, window=window, softcap=softcap, sinks=sinks, compute_dtype=self.compute_dtype
        )
        written = _rows_written(plan, q.shape[0])
        if written is None:
            out.copy_(res)
            if lse is not None:
                lse.copy_(res_lse)
            return
        # Bad metadata (validation off) leaves rows outside every request: like the kernels,
        # the oracle leaves them as they are.
        out[written] = res[written].to(out.dtype)
        if lse is not None:
            lse[written] = res_lse[written].to(lse.dtype)
