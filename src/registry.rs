//! The registry: tensors by name and replica. It accepts registrations one replica at a time
//! (frameworks register replica by replica), refuses only what contradicts an earlier
//! registration on the same replica, and reports disagreements between replicas through a
//! [`Snapshot`], so that the first collective touching a tensor can name it.

pub mod sparse;

use std::collections::HashMap;

use crate::error::{Error, ErrorKind, Result};
use crate::types::{DType, Memory, Role, RoleMask};

/// One replica's registration of a name: caller-owned memory.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Registration {
    pub role: Role,
    /// Address of the first element (kept as an integer: the registry never dereferences it).
    pub ptr: usize,
    pub count: usize,
    pub dtype: DType,
    /// Host or device memory (always host on host replicas).
    pub memory: Memory,
}

impl Registration {
    fn describe(&self) -> String {
        format!(
            "role {}, {} elements of {} at {:#x} ({} memory)",
            self.role,
            self.count,
            self.dtype,
            self.ptr,
            self.memory.name()
        )
    }
}

#[derive(Clone, Debug)]
struct Entry {
    name: String,
    per_replica: Vec<Option<Registration>>,
}

/// Tensors by name, in order of each name's first registration.
#[derive(Debug)]
pub struct Registry {
    replicas: usize,
    entries: Vec<Entry>,
    index: HashMap<String, usize>,
    generation: u64,
}

/// The one range check of a replica index (`argument` names it in the message).
pub(crate) fn check_replica(replica: usize, replicas: usize, argument: &str) -> Result<()> {
    if replica >= replicas {
        // -1 passed as size_t arrives near SIZE_MAX.
        let negative = if replica > usize::MAX / 2 {
            " (a negative index passed as size_t?)"
        } else {
            ""
        };
        return Err(Error::invalid(format!(
            "{argument} {replica} is out of range{negative}: the context has {replicas} replicas"
        )));
    }
    Ok(())
}

impl Registry {
    pub fn new(replicas: usize) -> Registry {
        Registry {
            replicas,
            entries: Vec::new(),
            index: HashMap::new(),
            generation: 0,
        }
    }

    /// Changes whenever the set of registrations changes; plans are cached against it.
    pub fn generation(&self) -> u64 {
        self.generation
    }

    /// What `replica` registered as `name`, if anything.
    pub fn registered_as(&self, name: &str, replica: usize) -> Option<&Registration> {
        let &i = self.index.get(name)?;
        self.entries[i].per_replica.get(replica)?.as_ref()
    }

    /// Whether any replica registered `name`.
    pub fn contains(&self, name: &str) -> bool {
        self.index.contains_key(name)
    }

    pub fn register(&mut self, name: &str, replica: usize, reg: Registration) -> Result<()> {
        check_replica(replica, self.replicas, "replica")?;
        // Every later byte count and slice is `count * size` from `ptr`: it must not wrap.
        let fits = (reg.count.checked_mul(reg.dtype.size()))
            .filter(|&bytes| bytes <= isize::MAX as usize && reg.ptr.checked_add(bytes).is_some());
        if fits.is_none() {
            return Err(Error::invalid(format!(
                "count {} is too large: that many {}-byte elements from {:#x} exceed the address \
                 space (tensor '{name}', replica {replica})",
                reg.count,
                reg.dtype.size(),
                reg.ptr
            )));
        }
        // Backends load elements through typed pointers: on a GPU a misaligned one is a fault
        // that kills the CUDA context, on the host undefined behaviour.
        if reg.ptr % reg.dtype.size() != 0 {
            return Err(Error::invalid(format!(
                "data ({:#x}) is not aligned to the {} bytes of {} (tensor '{name}', replica \
                 {replica})",
                reg.ptr,
                reg.dtype.size(),
                reg.dtype
            )));
        }
        if let Some(&i) = self.index.get(name) {
            let slot = &mut self.entries[i].per_replica[replica];
            match slot {
                Some(old) if *old == reg => return Ok(()),
                Some(old) => {
                    return Err(Error::new(
                        ErrorKind::Conflict,
                        format!(
                            "tensor '{name}': replica {replica} already has it registered with {}; \
                             the new registration has {} (unregister it first to change it)",
                            old.describe(),
                            reg.describe()
                        ),
                    ))
                }
                None => *slot = Some(reg),
            }
        } else {
            let mut per_replica = vec![None; self.replicas];
            per_replica[replica] = Some(reg);
            self.index.insert(name.to_owned(), self.entries.len());
            self.entries.push(Entry {
                name: name.to_owned(),
                per_replica,
            });
        }
        self.generation += 1;
        Ok(())
    }

    /// Removes `name` from every replica.
    pub fn unregister(&mut self, name: &str) -> Result<()> {
        let Some(i) = self.index.remove(name) else {
            return Err(not_found(name));
        };
        self.entries.remove(i);
        for pos in self.index.values_mut() {
            if *pos > i {
                *pos -= 1;
            }
        }
        self.generation += 1;
        Ok(())
    }

    /// Checks every name across replicas. Consistent tensors become [`TensorView`]s; the others
    /// are kept as the error a collective touching them must return.
    pub fn snapshot(&self) -> Snapshot {
        let mut snapshot = Snapshot {
            generation: self.generation,
            tensors: Vec::new(),
            problems: Vec::new(),
            index: HashMap::with_capacity(self.entries.len()),
            shared_memory: Vec::new(),
        };
        for entry in &self.entries {
            let lookup = match check_entry(entry) {
                Ok(view) => {
                    snapshot.tensors.push(view);
                    Ok(snapshot.tensors.len() - 1)
                }
                Err(err) => {
                    let roles = entry.per_replica.iter().flatten().map(|r| r.role.bit());
                    let bits = roles.fold(0, |acc, bit| acc | bit);
                    snapshot.problems.push((bits, err));
                    Err(snapshot.problems.len() - 1)
                }
            };
            snapshot.index.insert(entry.name.clone(), lookup);
        }
        snapshot.shared_memory = shared_memory(&snapshot.tensors);
        snapshot
    }
}

/// Memory shared by two tensors where a collective touching both would be wrong, as
/// `(role bits of the two, error)`, the first pair found per combination of roles:
/// - two GRADs, on any replicas: `allreduce_grads` would reduce those bytes twice;
/// - any two tensors on different replicas: replicas are separate copies, so writing one
///   replica's tensor (a broadcast from another root, an average) would change the other's.
///
/// Tensors of other roles may alias on one replica (a flat parameter buffer and views into it):
/// broadcasting or averaging those bytes twice leaves the replicas identical (a second average
/// may round the mean once more). One tensor's replicas are checked by `check_entry`.
fn shared_memory(tensors: &[TensorView]) -> Vec<(u32, Error)> {
    let mut spans: Vec<(usize, usize, usize, usize)> = Vec::new();
    for (t, view) in tensors.iter().enumerate() {
        let bytes = view.count * view.dtype.size();
        spans.extend(
            view.ptrs
                .iter()
                .enumerate()
                .map(|(r, &p)| (p, p.saturating_add(bytes), t, r)),
        );
    }
    spans.sort_unstable();
    let mut found: Vec<(u32, Error)> = Vec::new();
    // Spans that reach past the current start: only they can overlap it (views of one flat
    // buffer keep this short).
    let mut open: Vec<(usize, usize, usize)> = Vec::new();
    for &(start, end, t, r) in &spans {
        open.retain(|&(far, _, _)| far > start);
        for &(_, ot, or) in &open {
            let (a, b) = (&tensors[t], &tensors[ot]);
            let bits = a.role.bit() | b.role.bit();
            let grads = a.role == Role::Grad && b.role == Role::Grad;
            if ot == t || (!grads && or == r) || found.iter().any(|(k, _)| *k == bits) {
                continue;
            }
            let (first, second) = ((&b.name, or), (&a.name, r));
            let message = if grads {
                format!(
                    "GRAD tensors '{}' (replica {}) and '{}' (replica {}) share memory: \
                     dpsync_allreduce_grads would reduce it twice",
                    first.0, first.1, second.0, second.1
                )
            } else {
                format!(
                    "tensors '{}' (replica {}) and '{}' (replica {}) share memory, but replicas \
                     must be separate copies: a collective writing one would change the other",
                    first.0, first.1, second.0, second.1
                )
            };
            found.push((bits, Error::inconsistent(message)));
        }
        open.push((end, t, r));
    }
    found
}

fn not_found(name: &str) -> Error {
    Error::new(
        ErrorKind::NotFound,
        format!("tensor '{name}' is not registered"),
    )
}

/// The replicas of one name must agree on role, dtype and count, and their memory must not
/// overlap (the reduction writes every replica).
fn check_entry(entry: &Entry) -> Result<TensorView> {
    let name = &entry.name;
    let (first, reference) = entry
        .per_replica
        .iter()
        .enumerate()
        .find_map(|(i, r)| r.map(|r| (i, r)))
        .expect("an entry holds at least one registration");
    let mut ptrs = Vec::with_capacity(entry.per_replica.len());
    for (replica, reg) in entry.per_replica.iter().enumerate() {
        let Some(reg) = reg else {
            return Err(Error::inconsistent(format!(
                "tensor '{name}': not registered on replica {replica} (registered on replica {first})"
            )));
        };
        if reg.role != reference.role {
            return Err(Error::inconsistent(format!(
                "tensor '{name}': replica {replica} registered it as {}, replica {first} as {}",
                reg.role, reference.role
            )));
        }
        if reg.dtype != reference.dtype {
            return Err(Error::inconsistent(format!(
                "tensor '{name}': replica {replica} has dtype {}, replica {first} has {}",
                reg.dtype, reference.dtype
            )));
        }
        if reg.count != reference.count {
            return Err(Error::inconsistent(format!(
                "tensor '{name}': replica {replica} has {} elements, replica {first} has {}",
                reg.count, reference.count
            )));
        }
        if reg.memory != reference.memory {
            return Err(Error::inconsistent(format!(
                "tensor '{name}': replica {replica} has it in {} memory, replica {first} in {} memory",
                reg.memory.name(),
                reference.memory.name()
            )));
        }
        ptrs.push(reg.ptr);
    }
    let bytes = reference.count * reference.dtype.size();
    let mut spans: Vec<(usize, usize)> = ptrs.iter().copied().zip(0..).collect();
    spans.sort_unstable();
    for pair in spans.windows(2) {
        let ((lo, a), (hi, b)) = (pair[0], pair[1]);
        if hi < lo.saturating_add(bytes) {
            let (a, b) = (a.min(b), a.max(b));
            // Distinct addresses closer than the tensor's size usually mean a dtype wider than
            // the caller's elements (F64 over a float buffer): name it.
            let dtype = reference.dtype;
            let why = if hi > lo {
                format!(
                    ": {} elements of {dtype} take {bytes} bytes, but the two replicas' \
                     addresses are {} bytes apart (is {dtype}, {} bytes per element, the \
                     buffers' dtype?)",
                    reference.count,
                    hi - lo,
                    dtype.size()
                )
            } else {
                String::from(": both registered the same address")
            };
            return Err(Error::inconsistent(format!(
                "tensor '{name}': the memory of replica {b} overlaps the memory of replica {a}{why}"
            )));
        }
    }
    // The memory kind too: it splits buckets, and the ranks' buckets must match.
    let memory = match reference.memory {
        Memory::Host => "",
        Memory::Device => " (device)",
    };
    Ok(TensorView {
        name: name.clone(),
        role: reference.role,
        dtype: reference.dtype,
        count: reference.count,
        memory: reference.memory,
        ptrs,
        line: format!(
            "{name}\t{} {} x {}{memory}",
            reference.role, reference.count, reference.dtype
        ),
    })
}

/// A tensor registered consistently on every replica.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TensorView {
    pub name: String,
    pub role: Role,
    pub dtype: DType,
    pub count: usize,
    pub memory: Memory,
    /// One address per replica, in replica order.
    pub ptrs: Vec<usize>,
    /// The registration as the ranks of a world compare it before a collective
    /// (`name\trole count x dtype`), made once per registry generation.
    pub line: String,
}

/// The registry checked at one generation: what collectives may touch, and what they must refuse.
#[derive(Debug)]
pub struct Snapshot {
    pub generation: u64,
    /// Consistent tensors in registration order.
    pub tensors: Vec<TensorView>,
    /// Inconsistent names: the roles they were registered with (a bit mask) and the error.
    problems: Vec<(u32, Error)>,
    index: HashMap<String, Result<usize, usize>>,
    /// Tensors sharing memory that collectives over both roles must refuse ([`shared_memory`]).
    shared_memory: Vec<(u32, Error)>,
}

impl Snapshot {
    /// The tensor `name`, or NOT_FOUND / the INCONSISTENT error naming it.
    pub fn lookup(&self, name: &str) -> Result<&TensorView> {
        Ok(&self.tensors[self.position(name)?])
    }

    /// The index in `tensors` of `name`, with the errors of [`Snapshot::lookup`].
    pub fn position(&self, name: &str) -> Result<usize> {
        match self.index.get(name) {
            None => Err(not_found(name)),
            Some(Ok(i)) => Ok(*i),
            Some(Err(p)) => Err(self.problems[*p].1.clone()),
        }
    }

    /// Every tensor whose role is in `mask`, in registration order; fails if any name registered
    /// with such a role on some replica is inconsistent (a collective touching it would be wrong).
    pub fn select(&self, mask: RoleMask) -> Result<Vec<&TensorView>> {
        self.consistent(mask)?;
        Ok(self
            .tensors
            .iter()
            .filter(|t| mask.contains(t.role))
            .collect())
    }

    /// Fails if any name registered with a role in `mask` on some replica is inconsistent, or
    /// two tensors with roles in `mask` share memory where they must not ([`shared_memory`]).
    fn consistent(&self, mask: RoleMask) -> Result<()> {
        let mask = mask.bits();
        let problem = self.problems.iter().find(|(bits, _)| bits & mask != 0);
        // A pair sharing memory matters when the collective touches both of its roles.
        let shared = (self.shared_memory.iter()).find(|(bits, _)| bits & !mask == 0);
        match problem.or(shared) {
            Some((_, err)) => Err(err.clone()),
            None => Ok(()),
        }
    }

    /// What `allreduce_grads` may reduce: every GRAD consistent, and no two sharing memory.
    /// Cheap (no per-tensor work): `dpsync_grad_ready` asks it on every call.
    pub fn grads_to_reduce(&self) -> Result<()> {
        self.consistent(Role::Grad.into())
    }

    /// Everything collectives will refuse: inconsistent names, then shared memory.
    pub fn problems(&self) -> impl Iterator<Item = &Error> {
        (self.problems.iter().chain(&self.shared_memory)).map(|(_, e)| e)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn reg(role: Role, ptr: usize, count: usize) -> Registration {
        Registration {
            role,
            ptr,
            count,
            dtype: DType::F32,
            memory: Memory::Host,
        }
    }

    #[test]
    fn identical_registration_is_a_noop_and_a_difference_conflicts() {
        let mut r = Registry::new(2);
        r.register("w", 0, reg(Role::Param, 0x1000, 10)).unwrap();
        let g = r.generation();
        r.register("w", 0, reg(Role::Param, 0x1000, 10)).unwrap();
        assert_eq!(r.generation(), g, "a no-op must not invalidate plans");
        let err = r
            .register("w", 0, reg(Role::Param, 0x2000, 10))
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::Conflict);
        assert!(err.message.contains("'w'") && err.message.contains("replica 0"));
        let err = r
            .register("w", 2, reg(Role::Param, 0x2000, 10))
            .unwrap_err();
        assert_eq!(err.kind, ErrorKind::InvalidArgument);
        assert!(err.message.contains("replica 2"));
    }

    #[test]
    fn snapshot_names_the_inconsistent_tensor_and_replica() {
        let mut r = Registry::new(3);
        for i in 0..3 {
            r.register("ok", i, reg(Role::Grad, 0x1000 * (i + 1), 4))
                .unwrap();
        }
        r.register("fc_w", 0, reg(Role::Param, 0x10000, 10))
            .unwrap();
        r.register("fc_w", 1, reg(Role::Param, 0x20000, 11))
            .unwrap();
        r.register("fc_w", 2, reg(Role::Param, 0x30000, 10))
            .unwrap();
        r.register("half", 1, reg(Role::State, 0x40000, 1)).unwrap();
        let s = r.snapshot();
        assert_eq!(s.lookup("ok").unwrap().ptrs, vec![0x1000, 0x2000, 0x3000]);
        let err = s.lookup("fc_w").unwrap_err();
        assert_eq!(err.kind, ErrorKind::Inconsistent);
        assert_eq!(
            err.message,
            "tensor 'fc_w': replica 1 has 11 elements, replica 0 has 10"
        );
        let err = s.lookup("half").unwrap_err();
        assert!(err.message.contains("not registered on replica 0"));
        assert_eq!(s.lookup("nope").unwrap_err().kind, ErrorKind::NotFound);
        // Only the roles a collective touches are checked.
        assert_eq!(s.select(Role::Grad.into()).unwrap().len(), 1);
        assert!(s.select(Role::Param.into()).is_err());
        assert!(s.select(Role::State.into()).is_err());
        assert_eq!(s.problems().count(), 2);
    }

    #[test]
    fn overlapping_replica_memory_is_inconsistent() {
        let mut r = Registry::new(2);
        r.register("g", 0, reg(Role::Grad, 0x1000, 4)).unwrap();
        r.register("g", 1, reg(Role::Grad, 0x1008, 4)).unwrap();
        let err = r.snapshot().lookup("g").unwrap_err();
        assert!(err.message.contains("overlaps"), "{}", err.message);
        r.unregister("g").unwrap();
        r.register("g", 0, reg(Role::Grad, 0x1000, 4)).unwrap();
        r.register("g", 1, reg(Role::Grad, 0x1010, 4)).unwrap();
        assert!(r.snapshot().lookup("g").is_ok());
    }

    /// Two tensors on different replicas sharing memory are refused by collectives over both
    /// roles; on one replica only GRADs may not alias.
    #[test]
    fn shared_memory_across_replicas_is_refused_for_every_role() {
        let mut r = Registry::new(2);
        // p: A on replica 0, B on replica 1; q: C on replica 0, A on replica 1.
        r.register("p", 0, reg(Role::Param, 0x1000, 4)).unwrap();
        r.register("p", 1, reg(Role::Param, 0x2000, 4)).unwrap();
        r.register("q", 0, reg(Role::State, 0x3000, 4)).unwrap();
        r.register("q", 1, reg(Role::State, 0x1008, 4)).unwrap();
        let s = r.snapshot();
        let err = s.select(RoleMask::from_bits(0b1001).unwrap()).unwrap_err();
        assert_eq!(err.kind, ErrorKind::Inconsistent);
        for needle in ["'p' (replica 0)", "'q' (replica 1)", "separate copies"] {
            assert!(err.message.contains(needle), "{needle}: {}", err.message);
        }
        // A collective over one of the two roles writes only its own tensors' bytes correctly.
        assert!(s.select(Role::Param.into()).is_ok());
        assert!(s.grads_to_reduce().is_ok());
        assert_eq!(s.problems().count(), 1);
        // Views of one flat PARAM buffer on each replica are fine.
        let mut r = Registry::new(2);
        for (name, offset, count) in [("flat", 0, 8), ("w", 0, 4), ("b", 16, 4)] {
            r.register(name, 0, reg(Role::Param, 0x1000 + offset, count))
                .unwrap();
            r.register(name, 1, reg(Role::Param, 0x2000 + offset, count))
                .unwrap();
        }
        assert!(r.snapshot().select(Role::Param.into()).is_ok());
        // But not of a flat GRAD buffer.
        r.register("gflat", 0, reg(Role::Grad, 0x3000, 8)).unwrap();
        r.register("gflat", 1, reg(Role::Grad, 0x4000, 8)).unwrap();
        r.register("gview", 0, reg(Role::Grad, 0x3010, 4)).unwrap();
        r.register("gview", 1, reg(Role::Grad, 0x4010, 4)).unwrap();
        let s = r.snapshot();
        let err = s.grads_to_reduce().unwrap_err();
        assert!(err.message.contains("reduce it twice"), "{}", err.message);
        assert!(s.select(Role::Param.into()).is_ok());
    }

    #[test]
    fn host_and_device_memory_of_one_name_is_inconsistent() {
        let mut r = Registry::new(2);
        r.register("bn_mean", 0, reg(Role::Computed, 0x1000, 4))
            .unwrap();
        let device = Registration {
            memory: Memory::Device,
            ..reg(Role::Computed, 0x9000, 4)
        };
        r.register("bn_mean", 1, device).unwrap();
        let err = r.snapshot().lookup("bn_mean").unwrap_err();
        assert_eq!(err.kind, ErrorKind::Inconsistent);
        assert_eq!(
            err.message,
            "tensor 'bn_mean': replica 1 has it in device memory, replica 0 in host memory"
        );
    }

    #[test]
    fn unregister_keeps_the_order_of_the_rest() {
        let mut r = Registry::new(1);
        for (i, name) in ["a", "b", "c"].iter().enumerate() {
            r.register(name, 0, reg(Role::Grad, 0x100 * (i + 1), 1))
                .unwrap();
        }
        r.unregister("b").unwrap();
        assert_eq!(r.unregister("b").unwrap_err().kind, ErrorKind::NotFound);
        let s = r.snapshot();
        let names: Vec<_> = s.tensors.iter().map(|t| t.name.as_str()).collect();
        assert_eq!(names, ["a", "c"]);
        assert!(s.lookup("c").is_ok());
    }
}
