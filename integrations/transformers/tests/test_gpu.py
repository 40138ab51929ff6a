"""On a CUDA GPU: transformers' CUDA graphs around paged backends, and bf16 accuracy.

Skipped on a machine without CUDA (these need a GPU to mean anything); the CPU tests cover
correctness in float32. A failure inside ``generate_batch`` reaches the test only as the
request's error string, so the tests collect the full tracebacks (of the attention function
and of transformers' generation loop) and print them with the failure.
"""

from __future__ import annotations

import logging
import traceback

import paged_transformers
import pytest
import torch
from conftest import TRANSFORMERS_PAGED, generate, random_prompts, tiny_model
from paged_core import registry
from paged_transformers import PagedAttention

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU: CUDA graphs and bf16 kernels"),
]

GRAPH_BACKENDS = ["triton-unified", "flashinfer", "flash-attn2"]


@pytest.fixture
def tracebacks(monkeypatch):
    """Every traceback raised inside the attention function or logged by transformers' loop."""
    seen: list[str] = []
    original = PagedAttention.__call__

    def call(self, *args, **kwargs):
        try:
            return original(self, *args, **kwargs)
        except Exception:
            seen.append(f"in {self!r}:\n{traceback.format_exc()}")
            raise

    monkeypatch.setattr(PagedAttention, "__call__", call)

    class Keep(logging.Handler):
        def emit(self, record):
            if record.exc_info:
                seen.append(
                    f"logged by {record.name}: {record.getMessage()}\n"
                    + "".join(traceback.format_exception(*record.exc_info))
                )

    handler = Keep(level=logging.ERROR)
    loggers = [logging.getLogger("ContinuousBatchingLogger"), logging.getLogger("transformers")]
    for log in loggers:
        log.addHandler(handler)
    try:
        yield seen
    finally:
        for log in loggers:
            log.removeHandler(handler)


def _report(run, seen):
    return f"errors: {run.errors}\n\nfull tracebacks:\n" + ("\n".join(seen) or "(none recorded)")


def _on_gpu(kind, dtype):
    return tiny_model(kind, head_dim=128, num_attention_heads=8, num_key_value_heads=2).to("cuda", dtype)


@pytest.mark.parametrize("backend", GRAPH_BACKENDS)
def test_cuda_graphs_give_the_eager_tokens(backend, tracebacks):
    reasons = registry.unavailable(backend) if backend in registry.names() else ["not installed"]
    if reasons:
        pytest.skip(f"{backend} cannot run here: {'; '.join(reasons)}")
    model = _on_gpu("qwen3", torch.bfloat16)
    name = paged_transformers.enable(backend)
    prompts = random_prompts([1, 7, 30, 65, 200, 3])
    cb = dict(block_size=256, num_blocks=16, max_batch_tokens=128)
    eager = generate(model, name, prompts, max_new_tokens=6, use_cuda_graph=False, **cb)
    assert eager.errors == {r: None for r in eager.errors}, _report(eager, tracebacks)
    graphs = generate(model, name, prompts, max_new_tokens=6, use_cuda_graph=True, **cb)
    caps = registry.capabilities(backend)
    if not (caps.cuda_graphs and caps.device_plan):
        # transformers captures whole steps, plan included (flash-attn2: no graph claim;
        # FlashInfer: plans on the host): refused with the reason, never a CUDA error.
        assert all(
            e is not None and "running inside a CUDA-graph capture" in e and "use_cuda_graph=False" in e
            for e in graphs.errors.values()
        ), _report(graphs, tracebacks)
        return
    assert graphs.errors == {r: None for r in graphs.errors}, _report(graphs, tracebacks)
    assert graphs.tokens == eager.tokens


def test_bf16_is_as_close_to_fp32_as_transformers_own_bf16_path(tracebacks):
    prompts = random_prompts([5, 40, 120, 1])
    cb = dict(block_size=256, num_blocks=16, max_batch_tokens=256)
    model = _on_gpu("llama", torch.float32)
    ref = generate(model, TRANSFORMERS_PAGED, prompts, max_new_tokens=1, **cb)
    model = model.to(torch.bfloat16)
    theirs = generate(model, TRANSFORMERS_PAGED, prompts, max_new_tokens=1, **cb)
    ours = generate(model, paged_transformers.enable("triton-unified"), prompts, max_new_tokens=1, **cb)
    assert ours.errors == {r: None for r in ours.errors}, _report(ours, tracebacks)

    def err(run):
        return max((a.float() - b.float()).abs().max().item() for a, b in zip(run.logits, ref.logits, strict=True))

    # transformers' own bf16 error, with 50% headroom for a different (but equally valid) rounding order.
    assert err(ours) <= 1.5 * err(theirs) + 1e-3, (err(ours), err(theirs))
