#!/usr/bin/env python3
"""What the score modifiers cost (issue 12's targets: softcap <= 15 %, ALiBi and sinks <= 5 % over
the same call without them), forward and forward + backward, in one process so that the ratios
compare like with like. Each row times sdpa.attention (and attention_backward) on the same
float32 inputs with one modifier on, against the plain call, interleaved round by round; medians
of --reps rounds. GFLOP/s counts 4·B·Hq·Nq·Nk·D for the forward, 10·… for the backward (halved
for causal), as `sdpa bench` does. Each result is checked against the reference backend first
(on a small slice: the full problem is too big for it) so that what is timed is right.

    .venv/bin/python bench/modifiers.py [--n 4096] [--d 64] [--heads 8] [--threads 2] [--reps 7]
"""

import argparse
import statistics
import time

import numpy as np

import sdpa
from cpu import cpu_flags  # bench/cpu.py (the script's folder is on sys.path)

MODS = {
    "softcap 30": dict(softcap=30.0),
    "softcap 30 after bias": dict(softcap=30.0, softcap_order="after_bias"),
    "alibi": "alibi",
    "sinks": "sinks",
    "all three": "all",
}


def mods_for(name, heads):
    m = MODS[name]
    slopes = 2.0 ** (-8.0 * np.arange(1, heads + 1) / heads)
    sinks = np.linspace(-1.0, 1.0, heads)
    if m == "alibi":
        return dict(alibi_slopes=slopes)
    if m == "sinks":
        return dict(sinks=sinks)
    if m == "all":
        return dict(softcap=30.0, alibi_slopes=slopes, sinks=sinks)
    return m


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=4096)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--no-backward", action="store_true")
    args = ap.parse_args()
    sdpa.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    H, N, D = args.heads, args.n, args.d
    q, k, v = (rng.standard_normal((1, H, N, D)).astype(np.float32) for _ in range(3))
    dout = rng.standard_normal((1, H, N, D)).astype(np.float32)
    print(f"CPU: {cpu_flags()}; threads {args.threads}; (1, {H}, {N}, {D}) float32, causal")

    for name in MODS:
        m = mods_for(name, H)
        # Check first: a 256-query slice against the reference backend.
        s = slice(N - 256, N)
        got = sdpa.attention(q[:, :, s], k, v, causal=True, **m)
        ref = sdpa.attention(q[:, :, s], k, v, causal=True, backend="reference", **m)
        err = float(np.abs(got - ref).max())
        assert err < 1e-4, (name, err)

    flops_fwd = 4 * H * N * N * D / 2
    flops_bwd = 10 * H * N * N * D / 2
    rows = []
    for name in MODS:
        m = mods_for(name, H)
        times = {"plain": [], name: []}
        times_b = {"plain": [], name: []}
        for _ in range(args.reps):
            for label, kw in (("plain", {}), (name, m)):
                t0 = time.perf_counter()
                out, lse = sdpa.attention(q, k, v, causal=True, return_lse=True, **kw)
                times[label].append(time.perf_counter() - t0)
                if not args.no_backward:
                    t0 = time.perf_counter()
                    sdpa.attention_backward(dout, q, k, v, out, lse, causal=True, **kw)
                    times_b[label].append(time.perf_counter() - t0)
        f0, f1 = statistics.median(times["plain"]), statistics.median(times[name])
        row = f"{name:24s} fwd {f1 * 1e3:8.1f} ms ({flops_fwd / f1 / 1e9:6.1f} GFLOP/s) vs plain {f0 * 1e3:8.1f} ms: {f1 / f0:5.3f}x"
        if not args.no_backward:
            b0, b1 = statistics.median(times_b["plain"]), statistics.median(times_b[name])
            row += f" | bwd {b1 * 1e3:8.1f} ms vs {b0 * 1e3:8.1f} ms: {b1 / b0:5.3f}x"
        rows.append(row)
        print(row, flush=True)


if __name__ == "__main__":
    main()
