"""Ring attention's cost on one machine: W MPI ranks of T threads each against one process of
W·T threads on the whole sequence, the share of communication hidden behind compute, and the
per-rank memory. Run under mpirun (loopback), e.g. (docs/DISTRIBUTED.md):

  mpirun --allow-run-as-root --oversubscribe --bind-to none -np 2 --mca btl self,vader \\
      --mca oob_tcp_if_include lo .venv/bin/python bench/ring.py --n 32768 --heads 8 --dim 64
  mpirun ... -np 4 .venv/bin/python bench/ring.py --n 1048576 --heads 1 --dim 64 --no-baseline --reps 1
  mpirun ... -np 2 .venv/bin/python bench/ring.py --n 8192 --heads 8 --kv-heads 1 --strategy allgather

GFLOP/s = 2·B·Hq·N²·D (forward, causal: half of 4·B·Hq·N²·D) / time; backward 5·B·Hq·N²·D.
The baseline runs on rank 0 alone (W·T threads) while the other ranks sleep in a polled barrier
(--bind-to none: mpirun otherwise binds each rank, and the baseline's threads, to one core).
Transfers: each rank also times its W - 1 block sends alone (the same bytes around the ring,
nothing computed); hidden share = 1 - (the ring's exposed wait) / (the transfers' own time).
"""

import argparse
import resource
import time

import numpy as np
from mpi4py import MPI

import sdpa
import sdpa.distributed as sd


def polled_barrier(comm):
    """A barrier that sleeps instead of spinning (so that a waiting rank leaves its core free)."""
    req = comm.Ibarrier()
    while not req.Test():
        time.sleep(1e-3)


def median(xs):
    return float(np.median(np.asarray(xs)))


def transfers_alone(comm, nbytes, reps):
    """Seconds for W - 1 ring steps of `nbytes` each (send on, receive from behind), no compute."""
    W, r = comm.Get_size(), comm.Get_rank()
    a, b = np.ones(nbytes, np.uint8), np.empty(nbytes, np.uint8)
    times = []
    for _ in range(reps):
        polled_barrier(comm)
        t0 = time.perf_counter()
        for _ in range(W - 1):
            reqs = [comm.Irecv([b, MPI.BYTE], (r - 1) % W, 7), comm.Isend([a, MPI.BYTE], (r + 1) % W, 7)]
            MPI.Request.Waitall(reqs)
            a, b = b, a
        times.append(time.perf_counter() - t0)
    return median(times)


def main():
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--n", type=int, default=32768, help="whole sequence length N")
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int)
    p.add_argument("--dim", type=int, default=64)
    p.add_argument("--dtype", choices=("float32", "bfloat16"), default="float32")
    p.add_argument("--precision", choices=("exact", "fast"), default="exact")
    p.add_argument("--layout", choices=("zigzag", "contiguous"), default="zigzag")
    p.add_argument("--strategy", choices=("ring", "allgather"), default="ring",
                   help="K/V passed around the ring, or all-gathered one kv head at a time (GQA / MQA)")
    p.add_argument("--non-causal", action="store_true")
    p.add_argument("--threads", type=int, default=1, help="threads per rank (the baseline gets W x this)")
    p.add_argument("--reps", type=int, default=3)
    p.add_argument("--backward", action="store_true", help="also time the backward")
    p.add_argument("--no-baseline", action="store_true", help="skip the one-process call (e.g. 1M tokens)")
    a = p.parse_args()
    comm = MPI.COMM_WORLD
    W, r = comm.Get_size(), comm.Get_rank()
    kv = a.kv_heads or a.heads
    causal = not a.non_causal
    B, H, D, N = a.batch, a.heads, a.dim, a.n
    n = N // W
    dtype = np.float32
    if a.dtype == "bfloat16":
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    say = print if r == 0 else (lambda *x, **k: None)
    flags = open("/proc/cpuinfo").read().split("flags")[1].split("\n")[0].split()
    say(f"bench/ring.py: W = {W} ranks x {a.threads} threads; CPU flags: "
        + " ".join(f for f in flags if "avx" in f or "amx" in f or f == "fma"))
    say(f"B {B}, Hq {H}, Hkv {kv}, N {N} (n = {n} per rank), D {D}, {a.dtype} {a.precision}, "
        f"{'causal' if causal else 'non-causal'}, layout {a.layout}, strategy {a.strategy}")
    fwd_flops = (2 if causal else 4) * B * H * N * N * D
    bwd_flops = 2.5 * fwd_flops

    # Each rank's shard: cut from the whole problem (seeded, so the baseline sees the same), or
    # drawn on its own when there is no baseline (memory O(N / W) on every rank).
    def whole(seed, heads):
        return np.random.default_rng(seed).standard_normal((B, heads, N, D), np.float32).astype(dtype)
    if a.no_baseline:
        rng = np.random.default_rng(100 + r)
        q, k, v = (rng.standard_normal((B, h, n, D), np.float32).astype(dtype) for h in (H, kv, kv))
    else:
        Q, K, V = whole(1, H), whole(2, kv), whole(3, kv)
        q, k, v = (sd.shard(x, -2, a.layout, comm) for x in (Q, K, V))
    opts = dict(causal=causal, layout=a.layout, precision=a.precision, strategy=a.strategy)

    # The ring: T threads per rank.
    sdpa.set_num_threads(a.threads)
    times, stats = [], []
    for _ in range(a.reps):
        polled_barrier(comm)
        t0 = time.perf_counter()
        out, lse, st = sd.ring_attention(q, k, v, comm, return_lse=True, return_stats=True, **opts)
        times.append(comm.allreduce(time.perf_counter() - t0, MPI.MAX))
        stats.append(st)
    t_ring = median(times)
    block_bytes = k.nbytes + v.nbytes
    t_x = transfers_alone(comm, block_bytes, max(1, a.reps)) if W > 1 else 0.0
    check = median([s["check_seconds"] for s in stats])
    checks = comm.gather(check, 0)
    wait = median([s["wait_seconds"] for s in stats])
    compute = median([s["compute_seconds"] for s in stats])
    waits = comm.gather(wait, 0)
    computes = comm.gather(compute, 0)
    txs = comm.gather(t_x, 0)
    if r == 0:
        # hidden = 1 - wait / transfers alone; the wait also holds a slower peer's compute (the
        # ranks' imbalance), so it can exceed the transfers' own time: nothing hidden then (<= 0).
        hidden = [1 - w / x if x > 0 else float("nan") for w, x in zip(waits, txs)]
        say(f"ring forward: {t_ring * 1e3:.1f} ms (median of {a.reps}, slowest rank), {fwd_flops / t_ring / 1e9:.1f} GFLOP/s")
        say("  per rank: checks " + ", ".join(f"{c * 1e3:.1f}" for c in checks) + " ms; compute "
            + ", ".join(f"{c:.3f}" for c in computes) + " s (" + ", ".join(
                f"{fwd_flops / W / c / 1e9:.1f}" for c in computes) + " GFLOP/s); exposed wait "
            + ", ".join(f"{w * 1e3:.1f} ms ({100 * w / t_ring:.2f} %)" for w in waits) + " of the ring's time")
        say("  transfers alone (the same W - 1 blocks, nothing computed): " + ", ".join(f"{x * 1e3:.1f}" for x in txs)
            + " ms; hidden = 1 - wait / transfers: " + ", ".join(f"{100 * h:.0f} %" for h in hidden)
            + " (<= 0: not hidden; the wait includes the peers' imbalance)")
    t_bwd = None
    if a.backward:
        dout = np.random.default_rng(200 + r).standard_normal(out.shape, np.float32).astype(dtype)
        bt = []
        for _ in range(a.reps):
            polled_barrier(comm)
            t0 = time.perf_counter()
            sd.ring_attention_backward(dout, q, k, v, out, lse, comm, **opts)
            bt.append(comm.allreduce(time.perf_counter() - t0, MPI.MAX))
        t_bwd = median(bt)
        say(f"ring backward: {t_bwd * 1e3:.1f} ms, {bwd_flops / t_bwd / 1e9:.1f} GFLOP/s")
    rss = comm.gather(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 0)
    shard_mib = (q.nbytes + k.nbytes + v.nbytes + out.nbytes) / 2**20
    if r == 0:
        say("peak memory per rank (ru_maxrss): " + ", ".join(f"{m:.0f}" for m in rss) + f" MiB "
            f"(q, k, v, out of one shard: {shard_mib:.0f} MiB)")

    if a.no_baseline:
        return
    # The baseline: rank 0 alone with W·T threads, the others asleep.
    gathered = sd.unshard(out, -2, a.layout, comm)
    if r == 0:
        sdpa.set_num_threads(W * a.threads)
        bt = []
        for _ in range(a.reps):
            t0 = time.perf_counter()
            whole_out = sdpa.attention(Q, K, V, causal=causal, precision=a.precision)
            bt.append(time.perf_counter() - t0)
        t_one = median(bt)
        diff = float(np.max(np.abs(gathered.astype(np.float64) - whole_out.astype(np.float64))))
        say(f"one process, {W * a.threads} threads: {t_one * 1e3:.1f} ms, {fwd_flops / t_one / 1e9:.1f} GFLOP/s")
        say(f"ring / one process speed: {t_one / t_ring:.3f}x; max |ring - one process| = {diff:.3g}")
        if a.backward:
            dout_whole = np.random.default_rng(5).standard_normal(whole_out.shape, np.float32).astype(dtype)
            _, lse_whole = sdpa.attention(Q, K, V, causal=causal, precision=a.precision, return_lse=True)
            bt = []
            for _ in range(a.reps):
                t0 = time.perf_counter()
                sdpa.attention_backward(dout_whole, Q, K, V, whole_out, lse_whole, causal=causal,
                                        precision=a.precision)
                bt.append(time.perf_counter() - t0)
            t_one_b = median(bt)
            say(f"one process backward: {t_one_b * 1e3:.1f} ms; ring / one process speed {t_one_b / t_bwd:.3f}x")
    polled_barrier(comm)  # the other ranks sleep here while rank 0 runs the baseline


if __name__ == "__main__":
    main()
