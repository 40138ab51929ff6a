"""Backend.forward checks each distinct call once: the same objects are not re-checked, any change is."""

from __future__ import annotations

import pytest
import torch
from paged_core import BatchMeta, InputError, ReferenceBackend, _checks


class CountingBackend(ReferenceBackend):
    name = "counting"

    def __init__(self, **kw):
        super().__init__(**kw)
        self.full_checks = 0


@pytest.fixture
def setup(monkeypatch):
    check_call = _checks.check_call

    def counting(backend, *args):
        backend.full_checks += 1
        return check_call(backend, *args)

    monkeypatch.setattr(_checks, "check_call", counting)
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
        pytest.param(lambda q, cache, meta: dict(q=torch.randn(4, 4, 64)[..., ::2]), id="q-stride"),
        pytest.param(lambda q, cache, meta: dict(out=torch.empty(4, 4, 64)[..., ::2]), id="out-stride"),
        pytest.param(lambda q, cache, meta: dict(sinks=torch.zeros(3)), id="sinks-shape"),
        pytest.param(lambda q, cache, meta: dict(return_lse=1), id="return-lse"),
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


class Recording(torch.Tensor):
    """A tensor that records the name of every attribute and method read of it."""

    reads: list[str] = []

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        name = getattr(func, "__name__", repr(func))
        cls.reads.append(func.__self__.__name__ if name == "__get__" else name)  # a property's getter
        with torch._C.DisableTorchFunctionSubclass():
            return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("good", [True, False], ids=["accepted", "refused"])
def test_the_checks_read_of_a_tensor_only_what_the_memo_keys(setup, good):
    """The memo keys q, sinks and out by tensor_facts: a check reading anything else of them
    would give a remembered answer for a tensor that differs there."""
    backend, meta, cache, q = setup
    Recording.reads = []
    _checks.tensor_facts(q.as_subclass(Recording))
    keyed = set(Recording.reads)
    assert keyed == {"shape", "dtype", "device", "stride"}
    Recording.reads = []
    out = torch.empty(4, 4, 32 if good else 16)
    args = [
        q.as_subclass(Recording),
        cache,
        meta,
        0,
        0.0,
        None,
        torch.zeros(4).as_subclass(Recording),
        out.as_subclass(Recording),
        True,
    ]
    if good:
        _checks.check_call(backend, *args)
    else:
        with pytest.raises(InputError, match="out is"):
            _checks.check_call(backend, *args)
    assert Recording.reads and set(Recording.reads) <= keyed, set(Recording.reads) - keyed
