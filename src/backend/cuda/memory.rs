//! The CUDA backend's memory: per-device scratch (fusion and staging buffers, segment tables
//! cached by content, page-locked staging), the spares of completed collectives reused for
//! per-step buffers, and the owner that hands a dropped [`Allocation`](crate::backend::Allocation)
//! back to the collective it may still be used by.

use std::collections::HashMap;
use std::hash::{Hash, Hasher};
use std::sync::Arc;

use parking_lot::Mutex;

use super::driver::{self, DeviceMemory};
use super::{CudaBackend, Group};
use crate::backend::spares::Block;
use crate::backend::{size_class, BucketView, Members};
use crate::error::Result;

/// Library scratch memory of one device, grown on demand and reused by every collective.
#[derive(Default)]
pub(super) struct Scratch {
    pub(super) fusion: Option<DeviceMemory>,
    pub(super) staging: Option<DeviceMemory>,
    /// Page-locked memory the host reads device data into (coalescing), and its size.
    pub(super) host: Option<(driver::PinnedMemory, usize)>,
    /// Page-locked memory a world's buckets cross the ranks in (`stage.rs`), and its size.
    pub(super) stage: Option<(driver::PinnedMemory, usize)>,
    /// Segment tables by content (they only change when the registry does).
    pub(super) tables: HashMap<TableKey, DeviceMemory>,
}

/// A segment table as a cache key: equal only when every word is, but hashed on at most 64
/// words spread over it. Looked up on every collective: hashing all of ResNet-50's 5 KiB table
/// took about a third of the host time of issuing `allreduce_grads` (perf, fake driver). Tables
/// that differ only between the sampled words share a hash and are told apart by comparison.
#[derive(PartialEq, Eq)]
pub(super) struct TableKey(Vec<u64>);

impl Hash for TableKey {
    fn hash<H: Hasher>(&self, state: &mut H) {
        let words = &self.0;
        let stride = words.len().div_ceil(64).max(1);
        // Folded first (FxHash's step), then one write: a SipHash round per word would cost
        // more than the rest of the lookup.
        let fold = words
            .iter()
            .step_by(stride)
            .chain(words.last())
            .fold(words.len() as u64, |h, &w| {
                (h.rotate_left(5) ^ w).wrapping_mul(0x517c_c1b7_2722_0a95)
            });
        state.write_u64(fold);
    }
}

/// Tables kept before the cache is flushed (a framework re-registering every step).
const MAX_TABLES: usize = 4096;

/// Where this backend's dropped [`Allocation`]s go. Work already queued may still use them, so
/// `end` attaches them to the collective it ends, and they are freed when that completes. Once
/// the backend is gone (its `Drop` waited for all work), they are freed at once — or leaked, like
/// the rest, when the backend failed and queued work may never finish.
#[derive(Default)]
pub(super) struct Dropped {
    pub(super) mems: Vec<DeviceMemory>,
    /// `Some(leak)` after the backend's `Drop`.
    pub(super) closed: Option<bool>,
}

/// The owner of an [`Allocation`]'s device memory: hands it to [`Dropped`] on drop.
pub(super) struct Handed {
    pub(super) mem: Option<DeviceMemory>,
    pub(super) sink: Arc<Mutex<Dropped>>,
}

impl Drop for Handed {
    fn drop(&mut self) {
        let Some(mem) = self.mem.take() else { return };
        let mut sink = self.sink.lock();
        match sink.closed {
            None => sink.mems.push(mem),
            Some(false) => {
                drop(sink);
                drop(mem);
            }
            Some(true) => std::mem::forget(mem),
        }
    }
}

/// Device memory of completed collectives (coalescing maps, outputs replaced by newer ones) is
/// reused for the next per-step buffers ([`Spares`]): freeing and allocating them every step
/// would call `cuMemFree`, which waits for the whole device (the callers' streams included) and
/// so blocks the host. Nothing is freed while a collective is issued: spares beyond the cache's
/// limit retire and are freed by `synchronize` (which blocks anyway), by an allocation that ran
/// out of memory, or at destroy.
impl Block for DeviceMemory {
    fn bytes(&self) -> usize {
        self.bytes
    }
}

/// Fresh per-step device memory is at least 64 KiB ([`size_class`]): the driver's allocation
/// granularity makes smaller buffers no cheaper.
pub(super) const DEVICE_FLOOR: usize = 64 << 10;

impl CudaBackend {
    /// The segment table of `bucket` over `members` of `group`, in device memory (uploaded once
    /// per layout).
    pub(super) fn table(
        &self,
        group: &Group,
        bucket: &BucketView<'_>,
        members: Members,
    ) -> Result<u64> {
        let counts = bucket.segments.iter().map(|seg| seg.count);
        let host = match members {
            Members::All => table_of(
                counts,
                (bucket.segments.iter()).map(|seg| group.local.iter().map(|&r| seg.ptrs[r] as u64)),
            ),
            Members::One(r) => table_of(
                counts,
                bucket.segments.iter().map(|seg| [seg.ptrs[r] as u64]),
            ),
        };
        self.upload_table(group, host)
    }

    /// A table built by [`table_of`] in device memory on `group`'s device, uploaded the first
    /// time its content is seen and reused afterwards.
    pub(super) fn upload_table(&self, group: &Group, host: Vec<u64>) -> Result<u64> {
        let host = TableKey(host);
        let mut scratch = group.scratch.lock();
        if let Some(mem) = scratch.tables.get(&host) {
            return Ok(mem.ptr);
        }
        if scratch.tables.len() >= MAX_TABLES {
            // Tables in the cache may still be read by queued kernels, this collective's
            // included: they are freed (or reused) once it completes, not now.
            let old = std::mem::take(&mut scratch.tables).into_values();
            self.state.lock().issuing.retire.extend(old);
        }
        let bytes: Vec<u8> = host.0.iter().flat_map(|w| w.to_ne_bytes()).collect();
        let _bound = group.ctx.bind()?;
        let mem = self.fresh_memory(group, bytes.len())?;
        // In order on the group's stream, before the kernels that read the table.
        driver::upload(mem.ptr, &bytes, group.stream.0)?;
        let ptr = mem.ptr;
        scratch.tables.insert(host, mem);
        Ok(ptr)
    }

    /// At least `bytes` of device memory on `group`'s device for work about to be queued on
    /// its stream, contents undefined: a spare of a completed collective when one fits, else
    /// a fresh allocation of the size class ([`Spares`]).
    pub(super) fn device_memory(&self, group: &Group, bytes: usize) -> Result<DeviceMemory> {
        if let Some(mem) = (self.state.lock().spares).take(bytes, |m| m.is_on(&group.ctx)) {
            return Ok(mem);
        }
        self.fresh_memory(group, size_class(bytes, DEVICE_FLOOR))
    }

    /// A new allocation of `bytes` on `group`'s device. Out of memory, the idle spares on that
    /// device are freed and the allocation is tried once more.
    pub(super) fn fresh_memory(&self, group: &Group, bytes: usize) -> Result<DeviceMemory> {
        DeviceMemory::uninit(&group.ctx, bytes).or_else(|first| {
            let idle = (self.state.lock().spares).release(|m| m.is_on(&group.ctx));
            if idle.is_empty() {
                return Err(first);
            }
            drop(idle); // cuMemFree each
            DeviceMemory::uninit(&group.ctx, bytes)
        })
    }

    /// A scratch buffer of at least `bytes` (fusion or staging) on `group`'s device.
    pub(super) fn scratch(&self, group: &Group, bytes: usize, staging: bool) -> Result<u64> {
        let mut scratch = group.scratch.lock();
        let slot = if staging {
            &mut scratch.staging
        } else {
            &mut scratch.fusion
        };
        if let Some(mem) = slot.as_ref().filter(|m| m.bytes >= bytes) {
            return Ok(mem.ptr);
        }
        if let Some(old) = slot.take() {
            // The old buffer may still be read by queued work, on this device or (peer reads
            // and copies) on another: freed (or reused) once this collective completes, which
            // is after all of that on every device.
            self.state.lock().issuing.retire.push(old);
        }
        let mem = self.fresh_memory(group, bytes)?;
        let ptr = mem.ptr;
        *slot = Some(mem);
        Ok(ptr)
    }
}

/// A kernel table: `{offset, count}` per segment, then each segment's pointers (one per local
/// replica for the walks; params, W and D for BMUF).
pub(super) fn table_of<P: IntoIterator<Item = u64>>(
    counts: impl Iterator<Item = usize>,
    ptrs: impl Iterator<Item = P>,
) -> Vec<u64> {
    // Room for each segment's offset, count and two pointers (two replicas per GPU, or the
    // BMUF triple's first two); more grows once. Built on every collective: no repeated growth.
    let mut host = Vec::with_capacity(counts.size_hint().0 * 4);
    let mut offset = 0u64;
    for count in counts {
        host.push(offset);
        host.push(count as u64);
        offset += count as u64;
    }
    for seg in ptrs {
        host.extend(seg);
    }
    host
}

#[cfg(test)]
mod tests {
    use super::*;

    fn hash_of(key: &TableKey) -> u64 {
        let mut h = std::collections::hash_map::DefaultHasher::new();
        key.hash(&mut h);
        h.finish()
    }

    #[test]
    fn table_keys_differing_between_sampled_words_stay_distinct() {
        // 644 words (ResNet-50 on two replicas): a stride of 11, so word 5 is not sampled.
        let a: Vec<u64> = (0..644).map(|i| 0x7f00_0000_0000 + i * 4096).collect();
        let mut b = a.clone();
        b[5] += 8;
        let (ka, kb) = (TableKey(a.clone()), TableKey(b));
        assert_eq!(hash_of(&ka), hash_of(&kb), "word 5 is not sampled");
        assert!(ka != kb);
        let mut cache = HashMap::new();
        cache.insert(ka, 1);
        cache.insert(kb, 2);
        assert_eq!(cache.len(), 2, "same hash, different tables: two entries");
        assert_eq!(cache.get(&TableKey(a.clone())), Some(&1));
        // A sampled word and the length change the hash.
        let mut c = a.clone();
        c[0] += 8;
        assert_ne!(hash_of(&TableKey(c)), hash_of(&TableKey(a.clone())));
        assert_ne!(hash_of(&TableKey(a[..643].to_vec())), hash_of(&TableKey(a)));
    }
}
