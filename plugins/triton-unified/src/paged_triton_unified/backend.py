"""The ``triton-unified`` backend: the launcher of :mod:`.launch` behind the paged contract."""

from __future__ import annotations

import importlib.util
import os

from paged_core import KV_DTYPES, AttentionSpec, Backend, Capabilities

from . import kernels
from .launch import SUPPORTED_BLOCK_SIZES, SUPPORTED_DTYPES, SUPPORTED_HEAD_DIMS, unified_attention
from .write import write_checked

__all__ = ["TritonBackend", "TritonUnifiedBackend", "interpreter_reasons"]


def interpreter_reasons(spec: AttentionSpec) -> list[str]:
    """Triton runs on the CPU only through its interpreter, which must be on before import:
    Triton picks interpreter or compiler when a kernel is defined (``kernels.INTERPRET``, read
    at import), not when it runs, and setting TRITON_INTERPRET=1 later ends in "0 active
    drivers" on a CPU."""
    if spec.device_type != "cpu" or kernels.INTERPRET:
        return []
    if os.environ.get("TRITON_INTERPRET") == "1":
        return ["TRITON_INTERPRET=1 was set after the Triton kernels were imported, and Triton reads it "
                "when they are defined: set it before the first use of the backend (in the shell, or "
                "at the top of the script)"]
    return ["Triton runs on the CPU only under its interpreter: set TRITON_INTERPRET=1 (slow; for tests)"]


class TritonBackend(Backend):
    """What every Triton backend shares: needs the ``triton`` package, and on the CPU its
    interpreter (``TRITON_INTERPRET=1`` set before import)."""

    @classmethod
    def unavailable(cls) -> list[str]:
        if importlib.util.find_spec("triton") is None:
            return ["triton is not installed (pip install 'paged-core[triton]')"]
        return []

    def extra_reasons(self, spec: AttentionSpec) -> list[str]:
        return interpreter_reasons(spec)

    def _write(self, cache, k, v, slot_mapping) -> None:
        # One Triton launch (quantization included) with a few microseconds of host work,
        # instead of paged_core.write_kv's several PyTorch ops; the same checks and bytes.
        write_checked(cache, k, v, slot_mapping)


class TritonUnifiedBackend(TritonBackend):
    """One launch per layer for the whole batch: prefill chunks, prompts, decodes, verification.

    The GROUP query heads sharing a KV head are packed into the rows of each tile, so every K/V
    block is read once per group; the grid covers only the batch's real query tiles. No host
    synchronisation: ``forward`` can be captured in a CUDA graph (after a first, autotuning call).
    """

    name = "triton-unified"
    capabilities = Capabilities(
        head_dims=frozenset(SUPPORTED_HEAD_DIMS),
        block_sizes=frozenset(SUPPORTED_BLOCK_SIZES),
        kv_dtypes=frozenset(KV_DTYPES),
        dtypes=frozenset(SUPPORTED_DTYPES),
        devices=frozenset({"cpu", "cuda"}),
        sliding_window=True,
        softcap=True,
        sinks=True,
        returns_lse=True,
        cuda_graphs=True,
        # Tile sizes follow the batch's shape class (decode vs mixed), so a request's rounding
        # can change with its neighbours: close, not bitwise. triton-splitkv offers a bitwise mode.
        batch_invariant=False,
    )

    def _forward(self, q, cache, plan, *, out, lse, scale, window, softcap, sinks) -> None:
        meta = plan
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
            softcap=softcap,
            sinks=sinks,
            k_scale=cache.k_scale,
            v_scale=cache.v_scale,
            lse=lse,
            check=False,  # Backend.forward checked the contract; the default config has >= 16 rows
        )
