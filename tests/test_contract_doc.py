"""docs/contract.md's "Writing a backend" states what the code defines: every ``Capabilities``
field with its default, every ``Backend`` member it names, every hook of ``hookspecs.py``."""

from __future__ import annotations

import dataclasses
import inspect
import pathlib
import re

import pytest
import torch
from paged_core import Backend, Capabilities, hookspecs
from paged_core._spec import dtype_name

CONTRACT = pathlib.Path(__file__).resolve().parents[1] / "docs" / "contract.md"


def _section(heading: str) -> str:
    """The text under ``heading`` up to the next heading of the same or a higher level (a ``#``
    line inside a fenced code block is code, not a heading)."""
    level = len(heading) - len(heading.lstrip("#"))
    lines, out, inside, fenced = CONTRACT.read_text().splitlines(), [], False, False
    for line in lines:
        if line.startswith("```"):
            fenced = not fenced
        elif not fenced and re.match(r"#+ ", line):
            if line == heading:
                inside = True
                continue
            if inside and len(line) - len(line.lstrip("#")) <= level:
                break
        if inside:
            out.append(line)
    assert inside, f"no heading {heading!r} in docs/contract.md"
    return "\n".join(out)


def _table(section: str) -> dict[str, list[str]]:
    """A Markdown table's rows by the code span that opens their first cell: name -> cells."""
    rows = {}
    for line in section.splitlines():
        m = re.match(r"\| `([^`]+)`", line)
        if m:
            rows[m.group(1)] = [c.strip() for c in line.strip().strip("|").split("|")]
    return rows


def _default_words(default: object) -> list[str]:
    """How the table's default cell writes ``default``: each word must appear in it."""
    if default is None:
        return ["`None`", "any"]
    if isinstance(default, bool):
        return [f"`{default}`"]
    if isinstance(default, frozenset):
        if not default:
            return ["`frozenset()`"]
        return [f"`{dtype_name(v)}`" if isinstance(v, torch.dtype) else f'`"{v}"`' for v in default]
    raise AssertionError(f"no rule for a default of type {type(default).__name__}: add one")


CAPABILITIES = _table(_section("### Capabilities"))


def test_the_capabilities_table_has_every_field_and_nothing_else():
    fields = [f.name for f in dataclasses.fields(Capabilities)]
    missing = [name for name in fields if name not in CAPABILITIES]
    extra = sorted(set(CAPABILITIES) - set(fields))
    assert not missing and not extra, (
        f"docs/contract.md's Capabilities table lacks {missing} and names {extra}, which are not "
        f"fields of paged_core.Capabilities; its fields: {', '.join(fields)}"
    )
    assert list(CAPABILITIES) == fields, "list the fields in the dataclass's order"


@pytest.mark.parametrize("field", dataclasses.fields(Capabilities), ids=lambda f: f.name)
def test_the_capabilities_table_states_each_default(field):
    if field.name not in CAPABILITIES:
        pytest.fail(f"Capabilities.{field.name} is not in docs/contract.md's table")
    default_cell = CAPABILITIES[field.name][1]
    missing = [w for w in _default_words(field.default) if w not in default_cell]
    assert not missing, f"Capabilities.{field.name} defaults to {field.default!r}; the table says {default_cell!r}"


def test_the_member_table_names_what_backend_defines():
    members = _table(_section("### The class"))
    assert members, "no member table under '### The class'"
    for cell in members:
        name = re.match(r"\w+", cell).group(0)
        assert hasattr(Backend, name), f"docs/contract.md names Backend.{name}, which does not exist"
        if "(" in cell and name != "__init__":  # a method: the parameters it shows are its own
            shown = re.findall(r"[(,]\s*\*?\s*(\w+)", cell.split("->")[0])
            params = inspect.signature(getattr(Backend, name)).parameters
            unknown = [p for p in shown if p not in params and p not in ("self", "cls")]
            assert not unknown, f"Backend.{name} has no parameters {unknown}; it takes {list(params)}"
    # The methods a backend may define are all in the table.
    for name in ("_forward", "_plan", "_write", "allocate", "unavailable", "extra_reasons"):
        assert any(re.match(rf"{name}\b", cell) for cell in members), f"Backend.{name} is not in the member table"


def test_every_hook_is_documented():
    text = _section("## Writing a backend")
    hooks = [name for name, fn in vars(hookspecs).items() if inspect.isfunction(fn) and hasattr(fn, "paged_core_spec")]
    assert set(hooks) == {"register_backends", "register_commands"}, hooks
    for name in hooks:
        assert f"`{name}" in text, f"the hook {name} is not named in docs/contract.md's 'Writing a backend'"
