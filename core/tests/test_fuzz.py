"""Hypothesis drives the public API with random valid and invalid inputs (issue 9).

Valid inputs must give the float64 reference's answer; invalid ones must raise one of our
documented errors (``paged_core.PagedError``: ``BatchMetaError``, ``InputError``,
``UnsupportedSpecError``), never an ``IndexError``, a ``RuntimeError`` from deep inside torch,
an ``AttributeError``/``TypeError``, or a crash. Covered: ``BatchMeta.build`` / ``from_lists`` /
``validate``, ``allocate_kv_cache``, ``write_kv``, and ``Backend.forward`` with ``validate=True``
on the reference and on triton-unified (Triton's CPU interpreter without a GPU); hand-built
``KVCache`` objects that are wrong (dimensions, k/v mismatch, missing scales, dtypes), which
must be refused without a byte of the cache changing; wrong types for every public argument;
and ``max_query_len`` / ``max_seq_len`` below the truth with validation off, with and without
the host mirrors (the right answer or a ``PagedError``, never unwritten rows or dropped keys).

Examples are bounded (tiny shapes, ``FUZZ_EXAMPLES`` per test, derandomized so CI is stable);
``PAGED_FUZZ_EXAMPLES=500 PAGED_FUZZ_RANDOM=1`` explores further.
"""

from __future__ import annotations

import math
import os
import traceback

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from paged_core import (
    AttentionSpec,
    BatchMeta,
    BatchMetaError,
    InputError,
    PagedError,
    UnsupportedSpecError,
    allocate_kv_cache,
    dequantize_kv,
    quantize_kv,
    reference_attention,
    registry,
    write_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
FUZZ_EXAMPLES = int(os.environ.get("PAGED_FUZZ_EXAMPLES", "50"))
FUZZ = settings(
    max_examples=FUZZ_EXAMPLES,
    deadline=None,
    derandomize=os.environ.get("PAGED_FUZZ_RANDOM") != "1",
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large],
    database=None,
)
#: For the tests whose every example runs several kernel calls (Triton under its interpreter).
FUZZ_FEW = settings(FUZZ, max_examples=max(FUZZ_EXAMPLES // 3, 10))
TOL = {torch.float32: 1e-4, torch.bfloat16: 2e-2}


def outcome(fn, *args, **kwargs):
    """``("ok", result)`` or ``("error", PagedError)``; anything else fails the test right here."""
    try:
        return "ok", fn(*args, **kwargs)
    except PagedError as exc:
        return "error", exc
    except Exception as exc:  # the point of this module: name the leak and where it came from
        pytest.fail(
            f"{getattr(fn, '__qualname__', fn)} leaked {type(exc).__name__} (not a PagedError): {exc}\n"
            + "".join(traceback.format_exception(exc)[-6:])
        )


def expect_error(kind, fn, *args, **kwargs):
    status, res = outcome(fn, *args, **kwargs)
    assert status == "error", f"{kind}: accepted, expected a PagedError"
    return res


# ------------------------------------------------------------------------------ builders
ints = st.one_of(st.integers(-3, 40), st.sampled_from([0, 1, -(2**31)]))
bad_scalars = st.sampled_from([1.5, "3", None, True])


@FUZZ
@given(
    qlens=st.lists(st.one_of(ints, bad_scalars), max_size=5),
    slens=st.lists(st.one_of(ints, bad_scalars), max_size=5),
    block_size=st.one_of(st.sampled_from([1, 4, 16]), st.sampled_from([0, -4, 2.0, "16", None])),
    use_lists=st.booleans(),
    table_slack=st.integers(-2, 1),
)
def test_builders(qlens, slens, block_size, use_lists, table_slack):
    """build / from_lists: a valid BatchMeta (which then validates) or a BatchMetaError."""
    # 2**31 new tokens or context would build a 2**31-entry slot_mapping: valid, not the point.
    qlens = [min(x, 40) if isinstance(x, int) else x for x in qlens]
    slens = [min(x, 40) if isinstance(x, int) else x for x in slens]
    if use_lists:
        # Block lists of about the right length (table_slack < 0: too short), ids 1, 2, ...
        tables, nxt = [], 1
        for s in slens:
            valid = isinstance(s, int) and isinstance(block_size, int) and block_size > 0 and s >= 0
            need = math.ceil(s / block_size) if valid else 1
            n = max(0, need + table_slack)
            tables.append(list(range(nxt, nxt + n)))
            nxt += n
        status, meta = outcome(BatchMeta.from_lists, qlens, slens, tables, block_size=block_size)
        num_blocks = nxt
    else:
        status, meta = outcome(BatchMeta.build, qlens, slens, block_size=block_size)
        num_blocks = None
    if status == "ok":
        assert meta.num_reqs == len(slens)
        outcome_v, err = outcome(meta.validate, num_blocks=num_blocks)
        assert outcome_v == "ok", f"a built BatchMeta fails validate(): {err}"
    else:
        assert isinstance(meta, BatchMetaError), f"{type(meta).__name__}: {meta}"


@FUZZ
@given(
    num_blocks=st.one_of(st.integers(-1, 6), st.sampled_from([1.0, "4", None])),
    block_size=st.one_of(st.sampled_from([1, 16]), st.sampled_from([0, -1, 2.5])),
    num_kv_heads=st.one_of(st.integers(0, 3), st.just(None)),
    head_dim=st.one_of(st.sampled_from([8, 64]), st.sampled_from([0, -8, 8.0])),
    dtype=st.sampled_from([torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int8, "bf16"]),
    kv_dtype=st.sampled_from(["auto", "int8", "fp8", "fp4", None, 8]),
    device=st.sampled_from(["cpu", "cuda", "cuda:7", "nonsense", 3.5]),
)
def test_allocate_kv_cache(num_blocks, block_size, num_kv_heads, head_dim, dtype, kv_dtype, device):
    status, cache = outcome(
        allocate_kv_cache, num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype, kv_dtype=kv_dtype, device=device
    )
    if status == "ok":
        assert tuple(cache.k.shape) == (num_blocks, block_size, num_kv_heads, head_dim)
        assert cache.kv_dtype == kv_dtype and cache.dtype == dtype
    else:
        assert isinstance(cache, InputError), f"{type(cache).__name__}: {cache}"


_SCALES = st.one_of(
    st.floats(allow_nan=True, allow_infinity=True, width=32),
    st.sampled_from([None, True, "0.1", 0, -1]),
    st.builds(
        lambda n, dt, v: torch.full((n,), v).to(dt),
        st.sampled_from([0, 1, 2, 3]),
        st.sampled_from([torch.float32, torch.float64, torch.int32]),
        st.sampled_from([0.05, 1.0, 0.0, -2.0, float("inf")]),
    ),
    st.builds(lambda v: torch.tensor(v, dtype=torch.float32), st.sampled_from([0.02, 3.0, float("nan")])),
    st.just(torch.ones(2, 1)),
)


@FUZZ
@given(k_scale=_SCALES, v_scale=_SCALES, kv_dtype=st.sampled_from(["auto", "int8", "fp8"]), seed=st.integers(0, 2**16))
def test_static_scales_are_usable_or_refused(k_scale, v_scale, kv_dtype, seed):
    """Any static scale argument: a cache whose writes and reads mean codes * that scale, or an
    InputError; never another exception."""
    status, cache = outcome(
        allocate_kv_cache, 8, 8, 2, 16, dtype=torch.float32, kv_dtype=kv_dtype, k_scale=k_scale, v_scale=v_scale
    )
    if status == "error":
        assert isinstance(cache, InputError), f"{type(cache).__name__}: {cache}"
        return
    assert cache.static_scales == (k_scale is not None)
    gen = torch.Generator().manual_seed(seed)
    meta = BatchMeta.build([3, 1], [3, 20], block_size=8, num_blocks=8, seed=seed)
    k, v = (torch.randn(meta.num_tokens, 2, 16, generator=gen) for _ in range(2))
    assert outcome(write_kv, cache, k, v, meta.slot_mapping)[0] == "ok"
    if cache.static_scales:
        # Every written code is round(x / scale) (int8) or x / scale in e4m3, clamped.
        q_max = 127.0 if kv_dtype == "int8" else 448.0
        ks = cache.k_scale[0, 0]
        y = (k / ks[None, :, None]).clamp(-q_max, q_max)
        want = y.round().to(torch.int8) if kv_dtype == "int8" else y.to(torch.float8_e4m3fn)
        slots = meta.slot_mapping.long()
        got = cache.k.reshape(-1, 2, 16)[slots]
        assert torch.equal(got.view(torch.uint8), want.view(torch.uint8))
    q = torch.randn(meta.num_tokens, 4, 16, generator=gen)
    status, out = outcome(registry.get("reference").forward, q, cache, meta)
    assert status == "ok" and bool(out.isfinite().all())


# ------------------------------------------------------------------------------ write_kv
@FUZZ
@given(
    kv_dtype=st.sampled_from(["auto", "int8", "fp8"]),
    slots=st.lists(
        st.one_of(st.integers(-3, 40), st.sampled_from([2**31 - 1, 2**40, -(2**40)])), max_size=6, unique=True
    ),
    bad=st.sampled_from(
        [
            "none",
            "none",
            "k-shape",
            "v-heads",
            "k-dtype",
            "k-list",
            "slots-float",
            "slots-2d",
            "slots-list",
            "cache-tuple",
            "slots-int32",
        ]
    ),
    seed=st.integers(0, 2**16),
)
def test_write_kv(kv_dtype, slots, bad, seed):
    nb, bs, h, d = 4, 8, 2, 16  # 32 slots
    cache = allocate_kv_cache(nb, bs, h, d, dtype=torch.float32, kv_dtype=kv_dtype, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    before = [t.clone() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    n = len(slots)
    k = torch.randn(n, h, d, generator=gen).to(DEVICE)
    v = torch.randn(n, h, d, generator=gen).to(DEVICE)
    sm = torch.tensor(slots, dtype=torch.int64, device=DEVICE)
    target = cache
    if bad == "k-shape":
        k = k[:, :, :8]
    elif bad == "v-heads":
        v = torch.randn(n, h + 1, d).to(DEVICE)
    elif bad == "k-dtype":
        k = k.double()
    elif bad == "k-list":
        k = k.tolist()
    elif bad == "slots-float":
        sm = sm.float()
    elif bad == "slots-2d":
        sm = sm[:, None]
    elif bad == "slots-list":
        sm = list(slots)
    elif bad == "cache-tuple":
        target = (cache.k, cache.v)
    elif bad == "slots-int32":
        sm = sm.clamp(-(2**31), 2**31 - 1).int()  # accepted: int32 slots
    status, err = outcome(write_kv, target, k, v, sm)
    if bad not in ("none", "slots-int32"):
        assert status == "error" and isinstance(err, InputError), f"{bad}: {status} {err}"
        return
    assert status == "ok", err
    after = [t for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    written = {s: i for i, s in enumerate(sm.tolist()) if 0 <= s < nb * bs}
    keep = torch.ones(nb * bs, dtype=torch.bool)
    keep[list(written)] = False
    for t0, t1 in zip(before, after, strict=True):
        b0 = t0.view(torch.uint8) if t0.dtype == torch.float8_e4m3fn else t0
        b1 = t1.view(torch.uint8) if t1.dtype == torch.float8_e4m3fn else t1
        b0, b1 = b0.reshape(nb * bs, *b0.shape[2:]), b1.reshape(nb * bs, *b1.shape[2:])
        assert torch.equal(b0[keep.to(DEVICE)], b1[keep.to(DEVICE)]), "write_kv wrote outside its slots"
    kd, vd = cache.dequantized()
    for src, got in ((k, kd), (v, vd)):
        want = src if kv_dtype == "auto" else dequantize_kv(*quantize_kv(src, kv_dtype))
        for s, row in written.items():
            assert torch.equal(got.reshape(nb * bs, h, d)[s], want[row])


# ------------------------------------------------------------------------------ forward
@st.composite
def problems(draw):
    """A valid attention problem: (q, cache, meta, forward kwargs), tiny."""
    reqs = []
    for _ in range(draw(st.integers(0, 4))):
        s = draw(st.integers(0, 40))
        q = draw(st.integers(0, min(s, 5))) if s else draw(st.integers(0, 2))
        reqs.append((q, s))
    bs = draw(st.sampled_from([8, 16]))
    hq, hkv = draw(st.sampled_from([(4, 1), (4, 2), (2, 2)]))
    d = draw(st.sampled_from([32, 64]))
    dtype = draw(st.sampled_from([torch.float32, torch.float32, torch.bfloat16]))
    kv_dtype = draw(st.sampled_from(["auto", "auto", "int8", "fp8"]))
    seed = draw(st.integers(0, 2**16))
    kw = {}
    if draw(st.booleans()):
        kw["window"] = draw(st.integers(1, 12))
    if draw(st.booleans()):
        kw["softcap"] = draw(st.sampled_from([5.0, 30.0]))
    if draw(st.booleans()):
        kw["sinks"] = torch.randn(hq, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    if draw(st.booleans()):
        kw["scale"] = draw(st.sampled_from([0.05, 0.3]))

    qlens, slens = [q for q, _ in reqs], [s for _, s in reqs]
    nblk = [math.ceil(s / bs) for s in slens]
    num_blocks = sum(nblk) + 3
    meta = BatchMeta.build(qlens, slens, block_size=bs, num_blocks=num_blocks, seed=seed).to(DEVICE)
    cache = allocate_kv_cache(num_blocks, bs, hkv, d, dtype=dtype, kv_dtype=kv_dtype, device=DEVICE)
    gen = torch.Generator().manual_seed(seed)
    tables = [t[:n] for t, n in zip(meta.block_table.tolist(), nblk, strict=True)]
    full = BatchMeta.from_lists(slens, slens, tables, block_size=bs).to(DEVICE)
    n = full.num_tokens
    write_kv(
        cache,
        torch.randn(n, hkv, d, generator=gen).to(dtype).to(DEVICE),
        torch.randn(n, hkv, d, generator=gen).to(dtype).to(DEVICE),
        full.slot_mapping,
    )
    q = torch.randn(meta.num_tokens, hq, d, generator=gen).to(dtype).to(DEVICE)
    return q, cache, meta, kw


def _replace(meta, **fields):
    import dataclasses

    new = dataclasses.replace(meta, **fields)
    if "seq_lens" in fields and isinstance(new.seq_lens, torch.Tensor):
        new.seq_lens_cpu = new.seq_lens.cpu()
    if "query_start_loc" in fields and isinstance(new.query_start_loc, torch.Tensor):
        new.query_start_loc_cpu = new.query_start_loc.cpu()
    return new


def mutate(kind, q, cache, meta, kw):
    """Apply one invalid change; return (q, cache, meta, kw), or None if it does not apply here."""
    qlens, slens = meta.host()
    R, N = meta.num_reqs, meta.num_tokens
    nblk = [math.ceil(s / meta.block_size) for s in slens]
    used = [(r, j) for r in range(R) for j in range(nblk[r])]
    if kind == "q-float64":
        q = q.double()
    elif kind == "q-int32":
        q = q.to(torch.int32)
    elif kind == "q-rank2":
        q = q[:, 0]
    elif kind == "q-extra-row":
        q = torch.cat([q, torch.zeros(1, *q.shape[1:], dtype=q.dtype, device=q.device)])
    elif kind == "q-heads-not-multiple":
        if cache.num_kv_heads == 1:
            return None
        q = torch.cat([q, q[:, :1]], dim=1)
    elif kind == "q-head_dim":
        q = q[..., : q.shape[-1] // 2].contiguous()
    elif kind == "q-last-stride":
        q = torch.stack([q, q], dim=-1)[..., 0]
    elif kind == "q-not-a-tensor":
        q = q.tolist()
    elif kind == "q-meta-device":
        q = q.to("meta")
    elif kind == "cache-kv-heads":
        cache = allocate_kv_cache(
            cache.num_blocks,
            cache.block_size,
            3,
            cache.head_dim,
            dtype=cache.dtype,
            kv_dtype=cache.kv_dtype,
            device=DEVICE,
        )
    elif kind == "cache-tuple":
        cache = (cache.k, cache.v)
    elif kind == "meta-dict":
        meta = {"seq_lens": meta.seq_lens}
    elif kind == "seq_lens-int64":
        meta = _replace(meta, seq_lens=meta.seq_lens.long())
    elif kind == "block_table-int64":
        meta = _replace(meta, block_table=meta.block_table.long())
    elif kind == "query_start_loc-int64":
        meta = _replace(meta, query_start_loc=meta.query_start_loc.long())
    elif kind == "slot_mapping-int32":
        meta = _replace(meta, slot_mapping=meta.slot_mapping.int())
    elif kind == "seq_lens-list":
        meta = _replace(meta, seq_lens=slens)
    elif kind == "max_seq_len-tensor":
        meta = _replace(meta, max_seq_len=torch.tensor(meta.max_seq_len))
    elif kind == "max_query_len-negative":
        meta = _replace(meta, max_query_len=-1)
    elif kind == "block_size-zero":
        meta = _replace(meta, block_size=0)
    elif kind == "negative-seq_len":
        if not R:
            return None
        meta = _replace(meta, seq_lens=meta.seq_lens.clone().index_fill_(0, torch.tensor([R - 1]), -5))
    elif kind == "q_len-over-seq_len":
        r = next((r for r in range(R) if qlens[r] >= 2 and slens[r]), None)
        if r is None:
            return None
        sl = meta.seq_lens.clone()
        sl[r] = qlens[r] - 1
        meta = _replace(meta, seq_lens=sl)
    elif kind == "narrow-table":
        if not used or meta.block_table.shape[1] < 1:
            return None
        meta = _replace(meta, block_table=meta.block_table[:, :-1].contiguous())
    elif kind in ("block-past-pool", "block-negative", "block-int32-max"):
        if not used:
            return None
        r, j = used[len(used) // 2]
        bt = meta.block_table.clone()
        bt[r, j] = {"block-past-pool": cache.num_blocks, "block-negative": -1, "block-int32-max": 2**31 - 1}[kind]
        meta = _replace(meta, block_table=bt)
    elif kind == "qsl-decreasing":
        if R < 2 or qlens[0] == 0:
            return None
        qsl = meta.query_start_loc.clone()
        qsl[1] = qsl[2] + 1
        meta = _replace(meta, query_start_loc=qsl)
    elif kind == "max_query_len-small":
        if max(qlens, default=0) < 1:
            return None
        meta = _replace(meta, max_query_len=max(qlens) - 1)
    elif kind == "slot-mismatch":
        if not N:
            return None
        sm = meta.slot_mapping.clone()
        sm[N // 2] += 1 if sm[N // 2] >= 0 else 5
        meta = _replace(meta, slot_mapping=sm)
    elif kind.startswith("window-"):
        kw = {
            **kw,
            "window": {
                "window-negative": -1,
                "window-float": 1.5,
                "window-str": "4",
                "window-bool": True,
                "window-none": None,
            }[kind],
        }
    elif kind.startswith("softcap-"):
        kw = {
            **kw,
            "softcap": {
                "softcap-negative": -1.0,
                "softcap-str": "x",
                "softcap-nan": math.nan,
                "softcap-inf": math.inf,
                "softcap-none": None,
            }[kind],
        }
    elif kind.startswith("sinks-"):
        hq = q.shape[1]
        kw = {
            **kw,
            "sinks": {
                "sinks-list": [0.0] * hq,
                "sinks-float64": torch.zeros(hq, dtype=torch.float64),
                "sinks-shape": torch.zeros(hq + 1),
                "sinks-int": 3,
            }[kind],
        }
    elif kind.startswith("scale-"):
        kw = {**kw, "scale": {"scale-str": "0.1", "scale-nan": math.nan, "scale-inf": math.inf}[kind]}
    elif kind == "out-shape":
        kw = {**kw, "out": torch.empty(q.shape[0], q.shape[1], q.shape[2] + 1, dtype=q.dtype)}
    else:
        raise AssertionError(kind)
    return q, cache, meta, kw


INVALID = [
    "q-float64",
    "q-int32",
    "q-rank2",
    "q-extra-row",
    "q-heads-not-multiple",
    "q-head_dim",
    "q-last-stride",
    "q-not-a-tensor",
    "q-meta-device",
    "cache-kv-heads",
    "cache-tuple",
    "meta-dict",
    "seq_lens-int64",
    "block_table-int64",
    "query_start_loc-int64",
    "slot_mapping-int32",
    "seq_lens-list",
    "max_seq_len-tensor",
    "max_query_len-negative",
    "block_size-zero",
    "negative-seq_len",
    "q_len-over-seq_len",
    "narrow-table",
    "block-past-pool",
    "block-negative",
    "block-int32-max",
    "qsl-decreasing",
    "max_query_len-small",
    "slot-mismatch",
    "window-negative",
    "window-float",
    "window-str",
    "window-bool",
    "window-none",
    "softcap-negative",
    "softcap-str",
    "softcap-nan",
    "softcap-inf",
    "softcap-none",
    "sinks-list",
    "sinks-float64",
    "sinks-shape",
    "sinks-int",
    "scale-str",
    "scale-nan",
    "scale-inf",
    "out-shape",
]
# Valid variations that must still give the reference's answer.
VALID = ["none", "none", "q-strided-rows", "loose-upper-bounds", "wide-table", "out-given", "lse"]

FORWARD_BACKENDS = ["reference", "triton-unified"]


def _get(name):
    reasons = registry.unavailable(name) if name in registry.names() else [f"{name} is not installed"]
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    return registry.get(name, validate=True)


@pytest.mark.parametrize("name", FORWARD_BACKENDS)
@FUZZ
@given(problem=problems(), variant=st.sampled_from(VALID))
def test_forward_valid_matches_reference(name, problem, variant):
    backend = _get(name)
    q, cache, meta, kw = problem
    kw = dict(kw)
    if variant == "q-strided-rows":  # last dim contiguous, rows and heads strided: accepted
        q = torch.cat([q, q], dim=1)[:, : q.shape[1]]
    elif variant == "loose-upper-bounds":
        meta = _replace(meta, max_query_len=meta.max_query_len + 3, max_seq_len=meta.max_seq_len + 17)
    elif variant == "wide-table":
        pad = torch.zeros(meta.num_reqs, 2, dtype=torch.int32, device=DEVICE)
        meta = _replace(meta, block_table=torch.cat([meta.block_table, pad], dim=1))
    elif variant == "out-given":
        kw["out"] = torch.full_like(q, float("nan"))
    elif variant == "lse":
        kw["return_lse"] = True
    spec = AttentionSpec(
        num_heads=q.shape[1],
        num_kv_heads=cache.num_kv_heads,
        head_dim=q.shape[2],
        block_size=cache.block_size,
        dtype=q.dtype,
        kv_dtype=cache.kv_dtype,
        window=kw.get("window", 0),
        softcap=kw.get("softcap", 0.0),
        sinks="sinks" in kw,
        device=q.device.type,
        decode_only=meta.decode_only,
        return_lse=bool(kw.get("return_lse")),
    )
    status, res = outcome(backend.forward, q, cache, meta, **kw)
    if backend.reasons(spec):
        assert status == "error" and isinstance(res, UnsupportedSpecError), (status, res)
        return
    assert status == "ok", f"valid input refused: {res}"
    out, lse = res if kw.get("return_lse") else (res, None)
    ref_kw = {k: v for k, v in kw.items() if k in ("scale", "window", "softcap", "sinks")}
    want, want_lse = reference_attention(q, cache, meta, compute_dtype=torch.float64, return_lse=True, **ref_kw)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert torch.isfinite(out).all()
    if out.numel():
        err = (out.double() - want).abs().max().item()
        assert err <= TOL[q.dtype] * max(want.abs().max().item(), 1.0), f"max error {err:.3g}"
    if lse is not None and lse.numel():
        finite = torch.isfinite(want_lse)
        assert torch.equal(torch.isfinite(lse), finite)
        if finite.any():
            assert (lse.double()[finite] - want_lse[finite]).abs().max().item() <= 1e-3


@pytest.mark.parametrize("name", FORWARD_BACKENDS)
@FUZZ
@given(problem=problems(), kind=st.sampled_from(INVALID))
def test_forward_invalid_raises_paged_errors(name, problem, kind):
    backend = _get(name)
    changed = mutate(kind, *problem)
    if changed is None:  # the mutation needs a request this batch does not have
        return
    q, cache, meta, kw = changed
    err = expect_error(kind, backend.forward, q, cache, meta, **kw)
    assert isinstance(err, (BatchMetaError, InputError, UnsupportedSpecError)), f"{kind}: {err!r}"
    assert str(err), f"{kind}: empty message"


STRUCTURAL = [
    k
    for k in INVALID
    if k
    not in (
        "negative-seq_len",
        "q_len-over-seq_len",
        "narrow-table",
        "block-past-pool",
        "block-negative",
        "block-int32-max",
        "qsl-decreasing",
        "max_query_len-small",
        "slot-mismatch",
    )
]


@pytest.mark.parametrize("name", FORWARD_BACKENDS)
@FUZZ
@given(problem=problems(), kind=st.sampled_from(STRUCTURAL))
def test_forward_structural_errors_need_no_validation(name, problem, kind):
    """Wrong types, dtypes, shapes and arguments are refused with validation off too (host checks)."""
    backend = _get(name)
    backend.validate = False
    changed = mutate(kind, *problem)
    if changed is None:
        return
    expect_error(kind, backend.forward, *changed[:3], **changed[3])


@FUZZ
@given(problem=problems(), kind=st.sampled_from(INVALID + ["none"] * 6))
def test_validate_agrees_with_the_mutation(problem, kind):
    """validate(): accepts every built batch, refuses every value-level corruption with a BatchMetaError."""
    q, cache, meta, kw = problem
    if kind == "none":
        assert outcome(meta.validate, num_blocks=cache.num_blocks)[0] == "ok"
        return
    changed = mutate(kind, q, cache, meta, kw)
    if changed is None or changed[2] is meta or not hasattr(changed[2], "validate"):
        return  # the mutation is not in the metadata
    status, err = outcome(changed[2].validate, num_blocks=cache.num_blocks)
    assert status == "error" and isinstance(err, BatchMetaError), f"{kind}: {status} {err}"
    if kind in (
        "negative-seq_len",
        "q_len-over-seq_len",
        "block-past-pool",
        "block-negative",
        "block-int32-max",
        "qsl-decreasing",
        "slot-mismatch",
        "narrow-table",
    ):
        assert "request " in str(err), f"{kind}: the message names no request: {err}"


# ------------------------------------------------------------------------------ hand-built caches
def _cache_bytes(cache) -> list[torch.Tensor]:
    """Copies of every tensor a cache (or a thing posing as one) holds, fp8 as bytes."""
    out = []
    for name in ("k", "v", "k_scale", "v_scale"):
        t = getattr(cache, name, None)
        if isinstance(t, torch.Tensor):
            out.append((t.view(torch.uint8) if t.dtype == torch.float8_e4m3fn else t).clone())
    return out


def _unchanged(before, cache) -> bool:
    return all(torch.equal(a, b) for a, b in zip(before, _cache_bytes(cache), strict=True))


def hand_built(kind, cache):
    """A ``KVCache`` built by hand the way a caller might get it wrong; None if it does not apply."""
    import dataclasses

    k, v = cache.k, cache.v
    if kind == "k-3d":
        return dataclasses.replace(cache, k=k.flatten(0, 1), _spill=None)
    if kind == "both-3d":
        return dataclasses.replace(cache, k=k.flatten(0, 1), v=v.flatten(0, 1), _spill=None)
    if kind == "v-other-heads":
        return dataclasses.replace(cache, v=torch.cat([v, v], dim=2), _spill=None)
    if kind == "v-other-blocks":
        return dataclasses.replace(cache, v=v[:-1], _spill=None)
    if kind == "v-other-dtype":
        return dataclasses.replace(cache, v=v.view(torch.uint8) if v.element_size() == 1 else v.double(), _spill=None)
    if kind == "k-float64":
        return dataclasses.replace(cache, k=k.double(), v=v.double(), _spill=None)
    if kind == "kv_dtype-lie":  # full-precision tensors claimed to be int8 codes, scales missing
        if cache.quantized:
            return None
        return dataclasses.replace(cache, kv_dtype="int8", _spill=None)
    if kind == "missing-k_scale":
        if not cache.quantized:
            return None
        return dataclasses.replace(cache, k_scale=None, _spill=None)
    if kind == "missing-both-scales":
        if not cache.quantized:
            return None
        return dataclasses.replace(cache, k_scale=None, v_scale=None, _spill=None)
    if kind == "scale-float16":
        if not cache.quantized:
            return None
        return dataclasses.replace(cache, v_scale=cache.v_scale.half(), _spill=None)
    if kind == "scale-shape":
        if not cache.quantized:
            return None
        return dataclasses.replace(cache, k_scale=cache.k_scale[..., None], _spill=None)
    if kind == "kv_dtype-unknown":
        return dataclasses.replace(cache, kv_dtype="int2", _spill=None)
    if kind == "dtype-not-a-dtype":
        return dataclasses.replace(cache, dtype="bf16", _spill=None)
    if kind == "k-list":
        return dataclasses.replace(cache, k=k.tolist(), _spill=None)
    if kind == "last-dim-strided":
        return dataclasses.replace(
            cache, k=torch.stack([k, k], dim=-1)[..., 0], v=torch.stack([v, v], dim=-1)[..., 0], _spill=None
        )
    raise AssertionError(kind)


BAD_CACHES = [
    "k-3d",
    "both-3d",
    "v-other-heads",
    "v-other-blocks",
    "v-other-dtype",
    "k-float64",
    "kv_dtype-lie",
    "missing-k_scale",
    "missing-both-scales",
    "scale-float16",
    "scale-shape",
    "kv_dtype-unknown",
    "dtype-not-a-dtype",
    "k-list",
    "last-dim-strided",
]


@pytest.mark.parametrize("name", FORWARD_BACKENDS)
@FUZZ_FEW
@given(
    problem=problems(),
    kind=st.sampled_from(BAD_CACHES),
    validate=st.booleans(),
    op=st.sampled_from(["forward", "write", "write_kv"]),
)
def test_hand_built_caches_are_refused_and_left_alone(name, problem, kind, validate, op):
    """A wrong hand-built KVCache: a PagedError from forward, write and write_kv (validation on or
    off), and not one byte of it changed by the refused call."""
    backend = _get(name)
    backend.validate = validate
    q, cache, meta, kw = problem
    bad = hand_built(kind, cache)
    if bad is None:
        return
    before = _cache_bytes(bad)
    k = torch.randn(meta.num_tokens, cache.num_kv_heads, cache.head_dim).to(cache.dtype).to(DEVICE)
    if op == "forward":
        err = expect_error(kind, backend.forward, q, bad, meta, **kw)
    elif op == "write":
        err = expect_error(kind, backend.write, bad, k, k.clone(), meta)
    else:
        err = expect_error(kind, write_kv, bad, k, k.clone(), meta.slot_mapping)
    assert isinstance(err, InputError), f"{kind}/{op}: {type(err).__name__}: {err}"
    assert _unchanged(before, bad), f"{kind}/{op}: the refused call changed the cache"


# ------------------------------------------------------------------------------ wrong types everywhere
_WRONG = [None, "3", 2.5, True, [1, 2], {"a": 1}, object(), -1, 2**40, torch.tensor([1.0])]


def _public_calls(q, cache, meta, backend):
    """(name, call(value)) for every public argument: the value replaces that argument."""
    from paged_core import BlockAllocator, kv_bytes_per_token, merge_states

    k = torch.randn(meta.num_tokens, cache.num_kv_heads, cache.head_dim).to(cache.dtype).to(DEVICE)
    lse = torch.zeros(q.shape[0], q.shape[1], device=DEVICE)
    return {
        "forward.q": lambda x: backend.forward(x, cache, meta),
        "forward.cache": lambda x: backend.forward(q, x, meta),
        "forward.meta": lambda x: backend.forward(q, cache, x),
        "forward.scale": lambda x: backend.forward(q, cache, meta, scale=x),
        "forward.window": lambda x: backend.forward(q, cache, meta, window=x),
        "forward.softcap": lambda x: backend.forward(q, cache, meta, softcap=x),
        "forward.sinks": lambda x: backend.forward(q, cache, meta, sinks=x),
        "forward.out": lambda x: backend.forward(q, cache, meta, out=x),
        "forward.return_lse": lambda x: backend.forward(q, cache, meta, return_lse=x),
        "plan.meta": lambda x: backend.plan(x),
        "write.cache": lambda x: backend.write(x, k, k, meta),
        "write.k": lambda x: backend.write(cache, x, k, meta),
        "write.v": lambda x: backend.write(cache, k, x, meta),
        "write.meta": lambda x: backend.write(cache, k, k, x),
        "write_kv.slot_mapping": lambda x: write_kv(cache, k, k, x),
        "select.reqs": lambda x: meta.select(x),
        "select.item": lambda x: meta.select([x]),
        "validate.num_blocks": lambda x: meta.validate(num_blocks=x),
        "to.device": lambda x: meta.to(x),
        "registry.get": lambda x: registry.get(x),
        "registry.get.validate": lambda x: registry.get("reference", validate=x),
        "kv_bytes_per_token.dtype": lambda x: kv_bytes_per_token(2, 64, dtype=x),
        "kv_bytes_per_token.kv_dtype": lambda x: kv_bytes_per_token(2, 64, kv_dtype=x),
        "kv_bytes_per_token.num_kv_heads": lambda x: kv_bytes_per_token(x, 64),
        "merge_states.outs": lambda x: merge_states(x, [lse, lse]),
        "merge_states.lses": lambda x: merge_states([q, q], x),
        "quantize_kv.kv_dtype": lambda x: quantize_kv(k, x),
        "dequantize_kv.scales": lambda x: dequantize_kv(k.to(torch.int8), x),
        "allocator.allocate": lambda x: BlockAllocator(8).allocate(x),
        "allocator.free": lambda x: BlockAllocator(8).free(x),
    }


#: The keys of ``_public_calls`` (hypothesis draws them before a problem exists).
_ARGS = [
    "forward.q",
    "forward.cache",
    "forward.meta",
    "forward.scale",
    "forward.window",
    "forward.softcap",
    "forward.sinks",
    "forward.out",
    "forward.return_lse",
    "plan.meta",
    "write.cache",
    "write.k",
    "write.v",
    "write.meta",
    "write_kv.slot_mapping",
    "select.reqs",
    "select.item",
    "validate.num_blocks",
    "to.device",
    "registry.get",
    "registry.get.validate",
    "kv_bytes_per_token.dtype",
    "kv_bytes_per_token.kv_dtype",
    "kv_bytes_per_token.num_kv_heads",
    "merge_states.outs",
    "merge_states.lses",
    "quantize_kv.kv_dtype",
    "dequantize_kv.scales",
    "allocator.allocate",
    "allocator.free",
]


@FUZZ
@given(problem=problems(), arg=st.sampled_from(_ARGS), value=st.sampled_from(_WRONG))
def test_wrong_types_for_every_public_argument(problem, arg, value):
    """Any value for any public argument: a result or a PagedError, never another exception, and a
    refused write leaves the cache as it was."""
    backend = _get("reference")
    q, cache, meta, kw = problem
    calls = _public_calls(q, cache, meta, backend)
    assert sorted(calls) == sorted(_ARGS)
    call = calls[arg]
    before = _cache_bytes(cache)
    status, res = outcome(call, value)
    if status == "error" and arg.startswith(("write", "forward")):
        assert _unchanged(before, cache), f"{arg}={value!r}: refused, but the cache changed"


# ------------------------------------------------------------------------------ host ints that lie
LIES = ["max_query_len-low", "max_seq_len-low", "both-low", "max_query_len-zero", "max_seq_len-one"]


@pytest.mark.parametrize("name", FORWARD_BACKENDS)
@FUZZ_FEW
@given(problem=problems(), lie=st.sampled_from(LIES), mirrors=st.booleans())
def test_host_int_lies_with_validation_off(name, problem, lie, mirrors):
    """max_query_len / max_seq_len below the truth, validation off, with or without the host
    mirrors: either the right answer (the kernel bounds itself) or a PagedError (a cheap check
    against the mirrors) — never rows left unwritten, keys dropped, or another exception."""
    backend = _get(name)
    backend.validate = False
    q, cache, meta, kw = problem
    if meta.num_tokens == 0 or meta.max_seq_len < 2:
        return
    mq, ms = meta.max_query_len, meta.max_seq_len
    new = {
        "max_query_len-low": {"max_query_len": max(mq - 1, 0)},
        "max_seq_len-low": {"max_seq_len": ms - 1},
        "both-low": {"max_query_len": max(mq - 1, 0), "max_seq_len": ms // 2},
        "max_query_len-zero": {"max_query_len": 0},
        "max_seq_len-one": {"max_seq_len": 1},
    }[lie]
    lying = _replace(meta, **new)
    if not mirrors:
        lying = _replace(lying, seq_lens_cpu=None, query_start_loc_cpu=None)
    before = _cache_bytes(cache)
    out = torch.full_like(q, math.nan)
    status, res = outcome(backend.forward, q, cache, lying, out=out, **kw)
    assert _unchanged(before, cache), f"{lie}: forward changed the cache"
    if status == "error":
        return
    spec_kw = {k: v for k, v in kw.items() if k in ("scale", "window", "softcap", "sinks")}
    want = reference_attention(q, cache, meta, compute_dtype=torch.float64, **spec_kw)
    assert not torch.isnan(out).any(), f"{lie} (mirrors={mirrors}): rows left unwritten"
    err = (out.double() - want).abs().max().item()
    assert err <= TOL[q.dtype] * max(want.abs().max().item(), 1.0), (
        f"{lie} (mirrors={mirrors}): accepted but wrong by {err:.3g}"
    )
