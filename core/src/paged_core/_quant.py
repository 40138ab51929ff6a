"""The codec of the quantized KV formats (``paged_core.QUANT_FORMATS``) and static scales.

Symmetric quantization of head vectors to int8, fp8 (E4M3, E5M2) or int4 codes (two to a
``uint8``) with float32 scales, value = code * scale (:func:`quantize_kv`), its inverse
(:func:`dequantize_kv`), the int4 packing (:func:`pack_int4`, :func:`unpack_int4`), and static
scales: one per tensor or per KV head, viewed over a cache's blocks and slots with strides 0
(:func:`static_scale`). It knows no cache: ``_cache`` stores what it makes and ``_write`` (the
reference write) quantizes with it.
"""

from __future__ import annotations

import numbers

import torch

from ._errors import InputError
from ._spec import PACKED_CODES, PER_CHANNEL_KEYS, QUANT_FORMATS, check_codes, tensor_desc

__all__ = [
    "quantize_kv",
    "dequantize_kv",
    "pack_int4",
    "unpack_int4",
    "static_scale",
    "is_static",
    "is_float8",
    "Q_MAX",
    "SCALE_FLOOR",
]

#: Largest code magnitude per quantized storage format.
Q_MAX = {name: q_max for name, (_, q_max) in QUANT_FORMATS.items()}
#: The smallest scale a write stores: float32's smallest normal, 2**-126 (a scale of
#: ``max|x| / q_max`` below it would be a subnormal, or 0 for a row of float32 subnormals).
SCALE_FLOOR = float(torch.finfo(torch.float32).tiny)


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
        found = tensor_desc(x) if isinstance(x, torch.Tensor) else f"a {type(x).__name__}"
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
            found = f"{tensor_desc(scale)} on {scale.device}" if isinstance(scale, torch.Tensor) else repr(scale)
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
        found = tensor_desc(codes) if isinstance(codes, torch.Tensor) else f"a {type(codes).__name__}"
        raise InputError(f"codes is {found}; accepted: a tensor [..., head_dim]")
    if (
        not isinstance(scales, torch.Tensor)
        or tuple(scales.shape) != tuple(codes.shape[:-1])
        or scales.device != codes.device
    ):
        found = (
            f"{tensor_desc(scales)} on {scales.device}"
            if isinstance(scales, torch.Tensor)
            else f"a {type(scales).__name__}"
        )
        raise InputError(
            f"scales is {found} but codes is {tensor_desc(codes)} on {codes.device}; accepted: one scale "
            f"per head vector, shape codes.shape[:-1] = {list(codes.shape[:-1])} on codes' device"
        )
    if codes.dtype == torch.uint8:  # int4 codes, two per byte
        codes = unpack_int4(codes)
    return codes.float() * scales.float().unsqueeze(-1)


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
        found = tensor_desc(k) if isinstance(k, torch.Tensor) else f"a {type(k).__name__}"
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
        found = f"{tensor_desc(scale)} on {scale.device}" if isinstance(scale, torch.Tensor) else f"{scale!r}"
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


def is_static(t: torch.Tensor) -> bool:
    """A scale tensor that does not vary over blocks and slots: stride 0 on each of them that
    has more than one element (a stride of a size-1 dimension means nothing). A cache of one
    slot in all is static only with both strides 0, as :func:`static_scale` makes them."""
    nb, bs = t.shape[0], t.shape[1]
    if nb == 1 and bs == 1:
        return t.stride(0) == 0 and t.stride(1) == 0
    return (nb == 1 or t.stride(0) == 0) and (bs == 1 or t.stride(1) == 0)


def is_float8(dtype: torch.dtype) -> bool:
    """Whether ``dtype`` is one of the fp8 code dtypes (``float8_e4m3fn``, ``float8_e5m2``)."""
    return dtype.is_floating_point and dtype.itemsize == 1
