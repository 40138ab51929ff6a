"""Backend.forward: every input error, unsupported specs with the backend's reasons, PAGED_VALIDATE."""

from __future__ import annotations

from unittest import mock

import pytest
import torch
from paged_core import (
    AttentionSpec,
    BatchMeta,
    BatchMetaError,
    Capabilities,
    InputError,
    ReferenceBackend,
    UnsupportedSpecError,
    allocate_kv_cache,
    validation_enabled,
)


def setup(num_heads=4, dtype=torch.float32, kv_dtype="auto"):
    meta = BatchMeta.build([2, 1], [5, 9], block_size=4, num_blocks=8, seed=0)
    cache = allocate_kv_cache(8, 4, 2, 8, dtype=dtype, kv_dtype=kv_dtype)
    q = torch.randn(3, num_heads, 8).to(dtype)
    return q, cache, meta


def _input(change):
    q, cache, meta = setup()
    kw = {}
    if change == "q-rank":
        q = q[:, 0]
    elif change == "q-not-a-tensor":
        q = q.tolist()
    elif change == "cache-type":
        cache = (cache.k, cache.v)
    elif change == "meta-type":
        meta = {"seq_lens": meta.seq_lens}
    elif change == "q-rows":
        q = torch.randn(4, 4, 8)
    elif change == "head_dim":
        q = torch.randn(3, 4, 16)
    elif change == "heads-not-multiple":
        q = torch.randn(3, 5, 8)
    elif change == "dtype":
        q = q.double()
    elif change == "non-contiguous":
        q = torch.randn(3, 4, 16)[..., ::2]
    elif change == "block_size":
        meta = BatchMeta.build([2, 1], [5, 9], block_size=8, num_blocks=8, seed=0)
    elif change == "device":
        q = q.to("meta")
    elif change == "table-dtype":
        meta.block_table = meta.block_table.long()
    elif change == "window-negative":
        kw["window"] = -1
    elif change == "window-float":
        kw["window"] = 2.5
    elif change == "softcap-negative":
        kw["softcap"] = -1.0
    elif change == "sinks-shape":
        kw["sinks"] = torch.zeros(2)
    elif change == "sinks-dtype":
        kw["sinks"] = torch.zeros(4, dtype=torch.float64)
    elif change == "sinks-list":
        kw["sinks"] = [0.0] * 4
    elif change == "out-shape":
        kw["out"] = torch.empty(3, 4, 4)
    elif change == "out-dtype":
        kw["out"] = torch.empty(3, 4, 8, dtype=torch.float16)
    elif change == "out-strided":
        kw["out"] = torch.empty(3, 4, 16)[..., ::2]
    elif change == "out-not-a-tensor":
        kw["out"] = [0.0]
    else:
        raise AssertionError(change)
    return q, cache, meta, kw


INPUT_ERRORS = {
    "q-rank": ["q is float32 [3, 8] on cpu", "accepted: a tensor [num_tokens, num_heads, head_dim]"],
    "q-not-a-tensor": ["q is a list", "accepted: a tensor [num_tokens, num_heads, head_dim]"],
    "cache-type": ["cache is a tuple", "accepted: a paged_core.KVCache"],
    "meta-type": ["meta is a dict", "accepted: a BatchMeta or the result of reference.plan(meta)"],
    "q-rows": ["q has 4 rows but the batch has 3 query tokens", "q.shape[0] == meta.num_tokens"],
    "head_dim": ["q has head_dim 16 but the cache has head_dim 8"],
    "heads-not-multiple": [
        "q has 5 heads, not a multiple of the cache's 2 KV heads",
        "accepted: num_heads = group_size * num_kv_heads",
    ],
    "dtype": [
        "q is float64 but the cache holds float32 K/V",
        "accepted: the dtype the cache was allocated for",
    ],
    "non-contiguous": ["q's last dimension has stride 2", "accepted: stride 1 (call q.contiguous())"],
    "block_size": ["the batch was built for block_size 8 but the cache has block_size 4"],
    "device": ["cache.k is on cpu but q is on meta", "accepted: one device"],
    "table-dtype": ["block_table is int64 [2, 3]", "accepted: int32 [num_reqs=2, max_blocks_per_req]"],
    "window-negative": ["window is -1", "accepted: 0 (no window) or a positive int"],
    "window-float": ["window is 2.5", "accepted: 0 (no window) or a positive int"],
    "softcap-negative": ["softcap is -1.0", "accepted: 0 (off) or a positive finite float"],
    "sinks-shape": ["sinks is float32 [2] on cpu", "accepted: float32 [num_heads=4] on cpu"],
    "sinks-dtype": ["sinks is float64 [4] on cpu", "accepted: float32 [num_heads=4] on cpu"],
    "sinks-list": ["sinks is a list", "accepted: float32 [num_heads=4] on cpu"],
    "out-shape": [
        "out is float32 [3, 4, 4] on cpu",
        "accepted: the shape, dtype and device of q (float32 [3, 4, 8] on cpu)",
    ],
    "out-dtype": ["out is float16 [3, 4, 8] on cpu", "accepted: the shape, dtype and device of q"],
    "out-strided": [
        "out is float32 [3, 4, 8] on cpu with last-dimension stride 2",
        "last-dimension stride 1",
    ],
    "out-not-a-tensor": ["out is a list", "accepted: the shape, dtype and device of q"],
}


@pytest.mark.parametrize("change", list(INPUT_ERRORS))
def test_forward_input_errors(change):
    q, cache, meta, kw = _input(change)
    # A field of the batch is a BatchMetaError, anything else an InputError: both are ValueErrors.
    with pytest.raises(BatchMetaError if change == "table-dtype" else InputError) as exc:
        ReferenceBackend().forward(q, cache, meta, **kw)
    msg = str(exc.value)
    for needle in INPUT_ERRORS[change]:
        assert needle in msg, f"{needle!r} not in {msg!r}"
    assert isinstance(exc.value, ValueError)


class Narrow(ReferenceBackend):
    name = "narrow"
    capabilities = Capabilities(
        head_dims=frozenset({64, 128}),
        block_sizes=frozenset({16, 32}),
        group_sizes=frozenset({1}),
        dtypes=frozenset({torch.bfloat16}),
        kv_dtypes=frozenset({"auto", "fp8"}),
        devices=frozenset({"cuda"}),
        mixed_batches=False,
    )


def test_unsupported_spec_lists_every_reason():
    q, cache, meta = setup(kv_dtype="int8")
    with pytest.raises(UnsupportedSpecError) as exc:
        Narrow().forward(q, cache, meta, window=3, softcap=5.0, sinks=torch.zeros(4), return_lse=True)
    err = exc.value
    assert err.backend == "narrow"
    assert err.reasons == [
        "device 'cpu' is not supported (accepted: cuda)",
        "head_dim 8 is not supported (accepted: 64, 128)",
        "block_size 4 is not supported (accepted: 16, 32)",
        "2 query heads per KV head is not supported (accepted: 1)",
        "dtype float32 is not supported (accepted: bfloat16)",
        "kv_dtype 'int8' is not supported (accepted: auto, fp8)",
        "sliding window attention is not supported",
        "logit soft-capping is not supported",
        "attention sinks are not supported",
        "only decode-only batches (one query token per request) are supported",
        "returning the log-sum-exp is not supported",
    ]
    assert str(err).startswith("Backend 'narrow' cannot run this attention:\n  - device 'cpu'")
    assert isinstance(err, ValueError)


def test_unsupported_includes_unavailable_and_extra_reasons():
    class NoGpu(ReferenceBackend):
        name = "no-gpu"

        @classmethod
        def unavailable(cls):
            return ["no CUDA device; to fix: run on a GPU machine"]

        def extra_reasons(self, spec):
            return [f"head_dim {spec.head_dim} with {spec.dtype} is too small for this kernel"]

    q, cache, meta = setup()
    with pytest.raises(UnsupportedSpecError) as exc:
        NoGpu().forward(q, cache, meta)
    assert exc.value.reasons == [
        "no CUDA device; to fix: run on a GPU machine",
        "head_dim 8 with torch.float32 is too small for this kernel",
    ]


def test_supported_spec_reasons_empty():
    spec = AttentionSpec(
        num_heads=32,
        num_kv_heads=8,
        head_dim=128,
        block_size=16,
        kv_dtype="fp8",
        window=4,
        softcap=30.0,
        sinks=True,
        return_lse=True,
    )
    assert ReferenceBackend().reasons(spec) == [] and ReferenceBackend().supports(spec)
    cuda_spec = AttentionSpec(num_heads=8, num_kv_heads=8, head_dim=64, block_size=16, device="cuda", decode_only=True)
    with mock.patch.object(torch.cuda, "is_available", return_value=True):
        assert Narrow().reasons(cuda_spec) == []
    with mock.patch.object(torch.cuda, "is_available", return_value=False):
        assert Narrow().reasons(cuda_spec) == [
            "the spec asks for a CUDA device, but none is visible (torch.cuda.is_available() is False)"
        ]
    bad = AttentionSpec(num_heads=6, num_kv_heads=4, head_dim=64, block_size=16)
    assert "num_heads 6 is not a multiple of num_kv_heads 4" in ReferenceBackend().reasons(bad)


def test_decode_only_backend_runs_decode_batches():
    class DecodeOnly(ReferenceBackend):
        name = "decode-only"
        capabilities = Capabilities(mixed_batches=False)

    cache = allocate_kv_cache(8, 4, 2, 8, dtype=torch.float32)
    meta = BatchMeta.build([1, 1], [5, 9], block_size=4, num_blocks=8)
    q = torch.randn(2, 4, 8)
    assert torch.equal(DecodeOnly().forward(q, cache, meta), ReferenceBackend().forward(q, cache, meta))


# ---------------------------------------------------------------------------------- validation
@pytest.fixture
def validate_calls(monkeypatch):
    calls = []
    original = BatchMeta.validate

    def spy(self, **kwargs):
        calls.append(kwargs)
        return original(self, **kwargs)

    monkeypatch.setattr(BatchMeta, "validate", spy)
    return calls


@pytest.mark.parametrize(
    ("env", "explicit", "expect"),
    [
        (None, None, False),
        ("1", None, True),
        ("true", None, True),
        ("0", None, False),
        ("1", False, False),
        (None, True, True),
        ("0", True, True),
    ],
)
def test_paged_validate(monkeypatch, validate_calls, env, explicit, expect):
    if env is None:
        monkeypatch.delenv("PAGED_VALIDATE", raising=False)
    else:
        monkeypatch.setenv("PAGED_VALIDATE", env)
    assert validation_enabled(explicit) is expect
    q, cache, meta = setup()
    backend = ReferenceBackend(validate=explicit)
    backend.forward(q, cache, meta)
    assert validate_calls == ([{"num_blocks": 8}] if expect else [])


def test_validation_catches_bad_metadata(monkeypatch):
    q, cache, meta = setup()
    meta.block_table[1, 0] = 8  # one past the pool of 8 blocks
    monkeypatch.setenv("PAGED_VALIDATE", "1")
    with pytest.raises(BatchMetaError, match=r"request 1: block_table\[1, 0\] = 8 is outside the cache"):
        ReferenceBackend().forward(q, cache, meta)
    # Validation off: no host checks; the reference masks the bad block instead of reading it.
    out = ReferenceBackend(validate=False).forward(q, cache, meta)
    assert not out.isnan().any()


class ForgetsRowZero(ReferenceBackend):
    """Computes every row but the first (a kernel whose grid misses a tile)."""

    def _forward(self, q, cache, plan, *, out, lse, **kw) -> None:
        full = torch.empty_like(out)
        full_lse = None if lse is None else torch.empty_like(lse)
        super()._forward(q, cache, plan, out=full, lse=full_lse, **kw)
        out[1:] = full[1:]
        if lse is not None:
            lse[1:] = full_lse[1:]


@pytest.mark.parametrize("given_out", [False, True], ids=["allocated", "given"])
def test_validation_poisons_the_outputs_so_an_unwritten_row_shows(given_out):
    q, cache, meta = setup()
    out = torch.zeros_like(q) if given_out else None
    got, lse = ForgetsRowZero(validate=True).forward(q, cache, meta, out=out, return_lse=True)
    assert got[0].isnan().all() and lse[0].isnan().all()
    assert not got[1:].isnan().any() and not lse[1:].isnan().any()
    # Without validation nothing is filled: the given out keeps its zeros in the forgotten row.
    if given_out:
        got = ForgetsRowZero(validate=False).forward(q, cache, meta, out=torch.zeros_like(q))
        assert torch.equal(got[0], torch.zeros_like(got[0]))


def test_a_plan_of_another_backend_is_accepted_by_a_backend_that_does_not_plan():
    # forward() accepts "a BatchMeta or a plan with a .meta"; a backend without its own plan used
    # to receive the foreign plan object in _forward and fail with an AttributeError.
    import dataclasses as _dc

    from paged_core import BatchMeta, ReferenceBackend

    @_dc.dataclass
    class ForeignPlan:
        meta: BatchMeta
        extra: int = 3

    meta = BatchMeta.build([3, 1], [10, 40], block_size=16)
    backend = ReferenceBackend()
    cache = backend.allocate(8, 16, num_kv_heads=2, head_dim=8, dtype=torch.float32)
    backend.write(cache, torch.randn(4, 2, 8), torch.randn(4, 2, 8), meta)
    q = torch.randn(4, 4, 8)
    out, lse = backend.forward(q, cache, ForeignPlan(meta), return_lse=True)
    want, want_lse = backend.forward(q, cache, meta, return_lse=True)
    assert torch.equal(out, want) and torch.equal(lse, want_lse)


@pytest.mark.parametrize("field", ["num_heads", "num_kv_heads", "head_dim", "block_size"])
def test_attention_spec_refuses_non_positive_sizes(field):
    # num_kv_heads=0 used to pass here and raise ZeroDivisionError in registry.explain()/select().
    from paged_core import AttentionSpec, InputError

    kw = dict(num_heads=8, num_kv_heads=2, head_dim=64, block_size=16)
    kw[field] = 0
    with pytest.raises(InputError, match=f"AttentionSpec.{field} is 0; accepted: a positive int"):
        AttentionSpec(**kw)


def test_validation_is_skipped_while_a_cuda_graph_is_captured(monkeypatch, validate_calls):
    """validate() copies to the host, which CUDA-graph capture forbids: an engine capturing with
    PAGED_VALIDATE=1 must get its graph (the eager warm-up call before capture validated)."""
    q, cache, meta = setup()
    backend = ReferenceBackend(validate=True)
    backend.forward(q, cache, meta)
    backend.write(cache, q[:, :2], q[:, :2], meta)
    assert len(validate_calls) == 2
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    backend.forward(q, cache, meta)
    backend.write(cache, q[:, :2], q[:, :2], meta)
    assert len(validate_calls) == 2


def test_every_installed_backend_takes_the_layer_keywords_of_plan():
    """The one per-step call of the README's CUDA-graph recipe: ``plan(meta, num_heads=...,
    num_kv_heads=..., head_dim=..., dtype=...)`` on any backend (FlashInfer plans with them;
    the others accept and ignore them), and a misspelt keyword is an InputError that lists the
    accepted ones, never ignored."""
    from paged_core import registry

    meta = BatchMeta.build([1, 2], [5, 9], block_size=16)
    layer = dict(num_heads=4, num_kv_heads=2, head_dim=64, dtype=torch.float32, window=0, softcap=0.0, scale=0.125)
    names = registry.available()
    assert "reference" in names
    for name in names:
        backend = registry.get(name)
        plan = backend.plan(meta, **layer)
        assert plan is meta or plan.meta is meta, name
        with pytest.raises(InputError, match=r"unknown keyword\(s\) num_head; accepted: num_heads, num_kv_heads"):
            backend.plan(meta, num_head=4)


class PerSlotOnly(ReferenceBackend):
    """Claims int8/fp8 caches with per-slot scales only: the default of Capabilities.kv_scales."""

    name = "per-slot-only"
    capabilities = Capabilities(kv_dtypes=frozenset({"auto", "int8", "fp8"}))


def test_a_backend_that_does_not_claim_static_scales_refuses_them_everywhere():
    meta = BatchMeta.build([2, 1], [5, 9], block_size=4, num_blocks=8, seed=0)
    static = allocate_kv_cache(8, 4, 2, 8, dtype=torch.float32, kv_dtype="int8", k_scale=0.1, v_scale=0.1)
    per_head = allocate_kv_cache(
        8, 4, 2, 8, dtype=torch.float32, kv_dtype="int8", k_scale=torch.tensor([0.1, 0.2]), v_scale=0.1
    )
    per_slot = allocate_kv_cache(8, 4, 2, 8, dtype=torch.float32, kv_dtype="int8")
    assert (static.kv_scales, per_head.kv_scales, per_slot.kv_scales) == ("per_tensor", "per_head", "per_slot")
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    backend = PerSlotOnly()
    backend.write(per_slot, k, k, meta)
    backend.forward(q, per_slot, meta)  # claimed: runs
    for cache, kind in ((static, "per_tensor"), (per_head, "per_head")):
        for call in (lambda c=cache: backend.write(c, k, k, meta), lambda c=cache: backend.forward(q, c, meta)):
            with pytest.raises(
                UnsupportedSpecError,
                match=f"int8 caches with kv_scales '{kind}' are not supported "
                r"\(accepted: per_slot\)",
            ):
                call()
    with pytest.raises(UnsupportedSpecError, match="kv_scales 'per_tensor' are not supported"):
        backend.plan(meta, num_heads=4, num_kv_heads=2, head_dim=8, kv_dtype="int8", kv_scales="per_tensor")
    with pytest.raises(InputError, match="kv_scales is 'static'; accepted: per_slot, per_head, per_tensor"):
        backend.plan(meta, kv_scales="static")
    with pytest.raises(InputError, match="AttentionSpec.kv_scales is 'x'"):
        AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=8, block_size=4, kv_scales="x")
    # The reference claims every kind.
    ReferenceBackend().forward(q, static, meta)


class StaticOnly(ReferenceBackend):
    """Claims fp8 caches with static scales only, as a kernel that takes one scale per tensor or
    per KV head (FlashInfer's fp8 path)."""

    name = "static-only"
    capabilities = Capabilities(kv_dtypes=frozenset({"auto", "fp8"}), kv_scales=frozenset({"per_tensor", "per_head"}))


def test_a_backend_that_claims_only_static_scales_refuses_per_slot_ones_everywhere():
    meta = BatchMeta.build([2, 1], [5, 9], block_size=4, num_blocks=8, seed=0)
    static = allocate_kv_cache(8, 4, 2, 8, dtype=torch.float32, kv_dtype="fp8", k_scale=0.1, v_scale=0.1)
    per_slot = allocate_kv_cache(8, 4, 2, 8, dtype=torch.float32, kv_dtype="fp8")
    full = allocate_kv_cache(8, 4, 2, 8, dtype=torch.float32)
    q, k = torch.randn(3, 4, 8), torch.randn(3, 2, 8)
    backend = StaticOnly()
    for cache in (static, full):  # claimed (a full-precision cache has no scales to refuse)
        backend.write(cache, k, k, meta)
        backend.forward(q, cache, meta)
    for call in (lambda: backend.write(per_slot, k, k, meta), lambda: backend.forward(q, per_slot, meta)):
        with pytest.raises(
            UnsupportedSpecError,
            match=r"fp8 caches with kv_scales 'per_slot' are not supported \(accepted: per_head, per_tensor\)",
        ):
            call()
    with pytest.raises(UnsupportedSpecError, match="kv_scales 'per_slot' are not supported"):
        backend.plan(meta, num_heads=4, num_kv_heads=2, head_dim=8, kv_dtype="fp8")
