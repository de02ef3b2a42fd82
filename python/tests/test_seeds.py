"""The worked examples and test properties of the seed problems.

seed 000: a toy attention head (Q 2x2, K 3x2, V 3x2); weights are row-stochastic.
seed 001: single-head attention(Q, K, V, mask=None) with two examples and six properties:
    output shape (T, D); matches a NumPy reference (no mask) at atol 1e-6; includes the
    sqrt(d_k) scaling (diagnostic at d = 64); honours a causal mask; output rows are convex
    combinations of V rows; an all-True mask equals no mask.
"""

import math

import numpy as np
import pytest

import sdpa
from reference import reference_attention


def seed_attention(Q, K, V, mask=None):
    """The seed's own recipe, verbatim: scores / sqrt(d_k), blocked entries -> -1e9,
    max-subtracted row softmax, then @ V (float64)."""
    Q, K, V = (np.asarray(x, dtype=np.float64) for x in (Q, K, V))
    S = Q @ K.T / np.sqrt(Q.shape[-1])
    if mask is not None:
        S = np.where(mask, S, -1e9)
    S = S - S.max(axis=-1, keepdims=True)
    A = np.exp(S)
    A = A / A.sum(axis=-1, keepdims=True)
    return A @ V


# ---------------------------------------------------------------- seed 001: the two examples


def test_seed001_example1_uniform_attention_averages_values():
    out = sdpa.attention([[0, 0], [0, 0]], [[0, 0], [0, 0]], [[1, 0], [0, 1]], mask=None)
    assert out.dtype == np.float64  # integer inputs compute in float64
    np.testing.assert_array_equal(out, [[0.5, 0.5], [0.5, 0.5]])


def test_seed001_example2_causal_mask_blocks_the_future():
    mask = [[True, False],
            [True, True]]
    out = sdpa.attention([[0], [0]], [[0], [0]], [[10], [20]], mask=mask)
    np.testing.assert_array_equal(out, [[10.0], [15.0]])


@pytest.mark.parametrize("blocked", [-1e9, -np.inf])
def test_seed001_example2_with_additive_mask(blocked):
    # The seed allows "a large negative number (-1e9 or -inf)" for blocked scores.
    mask = np.array([[0.0, blocked], [0.0, 0.0]])
    out = sdpa.attention([[0], [0]], [[0], [0]], [[10], [20]], mask=mask)
    np.testing.assert_array_equal(out, [[10.0], [15.0]])


@pytest.mark.parametrize("causal", [True, "bottom_right", "top_left"])
def test_seed001_example2_with_causal_flag(causal):
    # Nq == Nk, so both causal conventions are the seed's lower-triangular mask.
    out = sdpa.attention([[0], [0]], [[0], [0]], [[10], [20]], causal=causal)
    np.testing.assert_array_equal(out, [[10.0], [15.0]])


# ---------------------------------------------------------------- seed 000: the toy head

Q0 = np.array([[1., 0.], [0., 1.]])
K0 = np.array([[1., 0.], [1., 1.], [0., 1.]])
V0 = np.array([[1., 0.], [0., 2.], [1., 1.]])


def _toy_expected():
    # Written out by hand: scores = Q K^T / sqrt(2) = [[a, a, 0], [0, a, a]], a = 1/sqrt(2).
    a = 1.0 / math.sqrt(2.0)
    ea = math.exp(a)
    z = 2 * ea + 1
    A = np.array([[ea / z, ea / z, 1 / z],
                  [1 / z, ea / z, ea / z]])
    O = np.array([[A[0, 0] + A[0, 2], 2 * A[0, 1] + A[0, 2]],
                  [A[1, 0] + A[1, 2], 2 * A[1, 1] + A[1, 2]]])
    lse = np.array([math.log(z) + 0.0, math.log(z)])  # log(e^a + e^a + e^0)
    return A, O, lse


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_seed000_toy_head_weights_are_row_stochastic(dtype):
    out, weights = sdpa.attention(Q0.astype(dtype), K0.astype(dtype), V0.astype(dtype), return_weights=True)
    assert weights.shape == (2, 3)
    assert out.shape == (2, 2)
    assert (weights >= 0).all()
    tol = 1e-12 if dtype == np.float64 else 1e-6
    np.testing.assert_allclose(weights.sum(axis=1), [1.0, 1.0], rtol=0, atol=tol)


def test_seed000_toy_head_values():
    A, O, lse = _toy_expected()
    out, weights, got_lse = sdpa.attention(Q0, K0, V0, return_weights=True, return_lse=True)
    np.testing.assert_allclose(weights, A, rtol=0, atol=1e-14)
    np.testing.assert_allclose(out, O, rtol=0, atol=1e-14)
    np.testing.assert_allclose(got_lse, lse, rtol=0, atol=1e-14)
    # The float64 reference of the test suite agrees with the hand computation too.
    ref_out, ref_w, ref_lse = reference_attention(Q0, K0, V0)
    np.testing.assert_allclose(ref_out, O, rtol=0, atol=1e-14)
    np.testing.assert_allclose(ref_w, A, rtol=0, atol=1e-14)
    np.testing.assert_allclose(ref_lse, lse, rtol=0, atol=1e-14)


def test_seed000_toy_head_float32():
    A, O, _ = _toy_expected()
    out, weights = sdpa.attention(Q0.astype(np.float32), K0.astype(np.float32), V0.astype(np.float32),
                                  return_weights=True)
    assert out.dtype == np.float32 and weights.dtype == np.float32
    np.testing.assert_allclose(out, O, rtol=0, atol=1e-6)
    np.testing.assert_allclose(weights, A, rtol=0, atol=1e-6)


# ---------------------------------------------------------------- seed 001: the six properties


@pytest.mark.parametrize("T,D", [(1, 1), (4, 3), (7, 16), (33, 64)])
def test_property_output_shape_is_T_by_D(T, D):
    rng = np.random.default_rng(T * 100 + D)
    Q, K, V = (rng.standard_normal((T, D)) for _ in range(3))
    out = sdpa.attention(Q, K, V)
    assert isinstance(out, np.ndarray)
    assert out.shape == (T, D)


@pytest.mark.parametrize("T,D", [(3, 2), (8, 8), (16, 64), (50, 32)])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_property_matches_numpy_reference_without_mask(T, D, dtype):
    rng = np.random.default_rng(1000 + T * D)
    Q, K, V = (rng.standard_normal((T, D)).astype(dtype) for _ in range(3))
    out = sdpa.attention(Q, K, V)
    np.testing.assert_allclose(out, seed_attention(Q, K, V), rtol=0, atol=1e-6)


def test_property_includes_sqrt_dk_scaling_diagnostic_d64():
    T, D = 8, 64
    rng = np.random.default_rng(64)
    Q, K, V = (rng.standard_normal((T, D)) for _ in range(3))
    scaled = seed_attention(Q, K, V)
    unscaled = seed_attention(Q * math.sqrt(D), K, V)  # softmax(Q K^T) V
    # Precondition on the test data, not on sdpa: the two differ by far more than the tolerance.
    assert np.abs(scaled - unscaled).max() > 0.1
    # sdpa's default is the scaled one ...
    out, weights = sdpa.attention(Q, K, V, return_weights=True)
    np.testing.assert_allclose(out, scaled, rtol=0, atol=1e-6)
    np.testing.assert_allclose(weights, reference_attention(Q, K, V)[1], rtol=0, atol=1e-6)
    assert np.abs(out - unscaled).max() > 0.1
    # ... and scale=1.0 switches the scaling off, so the unscaled result is reachable on purpose only,
    out1, weights1 = sdpa.attention(Q, K, V, scale=1.0, return_weights=True)
    np.testing.assert_allclose(out1, unscaled, rtol=0, atol=1e-6)
    np.testing.assert_allclose(weights1, reference_attention(Q, K, V, scale=1.0)[1], rtol=0, atol=1e-6)
    # ... giving the saturated (nearly one-hot) rows the seed warns about.
    assert weights1.max(axis=1).mean() > weights.max(axis=1).mean() + 0.1


def test_property_honours_a_causal_mask():
    T, D = 6, 4
    rng = np.random.default_rng(6)
    Q, K, V = (rng.standard_normal((T, D)) for _ in range(3))
    mask = np.tril(np.ones((T, T), dtype=bool))
    out, weights = sdpa.attention(Q, K, V, mask=mask, return_weights=True)
    np.testing.assert_allclose(out, seed_attention(Q, K, V, mask), rtol=0, atol=1e-6)
    # Blocked weights are exactly zero, and the surviving ones still sum to one
    # (masking the scores, not the weights).
    assert (weights[~mask] == 0).all()
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=0, atol=1e-12)
    assert (weights[mask] > 0).all()
    # Query 0 sees only key 0.
    np.testing.assert_allclose(out[0], V[0], rtol=0, atol=1e-12)
    # Changing the future never changes the past: row i does not depend on K/V rows j > i.
    for i in range(T - 1):
        K2, V2 = K.copy(), V.copy()
        K2[i + 1:] = rng.standard_normal((T - i - 1, D)) * 5
        V2[i + 1:] = rng.standard_normal((T - i - 1, D)) * 5
        out2 = sdpa.attention(Q, K2, V2, mask=mask)
        np.testing.assert_array_equal(out2[: i + 1], out[: i + 1])
        assert not np.allclose(out2[i + 1:], out[i + 1:])
    # causal=True is the same mask.
    np.testing.assert_allclose(sdpa.attention(Q, K, V, causal=True), out, rtol=0, atol=1e-12)


@pytest.mark.parametrize("masked", [False, True])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_property_output_rows_are_convex_combinations_of_V_rows(masked, dtype):
    T, D = 12, 5
    rng = np.random.default_rng(12 + masked)
    Q = (rng.standard_normal((T, D)) * 3).astype(dtype)  # large scores: nearly one-hot rows
    K = (rng.standard_normal((T, D)) * 3).astype(dtype)
    V = (rng.standard_normal((T, D)) * 10).astype(dtype)
    mask = np.tril(np.ones((T, T), dtype=bool)) if masked else None
    out, weights = sdpa.attention(Q, K, V, mask=mask, return_weights=True)
    # Weights are a probability distribution per row ...
    assert (weights >= 0).all()
    tol = 1e-12 if dtype == np.float64 else 1e-5
    np.testing.assert_allclose(weights.sum(axis=1), 1.0, rtol=0, atol=tol)
    # ... and each output coordinate lies within its column's range over the visible V rows.
    slack = tol * np.abs(V).max()
    for i in range(T):
        visible = V[: i + 1] if masked else V
        assert (out[i] >= visible.min(axis=0) - slack).all(), i
        assert (out[i] <= visible.max(axis=0) + slack).all(), i


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("form", ["bool", "float_zeros", "bool_row", "list"])
def test_property_all_true_mask_equals_no_mask(dtype, form):
    T, D = 9, 7
    rng = np.random.default_rng(9)
    Q, K, V = (rng.standard_normal((T, D)).astype(dtype) for _ in range(3))
    mask = {
        "bool": np.ones((T, T), dtype=bool),
        "float_zeros": np.zeros((T, T), dtype=dtype),
        "bool_row": np.ones((T,), dtype=bool),
        "list": [[True] * T] * T,
    }[form]
    out_none, w_none, lse_none = sdpa.attention(Q, K, V, return_weights=True, return_lse=True)
    out, w, lse = sdpa.attention(Q, K, V, mask=mask, return_weights=True, return_lse=True)
    np.testing.assert_array_equal(out, out_none)
    np.testing.assert_array_equal(w, w_none)
    np.testing.assert_array_equal(lse, lse_none)
