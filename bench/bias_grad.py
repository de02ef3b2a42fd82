#!/usr/bin/env python3
"""What the float mask's gradient (dbias, a learned bias such as T5's) costs: attention_backward
with and without return_dbias on the same float32 inputs, interleaved round by round, medians of
--reps rounds; beside it PyTorch's own backward with a mask that requires grad (its math path
materialises the scores), when torch is installed. The dbias is checked against a float64 NumPy
computation on a slice first, so that what is timed is right.

    .venv/bin/python bench/bias_grad.py [--b 2] [--heads 8] [--n 512] [--d 64] [--threads 2] [--reps 5]
"""

import argparse
import statistics

import numpy as np

import sdpa
from cpu import cpu_flags, median_time  # bench/cpu.py (the script's folder is on sys.path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--b", type=int, default=2)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--n", type=int, default=512)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    args = ap.parse_args()
    sdpa.set_num_threads(args.threads)
    B, H, N, D = args.b, args.heads, args.n, args.d
    rng = np.random.default_rng(0)
    q, k, v, dout = (rng.standard_normal((B, H, N, D)).astype(np.float32) for _ in range(4))
    mask = rng.standard_normal((N, N)).astype(np.float32)  # one bias for every batch and head (T5)
    print(f"CPU: {cpu_flags()}; threads {args.threads}; ({B}, {H}, {N}, {D}) float32, mask ({N}, {N})")

    # Check on a slice: dbias against float64 NumPy maths.
    s = slice(0, 1)
    qs, ks, vs, ds = (x[s, :2, :97].astype(np.float64) for x in (q, k, v, dout))
    ms = mask[:97, :97].astype(np.float64)
    out, lse = sdpa.attention(qs, ks, vs, ms, return_lse=True)
    got = sdpa.attention_backward(ds, qs, ks, vs, out, lse, ms, return_dbias=True)[3]
    sc = qs @ np.swapaxes(ks, -1, -2) / np.sqrt(D) + ms
    p = np.exp(sc - sc.max(-1, keepdims=True))
    p /= p.sum(-1, keepdims=True)
    want = (p * (ds @ np.swapaxes(vs, -1, -2) - (ds * (p @ vs)).sum(-1, keepdims=True))).sum((0, 1))
    assert np.max(np.abs(got - want)) < 1e-10, np.max(np.abs(got - want))

    out, lse = sdpa.attention(q, k, v, mask, return_lse=True)
    plain = lambda: sdpa.attention_backward(dout, q, k, v, out, lse, mask)  # noqa: E731
    with_dbias = lambda: sdpa.attention_backward(dout, q, k, v, out, lse, mask, return_dbias=True)  # noqa: E731
    t_plain, t_bias = [], []
    for _ in range(args.reps):
        t_plain.append(median_time(plain, 1))
        t_bias.append(median_time(with_dbias, 1))
    tp, tb = statistics.median(t_plain), statistics.median(t_bias)
    print(f"sdpa backward            {tp * 1e3:9.1f} ms")
    print(f"sdpa backward + dbias    {tb * 1e3:9.1f} ms   ({tb / tp:.2f}x; the dbias pass {(tb - tp) * 1e3:.1f} ms)")
    try:
        import torch
    except ImportError:
        print("torch: not installed")
        return
    torch.set_num_threads(args.threads)
    tq, tk, tv, tdo = (torch.from_numpy(x) for x in (q, k, v, dout))
    tm = torch.from_numpy(mask).requires_grad_()

    def torch_step():
        qq, kk, vv = (x.detach().requires_grad_() for x in (tq, tk, tv))
        o = torch.nn.functional.scaled_dot_product_attention(qq, kk, vv, attn_mask=tm)
        o.backward(tdo)
        tm.grad = None

    def torch_fwd():
        with torch.no_grad():
            torch.nn.functional.scaled_dot_product_attention(tq, tk, tv, attn_mask=tm)

    t_step, t_fwd = median_time(torch_step, args.reps), median_time(torch_fwd, args.reps)
    print(f"torch {torch.__version__} forward+backward with mask grad {t_step * 1e3:9.1f} ms "
          f"(its forward alone {t_fwd * 1e3:.1f} ms; backward ~{(t_step - t_fwd) * 1e3:.1f} ms)")


if __name__ == "__main__":
    main()
