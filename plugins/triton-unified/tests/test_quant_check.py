"""scripts/quant_check.py (the GPU check of the int8/fp8 code conversion) runs end to end.

On the CPU it runs its smoke mode: tiny shapes under the interpreter, whose kernels take the
``.to()`` path, so this proves the script (its cases, its reference comparisons, its table), not
the inline asm (test_codes.py models that; the GPU run checks it).
"""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_smoke_run_checks_every_conversion_and_prints_the_table():
    pytest.importorskip("paged_triton_splitkv")
    pytest.importorskip("paged_conformance")
    env = {**os.environ, "TRITON_INTERPRET": "1"}
    run = subprocess.run([sys.executable, str(ROOT / "scripts" / "quant_check.py"), "--smoke"],
                         capture_output=True, text=True, env=env, timeout=900)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-3000:]
    checks = re.findall(r"^(convert .+?|triton-\S+ .+?)\s+\| (ok |BAD)", run.stdout, re.M)
    # 2 formats x 2 dtypes x 3 tiles x (alone, through an MMA); 2 formats x 2 q dtypes x 3 paths.
    assert len([c for c in checks if c[0].startswith("convert")]) == 24, run.stdout
    assert len([c for c in checks if c[0].startswith("triton-")]) == 12, run.stdout
    assert all(status == "ok " for _, status in checks), run.stdout
    assert re.search(r"^\S+\s+triton-unified(\s+nan){5}$", run.stdout, re.M), run.stdout
    assert re.search(r"^\S+\s+triton-splitkv(\s+nan){5}$", run.stdout, re.M), run.stdout
