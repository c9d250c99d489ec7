//! `dpsync_grad_ready` in a reproducible world: float buckets start early and are summed as
//! the reproducible sum is, whole through shared memory where each rank holds one replica of
//! F32 or F64 (`backend/mpi/whole.rs`), else at each element's owner (F16 and BF16 always:
//! `backend/mpi/alltoall.rs`). A step gives the bytes of one process holding every replica,
//! marked or not.

use super::*;

/// One replica per rank through shared memory with 2 and 3 ranks and over MPI's messages;
/// two per rank with and without shared memory; one and two (uneven) with and without.
#[test]
fn reproducible_buckets_start_early() {
    if under_mpirun() {
        return;
    }
    let no_shm = Some(("DPSYNC_MPI_SHM", std::path::Path::new("0")));
    launch("repro_overlap::repro_overlap_body", 2, 300, None);
    launch("repro_overlap::repro_overlap_body", 3, 300, None);
    launch("repro_overlap::repro_overlap_body", 2, 300, no_shm);
    launch("repro_overlap::repro_overlap_two_body", 2, 300, None);
    launch("repro_overlap::repro_overlap_two_body", 2, 300, no_shm);
    launch("repro_overlap::repro_overlap_uneven_body", 2, 300, None);
    launch("repro_overlap::repro_overlap_uneven_body", 2, 300, no_shm);
}

/// A gradient's name, count and dtype: f32 buckets on and off the ring, f64, bf16 and f16
/// ones and an integer one, the first in backward order (exact already: it starts as a plain
/// sum).
const GRADS: [(&str, usize, u32); 6] = [
    ("a", 300_000, F32),
    ("b", 1000, F32),
    ("c", 50_000, F64),
    ("e", 40_000, BF16),
    ("f", 3000, F16),
    ("d", 1000, I32),
];

fn size_of(dtype: u32) -> usize {
    match dtype {
        F64 => 8,
        F16 | BF16 => 2,
        _ => 4,
    }
}

/// World replica `w`'s element `i` of gradient `t`: magnitudes from 2^-12 to 2^12 and both
/// signs, so that any other summation order would show in the bytes.
fn value(t: usize, w: usize, i: usize) -> f64 {
    let h = ((t * 7919 + w * 104_729 + i) as u64).wrapping_mul(0x9e37_79b9_7f4a_7c15) >> 40;
    let (mantissa, scale) = ((h % 20_001) as f64 - 10_000.0, (h >> 15) % 25);
    match GRADS[t].2 {
        I32 => (mantissa / 100.0).round(),
        // Within f16's normal range, sums of every replica included.
        F16 => mantissa / 3.0 * 2f64.powi((scale % 8) as i32 - 10),
        _ => mantissa / 3.0 * 2f64.powi(scale as i32 - 12),
    }
}

/// One replica's gradients as bytes, filled with world replica `w`'s values.
fn filled(w: usize) -> Vec<Vec<u8>> {
    (GRADS.iter().enumerate())
        .map(|(t, &(_, n, dtype))| {
            (0..n)
                .flat_map(|i| {
                    let v = value(t, w, i);
                    match dtype {
                        F32 => (v as f32).to_ne_bytes().to_vec(),
                        F64 => v.to_ne_bytes().to_vec(),
                        BF16 => half::bf16::from_f64(v).to_ne_bytes().to_vec(),
                        F16 => half::f16::from_f64(v).to_ne_bytes().to_vec(),
                        _ => (v as i32).to_ne_bytes().to_vec(),
                    }
                })
                .collect()
        })
        .collect()
}

fn reproducible(o: &Options) {
    // SAFETY: valid options.
    check(
        unsafe { dpsync_options_set_reproducible(o.0, true) },
        "set_reproducible",
    );
}

/// Registers `g` (one replica's gradients) on `replica`.
fn register_all(ctx: &Context, replica: usize, g: &mut [Vec<u8>]) {
    for (buf, &(name, n, dtype)) in g.iter_mut().zip(&GRADS) {
        let st = register_raw(
            ctx.0,
            name,
            GRAD,
            replica,
            buf.as_mut_ptr().cast(),
            n,
            dtype,
        );
        check(st, &format!("register '{name}'"));
    }
}

#[test]
fn repro_overlap_body() {
    if let Some((rank, ranks)) = as_rank("repro_overlap_body") {
        run(rank, &vec![1; ranks]);
    }
}

#[test]
fn repro_overlap_two_body() {
    if let Some((rank, ranks)) = as_rank("repro_overlap_two_body") {
        run(rank, &vec![2; ranks]);
    }
}

/// Rank r holds 1 + r % 2 replicas: the owners' exchange with other contributions per rank.
#[test]
fn repro_overlap_uneven_body() {
    if let Some((rank, ranks)) = as_rank("repro_overlap_uneven_body") {
        run(rank, &(0..ranks).map(|r| 1 + r % 2).collect::<Vec<_>>());
    }
}

/// Every replica's gradients, each as bytes.
type Grads = Vec<Vec<Vec<u8>>>;

/// Rank `rank` of a world of `per_rank[r]` replicas on rank r.
fn run(rank: usize, per_rank: &[usize]) {
    let (ranks, local) = (per_rank.len(), per_rank[rank]);
    let shm = std::env::var("DPSYNC_MPI_SHM").as_deref() != Ok("0");
    let tag =
        |what: &str| format!("rank {rank}/{ranks} of {per_rank:?} (shared memory {shm}): {what}");
    let world: usize = per_rank.iter().sum();
    // World replica `first + r` on this rank's replica r.
    let first: usize = per_rank[..rank].iter().sum();
    // The bytes every replica must end with: one process holding every world replica.
    let one_process = |op: u32| {
        let mut all: Grads = (0..world).map(filled).collect();
        let o = Options::host(world);
        reproducible(&o);
        let one = Context::new(&o);
        for (w, g) in all.iter_mut().enumerate() {
            register_all(&one, w, g);
        }
        check(one.allreduce_grads(op), &tag("one process"));
        all.swap_remove(0)
    };
    let (want, want_sum) = (one_process(AVG), one_process(SUM));

    let o = world_options(local);
    reproducible(&o);
    o.set_fusion_bytes(4 * 300_000);
    let ctx = Context::new(&o);
    let mut g: Grads = (0..local).map(|r| filled(first + r)).collect();
    for (r, g) in g.iter_mut().enumerate() {
        register_all(&ctx, r, g);
    }
    // In place: the registered memory stays where it is.
    let fill = |g: &mut Grads| {
        for (r, g) in g.iter_mut().enumerate() {
            for (buf, new) in g.iter_mut().zip(filled(first + r)) {
                buf.copy_from_slice(&new);
            }
        }
    };
    let mark = || {
        for &(name, ..) in GRADS.iter().rev() {
            for r in 0..local {
                check(ctx.grad_ready(name, r), &tag("grad_ready"));
            }
        }
    };
    let early = |key: &str| ctx.describe_json()["overlap"][key].as_u64().unwrap_or(0);
    let same_as = |g: &Grads, want: &[Vec<u8>], what: &str| {
        for (r, g) in g.iter().enumerate() {
            for (t, (got, want)) in g.iter().zip(want).enumerate() {
                let at = got.iter().zip(want).position(|(a, b)| a != b);
                let name = GRADS[t].0;
                assert!(
                    at.is_none(),
                    "{}",
                    tag(&format!("{what}: replica {r}'s '{name}' byte {at:?}"))
                );
            }
        }
    };
    let same = |g: &Grads, what: &str| same_as(g, &want, what);

    // Step 1 sets the op early buckets expect (nothing starts before).
    check(ctx.allreduce_grads(AVG), &tag("step 1"));
    same(&g, "step 1");

    // Step 2, marked: every bucket starts (a bucket each), on every route. The bytes are one
    // process's.
    fill(&mut g);
    mark();
    let buckets = early("buckets_reduced_early_this_step");
    assert_eq!(
        buckets,
        GRADS.len() as u64,
        "{}",
        tag("buckets started early")
    );
    check(ctx.allreduce_grads(AVG), &tag("step 2"));
    same(&g, "step 2 (marked)");

    // Step 3, marked, refused (the last rank's op is invalid): nothing changes; then again.
    fill(&mut g);
    let before = g.clone();
    mark();
    let last = rank == ranks - 1;
    let st = ctx.allreduce_grads(if last { 7 } else { AVG });
    let refused = if last { INVALID_ARGUMENT } else { INCONSISTENT };
    assert_eq!(st, refused, "{}: {}", tag("step 3"), last_error());
    assert!(
        g == before,
        "{}",
        tag("a refused step changed the gradients")
    );
    check(ctx.allreduce_grads(AVG), &tag("step 3 again"));
    same(&g, "step 3 again");

    // Step 4, marked, a reduce-scatter: each replica's own piece has one process's bytes.
    fill(&mut g);
    mark();
    // SAFETY: a live context.
    check(
        unsafe { dpsync_reduce_scatter_grads(ctx.0, AVG) },
        &tag("step 4"),
    );
    for (r, g) in g.iter().enumerate() {
        let w = first + r;
        for (t, &(name, n, dtype)) in GRADS.iter().enumerate() {
            let size = size_of(dtype);
            let (lo, hi) = (n * w / world * size, n * (w + 1) / world * size);
            let was = &before[r][t];
            assert!(
                g[t][lo..hi] == want[t][lo..hi]
                    && g[t][..lo] == was[..lo]
                    && g[t][hi..] == was[hi..],
                "{}",
                tag(&format!(
                    "step 4: replica {r}'s '{name}' owned piece or the rest"
                ))
            );
        }
    }

    // Steps 5-7, SUM: float buckets do not start (a SUM divided for a later AVG step would
    // round twice), the integer bucket, the first, does; a marked AVG step after a SUM step
    // still has one process's bytes (the integer bucket divided exactly afterwards).
    check(ctx.allreduce_grads(SUM), &tag("step 5"));
    fill(&mut g);
    mark();
    let buckets = early("buckets_reduced_early_this_step");
    assert_eq!(
        buckets,
        1,
        "{}",
        tag("step 6: buckets started early under SUM")
    );
    check(ctx.allreduce_grads(SUM), &tag("step 6"));
    same_as(&g, &want_sum, "step 6 (marked, SUM)");
    fill(&mut g);
    mark();
    check(ctx.allreduce_grads(AVG), &tag("step 7"));
    same(&g, "step 7 (marked under SUM, then AVG)");
}
