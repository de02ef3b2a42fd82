"""batch_invariant=True: a query row's out is bit for bit the same however it is computed —
alone (one row), in a batch of 5 with seqlens_k, as chunked prefill, through attention_varlen,
attention_paged (pages of 1, 16, 128) and KVCache token by token, with 1 or 2 threads — for
every float dtype, causal or not, GQA, Dv != Dk, sinks and softcap, and key counts across
one to two 4096-key chunks. Without the option some of these differ today (the option is not
vacuous). tests/batch_invariance_test.cc is the C++ twin."""
import ml_dtypes
import numpy as np
import pytest

import sdpa

BF16 = np.dtype(ml_dtypes.bfloat16)
HQ, HKV, DK, DV = 4, 2, 32, 24
P = 5  # the target's last rows compared


def seq(rng, n, dtype):
    """A sequence token-major: q (n, Hq, Dk), k (n, Hkv, Dk), v (n, Hkv, Dv)."""
    return tuple(rng.standard_normal((n, h, d)).astype(dtype) for h, d in ((HQ, DK), (HKV, DK), (HKV, DV)))


def head_major(x):  # (n, H, D) -> (H, n, D)
    return np.ascontiguousarray(x.transpose(1, 0, 2))


def ways(dtype, causal, n_keys, invariant, mods):
    """{way: (P, Hq, Dv) out of the target's last P rows}, the first being the rows alone."""
    rng = np.random.default_rng(n_keys * 3 + causal)
    q, k, v = seq(rng, n_keys, dtype)
    others = [seq(rng, int(rng.integers(P, 1400)), dtype) for _ in range(3)]
    kw = dict(causal=causal, batch_invariant=invariant, **mods)
    first = n_keys - min(P, n_keys)
    rows = range(first, n_keys)
    got = {}

    def keys(pos):
        return pos + 1 if causal else n_keys

    for threads in (1, 2):
        sdpa.set_num_threads(threads)
        t = f" ({threads} threads)"
        got["alone" + t] = np.stack([sdpa.attention(head_major(q[i:i + 1])[None], head_major(k[:keys(i)])[None],
                                                    head_major(v[:keys(i)])[None], **kw)[0, :, 0] for i in rows])
        # a dense batch with seqlens_k: every sequence's last len(rows) rows
        n = len(rows)
        group = [others[0], (q, k, v), others[1]]
        nk = max(s[1].shape[0] for s in group)
        qb = np.stack([head_major(s[0][-n:]) for s in group])
        kb = np.zeros((3, HKV, nk, DK), dtype)
        vb = np.zeros((3, HKV, nk, DV), dtype)
        for b, s in enumerate(group):
            kb[b, :, :s[1].shape[0]] = head_major(s[1])
            vb[b, :, :s[2].shape[0]] = head_major(s[2])
        lens = np.array([s[1].shape[0] for s in group])
        got["dense batch" + t] = sdpa.attention(qb, kb, vb, seqlens_k=lens, **kw)[1].transpose(1, 0, 2)
        # chunked prefill by 7 and 64 rows from position 0
        for c in (7, 64):
            out = []
            for a in range(first // c * c, n_keys, c):
                m = min(c, n_keys - a)
                nk_c = a + m if causal else n_keys
                o = sdpa.attention(head_major(q[a:a + m])[None], head_major(k[:nk_c])[None], head_major(v[:nk_c])[None],
                                   **kw)[0].transpose(1, 0, 2)
                out.extend(o[max(a, first) - a:])
            got[f"chunks of {c}" + t] = np.stack(out)
        # varlen beside two other sequences
        qs = [others[0][0][-2:], q[first:], others[1][0][-1:]]
        ks, vs = [others[0][1], k, others[1][1]], [others[0][2], v, others[1][2]]
        cu_q = np.cumsum([0] + [len(x) for x in qs])
        cu_k = np.cumsum([0] + [len(x) for x in ks])
        o = sdpa.attention_varlen(np.concatenate(qs), np.concatenate(ks), np.concatenate(vs), cu_q, cu_k, **kw)
        got["varlen" + t] = o[cu_q[1]:cu_q[2]]
        # paged, pages of 1, 16 and 128, shuffled, beside two other sequences
        for ps in (1, 16, 128):
            used = [-(-s[1].shape[0] // ps) for s in group]
            order = rng.permutation(sum(used))
            k_pages = np.zeros((sum(used), ps, HKV, DK), dtype)
            v_pages = np.zeros((sum(used), ps, HKV, DV), dtype)
            table = np.full((3, max(used)), -1, np.int32)
            at = 0
            for b, s in enumerate(group):
                for pg in range(used[b]):
                    table[b, pg] = order[at]
                    at += 1
                    part = slice(pg * ps, min((pg + 1) * ps, s[1].shape[0]))
                    k_pages[table[b, pg], :part.stop - part.start] = s[1][part]
                    v_pages[table[b, pg], :part.stop - part.start] = s[2][part]
            o = sdpa.attention_paged(qb, k_pages, v_pages, table, lens, **kw)
            got[f"paged {ps}" + t] = o[1].transpose(1, 0, 2)
        # KVCache, token by token (a decode step sees the keys up to itself)
        if causal:
            cache = sdpa.KVCache(2 * (n_keys + 1500) // 16 + 4, 16, HKV, DK, DV, dtype=dtype)
            a, s = cache.new_sequence(), cache.new_sequence()
            cache.append(a, others[2][1], others[2][2])
            if first:
                cache.append(s, k[:first], v[:first])
            out = []
            for i in rows:
                cache.append(s, k[i:i + 1], v[i:i + 1])
                qq = np.stack([head_major(others[2][0][-1:]), head_major(q[i:i + 1])])
                out.append(cache.attention(qq, [a, s], **kw)[1, :, 0])
            got["KVCache decode" + t] = np.stack(out)
    sdpa.set_num_threads(0)
    return got


def bits(x):
    return np.ascontiguousarray(x).view(np.uint8)


MODS = {"none": {}, "softcap+sinks": {"softcap": 20.0, "sinks": np.array([-0.7, -0.2, 0.3, 0.8])}}


@pytest.mark.parametrize("mods", MODS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("dtype", [np.float32, BF16, np.float16, np.float64], ids=str)
def test_rows_are_bitwise_equal_however_batched(dtype, causal, mods):
    for n_keys in (1, 127, 5000):
        got = ways(dtype, causal, n_keys, True, MODS[mods])
        want = got["alone (1 threads)"]
        for way, out in got.items():
            assert out.shape == want.shape, way
            assert np.array_equal(bits(out), bits(want)), f"{way}, {n_keys} keys: differs from the row alone"


def test_without_the_option_some_batching_differs():
    """Not vacuous: today the decode kernel and the key chunks chosen from the batch's shape
    change some row's last bits."""
    got = ways(np.float32, True, 3000, False, {})
    want = got["alone (1 threads)"]
    differ = [way for way, out in got.items() if not np.array_equal(bits(out), bits(want))]
    assert differ


def test_flag_type():
    q = np.ones((1, 1, 2, 4), np.float32)
    with pytest.raises(TypeError, match="batch_invariant must be True or False"):
        sdpa.attention(q, q, q, batch_invariant=1)
    np.testing.assert_array_equal(sdpa.attention(q, q, q, batch_invariant=np.bool_(True)), sdpa.attention(q, q, q))


def test_torch_front_door_passes_the_option():
    """sdpa.torch's scaled_dot_product_attention (with and without autograd), attention_varlen
    and attention_paged take batch_invariant: a row alone and in a batch give the same bits,
    which are the NumPy front door's."""
    from torch_required import import_torch
    torch = import_torch()
    import sdpa.torch as st
    rng = np.random.default_rng(3)
    n_keys = 5000
    q, k, v = seq(rng, n_keys, np.float32)
    other = seq(rng, n_keys, np.float32)
    kw = dict(causal=True, batch_invariant=True)
    want = np.stack([sdpa.attention(head_major(q[i:i + 1])[None], head_major(k[:i + 1])[None],
                                    head_major(v[:i + 1])[None], **kw)[0, :, 0] for i in range(n_keys - P, n_keys)])
    qb = torch.from_numpy(np.stack([head_major(other[0][-P:]), head_major(q[-P:])]))
    kb = torch.from_numpy(np.stack([head_major(other[1]), head_major(k)]))
    vb = torch.from_numpy(np.stack([head_major(other[2]), head_major(v)]))
    # torch's is_causal is top-left: with Nq < Nk the rows would not see their keys; a bool mask
    # of the bottom-right band says the same thing as sdpa's causal here.
    band = torch.from_numpy(np.arange(n_keys)[None, :] <= (n_keys - P + np.arange(P))[:, None])
    for grad in (False, True):
        qg = qb.clone().requires_grad_(grad)
        out = st.scaled_dot_product_attention(qg, kb, vb, attn_mask=band, enable_gqa=True, batch_invariant=True)
        assert np.array_equal(bits(out[1].detach().numpy().transpose(1, 0, 2)), bits(want))
        if grad:
            out.sum().backward()
            assert qg.grad is not None
    cu_q = torch.tensor([0, P, 2 * P])
    cu_k = torch.tensor([0, n_keys, 2 * n_keys])
    out = st.attention_varlen(torch.from_numpy(np.concatenate([other[0][-P:], q[-P:]])),
                              torch.from_numpy(np.concatenate([other[1], k])),
                              torch.from_numpy(np.concatenate([other[2], v])), cu_q, cu_k, **kw)
    assert np.array_equal(bits(out[P:].numpy()), bits(want))
    per = -(-n_keys // 16)  # pages per sequence (5000 keys: the last page half full)
    kp = np.zeros((2 * per * 16, HKV, DK), np.float32)
    vp = np.zeros((2 * per * 16, HKV, DV), np.float32)
    kp[:n_keys], vp[:n_keys] = k, v
    kp[per * 16:per * 16 + n_keys], vp[per * 16:per * 16 + n_keys] = other[1], other[2]
    table = torch.tensor([list(range(per, 2 * per)), list(range(per))], dtype=torch.int32)
    out = st.attention_paged(qb, torch.from_numpy(kp.reshape(-1, 16, HKV, DK)), torch.from_numpy(vp.reshape(-1, 16, HKV, DV)),
                             table, torch.tensor([n_keys, n_keys]), **kw)
    assert np.array_equal(bits(out[1].numpy().transpose(1, 0, 2)), bits(want))


def _hm(x):  # (n, H, ...) -> (H, n, ...): values (n, H, D) and scales (n, H) alike
    return np.ascontiguousarray(np.swapaxes(x, 0, 1))


def _q8(x, dtype):
    """x (n, H, D) quantised per (token, head): [values, scale(, zero)], each token-major."""
    return list(sdpa.quantize_kv(x, dtype))


def _kw8(k8, v8, f):
    """The 8-bit kwargs of k8 and v8's scale (and zero-point) parts, each mapped by f."""
    kw = {"k_scale": f(k8[1]), "v_scale": f(v8[1])}
    if len(k8) == 3:
        kw.update(k_zero=f(k8[2]), v_zero=f(v8[2]))
    return kw


@pytest.mark.parametrize("dtype", ["int8", "uint8"])
@pytest.mark.parametrize("causal", [True, False])
def test_8bit_rows_are_bitwise_equal_however_batched(dtype, causal):
    """The same ways as above on an 8-bit cache (values and per (token, head) scales sliced,
    batched, packed and paged alike; KVCache quantises on append, per token, as quantize_kv)."""
    for n_keys in (127, 5000):
        rng = np.random.default_rng(n_keys + causal)
        q, kf, vf = seq(rng, n_keys, np.float32)
        k, v = _q8(kf, dtype), _q8(vf, dtype)
        lo = n_keys // 2 + P  # the other sequence's length, shorter
        oq, okf, ovf = seq(rng, lo, np.float32)
        ok, ov = _q8(okf, dtype), _q8(ovf, dtype)
        first = n_keys - P
        rows = range(first, n_keys)
        kw = dict(causal=causal, batch_invariant=True)
        got = {}
        for threads in (1, 2):
            sdpa.set_num_threads(threads)
            t = f" ({threads} threads)"
            alone = []
            for i in rows:
                n = i + 1 if causal else n_keys
                cut = lambda a: _hm(a[:n])[None]  # noqa: E731
                alone.append(sdpa.attention(_hm(q[i:i + 1])[None], cut(k[0]), cut(v[0]), **kw, **_kw8(k, v, cut))[0, :, 0])
            got["alone" + t] = np.stack(alone)
            # a dense batch of two with seqlens_k (the other sequence shorter, padded)
            pad = lambda a, b: np.stack([_hm(a), _hm(np.concatenate([b, np.zeros((n_keys - len(b),) + b.shape[1:], b.dtype)]))])  # noqa: E731
            qb = np.stack([_hm(q[first:]), _hm(oq[-P:])])
            out = sdpa.attention(qb, pad(k[0], ok[0]), pad(v[0], ov[0]), seqlens_k=np.array([n_keys, lo]), **kw,
                                 **{name: pad(a, b) for (name, a), b in zip(_kw8(k, v, lambda x: x).items(),
                                                                           _kw8(ok, ov, lambda x: x).values())})
            got["dense batch" + t] = out[0].transpose(1, 0, 2)
            # varlen beside the other sequence
            cu_q, cu_k = np.array([0, 2, 2 + P]), np.array([0, lo, lo + n_keys])
            cat = lambda a, b: np.concatenate([a, b])  # noqa: E731
            out = sdpa.attention_varlen(cat(oq[-2:], q[first:]), cat(ok[0], k[0]), cat(ov[0], v[0]), cu_q, cu_k, **kw,
                                        **{name: cat(b, a) for (name, a), b in zip(_kw8(k, v, lambda x: x).items(),
                                                                                  _kw8(ok, ov, lambda x: x).values())})
            got["varlen" + t] = out[2:]
            # paged (pages of 16), the other sequence's pages first
            ps = 16
            per_t, per_o = -(-n_keys // ps), -(-lo // ps)

            def pool(a, b):
                x = np.zeros(((per_o + per_t) * ps,) + a.shape[1:], a.dtype)
                x[:lo], x[per_o * ps:per_o * ps + n_keys] = b, a
                return x.reshape((per_o + per_t, ps) + a.shape[1:])
            table = np.full((2, per_t), -1, np.int32)
            table[0] = np.arange(per_o, per_o + per_t)
            table[1, :per_o] = np.arange(per_o)
            out = sdpa.attention_paged(qb, pool(k[0], ok[0]), pool(v[0], ov[0]), table, np.array([n_keys, lo]), **kw,
                                       **{name: pool(a, b) for (name, a), b in zip(_kw8(k, v, lambda x: x).items(),
                                                                                  _kw8(ok, ov, lambda x: x).values())})
            got["paged 16" + t] = out[0].transpose(1, 0, 2)
            if causal:  # KVCache token by token, beside the other sequence
                cache = sdpa.KVCache(2 * (n_keys + lo) // 16 + 4, 16, HKV, DK, DV, dtype=dtype)
                a, s = cache.new_sequence(), cache.new_sequence()
                cache.append(a, okf, ovf)
                cache.append(s, kf[:first], vf[:first])
                out = []
                for i in rows:
                    cache.append(s, kf[i:i + 1], vf[i:i + 1])
                    out.append(cache.attention(np.stack([_hm(oq[-1:]), _hm(q[i:i + 1])]), [a, s], **kw)[1, :, 0])
                got["KVCache decode" + t] = np.stack(out)
        sdpa.set_num_threads(0)
        want = got["alone (1 threads)"]
        for way, out in got.items():
            assert out.shape == want.shape, way
            assert np.array_equal(bits(out), bits(want)), f"{way}, {n_keys} keys: differs from the row alone"
