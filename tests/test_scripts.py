"""The repository's scripts (most of them GPU measurements) start and explain themselves here.

A script that no longer imports or parses its options would otherwise be found on the GPU
machine, at the cost of a run there.
"""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

SCRIPTS = sorted((Path(__file__).resolve().parents[1] / "scripts").glob("*.py"))


@pytest.mark.parametrize("script", SCRIPTS, ids=[s.name for s in SCRIPTS])
def test_script_help(script):
    # kernel_resources.py compiles for the GPU and refuses the interpreter; --help needs neither.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run([sys.executable, str(script), "--help"], env=env, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.startswith("usage:"), proc.stdout[:500]


def test_the_scripts_are_found():
    # An empty glob (a moved folder) would leave the test above with no case at all.
    assert len(SCRIPTS) >= 6 and all(s.suffix == ".py" for s in SCRIPTS)
