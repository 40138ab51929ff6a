"""scripts/cp_decode_bench.py runs end to end under torchrun (2 gloo ranks, --smoke), so a
multi-GPU run does not die on a typo, and its sharded results match the single-device ones."""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[1]


def test_the_smoke_run_prints_a_table_of_matching_results(tmp_path: pathlib.Path):
    out = tmp_path / "rows.json"
    env = {k: v for k, v in os.environ.items() if k not in ("MASTER_ADDR", "MASTER_PORT", "RANK", "WORLD_SIZE")}
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--standalone",
            "--nproc-per-node",
            "2",
            str(ROOT / "scripts" / "cp_decode_bench.py"),
            "--smoke",
            "--json",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=300,
        env=env,
        cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "context-parallel decode, 2 ranks" in proc.stdout
    rows = json.loads(out.read_text())
    assert {(r["case"], r["layout"]) for r in rows} == {
        ("1 x 300", "contiguous"),
        ("1 x 300", "interleaved"),
        ("3 x 70", "contiguous"),
        ("3 x 70", "interleaved"),
    }
    for r in rows:
        assert r["ok"] and r["ranks"] == 2, r
        assert r["step_ms"] > 0 and 0 < r["merge_share"], r
