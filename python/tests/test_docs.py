"""help(sdpa.attention) documents every shape, the default scale, and draws both causal
alignments for Nq < Nk and Nq > Nk; each picture is checked against what attention blocks."""

import re

import numpy as np
import pytest

import sdpa

DOC = sdpa.attention.__doc__


@pytest.mark.parametrize("pattern", [
    r"q\s+\(B, Hq,\s+Nq, Dk\)", r"k\s+\(B, Hkv, Nk, Dk\)", r"v\s+\(B, Hkv, Nk, Dv\)",
    r"\(Hq, Nq, Dk\)", r"\(Nq, Dk\)",  # the 3- and 2-dim forms
    r"mask\s+broadcastable to \(B, Hq, Nq, Nk\)",
    r"out\s+\(B, Hq, Nq, Dv\)", r"weights\s+\(B, Hq, Nq, Nk\)", r"lse\s+\(B, Hq, Nq\)",
    r"scale: multiplies q·k; default 1 / sqrt\(Dk\)",
])
def test_docstring_documents_shapes_and_default_scale(pattern):
    assert re.search(pattern, DOC), pattern


def _pictures(doc):
    """{(Nq, Nk): {"bottom_right": bool (Nq, Nk), "top_left": ...}} from the docstring's
    causal drawings: a header naming Nq and Nk, then rows 'qi  x . ...  qi  x . ...'."""
    pictures = {}
    lines = doc.splitlines()
    for n, line in enumerate(lines):
        m = re.search(r"Nq=(\d+), Nk=(\d+)", line)
        if not m:
            continue
        nq, nk = int(m.group(1)), int(m.group(2))
        rows = []
        for row in lines[n + 1:]:
            cells = re.fullmatch(r"\s*q(\d+)((?:\s+[x.])+)\s+q(\d+)((?:\s+[x.])+)\s*", row)
            if cells:
                assert int(cells.group(1)) == int(cells.group(3)) == len(rows), row
                rows.append([cells.group(2).split(), cells.group(4).split()])
            elif rows:
                break  # the picture ended
        if not rows:
            continue  # a mention of Nq, Nk without a picture
        assert len(rows) == nq and all(len(r[0]) == len(r[1]) == nk for r in rows), (nq, nk)
        pictures[(nq, nk)] = {
            "bottom_right": np.array([[c == "x" for c in r[0]] for r in rows]),
            "top_left": np.array([[c == "x" for c in r[1]] for r in rows]),
        }
    return pictures


def test_docstring_draws_both_alignments_for_nq_below_and_above_nk():
    shapes = set(_pictures(DOC))
    assert any(nq < nk for nq, nk in shapes), shapes
    assert any(nq > nk for nq, nk in shapes), shapes
    assert "bottom_right (True)" in DOC and "top_left" in DOC


@pytest.mark.parametrize("backend", ["auto", "reference"])
def test_docstring_pictures_are_what_attention_blocks(backend):
    pictures = _pictures(DOC)
    assert len(pictures) >= 2
    rng = np.random.default_rng(0)
    for (nq, nk), drawn in pictures.items():
        q, k, v = rng.standard_normal((nq, 4)), rng.standard_normal((nk, 4)), rng.standard_normal((nk, 3))
        for causal, allowed in (("bottom_right", drawn["bottom_right"]), (True, drawn["bottom_right"]),
                                ("top_left", drawn["top_left"])):
            out, weights, lse = sdpa.attention(q, k, v, causal=causal, return_weights=True, return_lse=True,
                                               backend=backend)
            np.testing.assert_array_equal(weights != 0, allowed, err_msg=f"Nq={nq}, Nk={nk}, causal={causal!r}")
            empty = ~allowed.any(axis=1)
            # Rows the picture leaves without any key: zeros out and lse = -inf, as documented.
            assert (out[empty] == 0).all() and (lse[empty] == -np.inf).all()
            assert np.isfinite(lse[~empty]).all()
    # The Nq > Nk picture does have such rows under bottom_right (the case it exists for).
    assert any(not p["bottom_right"].any(axis=1).all() for (nq, nk), p in pictures.items() if nq > nk)
