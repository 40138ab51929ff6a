"""``auto``: the installed backend measured fastest for each step's batch, behind one name.

``paged tune`` (paged-bench) times every installed backend on this machine's batch classes and
writes a tune table; :class:`AutoBackend` reads it and, at ``plan``, hands the step to the backend
that was fastest on the nearest measured batch of the same class and layer. The choice is made
on host ints (the batch's request count, token count and longest sequence), so a CUDA graph
captured on a plan replays the backend it captured. Without a table (or without an entry for the
layer), ``auto`` is its *base*: the backend ``registry.select`` would pick.

``auto`` serves a layer if one of its backends does (the first in the registry's order runs it
where no measurement says otherwise); a backend takes part only if it claims each way of driving
it that the base (``registry.select``'s pick) claims: CUDA-graph capture of ``forward``, of
``plan``. Its claims are otherwise those of the backends' union, less batch invariance (two
batches holding the same request may run on two backends).
The base allocates the cache (every backend of ours reads that layout); the first backend with a
write kernel of its own that takes the cache's format writes it, else ``write_kv``.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import math
import os
import re
import warnings
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

from ._backend import Backend
from ._batch import BatchMeta
from ._cache import KVCache
from ._checks import forward_spec, layer_spec
from ._errors import InputError, PagedError
from ._spec import AttentionSpec, check_spec, dtype_name
from ._write import write_kv

if TYPE_CHECKING:
    from ._registry import Registry

__all__ = ["TUNE_FORMAT", "AutoBackend", "AutoPlan", "TuneTable", "tune_table_path"]

#: The ``format`` field of a tune table (``paged tune`` writes it; ``auto`` reads only this).
TUNE_FORMAT = "paged-tune/1"
#: Overrides where ``auto`` reads, and ``paged tune`` writes, this machine's table.
TUNE_TABLE_ENV = "PAGED_TUNE_TABLE"
#: How an engine drives a backend (capture its forward, or its plan too, in a CUDA graph): a
#: backend other than the base runs steps for ``auto`` only if it claims each of these the base claims.
_ENGINE_FEATURES = ("cuda_graphs", "device_plan")


def device_name() -> str:
    """The name this machine's tune table is kept under: the current CUDA device's, or ``"cpu"``."""
    return torch.cuda.get_device_name() if torch.cuda.is_available() else "cpu"


def tune_table_path(device: str | None = None) -> str:
    """Where the tune table of a device (its name; default: this machine's, :func:`device_name`) lives:
    ``$PAGED_TUNE_TABLE``, else ``$XDG_CACHE_HOME/paged/tune/<device name>.json`` (``~/.cache``
    by default)."""
    explicit = os.environ.get(TUNE_TABLE_ENV)
    if explicit:
        return explicit
    cache = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    name = device_name() if device is None else device
    slug = re.sub(r"[^A-Za-z0-9]+", "-", name).strip("-").lower() or "device"
    return os.path.join(cache, "paged", "tune", f"{slug}.json")


def layer_key(spec: AttentionSpec) -> str:
    """The layer part of a tune entry's key: what the timings of one batch depend on besides it."""
    return (
        f"{spec.num_heads}/{spec.num_kv_heads}x{spec.head_dim}"
        + (f"/{spec.head_dim_v}" if spec.head_dim_v not in (None, spec.head_dim) else "")
        + f" {dtype_name(spec.dtype)} kv={spec.kv_dtype}"
        + (f"/{spec.kv_scales}" if spec.kv_dtype != "auto" else "")
        + f" block={spec.block_size}"
    )


def batch_class(meta: BatchMeta) -> tuple[str, int, int]:
    """``(kind, size, context)`` of a batch from its host ints: ``("decode", requests, longest
    sequence)`` when every request has at most one new token, else ``("mixed", tokens, longest
    sequence)`` (prompts, prefill chunks, verification blocks, and decodes beside them)."""
    if meta.max_query_len <= 1:
        return "decode", meta.num_reqs, meta.max_seq_len
    return "mixed", meta.num_tokens, meta.max_seq_len


@dataclasses.dataclass(frozen=True)
class TuneEntry:
    """One measured batch: its class, the layer it was timed for, and each backend's ms."""

    kind: str
    layer: str
    size: int
    context: int
    ms: dict[str, float]

    def fastest(self, among: Sequence[str]) -> str | None:
        timed = [(self.ms[n], n) for n in among if n in self.ms and math.isfinite(self.ms[n])]
        return min(timed)[1] if timed else None


@dataclasses.dataclass(frozen=True)
class TuneTable:
    """A machine's measured batches (``paged tune`` writes one; :meth:`load` reads it)."""

    device_name: str
    entries: tuple[TuneEntry, ...]
    source: str = ""

    @functools.cached_property
    def _groups(self) -> dict[tuple[str, str], list[TuneEntry]]:
        groups: dict[tuple[str, str], list[TuneEntry]] = {}
        for e in self.entries:
            groups.setdefault((e.kind, e.layer), []).append(e)
        return groups

    def nearest(self, kind: str, layer: str, size: int, context: int) -> TuneEntry | None:
        """The entry of this class and layer closest to ``(size, context)`` on log scales."""
        same = self._groups.get((kind, layer))
        if not same:
            return None
        ls, lc = math.log2(max(size, 1)), math.log2(max(context, 1))
        return min(same, key=lambda e: (math.log2(max(e.size, 1)) - ls) ** 2 + (math.log2(max(e.context, 1)) - lc) ** 2)

    def to_json(self) -> dict[str, Any]:
        return {
            "format": TUNE_FORMAT,
            "device_name": self.device_name,
            "entries": [dataclasses.asdict(e) for e in self.entries],
        }

    @classmethod
    def load(cls, path: str) -> TuneTable:
        """Read a table ``paged tune`` wrote; anything else is an :class:`InputError` saying what."""

        def bad(what: str) -> InputError:
            return InputError(
                f"{path}: not a tune table written by paged tune ({what}); accepted: the file "
                f"`paged tune` writes (run it again to get one, or unset {TUNE_TABLE_ENV})"
            )

        try:
            with open(path) as f:
                data = json.load(f)
        except (OSError, ValueError) as exc:
            raise bad(f"{type(exc).__name__}: {exc}") from exc
        if not isinstance(data, dict) or data.get("format") != TUNE_FORMAT:
            raise bad(f"its format is not {TUNE_FORMAT!r}")
        if not isinstance(data.get("device_name"), str) or not isinstance(data.get("entries"), list):
            raise bad("it needs a device_name string and an entries list")
        entries = []
        for i, e in enumerate(data["entries"]):
            try:
                ms = {str(k): float(v) for k, v in e["ms"].items()}
                entry = TuneEntry(str(e["kind"]), str(e["layer"]), int(e["size"]), int(e["context"]), ms)
            except (KeyError, TypeError, ValueError, AttributeError) as exc:
                raise bad(f"entry {i}: {type(exc).__name__}: {exc}") from exc
            if entry.kind not in ("decode", "mixed") or entry.size < 1 or entry.context < 1:
                raise bad(f"entry {i}: kind {entry.kind!r}, size {entry.size}, context {entry.context}")
            entries.append(entry)
        return cls(data["device_name"], tuple(entries), source=path)


@dataclasses.dataclass
class AutoPlan:
    """What :meth:`AutoBackend.plan` returns: the step's backend, its own plan, and why. Planned
    without the layer keywords, the backend is chosen at the step's first ``forward`` of each
    layer shape instead (``backend`` None; ``resolved`` keeps each choice and its plan)."""

    meta: BatchMeta
    backend: Backend | None
    inner: Any
    why: str
    resolved: dict[AttentionSpec, tuple[Backend, Any, str]] = dataclasses.field(default_factory=dict)

    @property
    def choice(self) -> str | None:
        """The chosen backend's name (None before the first forward of a deferred plan)."""
        if self.backend is not None:
            return self.backend.name
        names = {b.name for b, _, _ in self.resolved.values()}
        return names.pop() if len(names) == 1 else None


class AutoBackend(Backend):
    """The installed backend measured fastest for each batch (module doc); see ``paged tune``.

    ``candidates``: the backend names it may choose from (default: every available registered
    backend but itself and deprecated aliases); the first of them that ``registry.select`` ranks
    highest is the base. ``table``: a tune table's path (default: :func:`tune_table_path`; a
    missing file means none). ``registry``: whose backends it chooses from (``registry.get``
    passes itself; default: ``paged_core.registry``).
    """

    name = "auto"
    listing = (
        "runs each batch on the available backend listed here measured fastest for it (paged tune), "
        "else on the registry's first; serves a layer one of them serves, with the first's engine features"
    )

    def __init__(
        self,
        *,
        candidates: Sequence[str] | None = None,
        table: str | os.PathLike[str] | None = None,
        registry: Registry | None = None,
        validate: bool | None = None,
    ) -> None:
        if registry is None:
            from ._registry import registry as default

            registry = default

        if candidates is not None and (isinstance(candidates, str) or not all(isinstance(c, str) for c in candidates)):
            raise InputError(f"candidates is {candidates!r}; accepted: a sequence of backend names, or None")
        names = [n for n in registry.names() if n != self.name] if candidates is None else list(candidates)
        if self.name in names:
            raise InputError("candidates names auto itself; accepted: other backends' names")
        self.backends: dict[str, Backend] = {}
        for n in names:
            if candidates is None and registry.unavailable(n):
                continue
            with warnings.catch_warnings():
                warnings.simplefilter("error", DeprecationWarning)
                try:
                    backend = registry.get(n)
                except DeprecationWarning:
                    continue  # an alias of another candidate: never a choice of its own
                except PagedError:
                    if candidates is not None:
                        raise
                    continue  # not constructible with its defaults here: not a candidate
            self.backends[n] = backend
        if not self.backends:
            raise PagedError(
                "auto has no backend to choose from"
                + (f" (candidates {list(candidates)})" if candidates is not None else "")
                + "; accepted: an installed, available backend (paged list shows them)"
            )
        #: The first backend (registry order): how engines may drive auto is what it claims.
        self.base = next(iter(self.backends.values()))
        base_caps = self.base.capabilities
        #: The backends that may run a step, in the registry's order (the base first).
        self.pool = [
            b
            for b in self.backends.values()
            if all(getattr(b.capabilities, f) or not getattr(base_caps, f) for f in _ENGINE_FEATURES)
        ]
        super().__init__(validate=validate)
        self.capabilities = dataclasses.replace(base_caps, batch_invariant=False)
        path = os.fspath(table) if table is not None else tune_table_path()
        #: The tune table read at construction (None: no file, every step runs on the base).
        self.table: TuneTable | None = TuneTable.load(path) if os.path.exists(path) else None
        if table is not None and self.table is None:
            raise InputError(f"table {path!r} does not exist; accepted: a file `paged tune` wrote, or leave it out")
        if self.table is not None and self.table.device_name != device_name():
            warnings.warn(
                f"auto: the tune table {path} was measured on {self.table.device_name}, this machine is "
                f"{device_name()}: its choices may not be the fastest here (run paged tune on this machine)",
                stacklevel=2,
            )
        self._per_spec: dict[AttentionSpec | None, tuple[list[Backend], str]] = {}
        self._writers: dict[tuple, Backend | None] = {}

    @classmethod
    def unavailable(cls) -> list[str]:
        from ._registry import registry

        others = [n for n in registry.names() if n != cls.name]
        if any(not registry.unavailable(n) for n in others):
            return []
        return ["no other backend is available to choose from (paged list shows why each is not)"]

    def reasons(self, spec: AttentionSpec) -> list[str]:
        """Empty if a backend of the pool serves ``spec``; else each one's reasons, by name."""
        check_spec(spec)
        if spec not in self._reasons:
            each = [(b.name, b.reasons(spec)) for b in self.pool]
            ok = any(not r for _, r in each)
            self._reasons[spec] = [] if ok else [f"{n}: {'; '.join(r)}" for n, r in each]
        return list(self._reasons[spec])

    def eligible(self, spec: AttentionSpec | None) -> list[Backend]:
        """The backends of the pool that serve ``spec``'s layer, in the registry's order (None:
        the base alone)."""
        if spec is None:
            return [self.base]
        return [b for b in self.pool if not b.reasons(spec)]

    def writer(self, cache: KVCache) -> Backend | None:
        """The backend whose write kernel writes ``cache``: the first with a write of its own (a
        few microseconds of host work instead of ``write_kv``'s PyTorch ops) that takes the
        cache's format; None: ``write_kv``. Every write stores the same bytes (``Backend._write``)."""
        key = (cache.kv_dtype, cache.kv_scales, cache.device.type)
        if key not in self._writers:
            own = [
                b
                for b in self.backends.values()
                if b.writes_on_device
                and cache.kv_dtype in b.capabilities.kv_dtypes
                and (cache.kv_dtype == "auto" or cache.kv_scales in b.capabilities.kv_scales)
                and cache.device.type in b.capabilities.devices
            ]
            self._writers[key] = own[0] if own else None
        return self._writers[key]

    @property
    def writes_on_device(self) -> bool:
        """True when a write kernel takes every cache format a backend of the pool reads."""
        kernels = [b for b in self.backends.values() if b.writes_on_device]
        formats = {(kv, sc) for b in self.pool for kv in b.capabilities.kv_dtypes for sc in b.capabilities.kv_scales}
        return any(
            all(
                kv in k.capabilities.kv_dtypes and (kv == "auto" or sc in k.capabilities.kv_scales)
                for kv, sc in formats
            )
            for k in kernels
        )

    def _write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        writer = self.writer(cache)
        if writer is None:
            write_kv(cache, k, v, slot_mapping)
        else:
            writer._write(cache, k, v, slot_mapping)

    def choose(self, meta: BatchMeta, spec: AttentionSpec | None) -> tuple[Backend, str]:
        """The backend for ``meta``'s batch and why; a function of host ints and the layer only.
        Per step: a lookup among the table's entries of the layer (what depends on the layer
        alone is kept per spec, so nothing grows with the batches an engine sees)."""
        kind, size, context = batch_class(meta)
        known = self._per_spec.get(spec)
        if known is None:
            eligible = self.eligible(spec) or [self.base]
            known = self._per_spec[spec] = (eligible, layer_key(spec) if spec is not None else "")
        eligible, layer = known
        first = eligible[0]
        if self.table is None or spec is None:
            return first, f"{first.name}: the registry's first choice for the layer (no tune table)"
        entry = self.table.nearest(kind, layer, size, context)
        best = entry.fastest([b.name for b in eligible]) if entry is not None else None
        if entry is None or best is None:
            return first, f"{first.name}: the tune table has no {kind} entry for {layer}"
        pick = next(b for b in eligible if b.name == best)
        why = (
            f"{best}: fastest on the nearest measured {kind} batch ({entry.size} x {entry.context}, "
            f"{entry.ms[best]:.4g} ms) in {self.table.source}"
        )
        return pick, why

    def _plan(self, meta: BatchMeta, **layer: Any) -> AutoPlan:
        spec = layer_spec(self.capabilities, meta, layer)
        if spec is None:
            why = "chosen at the first forward of each layer shape (plan() got no num_heads, num_kv_heads, head_dim)"
            return AutoPlan(meta=meta, backend=None, inner=None, why=why)
        backend, why = self.choose(meta, spec)
        return AutoPlan(meta=meta, backend=backend, inner=backend.plan(meta, **layer), why=why)

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
        if isinstance(plan, AutoPlan) and plan.backend is not None:
            backend, inner = plan.backend, plan.inner
        else:
            # The layer is known now: choose for it (once per layer shape and plan).
            meta = plan.meta if isinstance(plan, AutoPlan) else plan
            spec = forward_spec(
                q.shape[1], q.shape[2], q.dtype, q.device.type, cache, meta, window, softcap, sinks is not None,
                lse is not None,
            )  # fmt: skip
            hit = plan.resolved.get(spec) if isinstance(plan, AutoPlan) else None
            if hit is None:
                backend, why = self.choose(meta, spec)
                # A BatchMeta is what every backend's forward takes without a plan of its own.
                inner = backend.plan(meta, **_plan_keywords(spec)) if isinstance(plan, AutoPlan) else meta
                hit = (backend, inner, why)
                if isinstance(plan, AutoPlan):
                    plan.resolved[spec] = hit
            backend, inner = hit[0], hit[1]
        backend._forward(q, cache, inner, out=out, lse=lse, scale=scale, window=window, softcap=softcap, sinks=sinks)


def _plan_keywords(spec: AttentionSpec) -> dict[str, Any]:
    """The ``plan`` keywords that describe ``spec``'s layer."""
    return dict(
        num_heads=spec.num_heads,
        num_kv_heads=spec.num_kv_heads,
        head_dim=spec.head_dim,
        head_dim_v=spec.head_dim_v,
        dtype=spec.dtype,
        kv_dtype=spec.kv_dtype,
        kv_scales=spec.kv_scales,
        window=spec.window,
        softcap=spec.softcap,
        sinks=spec.sinks,
    )
