"""Run by test_ring_mpi.py under mpirun: every case of ring_util.CASES through sdpa.distributed
(NumPy, mpi4py), forward and backward twice, unsharded on every rank; then a shape that differs
on the last rank. Each rank pickles its results to argv[1]/rank{r}.pkl; the test checks them."""

import os
import sys
import traceback

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import ring_util  # noqa: E402


def main(outdir):
    from mpi4py import MPI

    import sdpa
    import sdpa.distributed as sd
    sdpa.set_num_threads(1)
    comm = MPI.COMM_WORLD
    rank, world = comm.Get_rank(), comm.Get_size()
    result = {"rank": rank, "cases": {}}
    try:
        for case in ring_util.CASES:
            if case["alibi"] and case["sinks"]:
                continue  # (the slopes' gradient is sdpa.torch's: test_ring_torch.py)
            q, k, v, dout, slopes, sinks = ring_util.inputs(case)
            lay = case["layout"]
            local = [sd.shard(a, -2, lay, comm) for a in (q, k, v, dout)]
            kw = dict(ring_util.options(case), layout=lay, alibi_slopes=slopes, sinks=sinks, timeout=60)
            runs = []
            for _ in range(2):
                out, lse = sd.ring_attention(*local[:3], comm, return_lse=True, **kw)
                grads = sd.ring_attention_backward(local[3], *local[:3], out, lse, comm, **kw)
                run = {name: sd.unshard(a, -2, lay, comm).astype(np.float32)
                       for name, a in zip(("out", "lse", "dq", "dk", "dv"), (out, lse[..., None]) + grads[:3])}
                run["lse"] = run["lse"][..., 0]
                runs.append(run)
            result["cases"][case["name"]] = runs
        if world > 1:
            qm = np.zeros((1, 2, 4 if rank == world - 1 else 2, 8), np.float32)
            try:
                sd.ring_attention(qm, qm, qm, comm, timeout=30)
                result["mismatch"] = None
            except ValueError as e:
                result["mismatch"] = str(e)
    except BaseException:  # noqa: BLE001 (reported to the test)
        result["crash"] = traceback.format_exc()
    ring_util.save(os.path.join(outdir, f"rank{rank}.pkl"), result)


if __name__ == "__main__":
    main(sys.argv[1])
