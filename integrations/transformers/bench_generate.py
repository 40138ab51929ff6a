"""End-to-end ``generate_batch`` throughput: every installed paged backend next to transformers' own paths.

A random-initialised Qwen3-8B-shaped model (32 query heads, 8 KV heads, head_dim 128, hidden
4096; 4 layers by default) in bfloat16, 24 prompts of 11 to 1,482 tokens, 16 new tokens each,
greedy. Each implementation runs eagerly and with transformers' CUDA graphs; the table gives
generated tokens per second (median of ``--repeats`` timed runs), the seconds of the first run
(which builds transformers' manager: its warm-up, graph captures, our kernels' compiles), whether
every request's tokens equal those of transformers' own SDPA path run eagerly (``paged|sdpa``;
``sdpa`` from 5.24), and the largest difference of the first generated token's log-probability
against an fp32 run of that path (the bf16 accuracy of the whole model, attention included). The timed runs reuse
the first run's manager (``persistent_manager=True``), captured graphs included, as a server
keeps one between requests.

    pip install --no-build-isolation --no-deps -e integrations/transformers
    python integrations/transformers/bench_generate.py                  # GPU: the full table
    python integrations/transformers/bench_generate.py --json out.json  # and the rows as JSON
    python integrations/transformers/bench_generate.py --small          # a tiny CPU smoke run

Nothing is downloaded: the model is built from a config, the prompts are random token ids.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import statistics
import sys
import time
import traceback

import torch
from paged_transformers import describe_environment, qwen3_shaped_model
from paged_transformers._versions import hook_of


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--prompts", type=int, default=24)
    p.add_argument("--min-prompt", type=int, default=11)
    p.add_argument("--max-prompt", type=int, default=1482)
    p.add_argument("--new-tokens", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3, help="timed runs per row (the median is reported)")
    p.add_argument("--block-size", type=int, default=256, help="transformers' cache block size (its default)")
    p.add_argument(
        "--num-blocks",
        type=int,
        default=256,
        help="cache blocks (256 x 256 tokens hold the 24 requests 3.6 times over)",
    )
    p.add_argument("--max-batch-tokens", type=int, default=4096)
    p.add_argument("--backends", default="", help="comma-separated paged backends (default: every available one)")
    p.add_argument(
        "--transformers-paths",
        default="",
        help="transformers' own implementations to time next to them (unavailable ones are reported; "
        "default: its SDPA, eager and FlashAttention 2 paths in the installed release)",
    )
    p.add_argument("--modes", default="eager,graphs")
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument(
        "--small", action="store_true", help="a tiny CPU smoke run (2 layers, small dims, 4 short prompts, fp32)"
    )
    return p.parse_args(argv)


def make_prompts(args, vocab: int) -> list[list[int]]:
    g = torch.Generator().manual_seed(0)
    n = args.prompts
    lengths = [round(args.min_prompt + (args.max_prompt - args.min_prompt) * i / max(n - 1, 1)) for i in range(n)]
    # Interleave long and short prompts, as arrivals would.
    order = torch.randperm(n, generator=g).tolist()
    return [torch.randint(0, vocab, (lengths[i],), generator=g).tolist() for i in order]


def generate(model, implementation, prompts, args, use_cuda_graph, persistent=False):
    """One ``generate_batch`` call: (seconds, tokens, log-probabilities) per request.

    ``persistent``: keep transformers' continuous-batching manager, with its cache and captured
    CUDA graphs, for the next call (``persistent_manager=True``), as a server keeps it between
    requests; the next call reuses it. Without it every call builds a manager, warms it up
    (capturing graphs at the largest sizes) and captures each new step shape again."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation(implementation)
    gen = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    cb = ContinuousBatchingConfig(
        block_size=args.block_size,
        num_blocks=args.num_blocks,
        max_batch_tokens=args.max_batch_tokens,
        return_logprobs=True,
        use_cuda_graph=use_cuda_graph,
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = model.generate_batch(
        prompts, generation_config=gen, continuous_batching_config=cb, persistent_manager=persistent
    )
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    seconds = time.perf_counter() - t0
    ids = sorted(out, key=lambda r: int(r.split("_")[-1]))
    errors = [out[r].error for r in ids if out[r].error]
    if errors:
        raise RuntimeError(errors[0])
    return seconds, [out[r].generated_tokens for r in ids], [out[r].logprobs for r in ids]


def transformers_own() -> list[str]:
    """transformers' own continuous-batching paths in the installed release, its SDPA path first
    (the oracle): 5.24 renamed ``paged|sdpa`` and ``paged|flash_attention_2`` to the plain names."""
    import transformers

    if hook_of(transformers.__version__) == "gathered":
        return ["sdpa", "paged|eager", "flash_attention_2"]
    return ["paged|sdpa", "paged|eager", "paged|flash_attention_2"]


def implementations(args) -> list[tuple[str, str, bool]]:
    """(label, attention-implementation name or why not, whether it claims CUDA graphs) of every row."""
    import paged_core
    import paged_transformers
    import transformers.utils as tu

    rows = []
    for name in [p for p in args.transformers_paths.split(",") if p] or transformers_own():
        if "flash_attention_2" in name and not tu.is_flash_attn_2_available():
            rows.append((name, "unavailable: flash-attn is not installed", True))
            continue
        rows.append((name, name, True))
    wanted = [b for b in args.backends.split(",") if b] or paged_core.registry.names()
    for backend in wanted:
        reasons = (
            paged_core.registry.unavailable(backend) if backend in paged_core.registry.names() else ["not installed"]
        )
        if reasons:
            rows.append((f"paged: {backend}", "unavailable: " + "; ".join(reasons), False))
            continue
        # transformers captures whole steps, plan included.
        graphs = paged_transformers.captures_whole_steps(paged_core.registry.capabilities(backend))
        rows.append((f"paged: {backend}", paged_transformers.enable(backend), graphs))
    return rows


def main(argv=None) -> int:
    args = parse_args(argv)
    # transformers warns on every persistent generate_batch call that the manager is kept.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.ERROR)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.small:
            print("no CUDA device: use --small for a CPU smoke run", file=sys.stderr)
            return 2
    if args.small:
        args.layers, args.prompts, args.min_prompt, args.max_prompt = 2, 4, 1, 40
        args.new_tokens, args.repeats, args.block_size, args.num_blocks = 3, 1, 16, 64
        args.max_batch_tokens = 32
    modes = [m for m in args.modes.split(",") if m]
    if device == "cpu" and "graphs" in modes:
        modes.remove("graphs")  # transformers turns CUDA graphs off without CUDA anyway

    print(f"# generate_batch, {describe_environment()}")
    print(
        f"# Qwen3-shaped, {args.layers} layers, {args.prompts} prompts of {args.min_prompt}-{args.max_prompt} "
        f"tokens, {args.new_tokens} new tokens each, block_size {args.block_size}"
    )

    # The accuracy baseline: transformers' own paged path in fp32 on the same weights.
    model = qwen3_shaped_model(args.layers, small=args.small, dtype=torch.float32, device=device)
    prompts = make_prompts(args, model.config.vocab_size)
    oracle = transformers_own()[0]
    _, ref32_tokens, ref32_logprobs = generate(model, oracle, prompts, args, use_cuda_graph=False)
    dtype = torch.float32 if args.small else torch.bfloat16
    model = model.to(dtype)
    if device == "cuda":
        torch.cuda.empty_cache()

    rows = []
    baseline_tokens = None
    for label, impl, graphs_ok in implementations(args):
        for mode in modes:
            row = {"implementation": label, "mode": mode}
            if impl.startswith("unavailable") or (mode == "graphs" and not graphs_ok):
                row["error"] = impl if impl.startswith("unavailable") else "skipped: does not claim CUDA graphs"
                rows.append(row)
                print_row(row, header=len(rows) == 1)
                continue
            try:
                # The first run builds transformers' manager, warms it up (graph captures, our
                # kernels' compile and tuning); the timed runs reuse it, as a server does.
                graphs = mode == "graphs"
                first_s, _, _ = generate(model, impl, prompts, args, use_cuda_graph=graphs, persistent=True)
                timings = []
                for _ in range(args.repeats):
                    seconds, tokens, logprobs = generate(
                        model, impl, prompts, args, use_cuda_graph=graphs, persistent=True
                    )
                    timings.append(seconds)
                seconds = statistics.median(timings)
                generated = sum(len(t) for t in tokens)
                if baseline_tokens is None and impl == oracle and mode == "eager":
                    baseline_tokens = tokens
                first = [
                    abs(lp[0] - r[0])
                    for lp, r, t, rt in zip(logprobs, ref32_logprobs, tokens, ref32_tokens, strict=True)
                    if t[:1] == rt[:1]
                ]
                row.update(
                    tokens_per_s=generated / seconds,
                    seconds=seconds,
                    same_tokens_as_sdpa=None
                    if baseline_tokens is None
                    else sum(a == b for a, b in zip(tokens, baseline_tokens, strict=True)),
                    first_token_same_as_fp32=sum(t[:1] == r[:1] for t, r in zip(tokens, ref32_tokens, strict=True)),
                    first_logprob_err_vs_fp32=max(first) if first else None,
                    requests=len(tokens),
                    first_run_seconds=first_s,
                )
            except Exception as exc:  # a row that fails is reported, the others still run
                row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                if os.environ.get("BENCH_TRACEBACK"):
                    traceback.print_exc()
            finally:
                # The next row builds its own manager (another implementation or mode).
                model.destroy_cached_continuous_batching_manager()
            rows.append(row)
            print_row(row, header=len(rows) == 1)

    if args.json:
        with open(args.json, "w") as f:
            json.dump({"environment": describe_environment(), "args": vars(args), "rows": rows}, f, indent=2)
    return 0


def print_row(row: dict, header: bool) -> None:
    if header:
        print(
            f"| {'implementation':<34} | {'mode':<6} | {'tokens/s':>9} | {'s':>7} | {'first s':>7} | {'=sdpa':>6} "
            f"| {'1st=fp32':>8} | {'1st logprob err':>15} |"
        )
        print(f"|{'-' * 36}|{'-' * 8}|{'-' * 11}|{'-' * 9}|{'-' * 9}|{'-' * 8}|{'-' * 10}|{'-' * 17}|")
    if "error" in row:
        print(f"| {row['implementation']:<34} | {row['mode']:<6} | {row['error']}")
        return
    n = row["requests"]
    same = "-" if row["same_tokens_as_sdpa"] is None else f"{row['same_tokens_as_sdpa']}/{n}"
    err = "-" if row["first_logprob_err_vs_fp32"] is None else f"{row['first_logprob_err_vs_fp32']:.2e}"
    print(
        f"| {row['implementation']:<34} | {row['mode']:<6} | {row['tokens_per_s']:>9.1f} | {row['seconds']:>7.3f} "
        f"| {row['first_run_seconds']:>7.3f} | {same:>6} | {row['first_token_same_as_fp32']:>3}/{n:<4} | {err:>15} |",
        flush=True,
    )


if __name__ == "__main__":
    sys.exit(main())
