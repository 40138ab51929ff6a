"""``write`` and ``forward`` as torch custom ops, so ``torch.compile(fullgraph=True)`` keeps them.

Under ``torch.compile``, :meth:`Backend.write` and :meth:`Backend.forward` call
``torch.ops.paged.write`` and ``torch.ops.paged.forward`` instead of running their Python: dynamo
records one opaque call per layer (no graph break) and the compiled graph runs the backend's
ordinary eager path when it gets there, vendor libraries and Triton launches included.

A custom op takes tensors and plain scalars, so the objects of a call travel as what they hold:

- the **backend** as an int handle, given once per instance at construction
  (:func:`register`); ints passed to an op are guarded by dynamo, and this one never changes,
  so the graph compiled for one step serves the next;
- the **cache** as its tensors (``k``, ``v``, the scales for int8/fp8) plus ``kv_dtype``;
- the **batch** as its device tensors (``query_start_loc``, ``seq_lens``, ``block_table``,
  ``slot_mapping``). Its host ints (``max_query_len``, ``max_seq_len``, …) change every step
  and would make dynamo recompile every step, so they never become op arguments: the op finds
  the plan with those very tensors among the last plans :meth:`Backend.plan` returned on that
  instance (every ``plan()`` is remembered) and runs with it, host ints and planned state
  (FlashInfer's wrappers, the split-KV decisions) included.

The contract, then: **call** ``plan = backend.plan(meta, ...)`` **once per step, outside the
compiled region, on every backend** (also those whose plan is the ``BatchMeta`` itself), and pass
the plan or its meta to the compiled step. Without a matching plan the op rebuilds the batch
from its tensors: it reads the host ints from the device (a sync, and refused during a CUDA graph
capture) and a planning backend plans again for every layer: correct, not fast. ``plan()`` stays
on the host; the compiled step runs no Python of ours, so the eager checks run inside the op, at
run time, and their errors surface there.

The cache is written through its own storage: a cache from :func:`allocate_kv_cache` holds one
hidden block past the pool (``KVCache._spill``, where padding rows go without a host sync), and
the write op mutates that storage, of which ``cache.k`` and ``cache.v`` are views. A cache built
around an engine's own tensors is written through the views themselves.
"""

from __future__ import annotations

import collections
import itertools
import weakref
from collections.abc import Callable
from typing import Any, ClassVar, Protocol, cast

import torch

from ._batch import BatchMeta
from ._cache import KVCache
from ._errors import InputError
from ._write import write_kv

__all__ = ["register", "remember", "write", "forward", "write_op", "forward_op", "KEPT_PLANS", "OpBackend"]

#: Plans remembered per backend instance, newest first. One step needs one; a few more let a
#: compiled step use the plan of the step before (an engine double-buffering its batches).
KEPT_PLANS = 4


class OpBackend(Protocol):
    """What the ops use of a backend; :class:`paged_core.Backend` declares it in ``__init__``."""

    name: ClassVar[str]
    #: Its handle, from :func:`register`.
    _op_handle: int
    #: Its last :data:`KEPT_PLANS` ``plan()`` results, newest first (:func:`remember`).
    _op_plans: collections.deque[Any]
    #: Whether its class replaces ``Backend.write`` (then a compiled write needs its plan).
    _op_own_write: bool

    def write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: Any) -> None: ...

    def forward(
        self,
        q: torch.Tensor,
        cache: KVCache,
        meta: Any,
        *,
        scale: float | None,
        window: int,
        softcap: float,
        sinks: torch.Tensor | None,
        out: torch.Tensor | None,
        return_lse: bool,
    ) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]: ...


_backends: weakref.WeakValueDictionary[int, OpBackend] = weakref.WeakValueDictionary()
_handles = itertools.count(1)


def register(backend: OpBackend) -> int:
    """Give ``backend`` its op handle, unique in the process; the registry holds it weakly.

    Called once, by :meth:`Backend.__init__`; :meth:`Backend.plan` then keeps its last
    :data:`KEPT_PLANS` results in ``backend._op_plans`` (:func:`remember`), where the ops find them.
    """
    handle = next(_handles)
    _backends[handle] = backend
    return handle


def remember(backend: OpBackend, plan: Any) -> Any:
    """Keep ``plan`` (what ``backend.plan`` returned) as the newest plan the ops look up; returns it."""
    backend._op_plans.appendleft(plan)
    return plan


# --------------------------------------------------------------------------------- traced side
# These two run while dynamo traces (torch.compiler.is_compiling() is True): only attribute reads
# and the op call, nothing that reads a tensor's data or address.


def write(backend: OpBackend, cache: KVCache, k: torch.Tensor, v: torch.Tensor, meta: Any) -> None:
    """What :meth:`Backend.write` does under ``torch.compile``: one ``paged::write`` call."""
    batch = meta if isinstance(meta, BatchMeta) else meta.meta
    views: tuple[torch.Tensor | None, ...] = (cache.k, cache.v, cache.k_scale, cache.v_scale)
    stores, spill = views, False
    if cache._spill is not None and _spill_holds(cache._spill, views):
        stores = (*cache._spill, None, None)[:4]
        spill = True
    k_store, v_store, ks_store, vs_store = stores
    write_op(
        backend._op_handle,
        k,
        v,
        cast(torch.Tensor, k_store),
        cast(torch.Tensor, v_store),
        ks_store,
        vs_store,
        cache.kv_dtype,
        spill,
        batch.slot_mapping,
    )


def forward(
    backend: OpBackend,
    q: torch.Tensor,
    cache: KVCache,
    meta: Any,
    *,
    scale: float | None,
    window: int,
    softcap: float,
    sinks: torch.Tensor | None,
    out: torch.Tensor | None,
    return_lse: bool,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """What :meth:`Backend.forward` does under ``torch.compile``: one ``paged::forward`` call."""
    batch = meta if isinstance(meta, BatchMeta) else meta.meta
    if out is None:
        out = (
            torch.empty_like(q)
            if cache.head_dim_v == q.shape[2]
            else q.new_empty(q.shape[0], q.shape[1], cache.head_dim_v)
        )
    lse = torch.empty(q.shape[:2], dtype=torch.float32, device=q.device) if return_lse else None
    forward_op(
        backend._op_handle,
        q,
        cache.k,
        cache.v,
        cache.k_scale,
        cache.v_scale,
        cache.kv_dtype,
        batch.query_start_loc,
        batch.seq_lens,
        batch.block_table,
        batch.slot_mapping,
        out,
        lse,
        sinks,
        scale,
        window,
        softcap,
    )
    return (out, cast(torch.Tensor, lse)) if return_lse else out


def _spill_holds(spill: tuple[torch.Tensor, ...], views: tuple[torch.Tensor | None, ...]) -> bool:
    """Whether ``spill`` has the layout of storage one block longer than the views (shapes and
    strides only: what dynamo can read without a tensor's address)."""
    live = [t for t in views if t is not None]
    if len(spill) != len(live):
        return False
    return all(
        s.shape[0] == t.shape[0] + 1 and s.shape[1:] == t.shape[1:] and s.stride() == t.stride() and s.dtype == t.dtype
        for s, t in zip(spill, live, strict=True)
    )


# --------------------------------------------------------------------------------- the ops


@torch.library.custom_op("paged::write", mutates_args=("k_cache", "v_cache", "k_scale", "v_scale"))
def write_op(
    handle: int,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kv_dtype: str,
    spill: bool,
    slot_mapping: torch.Tensor,
) -> None:
    """``backend.write`` of the backend ``handle`` names, into the cache these tensors form.

    ``spill``: the cache tensors are the storage with one hidden block past the pool (the views
    are all but that block). Runs the backend's eager ``write`` with the batch of its remembered
    plan whose ``slot_mapping`` this is; without one, the base :func:`write_kv` (what every
    backend's write does unless it overrides it).
    """
    backend = _backend(handle)
    stores = (k_cache, v_cache, k_scale, v_scale)
    if spill:
        ks_view = None if k_scale is None else k_scale[:-1]
        vs_view = None if v_scale is None else v_scale[:-1]
        cache = KVCache(
            k_cache[:-1],
            v_cache[:-1],
            kv_dtype=kv_dtype,
            k_scale=ks_view,
            v_scale=vs_view,
            dtype=key.dtype,
            _spill=tuple(t for t in stores if t is not None),
        )
    else:
        cache = KVCache(k_cache, v_cache, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale, dtype=key.dtype)
    plan = _remembered(backend, (slot_mapping,), lambda b: (b.slot_mapping,))
    if plan is not None:
        backend.write(cache, key, value, plan)
        return
    if backend._op_own_write:
        raise InputError(
            f"{backend.name}.write ran compiled with a batch this backend never planned, and this "
            "backend writes with its own write(), which needs the batch; call "
            "plan = backend.plan(meta) once per step, outside the compiled region"
        )
    write_kv(cache, key, value, slot_mapping)


@write_op.register_fake
def _write_fake(
    handle: int,
    key: torch.Tensor,
    value: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kv_dtype: str,
    spill: bool,
    slot_mapping: torch.Tensor,
) -> None:
    return None


@torch.library.custom_op("paged::forward", mutates_args=("output", "lse"))
def forward_op(
    handle: int,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kv_dtype: str,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float | None,
    window: int,
    softcap: float,
) -> None:
    """``backend.forward`` of the backend ``handle`` names, into ``output`` (and ``lse``).

    Runs the backend's eager ``forward`` with its remembered plan for this batch (the one whose
    tensors these are), or, without one, a :class:`BatchMeta` rebuilt from the tensors (a sync).
    """
    backend = _backend(handle)
    cache = KVCache(k_cache, v_cache, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale, dtype=q.dtype)
    tensors = (query_start_loc, seq_lens, block_table, slot_mapping)
    plan = _remembered(backend, tensors, lambda b: (b.query_start_loc, b.seq_lens, b.block_table, b.slot_mapping))
    if plan is None:
        plan = _rebuild(*tensors, block_size=cache.block_size)
    result = backend.forward(
        q,
        cache,
        plan,
        scale=scale,
        window=window,
        softcap=softcap,
        sinks=sinks,
        out=output,
        return_lse=lse is not None,
    )
    if lse is not None:
        lse.copy_(result[1])


@forward_op.register_fake
def _forward_fake(
    handle: int,
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    kv_dtype: str,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    output: torch.Tensor,
    lse: torch.Tensor | None,
    sinks: torch.Tensor | None,
    scale: float | None,
    window: int,
    softcap: float,
) -> None:
    return None


# --------------------------------------------------------------------------------- lookups


def _backend(handle: int) -> OpBackend:
    backend = _backends.get(handle)
    if backend is None:
        raise InputError(
            f"no live backend has op handle {handle}: the backend a compiled graph was traced with "
            "is gone; keep the backend alive as long as the compiled function that uses it"
        )
    return backend


def _same(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.data_ptr() == b.data_ptr() and a.shape == b.shape and a.dtype == b.dtype


def _remembered(
    backend: OpBackend,
    tensors: tuple[torch.Tensor, ...],
    fields: Callable[[BatchMeta], tuple[torch.Tensor, ...]],
) -> Any:
    """The newest remembered plan of ``backend`` whose batch holds ``tensors`` (same memory and
    shape), or None."""
    for plan in backend._op_plans:
        batch = plan if isinstance(plan, BatchMeta) else getattr(plan, "meta", None)
        if isinstance(batch, BatchMeta) and all(map(_same, fields(batch), tensors)):
            return plan
    return None


def _rebuild(
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    slot_mapping: torch.Tensor,
    *,
    block_size: int,
) -> BatchMeta:
    """A BatchMeta from the batch's tensors alone: its host ints come from the device."""
    if torch.cuda.is_available() and torch.cuda.is_current_stream_capturing():
        raise InputError(
            "forward ran compiled inside a CUDA graph capture with a batch this backend never "
            "planned, and its host ints (max_seq_len, ...) cannot be read from the device during "
            "capture; call plan = backend.plan(meta) once per step, outside the compiled region"
        )
    qsl_cpu, sl_cpu = query_start_loc.cpu(), seq_lens.cpu()
    qlens = qsl_cpu[1:] - qsl_cpu[:-1]
    return BatchMeta(
        num_reqs=int(seq_lens.shape[0]),
        query_start_loc=query_start_loc,
        seq_lens=seq_lens,
        block_table=block_table,
        slot_mapping=slot_mapping,
        block_size=block_size,
        max_query_len=int(qlens.max()) if qlens.numel() else 0,
        max_seq_len=int(sl_cpu.max()) if sl_cpu.numel() else 0,
        query_start_loc_cpu=qsl_cpu,
        seq_lens_cpu=sl_cpu,
    )
