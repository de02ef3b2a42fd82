"""attention_varlen and attention_varlen_backward: each packed sequence against reference.py's
float64 oracle on its own rows (its own lengths for causal and window), and the errors."""

import numpy as np
import pytest

import sdpa
from reference import (assert_close, backward_floors, float32_tolerance, float64_tolerance, max_error,
                       naive_float32_attention, naive_float32_attention_backward, reference_attention,
                       reference_attention_backward)

LEN_Q = [3, 0, 70, 1]
LEN_K = [5, 9, 70, 300]


def _packed(dtype, Hq=4, Hkv=2, D=8, seed=2):
    rng = np.random.default_rng(seed)
    cu_q, cu_k = np.cumsum([0] + LEN_Q), np.cumsum([0] + LEN_K)
    q = rng.standard_normal((cu_q[-1], Hq, D)).astype(dtype)
    k = rng.standard_normal((cu_k[-1], Hkv, D)).astype(dtype)
    v = rng.standard_normal((cu_k[-1], Hkv, D)).astype(dtype)
    return q, k, v, cu_q, cu_k


def _seq(a, cu, b):
    """Rows of sequence b of a packed (total, H, D) array as (H, n, D)."""
    return np.ascontiguousarray(a[cu[b]:cu[b + 1]].transpose(1, 0, 2))


@pytest.mark.parametrize("window", [None, (4, 0)])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_sequence_against_the_oracle(dtype, causal, window):
    q, k, v, cu_q, cu_k = _packed(dtype)
    out, lse = sdpa.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, window=window, return_lse=True)
    assert out.shape == q.shape[:2] + (v.shape[2],) and lse.shape == (q.shape[1], q.shape[0])
    for b in range(len(LEN_Q)):
        args = [_seq(x, cu, b).astype(np.float64) for x, cu in ((q, cu_q), (k, cu_k), (v, cu_k))]
        ref = reference_attention(*args, causal=causal, window=window)
        naive = naive_float32_attention(*args, causal=causal, window=window)
        got = (_seq(out, cu_q, b), lse[:, cu_q[b]:cu_q[b + 1]])
        for name, g, want, n32 in zip(("out", "lse"), got, (ref[0], ref[2]), (naive[0], naive[2])):
            tol = float64_tolerance(want) if dtype == np.float64 else float32_tolerance(n32, want)
            assert_close(g, want, tol, f"{name} of sequence {b}")


@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_backward_each_sequence_against_the_oracle(causal):
    q, k, v, cu_q, cu_k = _packed(np.float32)
    out, lse = sdpa.attention_varlen(q, k, v, cu_q, cu_k, causal=causal, return_lse=True)
    dout = np.random.default_rng(4).standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = sdpa.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=causal)
    for b in range(len(LEN_Q)):
        args = (_seq(dout, cu_q, b), _seq(q, cu_q, b), _seq(k, cu_k, b), _seq(v, cu_k, b))
        o = _seq(out, cu_q, b)
        ref = reference_attention_backward(*args, causal=causal, out=o)
        naive = naive_float32_attention_backward(*args, causal=causal, out=o)
        floors = backward_floors(*args, causal=causal)
        got = (_seq(dq, cu_q, b), _seq(dk, cu_k, b), _seq(dv, cu_k, b))
        for name, g, want, n32, floor in zip(("dq", "dk", "dv"), got, ref, naive, floors):
            assert_close(g, want, 2 * max_error(n32, want) + floor, f"{name} of sequence {b}")


def test_equals_attention_on_each_sequence_bit_for_bit():
    q, k, v, cu_q, cu_k = _packed(np.float32)
    out = sdpa.attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    for b in range(len(LEN_Q)):
        dense = sdpa.attention(_seq(q, cu_q, b), _seq(k, cu_k, b), _seq(v, cu_k, b), causal=True)
        np.testing.assert_array_equal(_seq(out, cu_q, b), dense)


@pytest.mark.parametrize("cu_q, error, match", [
    ([1, 3, 74, 75, 74], ValueError, r"cu_seqlens_q\[0\] = 1 but must be 0"),
    ([0, 3, 2, 73, 74], ValueError, r"cu_seqlens_q\[2\] = 2 is less than cu_seqlens_q\[1\] = 3"),
    ([0, 3, 3, 73, 70], ValueError, r"cu_seqlens_q\[3\] = 73 is less than|cu_seqlens_q\[4\] = 70"),
    ([0, 3, 3, 73], ValueError, r"cu_seqlens_q\[3\] = 73 but q has 74 rows"),
    ([0.0, 3.0, 3.0, 73.0, 74.0], TypeError, r"cu_seqlens_q has dtype float64"),
])
def test_bad_offsets_are_errors_naming_them(cu_q, error, match):
    q, k, v, _, cu_k = _packed(np.float32)
    with pytest.raises(error, match=match):
        sdpa.attention_varlen(q, k, v, cu_q, cu_k)


def test_packed_inputs_must_have_three_dims():
    q, k, v, cu_q, cu_k = _packed(np.float32)
    with pytest.raises(ValueError, match=r"q has shape \(74, 32\), but must be \(total_q, Hq, Dk\)"):
        sdpa.attention_varlen(q.reshape(74, 32), k, v, cu_q, cu_k)
