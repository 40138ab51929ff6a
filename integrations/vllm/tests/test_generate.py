"""vLLM's CPU build serving tiny models through paged backends: the same greedy tokens as vLLM's
own CPU attention, with paged's write, plan and forward provably on the path."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest
from conftest import MODEL_DIMS, generate, save_tiny_model

# The Triton kernel runs under its interpreter on the CPU: slow but exact enough for fp32.
PAGED_BACKENDS = ["reference", "triton-unified"]


@pytest.fixture(scope="session")
def own_run(model_dir):
    """vLLM's own CPU attention (CPU_ATTN) on each model, run once: the oracle."""
    with pytest.MonkeyPatch.context() as mp:
        return generate(model_dir, None, monkeypatch=mp)


def test_without_paged_vllm_runs_its_own_backend(own_run):
    run = own_run
    # The plugin is loaded (it registered CUSTOM) but a run that does not ask for it never calls it.
    assert run.calls == {"plan": 0, "write": 0, "forward": 0}
    assert all(len(t) == 8 for t in run.tokens)


@pytest.mark.parametrize("paged", PAGED_BACKENDS)
def test_same_greedy_tokens_as_vllm_cpu_attention(model_dir, own_run, paged, monkeypatch):
    want = own_run
    run = generate(model_dir, "CUSTOM", paged, monkeypatch=monkeypatch)
    assert run.tokens == want.tokens
    layers = MODEL_DIMS["num_hidden_layers"]
    # Every step was planned once and every layer wrote and read through paged.
    assert run.calls["plan"] == len(run.steps) > 0
    assert run.calls["forward"] == run.calls["write"] == layers * len(run.steps)
    # The scheduler mixed prompt chunks and decodes in one step at least once.
    assert any(1 in lens and max(lens) > 1 for lens in run.steps), run.steps


def test_unsupported_layer_is_refused_at_startup_naming_it(tmp_path, monkeypatch):
    """head_dim 24 is outside triton-unified's head dims: vLLM's engine does not start, and the
    error names each layer and the reason instead of failing inside a step."""
    from paged_core import UnsupportedSpecError

    model = save_tiny_model("llama", tmp_path, head_dim=24)
    with pytest.raises(UnsupportedSpecError) as err:
        generate(model, "CUSTOM", "triton-unified", monkeypatch=monkeypatch)
    message = str(err.value)
    for layer in range(MODEL_DIMS["num_hidden_layers"]):
        assert f"layer 'model.layers.{layer}.self_attn.attn': head_dim 24 is not supported (accepted: 32," in message


def test_sliding_window_layers(tmp_path, monkeypatch):
    """Qwen3 with every layer windowed to 8 tokens (prompts up to 90): vLLM hands the window to
    paged, and the tokens are vLLM's own CPU attention's with the same window."""
    model = save_tiny_model("qwen3", tmp_path, use_sliding_window=True, sliding_window=8, max_window_layers=0)
    want = generate(model, None, monkeypatch=monkeypatch)
    run = generate(model, "CUSTOM", "reference", monkeypatch=monkeypatch)
    assert run.windows == {8}
    assert run.tokens == want.tokens
    # The window decides these tokens: the same weights without it (same seed) give others, so
    # the equality above says the window reached paged (a dropped window would not pass it).
    plain = save_tiny_model("qwen3", tmp_path / "plain")
    assert generate(plain, "CUSTOM", "reference", monkeypatch=monkeypatch).tokens != run.tokens


def test_engine_in_its_own_processes(tiny_models, monkeypatch):
    """vLLM's default: the engine core and its worker are spawned processes, which load the
    plugin themselves (after unpickling the configuration that names the backend)."""
    model_dir = tiny_models["llama"]
    own_run = generate(model_dir, None, monkeypatch=monkeypatch)
    script = (
        "import os, sys, conftest\n"
        "os.environ['VLLM_ENABLE_V1_MULTIPROCESSING'] = '1'  # conftest turned it off; vLLM reads it lazily\n"
        "from vllm import LLM, SamplingParams, TokensPrompt\n"
        "llm = LLM(model=sys.argv[1], attention_backend='CUSTOM', **conftest.ENGINE)\n"
        "params = SamplingParams(temperature=0, max_tokens=8, detokenize=False, ignore_eos=True)\n"
        "outs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in conftest.prompts()], params)\n"
        "print('TOKENS', [list(o.outputs[0].token_ids) for o in outs])\n"
    )
    env = {
        **os.environ,
        "PAGED_VLLM_BACKEND": "reference",
        "PYTHONPATH": os.pathsep.join([str(pathlib.Path(__file__).parent), os.environ.get("PYTHONPATH", "")]),
    }
    done = subprocess.run(
        [sys.executable, "-c", script, model_dir], env=env, capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, done.stderr[-3000:]
    tokens = [line for line in done.stdout.splitlines() if line.startswith("TOKENS ")]
    assert tokens == [f"TOKENS {own_run.tokens}"], done.stdout[-2000:]
    # The worker process says which paged backend serves its layers.
    assert "paged-vllm: 2 attention layer(s) of this KV cache group run on paged backend 'reference'" in (
        done.stdout + done.stderr
    )


@pytest.mark.parametrize(("kv_cache_dtype", "kv_dtype"), [("fp8", "fp8"), ("fp8_e5m2", "fp8_e5m2")])
def test_fp8_cache_is_served_in_place_with_vllms_scales(tiny_models, kv_cache_dtype, kv_dtype, monkeypatch):
    """kv_cache_dtype="fp8" ("fp8_e5m2"): vLLM's uint8 pool holds e4m3 (e5m2) codes, value = code *
    the layer's per-tensor ``_k_scale`` / ``_v_scale``; paged serves it as an fp8 (fp8_e5m2) cache
    whose static scales are views of those very tensors, written and read in place.

    The oracle is the reference on the same cache: triton-unified gives its greedy tokens. Not
    vLLM's own fp8 run: on this tiny random model fp8 rounding alone flips greedy tokens (vLLM's
    CPU fp8 run differs from its full-precision run in 4 of 5 prompts, 2026-12-01), and vLLM's
    CPU kernel computes its fp8 attention in other precisions than paged's (it agrees with paged
    on the codes: both store round-to-nearest e4m3 of x / scale)."""
    import torch
    from paged_vllm import _backend

    model = tiny_models["llama"]
    full = generate(model, "CUSTOM", "reference", monkeypatch=monkeypatch)
    seen = []
    view = _backend.PagedAttentionImpl._view

    def recording_view(self, kv_cache, layer):
        cache = view(self, kv_cache, layer)
        same_scale = cache.k_scale.data_ptr() == layer._k_scale.data_ptr()
        seen.append((cache.kv_dtype, cache.static_scales, kv_cache.dtype, same_scale))
        return cache

    monkeypatch.setattr(_backend.PagedAttentionImpl, "_view", recording_view)
    runs = {
        paged: generate(model, "CUSTOM", paged, monkeypatch=monkeypatch, kv_cache_dtype=kv_cache_dtype)
        for paged in PAGED_BACKENDS
    }
    assert set(seen) == {(kv_dtype, True, torch.uint8, True)}
    for run in runs.values():
        assert run.calls["forward"] == run.calls["write"] > 0
    assert runs["triton-unified"].tokens == runs["reference"].tokens
    # The codes are fp8 indeed: quantization changes some greedy token of this model.
    assert runs["reference"].tokens != full.tokens


@pytest.mark.parametrize("kv_cache_dtype", ["int8_per_token_head", "fp8_per_token_head"])
def test_per_token_head_caches_are_paged_per_slot_caches(tiny_models, kv_cache_dtype, monkeypatch):
    """vLLM's per-token-head caches keep a float32 scale inline after each (slot, head)'s codes:
    paged's per-slot scales, read and written as views of vLLM's pool (its bytes), and the same
    greedy tokens through the reference and triton-unified."""
    from paged_vllm import _backend

    model = tiny_models["llama"]
    seen = []
    view = _backend.PagedAttentionImpl._view

    def recording_view(self, kv_cache, layer):
        cache = view(self, kv_cache, layer)
        storage = kv_cache.untyped_storage()
        inside = storage.data_ptr() <= cache.k_scale.data_ptr() < storage.data_ptr() + storage.nbytes()
        seen.append((cache.kv_dtype, cache.static_scales, inside, kv_cache.shape[-1]))
        return cache

    monkeypatch.setattr(_backend.PagedAttentionImpl, "_view", recording_view)
    runs = {
        paged: generate(model, "CUSTOM", paged, monkeypatch=monkeypatch, kv_cache_dtype=kv_cache_dtype)
        for paged in PAGED_BACKENDS
    }
    head = MODEL_DIMS["head_dim"]
    assert set(seen) == {(kv_cache_dtype[:4].rstrip("_"), False, True, 2 * (head + 4))}
    for run in runs.values():
        assert run.calls["forward"] == run.calls["write"] > 0
    assert runs["triton-unified"].tokens == runs["reference"].tokens
