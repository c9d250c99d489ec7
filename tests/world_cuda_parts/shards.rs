//! Shards with NCCL across the ranks (`mpirun -n 2` and `-n 3`, one replica per GPU: rank 0
//! on GPUs 0 and 1, rank 1 on GPU 0, rank 2 on GPU 1, so the clique's blocks are even):
//! `dpsync_reduce_scatter_grads` through `ncclReduceScatter` over owner-packed blocks gives
//! each replica the sums in its pieces alone and sends half of what `dpsync_allreduce_grads`
//! sends; `dpsync_allgather` through `ncclAllGather` gives every replica the owners' pieces and
//! sends as much as the reduce-scatter (the fake NCCL's counts; a real NCCL checks the values).

use super::*;
use common::fake_nccl::*;

/// Each rank's CUDA ordinals: one replica per GPU where there are two (the fakes give each
/// rank two).
fn even_layout(rank: usize) -> Vec<i32> {
    let gpus = common::place::device_count().clamp(1, 2) as i32;
    [&[0, 1][..], &[0], &[1]][rank]
        .iter()
        .map(|&d| d % gpus)
        .collect()
}

#[test]
fn shards_across_ranks_over_nccl() {
    if under_mpirun() {
        return;
    }
    for n in [2, 3] {
        launch("shards::nccl_shards_body", n, 300, None);
    }
}

#[test]
fn nccl_shards_body() {
    let Some((rank, ranks)) = as_rank("nccl_shards_body") else {
        return;
    };
    let Some(place) = Place::gpus("nccl_shards_body", 1) else {
        return;
    };
    let shared_gpu = ranks > 1
        && common::place::device_count() == 1
        && std::env::var_os("NCCL_MULTI_RANK_GPU_ENABLE").is_none();
    if shared_gpu {
        println!("nccl_shards_body: skipped: the ranks share the one GPU (NCCL >= 2.30 with NCCL_MULTI_RANK_GPU_ENABLE=1 allows it)");
        return;
    }
    let sizes: Vec<usize> = (0..ranks).map(|r| even_layout(r).len()).collect();
    let (local, total) = (sizes[rank], sizes.iter().sum::<usize>());
    let offset: usize = sizes[..rank].iter().sum();
    let ordinals = &even_layout(rank);
    let Some(ctx) = cuda_context("nccl_shards_body", ordinals, |o| world(o, T_NCCL)) else {
        return;
    };
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    assert_eq!(ctx.describe_json()["world"]["cross_rank"], "nccl");
    // NCCL ranks: this rank's GPUs, and the clique's; with one replica on each, the blocks
    // hold a piece each and are even.
    let gpus = |r: usize| {
        let mut o = even_layout(r);
        o.dedup();
        o.len() as u64
    };
    let clique: u64 = (0..ranks).map(gpus).sum();
    let even = clique == total as u64;
    // Two f32 gradients (one bucket) and an i64 one; counts of 3's and 4's multiples: the
    // blocks are even on 2 ranks (3 replicas) and 3 (4 replicas).
    let grads = [("g0", 1200usize, F32), ("g1", 600, F32), ("h", 12, I64)];
    let init = |w: usize, n: usize, dtype: u32| -> Vec<u8> {
        match dtype {
            F32 => bytes_of(&(0..n).map(|i| value(w, i) as f32).collect::<Vec<_>>()),
            _ => bytes_of(&(0..n).map(|i| value(w, i) << 40).collect::<Vec<_>>()),
        }
    };
    let mut mems: Vec<Vec<Mem>> = (grads.iter())
        .map(|&(_, n, dtype)| {
            (0..local)
                .map(|k| place.mem_on(ordinals[k], &init(offset + k, n, dtype)))
                .collect()
        })
        .collect();
    for (&(name, n, dtype), per) in grads.iter().zip(&mems) {
        for (k, mem) in per.iter().enumerate() {
            let st = register_raw(ctx.0, name, GRAD, k, mem.ptr() as *mut _, n, dtype);
            check(st, &tag(name));
        }
    }
    let sum = |i: usize| ((i + 1) * total * (total + 1) / 2) as i64;
    for op in [SUM, AVG] {
        // The sums (small integers: exact in any order) in each replica's piece alone.
        let want = |dtype: u32, i: usize| -> Vec<u8> {
            match (dtype, op) {
                (F32, SUM) => bytes_of(&[sum(i) as f32]),
                (F32, _) => bytes_of(&[(sum(i) as f64 / total as f64) as f32]),
                (_, SUM) => bytes_of(&[sum(i) << 40]),
                _ => bytes_of(&[(sum(i) << 40) / total as i64]),
            }
        };
        for (&(_, n, dtype), per) in grads.iter().zip(mems.iter_mut()) {
            for (k, mem) in per.iter_mut().enumerate() {
                mem.write(&init(offset + k, n, dtype));
            }
        }
        let what = tag(&format!("reduce_scatter_grads op {op}"));
        // SAFETY: a live context.
        let rs = sent_by(&ctx, &what, || unsafe {
            dpsync_reduce_scatter_grads(ctx.0, op)
        });
        for (&(name, n, dtype), per) in grads.iter().zip(&mems) {
            let size = if dtype == F32 { 4 } else { 8 };
            for (k, mem) in per.iter().enumerate() {
                let (got, before) = (mem.read(), init(offset + k, n, dtype));
                let (lo, hi) = (n * (offset + k) / total, n * (offset + k + 1) / total);
                for i in 0..n {
                    let want = match (lo..hi).contains(&i) {
                        true => want(dtype, i),
                        false => before[i * size..(i + 1) * size].to_vec(),
                    };
                    let at = format!("{what}: {name}[{i}] on replica {k} (owns {lo}..{hi})");
                    assert_eq!(got[i * size..(i + 1) * size], want, "{at}");
                }
            }
        }
        let what = tag(&format!("allreduce_grads op {op}"));
        let ar = sent_by(&ctx, &what, || ctx.allreduce_grads(op));
        if let (Some(rs), Some(ar)) = (rs, ar) {
            // Per NCCL rank a ring allreduce sends 2 (n-1)/n of each bucket, a reduce-scatter
            // (n-1)/n: half (where nothing is padded). One call per bucket (two) and GPU.
            assert_eq!(
                rs[ALLREDUCE],
                (0, 0),
                "{what}: no allreduce in the reduce-scatter"
            );
            assert_eq!(rs[REDUCE_SCATTER].1, 2 * gpus(rank), "{what}: {rs:?}");
            if even {
                let half = 2 * rs[REDUCE_SCATTER].0 == ar[ALLREDUCE].0;
                assert!(
                    half,
                    "{what}: half the allreduce's bytes: {rs:?} against {ar:?}"
                );
            }
        }
    }

    // The allgather: each replica's parameters hold its own mark in its pieces and another
    // value elsewhere; every replica ends with every owner's.
    let mark = |w: usize, i: usize| ((w * 7 + i) % 13) as f64;
    let n = 1200;
    let p: Vec<Mem> = (0..local)
        .map(|k| {
            let w = offset + k;
            let (lo, hi) = (n * w / total, n * (w + 1) / total);
            let v: Vec<f64> = (0..n)
                .map(|i| mark(w, i) + f64::from(u8::from(!(lo..hi).contains(&i))))
                .collect();
            place.mem_on(ordinals[k], &bytes_of(&v))
        })
        .collect();
    for (k, mem) in p.iter().enumerate() {
        let st = register_raw(ctx.0, "p", PARAM, k, mem.ptr() as *mut _, n, F64);
        check(st, &tag("register p"));
    }
    // SAFETY: a live context.
    let ag = sent_by(&ctx, &tag("allgather"), || unsafe {
        dpsync_allgather(ctx.0, PARAM)
    });
    let owner = |i: usize| (0..total).find(|&w| i < n * (w + 1) / total).unwrap();
    let want: Vec<f64> = (0..n).map(|i| mark(owner(i), i)).collect();
    for (k, mem) in p.iter().enumerate() {
        let got = from_bytes::<f64>(&mem.read());
        assert_eq!(got, want, "{}", tag(&format!("allgather into replica {k}")));
    }
    if let Some(ag) = ag {
        // One call per GPU, each sending (n-1) blocks: as much as a reduce-scatter.
        assert_eq!(ag[ALLGATHER].1, gpus(rank), "{}", tag(&format!("{ag:?}")));
        if even {
            let block = (n * 8 / total) as u64;
            let bytes = gpus(rank) * (clique - 1) * block;
            assert_eq!(ag[ALLGATHER].0, bytes, "{}", tag(&format!("{ag:?}")));
        }
        assert_eq!(
            ag[BROADCAST],
            (0, 0),
            "{}",
            tag("no broadcast in the allgather")
        );
    }
}
