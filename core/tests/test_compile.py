"""torch.compile: ``write`` and ``forward`` are the custom ops ``paged::write`` / ``paged::forward``.

A step compiled with ``fullgraph=True`` (which raises on any graph break) must give what eager
gives and what the float64 reference gives, compile once for a whole run of steps, and write the
cache in place. On the CPU the Triton backends run under ``TRITON_INTERPRET=1`` (core/tests/conftest.py)
inside the compiled graph: the op calls the eager launcher, which the interpreter runs as usual.
"""

from __future__ import annotations

import gc
import inspect
import pathlib
import re

import pytest
import torch
from paged_conformance.tolerances import assert_close_to_reference, lse_tolerance, output_tolerance
from paged_core import (
    AttentionSpec,
    BatchMeta,
    InputError,
    KVCache,
    _ops,
    reference_attention,
    registry,
)
from torch._dynamo.testing import CompileCounterWithBackend

# The torch.compile section of the contract's page, whose example is run as written.
CONTRACT_DOC = (pathlib.Path(__file__).resolve().parents[2] / "docs" / "contract.md").read_text()
HEADS, KV_HEADS, HEAD_DIM, BLOCK, NUM_BLOCKS = 4, 2, 32, 16, 12
#: Physical blocks per request: a prefill chunk, a decode, a padding request (seq_len 0).
TABLES = [[3, 7], [5, 1, 9], []]
WIDTH = 3
CPU_BACKENDS = ["reference", "triton-unified"]


@pytest.fixture(autouse=True)
def fresh_dynamo():
    """Each test compiles from scratch: dynamo's cache is per code object (``step``), and the
    recompile limit would count other tests' backends."""
    torch._dynamo.reset()
    yield
    torch._dynamo.reset()


def batch(query_lens, seq_lens, device="cpu") -> BatchMeta:
    return BatchMeta.from_lists(query_lens, seq_lens, TABLES, block_size=BLOCK, table_width=WIDTH, device=device)


#: Steps with one shape (3 requests, 3 tokens) and new lengths each time, as decode steps are.
STEPS = [([1, 1, 1], [20, 33, 0]), ([1, 1, 1], [21, 34, 0]), ([1, 1, 1], [22, 40, 0])]
#: A mixed step: a 3-token chunk after 17 cached tokens, a decode, a padding request.
MIXED = ([3, 1, 1], [20, 33, 0])


def step(backend, q, k, v, cache, plan):
    backend.write(cache, k, v, plan)
    return backend.forward(q, cache, plan, return_lse=True)


def get(name: str, device: str | None = "cpu"):
    """The backend, or a skip with the registry's reason it cannot run here (on ``device``, if
    given: a GPU machine runs Triton compiled, and then not on the CPU)."""
    if name not in registry.names():
        pytest.skip(f"{name}: not installed (no registered backend of that name)")
    reasons = registry.unavailable(name)
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    backend = registry.get(name)
    spec = AttentionSpec(
        num_heads=HEADS,
        num_kv_heads=KV_HEADS,
        head_dim=HEAD_DIM,
        block_size=BLOCK,
        dtype=torch.float32,
        device=device or "cpu",
    )
    reasons = [] if device is None else backend.reasons(spec)
    if reasons:
        pytest.skip(f"{name} on {device}: {'; '.join(reasons)}")
    return backend


def inputs(meta: BatchMeta, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    n = meta.num_tokens
    k, v = (torch.randn(n, KV_HEADS, HEAD_DIM, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(n, HEADS, HEAD_DIM, generator=g).to(dtype)
    return q, k, v


def fill(backend, cache: KVCache, seed=1) -> None:
    """Random contents for every block, so forward reads real context (not zeros)."""
    g = torch.Generator().manual_seed(seed)
    slots, heads, dim = cache.num_blocks * cache.block_size, cache.num_kv_heads, cache.head_dim
    k, v = (torch.randn(slots, heads, dim, generator=g).to(cache.device, cache.dtype) for _ in range(2))
    full = BatchMeta.from_lists([slots], [slots], [list(range(cache.num_blocks))], block_size=cache.block_size)
    backend.write(cache, k, v, full.to(cache.device))


def check_against_reference(name, out, lse, q, cache, meta, case):
    """Output and LSE against the float64 reference on the cache as it is now (padding rows:
    zeros and -inf in both)."""
    ref, ref_lse = reference_attention(q, cache, meta, compute_dtype=torch.float64, return_lse=True)
    where = dict(query_start_loc=meta.query_start_loc.tolist(), seq_lens=meta.seq_lens.tolist())
    assert_close_to_reference(
        out, ref, backend=name, case=case, tolerance=output_tolerance(q.dtype, cache.kv_dtype), **where
    )
    assert_close_to_reference(
        lse, ref_lse, backend=name, case=case, what="lse", tolerance=lse_tolerance(q.dtype, cache.kv_dtype), **where
    )


# ----------------------------------------------------------------------------------- one graph


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_write_and_forward_trace_to_one_graph_without_breaks(name):
    backend = get(name)
    meta = batch(*MIXED)
    cache = backend.allocate(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    q, k, v = inputs(meta)
    explained = torch._dynamo.explain(step)(backend, q, k, v, cache, backend.plan(meta))
    assert (explained.graph_count, explained.graph_break_count) == (1, 0), explained.break_reasons
    ops = [node.target for g in explained.graphs for node in g.graph.nodes if node.op == "call_function"]
    assert ops.count(torch.ops.paged.write.default) == 1 and ops.count(torch.ops.paged.forward.default) == 1, ops


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8", "int8-static", "fp8-static"])
@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_compiled_step_equals_eager_and_the_float64_reference(name, kv_dtype):
    backend = get(name)
    meta = batch(*MIXED)
    caches = []
    kv_dtype, _, static = kv_dtype.partition("-")
    for _ in range(2):
        # Static scales: one per KV head, fixed (the compiled write must leave them as they are).
        scales = (
            dict(k_scale=torch.linspace(0.01, 0.03, KV_HEADS), v_scale=torch.linspace(0.02, 0.04, KV_HEADS))
            if static
            else {}
        )
        cache = backend.allocate(
            NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32, kv_dtype=kv_dtype, **scales
        )
        fill(backend, cache)
        caches.append(cache)
    eager_cache, compiled_cache = caches
    q, k, v = inputs(meta)
    plan = backend.plan(meta)
    compiled = torch.compile(step, fullgraph=True, backend="aot_eager")  # fullgraph: a break raises
    out, lse = compiled(backend, q, k, v, compiled_cache, plan)
    eager_out, eager_lse = step(backend, q, k, v, eager_cache, plan)

    for field in ("k", "v", "k_scale", "v_scale"):
        a, b = getattr(compiled_cache, field), getattr(eager_cache, field)
        if a is not None:
            assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), f"[{name}] cache.{field} differs from eager"
    if kv_dtype == "auto":
        # The new rows are in the pool (expected values: the inputs themselves), padding rows nowhere.
        slots = meta.slot_mapping
        written = compiled_cache.k.reshape(-1, KV_HEADS, HEAD_DIM)[slots[slots >= 0]]
        assert torch.equal(written, k[slots >= 0])
    check_against_reference(name, out, lse, q, compiled_cache, meta, f"compiled-{kv_dtype}")
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse), f"[{name}] compiled output differs from eager"


def test_the_documented_example_compiles_once_with_inductor_and_computes_attention():
    """docs/contract.md's torch.compile block, as written: the default backend (inductor), two layers,
    three steps with a new plan each; the last step checked against the float64 reference."""
    section = CONTRACT_DOC.split("## torch.compile\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", section, flags=re.S)
    ns: dict = {}
    graphs = torch._dynamo.utils.counters["stats"]["unique_graphs"]
    exec(compile(block, "docs/contract.md#torch.compile", "exec"), ns)
    assert torch._dynamo.utils.counters["stats"]["unique_graphs"] - graphs == 1
    outs, meta, q, k, v = ns["outs"], ns["meta"], ns["q"], ns["k"], ns["v"]
    slots = meta.slot_mapping
    for layer, cache in enumerate(ns["caches"]):
        # Written in place, into the caller's cache (expected values: the inputs themselves).
        assert torch.equal(cache.v.reshape(-1, 2, 64)[slots], v) and torch.equal(cache.k.reshape(-1, 2, 64)[slots], k)
        ref = reference_attention(q, cache, meta, compute_dtype=torch.float64)
        assert_close_to_reference(
            outs[layer],
            ref,
            backend="reference",
            case=f"readme-layer{layer}",
            tolerance=output_tolerance(torch.float32),
        )


@pytest.mark.parametrize("name", CPU_BACKENDS)
def test_a_new_plan_each_step_does_not_recompile(name):
    backend = get(name)
    cache = backend.allocate(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    fill(backend, cache)
    counter = CompileCounterWithBackend("aot_eager")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for i, (query_lens, seq_lens) in enumerate(STEPS):
        meta = batch(query_lens, seq_lens)  # new tensors, new host ints, new plan: same shapes
        q, k, v = inputs(meta, seed=i)
        out, lse = compiled(backend, q, k, v, cache, backend.plan(meta))
        check_against_reference(name, out, lse, q, cache, meta, f"step-{i}")
    assert counter.frame_count == 1, f"[{name}] {counter.frame_count} compilations for {len(STEPS)} steps"


def test_a_batch_that_was_never_planned_is_rebuilt_from_its_tensors():
    """No plan(): the op reads the host ints from the device (a sync) and is still right."""
    backend = get("reference")
    meta = batch(*MIXED)
    cache = backend.allocate(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    fill(backend, cache)
    q, k, v = inputs(meta)
    out, lse = torch.compile(step, fullgraph=True, backend="aot_eager")(backend, q, k, v, cache, meta)
    check_against_reference("reference", out, lse, q, cache, meta, "unplanned")


def test_an_engine_owned_strided_cache_is_written_and_read_like_eager():
    """k = pool[:, 0], v = pool[:, 1] of one [num_blocks, 2, block_size, H, D] pool (no spill block)."""
    backend = get("reference")
    meta = batch(*MIXED)
    pools = [
        torch.randn(NUM_BLOCKS, 2, BLOCK, KV_HEADS, HEAD_DIM, generator=torch.Generator().manual_seed(3))
        for _ in range(2)
    ]
    eager_cache, compiled_cache = (KVCache(p[:, 0], p[:, 1], dtype=torch.float32) for p in pools)
    q, k, v = inputs(meta)
    plan = backend.plan(meta)
    out, lse = torch.compile(step, fullgraph=True, backend="aot_eager")(backend, q, k, v, compiled_cache, plan)
    eager_out, eager_lse = step(backend, q, k, v, eager_cache, plan)
    assert torch.equal(pools[0], pools[1]), "the compiled write left the pool different from the eager write"
    assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse)


def test_errors_of_the_eager_checks_surface_from_the_compiled_call():
    backend = get("reference")
    meta = batch(*MIXED)
    cache = backend.allocate(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    q = torch.randn(meta.num_tokens, 3, HEAD_DIM)  # 3 query heads over 2 KV heads

    def attend(q, cache, plan):
        return backend.forward(q, cache, plan)

    with pytest.raises(InputError, match="not a multiple of the cache's 2 KV heads"):
        torch.compile(attend, fullgraph=True, backend="aot_eager")(q, cache, backend.plan(meta))


# ----------------------------------------------------------------------------------- the ops


def _write_args(backend, cache, k, v, meta):
    stores = (*cache._spill, None, None)[:4]
    return (backend._op_handle, k, v, *stores, cache.kv_dtype, True, meta.slot_mapping)


@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "fp8"])
def test_opcheck_write(kv_dtype):
    backend = get("reference")
    meta = batch(*MIXED)
    cache = backend.allocate(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32, kv_dtype=kv_dtype)
    q, k, v = inputs(meta)
    backend.plan(meta)
    utils = list(torch.library._OPCHECK_DEFAULT_UTILS)
    if kv_dtype == "fp8":
        # opcheck's schema test compares tensors with torch.allclose, which PyTorch's CPU build
        # lacks for float8_e4m3fn ("mul_cpu_reduced_float" not implemented): the other three run,
        # and the test below checks that the fp8 write mutates the cache.
        utils.remove("test_schema")
    torch.library.opcheck(_ops.write_op, _write_args(backend, cache, k, v, meta), test_utils=utils)
    before = cache.k.view(torch.uint8).clone()
    _ops.write_op(*_write_args(backend, cache, k, v, meta))
    assert not torch.equal(cache.k.view(torch.uint8), before)


@pytest.mark.parametrize("planned", [True, False], ids=["planned", "unplanned"])
@pytest.mark.parametrize("extras", ["plain", "lse+sinks"])
def test_opcheck_forward(extras, planned):
    backend = get("reference")
    meta = batch(*MIXED)
    cache = backend.allocate(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    fill(backend, cache)
    q, _, _ = inputs(meta)
    if planned:
        backend.plan(meta)
    lse = torch.empty(meta.num_tokens, HEADS) if extras != "plain" else None
    sinks = torch.randn(HEADS) if extras != "plain" else None
    args = (
        backend._op_handle,
        q,
        cache.k,
        cache.v,
        None,
        None,
        "auto",
        meta.query_start_loc,
        meta.seq_lens,
        meta.block_table,
        meta.slot_mapping,
        torch.empty_like(q),
        lse,
        sinks,
        0.2,
        0,
        0.0,
    )
    torch.library.opcheck(_ops.forward_op, args)


def test_plan_is_remembered_with_the_class_signature():
    backend = get("reference")
    assert inspect.signature(backend.plan) == inspect.signature(type(backend).plan.__get__(backend))
    metas = [batch(*MIXED) for _ in range(_ops.KEPT_PLANS + 1)]
    plans = [backend.plan(m) for m in metas]
    assert plans[-1] is metas[-1]  # the reference's plan is the BatchMeta itself
    assert list(backend._op_plans) == plans[::-1][: _ops.KEPT_PLANS]


def test_each_instance_has_its_own_stable_handle():
    a, b = registry.get("reference"), registry.get("reference")
    assert a._op_handle != b._op_handle
    handle = a._op_handle
    a.plan(batch(*MIXED))
    assert a._op_handle == handle


def test_a_handle_whose_backend_is_gone_is_an_input_error():
    backend = get("reference")
    meta = batch(*MIXED)
    cache = backend.allocate(NUM_BLOCKS, BLOCK, KV_HEADS, HEAD_DIM, dtype=torch.float32)
    q, k, v = inputs(meta)
    args = _write_args(backend, cache, k, v, meta)
    del backend
    gc.collect()
    with pytest.raises(InputError, match="no live backend has op handle"):
        _ops.write_op(*args)


# ----------------------------------------------------------------------------------- GPU


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device (torch.cuda.is_available() is False)")
@pytest.mark.parametrize("kv_dtype", ["auto", "int8", "int8-static"])
@pytest.mark.parametrize("name", ["triton-unified", "flashinfer", "flash-attn2"])
def test_gpu_compiled_steps_equal_eager_and_the_float64_reference(name, kv_dtype):
    """Every CUDA backend, vendor calls included, compiled by inductor with fullgraph=True: a
    mixed step, then decode steps (split-KV's split path, FlashInfer's decode wrapper) with a
    new plan each; one compilation per shape."""
    backend = get(name, device=None)  # the spec is checked by plan(): flash-attn2 needs 256-token blocks
    block = 256 if name == "flash-attn2" else BLOCK  # FlashAttention 2's paged path: block_size % 256 == 0
    head_dim, dtype = 128, torch.bfloat16
    kv_dtype, _, static = kv_dtype.partition("-")
    # Static scales: one per KV head, on the GPU (the compiled write must leave them as they are).
    scales = (
        dict(
            k_scale=torch.linspace(0.02, 0.04, KV_HEADS, device="cuda"),
            v_scale=torch.linspace(0.03, 0.05, KV_HEADS, device="cuda"),
        )
        if static
        else {}
    )
    # What the backend does not claim is skipped here, before any step: inside the loop an
    # UnsupportedSpecError is a failure.
    reasons = backend.reasons(
        AttentionSpec(
            num_heads=HEADS,
            num_kv_heads=KV_HEADS,
            head_dim=head_dim,
            block_size=block,
            dtype=dtype,
            kv_dtype=kv_dtype,
            device="cuda",
        )
    )
    if reasons:
        pytest.skip(f"{name}: {'; '.join(reasons)}")
    caches = [
        backend.allocate(NUM_BLOCKS, block, KV_HEADS, head_dim, dtype=dtype, kv_dtype=kv_dtype, device="cuda", **scales)
        for _ in range(2)
    ]
    for cache in caches:
        fill(backend, cache)  # the same random context in both
    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, fullgraph=True, backend=counter)
    for i, (query_lens, seq_lens) in enumerate([MIXED, *STEPS]):
        meta = BatchMeta.from_lists(query_lens, seq_lens, TABLES, block_size=block, table_width=WIDTH, device="cuda")
        g = torch.Generator().manual_seed(i)
        n = meta.num_tokens
        q = torch.randn(n, HEADS, head_dim, generator=g).to("cuda", dtype)
        k, v = (torch.randn(n, KV_HEADS, head_dim, generator=g).to("cuda", dtype) for _ in range(2))
        plan = backend.plan(meta, num_heads=HEADS, num_kv_heads=KV_HEADS, head_dim=head_dim, dtype=dtype)
        eager_out, eager_lse = step(backend, q, k, v, caches[0], plan)
        out, lse = compiled(backend, q, k, v, caches[1], plan)
        torch.cuda.synchronize()
        case = f"compiled-step{i}-{kv_dtype}"
        for field in ("k", "v", "k_scale", "v_scale"):
            a, b = getattr(caches[1], field), getattr(caches[0], field)
            if a is not None:
                assert torch.equal(a.view(torch.uint8), b.view(torch.uint8)), (
                    f"[{name}/{case}] the compiled write left cache.{field} different from the eager write"
                )
        check_against_reference(name, out, lse, q, caches[1], meta, case)
        assert torch.equal(out, eager_out) and torch.equal(lse, eager_lse), (
            f"[{name}/{case}] compiled output differs from eager: max abs "
            f"{float((out.float() - eager_out.float()).abs().max())}"
        )
    # The mixed shape, then the decode shape (dynamic from then on): new plans compile nothing.
    assert counter.frame_count == 2, f"[{name}] {counter.frame_count} compilations for 2 shapes"
