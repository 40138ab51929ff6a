"""``auto``: the installed backend measured fastest for each step's batch, behind one name.

``paged tune`` (paged-bench) times every installed backend on this machine's batch classes and
writes a tune table; :class:`AutoBackend` reads it and, at ``plan``, hands the step to the backend
that was fastest on the nearest measured batch of the same class and layer. The choice is made
on host ints (the batch's request count, token count and longest sequence), so a CUDA graph
captured on a plan replays the backend it captured. Without a table (or without an entry for the
layer), ``auto`` is its *base*: the backend ``registry.select`` would pick.

What ``auto`` claims is what its base claims, less batch invariance (two batches holding the same
request may run on two backends). Another backend runs a step only if it serves the step's layer
(the ``plan`` keywords) and claims every feature the base claims (window, soft-cap, sinks, LSE,
CUDA graphs, device plans), so no call the base accepts is refused or computed differently.
The base allocates the cache (every backend of ours reads that layout); the first candidate with a
write kernel of its own writes it.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
import re
import warnings
from collections.abc import Sequence
from typing import Any

import torch

from ._backend import Backend
from ._batch import BatchMeta
from ._cache import KVCache
from ._checks import layer_spec
from ._errors import InputError, PagedError
from ._spec import AttentionSpec, dtype_name

__all__ = ["TUNE_FORMAT", "AutoBackend", "AutoPlan", "TuneTable", "tune_table_path"]

#: The ``format`` field of a tune table (``paged tune`` writes it; ``auto`` reads only this).
TUNE_FORMAT = "paged-tune/1"
#: Overrides where ``auto`` reads, and ``paged tune`` writes, this machine's table.
TUNE_TABLE_ENV = "PAGED_TUNE_TABLE"
#: The features a backend other than the base must also claim to run a step for ``auto``.
_FEATURES = ("sliding_window", "softcap", "sinks", "mixed_batches", "returns_lse", "cuda_graphs", "device_plan")


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

    def nearest(self, kind: str, layer: str, size: int, context: int) -> TuneEntry | None:
        """The entry of this class and layer closest to ``(size, context)`` on log scales."""
        same = [e for e in self.entries if e.kind == kind and e.layer == layer]
        if not same:
            return None

        def distance(e: TuneEntry) -> float:
            return math.log2(max(e.size, 1) / max(size, 1)) ** 2 + math.log2(max(e.context, 1) / max(context, 1)) ** 2

        return min(same, key=distance)

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
    """What :meth:`AutoBackend.plan` returns: the step's backend, its own plan, and why."""

    meta: BatchMeta
    backend: Backend
    inner: Any
    why: str

    @property
    def choice(self) -> str:
        return self.backend.name


class AutoBackend(Backend):
    """The installed backend measured fastest for each batch (module doc); see ``paged tune``.

    ``candidates``: the backend names it may choose from (default: every available registered
    backend but itself and deprecated aliases); the first of them that ``registry.select`` ranks
    highest is the base. ``table``: a tune table's path (default: :func:`tune_table_path`; a
    missing file means none).
    """

    name = "auto"

    def __init__(
        self,
        *,
        candidates: Sequence[str] | None = None,
        table: str | os.PathLike[str] | None = None,
        validate: bool | None = None,
    ) -> None:
        from ._registry import registry

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
            self.backends[n] = backend
        if not self.backends:
            raise PagedError(
                "auto has no backend to choose from"
                + (f" (candidates {list(candidates)})" if candidates is not None else "")
                + "; accepted: an installed, available backend (paged list shows them)"
            )
        #: The backend that runs every step no measurement assigns elsewhere.
        self.base = next(iter(self.backends.values()))
        super().__init__(validate=validate)
        self.capabilities = dataclasses.replace(self.base.capabilities, batch_invariant=False)
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
        self._choices: dict[tuple, tuple[Backend, str]] = {}
        self._writers: dict[tuple, Backend] = {}

    @classmethod
    def unavailable(cls) -> list[str]:
        from ._registry import registry

        others = [n for n in registry.names() if n != cls.name]
        if any(not registry.unavailable(n) for n in others):
            return []
        return ["no other backend is available to choose from (paged list shows why each is not)"]

    def extra_reasons(self, spec: AttentionSpec) -> list[str]:
        return self.base.extra_reasons(spec)

    def writer(self, cache: KVCache) -> Backend:
        """The backend that writes ``cache``: the first candidate with a write of its own (a
        kernel: a few microseconds of host work instead of ``write_kv``'s PyTorch ops) that takes
        the cache's format, else the base. Every write stores the same bytes (``Backend._write``)."""
        key = (cache.kv_dtype, cache.kv_scales, cache.device.type)
        if key not in self._writers:
            own = [
                b
                for b in self.backends.values()
                if type(b)._write is not Backend._write
                and cache.kv_dtype in b.capabilities.kv_dtypes
                and (cache.kv_dtype == "auto" or cache.kv_scales in b.capabilities.kv_scales)
                and cache.device.type in b.capabilities.devices
            ]
            self._writers[key] = own[0] if own else self.base
        return self._writers[key]

    def _write(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        self.writer(cache)._write(cache, k, v, slot_mapping)

    def eligible(self, spec: AttentionSpec | None) -> list[Backend]:
        """The backends that may run a step of ``spec``'s layer: the base, and every other that
        serves the layer and claims each feature the base claims (None: the base alone)."""
        if spec is None:
            return [self.base]
        base_caps = self.base.capabilities
        out = [self.base]
        for b in self.backends.values():
            if b is self.base or b.reasons(spec):
                continue
            if all(getattr(b.capabilities, f) or not getattr(base_caps, f) for f in _FEATURES):
                out.append(b)
        return out

    def choose(self, meta: BatchMeta, spec: AttentionSpec | None) -> tuple[Backend, str]:
        """The backend for ``meta``'s batch and why; a function of host ints and the layer only."""
        kind, size, context = batch_class(meta)
        key = (kind, size, context, spec)
        hit = self._choices.get(key)
        if hit is not None:
            return hit
        pick, why = self.base, f"{self.base.name}: the registry's first choice (no tune table)"
        if self.table is not None and spec is not None:
            layer = layer_key(spec)
            entry = self.table.nearest(kind, layer, size, context)
            eligible = self.eligible(spec)
            best = entry.fastest([b.name for b in eligible]) if entry is not None else None
            if entry is None or best is None:
                why = f"{self.base.name}: the tune table has no {kind} entry for {layer}"
            else:
                pick = next(b for b in eligible if b.name == best)
                why = (
                    f"{best}: fastest on the nearest measured {kind} batch ({entry.size} x {entry.context}, "
                    f"{entry.ms[best]:.4g} ms) in {self.table.source}"
                )
        self._choices[key] = (pick, why)
        return pick, why

    def _plan(self, meta: BatchMeta, **layer: Any) -> AutoPlan:
        spec = layer_spec(self.capabilities, meta, layer)
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
        if isinstance(plan, AutoPlan):
            backend, inner = plan.backend, plan.inner
        else:  # a BatchMeta: forward without a plan runs on the base
            backend, inner = self.base, plan
        backend._forward(q, cache, inner, out=out, lse=lse, scale=scale, window=window, softcap=softcap, sinks=sinks)
