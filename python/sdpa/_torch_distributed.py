"""``sdpa.torch.distributed``: ring attention (exact context-parallel attention) over
torch.distributed, with autograd, on CPU tensors.

    import torch.distributed as dist
    import sdpa.torch.distributed as sd
    dist.init_process_group("gloo")
    q, k, v = (sd.shard(t, dim=2) for t in (q_full, k_full, v_full))   # this rank's (B, H, N/W, D)
    out = sd.ring_attention(q, k, v, causal=True)                       # this rank's output rows
    out.sum().backward()                                                 # q.grad, k.grad, v.grad: the ring backward

The algorithm is the C++ ``sdpa::ring_attention`` (include/sdpa/ring.h; ``sdpa.distributed`` has
the layouts and the failure rules), run over ``TorchCommunicator``: the key/value blocks travel
with ``dist.isend``/``dist.irecv`` (tagged, on the tensors' own memory), the first all-gather
compares shapes and options across the ranks. Any backend with point-to-point messages and
all_gather works (gloo on the CPU). (This module is registered as the attribute ``distributed``
of ``sdpa.torch`` and as ``sys.modules["sdpa.torch.distributed"]``: sdpa.torch stays a module.)

Gradients: q, k, v get theirs (this rank's shards). ``sinks`` and ``alibi_slopes``, parameters
shared across the sequence, get this rank's part of their gradient: sum it over the ranks (the
all-reduce of data parallelism's gradients, or ``dist.all_reduce(p.grad)``), as for any parameter
every shard reads.
"""

from __future__ import annotations

import datetime
import math
import time
import warnings

import numpy as np
import torch
import torch.distributed as dist

from . import distributed as _numpy_ring
from ._args import _numpy_of_tensor, _parsed_dropout, _precision_arg, _tensor_of_numpy

__all__ = ["TorchCommunicator", "ring_attention", "shard", "unshard"]


def _group_rank_to_global(group, r):
    return r if group is None or group is dist.group.WORLD else dist.get_global_rank(group, r)


class TorchCommunicator(_numpy_ring.Communicator):
    """sdpa's ring communicator over a torch.distributed process group (None: the default
    group): ``dist.isend``/``dist.irecv`` with tags and an asynchronous ``dist.all_gather`` on
    tensors over the ring's own bytes (``torch.from_numpy``: no copies); ``wait`` is the work's
    wait with the deadline (False when it passes; the work's own error otherwise). After a timeout the work is
    abandoned: do not use the group for another ring call. The backend counts whole
    milliseconds: a deadline is rounded up to the next (a timeout that is not a whole number of
    them is reported as TimeoutError naming the one used)."""

    def __init__(self, group=None):
        super().__init__()
        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError("sdpa.torch.distributed needs torch.distributed initialised "
                               "(dist.init_process_group) before a ring call")
        self.group = group
        self._rank, self._size = dist.get_rank(group), dist.get_world_size(group)
        self._works = {}
        self._next = 0

    def _started(self, work):
        self._next += 1
        self._works[self._next] = work
        return self._next

    def rank(self):
        return self._rank

    def size(self):
        return self._size

    @staticmethod
    def _tensor(buf):
        with warnings.catch_warnings():  # a read-only buffer (what is sent): torch only reads it
            warnings.simplefilter("ignore", UserWarning)
            return torch.from_numpy(buf)

    def isend(self, buf, to, tag):
        return self._started(dist.isend(self._tensor(buf), _group_rank_to_global(self.group, to), group=self.group,
                                        tag=tag))

    def irecv(self, buf, from_, tag):
        return self._started(dist.irecv(self._tensor(buf), _group_rank_to_global(self.group, from_),
                                        group=self.group, tag=tag))

    def iallgather(self, inbuf, outbuf):
        parts = list(self._tensor(outbuf).view(self._size, -1).unbind(0))
        return self._started(dist.all_gather(parts, self._tensor(inbuf), group=self.group, async_op=True))

    def wait(self, request, seconds):
        # work.wait with a timeout: gloo's send and receive works say is_completed() only once
        # waited on, so they cannot be polled; a timeout is an error there, told from a
        # transport error by the time it took.
        work = self._works.pop(request)
        ms = max(1, math.ceil(round(seconds * 1e6) / 1000))  # whole ms, rounded up (never 0: no deadline)
        used = ms / 1000
        start = time.monotonic()
        try:
            work.wait(datetime.timedelta(milliseconds=ms))
        except RuntimeError:
            if time.monotonic() - start < used:
                raise  # a transport error (a peer that closed its connection)
            if used != seconds:  # (the ring's own message would name `seconds`)
                raise TimeoutError(f"no answer within {used:g} s (the timeout {seconds:g} s rounded up to the "
                                   f"backend's whole milliseconds)") from None
            return False
        return True


def _seed(seed, dropout_p, group, timeout):
    """The dropout seed every rank uses: seed, or with dropout and none given one drawn from
    torch's generator on the group's rank 0 (torch.manual_seed there reproduces it; the others'
    generators are not used). Every rank all-gathers (whether it draws, rank 0's draw) on every
    call, with the ring's deadline, so that ranks that disagree on drawing (one passes a seed or
    no dropout, another neither) get the same ValueError, and a peer that does not take part a
    ValueError naming the rank within ``timeout`` seconds: never a hang or mismatched collectives."""
    comm = TorchCommunicator(group)
    draw = seed is None and dropout_p > 0
    mine = np.zeros(2, np.int64)
    mine[0] = draw
    if draw and comm.rank() == 0:
        mine[1] = torch.randint(0, 2**62, (1,), dtype=torch.int64).item()
    every = np.empty((comm.size(), 2), np.int64)
    _numpy_ring._gathered(comm, mine, every, _numpy_ring._timeout_arg(timeout), "the dropout seed's all-gather")
    for r in range(1, comm.size()):
        if every[r, 0] != every[0, 0]:
            def says(x):
                return "draws a seed (dropout_p > 0, seed=None)" if x else "does not (a seed given, or dropout_p = 0)"
            raise ValueError(f"ring_attention: rank {r} {says(every[r, 0])} but rank 0 {says(every[0, 0])}: every "
                             f"rank must pass the same dropout_p and seed")
    return int(every[0, 1]) if draw else seed


def _array(name, t):
    return None if t is None else _numpy_of_tensor(name, t)


class _RingAttention(torch.autograd.Function):
    @staticmethod
    def forward(ctx, q, k, v, alibi_slopes, sinks, group, kw):
        comm = TorchCommunicator(group)
        arrays = [_array(n, t) for n, t in (("q", q), ("k", k), ("v", v))]
        mods = dict(kw, alibi_slopes=_array("alibi_slopes", alibi_slopes), sinks=_array("sinks", sinks))
        out, lse = _numpy_ring.ring_attention(*arrays, comm, return_lse=True, **mods)
        out, lse = _tensor_of_numpy(out), _tensor_of_numpy(lse)
        ctx.save_for_backward(q, k, v, out, lse, alibi_slopes, sinks)
        ctx.group, ctx.kw = group, kw
        return out

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, dout):
        q, k, v, out, lse, alibi_slopes, sinks = ctx.saved_tensors
        comm = TorchCommunicator(ctx.group)
        arrays = [_array(n, t) for n, t in (("dout", dout), ("q", q), ("k", k), ("v", v), ("out", out),
                                            ("lse", lse))]
        alibi_grad = alibi_slopes is not None and ctx.needs_input_grad[3]
        dq, dk, dv, dsinks, dalibi, _ = _numpy_ring._ring_backward(
            *arrays, comm, alibi_grad, alibi_slopes=_array("alibi_slopes", alibi_slopes),
            sinks=_array("sinks", sinks), **ctx.kw)
        grads = [None if g is None else _tensor_of_numpy(g) for g in (dq, dk, dv, dalibi, dsinks)]
        if not ctx.needs_input_grad[4]:
            grads[4] = None
        return (*grads, None, None)


def ring_attention(q, k, v, *, group=None, causal=False, layout="zigzag", scale=None, window=None,
                   alibi_slopes=None, softcap=0.0, softcap_order="before_bias", dropout_p=0.0, seed=None, sinks=None,
                   block_mask=None, block_size=128, precision=None, timeout=300.0, strategy="ring", cu_seqlens=None):
    """Ring attention over a torch.distributed group (None: the default one), with autograd:
    q (B, Hq, N_local, Dk), k (B, Hkv, N_local, Dk), v (B, Hkv, N_local, Dv), this rank's shards
    of the whole sequence in ``layout`` ("zigzag", default: rank r holds chunks r and 2W - 1 - r
    of 2W; "contiguous": chunk r of W; ``shard`` cuts them); returns this rank's output shard
    (B, Hq, N_local, Dv) in q's dtype: ``sdpa.distributed.ring_attention``'s, on tensors.

    The options are ``sdpa.distributed.ring_attention``'s (causal: the whole sequence's positions;
    window, ALiBi, sinks and block_mask of the whole sequence; precision None takes the
    enclosing ``sdpa.precision(...)`` block's, else "exact"). dropout_p > 0 without a seed: one
    is drawn on the group's rank 0 from torch's generator and all-gathered (with the deadline
    ``timeout``), so that every rank uses the same (the backward reuses it). ``strategy``
    ("ring" or "allgather") and ``cu_seqlens`` (packed documents: (D + 1,) integer offsets over
    the whole sequence's positions, a tensor or a sequence; q's batch 1; the result is
    ``sdpa.torch.attention_varlen``'s on the whole packed sequence) are
    ``sdpa.distributed.ring_attention``'s. Every rank must pass the same shapes and options (compared
    before any block moves; ValueError on every rank otherwise); ``timeout`` bounds each wait for
    a peer (ValueError naming it, never a hang).

    Gradients flow to q, k, v (the ring backward: dK/dV travel back to their owners, summed in
    float32) and to sinks and alibi_slopes when they require one: this rank's part, which the
    caller sums over the ranks (an all-reduce), as for any parameter the shards share
    (with cu_seqlens, the slopes' gradient has the slopes' shape: (D, Hq) or (Hq,)).
    First derivatives only.
    """
    from .torch import _check_tensors
    _check_tensors(("q", "k", "v"), (q, k, v))
    p, _ = _parsed_dropout(dropout_p, 0)  # (the seed is checked with the others)
    kw = dict(causal=causal, layout=layout, scale=scale, window=window, softcap=softcap, softcap_order=softcap_order,
              dropout_p=p, seed=_seed(seed, p, group, timeout), strategy=strategy,
              cu_seqlens=cu_seqlens.detach().cpu().numpy() if isinstance(cu_seqlens, torch.Tensor) else cu_seqlens,
              block_mask=None if block_mask is None else _array("block_mask", block_mask), block_size=block_size,
              precision=_precision_arg(precision), timeout=timeout)  # (the block's now: the backward's too)
    tensors = []
    for name, t in (("alibi_slopes", alibi_slopes), ("sinks", sinks)):
        if t is not None and not isinstance(t, torch.Tensor):
            t = torch.as_tensor(np.asarray(t))
        tensors.append(t)
    return _RingAttention.apply(q, k, v, *tensors, group, kw)


def shard(x, dim=2, layout="zigzag", group=None):
    """This rank's shard of x (the whole sequence, the same on every rank) along ``dim`` (the
    sequence dim: 2 for (B, H, N, D)) in ``layout``: a new tensor of N / W rows (no autograd
    link to x: shard leaf tensors). N must split into W ("contiguous") or 2W ("zigzag") chunks."""
    a = _numpy_ring._shard(_numpy_of_tensor("x", x), dim, layout, dist.get_rank(group), dist.get_world_size(group))
    return _tensor_of_numpy(np.ascontiguousarray(a))


def unshard(x_local, dim=2, layout="zigzag", group=None, *, timeout=300.0):
    """The whole sequence from every rank's shard (``shard``'s inverse), on every rank (an
    all-gather over the group; no autograd). Every rank's shard must have one shape and dtype
    (compared first: ValueError on every rank otherwise, naming both)."""
    a = _numpy_ring.unshard(_numpy_of_tensor("x_local", x_local), dim, layout, TorchCommunicator(group),
                            timeout=timeout)
    return _tensor_of_numpy(a)
