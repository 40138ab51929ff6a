"""Exact merge of attention computed over disjoint key sets (the log-sum-exp trick).

If ``out_s`` is softmax attention over key set ``K_s`` normalised within ``K_s`` and ``lse_s`` the
log-sum-exp of its logits, attention over the union is ``Σ_s exp(lse_s - lse) · out_s`` with
``lse = logsumexp_s(lse_s)``. This merges Flash-Decoding splits, cascade (shared prefix + suffix)
passes and context-parallel ranks. Convention: natural log, float32, ``[num_tokens, num_heads]``.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._errors import InputError

__all__ = ["merge_states"]


def merge_states(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``S`` partial attention results over disjoint key sets into one.

    ``outputs``: ``[S, num_tokens, num_heads, head_dim]`` (or a list of S ``[num_tokens,
    num_heads, head_dim]``); ``lses``: float32 ``[S, num_tokens, num_heads]``, natural log,
    ``-inf`` where a part saw no key. Returns ``(out, lse)`` with ``out`` in the outputs' dtype;
    rows where every part is empty give zeros and ``-inf``, never NaN.

    >>> o = torch.ones(2, 1, 1, 2); l = torch.tensor([[[0.0]], [[float("-inf")]]])
    >>> out, lse = merge_states(o, l)
    >>> out.flatten().tolist(), lse.item()
    ([1.0, 1.0], 0.0)
    """
    outs = torch.stack(list(outputs)) if not isinstance(outputs, torch.Tensor) else outputs
    ls = torch.stack(list(lses)) if not isinstance(lses, torch.Tensor) else lses
    if outs.dim() != 4 or ls.shape != outs.shape[:3]:
        raise InputError(
            f"outputs {list(outs.shape)} and lses {list(ls.shape)} do not match; accepted: "
            "outputs [S, num_tokens, num_heads, head_dim] with lses [S, num_tokens, num_heads]"
        )
    ls = ls.float()
    lse = torch.logsumexp(ls, dim=0)  # [N, H]; -inf where every part is empty
    # Guard the all-empty rows: -inf - -inf is NaN, so weigh them against 0 instead.
    safe = torch.where(torch.isfinite(lse), lse, torch.zeros_like(lse))
    w = torch.exp(ls - safe[None])  # [S, N, H]
    out = (w[..., None] * outs.float()).sum(dim=0)
    return out.to(outs.dtype), lse
