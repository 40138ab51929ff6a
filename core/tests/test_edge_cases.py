"""Numerical edge cases and bad metadata, on every backend that runs here (issue 9).

- inf/NaN in one request's q or K/V reach that request's rows only; stale NaN in blocks no
  request owns (block 0, slots past a request's seq_len) reaches nobody;
- huge logits (~1e4) and fp16 inputs of magnitude 200-1000 stay finite and match the reference;
- empty batches (no requests; no tokens but padding requests) and one-token contexts;
- bad metadata with validation off: block ids outside the pool, ``slot_mapping`` past the end,
  ``seq_len`` past what the table covers. Kernels mask (docs/reliability.md): results equal the
  float64 reference, which masks the same keys, and nothing outside the cache or ``out`` is read
  or written (guard regions of NaN around both). With validation on, the same inputs raise
  ``BatchMetaError`` naming the request and the field.

Backends come from the registry and are skipped with the registry's (or the spec's) reason.
Shapes are tiny so Triton's CPU interpreter keeps this module well under a minute.
"""

from __future__ import annotations

import pytest
import torch
from paged_conformance.tolerances import assert_close_to_reference, output_tolerance
from paged_core import (
    AttentionSpec,
    BatchMeta,
    BatchMetaError,
    KVCache,
    allocate_kv_cache,
    dequantize_kv,
    quantize_kv,
    reference_attention,
    registry,
    write_kv,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HQ, HKV, D, BS = 4, 2, 64, 16
NUM_BLOCKS = 24

# (id, registry name, options): the split path of triton-unified needs num_splits > 1 on the CPU,
# where choose_num_splits says 1 and the backend runs the unified kernel.
BACKENDS = [
    ("reference", "reference", {}),
    ("triton-unified", "triton-unified", {}),
    ("triton-unified-split", "triton-unified", {"num_splits": 2}),
]


def _backend(name: str, options: dict, *, dtype=torch.float32, kv_dtype="auto", validate=False):
    reasons = registry.unavailable(name) if name in registry.names() else [f"{name} is not installed"]
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    backend = registry.get(name, validate=validate, **options)
    spec = AttentionSpec(
        num_heads=HQ, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype=dtype, kv_dtype=kv_dtype, device=DEVICE
    )
    reasons = backend.reasons(spec)
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    return backend


@pytest.fixture(params=BACKENDS, ids=[b[0] for b in BACKENDS])
def backend_args(request):
    return request.param[1:]


def oracle(q, cache, meta, *, scale=None):
    """The float64 reference (which masks out-of-pool blocks and keys past the table too)."""
    return reference_attention(q, cache, meta, scale=scale, compute_dtype=torch.float64)


def batch(qlens, slens, *, dtype=torch.float32, seed=0, num_blocks=NUM_BLOCKS, kv_dtype="auto", mag=1.0):
    """A batch, its cache filled through write_kv (block 0 reserved), and q."""
    gen = torch.Generator().manual_seed(seed)
    meta = BatchMeta.build(qlens, slens, block_size=BS, num_blocks=num_blocks, seed=seed).to(DEVICE)
    cache = allocate_kv_cache(num_blocks, BS, HKV, D, dtype=dtype, kv_dtype=kv_dtype, device=DEVICE)
    # Fill whole contexts: one write of every position of every request.
    tables = [t[: -(-s // BS)] for t, s in zip(meta.block_table.tolist(), slens, strict=True)]
    full = BatchMeta.from_lists(slens, slens, tables, block_size=BS).to(DEVICE)
    n = full.num_tokens
    write_kv(
        cache,
        (mag * torch.randn(n, HKV, D, generator=gen)).to(dtype).to(DEVICE),
        (mag * torch.randn(n, HKV, D, generator=gen)).to(dtype).to(DEVICE),
        full.slot_mapping,
    )
    q = (mag * torch.randn(meta.num_tokens, HQ, D, generator=gen)).to(dtype).to(DEVICE)
    return q, cache, meta


def rows_of(meta: BatchMeta, r: int) -> slice:
    qsl = meta.query_start_loc.tolist()
    return slice(qsl[r], qsl[r + 1])


def assert_close(got, want, dtype, *, rows=None, magnitude=1.0, what=""):
    """``got`` within the suite's tolerance for ``dtype`` of the float64 ``want`` (the shared one,
    for values ``magnitude`` times the unit-normal data it is stated for)."""
    if rows is not None:
        got, want = got[rows], want[rows]
    assert_close_to_reference(
        got, want, backend=what, case="edge", tolerance=output_tolerance(dtype).for_values_of(magnitude)
    )


# A decode batch (triton-unified's split path, with num_splits) and a mixed one (the unified kernel).
DECODE = ([1, 1, 1], [37, 20, 9])
MIXED = ([1, 5, 3], [37, 20, 9])
SHAPES = {"decode": DECODE, "mixed": MIXED}


# ------------------------------------------------------------------------------ inf / NaN
@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("poison", ["nan", "inf"])
def test_nonfinite_q_stays_in_its_request(backend_args, shape, poison):
    name, opts = backend_args
    backend = _backend(name, opts)
    q, cache, meta = batch(*SHAPES[shape])
    want = oracle(q, cache, meta)
    bad = rows_of(meta, 1)
    q[bad] = float(poison)  # inf * (mixed-sign k) sums to NaN: the rows must come out NaN
    out = backend.forward(q, cache, meta)
    assert out[bad].isnan().all(), f"{name}: request 1's rows should be NaN"
    for r in (0, 2):
        assert_close(out, want, torch.float32, rows=rows_of(meta, r), what=f"{name} request {r}")


@pytest.mark.parametrize("shape", list(SHAPES))
@pytest.mark.parametrize("which", ["k", "v"])
def test_nan_in_one_requests_kv_stays_in_it(backend_args, shape, which):
    name, opts = backend_args
    backend = _backend(name, opts)
    q, cache, meta = batch(*SHAPES[shape])
    want = oracle(q, cache, meta)
    block = int(meta.block_table[1, 0])  # position 0 of request 1: every query of it sees it
    getattr(cache, which)[block] = float("nan")
    out = backend.forward(q, cache, meta)
    assert out[rows_of(meta, 1)].isnan().all(), f"{name}: request 1's rows should be NaN"
    for r in (0, 2):
        assert_close(out, want, torch.float32, rows=rows_of(meta, r), what=f"{name} request {r}")


@pytest.mark.parametrize("shape", list(SHAPES))
def test_stale_nan_outside_every_context_reaches_nobody(backend_args, shape):
    # Block 0 (reserved, and the filler of every table's unused columns) and the slots past
    # each request's seq_len in its last block hold NaN, as stale memory of a reused cache may.
    # Masked keys must be dropped, not multiplied by a zero probability (0 * NaN = NaN).
    name, opts = backend_args
    backend = _backend(name, opts)
    q, cache, meta = batch(*SHAPES[shape])
    for t in (cache.k, cache.v):
        t[0] = float("nan")
        for r, s in enumerate(meta.seq_lens.tolist()):
            if s % BS:
                t[int(meta.block_table[r, (s - 1) // BS]), s % BS :] = float("nan")
    # The oracle reads only each request's own keys: recompute it on a NaN-free copy.
    clean = KVCache(k=cache.k.nan_to_num(0.0), v=cache.v.nan_to_num(0.0), dtype=cache.dtype)
    want = oracle(q, clean, meta)
    out = backend.forward(q, cache, meta)
    assert_close(out, want, torch.float32, what=name)


# ------------------------------------------------------------------------------ magnitudes
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_huge_logits_do_not_overflow(backend_args, dtype):
    name, opts = backend_args
    backend = _backend(name, opts, dtype=dtype)
    # |q| = |k| = 100 per element: logits q.k / 8 have a spread of about 1e4.
    q, cache, meta = batch(*MIXED, dtype=dtype, mag=100.0)
    logits = (q[0, 0].double() @ cache.k[int(meta.block_table[0, 0]), :, 0].double().T) * D**-0.5
    assert logits.abs().max() > 3e3
    out = backend.forward(q, cache, meta)
    assert_close(out, oracle(q, cache, meta), dtype, magnitude=100.0, what=name)


@pytest.mark.parametrize("scale", [None, 1e-6], ids=["default-scale", "small-scale"])
def test_fp16_large_values(backend_args, scale):
    name, opts = backend_args
    backend = _backend(name, opts, dtype=torch.float16)
    q, cache, meta = batch(*MIXED, dtype=torch.float32)
    gen = torch.Generator().manual_seed(1)

    def big(t):  # magnitudes 200 .. 1000 with random signs, exact in fp16
        mag = 200 + 800 * torch.rand(t.shape, generator=gen)
        return (mag * t.sign().cpu()).to(torch.float16).to(DEVICE)

    q = big(q)
    cache = KVCache(k=big(cache.k), v=big(cache.v), dtype=torch.float16)
    out = backend.forward(q, cache, meta, scale=scale)
    assert out.dtype == torch.float16
    assert_close(out, oracle(q, cache, meta, scale=scale), torch.float16, magnitude=1000.0, what=name)


# ------------------------------------------------------------------------------ shapes
@pytest.mark.parametrize(
    ("qlens", "slens"),
    [([], []), ([0, 0], [0, 0]), ([0, 0, 0], [0, 17, 5])],
    ids=["no-requests", "padding-only", "context-only"],
)
@pytest.mark.parametrize("kv_dtype", ["auto", "int8"])
def test_empty_batches(backend_args, qlens, slens, kv_dtype):
    name, opts = backend_args
    backend = _backend(name, opts, kv_dtype=kv_dtype)
    meta = BatchMeta.build(qlens, slens, block_size=BS, num_blocks=8).to(DEVICE)
    cache = backend.allocate(8, BS, HKV, D, dtype=torch.float32, kv_dtype=kv_dtype, device=DEVICE)
    before = [t.clone() for t in (cache.k, cache.v)]
    kv = torch.empty(0, HKV, D, device=DEVICE)
    backend.write(cache, kv, kv, meta)
    assert all(torch.equal(a, b) for a, b in zip(before, (cache.k, cache.v), strict=True))
    q = torch.empty(0, HQ, D, device=DEVICE)
    out = backend.forward(q, cache, meta)
    assert out.shape == (0, HQ, D)
    if backend.capabilities.returns_lse:
        out, lse = backend.forward(q, cache, meta, return_lse=True)
        assert out.shape == (0, HQ, D) and lse.shape == (0, HQ)
    backend.validate = True
    assert backend.forward(q, cache, meta).shape == (0, HQ, D)


@pytest.mark.parametrize(
    ("qlens", "slens"),
    [([1], [1]), ([1, 1, 1], [1, 1, 40]), ([1, 1, 1], [1, 0, 1]), ([1, 4], [1, 4])],
    ids=["one", "decode-batch", "with-padding", "mixed"],
)
def test_one_token_contexts(backend_args, qlens, slens):
    name, opts = backend_args
    backend = _backend(name, opts)
    q, cache, meta = batch(qlens, slens)
    # Poisoned: a padding row left unwritten must not pass as the zeros it should hold.
    out = backend.forward(q, cache, meta, out=torch.full_like(q, float("nan")))
    want = oracle(q, cache, meta)
    assert_close(out, want, torch.float32, what=name)
    for r, s in enumerate(slens):
        if s == 1:  # softmax over one key: exactly that key's value
            key = int(meta.block_table[r, 0])
            v = cache.v[key, 0].repeat_interleave(HQ // HKV, dim=0)
            assert torch.allclose(out[rows_of(meta, r)][0], v, atol=1e-5)
        if s == 0:
            assert (out[rows_of(meta, r)] == 0).all()


# ------------------------------------------------------------------------------ bad metadata
def guarded_cache(num_blocks=NUM_BLOCKS, guard=4):
    """A cache whose pool sits between ``guard`` blocks of NaN on each side (no spill block).

    A kernel that reads outside the pool and uses what it read returns NaN; one that writes
    there leaves finite values in the guards.
    """
    store = torch.full((2, guard + num_blocks + guard, BS, HKV, D), float("nan"), device=DEVICE)
    cache = KVCache(k=store[0, guard:-guard], v=store[1, guard:-guard], dtype=torch.float32)
    return cache, store, guard


def _guards_intact(store, guard):
    return bool(store[:, :guard].isnan().all() and store[:, -guard:].isnan().all())


def bad_batch(kind):
    """(q, guarded cache, store, guard, meta, the request and field validation must name)."""
    cache, store, guard = guarded_cache()
    q, clean, meta = batch(*MIXED)
    cache.k.copy_(clean.k)
    cache.v.copy_(clean.v)
    if kind.startswith("block-"):
        value = {"block--1": -1, "block-num_blocks": NUM_BLOCKS, "block-2**31-1": 2**31 - 1, "block--2**31": -(2**31)}[
            kind
        ]
        meta.block_table[1, 1] = value  # request 1 (seq_len 20): its keys 16..19
        meta.block_table[2, 0] = value  # request 2 (seq_len 9): every key -> its rows are zeros
        needles = ["request 1", f"block_table[1, 1] = {value}", "outside the cache"]
    elif kind == "seq_len-past-table":
        meta = BatchMeta.build(*MIXED, block_size=BS, num_blocks=NUM_BLOCKS).to(DEVICE)
        meta.seq_lens[0] = 3 * BS + 5  # the table has 3 columns: keys from 48 on are masked
        meta.seq_lens_cpu = meta.seq_lens.cpu()
        meta.max_seq_len = 3 * BS + 5
        needles = ["request 0", "seq_lens[0] = 53 needs 4 blocks", "block_table has 3 columns"]
    else:
        raise AssertionError(kind)
    return q, cache, store, guard, meta, needles


BAD = ["block--1", "block-num_blocks", "block-2**31-1", "block--2**31", "seq_len-past-table"]


@pytest.mark.parametrize("kind", BAD)
def test_bad_metadata_validation_off_is_masked(backend_args, kind):
    name, opts = backend_args
    backend = _backend(name, opts)
    q, cache, store, guard, meta, _ = bad_batch(kind)
    out_store = torch.full((q.shape[0] + 2, HQ, D), float("nan"), device=DEVICE)
    out = backend.forward(q, cache, meta, out=out_store[1:-1])
    assert out_store[0].isnan().all() and out_store[-1].isnan().all(), f"{name} wrote outside out"
    assert _guards_intact(store, guard), f"{name} wrote outside the cache"
    # The float64 reference masks the same keys (docs/reliability.md): the results agree, and a
    # request whose every key is masked gets exact zeros.
    want = oracle(q, cache, meta)
    assert_close(out, want, torch.float32, what=f"{name}/{kind}")
    if kind.startswith("block-"):
        assert (out[rows_of(meta, 2)] == 0).all()


@pytest.mark.parametrize("how", ["argument", "env"])
@pytest.mark.parametrize("kind", BAD)
def test_bad_metadata_validation_on_raises(backend_args, kind, how, monkeypatch):
    name, opts = backend_args
    if how == "env":
        monkeypatch.setenv("PAGED_VALIDATE", "1")
        backend = _backend(name, opts, validate=None)
    else:
        monkeypatch.delenv("PAGED_VALIDATE", raising=False)
        backend = _backend(name, opts, validate=True)
    q, cache, _, _, meta, needles = bad_batch(kind)
    with pytest.raises(BatchMetaError) as exc:
        backend.forward(q, cache, meta)
    for needle in needles:
        assert needle in str(exc.value), f"{needle!r} not in {exc.value}"


def bad_rows_batch(kind):
    """Metadata the kernels clamp or skip: (q, cache, meta, the rows no backend writes, needles).

    MIXED has query_start_loc [0, 1, 6, 9] and seq_lens [37, 20, 9]. The host mirrors follow the
    device tensors (and max_query_len the longest request), so only the device data lies.
    """
    q, cache, meta = batch(*MIXED)
    unwritten: list[int] = []
    if kind == "query_start_loc-past-the-tokens":
        meta.query_start_loc[2] = 12  # request 1: rows 1..11 (9..11 do not exist); request 2: none
        needles = ["request 1", "query_start_loc[2] is 12, past the 9 rows"]
    elif kind == "query_start_loc-decreasing":
        meta.query_start_loc[3] = 4  # request 2: 6 -> 4, no rows; rows 6..8 belong to nobody
        unwritten = [6, 7, 8]
        needles = ["query_start_loc[3] is 4", "slot_mapping has 9 rows"]
    elif kind == "negative-seq_len":
        meta.seq_lens[1] = -3  # request 1 sees no key: its rows are zeros
        needles = ["request 1", "seq_lens[1] is -3", "accepted: >= 0"]
    else:
        raise AssertionError(kind)
    meta.query_start_loc_cpu = meta.query_start_loc.cpu()
    meta.seq_lens_cpu = meta.seq_lens.cpu()
    meta.max_query_len = max(int((meta.query_start_loc[1:] - meta.query_start_loc[:-1]).max()), 1)
    meta._checked = None  # tensors edited in place
    return q, cache, meta, unwritten, needles


BAD_ROWS = ["query_start_loc-past-the-tokens", "query_start_loc-decreasing", "negative-seq_len"]


@pytest.mark.parametrize("kind", BAD_ROWS)
def test_bad_rows_validation_off_are_masked_like_the_kernels(backend_args, kind):
    """The reference used to raise torch errors here (slicing past q, negative sizes) while the
    kernels clamp and skip; now every backend, oracle included, does the same thing."""
    name, opts = backend_args
    backend = _backend(name, opts)
    q, cache, meta, unwritten, _ = bad_rows_batch(kind)
    out = torch.full_like(q, float("nan"))
    backend.forward(q, cache, meta, out=out)
    written = [i for i in range(q.shape[0]) if i not in unwritten]
    assert out[unwritten].isnan().all(), f"{name} wrote rows that belong to no request"
    # Computed by hand from the rule of positions, never by the code under test: request 1's
    # rows under a negative seq_len see no key (zeros); past-the-tokens rows follow its length.
    want = oracle(q, cache, meta)
    assert_close(out[written], want[written], torch.float32, what=f"{name}/{kind}")
    if kind == "negative-seq_len":
        assert (out[rows_of(meta, 1)] == 0).all()
    if kind == "query_start_loc-past-the-tokens":
        # Request 1 has 11 queries at positions 9..19: row 8 is its 8th, at position 16.
        one = BatchMeta.from_lists([1], [17], [meta.block_table[1].tolist()], block_size=BS).to(DEVICE)
        alone = oracle(q[8:9], cache, one)
        assert_close(out[8:9], alone, torch.float32, what=f"{name}/{kind}/row 8")


@pytest.mark.parametrize("kind", BAD_ROWS)
def test_bad_rows_validation_on_raise(backend_args, kind):
    name, opts = backend_args
    backend = _backend(name, opts, validate=True)
    q, cache, meta, _, needles = bad_rows_batch(kind)
    with pytest.raises(BatchMetaError) as exc:
        backend.forward(q, cache, meta)
    for needle in needles:
        assert needle in str(exc.value), f"{needle!r} not in {exc.value}"


SLOTS_PAST = {
    "num_slots": lambda n: n,
    "num_slots+5": lambda n: n + 5,
    "2**40": lambda n: 2**40,
    "-7": lambda n: -7,
}


@pytest.mark.parametrize("bad", list(SLOTS_PAST))
@pytest.mark.parametrize(
    ("kv_dtype", "spill"),
    [("auto", True), ("int8", True), ("fp8", True), ("auto", False)],
    ids=["allocated-auto", "allocated-int8", "allocated-fp8", "wrapped-auto"],  # wrapped: no spill block
)
def test_write_kv_never_leaves_the_pool(bad, kv_dtype, spill):
    nb = 6
    num_slots = nb * BS
    if spill:
        cache = allocate_kv_cache(nb, BS, HKV, D, dtype=torch.float32, kv_dtype=kv_dtype, device=DEVICE)
        cache.k.fill_(1)  # recognisable: a stray write would change it
        cache.v.fill_(1)
        store = None
    else:
        cache, store, guard = guarded_cache(nb)
        cache.k.fill_(1)
        cache.v.fill_(1)
    before = [t.clone() for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    slots = torch.tensor([3, SLOTS_PAST[bad](num_slots), 2 * BS + 1, -1, num_slots - 1], device=DEVICE)
    k = torch.randn(5, HKV, D, device=DEVICE)
    v = torch.randn(5, HKV, D, device=DEVICE)
    write_kv(cache, k, v, slots)
    good = {0: 3, 2: 2 * BS + 1, 4: num_slots - 1}
    after = [t for t in (cache.k, cache.v, cache.k_scale, cache.v_scale) if t is not None]
    for t0, t1 in zip(before, after, strict=True):
        flat0 = t0.view(torch.uint8) if t0.dtype == torch.float8_e4m3fn else t0
        flat1 = t1.view(torch.uint8) if t1.dtype == torch.float8_e4m3fn else t1
        flat0 = flat0.reshape(num_slots, *flat0.shape[2:])
        flat1 = flat1.reshape(num_slots, *flat1.shape[2:])
        untouched = torch.ones(num_slots, dtype=torch.bool)
        untouched[list(good.values())] = False
        assert torch.equal(flat0[untouched.to(DEVICE)], flat1[untouched.to(DEVICE)]), "a stray write"
    kd, vd = cache.dequantized()
    for src, got in ((k, kd), (v, vd)):
        want = src if kv_dtype == "auto" else dequantize_kv(*quantize_kv(src, kv_dtype))
        for row, slot in good.items():
            assert torch.equal(got.reshape(num_slots, HKV, D)[slot], want[row])
    if store is not None:
        assert _guards_intact(store, guard)


def test_backend_write_slot_past_the_end(backend_args, monkeypatch):
    # Validation off: the bad row is skipped, the rest written. On: BatchMetaError, no write.
    monkeypatch.delenv("PAGED_VALIDATE", raising=False)
    name, opts = backend_args
    meta = BatchMeta.build([2, 1], [5, 9], block_size=BS, num_blocks=4).to(DEVICE)
    meta.slot_mapping[1] = 4 * BS + 2  # request 0's second token, past the pool of 4 blocks
    for validate in (False, True):
        backend = _backend(name, opts, validate=validate)
        cache = backend.allocate(4, BS, HKV, D, dtype=torch.float32, device=DEVICE)
        k = torch.randn(3, HKV, D, device=DEVICE)
        if validate:
            with pytest.raises(BatchMetaError, match=r"request 0: slot_mapping\[1\] is 66"):
                backend.write(cache, k, k, meta)
            assert not cache.k.any()
        else:
            backend.write(cache, k, k, meta)
            flat = cache.k.reshape(-1, HKV, D)
            for row, slot in enumerate(meta.slot_mapping.tolist()):
                if row != 1:
                    assert torch.equal(flat[slot], k[row])
            assert int((flat.abs().sum(dim=(1, 2)) > 0).sum()) == 2  # nothing else written


# ------------------------------------------------------------------------------ strided sinks
@pytest.mark.parametrize("shape", list(SHAPES))
def test_strided_sinks_are_read_by_head(backend_args, shape):
    """Sinks that are every other element of a buffer: the Triton kernels used to read them as
    if contiguous (head h got buffer[h], a neighbour's value). forward now hands every backend
    contiguous sinks."""
    name, opts = backend_args
    backend = _backend(name, opts)
    if not backend.capabilities.sinks:
        pytest.skip(f"{name}: attention sinks are not supported")
    q, cache, meta = batch(*SHAPES[shape])
    buf = torch.tensor([1.5, -40.0, -0.5, 40.0, 2.5, -40.0, 0.0, 40.0], device=DEVICE)
    sinks = buf[::2]
    assert not sinks.is_contiguous()
    out = backend.forward(q, cache, meta, sinks=sinks)
    want = reference_attention(
        q, cache, meta, sinks=torch.tensor([1.5, -0.5, 2.5, 0.0], device=DEVICE), compute_dtype=torch.float64
    )
    assert_close(out, want, torch.float32, what=f"{name}/strided sinks")
