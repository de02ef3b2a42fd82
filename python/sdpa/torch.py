"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors, with
autograd through sdpa's fused backward.

    from sdpa.torch import scaled_dot_product_attention
    out = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                       scale=None, enable_gqa=False)

PyTorch's semantics, with these limits:

- Shapes: (..., L, E) for the query and (..., S, E) / (..., S, Ev) for key and value, with at
  most two leading dims (batch, heads), the same number of dims for all three (no rank
  broadcasting) and the same batch size. Key and value have the same number of heads: that
  of the query, or 1 (broadcast, as PyTorch does), or with ``enable_gqa`` a divisor of it.
  Other head counts raise RuntimeError, the type PyTorch raises (PyTorch alone broadcasts a
  one-head query, or a key and value with different head counts).
- ``is_causal`` is top-left (query i sees keys j <= i), as in PyTorch; it excludes
  ``attn_mask``.
- ``attn_mask`` is applied as in PyTorch: broadcastable to (..., L, S); bool (True = take
  part) or float (added to the scaled scores, -inf blocks). A query row with no allowed key
  gives zeros in the output and zero gradients, as PyTorch 2.15 does. The mask gets no
  gradient: a float mask that requires grad raises ValueError (sdpa never materialises the
  L x S matrix the mask gradient would be); pass ``attn_mask.detach()``.
- ``dropout_p`` must be in [0, 1); other values raise ValueError (PyTorch also takes 1.0 and
  returns zeros). When it is > 0, the dropout seed is drawn from torch's global generator, so
  ``torch.manual_seed`` reproduces it, and it is reused in the backward pass. The dropped
  weights differ from PyTorch's (a different generator).
- float32 and float64 CPU tensors, passed to sdpa without copies where their strides allow
  (last dim contiguous).

torch is an optional dependency: importing ``sdpa`` never imports it; this module does.
"""

from __future__ import annotations

import torch

from . import attention, attention_backward

__all__ = ["scaled_dot_product_attention"]


def _numpy(t):
    """A NumPy view of a CPU tensor (no copy when its last dim is contiguous)."""
    t = t.detach()
    if t.dim() and t.size(-1) > 1 and t.stride(-1) != 1:
        t = t.contiguous()
    return t.numpy()


class _Attention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, query, key, value, mask, causal, scale, dropout_p, seed):
        m = None if mask is None else _numpy(mask)
        out, lse = attention(_numpy(query), _numpy(key), _numpy(value), m, causal=causal, scale=scale,
                             dropout_p=dropout_p, seed=seed, return_lse=True)
        out = torch.from_numpy(out)
        # Saved through autograd (not as ctx attributes) so that an in-place change of the
        # returned output, or of an input, makes backward raise instead of using stale data.
        ctx.save_for_backward(query, key, value, mask, out, torch.from_numpy(lse))
        ctx.causal, ctx.scale, ctx.dropout_p, ctx.seed = causal, scale, dropout_p, seed
        return out

    @staticmethod
    def backward(ctx, dout):
        query, key, value, mask, out, lse = ctx.saved_tensors
        m = None if mask is None else _numpy(mask)
        dq, dk, dv = attention_backward(_numpy(dout), _numpy(query), _numpy(key), _numpy(value), _numpy(out),
                                        _numpy(lse), m, causal=ctx.causal, scale=ctx.scale,
                                        dropout_p=ctx.dropout_p, seed=ctx.seed)
        return torch.from_numpy(dq), torch.from_numpy(dk), torch.from_numpy(dv), None, None, None, None, None


def _check_heads(query, key, value, enable_gqa):
    """Raises RuntimeError, like PyTorch, for head counts sdpa cannot pair up."""
    if query.dim() < 3 or key.dim() != query.dim() or value.dim() != query.dim():
        return  # sdpa's own checks name the mismatch
    hq, hk, hv = query.size(-3), key.size(-3), value.size(-3)
    # Key/value with one head are broadcast by PyTorch even without enable_gqa; sdpa's GQA
    # with a single kv head computes exactly that.
    if hk == hv and (hk == 1 or hk == hq or (enable_gqa and hk and hq % hk == 0)):
        return
    rule = ("key and value must have the same number of heads, dividing query's" if enable_gqa else
            "key and value must have query's number of heads or 1 (enable_gqa=True for grouped-query attention)")
    raise RuntimeError(f"{rule}; got query {tuple(query.shape)}, key {tuple(key.shape)}, "
                       f"value {tuple(value.shape)}")


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by sdpa (see the module
    doc for the limits). The mask gets no gradient: a float ``attn_mask`` that requires grad
    raises ValueError (use ``attn_mask.detach()``); ``dropout_p`` must be in [0, 1)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise TypeError(f"{name} must be a CPU torch.Tensor")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} has dtype {t.dtype}, but sdpa takes float32 or float64")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    _check_heads(query, key, value, enable_gqa)
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal cannot both be set (as in PyTorch)")
    if attn_mask is not None and attn_mask.requires_grad and torch.is_grad_enabled():
        # Silently returning no gradient would be worse than refusing.
        raise ValueError("gradients with respect to attn_mask are not supported (sdpa never forms the L x S "
                         "matrix they need); pass attn_mask.detach() if the mask is a constant")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(query.dtype)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else None
    causal = "top_left" if is_causal else False
    return _Attention.apply(query, key, value, attn_mask, causal, scale, float(dropout_p), seed)
