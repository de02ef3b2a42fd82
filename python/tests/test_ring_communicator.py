"""sdpa.distributed's Communicator interface in one process (no MPI, no torch): a Python
subclass drives the C++ ring (a world of 1: the all-gather of the arguments, then the rank's own
block), its exceptions become ValueErrors naming the rank and the call, a wait that times out is
an error within the timeout, and importing sdpa.distributed does not import mpi4py."""

import subprocess
import sys
import time

import numpy as np
import pytest

import sdpa
import sdpa.distributed as sd


class Alone(sd.Communicator):
    """A world of one: the all-gather copies in to out; nothing else is ever sent."""

    def __init__(self, fail=None, never=False):
        super().__init__()
        self.fail, self.never, self.calls = fail, never, []

    def rank(self):
        return 0

    def size(self):
        return 1

    def isend(self, buf, to, tag):
        raise AssertionError("a world of one sends nothing")

    def irecv(self, buf, from_, tag):
        raise AssertionError("a world of one receives nothing")

    def iallgather(self, inbuf, outbuf):
        self.calls.append(("iallgather", inbuf.dtype, inbuf.shape, outbuf.shape, inbuf.flags.writeable))
        if self.fail:
            raise self.fail
        outbuf[:] = inbuf
        return 7

    def wait(self, request, seconds):
        self.calls.append(("wait", request))
        if self.never:
            time.sleep(seconds)
            return False
        return True


def _qkv():
    rng = np.random.default_rng(3)
    return [rng.standard_normal((1, 2, 6, 4)).astype(np.float32) for _ in range(3)]


@pytest.mark.parametrize("layout", ["zigzag", "contiguous"])
def test_a_python_communicator_drives_the_ring(layout):
    q, k, v = _qkv()
    comm = Alone()
    out, lse = sd.ring_attention(q, k, v, comm, causal=True, layout=layout, return_lse=True)
    want, want_lse = sdpa.attention(q, k, v, causal=True, return_lse=True)
    np.testing.assert_allclose(out, want, atol=1e-6)
    np.testing.assert_allclose(lse, want_lse, atol=1e-6)
    kind, dtype, shape, gathered, writeable = comm.calls[0]
    assert kind == "iallgather" and dtype == np.uint8 and gathered == shape and not writeable  # zero-copy, read-only
    assert comm.calls[1] == ("wait", 7)
    dq, dk, dv = sd.ring_attention_backward(want, q, k, v, out, lse, Alone(), causal=True, layout=layout)
    for got, ref in zip((dq, dk, dv), sdpa.attention_backward(want, q, k, v, want, want_lse, causal=True)):
        np.testing.assert_allclose(got, ref, atol=1e-5)


def test_return_stats_says_where_the_time_went():
    q, k, v = _qkv()
    out, stats = sd.ring_attention(q, k, v, Alone(), causal=True, return_stats=True)
    np.testing.assert_array_equal(out, sd.ring_attention(q, k, v, Alone(), causal=True))
    assert set(stats) == {"check_seconds", "compute_seconds", "wait_seconds", "bytes_sent"}
    assert stats["compute_seconds"] > 0 and stats["check_seconds"] > 0
    assert stats["bytes_sent"] == 0  # a world of one sends no block
    out, lse = sd.ring_attention(q, k, v, Alone(), causal=True, return_lse=True)
    *grads, bstats = sd.ring_attention_backward(out, q, k, v, out, lse, Alone(), causal=True, return_stats=True)
    assert len(grads) == 3 and bstats["compute_seconds"] > 0


def test_an_exception_of_the_communicator_names_the_rank_and_the_call():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"rank 0: .*Alone.*iallgather\(\d+ bytes\) raised ConnectionError: peer gone"):
        sd.ring_attention(q, k, v, Alone(fail=ConnectionError("peer gone")))


def test_a_wait_that_times_out_is_an_error_not_a_hang():
    q, k, v = _qkv()
    start = time.monotonic()
    with pytest.raises(ValueError, match="rank 0"):
        sd.ring_attention(q, k, v, Alone(never=True), timeout=0.2)
    assert time.monotonic() - start < 5


def test_arguments_are_checked_by_name():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match="layout"):
        sd.ring_attention(q, k, v, Alone(), layout="spiral")
    with pytest.raises(ValueError, match="timeout"):
        sd.ring_attention(q, k, v, Alone(), timeout=0)
    with pytest.raises(ValueError, match=r"shape \(1, 2, 6, 4\).*4 equal chunks"):
        sd._shard(q, -2, "zigzag", 0, 2)


def test_shard_and_unshard_invert_each_other():
    x = np.arange(2 * 12).reshape(2, 12, 1)
    for layout in ("zigzag", "contiguous"):
        assert np.array_equal(sd.unshard(sd.shard(x, 1, layout, Alone()), 1, layout, Alone()), x)
    assert sd._shard(x, 1, "zigzag", 0, 2)[0, :, 0].tolist() == [0, 1, 2, 9, 10, 11]
    assert sd._shard(x, 1, "contiguous", 1, 2)[0, :, 0].tolist() == [6, 7, 8, 9, 10, 11]


def test_importing_sdpa_distributed_does_not_import_mpi4py():
    code = "import sys, sdpa, sdpa.distributed; assert 'mpi4py' not in sys.modules"
    subprocess.run([sys.executable, "-c", code], check=True)


def _positions(layout, world, rank, n_local):
    return [start + i for _, start, length in sd._chunks(layout, world, rank, n_local) for i in range(length)]


def test_the_layout_pictures_of_docs_distributed_md():
    """docs/DISTRIBUTED.md's pictures of the layouts are ring_chunks' (W = 2 and 4)."""
    import os
    import re
    doc = open(os.path.join(os.path.dirname(__file__), "..", "..", "docs", "DISTRIBUTED.md")).read()
    block = doc.split("## Layouts", 1)[1].split("```", 2)[1]
    pictures = {"contiguous": re.search(r"^  contiguous +(rank 0:.*)$", block, re.M).group(1),
                "zigzag": re.search(r"^  zigzag +(rank 0:.*)$", block, re.M).group(1)}
    for layout, line in pictures.items():
        ranks = [[int(t) for t in part.replace("|", " ").split()] for part in re.split(r"rank \d+:", line)[1:]]
        assert ranks == [_positions(layout, 2, r, 4) for r in range(2)], layout
    line = re.search(r"^  (rank 0: 0 1 \| 14 15.*)$", block, re.M).group(1)
    ranks = [[int(t) for t in part.replace("|", " ").split()] for part in re.split(r"rank \d+:", line)[1:]]
    assert ranks == [_positions("zigzag", 4, r, 4) for r in range(4)]



class Pair(Alone):
    """Rank 0 of two, whose peer holds a float64 shard of the same shape (unshard's header)."""

    def size(self):
        return 2

    def iallgather(self, inbuf, outbuf):
        n = inbuf.size
        outbuf[:n] = inbuf
        other = np.array(inbuf).view(np.int64)
        other[1:3] = np.frombuffer(b"float64".ljust(16), np.int64)
        outbuf[n:] = other.view(np.uint8)
        return 1


def test_unshard_names_both_dtypes_and_shapes():
    with pytest.raises(ValueError, match=r"^unshard: rank 1 holds a shard of shape \(2, 3\) and dtype float64 but "
                                         r"rank 0 one of shape \(2, 3\) and dtype float32: every rank's shard must "
                                         r"have one shape and dtype$"):
        sd.unshard(np.zeros((2, 3), np.float32), 0, "contiguous", Pair())


def test_layout_and_strategy_are_checked_once_by_name():
    q, k, v = _qkv()
    with pytest.raises(ValueError, match=r"^strategy must be 'ring' or 'allgather', got 'tree'$"):
        sd.ring_attention(q, k, v, Alone(), strategy="tree")
    with pytest.raises(TypeError, match="strategy must be 'ring' or 'allgather', got 1"):
        sd.ring_attention(q, k, v, Alone(), strategy=1)
    with pytest.raises(ValueError, match=r"^layout must be 'zigzag' or 'contiguous', got 'spiral'$"):
        sd.shard(q, -2, "spiral", Alone())
    with pytest.raises(TypeError, match="cu_seqlens has dtype float64"):
        sd.ring_attention(q, k, v, Alone(), cu_seqlens=[0.0, 6.0])
    with pytest.raises(ValueError, match="RingOptions::cu_seqlens"):  # the C++'s check of the values
        sd.ring_attention(q, k, v, Alone(), cu_seqlens=[0, 7])
