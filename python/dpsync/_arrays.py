"""Turning the caller's arrays into (pointer, count, dtype) for the C calls.

Accepted: torch.Tensor, numpy.ndarray, and any object with __cuda_array_interface__,
__array_interface__ or __dlpack__ (checked in that order). Refused, before any C call: memory
that is not one C-contiguous block, read-only memory where the library writes, dtypes the
library has no DPSYNC_DTYPE_* for, non-native byte order.
"""

from __future__ import annotations

import ctypes
import sys
from typing import Any, NamedTuple, Optional, Sequence, Tuple

from ._errors import InvalidArgument

F32, F64, F16, BF16, I32, I64 = range(6)
DTYPE_NAMES = ("float32", "float64", "float16", "bfloat16", "int32", "int64")
ITEMSIZE = (4, 8, 2, 2, 4, 8)
_BY_NAME = {name: code for code, name in enumerate(DTYPE_NAMES)}
_BY_NAME.update({"f32": F32, "f64": F64, "f16": F16, "bf16": BF16, "i32": I32, "i64": I64, "half": F16})
# __array_interface__ typestr without its byte-order character.
_BY_TYPESTR = {"f4": F32, "f8": F64, "f2": F16, "i4": I32, "i8": I64}
# DLPack (type code, bits) -> dtype; lanes must be 1.
_BY_DLPACK = {(2, 32): F32, (2, 64): F64, (2, 16): F16, (4, 16): BF16, (0, 32): I32, (0, 64): I64}
_DL_CPU, _DL_CUDA, _DL_CUDA_HOST, _DL_CUDA_MANAGED = 1, 2, 3, 13

SUPPORTED = "float32, float64, float16, bfloat16, int32 or int64"


class ArrayRef(NamedTuple):
    ptr: int
    elements: int
    dtype: int  # a DPSYNC_DTYPE_* value
    device: str  # "cpu" or "cuda"
    device_index: Optional[int]
    keep: Any  # what must stay alive while the library may touch the memory
    kind: str  # "torch", "numpy" or "other"


def dtype_code(dtype: Any, what: str) -> int:
    """A DPSYNC_DTYPE_* value from "float32" / "f32" / numpy.float32 / torch.float32 / a code."""
    if isinstance(dtype, int) and not isinstance(dtype, bool) and 0 <= dtype < len(DTYPE_NAMES):
        return dtype
    name = dtype if isinstance(dtype, str) else None
    if name is None:
        text = str(dtype)
        if text.startswith("torch."):
            name = text[len("torch.") :]
        else:
            name = getattr(dtype, "__name__", None) or getattr(dtype, "name", None)
            np = sys.modules.get("numpy")
            if np is not None:
                try:
                    name = np.dtype(dtype).name
                except TypeError:
                    pass
    code = _BY_NAME.get(str(name).lower()) if name is not None else None
    if code is None:
        raise InvalidArgument("%s is %r: dpsync takes %s" % (what, dtype, SUPPORTED))
    return code


def from_object(obj: Any, what: str, writable: bool) -> ArrayRef:
    """Describe `obj` (see the module docstring). `what` names it in messages
    ("tensor 'w' on replica 1"); `writable`: the library will write this memory."""
    torch = sys.modules.get("torch")
    if torch is not None and isinstance(obj, torch.Tensor):
        return _torch_tensor(torch, obj, what)
    np = sys.modules.get("numpy")
    if np is not None and isinstance(obj, np.ndarray):
        return _numpy_array(obj, what, writable)
    iface = getattr(obj, "__cuda_array_interface__", None)
    if iface is not None:
        return _interface(obj, iface, "cuda", what, writable)
    iface = getattr(obj, "__array_interface__", None)
    if iface is not None:
        return _interface(obj, iface, "cpu", what, writable)
    if hasattr(obj, "__dlpack__"):
        return _dlpack(obj, what)
    raise InvalidArgument(
        "%s is a %s: pass a numpy.ndarray, a torch.Tensor or an object with __array_interface__, "
        "__cuda_array_interface__ or __dlpack__" % (what, type(obj).__name__)
    )


_TORCH_DTYPES: dict = {}


def _torch_tensor(torch: Any, t: Any, what: str) -> ArrayRef:
    if not _TORCH_DTYPES:
        _TORCH_DTYPES.update(
            {
                torch.float32: F32,
                torch.float64: F64,
                torch.float16: F16,
                torch.bfloat16: BF16,
                torch.int32: I32,
                torch.int64: I64,
            }
        )
    if t.layout != torch.strided:
        raise InvalidArgument("%s has layout %s: dpsync takes dense (strided) tensors" % (what, t.layout))
    code = _TORCH_DTYPES.get(t.dtype)
    if code is None:
        raise InvalidArgument("%s has dtype %s: dpsync takes %s" % (what, t.dtype, SUPPORTED))
    device = t.device
    if device.type not in ("cpu", "cuda"):
        raise InvalidArgument("%s is on device %s: dpsync takes CPU or CUDA memory" % (what, device))
    if not t.is_contiguous():
        raise InvalidArgument(
            "%s is not contiguous (shape %s, strides %s): register a contiguous tensor"
            % (what, tuple(t.shape), t.stride())
        )
    return ArrayRef(t.data_ptr(), t.numel(), code, device.type, device.index, t, "torch")


def _numpy_array(a: Any, what: str, writable: bool) -> ArrayRef:
    dt = a.dtype
    code = _BY_NAME.get(dt.name) if dt.name in DTYPE_NAMES else None
    if code is None or dt.itemsize != ITEMSIZE[code]:
        raise InvalidArgument("%s has dtype %s: dpsync takes %s" % (what, dt, SUPPORTED))
    if not dt.isnative:
        raise InvalidArgument("%s has byte order %r: dpsync takes native byte order" % (what, dt.byteorder))
    if not a.flags.c_contiguous:
        raise InvalidArgument(
            "%s is not C-contiguous (shape %s, strides %s): pass numpy.ascontiguousarray(...) and "
            "keep that array" % (what, a.shape, a.strides)
        )
    if writable and not a.flags.writeable:
        raise InvalidArgument("%s is read-only: dpsync writes into registered memory" % what)
    return ArrayRef(a.ctypes.data, a.size, code, "cpu", None, a, "numpy")


def _interface(obj: Any, iface: dict, device: str, what: str, writable: bool) -> ArrayRef:
    label = "__cuda_array_interface__" if device == "cuda" else "__array_interface__"
    typestr = iface.get("typestr", "")
    order, key = typestr[:1], typestr[1:]
    code = _BY_TYPESTR.get(key)
    if code is None:
        hint = " (a 2-byte void type does not say bfloat16: pass a torch tensor or an ml_dtypes array)" if key == "V2" else ""
        raise InvalidArgument("%s: %s typestr %r: dpsync takes %s%s" % (what, label, typestr, SUPPORTED, hint))
    native = ("<", "|", "=") if sys.byteorder == "little" else (">", "|", "=")
    if order not in native:
        raise InvalidArgument("%s: %s typestr %r is not in native byte order" % (what, label, typestr))
    if iface.get("mask") is not None:
        raise InvalidArgument("%s: %s has a mask: dpsync takes plain arrays" % (what, label))
    data = iface.get("data")
    if not isinstance(data, tuple) or len(data) != 2:
        raise InvalidArgument("%s: %s data is not a (pointer, read-only) pair" % (what, label))
    ptr, readonly = data
    if writable and readonly:
        raise InvalidArgument("%s is read-only: dpsync writes into registered memory" % what)
    shape = tuple(iface.get("shape", ()))
    if not _c_contiguous(shape, iface.get("strides"), ITEMSIZE[code]):
        raise InvalidArgument(
            "%s is not C-contiguous (shape %s, strides %s)" % (what, shape, iface.get("strides"))
        )
    return ArrayRef(int(ptr or 0), _product(shape), code, device, None, obj, "other")


class _DLDevice(ctypes.Structure):
    _fields_ = [("device_type", ctypes.c_int32), ("device_id", ctypes.c_int32)]


class _DLDataType(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint8), ("bits", ctypes.c_uint8), ("lanes", ctypes.c_uint16)]


class _DLTensor(ctypes.Structure):
    _fields_ = [
        ("data", ctypes.c_void_p),
        ("device", _DLDevice),
        ("ndim", ctypes.c_int32),
        ("dtype", _DLDataType),
        ("shape", ctypes.POINTER(ctypes.c_int64)),
        ("strides", ctypes.POINTER(ctypes.c_int64)),
        ("byte_offset", ctypes.c_uint64),
    ]


_capsule_get = ctypes.pythonapi.PyCapsule_GetPointer
_capsule_get.restype = ctypes.c_void_p
_capsule_get.argtypes = [ctypes.py_object, ctypes.c_char_p]


def _dlpack(obj: Any, what: str) -> ArrayRef:
    try:
        capsule = obj.__dlpack__()
    except Exception as e:  # the producer's refusal (e.g. a read-only numpy array) names the cause
        raise InvalidArgument("%s: __dlpack__() failed: %s" % (what, e)) from e
    try:
        address = _capsule_get(capsule, b"dltensor")
    except ValueError as e:
        raise InvalidArgument("%s: __dlpack__() did not return a 'dltensor' capsule" % what) from e
    # DLManagedTensor starts with its DLTensor. The capsule is kept unconsumed: while it lives,
    # the producer keeps the memory; its destructor calls the deleter.
    t = _DLTensor.from_address(address)
    dev = t.device.device_type
    if dev in (_DL_CPU, _DL_CUDA_HOST):
        device, index = "cpu", None
    elif dev in (_DL_CUDA, _DL_CUDA_MANAGED):
        device, index = "cuda", int(t.device.device_id)
    else:
        raise InvalidArgument("%s: __dlpack__ device type %d: dpsync takes CPU or CUDA memory" % (what, dev))
    code = _BY_DLPACK.get((t.dtype.code, t.dtype.bits)) if t.dtype.lanes == 1 else None
    if code is None:
        raise InvalidArgument(
            "%s: __dlpack__ dtype (code %d, %d bits, %d lanes): dpsync takes %s"
            % (what, t.dtype.code, t.dtype.bits, t.dtype.lanes, SUPPORTED)
        )
    shape = tuple(t.shape[i] for i in range(t.ndim))
    strides = tuple(t.strides[i] * ITEMSIZE[code] for i in range(t.ndim)) if t.strides else None
    if not _c_contiguous(shape, strides, ITEMSIZE[code]):
        raise InvalidArgument("%s is not C-contiguous (shape %s, strides %s elements)" % (what, shape, strides))
    ptr = (t.data or 0) + t.byte_offset
    return ArrayRef(ptr, _product(shape), code, device, index, (obj, capsule), "other")


def _c_contiguous(shape: Sequence[int], strides: Optional[Sequence[int]], itemsize: int) -> bool:
    """Strides in bytes; None means C-contiguous. Dimensions of length 1 have any stride."""
    if strides is None:
        return True
    expected = itemsize
    for n, s in zip(reversed(shape), reversed(strides)):
        if n == 0:
            return True
        if n != 1 and s != expected:
            return False
        expected *= n
    return True


def _product(shape: Tuple[int, ...]) -> int:
    n = 1
    for d in shape:
        n *= int(d)
    return n
