"""MLA-shaped attention (DeepSeek-V3: V head dim below the QK head dim) under continuous batching.

transformers 5.25 serves MLA models in continuous batching with its own cache of compressed
latents (``MLACacheAllocator``: the KV latent and the rotated key per token); each layer expands
them to per-head K and V (``DeepseekV3Attention.expand_kv``) and hands the attention function
the gathered K of ``qk_nope_head_dim + qk_rope_head_dim`` and V of ``v_head_dim``. Paged reads
them as a cache of one-token blocks with V of its own head dim: no cache of paged's own and no
padding of V.
"""

from __future__ import annotations

import paged_transformers
import pytest
import torch
from conftest import HOOK, generate, random_prompts
from packaging.version import Version
from paged_transformers._attention import _ENABLED
from test_generate import MIXED, assert_same_generation

transformers = pytest.importorskip("transformers")
if HOOK != "gathered" or Version(transformers.__version__) < Version("5.25"):
    pytest.skip(
        f"transformers {transformers.__version__} has no continuous batching of MLA models "
        "(5.25 added it: MLACacheAllocator)",
        allow_module_level=True,
    )

QK_NOPE, QK_ROPE, V_DIM = 32, 32, 32  # QK head dim 64 over V head dim 32


@pytest.fixture(scope="module")
def model():
    from transformers import DeepseekV3Config

    torch.manual_seed(0)
    config = DeepseekV3Config(
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=4,
        n_routed_experts=4,
        n_shared_experts=1,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        first_k_dense_replace=1,
        kv_lora_rank=32,
        q_lora_rank=None,
        qk_nope_head_dim=QK_NOPE,
        qk_rope_head_dim=QK_ROPE,
        v_head_dim=V_DIM,
        vocab_size=128,
        max_position_embeddings=512,
        initializer_range=0.2,
    )
    return transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()


@pytest.fixture(scope="module")
def want(model):
    """transformers' own SDPA path under continuous batching: the oracle."""
    return generate(
        model, "sdpa", random_prompts(MIXED["lengths"]), max_new_tokens=MIXED["max_new_tokens"], **MIXED["cb"]
    )


@pytest.mark.parametrize("backend", ["reference", "triton-unified"])
def test_mla_model_matches_transformers(model, want, backend):
    name = paged_transformers.enable(backend)
    adapter = _ENABLED[name].backend
    dims = []
    original = adapter.forward

    def forward(q, cache, plan, **kw):
        dims.append((q.shape[-1], cache.head_dim, cache.head_dim_v))
        out = original(q, cache, plan, **kw)
        dims.append(tuple(out.shape[1:]))
        return out

    adapter.forward = forward
    try:
        run = generate(
            model, name, random_prompts(MIXED["lengths"]), max_new_tokens=MIXED["max_new_tokens"], **MIXED["cb"]
        )
    finally:
        del adapter.forward
    assert_same_generation(run, want)
    # Every call saw the MLA shapes, V unpadded, and returned V's head dim.
    assert set(dims) == {(QK_NOPE + QK_ROPE, QK_NOPE + QK_ROPE, V_DIM), (4, V_DIM)}
