"""``paged list``: table and JSON, problems shown; once end to end through ``python -m paged_core``.
Commands from plugins (``register_commands``), and what ``paged`` says when one is missing."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys

import pytest
from paged_core import Registry, _cli, hookimpl

REFERENCE_CAPS = (
    "head_dim any; head_dim_v any; block any; group any; dtype bfloat16,float16,float32; "
    "kv auto,fp8,fp8_e5m2,int4,int8,kivi4 (scales per_head,per_slot,per_tensor); mixed; cpu,cuda; "
    "window, softcap, sinks, lse, device-plan, batch-invariant"
)
#: auto claims what the backends it chooses from claim (an instance: its base's engine features),
#: so its line says that instead of its class's empty claims ("kv auto", no features).
AUTO_CAPS = (
    "runs each batch on the available backend listed here measured fastest for it (paged tune), "
    "else on the registry's first; serves a layer one of them serves, with the first's engine features"
)
GOOD_CAPS = "head_dim 16; block 8,16; group any; dtype bfloat16,float16,float32; kv auto; mixed; cpu,cuda"

#: How every install hint for one of paged's own distributions says where its wheels come from.
WHEELS = " (build dist/ in a clone of paged: python3 -m nox -s wheels)"


#: This project's plugins other than the reference, and what installs each (paged_core's hints).
NOT_INSTALLED = [
    ("triton-unified", f"pip install --find-links dist 'paged-core[triton]'{WHEELS}"),
    ("triton-splitkv", f"pip install --find-links dist 'paged-core[triton]'{WHEELS}"),
    ("flashinfer", f"pip install --find-links dist 'paged-core[flashinfer]'{WHEELS}"),
    ("flash-attn2", f"pip install --find-links dist 'paged-core[flash-attn]'{WHEELS}"),
]


def hide_plugins(monkeypatch, names):
    """Plugins ``names`` uninstalled, as far as the registry can tell: their entry points are gone."""
    real = importlib.metadata.entry_points

    def entry_points(**params):
        eps = real(**params)
        if params.get("group") != "paged_core":
            return eps
        return importlib.metadata.EntryPoints(ep for ep in eps if ep.name not in names)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)


@pytest.fixture
def cli_registry(fixture_plugins, monkeypatch):
    # Which of the project's plugins this environment has installed must not change the table.
    hide_plugins(monkeypatch, [name for name, _ in NOT_INSTALLED])
    reg = Registry()
    monkeypatch.setattr(_cli, "registry", reg)
    return reg


def test_list_table(cli_registry, capsys):
    assert _cli.main(["list"]) == 0
    out = capsys.readouterr().out.splitlines()
    w = len("fixture-missing")
    assert out[:17] == [
        f"{'fixture-good':<{w}}  available      paged-fixture-plugins 0.3.1",
        f"{'':<{w}}  {GOOD_CAPS}",
        f"{'fixture-missing':<{w}}  unavailable    paged-fixture-plugins 0.3.1",
        f"{'':<{w}}  ! importing paged_fixture_good.missing:MissingBackend failed: ModuleNotFoundError: "
        "No module named 'paged_fixture_extra_dependency_that_is_not_installed' "
        "(to fix: pip install paged-fixture-extra)",
        f"{'reference':<{w}}  available      paged-core 0.1.0",
        f"{'':<{w}}  {REFERENCE_CAPS}",
        f"{'auto':<{w}}  available      paged-core 0.1.0",
        f"{'':<{w}}  {AUTO_CAPS}",
        # The project's backends that are not installed: named, with the command that installs each.
        *(
            line
            for name, cmd in NOT_INSTALLED
            for line in (f"{name:<{w}}  not installed", f"{'':<{w}}  ! to install: {cmd}")
        ),
        "",
    ]
    assert out[17] == "Problems (these plugins were skipped; the others work):"
    problems = out[18:]
    assert (
        "  fixture-broken (import): ImportError: paged_fixture_broken needs libfixture.so.3, "
        "which is not installed (simulated)"
    ) in problems
    assert "  fixture-badhook (register_backends): RuntimeError: fixture-badhook exploded while registering" in problems
    assert any(p.startswith("  fixture-missing (backend): importing paged_fixture_good.missing") for p in problems)
    assert len(problems) == 3


def test_list_json(cli_registry, capsys):
    assert _cli.main(["list", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    backends = {b["name"]: b for b in data["backends"]}
    assert [b["name"] for b in data["backends"]] == ["fixture-good", "fixture-missing", "reference", "auto"]
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
    assert backends["auto"]["capabilities"] == AUTO_CAPS
    missing = backends["fixture-missing"]
    assert missing["available"] is False and missing["capabilities"] is None
    assert missing["reasons"][0].endswith("(to fix: pip install paged-fixture-extra)")
    # Added beside "backends", whose rows stay what is registered.
    assert data["not_installed"] == [{"name": name, "install": cmd} for name, cmd in NOT_INSTALLED]
    assert {(p["source"], p["stage"]) for p in data["problems"]} == {
        ("fixture-broken", "import"),
        ("fixture-badhook", "register_backends"),
        ("fixture-missing", "backend"),
    }


def test_not_installed_is_only_what_has_no_entry_point(fixture_plugins, monkeypatch):
    # Left out by PAGED_PLUGINS (pip install would change nothing) or registered some other way
    # is not "not installed"; a plugin whose entry point is gone is.
    hide_plugins(monkeypatch, ["flash-attn2"])
    reg = Registry()

    @hookimpl
    def register_backends(register):
        register("flashinfer", "paged_core:ReferenceBackend")

    reg.add_plugin(type("InProcess", (), {"register_backends": staticmethod(register_backends)}), name="in-process")
    missing = reg.not_installed()
    assert missing["flash-attn2"] == dict(NOT_INSTALLED)["flash-attn2"]
    assert "flashinfer" not in missing and "reference" not in missing
    installed = {ep.name for ep in importlib.metadata.entry_points(group="paged_core")}
    assert ("triton-unified" in missing) == ("triton-unified" not in installed)
    assert not set(missing) & set(reg.left_out())
    # A registry of another entry-point group has backends of its own: none of ours is missing.
    assert Registry(group="paged_cli_tests").not_installed() == {}


def test_list_with_nothing_registered(command_registry, capsys):
    assert _cli.main(["list"]) == 0
    out = capsys.readouterr().out
    assert out == f"No backends registered. Install one: pip install --find-links dist 'paged-core[triton]'{WHEELS}\n"


@pytest.mark.parametrize("value", [" , ", "no-such-plugin"])
def test_list_when_paged_plugins_leaves_every_plugin_out(monkeypatch, capsys, value):
    # Installed but left out: "pip install" would be the wrong advice (registry.get says the same).
    monkeypatch.setenv("PAGED_PLUGINS", value)
    hide_plugins(monkeypatch, [name for name, _ in NOT_INSTALLED])
    monkeypatch.setattr(_cli, "registry", Registry())
    assert _cli.main(["list"]) == 1
    out = capsys.readouterr().out
    assert out.startswith(f"No backends loaded: PAGED_PLUGINS={value!r} leaves out the installed plugins ")
    assert "reference" in out.splitlines()[0]
    assert "To fix: name the plugins to load, such as PAGED_PLUGINS=reference, or unset PAGED_PLUGINS.\n" in out
    # pip install is advised for the backends that are missing only, not for what is left out.
    assert "No backends registered" not in out
    assert [line.split()[0] for line in out.splitlines() if "pip install" in line or "not installed" in line] == [
        word for name, _ in NOT_INSTALLED for word in (name, "!")
    ]
    if value == "no-such-plugin":
        # The name PAGED_PLUGINS gives is no installed plugin: reported, not silently ignored.
        assert "no-such-plugin (PAGED_PLUGINS): PAGED_PLUGINS names 'no-such-plugin'" in out
    assert _cli.main(["list", "--json"]) == 1
    data = json.loads(capsys.readouterr().out)
    assert data["backends"] == [] and "reference" in data["left_out"]


def test_version_names_core_then_every_installed_paged_distribution(cli_registry, capsys):
    import importlib.metadata

    import paged_core

    with pytest.raises(SystemExit) as exit:
        _cli.main(["--version"])
    assert exit.value.code == 0
    rows = [line.split() for line in capsys.readouterr().out.splitlines()]
    assert rows[0] == ["paged-core", paged_core.__version__]
    listed = dict(rows[1:])
    assert listed["paged-fixture-plugins"] == "0.3.1"  # installed on sys.path like any plugin
    assert listed["paged-conformance"] == importlib.metadata.version("paged-conformance")
    assert list(listed) == sorted(listed) and "paged-core" not in listed


def test_version_lists_a_third_party_plugin_by_its_entry_points(monkeypatch):
    import importlib.metadata
    from types import SimpleNamespace

    def dist(name, version, *groups):
        eps = [importlib.metadata.EntryPoint(name="x", value="x", group=g) for g in groups]
        return SimpleNamespace(metadata={"Name": name}, version=version, entry_points=eps)

    fakes = [
        dist("acme-attention", "2.0", "paged_core"),
        dist("numpy", "2.1", "console_scripts"),
        dist("paged_extra", "0.9"),
        dist("paged-core", "9.9", "paged_core"),
    ]
    monkeypatch.setattr(_cli.importlib.metadata, "distributions", lambda: fakes)
    import paged_core

    assert _cli.versions() == [
        ("paged-core", paged_core.__version__),
        ("acme-attention", "2.0"),
        ("paged_extra", "0.9"),
    ]


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


# ------------------------------------------------------------------------ commands from plugins
class _Commands:
    """A plugin adding ``hello`` (and, when asked, a command that breaks while registering)."""

    def __init__(self, name="hello", *, fail=False, half=False):
        self.name, self.fail, self.half = name, fail, half

    @hookimpl
    def register_commands(self, subparsers):
        if self.fail:
            raise RuntimeError(f"{self.name} cannot register")
        p = subparsers.add_parser(self.name, help="say hello")
        p.add_argument("--to", default="world")
        if self.half:  # added, then raised before set_defaults
            raise ValueError("half-registered")
        p.set_defaults(func=lambda args: print(f"hello {args.to}") or 0)


@pytest.fixture
def command_registry(monkeypatch):
    """A registry with no entry points (a group no distribution declares) for the CLI to use."""
    reg = Registry(group="paged_cli_tests", env_var="PAGED_CLI_TESTS_PLUGINS")
    monkeypatch.setattr(_cli, "registry", reg)
    return reg


def test_a_plugin_command_runs(command_registry, capsys):
    command_registry.add_plugin(_Commands(), name="greeter")
    assert _cli.main(["hello", "--to", "paged"]) == 0
    assert capsys.readouterr().out == "hello paged\n"


def test_a_plugin_whose_register_commands_fails_is_a_problem_not_a_crash(command_registry, capsys):
    command_registry.add_plugin(_Commands("broken", fail=True), name="broken-commands")
    command_registry.add_plugin(_Commands(), name="greeter")
    assert _cli.main(["hello"]) == 0  # the other plugin's command still works
    assert _cli.main(["list", "--json"]) == 0
    out = capsys.readouterr().out
    problems = json.loads(out[out.index("{") :])["problems"]
    # Recorded once, although the parser was built twice.
    assert problems == [
        {"source": "broken-commands", "stage": "register_commands", "message": "RuntimeError: broken cannot register"}
    ]
    assert _cli.main(["list"]) == 0
    assert "  broken-commands (register_commands): RuntimeError: broken cannot register" in (
        capsys.readouterr().out.splitlines()
    )


def test_a_half_registered_command_exits_2_with_the_problem(command_registry, capsys):
    command_registry.add_plugin(_Commands("half", half=True), name="half-commands")
    with pytest.raises(SystemExit) as exc:
        _cli.main(["half"])
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert (
        "paged: error: 'half' did not finish registering: half-commands (register_commands): "
        "ValueError: half-registered" in err
    )


@pytest.mark.parametrize("command, dist", [("check", "paged-conformance"), ("bench", "paged-bench")])
def test_a_missing_command_says_what_to_install(command_registry, monkeypatch, capsys, command, dist):
    monkeypatch.setattr(_cli, "_installed", lambda dist: None)
    with pytest.raises(SystemExit) as exc:
        _cli.main([command, "--backend", "reference", "--help"])  # its options do not matter
    assert exc.value.code == 2
    err = capsys.readouterr().err
    assert err.startswith("usage: paged")
    assert err.endswith(
        f"paged: error: '{command}' is provided by {dist}, which is not installed. "
        f"To fix: pip install --find-links dist {dist}{WHEELS}\n"
    )
    # ... and `paged --help` names it with the same advice.
    with pytest.raises(SystemExit):
        _cli.main(["--help"])
    # argparse wraps the help text (at spaces and after hyphens): compare without whitespace.
    want = f"(needs {dist}: pip install --find-links dist {dist}{WHEELS})"
    assert "".join(want.split()) in "".join(capsys.readouterr().out.split())


def test_a_command_whose_plugin_is_left_out_says_so(command_registry, monkeypatch, capsys):
    monkeypatch.setattr(_cli, "_installed", lambda dist: ("0.1.0", ["conformance"]))
    monkeypatch.setenv("PAGED_CLI_TESTS_PLUGINS", "reference")
    with pytest.raises(SystemExit):
        _cli.main(["check"])
    assert (
        "'check' is provided by paged-conformance 0.1.0, whose plugin 'conformance' "
        "PAGED_CLI_TESTS_PLUGINS='reference' leaves out. To fix: add conformance to "
        "PAGED_CLI_TESTS_PLUGINS, or unset PAGED_CLI_TESTS_PLUGINS"
    ) in capsys.readouterr().err


def test_a_command_whose_plugin_failed_names_the_failure(command_registry, monkeypatch, capsys):
    monkeypatch.setattr(_cli, "_installed", lambda dist: ("0.1.0", ["bench"]))
    command_registry.add_plugin(_Commands("bench", fail=True), name="bench")
    with pytest.raises(SystemExit):
        _cli.main(["bench"])
    assert (
        "'bench' is provided by paged-bench 0.1.0, but its plugin failed: bench "
        "(register_commands): RuntimeError: bench cannot register"
    ) in capsys.readouterr().err


def test_a_command_an_installed_plugin_does_not_register(command_registry, monkeypatch, capsys):
    monkeypatch.setattr(_cli, "_installed", lambda dist: ("0.0.9", []))  # an install from before the hook
    with pytest.raises(SystemExit):
        _cli.main(["check"])
    assert (
        "'check' is provided by paged-conformance, but the installed paged-conformance 0.0.9 registers "
        f"no 'check' command. To fix: pip install --find-links dist --force-reinstall paged-conformance{WHEELS}"
    ) in (capsys.readouterr().err)
