"""Decode beside llama.cpp (ggml's q8_0 / f16 flash attention) and sdpa's own caches (issue 30 §2).

    python bench/decode_peers.py --ggml /path/to/ggml_decode [--rounds 2] [--reps 7] [--threads 2]
        [--dtypes float32,bfloat16[,int8,uint8]] [--cases one,batch]

Cases (Hq 32, Hkv 8, D 128, one query token per sequence):
  one    one sequence of 32768 keys. sdpa: sdpa.attention on a dense (1, 8, 32768, 128) cache.
  batch  32 sequences of 512 ... 32768 keys (round(512 * 64^(b/31)), 257k keys; sdpa bench's
         paged case). sdpa: sdpa.attention_paged on head-major pools (KVCache's layout), pages of
         16 and of 128, handed out shuffled. ggml: one ggml_flash_attn_ext call over a unified
         cache holding the sequences one after another, with a -inf mask (llama.cpp's unified
         KV cache; see bench/peers/ggml_decode.cc).
Every library runs on the same case in turn, once per round (rounds alternate the libraries, so
a drift of the machine hits all). ms is the median of --reps calls after a warm-up; GB/s counts
the K and V bytes of the keys that exist, as each library stores them (ggml q8_0: 34 bytes per
32 values incl. its f16 block scale).
ggml: pass the driver built by bench/peers/build_ggml.sh (ggml's source stays outside this
repository); without --ggml its rows are left out. --dtypes int8 / uint8: sdpa's 8-bit cache
(issue 30 §1; values from sdpa.quantize_kv, one float32 scale (and zero point) per token and kv
head, whose bytes count too: D + 4 (+ 4) bytes per row).
OpenVINO's PagedAttention is not driven here (see docs/PERFORMANCE.md, "Decode beside llama.cpp
and OpenVINO").
"""

import argparse
import os
import re
import subprocess
import sys

import numpy as np

import sdpa
from cpu import cpu_flags, median_time  # bench/cpu.py

HQ, HKV, D = 32, 8, 128


def lengths(case):
    if case == "one":
        return [32768]
    return [round(512 * 64 ** (b / 31)) for b in range(32)]


def np_dtype(name):
    if name == "float32":
        return np.float32, 4
    if name == "bfloat16":
        import ml_dtypes
        return ml_dtypes.bfloat16, 2
    if name in ("int8", "uint8"):
        return name, 1
    sys.exit(f"decode_peers.py: --dtypes: unknown dtype {name!r} (float32, bfloat16, int8, uint8)")


def cache(rng, shape, dt, perm=None):
    """A random cache of `shape` (memory order) in dt, viewed through `perm`: (array, {kwarg
    suffix: view}) with the scale (and zero point) views of an 8-bit cache, else {}."""
    x = rng.standard_normal(shape, dtype=np.float32)
    perm = perm or tuple(range(len(shape)))
    if dt not in ("int8", "uint8"):
        return x.astype(dt).transpose(perm), {}
    parts = sdpa.quantize_kv(x, dt)
    extra = {"scale": parts[1].transpose(perm[:-1])}
    if dt == "uint8":
        extra["zero"] = parts[2].transpose(perm[:-1])
    return parts[0].transpose(perm), extra


def kv_kwargs(kx, vx):
    return {f"{w}_{name}": view for w, x in (("k", kx), ("v", vx)) for name, view in x.items()}


def sdpa_runs(case, dtype_name, rng):
    """[(label, fn, kv_bytes)] for sdpa on this case."""
    dt, size = np_dtype(dtype_name)
    row_bytes = D * size + (4 if dt in ("int8", "uint8") else 0) + (4 if dt == "uint8" else 0)
    lens = lengths(case)
    qdt = np.float32 if dt in ("int8", "uint8") else dt
    q = rng.standard_normal((len(lens), HQ, 1, D), dtype=np.float32).astype(qdt)
    if case == "one":
        k, kx = cache(rng, (1, HKV, lens[0], D), dt)
        v, vx = cache(rng, (1, HKV, lens[0], D), dt)
        kw = kv_kwargs(kx, vx)
        return [(f"sdpa {dtype_name} dense", lambda: sdpa.attention(q, k, v, **kw), 2 * lens[0] * HKV * row_bytes)]
    runs = []
    for page in (16, 128):
        counts = [(n + page - 1) // page for n in lens]
        pages = sum(counts)
        # head-major pool: memory (pages, Hkv, page, D), passed as its (pages, page, Hkv, D) view
        kp, kx = cache(rng, (pages, HKV, page, D), dt, (0, 2, 1, 3))
        vp, vx = cache(rng, (pages, HKV, page, D), dt, (0, 2, 1, 3))
        kw = kv_kwargs(kx, vx)
        order = rng.permutation(pages).astype(np.int32)
        table = np.full((len(lens), max(counts)), -1, np.int32)
        nxt = 0
        for b, c in enumerate(counts):
            table[b, :c] = order[nxt:nxt + c]
            nxt += c
        seqlens = np.array(lens, np.int64)
        runs.append((f"sdpa {dtype_name} paged {page}",
                     lambda kp=kp, vp=vp, table=table, kw=kw: sdpa.attention_paged(q, kp, vp, table, seqlens, **kw),
                     2 * sum(lens) * HKV * row_bytes))
    return runs


def ggml_run(driver, case, gtype, threads, reps):
    out = subprocess.run([driver, "--type", gtype, "--case", case, "--threads", str(threads), "--reps", str(reps)],
                         check=True, capture_output=True, text=True).stdout
    ms = float(re.search(r"ms_median=([\d.]+)", out).group(1))
    kv = int(re.search(r"kv_bytes=(\d+)", out).group(1))
    return ms, kv


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ggml", help="bench/peers/build_ggml.sh's ggml_decode binary")
    ap.add_argument("--ggml-types", default="q8_0,f16,f32")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--reps", type=int, default=7)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--dtypes", default="float32,bfloat16")
    ap.add_argument("--cases", default="one,batch")
    a = ap.parse_args()
    sdpa.set_num_threads(a.threads)
    dtypes = a.dtypes.split(",")
    for name in dtypes:
        np_dtype(name)  # fail before any timing
    if a.ggml and not os.access(a.ggml, os.X_OK):
        sys.exit(f"decode_peers.py: --ggml {a.ggml}: not an executable")
    print(f"CPU: {cpu_flags()}")
    print(f"sdpa {sdpa.__file__}; threads {a.threads}; reps {a.reps}; Hq {HQ} Hkv {HKV} D {D}")
    rng = np.random.default_rng(0)
    for case in a.cases.split(","):
        lens = lengths(case)
        print(f"\ncase {case}: {len(lens)} sequence(s), {sum(lens)} keys")
        rows = {}
        runs = [r for name in dtypes for r in sdpa_runs(case, name, rng)]
        for rnd in range(a.rounds):
            for label, fn, kv in runs:
                rows.setdefault(label, []).append((median_time(fn, a.reps) * 1e3, kv))
            if a.ggml:
                for t in a.ggml_types.split(","):
                    rows.setdefault(f"ggml {t}", []).append(ggml_run(a.ggml, case, t, a.threads, a.reps))
        print(f"{'library':<26} {'KV bytes':>12}  " + "  ".join(f"round {r + 1}: ms, GB/s" for r in range(a.rounds)))
        for label, vals in rows.items():
            print(f"{label:<26} {vals[0][1]:>12}  " + "  ".join(f"{ms:9.2f} {kv / ms / 1e6:6.2f}" for ms, kv in vals))


if __name__ == "__main__":
    main()
