"""A world of 2 ranks over MPI through mpi4py (tests/mpi_worker.py under mpirun -n 2), on the
MPI-enabled library: cargo build --release --features mpi --target-dir target/mpi, or the file
DPSYNC_MPI_LIBRARY names."""

import os
import shutil
import subprocess
import sys

import pytest

from conftest import REPO_ROOT

WORKER = os.path.join(os.path.dirname(__file__), "mpi_worker.py")


def test_two_ranks():
    library = os.environ.get("DPSYNC_MPI_LIBRARY") or os.path.join(REPO_ROOT, "target", "mpi", "release", "libdpsync.so")
    if not os.path.isfile(library):
        pytest.skip("no MPI build of the library at %s (cargo build --release --features mpi --target-dir target/mpi)" % library)
    try:
        import mpi4py  # noqa: F401
    except ImportError:
        pytest.skip("mpi4py is not installed (apt-get install python3-mpi4py, or pip install mpi4py)")
    mpirun = shutil.which("mpirun")
    if mpirun is None:
        pytest.skip("mpirun is not on PATH")
    env = dict(os.environ, DPSYNC_LIBRARY=library)
    cmd = ["timeout", "120", mpirun, "--allow-run-as-root", "--oversubscribe", "-n", "2", sys.executable, WORKER]
    done = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, universal_newlines=True, env=env)
    assert done.returncode == 0, done.stdout
    assert "rank 0: ok" in done.stdout and "rank 1: ok" in done.stdout, done.stdout
