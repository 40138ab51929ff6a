"""scripts/kernel_resources.py: the offline sm_90a compile that reports registers and spills."""

from __future__ import annotations

import os
import pathlib
import re
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[3]


def test_reports_registers_and_shared_memory_per_config():
    triton = pytest.importorskip("triton")
    if not (pathlib.Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "cuobjdump").exists():
        pytest.skip("this Triton wheel ships no cuobjdump: the offline resource report needs it")
    # Its own process: the other tests of this directory run Triton's interpreter, which cannot compile.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = os.pathsep.join(
        [str(ROOT / "plugins" / p / "src") for p in ("triton-unified", "triton-common")] + [env.get("PYTHONPATH", "")]
    )
    script = ROOT / "scripts" / "kernel_resources.py"

    def report(tiles: str, configs: str) -> str:
        run = subprocess.run(
            [sys.executable, str(script), "--tiles", tiles, "--configs", configs],
            capture_output=True,
            text=True,
            env=env,
            timeout=600,
        )
        assert run.returncode == 0, run.stderr[-2000:]
        return run.stdout

    out = report("decode", "32/4/1,128/4/2,128/4/2/80")
    rows = {}
    for line in out.splitlines():
        m = re.match(
            r"decode \(direct\)\s+bf16\s+(\d+/\d+/\d+(?:/\d+)?)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+(\d+)\s+"
            r"((?:\d+ )*\d+)\s+\d+\s+\d+",
            line,
        )
        if m:
            rows[m[1]] = (int(m[2]), int(m[3]), float(m[4]), int(m[5]), [int(n) for n in m[6].split()])
    assert set(rows) == {"32/4/1", "128/4/2", "128/4/2/80"}, out
    for regs, spill, smem_kb, ctas, loops in rows.values():
        assert 16 <= regs <= 255 and spill >= 0 and smem_kb > 0 and ctas >= 1
        # Its key ranges' loops (the bulk, the causal diagonal): one key step each, two MMAs of
        # BLOCK_N keys and the softmax, some hundreds of instructions.
        assert len(loops) >= 2 and all(100 < n < 5000 for n in loops), loops
    # Four times the keys per step: more instructions per step.
    assert max(rows["128/4/2"][4]) > max(rows["32/4/1"][4])
    # Four times the keys per step, in two stages, need more shared memory.
    assert rows["128/4/2"][2] > rows["32/4/1"][2]
    # A register cap (a Config's maxnreg) reaches the compiler: the same tile in fewer registers.
    assert rows["128/4/2/80"][0] <= 80 < rows["128/4/2"][0]

    # The split-KV kernel loads each tile's block ids a tile ahead so that the pipeliner buffers
    # the gathered K/V num_stages deep, i.e. its third stage holds a third 64-key K/V buffer
    # (2 x 16 KB) more than two.
    out = report("split", "64/4/2,64/4/3")
    split = {
        m[1]: float(m[2]) for m in re.finditer(r"split-KV decode\s+bf16\s+(64/4/[23])\s+\d+\s+\d+\s+([\d.]+)", out)
    }
    assert set(split) == {"64/4/2", "64/4/3"}, out
    assert split["64/4/3"] >= split["64/4/2"] + 31, split

    # Cascade attention's prefix pass compiles too (its 64-row tiles): one key-step loop.
    out = report("cascade", "64/4/2")
    m = re.search(r"cascade prefix \(64 rows\)\s+bf16\s+64/4/2\s+(\d+)\s+\d+\s+([\d.]+)\s+\d+\s+(\d+)", out)
    assert m and 16 <= int(m[1]) <= 255 and float(m[2]) > 0 and 100 < int(m[3]) < 5000, out
