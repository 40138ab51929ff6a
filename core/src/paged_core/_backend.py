"""The contract every backend implements.

A backend subclasses :class:`Backend`, declares ``name`` and ``capabilities``, and implements
``_forward``. The public :meth:`Backend.forward` does the shared work once for everyone: it
derives the :class:`AttentionSpec` of the call, refuses what the capabilities do not claim (a
claim is a promise; anything else is an error, never a silently different result), checks the
tensors, and runs the full ``BatchMeta`` validation when validation is on.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import os
from typing import Any, ClassVar, cast

import torch

from . import _ops
from ._batch import BatchMeta
from ._cache import KVCache, allocate_kv_cache, write_kv
from ._errors import InputError, PagedError, UnsupportedSpecError
from ._spec import INT32_LIMIT, KV_DTYPES, KV_SCALES, AttentionSpec, Capabilities, KVDtype, dtype_name

__all__ = ["Backend", "validation_enabled", "PLAN_KEYWORDS"]

#: The layer keywords every backend's :meth:`Backend.plan` accepts: the description of the
#: layers that will run the plan (the same for every layer of a step).
PLAN_KEYWORDS = ("num_heads", "num_kv_heads", "head_dim", "dtype", "kv_dtype", "kv_scales", "window",
                 "softcap", "scale", "sinks")


def validation_enabled(validate: bool | None = None) -> bool:
    """Whether to run the checks that copy metadata to the host.

    An explicit ``validate=`` wins; otherwise ``PAGED_VALIDATE=1`` turns them on. Off by default,
    so the per-layer path of a server never syncs with the host.
    """
    if validate is not None:
        if not isinstance(validate, bool):
            raise InputError(
                f"validate is {validate!r}; accepted: True, False, or None (PAGED_VALIDATE decides)"
            )
        return validate
    return os.environ.get("PAGED_VALIDATE", "0").lower() in ("1", "true", "yes", "on")


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream.

    The data checks of ``validate`` copy to the host, which capture forbids; they are skipped
    while capturing and run on the eager warm-up call that capture needs anyway.
    """
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


# The float32 range of the kernels' scalars: the largest finite value and the smallest normal one.
_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)

# Entries of Backend._checked_calls before it is emptied: layers x shapes of a few live steps.
_CHECKED_CALLS_MAX = 4096


def _tensor_key(t: torch.Tensor) -> tuple:
    # stride() costs half of stride(-1) (argument parsing); the checks read only its last entry.
    return (t.shape, t.dtype, t.device, t.stride())


def _call_key(q, cache, batch, window, softcap, scale, sinks, out, return_lse) -> tuple | None:
    """Everything ``Backend._check_call`` reads, or None when it must run regardless.

    The layers of one step pass the same batch, caches of one layout and q/out of one shape,
    so their checks give the same answer: ``forward`` runs them once per key, i.e. once per
    step for all layers. The cache enters by its layout (shapes, strides, dtypes, device: what
    the checks read of it) and the batch by the generation of its own (cached) structure check,
    a number no other check ever had, so a new batch or a reassigned field is a new key; q, out
    and sinks by everything the checks read of them; the scalars by value and type (NaN never
    matches, so it is refused every time). Odd types (a tensor subclass, a numpy scalar) take
    the full checks on every call.
    """
    if type(q) is not torch.Tensor or not isinstance(cache, KVCache):
        return None
    cache.check()  # in the order _check_inputs checks: the same first error either way
    batch.check_structure()
    if type(window) is not int or type(softcap) not in (float, int) or (
            scale is not None and type(scale) not in (float, int)):
        return None
    if sinks is not None and type(sinks) is not torch.Tensor or out is not None and type(out) is not torch.Tensor:
        return None
    if type(return_lse) is not bool:
        return None
    return (cache._layout, batch._generation, q.shape, q.dtype, q.device, q.stride(), window, type(softcap),
            softcap, type(scale), scale, None if sinks is None else _tensor_key(sinks),
            None if out is None else _tensor_key(out), return_lse)


def _device_reasons(spec: AttentionSpec) -> list[str]:
    """A spec for a device this machine does not have cannot be served, whatever is claimed."""
    if spec.device_type == "cuda" and not torch.cuda.is_available():
        return ["the spec asks for a CUDA device, but none is visible (torch.cuda.is_available() is False)"]
    return []


def _shape(t: torch.Tensor) -> str:
    return f"{dtype_name(t.dtype)} {list(t.shape)} on {t.device}"


def _found(x) -> str:
    return _shape(x) if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"


def _is_int(v) -> bool:
    return isinstance(v, numbers.Integral) and not isinstance(v, bool)


def _check_scalars(window, softcap, scale) -> None:
    """The host scalars of a layer, shared by ``plan`` and ``forward``: in the ranges the kernels
    compute in (float32 scalars, an int32 window)."""
    # Fast path for the plain int/float every caller passes: isinstance against the numbers
    # ABCs costs microseconds, and this runs on every layer call.
    if type(window) is int and 0 <= window < INT32_LIMIT and type(softcap) in (float, int) \
            and (softcap == 0 or _F32_TINY <= softcap <= _F32_MAX) \
            and (scale is None or (type(scale) in (float, int) and -_F32_MAX <= scale <= _F32_MAX)):
        return
    if not _is_int(window) or not 0 <= window < INT32_LIMIT:
        raise InputError(
            f"window is {window!r}; accepted: 0 (no window) or a positive int below 2**31 (a window "
            "at least as long as the longest sequence is no window: pass 0)"
        )
    if not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or not (
            softcap == 0 or _F32_TINY <= softcap <= _F32_MAX):
        raise InputError(
            f"softcap is {softcap!r}; accepted: 0 (off) or a positive finite float32 (from "
            f"{_F32_TINY:.4g} to {_F32_MAX:.4g}: the kernels compute in float32)"
        )
    if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)
                              or not -_F32_MAX <= scale <= _F32_MAX):
        raise InputError(
            f"scale is {scale!r}; accepted: None (head_dim ** -0.5) or a finite float32 (magnitude at "
            f"most {_F32_MAX:.4g}: the kernels compute in float32)"
        )


def _span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, end)`` that tensor ``t`` (non-negative strides, not empty) can touch."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _overlaps_itself(t: torch.Tensor) -> bool:
    """Whether two elements of ``t`` may share memory: its dimensions of more than one element,
    by increasing stride, must each step past everything the smaller ones cover."""
    covered = 1
    for stride, n in sorted((st, n) for st, n in zip(t.stride(), t.shape, strict=True) if n > 1):
        if stride < covered:
            return True
        covered += stride * (n - 1)
    return False


def _check_out_memory(out: torch.Tensor, cache: KVCache) -> None:
    """Refuse an ``out`` that shares memory with the cache (the batch may read what it writes)."""
    if not out.numel():
        return
    lo, hi = _span(out)
    for name, t in (("k", cache.k), ("v", cache.v), ("k_scale", cache.k_scale), ("v_scale", cache.v_scale)):
        if t is not None:
            t_lo, t_hi = _span(t)
            if lo < t_hi and t_lo < hi:
                raise InputError(
                    f"out overlaps the cache's memory (cache.{name}); the kernels would read keys they "
                    "are overwriting; accepted: an output outside the cache, such as torch.empty_like(q)"
                )


@functools.cache
def _plan_params(cls: type[Backend]) -> tuple[frozenset[str], bool]:
    """The keywords ``cls._plan`` declares, and whether it takes ``**kwargs`` (read once per class)."""
    params = inspect.signature(cls._plan).parameters.values()
    names = frozenset(p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD)
                      and p.name not in ("self", "meta"))
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


class Backend:
    """Base class of every attention backend.

    Subclasses set ``name`` and ``capabilities`` and implement :meth:`_forward`; planning backends
    also override :meth:`_plan` (the public :meth:`plan` checks the layer first). Constructor
    options are keyword-only and validated by the subclass.
    """

    #: The registry key (``registry.get(name)``).
    name: ClassVar[str] = ""
    #: What the backend promises to compute exactly; conformance holds it to that.
    capabilities: ClassVar[Capabilities] = Capabilities()

    def __init__(self, *, validate: bool | None = None) -> None:
        #: Run the host-syncing checks of :meth:`BatchMeta.validate` on each call.
        self.validate = validation_enabled(validate)
        #: This instance's handle in the torch custom ops (stable for its life; see ``_ops``).
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
        cache = self.__dict__.setdefault("_reasons_cache", {})
        if spec not in cache:
            cache[spec] = [*self.unavailable(), *_device_reasons(spec), *self.capabilities.reasons(spec),
                           *self.extra_reasons(spec)]
        return list(cache[spec])

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
    ) -> KVCache:
        """Allocate one layer's cache in the layout this backend reads (NHD for all of ours);
        ``k_scale``/``v_scale`` give a quantized cache static scales (``allocate_kv_cache``)."""
        return allocate_kv_cache(
            num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, kv_dtype=kv_dtype, device=device,
            k_scale=k_scale, v_scale=v_scale,
        )

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: BatchMeta) -> None:
        """Write the step's new K/V rows into ``cache`` at ``meta.slot_mapping`` (-1: skipped).

        With validation on, the batch is validated against the cache first, so a slot past the
        pool is a :class:`BatchMetaError`; with it off, such a slot is skipped (never written).
        Under ``torch.compile`` this is the custom op ``paged::write`` (README, "torch.compile").
        """
        if torch.compiler.is_compiling():
            return _ops.write(self, cache, k, v, meta)
        batch = self._batch_of(meta)
        if not isinstance(cache, KVCache):
            raise InputError(f"cache is {_found(cache)}; accepted: a paged_core.KVCache")
        cache.check()
        # _kv_scales: what check() just found ("per_slot" for a full-precision cache too).
        if cache._kv_scales != "per_slot" and cache._kv_scales not in self.capabilities.kv_scales:
            raise UnsupportedSpecError(self.name, [
                f"{cache.kv_dtype} caches with kv_scales {cache._kv_scales!r} are not supported "
                f"(accepted: {', '.join(sorted(self.capabilities.kv_scales))})"])
        batch.check_structure()
        self._check_batch_fits(batch, cache)
        if self.validate and not _capturing():
            batch.validate(num_blocks=cache.num_blocks)
        self._write(cache, k, v, batch.slot_mapping)

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
        ``kv_dtype`` and ``kv_scales``, when given, are part of that check). A backend that plans on the host
        (FlashInfer) plans with them at once, which a CUDA-graph replay needs (it runs no
        Python); the others ignore them, so one call serves every backend. The default plan is
        the ``BatchMeta`` itself; planning backends return an object with a ``meta`` attribute.

        Subclasses override :meth:`_plan`, never this method, and get these checks for free.
        """
        if not isinstance(meta, BatchMeta):
            raise InputError(f"meta is {_found(meta)}; accepted: a paged_core.BatchMeta")
        meta.check_structure()
        names, takes_any = _plan_params(type(self))  # type: ignore[arg-type]  # classes are hashable; typeshed's Hashable misses type[...]
        unknown = sorted(k for k in layer if k not in PLAN_KEYWORDS and k not in names)
        if unknown:
            accepted = ", ".join([*PLAN_KEYWORDS, *sorted(names - set(PLAN_KEYWORDS))])
            raise InputError(
                f"{self.name}.plan() got unknown keyword(s) {', '.join(unknown)}; accepted: {accepted} "
                "(check the spelling)"
            )
        self._check_layer(meta, layer)
        meta = meta.contiguous()  # once per step: kernels index the metadata as contiguous
        passed = layer if takes_any else {k: v for k, v in layer.items() if k in names}
        # The custom ops of torch.compile find the step's plan here (host ints never travel as op
        # arguments: dynamo would guard on them and recompile every step).
        return _ops.remember(self, self._plan(meta, **passed))

    def _plan(self, meta: BatchMeta, *args: Any, **layer: Any) -> Any:
        """The backend's own planning; ``meta`` and the keywords are checked. Default: ``meta``.

        Receives the keywords of :data:`PLAN_KEYWORDS` that it declares (all of them given
        with ``**layer``), plus its own options, which :meth:`plan` then accepts.
        """
        return meta

    def _check_layer(self, meta: BatchMeta, layer: dict[str, Any]) -> None:
        """The layer keywords of :meth:`plan`: their types, then the spec they describe."""
        for name in ("num_heads", "num_kv_heads", "head_dim"):
            v = layer.get(name)
            if v is not None and (not _is_int(v) or v < 1):
                raise InputError(f"{name} is {v!r}; accepted: a positive int (or leave it out)")
        dtype, kv_dtype = layer.get("dtype"), layer.get("kv_dtype")
        if dtype is not None and not isinstance(dtype, torch.dtype):
            raise InputError(f"dtype is {dtype!r}; accepted: a torch.dtype such as torch.bfloat16")
        if kv_dtype is not None and kv_dtype not in KV_DTYPES:
            raise InputError(f"kv_dtype is {kv_dtype!r}; accepted: {', '.join(KV_DTYPES)}")
        kv_scales = layer.get("kv_scales", "per_slot")
        if kv_scales not in KV_SCALES:
            raise InputError(f"kv_scales is {kv_scales!r}; accepted: {', '.join(KV_SCALES)}")
        sinks = layer.get("sinks", False)
        if not isinstance(sinks, bool):
            raise InputError(f"sinks is {sinks!r}; accepted: True or False (whether the layers pass sinks)")
        window, softcap = layer.get("window", 0), layer.get("softcap", 0.0)
        _check_scalars(window, softcap, layer.get("scale"))
        if any(layer.get(n) is None for n in ("num_heads", "num_kv_heads", "head_dim")):
            return  # not enough to describe a spec; forward checks the layer it gets
        caps = self.capabilities
        spec = AttentionSpec(
            num_heads=layer["num_heads"], num_kv_heads=layer["num_kv_heads"], head_dim=layer["head_dim"],
            block_size=meta.block_size,
            # Not given: one the backend takes, so only what was given can be refused.
            dtype=dtype if dtype is not None else min(caps.dtypes, key=dtype_name, default=torch.bfloat16),
            kv_dtype=kv_dtype if kv_dtype is not None else ("auto" if "auto" in caps.kv_dtypes
                                                            else cast(KVDtype, min(caps.kv_dtypes, default="auto"))),
            kv_scales=kv_scales, window=int(window), softcap=float(softcap), sinks=sinks,
            device=meta.device.type, decode_only=meta.decode_only,
        )
        reasons = self.reasons(spec)
        if reasons:
            raise UnsupportedSpecError(self.name, reasons)

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
        """Paged attention of ``q [num_tokens, num_heads, head_dim]`` over ``cache``.

        ``meta`` is a :class:`BatchMeta` or what :meth:`plan` returned for it. ``scale``
        defaults to ``head_dim ** -0.5``; ``window > 0`` limits each query to its last
        ``window`` keys (itself included); ``softcap > 0`` maps logits ``s -> softcap *
        tanh(s / softcap)``; ``sinks`` (float32 ``[num_heads]``) adds one logit per head to every
        softmax denominator. ``out`` receives the result if given. With ``return_lse`` the
        result is ``(out, lse)``, ``lse`` float32 ``[num_tokens, num_heads]`` in natural log
        (``-inf`` for rows that see no key). Under ``torch.compile`` this is the custom op
        ``paged::forward`` (README, "torch.compile").
        """
        if torch.compiler.is_compiling():
            return _ops.forward(self, q, cache, meta, scale=scale, window=window, softcap=softcap,
                                sinks=sinks, out=out, return_lse=return_lse)
        batch = meta if type(meta) is BatchMeta else self._batch_of(meta)
        key = _call_key(q, cache, batch, window, softcap, scale, sinks, out, return_lse)
        checked = self.__dict__.get("_checked_calls")
        if checked is None:
            checked = self.__dict__["_checked_calls"] = {}
        if key is None or key not in checked:
            self._check_call(q, cache, batch, window, softcap, scale, sinks, out, return_lse)
            if key is not None:
                if len(checked) >= _CHECKED_CALLS_MAX:
                    checked.clear()  # old steps' batches; the live ones are checked again once
                checked[key] = True
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
            # Pointers differ per layer, so outside the memo: a few host ints per call.
            _check_out_memory(out, cache)
        if self.validate and not _capturing():
            batch.validate(num_blocks=cache.num_blocks)
            # A device read, so only here: with validation off a NaN sink is the caller's promise
            # (docs/reliability.md). +inf and -inf are the limits: zeros, and no sink.
            if sinks is not None and bool(torch.isnan(sinks).any()):
                raise InputError(
                    f"sinks holds NaN at heads {torch.isnan(sinks).nonzero().flatten().tolist()}; accepted: "
                    "float32 logits (+inf: the sink takes all the mass, zeros; -inf: no sink)"
                )
        if out is None:
            out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        if self.validate and not _capturing():
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
                q, cache, meta, out=out, lse=lse,
                scale=q.shape[2] ** -0.5 if scale is None else scale if type(scale) is float else float(scale),
                window=window if type(window) is int else int(window),
                softcap=softcap if type(softcap) is float else float(softcap), sinks=sinks,
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

    # ----------------------------------------------------------------------------- checks
    def _check_call(self, q, cache, batch, window, softcap, scale, sinks, out, return_lse) -> None:
        """Every host-side check of a ``forward`` call: the inputs, then the spec they make."""
        self._check_inputs(q, cache, batch, window, softcap, scale, sinks, out)
        if not isinstance(return_lse, bool):
            raise InputError(f"return_lse is {return_lse!r}; accepted: True or False")
        spec = AttentionSpec(
            num_heads=q.shape[1],
            num_kv_heads=cache.num_kv_heads,
            head_dim=q.shape[2],
            block_size=cache.block_size,
            dtype=q.dtype,
            kv_dtype=cache.kv_dtype,
            kv_scales=cache.kv_scales,
            window=int(window),
            softcap=float(softcap),
            sinks=sinks is not None,
            device=q.device.type,
            decode_only=batch.decode_only,
            return_lse=return_lse,
        )
        reasons = self.reasons(spec)
        if reasons:
            raise UnsupportedSpecError(self.name, reasons)

    def _batch_of(self, meta: Any) -> BatchMeta:
        """The BatchMeta of ``meta`` (a BatchMeta or a plan with a ``meta`` attribute)."""
        batch = meta if isinstance(meta, BatchMeta) else getattr(meta, "meta", None)
        if not isinstance(batch, BatchMeta):
            raise InputError(
                f"meta is a {type(meta).__name__}; accepted: a BatchMeta or the result of {self.name}.plan(meta)"
            )
        return batch

    @staticmethod
    def _check_batch_fits(batch: BatchMeta, cache: KVCache, *, device: bool = True) -> None:
        """A structurally sound batch and cache that belong together (block size, device)."""
        if batch.block_size != cache.block_size:
            raise InputError(
                f"the batch was built for block_size {batch.block_size} but the cache has block_size "
                f"{cache.block_size}; accepted: one block size (build the BatchMeta with "
                f"block_size={cache.block_size})"
            )
        if device and batch.device != cache.device:
            raise InputError(
                f"the batch is on {batch.device} but the cache is on {cache.device}; accepted: one "
                f"device (meta.to({str(cache.device)!r}))"
            )

    @classmethod
    def _check_inputs(cls, q, cache, meta, window, softcap, scale, sinks, out) -> None:
        """Every host-side check of the contract, before any backend code runs.

        No device read and no sync: the structure of the cache and of the batch is checked once
        per object (cached), the rest is a few attribute compares (microseconds per call).
        """
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise InputError(f"q is {_found(q)}; accepted: a tensor [num_tokens, num_heads, head_dim]")
        if not isinstance(cache, KVCache):
            raise InputError(f"cache is {_found(cache)}; accepted: a paged_core.KVCache")
        cache.check()
        meta.check_structure()  # shapes, dtypes, one device, host ints: a BatchMetaError naming the field
        n, hq, d = q.shape
        if hq == 0:
            raise InputError(f"q is {_shape(q)}, with no heads; accepted: num_heads >= 1")
        if n != meta.num_tokens:
            raise InputError(
                f"q has {n} rows but the batch has {meta.num_tokens} query tokens; accepted: "
                "q.shape[0] == meta.num_tokens (query_start_loc[-1])"
            )
        if d != cache.head_dim:
            raise InputError(
                f"q has head_dim {d} but the cache has head_dim {cache.head_dim}; accepted: the cache's head_dim"
            )
        if hq % cache.num_kv_heads:
            raise InputError(
                f"q has {hq} heads, not a multiple of the cache's {cache.num_kv_heads} KV heads; "
                "accepted: num_heads = group_size * num_kv_heads"
            )
        if q.dtype != cache.dtype:
            raise InputError(
                f"q is {dtype_name(q.dtype)} but the cache holds {dtype_name(cache.dtype)} K/V; "
                "accepted: the dtype the cache was allocated for"
            )
        if q.stride(-1) != 1:
            raise InputError(
                f"q's last dimension has stride {q.stride(-1)}; accepted: stride 1 (call q.contiguous())"
            )
        dev = q.device
        if cache.k.device != dev:
            raise InputError(f"cache.k is on {cache.device} but q is on {q.device}; accepted: one device")
        if meta.seq_lens.device != dev:
            raise InputError(
                f"the batch is on {meta.device} but q is on {q.device}; accepted: one device "
                f"(meta.to({str(q.device)!r}))"
            )
        cls._check_batch_fits(meta, cache, device=False)  # both are on q's device
        _check_scalars(window, softcap, scale)
        if sinks is not None and (
            not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,) or sinks.dtype != torch.float32
            or sinks.device != q.device
        ):
            raise InputError(f"sinks is {_found(sinks)}; accepted: float32 [num_heads={hq}] on {q.device}")
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape
                                or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1):
            found = (f"{_shape(out)} with last-dimension stride {out.stride(-1)}"
                     if isinstance(out, torch.Tensor) else f"a {type(out).__name__}")
            raise InputError(
                f"out is {found}; accepted: the shape, dtype and device of q ({_shape(q)}), "
                "last-dimension stride 1"
            )
        if out is not None and out.numel() and _overlaps_itself(out):
            raise InputError(
                f"out's elements overlap each other (shape {list(out.shape)}, strides {tuple(out.stride())}: an "
                "expanded or overlapping view, so rows would overwrite each other); accepted: an output whose "
                "elements each have their own memory, such as torch.empty_like(q)"
            )
