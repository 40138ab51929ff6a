"""Tiny random-initialised models and a generate_batch runner that records every logit.

Nothing is downloaded: the models are built from a config. They are fp32 and 2 layers deep,
with 4 query heads over 2 KV heads (groups of 2) and head_dim 32 (the smallest head_dim the
Triton backends serve). A larger initializer_range than the default makes the logits peaked
enough that greedy decoding does not hinge on float32 rounding.
"""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

# Triton's interpreter only where there is no GPU (CI); on a GPU the kernels must run compiled,
# or the GPU tests would time the interpreter (read when Triton is imported).
if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

transformers = pytest.importorskip("transformers", reason="paged-transformers' tests need transformers")
from paged_transformers._versions import hook_of  # noqa: E402
from transformers import GenerationConfig, LlamaConfig, Qwen3Config  # noqa: E402
from transformers.generation.configuration_utils import ContinuousBatchingConfig  # noqa: E402

#: The installed release's hook: "pool" (5.17, 5.18) or "gathered" (5.24, 5.25).
HOOK = hook_of(transformers.__version__)
#: transformers' own paged path in the installed release (the oracle): the gathered releases dropped the
#: ``paged|`` prefix of its SDPA path.
TRANSFORMERS_PAGED = "sdpa" if HOOK == "gathered" else "paged|sdpa"

MODEL_DIMS = dict(
    hidden_size=64,
    intermediate_size=128,
    num_hidden_layers=2,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=128,
    max_position_embeddings=512,
    initializer_range=0.2,
)


def tiny_model(kind: str, **overrides):
    """A random-initialised fp32 ``kind`` ("qwen3" or "llama") model in eval mode, seed 0."""
    torch.manual_seed(0)
    config_cls = {"qwen3": Qwen3Config, "llama": LlamaConfig}[kind]
    config = config_cls(**{**MODEL_DIMS, **overrides})
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


def random_prompts(lengths: list[int], *, seed: int = 1, prefix: int = 0) -> list[list[int]]:
    """Prompts of ``lengths`` random tokens, each after the same ``prefix`` random tokens."""
    g = torch.Generator().manual_seed(seed)
    shared = torch.randint(0, MODEL_DIMS["vocab_size"], (prefix,), generator=g).tolist()
    return [shared + torch.randint(0, MODEL_DIMS["vocab_size"], (n,), generator=g).tolist() for n in lengths]


@dataclasses.dataclass
class Run:
    tokens: dict[str, list[int]]
    logprobs: dict[str, list[float]]
    errors: dict[str, str | None]
    #: The lm_head output of every forward step, in order: [1, rows kept, vocab] each.
    logits: list[torch.Tensor]


def generate(model, implementation: str, prompts: list[list[int]], *, max_new_tokens: int, **cb_options) -> Run:
    """``model.generate_batch`` with ``implementation``, greedy, recording every step's logits."""
    model.set_attn_implementation(implementation)
    logits: list[torch.Tensor] = []
    hook = model.lm_head.register_forward_hook(lambda mod, args, out: logits.append(out.detach().clone()))
    # CUDA graphs only where a test asks: 5.24 takes the paged names for flash implementations
    # and would turn them on by itself on a GPU.
    options = dict(
        block_size=16,
        num_blocks=64,
        max_batch_tokens=64,
        return_logprobs=True,
        allow_block_sharing=False,
        use_cuda_graph=False,
    )
    if HOOK == "gathered":
        # 5.24 switches sdpa to flash-attention by itself where it is installed (a GPU): keep the
        # oracle on its SDPA path. block_size is its old name of page_size.
        options.update(auto_switch_to_flash=False, page_size=options.pop("block_size"))
        if "block_size" in cb_options:
            cb_options = {**cb_options, "page_size": cb_options["block_size"]}
            del cb_options["block_size"]
    options.update(cb_options)
    gen = GenerationConfig(max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=None, pad_token_id=0)
    try:
        out = model.generate_batch(
            prompts, generation_config=gen, continuous_batching_config=ContinuousBatchingConfig(**options)
        )
    finally:
        hook.remove()
    ids = sorted(out, key=lambda r: int(r.split("_")[-1]))
    return Run(
        tokens={r: out[r].generated_tokens for r in ids},
        logprobs={r: out[r].logprobs for r in ids},
        errors={r: out[r].error for r in ids},
        logits=logits,
    )
