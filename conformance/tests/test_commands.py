"""``paged check`` reaches core's ``paged`` through this distribution's plugin."""

from __future__ import annotations

import argparse
import importlib.metadata
import io
import json
import os
import re
import subprocess
import sys

from broken_backends import BackendsPlugin
from paged_conformance import runner
from paged_core import ReferenceBackend, Registry


def _paged(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PAGED_PLUGINS"}
    return subprocess.run(
        [sys.executable, "-m", "paged_core", *argv], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_plugin_is_an_entry_point_of_the_paged_core_group():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="paged_core")}
    assert eps.get("conformance") == "paged_conformance.commands"


def test_paged_help_lists_check_from_the_plugin():
    proc = _paged("--help")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("    ")}
    assert "run the conformance cases" in lines["check"]
    assert "needs paged-conformance" not in proc.stdout
    # Loading the commands is no problem of any plugin.
    listed = _paged("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [p for p in json.loads(listed.stdout)["problems"] if p["source"] == "conformance"] == []


def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys):
    # A regular file where a folder should be: no folder can be created under it.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    from paged_core._cli import main

    argv = ["check", "--backend", "reference", "--case", "first_token", "--report", f"{blocker}/report"]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and str(blocker) in err, err
    assert blocker.read_text() == ""


class _NotHere(ReferenceBackend):
    name = "not-here"

    @classmethod
    def unavailable(cls) -> list[str]:
        return ["libnothere is not installed (pip install libnothere)"]


def test_progress_counts_from_one_over_the_cases_that_run(cpu):
    """A backend that runs nothing here has one uncounted line first; the counter then counts
    every (backend, case) that runs, from 1 to the total."""
    registry = Registry(group="paged_conformance_tests", env_var="PAGED_CONFORMANCE_TESTS_PLUGINS")
    registry.add_plugin(BackendsPlugin(ReferenceBackend, _NotHere), name="progress")
    stream = io.StringIO()
    matrix = runner.run(
        ["reference", "not-here"],
        case_filter=["first_token", "random_batches"],
        device=cpu,
        registry=registry,
        progress=stream,
    )
    counters = [re.match(r"\[\s*(\S+)/(\d+)\] (\S+)", line).groups() for line in stream.getvalue().splitlines()]
    cases, total = len(matrix.cases), str(len(matrix.cases))
    assert cases >= 2
    assert counters == [("-", total, "not-here")] + [(str(i), total, "reference") for i in range(1, cases + 1)]
    assert list(matrix.backends) == ["reference", "not-here"]  # the columns keep the order asked for


def test_check_takes_backends_as_the_pytest_option_is_spelled():
    parser = argparse.ArgumentParser()
    runner.add_arguments(parser)
    assert parser.parse_args(["--backends", "a,b", "--backend", "c"]).backend == ["a,b", "c"]
