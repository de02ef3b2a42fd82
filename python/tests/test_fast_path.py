"""The fast paths of the tiny call (issue 30): ``sdpa.attention``'s for arrays it passes to _core as
they are with default options, and ``sdpa.torch``'s operator without lse. Each must give the
slow path's results bit for bit and its errors word for word, and be taken exactly where it
claims to be (the tests below fail when a fast path is removed, widened or narrowed).

The slow path of ``sdpa.attention`` is reached with an option at a non-default value that means
the default (``window=(None, None)``): the same call to _core, through every check."""

import ml_dtypes
import numpy as np
import pytest

import sdpa

SLOW = {"window": (None, None)}  # unbounded: the default's meaning, through the slow path


def _arrays(rng, dtype, shapes):
    return [rng.standard_normal(s).astype(dtype) for s in shapes]


def _equal(a, b):
    assert a.dtype == b.dtype and a.shape == b.shape
    np.testing.assert_array_equal(a.view(np.uint8), b.view(np.uint8))  # bits (NaN too)


def _counted(monkeypatch, module, name):
    """The list of calls of module.name (one entry each), for the rest of the test."""
    calls = []
    real = getattr(module, name)

    def counting(*args):
        calls.append(1)
        return real(*args)

    monkeypatch.setattr(module, name, counting)
    return calls


@pytest.fixture
def fast_taken(monkeypatch):
    """Counts the calls that went the slow way (through _prepared_inputs)."""
    return _counted(monkeypatch, sdpa, "_prepared_inputs")


SHAPES = [((1, 4, 1, 32), (1, 4, 16, 32), (1, 4, 16, 32)),  # the decode step of bench/overhead.py
          ((2, 8, 5, 16), (2, 2, 97, 16), (2, 2, 97, 24)),  # GQA, Dv != Dk, odd Nk
          ((3, 7, 9), (3, 11, 9), (3, 11, 9)),  # (H, N, D)
          ((1, 1), (1025, 1), (1025, 1)),  # (N, D), D = 1
          ((6, 3), (5, 3), (5, 2))]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, ml_dtypes.bfloat16])
@pytest.mark.parametrize("shapes", SHAPES)
@pytest.mark.parametrize("causal", [False, True])
def test_fast_equals_slow(fast_taken, dtype, shapes, causal):
    q, k, v = _arrays(np.random.default_rng(len(shapes[0])), dtype, shapes)
    fast = sdpa.attention(q, k, v, causal=causal)
    assert not fast_taken, "the fast path was not taken"
    slow = sdpa.attention(q, k, v, causal=causal, **SLOW)
    assert fast_taken, "the slow path was not taken"
    _equal(fast, slow)
    assert fast.dtype == q.dtype


def test_fast_strided_and_mixed(fast_taken):
    """Strided views (a (B, L, H, D) tensor transposed, a slice, a broadcast batch) and float32
    queries over a 16-bit cache go the fast way too, with the slow way's results."""
    rng = np.random.default_rng(1)
    base = rng.standard_normal((2, 17, 4, 8)).astype(np.float32)
    q = base.transpose(0, 2, 1, 3)[:, :, :3]
    k = base.transpose(0, 2, 1, 3)
    v = rng.standard_normal((1, 4, 17, 8)).astype(np.float32)
    for kv_dtype in (np.float32, np.float16, ml_dtypes.bfloat16):
        kk, vv = k.astype(kv_dtype), np.broadcast_to(v.astype(kv_dtype), (2, 4, 17, 8))
        fast_taken.clear()
        fast = sdpa.attention(q, kk, vv, causal=True, backend="flash", precision="exact")
        assert not fast_taken
        _equal(fast, sdpa.attention(q, kk, vv, causal=True, backend="flash", precision="exact", **SLOW))
    with sdpa.precision("fast"):  # the context's precision reaches the fast path
        kk, vv = k.astype(ml_dtypes.bfloat16), np.broadcast_to(v.astype(ml_dtypes.bfloat16), (2, 4, 17, 8))
        qq = q.astype(ml_dtypes.bfloat16)
        fast = sdpa.attention(qq, kk, vv)
        _equal(fast, sdpa.attention(qq, kk, vv, precision="fast", **SLOW))
        assert not (fast == sdpa.attention(qq, kk, vv, precision="exact")).all()


class _Sub(np.ndarray):
    pass


def _odd_arrays():
    """Inputs the fast path must leave to the slow one (each needs a conversion, a copy or a check)."""
    rng = np.random.default_rng(2)
    q = rng.standard_normal((2, 3, 4)).astype(np.float32)
    raw = np.zeros(q.nbytes + 1, np.uint8)[1:]  # data at an odd address
    misaligned = np.frombuffer(raw.data, np.float32).reshape(q.shape)
    misaligned[...] = q
    odd_stride = np.lib.stride_tricks.as_strided(q, shape=(1, 3, 4), strides=(2, 16, 4))  # a size-1 dim, stride 2
    return {"float64 list": q.astype(np.float64).tolist(),
            "big-endian": q.astype(">f4"),
            "int": (q * 10).astype(np.int32),
            "last dim strided": np.asfortranarray(q),
            "misaligned": misaligned,
            "odd stride of a size-1 dim": odd_stride,
            "subclass": q.view(_Sub),
            "empty": q[:, :0]}


@pytest.mark.parametrize("name", list(_odd_arrays()))
def test_fast_path_not_taken(fast_taken, name):
    odd = _odd_arrays()[name]
    rng = np.random.default_rng(3)
    ndim = np.ndim(odd)
    k = rng.standard_normal((3,) * (ndim - 2) + (5, 4)).astype(np.float32)
    if ndim == 3:
        k = rng.standard_normal((np.shape(odd)[0], 5, 4)).astype(np.float32)
    out = sdpa.attention(odd, k, k)
    assert fast_taken, f"the fast path took {name}"
    ref = sdpa.attention(np.array(np.asarray(odd), dtype=np.float64), k.astype(np.float64), k.astype(np.float64))
    np.testing.assert_allclose(out, ref, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("option", [{"mask": np.ones((1, 5), bool)}, {"causal": "top_left"}, {"scale": 0.5},
                                    {"window": (1, 1)}, {"seqlens_k": [5]}, {"return_lse": True},
                                    {"dropout_p": 0.5, "seed": 1}, {"seed": 0}, {"softcap": 5.0},
                                    {"softcap_order": "after_bias"}, {"alibi_slopes": [0.5]}, {"sinks": [0.0]},
                                    {"block_size": 64}, {"out_dtype": "float32"}, {"q_start": 0, "k_start": 0},
                                    {"dropout_p": 0}, {"causal": 1}, {"softcap": 0}])
def test_options_go_slow(fast_taken, option):
    """Any option away from its default (or of another type than the default's) takes the slow path."""
    rng = np.random.default_rng(4)
    q, k = rng.standard_normal((1, 2, 3, 4)).astype(np.float32), rng.standard_normal((1, 1, 5, 4)).astype(np.float32)
    try:
        sdpa.attention(q, k, k, **option)
    except (TypeError, ValueError):
        pass  # (causal=1 is refused: by the slow path's check)
    assert fast_taken


def _message(call):
    with pytest.raises((TypeError, ValueError)) as e:
        call()
    return e.type, str(e.value)


@pytest.mark.parametrize("shapes", [((1, 4, 1, 32), (1, 3, 16, 32), (1, 3, 16, 32)),  # heads
                                    ((1, 4, 1, 32), (1, 4, 16, 31), (1, 4, 16, 32)),  # Dk
                                    ((2, 4, 1, 32), (1, 4, 16, 32), (3, 4, 16, 32)),  # batch
                                    ((1, 4, 1, 32), (1, 4, 16, 32), (1, 4, 15, 32)),  # Nk
                                    ((4, 1, 32), (1, 4, 16, 32), (1, 4, 16, 32))])  # ranks
@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16])
def test_fast_errors_are_the_slow_ones(fast_taken, shapes, dtype):
    q, k, v = _arrays(np.random.default_rng(5), dtype, shapes)
    fast = _message(lambda: sdpa.attention(q, k, v))
    assert not fast_taken
    slow = _message(lambda: sdpa.attention(q, k, v, **SLOW))
    assert fast_taken and fast == slow
    assert fast[1].split()[0].strip(":,") in ("q", "k", "v"), fast  # names the argument
    for bad in (dict(backend="fastest"), dict(precision="quick")):  # names _core checks
        fast_taken.clear()
        assert _message(lambda: sdpa.attention(*_arrays(np.random.default_rng(5), dtype, SHAPES[0]), **bad)) == \
            _message(lambda: sdpa.attention(*_arrays(np.random.default_rng(5), dtype, SHAPES[0]), **bad, **SLOW))


# ---------------------------------------------------------------- sdpa.torch: the operator without lse

def _torch():
    from torch_required import import_torch
    return import_torch()


@pytest.fixture
def out_op_calls(monkeypatch):
    """Counts the wrapper's calls of attention_out (the operator without lse)."""
    _torch()
    import sdpa.torch as st
    return _counted(monkeypatch, st, "_attention_out")


@pytest.mark.parametrize("dtype", ["float32", "float64", "bfloat16", "float16"])
@pytest.mark.parametrize("causal", ["none", "top_left", "bottom_right"])
@pytest.mark.parametrize("shapes", [SHAPES[0], SHAPES[1], ((1, 1), (1025, 1), (1025, 1)), ((3, 6, 2), (3, 1, 2), (3, 1, 3))])
def test_attention_out_is_attentions_out(dtype, causal, shapes):
    """attention_out's out is attention's bit for bit, and its gradients (through attention's
    Function) are attention's too."""
    torch = _torch()
    import sdpa.torch  # noqa: F401  (loads the operators)
    g = torch.Generator().manual_seed(33)
    q, k, v = (torch.randn(s, generator=g).to(getattr(torch, dtype)).requires_grad_() for s in shapes)
    for scale in (None, 0.3):
        out = torch.ops.sdpa.attention_out(q, k, v, causal, scale)
        want, _ = torch.ops.sdpa.attention(q, k, v, None, causal, scale, -1, -1, 0.0, None)
        assert out.dtype == want.dtype and torch.equal(out, want)
        dout = torch.randn(out.shape, generator=g).to(out.dtype)
        got = torch.autograd.grad(out, (q, k, v), dout)
        wanted = torch.autograd.grad(want, (q, k, v), dout)
        for a, b in zip(got, wanted):
            assert torch.equal(a, b)
    with torch.no_grad():
        assert not torch.ops.sdpa.attention_out(q, k, v, causal).requires_grad


def test_wrapper_takes_attention_out_for_the_common_call(out_op_calls):
    torch = _torch()
    from sdpa.torch import scaled_dot_product_attention as ours
    g = torch.Generator().manual_seed(34)
    q, k, v = (torch.randn(s, generator=g) for s in SHAPES[0])
    qg = q.clone().requires_grad_()
    F = torch.nn.functional.scaled_dot_product_attention
    for kw in ({}, {"is_causal": True}, {"scale": 0.25}):
        out_op_calls.clear()
        torch.testing.assert_close(ours(q, k, v, **kw), F(q, k, v, **kw))
        got = ours(qg, k, v, **kw)
        assert len(out_op_calls) == 2 and got.requires_grad
        got.sum().backward()
        want_q = qg.detach().clone().requires_grad_()
        F(want_q, k, v, **kw).sum().backward()
        torch.testing.assert_close(qg.grad, want_q.grad)
        qg.grad = None
    mask = torch.ones(1, 1, 1, 16, dtype=torch.bool)
    for kw in ({"attn_mask": mask}, {"dropout_p": 0.5}, {"precision": "fast"}, {"softcap": 30.0},
               {"sinks": torch.zeros(4)}):
        out_op_calls.clear()
        ours(q, k, v, **kw)
        assert not out_op_calls, kw


@pytest.mark.parametrize("shapes", [((1, 4, 1, 32), (1, 3, 16, 32), (1, 3, 16, 32)),
                                    ((1, 4, 1, 32), (1, 4, 16, 31), (1, 4, 16, 32)),
                                    ((1, 4, 1, 32), (1, 4, 16, 32), (1, 4, 15, 32))])
def test_attention_out_errors_are_attentions(shapes):
    torch = _torch()
    import sdpa.torch  # noqa: F401
    q, k, v = (torch.randn(s) for s in shapes)

    def message(call):
        with pytest.raises(ValueError) as e:
            call()
        return str(e.value).split("\n")[0]

    assert message(lambda: torch.ops.sdpa.attention_out(q, k, v)) == \
        message(lambda: torch.ops.sdpa.attention(q, k, v, None, "none", None, -1, -1, 0.0, None))
    assert message(lambda: torch.ops.sdpa.attention_out(q[..., :0, :], q, q, "sideways")) == \
        message(lambda: torch.ops.sdpa.attention(q[..., :0, :], q, q, None, "sideways", None, -1, -1, 0.0, None))


def test_attention_out_compiles_with_its_gradient(out_op_calls):
    """The common call under torch.compile (fullgraph: no graph break), forward and backward,
    equals the eager call."""
    torch = _torch()
    from sdpa.torch import scaled_dot_product_attention as ours
    g = torch.Generator().manual_seed(35)
    q, k, v = (torch.randn(s, generator=g, requires_grad=True) for s in SHAPES[1][:2] + ((2, 2, 97, 16),))
    fn = lambda a, b, c: ours(a, b, c, is_causal=True, enable_gqa=True)  # noqa: E731
    compiled = torch.compile(fn, fullgraph=True, backend="aot_eager")
    got = compiled(q, k, v)
    assert out_op_calls  # traced through attention_out
    got_grads = torch.autograd.grad(got.sum(), (q, k, v))
    want = fn(q, k, v)
    want_grads = torch.autograd.grad(want.sum(), (q, k, v))
    assert torch.equal(got, want)
    for a, b in zip(got_grads, want_grads):
        assert torch.equal(a, b)
