"""The CUSTOM (paged) backend's answers to vLLM, without running an engine: capabilities as vLLM's
reasons, the pool views, the CUDA-graph level, the plugin's registration."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
from paged_core import BatchMeta, Capabilities, InputError, KVCache, ReferenceBackend, registry
from paged_vllm import _backend, _cpu, register
from paged_vllm._backend import PagedAttentionBackend, PagedAttentionImpl, cudagraph_support, pool_view
from paged_vllm._meta import batch_meta_from_vllm

VALIDATE = dict(
    dtype=torch.float32,
    kv_cache_dtype="auto",
    block_size=32,
    use_mla=False,
    has_sink=False,
    use_sparse=False,
    use_mm_prefix=False,
    use_per_head_quant_scales=False,
    device_capability=None,
    attn_type="decoder",
)


class _NoWindow(ReferenceBackend):
    name = "no-window"
    capabilities = Capabilities(head_dims=frozenset({64}), dtypes=frozenset({torch.float16}))


@pytest.fixture
def use(monkeypatch):
    """Make paged_vllm use backend instance ``b`` (by its name) in this test."""

    def _use(b):
        monkeypatch.setitem(_backend._INSTANCES, b.name, b)
        monkeypatch.setenv(_backend.BACKEND_ENV, b.name)
        return b

    return _use


def test_supported_configuration_has_no_reasons(monkeypatch):
    monkeypatch.setenv(_backend.BACKEND_ENV, "triton-unified")
    assert PagedAttentionBackend.validate_configuration(head_size=32, **VALIDATE) == []


def test_capabilities_become_vllm_reasons(monkeypatch):
    monkeypatch.setenv(_backend.BACKEND_ENV, "triton-unified")
    reasons = PagedAttentionBackend.validate_configuration(
        head_size=24, **{**VALIDATE, "kv_cache_dtype": "int4_per_token_head", "use_mla": True}
    )
    assert any(r.startswith("triton-unified: head_dim 24 is not supported (accepted: 32,") for r in reasons), reasons
    refusal = (
        "kv_cache_dtype 'int4_per_token_head' is not supported; accepted: 'auto', 'fp8' / 'fp8_e4m3', "
        "'fp8_e5m2' (codes with vLLM's per-tensor scales"
    )
    assert any(refusal in r for r in reasons), reasons
    assert any("paged's int4 is symmetric and unrotated" in r for r in reasons), reasons
    assert "MLA (latent attention) is not supported" in reasons
    assert len(reasons) == 3


@pytest.mark.parametrize("kv_cache_dtype", ["fp8", "fp8_e4m3", "fp8_e5m2"])
def test_vllms_fp8_caches_are_paged_static_scale_caches(monkeypatch, kv_cache_dtype):
    monkeypatch.setenv(_backend.BACKEND_ENV, "triton-unified")
    assert (
        PagedAttentionBackend.validate_configuration(head_size=32, **{**VALIDATE, "kv_cache_dtype": kv_cache_dtype})
        == []
    )
    assert kv_cache_dtype in PagedAttentionBackend.supported_kv_cache_dtypes
    impl = PagedAttentionImpl(4, 32, 32**-0.5, 2, kv_cache_dtype=kv_cache_dtype)
    spec = impl.spec(16, "cpu")
    assert (spec.kv_dtype, spec.kv_scales) == ("fp8_e5m2" if kv_cache_dtype == "fp8_e5m2" else "fp8", "per_tensor")
    assert impl.reasons(16, "cpu") == []


def test_an_e5m2_pool_is_written_and_read_in_place_with_the_layers_scales(monkeypatch):
    """vLLM's fp8_e5m2 cache: e5m2 codes of x / scale in its uint8 pool, the layer's per-tensor
    scales (views, not copies), read back as code * scale."""
    monkeypatch.setenv(_backend.BACKEND_ENV, "reference")
    impl = PagedAttentionImpl(4, 8, 8**-0.5, 2, kv_cache_dtype="fp8_e5m2")
    pool = torch.zeros(3, 2, 4, 16, dtype=torch.uint8)  # [blocks, heads, block_size, 2 * head_size]
    layer = SimpleNamespace(
        _k_scale=torch.tensor([0.5]), _v_scale=torch.tensor([0.25]), layer_name="model.layers.0.self_attn.attn"
    )
    cache = impl._view(pool, layer)
    assert (cache.kv_dtype, cache.k.dtype, cache.kv_scales) == ("fp8_e5m2", torch.float8_e5m2, "per_tensor")
    assert cache.k_scale.data_ptr() == layer._k_scale.data_ptr()
    k = torch.tensor([[1.0, -3.0, 0.75, 1e5, 0, 0, 0, 0], [2.0, 0, 0, 0, 0, 0, 0, 0]]).expand(1, 2, 8)
    meta = BatchMeta.build([1], [1], block_size=4, num_blocks=3, seed=0)
    impl.backend.write(cache, k.contiguous(), k.contiguous(), meta)
    block, offset = divmod(int(meta.slot_mapping[0]), 4)
    # x / 0.5 in e5m2: 2, -6, 1.5 exactly; 2e5 saturates at 57344.
    want_k = torch.tensor([2.0, -6.0, 1.5, 57344.0, 0, 0, 0, 0]).to(torch.float8_e5m2).view(torch.uint8)
    assert torch.equal(pool[block, 0, offset, :8], want_k)
    assert torch.equal(pool[block, 1, offset, 8:9], torch.tensor([8.0]).to(torch.float8_e5m2).view(torch.uint8))
    kf, vf = cache.dequantized()
    assert kf[block, offset, 0, :4].tolist() == [1.0, -3.0, 0.75, 57344.0 * 0.5]
    assert vf[block, offset, 1, 0].item() == 2.0


def test_class_methods_follow_the_capabilities(use):
    use(_NoWindow())
    assert PagedAttentionBackend.get_supported_head_sizes() == [64]
    assert PagedAttentionBackend.supports_dtype(torch.float16)
    assert not PagedAttentionBackend.supports_dtype(torch.float32)
    assert not PagedAttentionBackend.supports_sliding_window()
    assert not PagedAttentionBackend.supports_sink()
    assert PagedAttentionBackend.get_supported_kernel_block_sizes()[0].base == 1  # any block size


def test_unknown_backend_is_a_reason_not_a_crash(monkeypatch):
    monkeypatch.setenv(_backend.BACKEND_ENV, "no-such-backend")
    reasons = PagedAttentionBackend.validate_configuration(head_size=32, **VALIDATE)
    assert len(reasons) == 1 and "no-such-backend" in reasons[0]


def test_layer_reasons_cover_what_vllm_and_paged_refuse(use):
    use(_NoWindow())
    impl = PagedAttentionImpl(
        4,
        32,
        32**-0.5,
        2,
        alibi_slopes=[1.0] * 4,
        sliding_window=8,
        kv_cache_dtype="fp8",
        attn_type="encoder_only",
        chunk_lookback=4,
    )
    reasons = impl.reasons(16, "cpu")
    # vLLM's fp8 cache is served as paged's fp8 cache: a backend without fp8 caches says so itself.
    impl_e5m2 = PagedAttentionImpl(4, 64, 64**-0.5, 2, kv_cache_dtype="fp8_e5m2")
    assert any("kv_dtype 'fp8_e5m2' is not supported (accepted: auto)" in r for r in impl_e5m2.reasons(16, "cpu")), (
        impl_e5m2.reasons(16, "cpu")
    )
    for expected in (
        "kv_dtype 'fp8' is not supported (accepted: auto)",
        "attention type 'encoder_only' is not supported",
        "ALiBi slopes are not supported",
        "the attention argument 'chunk_lookback' is not supported",
        "head_dim 32 is not supported (accepted: 64)",
        "dtype float32 is not supported",
        "sliding window attention is not supported",
    ):
        assert any(expected in r for r in reasons), (expected, reasons)


@pytest.mark.parametrize("order", [(0, 2, 1), (0, 1, 2), (1, 0, 2)], ids=["NHD", "HND", "head-outer"])
def test_pool_view_writes_and_reads_vllm_storage_in_place(order):
    """vLLM's logical [blocks, heads, block_size, 2 * head] cache, stored in three physical orders
    of its first three dimensions; a vLLM step of a 3-token prompt and a decode at position 5."""
    blocks, heads, bs, d = 6, 2, 4, 8
    logical = (blocks, heads, bs)
    storage = torch.zeros([logical[i] for i in order] + [2 * d])
    kv = storage.permute(*[order.index(i) for i in range(3)], 3)  # logical shape, physical strides
    assert tuple(kv.shape) == (blocks, heads, bs, 2 * d) and kv.data_ptr() == storage.data_ptr()
    cache = pool_view(kv, d)
    common = SimpleNamespace(
        num_reqs=2,
        num_actual_tokens=4,
        max_query_len=3,
        max_seq_len=6,
        query_start_loc=torch.tensor([0, 3, 4], dtype=torch.int32),
        query_start_loc_cpu=None,
        seq_lens=torch.tensor([3, 6], dtype=torch.int32),
        block_table_tensor=torch.tensor([[2, 0], [5, 1]], dtype=torch.int32),
        slot_mapping=torch.tensor([8, 9, 10, 5]),
    )
    meta = batch_meta_from_vllm(common, bs)
    k, v = torch.randn(4, heads, d), torch.randn(4, heads, d)
    backend = registry.get("reference")
    backend.write(cache, k, v, meta)
    for row, slot in enumerate([8, 9, 10, 5]):  # block 2 offsets 0-2; block 1 offset 1
        block, offset = divmod(slot, bs)
        assert torch.equal(kv[block, :, offset, :d], k[row])
        assert torch.equal(kv[block, :, offset, d:], v[row])
    assert int((storage != 0).sum()) == 4 * heads * 2 * d  # nothing else written
    q = torch.randn(4, 4, d)
    dense = KVCache(k=cache.k.contiguous(), v=cache.v.contiguous(), kv_dtype="auto", dtype=torch.float32)
    torch.testing.assert_close(backend.forward(q, cache, meta), backend.forward(q, dense, meta), rtol=0, atol=0)


@pytest.mark.parametrize("dtype", ["auto", "fp8", "int8_per_token_head", "fp8_per_token_head"])
def test_vllm_026_cache_shape_is_the_one_the_views_read(dtype):
    """vLLM 0.26 allocates each layer from ``get_kv_cache_shape`` permuted by
    ``get_kv_cache_stride_order``: the logical tensor it then hands to ``forward`` is one that
    ``pool_view`` / ``per_token_head_view`` accept, laid out NHD."""
    shape = PagedAttentionBackend.get_kv_cache_shape(5, 16, 2, 32, cache_dtype_str=dtype)
    order = PagedAttentionBackend.get_kv_cache_stride_order()
    per_token_head = dtype.endswith("per_token_head")
    assert shape == (5, 2, 16, 2 * (32 + 4 if per_token_head else 32))
    storage = torch.zeros([shape[i] for i in order], dtype=torch.int8 if per_token_head else torch.float32)
    kv = storage.permute(*[order.index(i) for i in range(4)])  # as vLLM 0.26 builds it
    assert tuple(kv.shape) == shape
    if per_token_head:
        cache = _backend.per_token_head_view(kv, 32, "int8", dtype=torch.bfloat16)
    else:
        cache = pool_view(kv, 32)
    assert cache.k.stride() == (16 * 2 * kv.shape[-1], 2 * kv.shape[-1], kv.shape[-1], 1)  # NHD
    with_layers = PagedAttentionBackend.get_kv_cache_stride_order(include_num_layers_dimension=True)
    assert sorted(with_layers) == [0, 1, 2, 3, 4]


def test_pool_view_refuses_another_layout():
    with pytest.raises(InputError, match=r"accepted: \[num_blocks, num_kv_heads, block_size, 2 \* 32\]"):
        pool_view(torch.zeros(4, 2, 16, 32), 32)


class _Graphs(ReferenceBackend):
    capabilities = Capabilities(cuda_graphs=True)


class _GraphsOwnWrite(_Graphs):
    def _write(self, cache, k, v, slot_mapping):
        raise NotImplementedError


def test_cudagraph_level_needs_graph_safe_kernels_and_write():
    from vllm.v1.attention.backend import AttentionCGSupport

    assert cudagraph_support(ReferenceBackend()) is AttentionCGSupport.NEVER
    assert cudagraph_support(_Graphs()) is AttentionCGSupport.NEVER  # paged_core.write_kv syncs
    # Decode graphs only: a capture fixes the tile classes chosen from the captured batch.
    assert cudagraph_support(_GraphsOwnWrite()) is AttentionCGSupport.UNIFORM_SINGLE_TOKEN_DECODE


def test_register_is_idempotent_and_overrides_cpu_attention_by_path():
    from vllm.v1.attention.backends.registry import AttentionBackendEnum

    register()
    register()
    assert AttentionBackendEnum.CUSTOM.get_path() == "paged_vllm._backend.PagedAttentionBackend"
    assert AttentionBackendEnum.CPU_ATTN.get_path() == "paged_vllm._cpu.CPUAttentionBackend"
    # With no configuration asking for CUSTOM, CPU_ATTN stays vLLM's own backend.
    from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackend

    assert AttentionBackendEnum.CPU_ATTN.get_class() is CPUAttentionBackend
    with pytest.raises(AttributeError):
        _cpu.Other  # noqa: B018


def test_vllms_cache_release_drops_the_view_so_the_pool_can_be_freed(monkeypatch):
    """vLLM frees a KV pool (teardown, the end of memory profiling) with clear_layer_kv_caches:
    the impl's cached view must not keep the pool's storage alive past it."""
    import gc
    import weakref

    from vllm.v1.worker.utils import clear_layer_kv_caches

    monkeypatch.setenv(_backend.BACKEND_ENV, "reference")
    impl = PagedAttentionImpl(4, 32, 32**-0.5, 2)
    pool = torch.zeros(3, 2, 16, 64)
    layer = SimpleNamespace(impl=impl, kv_cache=pool, layer_name="model.layers.0.self_attn.attn")
    view = impl._view(pool, layer)
    assert impl._view(pool, layer) is view  # cached: one view per bound tensor
    alive = weakref.ref(pool.untyped_storage())
    del view, pool
    clear_layer_kv_caches([layer])
    gc.collect()
    assert impl._cache is None and alive() is None


def test_a_default_backend_that_is_not_installed_names_itself_and_its_install(monkeypatch):
    # The default (triton-unified) missing used to fail deep in vLLM's engine process with the
    # registry's "Unknown backend", which said nothing of PAGED_VLLM_BACKEND or its default.
    import importlib.metadata

    from paged_core import BackendNotFoundError, Registry

    real = importlib.metadata.entry_points

    def entry_points(**params):  # triton-unified uninstalled, as far as the registry can tell
        eps = real(**params)
        if params.get("group") != "paged_core":
            return eps
        return importlib.metadata.EntryPoints(ep for ep in eps if ep.name != _backend.DEFAULT_BACKEND)

    monkeypatch.setattr(importlib.metadata, "entry_points", entry_points)
    monkeypatch.setenv("PAGED_PLUGINS", "reference")
    monkeypatch.delenv(_backend.BACKEND_ENV, raising=False)
    monkeypatch.setattr(_backend, "registry", Registry())
    monkeypatch.setattr(_backend, "_INSTANCES", {})
    with pytest.raises(BackendNotFoundError) as exc:
        _backend.paged_backend()
    msg = str(exc.value)
    assert msg.startswith(
        "paged-vllm cannot serve --attention-backend CUSTOM with paged backend 'triton-unified' "
        "(PAGED_VLLM_BACKEND is unset: the default). Unknown backend 'triton-unified'."
    )
    assert "To install it: pip install --find-links dist 'paged-core[triton]'" in msg
    assert msg.endswith("Or set PAGED_VLLM_BACKEND to a backend that runs here: reference.")
