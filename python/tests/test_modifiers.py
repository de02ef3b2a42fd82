"""Score modifiers through the NumPy front door: softcap (both orders), ALiBi slopes and attention
sinks, forward against a float64 NumPy oracle written here from the docstring's formulas,
gradients (dq, dk, dv, dsinks) against central differences of that oracle, the varlen, paged
and KVCache entry points, and the errors."""

import ml_dtypes
import numpy as np
import pytest

import sdpa


def oracle(q, k, v, mask=None, causal=False, softcap=0.0, order="before_bias", slopes=None, sinks=None,
           seqlens_k=None):
    """(out, lse) in float64 for 4-D q, k, v (GQA by repetition), from sdpa.attention's docstring."""
    q, k, v = (np.asarray(x, np.float64) for x in (q, k, v))
    B, Hq, Nq, D = q.shape
    Nk = k.shape[2]
    rep = Hq // k.shape[1]
    k, v = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
    x = q @ k.transpose(0, 1, 3, 2) / np.sqrt(D)
    i = np.arange(Nq)[:, None]
    j = np.arange(Nk)[None, :]
    out = np.zeros((B, Hq, Nq, v.shape[-1]))
    lse = np.full((B, Hq, Nq), -np.inf)
    for b in range(B):
        L = Nk if seqlens_k is None else seqlens_k[b]
        allowed = (j < L) & ((j <= i + L - Nq) if causal else True)
        bias = np.zeros((Hq, Nq, Nk)) if mask is None else np.broadcast_to(np.where(mask, 0.0, -np.inf), (Hq, Nq, Nk))
        s = x[b].copy()
        alibi = 0.0
        if slopes is not None:
            sl = np.asarray(slopes, np.float64)
            sl = sl if sl.ndim == 1 else sl[b if sl.shape[0] > 1 else 0]
            alibi = -sl[:, None, None] * np.abs(i + L - Nq - j)[None]
        if softcap and order == "before_bias":
            s = softcap * np.tanh(s / softcap)
        s = s + alibi
        blocked = ~allowed[None] | (bias == -np.inf)
        s = np.where(blocked, -np.inf, s + np.where(blocked, 0.0, bias))
        if softcap and order == "after_bias":
            s = np.where(blocked, -np.inf, softcap * np.tanh(s / softcap))
        sink = np.full(Hq, -np.inf) if sinks is None else np.asarray(sinks, np.float64)
        m = np.maximum(s.max(axis=-1), sink[:, None])
        m_safe = np.where(np.isfinite(m), m, 0.0)
        p = np.exp(s - m_safe[..., None])
        total = p.sum(-1) + np.exp(sink[:, None] - m_safe)
        w = np.where(total[..., None] > 0, p / np.where(total > 0, total, 1)[..., None], 0.0)
        out[b] = w @ v[b]
        lse[b] = np.where(total > 0, m_safe + np.log(np.where(total > 0, total, 1)), -np.inf)
    return out, lse


def _inputs(dtype=np.float64, B=2, Hq=4, Hkv=2, Nq=9, Nk=13, D=8, seed=0):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, D)) * 2
    k = rng.standard_normal((B, Hkv, Nk, D)) * 2
    v = rng.standard_normal((B, Hkv, Nk, D))
    mask = rng.random((Nq, Nk)) < 0.8
    mask[3] = False  # a row with no key
    return q.astype(dtype), k.astype(dtype), v.astype(dtype), mask


MODS = {
    "softcap": dict(softcap=1.5),
    "softcap_after_bias": dict(softcap=1.5, softcap_order="after_bias"),
    "alibi": dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "alibi_per_batch": dict(alibi_slopes=[[0.5, 0.25, 0.125, 0.0625], [1.0, 0.5, 0.25, 0.125]]),
    "sinks": dict(sinks=[0.5, -1.0, 2.0, 0.0]),
    "all": dict(softcap=2.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625], sinks=[0.5, -1.0, 2.0, 0.0]),
}


def _oracle_kwargs(mods):
    return dict(softcap=mods.get("softcap", 0.0), order=mods.get("softcap_order", "before_bias"),
                slopes=mods.get("alibi_slopes"), sinks=mods.get("sinks"))


@pytest.mark.parametrize("name", MODS)
@pytest.mark.parametrize("causal", [False, True])
def test_float64_matches_the_oracle(name, causal):
    q, k, v, mask = _inputs()
    mods = MODS[name]
    want_out, want_lse = oracle(q, k, v, mask, causal, **_oracle_kwargs(mods))
    for backend in ("auto", "reference"):
        out, lse = sdpa.attention(q, k, v, mask, causal=causal, return_lse=True, backend=backend, **mods)
        np.testing.assert_allclose(out, want_out, rtol=0, atol=1e-12)
        np.testing.assert_array_equal(np.isinf(lse), np.isinf(want_lse))
        np.testing.assert_allclose(lse[np.isfinite(lse)], want_lse[np.isfinite(want_lse)], rtol=0, atol=1e-12)
    if "sinks" in mods:  # the row with no key: out 0, lse = its head's sink
        np.testing.assert_array_equal(out[:, :, 3], 0.0)
        np.testing.assert_array_equal(lse[:, :, 3], np.broadcast_to(np.asarray(mods["sinks"]), (2, 4)))


@pytest.mark.parametrize("name", MODS)
@pytest.mark.parametrize("dtype", [np.float32, np.float16, ml_dtypes.bfloat16])
def test_low_precision_within_the_naive_error(name, dtype):
    """auto against reference, within twice the error of the naive same-precision algorithm
    (plus one unit in the last place of the 16-bit out)."""
    q, k, v, mask = _inputs(dtype, Nq=70, Nk=150, D=16, seed=3)
    mods = MODS[name]
    ref = sdpa.attention(q, k, v, mask, causal=True, backend="reference", **mods).astype(np.float64)
    naive = sdpa.attention(q, k, v, mask, causal=True, backend="naive", **mods).astype(np.float64)
    got = sdpa.attention(q, k, v, mask, causal=True, **mods).astype(np.float64)
    ulp = 0.0 if dtype == np.float32 else float(ml_dtypes.finfo(dtype).eps) * np.abs(ref).max()
    tol = 2 * np.abs(naive - ref).max() + 8 * np.finfo(np.float32).eps * np.abs(ref).max() + ulp
    np.testing.assert_allclose(got, ref, rtol=0, atol=tol)


def _loss(q, k, v, mask, dout, mods):
    out, _ = oracle(q, k, v, mask, True, **_oracle_kwargs(mods))
    return float((out * dout).sum())


@pytest.mark.parametrize("name", ["softcap", "softcap_after_bias", "all"])
def test_gradients_match_finite_differences(name):
    q, k, v, mask = _inputs(Nq=5, Nk=7, D=4, seed=7)
    mods = dict(MODS[name])
    mods.setdefault("sinks", [0.3, -0.2, 1.1, 0.0])
    out, lse = sdpa.attention(q, k, v, mask, causal=True, return_lse=True, **mods)
    dout = np.random.default_rng(1).standard_normal(out.shape)
    dq, dk, dv, dsinks = sdpa.attention_backward(dout, q, k, v, out, lse, mask, causal=True, **mods)
    h = 1e-6
    for x, g in ((q, dq), (k, dk), (v, dv)):
        for idx in [(0, 0, 0, 0), (1, 1, 2, 3), (0, 1, 4, 1)]:
            x0 = x[idx]
            x[idx] = x0 + h
            up = _loss(q, k, v, mask, dout, mods)
            x[idx] = x0 - h
            down = _loss(q, k, v, mask, dout, mods)
            x[idx] = x0
            assert g[idx] == pytest.approx((up - down) / (2 * h), rel=1e-6, abs=1e-7)
    sinks = np.array(mods["sinks"], np.float64)
    for hh in range(4):
        up, down = dict(mods), dict(mods)
        up["sinks"] = sinks + h * (np.arange(4) == hh)
        down["sinks"] = sinks - h * (np.arange(4) == hh)
        want = (_loss(q, k, v, mask, dout, up) - _loss(q, k, v, mask, dout, down)) / (2 * h)
        assert dsinks[hh] == pytest.approx(want, rel=1e-6, abs=1e-7)


def test_varlen_gives_each_sequence_its_own_slopes():
    """Packed sequences with (B, Hq) slopes and sinks: sequence b equals attention on its rows
    with row b of the slopes, bit for bit; dsinks is the sum over the sequences."""
    rng = np.random.default_rng(4)
    lq, lk = [3, 6], [5, 11]
    cu_q, cu_k = np.cumsum([0] + lq), np.cumsum([0] + lk)
    q = rng.standard_normal((cu_q[-1], 4, 8)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], 2, 8)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], 2, 8)).astype(np.float32)
    mods = dict(softcap=3.0, alibi_slopes=np.array([[0.5, 0.25, 0.1, 0.05], [0.2, 0.3, 0.4, 0.5]]),
                sinks=[0.1, 0.2, 0.3, 0.4])
    out, lse = sdpa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, return_lse=True, **mods)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv, dsinks = sdpa.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, **mods)
    total = np.zeros(4)
    for b in range(2):
        rows = lambda a, cu: np.ascontiguousarray(a[cu[b]:cu[b + 1]].transpose(1, 0, 2))
        one = dict(mods, alibi_slopes=mods["alibi_slopes"][b])
        o, l = sdpa.attention(rows(q, cu_q), rows(k, cu_k), rows(v, cu_k), causal=True, return_lse=True, **one)
        np.testing.assert_array_equal(out[cu_q[b]:cu_q[b + 1]].transpose(1, 0, 2), o)
        *_, ds = sdpa.attention_backward(rows(dout, cu_q), rows(q, cu_q), rows(k, cu_k), rows(v, cu_k), o, l,
                                         causal=True, **one)
        total += ds
    np.testing.assert_allclose(dsinks, total, rtol=1e-6)


def test_paged_and_kv_cache_take_the_modifiers():
    """A KV cache's decode step with modifiers equals the dense call on the same keys."""
    rng = np.random.default_rng(5)
    cache = sdpa.KVCache(num_pages=8, page_size=4, num_kv_heads=2, head_dim_k=8)
    s = cache.new_sequence()
    k = rng.standard_normal((13, 2, 8)).astype(np.float32)
    v = rng.standard_normal((13, 2, 8)).astype(np.float32)
    cache.append(s, k, v)
    q = rng.standard_normal((1, 4, 1, 8)).astype(np.float32)
    mods = MODS["all"]
    got = cache.attention(q, [s], causal=True, **mods)
    dense = sdpa.attention(q, k.transpose(1, 0, 2)[None], v.transpose(1, 0, 2)[None], causal=True, **mods)
    np.testing.assert_allclose(got, dense, rtol=0, atol=1e-6)


def test_bad_modifiers_are_errors_naming_them():
    q, k, v, _ = _inputs()
    with pytest.raises(ValueError, match="softcap="):
        sdpa.attention(q, k, v, softcap=-1.0)
    with pytest.raises(TypeError, match="softcap must be a real number"):
        sdpa.attention(q, k, v, softcap="big")
    with pytest.raises(ValueError, match="softcap_order must be"):
        sdpa.attention(q, k, v, softcap=1.0, softcap_order="onnx")
    with pytest.raises(ValueError, match=r"alibi_slopes has shape \(3,\)"):
        sdpa.attention(q, k, v, alibi_slopes=[1.0, 2.0, 3.0])
    with pytest.raises(ValueError, match=r"sinks\[1\] = nan"):
        sdpa.attention(q, k, v, sinks=[1.0, np.nan, 0.0, 0.0])
    with pytest.raises(ValueError, match=r"sinks has rank 2"):
        sdpa.attention(q, k, v, sinks=[[1.0, 2.0], [3.0, 4.0]])
