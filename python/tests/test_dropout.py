"""Dropout: the mask is a pure function of (seed, b, h, i, j), forward and backward use the
same one, and both equal a float64 NumPy computation that applies that mask explicitly."""

import numpy as np
import pytest

import sdpa


def reference(q, k, v, keep, p, dout, causal=False):
    """float64 NumPy forward and backward of softmax(q kᵀ/√d) with weights multiplied by
    Z = keep / (1 - p); q (H, Nq, D), k/v (H, Nk, D) (no GQA here), keep (H, Nq, Nk)."""
    s = q @ np.swapaxes(k, -1, -2) / np.sqrt(q.shape[-1])
    if causal:
        nq, nk = s.shape[-2:]
        s = np.where(np.tril(np.ones((nq, nk), bool), nk - nq), s, -np.inf)
    m = s.max(-1, keepdims=True)
    P = np.exp(s - np.where(np.isfinite(m), m, 0))  # rows with no allowed key: all zero
    P /= np.maximum(P.sum(-1, keepdims=True), np.finfo(P.dtype).tiny)
    Z = keep / (1 - p)
    out = (P * Z) @ v
    dv = np.swapaxes(P * Z, -1, -2) @ dout
    dP = Z * (dout @ np.swapaxes(v, -1, -2))
    D = (dout * out).sum(-1, keepdims=True)
    dS = P * (dP - D)
    scale = 1 / np.sqrt(q.shape[-1])
    return out, (scale * dS @ k, scale * np.swapaxes(dS, -1, -2) @ q, dv)


def qkv(rng, H=2, Nq=37, Nk=150, D=16, dtype=np.float64):
    return tuple(rng.standard_normal(s).astype(dtype) for s in ((H, Nq, D), (H, Nk, D), (H, Nk, D), (H, Nq, D)))


@pytest.mark.parametrize("Nq,Nk", [(37, 150), (1, 300), (200, 130)])  # (1, ·): the decode kernel
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_equal_numpy_with_the_same_mask(Nq, Nk, causal):
    rng = np.random.default_rng(1)
    q, k, v, dout = qkv(rng, Nq=Nq, Nk=Nk)
    p, seed = 0.3, 77
    keep = sdpa.dropout_mask((2, Nq, Nk), p, seed)
    out, lse = sdpa.attention(q, k, v, causal=causal, dropout_p=p, seed=seed, return_lse=True)
    ref_out, ref_grads = reference(q, k, v, keep, p, dout, causal)
    np.testing.assert_allclose(out, ref_out, rtol=0, atol=1e-12)
    grads = sdpa.attention_backward(dout, q, k, v, out, lse, causal=causal, dropout_p=p, seed=seed)
    for name, g, r in zip(("dq", "dk", "dv"), grads, ref_grads):
        np.testing.assert_allclose(g, r, rtol=0, atol=1e-11, err_msg=name)


def test_backward_matches_finite_differences():
    rng = np.random.default_rng(2)
    q, k, v, dout = qkv(rng, H=1, Nq=5, Nk=9, D=4)
    p, seed = 0.25, 5

    def loss(q, k, v):
        return float((sdpa.attention(q, k, v, dropout_p=p, seed=seed, backend="reference") * dout).sum())

    out, lse = sdpa.attention(q, k, v, dropout_p=p, seed=seed, return_lse=True)
    grads = sdpa.attention_backward(dout, q, k, v, out, lse, dropout_p=p, seed=seed)
    h = 1e-6
    for which, g in enumerate(grads):
        for idx in [(0, 0, 0), (0, 2, 3), (0, 4, 1)]:
            args = [q.copy(), k.copy(), v.copy()]
            args[which][idx] += h
            up = loss(*args)
            args[which][idx] -= 2 * h
            down = loss(*args)
            assert abs((up - down) / (2 * h) - g[idx]) < 1e-7


def test_zero_dropout_is_exactly_no_dropout():
    rng = np.random.default_rng(3)
    q, k, v, _ = qkv(rng, dtype=np.float32)
    assert np.array_equal(sdpa.attention(q, k, v, dropout_p=0.0, seed=9), sdpa.attention(q, k, v))


def test_mask_is_a_function_of_the_element_not_of_the_shape_or_threads():
    m4 = sdpa.dropout_mask((2, 3, 50, 60), 0.5, 123)
    m3 = sdpa.dropout_mask((3, 50, 60), 0.5, 123)
    assert np.array_equal(m4[0], m3)                       # b = 0 in both
    assert np.array_equal(m3[:, :20, :30], sdpa.dropout_mask((3, 20, 30), 0.5, 123))
    assert not np.array_equal(m3, sdpa.dropout_mask((3, 50, 60), 0.5, 124))  # the seed matters
    rng = np.random.default_rng(4)
    q, k, v, _ = qkv(rng, Nq=300, Nk=700, dtype=np.float32)
    sdpa.set_num_threads(1)
    one = sdpa.attention(q, k, v, dropout_p=0.2, seed=1)
    sdpa.set_num_threads(2)
    two = sdpa.attention(q, k, v, dropout_p=0.2, seed=1)
    sdpa.set_num_threads(0)
    assert np.array_equal(one, two)


@pytest.mark.parametrize("p", [0.1, 0.5, 0.9])
def test_keep_rate_is_one_minus_p(p):
    keep = sdpa.dropout_mask((4, 500, 500), p, 2024)
    n = keep.size
    sigma = np.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - (1 - p)) < 6 * sigma


def test_weights_output_is_before_dropout():
    rng = np.random.default_rng(5)
    q, k, v, _ = qkv(rng)
    _, w = sdpa.attention(q, k, v, dropout_p=0.5, seed=3, return_weights=True)
    np.testing.assert_allclose(w.sum(-1), 1.0, rtol=0, atol=1e-12)


@pytest.mark.parametrize("kwargs,error,match", [
    ({"dropout_p": -0.1, "seed": 1}, ValueError, "dropout_p"),
    ({"dropout_p": 1.0, "seed": 1}, ValueError, "dropout_p"),
    ({"dropout_p": float("nan"), "seed": 1}, ValueError, "dropout_p"),
    ({"dropout_p": 0.5}, ValueError, "seed"),
    ({"dropout_p": 0.5, "seed": -1}, ValueError, "seed"),
    ({"dropout_p": 0.5, "seed": 1.5}, ValueError, "seed"),
    ({"dropout_p": "0.5", "seed": 1}, TypeError, "dropout_p"),
])
def test_bad_dropout_arguments(kwargs, error, match):
    q = np.zeros((2, 3))
    with pytest.raises(error, match=match):
        sdpa.attention(q, q, q, **kwargs)
