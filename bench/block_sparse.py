#!/usr/bin/env python3
"""What block-sparse attention costs against the dense call (issue 12's target: time within 1.2x
of density x dense time at densities 5-50 %, N = 16384). One process, float32, no causal; each
row times sdpa.attention with a random block mask of 128 x 128 blocks (each block kept with
probability `density`, the first key block always, so that no row is empty) and the dense call
on the same inputs, interleaved round by round; medians of --reps rounds. "vs ideal" is
t_sparse / (kept fraction x t_dense): 1.0 would be a perfect skip. GFLOP/s counts
4·B·H·N²·D·(kept fraction) for the sparse calls (the work they need), 4·B·H·N²·D for the dense
(10·… with --backward, which times attention_backward from each call's own out and lse).
Before timing, each sparse result is checked against the dense call with the equivalent element
mask on the first 256 query rows (bitwise: the kernels skip tiles without changing any sum).

    .venv/bin/python bench/block_sparse.py [--n 16384] [--d 64] [--heads 4] [--threads 2] [--reps 3] [--backward]
"""

import argparse
import statistics
import time

import numpy as np

import sdpa
from cpu import cpu_flags  # bench/cpu.py (the script's folder is on sys.path)


def random_blocks(n, block, density, rng):
    nb = -(-n // block)
    bm = rng.random((nb, nb)) < density
    bm[:, 0] = True
    return bm


def check(q, k, v, bm, block):
    """The sparse call against the dense one with the element mask, on the first 256 rows."""
    rows = 256
    qs = q[:, :rows]
    element = np.repeat(np.repeat(bm, block, axis=0), block, axis=1)[:rows, :k.shape[1]]
    want = sdpa.attention(qs, k, v, element)
    got = sdpa.attention(qs, k, v, block_mask=bm[: -(-rows // block)], block_size=block)
    assert np.array_equal(got, want), "block-sparse result differs from the element mask's"


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--n", type=int, default=16384)
    ap.add_argument("--d", type=int, default=64)
    ap.add_argument("--heads", type=int, default=4)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=3)
    ap.add_argument("--block", type=int, default=128)
    ap.add_argument("--densities", default="0.05,0.1,0.25,0.5")
    ap.add_argument("--backward", action="store_true", help="time attention_backward instead (10·… flops)")
    args = ap.parse_args()
    sdpa.set_num_threads(args.threads)
    rng = np.random.default_rng(0)
    H, N, D, blk = args.heads, args.n, args.d, args.block
    q = rng.standard_normal((H, N, D), dtype=np.float32)
    k = rng.standard_normal((H, N, D), dtype=np.float32)
    v = rng.standard_normal((H, N, D), dtype=np.float32)
    print(f"# CPU: {cpu_flags()}")
    print(f"# {'backward' if args.backward else 'forward'}: H={H} N={N} D={D} float32, blocks {blk}x{blk}, "
          f"{args.threads} threads, median of {args.reps}")
    masks = {}
    for d in map(float, args.densities.split(",")):
        masks[d] = random_blocks(N, blk, d, rng)
        check(q, k, v, masks[d], blk)
    calls = {"dense": lambda: sdpa.attention(q, k, v)}
    for d, bm in masks.items():
        calls[d] = (lambda bm=bm: sdpa.attention(q, k, v, block_mask=bm, block_size=blk))
    if args.backward:  # attention_backward from each call's own out and lse
        dout = rng.standard_normal((H, N, D), dtype=np.float32)
        fwd = {"dense": sdpa.attention(q, k, v, return_lse=True)}
        for d, bm in masks.items():
            fwd[d] = sdpa.attention(q, k, v, block_mask=bm, block_size=blk, return_lse=True)
        calls = {"dense": lambda: sdpa.attention_backward(dout, q, k, v, *fwd["dense"])}
        for d, bm in masks.items():
            calls[d] = (lambda d=d, bm=bm: sdpa.attention_backward(dout, q, k, v, *fwd[d], block_mask=bm,
                                                                    block_size=blk))
    times = {name: [] for name in calls}
    for _ in range(args.reps + 1):  # the first round warms up
        for name, fn in calls.items():
            t0 = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t0)
    med = {name: statistics.median(t[1:]) for name, t in times.items()}
    flops = (10.0 if args.backward else 4.0) * H * N * N * D
    print(f"{'call':>18} {'kept':>7} {'ms':>9} {'GFLOP/s':>8} {'vs ideal':>9}")
    print(f"{'dense':>18} {1.0:7.3f} {med['dense'] * 1e3:9.1f} {flops / med['dense'] / 1e9:8.1f} {'':>9}")
    for d, bm in masks.items():
        kept = bm.mean()
        t = med[d]
        print(f"{'density ' + str(d):>18} {kept:7.3f} {t * 1e3:9.1f} {kept * flops / t / 1e9:8.1f} "
              f"{t / (kept * med['dense']):9.2f}")


if __name__ == "__main__":
    main()
