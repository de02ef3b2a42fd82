"""precision="fast" through the NumPy front door (issue 28): bfloat16 and float16 inputs round the
weights before p·V and normalise by the sum of the rounded weights. The C++ tests
(tests/fast_test.cc) hold the sweep against the oracle; here: the argument reaches the core on
every entry point, values all 1 give exactly 1, the error bound against the float64 reference
with the naive twin (backend="naive", precision="fast") as yardstick, wider inputs unchanged,
the ``sdpa.precision`` block and the errors."""

import threading

import ml_dtypes
import numpy as np
import pytest

import sdpa

BF16 = np.dtype(ml_dtypes.bfloat16)
HALVES = [BF16, np.dtype(np.float16)]


def qkv(dtype, shape_q=(2, 4, 33, 32), shape_k=(2, 4, 300, 32), dv=16, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_k).astype(dtype)
    v = rng.standard_normal(shape_k[:-1] + (dv,)).astype(dtype)
    return q, k, v


def f64(a):
    return np.asarray(a).astype(np.float64)


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_fast_differs_from_exact_and_keeps_the_error_bound(dtype):
    q, k, v = qkv(dtype)
    fast = f64(sdpa.attention(q, k, v, precision="fast"))
    exact = f64(sdpa.attention(q, k, v))
    assert not np.array_equal(fast, exact)
    ref = f64(sdpa.attention(q, k, v, backend="reference"))
    naive = f64(sdpa.attention(q, k, v, backend="naive", precision="fast"))
    ulp = float(ml_dtypes.finfo(dtype).eps) * np.abs(f64(v)).max()  # the output's rounding
    assert np.abs(fast - ref).max() <= 2 * np.abs(naive - ref).max() + ulp


@pytest.mark.parametrize("dtype", HALVES, ids=str)
def test_values_all_one_give_exactly_one(dtype):
    q, k, _ = qkv(dtype, (1, 2, 40, 16), (1, 2, 1500, 16))
    v = np.ones((1, 2, 1500, 8), dtype)
    out = sdpa.attention(q, k, v, causal=True, precision="fast")
    assert np.array_equal(f64(out), np.ones(out.shape))


def test_wider_inputs_ignore_it():
    for dtype in (np.float32, np.float64):
        q, k, v = qkv(dtype)
        assert np.array_equal(sdpa.attention(q, k, v, precision="fast"), sdpa.attention(q, k, v))


def test_every_entry_point_takes_it():
    q, k, v = qkv(BF16, (2, 2, 5, 16), (2, 2, 40, 16), 8)
    out, lse = sdpa.attention(q, k, v, return_lse=True, precision="fast")
    dout = np.ones_like(out)
    exact_grads = sdpa.attention_backward(dout, q, k, v, out, lse)
    fast_grads = sdpa.attention_backward(dout, q, k, v, out, lse, precision="fast")
    assert any(not np.array_equal(a, b) for a, b in zip(exact_grads, fast_grads))
    # varlen: the two sequences packed, token-major.
    packed = [np.ascontiguousarray(x.transpose(0, 2, 1, 3).reshape(-1, x.shape[1], x.shape[3])) for x in (q, k, v)]
    cu_q, cu_k = np.array([0, 5, 10]), np.array([0, 40, 80])
    var = sdpa.attention_varlen(*packed, cu_q, cu_k, precision="fast")
    assert np.array_equal(var.reshape(2, 5, 2, 8).transpose(0, 2, 1, 3), out)
    sdpa.attention_varlen_backward(np.ones_like(var), *packed, var, sdpa.attention_varlen(*packed, cu_q, cu_k,
                                   return_lse=True, precision="fast")[1], cu_q, cu_k, precision="fast")
    # A KV cache and the paged call.
    cache = sdpa.KVCache(num_pages=8, page_size=16, num_kv_heads=2, head_dim_k=16, head_dim_v=8, dtype=BF16)
    seqs = [cache.new_sequence(), cache.new_sequence()]
    for b, s in enumerate(seqs):
        cache.append(s, k[b].transpose(1, 0, 2), v[b].transpose(1, 0, 2))
    paged = cache.attention(q, seqs, precision="fast")
    assert np.array_equal(paged, out)
    with pytest.raises(ValueError, match="precision"):
        cache.attention(q, seqs, precision="quick")


def test_the_block_sets_the_default():
    q, k, v = qkv(BF16)
    exact, fast = sdpa.attention(q, k, v), sdpa.attention(q, k, v, precision="fast")
    with sdpa.precision("fast"):
        assert np.array_equal(sdpa.attention(q, k, v), fast)
        assert np.array_equal(sdpa.attention(q, k, v, precision="exact"), exact)  # a call's own wins
        with sdpa.precision("exact"):
            assert np.array_equal(sdpa.attention(q, k, v), exact)
        assert np.array_equal(sdpa.attention(q, k, v), fast)
        seen = []  # another thread has its own default
        thread = threading.Thread(target=lambda: seen.append(sdpa.attention(q, k, v)))
        thread.start()
        thread.join()
        assert np.array_equal(seen[0], exact)
    assert np.array_equal(sdpa.attention(q, k, v), exact)


def test_errors_name_the_argument():
    q, k, v = qkv(BF16, (1, 1, 2, 8), (1, 1, 3, 8), 8)
    with pytest.raises(ValueError, match="precision must be 'exact' or 'fast', got 'quick'"):
        sdpa.attention(q, k, v, precision="quick")
    with pytest.raises(TypeError, match="precision must be 'exact' or 'fast', got 1"):
        sdpa.attention(q, k, v, precision=1)
    with pytest.raises(ValueError, match="precision must be 'exact' or 'fast'"):
        with sdpa.precision("half"):
            pass
