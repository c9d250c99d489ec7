//! The overlap tests' gradients: three GRADs of 1000 f32 (a bucket each with 4000 fusion
//! bytes) on every local CUDA replica, world replica `w` holding `value(w, i) * (t + 1)`.

use super::*;

pub const N: usize = 1000;
pub const NAMES: [&str; 3] = ["g0", "g1", "g2"];

pub struct Grads<'a> {
    ctx: &'a Context,
    g: Vec<Vec<Mem>>,
    /// This rank's replicas, the world's, and the world index of this rank's first.
    local: usize,
    total: usize,
    offset: usize,
    tag: String,
}

impl<'a> Grads<'a> {
    /// Made on `ordinals` (this rank's replicas' GPUs) and registered; `tag` starts every
    /// failure's message.
    pub fn new(
        ctx: &'a Context,
        place: &Place,
        ordinals: &[i32],
        (local, total, offset): (usize, usize, usize),
        tag: String,
    ) -> Grads<'a> {
        let mut grads = Grads {
            ctx,
            g: Vec::new(),
            local,
            total,
            offset,
            tag,
        };
        grads.g = (0..NAMES.len())
            .map(|t| {
                (0..local)
                    .map(|k| place.mem_on(ordinals[k], &grads.init(t, offset + k)))
                    .collect()
            })
            .collect();
        for (t, per_replica) in grads.g.iter().enumerate() {
            for (k, mem) in per_replica.iter().enumerate() {
                let st = register_raw(ctx.0, NAMES[t], GRAD, k, mem.ptr() as *mut _, N, F32);
                check(st, &grads.tag("register"));
            }
        }
        grads
    }

    pub fn tag(&self, what: &str) -> String {
        format!("{}: {what}", self.tag)
    }

    /// Tensor `t`'s bytes on world replica `w`.
    fn init(&self, t: usize, w: usize) -> Vec<u8> {
        let v: Vec<f32> = (0..N)
            .map(|i| (value(w, i) as usize * (t + 1)) as f32)
            .collect();
        bytes_of(&v)
    }

    /// Every replica's gradients as at first.
    pub fn refill(&mut self) {
        for t in 0..self.g.len() {
            for k in 0..self.local {
                let bytes = self.init(t, self.offset + k);
                self.g[t][k].write(&bytes);
            }
        }
    }

    /// Element `i` of tensor `t` summed over the world's replicas.
    fn summed(&self, t: usize, i: usize) -> f32 {
        ((i + 1) * self.total * (self.total + 1) / 2 * (t + 1)) as f32
    }

    /// Every replica holds the world's sums.
    pub fn expect(&self, what: &str) {
        check(
            common::place::synchronize(self.ctx),
            &self.tag("synchronize"),
        );
        for (t, per_replica) in self.g.iter().enumerate() {
            for mem in per_replica {
                let got = from_bytes::<f32>(&mem.read());
                for i in 0..N {
                    let at = format!("{what}: g{t}[{i}]");
                    assert_eq!(got[i], self.summed(t, i), "{}", self.tag(&at));
                }
            }
        }
    }

    /// Every replica holds its own pieces of the world's sums (a reduce-scatter step), the
    /// rest as at first.
    pub fn expect_owned(&self, what: &str) {
        check(
            common::place::synchronize(self.ctx),
            &self.tag("synchronize"),
        );
        for (t, per_replica) in self.g.iter().enumerate() {
            for (k, mem) in per_replica.iter().enumerate() {
                let w = self.offset + k;
                let (got, before) = (from_bytes::<f32>(&mem.read()), self.init(t, w));
                let before = from_bytes::<f32>(&before);
                let (lo, hi) = (N * w / self.total, N * (w + 1) / self.total);
                for i in 0..N {
                    let want = match (lo..hi).contains(&i) {
                        true => self.summed(t, i),
                        false => before[i],
                    };
                    let at = format!("{what}: g{t}[{i}] on replica {k} (owns {lo}..{hi})");
                    assert_eq!(got[i], want, "{}", self.tag(&at));
                }
            }
        }
    }

    /// Every replica's gradients as at first.
    pub fn untouched(&self, what: &str) {
        check(
            common::place::synchronize(self.ctx),
            &self.tag("synchronize"),
        );
        for (t, per_replica) in self.g.iter().enumerate() {
            for (k, mem) in per_replica.iter().enumerate() {
                let want = self.init(t, self.offset + k);
                assert_eq!(mem.read(), want, "{}", self.tag(what));
            }
        }
    }

    /// `dpsync_grad_ready` for `tensors` on every local replica, in that order.
    pub fn mark(&self, tensors: &[usize]) {
        for &t in tensors {
            for k in 0..self.local {
                check(self.ctx.grad_ready(NAMES[t], k), &self.tag("grad_ready"));
            }
        }
    }

    /// describe's `overlap` entry `key`.
    pub fn early(&self, key: &str) -> serde_json::Value {
        self.ctx.describe_json()["overlap"][key].clone()
    }

    /// Step `step`'s agreement fails on every rank (the last rank, of `ranks`, registers
    /// another gradient on `place`'s GPUs `ordinals`): nothing is written, started buckets
    /// drained; once that gradient goes, the step succeeds.
    pub fn failed_agreement(
        &self,
        (place, ordinals): (&Place, &[i32]),
        (rank, ranks): (usize, usize),
        step: &str,
    ) {
        let last = rank == ranks - 1;
        let extra: Vec<Mem> = (0..self.local)
            .map(|k| place.mem_on(ordinals[k], &bytes_of(&[1.0f32; 4])))
            .collect();
        if last {
            for (k, mem) in extra.iter().enumerate() {
                let st = register_raw(self.ctx.0, "extra", GRAD, k, mem.ptr() as *mut _, 4, F32);
                check(st, &self.tag("register extra"));
            }
        }
        let st = self.ctx.allreduce_grads(SUM);
        assert_eq!(st, INCONSISTENT, "{}", self.tag(step));
        self.untouched(&format!("{step}: nothing written after a failed agreement"));
        if last {
            check(self.ctx.unregister("extra"), &self.tag("unregister extra"));
        }
        check(
            self.ctx.allreduce_grads(SUM),
            &self.tag(&format!("{step}, again")),
        );
        self.expect(step);
    }
}
