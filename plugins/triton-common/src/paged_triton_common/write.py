"""One Triton launch that writes a step's new K/V rows into a paged cache (``Backend.write``).

:func:`write_kv` writes exactly what :func:`paged_core.write_kv` writes, codes and scales bit for
bit (non-finite inputs included): a row goes to slot ``slot_mapping[t]`` (block ``slot // block_size``,
offset ``slot % block_size``) through the cache tensors' strides, so views of an engine's pool
are written in place; slot -1 and slots outside ``[0, num_blocks * block_size)`` write nothing
(masked in the kernel: no spill block, no host sync, whatever the cache). int8/fp8 caches are
quantized in the kernel per (token, KV head) vector, step for step as
:func:`paged_core.quantize_kv` computes it (a cache with static scales skips the first step: its
scale is read at the slot, and no scale is stored):

* ``amax = max |x|`` in float32; ``scale = max(amax / q_max, 2**-126)`` (float32's smallest
  normal: a zero vector or one of subnormals keeps a positive scale) and ``y = x / scale``, both
  with IEEE round-to-nearest division (``tl.math.div_rn``: Triton's ``/``
  is not correctly rounded on NVIDIA GPUs; PyTorch's division by a tensor is, on every device).
* int8: ``y`` rounded half to even (``torch.round``) by the float32 add/subtract of
  ``1.5 * 2**23``, exact for ``|y| < 2**22``, clamped to ±127. fp8 E4M3: ``y`` clamped to ±448,
  then converted with PyTorch's own bit manipulation (``fp8e4m3fn_from_fp32_value``: round to
  nearest even, subnormals included), in integer arithmetic, so the interpreter and every GPU
  give the same bytes; fp8 E5M2 likewise, clamped to ±57344 (``fp8e5m2_from_fp32_value``).
  Codes travel as ``uint8`` (the CPU interpreter has no float8 pointers).
* Non-finite input (docs/reliability.md §4): a vector with a NaN or ±inf element gets codes 0
  and scale NaN (it reads back NaN, and no other slot changes); with static scales the element
  itself becomes fp8's NaN code ``0x7f`` (int8: code 0, having no NaN).

Cost, per call: one kernel launch, ``(num_tokens, cdiv(num_kv_heads, BLOCK_H))`` programs of one
token and ``BLOCK_H`` heads each (k and v both). Host work on a repeated call (same cache, same
shapes, strides, dtypes and devices of ``k``, ``v``, ``slot_mapping``): three ``data_ptr`` reads,
a key of ~16 attribute reads, one dict lookup, the launch-hook and current-device tests, and the
cached binary's ``run`` with every pointer passed as an int (no ``data_ptr`` call or pointer
query in Triton's launcher). A new key runs :func:`paged_core.check_write_inputs` (the checks of
``paged_core.write_kv``, same messages) and goes through :class:`~.direct.DirectKernel` (which
compiles once per specialisation, capture-safe on the first call). ``Backend.write`` adds its
own cached checks of the cache and the batch. The pure-PyTorch ``paged_core.write_kv`` this
replaces launches about 10 kernels for a full-precision cache and over 30 for a quantized one
(the quantization ops, the spill-slot arithmetic, one ``index_put_`` per tensor), ~86-117 us of
host time per call on an NVIDIA H200 (torch 2.11, Triton 3.6, 2026-12-01).
"""

from __future__ import annotations

from typing import Any

import torch
import triton
import triton.language as tl
from paged_core import KVCache, check_write_inputs
from paged_core import write_kv as torch_write_kv

from .direct import DirectKernel, _hooks_empty
from .runtime import INTERPRET, next_power_of_2

__all__ = ["write_kv", "write_kv_kernel"]


@triton.jit
def _e4m3fn_code(y):
    """float32 ``y`` within [-448, 448] -> its float8_e4m3fn byte (int32 0..255), rounded to
    nearest even as PyTorch's ``fp8e4m3fn_from_fp32_value`` does."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # Below 2**-6 (the smallest normal): adding 2**14 puts the value, rounded to the 2**-9 steps
    # of the subnormals by the float add itself, into the low mantissa bits.
    sub = (mag.to(tl.float32, bitcast=True) + 16384.0).to(tl.int32, bitcast=True) - (141 << 23)
    # Normal: rebias the exponent (127 -> 7) and drop 20 mantissa bits, rounding to nearest even.
    nrm = (mag + (((7 - 127) << 23) + 0x7FFFF) + ((mag >> 20) & 1)) >> 20
    code = tl.where(mag < (121 << 23), sub, nrm)
    return tl.where(bits < 0, code | 0x80, code)


@triton.jit
def _e5m2_code(y):
    """float32 ``y`` within [-57344, 57344] -> its float8_e5m2 byte (int32 0..255), rounded to
    nearest even as PyTorch's ``fp8e5m2_from_fp32_value`` does."""
    bits = y.to(tl.int32, bitcast=True)
    mag = bits & 0x7FFFFFFF
    # Below 2**-14 (the smallest normal): adding 2**7 puts the value, rounded to the 2**-16 steps
    # of the subnormals by the float add itself, into the low mantissa bits.
    sub = (mag.to(tl.float32, bitcast=True) + 128.0).to(tl.int32, bitcast=True) - (134 << 23)
    # Normal: rebias the exponent (127 -> 15) and drop 21 mantissa bits, rounding to nearest even.
    nrm = (mag + (((15 - 127) << 23) + 0xFFFFF) + ((mag >> 21) & 1)) >> 21
    code = tl.where(mag < (113 << 23), sub, nrm)
    return tl.where(bits < 0, code | 0x80, code)


@triton.jit
def _write_rows(
    src_ptr,  # [num_tokens, num_kv_heads, head_dim] model dtype, any strides
    dst_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim] model dtype, int8 or uint8 (fp8 codes)
    scale_ptr,  # float32 [num_blocks, block_size, num_kv_heads] (written only if KV_QUANT)
    src_offs,  # [BLOCK_H, HEAD_DIM_PAD] element offsets of the token's rows in src
    dst_offs,  # [BLOCK_H, HEAD_DIM_PAD] element offsets of the slot's rows in dst
    scale_offs,  # [BLOCK_H] element offsets of the slot's scales
    mask,  # [BLOCK_H, HEAD_DIM_PAD] valid slot, real head, real head-dim element
    mask_h,  # [BLOCK_H] valid slot, real head
    KV_QUANT: tl.constexpr,
    Q_MAX: tl.constexpr,
    STATIC_SCALE: tl.constexpr,
):
    """Copy (or quantize and store with their scales) BLOCK_H head vectors of one token.
    STATIC_SCALE: quantize with the cache's fixed scales, read at the slot, and store none."""
    x = tl.load(src_ptr + src_offs, mask=mask, other=0.0)
    if KV_QUANT == 0:
        tl.store(dst_ptr + dst_offs, x, mask=mask)  # a bit copy: no arithmetic on the values
    else:
        xf = x.to(tl.float32)  # [BLOCK_H, HEAD_DIM_PAD]; masked elements 0, never the max
        # False for NaN and ±inf. Tested explicitly: a GPU's max drops NaN, the interpreter's keeps it.
        finite = tl.abs(xf) <= 3.4028234663852886e38  # [BLOCK_H, HEAD_DIM_PAD]
        if STATIC_SCALE:
            scale = tl.load(scale_ptr + scale_offs, mask=mask_h, other=1.0)  # [BLOCK_H]
            y = tl.math.div_rn(tl.where(finite, xf, 0.0), scale[:, None])  # [BLOCK_H, HEAD_DIM_PAD]
        else:
            bad = tl.max(tl.where(finite, 0, 1), axis=1) > 0  # [BLOCK_H] a non-finite element
            amax = tl.max(tl.where(finite, tl.abs(xf), 0.0), axis=1)  # [BLOCK_H]
            # Floored at float32's smallest normal (paged_core's SCALE_FLOOR): a zero vector's
            # codes are 0, and a vector of subnormals, whose amax / Q_MAX is 0, reads back finite.
            scale = tl.maximum(tl.math.div_rn(amax, Q_MAX), 1.1754943508222875e-38)
            y = tl.where(bad[:, None], 0.0, tl.math.div_rn(xf, scale[:, None]))  # [BLOCK_H, HEAD_DIM_PAD]
            # A vector with a non-finite element: codes 0 (y above) and scale NaN, the bits of
            # torch's float("nan"), so every element reads back NaN.
            nan = tl.full(amax.shape, 0x7FC00000, tl.int32).to(tl.float32, bitcast=True)
            scale = tl.where(bad, nan, scale)
        if KV_QUANT == 1:
            # |y| <= ~127: adding 1.5 * 2**23 leaves no fraction bits, so the float add rounds to
            # the nearest integer, ties to even (torch.round); subtracting it back is exact.
            r = (y + 12582912.0) - 12582912.0
            code = tl.minimum(tl.maximum(r, -127.0), 127.0).to(tl.int8)
        elif KV_QUANT == 2:
            code = _e4m3fn_code(tl.minimum(tl.maximum(y, -448.0), 448.0)).to(tl.uint8)
        else:
            code = _e5m2_code(tl.minimum(tl.maximum(y, -57344.0), 57344.0)).to(tl.uint8)
        if STATIC_SCALE and KV_QUANT >= 2:
            # A static scale is shared: a non-finite element becomes fp8's NaN (0x7f) in its own
            # element (int8 has no NaN code: 0, from y above).
            code = tl.where(finite, code, 0x7F).to(tl.uint8)
        tl.store(dst_ptr + dst_offs, code, mask=mask)
        if not STATIC_SCALE:
            tl.store(scale_ptr + scale_offs, scale, mask=mask_h)


# The first three parameters are the ones that change between calls of one plan: the launch
# passes them before the cached rest (_Plan.tail).
@triton.jit
def write_kv_kernel(
    k_ptr,  # [num_tokens, num_kv_heads, head_dim] model dtype, any strides
    v_ptr,  # [num_tokens, num_kv_heads, head_dim_v] model dtype, any strides
    slot_mapping_ptr,  # int64 or int32 [num_tokens], any stride; -1 or out of the pool: not written
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM] model dtype, int8 or uint8 (fp8)
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM_V] like k_cache
    k_scale_ptr,  # float32 [num_blocks, BLOCK_SIZE, NUM_KV_HEADS] (written only if KV_QUANT)
    v_scale_ptr,  # float32 [num_blocks, BLOCK_SIZE, NUM_KV_HEADS] (written only if KV_QUANT)
    num_slots,  # num_blocks * BLOCK_SIZE
    stride_k_t,
    stride_k_h,
    stride_k_d,
    stride_v_t,
    stride_v_h,
    stride_v_d,
    stride_sm_t,
    stride_kc_b,
    stride_kc_s,
    stride_kc_h,
    stride_vc_b,
    stride_vc_s,
    stride_vc_h,
    stride_ks_b,
    stride_ks_s,
    stride_ks_h,
    stride_vs_b,
    stride_vs_s,
    stride_vs_h,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_H: tl.constexpr,  # KV heads per program (a power of two)
    HEAD_DIM_PAD: tl.constexpr,  # next power of two of HEAD_DIM
    KV_QUANT: tl.constexpr,  # 0: the model dtype, copied; 1: int8 codes; 2/3: fp8 e4m3/e5m2 codes (as uint8)
    Q_MAX: tl.constexpr,  # largest code (127.0, 448.0, 57344.0; unused if not KV_QUANT)
    STATIC_SCALE: tl.constexpr,  # KV_QUANT with static scales: read, never written
    HEAD_DIM_V: tl.constexpr,  # V's head dim (HEAD_DIM but in MLA-shaped layers)
    HEAD_DIM_V_PAD: tl.constexpr,  # next power of two of HEAD_DIM_V
):
    """One program writes BLOCK_H KV heads of token ``program_id(0)``, k and v, at its slot."""
    tl.static_assert(BLOCK_H & (BLOCK_H - 1) == 0)
    token = tl.program_id(0).to(tl.int64)
    slot = tl.load(slot_mapping_ptr + token * stride_sm_t).to(tl.int64)
    valid = (slot >= 0) & (slot < num_slots)
    slot = tl.where(valid, slot, 0)  # keeps the (masked) addresses inside the pool
    block = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE
    heads = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)  # [BLOCK_H]
    dims = tl.arange(0, HEAD_DIM_PAD)  # [HEAD_DIM_PAD]
    # An invalid slot has no head to write. (Not ``valid & (heads < ...)``: the interpreter of
    # Triton 3.9 turns a scalar bool & a bool vector into int64, which it refuses as a mask.)
    mask_h = heads < tl.where(valid, NUM_KV_HEADS, 0)  # [BLOCK_H]
    mask = mask_h[:, None] & (dims < HEAD_DIM)[None, :]  # [BLOCK_H, HEAD_DIM_PAD]
    if HEAD_DIM_V == HEAD_DIM:  # V's lanes: k's, or its own head dim's (MLA-shaped layers)
        dims_v = dims
        mask_v = mask
    else:
        dims_v = tl.arange(0, HEAD_DIM_V_PAD)
        mask_v = mask_h[:, None] & (dims_v < HEAD_DIM_V)[None, :]  # [BLOCK_H, HEAD_DIM_V_PAD]
    _write_rows(
        k_ptr,
        k_cache_ptr,
        k_scale_ptr,
        token * stride_k_t + heads[:, None] * stride_k_h + dims[None, :] * stride_k_d,
        block * stride_kc_b + offset * stride_kc_s + heads[:, None] * stride_kc_h + dims[None, :],
        block * stride_ks_b + offset * stride_ks_s + heads * stride_ks_h,
        mask,
        mask_h,
        KV_QUANT=KV_QUANT,
        Q_MAX=Q_MAX,
        STATIC_SCALE=STATIC_SCALE,
    )
    _write_rows(
        v_ptr,
        v_cache_ptr,
        v_scale_ptr,
        token * stride_v_t + heads[:, None] * stride_v_h + dims_v[None, :] * stride_v_d,
        block * stride_vc_b + offset * stride_vc_s + heads[:, None] * stride_vc_h + dims_v[None, :],
        block * stride_vs_b + offset * stride_vs_s + heads * stride_vs_h,
        mask_v,
        mask_h,
        KV_QUANT=KV_QUANT,
        Q_MAX=Q_MAX,
        STATIC_SCALE=STATIC_SCALE,
    )


_write = DirectKernel(write_kv_kernel)

# Elements of one k (or v) tile per program: 8 KV heads of 128 in one program, one 16-byte load
# per thread and row at 4 warps.
_TILE_ELEMS = 1024
# kv_dtype -> (KV_QUANT, Q_MAX).
_QUANT = {"auto": (0, 1.0), "int8": (1, 127.0), "fp8": (2, 448.0), "fp8_e5m2": (3, 57344.0)}
# Entries of _seen before it is emptied: the layers x batch shapes of a few live steps.
_SEEN_MAX = 4096


class _Plan:
    """What a write needs beyond ``k``, ``v`` and ``slot_mapping`` for one cache and one input
    signature (strides, dtypes, alignment), whatever the number of tokens. Holds no tensor (a
    plan must not keep a dropped cache alive): the cache's tensors are passed at each launch."""

    __slots__ = ("scalars", "kv_quant", "head_blocks", "num_warps", "torch_path", "tail", "compiled", "device")

    def __init__(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
        # Without the interpreter Triton runs on GPUs only: elsewhere the PyTorch write does the
        # same work (DirectKernel launches on CUDA devices).
        self.torch_path = cache.device.type != "cuda" and not (INTERPRET and cache.device.type == "cpu")
        # int4 codes pack two elements per byte: written by the PyTorch path.
        self.torch_path = self.torch_path or cache.kv_dtype not in _QUANT
        kv_quant, q_max = _QUANT.get(cache.kv_dtype, (0, 1.0))
        self.kv_quant = kv_quant
        ks_strides: tuple[int, ...] = (0, 0, 0)
        vs_strides: tuple[int, ...] = (0, 0, 0)
        if kv_quant:
            ks_strides, vs_strides = (t.stride() for t in cache._scales())
        heads, head_dim, head_dim_v = cache.num_kv_heads, cache.head_dim, cache.head_dim_v
        head_dim_pad = next_power_of_2(head_dim)
        head_dim_v_pad = next_power_of_2(head_dim_v)
        block_h = min(next_power_of_2(heads), max(1, _TILE_ELEMS // max(head_dim_pad, head_dim_v_pad)))
        tile = block_h * max(head_dim_pad, head_dim_v_pad)
        self.head_blocks = -(-heads // block_h)
        self.num_warps = 4 if tile >= 1024 else 2 if tile >= 256 else 1
        self.scalars: dict[str, Any] = dict(
            num_slots=cache.num_blocks * cache.block_size,
            stride_k_t=k.stride(0),
            stride_k_h=k.stride(1),
            stride_k_d=k.stride(2),
            stride_v_t=v.stride(0),
            stride_v_h=v.stride(1),
            stride_v_d=v.stride(2),
            stride_sm_t=slot_mapping.stride(0),
            stride_kc_b=cache.k.stride(0),
            stride_kc_s=cache.k.stride(1),
            stride_kc_h=cache.k.stride(2),
            stride_vc_b=cache.v.stride(0),
            stride_vc_s=cache.v.stride(1),
            stride_vc_h=cache.v.stride(2),
            stride_ks_b=ks_strides[0],
            stride_ks_s=ks_strides[1],
            stride_ks_h=ks_strides[2],
            stride_vs_b=vs_strides[0],
            stride_vs_s=vs_strides[1],
            stride_vs_h=vs_strides[2],
            NUM_KV_HEADS=heads,
            HEAD_DIM=head_dim,
            BLOCK_SIZE=cache.block_size,
            BLOCK_H=block_h,
            HEAD_DIM_PAD=head_dim_pad,
            KV_QUANT=kv_quant,
            Q_MAX=q_max,
            STATIC_SCALE=cache.static_scales,
            HEAD_DIM_V=head_dim_v,
            HEAD_DIM_V_PAD=head_dim_v_pad,
        )
        # Set by the first launch through DirectKernel: the binary, the arguments after the first
        # three (the cache's pointers as ints) and the device it was loaded on.
        self.tail: tuple | None = None
        self.compiled: Any = None
        self.device = -1

    def launch(self, cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor, n: int) -> None:
        """Launch through DirectKernel (compiles on a new specialisation, capture-safe), and
        remember the binary and the arguments for the direct launches of later calls."""
        k_cache, v_cache = cache.k, cache.v
        if self.kv_quant >= 2:
            # fp8 codes travel as bytes (the interpreter has no float8 pointers).
            k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
        # Without quantization the scale pointers are never written: any tensor keeps the
        # signature fixed.
        ks, vs = cache._scales() if self.kv_quant else (k_cache, v_cache)
        kwargs = dict(
            k_ptr=k,
            v_ptr=v,
            slot_mapping_ptr=slot_mapping,
            k_cache_ptr=k_cache,
            v_cache_ptr=v_cache,
            k_scale_ptr=ks,
            v_scale_ptr=vs,
            **self.scalars,
        )
        compiled = _write[(n, self.head_blocks)](**kwargs, num_warps=self.num_warps)
        if compiled is None or not _write.enabled:
            return  # the interpreter: every call takes this path
        self.compiled = compiled
        self.device = torch.cuda.current_device()
        # Pointers as ints: Triton's launcher then skips data_ptr() and the driver's pointer query.
        # Set last: a set tail means the two fields above are set.
        self.tail = tuple(a.data_ptr() if isinstance(a, torch.Tensor) else a for a in _write._args(kwargs, {})[3:])


# Input signatures that passed the checks -> their plan; plans, shared by every token count.
_seen: dict[tuple, _Plan] = {}
_plans: dict[tuple, _Plan] = {}


def _admit(key: tuple | None, cache: KVCache, k: Any, v: Any, slot_mapping: Any) -> tuple[_Plan, int]:
    """The checks of ``paged_core.write_kv`` (raising its errors), then the plan of the inputs."""
    n = check_write_inputs(cache, k, v, slot_mapping)
    plan_key = (
        cache._generation,
        k.stride(),
        v.stride(),
        slot_mapping.stride(),
        slot_mapping.dtype,
        k.data_ptr() & 15,
        v.data_ptr() & 15,
        slot_mapping.data_ptr() & 15,
    )
    plan = _plans.get(plan_key)
    if plan is None:
        if len(_plans) >= _SEEN_MAX:
            _plans.clear()
        plan = _plans[plan_key] = _Plan(cache, k, v, slot_mapping)
    if key is not None:
        if len(_seen) >= _SEEN_MAX:
            _seen.clear()
        _seen[key] = plan
    return plan, n


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """:func:`paged_core.write_kv` in one Triton launch: the same checks, errors and bytes.

    Writes ``k, v [num_tokens, num_kv_heads, head_dim]`` (any strides) at ``slot_mapping``
    (int64 or int32 ``[num_tokens]``; -1 and slots outside the pool write nothing), quantizing
    for int8/fp8 caches, through the cache tensors' strides. Never synchronises with the device;
    CUDA-graph capturable, on the first call too. On a CPU without ``TRITON_INTERPRET=1`` (where
    Triton cannot run) it is ``paged_core.write_kv``.

    >>> from paged_core import allocate_kv_cache
    >>> cache = allocate_kv_cache(2, 4, 1, 2, dtype=torch.float32)
    >>> write_kv(cache, torch.ones(2, 1, 2), torch.ones(2, 1, 2), torch.tensor([5, -1]))
    >>> cache.k[1, 1].tolist(), int(cache.k.sum())
    ([[1.0, 1.0]], 2)
    """
    if isinstance(cache, KVCache):
        cache.check()
    write_checked(cache, k, v, slot_mapping)


def write_checked(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """:func:`write_kv` for a cache whose ``check()`` has just passed (``Backend.write``)."""
    ptrs: list[int] | None
    try:
        ptrs = [k.data_ptr(), v.data_ptr(), slot_mapping.data_ptr()]
        # Everything check_write_inputs reads and the plan depends on; the cache enters by the
        # generation of its structure check, a number no other check had.
        key: tuple = (
            cache._generation,
            k.shape,
            v.shape,
            slot_mapping.shape,
            k.stride(),
            v.stride(),
            slot_mapping.stride(),
            k.dtype,
            v.dtype,
            slot_mapping.dtype,
            k.device,
            v.device,
            slot_mapping.device,
            ptrs[0] & 15,
            ptrs[1] & 15,
            ptrs[2] & 15,
        )
    except (AttributeError, TypeError, RuntimeError):
        ptrs = None  # not tensors: the checks say what is wrong
        plan, n = _admit(None, cache, k, v, slot_mapping)
    else:
        hit = _seen.get(key)
        if hit is None:
            plan, n = _admit(key, cache, k, v, slot_mapping)
        else:
            plan, n = hit, key[1][0]  # k.shape[0], which the checks found equal to len(slot_mapping)
    if n == 0:
        return
    if plan.torch_path:
        torch_write_kv(cache, k, v, slot_mapping)
    elif plan.tail is not None and ptrs is not None and _hooks_empty() and torch.cuda.current_device() == plan.device:
        ptrs.extend(plan.tail)
        _write._run(plan.compiled, ptrs, (n, plan.head_blocks), plan.device)
    else:
        plan.launch(cache, k, v, slot_mapping, n)
