"""The host checks of :class:`Backend`'s entry points, and the memo that runs ``forward``'s once.

Every refusal of the contract happens here, before any backend code runs: a layer outside the
capabilities is an :class:`UnsupportedSpecError` (a claim is a promise), anything malformed an
:class:`InputError` that says what was wrong and what is accepted. No check reads a device value.

The layers of one step pass the same batch, caches of one layout and ``q``/``out`` of one shape,
so their checks give the same answer: :func:`check_forward` runs them once per distinct call and
remembers the call by the very facts they read. The checks read a tensor argument only through
:func:`tensor_facts`, the cache by its layout and the batch by the generation of its own cached
structure check, and the scalars by value; the memo key is made of exactly those, so a check
cannot depend on something the key leaves out.
"""

from __future__ import annotations

import functools
import inspect
import numbers
import os
from typing import Any, ClassVar, Protocol, cast

import torch

from ._batch import BatchMeta, _is_int
from ._cache import KVCache, byte_span
from ._errors import InputError, UnsupportedSpecError
from ._spec import INT32_LIMIT, KV_DTYPES, KV_SCALES, AttentionSpec, Capabilities, KVDtype, check_dtype, dtype_name

__all__ = [
    "PLAN_KEYWORDS",
    "batch_of",
    "check_batch",
    "capturing",
    "check_call",
    "check_forward",
    "check_inputs",
    "check_out_memory",
    "check_plan",
    "check_write",
    "device_reasons",
    "tensor_facts",
    "validate_call",
    "validation_enabled",
]

#: The layer keywords every backend's ``plan`` accepts: the description of the layers that will
#: run the plan (the same for every layer of a step).
PLAN_KEYWORDS = (
    "num_heads",
    "num_kv_heads",
    "head_dim",
    "head_dim_v",
    "dtype",
    "kv_dtype",
    "kv_scales",
    "window",
    "softcap",
    "scale",
    "sinks",
)

# Entries of a backend's memo before it is emptied: layers x shapes of a few live steps.
CHECKED_CALLS_MAX = 4096

# The float32 range of the kernels' scalars: the largest finite value and the smallest normal one.
_F32_MAX = float(torch.finfo(torch.float32).max)
_F32_TINY = float(torch.finfo(torch.float32).tiny)
# The largest soft-cap: kernels fold log2(e) into it, which must stay finite in float32.
SOFTCAP_MAX = _F32_MAX / 2


class _Checked(Protocol):
    """What the checks read of a backend (:class:`paged_core.Backend`)."""

    name: ClassVar[str]
    capabilities: Capabilities

    def reasons(self, spec: AttentionSpec) -> list[str]: ...


def validation_enabled(validate: bool | None = None) -> bool:
    """Whether to run the checks that copy metadata to the host.

    An explicit ``validate=`` wins; otherwise ``PAGED_VALIDATE=1`` turns them on. Off by default,
    so the per-layer path of a server never syncs with the host.
    """
    if validate is not None:
        if not isinstance(validate, bool):
            raise InputError(f"validate is {validate!r}; accepted: True, False, or None (PAGED_VALIDATE decides)")
        return validate
    return os.environ.get("PAGED_VALIDATE", "0").lower() in ("1", "true", "yes", "on")


def capturing() -> bool:
    """Whether a CUDA graph is being captured on the current stream.

    The data checks of ``validate`` copy to the host, which capture forbids; they are skipped
    while capturing and run on the eager warm-up call that capture needs anyway.
    """
    return torch.cuda.is_available() and torch.cuda.is_current_stream_capturing()


def device_reasons(spec: AttentionSpec) -> list[str]:
    """A spec for a device this machine does not have cannot be served, whatever is claimed."""
    if spec.device_type == "cuda" and not torch.cuda.is_available():
        return ["the spec asks for a CUDA device, but none is visible (torch.cuda.is_available() is False)"]
    return []


def batch_of(backend: _Checked, meta: Any) -> BatchMeta:
    """The BatchMeta of ``meta`` (a BatchMeta or a plan with a ``meta`` attribute)."""
    batch = meta if isinstance(meta, BatchMeta) else getattr(meta, "meta", None)
    if not isinstance(batch, BatchMeta):
        raise InputError(
            f"meta is a {type(meta).__name__}; accepted: a BatchMeta or the result of {backend.name}.plan(meta)"
        )
    return batch


def check_batch(meta: Any, *, mirrors: bool = True) -> BatchMeta:
    """``meta`` as a structurally sound :class:`BatchMeta`, or an error that says what it is
    (host only, cached per object: :meth:`BatchMeta.check_structure`)."""
    if not isinstance(meta, BatchMeta):
        raise InputError(f"meta is {_described(meta)}; accepted: a paged_core.BatchMeta")
    # Shapes, dtypes, one device, host ints: a BatchMetaError naming the field.
    return meta._structure(mirrors=mirrors)


def tensor_facts(t: torch.Tensor) -> tuple:
    """``(shape, dtype, device, strides)``: all the checks read of a tensor argument (``q``,
    ``sinks``, ``out``), and all the memo keeps of it."""
    # stride() costs half of stride(-1) (argument parsing); the checks read only its last entry.
    return (t.shape, t.dtype, t.device, t.stride())


def _described(x: Any) -> str:
    if not isinstance(x, torch.Tensor):
        return f"a {type(x).__name__}"
    shape, dtype, device, _ = tensor_facts(x)
    return f"{dtype_name(dtype)} {list(shape)} on {device}"


# ------------------------------------------------------------------------------------- write
def check_write(backend: _Checked, seen: set[tuple], cache: Any, meta: Any) -> BatchMeta:
    """The cache and batch of ``write``: types, structure, the cache against the capabilities
    (the backend's own reasons), and that they belong together. Returns the batch.

    A write into a cache the backend does not claim (an int4 cache for FlashInfer) is refused
    as ``forward`` would refuse to read it, before anything is written. ``seen`` (the backend's
    memo, shared with :func:`check_forward`) remembers the cache layouts already accepted.
    """
    batch = batch_of(backend, meta)
    if not isinstance(cache, KVCache):
        raise InputError(f"cache is {_described(cache)}; accepted: a paged_core.KVCache")
    cache.check()
    key = ("write", cache._layout)
    if key not in seen:
        reasons = backend.reasons(_cache_spec(backend.capabilities, cache))
        if reasons:
            raise UnsupportedSpecError(backend.name, reasons)
        if len(seen) >= CHECKED_CALLS_MAX:
            seen.clear()
        seen.add(key)
    batch.check_structure()
    _check_batch_fits(batch, cache)
    return batch


def _cache_spec(caps: Capabilities, cache: KVCache) -> AttentionSpec:
    """The spec of a layer over ``cache``: the cache's facts (dtypes, scales, head dims, block
    size, device); for what a write does not know (query heads, the batch's shape), values the
    backend takes, so only the cache can be refused, as in :func:`_check_layer`."""
    group = min(caps.group_sizes) if caps.group_sizes else 1
    return AttentionSpec(
        num_heads=cache.num_kv_heads * group,
        num_kv_heads=cache.num_kv_heads,
        head_dim=cache.head_dim,
        block_size=cache.block_size,
        dtype=cache.dtype,
        kv_dtype=cast(KVDtype, cache.kv_dtype),
        # What check() just found ("per_slot" for a full-precision cache too, which has none).
        kv_scales=cache._kv_scales,
        device=cache.device.type,
        # Every backend reads decode steps; a cache some batch can be read from is writable.
        decode_only=True,
        head_dim_v=cache.head_dim_v,
    )


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


# ------------------------------------------------------------------------------------- plan
@functools.cache
def _plan_params(cls: Any) -> tuple[frozenset[str], bool]:
    """The keywords ``cls._plan`` declares, and whether it takes ``**kwargs`` (read once per class)."""
    params = inspect.signature(cls._plan).parameters.values()
    names = frozenset(
        p.name for p in params if p.kind in (p.KEYWORD_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name not in ("self", "meta")
    )
    return names, any(p.kind is p.VAR_KEYWORD for p in params)


def check_plan(backend: _Checked, meta: Any, layer: dict[str, Any]) -> dict[str, Any]:
    """The batch and layer keywords of ``plan``; returns the keywords ``_plan`` takes."""
    check_batch(meta)
    names, takes_any = _plan_params(type(backend))
    unknown = sorted(k for k in layer if k not in PLAN_KEYWORDS and k not in names)
    if unknown:
        accepted = ", ".join([*PLAN_KEYWORDS, *sorted(names - set(PLAN_KEYWORDS))])
        raise InputError(
            f"{backend.name}.plan() got unknown keyword(s) {', '.join(unknown)}; accepted: {accepted} "
            "(check the spelling)"
        )
    _check_layer(backend, meta, layer)
    return layer if takes_any else {k: v for k, v in layer.items() if k in names}


def _check_layer(backend: _Checked, meta: BatchMeta, layer: dict[str, Any]) -> None:
    """The layer keywords of ``plan``: their types, then the spec they describe."""
    for name in ("num_heads", "num_kv_heads", "head_dim", "head_dim_v"):
        v = layer.get(name)
        if v is not None and (not _is_int(v) or v < 1):
            raise InputError(f"{name} is {v!r}; accepted: a positive int (or leave it out)")
    dtype, kv_dtype = layer.get("dtype"), layer.get("kv_dtype")
    if dtype is not None and not isinstance(dtype, torch.dtype):
        # The type only: a torch dtype the backend lacks is an UnsupportedSpecError below.
        check_dtype("dtype", dtype, sorted(backend.capabilities.dtypes, key=str))
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
    spec = layer_spec(backend.capabilities, meta, layer)
    if spec is None:
        return  # not enough to describe a spec; forward checks the layer it gets
    reasons = backend.reasons(spec)
    if reasons:
        raise UnsupportedSpecError(backend.name, reasons)


def layer_spec(caps: Capabilities, meta: BatchMeta, layer: dict[str, Any]) -> AttentionSpec | None:
    """The spec that checked ``plan`` keywords describe for ``meta``'s batch, or None without
    ``num_heads``, ``num_kv_heads`` and ``head_dim``. A ``dtype`` or ``kv_dtype`` left out is one
    that ``caps`` takes, so only what was given can be refused."""
    if any(layer.get(n) is None for n in ("num_heads", "num_kv_heads", "head_dim")):
        return None
    dtype, kv_dtype = layer.get("dtype"), layer.get("kv_dtype")
    return AttentionSpec(
        num_heads=layer["num_heads"],
        num_kv_heads=layer["num_kv_heads"],
        head_dim=layer["head_dim"],
        block_size=meta.block_size,
        # Not given: one the backend takes, so only what was given can be refused.
        dtype=dtype if dtype is not None else min(caps.dtypes, key=dtype_name, default=torch.bfloat16),
        kv_dtype=kv_dtype
        if kv_dtype is not None
        else ("auto" if "auto" in caps.kv_dtypes else cast(KVDtype, min(caps.kv_dtypes, default="auto"))),
        kv_scales=layer.get("kv_scales", "per_slot"),
        window=int(layer.get("window", 0)),
        softcap=float(layer.get("softcap", 0.0)),
        sinks=layer.get("sinks", False),
        device=meta.device.type,
        decode_only=meta.decode_only,
        head_dim_v=layer.get("head_dim_v"),
    )


def _check_scalars(window: Any, softcap: Any, scale: Any) -> None:
    """The host scalars of a layer, shared by ``plan`` and ``forward``: in the ranges the kernels
    compute in (float32 scalars, an int32 window)."""
    # Fast path for the plain int/float every caller passes: isinstance against the numbers
    # ABCs costs microseconds, and this runs on every layer call.
    if (
        type(window) is int
        and 0 <= window < INT32_LIMIT
        and type(softcap) in (float, int)
        and (softcap == 0 or _F32_TINY <= softcap <= SOFTCAP_MAX)
        and (scale is None or (type(scale) in (float, int) and -_F32_MAX <= scale <= _F32_MAX))
    ):
        return
    if not _is_int(window) or not 0 <= window < INT32_LIMIT:
        raise InputError(
            f"window is {window!r}; accepted: 0 (no window) or a positive int below 2**31 (a window "
            "at least as long as the longest sequence is no window: pass 0)"
        )
    if (
        not isinstance(softcap, numbers.Real)
        or isinstance(softcap, bool)
        or not (softcap == 0 or _F32_TINY <= float(softcap) <= SOFTCAP_MAX)
    ):
        raise InputError(
            f"softcap is {softcap!r}; accepted: 0 (off) or a positive finite float32 from {_F32_TINY:.4g} to "
            f"{SOFTCAP_MAX:.4g} (the kernels compute in float32; a cap that large is no cap)"
        )
    if scale is not None and (
        not isinstance(scale, numbers.Real) or isinstance(scale, bool) or not -_F32_MAX <= float(scale) <= _F32_MAX
    ):
        raise InputError(
            f"scale is {scale!r}; accepted: None (head_dim ** -0.5) or a finite float32 (magnitude at "
            f"most {_F32_MAX:.4g}: the kernels compute in float32)"
        )


def _overlaps_itself(shape: tuple, strides: tuple) -> bool:
    """Whether two elements of a tensor of ``shape`` and ``strides`` may share memory: its
    dimensions of more than one element, by increasing stride, must each step past everything
    the smaller ones cover (an empty tensor has no elements to share)."""
    if 0 in shape:
        return False
    covered = 1
    for stride, n in sorted((st, n) for st, n in zip(strides, shape, strict=True) if n > 1):
        if stride < covered:
            return True
        covered += stride * (n - 1)
    return False


def check_out_memory(out: torch.Tensor, cache: KVCache) -> None:
    """Refuse an ``out`` that shares memory with the cache (the batch may read what it writes).
    Pointers differ per layer, so this runs outside the memo; the cache's spans are computed
    once per checked cache (``KVCache.check``)."""
    if not out.numel():
        return
    lo, hi = byte_span(out)
    for name, t_lo, t_hi in cache._spans:
        if lo < t_hi and t_lo < hi:
            raise InputError(
                f"out overlaps the cache's memory (cache.{name}); the kernels would read keys they "
                "are overwriting; accepted: an output outside the cache, such as torch.empty_like(q)"
            )


# ------------------------------------------------------------------------------------- forward
# The caller's values are typed Any here: refusing one of the wrong type is what these checks are for.
def check_forward(
    backend: _Checked,
    seen: set[tuple],
    q: Any,
    cache: Any,
    batch: BatchMeta,
    window: Any,
    softcap: Any,
    scale: Any,
    sinks: Any,
    out: Any,
    return_lse: Any,
) -> None:
    """Run :func:`check_call` unless ``seen`` (the backend's memo) holds this call's facts.

    The key is the cache's layout, the batch's generation (a number no other check ever had, so a
    new batch or a reassigned field is a new key), :func:`tensor_facts` of ``q``, ``sinks`` and
    ``out``, and the scalars by value and type (NaN never matches, so it is refused every time).
    Odd types (a tensor subclass, a numpy scalar) take the full checks on every call; a refusal
    is never remembered.
    """
    key = None
    if type(q) is torch.Tensor and isinstance(cache, KVCache):
        cache.check()  # in the order check_call checks: the same first error either way
        batch.check_structure()
        if (
            type(window) is int
            and type(softcap) in (float, int)
            and (scale is None or type(scale) in (float, int))
            and (sinks is None or type(sinks) is torch.Tensor)
            and (out is None or type(out) is torch.Tensor)
            and type(return_lse) is bool
        ):
            key = (
                cache._layout,
                batch._generation,
                tensor_facts(q),
                window,
                type(softcap),
                softcap,
                type(scale),
                scale,
                None if sinks is None else tensor_facts(sinks),
                None if out is None else tensor_facts(out),
                return_lse,
            )
            if key in seen:
                return
    check_call(backend, q, cache, batch, window, softcap, scale, sinks, out, return_lse)
    if key is not None:
        if len(seen) >= CHECKED_CALLS_MAX:
            seen.clear()  # old steps' batches; the live ones are checked again once
        seen.add(key)


def check_call(
    backend: _Checked,
    q: Any,
    cache: Any,
    meta: BatchMeta,
    window: Any,
    softcap: Any,
    scale: Any,
    sinks: Any,
    out: Any,
    return_lse: Any,
) -> None:
    """Every host-side check of a ``forward`` call: the inputs, then the spec they make.

    No device read and no sync: the structure of the cache and of the batch is checked once per
    object (cached), the rest is a few attribute compares (microseconds per call).
    """
    check_inputs(q, cache, meta, window, softcap, scale, sinks)
    q_shape, q_dtype, dev, _ = tensor_facts(q)
    n, hq, d = q_shape
    dv = cache.head_dim_v
    if out is not None and (not isinstance(out, torch.Tensor) or _wrong_out(tensor_facts(out), tensor_facts(q), dv)):
        found = (
            f"{_described(out)} with last-dimension stride {tensor_facts(out)[3][-1]}"
            if isinstance(out, torch.Tensor)
            else f"a {type(out).__name__}"
        )
        shape = "the shape," if dv == d else f"the shape [num_tokens={n}, num_heads={hq}, head_dim_v={dv}] and"
        raise InputError(
            f"out is {found}; accepted: {shape} dtype and device of q ({_described(q)}), last-dimension stride 1"
        )
    out_shape, _, _, out_strides = tensor_facts(out) if out is not None else ((), None, None, ())
    if _overlaps_itself(out_shape, out_strides):
        raise InputError(
            f"out's elements overlap each other (shape {list(out_shape)}, strides {tuple(out_strides)}: an "
            "expanded or overlapping view, so rows would overwrite each other); accepted: an output whose "
            "elements each have their own memory, such as torch.empty_like(q)"
        )
    if not isinstance(return_lse, bool):
        raise InputError(f"return_lse is {return_lse!r}; accepted: True or False")
    spec = forward_spec(hq, d, q_dtype, dev.type, cache, meta, window, softcap, sinks is not None, return_lse)
    reasons = backend.reasons(spec)
    if reasons:
        raise UnsupportedSpecError(backend.name, reasons)


def forward_spec(
    num_heads: int,
    head_dim: int,
    dtype: torch.dtype,
    device_type: str,
    cache: KVCache,
    meta: BatchMeta,
    window: Any,
    softcap: Any,
    sinks: bool,
    return_lse: bool,
) -> AttentionSpec:
    """The spec of a ``forward`` call: q's heads, head dim, dtype and device, the cache's facts,
    the batch's shape and the call's options (checked already)."""
    return AttentionSpec(
        num_heads=num_heads,
        num_kv_heads=cache.num_kv_heads,
        head_dim=head_dim,
        block_size=cache.block_size,
        dtype=dtype,
        kv_dtype=cast(KVDtype, cache.kv_dtype),
        kv_scales=cache.kv_scales,
        window=int(window),
        softcap=float(softcap),
        sinks=sinks,
        device=device_type,
        decode_only=meta.decode_only,
        return_lse=return_lse,
        head_dim_v=cache.head_dim_v,
    )


def check_inputs(
    q: Any,
    cache: Any,
    meta: Any,
    window: Any,
    softcap: Any,
    scale: Any,
    sinks: Any,
    *,
    mirrors: bool = True,
) -> None:
    """The inputs of an attention call, without an output or a backend: ``q`` against the cache
    and the batch, the scalars and ``sinks``. ``forward`` (through :func:`check_call`) and
    ``reference_attention`` both refuse bad input here. ``mirrors=False`` leaves the host
    mirrors' agreement with ``max_*`` unchecked, for callers that read neither."""
    if not isinstance(q, torch.Tensor) or len(tensor_facts(q)[0]) != 3:
        raise InputError(f"q is {_described(q)}; accepted: a tensor [num_tokens, num_heads, head_dim]")
    if not isinstance(cache, KVCache):
        raise InputError(f"cache is {_described(cache)}; accepted: a paged_core.KVCache")
    cache.check()
    check_batch(meta, mirrors=mirrors)
    q_shape, q_dtype, dev, q_strides = tensor_facts(q)
    n, hq, d = q_shape
    if hq == 0:
        raise InputError(f"q is {_described(q)}, with no heads; accepted: num_heads >= 1")
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
    if q_dtype != cache.dtype:
        raise InputError(
            f"q is {dtype_name(q_dtype)} but the cache holds {dtype_name(cache.dtype)} K/V; "
            "accepted: the dtype the cache was allocated for"
        )
    if q_strides[-1] != 1:
        raise InputError(f"q's last dimension has stride {q_strides[-1]}; accepted: stride 1 (call q.contiguous())")
    if cache.k.device != dev:
        raise InputError(f"cache.k is on {cache.device} but q is on {dev}; accepted: one device")
    if meta.seq_lens.device != dev:
        raise InputError(
            f"the batch is on {meta.device} but q is on {dev}; accepted: one device (meta.to({str(dev)!r}))"
        )
    _check_batch_fits(meta, cache, device=False)  # both are on q's device
    _check_scalars(window, softcap, scale)
    if sinks is not None and (not isinstance(sinks, torch.Tensor) or _wrong_sinks(tensor_facts(sinks), hq, dev)):
        raise InputError(f"sinks is {_described(sinks)}; accepted: float32 [num_heads={hq}] on {dev}")


def _wrong_sinks(facts: tuple, num_heads: int, device: torch.device) -> bool:
    shape, dtype, dev, _ = facts
    return tuple(shape) != (num_heads,) or dtype != torch.float32 or dev != device


def _wrong_out(facts: tuple, q_facts: tuple, head_dim_v: int) -> bool:
    shape, dtype, dev, strides = facts
    q_shape = q_facts[0]
    want = q_shape if q_shape[2] == head_dim_v else (q_shape[0], q_shape[1], head_dim_v)
    return tuple(shape) != tuple(want) or dtype != q_facts[1] or dev != q_facts[2] or strides[-1] != 1


def validate_call(batch: BatchMeta, cache: KVCache, sinks: torch.Tensor | None) -> None:
    """The data checks of ``validate=True`` (they read the device: a sync)."""
    batch.validate(num_blocks=cache.num_blocks)
    # A device read, so only here: with validation off a NaN sink is the caller's promise
    # (docs/reliability.md). +inf and -inf are the limits: zeros, and no sink.
    if sinks is not None and bool(torch.isnan(sinks).any()):
        raise InputError(
            f"sinks holds NaN at heads {torch.isnan(sinks).nonzero().flatten().tolist()}; accepted: "
            "float32 logits (+inf: the sink takes all the mass, zeros; -inf: no sink)"
        )
