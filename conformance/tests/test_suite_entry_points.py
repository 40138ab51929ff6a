"""The three ways in (pytest plugin, runner / ``paged check``) reach the same verdict and report it."""

from __future__ import annotations

import json

import broken_backends as bb
import pytest
from paged_conformance import runner
from paged_core import KV_DTYPES, Capabilities, ReferenceBackend, Registry
from paged_core._cli import main as paged_main
from paged_core.hookspecs import hookimpl

SELECTION = ["sliding_window", "first_token", "padding_rows"]


def test_pytest_and_runner_agree_on_broken_backends(pytester, use_registry):
    backends = "reference,window-ignored,padding-nan,padding-slots-written"
    result = pytester.runpytest_inprocess(
        "--pyargs",
        "paged_conformance",
        "--backends",
        backends,
        "-p",
        "no:cacheprovider",
        "-k",
        " or ".join(SELECTION),
    )
    result.stdout.fnmatch_lines(
        [
            "*paged conformance matrix*",
            "*FAILED*test_matches_reference[[]window-ignored-sliding_window[]]*",
            "*FAILED*test_matches_reference[[]padding-nan-padding_rows[]]*",
            "*FAILED*test_write_then_read[[]padding-slots-written-padding_rows[]]*",
            "*FAILED*test_layers_share_a_plan[[]padding-nan-padding_rows[]]*",
        ]
    )
    outcomes = result.parseoutcomes()
    # window-ignored: output and LSE on both windowed cases; padding-nan: output, LSE and the
    # layers check on padding_rows; padding-slots-written: the write check on padding_rows.
    assert outcomes["failed"] == 8
    report = json.loads((pytester.path / "conformance-report.json").read_text())
    assert (pytester.path / "conformance-report.md").exists()
    by_pytest = {(b, c): cell["status"] for b, cells in report["matrix"].items() for c, cell in cells.items()}

    matrix = runner.run(backends.split(","), case_filter=SELECTION, progress=False)
    by_runner = {(b, c): matrix.cell(b, c).status for b in matrix.backends for c in matrix.cases}
    assert by_pytest == by_runner
    assert by_runner[("reference", "sliding_window")] == "pass"
    assert by_runner[("window-ignored", "sliding_window")] == "fail"
    assert by_runner[("window-ignored", "first_token")] == "pass"


def test_unavailable_backend_is_skipped_with_its_reason(pytester, use_registry):
    class NeedsGpu(ReferenceBackend):
        name = "needs-gpu"

        @classmethod
        def unavailable(cls) -> list[str]:
            return ["needs a CUDA GPU (run on a machine with one)"]

    use_registry.add_plugin(bb.BackendsPlugin(NeedsGpu), name="needs-gpu")
    result = pytester.runpytest_inprocess(
        "--pyargs",
        "paged_conformance",
        "--backends",
        "needs-gpu",
        "-p",
        "no:cacheprovider",
        "-rs",
        "-k",
        "first_token or random",
    )
    result.assert_outcomes(skipped=5)
    result.stdout.fnmatch_lines(["*SKIPPED*needs a CUDA GPU (run on a machine with one)*"])


def test_skip_reason_comes_from_the_backend(pytester, use_registry):
    class NoWindow(bb.Wrapping):
        name = "no-window"
        capabilities = Capabilities(kv_dtypes=frozenset(KV_DTYPES), sinks=True, softcap=True)

    use_registry.add_plugin(bb.BackendsPlugin(NoWindow), name="no-window")
    result = pytester.runpytest_inprocess(
        "--pyargs",
        "paged_conformance",
        "--backends",
        "no-window",
        "-p",
        "no:cacheprovider",
        "-rs",
        "-k",
        "test_matches_reference and (sliding_window or g4)",
    )
    result.stdout.fnmatch_lines(["*SKIPPED*sliding window attention is not supported*"])
    report = json.loads((pytester.path / "conformance-report.json").read_text())
    assert report["matrix"]["no-window"]["sliding_window"] == {
        "status": "skip",
        "detail": "sliding window attention is not supported",
    }
    assert report["matrix"]["no-window"]["mixed_prefill_and_decode-g4"]["status"] == "pass"


def test_report_path_option(pytester, use_registry):
    result = pytester.runpytest_inprocess(
        "--pyargs",
        "paged_conformance",
        "--backends",
        "reference",
        "--paged-report",
        "out/matrix",
        "-p",
        "no:cacheprovider",
        "-k",
        "first_token",
    )
    result.assert_outcomes(passed=4)
    assert json.loads((pytester.path / "out" / "matrix.json").read_text())["passed"] is True


def test_explicit_plugin_flag_does_not_register_twice(pytester):
    """``-p paged_conformance.plugin`` (noxfile.py's spelling) next to the pytest11 entry point."""
    result = pytester.runpytest_subprocess(
        "--pyargs",
        "paged_conformance",
        "-p",
        "paged_conformance.plugin",
        "--backends",
        "reference",
        "-k",
        "first_token",
        "-p",
        "no:cacheprovider",
    )
    result.assert_outcomes(passed=4)


def test_other_test_suites_are_left_alone(pytester):
    pytester.makepyfile("def test_plain():\n    assert True\n")
    result = pytester.runpytest_inprocess("-p", "no:cacheprovider")
    result.assert_outcomes(passed=1)
    assert not (pytester.path / "conformance-report.md").exists()


def test_paged_check_prints_the_table_and_exits_zero(use_registry, tmp_path, capsys):
    report = tmp_path / "r"
    rc = paged_main(["check", "--backend", "reference", "--case", "first_token", "--report", str(report)])
    out, err = capsys.readouterr()
    assert rc == 0
    assert "reference        first_token" in err  # progress, one line per backend/case
    assert "first_token  pass" in out
    matrix = json.loads((tmp_path / "r.json").read_text())["matrix"]
    assert matrix["reference"]["first_token"]["status"] == "pass"


def test_paged_check_exits_one_on_a_failure(use_registry, tmp_path, capsys):
    rc = paged_main(
        ["check", "--backend", "reference,window-ignored", "--case", "sliding_window", "--report", str(tmp_path / "r")]
    )
    out, _ = capsys.readouterr()
    assert rc == 1
    assert "FAIL 1.2e+00 [1]" in out
    report = (tmp_path / "r.md").read_text()
    assert "[window-ignored/sliding_window] output differs from the float64 reference" in report


def test_paged_check_json(use_registry, tmp_path, capsys):
    rc = paged_main(
        ["check", "--backend", "reference", "--case", "first_token", "--json", "--report", str(tmp_path / "r")]
    )
    assert rc == 0
    assert json.loads(capsys.readouterr().out)["passed"] is True


def test_paged_check_unknown_backend(use_registry, capsys):
    assert paged_main(["check", "--backend", "nope"]) == 2
    assert "Unknown backend 'nope'" in capsys.readouterr().err


def test_paged_check_case_that_matches_nothing_is_a_usage_error(use_registry, tmp_path, capsys):
    # It used to print an empty table and exit 0 (or crash with an IndexError when the first
    # backend was unavailable): a typo must not look like a passing run.
    for backends in (["--backend", "reference"], []):
        rc = paged_main(["check", *backends, "--case", "padding_rowz", "--report", str(tmp_path / "r")])
        err = capsys.readouterr().err
        assert rc == 2
        assert "no case id contains 'padding_rowz'" in err and "padding_rows" in err
    assert not (tmp_path / "r.md").exists()


def test_backend_without_options_skips_split_cases_with_a_reason(use_registry):
    matrix = runner.run(["reference"], case_filter=["split_3"], progress=False)
    cell = matrix.cell("reference", "split_3")
    assert cell.status == "skip"
    assert cell.detail == "reference takes no option 'num_splits' (its options: compute_dtype, validate)"


def test_paged_check_merge_resumed_runs(use_registry, tmp_path, capsys):
    """Runs split across machines or interrupted ones merge into one report; for a cell checked
    in several, the later report wins (a re-run after a fix replaces the failure)."""
    first, second, merged = tmp_path / "first", tmp_path / "second", tmp_path / "merged"
    assert (
        paged_main(
            ["check", "--backend", "reference,window-ignored", "--case", "sliding_window", "--report", str(first)]
        )
        == 1
    )
    assert (
        paged_main(
            [
                "check",
                "--backend",
                "reference",
                "--case",
                "first_token",
                "--case",
                "sliding_window",
                "--report",
                str(second),
            ]
        )
        == 0
    )
    capsys.readouterr()
    assert paged_main(["check", "--merge", f"{first}.json", f"{second}.json", "--report", str(merged)]) == 1
    data = json.loads((tmp_path / "merged.json").read_text())
    assert {c: v["status"] for c, v in data["matrix"]["reference"].items()} == {
        "first_token": "pass",
        "sliding_window": "pass",
        "sliding_window-decode_only": "pass",
    }
    assert data["matrix"]["window-ignored"]["sliding_window"]["status"] == "fail"
    # The case table's order, not the order the files listed the cases in.
    assert list(data["matrix"]["reference"]) == ["first_token", "sliding_window", "sliding_window-decode_only"]

    # The later file wins: a passing re-run of the failed cell replaces the failure.
    fixed = json.loads((tmp_path / "first.json").read_text())
    for r in fixed["results"]:
        r["status"], r["message"] = "pass", ""
    (tmp_path / "fixed.json").write_text(json.dumps(fixed))
    assert paged_main(["check", "--merge", f"{first}.json", str(tmp_path / "fixed.json"), "--report", str(merged)]) == 0
    assert paged_main(["check", "--merge", str(tmp_path / "fixed.json"), f"{first}.json", "--report", str(merged)]) == 1


def test_paged_check_merge_refuses_what_it_cannot_merge(use_registry, tmp_path, capsys):
    small = tmp_path / "small"
    assert paged_main(["check", "--backend", "reference", "--case", "first_token", "--report", str(small)]) == 0
    full = json.loads((tmp_path / "small.json").read_text())
    full["size"] = "full"
    (tmp_path / "full.json").write_text(json.dumps(full))
    (tmp_path / "junk.json").write_text("not json")
    capsys.readouterr()
    assert paged_main(["check", "--merge", f"{small}.json", str(tmp_path / "full.json")]) == 2
    assert "cannot merge runs of different size/device" in capsys.readouterr().err
    assert paged_main(["check", "--merge", str(tmp_path / "junk.json")]) == 2
    assert "junk.json is not a readable conformance report" in capsys.readouterr().err
    assert paged_main(["check", "--merge", str(tmp_path / "missing.json")]) == 2
    assert "missing.json is not a readable conformance report" in capsys.readouterr().err


def test_a_cell_where_not_every_check_ran_says_so(use_registry, tmp_path, capsys):
    """An interrupted run must not look complete: a cell whose checks did not all run says how
    many did, also after a merge."""
    report = tmp_path / "r"
    assert paged_main(["check", "--backend", "reference", "--case", "first_token", "--report", str(report)]) == 0
    data = json.loads((tmp_path / "r.json").read_text())
    n = data["expected_checks"]["first_token"]
    assert n >= 3 and "first_token  pass\n" in capsys.readouterr().out
    data["results"] = [r for r in data["results"] if r["check"] != "write_then_read"]  # "interrupted"
    del data["expected_checks"]  # as in a report from before the field existed
    (tmp_path / "cut.json").write_text(json.dumps(data))
    assert paged_main(["check", "--merge", str(tmp_path / "cut.json"), "--report", str(tmp_path / "m")]) == 0
    assert f"first_token  pass ({n - 1}/{n} checks)" in capsys.readouterr().out


def test_reports_from_before_the_block_size_field_still_say_where_a_case_ran():
    """The H200 reports of 2026-11-29 said a rebased cell's block size only in the note."""
    from paged_conformance.report import Matrix

    legacy = {
        "size": "full",
        "device": "cuda",
        "backends": {"fa": {"available": True, "reasons": []}},
        "results": [
            {
                "backend": "fa",
                "case": "softcap",
                "check": "matches_reference",
                "status": "pass",
                "message": "at block_size 256 (fa does not take blocks of 16)",
                "max_error": 1e-3,
                "seconds": 1.0,
            }
        ],
    }
    matrix = Matrix.from_json(legacy)
    assert matrix.outcomes[0].block_size == 256
    assert "| `softcap` | pass (block 256) |" in matrix.to_markdown()


class _UnimportablePlugin:
    """Registers a backend whose module cannot be imported (as the Triton plugins' kernels
    cannot when the interpreter's numpy is missing)."""

    @hookimpl
    def register_backends(self, register):
        register(
            "cannot-import",
            "paged_conformance_tests_no_such_module.backend:Backend",
            install="pip install paged-cannot-import",
        )


def _only_reference_and_unimportable(monkeypatch) -> Registry:
    import paged_conformance.backends

    registry = Registry(group="paged_conformance_tests", env_var="PAGED_CONFORMANCE_TESTS_PLUGINS")
    registry.add_plugin(bb.BackendsPlugin(ReferenceBackend), name="reference-only")
    registry.add_plugin(_UnimportablePlugin(), name="cannot-import")
    monkeypatch.setattr(paged_conformance.backends, "default_registry", registry)
    monkeypatch.delenv("PAGED_BACKENDS", raising=False)
    return registry


def test_a_named_backend_that_cannot_be_imported_fails_the_run(pytester, monkeypatch):
    """It used to be skipped everywhere: 0 failed, exit 0, "passed": true."""
    _only_reference_and_unimportable(monkeypatch)
    result = pytester.runpytest_inprocess(
        "--pyargs",
        "paged_conformance",
        "--backends",
        "cannot-import",
        "-p",
        "no:cacheprovider",
        "-k",
        "first_token or random",
    )
    outcomes = result.parseoutcomes()
    assert outcomes.get("failed", 0) == 5 and "skipped" not in outcomes and "passed" not in outcomes
    assert result.ret == pytest.ExitCode.TESTS_FAILED
    result.stdout.fnmatch_lines(
        [
            "*[[]cannot-import/first_token[]] cannot-import was asked for by name*cannot be loaded*"
            "ModuleNotFoundError: No module named 'paged_conformance_tests_no_such_module'*"
            "pip install paged-cannot-import*",
        ]
    )
    report = json.loads((pytester.path / "conformance-report.json").read_text())
    assert report["passed"] is False
    assert report["matrix"]["cannot-import"]["first_token"]["status"] == "fail"


def test_a_discovered_backend_that_cannot_be_imported_is_skipped_with_the_import_error(pytester, monkeypatch):
    """Not asked for: nothing to prove here, so a skip, but one that says why and what to install."""
    _only_reference_and_unimportable(monkeypatch)
    result = pytester.runpytest_inprocess(
        "--pyargs", "paged_conformance", "-p", "no:cacheprovider", "-rs", "-k", "test_matches_reference and first_token"
    )
    result.assert_outcomes(passed=1, skipped=1)
    result.stdout.fnmatch_lines(
        ["*SKIPPED*No module named 'paged_conformance_tests_no_such_module'*pip install paged-cannot-import*"]
    )


def test_paged_check_fails_on_a_named_backend_that_cannot_be_imported(monkeypatch, tmp_path, capsys):
    _only_reference_and_unimportable(monkeypatch)
    rc = paged_main(
        ["check", "--backend", "cannot-import", "--case", "first_token", "--json", "--report", str(tmp_path / "r")]
    )
    data = json.loads(capsys.readouterr().out)
    assert rc == 1
    assert data["passed"] is False
    cell = data["matrix"]["cannot-import"]["first_token"]
    assert cell["status"] == "fail"
    message = next(r["message"] for r in data["results"] if r["backend"] == "cannot-import")
    assert "cannot-import was asked for by name" in message
    assert "No module named 'paged_conformance_tests_no_such_module'" in message
    assert "pip install paged-cannot-import" in message
    # Discovered rather than named: skipped with the same reason, and the run passes.
    assert paged_main(["check", "--case", "first_token", "--report", str(tmp_path / "s")]) == 0
    skipped = json.loads((tmp_path / "s.json").read_text())["matrix"]["cannot-import"]["first_token"]
    assert skipped["status"] == "skip" and "No module named" in skipped["detail"]


def test_paged_list_says_why_a_backend_cannot_be_imported(monkeypatch, capsys):
    registry = _only_reference_and_unimportable(monkeypatch)
    reasons = registry.unavailable("cannot-import")
    assert len(reasons) == 1
    assert "ModuleNotFoundError: No module named 'paged_conformance_tests_no_such_module'" in reasons[0]
    assert "pip install paged-cannot-import" in reasons[0]
    import paged_core._cli

    monkeypatch.setattr(paged_core._cli, "registry", registry)
    assert paged_main(["list", "--json"]) == 0
    row = next(r for r in json.loads(capsys.readouterr().out)["backends"] if r["name"] == "cannot-import")
    assert row["available"] is False and row["reasons"] == reasons
    assert paged_main(["list"]) == 0
    out = capsys.readouterr().out
    assert "cannot-import  unavailable" in out
    assert "No module named 'paged_conformance_tests_no_such_module'" in out
