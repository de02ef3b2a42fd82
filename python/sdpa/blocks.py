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

import numbers

import numpy as np

__all__ = ["block_mask_bigbird", "block_mask_dilated", "block_mask_from_mask", "document_mask",
           "block_mask_documents"]


def _sizes(block_size):
    pair = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    if len(pair) != 2 or any(isinstance(b, bool) or not isinstance(b, numbers.Integral) or b < 1 for b in pair):
        raise ValueError(f"block_size must be a positive int or a pair of them (bq, bk), got {block_size!r}")
    return int(pair[0]), int(pair[1])


def _count(name, n):
    if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
        raise ValueError(f"{name} must be a non-negative int, got {n!r}")
    return int(n)


def _blocks(nq, nk, block_size):
    bq, bk = _sizes(block_size)
    nq, nk = _count("nq", nq), _count("nk", nk)
    return -(-nq // bq), -(-nk // bk)


def block_mask_bigbird(nq, nk, *, block_size=128, window=3, global_blocks=1, random_blocks=0, seed=0):
    """BigBird's pattern (Zaheer et al. 2020) over nq queries and nk keys: each query block sees
    the ``window`` key blocks centred on its own index (window odd; 0 for none), the first
    ``global_blocks`` key blocks (global tokens) and ``random_blocks`` other key blocks drawn
    with ``np.random.default_rng(seed)``; the first ``global_blocks`` query blocks see every key
    block. Returns a (QB, KB) bool array."""
    QB, KB = _blocks(nq, nk, block_size)
    for name, x in (("window", window), ("global_blocks", global_blocks), ("random_blocks", random_blocks)):
        _count(name, x)
    if window % 2 == 0 and window != 0:
        raise ValueError(f"window must be odd (centred on the query block) or 0, got {window}")
    qi = np.arange(QB)[:, None]
    kj = np.arange(KB)[None, :]
    bm = np.abs(qi - kj) <= window // 2 if window else np.zeros((QB, KB), bool)
    bm[:, :global_blocks] = True
    bm[:global_blocks, :] = True
    rng = np.random.default_rng(seed)
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
    if isinstance(dilation, bool) or not isinstance(dilation, numbers.Integral) or dilation < 1:
        raise ValueError(f"dilation must be a positive int, got {dilation!r}")
    diff = np.arange(QB)[:, None] - np.arange(KB)[None, :]
    bm = diff % dilation == 0
    if window is not None:
        bm &= np.abs(diff) <= _count("window", window)
    return bm


def block_mask_from_mask(mask, block_size=128):
    """The block mask of an element mask: a block is True when it holds a key the mask lets
    some query see (a bool mask's True, a float mask's value above -inf). mask: (…, Nq, Nk);
    returns (…, QB, KB). With both passed to ``attention``, the result is the mask's alone and
    the kernels skip the empty blocks."""
    bq, bk = _sizes(block_size)
    m = np.asarray(mask)
    if m.ndim < 2:
        raise ValueError(f"mask must have at least 2 dims (…, Nq, Nk), got shape {m.shape}")
    allowed = m if m.dtype == np.bool_ else m > -np.inf
    *lead, nq, nk = allowed.shape
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
    bq, bk = _sizes(block_size)
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
