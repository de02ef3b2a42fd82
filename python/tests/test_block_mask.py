"""Block-sparse attention from Python: ``block_mask`` / ``block_size`` against the equivalent
element mask (bit for bit, forward and backward, every dtype), the docstring's picture, the
builders in sdpa.blocks against brute force, errors, and sdpa.torch with autograd."""

import re

import ml_dtypes
import numpy as np
import pytest

import sdpa


def element_mask(bm, block_q, block_k, nq, nk):
    """The element mask a block mask means: block (i // bq, j // bk), over its leading dims."""
    return np.repeat(np.repeat(bm, block_q, axis=-2), block_k, axis=-1)[..., :nq, :nk]


def _inputs(rng, shape_q, shape_kv, dtype=np.float32):
    q = rng.standard_normal(shape_q).astype(dtype)
    k = rng.standard_normal(shape_kv).astype(dtype)
    v = rng.standard_normal(shape_kv).astype(dtype)
    return q, k, v


CASES = [
    # (B, Hq, Hkv, Nq, Nk, D, block_q, block_k, block-mask leading dims, causal)
    (1, 2, 2, 200, 300, 32, 128, 128, (), False),
    (2, 4, 2, 97, 260, 16, 16, 40, (4,), "bottom_right"),
    (2, 2, 1, 1, 513, 64, 1, 64, (2, 1), False),
    (1, 3, 3, 33, 17, 8, 1, 1, (3,), "top_left"),
]


@pytest.mark.parametrize("dtype", [np.float32, np.float64, ml_dtypes.bfloat16, np.float16])
@pytest.mark.parametrize("case", CASES, ids=lambda c: f"q{c[3]}_k{c[4]}_b{c[6]}x{c[7]}")
def test_equals_the_element_mask_bitwise(case, dtype):
    B, Hq, Hkv, Nq, Nk, D, bq, bk, lead, causal = case
    rng = np.random.default_rng(Nq * 1000 + Nk)
    q, k, v = _inputs(rng, (B, Hq, Nq, D), (B, Hkv, Nk, D), dtype)
    bm = rng.random(lead + (-(-Nq // bq), -(-Nk // bk))) < 0.5
    mask = element_mask(bm, bq, bk, Nq, Nk)
    for backend in ("auto", "reference"):
        got = sdpa.attention(q, k, v, causal=causal, block_mask=bm, block_size=(bq, bk), return_weights=True,
                             return_lse=True, backend=backend)
        want = sdpa.attention(q, k, v, mask, causal=causal, return_weights=True, return_lse=True, backend=backend)
        for g, w in zip(got, want):
            np.testing.assert_array_equal(g.view(np.uint8), w.view(np.uint8))
    if dtype in (np.float32, np.float64):
        out, lse = got[0], got[2]
        dout = rng.standard_normal(out.shape).astype(dtype)
        g_block = sdpa.attention_backward(dout, q, k, v, out, lse, causal=causal, block_mask=bm, block_size=(bq, bk))
        g_elem = sdpa.attention_backward(dout, q, k, v, out, lse, mask, causal=causal)
        for g, w in zip(g_block, g_elem):
            np.testing.assert_array_equal(g, w)


def test_the_docstring_picture():
    doc = sdpa.attention.__doc__
    at = doc.index("block_mask = [[True, False],")
    rows = re.findall(r"q(\d)((?:\s+[x.]){6})", doc[at:at + 600])
    drawn = np.array([[c == "x" for c in cells.split()] for _, cells in rows])
    assert drawn.shape == (4, 6)
    rng = np.random.default_rng(0)
    q, k, v = _inputs(rng, (4, 3), (6, 3), np.float64)
    _, w = sdpa.attention(q, k, v, block_mask=[[True, False], [True, True]], block_size=(2, 3), return_weights=True)
    np.testing.assert_array_equal(w > 0, drawn)


def test_bigbird_has_its_window_global_and_random_blocks():
    bm = sdpa.block_mask_bigbird(1000, 1000, block_size=100, window=3, global_blocks=1, random_blocks=2, seed=3)
    assert bm.shape == (10, 10) and bm.dtype == np.bool_
    for i in range(10):
        for j in range(10):
            if abs(i - j) <= 1 or i == 0 or j == 0:
                assert bm[i, j]
        extra = bm[i].sum() - sum(abs(i - j) <= 1 or i == 0 or j == 0 for j in range(10))
        assert extra == (2 if i else 0)
    np.testing.assert_array_equal(bm, sdpa.block_mask_bigbird(1000, 1000, block_size=100, window=3,
                                                             global_blocks=1, random_blocks=2, seed=3))
    with pytest.raises(ValueError, match="window must be odd"):
        sdpa.block_mask_bigbird(10, 10, block_size=2, window=2)


def test_dilated_blocks():
    bm = sdpa.block_mask_dilated(700, 500, block_size=(100, 100), dilation=3, window=4)
    want = np.array([[(i - j) % 3 == 0 and abs(i - j) <= 4 for j in range(5)] for i in range(7)])
    np.testing.assert_array_equal(bm, want)


def test_from_mask_and_documents_against_brute_force():
    rng = np.random.default_rng(1)
    mask = rng.random((2, 37, 53)) < 0.05
    bm = sdpa.block_mask_from_mask(mask, (8, 16))
    assert bm.shape == (2, 5, 4)
    for h in range(2):
        for i in range(5):
            for j in range(4):
                assert bm[h, i, j] == mask[h, 8 * i:8 * i + 8, 16 * j:16 * j + 16].any()
    fm = np.where(mask, 0.0, -np.inf)
    np.testing.assert_array_equal(sdpa.block_mask_from_mask(fm, (8, 16)), bm)
    docs = np.repeat([0, 1, 2, 3], [50, 7, 100, 43])
    np.testing.assert_array_equal(sdpa.block_mask_documents(docs, block_size=32),
                                  sdpa.block_mask_from_mask(sdpa.document_mask(docs), 32))


def test_documents_are_exact_with_the_element_mask_and_skip_with_the_blocks():
    rng = np.random.default_rng(2)
    docs = np.repeat([0, 1, 2], [300, 40, 172])
    q, k, v = _inputs(rng, (2, 512, 32), (2, 512, 32))
    mask = sdpa.document_mask(docs)
    got = sdpa.attention(q, k, v, mask, causal=True, block_mask=sdpa.block_mask_documents(docs, block_size=128))
    want = np.empty_like(q)
    for d in range(3):  # each document alone
        rows = np.flatnonzero(docs == d)
        want[:, rows] = sdpa.attention(q[:, rows], k[:, rows], v[:, rows], causal=True)
    np.testing.assert_allclose(got, want, rtol=2e-6, atol=2e-6)


def test_errors_name_the_argument():
    rng = np.random.default_rng(3)
    q, k, v = _inputs(rng, (2, 100, 8), (2, 300, 8))
    with pytest.raises(TypeError, match="block_mask has dtype float64"):
        sdpa.attention(q, k, v, block_mask=np.ones((1, 3)))
    with pytest.raises(ValueError, match=r"block_mask has shape \(1, 2\).*ceil\(300 / 128\)"):
        sdpa.attention(q, k, v, block_mask=np.ones((1, 2), bool))
    with pytest.raises(ValueError, match="block_q=0"):
        sdpa.attention(q, k, v, block_mask=np.ones((1, 3), bool), block_size=(0, 128))
    with pytest.raises(TypeError, match="block_size"):
        sdpa.attention(q, k, v, block_mask=np.ones((1, 3), bool), block_size=1.5)
    # Packed sequences: the longest sequence's blocks.
    with pytest.raises(ValueError, match=r"block_mask has shape \(2, 1\).*longest sequence's Nq / block_q\) = ceil\(4 / 4\)"):
        sdpa.attention_varlen(q[0, :6, None], k[0, :6, None], v[0, :6, None], [0, 4, 6], [0, 2, 6],
                              block_mask=np.ones((2, 1), bool), block_size=4)


def _packed(rng, nq, nk, hq, hkv, d):
    q = rng.standard_normal((sum(nq), hq, d)).astype(np.float32)
    k = rng.standard_normal((sum(nk), hkv, d)).astype(np.float32)
    v = rng.standard_normal((sum(nk), hkv, d)).astype(np.float32)
    return q, k, v, np.cumsum([0] + nq), np.cumsum([0] + nk)


def test_varlen_sequences_read_their_corner_forward_and_backward():
    rng = np.random.default_rng(11)
    nq, nk, bq, bk = [37, 0, 70, 5], [90, 12, 64, 0], 16, 32
    q, k, v, cu_q, cu_k = _packed(rng, nq, nk, 4, 2, 8)
    bm = rng.random((len(nq), 1, -(-max(nq) // bq), -(-max(nk) // bk))) < 0.6
    out, lse = sdpa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, block_mask=bm, block_size=(bq, bk),
                                     return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    dq, dk, dv = sdpa.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, block_mask=bm,
                                                block_size=(bq, bk))
    for b in range(len(nq)):
        rq, rk = slice(cu_q[b], cu_q[b + 1]), slice(cu_k[b], cu_k[b + 1])
        qb, kb, vb = (np.ascontiguousarray(x.transpose(1, 0, 2)) for x in (q[rq], k[rk], v[rk]))
        corner = bm[b, :, :-(-nq[b] // bq), :-(-nk[b] // bk)]
        ob, lb = sdpa.attention(qb, kb, vb, causal=True, block_mask=corner, block_size=(bq, bk), return_lse=True)
        np.testing.assert_array_equal(out[rq], ob.transpose(1, 0, 2))
        np.testing.assert_array_equal(lse[:, rq], lb)
        g = sdpa.attention_backward(np.ascontiguousarray(dout[rq].transpose(1, 0, 2)), qb, kb, vb, ob, lb,
                                    causal=True, block_mask=corner, block_size=(bq, bk))
        for got, want in zip((dq[rq], dk[rk], dv[rk]), g):
            np.testing.assert_array_equal(got, want.transpose(1, 0, 2))


def test_the_varlen_docstring_picture():
    doc = sdpa.attention_varlen.__doc__
    assert "block_size=2" in doc and "block_mask = [[True, False], [False, True]]" in doc
    rng = np.random.default_rng(2)
    q, k, v, cu_q, cu_k = _packed(rng, [2, 3], [3, 4], 1, 1, 4)
    lines = re.findall(r"seq (\d) \((\d) queries, (\d) keys\) reads .*?:\s+(.*)", doc)
    assert len(lines) == 2
    out = sdpa.attention_varlen(q, k, v, cu_q, cu_k, block_mask=[[True, False], [False, True]], block_size=2)
    for b, n_q, n_k, seen in lines:
        b, n_q, n_k = int(b), int(n_q), int(n_k)
        # The rows and keys the picture names, as an element mask for the sequence's own call.
        mask = np.zeros((n_q, n_k), bool)
        for rows, keys in re.findall(r"rows? ([\d ]+?) (?:see )?keys ([\d ]+)", seen):
            mask[np.ix_([int(r) for r in rows.split()], [int(c) for c in keys.split()])] = True
        qb, kb, vb = (x[c[b]:c[b + 1], 0] for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
        np.testing.assert_array_equal(out[cu_q[b]:cu_q[b + 1], 0], sdpa.attention(qb, kb, vb, mask))


def test_packed_paged_sequences_read_their_corner():
    rng = np.random.default_rng(13)
    page, pages, max_pages, bq, bk = 16, 6, 3, 8, 16
    k_pages = rng.standard_normal((pages, page, 1, 8)).astype(np.float32)
    v_pages = rng.standard_normal((pages, page, 1, 8)).astype(np.float32)
    table = np.array([[0, 1, 2], [3, 4, 5], [5, 0, 1]])
    lengths, nq = np.array([40, 48, 9]), [10, 1, 20]
    cu = np.cumsum([0] + nq)
    q = rng.standard_normal((cu[-1], 2, 8)).astype(np.float32)
    bm = rng.random((3, 2, -(-max(nq) // bq), max_pages * page // bk)) < 0.6
    out = sdpa.attention_paged(q, k_pages, v_pages, table, lengths, cu_seqlens_q=cu, causal=True, block_mask=bm,
                               block_size=(bq, bk))
    for b in range(3):
        qb = np.ascontiguousarray(q[cu[b]:cu[b + 1]].transpose(1, 0, 2))[None]
        want = sdpa.attention_paged(qb, k_pages, v_pages, table[b:b + 1], lengths[b:b + 1], causal=True,
                                    block_mask=bm[b:b + 1, :, :-(-nq[b] // bq)], block_size=(bq, bk))
        np.testing.assert_array_equal(out[cu[b]:cu[b + 1]], want[0].transpose(1, 0, 2))


def test_torch_block_mask_with_autograd():
    torch = pytest.importorskip("torch")
    import sdpa.torch as st

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 4, 150, 16, generator=g, requires_grad=True)
    k = torch.randn(2, 4, 260, 16, generator=g, requires_grad=True)
    v = torch.randn(2, 4, 260, 16, generator=g, requires_grad=True)
    bm = torch.rand(4, 3, 5, generator=g) < 0.6
    mask = torch.from_numpy(element_mask(bm.numpy(), 64, 64, 150, 260))
    out = st.scaled_dot_product_attention(q, k, v, block_mask=bm, block_size=64)
    grads = torch.autograd.grad(out.square().sum(), (q, k, v))
    out2 = st.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    grads2 = torch.autograd.grad(out2.square().sum(), (q, k, v))
    assert torch.equal(out, out2)
    for a, b in zip(grads, grads2):
        assert torch.equal(a, b)
    ref = torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)
    with pytest.raises(TypeError, match="block_mask must be a bool"):
        st.scaled_dot_product_attention(q, k, v, block_mask=bm.float())


def test_torch_packed_block_masks_with_autograd():
    torch = pytest.importorskip("torch")
    import sdpa.torch as st

    rng = np.random.default_rng(19)
    nq, nk, bq, bk = [30, 3, 50], [40, 70, 9], 16, 16
    q, k, v, cu_q, cu_k = _packed(rng, nq, nk, 2, 1, 8)
    bm = rng.random((3, 1, -(-max(nq) // bq), -(-max(nk) // bk))) < 0.6
    out, lse = sdpa.attention_varlen(q, k, v, cu_q, cu_k, causal=True, block_mask=bm, block_size=bq, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    want = sdpa.attention_varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, causal=True, block_mask=bm,
                                          block_size=bq)
    tq, tk, tv = (torch.from_numpy(x).requires_grad_() for x in (q, k, v))
    got = st.attention_varlen(tq, tk, tv, torch.from_numpy(cu_q), torch.from_numpy(cu_k), causal=True,
                              block_mask=torch.from_numpy(bm), block_size=bq)
    np.testing.assert_array_equal(got.detach().numpy(), out)
    for g, w in zip(torch.autograd.grad(got, (tq, tk, tv), torch.from_numpy(dout)), want):
        np.testing.assert_array_equal(g.numpy(), w)
    # Packed paged queries: the same sequences from a pool of one-row pages.
    table = np.full((3, max(nk)), -1)
    for b in range(3):
        table[b, :nk[b]] = np.arange(cu_k[b], cu_k[b + 1])
    bm_paged = rng.random((1, 2, -(-max(nq) // bq), -(-max(nk) // bk))) < 0.6
    paged = st.attention_paged(torch.from_numpy(q), torch.from_numpy(k[:, None]), torch.from_numpy(v[:, None]),
                               torch.from_numpy(table), torch.tensor(nk), cu_seqlens_q=torch.from_numpy(cu_q),
                               causal=True, block_mask=torch.from_numpy(bm_paged), block_size=bq)
    np.testing.assert_array_equal(paged.numpy(), sdpa.attention_paged(q, k[:, None], v[:, None], table, nk,
                                                                      cu_seqlens_q=cu_q, causal=True,
                                                                      block_mask=bm_paged, block_size=bq))
