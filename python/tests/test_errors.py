"""Invalid arguments raise TypeError / ValueError, and each message names the argument."""

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


def test_errors_leave_nothing_half_done():
    # An error is raised before anything is computed: a bad option after good inputs still
    # raises, and a later valid call is unaffected.
    q, k, v = _qkv()
    good = sdpa.attention(q, k, v)
    with pytest.raises(ValueError):
        sdpa.attention(q, k, v, causal="sideways")
    np.testing.assert_array_equal(sdpa.attention(q, k, v), good)
