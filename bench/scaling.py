#!/usr/bin/env python3
"""How sdpa's cost grows with N: time and peak extra memory for one head, D=64, float32,
N = 1k ... 64k (self-attention, Nq = Nk = N, no mask), of the forward pass or, with
--backward, of attention_backward (given out and lse; its dq, dk, dv are preallocated and
counted with the inputs and outputs).

    .venv/bin/python bench/scaling.py [--threads 2] [--max-n 65536] [--backward]

Time: median of 11 calls (3 from N=16k) after a warm-up call of the same size. Extra memory =
peak resident memory during a call minus resident memory just before it, read from
/proc/self/status after resetting the peak through /proc/self/clear_refs. The inputs are
resident then, and so is the output's memory (glibc reuses the warm-up's freed output), so
this is what sdpa itself adds. Each N runs in a fresh process so that nothing freed earlier
hides in the peak."""

import argparse
import json
import os
import subprocess
import sys
import time


def rss_kib(field):
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith(field + ":"):
                return int(line.split()[1])
    raise RuntimeError(field + " not in /proc/self/status")


def child(n, threads, backward):
    import numpy as np
    import sdpa
    from sdpa import _core
    sdpa.set_num_threads(threads)
    rng = np.random.default_rng(0)
    q, k, v = (rng.standard_normal((1, n, 64), dtype=np.float32) for _ in range(3))
    if backward:
        out, lse = sdpa.attention(q, k, v, return_lse=True)
        dout = rng.standard_normal(out.shape, dtype=np.float32)
        grads = [np.ones_like(x) for x in (q, k, v)]  # resident before the call, like its inputs
        io = [q, k, v, out, lse, dout] + grads

        def call():  # the C++ entry point with the preallocated gradients
            _core.attention_backward(q, k, v, None, out, lse, dout, *grads, None, "none", -1, -1, "auto", 0.0, 0)
    else:
        io = [q, k, v, q]  # the output has q's size here

        def call():
            sdpa.attention(q, k, v)
    call()  # warm-up: thread pool, code paths, the output's pages
    times = []
    for _ in range(11 if n <= 8192 else 3):
        t = time.perf_counter()
        call()
        times.append(time.perf_counter() - t)
    seconds = sorted(times)[len(times) // 2]
    # Memory in a call of its own: resetting the peak disturbs the timing of small N.
    before = rss_kib("VmRSS")
    with open("/proc/self/clear_refs", "w") as f:
        f.write("5")  # reset VmHWM to the current RSS
    call()
    extra_kib = rss_kib("VmHWM") - before
    flops = (10 if backward else 4) * n * n * 64
    print(json.dumps({"n": n, "seconds": seconds, "extra_mib": extra_kib / 1024,
                      "io_mib": sum(x.nbytes for x in io) / 2**20, "gflops": flops / seconds / 1e9}))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--max-n", type=int, default=65536)
    ap.add_argument("--backward", action="store_true", help="time attention_backward instead")
    ap.add_argument("--child", type=int, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.threads, args.backward)
    what = "backward; GFLOP/s = 10*N*N*D / time" if args.backward else "forward; GFLOP/s = 4*N*N*D / time"
    print(f"one head, D=64, float32, {args.threads} threads, {what}")
    print(f"{'N':>6} {'time s':>9} {'GFLOP/s':>8} {'t(N)/t(N/2)':>12} {'inputs+outs MiB':>15} {'extra MiB':>10}")
    prev = None
    n = 1024
    while n <= args.max_n:
        cmd = [sys.executable, __file__, "--child", str(n), "--threads", str(args.threads)]
        res = subprocess.run(cmd + (["--backward"] if args.backward else []), check=True, capture_output=True,
                             text=True)
        r = json.loads(res.stdout)
        ratio = f"{r['seconds'] / prev:12.2f}" if prev else f"{'':12}"
        print(f"{n:6d} {r['seconds']:9.4f} {r['gflops']:8.1f} {ratio} {r['io_mib']:15.1f} {r['extra_mib']:10.1f}",
              flush=True)
        prev = r["seconds"]
        n *= 2


if __name__ == "__main__":
    sys.exit(main())
