"""``BatchMeta`` in the vocabularies of the vendor libraries, computed on the device.

Each converter is pure PyTorch on the batch's device with shapes fixed by host ints, so it needs
no host sync and can run inside a CUDA graph. Tested once here against per-request loops; the
adapters only call them.
"""

from __future__ import annotations

import dataclasses

import torch

from ._batch import BatchMeta
from ._checks import check_batch

__all__ = ["FlashInferPages", "to_flashinfer_pages", "FlashAttnArgs", "to_flash_attn_args"]


@dataclasses.dataclass
class FlashInferPages:
    """FlashInfer's description of a paged KV batch (its "page" is our block)."""

    #: int32 [num_reqs + 1]: request r's pages are ``indices[indptr[r]:indptr[r+1]]``.
    indptr: torch.Tensor
    #: int32 [num_reqs * max_blocks_per_req]: physical page ids, packed; the tail past
    #: ``indptr[-1]`` is unused (its length is an upper bound, so no sync is needed to size it).
    indices: torch.Tensor
    #: int32 [num_reqs]: tokens in each request's last page (1..block_size; 0 for padding).
    last_page_len: torch.Tensor
    #: int32 [num_reqs + 1] on the CPU from the batch's host mirrors, or None without them.
    indptr_cpu: torch.Tensor | None = None
    #: int32 [num_reqs] on the CPU from the host mirrors, or None.
    last_page_len_cpu: torch.Tensor | None = None


def _pages(seq_lens: torch.Tensor, block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    num_pages = (seq_lens + block_size - 1) // block_size
    last = torch.where(num_pages > 0, seq_lens - (num_pages - 1) * block_size, torch.zeros_like(seq_lens))
    return num_pages.to(torch.int32), last.to(torch.int32)


def to_flashinfer_pages(meta: BatchMeta) -> FlashInferPages:
    """Convert a batch to FlashInfer's ``paged_kv_indptr / indices / last_page_len``.

    >>> meta = BatchMeta.from_lists([1, 2], [17, 3], [[4, 7], [2]], block_size=16)
    >>> p = to_flashinfer_pages(meta)
    >>> p.indptr.tolist(), p.indices[:3].tolist(), p.last_page_len.tolist()
    ([0, 2, 3], [4, 7, 2], [1, 3])
    """
    check_batch(meta)
    bs = meta.block_size
    R, width = meta.block_table.shape
    num_pages, last = _pages(meta.seq_lens, bs)
    indptr = torch.zeros(R + 1, dtype=torch.int32, device=meta.device)
    indptr[1:] = torch.cumsum(num_pages, 0)
    # Scatter each used table entry to its packed position; unused ones go to a dump slot at
    # the end, which is cut off. Shapes depend only on host ints: no sync.
    j = torch.arange(width, device=meta.device)
    used = j[None, :] < num_pages[:, None]  # [R, width]
    dest = torch.where(used, indptr[:-1, None].long() + j[None, :], torch.full_like(j, R * width)[None, :])
    indices = torch.zeros(R * width + 1, dtype=torch.int32, device=meta.device)
    indices.scatter_(0, dest.flatten(), meta.block_table.flatten())
    indptr_cpu = last_cpu = None
    if meta.seq_lens_cpu is not None:
        np_cpu, last_cpu = _pages(meta.seq_lens_cpu, bs)
        indptr_cpu = torch.zeros(R + 1, dtype=torch.int32)
        indptr_cpu[1:] = torch.cumsum(np_cpu, 0)
    return FlashInferPages(indptr, indices[: R * width], last, indptr_cpu, last_cpu)


@dataclasses.dataclass
class FlashAttnArgs:
    """The paged arguments of ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``."""

    #: int32 [num_reqs + 1]: query offsets (our ``query_start_loc``).
    cu_seqlens_q: torch.Tensor
    #: int32 [num_reqs + 1]: cumulative key lengths (prefix sums of ``seq_lens``).
    cu_seqlens_k: torch.Tensor
    #: int32 [num_reqs]: key length per request (``seq_lens``).
    seqused_k: torch.Tensor
    max_seqlen_q: int
    max_seqlen_k: int
    #: int32 [num_reqs, max_blocks_per_req]: our block table as is.
    block_table: torch.Tensor


def to_flash_attn_args(meta: BatchMeta) -> FlashAttnArgs:
    """Convert a batch to flash-attn's varlen + block-table arguments (no host sync).

    >>> a = to_flash_attn_args(BatchMeta.from_lists([1, 2], [17, 3], [[4, 7], [2]], block_size=16))
    >>> a.cu_seqlens_q.tolist(), a.cu_seqlens_k.tolist(), a.max_seqlen_k
    ([0, 1, 3], [0, 17, 20], 17)
    """
    check_batch(meta)
    cu_k = torch.zeros(meta.num_reqs + 1, dtype=torch.int32, device=meta.device)
    cu_k[1:] = torch.cumsum(meta.seq_lens, 0)
    return FlashAttnArgs(
        cu_seqlens_q=meta.query_start_loc,
        cu_seqlens_k=cu_k,
        seqused_k=meta.seq_lens,
        max_seqlen_q=meta.max_query_len,
        max_seqlen_k=meta.max_seq_len,
        block_table=meta.block_table,
    )
