"""Shards (ZeRO stage 1) through the package: shard, reduce_scatter_grads, allgather on host
replicas; values exact (the reduce-scatter sums each element as allreduce_grads does)."""

import pytest

import dpsync

from conftest import np, rng

N = 4
# name -> (count, dtype, role). Counts below N give empty pieces; fusion_bytes=64 (ctx4) puts
# the gradients in several buckets, some holding more than one tensor.
TENSORS = {
    "w": (37, "float32", "param"),
    "w:grad": (37, "float32", "grad"),
    "b": (3, "float64", "param"),
    "b:grad": (3, "float64", "grad"),
    "n:grad": (10, "int64", "grad"),
    "h:grad": (13, "float16", "grad"),
    "stat": (5, "float32", "computed"),
}


def piece(count, w, total=N):
    first = count * w // total
    return first, count * (w + 1) // total - first


def make(seed):
    g = rng(seed)
    out = {}
    for name, (count, dtype, _) in TENSORS.items():
        if dtype.startswith("int"):
            out[name] = [g.integers(-1000, 1000, count).astype(dtype) for _ in range(N)]
        else:
            out[name] = [g.uniform(-100, 100, count).astype(dtype) for _ in range(N)]
    return out


def register(ctx, arrays):
    for name, (_, _, role) in TENSORS.items():
        for r, a in enumerate(arrays[name]):
            ctx.register(name, a, role, r)


def copies(arrays):
    return {name: [a.copy() for a in per_replica] for name, per_replica in arrays.items()}


def test_shard_pieces(ctx4):
    register(ctx4, make(0))
    for name, (count, _, _) in TENSORS.items():
        pieces = [ctx4.shard(name, r) for r in range(N)]
        assert pieces == [piece(count, r) for r in range(N)], name
        assert sum(n for _, n in pieces) == count
    assert ctx4.shard("b", 0) == (0, 0), "3 elements among 4 replicas: replica 0's piece is empty"
    assert ctx4.shard("w", 3) == (27, 10)
    assert ctx4.shard("w", 3) == ctx4.shard("w:grad", 3), "a parameter and its gradient are cut alike"


@pytest.mark.parametrize("op", ["sum", "avg"])
def test_reduce_scatter_grads_owned_pieces_only(op):
    arrays = make(1)
    inputs = copies(arrays)
    whole = copies(arrays)
    with dpsync.Context(host_replicas=N, fusion_bytes=64) as ref:
        register(ref, whole)
        ref.allreduce_grads(op)
    with dpsync.Context(host_replicas=N, fusion_bytes=64) as ctx:
        register(ctx, arrays)
        ctx.reduce_scatter_grads(op)
    for name, (count, _, role) in TENSORS.items():
        for r in range(N):
            got, before = arrays[name][r], inputs[name][r]
            if role != "grad":
                assert got.tobytes() == before.tobytes(), "%s (%s) was touched" % (name, role)
                continue
            first, n = piece(count, r)
            owned = slice(first, first + n)
            # Byte for byte what allreduce_grads gives in the owned piece, the input elsewhere.
            assert got[owned].tobytes() == whole[name][r][owned].tobytes(), (name, r)
            assert got[:first].tobytes() == before[:first].tobytes(), (name, r, "before the piece")
            assert got[first + n:].tobytes() == before[first + n:].tobytes(), (name, r, "after the piece")


def test_reduce_scatter_then_allgather_is_allreduce(ctx4):
    arrays = make(2)
    whole = copies(arrays)
    with dpsync.Context(host_replicas=N, fusion_bytes=64) as ref:
        register(ref, whole)
        ref.allreduce_grads("sum")
    register(ctx4, arrays)
    ctx4.reduce_scatter_grads()  # "sum" by default, as allreduce_grads
    ctx4.allgather("grad")
    for name, (_, _, role) in TENSORS.items():
        if role == "grad":
            for r in range(N):
                assert arrays[name][r].tobytes() == whole[name][r].tobytes(), (name, r)


def test_reduce_scatter_runs_the_pre_step_hooks(ctx4):
    register(ctx4, make(3))
    calls = []
    ctx4.add_pre_allreduce_grads_hook(lambda: calls.append(1))
    ctx4.reduce_scatter_grads("avg")
    assert calls == [1]


def gathered(per_replica, count):
    """Every world replica's own piece, in order."""
    parts = []
    for w in range(N):
        first, n = piece(count, w)
        parts.append(per_replica[w][first:first + n])
    return np.concatenate(parts)


def test_allgather_the_owners_pieces(ctx4):
    arrays = make(4)
    inputs = copies(arrays)
    register(ctx4, arrays)
    ctx4.allgather("param")
    for name, (count, _, role) in TENSORS.items():
        if role != "param":
            for r in range(N):
                assert arrays[name][r].tobytes() == inputs[name][r].tobytes(), "%s (%s) was touched" % (name, role)
            continue
        want = gathered(inputs[name], count)
        for r in range(N):
            assert arrays[name][r].tobytes() == want.tobytes(), (name, r)


def test_allgather_several_roles(ctx4):
    arrays = make(5)
    inputs = copies(arrays)
    register(ctx4, arrays)
    ctx4.allgather(["param", "computed"])
    for name in ("w", "stat"):
        count = TENSORS[name][0]
        want = gathered(inputs[name], count)
        assert all(a.tobytes() == want.tobytes() for a in arrays[name]), name
    assert arrays["w:grad"][1].tobytes() == inputs["w:grad"][1].tobytes()


def snapshot(arrays):
    return {name: [a.tobytes() for a in per_replica] for name, per_replica in arrays.items()}


def test_bad_input(ctx4):
    arrays = make(6)
    register(ctx4, arrays)
    before = snapshot(arrays)
    with pytest.raises(dpsync.NotFound, match="no_such") as e:
        ctx4.shard("no_such", 0)
    assert e.value.function == "dpsync_shard" and e.value.status == "NOT_FOUND"
    with pytest.raises(dpsync.InvalidArgument, match="replica 4") as e:
        ctx4.shard("w", N)
    assert e.value.function == "dpsync_shard", "the library's own check"
    with pytest.raises(dpsync.InvalidArgument, match="replica is -1"):
        ctx4.shard("w", -1)
    with pytest.raises(dpsync.InvalidArgument, match="a name must be a str"):
        ctx4.shard(b"w", 0)
    with pytest.raises(dpsync.InvalidArgument, match="op is 'max'"):
        ctx4.reduce_scatter_grads("max")
    with pytest.raises(dpsync.InvalidArgument, match="roles is empty"):
        ctx4.allgather([])
    with pytest.raises(dpsync.InvalidArgument, match="role is 'weights'"):
        ctx4.allgather("weights")
    # The library refuses roles 0 and codes outside the four roles itself.
    lib = dpsync.library()
    assert lib.dpsync_allgather(ctx4.handle, 0) == dpsync.InvalidArgument.code
    assert lib.dpsync_allgather(ctx4.handle, 16) == dpsync.InvalidArgument.code
    assert lib.dpsync_reduce_scatter_grads(ctx4.handle, 2) == dpsync.InvalidArgument.code
    assert snapshot(arrays) == before, "a failed call changes nothing"


def test_inconsistent_counts_change_nothing(ctx4):
    arrays = make(7)
    register(ctx4, arrays)
    odd = [np.zeros(4 if r == 2 else 3, np.float32) for r in range(N)]
    for r, a in enumerate(odd):
        ctx4.register("odd:grad", a, "grad", r)
    before = snapshot(arrays)
    with pytest.raises(dpsync.Inconsistent, match="odd:grad"):
        ctx4.reduce_scatter_grads()
    with pytest.raises(dpsync.Inconsistent, match="odd:grad"):
        ctx4.allgather("grad")
    assert snapshot(arrays) == before


def test_closed_context():
    ctx = dpsync.Context(host_replicas=2)
    ctx.close()
    with pytest.raises(dpsync.InvalidState, match="closed"):
        ctx.shard("w", 0)
    with pytest.raises(dpsync.InvalidState, match="closed"):
        ctx.reduce_scatter_grads()
    with pytest.raises(dpsync.InvalidState, match="closed"):
        ctx.allgather("param")
