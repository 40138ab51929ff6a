"""The three ways in (pytest plugin, runner / ``paged check``) reach the same verdict and report it."""

from __future__ import annotations

import json

import broken_backends as bb
from paged_conformance import runner
from paged_core import KV_DTYPES, Capabilities, ReferenceBackend
from paged_core._cli import main as paged_main

SELECTION = ["sliding_window", "first_token", "padding_rows"]


def test_pytest_and_runner_agree_on_broken_backends(pytester, use_registry):
    backends = "reference,window-ignored,padding-nan,padding-slots-written"
    result = pytester.runpytest_inprocess(
        "--pyargs", "paged_conformance", "--backends", backends, "-p", "no:cacheprovider",
        "-k", " or ".join(SELECTION),
    )
    result.stdout.fnmatch_lines([
        "*paged conformance matrix*",
        "*FAILED*test_matches_reference[[]window-ignored-sliding_window[]]*",
        "*FAILED*test_matches_reference[[]padding-nan-padding_rows[]]*",
        "*FAILED*test_write_then_read[[]padding-slots-written-padding_rows[]]*",
    ])
    outcomes = result.parseoutcomes()
    # window-ignored: output and LSE on both windowed cases; padding-nan: output and LSE on
    # padding_rows; padding-slots-written: the write check on padding_rows.
    assert outcomes["failed"] == 7
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
    result = pytester.runpytest_inprocess("--pyargs", "paged_conformance", "--backends", "needs-gpu",
                                          "-p", "no:cacheprovider", "-rs", "-k", "first_token or random")
    result.assert_outcomes(skipped=5)
    result.stdout.fnmatch_lines(["*SKIPPED*needs a CUDA GPU (run on a machine with one)*"])


def test_skip_reason_comes_from_the_backend(pytester, use_registry):
    class NoWindow(bb.Wrapping):
        name = "no-window"
        capabilities = Capabilities(kv_dtypes=frozenset(KV_DTYPES), sinks=True, softcap=True)

    use_registry.add_plugin(bb.BackendsPlugin(NoWindow), name="no-window")
    result = pytester.runpytest_inprocess("--pyargs", "paged_conformance", "--backends", "no-window",
                                          "-p", "no:cacheprovider", "-rs",
                                          "-k", "test_matches_reference and (sliding_window or g4)")
    result.stdout.fnmatch_lines(["*SKIPPED*sliding window attention is not supported*"])
    report = json.loads((pytester.path / "conformance-report.json").read_text())
    assert report["matrix"]["no-window"]["sliding_window"] == {
        "status": "skip", "detail": "sliding window attention is not supported"}
    assert report["matrix"]["no-window"]["mixed_prefill_and_decode-g4"]["status"] == "pass"


def test_report_path_option(pytester, use_registry):
    result = pytester.runpytest_inprocess("--pyargs", "paged_conformance", "--backends", "reference",
                                          "--paged-report", "out/matrix", "-p", "no:cacheprovider",
                                          "-k", "first_token")
    result.assert_outcomes(passed=4)
    assert json.loads((pytester.path / "out" / "matrix.json").read_text())["passed"] is True


def test_explicit_plugin_flag_does_not_register_twice(pytester):
    """``-p paged_conformance.plugin`` (noxfile.py's spelling) next to the pytest11 entry point."""
    result = pytester.runpytest_subprocess(
        "--pyargs", "paged_conformance", "-p", "paged_conformance.plugin", "--backends", "reference",
        "-k", "first_token", "-p", "no:cacheprovider",
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
    rc = paged_main(["check", "--backend", "reference,window-ignored", "--case", "sliding_window",
                     "--report", str(tmp_path / "r")])
    out, _ = capsys.readouterr()
    assert rc == 1
    assert "FAIL 1.2e+00 [1]" in out
    report = (tmp_path / "r.md").read_text()
    assert "[window-ignored/sliding_window] output differs from the float64 reference" in report


def test_paged_check_json(use_registry, tmp_path, capsys):
    rc = paged_main(["check", "--backend", "reference", "--case", "first_token", "--json",
                     "--report", str(tmp_path / "r")])
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
