"""A CPU stand-in for ``flash_attn.flash_attn_varlen_func``, written from flash-attn's own words.

It implements the *documented* behaviour of flash-attn 2.8.3, independently of paged's reference:

- flash_attn/flash_attn_interface.py, ``flash_attn_varlen_func`` docstring: bottom-right causal
  alignment; window ``[i + sk - sq - left, i + sk - sq + right]``; GQA head ``h`` reads KV head
  ``h // (nheads / nheads_k)``; "If the row of the mask is all zero, the output will be zero";
  ``softmax_lse`` is ``(nheads, total_q_seqlen)``; ``return_attn_probs`` returns a triple.
- csrc/flash_attn/flash_api.cpp, ``mha_varlen_fwd``: the TORCH_CHECKs (dtypes, int32 offsets,
  ``page_block_size % 256``, ``head_size % 8`` and ``<= 256``, heads divisible); causal is dropped
  when ``max_seqlen_q == 1``; windows at least ``max_seqlen_k`` become -1; the "ngroups swapped"
  decode path reshapes q to ``[batch_size, ...]``, which raises unless every request has one row.
- csrc/flash_attn/src/flash_fwd_kernel.h / softmax.h: rows that see no key get ``lse = +inf``;
  the lse is a natural log; softcap maps ``s -> softcap * tanh(s * scale / softcap)``.

Every call is recorded in ``CALLS`` so tests can inspect what the adapter passed.
"""

from __future__ import annotations

import importlib.machinery
import math
import types

import torch

__version__ = "2.8.3"
CALLS: list[dict] = []


def _check(cond: bool, msg: str) -> None:
    if not cond:
        raise RuntimeError(msg)  # what a TORCH_CHECK raises


def flash_attn_varlen_func(
    q,
    k,
    v,
    cu_seqlens_q,
    cu_seqlens_k,
    max_seqlen_q,
    max_seqlen_k,
    dropout_p=0.0,
    softmax_scale=None,
    causal=False,
    window_size=(-1, -1),
    softcap=0.0,
    alibi_slopes=None,
    deterministic=False,
    return_attn_probs=False,
    block_table=None,
):
    CALLS.append(
        dict(
            q=q,
            k=k,
            v=v,
            cu_seqlens_q=cu_seqlens_q,
            cu_seqlens_k=cu_seqlens_k,
            max_seqlen_q=max_seqlen_q,
            max_seqlen_k=max_seqlen_k,
            dropout_p=dropout_p,
            softmax_scale=softmax_scale,
            causal=causal,
            window_size=window_size,
            softcap=softcap,
            return_attn_probs=return_attn_probs,
            block_table=block_table,
        )
    )
    _check(q.dtype in (torch.float16, torch.bfloat16), "FlashAttention only support fp16 and bf16 data type")
    _check(k.dtype == q.dtype and v.dtype == q.dtype, "query and key must have the same dtype")
    _check(cu_seqlens_q.dtype == torch.int32 and cu_seqlens_k.dtype == torch.int32, "cu_seqlens must be int32")
    _check(block_table is not None, "this stand-in implements the paged path only")
    _check(block_table.dtype == torch.int32, "block_table must have dtype torch.int32")
    _check(block_table.stride(-1) == 1, "block_table must have contiguous last dimension")
    _check(
        q.stride(-1) == 1 and k.stride(-1) == 1 and v.stride(-1) == 1,
        "Input tensor must have contiguous last dimension",
    )
    _check(cu_seqlens_q.is_contiguous() and cu_seqlens_k.is_contiguous(), "cu_seqlens must be contiguous")
    total_q, num_heads, head_size = q.shape
    num_blocks, page, num_heads_k, _ = k.shape
    batch = cu_seqlens_q.numel() - 1
    _check(page % 256 == 0, "Paged KV cache block size must be divisible by 256")
    _check(batch > 0, "batch size must be positive")
    _check(head_size <= 256, "FlashAttention forward only supports head dimension at most 256")
    _check(head_size % 8 == 0, "head_size must be a multiple of 8")
    _check(num_heads % num_heads_k == 0, "Number of heads in key/value must divide number of heads in query")
    _check(tuple(block_table.shape[:1]) == (batch,), "block_table must have shape (batch_size, max_blocks)")
    scale = head_size**-0.5 if softmax_scale is None else softmax_scale

    left, right = window_size
    is_causal = causal and not (max_seqlen_q == 1 and alibi_slopes is None)
    if is_causal:
        right = 0
    swapped = (
        max_seqlen_q == 1
        and num_heads > num_heads_k
        and left < 0
        and right < 0
        and dropout_p == 0.0
        and head_size % 8 == 0
        and alibi_slopes is None
    )
    if swapped and total_q != batch:
        # q.reshape({batch_size, num_heads_k, ngroups, head_size}) in mha_varlen_fwd
        raise RuntimeError(
            f"shape '[{batch}, {num_heads_k}, {num_heads // num_heads_k}, {head_size}]' "
            f"is invalid for input of size {q.numel()}"
        )
    if left >= max_seqlen_k:
        left = -1
    if right >= max_seqlen_k:
        right = -1
    local = left >= 0 or right >= 0

    group = num_heads // num_heads_k
    out = torch.zeros(total_q, num_heads, head_size, dtype=torch.float32)
    lse = torch.full((num_heads, total_q), math.inf, dtype=torch.float32)
    cq, ck = cu_seqlens_q.tolist(), cu_seqlens_k.tolist()
    for b in range(batch):
        sq, sk = cq[b + 1] - cq[b], ck[b + 1] - ck[b]
        if sq == 0 or sk == 0:
            continue  # zeros, lse +inf
        nblk = math.ceil(sk / page)
        blocks = block_table[b, :nblk].long()
        keys = k[blocks].reshape(nblk * page, num_heads_k, head_size)[:sk].float()
        vals = v[blocks].reshape(nblk * page, num_heads_k, head_size)[:sk].float()
        keys = keys.repeat_interleave(group, dim=1)
        vals = vals.repeat_interleave(group, dim=1)
        qb = q[cq[b] : cq[b + 1]].float()
        s = torch.einsum("ihd,jhd->hij", qb, keys) * scale
        if softcap > 0:
            s = softcap * torch.tanh(s / softcap)
        i = torch.arange(sq)[:, None]
        j = torch.arange(sk)[None, :]
        visible = torch.ones(sq, sk, dtype=torch.bool)
        if is_causal or local:
            if left >= 0:
                visible &= j >= i + sk - sq - left
            if right >= 0:
                visible &= j <= i + sk - sq + right
        s = s.masked_fill(~visible[None], -math.inf)
        row_lse = torch.logsumexp(s, dim=-1)  # [h, sq]
        p = torch.exp(s - row_lse[..., None]).nan_to_num(0.0)
        out[cq[b] : cq[b + 1]] = torch.einsum("hij,jhd->ihd", p, vals)
        lse[:, cq[b] : cq[b + 1]] = torch.where(torch.isneginf(row_lse), math.inf, row_lse)
    out = out.to(q.dtype)
    return (out, lse, torch.empty(0, dtype=q.dtype)) if return_attn_probs else out


def as_module() -> types.ModuleType:
    """A ``flash_attn`` module object exposing the stand-in (for ``sys.modules``)."""
    mod = types.ModuleType("flash_attn")
    mod.__spec__ = importlib.machinery.ModuleSpec("flash_attn", None)
    mod.__version__ = __version__
    mod.flash_attn_varlen_func = flash_attn_varlen_func
    return mod
