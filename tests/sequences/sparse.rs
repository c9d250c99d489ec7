//! Modelled sparse gradients: `dpsync_register_sparse`, `dpsync_sparse_set` and
//! `dpsync_sparse_get`, and the gather of a step.

use std::collections::BTreeMap;
use std::ffi::c_void;
use std::ptr;

use crate::buffers::{
    addr, buf_of, divide_each, dtype_of, fill_small, first_difference, index_at, indices_list,
    is_float, read_buf, value_at,
};
use crate::common::{abi::*, buf::*, context::*, reference::*};
use crate::model::{Gathered, Sim, SliceM, SparseM, Spec};
use dpsync::*;

impl Sim {
    pub(crate) fn sparse_register_call(
        &mut self,
        name: &str,
        replica: usize,
        row_len: usize,
        values: u32,
        indices: u32,
        num_embeddings: usize,
    ) {
        let vdt = dtype_of(values).filter(|&d| is_float(d));
        let idt = dtype_of(indices).filter(|&d| !is_float(d));
        let s = self.find_sparse(name);
        let mut errs = Vec::new();
        if name.is_empty()
            || vdt.is_none()
            || idt.is_none()
            || replica >= self.n
            || row_len == 0
            || row_len.checked_mul(vdt.map_or(1, DType::size)).is_none()
        {
            errs.push(INVALID_ARGUMENT);
        }
        if self.find(name).is_some() {
            errs.push(CONFLICT);
        }
        let spec = vdt.zip(idt).map(|(v, i)| Spec {
            row_len,
            values: v,
            indices: i,
            num_embeddings,
        });
        if let Some(old) = s
            .filter(|_| replica < self.n)
            .and_then(|s| self.sparse[s].specs[replica])
        {
            if Some(old) != spec {
                errs.push(CONFLICT);
            }
        }
        let want = self.unchanged_unless(errs);
        let c = cstr(name);
        let what = format!(
            "register_sparse('{name}', replica {replica}, row_len {row_len}, values {values}, \
             indices {indices}, num_embeddings {num_embeddings})"
        );
        // SAFETY: valid handle and name.
        let st = self.call(what, want, |ctx| unsafe {
            dpsync_register_sparse(
                ctx,
                c.as_ptr(),
                replica,
                row_len,
                values,
                indices,
                num_embeddings,
            )
        });
        if st != OK {
            return;
        }
        let s = s.unwrap_or_else(|| {
            self.sparse.push(SparseM {
                name: name.to_owned(),
                specs: vec![None; self.n],
                slices: (0..self.n).map(|_| None).collect(),
                gathered: None,
            });
            self.sparse.len() - 1
        });
        self.sparse[s].specs[replica] = spec;
    }

    pub(crate) fn random_spec(&mut self) -> Spec {
        Spec {
            row_len: 1 + self.g.below(4) as usize,
            values: self.pick(&[DType::F32, DType::F64, DType::F16, DType::BF16]),
            indices: self.pick(&[DType::I32, DType::I64]),
            num_embeddings: self.pick(&[0, 5, 16, 1000]),
        }
    }

    pub(crate) fn op_sparse_register(&mut self) {
        let name = self.pick_name();
        let replica = self.pick_replica();
        let reference = self
            .find_sparse(&name)
            .and_then(|s| self.sparse[s].specs.iter().flatten().next().copied());
        let mut spec = self.random_spec();
        if let Some(r) = reference.filter(|_| self.g.below(10) < 7) {
            spec = r;
        }
        let (mut values, mut indices, mut row_len) =
            (spec.values.code(), spec.indices.code(), spec.row_len);
        match self.g.below(30) {
            0 => values = self.pick(&[I32, I64, 6]),
            1 => indices = self.pick(&[F32, F16, 9]),
            2 => row_len = self.pick(&[0, usize::MAX]),
            _ => {}
        }
        self.sparse_register_call(
            &name,
            replica,
            row_len,
            values,
            indices,
            spec.num_embeddings,
        );
    }

    pub(crate) fn op_sparse_register_all(&mut self) {
        if self.sparse.len() >= 3 {
            return self.op_sparse_set_all();
        }
        let Some(name) = self.free_name() else {
            return;
        };
        let spec = self.random_spec();
        let odd = if self.chance(0.1) {
            Some(self.g.below(self.n as u64) as usize)
        } else {
            None
        };
        self.note(format!("-- register sparse '{name}' on every replica"));
        for r in 0..self.n {
            let mut s = spec;
            if odd == Some(r) {
                if self.chance(0.5) {
                    continue;
                }
                s.row_len += 1;
            }
            let (v, i) = (s.values.code(), s.indices.code());
            self.sparse_register_call(&name, r, s.row_len, v, i, s.num_embeddings);
        }
    }

    /// One `dpsync_sparse_set` with fresh data: `rows` rows; a NULL pointer where asked; the
    /// indices memory of another slice (pointer and a copy of its contents) when `shared`.
    pub(crate) fn sparse_set_call(
        &mut self,
        name: &str,
        replica: usize,
        rows: usize,
        null: (bool, bool),
        shared: Option<(usize, Buf)>,
    ) -> bool {
        let s = self.find_sparse(name);
        let spec = s
            .filter(|_| replica < self.n)
            .and_then(|s| self.sparse[s].specs[replica]);
        let buf_spec = match spec {
            Some(spec) => spec,
            None => self.random_spec(),
        };
        let mut indices = Buf::zeros(buf_spec.indices, rows);
        let bad_row = if shared.is_none() && self.chance(0.05) && rows > 0 {
            Some(self.g.below(rows as u64) as usize)
        } else {
            None
        };
        for k in 0..rows {
            let i: i64 = if bad_row == Some(k) {
                if buf_spec.num_embeddings > 0 {
                    self.pick(&[-1, buf_spec.num_embeddings as i64, 1 << 40])
                } else {
                    -(1 + self.g.below(3) as i64)
                }
            } else if buf_spec.num_embeddings > 0 {
                // few distinct indices, so coalescing has duplicates to sum
                self.g.below(buf_spec.num_embeddings.min(6) as u64) as i64
            } else {
                self.g.below(9) as i64 - 2
            };
            match &mut indices {
                Buf::I32(v) => v[k] = i as i32,
                Buf::I64(v) => v[k] = i,
                _ => unreachable!(),
            }
        }
        let mut values = Buf::zeros(buf_spec.values, rows * buf_spec.row_len);
        fill_small(&mut values, &mut self.g);
        let null_both = rows == 0 && shared.is_none() && self.chance(0.7);
        let mut ip = if null.0 || null_both {
            ptr::null()
        } else {
            addr(&indices) as *const c_void
        };
        if let Some((p, copy)) = shared {
            assert!(rows <= copy.len(), "a shared indices buffer holds the rows");
            self.graveyard.push(std::mem::replace(&mut indices, copy));
            ip = p as *const c_void;
        }
        let vp = if null.1 || null_both {
            ptr::null()
        } else {
            addr(&values) as *const c_void
        };
        let mut errs = Vec::new();
        if name.is_empty() || (rows > 0 && (ip.is_null() || vp.is_null())) || replica >= self.n {
            errs.push(INVALID_ARGUMENT);
        }
        match s {
            None => errs.push(NOT_FOUND),
            Some(_) if replica < self.n && spec.is_none() => errs.push(INCONSISTENT),
            Some(_) => {}
        }
        let want = self.unchanged_unless(errs);
        let c = cstr(name);
        let what = format!(
            "sparse_set('{name}', replica {replica}, indices {}{:?}, {rows} rows{}{})",
            if ip.is_null() || addr(&indices) == ip as usize {
                ""
            } else {
                "shared "
            },
            &indices_list(&indices)[..rows.min(indices.len())],
            if ip.is_null() { ", NULL indices" } else { "" },
            if vp.is_null() { ", NULL values" } else { "" },
        );
        // SAFETY: the buffers stay alive (model or graveyard) until the step consumes them.
        let st = self.call(what, want, |ctx| unsafe {
            dpsync_sparse_set(ctx, c.as_ptr(), replica, ip, vp, rows)
        });
        if st == OK {
            let slot = &mut self.sparse[s.expect("found")].slices[replica];
            if let Some(old) = slot.replace(SliceM {
                indices,
                values,
                rows,
                indices_ptr: ip as usize,
            }) {
                self.graveyard.push(old.indices);
                self.graveyard.push(old.values);
            }
        } else {
            self.graveyard.push(indices);
            self.graveyard.push(values);
        }
        st == OK
    }

    /// Every sparse gradient's slice on every replica (sometimes one left out), or one random set.
    #[allow(clippy::needless_range_loop)] // `first[r]` is read and written per replica
    pub(crate) fn op_sparse_set_all(&mut self) {
        if self.sparse.is_empty() || self.chance(0.2) {
            let name = self.pick_name();
            let replica = self.pick_replica();
            let rows = self.g.below(5) as usize;
            let null = (self.chance(0.1), self.chance(0.1));
            self.sparse_set_call(&name, replica, rows, null, None);
            return;
        }
        // The first gradient's indices per replica: (pointer, copy), for later ones to share
        // (several value tensors of one embedding lookup).
        let mut first: Vec<Option<(usize, Buf)>> = vec![None; self.n];
        let names: Vec<String> = self.sparse.iter().map(|s| s.name.clone()).collect();
        for (k, name) in names.iter().enumerate() {
            let share = k > 0 && self.chance(0.4);
            for r in 0..self.n {
                if self.chance(0.04) {
                    continue;
                }
                let spec = self.sparse[self.find_sparse(name).expect("registered")].specs[r];
                let shared = match (first[r].as_ref(), spec) {
                    (Some((p, copy)), Some(spec)) if share && copy.dtype() == spec.indices => {
                        Some((*p, copy.clone()))
                    }
                    _ => None,
                };
                let rows = match &shared {
                    // the same rows, sometimes fewer (then gathered separately)
                    Some((_, copy)) if self.chance(0.85) => copy.len(),
                    Some((_, copy)) => self.g.below(copy.len() as u64 + 1) as usize,
                    None => self.g.below(6) as usize,
                };
                if self.sparse_set_call(name, r, rows, (false, false), shared) && k == 0 {
                    let s = &self.sparse[self.find_sparse(name).expect("registered")];
                    let sl = s.slices[r].as_ref().expect("just set");
                    if sl.indices_ptr != 0 {
                        first[r] = Some((sl.indices_ptr, sl.indices.clone()));
                    }
                }
            }
        }
    }

    /// What `dpsync_allreduce_grads` will find wrong with the sparse gradients (INCONSISTENT).
    pub(crate) fn sparse_step_fails(&self) -> bool {
        self.sparse.iter().any(|s| {
            let Some(spec) = s.spec() else {
                return true;
            };
            s.slices.iter().any(|sl| match sl {
                None => true,
                Some(sl) => {
                    spec.num_embeddings > 0
                        && (0..sl.rows).any(|k| {
                            let i = index_at(&sl.indices, k);
                            i < 0 || i >= spec.num_embeddings as i64
                        })
                }
            })
        })
    }

    /// The gathered slice of sparse gradient `s` after a successful step with `op`.
    pub(crate) fn gather(&self, s: usize, op: u32) -> Gathered {
        let entry = &self.sparse[s];
        let spec = entry.spec().expect("checked");
        let slices: Vec<&SliceM> = entry.slices.iter().map(|s| s.as_ref().unwrap()).collect();
        let (indices, values): (Vec<i64>, Vec<f64>) = if self.coalesce {
            let mut sums: BTreeMap<i64, Vec<f64>> = BTreeMap::new();
            for sl in &slices {
                for k in 0..sl.rows {
                    let row = sums
                        .entry(index_at(&sl.indices, k))
                        .or_insert_with(|| vec![0.0; spec.row_len]);
                    for (j, x) in row.iter_mut().enumerate() {
                        *x += value_at(&sl.values, k * spec.row_len + j);
                    }
                }
            }
            (
                sums.keys().copied().collect(),
                sums.into_values().flatten().collect(),
            )
        } else {
            let mut indices = Vec::new();
            let mut values = Vec::new();
            for sl in &slices {
                indices.extend((0..sl.rows).map(|k| index_at(&sl.indices, k)));
                values.extend((0..sl.values.len()).map(|i| value_at(&sl.values, i)));
            }
            (indices, values)
        };
        let mut values = buf_of(spec.values, &values);
        if op == AVG {
            values = divide_each(&values, self.n);
        }
        Gathered {
            rows: indices.len(),
            indices,
            values,
            share_key: slices.iter().map(|s| (s.indices_ptr, s.rows)).collect(),
        }
    }

    /// `dpsync_sparse_get`, checked; the indices pointer on success.
    pub(crate) fn sparse_get_call(
        &mut self,
        name: &str,
        replica: usize,
        null_out: bool,
    ) -> Option<usize> {
        let s = self.find_sparse(name);
        let mut errs = Vec::new();
        if name.is_empty() {
            errs.extend([INVALID_ARGUMENT, NOT_FOUND]);
        }
        if replica >= self.n || null_out {
            errs.push(INVALID_ARGUMENT);
        }
        match s {
            None => errs.push(NOT_FOUND),
            Some(s) if self.sparse[s].gathered.is_none() => errs.push(INVALID_STATE),
            Some(_) => {}
        }
        let want = self.unchanged_unless(errs);
        let c = cstr(name);
        let (mut ip, mut vp, mut rows) = (ptr::null::<c_void>(), ptr::null::<c_void>(), 0usize);
        let outs = if null_out {
            (ptr::null_mut(), ptr::null_mut(), ptr::null_mut())
        } else {
            (&mut ip as *mut _, &mut vp as *mut _, &mut rows as *mut _)
        };
        // SAFETY: valid handle, name and out pointers (or NULL, refused).
        let st = self.call(
            format!("sparse_get('{name}', {replica})"),
            want,
            |ctx| unsafe { dpsync_sparse_get(ctx, c.as_ptr(), replica, outs.0, outs.1, outs.2) },
        );
        if st != OK {
            return None;
        }
        let entry = &self.sparse[s.expect("found")];
        let spec = entry.spec().expect("gathered");
        let want = entry.gathered.as_ref().expect("gathered");
        if rows != want.rows {
            self.fail(format!(
                "sparse_get('{name}', {replica}): {rows} rows, the model predicts {} (indices {:?})",
                want.rows, want.indices
            ));
        }
        if rows == 0 {
            if !ip.is_null() || !vp.is_null() {
                self.fail(format!(
                    "sparse_get('{name}', {replica}): 0 rows but non-NULL outputs"
                ));
            }
            return Some(0);
        }
        // SAFETY: the library keeps `rows` indices and rows x row_len values there.
        let (got_i, got_v) = unsafe {
            (
                read_buf(spec.indices, ip, rows),
                read_buf(spec.values, vp, rows * spec.row_len),
            )
        };
        let got_i: Vec<i64> = (0..rows).map(|k| index_at(&got_i, k)).collect();
        if got_i != want.indices {
            self.fail(format!(
                "sparse_get('{name}', {replica}): indices {got_i:?}, the model predicts {:?}",
                want.indices
            ));
        }
        if let Some(i) = first_difference(&got_v, &want.values) {
            self.fail(format!(
                "sparse_get('{name}', {replica}): value {i} (row {}) is {}, the model predicts {}",
                i / spec.row_len,
                elem_str(&got_v, i),
                elem_str(&want.values, i)
            ));
        }
        Some(ip as usize)
    }

    pub(crate) fn op_sparse_get(&mut self) {
        let name = if !self.sparse.is_empty() && self.chance(0.8) {
            let i = self.g.below(self.sparse.len() as u64) as usize;
            self.sparse[i].name.clone()
        } else {
            self.pick_name()
        };
        let replica = self.pick_replica();
        let null_out = self.chance(0.03);
        self.sparse_get_call(&name, replica, null_out);
    }
}
