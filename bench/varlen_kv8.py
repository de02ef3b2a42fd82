"""A varlen decode step on an 8-bit cache (issue 30): 32 packed sequences of 512 ... 8192 keys
(token-major, FlashAttention's layout), Hq 32, Hkv 8, D 128, one query each, in one process:

  int8        sdpa.attention_varlen on int8 k and v with per-token scales (sdpa.quantize_kv):
              read in place, dequantised in registers
  int8 g16    the same with 16 scales a row (8 features a scale): the float32-copy path
              (scale groups that are not whole vectors of 16 floats)
  float32     the same call on the float32 cache of the dequantised values (what the 8-bit
              call must equal bit for bit; checked here)

KV GB/s = bytes of K and V read (values and float32 scales) / median time. Prints the CPU flags.

    .venv/bin/python bench/varlen_kv8.py --threads 2
"""

import argparse

import numpy as np

import sdpa
from cpu import cpu_flags, median_time  # bench/cpu.py (the script's folder is on sys.path)


def dequantised(values, scale, groups):
    shape = values.shape
    x = values.astype(np.float32).reshape(*shape[:-1], groups, shape[-1] // groups)
    return (x * scale.reshape(*shape[:-1], groups, 1)).reshape(shape)  # fl32(x · s): one rounding


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    args = ap.parse_args()
    sdpa.set_num_threads(args.threads)
    B, Hq, Hkv, D = 32, 32, 8, 128
    lengths = np.linspace(512, 8192, B).astype(np.int64)
    cu_k = np.concatenate([[0], np.cumsum(lengths)]).astype(np.int64)
    cu_q = np.arange(B + 1, dtype=np.int64)
    rng = np.random.default_rng(0)
    k = rng.standard_normal((cu_k[-1], Hkv, D), dtype=np.float32)
    v = rng.standard_normal((cu_k[-1], Hkv, D), dtype=np.float32)
    q = rng.standard_normal((B, Hq, D), dtype=np.float32)
    print(f"CPU: {cpu_flags()}")
    print(f"{B} sequences, {cu_k[-1]} keys, Hq {Hq}, Hkv {Hkv}, D {D}, {args.threads} threads; median of {args.reps}")
    print(f"{'case':<12} {'ms':>9} {'KV GB/s':>8}")
    for name, groups in (("int8", 1), ("int8 g16", 16)):
        kq, ks = sdpa.quantize_kv(k, "int8", groups=groups)
        vq, vs = sdpa.quantize_kv(v, "int8", groups=groups)
        t = median_time(lambda: sdpa.attention_varlen(q, kq, vq, cu_q, cu_k, k_scale=ks, v_scale=vs), args.reps)
        nbytes = kq.nbytes + vq.nbytes + ks.nbytes + vs.nbytes
        print(f"{name:<12} {t * 1e3:9.2f} {nbytes / t / 1e9:8.1f}")
        kd, vd = dequantised(kq, ks, groups), dequantised(vq, vs, groups)
        same = np.array_equal(np.asarray(sdpa.attention_varlen(q, kq, vq, cu_q, cu_k, k_scale=ks, v_scale=vs)),
                              np.asarray(sdpa.attention_varlen(q, kd, vd, cu_q, cu_k)))
        if not same:
            raise SystemExit(f"{name}: the 8-bit call differs from the float32 call on its dequantised values")
        if groups == 1:
            t32 = median_time(lambda: sdpa.attention_varlen(q, kd, vd, cu_q, cu_k), args.reps)
            print(f"{'float32':<12} {t32 * 1e3:9.2f} {(kd.nbytes + vd.nbytes) / t32 / 1e9:8.1f}")


if __name__ == "__main__":
    main()
