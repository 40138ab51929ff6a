"""The ``triton-unified`` backend: the launcher of :mod:`.launch` behind the paged contract."""

from __future__ import annotations

from paged_core import KV_SCALES, Capabilities
from paged_triton_common.backend import TritonBackend, kernel_k_scale

from .launch import SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, unified_attention

__all__ = ["TritonUnifiedBackend"]


class TritonUnifiedBackend(TritonBackend):
    """One launch per layer for the whole batch: prefill chunks, prompts, decodes, verification.

    The GROUP query heads sharing a KV head are packed into the rows of each tile, so every K/V
    block is read once per group; the grid covers only the batch's real query tiles. No host
    synchronisation: ``forward`` can be captured in a CUDA graph (after a first, autotuning call).
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
        device_plan=True,
        # Tile sizes follow the batch's shape class (decode vs mixed), so a request's rounding
        # can change with its neighbours: close, not bitwise. triton-splitkv offers a bitwise mode.
        batch_invariant=False,
    )

    def _forward(self, q, cache, plan, *, out, lse, scale, window, softcap, sinks) -> None:
        plan = self._triton_plan(plan)
        meta = plan.meta
        self._launch(
            plan,
            q,
            cache,
            out,
            lse,
            scale,
            window,
            softcap,
            sinks,
            lambda: unified_attention(
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
                softcap=softcap,
                sinks=sinks,
                k_scale=kernel_k_scale(cache),
                v_scale=cache.v_scale,
                lse=lse,
                check=False,  # Backend.forward checked the contract; the default config has >= 16 rows
            ),
        )
