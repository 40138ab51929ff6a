"""The workspace's distributions fit together: extras name real plugins at their versions."""

from __future__ import annotations

import pathlib
import re

import pytest

tomllib = pytest.importorskip("tomllib", reason="tomllib is in the standard library from Python 3.11")

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _project(path: pathlib.Path) -> dict:
    return tomllib.loads(path.read_text())["project"]


def _plugins() -> dict[str, dict]:
    return {p.parent.name: _project(p) for p in sorted((ROOT / "plugins").glob("*/pyproject.toml"))}


def test_every_extra_names_an_existing_plugin_at_its_version():
    core = _project(ROOT / "core" / "pyproject.toml")
    # Extras name plugins, integrations (paged-core[transformers]) and the bench (paged-core[bench]).
    integrations = [_project(p) for p in sorted((ROOT / "integrations").glob("*/pyproject.toml"))]
    bench = _project(ROOT / "bench" / "pyproject.toml")
    versions = {proj["name"]: proj["version"] for proj in [*_plugins().values(), *integrations, bench]}
    for extra, reqs in core["optional-dependencies"].items():
        for req in reqs:
            name, _, _, pin = re.match(r"([A-Za-z0-9_.-]+)(\[[^\]]*\])?\s*(==\s*(\S+))?", req).groups()
            if not name.startswith("paged-"):
                continue
            assert name in versions, f"extra {extra!r} names {name}, which is not a plugin of this repo"
            assert pin == versions[name], f"extra {extra!r} pins {name}=={pin}, the plugin is {versions[name]}"


# Distributions under plugins/ that register no backend: the runtime the Triton plugins share.
RUNTIMES = {"triton-common"}


def test_the_triton_runtime_registers_nothing_and_both_triton_plugins_need_it():
    plugins = _plugins()
    for folder in RUNTIMES:
        assert "paged_core" not in plugins[folder].get("entry-points", {}), f"{folder} must register no backend"
    for folder in ("triton-unified", "triton-splitkv"):
        needs = {re.split(r"[=<> ]", r)[0] for r in plugins[folder]["dependencies"]}
        assert "paged-triton-common" in needs, folder


def test_every_plugin_is_in_the_all_extra_and_registers_its_folder_name():
    core = _project(ROOT / "core" / "pyproject.toml")
    all_extra = {re.split(r"[=<> ]", r)[0] for r in core["optional-dependencies"]["all"]}
    for folder, proj in _plugins().items():
        if folder in RUNTIMES:
            continue
        assert proj["name"] == f"paged-{folder}", "folder, distribution suffix and registry key are one word"
        assert proj["name"] in all_extra
        assert folder in proj["entry-points"]["paged_core"], f"{proj['name']} registers no {folder!r} entry point"
        assert f"paged-core=={_project(ROOT / 'core' / 'pyproject.toml')['version']}" in proj["dependencies"]
