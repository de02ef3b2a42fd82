"""The float mask's gradient (dbias, a learned bias: T5's relative positions): sdpa.attention_backward
with return_dbias against the same maths in NumPy float64, summed over the mask's broadcast dims;
and sdpa.torch giving a mask that requires grad its gradient, against PyTorch's own function, at a
tolerance derived from the error of PyTorch's same-precision computation against float64. The
torch half is skipped without torch, except where CI is set (as test_torch.py)."""


import numpy as np
import pytest

import sdpa
from torch_required import import_torch


def softmax_grads(q, k, v, mask, dout, scale, causal=False):
    """dS = P * (dP - D) for 4-D float64 arrays (B, H, N, D), mask broadcast; top-left causal."""
    s = q @ np.swapaxes(k, -1, -2) * scale + mask
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.arange(S)[None, :] > np.arange(L)[:, None], -np.inf, s)
    m = s.max(-1, keepdims=True)
    p = np.exp(s - m)
    p /= p.sum(-1, keepdims=True)
    out = p @ v
    dp = dout @ np.swapaxes(v, -1, -2)
    D = (dout * out).sum(-1, keepdims=True)
    return out, p * (dp - D)


def dbias_bound(q, k, v, mask, dout, scale, causal, shape, eps, out_eps=0.0):
    """The rounding error bound of dbias computed in a precision of unit roundoff eps (float64
    arrays in): per score, p · (Σ|dout·v| + Σ|dout·out| + |dp - D| · 2 (S + |lse|)) with S the
    size of the score's terms (the error of the score moves p by p times it), summed over the
    scores an element reads, times 4 (tests/bias_grad_test.cc derives the same). out_eps: the
    unit roundoff of the out the backward is given (bfloat16's for bfloat16 inputs), which
    moves D = Σ dout·out by up to out_eps · Σ|dout·out|: twice that, per score, times p."""
    out, ds = softmax_grads(q, k, v, mask, dout, scale, causal)
    s = q @ np.swapaxes(k, -1, -2) * scale + mask
    size = np.abs(q) @ np.swapaxes(np.abs(k), -1, -2) * abs(scale) + np.abs(mask)
    if causal:
        L, S = s.shape[-2:]
        s = np.where(np.arange(S)[None, :] > np.arange(L)[:, None], -np.inf, s)
    m = s.max(-1, keepdims=True)
    lse = m + np.log(np.exp(s - m).sum(-1, keepdims=True))
    p = np.exp(s - lse)
    dp = dout @ np.swapaxes(v, -1, -2)
    D = (dout * out).sum(-1, keepdims=True)
    mag = p * (np.abs(dout) @ np.swapaxes(np.abs(v), -1, -2) + np.abs(dout * out).sum(-1, keepdims=True)
               + np.abs(dp - D) * 2 * (size + np.abs(lse)))
    D_size = np.abs(dout * out).sum(-1, keepdims=True)
    return 4 * eps * summed_like(np.where(p > 0, mag, 0.0), shape) + 2 * out_eps * summed_like(p * D_size, shape)


def summed_like(ds, shape):
    """ds (B, H, L, S) summed down to a mask of `shape` (NumPy broadcasting in reverse)."""
    lead = ds.ndim - len(shape)
    ds = ds.sum(axis=tuple(range(lead))) if lead else ds
    axes = tuple(n for n, extent in enumerate(shape) if extent == 1 and ds.shape[n] != 1)
    return ds.sum(axis=axes, keepdims=True).reshape(shape)


@pytest.mark.parametrize("mask_shape", [(2, 3, 5, 7), (5, 7), (1, 3, 1, 7), (2, 1, 1, 7), (3, 5, 1), ()])
@pytest.mark.parametrize("dtype", [np.float64, np.float32])
@pytest.mark.parametrize("causal", [False, True])
def test_dbias_matches_numpy(mask_shape, dtype, causal):
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 5, 4), (2, 3, 7, 4), (2, 3, 7, 6)))
    mask = rng.standard_normal(mask_shape)
    dout = rng.standard_normal((2, 3, 5, 6))
    scale = 0.5
    cast = [a.astype(dtype) for a in (q, k, v, mask, dout)]
    out, lse = sdpa.attention(*cast[:3], cast[3], causal="top_left" if causal else False, scale=scale,
                              return_lse=True)
    dq, dk, dv, dbias = sdpa.attention_backward(cast[4], *cast[:3], out, lse, cast[3],
                                                causal="top_left" if causal else False, scale=scale,
                                                return_dbias=True)
    assert dbias.shape == mask_shape and dbias.dtype == dtype
    _, ds = softmax_grads(*(a.astype(np.float64) for a in cast[:3]), cast[3].astype(np.float64),
                          cast[4].astype(np.float64), scale, causal)
    want = summed_like(ds, mask_shape)
    wide = [a.astype(np.float64) for a in cast]
    tol = dbias_bound(*wide[:4], wide[4], scale, causal, mask_shape, np.finfo(dtype).eps / 2)
    assert np.all(np.abs(dbias - want) <= tol + np.finfo(dtype).eps / 2 * np.abs(want))
    # The other gradients do not change when dbias is asked for.
    again = sdpa.attention_backward(cast[4], *cast[:3], out, lse, cast[3], causal="top_left" if causal else False,
                                    scale=scale)
    for a, b in zip((dq, dk, dv), again):
        np.testing.assert_array_equal(a, b)


def test_dbias_with_sinks_comes_last():
    rng = np.random.default_rng(2)
    q, k, v = (rng.standard_normal(s) for s in ((2, 3, 4), (2, 6, 4), (2, 6, 4)))
    mask = rng.standard_normal((3, 6))
    sinks = np.array([0.5, -0.5])
    out, lse = sdpa.attention(q, k, v, mask, sinks=sinks, return_lse=True)
    grads = sdpa.attention_backward(np.ones_like(out), q, k, v, out, lse, mask, sinks=sinks, return_dbias=True)
    assert len(grads) == 5 and grads[3].shape == (2,) and grads[4].shape == (3, 6)


@pytest.mark.parametrize("mask", [None, "bool"])
def test_return_dbias_needs_a_float_mask(mask):
    rng = np.random.default_rng(3)
    q, k, v = (rng.standard_normal(s) for s in ((3, 4), (5, 4), (5, 4)))
    m = None if mask is None else rng.standard_normal((3, 5)) > 0
    out, lse = sdpa.attention(q, k, v, m, return_lse=True)
    with pytest.raises(ValueError, match="return_dbias=True needs a float mask"):
        sdpa.attention_backward(np.ones_like(out), q, k, v, out, lse, m, return_dbias=True)


# ---- sdpa.torch ----

TORCH_CASES = [  # (q, k, v shapes, mask shape, kwargs)
    ((2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 5), (2, 3, 9, 11), {}),
    ((2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 5), (9, 11), {}),          # T5: one bias for every batch and head
    ((2, 3, 9, 8), (2, 3, 11, 8), (2, 3, 11, 5), (1, 3, 9, 11), {}),    # per head
    ((2, 4, 9, 8), (2, 2, 11, 8), (2, 2, 11, 8), (2, 1, 1, 11), {"enable_gqa": True}),
    ((3, 9, 8), (3, 11, 8), (3, 11, 8), (3, 9, 11), {"scale": 0.2}),
]


@pytest.mark.parametrize("shapes", TORCH_CASES)
@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16"])
def test_torch_mask_gradient_matches_pytorch(shapes, dtype):
    torch = import_torch()
    qs, ks, vs, ms, kwargs = shapes
    dt = getattr(torch, dtype)
    mask_dtype = torch.float32 if dt == torch.bfloat16 else dt  # PyTorch's float32 mask on bfloat16
    g = torch.Generator().manual_seed(4)
    # Values that the dtypes hold exactly, so that the float64 truth has the same inputs.
    q, k, v, dout = (torch.randn(s, generator=g, dtype=torch.float64).to(dt).double()
                     for s in (qs, ks, vs, qs[:-1] + vs[-1:]))
    m = torch.randn(ms, generator=g, dtype=torch.float64).to(mask_dtype).double()

    def grads(fn, t, mt):
        qq, kk, vv = (x.to(t).clone().requires_grad_() for x in (q, k, v))
        mask = m.to(mt).clone().requires_grad_()
        out = fn(qq, kk, vv, attn_mask=mask, **kwargs)
        out.backward(dout.to(out.dtype))
        return mask.grad.double(), qq.grad.double()

    got, got_dq = grads(sdpa.torch.scaled_dot_product_attention, dt, mask_dtype)
    want, want_dq = grads(torch.nn.functional.scaled_dot_product_attention, torch.float64, torch.float64)
    assert got.shape == ms
    # sdpa computes in float64, or float32 for float32 and bfloat16, and rounds dbias once to
    # the mask's dtype: the bound of tests/bias_grad_test.cc, from the float64 values.
    qn, kn, vn, mn, dn = (x.numpy() for x in (q, k, v, m, dout))
    if kwargs.get("enable_gqa"):
        kn, vn = (np.repeat(x, qs[1] // ks[1], axis=1) for x in (kn, vn))
    scale = kwargs.get("scale", 1 / np.sqrt(qs[-1]))
    eps = np.finfo(np.float64 if dt == torch.float64 else np.float32).eps / 2
    out_eps = 2.0 ** -8 if dt == torch.bfloat16 else 0.0  # out is rounded to bfloat16 before the backward reads it
    tol = dbias_bound(qn, kn, vn, mn, dn, scale, False, ms, eps, out_eps) + eps * np.abs(want.numpy())
    assert np.all(np.abs(got.numpy() - want.numpy()) <= tol)
    if dt == torch.float64:
        torch.testing.assert_close(got_dq, want_dq, rtol=0, atol=1e-10)


def test_torch_mask_gradient_gradcheck():
    torch = import_torch()
    g = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True) for s in
               ((1, 2, 4, 3), (1, 2, 5, 3), (1, 2, 5, 3)))
    mask = torch.randn(2, 4, 5, generator=g, dtype=torch.float64, requires_grad=True)
    assert torch.autograd.gradcheck(
        lambda q, k, v, m: sdpa.torch.scaled_dot_product_attention(q, k, v, attn_mask=m), (q, k, v, mask))


def test_torch_mask_alone_requires_grad():
    torch = import_torch()
    g = torch.Generator().manual_seed(6)
    q, k, v = (torch.randn(s, generator=g) for s in ((2, 5, 4), (2, 7, 4), (2, 7, 3)))
    mask = torch.randn(5, 7, generator=g, requires_grad=True)
    sdpa.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask).sum().backward()
    qd, kd, vd, md = (x.double() for x in (q, k, v, mask.detach()))
    md.requires_grad_()
    torch.nn.functional.scaled_dot_product_attention(qd, kd, vd, attn_mask=md).sum().backward()
    assert (mask.grad.double() - md.grad).abs().max().item() < 1e-5
    with torch.no_grad():  # nothing asked: no gradient pass
        sdpa.torch.scaled_dot_product_attention(q, k, v, attn_mask=mask)
