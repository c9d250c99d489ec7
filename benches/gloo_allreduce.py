#!/usr/bin/env python3
"""torch.distributed's Gloo all_reduce on the sizes of benches/world_allreduce.rs: the figure a
user would otherwise get. Run by that benchmark under `mpirun -n 2` when PyTorch is installed
(Debian's python3-torch): each rank reads its rank from Open MPI's environment and joins a Gloo
group over TCP on loopback.

    mpirun --allow-run-as-root --oversubscribe -n 2 python3 benches/gloo_allreduce.py [--quick]
"""
import os
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.distributed as dist

QUICK = "--quick" in sys.argv


def timed(reps, fn):
    """Median seconds of `reps` runs of fn, after one warm-up; ranks start together."""
    fn()
    times = []
    for _ in range(reps):
        dist.barrier()
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    return statistics.median(times)


def resnet_sizes():
    path = Path(__file__).parent / "data" / "resnet50_params.tsv"
    sizes = []
    for line in path.read_text().splitlines():
        if line.startswith("#") or not line.strip():
            continue
        sizes.append(int(line.split("\t")[2]))
    return sizes


def main():
    rank = int(os.environ.get("OMPI_COMM_WORLD_RANK", os.environ.get("PMI_RANK", "0")))
    size = int(os.environ.get("OMPI_COMM_WORLD_SIZE", os.environ.get("PMI_SIZE", "1")))
    dist.init_process_group("gloo", init_method="tcp://127.0.0.1:29517", rank=rank, world_size=size)
    reps = 3 if QUICK else 9
    out = []
    n = (1 << 20) if QUICK else (16 << 20)
    big = torch.ones(n)
    t = timed(reps, lambda: dist.all_reduce(big))
    out.append(f"Gloo all_reduce, {size} ranks, one {n * 4 >> 20} MiB f32 tensor: {t * 1e3:.2f} ms")
    sizes = resnet_sizes()
    tensors = [torch.ones(s) for s in sizes]
    flat = torch.ones(sum(sizes))
    t_many = timed(reps, lambda: [dist.all_reduce(x) for x in tensors])
    t_one = timed(reps, lambda: dist.all_reduce(flat))
    out.append(
        f"Gloo all_reduce, ResNet-50 ({len(sizes)} tensors, {sum(sizes) / 1e6:.1f} M f32): "
        f"{len(sizes)} calls {t_many * 1e3:.2f} ms | one call of the total {t_one * 1e3:.2f} ms"
    )
    one = torch.ones(1)
    calls = 200 if QUICK else 5000

    def loop():
        for _ in range(calls):
            dist.all_reduce(one)

    t = timed(reps, loop)
    out.append(f"Gloo all_reduce, 1 float across {size} ranks: {t / calls * 1e6:.2f} us per call")
    if rank == 0:
        print("\n".join(out), flush=True)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
