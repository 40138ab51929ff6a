"""The attention function transformers' continuous batching calls, backed by a paged backend.

transformers looks an attention implementation up by name in ``AttentionInterface`` (its public
registry) and calls it once per layer with the packed queries, keys and values and the step's
metadata as keyword arguments. What it hands over depends on the release
(:mod:`paged_transformers._versions` has the table of releases and their hooks):

- **"pool"** (5.17, 5.18): the new K/V of the step and transformers' paged cache object
  (``cache``, ``cu_seq_lens_q``, ``cu_seq_lens_k``, ``max_seqlen_q``, ``max_seqlen_k``,
  ``read_index``, ``write_index``). A name ``paged|<anything>`` tells continuous batching that the
  function manages the cache itself; one that is not ``paged|eager`` or ``paged|sdpa`` gets no
  attention mask, and one that contains ``flash`` is resolved as a flash-attention package (and
  looked up on the Hub), so these names never contain it (``flash`` is written ``fl-ash``). Per
  layer the function views the layer's pool as paged's ``[blocks, block_size, kv_heads,
  head_dim]`` (no copy; :func:`_view_pool` has each release's layout), writes the new K/V with
  ``backend.write`` and runs ``backend.forward``.
- **"gathered"** (5.24, 5.25): the model has already written the new K/V into the pool and gathered
  each request's whole K/V (``key``/``value`` are ``[1, kv_heads, rows, head_dim]``, request r at
  rows ``cu_k[r]:cu_k[r+1]``); the cache object is not passed. Continuous batching accepts only
  names that contain ``flash`` (besides its own), so these names end with ``+flash`` and the
  backend's own name keeps ``fl-ash``: nothing after the marker can read as a flash-attention
  version (5.24 turns on its flash-only decode path for ``flash...2`` / ``flash...3``). The
  function runs ``backend.forward`` over the gathered K/V seen as a cache of one-token blocks
  (:func:`batch_meta_from_gathered`), without a copy and without a write.

The ``BatchMeta`` and the backend's plan are built at the first layer of a step and reused by
every other layer; a new step is recognised by the identity of transformers' per-step tensors
(each step slices new views), and a CUDA-graph capture of a step plans again inside the
capture, so replays recompute the metadata.
"""

from __future__ import annotations

import threading
import weakref
from typing import Any

import torch
from paged_core import (
    KV_DTYPES,
    Backend,
    Capabilities,
    InputError,
    KVCache,
    PagedError,
    UnsupportedSpecError,
    registry,
)

from ._meta import batch_meta_from_gathered, batch_meta_from_transformers
from ._versions import SUPPORTED, check_transformers_version, hook_of

__all__ = ["enable", "PagedAttention", "implementation_name", "register"]

#: The adapters registered by :func:`enable`, by implementation name.
_ENABLED: dict[str, PagedAttention] = {}
# The options (name, type, value) each registered name was made with.
_OPTIONS: dict[str, list] = {}
_LOCK = threading.Lock()
#: The gathered hook's names that :func:`register` recorded in transformers' flash-attention loader.
_LOADED: set[str] = set()


class _LoadedNames(str):
    """What :func:`register` records as the flash-attention loader's loaded implementation.

    The loader keeps one name (``_loaded_implementation``) and imports anything it is asked for
    unless ``_loaded_implementation != implementation`` is False; a plain name would let only the
    last registered backend through, and ``set_attn_implementation`` with any earlier one raised
    "Could not find the currently requested flash attention implementation". This str is the last
    registered name and compares equal to every name in :data:`_LOADED`, so each enabled backend
    passes. Its hash is the str's own: the loader only compares it, never hashes it.
    """

    __slots__ = ()

    def __eq__(self, other: object) -> bool:
        if isinstance(other, str) and other in _LOADED:
            return True
        return str.__eq__(self, other)

    def __ne__(self, other: object) -> bool:
        equal = self.__eq__(other)
        return equal if equal is NotImplemented else not equal

    __hash__ = str.__hash__


def implementation_name(backend: str, options: dict[str, Any], *, hook: str = "pool") -> str:
    """The attention-implementation name :func:`enable` registers for ``backend`` and ``options``.

    ``hook`` is the transformers release's hook (:func:`paged_transformers._versions.hook_of`).
    The backend part never contains ``flash`` (written ``fl-ash``): 5.17 would resolve such a
    name as a flash-attention package; 5.24 and 5.25 need ``flash`` in the name, once, at its end.

    >>> implementation_name("triton-unified", {})
    'paged|paged-triton-unified'
    >>> implementation_name("flashinfer", {"validate": True})
    'paged|paged-fl-ashinfer-validate=True'
    >>> implementation_name("flash-attn2", {}, hook="gathered")
    'paged-fl-ash-attn2+flash'
    """
    parts = "-".join([backend, *(f"{k}={options[k]}" for k in sorted(options))]).replace("flash", "fl-ash")
    if hook == "gathered":
        return f"paged-{parts}+flash"
    return f"paged|paged-{parts}"


def enable(backend: str = "triton-unified", *, kv_dtype: str = "auto", **backend_options: Any) -> str:
    """Register paged backend ``backend`` as an attention implementation of transformers.

    Returns the implementation name; ``model.set_attn_implementation(name)`` (or
    ``from_pretrained(..., attn_implementation=name)``) then makes ``model.generate_batch``
    run every full-attention layer through the backend, on transformers' own KV pools.
    ``backend_options`` go to ``paged_core.registry.get(backend, **backend_options)``.
    Calling it again with the same arguments returns the same name.

    ``kv_dtype="int8"``, ``"fp8"`` or ``"fp8_e5m2"`` keeps K/V in pools of paged's quantized
    format (codes and one float32 scale per slot and KV head), one per layer, with transformers'
    slot arithmetic; transformers still allocates (and no longer uses) its own pool, so this
    measures what quantization costs in accuracy, not what it saves in memory. transformers
    5.17 only.

    On transformers 5.24 and 5.25 the name contains ``flash`` (the only custom names its continuous
    batching accepts); ``enable`` then marks the name as loaded in transformers' flash-attention
    loader, which would otherwise look for a flash-attention package or Hub kernel of that name
    when ``set_attn_implementation`` is called (see the README). Call ``enable`` again before
    ``set_attn_implementation`` if another flash-attention implementation was set in between.

    Raises :class:`paged_core.UnsupportedSpecError` on a transformers release without a
    supported hook, and the registry's errors for an unknown or unavailable backend.
    """
    hook = hook_of(check_transformers_version())
    registry.registration(backend)  # a name that is a str and registered, before it names anything
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if kv_dtype != "auto" and hook == "gathered":
        raise UnsupportedSpecError(
            backend,
            [
                f"kv_dtype={kv_dtype!r} on transformers {_transformers_version()}: its model writes K/V into its "
                "own full-precision pool and hands the attention function a gathered copy, so there is no write "
                "a quantized pool could take; accepted: kv_dtype='auto' there, or transformers 5.17 for int8/fp8"
            ],
        )
    name = implementation_name(
        backend,
        backend_options if kv_dtype == "auto" else {**backend_options, "kv_dtype": kv_dtype},
        hook=hook or "pool",
    )
    # The name is the options' text: options of other types (validate="True") share it, so the
    # adapter is reused only for the very options (with their types) it was made with.
    given = [(k, type(v), v) for k, v in sorted(backend_options.items())]
    with _LOCK:
        if name not in _ENABLED or _OPTIONS.get(name) != given:
            # Fails here, with the registry's message, for a missing or broken backend or a bad option.
            instance = registry.get(backend, **backend_options)
            register(PagedAttention(instance, name, kv_dtype=kv_dtype))
            _OPTIONS[name] = given
        else:
            register(_ENABLED[name])
    return name


def register(adapter: PagedAttention) -> str:
    """Register ``adapter`` with transformers under ``adapter.name`` (what :func:`enable` does).

    On 5.24 and 5.25 a name containing ``flash`` is also marked as loaded in transformers' flash-attention
    loader (``transformers.modeling_flash_attention_utils``). That loader is private: it is the
    one step between a registered name and continuous batching that these releases give no public way
    through. ``set_attn_implementation`` calls it for every name containing ``flash``, and for a
    name that is neither ``flash_attention_2/3/4`` nor a Hub repository it raises "Could not find
    the currently requested flash attention implementation"; a name without ``flash`` is refused
    by continuous batching instead. The loader keeps one name; what is recorded there compares
    equal to every name registered so far (:class:`_LoadedNames`), so any number of backends can be
    enabled and set in turn. Nothing else of transformers is touched.
    """
    from transformers import AttentionInterface

    AttentionInterface.register(adapter.name, adapter)
    _ENABLED[adapter.name] = adapter
    if adapter.hook == "gathered":
        from transformers import modeling_flash_attention_utils as loader

        if not hasattr(loader, "_loaded_implementation"):
            raise UnsupportedSpecError(
                adapter.backend.name,
                [
                    f"transformers {_transformers_version()} has no flash-attention loader state "
                    f"(modeling_flash_attention_utils._loaded_implementation) to record {adapter.name!r} in, so "
                    "set_attn_implementation would look the name up as a flash-attention package; accepted: "
                    f"transformers {_supported_releases()}"
                ],
            )
        _LOADED.add(adapter.name)
        # transformers leaves the module global unannotated at None, so mypy infers it as None.
        loader._loaded_implementation = _LoadedNames(adapter.name)  # type: ignore[assignment]
    return adapter.name


class _Step:
    """One step's metadata and plans: the key tensors held (so their ids are never reused)."""

    __slots__ = ("key", "plans", "rows")

    def __init__(self, key: tuple) -> None:
        self.key = key
        self.plans: dict[int, Any] = {}  # layer group -> backend.plan(meta)
        self.rows = 0  # "gathered": the K/V rows the plan was built for


class PagedAttention:
    """transformers' attention-function signature over one paged backend instance."""

    def __init__(self, backend: Backend, name: str, *, kv_dtype: str = "auto", hook: str | None = None) -> None:
        self.backend = backend
        self.name = name
        self.kv_dtype = kv_dtype
        #: "pool" (5.17, 5.18) or "gathered" (5.24, 5.25): what transformers hands the function.
        self.hook = hook or hook_of(_transformers_version()) or "pool"
        self._step: _Step | None = None
        # (transformers' cache object, per layer: (group, the layer as a paged cache, padding slot)):
        # views (or, for kv_dtype, pools of paged's format), dropped when transformers drops its
        # cache, so a finished generate_batch frees its pools.
        self._pools: tuple[weakref.ref, dict[int, tuple[int, KVCache, int | None]]] | None = None

    def __repr__(self) -> str:
        return f"PagedAttention({self.name!r}, backend={self.backend.name!r})"

    # transformers calls the function with these positional and keyword arguments.
    def __call__(
        self,
        module: torch.nn.Module,
        query: torch.Tensor,  # [1, num_heads, num_tokens, head_dim]
        key: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
        value: torch.Tensor,  # [1, num_kv_heads, num_tokens, head_dim]
        attention_mask: torch.Tensor | None,
        dropout: float = 0.0,
        scaling: float | None = None,
        **kwargs: Any,
    ) -> tuple[torch.Tensor, None]:
        layer = getattr(module, "layer_idx", None)
        if self.hook == "gathered":
            return self._gathered(module, layer, query, key, value, dropout, scaling, kwargs)
        cache = kwargs.get("cache")
        if cache is None or "write_index" not in kwargs:
            raise InputError(
                f"{self.name!r} was called without transformers' paged cache (layer {layer}); it serves "
                "continuous batching only: call model.generate_batch(...), or switch the model back "
                "with model.set_attn_implementation('sdpa') for a plain forward"
            )
        if not isinstance(layer, int):
            raise InputError(
                f"{type(module).__name__} has layer_idx {layer!r}; transformers' paged cache keeps one pool per "
                "layer index, so the layer's pool cannot be found; accepted: attention modules with an int "
                "layer_idx (every transformers decoder layer's attention sets it)"
            )
        if dropout:
            raise UnsupportedSpecError(
                self.backend.name,
                [
                    f"attention dropout {dropout} (the model is in "
                    "training mode); paged serves inference: call model.eval()"
                ],
            )
        group, kv, padding_slot = self._pool(module, cache, layer)
        plan = self._plan(kwargs, group, query, kv, scaling, padding_slot)
        # [1, H, N, D] -> [N, H, D]; q must be dense in head_dim, which a transpose keeps.
        q = query[0].transpose(0, 1)
        k = key[0].transpose(0, 1)
        v = value[0].transpose(0, 1)
        self.backend.write(kv, k, v, plan)
        # Rows of the padding request come back as exact zeros, so no row is left unwritten.
        out = self.backend.forward(q, kv, plan, scale=scaling)
        return out.unsqueeze(0), None  # [1, N, H, D], as transformers' paged paths return

    def _gathered(
        self,
        module: torch.nn.Module,
        layer: int | None,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        dropout: float,
        scaling: float | None,
        kwargs: dict,
    ) -> tuple[torch.Tensor, None]:
        """transformers 5.24, 5.25: attention over the K/V the model wrote and gathered itself."""
        if "write_index" not in kwargs or "cu_seq_lens_q" not in kwargs:
            raise InputError(
                f"{self.name!r} was called without transformers' continuous-batching metadata (layer {layer}); "
                "it serves continuous batching only: call model.generate_batch(...), or switch the model back "
                "with model.set_attn_implementation('sdpa') for a plain forward"
            )
        if dropout:
            raise UnsupportedSpecError(
                self.backend.name,
                [
                    f"attention dropout {dropout} (the model is in "
                    "training mode); paged serves inference: call model.eval()"
                ],
            )
        if kwargs.get("block_table") is not None:
            raise UnsupportedSpecError(
                self.backend.name,
                [
                    "transformers' decode fast path (a block table with its k_cache/v_cache) is meant for "
                    "flash_attn_with_kvcache; accepted: ContinuousBatchingConfig(max_blocks_per_request=0)"
                ],
            )
        window = getattr(module, "sliding_window", None)
        if window:
            raise UnsupportedSpecError(self.backend.name, [_window_reason(module, layer, window)])
        if getattr(module, "is_causal", True) is False:
            raise UnsupportedSpecError(
                self.backend.name,
                [f"layer {layer} ({type(module).__name__}) is not causal; paged computes causal attention only"],
            )
        # [1, kv_heads, rows, D] -> [rows, 1, kv_heads, D]: one-token blocks, a view of the gathered rows.
        k = key[0].transpose(0, 1).unsqueeze(1)
        v = value[0].transpose(0, 1).unsqueeze(1)
        kv = KVCache(k=k, v=v, kv_dtype="auto", dtype=k.dtype)
        step_key = (kwargs["cu_seq_lens_q"], kwargs["write_index"], kwargs["read_index"], _capturing())
        step = self._new_step(step_key)
        plan = step.plans.get(0)
        if plan is None or step.rows != k.shape[0]:
            meta = batch_meta_from_gathered(
                cu_seq_lens_q=kwargs["cu_seq_lens_q"],
                cu_seq_lens_k=kwargs["cu_seq_lens_k"],
                num_tokens=query.shape[2],
                num_kv_rows=k.shape[0],
                max_query_len=int(kwargs["max_length_q"]),
                max_seq_len=int(kwargs["max_length_k"]),
            )
            plan = self.backend.plan(
                meta,
                num_heads=query.shape[1],
                num_kv_heads=kv.num_kv_heads,
                head_dim=kv.head_dim,
                head_dim_v=kv.head_dim_v,
                dtype=query.dtype,
                kv_dtype=kv.kv_dtype,
                kv_scales=kv.kv_scales,
                scale=scaling,
            )
            step.plans[0], step.rows = plan, k.shape[0]
        q = query[0].transpose(0, 1)
        out = self.backend.forward(q, kv, plan, scale=scaling)
        return out.unsqueeze(0), None

    # ----------------------------------------------------------------------------- per step
    def _new_step(self, step_key: tuple) -> _Step:
        """This step's record, a new one when transformers' per-step tensors changed."""
        step = self._step
        if step is None or any(a is not b for a, b in zip(step.key, step_key, strict=True)):  # bools: interned
            caps = self.backend.capabilities
            if step_key[-1] and not captures_whole_steps(caps):
                # transformers captures each step whole: the plan (first layer) with the forwards.
                why = (
                    "which this backend does not claim to be safe in (capabilities.cuda_graphs is False)"
                    if not caps.cuda_graphs
                    else "and transformers captures each step whole, plan() included, while this backend "
                    "plans on the host (capabilities.device_plan is False: a replay would run the "
                    "captured schedule on another batch)"
                )
                raise UnsupportedSpecError(
                    self.backend.name,
                    [
                        f"running inside a CUDA-graph capture, {why}; accepted: "
                        "ContinuousBatchingConfig(use_cuda_graph=False), or a backend that claims CUDA graphs "
                        "and plans on the device (triton-unified without cascade=True)"
                    ],
                )
            step = self._step = _Step(step_key)
        return step

    def _plan(
        self,
        kwargs: dict,
        group: int,
        query: torch.Tensor,
        kv: KVCache,
        scaling: float | None,
        padding_slot: int | None,
    ) -> Any:
        write_index = kwargs["write_index"][group]
        # transformers captures a CUDA graph by running the same step twice, eagerly and then under
        # capture: a plan built by the eager run holds tensors computed outside the graph, which a
        # replay would never recompute, so a capture starts a new step.
        step_key = (kwargs["cu_seq_lens_q"], kwargs["write_index"], kwargs["read_index"], _capturing())
        step = self._new_step(step_key)
        plan = step.plans.get(group)
        if plan is None:
            cu_k = kwargs["cu_seq_lens_k"]
            max_k = kwargs["max_seqlen_k"]
            if isinstance(cu_k, dict):  # hybrid models: one entry per layer type
                cu_k, max_k = cu_k["full_attention"], max_k["full_attention"]
            meta = batch_meta_from_transformers(
                cu_seq_lens_q=kwargs["cu_seq_lens_q"],
                cu_seq_lens_k=cu_k,
                read_index=kwargs["read_index"][group],
                write_index=write_index,
                num_tokens=query.shape[2],
                block_size=kv.block_size,
                padding_slot=padding_slot,
                max_query_len=int(kwargs["max_seqlen_q"]),
                max_seq_len=int(max_k),
            )
            plan = self.backend.plan(
                meta,
                num_heads=query.shape[1],
                num_kv_heads=kv.num_kv_heads,
                head_dim=kv.head_dim,
                dtype=query.dtype,
                kv_dtype=kv.kv_dtype,
                kv_scales=kv.kv_scales,
                scale=scaling,
            )
            step.plans[group] = plan
        return plan

    # ----------------------------------------------------------------------------- per cache
    def _pool(self, module: torch.nn.Module, cache: Any, layer: int) -> tuple[int, KVCache, int | None]:
        pools = self._pools
        if pools is None or pools[0]() is not cache:
            pools = self._pools = (weakref.ref(cache), {})
            # A new cache is a new generate_batch: nothing of the old one may stay referenced.
            self._step = None
            weakref.finalize(cache, self._forget, pools[0])
        views = pools[1]
        entry = views.get(layer)
        if entry is None:
            # Once per layer of each cache (a new generate_batch may bring another model).
            self._check_layer(module, cache, layer)
            entry = _view_pool(cache, layer)
            if self.kv_dtype != "auto":
                entry = self._quantized_pool(cache, layer, *entry)
            views[layer] = entry
        return entry

    def _quantized_pool(
        self, cache: Any, layer: int, group: int, kv: KVCache, padding_slot: int | None
    ) -> tuple[int, KVCache, int | None]:
        """A pool of paged's quantized format covering the same slots as transformers' view."""
        if padding_slot is None:
            raise UnsupportedSpecError(
                self.backend.name,
                [
                    f"kv_dtype={self.kv_dtype!r} on transformers {_transformers_version()}: its pages interleave "
                    "every layer, so a pool of paged's format with the same slots would hold every layer's "
                    "pages for each layer; accepted: kv_dtype='auto', or transformers 5.17"
                ],
            )
        quantized = self.backend.allocate(
            kv.num_blocks,
            kv.block_size,
            kv.num_kv_heads,
            kv.head_dim,
            dtype=kv.dtype,
            kv_dtype=self.kv_dtype,
            device=kv.device,
        )
        return group, quantized, -1

    def _forget(self, ref: weakref.ref) -> None:
        if self._pools is not None and self._pools[0] is ref:
            self._pools = None
            self._step = None

    def _check_layer(self, module: torch.nn.Module, cache: Any, layer: int) -> None:
        window = _layer_window(module, cache, layer)
        if window:
            raise UnsupportedSpecError(self.backend.name, [_window_reason(module, layer, window)])
        if getattr(module, "is_causal", True) is False:
            raise UnsupportedSpecError(
                self.backend.name,
                [f"layer {layer} ({type(module).__name__}) is not causal; paged computes causal attention only"],
            )


def _window_reason(module: torch.nn.Module, layer: int | None, window: int) -> str:
    return (
        f"layer {layer} ({type(module).__name__}) is a sliding-window layer (window {window}); "
        "transformers keeps such layers in a rolling buffer whose slots are not paged's "
        "block_size * block + offset positions, so paged cannot read them. Accepted: models whose "
        "layers are all full attention (e.g. Qwen3 with use_sliding_window=False, Llama); use "
        "attn_implementation='sdpa' (5.24, 5.25) or 'paged|sdpa' (5.17, 5.18) for this model"
    )


def _layer_window(module: torch.nn.Module, cache: Any, layer: int) -> int:
    """The sliding window of ``layer`` as transformers' cache keeps it (0: full attention)."""
    if hasattr(cache, "sliding_windows"):  # 5.17: 1 means full attention
        window = cache.sliding_windows.get(layer, 1)
        return 0 if window == 1 else int(window)
    allocator = cache.layer_to_allocator[layer]  # 5.18: one allocator per attention type
    return int(getattr(allocator, "sliding_window", 0) or getattr(module, "sliding_window", 0) or 0)


def _supported_releases() -> str:
    return ", ".join(f"{key}.x" for key in SUPPORTED)


def _transformers_version() -> str:
    import transformers

    return transformers.__version__


def captures_whole_steps(capabilities: Capabilities) -> bool:
    """Whether a backend with these capabilities runs inside transformers' CUDA graphs
    (``ContinuousBatchingConfig(use_cuda_graph=True)``): transformers captures whole steps, the
    plan included, so it needs ``cuda_graphs`` and ``device_plan`` (a plan that reads nothing
    on the host). paged-transformers refuses a capture with any other backend.

    >>> from paged_core import registry
    >>> caps = registry.capabilities
    >>> captures_whole_steps(caps("triton-unified")), captures_whole_steps(caps("reference"))
    (True, False)
    """
    return capabilities.cuda_graphs and capabilities.device_plan


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream (a host query, no sync)."""
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _view_pool(cache: Any, layer: int) -> tuple[int, KVCache, int | None]:
    """(layer group, transformers' pools of ``layer`` as a paged ``KVCache``, the slot of padding
    rows), without a copy.

    - 5.17 allocates ``[(num_blocks + 2) * block_size, kv_heads, head_dim]`` per layer: the
      blocks its allocator hands out, then a zeroed read-trash block, then a write-trash block
      that padding tokens write to. Seen as ``[num_blocks + 2, block_size, kv_heads, head_dim]``,
      the first ``num_blocks + 1`` blocks are the pool paged reads, and the write-trash block is
      the block past the pool where paged's writes of padding rows (slot -1) land.
    - 5.18 interleaves every layer's K and V pages in one byte tensor and hands out
      ``get_cache_for_block_table(layer)``: this layer's pages as ``[pages, page_size, kv_heads,
      head_dim]`` (its own decode path's view), where slot ``s`` is page ``s // page_size``. Its
      trash sectors lie inside that view, so it has no block past the pool: padding rows keep
      transformers' write-trash slot (inside the view, never read), where transformers' own
      paths write them too. (``BatchMeta.validate`` expects slot -1 there, so on 5.18 it
      reports padded CUDA-graph steps; eager steps have no padding rows.)
    """
    if hasattr(cache, "layer_index_to_group_indices"):
        group, index_in_group = cache.layer_index_to_group_indices[layer]
        k_all, v_all = cache.key_cache[index_in_group], cache.value_cache[index_in_group]
        bs = cache.block_size
        if k_all.dim() != 3 or k_all.shape[0] % bs or not k_all.is_contiguous() or not v_all.is_contiguous():
            raise PagedError(
                f"transformers' KV pool of layer {layer} is {list(k_all.shape)} (contiguous: "
                f"{k_all.is_contiguous()}); accepted: a contiguous [(num_blocks + 2) * {bs}, num_kv_heads, "
                "head_dim] pool as transformers 5.17 allocates"
            )
        shape = (k_all.shape[0] // bs, bs, k_all.shape[1], k_all.shape[2])
        k_blocks, v_blocks = k_all.view(shape), v_all.view(shape)
        return (
            group,
            KVCache(k=k_blocks[:-1], v=v_blocks[:-1], kv_dtype="auto", dtype=k_all.dtype, _spill=(k_blocks, v_blocks)),
            -1,
        )
    group, k_pages, v_pages = cache.get_cache_for_block_table(layer)
    if k_pages.dim() != 4 or k_pages.stride(-1) != 1 or k_pages.shape != v_pages.shape:
        raise PagedError(
            f"transformers' page views of layer {layer} are {list(k_pages.shape)} and {list(v_pages.shape)}; "
            "accepted: two [pages, page_size, num_kv_heads, head_dim] views as transformers 5.18 returns"
        )
    return group, KVCache(k=k_pages, v=v_pages, kv_dtype="auto", dtype=k_pages.dtype), None
