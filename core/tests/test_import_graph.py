"""paged_core's own modules import each other one way: their import graph has no cycle.

Every import statement of every module is read from its source (the AST), so function-local
imports and those under ``if TYPE_CHECKING:`` count too: a module that needs another only to
name a type still depends on it. The backend contract (``_backend``) builds on the checks
(``_checks``) and the torch custom ops (``_ops``), which know a backend only by what they use of it.
"""

from __future__ import annotations

import ast
from pathlib import Path

CORE = Path(__file__).resolve().parents[1] / "src" / "paged_core"
PACKAGE = "paged_core"


def core_imports(source: str, modules: set[str]) -> set[str]:
    """The modules of ``modules`` (names relative to the package; ``__init__`` for the package
    itself) that ``source``, a module of the package, imports anywhere."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level == 1:
                base = node.module
            elif node.level == 0 and node.module and node.module.split(".")[0] == PACKAGE:
                base = node.module.partition(".")[2] or None
            else:
                continue
            if base is None:  # from . import _ops: each name that is a module, else the package
                found |= {a.name if a.name in modules else "__init__" for a in node.names}
            else:
                found.add(base.split(".")[0])
        elif isinstance(node, ast.Import):
            for alias in node.names:
                parts = alias.name.split(".")
                if parts[0] == PACKAGE:
                    found.add(parts[1] if len(parts) > 1 else "__init__")
    return found & modules


def _graph(folder: Path) -> dict[str, set[str]]:
    modules = {p.stem for p in folder.glob("*.py")}
    return {m: core_imports((folder / f"{m}.py").read_text(), modules) - {m} for m in sorted(modules)}


def _cycle(graph: dict[str, set[str]]) -> list[str]:
    """One import cycle of ``graph`` as the path that closes it, or [] when there is none."""
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> list[str]:
        state[node] = 1
        path.append(node)
        for nxt in sorted(graph[node]):
            if state.get(nxt) == 1:
                return [*path[path.index(nxt) :], nxt]
            if nxt not in state and (found := visit(nxt)):
                return found
        path.pop()
        state[node] = 2
        return []

    for node in graph:
        if node not in state and (found := visit(node)):
            return found
    return []


def test_the_walker_sees_every_kind_of_import():
    source = (
        "from typing import TYPE_CHECKING\n"
        "from . import _ops, hookspecs\n"
        "from ._batch import BatchMeta\n"
        "import paged_core._cache as cache\n"
        "from paged_core.plugin import hookimpl\n"
        "from paged_core import registry\n"
        "if TYPE_CHECKING:\n"
        "    from ._backend import Backend\n"
        "def f():\n"
        "    from ._merge import merge_states\n"
    )
    modules = {"__init__", "_ops", "hookspecs", "_batch", "_cache", "plugin", "_backend", "_merge", "_spec"}
    assert core_imports(source, modules) == modules - {"_spec"}


def test_a_cycle_is_found():
    assert _cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": set()}) == ["a", "b", "c", "a"]
    assert _cycle({"a": {"b"}, "b": set()}) == []


def test_the_contract_depends_on_the_ops_one_way():
    graph = _graph(CORE)
    assert "_ops" in graph["_backend"] and "_checks" in graph["_backend"]
    assert "_backend" not in graph["_ops"] and "_backend" not in graph["_checks"]


def test_the_codec_knows_no_cache():
    # The codec (_quant) is below the cache (_cache: dequantized(), static scales), and the
    # reference write (_write) above both: it takes a KVCache and quantizes with the codec.
    graph = _graph(CORE)
    assert "_quant" in graph["_cache"] and {"_cache", "_quant"} <= graph["_write"]
    assert not graph["_quant"] & {"_cache", "_write"} and "_write" not in graph["_cache"]


def test_core_modules_import_each_other_one_way():
    cycle = _cycle(_graph(CORE))
    assert not cycle, (
        f"paged_core's modules import each other in a cycle: {' -> '.join(cycle)}; let one of them "
        "depend on the other only (a Protocol of what it uses names the other's type without an import)"
    )
