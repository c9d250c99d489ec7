"""Reproducible sums through the package: Context(..., reproducible=True) gives the same bytes
whatever replica holds which contribution, where plain sums of the same data differ."""

import dpsync

from conftest import rng

N = 6


def contributions():
    g = rng(7)
    # Magnitudes over 40 binades, both signs: plain float sums depend on the order.
    scale = 2.0 ** g.integers(-20, 20, (N, 999))
    return [(g.uniform(-1, 1, 999) * scale[r]).astype("float32") for r in range(N)]


def allreduce(order, reproducible):
    data = contributions()
    arrays = [data[c].copy() for c in order]
    with dpsync.Context(host_replicas=N, reproducible=reproducible) as ctx:
        for r, a in enumerate(arrays):
            ctx.register("g", a, "grad", r)
        ctx.allreduce_grads("avg")
        if reproducible:
            assert ctx.describe()["reproducible"] is True
    assert all(a.tobytes() == arrays[0].tobytes() for a in arrays)
    return arrays[0].tobytes()


def test_reproducible_sums_ignore_the_arrangement():
    orders = [list(range(N)), list(reversed(range(N))), [3, 1, 5, 0, 2, 4]]
    assert len({allreduce(o, True) for o in orders}) == 1
    assert len({allreduce(o, False) for o in orders}) > 1, "plain sums of this data depend on the order"


def test_plan_describe_shows_the_option():
    assert dpsync.plan_describe(host_replicas=2, reproducible=True)["reproducible"] is True
    assert dpsync.plan_describe(host_replicas=2)["reproducible"] is False
