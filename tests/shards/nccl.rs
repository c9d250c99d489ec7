//! NCCL cliques in one process (scripts/fake-cuda.sh runs the tests named `*across*` on four
//! fake GPUs). Two GPUs: the reduce-scatter goes through `ncclReduceScatter` over owner-packed
//! blocks (the allreduce's bytes: each element is one addition of the two GPUs' sums) and sends
//! half of what the allreduce sends; the allgather goes through `ncclAllGather` and sends as
//! much as the reduce-scatter. Three GPUs: floats keep the allreduce's combine (one process
//! must give the allreduce's bytes, and NCCL promises no common order), integers take the
//! reduce-scatter. The counts are the fake NCCL's (`fake_nccl_sent_bytes`, `fake_nccl_calls`);
//! on a real NCCL only the values are checked.

use super::*;
use common::fake_nccl::*;

/// Tensor `t` of replica `r`: values whose sums are exact in f32 and i32 in any order.
fn initial(dtype: DType, r: usize, t: usize, n: usize) -> Vec<u8> {
    let scale = if dtype == DType::I32 { 1.0 } else { 0.25 };
    let v: Vec<f64> = (0..n)
        .map(|i| (((r * 7 + t * 3 + i * 5) % 17) as f64 - 8.0) * scale)
        .collect();
    encode(dtype, &v)
}

/// A context of CUDA replicas on `ordinals` over NCCL with tensors of `counts` elements of
/// `dtype` (one bucket), and their memory (`mems[t][r]`).
fn registered(
    place: &Place,
    test: &str,
    ordinals: &[i32],
    dtype: DType,
    counts: &[usize],
) -> (Context, Vec<Vec<Mem>>) {
    let ctx = (place.context(test, ordinals, T_NCCL, false)).expect("an NCCL context here");
    let mems: Vec<Vec<Mem>> = (counts.iter().enumerate())
        .map(|(t, &n)| {
            (ordinals.iter().enumerate())
                .map(|(r, &d)| place.mem_on(d, &initial(dtype, r, t, n)))
                .collect()
        })
        .collect();
    for (t, per) in mems.iter().enumerate() {
        for (r, m) in per.iter().enumerate() {
            let (name, ptr) = (format!("g{t}"), m.ptr() as *mut c_void);
            check(
                register_raw(ctx.0, &name, GRAD, r, ptr, counts[t], dtype.code()),
                "register",
            );
        }
    }
    (ctx, mems)
}

fn refill(mems: &mut [Vec<Mem>], dtype: DType, counts: &[usize]) {
    for (t, per) in mems.iter_mut().enumerate() {
        for (r, m) in per.iter_mut().enumerate() {
            m.write(&initial(dtype, r, t, counts[t]));
        }
    }
}

/// Reduce-scatters the registered tensors after an allreduce of the same values: each
/// replica's piece holds the allreduce's bytes and nothing else changed; then the allgather
/// leaves every replica with the allreduce's result. What each step sent (allreduce,
/// reduce-scatter, allgather).
fn three_steps(
    ctx: &Context,
    mems: &mut [Vec<Mem>],
    dtype: DType,
    counts: &[usize],
    tag: &str,
) -> [Sent; 3] {
    let replicas = mems[0].len();
    let ar = sent_by(ctx, tag, || ctx.allreduce_grads(SUM));
    let whole: Vec<Vec<u8>> = mems.iter().map(|per| per[0].read()).collect();
    refill(mems, dtype, counts);
    let rs = sent_by(ctx, tag, || reduce_scatter(ctx, SUM));
    let size = dtype.size();
    for (t, &n) in counts.iter().enumerate() {
        for r in 0..replicas {
            let (got, before) = (mems[t][r].read(), initial(dtype, r, t, n));
            let (lo, hi) = (n * r / replicas * size, n * (r + 1) / replicas * size);
            let tag = format!("{tag}: g{t} on replica {r}");
            assert_eq!(got[lo..hi], whole[t][lo..hi], "{tag}: the owned piece");
            assert_eq!(got[..lo], before[..lo], "{tag}: before the piece");
            assert_eq!(got[hi..], before[hi..], "{tag}: after the piece");
        }
    }
    let ag = sent_by(ctx, tag, || allgather(ctx, GRAD));
    for (t, per) in mems.iter().enumerate() {
        for (r, m) in per.iter().enumerate() {
            assert_eq!(
                m.read(),
                whole[t],
                "{tag}: g{t} on replica {r} after the allgather"
            );
        }
    }
    [ar, rs, ag]
}

#[test]
fn reduce_scatter_across_gpus_over_nccl_sends_half_the_allreduce() {
    let test = "reduce_scatter_across_gpus_over_nccl_sends_half_the_allreduce";
    let Some(place) = Place::gpus(test, 2) else {
        return;
    };
    // Counts of W's multiples: the owners' blocks are even, nothing padded.
    let counts = [1000usize, 600];
    for ordinals in [&[0, 1][..], &[0, 1, 0, 1]] {
        for dtype in [DType::F32, DType::I32] {
            let tag = format!("cuda:{ordinals:?}, {dtype:?}");
            let (ctx, mut mems) = registered(&place, test, ordinals, dtype, &counts);
            let [ar, rs, ag] = three_steps(&ctx, &mut mems, dtype, &counts, &tag);
            let (Some(ar), Some(rs), Some(ag)) = (ar, rs, ag) else {
                continue; // a real NCCL: no counts
            };
            // Per GPU, a ring allreduce sends 2 (n-1)/n of the bucket, a reduce-scatter
            // (n-1)/n: half. The allgather sends as much again.
            let bucket = (counts.iter().sum::<usize>() * dtype.size()) as u64;
            assert_eq!(
                ar[ALLREDUCE],
                (2 * bucket, 2),
                "{tag}: one ncclAllReduce per GPU"
            );
            assert_eq!(
                rs[ALLREDUCE],
                (0, 0),
                "{tag}: no allreduce in the reduce-scatter"
            );
            assert_eq!(
                rs[REDUCE_SCATTER],
                (bucket, 2),
                "{tag}: one ncclReduceScatter per GPU"
            );
            assert_eq!(
                2 * rs[REDUCE_SCATTER].0,
                ar[ALLREDUCE].0,
                "{tag}: half the bytes"
            );
            assert_eq!(
                ag[ALLGATHER],
                (bucket, 2),
                "{tag}: one ncclAllGather per GPU"
            );
            assert_eq!(
                ag[BROADCAST],
                (0, 0),
                "{tag}: no broadcast in the allgather"
            );
        }
    }
}

/// Three GPUs in one process: floats reduce-scatter through the allreduce's combine (its
/// bytes), integers through `ncclReduceScatter` (exact in any order); both allgather through
/// `ncclAllGather`.
#[test]
fn shards_across_three_gpus_take_reduce_scatter_for_integers_only() {
    let test = "shards_across_three_gpus_take_reduce_scatter_for_integers_only";
    let Some(place) = Place::gpus(test, 3) else {
        return;
    };
    let counts = [1000usize, 17];
    for dtype in [DType::F32, DType::I32] {
        let tag = format!("cuda:[0, 1, 2], {dtype:?}");
        let (ctx, mut mems) = registered(&place, test, &[0, 1, 2], dtype, &counts);
        let [_, rs, ag] = three_steps(&ctx, &mut mems, dtype, &counts, &tag);
        let (Some(rs), Some(ag)) = (rs, ag) else {
            continue;
        };
        let scatters = dtype == DType::I32;
        assert_eq!(rs[REDUCE_SCATTER].1 > 0, scatters, "{tag}: {rs:?}");
        assert_eq!(rs[ALLREDUCE].1 > 0, !scatters, "{tag}: {rs:?}");
        assert_eq!((ag[ALLGATHER].1, ag[BROADCAST].1), (3, 0), "{tag}: {ag:?}");
    }
}
