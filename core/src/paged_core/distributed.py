"""Attention over a KV cache sharded across ranks (context parallelism), on ``torch.distributed``.

Each rank holds part of every request's context in its own paged cache, described by its own
``BatchMeta`` with the same query rows, attends to it with ``return_lse=True``, and the ranks'
partial results merge exactly (:func:`paged_core.merge_states`)::

    out_r, lse_r = backend.forward(q, cache_shard, plan_shard, return_lse=True)
    out, lse = merge_across_ranks(out_r, lse_r)          # every rank: attention over all shards

Shards must be disjoint key sets whose every key each query may see: by the rule of positions
(a request's new tokens are the last of its ``seq_len`` keys) that is the case for decode steps
(one new token per request), the usual context-parallel workload; a prefill chunk sharded along
its context would be masked causally inside each shard. Sinks join the denominator once: pass
them here, not to the ranks' ``forward``. Any backend with LSE output works; NCCL on GPUs, gloo
on the CPU.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from ._errors import InputError
from ._merge import merge_states

__all__ = ["merge_across_ranks"]


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


def _desc(t: object) -> str:
    if isinstance(t, torch.Tensor):
        return f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
    return f"a {type(t).__name__}"
