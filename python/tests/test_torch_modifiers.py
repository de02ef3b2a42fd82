"""sdpa.torch with score modifiers (softcap, ALiBi slopes, sinks): forward and gradients (the
sinks' and the slopes' too) against the same maths written in plain torch ops (autograd through
a materialised score matrix), gradcheck in float64, varlen per sequence, opcheck of the
operators with modifiers, and torch.compile without graph breaks. Skipped without torch, except where CI is set (as
test_torch.py)."""

import math

import pytest

from torch_required import import_torch  # noqa: E402

torch = import_torch(module_level=True)

import sdpa.torch  # noqa: E402
from sdpa.torch import scaled_dot_product_attention  # noqa: E402


@pytest.fixture(autouse=True)
def one_thread():
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    sdpa.set_num_threads(1)
    yield
    torch.set_num_threads(threads)
    sdpa.set_num_threads(0)


def plain(q, k, v, is_causal=False, softcap=0.0, order="before_bias", slopes=None, sinks=None):
    """The modified attention in plain torch ops (q (B, H, L, E), k and v (B, H, S, E)),
    PyTorch's top-left causal, ALiBi aligned bottom-right, a sink as an extra column with no
    value."""
    L, S = q.shape[-2], k.shape[-2]
    s = q @ k.transpose(-1, -2) / q.shape[-1] ** 0.5
    i = torch.arange(L)[:, None]
    j = torch.arange(S)[None, :]
    blocked = (j > i) if is_causal else torch.zeros(L, S, dtype=torch.bool)
    alibi = 0.0 if slopes is None else -slopes.reshape(-1, q.shape[1], 1, 1) * (i + S - L - j).abs()
    if softcap and order == "before_bias":
        s = softcap * torch.tanh(s / softcap)
    s = s + alibi
    if softcap and order == "after_bias":
        s = softcap * torch.tanh(s / softcap)
    s = s.masked_fill(blocked, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.reshape(1, -1, 1, 1).expand(*s.shape[:-1], 1)], dim=-1)
    w = torch.softmax(s, dim=-1)[..., :S]
    return w @ v


CASES = {
    "softcap": dict(softcap=2.0),
    "softcap_after_bias": dict(softcap=2.0, softcap_order="after_bias"),
    "alibi": dict(alibi_slopes=[0.5, 0.25, 0.125, 0.0625]),
    "sinks": dict(sinks=[0.5, -1.0, 2.0, 0.0]),
    "all": dict(softcap=3.0, alibi_slopes=[0.5, 0.25, 0.125, 0.0625], sinks=[0.5, -1.0, 2.0, 0.0]),
}


def _tensors(dtype, seed=0, B=2, H=4, L=9, S=13, E=8):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(shape, generator=g, dtype=torch.float64) * scale).to(dtype).requires_grad_()
            for shape, scale in (((B, H, L, E), 2.0), ((B, H, S, E), 2.0), ((B, H, S, E), 1.0))]


@pytest.mark.parametrize("name", CASES)
@pytest.mark.parametrize("is_causal", [False, True])
def test_matches_plain_torch_forward_and_backward(name, is_causal):
    kw = CASES[name]
    q, k, v = _tensors(torch.float64)
    slopes = torch.tensor(kw["alibi_slopes"], dtype=torch.float64) if "alibi_slopes" in kw else None
    sinks = torch.tensor(kw["sinks"], dtype=torch.float64, requires_grad=True) if "sinks" in kw else None
    order = kw.get("softcap_order", "before_bias")
    out = scaled_dot_product_attention(q, k, v, is_causal=is_causal, softcap=kw.get("softcap", 0.0),
                                       softcap_order=order, alibi_slopes=slopes, sinks=sinks)
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, [q, k, v] + ([sinks] if sinks is not None else []), dout)
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    sinks2 = sinks.detach().clone().requires_grad_() if sinks is not None else None
    want = plain(q2, k2, v2, is_causal, kw.get("softcap", 0.0), order, slopes, sinks2)
    want_grads = torch.autograd.grad(want, [q2, k2, v2] + ([sinks2] if sinks2 is not None else []), dout)
    torch.testing.assert_close(out, want, rtol=0, atol=1e-12)
    for g, w in zip(grads, want_grads):
        torch.testing.assert_close(g, w, rtol=0, atol=1e-11)


def test_gradcheck_float64_with_every_modifier():
    q, k, v = _tensors(torch.float64, B=1, H=2, L=4, S=6, E=3)
    sinks = torch.tensor([0.3, -0.4], dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([[0.5, 0.25]], dtype=torch.float64)
    for order in ("before_bias", "after_bias"):
        def f(q, k, v, sinks):
            return scaled_dot_product_attention(q, k, v, is_causal=True, softcap=1.5, softcap_order=order,
                                                alibi_slopes=slopes, sinks=sinks)
        assert torch.autograd.gradcheck(f, (q, k, v, sinks))


def test_bfloat16_sinks_get_a_bfloat16_gradient():
    """A model's bfloat16 sink parameter: converted to float32 for the kernel, its gradient
    flows back through the conversion."""
    q, k, v = _tensors(torch.bfloat16)
    sinks = torch.zeros(4, dtype=torch.bfloat16, requires_grad=True)
    out = scaled_dot_product_attention(q, k, v, sinks=sinks)
    out.float().sum().backward()
    assert sinks.grad is not None and sinks.grad.dtype == torch.bfloat16 and sinks.grad.shape == (4,)


def test_varlen_with_modifiers_matches_per_sequence_calls():
    g = torch.Generator().manual_seed(3)
    lq, lk = [3, 6], [5, 11]
    cu_q, cu_k = torch.tensor([0, 3, 9]), torch.tensor([0, 5, 16])
    q = torch.randn(9, 4, 8, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(16, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(16, 2, 8, generator=g, dtype=torch.float64, requires_grad=True)
    sinks = torch.tensor([0.1, 0.2, 0.3, 0.4], dtype=torch.float64, requires_grad=True)
    slopes = torch.tensor([[0.5, 0.25, 0.1, 0.05], [0.2, 0.3, 0.4, 0.5]], dtype=torch.float64)
    out = sdpa.torch.attention_varlen(q, k, v, cu_q, cu_k, causal=True, softcap=3.0, alibi_slopes=slopes, sinks=sinks)
    out.sum().backward()
    want_grad = torch.zeros(4, dtype=torch.float64)
    for b in range(2):
        qs = q.detach()[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None]
        ks = k.detach()[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None].repeat_interleave(2, dim=1)
        vs = v.detach()[cu_k[b]:cu_k[b + 1]].transpose(0, 1)[None].repeat_interleave(2, dim=1)
        s = sinks.detach().clone().requires_grad_()
        # bottom-right causal with Nq <= Nk equals top-left on the last Nq keys' alignment: use the plain maths
        L, S = lq[b], lk[b]
        x = qs @ ks.transpose(-1, -2) / 8 ** 0.5
        i, j = torch.arange(L)[:, None], torch.arange(S)[None, :]
        x = 3.0 * torch.tanh(x / 3.0) - slopes[b].reshape(1, 4, 1, 1) * (i + S - L - j).abs()
        x = x.masked_fill(j > i + S - L, float("-inf"))
        x = torch.cat([x, s.reshape(1, 4, 1, 1).expand(1, 4, L, 1)], dim=-1)
        want = torch.softmax(x, -1)[..., :S] @ vs
        torch.testing.assert_close(out.detach()[cu_q[b]:cu_q[b + 1]].transpose(0, 1)[None], want, rtol=0, atol=1e-12)
        want.sum().backward()
        want_grad += s.grad
    torch.testing.assert_close(sinks.grad, want_grad, rtol=0, atol=1e-11)


def _samples():
    g = torch.Generator().manual_seed(31)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64, requires_grad=True)
               for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)))
    sinks = torch.randn(4, generator=g, dtype=torch.float64, requires_grad=True)
    slopes = torch.rand(2, 4, generator=g, dtype=torch.float64)
    mods = (1.5, True, slopes, sinks)
    out, lse = torch.ops.sdpa.attention(q, k, v, None, "none", None, -1, -1, 0.0, None, *mods)
    qp, kp, vp = (torch.randn(s, generator=g, dtype=torch.float32, requires_grad=True)
                  for s in ((5, 4, 8), (9, 2, 8), (9, 2, 6)))
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9])
    vmods = (2.0, False, slopes.float(), sinks.detach().float().requires_grad_())
    outp, lsep = torch.ops.sdpa.attention_varlen(qp, kp, vp, cu_q, cu_k, "bottom_right", None, -1, -1, 0.0, None,
                                                 *vmods)
    pages = torch.randn(6, 16, 2, 8, generator=g)
    table = torch.tensor([[3, 1], [0, 5]], dtype=torch.int32)
    return [
        (torch.ops.sdpa.attention.default, (q, k, v, None, "top_left", None, -1, -1, 0.0, None, *mods)),
        (torch.ops.sdpa.attention_backward.default,
         (torch.randn(out.shape, dtype=out.dtype), q.detach(), k.detach(), v.detach(), out.detach(), lse, None, "none",
          None, -1, -1, 0.0, None, *mods[:3], sinks.detach())),
        (torch.ops.sdpa.attention_varlen.default, (qp, kp, vp, cu_q, cu_k, "bottom_right", None, -1, -1, 0.0, None,
                                                   *vmods)),
        (torch.ops.sdpa.attention_varlen_backward.default,
         (torch.randn(outp.shape), qp.detach(), kp.detach(), vp.detach(), cu_q, cu_k, outp.detach(), lsep,
          "bottom_right", None, -1, -1, 0.0, None, *vmods[:3], vmods[3].detach())),
        (torch.ops.sdpa.attention_paged.default,
         (torch.randn(2, 4, 3, 8, generator=g), pages, pages, table, torch.tensor([20, 9]), None, "bottom_right", None,
          -1, -1, 2.0, False, slopes.float(), sinks.detach().float())),
    ]


@pytest.mark.parametrize("sample", range(5))
def test_operators_with_modifiers_pass_opcheck(sample):
    op, args = _samples()[sample]
    torch.library.opcheck(op, args)


def test_compiles_without_graph_breaks_with_modifiers():
    q, k, v = _tensors(torch.float32)
    sinks = torch.zeros(4, requires_grad=True)

    def block(q, k, v, sinks):
        return scaled_dot_product_attention(q, k, v, is_causal=True, softcap=5.0, sinks=sinks,
                                            alibi_slopes=torch.tensor([0.5, 0.25, 0.125, 0.0625])).sum()

    compiled = torch.compile(block, backend="aot_eager", fullgraph=True)
    loss = compiled(q, k, v, sinks)
    loss.backward()
    q2, k2, v2 = (t.detach().clone().requires_grad_() for t in (q, k, v))
    sinks2 = sinks.detach().clone().requires_grad_()
    block(q2, k2, v2, sinks2).backward()
    torch.testing.assert_close(loss, block(q2, k2, v2, sinks2))
    torch.testing.assert_close(sinks.grad, sinks2.grad)
    torch.testing.assert_close(q.grad, q2.grad)


# ---------------------------------------------------------------- the ALiBi slopes' gradient


@pytest.mark.parametrize("shape", [(4,), (1, 4), (2, 4)], ids=["per_head", "broadcast_row", "per_batch"])
@pytest.mark.parametrize("kw", [dict(), dict(is_causal=True, softcap=2.0), dict(softcap=1.5, order="after_bias")],
                         ids=["plain", "causal_cap", "cap_after"])
def test_alibi_slopes_get_the_gradient_of_plain_torch(shape, kw):
    """Slopes that require grad get ∂loss/∂slopes (they used to keep .grad None), shaped like
    them: what autograd through the plain maths gives."""
    q, k, v = _tensors(torch.float64, L=7, S=10)
    g = torch.Generator().manual_seed(5)
    slopes = (torch.rand(shape, generator=g, dtype=torch.float64) - 0.2).requires_grad_()
    order = kw.get("order", "before_bias")
    out = scaled_dot_product_attention(q, k, v, is_causal=kw.get("is_causal", False), softcap=kw.get("softcap", 0.0),
                                       softcap_order=order, alibi_slopes=slopes)
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64)
    out.backward(dout)
    assert slopes.grad is not None and slopes.grad.shape == shape
    s2 = slopes.detach().clone().requires_grad_()
    want = plain(q.detach(), k.detach(), v.detach(), kw.get("is_causal", False), kw.get("softcap", 0.0), order, s2)
    want.backward(dout)
    assert s2.grad.abs().min() > 1e-3  # every slope moves the loss: the comparison tests each
    torch.testing.assert_close(slopes.grad, s2.grad, rtol=0, atol=1e-11)


def test_gradcheck_float64_with_alibi_slopes():
    q, k, v = _tensors(torch.float64, B=2, H=2, L=4, S=6, E=3)
    sinks = torch.tensor([0.3, -0.4], dtype=torch.float64, requires_grad=True)
    for shape in ((2,), (1, 2), (2, 2)):
        slopes = torch.linspace(0.1, 0.7, math.prod(shape), dtype=torch.float64).reshape(shape).requires_grad_()
        for order in ("before_bias", "after_bias"):
            def f(q, k, v, slopes, sinks):
                return scaled_dot_product_attention(q, k, v, is_causal=True, softcap=1.5, softcap_order=order,
                                                    alibi_slopes=slopes, sinks=sinks)
            assert torch.autograd.gradcheck(f, (q, k, v, slopes, sinks))


def test_gradcheck_float64_varlen_with_alibi_slopes():
    g = torch.Generator().manual_seed(9)
    q = torch.randn(7, 2, 3, generator=g, dtype=torch.float64, requires_grad=True)
    k = torch.randn(9, 1, 3, generator=g, dtype=torch.float64, requires_grad=True)
    v = torch.randn(9, 1, 2, generator=g, dtype=torch.float64, requires_grad=True)
    cu_q, cu_k = torch.tensor([0, 3, 3, 7]), torch.tensor([0, 2, 5, 9])  # the middle sequence has no query
    for shape in ((2,), (1, 2), (3, 2)):
        slopes = torch.linspace(-0.2, 0.6, math.prod(shape), dtype=torch.float64).reshape(shape).requires_grad_()

        def f(q, k, v, slopes):
            return sdpa.torch.attention_varlen(q, k, v, cu_q, cu_k, causal=True, alibi_slopes=slopes)
        assert torch.autograd.gradcheck(f, (q, k, v, slopes))
        out = f(q, k, v, slopes)
        out.sum().backward()
        assert slopes.grad is not None and slopes.grad.shape == shape


def test_bfloat16_slopes_get_a_bfloat16_gradient():
    q, k, v = _tensors(torch.bfloat16)
    slopes = torch.full((2, 4), 0.25, dtype=torch.bfloat16, requires_grad=True)
    scaled_dot_product_attention(q, k, v, alibi_slopes=slopes).float().sum().backward()
    assert slopes.grad is not None and slopes.grad.dtype == torch.bfloat16 and slopes.grad.shape == (2, 4)


def test_compiles_without_graph_breaks_with_learned_slopes():
    torch._dynamo.reset()
    q, k, v = _tensors(torch.float32)
    slopes = torch.tensor([0.5, 0.25, 0.125, 0.0625], requires_grad=True)

    def block(q, k, v, slopes):
        return scaled_dot_product_attention(q, k, v, is_causal=True, alibi_slopes=slopes).sum()

    loss = torch.compile(block, backend="aot_eager", fullgraph=True)(q, k, v, slopes)
    loss.backward()
    s2 = slopes.detach().clone().requires_grad_()
    block(*(t.detach() for t in (q, k, v)), s2).backward()
    torch.testing.assert_close(slopes.grad, s2.grad, rtol=0, atol=0)


def _alibi_grad_samples():
    g = torch.Generator().manual_seed(37)
    q, k, v = (torch.randn(s, generator=g, dtype=torch.float64) for s in ((2, 4, 5, 8), (2, 2, 7, 8), (2, 2, 7, 6)))
    slopes = torch.rand(2, 4, generator=g, dtype=torch.float64)
    out, lse = torch.ops.sdpa.attention(q, k, v, None, "none", None, -1, -1, 0.0, None, 0.0, False, slopes)
    qp, kp, vp = (torch.randn(s, generator=g) for s in ((5, 4, 8), (9, 2, 8), (9, 2, 6)))
    cu_q, cu_k = torch.tensor([0, 2, 5], dtype=torch.int32), torch.tensor([0, 4, 9])
    vslopes = torch.rand(4, generator=g)
    outp, lsep = torch.ops.sdpa.attention_varlen(qp, kp, vp, cu_q, cu_k, "bottom_right", None, -1, -1, 0.0, None,
                                                 0.0, False, vslopes)
    return [
        (torch.ops.sdpa.attention_backward.default,
         (torch.randn(out.shape, dtype=out.dtype), q, k, v, out, lse, None, "none", None, -1, -1, 0.0, None, 0.0,
          False, slopes, None, None, 128, 128, False, True)),
        (torch.ops.sdpa.attention_varlen_backward.default,
         (torch.randn(outp.shape), qp, kp, vp, cu_q, cu_k, outp, lsep, "bottom_right", None, -1, -1, 0.0, None, 0.0,
          False, vslopes, None, None, 128, 128, True)),
    ]


@pytest.mark.parametrize("sample", range(2))
def test_backward_operators_with_alibi_grad_pass_opcheck(sample):
    op, args = _alibi_grad_samples()[sample]
    torch.library.opcheck(op, args)
