"""The paged KV cache of one layer, in vLLM's NHD layout, and its int8/fp8 quantization.

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
"""

from __future__ import annotations

import dataclasses
import itertools
import numbers
import operator
from typing import cast

import torch

from ._errors import InputError
from ._spec import KV_DTYPES, PACKED_CODES, PER_CHANNEL_KEYS, QUANT_FORMATS, check_codes, check_device, dtype_name

__all__ = [
    "KVCache",
    "allocate_kv_cache",
    "write_kv",
    "check_write_inputs",
    "quantize_kv",
    "dequantize_kv",
    "pack_int4",
    "unpack_int4",
    "kv_bytes_per_token",
    "static_scale",
    "Q_MAX",
]

#: Largest code magnitude per quantized storage format.
Q_MAX = {name: q_max for name, (_, q_max) in QUANT_FORMATS.items()}
#: The smallest scale a write stores: float32's smallest normal, 2**-126 (a scale of
#: ``max|x| / q_max`` below it would be a subnormal, or 0 for a row of float32 subnormals).
SCALE_FLOOR = float(torch.finfo(torch.float32).tiny)
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
            and _is_static(self.k_scale)
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
                found = _desc(t) if isinstance(t, torch.Tensor) else f"a {type(t).__name__}"
                raise InputError(
                    f"cache.{name} is {found}; accepted: a 4-D tensor [num_blocks, block_size, "
                    "num_kv_heads, head_dim] (NHD; view other layouts as NHD)"
                )
            if t.dtype != store:
                raise InputError(
                    f"cache.{name} is {_desc(t)} but kv_dtype {self.kv_dtype!r} with dtype "
                    f"{dtype_name(self.dtype)} stores {dtype_name(store)}; accepted: {dtype_name(store)} "
                    "codes (or set kv_dtype/dtype to what the tensors hold)"
                )
            if min(t.shape) < 1:
                raise InputError(f"cache.{name} is {_desc(t)}; accepted: every dimension >= 1")
            if t.stride(-1) != 1:
                raise InputError(
                    f"cache.{name}'s last dimension has stride {t.stride(-1)}; accepted: stride 1 "
                    "(head_dim contiguous; any strides for the other dimensions)"
                )
        if self.v.shape[:3] != self.k.shape[:3] or self.v.device != self.k.device:
            raise InputError(
                f"cache.v is {_desc(self.v)} on {self.v.device} but cache.k is {_desc(self.k)} on "
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
                    f"{_desc(t)} on {t.device}"
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
            if self.kv_dtype in PER_CHANNEL_KEYS and _is_static(t):
                raise InputError(
                    f"cache.{name} is a static scale (block and slot strides 0) for a {self.kv_dtype} cache; "
                    f"accepted: per-slot V scales, an element of their own for each (slot, KV head) "
                    f"({self.kv_dtype} sets them on every write; allocate it with allocate_kv_cache(..., "
                    f"kv_dtype={self.kv_dtype!r}))"
                )
            # Per-slot scales are written by every write: they need one element each (an
            # expanded view would make the writes of different slots land on one float).
            if not _is_static(t) and 0 in [st for st, n in zip(t.stride(), t.shape, strict=True) if n > 1]:
                raise InputError(
                    f"cache.{name} has strides {tuple(t.stride())} for shape {list(t.shape)}; accepted: "
                    "per-slot scales with an element of their own for each (slot, KV head), or static "
                    "scales whose block and slot strides are 0 (paged_core.static_scale)"
                )
        if (
            self.quantized
            and self.kv_dtype not in PER_CHANNEL_KEYS
            and _is_static(cast(torch.Tensor, self.k_scale)) != _is_static(cast(torch.Tensor, self.v_scale))
        ):
            kinds = [
                "static" if _is_static(cast(torch.Tensor, t)) else "per slot" for t in (self.k_scale, self.v_scale)
            ]
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


def static_scale(scale: float | torch.Tensor, k: torch.Tensor, *, name: str = "scale") -> torch.Tensor:
    """The ``[num_blocks, block_size, num_kv_heads]`` scale view of a static scale for cache
    tensor ``k`` (``[num_blocks, block_size, num_kv_heads, head_dim]``).

    ``scale``: a positive finite float, or a float32 tensor on ``k``'s device holding one value
    (shape ``[]`` or ``[1]``: a per-tensor scale, as vLLM's ``layer._k_scale``) or one per KV head
    (``[num_kv_heads]``). A tensor is viewed, not copied (block and slot strides 0): an engine
    that updates its scale in place updates the cache's. Its values are read once here, to
    refuse a scale that is not positive and finite (a sync for a GPU tensor; skipped while a
    CUDA graph is being captured, where a sync is not allowed).

    >>> k = torch.zeros(4, 16, 2, 64, dtype=torch.int8)
    >>> s = static_scale(torch.tensor([0.5, 0.25]), k)
    >>> tuple(s.shape), s.stride(), s[3, 7].tolist()
    ((4, 16, 2), (0, 0, 1), [0.5, 0.25])
    """
    if not isinstance(k, torch.Tensor) or k.dim() != 4:
        found = _desc(k) if isinstance(k, torch.Tensor) else f"a {type(k).__name__}"
        raise InputError(f"k is {found}; accepted: a cache tensor [num_blocks, block_size, num_kv_heads, head_dim]")
    heads = k.shape[2]
    if isinstance(scale, numbers.Real) and not isinstance(scale, bool):
        base = torch.full((1,), float(scale), dtype=torch.float32, device=k.device)
    elif (
        isinstance(scale, torch.Tensor)
        and scale.dtype == torch.float32
        and scale.device == k.device
        and scale.numel() in (1, heads)
        and scale.dim() <= 1
    ):
        base = scale.reshape(-1)
    else:
        found = f"{_desc(scale)} on {scale.device}" if isinstance(scale, torch.Tensor) else f"{scale!r}"
        raise InputError(
            f"{name} is {found}; accepted: a positive float, or a float32 tensor on {k.device} of "
            f"shape [] or [1] (one scale) or [num_kv_heads={heads}] (one per KV head)"
        )
    capturing = base.is_cuda and torch.cuda.is_current_stream_capturing()
    values = None if capturing else base.detach().cpu()
    if values is not None and not bool(torch.isfinite(values).all() and (values > 0).all()):
        raise InputError(f"{name} holds {values.tolist()}; accepted: positive, finite scales")
    # Strides set, not left to expand: expand keeps the stride of a dimension of size 1 (a
    # one-slot block), and stride 0 is what marks the view static.
    return base.as_strided(
        (k.shape[0], k.shape[1], heads), (0, 0, base.stride(0) if base.numel() > 1 else 0), base.storage_offset()
    )


def _storage_facts(k: torch.Tensor, v: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None):
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


def _is_static(t: torch.Tensor) -> bool:
    """A scale tensor that does not vary over blocks and slots: stride 0 on each of them that
    has more than one element (a stride of a size-1 dimension means nothing). A cache of one
    slot in all is static only with both strides 0, as :func:`static_scale` makes them."""
    nb, bs = t.shape[0], t.shape[1]
    if nb == 1 and bs == 1:
        return t.stride(0) == 0 and t.stride(1) == 0
    return (nb == 1 or t.stride(0) == 0) and (bs == 1 or t.stride(1) == 0)


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
    if not isinstance(dtype, torch.dtype) or dtype not in _ELEM_BYTES:
        raise InputError(f"dtype {dtype} is not supported; accepted: float32, float16, bfloat16")


def _desc(t: torch.Tensor) -> str:
    return f"{dtype_name(t.dtype)} {list(t.shape)}"


def quantize_kv(x: torch.Tensor, kv_dtype: str, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-vector quantization of ``x [..., head_dim]``.

    Returns ``(codes [..., head_dim], scales float32 [...])`` with ``x ≈ codes * scales[..., None]``.
    Without ``scale`` each vector gets ``max|x| / q_max``: the round-trip error is at most
    ``scale / 2`` per element for int8 and a relative 2**-4 of the element for fp8 (E4M3's 3
    mantissa bits), 2**-3 for fp8_e5m2 (2 bits). With ``scale`` (float32, broadcastable to
    ``x.shape[:-1]``: a static scale) the codes are ``x / scale``, rounded and clamped to the
    format's range (values beyond ``q_max * scale`` saturate).

    Scales are at least ``2**-126`` (float32's smallest normal), so finite input never reads
    back NaN. Non-finite input (NaN, ±inf) stays NaN where it was written, never changing another
    vector: without ``scale`` a vector holding one gets scale NaN and codes 0 (every element reads
    back NaN); with a static ``scale`` the element itself becomes fp8's NaN code, or code 0 for
    int8/int4, which have no NaN code (the one case where it reads back finite).

    >>> codes, scale = quantize_kv(torch.tensor([[1.0, -2.0, 0.5]]), "int8")
    >>> codes.tolist(), round(scale.item() * 127, 4)
    ([[64, -127, 32]], 2.0)
    >>> quantize_kv(torch.tensor([[1.0, -2.0, 0.5]]), "int8", torch.tensor(0.01))[0].tolist()
    [[100, -127, 50]]
    """
    if not isinstance(kv_dtype, str) or kv_dtype not in Q_MAX or kv_dtype in PER_CHANNEL_KEYS:
        per_block = isinstance(kv_dtype, str) and kv_dtype in PER_CHANNEL_KEYS
        extra = f" ({kv_dtype} scales keys per block: write_kv quantizes them)" if per_block else ""
        accepted = ", ".join(f for f in QUANT_FORMATS if f not in PER_CHANNEL_KEYS)
        raise InputError(f"kv_dtype {kv_dtype!r} cannot be quantized to{extra}; accepted: {accepted}")
    if not isinstance(x, torch.Tensor) or x.dim() < 1 or not x.is_floating_point():
        found = _desc(x) if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
        raise InputError(f"x is {found}; accepted: a floating-point tensor [..., head_dim]")
    xf = x.float()
    finite = torch.isfinite(xf)
    scale_given = scale is not None
    if scale is None:
        amax = torch.where(finite, xf.abs(), 0.0).amax(dim=-1)
        # A tensor divisor: PyTorch's CUDA division by a Python scalar multiplies by its
        # reciprocal (a last-bit difference from the CPU), so the same K/V would get other
        # scales per device. The floor keeps a zero vector's codes 0/floor = 0 and a vector of
        # float32 subnormals (whose max / q_max underflows to 0) from reading back 0 * inf.
        scale = torch.clamp_min(amax / torch.full_like(amax, Q_MAX[kv_dtype]), SCALE_FLOOR)
        # A non-finite element marks its whole vector: scale NaN, codes 0 (see the docstring).
        bad = ~finite.all(dim=-1)
        scale = torch.where(bad, torch.full_like(scale, float("nan")), scale)
    else:
        if not isinstance(scale, torch.Tensor) or scale.dtype != torch.float32 or scale.device != x.device:
            found = f"{_desc(scale)} on {scale.device}" if isinstance(scale, torch.Tensor) else repr(scale)
            raise InputError(f"scale is {found}; accepted: a float32 tensor on x's device ({x.device})")
        try:
            scale = scale.expand(x.shape[:-1])
        except RuntimeError as exc:
            raise InputError(
                f"scale has shape {list(scale.shape)}, which does not broadcast to x's vectors "
                f"{list(x.shape[:-1])}; accepted: a shape that does (one scale, or one per KV head)"
            ) from exc
    y = xf / scale.unsqueeze(-1)
    code_dtype, q_max = QUANT_FORMATS[kv_dtype]
    if not code_dtype.is_floating_point:
        y = y.round()
    # Saturating: fp8 casts turn values beyond the format's range into NaN (E4M3) or inf (E5M2).
    y = y.clamp(-q_max, q_max)
    if scale_given:
        # A static scale is shared: a non-finite element becomes NaN in its own element where the
        # format has a NaN (fp8: +NaN, one byte whatever the sign), else 0 (int codes have none).
        y = torch.where(finite, y, float("nan") if code_dtype.is_floating_point else 0.0)
    else:
        y = torch.where(bad.unsqueeze(-1), 0.0, y)
    if kv_dtype in PACKED_CODES:
        return pack_int4(y.to(torch.int8)), scale
    return y.to(code_dtype), scale


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int8 codes in ``[-8, 7]``, ``[..., 2n]``, as ``uint8 [..., n]``: element ``2i`` in the low
    nibble of byte ``i``, ``2i + 1`` in its high nibble (two's complement).

    >>> pack_int4(torch.tensor([[1, -1, 7, -7]], dtype=torch.int8)).tolist()
    [[241, 151]]
    """
    check_codes("codes", codes, torch.int8, "int8 codes in [-8, 7], [..., 2n] (codes.to(torch.int8))")
    if codes.shape[-1] % 2:
        raise InputError(f"codes has a last dimension of {codes.shape[-1]}; accepted: an even number (two per byte)")
    c = codes.to(torch.int16) & 0xF
    return (c[..., 0::2] | (c[..., 1::2] << 4)).to(torch.uint8)


def unpack_int4(packed: torch.Tensor) -> torch.Tensor:
    """The int8 codes of ``uint8 [..., n]`` packed int4 codes, ``[..., 2n]`` (:func:`pack_int4`).

    >>> unpack_int4(torch.tensor([[241, 151]], dtype=torch.uint8)).tolist()
    [[1, -1, 7, -7]]
    """
    check_codes("packed", packed, torch.uint8, "uint8 [..., n], two int4 codes a byte (an int4 cache's k or v)")
    b = packed.to(torch.int16)
    both = torch.stack((b & 0xF, b >> 4), dim=-1).flatten(-2)
    return torch.where(both > 7, both - 16, both).to(torch.int8)


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of quantized ``codes [..., head_dim]`` with ``scales [...]``.

    >>> dequantize_kv(torch.tensor([[64, -127]], dtype=torch.int8), torch.tensor([0.5])).tolist()
    [[32.0, -63.5]]
    """
    if not isinstance(codes, torch.Tensor) or codes.dim() < 1:
        found = _desc(codes) if isinstance(codes, torch.Tensor) else f"a {type(codes).__name__}"
        raise InputError(f"codes is {found}; accepted: a tensor [..., head_dim]")
    if (
        not isinstance(scales, torch.Tensor)
        or tuple(scales.shape) != tuple(codes.shape[:-1])
        or scales.device != codes.device
    ):
        found = (
            f"{_desc(scales)} on {scales.device}" if isinstance(scales, torch.Tensor) else f"a {type(scales).__name__}"
        )
        raise InputError(
            f"scales is {found} but codes is {_desc(codes)} on {codes.device}; accepted: one scale "
            f"per head vector, shape codes.shape[:-1] = {list(codes.shape[:-1])} on codes' device"
        )
    if codes.dtype == torch.uint8:  # int4 codes, two per byte
        codes = unpack_int4(codes)
    return codes.float() * scales.float().unsqueeze(-1)


def byte_span(t: torch.Tensor) -> tuple[int, int]:
    """The bytes ``[first, end)`` that tensor ``t`` (non-negative strides, not empty) can touch."""
    last = sum((n - 1) * st for n, st in zip(t.shape, t.stride(), strict=True))
    start = t.data_ptr()
    return start, start + (last + 1) * t.element_size()


def _tensor_layout(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16 == 0)


def is_float8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the fp8 code dtypes (``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype.is_floating_point and dtype.itemsize == 1


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    # PyTorch's CPU index_put_ has no float8 kernel: move fp8 bytes as uint8. A view of the
    # same element size needs only a contiguous last dimension, which check() guarantees.
    return t.view(torch.uint8) if is_float8(t.dtype) else t


def check_write_inputs(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> int:
    """The checks of :func:`write_kv`, before it writes anything; returns ``num_tokens``.

    ``cache`` a :class:`KVCache` whose :meth:`~KVCache.check` passes; ``slot_mapping`` int64 or
    int32 ``[num_tokens]``; ``k`` ``[num_tokens, num_kv_heads, head_dim]`` and ``v`` the same
    with the cache's ``head_dim_v``, of the cache's model dtype, on its device (any strides).
    Host-only (slot values are not read); raises :class:`InputError` saying what is wrong. A
    backend that writes with its own kernel calls this, so every write path refuses the same
    inputs with the same messages.

    >>> cache = allocate_kv_cache(2, 4, 1, 2, dtype=torch.float32)
    >>> check_write_inputs(cache, torch.ones(3, 1, 2), torch.ones(3, 1, 2), torch.tensor([0, 1, -1]))
    3
    """
    if not isinstance(cache, KVCache):
        raise InputError(f"cache is a {type(cache).__name__}; accepted: a paged_core.KVCache")
    cache.check()
    if (
        not isinstance(slot_mapping, torch.Tensor)
        or slot_mapping.dim() != 1
        or slot_mapping.dtype not in (torch.int64, torch.int32)
    ):
        found = (
            f"{dtype_name(slot_mapping.dtype)} {list(slot_mapping.shape)}"
            if isinstance(slot_mapping, torch.Tensor)
            else type(slot_mapping).__name__
        )
        raise InputError(f"slot_mapping is {found}; accepted: int64 or int32 [num_tokens]")
    n = slot_mapping.shape[0]
    for name, t, dim in (("k", k, cache.head_dim), ("v", v, cache.head_dim_v)):
        dim_name = "head_dim" if name == "k" or cache.head_dim_v == cache.head_dim else "head_dim_v"
        if not isinstance(t, torch.Tensor):
            raise InputError(
                f"{name} is a {type(t).__name__}; accepted: a tensor [num_tokens={n}, "
                f"num_kv_heads={cache.num_kv_heads}, {dim_name}={dim}]"
            )
        if tuple(t.shape) != (n, cache.num_kv_heads, dim):
            raise InputError(
                f"{name} has shape {list(t.shape)}; accepted: [num_tokens={n}, "
                f"num_kv_heads={cache.num_kv_heads}, {dim_name}={dim}] (one row per slot_mapping entry)"
            )
        if t.dtype != cache.dtype:
            raise InputError(
                f"{name} is {dtype_name(t.dtype)} but the cache was allocated for "
                f"{dtype_name(cache.dtype)}; accepted: {dtype_name(cache.dtype)}"
            )
        if t.device != cache.device:
            raise InputError(f"{name} is on {t.device} but the cache is on {cache.device}; accepted: one device")
    if slot_mapping.device != cache.device:
        raise InputError(
            f"slot_mapping is on {slot_mapping.device} but the cache is on {cache.device}; accepted: one device"
        )
    return n


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' ``k [num_tokens, num_kv_heads, head_dim]`` and ``v [num_tokens,
    num_kv_heads, head_dim_v]`` at ``slot_mapping``.

    Slot -1 (a padding row) writes nothing. Quantized caches quantize on write (with static
    scales: with those, which stay as they are; otherwise each slot gets its own). The write never
    leaves the pool: slots outside ``[0, num_blocks * block_size)`` are treated like -1. Every
    input is checked before anything is written.

    Writes go through the cache tensors' strides (``cache.k[block, offset] = ...``), so a cache
    whose ``k``/``v`` are views of an engine's pool (``pool[:, 0]`` of a ``[num_blocks, 2,
    block_size, heads, dim]`` pool, or HND storage ``.transpose(1, 2)``) is written in place.

    >>> cache = allocate_kv_cache(2, 4, 1, 2, dtype=torch.float32)
    >>> write_kv(cache, torch.ones(1, 1, 2), torch.ones(1, 1, 2), torch.tensor([5]))
    >>> cache.k[1, 1].tolist(), int(cache.k.sum())
    ([[1.0, 1.0]], 2)
    """
    n = check_write_inputs(cache, k, v, slot_mapping)
    if n == 0:
        return
    bs = cache.block_size
    num_slots = cache.num_blocks * bs
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < num_slots)
    if cache.kv_dtype in PER_CHANNEL_KEYS:
        if cache.device.type == "cuda" and torch.cuda.is_current_stream_capturing():
            raise InputError(
                f"a {cache.kv_dtype} cache is being written inside a CUDA-graph capture; its writes find the "
                "blocks they rescale on the host (a sync a capture forbids). Accepted: write outside the "
                "graph, or a per-token format (int4, int8, fp8) inside it"
            )
        keep = valid.nonzero().squeeze(1)  # a sync: the written blocks are found on the host
        _write_per_channel_keys(cache, k[keep], v[keep], slots[keep])
        return
    if cache.static_scales:
        # Quantized with the cache's fixed scales (one per KV head), which stay as they are.
        k_scale, v_scale = cache._scales()
        kc, _ = quantize_kv(k, cache.kv_dtype, k_scale[0, 0])
        vc, _ = quantize_kv(v, cache.kv_dtype, v_scale[0, 0])
        pairs = [(0, kc), (1, vc)]
        views: tuple[torch.Tensor, ...] = (cache.k, cache.v)
    elif cache.quantized:
        kc, ks = quantize_kv(k, cache.kv_dtype)
        vc, vs = quantize_kv(v, cache.kv_dtype)
        pairs = [(0, kc), (1, vc), (2, ks), (3, vs)]
        views = (cache.k, cache.v, *cache._scales())
    else:
        pairs = [(0, k), (1, v)]
        views = (cache.k, cache.v)
    if cache._spill_ok:
        # Invalid slots go to the hidden block past the pool: no host sync, nothing touched.
        target = torch.where(valid, slots, torch.full_like(slots, num_slots))
        blk, off = target // bs, target % bs
        # ``_spill_ok`` holds only when ``_spill`` is set (``_spill_matches``).
        spill = cast(tuple[torch.Tensor, ...], cache._spill)
        for i, src in pairs:
            _as_bytes(spill[i]).index_put_((blk, off), _as_bytes(src))
    else:
        # A cache wrapped around an engine's own tensors has no spill block: filter (syncs).
        keep = valid.nonzero().squeeze(1)
        blk, off = slots[keep] // bs, slots[keep] % bs
        for i, src in pairs:
            _as_bytes(views[i]).index_put_((blk, off), _as_bytes(src)[keep])


def _write_per_channel_keys(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slots: torch.Tensor) -> None:
    """``kivi4`` writes of valid ``slots``: values per (slot, KV head) as int4; keys per (block, KV
    head, channel) with scale ``max |k| / 7`` over the block's keys so far. A write that holds slot 0
    of a block starts the block afresh; any other write whose keys raise a channel's scale
    requantizes the block's earlier codes of that channel to the new scale (one more rounding of
    those keys, at most half the new step). Blocks are written whole, so a block's codes and its
    scales always agree."""
    if slots.numel() == 0:
        return
    q_max = Q_MAX[cache.kv_dtype]
    k_scale, v_scale = cache._scales()
    bs = cache.block_size
    blk, off = slots // bs, slots % bs
    kf = k.float()
    finite = torch.isfinite(kf)
    vc, vs = quantize_kv(v, "int4")  # values: int4's per-(slot, KV head) rule
    # A key with a non-finite element cannot scale its block's channels (a NaN or inf max would
    # rescale every other slot's keys): it is left out of the channel max, its non-finite
    # elements get code 0, and the slot's own V scale becomes NaN, so every row that reads the
    # slot is NaN and no other slot changes.
    vs = torch.where(finite.all(dim=-1), vs, float("nan"))
    cache.v.index_put_((blk, off), vc)
    v_scale.index_put_((blk, off), vs)
    kf = torch.where(finite, kf, 0.0)
    blocks, row = torch.unique(blk, return_inverse=True)  # [U], and each token's block among them
    u = blocks.shape[0]
    fresh = torch.zeros(u, dtype=torch.bool, device=slots.device).index_fill_(0, row[off == 0], True)
    new_max = torch.zeros(u, *k.shape[1:], dtype=torch.float32, device=k.device)
    k_abs = kf.abs()
    new_max.scatter_reduce_(0, row[:, None, None].expand_as(k_abs), k_abs, "amax")
    old = torch.where(fresh[:, None, None], 0.0, k_scale[blocks])  # [U, heads, channels]
    # Floored as quantize_kv's scales: a channel that is 0 so far keeps a tiny scale, not a
    # coarse one that a later, larger key could not raise.
    scale = torch.clamp_min(torch.maximum(old, new_max / q_max), SCALE_FLOOR)
    earlier = unpack_int4(cache.k[blocks]).float() * old[:, None]  # [U, block_size, heads, channels]
    codes = (earlier / scale[:, None]).round().clamp(-q_max, q_max)
    codes[row, off] = (kf / scale[row]).round().clamp(-q_max, q_max)
    cache.k[blocks] = pack_int4(codes.to(torch.int8))
    k_scale[blocks] = scale


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
