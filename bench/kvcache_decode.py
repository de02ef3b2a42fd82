"""Decode from a KVCache (sdpa's own paged pool): 32 sequences of 4096 tokens, Hkv 8, Hq 32, D 128,
pages of 16, one query each, 2 threads; median of 9 calls, in ms.

    .venv/bin/python bench/kvcache_decode.py [float32|int8|uint8]

The pools are allocated by the cache (on transparent huge pages where the OS gives them:
src/huge_pages.h), so running it under /sys/kernel/mm/transparent_hugepage/enabled = never and
= madvise (Debian's default) shows what the huge pages are worth (PERFORMANCE.md, "Huge pages").
"""
import sys
import time

import numpy as np

import sdpa

dtype = sys.argv[1] if len(sys.argv) > 1 else "float32"
sdpa.set_num_threads(2)
B, L, Hkv, Hq, D, P = 32, 4096, 8, 32, 128, 16
cache = sdpa.KVCache(B * L // P, P, Hkv, D, D, dtype=dtype)
rng = np.random.default_rng(0)
rows = rng.standard_normal((L, Hkv, D), dtype=np.float32)  # float32: quantised by an 8-bit cache
seqs = []
for _ in range(B):
    seqs.append(cache.new_sequence())
    cache.append(seqs[-1], rows, rows)
q = rng.standard_normal((B, Hq, 1, D), dtype=np.float32)
times = []
for _ in range(9):
    t0 = time.perf_counter()
    cache.attention(q, seqs)
    times.append(time.perf_counter() - t0)
print(f"{dtype}: median {1e3 * sorted(times)[len(times) // 2]:.1f} ms")
