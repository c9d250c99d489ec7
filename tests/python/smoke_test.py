#!/usr/bin/env python3
"""Smoke test of libdpsync.so through ctypes (standard library only).

    python3 tests/python/smoke_test.py [path/to/libdpsync.so]

Prints one line per check and ends with "N passed, M failed"; exits 1 if any check failed.
"""
import ctypes
import json
import os
import random
import re
import struct
import subprocess
import sys
from ctypes import POINTER, byref, c_char_p, c_double, c_int32, c_size_t, c_uint32, c_uint64, c_void_p

REPO_ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), "..", ".."))

OK, INVALID_ARGUMENT, NOT_FOUND, CONFLICT, INCONSISTENT, INVALID_STATE, UNAVAILABLE = range(7)
STATUS_NAMES = [
    "DPSYNC_STATUS_OK",
    "DPSYNC_STATUS_INVALID_ARGUMENT",
    "DPSYNC_STATUS_NOT_FOUND",
    "DPSYNC_STATUS_CONFLICT",
    "DPSYNC_STATUS_INCONSISTENT",
    "DPSYNC_STATUS_INVALID_STATE",
    "DPSYNC_STATUS_UNAVAILABLE",
    "DPSYNC_STATUS_BACKEND_ERROR",
    "DPSYNC_STATUS_TIMEOUT",
    "DPSYNC_STATUS_PANIC",
    "DPSYNC_STATUS_RANK_LOST",
]
F32, F64, I64 = 0, 1, 5
PARAM, GRAD, COMPUTED, STATE = 1, 2, 4, 8
SUM, AVG = 0, 1
TRANSPORT_NCCL = 1
NREP = 4

# A child process that creates a context on CUDA replica 0 and exits with the status, so the
# parent can check that nothing was printed on its stderr.
CHILD_CUDA_CREATE = r"""
import ctypes, sys
lib = ctypes.CDLL(sys.argv[1])
opts = ctypes.c_void_p()
lib.dpsync_options_new(ctypes.byref(opts))
ordinals = (ctypes.c_int32 * 1)(0)
lib.dpsync_options_set_cuda_replicas(opts, ordinals, ctypes.c_size_t(1))
ctx = ctypes.c_void_p()
st = lib.dpsync_context_create(opts, ctypes.byref(ctx))
sys.exit(st)
"""


def load(path):
    lib = ctypes.CDLL(path)
    status = c_uint32
    sigs = {
        "dpsync_version": (c_char_p, []),
        "dpsync_status_name": (c_char_p, [c_uint32]),
        "dpsync_last_error": (c_char_p, []),
        "dpsync_options_new": (status, [POINTER(c_void_p)]),
        "dpsync_options_free": (None, [c_void_p]),
        "dpsync_options_set_host_replicas": (status, [c_void_p, c_size_t]),
        "dpsync_options_set_cuda_replicas": (status, [c_void_p, POINTER(c_int32), c_size_t]),
        "dpsync_options_set_transport": (status, [c_void_p, c_uint32]),
        "dpsync_options_set_fusion_bytes": (status, [c_void_p, c_size_t]),
        "dpsync_options_set_timeout_ms": (status, [c_void_p, c_uint64]),
        "dpsync_context_create": (status, [c_void_p, POINTER(c_void_p)]),
        "dpsync_context_destroy": (status, [c_void_p]),
        "dpsync_replica_count": (status, [c_void_p, POINTER(c_size_t)]),
        "dpsync_loss_scale": (status, [c_void_p, POINTER(c_double)]),
        "dpsync_describe": (status, [c_void_p, c_char_p, c_size_t, POINTER(c_size_t)]),
        "dpsync_plan_describe": (status, [c_void_p, c_char_p, c_size_t, POINTER(c_size_t)]),
        "dpsync_register": (status, [c_void_p, c_char_p, c_uint32, c_size_t, c_void_p, c_size_t, c_uint32]),
        "dpsync_unregister": (status, [c_void_p, c_char_p]),
        "dpsync_allreduce_grads": (status, [c_void_p, c_uint32]),
        "dpsync_allreduce": (status, [c_void_p, c_char_p, c_uint32]),
        "dpsync_broadcast": (status, [c_void_p, c_uint32, c_size_t]),
        "dpsync_average": (status, [c_void_p, c_uint32]),
        "dpsync_shard": (status, [c_void_p, c_char_p, c_size_t, POINTER(c_size_t), POINTER(c_size_t)]),
        "dpsync_reduce_scatter_grads": (status, [c_void_p, c_uint32]),
        "dpsync_allgather": (status, [c_void_p, c_uint32]),
        "dpsync_register_sparse": (status, [c_void_p, c_char_p, c_size_t, c_size_t, c_uint32, c_uint32, c_size_t]),
        "dpsync_sparse_set": (status, [c_void_p, c_char_p, c_size_t, c_void_p, c_void_p, c_size_t]),
        "dpsync_sparse_get": (status, [c_void_p, c_char_p, c_size_t, POINTER(c_void_p), POINTER(c_void_p),
                                       POINTER(c_size_t)]),
    }
    for name, (restype, argtypes) in sigs.items():
        fn = getattr(lib, name)
        fn.restype = restype
        fn.argtypes = argtypes
    return lib


class DpsyncError(Exception):
    pass


class Smoke:
    def __init__(self, lib, lib_path):
        self.lib = lib
        self.lib_path = lib_path
        self.passed = 0
        self.failed = 0
        self.ctx = c_void_p()
        self.buffers = {}  # name -> list of ctypes arrays, one per replica (kept alive while registered)

    # ------------------------------------------------------------------ helpers

    def last_error(self):
        return (self.lib.dpsync_last_error() or b"").decode("utf-8", "replace")

    def call(self, fn, *args):
        st = getattr(self.lib, fn)(*args)
        if st != OK:
            raise DpsyncError("%s -> %s: %s" % (fn, self.lib.dpsync_status_name(st).decode(), self.last_error()))

    def expect_status(self, expected, fn, *args):
        st = getattr(self.lib, fn)(*args)
        if st != expected:
            raise AssertionError("%s returned %s, expected %s (%s)"
                                 % (fn, STATUS_NAMES[st] if st < len(STATUS_NAMES) else st,
                                    STATUS_NAMES[expected], self.last_error()))
        return self.last_error()

    def check(self, label, fn):
        try:
            detail = fn()
        except Exception as e:  # report and go on: one failure must not hide the others
            self.failed += 1
            print("FAIL %s: %s: %s" % (label, type(e).__name__, e))
        else:
            self.passed += 1
            print("ok   %s%s" % (label, ": " + detail if detail else ""))

    def register(self, name, role, dtype, values_per_replica):
        ctype = ctypes.c_float if dtype == F32 else ctypes.c_double
        arrays = []
        for r, values in enumerate(values_per_replica):
            arr = (ctype * len(values))(*values)
            arrays.append(arr)
            self.call("dpsync_register", self.ctx, name.encode(), role, r, ctypes.cast(arr, c_void_p), len(values), dtype)
        self.buffers[name] = arrays

    def snapshot(self):
        return {name: [bytes(a) for a in arrays] for name, arrays in self.buffers.items()}

    def describe_json(self, fn, handle):
        length = c_size_t(0)
        self.call(fn, handle, None, 0, byref(length))
        buf = ctypes.create_string_buffer(length.value + 1)
        self.call(fn, handle, buf, len(buf), byref(length))
        assert len(buf.value) == length.value, "sized length %d, written %d" % (length.value, len(buf.value))
        return json.loads(buf.value.decode("utf-8"))

    # ------------------------------------------------------------------ checks

    def check_version(self):
        v = self.lib.dpsync_version().decode()
        assert re.match(r"^\d+\.\d+\.\d+", v), "version %r" % v
        return v

    def check_status_names(self):
        for code, name in enumerate(STATUS_NAMES):
            got = self.lib.dpsync_status_name(code).decode()
            assert got == name, "status %d named %r, expected %r" % (code, got, name)
        got = self.lib.dpsync_status_name(1000).decode()
        assert got == "UNKNOWN", "status 1000 named %r" % got
        return "0..10 and UNKNOWN"

    def check_create(self):
        opts = c_void_p()
        self.call("dpsync_options_new", byref(opts))
        try:
            self.call("dpsync_options_set_host_replicas", opts, NREP)
            self.call("dpsync_options_set_fusion_bytes", opts, 64)  # several buckets even for tiny tensors
            self.call("dpsync_context_create", opts, byref(self.ctx))
        finally:
            self.lib.dpsync_options_free(opts)
        assert self.ctx.value, "context_create returned OK but no context"
        n = c_size_t(0)
        self.call("dpsync_replica_count", self.ctx, byref(n))
        assert n.value == NREP, "replica_count %d" % n.value
        return "%d host replicas" % NREP

    def check_loss_scale(self):
        s = c_double(0.0)
        self.call("dpsync_loss_scale", self.ctx, byref(s))
        assert s.value == 0.25, "loss_scale %r" % s.value
        return "0.25"

    def check_register(self):
        rng = random.Random(20240601)
        self.g32 = [[rng.uniform(-10, 10) for _ in range(37)] for _ in range(NREP)]
        self.g64 = [[rng.uniform(-10, 10) for _ in range(11)] for _ in range(NREP)]
        self.p32 = [[rng.uniform(-1, 1) for _ in range(9)] for _ in range(NREP)]
        self.register("g32", GRAD, F32, self.g32)
        self.register("g64", GRAD, F64, self.g64)
        self.register("p32", PARAM, F32, self.p32)
        # Read back through the f32 rounding so references start from the stored values.
        self.g32 = [list(a) for a in self.buffers["g32"]]
        self.p32 = [list(a) for a in self.buffers["p32"]]
        return "g32 (f32, 37), g64 (f64, 11), p32 (f32, 9) on %d replicas" % NREP

    def reference(self, per_replica, op, f32):
        """((r0 + r1) + r2) + r3, rounded to the dtype at every step, then / N for AVG."""
        rnd = (lambda x: struct.unpack("f", struct.pack("f", x))[0]) if f32 else (lambda x: x)
        out = []
        for i in range(len(per_replica[0])):
            s = per_replica[0][i]
            for r in range(1, len(per_replica)):
                s = rnd(s + per_replica[r][i])
            out.append(rnd(s / len(per_replica)) if op == AVG else s)
        return out

    def assert_all_replicas(self, name, expected):
        first = bytes(self.buffers[name][0])
        for r, arr in enumerate(self.buffers[name]):
            got = list(arr)
            for i, (g, e) in enumerate(zip(got, expected)):
                if g != e:
                    raise AssertionError("%s replica %d element %d: %r, expected %r (diff %.3g)"
                                         % (name, r, i, g, e, g - e))
            assert bytes(arr) == first, "%s: replica %d bytes differ from replica 0" % (name, r)

    def check_allreduce_sum(self):
        p_before = self.snapshot()["p32"]
        self.call("dpsync_allreduce_grads", self.ctx, SUM)
        self.g32 = self.reference(self.g32, SUM, True)
        self.g64 = self.reference(self.g64, SUM, False)
        self.assert_all_replicas("g32", self.g32)
        self.assert_all_replicas("g64", self.g64)
        assert self.snapshot()["p32"] == p_before, "allreduce_grads changed the PARAM tensor"
        return "f32 and f64 equal the fixed-order sums on every replica"

    def check_allreduce_avg(self):
        # Fresh, differing inputs: the SUM left every replica equal.
        rng = random.Random(7)
        for name in ("g32", "g64"):
            for arr in self.buffers[name]:
                for i in range(len(arr)):
                    arr[i] = rng.uniform(-100, 100)
        g32 = [list(a) for a in self.buffers["g32"]]
        g64 = [list(a) for a in self.buffers["g64"]]
        self.call("dpsync_allreduce", self.ctx, b"g32", AVG)
        self.call("dpsync_allreduce", self.ctx, b"g64", AVG)
        self.assert_all_replicas("g32", self.reference(g32, AVG, True))
        self.assert_all_replicas("g64", self.reference(g64, AVG, False))
        return "f32 and f64 equal sum / 4 on every replica"

    def check_broadcast(self):
        before = self.snapshot()
        self.call("dpsync_broadcast", self.ctx, PARAM, 3)
        self.assert_all_replicas("p32", self.p32[3])
        after = self.snapshot()
        assert after["g32"] == before["g32"] and after["g64"] == before["g64"], "broadcast(PARAM) changed a GRAD"
        return "p32 from root 3 on every replica, GRAD untouched"

    def check_describe(self):
        d = self.describe_json("dpsync_describe", self.ctx)
        assert d.get("transport") == "host", "transport %r" % d.get("transport")
        assert len(d.get("replicas", [])) == NREP, "replicas %r" % d.get("replicas")
        assert all(r.get("device") == "host" for r in d["replicas"]), "devices %r" % d["replicas"]
        grads = [t for b in d.get("buckets", []) for t in b.get("tensors", [])]
        assert grads == ["g64", "g32"], "bucketed GRAD tensors %r (expected reverse registration order)" % grads
        # snprintf semantics: truncated output, full length reported, still OK.
        length = c_size_t(0)
        small = ctypes.create_string_buffer(10)
        self.call("dpsync_describe", self.ctx, small, 10, byref(length))
        assert len(small.value) == 9 and length.value > 9, "truncated to %r, length %d" % (small.value, length.value)
        return "transport host, %d replicas, buckets %s" % (NREP, [b.get("tensors") for b in d["buckets"]])

    def check_plan_describe_nccl(self):
        opts = c_void_p()
        self.call("dpsync_options_new", byref(opts))
        try:
            ordinals = (c_int32 * 4)(0, 0, 1, 1)
            self.call("dpsync_options_set_cuda_replicas", opts, ordinals, 4)
            self.call("dpsync_options_set_transport", opts, TRANSPORT_NCCL)
            d = self.describe_json("dpsync_plan_describe", opts)
        finally:
            self.lib.dpsync_options_free(opts)
        assert d.get("transport") == "nccl", "transport %r" % d.get("transport")
        devices = [r.get("device") for r in d.get("replicas", [])]
        assert devices == ["cuda:0", "cuda:0", "cuda:1", "cuda:1"], "devices %r" % devices
        return "CUDA [0,0,1,1] + NCCL plans transport nccl, devices %s" % devices

    def check_cuda_unavailable(self):
        opts = c_void_p()
        self.call("dpsync_options_new", byref(opts))
        try:
            ordinals = (c_int32 * 2)(0, 0)
            self.call("dpsync_options_set_cuda_replicas", opts, ordinals, 2)
            ctx = c_void_p()
            st = self.lib.dpsync_context_create(opts, byref(ctx))
            if st != UNAVAILABLE:
                if ctx.value:
                    self.lib.dpsync_context_destroy(ctx)
                return "skipped: a CUDA driver is present (status %d)" % st
            msg = self.lib.dpsync_last_error().decode()
        finally:
            self.lib.dpsync_options_free(opts)
        assert ctx.value is None, "*out was written on failure"
        assert "libcuda" in msg, "message does not name the missing library: %r" % msg
        # Nothing may reach stderr on this path (cudarc would print and panic without a check).
        child = subprocess.run(
            [sys.executable, "-c", CHILD_CUDA_CREATE, self.lib_path],
            capture_output=True, text=True, timeout=60)
        assert child.returncode == 6, "child: status %r, stderr %r" % (child.returncode, child.stderr)
        assert child.stderr == "", "stderr was written: %r" % child.stderr
        return "UNAVAILABLE (%s), stderr empty" % msg

    def pieces(self, count):
        """World replica w's piece of a tensor of `count` elements: [count*w/N, count*(w+1)/N)."""
        return [(count * w // NREP, count * (w + 1) // NREP - count * w // NREP) for w in range(NREP)]

    def check_shard(self):
        for name, count in (("g32", 37), ("g64", 11), ("p32", 9)):
            for r, want in enumerate(self.pieces(count)):
                offset, n = c_size_t(99), c_size_t(99)
                self.call("dpsync_shard", self.ctx, name.encode(), r, byref(offset), byref(n))
                assert (offset.value, n.value) == want, "%s replica %d: piece %r, expected %r" % (
                    name, r, (offset.value, n.value), want)
        offset, n = c_size_t(99), c_size_t(99)
        msg = self.expect_status(NOT_FOUND, "dpsync_shard", self.ctx, b"no_such_tensor", 0, byref(offset), byref(n))
        assert "no_such_tensor" in msg, "message does not name the tensor: %r" % msg
        msg2 = self.expect_status(INVALID_ARGUMENT, "dpsync_shard", self.ctx, b"g32", NREP, byref(offset), byref(n))
        assert "replica" in msg2, "message does not name the replica: %r" % msg2
        self.expect_status(INVALID_ARGUMENT, "dpsync_shard", self.ctx, b"g32", 0, None, byref(n))
        assert (offset.value, n.value) == (99, 99), "a failed dpsync_shard wrote its outputs"
        return "g32 %s; NOT_FOUND (%s); INVALID_ARGUMENT (%s)" % (self.pieces(37), msg, msg2)

    def check_reduce_scatter(self):
        # Fresh, differing inputs; each replica must end with the sums in its own pieces only.
        rng = random.Random(11)
        for name in ("g32", "g64"):
            for arr in self.buffers[name]:
                for i in range(len(arr)):
                    arr[i] = rng.uniform(-100, 100)
        before = {name: [list(a) for a in self.buffers[name]] for name in ("g32", "g64")}
        p_before = self.snapshot()["p32"]
        self.call("dpsync_reduce_scatter_grads", self.ctx, SUM)
        for name, f32 in (("g32", True), ("g64", False)):
            total = self.reference(before[name], SUM, f32)
            for r, arr in enumerate(self.buffers[name]):
                first, n = self.pieces(len(arr))[r]
                for i, got in enumerate(arr):
                    want = total[i] if first <= i < first + n else before[name][r][i]
                    if got != want:
                        raise AssertionError("%s replica %d element %d (piece [%d, %d)): %r, expected %r"
                                             % (name, r, i, first, first + n, got, want))
        assert self.snapshot()["p32"] == p_before, "reduce_scatter_grads changed the PARAM tensor"
        # The pieces put together again: every replica holds the whole sums.
        self.call("dpsync_allgather", self.ctx, GRAD)
        self.assert_all_replicas("g32", self.reference(before["g32"], SUM, True))
        self.assert_all_replicas("g64", self.reference(before["g64"], SUM, False))
        return "sums in the owned pieces only, the rest untouched; allgather(GRAD) completes them"

    def check_allgather(self):
        for r, arr in enumerate(self.buffers["p32"]):
            for i in range(len(arr)):
                arr[i] = float(100 * r + i)
        want = []
        for w, (first, n) in enumerate(self.pieces(9)):
            want += [float(100 * w + i) for i in range(first, first + n)]
        grads = {name: self.snapshot()[name] for name in ("g32", "g64")}
        self.call("dpsync_allgather", self.ctx, PARAM)
        self.assert_all_replicas("p32", want)
        after = self.snapshot()
        assert all(after[name] == grads[name] for name in grads), "allgather(PARAM) changed a GRAD"
        before = self.snapshot()
        msg = self.expect_status(INVALID_ARGUMENT, "dpsync_allgather", self.ctx, 0)
        self.expect_status(INVALID_ARGUMENT, "dpsync_reduce_scatter_grads", self.ctx, 7)
        assert self.snapshot() == before, "a failed call changed tensor data"
        self.p32 = [list(a) for a in self.buffers["p32"]]
        return "p32 = the owners' pieces on every replica, GRAD untouched; roles 0 -> INVALID_ARGUMENT (%s)" % msg

    def check_not_found(self):
        msg = self.expect_status(NOT_FOUND, "dpsync_allreduce", self.ctx, b"no_such_tensor", SUM)
        assert "no_such_tensor" in msg, "message does not name the tensor: %r" % msg
        return "NOT_FOUND (%s)" % msg

    def check_inconsistent(self):
        # 'bad' has 3 elements on replicas 0-2 but 4 on replica 3: register accepts it, the
        # collective that touches it refuses, and no byte of any tensor moves.
        arrays = []
        for r in range(NREP):
            n = 4 if r == 3 else 3
            arr = (ctypes.c_float * n)(*[float(10 * r + i) for i in range(n)])
            arrays.append(arr)
            self.call("dpsync_register", self.ctx, b"bad", COMPUTED, r, ctypes.cast(arr, c_void_p), n, F32)
        self.buffers["bad"] = arrays
        before = self.snapshot()
        msg = self.expect_status(INCONSISTENT, "dpsync_allreduce", self.ctx, b"bad", SUM)
        assert "'bad'" in msg, "message does not name the tensor 'bad': %r" % msg
        assert "replica" in msg, "message does not name a replica: %r" % msg
        msg2 = self.expect_status(INCONSISTENT, "dpsync_average", self.ctx, COMPUTED)
        assert self.snapshot() == before, "a failed call changed tensor data"
        self.call("dpsync_unregister", self.ctx, b"bad")
        self.call("dpsync_allreduce_grads", self.ctx, SUM)  # the context stays usable
        return "INCONSISTENT (%s / %s), data untouched" % (msg, msg2)

    def check_sparse(self):
        # Replica r sets r rows (replica 0 none) of row_len 2 with i64 indices; every replica
        # then reads all rows in world order.
        for r in range(NREP):
            self.call("dpsync_register_sparse", self.ctx, b"emb", r, 2, F32, I64, 100)
        keep = []
        want_idx, want_val = [], []
        for r in range(NREP):
            idx = (ctypes.c_int64 * max(r, 1))(*[10 * r + k for k in range(r)])
            val = (ctypes.c_float * max(2 * r, 1))(*[float(100 * r + k) for k in range(2 * r)])
            keep += [idx, val]
            want_idx += list(idx)[:r]
            want_val += list(val)[: 2 * r]
            self.call("dpsync_sparse_set", self.ctx, b"emb", r, ctypes.cast(idx, c_void_p),
                      ctypes.cast(val, c_void_p), r)
        self.call("dpsync_allreduce_grads", self.ctx, SUM)
        for r in range(NREP):
            pi, pv, rows = c_void_p(), c_void_p(), c_size_t(0)
            self.call("dpsync_sparse_get", self.ctx, b"emb", r, byref(pi), byref(pv), byref(rows))
            got_idx = list(ctypes.cast(pi, POINTER(ctypes.c_int64))[: rows.value])
            got_val = list(ctypes.cast(pv, POINTER(ctypes.c_float))[: 2 * rows.value])
            assert (got_idx, got_val) == (want_idx, want_val), "replica %d: %r %r" % (r, got_idx, got_val)
        # The slices were consumed: a step without them names the gradient and a replica.
        msg = self.expect_status(INCONSISTENT, "dpsync_allreduce_grads", self.ctx, SUM)
        assert "'emb'" in msg and "replica 0" in msg, "message %r" % msg
        self.call("dpsync_unregister", self.ctx, b"emb")
        return "%d rows gathered in world order on every replica; unset slice -> INCONSISTENT" % len(want_idx)

    def run(self):
        self.check("version string", self.check_version)
        self.check("status names", self.check_status_names)
        self.check("options + context create", self.check_create)
        if not self.ctx.value:
            print("cannot go on without a context")
        else:
            self.check("loss scale", self.check_loss_scale)
            self.check("register f32 and f64 tensors", self.check_register)
            self.check("allreduce_grads SUM", self.check_allreduce_sum)
            self.check("allreduce AVG", self.check_allreduce_avg)
            self.check("broadcast from root 3", self.check_broadcast)
            self.check("describe JSON", self.check_describe)
            self.check("shard pieces, unknown name, replica out of range", self.check_shard)
            self.check("reduce_scatter_grads SUM", self.check_reduce_scatter)
            self.check("allgather PARAM, roles 0", self.check_allgather)
            self.check("unknown name -> NOT_FOUND", self.check_not_found)
            self.check("count mismatch -> INCONSISTENT", self.check_inconsistent)
            self.check("sparse gradient gather", self.check_sparse)
        self.check("plan_describe CUDA + NCCL", self.check_plan_describe_nccl)
        self.check("context_create with CUDA replicas -> UNAVAILABLE", self.check_cuda_unavailable)
        if self.ctx.value:
            self.check("context destroy", lambda: self.call("dpsync_context_destroy", self.ctx))
        print("%d passed, %d failed" % (self.passed, self.failed))
        return 0 if self.failed == 0 else 1


def main():
    path = sys.argv[1] if len(sys.argv) > 1 else os.path.join(REPO_ROOT, "target", "release", "libdpsync.so")
    if not os.path.isfile(path):
        print("library not found at %s (run cargo build --release first)" % path)
        print("0 passed, 1 failed")
        return 1
    print("library: %s" % path)
    return Smoke(load(path), path).run()


if __name__ == "__main__":
    sys.exit(main())
