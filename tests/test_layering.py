"""Dependencies point one way: paged-core imports nothing of this repository's other distributions.

Plugins, the conformance suite and integrations depend on core; core reaches them only through
its hooks (``register_backends``, ``register_commands``) and dotted paths they register. The
Triton runtime (paged-triton-common) sits between: it imports core only, and the Triton backend
plugins build on it. No plugin imports the conformance suite or the bench. Every
import statement of every module of ``paged_core`` is read from its source (the AST, so
function-local and ``try``-guarded imports count too), as is every ``importlib.import_module``
or ``__import__`` of a literal name.

Read the same way: nothing imports the bench (``paged bench`` reaches it through its entry
point), and no plugin imports the suite or the bench.
"""

from __future__ import annotations

import ast
import os
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
CORE = ROOT / "core" / "src" / "paged_core"
TRITON_COMMON = ROOT / "plugins" / "triton-common" / "src" / "paged_triton_common"
PLUGIN_SOURCES = sorted(ROOT.glob("plugins/*/src/*/**/*.py"))
BENCH = ROOT / "bench"


def _distributions() -> dict[str, str]:
    """Top-level import name -> distribution, for every distribution of this repository but core
    (each ``pyproject.toml`` with a ``[project]``; its packages are the ``src/`` folders)."""
    out = {}
    for pyproject in sorted(ROOT.glob("**/pyproject.toml")):
        # Hidden folders (.git, .nox virtualenvs, scratch copies) hold no distribution of ours.
        if any(part.startswith(".") for part in pyproject.relative_to(ROOT).parts) or pyproject.parent in (
            ROOT,
            CORE.parents[1],
        ):
            continue
        # Only [project].name is needed: a regex, since tomllib is Python 3.11+ and core supports 3.10.
        name = re.search(r'^\[project\]\s*$.*?^name\s*=\s*"([^"]+)"', pyproject.read_text(), re.M | re.S)
        if not name:
            continue
        for pkg in sorted((pyproject.parent / "src").glob("*/__init__.py")):
            out[pkg.parent.name] = name.group(1)
    return out


def imported_modules(source: str) -> list[tuple[int, str]]:
    """``(line, absolute module name)`` of every import in ``source``, relative ones excluded."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            found.append((node.lineno, node.module))
        elif isinstance(node, ast.Call) and node.args and isinstance(node.args[0], ast.Constant):
            fn = node.func
            name = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else ""
            if name in ("import_module", "__import__") and isinstance(node.args[0].value, str):
                found.append((node.lineno, node.args[0].value))
    return found


def test_the_other_distributions_are_found():
    names = _distributions()
    assert {
        "paged_conformance",
        "paged_bench",
        "paged_triton_common",
        "paged_triton_unified",
        "paged_triton_splitkv",
        "paged_flashinfer",
        "paged_flash_attn2",
    } <= set(names), names
    assert "paged_core" not in names


def test_the_walker_sees_every_kind_of_import():
    source = (
        "import os, paged_flashinfer.backend as fb\n"
        "from . import _merge\n"
        "def f():\n"
        "    try:\n"
        "        from paged_triton_unified.split_launch import merge_states\n"
        "    except ImportError:\n"
        "        pass\n"
        "    importlib.import_module('paged_conformance.runner')\n"
    )
    assert imported_modules(source) == [
        (1, "os"),
        (1, "paged_flashinfer.backend"),
        (5, "paged_triton_unified.split_launch"),
        (8, "paged_conformance.runner"),
    ]


@pytest.mark.parametrize("path", sorted(CORE.rglob("*.py")), ids=lambda p: str(p.relative_to(CORE)))
def test_core_imports_no_other_distribution(path):
    others = _distributions()
    bad = []
    for line, module in imported_modules(path.read_text()):
        top = module.split(".")[0]
        # Also any paged_* package that is not core: a distribution not written yet (the
        # integrations paged_transformers, paged_vllm) is caught before it lands.
        if top in others or (top.startswith("paged_") and top != "paged_core"):
            dist = others.get(top, "another distribution")
            bad.append(f"{path.relative_to(ROOT)}:{line} imports {module} ({dist})")
    assert not bad, (
        "paged-core must not import the distributions that depend on it; reach them through a hook "
        "(paged_core.hookspecs) or a registered dotted path instead:\n" + "\n".join(bad)
    )


def _repo_imports(path: Path) -> list[tuple[int, str]]:
    """``(line, module)`` of the imports of ``path`` that name a ``paged_*`` package."""
    return [(line, m) for line, m in imported_modules(path.read_text()) if m.split(".")[0].startswith("paged_")]


@pytest.mark.parametrize("path", sorted(TRITON_COMMON.rglob("*.py")), ids=lambda p: str(p.relative_to(TRITON_COMMON)))
def test_the_triton_runtime_imports_core_only(path):
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for line, module in _repo_imports(path)
        if module.split(".")[0] not in ("paged_core", "paged_triton_common")
    ]
    assert not bad, (
        "paged-triton-common is what the Triton plugins build on: it may import paged-core only, "
        "never a plugin (move what both plugins need into paged_triton_common instead):\n" + "\n".join(bad)
    )


def test_the_triton_plugins_build_on_the_triton_runtime():
    for plugin in ("triton_unified", "triton_splitkv"):
        sources = (ROOT / "plugins").glob(f"*/src/paged_{plugin}/*.py")
        tops = {m.split(".")[0] for path in sources for _, m in _repo_imports(path)}
        assert "paged_triton_common" in tops, plugin


@pytest.mark.parametrize("path", PLUGIN_SOURCES, ids=lambda p: str(p.relative_to(ROOT / "plugins")))
def test_plugins_import_neither_conformance_nor_bench(path):
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for line, module in _repo_imports(path)
        if module.split(".")[0] in ("paged_conformance", "paged_bench")
    ]
    assert not bad, (
        "a backend plugin must not depend on the conformance suite or the bench (they test and time "
        "plugins, through the registry):\n" + "\n".join(bad)
    )


def _sources_outside(folder: Path) -> list[Path]:
    """Every Python file of the repository outside ``folder``: not under hidden folders (.git, .nox
    virtualenvs) or build outputs."""
    found = []
    for here, dirs, files in os.walk(ROOT):
        dirs[:] = sorted(
            d
            for d in dirs
            if not d.startswith(".")
            and d not in ("build", "__pycache__")
            and not d.endswith(".egg-info")
            and Path(here, d) != folder
        )
        found += [Path(here, f) for f in sorted(files) if f.endswith(".py")]
    return found


def _imports_the_bench(path: Path, module: str) -> bool:
    """Whether ``module``, imported by ``path``, is the bench's beyond what may be: the development
    scripts time kernels with the bench's own timer (``paged_bench.timing``), so that their
    numbers and ``paged bench``'s are taken alike; nothing else of the bench is importable."""
    if module.split(".")[0] != "paged_bench":
        return False
    return not (path.parent == ROOT / "scripts" and module == "paged_bench.timing")


def test_nothing_imports_the_bench():
    bad = [
        f"{path.relative_to(ROOT)}:{line} imports {module}"
        for path in _sources_outside(BENCH)
        for line, module in imported_modules(path.read_text())
        if _imports_the_bench(path, module)
    ]
    assert not bad, (
        "paged_bench is reached only through its command (the entry point paged_bench.commands), "
        "and by the development scripts for its timer (paged_bench.timing); import what it shares "
        "from paged_conformance or paged_core instead:\n" + "\n".join(bad)
    )


def test_only_the_scripts_may_use_the_bench_timer():
    assert not _imports_the_bench(ROOT / "scripts" / "_harness.py", "paged_bench.timing")
    assert _imports_the_bench(ROOT / "scripts" / "_harness.py", "paged_bench.rows")
    assert _imports_the_bench(ROOT / "integrations" / "x.py", "paged_bench.timing")


def test_the_checks_see_the_plugins_and_the_rest_of_the_repository():
    assert {p.parts[len(ROOT.parts) + 1] for p in PLUGIN_SOURCES} >= {
        "triton-unified",
        "triton-splitkv",
        "flashinfer",
        "flash-attn2",
    }
    outside = {p.relative_to(ROOT).parts[0] for p in _sources_outside(BENCH)}
    assert {"core", "conformance", "plugins", "integrations", "scripts", "tests"} <= outside
    assert "bench" not in outside
