"""grad_ready (overlap) from one thread per replica, as backward threads call it."""

import threading

import pytest

import dpsync

from conftest import np, rng

N, TENSORS, STEPS = 4, 12, 5


def test_grad_ready_from_threads_gives_the_plain_step_s_bytes():
    g = rng(3)
    with dpsync.Context(host_replicas=N, fusion_bytes=256) as ctx:
        grads = [[np.zeros(16 + t, np.float32) for t in range(TENSORS)] for _ in range(N)]
        for t in range(TENSORS):
            for r in range(N):
                ctx.register("g%d" % t, grads[r][t], "grad", r)
        assert len(ctx.describe()["buckets"]) > 2, "several buckets, so some can start early"
        for step in range(STEPS):
            inputs = [[g.standard_normal(16 + t).astype(np.float32) for t in range(TENSORS)] for _ in range(N)]
            for r in range(N):
                for t in range(TENSORS):
                    grads[r][t][:] = inputs[r][t]
            errors = []

            def backward(replica):
                try:
                    for t in reversed(range(TENSORS)):  # backward produces the last tensor first
                        ctx.grad_ready("g%d" % t, replica)
                except Exception as e:  # reported by the main thread
                    errors.append(e)

            threads = [threading.Thread(target=backward, args=(r,)) for r in range(N)]
            for th in threads:
                th.start()
            for th in threads:
                th.join()
            assert errors == []
            ctx.allreduce_grads("avg")
            overlap = ctx.describe()["overlap"]
            if step > 0:  # nothing starts early before the first allreduce_grads sets the op
                assert overlap["buckets_reduced_early_last_step"] == len(ctx.describe()["buckets"])
            for t in range(TENSORS):
                s = inputs[0][t].copy()
                for r in range(1, N):
                    s = s + inputs[r][t]
                want = (s / np.float32(N)).astype(np.float32)
                for r in range(N):
                    assert grads[r][t].tobytes() == want.tobytes(), (step, t, r)


def test_grad_ready_argument_errors(ctx4):
    p = [np.zeros(2, np.float32) for _ in range(4)]
    for r in range(4):
        ctx4.register("p", p[r], "param", r)
    with pytest.raises(dpsync.InvalidArgument):
        ctx4.grad_ready("p", 0)  # not a GRAD
    with pytest.raises(dpsync.InvalidArgument):
        ctx4.grad_ready("p", -1)
