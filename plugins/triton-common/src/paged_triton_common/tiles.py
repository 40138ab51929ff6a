"""The rules every paged attention tile applies, once: ``@triton.jit`` helpers that the unified and
the split-KV kernels call (Triton inlines them, so a helper costs nothing over writing it out).

Scores are kept in log2 units inside the loops (``exp2`` is one MUFU instruction); every
log-sum-exp that leaves a kernel is in natural-log units (:func:`natural_lse`). A row that has
seen no visible key has ``m == -inf`` and ``l == 0``; its output is zeros and its LSE ``-inf``.

* Visibility (:func:`visible`): query at position ``pos`` sees keys ``<= pos`` of valid blocks
  (:func:`block_ok`), and with a window ``w > 0`` only keys ``> pos - w``.
* Soft-cap (:func:`soft_cap`): ``cap * tanh(score / cap)``, applied before masking (a masked
  key is ``-inf``, not ``cap * tanh(-inf)``).
* Sinks (:func:`fold_sink`): a per-head natural-log logit without a value, in the denominator
  once, after every key; it never makes a row without keys seen.
* Quantized caches (:func:`codes_to`, :func:`codes8_f16`, :func:`int4_codes`, :func:`int4_f16`):
  int8 codes, or fp8 codes (e4m3 or e5m2) that travel as ``uint8`` (the CPU interpreter has no
  float8 pointers) and are bitcast here; int4 codes come two to a byte. Codes convert exactly to
  fp16 (and 8-bit ones to bf16), so a dot on raw codes loses nothing; scales are applied by the
  caller to scores or probabilities. On the GPU codes become fp16 in a few integer instructions
  per four (8-bit) or eight (int4) codes (inline PTX); :func:`q_f16` brings a 16-bit ``q`` into
  fp16's range for such dots.
* The online-softmax step (:func:`softmax_step`): the running max and sum after one key tile;
  :func:`pv_step` folds the tile's probabilities times V (and V's scales) into the accumulator.
* The interpreter switch (:func:`upcast`): the interpreter of Triton 3.9 stores bfloat16 as raw
  16-bit integers and silently computes garbage on any bf16 value not first converted with
  ``.to(tl.float32)``; on the GPU 16-bit operands go into ``tl.dot`` untouched (tensor cores).
"""

import triton
import triton.language as tl

__all__ = [
    "FP8_E4M3",
    "FP8_E5M2",
    "LN2",
    "LOG2E",
    "block_ok",
    "codes8_f16",
    "codes_to",
    "fold_sink",
    "int4_codes",
    "int4_f16",
    "kivi4_keys",
    "log2_scores",
    "natural_lse",
    "pv_step",
    "q_f16",
    "sink_weight",
    "soft_cap",
    "softmax_step",
    "tanh",
    "upcast",
    "visible",
]

# tl.constexpr: compiled kernels may only read constexpr globals (the interpreter reads any).
LOG2E = tl.constexpr(1.4426950408889634)
LN2 = tl.constexpr(0.6931471805599453)
#: :func:`codes_to`'s ``FP8`` for each fp8 code format (0: not fp8 codes).
FP8_E4M3 = 1
FP8_E5M2 = 2


@triton.jit
def tanh(x):
    """tanh for float32 ``x``: ``tl`` has no portable tanh across Triton 3.6..3.9 and the
    interpreter (libdevice is not). ``1 - 2 / (exp(2x) + 1)`` saturates cleanly (exp overflow ->
    1, underflow -> -1) but cancels for small ``|x|`` (0 below 3e-8: a soft-cap far above the
    scores would flatten them), so below 0.2 the series ``x - x^3/3 + 2x^5/15 - 17x^7/315``
    (truncation < 6e-8 relative). Relative error < 1e-6 everywhere (tests/test_tiles.py)."""
    x2 = x * x
    series = x * (1.0 + x2 * (-0.3333333333333333 + x2 * (0.13333333333333333 + x2 * -0.05396825396825397)))
    return tl.where(tl.abs(x) < 0.2, series, 1.0 - 2.0 / (tl.exp(2.0 * x) + 1.0))


@triton.jit
def upcast(x, UPCAST: tl.constexpr):
    """``x`` in float32 when ``UPCAST`` (on under ``TRITON_INTERPRET=1`` only), else unchanged."""
    if UPCAST:
        x = x.to(tl.float32)
    return x


@triton.jit
def codes_to(x, dtype, FP8: tl.constexpr):
    """A loaded K/V tile in ``dtype``: values or int8 codes (``FP8`` 0 or False), or fp8 codes
    as uint8, e4m3 (``FP8`` 1 or True, :data:`FP8_E4M3`) or e5m2 (2, :data:`FP8_E5M2`).

    e4m3 -> fp16 is a native cvt on sm_89+ (cvt.rn.f16x2.e4m3x2: two codes per instruction);
    e4m3 -> bf16 is not, it goes through f16/f32. e5m2 is the upper byte of its fp16 value.
    """
    if FP8 == 2:
        x = x.to(tl.float8e5, bitcast=True)
    elif FP8:
        x = x.to(tl.float8e4nv, bitcast=True)
    return x.to(dtype)


@triton.jit
def int4_codes(x):
    """Packed int4 codes ``[R, C]`` (uint8: element ``2c`` in the low nibble of byte ``c``, ``2c +
    1`` in its high nibble, two's complement; ``paged_core.pack_int4``) as int8 codes ``[R, 2C]``."""
    b = x.to(tl.int8, bitcast=True)
    lo = (b << 4) >> 4  # arithmetic shifts sign-extend each nibble
    hi = b >> 4
    return tl.reshape(tl.join(lo, hi), (x.shape[0], 2 * x.shape[1]))


# int4 -> fp16 of eight codes (one 32-bit register) per PTX block: decode 64 x 4,096 (Qwen3-8B
# attention) 0.243 ms vs 0.321 ms unpacking to int8 and converting (NVIDIA H100, Triton 3.6,
# 2026-12-07). The second operand is a dummy: Triton moves the layout change of a dot operand
# above a pure unary conversion (onto the packed codes, which it then reads from shared memory
# one byte at a time); a binary one stays.
@triton.jit
def _int4x8_f16(x):
    # Four bytes, eight codes: (low nibbles, high nibbles) as fp16. With u = code + 8 (each
    # nibble's sign bit flipped): 0x6400 | u is 1024 + u, minus 1032; 0x6400 | u << 4 is
    # 1024 + 16u, times 1/16 minus 72. Exact.
    return tl.inline_asm_elementwise(
        asm="""{
        .reg .b32 t, a, b, m, s, c;
        xor.b32 t, $4, 0x88888888;
        prmt.b32 a, t, 0, 0x4140;
        prmt.b32 b, t, 0, 0x4342;
        mov.b32 m, 0x64086408;
        lop3.b32 $0, a, 0x000f000f, 0x64006400, 0xea;
        lop3.b32 $1, b, 0x000f000f, 0x64006400, 0xea;
        sub.f16x2 $0, $0, m;
        sub.f16x2 $1, $1, m;
        mov.b32 s, 0x2c002c00;
        mov.b32 c, 0xd480d480;
        lop3.b32 $2, a, 0x00f000f0, 0x64006400, 0xea;
        lop3.b32 $3, b, 0x00f000f0, 0x64006400, 0xea;
        fma.rn.f16x2 $2, $2, s, c;
        fma.rn.f16x2 $3, $3, s, c;
        }""",
        constraints="=r,=r,=r,=r,r,r",
        args=[x, tl.zeros_like(x)],
        dtype=(tl.float16, tl.float16),
        is_pure=True,
        pack=4,
    )


@triton.jit
def int4_f16(x, ASM: tl.constexpr):
    """Packed int4 codes ``[R, C]`` (uint8, :func:`int4_codes`'s order) as exact fp16 ``[R, 2C]``."""
    if ASM:
        lo, hi = _int4x8_f16(x)
    else:
        b = x.to(tl.int8, bitcast=True)
        lo = ((b << 4) >> 4).to(tl.float16)  # arithmetic shifts sign-extend each nibble
        hi = (b >> 4).to(tl.float16)
    return tl.reshape(tl.join(lo, hi), (x.shape[0], 2 * x.shape[1]))


@triton.jit
def kivi4_keys(kp, k_scale_ptr, blk, kv_head, stride_ks_b, stride_ks_h, offs_d, d_mask, F16: tl.constexpr,
               ASM: tl.constexpr, BLOCK_SIZE: tl.constexpr):  # fmt: skip
    """kivi4 keys ``[BLOCK_N, HEAD_DIM_PAD]`` from packed codes ``kp`` (``[BLOCK_N, HEAD_DIM_PAD //
    2]``, :func:`int4_codes`'s order) times their block's channel scales (``k_scale_ptr``:
    float32 ``[num_blocks, num_kv_heads, head_dim]`` via the two strides; ``blk``: each key's
    block id, 0 where masked). fp16 with ``F16`` (the product rounded once), else float32.

    The step's first key must be a multiple of ``min(BLOCK_N, BLOCK_SIZE)``: each run of that
    many keys then lies in one cache block, whose scale row is loaded once (``BLOCK_N /
    BLOCK_SIZE`` rows per step, not one per key and channel).
    """
    BLOCK_N: tl.constexpr = kp.shape[0]
    HEAD_DIM_PAD: tl.constexpr = 2 * kp.shape[1]
    RUN: tl.constexpr = BLOCK_N if BLOCK_N < BLOCK_SIZE else BLOCK_SIZE
    NB: tl.constexpr = BLOCK_N // RUN
    ids = tl.max(tl.reshape(blk, (NB, RUN)), 1)  # [NB] the run's block (its keys share one id)
    sc = tl.load(
        k_scale_ptr + ids[:, None] * stride_ks_b + kv_head * stride_ks_h + offs_d[None, :],
        mask=d_mask[None, :],
        other=0.0,
    )  # [NB, HEAD_DIM_PAD]
    if F16:
        codes = int4_f16(kp, ASM).to(tl.float32)
    else:
        codes = int4_codes(kp).to(tl.float32)
    k = tl.reshape(codes, (NB, RUN, HEAD_DIM_PAD)) * sc[:, None, :]
    k = tl.reshape(k, (BLOCK_N, HEAD_DIM_PAD))
    if F16:
        k = k.to(tl.float16)
    return k


# Four 8-bit codes (one 32-bit register) -> four fp16 (two registers), exact:
# int8: with u = code + 128 (each sign bit flipped), 0x6400 | u is 1024 + u, minus 1152;
# e4m3: the native two-code conversion, twice; e5m2: each code is the upper byte of its fp16.
_INT8X4_F16 = tl.constexpr("""{
    .reg .b32 t, m;
    xor.b32 t, $2, 0x80808080;
    prmt.b32 $0, t, 0x64646464, 0x4140;
    prmt.b32 $1, t, 0x64646464, 0x4342;
    mov.b32 m, 0x64806480;
    sub.f16x2 $0, $0, m;
    sub.f16x2 $1, $1, m;
    }""")
_E4M3X4_F16 = tl.constexpr("""{
    .reg .b16 a, b;
    mov.b32 {a, b}, $2;
    cvt.rn.f16x2.e4m3x2 $0, a;
    cvt.rn.f16x2.e4m3x2 $1, b;
    }""")
_E5M2X4_F16 = tl.constexpr("""{
    prmt.b32 $0, $2, 0, 0x1404;
    prmt.b32 $1, $2, 0, 0x3424;
    }""")


@triton.jit
def codes8_f16(x, FP8: tl.constexpr, ASM: tl.constexpr, STAGED: tl.constexpr):
    """8-bit codes (int8, or fp8 as uint8 with ``FP8`` as in :func:`codes_to`) as exact fp16.

    ``ASM`` (the GPU): inline PTX, four codes per block. ``STAGED`` keeps the conversion in the
    layout the tile was loaded in (the asm is declared impure, so Triton cannot move the MMA
    operand's layout change above it onto the codes): for V, whose reduction dim (keys) is not
    contiguous in memory, the fp16 values then reach the MMA through shared memory with one
    transposing ``ldmatrix`` per 16 bytes instead of one shared-memory load per code
    (the split kernel's int8 decode step at 64 keys: 1,473 instructions converted to bf16 in the
    MMA layout, 970 this way; sm_90a, Triton 3.9). K's reduction dim (its head dim) is
    contiguous: unstaged, its codes reach the MMA layout with ``ldmatrix`` and convert there
    (staged K has fewer instructions but ran slower: int8 decode 64 x 4,096 0.2676 ms vs 0.2315;
    NVIDIA H100, Triton 3.6, 2026-12-07, docs/results/2026-12-07-h100-staged-conversion-ab.txt).
    Without ``ASM`` Triton converts (fp8 to fp16 is one native instruction per two codes; int8
    to fp16 a slow I2F each).
    """
    if ASM:
        b = x.to(tl.uint8, bitcast=True)
        if FP8 == 2:
            y = _codes8x4_f16(b, _E5M2X4_F16, STAGED)
        elif FP8:
            y = _codes8x4_f16(b, _E4M3X4_F16, STAGED)
        else:
            y = _codes8x4_f16(b, _INT8X4_F16, STAGED)
    else:
        y = codes_to(x, tl.float16, FP8)
    return y


@triton.jit
def _codes8x4_f16(b, ASM_TEXT: tl.constexpr, STAGED: tl.constexpr):
    # The second operand is a dummy, as in _int4x8_f16.
    return tl.inline_asm_elementwise(
        asm=ASM_TEXT,
        constraints="=r,=r,r,r",
        args=[b, tl.zeros_like(b)],
        dtype=tl.float16,
        is_pure=not STAGED,
        pack=4,
    )


@triton.jit
def q_f16(q):
    """A 16-bit (or float32) ``q`` tile in fp16 for dots with fp16 codes: scaled by a power of
    two (exact) so that ``max|q| < 2**14``, which bf16 values beyond fp16's range need. Returns
    ``(q16, factor)``: the scores of ``q16`` times ``factor`` are those of ``q``."""
    qf = q.to(tl.float32)
    amax = tl.max(tl.max(tl.abs(qf), 1), 0)
    exponent = ((amax.to(tl.int32, bitcast=True) >> 23) & 0xFF) - 127
    shift = tl.minimum(tl.maximum(exponent - 13, 0), 100)
    q16 = (qf * ((127 - shift) << 23).to(tl.float32, bitcast=True)).to(tl.float16)
    return q16, ((127 + shift) << 23).to(tl.float32, bitcast=True)


@triton.jit
def block_ok(block, num_blocks):
    """Block ids inside the pool ``[0, num_blocks)``. Callers mask the keys of any other id and
    read them at block 0, so a corrupt block table never reads outside the cache."""
    return (block >= 0) & (block < num_blocks)


@triton.jit
def visible(key_ok, offs_n, q_last, q_pos, window, USE_WINDOW: tl.constexpr):
    """``[rows, keys]``: key ``offs_n`` is valid (``key_ok``), at most ``q_last`` (the row's
    position, or less where the tile's keys end sooner), and with ``USE_WINDOW`` after
    ``q_pos - window``."""
    vis = key_ok[None, :] & (offs_n[None, :] <= q_last[:, None])
    if USE_WINDOW:
        vis = vis & (offs_n[None, :] > q_pos[:, None] - window)
    return vis


@triton.jit
def soft_cap(x, cap):
    """``cap * tanh(x)`` for scores ``x`` already divided by the cap (each kernel folds that
    division, and its log2 factor into ``cap``, where it costs least)."""
    return tanh(x) * cap


@triton.jit
def log2_scores(qk, k_sc, qk_scale, softcap, KEY_SCALED: tl.constexpr, USE_SOFTCAP: tl.constexpr,
                RAW: tl.constexpr):  # fmt: skip
    """A tile's scores in log2 units from its raw dots ``qk [rows, keys]`` (float32).

    ``qk_scale`` is the softmax scale times log2(e), or with ``USE_SOFTCAP`` the scale divided by
    the cap (times any factor the caller folded into q). ``KEY_SCALED``: each key's scale ``k_sc
    [keys]`` joins ``qk_scale`` per column first, so a score costs one multiply. ``RAW`` (no key
    scales, no cap): the dots are returned unscaled and :func:`softmax_step` applies ``qk_scale``
    inside its exponent.
    """
    if KEY_SCALED:
        s = qk * (k_sc * qk_scale)[None, :]
        if USE_SOFTCAP:
            s = soft_cap(s, softcap * LOG2E)
    elif USE_SOFTCAP:
        s = soft_cap(qk * qk_scale, softcap * LOG2E)
    elif RAW:
        s = qk
    else:
        s = qk * qk_scale
    return s


@triton.jit
def softmax_step(s, m_i, l_i, qk_scale, MAY_BE_EMPTY: tl.constexpr, RAW: tl.constexpr):
    """Fold a tile of scores ``s [rows, keys]`` into the running max ``m_i`` and sum ``l_i``.

    ``s`` is in log2 units, or with ``RAW`` unscaled, ``qk_scale`` (> 0) then applied inside the
    exponent (``s * qk_scale - m`` is one FFMA). ``MAY_BE_EMPTY``: a row may have no visible key
    yet (``m = -inf``); subtracting 0 instead of -inf keeps ``exp2(-inf - (-inf)) = NaN`` out of
    ``alpha`` and ``p`` (both are then exactly 0). Returns ``(p, alpha, l_i, m_new)``: the tile's
    probabilities, the factor the accumulator is rescaled by, the new sum and max.
    """
    if RAW:
        m_new = tl.maximum(m_i, tl.max(s, 1) * qk_scale)
    else:
        m_new = tl.maximum(m_i, tl.max(s, 1))
    if MAY_BE_EMPTY:
        m_ref = tl.where(m_new == float("-inf"), 0.0, m_new)
    else:
        m_ref = m_new  # every score is finite, and so is the max
    alpha = tl.exp2(m_i - m_ref)  # [rows]
    if RAW:
        p = tl.exp2(s * qk_scale - m_ref[:, None])
    else:
        p = tl.exp2(s - m_ref[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    return p, alpha, l_i, m_new


@triton.jit
def pv_step(acc, alpha, p, v, v_sc, dtype, QUANT: tl.constexpr, QDOT16: tl.constexpr,
            DOT_PRECISION: tl.constexpr):  # fmt: skip
    """``acc * alpha + p @ V`` for one key tile: ``p [rows, keys]`` from :func:`softmax_step`,
    ``v [keys, dv]`` values or codes already in the dot dtype (``dtype``, or fp16 with ``QDOT16``),
    and with ``QUANT`` each key's V scale ``v_sc [keys]`` (float32), applied to ``p``:
    ``p @ (codes * s) == (p * s) @ codes``, ``rows x keys`` multiplies instead of ``keys x dv``.

    With ``QDOT16`` the product ``p * s`` goes into an fp16 dot, where small scales could sink it
    into subnormals: dividing by the tile's largest scale keeps ``p * s / s_max`` in ``[0, 1]``
    (the range, and rounding, of plain probabilities in an fp16 flash kernel), and ``s_max``
    multiplies the ``[rows, dv]`` product once. Accumulation stays in float32.
    """
    if QDOT16:
        vs_max = tl.max(tl.abs(v_sc), 0)
        vs_max = tl.where(vs_max > 0.0, vs_max, 1.0)
        pv = tl.dot((p * (v_sc / vs_max)[None, :]).to(tl.float16), v, input_precision=DOT_PRECISION)
        acc = acc * alpha[:, None] + pv * vs_max
    else:
        if QUANT:
            p = p * v_sc[None, :]
        acc = tl.dot(p.to(dtype), v, acc * alpha[:, None], input_precision=DOT_PRECISION)
    return acc


@triton.jit
def fold_sink(m_i, l_i, acc, sinks_ptr, head, row_mask, seen):
    """Add each row's sink (``sinks_ptr[head]``, a natural-log logit without a value) to the
    denominator, after every key: the same softmax as starting from ``(m = sink, l = 1)``. Rows
    not ``seen`` keep ``l == 0``, the "no visible key" signal. Returns ``(m_i, l_i, acc)``."""
    sink = tl.load(sinks_ptr + head, mask=row_mask, other=0.0) * LOG2E
    m_fin = tl.maximum(m_i, sink)
    rescale = tl.exp2(m_i - m_fin)  # m_i = -inf (no keys): 0, and acc is 0 anyway
    l_i = tl.where(seen, l_i * rescale + sink_weight(sink, m_fin, LOG2=True), 0.0)
    acc = acc * rescale[:, None]
    return m_fin, l_i, acc


@triton.jit
def sink_weight(sink, m, LOG2: tl.constexpr):
    """A sink's term of the denominator, ``exp(sink - m)`` for the running max ``m >= sink``
    (``exp2`` with ``LOG2``): exactly 1 where the sink is the max, so a sink of ``+inf`` takes
    all the mass (zeros out, LSE ``+inf``) instead of ``exp(inf - inf) = NaN``."""
    d = tl.where(sink == m, 0.0, sink - m)
    if LOG2:
        return tl.exp2(d)
    return tl.exp(d)


@triton.jit
def natural_lse(m_i, l_safe, seen):
    """The rows' log-sum-exp in natural-log units from the log2-unit max and a sum that is 1
    where the row was not ``seen`` (those get ``-inf``)."""
    return tl.where(seen, (m_i + tl.log2(l_safe)) * LN2, float("-inf"))
