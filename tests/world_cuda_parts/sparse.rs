//! Sparse gathers across the ranks of `cuda_rank_body`, plain and coalesced.

use super::*;

/// World replica `w`'s rows: indices that repeat across replicas, values that sum exactly.
pub(super) fn rows_of(w: usize) -> (Vec<i64>, Vec<f32>) {
    let n = [3, 0, 2, 4][w % 4];
    let indices: Vec<i64> = (0..n).map(|j| ((w * 5 + j * 3) % 7) as i64).collect();
    let values: Vec<f32> = (0..n * 2).map(|c| (w * 10 + c) as f32).collect();
    (indices, values)
}

/// Sparse gradients on CUDA replicas across the ranks give the bytes one host process with
/// every replica of the world gives (plain and coalesced).
pub(super) fn sparse_across_ranks(place: &Place, rank: usize, ranks: usize, coalesce: bool) {
    let (local, total, offset) = counts(rank, ranks);
    let ordinals = &layout(rank);
    let tag = |what: &str| format!("rank {rank}/{ranks}, coalesce {coalesce}: {what}");
    let ctx = cuda_context("cuda_rank_body", ordinals, |o| {
        o.set_timeout_ms(120_000);
        o.set_sparse_coalesce(coalesce);
        // SAFETY: valid options; NULL is MPI_COMM_WORLD.
        check(
            unsafe { dpsync_options_set_world_mpi(o.0, ptr::null()) },
            "world",
        );
    })
    .expect("the CUDA context of the first part");
    let r = Options::host(total);
    r.set_sparse_coalesce(coalesce);
    let reference = Context::new(&r);
    ctx.reg_sparse_all("emb", 2, F32, I64, 7);
    reference.reg_sparse_all("emb", 2, F32, I64, 7);
    let data: Vec<(Vec<i64>, Vec<f32>)> = (0..total).map(rows_of).collect();
    for (w, (i, v)) in data.iter().enumerate() {
        check(reference.sparse_set("emb", w, i, v), "reference set");
    }
    let mems: Vec<(Mem, Mem)> = (0..local)
        .map(|k| {
            let (i, v) = &data[offset + k];
            (
                place.mem_on(ordinals[k], &bytes_of(i)),
                place.mem_on(ordinals[k], &bytes_of(v)),
            )
        })
        .collect();
    for (k, (i, v)) in mems.iter().enumerate() {
        let rows = data[offset + k].0.len();
        let st = ctx.sparse_set_raw("emb", k, i.ptr() as *const _, v.ptr() as *const _, rows);
        check(st, &tag("sparse_set"));
    }
    check(reference.allreduce_grads(SUM), "reference step");
    check(ctx.allreduce_grads(SUM), &tag("world step"));
    check(common::place::synchronize(&ctx), &tag("synchronize"));
    let want = reference.gathered("emb", 0);
    for k in 0..local {
        let got = ctx.gathered("emb", k);
        assert_eq!(got.rows, want.rows, "{}", tag("rows"));
        let read = |ptr: *const std::ffi::c_void, bytes: usize| {
            common::place::read_at(place, ptr as usize, bytes)
        };
        assert_eq!(
            read(got.indices, got.rows * 8),
            bytes_of(&want.indices::<i64>()),
            "{}",
            tag("indices")
        );
        assert_eq!(
            read(got.values, got.rows * 8),
            bytes_of(&want.values::<f32>(2)),
            "{}",
            tag("values")
        );
    }
}
