"""The ``triton-splitkv`` backend: Flash-Decoding where it pays, the unified kernel elsewhere."""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from paged_core import BatchMeta, InputError
from paged_triton_common.backend import TritonBackend, TritonPlan
from paged_triton_unified.backend import TritonUnifiedBackend
from paged_triton_unified.launch import unified_attention

from .launch import cascade_attention, choose_num_splits, shared_prefix_blocks, split_decode_attention

__all__ = ["TritonSplitKVBackend", "SplitKVPlan"]


#: What :meth:`TritonSplitKVBackend.plan` returns: the batch, the shared prefix it decided
#: (``prefix_blocks``, 0: no cascade) and the launches its layers repeat.
SplitKVPlan = TritonPlan


class TritonSplitKVBackend(TritonBackend):
    """Decode batches too small to fill the GPU are split along the context (Flash-Decoding):
    each split writes a partial output and its log-sum-exp, and the last split of each
    (request, KV head) to finish merges them exactly, in the same launch.
    Every other batch runs the unified kernel, so any batch is served.

    Options:

    - ``split_kv``: ``"auto"`` (split when the (request, KV head) pairs cannot fill the GPU;
      the count comes from the multiprocessor count, at most three programs per SM, at least 256
      tokens a split, at most 32), ``True`` (always split decode batches) or ``False``.
    - ``num_splits``: a fixed split count for decode batches (implies ``split_kv=True``).
    - ``batch_invariant``: splits of a fixed ``blocks_per_split`` blocks, not derived from the
      batch, so a request's output is bitwise the same alone or in any batch (decode batches).
    - ``cascade``: detect a prefix shared by every request (the same physical blocks) in
      :meth:`plan` and read it once for the whole batch; ``plan(meta, shared_prefix_blocks=k)``
      declares it instead (no device read).
    - ``blocks_per_split``: the split size of the ``batch_invariant`` mode (default 16 blocks).
    - ``min_prefix_tokens``: a shared prefix (found or declared) shorter than this runs as a
      normal batch, without the cascade pass (default 256 tokens).
    """

    name = "triton-splitkv"
    capabilities = dataclasses.replace(TritonUnifiedBackend.capabilities)

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
        if split_kv not in ("auto", True, False):
            raise InputError(f"split_kv is {split_kv!r}; accepted: 'auto', True or False")
        if num_splits is not None and (not isinstance(num_splits, int) or num_splits < 1):
            raise InputError(f"num_splits is {num_splits!r}; accepted: None or an int >= 1")
        if not isinstance(blocks_per_split, int) or blocks_per_split < 1:
            raise InputError(f"blocks_per_split is {blocks_per_split!r}; accepted: an int >= 1")
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
            self.capabilities = dataclasses.replace(
                self.capabilities, batch_invariant=True, mixed_batches=False
            )

    def _plan(self, meta: BatchMeta, *, shared_prefix_blocks: int | None = None, **layer) -> TritonPlan:
        """Once per step (``plan(meta, ...)`` checks the layer keywords, then calls this). With
        ``cascade=True`` and no declared prefix, reads the block table from the device (a sync)
        to find the shared prefix; declare it to avoid that. The prefix is read through the
        first request with keys (found on the host: from the batch's host mirror, or from the
        device with the table); a declared prefix without host mirrors is read through row 0,
        which must then hold it. The layer keywords are unused."""
        prefix, row = 0, 0
        if shared_prefix_blocks is not None:
            prefix = shared_prefix_blocks
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
        if type(plan) is not TritonPlan:  # a BatchMeta, or another backend's plan of one
            plan = self._triton_plan(plan)
        meta = plan.meta
        kv = dict(k_scale=cache.k_scale, v_scale=cache.v_scale, lse=lse, softcap=softcap, sinks=sinks)
        if plan.prefix_blocks and not window:
            # Recorded like every other path: the recording keeps the partials the first layer
            # allocated, and the other layers replay the suffix pass, the prefix pass and the merge
            # in order on the current stream (the first layer, and a CUDA-graph capture, run the
            # two passes on two streams).
            call: Callable[[], object] = lambda: cascade_attention(  # noqa: E731
                q, cache.k, cache.v, out, query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
                block_table=meta.block_table, prefix_blocks=plan.prefix_blocks, prefix_row=plan.prefix_row,
                max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len, scale=scale, **kv,
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
                    q, cache.k, cache.v, out, seq_lens=meta.seq_lens, block_table=meta.block_table,
                    max_seq_len=meta.max_seq_len, scale=scale, num_splits=num_splits, window=window,
                    blocks_per_split=self.blocks_per_split, **kv,
                )
                return
        unified_attention(
            q, cache.k, cache.v, out, query_start_loc=meta.query_start_loc, seq_lens=meta.seq_lens,
            block_table=meta.block_table, max_query_len=meta.max_query_len, max_seq_len=meta.max_seq_len,
            scale=scale, window=window, **kv, check=False,  # checked by Backend.forward
        )


def _first_with_keys(seq_lens_cpu) -> int:
    """The first request with seq_len > 0 (0 when there is none)."""
    return int((seq_lens_cpu > 0).int().argmax()) if seq_lens_cpu.numel() else 0


def _shared_prefix(meta: BatchMeta) -> int:
    return shared_prefix_blocks(meta.block_table, meta.seq_lens, meta.block_size)
