"""merge_states against attention computed over the union of the keys (float64, by hand)."""

from __future__ import annotations

import math

import pytest
import torch
from paged_core import InputError, merge_states


def attention(q, k, v, keys):
    """Softmax attention of q [N, H, D] over k, v [L, H, D] restricted to key indices ``keys``
    (per (token, head): keys[n][h] is a list). Returns (out float64 [N, H, D], lse [N, H]);
    an empty key set gives zeros and -inf."""
    N, H, D = q.shape
    out = torch.zeros(N, H, D, dtype=torch.float64)
    lse = torch.full((N, H), -math.inf, dtype=torch.float64)
    for n in range(N):
        for h in range(H):
            idx = keys[n][h]
            if not idx:
                continue
            logits = [float(q[n, h] @ k[j, h]) for j in idx]
            m = max(logits)
            w = [math.exp(x - m) for x in logits]
            z = sum(w)
            out[n, h] = sum(wi * v[j, h] for wi, j in zip(w, idx, strict=True)) / z
            lse[n, h] = m + math.log(z)
    return out, lse


@pytest.mark.parametrize("splits", [1, 2, 3, 8])
@pytest.mark.parametrize("seed", [0, 1])
def test_merge_equals_attention_over_the_union(splits, seed):
    g = torch.Generator().manual_seed(seed)
    N, H, D, L = 5, 3, 8, 24
    q = torch.randn(N, H, D, generator=g, dtype=torch.float64) * 2
    k = torch.randn(L, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(L, H, D, generator=g, dtype=torch.float64)
    # Each (token, head) draws its own random key subset, split randomly (splits may be empty).
    union = [
        [sorted(torch.randperm(L, generator=g)[: 1 + (n * 7 + h) % L].tolist()) for h in range(H)] for n in range(N)
    ]
    union[2][1] = []  # one row sees no key at all
    part_of = {}
    parts = [[[[] for _ in range(H)] for _ in range(N)] for _ in range(splits)]
    for n in range(N):
        for h in range(H):
            for j in union[n][h]:
                s = int(torch.randint(splits, (1,), generator=g))
                parts[s][n][h].append(j)
                part_of[(n, h, j)] = s
    outs, lses = zip(*(attention(q, k, v, p) for p in parts), strict=True)
    want, want_lse = attention(q, k, v, union)
    out, lse = merge_states(torch.stack(outs).float(), torch.stack(lses).float())
    assert out.dtype == torch.float32 and lse.dtype == torch.float32 and out.shape == (N, H, D)
    torch.testing.assert_close(out.double(), want, rtol=0, atol=1e-5)
    torch.testing.assert_close(lse.double(), want_lse, rtol=0, atol=1e-5)
    assert torch.equal(out[2, 1], torch.zeros(D)) and lse[2, 1].item() == -math.inf
    assert not out.isnan().any() and not lse.isnan().any()
    # A list of parts gives the same result as the stacked tensor.
    out_l, lse_l = merge_states([o.float() for o in outs], [x.float() for x in lses])
    assert torch.equal(out_l, out) and torch.equal(lse_l, lse)


def test_all_empty_rows_give_zeros_and_minus_inf():
    outs = torch.randn(4, 2, 3, 5)  # whatever an empty part left in its output (finite garbage)
    lses = torch.full((4, 2, 3), -math.inf)
    lses[1, 0, 2] = 0.7  # one row has one non-empty part
    out, lse = merge_states(outs, lses)
    assert not out.isnan().any() and not lse.isnan().any()
    empty = torch.ones(2, 3, dtype=torch.bool)
    empty[0, 2] = False
    assert torch.equal(out[empty], torch.zeros(5, 5))
    assert torch.isneginf(lse[empty]).all()
    assert torch.equal(out[0, 2], outs[1, 0, 2]) and lse[0, 2].item() == pytest.approx(0.7)
    # With sinks too: a row no part saw has no visible key, so -inf, not the sink's logsumexp
    # (the Triton kernels' convention; the PyTorch path returned log(sum(exp(sinks))) before).
    out, lse = merge_states(outs, lses, sinks=torch.tensor([0.5, -1.0, 2.0]))
    assert torch.equal(out[empty], torch.zeros(5, 5)) and torch.isneginf(lse[empty]).all()
    assert torch.isfinite(lse[0, 2])


def test_output_dtype_follows_inputs():
    outs = torch.randn(2, 3, 4, 8, dtype=torch.bfloat16)
    lses = torch.randn(2, 3, 4)
    out, lse = merge_states(outs, lses)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    w = torch.softmax(lses, dim=0)
    torch.testing.assert_close(out.float(), (w[..., None] * outs.float()).sum(0), rtol=2**-7, atol=1e-2)
    torch.testing.assert_close(lse, torch.logsumexp(lses, 0))


@pytest.mark.parametrize(
    ("outs", "lses", "needles"),
    [
        (
            torch.zeros(2, 3, 4, 8),
            torch.zeros(2, 3, 5),
            ["outputs [2, 3, 4, 8] and lses [2, 3, 5] do not match"],
        ),
        (
            torch.zeros(2, 3, 4, 8),
            torch.zeros(3, 3, 4),
            ["outputs [2, 3, 4, 8] and lses [3, 3, 4] do not match"],
        ),
        (torch.zeros(3, 4, 8), torch.zeros(3, 4), ["outputs [3, 4, 8] and lses [3, 4] do not match"]),
        ([torch.zeros(3, 4, 8)] * 2, [torch.zeros(3, 4)] * 3, ["outputs [2, 3, 4, 8] and lses [3, 3, 4]"]),
        (
            [torch.zeros(3, 4, 8), torch.zeros(2, 4, 8)],
            [torch.zeros(3, 4)] * 2,
            ["outputs [3, 4, 8], [2, 4, 8] differ in shape"],
        ),
        ([], [], ["outputs no parts to merge"]),
    ],
)
def test_shape_mismatch(outs, lses, needles):
    with pytest.raises(InputError) as exc:
        merge_states(outs, lses)
    for n in needles:
        assert n in str(exc.value), str(exc.value)
    assert "accepted: outputs [S, num_tokens, num_heads, head_dim] with lses [S, num_tokens, num_heads]" in str(
        exc.value
    )


def test_empty_part_output_is_ignored_even_if_nan():
    outs = torch.randn(2, 3, 2, 4)
    outs[1] = float("nan")  # a split that saw no key may leave anything behind
    lses = torch.randn(2, 3, 2)
    lses[1] = -math.inf
    out, lse = merge_states(outs, lses)
    assert torch.equal(out, outs[0]) and torch.equal(lse, lses[0])


def test_sinks_add_a_logit_without_a_value():
    g = torch.Generator().manual_seed(5)
    N, H, D, L = 3, 2, 4, 10
    q = torch.randn(N, H, D, generator=g, dtype=torch.float64)
    k = torch.randn(L, H, D, generator=g, dtype=torch.float64)
    v = torch.randn(L, H, D, generator=g, dtype=torch.float64)
    sinks = torch.tensor([0.5, -1.25])
    parts = [[[list(keys) for _ in range(H)] for _ in range(N)] for keys in (range(0, 4), range(4, L))]
    outs, lses = zip(*(attention(q, k, v, p) for p in parts), strict=True)
    out, lse = merge_states(torch.stack(outs).float(), torch.stack(lses).float(), sinks=sinks)
    for n in range(N):
        for h in range(H):
            logits = [float(q[n, h] @ k[j, h]) for j in range(L)]
            z = sum(math.exp(x) for x in logits) + math.exp(float(sinks[h]))
            want = sum(math.exp(x) * v[j, h] for j, x in enumerate(logits)) / z
            torch.testing.assert_close(out[n, h].double(), want, rtol=0, atol=1e-5)
            assert lse[n, h].item() == pytest.approx(math.log(z), abs=1e-5)
    with pytest.raises(InputError, match=r"sinks is float32 \[3\] on cpu; accepted: None or a float32 tensor"):
        merge_states(torch.stack(outs).float(), torch.stack(lses).float(), sinks=torch.zeros(3))


@pytest.mark.parametrize("sinks", [None, torch.tensor([0.5, -1.0])])
def test_a_nan_lse_gives_nan_for_its_row_only(sinks):
    """NaN in, NaN out: a corrupted part must not merge into a finite, plausible answer (the
    PyTorch path once weighed it as zero and returned the other parts' mix)."""
    outs = torch.randn(3, 4, 2, 5)
    lses = torch.randn(3, 4, 2)
    lses[1, 2, 0] = float("nan")  # one part of row (token 2, head 0)
    lses[2, 3] = -math.inf  # an empty part elsewhere: still ignored
    out, lse = merge_states(outs, lses, sinks=sinks)
    assert torch.isnan(out[2, 0]).all() and torch.isnan(lse[2, 0])
    bad = torch.zeros(4, 2, dtype=torch.bool)
    bad[2, 0] = True
    assert torch.isfinite(out[~bad]).all() and torch.isfinite(lse[~bad]).all()
    # The other rows are exactly what merging them without the NaN row gives.
    keep = [0, 1, 3]
    out_k, lse_k = merge_states(outs[:, keep], lses[:, keep], sinks=sinks)
    assert torch.equal(out[keep], out_k) and torch.equal(lse[keep], lse_k)
