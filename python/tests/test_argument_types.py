"""Argument-type fuzzing of every public entry point of ``sdpa`` (issue 26).

Every function, class and public method the package exports (enumerated from ``sdpa.__all__``,
so that a new entry point without a row in ENTRY_POINTS fails ``test_every_entry_point_has_a_row``)
is called once validly, then once per wrong argument: arrays of dtypes it must refuse (complex,
strings, object, float8, datetime, ...), integers that do not fit int64 or are not integers
(2**64, 2.5, 2.0, True, "3", None), integer-valued float sequence ids, real numbers that are
not (a str, a complex) or that float64 cannot hold (10**400). Each must raise
TypeError or ValueError whose message starts with the argument's name (after an optional
"function: " prefix), never nanobind's "incompatible function arguments" nor OverflowError,
nothing may be converted silently (a complex array's real part stored, a float id truncated),
and nothing may be changed by the failed call (a KVCache's lengths, pages and pool, the layer's
parameters, the thread count).

The rules the rows encode (one rule each, in sdpa/__init__.py):
  real arrays (q, k, v, dout, out, lse, x, dy, weights, alibi_slopes, sinks, a cache's k and v):
      float32/64, float16, bfloat16, and integers and bool as numbers; anything else TypeError
  page pools (read in place): float32/64, float16, bfloat16 only
  index arrays (seqlens_k, cu_seqlens, block_table) and sequence ids (seqs): integers only; a
      float, even 1.0, and bool are TypeError (never truncated, never 0/1)
  masks: bool or floating point; block masks: bool
  integer arguments: Python or NumPy integers (not bool) within int64, TypeError otherwise
      (also a ValueError, as before), ValueError outside the range
  real-number arguments (scale, softcap, dropout_p, rope_base): numbers.Real, not bool
"""

import inspect as pyinspect
import os
import re

import ml_dtypes
import numpy as np
import pytest

import sdpa
from torch_required import import_torch

# ---------------------------------------------------------------- wrong values, by kind of argument

REAL_BAD = {
    "complex": lambda a: np.asarray(a).astype(np.complex128),
    "str": lambda a: np.asarray(a).astype(str),
    "object": lambda a: np.asarray(a).astype(object),
    "float8": lambda a: np.asarray(a).astype(ml_dtypes.float8_e4m3fn),
    "float8_e5m2": lambda a: np.asarray(a).astype(ml_dtypes.float8_e5m2),  # kind 'f', one byte
    "datetime": lambda a: np.asarray(a).astype(np.int64).astype("datetime64[s]"),
}
POOL_BAD = dict(REAL_BAD, bool=lambda a: np.asarray(a) > 0, int32=lambda a: np.asarray(a).astype(np.int32))
INDEX_BAD = {
    "float": lambda a: np.asarray(a).astype(np.float64),           # integer-valued: still refused
    "float-list": lambda a: np.asarray(a).astype(np.float64).tolist(),
    "bool": lambda a: np.asarray(a) > 0,
    "complex": REAL_BAD["complex"], "str": REAL_BAD["str"], "object-None": lambda a: np.full(np.shape(a), None),
    "datetime": REAL_BAD["datetime"],
}
MASK_BAD = {"int": lambda a: np.asarray(a).astype(np.int64), **{k: REAL_BAD[k] for k in REAL_BAD}}
BLOCK_MASK_BAD = {"float": lambda a: np.asarray(a).astype(np.float32), "int": lambda a: np.asarray(a).astype(np.int8),
                  **{k: REAL_BAD[k] for k in ("complex", "str", "object")}}
# Sequence ids: one id or a list / array of them.
IDS_BAD = {
    "float-list": ([0.9], TypeError), "float-array": (np.array([1.0]), TypeError), "bool": ([True], TypeError),
    "str": (np.array(["0"]), TypeError), "None": ([None], TypeError), "2**64": ([2**64], ValueError),
    "float-scalar": (0.5, TypeError),
}
INT_BAD = {"2**64": (2**64, ValueError), "-2**64": (-2**64, ValueError), "10**5000": (10**5000, ValueError),
           "2.5": (2.5, TypeError), "2.0": (2.0, TypeError), "True": (True, TypeError), "'3'": ("3", TypeError),
           "None": (None, TypeError), "np.float64": (np.float64(2), TypeError)}
# Real numbers (scale, softcap, dropout_p, rope_base): never parsed from a str, never cut from a
# complex, never an OverflowError.
REAL_NUMBER_BAD = {"10**400": (10**400, ValueError), "-10**400": (-10**400, ValueError), "'3'": ("3", TypeError),
                   "1j": (1j, TypeError), "True": (True, TypeError), "array": (np.ones(2), TypeError)}
DTYPE_BAD = {"complex64": np.complex64, "int32": np.int32, "float8": ml_dtypes.float8_e4m3fn, "'foo'": "foo",
             "None": None, "5": 5}
KINDS = {"real": REAL_BAD, "pool": POOL_BAD, "index": INDEX_BAD, "mask": MASK_BAD, "block_mask": BLOCK_MASK_BAD}


# ---------------------------------------------------------------- valid calls of each entry point


def _rng():
    return np.random.default_rng(0)


def _qkv(rank=4):
    r = _rng()
    lead_q, lead_kv = {4: ((1, 2), (1, 1)), 3: ((2,), (1,))}[rank]
    return tuple(r.standard_normal(shape).astype(np.float32)
                 for shape in (lead_q + (3, 4), lead_kv + (5, 4), lead_kv + (5, 4)))


MODS = dict(alibi_slopes=np.array([0.5, 0.25], np.float32), sinks=np.array([0.1, -0.2], np.float32),
            block_mask=np.ones((1, 1), bool), block_size=128)


def _attention_args():
    q, k, v = _qkv()
    return dict(q=q, k=k, v=v, mask=np.zeros((1, 2, 3, 5), np.float32), seqlens_k=np.array([4]), topk=2,
                **MODS)


def _backward_args():
    q, k, v = _qkv()
    mask, seqlens = np.zeros((1, 2, 3, 5), np.float32), np.array([4])
    out, lse = sdpa.attention(q, k, v, mask, seqlens_k=seqlens, return_lse=True, **MODS)
    return dict(dout=np.ones_like(out), q=q, k=k, v=v, out=out, lse=lse, mask=mask, seqlens_k=seqlens, **MODS)


def _varlen_args():
    q, k, v = (a[0].transpose(1, 0, 2).copy() for a in _qkv())  # (total, H, D)
    return dict(q=q, k=k, v=v, cu_seqlens_q=np.array([0, 1, 3]), cu_seqlens_k=np.array([0, 2, 5]), **MODS)


def _varlen_backward_args():
    args = _varlen_args()
    out, lse = sdpa.attention_varlen(**args, return_lse=True)
    return dict(dout=np.ones_like(out), out=out, lse=lse, **args)


def _paged_args():
    r = _rng()
    pool = r.standard_normal((3, 2, 1, 4)).astype(np.float32)
    return dict(q=r.standard_normal((3, 2, 4)).astype(np.float32), k_pages=pool, v_pages=pool.copy(),
                block_table=np.array([[0, 1], [2, -1]]), seqlens_k=np.array([3, 2]), cu_seqlens_q=np.array([0, 2, 3]),
                **MODS)


def _cache():
    cache = sdpa.KVCache(4, 2, 1, 4)
    s = cache.new_sequence()
    cache.append(s, np.ones((3, 1, 4)), np.ones((3, 1, 4)))
    return cache


def _cache_state(cache):
    seqs = cache.sequences()
    return (tuple(seqs), tuple(cache.length(s) for s in seqs), tuple(tuple(cache.pages(s)) for s in seqs),
            cache.free_pages, cache.k_pages.tobytes(), cache.v_pages.tobytes())


def _layer():
    return sdpa.MultiHeadAttention(8, 2, num_kv_heads=1, rope=True, seed=0)


def _layer_state(layer):
    return tuple((n, a.tobytes()) for n, a in layer.parameters().items())


class Row:
    """One entry point: `setup()` returns (call, state, values): call(**overrides) calls it
    validly with these arguments replaced, state() is what a failed call must leave as it was,
    values the valid call's arguments (the wrong arrays are made from them). `arrays` maps
    array arguments to their kind (a key of KINDS), `ints` integer arguments to the bad values
    they must refuse (default INT_BAD), `ids` the sequence-id arguments, `dtypes` the dtype
    arguments, `reals` the real-number arguments; `exempt` says why an argument is not fuzzed."""

    def __init__(self, setup, arrays=(), ints=(), ids=(), dtypes=(), reals=(), exempt=None):
        self.setup, self.arrays, self.ids, self.dtypes = setup, dict(arrays), tuple(ids), tuple(dtypes)
        self.reals = tuple(reals)
        self.exempt = exempt
        self.ints = {name: bad for name, bad in (i if isinstance(i, tuple) else (i, INT_BAD) for i in ints)}


def _function(fn, args):
    def setup():
        base = args()
        return (lambda **over: fn(**{**base, **over})), (lambda: tuple((n, np.asarray(a).tobytes()) for n, a in
                                                                       base.items() if isinstance(a, np.ndarray))), base
    return setup


def _method(make, method, args, state):
    def setup():
        obj = make()
        base = args(obj)
        return (lambda **over: getattr(obj, method)(**{**base, **over})), (lambda: state(obj)), base
    return setup


def _cache_method(method, args=lambda c: {}):
    return _method(_cache, method, args, _cache_state)


def _layer_method(method, args):
    def setup():
        layer = _layer()
        cache = layer.new_cache(4, 2)
        cache.new_sequence()
        layer(np.ones((1, 2, 8), np.float32))  # a forward for backward
        base = args(layer, cache)

        def call(**over):
            # The parameters are attributes that forward, backward and step read: set for the
            # call, then the layer's own again (state() checks that nothing else changed).
            params = {name: over.pop(name) for name in MHA_ARRAYS if name in over}
            kept = {name: getattr(layer, name) for name in params}
            try:
                for name, a in params.items():
                    setattr(layer, name, a)
                return getattr(layer, method)(**{**base, **over})
            finally:
                for name, a in kept.items():
                    setattr(layer, name, a)
        return call, lambda: (_layer_state(layer), _cache_state(cache)), {**layer.parameters(), **base}
    return setup


def _threads_setup():
    return (lambda **over: sdpa.set_num_threads(**{"n": sdpa.num_threads(), **over})), sdpa.num_threads, {}


def _constructor(cls, args):
    def setup():
        return (lambda **over: cls(**{**args, **over})), (lambda: None), args
    return setup


MHA_ARRAYS = dict.fromkeys(("w_q", "w_k", "w_v", "w_o", "b_q", "b_k", "b_v", "b_o"), "real")
ATTENTION_ARRAYS = dict(q="real", k="real", v="real", mask="mask", seqlens_k="index", alibi_slopes="real",
                        sinks="real", block_mask="block_mask")
RNG_SEED_BAD = {k: INT_BAD[k] for k in ("-2**64", "2.5", "2.0", "'3'", "np.float64")}
# np.random.default_rng takes any non-negative integer (2**64 too) and None (fresh entropy).

ENTRY_POINTS = {
    "attention": Row(_function(sdpa.attention, lambda: dict(_attention_args(), return_stats=True)),
                     ATTENTION_ARRAYS, ints=["topk", "block_size"], reals=["scale", "softcap", "dropout_p"]),
    "inspect": Row(_function(sdpa.inspect, lambda: dict(_attention_args(), progress=False)),
                   ATTENTION_ARRAYS, ints=["topk", "cells", "max_heads", "block_size"], reals=["scale", "softcap"]),
    "attention_backward": Row(_function(sdpa.attention_backward, _backward_args),
                              dict(ATTENTION_ARRAYS, dout="real", out="real", lse="real"), ints=["block_size"],
                              reals=["scale", "softcap", "dropout_p"]),
    "attention_varlen": Row(_function(sdpa.attention_varlen, _varlen_args),
                            dict(q="real", k="real", v="real", cu_seqlens_q="index", cu_seqlens_k="index",
                                 alibi_slopes="real", sinks="real", block_mask="block_mask"), ints=["block_size"],
                            reals=["scale", "softcap", "dropout_p"]),
    "attention_varlen_backward": Row(_function(sdpa.attention_varlen_backward, _varlen_backward_args),
                                     dict(q="real", k="real", v="real", dout="real", out="real", lse="real",
                                          cu_seqlens_q="index", cu_seqlens_k="index", alibi_slopes="real",
                                          sinks="real", block_mask="block_mask"), ints=["block_size"],
                                     reals=["scale", "softcap", "dropout_p"]),
    "attention_paged": Row(_function(sdpa.attention_paged, _paged_args),
                           dict(q="real", k_pages="pool", v_pages="pool", block_table="index", seqlens_k="index",
                                cu_seqlens_q="index", alibi_slopes="real", sinks="real", block_mask="block_mask"),
                           ints=["block_size"], reals=["scale", "softcap"]),
    "dropout_mask": Row(_function(sdpa.dropout_mask, lambda: dict(shape=(2, 3), dropout_p=0.5, seed=1)),
                        ints=[("seed", {k: v for k, v in INT_BAD.items() if k != "None"})],  # None: ValueError
                        reals=["dropout_p"]),
    "merge_attention": Row(_function(sdpa.merge_attention, lambda: dict(outs=[np.ones((2, 3, 4), np.float32)],
                                                                         lses=[np.zeros((2, 3), np.float32)])),
                           exempt="outs, lses: sequences of arrays, each refused by name (outs[s], lses[s]) as in "
                                  "test_merge.py::test_merge_errors; out_dtype: None is valid (the compute dtype)"),
    "quantize_kv": Row(_function(sdpa.quantize_kv, lambda: dict(x=np.ones((2, 4), np.float32), groups=2)),
                       dict(x="real"), ints=["groups"], dtypes=["dtype"]),
    "set_num_threads": Row(_threads_setup, ints=["n"]),
    "num_threads": Row(_function(sdpa.num_threads, dict)),
    "precision": Row(_function(sdpa.precision, lambda: dict(mode="fast")),
                     exempt="mode: a name, 'exact' or 'fast', checked when the block is entered (test_precision.py)"),
    "block_mask_bigbird": Row(_function(sdpa.block_mask_bigbird, lambda: dict(nq=5, nk=7, block_size=2, window=1,
                                                                              random_blocks=1, seed=0)),
                              ints=["nq", "nk", "block_size", "window", "global_blocks", "random_blocks",
                                    ("seed", RNG_SEED_BAD)]),
    "block_mask_dilated": Row(_function(sdpa.block_mask_dilated, lambda: dict(nq=5, nk=7, block_size=2, window=2)),
                              ints=["nq", "nk", "block_size", "dilation",
                                    ("window", {k: v for k, v in INT_BAD.items() if k != "None"})]),
    "block_mask_from_mask": Row(_function(sdpa.block_mask_from_mask, lambda: dict(mask=np.ones((3, 5), bool),
                                                                                  block_size=2)),
                                dict(mask="mask"), ints=["block_size"]),
    "document_mask": Row(_function(sdpa.document_mask, lambda: dict(doc_q=[0, 0, 1], doc_k=[0, 1])),
                         exempt="doc_q, doc_k: document ids compared with ==; any dtype NumPy compares is an id"),
    "block_mask_documents": Row(_function(sdpa.block_mask_documents, lambda: dict(doc_q=[0, 0, 1], block_size=2)),
                                ints=["block_size"], exempt="doc_q, doc_k: document ids, as document_mask"),
    "KVCache": Row(_constructor(sdpa.KVCache, dict(num_pages=4, page_size=2, num_kv_heads=1, head_dim_k=4)),
                   ints=["num_pages", "page_size", "num_kv_heads", "head_dim_k",
                         ("head_dim_v", {k: v for k, v in INT_BAD.items() if k != "None"}), "quant_groups"],
                   dtypes=["dtype"]),
    "KVCache.new_sequence": Row(_cache_method("new_sequence")),
    "KVCache.append": Row(_cache_method("append", lambda c: dict(seq=0, k=np.ones((1, 1, 4)), v=np.ones((1, 1, 4)))),
                          dict(k="real", v="real"), ints=["seq"]),
    "KVCache.free": Row(_cache_method("free", lambda c: dict(seq=0)), ints=["seq"]),
    "KVCache.length": Row(_cache_method("length", lambda c: dict(seq=0)), ints=["seq"]),
    "KVCache.pages": Row(_cache_method("pages", lambda c: dict(seq=0)), ints=["seq"]),
    "KVCache.sequences": Row(_cache_method("sequences")),
    "KVCache.attention": Row(_cache_method("attention", lambda c: dict(
        q=np.ones((1, 2, 1, 4), np.float32), seqs=[0], alibi_slopes=MODS["alibi_slopes"], sinks=MODS["sinks"])),
        dict(q="real", alibi_slopes="real", sinks="real"), ids=["seqs"], reals=["scale", "softcap"]),
    "MultiHeadAttention": Row(_constructor(sdpa.MultiHeadAttention, dict(d_model=8, num_heads=2, seed=0)),
                              ints=["d_model", "num_heads"] + [(n, {k: v for k, v in INT_BAD.items() if k != "None"})
                                                               for n in ("num_kv_heads", "head_dim", "head_dim_v",
                                                                         "kdim", "vdim")] + [("seed", RNG_SEED_BAD)],
                              dtypes=["dtype"], reals=["rope_base"]),
    "MultiHeadAttention.forward": Row(_layer_method("forward", lambda layer, cache: dict(
        x_q=np.ones((1, 2, 8), np.float32), x_k=np.ones((1, 3, 8), np.float32), x_v=np.ones((1, 3, 8), np.float32),
        mask=np.zeros((2, 3), np.float32), position_q=1, position_k=0)),
        dict(MHA_ARRAYS, x_q="real", x_k="real", x_v="real", mask="mask"), ints=["position_q", "position_k"],
        reals=["scale", "dropout_p"]),
    "MultiHeadAttention.backward": Row(_layer_method("backward", lambda layer, cache: dict(
        dy=np.ones((1, 2, 8), np.float32))), dict(dy="real")),
    "MultiHeadAttention.step": Row(_layer_method("step", lambda layer, cache: dict(
        x=np.ones((1, 1, 8), np.float32), cache=cache, seqs=[0])), dict(MHA_ARRAYS, x="real"), ids=["seqs"],
        reals=["scale"]),
    "MultiHeadAttention.new_cache": Row(_layer_method("new_cache", lambda layer, cache: dict(num_pages=2, page_size=2)),
                                        ints=["num_pages", "page_size"]),
    "MultiHeadAttention.parameters": Row(_layer_method("parameters", lambda layer, cache: {})),
    "Report": Row(_constructor(sdpa.Report, dict(html="<p>")), exempt="html: the page's text, kept as given"),
    "Report.save": Row(_method(lambda: sdpa.Report("<p>"), "save", lambda r: dict(path=os.devnull), lambda r: None),
                       exempt="path: a file name for open()"),
}
DATA_ONLY = {"Stats", "LayerGradients"}  # NamedTuples of results: no entry point


def _entry_points():
    """Every public callable of sdpa (NumPy): the functions of __all__, each class's constructor
    and its public methods (not properties, not the NamedTuples of results)."""
    names = []
    for name in sdpa.__all__:
        obj = getattr(sdpa, name)
        if name in DATA_ONLY:
            continue
        names.append(name)
        if pyinspect.isclass(obj):
            names += [f"{name}.{m}" for m, a in vars(obj).items()
                      if not m.startswith("_") and callable(a) and not isinstance(a, property)]
    return names


def test_every_entry_point_has_a_row():
    missing = sorted(set(_entry_points()) - set(ENTRY_POINTS))
    assert not missing, f"entry points without a row in ENTRY_POINTS: {missing}"
    stale = sorted(set(ENTRY_POINTS) - set(_entry_points()))
    assert not stale, f"rows of no entry point: {stale}"


@pytest.mark.parametrize("entry", sorted(ENTRY_POINTS))
def test_the_valid_call_works(entry):
    # The baseline every case below perturbs in one argument: it must not fail by itself.
    call, _, _ = ENTRY_POINTS[entry].setup()
    call()


# ---------------------------------------------------------------- the cases


def _cases():
    for entry, row in ENTRY_POINTS.items():
        for name, kind in row.arrays.items():
            for bad in KINDS[kind]:
                yield pytest.param(entry, name, ("array", bad), id=f"{entry}-{name}-{bad}")
        for name, bad in row.ints.items():
            for label in bad:
                yield pytest.param(entry, name, ("int", label), id=f"{entry}-{name}-{label}")
        for name in row.ids:
            for label in IDS_BAD:
                yield pytest.param(entry, name, ("ids", label), id=f"{entry}-{name}-{label}")
        for name in row.dtypes:
            for label in DTYPE_BAD:
                yield pytest.param(entry, name, ("dtype", label), id=f"{entry}-{name}-{label}")
        for name in row.reals:
            for label in REAL_NUMBER_BAD:
                yield pytest.param(entry, name, ("real", label), id=f"{entry}-{name}-{label}")


def _expect_error(call, state, name, error, **over):
    before = state()
    with pytest.raises((TypeError, ValueError)) as info:
        call(**over)
    message = str(info.value)
    assert "incompatible function arguments" not in message, message
    assert re.match(rf"^(\w+: )?{re.escape(name)}\b", message), f"the message does not start with {name!r}: {message}"
    assert isinstance(info.value, error), f"{type(info.value).__name__}, expected {error.__name__}: {message}"
    assert state() == before, "the failed call changed what it must not"


@pytest.mark.filterwarnings("error")  # a ComplexWarning (a silent cast) fails the test
@pytest.mark.parametrize("entry,name,case", list(_cases()))
def test_wrong_argument_is_an_error_naming_it(entry, name, case):
    row = ENTRY_POINTS[entry]
    call, state, values = row.setup()
    kind, label = case
    if kind == "array":
        _expect_error(call, state, name, TypeError, **{name: KINDS[row.arrays[name]][label](values[name])})
    elif kind == "int":
        value, error = row.ints[name][label]
        _expect_error(call, state, name, error, **{name: value})
    elif kind == "ids":
        value, error = IDS_BAD[label]
        _expect_error(call, state, name, error, **{name: value})
    elif kind == "real":
        value, error = REAL_NUMBER_BAD[label]
        _expect_error(call, state, name, error, **{name: value})
    else:
        _expect_error(call, state, name, TypeError, **{name: DTYPE_BAD[label]})


# ---------------------------------------------------------------- sdpa.torch: the cases it passes
#
# sdpa.torch's entry points share this package's rules (the same helpers) for integers, real
# numbers, index arrays, sequence ids and arrays of values (slopes and sinks, as NumPy arrays
# or tensors); the cases below hold them.


def _torch_cases():
    torch = import_torch()
    import sdpa.torch as st
    q, k = torch.ones(1, 2, 3, 4), torch.ones(1, 1, 5, 4)
    bm = torch.ones(1, 1, dtype=torch.bool)
    qv, kv = torch.ones(3, 2, 4), torch.ones(5, 1, 4)
    pool, qp = torch.ones(3, 2, 1, 4), torch.ones(1, 2, 1, 4)
    layer = st.MultiheadAttention(8, 2, batch_first=True)
    cases = []
    for label, (value, error) in INT_BAD.items():
        cases += [
            (f"sdpa-block_size-{label}", "block_size", error,
             lambda v=value: st.scaled_dot_product_attention(q, k, k, enable_gqa=True, block_mask=bm, block_size=v)),
            (f"varlen-block_size-{label}", "block_size", error,
             lambda v=value: st.attention_varlen(qv, kv, kv, [0, 1, 3], [0, 2, 5], block_mask=bm, block_size=v)),
            (f"paged-block_size-{label}", "block_size", error,
             lambda v=value: st.attention_paged(qp, pool, pool, [[0, 1]], [3], block_mask=bm, block_size=v)),
            (f"attention_stats-topk-{label}", "topk", error, lambda v=value: st.attention_stats(q, k, k, topk=v)),
            (f"MultiheadAttention.new_cache-num_pages-{label}", "num_pages", error,
             lambda v=value: layer.new_cache(v, 2)),
            (f"MultiheadAttention.new_cache-page_size-{label}", "page_size", error,
             lambda v=value: layer.new_cache(4, v)),
        ]
    for label, value, error in (("float", [0.0, 1.0, 3.0], TypeError),
                                ("float-tensor", torch.tensor([0.0, 1.0, 3.0]), TypeError),
                                ("bool", [False, True, True], TypeError), ("2**64", [0, 1, 2**64], ValueError)):
        cases += [(f"varlen-cu_seqlens_q-{label}", "cu_seqlens_q", error,
                   lambda v=value: st.attention_varlen(qv, kv, kv, v, [0, 2, 5])),
                  (f"varlen-cu_seqlens_k-{label}", "cu_seqlens_k", error,
                   lambda v=value: st.attention_varlen(qv, kv, kv, [0, 1, 3], v)),
                  (f"paged-seqlens_k-{label}", "seqlens_k", error,
                   lambda v=value: st.attention_paged(qp, pool, pool, [[0, 1]], v[-1:]))]
    for label, value in (("float", [[0.0, 1.0]]), ("bool", [[True, False]])):
        cases.append((f"paged-block_table-{label}", "block_table", TypeError,
                      lambda v=value: st.attention_paged(qp, pool, pool, v, [3])))
    for label, dtype in (("int32", torch.int32), ("complex", torch.complex64), ("bool", torch.bool)):
        cases += [(f"sdpa-query-{label}", "query", TypeError,
                   lambda d=dtype: st.scaled_dot_product_attention(q.to(d), k, k, enable_gqa=True)),
                  (f"paged-k_pages-{label}", "k_pages", TypeError,
                   lambda d=dtype: st.attention_paged(qp, pool.to(d), pool, [[0, 1]], [3]))]
    cache = layer.new_cache(4, 2)
    cache.new_sequence()
    cache.new_sequence()  # so that an id truncated or read as a bool (1) would be a sequence too
    cases.append(("MultiheadAttention.step-x-width", "x", ValueError,
                  lambda: layer.step(torch.ones(1, 1, 7), cache, [0])))
    ids_bad = dict(IDS_BAD, **{"float-array-1.7": (np.array([1.7]), TypeError),
                               "float-tensor": (torch.tensor([1.0]), TypeError),
                               "bool-tensor": (torch.tensor([True]), TypeError)})
    for label, (value, error) in ids_bad.items():
        cases.append((f"MultiheadAttention.step-seqs-{label}", "seqs", error,
                      lambda v=value: layer.step(torch.ones(1, 1, 8), cache, v)))
    # Slopes and sinks: sdpa's rule for arrays of values, as NumPy arrays and as tensors.
    slopes_bad = {label: (lambda a, f=f: f(a)) for label, f in REAL_BAD.items()}
    slopes_bad.update({f"tensor-{d}": (lambda a, d=d: torch.as_tensor(a).to(d))
                       for d in (torch.complex64, torch.complex128, torch.float8_e4m3fn, torch.float8_e5m2)})
    calls = {"sdpa": lambda **kw: st.scaled_dot_product_attention(q, k, k, enable_gqa=True, **kw),
             "varlen": lambda **kw: st.attention_varlen(qv, kv, kv, [0, 1, 3], [0, 2, 5], **kw),
             "paged": lambda **kw: st.attention_paged(qp, pool, pool, [[0, 1]], [3], **kw),
             "attention_stats": lambda **kw: st.attention_stats(q, k, k, **kw)}
    for entry, call in calls.items():
        for name in ("alibi_slopes", "sinks"):
            for label, bad in slopes_bad.items():
                cases.append((f"{entry}-{name}-{label}", name, TypeError,
                              lambda c=call, n=name, b=bad: c(**{n: b(np.array([0.5, 0.25], np.float32))})))
        for label, (value, error) in REAL_NUMBER_BAD.items():
            cases.append((f"{entry}-softcap-{label}", "softcap", error, lambda c=call, v=value: c(softcap=v)))
    for name in ("query", "key", "value"):
        cases.append((f"attention_stats-{name}-complex", name, TypeError,
                      lambda n=name: st.attention_stats(**dict(dict(query=q, key=k, value=k),
                                                               **{n: torch.ones(1, 1, 5, 4, dtype=torch.complex64)}))))
    # The module: its constructor's integers and rope_base, forward's positions and inputs.
    optional = {k: v for k, v in INT_BAD.items() if k != "None"}  # None: the default
    for name, bad in (("embed_dim", INT_BAD), ("num_heads", INT_BAD), ("kdim", optional), ("vdim", optional),
                      ("num_kv_heads", optional)):
        for label, (value, error) in bad.items():
            cases.append((f"MultiheadAttention-{name}-{label}", name, error,
                          lambda n=name, v=value: st.MultiheadAttention(**dict(dict(embed_dim=8, num_heads=2),
                                                                               **{n: v}))))
    for label, (value, error) in REAL_NUMBER_BAD.items():
        cases.append((f"MultiheadAttention-rope_base-{label}", "rope_base", error,
                      lambda v=value: st.MultiheadAttention(8, 2, rope=True, rope_base=v)))
    x = torch.ones(1, 3, 8)
    for name in ("position_q", "position_k"):
        for label, (value, error) in INT_BAD.items():
            cases.append((f"MultiheadAttention.forward-{name}-{label}", name, error,
                          lambda n=name, v=value: layer(x, x, x, **{n: v})))
    for name in ("query", "key", "value"):
        for label, dtype in (("complex", torch.complex64), ("int32", torch.int32), ("bool", torch.bool)):
            cases.append((f"MultiheadAttention.forward-{name}-{label}", name, TypeError,
                          lambda n=name, d=dtype: layer(**dict(dict(query=x, key=x, value=x), **{n: x.to(d)}))))
    return cases, (lambda: _cache_state(cache))


@pytest.mark.filterwarnings("error")  # a ComplexWarning (a silent cast) fails the test
def test_torch_entry_points_name_wrong_arguments():
    cases, state = _torch_cases()
    failures = []
    for label, name, error, call in cases:
        try:
            _expect_error(call, state, name, error)
        except (AssertionError, pytest.fail.Exception) as e:
            failures.append(f"{label}: {e}".splitlines()[0])
    assert not failures, f"{len(failures)} of {len(cases)} cases:\n" + "\n".join(failures)
