"""Deliberately simple NumPy references for ``sdpa.attention``, written from its docstring.

Nothing here is shared with the C++ library: shapes are normalised to 4 dims, kv heads are
repeated for grouped-query attention, the mask, causal rule and window are turned into one
boolean "allowed" array plus one additive float bias, and every (batch, head) pair is then an
ordinary masked, max-shifted softmax followed by a matrix product.

``reference_attention`` computes in float64 and is the oracle. ``naive_float32_attention`` is
the same algorithm with every step in float32; it is the yardstick for float32 tolerances
(see ``float32_tolerance``).
"""

from __future__ import annotations

import math
import zlib

import ml_dtypes
import numpy as np

_CAUSAL_MODES = {False: "none", None: "none", "none": "none",
                 True: "bottom_right", "bottom_right": "bottom_right", "top_left": "top_left"}


def _to4(a):
    """(N, D) -> (1, 1, N, D); (H, N, D) -> (1, H, N, D); (B, H, N, D) unchanged."""
    while a.ndim < 4:
        a = a[np.newaxis]
    return a


def _structural_allowed(nq, nk, causal, window):
    """(Nq, Nk) bool: which keys each query may see under the causal rule and the window (the C++
    tests and fuzzers state the same rule once: tests/oracle/oracle.cc, key_range)."""
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    allowed = np.ones((nq, nk), dtype=bool)
    mode = _CAUSAL_MODES[causal]
    if mode == "bottom_right":
        allowed &= j <= i + (nk - nq)
    elif mode == "top_left":
        allowed &= j <= i
    if window is not None:
        left, right = window
        shifted = i + (nk - nq)  # i' = i + (Nk - Nq): aligned bottom-right, like causal
        if left is not None and left >= 0:
            allowed &= j >= shifted - left
        if right is not None and right >= 0:
            allowed &= j <= shifted + right
    return allowed


def _attention(q, k, v, mask, causal, scale, window, dtype):
    q = np.asarray(q)
    k = np.asarray(k)
    v = np.asarray(v)
    rank = q.ndim
    assert k.ndim == rank and v.ndim == rank and 2 <= rank <= 4
    q4, k4, v4 = (_to4(np.asarray(a, dtype=dtype)) for a in (q, k, v))
    b, hq, nq, dk = q4.shape
    hkv, nk, dv = k4.shape[1], k4.shape[2], v4.shape[3]
    assert k4.shape == (b, hkv, nk, dk) and v4.shape == (b, hkv, nk, dv)
    assert hkv > 0 and hq % hkv == 0
    group = hq // hkv
    # Grouped-query attention: query head h reads kv head h // group.
    k4 = np.repeat(k4, group, axis=1)
    v4 = np.repeat(v4, group, axis=1)

    if scale is None:
        scale = 1.0 / math.sqrt(dk)
    scale = dtype.type(scale)

    allowed = np.broadcast_to(_structural_allowed(nq, nk, causal, window), (b, hq, nq, nk)).copy()
    bias = np.zeros((b, hq, nq, nk), dtype=dtype)
    if mask is not None:
        mask = np.asarray(mask)
        assert mask.ndim <= rank
        if mask.dtype == np.bool_:
            allowed &= np.broadcast_to(mask, (b, hq, nq, nk))
        else:
            bias = bias + np.broadcast_to(np.asarray(mask, dtype=dtype), (b, hq, nq, nk))

    out = np.zeros((b, hq, nq, dv), dtype=dtype)
    weights = np.zeros((b, hq, nq, nk), dtype=dtype)
    lse = np.full((b, hq, nq), -np.inf, dtype=dtype)
    for bi in range(b):
        for h in range(hq):
            scores = (q4[bi, h] @ k4[bi, h].T) * scale + bias[bi, h]  # (Nq, Nk)
            ok = allowed[bi, h] & (scores != -np.inf)  # a -inf bias blocks, like False; NaN stays
            for i in range(nq):
                if not ok[i].any():
                    continue  # no allowed key: out 0, weights 0, lse -inf
                row = scores[i][ok[i]]
                m = row.max()
                e = np.exp(row - m)
                total = e.sum()
                weights[bi, h, i, ok[i]] = e / total
                lse[bi, h, i] = m + np.log(total)
            out[bi, h] = weights[bi, h] @ v4[bi, h]

    lead = q.shape[:-2]  # drop the padding dims again
    return (out.reshape(lead + (nq, dv)), weights.reshape(lead + (nq, nk)), lse.reshape(lead + (nq,)))


def reference_attention(q, k, v, mask=None, causal=False, scale=None, window=None):
    """float64 oracle: returns (out, weights, lse) with the shapes ``sdpa.attention`` documents."""
    return _attention(q, k, v, mask, causal, scale, window, np.dtype(np.float64))


def naive_float32_attention(q, k, v, mask=None, causal=False, scale=None, window=None):
    """The same algorithm with inputs, scores, softmax and products all in float32."""
    return _attention(q, k, v, mask, causal, scale, window, np.dtype(np.float32))


# Float32 tolerance rule
# ----------------------
# A float32 result is compared with the float64 oracle at
#
#     tol = 2 * max|naive_float32 - oracle| + floor,
#     floor = 4 * eps32 * max(1, max|oracle|) * max(1, score_scale)
#
# computed separately for out, weights and lse on the very inputs of the test case: the
# library may be at most twice as wrong as the simplest float32 implementation. The floor
# (a few float32 ulps of the result's magnitude) covers cases where the naive version happens
# to be (almost) exact. score_scale is 1 (a tiny floor) everywhere except in tests that use
# deliberately huge scores: there every float32 implementation rounds each score to
# eps32 * |score|, so which of two implementations is luckier on one case is noise of that
# size; those tests pass score_scale = max |lse| (the size of the scores that carry weight).
# Whether the library is *systematically* less accurate than the naive version is tested
# separately, over many cases (test_attention.py::test_float32_accuracy_is_not_systematically_worse).
EPS32 = float(np.finfo(np.float32).eps)


def finite_max_abs(a):
    """max |a| over its finite entries (0 if there are none)."""
    a = np.asarray(a, dtype=np.float64)
    a = a[np.isfinite(a)]
    return float(np.abs(a).max()) if a.size else 0.0


def max_error(got, ref64):
    """max |got - ref| over the entries where the reference is finite (0 if there are none)."""
    got = np.asarray(got, dtype=np.float64)
    ref64 = np.asarray(ref64, dtype=np.float64)
    finite = np.isfinite(ref64)
    return float(np.abs(got[finite] - ref64[finite]).max()) if finite.any() else 0.0


def float32_tolerance(naive32, ref64, score_scale=1.0):
    """The float32 rule above, for one result (out, weights or lse) of one test case."""
    floor = 4.0 * EPS32 * max(1.0, finite_max_abs(ref64)) * max(1.0, score_scale)
    return 2.0 * max_error(naive32, ref64) + floor


def float64_tolerance(ref64):
    """About 1e-12 relative to the magnitude of the result (the oracle rounds differently)."""
    return 1e-12 * max(1.0, finite_max_abs(ref64))


def assert_close(got, ref, tol, what="result"):
    """|got - ref| <= tol elementwise, with infinities (the lse of empty rows) matched exactly."""
    got = np.asarray(got)
    ref = np.asarray(ref)
    assert got.shape == ref.shape, f"{what}: shape {got.shape} != {ref.shape}"
    assert not np.isnan(got).any(), f"{what}: contains NaN"
    inf = ~np.isfinite(ref)
    assert np.array_equal(got[inf], ref[inf]), f"{what}: infinities differ: got {got[inf]}, want {ref[inf]}"
    assert np.isfinite(got[~inf]).all(), f"{what}: non-finite where the reference is finite"
    diff = np.abs(got[~inf].astype(np.float64) - ref[~inf].astype(np.float64))
    worst = float(diff.max()) if diff.size else 0.0
    assert worst <= tol, f"{what}: max abs error {worst:.3g} > tolerance {tol:.3g}"


# Backward pass
# -------------
# Written from the maths of the softmax, independently of the C++. With P the weights of the
# forward pass (each row a softmax over the allowed keys, zero elsewhere), G = dout:
#
#     dv = Pᵀ @ G             dP = G @ vᵀ             D = rowsum(G * out)
#     dS = P * (dP - D)       dq = scale · dS @ k     dk = scale · dSᵀ @ q
#
# with k and v repeated over the query heads of a GQA group, so that dk and dv of a kv head
# are summed over its group. Rows without an allowed key have P = 0 and contribute nothing.


def _attention_backward(dout, q, k, v, mask, causal, scale, window, dtype, magnitudes=False, out=None):
    q = np.asarray(q)
    k = np.asarray(k)
    v = np.asarray(v)
    q4, k4, v4 = (_to4(np.asarray(a, dtype=dtype)) for a in (q, k, v))
    b, hq, nq, dk = q4.shape
    hkv, nk, dv = k4.shape[1], k4.shape[2], v4.shape[3]
    group = hq // hkv
    if scale is None:
        scale = 1.0 / math.sqrt(dk) if dk > 0 else 1.0
    recomputed, p, _ = _attention(q4, k4, v4, mask, causal, scale, window, dtype)  # (b, hq, nq, ·)
    # D from the out given (as sdpa.attention_backward takes it: a 16-bit out is rounded), else
    # from the out recomputed here.
    out = recomputed if out is None else _to4(np.asarray(out, dtype=dtype)).reshape(b, hq, nq, dv)
    g = _to4(np.asarray(dout, dtype=dtype)).reshape(b, hq, nq, dv)
    scale = dtype.type(scale)
    kr = np.repeat(k4, group, axis=1)
    vr = np.repeat(v4, group, axis=1)
    dv_full = np.swapaxes(p, -1, -2) @ g                      # (b, hq, nk, dv)
    dp = g @ np.swapaxes(vr, -1, -2)                          # (b, hq, nq, nk)
    d = (g * out).sum(axis=-1, keepdims=True, dtype=dtype)    # (b, hq, nq, 1)
    ds = p * (dp - d)
    dq = (ds @ kr) * scale                                    # (b, hq, nq, dk)
    dk_full = (np.swapaxes(ds, -1, -2) @ q4) * scale          # (b, hq, nk, dk)
    dk_sum = dk_full.reshape(b, hkv, group, nk, dk).sum(axis=2, dtype=dtype)
    dv_sum = dv_full.reshape(b, hkv, group, nk, dv).sum(axis=2, dtype=dtype)
    if magnitudes:
        # The size of the terms that cancel in dS = P (dP - D), through to dq and dk.
        mag = p * (np.abs(dp) + np.abs(d))                                          # (b, hq, nq, nk)
        kmax = np.abs(kr).max(axis=-1, initial=0.0)                                 # (b, hq, nk)
        qmax = np.abs(q4).max(axis=-1, initial=0.0)                                 # (b, hq, nq)
        m_dq = abs(float(scale)) * float((mag * kmax[:, :, None, :]).sum(axis=-1).max(initial=0.0))
        col = (mag * qmax[..., None]).sum(axis=-2).reshape(b, hkv, group, nk).sum(axis=2)
        m_dk = abs(float(scale)) * float(col.max(initial=0.0))
        return m_dq, m_dk, 0.0
    return dq.reshape(q.shape), dk_sum.reshape(k.shape), dv_sum.reshape(v.shape)


def reference_attention_backward(dout, q, k, v, mask=None, causal=False, scale=None, window=None, out=None):
    """float64 oracle of ``sdpa.attention_backward``: (dq, dk, dv) shaped like q, k, v. The
    forward quantities (P, out) are recomputed here in float64 from q, k, v; with `out` given,
    D = rowsum(dout * out) uses that out instead (sdpa's backward reads the out it is given)."""
    return _attention_backward(dout, q, k, v, mask, causal, scale, window, np.dtype(np.float64), out=out)


def naive_float32_attention_backward(dout, q, k, v, mask=None, causal=False, scale=None, window=None, out=None):
    """The same algorithm with every step (forward included) in float32: the yardstick."""
    return _attention_backward(dout, q, k, v, mask, causal, scale, window, np.dtype(np.float32), out=out)


def backward_floors(dout, q, k, v, mask=None, causal=False, scale=None, window=None, eps=EPS32):
    """The floor of the backward tolerance rule for (dq, dk, dv), in units of the dtype's eps:

        eps * (4 * max(1, max |ref|) + 2 * max |lse| * max |ref| + M)

    4 * max(1, max |ref|): a few roundings of the result, as ``float32_tolerance``.
    2 * max |lse| * max |ref|: the backward reads P = exp(s - lse) through the lse it is
        given, rounded to eps * |lse| / 2 however exact the forward (which adds its own ulp or
        so): a relative error of every p that the naive version, recomputing its softmax from
        scratch, does not have (the ``score_scale`` of the float32 rule above).
    M: the size of the terms that cancel in dS = P * (dP - D), only accurate to eps relative
        to |dP| + |D|: M_dq = |scale| max_i sum_j P_ij (|dP_ij| + |D_i|) max|k_j| and M_dk
        the same summed over the queries (and heads of a group) of each key, with max|q_i|;
        0 for dv. Where every row has one allowed key, P = 1 and out = v exactly, and the
        naive version may get dP - D = 0 exactly, while another summation order does not.
    """
    ref = reference_attention_backward(dout, q, k, v, mask, causal, scale, window)
    lse_max = finite_max_abs(reference_attention(q, k, v, mask, causal, scale, window)[2])
    mags = _attention_backward(dout, q, k, v, mask, causal, scale, window, np.dtype(np.float64), magnitudes=True)
    return [eps * (4 * max(1.0, finite_max_abs(r)) + 2 * lse_max * finite_max_abs(r) + m) for r, m in zip(ref, mags)]


# 16-bit storage (float16, bfloat16)
# ----------------------------------
# sdpa widens 16-bit inputs exactly to float32, computes in float32 and rounds each result once
# to its dtype. A 16-bit result is compared with the float64 oracle, run on the inputs widened
# to float64, at
#
#     tol = 2 * max|round16(naive32) - oracle| + ulp16(max|oracle|) + floor32
#
# naive32: the naive float32 implementation on the same widened inputs, its result rounded to
#     the 16-bit dtype once: the simplest implementation with the same storage, which the
#     library may be at most twice as wrong as (the float32 rule's factor);
# ulp16: one unit in the last place of the 16-bit dtype at the result's largest magnitude: a
#     float32 result near a tie between two 16-bit values may round the other way than the
#     naive one, by up to one unit;
# floor32: the float32 rule's floor (``float32_tolerance`` with naive32 exact), since the
#     arithmetic is float32's.
# Results stored in float32 (weights, lse, and out of float32 q over 16-bit k and v) keep the
# float32 rule. The library's tests (tests/test_util.cc) use the same rule.


def ulp(dtype, x):
    """One unit in the last place of `dtype` (float16, bfloat16, float32) at magnitude |x|:
    the spacing of its values in the binade of x (that of the subnormals below the normals)."""
    info = ml_dtypes.finfo(dtype)
    x = max(abs(float(x)), float(info.smallest_normal))
    return 2.0 ** (math.floor(math.log2(x)) - int(info.nmant))


def lowp_tolerance(naive32, ref64, dtype, score_scale=1.0):
    """The rule above for one result of dtype `dtype`; float32 results get ``float32_tolerance``."""
    dtype = np.dtype(dtype)
    if dtype == np.float32:
        return float32_tolerance(naive32, ref64, score_scale)
    naive = np.asarray(naive32, dtype=np.float32).astype(dtype)  # rounded once, to nearest even
    return (2.0 * max_error(naive, ref64) + ulp(dtype, finite_max_abs(ref64)) +
            float32_tolerance(ref64, ref64, score_scale))


def case_seed(*parts):
    """A seed from a case's parameters (stable across runs and machines)."""
    return zlib.crc32(repr(parts).encode())


def case_shapes(rank, B, Hq, Hkv, Nq, Nk, Dk, Dv):
    """q, k, v and out shapes of a case in rank 2, 3 or 4."""
    lead_q = {2: (), 3: (Hq,), 4: (B, Hq)}[rank]
    lead_kv = {2: (), 3: (Hkv,), 4: (B, Hkv)}[rank]
    return lead_q + (Nq, Dk), lead_kv + (Nk, Dk), lead_kv + (Nk, Dv), lead_q + (Nq, Dv)
