//! Host-memory tensors on CUDA replicas across the ranks (staged world): 3 ranks holding 1, 2
//! and 1 replicas, the 2-replica rank on two GPUs, so that its host tensors' levels must still
//! be one group of both replicas (not one per GPU).

use super::*;

/// Each rank's CUDA ordinals: one replica, two on distinct GPUs, one.
fn host_layout(rank: usize) -> Vec<i32> {
    let gpus = common::place::device_count().clamp(1, 2) as i32;
    [&[0][..], &[0, 1][..], &[1][..]][rank]
        .iter()
        .map(|&d| d % gpus)
        .collect()
}

#[test]
fn host_tensors_on_cuda_replicas_across_ranks() {
    if under_mpirun() {
        return;
    }
    launch("host_memory::host_memory_rank_body", 3, 300, None);
}

/// As every rank: a host COMPUTED f32 (allreduce SUM, average) and a host GRAD beside a device
/// GRAD (allreduce_grads SUM, AVG), every local replica checked.
#[test]
fn host_memory_rank_body() {
    let Some((rank, ranks)) = as_rank("host_memory_rank_body") else {
        return;
    };
    let Some(place) = Place::gpus("host_memory_rank_body", 1) else {
        return;
    };
    let sizes: Vec<usize> = (0..ranks).map(|r| host_layout(r).len()).collect();
    let (local, total, offset) = (
        sizes[rank],
        sizes.iter().sum::<usize>(),
        sizes[..rank].iter().sum::<usize>(),
    );
    let ordinals = &host_layout(rank);
    let Some(ctx) = cuda_context("host_memory_rank_body", ordinals, |o| world(o, T_PEER_COPY))
    else {
        return;
    };
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    let n = 5;
    let init = |w: usize| -> Vec<f32> { (0..n).map(|i| value(w, i) as f32).collect() };
    let sum = |i: usize| ((i + 1) * total * (total + 1) / 2) as f32;
    let mut stat: Vec<Vec<f32>> = (0..local).map(|k| init(offset + k)).collect();
    let mut grad: Vec<Vec<f32>> = (0..local).map(|k| init(offset + k)).collect();
    let mut dev: Vec<Mem> = (0..local)
        .map(|k| place.mem_on(ordinals[k], &bytes_of(&init(offset + k))))
        .collect();
    for k in 0..local {
        ctx.reg("stat", COMPUTED, k, &mut stat[k], F32);
        ctx.reg("host_grad", GRAD, k, &mut grad[k], F32);
        let ptr = dev[k].ptr() as *mut _;
        let st = register_raw(ctx.0, "dev_grad", GRAD, k, ptr, n, F32);
        check(st, &tag("register dev_grad"));
    }
    let d = ctx.describe_json();
    assert_eq!(d["world"]["cross_rank"], "mpi_staged", "{d}");

    let expect = |got: &[f32], want: &dyn Fn(usize) -> f32, what: &str| {
        for i in 0..n {
            assert_eq!(got[i], want(i), "{}", tag(&format!("{what}[{i}]")));
        }
    };
    check(ctx.allreduce("stat", SUM), &tag("allreduce stat SUM"));
    check(common::place::synchronize(&ctx), &tag("synchronize"));
    for k in 0..local {
        expect(&stat[k], &sum, &format!("stat SUM, replica {k}"));
    }
    for k in 0..local {
        stat[k].copy_from_slice(&init(offset + k));
    }
    check(ctx.average(COMPUTED), &tag("average COMPUTED"));
    check(common::place::synchronize(&ctx), &tag("synchronize"));
    let avg = |i: usize| (sum(i) as f64 / total as f64) as f32;
    for k in 0..local {
        expect(&stat[k], &avg, &format!("stat AVG, replica {k}"));
    }

    check(ctx.allreduce_grads(SUM), &tag("allreduce_grads SUM"));
    check(common::place::synchronize(&ctx), &tag("synchronize"));
    for k in 0..local {
        expect(&grad[k], &sum, &format!("host_grad SUM, replica {k}"));
        let d = from_bytes::<f32>(&dev[k].read());
        expect(&d, &sum, &format!("dev_grad SUM, replica {k}"));
    }
    for k in 0..local {
        grad[k].copy_from_slice(&init(offset + k));
        dev[k].write(&bytes_of(&init(offset + k)));
    }
    check(ctx.allreduce_grads(AVG), &tag("allreduce_grads AVG"));
    check(common::place::synchronize(&ctx), &tag("synchronize"));
    for k in 0..local {
        expect(&grad[k], &avg, &format!("host_grad AVG, replica {k}"));
        let d = from_bytes::<f32>(&dev[k].read());
        expect(&d, &avg, &format!("dev_grad AVG, replica {k}"));
    }
}
