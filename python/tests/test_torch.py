"""sdpa.torch against torch.nn.functional.scaled_dot_product_attention, forward and backward,
and torch.autograd.gradcheck in float64. scripts/test.sh installs torch
(python/requirements-test.txt) before running it; elsewhere it runs where torch is installed:

    .venv/bin/pip install -r python/requirements-test.txt && .venv/bin/python -m pytest python/tests/test_torch.py

Without torch the module is skipped, except where the environment variable CI is set: there
it fails, so that CI never passes without having run it.
"""


import numpy as np
import pytest

from torch_required import import_torch  # noqa: E402

torch = import_torch(module_level=True)
F = torch.nn.functional
from sdpa.torch import scaled_dot_product_attention  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    """sdpa's and torch's results do not depend on the thread count, but with tiny tensors on a
    busy machine their thread pools cost far more than the arithmetic (gradcheck makes
    hundreds of calls): run this module on one thread each."""
    import sdpa
    before = sdpa.num_threads(), torch.get_num_threads()
    sdpa.set_num_threads(1)
    torch.set_num_threads(1)
    yield
    sdpa.set_num_threads(before[0])
    torch.set_num_threads(before[1])


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
    ((2, 4, 9, 8), (2, 1, 12, 8), (2, 1, 12, 8), {"enable_gqa": True}),
    ((2, 4, 9, 8), (2, 1, 12, 8), (2, 4, 12, 8), {}),  # key broadcast, value not
    ((2, 1, 9, 8), (2, 3, 12, 8), (2, 3, 12, 8), {}),  # one query head broadcast
    ((1, 8, 9, 8), (1, 2, 12, 8), (1, 4, 12, 6), {"enable_gqa": True}),  # GQA, key and value head counts differ
    ((1, 6, 9, 8), (1, 2, 12, 8), (1, 3, 12, 6), {"enable_gqa": True, "is_causal": True}),
    ((2, 4, 9, 8), (1, 4, 12, 8), (2, 4, 12, 8), {}),  # batch broadcast
    ((17, 8), (23, 8), (23, 5), {"is_causal": True}),  # rank 2
    ((2, 3, 2, 9, 8), (2, 3, 2, 12, 8), (2, 3, 2, 12, 8), {"attn_mask": "float"}),  # rank 5
    ((2, 3, 4, 9, 8), (3, 2, 12, 8), (1, 2, 12, 8), {"enable_gqa": True, "attn_mask": "bool"}),  # rank 5 vs 4
    ((4, 9, 8), (2, 4, 12, 8), (2, 4, 12, 8), {}),  # rank 3 query against rank 4 key and value
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


@pytest.mark.parametrize("p", [1.0, -0.1])
def test_dropout_p_outside_0_1_raises(p):
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), torch.float32)
    with pytest.raises(ValueError, match="dropout_p"):
        scaled_dot_product_attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("p,error", [(10**400, ValueError), (-10**400, ValueError), ("0.1", TypeError),
                                     (None, TypeError), (float("nan"), ValueError)],
                         ids=["1e400", "-1e400", "str", "None", "nan"])
def test_dropout_p_that_is_not_a_number_in_0_1_names_it(p, error):
    # float(10**400) would raise OverflowError, and "0.1" > 0 a TypeError not naming dropout_p.
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), torch.float32)
    with pytest.raises(error, match=r"^dropout_p must be"):
        scaled_dot_product_attention(q, k, v, dropout_p=p)


@pytest.mark.parametrize("scale,dtype", [(10**400, torch.float64), (1e39, torch.float32), (1e-50, torch.float32)],
                         ids=["1e400", "1e39-float32", "1e-50-float32"])
def test_scale_that_does_not_fit_names_it(scale, dtype):
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), dtype)
    with pytest.raises(ValueError, match=r"^scale\b"):
        scaled_dot_product_attention(q, k, v, scale=scale)


# ---------------------------------------------------------------- layouts, without copies


@pytest.fixture
def spy():
    """The tensors sdpa.torch hands to sdpa's operators during the test, as a list of (operator,
    {argument name: data pointer}), seen at torch's Python dispatch key. The operators pass each
    tensor's memory to the kernels as it is unless its last dim is not contiguous
    (python/torch_ops.cc), so these are the kernels' pointers."""
    from torch.utils._python_dispatch import TorchDispatchMode

    calls = []

    class Spy(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            name = func.name()
            if name.startswith("sdpa::"):
                names = [a.name for a in func._schema.arguments]
                calls.append((name[len("sdpa::"):], {n: (a.data_ptr() if isinstance(a, torch.Tensor) else a)
                                                     for n, a in zip(names, args)}))
            return func(*args, **(kwargs or {}))

    with Spy():
        yield calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_blhe_transposed_inputs_reach_the_kernel_without_copies(spy, dtype):
    # (B, L, H, E) tensors, as a projection produces them, transposed to (B, H, L, E): only the
    # last dim is contiguous, which is all sdpa needs, so forward and backward read them in place.
    calls = spy
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(2, n, 4, 8, generator=g, dtype=dtype).transpose(1, 2).requires_grad_()
               for n in (9, 12, 12))
    assert not q.is_contiguous()
    mask = torch.rand(2, 1, 9, 12, generator=g) > 0.2
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.sum().backward()
    assert [c[0] for c in calls] == ["attention", "attention_backward"]
    for _, ptrs in calls:
        assert ptrs["q"] == q.data_ptr() and ptrs["k"] == k.data_ptr() and ptrs["v"] == v.data_ptr()
        assert ptrs["mask"] == mask.data_ptr()
    assert calls[1][1]["out"] == out.data_ptr()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    ref = F.scaled_dot_product_attention(q2, k2, v2, attn_mask=mask)
    ref.sum().backward()
    tol = 1e-10 if dtype == torch.float64 else 2e-5
    torch.testing.assert_close(out, ref, rtol=tol, atol=tol)
    for a, b in ((q, q2), (k, k2), (v, v2)):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)


def test_leading_dims_are_flattened_without_copies(spy):
    calls = spy
    q = torch.randn(2, 3, 4, 9, 8)
    k = torch.randn(2, 3, 4, 12, 8)
    mask = torch.zeros(9, 12)
    kv_one_head = torch.randn(2, 3, 1, 12, 8)  # broadcast over the heads with stride 0: no copy
    scaled_dot_product_attention(q, k, k, attn_mask=mask)
    scaled_dot_product_attention(q, kv_one_head, kv_one_head)
    q3 = torch.randn(4, 9, 8)  # rank 3: a batch of 1 is added
    scaled_dot_product_attention(q3, q3, q3)
    assert [c[1]["q"] for c in calls] == [q.data_ptr(), q.data_ptr(), q3.data_ptr()]
    assert [c[1]["k"] for c in calls] == [k.data_ptr(), kv_one_head.data_ptr(), q3.data_ptr()]
    assert calls[0][1]["mask"] == mask.data_ptr()


LAYOUTS = {  # name -> a function of a contiguous (B, H, N, D) tensor giving a strided one
    "blhe_transposed": lambda t: t.transpose(1, 2).contiguous().transpose(1, 2),
    "heads_first": lambda t: t.permute(1, 0, 2, 3).contiguous().permute(1, 0, 2, 3),
    "sliced_rows": lambda t: t.repeat_interleave(2, dim=2)[:, :, ::2],  # stride 2·D along N
    "padded_last_dim": lambda t: torch.nn.functional.pad(t, (0, 3))[..., :t.size(-1)],
    "non_contiguous_last_dim": lambda t: t.transpose(-1, -2).contiguous().transpose(-1, -2),  # copied by sdpa.torch
}


@pytest.mark.parametrize("dtype,tol", [(torch.float64, 1e-10), (torch.float32, 2e-5)])
@pytest.mark.parametrize("layout", sorted(LAYOUTS))
def test_strided_inputs_match_torch_forward_and_backward(layout, dtype, tol):
    g = torch.Generator().manual_seed(8)
    base = [torch.randn(s, generator=g, dtype=dtype) for s in ((2, 4, 9, 8), (2, 2, 13, 8), (2, 2, 13, 5))]
    strided = [LAYOUTS[layout](t).requires_grad_() for t in base]
    plain = [t.clone().requires_grad_() for t in base]
    for a, b in zip(strided, base):
        assert torch.equal(a, b)
    mask = torch.rand(9, 13, generator=g) > 0.3
    ours = scaled_dot_product_attention(*strided, attn_mask=mask, enable_gqa=True)
    theirs = F.scaled_dot_product_attention(*plain, attn_mask=mask, enable_gqa=True)
    torch.testing.assert_close(ours, theirs, rtol=tol, atol=tol)
    dout = LAYOUTS[layout](torch.randn(ours.shape, generator=g, dtype=dtype))  # a strided gradient too
    ours.backward(dout)
    theirs.backward(dout)
    for a, b in zip(strided, plain):
        torch.testing.assert_close(a.grad, b.grad, rtol=tol, atol=tol)


# ---------------------------------------------------------------- gradcheck, more shapes


@pytest.mark.parametrize("mask_kind", ["bool", "float"])
@pytest.mark.parametrize("shapes,kwargs", [
    (((2, 5, 4), (2, 7, 4), (2, 7, 3)), {}),
    (((1, 4, 5, 4), (1, 2, 7, 4), (1, 2, 7, 3)), {"enable_gqa": True}),
    (((1, 2, 5, 4), (1, 1, 7, 4), (1, 1, 7, 3)), {}),  # one kv head, broadcast
    (((2, 1, 2, 5, 4), (2, 1, 2, 7, 4), (1, 3, 2, 7, 3)), {}),  # rank 5 with broadcast batch dims
], ids=["rank3", "gqa", "one_kv_head", "rank5"])
def test_gradcheck_float64_with_mask(shapes, kwargs, mask_kind):
    q, k, v = tensors(shapes, torch.float64, seed=6)
    g = torch.Generator().manual_seed(9)
    allowed = torch.rand(5, 7, generator=g) > 0.4
    allowed[:, 0] = True
    allowed[2] = False  # a row with no allowed key: zero gradient
    mask = allowed if mask_kind == "bool" else torch.randn(5, 7, generator=g, dtype=torch.float64).masked_fill(
        ~allowed, float("-inf"))
    fn = lambda q, k, v: scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs)  # noqa: E731
    assert torch.autograd.gradcheck(fn, (q, k, v))
    torch.testing.assert_close(fn(q, k, v), F.scaled_dot_product_attention(q, k, v, attn_mask=mask, **kwargs))


def test_five_dim_mask_matches_torch():
    q, k, v = tensors(((2, 3, 2, 9, 8), (2, 3, 2, 12, 8), (2, 3, 2, 12, 8)), torch.float64, seed=10)
    mask = torch.randn(3, 1, 9, 12, generator=torch.Generator().manual_seed(11), dtype=torch.float64)
    ours = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(ours, F.scaled_dot_product_attention(q, k, v, attn_mask=mask), rtol=1e-10, atol=1e-10)


# ---------------------------------------------------------------- errors like torch's


def test_double_backward_raises():
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), torch.float64)
    out = scaled_dot_product_attention(q, k, v)
    (dq,) = torch.autograd.grad(out.pow(2).sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable"):
        dq.sum().backward()


def test_is_causal_with_attn_mask_raises_like_torch():
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), torch.float32)
    mask = torch.ones(5, 7, dtype=torch.bool)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)
    with pytest.raises(RuntimeError, match="attn_mask and is_causal"):
        scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=True)


@pytest.mark.parametrize("qs,ks,vs,kwargs", [
    ((2, 4, 5, 8), (3, 4, 7, 8), (3, 4, 7, 8), {}),  # batch 2 vs 3
    ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 8), {}),  # heads 4 vs 2 without enable_gqa
    ((2, 1, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), {"enable_gqa": True}),  # 4 does not divide 1
    ((2, 4, 5, 8), (2, 4, 7, 8), (2, 4, 7, 8), {"attn_mask": torch.ones(3, 5, 7, dtype=torch.bool)}),
    ((5, 8), (7, 8), (7, 8), {"attn_mask": torch.ones(3, 5, 7, dtype=torch.bool)}),  # mask would enlarge out
    ((5, 8), (7, 8), (7, 8), {"attn_mask": torch.zeros(5, 7, dtype=torch.float64)}),  # float64 mask, float32 q
    ((5, 8), (7, 8), (7, 8), {"attn_mask": torch.zeros(5, 7, dtype=torch.int64)}),
    ((8,), (7, 8), (7, 8), {}),  # rank 1
], ids=["batch", "heads", "gqa_heads", "mask_shape", "mask_enlarges", "mask_float64", "mask_int", "rank1"])
def test_shapes_and_mask_dtypes_torch_refuses_raise_runtime_error(qs, ks, vs, kwargs):
    q, k, v = (torch.randn(s) for s in (qs, ks, vs))
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, **kwargs)
    with pytest.raises(RuntimeError):
        scaled_dot_product_attention(q, k, v, **kwargs)


def test_float32_mask_with_float64_query_is_accepted_like_torch():
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), torch.float64)
    mask = torch.randn(5, 7)
    torch.testing.assert_close(scaled_dot_product_attention(q, k, v, attn_mask=mask),
                               F.scaled_dot_product_attention(q, k, v, attn_mask=mask))


# ---------------------------------------------------------------- bfloat16 and float16
# Forward and backward through autograd in the 16-bit dtype, compared with the float64 oracle of
# reference.py on the inputs widened, by its 16-bit rule (test_lowp.py's), and with torch's own
# SDPA in float32 on the widened inputs within that tolerance plus torch's own float32 error
# (measured against the same oracle). The backward's oracle reads the 16-bit out that the forward
# returned, as sdpa's backward does; torch's float32 backward reads its float32 out, and that
# difference is measured too (the oracle's for either out).

import ml_dtypes  # noqa: E402

from reference import (EPS32, backward_floors, lowp_tolerance, max_error, naive_float32_attention,  # noqa: E402
                       naive_float32_attention_backward, reference_attention, reference_attention_backward)

LOWP = [torch.bfloat16, torch.float16]
LOWP_CASES = [  # (q shape, k shape, v shape, kwargs): shapes reference.py takes as they are
    ((2, 4, 33, 16), (2, 4, 65, 16), (2, 4, 65, 8), {}),
    ((2, 4, 33, 16), (2, 4, 65, 16), (2, 4, 65, 8), {"is_causal": True}),
    ((1, 8, 40, 32), (1, 2, 40, 32), (1, 2, 40, 32), {"enable_gqa": True}),
    ((3, 17, 8), (3, 17, 8), (3, 17, 8), {"scale": 0.3}),
    ((2, 2, 20, 8), (2, 2, 30, 8), (2, 2, 30, 8), {"attn_mask": "bool_empty_rows"}),
    ((2, 2, 20, 8), (2, 2, 30, 8), (2, 2, 30, 8), {"attn_mask": "query_dtype"}),
    ((2, 2, 20, 8), (2, 2, 30, 8), (2, 2, 30, 8), {"attn_mask": "float32"}),
    ((17, 8), (23, 8), (23, 5), {"is_causal": True}),
]


def _as_numpy(t):
    """A tensor's values as NumPy (bfloat16 as ml_dtypes.bfloat16), for reference.py and sdpa."""
    t = t.detach()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _lowp_case(qs, ks, vs, kwargs, dtype):
    g = torch.Generator().manual_seed(12)
    q, k, v = (torch.randn(s, generator=g).to(dtype).requires_grad_() for s in (qs, ks, vs))
    kwargs = dict(kwargs)
    mask = kwargs.get("attn_mask")
    if mask is not None:
        allowed = torch.rand(qs[-2], ks[-2], generator=g) > 0.3
        allowed[:, 0] = True
        allowed[3] = False  # a row with no allowed key: zeros, and zero gradients
        bias = torch.randn(allowed.shape, generator=g).masked_fill(~allowed, float("-inf"))
        kwargs["attn_mask"] = {"bool_empty_rows": allowed, "query_dtype": bias.to(dtype), "float32": bias}[mask]
    return q, k, v, kwargs


def _reference_kwargs(kwargs):
    """reference.py's arguments for torch's keyword arguments (top-left causal, as torch's)."""
    mask = kwargs.get("attn_mask")
    if mask is not None:
        mask = _as_numpy(mask)
        mask = mask if mask.dtype == np.bool_ else mask.astype(np.float64)
    return dict(mask=mask, causal="top_left" if kwargs.get("is_causal") else False, scale=kwargs.get("scale"))


def _torch32(q, k, v, dout, kwargs):
    """torch's SDPA in float32 on the widened inputs: out and (dq, dk, dv), as float64 NumPy."""
    q2, k2, v2 = (t.detach().float().requires_grad_() for t in (q, k, v))
    kw = dict(kwargs)
    if "attn_mask" in kw and kw["attn_mask"].dtype != torch.bool:
        kw["attn_mask"] = kw["attn_mask"].float()
    out = F.scaled_dot_product_attention(q2, k2, v2, **kw)
    out.backward(dout.float())
    return [t.detach().double().numpy() for t in (out, q2.grad, k2.grad, v2.grad)]


def _close(got, want, tol, what):
    got = got.detach().double().numpy() if isinstance(got, torch.Tensor) else got
    diff = np.abs(got - want)
    assert np.isfinite(tol) and not np.isnan(got).any(), what
    assert float(diff.max()) <= tol, f"{what}: max abs error {float(diff.max()):.3g} > tolerance {tol:.3g}"


@pytest.mark.parametrize("dtype", LOWP)
@pytest.mark.parametrize("qs,ks,vs,kwargs", LOWP_CASES)
def test_lowp_matches_the_oracle_and_torch_float32(qs, ks, vs, kwargs, dtype):
    q, k, v, kwargs = _lowp_case(qs, ks, vs, kwargs, dtype)
    out = scaled_dot_product_attention(q, k, v, **kwargs)
    assert out.dtype == dtype
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(13)).to(dtype)
    out.backward(dout)
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (dtype,) * 3

    np_dtype = _as_numpy(out).dtype
    args = [_as_numpy(t).astype(np.float64) for t in (q, k, v)]
    ref_kwargs = _reference_kwargs(kwargs)
    t32 = _torch32(q, k, v, dout, kwargs)

    ref_out = reference_attention(*args, **ref_kwargs)[0]
    tol = lowp_tolerance(naive_float32_attention(*args, **ref_kwargs)[0], ref_out, np_dtype)
    _close(out, ref_out, tol, "out against the oracle")
    _close(out, t32[0], tol + max_error(t32[0], ref_out), "out against torch float32")

    out64 = _as_numpy(out).astype(np.float64)
    dout64 = _as_numpy(dout).astype(np.float64)
    ref = reference_attention_backward(dout64, *args, out=out64, **ref_kwargs)
    naive = naive_float32_attention_backward(dout64, *args, out=out64, **ref_kwargs)
    exact = reference_attention_backward(dout64, *args, **ref_kwargs)  # with the exact out, as torch's
    floors = backward_floors(dout64, *args, eps=EPS32, **ref_kwargs)
    for name, t, r, n, f, e, theirs in zip(("dq", "dk", "dv"), (q, k, v), ref, naive, floors, exact, t32[1:]):
        tol = lowp_tolerance(n, r, np_dtype) + f
        _close(t.grad, r, tol, f"{name} against the oracle")
        _close(t.grad, theirs, tol + max_error(r, e) + max_error(theirs, e), f"{name} against torch float32")


@pytest.mark.parametrize("dtype", LOWP)
def test_lowp_equals_the_numpy_front_door_bit_for_bit(dtype):
    # The same kernels on the same values: sdpa.torch adds nothing but the views.
    import sdpa
    g = torch.Generator().manual_seed(14)
    q, k, v = (torch.randn(s, generator=g).to(dtype).requires_grad_() for s in ((2, 4, 9, 8), (2, 2, 12, 8),
                                                                               (2, 2, 12, 8)))
    mask = torch.randn(9, 12, generator=g)  # float32: added as it is, not rounded to the query's dtype
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    dout = torch.randn(out.shape, generator=g).to(dtype)
    out.backward(dout)
    arrays = [_as_numpy(t) for t in (q, k, v)]
    want, lse = sdpa.attention(*arrays, mask.numpy(), causal=False, return_lse=True)
    grads = sdpa.attention_backward(_as_numpy(dout), *arrays, want, lse, mask.numpy())
    for got, w in zip((out, q.grad, k.grad, v.grad), (want,) + grads):
        assert got.dtype == dtype
        np.testing.assert_array_equal(_as_numpy(got).view(np.uint16), w.view(np.uint16))


@pytest.mark.parametrize("dtype", LOWP)
def test_lowp_blhe_transposed_inputs_reach_the_kernel_without_copies(spy, dtype):
    calls = spy
    g = torch.Generator().manual_seed(15)
    q, k, v = (torch.randn(2, n, 4, 8, generator=g).to(dtype).transpose(1, 2).requires_grad_() for n in (9, 12, 12))
    mask = torch.randn(9, 12, generator=g).to(dtype)
    out = scaled_dot_product_attention(q, k, v, attn_mask=mask)
    out.sum().backward()
    assert [c[0] for c in calls] == ["attention", "attention_backward"]
    for _, ptrs in calls:
        assert ptrs["q"] == q.data_ptr() and ptrs["k"] == k.data_ptr() and ptrs["v"] == v.data_ptr()
        assert ptrs["mask"] == mask.data_ptr()
    assert calls[1][1]["out"] == out.data_ptr()
    assert (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (dtype,) * 3


def test_lowp_dtype_errors_name_the_argument():
    q, k, v = (torch.randn(s) for s in ((5, 8), (7, 8), (7, 8)))
    with pytest.raises(RuntimeError, match=r"share a dtype, got torch.bfloat16, torch.float16, torch.float16"):
        scaled_dot_product_attention(q.bfloat16(), k.half(), v.half())
    with pytest.raises(RuntimeError, match=r"^attn_mask has dtype torch.float16, but must be bool, float32 or query's"):
        scaled_dot_product_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), attn_mask=torch.zeros(5, 7).half())
    with pytest.raises(TypeError, match=r"^query has dtype torch.float8_e4m3fn"):
        scaled_dot_product_attention(q.to(torch.float8_e4m3fn), k, v)


# ---------------------------------------------------------------- varlen


def _packed_torch(dtype, lengths_q=(3, 0, 20, 1), lengths_k=(5, 4, 20, 40), Hq=4, Hkv=2, D=8, seed=21):
    g = torch.Generator().manual_seed(seed)
    cu_q = torch.tensor([0] + list(np.cumsum(lengths_q)), dtype=torch.int32)
    cu_k = torch.tensor([0] + list(np.cumsum(lengths_k)), dtype=torch.int64)
    q = torch.randn(int(cu_q[-1]), Hq, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    k = torch.randn(int(cu_k[-1]), Hkv, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    v = torch.randn(int(cu_k[-1]), Hkv, D, generator=g, dtype=torch.float64).to(dtype).requires_grad_()
    return q, k, v, cu_q, cu_k


@pytest.mark.parametrize("causal", [False, True])
def test_varlen_matches_torch_per_sequence_forward_and_backward(causal):
    from sdpa.torch import attention_varlen
    q, k, v, cu_q, cu_k = _packed_torch(torch.float64)
    out = attention_varlen(q, k, v, cu_q, cu_k, causal=causal)
    (out * out).sum().backward()
    for b in range(len(cu_q) - 1):
        q0, q1, k0, k1 = int(cu_q[b]), int(cu_q[b + 1]), int(cu_k[b]), int(cu_k[b + 1])
        qb, kb, vb = (t.detach()[r0:r1].transpose(0, 1).clone().requires_grad_()
                      for t, r0, r1 in ((q, q0, q1), (k, k0, k1), (v, k0, k1)))
        # torch's is_causal is top-left; FlashAttention's (and sdpa's True) bottom-right: a mask.
        mask = None
        if causal:
            nq, nk = q1 - q0, k1 - k0
            mask = torch.arange(nk)[None, :] <= torch.arange(nq)[:, None] + (nk - nq)
        if q1 == q0 or (mask is not None and not mask.any(dim=-1).all()):
            continue  # torch gives NaN rows where sdpa gives zeros; covered by test_varlen.py
        ref = F.scaled_dot_product_attention(qb, kb.repeat_interleave(2, 0), vb.repeat_interleave(2, 0), attn_mask=mask)
        (ref * ref).sum().backward()
        torch.testing.assert_close(out[q0:q1].transpose(0, 1), ref, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(q.grad[q0:q1].transpose(0, 1), qb.grad, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(k.grad[k0:k1].transpose(0, 1), kb.grad, rtol=1e-10, atol=1e-10)
        torch.testing.assert_close(v.grad[k0:k1].transpose(0, 1), vb.grad, rtol=1e-10, atol=1e-10)


def test_varlen_gradcheck():
    from sdpa.torch import attention_varlen
    q, k, v, cu_q, cu_k = _packed_torch(torch.float64, (2, 3), (4, 3), Hq=2, Hkv=1, D=3)
    assert torch.autograd.gradcheck(lambda a, b, c: attention_varlen(a, b, c, cu_q, cu_k, causal=True), (q, k, v))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_varlen_lowp_gradients_have_the_inputs_dtype(dtype):
    from sdpa.torch import attention_varlen
    q, k, v, cu_q, cu_k = _packed_torch(dtype)
    out = attention_varlen(q, k, v, cu_q, cu_k, causal=True)
    out.float().sum().backward()
    assert out.dtype == dtype and (q.grad.dtype, k.grad.dtype, v.grad.dtype) == (dtype,) * 3
    assert torch.isfinite(out.float()).all() and torch.isfinite(q.grad.float()).all()


# ---------------------------------------------------------------- the operators, torch.compile


def _op_samples():
    """(operator, args) for every sdpa operator: torch.library.opcheck's samples."""
    g = torch.Generator().manual_seed(30)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)))
    mask = torch.rand(5, 7, generator=g) > 0.3
    out, lse = torch.ops.sdpa.attention(q, k, v, mask, "none", None, -1, -1, 0.0, None)
    seed = torch.tensor([7])
    qp, kp, vp = (torch.randn(s, generator=g, dtype=torch.float32, requires_grad=True)
                  for s in ((5, 4, 8), (9, 2, 8), (9, 2, 6)))
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9])
    outp, lsep = torch.ops.sdpa.attention_varlen(qp, kp, vp, cu_q, cu_k, "bottom_right", None, -1, -1, 0.0, None)
    pages = torch.randn(6, 16, 2, 8, generator=g)
    table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    return [
        (torch.ops.sdpa.attention.default, (q, k, v, mask, "top_left", None, -1, -1, 0.0, None)),
        (torch.ops.sdpa.attention.default, (q, k, v, None, "none", 0.5, 2, 1, 0.25, seed)),
        (torch.ops.sdpa.attention_backward.default,
         (torch.randn(out.shape, dtype=out.dtype), q.detach(), k.detach(), v.detach(), out.detach(), lse, mask, "none",
          None, -1, -1, 0.0, None)),
        (torch.ops.sdpa.attention_varlen.default, (qp, kp, vp, cu_q, cu_k, "bottom_right", None, -1, -1, 0.0, None)),
        (torch.ops.sdpa.attention_varlen_backward.default,
         (torch.randn(outp.shape), qp.detach(), kp.detach(), vp.detach(), cu_q, cu_k, outp.detach(), lsep,
          "bottom_right", None, -1, -1, 0.0, None)),
        (torch.ops.sdpa.attention_paged.default,
         (torch.randn(2, 4, 3, 8, generator=g), pages, pages, table, torch.tensor([20, 9]), None, "bottom_right", None,
          -1, -1)),
        (torch.ops.sdpa.attention_paged.default,
         (torch.randn(5, 4, 8, generator=g), pages, pages, table, torch.tensor([20, 9]), torch.tensor([0, 3, 5]),
          "bottom_right", None, -1, -1)),
        (torch.ops.sdpa.attention_out.default, (q, k, v)),
        (torch.ops.sdpa.attention_out.default, (q, k, v, "top_left", 0.5)),
    ]


def _seqlens_samples():
    """(operator, args) of attention and attention_backward with seqlens_k (their last argument)."""
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)))
    lengths = torch.tensor([7, 3])
    defaults = (0.0, False, None, None, None, 128, 128, "exact")  # softcap .. precision
    out, lse = torch.ops.sdpa.attention(q, k, v, None, "top_left", None, -1, -1, 0.0, None, *defaults, lengths)
    return [
        (torch.ops.sdpa.attention.default, (q, k, v, None, "top_left", None, -1, -1, 0.0, None, *defaults, lengths)),
        (torch.ops.sdpa.attention_backward.default,
         (torch.randn(out.shape, dtype=out.dtype), q.detach(), k.detach(), v.detach(), out.detach(), lse, None,
          "top_left", None, -1, -1, 0.0, None, *defaults[:-1], False, False, "exact", lengths)),
    ]


@pytest.mark.parametrize("sample", range(2))
def test_seqlens_operators_pass_opcheck(sample):
    op, args = _seqlens_samples()[sample]
    torch.library.opcheck(op, args)


@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
def test_operator_seqlens_k_is_sdpas(causal):
    """attention's seqlens_k is sdpa.attention's, forward and backward (its autograd kernel
    passes the lengths on): the same bits as the NumPy front door, keys past a length never read
    (NaN there changes nothing) and given zero gradients."""
    import sdpa
    g = torch.Generator().manual_seed(32)
    q, k, v = (torch.randn(s, generator=g) for s in ((3, 4, 6, 8), (3, 2, 9, 8), (3, 2, 9, 5)))
    lengths = torch.tensor([9, 4, 0], dtype=torch.int32)
    for b, n in enumerate(lengths.tolist()):
        k[b, :, n:], v[b, :, n:] = float("nan"), float("nan")
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out, lse = torch.ops.sdpa.attention(q, k, v, None, causal, None, -1, -1, 0.0, None, seqlens_k=lengths)
    dout = torch.randn(out.shape, generator=g)
    out.backward(dout)
    arrays = [t.detach().numpy() for t in (q, k, v)]
    causal_arg = {"none": False, "top_left": "top_left", "bottom_right": "bottom_right"}[causal]
    want, want_lse = sdpa.attention(*arrays, causal=causal_arg, seqlens_k=lengths.numpy(), return_lse=True)
    grads = sdpa.attention_backward(dout.numpy(), *arrays, want, want_lse, causal=causal_arg,
                                    seqlens_k=lengths.numpy())
    np.testing.assert_array_equal(out.detach().numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    for t, w in zip((q, k, v), grads):
        np.testing.assert_array_equal(t.grad.numpy(), w)
    assert torch.isfinite(out).all() and torch.isfinite(q.grad).all()
    assert (out[2] == 0).all() and (k.grad[1, :, 4:] == 0).all() and (v.grad[2] == 0).all()


def test_operator_seqlens_k_errors_name_it():
    q = torch.randn(2, 2, 3, 4)
    with pytest.raises(ValueError, match="seqlens_k"):
        torch.ops.sdpa.attention(q, q, q, None, "none", None, -1, -1, 0.0, None, seqlens_k=torch.tensor([1, 2, 3]))
    with pytest.raises(ValueError, match="seqlens_k"):
        torch.ops.sdpa.attention(q, q, q, None, "none", None, -1, -1, 0.0, None, seqlens_k=torch.tensor([1, 4]))


@pytest.mark.parametrize("sample", range(9))
def test_operators_pass_opcheck(sample):
    # torch's own checks of a custom operator: its schema, its autograd registration, its fake
    # kernel against the real one (shapes, strides, dtypes) and tracing with AOTAutograd.
    op, args = _op_samples()[sample]
    torch.library.opcheck(op, args)


def test_compiles_without_graph_breaks_forward_and_backward():
    # fullgraph=True makes any graph break an error; aot_eager traces the operators through
    # their fake kernels and autograd registration, as inductor does, without compiling C++.
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((2, 8, 9, 16), (2, 2, 12, 16), (2, 2, 12, 16)))
    mask = torch.randn(2, 1, 9, 12, generator=g, dtype=torch.float64)

    def model(q, k, v, mask):
        return (scaled_dot_product_attention(q * 2, k, v, attn_mask=mask, enable_gqa=True).tanh() ** 2).sum()

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    want = model(q, k, v, mask)
    want_grads = torch.autograd.grad(want, (q, k, v))
    got = compiled(q, k, v, mask)
    got_grads = torch.autograd.grad(got, (q, k, v))
    torch.testing.assert_close(got, want, rtol=1e-12, atol=1e-12)
    for a, b in zip(got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


def test_varlen_and_dropout_compile_without_graph_breaks():
    from sdpa.torch import attention_varlen
    torch._dynamo.reset()
    q, k, v, cu_q, cu_k = _packed_torch(torch.float32)
    compiled = torch.compile(lambda *a: attention_varlen(*a, causal=True), fullgraph=True, backend="aot_eager")
    torch.testing.assert_close(compiled(q, k, v, cu_q, cu_k), attention_varlen(q, k, v, cu_q, cu_k, causal=True),
                               rtol=0, atol=0)
    dropped = torch.compile(lambda a, b, c: scaled_dot_product_attention(a, b, c, dropout_p=0.5), fullgraph=True,
                            backend="aot_eager")
    a, b, c = tensors(((2, 3, 6, 8), (2, 3, 7, 8), (2, 3, 7, 8)), torch.float32)
    out = dropped(a, b, c)
    out.sum().backward()
    assert torch.isfinite(a.grad).all() and not torch.equal(out, scaled_dot_product_attention(a, b, c))


def test_inductor_compiles_a_block_using_it():
    # The default backend, as a user calls it: inductor generates C++ for the ops around sdpa's.
    torch._dynamo.reset()
    g = torch.Generator().manual_seed(32)
    x = torch.randn(2, 10, 32, generator=g)
    proj = torch.nn.Linear(32, 96)

    def block(x):
        q, k, v = proj(x).view(2, 10, 3, 4, 8).permute(2, 0, 3, 1, 4)
        return scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(2, 10, 32)

    with torch.no_grad():
        want = block(x)
        got = torch.compile(block, fullgraph=True)(x)
    torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)


def test_paged_matches_the_numpy_front_door_dense_and_packed():
    import sdpa
    from sdpa.torch import attention_paged
    g = torch.Generator().manual_seed(33)
    k_pages, v_pages = torch.randn(7, 16, 2, 8, generator=g), torch.randn(7, 16, 2, 6, generator=g)
    table = torch.tensor([[4, 0, 6], [2, 5, -1]], dtype=torch.int32)
    lengths = torch.tensor([40, 17])
    q = torch.randn(2, 4, 3, 8, generator=g)
    out, lse = attention_paged(q, k_pages, v_pages, table, lengths, causal=True, return_lse=True)
    want, want_lse = sdpa.attention_paged(q.numpy(), k_pages.numpy(), v_pages.numpy(), table.numpy(), lengths.numpy(),
                                          causal=True, return_lse=True)
    np.testing.assert_array_equal(out.numpy(), want)
    np.testing.assert_array_equal(lse.numpy(), want_lse)
    packed, cu = torch.randn(5, 4, 8, generator=g), torch.tensor([0, 4, 5])
    out = attention_paged(packed, k_pages, v_pages, table, lengths, cu_seqlens_q=cu, causal=True)
    for b in range(2):  # each sequence's rows: the dense call on them alone
        rows = packed[cu[b]:cu[b + 1]].transpose(0, 1)[None]
        alone = attention_paged(rows, k_pages, v_pages, table[b:b + 1], lengths[b:b + 1], causal=True)
        torch.testing.assert_close(out[cu[b]:cu[b + 1]], alone[0].transpose(0, 1), rtol=0, atol=0)
    assert not out.requires_grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_attention_stats_on_tensors(dtype):
    import ml_dtypes
    import sdpa
    from sdpa.torch import attention_stats
    g = torch.Generator().manual_seed(3)
    q = torch.randn(2, 4, 9, 8, generator=g).to(dtype)
    k = torch.randn(2, 2, 20, 8, generator=g).to(dtype)
    v = torch.randn(2, 2, 20, 8, generator=g).to(dtype)
    out, st = attention_stats(q, k, v, causal="top_left", topk=3)
    assert out.dtype == dtype and out.shape == (2, 4, 9, 8)
    assert isinstance(st, sdpa.Stats) and st.topk_indices.shape == (2, 4, 9, 3) and st.entropy.dtype == torch.float32
    as_np = (lambda t: t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)) if dtype == torch.bfloat16 else torch.Tensor.numpy
    want_out, want = sdpa.attention(as_np(q), as_np(k), as_np(v), causal="top_left", return_stats=True, topk=3)
    assert np.array_equal(as_np(out), want_out)
    for got, w in zip(st, want):
        assert np.array_equal(got.numpy(), w)
    assert st.allowed[0, 0].tolist() == list(range(1, 10))  # top-left causal: row i sees i + 1 keys


# ---------------------------------------------------------------- a tensor scale, as torch takes it


@pytest.mark.parametrize("scale", [torch.tensor(0.3), torch.tensor(0.3, dtype=torch.float64), torch.tensor(2),
                                   torch.tensor(0.3, dtype=torch.bfloat16)],
                         ids=["float32", "float64", "int64", "bfloat16"])
def test_zero_dim_tensor_scale_is_its_number_in_every_entry_point(scale):
    """F.scaled_dot_product_attention takes a 0-dim tensor as scale (any real dtype); so does each
    of sdpa.torch's functions, bit for bit as the float it holds (they used to raise TypeError)."""
    from sdpa.torch import attention_paged, attention_stats, attention_varlen
    number = scale.item()
    q, k, v = tensors(((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)), torch.float32)
    got = scaled_dot_product_attention(q, k, v, scale=scale)
    assert torch.equal(got, scaled_dot_product_attention(q, k, v, scale=number))
    torch.testing.assert_close(got, F.scaled_dot_product_attention(q, k, v, scale=scale), rtol=2e-5, atol=2e-5)
    pq, pk, pv, cu_q, cu_k = _packed_torch(torch.float32)
    assert torch.equal(attention_varlen(pq, pk, pv, cu_q, cu_k, scale=scale),
                       attention_varlen(pq, pk, pv, cu_q, cu_k, scale=number))
    pages = torch.randn(3, 4, 3, 8)
    table, lengths = torch.tensor([[0, 2], [1, 0]]), torch.tensor([7, 4])
    assert torch.equal(attention_paged(q.detach(), pages, pages, table, lengths, scale=scale),
                       attention_paged(q.detach(), pages, pages, table, lengths, scale=number))
    (out, st), (want_out, want) = (attention_stats(q, k, v, scale=s) for s in (scale, number))
    assert torch.equal(out, want_out) and torch.equal(st.entropy, want.entropy)


@pytest.mark.parametrize("scale,words", [(torch.tensor([0.5]), "shape"),
                                         (torch.tensor(0.5, requires_grad=True), "requires grad"),
                                         (torch.tensor(True), "bool")], ids=["one_element", "requires_grad", "bool"])
def test_tensor_scale_torch_or_sdpa_refuses_raises_type_error(scale, words):
    """torch refuses a tensor with dims (even one element) and one that requires grad (it gets no
    gradient) with TypeError; sdpa also refuses a bool one, as it refuses a bool scale."""
    q, k, v = tensors(((2, 5, 4), (2, 7, 4), (2, 7, 3)), torch.float32)
    if scale.dtype != torch.bool:
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, k, v, scale=scale)
    with pytest.raises(TypeError, match=rf"^scale\b.*{words}"):
        scaled_dot_product_attention(q, k, v, scale=scale)


def test_tensor_scale_under_torch_compile():
    """Reading a tensor's number breaks the graph, as it does for torch's function (whose
    fullgraph compile fails on a tensor scale): without fullgraph the compiled call is eager's."""
    torch._dynamo.reset()
    q, k, v = tensors(((2, 3, 5, 8), (2, 3, 7, 8), (2, 3, 7, 8)), torch.float64)
    compiled = torch.compile(lambda q, k, v, s: scaled_dot_product_attention(q, k, v, scale=s), backend="aot_eager")
    scale = torch.tensor(0.3)  # float32: 0.30000001192092896
    got = compiled(q, k, v, scale)
    dout = torch.randn(got.shape, dtype=got.dtype, generator=torch.Generator().manual_seed(4))
    got.backward(dout)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    want = scaled_dot_product_attention(q2, k2, v2, scale=scale.item())
    want.backward(dout)
    assert torch.equal(got, want) and torch.equal(q.grad, q2.grad)  # the same kernels on the same numbers
