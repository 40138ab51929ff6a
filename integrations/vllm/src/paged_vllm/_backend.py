"""vLLM's attention backend interface over one paged backend, in vLLM's ``CUSTOM`` slot.

vLLM asks an attention backend for four things, each answered from paged's contract:

- **what it supports** (``validate_configuration`` and the ``supports_*``/``get_supported_*``
  class methods): the paged backend's ``capabilities`` and ``reasons(spec)``, plus what vLLM
  can ask for that paged does not model (MLA, sparse, encoder attention, ALiBi, int4 caches);
- **a metadata builder**: vLLM's ``CommonAttentionMetadata`` becomes a ``BatchMeta`` (views of
  vLLM's tensors, :mod:`paged_vllm._meta`) and one ``backend.plan(meta, **layer)`` per step,
  shared by every layer of the KV cache group;
- **an implementation** whose ``forward`` writes the step's K/V with ``backend.write`` and reads
  with ``backend.forward``, on vLLM's own pool wrapped in a ``paged_core.KVCache`` (views, no copy);
- **a cache layout**: vLLM lays each layer out as logical ``[num_blocks, num_kv_heads,
  block_size, 2 * head_size]`` (K then V along the last dimension), in a physical order that
  0.26 takes from ``get_kv_cache_stride_order`` (NHD here) and 0.32 resolves from the backends'
  ``supported_kv_cache_layouts``. paged reads and writes any strides with a
  dense head dimension, so every layout serves, and vLLM's default (NHD, paged's own) is kept.
  vLLM's fp8 caches (``kv_cache_dtype="fp8"`` / ``"fp8_e4m3"``, and ``"fp8_e5m2"``: codes in
  uint8 storage, value = code * the layer's ``_k_scale`` / ``_v_scale``) are paged fp8 / fp8_e5m2
  caches with static per-tensor scales (``paged_core.static_scale`` views of the layer's scale
  tensors).

The paged backend is chosen by name with ``PAGED_VLLM_BACKEND`` (default ``triton-unified``),
read when vLLM first asks for the backend in a process; every layer shares one instance.
"""

from __future__ import annotations

import collections
import dataclasses
import os
import threading
from typing import Any, ClassVar

import torch
from paged_core import (
    QUANT_FORMATS,
    AttentionSpec,
    Backend,
    BackendNotFoundError,
    BackendUnavailableError,
    BatchMeta,
    InputError,
    KVCache,
    KVDtype,
    PagedError,
    UnsupportedSpecError,
    registry,
    static_scale,
)
from vllm.config import VllmConfig, get_layers_from_vllm_config
from vllm.logger import init_logger
from vllm.model_executor.layers.attention import Attention
from vllm.v1.attention.backend import (
    AttentionBackend,
    AttentionCGSupport,
    AttentionImpl,
    AttentionMetadataBuilder,
    AttentionType,
    CommonAttentionMetadata,
    MultipleOf,
)

from ._meta import batch_meta_from_vllm

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_BACKEND",
    "ENUM_NAME",
    "PagedAttentionBackend",
    "PagedAttentionImpl",
    "PagedAttentionMetadata",
    "PagedMetadataBuilder",
    "counters",
    "paged_backend",
]

#: The member of vLLM's ``AttentionBackendEnum`` the backend takes (``--attention-backend CUSTOM``).
#: Not a new name (``register_backend("PAGED", ...)``): vLLM pickles its configuration to the
#: engine-core process by the member's value, and a spawned process unpickles it before it loads
#: any plugin, so only a member that exists without the plugin survives the trip.
ENUM_NAME = "CUSTOM"
#: The environment variable naming the paged backend (a ``paged_core.registry`` name).
BACKEND_ENV = "PAGED_VLLM_BACKEND"
DEFAULT_BACKEND = "triton-unified"

#: Calls this process made into paged: ``plan`` (once per step and KV cache group), ``write``
#: and ``forward`` (once per layer and step). vLLM names no backend in its outputs, so this is
#: how a caller sees that attention ran here.
counters: collections.Counter[str] = collections.Counter()

# Under "vllm.": vLLM configures its own loggers only, so this one prints where vLLM's do.
_log = init_logger("vllm.paged_vllm")
_INSTANCES: dict[str, Backend] = {}
_LOCK = threading.Lock()


def paged_backend(name: str | None = None) -> Backend:
    """The process's instance of paged backend ``name`` (default: ``$PAGED_VLLM_BACKEND``, else
    ``triton-unified``). One that cannot run here is a ``PagedError`` that names it, where its
    name came from, what installs or enables it, and the backends that would run instead."""
    chosen = name or os.environ.get(BACKEND_ENV)
    name = chosen or DEFAULT_BACKEND
    with _LOCK:
        if name not in _INSTANCES:
            try:
                _INSTANCES[name] = registry.get(name)
            except (BackendNotFoundError, BackendUnavailableError) as exc:
                # vLLM reports this from its engine process, after a traceback: the message must
                # carry the whole fix, including that the name may be a default nobody chose.
                source = f"{BACKEND_ENV}={name}" if chosen else f"{BACKEND_ENV} is unset: the default"
                runnable = [n for n in registry.names() if not registry.unavailable(n)]
                raise type(exc)(
                    f"paged-vllm cannot serve --attention-backend {ENUM_NAME} with paged backend {name!r} "
                    f"({source}). {exc}\nOr set {BACKEND_ENV} to a backend that runs here: "
                    f"{', '.join(runnable) or 'none'}."
                ) from exc
        return _INSTANCES[name]


def _device_type() -> str:
    from vllm.platforms import current_platform

    return str(current_platform.device_type)


def cudagraph_support(backend: Backend) -> AttentionCGSupport:
    """vLLM's full-CUDA-graph level for ``backend``: ``UNIFORM_SINGLE_TOKEN_DECODE`` (graphs of
    decode batches) when its capabilities claim CUDA graphs and it writes K/V with its own
    kernel, else ``NEVER``. Not ``ALWAYS``: a capture fixes what the backend chose from the
    captured batch's host ints (triton-unified's tile classes from ``max_query_len``, its split
    count from ``max_seq_len``), which holds for every batch of the captured shape only when that
    shape is "one token per request".

    The write counts because vLLM's pool has no block past its last one: ``paged_core.write_kv``
    (the default ``Backend._write``) then filters the padding slots on the host, a sync that a
    capture refuses. ``NEVER`` still lets vLLM capture the rest of the model piecewise, with
    attention running eagerly between the pieces.
    """
    if backend.capabilities.cuda_graphs and backend.writes_on_device:
        return AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE
    return AttentionCGSupport.NEVER


#: vLLM's fp8 caches with per-tensor scales: vLLM name -> paged kv_dtype (its static scales).
FP8_CACHE_DTYPES: dict[str, KVDtype] = {"fp8": "fp8", "fp8_e4m3": "fp8", "fp8_e5m2": "fp8_e5m2"}
#: vLLM's caches with one scale per (token, KV head), stored inline after each head's codes:
#: paged's per-slot scales. vLLM name -> paged kv_dtype.
PER_TOKEN_HEAD_DTYPES: dict[str, KVDtype] = {"int8_per_token_head": "int8", "fp8_per_token_head": "fp8"}
#: Bytes of one inline scale (float32), after the codes of each (slot, head) and side.
_SCALE_BYTES = 4


class PagedAttentionBackend(AttentionBackend):
    """vLLM's ``AttentionBackend`` for the paged backend named by ``$PAGED_VLLM_BACKEND``."""

    # The write goes through backend.write inside forward, with the step's BatchMeta.
    forward_includes_kv_cache_update: bool = True
    supported_dtypes: ClassVar[list[torch.dtype]] = [torch.float16, torch.bfloat16, torch.float32]
    # vLLM's fp8 caches: e4m3 or e5m2 codes with one static scale per tensor (paged's static scales);
    # its per-token-head caches: one scale per (slot, KV head), paged's own format.
    supported_kv_cache_dtypes: ClassVar[list[Any]] = ["auto", *FP8_CACHE_DTYPES, *PER_TOKEN_HEAD_DTYPES]

    @classmethod
    def customize_spec(cls, spec: Any) -> Any:
        """Per-token-head caches pack a float32 scale after each head's codes, K side and V side
        (vLLM's own layout for them: ``[K(hs) | scale | V(hs) | scale]`` per slot and head)."""
        mode = getattr(spec, "kv_quant_mode", None)
        if (
            getattr(spec, "state_content_bytes", None) is not None
            or mode is None
            or not getattr(mode, "is_per_token_head", False)
            or mode.name.startswith("INT4")
        ):
            return spec
        elem = torch.empty((), dtype=spec.dtype).element_size()
        content = (spec.head_size + spec.head_size_v) * elem + 2 * _SCALE_BYTES
        return dataclasses.replace(spec, state_content_bytes=content)

    @staticmethod
    def get_kv_cache_shape(
        num_blocks: int, block_size: int, num_kv_heads: int, head_size: int, cache_dtype_str: str = "auto"
    ) -> tuple[int, ...]:
        """vLLM 0.26 asks each backend for its cache's logical shape (0.32 no longer does): the
        one vLLM's own Triton backend uses, ``[num_blocks, num_kv_heads, block_size, 2 * width]``,
        K then V along the last dimension; a per-token-head cache widens each side by the 4 bytes
        of its inline float32 scale (int8 and fp8 codes are one byte each)."""
        width = head_size + _SCALE_BYTES if cache_dtype_str in PER_TOKEN_HEAD_DTYPES else head_size
        return (num_blocks, num_kv_heads, block_size, 2 * width)

    @staticmethod
    def get_kv_cache_stride_order(include_num_layers_dimension: bool = False) -> tuple[int, ...]:
        """vLLM 0.26's physical order of that shape: NHD, paged's own layout (a slot's heads
        side by side), with a layers dimension after the blocks when vLLM asks for one."""
        return (1, 0, 3, 2, 4) if include_num_layers_dimension else (0, 2, 1, 3)

    @staticmethod
    def get_name() -> str:
        return ENUM_NAME

    @staticmethod
    def get_impl_cls() -> type[PagedAttentionImpl]:
        return PagedAttentionImpl

    @staticmethod
    def get_builder_cls() -> type[PagedMetadataBuilder]:
        return PagedMetadataBuilder

    @staticmethod
    def get_supported_kernel_block_sizes(kv_cache_spec: Any = None) -> list[int | MultipleOf]:
        sizes = paged_backend().capabilities.block_sizes
        return [MultipleOf(1)] if sizes is None else sorted(sizes)

    @classmethod
    def get_supported_head_sizes(cls) -> list[int]:
        dims = paged_backend().capabilities.head_dims
        return [] if dims is None else sorted(dims)

    @classmethod
    def supports_dtype(cls, dtype: torch.dtype) -> bool:
        return dtype in paged_backend().capabilities.dtypes

    @classmethod
    def supports_sliding_window(cls) -> bool:
        return paged_backend().capabilities.sliding_window

    @classmethod
    def supports_sink(cls) -> bool:
        return paged_backend().capabilities.sinks

    @classmethod
    def supports_batch_invariance(cls) -> bool:
        return paged_backend().capabilities.batch_invariant

    @classmethod
    def supported_kv_cache_layouts(cls) -> None:
        # Any: the K and V views are read and written through their strides.
        return None

    @classmethod
    def validate_configuration(  # type: ignore[override]
        cls,
        head_size: int,
        dtype: torch.dtype,
        kv_cache_dtype: Any,
        block_size: int | None,
        use_mla: bool,
        has_sink: bool,
        use_sparse: bool,
        use_mm_prefix: bool,
        use_per_head_quant_scales: bool,
        device_capability: Any,
        attn_type: str,
        has_sliding_window: bool = False,
        use_non_causal: bool = False,
        use_batch_invariant: bool = False,
        use_kv_connector: bool = False,
        use_pcp: bool = False,
        use_adaptive_verification: bool = False,
        use_dcp: bool = False,
        use_rswa: bool = False,
    ) -> list[str]:
        """The paged backend's reasons for this configuration, then what vLLM asks beyond paged."""
        try:
            backend = paged_backend()
        except PagedError as exc:
            return [str(exc)]
        if block_size is None:  # vLLM picks one later from get_supported_kernel_block_sizes
            sizes = backend.capabilities.block_sizes
            block_size = 16 if sizes is None or 16 in sizes else min(sizes)
        # The head counts are not known yet (the builder checks each layer's); one head per KV head
        # asks only about what is known.
        spec = AttentionSpec(
            num_heads=1,
            num_kv_heads=1,
            head_dim=head_size,
            block_size=block_size,
            dtype=dtype,
            kv_dtype=_paged_kv_dtype(kv_cache_dtype),
            kv_scales=_paged_kv_scales(kv_cache_dtype),
            window=1 if has_sliding_window else 0,
            sinks=has_sink,
            device=_device_type(),
        )
        reasons = [f"{backend.name}: {r}" for r in backend.reasons(spec)]
        reasons += _vllm_reasons(kv_cache_dtype=kv_cache_dtype, attn_type=attn_type)
        beyond = [
            (use_mla, "MLA (latent attention) is not supported"),
            (use_sparse, "sparse attention is not supported"),
            (use_mm_prefix, "bidirectional multimodal prefixes are not supported (paged is causal)"),
            (use_per_head_quant_scales, "per-head quantization scales are not supported"),
            (use_non_causal, "non-causal attention is not supported (paged is causal)"),
            (
                use_batch_invariant and not backend.capabilities.batch_invariant,
                f"batch invariance is not claimed by {backend.name}",
            ),
            (use_pcp, "prefill context parallelism is not supported"),
            (use_dcp, "decode context parallelism is not supported"),
            (use_rswa, "R-SWA is not supported"),
            (
                use_adaptive_verification,
                "adaptive verification (device query lengths below the host's) is not supported",
            ),
        ]
        return reasons + [r for on, r in beyond if on]


def _paged_kv_scales(kv_cache_dtype: Any) -> str:
    """paged's ``kv_scales`` of vLLM's ``kv_cache_dtype``: per tensor for its fp8 caches."""
    return "per_tensor" if kv_cache_dtype in FP8_CACHE_DTYPES else "per_slot"


def _paged_kv_dtype(kv_cache_dtype: Any) -> KVDtype:
    """paged's ``kv_dtype`` for vLLM's ``kv_cache_dtype`` (an unsupported one: "auto", with the
    reason from :func:`_vllm_reasons`)."""
    if kv_cache_dtype in FP8_CACHE_DTYPES:
        return FP8_CACHE_DTYPES[kv_cache_dtype]
    return PER_TOKEN_HEAD_DTYPES.get(kv_cache_dtype, "auto")


def _vllm_reasons(
    *,
    kv_cache_dtype: Any,
    attn_type: str,
    alibi: bool = False,
    head_size_v: int | None = None,
    head_size: int | None = None,
    extra: tuple[str, ...] = (),
) -> list[str]:
    """What a vLLM layer can ask for that no paged backend computes, as sentences."""
    out = []
    if kv_cache_dtype not in (None, "auto", *FP8_CACHE_DTYPES, *PER_TOKEN_HEAD_DTYPES):
        out.append(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; accepted: 'auto', 'fp8' / "
            "'fp8_e4m3', 'fp8_e5m2' (codes with vLLM's per-tensor scales, paged's static scales), "
            "'int8_per_token_head', 'fp8_per_token_head' (paged's per-slot scales)"
            + (
                " (vLLM's int4 cache rotates each head vector by a Hadamard transform and stores "
                "asymmetric codes with zero points; paged's int4 is symmetric and unrotated)"
                if kv_cache_dtype == "int4_per_token_head"
                else ""
            )
        )
    if attn_type != AttentionType.DECODER:
        out.append(f"attention type {attn_type!r} is not supported; accepted: {AttentionType.DECODER.value!r}")
    if alibi:
        out.append("ALiBi slopes are not supported")
    if head_size_v is not None and head_size is not None and head_size_v != head_size:
        out.append(f"a value head size {head_size_v} other than the key head size {head_size} is not supported")
    out += [f"the attention argument {name!r} is not supported" for name in extra]
    return out


@dataclasses.dataclass
class PagedAttentionMetadata:
    """One step of one KV cache group: the batch, and a plan per distinct layer description."""

    meta: BatchMeta
    #: layer description (``PagedAttentionImpl.layer_key``) -> ``backend.plan(meta, **layer)``.
    plans: dict[tuple, Any]
    num_actual_tokens: int


class PagedMetadataBuilder(AttentionMetadataBuilder[PagedAttentionMetadata]):
    """``CommonAttentionMetadata`` -> ``BatchMeta`` and the step's plans, once per step."""

    def __init__(
        self, kv_cache_spec: Any, layer_names: list[str], vllm_config: VllmConfig, device: torch.device
    ) -> None:
        super().__init__(kv_cache_spec, layer_names, vllm_config, device)
        self.backend = paged_backend()
        self.block_size = int(kv_cache_spec.block_size)
        layers = get_layers_from_vllm_config(vllm_config, Attention, layer_names)
        # Every layer of the group is checked here, before vLLM runs a step, so an unsupported
        # layer is one error naming it instead of a failure inside a forward.
        reasons = []
        self.layers: dict[tuple, dict[str, Any]] = {}
        for name, layer in layers.items():
            impl = layer.impl
            if not isinstance(impl, PagedAttentionImpl):
                continue
            found = impl.reasons(self.block_size, device.type, head_size_v=getattr(layer, "head_size_v", None))
            reasons += [f"layer {name!r}: {r}" for r in found]
            self.layers[impl.layer_key] = impl.layer_description()
        if reasons:
            raise UnsupportedSpecError(self.backend.name, reasons)
        # vLLM's CPU platform logs "Cannot use AttentionBackendEnum.CUSTOM backend on CPU" before resolving CPU_ATTN to
        # this backend (paged_vllm._cpu); this line says what actually serves the layers.
        _log.info(
            "paged-vllm: %d attention layer(s) of this KV cache group run on paged backend %r (block_size %d)",
            len(layers),
            self.backend.name,
            self.block_size,
        )

    @classmethod
    def get_cudagraph_support(cls, vllm_config: VllmConfig, kv_cache_spec: Any) -> AttentionCGSupport:
        return cudagraph_support(paged_backend())

    def build(
        self, common_prefix_len: int, common_attn_metadata: CommonAttentionMetadata, fast_build: bool = False
    ) -> PagedAttentionMetadata:
        meta = batch_meta_from_vllm(common_attn_metadata, self.block_size)
        plans = {key: self.backend.plan(meta, **layer) for key, layer in self.layers.items()}
        counters["plan"] += len(plans)
        return PagedAttentionMetadata(
            meta=meta, plans=plans, num_actual_tokens=int(common_attn_metadata.num_actual_tokens)
        )


class PagedAttentionImpl(AttentionImpl[PagedAttentionMetadata]):
    """One layer: ``backend.write`` then ``backend.forward`` on the layer's part of vLLM's pool."""

    def __init__(
        self,
        num_heads: int,
        head_size: int,
        scale: float,
        num_kv_heads: int | None = None,
        alibi_slopes: list[float] | None = None,
        sliding_window: int | None = None,
        kv_cache_dtype: str = "auto",
        logits_soft_cap: float | None = None,
        attn_type: str = AttentionType.DECODER,
        kv_sharing_target_layer_name: str | None = None,
        sinks: torch.Tensor | None = None,
        **extra: Any,
    ) -> None:
        self.backend = paged_backend()
        self.num_heads = num_heads
        self.head_size = head_size
        self.scale = float(scale)
        self.num_kv_heads = num_kv_heads or num_heads
        self.alibi_slopes = alibi_slopes
        self.sliding_window = int(sliding_window or 0)
        self.kv_cache_dtype = kv_cache_dtype
        self.logits_soft_cap = float(logits_soft_cap or 0.0)
        self.attn_type = attn_type
        self.kv_sharing_target_layer_name = kv_sharing_target_layer_name
        self.sinks = sinks
        self._sinks32: torch.Tensor | None = None
        self.extra = tuple(sorted(extra))
        # vLLM builds its layers under the model dtype as torch's default dtype.
        self.dtype = torch.get_default_dtype()
        # (vLLM's cache tensor, the paged view of it): vLLM binds one tensor per layer.
        self._cache: tuple[torch.Tensor, KVCache] | None = None

    # ----------------------------------------------------------------------------- checks
    def spec(self, block_size: int, device: str) -> AttentionSpec:
        return AttentionSpec(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size,
            block_size=block_size,
            dtype=self.dtype,
            kv_dtype=_paged_kv_dtype(self.kv_cache_dtype),
            kv_scales=_paged_kv_scales(self.kv_cache_dtype),
            window=self.sliding_window,
            softcap=self.logits_soft_cap,
            sinks=self.sinks is not None,
            device=device,
        )

    def reasons(self, block_size: int, device: str, *, head_size_v: int | None = None) -> list[str]:
        """Every reason this layer cannot run on the paged backend (empty: it can)."""
        out = _vllm_reasons(
            kv_cache_dtype=self.kv_cache_dtype,
            attn_type=self.attn_type,
            alibi=self.alibi_slopes is not None,
            head_size_v=head_size_v,
            head_size=self.head_size,
            extra=self.extra,
        )
        return out + self.backend.reasons(self.spec(block_size, device))

    @property
    def layer_key(self) -> tuple:
        return (
            self.num_heads,
            self.num_kv_heads,
            self.head_size,
            self.sliding_window,
            self.logits_soft_cap,
            self.scale,
            self.kv_cache_dtype,
        )

    def layer_description(self) -> dict[str, Any]:
        """The keywords ``backend.plan`` takes for this layer."""
        return dict(
            num_heads=self.num_heads,
            num_kv_heads=self.num_kv_heads,
            head_dim=self.head_size,
            dtype=self.dtype,
            kv_dtype=_paged_kv_dtype(self.kv_cache_dtype),
            kv_scales=_paged_kv_scales(self.kv_cache_dtype),
            window=self.sliding_window,
            softcap=self.logits_soft_cap,
            scale=self.scale,
        )

    def process_weights_after_loading(self, act_dtype: torch.dtype) -> None:
        self.dtype = act_dtype

    # ----------------------------------------------------------------------------- per step
    def forward(
        self,
        layer: Any,
        query: torch.Tensor,  # [num_tokens, num_heads, head_size]
        key: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_size]
        value: torch.Tensor | None,  # [num_tokens, num_kv_heads, head_size]
        kv_cache: torch.Tensor,  # [num_blocks, num_kv_heads, block_size, 2 * head_size] (logical)
        attn_metadata: PagedAttentionMetadata | None,
        output: torch.Tensor,  # [num_tokens, num_heads, head_size]
        output_scale: torch.Tensor | None = None,
        output_block_scale: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if output_scale is not None or output_block_scale is not None:
            raise UnsupportedSpecError(
                self.backend.name,
                [f"layer {getattr(layer, 'layer_name', '?')!r}: fused output quantization is not supported"],
            )
        if attn_metadata is None:  # vLLM's profiling and warm-up runs have no batch
            return output
        n = attn_metadata.num_actual_tokens
        meta = attn_metadata.meta
        plan = attn_metadata.plans[self.layer_key]
        cache = self._view(kv_cache, layer)
        # A layer sharing an earlier layer's cache (kv_sharing_target_layer_name) only reads it.
        if key is not None and value is not None and self.kv_sharing_target_layer_name is None:
            self.backend.write(cache, key[:n], value[:n], meta)
            counters["write"] += 1
        self.backend.forward(
            query[:n],
            cache,
            plan,
            scale=self.scale,
            window=self.sliding_window,
            softcap=self.logits_soft_cap,
            sinks=self._sinks(),
            out=output[:n],
        )
        counters["forward"] += 1
        return output

    def _sinks(self) -> torch.Tensor | None:
        # paged takes float32 sinks; vLLM's are model weights, loaded after __init__.
        if self.sinks is None:
            return None
        if self._sinks32 is None or self._sinks32.device != self.sinks.device:
            self._sinks32 = self.sinks.detach().float()
        return self._sinks32

    # vLLM's clear_layer_kv_caches (its teardown, and the end of its memory profiling) unbinds
    # the KV cache tensors from the layers and sets ``impl._k_scale_cache = None`` on each impl
    # that has one, to drop the impl's views of the pool. The cached view here holds the pool's
    # storage too: it is dropped the same way, so that memory is freed when vLLM frees it.
    @property
    def _k_scale_cache(self) -> None:
        return None

    @_k_scale_cache.setter
    def _k_scale_cache(self, value: Any) -> None:
        if value is None:
            self._cache = None

    def _view(self, kv_cache: torch.Tensor, layer: Any) -> KVCache:
        cached = self._cache
        if cached is not None and cached[0] is kv_cache:
            return cached[1]
        scales = None
        if self.kv_cache_dtype in FP8_CACHE_DTYPES:
            scales = (
                _layer_scale(layer, "_k_scale", kv_cache.device),
                _layer_scale(layer, "_v_scale", kv_cache.device),
            )
        if self.kv_cache_dtype in PER_TOKEN_HEAD_DTYPES:
            view = per_token_head_view(
                kv_cache, self.head_size, PER_TOKEN_HEAD_DTYPES[self.kv_cache_dtype], dtype=self.dtype
            )
        else:
            view = pool_view(
                kv_cache,
                self.head_size,
                dtype=self.dtype,
                scales=scales,
                kv_dtype=FP8_CACHE_DTYPES.get(self.kv_cache_dtype, "fp8"),
            )
        self._cache = (kv_cache, view)
        return view


def per_token_head_view(kv_cache: torch.Tensor, head_size: int, kv_dtype: str, *, dtype: torch.dtype) -> KVCache:
    """vLLM's per-token-head cache ``[num_blocks, num_kv_heads, block_size, 2 * (head_size + 4)]``
    (logical; int8, or uint8 for fp8 codes): per (block, head, slot) ``[K codes | K scale | V codes
    | V scale]``, each scale one float32 in the 4 bytes after its codes. As a paged ``KVCache``:
    NHD views of the codes and float32 views of the inline scales, ``[num_blocks, block_size,
    num_kv_heads]`` with the pool's strides (per-slot scales, which paged's writes set).

    >>> pool = torch.zeros(3, 2, 16, 2 * (32 + 4), dtype=torch.int8)
    >>> cache = per_token_head_view(pool, 32, "int8", dtype=torch.bfloat16)
    >>> tuple(cache.k_scale.shape), cache.k_scale.stride(), cache.static_scales
    ((3, 16, 2), (576, 18, 288), False)
    """
    code_dtype = {"int8": torch.int8, "fp8": torch.uint8}[kv_dtype]
    width = 2 * (head_size + _SCALE_BYTES)
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != width or kv_cache.stride(-1) != 1 or kv_cache.dtype != code_dtype:
        raise InputError(
            f"vLLM's {kv_dtype} per-token-head KV cache of this layer is {kv_cache.dtype} "
            f"{list(kv_cache.shape)} with strides {kv_cache.stride()}; accepted: {code_dtype} "
            f"[num_blocks, num_kv_heads, block_size, 2 * ({head_size} + 4)] with the last dimension contiguous"
        )
    strides, offset = kv_cache.stride(), kv_cache.storage_offset()
    if any(st % _SCALE_BYTES for st in strides[:3]) or (offset + head_size) % _SCALE_BYTES:
        raise InputError(
            f"vLLM's per-token-head KV cache has strides {strides} and offset {offset}; accepted: "
            "multiples of 4 bytes, so that each inline float32 scale is aligned"
        )
    nhd = kv_cache.transpose(1, 2)
    if kv_dtype == "fp8":
        nhd = nhd.view(torch.float8_e4m3fn)
    k, v = nhd[..., :head_size], nhd[..., head_size + _SCALE_BYTES : 2 * head_size + _SCALE_BYTES]
    words = torch.empty(0, dtype=torch.float32, device=kv_cache.device).set_(kv_cache.untyped_storage())
    n_blocks, heads, block_size = kv_cache.shape[:3]

    def scales(at: int) -> torch.Tensor:
        return torch.as_strided(
            words,
            (n_blocks, block_size, heads),
            (strides[0] // 4, strides[2] // 4, strides[1] // 4),
            (offset + at) // 4,
        )

    return KVCache(
        k=k,
        v=v,
        kv_dtype=kv_dtype,
        dtype=dtype,
        k_scale=scales(head_size),
        v_scale=scales(2 * head_size + _SCALE_BYTES),
    )


def _layer_scale(layer: Any, name: str, device: torch.device) -> torch.Tensor:
    """The layer's per-tensor fp8 scale (float32, one value) on the cache's device: vLLM's own
    tensor when it lives there, so a scale vLLM calibrates in place is the cache's."""
    scale = getattr(layer, name, None)
    if not isinstance(scale, torch.Tensor):
        raise InputError(
            f"layer {getattr(layer, 'layer_name', '?')!r} has no {name} tensor; an fp8 cache "
            "needs vLLM's per-tensor scales (vLLM's Attention layer sets them)"
        )
    if scale.dtype != torch.float32 or scale.device != device:
        scale = scale.to(device=device, dtype=torch.float32)
    return scale


#: The code dtype of each paged format a vLLM fp8 cache with per-tensor scales is viewed as.
_FP8_CODES = {name: QUANT_FORMATS[name][0] for name in ("fp8", "fp8_e5m2")}


def pool_view(
    kv_cache: torch.Tensor,
    head_size: int,
    *,
    dtype: torch.dtype | None = None,
    scales: tuple[torch.Tensor, torch.Tensor] | None = None,
    kv_dtype: str = "fp8",
) -> KVCache:
    """vLLM's per-layer cache ``[num_blocks, num_kv_heads, block_size, 2 * head_size]`` (logical;
    K in the first ``head_size`` of the last dimension, V in the rest) as a paged ``KVCache``:
    two NHD views, no copy, whatever physical order vLLM resolved.

    With ``scales`` (vLLM's ``layer._k_scale``, ``layer._v_scale``: one float32 value each) the
    cache holds ``kv_dtype`` codes ("fp8": vLLM's uint8 storage seen as ``float8_e4m3fn``;
    "fp8_e5m2": as ``float8_e5m2``) of the model ``dtype`` with those as static scales.

    >>> pool = torch.zeros(4, 2, 16, 64)                      # HND storage, head_size 32
    >>> cache = pool_view(pool, 32)
    >>> tuple(cache.k.shape), cache.k.stride(), cache.v.data_ptr() - cache.k.data_ptr()
    ((4, 16, 2, 32), (2048, 64, 1024, 1), 128)
    >>> fp8 = pool_view(torch.zeros(4, 2, 16, 64, dtype=torch.uint8), 32, dtype=torch.bfloat16,
    ...                 scales=(torch.tensor(0.5), torch.tensor(0.25)))
    >>> fp8.kv_dtype, fp8.k.dtype, fp8.static_scales, fp8.v_scale[3, 7].tolist()
    ('fp8', torch.float8_e4m3fn, True, [0.25, 0.25])
    >>> pool_view(torch.zeros(4, 2, 16, 64, dtype=torch.uint8), 32, scales=(torch.tensor(0.5), torch.tensor(0.25)),
    ...           kv_dtype="fp8_e5m2").k.dtype
    torch.float8_e5m2
    """
    if kv_cache.dim() != 4 or kv_cache.shape[-1] != 2 * head_size or kv_cache.stride(-1) != 1:
        raise InputError(
            f"vLLM's KV cache of this layer is {list(kv_cache.shape)} with strides {kv_cache.stride()}; "
            f"accepted: [num_blocks, num_kv_heads, block_size, 2 * {head_size}] with the last dimension "
            "contiguous (the attention cache of vLLM 0.26 and 0.32; other vLLM releases are not supported)"
        )
    nhd = kv_cache.transpose(1, 2)
    if scales is None:
        return KVCache(k=nhd[..., :head_size], v=nhd[..., head_size:], kv_dtype="auto", dtype=kv_cache.dtype)
    if kv_dtype not in _FP8_CODES:
        raise InputError(
            f"kv_dtype is {kv_dtype!r}; accepted: {', '.join(map(repr, _FP8_CODES))} (the "
            "paged format of vLLM's fp8 caches with per-tensor scales)"
        )
    code_dtype = _FP8_CODES[kv_dtype]
    if kv_cache.dtype not in (torch.uint8, code_dtype):
        raise InputError(
            f"vLLM's {kv_dtype} KV cache of this layer is {kv_cache.dtype}; accepted: uint8 "
            f"storage (vLLM's fp8 caches) or {str(code_dtype).removeprefix('torch.')}"
        )
    codes = nhd.view(code_dtype)
    k, v = codes[..., :head_size], codes[..., head_size:]
    return KVCache(
        k=k,
        v=v,
        kv_dtype=kv_dtype,
        dtype=dtype or torch.bfloat16,
        k_scale=static_scale(scales[0], k, name="k_scale"),
        v_scale=static_scale(scales[1], v, name="v_scale"),
    )
