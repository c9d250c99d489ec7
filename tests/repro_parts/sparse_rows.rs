//! Coalesced sparse sums: which replica sent a row does not change the bytes, on the host and
//! across GPUs.

use super::*;
use common::place::read_at;

const ROW: usize = 3;

/// 40 rows over 7 indices, values over 30 binades.
fn rows() -> Vec<(i64, [f32; ROW])> {
    let mut lcg = Lcg::new(77);
    (0..40)
        .map(|_| {
            let index = lcg.below(7) as i64;
            let mut v = [0f32; ROW];
            for x in &mut v {
                *x = (lcg.uniform(-1.0, 1.0) * 2f64.powi(lcg.below(30) as i32 - 15)) as f32;
            }
            (index, v)
        })
        .collect()
}

/// The coalesced gather (SUM) of `rows()` with row k on replica `owner(k)` of `w`, each
/// replica's rows in reverse with `reverse`: the gathered indices and values bytes.
fn gather(
    place: &Place,
    w: usize,
    owner: &dyn Fn(usize) -> usize,
    reverse: bool,
) -> (Vec<u8>, Vec<u8>) {
    let ctx = match place {
        Place::Host => {
            let o = Options::host(w);
            o.set_sparse_coalesce(true);
            // SAFETY: valid options.
            check(unsafe { dpsync_options_set_reproducible(o.0, true) }, "set");
            Context::new(&o)
        }
        Place::Gpu(_) => {
            let ordinals: Vec<i32> = (0..w).map(|r| ordinal(place, r)).collect();
            cuda_context("sparse", &ordinals, |o| {
                o.set_sparse_coalesce(true);
                // SAFETY: valid options.
                check(unsafe { dpsync_options_set_reproducible(o.0, true) }, "set");
            })
            .expect("a CUDA context where one was made")
        }
    };
    ctx.reg_sparse_all("e", ROW, F32, I64, 0);
    let all = rows();
    let mut mems = Vec::new();
    for r in 0..w {
        let mut mine: Vec<&(i64, [f32; ROW])> = (0..all.len())
            .filter(|&k| owner(k) == r)
            .map(|k| &all[k])
            .collect();
        if reverse {
            mine.reverse();
        }
        let idx: Vec<u8> = mine.iter().flat_map(|(i, _)| i.to_ne_bytes()).collect();
        let val: Vec<u8> = (mine.iter())
            .flat_map(|(_, v)| v.iter().flat_map(|x| x.to_ne_bytes()))
            .collect();
        let (mi, mv) = (
            place.mem_on(ordinal(place, r), &idx),
            place.mem_on(ordinal(place, r), &val),
        );
        let st = ctx.sparse_set_raw(
            "e",
            r,
            mi.ptr() as *const _,
            mv.ptr() as *const _,
            mine.len(),
        );
        check(st, "sparse_set");
        mems.push((mi, mv));
    }
    check(ctx.allreduce_grads(SUM), "allreduce_grads");
    synchronize(&ctx);
    let out = ctx.gathered("e", 0);
    let got = (
        read_at(place, out.indices as usize, out.rows * 8),
        read_at(place, out.values as usize, out.rows * ROW * 4),
    );
    for r in 1..w {
        let o = ctx.gathered("e", r);
        let other = (
            read_at(place, o.indices as usize, o.rows * 8),
            read_at(place, o.values as usize, o.rows * ROW * 4),
        );
        assert_eq!(other, got, "replica {r} of {w}");
    }
    drop(ctx);
    got
}

fn arrangements(place: &Place) {
    let want = gather(place, 1, &|_| 0, false);
    assert_eq!(want.0.len(), 7 * 8, "every index once");
    type Case<'a> = (usize, &'a dyn Fn(usize) -> usize, bool);
    let cases: [Case; 4] = [
        (1, &|_| 0, true),
        (4, &|k| k % 4, false),
        (4, &|k| (k * 7 + 1) % 4, true),
        (3, &|k| k / 14, false),
    ];
    for (w, owner, reverse) in cases {
        assert_eq!(
            gather(place, w, owner, reverse),
            want,
            "{w} replicas, reverse {reverse}"
        );
    }
}

#[test]
fn coalesced_sparse_sums_ignore_which_replica_sent_a_row() {
    arrangements(&Place::Host);
}

#[test]
fn coalesced_sparse_sums_across_gpus_give_the_same_bytes() {
    let _alone = super::gpus_alone();
    if let Some(gpu) = Place::gpu("coalesced_sparse_sums_across_gpus_give_the_same_bytes") {
        arrangements(&gpu);
        // And the host's.
        assert_eq!(
            gather(&gpu, 4, &|k| k % 4, false),
            gather(&Place::Host, 2, &|k| k % 2, true)
        );
    }
}
