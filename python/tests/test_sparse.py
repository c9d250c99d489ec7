"""Sparse gradients: register_sparse, sparse_set, sparse_get (docs/API.md, "Sparse gradients")."""

import pytest

import dpsync

from conftest import np


def set_rows(ctx, name, n, row_len, value_dtype=np.float32, index_dtype=np.int64):
    """Replica r sets r rows: indices 10r + k, values 100r + j."""
    for r in range(n):
        idx = np.array([10 * r + k for k in range(r)], index_dtype)
        val = (np.arange(r * row_len).reshape(r, row_len) + 100 * r).astype(value_dtype)
        ctx.sparse_set(name, r, idx, val)


@pytest.mark.parametrize("index_dtype", ["int32", "int64"])
@pytest.mark.parametrize("value_dtype", ["float32", "float64", "float16"])
def test_gather_in_world_order(ctx4, value_dtype, index_dtype):
    for r in range(4):
        ctx4.register_sparse("emb", r, 3, value_dtype=value_dtype, index_dtype=index_dtype, num_embeddings=100)
    set_rows(ctx4, "emb", 4, 3, np.dtype(value_dtype), np.dtype(index_dtype))
    ctx4.allreduce_grads("sum")
    want_idx = [10 * r + k for r in range(4) for k in range(r)]
    want_val = np.concatenate([np.arange(r * 3).reshape(r, 3) + 100 * r for r in range(4)])
    for r in range(4):
        idx, val = ctx4.sparse_get("emb", r)
        assert idx.dtype == np.dtype(index_dtype) and val.dtype == np.dtype(value_dtype)
        assert idx.tolist() == want_idx
        assert val.shape == (6, 3) and np.array_equal(val, want_val.astype(value_dtype))


def test_avg_divides_and_coalesce_merges():
    with dpsync.Context(host_replicas=2, sparse_coalesce=True) as ctx:
        for r in range(2):
            ctx.register_sparse("emb", r, 1, np.float32, np.int64)
        ctx.sparse_set("emb", 0, np.array([5, 1], np.int64), np.array([1.0, 2.0], np.float32))
        ctx.sparse_set("emb", 1, np.array([1], np.int64), np.array([4.0], np.float32))
        ctx.allreduce_grads("avg")
        idx, val = ctx.sparse_get("emb", 1)
        assert idx.tolist() == [1, 5]
        assert val.ravel().tolist() == [3.0, 0.5]


def test_zero_rows_everywhere(ctx4):
    for r in range(4):
        ctx4.register_sparse("emb", r, 4)
        ctx4.sparse_set("emb", r, np.zeros(0, np.int64), np.zeros((0, 4), np.float32))
    ctx4.allreduce_grads()
    idx, val = ctx4.sparse_get("emb", 0)
    assert idx.shape == (0,) and val.shape == (0, 4)


def test_slices_are_consumed_by_the_step(ctx4):
    for r in range(4):
        ctx4.register_sparse("emb", r, 2)
    set_rows(ctx4, "emb", 4, 2)
    ctx4.allreduce_grads()
    with pytest.raises(dpsync.Inconsistent, match="'emb'"):
        ctx4.allreduce_grads()


def test_sparse_get_before_the_step_is_invalid_state(ctx4):
    for r in range(4):
        ctx4.register_sparse("emb", r, 2)
    with pytest.raises(dpsync.InvalidState):
        ctx4.sparse_get("emb", 0)


def test_wrongly_typed_slices_are_refused(ctx4):
    for r in range(4):
        ctx4.register_sparse("emb", r, 2, "float32", "int64")
    idx = np.array([1, 2], np.int64)
    with pytest.raises(dpsync.InvalidArgument, match="indices are int32, registered as int64"):
        ctx4.sparse_set("emb", 0, idx.astype(np.int32), np.zeros((2, 2), np.float32))
    with pytest.raises(dpsync.InvalidArgument, match="values are float64, registered as float32"):
        ctx4.sparse_set("emb", 0, idx, np.zeros((2, 2), np.float64))
    with pytest.raises(dpsync.InvalidArgument, match="values hold 3 elements, 2 rows x row_len 2 need 4"):
        ctx4.sparse_set("emb", 0, idx, np.zeros(3, np.float32))
    with pytest.raises(dpsync.InvalidArgument, match="not C-contiguous"):
        ctx4.sparse_set("emb", 0, idx, np.zeros((2, 4), np.float32)[:, :2])
    # Nothing was set: the step names the missing slice on replica 0.
    with pytest.raises(dpsync.Inconsistent, match="replica 0"):
        ctx4.allreduce_grads()


def test_read_only_slices_are_accepted(ctx4):
    for r in range(4):
        ctx4.register_sparse("emb", r, 1)
    for r in range(4):
        idx, val = np.array([r], np.int64), np.array([float(r)], np.float32)
        idx.setflags(write=False)
        val.setflags(write=False)
        ctx4.sparse_set("emb", r, idx, val)
    ctx4.allreduce_grads()
    assert ctx4.sparse_get("emb", 3)[0].tolist() == [0, 1, 2, 3]


def test_bad_registrations(ctx4):
    with pytest.raises(dpsync.InvalidArgument, match="value_dtype"):
        ctx4.register_sparse("emb", 0, 2, value_dtype="complex64")
    with pytest.raises(dpsync.InvalidArgument) as e:  # the library: indices must be integers
        ctx4.register_sparse("emb", 0, 2, index_dtype="float32")
    assert e.value.function == "dpsync_register_sparse"
    ctx4.register_sparse("emb", 0, 2)
    with pytest.raises(dpsync.Conflict):
        ctx4.register_sparse("emb", 0, 3)
    with pytest.raises(dpsync.NotFound):
        ctx4.sparse_set("nothing", 0, np.zeros(0, np.int64), np.zeros(0, np.float32))


def test_unregister_sparse(ctx4):
    for r in range(4):
        ctx4.register_sparse("emb", r, 2)
    ctx4.unregister("emb")
    ctx4.allreduce_grads()  # no slice is required any more


def test_torch_values_come_back_as_torch(ctx4):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    for r in range(4):
        ctx4.register_sparse("emb", r, 2, torch.bfloat16, torch.int64)
    for r in range(4):
        ctx4.sparse_set("emb", r, torch.tensor([r]), torch.full((1, 2), r + 0.5, dtype=torch.bfloat16))
    ctx4.allreduce_grads()
    idx, val = ctx4.sparse_get("emb", 1)
    assert isinstance(idx, torch.Tensor) and isinstance(val, torch.Tensor)
    assert val.dtype == torch.bfloat16 and val.shape == (4, 2)
    assert idx.tolist() == [0, 1, 2, 3] and val[:, 0].float().tolist() == [0.5, 1.5, 2.5, 3.5]
