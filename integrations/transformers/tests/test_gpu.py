"""On a CUDA GPU: transformers' CUDA graphs around paged backends, and bf16 accuracy.

Skipped on a machine without CUDA (these need a GPU to mean anything); the CPU tests cover
correctness in float32.
"""

from __future__ import annotations

import paged_transformers
import pytest
import torch
from conftest import TRANSFORMERS_PAGED, generate, random_prompts, tiny_model
from paged_core import registry

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graphs and bf16 kernels"),
]

GRAPH_BACKENDS = ["triton-unified", "triton-splitkv", "flashinfer", "flash-attn2"]


def _on_gpu(kind, dtype):
    return tiny_model(kind, head_dim=128, num_attention_heads=8, num_key_value_heads=2).to("cuda", dtype)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_cuda_graphs_give_the_eager_tokens(backend):
    reasons = registry.unavailable(backend) if backend in registry.names() else ["not installed"]
    if reasons:
        pytest.skip(f"{backend} cannot run here: {'; '.join(reasons)}")
    model = _on_gpu("qwen3", torch.bfloat16)
    name = paged_transformers.enable(backend)
    prompts = random_prompts([1, 7, 30, 65, 200, 3])
    cb = dict(block_size=256, num_blocks=16, max_batch_tokens=128)
    eager = generate(model, name, prompts, max_new_tokens=6, use_cuda_graph=False, **cb)
    graphs = generate(model, name, prompts, max_new_tokens=6, use_cuda_graph=True, **cb)
    assert eager.errors == {r: None for r in eager.errors}, eager.errors
    assert graphs.errors == {r: None for r in graphs.errors}, graphs.errors
    assert graphs.tokens == eager.tokens


def test_bf16_is_as_close_to_fp32_as_transformers_own_bf16_path():
    prompts = random_prompts([5, 40, 120, 1])
    cb = dict(block_size=256, num_blocks=16, max_batch_tokens=256)
    model = _on_gpu("llama", torch.float32)
    ref = generate(model, TRANSFORMERS_PAGED, prompts, max_new_tokens=1, **cb)
    model = model.to(torch.bfloat16)
    theirs = generate(model, TRANSFORMERS_PAGED, prompts, max_new_tokens=1, **cb)
    ours = generate(model, paged_transformers.enable("triton-unified"), prompts, max_new_tokens=1, **cb)

    def err(run):
        return max((a.float() - b.float()).abs().max().item() for a, b in zip(run.logits, ref.logits, strict=True))
    # transformers' own bf16 error, with 50% headroom for a different (but equally valid) rounding order.
    assert err(ours) <= 1.5 * err(theirs) + 1e-3, (err(ours), err(theirs))
