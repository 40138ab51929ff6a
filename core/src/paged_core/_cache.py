"""The paged KV cache of one layer, in vLLM's NHD layout, and its int8/fp8 quantization.

``k, v: [num_blocks, block_size, num_kv_heads, head_dim]``. A quantized cache holds codes
(``int8`` or ``float8_e4m3fn``) and one float32 scale per (slot, KV head) in
``k_scale, v_scale: [num_blocks, block_size, num_kv_heads]``. Quantization is symmetric per
(token, head) vector: ``scale = max|x| / q_max`` (127 for int8, 448 for fp8 E4M3).
"""

from __future__ import annotations

import dataclasses

import torch

from ._errors import InputError
from ._spec import KV_DTYPES, dtype_name

__all__ = [
    "KVCache",
    "allocate_kv_cache",
    "write_kv",
    "quantize_kv",
    "dequantize_kv",
    "kv_bytes_per_token",
    "Q_MAX",
]

#: Largest code magnitude per quantized storage format.
Q_MAX = {"int8": 127.0, "fp8": 448.0}
_CODE_DTYPE = {"int8": torch.int8, "fp8": torch.float8_e4m3fn}
_ELEM_BYTES = {torch.float32: 4, torch.float16: 2, torch.bfloat16: 2}


@dataclasses.dataclass
class KVCache:
    """One layer's paged K/V pool.

    Allocated by :func:`allocate_kv_cache`, which keeps one hidden block past ``num_blocks``
    so that padding rows (slot -1) can be written somewhere harmless without a host sync.
    """

    #: [num_blocks, block_size, num_kv_heads, head_dim], model dtype or int8/float8_e4m3fn codes.
    k: torch.Tensor
    #: [num_blocks, block_size, num_kv_heads, head_dim], like ``k``.
    v: torch.Tensor
    #: "auto" (the model dtype), "int8" or "fp8".
    kv_dtype: str = "auto"
    #: float32 [num_blocks, block_size, num_kv_heads] for quantized caches, else None.
    k_scale: torch.Tensor | None = None
    #: float32 [num_blocks, block_size, num_kv_heads] for quantized caches, else None.
    v_scale: torch.Tensor | None = None
    #: The model dtype K/V arrive in (and are dequantized to).
    dtype: torch.dtype = torch.bfloat16
    # One extra block of storage after the pool: the destination of padding writes.
    _spill: tuple[torch.Tensor, ...] | None = dataclasses.field(default=None, repr=False)

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
        return int(self.k.shape[3])

    @property
    def device(self) -> torch.device:
        return self.k.device

    @property
    def quantized(self) -> bool:
        return self.kv_dtype != "auto"

    def dequantized(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(k, v) as float32 values: codes times scales for quantized caches."""
        if not self.quantized:
            return self.k.float(), self.v.float()
        return dequantize_kv(self.k, self.k_scale), dequantize_kv(self.v, self.v_scale)


def allocate_kv_cache(
    num_blocks: int,
    block_size: int,
    num_kv_heads: int,
    head_dim: int,
    *,
    dtype: torch.dtype = torch.bfloat16,
    kv_dtype: str = "auto",
    device: torch.device | str = "cpu",
) -> KVCache:
    """Allocate an empty (zeroed) cache of ``num_blocks`` blocks.

    >>> cache = allocate_kv_cache(4, 16, 2, 64, kv_dtype="int8")
    >>> tuple(cache.k.shape), cache.k.dtype, tuple(cache.k_scale.shape)
    ((4, 16, 2, 64), torch.int8, (4, 16, 2))
    """
    if kv_dtype not in KV_DTYPES:
        raise InputError(f"kv_dtype {kv_dtype!r} is not one of {', '.join(KV_DTYPES)}")
    if dtype not in _ELEM_BYTES:
        raise InputError(f"dtype {dtype} is not supported; accepted: float32, float16, bfloat16")
    for name, val in (("num_blocks", num_blocks), ("block_size", block_size),
                      ("num_kv_heads", num_kv_heads), ("head_dim", head_dim)):
        if not isinstance(val, int) or val < 1:
            raise InputError(f"{name} is {val!r}; accepted: a positive int")
    device = _check_device(device)
    store_dtype = dtype if kv_dtype == "auto" else _CODE_DTYPE[kv_dtype]
    shape = (num_blocks + 1, block_size, num_kv_heads, head_dim)
    k = torch.zeros(shape, dtype=store_dtype, device=device)
    v = torch.zeros(shape, dtype=store_dtype, device=device)
    spill: tuple[torch.Tensor, ...] = (k, v)
    ks = vs = None
    if kv_dtype != "auto":
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


def _check_device(device) -> torch.device:
    """``device`` as a torch.device that exists here, or an InputError saying what does."""
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        raise InputError(
            f"device {device!r} is not a device ({exc}); accepted: 'cpu', 'cuda', 'cuda:0', ..."
        ) from exc
    if dev.type == "cuda":
        count = torch.cuda.device_count() if torch.cuda.is_available() else 0
        if count == 0:
            raise InputError(
                f"device {device!r} was asked for but this machine has no usable CUDA GPU "
                "(torch.cuda.is_available() is False); accepted: 'cpu', or run on a GPU machine"
            )
        if dev.index is not None and dev.index >= count:
            raise InputError(f"device {device!r} does not exist; accepted: cuda:0 .. cuda:{count - 1}")
    return dev


def quantize_kv(x: torch.Tensor, kv_dtype: str) -> tuple[torch.Tensor, torch.Tensor]:
    """Symmetric per-vector quantization of ``x [..., head_dim]``.

    Returns ``(codes [..., head_dim], scales float32 [...])`` with ``x ≈ codes * scales[..., None]``.
    The round-trip error is at most ``scale / 2`` per element for int8 and a relative 2**-4 of
    the element (E4M3's 3 mantissa bits) for fp8.

    >>> codes, scale = quantize_kv(torch.tensor([[1.0, -2.0, 0.5]]), "int8")
    >>> codes.tolist(), round(scale.item() * 127, 4)
    ([[64, -127, 32]], 2.0)
    """
    if kv_dtype not in Q_MAX:
        raise InputError(f"kv_dtype {kv_dtype!r} cannot be quantized to; accepted: int8, fp8")
    xf = x.float()
    amax = xf.abs().amax(dim=-1)
    # A zero vector would give scale 0 and 0/0 codes: any positive scale encodes it exactly.
    scale = torch.where(amax > 0, amax / Q_MAX[kv_dtype], torch.ones_like(amax))
    y = xf / scale.unsqueeze(-1)
    if kv_dtype == "int8":
        codes = y.round().clamp(-127, 127).to(torch.int8)
    else:
        codes = y.clamp(-448.0, 448.0).to(torch.float8_e4m3fn)
    return codes, scale


def dequantize_kv(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """float32 values of quantized ``codes [..., head_dim]`` with ``scales [...]``."""
    return codes.float() * scales.float().unsqueeze(-1)


def _flat_rows(t: torch.Tensor) -> torch.Tensor:
    """View a [blocks, block_size, ...] store as [slots, ...]; fp8 through uint8 (see below)."""
    # PyTorch's CPU index_copy_/index_put_ have no float8 kernels: move fp8 bytes as uint8.
    if t.dtype == torch.float8_e4m3fn:
        t = t.view(torch.uint8)
    return t.reshape(t.shape[0] * t.shape[1], *t.shape[2:])


def _as_bytes(t: torch.Tensor) -> torch.Tensor:
    return t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t


def write_kv(cache: KVCache, k: torch.Tensor, v: torch.Tensor, slot_mapping: torch.Tensor) -> None:
    """Write new tokens' ``k, v [num_tokens, num_kv_heads, head_dim]`` at ``slot_mapping``.

    Slot -1 (a padding row) writes nothing. Quantized caches quantize on write. The write never
    leaves the pool: slots outside ``[0, num_blocks * block_size)`` are treated like -1.
    """
    if not isinstance(cache, KVCache):
        raise InputError(f"cache is a {type(cache).__name__}; accepted: a paged_core.KVCache")
    if (not isinstance(slot_mapping, torch.Tensor) or slot_mapping.dim() != 1
            or slot_mapping.dtype not in (torch.int64, torch.int32)):
        found = (f"{dtype_name(slot_mapping.dtype)} {list(slot_mapping.shape)}"
                 if isinstance(slot_mapping, torch.Tensor) else type(slot_mapping).__name__)
        raise InputError(f"slot_mapping is {found}; accepted: int64 or int32 [num_tokens]")
    n = slot_mapping.shape[0]
    want = (n, cache.num_kv_heads, cache.head_dim)
    for name, t in (("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise InputError(
                f"{name} is a {type(t).__name__}; accepted: a tensor [num_tokens={n}, "
                f"num_kv_heads={cache.num_kv_heads}, head_dim={cache.head_dim}]"
            )
        if tuple(t.shape) != want:
            raise InputError(
                f"{name} has shape {list(t.shape)}; accepted: [num_tokens={n}, "
                f"num_kv_heads={cache.num_kv_heads}, head_dim={cache.head_dim}] (one row per slot_mapping entry)"
            )
        if t.dtype != cache.dtype:
            raise InputError(
                f"{name} is {dtype_name(t.dtype)} but the cache was allocated for "
                f"{dtype_name(cache.dtype)}; accepted: {dtype_name(cache.dtype)}"
            )
        if t.device != cache.device:
            raise InputError(f"{name} is on {t.device} but the cache is on {cache.device}")
    if slot_mapping.device != cache.device:
        raise InputError(f"slot_mapping is on {slot_mapping.device} but the cache is on {cache.device}")
    if n == 0:
        return
    num_slots = cache.num_blocks * cache.block_size
    slots = slot_mapping.long()
    valid = (slots >= 0) & (slots < num_slots)
    if cache.quantized:
        kc, ks = quantize_kv(k, cache.kv_dtype)
        vc, vs = quantize_kv(v, cache.kv_dtype)
        pairs = [(0, kc), (1, vc), (2, ks), (3, vs)]
        views = (cache.k, cache.v, cache.k_scale, cache.v_scale)
    else:
        pairs = [(0, k), (1, v)]
        views = (cache.k, cache.v)
    if cache._spill is not None:
        # Invalid slots go to the hidden block past the pool: no host sync, nothing touched.
        target = torch.where(valid, slots, torch.full_like(slots, num_slots))
        for i, src in pairs:
            _flat_rows(cache._spill[i]).index_copy_(0, target, _as_bytes(src))
    else:
        # A cache wrapped around an engine's own tensors has no spill block: filter (syncs).
        keep = valid.nonzero().squeeze(1)
        for i, src in pairs:
            _flat_rows(views[i]).index_copy_(0, slots[keep], _as_bytes(src)[keep])


def kv_bytes_per_token(
    num_kv_heads: int, head_dim: int, *, dtype: torch.dtype = torch.bfloat16,
    kv_dtype: str = "auto", num_layers: int = 1,
) -> int:
    """Bytes of K and V cache one token takes, over ``num_layers`` layers (scales included).

    >>> kv_bytes_per_token(8, 128, num_layers=36)   # Qwen3-8B in bf16
    147456
    """
    elem = _ELEM_BYTES[dtype] if kv_dtype == "auto" else 1
    scales = 0 if kv_dtype == "auto" else 2 * num_kv_heads * 4
    return num_layers * (2 * num_kv_heads * head_dim * elem + scales)
