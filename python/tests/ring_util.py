"""Shared by test_ring_torch.py and test_ring_mpi.py: the ring attention cases, their inputs (the
same on every rank: seeded), and the parent's check of what the ranks sent back against the
one-process call on the whole sequence.

Tolerance (the rule of tests/oracle/tolerance.h and reference.py, per result): the ring's result
and the one-process sdpa.attention call are each compared with the float64 reference
(backend="reference" on the inputs widened to float64) at

    tol = 2 · |yardstick - ref64| + eps32 · (4 · max(1, max|ref|) + 2 · max|lse| · max|ref|)
          (+ one unit in the last place of max|ref| for a 16-bit result)

the yardstick being the naive algorithm in the inputs' precision (backend="naive"); for the
sinks' and ALiBi slopes' gradients, which only sdpa.torch's autograd gives, the one-process
float32 call (the ring may be at most twice as wrong as it). The lse term is the backward's
floor of reference.backward_floors (P = exp(s - lse) read through a rounded lse). The ring's
results add the bounds of its own arithmetic, as tests/ring_test.cc does (ring_bounds): the P - 1
merges of a row's pair partials (merge.h's bound) in out and lse, and the P - 1 additions of the
pairs' terms in dq, dk and dv (P the key chunks: 2W for zigzag, W for contiguous).
"""

from __future__ import annotations

import math
import pickle
import time

import ml_dtypes
import numpy as np

from reference import EPS32, case_seed, finite_max_abs, max_error, ulp

B, D, N = 1, 8, 24  # N splits into 2W chunks for W = 1..4 (zigzag: N_local even)


def _case(name, dtype="float32", layout="zigzag", causal=True, hq=2, hkv=2, window=None, alibi=False, sinks=False,
          dropout=0.0, cu=None, strategy="ring", backward=True):
    return dict(name=name, dtype=dtype, layout=layout, causal=causal, hq=hq, hkv=hkv, window=window, alibi=alibi,
                sinks=sinks, dropout=dropout, cu=cu, strategy=strategy, backward=backward)


CASES = [
    _case("zigzag_causal_gqa", hq=4, hkv=2),
    _case("contiguous_causal"),
    _case("zigzag_full", causal=False),
    _case("contiguous_full_gqa", layout="contiguous", causal=False, hq=4, hkv=1),
    _case("zigzag_window", causal=False, window=(5, 2)),
    _case("contiguous_causal_window", layout="contiguous", window=(7, 0)),
    _case("zigzag_alibi_sinks", alibi=True, sinks=True, hq=4, hkv=2),
    _case("contiguous_alibi", layout="contiguous", causal=False, alibi=True),
    _case("zigzag_bf16", dtype="bfloat16", hq=4, hkv=2),
    _case("contiguous_bf16_full", dtype="bfloat16", layout="contiguous", causal=False),
    _case("zigzag_dropout", dropout=0.25),
    _case("contiguous_dropout_full", layout="contiguous", causal=False, dropout=0.25),
]
# Packed documents (cu_seqlens over the whole sequence of N = 24): a 1-token document, an empty
# one, documents that span ranks and start mid-chunk for every W. The reference is
# sdpa.attention_varlen on the whole packed sequence.
DOCS = [0, 1, 7, 7, 16, 24]
_DOCS = [
    ("zigzag_docs_causal", {}),
    ("contiguous_docs_full_gqa", dict(layout="contiguous", causal=False, hq=4, hkv=2)),
    ("zigzag_docs_window_sinks", dict(causal=False, window=(3, 1), sinks=True)),
    ("contiguous_docs_bf16", dict(dtype="bfloat16", layout="contiguous")),
]
# Forward with documents: the C++ computes it today.
DOC_FORWARD_CASES = [_case(name + "_fwd", cu=DOCS, backward=False, **kw) for name, kw in _DOCS]
# Forward and backward with documents (the reference: attention_varlen_backward).
DOC_BACKWARD_CASES = [_case(name, cu=DOCS, **kw) for name, kw in _DOCS]
# strategy="allgather" forward and backward (GQA / MQA, the strategy's use; documents too).
ALLGATHER_CASES = [
    _case("zigzag_allgather_causal_gqa", hq=4, hkv=2, strategy="allgather"),
    _case("contiguous_allgather_full_mqa", layout="contiguous", causal=False, hq=4, hkv=1, strategy="allgather"),
    _case("zigzag_allgather_window_alibi_sinks", causal=False, window=(5, 2), alibi=True, sinks=True,
          strategy="allgather"),
    _case("contiguous_allgather_bf16", dtype="bfloat16", layout="contiguous", strategy="allgather"),
    _case("zigzag_allgather_docs", hq=4, hkv=1, cu=DOCS, strategy="allgather"),
]
ALL_CASES = CASES + DOC_FORWARD_CASES + DOC_BACKWARD_CASES + ALLGATHER_CASES
# The groups each transport's test file checks apart from its failures (test_ring_torch.py and
# test_ring_mpi.py: one test per group and world size, on the ranks' results of one run).
GROUPS = {"documents_backward": DOC_BACKWARD_CASES, "allgather": ALLGATHER_CASES}
SEED = 1234  # the dropout seed


def inputs(case):
    """The whole sequence's q, k, v, dout (float32 or bfloat16) and the slopes and sinks (float32
    or None), the same on every rank."""
    rng = np.random.default_rng(case_seed("ring", case["name"]))
    dt = np.dtype(ml_dtypes.bfloat16) if case["dtype"] == "bfloat16" else np.dtype(np.float32)
    q = rng.standard_normal((B, case["hq"], N, D)).astype(dt)
    k = rng.standard_normal((B, case["hkv"], N, D)).astype(dt)
    v = rng.standard_normal((B, case["hkv"], N, D)).astype(dt)
    dout = rng.standard_normal((B, case["hq"], N, D)).astype(dt)
    slopes = rng.uniform(0.05, 0.5, case["hq"]).astype(np.float32) if case["alibi"] else None
    sinks = rng.standard_normal(case["hq"]).astype(np.float32) if case["sinks"] else None
    return q, k, v, dout, slopes, sinks


def options(case):
    """The keyword arguments of the ring call and the one-process sdpa.attention call alike."""
    kw = dict(causal=case["causal"], window=case["window"])
    if case["cu"] is not None:
        kw.update(cu_seqlens=np.array(case["cu"], np.int64))
    if case["dropout"]:
        kw.update(dropout_p=case["dropout"], seed=SEED)
    return kw


def save(path, obj):
    with open(path, "wb") as f:
        pickle.dump(obj, f)


def load(path):
    with open(path, "rb") as f:
        return pickle.load(f)


def _f64(a):
    return None if a is None else np.asarray(a, dtype=np.float64)


def ring_options(case):
    """The ring call's keyword arguments beyond options(case): the strategy."""
    return dict(strategy=case["strategy"])


def _packed(a):
    """(1, H, N, D) as attention_varlen's token-major (N, H, D), and back."""
    return np.ascontiguousarray(a[0].transpose(1, 0, 2))


def _unpacked(a):
    return np.ascontiguousarray(a.transpose(1, 0, 2))[None]


def _one_process(case, backend, widen=False):
    """(out, lse, dq, dk, dv, dsinks) of sdpa.attention and attention_backward on the whole
    sequence (with documents: attention_varlen and its backward on the whole packed sequence,
    in the ring's (1, H, N, D) shapes)."""
    import sdpa
    q, k, v, dout, slopes, sinks = inputs(case)
    if widen:
        q, k, v, dout = (_f64(a) for a in (q, k, v, dout))
    mods = dict(options(case), alibi_slopes=slopes, sinks=sinks, backend=backend)
    if case["cu"] is not None:
        cu = mods.pop("cu_seqlens")
        q, k, v, dout = (_packed(a) for a in (q, k, v, dout))
        out, lse = sdpa.attention_varlen(q, k, v, cu, cu, return_lse=True, **mods)
        grads = list(sdpa.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, **mods))
        grads[:3] = (_unpacked(g) for g in grads[:3])
        return (_unpacked(out), lse[None]) + tuple(grads) + ((None,) if sinks is None else ())
    out, lse = sdpa.attention(q, k, v, return_lse=True, **mods)
    grads = sdpa.attention_backward(dout, q, k, v, out, lse, **mods)
    return (out, lse) + tuple(grads) + ((None,) if sinks is None else ())


def _slope_grads(case, dtype):
    """(dalibi, dsinks) of sdpa.torch on the whole sequence in dtype (float32 or float64)."""
    import torch

    import sdpa.torch as st
    q, k, v, dout, slopes, sinks = inputs(case)
    t = [torch.from_numpy(np.asarray(a, dtype=dtype)) for a in (q, k, v, dout)]
    assert case["cu"] is None, "the slopes' gradient with documents: not a case"
    s = torch.from_numpy(slopes.astype(dtype)).requires_grad_()
    sk = None if sinks is None else torch.from_numpy(sinks.astype(dtype)).requires_grad_()
    mask, causal = None, case["causal"]
    if case["window"] is not None:  # sdpa.torch's function takes no window: the same as a bool mask
        n = q.shape[-2]
        i, j = np.arange(n)[:, None], np.arange(n)[None, :]
        left, right = case["window"]
        allowed = (j <= i) if causal else np.ones((n, n), bool)
        if left >= 0:
            allowed &= j >= i - left
        if right >= 0:
            allowed &= j <= i + right
        mask, causal = torch.from_numpy(allowed), False
    out = st.scaled_dot_product_attention(*t[:3], attn_mask=mask, is_causal=causal, enable_gqa=True, alibi_slopes=s,
                                          sinks=sk)
    out.backward(t[3])
    return s.grad.numpy(), None if sk is None else sk.grad.numpy()


def tolerance(yardstick, ref, lse_max, dtype):
    tol = 2 * max_error(yardstick, ref) + EPS32 * (4 * max(1.0, finite_max_abs(ref)) +
                                                    2 * lse_max * finite_max_abs(ref))
    if dtype == "bfloat16":
        tol += ulp(ml_dtypes.bfloat16, finite_max_abs(ref))
    return tol


def ring_bounds(case, world):
    """tests/ring_test.cc's merge_bound and the sums' bound, for out, lse, dq, dk, dv."""
    q, k, v, dout, _, _ = (None if a is None else np.asarray(a, np.float64) for a in inputs(case))
    ref_lse = _one_process(case, "reference", widen=True)[1]
    u, P = EPS32 / 2, 2 * world if case["layout"] == "zigzag" else world
    m, z = max(P - 1, 0), 1 / (1 - case["dropout"])
    M, L = finite_max_abs(v) * z, finite_max_abs(ref_lse)
    c_out, c_lse = (2 + 2 / math.e) * 2 + 4, (1 + 1 / math.e) * 2 + 1 + 2 * math.log(2.0) + L
    omax = finite_max_abs(_one_process(case, "reference", widen=True)[0])
    dmax, rows = finite_max_abs(dout), case["hq"] // case["hkv"] * N
    term = D * dmax * (finite_max_abs(v) * z + omax) / math.sqrt(D)
    sums = (term * finite_max_abs(k), term * finite_max_abs(q) * rows, rows * dmax * z)
    return dict(out=m * u * M * (c_out + m * c_lse), lse=m * u * c_lse,
                **{name: (P - 1) * u * s for name, s in zip(("dq", "dk", "dv"), sums)})


NAMES = ("out", "lse", "dq", "dk", "dv", "dsinks")


def check(case, runs, world):
    """Asserts the ranks' results (runs: two dicts of whole-sequence arrays, unsharded by the
    ranks) against the one-process call, and that the two runs are bitwise equal."""
    where = f"W={world} {case['name']}"
    for name in runs[0]:
        a, b = runs[0][name], runs[1][name]
        assert a.shape == b.shape and np.array_equal(a.view(np.uint8), b.view(np.uint8)), \
            f"{where}: {name} differs between two runs (not bitwise repeatable)"
    ring = runs[0]
    one = dict(zip(NAMES, _one_process(case, "auto")))
    naive = dict(zip(NAMES, _one_process(case, "naive")))
    ref = dict(zip(NAMES, _one_process(case, "reference", widen=True)))
    lse_max = finite_max_abs(ref["lse"])
    yard = dict(naive)
    if case["alibi"]:
        ref["dalibi"], ref64_sinks = _slope_grads(case, np.float64)
        yard["dalibi"], yard_sinks = _slope_grads(case, np.float32)
        one["dalibi"] = yard["dalibi"]
        if case["sinks"]:
            ref["dsinks"], yard["dsinks"] = ref64_sinks, yard_sinks
    bounds = ring_bounds(case, world)
    for name in ring:
        if ref.get(name) is None:
            continue
        tol = tolerance(yard[name], ref[name], lse_max, case["dtype"] if name in ("out", "dq", "dk", "dv") else "float32")
        for who, got, extra in (("ring", ring[name], bounds.get(name, 0.0)), ("one-process", one[name], 0.0)):
            err = max_error(got, ref[name])
            assert got.shape == ref[name].shape, f"{where}: {who} {name} shape {got.shape} != {ref[name].shape}"
            assert not np.isnan(got).any() and err <= tol + extra, \
                f"{where}: {who} {name} off the float64 reference by {err:.3g} > tolerance {tol + extra:.3g}"
        assert math.isfinite(tol)


def check_cases(results, cases, world):
    """Every rank's results of `cases` (results: the ranks' dicts, each with "cases" (name: two
    runs) and "errors" (name: the message of a case that raised)): no rank raised, every rank
    unsharded the same whole arrays (so every rank's shard is checked), and check() holds."""
    for case in cases:
        for r in results:
            err = r["errors"].get(case["name"])
            assert err is None, f"W={world} rank {r['rank']} {case['name']} raised: {err}"
        runs = results[0]["cases"][case["name"]]
        for r in results[1:]:
            other = r["cases"][case["name"]]
            for name in runs[0]:
                assert np.array_equal(other[0][name], runs[0][name]), \
                    f"W={world} {case['name']}: rank {r['rank']}'s {name} differs from rank 0's"
        check(case, runs, world)


def error(fn):
    """(None, elapsed) when fn() returns, else ("Type: message", elapsed): a rank's record of a
    call expected to fail."""
    start = time.monotonic()
    try:
        fn()
        return None, time.monotonic() - start
    except Exception as e:  # noqa: BLE001 (any error is what is looked for)
        return f"{type(e).__name__}: {e}", time.monotonic() - start
