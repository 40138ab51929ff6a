"""One GPU call: old vs new code paths of the Triton kernels, CUDA-graph replay times + a check.

A development aid (the numbers in docs/benchmarks.md come from ``paged bench``):
    python scripts/gpu_tune.py            # everything, ~4-5 minutes with compiles
    python scripts/gpu_tune.py quant split  # only some sections
    TRITON_INTERPRET=1 python scripts/gpu_tune.py --smoke   # CPU: tiny shapes, checks only

Every variant runs a FIXED kernel config (no autotuning: one compile per variant), prints one
line ``section | variant | ms | % of floor (or TFLOP/s) | max rel err``, and is checked against
``paged_core.reference_attention`` (float32) on a few of its requests; ``BAD`` flags a relative
error above 2e-2. Floors: bytes of K/V (+ scales) read / 4.55 TB/s (the read ceiling measured
on this H200); prefill is reported in TFLOP/s (causal FLOPs, 4 * D * Hq per visible pair).
A section stops adding variants once the whole run passes ``DEADLINE_S``
(``PAGED_TUNE_DEADLINE_S``, default 290).
"""

from __future__ import annotations

import dataclasses
import math
import os
import sys
import time

# --smoke: run every variant once on tiny shapes on the CPU (interpreter) to check the script
# and the numerics before spending a GPU call. Must be decided before Triton is imported.
SMOKE = "--smoke" in sys.argv
if SMOKE:
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import triton  # noqa: E402
from paged_core import BatchMeta, KVCache, allocate_kv_cache, reference_attention  # noqa: E402
from paged_triton_splitkv import launch as split_launch  # noqa: E402
from paged_triton_splitkv.launch import choose_num_splits, split_decode_attention  # noqa: E402
from paged_triton_unified.launch import LaunchConfig, unified_attention  # noqa: E402

DEV = "cpu" if SMOKE else "cuda"
BW = 4.55e12  # read floor measured on this H200 (streaming-read kernel)
HQ, HKV, D, BS = (8, 2, 64, 16) if SMOKE else (32, 8, 128, 16)  # Qwen3-8B attention
SCALE = D**-0.5
DEADLINE_S = float(os.environ.get("PAGED_TUNE_DEADLINE_S", 290))
T0 = time.time()

# The previous behaviour of every switch (LaunchConfig code paths).
OLD = {"fuse_classes": False, "decode_direct": False, "quant_fp16": False, "fold_scale": False}
NEW = {"fuse_classes": True, "decode_direct": True, "quant_fp16": True, "fold_scale": True}
# Switches not yet timed, on top of NEW.
PREFETCH = {**NEW, "prefetch_block_ids": True}


def graph_ms(fn) -> float:
    if SMOKE:
        fn()
        return float("nan")
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        fn()
    return triton.testing.do_bench(g.replay, warmup=25, rep=100, return_mode="median")


# --------------------------------------------------------------------------------------------
# Batches
# --------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Case:
    meta: BatchMeta
    cache: KVCache
    q: torch.Tensor
    nbytes: int  # K/V (+ scale) bytes the batch must read
    flops: int  # causal FLOPs
    check_reqs: list[int]


def make_case(qlens, slens, kv_dtype="auto", seed=1, check_reqs=None) -> Case:
    if SMOKE:  # the first, middle and last request, at most 40 tokens each
        keep = sorted({0, len(qlens) // 2, len(qlens) - 1})
        qlens = [min(qlens[r], 20 + 7 * i) for i, r in enumerate(keep)]
        slens = [max(q, min(slens[r], 40 + 9 * i)) for i, (q, r) in enumerate(zip(qlens, keep, strict=True))]
        check_reqs = None
    meta = BatchMeta.build(qlens, slens, block_size=BS, device=DEV, seed=seed)
    nb = int(meta.block_table.max()) + 1
    cache = allocate_kv_cache(nb, BS, HKV, D, dtype=torch.bfloat16, device=DEV, kv_dtype=kv_dtype)
    g = torch.Generator(device=DEV).manual_seed(seed)
    if kv_dtype == "auto":
        cache.k.normal_(generator=g), cache.v.normal_(generator=g)
    elif kv_dtype == "int8":
        for t in (cache.k, cache.v):
            codes = torch.randint(-127, 128, t.shape, generator=g, device=DEV, dtype=torch.int16)
            t.copy_(codes.to(torch.int8))
    else:  # fp8 e4m3: normal codes spread over the format's range
        for t in (cache.k, cache.v):
            t.copy_((torch.randn(t.shape, generator=g, device=DEV) * 100).clamp(-448, 448).to(t.dtype))
    if cache.k_scale is not None:
        for t in (cache.k_scale, cache.v_scale):
            t.copy_(torch.rand(t.shape, generator=g, device=DEV) * 0.02 + 1e-3)
    q = torch.randn(sum(qlens), HQ, D, generator=g, device=DEV).to(torch.bfloat16)
    elem = 2 if kv_dtype == "auto" else 1
    per_token = 2 * HKV * D * elem + (2 * HKV * 4 if kv_dtype != "auto" else 0)
    nbytes = sum(slens) * per_token
    flops = 4 * D * HQ * sum(t * (s - t) + t * (t + 1) // 2 for t, s in zip(qlens, slens, strict=True) if s)
    if check_reqs is None:
        check_reqs = sorted({0, len(qlens) // 2, len(qlens) - 1})
    return Case(meta, cache, q, nbytes, flops, check_reqs)


def max_rel_err(case: Case, out: torch.Tensor) -> float:
    """float32 reference on the check requests only (a compact copy of their blocks)."""
    meta, cache = case.meta, case.cache
    qlens, slens = meta.host()
    qsl = meta.query_start_loc.tolist()
    table = meta.block_table.tolist()
    used = [table[r][: math.ceil(slens[r] / BS)] for r in case.check_reqs]
    uniq = sorted({b for t in used for b in t})
    remap = {b: i for i, b in enumerate(uniq)}
    idx = torch.tensor(uniq, dtype=torch.long, device=DEV)
    sub = KVCache(
        k=cache.k.index_select(0, idx), v=cache.v.index_select(0, idx), kv_dtype=cache.kv_dtype,
        k_scale=None if cache.k_scale is None else cache.k_scale.index_select(0, idx),
        v_scale=None if cache.v_scale is None else cache.v_scale.index_select(0, idx),
        dtype=cache.dtype,
    )
    reqs = case.check_reqs
    sub_meta = BatchMeta.from_lists([qlens[r] for r in reqs], [slens[r] for r in reqs],
                                    [[remap[b] for b in t] for t in used], block_size=BS, device=DEV)
    rows = torch.tensor([i for r in case.check_reqs for i in range(qsl[r], qsl[r + 1])], device=DEV)
    ref = reference_attention(case.q.index_select(0, rows), sub, sub_meta, scale=SCALE,
                              compute_dtype=torch.float32)
    got = out.index_select(0, rows).float()
    return ((got - ref).abs().max() / ref.abs().max().clamp_min(1e-6)).item()


def report(section: str, name: str, case: Case, fn, out: torch.Tensor, *, tflops: bool = False) -> None:
    if time.time() - T0 > DEADLINE_S:
        print(f"{section:8s} | {name:58s} | skipped (deadline)", flush=True)
        return
    try:
        out.fill_(float("nan"))
        ms = graph_ms(fn)
        err = max_rel_err(case, out)
    except Exception as exc:  # out of resources, compile errors: report and go on
        first = (str(exc).splitlines() or [""])[0][:90]
        print(f"{section:8s} | {name:58s} | {type(exc).__name__}: {first}", flush=True)
        return
    if tflops:
        perf = f"{case.flops / ms / 1e9:6.1f} TFLOP/s"
    else:
        perf = f"{100 * case.nbytes / BW * 1e3 / ms:5.1f}% of floor ({case.nbytes / BW * 1e3:.3f} ms)"
    flag = "  BAD" if not err <= 2e-2 else ""
    elapsed = time.time() - T0
    print(f"{section:8s} | {name:58s} | {ms:7.4f} ms | {perf} | err {err:.1e}{flag}  [{elapsed:5.0f}s]",
          flush=True)


def unified(case: Case, out: torch.Tensor, cfg: LaunchConfig | None):
    m, c = case.meta, case.cache
    return lambda: unified_attention(
        case.q, c.k, c.v, out, query_start_loc=m.query_start_loc, seq_lens=m.seq_lens,
        block_table=m.block_table, max_query_len=m.max_query_len, max_seq_len=m.max_seq_len, scale=SCALE,
        k_scale=c.k_scale, v_scale=c.v_scale, config=cfg)


def cfg(small=(128, 4, 2), large=(64, 8, 2), bq_large=32, **switches) -> LaunchConfig:
    return LaunchConfig(block_q_small=4, block_q_large=bq_large, block_n=small[0], num_warps=small[1],
                        num_stages=small[2], large_block_n=large[0], large_num_warps=large[1],
                        large_num_stages=large[2], **switches)


def tag(small=None, large=None, bq_large=None) -> str:
    parts = []
    if small:
        parts.append("small {}/w{}/st{}".format(*small))
    if large:
        parts.append("large {}/w{}/st{}".format(*large))
    if bq_large:
        parts.append(f"BLOCK_M {bq_large * 4}")
    return " ".join(parts)


# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def section_decode() -> None:
    case = make_case([1] * 64, [4096] * 64)
    out = torch.empty_like(case.q)
    for name, sw, small in [
        ("old (plan launch, scale per score)", OLD, (128, 4, 2)),
        ("new (direct tiles, folded scale)", NEW, (128, 4, 2)),
        ("new", NEW, (64, 2, 2)),
        ("new", NEW, (64, 4, 3)),
        ("new", NEW, (128, 4, 3)),
        ("prefetched block ids", PREFETCH, (128, 4, 2)),
        ("prefetched block ids", PREFETCH, (128, 4, 3)),
        ("prefetched block ids", PREFETCH, (64, 4, 3)),
    ]:
        fn = unified(case, out, cfg(small, **sw))
        report("decode", f"64x4096 bf16 {name} {tag(small)}", case, fn, out)
    del case


def section_quant() -> None:
    for kv in ("int8", "fp8"):
        case = make_case([1] * 64, [4096] * 64, kv_dtype=kv)
        out = torch.empty_like(case.q)
        variants = [("old (codes->bf16)", OLD, (128, 4, 2)),
                    ("old (codes->bf16)", OLD, (64, 4, 2)),
                    ("new (fp16 dots)", NEW, (128, 4, 2)), ("new (fp16 dots)", NEW, (64, 4, 2)),
                    ("new (fp16 dots)", NEW, (64, 4, 3)), ("new (fp16 dots)", NEW, (64, 8, 2))]
        if kv == "int8":
            variants += [("new (fp16 dots)", NEW, (128, 8, 2)), ("new (fp16 dots)", NEW, (32, 4, 3))]
        for name, sw, small in variants:
            fn = unified(case, out, cfg(small, **sw))
            report("quant", f"64x4096 {kv} {name} {tag(small)}", case, fn, out)
        del case


def section_prefill() -> None:
    case = make_case([2048] * 8, [2048] * 8, check_reqs=[0, 7])
    out = torch.empty_like(case.q)
    for name, sw, large, bq in [
        ("old (2 launches, scale per score)", OLD, (64, 8, 2), 32),
        ("fold only", {**OLD, "fold_scale": True}, (64, 8, 2), 32),
        ("new (fused, fold)", NEW, (64, 8, 2), 32),
        ("new", NEW, (64, 8, 3), 32),
        ("new", NEW, (128, 8, 2), 32),
        ("new", NEW, (64, 4, 2), 16),
        ("new", NEW, (64, 4, 3), 16),
        ("new", NEW, (128, 4, 2), 16),
    ]:
        report("prefill", f"8x2048 {name} {tag(None, large, bq)}", case,
               unified(case, out, cfg((64, 4, 2), large, bq, **sw)), out, tflops=True)
    # The next step's block ids loaded a step ahead: the pipeliner can then buffer the gathered
    # K/V num_stages deep (offline compile: 128 KB of shared memory at 3 stages instead of 96).
    for large in [(64, 8, 2), (64, 8, 3), (64, 8, 4), (32, 8, 3)]:
        report("prefill", f"8x2048 prefetched block ids {tag(None, large, 32)}", case,
               unified(case, out, cfg((64, 4, 2), large, 32, **PREFETCH)), out, tflops=True)
    # Run 5 lost 11 % on this batch (1.070 -> 1.187 ms autotuned) when fused launches began to
    # step 128 keys in their decode branch: does the unused decode branch cost the prefill one
    # registers? Same large config, decode branch at 64 / 128 keys, and the one-class launch.
    for name, sw, small in [
        ("fused, decode branch 64 keys", NEW, (64, 4, 2)),
        ("fused, decode branch 128 keys", NEW, (128, 4, 2)),
        ("2 launches (no fused branch)", {**NEW, "fuse_classes": False}, (64, 4, 2)),
    ]:
        for large in [(64, 8, 2), (128, 8, 2)]:
            report("prefill", f"8x2048 {name} {tag(None, large, 32)}", case,
                   unified(case, out, cfg(small, large, 32, **sw)), out, tflops=True)
    del case


def section_mixed() -> None:
    qlens = [512, 512] + [1] * 30
    slens = [1024, 1536] + [1990 + i for i in range(30)]
    case = make_case(qlens, slens, check_reqs=[0, 1, 2, 31])
    out = torch.empty_like(case.q)
    for name, sw, small, large, bq in [
        ("old (2 launches)", OLD, (128, 4, 2), (64, 8, 2), 32),
        ("2 launches, fold", {**OLD, "fold_scale": True}, (128, 4, 2), (64, 8, 2), 32),
        ("2 launches, fold", {**OLD, "fold_scale": True}, (128, 4, 2), (64, 4, 2), 16),
        ("new (1 fused launch)", NEW, (64, 8, 2), (64, 8, 2), 32),
        ("new (1 fused launch)", NEW, (64, 4, 2), (64, 4, 2), 16),
        ("new (1 fused launch)", NEW, (128, 4, 2), (64, 4, 2), 16),
        ("new (1 fused launch)", NEW, (32, 4, 2), (64, 4, 2), 16),
    ]:
        # Fused: the launch runs num_warps/num_stages of `large`; `small` gives only BLOCK_N.
        report("mixed", f"2x512+30 {name} {tag(small, large, bq)}", case,
               unified(case, out, cfg(small, large, bq, **sw)), out)
    del case


def section_split() -> None:
    sms = 132 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    for b, n in [(4, 32768), (1, 131072), (16, 8192)]:
        case = make_case([1] * b, [n] * b, check_reqs=[0])
        out = torch.empty_like(case.q)
        split_launch._PROGRAMS_PER_SM = 2
        old_auto = choose_num_splits(b, HKV, n, BS, DEV)
        split_launch._PROGRAMS_PER_SM = 1
        new_auto = choose_num_splits(b, HKV, n, BS, DEV)
        variants = [(f"old auto ({old_auto} splits, merged)", old_auto, (64, 4, 2), False)]
        for kc in [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3)]:
            variants.append((f"new auto ({new_auto} splits)", new_auto, kc, True))
        if b == 16:
            variants += [("1 split merged (old epilogue)", 1, (64, 4, 3), False),
                         ("1 split direct", 1, (64, 4, 3), True), ("1 split direct", 1, (128, 4, 2), True)]
        else:
            for s in sorted({max(1, new_auto // 2), new_auto * 2} - {new_auto}):
                variants.append((f"{s} splits", s, (64, 4, 3), True))
        # Block ids loaded a tile ahead: the 64-key configs get 3-4 K/V buffers instead of 2
        # (offline sm_90a compile: 70 / 102 KB of shared memory at 3 / 4 stages instead of 38).
        for kc in [(64, 4, 3), (64, 4, 4), (128, 4, 3)]:
            variants.append((f"prefetched ids, new auto ({new_auto} splits)", new_auto, kc, True))
        for name, splits, kc, direct in variants:
            split_launch.DIRECT_SINGLE_SPLIT = direct
            split_launch.PREFETCH_BLOCK_IDS = name.startswith("prefetched")
            kcfg = {"BLOCK_N": kc[0], "num_warps": kc[1], "num_stages": kc[2]}
            fn = lambda case=case, out=out, n=n, splits=splits, kcfg=kcfg: split_decode_attention(
                case.q, case.cache.k, case.cache.v, out, seq_lens=case.meta.seq_lens,
                block_table=case.meta.block_table, max_seq_len=n, scale=SCALE, num_splits=splits,
                kernel_config=kcfg)
            report("split", f"{b}x{n} {name} {kc[0]}/w{kc[1]}/st{kc[2]} ({sms} SMs)", case, fn, out)
        split_launch.DIRECT_SINGLE_SPLIT = True
        split_launch.PREFETCH_BLOCK_IDS = False
        del case


def section_bench_mixed() -> None:
    """The mixed batch of ``paged bench`` (chunk contexts 1,024 and 3,072: heavier than
    section_mixed's), so fixed configs compare with the bench's FlashInfer row (0.205 ms)."""
    g = torch.Generator().manual_seed(0)
    dec = [2000 + int(x) for x in torch.randint(-100, 101, (30,), generator=g)]
    case = make_case([1] * 30 + [512, 512], dec + [1024 + 512, 3072 + 512], check_reqs=[0, 30, 31])
    out = torch.empty_like(case.q)
    for name, sw, small, large, bq in [
        ("fused", NEW, (128, 4, 2), (64, 4, 2), 16),
        ("fused", NEW, (128, 4, 2), (64, 8, 2), 16),
        ("fused", NEW, (128, 4, 2), (128, 8, 2), 16),
        ("fused", NEW, (64, 4, 2), (64, 4, 2), 16),
        ("fused", NEW, (128, 4, 2), (64, 8, 2), 32),
        ("2 launches", {**NEW, "fuse_classes": False}, (128, 4, 2), (64, 4, 2), 16),
    ]:
        report("mixed-b", f"bench batch {name} {tag(small, large, bq)}", case,
               unified(case, out, cfg(small, large, bq, **sw)), out)
    for large in [(64, 4, 2), (64, 4, 3), (64, 8, 3)]:
        report("mixed-b", f"bench batch fused, prefetched block ids {tag((128, 4, 2), large, 16)}", case,
               unified(case, out, cfg((128, 4, 2), large, 16, **PREFETCH)), out)
    # Two launches on two streams: each class with its own warps (the fused launch runs both with
    # one num_warps; 8 warps made its decode tiles 1.7 x slower), overlapping in a CUDA graph.
    concurrent = {**NEW, "fuse_classes": False, "concurrent_classes": True}
    for large, bq in [((64, 8, 2), 32), ((64, 8, 2), 16), ((64, 4, 2), 16)]:
        report("mixed-b", f"bench batch 2 concurrent launches {tag((128, 4, 2), large, bq)}", case,
               unified(case, out, cfg((128, 4, 2), large, bq, **concurrent)), out)
    report("mixed-b", "bench batch 2 concurrent launches, prefetched ids, large 64/w8/st3 BLOCK_M 128", case,
           unified(case, out, cfg((128, 4, 2), (64, 8, 3), 32, **concurrent, prefetch_block_ids=True)), out)
    report("mixed-b", "bench batch autotuned", case, unified(case, out, None), out)
    del case


def section_chunk() -> None:
    """Chunked prefill after a long context next to decodes: 512 new tokens after 15,872 cached
    ones + 32 decodes at 4,096 (137 GFLOP: compute-bound, 0.6 ms at 230 TFLOP/s). H200, run 7:
    64-row tiles 0.746 ms, 128-row 1.259; splitting the tiles' keys (reverted) 0.90-1.23."""
    case = make_case([512] + [1] * 32, [16384] + [4096] * 32, check_reqs=[0, 1, 32])
    out = torch.empty_like(case.q)
    for bq in (16, 32):
        report("chunk", f"1x512@16k+32x4k {tag(None, (64, 4, 2), bq)}", case,
               unified(case, out, cfg((128, 4, 2), (64, 4, 2), bq, **NEW)), out, tflops=True)
    report("chunk", "1x512@16k+32x4k autotuned", case, unified(case, out, None), out, tflops=True)
    del case


def section_cascade() -> None:
    """64 decodes sharing 4,000 tokens (the same blocks) + 100 of their own: the cascade prefix
    pass with its keys split (auto) or not, against the unified kernel reading the prefix 64 x."""
    from paged_triton_splitkv.launch import cascade_attention

    n_prefix, n_own, b = (64, 24, 3) if SMOKE else (4000, 100, 64)
    prefix_blocks = n_prefix // BS
    case = make_case([1] * b, [n_prefix + n_own] * b, check_reqs=[0, b - 1])
    table = case.meta.block_table
    table[:, :prefix_blocks] = table[0, :prefix_blocks]  # every request shares request 0's prefix
    out = torch.empty_like(case.q)
    m, c = case.meta, case.cache
    for name, splits, chunk in [("cascade, prefix split auto", None, 1), ("cascade, prefix split auto", None, 8),
                                ("cascade, prefix in 1 pass", 1, 8), ("cascade, 4 prefix splits", 4, 8),
                                ("cascade, 16 prefix splits", 16, 8), ("cascade, 32 prefix splits", 32, 8),
                                ("concurrent passes, prefix split auto", None, 8),
                                ("concurrent passes, 16 prefix splits", 16, 8)]:
        split_launch.MERGE_PARTS_CHUNK = chunk
        split_launch.CONCURRENT_CASCADE_PASSES = name.startswith("concurrent")
        fn = lambda splits=splits, q=case.q: cascade_attention(  # noqa: E731
            q, c.k, c.v, out, query_start_loc=m.query_start_loc, seq_lens=m.seq_lens, block_table=table,
            prefix_blocks=prefix_blocks, max_query_len=1, max_seq_len=m.max_seq_len, scale=SCALE,
            prefix_splits=splits)
        report("cascade", f"{b}x({n_prefix}+{n_own}) {name}, merge {chunk} parts/step", case, fn, out)
    split_launch.CONCURRENT_CASCADE_PASSES = False
    report("cascade", f"{b}x({n_prefix}+{n_own}) unified kernel", case,
           unified(case, out, cfg((128, 4, 2))), out)
    # Its parts alone: the merge of 9 parts (1 suffix + 8 prefix splits), and the suffix pass.
    from paged_triton_splitkv.launch import merge_states

    parts = torch.randn(9, *case.q.shape, device=DEV)
    lses = torch.randn(9, *case.q.shape[:2], device=DEV)
    for chunk in (1, 8):
        split_launch.MERGE_PARTS_CHUNK = chunk
        print(f"cascade  | merge_states alone, 9 parts x {tuple(case.q.shape)}, {chunk} parts/step | "
              f"{graph_ms(lambda: merge_states(parts, lses, out=out)):7.4f} ms", flush=True)
    del case
    own = make_case([1] * b, [n_own] * b)  # the suffix pass's work: 64 requests x 100 keys
    own_out = torch.empty_like(own.q)
    suffix = lambda own=own: split_decode_attention(  # noqa: E731
        own.q, own.cache.k, own.cache.v, own_out, seq_lens=own.meta.seq_lens, block_table=own.meta.block_table,
        max_seq_len=n_own, scale=SCALE, num_splits=1)
    print(f"cascade  | {b}x{n_own} decode alone (the suffix pass's work)            | {graph_ms(suffix):7.4f} ms",
          flush=True)
    del own


SECTIONS = {"quant": section_quant, "decode": section_decode, "prefill": section_prefill,
            "mixed": section_mixed, "split": section_split, "bench-mixed": section_bench_mixed,
            "cascade": section_cascade, "chunk": section_chunk}


def main(argv: list[str]) -> int:
    device = "CPU interpreter (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"# {device} triton {triton.__version__} torch {torch.__version__}", flush=True)
    chosen = [a for a in argv if a != "--smoke"] or ["prefill", "split", "bench-mixed", "decode", "cascade", "quant",
                                                      "mixed", "chunk"]
    for name in chosen:
        SECTIONS[name]()
        torch.cuda.empty_cache()
    print(f"# total {time.time() - T0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
