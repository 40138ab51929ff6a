"""enable(): names, errors, supported releases and the layers paged refuses."""

from __future__ import annotations

import dataclasses
import re

import paged_transformers
import pytest
import torch
from conftest import HOOK, TRANSFORMERS_PAGED, generate, random_prompts, tiny_model
from paged_core import BackendNotFoundError, InputError, UnsupportedSpecError, registry
from paged_transformers import PagedAttention, implementation_name


def test_enable_returns_one_registered_name_per_backend_and_options():
    from transformers import AttentionInterface

    name = paged_transformers.enable("reference")
    assert name == {"pool": "paged|paged-reference", "gathered": "paged-reference+flash"}[HOOK]
    assert paged_transformers.enable("reference") == name
    assert name in AttentionInterface._global_mapping
    other = paged_transformers.enable("reference", validate=True)
    assert other != name and other in AttentionInterface._global_mapping


def test_every_enabled_backend_keeps_its_name():
    """Two backends enabled in one process both stay usable, in any order. On 5.24/5.25 the
    second enable() made the first name unknown to transformers' flash-attention loader ("Could
    not find the currently requested flash attention implementation at `paged-reference+flash`")."""
    model = tiny_model("llama")
    prompts = random_prompts([3, 9])
    want = generate(model, TRANSFORMERS_PAGED, prompts, max_new_tokens=2)
    first = paged_transformers.enable("reference")
    second = paged_transformers.enable("triton-unified")
    for name in (first, second, first, "sdpa", second, first):
        model.set_attn_implementation(name)
        if name != "sdpa":
            run = generate(model, name, prompts, max_new_tokens=2)
            assert run.errors == {r: None for r in run.errors}, (name, run.errors)
            assert run.tokens == want.tokens, name


def test_pool_names_never_contain_flash():
    # transformers 5.17 imports any implementation whose name contains "flash" as a
    # flash-attention package (or downloads it from the Hub).
    assert "flash" not in implementation_name("flashinfer", {})
    assert "flash" not in implementation_name("flash-attn2", {"x": "flash"})


def test_gathered_names_hold_one_flash_marker_at_the_end():
    # transformers 5.24's continuous batching accepts custom names only with "flash" in them, and
    # takes "flash" followed by a 2 or 3 for flash-attention 2/3 (its decode fast path).
    for backend in ("flashinfer", "flash-attn2", "triton-unified"):
        name = implementation_name(backend, {"x": "flash3"}, hook="gathered")
        assert name.count("flash") == 1 and name.endswith("+flash"), name
        assert not re.match(r".*flash.*[23]", name), name


def test_a_backend_named_flash_runs_without_any_lookup():
    """A backend whose name contains "flash" is served by its adapter, never resolved as a
    flash-attention package or Hub kernel (the reference backend stands in for it here: the
    vendor libraries are not installed on a CPU)."""
    model = tiny_model("llama")
    prompts = random_prompts([3, 9, 1])
    want = generate(model, TRANSFORMERS_PAGED, prompts, max_new_tokens=2)
    name = implementation_name("flash-attn2", {}, hook=HOOK)
    adapter = PagedAttention(registry.get("reference"), name)
    paged_transformers.register(adapter)
    calls = []
    original = adapter.backend.forward
    adapter.backend.forward = lambda *a, **k: calls.append(1) or original(*a, **k)
    try:
        run = generate(model, name, prompts, max_new_tokens=2)
    finally:
        del adapter.backend.forward
    assert run.errors == {r: None for r in run.errors}, run.errors
    assert run.tokens == want.tokens
    assert len(calls) == len(run.logits) * model.config.num_hidden_layers


def test_unknown_backend_is_the_registry_error():
    with pytest.raises(BackendNotFoundError, match="flashinfr"):
        paged_transformers.enable("flashinfr")


@pytest.mark.parametrize("version", ["5.17.0", "5.18.0", "5.18.3", "5.24.0", "5.24.1", "5.25.0", "5.25.2"])
def test_supported_releases(version):
    assert paged_transformers.check_transformers_version(version) == version


def test_the_table_names_each_release_once_with_a_known_hook():
    from paged_transformers import HOOKS, SUPPORTED

    for key, release in SUPPORTED.items():
        assert release.hook in HOOKS, (key, release)
        assert release.tested.startswith(key + "."), (key, release)
        assert paged_transformers.hook_of(release.tested) == release.hook
    assert paged_transformers.TESTED == tuple(r.tested for r in SUPPORTED.values())


def test_one_line_in_the_table_supports_a_release(monkeypatch):
    from paged_transformers import SUPPORTED, Release

    with pytest.raises(UnsupportedSpecError, match="newer than the newest release"):
        paged_transformers.check_transformers_version("5.26.0")
    monkeypatch.setitem(SUPPORTED, "5.26", Release("gathered", "5.26.0"))
    assert paged_transformers.hook_of("5.26.1") == "gathered"
    assert paged_transformers.check_transformers_version("5.26.1") == "5.26.1"


def test_the_distribution_requires_exactly_the_supported_releases():
    """pyproject.toml's transformers range admits the table's releases and no other."""
    import pathlib
    import tomllib

    from packaging.requirements import Requirement
    from paged_transformers import SUPPORTED

    pyproject = pathlib.Path(__file__).resolve().parents[1] / "pyproject.toml"
    (spec,) = [
        Requirement(d).specifier
        for d in tomllib.loads(pyproject.read_text())["project"]["dependencies"]
        if Requirement(d).name == "transformers"
    ]
    admitted = {f"5.{minor}" for minor in range(10, 40) if spec.contains(f"5.{minor}.0")}
    assert admitted == set(SUPPORTED), f"pyproject.toml requires transformers{spec}; the table: {sorted(SUPPORTED)}"


def test_ci_runs_the_tests_on_the_newest_supported_release():
    """noxfile.py's transformers pins are tested releases of the table, the newest among them."""
    import pathlib

    from paged_transformers import SUPPORTED

    noxfile = pathlib.Path(__file__).resolve().parents[3] / "noxfile.py"
    pins = re.findall(r'"transformers==([0-9.]+)"', noxfile.read_text())
    assert pins and set(pins) <= set(paged_transformers.TESTED), (pins, paged_transformers.TESTED)
    newest = max(SUPPORTED, key=lambda key: tuple(map(int, key.split("."))))
    assert SUPPORTED[newest].tested in pins, f"noxfile.py pins {pins}, not the newest release {newest}"


@pytest.mark.parametrize(
    "version, says",
    [
        ("5.19.0", "5.19 to 5.23 are untested"),
        ("5.23.2", "5.19 to 5.23 are untested"),
        ("5.26.0", "newer than the newest release paged-transformers was tested with (5.25.0)"),
        ("6.0.0", "newer than the newest release"),
        ("5.16.1", "predates"),
    ],
)
def test_releases_without_a_tested_hook_are_refused(version, says):
    with pytest.raises(UnsupportedSpecError, match=re.escape(says)) as info:
        paged_transformers.check_transformers_version(version)
    assert f"transformers {version}" in str(info.value)
    assert "accepted: transformers 5.17.x, 5.18.x, 5.24.x or 5.25.x" in str(info.value)
    assert "(tested: 5.17.0, 5.18.0, 5.24.0, 5.25.0)" in str(info.value)
    assert "pip install 'transformers==5.25.0'" in str(info.value)


def test_enable_refuses_an_untested_release_with_what_is_supported(monkeypatch):
    # By its dotted name: transformers may replace its module object in sys.modules after an import.
    monkeypatch.setattr("transformers.__version__", "5.26.0")
    with pytest.raises(UnsupportedSpecError, match=r"transformers 5\.26\.0 is newer.*accepted: transformers 5\.17\.x"):
        paged_transformers.enable("reference")


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
    with pytest.raises(InputError, match="it serves continuous batching only"):
        model(torch.tensor([[1, 2, 3]]))


def test_a_module_without_layer_idx_is_refused():
    adapter = PagedAttention(registry.get("reference"), "paged|reference-no-layer-idx", hook="pool")
    q, kv = torch.zeros(1, 4, 3, 8), torch.zeros(1, 2, 3, 8)
    with pytest.raises(InputError, match=r"Module has layer_idx None; .* accepted: attention modules with an int"):
        adapter(torch.nn.Module(), q, kv, kv, None, cache=object(), write_index=[0, 1, 2])


@pytest.mark.parametrize(
    "claims, says",
    [
        (dict(cuda_graphs=False), "does not claim to be safe in (capabilities.cuda_graphs is False)"),
        (dict(cuda_graphs=True, device_plan=False), "plans on the host (capabilities.device_plan is False"),
    ],
)
def test_a_capture_is_refused_for_backends_that_cannot_be_captured_whole(claims, says, monkeypatch):
    """transformers captures whole steps, the plan included: both claims are needed (FlashInfer
    plans on the host; inside the capture it failed on a host-to-device copy)."""
    from paged_core._reference import ReferenceBackend
    from paged_transformers import _attention

    monkeypatch.setattr(ReferenceBackend, "capabilities", dataclasses.replace(ReferenceBackend.capabilities, **claims))
    monkeypatch.setattr(_attention, "_capturing", lambda: True)
    run = generate(tiny_model("llama"), paged_transformers.enable("reference"), random_prompts([3]), max_new_tokens=1)
    (error,) = run.errors.values()
    assert "running inside a CUDA-graph capture" in error and says in error
    assert "use_cuda_graph=False" in error


def test_a_capture_runs_backends_that_claim_graphs_and_plan_on_the_device(monkeypatch):
    from paged_core._reference import ReferenceBackend
    from paged_transformers import _attention

    monkeypatch.setattr(
        ReferenceBackend, "capabilities", dataclasses.replace(ReferenceBackend.capabilities, cuda_graphs=True)
    )
    monkeypatch.setattr(_attention, "_capturing", lambda: True)
    run = generate(tiny_model("llama"), paged_transformers.enable("reference"), random_prompts([3]), max_new_tokens=1)
    assert run.errors == {"req_0": None}


def test_enable_checks_the_backend_and_options_before_naming_them():
    # enable(None) was a raw TypeError; enable("reference", validate="True") after
    # enable("reference", validate=True) was accepted, its name being the same.
    with pytest.raises(InputError, match="backend name is None"):
        paged_transformers.enable(None)
    paged_transformers.enable("reference", validate=True)
    with pytest.raises(InputError, match="validate is 'True'; accepted: True, False, or None"):
        paged_transformers.enable("reference", validate="True")
