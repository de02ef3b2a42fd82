"""NumPy arrays as _core takes them: the outputs it writes (refused by name when they cannot
fit), the inputs converted to the dtype policy of ``sdpa.attention`` (bfloat16 as a uint16 view:
_core_view) without copying broadcast dims, masks, sequence lengths and ids. Private: shared by
``sdpa`` (__init__) and ``sdpa.layer``; the argument policy (names, options, numbers) is _args'."""

from __future__ import annotations

import math
import os
import sys

import numpy as np

from ._args import (_BFLOAT16, _FLOAT16, _FLOAT32, _FLOAT64, _KV8_NAME, _LOW, _asarray, _check_real, _compute_dtype,
                    _is_float8, _prepared_indices)


def _memory_bytes():
    """The machine's physical memory in bytes (sys.maxsize where the OS does not say)."""
    try:
        n = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (AttributeError, ValueError, OSError):
        return sys.maxsize
    return min(n, sys.maxsize) if n > 0 else sys.maxsize


_MEMORY_BYTES = _memory_bytes()


def _byte_size(n):
    for unit in ("bytes", "KiB", "MiB", "GiB", "TiB", "PiB"):
        if n < 1024 or unit == "PiB":
            return f"{n} bytes" if unit == "bytes" else f"{n:.3g} {unit}"
        n /= 1024


def _check_fits(what, shape, dtype):
    """ValueError unless NumPy can make an array of `shape` and `dtype` and it fits in this
    machine's memory, checked before NumPy is asked for it (it would try, or fail without
    naming the array); `what` starts the message ("weights would have", "q needs a copy of")."""
    dtype = np.dtype(dtype)
    count = math.prod(shape)
    nbytes = count * dtype.itemsize
    if nbytes > _MEMORY_BYTES:
        raise ValueError(f"{what} shape {tuple(shape)} of {dtype}: {count} elements, "
                         f"{_byte_size(nbytes)}, more than this machine's memory ({_byte_size(_MEMORY_BYTES)})")
    if math.prod(n for n in shape if n) * dtype.itemsize > np.iinfo(np.intp).max:
        raise ValueError(f"{what} shape {tuple(shape)} of {dtype}, which NumPy cannot make although it holds no "
                         "element: its non-zero dims times the item size exceed the largest array size")


def _empty(name, shape, dtype):
    """np.empty(shape, dtype) for the output `name`, refused by name when it cannot fit."""
    _check_fits(f"{name} would have", shape, dtype)
    return np.empty(shape, dtype)


def _check_kind(name, a):
    _check_real(name, a)
    if not 2 <= a.ndim <= 4:
        raise ValueError(f"{name} has shape {a.shape}, but must have 2, 3 or 4 dims "
                         "(N, D), (H, N, D) or (B, H, N, D)")


def _narrow_float(a):
    """float16, bfloat16 or float32 (native byte order) for an array of one of them, in either
    byte order; None for anything else (float64, long double, integers, bool)."""
    if a.dtype == _BFLOAT16:
        return _BFLOAT16
    if a.dtype.kind == "f" and a.dtype.itemsize in (2, 4):
        return _FLOAT16 if a.dtype.itemsize == 2 else _FLOAT32
    return None


def _kv8_dtype(k_name, k, v_name, v):
    """The dtype of an 8-bit cache's values k and v (given with their scales): both int8 or both
    uint8, else TypeError naming the one that is not (nothing is converted to 8 bits here:
    ``quantize_kv`` does that, with the scales)."""
    for name, a in ((k_name, k), (v_name, v)):
        if a.dtype not in _KV8_NAME:
            raise TypeError(f"{name} has dtype {a.dtype}, but with k_scale and v_scale {k_name} and {v_name} hold an "
                            "8-bit cache's values, int8 or uint8 (sdpa.quantize_kv makes them)")
    if k.dtype != v.dtype:
        raise TypeError(f"{v_name} has dtype {v.dtype} but {k_name} has {k.dtype}: an 8-bit cache's values share one")
    return k.dtype


def _kv8_query_dtype(q):
    """q's dtype over an 8-bit cache: float32, float16 or bfloat16 kept, any other converted to
    float32 (the 8-bit kernels compute in float32)."""
    narrow = _narrow_float(q)
    return _FLOAT32 if narrow is None else narrow


def _storage_dtypes(q, k, v, quantized=False):
    """(q's dtype, k's and v's dtype) as _core gets them: the dtype policy of ``attention``.

    q, k, v all float16, or all bfloat16: kept (computed in float32, out rounded to it);
    float32 q over float16 or bfloat16 k and v (one dtype): kept (a 16-bit KV cache);
    any other mix of float32, float16 and bfloat16: float32; anything with float64, long
    double, integers or bool: float64. quantized (scales given): k and v int8 or uint8 kept,
    q as _kv8_query_dtype says."""
    if quantized:
        return _kv8_query_dtype(q), _kv8_dtype("k", k, "v", v)
    q_dt, k_dt, v_dt = (_narrow_float(a) for a in (q, k, v))
    if k_dt in _LOW and k_dt == v_dt and q_dt in (k_dt, _FLOAT32):
        return q_dt, k_dt
    if None in (q_dt, k_dt, v_dt):
        return _FLOAT64, _FLOAT64
    return _FLOAT32, _FLOAT32


def _core_view(a):
    """a as _core takes it: a bfloat16 array as a uint16 view of the same memory (NumPy has no
    bfloat16 of its own, and _core cannot read ml_dtypes' dtype), others as they are."""
    return None if a is None else a.view(np.uint16) if a.dtype == _BFLOAT16 else a


def _readable_in_place(a):
    """Whether _core can take a as it is: aligned, and (for _core's strides in elements) every
    byte stride a multiple of the item size. NumPy allows any address and stride: a buffer at
    an odd offset, a field of a structured array."""
    size = a.dtype.itemsize
    return a.flags.aligned and a.ctypes.data % size == 0 and all(s % size == 0 for s in a.strides)


def _broadcast_dims(a):
    """An index that keeps one element of each stride-0 (broadcast) dim of a, all of the others."""
    return tuple(slice(0, 1) if n > 1 and s == 0 else slice(None) for n, s in zip(a.shape, a.strides))


def _converted(name, a, dtype):
    """a as `dtype` (native byte order), readable in place by _core: a itself when it already
    is, else a copy in which broadcast (stride-0) dims stay broadcast: only one of their
    elements is converted, so a broadcast input never grows to its full size."""
    if a.dtype == dtype and _readable_in_place(a):
        return a
    stored = a[_broadcast_dims(a)] if a.size else a  # an empty array is all stride 0, broadcast or not
    _check_fits(f"{name} needs a copy{'' if a.dtype == dtype else f' as {dtype}'} of", stored.shape, dtype)
    copy = np.array(stored, dtype=dtype, copy=True)  # a fresh array: aligned, native order
    return copy if copy.shape == a.shape else np.broadcast_to(copy, a.shape)


def _prepared(name, a, dtype, unit_last_stride=True):
    """a as `dtype`, readable in place by _core (see _converted), with unit stride in its last
    dim (the kernel's only layout need of q, k, v, out and dout; lse may have any strides).

    Other strides (transposes, slices, broadcast zeros) are passed through without a copy."""
    a = _converted(name, np.asarray(a), dtype)
    if unit_last_stride and a.ndim > 0 and a.shape[-1] > 1 and a.strides[-1] != a.itemsize:
        _check_fits(f"{name} needs a copy with unit stride in its last dim, of", a.shape, dtype)
        a = np.ascontiguousarray(a)
    return a


def _check_mask_dtype(name, mask):
    """The rule for element masks: bool (True = attend) or floating point (a bias), else TypeError."""
    if mask.dtype != np.bool_ and (mask.dtype.kind != "f" or _is_float8(mask.dtype)) and mask.dtype != _BFLOAT16:
        raise TypeError(f"{name} has dtype {mask.dtype}, but must be bool (True = attend, False = block) "
                        "or floating point (added to the scaled scores); for a 0/1 mask use mask.astype(bool)")


def _prepared_mask(mask, q_dtype, scores_shape):
    """mask as bool, as q's dtype `q_dtype` when it has that dtype, or else as q's compute
    dtype; its rank checked against the scores' (B, Hq, Nq, Nk)."""
    mask = _asarray("mask", mask)
    _check_mask_dtype("mask", mask)
    if mask.ndim > 4:  # _core only takes up to 4 dims and would not say which shape it got
        raise ValueError(f"mask has shape {mask.shape}, more dims than the scores {scores_shape}; "
                         "a mask has at most 4 dims, (B, Hq, Nq, Nk)")
    if mask.dtype == np.bool_:
        return _converted("mask", mask, mask.dtype)
    if q_dtype in _LOW and _narrow_float(mask) == q_dtype:
        return _converted("mask", mask, q_dtype)  # a 16-bit mask of q's own dtype: _core widens it
    dtype = _compute_dtype(q_dtype)
    if mask.dtype.itemsize <= dtype.itemsize:
        return _converted("mask", mask, dtype)  # exact: float16 or bfloat16 -> float32, float32 -> float64, ...
    # Narrowing (float64 -> float32, long double -> float64): a bias below the compute dtype's
    # lowest value becomes -inf, which blocks, as documented; one above its largest value
    # would become +inf, a value the caller never passed, so it is refused here by name.
    with np.errstate(over="ignore"):
        converted = _converted("mask", mask, dtype)
    # Checked on one element of each broadcast dim: the first such value in index order has
    # index 0 in those dims.
    stored = _broadcast_dims(mask)
    overflowed = np.isposinf(converted[stored])
    if overflowed.any():
        overflowed &= ~np.isposinf(mask[stored])  # a +inf passed as such is reported by _core as +inf
        if overflowed.any():
            index = tuple(int(i) for i in np.argwhere(overflowed)[0])
            raise ValueError(f"mask has {str(mask[index])} at index {index}, which does not fit in {dtype} "
                             f"(largest {str(np.finfo(dtype).max)}), the dtype q, k and v compute in; "
                             "pass a smaller bias, or -inf to block")
    return converted


def _prepared_inputs(q, k, v, mask, quantized=False):
    """(compute dtype, q, k, v, mask) ready for _core (bfloat16 still as ml_dtypes.bfloat16:
    see _core_view): the dtype policy of ``attention``; quantized: k and v are an 8-bit cache's
    values (_storage_dtypes)."""
    arrays = [_asarray(name, x) for name, x in zip("qkv", (q, k, v))]
    for name, a in zip("qkv", arrays):
        _check_kind(name, a)
    q_dtype, kv_dtype = _storage_dtypes(*arrays, quantized=quantized)
    q = _prepared("q", arrays[0], q_dtype)
    k, v = (_prepared(name, a, kv_dtype) for name, a in zip("kv", arrays[1:]))
    if mask is not None:
        mask = _prepared_mask(mask, q_dtype, q.shape[:-1] + k.shape[-2:-1])
    return _compute_dtype(q_dtype), q, k, v, mask


# The dtypes the fast path of ``attention`` passes to _core as they are (native byte order),
# each aligned to its item size, so that NumPy's aligned flag of a non-empty array of one of them
# is _readable_in_place's check of the address and of the strides of its dims longer than 1.
_AS_IS = tuple(d for d in (_FLOAT32, _FLOAT64, _FLOAT16, _BFLOAT16) if d.alignment == d.itemsize)


def _as_is(a):
    """Whether _prepared would return a itself (no conversion, no copy), by a shorter road than
    its checks: an ndarray (not a subclass) of 2 to 4 dims (_check_kind's) and one of _AS_IS, not
    empty, readable in place (the aligned flag, and every stride a multiple of the item size)
    and with unit stride in its last dim (or a last dim of at most 1). False sends a call to
    the checks that name the argument."""
    if type(a) is not np.ndarray or a.dtype not in _AS_IS or not 2 <= a.ndim <= 4 or not a.size:
        return False
    size = a.itemsize
    return (a.flags.aligned and (a.strides[-1] == size or a.shape[-1] <= 1)
            and all(s % size == 0 for s in a.strides))


def _inputs_as_is(q, k, v):
    """Whether _prepared_inputs(q, k, v, None) would return q, k and v themselves: each _as_is,
    with dtypes that _storage_dtypes keeps (one dtype, or float32 q over one 16-bit k and v)."""
    return (_as_is(q) and _as_is(k) and _as_is(v) and k.dtype == v.dtype
            and (q.dtype == k.dtype or (q.dtype == _FLOAT32 and k.dtype in _LOW)))


def _prepared_kv_quant(k_scale, v_scale, k_zero, v_zero):
    """An 8-bit cache's scales and zero points as _core's keyword arguments (those given): float32
    arrays read in place (copied only where _core cannot read them so, any strides kept
    otherwise); another dtype is TypeError naming it (a float64 scale would be rounded).
    _core checks their shapes and values, and which of them an 8-bit k and v need."""
    given = {}
    for name, a in (("k_scale", k_scale), ("v_scale", v_scale), ("k_zero", k_zero), ("v_zero", v_zero)):
        if a is not None:
            a = _asarray(name, a)
            if a.dtype.kind != "f" or a.dtype.itemsize != 4:
                raise TypeError(f"{name} has dtype {a.dtype}, but an 8-bit cache's scales and zero points are float32 "
                                "(sdpa.quantize_kv makes them)")
            given[name] = _converted(name, a, _FLOAT32)
    return given


def _prepared_seqlens(seqlens_k):
    return _prepared_indices("seqlens_k", seqlens_k, "(B,), one key length per sequence")


def _sequence_ids(seqs, rows):
    """seqs (one id, or a list, tuple or 1-dim array of ids) as the list of ints _core takes, by
    the rule of index arrays (_prepared_indices): [0.9], np.array([1.0]) and [True] are
    TypeError naming seqs, never sequence 0 or 1; `rows` names the array they index."""
    a = _asarray("seqs", seqs)
    # One id is a list of one; a list goes on as it is, so that [] is an empty list of ids.
    return _prepared_indices("seqs", a.reshape(1) if a.ndim == 0 else seqs,
                             f"sequence ids, one per row of {rows}").tolist()
