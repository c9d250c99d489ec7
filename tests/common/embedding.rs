//! Caffe2's `test_equiv_sparse` model, for host replicas (tests/sparse.rs) and CUDA replicas
//! (tests/cuda_sparse.rs): an embedding-bag regression `y = w · Σ table[bag] + b` trained with
//! sparse SGD. The model and its arithmetic live on the host (the test is the framework); the
//! gradients dpsync reduces — dense `w_grad`/`b_grad` and the sparse `table_grad` slices — live
//! in the run's [`Place`], so on CUDA replicas the gather and the allreduce run on the GPUs.

use super::abi::{F32, GRAD, SUM};
use super::buf::DType;
use super::close::{assert_allclose, f32_bytes};
use super::context::{check, register_raw};
use super::lcg::Lcg;
use super::place::{encode_indices, read_at, synchronize, Mem, Place};

const VOCAB: usize = 40;
const EMB: usize = 4;
const BAG: usize = 3;
const GLOBAL_BATCH: usize = 16;
const STEPS: usize = 25;
const LR: f32 = 0.5;

/// One replica's model.
struct Model {
    table: Vec<f32>,
    w: Vec<f32>,
    b: f32,
}

/// What a training run ends with (every replica holds the same bytes; checked).
pub struct Trained {
    pub table: Vec<f32>,
    pub w: Vec<f32>,
    pub loss_before: f32,
    pub loss_after: f32,
}

/// The global batch of one step: bags skewed towards low indices (many duplicates) and targets.
fn batch(step: usize) -> Vec<([i64; BAG], f32)> {
    let mut g = Lcg::new(500 + step as u64);
    (0..GLOBAL_BATCH)
        .map(|_| {
            let mut bag = [0i64; BAG];
            for i in bag.iter_mut() {
                *i = (g.unit().powi(2) * VOCAB as f64) as i64;
            }
            let t: f32 = bag.iter().map(|&i| ((i * 7) % 5) as f32 * 0.2 - 0.4).sum();
            (bag, t)
        })
        .collect()
}

fn forward(m: &Model, bag: &[i64; BAG]) -> ([f32; EMB], f32) {
    let mut pooled = [0f32; EMB];
    for &i in bag {
        for (j, p) in pooled.iter_mut().enumerate() {
            *p += m.table[i as usize * EMB + j];
        }
    }
    let y = m.b + pooled.iter().zip(&m.w).map(|(p, w)| p * w).sum::<f32>();
    (pooled, y)
}

fn loss(m: &Model, batch: &[([i64; BAG], f32)]) -> f32 {
    batch
        .iter()
        .map(|(bag, t)| {
            let y = forward(m, bag).1;
            0.5 * (y - t) * (y - t)
        })
        .sum::<f32>()
        / batch.len() as f32
}

fn f32s(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(4)
        .map(|b| f32::from_ne_bytes(b.try_into().unwrap()))
        .collect()
}

fn indices_of(dtype: DType, bytes: &[u8]) -> Vec<i64> {
    match dtype {
        DType::I32 => bytes
            .chunks_exact(4)
            .map(|b| i32::from_ne_bytes(b.try_into().unwrap()) as i64)
            .collect(),
        _ => bytes
            .chunks_exact(8)
            .map(|b| i64::from_ne_bytes(b.try_into().unwrap()))
            .collect(),
    }
}

/// Trains on one replica per entry of `ordinals` (CUDA replica r on GPU `ordinals[r]` for a GPU
/// place) over `transport`, with `index` (I32 or I64) indices. `None` when the context cannot be
/// made here (no GPU, or the transport is missing).
pub fn train_embedding(
    place: &Place,
    ordinals: &[i32],
    transport: u32,
    index: DType,
    coalesce: bool,
) -> Option<Trained> {
    let n = ordinals.len();
    let ctx = place.context("embedding model", ordinals, transport, coalesce)?;
    let mut init = Lcg::new(7);
    let table: Vec<f32> = (0..VOCAB * EMB)
        .map(|_| init.uniform(-0.3, 0.3) as f32)
        .collect();
    let w: Vec<f32> = (0..EMB).map(|_| init.uniform(-0.5, 0.5) as f32).collect();
    let mut models: Vec<Model> = (0..n)
        .map(|_| Model {
            table: table.clone(),
            w: w.clone(),
            b: 0.1,
        })
        .collect();
    // Dense gradients in the place's memory: w_grad (EMB floats), b_grad (1).
    let mut dense: Vec<[Mem; 2]> = Vec::new();
    for (r, &ordinal) in ordinals.iter().enumerate() {
        let grads = [
            place.mem_on(ordinal, &[0u8; EMB * 4]),
            place.mem_on(ordinal, &[0u8; 4]),
        ];
        for (name, (mem, count)) in ["w_grad", "b_grad"].iter().zip(grads.iter().zip([EMB, 1])) {
            let st = register_raw(ctx.0, name, GRAD, r, mem.ptr() as *mut _, count, F32);
            check(st, &format!("register {name} on replica {r}"));
        }
        dense.push(grads);
    }
    ctx.reg_sparse_all("table_grad", EMB, F32, index.code(), VOCAB);
    let local = GLOBAL_BATCH / n;
    let scale = ctx.loss_scale() / local as f64;
    let loss_before = loss(&models[0], &batch(0));
    for step in 0..STEPS {
        let batch = batch(step);
        // The slices live until the step's allreduce_grads has run (and been synchronized).
        let mut slices: Vec<[Mem; 2]> = Vec::new();
        for (r, (m, &ordinal)) in models.iter().zip(ordinals).enumerate() {
            let (mut w_grad, mut b_grad) = ([0f32; EMB], 0f32);
            let mut indices = Vec::new();
            let mut values: Vec<f32> = Vec::new();
            for (bag, t) in &batch[r * local..(r + 1) * local] {
                let (pooled, y) = forward(m, bag);
                let dy = (y - t) * scale as f32;
                for (g, p) in w_grad.iter_mut().zip(&pooled) {
                    *g += dy * p;
                }
                b_grad += dy;
                for &i in bag {
                    indices.push(i);
                    values.extend(m.w.iter().map(|w| dy * w));
                }
            }
            dense[r][0].write(&f32_bytes(&w_grad));
            dense[r][1].write(&f32_bytes(&[b_grad]));
            let slice = [
                place.mem_on(ordinal, &encode_indices(index, &indices)),
                place.mem_on(ordinal, &f32_bytes(&values)),
            ];
            let st = ctx.sparse_set_raw(
                "table_grad",
                r,
                slice[0].ptr() as *const _,
                slice[1].ptr() as *const _,
                indices.len(),
            );
            check(st, "sparse_set");
            slices.push(slice);
        }
        check(ctx.allreduce_grads(SUM), "allreduce_grads");
        check(synchronize(&ctx), "synchronize");
        for (r, m) in models.iter_mut().enumerate() {
            let out = ctx.gathered("table_grad", r);
            let indices = indices_of(
                index,
                &read_at(place, out.indices as usize, out.rows * index.size()),
            );
            let values = f32s(&read_at(place, out.values as usize, out.rows * EMB * 4));
            assert_eq!(indices.len(), out.rows);
            if !coalesce {
                assert_eq!(
                    out.rows,
                    GLOBAL_BATCH * BAG,
                    "every bag index, in world order"
                );
            }
            for (k, &i) in indices.iter().enumerate() {
                for j in 0..EMB {
                    m.table[i as usize * EMB + j] -= LR * values[k * EMB + j];
                }
            }
            let w_grad = f32s(&dense[r][0].read());
            for (p, g) in m.w.iter_mut().zip(&w_grad) {
                *p -= LR * g;
            }
            m.b -= LR * f32s(&dense[r][1].read())[0];
        }
        drop(slices);
    }
    for (r, m) in models.iter().enumerate().skip(1) {
        assert_eq!(
            f32_bytes(&m.table),
            f32_bytes(&models[0].table),
            "table of replica {r}"
        );
        assert_eq!(f32_bytes(&m.w), f32_bytes(&models[0].w), "w of replica {r}");
    }
    let loss_after = loss(&models[0], &batch(0));
    let m = models.swap_remove(0);
    Some(Trained {
        table: m.table,
        w: m.w,
        loss_before,
        loss_after,
    })
}

/// Caffe2's `test_equiv_sparse`: 2 and 4 replicas train the model 1 replica trains (allclose),
/// which learns; coalescing on and off train the same model; both index dtypes. `sets` are the
/// GPU ordinals of the 1-, 2- and 4-replica runs. False when the context cannot be made here.
pub fn equiv_sparse(place: &Place, sets: [&[i32]; 3], transport: u32) -> bool {
    for index in [DType::I32, DType::I64] {
        let Some(one) = train_embedding(place, sets[0], transport, index, false) else {
            return false;
        };
        assert!(
            one.loss_after < 0.5 * one.loss_before,
            "the model must learn: loss {} -> {}",
            one.loss_before,
            one.loss_after
        );
        for ordinals in sets {
            for coalesce in [false, true] {
                let run = train_embedding(place, ordinals, transport, index, coalesce).unwrap();
                let what = format!("replicas {ordinals:?}, {index:?} indices, coalesce {coalesce}");
                assert_allclose(
                    &run.table,
                    &one.table,
                    1e-4,
                    1e-5,
                    &format!("table, {what}"),
                );
                assert_allclose(&run.w, &one.w, 1e-4, 1e-5, &format!("w, {what}"));
                assert!(run.loss_after.is_finite(), "{what}");
            }
        }
    }
    true
}
