"""sdpa.torch against torch.nn.functional.scaled_dot_product_attention, forward and backward,
and torch.autograd.gradcheck in float64. Runs only where torch is installed:

    .venv/bin/pip install torch && .venv/bin/python -m pytest python/tests/test_torch.py
"""

import numpy as np
import pytest

torch = pytest.importorskip("torch")
F = torch.nn.functional
from sdpa.torch import scaled_dot_product_attention  # noqa: E402


def tensors(shapes, dtype, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g, dtype=dtype, requires_grad=True) for s in shapes]


CASES = [  # (q shape, k shape, v shape, kwargs)
    ((2, 4, 33, 16), (2, 4, 65, 16), (2, 4, 65, 8), {}),
    ((2, 4, 33, 16), (2, 4, 65, 16), (2, 4, 65, 8), {"is_causal": True}),
    ((1, 8, 40, 32), (1, 2, 40, 32), (1, 2, 40, 32), {"enable_gqa": True}),
    ((3, 17, 8), (3, 17, 8), (3, 17, 8), {"scale": 0.3}),
    ((2, 2, 20, 8), (2, 2, 30, 8), (2, 2, 30, 8), {"attn_mask": "bool"}),
    ((2, 2, 20, 8), (2, 2, 30, 8), (2, 2, 30, 8), {"attn_mask": "float"}),
    ((2, 2, 20, 8), (2, 2, 30, 8), (2, 2, 30, 8), {"attn_mask": "bool_empty_rows"}),
    ((2, 2, 20, 8), (2, 2, 30, 8), (2, 2, 30, 8), {"attn_mask": "float_empty_rows"}),
    ((2, 4, 9, 8), (2, 1, 12, 8), (2, 1, 12, 8), {}),  # one kv head: torch broadcasts it
]


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("qs,ks,vs,kwargs", CASES)
def test_matches_torch_forward_and_backward(qs, ks, vs, kwargs, dtype, tol):
    kwargs = dict(kwargs)
    L, S = qs[-2], ks[-2]
    mask = kwargs.get("attn_mask")
    if mask in ("bool", "bool_empty_rows", "float_empty_rows"):
        kwargs["attn_mask"] = torch.rand(L, S, generator=torch.Generator().manual_seed(1)) > 0.3
        kwargs["attn_mask"][:, 0] = True
        if mask != "bool":
            # Rows with no allowed key: torch (2.15) gives zeros and zero gradients there, as sdpa
            # does (earlier torch versions gave NaN).
            kwargs["attn_mask"][3] = kwargs["attn_mask"][-1] = False
        if mask == "float_empty_rows":
            kwargs["attn_mask"] = torch.zeros(L, S, dtype=dtype).masked_fill(~kwargs["attn_mask"], float("-inf"))
    elif mask == "float":
        kwargs["attn_mask"] = torch.randn(L, S, generator=torch.Generator().manual_seed(2), dtype=dtype)
    q, k, v = tensors((qs, ks, vs), dtype)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ours = scaled_dot_product_attention(q, k, v, **kwargs)
    theirs = F.scaled_dot_product_attention(q2, k2, v2, **kwargs)
    assert ours.dtype == theirs.dtype
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
    g = torch.randn(ours.shape, generator=torch.Generator().manual_seed(3), dtype=dtype)
    ours.backward(g)
    theirs.backward(g)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)


@pytest.mark.parametrize("kwargs", [{}, {"is_causal": True}, {"scale": 0.7}])
def test_gradcheck_float64(kwargs):
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), torch.float64, seed=4)
    assert torch.autograd.gradcheck(lambda q, k, v: scaled_dot_product_attention(q, k, v, **kwargs), (q, k, v))


def test_dropout_is_reproducible_and_differentiable():
    q, k, v = tensors(((2, 9, 4), (2, 11, 4), (2, 11, 4)), torch.float64, seed=5)
    torch.manual_seed(0)
    a = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    torch.manual_seed(0)
    b = scaled_dot_product_attention(q, k, v, dropout_p=0.3)
    assert torch.equal(a, b)
    assert not torch.equal(a, scaled_dot_product_attention(q, k, v))

    def with_fixed_mask(q, k, v):
        torch.manual_seed(7)  # the same dropout seed on every evaluation gradcheck makes
        return scaled_dot_product_attention(q, k, v, dropout_p=0.3)

    assert torch.autograd.gradcheck(with_fixed_mask, (q, k, v))


@pytest.mark.parametrize("kv_heads,enable_gqa", [(2, False), (3, True)])
def test_mismatched_heads_raise_like_torch(kv_heads, enable_gqa):
    q, k, v = tensors(((1, 4, 5, 8), (1, kv_heads, 5, 8), (1, kv_heads, 5, 8)), torch.float32)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)
    with pytest.raises(RuntimeError, match=rf"query \(1, 4, 5, 8\), key \(1, {kv_heads}, 5, 8\)"):
        scaled_dot_product_attention(q, k, v, enable_gqa=enable_gqa)


def test_inplace_change_of_output_raises_like_torch():
    # Our backward reads the output, as torch's flash kernel does (its math fallback, taken
    # e.g. when Ev != E, does not, and allows the in-place change).
    for sdpa_fn in (F.scaled_dot_product_attention, scaled_dot_product_attention):
        q, k, v = tensors(((1, 2, 5, 4), (1, 2, 7, 4), (1, 2, 7, 4)), torch.float32)
        out = sdpa_fn(q, k, v)
        out.mul_(3)
        with pytest.raises(RuntimeError, match="modified by an inplace operation"):
            out.sum().backward()


def test_mask_gradient_is_refused():
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), torch.float32)
    mask = torch.randn(5, 7, requires_grad=True)
    with pytest.raises(ValueError, match=r"attn_mask.*not supported.*attn_mask\.detach\(\)"):
        scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask.detach())
    torch.testing.assert_close(out, F.scaled_dot_product_attention(q, k, v, attn_mask=mask.detach()))
    with torch.no_grad():  # no gradient is asked for: nothing to refuse
        scaled_dot_product_attention(q, k, v, attn_mask=mask)


@pytest.mark.parametrize("p", [1.0, -0.1])
def test_dropout_p_outside_0_1_raises(p):
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), torch.float32)
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=p)


def test_no_copy_for_contiguous_inputs():
    q = torch.randn(2, 3, 4)
    from sdpa.torch import _numpy
    assert np.shares_memory(_numpy(q), q.numpy())
