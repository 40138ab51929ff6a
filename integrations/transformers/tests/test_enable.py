"""enable(): names, errors, supported releases and the layers paged refuses."""

from __future__ import annotations

import paged_transformers
import pytest
import torch
from conftest import generate, random_prompts, tiny_model
from paged_core import BackendNotFoundError, InputError, UnsupportedSpecError


def test_enable_returns_one_registered_name_per_backend_and_options():
    from transformers import AttentionInterface

    name = paged_transformers.enable("reference")
    assert name == "paged|paged-reference"
    assert paged_transformers.enable("reference") == name
    assert name in AttentionInterface._global_mapping
    other = paged_transformers.enable("reference", validate=True)
    assert other != name and other in AttentionInterface._global_mapping


def test_names_never_contain_flash():
    # transformers imports any implementation whose name contains "flash" as a flash-attention
    # package (or downloads it from the Hub).
    assert "flash" not in paged_transformers.implementation_name("flashinfer", {})
    assert "flash" not in paged_transformers.implementation_name("flash-attn2", {"x": "flash"})


def test_unknown_backend_is_the_registry_error():
    with pytest.raises(BackendNotFoundError, match="flashinfr"):
        paged_transformers.enable("flashinfr")


@pytest.mark.parametrize("version", ["5.17.0", "5.18.0", "5.18.3"])
def test_supported_releases(version):
    assert paged_transformers.check_transformers_version(version) == version


@pytest.mark.parametrize("version, says", [
    ("5.19.0", "from 5.19 its continuous batching accepts only"),
    ("5.24.0", "from 5.19 its continuous batching accepts only"),
    ("5.16.1", "predates"),
])
def test_releases_without_a_hook_are_refused(version, says):
    with pytest.raises(UnsupportedSpecError, match=says) as info:
        paged_transformers.check_transformers_version(version)
    assert "pip install 'transformers>=5.17,<5.19'" in str(info.value)


def test_sliding_window_layer_is_refused_by_name():
    name = paged_transformers.enable("reference")
    # The same implementation served an all-full-attention model first: its checks are per model.
    ok = generate(tiny_model("qwen3"), name, random_prompts([3]), max_new_tokens=1)
    assert ok.errors == {"req_0": None}
    # Qwen3 with layer 1 on a sliding window (layer 0 stays full attention).
    model = tiny_model("qwen3", use_sliding_window=True, sliding_window=8, max_window_layers=1)
    run = generate(model, name, random_prompts([3]), max_new_tokens=1)
    (error,) = run.errors.values()
    assert "layer 1 (Qwen3Attention) is a sliding-window layer (window 8)" in error


def test_a_plain_forward_is_refused():
    model = tiny_model("llama")
    model.set_attn_implementation(paged_transformers.enable("reference"))
    with pytest.raises(InputError, match="without transformers' paged cache"):
        model(torch.tensor([[1, 2, 3]]))
