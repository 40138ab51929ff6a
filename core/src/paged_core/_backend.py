"""The contract every backend implements.

A backend subclasses :class:`Backend`, declares ``name`` and ``capabilities``, and implements
``_forward`` (planning backends also ``_plan``, and any backend may replace ``_write``). The
public :meth:`Backend.plan`, :meth:`Backend.write` and :meth:`Backend.forward` do the shared work
once for everyone (``_checks``): they refuse what the capabilities do not claim (a claim is a
promise; anything else is an error, never a silently different result), check the tensors, and
run the full ``BatchMeta`` validation when validation is on. Under ``torch.compile`` the public
calls are the custom ops of ``_ops``.
"""

from __future__ import annotations

import collections
from typing import Any, ClassVar, Literal, cast, overload

import torch

from . import _ops
from ._batch import BatchMeta
from ._cache import KVCache, allocate_kv_cache
from ._checks import (
    PLAN_KEYWORDS,
    batch_of,
    capturing,
    check_forward,
    check_out_memory,
    check_plan,
    check_write,
    device_reasons,
    validate_call,
    validation_enabled,
)
from ._errors import InputError, PagedError
from ._spec import AttentionSpec, Capabilities, check_spec
from ._write import write_kv

__all__ = ["Backend", "validation_enabled", "PLAN_KEYWORDS"]


class Backend:
    """Base class of every attention backend: plan a step once, then run every layer with it.

    Subclasses set ``name`` and ``capabilities`` and implement :meth:`_forward`; planning backends
    also override :meth:`_plan` (the public :meth:`plan` checks the layer first). Constructor
    options are keyword-only and validated by the subclass. An engine's step, with the reference
    backend (every backend is used the same way):

    >>> import torch
    >>> from paged_core import BatchMeta, registry
    >>> num_layers, num_heads, num_kv_heads, head_dim = 4, 8, 2, 64
    >>> backend = registry.get("reference")
    >>> caches = [backend.allocate(8, 16, num_kv_heads, head_dim, dtype=torch.float32)
    ...           for _ in range(num_layers)]
    >>> # A 5-token prompt and one decode token of a 40-token request, blocks of 16 tokens.
    >>> meta = BatchMeta.build(query_lens=[5, 1], seq_lens=[5, 40], block_size=16)
    >>> # Once per step, before the first layer: checks the layers against the capabilities.
    >>> plan = backend.plan(meta, num_heads=num_heads, num_kv_heads=num_kv_heads,
    ...                     head_dim=head_dim, dtype=torch.float32)
    >>> outputs = []
    >>> for cache in caches:  # every layer reuses the plan
    ...     q = torch.randn(meta.num_tokens, num_heads, head_dim)
    ...     k, v = torch.randn(2, meta.num_tokens, num_kv_heads, head_dim)
    ...     backend.write(cache, k, v, plan)  # the step's new K/V rows, at meta.slot_mapping
    ...     outputs.append(backend.forward(q, cache, plan))
    >>> outputs[0].shape
    torch.Size([6, 8, 64])
    """

    #: The registry key (``registry.get(name)``).
    name: ClassVar[str] = ""
    #: What the backend promises to compute exactly; conformance holds it to that. Set on the
    #: class; an instance may narrow it for its options (triton-unified's ``cascade``).
    capabilities: Capabilities = Capabilities()
    #: What ``paged list`` prints instead of the class's capabilities, for a backend whose
    #: instances claim other backends' (``auto``); None: the capabilities' summary.
    listing: ClassVar[str | None] = None

    def __init__(self, *, validate: bool | None = None) -> None:
        #: Run the host-syncing checks of :meth:`BatchMeta.validate` on each call.
        self.validate = validation_enabled(validate)
        # reasons() per spec: a model has few specs, and forward asks on every new call.
        self._reasons: dict[AttentionSpec, list[str]] = {}
        # The calls forward has checked (``_checks.check_forward``): one per layer shape per step.
        self._checked_calls: set[tuple] = set()
        # What the torch custom ops use (``_ops``): this instance's handle (stable for its life),
        # its last plans (plan() keeps them), and whether it writes with its own write().
        self._op_plans: collections.deque[Any] = collections.deque(maxlen=_ops.KEPT_PLANS)
        self._op_own_write = type(self).write is not Backend.write
        self._op_handle = _ops.register(self)

    # ----------------------------------------------------------------------------- capability
    @classmethod
    def unavailable(cls) -> list[str]:
        """Reasons this backend cannot run on this machine at all (missing package, no GPU).

        Each reason should end with the command that fixes it. Empty: it can run.
        """
        return []

    def reasons(self, spec: AttentionSpec) -> list[str]:
        """Every reason this backend cannot serve ``spec``; empty means supported.

        Cached per spec: a model has few specs, and ``forward`` asks on every call.
        """
        check_spec(spec)  # before the lookup: an unhashable spec would be a TypeError there
        if spec not in self._reasons:
            self._reasons[spec] = [
                *self.unavailable(),
                *device_reasons(spec),
                *self.capabilities.reasons(spec),
                *self.extra_reasons(spec),
            ]
        return list(self._reasons[spec])

    def supports(self, spec: AttentionSpec) -> bool:
        return not self.reasons(spec)

    def extra_reasons(self, spec: AttentionSpec) -> list[str]:
        """Reasons beyond what ``capabilities`` can express (e.g. a head_dim × dtype limit)."""
        return []

    # ----------------------------------------------------------------------------- cache
    def allocate(
        self,
        num_blocks: int,
        block_size: int,
        num_kv_heads: int,
        head_dim: int,
        *,
        dtype: torch.dtype = torch.bfloat16,
        kv_dtype: str = "auto",
        device: torch.device | str = "cpu",
        k_scale: float | torch.Tensor | None = None,
        v_scale: float | torch.Tensor | None = None,
        head_dim_v: int | None = None,
    ) -> KVCache:
        """Allocate one layer's cache in the layout this backend reads (NHD for all of ours);
        ``k_scale``/``v_scale`` give a quantized cache static scales, ``head_dim_v`` V's own head
        dim (``allocate_kv_cache``)."""
        return allocate_kv_cache(
            num_blocks,
            block_size,
            num_kv_heads,
            head_dim,
            dtype=dtype,
            kv_dtype=kv_dtype,
            device=device,
            k_scale=k_scale,
            v_scale=v_scale,
            head_dim_v=head_dim_v,
        )

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        """Write the step's new K/V rows into ``cache`` at ``meta.slot_mapping`` (-1: skipped).

        With validation on, the batch is validated against the cache first, so a slot past the
        pool is a :class:`BatchMetaError`; with it off, such a slot is skipped (never written).
        Under ``torch.compile`` this is the custom op ``paged::write`` (docs/contract.md, "torch.compile").
        """
        if torch.compiler.is_compiling():
            return _ops.write(self, cache, k, v, meta)
        batch = check_write(self, self._checked_calls, cache, meta)
        if self.validate and not capturing():
            batch.validate(num_blocks=cache.num_blocks)
        self._write(cache, k, v, batch.slot_mapping)

    @property
    def writes_on_device(self) -> bool:
        """Whether :meth:`write` runs without host syncs (a kernel of the backend's own), so an
        engine may capture it in a CUDA graph: :func:`write_kv`, the default, filters skipped
        slots on the host."""
        return type(self)._write is not Backend._write

    def _write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        """The backend's own write; the cache and batch are checked. Default: :func:`write_kv`
        (pure PyTorch), which checks ``k`` and ``v`` before writing anything. An override must
        write exactly what :func:`write_kv` writes (codes and scales included) and refuse what it
        refuses."""
        write_kv(cache, k, v, slot_mapping)

    # ----------------------------------------------------------------------------- attention
    def plan(self, meta: BatchMeta, **layer: Any) -> Any:
        """Prepare a batch once per step; the result is passed to every layer's ``forward``.

        The keywords describe the layers that will use the plan (the same for every layer of a
        step): ``num_heads``, ``num_kv_heads``, ``head_dim``, ``dtype``, ``kv_dtype``,
        ``kv_scales`` (``KV_SCALES``: how a quantized cache's scales vary, ``KVCache.kv_scales``),
        ``window``, ``softcap``, ``scale`` and ``sinks`` (a bool: whether the layers pass
        sinks), plus any option the backend's ``_plan`` declares. They are checked here, before
        any backend code runs: an unknown keyword is an :class:`InputError` listing the accepted
        ones, and with ``num_heads``, ``num_kv_heads`` and ``head_dim`` given, a layer outside
        the capabilities is an :class:`UnsupportedSpecError` with the reasons (``dtype`` and
        ``kv_dtype`` and ``kv_scales``, when given, are part of that check; so is ``head_dim_v``,
        V's and the output's head dim when it differs from ``head_dim``). A backend that plans on the host
        (FlashInfer) plans with them at once, which a CUDA-graph replay needs (it runs no
        Python); the others ignore them, so one call serves every backend. The default plan is
        the ``BatchMeta`` itself; planning backends return an object with a ``meta`` attribute.

        Subclasses override :meth:`_plan`, never this method, and get these checks for free.
        """
        passed = check_plan(self, meta, layer)
        meta = meta.contiguous()  # once per step: kernels index the metadata as contiguous
        # The custom ops of torch.compile find the step's plan here (host ints never travel as op
        # arguments: dynamo would guard on them and recompile every step).
        return _ops.remember(self, self._plan(meta, **passed))

    def _plan(self, meta: BatchMeta, *args: Any, **layer: Any) -> Any:
        """The backend's own planning; ``meta`` and the keywords are checked. Default: ``meta``.

        Receives the keywords of :data:`PLAN_KEYWORDS` that it declares (all of them given
        with ``**layer``), plus its own options, which :meth:`plan` then accepts.
        """
        return meta

    # The result's type follows ``return_lse``: ``out``, or ``(out, lse)``.
    @overload
    def forward(
        self,
        q: torch.Tensor,
        cache: KVCache,
        meta: Any,
        *,
        scale: float | None = ...,
        window: int = ...,
        softcap: float = ...,
        sinks: torch.Tensor | None = ...,
        out: torch.Tensor | None = ...,
        return_lse: Literal[False] = ...,
    ) -> torch.Tensor: ...
    @overload
    def forward(
        self,
        q: torch.Tensor,
        cache: KVCache,
        meta: Any,
        *,
        scale: float | None = ...,
        window: int = ...,
        softcap: float = ...,
        sinks: torch.Tensor | None = ...,
        out: torch.Tensor | None = ...,
        return_lse: Literal[True],
    ) -> tuple[torch.Tensor, torch.Tensor]: ...
    @overload
    def forward(
        self,
        q: torch.Tensor,
        cache: KVCache,
        meta: Any,
        *,
        scale: float | None = ...,
        window: int = ...,
        softcap: float = ...,
        sinks: torch.Tensor | None = ...,
        out: torch.Tensor | None = ...,
        return_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...
    def forward(
        self,
        q: torch.Tensor,
        cache: KVCache,
        meta: Any,
        *,
        scale: float | None = None,
        window: int = 0,
        softcap: float = 0.0,
        sinks: torch.Tensor | None = None,
        out: torch.Tensor | None = None,
        return_lse: bool = False,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
        """Paged attention of ``q [num_tokens, num_heads, head_dim]`` over ``cache``; the result
        is ``[num_tokens, num_heads, head_dim_v]`` (``cache.head_dim_v``, ``head_dim`` unless the
        cache's V has its own head dim, which the capabilities must claim: ``head_dim_pairs``).

        ``meta`` is a :class:`BatchMeta` or what :meth:`plan` returned for it. ``scale``
        defaults to ``head_dim ** -0.5``; ``window > 0`` limits each query to its last
        ``window`` keys (itself included); ``softcap > 0`` maps logits ``s -> softcap *
        tanh(s / softcap)``; ``sinks`` (float32 ``[num_heads]``) adds one logit per head to every
        softmax denominator. ``out`` receives the result if given. With ``return_lse`` the
        result is ``(out, lse)``, ``lse`` float32 ``[num_tokens, num_heads]`` in natural log
        (``-inf`` for rows that see no key). Under ``torch.compile`` this is the custom op
        ``paged::forward`` (docs/contract.md, "torch.compile").
        """
        if torch.compiler.is_compiling():
            return _ops.forward(
                self,
                q,
                cache,
                meta,
                scale=scale,
                window=window,
                softcap=softcap,
                sinks=sinks,
                out=out,
                return_lse=return_lse,
            )
        batch = meta if type(meta) is BatchMeta else batch_of(self, meta)
        check_forward(self, self._checked_calls, q, cache, batch, window, softcap, scale, sinks, out, return_lse)
        if not batch._dense:
            # Strided metadata (views of an engine's buffers): the kernels index it as contiguous.
            # plan() makes the copy once per step; a plan that holds such a batch was not made by it.
            if meta is not batch and not (type(self)._plan is Backend._plan and type(self).plan is Backend.plan):
                raise InputError(
                    f"the plan's batch has strided metadata, which {self.name}'s kernels do not read; "
                    f"accepted: a plan made by {self.name}.plan(meta) (it makes such a batch contiguous), or the "
                    "BatchMeta itself"
                )
            meta = batch = batch.contiguous()
        if out is not None:
            check_out_memory(out, cache)
        validating = self.validate and not capturing()
        if validating:
            validate_call(batch, cache, sinks)
        if out is None:
            out = (
                torch.empty_like(q)
                if cache.head_dim_v == q.shape[2]
                else q.new_empty(q.shape[0], q.shape[1], cache.head_dim_v)
            )
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        if validating:
            # Outputs start as NaN: a row a backend leaves unwritten shows, instead of passing
            # with whatever the memory held (zeros, an earlier layer's result).
            out.fill_(float("nan"))
            if lse is not None:
                lse.fill_(float("nan"))
        if meta is not batch and type(self)._plan is Backend._plan and type(self).plan is Backend.plan:
            # Another backend's plan: a backend without its own plan expects the BatchMeta.
            meta = batch
        if sinks is not None:
            # Every kernel indexes sinks by head with stride 1: a strided view (every other element
            # of a buffer) becomes a contiguous copy here, once for all backends (a no-op if it is).
            sinks = sinks.contiguous()
        try:
            self._forward(
                q,
                cache,
                meta,
                out=out,
                lse=lse,
                scale=q.shape[2] ** -0.5 if scale is None else scale if type(scale) is float else float(scale),
                window=window if type(window) is int else int(window),
                softcap=softcap if type(softcap) is float else float(softcap),
                sinks=sinks,
            )
        except ValueError as exc:
            # A backend's own launcher refused the arguments (they raise plain ValueError, as
            # vendor code does): keep the promise that every refusal is a PagedError.
            if isinstance(exc, PagedError):
                raise
            raise InputError(f"backend {self.name!r} refused the call: {exc}") from exc
        return (out, cast(torch.Tensor, lse)) if return_lse else out

    def _forward(
        self,
        q: torch.Tensor,
        cache: KVCache,
        plan: Any,
        *,
        out: torch.Tensor,
        lse: torch.Tensor | None,
        scale: float,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
    ) -> None:
        """Compute attention into ``out`` (and ``lse`` when not None). Inputs are checked."""
        raise NotImplementedError

    def _batch_of(self, meta: Any) -> BatchMeta:
        """The BatchMeta of ``meta`` (a BatchMeta or a plan with a ``meta`` attribute)."""
        return batch_of(self, meta)
