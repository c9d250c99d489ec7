#!/usr/bin/env python3
"""Cost of one Python call: ctx.allreduce of 1 float32 on 2 host replicas, against the same C
call made through ctypes directly on the same library and context.

    python3 python/benchmarks/bench_call.py [--calls 100000] [--repeats 9]

Prints the median over alternating repetitions of the time per call for both, and the
difference (the package's own cost; target: at most 5 us). docs/PERFORMANCE.md, "Python".
"""

import argparse
import ctypes
import statistics
import sys
import time

import numpy as np

import dpsync


def per_call(fn, calls):
    start = time.perf_counter()
    for _ in range(calls):
        fn()
    return (time.perf_counter() - start) / calls


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--calls", type=int, default=100000)
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    with dpsync.Context(host_replicas=2) as ctx:
        x = [np.zeros(1, np.float32) for _ in range(2)]  # zeros: a sum that stays finite
        for r in range(2):
            ctx.register("x", x[r], "grad", r)
        lib = dpsync.library()
        handle = ctypes.c_void_p(ctx.handle)
        raw = lib.dpsync_allreduce

        def c_call():
            if raw(handle, b"x", 0):
                raise RuntimeError(lib.dpsync_last_error())

        def py_call():
            ctx.allreduce("x", "sum")

        for fn in (c_call, py_call):  # warm the plan cache and the interpreter
            per_call(fn, 1000)
        c_times, py_times = [], []
        for _ in range(args.repeats):
            c_times.append(per_call(c_call, args.calls))
            py_times.append(per_call(py_call, args.calls))
        c, py = statistics.median(c_times), statistics.median(py_times)
        print("library %s, Python %s" % (dpsync.library_path(), sys.version.split()[0]))
        print("%d x %d calls, median of the repetitions:" % (args.repeats, args.calls))
        print("  C call through ctypes:  %.3f us  (range %.3f-%.3f)" % (c * 1e6, min(c_times) * 1e6, max(c_times) * 1e6))
        print("  ctx.allreduce:          %.3f us  (range %.3f-%.3f)" % (py * 1e6, min(py_times) * 1e6, max(py_times) * 1e6))
        print("  package overhead:       %.3f us per call (target <= 5 us)" % ((py - c) * 1e6))
        assert (x[0] == x[1]).all()


if __name__ == "__main__":
    main()
