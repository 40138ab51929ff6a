"""bench_generate.py's CPU smoke run: every row gives transformers' own tokens, and the timed runs
reuse the first run's continuous-batching manager (captured CUDA graphs included, on a GPU)."""

from __future__ import annotations

import importlib.util
import json
import pathlib

from conftest import TRANSFORMERS_PAGED
from transformers.generation.continuous_batching import ContinuousBatchingManager

BENCH = pathlib.Path(__file__).resolve().parents[1] / "bench_generate.py"


def _bench():
    spec = importlib.util.spec_from_file_location("bench_generate", BENCH)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_small_run_reuses_one_manager_per_row(tmp_path, monkeypatch):
    built = []
    real_init = ContinuousBatchingManager.__init__

    def counting_init(self, *args, **kwargs):
        built.append(self)
        real_init(self, *args, **kwargs)

    monkeypatch.setattr(ContinuousBatchingManager, "__init__", counting_init)
    out = tmp_path / "rows.json"
    argv = ["--small", "--backends", "reference", "--transformers-paths", TRANSFORMERS_PAGED, "--repeats", "2"]
    assert _bench().main([*argv, "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["implementation"], r["mode"]) for r in rows] == [
        (TRANSFORMERS_PAGED, "eager"),
        ("paged: reference", "eager"),
    ]
    for row in rows:
        assert "error" not in row, row
        assert row["same_tokens_as_sdpa"] == row["requests"] == 4
        assert row["tokens_per_s"] > 0 and row["first_run_seconds"] > 0
    # The fp32 oracle run, then one manager per row for its first run and both timed runs
    # (a manager per call would make 1 + 2 * 3).
    assert len(built) == 1 + len(rows)
