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

import triton
from paged_conformance.tolerances import assert_close_to_reference as conformance_close
from paged_conformance.tolerances import lse_tolerance, output_tolerance
from paged_core import InputError
from paged_triton_unified.launch import LaunchConfig, default_config, unified_attention

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
KV_NAMES = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8_e5m2", torch.uint8: "fp8"}
Q_MAX = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}

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
    q_max = Q_MAX[kv_dtype]
    scale = (x.abs().amax(-1) / q_max).clamp_min(1e-8)
    scaled = x / scale[..., None]
    if kv_dtype == torch.int8:
        codes = scaled.round().clamp(-127, 127).to(torch.int8)
    else:
        codes = scaled.clamp(-q_max, q_max).to(kv_dtype)
    return codes, scale.float()


def dequantize(cache, scale):
    values = cache.float().double()  # float8 converts to float32 only
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
        name: batch[name] for name in ("query_start_loc", "seq_lens", "block_table", "max_query_len", "max_seq_len")
    }
    for name in ("k_scale", "v_scale"):
        if name in batch:
            args[name] = batch[name]
    result = unified_attention(q, batch["k_cache"], batch["v_cache"], out, lse=lse, **args, **kwargs)
    assert result is out
    return out, lse


def assert_close_to_reference(batch, dtype, config=None, *, relative=False, **kwargs):
    """The kernel against the float64 reference with the conformance suite's comparison and
    tolerances; rows with no visible key must be exact zeros with lse = -inf. ``relative``:
    outputs far below unit size are compared after dividing both by max |reference|, so that
    the tolerance's absolute part does not swallow them."""
    out, lse = run(batch, config=config, **kwargs)
    ref_out, ref_lse = reference(batch, **kwargs)
    out, lse = out.double().cpu(), lse.double().cpu()
    kv = KV_NAMES.get(batch["k_cache"].dtype, "auto")
    where = dict(query_start_loc=batch["query_start_loc"].tolist(), seq_lens=batch["seq_lens"].tolist())
    unit = max(ref_out.abs().max().item(), 1e-300) if relative else 1.0
    conformance_close(
        out / unit,
        ref_out / unit,
        backend="triton-unified",
        case="test",
        tolerance=output_tolerance(dtype, kv),
        **where,
    )  # NaN (an unwritten row): an infinite error
    empty = torch.isinf(ref_lse)
    assert torch.equal(torch.isinf(lse), empty) and (lse[empty] < 0).all(), (
        "lse must be -inf exactly for rows with no visible key"
    )
    assert (out[empty[:, :, None].expand_as(out)] == 0).all(), "rows with no visible key must be exact zeros"
    conformance_close(
        lse, ref_lse, backend="triton-unified", case="test", what="lse", tolerance=lse_tolerance(dtype, kv), **where
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
    batch = make_batch(
        MIXED, num_q_heads=num_q_heads, num_kv_heads=num_kv_heads, head_dim=head_dim, block_size=block_size, dtype=dtype
    )
    assert_close_to_reference(batch, dtype, scale=head_dim**-0.5)


def test_decode_only_small_blocks():
    batch = make_batch(
        [(1, 33), (1, 1), (1, 90)], num_q_heads=3, num_kv_heads=1, head_dim=64, block_size=8, dtype=torch.float32
    )
    assert_close_to_reference(batch, torch.float32, scale=0.125)


def test_prefill_spans_several_large_tiles():
    # Small tiles force several query tiles per request in both launches (and multi-step keys).
    batch = make_batch(
        [(40, 50), (3, 3), (1, 20)], num_q_heads=2, num_kv_heads=1, head_dim=64, block_size=16, dtype=torch.float32
    )
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


@pytest.mark.parametrize(
    "kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2], ids=["int8", "fp8", "fp8_e5m2"]
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_quantized_cache(kv_dtype, dtype):
    batch = make_batch(MIXED, num_q_heads=6, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, kv_dtype=kv_dtype)
    assert_close_to_reference(batch, dtype, scale=0.125)


def test_mixed_batch_with_separate_large_config():
    # Several large and small tiles per class, different key steps per class, padding requests.
    batch = make_batch(
        [(40, 50), (1, 0), (3, 3), (1, 20), (17, 90)],
        num_q_heads=4,
        num_kv_heads=2,
        head_dim=64,
        block_size=16,
        dtype=torch.float32,
    )
    config = LaunchConfig(block_q_small=8, block_q_large=16, block_n=16, num_warps=4, num_stages=1, large_block_n=32)
    assert_close_to_reference(batch, torch.float32, scale=0.125, config=config, window=25)


@pytest.mark.parametrize(
    "kv_dtype",
    [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2],
    ids=["int8", "fp8-fp16-dots", "fp8_e5m2-fp16-dots"],
)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=["fp16", "bf16"])
def test_quantized_cache_edge_ranges(dtype, kv_dtype):
    """fp8 runs fp16 dots on its codes: q beyond fp16's range (bf16) is shifted by a power of
    two, and V scales far below fp16's normal range still give exact results; int8 converts its
    codes to q's dtype and must hold the same ranges."""
    batch = make_batch(MIXED, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=dtype, kv_dtype=kv_dtype)
    # p * scale would be fp16 subnormals (fp16 outputs themselves must stay normal).
    batch["v_scale"] = batch["v_scale"] * (1e-6 if dtype == torch.bfloat16 else 1e-3)
    big = 1e6 if dtype == torch.bfloat16 else 1e3
    batch["q"] = (batch["q"].float() * big).to(dtype)  # 1e6 overflows fp16
    sinks = torch.zeros(4, dtype=torch.float32, device=DEVICE)
    assert_close_to_reference(batch, dtype, scale=0.125 / big, sinks=sinks, relative=True)


def test_padding_requests_are_exact_zeros():
    # seq_len 0 marks CUDA-graph padding: one-row and zero-row padding requests between real ones.
    requests = [(1, 0), (5, 20), (1, 0), (0, 0), (1, 9)]
    batch = make_batch(requests, num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.bfloat16)
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


def test_a_bad_block_id_deep_in_a_long_context_is_masked():
    # The unmasked bulk of a tile runs only after its block ids were checked, 1,024 per pass: a
    # bad id in the second pass must still send the range down the masked path. A decode and a
    # 16-token chunk over 4,200 tokens of 4-token blocks (1,050 blocks).
    batch = make_batch(
        [(1, 4200), (16, 4200)], num_q_heads=2, num_kv_heads=1, head_dim=32, block_size=4, dtype=torch.float32
    )
    good, _ = assert_close_to_reference(batch, torch.float32, scale=0.125)
    batch["block_table"] = batch["block_table"].clone()
    batch["block_table"][:, 1030] = -1  # keys 4,120-4,123 of both requests drop out
    bad, _ = assert_close_to_reference(batch, torch.float32, scale=0.125)
    assert not torch.equal(good, bad)


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
    batch = make_batch(
        requests,
        num_q_heads=group,
        num_kv_heads=1,
        head_dim=64,
        block_size=block_size,
        dtype=torch.float32,
        seed=len(requests),
    )
    assert_close_to_reference(batch, torch.float32, scale=0.125, window=window)


def test_default_config():
    config = default_config(num_q_heads=32, num_kv_heads=8, head_dim=128)
    assert config.block_q_small * 4 == 16
    assert config.block_q_large * 4 == 128


def test_the_backend_claims_the_cache_formats_the_kernels_read():
    from paged_core import QUANT_FORMATS, registry
    from paged_triton_unified.launch import SUPPORTED_KV_DTYPES

    read = {name for name, (code, _) in QUANT_FORMATS.items() if code in SUPPORTED_KV_DTYPES}
    assert read == {"int8", "fp8", "fp8_e5m2", "int4", "kivi4"}
    assert registry.get("triton-unified").capabilities.kv_dtypes == {"auto", *read}


def test_checks_what_the_kernel_needs_beyond_the_contract():
    batch = make_batch([(2, 2)], num_q_heads=4, num_kv_heads=2, head_dim=64, block_size=16, dtype=torch.float32)
    args = {
        name: batch[name] for name in ("query_start_loc", "seq_lens", "block_table", "max_query_len", "max_seq_len")
    }
    q, k = batch["q"], batch["k_cache"]
    strided = torch.zeros(*k.shape[:3], 2 * k.shape[3], device=DEVICE)[..., ::2]  # head_dim stride 2
    with pytest.raises(InputError, match=r"k_cache's last-dimension stride is 2; .* pass k_cache.contiguous\(\)"):
        unified_attention(q, strided, batch["v_cache"], torch.empty_like(q), scale=0.125, **args)
    # Group 2 pads to 2 rows per token: 4-token tiles are 8 rows, below tl.dot's 16.
    small = LaunchConfig(block_q_small=4, block_q_large=8, block_n=16)
    with pytest.raises(InputError, match="config's smallest tile is 8 rows .* at least 8"):
        unified_attention(q, k, batch["v_cache"], torch.empty_like(q), scale=0.125, config=small, **args)


def test_interpreter_set_after_import_is_a_reason_not_a_driver_error(monkeypatch):
    # TRITON_INTERPRET=1 set after the kernels were defined used to pass the capability check and
    # then fail inside Triton with "RuntimeError: 0 active drivers".
    from paged_core import AttentionSpec, BatchMeta, UnsupportedSpecError
    from paged_triton_common import backend as common_backend
    from paged_triton_unified import backend as backend_module

    monkeypatch.setattr(common_backend, "INTERPRET", False)
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    spec = AttentionSpec(num_heads=4, num_kv_heads=2, head_dim=64, block_size=16, device="cpu")
    [reason] = common_backend.interpreter_reasons(spec)
    assert "was set after the Triton kernels were imported" in reason
    assert common_backend.interpreter_reasons(dataclasses.replace(spec, device="cuda")) == []
    b = backend_module.TritonUnifiedBackend()
    meta = BatchMeta.build([3, 1], [10, 40], block_size=16)
    cache = b.allocate(8, 16, 2, 64, dtype=torch.float32)
    with pytest.raises(UnsupportedSpecError, match="was set after"):
        b.forward(torch.randn(4, 4, 64), cache, meta)
    monkeypatch.delenv("TRITON_INTERPRET")
    assert "set TRITON_INTERPRET=1" in common_backend.interpreter_reasons(spec)[0]


def test_register_capped_configs_are_timed_only_where_they_were_chosen(monkeypatch):
    # The capped configs (a Config's maxnreg) were chosen from an offline compile of the 128-row
    # prefill tile at head dim 128 and 16-bit K/V. Elsewhere (decode tiles, 8-bit caches, other
    # head dims) they would spill in their loops or repeat an uncapped config, so the autotuner
    # never times them there; and the one config of PAGED_AUTOTUNE=0 is never a capped one.
    from paged_triton_unified import kernels

    def config(block_n, warps, stages, cap=None):
        return triton.Config({"BLOCK_N": block_n}, num_warps=warps, num_stages=stages, maxnreg=cap)

    assert kernels._PREFILL_CAPPED
    for capped in kernels._PREFILL_CAPPED:
        prefill = config(*capped)
        assert kernels.keep(prefill, 128, 128, 0)
        assert kernels.keep(prefill, 64, 128, 0)
        assert not kernels.keep(prefill, 16, 128, 0)  # a decode tile
        assert not kernels.keep(prefill, 32, 128, 0)
        assert not kernels.keep(prefill, 128, 64, 0)
        assert not kernels.keep(prefill, 128, 256, 0)
        for kv_quant in (1, 2):
            assert not kernels.keep(prefill, 128, 128, kv_quant)
        # A cap the list does not hold is not timed, even on a listed (BLOCK_N, warps, stages).
        assert not kernels.keep(config(*capped[:3], capped[3] - 32), 128, 128, 0)
    # The capped configs are in the GPU's search space, the one the launcher prunes.
    monkeypatch.setattr(kernels, "INTERPRET", False)
    space = {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages, c.maxnreg) for c in kernels._attention_configs()}
    assert kernels._PREFILL_CAPPED <= space
    # Where the caps run (head dim 128, 16-bit K/V), a prefill tile times them and the two uncapped
    # configs that won or came next (the 64-row tile's best, the no-autotune default) only.
    uncapped = [config(*sig) for sig in kernels._PREFILL_CONFIGS]
    timed = {(c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) for c in uncapped if kernels.keep(c, 128, 128, 0)}
    assert timed == kernels._PREFILL_WITH_CAPS and kernels._DEFAULT_PREFILL in timed
    # Elsewhere (other head dims, 8-bit caches) every uncapped prefill config is timed.
    assert all(kernels.keep(c, 128, 64, 0) and kernels.keep(c, 128, 128, 1) for c in uncapped)
    # Uncapped configs keep their rule (the decode space for decode tiles).
    assert kernels.keep(config(*kernels._DEFAULT_DECODE), 16, 128, 1)
    default = config(*kernels._DEFAULT_PREFILL)
    chosen = kernels._default_of([config(*kernels._DEFAULT_PREFILL, 128), default], 128)
    assert len(chosen) == 1 and chosen[0] is default
