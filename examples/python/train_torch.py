#!/usr/bin/env python3
"""A small CNN with batch norm on 4 host replicas through dpsync.torch (SGD with momentum),
checked against one model trained on the full batch.

    python3 examples/python/train_torch.py [--replicas 4] [--steps 30] [--fusion-bytes 4096]
                                           [--no-overlap] [--profile]

Synthetic data: 10 classes of 3x16x16 images (a fixed pattern per class plus noise). Each
replica trains on its shard of every batch; dpsync sums the gradients (overlap: bucket by
bucket as backward produces them). The reference model runs the same shards one after the
other and accumulates their gradients, so its batch norm normalises over the same samples.
At the end the replicas' batch-norm statistics are averaged, every replica must be bytewise
equal to replica 0, and the weights within a tolerance of the reference (exit 1 otherwise).
--profile reports the share of a step spent in the dpsync package (docs/PERFORMANCE.md).
Without torch it prints "skipped" and exits 0.
"""

import argparse
import copy
import cProfile
import os
import pstats
import sys
import time

try:
    import torch
    import torch.nn.functional as F
except ImportError as e:
    print("skipped: torch is not importable (%s)" % e)
    sys.exit(0)

import dpsync
import dpsync.torch


class SmallCNN(torch.nn.Module):
    def __init__(self, classes=10):
        super().__init__()
        self.conv1 = torch.nn.Conv2d(3, 8, 3, padding=1)
        self.bn1 = torch.nn.BatchNorm2d(8)
        self.conv2 = torch.nn.Conv2d(8, 16, 3, padding=1, stride=2)
        self.bn2 = torch.nn.BatchNorm2d(16)
        self.fc = torch.nn.Linear(16, classes)

    def forward(self, x):
        x = F.relu(self.bn1(self.conv1(x)))
        x = F.relu(self.bn2(self.conv2(x)))
        return self.fc(torch.flatten(F.adaptive_avg_pool2d(x, 1), 1))


def batches(steps, batch, classes=10, seed=1):
    g = torch.Generator().manual_seed(seed)
    patterns = torch.randn(classes, 3, 16, 16, generator=g)
    for _ in range(steps):
        y = torch.randint(0, classes, (batch,), generator=g)
        x = patterns[y] + 0.8 * torch.randn(batch, 3, 16, 16, generator=g)
        yield x, y


def train_replicas(ctx, models, opts, reg, data, n):
    scale = ctx.loss_scale  # 1 / replicas: summed gradients are the full batch's mean
    for step, (x, y) in enumerate(data):
        shard = len(y) // n
        for r in range(n):
            opts[r].zero_grad()  # PyTorch >= 2.0 sets the gradients to None: dpsync.torch puts them back
            rows = slice(r * shard, (r + 1) * shard)
            loss = F.cross_entropy(models[r](x[rows]), y[rows])
            (loss * scale).backward()
        ctx.allreduce_grads(op="sum")
        for o in opts:
            o.step()
        if step == 0:
            reg.register_optimizer_state()  # SGD creates its momentum buffers at the first step
        yield step, loss.item()


def train_reference(model, data, n, lr):
    opt = torch.optim.SGD(model.parameters(), lr=lr, momentum=0.9)
    for x, y in data:
        opt.zero_grad()
        shard = len(y) // n
        for r in range(n):
            rows = slice(r * shard, (r + 1) * shard)
            (F.cross_entropy(model(x[rows]), y[rows]) / n).backward()
        opt.step()


def package_share(profile):
    """Share of the profiled time in the dpsync package's functions. cProfile charges a ctypes
    call to its Python caller, so this includes the library's own C time: an upper bound."""
    stats = pstats.Stats(profile)
    package_dir = os.path.dirname(dpsync.__file__)
    own = sum(tt for (path, _, _), (_, _, tt, _, _) in stats.stats.items() if path.startswith(package_dir))
    return own, stats.total_tt


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--replicas", type=int, default=4)
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--lr", type=float, default=0.05)
    parser.add_argument("--fusion-bytes", type=int, default=4096, help="bucket size (small: several buckets)")
    parser.add_argument("--no-overlap", action="store_true", help="reduce everything in allreduce_grads")
    parser.add_argument("--profile", action="store_true", help="cProfile the training loop")
    args = parser.parse_args()
    n = args.replicas
    if args.batch % n:
        parser.error("--batch must be a multiple of --replicas")
    torch.manual_seed(0)
    torch.set_num_threads(1)  # the same kernels (and rounding) for the replicas and the reference
    initial = SmallCNN()
    models = [copy.deepcopy(initial) for _ in range(n)]
    opts = [torch.optim.SGD(m.parameters(), lr=args.lr, momentum=0.9) for m in models]

    with dpsync.Context(host_replicas=n, fusion_bytes=args.fusion_bytes) as ctx:
        reg = dpsync.torch.register_modules(ctx, models, optimizers=opts, overlap=not args.no_overlap)
        ctx.broadcast(roles=("param", "computed", "state"), root=0)
        print("torch %s, dpsync %s, %d replicas, %d GRAD tensors in %d buckets, overlap %s"
              % (torch.__version__, dpsync.version(), n, len(reg.names["grad"]), len(ctx.describe()["buckets"]),
                 not args.no_overlap))
        profile = cProfile.Profile() if args.profile else None
        start = time.perf_counter()
        if profile:
            profile.enable()
        for step, loss in train_replicas(ctx, models, opts, reg, batches(args.steps, args.batch), n):
            if step % 10 == 0 or step == args.steps - 1:
                print("step %3d  loss %.4f" % (step, loss))
        if profile:
            profile.disable()
        elapsed = time.perf_counter() - start
        print("%.2f ms per step" % (1000 * elapsed / args.steps))
        if profile:
            own, total = package_share(profile)
            print("profile: %.1f %% of the training loop in the dpsync package (%.0f of %.0f us per step under "
                  "cProfile, its C calls included)" % (100 * own / total, 1e6 * own / args.steps, 1e6 * total / args.steps))
        ctx.average("computed")  # batch-norm statistics: each replica saw its own shards

    failures = []
    for r in range(1, n):
        for (name, a), (_, b) in zip(models[0].state_dict().items(), models[r].state_dict().items()):
            if not torch.equal(a, b):
                failures.append("replica %d differs from replica 0 in %s" % (r, name))
        for p0, pr in zip(models[0].parameters(), models[r].parameters()):
            if not torch.equal(opts[0].state[p0]["momentum_buffer"], opts[r].state[pr]["momentum_buffer"]):
                failures.append("replica %d's momentum differs" % r)
    reference = copy.deepcopy(initial)
    train_reference(reference, batches(args.steps, args.batch), n, args.lr)
    worst = max(float((p - q).detach().abs().max()) for p, q in zip(models[0].parameters(), reference.parameters()))
    tolerance = 1e-4  # float32 gradients summed in another order, through 30 steps of momentum
    if worst > tolerance:
        failures.append("replicas differ from the full-batch model by %.3g (tolerance %g)" % (worst, tolerance))
    print("max |replica - full batch| = %.3g" % worst)
    if failures:
        print("FAILED: " + "; ".join(failures[:10]))
        return 1
    print("ok: %d replicas bytewise equal and within %g of one model on the full batch" % (n, tolerance))
    return 0


if __name__ == "__main__":
    sys.exit(main())
