"""One exception class per status, provoked through the API where the API can; a failed call
changes nothing."""

import pytest

import dpsync
from dpsync import _errors

from conftest import np

CLASSES = {
    "INVALID_ARGUMENT": dpsync.InvalidArgument,
    "NOT_FOUND": dpsync.NotFound,
    "CONFLICT": dpsync.Conflict,
    "INCONSISTENT": dpsync.Inconsistent,
    "INVALID_STATE": dpsync.InvalidState,
    "UNAVAILABLE": dpsync.Unavailable,
    "BACKEND_ERROR": dpsync.BackendError,
    "TIMEOUT": dpsync.Timeout,
    "PANIC": dpsync.Panic,
    "RANK_LOST": dpsync.RankLost,
}


def test_every_status_code_has_its_class():
    # The classes of the statuses this API cannot provoke on host replicas (BACKEND_ERROR: a
    # failing CUDA/NCCL/MPI call; PANIC: an internal defect) are checked here only. TIMEOUT is
    # provoked across two ranks by test_world_mpi.py; RANK_LOST needs an elastic world, which
    # this build does not make (test_world_leave.py checks its class's parsing).
    lib = dpsync.library()
    for code in range(1, 11):
        c_name = lib.dpsync_status_name(code).decode()
        cls = _errors.BY_CODE[code]
        assert c_name == "DPSYNC_STATUS_" + cls.status, (code, c_name, cls)
        assert CLASSES[cls.status] is cls
        e = _errors.error_for(code, "msg", "dpsync_x")
        assert type(e) is cls and e.code == code and isinstance(e, dpsync.Error)
    assert lib.dpsync_status_name(11).decode() == "UNKNOWN", "a new status needs a class"
    unknown = _errors.error_for(42, "msg")
    assert type(unknown) is dpsync.Error and unknown.code == 42


def snapshot(arrays):
    return [a.tobytes() for a in arrays]


def test_invalid_argument_carries_the_library_message(ctx4):
    a = np.zeros(3, np.float32)
    with pytest.raises(dpsync.InvalidArgument) as e:
        ctx4.register("w", a, "param", 7)
    err = e.value
    assert err.status == "INVALID_ARGUMENT" and err.code == 1
    assert err.function == "dpsync_register"
    assert "replica" in err.message and "7" in err.message
    assert str(err).startswith("dpsync_register: INVALID_ARGUMENT: ")
    assert isinstance(err, ValueError)
    assert ctx4.describe()["tensors"] == 0


def test_not_found(ctx4):
    with pytest.raises(dpsync.NotFound, match="no_such") as e:
        ctx4.allreduce("no_such", "sum")
    assert e.value.status == "NOT_FOUND"
    with pytest.raises(dpsync.NotFound):
        ctx4.grad_ready("no_such", 0)


def test_conflict_keeps_the_first_registration(ctx4):
    a, b = np.ones(3, np.float32), np.ones(3, np.float32)
    ctx4.register("w", a, "param", 0)
    ctx4.register("w", a, "param", 0)  # identical: a no-op
    with pytest.raises(dpsync.Conflict, match="'w'"):
        ctx4.register("w", b, "param", 0)
    with pytest.raises(dpsync.Conflict):
        ctx4.register("w", a, "grad", 0)
    assert ctx4.registered()["w"][0] is a


def test_inconsistent_changes_nothing(ctx4):
    arrays = [np.full(3 if r < 3 else 4, float(r), np.float32) for r in range(4)]
    for r, a in enumerate(arrays):
        ctx4.register("g", a, "grad", r)
    before = snapshot(arrays)
    with pytest.raises(dpsync.Inconsistent) as e:
        ctx4.allreduce_grads()
    assert "'g'" in e.value.message and "replica" in e.value.message
    assert snapshot(arrays) == before
    ctx4.unregister("g")
    ctx4.allreduce_grads()  # the context stays usable


def test_invalid_state(ctx4):
    with pytest.raises(dpsync.InvalidState) as e:
        ctx4.bmuf_step()
    assert e.value.function == "dpsync_bmuf_step"
    with pytest.raises(dpsync.InvalidState):
        ctx4.bmuf_init()  # no PARAM registered


def test_unavailable_world_mpi_without_mpi_build():
    try:
        ctx = dpsync.Context(host_replicas=1, world_mpi=True)
    except dpsync.Unavailable as e:
        assert e.function == "dpsync_options_set_world_mpi"
        assert "MPI" in e.message
    else:
        ctx.close()
        pytest.skip("this library (%s) is built with MPI" % dpsync.library_path())


def test_unavailable_cuda_without_driver():
    try:
        ctx = dpsync.Context(cuda_replicas=[0, 0])
    except dpsync.Unavailable as e:
        assert e.function == "dpsync_context_create"
        assert "libcuda" in e.message or "device" in e.message
    else:
        ctx.close()
        pytest.skip("a CUDA driver and device are present: no UNAVAILABLE to provoke")


def test_world_mpi_refuses_other_objects():
    with pytest.raises(dpsync.InvalidArgument, match="mpi4py"):
        dpsync.Context(host_replicas=1, world_mpi=object())
