"""How fast a plain Triton flash-attention tile runs a causal prefill on this GPU, by how K/V are loaded.

A measuring instrument, not a backend: one minimal forward kernel (BLOCK_M rows per program,
online softmax, a causal diagonal masked in its own loop, nothing else) whose K/V loads come from

* ``paged``: the block table, one pointer per key (the gathers triton-unified runs);
* ``affine``: the same keys laid out contiguously, addressed by arithmetic (no table);
* ``tma``: the contiguous copy through a tensor descriptor (TMA copies, no pointer tiles);
* ``tma-ws``: the same with the key loop warp-specialised (producer and consumer warps);
* ``paged-tma``: a paged cache of 64-token blocks through a descriptor over the whole pool, one
  box per block and key step at the block id's row (what TMA can do for engines with larger
  blocks: 16-token blocks would need a box per 16 keys);

and, to find what triton-unified's tile adds to the paged one, the paged tile with one of its
features at a time:

* ``paged-masked``: triton-unified's per-step checks in every step (the block-id load bounded by
  the table, ids and sequence length checked per key, masked K and V loads, selected scores, the
  running max guarded against -inf);
* ``paged-lean``: only the checks its contract needs in the bulk (ids clamped, scores of bad ids
  selected out, V masked: a clamped id reads block 0, whose unwritten slots may hold NaN);
* ``paged-gqa`` / ``paged-gqa-masked``: triton-unified's row layout, BLOCK_M / GROUP tokens x the
  GROUP query heads of one KV head per tile, each K/V step shared by them (without / with the
  checks);

next to triton-unified's prefill path on the same batch. Every variant is checked against the
float32 reference (``BAD`` flags an error), times are CUDA-graph replays, rates count causal
FLOPs (``_harness.py``). The H200's numbers of record, and the product's prefill beside them:
docs/developing.md ("What a Triton tile can reach") and docs/benchmarks.md ("Targets and gaps").
Usage:
    python scripts/prefill_ceiling.py                 # 8 x 2,048 causal, Qwen3-8B heads
    python scripts/prefill_ceiling.py --len 4096 --reqs 4
    python scripts/prefill_ceiling.py --modes paged,paged-masked,paged-gqa
    TRITON_INTERPRET=1 python scripts/prefill_ceiling.py --smoke   # CPU: tiny shapes, checks only
    python scripts/prefill_ceiling.py --resources    # no GPU: each mode compiled for sm_90a offline
                                                     # (registers, spills, instructions per key step)
"""

from __future__ import annotations

import argparse
import sys

import _harness as H  # first: with --smoke it sets TRITON_INTERPRET before Triton is imported
import torch
import triton
import triton.language as tl
from paged_core import BatchMeta, allocate_kv_cache

# mode -> (K/V load path, masks of the bulk steps, GQA rows). Load paths: 0 paged pointers,
# 1 contiguous by arithmetic, 2 TMA, 3 TMA + warp specialisation. Masks: 0 none; 1 triton-unified's
# (block-id load bounded by the table, ids and sequence checked per key, K and V loads masked,
# scores selected, the running max guarded against -inf); 2 lean (ids checked and clamped, scores
# selected, V masked, K and the id load unmasked). GQA: a tile's rows are BLOCK_M / GROUP tokens x
# the GROUP query heads of one KV head (triton-unified's tiles), each K/V step shared by them.
MODES = {
    "paged": (0, 0, False),
    "paged-masked": (0, 1, False),
    "paged-lean": (0, 2, False),
    "paged-gqa": (0, 0, True),
    "paged-gqa-masked": (0, 1, True),
    "affine": (1, 0, False),
    "tma": (2, 0, False),
    "tma-ws": (3, 0, False),
    "paged-tma": (4, 0, False),
}
# paged-tma reads a cache of larger blocks, one TMA box per block and key step (the block id as
# the box's row coordinate): each key step must lie in one block (BLOCK_N <= its block size).
TMA_BLOCK_SIZE = 32 if H.SMOKE else 64


@triton.jit
def _fold(q, kt, v, m_i, l_i, acc, qk_scale, q_pos, offs_n, key_ok, CAUSAL: tl.constexpr, MASKS: tl.constexpr):
    s = tl.dot(q, kt) * qk_scale
    if CAUSAL:
        s = tl.where(offs_n[None, :] <= q_pos[:, None], s, float("-inf"))
    if MASKS != 0:
        s = tl.where(key_ok[None, :], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    if MASKS != 0:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new
    p = tl.exp2(s - m_ref[:, None])
    alpha = tl.exp2(m_i - m_ref)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _load_kv(
    k_ptr,
    v_ptr,
    kd,
    vd,
    bt_row,
    req,
    seq_len,
    start_n,
    kv_head,
    offs_d,
    num_blocks,
    max_blocks,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_bt_b,
    LOAD: tl.constexpr,
    MASKS: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    key_ok = offs_n >= 0
    if LOAD == 0:
        lb = offs_n // BLOCK_SIZE
        if MASKS == 1:
            blk = tl.load(bt_row + lb * stride_bt_b, mask=lb < max_blocks, other=-1)
            key_ok = (blk >= 0) & (blk < num_blocks) & (offs_n < seq_len)
            blk = tl.where(key_ok, blk, 0)
        elif MASKS == 2:
            blk = tl.load(bt_row + lb * stride_bt_b)
            key_ok = (blk >= 0) & (blk < num_blocks)
            blk = tl.where(key_ok, blk, 0)
        else:
            blk = tl.load(bt_row + lb * stride_bt_b)
        off = blk.to(tl.int64) * stride_k_b + (offs_n % BLOCK_SIZE) * stride_k_s + kv_head * stride_k_h
    else:
        off = (req * seq_len + offs_n).to(tl.int64) * stride_k_s + kv_head * stride_k_h
    if LOAD == 4:
        blk = tl.load(bt_row + (start_n // BLOCK_SIZE) * stride_bt_b)
        row = blk * BLOCK_SIZE + start_n % BLOCK_SIZE
        kt = kd.load([row, kv_head * D]).T
        v = vd.load([row, kv_head * D])
    elif LOAD >= 2:
        row = req * seq_len + start_n
        kt = kd.load([row, kv_head * D]).T
        v = vd.load([row, kv_head * D])
    elif MASKS == 1:
        kt = tl.load(k_ptr + off[None, :] + offs_d[:, None], mask=key_ok[None, :], other=0)
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0)
    elif MASKS == 2:
        kt = tl.load(k_ptr + off[None, :] + offs_d[:, None])
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :], mask=key_ok[:, None], other=0)
    else:
        kt = tl.load(k_ptr + off[None, :] + offs_d[:, None])
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :])
    if UPCAST:
        kt, v = kt.to(tl.float32), v.to(tl.float32)
    return kt, v, offs_n, key_ok


@triton.jit
def ceiling_kernel(
    q_ptr,
    k_ptr,
    v_ptr,
    out_ptr,
    bt_ptr,
    seq_len,
    num_slots,
    num_blocks,
    max_blocks,
    qk_scale,
    stride_q_t,
    stride_q_h,
    stride_k_b,
    stride_k_s,
    stride_k_h,
    stride_bt_r,
    stride_bt_b,
    LOAD: tl.constexpr,
    MASKS: tl.constexpr,
    GQA: tl.constexpr,
    GROUP: tl.constexpr,
    NUM_KV_HEADS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    D: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    UPCAST: tl.constexpr,
):
    """UPCAST: float32 math under the interpreter (it mishandles raw bf16 arithmetic)."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest tiles first
    req = tl.program_id(2)
    offs_m = tl.arange(0, BLOCK_M)
    if GQA:  # rows: TOKENS tokens x the GROUP heads of KV head program_id(1)
        TOKENS: tl.constexpr = BLOCK_M // GROUP
        kv_head = tl.program_id(1)
        head = kv_head * GROUP + offs_m % GROUP
        tok = tile * TOKENS + offs_m // GROUP
    else:  # rows: BLOCK_M tokens of query head program_id(1)
        TOKENS: tl.constexpr = BLOCK_M
        head = tl.program_id(1) + offs_m * 0
        kv_head = tl.program_id(1) // GROUP
        tok = tile * TOKENS + offs_m
    m0 = tile * TOKENS
    offs_d = tl.arange(0, D)
    rows = (req * seq_len + tok).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :])
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + req * stride_bt_r
    kd = None
    vd = None
    if LOAD >= 2:
        width = NUM_KV_HEADS * D
        kd = tl.make_tensor_descriptor(k_ptr, shape=[num_slots, width], strides=[width, 1], block_shape=[BLOCK_N, D])
        vd = tl.make_tensor_descriptor(v_ptr, shape=[num_slots, width], strides=[width, 1], block_shape=[BLOCK_N, D])
    # Keys [0, diag): visible to every row, no causal mask. Keys [diag, m0 + TOKENS): the diagonal,
    # from the last whole step below m0 (a step may be wider than the tile's tokens).
    diag = m0 // BLOCK_N * BLOCK_N
    for start_n in tl.range(0, diag, BLOCK_N, warp_specialize=LOAD == 3):
        kt, v, offs_n, key_ok = _load_kv(
            k_ptr,
            v_ptr,
            kd,
            vd,
            bt_row,
            req,
            seq_len,
            start_n,
            kv_head,
            offs_d,
            num_blocks,
            max_blocks,
            stride_k_b,
            stride_k_s,
            stride_k_h,
            stride_bt_b,
            LOAD,
            MASKS,
            BLOCK_N,
            D,
            BLOCK_SIZE,
            UPCAST,
        )
        m_i, l_i, acc = _fold(q, kt, v, m_i, l_i, acc, qk_scale, tok, offs_n, key_ok, False, MASKS)
    for start_n in range(diag, m0 + TOKENS, BLOCK_N):
        kt, v, offs_n, key_ok = _load_kv(
            k_ptr,
            v_ptr,
            kd,
            vd,
            bt_row,
            req,
            seq_len,
            start_n,
            kv_head,
            offs_d,
            num_blocks,
            max_blocks,
            stride_k_b,
            stride_k_s,
            stride_k_h,
            stride_bt_b,
            LOAD,
            MASKS,
            BLOCK_N,
            D,
            BLOCK_SIZE,
            UPCAST,
        )
        m_i, l_i, acc = _fold(q, kt, v, m_i, l_i, acc, qk_scale, tok, offs_n, key_ok, True, MASKS)
    o = acc / l_i[:, None]
    tl.store(
        out_ptr + rows[:, None] * stride_q_t + head[:, None] * stride_q_h + offs_d[None, :],
        o.to(out_ptr.dtype.element_ty),
    )


def make_case(reqs: int, n: int, block_size: int = H.BS) -> tuple[H.Case, torch.Tensor, torch.Tensor]:
    """A causal prefill of ``reqs`` x ``n`` tokens (block table from ``BatchMeta.build``), plus
    the same keys laid out contiguously, request after request (for the affine and TMA loads)."""
    meta = BatchMeta.build([n] * reqs, [n] * reqs, block_size=block_size, device=H.DEV, seed=1)
    nb = int(meta.block_table.max()) + 1
    cache = allocate_kv_cache(nb, block_size, H.HKV, H.D, dtype=torch.bfloat16, device=H.DEV)
    g = torch.Generator(device=H.DEV).manual_seed(1)
    cache.k.normal_(generator=g), cache.v.normal_(generator=g)
    q = torch.randn(reqs * n, H.HQ, H.D, generator=g, device=H.DEV).to(torch.bfloat16)
    used = meta.block_table[:, : n // block_size].reshape(-1).long()
    k_flat, v_flat = (t.index_select(0, used).reshape(reqs * n, H.HKV, H.D).contiguous() for t in (cache.k, cache.v))
    flops = 4 * H.D * H.HQ * reqs * (n * (n + 1) // 2)
    case = H.Case(meta, cache, q, nbytes=0, flops=flops, check_reqs=sorted({0, reqs - 1}), kv_dtype="auto")
    return case, k_flat, v_flat


def ceiling(case, k_flat, v_flat, out, mode: str, block_m: int, block_n: int, warps: int, stages: int):
    meta, c = case.meta, case.cache
    n = int(meta.seq_lens[0])
    reqs = meta.num_reqs
    load, masks, gqa = MODES[mode]
    flat = load in (1, 2, 3)  # the contiguous copy; paged modes read the cache itself
    block_size = c.k.shape[1]
    k, v = (k_flat, v_flat) if flat else (c.k, c.v)
    stride_k_b = block_size * k.stride(0) if flat else k.stride(0)
    stride_k_s, stride_k_h = (k.stride(0), k.stride(1)) if flat else (k.stride(1), k.stride(2))
    if load == 4:  # the descriptor views the cache as [num_blocks * block_size, heads * D]
        assert c.k.is_contiguous() and block_n <= block_size and block_size % block_n == 0
    num_slots = c.k.shape[0] * block_size if load == 4 else reqs * n
    group = H.HQ // H.HKV
    grid = (n // (block_m // group), H.HKV, reqs) if gqa else (n // block_m, H.HQ, reqs)
    qk_scale = H.SCALE * 1.4426950408889634
    return lambda: ceiling_kernel[grid](
        case.q,
        k,
        v,
        out,
        meta.block_table,
        n,
        num_slots,
        c.k.shape[0],
        meta.block_table.shape[1],
        qk_scale,
        case.q.stride(0),
        case.q.stride(1),
        stride_k_b,
        stride_k_s,
        stride_k_h,
        meta.block_table.stride(0),
        meta.block_table.stride(1),
        LOAD=load,
        MASKS=masks,
        GQA=gqa,
        GROUP=group,
        NUM_KV_HEADS=H.HKV,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        D=H.D,
        BLOCK_SIZE=block_size,
        UPCAST=H.SMOKE,
        num_warps=warps,
        num_stages=stages,
    )


def offline_resources(modes: list[str], configs: list[tuple[int, int, int, int]]) -> int:
    """Each mode x config compiled for sm_90a (no GPU): registers, spills and the instructions of
    each loop, the bulk's first (kernel_resources.py's columns)."""
    import kernel_resources as R

    fn = ceiling_kernel
    print(f"sm_90a, triton {triton.__version__}, head_dim {H.D}, group {H.HQ // H.HKV}, block {H.BS}, bf16")
    print(f"{'mode':18s} {'BLOCK_M x BLOCK_N w st':>22s} {R.HEADER}")
    for mode in modes:
        load, masks, gqa = MODES[mode]
        for bm, bn, w, st in configs:
            block_size = TMA_BLOCK_SIZE if load == 4 else H.BS
            if bn > block_size and load == 4:
                continue
            constexprs = dict(
                LOAD=load,
                MASKS=masks,
                GQA=gqa,
                GROUP=H.HQ // H.HKV,
                NUM_KV_HEADS=H.HKV,
                BLOCK_M=bm,
                BLOCK_N=bn,
                D=H.D,
                BLOCK_SIZE=block_size,
                UPCAST=False,
            )
            sig = {
                n: "constexpr"
                if n in constexprs
                else "*i32"
                if n == "bt_ptr"
                else "*bf16"
                if n.endswith("_ptr")
                else "fp32"
                if n == "qk_scale"
                else "i32"
                for n in fn.arg_names
            }
            # Pointers and strides divisible by 16, as they are at run time (vectorised loads).
            attrs = {
                (i,): [["tt.divisibility", 16]]
                for i, n in enumerate(fn.arg_names)
                if sig[n] != "constexpr" and (n.endswith("_ptr") or n.startswith("stride"))
            }
            tag = f"{bm} x {bn} w{w} st{st}"
            try:
                r = R.compile_stats(fn, sig, constexprs, attrs, w, st)
            except Exception as exc:  # warp specialisation's pass fails on some shapes: say so, go on
                print(f"{mode:18s} {tag:>22s}  {type(exc).__name__}: {(str(exc).splitlines() or [''])[0][:70]}")
                continue
            print(f"{mode:18s} {tag:>22s} {R.row(r)}")
    return 0


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=2048, help="tokens per request (a multiple of 128)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, checks only")
    ap.add_argument(
        "--resources",
        action="store_true",
        help="compile each mode for sm_90a offline and print its resources (kernel_resources.py)",
    )
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}; accepted: {', '.join(MODES)}")
    if args.smoke:
        args.reqs, args.len = 2, 64
        configs = [(32, 16, 4, 1), (16, 32, 4, 1)]  # the second: steps wider than the tile
    else:
        configs = [
            (128, 64, 8, 2),
            (128, 128, 8, 2),
            (128, 64, 8, 3),
            (128, 128, 8, 3),
            (64, 64, 4, 2),
            (64, 128, 4, 2),
            (64, 64, 4, 3),
        ]
    if args.resources:
        return offline_resources(modes, configs)
    if H.DEV == "cuda":  # device-side descriptors take their scratch memory from here
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    case, k_flat, v_flat = make_case(args.reqs, args.len)
    out = torch.empty_like(case.q)
    name = f"{args.reqs}x{args.len}"
    for mode in modes:
        tma_blocks = mode == "paged-tma"
        mode_case = make_case(args.reqs, args.len, TMA_BLOCK_SIZE)[0] if tma_blocks else case
        for bm, bn, w, st in configs:
            if tma_blocks and bn > TMA_BLOCK_SIZE:
                continue  # a key step would span two blocks: two boxes, not this mode
            tag = f" ({TMA_BLOCK_SIZE}-token blocks)" if tma_blocks else ""
            H.report(
                "ceiling",
                f"{name} {mode} {bm}x{bn} w{w} st{st}{tag}",
                mode_case,
                ceiling(mode_case, k_flat, v_flat, out, mode, bm, bn, w, st),
                out,
                tflops=True,
            )
    product = [((64, 8, 2), 32)] if args.smoke else [((64, 8, 2), 32), ((128, 8, 2), 32), ((64, 4, 2), 16)]
    for large, bq in product:
        H.report(
            "ceiling",
            f"{name} triton-unified {H.tag(None, large, bq)}",
            case,
            H.unified(case, out, H.cfg((64, 4, 2), large, bq)),
            out,
            tflops=True,
        )
    H.report("ceiling", f"{name} triton-unified autotuned", case, H.unified(case, out, None), out, tflops=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
