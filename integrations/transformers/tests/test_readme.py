"""The three-line usage in the READMEs runs as written, on a tiny model."""

from __future__ import annotations

import pathlib
import re

import pytest
from conftest import random_prompts, tiny_model
from paged_core import registry

ROOT = pathlib.Path(__file__).resolve().parents[3]


def _usage(path: pathlib.Path, heading: str | None) -> str:
    text = path.read_text()
    if heading:
        text = text.split(f"## {heading}\n", 1)[1].split("\n## ", 1)[0]
    (block,) = re.findall(r"```python\n(.*?)```", text, flags=re.S)[:1]
    return block


def test_usage_runs():
    if registry.unavailable("triton-unified"):
        pytest.skip("; ".join(registry.unavailable("triton-unified")))
    model = tiny_model("qwen3")
    model.generation_config.max_new_tokens = 2
    model.generation_config.do_sample = False
    model.generation_config.pad_token_id = 0
    namespace = {"model": model, "prompts": random_prompts([3, 5])}
    exec(compile(_usage(ROOT / "README.md", "transformers"), "README.md", "exec"), namespace)
    outputs = namespace["outputs"]
    assert len(outputs) == 2 and all(o.error is None and len(o.generated_tokens) == 2 for o in outputs.values())


def test_the_package_readme_shows_the_same_usage():
    assert _usage(ROOT / "integrations" / "transformers" / "README.md", None) == _usage(
        ROOT / "README.md", "transformers")
