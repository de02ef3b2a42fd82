"""Absolute positions from Python (``q_start``, ``k_start`` of sdpa.attention and
sdpa.attention_backward): the docstring's picture; a whole call cut into query × key shards,
each computed with its positions and merged here by log-sum-exp, against the whole call
(forward and backward; causal, window, ALiBi, block mask, dropout, sinks, GQA); positions that
reproduce bottom-right causal bit for bit, every dtype; errors naming the argument. The C++
tests (tests/positions_test.cc) hold every kernel to the tolerance rule; these hold the
front door's plumbing and the decomposition."""

import ml_dtypes
import numpy as np
import pytest

import sdpa

DTYPES = [np.float32, np.float64, ml_dtypes.bfloat16, np.float16]


def _qkv(rng, B, Hq, Hkv, Nq, Nk, Dk, Dv, dtype=np.float64):
    return (rng.standard_normal((B, Hq, Nq, Dk)).astype(dtype), rng.standard_normal((B, Hkv, Nk, Dk)).astype(dtype),
            rng.standard_normal((B, Hkv, Nk, Dv)).astype(dtype))


def _chunks(n, cuts):
    edges = [0, *cuts, n]
    return list(zip(edges[:-1], edges[1:]))


def _merge(parts):
    """out, lse of one query shard from its key shards' (out_s, lse_s), in float64."""
    lse = np.stack([p[1].astype(np.float64) for p in parts])
    m = lse.max(axis=0)
    safe = np.where(np.isfinite(m), m, 0.0)
    with np.errstate(divide="ignore"):  # rows with no key in any shard: log(0), replaced below
        total = safe + np.log(np.exp(lse - safe).sum(axis=0))
    total = np.where(np.isfinite(m), total, -np.inf)
    w = np.where(np.isfinite(total), np.exp(lse - np.where(np.isfinite(total), total, 0.0)), 0.0)
    out = sum(w[s][..., None] * parts[s][0].astype(np.float64) for s in range(len(parts)))
    return out, total


def test_docstring_picture():
    rng = np.random.default_rng(0)
    q, k, v = _qkv(rng, 1, 1, 1, 2, 6, 4, 3, np.float32)
    want = {0: [[1, 1], [1, 1]], 2: [[1, 0], [1, 1]], 4: [[0, 0], [0, 0]]}
    for k0, allowed in want.items():
        out, w, lse = sdpa.attention(q, k[..., k0:k0 + 2, :], v[..., k0:k0 + 2, :], causal=True, q_start=2,
                                     k_start=k0, return_weights=True, return_lse=True)
        np.testing.assert_array_equal(w[0, 0] != 0, np.array(allowed, dtype=bool))
        if k0 == 4:
            assert np.all(out == 0) and np.all(lse == -np.inf)


# (B, Hq, Hkv, N, Dk, Dv, query cuts, key cuts, options)
SPLITS = [
    (2, 4, 2, 97, 16, 8, [30, 61], [25, 50, 75], dict(causal=True)),
    (1, 2, 1, 80, 8, 8, [40], [10, 41, 79], dict(causal="top_left", window=(12, 3), alibi_slopes=[0.25, 0.0625])),
    (1, 2, 2, 300, 32, 16, [150], [75, 150, 225], dict(causal=True, dropout_p=0.2, seed=5, block_size=(64, 128))),
    (1, 2, 1, 50, 8, 8, [25], [20, 35], dict(sinks=[0.5, -1.0])),
]


def _options(opts, rng, B, Hq, N):
    opts = dict(opts)
    if "block_size" in opts:
        bq, bk = opts["block_size"]
        opts["block_mask"] = rng.random((B, Hq, -(-N // bq), -(-N // bk))) < 0.6
    return opts


@pytest.mark.parametrize("case", SPLITS, ids=["causal_gqa", "window_alibi", "dropout_block_mask", "sinks"])
def test_split_merges_to_whole(case):
    B, Hq, Hkv, N, Dk, Dv, qcuts, kcuts, opts = case
    rng = np.random.default_rng(N)
    q, k, v = _qkv(rng, B, Hq, Hkv, N, N, Dk, Dv)
    opts = _options(opts, rng, B, Hq, N)
    out, lse = sdpa.attention(q, k, v, return_lse=True, backend="reference", **opts)
    sinks = opts.pop("sinks", None)
    for q0, q1 in _chunks(N, qcuts):
        parts = []
        for s, (k0, k1) in enumerate(_chunks(N, kcuts)):
            parts.append(sdpa.attention(q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :], return_lse=True,
                                        backend="reference", q_start=q0, k_start=k0,
                                        sinks=sinks if s == 0 else None, **opts))
        got_out, got_lse = _merge(parts)
        # float64 results exact to a few ulps; the merge adds a few more: 64 ulps of the sizes
        # involved (|out| <= max|v| / (1 - dropout_p), |lse| <= max|lse| + log(#shards)).
        eps = np.finfo(np.float64).eps
        scale = np.abs(v).max() / (1 - opts.get("dropout_p", 0))
        np.testing.assert_allclose(got_out, out[..., q0:q1, :], rtol=0, atol=64 * eps * scale)
        finite = np.isfinite(lse[..., q0:q1])
        np.testing.assert_array_equal(np.isfinite(got_lse), finite)
        np.testing.assert_allclose(got_lse[finite], lse[..., q0:q1][finite], rtol=0,
                                   atol=64 * eps * (1 + np.abs(lse[np.isfinite(lse)]).max()))


@pytest.mark.parametrize("case", SPLITS, ids=["causal_gqa", "window_alibi", "dropout_block_mask", "sinks"])
def test_backward_split_sums_to_whole(case):
    B, Hq, Hkv, N, Dk, Dv, qcuts, kcuts, opts = case
    rng = np.random.default_rng(N + 1)
    q, k, v = _qkv(rng, B, Hq, Hkv, N, N, Dk, Dv)
    opts = _options(opts, rng, B, Hq, N)
    out, lse = sdpa.attention(q, k, v, return_lse=True, backend="reference", **opts)
    dout = rng.standard_normal(out.shape)
    whole = sdpa.attention_backward(dout, q, k, v, out, lse, backend="reference", **opts)
    sinks = opts.pop("sinks", None)
    dq, dk, dv = np.zeros_like(q), np.zeros_like(k), np.zeros_like(v)
    dsinks = 0
    for q0, q1 in _chunks(N, qcuts):
        for s, (k0, k1) in enumerate(_chunks(N, kcuts)):
            g = sdpa.attention_backward(dout[..., q0:q1, :], q[..., q0:q1, :], k[..., k0:k1, :], v[..., k0:k1, :],
                                        out[..., q0:q1, :], lse[..., q0:q1], backend="reference", q_start=q0,
                                        k_start=k0, sinks=sinks if s == 0 else None, **opts)
            dq[..., q0:q1, :] += g[0]
            dk[..., k0:k1, :] += g[1]
            dv[..., k0:k1, :] += g[2]
            if s == 0 and sinks is not None:
                dsinks = dsinks + g[3]
    # Sums of float64 terms in another grouping: 2^-40 of the largest gradient (about 4000 ulps,
    # far below any missing or doubled term, which is of the gradient's own size).
    for got, want in zip((dq, dk, dv), whole[:3]):
        np.testing.assert_allclose(got, want, rtol=0, atol=2.0**-40 * max(1.0, np.abs(want).max()))
    if sinks is not None:
        np.testing.assert_allclose(dsinks, whole[3], rtol=0, atol=2.0**-40 * max(1.0, np.abs(whole[3]).max()))


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: np.dtype(d).name)
@pytest.mark.parametrize("nq,nk", [(37, 101), (101, 37)])
def test_positions_reproduce_bottom_right_bitwise(dtype, nq, nk):
    rng = np.random.default_rng(7)
    q, k, v = _qkv(rng, 2, 4, 2, nq, nk, 16, 8, dtype)
    opts = dict(window=(20, 2), alibi_slopes=np.array([0.5, 0.25, 0.125, 0.0625]), return_lse=True,
                return_weights=True)
    want = sdpa.attention(q, k, v, causal=True, **opts)
    got = sdpa.attention(q, k, v, causal="top_left", q_start=500 + max(nk - nq, 0), k_start=500 + max(nq - nk, 0),
                         **opts)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))
    out, lse = want[0], want[2]
    dout = rng.standard_normal(out.shape).astype(dtype)
    g_want = sdpa.attention_backward(dout, q, k, v, out, lse, causal=True, window=(20, 2))
    g_got = sdpa.attention_backward(dout, q, k, v, out, lse, causal="top_left", window=(20, 2),
                                    q_start=max(nk - nq, 0), k_start=max(nq - nk, 0))
    for a, b in zip(g_got, g_want):
        np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))


def test_errors_name_the_argument():
    rng = np.random.default_rng(1)
    q, k, v = _qkv(rng, 1, 1, 1, 3, 4, 4, 4, np.float32)
    with pytest.raises(ValueError, match="q_start is set but k_start is not"):
        sdpa.attention(q, k, v, q_start=1)
    with pytest.raises(ValueError, match="k_start=-1 must be >= 0"):
        sdpa.attention(q, k, v, q_start=0, k_start=-1)
    with pytest.raises(ValueError, match="q_start=.* overflows"):
        sdpa.attention(q, k, v, q_start=2**63 - 2, k_start=0)
    with pytest.raises(ValueError, match="q_start must be an integer in"):
        sdpa.attention(q, k, v, q_start=2**63, k_start=0)
    with pytest.raises(TypeError, match="k_start must be an integer"):
        sdpa.attention(q, k, v, q_start=0, k_start=1.0)
    out, lse = sdpa.attention(q, k, v, return_lse=True)
    with pytest.raises(ValueError, match="k_start is set but q_start is not"):
        sdpa.attention_backward(out, q, k, v, out, lse, k_start=3)
    with pytest.raises(ValueError, match=r"block_mask has shape \(1, 1\).*QB >= 2"):
        sdpa.attention(q, k, v, q_start=2, k_start=0, block_mask=np.ones((1, 1), bool), block_size=4)
