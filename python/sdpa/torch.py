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
  allowed key gives zeros in the output and zero gradients, as PyTorch 2.15 does. A float
  mask that requires grad (a learned bias: T5's relative positions) gets its gradient, as in
  PyTorch: sdpa's backward computes it shaped like the mask as passed (summed over the dims
  it broadcasts along, deterministically), in a pass of its own that costs about one more
  backward.
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
  inputs' dtype. ``precision="fast"`` (every function's keyword; None takes the enclosing
  ``sdpa.precision(...)`` block's) rounds the softmax weights as ``sdpa.attention`` describes.
- ``scale`` is a real number or, as in PyTorch, a 0-dim tensor (read as its number; a tensor
  with dims, one that requires grad and a bool one raise TypeError).
- First derivatives only: the backward is marked ``once_differentiable``, so asking for a
  second derivative (double backward) raises RuntimeError.

- Also ``attention_varlen`` (packed sequences, with autograd) and ``attention_paged`` (a paged
  KV cache, forward only), sdpa's functions of those names on tensors.

The functions call sdpa's torch operators (``torch.ops.sdpa.attention`` and its kin, in C++,
registered with autograd and with fake-tensor kernels), so a call costs about what a torch
operator costs, and models using them compile with ``torch.compile`` without graph breaks.
The operators live in ``sdpa/_torch_ops.so``, built with the package when torch is importable
at build time (``pip install --no-build-isolation .`` after installing torch;
``scripts/setup.sh --torch``); importing this module without them raises ImportError saying so.

torch is an optional dependency: importing ``sdpa`` never imports it; this module does.
"""

from __future__ import annotations

import math
import os
import sys

import numpy as np
import torch

from ._args import (_PRECISION, _batch_invariant_arg, _block_sizes, _causal_name, _check_real, _compute_dtype, _numpy_of_tensor, _parsed_dropout,
                    _parsed_softcap, _precision_arg, _prepared_indices, _real_array, _scale_value, _tensor_of_numpy,
                    _torch_dtypes, _window_bounds)

__all__ = ["scaled_dot_product_attention", "attention_varlen", "attention_paged", "attention_stats",
           "merge_attention", "MultiheadAttention"]

_LIBRARY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_torch_ops.so")
_REBUILD = ("install torch first, then build sdpa with `pip install --no-build-isolation .` "
            "(scripts/setup.sh --torch does both)")


def _load_operators():
    if not hasattr(torch.ops.sdpa, "attention"):
        if not os.path.exists(_LIBRARY):
            raise ImportError(f"sdpa.torch needs sdpa's torch operators ({_LIBRARY}), which are built only when "
                              f"torch can be imported while sdpa builds: {_REBUILD}")
        try:
            torch.ops.load_library(_LIBRARY)
        except OSError as e:
            raise ImportError(f"sdpa's torch operators ({_LIBRARY}) do not load with torch {torch.__version__} "
                              f"({e}): {_REBUILD}") from None
    built = torch.ops.sdpa.torch_version()
    if built != torch.__version__:
        raise ImportError(f"sdpa's torch operators were built against torch {built}, but torch {torch.__version__} "
                          f"is imported: {_REBUILD}")


_load_operators()
_ops = torch.ops.sdpa
_attention = _ops.attention.default
_attention_out = _ops.attention_out.default  # attention's out alone: the common call, cheaper (no lse)
_FLOATS = _torch_dtypes(torch)
_Tensor = torch.Tensor
_EXACT = {}  # the operators' keyword arguments for precision="exact", their default


# ---------------------------------------------------------------- fake kernels (torch.compile)


def _dsinks(q, sinks):
    """The backward operators' fourth result: dsinks (Hq,) in the compute dtype, (0,) without sinks."""
    return q.new_empty((sinks.shape[0] if sinks is not None else 0,), dtype=_compute_dtype(q.dtype))


def _dalibi(q, alibi_slopes, alibi_grad):
    """The backward operators' last result: the slopes' gradient (their shape and dtype) with
    alibi_grad, else (0,)."""
    return alibi_slopes.new_empty(alibi_slopes.shape) if alibi_grad else q.new_empty((0,))


@torch.library.register_fake("sdpa::attention")
def _(q, k, v, mask, causal, scale, window_left, window_right, dropout_p, seed, softcap=0.0, softcap_after_bias=False,
      alibi_slopes=None, sinks=None, block_mask=None, block_q=128, block_k=128, precision="exact", seqlens_k=None,
      batch_invariant=False):
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), q.new_empty(q.shape[:-1], dtype=_compute_dtype(q.dtype))


@torch.library.register_fake("sdpa::attention_out")
def _(q, k, v, causal="none", scale=None):
    return q.new_empty(q.shape[:-1] + v.shape[-1:])


@torch.library.register_fake("sdpa::attention_backward")
def _(dout, q, k, v, out, lse, mask, causal, scale, window_left, window_right, dropout_p, seed, softcap=0.0,
      softcap_after_bias=False, alibi_slopes=None, sinks=None, block_mask=None, block_q=128, block_k=128,
      mask_grad=False, alibi_grad=False, precision="exact", seqlens_k=None):
    dbias = mask.new_empty(mask.shape) if mask_grad else q.new_empty((0,))
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _dsinks(q, sinks), dbias,
            _dalibi(q, alibi_slopes, alibi_grad))


@torch.library.register_fake("sdpa::attention_varlen")
def _(q, k, v, cu_seqlens_q, cu_seqlens_k, causal, scale, window_left, window_right, dropout_p, seed, softcap=0.0,
      softcap_after_bias=False, alibi_slopes=None, sinks=None, block_mask=None, block_q=128, block_k=128,
      precision="exact", batch_invariant=False):
    lse = q.new_empty((q.shape[1], q.shape[0]), dtype=_compute_dtype(q.dtype))
    return q.new_empty(q.shape[:-1] + v.shape[-1:]), lse


@torch.library.register_fake("sdpa::attention_varlen_backward")
def _(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, out, lse, causal, scale, window_left, window_right, dropout_p,
      seed, softcap=0.0, softcap_after_bias=False, alibi_slopes=None, sinks=None, block_mask=None, block_q=128,
      block_k=128, alibi_grad=False, precision="exact"):
    return (q.new_empty(q.shape), k.new_empty(k.shape), v.new_empty(v.shape), _dsinks(q, sinks),
            _dalibi(q, alibi_slopes, alibi_grad))


@torch.library.register_fake("sdpa::attention_paged")
def _(q, k_pages, v_pages, block_table, seqlens_k, cu_seqlens_q, causal, scale, window_left, window_right,
      softcap=0.0, softcap_after_bias=False, alibi_slopes=None, sinks=None, block_mask=None, block_q=128, block_k=128,
      precision="exact", batch_invariant=False):
    lse_shape = (q.shape[1], q.shape[0]) if cu_seqlens_q is not None else q.shape[:-1]
    return q.new_empty(q.shape[:-1] + v_pages.shape[-1:]), q.new_empty(lse_shape, dtype=_compute_dtype(q.dtype))


@torch.library.register_fake("sdpa::attention_weights")
def _(q, k, v, mask, causal, scale, window_left, window_right, softcap=0.0, softcap_after_bias=False,
      alibi_slopes=None, sinks=None, block_mask=None, block_q=128, block_k=128, precision="exact"):
    return q.new_empty(q.shape[:-1] + k.shape[-2:-1], dtype=_compute_dtype(q.dtype))


def _merged_compute(outs, lses):
    """merge_attention's compute dtype: float64 when any part is float64, else float32."""
    return torch.float64 if any(t.dtype == torch.float64 for t in (*outs, *lses)) else torch.float32


@torch.library.register_fake("sdpa::merge_attention")
def _(outs, lses, out_dtype=None):
    compute = _merged_compute(outs, lses)
    return (outs[0].new_empty(outs[0].shape, dtype=out_dtype or compute),
            outs[0].new_empty(outs[0].shape[:-1], dtype=compute))


def merge_attention(outs, lses, *, out_dtype=None):
    """Merges partial attention results of the same query rows by their log-sum-exp, in the
    order given: ``sdpa.merge_attention`` (its docstring has the formulas and the rules) for CPU
    tensors, as the operator ``torch.ops.sdpa.merge_attention`` (with a fake kernel, so it
    traces under torch.compile).

    Shapes::

        outs[s]   (…, N, Dv)   one shape for every s, 2 to 4 dims
        lses[s]   (…, N)       outs' shape without its last dim
        returns   out (…, N, Dv) of out_dtype, lse (…, N) of the compute dtype

    outs float16, bfloat16, float32 or float64, lses float32 or float64, any strides, one
    length >= 1. The compute dtype is float64 when any part is float64, else float32; out_dtype
    (a torch dtype) defaults to it. Bitwise reproducible for the same parts in the same order.

    No autograd: the operator has no backward (the backward of a key shard is the attention
    backward with the merged out and lse); call it on tensors that do not require grad, or
    under torch.no_grad(). Errors as ValueError (shapes, +inf or NaN lse) and TypeError.
    """
    outs, lses = list(outs), list(lses)
    if len(outs) != len(lses):
        raise ValueError(f"outs has {len(outs)} tensors but lses has {len(lses)}: one lse per out")
    return _ops.merge_attention(outs, lses, out_dtype)


# ---------------------------------------------------------------- torch.nn.functional's function


def _check_tensors(names, tensors):
    for name, t in zip(names, tensors):
        if not isinstance(t, torch.Tensor) or t.device.type != "cpu":
            raise TypeError(f"{name} must be a CPU torch.Tensor")
        if t.dtype not in _FLOATS:
            raise TypeError(f"{name} has dtype {t.dtype}, but sdpa takes float32, float64, bfloat16 or float16")


def _tensor_scale(scale):
    """A tensor scale as the number it holds, as F.scaled_dot_product_attention reads one: a
    0-dim tensor of a floating or integer dtype. TypeError, naming scale, for a tensor with dims
    (even of one element) and one that requires grad (the scale gets no gradient), which torch
    refuses too, and for a bool one, as sdpa refuses a bool scale (torch takes both as 1 or 0).
    Under torch.compile, reading the number is a graph break, as it is for torch's function
    (whose fullgraph compile fails on a tensor scale)."""
    if scale.dim() != 0:
        raise TypeError(f"scale must be a real number or a 0-dim tensor, got a tensor of shape {tuple(scale.shape)}")
    if scale.requires_grad:
        raise TypeError("scale is a tensor that requires grad, but the scale gets no gradient: pass it detached "
                        "(torch's scaled_dot_product_attention refuses it too)")
    if scale.dtype == torch.bool or scale.is_complex():
        raise TypeError(f"scale must be a real number or a 0-dim tensor of one, got a {scale.dtype} tensor")
    return scale.item()


def _options(dropout_p, scale):
    """(dropout_p, scale, seed) checked: TypeError / ValueError naming the argument (scale a real
    number, a 0-dim tensor (_tensor_scale) or None). The seed is drawn from torch's global
    generator when dropout_p > 0 (torch.manual_seed reproduces it), as a tensor so that
    torch.compile traces it."""
    if type(dropout_p) is not float:
        dropout_p, _ = _parsed_dropout(dropout_p, 0)  # a real number in [0, 1), else an error naming it
    # (a float's range is the operator's to check: its ValueError names dropout_p)
    if scale is not None and type(scale) is not float:
        scale = _scale_value(_tensor_scale(scale) if isinstance(scale, torch.Tensor) else scale)
    seed = torch.randint(0, 2**62, (1,), dtype=torch.int64) if dropout_p > 0 else None
    return dropout_p, scale, seed


def _mods(softcap, softcap_order, alibi_slopes, sinks):
    """The operators' last four arguments: softcap a real number (sdpa's rule, _real_number: a
    str, a complex or a bool is TypeError; 10**400 is inf, which the operator refuses by name),
    the order one of sdpa's two, slopes and sinks real numbers by sdpa's rule for arrays of values
    (_check_real: complex, str, object and float8 are TypeError naming them), as float tensors
    (float32 unless float64: the kernels take those two; a bfloat16 parameter's gradient flows
    back through the conversion). The operator checks the rest."""
    softcap, softcap_order = _parsed_softcap(softcap, softcap_order)
    tensors = []
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None:
            if not isinstance(t, torch.Tensor):
                t = torch.from_numpy(np.ascontiguousarray(_real_array(name, t), dtype=np.float32))
            if t.device.type != "cpu":
                raise TypeError(f"{name} must be a CPU tensor")
            if t.dtype not in (torch.float32, torch.float64):
                _check_real_tensor(name, t)
                t = t.float()
        tensors.append(t)
    return softcap, softcap_order == "after_bias", tensors[0], tensors[1]


def _blocks(block_mask, block_size):
    """The attention operators' block arguments: block_mask a bool CPU tensor (or None) and
    (block_q, block_k) from block_size (an int or a pair). The operator checks the shape."""
    if block_mask is None:
        return (None, 128, 128)
    if not isinstance(block_mask, torch.Tensor):
        block_mask = torch.as_tensor(block_mask)
    if block_mask.dtype != torch.bool or block_mask.device.type != "cpu":
        raise TypeError(f"block_mask must be a bool CPU tensor, got {block_mask.dtype} on {block_mask.device}")
    return (block_mask,) + _block_sizes(block_size)


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


def _checked_mask(attn_mask, query, is_causal, scores):
    """attn_mask checked against PyTorch's rules for scores of shape `scores`."""
    if is_causal:
        raise RuntimeError("attn_mask and is_causal cannot both be set (PyTorch raises RuntimeError too)")
    if not isinstance(attn_mask, torch.Tensor):
        raise TypeError("attn_mask must be a torch.Tensor")
    if attn_mask.dtype not in (torch.bool, torch.float32, query.dtype):
        raise RuntimeError(f"attn_mask has dtype {attn_mask.dtype}, but must be bool, float32 or query's "
                           f"dtype {query.dtype} (as in PyTorch)")
    try:
        fits = tuple(torch.broadcast_shapes(attn_mask.shape, scores)) == scores
    except RuntimeError:
        fits = False
    if not fits:
        raise RuntimeError(f"attn_mask has shape {tuple(attn_mask.shape)}, which does not broadcast to the "
                           f"scores' {scores}")


def _direct(query, key, value, attn_mask, enable_gqa):
    """Whether the tensors are already sdpa's (B, H, N, D) call, as a model's decode step passes
    them: 4-D, one batch size, kv heads that are query's (or divide them, with enable_gqa), a
    mask absent or 4-D. Then the views of _layout and _as_4d would be the tensors themselves."""
    if attn_mask is not None and attn_mask.dim() != 4:
        return False
    try:  # (unpacking the shapes is cheaper than asking for each dim count; any other count raises)
        (b, hq, _, _), (bk, hk, _, _), (bv, hv, _, _) = query.shape, key.shape, value.shape
    except ValueError:
        return False
    return b == bk == bv and hk == hv and hk > 0 and (hk == hq or (enable_gqa and hq % hk == 0))


def _out(query, key, value, is_causal, scale):
    """attention_out(query, key, value), top-left causal or not, scale a float or None: the
    arguments at their defaults left out (each saves the call ~0.3 µs)."""
    if scale is not None:
        return _attention_out(query, key, value, "top_left" if is_causal else "none", scale)
    return _attention_out(query, key, value, "top_left") if is_causal else _attention_out(query, key, value)


def scaled_dot_product_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None,
                                 enable_gqa=False, *, softcap=0.0, softcap_order="before_bias", alibi_slopes=None,
                                 sinks=None, block_mask=None, block_size=128, precision=None, batch_invariant=False):
    """``torch.nn.functional.scaled_dot_product_attention``, computed by sdpa (see the module
    doc for the limits). A float ``attn_mask`` that requires grad gets its gradient;
    ``dropout_p`` must be in [0, 1).

    Beyond PyTorch's arguments, sdpa's score modifiers (``sdpa.attention`` states them):
    ``softcap`` (Gemma's ``softcap·tanh(s / softcap)``; ``softcap_order``), ``alibi_slopes``
    ((H,) or (B, H), the query aligned bottom-right) and ``sinks`` ((H,) logits added to each
    row's softmax denominator); slopes and sinks get a gradient when they require one (the
    slopes' from the pass that a float mask's gradient takes, about one more backward). H is the number of
    query heads and B the product of the batch dims. ``block_mask`` (bool; (QB, KB), (H, QB, KB)
    or (B, H, QB, KB) with QB = ceil(L / bq), KB = ceil(S / bk) for ``block_size`` = bq or
    (bq, bk), default 128) makes it block-sparse as in ``sdpa.attention``: a False block's keys
    are blocked for its queries, and the kernels skip the tiles it empties. ``precision`` as in
    ``sdpa.attention`` ("exact" or "fast"; None takes the enclosing ``sdpa.precision(...)`` block's).
    ``batch_invariant=True``: each query row's out is bit for bit the same however the rows are
    batched (``sdpa.attention``'s batch_invariant; forward only, the backward is unchanged)."""
    # The checks are written for speed (a decode step of a small model costs a few µs in all).
    # The commonest call (sdpa's layout, no mask, dropout, modifiers or precision) is checked
    # first and goes to attention_out; the common case passes the next checks in a few attribute
    # reads, anything else goes to the checks that name the argument.
    if (attn_mask is None and type(dropout_p) is float and dropout_p == 0.0 and (scale is None or type(scale) is float)
            and type(softcap) is float and softcap == 0.0 and alibi_slopes is None and sinks is None
            and block_mask is None and precision is None and batch_invariant is False and type(softcap_order) is str
            and softcap_order == "before_bias" and type(query) is _Tensor and type(key) is _Tensor
            and type(value) is _Tensor and query.is_cpu and key.is_cpu and value.is_cpu and query.dtype in _FLOATS
            and query.dtype == key.dtype == value.dtype and _PRECISION.get() == "exact"
            and _direct(query, key, value, None, enable_gqa)):
        return _out(query, key, value, is_causal, scale)
    if not (isinstance(query, _Tensor) and isinstance(key, _Tensor) and isinstance(value, _Tensor)
            and query.is_cpu and key.is_cpu and value.is_cpu and query.dtype in _FLOATS):
        _check_tensors(("query", "key", "value"), (query, key, value))
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(f"query, key and value must share a dtype, got {query.dtype}, {key.dtype}, {value.dtype}")
    if dropout_p == 0.0 and type(dropout_p) is float and (scale is None or type(scale) is float):
        seed = None
    else:
        dropout_p, scale, seed = _options(dropout_p, scale)
    # (type first: an array softcap has no truth value, and False == 0.0 must reach _mods' refusal)
    mods = () if (type(softcap) is float and softcap == 0.0 and alibi_slopes is None and sinks is None
                  and softcap_order == "before_bias") else _mods(softcap, softcap_order, alibi_slopes, sinks)
    if block_mask is not None:
        mods = (mods or (0.0, False, None, None)) + _blocks(block_mask, block_size)
    causal = "top_left" if is_causal else "none"
    precision = _precision_arg(precision)  # the operator checks the name
    # The operator's default, "exact", is left out: a keyword argument costs it ~0.6 µs a call.
    prec = _EXACT if precision == "exact" else {"precision": precision}
    invariant = _batch_invariant_arg(batch_invariant)
    if invariant:
        prec = {**prec, "batch_invariant": True}
    if _direct(query, key, value, attn_mask, enable_gqa):
        if attn_mask is None and seed is None and not mods and precision == "exact" and not invariant:
            return _out(query, key, value, is_causal, scale)
        if attn_mask is not None:
            _checked_mask(attn_mask, query, is_causal, query.shape[:-1] + key.shape[-2:-1])
        return _attention(query, key, value, attn_mask, causal, scale, -1, -1, dropout_p, seed, *mods, **prec)[0]
    if min(query.dim(), key.dim(), value.dim()) < 2:
        raise _shape_error("query, key and value must have at least 2 dims, (..., L, E)", query, key, value)
    batch, heads, kv_heads, out_shape = _layout(query, key, value, enable_gqa)
    if attn_mask is not None:
        _checked_mask(attn_mask, query, is_causal, out_shape[:-1] + (key.size(-2),))
        # A float mask goes to sdpa as it is (float32 or the query's dtype, as sdpa takes it):
        # sdpa widens it exactly, and never rounds a float32 bias to a 16-bit query's dtype.
        if attn_mask.dim() > 3:  # else sdpa broadcasts it against (B, H, L, S) as it is
            attn_mask = _as_4d(attn_mask, batch, attn_mask.size(-3))
    # Autograd sees the expand/reshape views around the operator, and sums the gradients of
    # broadcast dims back into the shapes of query, key and value.
    out, _ = _attention(_as_4d(query, batch, heads), _as_4d(key, batch, kv_heads), _as_4d(value, batch, kv_heads),
                        attn_mask, causal, scale, -1, -1, dropout_p, seed, *mods, **prec)
    return out.reshape(out_shape)


# ---------------------------------------------------------------- packed sequences, paged KV cache


def _index_tensor(name, t, meaning, ndim=1):
    """An index tensor (cu_seqlens, seqlens_k, block_table) as int32 or int64 on the CPU; a
    sequence or array is converted as ``sdpa`` converts it."""
    if isinstance(t, torch.Tensor):
        if t.dtype in (torch.int32, torch.int64) and t.device.type == "cpu" and t.dim() == ndim:
            return t
        t = t.detach().cpu().numpy()
    return torch.from_numpy(_prepared_indices(name, t, meaning, ndim))


def attention_varlen(query, key, value, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, window=None,
                     dropout_p=0.0, softcap=0.0, softcap_order="before_bias", alibi_slopes=None, sinks=None,
                     block_mask=None, block_size=128, precision=None, batch_invariant=False):
    """``sdpa.attention_varlen`` on CPU tensors, with autograd (FlashAttention's
    ``flash_attn_varlen_func`` layout): query (total_q, Hq, Dk), key (total_k, Hkv, Dk), value
    (total_k, Hkv, Dv), cu_seqlens_q and cu_seqlens_k (B + 1,) integer tensors (or sequences);
    returns out (total_q, Hq, Dv) in the query's dtype. causal is False, True / "bottom_right"
    (FlashAttention's alignment, per sequence) or "top_left"; window and scale as in
    ``sdpa.attention``. With dropout_p > 0 the seed is drawn from torch's global generator
    (``torch.manual_seed`` reproduces it) and reused by the backward. softcap, softcap_order,
    alibi_slopes ((Hq,) or (B, Hq): row b for sequence b) and sinks (both with a gradient) as in
    ``scaled_dot_product_attention``; block_mask and block_size as in ``sdpa.attention_varlen``
    (each sequence reads the top-left corner of the longest sequence's blocks); precision and
    batch_invariant as in ``scaled_dot_product_attention``."""
    _check_tensors(("query", "key", "value"), (query, key, value))
    cu_q = _index_tensor("cu_seqlens_q", cu_seqlens_q, "(B + 1,) offsets")
    cu_k = _index_tensor("cu_seqlens_k", cu_seqlens_k, "(B + 1,) offsets")
    dropout_p, scale, seed = _options(dropout_p, scale)
    left, right = _window_bounds(window)
    mods = _mods(softcap, softcap_order, alibi_slopes, sinks)
    if block_mask is not None:
        mods += _blocks(block_mask, block_size)
    out, _ = _ops.attention_varlen(query, key, value, cu_q, cu_k, _causal_name(causal), scale, left, right, dropout_p,
                                   seed, *mods, precision=_precision_arg(precision),
                                   batch_invariant=_batch_invariant_arg(batch_invariant))
    return out


def attention_paged(query, k_pages, v_pages, block_table, seqlens_k, *, cu_seqlens_q=None, causal=False, scale=None,
                    window=None, return_lse=False, softcap=0.0, softcap_order="before_bias", alibi_slopes=None,
                    sinks=None, block_mask=None, block_size=128, precision=None, batch_invariant=False):
    """``sdpa.attention_paged`` on CPU tensors (forward only: the result carries no gradient):
    query (B, Hq, Nq, Dk) against a paged KV cache, k_pages (num_pages, page_size, Hkv, Dk) and
    v_pages (num_pages, page_size, Hkv, Dv) (any strides with a contiguous last dim), block_table
    (B, max_pages) and seqlens_k (B,) integer tensors; returns out (B, Hq, Nq, Dv) in the query's
    dtype, and lse (B, Hq, Nq) with return_lse. With cu_seqlens_q ((B + 1,) offsets) the query
    is packed, (total_q, Hq, Dk), out (total_q, Hq, Dv) and lse (Hq, total_q). causal, window,
    scale, the score modifiers, block_mask, precision and batch_invariant as in ``sdpa.attention_paged``."""
    _check_tensors(("query", "k_pages", "v_pages"), (query, k_pages, v_pages))
    table = _index_tensor("block_table", block_table, "(B, max_pages) page indices", ndim=2)
    lengths = _index_tensor("seqlens_k", seqlens_k, "(B,) key lengths")
    cu_q = None if cu_seqlens_q is None else _index_tensor("cu_seqlens_q", cu_seqlens_q, "(B + 1,) offsets")
    _, scale, _ = _options(0.0, scale)
    left, right = _window_bounds(window)
    mods = _mods(softcap, softcap_order, alibi_slopes, sinks)
    if block_mask is not None:
        mods += _blocks(block_mask, block_size)
    out, lse = _ops.attention_paged(query, k_pages, v_pages, table, lengths, cu_q, _causal_name(causal), scale, left,
                                    right, *mods, precision=_precision_arg(precision),
                                    batch_invariant=_batch_invariant_arg(batch_invariant))
    return (out, lse) if return_lse else out


def _check_real_tensor(name, t):
    """sdpa's rule for arrays of values (_check_real) on a tensor's dtype, read from an empty
    array of its NumPy counterpart (the data is not touched)."""
    _check_real(name, _numpy_of_tensor(name, t.new_empty(0)))


def attention_stats(query, key, value, attn_mask=None, *, causal=False, scale=None, window=None, topk=8,
                    softcap=0.0, softcap_order="before_bias", alibi_slopes=None, sinks=None):
    """``sdpa.attention(..., return_stats=True)`` on CPU tensors, without autograd: returns
    ``(out, stats)``, out a tensor in the query's dtype and stats an ``sdpa.Stats`` of tensors
    (entropy, entropy_normalized, max_weight, argmax, allowed, topk_weights, topk_indices: per
    query row, from the fused kernel, no Nq × Nk weights). Shapes are sdpa's: query
    (B, Hq, Nq, Dk) (or 3 or 2 dims), key and value (B, Hkv, Nk, D) with Hq a multiple of Hkv;
    attn_mask bool or float broadcastable to (B, Hq, Nq, Nk); causal as in ``sdpa.attention``:
    False, True (= "bottom_right", FlashAttention's alignment) or "top_left" (what PyTorch's
    is_causal means; the two differ when Nq != Nk). The tensors are read in place (bfloat16
    through ml_dtypes), so this suits looking inside a model's heads from a forward hook."""
    from . import attention
    _, scale, _ = _options(0.0, scale)  # a 0-dim tensor as its number
    arrays = [_numpy_of_tensor(n, t) for n, t in (("query", query), ("key", key), ("value", value))]
    for n, a in zip(("query", "key", "value"), arrays):
        _check_real(n, a)  # here, so that the message names the argument as this function calls it
    mask = None if attn_mask is None else _numpy_of_tensor("attn_mask", attn_mask)
    kw = dict(causal=causal, scale=scale, window=window, softcap=softcap, softcap_order=softcap_order)
    for name, a in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if a is not None:
            kw[name] = _numpy_of_tensor(name, a) if isinstance(a, torch.Tensor) else a  # sdpa.attention checks them
    out, st = attention(*arrays, mask, return_stats=True, topk=topk, **kw)
    return _tensor_of_numpy(out), type(st)(*(torch.from_numpy(x) for x in st))


from ._torch_mha import MultiheadAttention  # noqa: E402  (it uses scaled_dot_product_attention above)

# sdpa.torch.distributed (ring attention over torch.distributed): a module of its own, registered
# so that `import sdpa.torch.distributed` works while sdpa.torch stays a module.
from . import _torch_distributed as distributed  # noqa: E402
sys.modules[__name__ + ".distributed"] = distributed
