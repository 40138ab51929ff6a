"""Exact merge of attention computed over disjoint key sets (the log-sum-exp trick).

If ``out_s`` is softmax attention over key set ``K_s`` normalised within ``K_s`` and ``lse_s`` the
log-sum-exp of its logits, attention over the union is ``Σ_s exp(lse_s - lse) · out_s`` with
``lse = logsumexp_s(lse_s)``. This merges Flash-Decoding splits, cascade (shared prefix + suffix)
passes and context-parallel ranks. Convention: natural log, float32, ``[num_tokens, num_heads]``.

This is plain PyTorch on every device, exact, and imports no plugin: on CUDA,
``paged_triton_unified.merge_states`` is the same merge as one Triton launch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from ._errors import InputError

__all__ = ["merge_states"]


def merge_states(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
    *,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Merge ``S`` partial attention results over disjoint key sets into one.

    ``outputs``: ``[S, num_tokens, num_heads, head_dim]`` (or a list of S ``[num_tokens,
    num_heads, head_dim]``); ``lses``: float32 ``[S, num_tokens, num_heads]``, natural log,
    ``-inf`` where a part saw no key (its output is then ignored, even if NaN). ``sinks``
    (float32 ``[num_heads]``) adds one logit per head to the denominator, with no value.
    Returns ``(out, lse)`` with ``out`` in the outputs' dtype; rows where every part is empty
    give zeros and ``-inf`` (with sinks too), never NaN. A NaN log-sum-exp in any part makes that
    row's ``out`` and ``lse`` NaN: a corrupted input never turns into a finite answer. PyTorch on
    every device; ``paged_triton_unified.merge_states`` is the Triton kernel of the same merge.

    >>> o = torch.ones(2, 1, 1, 2); l = torch.tensor([[[0.0]], [[float("-inf")]]])
    >>> out, lse = merge_states(o, l)
    >>> out.flatten().tolist(), lse.item()
    ([1.0, 1.0], 0.0)
    """
    outs = _stack("outputs", outputs)
    ls = _stack("lses", lses)
    if outs.dim() != 4 or ls.shape != outs.shape[:3]:
        raise InputError(
            f"outputs {list(outs.shape)} and lses {list(ls.shape)} do not match; accepted: "
            "outputs [S, num_tokens, num_heads, head_dim] with lses [S, num_tokens, num_heads]"
        )
    if sinks is not None and (
        not isinstance(sinks, torch.Tensor)
        or tuple(sinks.shape) != (outs.shape[2],)
        or sinks.dtype != torch.float32
        or sinks.device != outs.device
    ):
        found = (
            f"{str(sinks.dtype).removeprefix('torch.')} {list(sinks.shape)} on {sinks.device}"
            if isinstance(sinks, torch.Tensor)
            else f"a {type(sinks).__name__}"
        )
        raise InputError(
            f"sinks is {found}; accepted: None or a float32 tensor [num_heads={outs.shape[2]}] on {outs.device}"
        )
    ls = ls.float()
    total = ls if sinks is None else torch.cat([ls, sinks.float().view(1, 1, -1).expand(1, *ls.shape[1:])])
    lse = torch.logsumexp(total, dim=0)  # [N, H]
    # A row that no part saw (every lse_s = -inf) has no visible key: -inf, sinks or not (the
    # kernels' convention), never the sink's own log-sum-exp.
    lse = torch.where(torch.isneginf(ls).all(dim=0), float("-inf"), lse)
    # Guard the all-empty rows: -inf - -inf is NaN, so weigh them against 0 instead. Only those:
    # a NaN lse (NaN in some part) stays NaN, so every weight of its row is NaN.
    safe = torch.where(torch.isneginf(lse), torch.zeros_like(lse), lse)
    w = torch.exp(ls - safe[None])  # [S, N, H]; exactly 0 for empty parts
    # An empty part may hold anything (even NaN): a zero weight must not let it through. A NaN
    # weight must, so the test is != 0, not > 0 (the Triton merge kernel's rule).
    out = torch.where(w[..., None] != 0, w[..., None] * outs.float(), 0.0).sum(dim=0)
    return out.to(outs.dtype), lse


def _stack(name: str, parts: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """A list of parts as one tensor, refusing what torch.stack would fail on deep inside."""
    if isinstance(parts, torch.Tensor):
        return parts
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in parts):
        raise InputError(f"{name} is {type(parts).__name__} {parts!r:.60}; accepted: a tensor or a list of tensors")
    parts = list(parts)
    shapes = [list(p.shape) for p in parts]
    if not parts or any(sh != shapes[0] for sh in shapes):
        found = ", ".join(str(sh) for sh in shapes) if parts else "no parts to merge"
        raise InputError(
            f"{name} {found}{' differ in shape' if parts else ''}; accepted: outputs [S, num_tokens, "
            "num_heads, head_dim] with lses [S, num_tokens, num_heads] (or lists of S parts of one shape)"
        )
    return torch.stack(parts)
