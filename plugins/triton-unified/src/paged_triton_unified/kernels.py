"""Triton kernels of triton-unified's unified path: one launch per layer for a whole mixed batch.

Only ``@triton.jit`` code lives here, plus the autotuning configs of the kernel right below them;
the rules its tiles share with ``split_kernels.py`` (masks, soft-cap, sinks, 8-bit codes, the
online-softmax step) are :mod:`paged_triton_common.tiles`, and the launcher that checks
arguments and sizes the grid is ``launch.py``.

Vocabulary, for one request of a flattened batch::

    positions   0 . . . . . . . . . . . . . . . . seq_len - 1
                |<------ context_len ------>|<-- query_len -->|
                                             the new tokens: rows query_start_loc[r] ...

Query ``i`` of a request sits at position ``context_len + i`` and sees keys ``0 .. position``
(and with a window ``w > 0`` only keys ``> position - w``). Logical key ``j`` lives in physical
slot ``block_table[r, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE`` of the cache.

Stride names, here and in split_kernels.py: ``stride_<tensor>_<dim>`` with tensors ``q``, ``k``/``v``
(the caches), ``ks``/``vs`` (their scales), ``o`` (out), ``lse``, ``bt`` (block table), ``po``/``pl``
(partial outputs / LSEs) and dims ``t`` (token), ``h`` (head), ``d`` (head dim), ``b`` (cache
block, or block-table column), ``s`` (slot in a block, or split), ``r`` (request).
"""

from __future__ import annotations

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
    softmax_step,
    upcast,
    visible,
)
from paged_triton_common.tuning import replay_bench

__all__ = ["capture_config", "tile_plan_kernel", "unified_attention_kernel"]

# Block ids read per iteration of the check before a tile's unmasked bulk: 1,024 (16 K tokens of
# 16-token blocks) keep a long context's check to a few dependent loads.
ID_CHECK_BLOCKS = tl.constexpr(1024)

# Tilings of one launch (the FUSED constexpr): False, a decode-shaped batch (every request fits
# one small tile): tile r is request r, no tile plan launch and no search; True, both size
# classes in one launch, large tiles first, found through the tile plan's prefix sums.


# --------------------------------------------------------------------------------------------
# Tile plan: which query tiles exist, flattened over the batch.
# --------------------------------------------------------------------------------------------


@triton.jit(do_not_specialize=["num_reqs"])
def tile_plan_kernel(
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    tile_end_small_ptr,  # int32 [num_reqs], out: inclusive prefix sum of small-class tiles
    tile_end_large_ptr,  # int32 [num_reqs], out: inclusive prefix sum of large-class tiles
    num_reqs,
    BLOCK_Q_SMALL: tl.constexpr,
    BLOCK_Q_LARGE: tl.constexpr,
    BLOCK_R: tl.constexpr,
):
    """One program writes, for each size class, the running count of query tiles per request.

    A request with ``query_len <= BLOCK_Q_SMALL`` (a decode, a short verification block) fits in
    one small tile; longer ones go to the large class, so that a long prefill gets
    tensor-core-sized tiles without inflating the tiles of the decodes it is batched with.
    This is a single tiny launch instead of a chain of torch ops (diff, clamp, div, where,
    cumsum), which matters when it is paid once per layer.
    """
    # Loop-carried scalars must be tensors from the start (a Python 0 would be a constexpr).
    carry_small = num_reqs * 0
    carry_large = num_reqs * 0
    for start in range(0, num_reqs, BLOCK_R):
        offs = start + tl.arange(0, BLOCK_R)  # [BLOCK_R]
        in_range = offs < num_reqs
        q_begin = tl.load(query_start_loc_ptr + offs, mask=in_range, other=0)
        q_end = tl.load(query_start_loc_ptr + offs + 1, mask=in_range, other=0)
        # A non-monotone query_start_loc (bad metadata) must not produce negative counts:
        # the binary search in the attention kernel needs a monotone prefix sum.
        q_len = tl.maximum(q_end - q_begin, 0)
        is_large = q_len > BLOCK_Q_SMALL
        n_small = tl.where(is_large, 0, (q_len + BLOCK_Q_SMALL - 1) // BLOCK_Q_SMALL)
        n_large = tl.where(is_large, (q_len + BLOCK_Q_LARGE - 1) // BLOCK_Q_LARGE, 0)
        ends_large = carry_large + tl.cumsum(n_large, 0)
        tl.store(tile_end_large_ptr + offs, ends_large, mask=in_range)
        carry_large += tl.sum(n_large, 0)
        ends_small = carry_small + tl.cumsum(n_small, 0)
        tl.store(tile_end_small_ptr + offs, ends_small, mask=in_range)
        carry_small += tl.sum(n_small, 0)


# --------------------------------------------------------------------------------------------
# Attention.
# --------------------------------------------------------------------------------------------


@triton.jit
def _attend_step(
    acc,  # float32 [BLOCK_M, HEAD_DIM_V_PAD]
    l_i,  # float32 [BLOCK_M]
    m_i,  # float32 [BLOCK_M], running max in log2 units
    q,  # [BLOCK_M, HEAD_DIM_PAD], dot dtype
    start_n,
    q_pos,  # int32 [BLOCK_M]
    key_end,  # the tile's keys are [.., key_end): within the sequence and the table
    window,
    softcap,
    qk_scale,  # scale * log2(e), or scale / softcap when soft-capping (times q's pre-shift)
    num_blocks,
    block_table_row_ptr,  # int32 [max_blocks_per_req], this request's row
    stride_bt_b,
    k_cache_ptr,
    v_cache_ptr,
    k_scale_ptr,
    v_scale_ptr,
    kv_head,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_ks_b,
    stride_ks_s,
    stride_ks_h,
    stride_vs_b,
    stride_vs_s,
    stride_vs_h,
    offs_d,  # [HEAD_DIM_PAD]
    d_mask,  # [HEAD_DIM_PAD]
    offs_dv,  # [HEAD_DIM_V_PAD]: V's head-dim lanes (offs_d when V's head dim is q's)
    dv_mask,  # [HEAD_DIM_V_PAD]
    MASKED: tl.constexpr,  # False: every key of the step is visible to every row and valid (no checks)
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    KV_QUANT: tl.constexpr,
    QDOT16: tl.constexpr,  # quantized cache with 16-bit q: fp16 dots, V scale per tile
    ASM: tl.constexpr,  # code conversion in PTX (the GPU; not the interpreter)
    FOLD_SCALE: tl.constexpr,  # fewer multiplies per score (see unified_attention_kernel)
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D_PADDED: tl.constexpr,  # HEAD_DIM_PAD > HEAD_DIM: d_mask has false lanes
    DV_PADDED: tl.constexpr,  # HEAD_DIM_V_PAD > HEAD_DIM_V: dv_mask has false lanes
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr = 0,  # read only for int4 codes (KV_QUANT 4): the packed lanes
    HEAD_DIM_PAD: tl.constexpr = 0,
    HEAD_DIM_V: tl.constexpr = 0,
    HEAD_DIM_V_PAD: tl.constexpr = 0,
):
    """Fold BLOCK_N keys starting at ``start_n`` into the online softmax state of one tile."""
    offs_n = start_n + tl.arange(0, BLOCK_N)  # [BLOCK_N] logical key positions
    # BLOCK_N may span several cache blocks (or a part of one): gather the physical block per key.
    if MASKED:
        # The tile's keys end at key_end (<= the table's width x BLOCK_SIZE, <= seq_len): a step's
        # keys past it are read at key_end - 1 (a key the sequence holds) and masked through the
        # visibility below. A block id outside the pool is clamped to block 0, so bad metadata never
        # reads outside the cache, and its keys are masked; V is masked by the id alone, since
        # block 0's unwritten slots may hold NaN and 0 * NaN would reach the accumulator (K needs
        # no mask: its scores are selected out).
        offs_a = tl.minimum(offs_n, key_end - 1)
        block = tl.load(block_table_row_ptr + (offs_a // BLOCK_SIZE) * stride_bt_b)
        key_ok = block_ok(block, num_blocks)  # [BLOCK_N]
        block = tl.where(key_ok, block, 0)
        v_mask = key_ok[:, None] & dv_mask[None, :]
    else:
        # Unmasked: every key lies in the table and the sequence, and its block id was checked
        # before the loop (see _tile_program), so there is nothing to mask but padded lanes of d.
        offs_a = offs_n
        block = tl.load(block_table_row_ptr + (offs_a // BLOCK_SIZE) * stride_bt_b)
        v_mask = dv_mask[None, :]
    # int64: phys_block * stride_k_b exceeds 2**31 for caches over 2 G elements.
    block = block.to(tl.int64)
    in_block = (offs_a % BLOCK_SIZE).to(tl.int64)
    MASK_V: tl.constexpr = MASKED or DV_PADDED
    INT4: tl.constexpr = KV_QUANT >= 4  # int4 codes, two per byte
    K_PER_CHANNEL: tl.constexpr = KV_QUANT == 5  # kivi4: key scales per (block, KV head, channel)
    FP8: tl.constexpr = KV_QUANT - 1 if KV_QUANT == 2 else (2 if KV_QUANT == 3 else 0)  # codes_to's format

    # K^T: [HEAD_DIM_PAD, BLOCK_N]; padded lanes of d masked to 0 (uninitialised memory may hold NaN).
    k_offs = block * stride_k_b + in_block * stride_k_s + kv_head * stride_k_h  # [BLOCK_N]
    if INT4:
        offs_h = tl.arange(0, HEAD_DIM_PAD // 2)
        kp = tl.load(
            k_cache_ptr + k_offs[:, None] + offs_h[None, :], mask=(offs_h < HEAD_DIM // 2)[None, :], other=0
        )  # [BLOCK_N, HEAD_DIM_PAD // 2] bytes
        if K_PER_CHANNEL:
            k = kivi4_keys(
                kp, k_scale_ptr, block, kv_head, stride_ks_b, stride_ks_h, offs_d, d_mask, QDOT16, ASM, BLOCK_SIZE
            )
            k = tl.trans(k.to(q.dtype))
        elif QDOT16:
            k = tl.trans(int4_f16(kp, ASM))
        else:
            k = tl.trans(int4_codes(kp))
    elif D_PADDED:
        k = tl.load(k_cache_ptr + k_offs[None, :] + offs_d[:, None], mask=d_mask[:, None], other=0)
    else:
        k = tl.load(k_cache_ptr + k_offs[None, :] + offs_d[:, None])
    if INT4:
        pass  # converted above (kivi4: dequantized there, one scale per block and channel)
    elif QDOT16:
        k = codes8_f16(k, FP8, ASM, STAGED=False)
    elif not QDOT16:
        # Quantized codes are exact in the dot dtype; their per-key scale is applied to the
        # [BLOCK_M, BLOCK_N] scores instead of to every element of K. (int4_f16: already fp16.)
        k = codes_to(k, q.dtype, FP8)

    qk = tl.dot(q, k, input_precision=DOT_PRECISION)  # [BLOCK_M, BLOCK_N] float32
    # RAW: the scores stay unscaled and qk_scale moves into the exponent below, where
    # s * qk_scale - m is one FFMA (instead of a multiply here plus a subtraction there).
    RAW: tl.constexpr = FOLD_SCALE and KV_QUANT == 0 and not USE_SOFTCAP
    k_sc = 1.0  # read only for per-key scales
    if KV_QUANT != 0 and not K_PER_CHANNEL:
        ks_offs = block * stride_ks_b + in_block * stride_ks_s + kv_head * stride_ks_h
        k_sc = tl.load(k_scale_ptr + ks_offs)  # [BLOCK_N] float32; a masked key's score is selected out
    s = log2_scores(qk, k_sc, qk_scale, softcap, KV_QUANT != 0 and not K_PER_CHANNEL, USE_SOFTCAP, RAW)

    if MASKED:
        q_lim = tl.minimum(q_pos, key_end - 1)  # [BLOCK_M] the last key each row sees
        s = tl.where(visible(key_ok, offs_n, q_lim, q_pos, window, USE_WINDOW), s, float("-inf"))

    # RAW: FOLD_SCALE only for scale > 0, so max(s) * qk_scale is the max of the scaled scores
    # (and -inf stays -inf). Unmasked, every score is finite and so is the max.
    p, alpha, l_i, m_new = softmax_step(s, m_i, l_i, qk_scale, MAY_BE_EMPTY=MASKED, RAW=RAW)

    # V: [BLOCK_N, HEAD_DIM_V_PAD]
    v_offs = block * stride_v_b + in_block * stride_v_s + kv_head * stride_v_h
    if INT4:
        offs_hv = tl.arange(0, HEAD_DIM_V_PAD // 2)
        hv_mask = (offs_hv < HEAD_DIM_V // 2)[None, :]
        if MASKED:
            hv_mask = hv_mask & key_ok[:, None]
        vp = tl.load(v_cache_ptr + v_offs[:, None] + offs_hv[None, :], mask=hv_mask, other=0)
        if QDOT16:
            v = int4_f16(vp, ASM)
        else:
            v = codes_to(int4_codes(vp), q.dtype, 0)
    else:
        if MASK_V:
            v = tl.load(v_cache_ptr + v_offs[:, None] + offs_dv[None, :], mask=v_mask, other=0)
        else:
            v = tl.load(v_cache_ptr + v_offs[:, None] + offs_dv[None, :])
        if QDOT16:
            v = codes8_f16(v, FP8, ASM, STAGED=True)
        else:
            v = codes_to(v, q.dtype, FP8)
    v_sc = 1.0  # read only for a quantized cache
    if KV_QUANT != 0:
        vs_offs = block * stride_vs_b + in_block * stride_vs_s + kv_head * stride_vs_h
        if MASKED:
            v_sc = tl.load(v_scale_ptr + vs_offs, mask=key_ok, other=0.0)  # [BLOCK_N]
        else:
            v_sc = tl.load(v_scale_ptr + vs_offs)
    acc = pv_step(acc, alpha, p, v, v_sc, q.dtype, KV_QUANT != 0, QDOT16, DOT_PRECISION)
    return acc, l_i, m_new


@triton.jit
def _tile_program(
    tile,  # index of this program's tile within its size class
    kv_head,
    q_ptr, k_cache_ptr, v_cache_ptr, out_ptr, k_scale_ptr, v_scale_ptr, sinks_ptr, lse_ptr,
    query_start_loc_ptr, seq_lens_ptr, block_table_ptr, tile_end_ptr,
    num_tokens, num_reqs, num_blocks, max_blocks_per_req, scale, softcap, window,
    stride_q_t, stride_q_h,
    stride_k_b, stride_k_s, stride_k_h, stride_v_b, stride_v_s, stride_v_h,
    stride_ks_b, stride_ks_s, stride_ks_h, stride_vs_b, stride_vs_s, stride_vs_h,
    stride_o_t, stride_o_h, stride_lse_t, stride_lse_h, stride_bt_r, stride_bt_b,
    GROUP: tl.constexpr, GROUP_PAD: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_PAD: tl.constexpr,
    HEAD_DIM_V: tl.constexpr, HEAD_DIM_V_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr, BLOCK_Q: tl.constexpr, BLOCK_N: tl.constexpr,
    FROM_PLAN: tl.constexpr,  # False: tile == request (every request fits one tile)
    KV_QUANT: tl.constexpr, QDOT16: tl.constexpr, FOLD_SCALE: tl.constexpr,
    USE_WINDOW: tl.constexpr, USE_SOFTCAP: tl.constexpr, HAS_SINKS: tl.constexpr, HAS_LSE: tl.constexpr,
    UPCAST: tl.constexpr, DOT_PRECISION: tl.constexpr,
):  # fmt: skip
    """BLOCK_Q query tokens of one request x the GROUP query heads of one KV head.

    No early ``return`` here: in a fused launch this runs inside a branch, and a callee with
    several exits could not be inlined into it. A tile past the batch runs empty loops and
    masked stores instead.
    """
    if FROM_PLAN:
        # Find the request owning this tile: the first r with tile_end[r] > tile.
        lo = num_reqs * 0
        hi = num_reqs
        while lo < hi:
            mid = (lo + hi) // 2
            after = tl.load(tile_end_ptr + mid) > tile
            hi = tl.where(after, mid, hi)
            lo = tl.where(after, lo, mid + 1)
        in_batch = lo < num_reqs  # False: past the batch's last tile
        req = tl.minimum(lo, num_reqs - 1)
        tile_begin = tl.load(tile_end_ptr + req - 1, mask=req > 0, other=0)
        local_tile = tile - tile_begin
    else:
        in_batch = tile < num_reqs
        req = tile
        local_tile = tile * 0

    q_begin = tl.load(query_start_loc_ptr + req)
    q_len = tl.load(query_start_loc_ptr + req + 1) - q_begin
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - q_len
    tile_ok = in_batch & (local_tile * BLOCK_Q < q_len)

    offs_m = tl.arange(0, BLOCK_Q * GROUP_PAD)  # [BLOCK_M], BLOCK_M = BLOCK_Q * GROUP_PAD
    q_idx = local_tile * BLOCK_Q + offs_m // GROUP_PAD  # query index within the request
    head_in_group = offs_m % GROUP_PAD
    head = kv_head * GROUP + head_in_group  # [BLOCK_M] query head of each row
    token = q_begin + q_idx  # [BLOCK_M] row of q / out
    # A tile past the batch gets no rows (a where, not `scalar & tensor`: the interpreter
    # cannot mask with the result of the latter).
    rows_len = tl.where(tile_ok, q_len, 0)
    row_ok = (q_idx < rows_len) & (head_in_group < GROUP) & (token >= 0) & (token < num_tokens)
    q_pos = context_len + q_idx  # [BLOCK_M] position of each row's query

    offs_d = tl.arange(0, HEAD_DIM_PAD)
    d_mask = offs_d < HEAD_DIM
    # V, the accumulator and the output have V's head dim (MLA-shaped layers): q's lanes
    # themselves when the dims are equal.
    if HEAD_DIM_V == HEAD_DIM:
        offs_dv = offs_d
        dv_mask = d_mask
    else:
        offs_dv = tl.arange(0, HEAD_DIM_V_PAD)
        dv_mask = offs_dv < HEAD_DIM_V
    token64 = token.to(tl.int64)
    q_offs = token64[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :]
    q = upcast(tl.load(q_ptr + q_offs, mask=row_ok[:, None] & d_mask[None, :], other=0.0), UPCAST)

    if USE_SOFTCAP:
        qk_scale = scale / softcap
    else:
        qk_scale = scale * LOG2E
    if QDOT16:
        # Quantized caches run their dots in fp16: their codes convert to fp16 in a few integer
        # instructions (to bf16 they do not); q is brought into fp16's range exactly.
        q, q_factor = q_f16(q)
        qk_scale = qk_scale * q_factor

    # Key range of the tile. Visible to some row: [lo_key, last_pos]; visible to every row
    # without any mask: [full_lo, first_pos]. Steps are aligned to multiples of BLOCK_N so a
    # row's arithmetic does not depend on which tile it landed in (batch invariance).
    first_pos = context_len + local_tile * BLOCK_Q
    last_pos = context_len + tl.minimum((local_tile + 1) * BLOCK_Q, q_len) - 1
    key_end = tl.minimum(last_pos + 1, max_blocks_per_req * BLOCK_SIZE)
    key_end = tl.where(tile_ok, key_end, 0)  # no keys for a tile past the batch
    if USE_WINDOW:
        lo_key = tl.maximum(first_pos - window + 1, 0)
        full_lo = tl.maximum(last_pos - window + 1, 0)
    else:
        lo_key = first_pos * 0
        full_lo = first_pos * 0
    start = (lo_key // BLOCK_N) * BLOCK_N
    full_begin = tl.cdiv(full_lo, BLOCK_N) * BLOCK_N
    full_end = tl.minimum((first_pos + 1) // BLOCK_N * BLOCK_N, key_end // BLOCK_N * BLOCK_N)
    bt_row_ptr = block_table_ptr + req.to(tl.int64) * stride_bt_r
    # The bulk runs unmasked, so its block ids are checked here, once per tile: the ids of
    # [full_begin, full_end) lie in the table (full_end <= key_end), and the tile reads them again
    # in its loop, from L1/L2. One id outside the pool and the whole range runs masked (its keys
    # then drop out, as documented), with bitwise the same results on the valid keys.
    first_block = full_begin // BLOCK_SIZE
    end_block = tl.cdiv(full_end, BLOCK_SIZE)
    bad_ids = first_block * 0
    for b0 in range(first_block, end_block, ID_CHECK_BLOCKS):
        lb = b0 + tl.arange(0, ID_CHECK_BLOCKS)
        ids = tl.load(bt_row_ptr + lb * stride_bt_b, mask=lb < end_block, other=0)
        bad_ids += tl.sum(((ids < 0) | (ids >= num_blocks)).to(tl.int32), 0)
    if (full_begin >= full_end) | (bad_ids > 0):
        full_begin = start
        full_end = start

    m_i = tl.full([BLOCK_Q * GROUP_PAD], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_Q * GROUP_PAD], tl.float32)
    acc = tl.zeros([BLOCK_Q * GROUP_PAD, HEAD_DIM_V_PAD], tl.float32)

    # Three key ranges, one loop each; static_range unrolls them, so each compiles with its own
    # MASKED: the leading window edge (masked), the bulk of the context (no causal or window mask
    # to compute, no id to check), the causal diagonal (masked).
    for part in tl.static_range(3):
        if part == 0:
            lo = start
            hi = full_begin
        elif part == 1:
            lo = full_begin
            hi = full_end
        else:
            lo = full_end
            hi = key_end
        for start_n in range(lo, hi, BLOCK_N):
            acc, l_i, m_i = _attend_step(
                acc=acc, l_i=l_i, m_i=m_i, q=q, start_n=start_n, q_pos=q_pos, key_end=key_end, window=window,
                softcap=softcap, qk_scale=qk_scale, num_blocks=num_blocks,
                block_table_row_ptr=bt_row_ptr, stride_bt_b=stride_bt_b,
                k_cache_ptr=k_cache_ptr, v_cache_ptr=v_cache_ptr, k_scale_ptr=k_scale_ptr, v_scale_ptr=v_scale_ptr,
                kv_head=kv_head,
                stride_k_b=stride_k_b, stride_k_s=stride_k_s, stride_k_h=stride_k_h,
                stride_v_b=stride_v_b, stride_v_s=stride_v_s, stride_v_h=stride_v_h,
                stride_ks_b=stride_ks_b, stride_ks_s=stride_ks_s, stride_ks_h=stride_ks_h,
                stride_vs_b=stride_vs_b, stride_vs_s=stride_vs_s, stride_vs_h=stride_vs_h,
                offs_d=offs_d, d_mask=d_mask, offs_dv=offs_dv, dv_mask=dv_mask,
                MASKED=part != 1, USE_WINDOW=USE_WINDOW, USE_SOFTCAP=USE_SOFTCAP, KV_QUANT=KV_QUANT,
                QDOT16=QDOT16, ASM=not UPCAST, FOLD_SCALE=FOLD_SCALE, BLOCK_SIZE=BLOCK_SIZE, BLOCK_N=BLOCK_N,
                D_PADDED=HEAD_DIM_PAD != HEAD_DIM, DV_PADDED=HEAD_DIM_V_PAD != HEAD_DIM_V,
                DOT_PRECISION=DOT_PRECISION, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
                HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD,
            )  # fmt: skip

    # l == 0 exactly when the row saw no visible key (otherwise its max key adds exp2(~0) ~ 1):
    # such rows (padding requests) write zeros and lse = -inf, sinks or not.
    seen = l_i > 0.0
    if HAS_SINKS:
        m_i, l_i, acc = fold_sink(m_i, l_i, acc, sinks_ptr, head, row_ok, seen)
    l_safe = tl.where(seen, l_i, 1.0)
    o = acc / l_safe[:, None]  # rows never seen: acc == 0, so exact zeros
    o_offs = token64[:, None] * stride_o_t + head[:, None] * stride_o_h + offs_dv[None, :]
    tl.store(out_ptr + o_offs, o.to(out_ptr.dtype.element_ty), mask=row_ok[:, None] & dv_mask[None, :])
    if HAS_LSE:
        lse = natural_lse(m_i, l_safe, seen)
        tl.store(lse_ptr + token64 * stride_lse_t + head * stride_lse_h, lse, mask=row_ok)


# ============================================================================================
# The attention kernel: its autotuning space, then the kernel.
# ============================================================================================

# The one config run under TRITON_INTERPRET=1. BLOCK_N = 32 spans two 16-token cache blocks and
# half of a 64-token block, so the tests cover both sides of the block-table gather.
INTERPRET_CONFIG = {"BLOCK_N": 32, "num_warps": 4, "num_stages": 1}


def _attention_configs():
    """The GPU search space; ``keep`` narrows it per shape class at launch time."""
    if INTERPRET:
        return [
            triton.Config(
                {"BLOCK_N": INTERPRET_CONFIG["BLOCK_N"]},
                num_warps=INTERPRET_CONFIG["num_warps"],
                num_stages=INTERPRET_CONFIG["num_stages"],
            )
        ]
    configs = []
    for block_n in (16, 32, 64, 128):
        for num_warps in (2, 4, 8):
            for num_stages in (1, 2, 3, 4):
                configs.append(triton.Config({"BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages))
    for block_n, num_warps, num_stages, maxnreg in sorted(_PREFILL_CAPPED):
        configs.append(triton.Config({"BLOCK_N": block_n}, num_warps=num_warps, num_stages=num_stages, maxnreg=maxnreg))
    return configs


# (BLOCK_N, num_warps, num_stages) per shape class, about eight each: the tuning cost is paid
# on the first call of every class. Decode tiles (16-32 rows) are bandwidth-bound: wide key steps
# and deep pipelines keep enough bytes in flight (H200, decode 64 x 4096 bf16: 128/4w/2st 0.269 ms,
# 64/2w/2st 0.276, 32/4w/2st 0.293). Prefill tiles (64-128 rows) are compute-bound: more warps
# for the larger MMA, fewer stages because each stage holds larger K/V tiles. A config that wins
# only some batch sizes (64 keys / 2 warps / 2 stages: best on 64 x 4096, 24-41 % slower on
# batches of fewer programs) stays in the space: the autotune key holds the occupancy class
# (programs per SM, see launch.py), so each batch size keeps its own choice. Quantized caches
# convert codes on the way to the MMA (142-176 registers a thread at 4 warps): two warps a
# program fit five on an SM, and a third stage pays there (NVIDIA H100, Triton 3.6, decode
# 64 x 4,096 autotuned: int8 0.2312 -> 0.2215 ms, kivi4 0.2832 -> 0.2704 with 64/2/3 in the space;
# docs/results/2026-12-07-h100-quant-decode-configs.txt).
_DECODE_CONFIGS = {
    (32, 4, 3),
    (64, 2, 2),
    (64, 2, 3),
    (64, 4, 2),
    (64, 4, 3),
    (64, 4, 4),
    (128, 4, 2),
    (128, 4, 3),
    (128, 8, 2),
}
_PREFILL_CONFIGS = {
    (32, 4, 3),
    (64, 4, 2),
    (64, 4, 3),
    (64, 8, 2),
    (64, 8, 3),
    (128, 8, 2),
    (128, 8, 3),
    (32, 8, 3),
}


# Register caps (maxnreg) that fit a second 8-warp CTA of the 128-row prefill tile on an SM,
# (BLOCK_N, num_warps, num_stages, maxnreg). Only at head dim 128 with 16-bit K/V: elsewhere, and
# for 8-bit caches, the capped tiles spill in their loops (scripts/kernel_resources.py --configs
# 32/8/3/128,... shows it offline). NVIDIA H200, Triton 3.6, CUDA-graph replays: prefill
# 8 x 2,048 causal 0.9451 ms without them, 0.7759 ms (354 TFLOP/s) with them.
_PREFILL_CAPPED = {(32, 8, 3, 128), (64, 8, 2, 128)}
# Where the capped configs run, a prefill class times them and two uncapped configs, 64/8/2 (the
# default without autotuning) and 64/4/2 (the best of the 64-row tiles), and nothing else: a
# config that never wins only lengthens every first call. NVIDIA H200, Triton 3.6, every config of
# ten 128-row classes timed (scripts/first_call.py --timings): 64/8/2/128 fastest in all ten, the
# best uncapped config 1.18-1.40 x its time.
_PREFILL_WITH_CAPS = {(64, 4, 2), (64, 8, 2)}


def keep(config, block_m, head_dim_pad, kv_quant=0):
    """Whether ``config`` is worth timing for a tile of ``block_m`` rows, a padded head dim and a
    cache format (``kv_quant``: 0 values, 1 int8, 2 fp8 codes)."""
    sig = (config.kwargs["BLOCK_N"], config.num_warps, config.num_stages)
    if config.maxnreg is not None:
        return block_m > 32 and kv_quant == 0 and head_dim_pad == 128 and (*sig, config.maxnreg) in _PREFILL_CAPPED
    if block_m <= 32:
        allowed = _DECODE_CONFIGS
    elif kv_quant == 0 and head_dim_pad == 128:  # where the capped configs run
        allowed = _PREFILL_WITH_CAPS
    else:
        allowed = _PREFILL_CONFIGS
    if sig not in allowed:
        return False
    # Head dim 256 doubles every tile: 128-key steps with 3+ stages overflow shared memory.
    if head_dim_pad >= 256 and config.kwargs["BLOCK_N"] * config.num_stages > 192:
        return False
    return True


# The configs PAGED_AUTOTUNE=0 runs: one per shape class.
_DEFAULT_DECODE = (128, 4, 2)
_DEFAULT_PREFILL = (64, 8, 2)


def _prune(configs, named_args, **kwargs):
    args = {**named_args, **kwargs}
    # A fused launch is timed by its large tiles (compute-bound prefill); its small tiles run
    # with BLOCK_N_SMALL from the launcher.
    block_q = args["BLOCK_Q_LARGE"] if args["FUSED"] else args["BLOCK_Q"]
    block_m = block_q * args["GROUP_PAD"]
    # The wider of the K and V tiles sizes the shared memory (V's head dim may differ).
    width = max(args["HEAD_DIM_PAD"], args["HEAD_DIM_V_PAD"])
    kept = [c for c in configs if keep(c, block_m, width, args["KV_QUANT"])]
    if args["FUSED"] and width >= 256:
        # Both classes' pipelined K/V buffers share the launch's shared memory.
        kept = [c for c in kept if c.num_stages <= 2]
    if not AUTOTUNE:
        kept = _default_of(kept, block_m)
    return kept or configs[:1]


def _default_of(configs, block_m):
    default = _DEFAULT_DECODE if block_m <= 32 else _DEFAULT_PREFILL
    return [
        c for c in configs if (c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) == default and c.maxnreg is None
    ] or configs[:1]


def capture_config(named_args):
    """The config compiled without timing when a CUDA-graph capture meets a new key (nothing
    can be benchmarked there): the one PAGED_AUTOTUNE=0 runs for this shape class."""
    configs = unified_attention_kernel.configs
    kept = _prune(configs, named_args)
    if AUTOTUNE:
        args = named_args
        block_m = (args["BLOCK_Q_LARGE"] if args["FUSED"] else args["BLOCK_Q"]) * args["GROUP_PAD"]
        kept = _default_of(kept, block_m)
    return kept[0]


@triton.autotune(
    configs=_attention_configs(),
    # The tile shape, the cache layout, the KV format, the code path and how many programs each
    # SM gets decide the best config; tensor dtypes are added to the key by the autotuner
    # itself. Request counts and lengths are not in the key (each new value would re-tune), only
    # the occupancy class (1, 2, 4 or 8+ programs per SM): 2 warps per program win when every SM
    # has 4 programs and lose a third when it has 1. "Decode-only" is not either: BLOCK_Q
    # already separates decode-shaped tiles from prefill tiles. (So a request's result may
    # differ in rounding between batches of different classes: this kernel does not claim batch
    # invariance; the split kernel's batch_invariant mode (split_kernels.py) does.)
    key=[
        "BLOCK_Q",
        "BLOCK_Q_LARGE",
        "FUSED",
        "GROUP_PAD",
        "HEAD_DIM_PAD",
        "HEAD_DIM_V_PAD",
        "BLOCK_SIZE",
        "KV_QUANT",
        "QDOT16",
        "FOLD_SCALE",
        "occupancy",
    ],
    prune_configs_by={"early_config_prune": _prune},
    # Tuned choices persist next to the compiled kernels (TRITON_CACHE_DIR): a later process
    # does not time a shape class again, and a first call inside a CUDA-graph capture uses them.
    cache_results=True,
    # Configs are timed as CUDA-graph replays: Triton's launch path is slower than a decode tile.
    do_bench=replay_bench,
)
# Batch-dependent ints would otherwise be specialised (== 1, divisible by 16) and recompile the
# kernel for each combination as batches change; none of them feeds address alignment.
@triton.jit(
    do_not_specialize=["num_tokens", "num_reqs", "num_blocks", "max_blocks_per_req", "num_large_tiles", "occupancy"]
)
def unified_attention_kernel(
    q_ptr,  # [num_tokens, num_q_heads, HEAD_DIM], last dim contiguous
    k_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM], last dim contiguous
    v_cache_ptr,  # [num_blocks, BLOCK_SIZE, num_kv_heads, HEAD_DIM_V], last dim contiguous
    out_ptr,  # [num_tokens, num_q_heads, HEAD_DIM_V], q's dtype, last dim contiguous
    k_scale_ptr,  # float32 [num_blocks, BLOCK_SIZE, num_kv_heads] (read only if KV_QUANT)
    v_scale_ptr,  # float32 [num_blocks, BLOCK_SIZE, num_kv_heads] (read only if KV_QUANT)
    sinks_ptr,  # float32 [num_q_heads] (read only if HAS_SINKS)
    lse_ptr,  # float32 [num_tokens, num_q_heads] (written only if HAS_LSE)
    query_start_loc_ptr,  # int32 [num_reqs + 1]
    seq_lens_ptr,  # int32 [num_reqs]
    block_table_ptr,  # int32 [num_reqs, max_blocks_per_req]
    tile_end_ptr,  # int32 [num_reqs], inclusive prefix sum of small tiles per request (read only if FUSED)
    tile_end_large_ptr,  # int32 [num_reqs], the same for large tiles (read only if FUSED)
    num_tokens,
    num_reqs,
    num_blocks,
    max_blocks_per_req,
    num_kv_heads,  # read only if FUSED (its grid is flat)
    num_large_tiles,  # FUSED: upper bound on the large tiles; the first programs take them
    occupancy,  # programs per SM class (1, 2, 4, 8): only the autotune key reads it
    scale,
    softcap,
    window,
    stride_q_t,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_v_b,
    stride_v_s,
    stride_v_h,
    stride_ks_b,
    stride_ks_s,
    stride_ks_h,
    stride_vs_b,
    stride_vs_s,
    stride_vs_h,
    stride_o_t,
    stride_o_h,
    stride_lse_t,
    stride_lse_h,
    stride_bt_r,
    stride_bt_b,
    GROUP: tl.constexpr,  # query heads per KV head
    GROUP_PAD: tl.constexpr,  # next power of two of GROUP
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,  # next power of two of HEAD_DIM
    HEAD_DIM_V: tl.constexpr,  # V's and the output's head dim (HEAD_DIM but in MLA-shaped layers)
    HEAD_DIM_V_PAD: tl.constexpr,  # next power of two of HEAD_DIM_V
    BLOCK_SIZE: tl.constexpr,  # tokens per cache block
    BLOCK_Q: tl.constexpr,  # query tokens per (small) tile; BLOCK_Q * GROUP_PAD rows
    BLOCK_Q_LARGE: tl.constexpr,  # query tokens per large tile (FUSED only)
    BLOCK_N_SMALL: tl.constexpr,  # keys per step of the small tiles (FUSED only)
    FUSED: tl.constexpr,  # both size classes (see the tilings above); False: tile r is request r
    KV_QUANT: tl.constexpr,  # 0: cache in q's dtype, 1: int8 codes, 2/3: fp8 e4m3/e5m2 codes (as uint8),
    # 4: int4 codes, 5: kivi4 (int4 codes, key scales per block and channel: k_scale [.., head_dim])
    QDOT16: tl.constexpr,  # quantized cache with 16-bit q: both dots in fp16 (tiles.q_f16)
    FOLD_SCALE: tl.constexpr,  # scale > 0: qk_scale folded into the exp2 FFMA (see _attend_step)
    USE_WINDOW: tl.constexpr,
    USE_SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
    HAS_LSE: tl.constexpr,
    UPCAST: tl.constexpr,  # compute in float32 (the interpreter mishandles raw bf16 arithmetic)
    DOT_PRECISION: tl.constexpr,  # "ieee" for float32 operands, so fp32 stays exact on the GPU
    BLOCK_N: tl.constexpr,  # keys per loop step (of the large tiles if FUSED); autotuned
):
    """One program: a tile of query tokens of one request x all GROUP query heads of one KV head.

    Not FUSED: grid (requests, kv heads), one small tile per request (BLOCK_Q). FUSED: a flat
    grid, KV head fastest, so that the large tiles of every head are scheduled before any small
    one: the first ``num_large_tiles * num_kv_heads`` programs take the large tiles (heaviest
    first: the last tiles of a causal prefill see the most keys, and running them early evens out
    the tail of the launch; the empty programs of the over-sized grid exit at once), the rest the
    small ones. Both tile shapes are constexpr, so each class compiles its own loop; one launch
    means the decode tiles fill the SMs that the prefill tail leaves idle instead of waiting
    behind it in a second launch.

    FOLD_SCALE (scale > 0) moves the softmax scale into the exp2 argument: one FFMA per score
    instead of a multiply and a subtraction. The unfolded path stays for correctness: with
    scale <= 0, max(s) * scale is not the max of the scaled scores.
    """
    tl.static_assert(BLOCK_Q * GROUP_PAD >= 16, "tl.dot needs at least 16 rows")
    tl.static_assert(BLOCK_N >= 16, "tl.dot needs at least 16 keys")
    tl.static_assert(HEAD_DIM_PAD >= HEAD_DIM)
    tl.static_assert(HEAD_DIM_V_PAD >= HEAD_DIM_V)

    if FUSED:
        tl.static_assert(BLOCK_N_SMALL >= 16, "tl.dot needs at least 16 keys")
        kv_head = tl.program_id(0) % num_kv_heads
        t = tl.program_id(0) // num_kv_heads
    else:
        kv_head = tl.program_id(1)
        t = tl.num_programs(0) - 1 - tl.program_id(0)
    # The large tiles exist only in a fused launch: its first num_large_tiles tile indices,
    # heaviest first; the small tiles follow. Not FUSED, `large` is a constexpr False and only the
    # second call compiles. (One call in a static_range over the two classes, each behind its own
    # `if`, compiled to another schedule: 176 instead of 152 spilled bytes at 32/4/3, offline.)
    if FUSED:
        large = t < num_large_tiles
    else:
        large = False
    if large:
        _tile_program(
            tile=num_large_tiles - 1 - t, tile_end_ptr=tile_end_large_ptr, BLOCK_Q=BLOCK_Q_LARGE, BLOCK_N=BLOCK_N,
            FROM_PLAN=True,
            kv_head=kv_head,
            q_ptr=q_ptr, k_cache_ptr=k_cache_ptr, v_cache_ptr=v_cache_ptr, out_ptr=out_ptr,
            k_scale_ptr=k_scale_ptr, v_scale_ptr=v_scale_ptr, sinks_ptr=sinks_ptr, lse_ptr=lse_ptr,
            query_start_loc_ptr=query_start_loc_ptr, seq_lens_ptr=seq_lens_ptr, block_table_ptr=block_table_ptr,
            num_tokens=num_tokens, num_reqs=num_reqs, num_blocks=num_blocks,
            max_blocks_per_req=max_blocks_per_req, scale=scale, softcap=softcap, window=window,
            stride_q_t=stride_q_t, stride_q_h=stride_q_h,
            stride_k_b=stride_k_b, stride_k_s=stride_k_s, stride_k_h=stride_k_h,
            stride_v_b=stride_v_b, stride_v_s=stride_v_s, stride_v_h=stride_v_h,
            stride_ks_b=stride_ks_b, stride_ks_s=stride_ks_s, stride_ks_h=stride_ks_h,
            stride_vs_b=stride_vs_b, stride_vs_s=stride_vs_s, stride_vs_h=stride_vs_h,
            stride_o_t=stride_o_t, stride_o_h=stride_o_h, stride_lse_t=stride_lse_t, stride_lse_h=stride_lse_h,
            stride_bt_r=stride_bt_r, stride_bt_b=stride_bt_b,
            GROUP=GROUP, GROUP_PAD=GROUP_PAD, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
            HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_SIZE=BLOCK_SIZE, KV_QUANT=KV_QUANT,
            QDOT16=QDOT16, FOLD_SCALE=FOLD_SCALE,
            USE_WINDOW=USE_WINDOW, USE_SOFTCAP=USE_SOFTCAP, HAS_SINKS=HAS_SINKS, HAS_LSE=HAS_LSE,
            UPCAST=UPCAST, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
    else:
        _tile_program(
            tile=t - num_large_tiles if FUSED else t, tile_end_ptr=tile_end_ptr, BLOCK_Q=BLOCK_Q,
            BLOCK_N=BLOCK_N_SMALL if FUSED else BLOCK_N, FROM_PLAN=FUSED,
            kv_head=kv_head,
            q_ptr=q_ptr, k_cache_ptr=k_cache_ptr, v_cache_ptr=v_cache_ptr, out_ptr=out_ptr,
            k_scale_ptr=k_scale_ptr, v_scale_ptr=v_scale_ptr, sinks_ptr=sinks_ptr, lse_ptr=lse_ptr,
            query_start_loc_ptr=query_start_loc_ptr, seq_lens_ptr=seq_lens_ptr, block_table_ptr=block_table_ptr,
            num_tokens=num_tokens, num_reqs=num_reqs, num_blocks=num_blocks,
            max_blocks_per_req=max_blocks_per_req, scale=scale, softcap=softcap, window=window,
            stride_q_t=stride_q_t, stride_q_h=stride_q_h,
            stride_k_b=stride_k_b, stride_k_s=stride_k_s, stride_k_h=stride_k_h,
            stride_v_b=stride_v_b, stride_v_s=stride_v_s, stride_v_h=stride_v_h,
            stride_ks_b=stride_ks_b, stride_ks_s=stride_ks_s, stride_ks_h=stride_ks_h,
            stride_vs_b=stride_vs_b, stride_vs_s=stride_vs_s, stride_vs_h=stride_vs_h,
            stride_o_t=stride_o_t, stride_o_h=stride_o_h, stride_lse_t=stride_lse_t, stride_lse_h=stride_lse_h,
            stride_bt_r=stride_bt_r, stride_bt_b=stride_bt_b,
            GROUP=GROUP, GROUP_PAD=GROUP_PAD, HEAD_DIM=HEAD_DIM, HEAD_DIM_PAD=HEAD_DIM_PAD,
            HEAD_DIM_V=HEAD_DIM_V, HEAD_DIM_V_PAD=HEAD_DIM_V_PAD, BLOCK_SIZE=BLOCK_SIZE, KV_QUANT=KV_QUANT,
            QDOT16=QDOT16, FOLD_SCALE=FOLD_SCALE,
            USE_WINDOW=USE_WINDOW, USE_SOFTCAP=USE_SOFTCAP, HAS_SINKS=HAS_SINKS, HAS_LSE=HAS_LSE,
            UPCAST=UPCAST, DOT_PRECISION=DOT_PRECISION,
        )  # fmt: skip
