"""Quantized kv_dtypes (int8, fp8, fp8_e5m2, int4, kivi4): K/V in pools of paged's format, with transformers' slots."""

from __future__ import annotations

import re

import paged_transformers
import pytest
import torch
import transformers
from conftest import HOOK, TRANSFORMERS_PAGED, generate, random_prompts, tiny_model
from paged_core import PACKED_CODES, Q_MAX, UnsupportedSpecError, unpack_int4
from paged_transformers import _attention

#: First-step logits (the same batch in both runs) vs full precision. Per-vector symmetric
#: quantization moves each K/V element by at most scale / 2 = max|x| / (2 * q_max): 0.4 % of the
#: vector's largest element for int8 (q_max 127), while fp8 E4M3 keeps 3 mantissa bits, a relative
#: 2**-4 = 6 % per element (E5M2: 2 bits, 12.5 %). Through two layers of this deliberately sharp
#: model (logits up to ~5) that measured 0.08 (int8), 0.25 (fp8) and 0.78 (fp8_e5m2); int4's codes
#: -7..7 (max|x| / 14 per element) 1.38, and kivi4 (keys per block and channel) 0.82. The bounds
#: leave about 2x room, and a run that silently kept full precision fails the lower bound instead.
FIRST_STEP_LOGITS = {"int8": 0.15, "fp8": 0.5, "fp8_e5m2": 1.5, "int4": 3.0, "kivi4": 2.0}


@pytest.mark.skipif(
    HOOK != "pool",
    reason="transformers 5.24 and 5.25 write K/V into their own pool themselves: "
    "see test_quantized_pools_are_refused_where_the_model_writes_its_pool",
)
@pytest.mark.parametrize("kv_dtype", ["int8", "fp8", "fp8_e5m2", "int4", "kivi4"])
def test_quantized_pools(kv_dtype, monkeypatch):
    model = tiny_model("llama")
    prompts = random_prompts([1, 6, 30, 12])
    cb = dict(max_batch_tokens=32, max_requests_per_batch=3)
    full = generate(model, TRANSFORMERS_PAGED, prompts, max_new_tokens=3, **cb)
    name = paged_transformers.enable("reference", kv_dtype=kv_dtype)
    assert name == f"paged|paged-reference-kv_dtype={kv_dtype}"
    caches = []
    original = _attention.PagedAttention._quantized_pool

    def record(self, *args):
        entry = original(self, *args)
        caches.append(entry[1])
        return entry

    monkeypatch.setattr(_attention.PagedAttention, "_quantized_pool", record)
    # Plans describe the pool the layers read (FlashInfer plans its fp8 kernels from it).
    backend = _attention._ENABLED[name].backend
    planned = []
    original_plan = backend.plan
    monkeypatch.setattr(backend, "plan", lambda meta, **layer: planned.append(layer) or original_plan(meta, **layer))
    run = generate(model, name, prompts, max_new_tokens=3, **cb)
    if transformers.__version__.startswith("5.18"):
        assert all(f"kv_dtype='{kv_dtype}' on transformers 5.18" in e for e in run.errors.values()), run.errors
        return
    assert run.errors == {r: None for r in run.errors}, run.errors
    assert len(caches) == model.config.num_hidden_layers
    assert planned and all(p["kv_dtype"] == kv_dtype and p["kv_scales"] == "per_slot" for p in planned), planned[:1]
    for kv in caches:
        assert kv.kv_dtype == kv_dtype and kv.k.element_size() == 1 and kv.k_scale.dtype == torch.float32
        # Written: some scale is set, and every code is inside the format's range.
        assert bool((kv.k_scale > 0).any())
        codes = unpack_int4(kv.k) if kv_dtype in PACKED_CODES else kv.k
        assert float(codes.float().abs().max()) <= Q_MAX[kv_dtype]
    err = (run.logits[0] - full.logits[0]).abs().max().item()
    assert 1e-4 < err <= FIRST_STEP_LOGITS[kv_dtype], err


def test_unknown_kv_dtype():
    with pytest.raises(ValueError, match="kv_dtype 'int2' is not one of auto, int8, fp8, fp8_e5m2, int4, kivi4"):
        paged_transformers.enable("reference", kv_dtype="int2")


@pytest.mark.skipif(HOOK != "gathered", reason="transformers 5.17 serves quantized pools: see test_quantized_pools")
def test_quantized_pools_are_refused_where_the_model_writes_its_pool():
    says = f"kv_dtype='int8' on transformers {transformers.__version__}"
    with pytest.raises(UnsupportedSpecError, match=re.escape(says)):
        paged_transformers.enable("reference", kv_dtype="int8")
