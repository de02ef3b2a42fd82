"""``sdpa.MultiHeadAttention``: the multi-head attention layer on NumPy arrays, with its backward
and incremental decoding, computed by sdpa's C++ layer (``sdpa/mha.h``: OpenBLAS products and
the fused kernel)::

    layer = sdpa.MultiHeadAttention(d_model=512, num_heads=8, num_kv_heads=2, rope=True)
    y = layer(x, causal=True)                  # x (B, N, d_model) -> y (B, N, d_model)
    g = layer.backward(dy)                     # gradients of the last forward: g.x_q, g.w_q, ...
    layer.w_q -= lr * g.w_q                    # the parameters are plain arrays

    cache = layer.new_cache(num_pages=64, page_size=16)
    s = cache.new_sequence()
    y = layer.step(x_prompt, cache, [s])       # (1, n, d_model): appends the tokens, attends causally
    y = layer.step(x_next, cache, [s])         # one more token: equal to the full forward's last row

Shapes (E = d_model, Dk = head_dim, Dv = head_dim_v)::

    x_q  (B, Nq, E)        x_k (B, Nk, kdim), x_v (B, Nk, vdim): None = x_q (self-attention)
    w_q  (E, Hq·Dk)        b_q (Hq·Dk,)       q = x_q @ w_q + b_q; column h·Dk + d is head h's d
    w_k  (kdim, Hkv·Dk)    b_k (Hkv·Dk,)      query head h reads kv head h // (Hq // Hkv)
    w_v  (vdim, Hkv·Dv)    b_v (Hkv·Dv,)
    w_o  (Hq·Dv, E)        b_o (E,)           y = concat(heads) @ w_o + b_o
    mask as sdpa.attention's, broadcasting to (B, Hq, Nq, Nk); weights (B, Hq, Nq, Nk)

The weights act on the right (x @ w): a torch ``Linear``'s weight is the transpose. RoPE
(``rope=True``) rotates q and k per head in the rotate-half form (GPT-NeoX, Llama): element d
pairs with d + Dk/2, angle (position) · rope_base^(-2d/Dk), query row i at position_q + i, key
row j at position_k + j. Parameters start as ``torch.nn.MultiheadAttention``'s do (Xavier-uniform
input projections, drawn as one (3E × E) matrix when all three are E × E as torch's
in_proj_weight is; uniform ±1/sqrt(Hq·Dv) output projection; zero biases), from ``seed`` (None:
fresh entropy).

dtype: float32, float64, ``ml_dtypes.bfloat16`` or float16: the parameters', and the inputs',
outputs' and gradients' (inputs of other dtypes are converted to it). A bfloat16 or float16
layer computes in float32, its products float32 GEMMs on the exactly widened values, and
rounds once where it stores a value, as PyTorch's 16-bit layer does: q, k and v after the
projection and RoPE, the heads' output (the kernel's), y; in the backward the heads' gradient,
dq, dk, dv (the kernel's) and each gradient (``sdpa/mha.h`` lists them). ``precision`` ("exact"
or "fast", None: the enclosing ``sdpa.precision(...)`` block's) is the kernel's, as in
``sdpa.attention``; float32 and float64 layers ignore it. ``weights`` are float32 for a 16-bit
layer (the kernel's compute dtype), as ``sdpa.attention``'s.
"""

from __future__ import annotations

from typing import NamedTuple, Optional

import numpy as np

from . import _core, KVCache
from ._arrays import _core_view, _empty, _prepared, _prepared_mask, _sequence_ids
from ._args import (_STORAGE_NAME, _checked_int, _compute_dtype, _dtype_arg, _generator, _parsed_dropout,
                    _parsed_options, _precision_arg, _real_array, _real_number)

__all__ = ["MultiHeadAttention", "LayerGradients"]

_PARAMS = ("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o")


class LayerGradients(NamedTuple):
    """The gradients of one forward: of the inputs (x_k None when the forward had none: its part
    is in x_q; x_v None likewise, its part in x_k) and of every parameter (biases None without
    bias)."""
    x_q: np.ndarray
    x_k: Optional[np.ndarray]
    x_v: Optional[np.ndarray]
    w_q: np.ndarray
    w_k: np.ndarray
    w_v: np.ndarray
    w_o: np.ndarray
    b_q: Optional[np.ndarray]
    b_k: Optional[np.ndarray]
    b_v: Optional[np.ndarray]
    b_o: Optional[np.ndarray]


class MultiHeadAttention:
    """The multi-head attention layer (see the module's docstring for shapes)."""

    def __init__(self, d_model, num_heads, *, num_kv_heads=None, head_dim=None, head_dim_v=None, kdim=None,
                 vdim=None, bias=True, rope=False, rope_base=10000.0, dtype=np.float32, seed=None):
        self.dtype = _dtype_arg("dtype", dtype, _STORAGE_NAME, "float32, float64, float16 or ml_dtypes.bfloat16")
        optional = (("num_kv_heads", num_kv_heads), ("head_dim", head_dim), ("head_dim_v", head_dim_v), ("kdim", kdim),
                    ("vdim", vdim))
        config = (_checked_int("d_model", d_model, 1), _checked_int("num_heads", num_heads, 1),
                  *(0 if n is None else _checked_int(name, n, 1) for name, n in optional),  # 0: the layer's default
                  bool(bias), bool(rope), _real_number("rope_base", rope_base))
        self._config = _core.mha_resolved(config)  # defaults filled in and checked by the C++ layer
        (self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim_v, self.kdim, self.vdim,
         self.bias, self.rope, self.rope_base) = self._config
        E, Hq, Hkv, Dk, Dv = self.d_model, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim_v
        rng = _generator(seed)
        self._rng = rng  # dropout seeds when none is given

        def uniform(shape, bound):
            return rng.uniform(-bound, bound, size=shape).astype(self.dtype)

        xavier = [(E, Hq * Dk), (self.kdim, Hkv * Dk), (self.vdim, Hkv * Dv)]
        packed = all(s == (E, E) for s in xavier)  # torch's one (3E × E) in_proj_weight
        self.w_q, self.w_k, self.w_v = (uniform(s, np.sqrt(6.0 / (s[0] + (3 * E if packed else s[1]))))
                                        for s in xavier)
        self.w_o = uniform((Hq * Dv, E), 1.0 / np.sqrt(Hq * Dv))
        zeros = (lambda n: np.zeros(n, self.dtype)) if self.bias else (lambda n: None)
        self.b_q, self.b_k, self.b_v, self.b_o = zeros(Hq * Dk), zeros(Hkv * Dk), zeros(Hkv * Dv), zeros(E)
        self._last = None

    def parameters(self):
        """{name: array} of the parameters (biases only with bias)."""
        return {n: getattr(self, n) for n in _PARAMS if getattr(self, n) is not None}

    def _params(self):
        """The parameters as the layer's dtype, as _core takes them (_core_view)."""
        out = []
        for name in _PARAMS:
            a = getattr(self, name)
            out.append(None if a is None else _core_view(_prepared(name, _real_array(name, a), self.dtype)))
        return out

    def _inputs(self, x_q, x_k, x_v, q_name="x_q"):
        """The inputs as the layer's dtype (3 dims, real numbers); q_name: what the caller calls x_q."""
        arrays = []
        for name, a in ((q_name, x_q), ("x_k", x_k), ("x_v", x_v)):
            if a is None:
                arrays.append(None)
                continue
            a = _real_array(name, a)
            if a.ndim != 3:
                raise ValueError(f"{name} has shape {a.shape}, expected 3 dims (B, N, width)")
            arrays.append(_core_view(_prepared(name, a, self.dtype)))
        if arrays[2] is not None and arrays[1] is None:
            raise ValueError("x_v needs x_k (cross-attention takes x_k, and x_v unless it is x_k)")
        return arrays

    def forward(self, x_q, x_k=None, x_v=None, *, mask=None, causal=False, scale=None, window=None, dropout_p=0.0,
                seed=None, position_q=0, position_k=0, need_weights=False, backend="auto", precision=None):
        """y (B, Nq, d_model), or (y, weights (B, Hq, Nq, Nk)) with need_weights. Options as
        ``sdpa.attention``'s (causal False/True (bottom-right)/"top_left", window, mask, scale,
        dropout_p with seed: drawn from the layer's generator when not given, and reused by
        ``backward``; precision, None: the ``sdpa.precision(...)`` block's, and reused by
        ``backward``). Remembers what ``backward`` needs."""
        x_q, x_k, x_v = self._inputs(x_q, x_k, x_v)
        B, Nq = x_q.shape[:2]
        Nk = x_k.shape[1] if x_k is not None else Nq
        compute = _compute_dtype(self.dtype)
        causal_code, scale, left, right = _parsed_options(causal, scale, window, backend, compute)
        precision = _precision_arg(precision)
        positions = _checked_int("position_q", position_q), _checked_int("position_k", position_k)
        if seed is None and isinstance(dropout_p, (int, float)) and dropout_p > 0:
            seed = int(self._rng.integers(0, 2**62))
        dropout_p, seed = _parsed_dropout(dropout_p, seed)
        if mask is not None:
            mask = _prepared_mask(mask, self.dtype, (B, self.num_heads, Nq, Nk))
        y = _empty("y", (B, Nq, self.d_model), self.dtype)
        weights = _empty("weights", (B, self.num_heads, Nq, Nk), compute) if need_weights else None
        params = self._params()
        saved = _core.MultiHeadSaved()
        options = (scale, causal_code, left, right, backend, dropout_p, seed, precision)
        _core.mha_forward(self._config, params, x_q, x_k, x_v, _core_view(mask), *positions, _core_view(y), weights,
                          saved, *options)
        self._last = (params, x_q, x_k, x_v, mask, *positions, saved, options)
        return (y, weights) if need_weights else y

    __call__ = forward

    def backward(self, dy):
        """The gradients (``LayerGradients``) of the last forward for dy = ∂loss/∂y (B, Nq, d_model).
        It reads the parameter and input arrays that forward read: change them in place only
        after it."""
        if self._last is None:
            raise RuntimeError("backward needs a forward first")
        params, x_q, x_k, x_v, mask, pos_q, pos_k, saved, options = self._last
        dy = _core_view(_prepared("dy", _real_array("dy", dy), self.dtype))
        grads = [np.empty(x.shape, self.dtype) if x is not None else None for x in (x_q, x_k, x_v)]
        grads += [None if p is None else np.empty(p.shape, self.dtype) for p in params]
        _core.mha_backward(self._config, params, x_q, x_k, x_v, _core_view(mask), pos_q, pos_k, saved, dy,
                           [_core_view(g) for g in grads], *options)
        return LayerGradients(*grads)

    def new_cache(self, num_pages, page_size):
        """An empty ``sdpa.KVCache`` for this layer's keys and values (num_pages pages of page_size tokens)."""
        return KVCache(num_pages, page_size, self.num_kv_heads, self.head_dim, self.head_dim_v, self.dtype)

    def step(self, x, cache, seqs, *, scale=None, window=None, backend="auto", precision=None):
        """Incremental decoding: x (B, n, d_model) are the next n tokens of cache sequences seqs[b].
        Projects them, applies RoPE at their positions (the sequences' lengths so far), appends
        their keys and values to the cache and attends causally (each token sees the cache up to
        itself): y (B, n, d_model), equal to the causal forward of the whole sequences' rows.
        seqs: one id, or a list, tuple or 1-dim array of integer ids, as ``KVCache.attention``
        takes them (a float such as 1.0, or a bool, is a TypeError, never truncated). precision as
        ``forward``'s; the cache has the layer's dtype (``new_cache``)."""
        x = self._inputs(x, None, None, q_name="x")[0]
        seqs = _sequence_ids(seqs, "x")
        if not isinstance(cache, KVCache):
            raise TypeError(f"cache must be an sdpa.KVCache, got {type(cache).__name__}")
        _, scale, left, right = _parsed_options(False, scale, window, backend, _compute_dtype(self.dtype))
        precision = _precision_arg(precision)
        y = _empty("y", x.shape[:2] + (self.d_model,), self.dtype)
        _core.mha_step(self._config, self._params(), x, cache._c, seqs, _core_view(y), scale, left, right, backend,
                       precision)
        return y
