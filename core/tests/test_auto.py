"""``auto``: the backend a tune table names for each batch class, never one that cannot run it.

Its choices run through the reference and triton-unified (Triton's interpreter on the CPU);
every output is checked against the float64 loop oracle. The suite holds auto to its claims
(``nox -s tests`` runs it over the reference alone).
"""

from __future__ import annotations

import json

import pytest
import torch
from oracle import loop_attention
from paged_conformance.tolerances import assert_close_to_reference, output_tolerance
from paged_core import AutoBackend, AutoPlan, BatchMeta, InputError, TuneTable, registry, tune_table_path
from paged_core._auto import TUNE_FORMAT, batch_class, device_name, layer_key
from paged_core._spec import AttentionSpec

H, HKV, D, BS = 4, 1, 64, 16
LAYER = dict(num_heads=H, num_kv_heads=HKV, head_dim=D, dtype=torch.float32)
KEY = layer_key(AttentionSpec(num_heads=H, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype=torch.float32))


@pytest.fixture(autouse=True)
def _no_machine_table(tmp_path, monkeypatch):
    # Each test decides its table: this machine's own (~/.cache) must not leak in.
    monkeypatch.setenv("PAGED_TUNE_TABLE", str(tmp_path / "no-table.json"))


def _table(tmp_path, entries, device=None):
    path = tmp_path / "tune.json"
    path.write_text(json.dumps({"format": TUNE_FORMAT, "device_name": device or device_name(), "entries": entries}))
    return str(path)


def _entry(kind, size, context, **ms):
    return {
        "kind": kind,
        "layer": KEY,
        "size": size,
        "context": context,
        "ms": {k.replace("_", "-"): v for k, v in ms.items()},
    }


def _needs_triton():
    if "triton-unified" not in registry.names() or registry.unavailable("triton-unified"):
        pytest.skip("needs the triton-unified backend installed (pip install paged-triton-unified)")


def _run(backend, meta, seed=0):
    """auto's output for ``meta`` and the oracle's, on random data (never zeros)."""
    g = torch.Generator().manual_seed(seed)
    cache = backend.allocate(64, BS, HKV, D, dtype=torch.float32)
    cache.k.copy_(torch.randn(cache.k.shape, generator=g))
    cache.v.copy_(torch.randn(cache.v.shape, generator=g))
    q = torch.randn(meta.num_tokens, H, D, generator=g)
    plan = backend.plan(meta, **LAYER)
    out = backend.forward(q, cache, plan)
    tables = [row[: -(-s // BS)] for row, s in zip(meta.block_table.tolist(), meta.seq_lens.tolist(), strict=True)]
    qlens = (meta.query_start_loc[1:] - meta.query_start_loc[:-1]).tolist()
    ref, _ = loop_attention(q.double().tolist(), cache.k.double().tolist(), cache.v.double().tolist(), qlens,
                            meta.seq_lens.tolist(), tables, BS)  # fmt: skip
    assert_close_to_reference(
        out, torch.tensor(ref), backend=f"auto->{plan.choice}", case="auto", tolerance=output_tolerance(torch.float32)
    )
    return plan


DECODE = dict(query_lens=[1, 1], seq_lens=[40, 33], block_size=BS)
MIXED = dict(query_lens=[7, 1], seq_lens=[30, 50], block_size=BS)


def test_without_a_table_every_step_runs_on_the_registry_first_choice():
    auto = registry.get("auto")
    first = next(n for n in registry.names() if n != "auto" and not registry.unavailable(n))
    assert auto.base.name == first and auto.table is None
    plan = auto.plan(BatchMeta.build(**DECODE), **LAYER)
    assert isinstance(plan, AutoPlan) and plan.choice == first
    assert "no tune table" in plan.why


def test_the_table_decides_per_batch_class_and_each_choice_is_right(tmp_path):
    _needs_triton()
    path = _table(
        tmp_path,
        [
            _entry("decode", 2, 40, reference=0.1, triton_unified=0.2),
            _entry("mixed", 8, 50, reference=0.3, triton_unified=0.2),
        ],
    )
    # The reference is the base: triton-unified claims every feature it does (but batch invariance).
    auto = AutoBackend(candidates=["reference", "triton-unified"], table=path)
    assert _run(auto, BatchMeta.build(**DECODE)).choice == "reference"
    assert _run(auto, BatchMeta.build(**MIXED)).choice == "triton-unified"
    # The nearest measured batch of the class decides a batch never measured.
    assert _run(auto, BatchMeta.build(query_lens=[1] * 5, seq_lens=[70] * 5, block_size=BS)).choice == "reference"


def test_a_layer_or_backend_the_table_does_not_name_runs_on_the_base(tmp_path):
    path = _table(tmp_path, [_entry("decode", 2, 40, somebody_else=0.01)])
    auto = AutoBackend(candidates=["reference"], table=path)
    plan = auto.plan(BatchMeta.build(**DECODE), **LAYER)
    assert plan.choice == "reference"
    # Another layer (8 heads): no entry of its own, so the base, and the reason says so.
    plan = auto.plan(BatchMeta.build(**DECODE), **{**LAYER, "num_heads": 8})
    assert plan.choice == "reference" and "no decode entry" in plan.why


def test_a_backend_that_does_not_serve_the_layer_or_claim_the_base_features_is_never_chosen(tmp_path):
    _needs_triton()
    # triton-unified is fastest in the table, but it does not serve head dim 24.
    spec24 = AttentionSpec(num_heads=H, num_kv_heads=HKV, head_dim=24, block_size=BS, dtype=torch.float32)
    assert registry.get("triton-unified").reasons(spec24)
    path = _table(
        tmp_path, [{**_entry("decode", 2, 40, reference=1.0, triton_unified=0.1), "layer": layer_key(spec24)}]
    )
    auto = AutoBackend(candidates=["reference", "triton-unified"], table=path)
    assert auto.plan(BatchMeta.build(**DECODE), **{**LAYER, "head_dim": 24}).choice == "reference"
    # With triton-unified as the base, the reference (no CUDA graphs) may never run a step, so a
    # layer triton-unified does not serve is refused with each backend's reasons.
    path = _table(tmp_path, [_entry("decode", 2, 40, reference=0.1, triton_unified=1.0)])
    auto = AutoBackend(candidates=["triton-unified", "reference"], table=path)
    assert auto.capabilities.cuda_graphs and not auto.capabilities.batch_invariant
    assert [b.name for b in auto.pool] == ["triton-unified"] and auto.eligible(spec24) == []
    assert auto.reasons(spec24) and auto.reasons(spec24)[0].startswith("triton-unified: head_dim 24")
    assert auto.plan(BatchMeta.build(**DECODE), **LAYER).choice == "triton-unified"


def test_the_choice_depends_on_host_ints_only(tmp_path):
    """What a captured CUDA graph needs: the same batch class gives the same backend, whatever
    the metadata tensors hold, and another class may give another."""
    _needs_triton()
    path = _table(
        tmp_path,
        [_entry("decode", 2, 40, reference=0.1, triton_unified=0.2), _entry("decode", 8, 4096, triton_unified=0.1)],
    )
    auto = AutoBackend(candidates=["reference", "triton-unified"], table=path)
    spec = AttentionSpec(
        num_heads=H, num_kv_heads=HKV, head_dim=D, block_size=BS, dtype=torch.float32, decode_only=True
    )
    a, b = BatchMeta.build(**DECODE), BatchMeta.build(query_lens=[1, 1], seq_lens=[40, 2], block_size=BS)
    assert batch_class(a) == batch_class(b) == ("decode", 2, 40)
    assert auto.choose(a, spec)[0].name == auto.choose(b, spec)[0].name == "reference"
    long = BatchMeta.build(query_lens=[1] * 8, seq_lens=[4000] * 8, block_size=BS)
    assert auto.choose(long, spec)[0].name == "triton-unified"
    assert batch_class(BatchMeta.build(**MIXED)) == ("mixed", 8, 50)


@pytest.mark.parametrize(
    "text, what",
    [
        ("not json", "JSONDecodeError"),
        ('{"format": "paged-bench"}', "format is not"),
        (json.dumps({"format": TUNE_FORMAT, "device_name": "cpu", "entries": [{"kind": "decode"}]}), "entry 0"),
        (json.dumps({"format": TUNE_FORMAT, "device_name": "cpu", "entries": [_entry("prefill", 1, 1)]}), "kind"),
    ],
)
def test_a_malformed_table_is_refused_in_its_own_words(tmp_path, text, what):
    path = tmp_path / "bad.json"
    path.write_text(text)
    with pytest.raises(InputError, match="not a tune table written by paged tune") as err:
        AutoBackend(candidates=["reference"], table=str(path))
    assert what in str(err.value)
    with pytest.raises(InputError, match="does not exist"):
        AutoBackend(candidates=["reference"], table=str(tmp_path / "missing.json"))


def test_bad_candidates_are_refused():
    with pytest.raises(InputError, match="accepted: a sequence of backend names"):
        AutoBackend(candidates="reference")
    with pytest.raises(InputError, match="auto itself"):
        AutoBackend(candidates=["auto"])


def test_a_table_measured_on_another_device_warns(tmp_path):
    path = _table(tmp_path, [_entry("decode", 2, 40, reference=0.1)], device="NVIDIA Z100")
    with pytest.warns(UserWarning, match="measured on NVIDIA Z100"):
        AutoBackend(candidates=["reference"], table=path)


def test_the_default_table_is_per_device(monkeypatch, tmp_path):
    monkeypatch.delenv("PAGED_TUNE_TABLE")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert tune_table_path("NVIDIA H200") == str(tmp_path / "paged" / "tune" / "nvidia-h200.json")
    table = TuneTable.load(_table(tmp_path, [_entry("decode", 2, 40, reference=0.1)]))
    assert table.nearest("decode", KEY, 3, 64).fastest(["reference"]) == "reference"


def test_the_cache_is_written_by_a_write_kernel_when_one_is_installed():
    _needs_triton()
    auto = AutoBackend(candidates=["reference", "triton-unified"])
    cache = auto.allocate(8, BS, HKV, D, dtype=torch.float32)
    assert auto.writer(cache).name == "triton-unified"
    meta = BatchMeta.build(**DECODE)
    k, v = torch.randn(2, meta.num_tokens, HKV, D)
    auto.write(cache, k, v, meta)
    slots = meta.slot_mapping.tolist()
    flat_k = cache.k.reshape(-1, HKV, D)
    assert torch.equal(flat_k[slots], k)
    assert auto.writes_on_device
    # The reference alone has no write kernel: write_kv writes, on the host's schedule.
    alone = AutoBackend(candidates=["reference"])
    assert alone.writer(cache) is None and not alone.writes_on_device


def test_planned_without_the_layer_the_first_forward_chooses(tmp_path):
    """What the bench and the suite do: plan(meta) alone; the layer is known at forward."""
    _needs_triton()
    path = _table(
        tmp_path,
        [_entry("decode", 2, 40, reference=0.1, triton_unified=0.2), _entry("mixed", 8, 50, triton_unified=0.2)],
    )
    auto = AutoBackend(candidates=["reference", "triton-unified"], table=path)
    plan = auto.plan(BatchMeta.build(**MIXED))
    assert plan.backend is None and plan.choice is None and "first forward" in plan.why
    cache = auto.allocate(8, BS, HKV, D, dtype=torch.float32)
    cache.k.normal_(), cache.v.normal_()
    q = torch.randn(plan.meta.num_tokens, H, D)
    out = auto.forward(q, cache, plan)
    assert plan.choice == "triton-unified" and len(plan.resolved) == 1
    # A second layer of the same shape reuses the choice and its plan; a raw BatchMeta chooses too.
    torch.testing.assert_close(auto.forward(q, cache, plan), out, rtol=0, atol=0)
    assert len(plan.resolved) == 1
    torch.testing.assert_close(auto.forward(q, cache, BatchMeta.build(**MIXED)), out, rtol=0, atol=0)
