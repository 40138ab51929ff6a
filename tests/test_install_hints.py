"""Every install command for one of paged's own distributions works from a clone as written.

The distributions are not on a package index, so `pip install paged-conformance` fails
("No matching distribution found"); a command or fix hint must install from the wheels that
`python3 -m nox -s wheels` builds (`--find-links dist`). Error messages get theirs from
`paged_core.hookspecs.pip_install`.
"""

from __future__ import annotations

import pathlib
import re

import pytest
from paged_core.hookspecs import pip_install

ROOT = pathlib.Path(__file__).resolve().parents[1]
SOURCES = sorted(
    p
    for pattern in (
        "*.md",
        "docs/*.md",
        "*/README.md",
        "*/*/README.md",
        "*/src/**/*.py",
        "*/*/src/**/*.py",
        "examples/*.py",
        "scripts/*.py",
        "integrations/*/*.py",
    )
    for p in ROOT.glob(pattern)
    if ".nox" not in p.parts and "results" not in p.parts
)
COMMAND = re.compile(r"pip install ([^\n`]*)")
OURS = re.compile(r"\bpaged-[a-z0-9]")


def _bare_commands(text: str) -> list[str]:
    """``pip install`` commands that name a paged distribution but no wheels folder."""
    return [m.group(0) for m in COMMAND.finditer(text) if OURS.search(m.group(1)) and "--find-links" not in m.group(1)]


def test_the_hint_says_where_the_wheels_come_from():
    assert pip_install("paged-conformance") == (
        "pip install --find-links dist paged-conformance (build dist/ in a clone of paged: python3 -m nox -s wheels)"
    )


def test_a_bare_command_is_found():
    assert _bare_commands("To fix: pip install paged-conformance") == ["pip install paged-conformance"]
    assert _bare_commands(pip_install("'paged-core[triton]'") + "; pip install matplotlib") == []


@pytest.mark.parametrize("path", SOURCES, ids=lambda p: str(p.relative_to(ROOT)))
def test_no_install_command_names_an_unpublished_distribution_without_its_wheels(path):
    assert not _bare_commands(path.read_text()), path.relative_to(ROOT)
