"""The context keeps registered arrays (and sparse slices) alive: the caller may drop its own
references and the memory stays valid; unregister and close let it go."""

import gc
import weakref

import dpsync

from conftest import np


def register_temporaries(ctx, n=4, size=1000):
    """Registers arrays the caller keeps no reference to; returns weak references to them."""
    refs = []
    for r in range(n):
        a = np.full(size, float(r + 1), np.float64)
        refs.append(weakref.ref(a))
        ctx.register("g", a, "grad", r)
    return refs


def test_dropped_arrays_stay_valid_and_still_sync(ctx4):
    refs = register_temporaries(ctx4)
    gc.collect()
    # Other allocations of the same size would reuse the memory if it had been freed.
    decoys = [np.full(1000, -7.0) for _ in range(16)]
    assert all(ref() is not None for ref in refs), "the context keeps the arrays"
    ctx4.allreduce_grads("sum")
    for r in range(4):
        assert (refs[r]() == 10.0).all()
        assert ctx4.registered()["g"][r] is refs[r]()
    assert all((d == -7.0).all() for d in decoys)


def test_unregister_releases(ctx4):
    refs = register_temporaries(ctx4)
    ctx4.unregister("g")
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_close_releases():
    ctx = dpsync.Context(host_replicas=4)
    refs = register_temporaries(ctx)
    ctx.close()
    gc.collect()
    assert all(ref() is None for ref in refs)


def test_reregistering_identically_keeps_one_reference(ctx4):
    a = np.ones(8, np.float32)
    ctx4.register("p", a, "param", 0)
    view = a[:]
    ctx4.register("p", view, "param", 0)  # the same memory: a no-op in the library
    assert ctx4.registered()["p"][0] is view
    ref = weakref.ref(a)
    del a, view
    gc.collect()
    assert ref() is not None, "the view kept by the context holds its base"


def test_sparse_slices_are_kept_until_the_step(ctx4):
    for r in range(4):
        ctx4.register_sparse("emb", r, 2, "float32", "int64", 100)
    refs = []
    for r in range(4):
        idx = np.array([r], np.int64)
        val = np.full(2, float(r), np.float32)
        refs.append((weakref.ref(idx), weakref.ref(val)))
        ctx4.sparse_set("emb", r, idx, val)
    del idx, val
    gc.collect()
    assert all(i() is not None and v() is not None for i, v in refs)
    ctx4.allreduce_grads()
    gc.collect()
    assert all(i() is None and v() is None for i, v in refs), "released once the step has read them"
    indices, values = ctx4.sparse_get("emb", 2)
    assert indices.tolist() == [0, 1, 2, 3]
    assert values.tolist() == [[0, 0], [1, 1], [2, 2], [3, 3]]


def test_a_failed_step_keeps_the_slices(ctx4):
    for r in range(4):
        ctx4.register_sparse("emb", r, 1, "float32", "int64", 10)
    idx = np.array([11], np.int64)  # out of range: the step fails
    ref = weakref.ref(idx)
    for r in range(4):
        ctx4.sparse_set("emb", r, idx, np.zeros(1, np.float32))
    del idx
    try:
        ctx4.allreduce_grads()
    except dpsync.Inconsistent as e:
        assert "index 11" in e.message
    else:
        raise AssertionError("an index out of range must fail the step")
    gc.collect()
    assert ref() is not None, "a failed step consumes no slice: they stay set"
