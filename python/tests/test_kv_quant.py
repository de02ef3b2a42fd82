"""The 8-bit KV cache from Python: sdpa.quantize_kv against a NumPy implementation of the rule
(bitwise) and its round trip, KVCache's 8-bit pools, the errors, and attention on 8-bit K/V
(attention, attention_varlen, attention_paged, KVCache.attention) against attention on the
dequantised float32 K/V, and bench/kv_quant_accuracy.py's report."""
import importlib.util
import os

import ml_dtypes
import numpy as np
import pytest

import sdpa

BF16 = np.dtype(ml_dtypes.bfloat16)
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# bench/kv_quant_accuracy.py: its report() is tested below, its dequantised() (fl32(fl32(values -
# z) · s) per row or group, KVQuant's rule) is this file's too.
_spec = importlib.util.spec_from_file_location("kv_quant_accuracy", os.path.join(ROOT, "bench", "kv_quant_accuracy.py"))
accuracy = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(accuracy)
dequantised = accuracy.dequantised


def twin(x, dtype, groups):
    """quantize_kv's rule in NumPy, float64 arithmetic: (values, scale[, zero])."""
    u = np.asarray(x, np.float64)
    d = u.shape[-1]
    u = u.reshape(u.shape[:-1] + (groups, d // groups))
    with np.errstate(divide="ignore", invalid="ignore"):
        if dtype == "int8":
            s = (np.abs(u).max(-1) / 127).astype(np.float32)
            z = np.zeros_like(s)
            q = np.clip(np.rint(u / s[..., None].astype(np.float64)), -127, 127)
        else:
            lo, hi = np.minimum(u.min(-1), 0), np.maximum(u.max(-1), 0)
            s = ((hi - lo) / 255).astype(np.float32)
            z = np.where(s > 0, np.clip(np.rint(-lo / s.astype(np.float64)), 0, 255) + 0.0, 0).astype(np.float32)
            q = np.clip(np.rint(u / s[..., None].astype(np.float64)) + z[..., None], 0, 255)
        q = np.where(s[..., None] > 0, q, 0).reshape(x.shape).astype(dtype)
    shape = x.shape[:-1] + ((groups,) if groups > 1 else ())
    s, z = s.reshape(shape), z.reshape(shape)
    return (q, s) if dtype == "int8" else (q, s, z)


def bits(a):
    return np.ascontiguousarray(a).view(np.uint8)


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("xdtype", [np.float32, np.float64, np.float16, BF16])
@pytest.mark.parametrize("shape,groups", [((2, 3, 97, 16), 1), ((2, 3, 5, 16), 4), ((1025, 8), 2), ((7,), 7),
                                          ((1, 1, 1, 1), 1)])
def test_quantize_kv_is_the_rule_bitwise_and_round_trips(dtype, xdtype, shape, groups):
    rng = np.random.default_rng(30)
    x = (rng.standard_normal(shape) * 3 + (2 if dtype == "uint8" else 0)).astype(xdtype)
    got, want = sdpa.quantize_kv(x, dtype, groups=groups), twin(x, dtype, groups)
    assert len(got) == (2 if dtype == "int8" else 3)
    assert got[0].dtype == np.dtype(dtype) and got[0].shape == x.shape
    for g, w in zip(got, want):
        assert g.shape == w.shape and g.dtype == w.dtype
        np.testing.assert_array_equal(bits(g), bits(w))
    # The round trip: within s · (1/2 + 2^-15) (tests/quantize_test.cc derives it).
    s = got[1] if groups > 1 else got[1][..., None]
    d = shape[-1]
    bound = np.repeat(s.astype(np.float64), d // groups, axis=-1) * (0.5 + 2.0**-15)
    err = np.abs(x.astype(np.float64) - dequantised(*got).astype(np.float64))
    assert (err <= bound).all()


def test_quantize_kv_hand_computed():
    values, scale = sdpa.quantize_kv(np.array([127, -3.5, 2.5, 0.4, -0.5], np.float32))
    np.testing.assert_array_equal(values, [127, -4, 2, 0, 0])  # rne: 2.5 -> 2, -3.5 -> -4
    assert scale == 1.0 and scale.shape == ()
    values, scale, zero = sdpa.quantize_kv([[-255, -100.5, -1], [0, 0, 0]], "uint8")
    np.testing.assert_array_equal(values, [[0, 155, 254], [0, 0, 0]])  # negative only: z = 255
    np.testing.assert_array_equal(scale, [1, 0])
    np.testing.assert_array_equal(zero, [255, 0])
    assert not np.signbit(zero).any()


def test_quantize_kv_errors():
    x = np.ones((2, 8), np.float32)
    with pytest.raises(TypeError, match="dtype must be 'int8' or 'uint8'"):
        sdpa.quantize_kv(x, "int4")
    with pytest.raises(ValueError, match="groups=3 must divide x's last dim D = 8"):
        sdpa.quantize_kv(x, groups=3)
    with pytest.raises(ValueError, match="groups must be an integer in"):
        sdpa.quantize_kv(x, groups=0)
    with pytest.raises(ValueError, match="x has shape"):
        sdpa.quantize_kv(np.float32(1.0))
    with pytest.raises(TypeError, match="x has dtype complex"):
        sdpa.quantize_kv(x.astype(np.complex64))
    x[1, 5] = np.inf
    with pytest.raises(ValueError, match="x holds inf in row 1.*feature 5"):
        sdpa.quantize_kv(x, "uint8")
    with pytest.raises(ValueError, match="beyond float32"):
        sdpa.quantize_kv(np.array([1e300, 1.0]))


@pytest.mark.parametrize("dtype,groups", [("int8", 1), ("uint8", 1), ("int8", 4), ("uint8", 2)])
def test_kv_cache_pools_hold_quantize_kv(dtype, groups):
    rng = np.random.default_rng(1)
    hkv, dk, dv, page = 2, 16, 8, 4
    cache = sdpa.KVCache(16, page, hkv, dk, dv, dtype=dtype, quant_groups=groups)
    assert cache.dtype == np.dtype(dtype) and cache.quant_groups == groups
    tail = (hkv, groups) if groups > 1 else (hkv,)
    assert cache.k_scale.shape == (16, page) + tail and cache.k_scale.dtype == np.float32
    assert cache.v_scale.shape == (16, page) + tail
    assert (cache.k_zero is None) == (dtype == "int8")
    assert cache.k_pages.dtype == np.dtype(dtype) and cache.k_pages.shape == (16, page, hkv, dk)
    s = cache.new_sequence()
    ks, vs = [], []
    for n, xdtype in ((6, np.float32), (1, BF16), (3, np.float16), (2, np.float64)):
        k = rng.standard_normal((n, hkv, dk)).astype(xdtype)
        v = rng.standard_normal((n, hkv, dv)).astype(xdtype)
        cache.append(s, k, v)
        # float64 is converted to float32 first (the cache quantises float32, float16, bfloat16).
        ks.append(k.astype(np.float32) if xdtype == np.float64 else k)
        vs.append(v.astype(np.float32) if xdtype == np.float64 else v)
    pages = cache.pages(s)
    j = 0
    for k, v in zip(ks, vs):
        for i in range(k.shape[0]):
            p, r = pages[j // page], j % page
            for rows, pool, scale, zero in ((k[i], cache.k_pages, cache.k_scale, cache.k_zero),
                                            (v[i], cache.v_pages, cache.v_scale, cache.v_zero)):
                want = sdpa.quantize_kv(rows, dtype, groups=groups)
                np.testing.assert_array_equal(pool[p, r], want[0])
                np.testing.assert_array_equal(bits(scale[p, r]), bits(want[1]))
                if zero is not None:
                    np.testing.assert_array_equal(zero[p, r], want[2])
            j += 1
    # Views of the cache's memory: a later append shows in an array taken before it.
    scales = cache.k_scale
    before = scales.copy()
    cache.append(s, np.full((1, hkv, dk), 5, np.float32), np.ones((1, hkv, dv), np.float32))
    p, r = cache.pages(s)[j // page], j % page
    assert not np.array_equal(scales, before)
    assert (scales[p, r] == np.float32(5 / (127 if dtype == "int8" else 255))).all()


def test_kv_cache_errors_write_nothing():
    with pytest.raises(ValueError, match="quant_groups=3 must be at least 1 and divide head_dim_k=8"):
        sdpa.KVCache(4, 4, 1, 8, dtype="int8", quant_groups=3)
    with pytest.raises(ValueError, match="quant_groups=2 is for an 8-bit cache"):
        sdpa.KVCache(4, 4, 1, 8, quant_groups=2)
    with pytest.raises(TypeError, match="dtype must be float32, float64, float16, ml_dtypes.bfloat16, int8 or uint8"):
        sdpa.KVCache(4, 4, 1, 8, dtype="int16")
    assert sdpa.KVCache(4, 4, 1, 8).k_scale is None
    cache = sdpa.KVCache(4, 4, 1, 8, dtype="uint8")
    s = cache.new_sequence()
    k = np.ones((3, 1, 8), np.float32)
    cache.append(s, k, k)
    pools = [a.copy() for a in (cache.k_pages, cache.k_scale, cache.k_zero, cache.v_pages)]
    bad = k.copy()
    bad[2, 0, 7] = np.nan
    with pytest.raises(ValueError, match="v holds nan in row 2"):
        cache.append(s, k * 2, bad)
    assert cache.length(s) == 3 and cache.free_pages == 3
    for a, b in zip(pools, (cache.k_pages, cache.k_scale, cache.k_zero, cache.v_pages)):
        np.testing.assert_array_equal(a, b)


def test_attention_argument_errors():
    rng = np.random.default_rng(2)
    q = rng.standard_normal((1, 2, 3, 8)).astype(np.float32)
    k8, ks = sdpa.quantize_kv(rng.standard_normal((1, 2, 5, 8)))
    with pytest.raises(TypeError, match="k_scale has dtype float64, but an 8-bit cache's scales"):
        sdpa.attention(q, k8, k8, k_scale=ks.astype(np.float64), v_scale=ks)
    with pytest.raises(TypeError, match="k has dtype float32, but with k_scale and v_scale"):
        sdpa.attention(q, k8.astype(np.float32), k8, k_scale=ks, v_scale=ks)
    with pytest.raises(TypeError, match="v has dtype uint8 but k has int8"):
        sdpa.attention(q, k8, k8.view(np.uint8), k_scale=ks, v_scale=ks)
    with pytest.raises(ValueError, match="v_scale is missing"):
        sdpa.attention(q, k8, k8, k_scale=ks)
    with pytest.raises(TypeError, match="k_pages has dtype float32, but with k_scale and v_scale"):
        sdpa.attention_paged(q, np.zeros((2, 4, 2, 8), np.float32), np.zeros((2, 4, 2, 8), np.int8), [[0]], [3],
                             k_scale=np.zeros((2, 4, 2), np.float32), v_scale=np.zeros((2, 4, 2), np.float32))
    # Without scales integer k and v are numbers, converted to float64 as before.
    assert sdpa.attention(q, k8, k8).dtype == np.float64


def _kv8(rng, shape_k, shape_v, dtype, groups):
    k = sdpa.quantize_kv(rng.standard_normal(shape_k).astype(np.float32), dtype, groups=groups)
    v = sdpa.quantize_kv(rng.standard_normal(shape_v).astype(np.float32), dtype, groups=groups)
    kw = {"k_scale": k[1], "v_scale": v[1]}
    if dtype == "uint8":
        kw.update(k_zero=k[2], v_zero=v[2])
    return k, v, kw


@pytest.mark.parametrize("dtype,groups", [("int8", 1), ("uint8", 1), ("int8", 4), ("uint8", 2)])
@pytest.mark.parametrize("qdtype", [np.float32, BF16])
def test_attention_on_8bit_equals_attention_on_dequantised(dtype, groups, qdtype):
    rng = np.random.default_rng(3)
    q = rng.standard_normal((2, 4, 5, 16)).astype(qdtype)
    k, v, kw = _kv8(rng, (2, 2, 97, 16), (2, 2, 97, 8), dtype, groups)
    for causal in (False, True):
        got = sdpa.attention(q, k[0], v[0], causal=causal, **kw)
        # A 16-bit q is widened exactly and out rounded once (KVQuant): the float32 call's out
        # rounded to q's dtype (ml_dtypes rounds to nearest even).
        want = sdpa.attention(q.astype(np.float32), dequantised(*k), dequantised(*v), causal=causal).astype(qdtype)
        assert got.dtype == want.dtype == q.dtype
        np.testing.assert_array_equal(bits(got), bits(want))


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
def test_varlen_and_paged_on_8bit(dtype):
    rng = np.random.default_rng(4)
    hkv, dk, dv = 2, 16, 8
    k, v, kw = _kv8(rng, (12, hkv, dk), (12, hkv, dv), dtype, 1)
    q = rng.standard_normal((5, 4, dk)).astype(np.float32)
    cu_q, cu_k = [0, 2, 5], [0, 3, 12]
    got = sdpa.attention_varlen(q, k[0], v[0], cu_q, cu_k, causal=True, **kw)
    want = sdpa.attention_varlen(q, dequantised(*k), dequantised(*v), cu_q, cu_k, causal=True)
    np.testing.assert_array_equal(got, want)
    # KVCache.attention and attention_paged on its pools against attention on the dequantised
    # rows (the cache quantises exactly as quantize_kv: test_kv_cache_pools_hold_quantize_kv).
    cache = sdpa.KVCache(8, 4, hkv, dk, dv, dtype=dtype)
    s = cache.new_sequence()
    x_k, x_v = rng.standard_normal((10, hkv, dk)), rng.standard_normal((10, hkv, dv))
    cache.append(s, x_k, x_v)
    qc = rng.standard_normal((1, 4, 3, dk)).astype(np.float32)
    out = cache.attention(qc, [s], causal=True)
    kq = [a.astype(np.float32) for a in (x_k, x_v)]
    dense = [dequantised(*sdpa.quantize_kv(a, dtype)).transpose(1, 0, 2)[None] for a in kq]
    np.testing.assert_allclose(out, sdpa.attention(qc, *dense, causal=True), rtol=0, atol=2e-6)
    zeros = {"k_zero": cache.k_zero, "v_zero": cache.v_zero} if dtype == "uint8" else {}
    paged = sdpa.attention_paged(qc, cache.k_pages, cache.v_pages, [cache.pages(s)], [10], causal=True,
                                 k_scale=cache.k_scale, v_scale=cache.v_scale, **zeros)
    np.testing.assert_array_equal(out, paged)


def test_accuracy_report_helper():
    acc = accuracy
    rng = np.random.default_rng(5)
    q = rng.standard_normal((1, 4, 6, 16)).astype(np.float32)
    k = rng.standard_normal((1, 2, 33, 16)).astype(np.float32)
    v = rng.standard_normal((1, 2, 33, 16)).astype(np.float32)
    rows = acc.report(q, k, v)
    assert [r["cache"] for r in rows] == ["int8", "uint8", "int8 G=4", "uint8 G=4", "u8 OpenVINO rule"]
    for r in rows:
        # Normal keys and values, 8 bits: the output is close, and cosine similarity near 1.
        assert 0 < r["max_abs"] < 0.05 and 0 < r["rms_rel"] < 0.02 and r["cos_min"] > 0.999
    # Per group scales are at least as fine as per row ones here.
    assert rows[2]["rms_rel"] <= rows[0]["rms_rel"] * 1.2
    # The 8-bit cache gives the bits of attention on its dequantised values (the script's
    # --dequantised mode, and this file's own dequantised()).
    assert acc.report(q, k, v, via_dequantised=True) == rows
