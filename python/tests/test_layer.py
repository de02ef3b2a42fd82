"""sdpa.MultiHeadAttention (NumPy): the float64 forward against a NumPy oracle written here from
the docstring's formulas, its gradients against central differences of the oracle, the fast
float32, bfloat16 and float16 layers against the reference layer (tolerance from the naive
layer's error), precision passed through, step() against the causal forward, dropout's keep
decisions shared by forward and backward, errors."""

import ml_dtypes
import numpy as np
import pytest

import sdpa


def rope(x, pos0, base=10000.0):
    """x (B, N, H, D) rotated: d pairs with d + D/2, row i at position pos0 + i."""
    D = x.shape[-1]
    half = D // 2
    theta = (pos0 + np.arange(x.shape[1]))[:, None] * base ** (-2.0 * np.arange(half) / D)
    c, s = np.cos(theta)[None, :, None, :], np.sin(theta)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return np.concatenate([x1 * c - x2 * s, x2 * c + x1 * s], axis=-1)


def oracle(layer, x_q, x_k=None, x_v=None, mask=None, causal=False, pos_q=0, pos_k=0):
    """y in float64 by the formulas: projections, RoPE, softmax per head, output projection."""
    x_k = x_q if x_k is None else x_k
    x_v = x_k if x_v is None else x_v
    p = {n: (None if a is None else np.asarray(a, np.float64)) for n, a in layer.parameters().items()}
    B, Nq, _ = x_q.shape
    Nk = x_k.shape[1]
    H, Hkv, Dk, Dv = layer.num_heads, layer.num_kv_heads, layer.head_dim, layer.head_dim_v

    def proj(x, w, b):
        return x @ p[w] + (p[b] if b in p else 0.0)

    q = proj(x_q, "w_q", "b_q").reshape(B, Nq, H, Dk)
    k = proj(x_k, "w_k", "b_k").reshape(B, Nk, Hkv, Dk)
    v = proj(x_v, "w_v", "b_v").reshape(B, Nk, Hkv, Dv)
    if layer.rope:
        q, k = rope(q, pos_q), rope(k, pos_k)
    k = np.repeat(k, H // Hkv, axis=2)
    v = np.repeat(v, H // Hkv, axis=2)
    s = np.einsum("bihd,bjhd->bhij", q, k) / np.sqrt(Dk)
    allowed = np.ones((Nq, Nk), bool)
    if causal:
        allowed = np.arange(Nk)[None, :] <= np.arange(Nq)[:, None] + (Nk - Nq)
    s = np.where(allowed, s, -np.inf)
    if mask is not None:
        s = np.where(mask, s, -np.inf) if mask.dtype == bool else s + mask
    m = s.max(-1, keepdims=True)
    e = np.where(np.isfinite(m), np.exp(s - np.where(np.isfinite(m), m, 0)), 0)
    den = e.sum(-1, keepdims=True)
    w = np.divide(e, den, out=np.zeros_like(e), where=den > 0)
    heads = np.einsum("bhij,bjhd->bihd", w, v).reshape(B, Nq, H * Dv)
    return heads @ p["w_o"] + (p["b_o"] if "b_o" in p else 0.0)


CASES = {
    "self": dict(layer=dict(d_model=16, num_heads=4), B=2, Nq=5),
    "causal_rope_gqa": dict(layer=dict(d_model=32, num_heads=4, num_kv_heads=2, rope=True), B=2, Nq=9, causal=True,
                            pos=(3, 3)),
    "cross_dims_mask": dict(layer=dict(d_model=24, num_heads=3, head_dim=8, head_dim_v=6, kdim=12, vdim=10), B=2,
                            Nq=7, Nk=13, cross=True, mask=True),
    "mqa_nobias": dict(layer=dict(d_model=20, num_heads=5, num_kv_heads=1, bias=False), B=1, Nq=11),
}


def make(case, dtype=np.float64, seed=0):
    c = CASES[case]
    rng = np.random.default_rng(seed)
    layer = sdpa.MultiHeadAttention(**c["layer"], dtype=dtype, seed=seed)
    for name, a in layer.parameters().items():  # biases too, so that they matter
        setattr(layer, name, rng.normal(0, 0.3, a.shape).astype(dtype) if name[0] == "b" else a)
    B, Nq = c["B"], c["Nq"]
    Nk = c.get("Nk", Nq)
    x_q = rng.normal(size=(B, Nq, layer.d_model)).astype(dtype)
    kw = dict(causal=c.get("causal", False))
    if c.get("cross"):
        kw["x_k"] = rng.normal(size=(B, Nk, layer.kdim)).astype(dtype)
        kw["x_v"] = rng.normal(size=(B, Nk, layer.vdim)).astype(dtype)
    if c.get("mask"):
        mask = rng.random((B, 1, Nq, Nk)) < 0.7
        mask[0, 0, 2] = False  # a row with no key: zeros, no NaN
        kw["mask"] = mask
    if "pos" in c:
        kw["position_q"], kw["position_k"] = c["pos"]
    return layer, x_q, kw


def call_oracle(layer, x_q, kw):
    return oracle(layer, x_q, kw.get("x_k"), kw.get("x_v"), kw.get("mask"), kw.get("causal", False),
                  kw.get("position_q", 0), kw.get("position_k", 0))


@pytest.mark.parametrize("case", CASES)
def test_reference_forward_matches_oracle(case):
    layer, x_q, kw = make(case)
    y = layer(x_q, **kw, backend="reference")
    want = call_oracle(layer, x_q, kw)
    # Two float64 evaluations of the same sums (at most ~100 terms each) in different orders.
    np.testing.assert_allclose(y, want, rtol=0, atol=1e3 * np.finfo(np.float64).eps * (1 + np.abs(want).max()))
    assert np.isfinite(y).all()


@pytest.mark.parametrize("case", CASES)
def test_gradients_match_finite_differences_of_the_oracle(case):
    layer, x_q, kw = make(case)
    rng = np.random.default_rng(1)
    y = layer(x_q, **kw)
    dy = rng.normal(size=y.shape)
    g = layer.backward(dy)
    targets = [("x_q", x_q, g.x_q)]
    if "x_k" in kw:
        targets += [("x_k", kw["x_k"], g.x_k), ("x_v", kw["x_v"], g.x_v)]
    targets += [(n, a, getattr(g, n)) for n, a in layer.parameters().items()]
    h = 1e-6
    for name, a, grad in targets:
        for _ in range(3):
            i = tuple(rng.integers(0, n) for n in a.shape)
            x = a[i]
            a[i] = x + h
            up = np.sum(call_oracle(layer, x_q, kw) * dy)
            a[i] = x - h
            down = np.sum(call_oracle(layer, x_q, kw) * dy)
            a[i] = x
            # Central differences: truncation h² · |f'''| and rounding eps · |loss| / h, both
            # below 1e-8 here; a wrong gradient is off by O(1).
            assert abs(grad[i] - (up - down) / (2 * h)) < 1e-6 * (1 + abs(up)), (name, i)


LAYER_DTYPES = [(np.float32, "exact"), (ml_dtypes.bfloat16, "exact"), (ml_dtypes.bfloat16, "fast"),
                (np.float16, "exact"), (np.float16, "fast")]


@pytest.mark.parametrize("dtype, precision", LAYER_DTYPES, ids=[f"{np.dtype(d).name}-{p}" for d, p in LAYER_DTYPES])
@pytest.mark.parametrize("case", CASES)
def test_fast_layer_matches_reference(case, dtype, precision):
    layer, x_q, kw = make(case, dtype)
    dy = np.random.default_rng(2).normal(size=(x_q.shape[0], x_q.shape[1], layer.d_model)).astype(dtype)
    results = {}
    for backend in ("auto", "reference", "naive"):
        y = layer(x_q, **kw, backend=backend, precision=precision)
        results[backend] = [y, *[a for a in layer.backward(dy) if a is not None]]
    for fast, ref, naive in zip(results["auto"], results["reference"], results["naive"]):
        assert fast.dtype == ref.dtype == np.dtype(dtype)  # outputs and gradients in the layer's dtype
        fast, ref, naive = (a.astype(np.float64) for a in (fast, ref, naive))
        # tests/mha_test.cc's rule: 4 · (the naive layer's error) + one rounding. The naive 16-bit
        # layer rounds the same intermediates as the fast one (sdpa/mha.h), in the same precision.
        tol = 4 * np.abs(naive - ref).max() + ml_dtypes.finfo(dtype).eps * np.abs(ref).max()
        np.testing.assert_allclose(fast, ref, rtol=0, atol=tol)


def test_precision_reaches_the_kernel_in_forward_backward_and_step():
    """A bfloat16 layer: precision="fast" changes y and the gradients; the sdpa.precision block
    gives a call's precision=None its mode; backward uses its forward's precision, whatever block
    it runs in; step takes it too. The parameters, y and the gradients are bfloat16, the weights
    float32."""
    bf16 = ml_dtypes.bfloat16
    layer, x, kw = make("causal_rope_gqa", bf16)
    assert all(a.dtype == bf16 for a in layer.parameters().values())
    dy = np.random.default_rng(4).normal(size=x.shape).astype(bf16)
    y_exact, w = layer(x, **kw, need_weights=True)
    assert y_exact.dtype == bf16 and w.dtype == np.float32
    g_exact = layer.backward(dy)
    y_fast = layer(x, **kw, precision="fast")
    g_fast = layer.backward(dy)
    assert not np.array_equal(y_fast, y_exact)
    assert not np.array_equal(g_fast.x_q, g_exact.x_q)
    with sdpa.precision("fast"):
        y_block = layer(x, **kw)
    g_block = layer.backward(dy)  # after the block: the forward's "fast"
    assert np.array_equal(y_block, y_fast)
    for a, b in zip(g_block, g_fast):
        assert (a is None and b is None) or np.array_equal(a, b)
    with sdpa.precision("fast"):
        assert np.array_equal(layer(x, **kw, precision="exact"), y_exact)  # a call's own wins
    steps = {}
    for precision in ("exact", "fast"):
        cache = layer.new_cache(num_pages=8, page_size=4)
        seqs = [cache.new_sequence() for _ in range(x.shape[0])]
        steps[precision] = layer.step(x, cache, seqs, precision=precision)
        assert steps[precision].dtype == bf16
    assert not np.array_equal(steps["fast"], steps["exact"])


@pytest.mark.parametrize("dtype", [np.float32, ml_dtypes.bfloat16, np.float16])
def test_step_matches_causal_forward(dtype):
    layer, x, _ = make("causal_rope_gqa", dtype)
    ref = layer(x, causal=True, backend="reference").astype(np.float64)
    naive = layer(x, causal=True, backend="naive").astype(np.float64)
    cache = layer.new_cache(num_pages=8, page_size=4)
    seqs = [cache.new_sequence() for _ in range(x.shape[0])]
    got = np.concatenate([layer.step(x[:, a:b], cache, seqs) for a, b in ((0, 1), (1, 5), (5, 6), (6, 9))], axis=1)
    assert [cache.length(s) for s in seqs] == [9, 9]
    assert got.dtype == np.dtype(dtype)
    tol = 4 * np.abs(naive - ref).max() + ml_dtypes.finfo(dtype).eps * np.abs(ref).max()
    np.testing.assert_allclose(got.astype(np.float64), ref, rtol=0, atol=tol)


def test_dropout_backward_uses_the_forwards_keep_decisions():
    """With a fixed seed the layer is a deterministic function; its gradient must be that
    function's (finite differences), which it is only if backward drops what forward dropped."""
    layer, x, kw = make("self")
    rng = np.random.default_rng(3)
    y = layer(x, dropout_p=0.3, seed=99)
    dy = rng.normal(size=y.shape)
    g = layer.backward(dy)
    assert not np.allclose(y, layer(x)), "dropout changed nothing"
    h = 1e-6
    for _ in range(6):
        i = tuple(rng.integers(0, n) for n in layer.w_q.shape)
        w = layer.w_q[i]
        layer.w_q[i] = w + h
        up = np.sum(layer(x, dropout_p=0.3, seed=99) * dy)
        layer.w_q[i] = w - h
        down = np.sum(layer(x, dropout_p=0.3, seed=99) * dy)
        layer.w_q[i] = w
        assert abs(g.w_q[i] - (up - down) / (2 * h)) < 1e-6 * (1 + abs(up))


def test_weights_and_a_fresh_dropout_seed_per_call():
    layer, x, _ = make("self", np.float32)
    y, w = layer(x, need_weights=True)
    assert w.shape == (2, 4, 5, 5)
    np.testing.assert_allclose(w.sum(-1), 1, atol=1e-6)
    a, b = layer(x, dropout_p=0.5), layer(x, dropout_p=0.5)
    assert not np.array_equal(a, b)


def test_initialisation_is_torchs():
    """Xavier-uniform over torch's (3E × E) in_proj_weight when q, k, v are all E × E, else per
    matrix; the output projection ±1/sqrt(E); biases 0."""
    layer = sdpa.MultiHeadAttention(64, 4, seed=1)
    for w in (layer.w_q, layer.w_k, layer.w_v):
        assert 0.9 * np.sqrt(6 / 256) < np.abs(w).max() <= np.sqrt(6 / 256)
    assert np.abs(layer.w_o).max() <= 1 / 8 and not layer.b_q.any()
    gqa = sdpa.MultiHeadAttention(64, 4, num_kv_heads=2, seed=1)
    assert 0.9 * np.sqrt(6 / 96) < np.abs(gqa.w_k).max() <= np.sqrt(6 / 96)  # (64, 32): its own fans


def test_errors_name_the_argument():
    layer, x, _ = make("self", np.float32)
    layer.w_q = np.zeros((3, 3), np.float32)
    with pytest.raises(ValueError, match=r"w_q has shape \(3, 3\).*\(16, 16\)"):
        layer(x)
    layer, x, _ = make("self", np.float32)
    with pytest.raises(RuntimeError, match="backward needs a forward"):
        layer.backward(np.zeros_like(x))
    with pytest.raises(ValueError, match=r"x_q has shape \(2, 5, 7\).*d_model = 16"):
        layer(np.zeros((2, 5, 7), np.float32))
    with pytest.raises(ValueError, match="x_v needs x_k"):
        layer(x, x_v=x)
    with pytest.raises(ValueError, match="num_kv_heads 3 must divide num_heads 4"):
        sdpa.MultiHeadAttention(16, 4, num_kv_heads=3)
    with pytest.raises(ValueError, match="rope needs an even head_dim"):
        sdpa.MultiHeadAttention(15, 5, rope=True)
    with pytest.raises(TypeError, match="float32, float64, float16 or ml_dtypes.bfloat16"):
        sdpa.MultiHeadAttention(16, 4, dtype=np.int32)
    with pytest.raises(ValueError, match="seed must be given|dropout_p must be in"):
        layer(x, dropout_p=1.5)
    y = layer(x)
    with pytest.raises(ValueError, match=r"dy has shape \(2, 5, 3\)"):
        layer.backward(np.zeros((2, 5, 3), np.float32))
    assert y.shape == x.shape


# ---------------------------------------------------------------- issue 26: argument types


@pytest.mark.filterwarnings("error")  # numpy's ComplexWarning, the sign of a silent cast, fails the test
@pytest.mark.parametrize("name", ["w_q", "w_o", "b_k", "dy", "x_q", "x_k"])
@pytest.mark.parametrize("bad", [lambda a: a + 1j, lambda a: a.astype(str), lambda a: a.astype(object),
                                 lambda a: a.astype(ml_dtypes.float8_e4m3fn)], ids=["complex", "str", "object",
                                                                                     "float8"])
def test_weights_and_inputs_that_are_not_real_are_refused(name, bad):
    # A complex w_q or dy used to be cast to its real part.
    layer, x, _ = make("self", np.float32)
    layer(x)
    before = {n: a.copy() for n, a in layer.parameters().items()}
    with pytest.raises(TypeError, match=rf"^{name} has dtype"):
        if name == "dy":
            layer.backward(bad(np.ones_like(x)))
        elif name.startswith("x_"):
            layer(**{"x_q": x, "x_k": x, name: bad(x)})
        else:
            setattr(layer, name, bad(getattr(layer, name)))
            layer(x)
    for n, a in before.items():
        if n != name:
            np.testing.assert_array_equal(getattr(layer, n), a)


@pytest.mark.parametrize("seqs", [np.array([1.7]), [0.9], np.array([1.0]), [True], 0.0], ids=repr)
def test_step_takes_integer_sequence_ids_only(seqs):
    # np.array([1.7]) used to append to sequence 1.
    layer, x, _ = make("causal_rope_gqa", np.float32)
    cache = layer.new_cache(num_pages=8, page_size=4)
    for _ in range(2):
        cache.new_sequence()
    with pytest.raises(TypeError, match=r"^seqs has dtype (float64|bool), but must hold integers"):
        layer.step(x[:1, :1], cache, seqs)
    assert [cache.length(s) for s in (0, 1)] == [0, 0]
    layer.step(x[:1, :1], cache, np.array([1], np.int32))
    assert [cache.length(s) for s in (0, 1)] == [0, 1]


def test_step_names_its_argument_x():
    # step's argument is x; its errors used to call it x_q (the forward's name).
    layer, x, _ = make("causal_rope_gqa", np.float32)
    cache = layer.new_cache(num_pages=8, page_size=4)
    s = cache.new_sequence()
    for bad, match in ((np.zeros((1, 1, 7), np.float32), r"^multi_head_attention_step: x has shape \(1, 1, 7\)"),
                       (np.zeros((1, 7), np.float32), r"^x has shape \(1, 7\)"),
                       (np.zeros((1, 1, 32), np.complex64), r"^x has dtype complex64")):
        with pytest.raises((TypeError, ValueError), match=match) as info:
            layer.step(bad, cache, [s])
        assert "x_q" not in str(info.value)
    assert cache.length(s) == 0


@pytest.mark.parametrize("kw,name,error", [
    (dict(d_model=2**64), "d_model", ValueError), (dict(d_model=8.0), "d_model", TypeError),
    (dict(num_heads=-2**64), "num_heads", ValueError), (dict(num_kv_heads=2**64), "num_kv_heads", ValueError),
    (dict(head_dim="4"), "head_dim", TypeError), (dict(kdim=True), "kdim", TypeError),
    (dict(rope_base="10000"), "rope_base", TypeError), (dict(rope_base=1j), "rope_base", TypeError),
    (dict(dtype=None), "dtype", TypeError), (dict(dtype="nonsense"), "dtype", TypeError),
    (dict(seed=2.5), "seed", TypeError)], ids=repr)
def test_constructor_arguments_are_named_in_errors(kw, name, error):
    # d_model=2**64 gave nanobind's "incompatible function arguments" dump.
    with pytest.raises(error, match=rf"^{name}\b") as info:
        sdpa.MultiHeadAttention(**{"d_model": 8, "num_heads": 2, **kw})
    assert "incompatible function arguments" not in str(info.value)


@pytest.mark.parametrize("name", ["position_q", "position_k"])
@pytest.mark.parametrize("value,error", [(2.5, TypeError), (1.0, TypeError), (2**64, ValueError),
                                         ("1", TypeError)], ids=repr)
def test_positions_are_integers(name, value, error):
    # position_q=2.5 used to be truncated to 2, 2**64 gave nanobind's dump.
    layer, x, _ = make("causal_rope_gqa", np.float32)
    with pytest.raises(error, match=rf"^{name} must be an integer"):
        layer(x, **{name: value})
