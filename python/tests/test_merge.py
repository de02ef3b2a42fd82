"""sdpa.merge_attention, attention's out_dtype and attention_backward's grad_dtype (the float32
partials of 16-bit calls), through the NumPy front door, and sdpa.torch.merge_attention.

Key shards: each shard's attention call (k, v and the mask's key columns sliced alike) gives a
partial in the compute dtype; merging them equals the one call within the tolerance rule of
reference.py (twice the naive algorithm's error against float64, with its floors), measured
with sdpa's own backend="naive" and backend="reference" on the whole problem (they take sinks).
The C++ tests (tests/merge_test.cc) hold the merge's derived error bound against a float64 twin.
"""

import ml_dtypes
import numpy as np
import pytest

import sdpa
from reference import float64_tolerance, lowp_tolerance, assert_close

BF16 = np.dtype(ml_dtypes.bfloat16)
F16 = np.dtype(np.float16)
F32 = np.dtype(np.float32)
F64 = np.dtype(np.float64)
DTYPES = {"f32": F32, "f64": F64, "bf16": BF16, "f16": F16}


def _compute(dtype):
    return F64 if dtype == F64 else F32


def _case(dtype, seed, B=2, Hq=4, Hkv=2, Nq=37, Nk=300, Dk=16, Dv=24):
    rng = np.random.default_rng(seed)
    q = rng.standard_normal((B, Hq, Nq, Dk)).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, Dk)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, Dv)).astype(dtype)
    mask = rng.random((B, Hq, Nq, Nk)) < 0.7
    mask[:, :, ::7] = False        # fully masked rows
    mask[0, 0, :, 100:200] = False  # shard [100, 200) fully masked for head 0
    return q, k, v, mask


def _shards(q, k, v, mask, bounds, sinks=None, sinks_shard=1, **kw):
    outs, lses = [], []
    for s, (k0, k1) in enumerate(zip(bounds[:-1], bounds[1:])):
        out, lse = sdpa.attention(q, k[..., k0:k1, :], v[..., k0:k1, :], mask[..., k0:k1], return_lse=True,
                                  out_dtype=_compute(q.dtype), sinks=sinks if s == sinks_shard else None, **kw)
        outs.append(out)
        lses.append(lse)
    return outs, lses


@pytest.mark.parametrize("name", DTYPES)
@pytest.mark.parametrize("with_sinks", [False, True])
def test_key_shards_merge_to_the_one_call(name, with_sinks):
    dtype = DTYPES[name]
    q, k, v, mask = _case(dtype, 3)
    sinks = np.linspace(-1, 1, q.shape[1]) if with_sinks else None
    bounds = [0, 1, 100, 200, 200, 300]  # one key, a masked shard, an empty shard
    outs, lses = _shards(q, k, v, mask, bounds, sinks)
    assert all(o.dtype == _compute(dtype) for o in outs)
    out, lse = sdpa.merge_attention(outs, lses, out_dtype=dtype)
    assert out.dtype == dtype and lse.dtype == _compute(dtype)
    ref_out, ref_lse = sdpa.attention(q, k, v, mask, sinks=sinks, backend="reference", return_lse=True)
    naive_out, naive_lse = sdpa.attention(q, k, v, mask, sinks=sinks, backend="naive", return_lse=True)
    if dtype == F64:
        tol_out, tol_lse = float64_tolerance(ref_out), float64_tolerance(ref_lse)
    else:
        tol_out = lowp_tolerance(naive_out, ref_out, dtype)
        tol_lse = lowp_tolerance(naive_lse, ref_lse, F32)
    assert_close(out, ref_out, tol_out, "out")
    assert_close(lse, ref_lse, tol_lse, "lse")
    # Structure exact: fully masked rows give 0 (and lse -inf, or the sink).
    empty = ~mask.any(-1)
    assert (out.astype(F64)[empty] == 0).all()
    want = np.broadcast_to(sinks[None, :, None], empty.shape)[empty] if with_sinks else -np.inf
    np.testing.assert_array_equal(lse[empty], np.asarray(want, dtype=lse.dtype))


@pytest.mark.parametrize("name", DTYPES)
def test_fixed_order_is_bitwise_reproducible(name):
    q, k, v, mask = _case(DTYPES[name], 5)
    outs, lses = _shards(q, k, v, mask, [0, 128, 129, 300])
    a = sdpa.merge_attention(outs, lses)
    sdpa.set_num_threads(1)
    try:
        b = sdpa.merge_attention(tuple(outs), tuple(lses))
    finally:
        sdpa.set_num_threads(0)
    for x, y in zip(a, b):
        assert x.dtype == y.dtype and x.tobytes() == y.tobytes()


def test_two_way_merge_formula_and_masked_parts():
    out_a = np.array([[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], F32)
    out_b = np.array([[-1.0, 0.5], [np.nan, np.inf], [7.0, 8.0]], F32)
    lse_a = np.array([0.0, 1.0, -np.inf], F32)
    lse_b = np.array([np.log(3.0), -np.inf, -np.inf], F32)
    out, lse = sdpa.merge_attention([out_a, out_b], [lse_a, lse_b])
    np.testing.assert_allclose(out[0], (out_a[0] + 3 * out_b[0]) / 4, rtol=4e-7)
    np.testing.assert_allclose(lse[0], np.log(4.0), rtol=4e-7)
    np.testing.assert_array_equal(out[1], out_a[1])  # lse -inf: NaN and inf in its out are not read
    assert lse[1] == 1.0
    np.testing.assert_array_equal(out[2], [0.0, 0.0])  # every part empty
    assert not np.signbit(out[2]).any() and lse[2] == -np.inf


@pytest.mark.parametrize("name", ["bf16", "f16"])
@pytest.mark.parametrize("precision", ["exact", "fast"])
def test_float32_out_rounds_to_the_sixteen_bit_out(name, precision):
    dtype = DTYPES[name]
    q, k, v, mask = _case(dtype, 8)
    narrow, lse = sdpa.attention(q, k, v, mask, return_lse=True, precision=precision)
    for spelling in ("float32", np.float32, F32):
        wide, lse_w = sdpa.attention(q, k, v, mask, return_lse=True, precision=precision, out_dtype=spelling)
        assert wide.dtype == F32
        assert wide.astype(dtype).tobytes() == narrow.tobytes()
        assert lse_w.tobytes() == lse.tobytes()
    assert not np.array_equal(wide, wide.astype(dtype).astype(F32))  # it is not rounded


@pytest.mark.parametrize("name", ["bf16", "f16"])
def test_sixteen_bit_shard_gradients_sum_in_float32(name):
    """The backward of key shards (positions, the whole rows' out and lse) with grad_dtype="float32":
    the partials summed in float32 and rounded once are the gradients within the tolerance rule
    (naive = the whole problem's backend="naive" gradients). grad_dtype="float32" rounded to the
    16-bit dtype is grad_dtype=None's, bit for bit."""
    dtype = DTYPES[name]
    rng = np.random.default_rng(11)
    B, Hq, Hkv, N, Dk, Dv = 2, 4, 2, 97, 16, 24
    q, k, v = (rng.standard_normal((B, h, N, d)).astype(dtype) for h, d in ((Hq, Dk), (Hkv, Dk), (Hkv, Dv)))
    out, lse = sdpa.attention(q, k, v, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(dtype)
    ref = sdpa.attention_backward(dout, q, k, v, out, lse, causal=True, backend="reference")
    naive = sdpa.attention_backward(dout, q, k, v, out, lse, causal=True, backend="naive")
    sums = [np.zeros(t.shape, F32) for t in (q, k, v)]
    bounds = [0, 1, 40, 97]
    for q0, q1 in zip(bounds[:-1], bounds[1:]):
        for k0, k1 in zip(bounds[:-1], bounds[1:]):
            rows, keys = np.s_[..., q0:q1, :], np.s_[..., k0:k1, :]
            args = (dout[rows], q[rows], k[keys], v[keys], out[rows], lse[..., q0:q1])
            wide = sdpa.attention_backward(*args, causal=True, q_start=q0, k_start=k0, grad_dtype="float32")
            narrow = sdpa.attention_backward(*args, causal=True, q_start=q0, k_start=k0)
            for w, n in zip(wide, narrow):
                assert w.dtype == F32 and w.astype(dtype).tobytes() == n.tobytes()
            sums[0][rows] += wide[0]
            sums[1][keys] += wide[1]
            sums[2][keys] += wide[2]
    for got, want, yard, label in zip(sums, ref, naive, ("dq", "dk", "dv")):
        assert_close(got.astype(dtype), want, lowp_tolerance(yard, want, dtype), label)


def test_out_dtype_errors():
    q, k, v, _ = _case(BF16, 1, Nq=3, Nk=4)
    with pytest.raises(TypeError, match="out_dtype must be None or bfloat16 or float32"):
        sdpa.attention(q, k, v, out_dtype="float16")
    q32 = q.astype(F32)
    with pytest.raises(TypeError, match="out_dtype must be None or float32"):
        sdpa.attention(q32, k.astype(F32), v.astype(F32), out_dtype=np.float64)
    assert sdpa.attention(q32, k.astype(F32), v.astype(F32), out_dtype="float32").dtype == F32
    out, lse = sdpa.attention(q, k, v, return_lse=True)
    with pytest.raises(TypeError, match="grad_dtype must be None or bfloat16 or float32"):
        sdpa.attention_backward(out, q, k, v, out, lse, grad_dtype=np.float64)


def test_merge_errors():
    a = np.zeros((2, 3, 4), F32)
    la = np.zeros((2, 3), F32)
    with pytest.raises(ValueError, match="parts is empty"):
        sdpa.merge_attention([], [])
    with pytest.raises(ValueError, match="outs has 2 arrays but lses has 1"):
        sdpa.merge_attention([a, a], [la])
    with pytest.raises(ValueError, match=r"parts\[1\]\.out has shape \(2, 5, 4\) but out has shape \(2, 3, 4\)"):
        sdpa.merge_attention([a, np.zeros((2, 5, 4), F32)], [la, la])
    with pytest.raises(ValueError, match=r"parts\[0\]\.lse has shape \(3, 2\)"):
        sdpa.merge_attention([a], [la.T.copy()])
    bad = la.copy()
    bad[1, 2] = np.inf
    with pytest.raises(ValueError, match=r"parts\[1\]\.lse has \+inf at index \(1, 2\)"):
        sdpa.merge_attention([a, a], [la, bad])
    bad[1, 2] = np.nan
    with pytest.raises(ValueError, match=r"parts\[0\]\.lse has NaN"):
        sdpa.merge_attention([a], [bad])
    with pytest.raises(TypeError, match=r"lses\[0\] has dtype float16, but must be float32 or float64"):
        sdpa.merge_attention([a], [la.astype(F16)])
    with pytest.raises(TypeError, match=r"outs\[0\] has dtype int64"):
        sdpa.merge_attention([a.astype(np.int64)], [la])
    with pytest.raises(TypeError, match="out_dtype must be"):
        sdpa.merge_attention([a], [la], out_dtype="int8")


def test_merge_reads_any_layout_and_byte_order():
    rng = np.random.default_rng(2)
    outs = [rng.standard_normal((3, 5, 6)).astype(F32) for _ in range(3)]
    lses = [rng.standard_normal((3, 5)).astype(F32) for _ in range(3)]
    want = sdpa.merge_attention(outs, lses)
    got = sdpa.merge_attention([np.asfortranarray(outs[0]), outs[1].astype(">f4"), outs[2][:, ::-1][:, ::-1]],
                               [np.asfortranarray(lses[0]), lses[1].astype(">f4"), lses[2]])
    for x, y in zip(got, want):
        assert x.tobytes() == y.tobytes()


def test_torch_merge_matches_numpy():
    from torch_required import import_torch
    torch = import_torch()
    import sdpa.torch  # noqa: F401
    q, k, v, mask = _case(BF16, 4)
    outs, lses = _shards(q, k, v, mask, [0, 150, 300])
    want_out, want_lse = sdpa.merge_attention(outs, lses, out_dtype=BF16)
    t_outs = [torch.from_numpy(o) for o in outs]
    t_lses = [torch.from_numpy(l) for l in lses]
    out, lse = sdpa.torch.merge_attention(t_outs, t_lses, out_dtype=torch.bfloat16)
    assert out.dtype == torch.bfloat16 and lse.dtype == torch.float32
    assert out.view(torch.int16).numpy().tobytes() == want_out.view(np.int16).tobytes()
    assert lse.numpy().tobytes() == want_lse.tobytes()
    torch.library.opcheck(torch.ops.sdpa.merge_attention.default, (t_outs, t_lses, None))
    compiled = torch.compile(lambda a, b: sdpa.torch.merge_attention([a, b], t_lses), fullgraph=True,
                             backend="aot_eager")
    out2, _ = compiled(*t_outs)
    assert out2.dtype == torch.float32
    with pytest.raises(ValueError, match="outs has 1 tensors but lses has 2"):
        sdpa.torch.merge_attention(t_outs[:1], t_lses)
