"""The workspace's distributions fit together: one version each, read from one place; every pin
between them names that version; extras name real plugins; triton is required in one place,
bounded above."""

from __future__ import annotations

import ast
import pathlib
import re
import tomllib

ROOT = pathlib.Path(__file__).resolve().parents[1]
DISTRIBUTIONS = sorted(
    p.parent
    for pattern in ("core", "conformance", "bench", "plugins/*", "integrations/*")
    for p in ROOT.glob(f"{pattern}/pyproject.toml")
)
# name, extras, the rest (version specifiers and markers)
REQUIREMENT = re.compile(r"\s*([A-Za-z0-9_.-]+)\s*(\[[^\]]*\])?\s*(.*)")


def _pyproject(folder: pathlib.Path) -> dict:
    return tomllib.loads((folder / "pyproject.toml").read_text())


def _package(folder: pathlib.Path) -> str:
    (package,) = [p.name for p in (folder / "src").iterdir() if (p / "__init__.py").exists()]
    return package


def _literal(path: pathlib.Path, name: str):
    """The value of module-level ``name = <literal>`` in ``path``, read without importing it."""
    for node in ast.parse(path.read_text()).body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"{path} assigns no {name}")


def _versions() -> dict[str, str]:
    """Distribution name -> its version (``__version__`` of its package)."""
    return {
        _pyproject(d)["project"]["name"]: _literal(d / "src" / _package(d) / "__init__.py", "__version__")
        for d in DISTRIBUTIONS
    }


def _requirements(project: dict) -> list[tuple[str, str]]:
    """(where, requirement) for every dependency and extra of ``project``."""
    out = [("dependencies", r) for r in project.get("dependencies", [])]
    for extra, reqs in project.get("optional-dependencies", {}).items():
        out += [(f"extra {extra!r}", r) for r in reqs]
    return out


def test_every_distribution_is_found():
    names = {_pyproject(d)["project"]["name"] for d in DISTRIBUTIONS}
    assert {
        "paged-core",
        "paged-conformance",
        "paged-bench",
        "paged-triton-common",
        "paged-triton-unified",
        "paged-transformers",
        "paged-vllm",
    } <= names


def test_each_version_is_written_once_in_the_package():
    for d in DISTRIBUTIONS:
        data = _pyproject(d)
        assert "version" not in data["project"], f"{d.name}/pyproject.toml writes a version: read it from __version__"
        assert data["project"].get("dynamic") == ["version"], d
        attr = data["tool"]["setuptools"]["dynamic"]["version"]["attr"]
        assert attr == f"{_package(d)}.__version__", f"{d.name} reads its version from {attr}"
        assert re.fullmatch(r"\d+\.\d+\.\d+", _literal(d / "src" / _package(d) / "__init__.py", "__version__"))


def test_every_pin_between_distributions_names_the_version_of_the_one_it_pins():
    versions = _versions()
    for d in DISTRIBUTIONS:
        project = _pyproject(d)["project"]
        for where, req in _requirements(project):
            name, _, spec = REQUIREMENT.match(req).groups()
            if not name.startswith("paged-"):
                continue
            assert name in versions, f"{project['name']} {where} names {name}, not a distribution of this repo"
            assert spec == f"=={versions[name]}", (
                f"{project['name']} {where} requires {req!r}; {name} is {versions[name]}: pin =={versions[name]}"
            )


def test_every_backend_plugin_is_in_the_all_extra_and_registers_its_folder_name():
    core = _pyproject(ROOT / "core")["project"]
    all_extra = {REQUIREMENT.match(r).group(1) for r in core["optional-dependencies"]["all"]}
    backends = 0
    for folder in sorted((ROOT / "plugins").glob("*/pyproject.toml")):
        project = _pyproject(folder.parent)["project"]
        assert project["name"] == f"paged-{folder.parent.name}", "folder and distribution suffix are one word"
        registered = project.get("entry-points", {}).get("paged_core")
        if registered is None:  # a library of the backend plugins (triton-common)
            continue
        backends += 1
        assert project["name"] in all_extra
        assert folder.parent.name in registered, f"{project['name']} registers no {folder.parent.name!r} backend"
    assert backends >= 4


def _depends_on(name: str) -> set[str]:
    """The distributions of this repo that require ``name`` (a distribution of this repo) in their
    dependencies, directly or through others."""
    deps = {
        _pyproject(d)["project"]["name"]: {
            REQUIREMENT.match(r).group(1) for r in _pyproject(d)["project"].get("dependencies", [])
        }
        for d in DISTRIBUTIONS
    }
    found = {name}
    while True:
        more = {d for d, needs in deps.items() if needs & found} - found
        if not more:
            return found - {name}
        found |= more


def test_triton_is_required_in_one_place_bounded_above_at_the_newest_tested_release():
    """paged-triton-common alone requires triton; the Triton backends get it through their
    dependency on it, so its bound is written once."""
    tested = _literal(ROOT / "plugins/triton-common/src/paged_triton_common/direct.py", "TESTED_TRITON")
    newest = max(tested)
    bound = f"<{newest[0]}.{newest[1] + 1}"
    found = []
    for d in DISTRIBUTIONS:
        project = _pyproject(d)["project"]
        for where, req in _requirements(project):
            name, _, spec = REQUIREMENT.match(req).groups()
            if name == "triton":
                found.append(f"{project['name']} {where}")
                assert bound in spec.split(","), f"{project['name']} {where} requires {req!r}; bound it: {bound}"
    assert found == ["paged-triton-common dependencies"], (
        f"triton is required by {found}; require it in paged-triton-common only (the Triton backends "
        "get it through their dependency on paged-triton-common)"
    )
    backends = {f"paged-{p.parent.name}" for p in ROOT.glob("plugins/triton-*/pyproject.toml")} - {
        "paged-triton-common"
    }
    assert backends and backends <= _depends_on("paged-triton-common")
    pinned = re.search(r'"triton==(\d+)\.(\d+)\.\d+"', (ROOT / "noxfile.py").read_text())
    assert pinned and (int(pinned[1]), int(pinned[2])) in tested, "the sessions' triton is a tested release"
