"""Leaving a world (Context.leave), world_epoch, elastic=, and RankLost. The world part runs
tests/mpi_leave_worker.py under mpirun -n 2 on the MPI-enabled library (cargo build --release
--features mpi --target-dir target/mpi, or the file DPSYNC_MPI_LIBRARY names); the rest needs
no world."""

import os
import shutil
import subprocess
import sys

import pytest

import dpsync
from conftest import REPO_ROOT

WORKER = os.path.join(os.path.dirname(__file__), "mpi_leave_worker.py")


def test_leave_without_a_world_is_invalid_state():
    with dpsync.Context(host_replicas=2) as ctx:
        assert ctx.world_epoch == (0, 0)
        with pytest.raises(dpsync.InvalidState) as info:
            ctx.leave()
        assert info.value.function == "dpsync_leave" and info.value.code == 5
        # Nothing changed: the context still works.
        ctx.allreduce_grads("sum")
        assert ctx.world_epoch == (0, 0)


def test_elastic_without_a_world_changes_nothing():
    with dpsync.Context(host_replicas=2, elastic=3) as ctx:
        assert ctx.ranks == 1
    assert "replicas" in dpsync.plan_describe(host_replicas=2, elastic=1)
    with pytest.raises(dpsync.InvalidArgument, match="elastic"):
        dpsync.Context(host_replicas=2, elastic=-1)


def test_closed_context_world_epoch():
    ctx = dpsync.Context(host_replicas=1)
    ctx.close()
    with pytest.raises(dpsync.InvalidState):
        ctx.world_epoch
    with pytest.raises(dpsync.InvalidState):
        ctx.leave()


@pytest.mark.parametrize(
    "message, ranks",
    [
        ("dpsync_allreduce_grads: rank 2 was lost (its process ended); 3 ranks remain", (2,)),
        ("dpsync_broadcast on rank 0: ranks 1, 3 were lost", (1, 3)),
        ("lost ranks 1 and 4 of 6 at dpsync_bmuf_step", (1, 4)),
        ("ranks 0, 2 and 5 lost; the world goes on with 3", (0, 2, 5)),
        ("rank 3 of 4: lost rank 1", (1,)),
        ("the world changed", ()),
    ],
)
def test_rank_lost_parses_the_ranks(message, ranks):
    e = dpsync.RankLost(message, "dpsync_allreduce_grads")
    assert e.ranks == ranks
    assert (e.status, e.code, e.message) == ("RANK_LOST", 10, message)
    assert isinstance(e, dpsync.Error)


def test_rank_lost_is_the_exception_for_status_10():
    from dpsync._errors import BY_CODE, error_for

    assert BY_CODE[10] is dpsync.RankLost
    e = error_for(10, "dpsync_allreduce: ranks 2, 3 were lost", "dpsync_allreduce")
    assert type(e) is dpsync.RankLost and e.ranks == (2, 3)
    assert dpsync.library().dpsync_status_name(10) == b"DPSYNC_STATUS_RANK_LOST"
    assert "RankLost" in dpsync.__all__ and dpsync.RankLost.__module__ == "dpsync"


def test_two_ranks_one_leaves():
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
