//! Sparse gathers' outputs through a loss: a survivor's `dpsync_sparse_get` after RANK_LOST
//! answers what it answered before the interrupted step (the previous step's gathered slice, at
//! the same addresses), and the step consumed no slice (the redo gathers them again without
//! `dpsync_sparse_set`), as after any failed step.
//!
//! 3 ranks of 6, 1 and 1 host replicas (min_ranks 2), a dense GRAD "a" (4 MiB per replica) and
//! a sparse gradient "e" (2 rows of 4 f32 per replica, i64 indices). Rank 2 dies in step 2 once
//! its own part of it is done: a thread of its own watches its "a" and kills it when the step's
//! sum is there (the step gathers first, then reduces the dense buckets). The survivors' step
//! may then have completed, learning of the loss only in the call's vote, after it installed
//! its new outputs: the case the undo must put back. Each survivor prints whether its step had
//! completed; that depends on timing (here about one launch in three without shared memory,
//! where the ranks' last ring transfers end together; rarely through shared memory, where the
//! survivors usually wait on rank 2 once more within the step), so each form is launched three
//! times. Otherwise the loss interrupts the step's data (nothing was installed), or rank 2's
//! vote completes first and it dies when the call returns, the others losing their next step.

use super::*;
use common::sparse::SparseOut;

#[test]
fn a_loss_mid_step_keeps_the_sparse_outputs() {
    if under_mpirun() {
        return; // a rank runs sparse_body only
    }
    let Some(venv) = ulfm_venv("a_loss_mid_step_keeps_the_sparse_outputs") else {
        return;
    };
    for _ in 0..3 {
        launch_ulfm("sparse::sparse_body", 3, 300, &venv, &[], 2);
        let no_shm = [("DPSYNC_MPI_SHM", "0")];
        launch_ulfm("sparse::sparse_body", 3, 300, &venv, &no_shm, 2);
    }
}

const ROW: usize = 4;
/// Floats of "a" per replica.
const A_LEN: usize = 1 << 20;

fn layout(rank: usize) -> usize {
    [6, 1, 1][rank]
}

/// The world replicas (at creation) of ranks `0..ranks`.
fn below(ranks: usize) -> Vec<usize> {
    (0..(0..ranks).map(layout).sum()).collect()
}

/// Row `j`'s value of world replica `w` (at creation) in step `i`.
fn value(i: usize, w: usize, j: usize) -> f32 {
    (i * 1000 + w * 10 + j) as f32
}

/// Dense "a" of world replica `w` in step `i`.
fn dense(i: usize, w: usize) -> f32 {
    (i * 100 + w + 1) as f32
}

/// The gathered slice of step `i` over the world replicas `from`: indices and values.
fn gathered(i: usize, from: &[usize]) -> (Vec<i64>, Vec<f32>) {
    let indices = from.iter().flat_map(|&w| [w as i64, (100 + i) as i64]);
    let values = (from.iter()).flat_map(|&w| (0..2).flat_map(move |j| [value(i, w, j); ROW]));
    (indices.collect(), values.collect())
}

struct Step {
    a: Vec<Vec<f32>>,
    indices: Vec<Vec<i64>>,
    values: Vec<Vec<f32>>,
    offset: usize,
}

impl Step {
    /// Step `i`'s gradients and slices, set on every local replica (`sparse`: also the slices).
    fn compute(&mut self, ctx: &Context, i: usize, sparse: bool) {
        for k in 0..self.a.len() {
            let w = self.offset + k;
            self.a[k].fill(dense(i, w));
            if !sparse {
                continue;
            }
            self.indices[k] = vec![w as i64, (100 + i) as i64];
            self.values[k] = (0..2).flat_map(|j| [value(i, w, j); ROW]).collect();
            let st = ctx.sparse_set("e", k, &self.indices[k], &self.values[k]);
            assert_eq!(st, OK, "sparse_set: {}", last_error());
        }
    }
}

/// Every local replica's gathered "e" equals step `i`'s over `from`.
fn check_gathered(ctx: &Context, local: usize, i: usize, from: &[usize], tag: &str) -> SparseOut {
    let (indices, values) = gathered(i, from);
    let first = ctx.gathered("e", 0);
    for k in 0..local {
        let out = ctx.gathered("e", k);
        assert_eq!(
            out.indices::<i64>(),
            indices,
            "{tag}: indices on replica {k}"
        );
        assert_eq!(
            out.values::<f32>(ROW),
            values,
            "{tag}: values on replica {k}"
        );
    }
    first
}

#[test]
fn sparse_body() {
    let Some((rank, ranks)) = as_rank("sparse_body") else {
        return;
    };
    assert_eq!(ranks, 3, "sparse_body runs on 3 ranks");
    let local = layout(rank);
    let offset: usize = (0..rank).map(layout).sum();
    let tag = |what: &str| format!("rank {rank}/{ranks}: {what}");
    let ctx = Context::new(&options(local));
    let mut s = Box::new(Step {
        a: vec![vec![0f32; A_LEN]; local],
        indices: vec![Vec::new(); local],
        values: vec![Vec::new(); local],
        offset,
    });
    for k in 0..local {
        ctx.reg("a", GRAD, k, &mut s.a[k], F32);
    }
    ctx.reg_sparse_all("e", ROW, F32, I64, 0);
    let all = below(3);
    let sum = |i: usize, from: &[usize]| from.iter().map(|&w| dense(i, w)).sum::<f32>();

    // Step 1 of all three ranks.
    s.compute(&ctx, 1, true);
    let st = ctx.allreduce_grads(SUM);
    assert_eq!(st, OK, "{}: {}", tag("step 1"), last_error());
    let mut before = check_gathered(&ctx, local, 1, &all, &tag("step 1"));

    // Step 2: rank 2 dies once its part is done.
    if rank == 2 {
        let (at, want) = (s.a[0].as_ptr() as usize, sum(2, &all));
        // The first, middle and last float: each rank's block of the sum is there (the ranks'
        // own blocks are written first, the others' copied in after).
        std::thread::spawn(move || loop {
            // SAFETY: "a" outlives this process's end (the thread kills it); volatile reads
            // of floats the library writes: a torn value only delays the kill.
            let x = |k: usize| unsafe { std::ptr::read_volatile((at as *const f32).add(k)) };
            if [0, A_LEN / 2, A_LEN - 1].into_iter().all(|k| x(k) == want) {
                die();
            }
            std::hint::spin_loop();
        });
    }
    let mut lost = None;
    for i in 2..100 {
        s.compute(&ctx, i, true);
        let st = ctx.allreduce_grads(SUM);
        if rank == 2 {
            die(); // its vote completed before the thread killed it
        }
        if st == OK {
            before = check_gathered(&ctx, local, i, &all, &tag(&format!("step {i}")));
            continue;
        }
        assert_eq!(
            st,
            RANK_LOST,
            "{}: {}",
            tag(&format!("step {i}")),
            last_error()
        );
        assert!(last_error().contains("rank 2"), "{}", tag(&last_error()));
        lost = Some(i);
        break;
    }
    let i = lost.expect("rank 2 was lost within 100 steps");
    // Whether this survivor's step had completed its data (its "a" holds the step's sum):
    // then it had installed the step's outputs, which the undo put back.
    let completed = s.a.iter().all(|a| a.iter().all(|&x| x == sum(i, &all)));
    println!(
        "rank {rank}: rank 2 lost in step {i}; the step's data had {}crossed here",
        if completed { "" } else { "not " }
    );
    let kept = check_gathered(&ctx, local, i - 1, &all, &tag("sparse_get after RANK_LOST"));
    assert_eq!(kept, before, "{}", tag("the previous outputs' addresses"));

    // The redo: dense gradients computed again, the slices still set.
    let survivors = below(2);
    s.compute(&ctx, i, false);
    let st = ctx.allreduce_grads(SUM);
    assert_eq!(st, OK, "{}: {}", tag("redo"), last_error());
    check_gathered(&ctx, local, i, &survivors, &tag("redo"));
    assert!(
        s.a.iter()
            .all(|a| a.iter().all(|&x| x == sum(i, &survivors))),
        "{}",
        tag("redo's dense sum")
    );
    // And the next step over the survivors.
    s.compute(&ctx, i + 1, true);
    let st = ctx.allreduce_grads(SUM);
    assert_eq!(st, OK, "{}: {}", tag("next step"), last_error());
    check_gathered(&ctx, local, i + 1, &survivors, &tag("next step"));
    drop(ctx);
    println!("SURVIVED sparse::sparse_body");
}
