"""dpsync.Context: one method per C call of include/dpsync.h (docs/API.md is the reference)."""

from __future__ import annotations

import ctypes
import sys
from ctypes import byref, c_double, c_size_t, c_uint64, c_void_p
from typing import Any, Callable, Dict, Iterable, List, Optional, Sequence, Tuple, Union

from . import _lib
from ._arrays import DTYPE_NAMES, ITEMSIZE, ArrayRef, dtype_code, from_object
from ._errors import Error, InvalidArgument, InvalidState
from ._options import _describe, _failure, _options, _size

ROLES = {"param": 1, "grad": 2, "computed": 4, "state": 8}
OPS = {"sum": 0, "avg": 1}

Roles = Union[str, Iterable[str]]

# name -> its NUL-terminated UTF-8 bytes, so that hot calls (allreduce, grad_ready) skip the
# encoding and the checks.
_NAMES: Dict[str, bytes] = {}


def _encode_name(name: Any) -> bytes:
    if not isinstance(name, str):
        raise InvalidArgument("a name must be a str, not %s" % type(name).__name__)
    try:
        data = name.encode("utf-8")
    except UnicodeEncodeError as e:
        raise InvalidArgument("name %r is not valid UTF-8: %s" % (name, e)) from e
    if b"\0" in data:
        raise InvalidArgument("name %r contains a NUL character" % name)
    if len(_NAMES) < 65536:
        _NAMES[name] = data
    return data


def _op(op: Any) -> int:
    code = OPS.get(op.lower()) if isinstance(op, str) else None
    if code is None:
        raise InvalidArgument("op is %r: use \"sum\" or \"avg\"" % (op,))
    return code


def _role(role: Any) -> int:
    code = ROLES.get(role.lower()) if isinstance(role, str) else None
    if code is None:
        raise InvalidArgument("role is %r: use one of %s" % (role, ", ".join(map(repr, ROLES))))
    return code


def _roles(roles: Roles) -> int:
    if isinstance(roles, str):
        return _role(roles)
    mask = 0
    for role in roles:
        mask |= _role(role)
    if mask == 0:
        raise InvalidArgument("roles is empty: name at least one of %s" % ", ".join(map(repr, ROLES)))
    return mask


class HookHandle:
    """Returned by Context.add_pre_allreduce_grads_hook; remove() takes the hook away."""

    def __init__(self, hooks: List[Callable[[], None]], fn: Callable[[], None]) -> None:
        self._hooks, self._fn = hooks, fn

    def remove(self) -> None:
        if self._fn in self._hooks:
            self._hooks.remove(self._fn)


class Context:
    """A dpsync context (``dpsync_context_create``). Keyword arguments are the options of
    docs/API.md, "Options": host_replicas (default 1) or cuda_replicas (a list of device
    ordinals), transport ("auto", "nccl", "peer_copy", "host"), fusion_bytes, timeout_ms,
    sparse_coalesce, peer_access (an n x n matrix of truthy entries), world_mpi (True for
    MPI_COMM_WORLD, or an mpi4py communicator), reproducible (float sums that give the same
    bytes however the replicas are arranged: docs/API.md, "Reproducible sums").

    The context keeps a reference to every registered array until it is unregistered or the
    context closed, and to every sparse_set slice until the step that reads it has ended, so
    that the memory cannot be freed under the library. Use it as a context manager, or call
    close(); do not close it while another thread is calling it.
    """

    def __init__(
        self,
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
    ) -> None:
        self._closed = True  # until created, so that __del__ of a failed __init__ does nothing
        lib, _ = _lib.load()
        self._lib = lib
        options = _options(
            lib, host_replicas, cuda_replicas, transport, fusion_bytes, timeout_ms, sparse_coalesce, peer_access, world_mpi, reproducible, elastic
        )
        handle = c_void_p()
        try:
            st = lib.dpsync_context_create(options, byref(handle))
        finally:
            lib.dpsync_options_free(options)
        if st:
            raise _failure(lib, st, "dpsync_context_create")
        self._h = handle
        self._closed = False
        self._cuda: Optional[List[int]] = [int(o) for o in cuda_replicas] if cuda_replicas is not None else None
        n = c_size_t(0)
        self._check(lib.dpsync_replica_count(handle, byref(n)), "dpsync_replica_count")
        self._replica_count = n.value
        self._dense: Dict[str, Dict[int, Any]] = {}  # name -> replica -> the object kept alive
        self._sparse: Dict[Tuple[str, int], Tuple[int, int, int]] = {}  # (name, replica) -> row_len, value, index dtype
        self._kinds: Dict[Tuple[str, int], str] = {}  # (name, replica) -> array kind of the last values set
        self._slices: Dict[Tuple[str, int], Tuple[Any, Any]] = {}  # this step's sparse_set arrays
        self._retired: Dict[Tuple[str, int], Tuple[Any, Any]] = {}  # last step's, CUDA replicas only
        self._pre_step: List[Callable[[], None]] = []

    # -- lifetime ---------------------------------------------------------------------------

    def close(self) -> None:
        """dpsync_context_destroy, then drop every reference the context kept. Idempotent."""
        if self._closed:
            return
        self._closed = True
        handle, self._h = self._h, c_void_p()
        st = self._lib.dpsync_context_destroy(handle)
        self._dense.clear()
        self._sparse.clear()
        self._slices.clear()
        self._retired.clear()
        self._pre_step.clear()
        if st:
            raise _failure(self._lib, st, "dpsync_context_destroy")

    def __enter__(self) -> "Context":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    def __del__(self) -> None:
        try:
            self.close()
        except Exception:  # nothing can be reported from a finalizer
            pass

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def handle(self) -> int:
        """The ``dpsync_context *`` as an integer, for calling the C library directly."""
        return self._h.value or 0

    def _check(self, st: int, function: str) -> None:
        if st:
            raise self._error(st, function)

    def _error(self, st: int, function: str) -> Error:
        if self._closed:
            return InvalidState("the context is closed", function)
        return _failure(self._lib, st, function)

    # -- queries ----------------------------------------------------------------------------

    @property
    def replica_count(self) -> int:
        """dpsync_replica_count: this process's replicas."""
        return self._replica_count

    @property
    def loss_scale(self) -> float:
        """dpsync_loss_scale: 1 / replicas in the world."""
        out = c_double(0.0)
        self._check(self._lib.dpsync_loss_scale(self._h, byref(out)), "dpsync_loss_scale")
        return out.value

    def _rank(self) -> Tuple[int, int]:
        rank, ranks = c_size_t(0), c_size_t(0)
        self._check(self._lib.dpsync_rank(self._h, byref(rank), byref(ranks)), "dpsync_rank")
        return rank.value, ranks.value

    @property
    def rank(self) -> int:
        """dpsync_rank: this process's rank (0 outside a world)."""
        return self._rank()[0]

    @property
    def ranks(self) -> int:
        """dpsync_rank: the number of ranks (1 outside a world)."""
        return self._rank()[1]

    @property
    def world_replicas(self) -> Tuple[int, int]:
        """dpsync_world_replicas: (replicas in the world, world index of local replica 0)."""
        total, offset = c_size_t(0), c_size_t(0)
        self._check(self._lib.dpsync_world_replicas(self._h, byref(total), byref(offset)), "dpsync_world_replicas")
        return total.value, offset.value

    @property
    def world_epoch(self) -> Tuple[int, int]:
        """dpsync_world_epoch: (epoch, first_rank). epoch counts the collectives at which
        ranks left or were lost (0 at first, and outside a world); first_rank is this
        process's rank at creation, which never changes (keep its part of the data set by it)."""
        epoch, first = c_uint64(0), c_size_t(0)
        self._check(self._lib.dpsync_world_epoch(self._h, byref(epoch), byref(first)), "dpsync_world_epoch")
        return epoch.value, first.value

    def describe(self) -> Dict[str, Any]:
        """dpsync_describe as a dict (docs/API.md, "Describing the plan")."""
        if self._closed:
            raise InvalidState("the context is closed", "dpsync_describe")
        return _describe(self._lib.dpsync_describe, self._h, self._lib, "dpsync_describe")

    # -- registration -----------------------------------------------------------------------

    def _array(self, obj: Any, what: str, writable: bool) -> ArrayRef:
        ref = from_object(obj, what, writable)
        if ref.device == "cuda" and self._cuda is None:
            raise InvalidArgument("%s is CUDA memory, and the context has host replicas" % what)
        return ref

    def register(self, name: str, array: Any, role: str, replica: int) -> None:
        """dpsync_register: `array`'s memory as tensor `name` of `role` ("param", "grad",
        "computed", "state") on `replica`; count and dtype come from the array."""
        data = _NAMES.get(name) or _encode_name(name)
        what = "tensor %r on replica %s" % (name, replica)
        replica = _size(replica, "replica")
        code = _role(role)
        ref = self._array(array, what, writable=True)
        st = self._lib.dpsync_register(self._h, data, code, replica, ref.ptr, ref.elements, ref.dtype)
        if st:
            raise self._error(st, "dpsync_register")
        self._dense.setdefault(name, {})[replica] = ref.keep

    def unregister(self, name: str) -> None:
        """dpsync_unregister: `name` (dense or sparse) from every replica; drops the references."""
        st = self._lib.dpsync_unregister(self._h, _NAMES.get(name) or _encode_name(name))
        if st:
            raise self._error(st, "dpsync_unregister")
        self._dense.pop(name, None)
        for table in (self._sparse, self._kinds, self._slices):
            for key in [k for k in table if k[0] == name]:
                del table[key]

    def registered(self) -> Dict[str, Dict[int, Any]]:
        """The arrays this context keeps alive, by name and replica (a copy)."""
        return {name: dict(by_replica) for name, by_replica in self._dense.items()}

    # -- collectives ------------------------------------------------------------------------

    def add_pre_allreduce_grads_hook(self, fn: Callable[[], None]) -> HookHandle:
        """Run `fn()` at the start of every allreduce_grads and reduce_scatter_grads, before
        the C call (dpsync.torch uses it to put back gradients that zero_grad() set to None)."""
        self._pre_step.append(fn)
        return HookHandle(self._pre_step, fn)

    def allreduce_grads(self, op: str = "sum") -> None:
        """dpsync_allreduce_grads: every GRAD (fused, last registered first) and every sparse
        gradient's slices, SUM or AVG."""
        code = OPS.get(op)
        if code is None:
            code = _op(op)
        for fn in self._pre_step:
            fn()
        st = self._lib.dpsync_allreduce_grads(self._h, code)
        if st:
            raise self._error(st, "dpsync_allreduce_grads")
        if self._slices:
            # The slices were read. On CUDA replicas the reads are queued in stream order: keep
            # them one step longer (or until synchronize).
            self._retired = self._slices if self._cuda is not None else {}
            self._slices = {}

    def allreduce(self, name: str, op: str = "sum") -> None:
        """dpsync_allreduce: one tensor (any role) in place on every replica."""
        code = OPS.get(op)
        if code is None:
            code = _op(op)
        st = self._lib.dpsync_allreduce(self._h, _NAMES.get(name) or _encode_name(name), code)
        if st:
            raise self._error(st, "dpsync_allreduce")

    def broadcast(self, roles: Roles, root: int = 0) -> None:
        """dpsync_broadcast: every tensor whose role is in `roles` from world replica `root`."""
        st = self._lib.dpsync_broadcast(self._h, _roles(roles), _size(root, "root"))
        if st:
            raise self._error(st, "dpsync_broadcast")

    def average(self, roles: Roles) -> None:
        """dpsync_average: every tensor whose role is in `roles` replaced by its mean."""
        st = self._lib.dpsync_average(self._h, _roles(roles))
        if st:
            raise self._error(st, "dpsync_average")

    def leave(self) -> None:
        """dpsync_leave: this rank's data ran out. Call it instead of the next collective; it
        stands for this rank's part in the next collective the other ranks make, which
        completes on them over the remaining replicas (renumbered and recounted). Afterwards
        this context refuses collectives (InvalidState) but answers queries; close it as usual.
        InvalidState on a context without a world."""
        st = self._lib.dpsync_leave(self._h)
        if st:
            raise self._error(st, "dpsync_leave")

    def grad_ready(self, name: str, replica: int) -> None:
        """dpsync_grad_ready: GRAD `name` is final on `replica` for this step (overlap)."""
        if replica < 0:
            raise InvalidArgument("replica is %d" % replica, "dpsync_grad_ready")
        st = self._lib.dpsync_grad_ready(self._h, _NAMES.get(name) or _encode_name(name), replica)
        if st:
            raise self._error(st, "dpsync_grad_ready")

    def synchronize(self) -> None:
        """dpsync_synchronize: wait for every collective issued so far (CUDA replicas)."""
        st = self._lib.dpsync_synchronize(self._h)
        if st:
            raise self._error(st, "dpsync_synchronize")
        self._retired = {}

    def set_stream(self, replica: int, stream: Any) -> None:
        """dpsync_set_stream: a torch.cuda.Stream, a raw cudaStream_t as int, or None (the
        legacy default stream) for CUDA replica `replica`."""
        if stream is None:
            address = None
        elif hasattr(stream, "cuda_stream"):  # torch.cuda.Stream
            address = int(stream.cuda_stream)
        elif hasattr(stream, "ptr"):  # cupy
            address = int(stream.ptr)
        else:
            address = _size(stream, "stream")
        st = self._lib.dpsync_set_stream(self._h, _size(replica, "replica"), address)
        if st:
            raise self._error(st, "dpsync_set_stream")

    # -- shards (ZeRO stage 1) --------------------------------------------------------------

    def shard(self, name: str, replica: int) -> Tuple[int, int]:
        """dpsync_shard: (offset, count), the piece of dense tensor `name` that `replica` owns:
        with W replicas in the world, world replica w owns elements [count * w / W,
        count * (w + 1) / W) (count may be 0). A parameter and its gradient are cut alike."""
        data = _NAMES.get(name) or _encode_name(name)
        replica = _size(replica, "replica")
        offset, count = c_size_t(0), c_size_t(0)
        st = self._lib.dpsync_shard(self._h, data, replica, byref(offset), byref(count))
        if st:
            raise self._error(st, "dpsync_shard")
        return offset.value, count.value

    def reduce_scatter_grads(self, op: str = "sum") -> None:
        """dpsync_reduce_scatter_grads: as allreduce_grads (the same hooks, buckets and sums,
        sparse gradients gathered whole), but each replica receives the reduced values only in
        the pieces of its GRAD tensors that it owns (shard); its other elements are left as
        they were."""
        code = OPS.get(op)
        if code is None:
            code = _op(op)
        for fn in self._pre_step:
            fn()
        st = self._lib.dpsync_reduce_scatter_grads(self._h, code)
        if st:
            raise self._error(st, "dpsync_reduce_scatter_grads")
        if self._slices:
            # As in allreduce_grads: the slices were read (on CUDA replicas, in stream order).
            self._retired = self._slices if self._cuda is not None else {}
            self._slices = {}

    def allgather(self, roles: Roles) -> None:
        """dpsync_allgather: for every tensor whose role is in `roles`, each replica's owned
        piece (shard) copied to every other replica, so that all replicas end identical."""
        st = self._lib.dpsync_allgather(self._h, _roles(roles))
        if st:
            raise self._error(st, "dpsync_allgather")

    # -- BMUF -------------------------------------------------------------------------------

    def bmuf_init(self, block_lr: float = 1.0, block_momentum: Optional[float] = None, nesterov: bool = False) -> None:
        """dpsync_bmuf_init; block_momentum None is the default 1 - 1/N."""
        momentum = -1.0 if block_momentum is None else float(block_momentum)
        st = self._lib.dpsync_bmuf_init(self._h, float(block_lr), momentum, bool(nesterov))
        if st:
            raise self._error(st, "dpsync_bmuf_init")

    def bmuf_step(self) -> None:
        """dpsync_bmuf_step: average the PARAMs and apply the block-momentum filter."""
        st = self._lib.dpsync_bmuf_step(self._h)
        if st:
            raise self._error(st, "dpsync_bmuf_step")

    # -- sparse gradients -------------------------------------------------------------------

    def register_sparse(
        self,
        name: str,
        replica: int,
        row_len: int,
        value_dtype: Any = "float32",
        index_dtype: Any = "int64",
        num_embeddings: int = 0,
    ) -> None:
        """dpsync_register_sparse: rows of `row_len` values per index; num_embeddings > 0
        turns on index range checks."""
        data = _NAMES.get(name) or _encode_name(name)
        replica = _size(replica, "replica")
        row_len = _size(row_len, "row_len")
        vd = dtype_code(value_dtype, "value_dtype")
        idt = dtype_code(index_dtype, "index_dtype")
        st = self._lib.dpsync_register_sparse(
            self._h, data, replica, row_len, vd, idt, _size(num_embeddings, "num_embeddings")
        )
        if st:
            raise self._error(st, "dpsync_register_sparse")
        self._sparse[(name, replica)] = (row_len, vd, idt)

    def sparse_set(self, name: str, replica: int, indices: Any, values: Any) -> None:
        """dpsync_sparse_set: this step's slice; rows = len(indices), values hold rows x
        row_len elements in the registered dtypes. Both arrays are kept until the step ends."""
        data = _NAMES.get(name) or _encode_name(name)
        replica = _size(replica, "replica")
        what = "sparse gradient %r on replica %d" % (name, replica)
        i = self._array(indices, what + ": indices", writable=False)
        v = self._array(values, what + ": values", writable=False)
        rows = i.elements
        spec = self._sparse.get((name, replica))
        if spec is not None:
            row_len, vd, idt = spec
            if i.dtype != idt:
                raise InvalidArgument(
                    "%s: indices are %s, registered as %s" % (what, DTYPE_NAMES[i.dtype], DTYPE_NAMES[idt])
                )
            if v.dtype != vd:
                raise InvalidArgument(
                    "%s: values are %s, registered as %s" % (what, DTYPE_NAMES[v.dtype], DTYPE_NAMES[vd])
                )
            if v.elements != rows * row_len:
                raise InvalidArgument(
                    "%s: values hold %d elements, %d rows x row_len %d need %d" % (what, v.elements, rows, row_len, rows * row_len)
                )
        # Without a spec the name is not registered on this replica: the call fails before any
        # read (NOT_FOUND or INCONSISTENT).
        st = self._lib.dpsync_sparse_set(self._h, data, replica, i.ptr if rows else None, v.ptr if rows else None, rows)
        if st:
            raise self._error(st, "dpsync_sparse_set")
        self._slices[(name, replica)] = (i.keep, v.keep)
        self._kinds[(name, replica)] = v.kind

    def sparse_get(self, name: str, replica: int) -> Tuple[Any, Any]:
        """dpsync_sparse_get: (indices, values) gathered by the last allreduce_grads, copied out
        of the library's memory: shape (rows,) and (rows, row_len). numpy arrays, or torch
        tensors when the values were set as torch tensors (always on CUDA replicas)."""
        data = _NAMES.get(name) or _encode_name(name)
        replica = _size(replica, "replica")
        pi, pv, rows = c_void_p(), c_void_p(), c_size_t(0)
        st = self._lib.dpsync_sparse_get(self._h, data, replica, byref(pi), byref(pv), byref(rows))
        if st:
            raise self._error(st, "dpsync_sparse_get")
        row_len, vd, idt = self._sparse[(name, replica)]
        kind = self._kinds.get((name, replica), "numpy")
        n = rows.value
        if self._cuda is not None:
            device = "cuda:%d" % self._cuda[replica]
            return _cuda_copy(pi.value, (n,), idt, device), _cuda_copy(pv.value, (n, row_len), vd, device)
        return _host_copy(pi.value, (n,), idt, kind), _host_copy(pv.value, (n, row_len), vd, kind)


def _numpy_dtype(np: Any, code: int) -> Any:
    if code == 3:
        import ml_dtypes  # type: ignore[import-not-found]

        return ml_dtypes.bfloat16
    return np.dtype(DTYPE_NAMES[code])


def _host_copy(ptr: Optional[int], shape: Tuple[int, ...], code: int, kind: str) -> Any:
    nbytes = ITEMSIZE[code] * shape[0] * (shape[1] if len(shape) > 1 else 1)
    np = sys.modules.get("numpy")
    use_torch = kind == "torch" or np is None
    if not use_torch and code == 3:
        try:
            import ml_dtypes  # type: ignore[import-not-found]  # noqa: F401
        except ImportError:
            use_torch = True
    if use_torch:
        try:
            import torch  # type: ignore[import-not-found]
        except ImportError:
            raise InvalidArgument(
                "dpsync_sparse_get: returning %s needs numpy%s or torch"
                % (DTYPE_NAMES[code], " with ml_dtypes" if code == 3 else "")
            ) from None
        out = torch.empty(shape, dtype=getattr(torch, DTYPE_NAMES[code]))
        address = out.data_ptr()
    else:
        assert np is not None
        out = np.empty(shape, dtype=_numpy_dtype(np, code))
        address = out.ctypes.data
    if nbytes:
        ctypes.memmove(address, ptr or 0, nbytes)
    return out


class _DeviceBytes:
    """Library-owned device memory as a uint8 array for torch.as_tensor."""

    def __init__(self, ptr: Optional[int], nbytes: int) -> None:
        self.__cuda_array_interface__ = {"shape": (nbytes,), "typestr": "|u1", "data": (ptr or 0, True), "version": 2}


def _cuda_copy(ptr: Optional[int], shape: Tuple[int, ...], code: int, device: str) -> Any:
    import torch  # type: ignore[import-not-found]

    dtype = getattr(torch, DTYPE_NAMES[code])
    nbytes = ITEMSIZE[code] * shape[0] * (shape[1] if len(shape) > 1 else 1)
    if nbytes == 0:
        return torch.empty(shape, dtype=dtype, device=device)
    raw = torch.as_tensor(_DeviceBytes(ptr, nbytes), device=device)
    return raw.clone().view(dtype).reshape(shape)


def version() -> str:
    """dpsync_version: the library's version, e.g. "0.1.0"."""
    lib, _ = _lib.load()
    return lib.dpsync_version().decode()


def library_path() -> str:
    """The path of the loaded libdpsync.so."""
    return _lib.load()[1]


def library() -> ctypes.CDLL:
    """The loaded library (ctypes), with every function's signature declared."""
    return _lib.load()[0]
