"""paged's backends inside vLLM's GPU engine, next to vLLM's own: greedy tokens and throughput.

A Qwen3-8B-shaped model (36 layers, 32 query heads over 8 KV heads, head_dim 128) with vLLM's
dummy weights, rescaled once loaded so that greedy tokens do not hinge on rounding (linear
weights uniform in +-0.02, norm weights near 1); prompts are random token ids, so nothing is
downloaded and no tokenizer is needed. Each configuration runs in its own process::

    python integrations/vllm/gpu_generate.py run --backend paged:triton-unified --mode graphs \\
        --dtype bfloat16 --kv-cache-dtype auto --out row.json
    python integrations/vllm/gpu_generate.py table rows/*.json --json results.json

A run does two things with one engine:

- **check**: 8 prompts (3 to 20,000 tokens; two share a 600-token prefix, so prefix caching
  serves the second; the longest is prefilled in chunks next to the others' decodes), 32
  greedy tokens each, with the top-5 log-probabilities of the first;
- **throughput**: ``--prompts`` random prompts of ``--input-len`` tokens, ``--output-len`` new
  tokens each, ``ignore_eos`` (the shape of ``vllm bench throughput``), timed end to end.

``table`` compares the rows' tokens with a reference row of the same dtype and cache (vLLM's
own ``TRITON_ATTN`` by default) and prints the table of integrations/vllm/README.md.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import sys
import tempfile
import time

QWEN3_8B = {
    "architectures": ["Qwen3ForCausalLM"],
    "model_type": "qwen3",
    "hidden_size": 4096,
    "intermediate_size": 12288,
    "num_hidden_layers": 36,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 128,
    "vocab_size": 151936,
    "max_position_embeddings": 40960,
    "rope_theta": 1000000.0,
    "rms_norm_eps": 1e-6,
    "tie_word_embeddings": False,
    "hidden_act": "silu",
    "attention_bias": False,
    "torch_dtype": "bfloat16",
    "bos_token_id": 151643,
    "eos_token_id": 151645,
}
CHECK_LENS = [3, 17, 600, 650, 129, 1000, 20000, 64]
CHECK_TOKENS = 32
MAX_BATCHED_TOKENS = 8192


def model_dir(layers: int) -> str:
    folder = pathlib.Path(tempfile.gettempdir()) / f"qwen3-8b-shaped-{layers}"
    folder.mkdir(exist_ok=True)
    (folder / "config.json").write_text(json.dumps({**QWEN3_8B, "num_hidden_layers": layers}))
    return str(folder)


def check_prompts(seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    out = [torch.randint(1, 150000, (n,), generator=g).tolist() for n in CHECK_LENS]
    out[3] = out[2] + out[3][:50]  # shares prompt 2's 600 tokens: a prefix-cache hit
    return out


def rescale(model) -> None:
    """Peaked logits from dummy weights: linear weights x20 (uniform +-0.02), norms 1 + w."""
    import torch

    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:
                p.add_(1.0)
            else:
                p.mul_(20.0)


def run(args: argparse.Namespace) -> dict:
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine in this process: counters, model
    import importlib.util

    if importlib.util.find_spec("flashinfer") is None:
        # vLLM 0.26 imports FlashInfer for its top-k/top-p sampler on CUDA unless told not to.
        os.environ.setdefault("VLLM_USE_FLASHINFER_SAMPLER", "0")
    kind, name = args.backend.split(":", 1)
    if kind == "paged":
        os.environ["PAGED_VLLM_BACKEND"] = name
    import torch
    from vllm import LLM, SamplingParams, TokensPrompt

    started = time.perf_counter()
    llm = LLM(
        model=model_dir(args.layers),
        load_format="dummy",
        skip_tokenizer_init=True,
        dtype=args.dtype,
        kv_cache_dtype=args.kv_cache_dtype,
        enforce_eager=args.mode == "eager",
        attention_backend="CUSTOM" if kind == "paged" else name,
        max_model_len=args.max_model_len,
        max_num_batched_tokens=MAX_BATCHED_TOKENS,
        gpu_memory_utilization=0.85,
        seed=0,
        disable_log_stats=False,
    )
    llm.apply_model(rescale)
    startup_s = time.perf_counter() - started
    config = llm.llm_engine.vllm_config
    row = {
        "backend": args.backend,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "mode": args.mode,
        "layers": args.layers,
        "startup_s": round(startup_s, 1),
        "cudagraph_mode": str(config.compilation_config.cudagraph_mode),
        "attention": _attention_backends(llm),
    }
    # check: greedy tokens, first-step log-probabilities
    params = SamplingParams(temperature=0.0, max_tokens=CHECK_TOKENS, ignore_eos=True, logprobs=5)
    calls_before = _counters()
    outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in check_prompts()], params, use_tqdm=False)
    row["tokens"] = [list(o.outputs[0].token_ids) for o in outs]
    row["first_logprobs"] = [{str(t): lp.logprob for t, lp in o.outputs[0].logprobs[0].items()} for o in outs]
    row["check_calls"] = _diff(_counters(), calls_before)
    # throughput
    g = torch.Generator().manual_seed(2)
    prompts = [
        TokensPrompt(prompt_token_ids=torch.randint(1, 150000, (args.input_len,), generator=g).tolist())
        for _ in range(args.prompts)
    ]
    params = SamplingParams(temperature=0.0, max_tokens=args.output_len, ignore_eos=True)
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    outs = llm.generate(prompts, params, use_tqdm=False)
    elapsed = time.perf_counter() - t0
    generated = sum(len(o.outputs[0].token_ids) for o in outs)
    row.update(
        prompts=args.prompts,
        input_len=args.input_len,
        output_len=args.output_len,
        elapsed_s=round(elapsed, 3),
        output_tokens_per_s=round(generated / elapsed, 1),
        tokens_per_s=round((generated + args.prompts * args.input_len) / elapsed, 1),
        tpot_ms=_tpot_ms(outs),
    )
    return row


def _attention_backends(llm) -> list[str]:
    """The attention implementation classes the model's layers run (what served the tokens)."""

    def names(model):
        return sorted({type(m.impl).__qualname__ for m in model.modules() if hasattr(m, "impl")})

    return sorted({n for part in llm.apply_model(names) for n in part})


def _counters() -> dict[str, int]:
    try:
        from paged_vllm._backend import counters
    except ImportError:
        return {}
    return dict(counters)


def _diff(after: dict, before: dict) -> dict:
    return {k: after.get(k, 0) - before.get(k, 0) for k in after}


def _tpot_ms(outs) -> float | None:
    """Median time per output token after the first, over requests (vLLM's request stats)."""
    per = []
    for o in outs:
        m = getattr(o, "metrics", None)
        first, last, n = (
            getattr(m, "first_token_ts", 0.0),
            getattr(m, "last_token_ts", 0.0),
            len(o.outputs[0].token_ids),
        )
        if m is not None and n > 1 and last > first:
            per.append((last - first) / (n - 1))
    return round(1e3 * sorted(per)[len(per) // 2], 3) if per else None


def table(args: argparse.Namespace) -> None:
    rows = [json.loads(pathlib.Path(p).read_text()) for p in args.rows]
    rows = [r for r in rows if "tokens" in r]
    refs = {}
    for r in rows:  # reference: eager runs of the reference backend first, then graphs
        key = (r["dtype"], r["kv_cache_dtype"])
        if r["backend"] == args.reference and (key not in refs or r["mode"] == "eager"):
            refs[key] = r
    print(
        f"| backend | dtype | kv cache | mode | output tok/s | total tok/s | TPOT ms | greedy tokens "
        f"vs {args.reference} | max abs diff, first-step top-5 log-probs | paged forward calls |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|")
    out = []
    for r in rows:
        ref = refs.get((r["dtype"], r["kv_cache_dtype"]))
        match, same, diff = None, "—", "—"
        if ref is not None and ref is not r:
            equal = [a == b for a, b in zip(r["tokens"], ref["tokens"], strict=True)]
            match = all(equal)
            agree = [_common_prefix(a, b) for a, b in zip(r["tokens"], ref["tokens"], strict=True)]
            same = "all equal" if match else f"{sum(equal)}/{len(equal)} equal (first difference at {min(agree)})"
            diff = f"{_logprob_diff(r, ref):.2e}"
        calls = r.get("check_calls", {}).get("forward", "—")
        print(
            f"| {r['backend']} | {r['dtype']} | {r['kv_cache_dtype']} | {r['mode']} | "
            f"{r['output_tokens_per_s']:,.0f} | {r['tokens_per_s']:,.0f} | {r['tpot_ms']} | {same} | {diff} | "
            f"{calls} |"
        )
        out.append(
            {
                "backend": r["backend"],
                "dtype": r["dtype"],
                "kv_cache_dtype": r["kv_cache_dtype"],
                "mode": r["mode"],
                "tokens_per_s": r["tokens_per_s"],
                "output_tokens_per_s": r["output_tokens_per_s"],
                "tpot_ms": r["tpot_ms"],
                "tokens_match": match,
                "reference": None if ref is None or ref is r else f"{ref['backend']} ({ref['mode']})",
                "cudagraph_mode": r["cudagraph_mode"],
                "attention": r["attention"],
                "prompts": r["prompts"],
                "input_len": r["input_len"],
                "output_len": r["output_len"],
            }
        )
    if args.json:
        pathlib.Path(args.json).write_text(json.dumps(out, indent=1) + "\n")


def _common_prefix(a: list[int], b: list[int]) -> int:
    n = 0
    while n < min(len(a), len(b)) and a[n] == b[n]:
        n += 1
    return n


def _logprob_diff(r: dict, ref: dict) -> float:
    worst = 0.0
    for mine, theirs in zip(r["first_logprobs"], ref["first_logprobs"], strict=True):
        for tok in set(mine) & set(theirs):
            worst = max(worst, abs(mine[tok] - theirs[tok]))
    return worst


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    sub = parser.add_subparsers(dest="command", required=True)
    r = sub.add_parser("run", help="one configuration in this process; writes its row as JSON")
    r.add_argument(
        "--backend",
        required=True,
        help="paged:NAME (a paged registry name) or vllm:NAME "
        "(vLLM's AttentionBackendEnum member, e.g. FLASH_ATTN, TRITON_ATTN)",
    )
    r.add_argument(
        "--mode",
        choices=["eager", "graphs"],
        default="graphs",
        help="eager: enforce_eager; graphs: vLLM's defaults (torch.compile and CUDA graphs)",
    )
    r.add_argument("--dtype", default="bfloat16")
    r.add_argument("--kv-cache-dtype", default="auto")
    r.add_argument("--layers", type=int, default=36)
    r.add_argument("--prompts", type=int, default=256)
    r.add_argument("--input-len", type=int, default=1000)
    r.add_argument("--output-len", type=int, default=200)
    r.add_argument("--max-model-len", type=int, default=21000)
    r.add_argument("--out", required=True)
    t = sub.add_parser("table", help="the rows as a Markdown table, tokens checked against a reference")
    t.add_argument("rows", nargs="+")
    t.add_argument("--reference", default="vllm:TRITON_ATTN")
    t.add_argument("--json", help="write the rows of record here")
    args = parser.parse_args(argv)
    if args.command == "run":
        try:
            row = run(args)
        except Exception:  # the row says what failed; the driver goes on with the next
            import traceback

            row = {
                "backend": args.backend,
                "mode": args.mode,
                "dtype": args.dtype,
                "kv_cache_dtype": args.kv_cache_dtype,
                "error": traceback.format_exc()[-4000:],
            }
            print(row["error"], file=sys.stderr)
        pathlib.Path(args.out).write_text(json.dumps(row) + "\n")
        print(json.dumps({k: v for k, v in row.items() if k not in ("tokens", "first_logprobs")}), flush=True)
    else:
        table(args)


if __name__ == "__main__":
    main()
