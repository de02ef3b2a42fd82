"""A drop-in for ``torch.nn.functional.scaled_dot_product_attention`` on CPU tensors, with
autograd through sdpa's fused backward.

    from sdpa.torch import scaled_dot_product_attention
    out = scaled_dot_product_attention(q, k, v, attn_mask=None, dropout_p=0.0, is_causal=False,
                                       scale=None, enable_gqa=False)

PyTorch's semantics: shapes (..., L, E) for the query and (..., S, E) / (..., S, Ev) for key and
value with at most two leading dims; ``is_causal`` is top-left (query i sees keys j <= i);
``attn_mask`` is bool (True = take part) or float (added to the scores); ``enable_gqa`` lets the
query have a multiple of the key/value heads. float32 and float64 CPU tensors are passed to sdpa
without copies where their strides allow (last dim contiguous). Dropout draws its seed from
torch's generator (``torch.manual_seed`` makes it reproducible); the same seed is reused in the
backward pass. torch is an optional dependency: importing ``sdpa`` never imports it.
"""

from __future__ import annotations

import numpy as np
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
        q, k, v = _numpy(query), _numpy(key), _numpy(value)
        m = None if mask is None else _numpy(mask)
        out, lse = attention(q, k, v, m, causal=causal, scale=scale, dropout_p=dropout_p, seed=seed,
                             return_lse=True)
        ctx.save_for_backward(query, key, value)
        ctx.mask, ctx.causal, ctx.scale, ctx.dropout_p, ctx.seed = m, causal, scale, dropout_p, seed
        ctx.out, ctx.lse = out, lse
        return torch.from_numpy(out)

    @staticmethod
    def backward(ctx, dout):
        query, key, value = ctx.saved_tensors
        dq, dk, dv = attention_backward(_numpy(dout), _numpy(query), _numpy(key), _numpy(value), ctx.out, ctx.lse,
                                        ctx.mask, causal=ctx.causal, scale=ctx.scale, dropout_p=ctx.dropout_p,
                                        seed=ctx.seed)
        return torch.from_numpy(dq), torch.from_numpy(dk), torch.from_numpy(dv), None, None, None, None, None


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by sdpa (see the module doc)."""
    for name, t in (("query", query), ("key", key), ("value", value)):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise TypeError(f"{name} must be a CPU torch.Tensor")
        if t.dtype not in (torch.float32, torch.float64):
            raise TypeError(f"{name} has dtype {t.dtype}, but sdpa takes float32 or float64")
    if not (query.dtype == key.dtype == value.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if query.dim() >= 3 and query.size(-3) != key.size(-3) and not enable_gqa:
        raise ValueError(f"query has {query.size(-3)} heads but key has {key.size(-3)}: pass enable_gqa=True "
                         "for grouped-query attention")
    if attn_mask is not None and is_causal:
        raise ValueError("attn_mask and is_causal cannot both be set (as in PyTorch)")
    if attn_mask is not None and attn_mask.dtype != torch.bool:
        attn_mask = attn_mask.to(query.dtype)
    seed = int(torch.randint(0, 2**62, (1,)).item()) if dropout_p > 0 else None
    causal = "top_left" if is_causal else False
    return _Attention.apply(query, key, value, attn_mask, causal, scale, float(dropout_p), seed)
