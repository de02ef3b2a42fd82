"""Invalid arguments raise TypeError / ValueError, and each message names the argument."""

import re

import numpy as np
import pytest

import sdpa


def _qkv(rank=4, B=2, Hq=4, Hkv=2, Nq=3, Nk=5, Dk=8, Dv=6):
    rng = np.random.default_rng(0)
    lead_q = {2: (), 3: (Hq,), 4: (B, Hq)}[rank]
    lead_kv = {2: (), 3: (Hkv,), 4: (B, Hkv)}[rank]
    return (rng.standard_normal(lead_q + (Nq, Dk)), rng.standard_normal(lead_kv + (Nk, Dk)),
            rng.standard_normal(lead_kv + (Nk, Dv)))


def test_valid_call_works():
    # The baseline every error test below perturbs in one way only.
    q, k, v = _qkv()
    assert sdpa.attention(q, k, v, np.ones((3, 5), bool), causal=True, scale=0.5, window=(1, 1)).shape == (2, 4, 3, 6)


# ---------------------------------------------------------------- TypeError


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("bad", ["complex", "object", "string", "bytes", "datetime"])
def test_non_real_inputs_raise_type_error(which, bad):
    args = dict(zip("qkv", _qkv()))
    a = args[which]
    args[which] = {
        "complex": lambda: a.astype(np.complex128),
        "object": lambda: a.astype(object),
        "string": lambda: a.astype(str),
        "bytes": lambda: a.astype("S8"),
        "datetime": lambda: a.astype(np.int64).astype("datetime64[s]"),
    }[bad]()
    with pytest.raises(TypeError, match=rf"^{which}\b"):
        sdpa.attention(**args)


def test_nested_list_of_strings_raises_type_error():
    with pytest.raises(TypeError, match=r"^q\b"):
        sdpa.attention([["a", "b"]], [[1.0, 2.0]], [[1.0]])


@pytest.mark.parametrize("which", ["q", "k", "v", "mask"])
def test_ragged_nested_list_names_the_argument(which):
    args = {"q": [[1.0, 2.0]], "k": [[1.0, 2.0]], "v": [[1.0]], "mask": None}
    args[which] = [[1.0, 2.0], [3.0]]
    with pytest.raises(ValueError, match=rf"^{which} is not a rectangular array"):
        sdpa.attention(args["q"], args["k"], args["v"], args["mask"])


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad,word", [(np.inf, r"\+inf"), (np.nan, "NaN")])
def test_float_mask_with_plus_inf_or_nan(bad, word, dtype):
    q, k, v = (a.astype(dtype) for a in _qkv())
    mask = np.zeros((3, 5), dtype)
    mask[1, 0] = -np.inf  # blocks: fine
    sdpa.attention(q, k, v, mask)
    mask[2, 3] = bad
    with pytest.raises(ValueError, match=rf"^mask has {word} at index \(2, 3\)"):
        sdpa.attention(q, k, v, mask)


@pytest.mark.parametrize("dtype", [np.int64, np.int32, np.uint8, np.int8])
def test_integer_mask_raises_type_error(dtype):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^mask\b.*bool"):
        sdpa.attention(q, k, v, np.ones((3, 5), dtype=dtype))


@pytest.mark.parametrize("mask", [np.ones((3, 5), np.complex64), np.ones((3, 5)).astype(object),
                                  np.full((3, 5), "x"), [[1, 0, 1, 0, 1]] * 3],
                         ids=["complex", "object", "string", "int-list"])
def test_other_non_bool_non_float_masks_raise_type_error(mask):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^mask\b"):
        sdpa.attention(q, k, v, mask)


@pytest.mark.parametrize("scale", ["0.5", True, [0.5], 1j])
def test_non_real_scale_raises_type_error(scale):
    q, k, v = _qkv()
    with pytest.raises(TypeError, match=r"^scale\b"):
        sdpa.attention(q, k, v, scale=scale)


# ---------------------------------------------------------------- shapes


def test_dk_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^k has Dk=7 but q has Dk=8"):
        sdpa.attention(q, k[..., :7], v)


def test_nk_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^v has Nk=4 but k has Nk=5"):
        sdpa.attention(q, k, v[:, :, :4])


@pytest.mark.parametrize("hq,hkv", [(3, 2), (4, 3), (1, 2), (5, 4)])
def test_hq_not_a_multiple_of_hkv(hq, hkv):
    q, k, v = _qkv(Hq=hq, Hkv=hkv)
    with pytest.raises(ValueError, match=rf"^q has Hq={hq}\b.*multiple.*Hkv={hkv}"):
        sdpa.attention(q, k, v)


def test_k_and_v_heads_differ():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^v has 1 heads but k has 2"):
        sdpa.attention(q, k, v[:, :1])


def test_batch_mismatch():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^k has batch 1 but q has batch 2"):
        sdpa.attention(q, k[:1], v[:1])
    with pytest.raises(ValueError, match=r"^v has batch 1 but q has batch 2"):
        sdpa.attention(q, k, v[:1])


@pytest.mark.parametrize("which", ["q", "k", "v"])
@pytest.mark.parametrize("rank", [0, 1, 5])
def test_bad_rank(which, rank):
    args = dict(zip("qkv", _qkv()))
    args[which] = np.ones((2,) * rank)
    with pytest.raises(ValueError, match=rf"^{which} has shape .* must have 2, 3 or 4 dims"):
        sdpa.attention(**args)


@pytest.mark.parametrize("ranks,which", [((3, 4, 4), "k"), ((4, 3, 3), "k"), ((4, 4, 3), "v"),
                                         ((2, 3, 3), "k"), ((3, 3, 2), "v")])
def test_rank_mismatch(ranks, which):
    q = _qkv(rank=ranks[0])[0]
    k = _qkv(rank=ranks[1])[1]
    v = _qkv(rank=ranks[2])[2]
    with pytest.raises(ValueError, match=rf"^{which} has rank {ranks['qkv'.index(which)]} but q has rank {ranks[0]}"):
        sdpa.attention(q, k, v)


# ---------------------------------------------------------------- masks


@pytest.mark.parametrize("shape", [(3, 4), (4,), (2, 1), (3, 3, 5), (2, 2, 3, 5), (1, 3, 1, 1)],
                         ids=str)
@pytest.mark.parametrize("kind", [bool, np.float64])
def test_mask_that_does_not_broadcast(shape, kind):
    q, k, v = _qkv()  # scores (2, 4, 3, 5)
    with pytest.raises(ValueError, match=r"^mask has shape .*does not broadcast"):
        sdpa.attention(q, k, v, np.ones(shape, dtype=kind))


def test_mask_with_more_dims_than_q():
    q, k, v = _qkv(rank=2)
    with pytest.raises(ValueError, match=r"^mask has shape \(1, 3, 5\), more dims than the scores"):
        sdpa.attention(q, k, v, np.ones((1, 3, 5), bool))
    q, k, v = _qkv(rank=4)
    with pytest.raises(ValueError, match=r"^mask\b"):
        sdpa.attention(q, k, v, np.ones((1, 2, 4, 3, 5), bool))


@pytest.mark.parametrize("kind", [bool, np.float64, np.float32])
@pytest.mark.parametrize("rank", [2, 4])
def test_mask_with_five_dims_names_its_shape(kind, rank):
    # Checked in Python: _core would only say "more than 4 dims", without the shape.
    q, k, v = _qkv(rank=rank)
    scores = {2: r"\(3, 5\)", 4: r"\(2, 4, 3, 5\)"}[rank]
    for fn in (lambda m: sdpa.attention(q, k, v, m),
               lambda m: sdpa.attention_backward(np.ones((*q.shape[:-1], 6)), q, k, v, np.ones((*q.shape[:-1], 6)),
                                                 np.zeros(q.shape[:-1]), m)):
        with pytest.raises(ValueError, match=rf"^mask has shape \(1, 2, 4, 3, 5\), more dims than the scores "
                                             rf"{scores}; a mask has at most 4 dims"):
            fn(np.ones((1, 2, 4, 3, 5), dtype=kind))


@pytest.mark.parametrize("big", [1e300, 3.5e38, np.finfo(np.float64).max])
def test_float64_mask_too_large_for_float32_raises(big):
    # float32 q, k, v compute in float32, so a float64 mask is converted; a finite bias above
    # float32's max would become +inf, which the caller never passed: refused by name.
    q, k, v = (a.astype(np.float32) for a in _qkv())
    mask = np.zeros((3, 5))
    mask[0, 1] = -np.inf
    mask[2, 3] = big
    with pytest.raises(ValueError, match=rf"^mask has {re.escape(str(np.float64(big)))} at index \(2, 3\), "
                                         r"which does not fit in float32"):
        sdpa.attention(q, k, v, mask)
    with pytest.raises(ValueError, match=r"^mask has .* at index \(2, 3\), which does not fit in float32"):
        sdpa.attention_backward(np.ones((2, 4, 3, 6), np.float32), q, k, v, np.ones((2, 4, 3, 6), np.float32),
                                np.zeros((2, 4, 3), np.float32), mask)
    mask[2, 3] = np.float32(3.4e38)  # the largest values that fit are fine
    mask[2, 4] = np.finfo(np.float32).max
    sdpa.attention(q, k, v, mask)
    mask[2, 3] = np.inf  # a real +inf is still reported as +inf
    mask[2, 4] = 0
    with pytest.raises(ValueError, match=r"^mask has \+inf at index \(2, 3\)"):
        sdpa.attention(q, k, v, mask)


def test_float64_mask_too_large_for_float32_in_a_broadcast_mask():
    q, k, v = (a.astype(np.float32) for a in _qkv())
    mask = np.zeros((4, 1, 5))
    mask[3, 0, 2] = 1e39
    with pytest.raises(ValueError, match=r"^mask has 1e\+39 at index \(3, 0, 2\), which does not fit in float32"):
        sdpa.attention(q, k, v, mask)
    sdpa.attention(q.astype(np.float64), k, v, mask)  # float64 computes in float64: it fits


def test_float64_mask_too_negative_for_float32_blocks():
    # Documented: a bias below float32's lowest value becomes -inf, i.e. blocks ...
    q, k, v = (a.astype(np.float32) for a in _qkv())
    mask = np.zeros((3, 5))
    mask[0, 1] = mask[1, 4] = -1e300
    mask[2] = -1e300  # every key of row 2
    blocked = np.where(mask == -1e300, -np.inf, mask)
    out, w, lse = sdpa.attention(q, k, v, mask, return_weights=True, return_lse=True)
    want = sdpa.attention(q, k, v, blocked.astype(np.float32), return_weights=True, return_lse=True)
    for got, ref in zip((out, w, lse), want):
        np.testing.assert_array_equal(got, ref)
    assert (w[..., 0, 1] == 0).all() and (w[..., 1, 4] == 0).all()
    # ... so a row whose every key has such a bias is the fully masked row: zeros, lse = -inf,
    assert (out[..., 2, :] == 0).all() and (lse[..., 2] == -np.inf).all()
    # ... while the other rows are those of float64, where -1e300 is finite but as good as -inf.
    out64, lse64 = sdpa.attention(*(a.astype(np.float64) for a in (q, k, v)), mask, return_lse=True)
    np.testing.assert_allclose(out[..., :2, :], out64[..., :2, :], rtol=0, atol=1e-5)
    np.testing.assert_allclose(lse[..., :2], lse64[..., :2], rtol=0, atol=1e-5)
    assert np.isfinite(lse64[..., 2]).all()  # float64 still weighs row 2's keys


# ---------------------------------------------------------------- options


@pytest.mark.parametrize("causal", ["yes", "bottom-right", "TOP_LEFT", 2, -1, 0.5, "causal", [True], 1, 0, 1.0,
                                    np.int64(1), {}])
def test_unknown_causal_mode(causal):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^causal must be"):
        sdpa.attention(q, k, v, causal=causal)


@pytest.mark.parametrize("window", [5, (1,), (1, 2, 3), "ab", (1.5, 2), (1, 2.0), (True, 0), (0, "1"),
                                    (1, np.float64(2))],
                         ids=str)
def test_bad_window(window):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^window\b"):
        sdpa.attention(q, k, v, window=window)


@pytest.mark.parametrize("causal,code", [(np.True_, True), (np.False_, False), (None, False)])
def test_causal_accepts_numpy_bools_and_none(causal, code):
    q, k, v = _qkv()
    np.testing.assert_array_equal(sdpa.attention(q, k, v, causal=causal), sdpa.attention(q, k, v, causal=code))


def test_scale_accepts_zero_dim_arrays():
    q, k, v = _qkv()
    np.testing.assert_array_equal(sdpa.attention(q, k, v, scale=np.array(0.5)), sdpa.attention(q, k, v, scale=0.5))
    with pytest.raises(TypeError, match=r"^scale must be a real number"):
        sdpa.attention(q, k, v, scale=np.array([0.5]))


def test_window_accepts_numpy_integers():
    q, k, v = _qkv()
    a = sdpa.attention(q, k, v, window=(np.int64(1), np.int32(2)))
    np.testing.assert_array_equal(a, sdpa.attention(q, k, v, window=(1, 2)))


@pytest.mark.parametrize("scale", [float("nan"), float("inf"), -float("inf"), np.float32("nan"), np.float64("inf")])
def test_non_finite_scale(scale):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^scale must be finite"):
        sdpa.attention(q, k, v, scale=scale)


@pytest.mark.parametrize("backend", ["fast", "AUTO", "flash ", "", None, 0, "reference\0"])
def test_unknown_backend(backend):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^backend must be"):
        sdpa.attention(q, k, v, backend=backend)


def test_later_calls_work_after_an_error():
    # A failed call leaves no state behind: the next valid call gives the same result as
    # before it, and the inputs are untouched.
    q, k, v = _qkv()
    copies = [a.copy() for a in (q, k, v)]
    good = sdpa.attention(q, k, v)
    with pytest.raises(ValueError):
        sdpa.attention(q, k, v, causal="sideways")
    with pytest.raises(ValueError):
        sdpa.attention(q, k, v[:, :, :4])  # fails inside _core
    with pytest.raises(ValueError):
        sdpa.attention(q, k, v, np.full((3, 5), np.nan))
    for a, b in zip((q, k, v), copies):
        np.testing.assert_array_equal(a, b)
    np.testing.assert_array_equal(sdpa.attention(q, k, v), good)


# ---------------------------------------------------------------- issue 26: integers that do not fit


@pytest.mark.parametrize("fn", ["attention", "attention_backward", "inspect"])
@pytest.mark.parametrize("block_size,error", [(2**64, ValueError), ((2, -2**64), ValueError), ((2**70, 2), ValueError),
                                              (2.0, TypeError), ((2, "2"), TypeError), ((2, True), TypeError)],
                         ids=repr)
def test_block_size_is_checked_by_name(fn, block_size, error):
    # block_size=2**64 gave nanobind's "incompatible function arguments" dump.
    q, k, v = _qkv()
    args = {"attention": (q, k, v), "inspect": (q, k, v),
            "attention_backward": (np.ones((2, 4, 3, 6)), q, k, v, np.ones((2, 4, 3, 6)), np.zeros((2, 4, 3)))}[fn]
    with pytest.raises(error, match=r"^block_size must be an integer") as info:
        getattr(sdpa, fn)(*args, block_mask=np.ones((1, 1), bool), block_size=block_size)
    assert "incompatible function arguments" not in str(info.value)


@pytest.mark.parametrize("kw,name", [(dict(topk=2**64), "topk"), (dict(cells=2**64), "cells"),
                                     (dict(max_heads=2**64), "max_heads"), (dict(max_heads=-2**64), "max_heads")],
                         ids=repr)
def test_inspect_integers_beyond_int64_are_named(kw, name):
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=rf"^{name} must be an integer in") as info:
        sdpa.inspect(q, k, v, progress=False, **kw)
    assert "incompatible function arguments" not in str(info.value)
