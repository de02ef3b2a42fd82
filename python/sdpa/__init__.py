"""sdpa: exact scaled dot-product attention on the CPU.

    out = softmax(q @ k.T * scale + mask) @ v

See ``sdpa.attention`` for shapes and options, and ``sdpa.attention_backward`` for its
gradients with respect to q, k and v.
"""

from __future__ import annotations

import math
import numbers

import numpy as np

from . import _core

__all__ = ["attention", "dropout_mask", "attention_backward", "set_num_threads", "num_threads"]
__version__ = "0.1.0"

_CAUSAL = {False: "none", True: "bottom_right", "none": "none", "bottom_right": "bottom_right",
           "top_left": "top_left"}


def _asarray(name, a):
    """np.asarray(a), with a ragged nested list reported under the argument's name."""
    try:
        return np.asarray(a)
    except ValueError as e:
        raise ValueError(f"{name} is not a rectangular array: {e}") from None


def _check_real(name, a):
    if a.dtype.kind not in "biuf":
        raise TypeError(f"{name} has dtype {a.dtype}, but attention needs real numbers "
                        "(float32, float64, or integer/bool promoted to float64)")


def _check_kind(name, a):
    _check_real(name, a)
    if not 2 <= a.ndim <= 4:
        raise ValueError(f"{name} has shape {a.shape}, but must have 2, 3 or 4 dims "
                         "(N, D), (H, N, D) or (B, H, N, D)")


def _compute_dtype(*arrays):
    # float32 (and float16) inputs compute in float32; anything with float64 or integers in float64.
    if all(a.dtype in (np.float32, np.float16) for a in arrays):
        return np.dtype(np.float32)
    return np.dtype(np.float64)


def _prepared(a, dtype, unit_last_stride=True):
    """a as `dtype`, aligned, with unit stride in its last dim (the kernel's only layout need
    of q, k, v, out and dout; lse may have any strides).

    Other strides (transposes, slices, broadcast zeros) are passed through without a copy."""
    a = np.asarray(a, dtype=dtype)
    if not a.flags.aligned or (unit_last_stride and a.ndim > 0 and a.shape[-1] > 1 and a.strides[-1] != a.itemsize):
        a = np.ascontiguousarray(a)
    return a


def _prepared_mask(mask, dtype, scores_shape):
    """mask as bool or as `dtype`, its rank checked against the scores' (B, Hq, Nq, Nk)."""
    mask = _asarray("mask", mask)
    if mask.ndim > 4:  # _core only takes up to 4 dims and would not say which shape it got
        raise ValueError(f"mask has shape {mask.shape}, more dims than the scores {scores_shape}; "
                         "a mask has at most 4 dims, (B, Hq, Nq, Nk)")
    if mask.dtype == np.bool_:
        return mask
    if mask.dtype.kind != "f":
        raise TypeError(f"mask has dtype {mask.dtype}, but must be bool (True = attend, False = block) "
                        "or floating point (added to the scaled scores); for a 0/1 mask use mask.astype(bool)")
    if mask.dtype.itemsize <= dtype.itemsize:
        return np.asarray(mask, dtype=dtype)  # exact: float16 -> float32, float32 -> float64, ...
    # Narrowing (float64 -> float32, long double -> float64): a bias below the compute dtype's
    # lowest value becomes -inf, which blocks, as documented; one above its largest value
    # would become +inf, a value the caller never passed, so it is refused here by name.
    with np.errstate(over="ignore"):
        converted = np.asarray(mask, dtype=dtype)
    overflowed = np.isposinf(converted)
    if overflowed.any():
        overflowed &= ~np.isposinf(mask)  # a +inf passed as such is reported by _core as +inf
        if overflowed.any():
            index = tuple(int(i) for i in np.argwhere(overflowed)[0])
            raise ValueError(f"mask has {str(mask[index])} at index {index}, which does not fit in {dtype} "
                             f"(largest {str(np.finfo(dtype).max)}), the dtype q, k and v compute in; "
                             "pass a smaller bias, or -inf to block")
    return converted


def _window_bounds(window):
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), got {window!r}") from None
    bounds = []
    for name, x in (("left", left), ("right", right)):
        if x is None:
            x = -1
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise ValueError(f"window {name} must be an integer (-1 = unbounded), got {x!r}")
        bounds.append(int(x) if x >= 0 else -1)
    return bounds[0], bounds[1]


def _prepared_inputs(q, k, v, mask):
    """(compute dtype, q, k, v, mask) ready for _core: the dtype policy of ``attention``."""
    arrays = [_asarray(name, x) for name, x in zip("qkv", (q, k, v))]
    for name, a in zip("qkv", arrays):
        _check_kind(name, a)
    dtype = _compute_dtype(*arrays)
    q, k, v = (_prepared(a, dtype) for a in arrays)
    if mask is not None:
        mask = _prepared_mask(mask, dtype, q.shape[:-1] + k.shape[-2:-1])
    return dtype, q, k, v, mask


def _parsed_options(causal, scale, window, backend):
    """(causal code, scale or None, window left, window right) for _core, validated."""
    # Only bools (Python or NumPy) and the names: 1, 0.0 and the like are more likely slips.
    key = bool(causal) if causal is None or isinstance(causal, (bool, np.bool_)) else causal
    if not isinstance(key, (bool, str)) or key not in _CAUSAL:
        raise ValueError(f"causal must be False, True, 'bottom_right' or 'top_left', got {causal!r}")
    causal_code = _CAUSAL[key]
    if not isinstance(backend, str):
        raise ValueError(f"backend must be 'auto', 'flash', 'reference' or 'naive', got {backend!r}")
    if isinstance(scale, np.ndarray) and scale.ndim == 0:
        scale = scale[()]  # a 0-d array is a number
    if scale is not None:
        if isinstance(scale, (bool, np.bool_)) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be a real number, got {scale!r}")
        scale = float(scale)
        if not math.isfinite(scale):
            raise ValueError(f"scale must be finite, got {scale!r}")
    left, right = _window_bounds(window)
    return causal_code, scale, left, right


def _parsed_dropout(dropout_p, seed):
    """(p, seed) for _core: p a real number in [0, 1); seed an integer, required when p > 0."""
    if isinstance(dropout_p, bool) or not isinstance(dropout_p, numbers.Real):
        raise TypeError(f"dropout_p must be a real number, got {dropout_p!r}")
    p = float(dropout_p)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p!r}")
    if seed is None:
        if p > 0:
            raise ValueError("seed must be given when dropout_p > 0: the same seed draws the same "
                             "dropout mask in attention and attention_backward")
        seed = 0
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral) or not 0 <= seed < 2**64:
        raise ValueError(f"seed must be an integer in [0, 2**64), got {seed!r}")
    return p, int(seed)


def attention(q, k, v, mask=None, *, causal=False, scale=None, window=None,
              return_weights=False, return_lse=False, dropout_p=0.0, seed=None, backend="auto"):
    """Scaled dot-product attention, ``softmax(q @ kᵀ · scale + mask) @ v``, exactly.

    Shapes (all of one call have the same number of dims, 2, 3 or 4)::

        q        (B, Hq,  Nq, Dk)     or (Hq, Nq, Dk), or (Nq, Dk) for a single head
        k        (B, Hkv, Nk, Dk)     Hq must be a multiple of Hkv (grouped-query attention:
        v        (B, Hkv, Nk, Dv)     query head h reads kv head h // (Hq // Hkv))
        mask     broadcastable to (B, Hq, Nq, Nk), NumPy rules, at most as many dims as q
        returns  out      (B, Hq, Nq, Dv)
                 weights  (B, Hq, Nq, Nk)   if return_weights
                 lse      (B, Hq, Nq)       if return_lse: log-sum-exp of each row's scores

    Args:
        q, k, v: arrays or array-likes (nested lists work). float32 inputs compute and return
            float32 (float32 accumulation); float64, integer or bool inputs compute and return
            float64; float16 computes in float32 when all three are float16 or float32, and
            long double in float64. Complex or object arrays raise TypeError. NaN is never
            mistaken for a blocked key: a NaN in q, in k or in v makes every row that attends
            to it NaN (a NaN value row of a key a row blocks may reach it too: 0 · NaN).
        mask: bool (True = attend, False = block) or floating point, added to the scaled
            scores: finite biases, or -inf to block (NaN and +inf raise ValueError). Blocking
            happens before the softmax, never after. A float mask is converted to the compute
            dtype: a float64 mask with float32 q, k, v becomes float32, where a bias above
            float32's largest value (about 3.4e38) raises ValueError (it would become +inf)
            and one below its lowest (e.g. -1e300) becomes -inf, i.e. blocks. That equals the
            float64 result unless every key of a row has such a bias: float64 still weighs
            that row's keys (the least negative biases win), float32 gives it the fully
            masked row's zeros and lse = -inf.
        causal: False; True or "bottom_right"; or "top_left". With Nq=2, Nk=4 (x = attend)::

                bottom_right (True)      top_left
                  k0 k1 k2 k3             k0 k1 k2 k3
              q0   x  x  x  .         q0   x  .  .  .
              q1   x  x  x  x         q1   x  x  .  .

            and with Nq=4, Nk=2, where bottom_right leaves the first Nq - Nk rows without
            any key (zeros out, lse = -inf)::

                bottom_right (True)      top_left
                  k0 k1                   k0 k1
              q0   .  .               q0   x  .
              q1   .  .               q1   x  x
              q2   x  .               q2   x  x
              q3   x  x               q3   x  x

            "bottom_right" lets query i see keys j <= i + (Nk - Nq), so the last query sees
            every key (the KV-cache convention of FlashAttention); "top_left" lets query i see
            keys j <= i (PyTorch's is_causal). They agree when Nq == Nk. Combines with mask.
        scale: multiplies q·k; default 1 / sqrt(Dk).
        window: (left, right) sliding window; query i sees keys j with
            i' - left <= j <= i' + right, where i' = i + (Nk - Nq). -1 or None is unbounded.
        return_weights, return_lse: also return the attention weights and/or the lse.
            The weights are the softmax probabilities before any dropout.
        dropout_p, seed: dropout on the weights after the softmax: each weight (b, h, i, j) is
            dropped with probability dropout_p, kept ones are scaled by 1 / (1 - dropout_p).
            The decision is a pure function of (seed, b, h, i, j) (Philox4x32-10): the same in
            attention_backward, for any thread count, on any machine; ``dropout_mask`` shows
            it. dropout_p = 0 is exactly no dropout; a seed is required when it is > 0.
        backend: "auto" (the fastest exact kernel: today "flash"), "flash" (fused tiled SIMD
            kernel, O(N) memory), "reference" (float64, materialises the scores; the oracle
            of the tests) or "naive" (the reference's algorithm in the inputs' precision).

    Returns:
        out, or a tuple (out, weights), (out, lse) or (out, weights, lse).

    A query row with no allowed key (fully masked, or Nk == 0) gives an output row of zeros,
    weights of zeros and lse = -inf; never NaN. Results are bitwise reproducible.

    Raises:
        TypeError: complex, object or string inputs; a mask that is neither bool nor float.
        ValueError: shapes that do not fit together, a ragged nested list, a mask that does
            not broadcast, has more than 4 dims, holds NaN or +inf, or a value too large for
            the compute dtype, an unknown causal mode or backend, a non-finite scale.
            Messages name the argument.
    """
    dtype, q, k, v, mask = _prepared_inputs(q, k, v, mask)
    causal_code, scale, left, right = _parsed_options(causal, scale, window, backend)

    lead = q.shape[:-1]  # (…, Hq, Nq)
    out = np.empty(lead + (v.shape[-1],), dtype)
    weights = np.empty(lead + (k.shape[-2],), dtype) if return_weights else None
    lse = np.empty(lead, dtype) if return_lse else None
    p, seed = _parsed_dropout(dropout_p, seed)
    _core.attention(q, k, v, mask, out, weights, lse, scale, causal_code, left, right, backend, p, seed)

    extra = tuple(x for x in (weights, lse) if x is not None)
    return (out,) + extra if extra else out


def attention_backward(dout, q, k, v, out, lse, mask=None, *, causal=False, scale=None, window=None,
                       dropout_p=0.0, seed=None, backend="auto"):
    """Gradients of ``attention`` with respect to q, k and v: returns ``(dq, dk, dv)``.

    Given ``dout = ∂loss/∂out`` for ``out = attention(q, k, v, mask, ...)``, with the softmax
    probabilities ``P = softmax(q @ kᵀ · scale + mask)`` (row by row, over the keys)::

        dv = Pᵀ @ dout                          D  = rowsum(dout * out)
        dP = dout @ vᵀ                          dS = P * (dP - D)
        dq = scale · dS @ k                     dk = scale · dSᵀ @ q

    For grouped-query attention (Hq = group · Hkv) dk and dv of kv head j are these sums
    over the query heads j·group .. (j+1)·group - 1 that read it. The mask and the causal and
    window rules are constants: they get no gradient, and blocked keys receive none. A query
    row with no allowed key (fully masked, Nk == 0, lse = -inf) contributes nothing: its dq
    row is zero. "auto"/"flash" recompute P from lse, tile by tile (no Nq × Nk matrix);
    "reference" and "naive" recompute each row's softmax from q and k.

    Shapes (2, 3 or 4 dims, as in ``attention``)::

        dout  (B, Hq, Nq, Dv)       like out
        q     (B, Hq,  Nq, Dk)      k  (B, Hkv, Nk, Dk)     v  (B, Hkv, Nk, Dv)
        out   (B, Hq, Nq, Dv)       lse (B, Hq, Nq)
        mask  broadcastable to (B, Hq, Nq, Nk)
        returns dq (shaped like q), dk (like k), dv (like v)

    ``out`` and ``lse`` must be what ``attention(q, k, v, mask, causal=..., scale=...,
    window=..., return_lse=True)`` returned for these very inputs and options; the gradients
    are only meaningful then (nothing checks it).

    Args:
        dout, out, lse: arrays or array-likes, converted to the compute dtype.
        q, k, v, mask, causal, scale, window, dropout_p, seed, backend: as in ``attention``
            (with dropout, Z the kept/dropped factors: dv = (Z*P)ᵀ @ dout, dP = Z * (dout @ vᵀ)). The compute dtype is
            that of ``attention`` for q, k and v (float32 inputs give float32; float64,
            integer or bool give float64); dq, dk and dv are returned in it.
        backend: "auto"/"flash" (fused FlashAttention-2 backward, O(N) extra memory),
            "reference" (float64, materialises each row's softmax) or "naive" (the
            reference's algorithm in the inputs' precision).

    Results are bitwise reproducible, whatever the thread count.

    Raises:
        TypeError: as ``attention``, and for a dout, out or lse that is not real.
        ValueError: as ``attention``, and for a dout, out or lse of the wrong shape; messages
            name the argument.
    """
    dtype, q, k, v, mask = _prepared_inputs(q, k, v, mask)
    causal_code, scale, left, right = _parsed_options(causal, scale, window, backend)
    arrays = {name: _asarray(name, a) for name, a in (("dout", dout), ("out", out), ("lse", lse))}
    for name, a in arrays.items():
        _check_real(name, a)
    dout = _prepared(arrays["dout"], dtype)
    out = _prepared(arrays["out"], dtype)
    lse = _prepared(arrays["lse"], dtype, unit_last_stride=False)

    dq = np.empty(q.shape, dtype)
    dk = np.empty(k.shape, dtype)
    dv = np.empty(v.shape, dtype)
    p, seed = _parsed_dropout(dropout_p, seed)
    _core.attention_backward(q, k, v, mask, out, lse, dout, dq, dk, dv, scale, causal_code, left, right, backend,
                             p, seed)
    return dq, dk, dv


def dropout_mask(shape, dropout_p, seed):
    """The dropout decisions of ``attention(..., dropout_p=dropout_p, seed=seed)``: a bool array
    of ``shape`` (that of the weights: (Nq, Nk), (Hq, Nq, Nk) or (B, Hq, Nq, Nk)), True where
    weight (b, h, i, j) is kept. Kept weights are scaled by 1 / (1 - dropout_p)."""
    p, seed = _parsed_dropout(dropout_p, seed)
    shape = tuple(int(n) for n in shape)
    if not 2 <= len(shape) <= 4:
        raise ValueError(f"shape must have 2, 3 or 4 dims like the weights, got {shape}")
    mask = np.empty(shape, np.bool_)
    _core.dropout_mask(p, seed, mask)
    return mask


def set_num_threads(n):
    """Sets the threads sdpa's kernels use; 0 restores OpenMP's default (OMP_NUM_THREADS,
    else all cores). Outputs are bitwise identical whatever the count."""
    _core.set_num_threads(int(n))


def num_threads():
    """The number of threads sdpa's kernels use."""
    return _core.num_threads()
