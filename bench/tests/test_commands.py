"""``paged bench`` reaches core's ``paged`` through this distribution's plugin."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest


def _paged(*argv: str) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if k != "PAGED_PLUGINS"}
    return subprocess.run(
        [sys.executable, "-m", "paged_core", *argv], capture_output=True, text=True, env=env, timeout=300
    )


def test_the_plugin_is_an_entry_point_of_the_paged_core_group():
    eps = {ep.name: ep.value for ep in importlib.metadata.entry_points(group="paged_core")}
    assert eps.get("bench") == "paged_bench.commands"
    # paged-conformance no longer adds `paged bench`: one command, one provider.
    dist = importlib.metadata.distribution("paged-conformance")
    assert "paged_bench" not in " ".join(ep.value for ep in dist.entry_points)


def test_paged_help_lists_bench_from_the_plugin():
    proc = _paged("--help")
    assert proc.returncode == 0, proc.stderr
    lines = {line.split()[0]: line for line in proc.stdout.splitlines() if line.startswith("    ")}
    assert "bandwidth floor" in lines["bench"]
    assert "needs paged-bench" not in proc.stdout
    # Loading the command is no problem of any plugin.
    listed = _paged("list", "--json")
    assert listed.returncode == 0, listed.stderr
    assert [p for p in json.loads(listed.stdout)["problems"] if p["source"] == "bench"] == []


def test_paged_bench_help_keeps_its_options():
    proc = _paged("bench", "--help")
    assert proc.returncode == 0, proc.stderr
    for option in (
        "--backend",
        "--cases",
        "--heads",
        "--kv-heads",
        "--head-dim",
        "--block-size",
        "--dtype",
        "--sweep-len",
        "--sweep-batches",
        "--json",
        "--plot",
        "--from-json",
        "--quick",
        "--device",
        "--warmup",
        "--rep",
        "--no-cuda-graph",
        "--no-baselines",
        "--seed",
    ):
        assert option in proc.stdout, option


@pytest.mark.parametrize(
    "option, name", [("--json", "bench.json"), ("--plot", "bench.png")], ids=["bench-json", "bench-plot"]
)
def test_an_output_path_that_cannot_be_written_is_refused_before_the_run(tmp_path, capsys, option, name):
    # A regular file where a folder should be: no folder can be created under it.
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    from paged_core._cli import main

    assert main(["bench", "--backend", "reference", "--cases", "decode", option, f"{blocker}/{name}"]) == 2
    err = capsys.readouterr().err
    assert "cannot be written" in err and str(blocker) in err, err
    assert blocker.read_text() == ""
