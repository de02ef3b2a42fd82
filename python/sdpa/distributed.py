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
the peer within about that time, never a hang. Nothing is returned from a call that fails. After
a timeout the communicator's pending messages are abandoned: do not use that communicator for
another ring call (end the job, as MPI without fault tolerance must).
"""

from __future__ import annotations

import time

import numpy as np

from . import _core
from ._args import _checked_int, _describe, _out_dtype_arg, _parsed_dropout, _parsed_options, _real_number
from ._arrays import _core_view, _empty, _prepared_inputs

__all__ = ["Communicator", "MPICommunicator", "ring_attention", "ring_attention_backward", "shard", "unshard"]

# The interface ring attention runs on (sdpa::Communicator): subclass it, call
# super().__init__(), and define rank(), size(), isend(buf, to, tag), irecv(buf, from_, tag),
# iallgather(inbuf, outbuf) (each returning an int request; the bufs are 1-dim uint8 NumPy arrays
# over the ring's memory, valid until the request completes) and wait(request, seconds) -> bool
# (False: the time ran out and the request is abandoned). An Exception a method raises becomes
# the call's ValueError, naming the rank and the method.
Communicator = _core.Communicator

_LAYOUTS = {"zigzag": _core.RingLayout.zigzag, "contiguous": _core.RingLayout.contiguous}


def _layout_arg(layout):
    """layout as _core.RingLayout: "zigzag" or "contiguous" (or the enum itself)."""
    if isinstance(layout, _core.RingLayout):
        return layout
    if not isinstance(layout, str) or layout not in _LAYOUTS:
        raise ValueError(f"layout must be 'zigzag' or 'contiguous', got {_describe(layout)}")
    return _LAYOUTS[layout]


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


class MPICommunicator(Communicator):
    """sdpa's ring communicator over an mpi4py communicator (``MPI.COMM_WORLD`` for None):
    Isend / Irecv / Iallgather of the ring's bytes (no copies), ``wait`` a ``Test`` loop with a
    deadline. After a timeout the receive is cancelled (MPI_Cancel) and the send abandoned."""

    def __init__(self, comm=None):
        super().__init__()
        from mpi4py import MPI  # (imported here: sdpa does not need mpi4py otherwise)
        self._MPI = MPI
        self.comm = MPI.COMM_WORLD if comm is None else comm
        if not isinstance(self.comm, MPI.Comm):
            raise TypeError(f"comm must be an mpi4py communicator (or None: MPI.COMM_WORLD), got "
                            f"{type(comm).__name__}")
        self._rank, self._size = self.comm.Get_rank(), self.comm.Get_size()
        self._requests = {}
        self._next = 0

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
        req, receive = self._requests[request]
        poll = _Poll(seconds)
        while not req.Test():
            if poll.expired():
                del self._requests[request]
                if receive:
                    try:
                        req.Cancel()  # the ring's buffer is freed after it throws: no late write into it
                    except self._MPI.Exception:
                        pass
                return False
        del self._requests[request]
        return True


def _communicator(comm):
    """comm as a _core.Communicator: itself, or an mpi4py communicator (None: COMM_WORLD) wrapped."""
    return comm if isinstance(comm, Communicator) else MPICommunicator(comm)


def _ring_call(q, k, v, causal, scale, window, dropout_p, seed, softcap, softcap_order, alibi_slopes, sinks,
               block_mask, block_size, precision, layout, timeout, mask=None):
    """The arguments both ring calls share, checked as ``sdpa.attention`` checks its own:
    (compute dtype, q, k, v, _core's keyword arguments)."""
    from . import _parsed_mods  # (sdpa's __init__ imports this module's users, not this module)
    if mask is not None:
        raise ValueError("ring attention takes no element mask: pass a block_mask of the whole sequence")
    dtype, q, k, v, _ = _prepared_inputs(q, k, v, None)
    causal_code, scale, left, right = _parsed_options(causal, scale, window, "auto", dtype)
    p, seed = _parsed_dropout(dropout_p, seed)
    kw = dict(scale=scale, causal=causal_code, window_left=left, window_right=right, backend="auto", dropout_p=p,
              seed=seed, layout=_layout_arg(layout), timeout=_timeout_arg(timeout), alibi_slopes=None, sinks=None,
              block_mask=None, block_q=128, block_k=128)
    kw.update(_parsed_mods(softcap, softcap_order, alibi_slopes, sinks, dtype, block_mask, block_size, precision))
    return dtype, q, k, v, kw


def ring_attention(q, k, v, comm=None, *, causal=False, layout="zigzag", scale=None, window=None, alibi_slopes=None,
                   softcap=0.0, softcap_order="before_bias", dropout_p=0.0, seed=None, sinks=None, block_mask=None,
                   block_size=128, precision=None, timeout=300.0, return_lse=False, out_dtype=None,
                   return_stats=False):
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
                                    alibi_slopes, sinks, block_mask, block_size, precision, layout, timeout)
    comm = _communicator(comm)
    lead = q.shape[:-1]
    out = _empty("out", lead + (v.shape[-1],), _out_dtype_arg(out_dtype, q.dtype, dtype))
    lse = _empty("lse", lead, dtype) if return_lse else None
    stats = _core.ring_attention(comm, *map(_core_view, (q, k, v, out)), lse, **kw)
    result = (out,) + ((lse,) if return_lse else ()) + ((stats,) if return_stats else ())
    return result[0] if len(result) == 1 else result


def _ring_backward(dout, q, k, v, out, lse, comm, alibi_grad, causal, layout, scale, window, alibi_slopes, softcap,
                   softcap_order, dropout_p, seed, sinks, block_mask, block_size, precision, timeout):
    """ring_attention_backward's gradients, and the slopes' (dalibi_slopes, this rank's part)
    when alibi_grad: (dq, dk, dv, dsinks or None, dalibi or None)."""
    from . import _backward_arrays
    dtype, q, k, v, kw = _ring_call(q, k, v, causal, scale, window, dropout_p, seed, softcap, softcap_order,
                                    alibi_slopes, sinks, block_mask, block_size, precision, layout, timeout)
    comm = _communicator(comm)
    dout, out, lse, dq, dk, dv = _backward_arrays(dout, out, lse, q, k, v, dtype)
    dsinks = np.empty(kw["sinks"].shape, dtype) if kw["sinks"] is not None else None
    dalibi = np.empty(kw["alibi_slopes"].shape, dtype) if alibi_grad and kw["alibi_slopes"] is not None else None
    stats = _core.ring_attention_backward(comm, *map(_core_view, (q, k, v, out, lse, dout, dq, dk, dv)),
                                          dsinks=dsinks, dalibi_slopes=dalibi, **kw)
    return dq, dk, dv, dsinks, dalibi, stats


def ring_attention_backward(dout, q, k, v, out, lse, comm=None, *, causal=False, layout="zigzag", scale=None,
                            window=None, alibi_slopes=None, softcap=0.0, softcap_order="before_bias", dropout_p=0.0,
                            seed=None, sinks=None, block_mask=None, block_size=128, precision=None, timeout=300.0,
                            return_stats=False):
    """Gradients of ``ring_attention`` for this rank's shards: returns ``(dq, dk, dv)`` shaped
    like this rank's q, k, v (in their dtypes), then ``dsinks`` when ``sinks`` is given: this
    rank's part, (Hq,) in the compute dtype, which sums over the ranks (an all-reduce) to the
    whole sequence's, as any parameter shared across the sequence shards.

    dout, out and lse: this rank's shards, out and lse as ``ring_attention(...,
    return_lse=True)`` returned them for these inputs and options (the whole rows' lse). The
    options must be the forward's. dk and dv of a block are summed over the ranks in ring order,
    in float32 (float64 for float64), rounded once. ``return_stats``: also return (last) the
    dict ``ring_attention`` describes (``bytes_sent`` counts the travelling dk, dv too). Errors
    as ``ring_attention``.
    """
    dq, dk, dv, dsinks, _, stats = _ring_backward(dout, q, k, v, out, lse, comm, False, causal, layout, scale, window,
                                           alibi_slopes, softcap, softcap_order, dropout_p, seed, sinks, block_mask,
                                           block_size, precision, timeout)
    return (dq, dk, dv) + (() if dsinks is None else (dsinks,)) + ((stats,) if return_stats else ())


# ---------------------------------------------------------------- shard, unshard


def _chunks(layout, world, rank, n_local):
    return _core.ring_chunks(_layout_arg(layout), world, rank, n_local)


def _axis_arg(axis, ndim, name):
    axis = _checked_int("axis", axis)
    if not -ndim <= axis < ndim:
        raise ValueError(f"axis {axis} is out of range for {name} of {ndim} dims")
    return axis % ndim


def _shard(x, axis, layout, rank, world):
    """This rank's rows of x along axis, in the layout's order (a copy)."""
    axis = _axis_arg(axis, x.ndim, "x")
    n = x.shape[axis]
    parts = 2 * world if _layout_arg(layout) == _core.RingLayout.zigzag else world
    if n % parts:
        raise ValueError(f"x has shape {x.shape}: its axis {axis} of {n} does not split into {parts} equal chunks "
                         f"(layout {layout!r} over {world} ranks needs a multiple of {parts})")
    rows = [np.arange(start, start + length) for _, start, length in _chunks(layout, world, rank, n // world)]
    return np.take(x, np.concatenate(rows), axis=axis)


def shard(x, axis=-2, layout="zigzag", comm=None):
    """This rank's shard of x (the whole sequence, the same on every rank) along ``axis`` (the
    sequence dim: -2 for (B, H, N, D)) in ``layout``: a copy of N / W rows. N must split into W
    chunks ("contiguous") or 2W ("zigzag"), else ValueError naming the shapes."""
    comm = _communicator(comm)
    return _shard(np.asarray(x), axis, layout, comm.rank(), comm.size())


def _allgather(comm, x, timeout):
    """Every rank's x, stacked (W, *x.shape), through comm's iallgather; x's shape and dtype
    compared first (a fixed-size header), so that a mismatch is an error on every rank."""
    world = comm.size()
    header = np.full(10, -1, np.int64)
    header[0] = x.ndim
    header[1] = np.frombuffer(x.dtype.str.encode().ljust(8, b" ")[:8], np.int64)[0]
    header[2:2 + min(x.ndim, 8)] = x.shape[:8]
    headers = np.empty((world, 10), np.int64)
    _gathered(comm, header, headers, timeout)
    for r in range(world):
        if not np.array_equal(headers[r], header):
            shape = tuple(int(d) for d in headers[r, 2:2 + max(0, min(int(headers[r, 0]), 8))])
            raise ValueError(f"unshard: rank {r} holds a shard of shape {shape} but rank {comm.rank()} one of shape "
                             f"{x.shape} (or their dtypes differ): every rank's shard must have one shape and dtype")
    x = np.ascontiguousarray(x)
    out = np.empty((world,) + x.shape, x.dtype)
    _gathered(comm, x.reshape(-1).view(np.uint8), out.reshape(-1).view(np.uint8), timeout)
    return out


def _gathered(comm, inbuf, outbuf, timeout):
    request = comm.iallgather(inbuf.view(np.uint8), outbuf.view(np.uint8))
    if not comm.wait(request, timeout):
        raise ValueError(f"rank {comm.rank()}: an all-gather did not complete within {timeout} s (a rank stopped?)")


def unshard(x_local, axis=-2, layout="zigzag", comm=None, *, timeout=300.0):
    """The whole sequence from every rank's shard ``x_local`` (``shard``'s inverse), on every rank
    (an all-gather). Every rank's shard must have one shape and dtype (compared first; else a
    ValueError on every rank); zigzag needs an even number of rows along ``axis``."""
    comm = _communicator(comm)
    x_local = np.asarray(x_local)
    axis = _axis_arg(axis, x_local.ndim, "x_local")
    world, n_local = comm.size(), x_local.shape[axis]
    gathered = _allgather(comm, x_local, _timeout_arg(timeout))
    out = np.empty(x_local.shape[:axis] + (world * n_local,) + x_local.shape[axis + 1:], x_local.dtype)
    for r in range(world):
        for local, start, length in _chunks(layout, world, r, n_local):
            dst = [slice(None)] * out.ndim
            src = [slice(None)] * x_local.ndim
            dst[axis], src[axis] = slice(start, start + length), slice(local, local + length)
            out[tuple(dst)] = gathered[r][tuple(src)]
    return out
