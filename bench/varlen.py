"""Packed sequences of different lengths, three ways, in one process (issue 11's target):

  varlen   sdpa.attention_varlen on the packed batch (no padding)
  dense    sdpa.attention on each sequence alone, summed: on (H, n, D) views of the packed
           token-major rows (the same memory as varlen), and on contiguous copies
  seqlens  one padded (B, H, Lmax, D) call with seqlens_k (padding keys never read; padded query
           rows still computed)
  padded   one padded call with a key-padding bool mask (what a user does without varlen)

Times are medians over --reps runs; GFLOP/s count only the real pairs: 4 * H * sum_b (causal
pairs of sequence b) * D. Prints the CPU flags that matter.

    .venv/bin/python bench/varlen.py --threads 2
"""

import argparse

import numpy as np

import sdpa
from cpu import cpu_flags, median_time  # bench/cpu.py (the script's folder is on sys.path)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--dim", type=int, default=64)
    args = ap.parse_args()
    sdpa.set_num_threads(args.threads)
    H, D = args.heads, args.dim
    lengths = [128, 4096, 256, 2048, 512, 3072, 1024, 1200]  # 8 sequences, 128 ... 4096 (12,336 tokens)
    rng = np.random.default_rng(0)
    cu = np.cumsum([0] + lengths)
    q = rng.standard_normal((cu[-1], H, D)).astype(np.float32)
    k = rng.standard_normal((cu[-1], H, D)).astype(np.float32)
    v = rng.standard_normal((cu[-1], H, D)).astype(np.float32)
    seqs = [tuple(np.ascontiguousarray(x[cu[b]:cu[b + 1]].transpose(1, 0, 2)) for x in (q, k, v))
            for b in range(len(lengths))]
    B, Lmax = len(lengths), max(lengths)
    pad = [np.zeros((B, H, Lmax, D), np.float32) for _ in range(3)]
    for b, s in enumerate(seqs):
        for p, x in zip(pad, s):
            p[b, :, :lengths[b]] = x
    key_mask = np.arange(Lmax)[None, None, None, :] < np.array(lengths)[:, None, None, None]  # (B, 1, 1, Lmax)
    # Causal pairs per sequence: n (n + 1) / 2.
    flops = 4 * H * D * sum(n * (n + 1) / 2 for n in lengths)

    runs = {
        "varlen": lambda: sdpa.attention_varlen(q, k, v, cu, cu, causal=True),
        "dense views (sum)": lambda: [sdpa.attention(*(x[cu[b]:cu[b + 1]].transpose(1, 0, 2) for x in (q, k, v)),
                                                     causal=True) for b in range(len(lengths))],
        "dense copies (sum)": lambda: [sdpa.attention(*s, causal=True) for s in seqs],
        "seqlens": lambda: sdpa.attention(pad[0], pad[1], pad[2], causal="top_left", seqlens_k=lengths),
        "padded + mask": lambda: sdpa.attention(pad[0], pad[1], pad[2], key_mask, causal="top_left"),
    }
    # Check what is timed: the packed call and the padded seqlens_k call give each sequence the
    # bits of the dense call on it.
    packed = runs["varlen"]()
    padded = runs["seqlens"]()
    for b, s in enumerate(seqs):
        dense = sdpa.attention(*s, causal=True)
        assert np.array_equal(packed[cu[b]:cu[b + 1]].transpose(1, 0, 2), dense), b
        assert np.allclose(padded[b, :, :lengths[b]], dense, rtol=1e-5, atol=1e-5), b
    print(f"CPU: {cpu_flags()}")
    print(f"threads={args.threads}  H={H} D={D} float32 causal, lengths {lengths} (total {cu[-1]})")
    print("GFLOP/s = 4*H*D*sum_b n_b(n_b+1)/2 / median time (real pairs only)")
    times = {name: median_time(fn, args.reps) for name, fn in runs.items()}
    for name, t in times.items():
        print(f"{name:20s} {t * 1e3:9.2f} ms  {flops / t / 1e9:7.1f} GFLOP/s  {t / times['varlen']:5.2f}x varlen")
    # The backward (2.5x the forward's flops: five products), packed against per sequence.
    out, lse = sdpa.attention_varlen(q, k, v, cu, cu, causal=True, return_lse=True)
    dout = rng.standard_normal(out.shape).astype(np.float32)
    rows = [slice(cu[b], cu[b + 1]) for b in range(len(lengths))]
    backward = {
        "varlen backward": lambda: sdpa.attention_varlen_backward(dout, q, k, v, out, lse, cu, cu, causal=True),
        "dense views (sum)": lambda: [sdpa.attention_backward(*(x[r].transpose(1, 0, 2) for x in (dout, q, k, v, out)),
                                                              lse[:, r], causal=True) for r in rows],
    }
    packed_grads, dense_grads = backward["varlen backward"](), backward["dense views (sum)"]()
    for b, r in enumerate(rows):  # check what is timed: each sequence's gradients, bit for bit
        for got, want in zip(packed_grads, dense_grads[b]):
            assert np.array_equal(got[r].transpose(1, 0, 2), want), b
    times = {name: median_time(fn, args.reps) for name, fn in backward.items()}
    print()
    for name, t in times.items():
        print(f"{name:20s} {t * 1e3:9.2f} ms  {2.5 * flops / t / 1e9:7.1f} GFLOP/s  "
              f"{t / times['varlen backward']:5.2f}x varlen")
    decode_batch(args, rng, H, D)


def decode_batch(args, rng, H, D):
    """A continuous batch of 64 decode steps (one new query each) against 64 ... 8192 keys,
    packed, against one dense call per sequence: what one parallel region for all sequences
    saves."""
    nk = np.geomspace(64, 8192, 64).astype(int)
    cu_q, cu_k = np.arange(65), np.concatenate([[0], np.cumsum(nk)])
    q = rng.standard_normal((64, H, D)).astype(np.float32)
    k = rng.standard_normal((cu_k[-1], H, D)).astype(np.float32)
    v = rng.standard_normal((cu_k[-1], H, D)).astype(np.float32)
    views = [tuple(x[c[b]:c[b + 1]].transpose(1, 0, 2) for x, c in ((q, cu_q), (k, cu_k), (v, cu_k)))
             for b in range(64)]
    runs = {"varlen decode": lambda: sdpa.attention_varlen(q, k, v, cu_q, cu_k, causal=True),
            "dense views (sum)": lambda: [sdpa.attention(*s, causal=True) for s in views]}
    packed = runs["varlen decode"]()
    for b, s in enumerate(views):  # check what is timed
        assert np.array_equal(packed[b:b + 1].transpose(1, 0, 2), sdpa.attention(*s, causal=True)), b
    kv_bytes = 2 * cu_k[-1] * H * D * 4
    print(f"\ndecode batch: 64 sequences, 1 query each, keys 64 ... 8192 geometric ({cu_k[-1]} in all)")
    times = {name: median_time(fn, args.reps) for name, fn in runs.items()}
    for name, t in times.items():
        print(f"{name:20s} {t * 1e3:9.3f} ms  {kv_bytes / t / 1e9:7.1f} KV GB/s  {t / times['varlen decode']:5.2f}x varlen")


if __name__ == "__main__":
    main()
