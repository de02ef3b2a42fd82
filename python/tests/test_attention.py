"""Randomised comparison of sdpa.attention with the float64 NumPy reference (reference.py).

Tolerances
----------
float64 results: max |got - ref| <= 1e-12 * max(1, max |ref|)   (``float64_tolerance``).
float32 results: max |got - ref| <= 2 * max |naive32 - ref| + 4 * eps32 * max(1, max |ref|),
    where naive32 is ``naive_float32_attention`` (the same simple algorithm with every step
    in float32) run on the same inputs: the library may be at most twice as wrong as the
    simplest float32 implementation (``float32_tolerance``). The bound is derived per test
    case and separately for out, weights and lse.
Infinities (lse of rows without any allowed key) must match exactly; NaN never passes.
"""

import itertools
import zlib

import numpy as np
import pytest

import sdpa
from reference import (EPS32, assert_close, finite_max_abs, float32_tolerance, float64_tolerance, max_error,
                       naive_float32_attention, reference_attention)

# ---------------------------------------------------------------- helpers

BACKENDS = ("auto", "flash", "reference", "naive")


def _shapes(rank, B, Hq, Hkv, Nq, Nk, Dk, Dv):
    lead_q = {2: (), 3: (Hq,), 4: (B, Hq)}[rank]
    lead_kv = {2: (), 3: (Hkv,), 4: (B, Hkv)}[rank]
    return lead_q + (Nq, Dk), lead_kv + (Nk, Dk), lead_kv + (Nk, Dv)


def make_qkv(rng, rank, B=1, Hq=1, Hkv=1, Nq=4, Nk=4, Dk=8, Dv=8, dtype=np.float64, amp=1.0):
    sq, sk, sv = _shapes(rank, B, Hq, Hkv, Nq, Nk, Dk, Dv)
    q = (rng.standard_normal(sq) * amp).astype(dtype)
    k = (rng.standard_normal(sk) * amp).astype(dtype)
    v = rng.standard_normal(sv).astype(dtype)
    return q, k, v


def check_against_reference(q, k, v, mask=None, causal=False, scale=None, window=None, backend="auto"):
    """Runs sdpa.attention with weights and lse and compares all three with the oracle at the
    dtype's tolerance (see the module docstring). Returns the library's results."""
    out, weights, lse = sdpa.attention(q, k, v, mask, causal=causal, scale=scale, window=window,
                                       return_weights=True, return_lse=True, backend=backend)
    ref = reference_attention(q, k, v, mask, causal=causal, scale=scale, window=window)
    dtype = np.result_type(*(np.asarray(x).dtype for x in (q, k, v)))
    if dtype == np.float32:
        naive = naive_float32_attention(q, k, v, mask, causal=causal, scale=scale, window=window)
        tols = [float32_tolerance(n, r) for n, r in zip(naive, ref)]
        expect = np.float32
    else:
        tols = [float64_tolerance(r) for r in ref]
        expect = np.float64
    for name, got, want, tol in zip(("out", "weights", "lse"), (out, weights, lse), ref, tols):
        assert got.dtype == expect, f"{name} dtype {got.dtype}, want {expect}"
        assert_close(got, want, tol, name)
    return out, weights, lse


SHAPES = [
    # rank, B, Hq, Hkv, Nq, Nk, Dk, Dv
    pytest.param((2, 1, 1, 1, 5, 7, 8, 3), id="r2-Nq<Nk-Dv<Dk"),
    pytest.param((2, 1, 1, 1, 9, 4, 5, 11), id="r2-Nq>Nk-Dv>Dk"),
    pytest.param((2, 1, 1, 1, 1, 1, 1, 1), id="r2-all-ones"),
    pytest.param((2, 1, 1, 1, 1, 37, 16, 16), id="r2-decode-1-query"),
    pytest.param((3, 1, 4, 4, 6, 6, 8, 8), id="r3-MHA"),
    pytest.param((3, 1, 4, 2, 6, 9, 8, 5), id="r3-GQA"),
    pytest.param((3, 1, 5, 1, 3, 8, 7, 2), id="r3-MQA"),
    pytest.param((4, 2, 6, 3, 5, 10, 16, 12), id="r4-GQA"),
    pytest.param((4, 3, 2, 1, 7, 3, 4, 6), id="r4-MQA"),
    pytest.param((4, 2, 4, 4, 33, 130, 64, 64), id="r4-big-d64"),
    pytest.param((3, 1, 2, 2, 17, 67, 13, 9), id="r3-odd-dims"),
    pytest.param((2, 1, 1, 1, 64, 300, 128, 32), id="r2-long-d128"),
]


def _case(shape):
    rank, B, Hq, Hkv, Nq, Nk, Dk, Dv = shape
    return dict(rank=rank, B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, Dk=Dk, Dv=Dv)


def _seed(*parts):
    """A deterministic per-case seed (str hashes are randomised per process; crc32 is not)."""
    return zlib.crc32(repr(parts).encode())


# ---------------------------------------------------------------- plain comparisons


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype):
    rng = np.random.default_rng(_seed("plain", shape, dtype))
    q, k, v = make_qkv(rng, **_case(shape), dtype=dtype)
    check_against_reference(q, k, v)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("amp", [3.0, 30.0])
def test_large_scores(dtype, amp):
    # Scores of order amp^2 * sqrt(Dk): the max-shift must keep exp() from overflowing.
    rng = np.random.default_rng(int(amp))
    q, k, v = make_qkv(rng, 3, Hq=2, Hkv=2, Nq=8, Nk=19, Dk=16, Dv=4, dtype=dtype, amp=amp)
    out, weights, lse = sdpa.attention(q, k, v, return_weights=True, return_lse=True)
    assert np.isfinite(out).all() and np.isfinite(weights).all() and np.isfinite(lse).all()
    ref = reference_attention(q, k, v)
    if dtype == np.float32:
        # Huge scores: the floor scales with their size (see reference.py, float32 rule).
        big = finite_max_abs(ref[2])
        tols = [float32_tolerance(n, r, score_scale=big) for n, r in zip(naive_float32_attention(q, k, v), ref)]
    else:
        # Score rounding errors are relative to the score magnitude, which grows with amp^2.
        big = float(np.abs(ref[2]).max())
        tols = [1e-12 * max(1.0, big) * max(1.0, float(np.abs(v).max()))] * 3
    for name, got, want, tol in zip(("out", "weights", "lse"), (out, weights, lse), ref, tols):
        assert_close(got, want, tol, name)


@pytest.mark.parametrize("backend", ["auto", "flash", "naive"])
@pytest.mark.parametrize("amp", [1.0, 4.0, 10.0])
def test_float32_accuracy_is_not_systematically_worse(amp, backend):
    # One case can be unlucky (rounding is noise); over many cases the library's float32 error
    # must not typically exceed twice the naive float32 NumPy error: the median over 24 random
    # cases of err(library) / err(naive numpy) must stay <= 2 for out, weights and lse.
    # amp scales q and k, so scores grow like amp^2 (amp=10: |scores| ~ 100).
    # backend="naive" (the same algorithm as the NumPy yardstick) is the control.
    ratios = []
    for seed in range(24):
        rng = np.random.default_rng(seed)
        q, k, v = make_qkv(rng, 3, Hq=2, Hkv=2, Nq=8, Nk=19, Dk=16, Dv=4, dtype=np.float32, amp=amp)
        got = sdpa.attention(q, k, v, return_weights=True, return_lse=True, backend=backend)
        ref = reference_attention(q, k, v)
        naive = naive_float32_attention(q, k, v)
        floor = [4 * EPS32 * max(1.0, finite_max_abs(r)) for r in ref]  # a few ulps, as in the rule
        ratios.append([max_error(g, r) / (max_error(n, r) + f) for g, n, r, f in zip(got, naive, ref, floor)])
    median = np.median(np.array(ratios), axis=0)
    for name, m in zip(("out", "weights", "lse"), median):
        assert m <= 2.0, f"{name}: median error is {m:.1f} x the naive float32 error (+ floor)"


def test_gqa_head_mapping_is_h_div_group():
    # Query head h reads kv head h // (Hq // Hkv): equal to MHA with kv heads repeated,
    # and not to MHA with kv heads tiled (h % Hkv).
    rng = np.random.default_rng(7)
    q, k, v = make_qkv(rng, 4, B=2, Hq=6, Hkv=2, Nq=5, Nk=8, Dk=8, Dv=3)
    out = sdpa.attention(q, k, v)
    repeated = sdpa.attention(q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))
    tiled = sdpa.attention(q, np.tile(k, (1, 3, 1, 1)), np.tile(v, (1, 3, 1, 1)))
    assert_close(out, repeated, 1e-12)
    assert np.abs(out - tiled).max() > 1e-3
    # Each query head also matches a single-head rank-2 call on its own kv head.
    for b, h in itertools.product(range(2), range(6)):
        single = sdpa.attention(q[b, h], k[b, h // 3], v[b, h // 3])
        assert_close(out[b, h], single, 1e-12, f"head ({b}, {h})")


def test_batches_and_heads_are_independent():
    rng = np.random.default_rng(8)
    q, k, v = make_qkv(rng, 4, B=3, Hq=2, Hkv=2, Nq=4, Nk=6, Dk=5, Dv=5)
    out = sdpa.attention(q, k, v)
    for b, h in itertools.product(range(3), range(2)):
        assert_close(out[b, h], sdpa.attention(q[b, h], k[b, h], v[b, h]), 1e-12, f"({b}, {h})")


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("scale", [0.3, 1.0, 2.5, -0.7, 0.0, 1e-3])
def test_explicit_scale(scale, dtype):
    rng = np.random.default_rng(_seed("scale", scale, dtype))
    q, k, v = make_qkv(rng, 3, Hq=2, Hkv=1, Nq=6, Nk=9, Dk=16, Dv=4, dtype=dtype)
    out, weights, _ = check_against_reference(q, k, v, scale=scale)
    default = sdpa.attention(q, k, v)
    if scale != 1 / 4:
        assert np.abs(out - default).max() > 1e-4  # the scale is actually used
    if scale == 0.0:
        # Every score is 0: uniform weights, the mean of the value rows.
        assert_close(weights, np.full_like(weights, 1 / 9), 1e-6)


def test_default_scale_is_inverse_sqrt_dk():
    rng = np.random.default_rng(9)
    q, k, v = make_qkv(rng, 2, Nq=5, Nk=6, Dk=25, Dv=3)
    assert_close(sdpa.attention(q, k, v), sdpa.attention(q, k, v, scale=0.2), 1e-13)
    # Not 1/Dk, not 1/sqrt(Dv).
    assert np.abs(sdpa.attention(q, k, v) - sdpa.attention(q, k, v, scale=1 / 25)).max() > 1e-3
    assert np.abs(sdpa.attention(q, k, v) - sdpa.attention(q, k, v, scale=1 / np.sqrt(3))).max() > 1e-3


# ---------------------------------------------------------------- masks


def _random_mask(rng, shape, kind, dtype):
    if kind == "bool":
        m = rng.random(shape) < 0.7
        m.flat[0] = False  # at least one blocked entry, whatever the luck
        return m
    # float: an additive bias with some -inf entries
    m = rng.standard_normal(shape) * 2.0
    m[rng.random(shape) < 0.25] = -np.inf
    m.flat[0] = -np.inf
    return m.astype(dtype)


MASK_SHAPES = [
    # (rank, B, Hq, Hkv, Nq, Nk, mask shape as a function of the dims)
    pytest.param(2, lambda B, H, Nq, Nk: (Nq, Nk), id="r2-(Nq,Nk)"),
    pytest.param(2, lambda B, H, Nq, Nk: (Nk,), id="r2-(Nk,)"),
    pytest.param(2, lambda B, H, Nq, Nk: (Nq, 1), id="r2-(Nq,1)"),
    pytest.param(2, lambda B, H, Nq, Nk: (1, Nk), id="r2-(1,Nk)"),
    pytest.param(2, lambda B, H, Nq, Nk: (1, 1), id="r2-(1,1)"),
    pytest.param(3, lambda B, H, Nq, Nk: (H, Nq, Nk), id="r3-(Hq,Nq,Nk)"),
    pytest.param(3, lambda B, H, Nq, Nk: (Nq, Nk), id="r3-(Nq,Nk)"),
    pytest.param(3, lambda B, H, Nq, Nk: (H, 1, Nk), id="r3-(Hq,1,Nk)"),
    pytest.param(3, lambda B, H, Nq, Nk: (Nk,), id="r3-(Nk,)"),
    pytest.param(4, lambda B, H, Nq, Nk: (B, H, Nq, Nk), id="r4-full"),
    pytest.param(4, lambda B, H, Nq, Nk: (1, H, 1, Nk), id="r4-(1,Hq,1,Nk)"),
    pytest.param(4, lambda B, H, Nq, Nk: (B, 1, 1, Nk), id="r4-(B,1,1,Nk)-padding"),
    pytest.param(4, lambda B, H, Nq, Nk: (B, 1, Nq, Nk), id="r4-(B,1,Nq,Nk)"),
    pytest.param(4, lambda B, H, Nq, Nk: (H, Nq, Nk), id="r4-(Hq,Nq,Nk)"),
    pytest.param(4, lambda B, H, Nq, Nk: (Nq, 1), id="r4-(Nq,1)"),
    pytest.param(4, lambda B, H, Nq, Nk: (Nk,), id="r4-(Nk,)"),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("rank,mask_shape", MASK_SHAPES)
def test_masks_broadcast(rank, mask_shape, kind, dtype):
    B, Hq, Hkv, Nq, Nk = 2, 4, 2, 5, 7
    rng = np.random.default_rng(_seed("mask", rank, mask_shape(B, Hq, Nq, Nk), kind, dtype))
    q, k, v = make_qkv(rng, rank, B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, Dk=8, Dv=6, dtype=dtype)
    mask = _random_mask(rng, mask_shape(B, Hq, Nq, Nk), kind, dtype)
    out, weights, _ = check_against_reference(q, k, v, mask)
    # Blocked entries have weight exactly zero; the mask must matter.
    full = np.broadcast_to(mask, weights.shape)
    blocked = ~full if kind == "bool" else np.isneginf(full)
    assert (weights[blocked] == 0).all()
    if mask.shape[-1] == Nk:  # the mask varies over the keys, so it must change the result
        assert np.abs(out - sdpa.attention(q, k, v)).max() > 1e-4


def test_mask_equals_explicit_broadcast():
    # A broadcast mask gives the same result as the same mask materialised to full shape.
    rng = np.random.default_rng(10)
    q, k, v = make_qkv(rng, 4, B=2, Hq=4, Hkv=2, Nq=5, Nk=7)
    for shape in [(7,), (5, 1), (1, 4, 1, 7), (2, 1, 1, 7)]:
        for kind in ("bool", "float"):
            m = _random_mask(rng, shape, kind, np.float64)
            full = np.ascontiguousarray(np.broadcast_to(m, (2, 4, 5, 7)))
            assert_close(sdpa.attention(q, k, v, m), sdpa.attention(q, k, v, full), 1e-12, str(shape))


def test_scalar_mask_broadcasts():
    # A 0-d mask broadcasts to every score by NumPy rules (the docstring's rule).
    rng = np.random.default_rng(11)
    q, k, v = make_qkv(rng, 2, Nq=3, Nk=4)
    np.testing.assert_array_equal(sdpa.attention(q, k, v, np.array(True)), sdpa.attention(q, k, v))
    out, lse = sdpa.attention(q, k, v, np.array(False), return_lse=True)
    np.testing.assert_array_equal(out, np.zeros_like(out))
    assert np.isneginf(lse).all()
    check_against_reference(q, k, v, np.float64(0.5))


def test_float_mask_is_added_to_scaled_scores():
    # A constant bias cancels in the softmax; a per-key bias b shifts scores by exactly b
    # (not b * scale), and lse by the constant.
    rng = np.random.default_rng(12)
    q, k, v = make_qkv(rng, 2, Nq=4, Nk=6, Dk=16)
    out, lse = sdpa.attention(q, k, v, return_lse=True)
    out_c, lse_c = sdpa.attention(q, k, v, np.full((4, 6), 3.0), return_lse=True)
    assert_close(out_c, out, 1e-12)
    assert_close(lse_c, lse + 3.0, 1e-12)
    bias = rng.standard_normal(6)
    _, w = sdpa.attention(q, k, v, bias, return_weights=True)
    scores = q @ k.T / 4.0 + bias
    expect = np.exp(scores - scores.max(axis=1, keepdims=True))
    expect /= expect.sum(axis=1, keepdims=True)
    assert_close(w, expect, 1e-12)


def test_mask_dtype_follows_inputs():
    rng = np.random.default_rng(13)
    q, k, v = make_qkv(rng, 2, Nq=4, Nk=5)
    m = rng.standard_normal((4, 5))
    m[0, 1] = -np.inf
    # float32 mask with float64 inputs, float64 mask with float32 inputs.
    check_against_reference(q, k, v, m.astype(np.float32))
    q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
    out = check_against_reference(q32, k32, v32, m)[0]
    assert out.dtype == np.float32


def test_mask_as_nested_list():
    rng = np.random.default_rng(14)
    q, k, v = make_qkv(rng, 2, Nq=3, Nk=3)
    m = [[True, False, True], [False, True, True], [True, True, False]]
    assert_close(sdpa.attention(q, k, v, m), sdpa.attention(q, k, v, np.array(m)), 0.0)
    check_against_reference(q, k, v, m)
    fm = [[0.0, -np.inf, 1.0], [0.5, 0.0, 0.0], [0.0, 0.0, -np.inf]]
    check_against_reference(q, k, v, fm)


# ---------------------------------------------------------------- causal and windows


def test_causal_modes_match_docstring_diagram():
    # Nq=2, Nk=4:   bottom_right           top_left
    #               x x x .                x . . .
    #               x x x x                x x . .
    q = np.zeros((2, 3))
    k = np.zeros((4, 3))
    v = np.arange(8.0).reshape(4, 2)
    br = np.array([[1, 1, 1, 0], [1, 1, 1, 1]], dtype=bool)
    tl = np.array([[1, 0, 0, 0], [1, 1, 0, 0]], dtype=bool)
    for causal, pattern in [(True, br), ("bottom_right", br), ("top_left", tl)]:
        out, w = sdpa.attention(q, k, v, causal=causal, return_weights=True)
        expect = pattern / pattern.sum(axis=1, keepdims=True)
        np.testing.assert_allclose(w, expect, rtol=0, atol=1e-15, err_msg=str(causal))
        np.testing.assert_allclose(out, expect @ v, rtol=0, atol=1e-14, err_msg=str(causal))
    for causal in [False, None, "none"]:
        _, w = sdpa.attention(q, k, v, causal=causal, return_weights=True)
        np.testing.assert_allclose(w, 0.25, rtol=0, atol=1e-15)


CAUSAL_DIMS = [(6, 6), (3, 8), (8, 3), (1, 5), (5, 1)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [True, "bottom_right", "top_left"])
@pytest.mark.parametrize("nq,nk", CAUSAL_DIMS)
def test_causal(nq, nk, causal, dtype):
    rng = np.random.default_rng(_seed("causal", nq, nk, causal, dtype))
    q, k, v = make_qkv(rng, 4, B=2, Hq=2, Hkv=1, Nq=nq, Nk=nk, Dk=8, Dv=5, dtype=dtype)
    out, weights, lse = check_against_reference(q, k, v, causal=causal)
    i = np.arange(nq)[:, None]
    j = np.arange(nk)[None, :]
    allowed = j <= (i + nk - nq if causal != "top_left" else i)
    assert (weights[..., ~allowed] == 0).all()


@pytest.mark.parametrize("causal", [True, "top_left"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_causal_combined_with_mask(causal, kind):
    rng = np.random.default_rng(_seed("causal+mask", causal, kind))
    q, k, v = make_qkv(rng, 4, B=2, Hq=4, Hkv=2, Nq=6, Nk=9, Dk=8, Dv=4)
    mask = _random_mask(rng, (2, 1, 6, 9), kind, np.float64)
    out = check_against_reference(q, k, v, mask, causal=causal)[0]
    assert np.abs(out - sdpa.attention(q, k, v, mask)).max() > 1e-4
    assert np.abs(out - sdpa.attention(q, k, v, causal=causal)).max() > 1e-4


def test_causal_equals_explicit_mask():
    rng = np.random.default_rng(15)
    q, k, v = make_qkv(rng, 3, Hq=2, Hkv=2, Nq=4, Nk=7)
    br = np.arange(7)[None, :] <= np.arange(4)[:, None] + 3
    tl = np.arange(7)[None, :] <= np.arange(4)[:, None]
    assert_close(sdpa.attention(q, k, v, causal=True), sdpa.attention(q, k, v, br), 1e-12)
    assert_close(sdpa.attention(q, k, v, causal="top_left"), sdpa.attention(q, k, v, tl), 1e-12)


WINDOWS = [(0, 0), (2, 0), (1, 1), (3, 2), (-1, 1), (None, 2), (1, None), (2, -1), (-1, -1),
           (None, None), (0, 100), (100, 0), (-5, 0)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("nq,nk", [(7, 7), (3, 9), (9, 3)])
def test_window(nq, nk, window, dtype):
    rng = np.random.default_rng(_seed("window", nq, nk, window, dtype))
    q, k, v = make_qkv(rng, 3, Hq=2, Hkv=2, Nq=nq, Nk=nk, Dk=8, Dv=4, dtype=dtype)
    _, weights, _ = check_against_reference(q, k, v, window=window)
    # The pattern, written out from the docstring: i' - left <= j <= i' + right, i' = i + Nk - Nq.
    left, right = window
    left = -1 if left is None else left
    right = -1 if right is None else right
    for i in range(nq):
        ip = i + nk - nq
        for j in range(nk):
            inside = (left < 0 or j >= ip - left) and (right < 0 or j <= ip + right)
            assert ((weights[:, i, j] > 0) == inside).all(), (i, j)


def test_window_pattern_example():
    # Nq = Nk = 5, window (1, 0): each query sees itself and its predecessor.
    q = np.zeros((5, 2))
    k = np.zeros((5, 2))
    v = np.arange(5.0)[:, None]
    out, w = sdpa.attention(q, k, v, window=(1, 0), return_weights=True)
    expect = np.array([[1, 0, 0, 0, 0],
                       [.5, .5, 0, 0, 0],
                       [0, .5, .5, 0, 0],
                       [0, 0, .5, .5, 0],
                       [0, 0, 0, .5, .5]])
    np.testing.assert_array_equal(w, expect)
    np.testing.assert_array_equal(out[:, 0], [0, 0.5, 1.5, 2.5, 3.5])


@pytest.mark.parametrize("causal", [True, "top_left"])
@pytest.mark.parametrize("window", [(2, 0), (1, 3), (-1, 2)], ids=str)
def test_window_with_causal_and_mask(causal, window):
    rng = np.random.default_rng(_seed("window+causal", causal, window))
    q, k, v = make_qkv(rng, 4, B=2, Hq=2, Hkv=1, Nq=6, Nk=8, Dk=8, Dv=3)
    mask = _random_mask(rng, (6, 8), "bool", np.float64)
    check_against_reference(q, k, v, mask, causal=causal, window=window)
    check_against_reference(q, k, v, causal=causal, window=window)


# ---------------------------------------------------------------- fully masked rows, empty dims


def _assert_empty_rows(out, weights, lse, rows):
    assert not np.isnan(out).any() and not np.isnan(weights).any() and not np.isnan(lse).any()
    assert (out[..., rows, :] == 0).all()
    assert (weights[..., rows, :] == 0).all()
    assert np.isneginf(lse[..., rows]).all()


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("how", ["bool", "float-inf", "causal-Nq>Nk", "window", "scalar-False-row"])
def test_fully_masked_rows(how, dtype):
    rng = np.random.default_rng(_seed("empty rows", how, dtype))
    Nq, Nk = 6, 4
    q, k, v = make_qkv(rng, 3, Hq=2, Hkv=2, Nq=Nq, Nk=Nk, Dk=8, Dv=3, dtype=dtype)
    mask, causal, window = None, False, None
    if how == "bool":
        mask = rng.random((Nq, Nk)) < 0.8
        mask[[1, 4]] = False
        rows = [1, 4]
    elif how == "float-inf":
        mask = rng.standard_normal((2, Nq, Nk)).astype(dtype)
        mask[:, [0, 5]] = -np.inf
        rows = [0, 5]
    elif how == "causal-Nq>Nk":
        causal = True  # query i sees j <= i - 2: queries 0 and 1 see nothing
        rows = [0, 1]
    elif how == "window":
        window = (0, 0)  # query i sees only key i - 2
        rows = [0, 1]
    else:
        mask = np.ones((Nq, 1), dtype=bool)
        mask[3] = False
        rows = [3]
    out, weights, lse = check_against_reference(q, k, v, mask, causal=causal, window=window)
    _assert_empty_rows(out, weights, lse, rows)
    others = [i for i in range(Nq) if i not in rows]
    np.testing.assert_allclose(weights[:, others].sum(axis=-1), 1.0, rtol=0,
                               atol=1e-12 if dtype == np.float64 else 1e-5)


def test_fully_masked_everything_all_backends():
    rng = np.random.default_rng(16)
    q, k, v = make_qkv(rng, 4, B=2, Hq=2, Hkv=2, Nq=3, Nk=5)
    for backend in BACKENDS:
        for mask in (np.zeros((3, 5), bool), np.full((3, 5), -np.inf)):
            out, w, lse = sdpa.attention(q, k, v, mask, return_weights=True, return_lse=True, backend=backend)
            _assert_empty_rows(out, w, lse, slice(None))


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rank", [2, 3, 4])
def test_nk_zero(rank, dtype):
    # No keys at all: every row is empty -> zeros and lse = -inf (documented).
    q, k, v = make_qkv(np.random.default_rng(17), rank, B=2, Hq=2, Hkv=1, Nq=3, Nk=0, Dk=4, Dv=5, dtype=dtype)
    out, weights, lse = sdpa.attention(q, k, v, return_weights=True, return_lse=True)
    assert out.shape == q.shape[:-1] + (5,) and out.dtype == dtype
    assert weights.shape == q.shape[:-1] + (0,)
    assert lse.shape == q.shape[:-1]
    _assert_empty_rows(out, weights, lse, slice(None))


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_nq_zero(rank):
    q, k, v = make_qkv(np.random.default_rng(18), rank, B=2, Hq=2, Hkv=1, Nq=0, Nk=3, Dk=4, Dv=5)
    out, weights, lse = sdpa.attention(q, k, v, return_weights=True, return_lse=True)
    assert out.shape == q.shape[:-1] + (5,)
    assert weights.shape == q.shape[:-1] + (3,)
    assert lse.shape == q.shape[:-1]
    assert out.size == 0 and weights.size == 0 and lse.size == 0


def test_batch_zero():
    q, k, v = make_qkv(np.random.default_rng(19), 4, B=0, Hq=2, Hkv=1, Nq=3, Nk=3, Dk=4, Dv=5)
    out = sdpa.attention(q, k, v)
    assert out.shape == (0, 2, 3, 5)


def test_dv_zero():
    q, k, v = make_qkv(np.random.default_rng(20), 2, Nq=3, Nk=4, Dk=4, Dv=0)
    out, lse = sdpa.attention(q, k, v, return_lse=True)
    assert out.shape == (3, 0)
    assert_close(lse, reference_attention(q, k, v)[2], 1e-12)


# ---------------------------------------------------------------- returns


@pytest.mark.parametrize("rank", [2, 3, 4])
@pytest.mark.parametrize("return_weights,return_lse", [(False, False), (True, False), (False, True), (True, True)])
def test_return_combinations_and_order(return_weights, return_lse, rank):
    rng = np.random.default_rng(21)
    # Nq=3, Nk=5, Dv=2: out (..., 3, 2), weights (..., 3, 5), lse (..., 3) are all distinguishable.
    q, k, v = make_qkv(rng, rank, B=2, Hq=2, Hkv=1, Nq=3, Nk=5, Dk=4, Dv=2)
    lead = q.shape[:-1]
    res = sdpa.attention(q, k, v, return_weights=return_weights, return_lse=return_lse)
    ref_out, ref_w, ref_lse = reference_attention(q, k, v)
    expected = [("out", ref_out)]
    if return_weights:
        expected.append(("weights", ref_w))
    if return_lse:
        expected.append(("lse", ref_lse))
    if len(expected) == 1:
        assert isinstance(res, np.ndarray)
        res = (res,)
    else:
        assert isinstance(res, tuple) and len(res) == len(expected)
    shapes = {"out": lead + (2,), "weights": lead + (5,), "lse": lead}
    for got, (name, want) in zip(res, expected):
        assert isinstance(got, np.ndarray)
        assert got.shape == shapes[name], name
        assert_close(got, want, 1e-12, name)


def test_out_does_not_depend_on_requested_extras():
    rng = np.random.default_rng(22)
    q, k, v = make_qkv(rng, 4, B=2, Hq=4, Hkv=2, Nq=9, Nk=40, Dk=32, Dv=16)
    base = sdpa.attention(q, k, v)
    for rw, rl in [(True, False), (False, True), (True, True)]:
        res = sdpa.attention(q, k, v, return_weights=rw, return_lse=rl)
        assert_close(res[0], base, float64_tolerance(base))


def test_weights_reproduce_out_and_lse():
    # Internal consistency: out = weights @ v and weights = exp(score - lse).
    rng = np.random.default_rng(23)
    q, k, v = make_qkv(rng, 2, Nq=6, Nk=11, Dk=8, Dv=4)
    out, w, lse = sdpa.attention(q, k, v, return_weights=True, return_lse=True)
    assert_close(out, w @ v, 1e-12)
    scores = q @ k.T / np.sqrt(8)
    assert_close(w, np.exp(scores - lse[:, None]), 1e-12)


# ---------------------------------------------------------------- layouts


def _layout_variants(rng, dims, dtype):
    """(name, non-contiguous view) pairs, each view a (B, H, N, D) array of `dtype` with an
    unusual layout; every one is compared with its own contiguous copy."""
    B, H, N, D = dims

    def randn(*shape):
        return rng.standard_normal(shape).astype(dtype)

    return [
        ("rows-step-2", randn(B, H, 2 * N, D)[:, :, ::2]),
        ("cols-step-2", randn(B, H, N, 2 * D)[..., ::2]),
        ("cols-slice", randn(B, H, N, 2 * D)[..., 3:3 + D]),
        ("BNHD-transposed", randn(B, N, H, D).transpose(0, 2, 1, 3)),
        ("from-transposed-DN", randn(B, H, D, N).transpose(0, 1, 3, 2)),
        ("reversed-rows", randn(B, H, N, D)[:, :, ::-1]),
        ("reversed-cols", randn(B, H, N, D)[..., ::-1]),
        ("fortran", np.asfortranarray(randn(B, H, N, D))),
        ("heads-reversed", randn(B, H, N, D)[:, ::-1]),
        ("batch-step-2", randn(2 * B, H, N, D)[::2]),
    ]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("which", ["q", "k", "v"])
def test_noncontiguous_inputs_match_contiguous_copies(which, dtype):
    rng = np.random.default_rng(_seed("layout", which, dtype))
    B, Hq, Hkv, Nq, Nk, Dk, Dv = 2, 4, 2, 5, 7, 6, 6
    q, k, v = make_qkv(rng, 4, B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, Dk=Dk, Dv=Dv, dtype=dtype)
    dims = {"q": (B, Hq, Nq, Dk), "k": (B, Hkv, Nk, Dk), "v": (B, Hkv, Nk, Dv)}[which]
    for name, view in _layout_variants(rng, dims, dtype):
        assert view.dtype == dtype and not view.flags.c_contiguous, name
        args = dict(q=q, k=k, v=v)
        args[which] = view
        contiguous = dict(args)
        contiguous[which] = np.ascontiguousarray(view)
        got = sdpa.attention(**args, causal=True, return_weights=True, return_lse=True)
        want = sdpa.attention(**contiguous, causal=True, return_weights=True, return_lse=True)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w, err_msg=name)
        check_against_reference(args["q"], args["k"], args["v"], causal=True)


@pytest.mark.parametrize("rank", [2, 3, 4])
def test_noncontiguous_views_of_each_rank(rank):
    rng = np.random.default_rng(_seed("views", rank))
    q, k, v = make_qkv(rng, rank, B=2, Hq=2, Hkv=2, Nq=8, Nk=10, Dk=6, Dv=4)
    qv = np.repeat(q, 2, axis=-2)[..., ::2, :]  # every other row of a bigger array
    kv = np.ascontiguousarray(np.swapaxes(k, -1, -2))
    kv = np.swapaxes(kv, -1, -2)  # k taken from a transposed array
    vv = np.concatenate([v, v], axis=-1)[..., 1:5]  # a column slice
    assert not qv.flags.c_contiguous and not kv.flags.c_contiguous and not vv.flags.c_contiguous
    got = sdpa.attention(qv, kv, vv, causal=True, return_weights=True, return_lse=True)
    want = sdpa.attention(*(np.ascontiguousarray(x) for x in (qv, kv, vv)), causal=True,
                          return_weights=True, return_lse=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    check_against_reference(qv, kv, vv, causal=True)


def test_noncontiguous_masks():
    rng = np.random.default_rng(24)
    q, k, v = make_qkv(rng, 4, B=2, Hq=2, Hkv=2, Nq=5, Nk=6)
    bool_t = rng.random((2, 2, 6, 5)) < 0.6
    float_t = rng.standard_normal((2, 2, 6, 5))
    float_t[float_t < -1] = -np.inf
    for m in (bool_t.transpose(0, 1, 3, 2), float_t.transpose(0, 1, 3, 2),
              (rng.random((2, 2, 10, 6)) < 0.5)[:, :, ::2], (rng.random((5, 12)) < 0.5)[:, ::-2]):
        got = sdpa.attention(q, k, v, m, return_weights=True)
        want = sdpa.attention(q, k, v, np.ascontiguousarray(m), return_weights=True)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
        check_against_reference(q, k, v, m)


def test_broadcast_and_readonly_inputs():
    # np.broadcast_to views (zero strides, read-only) are ordinary NumPy inputs; the package
    # says broadcast strides are passed through without a copy.
    rng = np.random.default_rng(25)
    q, k, v = make_qkv(rng, 4, B=3, Hq=2, Hkv=2, Nq=4, Nk=5)
    kb = np.broadcast_to(k[:1], k.shape)
    vb = np.broadcast_to(v[:, :1], v.shape)
    mb = np.broadcast_to(rng.random((5,)) < 0.7, (3, 2, 4, 5))
    got = sdpa.attention(q, kb, vb, mb)
    want = sdpa.attention(q, kb.copy(), vb.copy(), mb.copy())
    np.testing.assert_array_equal(got, want)
    ro = [x.copy() for x in (q, k, v)]
    for x in ro:
        x.flags.writeable = False
    np.testing.assert_array_equal(sdpa.attention(*ro), sdpa.attention(q, k, v))


def test_inputs_are_not_modified():
    rng = np.random.default_rng(26)
    q, k, v = make_qkv(rng, 3, Hq=2, Hkv=1, Nq=4, Nk=6)
    mask = rng.standard_normal((4, 6))
    copies = [x.copy() for x in (q, k, v, mask)]
    sdpa.attention(q, k, v, mask, causal=True, return_weights=True, return_lse=True)
    for x, c in zip((q, k, v, mask), copies):
        np.testing.assert_array_equal(x, c)


def test_bitwise_reproducible():
    rng = np.random.default_rng(27)
    q, k, v = make_qkv(rng, 4, B=2, Hq=4, Hkv=2, Nq=31, Nk=77, Dk=64, Dv=64, dtype=np.float32)
    first = sdpa.attention(q, k, v, causal=True, return_weights=True, return_lse=True)
    for _ in range(3):
        again = sdpa.attention(q, k, v, causal=True, return_weights=True, return_lse=True)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


@pytest.fixture
def restore_threads():
    before = sdpa.num_threads()
    yield
    sdpa.set_num_threads(0)
    assert sdpa.num_threads() == before


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_thread_count_does_not_change_results(dtype, restore_threads):
    # "Outputs are bitwise identical whatever the count" (sdpa.set_num_threads).
    rng = np.random.default_rng(30)
    q, k, v = make_qkv(rng, 4, B=2, Hq=8, Hkv=2, Nq=70, Nk=1500, Dk=64, Dv=32, dtype=dtype)
    results = []
    for n in (1, 2, 3, 8):
        sdpa.set_num_threads(n)
        assert sdpa.num_threads() == n
        results.append(sdpa.attention(q, k, v, causal=True, return_weights=True, return_lse=True))
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)
    check_against_reference(q, k, v, causal=True)


# ---------------------------------------------------------------- dtypes


@pytest.mark.parametrize("dtypes,expect", [
    ((np.float32,) * 3, np.float32),
    ((np.float64,) * 3, np.float64),
    ((np.float16, np.float16, np.float32), np.float32),  # float16 q, k, v stay float16: test_lowp.py
    ((np.float32, np.float64, np.float32), np.float64),
    ((np.float32, np.float32, np.int64), np.float64),
    ((np.int64,) * 3, np.float64),
    ((np.int32,) * 3, np.float64),
    ((np.uint8,) * 3, np.float64),
    ((np.bool_,) * 3, np.float64),
])
def test_result_dtype(dtypes, expect):
    rng = np.random.default_rng(28)
    raw = [rng.integers(-3, 4, size=s) if d not in (np.uint8, np.bool_) else rng.integers(0, 2, size=s)
           for d, s in zip(dtypes, [(4, 3), (5, 3), (5, 2)])]
    q, k, v = (r.astype(d) for r, d in zip(raw, dtypes))
    out, w, lse = sdpa.attention(q, k, v, return_weights=True, return_lse=True)
    assert out.dtype == expect and w.dtype == expect and lse.dtype == expect
    ref = reference_attention(q, k, v)
    if expect == np.float64:
        tols = [float64_tolerance(r) for r in ref]
    else:
        tols = [float32_tolerance(n, r) for n, r in zip(naive_float32_attention(q, k, v), ref)]
    for name, g, r, t in zip(("out", "weights", "lse"), (out, w, lse), ref, tols):
        assert_close(g, r, t, name)


def test_integer_inputs_compute_in_float64():
    # Integer inputs are promoted to float64 (not float32): the float64 tolerance holds.
    rng = np.random.default_rng(29)
    q = rng.integers(-5, 6, size=(6, 9))
    k = rng.integers(-5, 6, size=(8, 9))
    v = rng.integers(-100, 100, size=(8, 3))
    out, w, lse = check_against_reference(q, k, v)
    assert_close(out, sdpa.attention(q.astype(float), k.astype(float), v.astype(float)), 0.0)


def test_nested_lists():
    q = [[1, 0, 2], [0.5, -1, 0]]
    k = [[1, 1, 0], [0, 2, 1], [-1, 0, 1]]
    v = [[1, 2], [3, 4], [5, 6]]
    out = sdpa.attention(q, k, v)
    assert isinstance(out, np.ndarray) and out.dtype == np.float64 and out.shape == (2, 2)
    check_against_reference(q, k, v)
    np.testing.assert_array_equal(out, sdpa.attention(np.array(q), np.array(k, float), np.array(v, float)))
    # Nested lists of heads (rank 3) too.
    out3 = sdpa.attention([q, q], [k], [v])
    np.testing.assert_array_equal(out3[0], out)
    np.testing.assert_array_equal(out3[1], out)


# ---------------------------------------------------------------- backends


BACKEND_CASES = [
    dict(),
    dict(causal=True),
    dict(causal="top_left", window=(20, 1)),  # i' = i + 16: keys i-4 .. i
    dict(mask="bool"),
    dict(mask="float"),
    dict(mask="float", causal=True, scale=0.4),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("opts", BACKEND_CASES, ids=lambda o: "-".join(f"{a}={b}" for a, b in o.items()) or "plain")
def test_backends_agree(opts, dtype):
    rng = np.random.default_rng(_seed("backends", opts, dtype))
    q, k, v = make_qkv(rng, 4, B=2, Hq=4, Hkv=2, Nq=13, Nk=29, Dk=32, Dv=16, dtype=dtype)
    opts = dict(opts)
    if "mask" in opts:
        opts["mask"] = _random_mask(rng, (2, 1, 13, 29), opts["mask"], dtype)
    results = {}
    for backend in BACKENDS:
        results[backend] = check_against_reference(q, k, v, backend=backend, **opts)
        for r in results[backend]:
            assert r.dtype == dtype
    ref = reference_attention(q, k, v, **opts)
    if dtype == np.float32:
        tols = [float32_tolerance(n, r) for n, r in zip(naive_float32_attention(q, k, v, **opts), ref)]
        # The reference backend computes in float64, so it is float32-rounded oracle output.
        # (up to one float32 ulp: the two float64 computations may round differently).
        for got, want in zip(results["reference"], ref):
            assert_close(got, want.astype(np.float32), EPS32 * max(1.0, finite_max_abs(want)))
    else:
        tols = [float64_tolerance(r) for r in ref]
    for fast in ("auto", "flash"):
        for name, a, b, tol in zip(("out", "weights", "lse"), results[fast], results["reference"], tols):
            assert_close(a, b, 2 * tol, f"{fast} vs reference {name}")
    # "auto" is documented to pick the fastest exact kernel, today "flash": the same numbers.
    for a, b in zip(results["auto"], results["flash"]):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("backend", ["auto", "reference", "naive"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("nq,nk", [(5, 5), (40, 40), (1, 4096)])
def test_nan_inputs_propagate_to_the_rows_they_reach(nq, nk, dtype, backend):
    # NaN is not a blocked key: rows whose scores or values it reaches are NaN, others as before.
    rng = np.random.default_rng(7)
    q = rng.standard_normal((2, nq, 8)).astype(dtype)
    k = rng.standard_normal((1, nk, 8)).astype(dtype)
    v = rng.standard_normal((1, nk, 4)).astype(dtype)
    clean, clean_lse = sdpa.attention(q, k, v, causal=True, backend=backend, return_lse=True)
    bad_key = nk - 3  # bottom-right causal: only the last three query rows see it
    reached = np.arange(nq) + (nk - nq) >= bad_key
    for which in "qkv":
        qq, kk, vv = q.copy(), k.copy(), v.copy()
        if which == "q":
            qq[1, -1, 5] = np.nan
            rows = np.zeros((2, nq), bool)
            rows[1, -1] = True
        else:
            (kk if which == "k" else vv)[0, bad_key, 2] = np.nan
            rows = np.broadcast_to(reached, (2, nq))
        out, w, lse = sdpa.attention(qq, kk, vv, causal=True, backend=backend, return_weights=True, return_lse=True)
        if which == "v":
            # Only that value feature; weights and lse do not involve v. A row that blocks the
            # key may get NaN too (the fused kernel multiplies whole tiles, 0 · NaN = NaN).
            assert np.isnan(out[..., 2][rows]).all()
            np.testing.assert_array_equal(lse, clean_lse)
            continue
        assert np.isnan(out[rows]).all() and np.isnan(lse[rows]).all() and np.isnan(w[rows][:, 0]).all()
        np.testing.assert_array_equal(out[~rows], clean[~rows])
        np.testing.assert_array_equal(lse[~rows], clean_lse[~rows])
