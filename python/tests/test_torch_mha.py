"""sdpa.torch.MultiheadAttention against torch.nn.MultiheadAttention with the same state_dict:
outputs, attention weights and the gradients of the inputs and of every parameter; its GQA and
RoPE options against sdpa.MultiHeadAttention (the C++ layer); in bfloat16 and float16 (both
precisions) against torch's 16-bit and float32 modules; dropout's keep decisions shared by
forward and backward; step() against the causal forward. Without torch the module is
skipped, except under CI (as test_torch.py)."""


import copy

import ml_dtypes
import numpy as np
import pytest

from torch_required import import_torch  # noqa: E402

torch = import_torch(module_level=True)

import sdpa  # noqa: E402
from sdpa.torch import MultiheadAttention  # noqa: E402


def run(module, inputs, kwargs, dtype):
    """Output, weights and every gradient (inputs, then parameters by name) of one call."""
    # One leaf per distinct input: query is key is value stays so (the packed self-attention path).
    leaves = {}
    xs = [leaves.setdefault(id(x), x.detach().to(dtype).requires_grad_(True)) for x in inputs]
    y, w = module(*xs, **kwargs)
    torch.manual_seed(7)
    dy = torch.randn(y.shape, dtype=torch.float64).to(dtype)
    module.zero_grad()
    y.backward(dy)
    results = {"y": y, "weights": w}
    for i, x in enumerate(dict.fromkeys(xs)):
        if x.grad is not None:
            results[f"d_input{i}"] = x.grad
    for name, p in module.named_parameters():
        results[f"d_{name}"] = p.grad
    return {k: v.detach().double() for k, v in results.items() if v is not None}


def mask_kwargs(kind, B, H, L, S, gen):
    if kind == "key_padding":
        kpm = torch.zeros(B, S, dtype=torch.bool)
        kpm[0, -2:] = True
        return dict(key_padding_mask=kpm)
    if kind == "bool_attn":
        m = torch.rand(L, S, generator=gen) < 0.3
        m[:, 0] = False  # every row keeps a key (torch gives NaN for a row with none)
        return dict(attn_mask=m)
    if kind == "float_attn_and_padding":
        am = torch.randn(B * H, L, S, generator=gen)
        kpm = torch.zeros(B, S)
        kpm[1, -1] = -float("inf")
        return dict(attn_mask=am, key_padding_mask=kpm)
    if kind == "causal":
        return dict(attn_mask=torch.ones(L, S, dtype=torch.bool).triu(1), is_causal=True)
    return {}


CASES = [
    # (name, embed_dim, heads, kdim, vdim, bias, batch_first, L, S, masks, need_weights, average)
    ("self", 32, 4, None, None, True, False, 6, 6, None, True, True),
    ("self_batch_first_per_head", 32, 4, None, None, True, True, 7, 7, "bool_attn", True, False),
    ("cross_kdim_vdim", 24, 3, 12, 10, True, True, 5, 9, "key_padding", True, True),
    ("no_bias_float_masks", 16, 2, None, None, False, False, 4, 8, "float_attn_and_padding", False, True),
    ("causal_mask_hint", 32, 8, None, None, True, True, 9, 9, "causal", False, True),
]


@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_matches_torch_module(case):
    _, E, H, kdim, vdim, bias, batch_first, L, S, masks, need_weights, average = case
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
    ours = MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
    ours.load_state_dict(ref.state_dict())  # unchanged
    gen = torch.Generator().manual_seed(1)
    B = 2
    shape = (lambda n, d: (B, n, d)) if batch_first else (lambda n, d: (n, B, d))
    q = torch.randn(shape(L, E), generator=gen)
    if kdim is None:
        kv = q if L == S else torch.randn(shape(S, E), generator=gen)
        inputs = [q, kv, kv]
    else:
        inputs = [q, torch.randn(shape(S, kdim), generator=gen), torch.randn(shape(S, vdim), generator=gen)]
    kwargs = dict(need_weights=need_weights, average_attn_weights=average, **mask_kwargs(masks, B, H, L, S, gen))
    got = run(ours, inputs, kwargs, torch.float32)
    want32 = run(ref, inputs, kwargs, torch.float32)
    ref64 = ref.double()
    want = run(ref64, inputs, {k: (v.double() if torch.is_tensor(v) and v.is_floating_point() else v)
                               for k, v in kwargs.items()}, torch.float64)
    assert set(got) == set(want), (sorted(got), sorted(want))
    for name in want:
        # torch's float32 module's error against its float64 self, times 4 (tests/mha_test.cc's
        # factor), plus one float32 rounding of the largest value.
        tol = 4 * (want32[name] - want[name]).abs().max().item() + 1.2e-7 * want[name].abs().max().item()
        err = (got[name] - want[name]).abs().max().item()
        assert err <= tol, (name, err, tol)


HALVES = [torch.bfloat16, torch.float16]


@pytest.mark.parametrize("precision", ["exact", "fast"])
@pytest.mark.parametrize("dtype", HALVES, ids=["bfloat16", "float16"])
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_16bit_module_matches_torchs(case, dtype, precision):
    """Parameters, inputs and masks of the 16-bit dtype for both modules; the tolerance is
    test_matches_torch_module's with torch's 16-bit module as the yardstick: it rounds where
    sdpa's does (its F.linear's outputs, the attention's output; its autograd rounds every
    gradient), so 4 · (its error against float64 on the same values) + one rounding of the
    largest value. float32's torch module on those values is within its own error of float64."""
    _, E, H, kdim, vdim, bias, batch_first, L, S, masks, need_weights, average = case
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first)
    with torch.no_grad():
        for p in ref.parameters():  # values of dtype, and biases that matter
            p.copy_((p + (0.1 * torch.randn_like(p) if p.dim() == 1 else 0)).to(dtype))
    ours = MultiheadAttention(E, H, bias=bias, kdim=kdim, vdim=vdim, batch_first=batch_first, dtype=dtype)
    ours.load_state_dict(ref.state_dict())
    assert all(p.dtype == dtype for p in ours.parameters())
    gen = torch.Generator().manual_seed(1)
    B = 2
    shape = (lambda n, d: (B, n, d)) if batch_first else (lambda n, d: (n, B, d))
    q = torch.randn(shape(L, E), generator=gen).to(dtype)
    if kdim is None:
        kv = q if L == S else torch.randn(shape(S, E), generator=gen).to(dtype)
        inputs = [q, kv, kv]
    else:
        inputs = [q, *(torch.randn(shape(S, d), generator=gen).to(dtype) for d in (kdim, vdim))]
    kwargs = {k: (v.to(dtype) if torch.is_tensor(v) and v.is_floating_point() else v)
              for k, v in mask_kwargs(masks, B, H, L, S, gen).items()}
    kwargs.update(need_weights=need_weights, average_attn_weights=average)

    def as_dtype(kw, dt):
        return {k: (v.to(dt) if torch.is_tensor(v) and v.is_floating_point() else v) for k, v in kw.items()}

    got = run(ours, inputs, dict(kwargs, precision=precision), dtype)
    want16 = run(copy.deepcopy(ref).to(dtype), inputs, kwargs, dtype)
    want32 = run(copy.deepcopy(ref).float(), inputs, as_dtype(kwargs, torch.float32), torch.float32)
    want = run(copy.deepcopy(ref).double(), inputs, as_dtype(kwargs, torch.float64), torch.float64)
    assert set(got) == set(want), (sorted(got), sorted(want))
    eps = torch.finfo(dtype).eps
    for name in want:
        tol = 4 * (want16[name] - want[name]).abs().max().item() + eps * want[name].abs().max().item()
        err = (got[name] - want[name]).abs().max().item()
        assert err <= tol, (name, err, tol)
        err32 = (want32[name] - want[name]).abs().max().item()
        assert (got[name] - want32[name]).abs().max().item() <= tol + err32, name


def test_16bit_rope_rounds_once_and_step_takes_the_dtype():
    """A bfloat16 module with RoPE and GQA: its output against the float64 module on the same
    values, with the tolerance of the C++ layer's naive bfloat16 twin (it rounds q and k once,
    after RoPE; the module also rounds F.linear's output before it, one more rounding of eps/2:
    factor 4 as above covers it); step decodes with a bfloat16 cache in the same bound."""
    torch.manual_seed(0)
    E, H, Hkv = 32, 8, 2
    mod = MultiheadAttention(E, H, num_kv_heads=Hkv, rope=True, batch_first=True, dtype=torch.bfloat16)
    with torch.no_grad():
        mod.in_proj_bias.normal_()
    mod64 = copy.deepcopy(mod).double()
    layer = sdpa.MultiHeadAttention(E, H, num_kv_heads=Hkv, rope=True, dtype=ml_dtypes.bfloat16)
    D = E // H
    b = mod.in_proj_bias.detach().float().numpy()
    layer.w_q, layer.w_k, layer.w_v = (w.detach().float().numpy().T.astype(ml_dtypes.bfloat16) for w in
                                       (mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight))
    layer.b_q, layer.b_k, layer.b_v = (a.astype(ml_dtypes.bfloat16) for a in (b[:E], b[E:E + Hkv * D], b[E + Hkv * D:]))
    layer.w_o = mod.out_proj.weight.detach().float().numpy().T.astype(ml_dtypes.bfloat16)
    layer.b_o = mod.out_proj.bias.detach().float().numpy().astype(ml_dtypes.bfloat16)
    x = torch.randn(2, 11, E).bfloat16()
    with torch.no_grad():
        y, _ = mod(x, x, x, need_weights=False, is_causal=True, position_q=5, position_k=5)
        y64, _ = mod64(x.double(), x.double(), x.double(), need_weights=False, is_causal=True, position_q=5,
                       position_k=5)
    naive = layer(sdpa_np(x), causal=True, position_q=5, position_k=5, backend="naive").astype(np.float64)
    ref = layer(sdpa_np(x), causal=True, position_q=5, position_k=5, backend="reference").astype(np.float64)
    assert np.abs(ref - y64.numpy()).max() <= 2 ** -8 * np.abs(ref).max()  # the same layer: y rounded once
    tol = 4 * np.abs(naive - ref).max() + 2 ** -7 * np.abs(ref).max()
    assert (y.double() - y64).abs().max().item() <= tol
    cache = mod.new_cache(num_pages=8, page_size=4)
    assert cache.dtype == ml_dtypes.bfloat16
    seqs = [cache.new_sequence(), cache.new_sequence()]
    with torch.no_grad():
        full, _ = mod(x, x, x, need_weights=False, is_causal=True)
        full64, _ = mod64(x.double(), x.double(), x.double(), need_weights=False, is_causal=True)
    got = torch.cat([mod.step(x[:, a:b], cache, seqs) for a, b in ((0, 1), (1, 5), (5, 11))], dim=1)
    assert got.dtype == torch.bfloat16
    assert (got.double() - full64).abs().max().item() <= tol
    with pytest.raises(TypeError, match="x must be a bfloat16 tensor"):
        mod.step(x.float(), cache, seqs)


def sdpa_np(t):
    """A bfloat16 tensor as an ml_dtypes.bfloat16 array."""
    return t.float().numpy().astype(ml_dtypes.bfloat16)


def test_gqa_and_rope_match_the_cpp_layer():
    torch.manual_seed(0)
    E, H, Hkv = 32, 8, 2
    mod = MultiheadAttention(E, H, num_kv_heads=Hkv, rope=True, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        mod.in_proj_bias.normal_()
    layer = sdpa.MultiHeadAttention(E, H, num_kv_heads=Hkv, rope=True, dtype=np.float64)
    D = E // H
    b = mod.in_proj_bias.detach().numpy()
    layer.w_q, layer.w_k, layer.w_v = (w.detach().numpy().T.copy() for w in
                                       (mod.q_proj_weight, mod.k_proj_weight, mod.v_proj_weight))
    layer.b_q, layer.b_k, layer.b_v = b[:E].copy(), b[E:E + Hkv * D].copy(), b[E + Hkv * D:].copy()
    layer.w_o = mod.out_proj.weight.detach().numpy().T.copy()
    layer.b_o = mod.out_proj.bias.detach().numpy().copy()
    x = torch.randn(2, 11, E, dtype=torch.float64, requires_grad=True)
    y, _ = mod(x, x, x, need_weights=False, is_causal=True, position_q=5, position_k=5)
    dy = torch.randn_like(y)
    y.backward(dy)
    y2 = layer(x.detach().numpy(), causal=True, position_q=5, position_k=5)
    g = layer.backward(dy.numpy())
    tol = 1e3 * np.finfo(np.float64).eps  # two float64 evaluations of the same sums, values O(1)
    np.testing.assert_allclose(y.detach().numpy(), y2, rtol=0, atol=tol * (1 + np.abs(y2).max()))
    np.testing.assert_allclose(x.grad.numpy(), g.x_q, rtol=0, atol=tol * (1 + np.abs(g.x_q).max()))
    np.testing.assert_allclose(mod.q_proj_weight.grad.numpy().T, g.w_q, rtol=0, atol=tol * (1 + np.abs(g.w_q).max()))
    np.testing.assert_allclose(mod.in_proj_bias.grad.numpy(), np.concatenate([g.b_q, g.b_k, g.b_v]), rtol=0,
                               atol=tol * 10)


def test_dropout_gradient_is_the_forwards():
    """With torch's generator reseeded, the module is a deterministic function of its inputs;
    autograd's gradient must match its finite differences, which holds only if the backward
    drops what the forward dropped."""
    torch.manual_seed(0)
    mod = MultiheadAttention(16, 2, dropout=0.3, batch_first=True, dtype=torch.float64)
    x = torch.randn(1, 5, 16, dtype=torch.float64, requires_grad=True)
    dy = torch.randn(1, 5, 16, dtype=torch.float64)

    def loss(inp):
        torch.manual_seed(42)
        return (mod(inp, inp, inp, need_weights=False)[0] * dy).sum()

    loss(x).backward()
    with torch.no_grad():
        nodrop = (mod.eval()(x, x, x, need_weights=False)[0] * dy).sum()
        mod.train()
        assert not torch.isclose(nodrop, loss(x)), "dropout changed nothing"
    h = 1e-6
    for i in [(0, 0, 0), (0, 3, 7), (0, 4, 15)]:
        xp, xm = x.detach().clone(), x.detach().clone()
        xp[i] += h
        xm[i] -= h
        fd = (loss(xp) - loss(xm)).item() / (2 * h)
        assert abs(x.grad[i].item() - fd) < 1e-6, (i, x.grad[i].item(), fd)


def test_step_matches_causal_forward():
    torch.manual_seed(0)
    mod = MultiheadAttention(32, 4, num_kv_heads=2, rope=True, batch_first=True).eval()
    x = torch.randn(2, 9, 32)
    with torch.no_grad():
        full, _ = mod(x, x, x, need_weights=False, is_causal=True)
    cache = mod.new_cache(num_pages=8, page_size=4)
    seqs = [cache.new_sequence(), cache.new_sequence()]
    got = torch.cat([mod.step(x[:, a:b], cache, seqs) for a, b in ((0, 1), (1, 5), (5, 9))], dim=1)
    # Two float32 evaluations (dense and paged kernels, different GEMM shapes): a few float32
    # roundings of values O(1) summed over 32 terms.
    assert (got - full).abs().max().item() < 64 * 1.2e-7 * (1 + full.abs().max().item())


def test_is_causal_alone_with_key_padding_matches_torch_with_the_causal_mask():
    """sdpa's module applies causal from is_causal alone; torch's needs the mask with it."""
    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(16, 2, batch_first=True)
    ours = MultiheadAttention(16, 2, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(2, 6, 16)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    causal = torch.ones(6, 6, dtype=torch.bool).triu(1)
    y, w = ours(x, x, x, key_padding_mask=kpm, is_causal=True)
    y2, w2 = ref(x, x, x, key_padding_mask=kpm, attn_mask=causal, is_causal=True)
    ref64 = torch.nn.MultiheadAttention(16, 2, batch_first=True).double()
    ref64.load_state_dict(ref.state_dict())
    y64, w64 = ref64(x.double(), x.double(), x.double(), key_padding_mask=kpm, attn_mask=causal, is_causal=True)
    for got, want32, want in ((y, y2, y64), (w, w2, w64)):
        tol = 4 * (want32.double() - want).abs().max().item() + 1.2e-7 * want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= tol


def test_step_checks_before_appending():
    mod = MultiheadAttention(16, 2, batch_first=True)
    cache = mod.new_cache(num_pages=2, page_size=2)
    s0, s1 = cache.new_sequence(), cache.new_sequence()
    x = torch.randn(2, 3, 16)
    with pytest.raises(ValueError, match="twice"):
        mod.step(x, cache, [s0, s0])
    with pytest.raises(ValueError, match="2 free pages, these tokens need 4"):
        mod.step(x, cache, [s0, s1])
    with pytest.raises(ValueError):
        mod.step(x, cache, [s0, 7])  # an unknown sequence
    assert cache.length(s0) == cache.length(s1) == 0 and cache.free_pages == 2


def test_unbatched_and_errors():
    torch.manual_seed(0)
    mod = MultiheadAttention(16, 4)
    ref = torch.nn.MultiheadAttention(16, 4)
    ref.load_state_dict(mod.state_dict())
    x = torch.randn(5, 16)
    y, w = mod(x, x, x)
    y2, w2 = ref(x, x, x)
    assert y.shape == y2.shape and w.shape == w2.shape == (5, 5)
    assert (y - y2).abs().max() < 1e-5
    with pytest.raises(ValueError, match="add_bias_kv"):
        MultiheadAttention(16, 4, add_bias_kv=True)
    with pytest.raises(ValueError, match="num_kv_heads \\(3\\) must divide num_heads \\(4\\)"):
        MultiheadAttention(16, 4, num_kv_heads=3)
    with pytest.raises(TypeError, match="attn_mask has dtype torch.int64"):
        mod(x, x, x, attn_mask=torch.zeros(5, 5, dtype=torch.int64))
    with pytest.raises(RuntimeError, match="key_padding_mask has shape"):
        mod(x.unsqueeze(1), x.unsqueeze(1), x.unsqueeze(1), key_padding_mask=torch.zeros(2, 5, dtype=torch.bool))


@pytest.mark.parametrize("average", [True, False], ids=["averaged", "per_head"])
def test_need_weights_compiles_with_fullgraph(average):
    """need_weights=True, the default: the weights come from sdpa's operator (they came from a
    NumPy call, which broke the graph: "Unsupported ndarray attribute access"), so the module
    compiles with fullgraph=True, and gives torch's module's output and weights."""
    torch._dynamo.reset()
    torch.manual_seed(0)
    E, H, B, L = 32, 4, 2, 6
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ours = MultiheadAttention(E, H, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    x = torch.randn(B, L, E, generator=torch.Generator().manual_seed(3))
    kpm = torch.zeros(B, L, dtype=torch.bool)
    kpm[0, -2:] = True
    kwargs = dict(key_padding_mask=kpm, average_attn_weights=average)  # need_weights left at True
    y, w = torch.compile(ours, fullgraph=True, backend="aot_eager")(x, x, x, **kwargs)
    y32, w32 = ref(x, x, x, **kwargs)
    y64, w64 = ref.double()(x.double(), x.double(), x.double(), **kwargs)
    assert w.shape == w64.shape == ((B, L, L) if average else (B, H, L, L))
    for got, want32, want in ((y, y32, y64), (w, w32, w64)):
        # torch's float32 module's error against its float64 self, times 4, plus one float32
        # rounding of the largest value (test_matches_torch_module's bound).
        tol = 4 * (want32.double() - want).abs().max().item() + 1.2e-7 * want.abs().max().item()
        assert (got.double() - want).abs().max().item() <= tol
