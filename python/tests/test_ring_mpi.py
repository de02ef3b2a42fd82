"""sdpa.distributed over MPI (mpi4py): one mpirun -np W (W = 1..4) on loopback of
ring_mpi_script.py per world size, whose ranks run every case of ring_util.ALL_CASES forward and
backward (dsinks and dalibi_slopes included) and the failures; every rank's results are checked
here against the float64 reference under the tolerance rule (ring_util.check_cases, as
test_ring_torch.py does), a shape mismatch by its exact message on every rank, the ring's
messages apart from the caller's own, and a rank that stops. Skipped only where mpirun or mpi4py
is missing (CI has both)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys

import pytest

import ring_util

SCRIPT = os.path.join(os.path.dirname(os.path.abspath(__file__)), "ring_mpi_script.py")
LIMIT = 120  # seconds for one mpirun


def _mpirun():
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not installed (scripts/setup.sh installs openmpi-bin)")
    if importlib.util.find_spec("mpi4py") is None:
        pytest.skip("mpi4py is not installed (scripts/setup.sh installs it)")
    return mpirun


STOP_TIMEOUT = 1.0  # ring_mpi_script.py's


@pytest.fixture(scope="module", params=[1, 2, 3, 4], ids=lambda w: f"W{w}")
def mpi_run(request, tmp_path_factory):
    """(world, every rank's results): one mpirun per world size, shared by the tests below."""
    world = request.param
    outdir = tmp_path_factory.mktemp(f"ring_mpi_w{world}")
    cmd = [_mpirun(), "--allow-run-as-root", "--oversubscribe", "-np", str(world), "--mca", "btl", "self,vader",
           "--mca", "btl_vader_single_copy_mechanism", "none", "--mca", "oob_tcp_if_include", "lo",
           sys.executable, SCRIPT, str(outdir)]
    try:
        run = subprocess.run(cmd, capture_output=True, text=True, timeout=LIMIT,
                             env=dict(os.environ, OMP_NUM_THREADS="1"))
    except subprocess.TimeoutExpired:
        pytest.fail(f"mpirun -np {world} did not finish within {LIMIT} s (a hang)")
    assert run.returncode == 0, f"mpirun -np {world} failed ({run.returncode}):\n{run.stdout}\n{run.stderr}"
    results = [ring_util.load(os.path.join(outdir, f"rank{r}.pkl")) for r in range(world)]
    for r in results:
        assert "crash" not in r, f"W={world} rank {r['rank']} failed:\n{r['crash']}"
    return world, results


def test_ring_attention_mpi(mpi_run):
    world, results = mpi_run
    ring_util.check_cases(results, ring_util.CASES + ring_util.DOC_FORWARD_CASES, world)
    for r in results:  # the caller's wildcard receive got the caller's message, not the ring's
        assert r["wildcard"] == [100 + (r["rank"] - 1) % world] * 4, f"W={world} rank {r['rank']}: {r['wildcard']}"
    if world == 1:
        return
    want = (f"ValueError: ring_attention: rank {world - 1}'s arguments differ from rank 0's (every rank must pass "
            f"the same shapes, dtypes and options): q: shape (1, 2, 2, 8) float32 on rank 0, shape (1, 2, 4, 8) "
            f"float32 on rank {world - 1}")
    for r in results:
        assert r["mismatch"] == want, f"W={world} rank {r['rank']}: {r['mismatch']!r}"
    for r in results[:-1]:  # (the last rank sends nothing; those before it wait in turn)
        msg, elapsed = r["stopped"]
        assert msg is not None and msg.startswith(f"ValueError: ring_attention: rank {r['rank']} waited "
                                                  f"{STOP_TIMEOUT:g} s for the block of rank "), \
            f"W={world} rank {r['rank']}: {msg}"
        assert elapsed <= world * STOP_TIMEOUT + 4, f"W={world} rank {r['rank']}: the error took {elapsed:.1f} s"
    for r in results:  # the caller's communicator after the timeout: its own messages only
        assert r["after_stop"] == [100 + (r["rank"] - 1) % world] * 4, f"W={world} rank {r['rank']}: {r['after_stop']}"


@pytest.mark.parametrize("group", list(ring_util.GROUPS))
def test_ring_cases_mpi(mpi_run, group):
    """Each group of ring_util.GROUPS (documents, allgather) forward and backward, as above."""
    world, results = mpi_run
    ring_util.check_cases(results, ring_util.GROUPS[group], world)
