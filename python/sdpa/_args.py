"""sdpa's argument policy, shared by its two Python front doors (sdpa, NumPy arrays, and
sdpa.torch, tensors): the dtype table on the Python side, the types each argument takes, and
causal's, softcap_order's and the window's Python spellings. Private.

Value rules (softcap >= 0, block sizes >= 1, the window, ...) are the C++ library's,
which names the argument (its sdpa::Error is ValueError here); a check of a value that stays
here says why (a better message, the right exception type, or a value C++ cannot see).
"""

from __future__ import annotations

import contextlib
import contextvars
import math
import numbers

import ml_dtypes
import numpy as np

# ---------------------------------------------------------------- the dtype table

# sdpa's storage dtypes by name: sdpa's name is also torch's (torch.float32, ...) and _core's
# (KVCache's dtype); the NumPy dtype (bfloat16 is ml_dtypes', which _core takes as uint16
# bits). They compute in float64 (float64) or float32 (the others): _compute_dtype.
_STORAGE = {"float32": np.dtype(np.float32), "float64": np.dtype(np.float64), "float16": np.dtype(np.float16),
            "bfloat16": np.dtype(ml_dtypes.bfloat16)}
_FLOAT32, _FLOAT64, _FLOAT16, _BFLOAT16 = _STORAGE.values()
_LOW = (_FLOAT16, _BFLOAT16)  # the 16-bit storage types: computed in float32, results rounded once
_STORAGE_NAME = {dtype: name for name, dtype in _STORAGE.items()}  # NumPy dtype -> sdpa's name
# The 8-bit K/V dtypes (an 8-bit cache's values, with float32 scales beside them: KVQuant) by
# sdpa's name, which is NumPy's: int8 symmetric, uint8 with a zero point. Computed in float32.
_KV8 = {"int8": np.dtype(np.int8), "uint8": np.dtype(np.uint8)}
_KV8_NAME = {dtype: name for name, dtype in _KV8.items()}


def _torch_dtypes(torch):
    """The storage dtypes as torch's, in _STORAGE's order."""
    return tuple(getattr(torch, name) for name in _STORAGE)


def _compute_dtype(dtype):
    """The dtype the kernels compute in for q of `dtype`, and that of weights and lse: float64
    for float64, else float32; a NumPy dtype for a NumPy dtype, a torch dtype for a torch dtype."""
    if isinstance(dtype, np.dtype):
        return _FLOAT64 if dtype == _FLOAT64 else _FLOAT32
    import torch  # only torch dtypes get here
    return torch.float64 if dtype == torch.float64 else torch.float32


def _numpy_of_tensor(name, t):
    """A tensor (detached, on the CPU) as a NumPy array sharing its memory: bfloat16 and the
    float8 types as ml_dtypes' (NumPy has none of them); TypeError naming it when it is not a
    tensor or NumPy cannot hold its dtype (complex32, quantized)."""
    import torch
    if not isinstance(t, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
    t = t.detach().cpu()
    ml = getattr(ml_dtypes, str(t.dtype).removeprefix("torch."), None) if t.is_floating_point() else None
    if ml is not None and t.element_size() in (1, 2):  # a bit-for-bit view through an integer of its size
        return t.view({1: torch.uint8, 2: torch.int16}[t.element_size()]).numpy().view(ml)
    try:
        return t.numpy()
    except TypeError:
        raise TypeError(f"{name} has dtype {t.dtype}, which NumPy cannot hold") from None


def _tensor_of_numpy(a):
    """A NumPy array (C-contiguous, or copied to be) as a tensor sharing its memory, an
    ml_dtypes.bfloat16 array as torch.bfloat16."""
    import torch
    if a.dtype == _BFLOAT16:
        return torch.from_numpy(np.ascontiguousarray(a).view(np.int16)).view(torch.bfloat16)
    return torch.from_numpy(a)


# ---------------------------------------------------------------- argument types and spellings

_INT64_MIN, _INT64_MAX = -2**63, 2**63 - 1
# causal as the Python front doors take it, by _core's and the torch operators' name for it.
_CAUSAL = {False: "none", True: "bottom_right", "none": "none", "bottom_right": "bottom_right",
           "top_left": "top_left"}
_SOFTCAP_ORDERS = ("before_bias", "after_bias")


def _describe(x):
    """repr(x) for a message; an integer too long to print usefully (Python refuses to print
    one past 4300 digits) is described by its size, other long reprs are cut."""
    if isinstance(x, numbers.Integral) and not isinstance(x, (bool, np.bool_)) and abs(int(x)) >= 2**128:
        return f"{'a negative' if x < 0 else 'an'} integer of {int(x).bit_length()} bits"
    try:
        text = repr(x)
    except ValueError:  # e.g. a Fraction whose parts have more than 4300 digits
        return f"a {type(x).__name__} too long to print"
    return text if len(text) <= 80 else text[:60] + "..."


class _NotAnInteger(TypeError, ValueError):
    """A value that is not an integer, given for an integer argument: a TypeError, and also a
    ValueError, which this package raised for it before (callers catching that keep working)."""


def _bound(n):
    return {_INT64_MIN: "-2**63", _INT64_MAX: "2**63 - 1", 2**64 - 1: "2**64 - 1"}.get(n, str(n))


def _checked_int(name, value, low=_INT64_MIN, high=_INT64_MAX):
    """value as an int in [low, high] (high None: unbounded), by default int64's range, which
    _core takes (it checks tighter ranges itself, naming the argument): the one rule for every
    integer argument. A Python or NumPy integer; a bool (True is a slip, not 1), a float (2.0
    too: nothing is truncated), a str (nothing is parsed) or None is _NotAnInteger, a value
    outside the range ValueError, each naming `name`."""
    if isinstance(value, (bool, np.bool_)) or not isinstance(value, numbers.Integral):
        raise _NotAnInteger(f"{name} must be an integer, got {_describe(value)}")
    if value < low or (high is not None and value > high):
        raise ValueError(f"{name} must be an integer in [{_bound(low)}, {'inf' if high is None else _bound(high)}], "
                         f"got {_describe(value)}")
    return int(value)


def _dtype_arg(name, dtype, allowed, names):
    """np.dtype(dtype) when it is one of `allowed` (spelt `names` in the message), else TypeError
    naming it; None is refused (NumPy would read it as float64)."""
    try:
        dt = None if dtype is None else np.dtype(dtype)
    except TypeError:  # not a dtype at all ("nonsense", 5)
        dt = None
    if dt is None or dt not in allowed:  # (np.dtype == None is float64's test, hence the first)
        raise TypeError(f"{name} must be {names}, got {_describe(dtype)}")
    return dt


def _out_dtype_arg(out_dtype, dtype, compute, name="out_dtype"):
    """out's (or, named grad_dtype, the gradients') dtype for q of `dtype` computing in `compute`:
    `dtype` for None, else out_dtype when it is `dtype` or `compute` (float32 partials of 16-bit
    q, unrounded), by _dtype_arg's rule."""
    if out_dtype is None:
        return dtype
    allowed = (dtype, compute)
    return _dtype_arg(name, out_dtype, allowed,
                      " or ".join(["None"] + [_STORAGE_NAME[d] for d in dict.fromkeys(allowed)]) + " (for these inputs)")


def _generator(seed):
    """np.random.default_rng(seed) (None: fresh entropy; an integer or a sequence of them), its
    refusals (a float, a str, a negative integer) naming seed."""
    try:
        return np.random.default_rng(seed)
    except (TypeError, ValueError) as e:
        raise type(e)(f"seed must be None, a non-negative integer or a sequence of them, got {_describe(seed)} "
                      f"({e})") from None


def _asarray(name, a):
    """np.asarray(a), with a ragged nested list reported under the argument's name."""
    try:
        return np.asarray(a)
    except ValueError as e:
        raise ValueError(f"{name} is not a rectangular array: {e}") from None


def _is_float8(dtype):
    """ml_dtypes.float8_e5m2 and its like: kind 'f' in one byte (NumPy's own floats have 2 or more)."""
    return dtype.kind == "f" and dtype.itemsize == 1


def _check_real(name, a):
    """The one rule for arrays of values (q, k, v, dout, out, lse, slopes, sinks, a cache's k and
    v, the layer's inputs, weights and dy): real numbers, which are converted as each function
    says; complex (its imaginary part would be dropped), strings (they would be parsed), object,
    datetime and other dtypes (ml_dtypes' float8 types: most have kind 'V', float8_e5m2 kind 'f'
    with one byte, which no NumPy float has) are TypeError naming the array."""
    if (a.dtype.kind not in "biuf" and a.dtype != _BFLOAT16) or _is_float8(a.dtype):
        raise TypeError(f"{name} has dtype {a.dtype}, but attention needs real numbers (float32, float64, "
                        "float16, ml_dtypes.bfloat16, or integers and bool, converted)")


def _real_array(name, a):
    """np.asarray(a) (see _asarray) when it holds real numbers (see _check_real)."""
    a = _asarray(name, a)
    _check_real(name, a)
    return a


def _window_bounds(window):
    if window is None:
        return -1, -1
    try:
        left, right = window
    except (TypeError, ValueError):
        raise ValueError(f"window must be a pair (left, right), got {window!r}") from None
    bounds = []
    for name, x in (("left", left), ("right", right)):
        if x is None:
            x = -1
        if isinstance(x, bool) or not isinstance(x, numbers.Integral):
            raise ValueError(f"window {name} must be an integer (-1 = unbounded), got {x!r}")
        # _core takes int64 bounds; any bound of Nq + Nk or more reaches every key, so one
        # beyond int64 is exactly as good as int64's largest.
        bounds.append(min(int(x), _INT64_MAX) if x >= 0 else -1)
    return bounds[0], bounds[1]


def _real_number(name, x, finite=True):
    """x (a real number, not a bool: a str is not parsed, a complex not cut) as a float, an int
    or Fraction beyond float64 as ±inf; TypeError naming it, and ValueError when `finite` and it
    is not (else the caller checks its range)."""
    if isinstance(x, (bool, np.bool_)) or not isinstance(x, numbers.Real):
        raise TypeError(f"{name} must be a real number, got {_describe(x)}")
    try:
        value = float(x)
    except OverflowError:  # an int or Fraction beyond float64
        value = math.inf if x > 0 else -math.inf
    if finite and not math.isfinite(value):
        raise ValueError(f"{name} must be finite, got {_describe(x)}")
    return value


def _causal_name(causal):
    """causal as _core and the torch operators name it: False (or None), True, or a name."""
    # Only bools (Python or NumPy) and the names: 1, 0.0 and the like are more likely slips.
    key = bool(causal) if causal is None or isinstance(causal, (bool, np.bool_)) else causal
    if not isinstance(key, (bool, str)) or key not in _CAUSAL:
        raise ValueError(f"causal must be False, True, 'bottom_right' or 'top_left', got {causal!r}")
    return _CAUSAL[key]


def _scale_value(scale, dtype=None):
    """A scale (a real number or None) as a float or None, and, with the
    compute dtype `dtype`, one that it holds. Both checks are C++'s too, kept here because C++
    cannot see them: the finite check names the value given (10**400, not inf), and a scale
    that rounds to 0 in float64 (Fraction(1, 10**400)) reaches C++ as 0, a scale it takes."""
    if scale is None:
        return None
    value = _real_number("scale", scale)
    if dtype is not None:
        # The kernels multiply in the compute dtype, where the scale must not round to inf (for
        # float32, a magnitude past its max by half an ulp or more) nor, when not 0, to 0 (for
        # float32, 2**-150, half its smallest subnormal, or less).
        with np.errstate(over="ignore", under="ignore"):
            rounded = dtype.type(value)
        if np.isinf(rounded) or (rounded == 0 and scale != 0):
            holds = {"float32": "from about 1.4e-45 to 3.4e38; pass float64 q, k and v for such a scale",
                     "float64": "from about 4.9e-324 to 1.8e308"}[dtype.name]
            raise ValueError(f"scale {_describe(scale)} does not fit in {dtype}, the dtype q, k and v compute in: "
                             f"it would become {'inf' if np.isinf(rounded) else '0'} ({dtype} holds magnitudes "
                             f"{holds})")
    return value


def _parsed_options(causal, scale, window, backend, dtype):
    """(causal name, scale or None, window left, window right) for _core; `dtype` is the compute
    dtype, which must hold the scale. backend's name is _core's to check (a str is all it
    takes: anything else would be nanobind's TypeError, not naming backend)."""
    causal = _causal_name(causal)
    if not isinstance(backend, str):
        raise ValueError(f"backend must be 'auto', 'flash', 'reference' or 'naive', got {backend!r}")
    if isinstance(scale, np.ndarray) and scale.ndim == 0:
        scale = scale[()]  # a 0-d array is a number
    left, right = _window_bounds(window)
    return causal, _scale_value(scale, dtype), left, right


def _parsed_dropout(dropout_p, seed):
    """(p, seed) for _core and the torch operators: p a real number in [0, 1); seed an integer,
    required when p > 0. C++ checks both too; they stay here because the seed's requirement
    is worded for Python (C++ speaks of Options::seed), and the range must be refused before
    it (dropout_p=10**400 without a seed is dropout_p's error), naming the value as given."""
    p = _real_number("dropout_p", dropout_p, finite=False)
    if not 0.0 <= p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {_describe(dropout_p)}")
    if seed is None:
        if p > 0:
            raise ValueError("seed must be given when dropout_p > 0: the same seed draws the same "
                             "dropout mask in attention and attention_backward")
        seed = 0
    return p, _checked_int("seed", seed, 0, 2**64 - 1)


def _parsed_softcap(softcap, softcap_order):
    """(softcap, softcap_order): softcap a real number (10**400 is inf, which C++ refuses by
    name, as any other value out of range), the order one of _SOFTCAP_ORDERS, checked here
    because anything but a str would reach C++ as a TypeError that does not name it."""
    softcap = _real_number("softcap", softcap, finite=False)
    if not isinstance(softcap_order, str) or softcap_order not in _SOFTCAP_ORDERS:
        raise ValueError(f"softcap_order must be 'before_bias' or 'after_bias', got {_describe(softcap_order)}")
    return softcap, softcap_order


def _prepared_indices(name, a, meaning, ndim=1):
    """An index array (seqlens_k, cu_seqlens, block_table, sequence ids) as the int64 array _core
    reads; _core checks its length and values, so that its messages name the batch and the
    sizes. `meaning` says what it holds, for the messages here. The one rule for indices:
    integers only, a float (1.0 too: nothing is truncated) or bool array is TypeError."""
    if a is None:
        return None
    given, a = a, _asarray(name, a)
    if a.size == 0 and not isinstance(given, np.ndarray):
        a = a.astype(np.int64)  # [] has no dtype of its own (NumPy makes it float64)
    if a.dtype == object:  # NumPy keeps integers beyond int64 and uint64 ([2**64]) as Python objects
        big = [x for x in a.flat if isinstance(x, numbers.Integral) and not _INT64_MIN <= x <= _INT64_MAX]
        if big:
            raise ValueError(f"{name} holds {_describe(big[0])}, beyond int64 ({meaning})")
    if a.dtype == np.bool_ or a.dtype.kind not in "iu":
        raise TypeError(f"{name} has dtype {a.dtype}, but must hold integers ({meaning})")
    if a.ndim != ndim:
        raise ValueError(f"{name} has shape {a.shape}, but must have {ndim} dim{'s' * (ndim > 1)}: {meaning}")
    if a.dtype == np.uint64 and a.size and int(a.max()) > np.iinfo(np.int64).max:
        raise ValueError(f"{name} holds {int(a.max())}, more than any number of rows")
    return np.ascontiguousarray(a, dtype=np.int64)


def _block_sizes(block_size, low=_INT64_MIN):
    """(block_q, block_k) from an int or a pair of ints, each in [low, 2**63 - 1] (_core checks
    that they are >= 1, naming block_q and block_k)."""
    pair = block_size if isinstance(block_size, (tuple, list)) else (block_size, block_size)
    if len(pair) != 2:
        raise TypeError(f"block_size must be an int or a pair of ints (block_q, block_k), got {_describe(block_size)}")
    return tuple(_checked_int("block_size", b, low) for b in pair)


def _positions(q_start, k_start):
    """The q_start and k_start keywords for _core (Options::q_start, k_start): each None or an
    int in int64's range; _core checks the rest, naming them (both or neither, each >= 0, the
    last row's and key's positions held by int64)."""
    return {name: None if x is None else _checked_int(name, x) for name, x in (("q_start", q_start), ("k_start", k_start))}


# Options::precision: "exact" (the default) or "fast" (16-bit inputs round the weights before
# p·V; float32 and float64 inputs ignore it). A call's precision=None takes the innermost
# ``precision(...)`` block's, else "exact".
_PRECISION_NAMES = ("exact", "fast")
_PRECISION = contextvars.ContextVar("sdpa_precision", default="exact")


def _precision_arg(precision):
    """A call's precision as _core takes it: the context's for None; a name _core checks."""
    if precision is None:
        return _PRECISION.get()
    if not isinstance(precision, str):
        raise TypeError(f"precision must be 'exact' or 'fast', got {_describe(precision)}")
    return precision


def _batch_invariant_arg(batch_invariant):
    """Options::batch_invariant as _core takes it: a bool (Python's or NumPy's); anything else
    (1, "yes", None) is TypeError, more likely a slip than a choice."""
    if not isinstance(batch_invariant, (bool, np.bool_)):
        raise TypeError(f"batch_invariant must be True or False, got {_describe(batch_invariant)}")
    return bool(batch_invariant)


@contextlib.contextmanager
def precision(mode):
    """Sets the precision of every sdpa call in the block that does not name its own (NumPy's
    ``sdpa.attention`` and the rest, and ``sdpa.torch``'s functions and modules), as
    ``torch.backends``' flags set PyTorch's; blocks nest, and each thread (and asyncio task)
    has its own::

        with sdpa.precision("fast"):      # bfloat16 and float16 inputs round the weights
            y = model(x)                  # before p·V (see sdpa.attention)

    mode: "exact" or "fast"."""
    if mode not in _PRECISION_NAMES:
        raise ValueError(f"precision must be 'exact' or 'fast', got {_describe(mode)}")
    token = _PRECISION.set(mode)
    try:
        yield
    finally:
        _PRECISION.reset(token)
