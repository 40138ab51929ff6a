"""The ``triton-unified`` backend: the launchers of :mod:`.launch` and :mod:`.split_launch` behind
the paged contract."""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Callable

import torch
from paged_core import KV_SCALES, BatchMeta, Capabilities, InputError
from paged_triton_common.backend import TritonBackend, TritonPlan, kernel_k_scale

from .launch import SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, unified_attention
from .split_launch import cascade_attention, choose_num_splits, shared_prefix_blocks, split_decode_attention

__all__ = ["TritonUnifiedBackend", "MAX_NUM_SPLITS"]

#: The largest fixed split count (``num_splits``): eight times the automatic choice's cap.
MAX_NUM_SPLITS = 256
INT32_LIMIT = 2**31


class TritonUnifiedBackend(TritonBackend):
    """One launch per layer for the whole batch: prefill chunks, prompts, decodes, verification.

    The GROUP query heads sharing a KV head are packed into the rows of each tile, so every K/V
    block is read once per group; the grid covers only the batch's real query tiles. No host
    synchronisation: ``forward`` can be captured in a CUDA graph (after a first, autotuning call).

    Decode batches too small to fill the GPU are split along the context (Flash-Decoding):
    each split writes a partial output and its log-sum-exp, and the last split of each
    (request, KV head) to finish merges them exactly, in the same launch.
    Every other batch runs the unified kernel, so any batch is served.

    Options:

    - ``split_kv``: ``"auto"`` (split when the (request, KV head) pairs cannot fill the GPU;
      the count comes from the multiprocessor count, at most three programs per SM, at least 256
      tokens a split, at most 32), ``True`` (always split decode batches) or ``False`` (never:
      every batch runs the unified kernel).
    - ``num_splits``: a fixed split count for decode batches, 1 to :data:`MAX_NUM_SPLITS`
      (implies ``split_kv=True``; refused with ``split_kv=False`` or ``batch_invariant``).
    - ``batch_invariant``: splits of a fixed ``blocks_per_split`` blocks, not derived from the
      batch, so a request's output is bitwise the same alone or in any batch (decode batches).
      Refused with ``cascade``, whose prefix pass splits by the batch.
    - ``cascade``: detect a prefix shared by every request (the same physical blocks) in
      :meth:`plan` and read it once for the whole batch; ``plan(meta, shared_prefix_blocks=k)``
      declares it instead (no device read; with validation on it is checked against the block
      table, a sync; with it off a false declaration gives wrong rows for the requests that do
      not hold it).
    - ``blocks_per_split``: the split size of the ``batch_invariant`` mode (default 16 blocks).
    - ``min_prefix_tokens``: a shared prefix (found or declared) shorter than this runs as a
      normal batch, without the cascade pass (default 256 tokens).
    """

    name = "triton-unified"
    capabilities = Capabilities(
        head_dims=frozenset(SUPPORTED_HEAD_DIMS),
        # V's head dim may be any supported one (MLA-shaped layers): the PV tile and the
        # accumulator have their own width.
        head_dim_pairs=None,
        block_sizes=frozenset(SUPPORTED_BLOCK_SIZES),
        # Named, not paged_core.KV_DTYPES: a format core adds is claimed once the kernels read it.
        kv_dtypes=frozenset({"auto", "int8", "fp8", "fp8_e5m2", "int4", "kivi4"}),
        kv_scales=frozenset(KV_SCALES),
        dtypes=frozenset(SUPPORTED_DTYPES),
        devices=frozenset({"cpu", "cuda"}),
        sliding_window=True,
        softcap=True,
        sinks=True,
        returns_lse=True,
        cuda_graphs=True,
        # TritonPlan holds the batch; a mixed batch's tile plan is a kernel launched from it.
        # cascade=True narrows it (the shared prefix is found on the host).
        device_plan=True,
        # Tile sizes follow the batch's shape class (decode vs mixed), so a request's rounding
        # can change with its neighbours: close, not bitwise. batch_invariant=True narrows the
        # instance to a bitwise mode for decode batches.
        batch_invariant=False,
    )

    def __init__(
        self,
        *,
        split_kv: bool | str = "auto",
        num_splits: int | None = None,
        batch_invariant: bool = False,
        blocks_per_split: int = 16,
        cascade: bool = False,
        min_prefix_tokens: int = 256,
        validate: bool | None = None,
    ):
        super().__init__(validate=validate)
        for opt, val in (("batch_invariant", batch_invariant), ("cascade", cascade)):
            if type(val) is not bool:
                raise InputError(f"{opt} is {val!r}; accepted: True or False")
        if not (split_kv == "auto" or type(split_kv) is bool):
            raise InputError(f"split_kv is {split_kv!r}; accepted: 'auto', True or False")
        if num_splits is not None and (not _is_int(num_splits) or not 1 <= num_splits <= MAX_NUM_SPLITS):
            raise InputError(
                f"num_splits is {num_splits!r}; accepted: None or an int from 1 to {MAX_NUM_SPLITS} (each split "
                "keeps a partial output of the whole batch)"
            )
        if not _is_int(blocks_per_split) or not 1 <= blocks_per_split < INT32_LIMIT:
            raise InputError(f"blocks_per_split is {blocks_per_split!r}; accepted: an int from 1 to 2**31 - 1")
        if not _is_int(min_prefix_tokens) or min_prefix_tokens < 0:
            raise InputError(f"min_prefix_tokens is {min_prefix_tokens!r}; accepted: an int >= 0")
        if split_kv is False and num_splits is not None:
            raise InputError(
                f"split_kv=False and num_splits={num_splits} contradict each other; accepted: one of them "
                "(num_splits alone splits decode batches that many ways)"
            )
        if batch_invariant and num_splits is not None:
            raise InputError(
                f"num_splits={num_splits} does not combine with batch_invariant=True, whose splits are "
                "blocks_per_split blocks each (their count follows the sequence); accepted: one of them"
            )
        if batch_invariant and cascade:
            raise InputError(
                "cascade=True does not combine with batch_invariant=True: the cascade pass splits the shared "
                "prefix by the batch, so a request's bits would follow its neighbours; accepted: one of them"
            )
        self.split_kv = True if num_splits is not None else split_kv
        self.num_splits = num_splits
        self.blocks_per_split = blocks_per_split if batch_invariant else None
        self.cascade = cascade
        self.min_prefix_tokens = min_prefix_tokens
        if cascade:
            # Finding the shared prefix reads the block table on the host (in plan()).
            self.capabilities = dataclasses.replace(self.capabilities, device_plan=False)
        if batch_invariant:
            # Mixed batches go to the unified kernel, whose tiles follow the batch: the bitwise
            # promise holds for decode batches, so that is what this mode claims.
            self.capabilities = dataclasses.replace(self.capabilities, batch_invariant=True, mixed_batches=False)

    def _plan(self, meta: BatchMeta, *, shared_prefix_blocks: int | None = None, **layer) -> TritonPlan:
        """Once per step (``plan(meta, ...)`` checks the layer keywords, then calls this). With
        ``cascade=True`` and no declared prefix, reads the block table from the device (a sync)
        to find the shared prefix; declare it to avoid that. The prefix is read through the
        first request with keys (found on the host: from the batch's host mirror, or from the
        device with the table); a declared prefix without host mirrors is read through row 0,
        which must then hold it. The layer keywords are unused."""
        prefix, row = 0, 0
        if shared_prefix_blocks is not None:
            width = meta.block_table.shape[1]
            if not _is_int(shared_prefix_blocks) or not 0 <= shared_prefix_blocks <= width:
                raise InputError(
                    f"shared_prefix_blocks is {shared_prefix_blocks!r}; accepted: None or an int from 0 to the "
                    f"block table's width ({width})"
                )
            prefix = int(shared_prefix_blocks)
            if self.validate and prefix:
                _check_declared_prefix(meta, prefix)
            if meta.seq_lens_cpu is not None and prefix:
                row = _first_with_keys(meta.seq_lens_cpu)
        elif self.cascade and meta.num_reqs > 1:
            prefix = _shared_prefix(meta)
            if prefix:
                row = _first_with_keys(meta.seq_lens.cpu())
        if prefix * meta.block_size < self.min_prefix_tokens:
            prefix, row = 0, 0
        return TritonPlan(meta, prefix, prefix_row=row)

    def _forward(self, q, cache, plan, *, out, lse, scale, window, softcap, sinks) -> None:
        plan = self._triton_plan(plan)
        meta = plan.meta
        kv = dict(k_scale=kernel_k_scale(cache), v_scale=cache.v_scale, lse=lse, softcap=softcap, sinks=sinks)
        if plan.prefix_blocks and not window and not _cascade_refused(cache):
            # Recorded like every other path: the recording keeps the partials the first layer
            # allocated, and the other layers replay the suffix pass, the prefix pass and the merge
            # in order on the current stream (the first layer, and a CUDA-graph capture, run the
            # two passes on two streams).
            call: Callable[[], object] = lambda: cascade_attention(  # noqa: E731
                q,
                cache.k,
                cache.v,
                out,
                query_start_loc=meta.query_start_loc,
                seq_lens=meta.seq_lens,
                block_table=meta.block_table,
                prefix_blocks=plan.prefix_blocks,
                prefix_row=plan.prefix_row,
                max_query_len=meta.max_query_len,
                max_seq_len=meta.max_seq_len,
                scale=scale,
                **kv,
            )
        else:
            # The path and split count depend only on the batch and the cache's layout: decided
            # once per recording, and the step's other layers repeat what was launched.
            call = lambda: self._run(q, cache, meta, out=out, scale=scale, window=window, kv=kv)  # noqa: E731
        self._launch(plan, q, cache, out, lse, scale, window, softcap, sinks, call)

    def _run(self, q, cache, meta, *, out, scale, window, kv) -> None:
        if meta.decode_only and meta.num_tokens == meta.num_reqs and self.split_kv is not False:
            if self.blocks_per_split is not None:
                num_splits = None  # fixed-size splits: the count follows max_seq_len
            elif self.num_splits is not None:
                num_splits = self.num_splits
            else:
                num_splits = choose_num_splits(
                    meta.num_reqs, cache.num_kv_heads, meta.max_seq_len, cache.block_size, q.device
                )
            if num_splits is None or num_splits > 1 or self.split_kv is True:
                split_decode_attention(
                    q,
                    cache.k,
                    cache.v,
                    out,
                    seq_lens=meta.seq_lens,
                    block_table=meta.block_table,
                    max_seq_len=meta.max_seq_len,
                    scale=scale,
                    num_splits=num_splits,
                    window=window,
                    blocks_per_split=self.blocks_per_split,
                    **kv,
                )
                return
        unified_attention(
            q,
            cache.k,
            cache.v,
            out,
            query_start_loc=meta.query_start_loc,
            seq_lens=meta.seq_lens,
            block_table=meta.block_table,
            max_query_len=meta.max_query_len,
            max_seq_len=meta.max_seq_len,
            scale=scale,
            window=window,
            **kv,
            check=False,  # checked by Backend.forward
        )


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_declared_prefix(meta: BatchMeta, prefix: int) -> None:
    """With validation on: every request with keys holds the first request's ids in the
    declared prefix's columns, for the blocks it uses (a sync: the table is read on the host)."""
    sl = meta.seq_lens.cpu()
    table = meta.block_table[:, :prefix].cpu()
    active = (sl > 0).nonzero().flatten().tolist()
    if not active:
        return
    first = active[0]
    for r in active[1:]:
        used = min(prefix, -(-int(sl[r]) // meta.block_size))
        if not torch.equal(table[r, :used], table[first, :used]):
            raise InputError(
                f"shared_prefix_blocks={prefix} but request {r} holds blocks {table[r, :used].tolist()} in its "
                f"first {used} columns, request {first} {table[first, :used].tolist()}; accepted: a prefix every "
                "request with keys shares (the same block ids), such as paged_core.shared_prefix_blocks(...) "
                "finds, or leave it out with cascade=True"
            )


def _first_with_keys(seq_lens_cpu) -> int:
    """The first request with seq_len > 0 (0 when there is none)."""
    return int((seq_lens_cpu > 0).int().argmax()) if seq_lens_cpu.numel() else 0


def _shared_prefix(meta: BatchMeta) -> int:
    return shared_prefix_blocks(meta.block_table, meta.seq_lens, meta.block_size)


def _cascade_refused(cache) -> bool:
    """Whether the cascade pass must not read ``cache``: a quantized cache whose V head dim is not
    K's. NVIDIA H200, Triton 3.6, 2026-12-05: the prefix pass gave wrong rows on int8 codes with
    head dims 64/32 (scripts/sanitize.py; no memory fault), while the split and unified paths
    were right on the same batches: such batches run as normal batches."""
    return cache.quantized and cache.head_dim_v != cache.head_dim
