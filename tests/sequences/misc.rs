//! The remaining calls: replica count, loss scale, synchronize, streams on host replicas,
//! invalid names and handles, version and status names.

use std::ffi::CStr;
use std::ptr;

use crate::common::{abi::*, buf::*, errors::*};
use crate::model::{Sim, Want, LAST_STATUS};
use dpsync::*;

impl Sim {
    pub(crate) fn op_misc(&mut self) {
        let n = self.n;
        match self.g.below(9) {
            0 => {
                let mut out = 0usize;
                let want = self.unchanged();
                // SAFETY: valid handle and out pointer.
                self.call("replica_count".into(), want, |ctx| unsafe {
                    dpsync_replica_count(ctx, &mut out)
                });
                if out != n {
                    self.fail(format!("replica_count {out}, want {n}"));
                }
            }
            1 => {
                let mut out = 0f64;
                let want = self.unchanged();
                // SAFETY: valid handle and out pointer.
                self.call("loss_scale".into(), want, |ctx| unsafe {
                    dpsync_loss_scale(ctx, &mut out)
                });
                if out != 1.0 / n as f64 {
                    self.fail(format!("loss_scale {out}, want 1/{n}"));
                }
            }
            2 => {
                // SAFETY: NULL out pointers are refused.
                self.call(
                    "replica_count(NULL)".into(),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |ctx| unsafe { dpsync_replica_count(ctx, ptr::null_mut()) },
                );
                // SAFETY: as above.
                self.call(
                    "loss_scale(NULL)".into(),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |ctx| unsafe { dpsync_loss_scale(ctx, ptr::null_mut()) },
                );
            }
            3 => {
                let want = self.unchanged();
                // SAFETY: valid handle.
                self.call("synchronize".into(), want, |ctx| unsafe {
                    dpsync_synchronize(ctx)
                });
            }
            4 => {
                let r = self.pick_replica();
                // SAFETY: host replicas refuse streams.
                self.call(
                    format!("set_stream({r}, NULL)"),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |ctx| unsafe { dpsync_set_stream(ctx, r, ptr::null_mut()) },
                );
            }
            5 => {
                let op = self.pick_op();
                // SAFETY: a NULL context is refused.
                self.call(
                    "allreduce_grads(NULL context)".into(),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |_| unsafe { dpsync_allreduce_grads(ptr::null_mut(), op) },
                );
            }
            6 => {
                // An invalid UTF-8 name is refused before anything else is looked at.
                let bad = c"w\xff\xfe";
                let r = self.pick_replica();
                let mut data = Buf::zeros(DType::F32, 1);
                let p = data.ptr();
                self.graveyard.push(data);
                let which = self.g.below(4);
                let what = ["unregister", "allreduce", "grad_ready", "register"][which as usize];
                // SAFETY: valid handle, NUL-terminated name, live data.
                self.call(
                    format!("{what}(invalid UTF-8 name)"),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |c| unsafe {
                        match which {
                            0 => dpsync_unregister(c, bad.as_ptr()),
                            1 => dpsync_allreduce(c, bad.as_ptr(), SUM),
                            2 => dpsync_grad_ready(c, bad.as_ptr(), r),
                            _ => dpsync_register(c, bad.as_ptr(), GRAD, r, p, 1, F32),
                        }
                    },
                );
            }
            7 => {
                let r = self.pick_replica();
                let which = self.g.below(3);
                let what = ["unregister", "grad_ready", "sparse_set"][which as usize];
                // SAFETY: a NULL name is refused before anything is read.
                self.call(
                    format!("{what}(NULL name)"),
                    Want::Err(vec![INVALID_ARGUMENT]),
                    |c| unsafe {
                        match which {
                            0 => dpsync_unregister(c, ptr::null()),
                            1 => dpsync_grad_ready(c, ptr::null(), r),
                            _ => dpsync_sparse_set(c, ptr::null(), r, ptr::null(), ptr::null(), 0),
                        }
                    },
                );
            }
            _ => {
                // The version and status names are static strings.
                // SAFETY: static NUL-terminated strings.
                let v = unsafe { CStr::from_ptr(dpsync_version()) };
                if v.to_str() != Ok(env!("CARGO_PKG_VERSION")) {
                    self.fail(format!("version {v:?}"));
                }
                for code in 0..=LAST_STATUS {
                    if !status_name(code).starts_with("DPSYNC_STATUS_") {
                        self.fail(format!("status name of {code}"));
                    }
                }
            }
        }
    }
}
