"""vLLM's CPU build serving tiny models through paged backends: the same greedy tokens as vLLM's
own CPU attention, with paged's write, plan and forward provably on the path."""

from __future__ import annotations

import pytest
from conftest import MODEL_DIMS, generate

# The Triton kernel runs under its interpreter on the CPU: slow but exact enough for fp32.
PAGED_BACKENDS = ["reference", "triton-unified"]


@pytest.fixture(scope="session")
def own_run(model_dir):
    """vLLM's own CPU attention (CPU_ATTN) on each model, run once: the oracle."""
    with pytest.MonkeyPatch.context() as mp:
        return generate(model_dir, None, monkeypatch=mp)


def test_without_paged_vllm_runs_its_own_backend(own_run):
    run = own_run
    # The plugin is loaded (it registered PAGED) but a run that does not ask for it never calls it.
    assert run.calls == {"plan": 0, "write": 0, "forward": 0}
    assert all(len(t) == 8 for t in run.tokens)


@pytest.mark.parametrize("paged", PAGED_BACKENDS)
def test_same_greedy_tokens_as_vllm_cpu_attention(model_dir, own_run, paged, monkeypatch):
    want = own_run
    run = generate(model_dir, "PAGED", paged, monkeypatch=monkeypatch)
    assert run.tokens == want.tokens
    layers = MODEL_DIMS["num_hidden_layers"]
    # Every step was planned once and every layer wrote and read through paged.
    assert run.calls["plan"] == len(run.steps) > 0
    assert run.calls["forward"] == run.calls["write"] == layers * len(run.steps)
    # The scheduler mixed prompt chunks and decodes in one step at least once.
    assert any(1 in lens and max(lens) > 1 for lens in run.steps), run.steps
