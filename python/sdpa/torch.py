"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors, with
autograd through sdpa's fused backward.

    from sdpa.torch import scaled_dot_product_attention
    out = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                       scale=None, enable_gqa=False)

PyTorch's semantics, with these limits:

- Shapes: (..., L, E) for the query and (..., S, E) / (..., S, Ev) for key and value, as in
  PyTorch: any number of leading dims, broadcast against each other (a missing or size-1
  dim is read with stride 0, not copied), dim -3 being the heads. Without ``enable_gqa``
  the head counts broadcast too (1 or the largest); with it, key's and value's head counts
  must divide query's (query head h reads kv head h // (Hq / Hkv)). Leading dims are
  flattened into one batch dim for sdpa: a view where their strides allow, else a copy of
  that tensor (when a dim broadcast with stride 0 has to be merged with one that is not).
  With ``enable_gqa`` and key and value head counts that differ (neither 1), both are
  repeated to a common head count (copies). Shapes that do not fit raise RuntimeError, the
  type PyTorch raises.
- ``is_causal`` is top-left (query i sees keys j <= i), as in PyTorch; together with
  ``attn_mask`` it raises RuntimeError, as PyTorch does.
- ``attn_mask`` is applied as in PyTorch: broadcastable to the output's (..., L, S); bool
  (True = take part) or float (added to the scaled scores, -inf blocks): float32 or the
  query's dtype (other dtypes raise RuntimeError, as in PyTorch). A query row with no
  allowed key gives zeros in the output and zero gradients, as PyTorch 2.15 does. The mask
  gets no gradient: a float mask that requires grad raises ValueError (sdpa never
  materialises the L x S matrix the mask gradient would be); pass ``attn_mask.detach()``.
  A float32 mask on bfloat16 or float16 tensors is added in float32 as it is (not rounded to
  the query's dtype first).
- ``dropout_p`` must be a real number in [0, 1); other values raise ValueError (PyTorch also
  takes 1.0 and returns zeros), non-numbers TypeError. When it is > 0, the dropout seed is
  drawn from torch's global generator, so ``torch.manual_seed`` reproduces it, and it is
  reused in the backward pass. The dropped weights differ from PyTorch's (a different
  generator).
- float32, float64, bfloat16 and float16 CPU tensors, query, key and value of one dtype (as
  in PyTorch), passed to sdpa without copies where their strides allow (last dim contiguous;
  a (B, L, H, E) tensor transposed to (B, H, L, E) is not copied). bfloat16 and float16
  compute in float32 and round each result once: the output and the gradients have the
  inputs' dtype.
- First derivatives only: the backward is marked ``once_differentiable``, so asking for a
  second derivative (double backward) raises RuntimeError.

torch is an optional dependency: importing ``sdpa`` never imports it; this module does.
"""

from __future__ import annotations

import math

import ml_dtypes
import numpy as np
import torch

from . import _parsed_dropout, attention, attention_backward, attention_varlen_backward
from . import attention_varlen as _numpy_attention_varlen

__all__ = ["scaled_dot_product_attention", "attention_varlen"]


def _numpy(t):
    """A NumPy view of a CPU tensor (no copy when its last dim is contiguous); a bfloat16 tensor
    becomes an ml_dtypes.bfloat16 array over the same memory (NumPy has no bfloat16 of its own)."""
    t = t.detach()
    if t.dim() and t.size(-1) > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    if t.dtype == torch.bfloat16:
        return t.view(torch.int16).numpy().view(ml_dtypes.bfloat16)
    return t.numpy()


def _torch(a):
    """A tensor over the memory of a NumPy array from sdpa (ml_dtypes.bfloat16 as torch.bfloat16)."""
    if a.dtype == ml_dtypes.bfloat16:
        return torch.from_numpy(a.view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


class _Attention(torch.autograd.Function):
    """sdpa on 4-D (B, H, N, D) tensors; scaled_dot_product_attention maps other shapes to it."""

    @staticmethod
    def forward(ctx, query, key, value, mask, causal, scale, dropout_p, seed):
        m = None if mask is None else _numpy(mask)
        out, lse = attention(_numpy(query), _numpy(key), _numpy(value), m, causal=causal, scale=scale,
                             dropout_p=dropout_p, seed=seed, return_lse=True)
        out = _torch(out)
        # Saved through autograd (not as ctx attributes) so that an in-place change of the
        # returned output, or of an input, makes backward raise instead of using stale data.
        ctx.save_for_backward(query, key, value, mask, out, _torch(lse))
        ctx.causal, ctx.scale, ctx.dropout_p, ctx.seed = causal, scale, dropout_p, seed
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable  # sdpa's backward is not itself differentiable
    def backward(ctx, dout):
        query, key, value, mask, out, lse = ctx.saved_tensors
        m = None if mask is None else _numpy(mask)
        dq, dk, dv = attention_backward(_numpy(dout), _numpy(query), _numpy(key), _numpy(value), _numpy(out),
                                        _numpy(lse), m, causal=ctx.causal, scale=ctx.scale,
                                        dropout_p=ctx.dropout_p, seed=ctx.seed)
        return _torch(dq), _torch(dk), _torch(dv), None, None, None, None, None


def _heads(t):
    return t.size(-3) if t.dim() >= 3 else 1


def _shape_error(rule, query, key, value):
    return RuntimeError(f"{rule}; got query {tuple(query.shape)}, key {tuple(key.shape)}, value {tuple(value.shape)}")


def _layout(query, key, value, enable_gqa):
    """(batch dims, query heads, kv heads for sdpa, output shape) of PyTorch's broadcasting
    rules; RuntimeError, like PyTorch, for shapes that do not fit together."""
    try:
        batch = tuple(torch.broadcast_shapes(query.shape[:-3], key.shape[:-3], value.shape[:-3]))
    except RuntimeError:
        raise _shape_error("the leading (batch) dims of query, key and value do not broadcast",
                           query, key, value) from None
    hq, hk, hv = _heads(query), _heads(key), _heads(value)
    if enable_gqa:
        if not (hk and hv and hq % hk == 0 and hq % hv == 0):
            raise _shape_error("key and value must have numbers of heads that divide query's", query, key, value)
        heads = hq
    else:
        heads = max(hq, hk, hv)
        if any(h not in (1, heads) for h in (hq, hk, hv)):
            raise _shape_error("key and value must have query's number of heads or 1 (enable_gqa=True for "
                               "grouped-query attention)", query, key, value)
    # sdpa pairs query head h with kv head h // (heads / kv_heads), one kv_heads for k and v.
    kv_heads = hk if hk == hv else math.lcm(hk, hv)
    lead = batch + (heads,) if max(query.dim(), key.dim(), value.dim()) >= 3 else ()
    return batch, heads, kv_heads, lead + (query.size(-2), value.size(-1))


def _as_4d(t, batch, heads):
    """t (..., N, D) as (B, heads, N, D), B the product of `batch`; a view when strides allow.

    Missing and size-1 leading dims are broadcast with stride 0 (no copy); a head count that
    is neither 1 nor `heads` (grouped-query attention with different key and value head
    counts) is repeated head by head, a copy. Merging the batch dims into one is a view
    unless a stride-0 (broadcast) dim has to be merged with a real one; then reshape copies,
    since sdpa's kernels take one stride per dim."""
    h = _heads(t)
    if h not in (1, heads):
        t = t.repeat_interleave(heads // h, dim=-3)  # copy: GQA with key and value head counts that differ
    t = t.expand(*batch, heads, t.size(-2), t.size(-1))
    return t.reshape(math.prod(batch), heads, t.size(-2), t.size(-1))


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by sdpa (see the module
    doc for the limits). The mask gets no gradient: a float ``attn_mask`` that requires grad
    raises ValueError (use ``attn_mask.detach()``); ``dropout_p`` must be in [0, 1)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise TypeError(f"{name} must be a CPU torch.Tensor")
        if t.dtype not in (torch.float32, torch.float64, torch.bfloat16, torch.float16):
            raise TypeError(f"{name} has dtype {t.dtype}, but sdpa takes float32, float64, bfloat16 or float16")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise _shape_error("query, key and value must have at least 2 dims, (..., L, E)", query, key, value)
    batch, heads, kv_heads, out_shape = _layout(query, key, value, enable_gqa)
    if attn_mask is not None:
        if is_causal:
            raise RuntimeError("attn_mask and is_causal cannot both be set (PyTorch raises RuntimeError too)")
        if not isinstance(attn_mask, torch.Tensor):
            raise TypeError("attn_mask must be a torch.Tensor")
        if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
            raise RuntimeError(f"attn_mask has dtype {attn_mask.dtype}, but must be bool, float32 or query's "
                               f"dtype {query.dtype} (as in PyTorch)")
        scores = out_shape[:-1] + (key.size(-2),)
        try:
            fits = tuple(torch.broadcast_shapes(attn_mask.shape, scores)) == scores
        except RuntimeError:
            fits = False
        if not fits:
            raise RuntimeError(f"attn_mask has shape {tuple(attn_mask.shape)}, which does not broadcast to the "
                               f"scores' {scores}")
        if attn_mask.requires_grad and torch.is_grad_enabled():
            # Silently returning no gradient would be worse than refusing.
            raise ValueError("gradients with respect to attn_mask are not supported (sdpa never forms the L x S "
                             "matrix they need); pass attn_mask.detach() if the mask is a constant")
        # A float mask goes to sdpa as it is (float32 or the query's dtype, as sdpa takes it):
        # sdpa widens it exactly, and never rounds a float32 bias to a 16-bit query's dtype.
        if attn_mask.dim() > 3:  # else sdpa broadcasts it against (B, H, L, S) as it is
            attn_mask = _as_4d(attn_mask, batch, attn_mask.size(-3))
    # A real number in [0, 1), else TypeError / ValueError naming dropout_p (seed 0: no seed check).
    dropout_p, _ = _parsed_dropout(dropout_p, 0)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else None
    causal = "top_left" if is_causal else False
    # Autograd sees the expand/reshape views around _Attention, and sums the gradients of
    # broadcast dims back into the shapes of query, key and value.
    out = _Attention.apply(_as_4d(query, batch, heads), _as_4d(key, batch, kv_heads), _as_4d(value, batch, kv_heads),
                           attn_mask, causal, scale, dropout_p, seed)
    return out.reshape(out_shape)


class _Varlen(torch.autograd.Function):
    """sdpa.attention_varlen on packed (total, H, D) tensors, with its backward."""

    @staticmethod
    def forward(ctx, query, key, value, cu_q, cu_k, causal, scale, window, dropout_p, seed):
        out, lse = _numpy_attention_varlen(_numpy(query), _numpy(key), _numpy(value), cu_q, cu_k, causal=causal,
                                           scale=scale, window=window, dropout_p=dropout_p, seed=seed, return_lse=True)
        out = _torch(out)
        ctx.save_for_backward(query, key, value, out, _torch(lse))
        ctx.cu, ctx.options = (cu_q, cu_k), dict(causal=causal, scale=scale, window=window, dropout_p=dropout_p,
                                                 seed=seed)
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        query, key, value, out, lse = ctx.saved_tensors
        dq, dk, dv = attention_varlen_backward(_numpy(dout), _numpy(query), _numpy(key), _numpy(value), _numpy(out),
                                               _numpy(lse), *ctx.cu, **ctx.options)
        return _torch(dq), _torch(dk), _torch(dv), None, None, None, None, None, None, None


def attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, window=None,
                     dropout_p=0.0):
    """``sdpa.attention_varlen`` on CPU tensors, with autograd (FlashAttention's
    ``flash_attn_varlen_func`` layout): query (total_q, Hq, Dk), key (total_k, Hkv, Dk), value
    (total_k, Hkv, Dv), cu_seqlens_q and cu_seqlens_k (B + 1,) integer tensors (or sequences);
    returns out (total_q, Hq, Dv) in the query's dtype. causal is False, True / "bottom_right"
    (FlashAttention's alignment, per sequence) or "top_left"; window and scale as in
    ``sdpa.attention``. With dropout_p > 0 the seed is drawn from torch's global generator
    (``torch.manual_seed`` reproduces it) and reused by the backward."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise TypeError(f"{name} must be a CPU torch.Tensor")
    cu = [np.asarray(c.detach().cpu().numpy() if isinstance(c, torch.Tensor) else c) for c in (cu_seqlens_q, cu_seqlens_k)]
    dropout_p, _ = _parsed_dropout(dropout_p, 0)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else None
    return _Varlen.apply(query, key, value, cu[0], cu[1], causal, scale, window, dropout_p, seed)
