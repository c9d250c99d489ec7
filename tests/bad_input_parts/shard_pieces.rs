//! Reduce-scatter and allgather write the owned pieces only: sentinels around and between the
//! tensors stay.

use super::*;

// ------------------------------------------------------------------ shards: the owned pieces only

/// Filled around and between the registered tensors: a write outside them shows.
const SENTINEL: u8 = 0xA5;
/// Sentinel bytes before and after each tensor (a multiple of 8, so every tensor stays aligned).
const GAP: usize = 40;

/// One replica's tensors in one allocation, each between sentinel gaps.
struct Arena {
    words: Vec<u64>,
    /// Byte offset of each tensor.
    at: Vec<usize>,
}

impl Arena {
    fn new(tensors: &[Buf]) -> Arena {
        let mut at = Vec::new();
        let mut end = GAP;
        for t in tensors {
            at.push(end);
            end += (t.len() * t.dtype().size()).next_multiple_of(8) + GAP;
        }
        let mut arena = Arena {
            words: vec![u64::from_ne_bytes([SENTINEL; 8]); end / 8],
            at,
        };
        for (i, t) in tensors.iter().enumerate() {
            arena.write(i, t);
        }
        arena
    }

    fn bytes(&self) -> Vec<u8> {
        self.words.iter().flat_map(|w| w.to_ne_bytes()).collect()
    }

    fn write(&mut self, i: usize, t: &Buf) {
        let b = t.bytes();
        assert!(self.at[i] + b.len() <= self.words.len() * 8);
        // SAFETY: in bounds of the words (checked above); registered memory is only written
        // by the library inside a call, and no call runs now.
        unsafe { ptr::copy_nonoverlapping(b.as_ptr(), self.ptr(i).cast::<u8>(), b.len()) };
    }

    fn ptr(&mut self, i: usize) -> *mut c_void {
        // SAFETY: the offset is inside the words.
        unsafe { self.words.as_mut_ptr().cast::<u8>().add(self.at[i]).cast() }
    }

    /// What byte `b` of the arena belongs to, for a failure message.
    fn locate(&self, b: usize, names: &[String], sizes: &[usize]) -> String {
        for (i, &at) in self.at.iter().enumerate() {
            if b >= at && b < at + sizes[i] {
                return format!("'{}' byte {}", names[i], b - at);
            }
        }
        format!("a sentinel gap (arena byte {b})")
    }
}

/// dpsync_reduce_scatter_grads writes only the owned pieces of the GRADs: every replica's memory
/// around and between the tensors is filled with a sentinel, and after the call each replica's
/// whole allocation holds exactly its inputs with only its owned pieces replaced by the
/// reduction (dpsync_allreduce_grads' bytes): the sentinels, the other elements and the other
/// roles are as they were. Every dtype, SUM and AVG, 1 to 7 replicas (pieces that are empty when
/// a tensor has fewer elements than replicas), fusion off, small and the default, the host's
/// threaded path (a tensor over a MiB), and a second step whose gradients were marked ready.
/// dpsync_allgather then gives every replica the whole reduction, sentinels still intact.
#[test]
fn reduce_scatter_writes_only_the_owned_pieces() {
    let shapes: [(&str, u32, DType, usize); 11] = [
        ("g_one", GRAD, DType::F32, 1),
        ("g_two", GRAD, DType::F32, 2),
        ("g_f16", GRAD, DType::F16, 5),
        ("g_bf16", GRAD, DType::BF16, 9),
        ("p", PARAM, DType::F32, 6),
        ("g_f64", GRAD, DType::F64, 3),
        ("g_i32", GRAD, DType::I32, 7),
        ("s", STATE, DType::I64, 3),
        ("g_i64", GRAD, DType::I64, 4),
        ("g_f32", GRAD, DType::F32, 13),
        ("g_large", GRAD, DType::F32, 300_000 + 7),
    ];
    let names: Vec<String> = shapes.iter().map(|s| s.0.to_owned()).collect();
    let sizes: Vec<usize> = shapes.iter().map(|s| s.3 * s.2.size()).collect();
    for (n, fusion) in [
        (1, None),
        (2, Some(0)),
        (3, Some(48)),
        (3, None),
        (4, Some(0)),
        (7, Some(64)),
    ] {
        for op in [SUM, AVG] {
            let what = format!("{n} replicas, fusion {fusion:?}, op {op}");
            let ctx = Context::host(n, fusion);
            let input = |step: usize| -> Vec<Vec<Buf>> {
                (0..n)
                    .map(|r| {
                        (shapes.iter().enumerate())
                            .map(|(t, &(_, _, d, count))| {
                                Buf::random(d, count, (step * 1000 + r * 50 + t) as u64)
                            })
                            .collect()
                    })
                    .collect()
            };
            let first = input(0);
            let inputs = first.clone();
            let mut arenas: Vec<Arena> = inputs.iter().map(|ts| Arena::new(ts)).collect();
            for (r, arena) in arenas.iter_mut().enumerate() {
                for (t, &(name, role, d, count)) in shapes.iter().enumerate() {
                    let p = arena.ptr(t);
                    check(
                        register_raw(ctx.0, name, role, r, p, count, d.code()),
                        &what,
                    );
                }
            }
            let expect = |inputs: &[Vec<Buf>], gathered: bool| -> Vec<Vec<u8>> {
                let mut want: Vec<Arena> = inputs.iter().map(|ts| Arena::new(ts)).collect();
                for (t, &(_, role, _, count)) in shapes.iter().enumerate() {
                    if role != GRAD {
                        continue;
                    }
                    let per: Vec<&Buf> = inputs.iter().map(|ts| &ts[t]).collect();
                    let red = reference_allreduce(&per, op);
                    for (r, a) in want.iter_mut().enumerate() {
                        let (at, k) = if gathered {
                            (0, count)
                        } else {
                            owned(count, r, n)
                        };
                        a.write(t, &spliced(&inputs[r][t], &red, at, k));
                    }
                }
                want.iter().map(Arena::bytes).collect()
            };
            let compare = |arenas: &[Arena], want: &[Vec<u8>], when: &str| {
                for (r, (a, w)) in arenas.iter().zip(want).enumerate() {
                    let got = a.bytes();
                    if let Some(b) = (0..got.len()).find(|&b| got[b] != w[b]) {
                        panic!(
                            "{what}, {when}: replica {r}: {} is {:#04x}, want {:#04x}",
                            a.locate(b, &names, &sizes),
                            got[b],
                            w[b]
                        );
                    }
                }
            };

            check(reduce_scatter(ctx.0, op), &what);
            compare(
                &arenas,
                &expect(&inputs, false),
                "after reduce_scatter_grads",
            );
            for (t, &(name, _, _, count)) in shapes.iter().enumerate() {
                for r in 0..n {
                    let (st, o, c) = shard(ctx.0, name, r);
                    check(st, &format!("{what}: shard '{name}' on replica {r}"));
                    assert_eq!((o, c), owned(count, r, n), "{what}: '{name}' #{t}");
                }
            }
            check(allgather(ctx.0, GRAD), &what);
            compare(&arenas, &expect(&inputs, true), "after allgather(GRAD)");

            // Step 2: new gradients, every one marked ready (nothing starts early after a
            // reduce-scatter step), then a reduce-scatter again.
            let inputs = input(1);
            for (r, a) in arenas.iter_mut().enumerate() {
                for (t, &(name, role, _, _)) in shapes.iter().enumerate() {
                    if role == GRAD {
                        a.write(t, &inputs[r][t]);
                        check(ctx.grad_ready(name, r), &format!("{what}: grad_ready"));
                    }
                }
            }
            // The other roles keep step 0's bytes.
            let mut mixed = inputs.clone();
            for (t, &(_, role, _, _)) in shapes.iter().enumerate() {
                if role != GRAD {
                    for r in 0..n {
                        mixed[r][t] = first[r][t].clone();
                    }
                }
            }
            check(reduce_scatter(ctx.0, op), &format!("{what}: step 2"));
            compare(
                &arenas,
                &expect(&mixed, false),
                "step 2, after reduce_scatter_grads",
            );
            drop(ctx);
            compare(
                &arenas,
                &expect(&mixed, false),
                "step 2, after context_destroy",
            );
        }
    }
}
