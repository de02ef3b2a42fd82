"""sdpa.attention_paged and sdpa.KVCache: the gathered dense problem's results, the docstring's
picture, token-by-token generation against full recomputation, dtypes, and the errors."""
import ml_dtypes
import numpy as np
import pytest

import sdpa

BF16 = np.dtype(ml_dtypes.bfloat16)


def tolerance(dtype):
    return {np.float64: 1e-12, np.float32: 2e-5}.get(np.dtype(dtype).type, 2e-2)


def paged(rng, lengths, page_size, hkv, dk, dv, dtype):
    """A pool holding the sequences' rows in shuffled pages (the others NaN), its block table,
    and the dense (B, Hkv, Nk, D) keys and values the pages hold."""
    used = [-(-n // page_size) for n in lengths]
    num_pages = sum(used) + 2
    max_pages = max(used + [1])
    order = rng.permutation(num_pages)
    k_pages = np.full((num_pages, page_size, hkv, dk), np.nan, dtype)
    v_pages = np.full((num_pages, page_size, hkv, dv), np.nan, dtype)
    table = np.full((len(lengths), max_pages), -1, np.int32)
    nk = max_pages * page_size
    k = rng.standard_normal((len(lengths), hkv, nk, dk)).astype(dtype)
    v = rng.standard_normal((len(lengths), hkv, nk, dv)).astype(dtype)
    at = 0
    for b, n in enumerate(lengths):
        for p in range(used[b]):
            page = order[at]
            at += 1
            table[b, p] = page
            rows = range(p * page_size, min(n, (p + 1) * page_size))
            for r, j in enumerate(rows):
                k_pages[page, r] = k[b, :, j]
                v_pages[page, r] = v[b, :, j]
    return k_pages, v_pages, table, k, v


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
@pytest.mark.parametrize("page_size,nq,causal", [(16, 1, True), (48, 3, True), (128, 20, "top_left"), (16, 2, False)])
def test_paged_equals_attention_on_the_gathered_keys(dtype, page_size, nq, causal):
    rng = np.random.default_rng(page_size + nq)
    lengths = [page_size * 3, 0, 1, page_size - 1, page_size + 1, 100]
    k_pages, v_pages, table, k, v = paged(rng, lengths, page_size, 2, 32, 24, dtype)
    q = rng.standard_normal((len(lengths), 4, nq, 32)).astype(dtype)
    out, lse = sdpa.attention_paged(q, k_pages, v_pages, table, lengths, causal=causal, return_lse=True)
    want, want_lse = sdpa.attention(q, k, v, seqlens_k=lengths, causal=causal, return_lse=True, backend="reference")
    assert out.dtype == q.dtype and out.shape == (len(lengths), 4, nq, 24)
    np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), atol=tolerance(dtype), rtol=0)
    np.testing.assert_allclose(lse, want_lse, atol=tolerance(dtype) * 10, rtol=0)
    assert np.all(out[1] == 0) and np.all(np.isneginf(lse[1]))  # no keys: out 0, lse -inf


def test_float32_queries_over_a_bfloat16_pool():
    rng = np.random.default_rng(1)
    k_pages, v_pages, table, k, v = paged(rng, [40, 7], 16, 1, 16, 16, BF16)
    q = rng.standard_normal((2, 2, 1, 16)).astype(np.float32)
    out = sdpa.attention_paged(q, k_pages, v_pages, table, [40, 7])
    assert out.dtype == np.float32
    want = sdpa.attention(q, k, v, seqlens_k=[40, 7], backend="reference")
    np.testing.assert_allclose(out, want, atol=2e-5, rtol=0)


def test_docstring_picture():
    # page_size 4, block_table [7, 2, 5], 10 keys; with q = 0 out is the mean of the 10 values read.
    v_pages = np.full((8, 4, 1, 1), -1e6, np.float32)
    for j in range(10):
        v_pages[[7, 2, 5][j // 4], j % 4, 0, 0] = j
    out = sdpa.attention_paged(np.zeros((1, 1, 1, 2), np.float32), np.zeros((8, 4, 1, 2), np.float32), v_pages,
                               [[7, 2, 5]], [10])
    assert out[0, 0, 0, 0] == pytest.approx(4.5)


def test_errors_name_the_argument():
    pool = np.zeros((4, 16, 1, 8), np.float32)
    q = np.zeros((1, 1, 1, 8), np.float32)
    with pytest.raises(ValueError, match=r"block_table\[0\]\[1\] = 9 is not a page of k_pages"):
        sdpa.attention_paged(q, pool, pool, [[0, 9]], [20])
    with pytest.raises(ValueError, match="seqlens_k"):
        sdpa.attention_paged(q, pool, pool, [[0, 1]], [33])
    with pytest.raises(TypeError, match="block_table has dtype float64"):
        sdpa.attention_paged(q, pool, pool, [[0.0, 1.0]], [3])
    with pytest.raises(ValueError, match=r"k_pages has shape \(16, 1, 8\)"):
        sdpa.attention_paged(q, pool[0], pool, [[0]], [3])
    with pytest.raises(TypeError, match="read in place, not converted"):
        sdpa.attention_paged(q, pool.astype(np.int32), pool, [[0]], [3])


@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16, np.float64])
def test_kv_cache_token_by_token_matches_full_recomputation(dtype):
    rng = np.random.default_rng(7)
    cache = sdpa.KVCache(num_pages=30, page_size=16, num_kv_heads=2, head_dim_k=16, head_dim_v=8, dtype=dtype)
    seqs = [cache.new_sequence() for _ in range(3)]
    hist = {s: ([], []) for s in seqs}

    def step(s, n):
        k = rng.standard_normal((n, 2, 16)).astype(dtype)
        v = rng.standard_normal((n, 2, 8)).astype(dtype)
        cache.append(s, k, v)
        hist[s][0].append(k)
        hist[s][1].append(v)
        q = rng.standard_normal((1, 4, n, 16)).astype(dtype)
        out = cache.attention(q, [s], causal=True)
        k_all = np.concatenate(hist[s][0]).transpose(1, 0, 2)[None]
        v_all = np.concatenate(hist[s][1]).transpose(1, 0, 2)[None]
        want = sdpa.attention(q, k_all, v_all, causal=True, backend="reference")
        np.testing.assert_allclose(out.astype(np.float64), want.astype(np.float64), atol=tolerance(dtype), rtol=0)

    for s, n in zip(seqs, (5, 16, 33)):  # prompts: chunked prefill into the cache
        step(s, n)
    for _ in range(20):
        for s in seqs:
            step(s, 1)
    assert [cache.length(s) for s in seqs] == [25, 36, 53]
    assert cache.free_pages == 30 - (2 + 3 + 4)
    assert cache.k_pages.dtype == np.dtype(dtype) and cache.k_pages.shape == (30, 16, 2, 16)
    # The pool view shows the tokens where pages() says they are.
    page = cache.pages(seqs[0])[1]  # tokens 16 .. 24 of sequence 0
    np.testing.assert_array_equal(cache.k_pages[page, :9], np.concatenate(hist[seqs[0]][0])[16:25])


def test_kv_cache_errors_and_page_reuse():
    cache = sdpa.KVCache(2, 16, 1, 8)
    s = cache.new_sequence()
    with pytest.raises(ValueError, match="KVCache is full: sequence 0 needs 3 more pages"):
        cache.append(s, np.zeros((33, 1, 8), np.float32), np.zeros((33, 1, 8), np.float32))
    assert cache.length(s) == 0 and cache.free_pages == 2
    with pytest.raises(ValueError, match="sequence 5 is not in this KVCache"):
        cache.append(5, np.zeros((1, 1, 8)), np.zeros((1, 1, 8)))
    with pytest.raises(ValueError, match=r"k has shape \(1, 2, 8\) but the cache takes \(n, 1, 8\)"):
        cache.append(s, np.zeros((1, 2, 8)), np.zeros((1, 1, 8)))
    cache.append(s, np.ones((20, 1, 8)), np.ones((20, 1, 8)))
    assert cache.pages(s) == [0, 1] and cache.free_pages == 0
    cache.free(s)
    assert cache.free_pages == 2 and cache.sequences() == []
    with pytest.raises(ValueError, match="sequence 0 is not in this KVCache"):
        cache.length(s)


def test_head_major_pool_views_give_the_same_results():
    # Memory (num_pages, Hkv, page_size, D) passed as a (num_pages, page_size, Hkv, D) view.
    rng = np.random.default_rng(11)
    k_pages, v_pages, table, _, _ = paged(rng, [70, 3, 33], 16, 2, 16, 8, np.float32)
    k_hnd = np.ascontiguousarray(k_pages.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    v_hnd = np.ascontiguousarray(v_pages.transpose(0, 2, 1, 3)).transpose(0, 2, 1, 3)
    assert not k_hnd.flags.c_contiguous
    q = rng.standard_normal((3, 4, 1, 16)).astype(np.float32)
    np.testing.assert_array_equal(sdpa.attention_paged(q, k_hnd, v_hnd, table, [70, 3, 33]),
                                  sdpa.attention_paged(q, k_pages, v_pages, table, [70, 3, 33]))


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16, BF16])
@pytest.mark.parametrize("causal", [True, False, "top_left"])
def test_packed_queries_are_each_sequence_alone(dtype, causal):
    # Chunked prefill: sequences with different numbers of new tokens (0, 1, a tile's worth)
    # packed as attention_varlen packs them, each against its own pages.
    rng = np.random.default_rng(40)
    lengths = [70, 5, 33, 16, 200]
    new = [6, 0, 1, 16, 130]
    k_pages, v_pages, table, k, v = paged(rng, lengths, 16, 2, 16, 8, dtype)
    cu = np.concatenate([[0], np.cumsum(new)])
    q = rng.standard_normal((cu[-1], 4, 16)).astype(dtype)
    out, lse = sdpa.attention_paged(q, k_pages, v_pages, table, lengths, cu_seqlens_q=cu, causal=causal,
                                    return_lse=True)
    assert out.shape == (cu[-1], 4, 8) and lse.shape == (4, cu[-1])
    for b in range(len(lengths)):
        rows = q[cu[b]:cu[b + 1]].transpose(1, 0, 2)[None]
        alone, alone_lse = sdpa.attention_paged(rows, k_pages, v_pages, table[b:b + 1], lengths[b:b + 1],
                                                causal=causal, return_lse=True)
        np.testing.assert_array_equal(out[cu[b]:cu[b + 1]], alone[0].transpose(1, 0, 2))  # bit for bit
        np.testing.assert_array_equal(lse[:, cu[b]:cu[b + 1]], alone_lse[0])
        want = sdpa.attention(rows, k[b:b + 1], v[b:b + 1], seqlens_k=lengths[b:b + 1], causal=causal,
                              backend="reference")
        np.testing.assert_allclose(alone.astype(np.float64), want.astype(np.float64), atol=tolerance(dtype), rtol=0)


def test_packed_query_errors_name_the_argument_and_the_sequence():
    rng = np.random.default_rng(41)
    k_pages, v_pages, table, _, _ = paged(rng, [20, 20], 16, 1, 8, 8, np.float32)
    q = rng.standard_normal((5, 2, 8)).astype(np.float32)
    with pytest.raises(ValueError, match=r"cu_seqlens_q\[2\] = 4 but q has 5 rows"):
        sdpa.attention_paged(q, k_pages, v_pages, table, [20, 20], cu_seqlens_q=[0, 2, 4])
    with pytest.raises(ValueError, match=r"block_table has shape \(2, 2\) but cu_seqlens_q holds 3 sequences"):
        sdpa.attention_paged(q, k_pages, v_pages, table, [20, 20], cu_seqlens_q=[0, 2, 4, 5])
    bad = table.copy()
    bad[1, 1] = 99
    with pytest.raises(ValueError, match=r"block_table\[1\]\[1\] = 99 is not a page .*sequence 1 has 20 keys"):
        sdpa.attention_paged(q, k_pages, v_pages, bad, [20, 20], cu_seqlens_q=[0, 2, 5])
    with pytest.raises(ValueError, match=r"q has shape \(1, 5, 2, 8\), but must be \(total_q, Hq, Dk\) with cu_seqlens_q"):
        sdpa.attention_paged(q[None], k_pages, v_pages, table, [20, 20], cu_seqlens_q=[0, 2, 5])


# ---------------------------------------------------------------- issue 26: nothing converted silently


@pytest.mark.filterwarnings("error")  # numpy's ComplexWarning, the sign of a silent cast, fails the test
@pytest.mark.parametrize("which", ["k", "v"])
@pytest.mark.parametrize("bad", ["complex", "str", "float8", "object"])
def test_kv_cache_append_refuses_what_attention_refuses(which, bad):
    # A complex k used to be stored as its real part, a str array parsed, float8 widened.
    cache = sdpa.KVCache(2, 2, 1, 2)
    s = cache.new_sequence()
    good = np.ones((1, 1, 2))
    wrong = {"complex": good + 1j, "str": good.astype(str), "float8": good.astype(ml_dtypes.float8_e4m3fn),
             "object": good.astype(object)}[bad]
    args = {"k": good, "v": good, which: wrong}
    with pytest.raises(TypeError, match=rf"^{which} has dtype"):
        cache.append(s, args["k"], args["v"])
    assert cache.length(s) == 0 and cache.free_pages == 2
    with pytest.raises(TypeError, match=rf"^{which} has dtype"):  # attention's own rule, the same message
        sdpa.attention(np.ones((1, 2)), *(a[:, 0] for a in (args["k"], args["v"])))


@pytest.mark.parametrize("seqs", [[0.9], np.array([1.0]), np.array([0.0, 1.0]), 0.5, [True], [0, 1.0]], ids=repr)
def test_kv_cache_attention_takes_integer_sequence_ids_only(seqs):
    # [0.9] used to attend to sequence 0: an id is never truncated, nor a bool read as 0/1.
    cache = sdpa.KVCache(4, 2, 1, 2)
    for _ in range(2):
        cache.append(cache.new_sequence(), np.ones((1, 1, 2)), np.ones((1, 1, 2)))
    q = np.ones((np.size(seqs), 1, 1, 2), np.float32)
    with pytest.raises(TypeError, match=r"^seqs has dtype (float64|bool), but must hold integers"):
        cache.attention(q, seqs)
    for ok in ([1], np.array([1], np.int32), np.int64(1), 1):
        np.testing.assert_array_equal(cache.attention(q[:1], ok), cache.attention(q[:1], [1]))


@pytest.mark.parametrize("method", ["append", "free", "length", "pages"])
@pytest.mark.parametrize("seq,error", [(0.5, TypeError), (0.0, TypeError), (True, TypeError), ("0", TypeError),
                                       (2**64, ValueError), (-2**64, ValueError)], ids=repr)
def test_kv_cache_sequence_argument_is_an_integer(method, seq, error):
    cache = sdpa.KVCache(2, 2, 1, 2)
    cache.append(cache.new_sequence(), np.ones((1, 1, 2)), np.ones((1, 1, 2)))
    args = (np.ones((1, 1, 2)), np.ones((1, 1, 2))) if method == "append" else ()
    with pytest.raises(error, match=r"^seq must be an integer") as info:
        getattr(cache, method)(seq, *args)
    assert "incompatible function arguments" not in str(info.value)
    assert cache.length(0) == 1 and cache.free_pages == 1


@pytest.mark.parametrize("args,name,error", [
    ((2.5, 2, 1, 2), "num_pages", TypeError), ((4, 2**64, 1, 2), "page_size", ValueError),
    ((4, 2, 1.0, 2), "num_kv_heads", TypeError), ((4, 2, 1, -2**64), "head_dim_k", ValueError),
    ((4, 2, 1, 2, "2"), "head_dim_v", TypeError), ((4, True, 1, 2), "page_size", TypeError)], ids=repr)
def test_kv_cache_sizes_are_integers_named_in_errors(args, name, error):
    # These gave nanobind's "incompatible function arguments" dump, naming nothing.
    with pytest.raises(error, match=rf"^{name} must be an integer"):
        sdpa.KVCache(*args)


@pytest.mark.parametrize("dtype", [np.complex64, np.int32, None, "float8", "nonsense"], ids=repr)
def test_kv_cache_dtype_is_named_in_errors(dtype):
    with pytest.raises(TypeError, match=r"^dtype must be float32, float64, float16, ml_dtypes.bfloat16, int8 or uint8"):
        sdpa.KVCache(2, 2, 1, 2, dtype=ml_dtypes.float8_e4m3fn if dtype == "float8" else dtype)


def test_empty_batches_of_ids():
    # An empty list of ids (or of lengths) has no dtype of its own: it is an empty int64 array.
    cache = sdpa.KVCache(2, 2, 1, 2)
    assert cache.attention(np.ones((0, 1, 1, 2), np.float32), []).shape == (0, 1, 1, 2)
    pool = np.zeros((2, 2, 1, 2), np.float32)
    assert sdpa.attention_paged(np.ones((0, 1, 1, 2), np.float32), pool, pool, np.zeros((0, 1), np.int64),
                                []).shape == (0, 1, 1, 2)
    with pytest.raises(TypeError, match="^seqs has dtype float64"):  # an explicit float array is still refused
        cache.attention(np.ones((0, 1, 1, 2), np.float32), np.array([]))
