"""``sdpa.torch.MultiheadAttention``: ``torch.nn.MultiheadAttention``'s module on sdpa's kernel.

    mha = sdpa.torch.MultiheadAttention(embed_dim, num_heads, dropout=0.0, bias=True, kdim=None,
                                        vdim=None, batch_first=False,
                                        num_kv_heads=None, rope=False, rope_base=10000.0)
    y, weights = mha(query, key, value, key_padding_mask=None, need_weights=True, attn_mask=None,
                     average_attn_weights=True, is_causal=False)
    mha.load_state_dict(torch_mha.state_dict())   # a torch.nn.MultiheadAttention's, unchanged

The constructor, the forward's signature and the parameters (``in_proj_weight``/``in_proj_bias``,
or ``q_proj_weight``/``k_proj_weight``/``v_proj_weight`` when kdim or vdim differ from
embed_dim, ``out_proj``) are torch's, so a state_dict moves either way. The projections are
torch's own ``F.linear``; the attention is sdpa's torch operator (``torch.ops.sdpa.attention``: sdpa's
kernel, autograd through sdpa's backward), reading q, k, v as (B, H, N, D) tensors made
head-major (contiguous) from the projections by one copy each: the kernel reads that layout
~15 % faster than the transposed views (docs/PERFORMANCE.md). Differences from torch:

- ``add_bias_kv`` and ``add_zero_attn`` raise ValueError (not supported).
- ``need_weights`` returns the softmax before dropout (torch's are after it), computed by a
  second sdpa call (the operator ``torch.ops.sdpa.attention_weights``, so ``torch.compile``
  traces it without a graph break), without gradient.
- ``is_causal=True`` applies the causal mask in the kernel, which then skips the tiles above
  the diagonal: without ``attn_mask`` (torch asks for the mask too), or with it, which torch
  documents as a hint that it is the causal mask: it is not read then (torch reads it when a
  key_padding_mask or need_weights is given). A key_padding_mask applies on top.
- A query row that every mask blocks gives zeros (torch's module gives NaN there), and zero
  gradients.
- Masks are bool or floating point; other dtypes raise TypeError.
- Extra keyword options: ``num_kv_heads`` (GQA/MQA: k_proj_weight and v_proj_weight are
  (num_kv_heads · head_dim, kdim/vdim), and in_proj_bias holds E + 2 · num_kv_heads · head_dim),
  ``rope`` with ``rope_base`` (rotary embedding on q and k as ``sdpa.MultiHeadAttention``'s,
  positions from ``position_q`` / ``position_k`` given to forward); forward's ``precision``
  (as in ``sdpa.attention``; None takes the enclosing ``sdpa.precision(...)`` block's).
- ``step(x, cache, seqs)`` decodes incrementally with an ``sdpa.KVCache`` (``new_cache``).

In bfloat16 or float16 (``dtype=``, or ``.to(torch.bfloat16)``): parameters, activations and
gradients in that dtype; the projections are torch's ``F.linear`` in it (float32 sums, rounded
once), RoPE is computed in float32 and rounded once (q and k are rounded after the projection and
again after RoPE), the attention is sdpa's kernel on the 16-bit q, k, v with ``precision``
("exact" by default, or "fast"), the output projection torch's again. The C++ layer
(``sdpa.MultiHeadAttention``, ``step``) rounds q and k once, after RoPE.
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F
from torch.nn.parameter import Parameter

from ._arrays import _core_view, _sequence_ids
from ._args import _checked_int, _numpy_of_tensor, _precision_arg, _real_number, _tensor_of_numpy
from .torch import _attention, _check_tensors, _options

_attention_weights = torch.ops.sdpa.attention_weights.default

__all__ = ["MultiheadAttention"]


def _rope(x, position, base):
    """RoPE on x (B, N, H, D) (rotate-half: element d pairs with d + D/2), row i at position + i.
    The angles are computed in float64 and rounded to the compute dtype once: x's, or float32 for
    a 16-bit x, whose result is rounded once to its dtype (as the C++ layer's)."""
    N, D = x.shape[1], x.shape[3]
    half = D // 2
    dtype = x.dtype
    if dtype in (torch.bfloat16, torch.float16):
        x = x.float()
    pos = torch.arange(position, position + N, dtype=torch.float64)
    freq = base ** (-2.0 * torch.arange(half, dtype=torch.float64) / D)
    theta = pos[:, None] * freq[None, :]  # (N, D/2)
    c = torch.cos(theta).to(x.dtype)[None, :, None, :]
    s = torch.sin(theta).to(x.dtype)[None, :, None, :]
    x1, x2 = x[..., :half], x[..., half:]
    return torch.cat((x1 * c - x2 * s, x2 * c + x1 * s), dim=-1).to(dtype)


def _merged_mask(attn_mask, key_padding_mask, B, H, L, S, dtype):
    """torch.nn.MultiheadAttention's attn_mask ((L, S) or (B·H, L, S); bool True = blocked, or a
    float added) and key_padding_mask ((B, S); bool True = padding, or a float added) as one
    mask for scaled_dot_product_attention (bool True = attends, or a float added), broadcasting
    to (B, H, L, S); None when both are None."""
    masks = []
    if attn_mask is not None:
        if attn_mask.dim() == 2:
            if attn_mask.shape != (L, S):
                raise RuntimeError(f"attn_mask has shape {tuple(attn_mask.shape)}, expected (L, S) = {(L, S)}")
            am = attn_mask.reshape(1, 1, L, S)
        elif attn_mask.dim() == 3:
            if attn_mask.shape != (B * H, L, S):
                raise RuntimeError(f"attn_mask has shape {tuple(attn_mask.shape)}, expected "
                                   f"(B·num_heads, L, S) = {(B * H, L, S)}")
            am = attn_mask.reshape(B, H, L, S)
        else:
            raise RuntimeError(f"attn_mask has {attn_mask.dim()} dims, expected 2 or 3")
        masks.append(am)
    if key_padding_mask is not None:
        if key_padding_mask.shape != (B, S):
            raise RuntimeError(f"key_padding_mask has shape {tuple(key_padding_mask.shape)}, expected (B, S) = {(B, S)}")
        masks.append(key_padding_mask.reshape(B, 1, 1, S))
    if not masks:
        return None
    for name, m in zip(("attn_mask", "key_padding_mask"), (attn_mask, key_padding_mask)):
        if m is not None and m.dtype != torch.bool and not m.is_floating_point():
            raise TypeError(f"{name} has dtype {m.dtype}; it must be bool or floating point")
    if all(m.dtype == torch.bool for m in masks):
        allowed = ~masks[0]
        for m in masks[1:]:
            allowed = allowed & ~m
        return allowed
    total = None
    for m in masks:
        bias = (torch.zeros(m.shape, dtype=dtype).masked_fill(m, -math.inf) if m.dtype == torch.bool
                else m.to(dtype))
        total = bias if total is None else total + bias
    return total


class _MergeHeads(torch.autograd.Function):
    """(B, H, L, D) -> (B, L, H·D) for the output projection (a copy, as a reshape would make).
    Its backward hands sdpa's kernel the gradient head-major (contiguous (B, H, L, D)): the
    reshape's own backward would give a transposed view whose rows lie H·D apart, which the
    kernel reads ~15 % slower (docs/PERFORMANCE.md)."""

    @staticmethod
    def forward(ctx, x):
        B, H, L, D = x.shape
        ctx.shape = (B, H, L, D)
        return x.transpose(1, 2).reshape(B, L, H * D)

    @staticmethod
    def backward(ctx, grad):
        B, H, L, D = ctx.shape
        return grad.reshape(B, L, H, D).transpose(1, 2).contiguous()


class MultiheadAttention(torch.nn.Module):
    """torch.nn.MultiheadAttention on sdpa's kernel (see the module docstring)."""

    __constants__ = ["batch_first"]

    def __init__(self, embed_dim, num_heads, dropout=0.0, bias=True, add_bias_kv=False, add_zero_attn=False,
                 kdim=None, vdim=None, batch_first=False, device=None, dtype=None, *, num_kv_heads=None, rope=False,
                 rope_base=10000.0):
        super().__init__()
        if add_bias_kv or add_zero_attn:
            raise ValueError("sdpa.torch.MultiheadAttention does not support add_bias_kv or add_zero_attn")
        # sdpa's rule for integer and real-number arguments (sdpa.MultiHeadAttention's): a float,
        # a str or a bool is TypeError, an integer beyond int64 ValueError, each naming it.
        embed_dim, num_heads = _checked_int("embed_dim", embed_dim, 1), _checked_int("num_heads", num_heads, 1)
        kdim, vdim, num_kv_heads = (None if n is None else _checked_int(name, n, 1)
                                    for name, n in (("kdim", kdim), ("vdim", vdim), ("num_kv_heads", num_kv_heads)))
        if embed_dim % num_heads != 0:
            raise ValueError(f"embed_dim ({embed_dim}) must be a positive multiple of num_heads ({num_heads})")
        f = {"device": device, "dtype": dtype}
        self.embed_dim = embed_dim
        self.kdim = kdim if kdim is not None else embed_dim
        self.vdim = vdim if vdim is not None else embed_dim
        self.num_heads = num_heads
        self.num_kv_heads = num_heads if num_kv_heads is None else num_kv_heads
        if self.num_kv_heads <= 0 or num_heads % self.num_kv_heads != 0:
            raise ValueError(f"num_kv_heads ({self.num_kv_heads}) must divide num_heads ({num_heads})")
        self.head_dim = embed_dim // num_heads
        if rope and self.head_dim % 2:
            raise ValueError(f"rope needs an even head_dim, got {self.head_dim}")
        self.dropout = dropout
        self.batch_first = batch_first
        self.rope, self.rope_base = bool(rope), _real_number("rope_base", rope_base)
        kv = self.num_kv_heads * self.head_dim
        self._qkv_same_embed_dim = self.kdim == embed_dim and self.vdim == embed_dim and kv == embed_dim
        if self._qkv_same_embed_dim:
            self.in_proj_weight = Parameter(torch.empty((3 * embed_dim, embed_dim), **f))
            for name in ("q_proj_weight", "k_proj_weight", "v_proj_weight"):
                self.register_parameter(name, None)
        else:
            self.q_proj_weight = Parameter(torch.empty((embed_dim, embed_dim), **f))
            self.k_proj_weight = Parameter(torch.empty((kv, self.kdim), **f))
            self.v_proj_weight = Parameter(torch.empty((kv, self.vdim), **f))
            self.register_parameter("in_proj_weight", None)
        if bias:
            self.in_proj_bias = Parameter(torch.empty(embed_dim + 2 * kv, **f))
        else:
            self.register_parameter("in_proj_bias", None)
        self.out_proj = torch.nn.Linear(embed_dim, embed_dim, bias=bias, **f)
        self.bias_k = self.bias_v = None
        self.add_zero_attn = False
        self._reset_parameters()

    def _reset_parameters(self):
        """torch.nn.MultiheadAttention's initialisation."""
        if self._qkv_same_embed_dim:
            torch.nn.init.xavier_uniform_(self.in_proj_weight)
        else:
            for w in (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight):
                torch.nn.init.xavier_uniform_(w)
        if self.in_proj_bias is not None:
            torch.nn.init.constant_(self.in_proj_bias, 0.0)
            torch.nn.init.constant_(self.out_proj.bias, 0.0)

    def _projections(self):
        """(w_q, w_k, w_v), (b_q, b_k, b_v) as F.linear takes them (views, no copies)."""
        E, kv = self.embed_dim, self.num_kv_heads * self.head_dim
        if self._qkv_same_embed_dim:
            w = (self.in_proj_weight[:E], self.in_proj_weight[E:2 * E], self.in_proj_weight[2 * E:])
        else:
            w = (self.q_proj_weight, self.k_proj_weight, self.v_proj_weight)
        b = self.in_proj_bias
        biases = (None, None, None) if b is None else (b[:E], b[E:E + kv], b[E + kv:])
        return w, biases

    def _heads(self, x, w, b, heads, rope_position):
        """x (B, N, width) projected to (B, heads, N, head_dim), RoPE'd if asked, head-major
        (contiguous): one copy, which the kernel repays by reading it ~15 % faster than the
        transposed view, whose rows lie heads·head_dim apart (docs/PERFORMANCE.md)."""
        B, N = x.shape[:2]
        return self._head_major(F.linear(x, w, b).view(B, N, heads, self.head_dim), rope_position)

    def _head_major(self, h, rope_position):
        """(B, N, heads, head_dim) RoPE'd if asked, as a contiguous (B, heads, N, head_dim)."""
        if rope_position is not None:
            h = _rope(h, rope_position, self.rope_base)
        return h.transpose(1, 2).contiguous()

    def forward(self, query, key=None, value=None, key_padding_mask=None, need_weights=True, attn_mask=None,
                average_attn_weights=True, is_causal=False, *, position_q=0, position_k=0, precision=None):
        key = query if key is None else key
        value = key if value is None else value
        _check_tensors(("query", "key", "value"), (query, key, value))
        # Positions are integers (sdpa.MultiHeadAttention's rule), checked with or without rope.
        position_q, position_k = _checked_int("position_q", position_q), _checked_int("position_k", position_k)
        shared = query is key and key is value  # self-attention: one product for q, k and v
        unbatched = query.dim() == 2
        if unbatched:
            query, key, value = (t.unsqueeze(0) for t in (query, key, value))
            if key_padding_mask is not None:
                key_padding_mask = key_padding_mask.unsqueeze(0)
        elif not self.batch_first:
            query, key, value = (t.transpose(0, 1) for t in (query, key, value))
        if query.dim() != 3 or key.dim() != 3 or value.dim() != 3:
            raise RuntimeError(f"query, key and value must have 2 or 3 dims, got {query.dim()}, {key.dim()}, "
                               f"{value.dim()}")
        B, L, S = query.shape[0], query.shape[1], key.shape[1]
        H, Hkv = self.num_heads, self.num_kv_heads
        (w_q, w_k, w_v), (b_q, b_k, b_v) = self._projections()
        rope_q, rope_k = (position_q, position_k) if self.rope else (None, None)
        if shared and self._qkv_same_embed_dim:
            # Self-attention: one product with in_proj_weight (3E × E) for q, k and v, as torch does.
            qkv = F.linear(query, self.in_proj_weight, self.in_proj_bias).view(B, L, 3, H, self.head_dim)
            q, k, v = (self._head_major(qkv[:, :, i], r) for i, r in enumerate((rope_q, rope_k, None)))
        else:
            q = self._heads(query, w_q, b_q, H, rope_q)
            k = self._heads(key, w_k, b_k, Hkv, rope_k)
            v = self._heads(value, w_v, b_v, Hkv, None)
        # is_causal is torch's hint that attn_mask is the causal mask: sdpa's kernel applies causal
        # itself (skipping the tiles above the diagonal) and does not read attn_mask then; a
        # key_padding_mask still applies on top.
        causal = bool(is_causal)
        mask = _merged_mask(None if causal else attn_mask, key_padding_mask, B, H, L, S, q.dtype)
        dropout_p, seed = (self.dropout, None) if self.training and self.dropout > 0 else (0.0, None)
        if dropout_p > 0:
            dropout_p, _, seed = _options(dropout_p, None)
        # The operator itself (q, k, v are already (B, H, N, D); GQA is native): it takes a mask
        # and causal together, which scaled_dot_product_attention's torch semantics refuse.
        out, _ = _attention(q, k, v, mask, "top_left" if causal else "none", None, -1, -1, dropout_p, seed,
                            precision=_precision_arg(precision))
        y = self.out_proj(_MergeHeads.apply(out))
        weights = None
        if need_weights:
            weights = self._weights(q, k, v, mask, causal)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if unbatched:
                weights = weights.squeeze(0)
        if unbatched:
            y = y.squeeze(0)
        elif not self.batch_first:
            y = y.transpose(0, 1)
        return y, weights

    def _weights(self, q, k, v, mask, causal):
        """The attention weights (B, H, L, S) from sdpa's kernel (before dropout), in q's dtype,
        without gradient (the operator's result carries none); exact mode's whatever the
        precision (Outputs::weights are)."""
        w = _attention_weights(q, k, v, mask, "top_left" if causal else "none", None, -1, -1)
        return w.to(q.dtype)

    def new_cache(self, num_pages, page_size):
        """An empty sdpa.KVCache of the parameters' dtype for ``step``."""
        from . import KVCache
        dtype = _numpy_of_tensor("out_proj.weight", self.out_proj.weight[:0]).dtype
        return KVCache(num_pages, page_size, self.num_kv_heads, self.head_dim, self.head_dim, dtype)

    @torch.no_grad()
    def step(self, x, cache, seqs, *, precision=None):
        """Incremental decoding (no autograd) by the C++ layer, in the parameters' dtype: x (B, n,
        embed_dim) (batch first, whatever batch_first says) of that dtype are the next n tokens of
        cache sequences seqs[b]. Projects them, applies RoPE at their positions (the sequences'
        lengths so far), appends their keys and values to the cache and attends causally: y (B,
        n, embed_dim), equal to the causal forward's rows (a 16-bit layer's within rounding: the C++
        layer rounds q and k after RoPE only). seqs: one id, or a list, tuple, 1-dim array or
        integer tensor of ids (a float such as 1.0, or a bool, is a TypeError, never truncated), as
        ``sdpa.MultiHeadAttention.step`` takes them. precision as forward's."""
        dtype = self.out_proj.weight.dtype
        if not isinstance(x, torch.Tensor) or x.dtype != dtype:
            raise TypeError(f"x must be a {str(dtype).removeprefix('torch.')} tensor (step takes the parameters' "
                            f"dtype), got {x.dtype if isinstance(x, torch.Tensor) else type(x).__name__}")
        # Sequence ids by sdpa's rule (sdpa.MultiHeadAttention.step's): integers, never a float
        # or bool truncated to a sequence; an integer tensor as its NumPy array.
        seqs = _sequence_ids(seqs.detach().cpu().numpy() if isinstance(seqs, torch.Tensor) else seqs, "x")
        # The C++ layer's step (sdpa.MultiHeadAttention.step's): it checks the sequences, the free
        # pages and the options before appending. Its weights act on the right: torch's transposed.
        from . import _core
        (w_q, w_k, w_v), (b_q, b_k, b_v) = self._projections()
        params = [_numpy_of_tensor(n, w).T for n, w in (("w_q", w_q), ("w_k", w_k), ("w_v", w_v),
                                                ("w_o", self.out_proj.weight))]
        params += [None if b is None else _numpy_of_tensor("bias", b) for b in (b_q, b_k, b_v, self.out_proj.bias)]
        config = (self.embed_dim, self.num_heads, self.num_kv_heads, self.head_dim, self.head_dim, self.embed_dim,
                  self.embed_dim, self.in_proj_bias is not None, self.rope, self.rope_base)
        xs = _numpy_of_tensor("x", x.contiguous())
        y = np.empty(xs.shape[:2] + (self.embed_dim,), xs.dtype)
        _core.mha_step(config, [None if p is None else _core_view(p) for p in params], _core_view(xs), cache._c, seqs,
                       _core_view(y), None, -1, -1, "auto", _precision_arg(precision))
        return _tensor_of_numpy(y)
