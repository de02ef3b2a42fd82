"""sdpa inside Hugging Face transformers models, chosen by name.

    import sdpa.transformers
    name = sdpa.transformers.register()          # "sdpa_cpu"
    model = AutoModelForCausalLM.from_pretrained(path, attn_implementation=name)

``register(name)`` adds two functions to transformers (5.x) under ``name``: an attention function
(``AttentionInterface``) that runs every attention layer of the model on sdpa's torch operator
(``torch.ops.sdpa.attention``, the one ``sdpa.torch.scaled_dot_product_attention`` calls, with
its autograd), and a mask function (``AttentionMaskInterface``) so that the model hands that
attention function a ``KeyMask`` -- which keys exist, which of them are padding, causal or not,
the sliding window -- instead of a dense (batch, 1, Nq, Nk) mask. Each layer then makes one
call:

- causal: sdpa's bottom-right causal on the keys the cache holds (a generation step's queries
  are the last rows), cut to the keys the queries can reach (a ``StaticCache`` holds more);
- padding, only when some key is padding: right padding (every row's real keys a prefix, as a
  tokenizer pads a batch by default) as sdpa's ``seqlens_k`` (the kernels skip the padded keys
  instead of masking them) where the queries are the keys' own positions (no cache before them)
  or the layer is bidirectional, and no sliding window; otherwise, and for left padding (batched
  ``generate()`` pads left), a bool key-padding mask of shape (batch, 1, 1, Nk), broadcast by
  sdpa. Query rows that are padding themselves and see no key give zeros, as PyTorch 2.15's
  function does;
- sliding windows (Mistral, Gemma 2, Qwen2, gpt-oss): sdpa's window, ``window_left =
  sliding_window - 1`` as transformers' mask counts it (bidirectional: ``sliding_window`` on
  both sides);
- grouped-query attention: the key/value heads as they are (no repeat);
- ``softcap`` (Gemma 2's ``attn_logit_softcapping``: ``cap·tanh(s / cap)``), ``s_aux`` (gpt-oss's
  attention sinks, with their gradient), ``scaling`` and ``dropout`` (training).

What sdpa cannot express raises ValueError naming the model's feature and config field, never
a different result: a dense 4-D mask passed in by the caller, chunked attention
(``attention_chunk_size``), packed sequences (``position_ids`` restarting inside a row), mask
functions a model adds (``or_mask_function`` / ``and_mask_function``, e.g. image tokens),
``position_bias`` (T5's relative attention bias). ``output_attentions`` returns no weights, as
transformers' "sdpa" does.

Importing ``sdpa`` imports neither torch nor transformers; this module imports torch (through
``sdpa.torch``), and ``register`` imports transformers.
"""

from __future__ import annotations

import inspect

import torch

from .torch import _attention, _options

__all__ = ["register", "KeyMask", "attention_forward", "key_mask"]


class KeyMask:
    """What the registered mask function hands each attention layer instead of a dense mask.

    keys    the number of leading keys (of the layer's key/value tensors) that the queries may
            reach; the layer reads keys[:, :, :keys] (a view). The queries are the last rows of
            those keys' positions: query i is at position keys - Nq + i (bottom-right).
    valid   None (no padding) or a bool (batch, keys) tensor: True where the key is a real token.
    lengths None, or when valid is right padding (each row's real keys a prefix) the (batch,)
            int64 tensor of those prefixes' lengths (valid's row sums).
    causal  whether query i sees only keys at positions <= its own.
    window  None, or transformers' sliding_window: with causal, keys at positions > p - window
            (p the query's); without, keys within window of p on both sides."""

    __slots__ = ("keys", "valid", "causal", "window", "shape", "lengths")
    # It reads as 4-D, the (batch, 1, Nq, keys) mask it stands for, so that transformers passes it
    # on as a prepared mask (generate() builds the masks ahead of the forward for a StaticCache).
    ndim = 4

    def __init__(self, keys, valid, causal, window, shape, lengths=None):
        self.keys, self.valid, self.causal, self.window, self.shape = keys, valid, causal, window, shape
        self.lengths = lengths

    def __repr__(self):
        valid = None if self.valid is None else tuple(self.valid.shape)
        return (f"KeyMask(keys={self.keys}, valid={valid}, causal={self.causal}, window={self.window}, "
                f"right_padded={self.lengths is not None})")

    def __len__(self):
        return 4


def _pattern(mask_function, local_size):
    """(causal, window) of one of the mask functions transformers' mask builders pass; ValueError
    naming the feature for any other (sdpa has no way to express an arbitrary mask function)."""
    from transformers import masking_utils as mu

    if mask_function is mu.causal_mask_function:
        return True, None
    if mask_function is mu.bidirectional_mask_function:
        return False, None
    parts = ()
    if getattr(mask_function, "__qualname__", "") == "and_masks.<locals>.and_mask":
        parts = inspect.getclosurevars(mask_function).nonlocals.get("mask_functions", ())
    names = [getattr(f, "__qualname__", "") for f in parts]
    if len(parts) == 2 and local_size is not None:
        if names[0] == "sliding_window_overlay.<locals>.inner_mask" and parts[1] is mu.causal_mask_function:
            return True, _window_of(parts[0], local_size)
        if (names[0] == "sliding_window_bidirectional_overlay.<locals>.inner_mask"
                and parts[1] is mu.bidirectional_mask_function):
            return False, _window_of(parts[0], local_size)
        if names[0] == "chunked_overlay.<locals>.inner_mask":
            raise ValueError(f"sdpa cannot express chunked attention (the model's config sets "
                             f"attention_chunk_size={local_size}); use attn_implementation='sdpa' or 'eager'")
    raise ValueError(f"sdpa expresses causal, bidirectional and sliding-window masks with padding, but this model "
                     f"builds its mask from another mask function ({getattr(mask_function, '__qualname__', mask_function)}"
                     f": packed sequences, whose position_ids restart inside a row, or an or_mask_function / "
                     f"and_mask_function the model adds, e.g. for image tokens); use attn_implementation='sdpa' or "
                     f"'eager' for it")


def _window_of(overlay, local_size):
    window = inspect.getclosurevars(overlay).nonlocals.get("sliding_window")
    if window != local_size:  # transformers passes the window twice; they cannot differ
        raise ValueError(f"the sliding-window mask function has sliding_window={window} but local_size={local_size}")
    return int(window)


def key_mask(batch_size, q_length, kv_length, q_offset=0, kv_offset=0, mask_function=None, attention_mask=None,
             local_size=None, **kwargs):
    """The mask function registered with transformers' AttentionMaskInterface: a KeyMask for the
    layers (see the class) from transformers' mask arguments -- the pattern, the 2-D padding mask
    (batch, positions) and where the cache's keys (kv_offset) and this call's queries (q_offset)
    start. ValueError for a pattern sdpa cannot express (_pattern)."""
    from transformers import masking_utils as mu

    if isinstance(attention_mask, KeyMask):  # already prepared (generate() with a StaticCache)
        return attention_mask
    causal, window = _pattern(mask_function, local_size)
    q_offset, kv_offset = int(q_offset), int(kv_offset)
    # Bidirectional layers see every key; causal ones the keys up to the last query's position
    # (a StaticCache holds kv_length >= that, the rest not yet written).
    keys = q_offset + q_length - kv_offset if causal else kv_length
    if not 0 <= keys <= kv_length or (causal and keys < q_length):
        raise ValueError(f"the cache's keys (kv_length={kv_length} from position {kv_offset}) do not hold this call's "
                         f"{q_length} queries at position {q_offset}")
    valid = lengths = None
    if attention_mask is not None:
        padding = mu.prepare_padding_mask(attention_mask, kv_length, kv_offset)[:, kv_offset:kv_offset + keys]
        if not bool(padding.all()):
            valid = padding.to(torch.bool)
            lengths = _prefix_lengths(valid)
    return KeyMask(keys, valid, causal, window, (batch_size, 1, q_length, keys), lengths)


def _prefix_lengths(valid):
    """The (batch,) int64 lengths of valid's rows when each row's True entries are a prefix
    (right padding), else None."""
    lengths = valid.sum(-1)
    prefix = torch.arange(valid.shape[-1], device=valid.device) < lengths[:, None]
    return lengths if bool((prefix == valid).all()) else None


def _refuse(what):
    raise ValueError(f"sdpa cannot express {what}; use attn_implementation='sdpa' or 'eager' for this model")


def attention_forward(module, query, key, value, attention_mask, dropout=0.0, scaling=None, sliding_window=None,
                      softcap=None, s_aux=None, is_causal=None, position_bias=None, **kwargs):
    """The attention function registered with transformers' AttentionInterface: query (B, Hq, Nq,
    D), key and value (B, Hkv, Nk, D) / (B, Hkv, Nk, Dv) with Hkv dividing Hq, attention_mask a
    KeyMask from ``key_mask`` (or None: no padding, causal as the module says); returns
    (out (B, Nq, Hq, Dv) contiguous, None)."""
    if position_bias is not None:
        _refuse("a position_bias tensor (T5's relative attention bias)")
    if isinstance(attention_mask, torch.Tensor):
        _refuse(f"a dense attention_mask of shape {tuple(attention_mask.shape)} (a 4-D mask passed to the model); "
                f"pass the 2-D padding mask (batch, positions) instead")
    if attention_mask is None:
        causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
        window, keys, valid, lengths = sliding_window, key.shape[2], None, None
    elif isinstance(attention_mask, KeyMask):
        causal, window, keys, valid, lengths = (attention_mask.causal, attention_mask.window, attention_mask.keys,
                                                attention_mask.valid, attention_mask.lengths)
        if sliding_window is not None and window != sliding_window:
            raise ValueError(f"the layer's sliding_window={sliding_window} (config.sliding_window) is not the "
                             f"window of the mask the model built for it ({window})")
    else:
        raise TypeError(f"attention_mask must be a KeyMask (from the mask function that sdpa.transformers.register "
                        f"registers) or None, got {type(attention_mask).__name__}")
    if keys != key.shape[2]:
        key, value = key[:, :, :keys], value[:, :, :keys]
    causal_name = "bottom_right" if causal else "none"
    seqlens = None
    # sdpa aligns causal and the window to each sequence's own length: that is the queries'
    # positions when they are the keys' own (top-left then equals bottom-right over all keys) or
    # when no causal mask or window looks at positions.
    if lengths is not None and window is None and (not causal or query.shape[2] == keys):
        mask, seqlens, causal_name = None, lengths, "top_left" if causal else "none"
    else:
        mask = None if valid is None else valid[:, None, None, :]
    if window is None:
        left, right = -1, -1
    else:
        left, right = window - 1 if causal else window, -1 if causal else window
    if dropout == 0.0 and (scaling is None or type(scaling) is float):
        seed = None
    else:
        dropout, scaling, seed = _options(dropout, scaling)
    mods = ()
    if softcap is not None or s_aux is not None:
        mods = (float(softcap or 0.0), False, None, None if s_aux is None else _sinks(s_aux))
    extra = {"seqlens_k": seqlens} if seqlens is not None else {}
    out, _ = _attention(query, key, value, mask, causal_name, scaling, left, right, dropout, seed, *mods, **extra)
    return out.transpose(1, 2).contiguous(), None


def _sinks(s_aux):
    """gpt-oss's s_aux (Hq,) as the operator's sinks: float32 unless float64 (a bfloat16
    parameter's gradient flows back through the conversion)."""
    return s_aux if s_aux.dtype in (torch.float32, torch.float64) else s_aux.float()


def register(name="sdpa_cpu"):
    """Registers sdpa with transformers under ``name`` (an attention function and a mask
    function) and returns the name, for ``from_pretrained(..., attn_implementation=name)`` or
    ``from_config(config, attn_implementation=name)``. Registering again replaces them.
    transformers applies its check for PyTorch's function (the model's ``_supports_sdpa``) to
    every name that contains "sdpa", and Gemma 2 and gpt-oss fail it although sdpa runs them
    (softcap, sinks): register another name for those, e.g. ``register("exact_cpu")``. transformers
    (5.x) has no flag to skip that check for a registered function: it reads the model class's
    ``_supports_sdpa`` whenever the name contains "sdpa"."""
    if not isinstance(name, str) or not name:
        raise TypeError(f"name must be a non-empty str, got {name!r}")
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface

    AttentionInterface.register(name, attention_forward)
    AttentionMaskInterface.register(name, key_mask)
    return name
