"""A ``BatchMeta`` from vLLM's ``CommonAttentionMetadata``: field for field, no copy, no sync.

vLLM describes a step with the same words paged uses::

    query_start_loc       int32 [R + 1]   request r's new tokens are rows qsl[r]:qsl[r+1]
    query_start_loc_cpu   int32 [R + 1]   its host mirror
    seq_lens              int32 [R]       context after this step, new tokens included
    block_table_tensor    int32 [R', W]   physical block of each logical block (R' >= R rows)
    slot_mapping          int64 [N' >= N] block * block_size + offset of each new token; -1 = padding
    num_actual_tokens     host int N      the rows of q that are real tokens
    max_query_len, max_seq_len            host ints

so the metadata is views of vLLM's tensors: the block table cut to ``R`` rows and the slot
mapping to the ``N`` real tokens (vLLM pads the token count; rows past ``N`` are never read).
"""

from __future__ import annotations

import numbers
from typing import Any

from paged_core import BatchMeta, InputError

__all__ = ["batch_meta_from_vllm"]

#: What this reads of ``CommonAttentionMetadata`` (``query_start_loc_cpu`` is optional).
_FIELDS = (
    "num_reqs",
    "num_actual_tokens",
    "max_query_len",
    "max_seq_len",
    "query_start_loc",
    "seq_lens",
    "block_table_tensor",
    "slot_mapping",
)


def batch_meta_from_vllm(common: Any, block_size: int) -> BatchMeta:
    """The ``BatchMeta`` of one vLLM step from its ``CommonAttentionMetadata`` ``common``.

    ``block_size`` is the KV cache group's (kernel) block size, in which vLLM's block table and
    slot mapping count. A 3-token prompt in block 2 and a decode at position 4 in blocks 1 and 3
    (block_size 4), with vLLM's padding of the token count and table rows:

    >>> import torch
    >>> from types import SimpleNamespace
    >>> common = SimpleNamespace(
    ...     num_reqs=2, num_actual_tokens=4, max_query_len=3, max_seq_len=5,
    ...     query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
    ...     query_start_loc_cpu=torch.tensor([0, 3, 4], dtype=torch.int32),
    ...     seq_lens=torch.tensor([3, 5], dtype=torch.int32),
    ...     block_table_tensor=torch.tensor([[2, 0], [1, 3], [0, 0]], dtype=torch.int32),
    ...     slot_mapping=torch.tensor([8, 9, 10, 12, -1, -1]))
    >>> meta = batch_meta_from_vllm(common, block_size=4)
    >>> meta.block_table.tolist(), meta.slot_mapping.tolist(), meta.num_tokens
    ([[2, 0], [1, 3]], [8, 9, 10, 12], 4)
    >>> meta.validate(num_blocks=4) is meta
    True
    """
    missing = [f for f in _FIELDS if not hasattr(common, f)]
    if missing:
        raise InputError(
            f"common is a {type(common).__name__} without {', '.join(missing)}; accepted: vLLM's "
            f"CommonAttentionMetadata (an object with the attributes {', '.join(_FIELDS)})"
        )
    if not isinstance(block_size, numbers.Integral) or isinstance(block_size, bool) or block_size < 1:
        raise InputError(
            f"block_size is {block_size!r}; accepted: a positive int (the KV cache group's kernel block "
            "size, in which vLLM's block table and slot mapping count)"
        )
    num_reqs = int(common.num_reqs)
    num_tokens = int(common.num_actual_tokens)
    return BatchMeta(
        num_reqs=num_reqs,
        query_start_loc=common.query_start_loc[: num_reqs + 1],
        seq_lens=common.seq_lens[:num_reqs],
        block_table=common.block_table_tensor[:num_reqs],
        slot_mapping=common.slot_mapping[:num_tokens],
        block_size=int(block_size),
        max_query_len=int(common.max_query_len),
        max_seq_len=int(common.max_seq_len),
        query_start_loc_cpu=_host(common, "query_start_loc_cpu", num_reqs + 1),
        # vLLM's host copy of seq_lens is an upper bound when set (speculative decoding trims on
        # the device), which BatchMeta's mirror may not be: leave it out.
        seq_lens_cpu=None,
    )


def _host(common: Any, name: str, n: int) -> Any:
    t = getattr(common, name, None)
    return None if t is None else t[:n]
