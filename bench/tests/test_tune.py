"""``paged tune``: the bench's timings as the table the auto backend reads."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from paged_core import AutoBackend, BatchMeta, TuneTable


def _paged(*argv: str, env_home: str) -> subprocess.CompletedProcess:
    # A home of its own: the table lands where auto looks on this machine, not in the real ~/.cache.
    env = {**os.environ, "XDG_CACHE_HOME": env_home, "HOME": env_home}
    env.pop("PAGED_TUNE_TABLE", None)
    return subprocess.run([sys.executable, "-m", "paged_core", *argv], capture_output=True, text=True, env=env)


def test_paged_tune_writes_the_table_auto_reads(tmp_path):
    run = tmp_path / "run.json"
    res = _paged(
        "tune", "--cases", "decode,mixed", "--backend", "reference", "--no-baselines", "--json", str(run),
        env_home=str(tmp_path),
    )  # fmt: skip
    assert res.returncode == 0, res.stderr[-2000:]
    path = tmp_path / "paged" / "tune" / "cpu.json"  # where auto looks on this machine
    assert f"wrote {path}" in res.stdout
    table = TuneTable.load(str(path))
    assert {e.kind for e in table.entries} == {"decode", "mixed"}
    assert all(set(e.ms) == {"reference"} and e.ms["reference"] > 0 for e in table.entries)
    # The same table again from the recorded run, timing nothing.
    again = tmp_path / "again.json"
    res = _paged("tune", "--from-json", str(run), "--out", str(again), env_home=str(tmp_path))
    assert res.returncode == 0, res.stderr[-2000:]
    assert json.loads(again.read_text())["entries"] == json.loads(path.read_text())["entries"]
    # auto reads it: the bench's tiny layer (4 heads over 1 KV head x 64, bfloat16, blocks of 16).
    auto = AutoBackend(candidates=["reference"], table=str(path))
    meta = BatchMeta.build(query_lens=[1, 1], seq_lens=[64, 64], block_size=16)
    plan = auto.plan(meta, num_heads=4, num_kv_heads=1, head_dim=64)
    assert plan.choice == "reference" and "fastest on the nearest measured decode batch" in plan.why


def test_a_file_that_is_not_a_bench_run_is_refused_in_its_own_words(tmp_path):
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"rows": "nope"}))
    res = _paged("tune", "--from-json", str(bad), "--out", str(tmp_path / "t.json"), env_home=str(tmp_path))
    assert res.returncode == 2
    assert "not a run written by paged bench --json" in res.stderr
    assert "Traceback" not in res.stderr
