"""Collectives on host replicas through the package, every dtype, values exact (docs/API.md,
"Exact arithmetic")."""

import pytest

import dpsync

from conftest import bf16_backends, np, rng

N = 3


def float_sum(per_replica, dtype, accumulate):
    """((r0 + r1) + r2) in `accumulate`, rounded to `dtype` once at the end."""
    s = per_replica[0].astype(accumulate)
    for a in per_replica[1:]:
        s = (s + a.astype(accumulate)).astype(accumulate)
    return s


def reference(per_replica, dtype, op):
    if dtype in ("float32", "float64"):
        s = float_sum(per_replica, dtype, dtype)
        return (s / np.array(N, dtype)).astype(dtype) if op == "avg" else s
    if dtype == "float16":
        s = float_sum(per_replica, dtype, np.float32)
        return ((s / np.float32(N)) if op == "avg" else s).astype(np.float16)
    wide = sum(int(a) for a in per_replica)
    bits = 32 if dtype == "int32" else 64
    if op == "avg":
        q = abs(wide) // N
        return q if wide >= 0 else -q
    return (wide + (1 << (bits - 1))) % (1 << bits) - (1 << (bits - 1))  # two's complement wrap


def make(dtype, seed):
    g = rng(seed)
    if dtype.startswith("float"):
        return [g.uniform(-100, 100, 37).astype(dtype) for _ in range(N)]
    info = np.iinfo(dtype)
    return [g.integers(info.min // 2, info.max // 2, 37, dtype=dtype, endpoint=True) for _ in range(N)]


@pytest.mark.parametrize("op", ["sum", "avg"])
@pytest.mark.parametrize("dtype", ["float32", "float64", "float16", "int32", "int64"])
def test_allreduce_grads_every_numpy_dtype(dtype, op):
    arrays = make(dtype, 1)
    inputs = [a.copy() for a in arrays]
    with dpsync.Context(host_replicas=N) as ctx:
        for r, a in enumerate(arrays):
            ctx.register("g", a, "grad", r)
        assert ctx.describe()["buckets"][0]["dtype"] == {"float32": "f32", "float64": "f64", "float16": "f16",
                                                          "int32": "i32", "int64": "i64"}[dtype]
        ctx.allreduce_grads(op)
    if dtype.startswith("int"):
        want = np.array([reference([a[i] for a in inputs], dtype, op) for i in range(37)], dtype=dtype)
    else:
        want = reference(inputs, dtype, op)
    for a in arrays:
        assert a.tobytes() == want.tobytes()


@pytest.mark.parametrize("backend", ["ml_dtypes", "torch"])
@pytest.mark.parametrize("op", ["sum", "avg"])
def test_bfloat16(backend, op):
    if backend not in bf16_backends():
        pytest.skip("%s is not installed: no bfloat16 arrays from it" % backend)
    g = rng(2)
    values = [g.uniform(-10, 10, 19).astype(np.float32) for _ in range(N)]
    if backend == "ml_dtypes":
        import ml_dtypes

        arrays = [v.astype(ml_dtypes.bfloat16) for v in values]
        as_f32 = [a.astype(np.float32) for a in arrays]
        to_bf16 = lambda x: x.astype(ml_dtypes.bfloat16).astype(np.float32)  # noqa: E731
        read = lambda a: a.astype(np.float32)  # noqa: E731
    else:
        import torch

        arrays = [torch.from_numpy(v).to(torch.bfloat16) for v in values]
        as_f32 = [a.float().numpy() for a in arrays]
        to_bf16 = lambda x: torch.from_numpy(x).to(torch.bfloat16).float().numpy()  # noqa: E731
        read = lambda a: a.float().numpy()  # noqa: E731
    s = float_sum(as_f32, np.float32, np.float32)
    want = to_bf16(s / np.float32(N) if op == "avg" else s)
    with dpsync.Context(host_replicas=N) as ctx:
        for r, a in enumerate(arrays):
            ctx.register("g", a, "grad", r)
        assert ctx.describe()["buckets"][0]["dtype"] == "bf16"
        ctx.allreduce_grads(op)
    for a in arrays:
        assert np.array_equal(read(a), want)


def test_allreduce_one_tensor_leaves_others(ctx4):
    a = [np.full(5, r + 1, np.float64) for r in range(4)]
    b = [np.full(5, 10 * (r + 1), np.float64) for r in range(4)]
    for r in range(4):
        ctx4.register("a", a[r], "computed", r)
        ctx4.register("b", b[r], "grad", r)
    ctx4.allreduce("a", "sum")
    assert all((x == 10).all() for x in a)
    assert [x[0] for x in b] == [10, 20, 30, 40]
    for r in range(4):
        a[r][:] = r
    ctx4.allreduce("a", op="avg")
    assert all((x == 1.5).all() for x in a)


def test_broadcast_roles_and_root(ctx4):
    p = [np.full(3, r, np.float32) for r in range(4)]
    s = [np.full(2, 10 + r, np.int64) for r in range(4)]
    c = [np.full(2, 20 + r, np.float32) for r in range(4)]
    for r in range(4):
        ctx4.register("p", p[r], "param", r)
        ctx4.register("s", s[r], "state", r)
        ctx4.register("c", c[r], "computed", r)
    ctx4.broadcast(roles=("param", "state"), root=2)
    assert all((x == 2).all() for x in p)
    assert all((x == 12).all() for x in s)
    assert [x[0] for x in c] == [20, 21, 22, 23]  # not in the mask
    ctx4.broadcast("computed")  # a single role, root 0
    assert all((x == 20).all() for x in c)


def test_average(ctx4):
    c = [np.full(4, float(r), np.float32) for r in range(4)]
    for r in range(4):
        ctx4.register("bn.running_mean", c[r], "computed", r)
    ctx4.average(roles=["computed"])
    assert all((x == 1.5).all() for x in c)


def test_unknown_role_and_op_are_refused(ctx4):
    a = np.zeros(2, np.float32)
    with pytest.raises(dpsync.InvalidArgument, match="role"):
        ctx4.register("a", a, "weights", 0)
    with pytest.raises(dpsync.InvalidArgument, match="op"):
        ctx4.allreduce_grads("max")
    with pytest.raises(dpsync.InvalidArgument, match="roles is empty"):
        ctx4.broadcast(roles=())
    assert ctx4.registered() == {}


def test_unregister_removes_from_every_replica(ctx4):
    g = [np.ones(2, np.float32) for _ in range(4)]
    for r in range(4):
        ctx4.register("g", g[r], "grad", r)
    ctx4.unregister("g")
    assert ctx4.describe()["tensors"] == 0
    assert ctx4.registered() == {}
    with pytest.raises(dpsync.NotFound):
        ctx4.unregister("g")
    ctx4.allreduce_grads()  # nothing to reduce: OK
    assert all((x == 1).all() for x in g)


def test_pre_allreduce_grads_hook_runs_first_and_can_be_removed(ctx4):
    g = [np.ones(2, np.float32) for _ in range(4)]
    for r in range(4):
        ctx4.register("g", g[r], "grad", r)
    seen = []

    def hook():
        seen.append(g[0][0])  # before the reduction
        g[1][:] = 5

    handle = ctx4.add_pre_allreduce_grads_hook(hook)
    ctx4.allreduce_grads()
    assert seen == [1] and (g[0] == 8).all()
    handle.remove()
    ctx4.allreduce_grads()
    assert len(seen) == 1 and (g[0] == 32).all()
