"""float16 and bfloat16 (ml_dtypes) through the NumPy front door: the dtype policy, forward and
backward against the float64 oracle on the inputs widened, masks of each dtype, layouts read in
place, and the errors.

Tolerances are reference.py's 16-bit rule: twice the error of the naive float32 computation on
the same widened inputs with its result rounded to the 16-bit dtype, plus one unit in the last
place of that dtype at the result's largest magnitude, plus the float32 floor. Results stored in
float32 (weights, lse; out and dq of float32 q over 16-bit k and v) keep the float32 rule. The
backward is compared with the oracle for the out it is given (D = rowsum(dout * out) with the
16-bit out that attention returned, as sdpa.attention_backward documents), plus the float32
rule's floors for what the fused backward reads through lse (reference.backward_floors).

The torch front door's bfloat16 and float16 tests are in test_torch.py (they need torch).
"""


import ml_dtypes
import numpy as np
import pytest

import sdpa
from reference import (case_seed, case_shapes, EPS32, assert_close, backward_floors, finite_max_abs, float32_tolerance, lowp_tolerance,
                       max_error, naive_float32_attention, naive_float32_attention_backward, reference_attention,
                       reference_attention_backward, ulp)

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)

# (q's dtype, k's and v's dtype): the four combinations the core computes natively.
STORAGE = {"f16": (F16, F16), "bf16": (BF16, BF16), "f32/f16": (F32, F16), "f32/bf16": (F32, BF16)}


_seed, _shapes = case_seed, case_shapes


def make_case(rng, storage, rank=3, B=2, Hq=2, Hkv=2, Nq=9, Nk=11, Dk=16, Dv=8, amp=1.0, v_amp=1.0):
    """q, k, v and a dout (shaped like out, in out's dtype), normal values rounded to the
    storage dtypes."""
    q_dt, kv_dt = STORAGE[storage]
    sq, sk, sv, so = _shapes(rank, B, Hq, Hkv, Nq, Nk, Dk, Dv)
    q = (rng.standard_normal(sq) * amp).astype(q_dt)
    k = (rng.standard_normal(sk) * amp).astype(kv_dt)
    v = (rng.standard_normal(sv) * v_amp).astype(kv_dt)
    dout = rng.standard_normal(so).astype(q_dt)
    return q, k, v, dout


def wide(*arrays):
    """The arrays widened to float64 (exact for every storage dtype here); None and bool masks
    stay as they are."""
    return [a if a is None or np.asarray(a).dtype == np.bool_ else np.asarray(a).astype(np.float64) for a in arrays]


def check_forward(q, k, v, mask=None, backend="auto", score_scale=1.0, **opts):
    """attention() in q's storage dtype against the float64 oracle on the widened inputs, with
    the 16-bit rule for out and the float32 rule for weights and lse. Returns (out, weights, lse)."""
    got = sdpa.attention(q, k, v, mask, return_weights=True, return_lse=True, backend=backend, **opts)
    assert [g.dtype for g in got] == [q.dtype, F32, F32]
    args = wide(q, k, v, mask)
    ref = reference_attention(*args, **opts)
    naive = naive_float32_attention(*args, **opts)
    for name, g, r, n, dt in zip(("out", "weights", "lse"), got, ref, naive, (q.dtype, F32, F32)):
        tol = lowp_tolerance(n, r, dt, score_scale)
        assert np.isfinite(tol), f"{name}: the naive float32 computation overflowed; pick another case"
        assert_close(g.astype(np.float64), r, tol, f"{backend} {name} ({dt})")
    return got


def check_backward(dout, q, k, v, mask=None, backend="auto", **opts):
    """attention() then attention_backward() in the storage dtypes, against the float64 oracle for
    the out that attention() returned. Returns (dq, dk, dv)."""
    out, lse = sdpa.attention(q, k, v, mask, return_lse=True, **opts)
    grads = sdpa.attention_backward(dout, q, k, v, out, lse, mask, backend=backend, **opts)
    assert [g.dtype for g in grads] == [q.dtype, k.dtype, v.dtype]
    args = wide(dout, q, k, v, mask)
    ref = reference_attention_backward(*args, out=wide(out)[0], **opts)
    naive = naive_float32_attention_backward(*args, out=wide(out)[0], **opts)
    floors = backward_floors(*args, eps=EPS32, **opts)
    for name, g, r, n, f, like in zip(("dq", "dk", "dv"), grads, ref, naive, floors, (q, k, v)):
        assert g.shape == like.shape
        tol = lowp_tolerance(n, r, like.dtype) + f
        assert np.isfinite(tol), f"{name}: the naive float32 computation overflowed; pick another case"
        assert_close(g.astype(np.float64), r, tol, f"{backend} {name} ({like.dtype})")
    return grads


# ---------------------------------------------------------------- the dtype policy


@pytest.mark.parametrize("dtypes,out,weights,grads", [
    ((F16, F16, F16), F16, F32, (F16, F16, F16)),
    ((BF16, BF16, BF16), BF16, F32, (BF16, BF16, BF16)),
    ((F32, BF16, BF16), F32, F32, (F32, BF16, BF16)),  # a bfloat16 KV cache under float32 queries
    ((F32, F16, F16), F32, F32, (F32, F16, F16)),
    # Other mixes are converted, as NumPy promotes: float32, or float64 with float64 or integers.
    ((F16, F32, F32), F32, F32, (F32, F32, F32)),
    ((F16, F16, F32), F32, F32, (F32, F32, F32)),
    ((BF16, F16, F16), F32, F32, (F32, F32, F32)),
    ((F32, BF16, F16), F32, F32, (F32, F32, F32)),
    ((BF16, F32, F32), F32, F32, (F32, F32, F32)),
    ((BF16, BF16, F64), F64, F64, (F64, F64, F64)),
    ((F16, F16, np.dtype(np.int8)), F64, F64, (F64, F64, F64)),
], ids=lambda x: "-".join(map(str, x)) if isinstance(x, tuple) else str(x))
def test_dtype_policy(dtypes, out, weights, grads):
    rng = np.random.default_rng(1)
    q, k, v = (rng.integers(-3, 4, size=s).astype(d) for d, s in zip(dtypes, [(4, 3), (5, 3), (5, 2)]))
    got = sdpa.attention(q, k, v, return_weights=True, return_lse=True)
    assert [g.dtype for g in got] == [out, weights, weights]
    dq, dk, dv = sdpa.attention_backward(np.ones_like(got[0]), q, k, v, got[0], got[2])
    assert (dq.dtype, dk.dtype, dv.dtype) == grads
    # A converted mix is exactly the call with the inputs converted first.
    if len(set(dtypes)) > 1 and not (dtypes[0] == F32 and dtypes[1] == dtypes[2]):
        same = sdpa.attention(*(a.astype(out) for a in (q, k, v)), return_weights=True, return_lse=True)
        for g, s in zip(got, same):
            np.testing.assert_array_equal(g, s)


def test_float16_out_is_the_float32_result_rounded():
    # float16 in gives float16 out (earlier versions returned float32), computed in float32 and
    # rounded once: it equals the float32 computation on the widened inputs, rounded, to within
    # the rounding of that float32 result (checked against the oracle in test_forward_*).
    rng = np.random.default_rng(2)
    q, k, v, _ = make_case(rng, "f16")
    out = sdpa.attention(q, k, v)
    assert out.dtype == np.float16
    out32 = sdpa.attention(*(a.astype(np.float32) for a in (q, k, v)))
    np.testing.assert_array_less(np.abs(out.astype(np.float64) - out32), ulp(F16, finite_max_abs(out32)))


def test_bfloat16_is_read_as_bfloat16_not_as_its_bits():
    # A uint16 view reaches the core: values 1, 2, 3 must be read as such, not as 16256, ...
    q = np.zeros((1, 4), BF16)
    k = np.zeros((3, 4), BF16)
    v = np.array([[1.0], [2.0], [3.0]], np.float32).astype(BF16)
    out = check_forward(q, k, v)[0]
    assert float(out[0, 0]) == 2.0  # the mean of 1, 2, 3: 2 within float32's error, exactly 2 in bfloat16


@pytest.mark.parametrize("backend", ["auto", "reference", "naive"])
@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_results_are_rounded_to_nearest_even_once(storage, backend):
    # Two keys of equal score: out = (v0 + v1) / 2, exact in float32 and float64. With v1 the
    # 16-bit value just above v0, that mean lies halfway between them: round to nearest even
    # gives the one whose last bit is 0, v0 or v1 depending on v0 (rounding half up, half down
    # or by truncation would give the same one for all).
    dt = STORAGE[storage][0]
    lo = np.array([0x3C00, 0x3C01, 0x4200, 0x4201, 0xBC00, 0xBC01] if dt == F16 else
                  [0x3F80, 0x3F81, 0x4040, 0x4041, 0xBF80, 0xBF81], np.uint16)  # 1, 3 and -1, and the next
    v = np.stack([lo, lo + 1]).view(dt)  # (2 keys, 6)
    q, k = np.zeros((1, 2), dt), np.zeros((2, 2), dt)
    out = sdpa.attention(q, k, v, backend=backend)
    np.testing.assert_array_equal(out[0].view(np.uint16), np.where(lo % 2 == 0, lo, lo + 1))


# ---------------------------------------------------------------- forward and backward against the oracle


CASES = [  # (make_case kwargs, attention kwargs, mask kind)
    (dict(rank=2, Nq=17, Nk=23), {}, None),
    (dict(rank=3, Hq=4, Hkv=2, Nq=33, Nk=65, Dk=32, Dv=16), dict(causal=True), None),  # GQA, bottom-right
    (dict(rank=4, Nq=20, Nk=30, Dk=8), dict(causal="top_left"), None),
    (dict(rank=4, Nq=20, Nk=30, Dk=8), {}, "bool"),  # with rows that have no allowed key
    (dict(rank=4, Nq=20, Nk=30, Dk=8), {}, "q"),  # float mask of q's dtype, -inf blocks
    (dict(rank=4, Nq=20, Nk=30, Dk=8), {}, "float32"),
    (dict(rank=3, Nq=1, Nk=300, Dk=64, Dv=64), {}, None),  # one query row: decode
    (dict(rank=3, Nq=40, Nk=40), dict(window=(4, 2)), None),
    (dict(rank=3, Nq=24, Nk=24, amp=4.0), dict(scale=0.3), None),  # sharper softmax
]


def _mask(rng, kind, shape, q_dtype):
    if kind is None:
        return None
    allowed = rng.random(shape) > 0.3
    allowed[..., 0] = True
    allowed[..., 3, :] = False  # a row with no allowed key: zeros out, lse = -inf, no gradient
    if kind == "bool":
        return allowed
    bias = np.where(allowed, rng.standard_normal(shape), -np.inf)
    return bias.astype(q_dtype if kind == "q" else np.float32)


def _case(storage, shape, kind):
    rng = np.random.default_rng(_seed(storage, sorted(shape.items()), kind))
    q, k, v, dout = make_case(rng, storage, **shape)
    mask = _mask(rng, kind, q.shape[:-1] + (k.shape[-2],), q.dtype)
    return q, k, v, dout, mask


@pytest.mark.parametrize("backend", ["auto", "reference", "naive"])
@pytest.mark.parametrize("storage", list(STORAGE))
@pytest.mark.parametrize("shape,opts,kind", CASES)
def test_forward_matches_reference(shape, opts, kind, storage, backend):
    q, k, v, _, mask = _case(storage, shape, kind)
    out, weights, lse = check_forward(q, k, v, mask, backend=backend, **opts)
    if kind is not None:
        assert (out[..., 3, :].astype(np.float64) == 0).all() and (lse[..., 3] == -np.inf).all()


@pytest.mark.parametrize("backend", ["auto", "reference", "naive"])
@pytest.mark.parametrize("storage", list(STORAGE))
@pytest.mark.parametrize("shape,opts,kind", CASES)
def test_backward_matches_reference(shape, opts, kind, storage, backend):
    q, k, v, dout, mask = _case(storage, shape, kind)
    dq, dk, dv = check_backward(dout, q, k, v, mask, backend=backend, **opts)
    if kind is not None:
        assert (dq[..., 3, :].astype(np.float64) == 0).all()


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_large_scores(storage):
    # Scores in the thousands: the softmax is nearly one-hot, and every float32 computation rounds
    # each score to eps32 * |score| (the float32 rule's score_scale, max |lse|).
    rng = np.random.default_rng(_seed("large", storage))
    q, k, v, _ = make_case(rng, storage, rank=3, Nq=64, Nk=64, Dk=16, amp=30.0)
    lse = reference_attention(*wide(q, k, v))[2]
    assert finite_max_abs(lse) > 1000
    check_forward(q, k, v, score_scale=finite_max_abs(lse))


def test_float16_near_the_top_of_its_range():
    # v up to about 60000 (float16's largest is 65504): out stays finite and within the rule,
    # whose unit in the last place there is 32.
    rng = np.random.default_rng(3)
    q, k, v, _ = make_case(rng, "f16", rank=3, Nq=32, Nk=48, v_amp=1.0)
    v = (np.clip(rng.standard_normal(v.shape), -1, 1) * 60000).astype(np.float16)
    v[0, 0, 0] = np.float16(65504)
    out = check_forward(q, k, v)[0]
    assert np.isfinite(out.astype(np.float64)).all() and finite_max_abs(out) > 10000


def test_float16_subnormal_values():
    # v in float16's subnormal range (below 6.1e-5): widened exactly, out rounded into it again.
    rng = np.random.default_rng(4)
    q, k, _, _ = make_case(rng, "f16", rank=2, Nq=16, Nk=20)
    v = (rng.standard_normal((20, 8)) * 1e-5).astype(np.float16)
    assert (np.abs(v.astype(np.float64)) < 6.1e-5).all() and (v != 0).any()
    out = check_forward(q, k, v)[0]
    assert (out != 0).any()


@pytest.mark.parametrize("storage", list(STORAGE))
def test_dropout(storage):
    # Forward and backward with dropout equal the float64 computation with the same kept
    # weights (sdpa.dropout_mask), by the same rule with a naive float32 computation.
    rng = np.random.default_rng(_seed("dropout", storage))
    q, k, v, dout = make_case(rng, storage, rank=3, Nq=21, Nk=37)
    p, seed = 0.25, 11
    keep = sdpa.dropout_mask(q.shape[:-1] + (k.shape[-2],), p, seed)
    out, lse = sdpa.attention(q, k, v, dropout_p=p, seed=seed, return_lse=True)
    grads = sdpa.attention_backward(dout, q, k, v, out, lse, dropout_p=p, seed=seed)

    def explicit(dtype):
        """(out, (dq, dk, dv), floors of the backward rule) with every step in `dtype`."""
        qq, kk, vv, g, o = (np.asarray(a).astype(dtype) for a in (q, k, v, dout, out))
        scale = dtype.type(1 / np.sqrt(q.shape[-1]))
        s = (qq @ np.swapaxes(kk, -1, -2)) * scale
        P = np.exp(s - s.max(-1, keepdims=True))
        total = P.sum(-1, keepdims=True)
        P /= total
        Z = (keep / (1 - p)).astype(dtype)
        dP = Z * (g @ np.swapaxes(vv, -1, -2))
        D = (g * o).sum(-1, keepdims=True)  # from the out given
        dS = P * (dP - D)
        grads = ((dS @ kk) * scale, (np.swapaxes(dS, -1, -2) @ qq) * scale, np.swapaxes(P * Z, -1, -2) @ g)
        # reference.backward_floors with the dropout factors in dP: the result's rounding, P read
        # through the rounded lse, and the terms that cancel in dS (no GQA here: Hq == Hkv).
        lse_max = float(np.abs(s.max(-1) + np.log(total[..., 0])).max())
        mag = P * (np.abs(dP) + np.abs(D))
        m = (abs(scale) * float((mag * np.abs(kk).max(-1)[..., None, :]).sum(-1).max()),
             abs(scale) * float((mag * np.abs(qq).max(-1)[..., :, None]).sum(-2).max()), 0.0)
        floors = [EPS32 * (4 * max(1.0, finite_max_abs(r)) + 2 * lse_max * finite_max_abs(r) + mi)
                  for r, mi in zip(grads, m)]
        return (P * Z) @ vv, grads, floors

    ref_out, ref_grads, floors = explicit(F64)
    naive_out, naive_grads, _ = explicit(F32)
    assert_close(out.astype(np.float64), ref_out, lowp_tolerance(naive_out, ref_out, q.dtype), "out")
    for name, g, r, n, f, like in zip(("dq", "dk", "dv"), grads, ref_grads, naive_grads, floors, (q, k, v)):
        assert g.dtype == like.dtype
        assert_close(g.astype(np.float64), r, lowp_tolerance(n, r, like.dtype) + f, name)


@pytest.mark.parametrize("storage", ["f16", "bf16"])
def test_bitwise_identical_across_thread_counts(storage):
    rng = np.random.default_rng(5)
    q, k, v, dout = make_case(rng, storage, rank=4, B=2, Hq=4, Hkv=2, Nq=70, Nk=300, Dk=32, Dv=16)
    before = sdpa.num_threads()
    try:
        results = []
        for n in (1, 2, 3):
            sdpa.set_num_threads(n)
            out, w, lse = sdpa.attention(q, k, v, causal=True, return_weights=True, return_lse=True)
            results.append((out.view(np.uint16), w, lse) +
                           tuple(g.view(np.uint16) for g in sdpa.attention_backward(dout, q, k, v, out, lse,
                                                                                    causal=True)))
    finally:
        sdpa.set_num_threads(before)
    for other in results[1:]:
        for a, b in zip(results[0], other):
            np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- masks


@pytest.mark.parametrize("storage,mask_dtype", [("f16", F16), ("bf16", BF16), ("f16", BF16), ("bf16", F16),
                                                ("bf16", F64), ("f32/bf16", BF16), ("f32/f16", F64)])
def test_float_masks_of_any_float_dtype_are_their_values(storage, mask_dtype):
    # A mask of q's 16-bit dtype is read as it is, others are converted (exactly here): either
    # way the result is that of the same biases in float32.
    rng = np.random.default_rng(6)
    q, k, v, _, _ = _case(storage, dict(rank=3, Nq=12, Nk=14), None)
    bias = np.where(rng.random((12, 14)) > 0.2, rng.standard_normal((12, 14)) * 3, -np.inf).astype(mask_dtype)
    got = sdpa.attention(q, k, v, bias, return_weights=True, return_lse=True)
    want = sdpa.attention(q, k, v, bias.astype(np.float32), return_weights=True, return_lse=True)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(g.astype(np.float64), w.astype(np.float64))


def test_float32_mask_is_not_rounded_to_a_16bit_q():
    # 0.1 + 1e-3 is no bfloat16 value: a float32 mask reaches the core as float32.
    rng = np.random.default_rng(7)
    q, k, v, _, _ = _case("bf16", dict(rank=2, Nq=8, Nk=9), None)
    bias = np.float32(rng.standard_normal((8, 9)) * 5 + 0.001)
    lse = sdpa.attention(q, k, v, bias, return_lse=True)[1]
    ref = reference_attention(*wide(q, k, v, bias))[2]
    rounded = reference_attention(*wide(q, k, v, bias.astype(BF16)))[2]
    tol = float32_tolerance(naive_float32_attention(*wide(q, k, v, bias))[2], ref)
    assert_close(lse, ref, tol, "lse")
    assert max_error(rounded, ref) > 10 * tol  # rounding the mask would have been seen


def test_float64_mask_too_large_for_float32_raises_for_16bit_q():
    q, k, v, _, _ = _case("f16", dict(rank=2, Nq=3, Nk=5), None)
    mask = np.zeros((3, 5))
    mask[2, 3] = 1e39
    with pytest.raises(ValueError, match=r"^mask has 1e\+39 at index \(2, 3\), which does not fit in float32"):
        sdpa.attention(q, k, v, mask)


# ---------------------------------------------------------------- layouts


@pytest.fixture
def core_calls(monkeypatch):
    """The arrays that sdpa passes to _core.attention and _core.attention_backward."""
    calls = []
    for name in ("attention", "attention_backward"):
        real = getattr(sdpa._core, name)

        def spy(*args, _real=real, _name=name, **kwargs):
            calls.append((_name, args))
            return _real(*args, **kwargs)

        monkeypatch.setattr(sdpa._core, name, spy)
    return calls


@pytest.mark.parametrize("storage", list(STORAGE))
def test_strided_inputs_are_read_in_place(storage, core_calls):
    # (B, N, H, D) arrays viewed as (B, H, N, D), and k, v broadcast over the batch: no copies
    # reach the core, and the results equal those of contiguous copies bit for bit.
    q_dt, kv_dt = STORAGE[storage]
    rng = np.random.default_rng(8)
    q = rng.standard_normal((2, 10, 3, 8)).astype(q_dt).transpose(0, 2, 1, 3)
    k = np.broadcast_to(rng.standard_normal((1, 12, 3, 8)).astype(kv_dt).transpose(0, 2, 1, 3), (2, 3, 12, 8))
    v = rng.standard_normal((2, 12, 3, 4)).astype(kv_dt).transpose(0, 2, 1, 3)
    dout = rng.standard_normal((2, 3, 10, 4)).astype(q_dt)
    out, lse = sdpa.attention(q, k, v, causal=True, return_lse=True)
    grads = sdpa.attention_backward(dout, q, k, v, out, lse, causal=True)
    (_, fwd), (_, bwd) = core_calls
    for passed, given in zip(fwd[:3] + bwd[:3], (q, k, v) * 2):
        assert passed.ctypes.data == given.ctypes.data and passed.strides == given.strides
        assert passed.dtype == (np.uint16 if given.dtype == BF16 else given.dtype)
    assert bwd[5].ctypes.data == out.ctypes.data and bwd[7].ctypes.data == dout.ctypes.data  # after mask, seqlens_k
    copies = [np.ascontiguousarray(a) for a in (q, k, v)]
    out2, lse2 = sdpa.attention(*copies, causal=True, return_lse=True)
    grads2 = sdpa.attention_backward(dout, *copies, out2, lse2, causal=True)
    for a, b in zip((out, lse) + grads, (out2, lse2) + grads2):
        np.testing.assert_array_equal(a.astype(np.float64), b.astype(np.float64))


def test_unaligned_bfloat16_is_copied_and_read_right():
    # A bfloat16 array at an odd byte address cannot be read in place: it is copied, not misread.
    q, k, v, _, _ = _case("bf16", dict(rank=2, Nq=5, Nk=7), None)
    buf = np.zeros(k.nbytes + 1, np.uint8)
    buf[1:] = k.view(np.uint8).reshape(-1)
    odd = np.frombuffer(buf, BF16, k.size, 1).reshape(k.shape)
    assert odd.ctypes.data % 2 == 1
    np.testing.assert_array_equal(odd.view(np.uint16), k.view(np.uint16))
    np.testing.assert_array_equal(sdpa.attention(q, odd, v).view(np.uint16), sdpa.attention(q, k, v).view(np.uint16))


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize("name", ["q", "k", "v"])
def test_other_ml_dtypes_raise_naming_the_argument(name):
    arrays = dict(q=np.zeros((2, 4), np.float32), k=np.zeros((3, 4), np.float32), v=np.zeros((3, 2), np.float32))
    arrays[name] = arrays[name].astype(ml_dtypes.float8_e4m3fn)
    with pytest.raises(TypeError, match=rf"^{name} has dtype float8_e4m3fn, but attention needs real numbers"):
        sdpa.attention(**arrays)


def test_16bit_scale_is_held_by_float32():
    q, k, v, _, _ = _case("f16", dict(rank=2, Nq=3, Nk=5), None)
    with pytest.raises(ValueError, match=r"^scale 1e\+39 does not fit in float32"):
        sdpa.attention(q, k, v, scale=1e39)
    # 1e5 is beyond float16's range but not float32's, where the arithmetic happens.
    assert np.isfinite(sdpa.attention(q, k, v, scale=1e5).astype(np.float64)).all()


@pytest.mark.parametrize("q_dt,k_dt,v_dt,message", [
    (F16, BF16, BF16, r"^k has dtype bfloat16 but q has dtype float16"),
    (BF16, F16, F16, r"^k has dtype float16 but q has dtype bfloat16"),
    (F32, BF16, F16, r"^v has dtype float16 but k has dtype bfloat16"),
    (F16, F32, F32, r"^k has dtype float32 but q has dtype float16"),
])
def test_core_names_the_argument_of_a_bad_combination(q_dt, k_dt, v_dt, message):
    # sdpa.attention converts such mixes (test_dtype_policy); the core refuses them, and its
    # message reaches Python as ValueError through the binding, bfloat16 named as such.
    views = [np.zeros(s, d).view(np.uint16) if d == BF16 else np.zeros(s, d)
             for d, s in zip((q_dt, k_dt, v_dt), [(2, 4), (3, 4), (3, 2)])]
    out = np.zeros((2, 2), q_dt)
    with pytest.raises(ValueError, match=message):
        sdpa._core.attention(*views, None, None, out.view(np.uint16) if q_dt == BF16 else out, None, None, None, "none",
                             -1, -1, "auto", 0.0, None)


def test_core_names_an_output_of_the_wrong_dtype():
    q, k, v, _, _ = _case("bf16", dict(rank=2, Nq=2, Nk=3, Dk=4, Dv=2), None)
    qv, kv_, vv = (a.view(np.uint16) for a in (q, k, v))
    with pytest.raises(ValueError, match=r"^lse has dtype bfloat16 but must be float32, the compute type of bfloat16 q"):
        sdpa._core.attention(qv, kv_, vv, None, None, np.zeros((2, 2), np.uint16), None, np.zeros(2, np.uint16), None,
                             "none", -1, -1, "auto", 0.0, None)
    # out may be q's dtype or the compute type (float32 partials, issue 29); float16 is neither.
    with pytest.raises(ValueError, match=r"^out has dtype float16 but must be q's dtype bfloat16 or the compute type "
                                         r"float32"):
        sdpa._core.attention(qv, kv_, vv, None, None, np.zeros((2, 2), np.float16), None, None, None, "none", -1, -1,
                             "auto", 0.0, None)
