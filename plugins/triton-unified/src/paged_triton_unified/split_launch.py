"""Launchers of the split-KV (Flash-Decoding) kernels: argument checks, workspaces, grids.

Every launcher is CUDA-graph capturable: it never reads a device tensor on the host (no
``.item()``, no ``.tolist()``); grids come from host ints (shapes, ``max_seq_len``). The
attention launchers take their arguments to satisfy the paged contract (what
``paged_core.Backend.forward`` checks: shapes, dtypes, devices, cache scales, host ints) and
check only what their kernels need beyond it, on host ints, so they cost microseconds;
``merge_states``, a primitive of its own, checks its inputs. ``shared_prefix_blocks`` (re-exported
from paged_core) is the one helper that syncs, and says so.

The autotuned kernels benchmark their configs on the first call for each key (GROUP_PAD,
HEAD_DIM_PAD, BLOCK_SIZE, query tile, dtypes; the split kernel also the keys per program, a
power of two): a first call inside a CUDA-graph capture takes a tuned choice if there is one,
else the default config (paged_triton_common.direct).
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Sequence
from typing import cast

import torch
from paged_core import InputError, shared_prefix_blocks
from paged_triton_common.direct import DirectKernel
from paged_triton_common.runtime import INTERPRET, cdiv, head_dim_of, next_power_of_2, occupancy_class, sm_count

from .launch import _fail, check_scales, kv_quant_of
from .split_kernels import (
    PREFIX_DEFAULT_CONFIG,
    SPLIT_DEFAULT_CONFIG,
    cascade_prefix_kernel,
    merge_states_kernel,
    split_kv_attention_kernel,
)

# Launched directly once compiled, and compiled safely inside a CUDA-graph capture on a first
# call (paged_triton_common.direct).
_split = DirectKernel(split_kv_attention_kernel, capture_config=lambda _: SPLIT_DEFAULT_CONFIG)
_split_fixed = DirectKernel(split_kv_attention_kernel.fn)
_merge = DirectKernel(merge_states_kernel)
_prefix = DirectKernel(cascade_prefix_kernel, capture_config=lambda _: PREFIX_DEFAULT_CONFIG)

__all__ = [
    "cascade_attention",
    "choose_num_splits",
    "merge_states",
    "shared_prefix_blocks",
    "split_decode_attention",
]

_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# choose_num_splits: two programs per SM, three (as many as fit on one at the split kernel's
# ~70 KB of shared memory) for many (request, KV head) pairs with long splits, and only for
# batches with fewer pairs than SMs. Rounded down, never up: a few programs more than a whole
# number per SM leave those SMs with more work than the rest. A short split's fixed cost (its
# prologue, its partial, the merge) outweighs what a third program per SM hides; a long one's
# does not. NVIDIA H200, Triton 3.6, bf16, 32/8 heads, d 128, CUDA-graph replays, autotuned, the
# merge fused, 2026-12-02 (docs/benchmarks.md), two then three programs per SM: 4 x 4,096
# 0.0373 vs 0.0409-0.0508 ms; 8 x 4,096 0.0548 vs 0.0564-0.0647; 2 x 32,768 0.0888 vs 0.0917;
# 4 x 32,768 0.1475 vs 0.1494-0.1510; but 8 x 32,768 0.2721 vs 0.2653, 16 x 32,768 0.5184 vs
# 0.5024, 16 x 8,192 0.1478 vs 0.1452 (16 x 4,096 the same, 0.0859 / 0.0850). From 256 pairs
# on, the unified kernel was as fast or faster (the crossover sweep in docs/benchmarks.md).
# 256 tokens (16 blocks of 16) per split keeps the fixed cost of a program (loading q, writing
# a partial, merging it) small against its K/V traffic; beyond 32 splits the merge's reads start
# to show (1 x 131,072: 0.1501 ms at 32 splits, 0.1506 at 48, 0.1542 at 64).
_SPLIT_PROGRAMS_PER_SM = 2
_SPLIT_PROGRAMS_PER_SM_LONG = 3
_LONG_SPLIT_MIN_PAIRS = 64  # and at least _LONG_SPLIT_MIN_TOKENS keys per split at three per SM
_LONG_SPLIT_MIN_TOKENS = 2048
# The cascade's prefix pass: about two programs per SM (rounded up).
_PROGRAMS_PER_SM = 2
_MIN_TOKENS_PER_SPLIT = 256
_MAX_SPLITS = 32
# Both merges (merge_states_kernel and the split kernel's fused merge) read parts
# _MERGE_PARTS_CHUNK at a time: a chunk costs one memory round trip instead of one per part.
# NVIDIA H200, Triton 3.6, 2026-11-29: the cascade's 9 parts (64 x (4,000 + 100) tokens) merged
# in 0.0093 ms at 8 parts a step, 0.0115 at 1.
_MERGE_PARTS_CHUNK = 8


# --------------------------------------------------------------------------------------------
# Checks
# --------------------------------------------------------------------------------------------


def _check_count(name: str, value: object, *, minimum: int, none_ok: bool) -> None:
    """A host int option of a launcher (split counts, block counts): ``>= minimum``, or None."""
    if value is None and none_ok:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        _fail(
            name,
            repr(value),
            f"{'None or ' if none_ok else ''}a host int >= {minimum}",
            f"pass {'None (automatic) or ' if none_ok else ''}an int of at least {minimum}",
        )


def _pow2_at_least(x: int, floor: int) -> int:
    return max(floor, next_power_of_2(x))


def _kv_args(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
) -> dict:
    """Cache pointers, strides and dtype switches common to the attention kernels."""
    kv_quant = kv_quant_of(k_cache, k_scale)
    quant = kv_quant != 0
    head_dim_v = head_dim_of(v_cache)  # before fp8 codes are viewed as bytes (uint8 is int4's dtype)
    if kv_quant in (2, 3):
        # Bytes in, bitcast in the kernel: the interpreter cannot load float8 tensors.
        k_cache, v_cache = k_cache.view(torch.uint8), v_cache.view(torch.uint8)
    # Unused scale pointers still need a tensor; the QUANT=False kernel never touches them.
    ks = k_scale if quant else k_cache
    vs = v_scale if quant else v_cache
    # A 4-D key scale: kivi4's per-channel scales as a [num_blocks, block_size, heads, head_dim]
    # view with slot stride 0 (paged_triton_common.backend.kernel_k_scale).
    ks_strides = cast(torch.Tensor, k_scale).stride()[:3] if quant else (0, 0, 0)
    vs_strides = cast(torch.Tensor, v_scale).stride() if quant else (0, 0, 0)
    return dict(
        k_cache_ptr=k_cache,
        v_cache_ptr=v_cache,
        k_scale_ptr=ks,
        v_scale_ptr=vs,
        stride_k_b=k_cache.stride(0),
        stride_k_s=k_cache.stride(1),
        stride_k_h=k_cache.stride(2),
        stride_k_d=k_cache.stride(3),
        stride_v_b=v_cache.stride(0),
        stride_v_s=v_cache.stride(1),
        stride_v_h=v_cache.stride(2),
        stride_v_d=v_cache.stride(3),
        stride_ks_b=ks_strides[0],
        stride_ks_s=ks_strides[1],
        stride_ks_h=ks_strides[2],
        stride_vs_b=vs_strides[0],
        stride_vs_s=vs_strides[1],
        stride_vs_h=vs_strides[2],
        HEAD_DIM=q.shape[2],
        HEAD_DIM_PAD=_pow2_at_least(q.shape[2], 16),
        # V's head dim (MLA-shaped layers) sizes the PV tile, the accumulator and the outputs.
        HEAD_DIM_V=head_dim_v,
        HEAD_DIM_V_PAD=_pow2_at_least(head_dim_v, 16),
        BLOCK_SIZE=k_cache.shape[1],
        KV_QUANT=kv_quant,
        # Quantized codes with 16-bit q run both dots in fp16 (tiles.codes8_f16, int4_f16); fp32
        # q keeps its own dtype (fp16 operands would round it).
        QDOT16=quant and q.dtype in (torch.float16, torch.bfloat16),
        UPCAST=INTERPRET,
        # fp32 q must not silently become TF32 on tensor cores (1e-3 error); 16-bit ignores it.
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
    )


# --------------------------------------------------------------------------------------------
# Split decode
# --------------------------------------------------------------------------------------------


def choose_num_splits(
    num_reqs: int, num_kv_heads: int, max_seq_len: int, block_size: int, device: torch.device | str
) -> int:
    """Number of KV splits that fills the GPU for a decode batch (host ints only, no sync).

    Gives the GPU two programs per SM over ``num_reqs * num_kv_heads * splits`` programs
    (rounded down; three when 64 or more (request, KV head) pairs would still get 2,048 keys per
    split), keeps at least 256 tokens (and a whole block) per split, caps at 32.
    Returns 1 on a non-CUDA device or when the (request, KV head) pairs already fill the GPU.

    >>> choose_num_splits(4, 8, 32768, 16, "cpu")
    1
    """
    sms = sm_count(device)
    if sms is None:
        return 1
    pairs = max(1, num_reqs * num_kv_heads)
    # Split only when the (request, KV head) pairs cannot give every SM a program: on the H200
    # at 4,096 and 32,768 tokens the unified kernel won from 32 requests x 8 KV heads (256
    # pairs, 2 per SM) on, the split kernel below it (docs/benchmarks.md, the crossover sweep).
    if pairs >= sms:
        return 1
    by_occupancy = _SPLIT_PROGRAMS_PER_SM_LONG * sms // pairs
    if pairs < _LONG_SPLIT_MIN_PAIRS or max_seq_len // by_occupancy < _LONG_SPLIT_MIN_TOKENS:
        by_occupancy = _SPLIT_PROGRAMS_PER_SM * sms // pairs
    by_length = max(1, max_seq_len // max(_MIN_TOKENS_PER_SPLIT, block_size))
    return max(1, min(by_occupancy, by_length, _MAX_SPLITS))


# The prefix pass of cascade attention splits the shared prefix along its keys when its row
# tiles alone cannot fill the GPU (64 decodes x 4 heads: 4 tiles x 8 KV heads = 32 programs, each
# walking 4,000 keys: 0.18 ms on the H200, as slow as not sharing the prefix at all). Ranges are
# multiples of _PREFIX_KEY_QUANTUM (every BLOCK_N of the prefix configs divides it) and at least
# _MIN_TOKENS_PER_SPLIT long; the row tiles are counted at the smallest BLOCK_M of the configs.
_PREFIX_KEY_QUANTUM = 128
_PREFIX_BLOCK_M_MIN = 64


def _prefix_split(
    prefix_tokens: int, prefix_splits: int | None, *, row_tiles: int, num_kv_heads: int, device: torch.device
) -> tuple[int, int]:
    """(keys per split, number of splits) for the cascade prefix pass; (0, 0) without a prefix.

    >>> _prefix_split(4000, 3, row_tiles=4, num_kv_heads=8, device=torch.device("cpu"))
    (1408, 3)
    >>> _prefix_split(4000, None, row_tiles=4, num_kv_heads=8, device=torch.device("cpu"))
    (4096, 1)
    """
    if prefix_tokens == 0:
        return 0, 0
    if prefix_splits is None:
        prefix_splits = 1
        sms = sm_count(device)
        if sms is not None:
            by_occupancy = cdiv(_PROGRAMS_PER_SM * sms, max(1, row_tiles * num_kv_heads))
            by_length = max(1, prefix_tokens // _MIN_TOKENS_PER_SPLIT)
            prefix_splits = max(1, min(by_occupancy, by_length, _MAX_SPLITS))
    quantum = _PREFIX_KEY_QUANTUM
    keys_per_split = cdiv(cdiv(prefix_tokens, prefix_splits), quantum) * quantum
    return keys_per_split, cdiv(prefix_tokens, keys_per_split)


def split_decode_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    max_seq_len: int,
    scale: float,
    num_splits: int | None = None,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    blocks_per_split: int | None = None,
    kernel_config: dict | None = None,
) -> torch.Tensor:
    """Flash-Decoding over a paged KV cache for a decode-only batch; fills and returns ``out``.

    Shapes: q ``[num_reqs, num_q_heads, head_dim]`` (token r is request r's one query, at
    position ``seq_lens[r] - 1``), out the same with V's head dim; k_cache, v_cache ``[num_blocks,
    block_size, num_kv_heads, head_dim]`` (v_cache's last dimension may differ: MLA-shaped) of
    q.dtype, int8 or float8_e4m3fn (then k_scale, v_scale float32 ``[num_blocks, block_size,
    num_kv_heads]``, value = code * scale); seq_lens int32
    ``[num_reqs]`` (0: padding request, exact zeros); block_table int32 ``[num_reqs,
    max_blocks]``; sinks float32 ``[num_q_heads]``; lse (output, optional) float32
    ``[num_reqs, num_q_heads]``, natural log, -inf where no key is visible, and including the
    sink term otherwise (so ``out * exp(lse)`` stays the unnormalized sum and merges exactly).

    Splits: with ``blocks_per_split=K`` split s covers key tokens ``[s*K*block_size,
    (s+1)*K*block_size)`` of every request, so a request's output is bit-identical alone or in
    any batch (``num_splits`` then defaults to ``ceil(max_seq_len / (K*block_size))``; a larger
    value just adds empty splits, e.g. to keep one CUDA-graph grid). Otherwise each request's
    visible range is cut into ``num_splits`` (default: ``choose_num_splits``) near-equal parts;
    one such part is written straight to ``out``. Several are merged by the last split of each
    (request, KV head) to finish, inside the one launch (no merge launch in either case).

    ``kernel_config`` (e.g. ``{"BLOCK_N": 64, "num_warps": 4, "num_stages": 3}``) bypasses the
    autotuner: for tuning scripts and benchmarks.

    >>> import torch
    >>> q = torch.zeros(1, 4, 64); kc = torch.zeros(2, 16, 1, 64); o = torch.empty_like(q)
    >>> _ = split_decode_attention(q, kc, kc, o, seq_lens=torch.tensor([0], dtype=torch.int32),
    ...     block_table=torch.zeros(1, 2, dtype=torch.int32), max_seq_len=0, scale=0.125)
    >>> bool((o == 0).all())
    True
    """
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs = block_table.shape[0]
    if num_tokens != num_reqs:
        _fail(
            "q.shape[0] (num_tokens)",
            num_tokens,
            f"num_reqs = {num_reqs}: one query per request",
            "use cascade_attention or unified_attention (paged_triton_unified.launch) for longer queries",
        )
    check_scales(k_cache, k_scale, v_scale)
    _check_count("blocks_per_split", blocks_per_split, minimum=1, none_ok=True)
    if blocks_per_split is not None:
        tokens_per_split = blocks_per_split * block_size
        needed = max(1, cdiv(max_seq_len, tokens_per_split))
        if num_splits is None:
            num_splits = needed
        _check_count("num_splits", num_splits, minimum=needed, none_ok=False)
    else:
        tokens_per_split = 0
        if num_splits is None:
            num_splits = choose_num_splits(num_reqs, num_kv_heads, max_seq_len, block_size, q.device)
        _check_count("num_splits", num_splits, minimum=1, none_ok=False)

    if num_tokens == 0:
        return out
    # Direct output for one split. Not in blocks_per_split mode: there a request alone may need
    # one split and in a batch several, and its bits must not depend on which epilogue ran.
    if num_splits == 1 and blocks_per_split is None:
        _launch_split(
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            None,
            None,
            seq_lens=seq_lens,
            block_table=block_table,
            query_start_loc=None,
            scale=scale,
            softcap=softcap,
            window=window,
            key_start=0,
            num_splits=1,
            tokens_per_split=0,
            max_query_len=1,
            max_keys=max_seq_len,
            final=(out, lse, sinks),
            kernel_config=kernel_config,
        )
        return out
    # Several splits: one launch, whose last program per (request, KV head) merges the partials
    # (split_kv_attention_kernel's FUSED_MERGE). The counters reset themselves, so zeroing them
    # once per workspace is enough: a recorded or captured call keeps its workspace.
    part_out, part_lse = _partials(num_splits, num_tokens, num_q_heads, head_dim_of(v_cache), q.device)
    counters = torch.zeros((num_reqs, num_kv_heads), dtype=torch.int32, device=q.device)
    _launch_split(
        q,
        k_cache,
        v_cache,
        k_scale,
        v_scale,
        part_out,
        part_lse,
        seq_lens=seq_lens,
        block_table=block_table,
        query_start_loc=None,
        scale=scale,
        softcap=softcap,
        window=window,
        key_start=0,
        num_splits=num_splits,
        tokens_per_split=tokens_per_split,
        max_query_len=1,
        max_keys=max_seq_len,
        final=(out, lse, sinks),
        counters=counters,
        kernel_config=kernel_config,
    )
    return out


def _partials(
    num_parts: int, num_tokens: int, num_q_heads: int, head_dim: int, device: torch.device
) -> tuple[torch.Tensor, torch.Tensor]:
    """float32 workspaces ``[num_parts, num_tokens, num_q_heads, head_dim]`` and ``[num_parts,
    num_tokens, num_q_heads]``, views of ones with the token count rounded up to 16: a part's
    stride is then a multiple of 16 for every batch size, so Triton specialises the kernels on it
    one way (aligned) instead of compiling a binary per batch-size residue."""
    rows = cdiv(num_tokens, 16) * 16
    part_out = torch.empty((num_parts, rows, num_q_heads, head_dim), dtype=torch.float32, device=device)
    part_lse = torch.empty((num_parts, rows, num_q_heads), dtype=torch.float32, device=device)
    return part_out[:, :num_tokens], part_lse[:, :num_tokens]


def _launch_split(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    k_scale: torch.Tensor | None,
    v_scale: torch.Tensor | None,
    part_out: torch.Tensor | None,
    part_lse: torch.Tensor | None,
    *,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    query_start_loc: torch.Tensor | None,
    scale: float,
    softcap: float,
    window: int,
    key_start: int,
    num_splits: int,
    tokens_per_split: int,
    max_query_len: int,
    max_keys: int,
    final: tuple | None = None,
    counters: torch.Tensor | None = None,
    kernel_config: dict | None = None,
) -> None:
    """Launch the split kernel; arguments already checked. Without ``final``, writes part_out /
    part_lse; with ``final=(out, lse or None, sinks or None)``, the final out / lse: directly
    (one split, part_out None) or merged by the last split of each (request, KV head), counted
    in ``counters`` (int32 ``[num_reqs, num_kv_heads]``, zero). ``max_keys``: the most keys a
    request has in this pass (it sets the autotune key's loop length)."""
    num_q_heads = q.shape[1]
    num_kv_heads = k_cache.shape[2]
    num_reqs = block_table.shape[0]
    group = num_q_heads // num_kv_heads
    group_pad = next_power_of_2(group)
    if max_query_len <= 1:
        block_q = 1
    else:
        # Up to 64 rows per tile for multi-token queries: enough to amortize each K/V tile
        # over several queries without spilling the fp32 accumulator at head_dim 256.
        block_q = min(next_power_of_2(max_query_len), max(1, 64 // group_pad))
    num_q_tiles = cdiv(max(max_query_len, 1), block_q)
    grid = (num_reqs * num_q_tiles, num_kv_heads, num_splits)
    direct = final is not None and part_out is None
    fused = final is not None and part_out is not None
    if final is not None:
        out, out_lse, sinks = final
    else:
        out, out_lse, sinks = q, None, None
    if direct:
        # Unused pointers still need a tensor; the constexpr switches keep them untouched.
        part_out, part_lse = out, out_lse if out_lse is not None else q
    out_lse_t = out_lse if out_lse is not None else part_lse
    kernel, fixed = _split, {}
    if kernel_config is not None:
        kernel, fixed = _split_fixed, dict(kernel_config)  # the jitted kernel, no tuning
    kernel[grid](
        q_ptr=q,
        block_table_ptr=block_table,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc if query_start_loc is not None else seq_lens,
        part_out_ptr=part_out,
        part_lse_ptr=part_lse,
        out_ptr=out,
        out_lse_ptr=out_lse_t,
        sinks_ptr=sinks if sinks is not None else out_lse_t,
        counter_ptr=counters if fused else seq_lens,
        scale=float(scale),
        softcap=float(softcap),
        window=int(window),
        key_start=int(key_start),
        num_blocks=k_cache.shape[0],
        max_blocks=block_table.shape[1],
        num_splits=num_splits,
        tokens_per_split=tokens_per_split,
        num_q_tiles=num_q_tiles,
        # At least 256: the loop lengths below share one tuned choice, and the int never drops
        # under 16, where Triton would specialise (and compile) the kernel on its value.
        keys_per_program=max(
            256, next_power_of_2(tokens_per_split if tokens_per_split > 0 else max(1, cdiv(max_keys, num_splits)))
        ),
        # Fixed splits (batch-invariant mode) keep one class: a request's config must not follow
        # the batch it is in.
        occupancy=0 if tokens_per_split > 0 else occupancy_class(grid[0] * grid[1] * grid[2], sm_count(q.device)),
        stride_q_t=q.stride(0),
        stride_q_h=q.stride(1),
        stride_q_d=q.stride(2),
        stride_bt_r=block_table.stride(0),
        stride_bt_b=block_table.stride(1),
        **dict(
            zip(
                ("stride_po_s", "stride_po_t", "stride_po_h", "stride_po_d"),
                cast(torch.Tensor, part_out).stride() if not direct else (0, 0, 0, 0),
                strict=True,
            )
        ),
        **dict(
            zip(
                ("stride_pl_s", "stride_pl_t", "stride_pl_h"),
                cast(torch.Tensor, part_lse).stride() if not direct else (0, 0, 0),
                strict=True,
            )
        ),
        stride_o_t=out.stride(0),
        stride_o_h=out.stride(1),
        stride_o_d=out.stride(2),
        stride_lse_t=cast(torch.Tensor, out_lse_t).stride(0),
        stride_lse_h=cast(torch.Tensor, out_lse_t).stride(1),
        GROUP=group,
        GROUP_PAD=group_pad,
        BLOCK_Q=block_q,
        BLOCK_M=max(16, block_q * group_pad),
        HAS_QSL=query_start_loc is not None,
        FIXED_SPLITS=tokens_per_split > 0,
        USE_SOFTCAP=softcap > 0.0,
        USE_WINDOW=window > 0,
        DIRECT_OUT=direct,
        FUSED_MERGE=fused,
        HAS_SINKS=sinks is not None,
        STORE_LSE=out_lse is not None,
        MERGE_PARTS_CHUNK=_MERGE_PARTS_CHUNK,
        **_kv_args(q, k_cache, v_cache, k_scale, v_scale),
        **fixed,
    )


# --------------------------------------------------------------------------------------------
# Merge
# --------------------------------------------------------------------------------------------


def _stacked(name: str, parts: torch.Tensor | Sequence[torch.Tensor]) -> torch.Tensor:
    """A list of parts as one tensor, refusing what torch.stack would fail on."""
    if isinstance(parts, torch.Tensor):
        return parts
    if not isinstance(parts, (list, tuple)) or not all(isinstance(p, torch.Tensor) for p in parts):
        _fail(
            name,
            f"a {type(parts).__name__}",
            "a tensor [S, ...] or a list of S tensors of one shape",
            "pass the parts to merge",
        )
    if not parts:
        _fail(name, "an empty list (it has no parts)", "at least one part", "pass the parts to merge")
    shapes = [list(p.shape) for p in parts]
    if any(sh != shapes[0] for sh in shapes) or any(
        p.dtype != parts[0].dtype or p.device != parts[0].device for p in parts
    ):
        raise InputError(
            f"{name}: the parts differ in shape ({', '.join(map(str, shapes))}), dtype or device; triton-unified "
            "accepts parts of one shape, dtype and device; pass outputs [num_tokens, num_heads, head_dim] and "
            "lses [num_tokens, num_heads] per part"
        )
    return torch.stack(list(parts))


def merge_states(
    outputs: torch.Tensor | Sequence[torch.Tensor],
    lses: torch.Tensor | Sequence[torch.Tensor],
    out: torch.Tensor | None = None,
    out_lse: torch.Tensor | None = None,
    *,
    sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact merge of attention results over S disjoint key sets (Triton kernel).

    outputs ``[S, num_tokens, num_heads, head_dim]`` (or S tensors ``[num_tokens, num_heads,
    head_dim]``, stacked here: one copy), each normalized over its own keys; lses float32
    ``[S, num_tokens, num_heads]``, natural log, -inf for an empty key set (its output is then
    ignored, even if NaN). Returns ``(out, lse)``: out ``[num_tokens, num_heads, head_dim]`` in
    outputs' dtype (or written into ``out``, any float dtype), lse float32 ``[num_tokens,
    num_heads]``; a (token, head) empty in every part gets zeros and -inf. ``sinks`` (float32
    ``[num_heads]``, optional) adds ``exp(sink)`` to the denominator once, with no value.

    >>> import torch
    >>> o = torch.ones(2, 1, 1, 4); l = torch.tensor([[[0.0]], [[float("-inf")]]])
    >>> m, s = merge_states(o, l)
    >>> m.flatten().tolist(), s.item()
    ([1.0, 1.0, 1.0, 1.0], 0.0)
    """
    outputs = _stacked("outputs", outputs)
    lses = _stacked("lses", lses)
    if outputs.dim() != 4 or outputs.dtype not in _FLOAT_DTYPES:
        _fail(
            "outputs",
            f"{outputs.dtype} {list(outputs.shape)}",
            "float32/float16/bfloat16 [S, num_tokens, num_heads, head_dim], or a list of S [N, H, D]",
            "stack the parts along a new first dimension",
        )
    num_parts, num_tokens, num_heads, head_dim = outputs.shape
    dev = outputs.device
    if num_parts < 1:
        _fail("outputs.shape[0] (S)", num_parts, "at least 1 part", "pass the parts to merge")
    if tuple(lses.shape) != (num_parts, num_tokens, num_heads) or lses.dtype != torch.float32 or lses.device != dev:
        _fail(
            "lses",
            f"{lses.dtype} {list(lses.shape)} on {lses.device}",
            f"float32 {[num_parts, num_tokens, num_heads]} on {dev}",
            "pass one natural-log LSE per part and row",
        )
    if out is None:
        out = torch.empty((num_tokens, num_heads, head_dim), dtype=outputs.dtype, device=dev)
    elif tuple(out.shape) != (num_tokens, num_heads, head_dim) or out.dtype not in _FLOAT_DTYPES or out.device != dev:
        _fail(
            "out",
            f"{out.dtype} {list(out.shape)} on {out.device}",
            f"a float tensor {[num_tokens, num_heads, head_dim]} on {dev}",
            "or pass out=None",
        )
    if out_lse is None:
        out_lse = torch.empty((num_tokens, num_heads), dtype=torch.float32, device=dev)
    elif tuple(out_lse.shape) != (num_tokens, num_heads) or out_lse.dtype != torch.float32 or out_lse.device != dev:
        _fail(
            "out_lse",
            f"{out_lse.dtype} {list(out_lse.shape)} on {out_lse.device}",
            f"float32 {[num_tokens, num_heads]} on {dev}",
            "or pass out_lse=None",
        )
    if sinks is not None and (
        sinks.dtype != torch.float32 or tuple(sinks.shape) != (num_heads,) or sinks.device != dev
    ):
        _fail(
            "sinks",
            f"{sinks.dtype} {list(sinks.shape)} on {sinks.device}",
            f"float32 [{num_heads}] on {dev}",
            "or pass sinks=None",
        )
    if num_tokens == 0 or num_heads == 0:
        return out, out_lse
    _merge[(num_tokens, num_heads)](
        parts_out_ptr=outputs,
        parts_lse_ptr=lses,
        sinks_ptr=sinks if sinks is not None else lses,
        out_ptr=out,
        out_lse_ptr=out_lse,
        num_parts=num_parts,
        stride_po_s=outputs.stride(0),
        stride_po_t=outputs.stride(1),
        stride_po_h=outputs.stride(2),
        stride_po_d=outputs.stride(3),
        stride_pl_s=lses.stride(0),
        stride_pl_t=lses.stride(1),
        stride_pl_h=lses.stride(2),
        stride_o_t=out.stride(0),
        stride_o_h=out.stride(1),
        stride_o_d=out.stride(2),
        stride_lse_t=out_lse.stride(0),
        stride_lse_h=out_lse.stride(1),
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_pow2_at_least(head_dim, 16),
        HAS_SINKS=sinks is not None,
        STORE_LSE=True,  # the kernel can skip it; this API always returns an lse
        PARTS_CHUNK=_MERGE_PARTS_CHUNK,
        # One (token, head) row of <= 256 floats per program: a single warp covers it.
        num_warps=1 if head_dim <= 128 else 2,
    )
    return out, out_lse


# --------------------------------------------------------------------------------------------
# Cascade
# --------------------------------------------------------------------------------------------


@functools.cache
def _side_stream_of(device_index: int) -> torch.cuda.Stream:
    return torch.cuda.Stream(device_index)


@contextlib.contextmanager
def _side_branch(device: torch.device):
    """Launches that may run beside the current stream's. Yields ``side()``, a context: work
    under ``with side():`` runs on one extra (cached) stream of ``device``, forked from the
    current stream on entry; the rest of the block runs on the current stream; leaving the block
    joins the two. A CUDA graph captures the fork as parallel branches. Not on CUDA (the CPU
    interpreter): ``side()`` does nothing and everything runs in order.
    """
    if device.type != "cuda":
        yield contextlib.nullcontext
        return
    main = torch.cuda.current_stream(device)
    side = _side_stream_of(device.index if device.index is not None else torch.cuda.current_device())
    side.wait_stream(main)  # the side work may read what the current stream wrote before
    try:
        yield lambda: torch.cuda.stream(side)
    finally:
        main.wait_stream(side)


def cascade_attention(
    q: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    out: torch.Tensor,
    *,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    block_table: torch.Tensor,
    prefix_blocks: int,
    max_query_len: int,
    max_seq_len: int,
    scale: float,
    window: int = 0,
    softcap: float = 0.0,
    sinks: torch.Tensor | None = None,
    k_scale: torch.Tensor | None = None,
    v_scale: torch.Tensor | None = None,
    lse: torch.Tensor | None = None,
    num_splits: int = 1,
    prefix_splits: int | None = None,
    prefix_row: int = 0,
) -> torch.Tensor:
    """Causal paged attention for a batch sharing its first ``prefix_blocks`` blocks.

    One prefix kernel tiles every query row of the batch (tokens x GROUP heads) against the
    shared prefix, read through ``block_table[prefix_row, :prefix_blocks]`` (the caller guarantees each
    request with ``seq_len > 0`` holds the same ids there, for the blocks it uses: see
    ``shared_prefix_blocks``), so the prefix K/V is read once per 64-128-row tile instead of
    once per request. A second pass attends each request's queries to its own keys from
    ``prefix_blocks * block_size`` on (``num_splits`` splits), and ``merge_states`` combines
    both. Exact for any request: queries lying inside the prefix are masked causally in the
    prefix pass, padding requests (seq_len 0) give exact zeros.

    The prefix pass has only ``ceil(rows / BLOCK_M) x num_kv_heads`` tiles (64 decodes x 4 heads
    of a group: 4 x 8 = 32), far too few to fill a GPU on their own, so it also splits the
    prefix keys into ``prefix_splits`` ranges, one program each, merged with the rest
    (``None``: about two programs per SM, at least 256 keys a split; 1 on a CPU).

    Shapes as in ``split_decode_attention``, except q, out ``[num_tokens, ...]`` with
    query_start_loc int32 ``[num_reqs + 1]``. Sliding windows are refused (``paged_core.InputError``).
    """
    if window != 0:
        _fail(
            "window",
            window,
            "0: cascade attention has no sliding window",
            "run windowed layers with split_decode_attention or unified_attention (paged_triton_unified.launch)",
        )
    num_tokens, num_q_heads, head_dim = q.shape
    num_blocks, block_size, num_kv_heads, _ = k_cache.shape
    num_reqs, max_blocks = block_table.shape
    check_scales(k_cache, k_scale, v_scale)
    _check_count("prefix_blocks", prefix_blocks, minimum=0, none_ok=False)
    if prefix_blocks > max_blocks:
        _fail(
            "prefix_blocks",
            prefix_blocks,
            f"at most block_table.shape[1] = {max_blocks}",
            "declare only blocks that the table holds (see shared_prefix_blocks)",
        )
    _check_count("num_splits", num_splits, minimum=1, none_ok=False)
    _check_count("prefix_splits", prefix_splits, minimum=1, none_ok=True)
    _check_count("prefix_row", prefix_row, minimum=0, none_ok=False)
    if prefix_row >= max(num_reqs, 1):
        _fail(
            "prefix_row",
            prefix_row,
            f"a row of block_table (< {num_reqs})",
            "pass the index of a request that holds the prefix",
        )
    if num_tokens == 0:
        return out

    group = num_q_heads // num_kv_heads
    prefix_tokens = prefix_blocks * block_size
    keys_per_split, prefix_splits = _prefix_split(
        prefix_tokens,
        prefix_splits,
        row_tiles=cdiv(num_tokens * group, _PREFIX_BLOCK_M_MIN),
        num_kv_heads=num_kv_heads,
        device=q.device,
    )
    num_parts = num_splits + prefix_splits
    part_out, part_lse = _partials(num_parts, num_tokens, num_q_heads, head_dim_of(v_cache), q.device)
    kv = _kv_args(q, k_cache, v_cache, k_scale, v_scale)

    # The suffix and prefix passes share nothing until the merge: on a GPU the prefix pass runs on
    # a side stream, joined before the merge (part_out/part_lse are freed on the current stream
    # after it, so the side stream is done with them by then). NVIDIA H200, Triton 3.6, CUDA-graph
    # replays, 2026-12-01, 64 x (4,000 shared + 100 own): 0.0539 ms so, 0.0570 ms one after the other.
    with _side_branch(q.device) as side:
        # Suffix: each request's own keys after the prefix, causal; parts 0 .. num_splits-1.
        _launch_split(
            q,
            k_cache,
            v_cache,
            k_scale,
            v_scale,
            part_out,
            part_lse,
            seq_lens=seq_lens,
            block_table=block_table,
            query_start_loc=query_start_loc,
            scale=scale,
            softcap=softcap,
            window=0,
            key_start=prefix_blocks * block_size,
            num_splits=num_splits,
            tokens_per_split=0,
            max_query_len=max(max_query_len, 1),
            max_keys=max(max_seq_len - prefix_blocks * block_size, 0),
        )
        # Prefix: all query rows of the batch against the shared blocks, split along the keys;
        # the last prefix_splits parts.
        if prefix_splits > 0:
            po, pl = part_out[num_splits:], part_lse[num_splits:]
            grid = lambda meta: (  # noqa: E731
                cdiv(num_tokens * group, meta["BLOCK_M"]),
                num_kv_heads,
                prefix_splits,
            )
            with side():
                _launch_prefix(
                    grid,
                    q,
                    block_table[prefix_row],
                    seq_lens,
                    query_start_loc,
                    po,
                    pl,
                    scale=scale,
                    softcap=softcap,
                    prefix_tokens=prefix_tokens,
                    keys_per_split=keys_per_split,
                    num_tokens=num_tokens,
                    num_reqs=num_reqs,
                    num_blocks=num_blocks,
                    max_blocks=max_blocks,
                    group=group,
                    kv=kv,
                )
    merge_states(part_out, part_lse, out=out, out_lse=lse, sinks=sinks)
    return out


def _launch_prefix(
    grid,
    q,
    prefix_table,
    seq_lens,
    query_start_loc,
    po,
    pl,
    *,
    scale,
    softcap,
    prefix_tokens,
    keys_per_split,
    num_tokens,
    num_reqs,
    num_blocks,
    max_blocks,
    group,
    kv,
) -> None:
    """cascade_attention's prefix pass: every query row of the batch against the shared blocks,
    read through ``prefix_table`` (the block-table row of a request that holds them)."""
    _prefix[grid](
        q_ptr=q,
        block_table_ptr=prefix_table,
        seq_lens_ptr=seq_lens,
        query_start_loc_ptr=query_start_loc,
        part_out_ptr=po,
        part_lse_ptr=pl,
        scale=float(scale),
        softcap=float(softcap),
        prefix_tokens=prefix_tokens,
        keys_per_split=keys_per_split,
        num_tokens=num_tokens,
        num_reqs=num_reqs,
        search_steps=(num_reqs - 1).bit_length(),
        num_blocks=num_blocks,
        max_blocks=max_blocks,
        stride_q_t=q.stride(0),
        stride_q_h=q.stride(1),
        stride_q_d=q.stride(2),
        stride_bt_b=prefix_table.stride(0),
        stride_po_s=po.stride(0),
        stride_po_t=po.stride(1),
        stride_po_h=po.stride(2),
        stride_po_d=po.stride(3),
        stride_pl_s=pl.stride(0),
        stride_pl_t=pl.stride(1),
        stride_pl_h=pl.stride(2),
        GROUP=group,
        USE_SOFTCAP=softcap > 0.0,
        **kv,
    )
