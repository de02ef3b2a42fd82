#!/usr/bin/env python3
"""Per-call overhead on a decode step of a very small model (issue 11): query (1, 4, 1, 32)
against 16 keys, float32, one thread, where the arithmetic (8192 flops, well under 0.1 µs) is
nothing and the time is what each front door costs per call. In one process:

    torch F          torch.nn.functional.scaled_dot_product_attention
    sdpa.torch       sdpa.torch.scaled_dot_product_attention (sdpa's torch operator)
    sdpa (NumPy)     sdpa.attention on NumPy arrays
    ... grad         the same with query.requires_grad (autograd records the call)
    ... compiled     under torch.compile (the first call compiles; timed after it)

Medians of --reps rounds of --calls calls, in µs per call. The C++ entry's own cost is the
"tiny call" row of `sdpa bench` (cli/bench.cc).

    .venv/bin/python bench/overhead.py [--reps 7] [--calls 3000] [--compile]
"""

import argparse
import statistics
import time

import numpy as np
import torch

import sdpa
import sdpa.torch
from cpu import cpu_flags  # bench/cpu.py (the script's folder is on sys.path)


def per_call_us(fn, reps, calls):
    fn()
    rounds = []
    for _ in range(reps):
        t0 = time.perf_counter()
        for _ in range(calls):
            fn()
        rounds.append((time.perf_counter() - t0) / calls * 1e6)
    return statistics.median(rounds)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--calls", type=int, default=3000)
    ap.add_argument("--compile", action="store_true", help="also time both functions under torch.compile")
    args = ap.parse_args()
    torch.set_num_threads(1)
    sdpa.set_num_threads(1)
    print(f"cpu: {cpu_flags()}")
    print(f"torch {torch.__version__}, one thread each; query (1, 4, 1, 32), key/value (1, 4, 16, 32), float32")
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(s, generator=g) for s in ((1, 4, 1, 32), (1, 4, 16, 32), (1, 4, 16, 32)))
    qg = q.clone().requires_grad_()
    qn, kn, vn = q.numpy(), k.numpy(), v.numpy()
    F = torch.nn.functional.scaled_dot_product_attention
    ours = sdpa.torch.scaled_dot_product_attention
    np.testing.assert_allclose(ours(q, k, v).numpy(), F(q, k, v).numpy(), rtol=1e-5, atol=1e-6)  # check what we time
    rows = [("torch F", lambda: F(q, k, v)), ("sdpa.torch", lambda: ours(q, k, v)),
            ("sdpa (NumPy)", lambda: sdpa.attention(qn, kn, vn)),
            ("torch F, grad", lambda: F(qg, k, v)), ("sdpa.torch, grad", lambda: ours(qg, k, v))]
    if args.compile:
        cf, co = torch.compile(F, fullgraph=True), torch.compile(ours, fullgraph=True)
        rows += [("torch F, compiled", lambda: cf(q, k, v)), ("sdpa.torch, compiled", lambda: co(q, k, v))]
    times = {name: per_call_us(fn, args.reps, args.calls) for name, fn in rows}
    print(f"{'front door':24} {'µs/call':>8} {'/ torch F':>10}")
    for name, us in times.items():
        base = times["torch F, grad" if "grad" in name else "torch F, compiled" if "compiled" in name else "torch F"]
        print(f"{name:24} {us:8.2f} {us / base:9.2f}x")


if __name__ == "__main__":
    main()
