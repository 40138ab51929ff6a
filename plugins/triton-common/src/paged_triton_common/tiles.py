"""The rules every paged attention tile applies, once: ``@triton.jit`` helpers that both Triton
backends' kernels call (Triton inlines them, so a helper costs nothing over writing it out).

Scores are kept in log2 units inside the loops (``exp2`` is one MUFU instruction); every
log-sum-exp that leaves a kernel is in natural-log units (:func:`natural_lse`). A row that has
seen no visible key has ``m == -inf`` and ``l == 0``; its output is zeros and its LSE ``-inf``.

* Visibility (:func:`visible`): query at position ``pos`` sees keys ``<= pos`` of valid blocks
  (:func:`block_ok`), and with a window ``w > 0`` only keys ``> pos - w``.
* Soft-cap (:func:`soft_cap`): ``cap * tanh(score / cap)``, applied before masking (a masked
  key is ``-inf``, not ``cap * tanh(-inf)``).
* Sinks (:func:`fold_sink`): a per-head natural-log logit without a value, in the denominator
  once, after every key; it never makes a row without keys seen.
* 8-bit caches (:func:`codes_to`): int8 codes, or fp8 codes (e4m3 or e5m2) that travel as
  ``uint8`` (the CPU interpreter has no float8 pointers) and are bitcast here. Codes convert exactly to
  fp16/bf16, so a dot on raw codes loses nothing; scales are applied by the caller to scores or
  probabilities. int4 codes (:func:`int4_codes`) come two to a byte and unpack to int8 codes.
* The online-softmax step (:func:`softmax_step`): the running max and sum after one key tile.
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
    "codes_to",
    "fold_sink",
    "int4_codes",
    "natural_lse",
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
