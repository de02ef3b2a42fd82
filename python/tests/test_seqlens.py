"""seqlens_k: per-sequence key lengths. Each sequence b of a call equals the dense call on its
own keys k[b, :, :L], v[b, :, :L] (the definition in the docstring: keys past L do not exist, and
causal and window align to L), checked against reference.py's float64 oracle on those slices;
keys past L hold NaN and must not matter; the docstring's picture; the errors."""

import re

import ml_dtypes
import numpy as np
import pytest

import sdpa
from reference import (assert_close, backward_floors, float32_tolerance, float64_tolerance, max_error,
                       naive_float32_attention, naive_float32_attention_backward, reference_attention,
                       reference_attention_backward)


def _inputs(dtype, B=4, Hq=4, Hkv=2, Nq=5, Nk=40, D=8, lengths=(40, 0, 17, 3), seed=3):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, D))
    k = rng.standard_normal((B, Hkv, Nk, D))
    v = rng.standard_normal((B, Hkv, Nk, D))
    L = np.array(lengths)
    for b in range(B):  # keys past the length: NaN, which would show if read
        k[b, :, L[b]:] = np.nan
        v[b, :, L[b]:] = np.nan
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), L


@pytest.mark.parametrize("window", [None, (6, 1)])
@pytest.mark.parametrize("causal", [False, "bottom_right", "top_left"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_each_sequence_is_attention_on_its_own_keys(dtype, causal, window):
    q, k, v, L = _inputs(dtype)
    out, weights, lse = sdpa.attention(q, k, v, causal=causal, window=window, seqlens_k=L, return_weights=True,
                                       return_lse=True)
    for b, n in enumerate(L):
        kb, vb = k[b, :, :n].astype(np.float64), v[b, :, :n].astype(np.float64)
        ref = reference_attention(q[b], kb, vb, causal=causal, window=window)
        naive = naive_float32_attention(q[b], kb, vb, causal=causal, window=window)
        for name, got, want, naive32 in zip(("out", "weights", "lse"), (out[b], weights[b, :, :, :n], lse[b]), ref,
                                            naive):
            tol = float64_tolerance(want) if dtype == np.float64 else float32_tolerance(naive32, want)
            assert_close(got, want, tol, f"{name} of sequence {b}")
        assert not weights[b, :, :, n:].any(), "keys past the length have weight 0"


def test_bfloat16_kv_cache_filled_to_different_lengths():
    q, k, v, L = _inputs(np.float32, Nq=1)
    k16, v16 = k.astype(ml_dtypes.bfloat16), v.astype(ml_dtypes.bfloat16)
    out = sdpa.attention(q, k16, v16, seqlens_k=L.astype(np.int32))
    assert out.dtype == np.float32 and np.isfinite(out).all()
    for b, n in enumerate(L):
        dense = sdpa.attention(q[b], k16[b, :, :n], v16[b, :, :n])
        np.testing.assert_array_equal(out[b], dense)  # one tile of keys: the same arithmetic


@pytest.mark.parametrize("causal", [False, "bottom_right"])
def test_backward_each_sequence_on_its_own_keys(causal):
    q, k, v, L = _inputs(np.float32, Nq=6)
    out, lse = sdpa.attention(q, k, v, causal=causal, seqlens_k=L, return_lse=True)
    dout = np.random.default_rng(9).standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = sdpa.attention_backward(dout, q, k, v, out, lse, causal=causal, seqlens_k=L)
    for b, n in enumerate(L):
        args = (dout[b], q[b], k[b, :, :n], v[b, :, :n])
        ref = reference_attention_backward(*args, causal=causal, out=out[b])
        naive = naive_float32_attention_backward(*args, causal=causal, out=out[b])
        floors = backward_floors(*args, causal=causal)
        for name, got, want, naive32, floor in zip(("dq", "dk", "dv"), (dq[b], dk[b, :, :n], dv[b, :, :n]), ref, naive,
                                                   floors):
            assert_close(got, want, 2 * max_error(naive32, want) + floor, f"{name} of sequence {b}")
        assert not dk[b, :, n:].any() and not dv[b, :, n:].any(), "keys past the length get no gradient"


def test_docstring_picture():
    """The picture under seqlens_k in help(sdpa.attention) is what attention blocks."""
    doc = sdpa.attention.__doc__
    start = doc.index("seqlens_k = [5, 2]")
    rows = re.findall(r"q(\d)((?:\s+[x.-]){6})\s+q\d((?:\s+[x.-]){6})", doc[start:start + 600])
    assert len(rows) == 2
    pictures = [np.array([r[1].split() for r in rows]), np.array([r[2].split() for r in rows])]
    q = np.zeros((2, 1, 2, 4))
    k = np.random.default_rng(1).standard_normal((2, 1, 6, 4))
    _, weights = sdpa.attention(q, k, k, causal=True, seqlens_k=[5, 2], return_weights=True)
    for b in range(2):
        np.testing.assert_array_equal(weights[b, 0] > 0, pictures[b] == "x")


@pytest.mark.parametrize("seqlens, error, match", [
    ([5, 7], ValueError, r"seqlens_k\[1\] = 7 is outside \[0, Nk\] = \[0, 6\]"),
    ([-1, 2], ValueError, r"seqlens_k\[0\] = -1"),
    ([5], ValueError, r"seqlens_k has shape \(1,\) but must be \(2,\)"),
    ([[5, 2]], ValueError, r"seqlens_k has shape \(1, 2\)"),
    ([5.0, 2.0], TypeError, r"seqlens_k has dtype float64"),
    ([True, False], TypeError, r"seqlens_k has dtype bool"),
    (np.array([2**63, 1], dtype=np.uint64), ValueError, r"seqlens_k holds 9223372036854775808"),
])
def test_bad_seqlens_are_errors_naming_them(seqlens, error, match):
    q = np.zeros((2, 1, 2, 4), np.float32)
    k = np.zeros((2, 1, 6, 4), np.float32)
    with pytest.raises(error, match=match):
        sdpa.attention(q, k, k, seqlens_k=seqlens)
