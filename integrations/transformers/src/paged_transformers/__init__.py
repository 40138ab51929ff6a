"""paged-transformers: Hugging Face transformers' continuous batching on any paged backend.

Usage::

    import paged_transformers
    name = paged_transformers.enable("triton-unified")
    model.set_attn_implementation(name)
    outputs = model.generate_batch(prompts)

Every full-attention layer then runs through the backend, with one ``BatchMeta`` and one
``plan`` per step shared by all layers: on transformers 5.17/5.18 it writes and reads
transformers' own paged pools (viewed, never copied); on 5.24 and 5.25, whose model writes the
pool itself, it reads the K/V transformers gathered from it. Supported: transformers 5.17, 5.18,
5.24 and 5.25 (the table :data:`SUPPORTED` in :mod:`paged_transformers._versions`).
"""

from ._attention import PagedAttention, captures_whole_steps, enable, implementation_name, register
from ._bench import describe_environment, qwen3_shaped_model
from ._meta import batch_meta_from_gathered, batch_meta_from_transformers
from ._versions import HOOKS, SUPPORTED, TESTED, Hook, Release, check_transformers_version, hook_of

__version__ = "0.1.0"

__all__ = [
    "HOOKS",
    "SUPPORTED",
    "TESTED",
    "Hook",
    "PagedAttention",
    "Release",
    "batch_meta_from_gathered",
    "batch_meta_from_transformers",
    "captures_whole_steps",
    "check_transformers_version",
    "describe_environment",
    "hook_of",
    "enable",
    "implementation_name",
    "qwen3_shaped_model",
    "register",
]
