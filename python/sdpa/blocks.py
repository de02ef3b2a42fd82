"""Builders of ``block_mask`` for ``sdpa.attention``'s block-sparse attention.

A block mask is a bool array of shape (…, QB, KB) with QB = ceil(Nq / bq) and KB = ceil(Nk / bk)
for block_size = (bq, bk): block (qi, kj) holds queries qi·bq … qi·bq + bq - 1 and keys
kj·bk … kj·bk + bk - 1, and False there blocks those keys for those queries. Each builder
returns a (QB, KB) array (add leading dims with NumPy to vary it per batch or head)::

    bm = sdpa.block_mask_bigbird(4096, 4096, block_size=128, window=3, global_blocks=1,
                                 random_blocks=2, seed=0)
    out = sdpa.attention(q, k, v, block_mask=bm, block_size=128)

A pattern that is not made of whole blocks (documents packed into one sequence) is an element
mask plus the block mask of its non-empty blocks: the element mask keeps the result exact, the
block mask lets the kernels skip what is empty::

    mask = sdpa.document_mask(doc_ids)                 # (N, N) bool
    out = sdpa.attention(q, k, v, mask, block_mask=sdpa.block_mask_from_mask(mask, 128))
"""

from __future__ import annotations

import numpy as np

from ._arrays import _check_fits, _check_mask_dtype
from ._args import _asarray, _block_sizes, _checked_int, _generator

__all__ = ["block_mask_bigbird", "block_mask_dilated", "block_mask_from_mask", "document_mask",
           "block_mask_documents"]


def _blocks(nq, nk, block_size):
    """(QB, KB) for nq queries and nk keys, refused by name when the (QB, KB) mask cannot fit."""
    bq, bk = _block_sizes(block_size, low=1)
    nq, nk = _checked_int("nq", nq, 0), _checked_int("nk", nk, 0)
    shape = (-(-nq // bq), -(-nk // bk))
    _check_fits("the block mask would have", shape, np.bool_)
    return shape


def block_mask_bigbird(nq, nk, *, block_size=128, window=3, global_blocks=1, random_blocks=0, seed=0):
    """BigBird's pattern (Zaheer et al. 2020) over nq queries and nk keys: each query block sees
    the ``window`` key blocks centred on its own index (window odd; 0 for none), the first
    ``global_blocks`` key blocks (global tokens) and ``random_blocks`` other key blocks drawn
    with ``np.random.default_rng(seed)``; the first ``global_blocks`` query blocks see every key
    block. Returns a (QB, KB) bool array."""
    QB, KB = _blocks(nq, nk, block_size)
    window, global_blocks, random_blocks = (_checked_int(name, x, 0) for name, x in (
        ("window", window), ("global_blocks", global_blocks), ("random_blocks", random_blocks)))
    rng = _generator(seed)
    if window % 2 == 0 and window != 0:
        raise ValueError(f"window must be odd (centred on the query block) or 0, got {window}")
    qi = np.arange(QB)[:, None]
    kj = np.arange(KB)[None, :]
    bm = np.abs(qi - kj) <= window // 2 if window else np.zeros((QB, KB), bool)
    bm[:, :global_blocks] = True
    bm[:global_blocks, :] = True
    for row in bm:
        free = np.flatnonzero(~row)
        if free.size and random_blocks:
            row[rng.choice(free, size=min(random_blocks, free.size), replace=False)] = True
    return bm


def block_mask_dilated(nq, nk, *, block_size=128, dilation=2, window=None):
    """Dilated blocks (LongNet-style): query block qi sees key block kj when (qi - kj) is a
    multiple of ``dilation``, and, with ``window`` (in blocks), when also |qi - kj| <= window.
    Returns a (QB, KB) bool array."""
    QB, KB = _blocks(nq, nk, block_size)
    dilation = _checked_int("dilation", dilation, 1)
    diff = np.arange(QB)[:, None] - np.arange(KB)[None, :]
    bm = diff % dilation == 0
    if window is not None:
        bm &= np.abs(diff) <= _checked_int("window", window, 0)
    return bm


def block_mask_from_mask(mask, block_size=128):
    """The block mask of an element mask: a block is True when it holds a key the mask lets
    some query see (a bool mask's True, a float mask's value above -inf). mask: (…, Nq, Nk);
    returns (…, QB, KB). With both passed to ``attention``, the result is the mask's alone and
    the kernels skip the empty blocks."""
    bq, bk = _block_sizes(block_size, low=1)
    m = _asarray("mask", mask)
    _check_mask_dtype("mask", m)  # attention's rule: an integer 0/1 mask is not read as all True
    if m.ndim < 2:
        raise ValueError(f"mask must have at least 2 dims (…, Nq, Nk), got shape {m.shape}")
    allowed = m if m.dtype == np.bool_ else m > -np.inf
    *lead, nq, nk = allowed.shape
    # A block larger than the mask holds all of it: the same blocks, and padding of at most nq, nk.
    bq, bk = min(bq, max(nq, 1)), min(bk, max(nk, 1))
    QB, KB = -(-nq // bq), -(-nk // bk)
    padded = np.zeros((*lead, QB * bq, KB * bk), bool)
    padded[..., :nq, :nk] = allowed
    return padded.reshape(*lead, QB, bq, KB, bk).any(axis=(-3, -1))


def document_mask(doc_q, doc_k=None):
    """The element mask of packed documents: query i sees key j when they belong to the same
    document, doc_q[i] == doc_k[j] (doc_k defaults to doc_q, self-attention). Returns an
    (Nq, Nk) bool array; add ``causal=`` in ``attention`` for causal documents."""
    dq = np.asarray(doc_q)
    dk = dq if doc_k is None else np.asarray(doc_k)
    if dq.ndim != 1 or dk.ndim != 1:
        raise ValueError(f"doc_q and doc_k must be 1-D document ids, got shapes {dq.shape} and {dk.shape}")
    return dq[:, None] == dk[None, :]


def block_mask_documents(doc_q, doc_k=None, *, block_size=128):
    """``block_mask_from_mask(document_mask(doc_q, doc_k), block_size)`` without the (Nq, Nk)
    mask: block (qi, kj) is True when a document has a query in qi and a key in kj."""
    bq, bk = _block_sizes(block_size, low=1)
    dq = np.asarray(doc_q)
    dk = dq if doc_k is None else np.asarray(doc_k)
    if dq.ndim != 1 or dk.ndim != 1:
        raise ValueError(f"doc_q and doc_k must be 1-D document ids, got shapes {dq.shape} and {dk.shape}")
    docs, inverse = np.unique(np.concatenate([dq, dk]), return_inverse=True)
    iq, ik = inverse[:dq.size], inverse[dq.size:]
    QB, KB = -(-dq.size // bq), -(-dk.size // bk)
    in_q = np.zeros((QB, docs.size), bool)
    in_k = np.zeros((KB, docs.size), bool)
    in_q[np.arange(dq.size) // bq, iq] = True
    in_k[np.arange(dk.size) // bk, ik] = True
    return (in_q.astype(np.int64) @ in_k.T.astype(np.int64)) > 0
