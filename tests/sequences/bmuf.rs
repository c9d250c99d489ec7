//! Modelled BMUF: the block filter's arithmetic, `dpsync_bmuf_init` and `dpsync_bmuf_step`.

use std::ops::{Add, Mul, Sub};

use crate::buffers::{addr, is_float};
use crate::common::{abi::*, buf::*, float16::*};
use crate::model::{Sim, Want};
use dpsync::*;

/// docs/API.md "BMUF": every operation in the state type, rounded as written (no FMA).
pub(crate) fn bmuf_filter<T>(
    a: &[T],
    w: &mut [T],
    d: &mut [T],
    mu: T,
    eta: T,
    nesterov: bool,
) -> Vec<T>
where
    T: Copy + Add<Output = T> + Sub<Output = T> + Mul<Output = T>,
{
    (0..a.len())
        .map(|i| {
            let wg = if nesterov { w[i] + mu * d[i] } else { w[i] };
            let g = a[i] - wg;
            let dn = mu * d[i] + eta * g;
            let wn = w[i] + dn;
            d[i] = dn;
            w[i] = wn;
            if nesterov {
                wn + mu * dn
            } else {
                wn
            }
        })
        .collect()
}

/// `W` and `D` of one PARAM: f64 for f64 params, f32 for f32/f16/bf16.
#[derive(Clone)]
pub(crate) enum State {
    F32(Vec<f32>, Vec<f32>),
    F64(Vec<f64>, Vec<f64>),
}

pub(crate) fn widen32(b: &Buf) -> Vec<f32> {
    match b {
        Buf::F32(v) => v.clone(),
        Buf::F16(v) => v.iter().map(|&x| f16_to_f32(x)).collect(),
        Buf::BF16(v) => v.iter().map(|&x| bf16_to_f32(x)).collect(),
        _ => unreachable!("f32 state for f32/f16/bf16 params"),
    }
}

pub(crate) fn narrow32(dtype: DType, v: &[f32]) -> Buf {
    match dtype {
        DType::F32 => Buf::F32(v.to_vec()),
        DType::F16 => Buf::F16(v.iter().map(|&x| f32_to_f16(x)).collect()),
        DType::BF16 => Buf::BF16(v.iter().map(|&x| f32_to_bf16(x)).collect()),
        _ => unreachable!(),
    }
}

pub(crate) struct BmufParam {
    pub(crate) name: String,
    pub(crate) ptrs: Vec<usize>,
    pub(crate) count: usize,
    pub(crate) dtype: DType,
    pub(crate) state: State,
}

pub(crate) struct Bmuf {
    pub(crate) lr: f64,
    pub(crate) mu: f64,
    pub(crate) nesterov: bool,
    pub(crate) params: Vec<BmufParam>,
}

impl Sim {
    pub(crate) fn op_bmuf_init(&mut self) {
        let lr = if self.chance(0.08) {
            self.pick(&[0.0, -1.0, f64::NAN, f64::INFINITY])
        } else {
            self.pick(&[1.0, 0.5, 2.0, 0.75])
        };
        let mu = if self.chance(0.08) {
            self.pick(&[1.0, 1.5, f64::NAN, f64::INFINITY, f64::NEG_INFINITY])
        } else {
            self.pick(&[-1.0, 0.0, 0.5, 0.25, 0.875, 0.9])
        };
        let nesterov = self.chance(0.5);
        let params = self.selected(PARAM);
        let mut errs = Vec::new();
        let lr_ok = lr.is_finite() && lr > 0.0;
        let mu_ok = mu < 1.0; // negative, -inf too: the default 1 - 1/N; NaN fails
        if !lr_ok || !mu_ok {
            errs.push(INVALID_ARGUMENT);
        }
        if self.inconsistent(PARAM) {
            errs.push(INCONSISTENT);
        }
        if params.is_empty() {
            errs.push(INVALID_STATE); // no (consistent) PARAM
        }
        if (params.iter()).any(|&t| !is_float(self.tensors[t].spec().expect("consistent").1)) {
            errs.push(INVALID_ARGUMENT);
        }
        let want = if errs.is_empty() {
            let mut pred = self.contents();
            for &t in &params {
                let b = self.tensors[t].buf(0).clone();
                Self::set_all(&mut pred, t, &b);
            }
            Want::Ok(pred)
        } else {
            Want::Err(errs)
        };
        // SAFETY: valid handle.
        let st = self.call(
            format!("bmuf_init(lr {lr}, mu {mu}, nesterov {nesterov})"),
            want,
            |ctx| unsafe { dpsync_bmuf_init(ctx, lr, mu, nesterov) },
        );
        if st != OK {
            return;
        }
        let mu = if mu < 0.0 {
            1.0 - 1.0 / self.n as f64
        } else {
            mu
        };
        let params = (params.into_iter())
            .map(|t| {
                let tensor = &self.tensors[t];
                let b = tensor.buf(0);
                let state = match b {
                    Buf::F64(v) => State::F64(v.clone(), vec![0.0; v.len()]),
                    _ => State::F32(widen32(b), vec![0.0; b.len()]),
                };
                BmufParam {
                    name: tensor.name.clone(),
                    ptrs: (0..self.n).map(|r| addr(tensor.buf(r))).collect(),
                    count: b.len(),
                    dtype: b.dtype(),
                    state,
                }
            })
            .collect();
        self.bmuf = Some(Bmuf {
            lr,
            mu,
            nesterov,
            params,
        });
    }

    /// Whether the PARAMs registered now are those the filter was started over.
    pub(crate) fn bmuf_params_match(&self, bmuf: &Bmuf) -> bool {
        let now = self.selected(PARAM);
        now.len() == bmuf.params.len()
            && now.iter().all(|&t| {
                let tensor = &self.tensors[t];
                let (_, dtype, count) = tensor.spec().expect("consistent");
                bmuf.params.iter().any(|p| {
                    p.name == tensor.name
                        && p.dtype == dtype
                        && p.count == count
                        && (0..self.n).all(|r| addr(tensor.buf(r)) == p.ptrs[r])
                })
            })
    }

    pub(crate) fn op_bmuf_step(&mut self) {
        let started = (self.bmuf.as_ref()).is_some_and(|b| self.bmuf_params_match(b));
        if !started && self.chance(0.6) {
            self.op_bmuf_init();
        }
        let mut errs = Vec::new();
        match &self.bmuf {
            None => errs.push(INVALID_STATE),
            Some(b) if !self.inconsistent(PARAM) && !self.bmuf_params_match(b) => {
                errs.push(INVALID_STATE)
            }
            Some(_) => {}
        }
        if self.inconsistent(PARAM) {
            errs.extend([INCONSISTENT, INVALID_STATE]);
        }
        let mut new_state = Vec::new();
        let want = if errs.is_empty() {
            let bmuf = self.bmuf.as_ref().expect("started");
            let mut pred = self.contents();
            for p in &bmuf.params {
                let t = self.find(&p.name).expect("checked");
                let a = self.reduce(t, AVG);
                let mut state = p.state.clone();
                let out = match &mut state {
                    State::F64(w, d) => {
                        let Buf::F64(a) = &a else { unreachable!() };
                        let out = bmuf_filter(a, w, d, bmuf.mu, bmuf.lr, bmuf.nesterov);
                        Buf::F64(out)
                    }
                    State::F32(w, d) => {
                        let a = widen32(&a);
                        let (mu, lr) = (bmuf.mu as f32, bmuf.lr as f32);
                        narrow32(p.dtype, &bmuf_filter(&a, w, d, mu, lr, bmuf.nesterov))
                    }
                };
                Self::set_all(&mut pred, t, &out);
                new_state.push(state);
            }
            Want::Ok(pred)
        } else {
            Want::Err(errs)
        };
        // SAFETY: valid handle.
        let st = self.call("bmuf_step()".into(), want, |ctx| unsafe {
            dpsync_bmuf_step(ctx)
        });
        if st == OK {
            let bmuf = self.bmuf.as_mut().expect("started");
            for (p, s) in bmuf.params.iter_mut().zip(new_state) {
                p.state = s;
            }
        }
    }
}
