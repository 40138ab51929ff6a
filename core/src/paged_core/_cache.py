"""The paged KV cache of one layer, in vLLM's NHD layout.

``k: [num_blocks, block_size, num_kv_heads, head_dim]``, ``v`` the same with its own last
dimension ``head_dim_v`` (``head_dim`` except in MLA-shaped layers). A quantized cache holds codes
(``int8``, ``float8_e4m3fn``, ``float8_e5m2``, or int4 codes two to a ``uint8``, whose last
dimension is then half the head dim: ``paged_core.QUANT_FORMATS``) and float32 scales
``k_scale, v_scale: [num_blocks, block_size, num_kv_heads]``, value = code * scale. The scales are
either

* **per slot** (the default): one per (slot, KV head), set by every write to ``max|x| / q_max``
  of the vector written (127 for int8, 448 for fp8 E4M3, 57344 for fp8 E5M2, 7 for int4): symmetric per
  (token, head); or
* **per channel for keys** (``kivi4``): ``k_scale: [num_blocks, num_kv_heads, head_dim]``, one per
  (block, KV head, channel), the largest ``|k| / 7`` of each channel over the block's keys so far
  (a write that raises it requantizes the block's earlier keys; a write at slot 0 of a block
  starts it afresh); ``v_scale`` per slot as above; or
* **static**: one per tensor or per KV head, fixed when the cache is made (:func:`static_scale`:
  a view whose block and slot strides are 0), which writes quantize with and never change: the
  format of vLLM's and SGLang's fp8 KV caches (``x / k_scale`` with one calibrated scale).

The codes and scales are made by the codec (``_quant``) and written by the reference write
(``_write``); this module holds the cache object, its checks, its allocation and its size.
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import operator
from typing import cast

import torch

from ._errors import InputError
from ._quant import dequantize_kv, is_static, static_scale, unpack_int4
from ._spec import (
    KV_DTYPES,
    PACKED_CODES,
    PER_CHANNEL_KEYS,
    QUANT_FORMATS,
    check_device,
    check_dtype,
    dtype_name,
    tensor_desc,
)

__all__ = [
    "KVCache",
    "allocate_kv_cache",
    "kv_bytes_per_token",
]

_GENERATIONS = itertools.count(1)  # KVCache._generation
_CODE_DTYPE = {name: code for name, (code, _) in QUANT_FORMATS.items()}
_QUANTIZED = ", ".join(QUANT_FORMATS)
_ELEM_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@dataclasses.dataclass
class KVCache:
    """One layer's paged K/V pool.

    Allocated by :func:`allocate_kv_cache`, which keeps one hidden block past ``num_blocks``
    so that padding rows (slot -1) can be written somewhere harmless without a host sync.
    """

    #: [num_blocks, block_size, num_kv_heads, head_dim], model dtype or int8/float8 codes.
    k: torch.Tensor
    #: [num_blocks, block_size, num_kv_heads, head_dim_v], like ``k`` but for its last dimension.
    v: torch.Tensor
    #: "auto" (the model dtype), or a quantized format: "int8", "fp8" (E4M3), "fp8_e5m2" or "int4".
    kv_dtype: str = "auto"
    #: float32 [num_blocks, block_size, num_kv_heads] for quantized caches, else None.
    k_scale: torch.Tensor | None = None
    #: float32 [num_blocks, block_size, num_kv_heads] for quantized caches, else None.
    v_scale: torch.Tensor | None = None
    #: The model dtype K/V arrive in (and are dequantized to).
    dtype: torch.dtype = torch.bfloat16
    # One extra block of storage after the pool: the destination of padding writes.
    _spill: tuple[torch.Tensor, ...] | None = dataclasses.field(default=None, repr=False)
    # The fields check() last accepted (every layer call checks the same cache object), and
    # whether ``_spill`` still holds the storage of those very views.
    _checked: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # A number no other check of any object had (a re-check gives a new one). 0: never checked.
    _generation: int = dataclasses.field(default=0, init=False, repr=False, compare=False)
    # What a call can depend on besides values, for the last accepted fields: shapes, strides,
    # dtypes, device and 16-byte alignment of every tensor. The caches of a model's layers have
    # equal layouts, so per-call caches keyed by it (Backend.forward's checks, a launcher's
    # prepared arguments) serve every layer. None: never checked.
    _layout: tuple | None = dataclasses.field(default=None, init=False, repr=False, compare=False)
    # The data pointers and shapes of the last accepted tensors: ``cache.k.set_(other)`` or
    # ``cache.k.resize_(0)`` keeps the object but not its memory or shape, so it is checked again
    # (and ``_spill``, still over the old storage, no longer matches).
    _storage: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)
    _spill_ok: bool = dataclasses.field(default=False, init=False, repr=False, compare=False)
    # ``kv_scales`` of the last accepted fields (computed by check(), read on every write).
    _kv_scales: str = dataclasses.field(default="per_slot", init=False, repr=False, compare=False)
    # The bytes [first, end) each tensor of the last accepted fields can touch, by name (computed by
    # check(), read on every forward with ``out=``: an output must not alias the cache).
    _spans: tuple = dataclasses.field(default=(), init=False, repr=False, compare=False)

    @property
    def num_blocks(self) -> int:
        return int(self.k.shape[0])

    @property
    def block_size(self) -> int:
        return int(self.k.shape[1])

    @property
    def num_kv_heads(self) -> int:
        return int(self.k.shape[2])

    @property
    def head_dim(self) -> int:
        return int(self.k.shape[3]) * PACKED_CODES.get(self.kv_dtype, 1)

    @property
    def head_dim_v(self) -> int:
        """V's head dim, the output's: ``head_dim`` except in MLA-shaped layers."""
        return int(self.v.shape[3]) * PACKED_CODES.get(self.kv_dtype, 1)

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "auto"

    @property
    def static_scales(self) -> bool:
        """Whether a quantized cache's scales are static (:func:`static_scale`): fixed, one per
        tensor or KV head, which writes quantize with and leave unchanged."""
        return (
            self.quantized
            and self.kv_dtype not in PER_CHANNEL_KEYS
            and isinstance(self.k_scale, torch.Tensor)
            and is_static(self.k_scale)
        )

    @property
    def kv_scales(self) -> str:
        """How the scales vary (``paged_core.KV_SCALES``): "per_slot", or for static scales
        "per_head" or "per_tensor" (one value: every KV head's stride 0 too, or one KV head).
        "per_slot" for a full-precision cache, which has none. Checks the cache first."""
        return self.check()._kv_scales

    def _scale_kind(self) -> str:
        if not self.static_scales:
            return "per_slot"
        k_scale, v_scale = self._scales()
        one = all(t.stride(2) == 0 or t.shape[2] == 1 for t in (k_scale, v_scale))
        return "per_tensor" if one else "per_head"

    def check(self) -> KVCache:
        """Check the structure of the cache; raise :class:`InputError` saying what is wrong.

        Host-only (reads no tensor value): ``k`` and ``v`` 4-D ``[num_blocks, block_size,
        num_kv_heads, head_dim]`` of one dtype and device and one shape but for the last dimension
        (V's head dim may differ: whether a backend serves that is its capabilities'), last
        dimension contiguous, of
        the dtype ``kv_dtype`` stores; quantized caches have float32 ``k_scale``/``v_scale`` of
        shape ``[num_blocks, block_size, num_kv_heads]`` on that device. The result is cached
        per object (the fields themselves are compared by identity), so the per-layer call costs
        a tuple comparison. Returns ``self``.
        """
        fields = (self.k, self.v, self.kv_dtype, self.k_scale, self.v_scale, self.dtype, self._spill)
        last = self._checked
        if (
            last is not None
            and all(map(operator.is_, fields, last))
            and _storage_facts(self.k, self.v, self.k_scale, self.v_scale) == self._storage
        ):  # same objects, still over the same memory with the same shapes: checked
            return self
        if self.kv_dtype not in KV_DTYPES:
            raise InputError(
                f"cache.kv_dtype is {self.kv_dtype!r}; accepted: {', '.join(KV_DTYPES)} "
                "(allocate caches with allocate_kv_cache or backend.allocate)"
            )
        if self.dtype not in _ELEM_BYTES:
            raise InputError(
                f"cache.dtype is {self.dtype!r}; accepted: torch.float32, torch.float16, torch.bfloat16 "
                "(the dtype K/V arrive in)"
            )
        store = self.dtype if self.kv_dtype == "auto" else _CODE_DTYPE[self.kv_dtype]
        for name in ("k", "v"):
            t = getattr(self, name)
            if not isinstance(t, torch.Tensor) or t.dim() != 4:
                found = tensor_desc(t) if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
                raise InputError(
                    f"cache.{name} is {found}; accepted: a 4-D tensor [num_blocks, block_size, "
                    "num_kv_heads, head_dim] (NHD; view other layouts as NHD)"
                )
            if t.dtype != store:
                raise InputError(
                    f"cache.{name} is {tensor_desc(t)} but kv_dtype {self.kv_dtype!r} with dtype "
                    f"{dtype_name(self.dtype)} stores {dtype_name(store)}; accepted: {dtype_name(store)} "
                    "codes (or set kv_dtype/dtype to what the tensors hold)"
                )
            if min(t.shape) < 1:
                raise InputError(f"cache.{name} is {tensor_desc(t)}; accepted: every dimension >= 1")
            if t.stride(-1) != 1:
                raise InputError(
                    f"cache.{name}'s last dimension has stride {t.stride(-1)}; accepted: stride 1 "
                    "(head_dim contiguous; any strides for the other dimensions)"
                )
        if self.v.shape[:3] != self.k.shape[:3] or self.v.device != self.k.device:
            raise InputError(
                f"cache.v is {tensor_desc(self.v)} on {self.v.device} but cache.k is {tensor_desc(self.k)} on "
                f"{self.k.device}; accepted: v of k's [num_blocks, block_size, num_kv_heads], dtype and "
                "device (its head dim may differ from k's)"
            )
        slot_scales = tuple(self.k.shape[:3])
        for name in ("k_scale", "v_scale"):
            t = getattr(self, name)
            per_channel = name == "k_scale" and self.kv_dtype in PER_CHANNEL_KEYS
            want = (self.k.shape[0], self.k.shape[2], self.head_dim) if per_channel else slot_scales
            layout = "[num_blocks, num_kv_heads, head_dim]" if per_channel else "[num_blocks, block_size, num_kv_heads]"
            if not self.quantized:
                if t is not None:
                    raise InputError(
                        f"cache.{name} is set but kv_dtype is 'auto' (no quantization); accepted: "
                        f"None, or kv_dtype {_QUANTIZED} for a quantized cache"
                    )
                continue
            if (
                not isinstance(t, torch.Tensor)
                or t.dtype != torch.float32
                or tuple(t.shape) != want
                or t.device != self.k.device
            ):
                found = (
                    f"{tensor_desc(t)} on {t.device}"
                    if isinstance(t, torch.Tensor)
                    else "None"
                    if t is None
                    else f"a {type(t).__name__}"
                )
                raise InputError(
                    f"cache.{name} is {found}; an {self.kv_dtype} cache needs float32 "
                    f"{layout} = {list(want)} on {self.k.device} "
                    "(allocate it with allocate_kv_cache(..., kv_dtype=...))"
                )
            if per_channel:
                if 0 in [st for st, n in zip(t.stride(), t.shape, strict=True) if n > 1] or t.stride(-1) != 1:
                    raise InputError(
                        f"cache.{name} has strides {tuple(t.stride())} for shape {list(t.shape)}; accepted: "
                        "an element of its own for each (block, KV head, channel), channels contiguous"
                    )
                continue
            if self.kv_dtype in PER_CHANNEL_KEYS and is_static(t):
                raise InputError(
                    f"cache.{name} is a static scale (block and slot strides 0) for a {self.kv_dtype} cache; "
                    f"accepted: per-slot V scales, an element of their own for each (slot, KV head) "
                    f"({self.kv_dtype} sets them on every write; allocate it with allocate_kv_cache(..., "
                    f"kv_dtype={self.kv_dtype!r}))"
                )
            # Per-slot scales are written by every write: they need one element each (an
            # expanded view would make the writes of different slots land on one float).
            if not is_static(t) and 0 in [st for st, n in zip(t.stride(), t.shape, strict=True) if n > 1]:
                raise InputError(
                    f"cache.{name} has strides {tuple(t.stride())} for shape {list(t.shape)}; accepted: "
                    "per-slot scales with an element of their own for each (slot, KV head), or static "
                    "scales whose block and slot strides are 0 (paged_core.static_scale)"
                )
        if (
            self.quantized
            and self.kv_dtype not in PER_CHANNEL_KEYS
            and is_static(cast(torch.Tensor, self.k_scale)) != is_static(cast(torch.Tensor, self.v_scale))
        ):
            kinds = ["static" if is_static(cast(torch.Tensor, t)) else "per slot" for t in (self.k_scale, self.v_scale)]
            raise InputError(
                f"cache.k_scale is {kinds[0]} but cache.v_scale is {kinds[1]}; accepted: both static "
                "(paged_core.static_scale) or both per slot"
            )
        self._spill_ok = self._spill_matches()
        self._kv_scales = self._scale_kind()
        self._layout = (
            self.kv_dtype,
            self.dtype,
            self.k.device,
            self._spill_ok,
            *(_tensor_layout(t) for t in (self.k, self.v, self.k_scale, self.v_scale)),
        )
        self._spans = tuple(
            (name, *byte_span(t))
            for name, t in (("k", self.k), ("v", self.v), ("k_scale", self.k_scale), ("v_scale", self.v_scale))
            if t is not None and t.numel()
        )
        self._checked = fields
        self._storage = _storage_facts(self.k, self.v, self.k_scale, self.v_scale)
        self._generation = next(_GENERATIONS)
        return self

    def layout(self) -> tuple:
        """The checked cache's layout key (see ``_layout``): equal for every layer's cache of one
        model, so what depends only on it can be computed once for all layers."""
        self.check()
        return cast(tuple, self._layout)

    def _spill_matches(self) -> bool:
        """Whether ``_spill`` is the storage the views start at, one block longer: only then do
        writes of invalid slots go to its hidden block (a replaced field loses it)."""
        views = (self.k, self.v) + (self._scales() if self.quantized else ())
        spill = self._spill
        if spill is None or len(spill) != len(views):
            return False
        for view, full in zip(views, spill, strict=True):
            if (
                not isinstance(full, torch.Tensor)
                or full.data_ptr() != view.data_ptr()
                or full.dtype != view.dtype
                or full.stride() != view.stride()
                or full.shape[0] != view.shape[0] + 1
                or full.shape[1:] != view.shape[1:]
            ):
                return False
        return True

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) as float32 values: codes times scales for quantized caches."""
        self.check()
        if not self.quantized:
            return self.k.float(), self.v.float()
        k_scale, v_scale = self._scales()
        if self.kv_dtype in PER_CHANNEL_KEYS:
            return unpack_int4(self.k).float() * k_scale[:, None].float(), dequantize_kv(self.v, v_scale)
        return dequantize_kv(self.k, k_scale), dequantize_kv(self.v, v_scale)

    def _scales(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k_scale, v_scale) of a quantized cache: float32 tensors once ``check`` has passed."""
        return cast(torch.Tensor, self.k_scale), cast(torch.Tensor, self.v_scale)


def allocate_kv_cache(
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
    """Allocate an empty (zeroed) cache of ``num_blocks`` blocks; ``head_dim_v`` (default
    ``head_dim``) is V's head dim, for MLA-shaped layers.

    A quantized cache gets per-slot scales, set by each write; with ``k_scale`` and ``v_scale``
    (a positive float, or a float32 tensor of one value or one per KV head) it gets those as
    static scales instead (:func:`static_scale`): writes quantize with them.

    >>> cache = allocate_kv_cache(4, 16, 2, 64, kv_dtype="int8")
    >>> tuple(cache.k.shape), cache.k.dtype, tuple(cache.k_scale.shape)
    ((4, 16, 2, 64), torch.int8, (4, 16, 2))
    >>> fp8 = allocate_kv_cache(4, 16, 2, 64, kv_dtype="fp8", k_scale=0.05, v_scale=0.02)
    >>> fp8.static_scales, fp8.k_scale[3, 15].tolist()
    (True, [0.05000000074505806, 0.05000000074505806])
    """
    _check_dtypes(dtype, kv_dtype)
    for name, val in (
        ("num_blocks", num_blocks),
        ("block_size", block_size),
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
    ):
        _check_size(name, val)
    if head_dim_v is None:
        head_dim_v = head_dim
    _check_size("head_dim_v", head_dim_v)
    device = check_device(device)
    if (k_scale is None) != (v_scale is None):
        raise InputError(
            "k_scale is given but v_scale is not (or the other way); accepted: both static "
            "scales, or neither (per-slot scales set by each write)"
        )
    if k_scale is not None and kv_dtype in PER_CHANNEL_KEYS:
        raise InputError(
            f"k_scale/v_scale are given for a {kv_dtype} cache; accepted: none ({kv_dtype} scales keys per "
            "block and channel and values per slot, set by each write)"
        )
    if k_scale is not None and kv_dtype == "auto":
        raise InputError(
            "k_scale/v_scale are given for a kv_dtype 'auto' cache; accepted: static scales "
            f"for a quantized cache only (kv_dtype {_QUANTIZED})"
        )
    store_dtype = dtype if kv_dtype == "auto" else _CODE_DTYPE[kv_dtype]
    pack = PACKED_CODES.get(kv_dtype, 1)
    _check_packed(kv_dtype, head_dim, head_dim_v)
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim // pack)
    k = torch.zeros(shape, dtype=store_dtype, device=device)
    v = torch.zeros((*shape[:3], head_dim_v // pack), dtype=store_dtype, device=device)
    spill: tuple[torch.Tensor, ...] = (k, v)
    ks = vs = None
    if k_scale is not None:
        ks = static_scale(k_scale, k, name="k_scale")
        vs = static_scale(cast(float | torch.Tensor, v_scale), v, name="v_scale")
        spill = (k, v, ks, vs)
    elif kv_dtype in PER_CHANNEL_KEYS:
        ks = torch.zeros((shape[0], num_kv_heads, head_dim), dtype=torch.float32, device=device)
        vs = torch.zeros(shape[:3], dtype=torch.float32, device=device)
        spill = (k, v, ks, vs)
    elif kv_dtype != "auto":
        ks = torch.zeros(shape[:3], dtype=torch.float32, device=device)
        vs = torch.zeros(shape[:3], dtype=torch.float32, device=device)
        spill = (k, v, ks, vs)
    return KVCache(
        k=k[:num_blocks],
        v=v[:num_blocks],
        kv_dtype=kv_dtype,
        k_scale=None if ks is None else ks[:num_blocks],
        v_scale=None if vs is None else vs[:num_blocks],
        dtype=dtype,
        _spill=spill,
    )


def _storage_facts(
    k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None
) -> tuple:
    """What an in-place ``set_`` or ``resize_`` changes without a new object: the addresses of
    the cache's tensors and the shapes of ``k`` and ``v`` (a flat tuple: this runs on every call)."""
    return (
        k.data_ptr(),
        k.shape,
        v.data_ptr(),
        v.shape,
        None if k_scale is None else k_scale.data_ptr(),
        None if v_scale is None else v_scale.data_ptr(),
    )


def _check_size(name: str, val: object) -> None:
    # bool is an int to Python: allocate_kv_cache(True, ...) must not be a 1-block cache.
    # An Integral (int, numpy.int64, ...) compares like the int it stands for.
    if not isinstance(val, numbers.Integral) or isinstance(val, bool) or not 1 <= cast(int, val) < 2**31:
        raise InputError(f"{name} is {val!r}; accepted: a positive int (below 2**31)")


def _check_packed(kv_dtype: str, head_dim: int, head_dim_v: int) -> None:
    pack = PACKED_CODES.get(kv_dtype, 1)
    for name, val in (("head_dim", head_dim), ("head_dim_v", head_dim_v)):
        if val % pack:
            raise InputError(
                f"{name} is {val}, but a {kv_dtype} cache stores {pack} codes per byte; accepted: a "
                f"multiple of {pack} (or another kv_dtype)"
            )


def _check_dtypes(dtype: object, kv_dtype: object) -> None:
    if not isinstance(kv_dtype, str) or kv_dtype not in KV_DTYPES:
        raise InputError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    check_dtype("dtype", dtype, _ELEM_BYTES)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, end)`` that tensor ``t`` (non-negative strides, not empty) can touch."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _tensor_layout(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)


def kv_bytes_per_token(
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: str = "auto",
    num_layers: int = 1,
    head_dim_v: int | None = None,
    block_size: int | None = None,
) -> int:
    """Bytes of K and V cache one token takes, over ``num_layers`` layers (scales included);
    ``head_dim_v`` (default ``head_dim``) is V's head dim; ``block_size`` is needed for
    ``kivi4``, whose key scales are per block (rounded up to a whole byte per token).

    >>> kv_bytes_per_token(8, 128, num_layers=36)   # Qwen3-8B in bf16
    147456
    """
    _check_dtypes(dtype, kv_dtype)
    if head_dim_v is None:
        head_dim_v = head_dim
    for name, val in (
        ("num_kv_heads", num_kv_heads),
        ("head_dim", head_dim),
        ("num_layers", num_layers),
        ("head_dim_v", head_dim_v),
    ):
        _check_size(name, val)
    elem = _ELEM_BYTES[dtype] if kv_dtype == "auto" else 1
    pack = PACKED_CODES.get(kv_dtype, 1)
    _check_packed(kv_dtype, head_dim, head_dim_v)
    scales = 0 if kv_dtype == "auto" else 2 * num_kv_heads * 4
    codes = num_kv_heads * (head_dim + head_dim_v) * elem // pack
    if kv_dtype in PER_CHANNEL_KEYS:  # per slot: V's scale; per block: one float per K channel
        if block_size is None:
            raise InputError(f"a {kv_dtype} cache's key scales are per block; accepted: block_size=<tokens per block>")
        _check_size("block_size", block_size)
        return num_layers * (codes + num_kv_heads * 4 + -(-num_kv_heads * head_dim * 4 // block_size))
    return num_layers * (codes + scales)
