"""Ring attention over MPI (mpi4py) for NumPy arrays: exact context-parallel attention, forward
and backward, the C++ ``sdpa::ring_attention`` (include/sdpa/ring.h) behind a communicator.

A sequence of N tokens is cut into W shards, one per rank; each rank holds its shard's q, k and
v, the key/value blocks travel around the ring, and each rank gets the output rows of its own
queries, equal to ``sdpa.attention`` on the whole sequence within its tolerance, bitwise the
same from run to run for a given world size and layout::

    from mpi4py import MPI
    import sdpa.distributed as sd
    q_local = sd.shard(q, axis=-2, layout="zigzag")          # this rank's rows of the sequence
    k_local, v_local = sd.shard(k, -2), sd.shard(v, -2)
    out_local, lse_local = sd.ring_attention(q_local, k_local, v_local, causal=True, return_lse=True)
    out = sd.unshard(out_local, axis=-2)                      # the whole output, on every rank

Layouts (the sequence cut into chunks; rank r holds)::

    "contiguous"  chunk r of W                   W = 2, N = 8:  rank 0: 0 1 2 3   rank 1: 4 5 6 7
    "zigzag"      chunks r and 2W - 1 - r of 2W                 rank 0: 0 1 6 7   rank 1: 2 3 4 5

"zigzag" (the default) gives every rank the same causal work; it needs N divisible by 2W.

Communicators: an mpi4py communicator (``comm=None`` is ``MPI.COMM_WORLD``; ``MPICommunicator``
wraps it), or any ``sdpa.distributed.Communicator`` subclass (the interface of sdpa/ring.h in
Python: ``sdpa.torch.distributed`` implements it over torch.distributed). mpi4py is imported only
when an MPI communicator is needed: ``import sdpa`` and this module do not need it.

Failures: shapes, dtypes and options are compared across the ranks before any block moves (a
mismatch is a ValueError on every rank, naming the rank that differs); every wait has a
deadline, ``timeout`` seconds, so a rank that stops or dies gives the others a ValueError naming
the peer within about that time, never a hang. (An argument this module refuses itself before
the C++ call, a wrong type, name or timeout, raises on that rank at once; its peers then get
the deadline's ValueError, not the same message.) Nothing is returned from a call that fails. The
ring's messages travel on a duplicate of an mpi4py communicator (``MPICommunicator``), never
matching the caller's own; after a timeout its pending messages are abandoned with it: end the
job (MPI without fault tolerance cannot go on past a dead peer). A ``Communicator`` passed in
(``TorchCommunicator``) carries the abandoned messages itself: do not use it for another call.
"""

from __future__ import annotations

import contextlib
import time

import numpy as np

from . import _core
from ._args import (_checked_int, _describe, _out_dtype_arg, _parsed_dropout, _parsed_options, _prepared_indices,
                    _real_number)
from ._arrays import _core_view, _empty, _prepared_inputs

__all__ = ["Communicator", "MPICommunicator", "ring_attention", "ring_attention_backward", "shard", "unshard"]

# The interface ring attention runs on (sdpa::Communicator): subclass it, call
# super().__init__(), and define rank(), size(), isend(buf, to, tag), irecv(buf, from_, tag),
# iallgather(inbuf, outbuf) (each returning an int request; the bufs are 1-dim uint8 NumPy arrays
# over the ring's memory, valid until the request completes) and wait(request, seconds) -> bool
# (False: the time ran out and the request is abandoned). An Exception a method raises becomes
# the call's ValueError, naming the rank and the method.
Communicator = _core.Communicator

def _name_arg(name, value, names):
    """A name argument (layout, strategy) as _core takes it: a str, whose value _core checks
    (ValueError naming the argument and the names); anything else is TypeError here."""
    if not isinstance(value, str):
        raise TypeError(f"{name} must be {names}, got {_describe(value)}")
    return value


def _timeout_arg(timeout):
    t = _real_number("timeout", timeout)
    if not t > 0:
        raise ValueError(f"timeout must be a number of seconds > 0, got {_describe(timeout)}")
    return t


class _Poll:
    """Sleeps between polls of a request until a deadline: short sleeps first (a message that is
    about to arrive costs microseconds), growing to 1 ms (a long wait costs little CPU)."""

    def __init__(self, seconds):
        self.deadline = time.monotonic() + seconds
        self.delay = 0.0

    def expired(self):
        """Whether the deadline passed; else sleeps a little (the GIL released) and says False."""
        if time.monotonic() >= self.deadline:
            return True
        time.sleep(self.delay)
        self.delay = min(max(2 * self.delay, 1e-5), 1e-3)
        return False


_CANCEL_SECONDS = 1.0  # how long a cancelled receive may take to complete (MPI requires it completed)


def _completed(request, seconds):
    """Whether an mpi4py request completes (Test) within seconds."""
    poll = _Poll(seconds)
    while not request.Test():
        if poll.expired():
            return False
    return True


class MPICommunicator(Communicator):
    """sdpa's ring communicator over an mpi4py communicator ``comm`` (``MPI.COMM_WORLD`` for
    None): Isend / Irecv / Iallgather of the ring's bytes (no copies); ``wait`` a ``Test`` loop
    with a deadline.

    The ring's messages travel on a duplicate of ``comm`` (``Idup``, made here: a collective,
    so every rank of ``comm`` must make one; its wait has the deadline ``timeout`` seconds,
    else ValueError), so they never match the caller's own messages on ``comm``. ``free()``
    (or the end of a ``with`` block) frees the duplicate; sdpa.distributed's functions do so
    for the communicators they make from an mpi4py one.

    After a wait that timed out, a receive is cancelled (``Cancel``) and then completed (``Test``
    for at most 1 s, as MPI requires; a receive that had already begun may not complete, and is
    then abandoned), sends and all-gathers are abandoned, and ``free()`` leaves the duplicate
    (freeing it could wait on those requests): the caller's ``comm`` carries none of them, but
    MPI without fault tolerance cannot go on past a dead peer: end the job (``comm.Abort()``)."""

    def __init__(self, comm=None, *, timeout=300.0):
        super().__init__()
        from mpi4py import MPI  # (imported here: sdpa does not need mpi4py otherwise)
        self._MPI = MPI
        comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py communicator (or None: MPI.COMM_WORLD), got "
                            f"{type(comm).__name__}")
        timeout = _timeout_arg(timeout)
        self._rank, self._size = comm.Get_rank(), comm.Get_size()
        self._requests = {}
        self._next = 0
        self._abandoned = False  # a request was abandoned: the duplicate is not freed
        self.comm, request = comm.Idup()
        if not _completed(request, timeout):
            self._abandoned = True
            raise ValueError(f"rank {self._rank}: duplicating the communicator (Idup, which every rank of it must "
                             f"call) did not complete within {timeout} s (a rank stopped, or did not call?)")

    def free(self):
        """Frees the duplicate communicator, unless a request on it was abandoned (see above)."""
        if self.comm is not None and not self._abandoned:
            self.comm.Free()
        self.comm = None

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.free()

    def _started(self, request, receive):
        self._next += 1
        self._requests[self._next] = (request, receive)
        return self._next

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    def isend(self, buf, to, tag):
        return self._started(self.comm.Isend([buf, self._MPI.BYTE], dest=to, tag=tag), False)

    def irecv(self, buf, from_, tag):
        return self._started(self.comm.Irecv([buf, self._MPI.BYTE], source=from_, tag=tag), True)

    def iallgather(self, inbuf, outbuf):
        # (a collective cannot be cancelled: after a timeout it is abandoned as sends are)
        return self._started(self.comm.Iallgather([inbuf, self._MPI.BYTE], [outbuf, self._MPI.BYTE]), False)

    def wait(self, request, seconds):
        req, receive = self._requests.pop(request)
        if _completed(req, seconds):
            return True
        self._abandoned = True
        _LOST.append(req)  # never freed: MPI may still use it and the buffers it references
        if receive:  # cancelled so that no late message lands (the ring leaks the buffer of a request not
            # waited to completion, so a late write would not hit freed memory either)
            try:
                req.Cancel()
                _completed(req, min(seconds, _CANCEL_SECONDS))  # a cancelled request must still complete
            except self._MPI.Exception:
                pass
        return False


def _rank_size(comm):
    """(rank, size) of a Communicator or an mpi4py communicator (None: COMM_WORLD), with no message."""
    if isinstance(comm, Communicator):
        return comm.rank(), comm.size()
    from mpi4py import MPI
    comm = MPI.COMM_WORLD if comm is None else comm
    if not isinstance(comm, MPI.Comm):
        raise TypeError(f"comm must be an mpi4py communicator (or None: MPI.COMM_WORLD), got {type(comm).__name__}")
    return comm.Get_rank(), comm.Get_size()


@contextlib.contextmanager
def _communicator(comm, timeout):
    """comm as a _core.Communicator for one call: itself, or an mpi4py communicator (None:
    COMM_WORLD) wrapped in an MPICommunicator, freed after the call."""
    if isinstance(comm, Communicator):
        yield comm
        return
    with MPICommunicator(comm, timeout=timeout) as mpi:
        yield mpi


def _ring_call(q, k, v, causal, scale, window, dropout_p, seed, softcap, softcap_order, alibi_slopes, sinks,
               block_mask, block_size, precision, layout, timeout, strategy, cu_seqlens, mask=None):
    """The arguments both ring calls share, checked as ``sdpa.attention`` checks its own:
    (compute dtype, q, k, v, _core's keyword arguments)."""
    from . import _parsed_mods  # (sdpa's __init__ imports this module's users, not this module)
    if mask is not None:
        raise ValueError("ring attention takes no element mask: pass a block_mask of the whole sequence")
    dtype, q, k, v, _ = _prepared_inputs(q, k, v, None)
    causal_code, scale, left, right = _parsed_options(causal, scale, window, "auto", dtype)
    p, seed = _parsed_dropout(dropout_p, seed)
    kw = dict(scale=scale, causal=causal_code, window_left=left, window_right=right, backend="auto", dropout_p=p,
              seed=seed, layout=_name_arg("layout", layout, "'zigzag' or 'contiguous'"), timeout=_timeout_arg(timeout),
              strategy=_name_arg("strategy", strategy, "'ring' or 'allgather'"),
              cu_seqlens=_prepared_indices("cu_seqlens", cu_seqlens, "(D + 1,) offsets of the documents in the whole "
                                           "sequence"),
              alibi_slopes=None, sinks=None, block_mask=None, block_q=128, block_k=128)
    kw.update(_parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, block_mask, block_size, precision))
    return dtype, q, k, v, kw


def ring_attention(q, k, v, comm=None, *, causal=False, layout="zigzag", scale=None, window=None, alibi_slopes=None,
                   softcap=0.0, softcap_order="before_bias", dropout_p=0.0, seed=None, sinks=None, block_mask=None,
                   block_size=128, precision=None, timeout=300.0, strategy="ring", cu_seqlens=None, return_lse=False,
                   out_dtype=None, return_stats=False):
    """Ring attention forward: this rank's output shard of ``sdpa.attention`` on the whole
    sequence, whose shards the ranks of ``comm`` hold in ``layout`` (see the module doc).

    Shapes (this rank's shards; N_local the same on every rank, N = W · N_local)::

        q  (B, Hq, N_local, Dk)   k  (B, Hkv, N_local, Dk)   v  (B, Hkv, N_local, Dv)
        returns out (B, Hq, N_local, Dv), and lse (B, Hq, N_local) with return_lse
        (also 3 or 2 dims, as sdpa.attention)

    Args:
        comm: an mpi4py communicator (None: ``MPI.COMM_WORLD``) or a ``Communicator``.
        causal: False or True ("bottom_right" and "top_left" are the same here: query and key
            positions are those of the whole sequence, and a query sees keys at or before its
            own position).
        layout: "zigzag" (default; N_local must be even) or "contiguous".
        scale, window, alibi_slopes, softcap, softcap_order, sinks, block_mask, block_size,
            precision, out_dtype: as ``sdpa.attention``'s, of the whole sequence (window and
            ALiBi measure positions in it; a block_mask is the whole sequence's; sinks count
            once per row).
        dropout_p, seed: as ``sdpa.attention``'s, drawn at the whole sequence's positions:
            every rank must pass the same seed.
        timeout: seconds each wait for a peer may take (a block's transfer and the peer's work
            on the block before it must fit), > 0.
        strategy: how the keys and values reach the queries: "ring" (default: K/V blocks travel
            the ring, each transfer behind the compute of the block before; memory O(N_local))
            or "allgather" (each rank gathers the whole sequence's K/V one (batch entry, kv
            head) at a time, Llama 3's: for GQA / MQA and short K/V; refuses dropout and a
            block_mask). The results differ only by the fixed order of their sums (dk, dv).
        cu_seqlens: packed documents (as ``sdpa.attention_varlen`` packs them): (D + 1,)
            integer offsets over the WHOLE sequence's positions (not this rank's rows): 0, non-
            decreasing, ending at N = W · N_local; the same on every rank; q's batch must be 1
            (q (1, Hq, N_local, Dk), or 3 or 2 dims). The result is ``sdpa.attention_varlen``'s
            on the whole packed sequence with cu_seqlens_q = cu_seqlens_k = cu_seqlens: a token
            attends to keys of its own document only, causal, window and ALiBi are the
            document's own ((D, Hq) alibi_slopes give document d row d), dropout draws as
            attention_varlen's. Documents may span ranks and chunks.
        return_lse: also return lse (the compute dtype), which ``ring_attention_backward`` needs.
        return_stats: also return (last) a dict of where this rank's time went (sdpa::RingStats):
            ``check_seconds`` (the checks and the all-gather of the ranks' arguments),
            ``compute_seconds`` (the pairs' kernels and merges), ``wait_seconds`` (waiting for
            transfers after the compute: the communication not hidden) and ``bytes_sent``.

    Every rank must pass the same options and shapes: they are compared before any block moves.

    Raises:
        TypeError, ValueError: as ``sdpa.attention`` for the arguments; ValueError for a shape,
            dtype or option that differs between the ranks, a peer that does not answer within
            ``timeout`` or a communicator that fails, naming the rank (on every rank).
    """
    dtype, q, k, v, kw = _ring_call(q, k, v, causal, scale, window, dropout_p, seed, softcap, softcap_order,
                                    alibi_slopes, sinks, block_mask, block_size, precision, layout, timeout, strategy,
                                    cu_seqlens)
    lead = q.shape[:-1]
    out = _empty("out", lead + (v.shape[-1],), _out_dtype_arg(out_dtype, q.dtype, dtype))
    lse = _empty("lse", lead, dtype) if return_lse else None
    with _communicator(comm, kw["timeout"]) as c:
        stats = _core.ring_attention(c, *map(_core_view, (q, k, v, out)), lse, **kw)
    result = (out,) + ((lse,) if return_lse else ()) + ((stats,) if return_stats else ())
    return result[0] if len(result) == 1 else result


def _ring_backward(dout, q, k, v, out, lse, comm, alibi_grad, *, causal=False, layout="zigzag", scale=None, window=None,
                   alibi_slopes=None, softcap=0.0, softcap_order="before_bias", dropout_p=0.0, seed=None, sinks=None,
                   block_mask=None, block_size=128, precision=None, timeout=300.0, strategy="ring", cu_seqlens=None):
    """ring_attention_backward's gradients, and the slopes' (dalibi_slopes, this rank's part)
    when alibi_grad: (dq, dk, dv, dsinks or None, dalibi or None)."""
    from . import _backward_arrays
    dtype, q, k, v, kw = _ring_call(q, k, v, causal, scale, window, dropout_p, seed, softcap, softcap_order,
                                    alibi_slopes, sinks, block_mask, block_size, precision, layout, timeout, strategy,
                                    cu_seqlens)
    dout, out, lse, dq, dk, dv = _backward_arrays(dout, out, lse, q, k, v, dtype)
    dsinks = np.empty(kw["sinks"].shape, dtype) if kw["sinks"] is not None else None
    dalibi = np.empty(kw["alibi_slopes"].shape, dtype) if alibi_grad and kw["alibi_slopes"] is not None else None
    with _communicator(comm, kw["timeout"]) as c:
        stats = _core.ring_attention_backward(c, *map(_core_view, (q, k, v, out, lse, dout, dq, dk, dv)),
                                              dsinks=dsinks, dalibi_slopes=dalibi, **kw)
    return dq, dk, dv, dsinks, dalibi, stats


def ring_attention_backward(dout, q, k, v, out, lse, comm=None, *, causal=False, layout="zigzag", scale=None,
                            window=None, alibi_slopes=None, softcap=0.0, softcap_order="before_bias", dropout_p=0.0,
                            seed=None, sinks=None, block_mask=None, block_size=128, precision=None, timeout=300.0,
                            strategy="ring", cu_seqlens=None, return_stats=False):
    """Gradients of ``ring_attention`` for this rank's shards: returns ``(dq, dk, dv)`` shaped
    like this rank's q, k, v (in their dtypes), then ``dsinks`` when ``sinks`` is given: this
    rank's part, (Hq,) in the compute dtype, which sums over the ranks (an all-reduce) to the
    whole sequence's, as any parameter shared across the sequence shards.

    dout, out and lse: this rank's shards, out and lse as ``ring_attention(...,
    return_lse=True)`` returned them for these inputs and options (the whole rows' lse). The
    options (strategy and cu_seqlens too) must be the forward's. dk and dv of a block are summed
    over the ranks in a fixed order (ring.h), in float32 (float64 for float64), rounded once. ``return_stats``: also return (last) the
    dict ``ring_attention`` describes (``bytes_sent`` counts the travelling dk, dv too). Errors
    as ``ring_attention``.
    """
    dq, dk, dv, dsinks, _, stats = _ring_backward(
        dout, q, k, v, out, lse, comm, False, causal=causal, layout=layout, scale=scale, window=window,
        alibi_slopes=alibi_slopes, softcap=softcap, softcap_order=softcap_order, dropout_p=dropout_p, seed=seed,
        sinks=sinks, block_mask=block_mask, block_size=block_size, precision=precision, timeout=timeout,
        strategy=strategy, cu_seqlens=cu_seqlens)
    return (dq, dk, dv) + (() if dsinks is None else (dsinks,)) + ((stats,) if return_stats else ())


# ---------------------------------------------------------------- shard, unshard


def _chunks(layout, world, rank, n_local):
    return _core.ring_chunks(_name_arg("layout", layout, "'zigzag' or 'contiguous'"), world, rank, n_local)


def _axis_arg(axis, ndim, name):
    axis = _checked_int("axis", axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for {name} of {ndim} dims")
    return axis % ndim


def _shard(x, axis, layout, rank, world):
    """This rank's rows of x along axis, in the layout's order (a copy)."""
    axis = _axis_arg(axis, x.ndim, "x")
    n = x.shape[axis]
    parts = len(_chunks(layout, world, rank, 0)) * world  # (the layout's chunks per rank; checks its name)
    if n % parts:
        raise ValueError(f"x has shape {x.shape}: its axis {axis} of {n} does not split into {parts} equal chunks "
                         f"(layout {layout!r} over {world} ranks needs a multiple of {parts})")
    rows = [np.arange(start, start + length) for _, start, length in _chunks(layout, world, rank, n // world)]
    return np.take(x, np.concatenate(rows), axis=axis)


def shard(x, axis=-2, layout="zigzag", comm=None):
    """This rank's shard of x (the whole sequence, the same on every rank) along ``axis`` (the
    sequence dim: -2 for (B, H, N, D)) in ``layout``: a copy of N / W rows. N must split into W
    chunks ("contiguous") or 2W ("zigzag"), else ValueError naming the shapes. No message is
    sent (comm gives the rank and the size)."""
    return _shard(np.asarray(x), axis, layout, *_rank_size(comm))


_HEADER = 11  # unshard's header: ndim, the dtype's name (16 bytes), up to 8 dims


def _allgather(comm, x, timeout):
    """Every rank's x, stacked (W, *x.shape), through comm's iallgather; x's shape and dtype
    compared first (a fixed-size header), so that a mismatch is an error on every rank."""
    world = comm.size()
    header = np.full(_HEADER, -1, np.int64)
    header[0] = x.ndim
    header[1:3] = np.frombuffer(x.dtype.name.encode().ljust(16, b" ")[:16], np.int64)
    header[3:3 + min(x.ndim, 8)] = x.shape[:8]
    headers = np.empty((world, _HEADER), np.int64)
    _gathered(comm, header, headers, timeout, "unshard: the all-gather of the shards' shapes")
    for r in range(world):
        if not np.array_equal(headers[r], header):
            shape = tuple(int(d) for d in headers[r, 3:3 + max(0, min(int(headers[r, 0]), 8))])
            dtype = headers[r, 1:3].tobytes().decode(errors="replace").rstrip()
            raise ValueError(f"unshard: rank {r} holds a shard of shape {shape} and dtype {dtype} but rank "
                             f"{comm.rank()} one of shape {x.shape} and dtype {x.dtype.name}: every rank's shard must "
                             f"have one shape and dtype")
    x = np.ascontiguousarray(x)
    out = np.empty((world,) + x.shape, x.dtype)
    _gathered(comm, x, out, timeout, "unshard: the all-gather")
    return out


# What a request that did not complete may still touch (abandoned requests and their buffers):
# kept alive, never freed, as the C++ ring leaks its buffers (ring.h, Communicator).
_LOST = []


def _gathered(comm, inbuf, outbuf, timeout, what):
    """comm's all-gather of inbuf into outbuf, waited on for timeout seconds (ValueError naming
    `what` and the rank when it does not complete; the buffers are then kept in _LOST)."""
    request = comm.iallgather(inbuf.reshape(-1).view(np.uint8), outbuf.reshape(-1).view(np.uint8))  # (1-dim, as the ring's)
    if not comm.wait(request, timeout):
        _LOST.append((inbuf, outbuf))
        raise ValueError(f"rank {comm.rank()}: {what} did not complete within {timeout} s (a rank stopped?)")


def unshard(x_local, axis=-2, layout="zigzag", comm=None, *, timeout=300.0):
    """The whole sequence from every rank's shard ``x_local`` (``shard``'s inverse), on every rank
    (an all-gather). Every rank's shard must have one shape and dtype (compared first; else a
    ValueError on every rank naming both); zigzag needs an even number of rows along ``axis``."""
    x_local = np.asarray(x_local)
    axis = _axis_arg(axis, x_local.ndim, "x_local")
    timeout = _timeout_arg(timeout)
    with _communicator(comm, timeout) as c:
        world, n_local = c.size(), x_local.shape[axis]
        gathered = _allgather(c, x_local, timeout)
        out = np.empty(x_local.shape[:axis] + (world * n_local,) + x_local.shape[axis + 1:], x_local.dtype)
        for r in range(world):
            for local, start, length in _chunks(layout, world, r, n_local):
                dst = [slice(None)] * out.ndim
                src = [slice(None)] * x_local.ndim
                dst[axis], src[axis] = slice(start, start + length), slice(local, local + length)
                out[tuple(dst)] = gathered[r][tuple(src)]
    return out
