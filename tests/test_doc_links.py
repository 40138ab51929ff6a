"""Every relative link in the project's Markdown docs points at a file (and heading) that exists."""

from __future__ import annotations

import pathlib
import re

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
DOCS = sorted(
    [
        ROOT / "README.md",
        ROOT / "CHANGELOG.md",
        *(ROOT / "docs").glob("*.md"),
        *ROOT.glob("*/README.md"),
        *ROOT.glob("plugins/*/README.md"),
        *ROOT.glob("integrations/*/README.md"),
    ]
)
# [text](target) outside code spans and fenced blocks; images too.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")


def _prose(text: str) -> str:
    text = re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)
    return re.sub(r"`[^`\n]*`", "", text)


def _anchors(path: pathlib.Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces to hyphens."""
    out = set()
    for line in _prose(path.read_text()).splitlines():
        m = re.match(r"#{1,6} (.*)", line)
        if m:
            out.add(re.sub(r"[^\w\- ]", "", m.group(1).strip().lower()).replace(" ", "-"))
    return out


def _links(doc: pathlib.Path) -> list[str]:
    return [t for t in LINK.findall(_prose(doc.read_text())) if not re.match(r"[a-z]+:", t)]


def test_the_docs_are_found():
    names = {str(p.relative_to(ROOT)) for p in DOCS}
    assert {
        "README.md",
        "docs/benchmarks.md",
        "conformance/README.md",
        "plugins/flashinfer/README.md",
        "integrations/vllm/README.md",
    } <= names


@pytest.mark.parametrize("doc", DOCS, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve(doc):
    broken = []
    for target in _links(doc):
        file, _, anchor = target.partition("#")
        path = (doc.parent / file).resolve() if file else doc
        if not path.exists():
            broken.append(f"{target}: no file {path.relative_to(ROOT) if path.is_relative_to(ROOT) else path}")
        elif anchor and path.suffix == ".md" and anchor not in _anchors(path):
            broken.append(f"{target}: no heading '#{anchor}' in {path.relative_to(ROOT)}")
    assert not broken, f"{doc.relative_to(ROOT)} links to what does not exist:\n" + "\n".join(broken)
