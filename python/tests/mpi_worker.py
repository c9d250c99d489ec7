"""One rank of tests/test_world_mpi.py (started by mpirun, 2 ranks; DPSYNC_LIBRARY is the MPI
build). Rank 0 has 2 host replicas, rank 1 has 1: world replicas 0, 1 on rank 0 and 2 on rank 1.
Prints "rank R: ok" at the end; any failed check raises and the rank exits non-zero."""

import time

import numpy as np
from mpi4py import MPI

import dpsync

comm = MPI.COMM_WORLD
rank = comm.Get_rank()
assert comm.Get_size() == 2, "run with mpirun -n 2"
local = 2 if rank == 0 else 1
offset = 0 if rank == 0 else 2

with dpsync.Context(host_replicas=local, world_mpi=comm, timeout_ms=60000) as ctx:
    assert (ctx.rank, ctx.ranks) == (rank, 2), (ctx.rank, ctx.ranks)
    assert ctx.world_replicas == (3, offset), ctx.world_replicas
    assert ctx.loss_scale == 1.0 / 3
    d = ctx.describe()
    assert d["world"]["engine"] == "mpi" and d["world"]["ranks"] == 2, d["world"]

    # World replica w holds w + 1: the sum is 6, the mean 2.
    g = [np.full(5, float(offset + r + 1), np.float32) for r in range(local)]
    p = [np.full(3, float(10 * (offset + r)), np.float64) for r in range(local)]
    for r in range(local):
        ctx.register("g", g[r], "grad", r)
        ctx.register("p", p[r], "param", r)
    ctx.allreduce_grads("sum")
    assert all((a == 6).all() for a in g), g
    for r in range(local):
        g[r][:] = offset + r + 1
    ctx.allreduce("g", "avg")
    assert all((a == 2).all() for a in g), g
    ctx.broadcast("param", root=2)  # rank 1's replica 0
    assert all((a == 20).all() for a in p), p

    # The ranks disagree on a tensor: INCONSISTENT on both, nothing changed.
    bad = [np.ones(4 if rank == 0 else 5, np.float32) for _ in range(local)]
    for r in range(local):
        ctx.register("bad", bad[r], "computed", r)
    try:
        ctx.average("computed")
    except dpsync.Inconsistent as e:
        assert "'bad'" in e.message, e.message
    else:
        raise AssertionError("ranks with different counts must fail")
    assert all((a == 1).all() for a in bad)
    ctx.unregister("bad")

# world_mpi=True: NULL, MPI_COMM_WORLD (MPI is already initialised by mpi4py).
with dpsync.Context(host_replicas=1, world_mpi=True) as ctx:
    x = np.array([rank + 1], np.int64)
    ctx.register("x", x, "state", 0)
    ctx.allreduce("x", "sum")
    assert x[0] == 3, x

# A rank that does not come: rank 0 times out, naming the collective; rank 1 arrives late.
with dpsync.Context(host_replicas=1, world_mpi=comm, timeout_ms=2000) as ctx:
    y = np.ones(8, np.float32)
    ctx.register("y", y, "state", 0)
    if rank == 1:
        time.sleep(6)
        try:
            # A small allreduce may still complete against the exchange rank 0 abandoned (its
            # data rides in the agreement rank 0 had sent); the next call then fails.
            ctx.allreduce("y", "sum")
            ctx.allreduce("y", "sum")
        except (dpsync.Timeout, dpsync.InvalidState):
            pass
        else:
            raise AssertionError("the late rank's collectives must fail")
    else:
        start = time.monotonic()
        try:
            ctx.allreduce("y", "sum")
        except dpsync.Timeout as e:
            assert e.status == "TIMEOUT" and "dpsync_allreduce" in e.message, e
        else:
            raise AssertionError("a missing rank must give TIMEOUT")
        assert time.monotonic() - start < 10
        assert (y == 1).all(), "nothing changed"
        try:
            ctx.allreduce("y", "sum")
        except dpsync.InvalidState:
            pass
        else:
            raise AssertionError("the context refuses collectives after a TIMEOUT")

print("rank %d: ok" % rank, flush=True)
