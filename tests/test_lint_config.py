""".pre-commit-config.yaml runs what ``nox -s lint`` runs: the noxfile's ruff and mypy pins (RUFF,
MYPY), mypy's type dependencies (MYPY_DEPS), and mypy over every distribution's src."""

from __future__ import annotations

import ast
import pathlib
import re

ROOT = pathlib.Path(__file__).resolve().parents[1]
PRE_COMMIT = (ROOT / ".pre-commit-config.yaml").read_text()


def _noxfile_constants() -> dict[str, object]:
    """The noxfile's module-level constants built from literals and earlier constants (read, not
    imported: the tests' environment has no nox)."""
    out: dict[str, object] = {}
    for node in ast.parse((ROOT / "noxfile.py").read_text()).body:
        if isinstance(node, ast.Assign) and len(node.targets) == 1 and isinstance(node.targets[0], ast.Name):
            try:
                out[node.targets[0].id] = eval(compile(ast.Expression(node.value), "noxfile.py", "eval"), {}, dict(out))
            except Exception:  # computed from the file system or nox: not a pin
                continue
    return out


def _block_list(key: str, after: str) -> list[str]:
    """The items of the YAML block list ``key:`` that follows the line ``after`` (one item a line,
    ``- value``, quotes dropped): the file keeps to that form."""
    lines = PRE_COMMIT.splitlines()
    start = next(i for i, line in enumerate(lines) if line.strip() == after)
    head = next(i for i in range(start, len(lines)) if lines[i].strip() == f"{key}:")
    items = []
    for line in lines[head + 1 :]:
        m = re.fullmatch(r"\s*- (.+)", line)
        if not m:
            break
        items.append(m[1].strip().strip('"'))
    return items


def _version(pin: str) -> str:
    name, version = pin.split("==")
    return version


def test_pre_commit_runs_the_lint_sessions_ruff():
    nox = _noxfile_constants()
    m = re.search(r"repo: https://github.com/astral-sh/ruff-pre-commit\n\s+rev: v(\S+)", PRE_COMMIT)
    assert m, ".pre-commit-config.yaml has no astral-sh/ruff-pre-commit repo with a rev"
    assert m[1] == _version(nox["RUFF"]), f"pre-commit's ruff is {m[1]}, the lint session's {nox['RUFF']}: set rev"
    for hook in ("ruff-check", "ruff-format"):
        assert f"- id: {hook}\n" in PRE_COMMIT, f"pre-commit runs no {hook} (nox -s lint does)"


def test_pre_commit_runs_the_lint_sessions_mypy_with_its_dependencies():
    nox = _noxfile_constants()
    deps = _block_list("additional_dependencies", "- id: mypy")
    assert deps == [nox["MYPY"], *nox["MYPY_DEPS"]], (
        f"pre-commit's mypy hook installs {deps}; the lint session installs {[nox['MYPY'], *nox['MYPY_DEPS']]}"
    )


def test_pre_commit_checks_the_types_of_every_distributions_src():
    distributions = sorted(
        str(p.parent.relative_to(ROOT))
        for pattern in ("core", "conformance", "bench", "plugins/*", "integrations/*")
        for p in ROOT.glob(f"{pattern}/pyproject.toml")
    )
    args = _block_list("args", "- id: mypy")
    assert sorted(args) == [f"{d}/src" for d in distributions]
