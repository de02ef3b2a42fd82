"""Arguments at the edges of what Python and NumPy allow (issue 9): integers beyond float64 and
int64, arrays at odd addresses or with odd byte strides, non-native byte order, and outputs
too large for any machine. Each raises TypeError / ValueError naming the argument, or is
handled exactly; none reaches nanobind's generic "incompatible function arguments"."""

import os
import re
import subprocess
import sys
import tracemalloc
from fractions import Fraction

import numpy as np
import pytest

import sdpa

HERE = os.path.dirname(os.path.abspath(__file__))


def _qkv(dtype=np.float64, rank=4, B=2, Hq=4, Hkv=2, Nq=3, Nk=5, Dk=8, Dv=6, seed=0):
    rng = np.random.default_rng(seed)
    lead_q = {2: (), 3: (Hq,), 4: (B, Hq)}[rank]
    lead_kv = {2: (), 3: (Hkv,), 4: (B, Hkv)}[rank]
    return tuple(a.astype(dtype) for a in (rng.standard_normal(lead_q + (Nq, Dk)),
                                           rng.standard_normal(lead_kv + (Nk, Dk)),
                                           rng.standard_normal(lead_kv + (Nk, Dv))))


def _backward_args(dtype=np.float64, **kw):
    """(dout, q, k, v, out, lse) of a valid attention_backward call."""
    q, k, v = _qkv(dtype, **kw)
    out, lse = sdpa.attention(q, k, v, return_lse=True)
    dout = np.random.default_rng(1).standard_normal(out.shape).astype(dtype)
    return dout, q, k, v, out, lse


# ---------------------------------------------------------------- numbers beyond float64


@pytest.mark.parametrize("scale", [10**400, -10**400, 10**5000, Fraction(10**400), Fraction(-1, 3) * 10**400],
                         ids=["1e400", "-1e400", "1e5000", "Fraction", "-Fraction"])
def test_scale_beyond_float64_raises_value_error(scale):
    # float(10**400) raises OverflowError; the caller passed a scale that is not finite.
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^scale must be finite"):
        sdpa.attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match=r"^scale must be finite"):
        sdpa.attention_backward(*_backward_args(), scale=scale)


@pytest.mark.parametrize("p", [10**400, -10**400, 10**5000, Fraction(10**400)], ids=["1e400", "-1e400", "1e5000",
                                                                                    "Fraction"])
def test_dropout_p_beyond_float64_raises_value_error(p):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^dropout_p must be in \[0, 1\)"):
        sdpa.attention(q, k, v, dropout_p=p, seed=1)
    with pytest.raises(ValueError, match=r"^dropout_p must be in \[0, 1\)"):
        sdpa.attention_backward(*_backward_args(), dropout_p=p, seed=1)
    with pytest.raises(ValueError, match=r"^dropout_p must be in \[0, 1\)"):
        sdpa.dropout_mask((3, 5), p, 1)


def test_seed_beyond_int_digits_limit_names_seed():
    # repr(10**5000) itself raises ValueError (Python's 4300-digit limit): the message must not.
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^seed must be an integer in \[0, 2\*\*64 - 1\]"):
        sdpa.attention(q, k, v, dropout_p=0.5, seed=10**5000)


@pytest.mark.parametrize("scale", [1e39, -1e39, 3.40282357e38, np.finfo(np.float64).max, 1e-46, -1e-50, 2.0**-150,
                                   5e-324], ids=str)
def test_scale_that_float32_cannot_hold_raises_for_float32_inputs(scale):
    # float32 inputs compute in float32: such a scale would become inf or 0 there.
    q, k, v = _qkv(np.float32)
    with pytest.raises(ValueError, match=r"^scale .*float32"):
        sdpa.attention(q, k, v, scale=scale)
    with pytest.raises(ValueError, match=r"^scale .*float32"):
        sdpa.attention_backward(*_backward_args(np.float32), scale=scale)
    # float64 holds it: no error.
    q64, k64, v64 = (a.astype(np.float64) for a in (q, k, v))
    assert sdpa.attention(q64, k64, v64, scale=scale).dtype == np.float64


@pytest.mark.parametrize("scale", [Fraction(1, 10**400), Fraction(-1, 10**5000), np.longdouble(2) ** -1100],
                         ids=["1e-400", "-1e-5000", "2**-1100"])
def test_non_zero_scale_that_rounds_to_zero_in_float64_raises(scale):
    # Such a scale would silently become 0 (all scores equal) where the caller asked for
    # another value.
    q, k, v = _qkv()
    if np.longdouble(scale) != 0 and float(np.longdouble(scale)) != 0:
        pytest.skip("long double is float64 here")
    with pytest.raises(ValueError, match=r"^scale .* does not fit in float64.*would become 0"):
        sdpa.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("scale", [float(np.finfo(np.float32).max), -float(np.finfo(np.float32).max),
                                   3.4028235e38,  # above float32's max, but rounds to it
                                   2.0**-149, np.nextafter(2.0**-150, 1),  # rounds to 2**-149
                                   float(np.finfo(np.float32).tiny), 0.0, -0.0], ids=str)
def test_scale_float32_can_hold_is_taken(scale):
    q, k, v = _qkv(np.float32, Hq=2)
    q[:] = 0  # all scores 0 whatever the scale: a finite, uniform softmax
    out = sdpa.attention(q, k, v, scale=scale)
    np.testing.assert_allclose(out, np.broadcast_to(v.mean(axis=-2, keepdims=True), out.shape), rtol=1e-5,
                               atol=1e-6)


# ---------------------------------------------------------------- window bounds beyond int64


@pytest.mark.parametrize("window,same_as", [((2**70, 0), (-1, 0)), ((0, 2**64), (0, -1)), ((2**63, 2**63), None),
                                            ((np.uint64(2**64 - 1), 1), (-1, 1)), ((2**63 - 1, 2), (-1, 2)),
                                            ((-2**70, 1), (-1, 1))], ids=str)
@pytest.mark.parametrize("causal", [False, "top_left"])
def test_window_bounds_beyond_int64_reach_every_key(window, same_as, causal):
    q, k, v = _qkv()
    got = sdpa.attention(q, k, v, causal=causal, window=window, return_weights=True, return_lse=True)
    want = sdpa.attention(q, k, v, causal=causal, window=same_as, return_weights=True, return_lse=True)
    for a, b in zip(got, want):
        np.testing.assert_array_equal(a, b)
    args = _backward_args()
    for a, b in zip(sdpa.attention_backward(*args, causal=causal, window=window),
                    sdpa.attention_backward(*args, causal=causal, window=same_as)):
        np.testing.assert_array_equal(a, b)


# ---------------------------------------------------------------- odd addresses and strides


def _at_odd_address(a):
    """A copy of a whose data starts one byte past an aligned address: unaligned."""
    buf = bytearray(a.nbytes + 1)
    b = np.frombuffer(buf, dtype=a.dtype, count=a.size, offset=1).reshape(a.shape)
    b[...] = a
    assert not b.flags.aligned and b.ctypes.data % a.itemsize != 0
    return b


def _with_odd_strides(a):
    """A copy of a with one padding byte after each element (byte strides that are not a
    multiple of the item size, for items wider than a byte), over a bytearray at offset 1."""
    step = a.itemsize + 1
    buf = bytearray(a.size * step + 1)
    base = np.frombuffer(buf, a.dtype, count=(len(buf) - 1) // a.itemsize, offset=1)
    elements = tuple(s // a.itemsize for s in np.empty(a.shape, a.dtype).strides)  # C order
    b = np.lib.stride_tricks.as_strided(base, a.shape, tuple(step * s for s in elements))
    b[...] = a
    assert a.itemsize == 1 or b.strides[-1] % a.itemsize, b.strides
    return b


def _field_view(a):
    """a as a field of a packed structured array: byte stride itemsize + 1."""
    rec = np.zeros(a.size, dtype=[("pad", "u1"), ("x", a.dtype)])
    rec["x"] = a.ravel()
    b = rec["x"].reshape(a.shape)
    assert b.strides[-1] == a.itemsize + 1
    return b


LAYOUTS = {"odd_address": _at_odd_address, "odd_strides": _with_odd_strides, "field": _field_view}


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("which", ["q", "k", "v", "mask"])
def test_unaligned_or_oddly_strided_inputs_are_copied(which, dtype, layout):
    q, k, v = _qkv(dtype)
    mask = np.random.default_rng(2).standard_normal((4, 3, 5)).astype(dtype)
    args = {"q": q, "k": k, "v": v, "mask": mask}
    want = sdpa.attention(**args, return_weights=True, return_lse=True)
    args[which] = LAYOUTS[layout](args[which])
    got = sdpa.attention(**args, return_weights=True, return_lse=True)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", list(LAYOUTS))
@pytest.mark.parametrize("which", ["dout", "q", "k", "v", "out", "lse", "mask"])
def test_unaligned_or_oddly_strided_backward_inputs_are_copied(which, layout):
    dout, q, k, v, out, lse = _backward_args(np.float32)
    mask = np.random.default_rng(2).standard_normal((4, 3, 5)).astype(np.float32)
    args = {"dout": dout, "q": q, "k": k, "v": v, "out": out, "lse": lse, "mask": mask}
    want = sdpa.attention_backward(**args)
    args[which] = LAYOUTS[layout](args[which])
    for a, b in zip(sdpa.attention_backward(**args), want):
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("layout", ["odd_address", "odd_strides"])
def test_bool_mask_at_odd_address(layout):
    q, k, v = _qkv()
    mask = np.random.default_rng(3).random((4, 3, 5)) < 0.7
    m = np.frombuffer(bytearray(mask.size + 1), np.bool_, count=mask.size, offset=1).reshape(mask.shape)
    m[...] = mask
    if layout == "odd_strides":
        m = _with_odd_strides(mask)
    np.testing.assert_array_equal(sdpa.attention(q, k, v, m), sdpa.attention(q, k, v, mask))


def test_core_refuses_misaligned_data():
    # The bridge itself never reads misaligned: the package copies first, and _core says so by
    # name when called directly with such an array.
    q, k, v = _qkv(np.float32, rank=2)
    out = np.empty((3, 6), np.float32)
    with pytest.raises(ValueError, match=r"^q\b.*aligned"):
        sdpa._core.attention(_at_odd_address(q), k, v, None, None, out, None, None, None, "none", -1, -1, "auto", 0.0,
                             None)


# ---------------------------------------------------------------- byte order


@pytest.mark.parametrize("order", [">", "<"])
@pytest.mark.parametrize("dtype,stores,computes", [("f4", np.float32, np.float32), ("f2", np.float16, np.float32),
                                                   ("f8", np.float64, np.float64)])
def test_non_native_byte_order_computes_in_the_same_precision(dtype, stores, computes, order):
    # out and the gradients in the inputs' dtype (native order), weights and lse in the compute dtype.
    native = _qkv(np.dtype(dtype))
    swapped = tuple(a.astype(np.dtype(order + dtype)) for a in native)
    want = sdpa.attention(*native, causal=True, return_weights=True, return_lse=True)
    got = sdpa.attention(*swapped, causal=True, return_weights=True, return_lse=True)
    for a, b, expect in zip(got, want, (stores, computes, computes)):
        assert a.dtype == expect
        np.testing.assert_array_equal(a, b)
    # Mixed with native float32 k and v: float32 (float64 for float64 q).
    mixed = sdpa.attention(swapped[0], native[1].astype(np.float32), native[2].astype(np.float32))
    assert mixed.dtype == computes
    # The backward too.
    dout = np.ones(want[0].shape, want[0].dtype)
    args = (want[0], want[2])
    grads = sdpa.attention_backward(dout.astype(np.dtype(order + dout.dtype.str[1:])), *swapped,
                                    *(a.astype(a.dtype.newbyteorder()) for a in args), causal=True)
    for a, b in zip(grads, sdpa.attention_backward(dout, *native, *args, causal=True)):
        assert a.dtype == stores
        np.testing.assert_array_equal(a, b)


@pytest.mark.parametrize("mask_dtype", [">f4", ">f8", ">f2", "<f4"])
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
def test_non_native_byte_order_masks(mask_dtype, dtype):
    q, k, v = _qkv(dtype)
    mask = np.random.default_rng(4).standard_normal((4, 3, 5))
    mask[1, 2, 3] = -np.inf
    native = mask.astype(np.dtype(mask_dtype).newbyteorder("="))
    got = sdpa.attention(q, k, v, native.astype(mask_dtype), return_weights=True)
    want = sdpa.attention(q, k, v, native, return_weights=True)
    for a, b in zip(got, want):
        assert a.dtype == dtype
        np.testing.assert_array_equal(a, b)


def test_big_endian_float64_mask_too_large_for_float32_still_raises():
    q, k, v = _qkv(np.float32)
    mask = np.zeros((3, 5), ">f8")
    mask[2, 3] = 1e39
    with pytest.raises(ValueError, match=r"^mask has 1e\+39 at index \(2, 3\), which does not fit in float32"):
        sdpa.attention(q, k, v, mask)


# ---------------------------------------------------------------- set_num_threads


@pytest.fixture
def restore_threads():
    before = sdpa.num_threads()
    yield
    sdpa.set_num_threads(0)
    if sdpa.num_threads() != before:
        sdpa.set_num_threads(before)


@pytest.mark.parametrize("n", [2**40, 2**31, -1, -2**70, 10**5000], ids=["2**40", "2**31", "-1", "-2**70", "1e5000"])
def test_set_num_threads_out_of_range_raises_value_error(n, restore_threads):
    before = sdpa.num_threads()
    with pytest.raises(ValueError, match=r"^set_num_threads: n must be"):
        sdpa.set_num_threads(n)
    assert sdpa.num_threads() == before


@pytest.mark.parametrize("n", [1.5, 2.0, "2", None, True, np.float64(2), [2]], ids=str)
def test_set_num_threads_non_integer_raises_type_error(n, restore_threads):
    with pytest.raises(TypeError, match=r"^set_num_threads: n must be an integer"):
        sdpa.set_num_threads(n)


def test_set_num_threads_takes_numpy_integers_and_zero(restore_threads):
    sdpa.set_num_threads(np.int64(3))
    assert sdpa.num_threads() == 3
    sdpa.set_num_threads(np.uint8(1))
    assert sdpa.num_threads() == 1
    sdpa.set_num_threads(0)  # OpenMP's default again
    assert sdpa.num_threads() >= 1


# ---------------------------------------------------------------- outputs no machine can hold


BIG = 2**50  # rows: 2**50 float32 values are 4 PiB


def _rows(n, d, dtype=np.float64):
    """An (n, d) array of zeros with stride 0 between rows: n may be far beyond memory."""
    return np.lib.stride_tricks.as_strided(np.zeros(max(d, 1), dtype), shape=(n, d),
                                           strides=(0, np.dtype(dtype).itemsize))


@pytest.mark.parametrize("what,kwargs,shape", [
    ("weights", {"return_weights": True}, (BIG, BIG)),
    ("lse", {"return_lse": True}, (BIG,)),
])
def test_huge_weights_or_lse_from_empty_inputs_raise_before_allocating(what, kwargs, shape):
    # q, k, v with Dk = Dv = 0 hold no element, yet the weights would be BIG x BIG.
    q = np.zeros((BIG, 0))
    k = v = np.zeros((BIG, 0))
    with pytest.raises(ValueError, match=rf"^{what} would have shape {re.escape(str(shape))} of float64.*more than "
                                         r"this machine's memory"):
        sdpa.attention(q, k, v, **kwargs)
    assert sdpa.attention(q, k, v).shape == (BIG, 0)  # out has no element: fine


def test_huge_out_raises_before_allocating():
    q, k, v = np.zeros((BIG, 0), np.float32), np.zeros((3, 0), np.float32), np.zeros((3, 2), np.float32)
    with pytest.raises(ValueError, match=r"^out would have shape \(1125899906842624, 2\) of float32"):
        sdpa.attention(q, k, v)


def test_huge_gradients_raise_before_allocating():
    # Broadcast (stride-0) q, dout, out and lse of BIG rows: dq would be BIG x 4.
    q, k, v = _rows(BIG, 4), np.zeros((3, 4)), np.zeros((3, 2))
    dout, out, lse = _rows(BIG, 2), _rows(BIG, 2), _rows(BIG, 1)[:, 0]
    with pytest.raises(ValueError, match=r"^dq would have shape \(1125899906842624, 4\) of float64"):
        sdpa.attention_backward(dout, q, k, v, out, lse)


def test_huge_copy_of_an_input_raises_before_allocating():
    # A q whose last dim has stride 0 needs a copy with unit stride: BIG x 4 values.
    q = np.lib.stride_tricks.as_strided(np.zeros(1), shape=(BIG, 4), strides=(0, 0))
    k, v = np.zeros((3, 4)), np.zeros((3, 0))
    with pytest.raises(ValueError, match=r"^q needs a copy .*shape \(1125899906842624, 4\) of float64"):
        sdpa.attention(q, k, v)


@pytest.mark.parametrize("dtype,kv_dtype,rows", [(np.float16, np.float32, 2**61), (np.bool_, np.bool_, 2**62)],
                         ids=["float16", "bool"])
def test_empty_input_numpy_cannot_convert_names_it(dtype, kv_dtype, rows):
    # q of shape (rows, 0) holds nothing, but NumPy cannot make that shape in the compute
    # dtype (rows times the wider item size exceeds its largest array size). float16 q is
    # converted only beside float32 k and v (float16 q, k and v stay float16).
    q, k, v = np.zeros((rows, 0), dtype), np.zeros((3, 0), kv_dtype), np.zeros((3, 0), kv_dtype)
    with pytest.raises(ValueError, match=rf"^q needs a copy as float(32|64) of shape \({rows}, 0\).*NumPy cannot make"):
        sdpa.attention(q, k, v)


def test_broadcast_inputs_are_converted_without_expanding():
    # float16 k and int8 v broadcast over 2**22 keys convert to float64 (the int8 makes
    # everything float64) one row each, not 2**22.
    n = 2**22
    q = np.random.default_rng(5).standard_normal((4, 8)).astype(np.float16)
    k = np.broadcast_to(np.ones((1, 8), np.float16), (n, 8))
    v = np.broadcast_to(np.arange(2, dtype=np.int8)[None], (n, 2))
    mask = np.broadcast_to(np.zeros((1, 1), np.float16), (4, n))
    tracemalloc.start()
    try:
        out = sdpa.attention(q, k, v, mask)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert out.dtype == np.float64
    np.testing.assert_allclose(out, np.broadcast_to([0.0, 1.0], (4, 2)), atol=1e-12)
    assert peak < 2**20, peak  # a converted k alone would be 256 MiB


def test_dropout_mask_shape_is_checked():
    with pytest.raises(ValueError, match=r"^the dropout mask would have shape \(1099511627776, 1099511627776\)"):
        sdpa.dropout_mask((2**40, 2**40), 0.1, 1)
    with pytest.raises(ValueError, match=r"^shape\b"):
        sdpa.dropout_mask((2**70, 0), 0.1, 1)
    with pytest.raises(ValueError, match=r"^shape\b"):
        sdpa.dropout_mask((-1, 2), 0.1, 1)
    for bad in (5, None, (1.5, 2), (2, "3"), (True, 2)):
        with pytest.raises(TypeError, match=r"^shape\b"):
            sdpa.dropout_mask(bad, 0.1, 1)
    assert sdpa.dropout_mask((2**40, 0), 0.1, 1).shape == (2**40, 0)
    assert sdpa.dropout_mask(np.array([3, 5]), 0.1, 1).shape == (3, 5)


# ---------------------------------------------------------------- the torch tests never skip in CI


@pytest.mark.parametrize("ci", ["1", ""])
def test_torch_tests_fail_in_ci_without_torch(ci):
    # scripts/test.sh installs torch; where CI is set, a missing torch must fail, not skip.
    code = ("import sys; sys.modules['torch'] = None; import pytest; "
            f"sys.exit(pytest.main(['-q', '-p', 'no:cacheprovider', {os.path.join(HERE, 'test_torch.py')!r}]))")
    env = dict(os.environ, CI=ci)
    run = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    if ci:
        assert run.returncode != 0 and "CI is set but torch cannot be imported" in run.stdout, run.stdout
        assert "skipped" not in run.stdout, run.stdout
    else:
        assert run.returncode in (0, 5) and "1 skipped" in run.stdout, run.stdout  # 5: no test ran
