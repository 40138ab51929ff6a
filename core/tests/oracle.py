"""An independent float64 oracle for paged attention: plain Python loops, no paged_core code.

It reads K/V through the block table one key at a time, applies the rule of positions of
DESIGN §2 (query i of a request with t new tokens and seq_len s sits at position s - t + i and
sees keys 0..position, and with a window w only keys > position - w), and does the softmax in
Python floats (float64). Slow, so the tests keep batches small.
"""

from __future__ import annotations

import math


def loop_attention(
    q,
    k_cache,
    v_cache,
    query_lens,
    seq_lens,
    tables,
    block_size,
    *,
    scale=None,
    window=0,
    softcap=0.0,
    sinks=None,
):
    """q: [N][H][D] nested lists; k_cache/v_cache: [blocks][block_size][Hkv][D] nested lists of
    float64 values (dequantized already); tables: per-request lists of block ids.

    Returns (out [N][H][D], lse [N][H]); padding requests (seq_len 0) give zeros and -inf.
    """
    num_heads = len(q[0]) if q else 0
    head_dim = len(q[0][0]) if q else 0
    num_kv_heads = len(k_cache[0][0])
    group = num_heads // num_kv_heads
    scale = head_dim**-0.5 if scale is None else scale
    out = [[[0.0] * head_dim for _ in range(num_heads)] for _ in range(len(q))]
    lse = [[-math.inf] * num_heads for _ in range(len(q))]
    row = 0
    for r, (t, s) in enumerate(zip(query_lens, seq_lens, strict=True)):
        for i in range(t):
            if s == 0:
                row += 1
                continue
            pos = s - t + i
            for h in range(num_heads):
                g = h // group
                qv = q[row][h]
                logits, values = [], []
                for key in range(pos + 1):
                    if window and key <= pos - window:
                        continue
                    blk = tables[r][key // block_size]
                    kv = k_cache[blk][key % block_size][g]
                    x = scale * sum(a * b for a, b in zip(qv, kv, strict=True))
                    if softcap:
                        x = softcap * math.tanh(x / softcap)
                    logits.append(x)
                    values.append(v_cache[blk][key % block_size][g])
                extra = [] if sinks is None else [sinks[h]]
                m = max(logits + extra)
                weights = [math.exp(x - m) for x in logits]
                denom = sum(weights) + sum(math.exp(x - m) for x in extra)
                acc = [0.0] * head_dim
                for w, val in zip(weights, values, strict=True):
                    for d in range(head_dim):
                        acc[d] += w * val[d]
                out[row][h] = [a / denom for a in acc]
                lse[row][h] = m + math.log(denom)
            row += 1
    return out, lse
