"""One rank of tests/test_world_leave.py (started by mpirun, 2 ranks; DPSYNC_LIBRARY is the MPI
build). Rank 0 has 2 host replicas, rank 1 has 1. Rank 1 leaves (its data ran out): rank 0's
allreduce_grads completes over its own 2 replicas, and its world is renumbered and recounted.
Then elastic=1 is UNAVAILABLE on both ranks (this build makes no elastic worlds). Prints
"rank R: ok" at the end; any failed check raises and the rank exits non-zero."""

import numpy as np
from mpi4py import MPI

import dpsync

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
assert comm.Get_size() == 2, "run with mpirun -n 2"
local = 2 if rank == 0 else 1

with dpsync.Context(host_replicas=local, world_mpi=comm, timeout_ms=60000) as ctx:
    assert ctx.world_epoch == (0, rank), ctx.world_epoch
    # World replica w holds w + 1 (1 and 2 on rank 0, 3 on rank 1).
    g = [np.full(5, float(2 * rank + r + 1), np.float32) for r in range(local)]
    for r in range(local):
        ctx.register("g", g[r], "grad", r)
    if rank == 1:
        ctx.leave()
        assert ctx.world_epoch == (1, 1), ctx.world_epoch
        try:
            ctx.allreduce_grads("sum")
        except dpsync.InvalidState as e:
            assert e.function == "dpsync_allreduce_grads", e
        else:
            raise AssertionError("a rank that left refuses collectives")
        assert ctx.rank == 1, "queries still answer"
    else:
        ctx.allreduce_grads("sum")
        assert all((a == 3).all() for a in g), g  # 1 + 2: rank 0's replicas only
        assert (ctx.rank, ctx.ranks) == (0, 1), (ctx.rank, ctx.ranks)
        assert ctx.world_replicas == (2, 0), ctx.world_replicas
        assert ctx.loss_scale == 0.5, ctx.loss_scale
        assert ctx.world_epoch == (1, 0), ctx.world_epoch
        world = ctx.describe()["world"]
        assert world["epoch"] == 1 and world["left"] == [1], world
        # The world of one rank goes on.
        g[0][:], g[1][:] = 1, 5
        ctx.allreduce_grads("avg")
        assert all((a == 3).all() for a in g), g

# An elastic world: every rank gets UNAVAILABLE (no ULFM in this MPI, or no recovery yet).
try:
    dpsync.Context(host_replicas=local, world_mpi=comm, timeout_ms=60000, elastic=1)
except dpsync.Unavailable as e:
    assert e.code == 6 and "elastic" in e.message, e
else:
    raise AssertionError("an elastic world is UNAVAILABLE in this build")

print("rank %d: ok" % rank, flush=True)
