"""A ``BatchMeta`` from transformers' per-step continuous-batching tensors, built on the device.

transformers describes a step with cumulative lengths and flat slot lists, one per layer group::

    cu_seq_lens_q  int32 [R + 1]   request r's new tokens are rows cu_q[r]:cu_q[r+1] of q
    cu_seq_lens_k  int32 [R + 1]   request r reads cu_k[r+1] - cu_k[r] = seq_len tokens
    read_index     int64 [sum seq_len] or empty: the slot of every position 0 .. seq_len-1
    write_index    int64 [num_tokens]: the slot of every new token (padding: a trash slot)

A slot is ``block * block_size + offset`` in a pool of ``num_blocks + 2`` blocks, the same
arithmetic as paged's ``slot_mapping``, so a full-attention layer's block table is the slot of
position ``j * block_size`` divided by ``block_size``. When no request reads its past
(``read_index`` empty: every request is a whole prompt) the write slots are those positions.

Rows of q past ``cu_q[R]`` (transformers pads the token count for CUDA graphs) become one extra
request with ``seq_len`` 0 and slot -1: paged's padding request, which yields exact zeros and
writes nothing. A step that cannot have such rows gets none: a decode step with one row per
request (``max_query_len`` 1 and ``R`` rows, as transformers sends decodes without CUDA graphs)
stays a decode-only batch of one row per request, the shape split-KV decode kernels take.
Nothing here reads a device value, so building the metadata never syncs and records into a CUDA
graph.
"""

from __future__ import annotations

import numbers

import torch
from paged_core import BatchMeta, InputError

__all__ = ["batch_meta_from_gathered", "batch_meta_from_transformers"]


def _check_index_tensors(**tensors: object) -> None:
    """transformers' per-step tensors are integer tensors; a list or a float tensor is refused
    here, before any arithmetic on it."""
    for name, t in tensors.items():
        if not isinstance(t, torch.Tensor) or t.is_floating_point() or t.is_complex() or t.dtype == torch.bool:
            if isinstance(t, torch.Tensor):
                found = f"{str(t.dtype).removeprefix('torch.')} {list(t.shape)}"
            else:
                found = f"a {type(t).__name__}"
            raise InputError(
                f"{name} is {found}; accepted: an int tensor (transformers' "
                f"per-step {name}; torch.tensor(..., dtype=torch.int32) for a list)"
            )


def _check_host_ints(**ints: tuple[object, int | None]) -> None:
    """transformers' host ints, each ``(value, lowest accepted)``: a block size of 0 would divide
    by zero. The max lengths take any int (below 0 is read as 0, as transformers may send)."""
    for name, (v, low) in ints.items():
        if not isinstance(v, numbers.Integral) or isinstance(v, bool) or (low is not None and v < low):
            bound = "an int" if low is None else f"an int >= {low}"
            what = "the paged cache's tokens per block" if name == "block_size" else "a host int of the step"
            raise InputError(f"{name} is {v!r}; accepted: {bound} ({what})")


def _check_cu_lens(cu_seq_lens_q: torch.Tensor, cu_seq_lens_k: torch.Tensor) -> None:
    _check_index_tensors(cu_seq_lens_q=cu_seq_lens_q, cu_seq_lens_k=cu_seq_lens_k)
    if cu_seq_lens_q.dim() != 1 or cu_seq_lens_k.shape != cu_seq_lens_q.shape:
        raise InputError(
            f"cu_seq_lens_q is {list(cu_seq_lens_q.shape)} and cu_seq_lens_k is {list(cu_seq_lens_k.shape)}; "
            "accepted: two int tensors [num_reqs + 1] (transformers' per-step cumulative lengths)"
        )


def _fills_q(num_reqs: int, num_tokens: int, max_query_len: int) -> bool:
    """Whether the requests own every row of q, known on the host: at most one row each
    (``max_query_len`` is an upper bound) and as many rows as requests, so one row each."""
    return num_reqs > 0 and max_query_len <= 1 and num_tokens == num_reqs


def _with_padding_request(
    num_reqs: int,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    num_tokens: int,
    pad: bool,
) -> tuple[int, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The request arrays with one padding request (``seq_len`` 0) owning the rows past
    ``cu_q[R]`` (empty when nothing is padded) appended, or as they are without ``pad``."""
    q, s, t = query_start_loc.to(torch.int32), seq_lens.to(torch.int32), block_table.to(torch.int32)
    if not pad:
        return num_reqs, q, s, t
    device = q.device
    return (
        num_reqs + 1,
        torch.cat([q, torch.full((1,), num_tokens, dtype=torch.int32, device=device)]),
        torch.cat([s, torch.zeros(1, dtype=torch.int32, device=device)]),
        torch.cat([t, torch.zeros((1, t.shape[1]), dtype=torch.int32, device=device)]),
    )


def batch_meta_from_transformers(
    *,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    read_index: torch.Tensor,
    write_index: torch.Tensor,
    num_tokens: int,
    block_size: int,
    max_query_len: int,
    max_seq_len: int,
    padding_slot: int | None = -1,
) -> BatchMeta:
    """The ``BatchMeta`` of one transformers step (one full-attention layer group).

    ``max_query_len`` and ``max_seq_len`` are transformers' host ints ``max_seqlen_q`` and
    ``max_seqlen_k``: the true maxima, or (with padding for CUDA graphs) upper bounds, which is
    what ``BatchMeta`` accepts. The table is ``ceil(max_seq_len / block_size)`` wide.
    ``padding_slot`` is the slot of rows past ``cu_q[R]``: -1 (paged's padding slot, for a cache
    with a block past the pool), or None to keep transformers' own write-trash slot.

    Two whole prompts of 3 and 5 tokens in blocks 4 and 1 (block_size 4), padded to 10 rows:

    >>> import torch
    >>> slots = torch.tensor([16, 17, 18, 4, 5, 6, 7, 8, 99, 99])  # second prompt: blocks 1, 2
    >>> meta = batch_meta_from_transformers(
    ...     cu_seq_lens_q=torch.tensor([0, 3, 8], dtype=torch.int32),
    ...     cu_seq_lens_k=torch.tensor([0, 3, 8], dtype=torch.int32),
    ...     read_index=torch.empty(0, dtype=torch.int64), write_index=slots,
    ...     num_tokens=10, block_size=4, max_query_len=10, max_seq_len=5)
    >>> meta.block_table.tolist(), meta.seq_lens.tolist(), meta.slot_mapping[-3:].tolist()
    ([[4, 0], [1, 2], [0, 0]], [3, 5, 0], [8, -1, -1])
    >>> meta.validate(num_blocks=8) is meta
    True
    """
    _check_cu_lens(cu_seq_lens_q, cu_seq_lens_k)
    _check_index_tensors(read_index=read_index, write_index=write_index)
    _check_host_ints(
        num_tokens=(num_tokens, 0),
        block_size=(block_size, 1),
        max_query_len=(max_query_len, None),
        max_seq_len=(max_seq_len, None),
    )
    if padding_slot is not None and (not isinstance(padding_slot, numbers.Integral) or isinstance(padding_slot, bool)):
        raise InputError(f"padding_slot is {padding_slot!r}; accepted: an int slot (-1: paged's padding slot) or None")
    if write_index.dim() != 1 or write_index.shape[0] != num_tokens:
        raise InputError(
            f"write_index has shape {list(write_index.shape)} but q has {num_tokens} rows; accepted: one "
            "write slot per query row (transformers' write_index of the layer's group)"
        )
    device = cu_seq_lens_q.device
    num_reqs = cu_seq_lens_q.shape[0] - 1
    cu_q = cu_seq_lens_q.to(torch.int32)
    cu_k = cu_seq_lens_k.to(torch.int64)
    width = max(1, -(-max_seq_len // block_size))
    seq_lens = (cu_k[1:] - cu_k[:-1]).to(torch.int32)  # [R]
    # The slot of every position of every request, in request order (see the module docstring).
    positions = read_index if read_index.numel() else write_index
    starts = torch.arange(width, device=device, dtype=torch.int64) * block_size  # [W]
    first_slot = cu_k[:-1, None] + starts[None, :]  # [R, W]: where position j*bs of request r sits
    used = starts[None, :] < seq_lens[:, None]
    if positions.numel():
        gathered = positions[first_slot.clamp(max=positions.numel() - 1)]
        table = torch.where(used, torch.div(gathered, block_size, rounding_mode="floor"), 0)
    else:
        table = torch.zeros((num_reqs, width), dtype=torch.int64, device=device)
    pad = not _fills_q(num_reqs, num_tokens, max_query_len)
    slot_mapping = write_index.to(torch.int64)
    if padding_slot is not None and pad:
        row = torch.arange(num_tokens, device=device)
        slot_mapping = torch.where(row < cu_q[-1], slot_mapping, padding_slot)
    reqs, query_start_loc, seq_lens, table = _with_padding_request(num_reqs, cu_q, seq_lens, table, num_tokens, pad)
    return BatchMeta(
        num_reqs=reqs,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=table,
        slot_mapping=slot_mapping,
        block_size=block_size,
        max_query_len=max(max_query_len, 0),
        max_seq_len=max(max_seq_len, 0),
    )


def batch_meta_from_gathered(
    *,
    cu_seq_lens_q: torch.Tensor,
    cu_seq_lens_k: torch.Tensor,
    num_tokens: int,
    num_kv_rows: int,
    max_query_len: int,
    max_seq_len: int,
) -> BatchMeta:
    """The ``BatchMeta`` of one transformers 5.24 or 5.25 step over the K/V it gathered: block_size 1.

    transformers 5.24 and 5.25 hand the attention function every request's K/V gathered from its pool,
    request after request (request r's positions ``0 .. seq_len-1`` are rows
    ``cu_k[r]:cu_k[r+1]``; ``num_kv_rows`` counts them, padding included). Seen as a pool of
    one-token blocks, request r's block table is ``cu_k[r] + j`` and each new token's K/V is
    already in row ``cu_k[r] + seq_len - query_len + i``, its ``slot_mapping`` (padding rows -1).
    Rows of q past ``cu_q[R]`` become one padding request (``seq_len`` 0), as above.

    Two requests: a decode at 3 tokens and a 2-token chunk after 1, padded to 4 query rows:

    >>> import torch
    >>> meta = batch_meta_from_gathered(
    ...     cu_seq_lens_q=torch.tensor([0, 1, 3], dtype=torch.int32),
    ...     cu_seq_lens_k=torch.tensor([0, 3, 6], dtype=torch.int32),
    ...     num_tokens=4, num_kv_rows=8, max_query_len=4, max_seq_len=3)
    >>> meta.block_table.tolist(), meta.seq_lens.tolist(), meta.slot_mapping.tolist()
    ([[0, 1, 2], [3, 4, 5], [0, 0, 0]], [3, 3, 0], [2, 4, 5, -1])
    >>> meta.validate(num_blocks=8) is meta
    True
    """
    _check_cu_lens(cu_seq_lens_q, cu_seq_lens_k)
    _check_host_ints(
        num_tokens=(num_tokens, 0),
        num_kv_rows=(num_kv_rows, 0),
        max_query_len=(max_query_len, None),
        max_seq_len=(max_seq_len, None),
    )
    device = cu_seq_lens_q.device
    num_reqs = cu_seq_lens_q.shape[0] - 1
    cu_q = cu_seq_lens_q.to(torch.int64)
    cu_k = cu_seq_lens_k.to(torch.int64)
    width = max(1, max_seq_len)
    seq_lens = cu_k[1:] - cu_k[:-1]  # [R]
    query_lens = cu_q[1:] - cu_q[:-1]  # [R]
    j = torch.arange(width, device=device, dtype=torch.int64)
    rows = (cu_k[:-1, None] + j[None, :]).clamp(max=max(num_kv_rows - 1, 0))  # [R, W]
    table = torch.where(j[None, :] < seq_lens[:, None], rows, 0)
    # Each query row's request (the padding rows past cu_q[R] get the last one, then -1).
    n = torch.arange(num_tokens, device=device, dtype=torch.int64)
    req = (torch.searchsorted(cu_q[1:], n, right=True)).clamp(max=max(num_reqs - 1, 0))
    pad = not _fills_q(num_reqs, num_tokens, max_query_len)
    if num_reqs:
        slot = cu_k[req] + seq_lens[req] - query_lens[req] + (n - cu_q[req])
        slot_mapping = torch.where(n < cu_q[-1], slot, -1) if pad else slot
    else:
        slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64, device=device)
    reqs, query_start_loc, seq_lens_, table_ = _with_padding_request(num_reqs, cu_q, seq_lens, table, num_tokens, pad)
    return BatchMeta(
        num_reqs=reqs,
        query_start_loc=query_start_loc,
        seq_lens=seq_lens_,
        block_table=table_,
        slot_mapping=slot_mapping,
        block_size=1,
        max_query_len=max(max_query_len, 0),
        max_seq_len=max(max_seq_len, 0),
    )
