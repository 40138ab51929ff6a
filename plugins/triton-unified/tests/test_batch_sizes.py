"""A new decode batch size of a shape class already run costs no tuning and no compile.

Engines that capture CUDA graphs run every capture size once (vLLM: 1, 2, 4, 8, 16, 24, ...).
Each launch here is classified as the GPU would see it, from the launcher's arguments: its
autotune key (a new one times every config) and what Triton compiles a binary on (a new one
compiles). The interpreter neither tunes nor compiles, so the keys are counted, with the
multiprocessor count of a small GPU (16 SMs) so that split counts and occupancy classes follow
the batch as on one. vLLM captures with ``max_seq_len`` = the model's length and one-token
contexts; so do these batches.

Runs on the CPU under TRITON_INTERPRET=1 (set below when no GPU is present, before Triton is
imported).
"""

from __future__ import annotations

import os
import sys
from collections import defaultdict
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

import paged_triton_unified.launch as unified_launch
import paged_triton_unified.split_launch as split_launch
from paged_core import BatchMeta, ReferenceBackend, allocate_kv_cache
from paged_triton_common.direct import DirectKernel
from paged_triton_unified.backend import TritonUnifiedBackend

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="counts keys under the CPU interpreter")

SIZES = (1, 2, 3, 4, 8, 16, 24, 32, 48, 64)
SMS = 16
HQ, HKV, D, BS = 4, 2, 32, 16
MAX_MODEL_LEN = 8192
# The autotuned kernel behind each launcher's kernel (the interpreter runs the fixed-config one).
_TUNED = {"unified_attention_kernel": unified_launch._attention, "split_kv_attention_kernel": split_launch._split}


@pytest.fixture
def launches(monkeypatch):
    """Every DirectKernel launch as (kernel, autotune key or None, binary key), with SMS SMs."""
    for module in (split_launch, unified_launch):
        monkeypatch.setattr(module, "sm_count", lambda device: SMS)
    unified_launch._batch_config.cache_clear()
    seen: list[tuple] = []
    launch = DirectKernel.launch

    def counted(self, grid, kwargs):
        name = self.jit.fn.__name__
        tuned = _TUNED.get(name, self)
        seen.append((name, tuned.tuning_key(kwargs), self.binary_key(kwargs)))
        return launch(self, grid, kwargs)

    monkeypatch.setattr(DirectKernel, "launch", counted)
    yield seen
    unified_launch._batch_config.cache_clear()


def _counts(seen) -> dict[str, tuple[int, int]]:
    """kernel -> (autotune keys, binary keys)."""
    keys, binaries = defaultdict(set), defaultdict(set)
    for name, key, binary in seen:
        if key is not None:
            keys[name].add(key)
        binaries[name].add(binary)
    return {name: (len(keys[name]), len(binaries[name])) for name in binaries}


def _run(backend, query_lens, seed=0):
    """One step: one-token contexts for the decodes (as vLLM's capture batches), a table as wide
    as MAX_MODEL_LEN, ``max_seq_len`` = MAX_MODEL_LEN; compared with the reference."""
    g = torch.Generator().manual_seed(seed)
    num_reqs = len(query_lens)
    seq = [q + int(torch.randint(0, 40, (1,), generator=g)) for q in query_lens]
    width = MAX_MODEL_LEN // BS
    table = torch.zeros(num_reqs, width, dtype=torch.int32)
    per_req = -(-max(seq) // BS)
    for r in range(num_reqs):
        table[r, :per_req] = torch.arange(1 + r * per_req, 1 + (r + 1) * per_req, dtype=torch.int32)
    qsl = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    seq_t = torch.tensor(seq, dtype=torch.int32)
    slots = torch.cat(
        [
            table[r, (torch.arange(seq[r] - q, seq[r]) // BS)].long() * BS + torch.arange(seq[r] - q, seq[r]) % BS
            for r, q in enumerate(query_lens)
        ]
    )
    meta = BatchMeta(
        num_reqs=num_reqs,
        query_start_loc=qsl,
        seq_lens=seq_t,
        block_table=table,
        slot_mapping=slots,
        block_size=BS,
        max_query_len=max(query_lens),
        max_seq_len=MAX_MODEL_LEN,
    )
    cache = allocate_kv_cache(1 + num_reqs * per_req, BS, HKV, D, dtype=torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    q = torch.randn(int(qsl[-1]), HQ, D, generator=g)
    out = backend.forward(q, cache, backend.plan(meta))
    torch.testing.assert_close(out, ReferenceBackend().forward(q, cache, meta), atol=1e-4, rtol=1e-4)


def test_new_decode_sizes_compile_once(launches):
    backend = TritonUnifiedBackend()
    for size in SIZES:
        _run(backend, [1] * size)
    counts = _counts(launches)
    # Split below 8 requests (2 KV heads x 8 fill 16 SMs), the unified kernel from there.
    assert set(counts) == {"split_kv_attention_kernel", "unified_attention_kernel"}
    # One binary per config for every size: split counts (16, 8, 5, 4 here) and partial strides
    # (the token count) were specialised, three binaries of one config before.
    # Tuning follows the keys one program walks and the occupancy class, both powers of two of the
    # batch's work: 3 and 4 requests share a key (512, 1024, 2048 keys a program); the unified
    # kernel's four occupancy classes.
    assert counts == {"split_kv_attention_kernel": (3, 1), "unified_attention_kernel": (4, 1)}


def test_new_decode_sizes_compile_once_unsplit(launches):
    backend = TritonUnifiedBackend(split_kv=False)
    for size in SIZES:
        _run(backend, [1] * size)
    # The four occupancy classes (1, 2, 4, 8+ programs per SM), one binary.
    assert _counts(launches) == {"unified_attention_kernel": (4, 1)}


def test_mixed_steps_of_any_request_count_share_one_tile_plan(launches):
    backend = TritonUnifiedBackend()
    for num_decodes in (2, 20, 40):
        _run(backend, [12] + [1] * num_decodes, seed=num_decodes)
    # The tile plan's scan width followed the request count (16, 32, 64 here): three binaries.
    assert _counts(launches)["tile_plan_kernel"] == (0, 1)
