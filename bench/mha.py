#!/usr/bin/env python3
"""The multi-head attention layer, forward + backward (issue 14's target: >= 1.3x
torch.nn.MultiheadAttention at B=4, N=1024, d_model=512, H=8, float32, 2 threads), in one
process, interleaved round by round; medians of --reps rounds. Variants:

    torch                 torch.nn.MultiheadAttention, need_weights=False (its SDPA path)
    torch need_weights    the same with torch's default need_weights=True (explicit weights)
    sdpa.torch            sdpa.torch.MultiheadAttention (torch's F.linear, sdpa's kernel), need_weights=False
    sdpa C++ layer        sdpa.MultiHeadAttention (NumPy front door: OpenBLAS products, sdpa's kernel)

All start from one state_dict; before timing, each variant's output and input gradient are
checked against torch's (float32 tolerance), so that what is timed is right. GFLOP/s counts
the products: projections 2·B·N·E·(4E) forward and twice that backward, attention 4·B·H·N²·D
forward and 10·B·H·N²·D backward (the backward recomputes the scores: 5 products of 2·N²·D),
halved for the attention part with --causal.

With --bf16 the same variants also run in bfloat16 in the same rounds (parameters and
activations bfloat16: torch's module .to(torch.bfloat16), sdpa.torch's likewise, the C++ layer
with dtype=ml_dtypes.bfloat16), sdpa's in both precisions ("exact", "fast"); each bfloat16
variant is checked against torch's bfloat16 module (a sanity bound, 3e-2 · (1 + max|y|)), and
the speed-ups are printed against torch's module of the same dtype.

    .venv/bin/python bench/mha.py [--batch 4] [--n 1024] [--d-model 512] [--heads 8] [--threads 2]
                                  [--causal] [--reps 7] [--bf16]
"""

import argparse
import statistics
import time

import copy

import ml_dtypes
import numpy as np
import torch

import sdpa
import sdpa.torch
from cpu import cpu_flags  # bench/cpu.py (the script's folder is on sys.path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--n", type=int, default=1024)
    ap.add_argument("--d-model", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--causal", action="store_true")
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--bf16", action="store_true", help="also the bfloat16 variants (both precisions)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    sdpa.set_num_threads(args.threads)
    B, N, E, H = args.batch, args.n, args.d_model, args.heads
    D = E // H
    print(f"CPU: {cpu_flags()}; threads {args.threads}; torch {torch.__version__}")
    print(f"layer B={B} N={N} d_model={E} H={H} float32{' and bfloat16' if args.bf16 else ''}"
          f"{' causal' if args.causal else ''}, forward + backward")

    torch.manual_seed(0)
    ref = torch.nn.MultiheadAttention(E, H, batch_first=True)
    ours = sdpa.torch.MultiheadAttention(E, H, batch_first=True)
    ours.load_state_dict(ref.state_dict())
    layer = sdpa.MultiHeadAttention(E, H)
    w = ref.in_proj_weight.detach().numpy()
    layer.w_q, layer.w_k, layer.w_v = (w[i * E:(i + 1) * E].T.copy() for i in range(3))
    layer.b_q, layer.b_k, layer.b_v = (ref.in_proj_bias.detach().numpy()[i * E:(i + 1) * E].copy() for i in range(3))
    layer.w_o = ref.out_proj.weight.detach().numpy().T.copy()
    layer.b_o = ref.out_proj.bias.detach().numpy().copy()

    x = torch.randn(B, N, E)
    dy = torch.randn(B, N, E)
    mask = torch.ones(N, N, dtype=torch.bool).triu(1) if args.causal else None

    def torch_step(module, need_weights):
        def run():
            xi = x.clone().requires_grad_(True)
            y, _ = module(xi, xi, xi, need_weights=need_weights, attn_mask=mask, is_causal=args.causal)
            y.backward(dy)
            return y, xi.grad
        return run

    def layer_step():
        y = layer(x.numpy(), causal=args.causal)
        return torch.from_numpy(y), torch.from_numpy(layer.backward(dy.numpy()).x_q)

    variants = {"torch": torch_step(ref, False), "torch need_weights": torch_step(ref, True),
                "sdpa.torch": torch_step(ours, False), "sdpa C++ layer": layer_step}
    want_y, want_dx = variants["torch"]()
    for name, fn in variants.items():
        y, dx = fn()
        for what, got, want in (("y", y, want_y), ("dx", dx, want_dx)):
            err = (got.detach() - want).abs().max().item()
            assert err < 1e-4 * (1 + want.abs().max().item()), (name, what, err)

    if args.bf16:
        bf16 = torch.bfloat16
        ref16, ours16 = copy.deepcopy(ref).to(bf16), copy.deepcopy(ours).to(bf16)
        layer16 = sdpa.MultiHeadAttention(E, H, dtype=ml_dtypes.bfloat16)
        for name, a in layer.parameters().items():
            setattr(layer16, name, a.astype(ml_dtypes.bfloat16))
        x16, dy16 = x.to(bf16), dy.to(bf16)
        x16n, dy16n = (t.float().numpy().astype(ml_dtypes.bfloat16) for t in (x16, dy16))

        def torch_step16(module, **kw):
            def run():
                xi = x16.clone().requires_grad_(True)
                y, _ = module(xi, xi, xi, need_weights=False, attn_mask=mask, is_causal=args.causal, **kw)
                y.backward(dy16)
                return y, xi.grad
            return run

        def layer_step16(precision):
            def run():
                y = layer16(x16n, causal=args.causal, precision=precision)
                dx = layer16.backward(dy16n).x_q
                return (torch.from_numpy(a.astype(np.float32)) for a in (y, dx))
            return run

        variants16 = {"torch bf16": torch_step16(ref16), "sdpa.torch bf16 exact": torch_step16(ours16),
                      "sdpa.torch bf16 fast": torch_step16(ours16, precision="fast"),
                      "sdpa C++ bf16 exact": layer_step16("exact"), "sdpa C++ bf16 fast": layer_step16("fast")}
        want_y, want_dx = (t.float() for t in variants16["torch bf16"]())
        for name, fn in variants16.items():
            y, dx = fn()
            for what, got, want in (("y", y, want_y), ("dx", dx, want_dx)):
                err = (got.detach().float() - want).abs().max().item()
                assert err < 3e-2 * (1 + want.abs().max().item()), (name, what, err)
        variants.update(variants16)

    times = {name: [] for name in variants}
    for _ in range(args.reps + 1):  # the first round warms up and is dropped
        for name, fn in variants.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    attn = 14 * B * H * N * N * D / (2 if args.causal else 1)
    flops = 3 * 2 * B * N * E * 4 * E + attn
    base = {False: statistics.median(times["torch"][1:])}
    if args.bf16:
        base[True] = statistics.median(times["torch bf16"][1:])
    print(f"{'variant':22s} {'ms':>9s} {'GFLOP/s':>8s} {'vs torch (same dtype)':>22s}")
    for name, ts in times.items():
        t = statistics.median(ts[1:])
        print(f"{name:22s} {t * 1e3:9.1f} {flops / t / 1e9:8.1f} {base['bf16' in name] / t:21.2f}x")


if __name__ == "__main__":
    main()
