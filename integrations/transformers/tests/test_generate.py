"""generate_batch through paged backends equals transformers' own paged path, token for token.

The oracle is transformers' ``paged|sdpa`` on the same model, prompts and scheduler settings:
the scheduler is deterministic, so both runs see the same batches, and every step's logits
(the lm_head rows transformers keeps) must agree, not only the sampled tokens.
"""

from __future__ import annotations

import paged_transformers
import pytest
from conftest import HOOK, TRANSFORMERS_PAGED, generate, random_prompts, tiny_model
from paged_core import registry
from paged_transformers import PagedAttention
from paged_transformers._attention import _ENABLED

#: Logits vs transformers' paged|sdpa in float32 on the CPU. Both compute attention in float32
#: over the same K/V; they differ only in summation order (a softmax over a different number
#: of padded keys, a different dot blocking), ~1e-7 relative per attention output, which the
#: two layers and the lm_head (logits of magnitude ~10) grow to a few 1e-6.
LOGITS_ATOL = 1e-5

# Chunked prefill (prompts of 33-64 tokens through a 24-token step), prompts of length 1, and
# more requests (8) than a batch holds (3).
MIXED = dict(
    lengths=[1, 5, 17, 33, 40, 1, 9, 64], max_new_tokens=5, cb=dict(max_batch_tokens=24, max_requests_per_batch=3)
)


@pytest.fixture(scope="module")
def models():
    return {kind: tiny_model(kind) for kind in ("qwen3", "llama")}


@pytest.fixture(scope="module")
def oracle(models):
    """transformers' own paged path, once per (model, scenario)."""
    memo = {}

    def get(kind, name, prompts, max_new_tokens, cb):
        if (kind, name) not in memo:
            memo[kind, name] = generate(models[kind], TRANSFORMERS_PAGED, prompts, max_new_tokens=max_new_tokens, **cb)
        return memo[kind, name]

    return get


def assert_same_generation(run, want):
    assert all(e is None for e in want.errors.values()), want.errors
    assert run.errors == {r: None for r in want.errors}, run.errors
    assert run.tokens == want.tokens
    assert len(run.logits) == len(want.logits), "the two runs did not take the same steps"
    for step, (a, b) in enumerate(zip(run.logits, want.logits, strict=True)):
        assert a.shape == b.shape, f"step {step}: logits {list(a.shape)} vs {list(b.shape)}"
        err = (a - b).abs().max().item()
        assert err <= LOGITS_ATOL, f"step {step}: logits differ by {err:.2e} > {LOGITS_ATOL:.0e}"
    for r in want.logprobs:
        diff = max(abs(x - y) for x, y in zip(run.logprobs[r], want.logprobs[r], strict=True))
        assert diff <= LOGITS_ATOL, f"{r}: log-probabilities differ by {diff:.2e}"


@pytest.mark.parametrize("kind", ["qwen3", "llama"])
def test_mixed_batches_match_transformers(models, oracle, kind):
    prompts = random_prompts(MIXED["lengths"])
    want = oracle(kind, "mixed", prompts, MIXED["max_new_tokens"], MIXED["cb"])
    name = paged_transformers.enable("reference")
    run = generate(models[kind], name, prompts, max_new_tokens=MIXED["max_new_tokens"], **MIXED["cb"])
    assert_same_generation(run, want)


def _spy_plans(name):
    """Record the BatchMeta of every plan the adapter makes (and count them)."""
    backend = _ENABLED[name].backend
    seen = []
    original = backend.plan

    def plan(meta, **layer):
        seen.append(meta)
        return original(meta, **layer)

    backend.plan = plan
    return seen, lambda: delattr(backend, "plan")


def test_prefix_sharing_matches_transformers(models, oracle, monkeypatch):
    # Three prompts after one 40-token prefix: with block sharing on, transformers hands the
    # later requests the first request's full prefix blocks.
    prompts = random_prompts([3, 7, 1], prefix=40)
    cb = dict(max_batch_tokens=64, max_requests_per_batch=4, allow_block_sharing=True)
    want = oracle("qwen3", "shared", prompts, 4, cb)
    name = paged_transformers.enable("reference")
    steps = []  # (cu_seq_lens_k, read slots) of layer 0 of every step

    def spy(self, module, *args, **kwargs):
        if module.layer_idx == 0:
            cu_k = kwargs["cu_seq_lens_k"]
            cu_k = cu_k["full_attention"] if isinstance(cu_k, dict) else cu_k
            steps.append((cu_k.tolist(), kwargs["read_index"][0].tolist()))
        return original(self, module, *args, **kwargs)

    original = PagedAttention.__call__
    monkeypatch.setattr(PagedAttention, "__call__", spy)
    run = generate(models["qwen3"], name, prompts, max_new_tokens=4, **cb)
    assert_same_generation(run, want)
    # The sharing happened: in some step two live requests read one slot of transformers' pool.
    shared = False
    for cu_k, reads in steps:
        if not reads:
            continue
        rows = [set(reads[a:b]) for a, b in zip(cu_k, cu_k[1:], strict=False) if b > a]
        shared |= any(rows[i] & rows[j] for i in range(len(rows)) for j in range(i + 1, len(rows)))
    assert shared, "no step had two requests on one slot: the scenario did not exercise prefix sharing"


def test_one_plan_per_step_serves_every_layer(models):
    prompts = random_prompts([5, 12, 1])
    name = paged_transformers.enable("reference")
    backend = _ENABLED[name].backend
    seen, restore = _spy_plans(name)
    forwards = []
    original_forward = backend.forward
    backend.forward = lambda q, cache, plan, **kw: forwards.append(plan) or original_forward(q, cache, plan, **kw)
    try:
        run = generate(models["llama"], name, prompts, max_new_tokens=3, max_batch_tokens=8)
    finally:
        restore()
        del backend.forward
    steps = len(run.logits)
    assert steps > 1 and len(seen) == steps
    layers = models["llama"].config.num_hidden_layers
    assert len(forwards) == steps * layers
    # Both layers of a step got the very same plan object.
    assert all(forwards[i] is forwards[i + 1] for i in range(0, len(forwards), layers))


def _skip_unless_available(backend: str) -> None:
    reasons = (
        registry.unavailable(backend)
        if backend in registry.names()
        else [f"{backend} is not installed: pip install --find-links dist 'paged-core[triton]'"]
    )
    if reasons:
        pytest.skip("; ".join(reasons))


def test_triton_unified_matches_transformers(models):
    _skip_unless_available("triton-unified")
    # Kept tiny: every kernel call runs in Triton's interpreter on the CPU.
    prompts = random_prompts([1, 6, 20])
    cb = dict(max_batch_tokens=16, max_requests_per_batch=2)
    want = generate(models["qwen3"], TRANSFORMERS_PAGED, prompts, max_new_tokens=2, **cb)
    run = generate(models["qwen3"], paged_transformers.enable("triton-unified"), prompts, max_new_tokens=2, **cb)
    assert_same_generation(run, want)


def test_triton_unified_runs_decode_steps_through_its_split_kernel(models, monkeypatch):
    _skip_unless_available("triton-unified")
    import paged_triton_unified.backend as backend_module

    split_calls = []
    real = backend_module.split_decode_attention

    def counted(*args, **kwargs):
        split_calls.append(kwargs["seq_lens"].shape[0])
        return real(*args, **kwargs)

    monkeypatch.setattr(backend_module, "split_decode_attention", counted)
    prompts = random_prompts([3, 9])
    cb = dict(max_batch_tokens=16, max_requests_per_batch=2)
    want = generate(models["qwen3"], TRANSFORMERS_PAGED, prompts, max_new_tokens=3, **cb)
    # split_kv=True: every decode-only batch of one row per request takes the split kernel.
    name = paged_transformers.enable("triton-unified", split_kv=True)
    run = generate(models["qwen3"], name, prompts, max_new_tokens=3, **cb)
    assert_same_generation(run, want)
    # Two decode steps of both requests (the third token), once per layer: transformers' decode
    # steps reach the backend as decode-only batches, with no empty padding request.
    assert split_calls and set(split_calls) == {2}, split_calls


def _transformers_pools(cache):
    """The tensors transformers allocated for its KV cache (5.17: one per layer; 5.18: one in all)."""
    if hasattr(cache, "cache_tensor"):
        return [cache.cache_tensor]
    return [*cache.key_cache, *cache.value_cache]


@pytest.mark.skipif(
    HOOK != "pool",
    reason="transformers 5.24 and 5.25 write their pool themselves: see test_gathered_kv_is_read_without_a_copy",
)
def test_kv_pool_is_written_in_place(models, monkeypatch):
    """The backend reads and writes transformers' own pool tensors (no copy of the cache)."""
    from paged_transformers import _attention

    views = []

    def view_pool(cache, layer):
        entry = original_view(cache, layer)
        views.append(({p.untyped_storage().data_ptr() for p in _transformers_pools(cache)}, entry[1]))
        return entry

    original_view = _attention._view_pool
    monkeypatch.setattr(_attention, "_view_pool", view_pool)
    name = paged_transformers.enable("reference")
    adapter = _ENABLED[name]
    written = []
    original_write = adapter.backend.write
    monkeypatch.setattr(adapter.backend, "write", lambda cache, *a: written.append(cache) or original_write(cache, *a))
    run = generate(models["llama"], name, random_prompts([4, 9]), max_new_tokens=2)
    assert run.errors == {r: None for r in run.errors}
    assert len(views) == models["llama"].config.num_hidden_layers
    for storages, kv in views:
        assert kv.k.untyped_storage().data_ptr() in storages and kv.v.untyped_storage().data_ptr() in storages
        assert kv.block_size == 16
    assert {id(c) for c in written} == {id(kv) for _, kv in views}


@pytest.mark.skipif(
    HOOK != "gathered", reason="transformers 5.17/5.18 pass their pool: see test_kv_pool_is_written_in_place"
)
def test_gathered_kv_is_read_without_a_copy(models, monkeypatch):
    """5.24, 5.25: the backend reads the K/V transformers gathered, as one-token blocks, and writes nothing."""
    name = paged_transformers.enable("reference")
    adapter = _ENABLED[name]
    given, read = [], []

    def spy(self, module, query, key, *args, **kwargs):
        given.append(key.untyped_storage().data_ptr())
        return original(self, module, query, key, *args, **kwargs)

    original = PagedAttention.__call__
    monkeypatch.setattr(PagedAttention, "__call__", spy)
    original_forward = adapter.backend.forward
    monkeypatch.setattr(
        adapter.backend,
        "forward",
        lambda q, cache, plan, **kw: read.append(cache) or original_forward(q, cache, plan, **kw),
    )
    monkeypatch.setattr(adapter.backend, "write", lambda *a: pytest.fail("5.24 wrote the pool already"))
    run = generate(models["llama"], name, random_prompts([4, 9]), max_new_tokens=3)
    assert run.errors == {r: None for r in run.errors}
    assert len(read) == len(given) == len(run.logits) * models["llama"].config.num_hidden_layers
    for ptr, kv in zip(given, read, strict=True):
        assert kv.block_size == 1 and kv.k.untyped_storage().data_ptr() == ptr
