"""How fast a plain Triton flash-attention tile runs a causal prefill on this GPU, by how K/V are loaded.

A measuring instrument, not a backend: one minimal forward kernel (one query head x BLOCK_M
tokens per program, online softmax, a causal diagonal masked in its own loop, nothing else) whose
K/V loads come from

* ``paged``: the block table, one pointer per key (the gathers triton-unified runs);
* ``affine``: the same keys laid out contiguously, addressed by arithmetic (no table);
* ``tma``: the contiguous copy through a tensor descriptor (TMA copies, no pointer tiles);
* ``tma-ws``: the same with the key loop warp-specialised (producer and consumer warps).

next to triton-unified's prefill path on the same batch. If the minimal paged tile is already
near triton-unified's rate, the product kernel's extras are not what holds it back and the
lever is the load path or warp specialisation; the gap between ``paged`` and ``tma-ws`` is what
a TMA producer would buy. Every variant is checked against the float32 reference
(``BAD`` flags an error), times are CUDA-graph replays, rates count causal FLOPs:
    python scripts/prefill_ceiling.py                 # 8 x 2,048 causal, Qwen3-8B heads
    python scripts/prefill_ceiling.py --len 4096 --reqs 4
    TRITON_INTERPRET=1 python scripts/prefill_ceiling.py --smoke   # CPU: tiny shapes, checks only
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

SMOKE = "--smoke" in sys.argv  # gpu_tune reads it at import: interpreter, tiny shapes
sys.path.insert(0, str(Path(__file__).resolve().parent))

import gpu_tune as G  # noqa: E402
import torch  # noqa: E402
import triton  # noqa: E402
import triton.language as tl  # noqa: E402
from paged_core import BatchMeta, allocate_kv_cache  # noqa: E402

MODES = {"paged": 0, "affine": 1, "tma": 2, "tma-ws": 3}


@triton.jit
def _fold(q, kt, v, m_i, l_i, acc, qk_scale, offs_m, offs_n, MASK: tl.constexpr):
    s = tl.dot(q, kt) * qk_scale
    if MASK:
        s = tl.where(offs_n[None, :] <= offs_m[:, None], s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    p = tl.exp2(s - m_new[:, None])
    alpha = tl.exp2(m_i - m_new)
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = tl.dot(p.to(v.dtype), v, acc * alpha[:, None])
    return m_new, l_i, acc


@triton.jit
def _load_kv(k_ptr, v_ptr, kd, vd, bt_row, req, seq_len, start_n, kv_head, offs_d,
             stride_k_b, stride_k_s, stride_k_h, stride_bt_b,
             MODE: tl.constexpr, BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr,
             UPCAST: tl.constexpr):
    offs_n = start_n + tl.arange(0, BLOCK_N)
    if MODE == 0:
        blk = tl.load(bt_row + (offs_n // BLOCK_SIZE) * stride_bt_b).to(tl.int64)
        off = blk * stride_k_b + (offs_n % BLOCK_SIZE) * stride_k_s + kv_head * stride_k_h
    else:
        off = (req * seq_len + offs_n).to(tl.int64) * stride_k_s + kv_head * stride_k_h
    if MODE >= 2:
        row = req * seq_len + start_n
        kt = kd.load([row, kv_head * D]).T
        v = vd.load([row, kv_head * D])
    else:
        kt = tl.load(k_ptr + off[None, :] + offs_d[:, None])
        v = tl.load(v_ptr + off[:, None] + offs_d[None, :])
    if UPCAST:
        kt, v = kt.to(tl.float32), v.to(tl.float32)
    return kt, v


@triton.jit
def ceiling_kernel(q_ptr, k_ptr, v_ptr, out_ptr, bt_ptr, seq_len, num_slots, qk_scale,
                   stride_q_t, stride_q_h, stride_k_b, stride_k_s, stride_k_h, stride_bt_r, stride_bt_b,
                   MODE: tl.constexpr, GROUP: tl.constexpr, NUM_KV_HEADS: tl.constexpr, BLOCK_M: tl.constexpr,
                   BLOCK_N: tl.constexpr, D: tl.constexpr, BLOCK_SIZE: tl.constexpr, UPCAST: tl.constexpr):
    """UPCAST: float32 math under the interpreter (it mishandles raw bf16 arithmetic)."""
    tile = tl.num_programs(0) - 1 - tl.program_id(0)  # heaviest tiles first
    head = tl.program_id(1)
    req = tl.program_id(2)
    kv_head = head // GROUP
    m0 = tile * BLOCK_M
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, D)
    rows = (req * seq_len + offs_m).to(tl.int64)
    q = tl.load(q_ptr + rows[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :])
    if UPCAST:
        q = q.to(tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
    l_i = tl.zeros([BLOCK_M], tl.float32)
    acc = tl.zeros([BLOCK_M, D], tl.float32)
    bt_row = bt_ptr + req * stride_bt_r
    kd = None
    vd = None
    if MODE >= 2:
        width = NUM_KV_HEADS * D
        kd = tl.make_tensor_descriptor(k_ptr, shape=[num_slots, width], strides=[width, 1], block_shape=[BLOCK_N, D])
        vd = tl.make_tensor_descriptor(v_ptr, shape=[num_slots, width], strides=[width, 1], block_shape=[BLOCK_N, D])
    # Keys [0, m0): visible to every row, no mask. Keys [m0, m0 + BLOCK_M): the diagonal.
    for start_n in tl.range(0, m0, BLOCK_N, warp_specialize=MODE == 3):
        kt, v = _load_kv(k_ptr, v_ptr, kd, vd, bt_row, req, seq_len, start_n, kv_head, offs_d,
                         stride_k_b, stride_k_s, stride_k_h, stride_bt_b, MODE, BLOCK_N, D, BLOCK_SIZE, UPCAST)
        m_i, l_i, acc = _fold(q, kt, v, m_i, l_i, acc, qk_scale, offs_m, start_n + tl.arange(0, BLOCK_N), False)
    for start_n in range(m0, m0 + BLOCK_M, BLOCK_N):
        kt, v = _load_kv(k_ptr, v_ptr, kd, vd, bt_row, req, seq_len, start_n, kv_head, offs_d,
                         stride_k_b, stride_k_s, stride_k_h, stride_bt_b, MODE, BLOCK_N, D, BLOCK_SIZE, UPCAST)
        m_i, l_i, acc = _fold(q, kt, v, m_i, l_i, acc, qk_scale, offs_m, start_n + tl.arange(0, BLOCK_N), True)
    o = acc / l_i[:, None]
    tl.store(out_ptr + rows[:, None] * stride_q_t + head * stride_q_h + offs_d[None, :], o.to(out_ptr.dtype.element_ty))


def make_case(reqs: int, n: int) -> tuple[G.Case, torch.Tensor, torch.Tensor]:
    """A causal prefill of ``reqs`` x ``n`` tokens (block table from ``BatchMeta.build``), plus
    the same keys laid out contiguously, request after request (for the affine and TMA loads)."""
    meta = BatchMeta.build([n] * reqs, [n] * reqs, block_size=G.BS, device=G.DEV, seed=1)
    nb = int(meta.block_table.max()) + 1
    cache = allocate_kv_cache(nb, G.BS, G.HKV, G.D, dtype=torch.bfloat16, device=G.DEV)
    g = torch.Generator(device=G.DEV).manual_seed(1)
    cache.k.normal_(generator=g), cache.v.normal_(generator=g)
    q = torch.randn(reqs * n, G.HQ, G.D, generator=g, device=G.DEV).to(torch.bfloat16)
    used = meta.block_table[:, : n // G.BS].reshape(-1).long()
    k_flat, v_flat = (t.index_select(0, used).reshape(reqs * n, G.HKV, G.D).contiguous() for t in (cache.k, cache.v))
    flops = 4 * G.D * G.HQ * reqs * (n * (n + 1) // 2)
    case = G.Case(meta, cache, q, nbytes=0, flops=flops, check_reqs=sorted({0, reqs - 1}), kv_dtype="auto")
    return case, k_flat, v_flat


def ceiling(case, k_flat, v_flat, out, mode: str, block_m: int, block_n: int, warps: int, stages: int):
    meta, c = case.meta, case.cache
    n = int(meta.seq_lens[0])
    reqs = meta.num_reqs
    flat = mode != "paged"
    k, v = (k_flat, v_flat) if flat else (c.k, c.v)
    stride_k_b = G.BS * k.stride(0) if flat else k.stride(0)
    stride_k_s, stride_k_h = (k.stride(0), k.stride(1)) if flat else (k.stride(1), k.stride(2))
    grid = (n // block_m, G.HQ, reqs)
    qk_scale = G.SCALE * 1.4426950408889634
    return lambda: ceiling_kernel[grid](
        case.q, k, v, out, meta.block_table, n, reqs * n, qk_scale,
        case.q.stride(0), case.q.stride(1), stride_k_b, stride_k_s, stride_k_h,
        meta.block_table.stride(0), meta.block_table.stride(1),
        MODE=MODES[mode], GROUP=G.HQ // G.HKV, NUM_KV_HEADS=G.HKV, BLOCK_M=block_m, BLOCK_N=block_n, D=G.D,
        BLOCK_SIZE=G.BS, UPCAST=G.SMOKE, num_warps=warps, num_stages=stages)


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--reqs", type=int, default=8)
    ap.add_argument("--len", type=int, default=2048, help="tokens per request (a multiple of 128)")
    ap.add_argument("--modes", default=",".join(MODES), help=f"of {', '.join(MODES)}")
    ap.add_argument("--smoke", action="store_true", help="CPU interpreter, tiny shapes, checks only")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        ap.error(f"unknown modes {unknown}; accepted: {', '.join(MODES)}")
    if args.smoke:
        args.reqs, args.len = 2, 64
        configs = [(32, 16, 4, 1)]
    else:
        configs = [(128, 64, 8, 2), (128, 128, 8, 2), (128, 64, 8, 3), (128, 128, 8, 3), (64, 64, 4, 2),
                   (64, 128, 4, 2), (64, 64, 4, 3)]
    if G.DEV == "cuda":  # device-side descriptors take their scratch memory from here
        triton.set_allocator(lambda size, align, stream: torch.empty(size, dtype=torch.int8, device="cuda"))
    case, k_flat, v_flat = make_case(args.reqs, args.len)
    out = torch.empty_like(case.q)
    name = f"{args.reqs}x{args.len}"
    for mode in modes:
        for bm, bn, w, st in configs:
            G.report("ceiling", f"{name} {mode} {bm}x{bn} w{w} st{st}", case,
                     ceiling(case, k_flat, v_flat, out, mode, bm, bn, w, st), out, tflops=True)
    product = [((64, 8, 2), 32)] if args.smoke else [((64, 8, 2), 32), ((128, 8, 2), 32), ((64, 4, 2), 16)]
    for large, bq in product:
        G.report("ceiling", f"{name} triton-unified {G.tag(None, large, bq)}", case,
                 G.unified(case, out, G.cfg((64, 4, 2), large, bq)), out, tflops=True)
    G.report("ceiling", f"{name} triton-unified autotuned", case, G.unified(case, out, None), out, tflops=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
