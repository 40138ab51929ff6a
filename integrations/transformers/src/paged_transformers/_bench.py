"""What the integration's scripts share: the line naming where a measurement ran, and the
random-initialised model they measure."""

from __future__ import annotations

import datetime
import importlib.util
import platform
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import transformers

__all__ = ["describe_environment", "qwen3_shaped_model"]


def _cpu() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        return f"{names[0]} ({len(names)} cores)" if names else platform.machine()
    except OSError:
        return platform.machine()


def describe_environment() -> str:
    """Date, host, CPU, GPU (if any), and the Python, torch, transformers and Triton versions.

    >>> "torch" in describe_environment()
    True
    """
    import torch
    import transformers

    parts = [datetime.date.today().isoformat(), platform.node(), _cpu()]
    if torch.cuda.is_available():
        parts.append(torch.cuda.get_device_name())
    parts += [
        f"Python {platform.python_version()}",
        f"torch {torch.__version__}",
        f"transformers {transformers.__version__}",
    ]
    if importlib.util.find_spec("triton") is not None:
        import triton

        parts.append(f"triton {triton.__version__}")
    return ", ".join(parts)


def qwen3_shaped_model(
    layers: int, *, small: bool = False, dtype: torch.dtype | None = None, device: torch.device | str = "cpu"
) -> transformers.PreTrainedModel:
    """A random-initialised Qwen3 with Qwen3-8B's attention and width (32 query heads, 8 KV
    heads, head_dim 128, hidden 4096) and ``layers`` layers; ``small``: tiny dims for a CPU
    smoke run. Seeded, in eval mode; nothing is downloaded."""
    import torch
    import transformers

    dims: dict[str, Any]
    if small:
        dims = dict(
            hidden_size=64,
            intermediate_size=128,
            num_attention_heads=4,
            num_key_value_heads=2,
            head_dim=32,
            vocab_size=128,
        )
    else:
        dims = dict(
            hidden_size=4096,
            intermediate_size=12288,
            num_attention_heads=32,
            num_key_value_heads=8,
            head_dim=128,
            vocab_size=151936,
        )
    config = transformers.Qwen3Config(
        num_hidden_layers=layers, max_position_embeddings=32768, initializer_range=0.02, **dims
    )
    torch.manual_seed(0)
    with torch.device(device):
        model = transformers.AutoModelForCausalLM.from_config(config, dtype=dtype or torch.float32)
    return model.eval()
