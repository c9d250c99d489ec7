"""Finding and loading libdpsync.so, and the C signatures (include/dpsync.h, docs/API.md)."""

from __future__ import annotations

import ctypes
import os
import threading
from ctypes import POINTER, c_bool, c_char_p, c_double, c_int32, c_size_t, c_uint8, c_uint32, c_uint64, c_void_p
from typing import List, Optional, Tuple

LIBRARY_FILE = "libdpsync.so"
_PACKAGE_DIR = os.path.dirname(os.path.abspath(__file__))

_STATUS = c_uint32
# name -> (restype, argtypes), one entry per function of include/dpsync.h.
SIGNATURES = {
    "dpsync_version": (c_char_p, []),
    "dpsync_status_name": (c_char_p, [c_uint32]),
    "dpsync_last_error": (c_char_p, []),
    "dpsync_options_new": (_STATUS, [POINTER(c_void_p)]),
    "dpsync_options_free": (None, [c_void_p]),
    "dpsync_options_set_host_replicas": (_STATUS, [c_void_p, c_size_t]),
    "dpsync_options_set_cuda_replicas": (_STATUS, [c_void_p, POINTER(c_int32), c_size_t]),
    "dpsync_options_set_transport": (_STATUS, [c_void_p, c_uint32]),
    "dpsync_options_set_fusion_bytes": (_STATUS, [c_void_p, c_size_t]),
    "dpsync_options_set_timeout_ms": (_STATUS, [c_void_p, c_uint64]),
    "dpsync_options_set_peer_access": (_STATUS, [c_void_p, POINTER(c_uint8), c_size_t]),
    "dpsync_options_set_sparse_coalesce": (_STATUS, [c_void_p, c_bool]),
    "dpsync_options_set_reproducible": (_STATUS, [c_void_p, c_bool]),
    "dpsync_options_set_world_mpi": (_STATUS, [c_void_p, c_void_p]),
    "dpsync_options_set_elastic": (_STATUS, [c_void_p, c_size_t]),
    "dpsync_context_create": (_STATUS, [c_void_p, POINTER(c_void_p)]),
    "dpsync_context_destroy": (_STATUS, [c_void_p]),
    "dpsync_replica_count": (_STATUS, [c_void_p, POINTER(c_size_t)]),
    "dpsync_loss_scale": (_STATUS, [c_void_p, POINTER(c_double)]),
    "dpsync_rank": (_STATUS, [c_void_p, POINTER(c_size_t), POINTER(c_size_t)]),
    "dpsync_world_replicas": (_STATUS, [c_void_p, POINTER(c_size_t), POINTER(c_size_t)]),
    "dpsync_world_epoch": (_STATUS, [c_void_p, POINTER(c_uint64), POINTER(c_size_t)]),
    "dpsync_leave": (_STATUS, [c_void_p]),
    "dpsync_set_stream": (_STATUS, [c_void_p, c_size_t, c_void_p]),
    "dpsync_synchronize": (_STATUS, [c_void_p]),
    "dpsync_describe": (_STATUS, [c_void_p, c_char_p, c_size_t, POINTER(c_size_t)]),
    "dpsync_plan_describe": (_STATUS, [c_void_p, c_char_p, c_size_t, POINTER(c_size_t)]),
    "dpsync_register": (_STATUS, [c_void_p, c_char_p, c_uint32, c_size_t, c_void_p, c_size_t, c_uint32]),
    "dpsync_unregister": (_STATUS, [c_void_p, c_char_p]),
    "dpsync_allreduce_grads": (_STATUS, [c_void_p, c_uint32]),
    "dpsync_allreduce": (_STATUS, [c_void_p, c_char_p, c_uint32]),
    "dpsync_broadcast": (_STATUS, [c_void_p, c_uint32, c_size_t]),
    "dpsync_average": (_STATUS, [c_void_p, c_uint32]),
    "dpsync_grad_ready": (_STATUS, [c_void_p, c_char_p, c_size_t]),
    "dpsync_shard": (_STATUS, [c_void_p, c_char_p, c_size_t, POINTER(c_size_t), POINTER(c_size_t)]),
    "dpsync_reduce_scatter_grads": (_STATUS, [c_void_p, c_uint32]),
    "dpsync_allgather": (_STATUS, [c_void_p, c_uint32]),
    "dpsync_bmuf_init": (_STATUS, [c_void_p, c_double, c_double, c_bool]),
    "dpsync_bmuf_step": (_STATUS, [c_void_p]),
    "dpsync_register_sparse": (_STATUS, [c_void_p, c_char_p, c_size_t, c_size_t, c_uint32, c_uint32, c_size_t]),
    "dpsync_sparse_set": (_STATUS, [c_void_p, c_char_p, c_size_t, c_void_p, c_void_p, c_size_t]),
    "dpsync_sparse_get": (
        _STATUS,
        [c_void_p, c_char_p, c_size_t, POINTER(c_void_p), POINTER(c_void_p), POINTER(c_size_t)],
    ),
}

_lock = threading.Lock()
_loaded: Optional[Tuple[ctypes.CDLL, str]] = None


def candidates() -> List[Tuple[str, str]]:
    """The (path, origin) pairs tried in order. DPSYNC_LIBRARY, when set, is the only one:
    falling back to another build would hide that the requested one (say the MPI build) is
    missing."""
    env = os.environ.get("DPSYNC_LIBRARY")
    if env:
        return [(env, "DPSYNC_LIBRARY")]
    found = [(os.path.join(_PACKAGE_DIR, LIBRARY_FILE), "bundled in the package")]
    # Running from a source checkout (python/dpsync/ inside the repository): cargo's output.
    repo = os.path.dirname(os.path.dirname(_PACKAGE_DIR))
    if os.path.isfile(os.path.join(repo, "Cargo.toml")):
        target = os.environ.get("CARGO_TARGET_DIR") or os.path.join(repo, "target")
        found.append((os.path.join(target, "release", LIBRARY_FILE), "source checkout"))
    found.append((LIBRARY_FILE, "the dynamic loader's search path"))
    return found


def load() -> Tuple[ctypes.CDLL, str]:
    """The loaded library and its path (loaded once per process)."""
    global _loaded
    if _loaded is not None:
        return _loaded
    with _lock:
        if _loaded is not None:
            return _loaded
        tried = []
        for path, origin in candidates():
            if os.sep in path and not os.path.isfile(path):
                tried.append("%s (%s): no such file" % (path, origin))
                continue
            try:
                lib = ctypes.CDLL(path)
            except OSError as e:
                tried.append("%s (%s): %s" % (path, origin, e))
                continue
            _declare(lib)
            _loaded = (lib, _resolved_path(lib, path))
            return _loaded
        raise OSError(
            "dpsync: cannot load %s; tried:\n  %s\n(pip install ./python builds it; "
            "DPSYNC_LIBRARY=/path/to/libdpsync.so selects a build)" % (LIBRARY_FILE, "\n  ".join(tried))
        )


def _declare(lib: ctypes.CDLL) -> None:
    for name, (restype, argtypes) in SIGNATURES.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes


def _resolved_path(lib: ctypes.CDLL, path: str) -> str:
    """The file the loader actually opened (a bare name is resolved through dladdr)."""
    if os.sep in path:
        return os.path.abspath(path)
    try:
        libdl = ctypes.CDLL(None)

        class DlInfo(ctypes.Structure):
            _fields_ = [("fname", c_char_p), ("fbase", c_void_p), ("sname", c_char_p), ("saddr", c_void_p)]

        info = DlInfo()
        addr = ctypes.cast(lib.dpsync_version, c_void_p)
        if libdl.dladdr(addr, ctypes.byref(info)) and info.fname:
            return os.path.abspath(info.fname.decode())
    except (OSError, AttributeError):
        pass
    return path
