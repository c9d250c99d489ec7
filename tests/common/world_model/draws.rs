//! What the randomized tests draw alike on every rank: marks, a step's sparse slices, and
//! BMUF's filter as the model runs it.

use super::*;

/// Below `n`, as an index.
fn below(g: &mut Lcg, n: usize) -> usize {
    g.below(n as u64) as usize
}

/// Every rank's `dpsync_grad_ready` marks `(tensor, local replica)` of the `grads` (tensor
/// indices, in the order to mark them): per rank all, some or none; with `uniform` the same
/// tensors on every rank, on all its replicas. Drawn for every rank, so that every rank draws
/// alike (and knows what every other marked).
pub fn marks(
    g: &mut Lcg,
    per_rank: &[usize],
    grads: &[usize],
    uniform: bool,
) -> Vec<Vec<(usize, usize)>> {
    let common = below(g, 3);
    let picks: Vec<bool> = grads.iter().map(|_| g.below(2) == 0).collect();
    let mut every = Vec::new();
    for &replicas in per_rank {
        let pattern = if uniform { common } else { below(g, 3) };
        let mut its = Vec::new();
        for (i, &t) in grads.iter().enumerate() {
            for k in 0..replicas {
                let pick = g.below(2) == 0;
                let marked =
                    pattern == 1 || (pattern == 2 && if uniform { picks[i] } else { pick });
                if marked {
                    its.push((t, k));
                }
            }
        }
        every.push(its);
    }
    every
}

impl Slices {
    /// A step's slices of the `sparse` gradients: rows 0..3 per world replica, pairs of
    /// gradients sharing their indices (one buffer, or two of the same content), empty slices
    /// NULL, with an empty buffer's address or one of their own; this rank's buffers for its
    /// replicas `offset..offset + local`. `uniform`: every world replica set up alike, and
    /// every buffer with an address of its own (ranks group slices by their buffers). The
    /// buffers live where `at` says.
    pub fn draw(
        g: &mut Lcg,
        sparse: &[Sparse],
        total: usize,
        (offset, local): (usize, usize),
        uniform: bool,
        at: &Where,
    ) -> Slices {
        let mut sl = Slices::default();
        let mut paired = vec![false; sparse.len()];
        let mut kinds = Vec::new();
        for (s, sp) in sparse.iter().enumerate() {
            let pair = s > 0 && !paired[s - 1] && sparse[s - 1].idt == sp.idt;
            paired[s] = pair && g.below(2) == 0;
            let (mut idx, mut val) = (Vec::new(), Vec::new());
            for w in 0..total {
                let i: Vec<i64> = match paired[s] {
                    true => sl.idx[s - 1][w].clone(),
                    false => (0..g.below(4)).map(|_| g.below(8) as i64).collect(),
                };
                val.push(
                    (0..i.len() * sp.row_len)
                        .map(|_| g.below(4) as f64)
                        .collect(),
                );
                idx.push(i);
            }
            let one = below(g, 3);
            let kind: Vec<usize> = (0..total).map(|_| below(g, 3)).collect();
            let kind: Vec<usize> = kind
                .into_iter()
                .map(|k| if uniform { one } else { k })
                .collect();
            if paired[s] && kind.iter().all(|&k| k < 2) {
                sl.shared.push(s);
            }
            let shares = kind.iter().map(|&k| paired[s] && k < 2).collect();
            sl.with_prev.push(shares);
            sl.idx.push(idx);
            sl.val.push(val);
            kinds.push(kind);
        }
        for (s, sp) in sparse.iter().enumerate() {
            let mut row = Vec::new();
            for k in 0..local {
                let w = offset + k;
                let (rows, kind) = (sl.idx[s][w].len(), kinds[s][w]);
                let (ibuf, ip) = if paired[s] && kind < 2 {
                    (sl.set[s - 1][k].0, sl.set[s - 1][k].1)
                } else if rows == 0 && !uniform && kind == 0 {
                    (None, std::ptr::null())
                } else {
                    let min = usize::from(rows > 0 || uniform || kind != 1);
                    let i: Vec<f64> = sl.idx[s][w].iter().map(|&i| i as f64).collect();
                    sl.push(at.put(k, make_buf(sp.idt, &i, min)))
                };
                let vp = match ip.is_null() {
                    true => std::ptr::null(),
                    false => sl.push(at.put(k, make_buf(sp.vdt, &sl.val[s][w], 1))).1,
                };
                row.push((ibuf, ip, vp, rows));
            }
            sl.set.push(row);
        }
        sl
    }
}

impl Bmuf {
    /// `dpsync_bmuf_init` succeeded over the PARAMs `params` (indices into `dense`): world
    /// replica 0's values everywhere, W = them, D = 0; `mu` < 0 is 1 - 1/N.
    pub fn start(
        dense: &mut [Dense],
        params: &[usize],
        total: usize,
        (lr, mu, nesterov): (f64, f64, bool),
    ) -> Bmuf {
        let default_mu = mu < 0.0;
        let mu = if default_mu {
            1.0 - 1.0 / total as f64
        } else {
            mu
        };
        let mut b = Bmuf {
            lr,
            default_mu,
            mu,
            nesterov,
            params: vec![],
            w: vec![],
            d: vec![],
        };
        for &t in params {
            let d = &mut dense[t];
            d.vals = vec![d.vals[0].clone(); total];
            b.params.push((d.name.clone(), d.id));
            b.d.push(vec![0.0; d.vals[0].len()]);
            b.w.push(d.vals[0].clone());
        }
        b
    }

    /// The world now has `total` replicas (ranks left): the default momentum counts them.
    pub fn recount(&mut self, total: usize) {
        if self.default_mu {
            self.mu = 1.0 - 1.0 / total as f64;
        }
    }

    /// `dpsync_bmuf_step` succeeded: per element, the mean A as the averaging stores it, then
    /// the filter in the state type (f32 for f32/f16/bf16, f64 for f64), the new param rounded
    /// once to its dtype on every replica.
    pub fn step(&mut self, dense: &mut [Dense]) {
        for (p, (name, _)) in self.params.iter().enumerate() {
            let t = dense.iter_mut().find(|t| &t.name == name).expect("a PARAM");
            let (dt, n) = (t.dtype, t.vals.len());
            let new: Vec<f64> = (0..self.w[p].len())
                .map(|e| {
                    let a = avg(dt, t.vals.iter().map(|v| v[e]).sum(), n);
                    let x = [a, self.w[p][e], self.d[p][e], self.mu, self.lr];
                    let [param, w, d] = match dt {
                        DType::F64 => filter::<f64>(x, self.nesterov, |v| v, |v| v),
                        _ => filter::<f32>(x, self.nesterov, |v| v as f32, |v| v as f64),
                    };
                    (self.w[p][e], self.d[p][e]) = (w, d);
                    round(dt, param)
                })
                .collect();
            t.vals = vec![new; n];
        }
    }
}
