"""What an attention call needs (``AttentionSpec``) and what a backend offers (``Capabilities``).

A backend's ``capabilities`` are a promise: the conformance suite runs every case whose spec the
backend accepts and fails the backend if it is wrong. ``Capabilities.reasons(spec)`` turns the
comparison into sentences, so "why was this skipped" and "why did select() pick that" always have
an answer a person can read.
"""

from __future__ import annotations

import dataclasses
import numbers
from collections.abc import Iterable
from typing import Any, Literal, cast

import torch

from ._errors import InputError

__all__ = [
    "AttentionSpec",
    "Capabilities",
    "KV_DTYPES",
    "KV_SCALES",
    "KVDtype",
    "ANY",
    "QUANT_FORMATS",
    "PACKED_CODES",
    "PER_CHANNEL_KEYS",
]

#: Host ints the metadata stores as int32 (lengths, offsets, block ids) must stay below this.
INT32_LIMIT = 2**31

KVDtype = Literal["auto", "int8", "fp8", "fp8_e5m2", "int4", "kivi4"]
#: The quantized storage formats: kv_dtype -> (the dtype of its codes, the largest code
#: magnitude). Symmetric codes with float32 scales; "fp8" is E4M3 (3 mantissa bits, vLLM's
#: "fp8"/"fp8_e4m3"), "fp8_e5m2" E5M2 (2 mantissa bits, wider range), "int4" integer codes
#: -7..7 stored two to a byte (:data:`PACKED_CODES`), "kivi4" the same codes with KIVI's split:
#: keys scaled per (block, KV head, channel), values per (slot, KV head) (:data:`PER_CHANNEL_KEYS`).
QUANT_FORMATS: dict[str, tuple[torch.dtype, float]] = {
    "int8": (torch.int8, 127.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
    "int4": (torch.uint8, 7.0),
    "kivi4": (torch.uint8, 7.0),
}
#: Formats that store several codes per element of their code dtype: kv_dtype -> codes per
#: element. An int4 cache's last dimension is ``head_dim // 2`` bytes; byte ``i`` holds element
#: ``2i`` in its low nibble and ``2i + 1`` in its high nibble, each a two's-complement 4-bit code.
PACKED_CODES: dict[str, int] = {"int4": 2, "kivi4": 2}
#: Formats whose key scales are one per (block, KV head, channel), ``k_scale: float32
#: [num_blocks, num_kv_heads, head_dim]`` (KIVI, Liu et al. 2024: keys have outlier channels).
PER_CHANNEL_KEYS: frozenset[str] = frozenset({"kivi4"})
#: The cache storage formats: the model dtype itself ("auto"), or one of ``QUANT_FORMATS``.
KV_DTYPES: tuple[str, ...] = ("auto", *QUANT_FORMATS)
#: How a quantized cache's scales vary (``KVCache.kv_scales``): one per (slot, KV head), set by
#: each write; or static (``paged_core.static_scale``), one per KV head or one per tensor.
KV_SCALES: tuple[str, ...] = ("per_slot", "per_head", "per_tensor")

#: Marker for "no restriction" in a ``Capabilities`` field.
ANY = None

_DTYPE_NAMES = {torch.float32: "float32", torch.float16: "float16", torch.bfloat16: "bfloat16"}


def dtype_name(dtype: torch.dtype) -> str:
    return _DTYPE_NAMES.get(dtype, str(dtype).removeprefix("torch."))


def tensor_desc(t: torch.Tensor) -> str:
    """``t``'s dtype and shape as a message names them: ``int8 [4, 16, 2, 64]``."""
    return f"{dtype_name(t.dtype)} {list(t.shape)}"


def check_dtype(name: str, value: Any, accepted: Iterable[torch.dtype], note: str = "") -> None:
    """``value`` is one of the torch dtypes ``accepted``, else an InputError; ``note`` ends it.

    The one place a refused dtype is described: a string such as ``"float32"`` is named as a
    string, so the message never lists the value it refuses as accepted (``accepted: float32``
    beside ``dtype float32``), and the accepted torch dtype it names, if any, is suggested.

    >>> check_dtype("dtype", "float32", [torch.float32, torch.float16])  # doctest: +ELLIPSIS
    Traceback (most recent call last):
    paged_core._errors.InputError: dtype is the string 'float32'; accepted: ... not a string: torch.float32)
    """
    accepted = list(accepted)
    if isinstance(value, torch.dtype) and value in accepted:
        return
    remarks = [note] if note else []
    if isinstance(value, str):
        found = f"the string {value!r}"
        named = getattr(torch, value.removeprefix("torch."), None)
        remarks.insert(0, "a torch.dtype, not a string" + (f": {named}" if named in accepted else ""))
    elif isinstance(value, torch.dtype):
        found = str(value)
    else:
        found = f"{value!r} (of type {type(value).__name__})"
    remark = f" ({'; '.join(remarks)})" if remarks else ""
    raise InputError(f"{name} is {found}; accepted: {', '.join(str(d) for d in accepted)}{remark}")


def check_device(device: Any) -> torch.device:
    """``device`` as a torch.device that exists here, or an InputError saying what does."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(f"device {device!r} is not a device ({exc}); accepted: 'cpu', 'cuda', 'cuda:0', ...") from exc
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError(
                f"device {device!r} was asked for but this machine has no usable CUDA GPU "
                "(torch.cuda.is_available() is False); accepted: 'cpu', or run on a GPU machine"
            )
        if dev.index is not None and dev.index >= count:
            raise InputError(f"device {device!r} does not exist; accepted: cuda:0 .. cuda:{count - 1}")
    elif dev.type not in ("cpu", "meta"):
        try:
            torch.empty(0, device=dev)
        except Exception as exc:  # a backend torch was not built with (xpu, mps, ...)
            raise InputError(
                f"device {device!r} is not usable here ({type(exc).__name__}: {exc}); accepted: 'cpu', "
                "or 'cuda' on a GPU machine"
            ) from exc
    return dev


def check_codes(name: str, x: Any, dtype: torch.dtype, accepted: str) -> None:
    """A tensor of ``dtype`` with at least one dimension (``pack_int4``'s codes, ``unpack_int4``'s
    bytes), or an InputError naming what ``x`` is. Here, not in ``_checks``, because ``_quant``
    (which ``_checks`` imports through ``_cache``) calls it."""
    if not isinstance(x, torch.Tensor) or x.dtype != dtype or x.dim() == 0:
        found = f"{dtype_name(x.dtype)} {list(x.shape)}" if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise InputError(f"{name} is {found}; accepted: {accepted}")


def check_spec(spec: Any) -> AttentionSpec:
    """``spec`` itself if it is an :class:`AttentionSpec`, else an InputError naming what it is."""
    if not isinstance(spec, AttentionSpec):
        raise InputError(
            f"spec is {spec!r} (a {type(spec).__name__}); accepted: a paged_core.AttentionSpec, such as "
            "AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)"
        )
    return spec


def _sorted(values: Iterable[Any]) -> list[Any]:
    """Numbers in numeric order, anything else by its text."""
    return sorted(values, key=lambda v: (0, v, "") if isinstance(v, (int, float)) else (1, 0, str(v)))


def _fmt(values: Iterable[Any]) -> str:
    return ", ".join(str(v) for v in _sorted(values))


@dataclasses.dataclass(frozen=True)
class AttentionSpec:
    """The static shape of one attention layer call; hashable, so checks can be cached.

    >>> spec = AttentionSpec(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16)
    >>> spec.group_size
    4
    """

    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    dtype: torch.dtype = torch.bfloat16
    kv_dtype: KVDtype = "auto"
    window: int = 0
    softcap: float = 0.0
    sinks: bool = False
    device: str = "cpu"
    decode_only: bool = False
    return_lse: bool = False
    #: A quantized cache's scales (one of ``KV_SCALES``); ignored for ``kv_dtype="auto"``.
    kv_scales: str = "per_slot"
    #: The head dim of V and of the output (MLA-shaped layers: DeepSeek-V3 has head_dim 192,
    #: head_dim_v 128); None: ``head_dim``, which it is set to.
    head_dim_v: int | None = None

    def __post_init__(self) -> None:
        if self.head_dim_v is None:
            object.__setattr__(self, "head_dim_v", self.head_dim)
        # Sizes below 1 are refused here, so registry.explain()/select() never divide by zero.
        for name in ("num_heads", "num_kv_heads", "head_dim", "block_size", "head_dim_v"):
            v = getattr(self, name)
            if not isinstance(v, numbers.Integral) or isinstance(v, bool) or v < 1:
                raise InputError(f"AttentionSpec.{name} is {v!r}; accepted: a positive int")
        # A string here ("float32") would be refused later as "dtype float32 is not supported
        # (accepted: ..., float32)"; say what it is instead. Which dtypes run is the backends' call.
        if not isinstance(self.dtype, torch.dtype):
            check_dtype("AttentionSpec.dtype", self.dtype, _DTYPE_NAMES)
        if self.kv_dtype not in KV_DTYPES:
            raise InputError(
                f"AttentionSpec.kv_dtype is {self.kv_dtype!r}; accepted: {', '.join(KV_DTYPES)} "
                "('auto': the model dtype itself)"
            )
        if self.kv_scales not in KV_SCALES:
            raise InputError(f"AttentionSpec.kv_scales is {self.kv_scales!r}; accepted: {', '.join(KV_SCALES)}")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def device_type(self) -> str:
        return torch.device(self.device).type

    def describe(self) -> str:
        """A compact one-line description used in case ids and reports."""
        parts = [
            f"{self.num_heads}/{self.num_kv_heads}x{self.head_dim}"
            + ("" if self.head_dim_v == self.head_dim else f" v{self.head_dim_v}"),
            f"bs{self.block_size}",
            dtype_name(self.dtype),
        ]
        if self.kv_dtype != "auto":
            parts.append(f"kv={self.kv_dtype}" + ("" if self.kv_scales == "per_slot" else f"/{self.kv_scales}"))
        if self.window:
            parts.append(f"window={self.window}")
        if self.softcap:
            parts.append(f"softcap={self.softcap:g}")
        if self.sinks:
            parts.append("sinks")
        parts.append(self.device_type)
        return " ".join(parts)


@dataclasses.dataclass(frozen=True)
class Capabilities:
    """What a backend promises to compute exactly. ``None`` in a set-valued field means any."""

    head_dims: frozenset[int] | None = ANY
    #: The ``(head_dim, head_dim_v)`` pairs with a V/output head dim other than the QK head dim
    #: that it serves (MLA-shaped layers), each a claim of its own (its head_dim need not be in
    #: ``head_dims``). Empty (the default): V's head dim must be ``head_dim``; ``None``: any pair
    #: of head dims that ``head_dims`` accepts.
    head_dim_pairs: frozenset[tuple[int, int]] | None = frozenset()
    block_sizes: frozenset[int] | None = ANY
    group_sizes: frozenset[int] | None = ANY
    dtypes: frozenset[torch.dtype] = frozenset(_DTYPE_NAMES)
    kv_dtypes: frozenset[str] = frozenset({"auto"})
    #: The scales of quantized caches it reads (``KV_SCALES``). Per slot only unless it says so: a
    #: kernel that indexes scales as one per slot would read a static scale's view wrongly, and one
    #: that takes a scale per tensor or per head (FlashInfer's fp8) cannot read per-slot scales.
    kv_scales: frozenset[str] = frozenset({"per_slot"})
    devices: frozenset[str] = frozenset({"cpu", "cuda"})
    sliding_window: bool = False
    softcap: bool = False
    sinks: bool = False
    mixed_batches: bool = True
    returns_lse: bool = False
    cuda_graphs: bool = False
    #: ``plan()`` reads nothing of the batch on the host (it runs on the device, or does
    #: nothing): an engine that captures whole steps in a CUDA graph (transformers' continuous
    #: batching) may capture the plan with ``forward``, and a replay plans the batch it finds
    #: in the metadata tensors then. With ``cuda_graphs`` only, plan outside the capture.
    device_plan: bool = False
    #: Each request's output is bitwise the same whatever else is in the batch.
    batch_invariant: bool = False

    def reasons(self, spec: AttentionSpec) -> list[str]:
        """Each way ``spec`` falls outside these capabilities, as a sentence; empty if none."""
        check_spec(spec)
        out: list[str] = []
        if spec.num_heads % spec.num_kv_heads:
            out.append(f"num_heads {spec.num_heads} is not a multiple of num_kv_heads {spec.num_kv_heads}")
        if spec.device_type not in self.devices:
            out.append(f"device {spec.device_type!r} is not supported (accepted: {_fmt(self.devices)})")
        # A pair named in head_dim_pairs is a claim of its own, whatever head_dims holds.
        paired = self.head_dim_pairs is not None and (spec.head_dim, spec.head_dim_v) in self.head_dim_pairs
        if self.head_dims is not None and spec.head_dim not in self.head_dims and not paired:
            out.append(f"head_dim {spec.head_dim} is not supported (accepted: {_fmt(self.head_dims)})")
        out.extend(self.head_dim_v_reasons(spec.head_dim, cast(int, spec.head_dim_v)))
        if not self.accepts_block_size(spec.block_size):
            out.append(self.block_size_reason(spec.block_size))
        if self.group_sizes is not None and spec.group_size not in self.group_sizes:
            out.append(
                f"{spec.num_heads // max(spec.num_kv_heads, 1)} query heads per KV head is not "
                f"supported (accepted: {_fmt(self.group_sizes)})"
            )
        if spec.dtype not in self.dtypes:
            out.append(
                f"dtype {dtype_name(spec.dtype)} is not supported "
                f"(accepted: {_fmt(dtype_name(d) for d in self.dtypes)})"
            )
        if spec.kv_dtype not in self.kv_dtypes:
            out.append(f"kv_dtype {spec.kv_dtype!r} is not supported (accepted: {_fmt(self.kv_dtypes)})")
        elif spec.kv_dtype != "auto" and spec.kv_scales not in self.kv_scales:
            out.append(
                f"{spec.kv_dtype} caches with kv_scales {spec.kv_scales!r} are not supported "
                f"(accepted: {_fmt(self.kv_scales)})"
            )
        if spec.window and not self.sliding_window:
            out.append("sliding window attention is not supported")
        if spec.softcap and not self.softcap:
            out.append("logit soft-capping is not supported")
        if spec.sinks and not self.sinks:
            out.append("attention sinks are not supported")
        if not spec.decode_only and not self.mixed_batches:
            out.append("only decode-only batches (one query token per request) are supported")
        if spec.return_lse and not self.returns_lse:
            out.append("returning the log-sum-exp is not supported")
        return out

    def head_dim_v_reasons(self, head_dim: int, head_dim_v: int) -> list[str]:
        """Why a V/output head dim of ``head_dim_v`` with QK head dim ``head_dim`` is refused
        (``reasons`` asks this); empty when it is served or the dims are equal."""
        if head_dim_v == head_dim:
            return []
        pairs = self.head_dim_pairs
        if pairs is None:
            if self.head_dims is None or head_dim_v in self.head_dims:
                return []
            return [f"head_dim_v {head_dim_v} is not supported (accepted: {_fmt(self.head_dims)})"]
        if (head_dim, head_dim_v) in pairs:
            return []
        accepted = ", ".join(f"({d}, {dv})" for d, dv in sorted(pairs)) + " or " if pairs else ""
        return [
            f"head_dim_v {head_dim_v} other than head_dim {head_dim} (MLA-shaped heads) is not supported "
            f"(accepted (head_dim, head_dim_v): {accepted}head_dim_v == head_dim)"
        ]

    def pairs_summary(self) -> str:
        """The ``head_dim_pairs`` of ``summary`` (shown when not empty): the V head dims any
        ``head_dim`` pairs with (``head_dims``, as ``head_dim_v_reasons`` accepts them; "any"
        when those are unrestricted), or the pairs ``(head_dim, head_dim_v)`` as ``192/128``."""
        if self.head_dim_pairs is None:
            return "any" if self.head_dims is None else ",".join(str(d) for d in sorted(self.head_dims))
        return ",".join(f"{d}/{dv}" for d, dv in sorted(self.head_dim_pairs))

    def accepts_block_size(self, block_size: int) -> bool:
        """Whether a cache of ``block_size``-token blocks is accepted (``reasons`` asks this).

        A subclass whose accepted sizes a finite set cannot state (flash-attn 2: any multiple of
        256) overrides this and :meth:`block_size_reason`.
        """
        return self.block_sizes is None or block_size in self.block_sizes

    def block_size_reason(self, block_size: int) -> str:
        """The sentence ``reasons`` gives for a block size ``accepts_block_size`` refuses."""
        # Only asked after ``accepts_block_size`` refused, which ``block_sizes=ANY`` never does.
        accepted = cast(frozenset[int], self.block_sizes)
        return f"block_size {block_size} is not supported (accepted: {_fmt(accepted)})"

    def summary(self) -> str:
        """A compact one-line form for ``paged list``."""

        def s(v: Iterable[Any] | None) -> str:
            return "any" if v is None else ",".join(str(x) for x in _sorted(v))

        flags = [
            name
            for name, on in [
                ("window", self.sliding_window),
                ("softcap", self.softcap),
                ("sinks", self.sinks),
                ("lse", self.returns_lse),
                ("cuda-graphs", self.cuda_graphs),
                ("device-plan", self.device_plan),
                ("batch-invariant", self.batch_invariant),
            ]
            if on
        ]
        return (
            f"head_dim {s(self.head_dims)}; "
            + ("" if self.head_dim_pairs == frozenset() else f"head_dim_v {self.pairs_summary()}; ")
            + f"block {s(self.block_sizes)}; group {s(self.group_sizes)}; "
            f"dtype {s(dtype_name(d) for d in self.dtypes)}; kv {s(self.kv_dtypes)}"
            + (f" (scales {s(self.kv_scales)})" if set(self.kv_dtypes) - {"auto"} else "")
            + "; "
            f"{'mixed' if self.mixed_batches else 'decode-only'}; {s(self.devices)}"
            + (f"; {', '.join(flags)}" if flags else "")
        )
