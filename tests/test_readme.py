"""The README's Python examples run as written (the usage and the registry blocks) and print what
they say; its install commands pin what the nox sessions and CI install; the noxfile lists its
sessions as the README does."""

from __future__ import annotations

import ast
import contextlib
import importlib.util
import io
import pathlib
import re
import tomllib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
README = (ROOT / "README.md").read_text()
NOXFILE = ast.parse((ROOT / "noxfile.py").read_text())


def _python_blocks_under(heading: str) -> list[str]:
    section = README.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    return re.findall(r"```python\n(.*?)```", section, flags=re.S)


@pytest.mark.parametrize("heading", ["Using it", "The registry and writing a plugin"])
def test_readme_examples_run(heading):
    blocks = _python_blocks_under(heading)
    assert blocks, f"no python example under '{heading}'"
    # The plugin example is two files; run the hook module and the backend module in turn.
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, f"README.md#{heading}", "exec"), namespace)


def test_usage_example_prints_what_its_comments_say():
    block = _python_blocks_under("Using it")[0]
    said = [line.split("  # ", 1)[1] for line in block.splitlines() if line.startswith("print(")]
    printed = io.StringIO()
    with contextlib.redirect_stdout(printed):
        exec(block, {})
    shapes, error = printed.getvalue().splitlines()
    assert len(said) == 2 and shapes == said[0]
    # "max error 5e-07" for "about 1e-06": float32 against the float64 oracle, within 10x.
    about = float(re.fullmatch(r"about (\S+) .*", said[1])[1])
    assert error.startswith("max error ") and float(error.removeprefix("max error ")) < 10 * about, error


def test_usage_example_computes_attention():
    import torch

    # The plain-loop float64 oracle of paged-core's tests, loaded by path: it has one copy, in
    # core/tests, which pytest runs in a process of its own.
    spec = importlib.util.spec_from_file_location("_oracle", ROOT / "core" / "tests" / "oracle.py")
    oracle = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(oracle)

    namespace: dict = {}
    exec(_python_blocks_under("Using it")[0], namespace)
    out, lse, q = namespace["out"], namespace["lse"], namespace["q"]
    meta, cache = namespace["meta"], namespace["cache"]
    assert out.shape == q.shape and lse.shape == q.shape[:2]
    # The example's last call (window 32, with the LSE) against the plain-loop float64 oracle.
    qlens, slens = meta.host()
    tables = [meta.block_table[r].tolist() for r in range(meta.num_reqs)]
    want, want_lse = oracle.loop_attention(
        q.double().tolist(),
        cache.k.double().tolist(),
        cache.v.double().tolist(),
        qlens,
        slens,
        tables,
        cache.block_size,
        window=32,
    )
    from paged_conformance.tolerances import assert_close_to_reference, lse_tolerance, output_tolerance

    assert_close_to_reference(
        out,
        torch.tensor(want, dtype=torch.float64),
        backend="reference",
        case="readme",
        tolerance=output_tolerance(torch.float32),
    )
    assert_close_to_reference(
        lse,
        torch.tensor(want_lse, dtype=torch.float64),
        backend="reference",
        case="readme",
        what="lse",
        tolerance=lse_tolerance(torch.float32),
    )


def test_minimal_plugin_backend_works_and_refuses_what_it_does_not_claim():
    import torch
    from paged_core import BatchMeta, UnsupportedSpecError

    namespace: dict = {}
    for block in _python_blocks_under("The registry and writing a plugin"):
        exec(block, namespace)
    backend = namespace["MyBackend"]()
    meta = BatchMeta.build([3, 1], [10, 40], block_size=16)
    cache = backend.allocate(8, 16, num_kv_heads=2, head_dim=64, dtype=torch.float32)
    backend.write(cache, torch.randn(4, 2, 64), torch.randn(4, 2, 64), meta)
    out = backend.forward(torch.randn(4, 4, 64), cache, meta, window=8)
    assert out.shape == (4, 4, 64) and bool(out.isfinite().all())
    with pytest.raises(UnsupportedSpecError, match="softcap|soft-capping"):
        backend.forward(torch.randn(4, 4, 64), cache, meta, softcap=5.0)


def _nox_sessions() -> dict[str, str | None]:
    """{session: docstring} of the noxfile's ``@nox.session`` functions (read, not imported: the
    tests' environment has no nox)."""
    return {
        f.name: ast.get_docstring(f)
        for f in NOXFILE.body
        if isinstance(f, ast.FunctionDef) and any(ast.unparse(d).startswith("nox.session") for d in f.decorator_list)
    }


def test_every_nox_session_is_named_and_described_in_one_line():
    sessions = _nox_sessions()
    assert {"tests", "demo", "lint", "wheels"} <= set(sessions)
    # `nox -l` prints the first line of each docstring: a summary running onto a second line is
    # cut off mid-sentence.
    for name, doc in sessions.items():
        summary = (doc or "").split("\n\n")[0]
        assert summary and "\n" not in summary, f"nox session {name!r}: start its docstring with a one-line summary"
    listed = ast.get_docstring(NOXFILE).splitlines()[0]
    layout = next(line for line in README.splitlines() if line.startswith("noxfile.py "))
    for name in sessions:
        assert re.search(rf"\b{name}\b", listed), f"noxfile.py's docstring does not name the {name!r} session"
        assert re.search(rf"\b{name}\b", layout), f"README.md's layout does not name the {name!r} session"


def _noxfile_constant(name: str) -> str:
    return next(
        ast.literal_eval(node.value)
        for node in NOXFILE.body
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets)
    )


@pytest.mark.parametrize("package, constant", [("torch", "TORCH"), ("triton", "TRITON")])
def test_readme_pins_what_the_sessions_and_ci_install(package, constant):
    # The noxfile holds the pair CI tests (.ci/run runs nox); the README's install copies it.
    pinned = _noxfile_constant(constant)
    install = README.split("## Install\n", 1)[1].split("\n## ", 1)[0]
    copies = set(re.findall(rf"\b{package}==\S+", install))
    assert copies == {pinned}, f"README.md's install pins {sorted(copies)}; noxfile.py's {constant} is {pinned}"


def test_the_distributions_admit_the_pinned_torch_and_triton():
    # The README's install line asks for both pins next to paged-core[triton]; every requirement
    # on torch and triton in the distributions it installs must admit them, or pip refuses.
    from packaging.requirements import Requirement
    from packaging.version import Version

    pins = {p: Version(_noxfile_constant(c).split("==")[1]) for p, c in [("torch", "TORCH"), ("triton", "TRITON")]}
    folders = ["core", "plugins/triton-common", "plugins/triton-unified", "plugins/triton-splitkv"]
    checked = set()
    for folder in folders:
        project = tomllib.loads((ROOT / folder / "pyproject.toml").read_text())["project"]
        for req in map(Requirement, project["dependencies"]):
            if req.name in pins:
                checked.add(req.name)
                assert req.specifier.contains(pins[req.name]), (
                    f"{project['name']} requires {req}; CI tests {pins[req.name]}"
                )
    assert checked == set(pins)  # torch in paged-core, triton in paged-triton-common


def test_ci_runs_the_readme_test_command():
    command = re.search(r"`python3 -m pip install nox && (python3 -m nox -s tests)`", README)
    assert command, "README.md's test command is not in its table"
    ci = (ROOT / ".ci" / "run").read_text()
    assert re.search(rf"^{re.escape(command[1])}$", ci, flags=re.M), ".ci/run does not run README.md's test command"
