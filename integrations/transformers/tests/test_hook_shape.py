"""The installed transformers still offers the hook its table entry names, in the shape paged relies on.

``paged_transformers._versions.SUPPORTED`` maps a release to a hook by its version number; these
tests check the hook itself (the registration API, how the attention function is called, the
step's keyword arguments, the cache attributes, the name checks on the way to continuous
batching), so that a release that changes any of it fails here with what changed, not deep
inside ``generate_batch``, even when its version number is in the table.
"""

from __future__ import annotations

import inspect
import types

import paged_transformers
import pytest
import torch
import transformers
from conftest import HOOK, generate, random_prompts, tiny_model
from paged_core import registry
from paged_transformers import HOOKS, PagedAttention, implementation_name

VERSION = transformers.__version__
SPEC = HOOKS[HOOK]
#: How transformers' attention modules call the attention function, as transformers' own
#: implementations declare it (dropout and scaling come as keywords).
POSITIONAL = ["module", "query", "key", "value", "attention_mask"]
#: What paged's pool hook reads from transformers' cache object (paged_transformers._attention._view_pool).
POOL_CACHE_ATTRIBUTES = {
    "5.17": ("layer_index_to_group_indices", "key_cache", "value_cache", "block_size", "sliding_windows"),
    "5.18": ("get_cache_for_block_table", "layer_to_allocator"),
}


def changed(what: str) -> str:
    return (
        f"transformers {VERSION} changed the {HOOK!r} hook through which paged-transformers reaches its "
        f"attention function: {what}. Adapt paged_transformers/_attention.py to this release and list it "
        "in paged_transformers._versions.SUPPORTED, or install a release the table lists "
        f"({', '.join(paged_transformers.TESTED)})"
    )


def _probe_name() -> str:
    return implementation_name("reference", {"probe": "shape"}, hook=HOOK)


def test_the_registration_api():
    from transformers import AttentionInterface
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    params = list(inspect.signature(AttentionInterface.register).parameters)
    assert params == ["key", "value"], changed(f"AttentionInterface.register takes {params}, not (key, value)")
    name = paged_transformers.register(PagedAttention(registry.get("reference"), _probe_name()))
    found = ALL_ATTENTION_FUNCTIONS.get_interface(name, None)
    assert isinstance(found, PagedAttention) and found.name == name, changed(
        f"a function registered as {name!r} is looked up as {found!r}"
    )


def test_the_attention_function_is_called_as_transformers_own():
    from transformers import AttentionInterface

    own = AttentionInterface._global_mapping.get(SPEC.stands_in_for)
    assert own is not None, changed(
        f"it no longer registers {SPEC.stands_in_for!r}, the implementation whose place a paged name takes"
    )
    params = list(inspect.signature(own).parameters)
    assert params[: len(POSITIONAL)] == POSITIONAL, changed(
        f"its own {SPEC.stands_in_for!r} function takes {params}, not {POSITIONAL} first"
    )
    for keyword in ("dropout", "scaling"):
        assert keyword in params, changed(f"its own {SPEC.stands_in_for!r} function has no {keyword!r} parameter")
    ours = list(inspect.signature(PagedAttention.__call__).parameters)[1:]
    assert ours[: len(POSITIONAL) + 2] == [*POSITIONAL, "dropout", "scaling"]


def test_the_step_passes_the_keyword_arguments_paged_reads():
    from transformers.generation.continuous_batching.input_outputs import PagedAttentionArgs

    passed = set(PagedAttentionArgs.__annotations__)
    missing = sorted(set(SPEC.step_kwargs) - passed)
    assert not missing, changed(
        f"a continuous-batching step (PagedAttentionArgs) no longer passes {missing}; it passes {sorted(passed)}"
    )


def test_continuous_batching_keeps_the_name():
    """transformers' check of the implementation name before a generate_batch keeps paged's name."""
    from transformers.generation.continuous_batching.continuous_api import ContinuousBatchingManager

    name = _probe_name()
    renamed = []
    model = types.SimpleNamespace(
        config=types.SimpleNamespace(_attn_implementation=name),
        dtype=torch.float32,
        _supports_flash_attn=True,
        set_attn_implementation=renamed.append,
    )
    try:
        ContinuousBatchingManager.switch_to_cb_friendly_attn(types.SimpleNamespace(), model)
    except ValueError as exc:
        pytest.fail(changed(f"continuous batching refuses the name {name!r}: {exc}"))
    assert not renamed, changed(f"continuous batching switches {name!r} to {renamed[0]!r}")


@pytest.mark.skipif(HOOK != "gathered", reason="the pool hook's names contain no 'flash'")
def test_the_flash_loader_takes_a_recorded_name():
    """The gathered hook's names contain "flash": set_attn_implementation loads them as flash
    attention unless transformers' loader records them as loaded, which register() does."""
    from transformers import modeling_flash_attention_utils as loader
    from transformers.utils.generic import is_flash_attention_requested

    name = _probe_name()
    assert is_flash_attention_requested(requested_attention_implementation=name), changed(
        f"{name!r} is no longer taken for a flash implementation, which continuous batching requires"
    )
    assert not is_flash_attention_requested(requested_attention_implementation=name, version=[2, 3]), changed(
        f"{name!r} reads as flash-attention 2 or 3, which turns on transformers' decode fast path"
    )
    assert hasattr(loader, "_loaded_implementation"), changed(
        "modeling_flash_attention_utils has no _loaded_implementation"
    )
    before = loader._loaded_implementation
    # Two names: the loader keeps one, and register() records one that stands for every name.
    other = implementation_name("reference", {"probe": "shape-2"}, hook=HOOK)
    try:
        for each in (name, other):
            paged_transformers.register(PagedAttention(registry.get("reference"), each))
        for each in (name, other, name):
            try:
                loader.lazy_import_flash_attention(each)
            except Exception as exc:  # any failure here is the change to report
                pytest.fail(changed(f"its flash-attention loader looks a recorded name ({each!r}) up anyway: {exc!r}"))
    finally:
        loader._loaded_implementation = before


class _Probe(PagedAttention):
    """The reference backend's adapter, recording what transformers hands it at each call
    (transformers' per-step tensors are views of buffers that later steps overwrite)."""

    def __init__(self) -> None:
        super().__init__(registry.get("reference"), _probe_name())
        self.calls: list[dict] = []

    def __call__(self, *args, **kwargs):
        seen = dict(num_args=len(args), kwargs=sorted(kwargs))
        if len(args) == len(POSITIONAL):
            module, query, key, value, _ = args
            seen.update(
                layer_idx=getattr(module, "layer_idx", None),
                query=list(query.shape),
                key=list(key.shape),
                value=list(value.shape),
            )
        if "cache" in kwargs:
            seen["cache"] = type(kwargs["cache"]).__name__
            seen["cache_has"] = [
                release
                for release, names in POOL_CACHE_ATTRIBUTES.items()
                if all(hasattr(kwargs["cache"], n) for n in names)
            ]
        if isinstance(kwargs.get("cu_seq_lens_k"), torch.Tensor):
            seen["rows"] = int(kwargs["cu_seq_lens_k"][-1])
        self.calls.append(seen)
        return super().__call__(*args, **kwargs)


def test_what_the_attention_function_receives():
    model = tiny_model("llama")
    probe = _Probe()
    paged_transformers.register(probe)
    run = generate(model, probe.name, random_prompts([3, 6]), max_new_tokens=2)
    assert probe.calls, changed(
        f"generate_batch never called the function registered as {probe.name!r}; its requests report {run.errors}"
    )
    config = model.config
    for seen in probe.calls:
        assert seen["num_args"] == len(POSITIONAL), changed(
            f"the function gets {seen['num_args']} positional arguments, not {POSITIONAL}"
        )
        assert isinstance(seen["layer_idx"], int), changed("the module has no int layer_idx")
        query, key = seen["query"], seen["key"]
        assert len(query) == 4 and query[:2] == [1, config.num_attention_heads], changed(
            f"query is {query}, not [1, num_heads, num_tokens, head_dim]"
        )
        assert len(key) == 4 and key[:2] == [1, config.num_key_value_heads] and seen["value"] == key, changed(
            f"key/value are {key}/{seen['value']}, not [1, num_kv_heads, rows, head_dim]"
        )
        missing = sorted({*SPEC.step_kwargs, "scaling"} - set(seen["kwargs"]))
        assert not missing, changed(f"the function no longer gets {missing}; it gets {seen['kwargs']}")
        if HOOK == "pool":
            assert seen["cache_has"], changed(
                f"its cache ({seen['cache']}) has neither 5.17's nor 5.18's attributes: {POOL_CACHE_ATTRIBUTES}"
            )
        else:
            assert key[2] >= seen.get("rows", 0), changed(
                f"key holds {key[2]} rows, fewer than the {seen.get('rows')} of the requests' gathered K/V "
                "(cu_seq_lens_k[-1])"
            )
    assert run.errors == {r: None for r in run.errors}, run.errors


def test_a_changed_shape_fails_these_checks_with_what_changed(monkeypatch):
    """The checks above fail, naming the change, on a release whose hook changed shape."""
    from transformers import AttentionInterface
    from transformers.generation.continuous_batching.input_outputs import PagedAttentionArgs

    renamed = {k: v for k, v in PagedAttentionArgs.__annotations__.items() if k != "write_index"}
    monkeypatch.setattr(PagedAttentionArgs, "__annotations__", {**renamed, "write_indices": list})
    with pytest.raises(AssertionError, match=r"changed the .* hook .*no longer passes \['write_index'\]"):
        test_the_step_passes_the_keyword_arguments_paged_reads()
    monkeypatch.setattr(AttentionInterface, "register", classmethod(lambda cls, name, fn, *, local=False: None))
    with pytest.raises(AssertionError, match=r"AttentionInterface.register takes \['name', 'fn', 'local'\]"):
        test_the_registration_api()
