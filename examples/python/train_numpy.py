#!/usr/bin/env python3
"""Linear regression on 4 host replicas with dpsync and NumPy, checked against one model trained
on the full batch.

    python3 examples/python/train_numpy.py [--replicas 4] [--steps 200]

Each replica computes the gradient of its shard of every batch, scaled by ctx.loss_scale;
allreduce_grads sums them, so every replica takes the full batch's step. Exits 1 if the
replicas differ from each other or from the reference beyond float32 rounding.
"""

import argparse
import sys

import numpy as np

import dpsync


def gradient(w, b, x, y, scale):
    """d/d(w, b) of scale * mean((x @ w + b - y)^2), in float32."""
    err = x @ w + b - y
    k = np.float32(2.0 * scale / len(y))
    return (x.T @ err) * k, np.array([err.sum() * k], np.float32)


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    args = parser.parse_args()
    n, features = args.replicas, 8
    if args.batch % n:
        parser.error("--batch must be a multiple of --replicas")

    rng = np.random.default_rng(0)
    true_w = rng.standard_normal(features).astype(np.float32)
    w0 = rng.standard_normal(features).astype(np.float32)

    with dpsync.Context(host_replicas=n) as ctx:
        # Replica 0 starts from w0, the others from garbage: the broadcast makes them equal.
        ws = [w0.copy() if r == 0 else rng.standard_normal(features).astype(np.float32) for r in range(n)]
        bs = [np.zeros(1, np.float32) for _ in range(n)]
        gws = [np.zeros(features, np.float32) for _ in range(n)]
        gbs = [np.zeros(1, np.float32) for _ in range(n)]
        for r in range(n):
            ctx.register("w", ws[r], role="param", replica=r)
            ctx.register("b", bs[r], role="param", replica=r)
            ctx.register("w:grad", gws[r], role="grad", replica=r)
            ctx.register("b:grad", gbs[r], role="grad", replica=r)
        ctx.broadcast(roles="param", root=0)
        scale = ctx.loss_scale

        ref_w, ref_b = w0.copy(), np.zeros(1, np.float32)
        lr = np.float32(args.lr)
        shard = args.batch // n
        for step in range(args.steps):
            x = rng.standard_normal((args.batch, features)).astype(np.float32)
            y = (x @ true_w + np.float32(0.1) * rng.standard_normal(args.batch).astype(np.float32)).astype(np.float32)
            for r in range(n):
                rows = slice(r * shard, (r + 1) * shard)
                gws[r][:], gbs[r][:] = gradient(ws[r], bs[r], x[rows], y[rows], scale)
            ctx.allreduce_grads(op="sum")
            for r in range(n):
                ws[r] -= lr * gws[r]
                bs[r] -= lr * gbs[r]
            gw, gb = gradient(ref_w, ref_b, x, y, 1.0)
            ref_w -= lr * gw
            ref_b -= lr * gb
            if step % 50 == 0 or step == args.steps - 1:
                loss = float(np.mean((x @ ws[0] + bs[0] - y) ** 2))
                print("step %4d  loss %.5f" % (step, loss))

        failures = []
        for r in range(1, n):
            if ws[r].tobytes() != ws[0].tobytes() or bs[r].tobytes() != bs[0].tobytes():
                failures.append("replica %d differs from replica 0" % r)
        diff = max(float(np.abs(ws[0] - ref_w).max()), float(np.abs(bs[0] - ref_b).max()))
        tolerance = 1e-5  # float32 gradients summed in another order, over every step
        if diff > tolerance:
            failures.append("replicas differ from the full-batch model by %.3g (tolerance %g)" % (diff, tolerance))
        print("max |replica - full batch| = %.3g; |w - true w| = %.3g" % (diff, float(np.abs(ws[0] - true_w).max())))
    if failures:
        print("FAILED: " + "; ".join(failures))
        return 1
    print("ok: %d replicas bytewise equal and within %g of one model on the full batch" % (n, tolerance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
