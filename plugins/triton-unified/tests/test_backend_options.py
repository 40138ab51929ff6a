"""triton-unified's options and plan keywords: every bad value a PagedError that says what is
accepted, no option silently overriding another, and a declared shared prefix checked against
the block table when validation is on.

Runs on the CPU under TRITON_INTERPRET=1 (set below when no GPU is present, before Triton is
imported).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_core import BatchMeta, InputError, ReferenceBackend, allocate_kv_cache
from paged_triton_unified.backend import TritonUnifiedBackend

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize(
    ("options", "needle"),
    [
        (dict(num_splits=2**40), "num_splits is 1099511627776; accepted: None or an int from 1 to 256"),
        (dict(num_splits=True), "num_splits is True; accepted: None or an int from 1 to 256"),
        (dict(num_splits=0), "num_splits is 0; accepted"),
        (dict(cascade="no"), "cascade is 'no'; accepted: True or False"),
        (dict(cascade=1), "cascade is 1; accepted: True or False"),
        (dict(batch_invariant="yes"), "batch_invariant is 'yes'; accepted: True or False"),
        (dict(split_kv=1), "split_kv is 1; accepted: 'auto', True or False"),
        (dict(split_kv="on"), "split_kv is 'on'; accepted: 'auto', True or False"),
        (dict(blocks_per_split=True), "blocks_per_split is True; accepted: an int from 1 to"),
        (dict(blocks_per_split=2**40), "blocks_per_split is 1099511627776; accepted: an int from 1 to"),
        (dict(cascade=True, min_prefix_tokens="x"), "min_prefix_tokens is 'x'; accepted: an int >= 0"),
        (dict(min_prefix_tokens=-1), "min_prefix_tokens is -1; accepted: an int >= 0"),
        # Options that would silently override each other.
        (dict(split_kv=False, num_splits=3), "split_kv=False and num_splits=3 contradict each other"),
        (dict(batch_invariant=True, num_splits=1), "num_splits=1 does not combine with batch_invariant=True"),
        # The cascade pass's splits follow the batch: its promise would not hold.
        (dict(batch_invariant=True, cascade=True), "cascade=True does not combine with batch_invariant=True"),
    ],
)
def test_bad_options_are_refused(options, needle):
    with pytest.raises(InputError) as exc:
        TritonUnifiedBackend(**options)
    assert needle in str(exc.value)


@pytest.mark.parametrize(
    ("declared", "needle"),
    [
        ("2", "shared_prefix_blocks is '2'; accepted: None or an int from 0 to the block table's width (4)"),
        (True, "shared_prefix_blocks is True; accepted"),
        (-1, "shared_prefix_blocks is -1; accepted"),
        (5, "shared_prefix_blocks is 5; accepted"),
    ],
)
def test_bad_declared_prefixes_are_refused(declared, needle):
    meta = BatchMeta.build([1, 1], [13, 16], block_size=4)
    with pytest.raises(InputError) as exc:
        TritonUnifiedBackend(cascade=True).plan(meta, shared_prefix_blocks=declared)
    assert needle in str(exc.value)


def _shared_batch():
    """Three decodes over 2 blocks of 4 that requests 0 and 1 share and request 2 does not."""
    tables = [[1, 2, 3, 4], [1, 2, 5, 6], [1, 9, 7, 8]]
    meta = BatchMeta.from_lists([1, 1, 1], [13, 16, 14], tables, block_size=4, device=DEVICE)
    cache = allocate_kv_cache(10, 4, 2, 32, dtype=torch.float32, device=DEVICE)
    g = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    q = torch.randn(3, 4, 32, generator=g).to(DEVICE)
    return q, cache, meta


def test_a_declared_prefix_the_table_does_not_hold_is_refused_with_validation_on():
    # plan(meta, shared_prefix_blocks=k) with validate=True accepted a prefix the requests did
    # not share; requests 1-2 came out wrong (relative error 1.22).
    q, cache, meta = _shared_batch()
    b = TritonUnifiedBackend(cascade=True, min_prefix_tokens=4, validate=True)
    with pytest.raises(
        InputError,
        match=r"shared_prefix_blocks=2 but request 2 holds blocks \[1, 9\] in its "
        r"first 2 columns, request 0 \[1, 2\]",
    ):
        b.plan(meta, shared_prefix_blocks=2)
    plan = b.plan(meta, shared_prefix_blocks=1)  # true: accepted
    torch.testing.assert_close(
        b.forward(q, cache, plan), ReferenceBackend().forward(q, cache, meta), atol=1e-4, rtol=1e-4
    )


def test_a_declared_prefix_is_the_callers_promise_with_validation_off():
    q, cache, meta = _shared_batch()
    b = TritonUnifiedBackend(cascade=True, min_prefix_tokens=4, validate=False)
    assert b.plan(meta, shared_prefix_blocks=2).prefix_blocks == 2  # read as declared, unchecked


@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_the_cascade_pass_reads_no_quantized_mla_shaped_cache(monkeypatch, kv_dtype):
    # On the H200 the prefix pass gave wrong rows on int8 codes with head dims 64/32: such a
    # batch runs as a normal batch, and still matches the reference.
    import paged_triton_unified.backend as backend_module
    from paged_core import write_kv

    calls = []
    real = backend_module.cascade_attention
    monkeypatch.setattr(backend_module, "cascade_attention", lambda *a, **k: calls.append(1) or real(*a, **k))
    g = torch.Generator().manual_seed(3)
    cache = allocate_kv_cache(12, 4, 2, 64, head_dim_v=32, dtype=torch.float32, kv_dtype=kv_dtype, device=DEVICE)
    slots = torch.arange(12 * 4, device=DEVICE)
    write_kv(
        cache, torch.randn(48, 2, 64, generator=g).to(DEVICE), torch.randn(48, 2, 32, generator=g).to(DEVICE), slots
    )
    tables = [[1, 2, 3], [1, 2, 5], [1, 2, 7]]
    meta = BatchMeta.from_lists([1, 2, 1], [10, 11, 9], tables, block_size=4, device=DEVICE)
    q = torch.randn(4, 4, 64, generator=g).to(DEVICE)
    b = TritonUnifiedBackend(cascade=True, min_prefix_tokens=4)
    plan = b.plan(meta, shared_prefix_blocks=2)
    torch.testing.assert_close(
        b.forward(q, cache, plan), ReferenceBackend().forward(q, cache, meta), atol=2e-4, rtol=2e-4
    )
    assert calls == ([1] if kv_dtype == "auto" else [])
