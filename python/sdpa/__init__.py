"""sdpa: exact scaled dot-product attention on the CPU.

    out = softmax(q @ k.T * scale + mask) @ v

See ``sdpa.attention`` for shapes and options, and ``sdpa.attention_backward`` for its
gradients with respect to q, k and v.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np

from . import _core
from ._args import (_BFLOAT16, _FLOAT32, _FLOAT64, _KV8, _KV8_NAME, _LOW, _STORAGE_NAME, _asarray, _block_sizes, _checked_int, _compute_dtype,
                    _describe, _dtype_arg, _out_dtype_arg, _parsed_dropout, _parsed_options, _parsed_softcap, _positions,
                    _batch_invariant_arg, _precision_arg, _prepared_indices, _real_array, precision)
from ._arrays import (_MEMORY_BYTES, _converted, _core_view, _empty, _inputs_as_is, _kv8_dtype, _kv8_query_dtype,
                      _narrow_float, _prepared, _prepared_inputs, _prepared_kv_quant, _prepared_seqlens,
                      _readable_in_place, _sequence_ids)

__all__ = ["attention", "precision", "MultiHeadAttention", "LayerGradients", "Stats", "inspect", "Report", "dropout_mask", "attention_backward", "attention_varlen", "attention_varlen_backward",
           "attention_paged", "KVCache", "quantize_kv", "merge_attention", "set_num_threads", "num_threads", "block_mask_bigbird", "block_mask_dilated",
           "block_mask_documents", "block_mask_from_mask", "document_mask"]
__version__ = "0.1.0"

def _parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, block_mask=None, block_size=128, precision=None,
                 batch_invariant=False):
    """The score modifiers as _core's keyword arguments: softcap a real number (_core checks its
    range; _parsed_softcap), slopes and sinks real arrays in the compute dtype
    `dtype` (_core checks shapes and values, naming the batch and heads), a bool block_mask
    and its block sizes (_core checks its shape against them), and batch_invariant when True
    (only the forward calls take it)."""
    softcap, softcap_order = _parsed_softcap(softcap, softcap_order)
    mods = {"softcap": softcap, "softcap_order": softcap_order, "precision": _precision_arg(precision)}
    if _batch_invariant_arg(batch_invariant):
        mods["batch_invariant"] = True
    for name, a in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if a is not None:
            mods[name] = np.ascontiguousarray(_real_array(name, a), dtype=dtype)
    block_q, block_k = _block_sizes(block_size)
    if block_mask is not None:
        bm = _asarray("block_mask", block_mask)
        if bm.dtype != np.bool_:
            raise TypeError(f"block_mask has dtype {bm.dtype} but must be bool (True: the block is computed)")
        mods.update(block_mask=bm if _readable_in_place(bm) else np.ascontiguousarray(bm),
                    block_q=block_q, block_k=block_k)
    return mods


class Stats(NamedTuple):
    """Per-row statistics of the attention weights, from ``attention(..., return_stats=True)``.

    Computed by the fused kernel in its one pass over the keys (O(Nq · topk) memory: no
    Nq × Nk weights), of the weights ``return_weights`` would give (the softmax before dropout,
    after masks and score modifiers). Each field is shaped like lse, (B, Hq, Nq) (or (Hq, Nq),
    (Nq,)), the top-k ones with a last dim topk; floats in the compute dtype, integers int64::

        allowed             keys the row may attend (scores above -inf; an underflowed weight counts)
        entropy             -Σ_j w_j log w_j in nats: log(allowed) when uniform, 0 when one-hot
        entropy_normalized  entropy / log(allowed) (0 when allowed <= 1): in [0, 1], except with
                            sinks (weights summing to S < 1 allow up to S·(log n - log S))
        max_weight          the largest weight; exactly weights[..., argmax]
        argmax              the key of the largest score, the lowest on equal scores (-1: no
                            allowed key)
        topk_weights        the weights of the topk largest scores, largest first (exactly the
                            weights there)
        topk_indices        their keys, equal scores to the lower key; -1 (weight 0) past the
                            allowed keys

    Keys are ranked by score, not by weight: scores that differ keep their order where their
    weights round to the same value or underflow to 0.

    A row with no allowed key has entropy 0, max_weight 0, argmax -1. A row with a NaN score
    has NaN entropy, max_weight and top-k weights and -1 indices. With sinks the weights sum
    to less than 1 and the entropy is of the keys' weights as they are.
    """
    allowed: np.ndarray
    entropy: np.ndarray
    entropy_normalized: np.ndarray
    max_weight: np.ndarray
    argmax: np.ndarray
    topk_weights: np.ndarray
    topk_indices: np.ndarray


def _stats_arrays(lead, dtype, topk):
    """Empty arrays for Stats (lead = lse's shape), checking topk."""
    topk = _checked_int("topk", topk, 0, 32)
    return Stats(_empty("allowed", lead, np.int64), _empty("entropy", lead, dtype),
                 _empty("entropy_normalized", lead, dtype), _empty("max_weight", lead, dtype),
                 _empty("argmax", lead, np.int64), _empty("topk_weights", lead + (topk,), dtype),
                 _empty("topk_indices", lead + (topk,), np.int64))


def attention(q, k, v, mask=None, *, causal=False, scale=None, window=None, seqlens_k=None,
              return_weights=False, return_lse=False, dropout_p=0.0, seed=None, backend="auto",
              softcap=0.0, softcap_order="before_bias", alibi_slopes=None, sinks=None, block_mask=None,
              block_size=128, return_stats=False, topk=8, return_scores=None, precision=None, out_dtype=None,
              q_start=None, k_start=None, k_scale=None, v_scale=None, k_zero=None, v_zero=None, batch_invariant=False):
    """Scaled dot-product attention, ``softmax(q @ kᵀ · scale + mask) @ v``, exactly.

    Shapes (all of one call have the same number of dims, 2, 3 or 4)::

        q        (B, Hq,  Nq, Dk)     or (Hq, Nq, Dk), or (Nq, Dk) for a single head
        k        (B, Hkv, Nk, Dk)     Hq must be a multiple of Hkv (grouped-query attention:
        v        (B, Hkv, Nk, Dv)     query head h reads kv head h // (Hq // Hkv))
        mask     broadcastable to (B, Hq, Nq, Nk), NumPy rules, at most as many dims as q
        seqlens_k  (B,) integers, each in [0, Nk]; (1,) when q has no batch dim
        returns  out      (B, Hq, Nq, Dv)
                 weights  (B, Hq, Nq, Nk)   if return_weights
                 lse      (B, Hq, Nq)       if return_lse: log-sum-exp of each row's scores
                 stats    Stats of (B, Hq, Nq) if return_stats: entropy, max weight, argmax,
                          arrays (top k: (B, Hq, Nq, topk))   top k of each row's weights
                 scores   (B, Hq, Nq, Nk)   if return_scores: the raw scores at that stage

    Args:
        q, k, v: arrays or array-likes (nested lists work). Their dtypes decide those of
            the results and of the arithmetic (the compute dtype, also that of weights, lse):

                q, k, v                             out        compute, weights, lse
                float32                             float32    float32
                float64                             float64    float64
                float16                             float16    float32
                ml_dtypes.bfloat16                  bfloat16   float32
                q float32 over k and v both         float32    float32
                  float16 or both bfloat16 (a 16-bit KV cache, read as it is)
                any other mix of float32, float16   float32    float32
                  and bfloat16 (converted to float32)
                anything with float64, integers,    float64    float64
                  bool or long double (converted to float64)

            float16 and bfloat16 values are widened exactly to float32, every result is
            computed in float32 and rounded once (to nearest even) to out's dtype: float16
            in gives float16 out (earlier versions returned float32). Byte order does not
            matter (big-endian float32 computes in float32). Arrays the kernels cannot read
            in place (data not aligned to the item size, byte strides that are not a
            multiple of it, a last dim with stride != 1) are copied; broadcast (stride-0)
            dims stay broadcast. Complex, object or other dtypes (e.g. ml_dtypes' float8
            types) raise TypeError. NaN is never mistaken for a blocked key: a NaN in q, in k or in v
            makes every row that attends to it NaN (a NaN value row of a key a row blocks may
            reach it too: 0 · NaN).
        mask: bool (True = attend, False = block) or floating point, added to the scaled
            scores: finite biases, or -inf to block (NaN and +inf raise ValueError). Blocking
            happens before the softmax, never after. A float mask of q's float16 or bfloat16
            dtype is read as it is; any other float mask is converted to the compute dtype
            (exactly for float16, bfloat16 and float32 masks): a float64 mask with float32 (or
            16-bit) q, k, v becomes float32, where a bias above
            float32's largest value (about 3.4e38) raises ValueError (it would become +inf)
            and one below its lowest (e.g. -1e300) becomes -inf, i.e. blocks. That equals the
            float64 result unless every key of a row has such a bias: float64 still weighs
            that row's keys (the least negative biases win), float32 gives it the fully
            masked row's zeros and lse = -inf.
        causal: False; True or "bottom_right"; or "top_left". With Nq=2, Nk=4 (x = attend)::

                bottom_right (True)      top_left
                  k0 k1 k2 k3             k0 k1 k2 k3
              q0   x  x  x  .         q0   x  .  .  .
              q1   x  x  x  x         q1   x  x  .  .

            and with Nq=4, Nk=2, where bottom_right leaves the first Nq - Nk rows without
            any key (zeros out, lse = -inf)::

                bottom_right (True)      top_left
                  k0 k1                   k0 k1
              q0   .  .               q0   x  .
              q1   .  .               q1   x  x
              q2   x  .               q2   x  x
              q3   x  x               q3   x  x

            "bottom_right" lets query i see keys j <= i + (Nk - Nq), so the last query sees
            every key (the KV-cache convention of FlashAttention); "top_left" lets query i see
            keys j <= i (PyTorch's is_causal). They agree when Nq == Nk. Combines with mask.
        scale: multiplies q·k; default 1 / sqrt(Dk). Must be finite and held by the compute
            dtype, else ValueError: with float32 (or 16-bit) inputs a magnitude of at most about 3.4e38
            and, when not 0, not so small that it rounds to 0 (below about 7e-46).
        window: (left, right) sliding window; query i sees keys j with
            i' - left <= j <= i' + right, where i' = i + (Nk - Nq). -1 or None is unbounded.
            A bound of Nq + Nk or more reaches every key; one above 2**63 - 1 is taken as
            2**63 - 1, which is the same.
        seqlens_k: per-sequence key lengths (ONNX Attention's nonpad_kv_seqlen; a KV cache
            filled to different lengths): sequence b has keys 0 .. seqlens_k[b] - 1 and the keys
            past them are never read (that memory of k and v may hold anything, even
            uninitialised values); their weights are 0. Causal and window align to the
            sequence's own length L: bottom_right lets query i see keys j <= i + (L - Nq),
            top_left keys j <= i (and j < L). For 2 queries, 6 keys, seqlens_k = [5, 2] and
            causal bottom_right (x = attend, - = past the length)::

                b=0  k0 k1 k2 k3 k4 k5       b=1  k0 k1 k2 k3 k4 k5
                 q0   x  x  x  x  .  -        q0   x  .  -  -  -  -
                 q1   x  x  x  x  x  -        q1   x  x  -  -  -  -

        out_dtype: None (out in q's dtype, the table above) or the compute dtype: "float32" (or
            np.float32) for float16 and bfloat16 inputs gives out unrounded, the float32 partials
            that ``merge_attention`` combines without rounding to 16 bits first. Rounded to q's
            dtype (``out.astype(q.dtype)``) they are bit for bit the out of out_dtype=None. For
            float32 and float64 inputs only their own dtype. Other dtypes raise TypeError.
        return_weights, return_lse: also return the attention weights and/or the lse.
            The weights are the softmax probabilities before any dropout.
        return_stats, topk: also return a ``Stats`` of each row's weights (entropy, its
            normalised form, max weight, argmax, allowed keys, and the topk largest weights
            with their keys; topk in [0, 32], default 8), computed by the fused kernel without
            the Nq × Nk weights: for long sequences, where return_weights cannot fit.
        return_scores: also return the raw scores (ONNX Attention's qk_matmul_output_mode), in
            the compute dtype, O(Nq · Nk) memory, from a plain loop (not the fused kernel: they
            may differ from its scores by rounding): "scaled" = q·k · scale for every key (no
            mask, modifier or causal applied), "softcapped" = softcap·tanh(that / softcap) for
            every key (the cap alone, before the mask; "scaled" without a softcap), "biased" =
            "scaled" + ALiBi + the mask's bias with -inf where causal, the window or a mask
            blocks, "final" = what the softmax takes (the softcap too, in its order). ONNX's
            modes 0, 1, 2 are "scaled", "softcapped", "final". Keys past seqlens_k are -inf at
            every stage (never read).
        dropout_p, seed: dropout on the weights after the softmax: each weight (b, h, i, j) is
            dropped with probability dropout_p, kept ones are scaled by 1 / (1 - dropout_p).
            The decision is a pure function of (seed, b, h, i, j) (Philox4x32-10): the same in
            attention_backward, for any thread count, on any machine; ``dropout_mask`` shows
            it. dropout_p = 0 is exactly no dropout; a seed is required when it is > 0.
        backend: "auto" (the fastest exact kernel: today "flash"), "flash" (fused tiled SIMD
            kernel, O(N) memory), "reference" (float64, materialises the scores; the oracle
            of the tests) or "naive" (the reference's algorithm in the inputs' precision).
        precision: "exact" (default) or "fast", for bfloat16 and float16 inputs (float32 and
            float64 ignore it); None takes the enclosing ``sdpa.precision(...)`` block's. "exact"
            widens them exactly, computes in float32 and rounds out once. "fast" rounds each
            unnormalised weight p = exp(s - m) (m the running max of the online softmax) to
            the inputs' type before p·V, as FlashAttention, PyTorch's CPU flash attention and
            OpenVINO do, so that the product runs on bfloat16 instructions (AVX512_BF16), and
            normalises by the float32 sum of those same rounded weights: values all 1 give
            exactly 1 and the error has no sign. Its error against float64 is at most twice
            that of the naive algorithm that rounds the same weights (backend="naive" with
            precision="fast"). lse = m + log of that sum. weights and stats stay exact mode's
            (asking for them costs an exact pass of their own). ``attention_backward`` with
            precision="fast" rounds p before dv's product and ds before dq's and dk's.
        batch_invariant: True makes each query row's out and lse depend only on the row, its
            own keys and the options, bit for bit: not on the batch size, Nq, the other
            sequences of an ``attention_varlen`` or ``attention_paged`` batch, chunked prefill
            versus token-by-token decode, the page size or the thread count (an engine then
            gives the same result however it batches requests). It fixes the key chunks at
            multiples of 4096 keys, sums decode steps in the prefill kernel's order and uses the
            portable SIMD products (no AVX512_BF16 dot instruction); the cost is in
            docs/PERFORMANCE.md. False (default): results still do not depend on the thread
            count, but may change in the last bits with the batch's shape.
        softcap, softcap_order, alibi_slopes, sinks: score modifiers, in the fused kernels
            (forward and backward). With x = q·k · scale, query i, key j, query head h::

                "before_bias" (default):  s = softcap·tanh(x / softcap) + alibi + mask
                "after_bias":             s = softcap·tanh((x + alibi + mask) / softcap)
                alibi = -alibi_slopes[h] · |i + (L - Nq) - j|     (L = Nk, or seqlens_k[b])

            softcap: 0 (off) or a positive number (Gemma 2's logit softcapping; "before_bias"
            is FlashAttention's, Gemma's and ONNX Attention's order). A key blocked by causal,
            window, length, a bool mask or a -inf bias keeps weight exactly 0 in either order.
            alibi_slopes: (Hq,) or (B, Hq) ALiBi slopes (BLOOM, MPT); the query aligned
            bottom-right whatever ``causal`` is. sinks: (Hq,) attention-sink logits (gpt-oss,
            StreamingLLM), one more term in each row's softmax denominator with no value::

                weights[i, j] = exp(s_ij) / (exp(sinks[h]) + Σ_j' exp(s_ij'))

            so a row's weights sum to less than 1, lse includes the sink, and a row with no
            allowed key gives out = 0 and lse = sinks[h].
        block_mask, block_size: block-sparse attention (BigBird, Longformer; the helpers
            ``block_mask_bigbird``, ``block_mask_dilated`` and ``block_mask_from_mask`` build
            them). block_mask is bool, (…, ceil(Nq / bq), ceil(Nk / bk)) with (bq, bk) =
            block_size (an int for both, default 128), its leading dims broadcasting to
            (B, Hq). Query i and key j lie in block (i // bq, j // bk); where it is False the
            key is blocked for the query on top of every other mask (weight 0). The fused
            kernels skip tiles of 128 keys that a whole block of rows blocks, reading neither
            their keys nor their values, so a bk that is a multiple of 128 skips exactly the
            False blocks. For Nq = 4, Nk = 6, block_size = (2, 3) (x = attend, . = blocked)::

                block_mask = [[True, False],      k0 k1 k2 k3 k4 k5
                              [True, True]]    q0  x  x  x  .  .  .
                                               q1  x  x  x  .  .  .
                                               q2  x  x  x  x  x  x
                                               q3  x  x  x  x  x  x

        q_start, k_start: absolute positions, for a shard of a longer sequence (context
            parallelism): query row i is at position q_start + i, key j at k_start + j. None
            (the default) for both is the usual call; otherwise both are ints >= 0 (one alone,
            a negative one, or q_start + Nq or k_start + Nk past 2**63 - 1 raise ValueError
            naming it). Then causal (True, "bottom_right" or "top_left" alike) lets row i see
            key j when k_start + j <= q_start + i; the window and ALiBi measure
            (q_start + i) - (k_start + j); a block_mask is indexed by positions, block
            ((q_start + i) // bq, (k_start + j) // bk), and may be larger than those blocks
            need (the whole sequence's block_mask works for every shard); dropout draws as the
            whole call does at (b, h, q_start + i, k_start + j); seqlens_k still counts this
            call's keys. So the query rows [q0, q0 + n) against the keys [k0, k0 + m) of a
            sequence, called with q_start=q0, k_start=k0, give exactly that pair's part of the
            whole call, and the key shards' results merge by their lse::

                lse = logaddexp over the shards of lse_s
                out = sum over the shards of exp(lse_s - lse) * out_s

            A shard whose rows see none of its keys gives out = 0, lse = -inf, which the
            merge ignores. sinks: pass them to one key shard of each row only (its lse counts
            the sink; the merge then counts it once). With a sequence of 6 in chunks of 2,
            causal, the query shard at q_start=2 against key shards at k_start=0, 2, 4::

                   k_start=0   k_start=2   k_start=4
                    k0 k1       k2 k3       k4 k5
                q2   x  x        x  .        .  .     (out = 0, lse = -inf)
                q3   x  x        x  x        .  .

        k_scale, v_scale, k_zero, v_zero: an 8-bit KV cache (OpenVINO's u8 cache, llama.cpp's
            q8_0): k and v hold int8 (symmetric) or uint8 (with zero points) values, both the
            same, as ``quantize_kv`` makes them, and beside them float32 scales (and, for
            uint8, float32 zero points). Element d of key row (b, h, n) is::

                k[b, h, n, d] = fl32(fl32(k8[b, h, n, d] - z) · s)    (one float32 rounding)
                s = k_scale[b, h, n] (or k_scale[b, h, n, d // (Dk // G)]), z = k_zero[...] (0 for int8)

            and likewise v with v_scale, v_zero and Dv. Shapes::

                k_scale, k_zero   k's shape without its last dim, (B, Hkv, Nk): one per
                                  (token, kv head); or (B, Hkv, Nk, G), G dividing Dk: G groups
                v_scale, v_zero   the same for v (G dividing Dv)

            Scales are float32 arrays, read in place (another dtype raises TypeError); k and v
            must then be int8 or uint8 (TypeError otherwise; without scales integer k and v
            are numbers, converted to float64 as above). q is float32, float16 or bfloat16
            (kept; any other q is converted to float32) and everything is computed in float32
            on those dequantised values, which the float64 reference takes as the cache.
            Forward only (``attention_backward`` takes no 8-bit k and v). ValueError for
            scales or zero points of the wrong shape, non-finite ones, zero points for int8 or
            none for uint8.

    Returns:
        out, or a tuple (out, weights), (out, lse), (out, weights, lse), then stats when
        return_stats and scores when return_scores, in that order; out in q's dtype (or out_dtype), weights and lse in the compute dtype (float32 for
        float16 and bfloat16 inputs).

    A query row with no allowed key (fully masked, or Nk == 0) gives an output row of zeros,
    weights of zeros and lse = -inf; never NaN. Results are bitwise reproducible.

    Raises:
        TypeError: complex, object or string inputs, and dtypes other than those above (e.g.
            ml_dtypes' float8 types); a mask that is neither bool nor float.
        ValueError: shapes that do not fit together, a ragged nested list, a mask that does
            not broadcast, has more than 4 dims, holds NaN or +inf, or a value too large for
            the compute dtype, an unknown causal mode or backend, a non-finite scale (an
            integer beyond float64 too) or one float32 inputs cannot hold, a dropout_p outside
            [0, 1), an output (out, weights, lse) or a needed copy of an input larger than this
            machine's memory, refused before it is allocated (e.g. weights of Nq x Nk for
            inputs with Dk = 0). Messages name the argument.
    """
    # The fast path (a decode step of a small model is all overhead): arrays that _prepared_inputs
    # would pass as they are, every option but causal, backend and precision at its default.
    # It makes the slow path's call to _core, whose checks (shapes, names) are the same.
    if (mask is None and type(causal) is bool and scale is None and window is None and seqlens_k is None
            and return_weights is False and return_lse is False and return_stats is False and return_scores is None
            and type(dropout_p) is float and dropout_p == 0.0 and seed is None and type(backend) is str
            and type(softcap) is float and softcap == 0.0 and type(softcap_order) is str
            and softcap_order == "before_bias" and alibi_slopes is None and sinks is None and block_mask is None
            and type(block_size) is int and block_size == 128 and out_dtype is None and q_start is None
            and k_start is None and k_scale is None and v_scale is None and k_zero is None and v_zero is None
            and batch_invariant is False and _inputs_as_is(q, k, v)):
        shape = q.shape[:-1] + v.shape[-1:]
        # out is q's size when Dv == Dk: an array that exists (q), so _empty's checks pass.
        out = (np.empty(shape, q.dtype) if shape[-1] == q.shape[-1] and q.nbytes <= _MEMORY_BYTES
               else _empty("out", shape, q.dtype))
        if q.dtype == _BFLOAT16 or k.dtype == _BFLOAT16:
            q, k, v, out_view = _core_view(q), _core_view(k), _core_view(v), _core_view(out)
        else:
            out_view = out
        _core.attention(q, k, v, None, None, out_view, None, None, None, "bottom_right" if causal else "none", -1, -1,
                        backend, dropout_p, 0, 0.0, "before_bias", None, None, None, 128, 128, None, None, "final",
                        _precision_arg(precision))
        return out

    kv_quant = _prepared_kv_quant(k_scale, v_scale, k_zero, v_zero)
    dtype, q, k, v, mask = _prepared_inputs(q, k, v, mask, bool(kv_quant))
    causal_code, scale, left, right = _parsed_options(causal, scale, window, backend, dtype)
    p, seed = _parsed_dropout(dropout_p, seed)
    seqlens_k = _prepared_seqlens(seqlens_k)
    mods = _parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, block_mask, block_size, precision,
                        batch_invariant)

    lead = q.shape[:-1]  # (…, Hq, Nq)
    out = _empty("out", lead + (v.shape[-1],), _out_dtype_arg(out_dtype, q.dtype, dtype))
    weights = _empty("weights", lead + (k.shape[-2],), dtype) if return_weights else None
    lse = _empty("lse", lead, dtype) if return_lse else None
    stats = _stats_arrays(lead, dtype, topk) if return_stats else None
    if return_scores not in (None, "scaled", "softcapped", "biased", "final"):
        raise ValueError(f"return_scores must be None, 'scaled', 'softcapped', 'biased' or 'final', got {return_scores!r}")
    scores = _empty("scores", lead + (k.shape[-2],), dtype) if return_scores else None
    positions = _positions(q_start, k_start)
    _core.attention(*map(_core_view, (q, k, v, mask, seqlens_k, out, weights, lse)), scale, causal_code, left, right,
                    backend, p, seed, **mods, stats=list(stats) if stats is not None else None, scores=scores,
                    scores_stage=return_scores or "final", **positions, **kv_quant)

    extra = tuple(x for x in (weights, lse, stats, scores) if x is not None)
    return (out,) + extra if extra else out


class Report:
    """The page ``inspect`` made: shows itself in Jupyter (``_repr_html_``), ``save(path)``
    writes it, ``html`` is its text."""

    def __init__(self, html):
        self.html = html

    def _repr_html_(self):
        return self.html

    def save(self, path):
        with open(path, "w", encoding="utf-8") as f:
            f.write(self.html)

    def __repr__(self):
        return f"<sdpa.Report: {len(self.html)} characters of HTML>"


def inspect(q, k, v, mask=None, *, causal=False, scale=None, window=None, seqlens_k=None, backend="auto",
            softcap=0.0, softcap_order="before_bias", alibi_slopes=None, sinks=None, block_mask=None,
            block_size=128, topk=8, cells=512, max_heads=16, title="sdpa inspect", progress=True, precision=None):
    """A report of what attention does on these inputs, per head, as one self-contained HTML page
    (a ``Report``: it renders in Jupyter and ``save(path)`` writes it; ``sdpa inspect`` on the
    command line makes the same page from .npy files).

    The arguments are ``attention``'s (dropout aside: the weights are before it). Per head (the
    first ``max_heads`` in (batch, head) order): heatmaps of the weights, query rows down and
    keys across with ticks at query and key indices (real indices where a cell pools several),
    on a linear colour scale (0 to the 99th percentile of the head's cells, by nearest rank;
    brighter cells clipped) and a log10 one (the five decades below the largest cell), each
    beside a colour bar labelled with its weights, grey where every weight of a cell is exactly
    0 (blocked); the entropy and max weight of each query row as curves; a table of row sums (min,
    max), entropy and max weight, flagged near-uniform (mean normalised entropy >= 0.9) or
    near-one-hot (mean max weight >= 0.9); the top ``topk`` keys of some rows; the weights
    themselves when Nq and Nk are at most 16. Everything comes from the fused kernel's
    ``return_stats`` and per-row pooled weights: memory O(Nq · cells) per head, so inputs of
    any length get a picture of at most ``cells`` × ``cells``, one cell per weight when Nq and
    Nk fit and block averages beyond. ``progress``: a progress bar on stderr when it is a
    terminal (quiet in Jupyter).
    """
    dtype, q, k, v, mask = _prepared_inputs(q, k, v, mask)
    causal_code, scale, left, right = _parsed_options(causal, scale, window, backend, dtype)
    seqlens_k = _prepared_seqlens(seqlens_k)
    mods = _parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, block_mask, block_size, precision)
    topk, cells, max_heads = (_checked_int("topk", topk, 0, 32), _checked_int("cells", cells, 1, 4096),
                              _checked_int("max_heads", max_heads, 0))
    html = _core.inspect_report(*map(_core_view, (q, k, v, mask, seqlens_k)), scale, causal_code, left, right, backend,
                                topk, cells, max_heads, str(title), bool(progress), **mods)
    return Report(html)


def _backward_arrays(dout, out, lse, q, k, v, dtype, grad_dtype=None):
    """dout, out (q's dtype) and lse (the compute dtype `dtype`) ready for _core, and empty dq,
    dk, dv shaped like q, k, v: typed like them, or all of grad_dtype (q's dtype or the compute
    dtype, checked here) when it is given: what the backward functions take and return."""
    arrays = {name: _real_array(name, a) for name, a in (("dout", dout), ("out", out), ("lse", lse))}
    grads = (q.dtype, k.dtype, v.dtype)
    if grad_dtype is not None:
        grads = (_out_dtype_arg(grad_dtype, q.dtype, dtype, "grad_dtype"),) * 3
    return (_prepared("dout", arrays["dout"], q.dtype), _prepared("out", arrays["out"], q.dtype),
            _prepared("lse", arrays["lse"], dtype, unit_last_stride=False),
            _empty("dq", q.shape, grads[0]), _empty("dk", k.shape, grads[1]), _empty("dv", v.shape, grads[2]))


def attention_backward(dout, q, k, v, out, lse, mask=None, *, causal=False, scale=None, window=None,
                       seqlens_k=None, dropout_p=0.0, seed=None, backend="auto", softcap=0.0,
                       softcap_order="before_bias", alibi_slopes=None, sinks=None, block_mask=None,
                       block_size=128, return_dbias=False, precision=None, q_start=None, k_start=None,
                       grad_dtype=None):
    """Gradients of ``attention`` with respect to q, k and v: returns ``(dq, dk, dv)``, then
    ``dsinks`` when ``sinks`` is given (dsinks (Hq,) in the compute dtype:
    ``dsinks[h] = -Σ_b Σ_i exp(sinks[h] - lse) · rowsum(dout * out)``), then ``dbias`` when
    ``return_dbias`` (the gradient of a float mask, a learned bias: shaped like ``mask``, in the
    compute dtype, each element the sum of ``dS`` (below) over the scores that read it, so
    summed over the mask's broadcast dims; times 1 - tanh² under softcap_order="after_bias").
    dbias costs a pass of its own, about one more backward.

    Given ``dout = ∂loss/∂out`` for ``out = attention(q, k, v, mask, ...)``, with the softmax
    probabilities ``P = softmax(q @ kᵀ · scale + mask)`` (row by row, over the keys)::

        dv = Pᵀ @ dout                          D  = rowsum(dout * out)
        dP = dout @ vᵀ                          dS = P * (dP - D)
        dq = scale · dS @ k                     dk = scale · dSᵀ @ q

    For grouped-query attention (Hq = group · Hkv) dk and dv of kv head j are these sums
    over the query heads j·group .. (j+1)·group - 1 that read it. The causal and window rules
    are constants, and so is the mask unless ``return_dbias``; blocked keys receive no gradient. A query
    row with no allowed key (fully masked, Nk == 0, lse = -inf) contributes nothing: its dq
    row is zero. "auto"/"flash" recompute P from lse, tile by tile (no Nq × Nk matrix);
    "reference" and "naive" recompute each row's softmax from q and k.

    Shapes (2, 3 or 4 dims, as in ``attention``)::

        dout  (B, Hq, Nq, Dv)       like out
        q     (B, Hq,  Nq, Dk)      k  (B, Hkv, Nk, Dk)     v  (B, Hkv, Nk, Dv)
        out   (B, Hq, Nq, Dv)       lse (B, Hq, Nq)
        mask  broadcastable to (B, Hq, Nq, Nk)
        returns dq (shaped like q), dk (like k), dv (like v)

    ``out`` and ``lse`` must be what ``attention(q, k, v, mask, causal=..., scale=...,
    window=..., return_lse=True)`` returned for these very inputs and options; the gradients
    are only meaningful then (nothing checks it).

    Args:
        dout, out, lse: arrays or array-likes; dout and out are converted to the dtype
            ``attention`` gives out (q's, after its dtype policy), lse to the compute dtype
            (float32 for float32, float16 and bfloat16 q; float64 for float64).
        q, k, v, mask, causal, scale, window, seqlens_k, dropout_p, seed, backend, softcap,
            softcap_order, alibi_slopes, sinks, block_mask, block_size: as in ``attention``
            (blocked blocks get no gradient and their score tiles are skipped; keys past seqlens_k[b]
            are not read and get dk = dv = 0; under a softcap dS is multiplied by its
            derivative 1 - tanh², and ALiBi slopes get no gradient)
            (with dropout, Z the kept/dropped factors: dv = (Z*P)ᵀ @ dout, dP = Z * (dout @ vᵀ)),
            with its dtype policy: dq is returned in q's dtype and dk, dv in k's and v's
            (float16 q, k, v give float16 gradients; float32 q over bfloat16 k and v gives a
            float32 dq and bfloat16 dk, dv; integer or bool inputs give float64). Gradients of
            16-bit inputs are computed in float32 and rounded once.
        backend: "auto"/"flash" (fused FlashAttention-2 backward, O(N) extra memory),
            "reference" (float64, materialises each row's softmax) or "naive" (the
            reference's algorithm in the inputs' precision).
        precision: as ``attention``'s: "fast" rounds p = exp(s - lse) to the inputs' 16-bit type
            before dv's product and ds before dq's and dk's (float32 sums); pass the forward's.
        q_start, k_start: positions, as in ``attention``. Given the whole rows' out and lse
            (merged from every key shard's), the backward of the query rows against one key
            shard gives that pair's part of dq (sum over the key shards for the rows' dq) and
            of the shard's dk and dv (sum over the query shards). dsinks reads only out, lse
            and dout: pass sinks to one key shard's call of each row. The "reference" and
            "naive" backends use the given lse only with positions set (without, they
            recompute each row's softmax over this call's keys): set them for a shard there.
        grad_dtype: None (dq, dk, dv in q's, k's and v's dtypes, above) or the compute dtype:
            "float32" (or np.float32) for float16 and bfloat16 inputs gives all three unrounded,
            the float32 partials that sum over shards without rounding to 16 bits first
            (rounded to the inputs' dtypes they are bit for bit the gradients of
            grad_dtype=None); q's dtype is accepted too. Other dtypes raise TypeError.

    Results are bitwise reproducible, whatever the thread count.

    Raises:
        TypeError: as ``attention``, and for a dout, out or lse that is not real.
        ValueError: as ``attention``, for a dout, out or lse of the wrong shape, and for a
            dq, dk or dv larger than this machine's memory (q, k or v broadcast with stride 0
            over many rows); messages name the argument.
    """
    dtype, q, k, v, mask = _prepared_inputs(q, k, v, mask)
    causal_code, scale, left, right = _parsed_options(causal, scale, window, backend, dtype)
    p, seed = _parsed_dropout(dropout_p, seed)
    seqlens_k = _prepared_seqlens(seqlens_k)
    mods = _parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, block_mask, block_size, precision)
    dout, out, lse, dq, dk, dv = _backward_arrays(dout, out, lse, q, k, v, dtype, grad_dtype)
    dsinks = np.empty(mods["sinks"].shape, dtype) if sinks is not None else None
    dbias = None
    if return_dbias:
        if mask is None or mask.dtype == np.bool_:
            raise ValueError("return_dbias=True needs a float mask: dbias is the gradient of the mask's biases"
                             + (" (this mask is bool)" if mask is not None else " (no mask was given)"))
        dbias = np.empty(mask.shape, dtype)
    positions = _positions(q_start, k_start)
    _core.attention_backward(*map(_core_view, (q, k, v, mask, seqlens_k, out, lse, dout, dq, dk, dv)), scale, causal_code,
                             left, right, backend, p, seed, **mods, dsinks=dsinks, dbias=dbias, **positions)
    return (dq, dk, dv) + tuple(g for g in (dsinks, dbias) if g is not None)


def _prepared_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, quantized=False):
    dtype, q, k, v, _ = _prepared_inputs(q, k, v, None, quantized)
    for name, a, shape in (("q", q, "(total_q, Hq, Dk)"), ("k", k, "(total_k, Hkv, Dk)"), ("v", v, "(total_k, Hkv, Dv)")):
        if a.ndim != 3:
            raise ValueError(f"{name} has shape {a.shape}, but must be {shape} (packed sequences, token-major)")
    offsets = (_prepared_indices(name, cu, "(B + 1,) offsets")
               for name, cu in (("cu_seqlens_q", cu_seqlens_q), ("cu_seqlens_k", cu_seqlens_k)))
    return (dtype, q, k, v, *offsets)


def attention_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None, window=None,
                     return_lse=False, dropout_p=0.0, seed=None, backend="auto", softcap=0.0,
                     softcap_order="before_bias", alibi_slopes=None, sinks=None, block_mask=None, block_size=128,
                     precision=None, k_scale=None, v_scale=None, k_zero=None, v_zero=None, batch_invariant=False):
    """``attention`` on a batch of sequences of different lengths packed end to end, token-major
    (FlashAttention's ``flash_attn_varlen_func`` layout): no padding is stored or computed.

    Shapes::

        q             (total_q, Hq,  Dk)    sequence b's queries: rows cu_seqlens_q[b] .. cu_seqlens_q[b+1]-1
        k             (total_k, Hkv, Dk)    its keys: rows cu_seqlens_k[b] .. cu_seqlens_k[b+1]-1
        v             (total_k, Hkv, Dv)
        cu_seqlens_q  (B + 1,) integers: 0, then non-decreasing, ending at total_q
        cu_seqlens_k  (B + 1,) integers: 0, then non-decreasing, ending at total_k
        returns  out  (total_q, Hq, Dv)
                 lse  (Hq, total_q)         if return_lse

    For cu_seqlens_q = [0, 2, 5] and cu_seqlens_k = [0, 3, 7]::

        q rows   | 0 1 | 2 3 4   |
        k rows   | 0 1 2 | 3 4 5 6 |
                   seq 0   seq 1

    Each sequence is ``attention`` of its own rows with these options: causal and window align
    to that sequence's own lengths, dropout draws for (seed, b, h, i, j) with b the sequence and
    i, j positions inside it. Nothing crosses a sequence's boundary. dtypes, scale, window,
    dropout, backend and the score modifiers as in ``attention`` (alibi_slopes (B, Hq) give
    sequence b row b); results are bitwise reproducible. With ``batch_invariant=True`` a row's
    bits are also those of its sequence computed alone (``attention``'s batch_invariant).

    block_mask (bool) is (…, ceil(max_b Nq_b / bq), ceil(max_b Nk_b / bk)), its leading dims
    broadcasting to (B, Hq): sequence b reads the top-left ceil(Nq_b / bq) × ceil(Nk_b / bk)
    blocks of its row, in its own positions. For the sequences above, block_size=2 and
    block_mask = [[True, False], [False, True]] (every sequence and head)::

        seq 0 (2 queries, 3 keys) reads [[1, 0]]:   rows 0 1 see keys 0 1 (key 2 is in block 1)
        seq 1 (3 queries, 4 keys) reads all four:   rows 0 1 see keys 0 1, row 2 keys 2 3

    An 8-bit k and v (int8 or uint8) take their scales as ``attention`` does: k_scale, k_zero
    (total_k, Hkv) or (total_k, Hkv, G), v_scale, v_zero likewise, float32.
    """
    kv_quant = _prepared_kv_quant(k_scale, v_scale, k_zero, v_zero)
    dtype, q, k, v, cu_q, cu_k = _prepared_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k, quantized=bool(kv_quant))
    causal_code, scale, left, right = _parsed_options(causal, scale, window, backend, dtype)
    p, seed = _parsed_dropout(dropout_p, seed)
    mods = _parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, block_mask, block_size, precision,
                        batch_invariant)
    out = _empty("out", q.shape[:-1] + (v.shape[-1],), q.dtype)
    lse = _empty("lse", (q.shape[1], q.shape[0]), dtype) if return_lse else None
    _core.attention_varlen(*map(_core_view, (q, k, v, cu_q, cu_k, out, lse)), scale, causal_code, left, right, backend,
                           p, seed, **mods, **kv_quant)
    return (out, lse) if return_lse else out


def attention_varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k, *, causal=False, scale=None,
                              window=None, dropout_p=0.0, seed=None, backend="auto", softcap=0.0,
                              softcap_order="before_bias", alibi_slopes=None, sinks=None, block_mask=None,
                              block_size=128, precision=None):
    """Gradients of ``attention_varlen``: returns ``(dq, dk, dv)`` shaped like the packed q, k, v
    (and dsinks, summed over the sequences, when ``sinks`` is given). dout and out are
    (total_q, Hq, Dv), lse (Hq, total_q), as ``attention_varlen(..., return_lse=True)`` returned
    them for these inputs and options; the rest as ``attention_backward``, sequence by sequence."""
    dtype, q, k, v, cu_q, cu_k = _prepared_varlen(q, k, v, cu_seqlens_q, cu_seqlens_k)
    causal_code, scale, left, right = _parsed_options(causal, scale, window, backend, dtype)
    p, seed = _parsed_dropout(dropout_p, seed)
    mods = _parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, block_mask, block_size, precision)
    dout, out, lse, dq, dk, dv = _backward_arrays(dout, out, lse, q, k, v, dtype)
    dsinks = np.empty(mods["sinks"].shape, dtype) if sinks is not None else None
    _core.attention_varlen_backward(*map(_core_view, (q, k, v, cu_q, cu_k, out, lse, dout, dq, dk, dv)), scale,
                                    causal_code, left, right, backend, p, seed, **mods, dsinks=dsinks)
    return (dq, dk, dv) if dsinks is None else (dq, dk, dv, dsinks)


def _pool_array(name, a, quantized=False):
    """A page pool as _core reads it: in place, never copied (it may be most of memory);
    quantized (scales given): an 8-bit pool, int8 or uint8."""
    a = _asarray(name, a)
    if quantized:
        if a.dtype not in _KV8_NAME:
            raise TypeError(f"{name} has dtype {a.dtype}, but with k_scale and v_scale the pools hold an 8-bit cache's "
                            "values, int8 or uint8 (read in place, not converted)")
    elif a.dtype not in _STORAGE_NAME:
        raise TypeError(f"{name} has dtype {a.dtype}, but a page pool must be float32, float64, float16 or "
                        "ml_dtypes.bfloat16 (it is read in place, not converted), or int8 or uint8 with k_scale "
                        "and v_scale")
    if a.ndim != 4:
        raise ValueError(f"{name} has shape {a.shape}, but must be (num_pages, page_size, Hkv, D)")
    if not _readable_in_place(a) or (a.shape[-1] > 1 and a.strides[-1] != a.itemsize):
        raise ValueError(f"{name} must be aligned with a unit stride in its last dim (it is read in place)")
    return a


def _paged_query(q, pool_dtype, nq_name="q", packed=False):
    """q as the kernels take it against a pool of `pool_dtype`: the pool's dtype, or float32 over
    a 16-bit pool; over an 8-bit pool as _kv8_query_dtype says. packed: (total_q, Hq, Dk) rows
    cut by cu_seqlens_q, else (B, Hq, Nq, Dk)."""
    q = _real_array(nq_name, q)
    if q.ndim != (3 if packed else 4):
        raise ValueError(f"{nq_name} has shape {q.shape}, but must be "
                         f"{'(total_q, Hq, Dk) with cu_seqlens_q' if packed else '(B, Hq, Nq, Dk)'}")
    if pool_dtype in _KV8_NAME:
        dtype = _kv8_query_dtype(q)
    else:
        dtype = _FLOAT32 if pool_dtype in _LOW and _narrow_float(q) == _FLOAT32 else pool_dtype
    return _prepared(nq_name, q, dtype)


def attention_paged(q, k_pages, v_pages, block_table, seqlens_k, *, cu_seqlens_q=None, causal=False, scale=None,
                    window=None, return_lse=False, backend="auto", softcap=0.0, softcap_order="before_bias",
                    alibi_slopes=None, sinks=None, block_mask=None, block_size=128, precision=None, k_scale=None,
                    v_scale=None, k_zero=None, v_zero=None, batch_invariant=False):
    """``attention`` against a paged KV cache (vLLM's and FlashAttention's ``block_table``
    layout): sequence b's key j is row ``j % page_size`` of page ``block_table[b, j // page_size]``.

    Shapes::

        q            (B, Hq, Nq, Dk)                   or (total_q, Hq, Dk) with cu_seqlens_q (below)
        k_pages      (num_pages, page_size, Hkv, Dk)   float32, float64, float16 or bfloat16,
        v_pages      (num_pages, page_size, Hkv, Dv)   read in place (never copied)
        block_table  (B, max_pages) integers: the pages sequence b uses, in order; entries past
                     ceil(seqlens_k[b] / page_size) are not read (-1 is fine)
        seqlens_k    (B,) integers: sequence b has keys 0 .. seqlens_k[b] - 1
        returns out  (B, Hq, Nq, Dv)          in q's dtype
                lse  (B, Hq, Nq)              if return_lse

    Pools may have any strides with a unit last one: a head-major pool, memory
    (num_pages, Hkv, page_size, D) passed as ``pool.transpose(0, 2, 1, 3)``, keeps one head's
    rows of a page contiguous and decodes about twice as fast as the C-order layout
    (``KVCache`` stores its pool so).

    For page_size = 4, block_table[b] = [7, 2, 5], seqlens_k[b] = 10::

        keys     0 1 2 3 | 4 5 6 7 | 8 9
        pages    page 7  | page 2  | page 5 (rows 0-1)

    The same as ``attention(q, k, v, seqlens_k=seqlens_k)`` with each sequence's keys and
    values gathered in order: causal and window align to each sequence's own length (with
    ``causal=True`` a query block appended last sees the whole cache up to itself). q is
    converted to the pools' dtype, except float32 q over 16-bit pools, which is kept. Pages
    may be shared between sequences and appear in any order. Forward only; no mask.

    Packed queries (chunked prefill of sequences with different numbers of new tokens, packed
    as ``attention_varlen`` packs them): with ``cu_seqlens_q`` ((B + 1,) offsets), q is
    (total_q, Hq, Dk), sequence b's queries rows cu_seqlens_q[b] .. cu_seqlens_q[b+1] - 1,
    attending to block_table row b; out is (total_q, Hq, Dv) and lse (Hq, total_q)::

        cu_seqlens_q = [0, 3, 4]     q rows | 0 1 2 | 3 |     seqlens_k = [9, 5]
                                             seq 0   seq 1   (causal: seq 0's rows see keys
                                                              up to 6, 7, 8; seq 1's row all 5)

    Each sequence's rows are bit for bit the call with q = its rows as (1, Hq, n_b, Dk).

    Score modifiers and batch_invariant as in ``attention`` (with it, a row's bits do not depend
    on the page size, the other sequences, or whether it is decoded token by token or
    prefilled in chunks). A block_mask counts max_pages · page_size keys (the
    table's row), and with packed queries it is (…, ceil(max_b n_b / bq), ceil(max_pages ·
    page_size / bk)), of which sequence b reads its first ceil(n_b / bq) rows of blocks (as
    ``attention_varlen`` reads one).

    8-bit pools (``KVCache(..., dtype="int8")`` keeps them): k_pages and v_pages int8 or uint8,
    with their scale pools (and zero points for uint8) as ``attention`` takes them, read
    through the same block table::

        k_scale, k_zero   (num_pages, page_size, Hkv) float32, one per (token, kv head), or
                          (num_pages, page_size, Hkv, G), G groups of Dk // G features
        v_scale, v_zero   the same for v_pages (G dividing Dv)
    """
    kv_quant = _prepared_kv_quant(k_scale, v_scale, k_zero, v_zero)
    k_pages, v_pages = (_pool_array(name, a, bool(kv_quant)) for name, a in (("k_pages", k_pages), ("v_pages", v_pages)))
    if kv_quant:
        _kv8_dtype("k_pages", k_pages, "v_pages", v_pages)
    q = _paged_query(q, k_pages.dtype, packed=cu_seqlens_q is not None)
    table = _prepared_indices("block_table", block_table, "(B, max_pages) page indices", ndim=2)
    seqlens = _prepared_seqlens(seqlens_k)
    cu_q = _prepared_indices("cu_seqlens_q", cu_seqlens_q, "(B + 1,) offsets into q's rows")
    dtype = _compute_dtype(q.dtype)
    causal_code, scale, left, right = _parsed_options(causal, scale, window, backend, dtype)
    mods = _parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, block_mask, block_size, precision,
                        batch_invariant)
    out = _empty("out", q.shape[:-1] + (v_pages.shape[-1],), q.dtype)
    lse_shape = (q.shape[1], q.shape[0]) if cu_q is not None else q.shape[:-1]
    lse = _empty("lse", lse_shape, dtype) if return_lse else None
    _core.attention_paged(*map(_core_view, (q, k_pages, v_pages, table, seqlens, cu_q, out, lse)), scale, causal_code,
                          left, right, backend, **mods, **kv_quant)
    return (out, lse) if return_lse else out


class KVCache:
    """A paged KV cache that owns its page pool and the sequences' block tables, for
    ``attention_paged``::

        cache = sdpa.KVCache(num_pages=1024, page_size=16, num_kv_heads=8, head_dim_k=128)
        s = cache.new_sequence()
        cache.append(s, k_prompt, v_prompt)        # (n, Hkv, Dk), (n, Hkv, Dv) token-major
        out = cache.attention(q, [s], causal=True) # q (1, Hq, Nq, Dk) against all of s so far

    Layout (what an engine filling a pool itself reproduces)::

        k_pages  (num_pages, page_size, Hkv, Dk), v_pages (num_pages, page_size, Hkv, Dv), views of
                 memory stored head-major within a page, (num_pages, Hkv, page_size, D): one
                 head's rows of a page are contiguous, which decode streams ~2x faster
        sequence s: pages(s) = its block-table row; key j is row j % page_size of page
                    pages(s)[j // page_size], for j < length(s)

        page_size 4; s0 holds 6 tokens in pages [3, 0], s1 holds 3 in page [1]:
          page 0: s0 keys 4 5 . .   page 1: s1 keys 0 1 2 .   page 2: free   page 3: s0 keys 0-3

    ``append`` writes new tokens in place (converted to the cache's dtype, rounded once), taking
    free pages lowest first; ``free`` gives a sequence's pages back. ``attention(q, seqs)``
    attends row b of q (len(seqs), Hq, Nq, Dk) to sequence seqs[b]. Errors (ValueError) for a
    full pool, an unknown sequence, and mismatched heads, dims or token counts; nothing is
    written then. Not thread-safe while it changes.

    An 8-bit cache, ``dtype="int8"`` or ``"uint8"`` (OpenVINO's u8 KV cache is uint8 per token
    and head): k_pages and v_pages hold the 1-byte values, and beside them float32 pools
    k_scale, v_scale (and k_zero, v_zero for uint8; None for int8), views shaped::

        (num_pages, page_size, Hkv)      quant_groups=1: one scale per (token, kv head)
        (num_pages, page_size, Hkv, G)   quant_groups=G (dividing Dk and Dv): G groups of D // G

    stored head-major like the pools. ``append`` takes float32, float16 or bfloat16 k and v (any
    other real dtype is converted to float32 first) and quantises each (token, head, group)
    as ``quantize_kv`` does; a non-finite value raises ValueError and writes nothing.
    ``attention`` reads the values dequantised, fl32(fl32(x - z) · s), in float32, as
    ``attention_paged(q, k_pages, v_pages, ..., k_scale=..., v_scale=..., ...)`` does.

    Arguments are checked as ``attention`` checks its own: sizes and sequence ids are integers
    (Python or NumPy, not bool; a float such as 1.0 is a TypeError, never truncated), k and v
    real numbers (complex, strings, object or float8 arrays are a TypeError, never cast).
    """

    def __init__(self, num_pages, page_size, num_kv_heads, head_dim_k, head_dim_v=None, dtype=np.float32,
                 quant_groups=1):
        sizes = [_checked_int(name, n) for name, n in (("num_pages", num_pages), ("page_size", page_size),
                                                       ("num_kv_heads", num_kv_heads), ("head_dim_k", head_dim_k))]
        sizes.append(sizes[3] if head_dim_v is None else _checked_int("head_dim_v", head_dim_v))
        names = {**_STORAGE_NAME, **_KV8_NAME}
        self._dtype = _dtype_arg("dtype", dtype, names, "float32, float64, float16, ml_dtypes.bfloat16, int8 or uint8")
        self._c = _core.KVCache(*sizes, names[self._dtype], _checked_int("quant_groups", quant_groups))

    def new_sequence(self):
        """A new, empty sequence; returns its id (the lowest not in use)."""
        return self._c.new_sequence()

    def append(self, seq, k, v):
        """Appends tokens to sequence ``seq``: k (n, Hkv, Dk), v (n, Hkv, Dv) (an 8-bit cache
        quantises them, each (token, head, group) by ``quantize_kv``'s rule)."""
        seq = _checked_int("seq", seq)
        arrays = [(name, _real_array(name, a)) for name, a in (("k", k), ("v", v))]
        k, v = (_prepared(name, a, _kv8_query_dtype(a) if self._dtype in _KV8_NAME else self._dtype)
                for name, a in arrays)
        self._c.append(seq, _core_view(k), _core_view(v))

    def free(self, seq):
        """Gives the sequence's pages back to the pool; its id may be reused."""
        self._c.free(_checked_int("seq", seq))

    def length(self, seq):
        return self._c.length(_checked_int("seq", seq))

    def pages(self, seq):
        """The sequence's pages in order: its block-table row."""
        return list(self._c.pages(_checked_int("seq", seq)))

    def sequences(self):
        return list(self._c.sequences())

    @property
    def free_pages(self):
        return self._c.free_pages

    @property
    def page_size(self):
        return self._c.page_size

    @property
    def dtype(self):
        return self._dtype

    @property
    def k_pages(self):
        """The key pool (num_pages, page_size, Hkv, Dk): a view of the cache's memory."""
        a = self._c.k_pages()
        return a.view(_BFLOAT16) if self._dtype == _BFLOAT16 else a

    @property
    def v_pages(self):
        a = self._c.v_pages()
        return a.view(_BFLOAT16) if self._dtype == _BFLOAT16 else a

    @property
    def quant_groups(self):
        return self._c.quant_groups

    def _quant_pool(self, i, uint8_only=False):
        if self._dtype not in _KV8_NAME or (uint8_only and self._dtype != _KV8["uint8"]):
            return None
        return self._c.kv_quant_pool(i)

    @property
    def k_scale(self):
        """An 8-bit cache's key scales, float32 (num_pages, page_size, Hkv) or (..., G) with
        quant_groups G > 1: a view of the cache's memory; None for a float cache."""
        return self._quant_pool(0)

    @property
    def v_scale(self):
        return self._quant_pool(1)

    @property
    def k_zero(self):
        """A uint8 cache's key zero points, shaped like k_scale (integers 0..255 as float32); None
        for other caches."""
        return self._quant_pool(2, uint8_only=True)

    @property
    def v_zero(self):
        return self._quant_pool(3, uint8_only=True)

    def attention(self, q, seqs, *, causal=False, scale=None, window=None, return_lse=False, backend="auto",
                  softcap=0.0, softcap_order="before_bias", alibi_slopes=None, sinks=None, precision=None,
                  batch_invariant=False):
        """``attention_paged`` of q (len(seqs), Hq, Nq, Dk) against these sequences (one id, or a
        list, tuple or 1-dim array of integer ids; one may appear more than once): row b attends
        to sequence seqs[b]. Options as ``attention`` (batch_invariant: a row's bits then do not
        depend on the other sequences asked with it, nor on decoding token by token or not)."""
        seqs = _sequence_ids(seqs, "q")
        q = _paged_query(q, self._dtype)
        dtype = _compute_dtype(q.dtype)
        causal_code, scale, left, right = _parsed_options(causal, scale, window, backend, dtype)
        mods = _parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, precision=precision,
                            batch_invariant=batch_invariant)
        out = _empty("out", q.shape[:-1] + (self._c.head_dim_v,), q.dtype)
        lse = _empty("lse", q.shape[:-1], dtype) if return_lse else None
        self._c.attention(_core_view(q), seqs, _core_view(out), _core_view(lse), scale, causal_code, left, right,
                          backend, **mods)
        return (out, lse) if return_lse else out


def quantize_kv(x, dtype="int8", groups=1):
    """Quantises keys or values x for an 8-bit KV cache: returns ``(values, scale)`` for int8,
    ``(values, scale, zero)`` for uint8, which ``attention``, ``attention_varlen`` and
    ``attention_paged`` take as k (or v) with k_scale (v_scale) and k_zero (v_zero).

    Shapes::

        x        (..., D)   1 to 4 dims, e.g. k (B, Hkv, Nk, Dk): float32, float64, float16 or
                            ml_dtypes.bfloat16 (other real dtypes are converted to float64), finite
        values   (..., D)   x's shape, int8 or uint8
        scale    (...)      float32, one per row of x (x's shape without D) for groups=1, or
                 (..., G)   G = groups (dividing D) scales per row, one per D // G features
        zero     like scale float32 zero points (uint8 only): integers in [0, 255]

    The rule, per group u of features (its elements widened to float64; rne rounds to nearest
    even; the range includes 0, so that a 0 is stored exactly)::

        int8:  s = fl32(max|u| / 127), values = clamp(rne(u / s), -127, 127)
        uint8: lo = min(min u, 0), hi = max(max u, 0), s = fl32((hi - lo) / 255),
               z = clamp(rne(-lo / s), 0, 255), values = clamp(rne(u / s) + z, 0, 255)
        s = 0 (all zero): values 0, z = 0

    and the value the kernels read back is fl32(fl32(values - z) · s), within
    s · (1/2 + 2^-15) of u. OpenVINO's u8 cache is uint8 with groups=1 over (token, head) rows.

    Raises:
        TypeError: x not real (complex, object, ...), dtype not "int8" or "uint8".
        ValueError: x with 0 or more than 4 dims, groups < 1 or not dividing D, a non-finite x,
            or (float64 x) a scale beyond float32's largest value; messages name the argument.
    """
    x = _real_array("x", x)
    if not 1 <= x.ndim <= 4:
        raise ValueError(f"x has shape {x.shape}, but must have 1 to 4 dims, (..., D)")
    values_dtype = _dtype_arg("dtype", dtype, _KV8_NAME, "'int8' or 'uint8'")
    groups = _checked_int("groups", groups, 1)
    if x.shape[-1] % groups:
        raise ValueError(f"groups={groups} must divide x's last dim D = {x.shape[-1]} (x has shape {x.shape})")
    narrow = _narrow_float(x)
    x = _prepared("x", x, _FLOAT64 if narrow is None else narrow)
    scale_shape = x.shape[:-1] + ((groups,) if groups > 1 else ())
    values = _empty("values", x.shape, values_dtype)
    scale = _empty("scale", scale_shape, _FLOAT32)
    zero = _empty("zero", scale_shape, _FLOAT32) if values_dtype == _KV8["uint8"] else None
    _core.quantize_kv(_core_view(x), values, scale, zero)
    return (values, scale) if zero is None else (values, scale, zero)


def dropout_mask(shape, dropout_p, seed):
    """The dropout decisions of ``attention(..., dropout_p=dropout_p, seed=seed)``: a bool array
    of ``shape`` (that of the weights: (Nq, Nk), (Hq, Nq, Nk) or (B, Hq, Nq, Nk)), True where
    weight (b, h, i, j) is kept. Kept weights are scaled by 1 / (1 - dropout_p).

    Raises TypeError for a shape that is not a sequence of integers, ValueError for one with
    a negative dim, not 2, 3 or 4 dims, or more elements than this machine's memory holds,
    and as ``attention`` for dropout_p and seed."""
    p, seed = _parsed_dropout(dropout_p, seed)
    try:
        dims = tuple(shape)
    except TypeError:
        raise TypeError(f"shape must be a tuple of integers like the weights' shape, got {_describe(shape)}") from None
    dims = tuple(_checked_int(f"shape[{i}]", n, 0) for i, n in enumerate(dims))
    if not 2 <= len(dims) <= 4:
        raise ValueError(f"shape must have 2, 3 or 4 dims like the weights, got {dims}")
    mask = _empty("the dropout mask", dims, np.bool_)
    _core.dropout_mask(p, seed, mask)
    return mask


def _partial_array(name, a, lse):
    """A partial's out (float16, bfloat16, float32 or float64) or lse (float32 or float64), in
    either byte order, readable in place by _core; other dtypes TypeError naming it."""
    a = _real_array(name, a)
    dt = _narrow_float(a) if a.dtype.kind == "f" or a.dtype == _BFLOAT16 else None
    if dt is None and a.dtype.kind == "f" and a.dtype.itemsize == 8:
        dt = _FLOAT64
    if dt is None or (lse and dt not in (_FLOAT32, _FLOAT64)):
        raise TypeError(f"{name} has dtype {a.dtype}, but must be "
                        f"{'float32 or float64' if lse else 'float16, bfloat16, float32 or float64'}")
    return _converted(name, a, dt)


def merge_attention(outs, lses, *, out_dtype=None):
    """Merges partial attention results of the same query rows by their log-sum-exp, in the
    order given (the C++ sdpa::merge_attention, include/sdpa/merge.h).

    Split a problem's keys into shards (k, v and the mask's key columns sliced alike), call
    ``attention(q, k_s, v_s, mask_s, return_lse=True, out_dtype=<compute dtype>)`` once per
    shard, and merge: the result is the one call's, within its tolerance::

        m   = max_s lses[s]
        w_s = exp(lses[s] - m)
        out = Σ_s w_s · outs[s] / Σ_s w_s
        lse = m + log(Σ_s w_s)

    Shapes::

        outs[s]   (…, N, Dv)   one shape for every s: attention's out, 2 to 4 dims
        lses[s]   (…, N)       outs' shape without its last dim: attention's lse
        returns   out (…, N, Dv), lse (…, N)

    Args:
        outs, lses: sequences of one length, at least 1 (a 2-way merge: ``merge_attention([a,
            b], [lse_a, lse_b])``). outs float16, bfloat16, float32 or float64; lses float32 or
            float64; any strides. For attention_varlen's (Hq, total_q) lse pass ``lse.T``.
        out_dtype: out's dtype: None gives the compute dtype (float64 when any of outs or lses
            is float64, else float32), to merge further; q's 16-bit dtype rounds the merge once.
            (float64 here with float32 parts merges in float64, and lse still comes back in the
            parts' compute dtype, float32.)

    The arithmetic is in the compute dtype, in the order given: the same partials in the same
    order give the same bits, for any thread count. A partial with lse = -inf (all its keys
    masked) adds exactly nothing (its out is not read); a row whose lses are all -inf gives out
    0 and lse -inf. Sinks enter once: pass ``sinks`` to one shard's call only. Causal, window,
    ALiBi, a block mask and dropout depend on positions: give each shard's call its q_start and
    k_start (``attention``), and it is its part of the one call with them too. No gradient (NumPy has no autograd; the backward of a
    shard is ``attention_backward`` with the merged out and lse).

    Returns:
        (out, lse): out (…, N, Dv) of out_dtype, lse (…, N) of the compute dtype.

    Raises:
        TypeError: a dtype other than those above.
        ValueError: outs and lses of different lengths or empty, shapes that differ (the
            message names the part and both shapes), an lse holding +inf or NaN (naming the
            part and the row).
    """
    outs, lses = list(outs), list(lses)
    if len(outs) != len(lses):
        raise ValueError(f"outs has {len(outs)} arrays but lses has {len(lses)}: one lse per out")
    outs = [_partial_array(f"outs[{s}]", a, False) for s, a in enumerate(outs)]
    lses = [_partial_array(f"lses[{s}]", a, True) for s, a in enumerate(lses)]
    compute = _FLOAT64 if any(a.dtype == _FLOAT64 for a in outs + lses) else _FLOAT32
    dtype = compute if out_dtype is None else _dtype_arg("out_dtype", out_dtype, _STORAGE_NAME,
                                                        "float32, float64, float16 or ml_dtypes.bfloat16")
    shape = outs[0].shape if outs else (0, 0)
    out = _empty("out", shape, dtype)
    lse = _empty("lse", shape[:-1], compute)
    _core.merge_attention([_core_view(a) for a in outs], [_core_view(a) for a in lses], _core_view(out), lse)
    return out, lse


def set_num_threads(n):
    """Sets the threads sdpa's kernels use; 0 restores OpenMP's default (OMP_NUM_THREADS,
    else all cores). Outputs are bitwise identical whatever the count.

    Raises TypeError for an n that is not an integer, ValueError for one outside [0, 2**31)."""
    _core.set_num_threads(_checked_int("set_num_threads: n", n, 0, 2**31 - 1))


def num_threads():
    """The number of threads sdpa's kernels use."""
    return _core.num_threads()


# blocks.py and layer.py use the helpers above.
from .blocks import (block_mask_bigbird, block_mask_dilated, block_mask_documents, block_mask_from_mask,  # noqa: E402
                     document_mask)
from .layer import LayerGradients, MultiHeadAttention  # noqa: E402
