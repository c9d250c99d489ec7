"""dpsync: keeps data-parallel model replicas in sync (allreduce, broadcast, BMUF, sparse
gradient gathers), over the C library libdpsync.so.

Each method of Context is one C call of include/dpsync.h; docs/API.md is the reference for
what the calls do, and its section "Python" for this package. dpsync.torch registers PyTorch
modules and optimizers.

The library is the one bundled in the package, or the file named by the DPSYNC_LIBRARY
environment variable (e.g. the MPI build, target/mpi/release/libdpsync.so).
"""

from ._context import Context, HookHandle, library, library_path, version
from ._errors import (
    BackendError,
    Conflict,
    Error,
    Inconsistent,
    InvalidArgument,
    InvalidState,
    NotFound,
    Panic,
    RankLost,
    Timeout,
    Unavailable,
)
from ._options import plan_describe

__version__ = "0.1.0"

for _cls in (Context, HookHandle, Error, InvalidArgument, NotFound, Conflict, Inconsistent, InvalidState, Unavailable,
             BackendError, Timeout, Panic, RankLost):
    _cls.__module__ = "dpsync"  # shown in tracebacks and reprs as dpsync.NotFound, not dpsync._errors.NotFound
del _cls

__all__ = [
    "BackendError",
    "Conflict",
    "Context",
    "Error",
    "HookHandle",
    "Inconsistent",
    "InvalidArgument",
    "InvalidState",
    "NotFound",
    "Panic",
    "RankLost",
    "Timeout",
    "Unavailable",
    "__version__",
    "library",
    "library_path",
    "plan_describe",
    "version",
]
