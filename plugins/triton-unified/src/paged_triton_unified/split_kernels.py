"""Triton kernels of triton-unified's split-KV (Flash-Decoding) path, its merge and cascade attention.

Only ``@triton.jit`` code and the autotune configs of the kernel right below them live here;
launchers (argument checks, workspaces, grids) are in ``split_launch.py``.

Conventions shared by every kernel of this file (the rules of masking, soft-cap, sinks, 8-bit
codes, the online-softmax step and the interpreter's float32 switch are the helpers of
:mod:`paged_triton_common.tiles`, which the unified kernel calls too):

* Scores are kept in the log2 domain inside the loops (``exp2`` is one MUFU instruction);
  every log-sum-exp that leaves a kernel is converted back to the natural log.
* The GROUP query heads that share one KV head are packed into the rows of a tile, so each
  K/V element read from HBM feeds GROUP (padded) rows of a ``tl.dot``.
* K/V are gathered straight from the paged pool through the block table; block ids outside
  ``[0, num_blocks)`` mask their keys and their pointers are clamped to block 0, so a corrupt
  table can never make a kernel read outside the pool.
* ``UPCAST`` (:func:`~paged_triton_common.tiles.upcast`) is on only under ``TRITON_INTERPRET=1``.
* float8 codes arrive as ``uint8`` (the launcher views the cache) and are bitcast in
  :func:`~paged_triton_common.tiles.codes_to` (``FP8``: 0, or which fp8 format): the
  interpreter cannot load float8 tensors, the GPU does not care.
* Stride names follow the unified kernel's (``stride_<tensor>_<dim>``, see ``kernels.py``).
"""

import triton
import triton.language as tl
from paged_triton_common.runtime import AUTOTUNE, INTERPRET
from paged_triton_common.tiles import (
    LOG2E,
    block_ok,
    codes8_f16,
    codes_to,
    fold_sink,
    int4_codes,
    int4_f16,
    kivi4_keys,
    log2_scores,
    natural_lse,
    pv_step,
    q_f16,
    sink_weight,
    softmax_step,
    upcast,
    visible,
)
from paged_triton_common.tuning import replay_bench


@triton.jit
def _tile_block_ids(bt_row_ptr, t0, start, end, stride_bt_b, BLOCK_SIZE: tl.constexpr, BLOCK_N: tl.constexpr):
    """Physical blocks of keys t0 .. t0 + BLOCK_N - 1 of one request; -1 outside [start, end)."""
    offs_n = t0 + tl.arange(0, BLOCK_N)
    return tl.load(bt_row_ptr + (offs_n // BLOCK_SIZE) * stride_bt_b, mask=(offs_n >= start) & (offs_n < end), other=-1)


@triton.jit
def _attend_tile(
    m_i,  # [BLOCK_M] float32, running max of scores (log2 domain), -inf while nothing seen
    l_i,  # [BLOCK_M] float32, running sum of exp2(score - m_i)
    acc,  # [BLOCK_M, HEAD_DIM_V_PAD] float32, running sum of p @ V
    q,  # [BLOCK_M, HEAD_DIM_PAD] dot dtype (q.dtype on GPU, float32 under the interpreter)
    vis,  # [BLOCK_M, BLOCK_N] bool, key visible to row (implies key_ok)
    blk,  # [BLOCK_N] int64, physical block of each key (0 where not key_ok)
    offs_in_blk,  # [BLOCK_N] int32, slot of each key inside its block
    key_ok,  # [BLOCK_N] bool, key may be loaded (in range, valid block id)
    kv_head,
    offs_d,  # [HEAD_DIM_PAD]
    d_mask,  # [HEAD_DIM_PAD] bool, offs_d < HEAD_DIM
    offs_dv,  # [HEAD_DIM_V_PAD]: V's head-dim lanes (offs_d when V's head dim is q's)
    dv_mask,  # [HEAD_DIM_V_PAD] bool, offs_dv < HEAD_DIM_V
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim]
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim_v]
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (QUANT only)
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (QUANT only)
    qk_scale,  # scale * log2(e), or scale / softcap with USE_SOFTCAP (times q's pre-shift)
    softcap,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    stride_ks_b,
    stride_ks_s,
    stride_ks_h,
    stride_vs_b,
    stride_vs_s,
    stride_vs_h,
    KV_QUANT: tl.constexpr,  # the cache format, as the unified kernel's KV_QUANT
    USE_SOFTCAP: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr = 0,  # read only for int4 codes (two per byte: the cache's last
    # dimension is half of these head dims)
    HEAD_DIM_PAD: tl.constexpr = 0,
    HEAD_DIM_V: tl.constexpr = 0,
    HEAD_DIM_V_PAD: tl.constexpr = 0,
    BLOCK_SIZE: tl.constexpr = 0,  # tokens per cache block (read only for kivi4)
    QDOT16: tl.constexpr = False,  # codes into fp16 dots (q already in fp16: tiles.q_f16)
    ASM: tl.constexpr = False,  # code conversion in PTX (the GPU; not the interpreter)
):
    """One online-softmax step: fold BLOCK_N gathered keys into (m_i, l_i, acc)."""
    QUANT: tl.constexpr = KV_QUANT != 0
    FP8: tl.constexpr = 1 if KV_QUANT == 2 else (2 if KV_QUANT == 3 else 0)  # codes_to's format
    INT4: tl.constexpr = KV_QUANT >= 4  # int4 codes, two per byte
    K_PER_CHANNEL: tl.constexpr = KV_QUANT == 5  # kivi4: key scales per (block, KV head, channel)
    k_off = blk * stride_k_b + offs_in_blk * stride_k_s + kv_head * stride_k_h  # [BLOCK_N] int64
    # K is loaded already transposed so the score tile is a plain q @ kt.
    if INT4:
        offs_h = tl.arange(0, HEAD_DIM_PAD // 2)
        kp = tl.load(
            k_cache_ptr + k_off[:, None] + offs_h[None, :] * stride_k_d,
            mask=key_ok[:, None] & (offs_h < HEAD_DIM // 2)[None, :],
            other=0,
        )  # [BLOCK_N, HEAD_DIM_PAD // 2] bytes
        if K_PER_CHANNEL:
            kt = kivi4_keys(
                kp, k_scale_ptr, blk, kv_head, stride_ks_b, stride_ks_h, offs_d, d_mask, QDOT16, ASM, BLOCK_SIZE
            )
            kt = tl.trans(kt.to(q.dtype))
        elif QDOT16:
            kt = tl.trans(int4_f16(kp, ASM))
        else:
            kt = tl.trans(int4_codes(kp))
    else:
        kt = tl.load(
            k_cache_ptr + k_off[None, :] + offs_d[:, None] * stride_k_d,
            mask=key_ok[None, :] & d_mask[:, None],
            other=0,
        )  # [HEAD_DIM_PAD, BLOCK_N]
    # int8 and fp8 codes are exact in fp16/bf16, so the dot on raw codes loses nothing; the
    # per-key scale is applied to the score column afterwards (one multiply per score instead of
    # one per K element).
    if INT4:
        pass  # converted above (kivi4: dequantized there, one scale per block and channel)
    elif QDOT16:
        kt = codes8_f16(kt, FP8, ASM, STAGED=False)
    elif not QDOT16:  # (int4_f16's codes are fp16 already)
        kt = codes_to(kt, q.dtype, FP8)
    s = tl.dot(q, kt, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] float32
    k_sc = 1.0  # read only for per-key scales
    if QUANT and not K_PER_CHANNEL:
        ks_off = blk * stride_ks_b + offs_in_blk * stride_ks_s + kv_head * stride_ks_h
        k_sc = tl.load(k_scale_ptr + ks_off, mask=key_ok, other=0.0)  # [BLOCK_N]
    s = log2_scores(s, k_sc, qk_scale, softcap, QUANT and not K_PER_CHANNEL, USE_SOFTCAP, RAW=False)
    # Masking after the soft-cap: a masked key must be -inf, not cap * tanh(-inf).
    s = tl.where(vis, s, float("-inf"))
    p, alpha, l_i, m_new = softmax_step(s, m_i, l_i, 1.0, MAY_BE_EMPTY=True, RAW=False)

    v_off = blk * stride_v_b + offs_in_blk * stride_v_s + kv_head * stride_v_h  # [BLOCK_N] int64
    if INT4:
        offs_hv = tl.arange(0, HEAD_DIM_V_PAD // 2)
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_hv[None, :] * stride_v_d,
            mask=key_ok[:, None] & (offs_hv < HEAD_DIM_V // 2)[None, :],
            other=0,
        )  # [BLOCK_N, HEAD_DIM_V_PAD // 2] bytes
        if QDOT16:
            v = int4_f16(v, ASM)
        else:
            v = int4_codes(v)
    else:
        v = tl.load(
            v_cache_ptr + v_off[:, None] + offs_dv[None, :] * stride_v_d,
            mask=key_ok[:, None] & dv_mask[None, :],
            other=0,
        )  # [BLOCK_N, HEAD_DIM_V_PAD]
        if QDOT16:
            v = codes8_f16(v, FP8, ASM, STAGED=True)
    v_sc = 1.0  # read only for a quantized cache
    if QUANT:
        vs_off = blk * stride_vs_b + offs_in_blk * stride_vs_s + kv_head * stride_vs_h
        v_sc = tl.load(v_scale_ptr + vs_off, mask=key_ok, other=0.0)  # [BLOCK_N]
    if not QDOT16:
        v = codes_to(v, q.dtype, FP8)
    acc = pv_step(acc, alpha, p, v, v_sc, q.dtype, QUANT, QDOT16, DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _store_partial(
    part_out_ptr,  # [num_tokens, num_q_heads, head_dim] float32 (one split's slice)
    part_lse_ptr,  # [num_tokens, num_q_heads] float32 (one split's slice)
    m_i,
    l_i,
    acc,
    token,  # [BLOCK_M] int64
    head,  # [BLOCK_M]
    row_valid,  # [BLOCK_M] bool
    offs_d,
    d_mask,
    stride_po_t,
    stride_po_h,
    stride_po_d,
    stride_pl_t,
    stride_pl_h,
):
    """Write out normalized within this key range and its natural-log LSE (-inf, zeros if empty)."""
    # != rather than >: a NaN sum (NaN in this request's q or K) must stay NaN, not become 0.
    has_keys = l_i != 0.0
    inv_l = tl.where(has_keys, 1.0 / tl.where(has_keys, l_i, 1.0), 0.0)
    out = acc * inv_l[:, None]
    lse = natural_lse(m_i, tl.where(has_keys, l_i, 1.0), has_keys)
    tl.store(
        part_out_ptr + token[:, None] * stride_po_t + head[:, None] * stride_po_h + offs_d[None, :] * stride_po_d,
        out,
        mask=row_valid[:, None] & d_mask[None, :],
    )
    tl.store(part_lse_ptr + token * stride_pl_t + head * stride_pl_h, lse, mask=row_valid)


@triton.jit
def _store_final(
    out_ptr,  # [num_tokens, num_q_heads, head_dim], q's dtype
    lse_ptr,  # [num_tokens, num_q_heads] float32 (STORE_LSE only)
    sinks_ptr,  # [num_q_heads] float32 (HAS_SINKS only), natural-log logit without a value
    m_i,
    l_i,
    acc,
    token,  # [BLOCK_M] int64
    head,  # [BLOCK_M]
    row_valid,  # [BLOCK_M] bool
    offs_d,
    d_mask,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_lse_t,
    stride_lse_h,
    HAS_SINKS: tl.constexpr,
    STORE_LSE: tl.constexpr,
):
    """The one-split epilogue: what merge_states would make of a single part, written directly.

    Same rules as the merge: a row with no visible key gets zeros and lse = -inf (sinks or not);
    otherwise the sink joins the denominator once.
    """
    # != rather than >: a NaN sum (NaN in this request's q or K) must stay NaN, not become 0.
    has_keys = l_i != 0.0
    if HAS_SINKS:
        m_i, l_i, acc = fold_sink(m_i, l_i, acc, sinks_ptr, head, row_valid, has_keys)
    l_safe = tl.where(has_keys, l_i, 1.0)
    # acc * (1 / l) as in _store_partial: without sinks this is bit-identical to merging one part.
    out = acc * (1.0 / l_safe)[:, None]
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & d_mask[None, :],
    )
    if STORE_LSE:
        lse = natural_lse(m_i, l_safe, has_keys)
        tl.store(lse_ptr + token * stride_lse_t + head * stride_lse_h, lse, mask=row_valid)


# --------------------------------------------------------------------------------------------
# Split kernel: (request, query tile, KV head, split) -> partial out + lse.
# --------------------------------------------------------------------------------------------

# BLOCK_N 64-128 with 2-4 stages keeps ~2-3 tiles of K/V in flight per program (cp.async), which
# is what a memory-bound loop needs when one program per SM carries the whole bandwidth (few
# long requests); 4 warps suffice for 16-row tiles. With each tile's block ids loaded a tile
# ahead, the pipeliner buffers the gathered K/V num_stages deep (offline sm_90a compile, bf16,
# d 128, GROUP 4: 64 keys take 38 / 70 / 102 KB of shared memory at 2 / 3 / 4 stages). NVIDIA
# H200, Triton 3.6, CUDA-graph replays, 2026-12-01: 64 keys / 4 warps / 3 stages ran 4 x 32,768
# (9 splits) in 0.1672 ms and 16 x 8,192 (3 splits) in 0.1469 ms; 4 stages 0.2512 / 0.1970.
if INTERPRET:
    # One fixed config under the interpreter: autotuning there only multiplies the run time.
    # 32 spans two 16-token blocks and is smaller than a 64-token block: both gather paths.
    _SPLIT_CONFIGS = [triton.Config({"BLOCK_N": 32}, num_warps=4, num_stages=1)]
    SPLIT_DEFAULT_CONFIG = _SPLIT_CONFIGS[0]
else:
    _SPLIT_CONFIGS = [
        triton.Config({"BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bn, w, st in [
            (32, 4, 3),
            (64, 4, 2),
            (64, 4, 3),
            (64, 4, 4),
            (64, 8, 3),
            (128, 4, 2),
            (128, 4, 3),
            (128, 8, 2),
        ]
    ]
    # What PAGED_AUTOTUNE=0 runs, and what a CUDA-graph capture compiles on a new key (nothing
    # can be timed there).
    SPLIT_DEFAULT_CONFIG = _SPLIT_CONFIGS[2]  # (64, 4 warps, 3 stages)
    if not AUTOTUNE:
        _SPLIT_CONFIGS = [SPLIT_DEFAULT_CONFIG]


# The key holds the keys one program walks (keys_per_program, a power of two): the best config
# follows the loop's length (NVIDIA H200, Triton 3.6, 2026-12-01: a choice tuned on 1 x 512 ran
# 4 x 32,768 58 % slower than the best config), and how many programs each SM gets (occupancy,
# 1, 2, 4 or 8+, as the unified kernel's key): 1 x 4,096 and 2 x 4,096 both walk 256 keys a program,
# on 128 and 256 programs, and need different configs. It leaves out every other batch-dependent
# value (num_reqs, num_splits): batch-invariant mode needs the same config for a request alone
# and in any batch, so there a split's length is fixed (blocks_per_split) and occupancy is 0.
# DIRECT_OUT (one split) is in it, but the launcher never uses it in that mode.
# Triton adds the dtypes of tensor arguments (q, KV cache) to the key by itself.
# Tuned choices persist in TRITON_CACHE_DIR (as the unified kernel's).
@triton.autotune(
    configs=_SPLIT_CONFIGS,
    key=[
        "GROUP_PAD",
        "HEAD_DIM_PAD",
        "HEAD_DIM_V_PAD",
        "BLOCK_SIZE",
        "BLOCK_Q",
        "DIRECT_OUT",
        "FUSED_MERGE",
        "keys_per_program",
        "occupancy",
    ],
    cache_results=True,
    # Timed as CUDA-graph replays (paged_triton_common.tuning): a small decode's split kernel
    # takes less time than Triton's own launch path, which would otherwise be what is timed.
    do_bench=replay_bench,
)
# Batch-dependent ints feed no address alignment: specialised (== 1, divisible by 16), a new
# split count or table width would compile another binary of a tuned class. occupancy is a key
# value only.
@triton.jit(do_not_specialize=["num_blocks", "max_blocks", "num_splits", "occupancy"])
def split_kv_attention_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim], q dtype
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], q dtype / int8 / uint8 (fp8 bytes)
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], like k_cache
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (QUANT only)
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (QUANT only)
    block_table_ptr,  # [num_reqs, max_blocks] int32
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32 (HAS_QSL only; else request r is token r)
    part_out_ptr,  # [num_splits, num_tokens, num_q_heads, head_dim] float32
    part_lse_ptr,  # [num_splits, num_tokens, num_q_heads] float32
    out_ptr,  # [num_tokens, num_q_heads, head_dim], q's dtype (DIRECT_OUT or FUSED_MERGE)
    out_lse_ptr,  # [num_tokens, num_q_heads] float32 (STORE_LSE only)
    sinks_ptr,  # [num_q_heads] float32 (HAS_SINKS only)
    counter_ptr,  # [grid axis 0, num_kv_heads] int32, all zero between launches (FUSED_MERGE only)
    scale,  # float, softmax scale
    softcap,  # float (USE_SOFTCAP only)
    window,  # int (USE_WINDOW only): keys > pos - window are visible
    key_start,  # int, first key position this pass may see (cascade suffix: prefix length)
    num_blocks,  # int, blocks in the pool: ids outside [0, num_blocks) are masked
    max_blocks,  # int, width of block_table: keys past max_blocks * BLOCK_SIZE are masked
    num_splits,  # int (not FIXED_SPLITS): splits per request
    tokens_per_split,  # int (FIXED_SPLITS only): key tokens per split, batch independent
    num_q_tiles,  # int, query tiles per request (grid axis 0 = num_reqs * num_q_tiles)
    keys_per_program,  # int, a power of two near the keys one program walks: the autotune key only
    occupancy,  # int, programs per SM class (1, 2, 4, 8; 0 with fixed splits): the autotune key only
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    stride_ks_b,
    stride_ks_s,
    stride_ks_h,
    stride_vs_b,
    stride_vs_s,
    stride_vs_h,
    stride_bt_r,
    stride_bt_b,
    stride_po_s,
    stride_po_t,
    stride_po_h,
    stride_po_d,
    stride_pl_s,
    stride_pl_t,
    stride_pl_h,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_lse_t,
    stride_lse_h,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # GROUP rounded up to a power of two
    BLOCK_Q: tl.constexpr,  # query tokens per tile (1 for decode)
    BLOCK_M: tl.constexpr,  # tile rows: max(16, BLOCK_Q * GROUP_PAD)
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # HEAD_DIM rounded up to a power of two (>= 16)
    HEAD_DIM_V: tl.constexpr,  # V's and the output's head dim (HEAD_DIM but in MLA-shaped layers)
    HEAD_DIM_V_PAD: tl.constexpr,  # HEAD_DIM_V rounded up to a power of two (>= 16)
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    HAS_QSL: tl.constexpr,
    FIXED_SPLITS: tl.constexpr,
    KV_QUANT: tl.constexpr,  # the cache format, as the unified kernel's KV_QUANT
    QDOT16: tl.constexpr,  # quantized cache with 16-bit q: both dots in fp16 (tiles.codes8_f16, int4_f16)
    USE_SOFTCAP: tl.constexpr,
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    DIRECT_OUT: tl.constexpr,  # one split: write the final out (and lse) instead of a partial
    FUSED_MERGE: tl.constexpr,  # several splits: the last to finish merges them into out (and lse)
    HAS_SINKS: tl.constexpr,  # DIRECT_OUT or FUSED_MERGE only
    STORE_LSE: tl.constexpr,  # DIRECT_OUT or FUSED_MERGE only
    MERGE_PARTS_CHUNK: tl.constexpr,  # FUSED_MERGE: parts per load (see _merge_rows)
    BLOCK_N: tl.constexpr,  # key tokens per loop step (autotuned)
):
    """One program: BLOCK_Q queries of one request x the GROUP heads of one KV head, against the
    keys of one split; writes that split's normalized partial output and natural-log LSE, or,
    with DIRECT_OUT (a single split), the final output: no workspace and no merge launch.

    With FUSED_MERGE, the program that finishes last among the splits of its (query tile, KV
    head) merges them all into the final output: one launch instead of a split launch and a
    merge launch. Finishing is counted per (query tile, KV head) in ``counter_ptr``: each
    program stores its partial, passes a CTA barrier (every thread's stores done), then adds 1
    with acquire-release semantics at GPU scope, so the program that sees ``num_splits - 1``
    observes every other split's partial. It resets the count to 0, so the buffer is ready for
    the next launch (and for CUDA-graph replays) without a memset. Every program reaches the
    count: none returns early on this path (decode batches, one query per request).
    """
    tl.static_assert(BLOCK_M >= BLOCK_Q * GROUP_PAD)
    tl.static_assert(BLOCK_M >= 16)  # tl.dot needs at least 16 rows
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    tl.static_assert(HEAD_DIM_V_PAD >= HEAD_DIM_V)
    tl.static_assert(BLOCK_N >= 16)

    pid_rq = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    req = pid_rq // num_q_tiles
    q_tile = pid_rq % num_q_tiles

    seq_len = tl.load(seq_lens_ptr + req)
    if HAS_QSL:
        q_start = tl.load(query_start_loc_ptr + req)
        q_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    else:
        q_start = req
        q_len = 1
    tile_q0 = q_tile * BLOCK_Q
    if tile_q0 >= q_len:
        return

    offs_m = tl.arange(0, BLOCK_M)
    tok_in_tile = offs_m // GROUP_PAD
    hh = offs_m % GROUP_PAD
    q_idx = tile_q0 + tok_in_tile  # [BLOCK_M] query index inside the request
    row_valid = (tok_in_tile < BLOCK_Q) & (hh < GROUP) & (q_idx < q_len)
    token = (q_start + q_idx).to(tl.int64)  # [BLOCK_M]
    head = kv_head * GROUP + hh  # [BLOCK_M]
    pos = seq_len - q_len + q_idx  # [BLOCK_M] position of each row's query
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    if HEAD_DIM_V == HEAD_DIM:  # V, the accumulator and the output: q's lanes, or V's own
        offs_dv = offs_d
        dv_mask = d_mask
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
        dv_mask = offs_dv < HEAD_DIM_V

    q = tl.load(
        q_ptr + token[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    q = upcast(q, UPCAST)
    if USE_SOFTCAP:
        qk_scale = scale / softcap
    else:
        qk_scale = scale * LOG2E
    if QDOT16:
        q, q_factor = q_f16(q)
        qk_scale = qk_scale * q_factor

    # Keys the tile can see: [lo, hi). Rows refine this with their own causal / window mask.
    last_q = tl.minimum(tile_q0 + BLOCK_Q, q_len) - 1
    hi = tl.minimum(seq_len - q_len + last_q + 1, max_blocks * BLOCK_SIZE)
    lo = tl.maximum(key_start, 0)
    if USE_WINDOW:
        lo = tl.maximum(lo, seq_len - q_len + tile_q0 - window + 1)

    if FIXED_SPLITS:
        # Batch invariant: split s always covers the same absolute key positions.
        split_lo = split * tokens_per_split
        split_hi = split_lo + tokens_per_split
    else:
        # Equal shares of this request's visible range, aligned to BLOCK_N so that every split
        # but the edges runs whole tiles.
        base = (lo // BLOCK_N) * BLOCK_N
        span = tl.maximum(hi - base, 0)
        per_split = tl.cdiv(tl.cdiv(span, num_splits), BLOCK_N) * BLOCK_N
        split_lo = base + split * per_split
        split_hi = split_lo + per_split
    start = tl.maximum(split_lo, lo)
    end = tl.minimum(split_hi, hi)

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], tl.float32)

    # Tiles stay aligned to split_lo (not to `start`), so the summation order of a split depends
    # only on the request itself: needed for the batch-invariant mode.
    t_begin = split_lo + ((start - split_lo) // BLOCK_N) * BLOCK_N
    bt_row = block_table_ptr + req * stride_bt_r
    blk_next = _tile_block_ids(bt_row, t_begin, start, end, stride_bt_b, BLOCK_SIZE, BLOCK_N)
    for t0 in range(t_begin, end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)  # [BLOCK_N] key positions
        key_in = (offs_n >= start) & (offs_n < end)
        # This tile's ids were loaded one tile earlier: no load inside the step feeds the K/V
        # addresses, so the pipeliner can buffer the gathered K/V num_stages deep.
        blk = blk_next  # [BLOCK_N] int32
        blk_next = _tile_block_ids(bt_row, t0 + BLOCK_N, start, end, stride_bt_b, BLOCK_SIZE, BLOCK_N)
        key_ok = key_in & block_ok(blk, num_blocks)
        blk = tl.where(key_ok, blk, 0).to(tl.int64)
        if BLOCK_Q > 1:
            vis = visible(key_ok, offs_n, pos, pos, window, USE_WINDOW)
        else:
            # Decode: the single query sits at seq_len - 1, so [start, end) is already exact.
            vis = key_ok[None, :] & (offs_m[:, None] >= 0)
        m_i, l_i, acc = _attend_tile(
            m_i,
            l_i,
            acc,
            q,
            vis,
            blk,
            offs_n % BLOCK_SIZE,
            key_ok,
            kv_head,
            offs_d,
            d_mask,
            offs_dv,
            dv_mask,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            qk_scale,
            softcap,
            stride_k_b,
            stride_k_s,
            stride_k_h,
            stride_k_d,
            stride_v_b,
            stride_v_s,
            stride_v_h,
            stride_v_d,
            stride_ks_b,
            stride_ks_s,
            stride_ks_h,
            stride_vs_b,
            stride_vs_s,
            stride_vs_h,
            KV_QUANT,
            USE_SOFTCAP,
            DOT_PRECISION,
            HEAD_DIM=HEAD_DIM,
            HEAD_DIM_PAD=HEAD_DIM_PAD,
            HEAD_DIM_V=HEAD_DIM_V,
            HEAD_DIM_V_PAD=HEAD_DIM_V_PAD,
            BLOCK_SIZE=BLOCK_SIZE,
            QDOT16=QDOT16,
            ASM=not UPCAST,
        )

    if DIRECT_OUT:
        _store_final(
            out_ptr,
            out_lse_ptr,
            sinks_ptr,
            m_i,
            l_i,
            acc,
            token,
            head,
            row_valid,
            offs_dv,
            dv_mask,
            stride_o_t,
            stride_o_h,
            stride_o_d,
            stride_lse_t,
            stride_lse_h,
            HAS_SINKS,
            STORE_LSE,
        )
    else:
        # int64: with blocks_per_split, thousands of splits x a large batch overflow int32 offsets.
        split64 = split.to(tl.int64)
        _store_partial(
            part_out_ptr + split64 * stride_po_s,
            part_lse_ptr + split64 * stride_pl_s,
            m_i,
            l_i,
            acc,
            token,
            head,
            row_valid,
            offs_dv,
            dv_mask,
            stride_po_t,
            stride_po_h,
            stride_po_d,
            stride_pl_t,
            stride_pl_h,
        )
        if FUSED_MERGE:
            tl.debug_barrier()  # every thread's partial is stored before the count releases it
            counter = counter_ptr + pid_rq * tl.num_programs(1) + kv_head
            finished = tl.atomic_add(counter, 1, sem="acq_rel", scope="gpu")
            if finished == tl.num_programs(2) - 1:
                # The tile's real rows only (BLOCK_Q x GROUP_PAD; BLOCK_M pads them to 16 for
                # tl.dot), so a chunk of parts is a small tile.
                offs_r = tl.arange(0, BLOCK_Q * GROUP_PAD)
                r_q = tile_q0 + offs_r // GROUP_PAD
                r_hh = offs_r % GROUP_PAD
                _merge_rows(
                    part_out_ptr,
                    part_lse_ptr,
                    sinks_ptr,
                    out_ptr,
                    out_lse_ptr,
                    tl.num_programs(2),
                    (q_start + r_q).to(tl.int64),
                    kv_head * GROUP + r_hh,
                    (r_hh < GROUP) & (r_q < q_len),
                    offs_dv,
                    dv_mask,
                    stride_po_s,
                    stride_po_t,
                    stride_po_h,
                    stride_po_d,
                    stride_pl_s,
                    stride_pl_t,
                    stride_pl_h,
                    stride_o_t,
                    stride_o_h,
                    stride_o_d,
                    stride_lse_t,
                    stride_lse_h,
                    HAS_SINKS,
                    STORE_LSE,
                    MERGE_PARTS_CHUNK,
                )
                tl.atomic_xchg(counter, 0, sem="relaxed", scope="gpu")


# --------------------------------------------------------------------------------------------
# Cascade prefix kernel: every query row of the batch x the shared prefix.
# --------------------------------------------------------------------------------------------

# Prefix tiles are real matrix tiles (64-128 rows): the whole point is that one K/V read serves
# many requests, so the tile is compute-shaped, unlike the 16-row decode tiles above.
if INTERPRET:
    _PREFIX_CONFIGS = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=1)]
    PREFIX_DEFAULT_CONFIG = _PREFIX_CONFIGS[0]
else:
    _PREFIX_CONFIGS = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=st)
        for bm, bn, w, st in [
            (64, 32, 4, 2),
            (64, 64, 4, 2),
            (64, 64, 4, 3),
            (128, 32, 4, 2),
            (128, 64, 8, 2),
            (128, 64, 8, 3),
        ]
    ]
    PREFIX_DEFAULT_CONFIG = _PREFIX_CONFIGS[1]  # (64 rows, 64 keys, 4 warps, 2 stages)
    if not AUTOTUNE:
        _PREFIX_CONFIGS = [PREFIX_DEFAULT_CONFIG]


@triton.autotune(
    configs=_PREFIX_CONFIGS,
    key=["GROUP", "HEAD_DIM_PAD", "HEAD_DIM_V_PAD", "BLOCK_SIZE"],
    cache_results=True,
    do_bench=replay_bench,
)
@triton.jit
def cascade_prefix_kernel(
    q_ptr,  # [num_tokens, num_q_heads, head_dim], q dtype
    k_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], q dtype / int8 / uint8 (fp8 bytes)
    v_cache_ptr,  # [num_blocks, block_size, num_kv_heads, head_dim], like k_cache
    k_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (QUANT only)
    v_scale_ptr,  # [num_blocks, block_size, num_kv_heads] float32 (QUANT only)
    block_table_ptr,  # [num_reqs, max_blocks] int32; row 0 supplies the shared prefix blocks
    seq_lens_ptr,  # [num_reqs] int32
    query_start_loc_ptr,  # [num_reqs + 1] int32
    part_out_ptr,  # [prefix_splits, num_tokens, num_q_heads, head_dim] float32 (the prefix slots)
    part_lse_ptr,  # [prefix_splits, num_tokens, num_q_heads] float32 (the prefix slots)
    scale,
    softcap,
    prefix_tokens,  # int, prefix_blocks * block_size
    keys_per_split,  # int, prefix keys per program along axis 2 (a multiple of every BLOCK_N)
    num_tokens,  # int
    num_reqs,  # int
    search_steps,  # int, ceil(log2(num_reqs)): binary-search steps from token to request
    num_blocks,
    max_blocks,
    stride_q_t,
    stride_q_h,
    stride_q_d,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_k_d,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_v_d,
    stride_ks_b,
    stride_ks_s,
    stride_ks_h,
    stride_vs_b,
    stride_vs_s,
    stride_vs_h,
    stride_bt_b,
    stride_po_s,
    stride_po_t,
    stride_po_h,
    stride_po_d,
    stride_pl_s,
    stride_pl_t,
    stride_pl_h,
    GROUP: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr,  # V's and the output's head dim
    HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,  # the cache format, as the unified kernel's KV_QUANT
    QDOT16: tl.constexpr,  # quantized cache with 16-bit q: both dots in fp16 (tiles.codes8_f16, int4_f16)
    USE_SOFTCAP: tl.constexpr,
    UPCAST: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr,  # rows (query token x head-in-group) per program (autotuned)
    BLOCK_N: tl.constexpr,  # key tokens per loop step (autotuned)
):
    """One program: BLOCK_M consecutive (query token, head-in-group) rows of the whole batch for
    one KV head, against one split of the shared prefix keys (``keys_per_split`` from
    ``program_id(2) * keys_per_split``); writes partial output and natural-log LSE to that split's
    slot (an empty range: -inf and zeros, which the merge ignores)."""
    tl.static_assert(BLOCK_M >= 16)
    tl.static_assert(BLOCK_N >= 16)
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    tl.static_assert(HEAD_DIM_V_PAD >= HEAD_DIM_V)

    kv_head = tl.program_id(1)
    # Rows pack exactly GROUP heads per token (no power-of-two padding needed: the tile is not
    # split per token), so no row of the tile is wasted.
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    token = rows // GROUP  # [BLOCK_M]
    hh = rows % GROUP
    row_valid = token < num_tokens
    head = kv_head * GROUP + hh

    # Request of each row: the last r with query_start_loc[r] <= token (empty requests share
    # their start with the next one, "last" skips them).
    r_lo = tl.zeros([BLOCK_M], tl.int32)
    r_hi = tl.zeros([BLOCK_M], tl.int32) + num_reqs
    for _ in range(search_steps):
        mid = (r_lo + r_hi) // 2
        mid_start = tl.load(query_start_loc_ptr + mid, mask=row_valid, other=0)
        right = mid_start <= token
        r_lo = tl.where(right, mid, r_lo)
        r_hi = tl.where(right, r_hi, mid)
    seq_len = tl.load(seq_lens_ptr + r_lo, mask=row_valid, other=0)
    q_end = tl.load(query_start_loc_ptr + r_lo + 1, mask=row_valid, other=0)
    # The query at `token` is the (q_end - token)-th from the end of its request's positions.
    # Rows whose query sits inside the prefix keep an exact causal mask below; padding requests
    # (seq_len 0) get pos < 0 and see nothing.
    pos = tl.where(row_valid, seq_len - (q_end - token), -1)  # [BLOCK_M]

    token64 = token.to(tl.int64)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    if HEAD_DIM_V == HEAD_DIM:  # V, the accumulator and the partial output: q's lanes, or V's own
        offs_dv = offs_d
        dv_mask = d_mask
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
        dv_mask = offs_dv < HEAD_DIM_V
    q = tl.load(
        q_ptr + token64[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :] * stride_q_d,
        mask=row_valid[:, None] & d_mask[None, :],
        other=0.0,
    )  # [BLOCK_M, HEAD_DIM_PAD]
    q = upcast(q, UPCAST)
    if USE_SOFTCAP:
        qk_scale = scale / softcap
    else:
        qk_scale = scale * LOG2E
    if QDOT16:
        q, q_factor = q_f16(q)
        qk_scale = qk_scale * q_factor

    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PAD], tl.float32)

    split = tl.program_id(2)
    start = split * keys_per_split
    end = tl.minimum(tl.minimum(prefix_tokens, tl.max(pos, 0) + 1), max_blocks * BLOCK_SIZE)
    end = tl.minimum(end, start + keys_per_split)
    for t0 in range(start, end, BLOCK_N):
        offs_n = t0 + tl.arange(0, BLOCK_N)
        key_in = offs_n < end
        blk = _tile_block_ids(block_table_ptr, t0, start, end, stride_bt_b, BLOCK_SIZE, BLOCK_N)
        key_ok = key_in & block_ok(blk, num_blocks)
        blk = tl.where(key_ok, blk, 0).to(tl.int64)
        vis = visible(key_ok, offs_n, pos, pos, 0, False)
        m_i, l_i, acc = _attend_tile(
            m_i,
            l_i,
            acc,
            q,
            vis,
            blk,
            offs_n % BLOCK_SIZE,
            key_ok,
            kv_head,
            offs_d,
            d_mask,
            offs_dv,
            dv_mask,
            k_cache_ptr,
            v_cache_ptr,
            k_scale_ptr,
            v_scale_ptr,
            qk_scale,
            softcap,
            stride_k_b,
            stride_k_s,
            stride_k_h,
            stride_k_d,
            stride_v_b,
            stride_v_s,
            stride_v_h,
            stride_v_d,
            stride_ks_b,
            stride_ks_s,
            stride_ks_h,
            stride_vs_b,
            stride_vs_s,
            stride_vs_h,
            KV_QUANT,
            USE_SOFTCAP,
            DOT_PRECISION,
            HEAD_DIM=HEAD_DIM,
            HEAD_DIM_PAD=HEAD_DIM_PAD,
            HEAD_DIM_V=HEAD_DIM_V,
            HEAD_DIM_V_PAD=HEAD_DIM_V_PAD,
            BLOCK_SIZE=BLOCK_SIZE,
            QDOT16=QDOT16,
            ASM=not UPCAST,
        )

    _store_partial(
        part_out_ptr + split.to(tl.int64) * stride_po_s,
        part_lse_ptr + split.to(tl.int64) * stride_pl_s,
        m_i,
        l_i,
        acc,
        token64,
        head,
        row_valid,
        offs_dv,
        dv_mask,
        stride_po_t,
        stride_po_h,
        stride_po_d,
        stride_pl_t,
        stride_pl_h,
    )


# --------------------------------------------------------------------------------------------
# Merge: exact combination of partial attention over disjoint key sets.
# --------------------------------------------------------------------------------------------


@triton.jit
def _merge_rows(
    parts_out_ptr,  # [num_parts, num_tokens, num_heads, head_dim], float32 / fp16 / bf16
    parts_lse_ptr,  # [num_parts, num_tokens, num_heads] float32, natural log
    sinks_ptr,  # [num_heads] float32 (HAS_SINKS only), natural-log logit without a value
    out_ptr,  # [num_tokens, num_heads, head_dim], any float dtype
    out_lse_ptr,  # [num_tokens, num_heads] float32 (STORE_LSE only)
    num_parts,
    token,  # [ROWS] int64
    head,  # [ROWS]
    row_valid,  # [ROWS] bool
    offs_d,
    d_mask,
    stride_po_s,
    stride_po_t,
    stride_po_h,
    stride_po_d,
    stride_pl_s,
    stride_pl_t,
    stride_pl_h,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_lse_t,
    stride_lse_h,
    HAS_SINKS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PARTS_CHUNK: tl.constexpr,  # parts loaded (and summed as a tree) per step
):
    """For each (token, head) row: out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s
    (and the sink, if any, in the denominator once).

    Parts are read PARTS_CHUNK at a time, [PARTS_CHUNK, ROWS, head_dim] per load (one memory
    round trip for that many parts instead of one each), summed within a chunk, chunks added in
    order. A row's bits depend only on its own parts: a batch that launched more parts adds
    empty ones (weight exactly 0, in a chunk's tail or in chunks of their own, and adding exact
    zeros changes no bit). That is what makes blocks_per_split mode bit-identical across
    batches. Loads bypass L1 (``.cg``): the parts were written by other programs, and a line
    cached by an earlier launch on this SM would be stale.

    The split kernel's fused merge; ``merge_states_kernel`` below merges one row per one-warp
    program instead (NVIDIA H200, Triton 3.6, 2026-12-01: the cascade's 9 parts x 64 tokens x 32
    heads merged in 0.0049 ms so, 0.0142 through this helper at 4 rows a program).
    """
    offs_p = tl.arange(0, PARTS_CHUNK)
    lse_base = parts_lse_ptr + token * stride_pl_t + head * stride_pl_h  # [ROWS]
    out_base = (
        parts_out_ptr + token[:, None] * stride_po_t + head[:, None] * stride_po_h + offs_d[None, :] * stride_po_d
    )  # [ROWS, HEAD_DIM_PAD]
    o_mask = row_valid[:, None] & d_mask[None, :]

    m = tl.full(token.shape, float("-inf"), tl.float32)
    for s in range(0, num_parts, PARTS_CHUNK):
        part = s + offs_p
        lse = tl.load(
            lse_base[None, :] + part[:, None] * stride_pl_s,
            mask=(part < num_parts)[:, None] & row_valid[None, :],
            other=float("-inf"),
            cache_modifier=".cg",
        )  # [PARTS_CHUNK, ROWS]
        m = tl.maximum(m, tl.max(lse, 0))
    empty = m == float("-inf")
    m_all = m
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0)
        m_all = tl.maximum(m, sink)
    m_safe = tl.where(empty, 0.0, m_all)

    denom = tl.zeros(token.shape, tl.float32)
    acc = tl.zeros(out_base.shape, tl.float32)
    for s in range(0, num_parts, PARTS_CHUNK):
        part = s + offs_p
        in_range = part < num_parts
        w = tl.exp(
            tl.load(
                lse_base[None, :] + part[:, None] * stride_pl_s,
                mask=in_range[:, None] & row_valid[None, :],
                other=float("-inf"),
                cache_modifier=".cg",
            )
            - m_safe[None, :]
        )  # [PARTS_CHUNK, ROWS]
        o = tl.load(
            out_base[None, :, :] + part[:, None, None] * stride_po_s,
            mask=in_range[:, None, None] & o_mask[None, :, :],
            other=0.0,
            cache_modifier=".cg",
        ).to(tl.float32)  # [PARTS_CHUNK, ROWS, HEAD_DIM_PAD]
        denom += tl.sum(w, 0)
        # An empty part may hold anything (a caller's NaN); w == 0 must not let it through. A NaN
        # weight (NaN in this request's inputs) must, so the test is != 0, not > 0.
        acc += tl.sum(tl.where((w != 0.0)[:, :, None], w[:, :, None] * o, 0.0), 0)
    if HAS_SINKS:
        denom += sink_weight(sink, m_safe, LOG2=False)
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, denom))
    tl.store(
        out_ptr + token[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_d[None, :] * stride_o_d,
        (acc * inv[:, None]).to(out_ptr.dtype.element_ty),
        mask=o_mask,
    )
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, denom)))
        tl.store(out_lse_ptr + token * stride_lse_t + head * stride_lse_h, lse, mask=row_valid)


@triton.jit
def merge_states_kernel(
    parts_out_ptr,  # [num_parts, num_tokens, num_heads, head_dim], float32 / fp16 / bf16
    parts_lse_ptr,  # [num_parts, num_tokens, num_heads] float32, natural log
    sinks_ptr,  # [num_heads] float32 (HAS_SINKS only), natural-log logit without a value
    out_ptr,  # [num_tokens, num_heads, head_dim], any float dtype
    out_lse_ptr,  # [num_tokens, num_heads] float32 (STORE_LSE only)
    num_parts,
    stride_po_s,
    stride_po_t,
    stride_po_h,
    stride_po_d,
    stride_pl_s,
    stride_pl_t,
    stride_pl_h,
    stride_o_t,
    stride_o_h,
    stride_o_d,
    stride_lse_t,
    stride_lse_h,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    STORE_LSE: tl.constexpr,
    PARTS_CHUNK: tl.constexpr,  # parts loaded (and summed as a tree) per step; 1: one at a time
):
    """One program: one (token, head); out = sum_s exp(lse_s - lse) out_s, lse = logsumexp_s lse_s.

    The parts are read PARTS_CHUNK at a time (one round trip to memory for that many parts
    instead of one each), summed within a chunk, chunks added in order. The rules are
    :func:`_merge_rows`'s; written through it on one row, this kernel ran slower (9 parts x 64
    tokens x 32 heads: 4.35 vs 4.20 us; NVIDIA H100, Triton 3.6, 2026-12-07,
    docs/results/2026-12-07-h100-quant-decode-configs.txt).
    """
    token = tl.program_id(0).to(tl.int64)
    head = tl.program_id(1)
    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    offs_p = tl.arange(0, PARTS_CHUNK)
    lse_base = parts_lse_ptr + token * stride_pl_t + head * stride_pl_h
    out_base = parts_out_ptr + token * stride_po_t + head * stride_po_h

    m = tl.full([], float("-inf"), tl.float32)
    for s in range(0, num_parts, PARTS_CHUNK):
        part = s + offs_p
        lse = tl.load(lse_base + part * stride_pl_s, mask=part < num_parts, other=float("-inf"))
        m = tl.maximum(m, tl.max(lse, 0))
    empty = m == float("-inf")
    m_all = m
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head)
        m_all = tl.maximum(m, sink)
    m_safe = tl.where(empty, 0.0, m_all)

    # The same sum for a request whatever the number of parts its batch launched: the parts
    # past its own are empty (weight exactly 0, whether in a chunk's tail or in a chunk of
    # their own), and adding exact zeros changes no bit. That is what makes blocks_per_split
    # mode bit-identical across batches.
    denom = tl.zeros([], tl.float32)
    acc = tl.zeros([HEAD_DIM_PAD], tl.float32)
    for s in range(0, num_parts, PARTS_CHUNK):
        part = s + offs_p
        in_range = part < num_parts
        w = tl.exp(tl.load(lse_base + part * stride_pl_s, mask=in_range, other=float("-inf")) - m_safe)
        o = tl.load(
            out_base + part[:, None] * stride_po_s + offs_d[None, :] * stride_po_d,
            mask=in_range[:, None] & d_mask[None, :],
            other=0.0,
        ).to(tl.float32)
        denom += tl.sum(w, 0)
        # An empty part may hold anything (a caller's NaN); w == 0 must not let it through. A NaN
        # weight (NaN in this request's inputs) must, so the test is != 0, not > 0.
        acc += tl.sum(tl.where((w != 0.0)[:, None], w[:, None] * o, 0.0), 0)
    if HAS_SINKS:
        # The sink joins the denominator exactly once, here, after all parts.
        denom += sink_weight(sink, m_safe, LOG2=False)
    inv = tl.where(empty, 0.0, 1.0 / tl.where(empty, 1.0, denom))
    out = acc * inv
    tl.store(
        out_ptr + token * stride_o_t + head * stride_o_h + offs_d * stride_o_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )
    if STORE_LSE:
        lse = tl.where(empty, float("-inf"), m_safe + tl.log(tl.where(empty, 1.0, denom)))
        tl.store(out_lse_ptr + token * stride_lse_t + head * stride_lse_h, lse)
