"""sdpa.attention_backward: finite differences, the NumPy float64 reference, properties,
layouts, determinism and errors.

Tolerances
----------
Every comparison runs the library's backward on the (out, lse) that ``sdpa.attention``
returned, and compares dq, dk, dv with ``reference_attention_backward`` (reference.py: the
maths in float64, forward recomputed there), per gradient and per case:
float32: max |got - ref| <= 2 * max |naive32 - ref| + floor(eps32), where naive32 is
    ``naive_float32_attention_backward`` (the same simple algorithm, forward included, with
    every step in float32) on the same inputs: the float32 rule of test_attention.py.
float64: max |got - ref| <= max(1e-12 * max(1, max |ref|),
                                3 * (eps64 / eps32) * max |naive32 - ref| + floor(eps64)):
    the fixed 1e-12 of test_attention.py, or the naive float32 error scaled to float64's unit
    roundoff where the problem is worse conditioned (sharp softmax, long rows).
floor(eps) = eps * (4 * max(1, max |ref|) + 2 * max |lse| * max |ref| + M) is
``reference.backward_floors``: the result's rounding, the relative error of P read through the
given (rounded) lse, and the size M of the terms that cancel in dS = P * (dP - D). The naive
version has neither of the last two errors when it is lucky (it recomputes its softmax; with
one allowed key per row it gets dP - D = 0 exactly), a correct fused kernel does.
NaN never passes.
"""


import numpy as np
import pytest

import sdpa
from reference import (case_seed, case_shapes, EPS32, assert_close, backward_floors, finite_max_abs, float64_tolerance, max_error,
                       naive_float32_attention_backward, reference_attention_backward)

EPS64 = float(np.finfo(np.float64).eps)
GRADS = ("dq", "dk", "dv")


_seed, _shapes = case_seed, case_shapes


def make_case(rng, rank, B=1, Hq=1, Hkv=1, Nq=4, Nk=4, Dk=8, Dv=8, dtype=np.float64, amp=1.0):
    """q, k, v and an incoming gradient dout (shaped like out), normal values."""
    sq, sk, sv, so = _shapes(rank, B, Hq, Hkv, Nq, Nk, Dk, Dv)
    q = (rng.standard_normal(sq) * amp).astype(dtype)
    k = (rng.standard_normal(sk) * amp).astype(dtype)
    v = rng.standard_normal(sv).astype(dtype)
    dout = rng.standard_normal(so).astype(dtype)
    return q, k, v, dout


def forward_backward(dout, q, k, v, mask=None, backend="auto", **opts):
    """The library's (out, lse) and then its (dq, dk, dv), as a user would chain them."""
    out, lse = sdpa.attention(q, k, v, mask, return_lse=True, **opts)
    return sdpa.attention_backward(dout, q, k, v, out, lse, mask, backend=backend, **opts)


def tolerances(dout, q, k, v, mask=None, **opts):
    """(reference grads, tolerances) per gradient, by the rule of the module docstring."""
    ref = reference_attention_backward(dout, q, k, v, mask, **opts)
    naive = naive_float32_attention_backward(dout, q, k, v, mask, **opts)
    dtype = np.result_type(*(np.asarray(x).dtype for x in (q, k, v)))
    if dtype == np.float32:
        floors = backward_floors(dout, q, k, v, mask, eps=EPS32, **opts)
        tols = [2 * max_error(n, r) + f for n, r, f in zip(naive, ref, floors)]
    else:
        floors = backward_floors(dout, q, k, v, mask, eps=EPS64, **opts)
        tols = [max(float64_tolerance(r), 3 * EPS64 / EPS32 * max_error(n, r) + f)
                for n, r, f in zip(naive, ref, floors)]
    return ref, tols


def check_backward(dout, q, k, v, mask=None, backend="auto", **opts):
    """Runs forward + backward and compares dq, dk, dv with the oracle. Returns the grads."""
    got = forward_backward(dout, q, k, v, mask, backend=backend, **opts)
    ref, tols = tolerances(dout, q, k, v, mask, **opts)
    dtype = np.result_type(*(np.asarray(x).dtype for x in (q, k, v)))
    for name, g, r, t, like in zip(GRADS, got, ref, tols, (q, k, v)):
        assert g.dtype == dtype, f"{name} dtype {g.dtype}, want {dtype}"
        assert g.shape == np.shape(like), f"{name} shape {g.shape}, want {np.shape(like)}"
        assert_close(g, r, t, f"{backend} {name}")
    return got


# ---------------------------------------------------------------- the reference itself


def test_reference_backward_matches_a_hand_computed_case():
    # One query, two keys, Dk = Dv = 1, scale 1: s = (q k0, q k1) = (0, 1) with q = 1,
    # k = (0, 1), v = (2, 5), dout = 1. P = (1 - a, a) with a = e / (1 + e).
    # out = 2 + 3a; dv = P; dP = (2, 5); D = out; dS = P * (dP - out) = (-(1-a) 3a, a 3(1-a)).
    # dq = dS · k = 3a(1-a); dk = dS · q = (-3a(1-a), 3a(1-a)).
    a = np.e / (1 + np.e)
    dq, dk, dv = reference_attention_backward(np.ones((1, 1)), np.ones((1, 1)), np.array([[0.0], [1.0]]),
                                              np.array([[2.0], [5.0]]), scale=1.0)
    np.testing.assert_allclose(dq, [[3 * a * (1 - a)]], rtol=1e-15)
    np.testing.assert_allclose(dk, [[-3 * a * (1 - a)], [3 * a * (1 - a)]], rtol=1e-15)
    np.testing.assert_allclose(dv, [[1 - a], [a]], rtol=1e-15)


# ---------------------------------------------------------------- finite differences


def _numerical_grads(dout, q, k, v, mask, h=1e-5, **opts):
    """Central differences of f = sum(attention(q, k, v) * dout) (float64, the library's
    forward), element by element: ∂f/∂x = (f(x + h) - f(x - h)) / 2h."""
    def f(qq, kk, vv):
        return float(np.sum(sdpa.attention(qq, kk, vv, mask, **opts) * dout))

    grads = []
    for which in range(3):
        arrays = [q.copy(), k.copy(), v.copy()]
        x = arrays[which]
        g = np.zeros_like(x)
        for idx in np.ndindex(x.shape):
            old = x[idx]
            x[idx] = old + h
            fp = f(*arrays)
            x[idx] = old - h
            fm = f(*arrays)
            x[idx] = old
            g[idx] = (fp - fm) / (2 * h)
        grads.append(g)
    return grads


FD_CASES = [
    # (rank, B, Hq, Hkv, Nq, Nk, Dk, Dv), options
    pytest.param((2, 1, 1, 1, 3, 4, 3, 2), dict(), id="r2-plain"),
    pytest.param((2, 1, 1, 1, 4, 3, 2, 3), dict(scale=0.7), id="r2-scale"),
    pytest.param((3, 1, 4, 2, 3, 5, 2, 2), dict(causal=True), id="r3-GQA-causalBR"),
    pytest.param((4, 2, 3, 1, 2, 4, 2, 3), dict(causal="top_left"), id="r4-MQA-causalTL"),
    pytest.param((3, 1, 2, 2, 4, 5, 3, 2), dict(window=(1, 1)), id="r3-window"),
    pytest.param((2, 1, 1, 1, 4, 5, 3, 2), dict(mask="bool"), id="r2-bool-mask-empty-row"),
    pytest.param((3, 1, 2, 1, 3, 4, 2, 2), dict(mask="float"), id="r3-additive-mask"),
]


def _fd_mask(kind, rng, nq, nk):
    if kind == "bool":
        m = rng.random((nq, nk)) < 0.6
        m[0, 0] = True
        m[1] = False  # a fully masked row
        return m
    m = rng.standard_normal((nq, nk))
    m[0, 1] = -np.inf
    return m


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("shape,opts", FD_CASES)
def test_finite_differences(shape, opts, backend):
    # The gradients of the linear functional sum(out * dout) are exactly what the backward
    # returns for that dout: compare with central differences of the float64 forward.
    rank, B, Hq, Hkv, Nq, Nk, Dk, Dv = shape
    rng = np.random.default_rng(_seed("fd", shape, sorted(opts.items())))
    q, k, v, dout = make_case(rng, rank, B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, Dk=Dk, Dv=Dv)
    opts = dict(opts)
    mask = _fd_mask(opts.pop("mask"), rng, Nq, Nk) if "mask" in opts else None
    got = forward_backward(dout, q, k, v, mask, backend=backend, **opts)
    want = _numerical_grads(dout, q, k, v, mask, **opts)
    for name, g, w in zip(GRADS, got, want):
        # h^2 truncation and eps / h rounding are both ~1e-10 here; a wrong factor is ~0.1.
        assert_close(g, w, 1e-7 * max(1.0, finite_max_abs(w)), f"{name} vs finite differences")
        assert finite_max_abs(w) > 1e-3, f"{name}: the case has no gradient to check"


# ---------------------------------------------------------------- against the reference


SHAPES = [
    # rank, B, Hq, Hkv, Nq, Nk, Dk, Dv
    pytest.param((2, 1, 1, 1, 5, 7, 8, 3), id="r2-Nq<Nk-Dv<Dk"),
    pytest.param((2, 1, 1, 1, 9, 4, 5, 11), id="r2-Nq>Nk-Dv>Dk"),
    pytest.param((2, 1, 1, 1, 1, 1, 1, 1), id="r2-all-ones"),
    pytest.param((2, 1, 1, 1, 1, 37, 16, 16), id="r2-one-query"),
    pytest.param((3, 1, 4, 4, 6, 6, 8, 8), id="r3-MHA"),
    pytest.param((3, 1, 4, 2, 6, 9, 8, 5), id="r3-GQA"),
    pytest.param((3, 1, 5, 1, 3, 8, 7, 2), id="r3-MQA"),
    pytest.param((4, 2, 6, 3, 5, 10, 16, 12), id="r4-GQA"),
    pytest.param((4, 3, 2, 1, 7, 3, 4, 6), id="r4-MQA"),
    pytest.param((4, 2, 4, 4, 33, 130, 64, 64), id="r4-d64-two-key-tiles"),
    pytest.param((3, 1, 2, 2, 17, 67, 13, 9), id="r3-odd-dims"),
    pytest.param((2, 1, 1, 1, 150, 300, 128, 32), id="r2-d128-two-query-tiles"),
    pytest.param((3, 1, 4, 1, 140, 40, 8, 8), id="r3-MQA-long-queries"),
]


def _case(shape):
    rank, B, Hq, Hkv, Nq, Nk, Dk, Dv = shape
    return dict(rank=rank, B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, Dk=Dk, Dv=Dv)


@pytest.mark.parametrize("backend", ["auto", "flash"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("shape", SHAPES)
def test_matches_reference(shape, dtype, backend):
    rng = np.random.default_rng(_seed("plain", shape, dtype))
    q, k, v, dout = make_case(rng, **_case(shape), dtype=dtype)
    check_backward(dout, q, k, v, backend=backend)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True, "top_left"])
def test_all_backends(causal, dtype):
    rng = np.random.default_rng(_seed("backends", causal, dtype))
    q, k, v, dout = make_case(rng, 4, B=2, Hq=4, Hkv=2, Nq=13, Nk=29, Dk=32, Dv=16, dtype=dtype)
    results = {b: check_backward(dout, q, k, v, backend=b, causal=causal)
               for b in ("auto", "flash", "reference", "naive")}
    # "auto" is today "flash": the same numbers.
    for a, b in zip(results["auto"], results["flash"]):
        np.testing.assert_array_equal(a, b)
    if dtype == np.float32:
        # The reference backend computes in float64 and rounds once: from the float32 out
        # it is given, it is at least as accurate as the naive float32 version.
        ref, _ = tolerances(dout, q, k, v, causal=causal)
        naive = naive_float32_attention_backward(dout, q, k, v, causal=causal)
        for name, g, r, n in zip(GRADS, results["reference"], ref, naive):
            assert max_error(g, r) <= max_error(n, r) + 4 * EPS32 * max(1.0, finite_max_abs(r)), name


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("amp,scale", [(1.0, 0.0), (1.0, -0.7), (1.0, 2.5), (3.0, None)])
def test_explicit_scale_and_sharp_softmax(amp, scale, dtype):
    rng = np.random.default_rng(_seed("scale", amp, scale, dtype))
    q, k, v, dout = make_case(rng, 3, Hq=2, Hkv=1, Nq=20, Nk=33, Dk=16, Dv=8, dtype=dtype, amp=amp)
    dq, dk, dv = check_backward(dout, q, k, v, scale=scale)
    if scale == 0.0:
        # Uniform weights: dv is the mean of dout over the queries, summed over the group;
        # scale 0 multiplies dq and dk.
        assert (dq == 0).all() and (dk == 0).all()
        assert_close(dv, np.broadcast_to(dout.sum(axis=(0, 1)) / 33, dv.shape), 1e-5)
    elif scale is not None:
        default = forward_backward(dout, q, k, v)
        assert np.abs(dq - default[0]).max() > 1e-3  # the scale is used


# ---------------------------------------------------------------- masks, causal, windows


def _random_mask(rng, shape, kind, dtype):
    if kind == "bool":
        m = rng.random(shape) < 0.7
        m.flat[0] = False
        return m
    m = rng.standard_normal(shape) * 2.0
    m[rng.random(shape) < 0.25] = -np.inf
    m.flat[0] = -np.inf
    return m.astype(dtype)


MASK_SHAPES = [
    pytest.param(2, lambda B, H, Nq, Nk: (Nq, Nk), id="r2-(Nq,Nk)"),
    pytest.param(2, lambda B, H, Nq, Nk: (Nk,), id="r2-(Nk,)"),
    pytest.param(3, lambda B, H, Nq, Nk: (H, Nq, Nk), id="r3-(Hq,Nq,Nk)"),
    pytest.param(3, lambda B, H, Nq, Nk: (H, 1, Nk), id="r3-(Hq,1,Nk)"),
    pytest.param(4, lambda B, H, Nq, Nk: (B, H, Nq, Nk), id="r4-full"),
    pytest.param(4, lambda B, H, Nq, Nk: (B, 1, 1, Nk), id="r4-(B,1,1,Nk)"),
    pytest.param(4, lambda B, H, Nq, Nk: (Nq, 1), id="r4-(Nq,1)"),
]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("kind", ["bool", "float"])
@pytest.mark.parametrize("rank,mask_shape", MASK_SHAPES)
def test_masks(rank, mask_shape, kind, dtype):
    B, Hq, Hkv, Nq, Nk = 2, 4, 2, 9, 37
    rng = np.random.default_rng(_seed("mask", rank, mask_shape(B, Hq, Nq, Nk), kind, dtype))
    q, k, v, dout = make_case(rng, rank, B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, Dk=8, Dv=6, dtype=dtype)
    mask = _random_mask(rng, mask_shape(B, Hq, Nq, Nk), kind, dtype)
    dq, dk, dv = check_backward(dout, q, k, v, mask)
    if mask.shape[-1] == Nk:  # the mask must change the gradients
        assert np.abs(dv - forward_backward(dout, q, k, v)[2]).max() > 1e-4


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [True, "bottom_right", "top_left"])
@pytest.mark.parametrize("nq,nk", [(6, 6), (3, 40), (40, 3), (1, 5), (5, 1), (70, 150)])
def test_causal(nq, nk, causal, dtype):
    rng = np.random.default_rng(_seed("causal", nq, nk, causal, dtype))
    q, k, v, dout = make_case(rng, 4, B=2, Hq=2, Hkv=1, Nq=nq, Nk=nk, Dk=8, Dv=5, dtype=dtype)
    dq, dk, dv = check_backward(dout, q, k, v, causal=causal)
    # A key that no query may see gets exactly zero gradient.
    seen = np.zeros(nk, bool)
    for i in range(nq):
        seen[: max(0, (i + nk - nq if causal != "top_left" else i) + 1)] = True
    assert (dk[..., ~seen, :] == 0).all() and (dv[..., ~seen, :] == 0).all()


@pytest.mark.parametrize("causal", [False, True, "top_left"])
@pytest.mark.parametrize("kind", ["bool", "float"])
def test_causal_with_mask_gqa(causal, kind):
    rng = np.random.default_rng(_seed("causal+mask", causal, kind))
    q, k, v, dout = make_case(rng, 4, B=2, Hq=4, Hkv=2, Nq=21, Nk=45, Dk=16, Dv=8)
    mask = _random_mask(rng, (2, 1, 21, 45), kind, np.float64)
    check_backward(dout, q, k, v, mask, causal=causal)


WINDOWS = [(0, 0), (2, 0), (1, 1), (3, 2), (None, 2), (1, None), (0, 100), (100, 0), (40, 3)]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("window", WINDOWS, ids=str)
@pytest.mark.parametrize("nq,nk", [(7, 7), (3, 50), (50, 3), (65, 65)])
def test_window(nq, nk, window, dtype):
    rng = np.random.default_rng(_seed("window", nq, nk, window, dtype))
    q, k, v, dout = make_case(rng, 3, Hq=2, Hkv=2, Nq=nq, Nk=nk, Dk=8, Dv=4, dtype=dtype)
    check_backward(dout, q, k, v, window=window)


@pytest.mark.parametrize("causal", [True, "top_left"])
@pytest.mark.parametrize("window", [(2, 0), (1, 3), (None, 2)], ids=str)
def test_window_with_causal_and_mask(causal, window):
    rng = np.random.default_rng(_seed("window+causal", causal, window))
    q, k, v, dout = make_case(rng, 4, B=2, Hq=2, Hkv=1, Nq=6, Nk=8, Dk=8, Dv=3)
    mask = _random_mask(rng, (6, 8), "bool", np.float64)
    check_backward(dout, q, k, v, mask, causal=causal, window=window)


# ---------------------------------------------------------------- empty rows and dims


def _assert_zero_rows(dq, dk, dv, empty_rows, unseen_keys):
    for name, g in zip(GRADS, (dq, dk, dv)):
        assert not np.isnan(g).any(), f"{name} has NaN"
    assert (dq[..., empty_rows, :] == 0).all(), "dq of a row without keys must be exactly 0"
    assert (dk[..., unseen_keys, :] == 0).all(), "dk of a key nobody sees must be exactly 0"
    assert (dv[..., unseen_keys, :] == 0).all(), "dv of a key nobody sees must be exactly 0"


@pytest.mark.parametrize("backend", ["auto", "reference", "naive"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("how", ["bool", "float-inf", "causal-Nq>Nk", "window"])
def test_fully_masked_rows(how, dtype, backend):
    rng = np.random.default_rng(_seed("empty rows", how, dtype))
    Nq, Nk = 40, 19
    q, k, v, dout = make_case(rng, 3, Hq=2, Hkv=1, Nq=Nq, Nk=Nk, Dk=8, Dv=3, dtype=dtype)
    mask, causal, window = None, False, None
    unseen = []
    if how == "bool":
        mask = rng.random((Nq, Nk)) < 0.8
        mask[[1, 4, 33]] = False
        mask[:, [5, 18]] = False  # keys nobody sees
        rows, unseen = [1, 4, 33], [5, 18]
    elif how == "float-inf":
        mask = rng.standard_normal((2, Nq, Nk)).astype(dtype)
        mask[:, [0, 39]] = -np.inf
        mask[:, :, 7] = -np.inf
        rows, unseen = [0, 39], [7]
    elif how == "causal-Nq>Nk":
        causal = True  # query i sees keys j <= i - 21: rows 0..20 see nothing
        rows = list(range(21))
    else:
        window = (0, 0)  # query i sees key i - 21 only
        rows = list(range(21))
    out, lse = sdpa.attention(q, k, v, mask, causal=causal, window=window, return_lse=True)
    assert np.isneginf(lse[:, rows]).all()
    dq, dk, dv = sdpa.attention_backward(dout, q, k, v, out, lse, mask, causal=causal, window=window,
                                         backend=backend)
    _assert_zero_rows(dq, dk, dv, rows, unseen)
    check_backward(dout, q, k, v, mask, causal=causal, window=window, backend=backend)


@pytest.mark.parametrize("backend", ["auto", "reference"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_everything_masked(dtype, backend):
    rng = np.random.default_rng(16)
    q, k, v, dout = make_case(rng, 4, B=2, Hq=2, Hkv=1, Nq=3, Nk=5, dtype=dtype)
    for mask in (np.zeros((3, 5), bool), np.full((3, 5), -np.inf)):
        dq, dk, dv = forward_backward(dout, q, k, v, mask, backend=backend)
        for g in (dq, dk, dv):
            np.testing.assert_array_equal(g, np.zeros_like(g))


@pytest.mark.parametrize("backend", ["auto", "reference", "naive"])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("rank", [2, 3, 4])
def test_nk_zero(rank, dtype, backend):
    # No keys: every row is empty, dq = 0; dk and dv are empty.
    q, k, v, dout = make_case(np.random.default_rng(17), rank, B=2, Hq=2, Hkv=1, Nq=3, Nk=0, Dk=4, Dv=5, dtype=dtype)
    dq, dk, dv = forward_backward(dout, q, k, v, backend=backend)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    assert dq.dtype == dtype and dk.dtype == dtype and dv.dtype == dtype
    np.testing.assert_array_equal(dq, np.zeros_like(dq))


@pytest.mark.parametrize("backend", ["auto", "reference", "naive"])
@pytest.mark.parametrize("rank", [2, 3, 4])
def test_nq_zero(rank, backend):
    # No queries: nothing depends on k and v, so dk = dv = 0 (written, not left empty).
    q, k, v, dout = make_case(np.random.default_rng(18), rank, B=2, Hq=2, Hkv=1, Nq=0, Nk=3, Dk=4, Dv=5)
    dq, dk, dv = forward_backward(dout, q, k, v, backend=backend)
    assert dq.shape == q.shape and dk.shape == k.shape and dv.shape == v.shape
    np.testing.assert_array_equal(dk, np.zeros_like(dk))
    np.testing.assert_array_equal(dv, np.zeros_like(dv))


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_zero_sized_other_dims(backend):
    rng = np.random.default_rng(19)
    q, k, v, dout = make_case(rng, 4, B=0, Hq=2, Hkv=1, Nq=3, Nk=3, Dk=4, Dv=5)
    assert [g.shape for g in forward_backward(dout, q, k, v, backend=backend)] == [q.shape, k.shape, v.shape]
    # Dv = 0: out is empty, so every gradient is 0.
    q, k, v, dout = make_case(rng, 2, Nq=3, Nk=4, Dk=4, Dv=0)
    dq, dk, dv = forward_backward(dout, q, k, v, backend=backend)
    assert dv.shape == (4, 0)
    np.testing.assert_array_equal(dq, np.zeros_like(dq))
    np.testing.assert_array_equal(dk, np.zeros_like(dk))
    # Dk = 0: every score is 0 (uniform weights, scale 1); dv is still the mean of dout.
    q, k, v, dout = make_case(rng, 2, Nq=3, Nk=4, Dk=0, Dv=2)
    dq, dk, dv = forward_backward(dout, q, k, v, backend=backend)
    assert dq.shape == (3, 0) and dk.shape == (4, 0)
    assert_close(dv, np.broadcast_to(dout.sum(axis=0) / 4, (4, 2)), 1e-15)


# ---------------------------------------------------------------- properties


def test_gqa_gradients_are_sums_over_repeated_heads():
    # dk, dv of GQA = the per-head gradients of MHA with kv heads repeated, summed over the
    # group (and not over tiled heads h % Hkv).
    rng = np.random.default_rng(20)
    q, k, v, dout = make_case(rng, 4, B=2, Hq=6, Hkv=2, Nq=5, Nk=8, Dk=8, Dv=3)
    dq, dk, dv = forward_backward(dout, q, k, v)
    mq, mk, mv = forward_backward(dout, q, np.repeat(k, 3, axis=1), np.repeat(v, 3, axis=1))
    assert_close(dq, mq, 1e-12, "dq")
    assert_close(dk, mk.reshape(2, 2, 3, 8, 8).sum(axis=2), 1e-12, "dk")
    assert_close(dv, mv.reshape(2, 2, 3, 8, 3).sum(axis=2), 1e-12, "dv")
    tiled = forward_backward(dout, q, np.tile(k, (1, 3, 1, 1)), np.tile(v, (1, 3, 1, 1)))
    assert np.abs(tiled[1].reshape(2, 3, 2, 8, 8).sum(axis=1) - dk).max() > 1e-3


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_softmax_shift_invariance(dtype):
    # Softmax ignores a per-row constant: adding c to every key shifts row i's scores by
    # q_i·c, so Σ_j dk_j = 0 for each kv head. The rows of P sum to 1, so Σ_j dv_j = Σ_i dout_i
    # over the group's rows; and linearity in dout.
    rng = np.random.default_rng(_seed("shift", dtype))
    q, k, v, dout = make_case(rng, 4, B=2, Hq=4, Hkv=2, Nq=23, Nk=41, Dk=16, Dv=8, dtype=dtype)
    dq, dk, dv = forward_backward(dout, q, k, v, causal="top_left")
    tol = 1e-11 if dtype == np.float64 else 1e-4
    scale = float(np.abs(dk).max())
    assert np.abs(dk.sum(axis=2)).max() <= tol * scale * 41
    want_dv = dout.reshape(2, 2, 2, 23, 8).sum(axis=(2, 3))
    assert_close(dv.sum(axis=2, dtype=np.float64), want_dv, tol * 41 * float(np.abs(dout).max()))
    doubled = forward_backward(2 * dout, q, k, v, causal="top_left")
    for g, g2 in zip((dq, dk, dv), doubled):
        np.testing.assert_array_equal(2 * g, g2)  # multiplying by 2 is exact


def test_zero_dout_gives_zero_gradients():
    rng = np.random.default_rng(21)
    q, k, v, dout = make_case(rng, 3, Hq=2, Hkv=1, Nq=9, Nk=40, Dk=8, Dv=4)
    for g in forward_backward(np.zeros_like(dout), q, k, v, causal=True):
        np.testing.assert_array_equal(g, np.zeros_like(g))


# ---------------------------------------------------------------- layouts and dtypes


def _views(rng, shape, dtype):
    """Non-contiguous views of `shape` (unit last stride, as q, k, v, out, dout need)."""
    B, H, N, D = shape

    def randn(*s):
        return rng.standard_normal(s).astype(dtype)

    return [
        ("rows-step-2", randn(B, H, 2 * N, D)[:, :, ::2]),
        ("BNHD-transposed", randn(B, N, H, D).transpose(0, 2, 1, 3)),
        ("reversed-rows", randn(B, H, N, D)[:, :, ::-1]),
        ("heads-reversed", randn(B, H, N, D)[:, ::-1]),
        ("cols-slice", randn(B, H, N, 2 * D)[..., 3:3 + D]),
        ("cols-step-2 (copied)", randn(B, H, N, 2 * D)[..., ::2]),
    ]


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("which", ["q", "k", "v", "dout", "out"])
def test_noncontiguous_inputs_match_contiguous_copies(which, dtype):
    rng = np.random.default_rng(_seed("layout", which, dtype))
    B, Hq, Hkv, Nq, Nk, Dk, Dv = 2, 4, 2, 37, 45, 6, 6
    q, k, v, dout = make_case(rng, 4, B=B, Hq=Hq, Hkv=Hkv, Nq=Nq, Nk=Nk, Dk=Dk, Dv=Dv, dtype=dtype)
    dims = {"q": (B, Hq, Nq, Dk), "k": (B, Hkv, Nk, Dk), "v": (B, Hkv, Nk, Dv), "dout": (B, Hq, Nq, Dv),
            "out": (B, Hq, Nq, Dv)}[which]
    for name, view in _views(rng, dims, dtype):
        assert not view.flags.c_contiguous, name
        args = dict(q=q, k=k, v=v, dout=dout)
        if which != "out":
            args[which] = view
        out, lse = sdpa.attention(args["q"], args["k"], args["v"], causal=True, return_lse=True)
        if which == "out":
            view[...] = out  # the same values in a strided layout
            out = view
        got = sdpa.attention_backward(args["dout"], args["q"], args["k"], args["v"], out, lse, causal=True)
        contiguous = [np.ascontiguousarray(x) for x in (args["dout"], args["q"], args["k"], args["v"], out, lse)]
        want = sdpa.attention_backward(*contiguous, causal=True)
        for g, w, n in zip(got, want, GRADS):
            assert g.flags.c_contiguous
            np.testing.assert_array_equal(g, w, err_msg=f"{name} {n}")
    check_backward(args["dout"], args["q"], args["k"], args["v"], causal=True)


@pytest.mark.parametrize("dtype", [np.float64, np.float32])
def test_strided_lse_and_broadcast_inputs(dtype):
    # lse may have any strides (it is passed without a copy); zero strides (np.broadcast_to,
    # read-only views) are ordinary inputs.
    rng = np.random.default_rng(_seed("lse strides", dtype))
    q, k, v, dout = make_case(rng, 4, B=3, Hq=2, Hkv=2, Nq=20, Nk=35, Dk=8, Dv=4, dtype=dtype)
    out, lse = sdpa.attention(q, k, v, return_lse=True)
    want = sdpa.attention_backward(dout, q, k, v, out, lse)
    for step in (2, -2):
        big = np.full((3, 2, 40), np.nan, dtype)  # NaN between the elements: a stray read shows
        strided = big[..., ::step]
        strided[...] = lse
        assert strided.strides[-1] == step * strided.itemsize
        got = sdpa.attention_backward(dout, q, k, v, out, strided)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g, w)
    lse_t = np.ascontiguousarray(lse.transpose(2, 0, 1)).transpose(1, 2, 0)
    for g, w in zip(sdpa.attention_backward(dout, q, k, v, out, lse_t), want):
        np.testing.assert_array_equal(g, w)

    kb = np.broadcast_to(k[:1], k.shape)
    db = np.broadcast_to(dout[:, :, :1], dout.shape)
    out_b, lse_b = sdpa.attention(q, kb, v, return_lse=True)
    got = sdpa.attention_backward(db, q, kb, v, out_b, lse_b)
    want = sdpa.attention_backward(db.copy(), q, kb.copy(), v, out_b, lse_b)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g, w)
    ro = [x.copy() for x in (dout, q, k, v, out, lse)]
    for x in ro:
        x.flags.writeable = False
    for g, w in zip(sdpa.attention_backward(*ro), sdpa.attention_backward(dout, q, k, v, out, lse)):
        np.testing.assert_array_equal(g, w)


def test_inputs_are_not_modified():
    rng = np.random.default_rng(22)
    q, k, v, dout = make_case(rng, 3, Hq=2, Hkv=1, Nq=4, Nk=6)
    mask = rng.standard_normal((4, 6))
    out, lse = sdpa.attention(q, k, v, mask, causal=True, return_lse=True)
    args = (dout, q, k, v, out, lse, mask)
    copies = [x.copy() for x in args]
    sdpa.attention_backward(*args, causal=True)
    for x, c in zip(args, copies):
        np.testing.assert_array_equal(x, c)


@pytest.mark.parametrize("qkv,grads,expect", [
    (np.float32, np.float32, np.float32),
    (np.float32, np.float64, np.float32),  # dout, out, lse follow q, k, v: converted
    (np.float64, np.float32, np.float64),
    (np.float16, np.float32, np.float16),  # float16 q, k, v: float16 gradients (more in test_lowp.py)
    (np.int64, np.float64, np.float64),
    (np.float64, np.int64, np.float64),
])
def test_result_dtype(qkv, grads, expect):
    rng = np.random.default_rng(23)
    q, k, v = (rng.integers(-3, 4, size=s).astype(qkv) for s in [(4, 3), (5, 3), (5, 2)])
    dout = rng.integers(-3, 4, size=(4, 2)).astype(grads)
    out, lse = sdpa.attention(q, k, v, return_lse=True)
    dq, dk, dv = sdpa.attention_backward(dout, q, k, v, out.astype(grads), lse.astype(grads))
    assert dq.dtype == expect and dk.dtype == expect and dv.dtype == expect
    lse_dtype = np.float32 if expect == np.float16 else expect  # lse is in the compute dtype
    same = sdpa.attention_backward(*(np.asarray(x).astype(expect) for x in (dout, q, k, v, out.astype(grads))),
                                   lse.astype(grads).astype(lse_dtype))
    for g, s in zip((dq, dk, dv), same):
        np.testing.assert_array_equal(g, s)


def test_nested_lists():
    q = [[1, 0, 2], [0.5, -1, 0]]
    k = [[1, 1, 0], [0, 2, 1], [-1, 0, 1]]
    v = [[1, 2], [3, 4], [5, 6]]
    out, lse = sdpa.attention(q, k, v, return_lse=True)
    dout = [[1.0, -1.0], [0.5, 2.0]]
    got = sdpa.attention_backward(dout, q, k, v, out.tolist(), lse.tolist())
    want = reference_attention_backward(dout, q, k, v)
    for g, w in zip(got, want):
        assert isinstance(g, np.ndarray) and g.dtype == np.float64
        assert_close(g, w, 1e-14)


# ---------------------------------------------------------------- determinism


@pytest.fixture
def restore_threads():
    before = sdpa.num_threads()
    yield
    sdpa.set_num_threads(0)
    assert sdpa.num_threads() == before


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_thread_count_does_not_change_results(dtype, restore_threads):
    # Bitwise identical for any thread count: many key blocks and query blocks (GQA, causal,
    # a mask), shared among 1, 2 and 3 threads.
    rng = np.random.default_rng(_seed("threads", dtype))
    q, k, v, dout = make_case(rng, 4, B=2, Hq=8, Hkv=2, Nq=70, Nk=300, Dk=64, Dv=32, dtype=dtype)
    mask = _random_mask(rng, (70, 300), "float", dtype)
    out, lse = sdpa.attention(q, k, v, mask, causal=True, return_lse=True)
    results = []
    for n in (1, 2, 3):
        sdpa.set_num_threads(n)
        assert sdpa.num_threads() == n
        results.append(sdpa.attention_backward(dout, q, k, v, out, lse, mask, causal=True))
    for other in results[1:]:
        for a, b, name in zip(results[0], other, GRADS):
            np.testing.assert_array_equal(a, b, err_msg=name)
    check_backward(dout, q, k, v, mask, causal=True)


def test_repeated_calls_are_bitwise_identical():
    rng = np.random.default_rng(24)
    q, k, v, dout = make_case(rng, 4, B=2, Hq=4, Hkv=2, Nq=31, Nk=77, Dk=64, Dv=64, dtype=np.float32)
    out, lse = sdpa.attention(q, k, v, causal=True, return_lse=True)
    first = sdpa.attention_backward(dout, q, k, v, out, lse, causal=True)
    for _ in range(3):
        again = sdpa.attention_backward(dout, q, k, v, out, lse, causal=True)
        for a, b in zip(first, again):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- errors


def _valid():
    rng = np.random.default_rng(0)
    q, k, v, dout = make_case(rng, 4, B=2, Hq=4, Hkv=2, Nq=3, Nk=5, Dk=8, Dv=6)
    out, lse = sdpa.attention(q, k, v, return_lse=True)
    return dict(dout=dout, q=q, k=k, v=v, out=out, lse=lse)


def test_valid_call_works():
    # The baseline every error test below perturbs in one way only.
    args = _valid()
    dq, dk, dv = sdpa.attention_backward(**args, mask=np.ones((3, 5), bool), causal=True, scale=0.5,
                                         window=(1, 1))
    assert dq.shape == (2, 4, 3, 8) and dk.shape == (2, 2, 5, 8) and dv.shape == (2, 2, 5, 6)


@pytest.mark.parametrize("which,bad,message", [
    ("dout", lambda a: a[..., :5], r"^dout has shape \(2, 4, 3, 5\) but must be \(2, 4, 3, 6\)"),
    ("dout", lambda a: a[0], r"^dout has shape \(4, 3, 6\) but must be \(2, 4, 3, 6\)"),
    ("dout", lambda a: a[:, :, :2], r"^dout has shape \(2, 4, 2, 6\)"),
    ("dout", lambda a: a[None], r"^dout has more than 4 dims"),
    ("out", lambda a: a[..., :5], r"^out has shape \(2, 4, 3, 5\) but must be \(2, 4, 3, 6\)"),
    ("out", lambda a: a[:1], r"^out has shape \(1, 4, 3, 6\)"),
    ("lse", lambda a: a[..., :2], r"^lse has shape \(2, 4, 2\) but must be \(2, 4, 3\)"),
    ("lse", lambda a: a[..., None], r"^lse has rank 4 but must have rank 1..3"),
    ("lse", lambda a: a[0, 0, 0], r"^lse has rank 0"),
    ("k", lambda a: a[..., :7], r"^k has Dk=7 but q has Dk=8"),
    ("v", lambda a: a[:, :1], r"^v has 1 heads but k has 2"),
])
def test_shape_errors_name_the_argument(which, bad, message):
    args = _valid()
    args[which] = bad(args[which])
    with pytest.raises(ValueError, match=message):
        sdpa.attention_backward(**args)


@pytest.mark.parametrize("which", ["dout", "out", "lse"])
@pytest.mark.parametrize("bad", ["complex", "string"])
def test_non_real_gradient_inputs_raise_type_error(which, bad):
    args = _valid()
    args[which] = args[which].astype(np.complex128 if bad == "complex" else str)
    with pytest.raises(TypeError, match=rf"^{which}\b"):
        sdpa.attention_backward(**args)


def test_option_errors_are_those_of_attention():
    args = _valid()
    with pytest.raises(ValueError, match=r"^causal must be"):
        sdpa.attention_backward(**args, causal="upper")
    with pytest.raises(ValueError, match=r"^backend must be"):
        sdpa.attention_backward(**args, backend="fast")
    with pytest.raises(ValueError, match=r"^scale must be finite"):
        sdpa.attention_backward(**args, scale=float("inf"))
    with pytest.raises(TypeError, match=r"^scale\b"):
        sdpa.attention_backward(**args, scale="1")
    with pytest.raises(ValueError, match=r"^window must be a pair"):
        sdpa.attention_backward(**args, window=3)
    with pytest.raises(ValueError, match=r"^mask has shape"):
        sdpa.attention_backward(**args, mask=np.ones((4, 5), bool))
    with pytest.raises(TypeError, match=r"^mask\b"):
        sdpa.attention_backward(**args, mask=np.ones((3, 5), np.int64))


def test_options_are_keyword_only():
    args = _valid()
    with pytest.raises(TypeError):
        sdpa.attention_backward(*args.values(), None, True)  # causal passed by position


def test_exported():
    assert "attention_backward" in sdpa.__all__
    doc = sdpa.attention_backward.__doc__
    for needle in ("dS = P * (dP - D)", "return_lse=True", "(dq, dk, dv)"):
        assert needle in doc
