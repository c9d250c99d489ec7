//! Modelled registration calls: `dpsync_register` and `dpsync_unregister`, and what a framework
//! does with them (every replica, repairs, re-attaching kept memory, new contents).

use std::ffi::c_void;
use std::ptr;

use crate::buffers::{addr, dtype_of, is_float, refill};
use crate::common::{abi::*, buf::*, context::*};
use crate::model::{Sim, Slot, Tensor, Want, ROLES};
use dpsync::*;

/// Where the data pointer of a registration comes from.
pub(crate) enum Data {
    /// A fresh buffer of `count` elements.
    New,
    Null,
    /// A buffer of count + 1 elements, one byte in.
    Misaligned,
    /// The pointer of the slot's current buffer (re-registration).
    Reuse,
    /// A buffer kept by the test (an unregistered tensor registered again).
    Given(Buf),
}

impl Sim {
    /// One `dpsync_register` call, checked; the model follows on success.
    pub(crate) fn register_call(
        &mut self,
        name: &str,
        role: u32,
        replica: usize,
        count: usize,
        dtype: u32,
        data: Data,
    ) -> dpsync_status {
        let dt = dtype_of(dtype);
        let alloc_dt = dt.unwrap_or(DType::F32);
        let alloc = count.min(64);
        let existing = self.find(name);
        let slot = existing
            .filter(|_| replica < self.n)
            .and_then(|t| self.tensors[t].slots[replica].as_ref());
        let (mut owned, ptr, kind) = match data {
            Data::New => {
                let mut b = Buf::zeros(alloc_dt, alloc);
                refill(&mut b, &mut self.g);
                let p = b.ptr();
                (Some(b), p, "new")
            }
            Data::Null => (None, ptr::null_mut(), "NULL"),
            Data::Misaligned => {
                let mut b = Buf::zeros(alloc_dt, alloc + 1);
                // SAFETY: one byte into a buffer of alloc + 1 elements of at least 2 bytes.
                let p = unsafe { b.ptr().cast::<u8>().add(1) }.cast::<c_void>();
                (Some(b), p, "misaligned")
            }
            Data::Reuse => {
                let p = slot.map_or(ptr::null_mut(), |s| addr(&s.buf) as *mut c_void);
                (None, p, "its own")
            }
            Data::Given(mut b) => {
                let p = b.ptr();
                (Some(b), p, "kept")
            }
        };
        let misaligned = kind == "misaligned";
        let identical = slot.is_some_and(|s| {
            Some(s.dtype) == dt
                && s.role == role
                && s.buf.len() == count
                && addr(&s.buf) == ptr as usize
        });
        let mut errs = Vec::new();
        if name.is_empty()
            || !ROLES.contains(&role)
            || ptr.is_null()
            || count == 0
            || dt.is_none()
            || replica >= self.n
            || misaligned
            || count
                .checked_mul(alloc_dt.size())
                .is_none_or(|b| b > isize::MAX as usize)
        {
            errs.push(INVALID_ARGUMENT);
        }
        if self.find_sparse(name).is_some() || (slot.is_some() && !identical) {
            errs.push(CONFLICT);
        }
        if self.mid_step() && !identical {
            errs.push(INVALID_STATE);
        }
        let want = self.unchanged_unless(errs);
        let c = cstr(name);
        let what = format!(
            "register('{name}', role {role}, replica {replica}, {kind} data, count {count}, dtype {dtype})"
        );
        // SAFETY: the data outlives its registration (owned by the model or the graveyard).
        let st = self.call(what, want, |ctx| unsafe {
            dpsync_register(ctx, c.as_ptr(), role, replica, ptr, count, dtype)
        });
        if st == OK && !identical {
            let b = owned
                .take()
                .expect("a successful new registration has its buffer");
            let slot = Slot {
                role,
                dtype: dt.expect("valid"),
                buf: b,
            };
            match existing {
                Some(t) => self.tensors[t].slots[replica] = Some(slot),
                None => {
                    let mut slots: Vec<Option<Slot>> = (0..self.n).map(|_| None).collect();
                    slots[replica] = Some(slot);
                    self.tensors.push(Tensor {
                        name: name.to_owned(),
                        slots,
                    });
                }
            }
            self.marks = None; // the buckets may have changed: the step's marks are forgotten
        }
        if let Some(b) = owned {
            self.graveyard.push(b);
        }
        st
    }

    /// A framework usually ends the step (allreduce_grads) before it changes registrations;
    /// while `grad_ready` has reduced a bucket, registrations are refused.
    pub(crate) fn maybe_end_step(&mut self) {
        if self.mid_step() && self.chance(0.5) {
            self.op_allreduce_grads();
        }
    }

    /// One random registration, valid or not.
    pub(crate) fn op_register(&mut self) {
        self.maybe_end_step();
        let name = self.pick_name();
        let existing = self.find(&name);
        let mut replica = self.pick_replica();
        if let Some(t) = existing {
            let missing: Vec<usize> = (0..self.n)
                .filter(|&r| self.tensors[t].slots[r].is_none())
                .collect();
            if !missing.is_empty() && self.chance(0.5) {
                replica = self.pick(&missing);
            }
        }
        let reference = existing.and_then(|t| self.tensors[t].reference());
        let (mut role, mut dtype, mut count) =
            (self.pick_role(), self.pick_dtype(), self.pick_count());
        if let Some((r, d, c)) = reference {
            if self.chance(0.7) {
                (role, dtype, count) = (r, d.code(), c);
            }
        }
        let has_slot =
            existing.is_some_and(|t| replica < self.n && self.tensors[t].slots[replica].is_some());
        let data = match self.g.below(100) {
            0..=3 => Data::Null,
            4..=7 => Data::Misaligned,
            8..=40 if has_slot => Data::Reuse,
            _ => Data::New,
        };
        self.register_call(&name, role, replica, count, dtype, data);
    }

    /// A new name on every replica (what a framework does), sometimes with one replica that
    /// disagrees or is left out.
    pub(crate) fn op_register_all(&mut self) {
        if self.tensors.len() >= 9 {
            return self.op_unregister();
        }
        let Some(name) = self.free_name() else {
            return;
        };
        self.maybe_end_step();
        let role = self.pick(&ROLES);
        let mut dtype = self.pick(&DType::ALL);
        if role == PARAM && !is_float(dtype) && self.chance(0.8) {
            dtype = DType::F32; // BMUF refuses integer PARAMs: keep most models filterable
        }
        let count = if self.chance(0.2) {
            13 + self.g.below(40) as usize
        } else {
            1 + self.g.below(12) as usize
        };
        let odd = if self.chance(0.15) {
            Some(self.g.below(self.n as u64) as usize)
        } else {
            None
        };
        self.note(format!("-- register '{name}' on every replica"));
        for r in 0..self.n {
            let (mut role, mut dtype, mut count) = (role, dtype, count);
            if odd == Some(r) {
                match self.g.below(4) {
                    0 => continue, // left out
                    1 => count += 1,
                    2 => dtype = self.pick(&DType::ALL),
                    _ => role = self.pick(&ROLES),
                }
            }
            self.register_call(&name, role, r, count, dtype.code(), Data::New);
            if self.chance(0.05) {
                // a duplicate initialiser: the identical registration again
                self.register_call(&name, role, r, count, dtype.code(), Data::Reuse);
            }
        }
    }

    /// Registers an inconsistent name where it is missing, like its first registration.
    pub(crate) fn op_complete(&mut self) {
        let partial: Vec<usize> = (0..self.tensors.len())
            .filter(|&t| self.tensors[t].slots.iter().any(Option::is_none))
            .collect();
        if partial.is_empty() {
            return self.op_register();
        }
        let t = self.pick(&partial);
        let name = self.tensors[t].name.clone();
        let (role, dtype, count) = self.tensors[t].reference().expect("registered somewhere");
        for r in 0..self.n {
            let t = self.find(&name);
            if t.is_some_and(|t| self.tensors[t].slots[r].is_none()) {
                self.register_call(&name, role, r, count, dtype.code(), Data::New);
            }
        }
    }

    /// What a framework does after a mistake: every inconsistent dense name completed where it
    /// is only missing, otherwise unregistered; every inconsistent sparse gradient unregistered.
    pub(crate) fn op_repair(&mut self) {
        self.note("-- repair inconsistent names".into());
        let bad: Vec<String> = (self.tensors.iter())
            .filter(|t| t.spec().is_none())
            .map(|t| t.name.clone())
            .collect();
        for name in bad {
            let t = self.find(&name).expect("registered");
            let reference = self.tensors[t].reference().expect("registered somewhere");
            let only_missing = (self.tensors[t].slots.iter().flatten())
                .all(|s| (s.role, s.dtype, s.buf.len()) == reference);
            if only_missing && self.chance(0.7) {
                let (role, dtype, count) = reference;
                for r in 0..self.n {
                    if self.tensors[t].slots[r].is_none() {
                        self.register_call(&name, role, r, count, dtype.code(), Data::New);
                    }
                }
            } else {
                self.unregister_call(&name);
            }
        }
        let bad: Vec<String> = (self.sparse.iter())
            .filter(|s| s.spec().is_none())
            .map(|s| s.name.clone())
            .collect();
        for name in bad {
            self.unregister_call(&name);
        }
    }

    pub(crate) fn unregister_call(&mut self, name: &str) {
        let dense = self.find(name);
        let sparse = self.find_sparse(name);
        let want = if sparse.is_some() {
            self.unchanged()
        } else if dense.is_some() {
            if self.mid_step() {
                Want::Err(vec![INVALID_STATE])
            } else {
                self.unchanged()
            }
        } else if name.is_empty() {
            Want::Err(vec![INVALID_ARGUMENT])
        } else {
            Want::Err(vec![NOT_FOUND])
        };
        let c = cstr(name);
        // SAFETY: valid handle and name.
        let st = self.call(format!("unregister('{name}')"), want, |ctx| unsafe {
            dpsync_unregister(ctx, c.as_ptr())
        });
        if st != OK {
            return;
        }
        if let Some(s) = sparse {
            let s = self.sparse.remove(s);
            for sl in s.slices.into_iter().flatten() {
                self.graveyard.push(sl.indices);
                self.graveyard.push(sl.values);
            }
        } else if let Some(t) = dense {
            let t = self.tensors.remove(t);
            self.marks = None;
            self.detached.push(t);
            if self.detached.len() > 4 {
                let old = self.detached.remove(0);
                self.graveyard
                    .extend(old.slots.into_iter().flatten().map(|s| s.buf));
            }
        }
    }

    pub(crate) fn op_unregister(&mut self) {
        self.maybe_end_step();
        let inconsistent: Vec<String> = (self.tensors.iter())
            .filter(|t| t.spec().is_none())
            .map(|t| t.name.clone())
            .collect();
        let name = if !inconsistent.is_empty() && self.chance(0.4) {
            self.pick_from(&inconsistent)
        } else {
            self.pick_name()
        };
        self.unregister_call(&name);
    }

    pub(crate) fn pick_from(&mut self, names: &[String]) -> String {
        names[self.g.below(names.len() as u64) as usize].clone()
    }

    /// An unregistered tensor registered again with its old memory (what BMUF accepts as
    /// "undoing the change").
    pub(crate) fn op_reattach(&mut self) {
        let free: Vec<usize> = (0..self.detached.len())
            .filter(|&i| {
                let name = &self.detached[i].name;
                self.find(name).is_none() && self.find_sparse(name).is_none()
            })
            .collect();
        if free.is_empty() {
            return self.op_register_all();
        }
        let i = self.pick(&free);
        let t = self.detached.remove(i);
        self.note(format!(
            "-- register '{}' again with its old memory",
            t.name
        ));
        for (r, slot) in t.slots.into_iter().enumerate() {
            if let Some(s) = slot {
                let (role, dtype, count) = (s.role, s.dtype.code(), s.buf.len());
                self.register_call(&t.name, role, r, count, dtype, Data::Given(s.buf));
            }
        }
    }

    /// The framework computes: new values in some registered buffers (not in GRADs a bucket
    /// of this step was already reduced from, and not in slices: those are set fresh).
    pub(crate) fn op_refill(&mut self) {
        let mid = self.mid_step();
        let mut touched = Vec::new();
        for t in 0..self.tensors.len() {
            if self.g.below(2) == 0 || (mid && self.tensors[t].role_bits() & GRAD != 0) {
                continue;
            }
            for r in 0..self.n {
                if self.g.below(4) == 0 {
                    continue;
                }
                if let Some(s) = self.tensors[t].slots[r].as_mut() {
                    refill(&mut s.buf, &mut self.g);
                    touched.push(format!("{}@{r}", self.tensors[t].name));
                }
            }
        }
        self.note(format!("-- refill {}", touched.join(" ")));
    }
}
