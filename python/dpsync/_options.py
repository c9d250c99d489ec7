"""Options (dpsync_options_*) for Context and plan_describe, and the helpers they share."""

from __future__ import annotations

import ctypes
import json
import operator
from ctypes import byref, c_int32, c_size_t, c_uint8, c_void_p
from typing import Any, Dict, Optional, Sequence

from . import _lib
from ._errors import Error, InvalidArgument, error_for

TRANSPORTS = {"auto": 0, "nccl": 1, "peer_copy": 2, "host": 3}


def _size(value: Any, what: str) -> int:
    """A size_t argument: ctypes would wrap a negative int silently."""
    try:
        n = operator.index(value)
    except TypeError:
        raise InvalidArgument("%s is %r: expected an integer" % (what, value)) from None
    if n < 0 or n >= 1 << 64:
        raise InvalidArgument("%s is %d: expected 0 <= %s < 2**64" % (what, n, what))
    return n


def _failure(lib: ctypes.CDLL, code: int, function: str) -> Error:
    message = lib.dpsync_last_error()
    return error_for(code, message.decode("utf-8", "replace") if message else "", function)


def _describe(fn: Any, handle: Any, lib: ctypes.CDLL, function: str) -> Dict[str, Any]:
    length = c_size_t(0)
    st = fn(handle, None, 0, byref(length))
    while True:
        if st:
            raise _failure(lib, st, function)
        buf = ctypes.create_string_buffer(length.value + 1)
        st = fn(handle, buf, len(buf), byref(length))
        if st == 0 and length.value < len(buf):  # else it grew in between (another thread)
            return json.loads(buf.value.decode("utf-8"))


def _options(
    lib: ctypes.CDLL,
    host_replicas: Optional[int],
    cuda_replicas: Optional[Sequence[int]],
    transport: str,
    fusion_bytes: Optional[int],
    timeout_ms: Optional[int],
    sparse_coalesce: Optional[bool],
    peer_access: Optional[Sequence[Sequence[Any]]],
    world_mpi: Any,
    reproducible: Optional[bool] = None,
    elastic: Optional[int] = None,
) -> c_void_p:
    """A dpsync_options handle with every given setting; the caller frees it."""
    handle = c_void_p()
    st = lib.dpsync_options_new(byref(handle))
    if st:
        raise _failure(lib, st, "dpsync_options_new")
    try:

        def call(function: str, *args: Any) -> None:
            st = getattr(lib, function)(handle, *args)
            if st:
                raise _failure(lib, st, function)

        if host_replicas is not None and cuda_replicas is not None:
            raise InvalidArgument("give host_replicas or cuda_replicas, not both")
        if cuda_replicas is not None:
            ordinals = [operator.index(o) for o in cuda_replicas]
            if any(not -(1 << 31) <= o < 1 << 31 for o in ordinals):
                raise InvalidArgument("cuda_replicas %r: ordinals must fit an int32" % (ordinals,))
            call("dpsync_options_set_cuda_replicas", (c_int32 * max(len(ordinals), 1))(*ordinals), len(ordinals))
        elif host_replicas is not None:
            call("dpsync_options_set_host_replicas", _size(host_replicas, "host_replicas"))
        code = TRANSPORTS.get(transport.lower()) if isinstance(transport, str) else None
        if code is None:
            raise InvalidArgument("transport is %r: use one of %s" % (transport, ", ".join(map(repr, TRANSPORTS))))
        call("dpsync_options_set_transport", code)
        if fusion_bytes is not None:
            call("dpsync_options_set_fusion_bytes", _size(fusion_bytes, "fusion_bytes"))
        if timeout_ms is not None:
            call("dpsync_options_set_timeout_ms", _size(timeout_ms, "timeout_ms"))
        if sparse_coalesce is not None:
            call("dpsync_options_set_sparse_coalesce", bool(sparse_coalesce))
        if reproducible is not None:
            call("dpsync_options_set_reproducible", bool(reproducible))
        if peer_access is not None:
            rows = [list(row) for row in peer_access]
            n = len(rows)
            if any(len(row) != n for row in rows):
                raise InvalidArgument("peer_access must be a square matrix (n lists of n entries)")
            flat = [1 if x else 0 for row in rows for x in row]
            call("dpsync_options_set_peer_access", (c_uint8 * max(len(flat), 1))(*flat), n)
        if world_mpi is True:
            call("dpsync_options_set_world_mpi", None)  # NULL: MPI_COMM_WORLD
        elif world_mpi is not None and world_mpi is not False:
            call("dpsync_options_set_world_mpi", _mpi_comm_address(world_mpi))
        if elastic is not None:
            call("dpsync_options_set_elastic", _size(elastic, "elastic"))
    except BaseException:
        lib.dpsync_options_free(handle)
        raise
    return handle


def _mpi_comm_address(comm: Any) -> int:
    """The address of an mpi4py communicator's MPI_Comm handle (the C call copies its value)."""
    if not type(comm).__module__.startswith("mpi4py"):
        raise InvalidArgument("world_mpi is a %s: pass True (MPI_COMM_WORLD) or an mpi4py communicator" % type(comm).__name__)
    from mpi4py import MPI

    return int(MPI._addressof(comm))


def plan_describe(
    host_replicas: Optional[int] = None,
    cuda_replicas: Optional[Sequence[int]] = None,
    *,
    transport: str = "auto",
    fusion_bytes: Optional[int] = None,
    timeout_ms: Optional[int] = None,
    sparse_coalesce: Optional[bool] = None,
    peer_access: Optional[Sequence[Sequence[Any]]] = None,
    world_mpi: Any = None,
    reproducible: Optional[bool] = None,
    elastic: Optional[int] = None,
) -> Dict[str, Any]:
    """dpsync_plan_describe: the plan for these options (Context's keywords) as a dict,
    touching no device."""
    lib, _ = _lib.load()
    options = _options(
        lib, host_replicas, cuda_replicas, transport, fusion_bytes, timeout_ms, sparse_coalesce, peer_access, world_mpi, reproducible, elastic
    )
    try:
        return _describe(lib.dpsync_plan_describe, options, lib, "dpsync_plan_describe")
    finally:
        lib.dpsync_options_free(options)
