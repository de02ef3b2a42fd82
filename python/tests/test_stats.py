"""``attention(..., return_stats=True)``: the fused kernel's per-row statistics against the
same call's weights (bit for bit where the header promises it) and against NumPy's entropy of
the float64 reference weights; the kernel paths (tiles, decode, key chunks), every dtype;
edges and errors."""

import ml_dtypes
import numpy as np
import pytest

import sdpa


def _np_entropy(w):
    with np.errstate(divide="ignore", invalid="ignore"):
        return -np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0).sum(-1)


CASES = [
    # (B, Hq, Hkv, Nq, Nk, D, causal, topk)
    (2, 4, 2, 97, 300, 32, False, 8),     # tiles of query rows
    (2, 8, 2, 1, 1025, 64, False, 32),    # decode (few rows per kv head)
    (1, 2, 1, 1, 5000, 32, False, 5),     # decode with key chunks merged
    (1, 1, 1, 40, 4500, 16, "bottom_right", 4),  # tiles with key chunks, causal
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[3]}_k{c[4]}_top{c[7]}")
def test_stats_match_weights_and_reference(case, dtype):
    B, Hq, Hkv, Nq, Nk, D, causal, topk = case
    rng = np.random.default_rng(Nq * 7 + Nk)
    q = (1.5 * rng.standard_normal((B, Hq, Nq, D))).astype(dtype)
    k = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    v = rng.standard_normal((B, Hkv, Nk, D)).astype(dtype)
    out, w, st = sdpa.attention(q, k, v, causal=causal, return_weights=True, return_stats=True, topk=topk)
    out2 = sdpa.attention(q, k, v, causal=causal)
    assert np.array_equal(out, out2)  # asking for statistics changes nothing else
    assert isinstance(st, sdpa.Stats)
    assert st.entropy.shape == (B, Hq, Nq) and st.topk_indices.shape == (B, Hq, Nq, topk)
    assert st.argmax.dtype == np.int64 and st.entropy.dtype == w.dtype
    # Bit for bit the weights output at the chosen keys.
    assert np.array_equal(st.max_weight, np.take_along_axis(w, st.argmax[..., None], -1)[..., 0])
    assert np.array_equal(st.topk_weights, np.take_along_axis(w, st.topk_indices, -1))
    assert np.all(np.diff(st.topk_weights, axis=-1) <= 0)
    assert np.array_equal(st.allowed, (w > 0).sum(-1))  # no weight underflows at these scales
    # Against float64: the reference backend's weights, NumPy's entropy. The kernel's entropy
    # comes from its scores (a score error δ moves H by up to δ · spread): float32's eps times
    # the scores' size, and the 16-bit inputs are the same stored values for both.
    _, w64 = sdpa.attention(q, k, v, causal=causal, return_weights=True, backend="reference")
    H = _np_entropy(w64)
    eps = np.finfo(np.float64 if dtype == np.float64 else np.float32).eps
    assert np.allclose(st.entropy, H, rtol=0, atol=200 * eps * np.sqrt(D) * (1 + H.max()))
    n = st.allowed
    assert np.allclose(st.entropy_normalized, np.where(n > 1, H / np.log(np.maximum(n, 2)), 0), atol=200 * eps * np.sqrt(D) * (1 + H.max()))
    top_ref = -np.sort(-w64, axis=-1)[..., :topk]
    assert np.allclose(np.take_along_axis(w64, st.topk_indices, -1), top_ref, rtol=0, atol=100 * eps * np.sqrt(D))


def test_ties_fully_masked_rows_and_padding():
    q = np.zeros((3, 4), np.float32)
    k = np.ones((6, 4), np.float32)
    v = np.ones((6, 2), np.float32)
    mask = np.ones((3, 6), bool)
    mask[1] = False            # row 1: nothing allowed
    mask[2, 2:] = False        # row 2: two keys, fewer than topk
    st = sdpa.attention(q, k, v, mask, return_stats=True, topk=3)[1]
    assert st.allowed.tolist() == [6, 0, 2]
    assert st.argmax.tolist() == [0, -1, 0]
    assert st.topk_indices.tolist() == [[0, 1, 2], [-1, -1, -1], [0, 1, -1]]
    assert np.allclose(st.entropy, [np.log(6), 0, np.log(2)])
    assert st.entropy_normalized.tolist() == pytest.approx([1, 0, 1])
    assert st.topk_weights[2, 2] == 0 and st.max_weight[1] == 0


def test_reference_and_naive_backends_give_them_too():
    rng = np.random.default_rng(1)
    q, k, v = (rng.standard_normal(s) for s in ((2, 5, 8), (2, 7, 8), (2, 7, 8)))
    got = [sdpa.attention(q, k, v, return_stats=True, topk=2, backend=b)[1] for b in ("flash", "reference", "naive")]
    for st in got[1:]:
        assert np.allclose(st.entropy, got[0].entropy, atol=1e-12)
        assert np.array_equal(st.topk_indices, got[0].topk_indices)


@pytest.mark.parametrize("topk", [-1, 33, 2.5, True])
def test_bad_topk_is_an_error_naming_it(topk):
    with pytest.raises(ValueError, match="topk"):
        sdpa.attention(np.ones((2, 4)), np.ones((3, 4)), np.ones((3, 4)), return_stats=True, topk=topk)


def test_return_scores_stages():
    rng = np.random.default_rng(5)
    q, k, v = rng.standard_normal((2, 4, 3)), rng.standard_normal((2, 6, 3)), rng.standard_normal((2, 6, 3))
    mask = rng.random((4, 6)) < 0.8
    x = q @ k.transpose(0, 2, 1) / np.sqrt(3)
    out, scaled = sdpa.attention(q, k, v, mask, causal=True, softcap=2.0, return_scores="scaled")
    assert np.allclose(scaled, x, atol=1e-14)
    # The cap alone, for every key (ONNX's qk_matmul_output_mode 1); without a softcap, "scaled".
    _, softcapped = sdpa.attention(q, k, v, mask, causal=True, softcap=2.0, return_scores="softcapped")
    assert np.allclose(softcapped, 2.0 * np.tanh(x / 2.0), atol=1e-14)
    _, uncapped = sdpa.attention(q, k, v, mask, causal=True, return_scores="softcapped")
    assert np.array_equal(uncapped, scaled)
    allowed = mask & (np.arange(6)[None, :] <= np.arange(4)[:, None] + 2)  # bottom-right causal
    _, biased = sdpa.attention(q, k, v, mask, causal=True, softcap=2.0, return_scores="biased")
    assert np.array_equal(np.isinf(biased), np.broadcast_to(~allowed, biased.shape))
    assert np.allclose(np.where(allowed, biased, 0), np.where(allowed, x, 0), atol=1e-14)
    _, w, final = sdpa.attention(q, k, v, mask, causal=True, softcap=2.0, return_weights=True, return_scores="final")
    assert np.allclose(np.where(allowed, final, 0), np.where(allowed, 2.0 * np.tanh(x / 2.0), 0), atol=1e-14)
    e = np.exp(final - final.max(-1, keepdims=True))
    assert np.allclose(e / e.sum(-1, keepdims=True), w, atol=1e-14)  # the softmax of the final scores
    with pytest.raises(ValueError, match="return_scores"):
        sdpa.attention(q, k, v, return_scores="raw")


def test_featureless_rows_of_huge_nk_return_at_once():
    """Issue 26 item 2: with Dk = Dv = 0 a row's keys share one score, so its statistics (and
    sdpa.inspect's report) follow from the key range, as lse does; k of shape (2**40, 0) holds no
    element and must not be walked (return_stats ran for hours, inspect counted 2**40 keys)."""
    import signal

    def too_slow(signum, frame):
        raise TimeoutError("work followed Nk = 2**40")

    before = signal.signal(signal.SIGALRM, too_slow)
    signal.alarm(60)
    try:
        q, k = np.zeros((3, 0), np.float32), np.empty((2**40, 0), np.float32)
        out, stats = sdpa.attention(q, k, k, causal=True, return_stats=True, topk=4)
        n = 2**40 - np.arange(2, -1, -1)  # bottom-right causal: rows see Nk - 2, Nk - 1, Nk keys
        assert np.array_equal(stats.allowed, n)
        assert np.allclose(stats.max_weight, 1.0 / n, rtol=1e-6)
        assert np.allclose(stats.entropy, np.log(n), rtol=1e-6)
        assert np.array_equal(stats.topk_indices, np.tile(np.arange(4), (3, 1)))
        report = sdpa.inspect(q, k, k, causal=True)
        assert "1099511627775" in report.html  # the keys axis names the last key
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)
