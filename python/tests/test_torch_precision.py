"""precision="fast" through sdpa.torch (issue 28): the operators take precision as their last
option and the autograd kernels hand the forward's to the backward, so sdpa.torch's results are
the NumPy front door's bit for bit (test_precision.py holds the NumPy tests); precision=None
takes the enclosing ``sdpa.precision(...)`` block's, also under torch.compile. Skipped without
torch, except where CI is set (torch_required.py)."""

import ml_dtypes
import numpy as np
import pytest

from torch_required import import_torch  # noqa: E402

torch = import_torch(module_level=True)
import sdpa  # noqa: E402
from sdpa.torch import (MultiheadAttention, attention_paged, attention_varlen,  # noqa: E402
                        scaled_dot_product_attention)
from test_torch import _as_numpy as as_numpy  # noqa: E402
from test_torch import one_thread  # noqa: E402, F401  (autouse: tiny tensors, one thread each)

HALVES = [torch.bfloat16, torch.float16]


def as_tensor(a):
    """An array as a tensor of its values, ml_dtypes.bfloat16 as torch.bfloat16."""
    a = np.ascontiguousarray(a)
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


def same(t, a):
    """Whether tensor t holds array a's values bit for bit."""
    return torch.equal(t.detach(), as_tensor(a))


def qkv(dtype, shapes=((2, 4, 33, 32), (2, 2, 300, 32), (2, 2, 300, 16)), seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(s, generator=g).to(dtype).requires_grad_() for s in shapes]


@pytest.mark.parametrize("dtype", HALVES, ids=str)
@pytest.mark.parametrize("causal", [False, True])
def test_forward_and_backward_are_the_numpy_front_doors(dtype, causal):
    q, k, v = qkv(dtype)
    out = scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=True, precision="fast")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    qn, kn, vn = map(as_numpy, (q, k, v))
    kw = dict(causal="top_left" if causal else False, precision="fast")
    want, lse = sdpa.attention(qn, kn, vn, return_lse=True, **kw)
    assert same(out, want)
    assert not same(out, sdpa.attention(qn, kn, vn, causal=kw["causal"]))  # fast is not exact mode
    # The backward of autograd is sdpa.attention_backward with the forward's precision.
    for got, grad in zip((dq, dk, dv), sdpa.attention_backward(as_numpy(dout), qn, kn, vn, want, lse, **kw)):
        assert same(got, grad)


def test_a_reshaped_call_takes_it_too():
    # 3-dim tensors go through the drop-in's views, not the direct call.
    q, k, v = qkv(torch.bfloat16, ((4, 9, 16), (4, 40, 16), (4, 40, 8)))
    out = scaled_dot_product_attention(q, k, v, precision="fast")
    assert same(out, sdpa.attention(*map(as_numpy, (q, k, v)), precision="fast"))


def test_the_block_sets_the_default_and_the_backward_keeps_the_forwards():
    q, k, v = qkv(torch.bfloat16, ((2, 4, 33, 32), (2, 4, 300, 32), (2, 4, 300, 16)))
    fast = scaled_dot_product_attention(q, k, v, precision="fast")
    exact = scaled_dot_product_attention(q, k, v)
    assert not torch.equal(fast, exact)
    with sdpa.precision("fast"):
        out = scaled_dot_product_attention(q, k, v)
        assert torch.equal(out, fast)
        assert torch.equal(scaled_dot_product_attention(q, k, v, precision="exact"), exact)  # a call's own wins
    # Backward after the block has closed: the forward's precision, saved by autograd.
    dout = torch.ones_like(out)
    got = torch.autograd.grad(out, (q, k, v), dout)
    want = torch.autograd.grad(fast, (q, k, v), dout)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert torch.equal(scaled_dot_product_attention(q, k, v), exact)


def test_varlen_paged_and_the_module_take_it():
    q, k, v = qkv(torch.bfloat16, ((2, 2, 5, 16), (2, 2, 40, 16), (2, 2, 40, 8)))
    qn, kn, vn = map(as_numpy, (q, k, v))
    packed = [x.detach().transpose(1, 2).reshape(-1, x.shape[1], x.shape[3]).contiguous().requires_grad_()
              for x in (q, k, v)]
    cu_q, cu_k = torch.tensor([0, 5, 10]), torch.tensor([0, 40, 80])
    pn = list(map(as_numpy, packed))
    out = attention_varlen(*packed, cu_q, cu_k, precision="fast")
    want, lse = sdpa.attention_varlen(*pn, cu_q.numpy(), cu_k.numpy(), return_lse=True, precision="fast")
    assert same(out, want)
    grads = torch.autograd.grad(out, packed, torch.ones_like(out))
    wants = sdpa.attention_varlen_backward(np.ones_like(want), *pn, want, lse, cu_q.numpy(), cu_k.numpy(),
                                           precision="fast")
    assert all(same(a, b) for a, b in zip(grads, wants))
    with sdpa.precision("fast"):
        assert same(attention_varlen(*packed, cu_q, cu_k), want)
    # A paged cache holding the same keys and values: pages of 16 rows, (num_pages, 16, Hkv, D).
    k_pages = k.detach().transpose(1, 2).reshape(2, 40, 2, 16)
    v_pages = v.detach().transpose(1, 2).reshape(2, 40, 2, 8)
    k_pages, v_pages = (torch.cat([torch.nn.functional.pad(p, (0, 0, 0, 0, 0, 8)) for p in x]).reshape(6, 16, 2, -1)
                        for x in (k_pages, v_pages))
    table, lengths = torch.tensor([[0, 1, 2], [3, 4, 5]]), torch.tensor([40, 40])
    paged = attention_paged(q.detach(), k_pages, v_pages, table, lengths, precision="fast")
    assert same(paged, sdpa.attention(qn, kn, vn, precision="fast"))
    with sdpa.precision("fast"):
        assert torch.equal(attention_paged(q.detach(), k_pages, v_pages, table, lengths), paged)
    # sdpa.torch.MultiheadAttention: forward's precision, or the block's.
    torch.manual_seed(2)
    mha = MultiheadAttention(32, 4, batch_first=True, dtype=torch.bfloat16)
    x = torch.randn(2, 50, 32).bfloat16()
    fast, _ = mha(x, x, x, need_weights=False, precision="fast")
    exact, _ = mha(x, x, x, need_weights=False)
    assert not torch.equal(fast, exact)
    with sdpa.precision("fast"):
        assert torch.equal(mha(x, x, x, need_weights=False)[0], fast)


def test_errors_name_the_argument():
    q, k, v = qkv(torch.bfloat16, ((1, 1, 2, 8), (1, 1, 3, 8), (1, 1, 3, 8)))
    with pytest.raises(ValueError, match="precision must be 'exact' or 'fast', got 'quick'"):
        scaled_dot_product_attention(q, k, v, precision="quick")
    with pytest.raises(ValueError, match="precision must be 'exact' or 'fast', got 'quick'"):
        attention_varlen(q[0].transpose(0, 1), k[0].transpose(0, 1), v[0].transpose(0, 1), [0, 2], [0, 3],
                         precision="quick")
    with pytest.raises(TypeError, match="precision must be 'exact' or 'fast', got 1"):
        scaled_dot_product_attention(q, k, v, precision=1)


def _samples():
    """(operator, args, kwargs) with precision="fast", for torch.library.opcheck."""
    q, k, v = qkv(torch.bfloat16, ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)))
    fast = {"precision": "fast"}
    out, lse = torch.ops.sdpa.attention(q, k, v, None, "none", None, -1, -1, 0.0, None, **fast)
    qp, kp, vp = (x.detach()[0].transpose(0, 1).contiguous().requires_grad_() for x in (q, k, v))
    cu_q, cu_k = torch.tensor([0, 2, 5]), torch.tensor([0, 4, 7])
    outp, lsep = torch.ops.sdpa.attention_varlen(qp, kp, vp, cu_q, cu_k, "bottom_right", None, -1, -1, 0.0, None,
                                                 **fast)
    d = (q.detach(), k.detach(), v.detach())
    dp = (qp.detach(), kp.detach(), vp.detach())
    return [
        (torch.ops.sdpa.attention.default, (q, k, v, None, "top_left", None, -1, -1, 0.0, None), fast),
        (torch.ops.sdpa.attention_backward.default,
         (torch.ones_like(out), *d, out.detach(), lse, None, "none", None, -1, -1, 0.0, None), fast),
        (torch.ops.sdpa.attention_varlen.default, (qp, kp, vp, cu_q, cu_k, "bottom_right", None, -1, -1, 0.0, None),
         fast),
        (torch.ops.sdpa.attention_varlen_backward.default,
         (torch.ones_like(outp), *dp, cu_q, cu_k, outp.detach(), lsep, "bottom_right", None, -1, -1, 0.0, None), fast),
    ]


@pytest.mark.parametrize("sample", range(4))
def test_operators_pass_opcheck_with_it(sample):
    op, args, kwargs = _samples()[sample]
    torch.library.opcheck(op, args, kwargs)


def test_compiles_without_graph_breaks():
    torch._dynamo.reset()
    q, k, v = qkv(torch.bfloat16)

    def model(q, k, v, precision=None):
        return scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, precision=precision)

    compiled = torch.compile(model, fullgraph=True, backend="aot_eager")
    want, exact = model(q, k, v, "fast"), model(q, k, v)
    dout = torch.randn(want.shape, generator=torch.Generator().manual_seed(3)).bfloat16()
    want_grads = torch.autograd.grad(want, (q, k, v), dout)
    got = compiled(q, k, v, "fast")
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), want_grads))
    # precision=None: the block's, read while tracing and guarded on (a new block recompiles).
    assert torch.equal(compiled(q, k, v), exact)
    with sdpa.precision("fast"):
        got = compiled(q, k, v)
    assert torch.equal(got, want)
    assert all(torch.equal(a, b) for a, b in zip(torch.autograd.grad(got, (q, k, v), dout), want_grads))
