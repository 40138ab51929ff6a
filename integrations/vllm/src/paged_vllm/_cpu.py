"""The CPU platform's attention backend, as vLLM resolves it once this plugin is loaded.

vLLM 0.32's CPU platform returns ``CPU_ATTN`` for every non-MLA layer, whatever backend the
configuration names (``CpuPlatform.get_attn_backend_cls``). It returns it by path, through
``AttentionBackendEnum.CPU_ATTN.get_path()``, which honours ``register_backend`` overrides: the
plugin points that path here, and :func:`__getattr__` answers with paged's backend when the
current configuration asks for ``CUSTOM`` (``--attention-backend CUSTOM``), and with vLLM's own
``CPUAttentionBackend`` otherwise, so a run that does not ask for paged is unchanged.
"""

from __future__ import annotations

from typing import Any

#: The attribute the CPU_ATTN override names (``paged_vllm._cpu.CPUAttentionBackend``).
ATTRIBUTE = "CPUAttentionBackend"


def __getattr__(name: str) -> Any:
    if name != ATTRIBUTE:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from vllm.config import get_current_vllm_config_or_none

    from ._backend import ENUM_NAME

    config = get_current_vllm_config_or_none()
    chosen = None if config is None else config.attention_config.backend
    if chosen is not None and chosen.name == ENUM_NAME:
        from ._backend import PagedAttentionBackend, paged_backend

        paged_backend()  # a paged backend that cannot run here fails now, with its fix, not mid-setup
        return PagedAttentionBackend
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    return CPUAttentionBackend
