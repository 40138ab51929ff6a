"""CPU tests of the flashinfer plugin: registration, availability reasons, `paged list`, planning prep.

None of these import FlashInfer or need CUDA; they run everywhere (FlashInfer is absent on CI).
"""

from __future__ import annotations

import dataclasses
import json
import sys
import types

import paged_flashinfer
import pytest
import torch
from paged_core import AttentionSpec, BatchMeta, Registry, UnsupportedSpecError, _cli, allocate_kv_cache
from paged_flashinfer import backend as fib
from paged_flashinfer.backend import INSTALL, FlashInferBackend, prepare_plan


@pytest.fixture
def registry(monkeypatch):
    """A registry with the reference and this plugin only, whatever else is installed."""
    monkeypatch.setenv("PAGED_PLUGINS", "reference")
    reg = Registry()
    reg.add_plugin(paged_flashinfer, name="flashinfer")
    return reg


def _no_flashinfer(monkeypatch):
    real = fib.importlib.util.find_spec
    monkeypatch.setattr(
        fib.importlib.util, "find_spec", lambda name, *a: None if name == "flashinfer" else real(name, *a)
    )


def _fake_flashinfer(monkeypatch):
    real = fib.importlib.util.find_spec
    monkeypatch.setattr(
        fib.importlib.util, "find_spec", lambda name, *a: object() if name == "flashinfer" else real(name, *a)
    )


def test_registered_with_priority_and_install_hint(registry):
    reg = registry.registration("flashinfer")
    assert reg.priority == 30
    assert reg.install_hint == INSTALL
    assert registry.names()[0] == "flashinfer"


def test_unavailable_without_flashinfer_names_the_fix(registry, monkeypatch):
    _no_flashinfer(monkeypatch)
    reasons = registry.unavailable("flashinfer")
    assert any("flashinfer is not installed" in r and r.endswith(f"({INSTALL})") for r in reasons)
    with pytest.raises(Exception, match="pip install --find-links dist 'paged-core\\[flashinfer\\]'"):
        registry.get("flashinfer")


def test_unavailable_without_cuda(monkeypatch):
    _fake_flashinfer(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    reasons = FlashInferBackend.unavailable()
    assert len(reasons) == 1
    assert "needs a CUDA GPU" in reasons[0] and "torch.cuda.is_available()" in reasons[0]


def test_available_when_both_present(monkeypatch):
    _fake_flashinfer(monkeypatch)
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert FlashInferBackend.unavailable() == []


def test_importing_the_backend_does_not_import_flashinfer():
    # The registry imports the backend module for capabilities on any machine.
    if "flashinfer" in sys.modules:
        pytest.skip("flashinfer was already imported by something else in this process")
    import importlib

    importlib.reload(fib)
    assert "flashinfer" not in sys.modules


@pytest.mark.parametrize("as_json", [False, True], ids=["table", "json"])
def test_paged_list_shows_it_unavailable_and_never_breaks(registry, monkeypatch, capsys, as_json):
    _no_flashinfer(monkeypatch)
    monkeypatch.setattr(_cli, "registry", registry)
    assert _cli.main(["list", "--json"] if as_json else ["list"]) == 0
    text = capsys.readouterr().out
    if as_json:
        rows = {r["name"]: r for r in json.loads(text)["backends"]}
        assert rows["flashinfer"]["available"] is False
        assert any(INSTALL in r for r in rows["flashinfer"]["reasons"])
        assert rows["reference"]["available"] is True
    else:
        line = next(x for x in text.splitlines() if x.startswith("flashinfer"))
        assert "unavailable" in line
        assert INSTALL in text and "reference" in text


def test_constructor_is_cheap_and_checks_options():
    b = FlashInferBackend()  # no GPU, no FlashInfer: constructing allocates nothing
    assert b._workspaces == {} and b._slots == {}
    with pytest.raises(ValueError, match="decode_backend is 'fa4'"):
        FlashInferBackend(decode_backend="fa4")
    with pytest.raises(ValueError, match="mixed is 'pod'"):
        FlashInferBackend(mixed="pod")


@pytest.mark.parametrize(
    "change, words",
    [
        (dict(device="cpu"), "device 'cpu'"),
        (dict(dtype=torch.float32), "dtype float32"),
        (dict(head_dim=96), "head_dim 96"),
        (dict(kv_dtype="int8"), "kv_dtype 'int8' is not supported (accepted: auto, fp8, fp8_e5m2)"),
        (dict(kv_dtype="kivi4"), "kv_dtype 'kivi4'"),
        (dict(sinks=True), "sinks"),
    ],
    ids=["cpu", "float32", "head_dim_96", "int8", "kivi4", "sinks"],
)
def test_declared_capabilities_refuse_what_flashinfer_cannot_do(change, words):
    base = dict(window=128, softcap=30.0, return_lse=True)
    assert FlashInferBackend.capabilities.reasons(_spec(**base)) == []
    reasons = FlashInferBackend.capabilities.reasons(_spec(**{**base, **change}))
    assert any(words in r for r in reasons), reasons


def test_forward_on_cpu_is_refused_with_reasons():
    meta = BatchMeta.build([1, 1], [5, 9], block_size=16)
    cache = allocate_kv_cache(4, 16, 2, 64, dtype=torch.bfloat16)
    with pytest.raises(UnsupportedSpecError, match="device 'cpu'"):
        FlashInferBackend().forward(torch.zeros(2, 4, 64, dtype=torch.bfloat16), cache, meta)


# ----------------------------------------------------------------------------- plan preparation
def test_decode_batch_with_padding_gets_dummy_pages_and_a_row_mask():
    meta = BatchMeta.build([1, 1, 1, 1], [17, 0, 3, 0], block_size=16)
    p = prepare_plan(meta)
    assert p.batch_class == "decode"
    # Padding requests: one page (block 0) holding one token.
    assert p.pages.indptr.tolist() == [0, 2, 3, 4, 5]
    assert p.pages.last_page_len.tolist() == [1, 1, 3, 1]
    idx = p.pages.indices.tolist()
    assert idx[:2] == meta.block_table[0, :2].tolist() and idx[2] == 0 and idx[4] == 0
    assert idx[3] == meta.block_table[2, 0].item()
    assert p.pages.indptr_cpu.tolist() == p.pages.indptr.tolist()
    assert p.pages.last_page_len_cpu.tolist() == [1, 1, 3, 1]
    assert p.kv_lens_cpu.tolist() == [17, 1, 3, 1]
    assert p.pad_rows.tolist() == [False, True, False, True]


def test_padding_request_with_several_rows_gets_as_many_dummy_keys():
    # kv_len >= qo_len for every request the kernels see, even padding ones.
    meta = BatchMeta.build([3, 20], [10, 0], block_size=16)
    p = prepare_plan(meta)
    assert p.batch_class == "prefill"
    assert p.kv_lens_cpu.tolist() == [10, 20]
    assert p.pages.indptr_cpu.tolist() == [0, 1, 3]
    assert p.pages.indices[1:3].tolist() == [0, 0]
    assert p.pad_rows.tolist() == [False] * 3 + [True] * 20


@pytest.mark.parametrize(
    "qlens, slens, cls",
    [
        ([1, 1, 1], [5, 40, 9], "decode"),
        ([5, 1, 1], [5, 40, 9], "mixed"),
        ([5, 16, 21], [5, 16, 21], "prefill"),
        ([1, 0, 1], [5, 40, 9], "prefill"),  # a request without new tokens: not the decode wrapper
        ([4, 0, 1], [40, 40, 9], "mixed"),
    ],
    ids=["decode", "mixed", "prefill", "decode_with_idle_request", "mixed_with_idle_request"],
)
def test_batch_classes(qlens, slens, cls):
    p = prepare_plan(BatchMeta.build(qlens, slens, block_size=16))
    assert p.batch_class == cls
    assert p.pad_rows is None  # no padding: no mask, nothing extra per layer
    assert p.qo_indptr_cpu.tolist() == [0, *torch.tensor(qlens).cumsum(0).tolist()]


def test_plan_works_without_host_mirrors():
    meta = BatchMeta.build([1, 1], [17, 0], block_size=16)
    bare = BatchMeta(**{**meta.__dict__, "query_start_loc_cpu": None, "seq_lens_cpu": None})
    p = prepare_plan(bare)
    assert p.pages.indptr_cpu.tolist() == [0, 2, 3]
    assert p.pad_rows.tolist() == [False, True]


def test_explicit_plan_needs_all_parameters_and_a_cuda_batch():
    b = FlashInferBackend()
    meta = BatchMeta.build([1], [5], block_size=16)
    assert b.plan(meta).batch_class == "decode"  # no parameters: pure preparation, no FlashInfer
    with pytest.raises(ValueError, match="not all"):
        b.plan(meta, num_heads=8)
    # The base class refuses the spec (a CPU batch) before FlashInfer's own plan runs.
    with pytest.raises(UnsupportedSpecError, match="device 'cpu' is not supported"):
        b.plan(meta, num_heads=8, num_kv_heads=2, head_dim=64, dtype=torch.bfloat16)


@pytest.mark.parametrize(
    ("heads", "window", "mixed", "path"),
    [
        ((32, 8), 0, "batch_attention", "batch_attention"),
        ((24, 8), 0, "batch_attention", "batch_attention"),
        # MHA mixed batches failed conformance through BatchAttention on the H200: prefill wrapper.
        ((32, 32), 0, "batch_attention", "prefill"),
        ((32, 8), 64, "batch_attention", "prefill"),  # BatchAttention has no sliding window
        ((32, 8), 0, "prefill", "prefill"),
    ],
)
def test_mixed_batch_path(heads, window, mixed, path):
    plan = prepare_plan(BatchMeta.build([5, 1, 1], [40, 70, 9], block_size=16))
    params = fib._Params(
        num_heads=heads[0],
        num_kv_heads=heads[1],
        head_dim=128,
        dtype=torch.bfloat16,
        window=window,
        softcap=0.0,
        scale=128**-0.5,
    )
    assert FlashInferBackend(mixed=mixed)._path(plan, params) == path


# ----------------------------------------------------------------------------- cascade levels
def _shared_prefix_meta(qlens, slens, prefix_blocks, block_size=16):
    """A batch whose requests hold blocks 1 .. prefix_blocks first, then their own."""
    next_id = prefix_blocks + 1
    tables = []
    for s in slens:
        n = -(-s // block_size)
        own = list(range(next_id, next_id + max(0, n - prefix_blocks)))
        next_id += len(own)
        tables.append(list(range(1, min(n, prefix_blocks) + 1)) + own if s else [])
    return BatchMeta.from_lists(qlens, slens, tables, block_size=block_size)


def test_cascade_levels_split_the_shared_prefix_from_each_requests_keys():
    meta = _shared_prefix_meta([1, 3, 1, 1], [69, 94, 0, 81], prefix_blocks=4)
    p = prepare_plan(meta, prefix_blocks=4)
    c = p.cascade
    assert c is not None and c.prefix_blocks == 4
    # Level 0: all 6 query rows as one request over the 4 prefix pages.
    assert c.prefix_qo_indptr_cpu.tolist() == [0, 6]
    assert c.prefix_indptr_cpu.tolist() == [0, 4] and c.prefix_indices.tolist() == [1, 2, 3, 4]
    assert c.prefix_last_page_len_cpu.tolist() == [16]
    # Level 1: each request's keys after the 64 prefix tokens; the padding request stays padding.
    s = c.suffix
    assert s.kv_lens_cpu.tolist() == [5, 30, 1, 17]
    assert s.pages.indptr_cpu.tolist() == [0, 1, 3, 4, 6]
    assert s.pages.indices[:6].tolist() == [5, 6, 7, 0, 8, 9]
    assert s.pages.last_page_len_cpu.tolist() == [5, 14, 1, 1]
    assert p.pad_rows.tolist() == s.pad_rows.tolist() == [False] * 4 + [True, False]


def test_cascade_is_dropped_when_a_query_reaches_into_the_prefix():
    # Request 1 has 40 new tokens over 70 keys: its first queries sit inside the 64-token prefix,
    # which the non-causal prefix level would show them whole.
    meta = _shared_prefix_meta([1, 40], [80, 70], prefix_blocks=4)
    assert prepare_plan(meta, prefix_blocks=4).cascade is None
    assert prepare_plan(meta).cascade is None


def test_cascade_option_finds_the_prefix_and_checks_declared_ones():
    meta = _shared_prefix_meta([1, 1, 1], [300, 290, 410], prefix_blocks=16)
    assert FlashInferBackend(cascade=True).plan(meta).cascade.prefix_blocks == 16
    assert FlashInferBackend().plan(meta).cascade is None  # opt-in
    assert FlashInferBackend(cascade=True, min_prefix_tokens=512).plan(meta).cascade is None
    assert FlashInferBackend().plan(meta, shared_prefix_blocks=16).cascade.prefix_blocks == 16
    with pytest.raises(ValueError, match="shared_prefix_blocks is 99; accepted: an int from 0"):
        FlashInferBackend().plan(meta, shared_prefix_blocks=99)
    with pytest.raises(ValueError, match="min_prefix_tokens is -1"):
        FlashInferBackend(min_prefix_tokens=-1)


def test_cascade_reads_the_prefix_through_a_request_with_keys():
    # Request 0 is padding and its table row holds other ids: the prefix comes from request 1.
    meta = _shared_prefix_meta([1, 1, 1], [0, 300, 290], prefix_blocks=16)
    table = meta.block_table.clone()
    table[0, :16] = 99
    meta = BatchMeta.from_lists(
        [1, 1, 1],
        [0, 300, 290],
        [table[0, :16].tolist(), *(table[r, : -(-n // 16)].tolist() for r, n in ((1, 300), (2, 290)))],
        block_size=16,
    )
    c = prepare_plan(meta, prefix_blocks=16).cascade
    assert c.prefix_indices.tolist() == list(range(1, 17))


# ----------------------------------------------------------------------------- MLA-shaped heads
class _Recorder:
    """A stand-in FlashInfer wrapper: records each plan() call's arguments."""

    def __init__(self):
        self.calls = []

    def plan(self, *args, **kwargs):
        self.calls.append((args, kwargs))


def _spec(**kw):
    """A CUDA layer spec: Qwen3-8B's attention (32/8/128, bf16, 16-token blocks) unless changed."""
    base = dict(num_heads=32, num_kv_heads=8, head_dim=128, block_size=16, dtype=torch.bfloat16, device="cuda")
    return AttentionSpec(**{**base, **kw})


#: DeepSeek-style MLA heads expanded to 16 query and KV heads: QK 192, V 128.
MLA = dict(num_heads=16, num_kv_heads=16, head_dim=192, head_dim_v=128)


def _planned_params(monkeypatch, **layer):
    """The _Params an explicit plan(meta, **layer) of a one-request CUDA batch loads."""
    seen = []
    monkeypatch.setattr(FlashInferBackend, "_load", lambda self, plan, params, device: seen.append(params))
    monkeypatch.setattr(fib, "prepare_plan", lambda meta, prefix_blocks=0: None)
    monkeypatch.setattr(FlashInferBackend, "_prefix_of", lambda self, meta, declared: 0)
    meta = BatchMeta.build([1], [9], block_size=16)
    monkeypatch.setattr(type(meta), "device", property(lambda self: torch.device("cuda")))
    FlashInferBackend()._plan(meta, **layer)
    (params,) = seen
    return params


def _mla_params(**kw):
    base = dict(
        num_heads=16,
        num_kv_heads=16,
        head_dim=192,
        dtype=torch.bfloat16,
        window=0,
        softcap=0.0,
        scale=192**-0.5,
        head_dim_vo=128,
    )
    return fib._Params(**{**base, **kw})


def test_mla_claim_is_the_deepseek_pair_only():
    caps = FlashInferBackend.capabilities
    spec = _spec(**MLA)
    assert caps.reasons(spec) == []
    assert caps.reasons(dataclasses.replace(spec, head_dim=96, head_dim_v=64)) == [
        "head_dim 96 is not supported (accepted: 64, 128, 256)",
        "head_dim_v 64 other than head_dim 96 (MLA-shaped heads) is not supported "
        "(accepted (head_dim, head_dim_v): (192, 128) or head_dim_v == head_dim)",
    ]
    # 192 with V of 192 is no FA3 instantiation: not claimed through the pair.
    assert caps.reasons(dataclasses.replace(spec, head_dim_v=192)) == [
        "head_dim 192 is not supported (accepted: 64, 128, 256)"
    ]


@pytest.mark.parametrize(
    ("qlens", "equal_dims_path"), [([1, 1, 1], "decode"), ([5, 1, 1], "batch_attention")], ids=["decode", "mixed"]
)
def test_mla_batches_take_the_prefill_wrapper(qlens, equal_dims_path):
    # The decode wrapper's plan has one head_dim; BatchAttention is not claimed for the pair.
    plan = prepare_plan(BatchMeta.build(qlens, [40, 70, 9], block_size=16))
    assert FlashInferBackend()._path(plan, _mla_params()) == "prefill"
    assert FlashInferBackend()._path(plan, _mla_params(num_kv_heads=4, head_dim=128, head_dim_vo=0)) == equal_dims_path


def test_mla_plan_passes_head_dim_vo(monkeypatch):
    monkeypatch.setattr(FlashInferBackend, "_prewarm", staticmethod(lambda p, device: None))
    b = FlashInferBackend()
    plan = prepare_plan(BatchMeta.build([5, 1], [40, 70], block_size=16))
    wrapper = _Recorder()
    b._plan_into(fib._Slot("prefill", wrapper), plan, _mla_params())
    ((args, kwargs),) = wrapper.calls
    assert args[4:8] == (16, 16, 192, 16)  # heads, KV heads, head_dim_qk, page size
    assert kwargs["head_dim_vo"] == 128
    # Equal dims pass head_dim_vo == head_dim: what FlashInfer's default (None) means.
    wrapper.calls.clear()
    b._plan_into(fib._Slot("prefill", wrapper), plan, _mla_params(head_dim=128, head_dim_vo=0))
    assert wrapper.calls[0][1]["head_dim_vo"] == 128
    # Cascade: both levels get it.
    meta = _shared_prefix_meta([1, 3, 1], [69, 94, 81], prefix_blocks=4)
    cplan = prepare_plan(meta, prefix_blocks=4)
    levels = (_Recorder(), _Recorder())
    b._plan_into(fib._Slot("cascade", levels), cplan, _mla_params())
    assert [lv.calls[0][1]["head_dim_vo"] for lv in levels] == [128, 128]
    # BatchAttention.plan takes head_dim_qk, head_dim_vo positionally.
    ba = _Recorder()
    b._plan_into(fib._Slot("batch_attention", ba), plan, _mla_params())
    assert ba.calls[0][0][6:8] == (192, 128)


def test_mla_plan_keyword_reaches_the_params(monkeypatch):
    params = _planned_params(monkeypatch, **MLA, dtype=torch.bfloat16)
    assert params.head_dim_vo == 128 and params.head_dim == 192


def test_mla_prefill_wrappers_use_fa2(monkeypatch):
    # FA3's paged prefill refuses K and V pages of two strides (K 192, V 128 per token and head);
    # FA2 reads V with its own strides. Equal dims keep the configured backend.
    made = []

    class _Wrapper:
        def __init__(self, workspace, layout, backend):
            made.append(backend)

    monkeypatch.setattr(fib, "_flashinfer", lambda: types.SimpleNamespace(BatchPrefillWithPagedKVCacheWrapper=_Wrapper))
    b = FlashInferBackend()
    monkeypatch.setattr(b, "_workspace", lambda device: None)
    plan = prepare_plan(BatchMeta.build([5, 1], [40, 70], block_size=16))
    for path in ("prefill", "cascade"):
        b._new_slot(path, False, plan, _mla_params(), torch.device("cpu"))
        b._new_slot(path, False, plan, _mla_params(head_dim=128, head_dim_vo=0), torch.device("cpu"))
    assert made == ["fa2", "auto", "fa2", "fa2", "auto", "auto"]
    spec = _spec(**MLA)
    (reason,) = FlashInferBackend(prefill_backend="fa3").extra_reasons(spec)
    assert "needs prefill_backend 'auto' or 'fa2'" in reason
    assert FlashInferBackend(prefill_backend="fa2").extra_reasons(spec) == []


@pytest.mark.parametrize("kv_dtype", ["fp8", "fp8_e5m2"])
@pytest.mark.parametrize("kv_scales", ["per_slot", "per_head", "per_tensor"])
def test_fp8_caches_are_claimed_through_fa2_only(kv_dtype, kv_scales):
    spec = _spec(kv_dtype=kv_dtype, kv_scales=kv_scales)
    assert FlashInferBackend.capabilities.reasons(spec) == []
    assert FlashInferBackend().extra_reasons(spec) == []
    (reason,) = FlashInferBackend(decode_backend="fa3", prefill_backend="fa3").extra_reasons(spec)
    assert f"kv_dtype '{kv_dtype}' runs FlashInfer's FA2 kernels only" in reason
    assert "decode_backend='fa3' and prefill_backend='fa3'" in reason
    assert FlashInferBackend(prefill_backend="fa3").extra_reasons(dataclasses.replace(spec, kv_dtype="auto")) == []


def test_fp8_plans_read_codes_with_per_slot_scales(monkeypatch):
    # use_token_head_sf and the codes' dtype reach every planner; mixed batches and prefills
    # take the prefill wrapper on FA2 (BatchAttention reads no per-slot scales).
    monkeypatch.setattr(FlashInferBackend, "_prewarm", staticmethod(lambda p, device: None))
    b = FlashInferBackend()
    fp8 = _mla_params(num_kv_heads=4, head_dim=128, head_dim_vo=0, kv_dtype=torch.float8_e5m2)
    assert fp8.fp8 and not _mla_params().fp8
    mixed = prepare_plan(BatchMeta.build([5, 1], [40, 70], block_size=16))
    decode = prepare_plan(BatchMeta.build([1, 1], [40, 70], block_size=16))
    assert b._path(mixed, fp8) == "prefill" and b._path(decode, fp8) == "decode"
    assert b._prefill_kernel(fp8) == "fa2"
    for path, plan in (("prefill", mixed), ("decode", decode)):
        wrapper = _Recorder()
        b._plan_into(fib._Slot(path, wrapper), plan, fp8)
        kwargs = wrapper.calls[0][1]
        assert kwargs["use_token_head_sf"] is True
        assert kwargs["kv_data_type"] == torch.float8_e5m2 and kwargs["q_data_type"] == torch.bfloat16
    wrapper = _Recorder()
    b._plan_into(fib._Slot("decode", wrapper), decode, dataclasses.replace(fp8, kv_dtype=None))
    assert "use_token_head_sf" not in wrapper.calls[0][1]


@pytest.mark.parametrize(("kv_dtype", "want"), [("fp8", torch.float8_e4m3fn), ("auto", torch.bfloat16)])
def test_fp8_plan_keyword_reaches_the_params(monkeypatch, kv_dtype, want):
    layer = dict(num_heads=8, num_kv_heads=2, head_dim=128, dtype=torch.bfloat16, kv_dtype=kv_dtype)
    assert _planned_params(monkeypatch, **layer).kv_dtype == want


def test_fp8_with_mla_shaped_heads_is_refused():
    spec = _spec(**MLA, kv_dtype="fp8")
    assert FlashInferBackend.capabilities.reasons(spec) == []
    (reason,) = FlashInferBackend().extra_reasons(spec)
    assert "kv_dtype 'fp8' with head_dim_v 128 other than head_dim 192" in reason
    assert FlashInferBackend().extra_reasons(dataclasses.replace(spec, kv_dtype="auto")) == []
