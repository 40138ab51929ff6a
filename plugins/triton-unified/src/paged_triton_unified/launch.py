"""Launcher of the triton-unified kernel: the checks its kernel needs, tile sizing and the grid.

Everything here is host-side Python that reads only shapes, dtypes, strides and host ints, so a
call never synchronises with the device and can be captured in a CUDA graph.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import NoReturn, cast

import torch
from paged_core import InputError
from paged_triton_common.direct import DirectKernel
from paged_triton_common.runtime import INTERPRET, head_dim_of, next_power_of_2, occupancy_class, sm_count

from .kernels import INTERPRET_CONFIG, capture_config, tile_plan_kernel, unified_attention_kernel

__all__ = [
    "BLOCK_M_LARGE",
    "BLOCK_M_SMALL",
    "INTERPRET_CONFIG",
    "SUPPORTED_BLOCK_SIZES",
    "SUPPORTED_DTYPES",
    "SUPPORTED_HEAD_DIMS",
    "SUPPORTED_KV_DTYPES",
    "LaunchConfig",
    "check_scales",
    "default_config",
    "unified_attention",
]

SUPPORTED_HEAD_DIMS = (32, 64, 80, 96, 112, 128, 160, 192, 256)
SUPPORTED_BLOCK_SIZES = (1, 2, 4, 8, 16, 32, 64, 128, 256)
SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# The cache holds either q's dtype or quantized codes with float32 scales per (slot, KV head).
SUPPORTED_KV_DTYPES = (torch.int8, torch.float8_e4m3fn, torch.float8_e5m2, torch.uint8)
# The kernels' KV_QUANT per code dtype: 1 int8; 2 fp8 e4m3 and 3 fp8 e5m2, codes as uint8; 4 int4
# codes two per uint8 (the cache's last dimension is half the head dim).
_KV_QUANT = {torch.int8: 1, torch.float8_e4m3fn: 2, torch.float8_e5m2: 3, torch.uint8: 4}


def check_scales(k_cache: torch.Tensor, k_scale: torch.Tensor | None, v_scale: torch.Tensor | None) -> None:
    """Raise ``paged_core.InputError`` unless the scales fit the cache as the kernels read them:
    none for a cache of values; for codes, float32 ``v_scale [num_blocks, block_size,
    num_kv_heads]`` and ``k_scale`` the same, or for int4 codes scaled per channel (kivi4) the 4-D
    view of ``paged_triton_common.backend.kernel_k_scale``. Host-only: shapes and dtypes."""
    nb, bs, heads = k_cache.shape[:3]
    slots = (nb, bs, heads)
    if k_cache.dtype not in _KV_QUANT:
        if k_scale is not None or v_scale is not None:
            _fail("k_scale/v_scale", "given", "no scales for a cache of values", "pass k_scale=None, v_scale=None")
        return
    per_channel = k_cache.dtype == torch.uint8 and k_scale is not None and k_scale.dim() == 4
    for name, t, want in (
        ("k_scale", k_scale, (*slots, 2 * k_cache.shape[3]) if per_channel else slots),
        ("v_scale", v_scale, slots),
    ):
        if t is None or t.dtype != torch.float32 or tuple(t.shape) != want:
            found = "None" if t is None else f"{t.dtype} {list(t.shape)}"
            _fail(
                name,
                found,
                f"float32 {list(want)} for a {k_cache.dtype} cache of shape {list(k_cache.shape)}",
                "pass the cache's scales (kivi4 keys: paged_triton_common.backend.kernel_k_scale(cache))",
            )


def kv_quant_of(k_cache: torch.Tensor, k_scale: torch.Tensor | None) -> int:
    """The kernels' ``KV_QUANT`` of a cache: 0 values in q's dtype, 1 int8, 2 fp8 e4m3, 3 fp8
    e5m2, 4 int4 (``uint8``, two codes a byte), 5 kivi4 (int4 whose key scale is a 4-D
    ``[num_blocks, block_size (stride 0), heads, head_dim]`` view: one per channel)."""
    kv_quant = _KV_QUANT.get(k_cache.dtype, 0)
    if kv_quant == 4 and k_scale is not None and k_scale.dim() == 4:
        kv_quant = 5
    return kv_quant


# Rows per tile (BLOCK_Q query tokens x GROUP_PAD heads). 16 is the smallest tl.dot M, enough
# for one decode token of a small group. Prefill wants the 64/128-row MMAs of Hopper: 16-row
# tiles re-read the causal prefix once per few queries (NVIDIA H200, Triton 3.6: 61-71 TFLOP/s
# for such designs on prefill 8 x 2,048; this kernel's 128-row tiles run 349, docs/benchmarks.md).
BLOCK_M_SMALL = 16
BLOCK_M_LARGE = 128
# Head dims padded to 256 double every register tile; 64 rows keep the accumulator in registers.
BLOCK_M_LARGE_WIDE_HEAD = 64

# Requests per step of the tile-plan scan, one value for every batch: a constexpr that followed
# the request count compiled a tile-plan binary per power of two of it, on the first mixed step
# of each (the masked lanes of one program cost nothing a launch of it can show).
_TILE_PLAN_BLOCK_R = 1024

# Launched directly once compiled (a few us instead of Triton's ~100 us of per-call Python), and
# compiled safely inside a CUDA-graph capture on a first call (paged_triton_common.direct).
_attention = DirectKernel(unified_attention_kernel, capture_config=capture_config)
_attention_fixed = DirectKernel(unified_attention_kernel.fn)
_tile_plan = DirectKernel(tile_plan_kernel)


# Keys per step of the decode tiles inside a fused launch when the autotuner picks the config
# (it tunes the large tiles' BLOCK_N; the small tiles are bandwidth-bound and like wide steps).
# H200, a mixed batch of 2 x 512-token chunks + 30 decodes, fused launch: 128 keys 0.167 ms,
# 64 keys 0.186 ms (scripts/gpu_tune.py).
FUSED_BLOCK_N_SMALL = 128
# Large tiles shrink from 128 to 64 rows when 128-row tiles would give fewer programs than this
# many per SM. Two register-capped 128-row tiles fit on an SM, so a wave is two per SM; under 1.5,
# more than a quarter of its slots would stay empty, and 64-row tiles (twice the programs) fill
# them. NVIDIA H200, Triton 3.6, 2026-12-03, CUDA-graph replays: paged bench's mixed batch (2
# chunks of 512 + 30 decodes; 256 programs of 128 rows on 132 SMs) 0.1856 ms with 128-row tiles,
# 0.2180 with 64; one chunk of 512 after 15,872 cached tokens + 32 decodes (136 programs)
# 0.5922 ms with 64-row tiles, 1.0839 with 128.
MIN_LARGE_PROGRAMS_PER_SM = 1.5


def large_tile_tokens(
    *, num_tokens: int, num_kv_heads: int, block_q_large: int, group_pad: int, num_sms: int | None
) -> int:
    """Query tokens per large tile: ``block_q_large``, halved (down to 64 rows) when the batch's
    large tiles could not give every SM ``MIN_LARGE_PROGRAMS_PER_SM`` programs.

    >>> large_tile_tokens(num_tokens=1054, num_kv_heads=8, block_q_large=32, group_pad=4, num_sms=132)
    32
    >>> large_tile_tokens(num_tokens=544, num_kv_heads=8, block_q_large=32, group_pad=4, num_sms=132)
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


@dataclasses.dataclass(frozen=True)
class LaunchConfig:
    """How the launcher tiles a batch.

    Requests with at most ``block_q_small`` new tokens (decodes, short verification blocks) run
    with ``block_q_small``-token tiles; longer ones, if the batch has any, with
    ``block_q_large``-token tiles, in the same launch (large tiles first, then the small ones
    fill the SMs the prefill tail leaves idle). A batch where every request fits one small tile
    skips the tile-plan launch and the search (tile = request). ``block_n``/``num_warps``/
    ``num_stages`` fix the kernel config (``None``: the autotuner chooses, on the GPU), with
    ``maxnreg`` a register cap per thread for it (``None``: none); ``large_*`` override them
    for a launch with large tiles (``None``: the same as the small ones), whose small tiles step
    ``block_n`` keys (``None``: ``FUSED_BLOCK_N_SMALL``).

    Quantized caches with fp16/bf16 q run both dots in fp16 (``tiles.codes8_f16``,
    ``tiles.int4_f16``): NVIDIA H100, 64 x 4,096 decode, CUDA graph, 2026-12-07
    (docs/quantization.md): fp8 0.2280 ms this way vs 0.2470 with its codes converted to bf16 in
    the MMA operand layout; int8 0.2348 vs 0.2333.
    """

    block_q_small: int
    block_q_large: int
    block_n: int | None = None
    num_warps: int | None = None
    num_stages: int | None = None
    large_block_n: int | None = None
    large_num_warps: int | None = None
    large_num_stages: int | None = None
    maxnreg: int | None = None


def default_config(*, num_q_heads: int, num_kv_heads: int, head_dim: int) -> LaunchConfig:
    """The launcher's default tiling for a model shape (independent of the batch).

    >>> default_config(num_q_heads=32, num_kv_heads=8, head_dim=128).block_q_small
    4
    """
    group_pad = next_power_of_2(num_q_heads // num_kv_heads)
    large_rows = BLOCK_M_LARGE if next_power_of_2(head_dim) <= 128 else BLOCK_M_LARGE_WIDE_HEAD
    fixed = INTERPRET_CONFIG if INTERPRET else {}
    return LaunchConfig(
        block_q_small=max(1, BLOCK_M_SMALL // group_pad),
        block_q_large=max(1, large_rows // group_pad),
        block_n=fixed.get("BLOCK_N"),
        num_warps=fixed.get("num_warps"),
        num_stages=fixed.get("num_stages"),
    )


@functools.lru_cache(maxsize=1024)
def _batch_config(
    num_q_heads: int, num_kv_heads: int, head_dim: int, num_tokens: int, max_query_len: int, num_sms: int | None
) -> LaunchConfig:
    """The default config adapted to a batch (cached: every layer of a step asks the same)."""
    config = default_config(num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim)
    if num_sms is not None and max_query_len > config.block_q_small:
        # Only the default adapts to the batch: an explicit config is taken as given.
        config = dataclasses.replace(
            config,
            block_q_large=large_tile_tokens(
                num_tokens=num_tokens,
                num_kv_heads=num_kv_heads,
                block_q_large=config.block_q_large,
                group_pad=next_power_of_2(num_q_heads // num_kv_heads),
                num_sms=num_sms,
            ),
        )
    return config


def _fail(what: str, found: object, accepted: str, fix: str) -> NoReturn:
    raise InputError(f"{what} is {found}; triton-unified accepts {accepted}; {fix}")


def _check(q, k_cache, v_cache, out, config: LaunchConfig, group_pad: int) -> None:
    """What the kernel needs beyond the paged contract (which ``paged_core.Backend.forward``
    checks: shapes, dtypes, devices, cache scales, host ints). Host-only, a few attribute reads."""
    for name, t in (("q", q), ("k_cache", k_cache), ("v_cache", v_cache), ("out", out)):
        if t.stride(-1) != 1:
            # The kernel adds the head-dim offsets unscaled: a strided last dimension would be
            # read (or written) at the wrong addresses.
            _fail(
                f"{name}'s last-dimension stride",
                t.stride(-1),
                "stride 1 (head_dim contiguous)",
                f"pass {name}.contiguous() or a view whose head_dim is contiguous",
            )
    rows = min(config.block_q_small, config.block_q_large) * group_pad
    if rows < 16:
        _fail(
            "config's smallest tile",
            f"{rows} rows ({config})",
            "at least 16 rows (tl.dot's smallest M)",
            f"use block_q_small and block_q_large of at least {max(1, 16 // group_pad)}",
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
    check: bool = True,
) -> torch.Tensor:
    """Paged attention for a flattened batch of requests in any mix of prefill and decode.

    Request ``r`` owns rows ``query_start_loc[r]:query_start_loc[r+1]`` of ``q``; they are the
    last ``t`` of its ``seq_lens[r]`` positions, so query ``i`` sits at position
    ``seq_lens[r] - t + i`` and sees keys ``0 .. position`` (with ``window > 0`` only keys
    ``> position - window``). Logical key ``j`` is read from slot ``j % block_size`` of block
    ``block_table[r, j // block_size]``.

    Args:
        q: ``[num_tokens, num_q_heads, head_dim]``, float32/float16/bfloat16, last dim contiguous.
        k_cache: ``[num_blocks, block_size, num_kv_heads, head_dim]``, q's dtype, or
            ``torch.int8`` / ``torch.float8_e4m3fn`` / ``torch.float8_e5m2`` codes dequantized as
            ``code * scale``.
        v_cache: like ``k_cache`` with its own last dimension ``head_dim_v`` (MLA-shaped layers).
        out: ``[num_tokens, num_q_heads, head_dim_v]``, q's dtype; every row is written.
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
            caches of codes and rejected otherwise; kivi4 keys (int4 codes, scaled per block
            and channel) take ``paged_triton_common.backend.kernel_k_scale``'s 4-D view
            (:func:`check_scales`).
        lse: float32 ``[num_tokens, num_q_heads]`` or None; if given, receives the natural-log
            log-sum-exp of the scaled (soft-capped) logits over the visible keys, sinks
            included; ``-inf`` for rows with no visible key.
        config: tiling/kernel config; default :func:`default_config` (autotuned on the GPU).
        check: False skips this function's own checks (below), for a caller that passes the
            default config and arguments ``paged_core.Backend.forward`` has checked.

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
    device and is CUDA-graph capturable. Arguments are taken to satisfy the paged contract (what
    ``paged_core.Backend.forward`` checks); this function checks only what its kernel needs
    beyond it (contiguous head dims, tiles of at least 16 rows) and raises
    ``paged_core.InputError`` otherwise.

    Example::

        out = unified_attention(q, k_cache, v_cache, torch.empty_like(q),
                                query_start_loc=qsl, seq_lens=seq_lens, block_table=bt,
                                max_query_len=16, max_seq_len=130, scale=head_dim ** -0.5)
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs = seq_lens.shape[0]
    if num_tokens == 0 or num_reqs == 0:
        return out

    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    head_dim_pad = max(16, next_power_of_2(head_dim))
    head_dim_v = head_dim_of(v_cache)
    head_dim_v_pad = head_dim_pad if head_dim_v == head_dim else max(16, next_power_of_2(head_dim_v))
    num_sms = sm_count(q.device)
    if config is None:
        # The wider of the K and V tiles sizes the tiling (V's head dim may differ).
        config = _batch_config(num_q_heads, num_kv_heads, max(head_dim, head_dim_v), num_tokens, max_query_len, num_sms)
    if check:
        _check(q, k_cache, v_cache, out, config, group_pad)
        check_scales(k_cache, k_scale, v_scale)
    bq_small, bq_large = config.block_q_small, config.block_q_large

    kv_quant = kv_quant_of(k_cache, k_scale)
    if kv_quant >= 2:
        # Codes travel as bytes and are bit-cast in the kernel: the CPU interpreter has no
        # float8 pointers, and on the GPU the reinterpretation is free.
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    if kv_quant:
        ks, vs = k_scale, v_scale
    else:
        ks = vs = q  # never read (KV_QUANT is 0); any tensor keeps the signature fixed
    ks_strides = cast(torch.Tensor, ks).stride() if kv_quant else (0, 0, 0)
    vs_strides = cast(torch.Tensor, vs).stride() if kv_quant else (0, 0, 0)
    lse_strides = lse.stride() if lse is not None else (0, 0)

    # Requests longer than one small tile get large tiles, so a long prefill reaches tensor-core
    # rates without 128-row tiles for the decodes next to it; both classes share one launch.
    fused = max_query_len > bq_small
    if fused:
        tile_end_small = torch.empty(num_reqs, dtype=torch.int32, device=q.device)
        tile_end_large = torch.empty(num_reqs, dtype=torch.int32, device=q.device)
        _tile_plan[(1,)](
            query_start_loc_ptr=query_start_loc,
            tile_end_small_ptr=tile_end_small,
            tile_end_large_ptr=tile_end_large,
            num_reqs=num_reqs,
            BLOCK_Q_SMALL=bq_small,
            BLOCK_Q_LARGE=bq_large,
            BLOCK_R=_TILE_PLAN_BLOCK_R,
        )
        # Upper bounds on the tile counts from host ints only: sum(ceil(q_len / B)) over
        # requests <= num_tokens // B + (number of requests). Programs past the last real tile
        # exit at once.
        num_large_tiles = num_tokens // bq_large + min(num_reqs, num_tokens // (bq_small + 1))
        grid: tuple[int, ...] = (num_kv_heads * (num_large_tiles + num_reqs),)
    else:
        # Every request fits one small tile: tile r is request r, no plan needed.
        tile_end_small = tile_end_large = seq_lens  # never read
        num_large_tiles = 0
        grid = (num_reqs, num_kv_heads)

    kernel = _attention
    fixed = {}
    if config.block_n is not None:
        kernel = _attention_fixed  # the jitted kernel under the autotuner
        fixed = {
            "BLOCK_N": config.block_n,
            "num_warps": config.num_warps or 4,
            "num_stages": config.num_stages or 2,
        }
        if fused:
            fixed = {
                "BLOCK_N": config.large_block_n or fixed["BLOCK_N"],
                "num_warps": config.large_num_warps or fixed["num_warps"],
                "num_stages": config.large_num_stages or fixed["num_stages"],
            }
        if config.maxnreg is not None:
            fixed["maxnreg"] = config.maxnreg

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
        tile_end_ptr=tile_end_small,
        tile_end_large_ptr=tile_end_large,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        num_blocks=num_blocks,
        max_blocks_per_req=block_table.shape[1],
        num_kv_heads=num_kv_heads,
        num_large_tiles=num_large_tiles,
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
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=head_dim_v_pad,
        BLOCK_SIZE=block_size,
        BLOCK_Q=bq_small,
        BLOCK_Q_LARGE=bq_large,
        BLOCK_N_SMALL=config.block_n or FUSED_BLOCK_N_SMALL,
        FUSED=fused,
        KV_QUANT=kv_quant,
        # Quantized codes with 16-bit q: fp32 q keeps its own dtype (fp16 operands would round it).
        QDOT16=kv_quant >= 1 and q.dtype in (torch.float16, torch.bfloat16),
        # Folding the scale into the exponent needs max(s * c) == max(s) * c, i.e. c > 0.
        FOLD_SCALE=scale > 0,
        USE_WINDOW=window > 0,
        USE_SOFTCAP=softcap > 0,
        HAS_SINKS=sinks is not None,
        HAS_LSE=lse is not None,
        UPCAST=INTERPRET,
        # tf32 would cost float32 inputs ~1e-3 relative error; bf16/fp16 ignore the setting.
        DOT_PRECISION="ieee" if (INTERPRET or q.dtype == torch.float32) else "tf32",
        **fixed,
    )
    return out
