"""One GPU call: kernel configs of the Triton backends side by side, CUDA-graph replay times + a check.

A development aid (the numbers in docs/benchmarks.md come from ``paged bench``):
    python scripts/gpu_tune.py            # everything, ~4-5 minutes with compiles
    python scripts/gpu_tune.py quant split  # only some sections
    python scripts/gpu_tune.py --deadline 400 prefill split   # stop adding variants after 400 s
    TRITON_INTERPRET=1 python scripts/gpu_tune.py --smoke   # CPU: tiny shapes, checks only

Every variant runs a FIXED kernel config (no autotuning: one compile per variant), prints one
line ``section | variant | ms | % of floor (or TFLOP/s) | max abs err``, and is checked against
``paged_core.reference_attention`` (float32) on a few of its requests with the conformance
suite's tolerance; ``BAD`` flags an error beyond it. The batches, the timing (CUDA-graph
replays, as ``paged bench`` times them), the check and the floors are ``_harness.py``'s. With
``--deadline SECONDS`` a section stops adding variants once the whole run passes it.
"""

from __future__ import annotations

import argparse
import sys
import time

import _harness as H  # first: with --smoke it sets TRITON_INTERPRET before Triton is imported
import torch
import triton
from _harness import BS, DEV, HKV, SCALE, SMOKE, cfg, graph_ms, make_case, report, split_call, tag, unified
from paged_triton_unified.launch import LaunchConfig
from paged_triton_unified.split_launch import choose_num_splits, split_decode_attention

# --------------------------------------------------------------------------------------------
# Sections
# --------------------------------------------------------------------------------------------


def section_decode() -> None:
    case = make_case([1] * 64, [4096] * 64)
    out = torch.empty_like(case.q)
    for small in [(128, 4, 2), (64, 2, 2), (64, 4, 3), (128, 4, 3)]:
        report("decode", f"64x4096 bf16 {tag(small)}", case, unified(case, out, cfg(small)), out)
    del case


def section_quant() -> None:
    for kv in ("int8", "fp8"):
        case = make_case([1] * 64, [4096] * 64, kv_dtype=kv)
        out = torch.empty_like(case.q)
        path = "codes->bf16" if kv == "int8" else "fp16 dots"
        smalls = [(128, 4, 2), (64, 4, 2), (64, 4, 3), (64, 8, 2)]
        if kv == "int8":
            smalls += [(128, 8, 2), (32, 4, 3)]
        for small in smalls:
            report("quant", f"64x4096 {kv} ({path}) {tag(small)}", case, unified(case, out, cfg(small)), out)
        del case


def section_prefill() -> None:
    case = make_case([2048] * 8, [2048] * 8, check_reqs=[0, 7])
    out = torch.empty_like(case.q)
    for large, bq in [
        ((64, 8, 2), 32),
        ((64, 8, 3), 32),
        ((128, 8, 2), 32),
        ((64, 4, 2), 16),
        ((64, 4, 3), 16),
        ((128, 4, 2), 16),
    ]:
        report(
            "prefill",
            f"8x2048 {tag(None, large, bq)}",
            case,
            unified(case, out, cfg((64, 4, 2), large, bq)),
            out,
            tflops=True,
        )
    # Does the fused launch's decode branch (unused here) cost the prefill branch registers?
    # The same large config, decode branch at 64 / 128 keys.
    for small in [(64, 4, 2), (128, 4, 2)]:
        for large in [(64, 8, 2), (128, 8, 2)]:
            report(
                "prefill",
                f"8x2048 decode branch {small[0]} keys {tag(None, large, 32)}",
                case,
                unified(case, out, cfg(small, large, 32)),
                out,
                tflops=True,
            )
    del case


def section_mixed() -> None:
    qlens = [512, 512] + [1] * 30
    slens = [1024, 1536] + [1990 + i for i in range(30)]
    case = make_case(qlens, slens, check_reqs=[0, 1, 2, 31])
    out = torch.empty_like(case.q)
    for small, large, bq in [
        ((64, 8, 2), (64, 8, 2), 32),
        ((64, 4, 2), (64, 4, 2), 16),
        ((128, 4, 2), (64, 4, 2), 16),
        ((32, 4, 2), (64, 4, 2), 16),
    ]:
        # The launch runs num_warps/num_stages of `large`; `small` gives only the small tiles' BLOCK_N.
        report("mixed", f"2x512+30 {tag(small, large, bq)}", case, unified(case, out, cfg(small, large, bq)), out)
    del case


def section_split() -> None:
    sms = 132 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    for b, n in [(4, 32768), (1, 131072), (16, 8192)]:
        case = make_case([1] * b, [n] * b, check_reqs=[0])
        out = torch.empty_like(case.q)
        auto = choose_num_splits(b, HKV, n, BS, DEV)
        variants = [
            (f"auto ({auto} splits)", auto, kc)
            for kc in [(64, 4, 2), (64, 4, 3), (64, 4, 4), (64, 8, 3), (128, 4, 2), (128, 4, 3)]
        ]
        for s in sorted({max(1, auto // 2), auto * 2, 1} - {auto}):
            variants.append((f"{s} splits", s, (64, 4, 3)))
        for name, splits, kc in variants:
            report(
                "split",
                f"{b}x{n} {name} {kc[0]}/w{kc[1]}/st{kc[2]} ({sms} SMs)",
                case,
                split_call(case, out, splits, kc),
                out,
            )
        del case


def section_split_count() -> None:
    """The split count of split decode: around ``choose_num_splits``, at the counts that put a
    whole number of programs on every SM, and below its 256 tokens per split and above its cap of
    32, at the two configs the autotuner picks from most (128 keys / 4 warps / 2 stages, 64 / 4 / 3)."""
    sms = 132 if SMOKE else torch.cuda.get_device_properties(0).multi_processor_count
    for b, n in [(1, 32768), (1, 131072), (4, 32768), (16, 8192), (2, 4096), (4, 4096), (8, 4096)]:
        case = make_case([1] * b, [n] * b, check_reqs=[0])
        out = torch.empty_like(case.q)
        auto = choose_num_splits(b, HKV, n, BS, DEV)
        pairs = b * HKV
        counts = {auto, max(1, auto // 2), auto * 3 // 2, auto * 2, *(max(1, k * sms // pairs) for k in (1, 2, 3, 4))}
        for splits in sorted(c for c in counts if c <= max(1, n // 128)):
            for kc in ((128, 4, 2), (64, 4, 3)):
                if n // splits < kc[0] // 2:
                    continue
                mark = " (auto)" if splits == auto else ""
                name = f"{b}x{n} {splits} splits{mark}: {splits * pairs} programs {tag(kc)}"
                report("split-count", f"{name} ({sms} SMs)", case, split_call(case, out, splits, kc), out)
        del case


def section_quant_depth() -> None:
    """8-bit caches read half the bytes per key step: do deeper pipelines, wider steps, more
    warps or more programs (split counts) buy the bytes in flight that bf16 gets from 2 stages?
    And is the per-key scale gather the cost (the same batch with one static scale per tensor,
    and with per-slot scales stored head-major, so a program's scales are contiguous)?"""
    for kv in ("int8", "fp8"):
        static = make_case([1] * 64, [4096] * 64, kv_dtype=kv, static_scales=True)
        out = torch.empty_like(static.q)
        for small in [(128, 4, 2), (128, 8, 2)]:
            report(
                "q-depth",
                f"64x4096 {kv} static scales unified {tag(small)}",
                static,
                unified(static, out, cfg(small)),
                out,
            )
        del static
        head_major = make_case([1] * 64, [4096] * 64, kv_dtype=kv, head_major_scales=True)
        for small in [(128, 4, 2), (128, 8, 2)]:
            report(
                "q-depth",
                f"64x4096 {kv} head-major scales unified {tag(small)}",
                head_major,
                unified(head_major, out, cfg(small)),
                out,
            )
        del head_major
        case = make_case([1] * 64, [4096] * 64, kv_dtype=kv)
        out = torch.empty_like(case.q)
        for small in [
            (128, 4, 2),
            (128, 4, 3),
            (128, 4, 4),
            (128, 8, 2),
            (128, 8, 3),
            (256, 8, 2),
            (256, 8, 3),
            (64, 4, 4),
            (64, 2, 4),
        ]:
            report("q-depth", f"64x4096 {kv} unified {tag(small)}", case, unified(case, out, cfg(small)), out)
        for splits in (2, 4):
            for kc in ((128, 4, 2), (128, 4, 3), (128, 8, 2)):
                report(
                    "q-depth",
                    f"64x4096 {kv} split {splits} {kc[0]}/w{kc[1]}/st{kc[2]}",
                    case,
                    split_call(case, out, splits, kc),
                    out,
                )
        del case


def section_quant_occupancy() -> None:
    """Quantized decode tiles take more registers than bf16's (int8 64/4/3: 144 a thread, 3
    programs per SM; bf16 125, 4): which programs-per-SM and stage counts run each format
    fastest? Each format at 2-warp configs around the autotuner's best (64/2/3 on an H100,
    docs/results/2026-12-07-h100-quant-decode-configs.txt), a 4-warp one and a register cap."""
    for kv in ("auto", "int8", "fp8", "int4", "kivi4"):
        for b, n in ((64, 4096), (256, 1024)) if kv in ("int8", "int4") else ((64, 4096),):
            case = make_case([1] * b, [n] * b, kv_dtype=kv)
            out = torch.empty_like(case.q)
            smalls = [(64, 2, 2), (64, 2, 3), (64, 2, 4), (32, 2, 4), (128, 2, 3), (128, 4, 2), (64, 4, 2, 128)]
            for small in smalls:
                report("q-occ", f"{b}x{n} {kv} {tag(small)}", case, unified(case, out, cfg(small)), out)
            del case


def section_small_decode() -> None:
    """Decodes of 1-4 requests x 4,096 keys (latency-bound: a few microseconds of data): split
    counts x kernel configs, around ``choose_num_splits``."""
    for b in (1, 2, 4):
        case = make_case([1] * b, [4096] * b, check_reqs=[0])
        out = torch.empty_like(case.q)
        auto = choose_num_splits(b, HKV, 4096, BS, DEV)
        for splits in sorted({auto, 4, 8, 12, 16, 32}):
            for kc in ((32, 2, 2), (64, 2, 2), (64, 4, 2), (64, 4, 3), (128, 4, 2)):
                if 4096 // splits < kc[0]:
                    continue
                name = f"{b}x4096 {splits} splits{' (auto)' if splits == auto else ''} {kc[0]}/w{kc[1]}/st{kc[2]}"
                report("small", name, case, split_call(case, out, splits, kc), out)
        del case


def section_bench_mixed() -> None:
    """The mixed batch of ``paged bench`` (chunk contexts 1,024 and 3,072: heavier than
    section_mixed's), so fixed configs compare with the bench's FlashInfer row (docs/benchmarks.md,
    the run of record)."""
    g = torch.Generator().manual_seed(0)
    dec = [2000 + int(x) for x in torch.randint(-100, 101, (30,), generator=g)]
    case = make_case([1] * 30 + [512, 512], dec + [1024 + 512, 3072 + 512], check_reqs=[0, 30, 31])
    out = torch.empty_like(case.q)
    for small, large, bq in [
        ((128, 4, 2), (64, 4, 2), 16),
        ((128, 4, 2), (64, 8, 2), 16),
        ((128, 4, 2), (128, 8, 2), 16),
        ((64, 4, 2), (64, 4, 2), 16),
        ((128, 4, 2), (64, 8, 2), 32),
        ((128, 4, 2), (64, 4, 3), 16),
    ]:
        report("mixed-b", f"bench batch {tag(small, large, bq)}", case, unified(case, out, cfg(small, large, bq)), out)
    report("mixed-b", "bench batch autotuned", case, unified(case, out, None), out)
    del case


def section_mixed_parts() -> None:
    """The bench's mixed batch and its two halves, each alone and one after the other: its 2
    prefill chunks (through the unified kernel, 64- and 128-row tiles) and its 30 decodes
    (through the unified kernel, and split along their keys by the split kernel). Says whether the
    fused launch loses to its own parts run back to back, and which part is the time."""
    g = torch.Generator().manual_seed(0)
    dec = [2000 + int(x) for x in torch.randint(-100, 101, (30,), generator=g)]
    whole = make_case([1] * 30 + [512, 512], dec + [1024 + 512, 3072 + 512], check_reqs=[0, 30, 31])
    out = torch.empty_like(whole.q)
    report("parts", "whole batch, fused launch, autotuned", whole, unified(whole, out, None), out)
    for bq in (16, 32):
        report(
            "parts",
            f"whole batch, fused launch, {bq * 4}-row tiles, autotuned",
            whole,
            unified(whole, out, LaunchConfig(block_q_small=4, block_q_large=bq)),
            out,
        )
    del whole
    pre = make_case([512, 512], [1024 + 512, 3072 + 512], check_reqs=[0, 1])
    pre_out = torch.empty_like(pre.q)
    dcase = make_case([1] * 30, dec, check_reqs=[0, 29])
    d_out = torch.empty_like(dcase.q)
    pre_calls = {bq: unified(pre, pre_out, LaunchConfig(block_q_small=4, block_q_large=bq)) for bq in (16, 32)}
    for bq, fn in pre_calls.items():
        report("parts", f"2 chunks alone, {bq * 4}-row tiles, autotuned", pre, fn, pre_out, tflops=True)
    d_unified = unified(dcase, d_out, None)
    report("parts", "30 decodes alone, unified kernel", dcase, d_unified, d_out)
    d_splits = {}
    for n in (None, 2, 3, 4):
        d_splits[n] = lambda n=n: split_decode_attention(
            dcase.q,
            dcase.cache.k,
            dcase.cache.v,
            d_out,
            seq_lens=dcase.meta.seq_lens,
            block_table=dcase.meta.block_table,
            max_seq_len=max(dec),
            scale=SCALE,
            num_splits=n,
        )
        report("parts", f"30 decodes alone, split-KV ({n or 'auto'} splits)", dcase, d_splits[n], d_out)
    d_split = d_splits[2]
    if SMOKE:
        return
    side = torch.cuda.Stream()

    def concurrent(p, d):
        def fn():
            cur = torch.cuda.current_stream()
            side.wait_stream(cur)
            with torch.cuda.stream(side):
                d()
            p()
            cur.wait_stream(side)

        return fn

    for bq, p in pre_calls.items():
        for dname, d in (("unified", d_unified), ("2 splits", d_split)):
            ms = graph_ms(lambda p=p, d=d: (p(), d()))
            print(
                f"parts    | {bq * 4}-row chunks, then decodes ({dname}), one stream{'':9s} | {ms:7.4f} ms", flush=True
            )
            ms = graph_ms(concurrent(p, d))
            print(
                f"parts    | {bq * 4}-row chunks beside decodes ({dname}), two streams{'':6s} | {ms:7.4f} ms",
                flush=True,
            )


def section_launch() -> None:
    """What any kernel costs in these timings: one graph replay of one tiny kernel (the floor
    under every latency-bound decode, ours and FlashInfer's alike)."""
    x = torch.zeros(1, device=DEV)
    if SMOKE:
        return
    print(
        f"launch   | one graph replay of one 1-element kernel{'':17s} | {graph_ms(lambda: x.add_(1)):7.4f} ms",
        flush=True,
    )
    y = torch.zeros(1, device=DEV)
    print(
        f"launch   | one graph replay of two dependent 1-element kernels{'':6s} | "
        f"{graph_ms(lambda: (x.add_(1), y.add_(x))):7.4f} ms",
        flush=True,
    )


def section_chunk() -> None:
    """Chunked prefill after a long context next to decodes: 512 new tokens after 15,872 cached
    ones + 32 decodes at 4,096 (137 GFLOP: compute-bound). NVIDIA H200,
    2026-11-29: 64-row tiles 0.746 ms, 128-row 1.259; splitting the tiles' keys (reverted) 0.90-1.23."""
    case = make_case([512] + [1] * 32, [16384] + [4096] * 32, check_reqs=[0, 1, 32])
    out = torch.empty_like(case.q)
    for bq in (16, 32):
        report(
            "chunk",
            f"1x512@16k+32x4k {tag(None, (64, 4, 2), bq)}",
            case,
            unified(case, out, cfg((128, 4, 2), (64, 4, 2), bq)),
            out,
            tflops=True,
        )
    report("chunk", "1x512@16k+32x4k autotuned", case, unified(case, out, None), out, tflops=True)
    del case


def section_cascade() -> None:
    """64 decodes sharing 4,000 tokens (the same blocks) + 100 of their own: the cascade prefix
    pass with its keys split (auto) or not, against the unified kernel reading the prefix 64 x."""
    from paged_triton_unified.split_launch import cascade_attention, merge_states

    n_prefix, n_own, b = (64, 24, 3) if SMOKE else (4000, 100, 64)
    prefix_blocks = n_prefix // BS
    case = make_case([1] * b, [n_prefix + n_own] * b, check_reqs=[0, b - 1])
    table = case.meta.block_table
    table[:, :prefix_blocks] = table[0, :prefix_blocks]  # every request shares request 0's prefix
    out = torch.empty_like(case.q)
    m, c = case.meta, case.cache
    for name, splits in [
        ("prefix split auto", None),
        ("prefix in 1 pass", 1),
        ("4 prefix splits", 4),
        ("16 prefix splits", 16),
        ("32 prefix splits", 32),
    ]:
        fn = lambda splits=splits, q=case.q: cascade_attention(
            q,
            c.k,
            c.v,
            out,
            query_start_loc=m.query_start_loc,
            seq_lens=m.seq_lens,
            block_table=table,
            prefix_blocks=prefix_blocks,
            max_query_len=1,
            max_seq_len=m.max_seq_len,
            scale=SCALE,
            prefix_splits=splits,
        )
        report("cascade", f"{b}x({n_prefix}+{n_own}) cascade, {name}", case, fn, out)
    report("cascade", f"{b}x({n_prefix}+{n_own}) unified kernel", case, unified(case, out, cfg((128, 4, 2))), out)
    # Its parts alone: the merge of 9 parts (1 suffix + 8 prefix splits), and the suffix pass.
    parts = torch.randn(9, *case.q.shape, device=DEV)
    lses = torch.randn(9, *case.q.shape[:2], device=DEV)
    print(
        f"cascade  | merge_states alone, 9 parts x {tuple(case.q.shape)} | "
        f"{graph_ms(lambda: merge_states(parts, lses, out=out)):7.4f} ms",
        flush=True,
    )
    del case
    own = make_case([1] * b, [n_own] * b)  # the suffix pass's work: 64 requests x 100 keys
    own_out = torch.empty_like(own.q)
    suffix = lambda own=own: split_decode_attention(
        own.q,
        own.cache.k,
        own.cache.v,
        own_out,
        seq_lens=own.meta.seq_lens,
        block_table=own.meta.block_table,
        max_seq_len=n_own,
        scale=SCALE,
        num_splits=1,
    )
    print(
        f"cascade  | {b}x{n_own} decode alone (the suffix pass's work)            | {graph_ms(suffix):7.4f} ms",
        flush=True,
    )
    del own


SECTIONS = {
    "quant": section_quant,
    "decode": section_decode,
    "prefill": section_prefill,
    "mixed": section_mixed,
    "split": section_split,
    "split-count": section_split_count,
    "bench-mixed": section_bench_mixed,
    "quant-depth": section_quant_depth,
    "quant-occupancy": section_quant_occupancy,
    "small-decode": section_small_decode,
    "mixed-parts": section_mixed_parts,
    "launch": section_launch,
    "cascade": section_cascade,
    "chunk": section_chunk,
}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("sections", nargs="*", metavar="SECTION", help=f"any of {', '.join(SECTIONS)} (default: all)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU interpreter, checks only")
    ap.add_argument(
        "--deadline",
        type=float,
        default=None,
        metavar="SECONDS",
        help="stop adding variants once the run has taken this long (default: no deadline)",
    )
    args = ap.parse_args(argv)
    unknown = sorted(set(args.sections) - set(SECTIONS))
    if unknown:
        ap.error(f"unknown sections {unknown}; accepted: {', '.join(SECTIONS)}")
    H.DEADLINE_S = args.deadline
    device = "CPU interpreter (smoke)" if SMOKE else torch.cuda.get_device_name()
    print(f"# {device} triton {triton.__version__} torch {torch.__version__}", flush=True)
    for name in args.sections or ["prefill", "split", "bench-mixed", "decode", "cascade", "quant", "mixed", "chunk"]:
        SECTIONS[name]()
        if not SMOKE:
            torch.cuda.empty_cache()
    print(f"# total {time.time() - H.T0:.0f}s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
