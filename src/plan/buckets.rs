//! Fusion buckets: gradients in the order backward produces them (last registered first), packed
//! per dtype into buckets of at most `fusion_bytes`, so many small tensors cost about one launch.

use crate::types::{DType, Memory};

#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bucket {
    pub dtype: DType,
    /// Host buckets are reduced by host threads, device buckets by the device transport.
    pub memory: Memory,
    /// Tensor indices in reduction order.
    pub tensors: Vec<usize>,
    pub elements: usize,
}

impl Bucket {
    pub fn bytes(&self) -> usize {
        self.elements * self.dtype.size()
    }
}

/// `grads` yields (tensor index, dtype, memory, count) in reduction order; a bucket holds one
/// dtype in one kind of memory. A tensor larger than
/// `fusion_bytes` gets a bucket of its own; `fusion_bytes == 0` gives every tensor its own.
/// Buckets are returned in the order of their first tensor, the order they become ready in.
pub fn plan_buckets(
    grads: impl IntoIterator<Item = (usize, DType, Memory, usize)>,
    fusion_bytes: usize,
) -> Vec<Bucket> {
    // (position of first tensor, bucket); one open bucket per dtype.
    let mut done: Vec<(usize, Bucket)> = Vec::new();
    let mut open: Vec<(usize, Bucket)> = Vec::new();
    for (pos, (index, dtype, memory, count)) in grads.into_iter().enumerate() {
        let bytes = count * dtype.size();
        let same_kind = |b: &Bucket| b.dtype == dtype && b.memory == memory;
        if let Some(slot) = open.iter().position(|(_, b)| same_kind(b)) {
            if open[slot].1.bytes() + bytes <= fusion_bytes {
                let bucket = &mut open[slot].1;
                bucket.tensors.push(index);
                bucket.elements += count;
                continue;
            }
            done.push(open.swap_remove(slot));
        }
        open.push((
            pos,
            Bucket {
                dtype,
                memory,
                tensors: vec![index],
                elements: count,
            },
        ));
    }
    done.extend(open);
    done.sort_by_key(|(pos, _)| *pos);
    done.into_iter().map(|(_, b)| b).collect()
}

#[cfg(test)]
mod tests {
    use super::*;

    fn names(buckets: &[Bucket]) -> Vec<Vec<usize>> {
        buckets.iter().map(|b| b.tensors.clone()).collect()
    }

    #[test]
    fn packs_in_order_up_to_the_capacity_per_dtype() {
        // Reverse registration order 5,4,3,2,1,0 with 4-byte elements.
        let grads = [
            (5, DType::F32, Memory::Host, 2),
            (4, DType::F32, Memory::Host, 2),
            (3, DType::F16, Memory::Host, 4),
            (2, DType::F32, Memory::Host, 2),
            (1, DType::F32, Memory::Host, 10),
            (0, DType::F16, Memory::Host, 1),
        ];
        let b = plan_buckets(grads, 16);
        assert_eq!(names(&b), vec![vec![5, 4], vec![3, 0], vec![2], vec![1]]);
        assert_eq!(b[0].bytes(), 16);
        assert_eq!(b[1].dtype, DType::F16);
        assert_eq!(b[3].bytes(), 40, "an oversized tensor gets its own bucket");
        for bucket in &b {
            assert!(bucket.bytes() <= 16 || bucket.tensors.len() == 1);
        }
    }

    #[test]
    fn zero_capacity_disables_fusion() {
        let grads = [
            (2, DType::F32, Memory::Host, 1),
            (1, DType::F32, Memory::Host, 1),
            (0, DType::F32, Memory::Host, 1),
        ];
        let b = plan_buckets(grads, 0);
        assert_eq!(names(&b), vec![vec![2], vec![1], vec![0]]);
    }

    #[test]
    fn a_large_capacity_makes_one_bucket_per_dtype() {
        let grads = (0..100).rev().map(|i| (i, DType::F32, Memory::Host, 1000));
        let b = plan_buckets(grads, usize::MAX);
        assert_eq!(b.len(), 1);
        assert_eq!(b[0].elements, 100_000);
        assert_eq!(b[0].tensors[0], 99);
    }

    #[test]
    fn host_and_device_tensors_never_share_a_bucket() {
        let grads = [
            (2, DType::F32, Memory::Device, 1),
            (1, DType::F32, Memory::Host, 1),
            (0, DType::F32, Memory::Device, 1),
        ];
        let b = plan_buckets(grads, 1 << 20);
        assert_eq!(names(&b), vec![vec![2, 0], vec![1]]);
        assert_eq!(b[1].memory, Memory::Host);
    }
}
