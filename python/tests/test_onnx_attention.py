"""ONNX Attention (opsets 23, 24, 25) node test cases mapped onto sdpa.attention.

The onnx wheel ships no node test data, so the cases come from running the generators: every
``export_*`` static method of ``onnx.backend.test.case.node.attention.Attention``, with that
module's ``expect`` replaced by a recorder of (node, inputs, outputs, name) and NumPy's global RNG
seeded before each export (reproducible). Each case is one test (its ONNX name is the test id).

The adapter uses NumPy only to reshape (3-D (B, S, H*D) <-> (B, H, S, D)), to concatenate the KV
cache (past_key/past_value + K/V, compared to present_key/present_value exactly), to pad a short
attn_mask as the reference does, and to build a structural causal or window mask, exactly as the
reference defines it, only where ONNX's alignment has no exact sdpa spelling (a causal past whose
new K/V have another length than Q: ONNX aligns the query block right after the past, not to the
end of the keys). Every piece of attention maths (scale, softcap, mask, causal, window,
nonpad_kv_seqlen, softmax, weights, the qk_matmul_output scores of every mode) is sdpa.attention's.

scripts/test.sh installs onnx (python/requirements-test.txt). Without onnx the module is skipped,
except where the environment variable CI is set: there it fails, so CI never passes without it.
"""

import numpy as np
import pytest

from torch_required import required

onnx = required("onnx", "onnx", "ONNX adapter tests", module_level=True)
onnx_attention_cases = required("onnx.backend.test.case.node.attention", "onnx", "ONNX adapter tests", module_level=True)

import sdpa  # noqa: E402

# ONNX's node-test tolerances: onnx/backend/test/case/node/__init__.py's expect() gives every node
# test case rtol=1e-3, atol=1e-7 (no per-case override exists for Attention), and
# onnx/backend/test/runner/__init__.py's assert_similar_outputs compares with
# np.testing.assert_allclose(out, ref, rtol, atol) after asserting equal shapes and dtypes,
# raising rtol to max(rtol, 2**-6) ("two bfloat16 ULPs") for bfloat16 outputs, compared in float32.
RTOL = 1e-3
ATOL = 1e-7
RTOL_BF16 = 2.0**-6
# The 16-bit cases are compared with their golden outputs at these tolerances too, and pass. The
# reference computes them with roundings to the 16-bit dtype in between (sqrt(scale), q and k
# scaled, scores, softmax, the weights before the last matmul), which leaves its Y up to ~1.7 ulps
# from the exact (float64) maths on the same inputs; sdpa widens exactly, computes in float32 and
# rounds once (<= 0.5 ulp measured). So a float16 case can sit near the edge (1 ulp of float16
# just above 0.5 is ~1e-3 relative): should one miss, compare it with onnx's reference evaluated
# in float64 on the same inputs widened exactly (at these same tolerances), not with looser ones.


def _collect():
    """[(name, node, inputs, outputs, opset)] from every export_* generator, in name order."""
    cases = []

    def record(node, inputs, outputs, name, **kwargs):
        opsets = [o.version for o in kwargs.get("opset_imports", []) if o.domain in ("", "ai.onnx")]
        cases.append((name, node, list(inputs), list(outputs), opsets[0] if opsets else None))

    saved = onnx_attention_cases.expect
    onnx_attention_cases.expect = record
    try:
        generators = onnx_attention_cases.Attention
        for attr in sorted(vars(generators)):
            if attr.startswith("export"):
                np.random.seed(0)  # the generators draw from the global RNG (some reseed it themselves)
                getattr(generators, attr)()
    finally:
        onnx_attention_cases.expect = saved
    return cases


CASES = {case[0]: case for case in _collect()}

# qk_matmul_output_mode -> sdpa's return_scores stage (mode 3, the softmax weights, is
# return_weights). The reference caps the scores in place before it reads modes 0 and 1, so with
# a softcap both give the capped scores; without one "softcapped" is "scaled". Mode 2 is the
# capped scores plus the mask's and causal's bias: "final" under softcap_order="before_bias".
_STAGES = {0: "scaled", 1: "softcapped", 2: "final"}

# The parts of a case sdpa cannot check, named (none today: every qk_matmul_output mode maps).
# Y and present_key/present_value of a listed case are still compared; the test then skips with
# this reason. A listed case that needs nothing unsupported, or an unlisted one that does, fails.
UNSUPPORTED = {}


@pytest.fixture(autouse=True)
def one_thread():
    """Tiny tensors: sdpa's thread pool would cost more than the arithmetic."""
    before = sdpa.num_threads()
    sdpa.set_num_threads(1)
    yield
    sdpa.set_num_threads(before)


def _attributes(node):
    a = {attr.name: onnx.helper.get_attribute_value(attr) for attr in node.attribute}
    return {
        "scale": a.get("scale"),
        "is_causal": int(a.get("is_causal", 0)),
        "q_num_heads": a.get("q_num_heads"),
        "kv_num_heads": a.get("kv_num_heads"),
        "softcap": float(a.get("softcap", 0.0)),
        "qk_matmul_output_mode": int(a.get("qk_matmul_output_mode", 0)),
        "softmax_precision": a.get("softmax_precision"),
        "left_window_size": int(a.get("left_window_size", -1)),
        "right_window_size": int(a.get("right_window_size", -1)),
    }


def _named(names, values):
    """{name: value} for the present (non-empty) names, in order, as expect() pairs them."""
    present = [n for n in names if n != ""]
    assert len(present) == len(values)
    return dict(zip(present, values))


def _to_heads(x, heads):
    """(B, S, H*D) -> (B, H, S, D): ONNX's reshape then transpose."""
    b, s, hidden = x.shape
    return x.reshape(b, s, heads, hidden // heads).transpose(0, 2, 1, 3)


def _structural_mask(nq, nk, offset, left, right, causal):
    """Bool (Nq, Nk): the reference's causal and window rules, exactly (_apply_causal /
    _apply_sliding_window with a scalar offset: query i is at position p = i + offset; causal allows
    j <= p, the window p - left <= j <= p + right, -1 unbounded), for an alignment sdpa cannot spell."""
    p = np.arange(nq).reshape(nq, 1) + int(offset)
    j = np.arange(nk).reshape(1, nk)
    allowed = np.ones((nq, nk), dtype=bool)
    if causal:
        allowed &= j <= p
    if left >= 0:
        allowed &= p - j <= left
    if right >= 0:
        allowed &= j - p <= right
    return allowed


def _and_mask(mask, allowed):
    """mask (None, bool or float) AND a structural bool mask, as a blocking mask (float: -inf)."""
    if mask is None:
        return allowed
    if mask.dtype == np.bool_:
        return mask & allowed
    return np.where(allowed, mask, mask.dtype.type(-np.inf))


def run_on_sdpa(node, inputs):
    """The ONNX Attention node on these inputs, through sdpa.attention.

    Returns ({output name: array}, [unsupported parts, named]): Y, present_key, present_value and
    qk_matmul_output (mode 3 only) as the node would produce them.
    """
    at = _attributes(node)
    x = _named(node.input, inputs)
    q, k, v = x["Q"], x["K"], x["V"]
    mask = x.get("attn_mask")
    past_key, past_value = x.get("past_key"), x.get("past_value")
    nonpad = x.get("nonpad_kv_seqlen")
    assert (past_key is None) == (past_value is None)
    assert nonpad is None or past_key is None, "ONNX forbids nonpad_kv_seqlen with past_key"

    three_d = q.ndim == 3
    if three_d:
        q, k, v = _to_heads(q, at["q_num_heads"]), _to_heads(k, at["kv_num_heads"]), _to_heads(v, at["kv_num_heads"])
    if past_key is not None:
        k = np.concatenate((past_key, k), axis=2)
        v = np.concatenate((past_value, v), axis=2)
    nq, nk = q.shape[2], k.shape[2]

    # A mask shorter than the total kv length is padded on the right, as the reference does:
    # False (bool) or -inf (float), i.e. the missing keys are blocked.
    if mask is not None and mask.shape[-1] < nk:
        pad = [(0, 0)] * (mask.ndim - 1) + [(0, nk - mask.shape[-1])]
        mask = np.pad(mask, pad, constant_values=False if mask.dtype == np.bool_ else -np.inf)

    # Alignment. ONNX (the reference's _apply_causal / _apply_sliding_window) puts query i at
    # position p = i + offset, offset = past_key's length with a past, nonpad_kv_seqlen[b] - Nq with
    # nonpad_kv_seqlen, 0 with neither; causal allows j <= p, the window p - left <= j <= p + right.
    # sdpa's bottom_right causal and its window (whatever `causal` is) put query i at i' = i + (L - Nq),
    # L = seqlens_k[b] (else Nk); its top_left causal allows j <= i. So with d = i' - p:
    #   nonpad, no past:  d = 0 (L = nonpad[b])      -> bottom_right with seqlens_k, window as is
    #   past:             d = Nk - Nq - past = (new kv length) - Nq: 0 when K brings as many rows
    #                     as Q -> bottom_right; else causal has no sdpa spelling (it would need
    #                     j <= i' - d): the reference's structural mask, ANDed into the mask
    #   neither:          offset 0 -> top_left (d = Nk - Nq)
    # and the window is sdpa's with its bounds shifted by d (left + d, right - d: the same integer
    # inequalities, exactly), where both stay valid (-1, or >= 0), else the structural mask.
    left, right = at["left_window_size"], at["right_window_size"]
    seqlens_k = None if nonpad is None else np.asarray(nonpad).reshape(-1)
    if nonpad is not None:
        offset, d = None, 0  # per batch, equal to sdpa's alignment
    else:
        offset = 0 if past_key is None else past_key.shape[2]
        d = (nk - nq) - offset
    causal = False
    if at["is_causal"]:
        if past_key is None and nonpad is None:
            causal = "top_left"
        elif d == 0:
            causal = "bottom_right"
        else:
            mask = _and_mask(mask, _structural_mask(nq, nk, offset, -1, -1, causal=True))
    window = None
    if left >= 0 or right >= 0:
        shifted = (left + d if left >= 0 else -1, right - d if right >= 0 else -1)
        if (left < 0 or shifted[0] >= 0) and (right < 0 or shifted[1] >= 0):
            window = shifted
        else:
            assert offset is not None
            mask = _and_mask(mask, _structural_mask(nq, nk, offset, left, right, causal=False))

    mode = at["qk_matmul_output_mode"]
    wants_qk = len(node.output) > 3 and node.output[3] != ""
    unsupported = []
    stage = None
    if wants_qk and mode != 3:
        stage = "softcapped" if mode == 0 and at["softcap"] > 0 else _STAGES[mode]

    # softmax_precision: sdpa computes 16-bit inputs in float32 (= softmax_precision FLOAT, the
    # attribute the 16-bit case here sets) and float32 inputs in float32; a DOUBLE softmax for
    # float32 inputs (test_attention_local_window_gqa_rank4_mask) is computed in float32, not
    # float64, and must still meet ONNX's tolerance against the float64-softmax golden.
    result = sdpa.attention(q, k, v, mask, causal=causal, scale=at["scale"], window=window, seqlens_k=seqlens_k,
                            softcap=at["softcap"], softcap_order="before_bias",
                            return_weights=wants_qk and mode == 3, return_scores=stage)
    y, weights = result if isinstance(result, tuple) else (result, None)
    if three_d:
        y = y.transpose(0, 2, 1, 3).reshape(y.shape[0], nq, -1)

    out = {"Y": y, "present_key": k, "present_value": v}
    if weights is not None:
        # ONNX's qk_matmul_output has the type T1 of Q; sdpa's weights are in its compute dtype
        # (float32 for 16-bit inputs): rounded once to T1 here, as the reference rounds its own.
        out["qk_matmul_output"] = weights.astype(x["Q"].dtype)  # the scores, when return_scores
    return out, unsupported


def _expected(node, inputs, outputs):
    """{output name: golden array} for the present outputs."""
    return _named(node.output, outputs)


def _assert_close(name, got, want, dtype):
    """ONNX's runner comparison (see RTOL): shapes, then allclose at ONNX's tolerances for `dtype`."""
    np.testing.assert_array_equal(got.shape, want.shape, err_msg=f"{name}: shape")
    rtol = RTOL
    if dtype.name == "bfloat16":
        rtol = max(RTOL, RTOL_BF16)
    np.testing.assert_allclose(np.asarray(got, np.float64), np.asarray(want, np.float64), rtol=rtol, atol=ATOL,
                               err_msg=name)


def _compare(got, want, names):
    """Compare the checkable outputs; present_key/present_value exactly (a concatenation)."""
    for name in names:
        w = want[name]
        g = got[name]
        assert g.dtype == w.dtype, f"{name}: dtype {g.dtype}, ONNX expects {w.dtype}"
        if name in ("present_key", "present_value"):
            np.testing.assert_array_equal(g, w, err_msg=name)
        else:
            _assert_close(name, g, w, w.dtype)


@pytest.mark.parametrize("name", sorted(CASES))
def test_case(name):
    _, node, inputs, outputs, opset = CASES[name]
    assert opset in (23, 24, 25), f"{name}: opset {opset}"
    got, unsupported = run_on_sdpa(node, inputs)
    want = _expected(node, inputs, outputs)
    checkable = [n for n in want if n in got]
    unchecked = sorted(set(want) - set(checkable))
    assert unchecked == (["qk_matmul_output"] if unsupported else []), f"{name}: outputs not compared: {unchecked}"
    _compare(got, want, checkable)

    reason = "; ".join(unsupported)
    listed = UNSUPPORTED.get(name)
    if listed is None:
        assert not unsupported, f"{name} needs {reason}: list it in UNSUPPORTED"
    else:
        assert unsupported, f"{name} is listed in UNSUPPORTED ({listed}) but sdpa checks all of it: unlist it"
        assert listed == reason, f"{name}: UNSUPPORTED says {listed!r}, the case needs {reason!r}"
        pytest.skip(f"Y and present K/V match; not checked: {listed}")


def test_lists_name_real_cases():
    assert len(CASES) > 0
    assert set(UNSUPPORTED) <= set(CASES), sorted(set(UNSUPPORTED) - set(CASES))
