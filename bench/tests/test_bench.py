"""``paged bench`` on the CPU: structure and correctness checks of its output, never timings."""

from __future__ import annotations

import argparse
import dataclasses
import json

import pytest
import torch
from paged_bench import cli as _bench
from paged_bench import config as _config
from paged_bench import data as _data
from paged_bench import rows as _rows
from paged_conformance import output_tolerance
from paged_core import KV_DTYPES, KV_SCALES, Backend, Capabilities, Registry, _cli, hookimpl, reference_attention


class _Counting(Backend):
    capabilities = Capabilities(kv_dtypes=frozenset(KV_DTYPES), kv_scales=frozenset(KV_SCALES))
    calls = 0

    def _forward(self, q, cache, plan, *, out, lse, scale, window, softcap, sinks) -> None:
        type(self).calls += 1
        self._compute(q, cache, plan, out, scale)

    def _compute(self, q, cache, plan, out, scale) -> None:
        raise NotImplementedError


class WrongBackend(_Counting):
    """Fast and wrong: random numbers."""

    name = "fake-wrong"

    def _compute(self, q, cache, plan, out, scale) -> None:
        out.copy_(torch.randn_like(out))


class ForgetfulBackend(_Counting):
    """Right for the first query row, forgets the others (the poisoned output must catch it)."""

    name = "fake-forgetful"

    def _compute(self, q, cache, plan, out, scale) -> None:
        ref = reference_attention(q, cache, plan, scale=scale).to(out.dtype)
        out[:1].copy_(ref[:1])


class CudaOnlyBackend(_Counting):
    name = "fake-cuda-only"
    capabilities = Capabilities(devices=frozenset({"cuda"}))


class BrokenBackend(_Counting):
    name = "fake-broken"

    def _compute(self, q, cache, plan, out, scale) -> None:
        raise RuntimeError("kernel exploded")


class PlanningBackend(_Counting):
    """Correct, with a plan object (like FlashInfer's plan/run split)."""

    name = "fake-planning"
    plans = 0

    class Plan:
        def __init__(self, meta):
            self.meta = meta

    def plan(self, meta):
        type(self).plans += 1
        return self.Plan(meta)

    def _compute(self, q, cache, plan, out, scale) -> None:
        out.copy_(reference_attention(q, cache, plan.meta, scale=scale))


FAKES = (WrongBackend, ForgetfulBackend, CudaOnlyBackend, BrokenBackend, PlanningBackend)


class _Plugin:
    @hookimpl
    def register_backends(self, register):
        for cls in FAKES:
            register(cls.name, cls)


@pytest.fixture
def fake_registry(monkeypatch):
    # paged bench sets TRITON_INTERPRET=1 on a machine without CUDA; keep it out of other tests.
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    for cls in FAKES:
        cls.calls = 0
    reg = Registry()
    reg.add_plugin(_Plugin(), name="bench-fakes")
    return reg


def _args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    _bench.add_arguments(p)
    return p.parse_args(["--device", "cpu", *argv])


ROW_FIELDS = {
    "case",
    "shape",
    "kind",
    "backend",
    "label",
    "paged",
    "status",
    "ms",
    "gbps",
    "pct_bw_floor",
    "tflops",
    "pct_mm_floor",
    "x_fastest",
    "max_rel_err",
    "tolerance",
    "timing",
    "plan_ms",
}
CASE_FIELDS = {
    "id",
    "kind",
    "shape",
    "num_reqs",
    "num_tokens",
    "kv_bytes",
    "qo_bytes",
    "flops",
    "floor_ms_bw",
    "floor_ms_mm",
    "checked_requests",
}


def test_bench_reports_wrong_skip_and_error_without_timing_them(tmp_path, fake_registry, capsys):
    out = tmp_path / "bench.json"
    names = "reference," + ",".join(c.name for c in FAKES)
    rc = _bench.main(
        _args(
            "--backend",
            names,
            "--backend",
            "sdpa-flash,sdpa-cudnn",
            "--cases",
            "decode,mixed,prefill,decode-int8,decode-fp8,decode-fp8-static,cascade,sweep",
            "--sweep-batches",
            "1,2",
            "--json",
            str(out),
        ),
        registry=fake_registry,
    )
    assert rc == 1  # a WRONG or failing backend makes the run fail
    text = capsys.readouterr().out
    assert "CPU timings — not representative" in text
    data = json.loads(out.read_text())

    assert data["env"]["device"] == "cpu" and data["env"]["cpu_note"]
    assert data["env"]["read_bandwidth_Bps"] > 0 and data["env"]["matmul_flops"] > 0
    ids = [c["id"] for c in data["cases"]]
    assert ids == [
        "decode",
        "mixed",
        "prefill",
        "decode-int8",
        "decode-fp8",
        "decode-fp8-static",
        "cascade",
        "sweep-b1-l64",
        "sweep-b2-l64",
    ]
    for c in data["cases"]:
        assert CASE_FIELDS <= set(c)
    for r in data["rows"]:
        assert ROW_FIELDS <= set(r)
    rows = {(r["case"], r["backend"]): r for r in data["rows"]}

    for cid in ids:
        ref = rows[(cid, "reference")]
        assert ref["status"] == "ok", ref
        assert ref["ms"] > 0 and ref["gbps"] > 0 and ref["x_fastest"] >= 1.0
        assert ref["max_rel_err"] < 1e-2  # the reference agrees with itself (up to bf16 rounding)

        wrong = rows[(cid, "fake-wrong")]
        assert wrong["status"].startswith("WRONG"), wrong
        assert wrong["ms"] is None and wrong["gbps"] is None and wrong["x_fastest"] is None

        forgetful = rows[(cid, "fake-forgetful")]
        if cid != "sweep-b1-l64":  # with one query row, forgetting "the others" is harmless
            assert forgetful["status"].startswith("WRONG") and "non-finite" in forgetful["status"]
            assert forgetful["ms"] is None

        skip = rows[(cid, "fake-cuda-only")]
        assert skip["status"].startswith("skip:") and "device 'cpu'" in skip["status"]

        broken = rows[(cid, "fake-broken")]
        assert broken["status"].startswith("error:") and "kernel exploded" in broken["status"]
        assert broken["ms"] is None

        planning = rows[(cid, "fake-planning")]
        assert planning["status"] == "ok" and planning["plan_ms"] is not None

    # The wrong backends ran exactly once per case (the check) and were never timed.
    assert WrongBackend.calls == len(ids)
    assert ForgetfulBackend.calls > len(ids)  # right on sweep-b1-l64, so timed there
    assert CudaOnlyBackend.calls == 0
    assert PlanningBackend.calls > len(ids)  # checked, then timed

    # Non-paged baselines only where they make sense (uniform lengths, model-dtype cache).
    sdpa_cases = {r["case"] for r in data["rows"] if r["backend"] == "sdpa-flash"}
    assert sdpa_cases == {"decode", "prefill", "cascade", "sweep-b1-l64", "sweep-b2-l64"}
    for r in data["rows"]:
        if r["backend"] == "sdpa-flash":
            assert r["paged"] is False and "non-paged" in r["label"]
            assert r["status"] == "ok" or r["status"].startswith("skip:"), r
    assert data["not_run"]["sdpa-cudnn"]

    by_id = {c["id"]: c for c in data["cases"]}
    # Checked with the suite's tolerance table (bf16; doubled for a quantized cache).
    for cid in ids:
        kv = by_id[cid]["kv_dtype"]
        want = f"{output_tolerance(torch.bfloat16, kv)} (paged_conformance)"
        assert by_id[cid]["tolerance"] == want and rows[(cid, "reference")]["tolerance"] == want
    assert by_id["decode-int8"]["tolerance"] != by_id["decode"]["tolerance"]
    # Cascade: the shared prefix counts once in the bytes the batch needs.
    casc = by_id["cascade"]
    assert casc["prefix_tokens"] == 32 and casc["kv_bytes"] < casc["kv_bytes_logical"]
    # Quantized caches count their scales: int8 and fp8 need the same bytes, fewer than bf16.
    assert by_id["decode-int8"]["kv_bytes"] == by_id["decode-fp8"]["kv_bytes"] < by_id["decode"]["kv_bytes"]
    # One static scale per tensor: no scale per slot to read (2 x 4 bytes per token and KV head).
    fp8, static = by_id["decode-fp8"], by_id["decode-fp8-static"]
    tokens = fp8["total_context"]
    assert fp8["kv_bytes"] - static["kv_bytes"] == tokens * 2 * 4 * _config.make_config(_args()).kv_heads
    assert static["kv_scales"] == "static" and fp8["kv_scales"] == "per_slot"
    assert rows[("decode-fp8-static", "reference")]["status"] == "ok"
    assert by_id["prefill"]["flops"] > 0 and by_id["mixed"]["kind"] == "mixed"


def test_cli_bench_reference_and_plot(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out, png = tmp_path / "b.json", tmp_path / "sweep.png"
    argv = [
        "bench",
        "--device",
        "cpu",
        "--backend",
        "reference",
        "--cases",
        "decode,sweep",
        "--sweep-batches",
        "1,2",
        "--json",
        str(out),
        "--plot",
        str(png),
    ]
    assert _cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert {r["status"] for r in data["rows"]} == {"ok"}
    assert [r["backend"] for r in data["rows"]] == ["reference"] * 3
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib" in capsys.readouterr().out
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_a_recorded_run_is_printed_again_without_timing(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "b.json"
    argv = [
        "bench",
        "--device",
        "cpu",
        "--backend",
        "reference",
        "--cases",
        "decode,sweep",
        "--sweep-batches",
        "1,2",
        "--json",
        str(out),
    ]
    assert _cli.main(argv) == 0
    first = capsys.readouterr().out
    table = [line for line in first.splitlines() if line.startswith(("decode", "sweep-"))]
    assert len(table) == 3
    # Nothing may run: a backend call would fail here.
    monkeypatch.setattr(_rows, "run_backend", lambda *a, **k: pytest.fail("--from-json timed a backend"))
    png = tmp_path / "again.png"
    assert _cli.main(["bench", "--from-json", str(out), "--plot", str(png)]) == 0
    again = capsys.readouterr().out
    assert [line for line in again.splitlines() if line.startswith(("decode", "sweep-"))] == table
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        assert "matplotlib" in again
    else:
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_from_json_refuses_a_file_that_is_not_a_run(tmp_path, capsys):
    bad = tmp_path / "not-a-run.json"
    bad.write_text('{"rows": []}')
    assert _cli.main(["bench", "--from-json", str(bad)]) == 2
    err = capsys.readouterr().err
    assert "not-a-run.json" in err and "paged bench --json" in err
    assert _cli.main(["bench", "--from-json", str(tmp_path / "missing.json")]) == 2
    assert "missing.json" in capsys.readouterr().err


def test_bad_options_exit_2(fake_registry, capsys):
    assert _bench.main(_args("--cases", "nope"), registry=fake_registry) == 2
    assert "unknown case" in capsys.readouterr().err
    assert _bench.main(_args("--backend", "no-such-backend"), registry=fake_registry) == 2
    assert "no-such-backend" in capsys.readouterr().err


def test_flop_and_byte_counts():
    # One prompt of 3 tokens sees 1 + 2 + 3 keys; a decode at 10 tokens sees 10.
    assert _data.count_flops([3, 1], [3, 10], heads=2, head_dim=8) == 4 * 8 * 2 * (6 + 10)
    # MLA-shaped: QK^T over 8 elements, PV over 4.
    assert _data.count_flops([3, 1], [3, 10], heads=2, head_dim=8, head_dim_v=4) == 2 * (8 + 4) * 2 * (6 + 10)
    # A 2-block prefix shared by two requests is read once.
    tables = [[5, 6, 7], [5, 6, 9]]
    assert _data.unique_kv_tokens(tables, [40, 36], 16) == 32 + 8 + 4
    # Checked requests: every prefill within the row budget, and spread decodes.
    picked = _data.pick_checked([1] * 30 + [512, 512])
    assert {30, 31} <= set(picked) and 0 in picked and len(picked) <= 8


def test_a_case_that_cannot_be_built_is_reported_and_the_rest_run(tmp_path, fake_registry, monkeypatch):
    real = _data.build_pool

    def build(cfg, case, seed):
        if case.id == "prefill":
            raise torch.OutOfMemoryError("pretend the pool does not fit")
        return real(cfg, case, seed)

    monkeypatch.setattr(_data, "build_pool", build)
    out = tmp_path / "b.json"
    rc = _bench.main(
        _args("--backend", "reference", "--cases", "decode,prefill,cascade", "--json", str(out)), registry=fake_registry
    )
    assert rc == 1
    data = json.loads(out.read_text())
    assert data["complete"] is True
    status = {r["case"]: r["status"] for r in data["rows"]}
    assert status["decode"] == "ok" and status["cascade"] == "ok"
    assert status["prefill"].startswith("error: building the case failed")
    assert "does not fit" in status["prefill"]


class CascadeOptionBackend(_Counting):
    """Correct; takes a ``cascade`` option, as triton-splitkv does."""

    name = "fake-cascade"
    built_with: list = []

    def __init__(self, *, cascade: bool = False, validate=None):
        super().__init__(validate=validate)
        type(self).built_with.append(cascade)

    def _compute(self, q, cache, plan, out, scale) -> None:
        out.copy_(reference_attention(q, cache, plan, scale=scale))


def test_cascade_case_adds_a_row_for_backends_offering_cascade(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    CascadeOptionBackend.built_with = []

    class Plugin:
        @hookimpl
        def register_backends(self, register):
            register(CascadeOptionBackend.name, CascadeOptionBackend)
            register(PlanningBackend.name, PlanningBackend)

    reg = Registry()
    reg.add_plugin(Plugin(), name="cascade-fakes")
    out = tmp_path / "b.json"
    _bench.main(
        _args("--cases", "cascade", "--backend", "fake-cascade,fake-planning", "--no-baselines", "--json", str(out)),
        registry=reg,
    )
    rows = json.loads(out.read_text())["rows"]
    labels = {r["label"]: r["status"] for r in rows}
    assert labels == {"fake-cascade": "ok", "fake-planning": "ok", "fake-cascade (cascade)": "ok"}
    assert True in CascadeOptionBackend.built_with  # the extra row really used cascade=True
    # Every backend's row, then the variants; each row gets one progress line as it finishes.
    assert [r["label"] for r in rows] == ["fake-cascade", "fake-planning", "fake-cascade (cascade)"]
    progress = [line for line in capsys.readouterr().err.splitlines() if line.startswith("[1/1]")]
    heads = [
        f"[1/1] {'cascade':<16} {'4x(32+8)':<14} {label:<24} "
        for label in ("fake-cascade", "fake-planning", "fake-cascade (cascade)")
    ]
    assert [line[: len(head)] for line, head in zip(progress, heads, strict=True)] == heads
    assert all(line.endswith(" ms") for line in progress), progress


@pytest.mark.parametrize(
    "argv, words",
    [
        (("--block-size", "0"), "--block-size"),
        (("--heads", "0"), "--heads"),
        (("--heads", "6", "--kv-heads", "4"), "not a multiple"),
        (("--sweep-len", "abc"), "--sweep-len"),
        (("--sweep-batches", "1,-2"), "--sweep-batches"),
    ],
)
def test_bad_shape_options_exit_2_with_the_option_named(fake_registry, capsys, argv, words):
    # These used to end in a ZeroDivisionError/ValueError traceback, a silent default (heads 0)
    # or an einsum error reported as a failed case.
    assert _bench.main(_args("--cases", "decode", *argv), registry=fake_registry) == 2
    assert words in capsys.readouterr().err


class BigBlockBackend(PlanningBackend):
    """Takes 256-token blocks only, like flash-attn 2: the bench runs it through the bridge."""

    name = "fake-big-blocks"
    capabilities = Capabilities(block_sizes=frozenset({256}))


def test_a_256_token_block_backend_runs_on_16_token_blocks_through_the_bridge(tmp_path, monkeypatch):
    pytest.importorskip("paged_flash_attn2")
    monkeypatch.setenv("TRITON_INTERPRET", "1")

    class Plugin:
        @hookimpl
        def register_backends(self, register):
            register(BigBlockBackend.name, BigBlockBackend)

    reg = Registry()
    reg.add_plugin(Plugin(), name="bridge-fakes")
    out = tmp_path / "b.json"
    _bench.main(
        _args("--cases", "decode,mixed", "--backend", "fake-big-blocks", "--no-baselines", "--json", str(out)),
        registry=reg,
    )
    rows = json.loads(out.read_text())["rows"]
    by_label = {(r["case"], r["label"]): r for r in rows}
    for case in ("decode", "mixed"):
        assert by_label[(case, "fake-big-blocks")]["status"].startswith("skip: block_size 16")
        # Checked against the reference of the original placement: K/V moved right, every row.
        bridged = by_label[(case, "fake-big-blocks (bridge)")]
        assert bridged["status"] == "ok" and bridged["plan_ms"] is not None


def test_mla_shaped_heads_run_with_v_of_its_own_head_dim(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("TRITON_INTERPRET", "1")
    out = tmp_path / "b.json"
    argv = [
        "bench",
        "--device",
        "cpu",
        "--backend",
        "reference,triton-unified,sdpa-flash",
        "--cases",
        "decode",
        "--head-dim",
        "64",
        "--head-dim-v",
        "32",
        "--json",
        str(out),
    ]
    assert _cli.main(argv) == 0
    data = json.loads(out.read_text())
    assert data["config"]["head_dim_v"] == 32
    status = {r["backend"]: r["status"] for r in data["rows"]}
    assert status["reference"] == "ok" and status["triton-unified"] == "ok", status
    assert status["sdpa-flash"] == "skip: sdpa-flash needs V of the QK head dim (64), not 32"
    assert "heads x 64 (V 32)" in capsys.readouterr().out


def test_quantized_cases_run_at_the_shapes_of_the_bf16_decode_rows():
    # On a GPU every cache format is timed at the shapes of decode, decode-short and decode-long,
    # so each quantized row has a bf16 row of its shape to be compared with.
    from paged_bench.cases import build_cases

    cfg = dataclasses.replace(
        _config.make_config(_args()), tiny=False, cases=["decode", "decode-short", "decode-long", "decode-kivi4"]
    )
    shapes = {c.id: (c.shape, c.kv_dtype) for c in build_cases(cfg)}
    assert shapes["decode-kivi4"] == (shapes["decode"][0], "kivi4")
    assert shapes["decode-kivi4-short"] == (shapes["decode-short"][0], "kivi4")
    assert shapes["decode-kivi4-long"] == (shapes["decode-long"][0], "kivi4")


def test_cache_formats_are_reported_against_bf16_of_the_same_shape_and_backend():
    from paged_bench.report import format_ratios

    cases = [
        {"id": "decode", "kind": "decode", "kv_dtype": "auto"},
        {"id": "decode-int8", "kind": "decode", "kv_dtype": "int8"},
        {"id": "decode-fp8-static", "kind": "decode", "kv_dtype": "fp8", "kv_scales": "static"},
        {"id": "decode-int8-long", "kind": "decode", "kv_dtype": "int8"},  # no bf16 row of its shape
    ]

    def row(case, shape, label, ms, status="ok"):
        return _rows.Row(case, shape, "decode", "", 0, label, label, True, status=status, ms=ms)

    lines = format_ratios(
        cases,
        [
            row("decode", "64x4096", "a", 0.4),
            row("decode", "64x4096", "b", 0.2),
            row("decode-int8", "64x4096", "a", 0.2),
            row("decode-int8", "64x4096", "b", 0.3),
            row("decode-fp8-static", "64x4096", "a", 0.1),
            row("decode-int8-long", "4x32768", "a", 0.1),
            row("decode-int8", "64x4096", "c", None, status="skip: no"),
        ],
    )
    assert [line.split() for line in lines] == [
        ["int8", "64x4096", "a", "0.500x"],
        ["int8", "64x4096", "b", "1.500x"],
        ["fp8", "static", "64x4096", "a", "0.250x"],
    ]


def _minimal_run() -> dict:
    """The smallest document ``--from-json`` prints: what ``paged bench --json`` writes, one row."""
    cfg = _config.make_config(_args("--cases", "decode"))
    env = {key: 1.0 if key.endswith(("_Bps", "_flops")) else "x" for key in _bench.report.ENV_PRINTED}
    case = {"id": "decode", "kind": "decode", "group": "decode", "shape": "1x64"}
    row = {"case": "decode", "shape": "1x64", "kind": "decode", "group": "decode", "batch": 1}
    row |= {"backend": "reference", "label": "reference", "paged": True, "status": "ok"}
    return {"env": env, "config": cfg.public(), "cases": [case], "rows": [row], "complete": True}


@pytest.mark.parametrize(
    ("change", "needle"),
    [
        (lambda d: d.update(rows=["decode"]), "rows[0] is 'decode'; accepted: a JSON object"),
        (lambda d: d["env"].pop("device_name"), "env has no device_name"),
        (lambda d: d["config"].update(device="gpu9"), "config.device is 'gpu9', not a device name"),
        (lambda d: d["config"].update(dtype="float8"), "config.dtype is 'float8'; accepted: "),
        (lambda d: d.update(cases={}), "'cases' is a dict; accepted: a JSON list"),
        (lambda d: d["rows"][0].pop("label"), "a row lacks a field"),
        (lambda d: d["rows"][0].update(case="prefill"), "rows of cases it does not describe: prefill"),
        (lambda d: d["env"].update(read_bandwidth_Bps="fast"), "the table could not be printed from it"),
        (lambda d: d.clear() or d.update(run=[1]), "'env' is missing; accepted: a JSON object"),
    ],
    ids=["str_rows", "no_device_name", "gpu9", "bad_dtype", "cases_dict", "row_field", "row_case", "env_type", "other"],
)
def test_from_json_names_what_is_wrong_in_a_malformed_run(tmp_path, capsys, change, needle):
    # String rows were an AttributeError, a missing device_name a KeyError and device "gpu9" a
    # RuntimeError, each with a traceback.
    good = tmp_path / "good.json"
    good.write_text(json.dumps(_minimal_run()))
    assert _cli.main(["bench", "--from-json", str(good)]) == 0
    assert "decode" in capsys.readouterr().out
    doc = _minimal_run()
    change(doc)
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps(doc))
    assert _cli.main(["bench", "--from-json", str(bad)]) == 2
    out, err = capsys.readouterr()
    assert err.startswith(f"paged bench: --from-json {bad}: not a run written by paged bench --json (")
    assert needle in err and out == ""


@pytest.mark.parametrize(
    ("argv", "needle"),
    [
        (("--heads", "999999999", "--kv-heads", "1"), "the sizes are too large: the smallest case"),
        (("--rep", "-5"), "--rep is -5; accepted: a positive number of milliseconds"),
        (("--rep", "0"), "--rep is 0; accepted: a positive number of milliseconds"),
        (("--warmup", "-1"), "--warmup is -1; accepted: 0 or more milliseconds"),
    ],
    ids=["huge_heads", "negative_rep", "zero_rep", "negative_warmup"],
)
def test_sizes_and_timings_out_of_range_exit_2(fake_registry, capsys, argv, needle):
    # --heads 999999999 ended in torch's allocator error for every case; --rep -5 was accepted.
    assert _bench.main(_args(*argv), registry=fake_registry) == 2
    err = capsys.readouterr().err
    assert needle in err
    if argv[0] == "--heads":
        assert "--heads 999999999" in err and "GB" in err
