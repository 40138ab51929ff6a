"""Backend.forward checks each distinct call once: the same objects are not re-checked, any change is."""

from __future__ import annotations

import pytest
import torch
from paged_core import BatchMeta, InputError, ReferenceBackend


class CountingBackend(ReferenceBackend):
    name = "counting"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.full_checks = 0

    def _check_call(self, *args):
        self.full_checks += 1
        return super()._check_call(*args)


@pytest.fixture
def setup():
    backend = CountingBackend()
    meta = BatchMeta.build([3, 1], [10, 20], block_size=16)
    cache = backend.allocate(4, 16, 2, 32, dtype=torch.float32)
    q = torch.randn(4, 4, 32)
    return backend, meta, cache, q


def test_same_objects_are_checked_once(setup):
    backend, meta, cache, q = setup
    for _ in range(3):
        backend.forward(q, cache, meta)
    backend.forward(torch.randn(4, 4, 32), cache, meta)  # another q of the same shape: another layer
    assert backend.full_checks == 1


@pytest.mark.parametrize(
    "bad",
    [
        pytest.param(lambda q, cache, meta: dict(q=q.half()), id="q-dtype"),
        pytest.param(lambda q, cache, meta: dict(q=q[:, :3]), id="q-heads"),
        pytest.param(lambda q, cache, meta: dict(out=torch.empty(4, 4, 16)), id="out-shape"),
        pytest.param(lambda q, cache, meta: dict(sinks=torch.zeros(4, dtype=torch.float64)), id="sinks-dtype"),
        pytest.param(lambda q, cache, meta: dict(window=-1), id="window"),
        pytest.param(lambda q, cache, meta: dict(scale=float("nan")), id="scale-nan"),
    ],
)
def test_a_changed_argument_is_checked_again(setup, bad):
    backend, meta, cache, q = setup
    backend.forward(q, cache, meta)
    kw = {"q": q, **bad(q, cache, meta)}
    bad_q = kw.pop("q")
    for _ in range(2):  # refused every time: a refusal is never remembered
        with pytest.raises(InputError):
            backend.forward(bad_q, cache, meta, **kw)


def test_a_reassigned_cache_field_is_checked_again(setup):
    backend, meta, cache, q = setup
    backend.forward(q, cache, meta)
    cache.k = torch.zeros(4, 16, 2, 16)  # head_dim 16 now, q has 32
    cache.v = torch.zeros(4, 16, 2, 16)
    with pytest.raises(InputError, match="head_dim"):
        backend.forward(q, cache, meta)


def test_a_reassigned_batch_field_is_checked_again(setup):
    backend, meta, cache, q = setup
    backend.forward(q, cache, meta)
    meta.block_size = 8  # the cache has 16
    with pytest.raises(InputError, match="block_size"):
        backend.forward(q, cache, meta)
