"""Run by test_ring_mpi.py under mpirun: every case of ring_util.ALL_CASES through sdpa.distributed
(NumPy, mpi4py), forward and (but for forward-only cases) backward twice, unsharded on every
rank, dsinks and dalibi_slopes summed over the ranks; then the failures: a shape that differs on
the last rank, the ring's messages kept apart from the caller's own (a wildcard receive posted on
the caller's communicator during a ring call gets the caller's message, not the ring's), and a
rank that stops sending (its blocks never leave): the others' error within the timeout, after
which the caller's communicator still carries its own messages. Each rank pickles its results to
argv[1]/rank{r}.pkl; the test checks them."""

import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ring_util  # noqa: E402

STOP_TIMEOUT = 1.0  # the ring's timeout in the stopped-rank case (s)


def _run(case, sd, comm):
    """One run of a case on this rank: {name: the whole sequence's array}, unsharded."""
    from mpi4py import MPI
    q, k, v, dout, slopes, sinks = ring_util.inputs(case)
    lay = case["layout"]
    local = [sd.shard(a, -2, lay, comm) for a in (q, k, v, dout)]
    kw = dict(ring_util.options(case), **ring_util.ring_options(case), layout=lay, alibi_slopes=slopes, sinks=sinks,
              timeout=60)
    out, lse = sd.ring_attention(*local[:3], comm, return_lse=True, **kw)
    run = {"out": sd.unshard(out, -2, lay, comm).astype(np.float32),
           "lse": sd.unshard(lse[..., None], -2, lay, comm).astype(np.float32)[..., 0]}
    if case["backward"]:
        # (the slopes' gradient: sdpa.distributed's _ring_backward, which sdpa.torch.distributed uses)
        dq, dk, dv, dsinks, dalibi, _ = sd._ring_backward(local[3], *local[:3], out, lse, comm, slopes is not None,
                                                          **kw)
        run.update({name: sd.unshard(a, -2, lay, comm).astype(np.float32)
                    for name, a in (("dq", dq), ("dk", dk), ("dv", dv))})
        for name, part in (("dalibi", dalibi), ("dsinks", dsinks)):
            if part is not None:  # this rank's part: summed over the ranks
                comm.Allreduce(MPI.IN_PLACE, part)
                run[name] = part
    return run


def main(outdir):
    from mpi4py import MPI

    import sdpa
    import sdpa.distributed as sd
    sdpa.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    result = {"rank": rank, "cases": {}, "errors": {}}
    try:
        for case in ring_util.ALL_CASES:
            try:
                result["cases"][case["name"]] = [_run(case, sd, comm) for _ in range(2)]
            except Exception as e:  # noqa: BLE001 (the test names it)
                result["errors"][case["name"]] = f"{type(e).__name__}: {e}"
        # The caller's wildcard receive, posted before a ring call, gets the caller's message
        # sent after it (the ring's own travel on a duplicate communicator).
        got, mine = np.zeros(4, np.int64), np.full(4, 100 + rank, np.int64)
        pending = comm.Irecv(got, source=MPI.ANY_SOURCE, tag=MPI.ANY_TAG)
        q, k, v, _, _, _ = ring_util.inputs(ring_util.CASES[0])
        sd.ring_attention(*(sd.shard(a, -2, "zigzag", comm) for a in (q, k, v)), comm, causal=True, timeout=60)
        comm.Send(mine, dest=(rank + 1) % world, tag=5)
        pending.Wait()
        result["wildcard"] = got.tolist()
        if world > 1:
            qm = np.zeros((1, 2, 4 if rank == world - 1 else 2, 8), np.float32)
            result["mismatch"] = ring_util.error(lambda: sd.ring_attention(qm, qm, qm, comm, timeout=30))[0]

            class Mute(sd.MPICommunicator):
                """Sends nothing (a rank that stops after the arguments' all-gather)."""

                def isend(self, buf, to, tag):
                    return self._started(MPI.REQUEST_NULL, False)

            q1 = np.zeros((1, 2, 2, 8), np.float32)
            stopped = Mute(comm) if rank == world - 1 else comm
            result["stopped"] = ring_util.error(lambda: sd.ring_attention(q1, q1, q1, stopped, timeout=STOP_TIMEOUT))
            # the caller's communicator after it: its own messages only
            comm.Sendrecv(mine, dest=(rank + 1) % world, sendtag=6, recvbuf=got, source=MPI.ANY_SOURCE,
                          recvtag=MPI.ANY_TAG)
            result["after_stop"] = got.tolist()
    except BaseException:  # noqa: BLE001 (reported to the test)
        result["crash"] = traceback.format_exc()
    ring_util.save(os.path.join(outdir, f"rank{rank}.pkl"), result)


if __name__ == "__main__":
    main(sys.argv[1])
