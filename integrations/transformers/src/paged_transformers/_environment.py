"""One line naming where a measurement ran: what the integration's scripts print and record."""

from __future__ import annotations

import datetime
import importlib.util
import platform

__all__ = ["describe_environment"]


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
    parts += [f"Python {platform.python_version()}", f"torch {torch.__version__}",
              f"transformers {transformers.__version__}"]
    if importlib.util.find_spec("triton") is not None:
        import triton

        parts.append(f"triton {triton.__version__}")
    return ", ".join(parts)
