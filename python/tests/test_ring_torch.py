"""sdpa.torch.distributed: ring attention over torch.distributed (gloo on loopback), world sizes 1
to 4, one spawn per world size running every case (ring_util.CASES: both layouts, causal and
not, GQA, window, ALiBi and sinks, bfloat16 and float32, dropout), forward and every gradient
unsharded and checked here, in the parent, against the one-process call on the whole sequence
(ring_util.check: the tolerance rule, and two runs bitwise equal); then the failures: a shape
that differs on one rank is an error on every rank, and a rank that stops gives the others an
error within the timeout, never a hang."""

from __future__ import annotations

import os
import socket
import sys
import time
import traceback

import numpy as np
import pytest

import ring_util
from torch_required import import_torch

torch = import_torch(module_level=True)
import torch.multiprocessing as mp  # noqa: E402

STOP_TIMEOUT = 1.0   # the ring's timeout in the stopped-rank case (s)
SLACK = 4.0          # what the others may take beyond it to raise (the stopped rank sleeps longer)
JOIN_LIMIT = 150.0   # the parent's bound on a whole spawn (s)


def _free_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _run(case, sd, dist):
    """One run of a case on this rank: {name: the whole sequence's array}, unsharded."""
    q, k, v, dout, slopes, sinks = ring_util.inputs(case)
    local = [sd.shard(torch.from_numpy(a.astype(np.float32)).to(torch.bfloat16 if case["dtype"] == "bfloat16"
                                                                  else torch.float32), 2, case["layout"])
             for a in (q, k, v, dout)]
    for t in local[:3]:
        t.requires_grad_(case["backward"])
    s = None if slopes is None else torch.from_numpy(slopes).requires_grad_()
    sk = None if sinks is None else torch.from_numpy(sinks).requires_grad_()
    out = sd.ring_attention(*local[:3], layout=case["layout"], alibi_slopes=s, sinks=sk, timeout=60,
                            **ring_util.options(case), **ring_util.ring_options(case))
    if not case["backward"]:
        return {"out": sd.unshard(out.detach(), 2, case["layout"]).float().numpy()}
    out.backward(local[3])
    run = {name: sd.unshard(t.detach(), 2, case["layout"]).float().numpy()
           for name, t in (("out", out), ("dq", local[0].grad), ("dk", local[1].grad), ("dv", local[2].grad))}
    for name, p in (("dalibi", s), ("dsinks", sk)):
        if p is not None:  # this rank's part: the caller's all-reduce sums them
            dist.all_reduce(p.grad)
            run[name] = p.grad.numpy().copy()
    return run


def _worker(rank, world, port, outdir):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), GLOO_SOCKET_IFNAME="lo")
    result = {"rank": rank}
    try:
        import torch.distributed as dist

        import sdpa
        import sdpa.torch.distributed as sd
        torch.set_num_threads(1)
        sdpa.set_num_threads(1)
        dist.init_process_group("gloo", rank=rank, world_size=world)
        result["cases"], result["errors"] = {}, {}
        for case in ring_util.ALL_CASES:
            try:
                result["cases"][case["name"]] = [_run(case, sd, dist) for _ in range(2)]
            except Exception as e:  # noqa: BLE001 (the test names it)
                result["errors"][case["name"]] = f"{type(e).__name__}: {e}"
        # dropout without a seed: rank 0's, all-gathered (the ring compares seeds: a different one
        # on any rank would be an error)
        qd = torch.randn(1, 2, 2 * world, 8, generator=torch.Generator().manual_seed(7))
        result["no_seed"] = ring_util.error(lambda: sd.ring_attention(qd, qd, qd, dropout_p=0.5, timeout=60))[0]
        if world > 1:
            # a shape that differs on one rank: an error on every rank, before any block moves
            n = 4 if rank == world - 1 else 2
            qm = torch.zeros(1, 2, n, 8)
            result["mismatch"] = ring_util.error(lambda: sd.ring_attention(qm, qm, qm, timeout=30))[0]
            # rank 0 draws a dropout seed, the others pass one: the same ValueError on every rank
            # (not two different collectives, which gloo aborts on)
            result["seed_mismatch"] = ring_util.error(
                lambda: sd.ring_attention(qd, qd, qd, dropout_p=0.5, seed=None if rank == 0 else 3, timeout=30))[0]
            # a rank that stops: the others' error within the timeout (the last rank sleeps, then exits)
            if rank == world - 1:
                ring_util.save(os.path.join(outdir, f"rank{rank}.pkl"), result)
                time.sleep(STOP_TIMEOUT + SLACK + 1)
                os._exit(0)
            q1 = torch.zeros(1, 2, 2, 8)
            # dropout without a seed: its all-gather has the deadline too
            result["stopped_seed"] = ring_util.error(lambda: sd.ring_attention(q1, q1, q1, dropout_p=0.5, timeout=STOP_TIMEOUT))
            result["stopped"] = ring_util.error(lambda: sd.ring_attention(q1, q1, q1, timeout=STOP_TIMEOUT))
    except BaseException:  # noqa: BLE001 (reported to the parent)
        result["crash"] = traceback.format_exc()
    ring_util.save(os.path.join(outdir, f"rank{rank}.pkl"), result)
    sys.stdout.flush()
    os._exit(0)  # no teardown of a group with abandoned work


def _spawn(world, tmp_path):
    ctx = mp.start_processes(_worker, args=(world, _free_port(), str(tmp_path)), nprocs=world, join=False,
                             start_method="spawn")
    deadline = time.monotonic() + JOIN_LIMIT
    try:
        while not ctx.join(timeout=1):
            if time.monotonic() > deadline:
                pytest.fail(f"W={world}: the ranks did not finish within {JOIN_LIMIT} s (a hang)")
    finally:
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
    results = [ring_util.load(os.path.join(tmp_path, f"rank{r}.pkl")) for r in range(world)]
    for r in results:
        assert "crash" not in r, f"W={world} rank {r['rank']} failed:\n{r['crash']}"
    return results


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def spawned(request, tmp_path_factory):
    """(world, every rank's results): one spawn per world size, shared by the tests below."""
    world = request.param
    return world, _spawn(world, tmp_path_factory.mktemp(f"ring_torch_w{world}"))


def test_ring_attention_torch(spawned):
    world, results = spawned
    ring_util.check_cases(results, ring_util.CASES + ring_util.DOC_FORWARD_CASES, world)
    for r in results:
        assert r["no_seed"] is None, f"W={world} rank {r['rank']}: dropout without a seed failed: {r['no_seed']}"
    if world == 1:
        return
    for r in results:
        msg = r["mismatch"]
        assert msg is not None and "ValueError" in msg, f"W={world} rank {r['rank']}: no error for a mismatch ({msg})"
        msg = r["seed_mismatch"]
        want = "rank 1 does not (a seed given, or dropout_p = 0) but rank 0 draws a seed (dropout_p > 0, seed=None)"
        assert msg is not None and want in msg, f"W={world} rank {r['rank']}: seed mismatch: {msg}"
    for r in results[:-1]:
        for key, text in (("stopped_seed", f"rank {r['rank']}: the dropout seed's all-gather did not complete within "
                                           f"{STOP_TIMEOUT} s"), ("stopped", None)):
            msg, elapsed = r[key]
            assert msg is not None, f"W={world} rank {r['rank']}: no error with a stopped rank ({key})"
            assert text is None or text in msg, f"W={world} rank {r['rank']}: {key}: {msg}"
            assert elapsed <= STOP_TIMEOUT + SLACK, f"W={world} rank {r['rank']}: {key}: the error took {elapsed:.1f} s"


@pytest.mark.parametrize("group", list(ring_util.GROUPS))
def test_ring_cases_torch(spawned, group):
    """Each group of ring_util.GROUPS (documents, allgather) forward and backward, as above."""
    world, results = spawned
    ring_util.check_cases(results, ring_util.GROUPS[group], world)


class _Work:
    """A gloo work whose wait times out after the deadline it is given (recorded)."""

    def __init__(self):
        self.deadlines = []

    def wait(self, deadline):
        self.deadlines.append(deadline)
        time.sleep(deadline.total_seconds())
        raise RuntimeError(f"Timed out waiting {deadline}")


def test_torch_wait_rounds_the_deadline_up_and_names_the_one_used():
    import datetime

    import sdpa.distributed
    import sdpa.torch.distributed as sd
    comm = sd.TorchCommunicator.__new__(sd.TorchCommunicator)
    sdpa.distributed.Communicator.__init__(comm)
    work = _Work()
    comm._works = {1: work, 2: work, 3: work}
    assert comm.wait(1, 0.2) is False  # a whole number of ms: the ring names it
    with pytest.raises(TimeoutError, match=r"no answer within 0\.002 s \(the timeout 0\.0015 s rounded up"):
        comm.wait(2, 0.0015)
    with pytest.raises(TimeoutError, match=r"no answer within 0\.001 s \(the timeout 0\.0001 s rounded up"):
        comm.wait(3, 0.0001)
    assert work.deadlines == [datetime.timedelta(milliseconds=ms) for ms in (200, 2, 1)]
