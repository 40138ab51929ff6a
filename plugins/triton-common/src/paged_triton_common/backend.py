"""What every Triton backend shares: the backend base class and the plan whose layers repeat the
first layer's launches."""

from __future__ import annotations

import dataclasses
import importlib.util
import os
from collections.abc import Callable
from typing import Any

import torch
from paged_core import PER_CHANNEL_KEYS, AttentionSpec, Backend, BatchMeta, KVCache
from paged_core.hookspecs import pip_install

from .direct import LayerTensors, Recording
from .runtime import INTERPRET
from .write import write_checked

__all__ = ["TritonBackend", "TritonPlan", "interpreter_reasons", "kernel_k_scale"]


def kernel_k_scale(cache: KVCache) -> torch.Tensor | None:
    """``cache.k_scale`` as the kernels read it: per-channel key scales (``kivi4``: ``[num_blocks,
    num_kv_heads, head_dim]``) as a ``[num_blocks, block_size, num_kv_heads, head_dim]`` view whose
    slot stride is 0; a 4-D key scale tells the launchers the keys are scaled per channel."""
    ks = cache.k_scale
    if ks is not None and cache.kv_dtype in PER_CHANNEL_KEYS:
        ks = ks[:, None].expand(ks.shape[0], cache.block_size, *ks.shape[1:])
    return ks


#: What installs triton with the Triton backends (shown when triton is missing).
_INSTALL = pip_install("'paged-core[triton]'")

# torch.cuda.is_current_stream_capturing() without its Python wrapper (called per layer).
_capture_query = getattr(torch._C, "_cuda_isCurrentStreamCapturing", None)


def _capturing() -> bool:
    return _capture_query is not None and torch.cuda.is_initialized() and bool(_capture_query())


def interpreter_reasons(spec: AttentionSpec) -> list[str]:
    """Triton runs on the CPU only through its interpreter, which must be on before import:
    Triton picks interpreter or compiler when a kernel is defined (``runtime.INTERPRET``, read
    at import), not when it runs, and setting TRITON_INTERPRET=1 later ends in "0 active
    drivers" on a CPU."""
    return _interpreter_off() if spec.device_type == "cpu" else []


def _interpreter_off() -> list[str]:
    """Why the Triton kernels cannot run on this machine's CPU (empty: they can)."""
    if INTERPRET:
        return []
    if os.environ.get("TRITON_INTERPRET") == "1":
        return [
            "TRITON_INTERPRET=1 was set after the Triton kernels were imported, and Triton reads it "
            "when they are defined: set it before the first use of the backend (in the shell, or "
            "at the top of the script)"
        ]
    return ["Triton runs on the CPU only under its interpreter: set TRITON_INTERPRET=1 (slow; for tests)"]


@dataclasses.dataclass(eq=False)
class TritonPlan:
    """What the Triton backends' ``plan(meta)`` returns: the batch, and the launches its layers
    repeat.

    The first ``forward`` of each layer layout (shapes, strides, dtypes, pointer alignment of
    q, out and the cache) runs the launcher and records its launches
    (:class:`paged_triton_common.direct.Recording`); the step's other layers repeat them with
    their own tensors for a few microseconds of host time, and what depends only on the batch (a
    mixed batch's tile plan) runs once. A plan serves the step it was made for: after
    ``meta.copy_(step)``, plan again (a plan used after it records anew: correct, without the
    saving). Inside a CUDA-graph capture nothing is taken from or kept in the plan. The layers of
    a plan share its workspaces (split-KV partials and counters), so they run one after another
    on one stream, as a model's layers do: give concurrent streams plans of their own.
    """

    meta: BatchMeta
    #: Leading logical blocks shared by every request (triton-unified's cascade; 0: none).
    prefix_blocks: int = 0
    #: The block-table row the shared prefix is read through: a request that holds it.
    prefix_row: int = 0
    #: False for the plan a ``forward`` makes itself from a BatchMeta: it may be reused across
    #: calls whose batch tensors changed in place, so it repeats every launch.
    per_step: bool = True
    recordings: dict[tuple, Recording] = dataclasses.field(default_factory=dict, repr=False)
    #: The batch's structure check the recordings were made under: ``meta.copy_(step)`` makes
    #: the next check a new one (new host ints), and the recordings are dropped.
    generation: int = dataclasses.field(default=0, repr=False)

    def __post_init__(self) -> None:
        self.generation = self.meta._generation


class TritonBackend(Backend):
    """What every Triton backend shares: needs the ``triton`` package, and on the CPU its
    interpreter (``TRITON_INTERPRET=1`` set before import); plans whose layers repeat the first
    layer's launches (:class:`TritonPlan`)."""

    def _plan(self, meta: BatchMeta) -> TritonPlan:
        return TritonPlan(meta)

    def _triton_plan(self, plan: Any) -> TritonPlan:
        """``plan`` as a TritonPlan: for a BatchMeta (or another backend's plan), the one made
        for the last call with the same, unchanged batch; it repeats every launch, so an
        in-place edit of the batch's tensors between calls stays correct."""
        if type(plan) is TritonPlan:
            return plan
        meta = plan if isinstance(plan, BatchMeta) else plan.meta
        last = self.__dict__.get("_last_implicit")
        if last is not None and last[0] is meta and last[1] == meta._generation:
            return last[2]
        made = self._plan(meta)
        made.per_step = False
        self.__dict__["_last_implicit"] = (meta, meta._generation, made)
        return made

    def _launch(
        self,
        plan: TritonPlan,
        q: torch.Tensor,
        cache: KVCache,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
        call: Callable[[], object],
    ) -> None:
        """Run ``call()`` (the launcher) for this layer, or repeat what it launched for an earlier
        layer of the plan with this layer's tensors."""
        if _capturing():
            call()  # allocations from the graph's pool, every launch captured; nothing kept
            return
        layer = LayerTensors(
            q=q, k=cache.k, v=cache.v, out=out, k_scale=cache.k_scale, v_scale=cache.v_scale, sinks=sinks, lse=lse
        )
        # Everything a recording depends on besides the batch: the layer's shapes, strides,
        # dtypes and pointer alignment (the compiled binaries are specialised on it).
        key = (
            cache._layout,
            q.shape,
            q.stride(),
            q.data_ptr() % 16 == 0,
            out.stride(),
            out.data_ptr() % 16 == 0,
            scale,
            window,
            softcap,
            None if sinks is None else sinks.data_ptr() % 16 == 0,
            lse is None,
        )
        if plan.generation != plan.meta._generation:  # the batch was copied into or reassigned
            plan.recordings.clear()
            plan.generation = plan.meta._generation
        recording = plan.recordings.get(key)
        if recording is not None:
            recording.replay(layer, everything=not plan.per_step)
            return
        with Recording(layer) as recording:
            call()
        if recording.ok:
            plan.recordings[key] = recording

    @classmethod
    def unavailable(cls) -> list[str]:
        if importlib.util.find_spec("triton") is None:
            return [f"triton is not installed ({_INSTALL})"]
        # No GPU and no interpreter: nothing here can run the kernels, whatever the spec.
        return [] if torch.cuda.is_available() else _interpreter_off()

    def extra_reasons(self, spec: AttentionSpec) -> list[str]:
        return interpreter_reasons(spec)

    def _write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # One Triton launch (quantization included) with a few microseconds of host work,
        # instead of paged_core.write_kv's several PyTorch ops; the same checks and bytes.
        write_checked(cache, k, v, slot_mapping)
