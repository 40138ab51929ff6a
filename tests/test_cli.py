"""``paged list``: table and JSON, problems shown; once end to end through ``python -m paged_core``."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
from paged_core import Registry, _cli

REFERENCE_CAPS = (
    "head_dim any; block any; group any; dtype bfloat16,float16,float32; kv auto,fp8,int8; mixed; "
    "cpu,cuda; window, softcap, sinks, lse, batch-invariant"
)
GOOD_CAPS = "head_dim 16; block 8,16; group any; dtype bfloat16,float16,float32; kv auto; mixed; cpu,cuda"


@pytest.fixture
def cli_registry(fixture_plugins, monkeypatch):
    reg = Registry()
    monkeypatch.setattr(_cli, "registry", reg)
    return reg


def test_list_table(cli_registry, capsys):
    assert _cli.main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    w = len("fixture-missing")
    assert out[:7] == [
        f"{'fixture-good':<{w}}  available    paged-fixture-plugins 0.3.1",
        f"{'':<{w}}  {GOOD_CAPS}",
        f"{'fixture-missing':<{w}}  unavailable  paged-fixture-plugins 0.3.1",
        f"{'':<{w}}  ! importing paged_fixture_good.missing:MissingBackend failed: ModuleNotFoundError: "
        "No module named 'paged_fixture_extra_dependency_that_is_not_installed' "
        "(to fix: pip install paged-fixture-extra)",
        f"{'reference':<{w}}  available    paged-core 0.1.0",
        f"{'':<{w}}  {REFERENCE_CAPS}",
        "",
    ]
    assert out[7] == "Problems (these plugins were skipped; the others work):"
    problems = out[8:]
    assert (
        "  fixture-broken (import): ImportError: paged_fixture_broken needs libfixture.so.3, "
        "which is not installed (simulated)"
    ) in problems
    assert (
        "  fixture-badhook (register_backends): RuntimeError: fixture-badhook exploded while registering"
        in problems
    )
    assert any(
        p.startswith("  fixture-missing (backend): importing paged_fixture_good.missing") for p in problems
    )
    assert len(problems) == 3


def test_list_json(cli_registry, capsys):
    assert _cli.main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    backends = {b["name"]: b for b in data["backends"]}
    assert [b["name"] for b in data["backends"]] == ["fixture-good", "fixture-missing", "reference"]
    assert backends["reference"] == {
        "name": "reference",
        "distribution": "paged-core",
        "version": "0.1.0",
        "priority": -100,
        "available": True,
        "reasons": [],
        "capabilities": REFERENCE_CAPS,
    }
    assert backends["fixture-good"]["capabilities"] == GOOD_CAPS
    missing = backends["fixture-missing"]
    assert missing["available"] is False and missing["capabilities"] is None
    assert missing["reasons"][0].endswith("(to fix: pip install paged-fixture-extra)")
    assert {(p["source"], p["stage"]) for p in data["problems"]} == {
        ("fixture-broken", "import"),
        ("fixture-badhook", "register_backends"),
        ("fixture-missing", "backend"),
    }


def test_list_with_nothing_registered(monkeypatch, capsys):
    monkeypatch.setenv("PAGED_PLUGINS", "no-such-plugin")
    monkeypatch.setattr(_cli, "registry", Registry())
    assert _cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert out.startswith("No backends registered. Install one: pip install 'paged-core[triton]'\n")
    # The name PAGED_PLUGINS gives is no installed plugin: reported, not silently ignored.
    assert "no-such-plugin (PAGED_PLUGINS): PAGED_PLUGINS names 'no-such-plugin'" in out


def test_unknown_command_exits_2(capsys):
    with pytest.raises(SystemExit) as exc:
        _cli.main(["frobnicate"])
    assert exc.value.code == 2
    assert "invalid choice: 'frobnicate'" in capsys.readouterr().err


def test_python_m_paged_core_list(plugin_site):
    env = {
        **os.environ,
        "PAGED_PLUGINS": "reference,fixture-broken",
        "PYTHONPATH": os.pathsep.join([str(plugin_site), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.run(
        [sys.executable, "-m", "paged_core", "list"], capture_output=True, text=True, env=env, timeout=120
    )
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0].split() == ["reference", "available", "paged-core", "0.1.0"]
    assert lines[1].strip() == REFERENCE_CAPS
    assert "Problems (these plugins were skipped; the others work):" in lines
    assert any(line.startswith("  fixture-broken (import): ImportError:") for line in lines)
