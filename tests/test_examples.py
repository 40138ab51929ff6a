"""examples/: the engine loop runs as its docstring says, and its check fails when it should."""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
LOOP = ROOT / "examples" / "engine_loop.py"


def _run(*args: str, hide: str | None = None) -> subprocess.CompletedProcess:
    """The example in a fresh process; ``hide``: a package the process cannot import, as where
    it is not installed (this environment has every distribution of the workspace)."""
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    command = [sys.executable, str(LOOP), *args]
    if hide is not None:
        run = f"import runpy, sys; sys.modules[{hide!r}] = None; sys.argv = {[str(LOOP), *args]!r}; "
        run += f"runpy.run_path({str(LOOP)!r}, run_name='__main__')"
        command = [sys.executable, "-c", run]
    return subprocess.run(command, capture_output=True, text=True, env=env, timeout=600)


@pytest.mark.parametrize("backend", ["reference", "triton-unified"])
def test_engine_loop_runs_chunked_prefill_then_decodes(backend):
    from paged_core import registry

    if backend not in registry.names():
        pytest.skip(f"{backend} is not installed here")
    run = _run("--backend", backend, "--steps", "3")
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    lines = run.stdout.splitlines()
    # Step 0: a 16-token chunk of the 37-token prompt next to two whole prompts; step 2 finishes
    # the long prompt while the short ones decode.
    assert lines[0].startswith("step 0:  37 tokens (16 new/16, 5 new/5, 16 new/16)"), lines[0]
    assert lines[2].startswith("step 2:   7 tokens (5 new/37, 1 new/7, 1 new/21)"), lines[2]
    assert "within the float32 tolerance" in lines[-1]


def test_engine_loop_runs_after_the_readme_install_without_the_suite():
    # The README's install is paged-core[triton]: no paged-conformance, so no tolerance table.
    from paged_core import registry

    if "triton-unified" not in registry.names():
        pytest.skip("triton-unified is not installed here")
    run = _run("--backend", "triton-unified", "--steps", "2", hide="paged_conformance")
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    last = run.stdout.splitlines()[-1]
    assert last.startswith("triton-unified: 2 steps x 2 layers, worst abs err "), last
    assert "not judged" in last and "pip install --find-links dist paged-conformance" in last


def test_engine_loop_names_a_missing_backend():
    run = _run("--backend", "no-such-backend", "--steps", "1")
    assert run.returncode == 2 and "no-such-backend" in run.stderr and "Traceback" not in run.stderr


def test_engine_loop_on_an_fp8_cache_with_a_static_scale():
    run = _run("--kv-dtype", "fp8", "--static-scale", "0.02", "--steps", "3")
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "fp8 cache (static scale)" in run.stdout and "within the float32 tolerance" in run.stdout
    # A static scale for a full-precision cache is refused with the reason, not a traceback.
    bad = _run("--static-scale", "0.02", "--steps", "1")
    assert bad.returncode == 2 and "for a quantized cache only" in bad.stderr and "Traceback" not in bad.stderr


def test_engine_loop_on_a_kivi4_cache():
    run = _run("--backend", "reference", "--steps", "3", "--kv-dtype", "kivi4")
    assert run.returncode == 0, run.stdout + run.stderr[-2000:]
    assert "kivi4 cache (keys per block and channel, values per slot)" in run.stdout.splitlines()[-1]
