"""bf16 accuracy of every paged backend inside ``generate_batch``, and CUDA graphs against eager.

A random-initialised Qwen3-8B-shaped model (32 query heads, 8 KV heads, head_dim 128, hidden
4096; 4 layers by default), 8 random prompts of 1 to 511 tokens prefilled in one step. The
oracle is transformers' own paged path in **fp32**; every other row runs the bf16 model and
reports the max and mean absolute error of its first-step logits (the lm_head rows of the
prompts' last tokens, fp32 vocabulary logits) against it:

- each paged backend (``reference``, ``triton-unified``, ``flashinfer``, or ``--backends``) through ``generate_batch``;
- transformers' own bf16 paths: its paged SDPA path through ``generate_batch``, and plain
  ``sdpa`` and ``eager`` forwards of each prompt alone (no continuous batching).

Then, for every paged backend that claims CUDA graphs (and transformers' paged SDPA path), the
greedy tokens of ``generate_batch(use_cuda_graph=True)`` against the same run eagerly. A row
that fails prints its error in the table (and its traceback on stderr); the others still run.

    python integrations/transformers/gpu_accuracy.py              # GPU: both tables
    python integrations/transformers/gpu_accuracy.py --json a.json
    python integrations/transformers/gpu_accuracy.py --small      # a tiny CPU smoke run

Nothing is downloaded: the model is built from a config, the prompts are random token ids.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch
from paged_transformers import describe_environment, qwen3_shaped_model

PROMPT_LENGTHS = [5, 17, 64, 130, 257, 511, 1, 40]


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--backends", default="reference,triton-unified,flashinfer")
    p.add_argument("--new-tokens", type=int, default=8, help="greedy tokens compared eager vs CUDA graphs")
    p.add_argument("--block-size", type=int, default=256)
    p.add_argument("--json", default="", help="also write the rows to this file")
    p.add_argument("--small", action="store_true", help="a tiny CPU smoke run (small dims, fp32 and bf16 on CPU)")
    return p.parse_args(argv)


def own_paged_name() -> str:
    import paged_transformers
    import transformers

    return "sdpa" if paged_transformers.hook_of(transformers.__version__) == "gathered" else "paged|sdpa"


def cb_generate(model, implementation, prompts, args, *, new_tokens, use_cuda_graph=False):
    """(first-step logits [R, vocab] in request order, greedy tokens per request)."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation(implementation)
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, a, out: logits.append(out.detach().float()[0]))
    total = sum(len(p) for p in prompts)
    options = dict(
        num_blocks=64,
        max_batch_tokens=max(total, 64),
        max_requests_per_batch=len(prompts),
        use_cuda_graph=use_cuda_graph,
        allow_block_sharing=False,
    )
    if "page_size" in ContinuousBatchingConfig.__dataclass_fields__:  # 5.24
        options.update(page_size=args.block_size, auto_switch_to_flash=False)
    else:
        options.update(block_size=args.block_size)
    gen = GenerationConfig(max_new_tokens=new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        out = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**options)
        )
    finally:
        hook.remove()
    ids = sorted(out, key=lambda r: int(r.split("_")[-1]))
    errors = [f"{r}: {out[r].error}" for r in ids if out[r].error]
    if errors:
        raise RuntimeError(errors[0])
    # Every prompt fits the first step, so its kept rows are the prompts' last tokens, in order.
    first = logits[0]
    if first.shape[0] != len(prompts):
        raise RuntimeError(f"the first step kept {first.shape[0]} rows for {len(prompts)} prompts")
    return first, [out[r].generated_tokens for r in ids]


def plain_forward(model, implementation, prompts):
    """Last-token logits of each prompt run alone through a plain forward ([R, vocab])."""
    model.set_attn_implementation(implementation)
    rows = []
    with torch.no_grad():
        for p in prompts:
            ids = torch.tensor([p], device=model.device)
            rows.append(model(input_ids=ids, use_cache=False).logits[0, -1].float())
    return torch.stack(rows)


def _error(exc: Exception) -> str:
    traceback.print_exc(file=sys.stderr)
    first = str(exc).splitlines()[0][:160] if str(exc) else ""
    return f"{type(exc).__name__}: {first}"


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
        if not args.small:
            print("no CUDA device: use --small for a CPU smoke run", file=sys.stderr)
            return 2
    if args.small:
        args.layers, args.block_size, args.new_tokens = 2, 16, 3
    import paged_core
    import paged_transformers

    lengths = [min(n, 40) for n in PROMPT_LENGTHS] if args.small else PROMPT_LENGTHS
    print(f"# generate_batch accuracy and CUDA graphs, {describe_environment()}")
    print(
        f"# Qwen3-shaped, {args.layers} layers, prompts of {lengths} tokens, block_size {args.block_size}", flush=True
    )
    model = qwen3_shaped_model(args.layers, small=args.small, dtype=torch.float32, device=device)
    g = torch.Generator().manual_seed(0)
    prompts = [torch.randint(0, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]
    own = own_paged_name()
    ref, _ = cb_generate(model, own, prompts, args, new_tokens=1)
    model = model.to(torch.bfloat16)
    if device == "cuda":
        torch.cuda.empty_cache()

    paged = []
    for backend in [b for b in args.backends.split(",") if b]:
        reasons = (
            paged_core.registry.unavailable(backend)
            if backend in paged_core.registry.names()
            else [f"not installed (installed: {', '.join(paged_core.registry.names())})"]
        )
        paged.append((backend, reasons))

    accuracy = []
    print("\n| bf16 path (vs fp32 transformers paged) | max abs err | mean abs err |")
    print("|---|---|---|", flush=True)
    rows = [
        (
            f"paged {b}",
            (lambda b=b: cb_generate(model, paged_transformers.enable(b), prompts, args, new_tokens=1)[0]),
            why,
        )
        for b, why in paged
    ]
    rows += [
        (f"transformers {own} (generate_batch)", lambda: cb_generate(model, own, prompts, args, new_tokens=1)[0], [])
    ]
    rows += [
        (f"transformers {impl} (plain forward)", lambda impl=impl: plain_forward(model, impl, prompts), [])
        for impl in ("sdpa", "eager")
    ]
    for label, run, why in rows:
        row = {"path": label}
        if why:
            row["error"] = "unavailable: " + "; ".join(why)
        else:
            try:
                err = (run() - ref).abs()
                row.update(max_abs_err=err.max().item(), mean_abs_err=err.mean().item())
            except Exception as exc:  # reported in the table; the other rows still run
                row["error"] = _error(exc)
        accuracy.append(row)
        if "error" in row:
            print(f"| {label} | {row['error']} | |", flush=True)
        else:
            print(f"| {label} | {row['max_abs_err']:.3e} | {row['mean_abs_err']:.3e} |", flush=True)

    graphs = []
    if device == "cuda":
        print("\n| greedy tokens, CUDA graphs vs eager | same sequences | first difference |")
        print("|---|---|---|", flush=True)
        candidates = [(f"paged {b}", b, why) for b, why in paged]
        candidates.append((f"transformers {own}", None, []))
        for label, backend, why in candidates:
            row = {"path": label}
            if why:
                row["error"] = "unavailable: " + "; ".join(why)
            elif backend and not paged_transformers.captures_whole_steps(paged_core.registry.capabilities(backend)):
                # transformers captures whole steps, the plan included (paged-transformers refuses).
                row["error"] = "skipped: its capabilities do not claim CUDA graphs and a device-side plan"
            else:
                try:
                    name = paged_transformers.enable(backend) if backend else own
                    _, eager = cb_generate(model, name, prompts, args, new_tokens=args.new_tokens)
                    _, captured = cb_generate(
                        model, name, prompts, args, new_tokens=args.new_tokens, use_cuda_graph=True
                    )
                    same = [a == b for a, b in zip(eager, captured, strict=True)]
                    first = next(
                        (f"request {i}: {eager[i]} vs {captured[i]}" for i, s in enumerate(same) if not s), "-"
                    )
                    row.update(same=sum(same), requests=len(same), first_difference=first)
                except Exception as exc:  # reported in the table; the other rows still run
                    row["error"] = _error(exc)
            graphs.append(row)
            if "error" in row:
                print(f"| {label} | {row['error']} | |", flush=True)
            else:
                print(f"| {label} | {row['same']}/{row['requests']} | {row['first_difference'][:100]} |", flush=True)

    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": describe_environment(),
                    "prompt_lengths": lengths,
                    "accuracy": accuracy,
                    "cuda_graphs": graphs,
                },
                f,
                indent=2,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
