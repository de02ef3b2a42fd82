#!/usr/bin/env python3
"""sdpa against NumPy float32 attention and PyTorch's scaled_dot_product_attention, in one
process, on the same threads. GFLOP/s = 4·B·Hq·Nq·Nk·D / time (halved for causal).

    .venv/bin/python bench/compare.py [--threads 2] [--reps 5] [--no-avx512] [--bf16]

--no-avx512 caps every library at AVX2, as on a CPU without AVX-512 (the project's reference
machine, a Zen 3): sdpa through Highway, torch through ATEN_CPU_CAPABILITY, MKL and oneDNN
through their own variables, NumPy's OpenBLAS through OPENBLAS_CORETYPE.

torch is optional (.venv/bin/pip install torch: the default PyPI wheel, as in README.md); without
it its column says "n/a".

--bf16 adds a bfloat16 table: sdpa on ml_dtypes.bfloat16 arrays (and with its AVX512_BF16 path
turned off), PyTorch on torch.bfloat16 tensors, and OpenVINO's ScaledDotProductAttention op
compiled for the CPU with INFERENCE_PRECISION_HINT bf16 (optional: .venv/bin/pip install
openvino; "n/a" without it), all on the same bfloat16-representable inputs; then the training
step (forward + backward) in bfloat16 against torch's."""

import argparse
import os
import sys


def parse():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--threads", type=int, default=os.cpu_count())
    ap.add_argument("--reps", type=int, default=5)
    ap.add_argument("--no-avx512", action="store_true", help="cap sdpa, torch and NumPy at AVX2")
    ap.add_argument("--bf16", action="store_true", help="also the bfloat16 table (sdpa, torch, OpenVINO)")
    return ap.parse_args()


args = parse()
# Thread pools read these at import: set them before numpy/torch load.
for var in ("OMP_NUM_THREADS", "OPENBLAS_NUM_THREADS", "MKL_NUM_THREADS"):
    os.environ[var] = str(args.threads)
if args.no_avx512:
    os.environ.update(ATEN_CPU_CAPABILITY="avx2", MKL_ENABLE_INSTRUCTIONS="AVX2", ONEDNN_MAX_CPU_ISA="AVX2",
                      OPENBLAS_CORETYPE="Haswell")

import numpy as np  # noqa: E402

import sdpa  # noqa: E402
from cpu import median_time  # noqa: E402  (bench/cpu.py: the script's folder is on sys.path)

try:
    import torch  # noqa: E402
    import torch.nn.functional as F  # noqa: E402
    torch.set_num_threads(args.threads)
except ImportError:
    torch = None

sdpa.set_num_threads(args.threads)
if args.no_avx512:
    sdpa._core._limit_simd_to_avx2(True)


def numpy_attention(q, k, v, causal):
    """The straightforward float32 NumPy version: materialised scores, stable softmax."""
    s = (q @ np.swapaxes(k, -1, -2)) * np.float32(1 / np.sqrt(q.shape[-1]))
    if causal:
        nq, nk = s.shape[-2:]
        s = np.where(np.tril(np.ones((nq, nk), bool), nk - nq), s, np.float32(-np.inf))
    s = np.exp(s - s.max(-1, keepdims=True))
    return (s / s.sum(-1, keepdims=True)) @ v


CASES = [  # B, Hq, Hkv, Nq, Nk, D, causal
    (1, 8, 8, 2048, 2048, 64, False),
    (1, 8, 8, 2048, 2048, 128, False),
    (1, 8, 8, 2048, 2048, 64, True),
    (1, 8, 8, 4096, 4096, 64, False),
    (1, 32, 8, 1, 32768, 128, False),
]


def forward_backward(rng, bf16=False):
    """Training step (forward + backward) against torch's autograd, same threads, in float32 or
    (bf16) bfloat16: sdpa on ml_dtypes.bfloat16 arrays, torch on torch.bfloat16 tensors, the same
    values. GFLOP/s counts the forward 4·… plus the backward 10·… = 14·B·Hq·Nq·Nk·D (halved for
    causal)."""
    dtype = None
    if bf16:
        import ml_dtypes
        dtype = ml_dtypes.bfloat16
    print(f"\nforward + backward{' in bfloat16' if bf16 else ''}, "
          "GFLOP/s = 14*B*Hq*Nq*Nk*D / median time (halved for causal)")
    print(f"{'case':34} {'sdpa':>9} {'fast':>9} {'torch':>9} {'sdpa/torch':>11} {'fast/torch':>11}")
    for B, Hq, Hkv, Nq, Nk, D, causal in CASES[:3]:
        draw = lambda shape: rng.standard_normal(shape, dtype=np.float32)
        q, k, v, dout = draw((B, Hq, Nq, D)), draw((B, Hkv, Nk, D)), draw((B, Hkv, Nk, D)), draw((B, Hq, Nq, D))
        if bf16:
            q, k, v, dout = (x.astype(dtype) for x in (q, k, v, dout))
        flops = 14 * B * Hq * Nq * Nk * D / (2 if causal else 1)

        def ours(precision="exact"):
            out, lse = sdpa.attention(q, k, v, causal=causal, return_lse=True, precision=precision)
            sdpa.attention_backward(dout, q, k, v, out, lse, causal=causal, precision=precision)

        t_sdpa = median_time(ours, args.reps)
        t_fast = median_time(lambda: ours("fast"), args.reps) if bf16 else None
        t_torch = None
        if torch is not None:
            as_torch = lambda x: torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16) if bf16 else torch.from_numpy(x)
            tq, tk, tv = (as_torch(x).requires_grad_() for x in (q, k, v))
            tdout = as_torch(dout)

            def theirs():
                F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal).backward(tdout)

            t_torch = median_time(theirs, args.reps)
        name = f"B{B} H{Hq}/{Hkv} {Nq}x{Nk} d{D}{' causal' if causal else ''}"
        g = lambda t: f"{flops / t / 1e9:9.1f}" if t else f"{'n/a':>9}"
        r = lambda t: f"{t_torch / t:10.2f}x" if t_torch and t else f"{'n/a':>11}"
        print(f"{name:34} {g(t_sdpa)} {g(t_fast)} {g(t_torch)} {r(t_sdpa)} {r(t_fast)}", flush=True)


def openvino_sdpa(shape_q, shape_kv, causal):
    """OpenVINO's ScaledDotProductAttention (opset 13) compiled for the CPU in bfloat16, or None."""
    try:
        import openvino as ov
        import openvino.opset13 as ops
    except ImportError:
        return None
    q = ops.parameter(list(shape_q), ov.Type.f32)
    k = ops.parameter(list(shape_kv), ov.Type.f32)
    v = ops.parameter(list(shape_kv), ov.Type.f32)
    model = ov.Model([ops.scaled_dot_product_attention(q, k, v, causal=causal)], [q, k, v])
    config = {"INFERENCE_PRECISION_HINT": "bf16", "INFERENCE_NUM_THREADS": args.threads}
    return ov.Core().compile_model(model, "CPU", config)


def bfloat16_table(rng):
    """bfloat16 forward: sdpa (AVX512_BF16 path where the CPU has it, and without), torch bf16,
    OpenVINO bf16. Inputs are drawn in float32 and rounded to bfloat16 once, so every library
    sees the same values (OpenVINO takes them as float32 and converts inside)."""
    import ml_dtypes
    bf16 = ml_dtypes.bfloat16
    has_dot = sdpa._core._kernel_path_available_bf16()
    has_amx = sdpa._core._kernel_path_available_amx()
    print(f"\nbfloat16, GFLOP/s = 4*B*Hq*Nq*Nk*D / median time (halved for causal); "
          f"sdpa's path: {'AMX' if has_amx else 'AVX512_BF16' if has_dot else 'SIMD (no bf16 dot on this CPU)'}")
    print("sdpa: precision exact (the default); fast: precision=\"fast\" (the weights rounded to bfloat16 "
          "before p·V, as the peers do); fast vdp: fast capped at AVX512_BF16 (no AMX tiles; shown where the CPU "
          "has AMX); no dot: exact without the bfloat16 products; f32: sdpa float32 on the same values; "
          "ratios are fast's")
    print(f"{'case':34} {'sdpa':>9} {'fast':>9} {'fast vdp':>9} {'no dot':>9} {'f32':>9} {'torch':>9} {'openvino':>9} "
          f"{'fast/exact':>11} {'fast/f32':>9} {'fast/torch':>11} {'fast/ov':>9}")
    for B, Hq, Hkv, Nq, Nk, D, causal in CASES[:4] + [(1, 8, 8, 2048, 2048, 128, True)]:  # issue 28's five
        q = rng.standard_normal((B, Hq, Nq, D), dtype=np.float32).astype(bf16)
        k = rng.standard_normal((B, Hkv, Nk, D), dtype=np.float32).astype(bf16)
        v = rng.standard_normal((B, Hkv, Nk, D), dtype=np.float32).astype(bf16)
        flops = 4 * B * Hq * Nq * Nk * D / (2 if causal else 1)
        t_sdpa = median_time(lambda: sdpa.attention(q, k, v, causal=causal), args.reps)
        t_fast = median_time(lambda: sdpa.attention(q, k, v, causal=causal, precision="fast"), args.reps)
        t_vdp = None
        if has_amx:
            sdpa._core._limit_kernel_path_to_avx512_bf16(True)
            t_vdp = median_time(lambda: sdpa.attention(q, k, v, causal=causal, precision="fast"), args.reps)
            sdpa._core._limit_kernel_path_to_avx512_bf16(False)
        sdpa._core._limit_kernel_path_to_simd(True)
        t_nodot = median_time(lambda: sdpa.attention(q, k, v, causal=causal), args.reps)
        sdpa._core._limit_kernel_path_to_simd(False)
        q32, k32, v32 = (x.astype(np.float32) for x in (q, k, v))
        t_f32 = median_time(lambda: sdpa.attention(q32, k32, v32, causal=causal), args.reps)
        t_torch = t_ov = None
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(x.astype(np.float32)).to(torch.bfloat16) for x in (q, k, v))
            t_torch = median_time(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal), args.reps)
        compiled = openvino_sdpa(q.shape, k.shape, causal)
        if compiled is not None:
            inputs = [x.astype(np.float32) for x in (q, k, v)]
            t_ov = median_time(lambda: compiled(inputs), args.reps)
        name = f"B{B} H{Hq}/{Hkv} {Nq}x{Nk} d{D}{' causal' if causal else ''}"
        g = lambda t: f"{flops / t / 1e9:9.1f}" if t else f"{'n/a':>9}"
        r = lambda t, w: f"{t / t_fast:{w - 1}.2f}x" if t else f"{'n/a':>{w}}"
        print(f"{name:34} {g(t_sdpa)} {g(t_fast)} {g(t_vdp)} {g(t_nodot)} {g(t_f32)} {g(t_torch)} {g(t_ov)} "
              f"{r(t_sdpa, 11)} {r(t_f32, 9)} {r(t_torch, 11)} {r(t_ov, 9)}", flush=True)


def main():
    rng = np.random.default_rng(0)
    print(f"threads={args.threads}  sdpa {sdpa.__version__}  numpy {np.__version__}  "
          f"torch {torch.__version__ if torch else 'not installed'}"
          f"{'  (all capped at AVX2)' if args.no_avx512 else ''}")
    if torch is not None:
        print(f"torch CPU capability: {torch.backends.cpu.get_cpu_capability()}")
    print("GFLOP/s = 4*B*Hq*Nq*Nk*D / median time (halved for causal)")
    head = f"{'case':34} {'sdpa':>9} {'numpy':>9} {'torch':>9} {'sdpa/numpy':>11} {'sdpa/torch':>11}"
    print(head)
    for B, Hq, Hkv, Nq, Nk, D, causal in CASES:
        q = rng.standard_normal((B, Hq, Nq, D), dtype=np.float32)
        k = rng.standard_normal((B, Hkv, Nk, D), dtype=np.float32)
        v = rng.standard_normal((B, Hkv, Nk, D), dtype=np.float32)
        flops = 4 * B * Hq * Nq * Nk * D / (2 if causal else 1)
        t_sdpa = median_time(lambda: sdpa.attention(q, k, v, causal=causal), args.reps)
        rep = Hq // Hkv
        kr, vr = np.repeat(k, rep, axis=1), np.repeat(v, rep, axis=1)
        t_np = median_time(lambda: numpy_attention(q, kr, vr, causal), args.reps)
        t_torch = None
        if torch is not None:
            tq, tk, tv = (torch.from_numpy(x) for x in (q, kr, vr))
            # torch's is_causal is top-left; for Nq == Nk both alignments agree.
            t_torch = median_time(lambda: F.scaled_dot_product_attention(tq, tk, tv, is_causal=causal), args.reps)
        name = f"B{B} H{Hq}/{Hkv} {Nq}x{Nk} d{D}{' causal' if causal else ''}"
        g = lambda t: f"{flops / t / 1e9:9.1f}" if t else f"{'n/a':>9}"
        r = lambda t: f"{t / t_sdpa:10.2f}x" if t else f"{'n/a':>11}"
        print(f"{name:34} {g(t_sdpa)} {g(t_np)} {g(t_torch)} {r(t_np)} {r(t_torch)}", flush=True)
    forward_backward(rng)
    if args.bf16:
        bfloat16_table(rng)
        forward_backward(rng, bf16=True)


if __name__ == "__main__":
    sys.exit(main())
