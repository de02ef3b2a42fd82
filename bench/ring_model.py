"""The ring attention cost model of docs/DISTRIBUTED.md, as numbers.

Each of W ranks holds n = N / W tokens. At each of the W ring steps a rank computes its queries
against one K/V block while the next block is in flight, so a step takes max(compute, transfer)
when the transfer hides behind the compute (the ring overlaps them; docs/DISTRIBUTED.md):

  forward   compute  c · 4 · B · Hq · n² · D / F        (c = 1, or 1/2 causal in the zigzag layout:
            transfer 2 · B · Hkv · n · D · s / BW         every step then does exactly half the pairs)
  backward  compute  c · 10 · B · Hq · n² · D / F_b     (five products)
            transfer 2 · B · Hkv · n · D · (s + 4) / BW  (K, V in their dtype, dK, dV in float32)

with F (F_b) a rank's forward (backward) FLOP/s, BW the link's bandwidth in bytes/s and s the
bytes of an element. D and B cancel: the transfer hides when n is at least

  forward   n* = s · F · (Hkv / Hq) / (2 · c · BW)
  backward  n* = (s + 4) · F_b · (Hkv / Hq) / (5 · c · BW)

Usage:
  python bench/ring_model.py                                  # the table of docs/DISTRIBUTED.md
  python bench/ring_model.py --flops 170e9 --bw 9.3e9 --n 32768 --world 2 --heads 8 --dim 64
"""

import argparse


def step_times(n, heads, kv_heads, dim, elem_bytes, flops, flops_bwd, bw, causal, batch=1):
  """Seconds of one ring step per rank: (fwd compute, fwd transfer, bwd compute, bwd transfer)."""
  c = 0.5 if causal else 1.0
  fwd_c = c * 4 * batch * heads * n * n * dim / flops
  fwd_x = 2 * batch * kv_heads * n * dim * elem_bytes / bw
  bwd_c = c * 10 * batch * heads * n * n * dim / flops_bwd
  bwd_x = 2 * batch * kv_heads * n * dim * (elem_bytes + 4) / bw
  return fwd_c, fwd_x, bwd_c, bwd_x


def critical_n(heads, kv_heads, elem_bytes, flops, flops_bwd, bw, causal):
  """The smallest block (tokens per rank) whose transfer hides behind its compute."""
  c = 0.5 if causal else 1.0
  ratio = kv_heads / heads
  return (elem_bytes * flops * ratio / (2 * c * bw), (elem_bytes + 4) * flops_bwd * ratio / (5 * c * bw))


def main():
  p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--flops", type=float, help="a rank's forward FLOP/s (default: the node table's)")
  p.add_argument("--flops-bwd", type=float, help="a rank's backward FLOP/s (default: --flops)")
  p.add_argument("--bw", type=float, help="link bandwidth, bytes/s")
  p.add_argument("--n", type=int, help="whole sequence length N")
  p.add_argument("--world", type=int)
  p.add_argument("--heads", type=int, default=8)
  p.add_argument("--kv-heads", type=int)
  p.add_argument("--dim", type=int, default=64)
  p.add_argument("--bytes", type=int, default=4, help="bytes per element: 4 float32, 2 bf16")
  p.add_argument("--non-causal", action="store_true")
  a = p.parse_args()
  kv = a.kv_heads or a.heads
  causal = not a.non_causal
  if a.flops and a.bw and a.n and a.world:
    fb = a.flops_bwd or a.flops
    n = a.n // a.world
    fc, fx, bc, bx = step_times(n, a.heads, kv, a.dim, a.bytes, a.flops, fb, a.bw, causal)
    print(f"n = {n} tokens per rank; per step: forward compute {fc * 1e3:.2f} ms, transfer {fx * 1e3:.2f} ms; "
          f"backward compute {bc * 1e3:.2f} ms, transfer {bx * 1e3:.2f} ms")
    print(f"forward {a.world} steps: {a.world * max(fc, fx):.3f} s (transfer {100 * fx / fc:.2f} % of compute); "
          f"backward {a.world * max(bc, bx):.3f} s (transfer {100 * bx / bc:.2f} % of compute)")
    nf, nb = critical_n(a.heads, kv, a.bytes, a.flops, fb, a.bw, causal)
    print(f"transfer hides for n >= {nf:.0f} (forward), {nb:.0f} (backward)")
    return
  # The node table: a CPU node of 64 cores at this machine's measured rate per core, float32 and
  # bf16 in kFast (a node's cores share its memory bandwidth; attention's prefill is compute-bound).
  # `sdpa bench --threads 1 --filter causal` (and --dtype bf16 --precision fast), "d64 causal"
  # rows, on the AMD EPYC (Zen 5 class) VM of 2026-11-28: forward and backward GFLOP/s per core.
  per_core = {"float32": (4, 83e9, 84e9), "bf16 (kFast)": (2, 114e9, 97e9)}
  cores = 64
  print(f"node = {cores} cores; causal zigzag; forward / backward critical block n* (tokens per node)")
  print(f"{'dtype':14s} {'Hkv/Hq':>7s} {'link':>8s} {'n* fwd':>8s} {'n* bwd':>8s}   N over W nodes: n = N / W, hidden?")
  for dtype, (s, f, fb) in per_core.items():
    for ratio in (1, 8):
      for gbit in (25, 100):
        bw = gbit * 1e9 / 8
        nf, nb = critical_n(ratio, 1, s, f * cores, fb * cores, bw, True)
        cells = []
        for big in (1 << 17, 1 << 20):
          cells.append(f"N={big >> 10}k")
          for w in (8, 16, 32, 64):
            n = big // w
            cells.append(f"W{w}:{n}{'✓' if n >= max(nf, nb) else ('f' if n >= nf else '✗')}")
        print(f"{dtype:14s} {'1/' + str(ratio):>7s} {gbit:>5d}Gb/s {nf:8.0f} {nb:8.0f}   {' '.join(cells)}")
  print("✓ forward and backward hide the transfer, f forward only, ✗ neither")


if __name__ == "__main__":
  main()
