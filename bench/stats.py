#!/usr/bin/env python3
"""What the fused statistics cost (issue 13's targets: entropy + max weight <= 10 %, top-k with
k = 8 <= 30 % over the plain forward), in one process so that the ratios compare like with like.
Each row times sdpa.attention on the same float32 inputs with return_stats (topk 0 or 8) against
the plain call, interleaved round by round; medians of --reps rounds. GFLOP/s counts
4·B·Hq·Nq·Nk·D (halved for causal), as `sdpa bench` does. Before timing, each variant's
statistics are checked against NumPy's entropy of the reference backend's weights (on a
slice: the full problem is too big for it), so that what is timed is right.

    .venv/bin/python bench/stats.py [--n 4096] [--d 64] [--heads 8] [--threads 2] [--reps 7]
"""

import argparse
import statistics
import time

import numpy as np

import sdpa
from cpu import cpu_flags  # bench/cpu.py (the script's folder is on sys.path)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    sdpa.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    H, N, D = args.heads, args.n, args.d
    q, k, v = (rng.standard_normal((1, H, N, D)).astype(np.float32) for _ in range(3))
    print(f"CPU: {cpu_flags()}; threads {args.threads}; (1, {H}, {N}, {D}) float32")

    shapes = {"prefill causal": dict(q=q, causal=True), "prefill": dict(q=q, causal=False),
              "decode (Nq 1)": dict(q=q[:, :, -1:], causal=False)}
    for shape, kw in shapes.items():
        s = slice(max(0, kw["q"].shape[2] - 64), kw["q"].shape[2])
        qs = kw["q"][:, :, s]
        _, w = sdpa.attention(qs, k, v, causal=kw["causal"], return_weights=True, backend="reference")
        H_ref = -np.where(w > 0, w * np.log(np.where(w > 0, w, 1)), 0).sum(-1)
        for topk in (0, 8):
            st = sdpa.attention(qs, k, v, causal=kw["causal"], return_stats=True, topk=topk)[1]
            assert np.abs(st.entropy - H_ref).max() < 1e-3, (shape, topk)
            if topk:
                assert np.allclose(np.take_along_axis(w, st.topk_indices, -1), -np.sort(-w, -1)[..., :topk], atol=1e-5)

    for shape, kw in shapes.items():
        qq, causal = kw["q"], kw["causal"]
        flops = 4 * H * qq.shape[2] * N * D / (2 if causal else 1)
        variants = {"plain": None, "stats": 0, "stats + top-8": 8}
        times = {name: [] for name in variants}
        for _ in range(args.reps + 1):  # the first round warms up and is dropped
            for name, topk in variants.items():
                t0 = time.perf_counter()
                if topk is None:
                    sdpa.attention(qq, k, v, causal=causal)
                else:
                    sdpa.attention(qq, k, v, causal=causal, return_stats=True, topk=topk)
                times[name].append(time.perf_counter() - t0)
        t = {name: statistics.median(x[1:]) for name, x in times.items()}
        row = f"{shape:16s} plain {t['plain'] * 1e3:8.2f} ms ({flops / t['plain'] / 1e9:6.1f} GFLOP/s)"
        for name in ("stats", "stats + top-8"):
            row += f" | {name} {t[name] * 1e3:8.2f} ms: {t[name] / t['plain']:5.3f}x"
        print(row, flush=True)


if __name__ == "__main__":
    main()
