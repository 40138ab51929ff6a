"""The test harness itself: Triton's interpreter is chosen only on a machine without CUDA.

On a GPU, a kernel run by the interpreter (NumPy on the host) is not the kernel under test, and
fails in ways the compiled kernel does not (Triton 3.6's interpreter converts 1-element arrays
with ``int()``, which NumPy 2.4 refuses: "only 0-dimensional arrays can be converted to Python
scalars").
"""

from __future__ import annotations

import os
import pathlib
import subprocess
import sys

CHECK = """
import importlib, os, torch
seen = []
for cuda in (True, False):
    os.environ.pop("TRITON_INTERPRET", None)
    torch.cuda.is_available = lambda cuda=cuda: cuda
    import conftest
    importlib.reload(conftest)
    seen.append(os.environ.get("TRITON_INTERPRET"))
print(seen)
"""


def test_the_interpreter_is_chosen_only_without_cuda():
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run(
        [sys.executable, "-c", CHECK],
        cwd=pathlib.Path(__file__).parent,
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip().splitlines()[-1] == "[None, '1']"
