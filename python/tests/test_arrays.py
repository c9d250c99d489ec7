"""What register accepts (numpy, torch, the array interfaces, DLPack) and what it refuses,
before anything is registered."""

import pytest

import dpsync

from conftest import np


class ArrayInterface:
    """Only __array_interface__, borrowed from a numpy array."""

    def __init__(self, a, readonly=None):
        self.base = a
        iface = dict(a.__array_interface__)
        if readonly is not None:
            iface["data"] = (iface["data"][0], readonly)
        self.__array_interface__ = iface


class CudaArrayInterface:
    def __init__(self, ptr, n):
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "<f4", "data": (ptr, False), "version": 3}


class DLPackOnly:
    """Only __dlpack__ / __dlpack_device__, from a numpy array (numpy >= 1.22)."""

    def __init__(self, a):
        self.base = a

    def __dlpack__(self, stream=None):
        return self.base.__dlpack__()

    def __dlpack_device__(self):
        return self.base.__dlpack_device__()


def refused(ctx, array, match):
    before = (ctx.registered().keys(), ctx.describe()["tensors"])
    with pytest.raises(dpsync.InvalidArgument, match=match) as e:
        ctx.register("w", array, "param", 1)
    assert "'w'" in str(e.value) and "replica 1" in str(e.value), "the message names the tensor and replica"
    assert e.value.function is None  # refused by the package, before any C call
    assert (ctx.registered().keys(), ctx.describe()["tensors"]) == before, "nothing registered"
    assert "w" not in ctx.registered()
    return str(e.value)


def test_non_contiguous_is_refused(ctx4):
    a = np.zeros((4, 4), np.float32)
    refused(ctx4, a[:, 1], "not C-contiguous")
    refused(ctx4, a.T, "not C-contiguous")


def test_read_only_is_refused(ctx4):
    a = np.zeros(4, np.float32)
    a.setflags(write=False)
    refused(ctx4, a, "read-only")
    refused(ctx4, ArrayInterface(np.zeros(4, np.float32), readonly=True), "read-only")


@pytest.mark.parametrize("dtype", ["complex64", "uint8", "bool", "int16", "float128" if hasattr(np, "float128") else "uint32"])
def test_unsupported_dtypes_are_refused(ctx4, dtype):
    msg = refused(ctx4, np.zeros(4, dtype), "dtype")
    assert "float32" in msg  # says what is accepted


def test_big_endian_is_refused(ctx4):
    refused(ctx4, np.zeros(4, ">f4"), "byte order")


def test_other_objects_are_refused(ctx4):
    refused(ctx4, [1.0, 2.0], "list")
    refused(ctx4, memoryview(bytearray(8)), "memoryview")


def test_cuda_memory_on_host_replicas_is_refused(ctx4):
    refused(ctx4, CudaArrayInterface(0x1000, 4), "CUDA memory")


def test_bad_names_are_refused(ctx4):
    a = np.zeros(2, np.float32)
    with pytest.raises(dpsync.InvalidArgument, match="NUL"):
        ctx4.register("a\0b", a, "param", 0)
    with pytest.raises(dpsync.InvalidArgument, match="str"):
        ctx4.register(b"a", a, "param", 0)
    with pytest.raises(dpsync.InvalidArgument) as e:  # the library's own check
        ctx4.register("", a, "param", 0)
    assert e.value.function == "dpsync_register"
    with pytest.raises(dpsync.InvalidArgument, match="replica"):
        ctx4.register("a", a, "param", -1)
    assert ctx4.describe()["tensors"] == 0


def test_zero_size_is_the_library_s_invalid_argument(ctx4):
    with pytest.raises(dpsync.InvalidArgument, match="count is 0") as e:
        ctx4.register("a", np.zeros(0, np.float32), "param", 0)
    assert e.value.function == "dpsync_register"


def test_views_and_shapes(ctx4):
    # A contiguous slice and a 2-D block are one run of memory each; count = elements.
    big = [np.arange(12, dtype=np.float64).reshape(3, 4) * (r + 1) for r in range(4)]
    for r in range(4):
        ctx4.register("rows", big[r][1:], "grad", r)
    assert ctx4.describe()["buckets"][0]["elements"] == 8
    ctx4.allreduce_grads()
    for r in range(4):
        assert (big[r][0] == np.arange(4) * (r + 1)).all()  # outside the view: untouched
        assert (big[r][1:] == np.arange(4, 12).reshape(2, 4) * 10).all()


def test_array_interface_object(ctx4):
    bases = [np.full(3, r + 1, np.int32) for r in range(4)]
    for r in range(4):
        ctx4.register("x", ArrayInterface(bases[r]), "grad", r)
    ctx4.allreduce_grads()
    assert all((b == 10).all() for b in bases)


def test_array_interface_v2_typestr_is_refused(ctx4):
    obj = ArrayInterface(np.zeros(4, np.int16))
    obj.__array_interface__["typestr"] = "<V2"
    refused(ctx4, obj, "bfloat16")


def test_dlpack_object(ctx4):
    if not hasattr(np.ndarray, "__dlpack__"):
        pytest.skip("numpy %s has no __dlpack__ (needs 1.22)" % np.__version__)
    bases = [np.full(5, float(r), np.float64) for r in range(4)]
    for r in range(4):
        ctx4.register("x", DLPackOnly(bases[r]), "grad", r)
    ctx4.allreduce_grads("avg")
    assert all((b == 1.5).all() for b in bases)
    strided = DLPackOnly(np.zeros((4, 4), np.float32)[:, 0])
    refused(ctx4, strided, "not C-contiguous")


def test_torch_tensors_are_refused_like_numpy(ctx4):
    torch = pytest.importorskip("torch", reason="torch is not installed")
    refused(ctx4, torch.zeros(4, 4)[:, 1], "not contiguous")
    refused(ctx4, torch.zeros(4, dtype=torch.uint8), "dtype")
    refused(ctx4, torch.zeros(4, dtype=torch.complex64), "dtype")
    refused(ctx4, torch.zeros(4).to_sparse(), "layout")
    refused(ctx4, torch.zeros(4, device="meta"), "device")
