"""triton-splitkv: triton-unified under its former name, deprecated. It registers below
triton-unified, warns on every construction, takes the same options and gives the same bits.

Runs on the CPU under TRITON_INTERPRET=1 (set below when no GPU is present, before Triton is
imported).
"""

from __future__ import annotations

import inspect
import os
import subprocess
import sys

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import paged_triton_splitkv
import paged_triton_unified
from paged_core import BatchMeta, InputError, registry
from paged_triton_common.backend import TritonPlan
from paged_triton_splitkv.backend import MAX_NUM_SPLITS, SplitKVPlan, TritonSplitKVBackend
from paged_triton_unified.backend import TritonUnifiedBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
REPLACEMENT = "use registry.get('triton-unified', ...) with the same options"


def _alias(**options):
    with pytest.warns(DeprecationWarning, match="triton-splitkv is triton-unified under its former name"):
        return registry.get("triton-splitkv", **options)


def test_registered_below_triton_unified():
    # select() must reach the current name first: the same class, without the warning.
    ranked = [n for n in registry.names() if n in ("triton-splitkv", "triton-unified")]
    assert ranked == ["triton-unified", "triton-splitkv"]
    registration = registry.registration("triton-splitkv")
    assert registration.target == "paged_triton_splitkv.backend:TritonSplitKVBackend"
    assert registry.backend_class("triton-splitkv").__mro__[1] is TritonUnifiedBackend


@pytest.mark.parametrize("how", ["registry", "class"])
def test_every_construction_warns_once_at_the_line_that_asked(how):
    for _ in range(2):
        with pytest.warns(DeprecationWarning) as record:
            backend = registry.get("triton-splitkv") if how == "registry" else TritonSplitKVBackend()
        assert len(record) == 1, [str(r.message) for r in record]
        assert REPLACEMENT in str(record[0].message)
        # Attributed to this file, not to the registry: outside paged, so Python shows it.
        assert record[0].filename == __file__
    assert isinstance(backend, TritonUnifiedBackend) and backend.name == "triton-splitkv"


def test_the_options_are_triton_unifieds():
    assert inspect.signature(TritonSplitKVBackend.__init__) == inspect.signature(TritonUnifiedBackend.__init__)
    options = dict(num_splits=3, min_prefix_tokens=64, validate=True)
    alias, unified = _alias(**options), TritonUnifiedBackend(**options)
    for attribute in ("split_kv", "num_splits", "blocks_per_split", "cascade", "min_prefix_tokens", "validate"):
        assert getattr(alias, attribute) == getattr(unified, attribute), attribute
    assert _alias(cascade=True).capabilities == TritonUnifiedBackend(cascade=True).capabilities
    assert _alias(batch_invariant=True).capabilities.batch_invariant
    with pytest.raises(InputError, match="split_kv=False and num_splits=3 contradict each other"):
        _alias(split_kv=False, num_splits=3)
    with pytest.raises(InputError, match=r"'triton-splitkv' does not accept options \['spilt_kv'\]"):
        registry.get("triton-splitkv", spilt_kv=True)
    # What the module exported before the fold still imports.
    assert SplitKVPlan is TritonPlan and MAX_NUM_SPLITS == 256


# A mixed batch (the unified kernel), a decode batch split three ways, and a shared prefix read
# once (cascade) for decodes.
BATCHES = {
    "mixed": ({}, [4, 1, 1], [37, 20, 60]),
    "split": ({"num_splits": 3}, [1, 1, 1], [37, 20, 60]),
    "cascade": ({"cascade": True, "min_prefix_tokens": 16}, [1, 1, 1], [70, 50, 60]),
}


@pytest.mark.parametrize("batch", list(BATCHES))
def test_bitwise_the_same_output_as_triton_unified(batch):
    options, query_lens, seq_lens = BATCHES[batch]
    tables = [[1, 2, 3, 4, 5], [1, 2, 6, 7, 8], [1, 2, 9, 10, 11]] if batch == "cascade" else None
    if tables:
        meta = BatchMeta.from_lists(query_lens, seq_lens, tables, block_size=16, device=DEVICE)
    else:
        meta = BatchMeta.build(query_lens, seq_lens, block_size=16, num_blocks=16, device=DEVICE, seed=1)
    g = torch.Generator().manual_seed(0)
    outputs = []
    for backend in (TritonUnifiedBackend(**options), _alias(**options)):
        cache = backend.allocate(16, 16, 2, 32, dtype=torch.float32, device=DEVICE)
        cache.k.copy_(torch.randn(cache.k.shape, generator=g.manual_seed(1)))
        cache.v.copy_(torch.randn(cache.v.shape, generator=g.manual_seed(2)))
        q = torch.randn(meta.num_tokens, 4, 32, generator=g.manual_seed(3)).to(DEVICE)
        plan = backend.plan(meta)
        if batch == "cascade":
            assert plan.prefix_blocks == 2
        outputs.append(backend.forward(q, cache, plan, return_lse=True))
    (out, lse), (alias_out, alias_lse) = outputs
    assert torch.equal(out, alias_out) and torch.equal(lse, alias_lse)


def test_merge_states_is_triton_unifieds_and_imported_on_first_use():
    assert paged_triton_splitkv.merge_states is paged_triton_unified.merge_states
    assert "merge_states" in paged_triton_splitkv.__all__
    # Loading the plugin (what `paged list` does) must not define the kernels yet.
    code = "import sys, paged_triton_splitkv; print('paged_triton_unified.split_launch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "False"
