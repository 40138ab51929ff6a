"""The usage block of the READMEs runs as written and gives transformers' own tokens."""

from __future__ import annotations

import pathlib
import re

import torch
from conftest import TRANSFORMERS_PAGED, generate

ROOT = pathlib.Path(__file__).resolve().parents[3]
README = ROOT / "integrations" / "transformers" / "README.md"


def _usage(path: pathlib.Path, heading: str | None) -> str:
    text = path.read_text()
    if heading:
        text = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)[:1]
    return block


def test_usage_runs_as_written_with_transformers_own_tokens():
    namespace: dict = {"__name__": "readme"}
    exec(compile(_usage(README, None), str(README), "exec"), namespace)
    outputs, model, prompts = namespace["outputs"], namespace["model"], namespace["prompts"]
    assert sorted(outputs) == [f"req_{i}" for i in range(len(prompts))]
    errors = {r: o.error for r, o in outputs.items() if o.error is not None}
    assert not errors, errors
    tokens = {r: o.generated_tokens for r, o in outputs.items()}
    assert all(len(t) == 8 for t in tokens.values()), tokens
    want = generate(model, TRANSFORMERS_PAGED, prompts, max_new_tokens=8)
    assert want.errors == {r: None for r in want.errors}, want.errors
    if model.dtype == torch.float32:  # the CPU's model; in bf16 (a GPU) rounding may flip a greedy choice
        assert tokens == want.tokens


def test_the_repository_readme_shows_the_same_usage():
    assert _usage(ROOT / "README.md", "transformers") == _usage(README, None)
