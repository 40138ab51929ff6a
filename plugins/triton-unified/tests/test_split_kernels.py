"""Split-KV (Flash-Decoding), merge and cascade kernels against a float64 PyTorch reference.

Runs on the CPU under TRITON_INTERPRET=1 (set below when no GPU is present, before Triton is
imported) and unchanged on a GPU. Shapes are tiny on purpose: the interpreter runs every
program in NumPy.
"""

from __future__ import annotations

import math
import os
import sys
from pathlib import Path

import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "src"))

from paged_conformance.tolerances import assert_close_to_reference, lse_tolerance, output_tolerance
from paged_core import InputError
from paged_core import merge_states as merge_states_torch
from paged_triton_unified import split_launch as split_launch
from paged_triton_unified.split_launch import (
    cascade_attention,
    choose_num_splits,
    merge_states,
    shared_prefix_blocks,
    split_decode_attention,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
HEAD_DIM = 64


# --------------------------------------------------------------------------------------------
# Reference and fixtures
# --------------------------------------------------------------------------------------------


def reference_attention(
    q,
    k_cache,
    v_cache,
    *,
    query_start_loc,
    seq_lens,
    block_table,
    scale,
    window=0,
    softcap=0.0,
    sinks=None,
    k_scale=None,
    v_scale=None,
):
    """Float64 oracle: (out [N, Hq, D] float64, lse [N, Hq] float64, natural log incl. sink)."""
    num_tokens, hq, d = q.shape
    num_blocks, bs, hkv, _ = k_cache.shape
    group = hq // hkv
    k = k_cache.double() if k_scale is None else k_cache.double() * k_scale.double()[..., None]
    v = v_cache.double() if v_scale is None else v_cache.double() * v_scale.double()[..., None]
    out = torch.zeros(num_tokens, hq, d, dtype=torch.float64)
    lse = torch.full((num_tokens, hq), float("-inf"), dtype=torch.float64)
    qsl, sl, bt = query_start_loc.tolist(), seq_lens.tolist(), block_table.tolist()
    for r in range(len(sl)):
        q_len, seq_len = qsl[r + 1] - qsl[r], sl[r]
        for i in range(q_len):
            pos = seq_len - q_len + i
            keys = []
            for j in range(max(0, pos + 1)):
                if j // bs >= len(bt[r]):
                    continue
                blk = bt[r][j // bs]
                if not 0 <= blk < num_blocks:  # the kernels mask invalid block ids
                    continue
                if window > 0 and j <= pos - window:
                    continue
                keys.append((blk, j % bs))
            if not keys:
                continue
            t = qsl[r] + i
            kk = torch.stack([k[b, o] for b, o in keys])  # [n, Hkv, D]
            vv = torch.stack([v[b, o] for b, o in keys])
            for h in range(hq):
                s = (kk[:, h // group] @ q[t, h].double()) * scale
                if softcap > 0:
                    s = softcap * torch.tanh(s / softcap)
                logits = s if sinks is None else torch.cat([s, sinks[h].double().view(1)])
                lse[t, h] = torch.logsumexp(logits, 0)
                p = torch.exp(s - lse[t, h])
                out[t, h] = p @ vv[:, h // group]
    return out, lse


def make_cache(num_blocks, block_size, hkv, dtype, kv_dtype=None, seed=0, head_dim=HEAD_DIM):
    """Random K/V; quantized caches hold symmetric per-(slot, head) codes and float32 scales."""
    g = torch.Generator().manual_seed(seed)
    k = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g)
    v = torch.randn(num_blocks, block_size, hkv, head_dim, generator=g)
    if kv_dtype is None:
        return k.to(dtype), v.to(dtype), None, None
    qmax = {torch.int8: 127.0, torch.float8_e4m3fn: 448.0, torch.float8_e5m2: 57344.0}[kv_dtype]
    caches = []
    for x in (k, v):
        sc = x.abs().amax(-1) / qmax
        codes = x / sc[..., None]
        codes = codes.round().clamp(-127, 127).to(torch.int8) if kv_dtype == torch.int8 else codes.to(kv_dtype)
        caches += [codes, sc.float()]
    return caches[0], caches[2], caches[1], caches[3]


def make_batch(seq_lens, block_size, num_blocks, max_blocks=None, seed=0, shared_prefix=0):
    """Shuffled, non-contiguous block table (block 0 reserved); unused entries hold garbage ids."""
    g = torch.Generator().manual_seed(seed)
    need = [math.ceil(s / block_size) for s in seq_lens]
    max_blocks = max_blocks or max(max(need), 1) + 1
    perm = (torch.randperm(num_blocks - 1, generator=g) + 1).tolist()
    prefix_ids = [perm.pop() for _ in range(shared_prefix)]
    bt = torch.full((len(seq_lens), max_blocks), -7, dtype=torch.int32)
    for r, n in enumerate(need):
        ids = prefix_ids[:n] + [perm.pop() for _ in range(max(0, n - shared_prefix))]
        bt[r, : len(ids)] = torch.tensor(ids, dtype=torch.int32)
        bt[r, len(ids) :: 2] = num_blocks + 5  # out-of-range ids past the context: never read
    return torch.tensor(seq_lens, dtype=torch.int32), bt


def decode_qsl(n):
    return torch.arange(n + 1, dtype=torch.int32)


def assert_close(out, ref, dtype, what="", kv="auto"):
    """The conformance suite's comparison and tolerance (NaN counts as an infinite error)."""
    assert_close_to_reference(out, ref, backend="triton-unified", case=what, tolerance=output_tolerance(dtype, kv))


def assert_lse_close(lse, ref_lse, dtype=torch.float32, kv="auto"):
    """LSE against the reference: -inf exactly where no key is visible, else within tolerance."""
    lse = lse.double().cpu()
    assert torch.equal(torch.isneginf(lse), torch.isneginf(ref_lse)), "lse: -inf pattern differs"
    assert_close_to_reference(
        lse, ref_lse, backend="triton-unified", case="lse", what="lse", tolerance=lse_tolerance(dtype, kv)
    )


def run_decode(q, kc, vc, seq_lens, bt, *, dtype, ks=None, vs=None, with_lse=True, **kw):
    """Run split_decode_attention on DEVICE with NaN-poisoned outputs; returns CPU (out, lse)."""
    dev = lambda t: None if t is None else t.to(DEVICE)
    out = torch.full(q.shape, float("nan"), dtype=q.dtype, device=DEVICE)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=DEVICE) if with_lse else None
    split_decode_attention(
        q.to(DEVICE),
        kc.to(DEVICE),
        vc.to(DEVICE),
        out,
        seq_lens=seq_lens.to(DEVICE),
        block_table=bt.to(DEVICE),
        max_seq_len=int(seq_lens.max()),
        scale=HEAD_DIM**-0.5,
        k_scale=dev(ks),
        v_scale=dev(vs),
        lse=lse,
        **kw,
    )
    return out.cpu(), (None if lse is None else lse.cpu())


def decode_case(seq_lens, *, hq=4, hkv=1, block_size=16, dtype=torch.float32, kv_dtype=None, seed=0, head_dim=HEAD_DIM):
    num_blocks = sum(math.ceil(s / block_size) for s in seq_lens) + 4
    kc, vc, ks, vs = make_cache(num_blocks, block_size, hkv, dtype, kv_dtype, seed, head_dim)
    sl, bt = make_batch(seq_lens, block_size, num_blocks, seed=seed)
    q = torch.randn(len(seq_lens), hq, head_dim, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, kc, vc, ks, vs, sl, bt


# --------------------------------------------------------------------------------------------
# Split decode
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("num_splits", [1, 3, 8])
def test_decode_matches_reference_for_split_counts(num_splits):
    q, kc, vc, _, _, sl, bt = decode_case([70, 130, 255], hq=6, hkv=2)  # group 3 -> padded to 4
    out, lse = run_decode(q, kc, vc, sl, bt, dtype=torch.float32, num_splits=num_splits)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(3), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(out, ref, torch.float32, f"splits={num_splits}")
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("num_splits", [3, 8])
def test_several_splits_are_one_launch_that_merges_itself(num_splits, monkeypatch):
    """The last split of each (request, KV head) merges in the same launch; its counters end at
    zero, so one workspace serves the next launch (a recording's or a CUDA graph's replays)."""
    q, kc, vc, _, _, sl, bt = decode_case([70, 130, 0, 255], hq=6, hkv=2, seed=11)
    launches = []
    real_launch = split_launch._launch_split
    monkeypatch.setattr(split_launch, "_launch_split", lambda *a, **k: (launches.append(k), real_launch(*a, **k)))
    monkeypatch.setattr(split_launch, "merge_states", lambda *a, **k: pytest.fail("a second, merge launch"))
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(4), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    out, lse = run_decode(q, kc, vc, sl, bt, dtype=torch.float32, num_splits=num_splits)
    assert len(launches) == 1
    counters = launches[0]["counters"]
    assert_close(out, ref, torch.float32, f"fused merge, {num_splits} splits")
    assert_lse_close(lse, ref_lse)
    assert counters.shape == (4, 2) and not counters.any(), "the counters must reset to zero"

    # The same counters again, as a recording's or a graph's replay uses them: the same bits.
    again = torch.full_like(out, float("nan"), device=DEVICE)
    kw = {k: v for k, v in launches[0].items() if k != "final"}
    real_launch(
        q.to(DEVICE),
        kc.to(DEVICE),
        vc.to(DEVICE),
        None,
        None,
        torch.full((num_splits, 4, 6, HEAD_DIM), float("nan"), device=DEVICE),
        torch.full((num_splits, 4, 6), float("nan"), device=DEVICE),
        final=(again, None, None),
        **kw,
    )
    assert torch.equal(again.cpu(), out), "a second launch on the reset counters must merge the same way"
    assert not counters.any()


def test_the_fused_merge_is_the_same_on_every_launch():
    """The merging program must see every other split's partial (acquire-release counting): a
    missed one changes the result, differently from launch to launch. Many launches on a GPU,
    where programs really run at once; two under the interpreter."""
    q, kc, vc, _, _, sl, bt = decode_case([700, 1300, 2000, 90], hq=8, hkv=2, seed=13)
    ref, _ = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(4), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    first, _ = run_decode(q, kc, vc, sl, bt, dtype=torch.float32, num_splits=13, with_lse=False)
    assert_close(first, ref, torch.float32, "fused merge, 13 splits")
    args = [t.to(DEVICE) for t in (q, kc, vc, sl, bt)]
    out = torch.empty_like(args[0])
    for i in range(300 if DEVICE == "cuda" else 1):
        out.fill_(float("nan"))
        split_decode_attention(
            *args[:3], out, seq_lens=args[3], block_table=args[4], max_seq_len=2000, scale=HEAD_DIM**-0.5, num_splits=13
        )
        assert torch.equal(out.cpu(), first), f"launch {i + 2} differs from the first"


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_decode_half_precision(dtype):
    # Block 64 > BLOCK_N exercises tiles smaller than a block.
    q, kc, vc, _, _, sl, bt = decode_case([100, 37], block_size=64, dtype=dtype, seed=3)
    out, lse = run_decode(q, kc, vc, sl, bt, dtype=dtype, num_splits=3)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(2), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert out.dtype == dtype
    assert_close(out, ref, dtype, str(dtype))
    assert_lse_close(lse, ref_lse, dtype)


def test_head_dim_not_power_of_two():
    # head_dim 80 -> padded to 128 and masked; block 32 with BLOCK_N 32 (one block per step).
    q, kc, vc, _, _, sl, bt = decode_case([75, 140], hq=4, hkv=2, block_size=32, seed=41, head_dim=80)
    out, lse = run_decode(q, kc, vc, sl, bt, dtype=torch.float32, num_splits=3)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(2), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(out, ref, torch.float32, "head_dim 80")
    assert_lse_close(lse, ref_lse)


def test_short_request_among_long_ones_and_padding_rows():
    # 8 splits over 3 tokens leaves most splits of request 1 empty; requests 2 and 4 are padding.
    q, kc, vc, _, _, sl, bt = decode_case([200, 3, 0, 129, 0], seed=5)
    out, lse = run_decode(q, kc, vc, sl, bt, dtype=torch.float32, num_splits=8)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(5), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(out, ref, torch.float32, "mixed lengths")
    assert torch.equal(out[[2, 4]], torch.zeros_like(out[[2, 4]])), "padding rows must be exact zeros"
    assert torch.isneginf(lse[[2, 4]]).all()
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize(
    "kv_dtype", [torch.int8, torch.float8_e4m3fn, torch.float8_e5m2], ids=["int8", "fp8", "fp8_e5m2"]
)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_quantized_cache_matches_dequantized_reference(kv_dtype, dtype):
    q, kc, vc, ks, vs, sl, bt = decode_case([90, 161], hq=4, hkv=1, dtype=dtype, kv_dtype=kv_dtype, seed=7)
    out, _ = run_decode(q, kc, vc, sl, bt, dtype=dtype, ks=ks, vs=vs, num_splits=3)
    ref, _ = reference_attention(
        q,
        kc,
        vc,
        query_start_loc=decode_qsl(2),
        seq_lens=sl,
        block_table=bt,
        scale=HEAD_DIM**-0.5,
        k_scale=ks,
        v_scale=vs,
    )
    kv = {torch.int8: "int8", torch.float8_e4m3fn: "fp8", torch.float8_e5m2: "fp8_e5m2"}[kv_dtype]
    assert_close(out, ref, dtype, f"{kv_dtype}/{dtype}", kv=kv)


@pytest.mark.parametrize(
    "kw",
    [dict(window=40), dict(softcap=5.0), dict(sinks=True), dict(window=17, softcap=2.0, sinks=True)],
    ids=["window", "softcap", "sinks", "all"],
)
def test_window_softcap_sinks(kw):
    q, kc, vc, _, _, sl, bt = decode_case([150, 30, 0, 255], hq=6, hkv=2, seed=11)
    kw = dict(kw)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.linspace(-1.0, 3.0, 6, dtype=torch.float32)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(4), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5, **kw
    )
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].to(DEVICE)
    out, lse = run_decode(q, kc, vc, sl, bt, dtype=torch.float32, num_splits=3, **kw)
    assert_close(out, ref, torch.float32, str(kw))
    assert_lse_close(lse, ref_lse)
    assert torch.equal(out[2], torch.zeros_like(out[2]))


def test_invalid_block_ids_are_masked_not_read():
    q, kc, vc, _, _, sl, bt = decode_case([100, 60], hq=2, hkv=2, seed=13)  # MHA: GROUP 1
    bt[0, 2] = -3  # keys 32..47 of request 0 vanish
    bt[1, 1] = kc.shape[0] + 100  # keys 16..31 of request 1 vanish
    out, lse = run_decode(q, kc, vc, sl, bt, dtype=torch.float32, num_splits=3)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(2), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(out, ref, torch.float32, "invalid ids")
    assert_lse_close(lse, ref_lse)


def test_table_narrower_than_seq_len_masks_the_rest():
    q, kc, vc, _, _, sl, bt = decode_case([100], seed=17)
    bt = bt[:, :3].contiguous()  # 48 keys addressable out of 100
    out, _ = run_decode(q, kc, vc, sl, bt, dtype=torch.float32, num_splits=2)
    ref, _ = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(1), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(out, ref, torch.float32, "narrow table")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_batch_invariant_mode_is_bitwise_stable(dtype):
    q, kc, vc, _, _, sl, bt = decode_case([250, 70, 0, 131], hq=4, hkv=1, dtype=dtype, seed=19)
    batch_out, batch_lse = run_decode(q, kc, vc, sl, bt, dtype=dtype, blocks_per_split=2)
    ref, _ = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(4), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(batch_out, ref, dtype, "batch-invariant mode")
    for r in (1, 3):
        alone_out, alone_lse = run_decode(
            q[r : r + 1], kc, vc, sl[r : r + 1], bt[r : r + 1], dtype=dtype, blocks_per_split=2
        )
        assert torch.equal(alone_out[0], batch_out[r]), f"request {r}: output differs alone vs in batch"
        assert torch.equal(alone_lse[0], batch_lse[r])
    # A larger grid than needed (fixed CUDA-graph grid) only adds empty splits.
    padded_out, _ = run_decode(q, kc, vc, sl, bt, dtype=dtype, blocks_per_split=2, num_splits=12)
    assert torch.equal(padded_out, batch_out)


@pytest.mark.parametrize(
    ("block_size", "kw"),
    [(16, dict(num_splits=3)), (64, dict(num_splits=1)), (16, dict(blocks_per_split=4))],
    ids=["3-splits", "tile-inside-a-block", "batch-invariant"],
)
def test_block_ids_loaded_a_tile_ahead(block_size, kw):
    """Each tile uses the block ids loaded one tile earlier (the last load looks past the split
    and must be masked): empty splits, a bad id, a padding row, tiles inside one block."""
    q, kc, vc, _, _, sl, bt = decode_case([200, 3, 0, 129], hq=4, hkv=2, block_size=block_size, seed=23)
    bt[3, 1] = -2  # a bad id: its keys vanish
    out, lse = run_decode(q, kc, vc, sl, bt, dtype=torch.float32, **kw)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(4), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(out, ref, torch.float32, f"block ids a tile ahead {kw}")
    assert_lse_close(lse, ref_lse)


@pytest.mark.parametrize("window", [0, 100])
def test_multi_token_tiles_see_their_causal_and_window_edges(window):
    # Multi-token tiles (the cascade's suffix pass): a tile's first row sees fewer keys than its
    # last, and with a window its last row sees fewer old keys than its first. Launched directly
    # (one split, final output), since no public entry point combines multi-token queries and a
    # window in this kernel.
    q_lens, seq_lens = [16, 9, 3], [300, 130, 70]
    q, kc, vc, _, _, qsl, sl, bt = cascade_case(q_lens, seq_lens, 0, hq=4, hkv=2, seed=41)
    out = torch.full(q.shape, float("nan"), device=DEVICE)
    split_launch._launch_split(
        q.to(DEVICE),
        kc.to(DEVICE),
        vc.to(DEVICE),
        None,
        None,
        None,
        None,
        seq_lens=sl.to(DEVICE),
        block_table=bt.to(DEVICE),
        query_start_loc=qsl.to(DEVICE),
        scale=HEAD_DIM**-0.5,
        softcap=0.0,
        window=window,
        key_start=0,
        num_splits=1,
        tokens_per_split=0,
        max_query_len=max(q_lens),
        max_keys=max(seq_lens),
        final=(out, None, None),
    )
    ref, _ = reference_attention(
        q, kc, vc, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5, window=window
    )
    assert_close(out.cpu(), ref, torch.float32, f"multi-token tiles, window {window}")


def test_decode_rejects_bad_arguments():
    q, kc, vc, _, _, sl, bt = decode_case([20, 30])
    out = torch.empty_like(q)
    base = dict(seq_lens=sl, block_table=bt, max_seq_len=30, scale=0.125)
    # What the kernels need beyond the contract (Backend.forward checks the rest).
    with pytest.raises(InputError, match=r"q.shape\[0\] \(num_tokens\) is 1; .*num_reqs = 2.*cascade_attention"):
        split_decode_attention(q[:1], kc, vc, out[:1], **base)
    with pytest.raises(InputError, match="num_splits is 0; .*a host int >= 1"):
        split_decode_attention(q, kc, vc, out, **base, num_splits=0)
    with pytest.raises(InputError, match="num_splits is 1; .*a host int >= 2"):  # 30 tokens need 2 splits of 16
        split_decode_attention(q, kc, vc, out, **base, blocks_per_split=1, num_splits=1)
    with pytest.raises(InputError, match="blocks_per_split is 0; .*None or a host int >= 1"):
        split_decode_attention(q, kc, vc, out, **base, blocks_per_split=0)


@pytest.mark.parametrize("launcher", ["unified", "split", "cascade"])
def test_launchers_refuse_scales_that_do_not_fit_the_cache(launcher):
    # The launchers read a cache's scales by shape: kivi4's per-channel key scales passed as the
    # cache stores them ([blocks, heads, head_dim]) instead of kernel_k_scale's 4-D view once ran
    # as per-slot int4 scales and gave wrong numbers with no error.
    from paged_core import allocate_kv_cache
    from paged_triton_common.backend import kernel_k_scale
    from paged_triton_unified.launch import unified_attention

    cache = allocate_kv_cache(2, 16, 1, 64, dtype=torch.bfloat16, kv_dtype="kivi4", device=DEVICE)
    q = torch.zeros(1, 4, 64, dtype=torch.bfloat16, device=DEVICE)
    sl = torch.tensor([20], dtype=torch.int32, device=DEVICE)
    bt = torch.tensor([[0, 1]], dtype=torch.int32, device=DEVICE)
    qsl = torch.tensor([0, 1], dtype=torch.int32, device=DEVICE)

    def call(k_scale, v_scale, k=cache.k):
        args = (q, k, cache.v, torch.empty_like(q))
        kw = dict(seq_lens=sl, block_table=bt, max_seq_len=20, scale=0.125, k_scale=k_scale, v_scale=v_scale)
        if launcher == "unified":
            unified_attention(*args, query_start_loc=qsl, max_query_len=1, **kw)
        elif launcher == "split":
            split_decode_attention(*args, **kw)
        else:
            cascade_attention(*args, query_start_loc=qsl, max_query_len=1, prefix_blocks=1, **kw)

    stored = r"k_scale is torch.float32 \[2, 1, 64\]; .*float32 \[2, 16, 1\].*kernel_k_scale"
    with pytest.raises(InputError, match=stored):
        call(cache.k_scale, cache.v_scale)
    with pytest.raises(InputError, match=r"v_scale is None; .*float32 \[2, 16, 1\]"):
        call(kernel_k_scale(cache), None)
    with pytest.raises(InputError, match=r"v_scale is torch.float16 \[2, 16, 1\]"):
        call(kernel_k_scale(cache), cache.v_scale.half())
    with pytest.raises(InputError, match="k_scale/v_scale is given; .*no scales for a cache of values"):
        call(kernel_k_scale(cache), cache.v_scale, k=torch.zeros(2, 16, 1, 64, dtype=torch.bfloat16, device=DEVICE))
    call(kernel_k_scale(cache), cache.v_scale)  # the view the backends pass


def test_choose_num_splits_on_cpu_is_one():
    assert choose_num_splits(1, 8, 131072, 16, "cpu") == 1


def test_choose_num_splits_gives_two_programs_per_sm_three_on_long_splits_of_many_pairs(monkeypatch):
    monkeypatch.setattr(split_launch, "sm_count", lambda device: 132)
    assert choose_num_splits(4, 8, 32768, 16, "cuda:0") == 8  # 264 // 32: 256 programs
    assert choose_num_splits(2, 8, 32768, 16, "cuda:0") == 16  # 264 // 16
    assert choose_num_splits(4, 8, 4096, 16, "cuda:0") == 8
    assert choose_num_splits(8, 8, 4096, 16, "cuda:0") == 4  # 64 pairs, but 682 keys a split at three
    assert choose_num_splits(16, 8, 4096, 16, "cuda:0") == 2
    assert choose_num_splits(8, 8, 32768, 16, "cuda:0") == 6  # 64 pairs, 5,461 keys a split: 396 // 64
    assert choose_num_splits(16, 8, 8192, 16, "cuda:0") == 3  # 128 pairs, 2,730 keys a split
    assert choose_num_splits(1, 8, 131072, 16, "cuda:0") == 32  # 264 // 8 = 33, capped
    assert choose_num_splits(1, 8, 4096, 16, "cuda:0") == 16  # 256 tokens a split at least
    assert choose_num_splits(32, 8, 4096, 16, "cuda:0") == 1  # 256 pairs: one per SM already
    assert choose_num_splits(64, 8, 4096, 16, "cuda:0") == 1  # 512 pairs already fill the GPU
    assert choose_num_splits(1, 1, 131072, 16, "cuda:0") == 32  # capped
    assert choose_num_splits(1, 8, 1000, 16, "cuda:0") == 3  # >= 256 tokens per split


@pytest.mark.parametrize(
    ("dtype", "kv_dtype", "kw"),
    [
        (torch.float32, None, dict(window=40, softcap=5.0, sinks=True)),
        (torch.float32, None, dict()),
        (torch.bfloat16, None, dict(sinks=True)),
        (torch.float16, torch.int8, dict()),
    ],
    ids=["fp32-all", "fp32", "bf16-sinks", "fp16-int8"],
)
def test_single_split_writes_output_directly(dtype, kv_dtype, kw):
    """One split: the kernel's own epilogue (sinks, lse, padding rows) equals the merge path."""
    q, kc, vc, ks, vs, sl, bt = decode_case([150, 30, 0, 255], hq=6, hkv=2, dtype=dtype, kv_dtype=kv_dtype, seed=23)
    kw = dict(kw)
    if kw.pop("sinks", False):
        kw["sinks"] = torch.linspace(-1.0, 3.0, 6, dtype=torch.float32)
    ref, ref_lse = reference_attention(
        q,
        kc,
        vc,
        query_start_loc=decode_qsl(4),
        seq_lens=sl,
        block_table=bt,
        scale=HEAD_DIM**-0.5,
        k_scale=ks,
        v_scale=vs,
        **kw,
    )
    if "sinks" in kw:
        kw["sinks"] = kw["sinks"].to(DEVICE)
    out, lse = run_decode(q, kc, vc, sl, bt, dtype=dtype, ks=ks, vs=vs, num_splits=1, **kw)
    assert out.dtype == dtype
    assert_close(out, ref, dtype, "one split, direct", kv="auto" if kv_dtype is None else "int8")
    assert_lse_close(lse, ref_lse, dtype)
    assert torch.equal(out[2], torch.zeros_like(out[2])) and torch.isneginf(lse[2]).all()
    # Without lse and sinks the direct epilogue is bit-identical to merging one part: one split
    # of blocks_per_split (which always merges) covers the same keys in the same tiles.
    if not kw:
        plain, _ = run_decode(q, kc, vc, sl, bt, dtype=dtype, ks=ks, vs=vs, num_splits=1, with_lse=False)
        merged, _ = run_decode(
            q, kc, vc, sl, bt, dtype=dtype, ks=ks, vs=vs, blocks_per_split=bt.shape[1], with_lse=False
        )
        assert torch.equal(plain, merged)


def test_fixed_kernel_config_bypasses_the_autotuner():
    q, kc, vc, _, _, sl, bt = decode_case([70, 130], hq=4, hkv=1, seed=29)
    ref, _ = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(2), seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    for splits in (1, 3):
        out, _ = run_decode(
            q,
            kc,
            vc,
            sl,
            bt,
            dtype=torch.float32,
            num_splits=splits,
            kernel_config={"BLOCK_N": 16, "num_warps": 4, "num_stages": 1},
        )
        assert_close(out, ref, torch.float32, f"fixed config, splits={splits}")


# --------------------------------------------------------------------------------------------
# Merge
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_merge_states_matches_torch_and_handles_empty(dtype):
    g = torch.Generator().manual_seed(23)
    outs = torch.randn(3, 5, 4, HEAD_DIM, generator=g).to(dtype)
    lses = torch.randn(3, 5, 4, generator=g) * 3
    lses[1, 0] = float("-inf")  # one part empty
    lses[:, 2, 1] = float("-inf")  # every part empty
    outs[1, 0] = float("nan")  # an empty part's output must be ignored
    # Poisoned outputs: the all-empty row must be written as zeros, not left as it was.
    nan_out = torch.full(outs.shape[1:], float("nan"), dtype=dtype, device=DEVICE)
    nan_lse = torch.full(lses.shape[1:], float("nan"), device=DEVICE)
    got_out, got_lse = merge_states([o.to(DEVICE) for o in outs], lses.to(DEVICE), nan_out, nan_lse)
    assert got_out is nan_out and got_lse is nan_lse
    ref_out, ref_lse = merge_states_torch(outs, lses)
    assert got_out.dtype == dtype
    assert_close(got_out.cpu(), ref_out.double(), dtype, "merge vs torch")
    assert torch.equal(got_out[2, 1].cpu(), torch.zeros(HEAD_DIM, dtype=dtype))
    assert torch.isneginf(got_lse[2, 1]).item()
    assert_lse_close(got_lse, ref_lse.double())


def test_merge_of_disjoint_key_sets_equals_attention_over_union():
    q, kc, vc, _, _, sl, bt = decode_case([150, 90], seed=29)
    scale = HEAD_DIM**-0.5
    full, full_lse = reference_attention(
        q, kc, vc, query_start_loc=decode_qsl(2), seq_lens=sl, block_table=bt, scale=scale
    )
    # Disjoint key sets: the first 48 keys (blocks 0-2) and the rest, by masking table entries.
    bt_a, bt_b = bt.clone(), bt.clone()
    bt_a[:, 3:] = -1
    bt_b[:, :3] = -1
    parts = [run_decode(q, kc, vc, sl, t, dtype=torch.float32, num_splits=2) for t in (bt_a, bt_b)]
    out, lse = merge_states([p[0].to(DEVICE) for p in parts], torch.stack([p[1] for p in parts]).to(DEVICE))
    assert_close(out.cpu(), full, torch.float32, "merge of halves")
    assert_lse_close(lse, full_lse)
    torch_out, _ = merge_states_torch([p[0] for p in parts], [p[1] for p in parts])
    assert_close(torch_out, full, torch.float32, "torch merge of halves")


# --------------------------------------------------------------------------------------------
# Cascade
# --------------------------------------------------------------------------------------------


def cascade_case(
    q_lens, seq_lens, prefix_blocks, *, hq=4, hkv=1, block_size=16, dtype=torch.float32, kv_dtype=None, seed=31
):
    num_blocks = prefix_blocks + sum(math.ceil(s / block_size) for s in seq_lens) + 4
    kc, vc, ks, vs = make_cache(num_blocks, block_size, hkv, dtype, kv_dtype, seed)
    sl, bt = make_batch(seq_lens, block_size, num_blocks, seed=seed, shared_prefix=prefix_blocks)
    qsl = torch.tensor([0] + list(torch.tensor(q_lens).cumsum(0).tolist()), dtype=torch.int32)
    q = torch.randn(int(qsl[-1]), hq, HEAD_DIM, generator=torch.Generator().manual_seed(seed + 1)).to(dtype)
    return q, kc, vc, ks, vs, qsl, sl, bt


def run_cascade(q, kc, vc, qsl, sl, bt, prefix_blocks, *, ks=None, vs=None, **kw):
    out = torch.full_like(q, float("nan")).to(DEVICE)
    lse = torch.full(q.shape[:2], float("nan"), dtype=torch.float32, device=DEVICE)
    dev = lambda t: None if t is None else t.to(DEVICE)
    q_lens = qsl[1:] - qsl[:-1]
    cascade_attention(
        q.to(DEVICE),
        kc.to(DEVICE),
        vc.to(DEVICE),
        out,
        query_start_loc=qsl.to(DEVICE),
        seq_lens=sl.to(DEVICE),
        block_table=bt.to(DEVICE),
        prefix_blocks=prefix_blocks,
        max_query_len=int(q_lens.max()),
        max_seq_len=int(sl.max()),
        scale=HEAD_DIM**-0.5,
        k_scale=dev(ks),
        v_scale=dev(vs),
        lse=lse,
        **kw,
    )
    return out.cpu(), lse.cpu()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cascade_decode_batch_matches_reference(dtype):
    # 5 decodes sharing 6 blocks (96 tokens); 6 q / 2 kv heads -> GROUP 3 rows per token.
    seq_lens = [130, 97, 180, 0, 111]
    q, kc, vc, _, _, qsl, sl, bt = cascade_case([1] * 5, seq_lens, 6, hq=6, hkv=2, dtype=dtype)
    assert shared_prefix_blocks(bt, sl, 16) == 6
    out, lse = run_cascade(q, kc, vc, qsl, sl, bt, 6)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(out, ref, dtype, "cascade decode")
    assert torch.equal(out[3], torch.zeros_like(out[3]))
    assert_lse_close(lse, ref_lse, dtype)


def test_cascade_reads_the_prefix_through_a_request_that_holds_it():
    """Row 0 is a padding request whose table holds other (valid) ids: the prefix is found and
    read through the first request with keys, by the detection and by the backend's plan."""
    from paged_core import BatchMeta
    from paged_triton_unified.backend import TritonUnifiedBackend

    seq_lens = [0, 130, 97, 180, 111]
    q, kc, vc, _, _, qsl, sl, bt = cascade_case([1] * 5, seq_lens, 6, hq=6, hkv=2)
    bt[0, :9] = bt[1, :9].flip(0)  # other blocks of the pool, all valid
    assert shared_prefix_blocks(bt, sl, 16) == 6
    ref, _ = reference_attention(q, kc, vc, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5)
    out, _ = run_cascade(q, kc, vc, qsl, sl, bt, 6, prefix_row=1)
    assert_close(out, ref, torch.float32, "cascade through row 1")
    wrong, _ = run_cascade(q, kc, vc, qsl, sl, bt, 6)  # row 0: the test's premise, that it matters
    assert not torch.allclose(wrong[1:], ref[1:].float(), atol=1e-3)

    rows = [bt[0, :9].tolist()] + [bt[r, : -(-n // 16)].tolist() for r, n in enumerate(seq_lens) if r]
    meta = BatchMeta.from_lists([1] * 5, seq_lens, rows, block_size=16, device=DEVICE)
    for backend, kw in [
        (TritonUnifiedBackend(cascade=True, min_prefix_tokens=16), {}),
        (TritonUnifiedBackend(min_prefix_tokens=16), {"shared_prefix_blocks": 6}),
    ]:
        plan = backend.plan(meta, **kw)
        assert (plan.prefix_blocks, plan.prefix_row) == (6, 1)
        got = backend.forward(q.to(DEVICE), _cache_of(kc, vc), plan)
        assert_close(got.cpu(), ref, torch.float32, f"plan {kw or 'found'}")


def test_the_cascade_path_is_recorded_once_per_step(monkeypatch):
    """A plan's later layers repeat the cascade's launches with their own tensors instead of
    running the launcher again (472 us of host per layer on the H200 before, 2026-12-02). The
    launcher is faked: under the interpreter nothing launches directly, so nothing records."""
    from paged_core import BatchMeta
    from paged_triton_common import direct
    from paged_triton_unified import backend as backend_module

    class Binary:
        function, packed_metadata = "fn", "md"

        def __init__(self):
            self.calls = []

        def run(self, gx, gy, gz, stream, function, metadata, launch_md, enter, exit_, *args):
            self.calls.append(args)

    binary, launcher_calls = Binary(), []

    def fake_cascade(q, k_cache, v_cache, out, **kw):
        launcher_calls.append(kw["prefix_blocks"])
        recording = direct._recording.active  # None when the backend records nothing
        if recording is not None:
            recording.add(binary, (4, 2), [q, k_cache, v_cache, out, kw["block_table"]], 0)

    monkeypatch.setattr(backend_module, "cascade_attention", fake_cascade)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 0, raising=False)
    backend = backend_module.TritonUnifiedBackend(min_prefix_tokens=16)
    meta = BatchMeta.build([1, 1, 1], [100, 90, 120], block_size=16, device=DEVICE)
    plan = backend.plan(meta, shared_prefix_blocks=4)
    layers = []
    for _ in range(2):
        cache = backend.allocate(
            meta.block_table.shape[0] * meta.block_table.shape[1] + 1,
            16,
            num_kv_heads=1,
            head_dim=HEAD_DIM,
            dtype=torch.float32,
            device=DEVICE,
        )
        layers.append((torch.randn(3, 2, HEAD_DIM, device=DEVICE), cache))
    outs = [backend.forward(q, cache, plan) for q, cache in layers]
    assert launcher_calls == [4], f"the launcher ran {len(launcher_calls)} times for two layers of one plan"
    (args,) = binary.calls  # the second layer's replay, with its own tensors
    q2, cache2 = layers[1]
    assert list(args) == [
        q2.data_ptr(),
        cache2.k.data_ptr(),
        cache2.v.data_ptr(),
        outs[1].data_ptr(),
        meta.block_table.data_ptr(),
    ]


def _cache_of(kc, vc):
    from paged_core import KVCache

    return KVCache(kc.to(DEVICE), vc.to(DEVICE), dtype=kc.dtype)


@pytest.mark.skipif(
    not torch.cuda.is_available(), reason="the cascade's prefix pass runs on a forked CUDA stream: needs a CUDA device"
)
def test_concurrent_cascade_passes_eager_and_in_a_cuda_graph():
    q, kc, vc, _, _, qsl, sl, bt = cascade_case([1] * 5, [130, 97, 180, 0, 111], 6, hq=6, hkv=2, dtype=torch.bfloat16)
    eager, eager_lse = run_cascade(q, kc, vc, qsl, sl, bt, 6, prefix_splits=2)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(eager, ref, torch.bfloat16, "cascade, passes on two streams")
    assert_lse_close(eager_lse, ref_lse, torch.bfloat16)
    again, _ = run_cascade(q, kc, vc, qsl, sl, bt, 6, prefix_splits=2)
    assert torch.equal(again, eager)  # the join orders the merge after both passes, every time

    args = [t.to(DEVICE) for t in (q, kc, vc, qsl, sl, bt)]
    out = torch.full_like(args[0], float("nan"))
    call = lambda: cascade_attention(
        args[0],
        args[1],
        args[2],
        out,
        query_start_loc=args[3],
        seq_lens=args[4],
        block_table=args[5],
        prefix_blocks=6,
        max_query_len=1,
        max_seq_len=180,
        scale=HEAD_DIM**-0.5,
        prefix_splits=2,
    )
    call()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        call()
    out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(out.cpu(), eager)


def test_cascade_multi_token_queries_reaching_into_the_prefix():
    # Request 1's 40 queries start at position 60 < prefix 64: masked causally in the prefix pass.
    # Request 2 ends exactly at the prefix (empty suffix). Softcap, int8 cache and sinks too.
    q_lens, seq_lens = [5, 40, 1, 3], [120, 100, 64, 77]
    q, kc, vc, ks, vs, qsl, sl, bt = cascade_case(q_lens, seq_lens, 4, kv_dtype=torch.int8, seed=37)
    sinks = torch.tensor([0.5, -1.0, 2.0, 0.0])
    out, lse = run_cascade(q, kc, vc, qsl, sl, bt, 4, ks=ks, vs=vs, softcap=4.0, sinks=sinks.to(DEVICE), num_splits=2)
    ref, ref_lse = reference_attention(
        q,
        kc,
        vc,
        query_start_loc=qsl,
        seq_lens=sl,
        block_table=bt,
        scale=HEAD_DIM**-0.5,
        softcap=4.0,
        sinks=sinks,
        k_scale=ks,
        v_scale=vs,
    )
    assert_close(out, ref, torch.float32, "cascade multi-token", kv="int8")
    assert_lse_close(lse, ref_lse, kv="int8")


@pytest.mark.parametrize("prefix_splits", [1, 3])
def test_cascade_prefix_split_along_its_keys(prefix_splits):
    # A 320-token prefix in ranges of 128 keys (3 splits: 128, 128, 64). Request 1's 40 queries
    # start at 290, inside the last range; request 2 ends exactly at the prefix; request 3 pads.
    q_lens, seq_lens = [1, 40, 1, 1, 3], [400, 330, 320, 0, 350]
    q, kc, vc, _, _, qsl, sl, bt = cascade_case(q_lens, seq_lens, 20, seed=41)
    out, lse = run_cascade(q, kc, vc, qsl, sl, bt, 20, prefix_splits=prefix_splits)
    ref, ref_lse = reference_attention(
        q, kc, vc, query_start_loc=qsl, seq_lens=sl, block_table=bt, scale=HEAD_DIM**-0.5
    )
    assert_close(out, ref, torch.float32, f"cascade, {prefix_splits} prefix splits")
    assert_lse_close(lse, ref_lse)
    assert torch.equal(out[42], torch.zeros_like(out[42]))  # the padding request's row


def test_cascade_prefix_split_sizes():
    from paged_triton_unified.split_launch import _prefix_split

    cpu = torch.device("cpu")
    assert _prefix_split(0, None, row_tiles=4, num_kv_heads=8, device=cpu) == (0, 0)
    assert _prefix_split(320, 3, row_tiles=1, num_kv_heads=1, device=cpu) == (128, 3)
    # More splits than 128-key ranges: as many as there are ranges.
    assert _prefix_split(200, 8, row_tiles=1, num_kv_heads=1, device=cpu) == (128, 2)


def test_cascade_prefix_split_count_on_a_gpu(monkeypatch):
    from paged_triton_unified.split_launch import _prefix_split

    monkeypatch.setattr(split_launch, "sm_count", lambda device: 132)
    cuda = torch.device("cuda", 0)
    # 64 decodes x 4 heads = 4 row tiles x 8 KV heads = 32 programs: ceil(264 / 32) = 9 wanted,
    # ranges of ceil(4000 / 9) = 445 -> 512 keys, so 8 splits.
    assert _prefix_split(4000, None, row_tiles=4, num_kv_heads=8, device=cuda) == (512, 8)
    # A short prefix keeps at least 256 keys a split; a batch filling the GPU does not split.
    assert _prefix_split(600, None, row_tiles=4, num_kv_heads=8, device=cuda) == (384, 2)
    assert _prefix_split(4000, None, row_tiles=64, num_kv_heads=8, device=cuda) == (4096, 1)


def test_cascade_refuses_window_and_bad_prefix():
    q, kc, vc, _, _, qsl, sl, bt = cascade_case([1, 1], [40, 50], 2)
    base = dict(query_start_loc=qsl, seq_lens=sl, block_table=bt, max_query_len=1, max_seq_len=50, scale=0.1)
    with pytest.raises(InputError, match="window"):
        cascade_attention(q, kc, vc, torch.empty_like(q), prefix_blocks=2, window=8, **base)
    with pytest.raises(InputError, match="prefix_blocks"):
        cascade_attention(q, kc, vc, torch.empty_like(q), prefix_blocks=99, **base)
    with pytest.raises(InputError, match="prefix_splits"):
        cascade_attention(q, kc, vc, torch.empty_like(q), prefix_blocks=2, prefix_splits=0, **base)


def test_shared_prefix_blocks_ignores_padding_rows_and_caps_by_length():
    bt = torch.tensor([[3, 4, 5, 6], [3, 4, 5, 8], [0, 0, 0, 0], [3, 4, 5, 6]], dtype=torch.int32)
    assert shared_prefix_blocks(bt, torch.tensor([64, 64, 0, 64], dtype=torch.int32), 16) == 3
    assert shared_prefix_blocks(bt, torch.tensor([64, 64, 0, 20], dtype=torch.int32), 16) == 1
    assert shared_prefix_blocks(bt, torch.zeros(4, dtype=torch.int32), 16) == 0


# --------------------------------------------------------------------------------------------
# The backend: plans across instances and backends
# --------------------------------------------------------------------------------------------


def test_plans_are_interchangeable_between_instances_and_backends():
    # forward() takes a BatchMeta or a plan of it. The unsplit backend used to fail on a split
    # one's plan ('SplitKVPlan' object has no attribute 'query_start_loc') and the split one on
    # any plan object that is not its own.
    import dataclasses

    from paged_core import BatchMeta
    from paged_triton_unified.backend import TritonUnifiedBackend

    @dataclasses.dataclass
    class ForeignPlan:
        meta: BatchMeta

    meta = BatchMeta.build([3, 1, 1], [10, 40, 20], block_size=16, device=DEVICE)
    unified, split = TritonUnifiedBackend(split_kv=False), TritonUnifiedBackend(num_splits=3)
    cache = unified.allocate(8, 16, num_kv_heads=1, head_dim=HEAD_DIM, dtype=torch.float32, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    kv = [torch.randn(5, 1, HEAD_DIM, generator=gen).to(DEVICE) for _ in range(2)]
    unified.write(cache, *kv, meta)
    q = torch.randn(5, 2, HEAD_DIM, generator=gen).to(DEVICE)
    for backend in (unified, split):
        want = backend.forward(q, cache, meta)
        for plan in (split.plan(meta), unified.plan(meta), ForeignPlan(meta)):
            torch.testing.assert_close(backend.forward(q, cache, plan), want, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("options", [{"split_kv": False}, {"num_splits": 3}], ids=["unsplit", "split"])
def test_a_plan_made_before_copy_computes_the_copied_batch(options):
    """What a captured CUDA graph relies on: a Triton plan reads the batch's tensors, so after
    ``static.copy_(step)`` the plan made from ``static`` computes ``step`` (new lengths, new
    blocks, a padding request), equal to a fresh plan of ``step``."""
    from paged_core import BatchMeta
    from paged_triton_unified.backend import TritonUnifiedBackend

    backend = TritonUnifiedBackend(**options)
    static = BatchMeta.build([1, 1, 1], [40, 7, 0], block_size=16, num_blocks=24, table_width=6, seed=1, device=DEVICE)
    cache = backend.allocate(24, 16, num_kv_heads=1, head_dim=HEAD_DIM, dtype=torch.float32, device=DEVICE)
    gen = torch.Generator().manual_seed(0)
    cache.k.copy_(torch.randn(cache.k.shape, generator=gen))
    cache.v.copy_(torch.randn(cache.v.shape, generator=gen))
    q = torch.randn(3, 2, HEAD_DIM, generator=gen).to(DEVICE)
    plan = backend.plan(static)
    backend.forward(q, cache, plan)  # as a warm-up before capture would
    step = BatchMeta.build([1, 1, 1], [3, 70, 18], block_size=16, num_blocks=24, seed=2, device=DEVICE)
    static.copy_(step)
    got = backend.forward(q, cache, plan)
    torch.testing.assert_close(got, backend.forward(q, cache, backend.plan(step)), atol=0, rtol=0)
    ref, _ = reference_attention(
        q.cpu(),
        cache.k.cpu(),
        cache.v.cpu(),
        query_start_loc=step.query_start_loc.cpu(),
        seq_lens=step.seq_lens.cpu(),
        block_table=step.block_table.cpu(),
        scale=HEAD_DIM**-0.5,
    )
    assert_close(got.cpu(), ref, torch.float32, "old plan, copied batch")


@pytest.mark.parametrize("seq_lens, num_splits", [([0, 0], 3), ([5, 3], 1), ([300, 9000], 7), ([40, 70], None)])
def test_the_autotune_key_holds_a_power_of_two_loop_length_of_at_least_256(seq_lens, num_splits, monkeypatch):
    """keys_per_program picks the tuned config; below 16 Triton would also compile a binary per
    value, so it never goes below 256 (all-padding batches included)."""
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda **kw: seen.append(kw["keys_per_program"])

    monkeypatch.setattr(split_launch, "_split", Recorder())
    q, kc, vc, _, _, sl, bt = decode_case(seq_lens)
    split_decode_attention(
        q,
        kc,
        vc,
        torch.empty_like(q),
        seq_lens=sl,
        block_table=bt,
        max_seq_len=max(seq_lens),
        scale=0.125,
        num_splits=num_splits,
    )
    (keys,) = seen
    assert keys >= 256 and keys & (keys - 1) == 0
    if max(seq_lens) == 9000:
        assert keys == 2048  # ceil(9000 / 7) = 1286 -> the next power of two


def test_the_autotune_key_holds_the_occupancy_class_except_with_fixed_splits(monkeypatch):
    """1 x 4,096 and 2 x 4,096 walk the same keys per program on 128 and 256 programs: each gets
    its own tuned choice. With fixed splits (batch-invariant mode) the class is 0 for any batch,
    so a request runs the same config alone and in a batch."""
    seen = []

    class Recorder:
        def __getitem__(self, grid):
            return lambda **kw: seen.append((kw["keys_per_program"], kw["occupancy"]))

    monkeypatch.setattr(split_launch, "_split", Recorder())
    monkeypatch.setattr(split_launch, "sm_count", lambda device: 132)
    for batch, kw in [
        (1, {"num_splits": 16}),
        (2, {"num_splits": 16}),
        (1, {"blocks_per_split": 16}),
        (8, {"blocks_per_split": 16}),
    ]:
        q, kc, vc, _, _, sl, bt = decode_case([4096] * batch, hq=32, hkv=8)
        split_decode_attention(
            q, kc, vc, torch.empty_like(q), seq_lens=sl, block_table=bt, max_seq_len=4096, scale=0.125, **kw
        )
    assert seen == [(256, 1), (256, 2), (256, 0), (256, 0)], seen


def test_every_autotuner_times_configs_as_graph_replays():
    """A small decode's split kernel runs faster than Triton's launch path: timed eagerly, every
    config measured the host (paged_triton_common.tuning)."""
    from paged_triton_common.tuning import replay_bench
    from paged_triton_unified import split_kernels
    from triton.runtime.autotuner import Autotuner

    tuners = {name: obj for name, obj in vars(split_kernels).items() if isinstance(obj, Autotuner)}
    assert {"split_kv_attention_kernel", "cascade_prefix_kernel"} <= set(tuners)
    for name, tuner in tuners.items():
        assert tuner._do_bench is replay_bench, f"{name} times its configs through Triton's launch path"
