"""The unified kernel's launcher against a float64 per-request reference.

Without a GPU the kernel runs in Triton's interpreter (TRITON_INTERPRET=1, set below before
Triton is imported); shapes are kept small so the module runs in well under a minute there.
"""

from __future__ import annotations

import dataclasses
import math
import os
import pathlib
import sys

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[1] / "src"))

from paged_triton_unified.launch import LaunchConfig, default_config, unified_attention  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Max |kernel - reference| allowed, relative to max |reference|, per q dtype.
TOLERANCE = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# (query_len, seq_len) per request: a mid-prefill chunk, a whole 16-token prompt, a 21-token
# prompt, decodes at 70 and 130 tokens.
MIXED = [(24, 60), (16, 16), (21, 21), (1, 70), (1, 130)]


# --------------------------------------------------------------------------------------------
# Batch construction and the reference.
# --------------------------------------------------------------------------------------------


def make_batch(requests, *, num_q_heads, num_kv_heads, head_dim, block_size, dtype, kv_dtype=None, seed=0):
    """Random q and a paged cache holding every request's context in shuffled blocks.

    Block 0 is reserved (never allocated), so a kernel that ignores the block table and reads
    block 0 shows up as a mismatch. ``kv_dtype`` int8/fp8 quantizes the cache per (slot, head).
    """
    gen = torch.Generator().manual_seed(seed)
    blocks_per_req = [max(1, math.ceil(s / block_size)) for _, s in requests]
    num_blocks = 1 + sum(blocks_per_req) + 3  # block 0 reserved, a few spare
    physical = (1 + torch.randperm(num_blocks - 1, generator=gen)).tolist()
    width = max(blocks_per_req)
    block_table = torch.zeros(len(requests), width, dtype=torch.int32)
    for r, n in enumerate(blocks_per_req):
        block_table[r, :n] = torch.tensor([physical.pop() for _ in range(n)], dtype=torch.int32)

    num_tokens = sum(t for t, _ in requests)
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    k = torch.randn(shape, generator=gen)
    v = torch.randn(shape, generator=gen)
    q = torch.randn(num_tokens, num_q_heads, head_dim, generator=gen)
    batch = {
        "q": q.to(dtype),
        "query_start_loc": torch.tensor([0] + list(_cumsum(t for t, _ in requests)), dtype=torch.int32),
        "seq_lens": torch.tensor([s for _, s in requests], dtype=torch.int32),
        "block_table": block_table,
        "max_query_len": max(t for t, _ in requests),
        "max_seq_len": max(s for _, s in requests),
    }
    if kv_dtype is None:
        batch["k_cache"], batch["v_cache"] = k.to(dtype), v.to(dtype)
    else:
        batch["k_cache"], batch["k_scale"] = quantize(k, kv_dtype)
        batch["v_cache"], batch["v_scale"] = quantize(v, kv_dtype)
    return {name: t.to(DEVICE) if isinstance(t, torch.Tensor) else t for name, t in batch.items()}


def _cumsum(values):
    total = 0
    for value in values:
        total += value
        yield total


def quantize(x, kv_dtype):
    """Symmetric per-(slot, head) quantization: scale = max|x| / q_max."""
    q_max = 127.0 if kv_dtype == torch.int8 else 448.0
    scale = (x.abs().amax(-1) / q_max).clamp_min(1e-8)
    scaled = x / scale[..., None]
    if kv_dtype == torch.int8:
        codes = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        codes = scaled.to(torch.float8_e4m3fn)
    return codes, scale.float()


def dequantize(cache, scale):
    values = cache.double() if cache.dtype != torch.float8_e4m3fn else cache.float().double()
    return values if scale is None else values * scale.double()[..., None]


def reference(batch, *, scale, window=0, softcap=0.0, sinks=None):
    """float64 attention, one request at a time; returns (out, lse)."""
    q = batch["q"].double().cpu()
    k = dequantize(batch["k_cache"], batch.get("k_scale")).cpu()
    v = dequantize(batch["v_cache"], batch.get("v_scale")).cpu()
    qsl = batch["query_start_loc"].tolist()
    seq_lens = batch["seq_lens"].tolist()
    block_table = batch["block_table"].cpu()
    num_blocks, block_size, num_kv_heads, head_dim = k.shape
    num_tokens, num_q_heads, _ = q.shape
    group = num_q_heads // num_kv_heads
    out = torch.zeros(num_tokens, num_q_heads, head_dim, dtype=torch.float64)
    lse = torch.full((num_tokens, num_q_heads), -math.inf, dtype=torch.float64)
    for r, seq_len in enumerate(seq_lens):
        begin, end = qsl[r], qsl[r + 1]
        q_len = end - begin
        if q_len <= 0 or seq_len <= 0:
            continue
        pos = torch.arange(seq_len)
        width = block_table.shape[1]
        logical = pos // block_size
        in_table = logical < width
        phys = block_table[r, logical.clamp(max=width - 1)].long()
        usable = in_table & (phys >= 0) & (phys < num_blocks)  # bad block ids mask their keys
        phys = torch.where(usable, phys, 0)
        keys = k[phys, pos % block_size].repeat_interleave(group, dim=1)  # [seq_len, Hq, D]
        values = v[phys, pos % block_size].repeat_interleave(group, dim=1)
        logits = torch.einsum("qhd,khd->hqk", q[begin:end], keys) * scale
        if softcap:
            logits = softcap * torch.tanh(logits / softcap)
        q_pos = seq_len - q_len + torch.arange(q_len)
        visible = (pos[None, :] <= q_pos[:, None]) & usable[None, :]
        if window:
            visible &= pos[None, :] > q_pos[:, None] - window
        logits = logits.masked_fill(~visible[None], -math.inf)  # [Hq, q_len, seq_len]
        any_visible = visible.any(-1)  # [q_len]
        if sinks is not None:
            sink = sinks.double().cpu()[:, None, None].expand(-1, q_len, 1)
            row_lse = torch.logsumexp(torch.cat([logits, sink], -1), -1)
        else:
            row_lse = torch.logsumexp(logits, -1)
        probs = torch.exp(logits - row_lse[..., None]).nan_to_num(0.0)
        o = torch.einsum("hqk,khd->qhd", probs, values)
        out[begin:end] = torch.where(any_visible[:, None, None], o, 0.0)
        lse[begin:end] = torch.where(any_visible[None, :], row_lse, -math.inf).T
    return out, lse


def run(batch, **kwargs):
    q = batch["q"]
    out = torch.full_like(q, math.nan)  # poisoned: every row must be written
    lse = torch.full(q.shape[:2], math.nan, dtype=torch.float32, device=q.device)
    args = {
        name: batch[name]
        for name in ("query_start_loc", "seq_lens", "block_table", "max_query_len", "max_seq_len")
    }
    for name in ("k_scale", "v_scale"):
        if name in batch:
            args[name] = batch[name]
    result = unified_attention(q, batch["k_cache"], batch["v_cache"], out, lse=lse, **args, **kwargs)
    assert result is out
    return out, lse


def assert_close_to_reference(batch, dtype, config=None, **kwargs):
    out, lse = run(batch, config=config, **kwargs)
    ref_out, ref_lse = reference(batch, **kwargs)
    out, lse = out.double().cpu(), lse.double().cpu()
    assert not out.isnan().any(), "rows left unwritten or NaN"
    err = (out - ref_out).abs()
    bound = TOLERANCE[dtype] * max(ref_out.abs().max().item(), 1e-6)
    assert err.max().item() <= bound, (
        f"max err {err.max().item():.3g} > {bound:.3g} (mean {err.mean().item():.3g})"
    )
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all(), (
        "lse must be -inf exactly for rows with no visible key"
    )
    assert (out[empty[:, :, None].expand_as(out)] == 0).all(), "rows with no visible key must be exact zeros"
    lse_err = (lse[~empty] - ref_lse[~empty]).abs().max().item() if (~empty).any() else 0.0
    assert lse_err <= 10 * TOLERANCE[dtype] * max(1.0, ref_lse[~empty].abs().max().item()), (
        f"lse err {lse_err:.3g}"
    )
    return out, lse


# --------------------------------------------------------------------------------------------
# Tests.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("num_q_heads", "num_kv_heads", "head_dim", "block_size", "dtype"),
    [
        pytest.param(4, 4, 64, 16, torch.float32, id="mha-d64-b16-fp32"),
        pytest.param(6, 2, 96, 64, torch.float16, id="group3-d96-b64-fp16"),
        pytest.param(4, 1, 64, 16, torch.bfloat16, id="group4-d64-b16-bf16"),
        pytest.param(4, 1, 64, 64, torch.float32, id="group4-d64-b64-fp32"),
    ],
)
def test_mixed_batch(num_q_heads, num_kv_heads, head_dim, block_size, dtype):
    batch = make_batch(MIXED, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim,
                       block_size=block_size, dtype=dtype)  # fmt: skip
    assert_close_to_reference(batch, dtype, scale=head_dim**-0.5)


def test_decode_only_small_blocks():
    batch = make_batch([(1, 33), (1, 1), (1, 90)], num_q_heads=3, num_kv_heads=1, head_dim=64,
                       block_size=8, dtype=torch.float32)  # fmt: skip
    assert_close_to_reference(batch, torch.float32, scale=0.125)


def test_prefill_spans_several_large_tiles():
    # Small tiles force several query tiles per request in both launches (and multi-step keys).
    batch = make_batch([(40, 50), (3, 3), (1, 20)], num_q_heads=2, num_kv_heads=1, head_dim=64,
                       block_size=16, dtype=torch.float32)  # fmt: skip
    config = LaunchConfig(block_q_small=8, block_q_large=8, block_n=16, num_warps=4, num_stages=1)
    assert_close_to_reference(batch, torch.float32, scale=0.125, config=config)


@pytest.mark.parametrize("window", [1, 7, 40])
def test_sliding_window(window):
    batch = make_batch(MIXED, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    assert_close_to_reference(batch, torch.float32, scale=0.125, window=window)


def test_softcap_sinks_and_window():
    batch = make_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    sinks = torch.linspace(-2.0, 3.0, 4, dtype=torch.float32, device=DEVICE)
    # A large scale makes the soft cap bite (|s| well above softcap).
    assert_close_to_reference(batch, torch.float32, scale=1.0, softcap=5.0, sinks=sinks, window=30)


@pytest.mark.parametrize("kv_dtype", [torch.int8, torch.float8_e4m3fn], ids=["int8", "fp8"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_quantized_cache(kv_dtype, dtype):
    batch = make_batch(MIXED, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                       kv_dtype=kv_dtype)  # fmt: skip
    assert_close_to_reference(batch, dtype, scale=0.125)


def _config(batch, **switches):
    num_q_heads, head_dim = batch["q"].shape[1:]
    base = default_config(num_q_heads=num_q_heads, num_kv_heads=batch["k_cache"].shape[2], head_dim=head_dim)
    return dataclasses.replace(base, **switches)


# Every code-path switch of LaunchConfig, off: the previous implementation of each stays exact.
OLD_PATHS = {"fuse_classes": False, "decode_direct": False, "quant_fp16": False, "fold_scale": False}


@pytest.mark.parametrize("kv_dtype", [None, torch.int8, torch.float8_e4m3fn], ids=["bf16", "int8", "fp8"])
def test_old_code_paths(kv_dtype):
    """Two launches with the tile plan, codes converted to q's dtype, scores scaled first."""
    batch = make_batch(MIXED, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16,
                       kv_dtype=kv_dtype)  # fmt: skip
    assert_close_to_reference(batch, torch.bfloat16, scale=0.125, config=_config(batch, **OLD_PATHS))
    decode = make_batch([(1, 33), (1, 70)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16,
                        dtype=torch.bfloat16, kv_dtype=kv_dtype)  # fmt: skip
    assert_close_to_reference(decode, torch.bfloat16, scale=0.125, config=_config(decode, **OLD_PATHS))


@pytest.mark.parametrize(
    ("block_size", "block_n", "kv_dtype"),
    [
        pytest.param(16, 32, None, id="step-spans-2-blocks"),
        pytest.param(64, 16, None, id="4-steps-per-block"),
        pytest.param(16, 32, torch.int8, id="int8"),
    ],
)
def test_prefetched_block_ids(block_size, block_n, kv_dtype):
    """prefetch_block_ids: each step uses the ids loaded by the step before (every loop, windows
    that start mid-table, steps smaller and larger than a block) and the result is unchanged."""
    batch = make_batch(MIXED + [(1, 0)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=block_size,
                       dtype=torch.bfloat16, kv_dtype=kv_dtype)  # fmt: skip
    sinks = torch.linspace(-1.0, 1.0, 4, dtype=torch.float32, device=DEVICE)
    config = dataclasses.replace(_config(batch), block_q_large=8, block_n=block_n, prefetch_block_ids=True)
    for window in (0, 37):
        assert_close_to_reference(batch, torch.bfloat16, scale=0.125, config=config, window=window, sinks=sinks)


@pytest.mark.parametrize("fuse", [True, False], ids=["fused", "two-launches"])
def test_mixed_batch_with_separate_large_config(fuse):
    # Several large and small tiles per class, different key steps per class, padding requests.
    batch = make_batch([(40, 50), (1, 0), (3, 3), (1, 20), (17, 90)], num_q_heads=4, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=torch.float32)  # fmt: skip
    config = LaunchConfig(block_q_small=8, block_q_large=16, block_n=16, num_warps=4, num_stages=1,
                          large_block_n=32, fuse_classes=fuse)  # fmt: skip
    assert_close_to_reference(batch, torch.float32, scale=0.125, config=config, window=25)


@pytest.mark.skipif(DEVICE != "cuda",
                    reason="concurrent_classes forks a CUDA stream: needs a CUDA device (the GPU machine)")
def test_concurrent_classes_equal_two_serial_launches_eager_and_in_a_cuda_graph():
    batch = make_batch([(40, 50), (1, 0), (3, 3), (1, 20), (17, 90)], num_q_heads=4, num_kv_heads=2,
                       head_dim=64, block_size=16, dtype=torch.bfloat16)  # fmt: skip
    serial = dataclasses.replace(_config(batch), block_q_large=16, fuse_classes=False)
    want, want_lse = run(batch, scale=0.125, config=serial)
    config = dataclasses.replace(serial, concurrent_classes=True)
    got, got_lse = run(batch, scale=0.125, config=config)
    assert torch.equal(got, want) and torch.equal(got_lse, want_lse)

    q = batch["q"]
    out = torch.full_like(q, math.nan)
    args = {name: batch[name] for name in ("query_start_loc", "seq_lens", "block_table", "max_query_len",
                                           "max_seq_len")}
    call = lambda: unified_attention(q, batch["k_cache"], batch["v_cache"], out, scale=0.125,  # noqa: E731
                                     config=config, **args)
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(math.nan)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, want)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_quantized_fast_path_edge_ranges(dtype):
    """fp16 dots on codes: q beyond fp16's range (bf16) is shifted by a power of two, and V
    scales far below fp16's normal range still give exact results."""
    batch = make_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype,
                       kv_dtype=torch.int8)  # fmt: skip
    # p * scale would be fp16 subnormals (fp16 outputs themselves must stay normal).
    batch["v_scale"] = batch["v_scale"] * (1e-6 if dtype == torch.bfloat16 else 1e-3)
    big = 1e6 if dtype == torch.bfloat16 else 1e3
    batch["q"] = (batch["q"].float() * big).to(dtype)  # 1e6 overflows fp16
    sinks = torch.zeros(4, dtype=torch.float32, device=DEVICE)
    assert_close_to_reference(batch, dtype, scale=0.125 / big, sinks=sinks)


def test_padding_requests_are_exact_zeros():
    # seq_len 0 marks CUDA-graph padding: one-row and zero-row padding requests between real ones.
    requests = [(1, 0), (5, 20), (1, 0), (0, 0), (1, 9)]
    batch = make_batch(
        requests, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16
    )
    sinks = torch.ones(4, dtype=torch.float32, device=DEVICE)
    out, lse = assert_close_to_reference(batch, torch.bfloat16, scale=0.125, sinks=sinks)
    for row in (0, 6):
        assert (out[row] == 0).all() and torch.isneginf(lse[row]).all()


def test_bad_block_ids_are_masked():
    batch = make_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    num_blocks = batch["k_cache"].shape[0]
    table = batch["block_table"].clone()
    table[0, 1] = -1
    table[2, 0] = num_blocks
    table[4, 3] = 2**31 - 1
    # The decode at 130 tokens needs 9 blocks: a 5-wide table masks positions 80 and later.
    batch["block_table"] = table[:, :5].contiguous()
    out, _ = assert_close_to_reference(batch, torch.float32, scale=0.125)
    assert torch.isfinite(out).all()


@settings(max_examples=12, deadline=None, derandomize=True)
@given(
    data=st.data(),
    group=st.sampled_from([1, 2, 3, 4]),
    block_size=st.sampled_from([4, 16, 32]),
    window=st.sampled_from([0, 5, 33]),
)
def test_random_batches(data, group, block_size, window):
    """Any mix of request shapes, including empty and over-long query runs, matches the reference."""
    q_lens = data.draw(st.lists(st.integers(0, 20), min_size=1, max_size=4), label="q_lens")
    requests = [(t, t + data.draw(st.integers(0, 50), label="context")) for t in q_lens]
    if sum(q_lens) == 0:
        requests[0] = (1, 1)
    batch = make_batch(requests, num_q_heads=group, num_kv_heads=1, head_dim=64, block_size=block_size,
                       dtype=torch.float32, seed=len(requests))  # fmt: skip
    assert_close_to_reference(batch, torch.float32, scale=0.125, window=window)


def test_default_config():
    config = default_config(num_q_heads=32, num_kv_heads=8, head_dim=128)
    assert config.block_q_small * 4 == 16
    assert config.block_q_large * 4 == 128


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"block_size": 24}, "block_size 24 is not supported: triton-unified accepts powers of two"),
        ({"head_dim": 72}, "head_dim 72 is not supported"),
        ({"kv_dtype": torch.float16}, "k_cache dtype torch.float16 is not supported"),
        ({"drop": "k_scale"}, "k_scale None is not supported"),
        ({"seq_lens_dtype": torch.int64}, "seq_lens with dtype torch.int64 is not supported"),
        ({"max_query_len": torch.tensor(1)}, "max_query_len"),
    ],
)
def test_validation_names_the_argument(change, message):
    block_size = change.get("block_size", 16)
    head_dim = change.get("head_dim", 64)
    q = torch.zeros(2, 4, head_dim, device=DEVICE)
    cache = torch.zeros(
        4, block_size, 2, head_dim, device=DEVICE, dtype=change.get("kv_dtype", torch.float32)
    )
    kwargs = {
        "query_start_loc": torch.tensor([0, 2], dtype=torch.int32, device=DEVICE),
        "seq_lens": torch.tensor([2], dtype=change.get("seq_lens_dtype", torch.int32), device=DEVICE),
        "block_table": torch.ones(1, 1, dtype=torch.int32, device=DEVICE),
        "max_query_len": change.get("max_query_len", 2),
        "max_seq_len": 2,
        "scale": 0.125,
    }
    if change.get("drop") == "k_scale":
        cache = cache.to(torch.int8)
        kwargs["v_scale"] = torch.ones(cache.shape[:3], device=DEVICE)
    with pytest.raises(ValueError, match=message):
        unified_attention(q, cache, cache, torch.empty_like(q), **kwargs)


def test_interpreter_set_after_import_is_a_reason_not_a_driver_error(monkeypatch):
    # TRITON_INTERPRET=1 set after the kernels were defined used to pass the capability check and
    # then fail inside Triton with "RuntimeError: 0 active drivers".
    from paged_core import AttentionSpec, BatchMeta, UnsupportedSpecError
    from paged_triton_unified import backend as backend_module

    monkeypatch.setattr(backend_module, "_INTERPRETED", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device="cpu")
    [reason] = backend_module.interpreter_reasons(spec)
    assert "was set after the Triton kernels were imported" in reason
    assert backend_module.interpreter_reasons(dataclasses.replace(spec, device="cuda")) == []
    b = backend_module.TritonUnifiedBackend()
    meta = BatchMeta.build([3, 1], [10, 40], block_size=16)
    cache = b.allocate(8, 16, 2, 64, dtype=torch.float32)
    with pytest.raises(UnsupportedSpecError, match="was set after"):
        b.forward(torch.randn(4, 4, 64), cache, meta)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "set TRITON_INTERPRET=1" in backend_module.interpreter_reasons(spec)[0]
