//! Sparse gradients by name and replica: what each replica registered (row length, dtypes,
//! range bound) and the slice it set for the coming step. Like the dense registry it accepts
//! registrations one replica at a time, refuses only a contradiction on the same replica
//! (CONFLICT), and reports disagreement between replicas when a collective needs the gradient
//! ([`SparseRegistry::step`], INCONSISTENT naming it and the replica). It never reads the memory
//! a slice points to: index ranges are checked by the executor through the backend.

use std::collections::HashMap;

use crate::error::{Error, ErrorKind, Result};
use crate::types::DType;

/// One replica's registration of a sparse gradient.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseSpec {
    /// Values per row (> 0).
    pub row_len: usize,
    /// F32, F64, F16 or BF16.
    pub value_dtype: DType,
    /// I32 or I64.
    pub index_dtype: DType,
    /// > 0: every index must be in `[0, num_embeddings)`; 0: indices are not checked.
    pub num_embeddings: usize,
}

impl SparseSpec {
    /// A value dtype code (`DPSYNC_DTYPE_F32/F64/F16/BF16`), or `None`.
    pub fn value_dtype_from_code(code: u32) -> Option<DType> {
        DType::from_code(code)
            .filter(|d| matches!(d, DType::F32 | DType::F64 | DType::F16 | DType::Bf16))
    }

    /// An index dtype code (`DPSYNC_DTYPE_I32/I64`), or `None`.
    pub fn index_dtype_from_code(code: u32) -> Option<DType> {
        DType::from_code(code).filter(|d| matches!(d, DType::I32 | DType::I64))
    }

    /// Bytes of one row of values.
    pub fn row_bytes(&self) -> usize {
        self.row_len * self.value_dtype.size()
    }

    fn describe(&self) -> String {
        format!(
            "row_len {}, values {}, indices {}, num_embeddings {}",
            self.row_len, self.value_dtype, self.index_dtype, self.num_embeddings
        )
    }
}

/// One replica's slice for the coming step (caller-owned memory, addresses kept as integers).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct SparseSlice {
    /// `rows` indices; 0 (NULL) allowed when `rows` is 0.
    pub indices: usize,
    /// `rows × row_len` values; 0 (NULL) allowed when `rows` is 0.
    pub values: usize,
    pub rows: usize,
}

/// The slices a successful step consumed, by name ([`SparseRegistry::consume_slices`]).
#[derive(Debug, Default)]
pub struct ConsumedSlices(Vec<(String, Vec<Option<SparseSlice>>)>);

#[derive(Clone, Debug)]
struct Entry {
    name: String,
    specs: Vec<Option<SparseSpec>>,
    /// Slices set since the last successful `dpsync_allreduce_grads`.
    slices: Vec<Option<SparseSlice>>,
}

/// A sparse gradient registered consistently on every replica, with the slice of every replica
/// for this step.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SparseInput {
    pub name: String,
    pub spec: SparseSpec,
    /// One per replica, in replica order.
    pub slices: Vec<SparseSlice>,
}

/// Sparse gradients by name, in order of each name's first registration.
#[derive(Debug)]
pub struct SparseRegistry {
    replicas: usize,
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
}

fn not_found(name: &str) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("sparse gradient '{name}' is not registered"),
    )
}

impl SparseRegistry {
    pub fn new(replicas: usize) -> SparseRegistry {
        SparseRegistry {
            replicas,
            entries: Vec::new(),
            index: HashMap::new(),
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    fn check_replica(&self, replica: usize) -> Result<()> {
        super::check_replica(replica, self.replicas, "replica")
    }

    /// Identical re-registration is a no-op; another spec on the same replica is CONFLICT.
    pub fn register(&mut self, name: &str, replica: usize, spec: SparseSpec) -> Result<()> {
        self.check_replica(replica)?;
        if spec.row_len == 0 {
            return Err(Error::invalid(format!(
                "row_len is 0 (sparse gradient '{name}', replica {replica})"
            )));
        }
        if spec.row_len.checked_mul(spec.value_dtype.size()).is_none() {
            return Err(Error::invalid(format!(
                "row_len {} is too large (sparse gradient '{name}', replica {replica})",
                spec.row_len
            )));
        }
        let Some(&i) = self.index.get(name) else {
            let mut specs = vec![None; self.replicas];
            specs[replica] = Some(spec);
            self.index.insert(name.to_owned(), self.entries.len());
            self.entries.push(Entry {
                name: name.to_owned(),
                specs,
                slices: vec![None; self.replicas],
            });
            return Ok(());
        };
        let slot = &mut self.entries[i].specs[replica];
        match slot {
            Some(old) if *old == spec => Ok(()),
            Some(old) => Err(Error::new(
                ErrorKind::Conflict,
                format!(
                    "sparse gradient '{name}': replica {replica} already has it registered with {}; \
                     the new registration has {} (unregister it first to change it)",
                    old.describe(),
                    spec.describe()
                ),
            )),
            None => {
                *slot = Some(spec);
                Ok(())
            }
        }
    }

    /// Removes `name` (registrations and slices) from every replica; false if it is not here.
    pub fn unregister(&mut self, name: &str) -> bool {
        let Some(i) = self.index.remove(name) else {
            return false;
        };
        self.entries.remove(i);
        for pos in self.index.values_mut() {
            if *pos > i {
                *pos -= 1;
            }
        }
        true
    }

    /// The spec `name` has on `replica`: NOT_FOUND if no replica registered it, INCONSISTENT if
    /// only other replicas did.
    pub fn spec(&self, name: &str, replica: usize) -> Result<SparseSpec> {
        self.check_replica(replica)?;
        let entry = &self.entries[*self.index.get(name).ok_or_else(|| not_found(name))?];
        entry.specs[replica].ok_or_else(|| {
            let first = entry.specs.iter().position(Option::is_some).unwrap_or(0);
            Error::inconsistent(format!(
                "sparse gradient '{name}': not registered on replica {replica} \
                 (registered on replica {first})"
            ))
        })
    }

    /// Sets this step's slice of `name` on `replica` (a second call replaces the first).
    pub fn set(&mut self, name: &str, replica: usize, slice: SparseSlice) -> Result<()> {
        let spec = self.spec(name, replica)?;
        // Both buffers must be addressable: rows x index size and rows x row_len x value size
        // bytes, each at most isize::MAX (the index bytes can overflow when the values' do not).
        let rows = slice.rows;
        let fits = |bytes: Option<usize>| bytes.is_some_and(|b| b <= isize::MAX as usize);
        if !fits(rows.checked_mul(spec.index_dtype.size())) {
            return Err(Error::invalid(format!(
                "rows {rows} is too large: {rows} indices of {} exceed isize::MAX bytes \
                 (sparse gradient '{name}', replica {replica})",
                spec.index_dtype
            )));
        }
        let value_bytes = rows
            .checked_mul(spec.row_len)
            .and_then(|n| n.checked_mul(spec.value_dtype.size()));
        if !fits(value_bytes) {
            return Err(Error::invalid(format!(
                "rows {rows} is too large: rows {rows} x row_len {} of {} exceed isize::MAX bytes \
                 (sparse gradient '{name}', replica {replica})",
                spec.row_len, spec.value_dtype
            )));
        }
        let misaligned = |ptr: usize, dtype: DType| slice.rows > 0 && ptr % dtype.size() != 0;
        for (argument, ptr, dtype) in [
            ("indices", slice.indices, spec.index_dtype),
            ("values", slice.values, spec.value_dtype),
        ] {
            if misaligned(ptr, dtype) {
                return Err(Error::invalid(format!(
                    "{argument} ({ptr:#x}) is not aligned to the {} bytes of {dtype} \
                     (sparse gradient '{name}', replica {replica})",
                    dtype.size()
                )));
            }
        }
        let i = self.index[name];
        self.entries[i].slices[replica] = Some(slice);
        Ok(())
    }

    /// Every sparse gradient with its slices for this step, in registration order; INCONSISTENT
    /// (naming the gradient and the replica) when replicas disagree about a registration or a
    /// replica has not set its slice.
    pub fn step(&self) -> Result<Vec<SparseInput>> {
        let mut inputs = Vec::with_capacity(self.entries.len());
        for entry in &self.entries {
            let spec = check_specs(entry)?;
            let mut slices = Vec::with_capacity(self.replicas);
            for (replica, slice) in entry.slices.iter().enumerate() {
                let Some(slice) = slice else {
                    return Err(Error::inconsistent(format!(
                        "sparse gradient '{}': no slice set on replica {replica} for this step \
                         (every registered sparse gradient must be set with dpsync_sparse_set on \
                         every replica before each dpsync_allreduce_grads; rows may be 0)",
                        entry.name
                    )));
                };
                slices.push(*slice);
            }
            // The gathered slice must be addressable: checked here so the executor need not.
            let total = slices
                .iter()
                .try_fold(0usize, |acc, s| acc.checked_add(s.rows));
            let fits = total
                .and_then(|t| t.checked_mul(spec.row_bytes().max(spec.index_dtype.size())))
                .is_some_and(|b| b <= isize::MAX as usize);
            if !fits {
                return Err(Error::invalid(format!(
                    "sparse gradient '{}': the gathered slice of all replicas' rows is too large",
                    entry.name
                )));
            }
            inputs.push(SparseInput {
                name: entry.name.clone(),
                spec,
                slices,
            });
        }
        Ok(inputs)
    }

    /// Forgets every slice: a successful step consumed them.
    pub fn consume_slices(&mut self) {
        for entry in &mut self.entries {
            entry.slices.iter_mut().for_each(|s| *s = None);
        }
    }

    /// As [`Self::consume_slices`], returning them by name for [`Self::restore_slices`] (an
    /// elastic world's undo).
    pub fn take_slices(&mut self) -> ConsumedSlices {
        let replicas = self.replicas;
        let taken = (self.entries.iter_mut())
            .map(|e| {
                (
                    e.name.clone(),
                    std::mem::replace(&mut e.slices, vec![None; replicas]),
                )
            })
            .collect();
        ConsumedSlices(taken)
    }

    /// Sets again the slices a step consumed (it answered RANK_LOST: no slice is consumed by a
    /// step that did not complete); names unregistered since are skipped.
    pub fn restore_slices(&mut self, consumed: ConsumedSlices) {
        for (name, slices) in consumed.0 {
            if let Some(e) = self.entries.iter_mut().find(|e| e.name == name) {
                e.slices = slices;
            }
        }
    }

    /// Every name with its spec when the replicas agree, or the error a step would return.
    pub fn checked(&self) -> impl Iterator<Item = (&str, Result<SparseSpec>)> {
        self.entries
            .iter()
            .map(|e| (e.name.as_str(), check_specs(e)))
    }
}

/// The replicas of one name must have registered the same spec.
fn check_specs(entry: &Entry) -> Result<SparseSpec> {
    let name = &entry.name;
    let (first, reference) = entry
        .specs
        .iter()
        .enumerate()
        .find_map(|(i, s)| s.map(|s| (i, s)))
        .expect("an entry holds at least one registration");
    for (replica, spec) in entry.specs.iter().enumerate() {
        let Some(spec) = spec else {
            return Err(Error::inconsistent(format!(
                "sparse gradient '{name}': not registered on replica {replica} \
                 (registered on replica {first})"
            )));
        };
        let differs = |what: &str, a: String, b: String| {
            Err(Error::inconsistent(format!(
                "sparse gradient '{name}': replica {replica} has {what} {a}, replica {first} has {b}"
            )))
        };
        if spec.row_len != reference.row_len {
            return differs(
                "row_len",
                spec.row_len.to_string(),
                reference.row_len.to_string(),
            );
        }
        if spec.value_dtype != reference.value_dtype {
            return differs(
                "value dtype",
                spec.value_dtype.to_string(),
                reference.value_dtype.to_string(),
            );
        }
        if spec.index_dtype != reference.index_dtype {
            return differs(
                "index dtype",
                spec.index_dtype.to_string(),
                reference.index_dtype.to_string(),
            );
        }
        if spec.num_embeddings != reference.num_embeddings {
            return differs(
                "num_embeddings",
                spec.num_embeddings.to_string(),
                reference.num_embeddings.to_string(),
            );
        }
    }
    Ok(reference)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn spec(row_len: usize) -> SparseSpec {
        SparseSpec {
            row_len,
            value_dtype: DType::F32,
            index_dtype: DType::I64,
            num_embeddings: 100,
        }
    }

    fn slice(rows: usize) -> SparseSlice {
        SparseSlice {
            indices: 0x1000,
            values: 0x2000,
            rows,
        }
    }

    #[test]
    fn identical_registration_is_a_noop_and_a_difference_conflicts() {
        let mut r = SparseRegistry::new(2);
        r.register("emb", 0, spec(4)).unwrap();
        r.register("emb", 0, spec(4)).unwrap();
        let err = r.register("emb", 0, spec(8)).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Conflict);
        assert!(err.message.contains("'emb'") && err.message.contains("replica 0"));
        assert_eq!(
            r.register("emb", 2, spec(4)).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert_eq!(
            r.register("x", 0, spec(0)).unwrap_err().kind,
            ErrorKind::InvalidArgument
        );
        assert!(
            !r.contains("x"),
            "a refused registration leaves nothing behind"
        );
    }

    #[test]
    fn taken_slices_come_back_but_for_names_unregistered_since() {
        let mut r = SparseRegistry::new(2);
        for name in ["emb", "other"] {
            for replica in 0..2 {
                r.register(name, replica, spec(4)).unwrap();
                r.set(name, replica, slice(replica + 1)).unwrap();
            }
        }
        let before = r.step().unwrap();
        let taken = r.take_slices();
        assert!(r.step().is_err(), "taken slices are consumed");
        assert!(r.unregister("other"));
        r.restore_slices(taken);
        let after = r.step().unwrap();
        assert_eq!(after.len(), 1);
        assert_eq!(after[0], before[0], "emb's slices set again");
    }

    #[test]
    fn step_names_the_gradient_and_replica_that_disagree_or_did_not_set() {
        let mut r = SparseRegistry::new(3);
        for replica in 0..3 {
            r.register("emb", replica, spec(4)).unwrap();
        }
        assert_eq!(
            r.set("nope", 0, slice(1)).unwrap_err().kind,
            ErrorKind::NotFound
        );
        r.set("emb", 0, slice(2)).unwrap();
        r.set("emb", 2, slice(0)).unwrap();
        let err = r.step().unwrap_err();
        assert_eq!(err.kind, ErrorKind::Inconsistent);
        assert!(
            err.message.contains("'emb'") && err.message.contains("replica 1"),
            "{}",
            err.message
        );
        r.set("emb", 1, slice(5)).unwrap();
        let inputs = r.step().unwrap();
        assert_eq!(
            inputs[0].slices.iter().map(|s| s.rows).collect::<Vec<_>>(),
            [2, 5, 0]
        );
        r.consume_slices();
        assert!(r.step().is_err(), "slices are consumed by a step");

        r.register("other", 0, spec(4)).unwrap();
        r.register("other", 2, spec(5)).unwrap();
        let err = r.set("other", 1, slice(1)).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Inconsistent);
        assert!(
            err.message.contains("not registered on replica 1"),
            "{}",
            err.message
        );
        r.register("other", 1, spec(4)).unwrap();
        let problems: Vec<_> = r.checked().filter_map(|(_, s)| s.err()).collect();
        assert_eq!(
            problems[0].message,
            "sparse gradient 'other': replica 2 has row_len 5, replica 0 has 4"
        );
    }

    #[test]
    fn set_refuses_misaligned_and_oversized_slices() {
        let mut r = SparseRegistry::new(1);
        r.register("emb", 0, spec(4)).unwrap();
        let bad = SparseSlice {
            indices: 0x1004,
            ..slice(1)
        };
        let err = r.set("emb", 0, bad).unwrap_err();
        assert!(
            err.message.starts_with("indices (0x1004) is not aligned"),
            "{}",
            err.message
        );
        let err = r.set("emb", 0, slice(usize::MAX / 4)).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        // One f32 per row: 2^60 rows are 2^62 bytes of values but 2^63 bytes of i64 indices,
        // one byte over isize::MAX; one row fewer fits.
        r.register("one", 0, spec(1)).unwrap();
        let err = r.set("one", 0, slice(1 << 60)).unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(
            err.message
                .starts_with("rows 1152921504606846976 is too large: ")
                && err.message.contains("indices of i64")
                && err.message.ends_with("(sparse gradient 'one', replica 0)"),
            "{}",
            err.message
        );
        r.set("one", 0, slice((1 << 60) - 1)).unwrap();
        // Overflowing index bytes (2^64), and values over isize::MAX without overflowing.
        assert!(r.set("one", 0, slice(1 << 61)).is_err());
        r.register("wide", 0, spec(1 << 20)).unwrap();
        let err = r.set("wide", 0, slice(1 << 41)).unwrap_err();
        assert!(
            err.message.contains("x row_len 1048576 of f32"),
            "{}",
            err.message
        );
        // No rows: no pointer is read, so NULL or odd addresses are fine.
        r.set(
            "emb",
            0,
            SparseSlice {
                indices: 0,
                values: 3,
                rows: 0,
            },
        )
        .unwrap();
    }

    #[test]
    fn unregister_keeps_the_others() {
        let mut r = SparseRegistry::new(1);
        r.register("a", 0, spec(1)).unwrap();
        r.register("b", 0, spec(2)).unwrap();
        assert!(r.unregister("a"));
        assert!(!r.unregister("a"));
        r.set("b", 0, slice(1)).unwrap();
        assert_eq!(r.step().unwrap()[0].name, "b");
    }
}
