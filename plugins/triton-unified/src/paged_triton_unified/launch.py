"""Launcher of the triton-unified kernel: validation, tile sizing and the grid.

Everything here is host-side Python that reads only shapes, dtypes, strides and host ints, so a
call never synchronises with the device and can be captured in a CUDA graph.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools
import math
import numbers

import torch
from triton.runtime.autotuner import Autotuner

from .kernels import (
    INTERPRET,
    TILING_DIRECT,
    TILING_FUSED,
    TILING_PLAN,
    tile_plan_kernel,
    unified_attention_kernel,
)

__all__ = [
    "BLOCK_M_LARGE",
    "BLOCK_M_SMALL",
    "INTERPRET",
    "INTERPRET_CONFIG",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_KV_DTYPES",
    "LaunchConfig",
    "default_config",
    "side_branch",
    "sm_count",
    "unified_attention",
]

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)
SUPPORTED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The cache holds either q's dtype or quantized codes with float32 scales per (slot, KV head).
SUPPORTED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn)

# Rows per tile (BLOCK_Q query tokens x GROUP_PAD heads). 16 is the smallest tl.dot M, enough
# for one decode token of a small group. Prefill wants the 64/128-row MMAs of Hopper: 16-row
# tiles re-read the causal prefix once per few queries (GPU.md: 61-71 TFLOP/s for such designs).
BLOCK_M_SMALL = 16
BLOCK_M_LARGE = 128
# Head dims padded to 256 double every register tile; 64 rows keep the accumulator in registers.
BLOCK_M_LARGE_WIDE_HEAD = 64

# The one config run under TRITON_INTERPRET=1. BLOCK_N = 32 spans two 16-token cache blocks and
# half of a 64-token block, so the tests cover both sides of the block-table gather.
INTERPRET_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}

_TILE_PLAN_BLOCK_R = 1024  # requests per step of the tile-plan scan


# Keys per step of the decode tiles inside a fused launch when the autotuner picks the config
# (it tunes the large tiles' BLOCK_N; the small tiles are bandwidth-bound and like wide steps).
# H200, mixed batch of 2 x 512-token chunks + 30 decodes, fused launch, 64-row large tiles:
# 128 keys 0.167 ms, 64 keys 0.186 ms (scripts/gpu_tune.py, 2026-11-29).
FUSED_BLOCK_N_SMALL = 128
# Large tiles shrink from 128 to 64 rows when 128-row tiles would give fewer programs than this
# many per SM: the same mixed batch ran in 0.167 ms with 64-row tiles and 0.20-0.23 ms with
# 128-row ones (256 programs on 132 SMs), while prefill 8 x 2,048 (4,096 programs) keeps 128.
MIN_LARGE_PROGRAMS_PER_SM = 4


@functools.cache
def _sm_count(device_index: int) -> int:
    return torch.cuda.get_device_properties(device_index).multi_processor_count


def sm_count(device: torch.device | str) -> int | None:
    """Multiprocessors of a CUDA device (cached; no sync); None for any other device.

    >>> sm_count("cpu") is None
    True
    """
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return _sm_count(device.index if device.index is not None else torch.cuda.current_device())


@functools.cache
def _side_stream_of(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device_index)


@contextlib.contextmanager
def side_branch(device: torch.device, enabled: bool = True):
    """Launches that may run beside the current stream's. Yields ``side()``, a context: work
    under ``with side():`` runs on one extra (cached) stream of ``device``, forked from the
    current stream on entry; the rest of the block runs on the current stream; leaving the block
    joins the two. A CUDA graph captures the fork as parallel branches. Not ``enabled``, or not
    on CUDA: ``side()`` does nothing and everything runs in order.
    """
    if not enabled or device.type != "cuda":
        yield contextlib.nullcontext
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream_of(device.index if device.index is not None else torch.cuda.current_device())
    side.wait_stream(main)  # the side work may read what the current stream wrote before
    try:
        yield lambda: torch.cuda.stream(side)
    finally:
        main.wait_stream(side)


def large_tile_tokens(*, num_tokens: int, num_kv_heads: int, block_q_large: int, group_pad: int,
                      num_sms: int | None) -> int:
    """Query tokens per large tile: ``block_q_large``, halved (down to 64 rows) when the batch's
    large tiles could not give every SM ``MIN_LARGE_PROGRAMS_PER_SM`` programs.

    >>> large_tile_tokens(num_tokens=1054, num_kv_heads=8, block_q_large=32, group_pad=4, num_sms=132)
    16
    >>> large_tile_tokens(num_tokens=16384, num_kv_heads=8, block_q_large=32, group_pad=4, num_sms=132)
    32
    """
    if num_sms is None or block_q_large * group_pad <= 64:
        return block_q_large
    programs = (num_tokens // block_q_large) * num_kv_heads
    if programs < MIN_LARGE_PROGRAMS_PER_SM * num_sms:
        return max(1, block_q_large // 2)
    return block_q_large


def occupancy_class(programs: int, num_sms: int | None) -> int:
    """The autotune key's occupancy class: programs per SM rounded up to 1, 2, 4 or 8 (8: 8 or
    more); 1 without a GPU.

    >>> [occupancy_class(n * 8, 132) for n in (16, 32, 64, 128, 256)]  # decode batches, 8 KV heads
    [1, 2, 4, 8, 8]
    """
    if not num_sms:
        return 1
    return min(8, _next_power_of_2(-(-programs // num_sms)))


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How the launcher tiles a batch.

    Requests with at most ``block_q_small`` new tokens (decodes, short verification blocks) run
    with ``block_q_small``-token tiles; longer ones, if the batch has any, with
    ``block_q_large``-token tiles. ``block_n``/``num_warps``/``num_stages`` fix the kernel config
    (``None``: the autotuner chooses, on the GPU); ``large_*`` override them for the large tiles
    (``None``: the same as the small ones).

    Code-path switches (each selects between two exact implementations; the defaults are the
    faster ones as far as measured, the others stay for timing and as a fallback):

    - ``fuse_classes``: a batch with both classes runs in ONE launch (large tiles first, then
      the small ones fill the SMs the prefill tail leaves idle); False: two launches back to back.
    - ``decode_direct``: a batch where every request fits one small tile skips the tile-plan
      launch and the binary search (tile = request); False: always plan.
    - ``quant_fp16``: int8/fp8 caches with fp16/bf16 q run both dots in fp16 with a bit-trick
      int8 decode (no I2F) and the native e4m3->f16 conversion; False: convert codes to q's dtype.
      None (default): fp8 only. Measured on the H200 (64 x 4,096 decode, CUDA graph): fp8 0.281
      vs 0.306 ms with it, int8 0.301 vs 0.271 ms, so int8 keeps the bf16 path.
    - ``fold_scale``: the softmax scale moves into the exp2 argument (one FFMA per score instead
      of a multiply and a subtraction); False: scale every score first.
    - ``concurrent_classes`` (with ``fuse_classes=False``): the small tiles' launch runs on a
      side stream beside the large tiles' (each launch with its own warps and key steps: the
      fused launch must run both classes with one ``num_warps``, and 8 warps, good for 128-row
      prefill tiles, made the decode tiles 1.7 x slower on the H200). Off until timed.
    - ``prefetch_block_ids``: each key step loads the next step's block ids, so Triton's
      pipeliner can buffer the gathered K/V ``num_stages`` deep (offline sm_90a compile: 3 K/V
      buffers at 3 stages instead of 2). Off by default until timed on a GPU
      (``scripts/gpu_tune.py prefill decode``).
    """

    block_q_small: int
    block_q_large: int
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    large_block_n: int | None = None
    large_num_warps: int | None = None
    large_num_stages: int | None = None
    fuse_classes: bool = True
    decode_direct: bool = True
    quant_fp16: bool | None = None
    fold_scale: bool = True
    prefetch_block_ids: bool = False
    concurrent_classes: bool = False


def _next_power_of_2(n: int) -> int:
    return 1 << max(0, n - 1).bit_length()


def default_config(*, num_q_heads: int, num_kv_heads: int, head_dim: int) -> LaunchConfig:
    """The launcher's default tiling for a model shape (independent of the batch).

    >>> default_config(num_q_heads=32, num_kv_heads=8, head_dim=128).block_q_small
    4
    """
    group_pad = _next_power_of_2(num_q_heads // num_kv_heads)
    large_rows = BLOCK_M_LARGE if _next_power_of_2(head_dim) <= 128 else BLOCK_M_LARGE_WIDE_HEAD
    fixed = INTERPRET_CONFIG if INTERPRET else {}
    return LaunchConfig(
        block_q_small=max(1, BLOCK_M_SMALL // group_pad),
        block_q_large=max(1, large_rows // group_pad),
        block_n=fixed.get("BLOCK_N"),
        num_warps=fixed.get("num_warps"),
        num_stages=fixed.get("num_stages"),
    )


def _fail(name: str, found, accepted: str) -> None:
    raise ValueError(f"{name} {found} is not supported: triton-unified accepts {accepted}")


def _check_int32_vector(name: str, t, length: int, device) -> None:
    if not isinstance(t, torch.Tensor):
        _fail(name, f"of type {type(t).__name__}", "an int32 tensor")
    if t.dtype != torch.int32:
        _fail(name, f"with dtype {t.dtype}", "int32 (cast with .to(torch.int32))")
    if t.dim() != 1 or t.shape[0] != length:
        _fail(name, f"with shape {tuple(t.shape)}", f"shape ({length},)")
    if not t.is_contiguous():
        _fail(name, "with non-contiguous storage", "a contiguous tensor (call .contiguous())")
    if t.device != device:
        _fail(name, f"on {t.device}", f"tensors on q's device {device}")


def _check_scales(name: str, t, cache: torch.Tensor) -> None:
    expected = tuple(cache.shape[:3])
    if t is None:
        _fail(name, "None", f"a float32 tensor {expected} when the cache holds {cache.dtype} codes")
    if t.dtype != torch.float32 or tuple(t.shape) != expected:
        _fail(
            name,
            f"{t.dtype} {tuple(t.shape)}",
            f"float32 of shape {expected} (num_blocks, block_size, num_kv_heads)",
        )
    if t.device != cache.device:
        _fail(name, f"on {t.device}", f"tensors on q's device {cache.device}")


def _validate(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, max_query_len,
              max_seq_len, scale, window, softcap, sinks, k_scale, v_scale, lse) -> None:  # fmt: skip
    if q.dtype not in SUPPORTED_DTYPES:
        _fail("q dtype", q.dtype, "float32, float16 and bfloat16")
    if q.dim() != 3:
        _fail("q", f"with shape {tuple(q.shape)}", "[num_tokens, num_q_heads, head_dim]")
    num_tokens, num_q_heads, head_dim = q.shape
    if head_dim not in SUPPORTED_HEAD_DIMS:
        _fail("head_dim", head_dim, ", ".join(map(str, SUPPORTED_HEAD_DIMS)))
    if k_cache.dim() != 4:
        _fail(
            "k_cache",
            f"with shape {tuple(k_cache.shape)}",
            "[num_blocks, block_size, num_kv_heads, head_dim]",
        )
    num_blocks, block_size, num_kv_heads, cache_head_dim = k_cache.shape
    if block_size not in SUPPORTED_BLOCK_SIZES:
        _fail("block_size", block_size, "powers of two from 1 to 256")
    if cache_head_dim != head_dim:
        _fail("k_cache head_dim", cache_head_dim, f"q's head_dim {head_dim}")
    if num_kv_heads == 0 or num_q_heads % num_kv_heads:
        _fail("num_kv_heads", num_kv_heads, f"a divisor of num_q_heads ({num_q_heads})")
    if num_blocks == 0:
        _fail("k_cache", "with 0 blocks", "a cache of at least one block")
    if tuple(v_cache.shape) != tuple(k_cache.shape):
        _fail("v_cache shape", tuple(v_cache.shape), f"k_cache's shape {tuple(k_cache.shape)}")
    if k_cache.dtype != q.dtype and k_cache.dtype not in SUPPORTED_KV_DTYPES:
        _fail("k_cache dtype", k_cache.dtype, f"q's dtype ({q.dtype}), torch.int8 or torch.float8_e4m3fn")
    if v_cache.dtype != k_cache.dtype:
        _fail("v_cache dtype", v_cache.dtype, f"k_cache's dtype ({k_cache.dtype})")
    if out.dtype != q.dtype or tuple(out.shape) != tuple(q.shape):
        _fail("out", f"{out.dtype} {tuple(out.shape)}", f"q's dtype and shape ({q.dtype} {tuple(q.shape)})")
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            _fail(f"{name} stride", tuple(t.stride()), "a contiguous last (head_dim) dimension")
        if t.device != q.device:
            _fail(name, f"on {t.device}", f"tensors on q's device {q.device}")

    num_reqs = seq_lens.shape[0] if isinstance(seq_lens, torch.Tensor) else -1
    _check_int32_vector("seq_lens", seq_lens, max(num_reqs, 0), q.device)
    _check_int32_vector("query_start_loc", query_start_loc, num_reqs + 1, q.device)
    if (
        not isinstance(block_table, torch.Tensor)
        or block_table.dtype != torch.int32
        or block_table.dim() != 2
        or block_table.shape[0] != num_reqs
    ):
        found = (
            f"{block_table.dtype} {tuple(block_table.shape)}"
            if isinstance(block_table, torch.Tensor)
            else type(block_table).__name__
        )
        _fail("block_table", found, f"an int32 tensor [num_reqs={num_reqs}, max_blocks_per_req]")
    if block_table.device != q.device:
        _fail("block_table", f"on {block_table.device}", f"tensors on q's device {q.device}")

    # Host numbers only: reading a device tensor here would synchronise (and break graph capture).
    for name, value in (("max_query_len", max_query_len), ("max_seq_len", max_seq_len), ("window", window)):
        if not isinstance(value, numbers.Integral) or isinstance(value, bool) or value < 0:
            _fail(name, repr(value), "a non-negative host int (not a device tensor)")
    if not isinstance(scale, numbers.Real) or not math.isfinite(scale):
        _fail("scale", repr(scale), "a finite host float")
    if not isinstance(softcap, numbers.Real) or not softcap >= 0.0 or math.isinf(softcap):
        _fail("softcap", repr(softcap), "0 (off) or a positive host float")

    if k_cache.dtype in SUPPORTED_KV_DTYPES:
        _check_scales("k_scale", k_scale, k_cache)
        _check_scales("v_scale", v_scale, v_cache)
    elif k_scale is not None or v_scale is not None:
        # A claim is a promise: scales on a full-precision cache would be silently ignored.
        _fail(
            "k_scale/v_scale",
            "given",
            f"None when the cache holds {k_cache.dtype} values (scales are for int8/fp8 caches)",
        )
    if sinks is not None and (
        sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_q_heads,) or sinks.device != q.device
    ):
        _fail(
            "sinks",
            f"{sinks.dtype} {tuple(sinks.shape)} on {sinks.device}",
            f"None or float32 [{num_q_heads}] on {q.device}",
        )
    if lse is not None and (
        lse.dtype != torch.float32 or tuple(lse.shape) != (num_tokens, num_q_heads) or lse.device != q.device
    ):
        _fail(
            "lse",
            f"{lse.dtype} {tuple(lse.shape)} on {lse.device}",
            f"None or float32 [{num_tokens}, {num_q_heads}] on {q.device}",
        )


def unified_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    config: LaunchConfig | None = None,
) -> torch.Tensor:
    """Paged attention for a flattened batch of requests in any mix of prefill and decode.

    Request ``r`` owns rows ``query_start_loc[r]:query_start_loc[r+1]`` of ``q``; they are the
    last ``t`` of its ``seq_lens[r]`` positions, so query ``i`` sits at position
    ``seq_lens[r] - t + i`` and sees keys ``0 .. position`` (with ``window > 0`` only keys
    ``> position - window``). Logical key ``j`` is read from slot ``j % block_size`` of block
    ``block_table[r, j // block_size]``.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``, float32/float16/bfloat16, last dim contiguous.
        k_cache, v_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype, or
            ``torch.int8`` / ``torch.float8_e4m3fn`` codes dequantized as ``code * scale``.
        out: ``[num_tokens, num_q_heads, head_dim]``, q's dtype; every row is written.
        query_start_loc: int32 ``[num_reqs + 1]``, ``query_start_loc[-1] == num_tokens``.
        seq_lens: int32 ``[num_reqs]``, context after this step including the new tokens;
            0 marks a padding request.
        block_table: int32 ``[num_reqs, max_blocks_per_req]``.
        max_query_len, max_seq_len: host ints bounding the batch (no device read here).
        scale: softmax scale applied to ``q . k``.
        window: 0 for full causal attention, else the sliding-window width.
        softcap: 0 for off, else logits ``s -> softcap * tanh(s / softcap)`` after scaling.
        sinks: float32 ``[num_q_heads]`` or None: one logit per head that joins the softmax
            denominator and contributes no value.
        k_scale, v_scale: float32 ``[num_blocks, block_size, num_kv_heads]``, required for
            int8/fp8 caches and rejected otherwise.
        lse: float32 ``[num_tokens, num_q_heads]`` or None; if given, receives the natural-log
            log-sum-exp of the scaled (soft-capped) logits over the visible keys, sinks
            included; ``-inf`` for rows with no visible key.
        config: tiling/kernel config; default :func:`default_config` (autotuned on the GPU).

    Returns:
        ``out``.

    Rows with no visible key (a padding request with ``seq_len == 0``, or a query position
    below 0) are exact zeros, never NaN, with ``lse = -inf`` even when sinks are given.

    Robustness: device metadata is never trusted for addressing. Block ids ``< 0`` or
    ``>= num_blocks`` mask their keys (the pointer is clamped, never dereferenced out of the
    pool); key positions at or beyond ``max_blocks_per_req * block_size`` are masked; q/out rows
    outside ``[0, num_tokens)`` are neither read nor written; a decreasing ``query_start_loc``
    yields empty requests. Bad metadata gives wrong numbers for the requests it describes,
    never a fault.

    The call only reads host ints, shapes, dtypes and strides: it never synchronises with the
    device and is CUDA-graph capturable. Validation is host-only and raises ``ValueError``.

    Example::

        out = unified_attention(q, k_cache, v_cache, torch.empty_like(q),
                                query_start_loc=qsl, seq_lens=seq_lens, block_table=bt,
                                max_query_len=16, max_seq_len=130, scale=head_dim ** -0.5)
    """
    _validate(q, k_cache, v_cache, out, query_start_loc, seq_lens, block_table, max_query_len,
              max_seq_len, scale, window, softcap, sinks, k_scale, v_scale, lse)  # fmt: skip
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    group_pad = _next_power_of_2(group)
    head_dim_pad = max(16, _next_power_of_2(head_dim))
    num_sms = sm_count(q.device)
    if config is None:
        config = default_config(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
        if num_sms is not None and max_query_len > config.block_q_small:
            # Only the default adapts to the batch: an explicit config is taken as given.
            config = dataclasses.replace(config, block_q_large=large_tile_tokens(
                num_tokens=num_tokens, num_kv_heads=num_kv_heads, block_q_large=config.block_q_large,
                group_pad=group_pad, num_sms=num_sms))
    bq_small, bq_large = config.block_q_small, config.block_q_large
    if bq_small * group_pad < 16 or bq_large * group_pad < 16:
        _fail("config", config, f"block_q_small/large of at least {max(1, 16 // group_pad)} (16 tile rows)")

    if k_cache.dtype == torch.int8:
        kv_quant = 1
    elif k_cache.dtype == torch.float8_e4m3fn:
        # Codes travel as bytes and are bit-cast in the kernel: the CPU interpreter has no
        # float8 pointers, and on the GPU the reinterpretation is free.
        kv_quant = 2
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    else:
        kv_quant = 0
    if kv_quant:
        ks, vs = k_scale, v_scale
    else:
        ks = vs = q  # never read (KV_QUANT is 0); any tensor keeps the signature fixed
    ks_strides = ks.stride() if kv_quant else (0, 0, 0)
    vs_strides = vs.stride() if kv_quant else (0, 0, 0)
    lse_strides = lse.stride() if lse is not None else (0, 0)

    # Requests longer than one small tile get large tiles, so a long prefill reaches tensor-core
    # rates without 128-row tiles for the decodes next to it.
    split = max_query_len > bq_small
    if not split and config.decode_direct:
        # Every request fits one small tile: tile r is request r, no plan needed.
        tiling = TILING_DIRECT
        tile_end_small = tile_end_large = seq_lens  # never read
    else:
        tiling = TILING_FUSED if (split and config.fuse_classes) else TILING_PLAN
        tile_end_small = torch.empty(num_reqs, dtype=torch.int32, device=q.device)
        tile_end_large = (
            torch.empty(num_reqs, dtype=torch.int32, device=q.device) if split else tile_end_small
        )
        tile_plan_kernel[(1,)](
            query_start_loc_ptr=query_start_loc,
            tile_end_small_ptr=tile_end_small,
            tile_end_large_ptr=tile_end_large,
            num_reqs=num_reqs,
            BLOCK_Q_SMALL=bq_small,
            BLOCK_Q_LARGE=bq_large,
            SPLIT=split,
            BLOCK_R=min(_TILE_PLAN_BLOCK_R, max(16, _next_power_of_2(num_reqs))),
        )

    # Upper bounds on the tile counts from host ints only: sum(ceil(q_len / B)) over requests
    # <= num_tokens // B + (number of requests). Programs past the last real tile exit at once.
    num_large = min(num_reqs, num_tokens // (bq_small + 1)) if split else 0
    large_bound = num_tokens // bq_large + num_large
    # Direct tiling: tile r is request r.
    small_bound = num_reqs if (split or tiling == TILING_DIRECT) else num_tokens // bq_small + num_reqs

    kernel = unified_attention_kernel
    fixed_small = fixed_large = {}
    if config.block_n is not None:
        if isinstance(kernel, Autotuner):
            kernel = kernel.fn  # the jitted kernel under the autotuner
        fixed_small = {
            "BLOCK_N": config.block_n,
            "num_warps": config.num_warps or 4,
            "num_stages": config.num_stages or 2,
        }
        fixed_large = {
            "BLOCK_N": config.large_block_n or fixed_small["BLOCK_N"],
            "num_warps": config.large_num_warps or fixed_small["num_warps"],
            "num_stages": config.large_num_stages or fixed_small["num_stages"],
        }

    # (grid, BLOCK_Q, fixed config, BLOCK_N_SMALL) per launch; a second one holds the large tiles.
    if tiling == TILING_FUSED:
        block_n_small = config.block_n or FUSED_BLOCK_N_SMALL
        launches = [((num_kv_heads * (large_bound + small_bound),), bq_small, fixed_large, block_n_small)]
    elif split:
        launches = [((small_bound, num_kv_heads), bq_small, fixed_small, 16),
                    ((large_bound, num_kv_heads), bq_large, fixed_large, 16)]
    else:
        launches = [((small_bound, num_kv_heads), bq_small, fixed_small, 16)]

    q_is_16bit = q.dtype in (torch.float16, torch.bfloat16)
    # concurrent_classes: the small tiles' launch on a side stream, forked after the tile plan
    # (both launches read it) and joined before returning. The two write disjoint rows of out.
    with side_branch(q.device, len(launches) == 2 and config.concurrent_classes) as side:
        for i, (grid, block_q, fixed, block_n_small) in enumerate(launches):
            if grid[0] == 0:
                continue
            large_launch = tiling != TILING_FUSED and i == 1
            with side() if i == 0 else contextlib.nullcontext():
                kernel[grid](
                    q_ptr=q,
                    k_cache_ptr=k_cache,
                    v_cache_ptr=v_cache,
                    out_ptr=out,
                    k_scale_ptr=ks,
                    v_scale_ptr=vs,
                    sinks_ptr=sinks if sinks is not None else q,
                    lse_ptr=lse if lse is not None else out,
                    query_start_loc_ptr=query_start_loc,
                    seq_lens_ptr=seq_lens,
                    block_table_ptr=block_table,
                    tile_end_ptr=tile_end_large if large_launch else tile_end_small,
                    tile_end_large_ptr=tile_end_large,
                    num_tokens=num_tokens,
                    num_reqs=num_reqs,
                    num_blocks=num_blocks,
                    max_blocks_per_req=block_table.shape[1],
                    num_kv_heads=num_kv_heads,
                    num_large_tiles=large_bound,
                    occupancy=occupancy_class(grid[0] * (grid[1] if len(grid) > 1 else 1), num_sms),
                    scale=float(scale),
                    softcap=float(softcap) if softcap else 1.0,
                    window=window,
                    stride_q_t=q.stride(0),
                    stride_q_h=q.stride(1),
                    stride_k_b=k_cache.stride(0),
                    stride_k_s=k_cache.stride(1),
                    stride_k_h=k_cache.stride(2),
                    stride_v_b=v_cache.stride(0),
                    stride_v_s=v_cache.stride(1),
                    stride_v_h=v_cache.stride(2),
                    stride_ks_b=ks_strides[0],
                    stride_ks_s=ks_strides[1],
                    stride_ks_h=ks_strides[2],
                    stride_vs_b=vs_strides[0],
                    stride_vs_s=vs_strides[1],
                    stride_vs_h=vs_strides[2],
                    stride_o_t=out.stride(0),
                    stride_o_h=out.stride(1),
                    stride_lse_t=lse_strides[0],
                    stride_lse_h=lse_strides[1],
                    stride_bt_r=block_table.stride(0),
                    stride_bt_b=block_table.stride(1),
                    GROUP=group,
                    GROUP_PAD=group_pad,
                    HEAD_DIM=head_dim,
                    HEAD_DIM_PAD=head_dim_pad,
                    BLOCK_SIZE=block_size,
                    BLOCK_Q=block_q,
                    BLOCK_Q_LARGE=bq_large,
                    BLOCK_N_SMALL=block_n_small,
                    TILING=tiling,
                    KV_QUANT=kv_quant,
                    # fp32 q keeps its own dtype: fp16 operands would round it.
                    QDOT16=bool(kv_quant and q_is_16bit and (config.quant_fp16 if config.quant_fp16 is not None
                                                             else kv_quant == 2)),
                    # Folding the scale into the exponent needs max(s * c) == max(s) * c, i.e. c > 0.
                    FOLD_SCALE=bool(config.fold_scale and scale > 0),
                    USE_WINDOW=window > 0,
                    USE_SOFTCAP=softcap > 0,
                    HAS_SINKS=sinks is not None,
                    HAS_LSE=lse is not None,
                    UPCAST=INTERPRET,
                    # tf32 would cost float32 inputs ~1e-3 relative error; bf16/fp16 ignore the setting.
                    DOT_PRECISION="ieee" if (INTERPRET or q.dtype == torch.float32) else "tf32",
                    PREFETCH_IDS=bool(config.prefetch_block_ids),
                    **fixed,
                )
    return out
