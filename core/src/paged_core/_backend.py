"""The contract every backend implements.

A backend subclasses :class:`Backend`, declares ``name`` and ``capabilities``, and implements
``_forward``. The public :meth:`Backend.forward` does the shared work once for everyone: it
derives the :class:`AttentionSpec` of the call, refuses what the capabilities do not claim (a
claim is a promise; anything else is an error, never a silently different result), checks the
tensors, and runs the full ``BatchMeta`` validation when validation is on.
"""

from __future__ import annotations

import math
import numbers
import os
from typing import Any, ClassVar

import torch

from . import _ops
from ._batch import BatchMeta
from ._cache import KVCache, allocate_kv_cache, write_kv
from ._errors import InputError, PagedError, UnsupportedSpecError
from ._spec import AttentionSpec, Capabilities, dtype_name

__all__ = ["Backend", "validation_enabled"]


def validation_enabled(validate: bool | None = None) -> bool:
    """Whether to run the checks that copy metadata to the host.

    An explicit ``validate=`` wins; otherwise ``PAGED_VALIDATE=1`` turns them on. Off by default,
    so the per-layer path of a server never syncs with the host.
    """
    if validate is not None:
        return validate
    return os.environ.get("PAGED_VALIDATE", "0").lower() in ("1", "true", "yes", "on")


def _capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream.

    The data checks of ``validate`` copy to the host, which capture forbids; they are skipped
    while capturing and run on the eager warm-up call that capture needs anyway.
    """
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def _device_reasons(spec: AttentionSpec) -> list[str]:
    """A spec for a device this machine does not have cannot be served, whatever is claimed."""
    if spec.device_type == "cuda" and not torch.cuda.is_available():
        return ["the spec asks for a CUDA device, but none is visible (torch.cuda.is_available() is False)"]
    return []


def _shape(t: torch.Tensor) -> str:
    return f"{dtype_name(t.dtype)} {list(t.shape)} on {t.device}"


class Backend:
    """Base class of every attention backend.

    Subclasses set ``name`` and ``capabilities`` and implement :meth:`_forward`; planning backends
    also override :meth:`plan`. Constructor options are keyword-only and validated by the subclass.
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
    ) -> KVCache:
        """Allocate one layer's cache in the layout this backend reads (NHD for all of ours)."""
        return allocate_kv_cache(
            num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, kv_dtype=kv_dtype, device=device
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
            raise InputError(f"cache is a {type(cache).__name__}; accepted: a paged_core.KVCache")
        batch.check_structure()
        if self.validate and not _capturing():
            batch.validate(num_blocks=cache.num_blocks)
        write_kv(cache, k, v, batch.slot_mapping)

    # ----------------------------------------------------------------------------- attention
    def plan(
        self,
        meta: BatchMeta,
        *,
        num_heads: int | None = None,
        num_kv_heads: int | None = None,
        head_dim: int | None = None,
        dtype: torch.dtype | None = None,
        window: int = 0,
        softcap: float = 0.0,
        scale: float | None = None,
    ) -> Any:
        """Prepare a batch once per step; the result is passed to every layer's ``forward``.

        The keywords describe the layers that will use the plan (the same for every layer of a
        step). A backend that plans on the host (FlashInfer) plans with them at once, which a
        CUDA-graph replay needs (it runs no Python); the others accept and ignore them, so one
        call serves every backend. The default plan is the ``BatchMeta`` itself; planning
        backends return an object with a ``meta`` attribute.
        """
        return meta

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
        batch = self._batch_of(meta)
        self._check_inputs(q, cache, batch, window, softcap, sinks, out)
        if scale is not None and (not isinstance(scale, numbers.Real) or isinstance(scale, bool)
                                  or not math.isfinite(scale)):
            raise InputError(f"scale is {scale!r}; accepted: None (head_dim ** -0.5) or a finite float")
        spec = AttentionSpec(
            num_heads=q.shape[1],
            num_kv_heads=cache.num_kv_heads,
            head_dim=q.shape[2],
            block_size=cache.block_size,
            dtype=q.dtype,
            kv_dtype=cache.kv_dtype,
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
        if self.validate and not _capturing():
            batch.validate(num_blocks=cache.num_blocks)
        if out is None:
            out = torch.empty_like(q)
        lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
        if scale is None:
            scale = q.shape[2] ** -0.5
        if meta is not batch and type(self).plan is Backend.plan:
            # Another backend's plan: a backend without its own plan expects the BatchMeta.
            meta = batch
        try:
            self._forward(
                q, cache, meta, out=out, lse=lse, scale=float(scale), window=int(window),
                softcap=float(softcap), sinks=sinks,
            )
        except ValueError as exc:
            # A backend's own launcher refused the arguments (they raise plain ValueError, as
            # vendor code does): keep the promise that every refusal is a PagedError.
            if isinstance(exc, PagedError):
                raise
            raise InputError(f"backend {self.name!r} refused the call: {exc}") from exc
        return (out, lse) if return_lse else out

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
    def _batch_of(self, meta: Any) -> BatchMeta:
        """The BatchMeta of ``meta`` (a BatchMeta or a plan with a ``meta`` attribute)."""
        batch = meta if isinstance(meta, BatchMeta) else getattr(meta, "meta", None)
        if not isinstance(batch, BatchMeta):
            raise InputError(
                f"meta is a {type(meta).__name__}; accepted: a BatchMeta or the result of {self.name}.plan(meta)"
            )
        return batch

    @staticmethod
    def _check_inputs(q, cache, meta, window, softcap, sinks, out) -> None:
        """Host-only checks (no sync, a few microseconds): shapes, dtypes, devices, strides."""
        if not isinstance(q, torch.Tensor) or q.dim() != 3:
            raise InputError(
                f"q is {_shape(q) if isinstance(q, torch.Tensor) else type(q).__name__}; "
                "accepted: a tensor [num_tokens, num_heads, head_dim]"
            )
        if not isinstance(cache, KVCache):
            raise InputError(f"cache is a {type(cache).__name__}; accepted: a paged_core.KVCache")
        if not isinstance(meta.slot_mapping, torch.Tensor) or meta.slot_mapping.dim() == 0:
            meta.check_structure()  # raises the BatchMetaError that names the field
        n, hq, d = q.shape
        if hq == 0:
            raise InputError(f"q is {_shape(q)}, with no heads; accepted: num_heads >= 1")
        if n != meta.num_tokens:
            raise InputError(
                f"q has {n} rows but the batch has {meta.num_tokens} query tokens; accepted: "
                "q.shape[0] == meta.num_tokens (query_start_loc[-1])"
            )
        if d != cache.head_dim:
            raise InputError(f"q has head_dim {d} but the cache has head_dim {cache.head_dim}")
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
        if meta.block_size != cache.block_size:
            raise InputError(
                f"the batch was built for block_size {meta.block_size} but the cache has "
                f"block_size {cache.block_size}"
            )
        for name, t in (("cache.k", cache.k), ("meta.seq_lens", meta.seq_lens),
                        ("meta.block_table", meta.block_table), ("meta.query_start_loc", meta.query_start_loc)):
            if not isinstance(t, torch.Tensor):
                meta.check_structure()  # raises the BatchMetaError that names the field
            if t.device != q.device:
                raise InputError(f"{name} is on {t.device} but q is on {q.device}; accepted: one device")
        if meta.block_table.dtype != torch.int32 or meta.seq_lens.dtype != torch.int32:
            raise InputError(
                f"block_table is {dtype_name(meta.block_table.dtype)} and seq_lens is "
                f"{dtype_name(meta.seq_lens.dtype)}; accepted: int32 for both"
            )
        meta.check_structure()  # host-only: shapes, dtypes and host ints, never a device read
        if not isinstance(window, numbers.Integral) or isinstance(window, bool) or window < 0:
            raise InputError(f"window is {window!r}; accepted: 0 (no window) or a positive int")
        if (not isinstance(softcap, numbers.Real) or isinstance(softcap, bool) or not math.isfinite(softcap)
                or softcap < 0):
            raise InputError(f"softcap is {softcap!r}; accepted: 0 (off) or a positive float")
        if sinks is not None and (
            not isinstance(sinks, torch.Tensor) or tuple(sinks.shape) != (hq,) or sinks.dtype != torch.float32
            or sinks.device != q.device
        ):
            raise InputError(
                f"sinks is {_shape(sinks) if isinstance(sinks, torch.Tensor) else type(sinks).__name__}; "
                f"accepted: float32 [num_heads={hq}] on {q.device}"
            )
        if out is not None and (not isinstance(out, torch.Tensor) or out.shape != q.shape
                                or out.dtype != q.dtype or out.device != q.device or out.stride(-1) != 1):
            found = (f"{_shape(out)} with last-dimension stride {out.stride(-1)}"
                     if isinstance(out, torch.Tensor) else type(out).__name__)
            raise InputError(
                f"out is {found}; accepted: the shape, dtype and device of q ({_shape(q)}), "
                "last-dimension stride 1"
            )
