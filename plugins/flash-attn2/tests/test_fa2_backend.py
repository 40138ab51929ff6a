"""The flash-attn2 adapter on the CPU: registry, capabilities, argument conversion, LSE, padding.

flash-attn is not installed here (and must not be): the availability tests see it missing, and
the adapter's end-to-end tests run against ``fa2_fake``, a stand-in written from flash-attn's
documented behaviour. The real kernel is checked by ``test_gpu_matches_reference`` and
``smoke_flash_attn2_gpu.py`` on a GPU.
"""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
from pathlib import Path

import paged_flash_attn2
import pytest
import torch
from fa2_helpers import MIXED, make_batch
from paged_conformance.tolerances import assert_close_to_reference, lse_tolerance, output_tolerance
from paged_core import (
    AttentionSpec,
    BackendUnavailableError,
    Registry,
    UnsupportedSpecError,
    allocate_kv_cache,
    reference_attention,
)
from paged_flash_attn2.backend import (
    FlashAttn2Backend,
    FlashAttn2Plan,
    lse_to_paged,
    varlen_kwargs,
)

INSTALL = (
    "pip install --find-links dist 'paged-core[flash-attn]' (build dist/ in a clone of paged: python3 -m nox -s wheels)"
)


def spec(**kw):
    base = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=256, dtype=torch.bfloat16, device="cuda")
    return AttentionSpec(**{**base, **kw})


def capability_reasons(**kw):
    return FlashAttn2Backend.capabilities.reasons(spec(**kw))


# ---------------------------------------------------------------------------------- import / registry
def test_backend_module_imports_without_flash_attn():
    code = (
        "import sys\n"
        "import paged_flash_attn2, paged_flash_attn2.backend as b, paged_flash_attn2.bridge\n"
        "b.FlashAttn2Backend()\n"
        "assert 'flash_attn' not in sys.modules, 'flash_attn was imported eagerly'\n"
        "sys.modules['flash_attn'] = None\n"
        "print(b.FlashAttn2Backend.unavailable())\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert INSTALL in proc.stdout


def _registry(monkeypatch) -> Registry:
    monkeypatch.setenv("PAGED_PLUGINS", "reference,flash-attn2")
    reg = Registry()
    if "flash-attn2" not in reg.names():  # sources on sys.path but the distribution not installed
        reg.add_plugin(paged_flash_attn2, name="flash-attn2")
    return reg


def test_registry_lists_flash_attn2_as_unavailable_with_the_install_command(monkeypatch, no_flash_attn):
    reg = _registry(monkeypatch)
    assert "flash-attn2" in reg.names()
    assert reg.names().index("flash-attn2") < reg.names().index("reference")  # priority 10 > -100
    assert reg.problems() == []  # unavailable is not broken
    reasons = reg.unavailable("flash-attn2")
    assert reasons[0].startswith(f"flash-attn is not installed (to fix: {INSTALL}; ")
    assert "compiles flash-attn from source" in reasons[0] and "build_sm90.sh" in reasons[0]  # what it costs
    assert all("(to fix: " in r and r.endswith(")") for r in reasons)
    assert len(reasons) == (1 if torch.cuda.is_available() else 2)  # + "no CUDA device" here
    explained = reg.explain(spec())
    assert explained["flash-attn2"] == reasons
    assert "flash-attn2" not in reg.available()
    with pytest.raises(
        BackendUnavailableError, match=r"flash-attn2.*pip install --find-links dist 'paged-core\[flash-attn"
    ):
        reg.get("flash-attn2")
    summary = reg.capabilities("flash-attn2").summary()
    assert summary.startswith("head_dim 8..256 step 8; block multiple of 256")


def test_with_flash_attn_importable_only_the_missing_gpu_remains(monkeypatch, fake_flash_attn):
    reg = _registry(monkeypatch)
    reasons = reg.unavailable("flash-attn2")
    if torch.cuda.is_available():
        pytest.skip("this machine has a GPU; the CPU-only reason does not apply")
    assert len(reasons) == 1 and "no CUDA device" in reasons[0]


def test_too_old_flash_attn_is_refused(monkeypatch, fake_flash_attn):
    monkeypatch.setattr(sys.modules["flash_attn"], "__version__", "2.5.9")
    reason = FlashAttn2Backend.unavailable()[0]
    assert "flash-attn 2.5.9 is installed; accepted: >=2.6,<3" in reason


def test_constructor_is_cheap_and_takes_no_flash_attn(no_flash_attn):
    FlashAttn2Backend()  # no import, no probe
    FlashAttn2Backend(validate=True)


# ---------------------------------------------------------------------------------- capabilities
def test_supported_spec_has_no_capability_reasons():
    assert capability_reasons() == []
    assert capability_reasons(block_size=512, dtype=torch.float16, window=128, softcap=30.0) == []
    assert capability_reasons(num_heads=24, num_kv_heads=8, head_dim=96) == []  # group 3
    assert capability_reasons(num_heads=8, num_kv_heads=8, head_dim=256, return_lse=True) == []


@pytest.mark.parametrize("block_size", [16, 32, 64, 128, 384])
def test_block_sizes_not_multiple_of_256_are_refused_with_that_reason(block_size):
    (reason,) = capability_reasons(block_size=block_size)
    assert f"block_size {block_size} is not supported" in reason
    assert "block_size % 256 == 0" in reason and "paged_flash_attn2.bridge" in reason


@pytest.mark.parametrize(
    "kw, words",
    [
        (dict(dtype=torch.float32), "dtype float32"),
        (dict(kv_dtype="int8"), "kv_dtype 'int8'"),
        (dict(kv_dtype="fp8"), "kv_dtype 'fp8'"),
        (dict(kv_dtype="fp8_e5m2"), "kv_dtype 'fp8_e5m2' is not supported (accepted: auto)"),
        (dict(sinks=True), "attention sinks"),
        (dict(head_dim=100), "head_dim 100"),
        (dict(head_dim=320), "head_dim 320"),
        (dict(device="cpu"), "device 'cpu'"),
    ],
)
def test_what_flash_attn2_cannot_do_is_refused(kw, words):
    reasons = capability_reasons(**kw)
    assert len(reasons) == 1 and words in reasons[0], reasons


def test_forward_with_block_size_16_raises_naming_the_rule():
    meta = make_batch([(1, 20)], block_size=16)[2]
    cache = allocate_kv_cache(4, 16, 2, 64, dtype=torch.bfloat16)
    q = torch.randn(1, 8, 64).to(torch.bfloat16)
    with pytest.raises(UnsupportedSpecError) as err:
        FlashAttn2Backend().forward(q, cache, meta)
    assert "block_size % 256" in str(err.value)
    assert any("block_size 16" in r for r in err.value.reasons)


# ---------------------------------------------------------------------------------- argument conversion
def _visible(kw, r, i, sq, sk):
    """Key positions query row i of request r sees under flash-attn's documented rule."""
    left, right = kw["window_size"]
    causal = kw["causal"] and kw["max_seqlen_q"] != 1
    if causal:
        right = 0
    if left >= kw["max_seqlen_k"]:
        left = -1
    lo = i + sk - sq - left if left >= 0 else -math.inf
    hi = i + sk - sq + right if (causal or left >= 0 or right >= 0) and right >= 0 else math.inf
    return {j for j in range(sk) if lo <= j <= hi}


@pytest.mark.parametrize("window", [0, 1, 5, 64])
def test_varlen_kwargs_match_a_per_request_loop(window):
    q, cache, meta = make_batch(MIXED)
    plan = FlashAttn2Backend().plan(meta)
    kw = varlen_kwargs(q, cache, plan, scale=0.125, window=window, softcap=0.0, return_lse=True)
    qlens, slens = meta.host()
    assert kw["q"] is q and kw["k"] is cache.k and kw["v"] is cache.v  # the pool itself, no copy
    assert kw["block_table"].dtype == torch.int32 and kw["block_table"].stride(-1) == 1
    assert kw["cu_seqlens_q"].dtype == torch.int32 and kw["cu_seqlens_k"].dtype == torch.int32
    assert kw["cu_seqlens_q"].is_contiguous() and kw["cu_seqlens_k"].is_contiguous()
    assert kw["dropout_p"] == 0.0 and kw["softmax_scale"] == 0.125 and kw["return_attn_probs"] is True
    assert kw["max_seqlen_q"] >= max(qlens) and kw["max_seqlen_k"] >= max(slens)
    cq, ck = kw["cu_seqlens_q"].tolist(), kw["cu_seqlens_k"].tolist()
    for r, (t, s) in enumerate(zip(qlens, slens, strict=True)):
        assert cq[r + 1] - cq[r] == t, f"request {r}: query length"
        if s == 0:  # padding: one key of block 0 (flash-attn writes out of bounds for none)
            assert ck[r + 1] - ck[r] == 1 and kw["block_table"][r, 0] == 0, f"request {r}: padding"
            continue
        assert ck[r + 1] - ck[r] == s, f"request {r}: key length"
        nblk = math.ceil(s / meta.block_size)
        assert kw["block_table"][r, :nblk].tolist() == meta.block_table[r, :nblk].tolist()
        for i in range(t):
            pos = s - t + i  # the rule of positions
            ours = {j for j in range(s) if j <= pos and (not window or j > pos - window)}
            assert _visible(kw, r, i, t, s) == ours, f"request {r} row {i}"


def test_decode_batch_keeps_max_seqlen_q_1_only_when_every_request_has_a_row():
    meta = make_batch([(1, 70), (1, 300), (1, 0)])[2]
    assert FlashAttn2Backend().plan(meta).max_seqlen_q == 1
    meta = make_batch([(1, 70), (0, 300), (0, 0), (1, 5)])[2]
    # max_seqlen_q == 1 would send flash-attn down its one-row-per-request reshape: take 2.
    assert FlashAttn2Backend().plan(meta).max_seqlen_q == 2


@pytest.mark.parametrize("window", [0, 64])
def test_a_decode_batch_returning_its_lse_skips_flash_attns_head_swap(window):
    # flash-attn's decode reshape (max_seqlen_q == 1, more q heads than KV heads) leaves the
    # lse of its unsplit path in another order: an lse call passes a bound of 2 query tokens.
    q, cache, meta = make_batch([(1, 70), (1, 300), (1, 5)])
    plan = FlashAttn2Backend().plan(meta)
    assert plan.max_seqlen_q == 1 and q.shape[1] > cache.num_kv_heads
    with_lse = varlen_kwargs(q, cache, plan, scale=0.125, window=window, return_lse=True)
    without = varlen_kwargs(q, cache, plan, scale=0.125, window=window, return_lse=False)
    assert with_lse["max_seqlen_q"] == 2 and without["max_seqlen_q"] == 1
    for r, s in enumerate([70, 300, 5]):  # the keys each decode sees are the same either way
        assert _visible(with_lse, r, 0, 1, s) == _visible(without, r, 0, 1, s)


def test_without_the_bump_flash_attn_would_reject_the_decode_batch(fake_flash_attn):
    q, cache, meta = make_batch([(1, 70), (0, 300), (1, 5)])
    plan = FlashAttn2Backend().plan(meta)
    plan.max_seqlen_q = 1
    with pytest.raises(RuntimeError, match="is invalid for input of size"):
        FlashAttn2Backend()._forward(
            q, cache, plan, out=torch.empty_like(q), lse=None, scale=0.1, window=0, softcap=0.0, sinks=None
        )


def test_plan_maps_rows_to_requests_and_marks_padding():
    meta = make_batch([(2, 5), (0, 7), (3, 0), (1, 9)])[2]
    plan = FlashAttn2Backend().plan(meta)
    assert plan.token_req.tolist() == [0, 0, 2, 2, 2, 3]
    assert plan.token_pos.tolist() == [0, 1, 0, 1, 2, 0]
    assert plan.pad_rows.tolist() == [False, False, True, True, True, False]


def test_no_request_reaches_flash_attn_without_keys():
    """flash-attn 2.8.3 writes the lse of a request without keys out of bounds (see _plan)."""
    meta = make_batch([(2, 5), (3, 0), (1, 9), (1, 0)])[2]
    before = meta.block_table.clone()
    plan = FlashAttn2Backend().plan(meta)
    assert torch.diff(plan.cu_seqlens_k).tolist() == [5, 1, 9, 1]
    assert plan.block_table[[1, 3], 0].tolist() == [0, 0]
    assert plan.block_table[[0, 2]].tolist() == before[[0, 2]].tolist()
    assert torch.equal(meta.block_table, before)  # the engine's table is not touched
    assert plan.pad_rows.tolist() == [False, False, True, True, True, False, True]


def test_plan_needs_no_data_on_the_host():
    # Meta tensors have shapes but no values: a .item()/.tolist() (a device sync on a GPU) would raise.
    from paged_core import BatchMeta

    def empty(*shape, dtype=torch.int32):
        return torch.empty(*shape, dtype=dtype, device="meta")

    meta = BatchMeta(
        num_reqs=7,
        query_start_loc=empty(8),
        seq_lens=empty(7),
        block_table=empty(7, 3),
        slot_mapping=empty(9, dtype=torch.int64),
        block_size=256,
        max_query_len=3,
        max_seq_len=600,
    )
    plan = FlashAttn2Backend().plan(meta)
    assert plan.pad_rows.shape == (9,) and plan.cu_seqlens_k.shape == (8,) and plan.max_seqlen_q == 3


def test_lse_conversion_both_layouts():
    meta = make_batch([(2, 5), (3, 0), (1, 9)])[2]
    plan = FlashAttn2Backend().plan(meta)
    H = 4
    ours = torch.randn(meta.num_tokens, H)
    ours[2:5] = -math.inf  # the padding request
    fa = ours.t().contiguous().clone()  # flash-attn >= 2.6: [num_heads, total_q]
    fa[:, 2:5] = math.inf  # flash-attn's value for rows without keys
    assert torch.equal(lse_to_paged(fa, plan), ours)
    padded = torch.full((3, H, 3), 7.0)  # older layout: [batch, num_heads, max_seqlen_q]
    for row, (r, i) in enumerate(zip(plan.token_req.tolist(), plan.token_pos.tolist(), strict=True)):
        padded[r, :, i] = fa[:, row]
    out = lse_to_paged(padded, plan)
    assert out.dtype == torch.float32 and out.shape == (meta.num_tokens, H)
    assert torch.equal(out, ours)


# ---------------------------------------------------------------------------------- end to end (stand-in)
CASES = {
    "mixed_gqa4": dict(pairs=MIXED),
    "mixed_group3": dict(pairs=MIXED, num_heads=6, num_kv_heads=2),
    "mixed_mha_fp16": dict(pairs=MIXED, num_heads=4, num_kv_heads=4, dtype=torch.float16),
    "decode_only_swapped_path": dict(pairs=[(1, 70), (1, 300), (1, 0), (1, 1)]),
    "decode_with_empty_requests": dict(pairs=[(1, 70), (0, 300), (0, 0), (1, 5)]),
    "window": dict(pairs=MIXED, window=16),
    "window_decode": dict(pairs=[(1, 70), (1, 600)], window=100),
    "softcap": dict(pairs=MIXED, softcap=5.0),
    "all_padding": dict(pairs=[(2, 0), (1, 0)]),
    "block_512": dict(pairs=MIXED, block_size=512),
}


@pytest.mark.parametrize("case", CASES, ids=list(CASES))
def test_adapter_through_the_stand_in_matches_reference(case, fake_flash_attn):
    kw = dict(CASES[case])
    window, softcap = kw.pop("window", 0), kw.pop("softcap", 0.0)
    q, cache, meta = make_batch(kw.pop("pairs"), **kw)
    backend = FlashAttn2Backend()
    plan = backend.plan(meta)
    assert isinstance(plan, FlashAttn2Plan) and plan.meta is meta
    out = torch.full_like(q, float("nan"))  # every row must be written
    lse = torch.full(q.shape[:2], float("nan"))
    backend._forward(
        q, cache, plan, out=out, lse=lse, scale=q.shape[2] ** -0.5, window=window, softcap=softcap, sinks=None
    )
    ref, ref_lse = reference_attention(
        q, cache, meta, window=window, softcap=softcap, return_lse=True, compute_dtype=torch.float64
    )
    assert_close_to_reference(out, ref, backend="flash-attn2", case=case, tolerance=output_tolerance(q.dtype))
    assert_close_to_reference(
        lse, ref_lse, backend="flash-attn2", case=case, what="lse", tolerance=lse_tolerance(q.dtype)
    )
    pad = plan.pad_rows
    assert torch.equal(out[pad], torch.zeros_like(out[pad])) and torch.isneginf(lse[pad]).all()
    assert not out.isnan().any() and not lse.isnan().any()
    (call,) = fake_flash_attn.CALLS
    assert call["k"] is cache.k and call["block_table"] is plan.block_table


def test_forward_without_lse_returns_only_out(fake_flash_attn):
    q, cache, meta = make_batch(MIXED)
    out = torch.full_like(q, float("nan"))  # every row must be written
    FlashAttn2Backend()._forward(
        q, cache, meta, out=out, lse=None, scale=0.125, window=0, softcap=0.0, sinks=None
    )  # a BatchMeta is planned on the fly
    ref = reference_attention(q, cache, meta, scale=0.125, compute_dtype=torch.float64)
    assert_close_to_reference(out, ref, backend="flash-attn2", case="no-lse", tolerance=output_tolerance(q.dtype))
    assert fake_flash_attn.CALLS[0]["return_attn_probs"] is False


# ---------------------------------------------------------------------------------- the real kernel
_HAVE_GPU_FA = torch.cuda.is_available() and importlib.util.find_spec("flash_attn") is not None


@pytest.mark.gpu
@pytest.mark.skipif(not _HAVE_GPU_FA, reason="needs CUDA and flash-attn")
def test_gpu_matches_reference():
    path = Path(__file__).with_name("smoke_flash_attn2_gpu.py")  # loaded by path: other plugins may have one too
    spec = importlib.util.spec_from_file_location("paged_flash_attn2_gpu_smoke", path)
    gpu_smoke = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(gpu_smoke)
    results = gpu_smoke.run_all()
    failed = [r for r in results if not r.ok]
    assert not failed, "\n".join(str(r) for r in failed)


def test_a_pruned_build_refuses_head_dims_it_has_no_kernel_for(fake_flash_attn, tmp_path):
    """build_sm90.sh's marker names its kernels: the backend's reasons (which plan() raises as
    UnsupportedSpecError) name the rest; flash-attn would stop inside its dispatch."""
    import json
    import sys

    from paged_flash_attn2.backend import PRUNED_BUILD_INFO, _pruned_build

    pkg = tmp_path / "flash_attn"
    pkg.mkdir()
    (pkg / PRUNED_BUILD_INFO).write_text(json.dumps({"head_dims": [64, 96, 128, 256], "dtypes": ["bf16"]}))
    sys.modules["flash_attn"].__file__ = str(pkg / "__init__.py")
    _pruned_build.cache_clear()
    b = FlashAttn2Backend()
    assert b.extra_reasons(spec(head_dim=128)) == [] and b.extra_reasons(spec(head_dim=80)) == []  # 80: the 96 kernel
    (why,) = b.extra_reasons(spec(head_dim=160))
    assert "head-dim-192 kernel, which this pruned build does not have (compiled: 64, 96, 128, 256" in why
    assert 'FA_HEAD_DIMS="64 96 128 192 256"' in why
    assert "head-dim-32 kernel" in b.extra_reasons(spec(head_dim=32))[0]
    (why,) = b.extra_reasons(spec(dtype=torch.float16))
    assert "dtype fp16 is not in this pruned build" in why
    assert any("head-dim-192" in r for r in b.reasons(spec(head_dim=160)))  # what plan() checks


def test_a_full_build_has_no_marker_and_no_extra_reasons(fake_flash_attn):
    assert FlashAttn2Backend().extra_reasons(spec(head_dim=160)) == []


def test_mla_shaped_heads_are_refused_with_the_reason():
    spec = AttentionSpec(
        num_heads=16, num_kv_heads=16, head_dim=192, head_dim_v=128, block_size=256, dtype=torch.bfloat16, device="cuda"
    )
    assert (
        "head_dim_v 128 other than head_dim 192 (MLA-shaped heads) is not supported (accepted "
        "(head_dim, head_dim_v): head_dim_v == head_dim)" in FlashAttn2Backend.capabilities.reasons(spec)
    )
