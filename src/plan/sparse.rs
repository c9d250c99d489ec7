//! The sparse gather of one step as pure data: which slices share one index gather, where each
//! replica's rows land in the gathered slice, and the JSON `describe` shows for sparse gradients.

use std::collections::HashMap;

use serde_json::{json, Value};

use crate::registry::sparse::{SparseInput, SparseSpec};

/// Slices gathered together: the first member's indices are gathered once for all of them.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct IndexGroup {
    /// Indices into the step's inputs, in registration order.
    pub members: Vec<usize>,
}

/// Groups the step's inputs by index buffer: slices whose indices are the same buffer with the
/// same row count on every replica (and the same index dtype) share one index gather, so the
/// gathered indices are exactly as long as each member's gathered values. A buffer shared with
/// different row counts on some replica is not the same indices and is gathered separately.
pub fn index_groups(inputs: &[SparseInput]) -> Vec<IndexGroup> {
    groups_by_key(inputs.iter().map(|input| {
        (
            input.spec.index_dtype,
            // An empty slice's pointer (NULL or not) is never read: every empty slice is alike.
            (input.slices.iter())
                .map(|s| (if s.rows == 0 { 0 } else { s.indices }, s.rows))
                .collect::<Vec<_>>(),
        )
    }))
}

/// The inputs grouped by `keys` (one per input): groups in order of their first member.
fn groups_by_key<K: std::hash::Hash + Eq>(keys: impl Iterator<Item = K>) -> Vec<IndexGroup> {
    let mut groups: Vec<IndexGroup> = Vec::new();
    let mut by_key: HashMap<K, usize> = HashMap::new();
    for (i, key) in keys.enumerate() {
        match by_key.get(&key) {
            Some(&g) => groups[g].members.push(i),
            None => {
                by_key.insert(key, groups.len());
                groups.push(IndexGroup { members: vec![i] });
            }
        }
    }
    groups
}

/// Each input's group in `groups` (the group's position), `inputs` long.
pub fn group_labels(groups: &[IndexGroup], inputs: usize) -> Vec<usize> {
    let mut labels = vec![0; inputs];
    for (g, group) in groups.iter().enumerate() {
        for &m in &group.members {
            labels[m] = g;
        }
    }
    labels
}

/// The index groups every rank of a world can use, from every rank's [`group_labels`]: two
/// inputs share a gather only where they share one on every rank (each rank decides from its
/// own buffers, so one may share an indices buffer where another holds two copies). Groups in
/// order of their first member, the same on every rank.
pub fn common_groups(labels: &[Vec<usize>]) -> Vec<IndexGroup> {
    let inputs = labels.first().map_or(0, Vec::len);
    groups_by_key((0..inputs).map(|i| labels.iter().map(|l| l[i]).collect::<Vec<usize>>()))
}

/// Row offsets of each replica's rows in the gathered slice (world order), and the total.
pub fn world_offsets(rows: impl IntoIterator<Item = usize>) -> (Vec<usize>, usize) {
    let mut total = 0;
    let offsets = rows
        .into_iter()
        .map(|r| {
            let at = total;
            total += r;
            at
        })
        .collect();
    (offsets, total)
}

/// `describe`'s entry for one consistently registered sparse gradient.
pub fn describe_sparse(name: &str, spec: &SparseSpec, coalesce: bool) -> Value {
    json!({
        "name": name,
        "row_len": spec.row_len,
        "value_dtype": spec.value_dtype.name(),
        "index_dtype": spec.index_dtype.name(),
        "num_embeddings": spec.num_embeddings,
        "coalesce": coalesce,
    })
}

/// `describe`'s summary of how sparse gradients are gathered on `replicas` replicas.
pub fn describe_gather(replicas: usize, coalesce: bool) -> Value {
    let order: Vec<usize> = (0..replicas).collect();
    if coalesce {
        json!({"coalesce": true, "order": order, "root": 0,
               "program": "coalesce on every replica, gather to the root in world order, \
                           coalesce there, copy the result to every replica"})
    } else {
        json!({"coalesce": false, "order": order,
               "program": "copy every replica's rows to every replica in world order"})
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::registry::sparse::SparseSlice;
    use crate::types::DType;

    fn input(name: &str, index_dtype: DType, slices: &[(usize, usize)]) -> SparseInput {
        SparseInput {
            name: name.to_owned(),
            spec: SparseSpec {
                row_len: 4,
                value_dtype: DType::F32,
                index_dtype,
                num_embeddings: 0,
            },
            slices: slices
                .iter()
                .enumerate()
                .map(|(r, &(indices, rows))| SparseSlice {
                    indices,
                    values: 0x10_0000 * (r + 1),
                    rows,
                })
                .collect(),
        }
    }

    #[test]
    fn slices_sharing_an_index_buffer_on_every_replica_share_one_gather() {
        let shared = [(0x100, 3), (0x200, 5)];
        let inputs = [
            input("a", DType::I64, &shared),
            input("b", DType::I64, &[(0x100, 3), (0x300, 5)]),
            input("c", DType::I64, &shared),
            input("d", DType::I64, &[(0x100, 3), (0x200, 4)]), // same buffer, other length
            input("e", DType::I32, &shared),
            input("f", DType::I64, &shared),
        ];
        let groups: Vec<Vec<usize>> = index_groups(&inputs)
            .into_iter()
            .map(|g| g.members)
            .collect();
        assert_eq!(groups, vec![vec![0, 2, 5], vec![1], vec![3], vec![4]]);
    }

    #[test]
    fn empty_slices_share_a_gather_whatever_their_pointers() {
        let inputs = [
            input("a", DType::I64, &[(0, 0), (0x200, 5)]),
            input("b", DType::I64, &[(0x900, 0), (0x200, 5)]),
        ];
        assert_eq!(index_groups(&inputs).len(), 1);
    }

    #[test]
    fn ranks_share_a_gather_only_where_every_rank_does() {
        // Rank 0 shares one buffer among a, b and c; rank 1 between b and c and d only.
        let rank0 = vec![0, 0, 0, 1];
        let rank1 = vec![0, 1, 1, 1];
        let groups: Vec<Vec<usize>> = common_groups(&[rank0.clone(), rank1])
            .into_iter()
            .map(|g| g.members)
            .collect();
        assert_eq!(groups, vec![vec![0], vec![1, 2], vec![3]]);
        let alone = common_groups(std::slice::from_ref(&rank0));
        assert_eq!(group_labels(&alone, 4), rank0);
    }

    #[test]
    fn offsets_follow_world_order() {
        assert_eq!(world_offsets([3, 0, 5, 1]), (vec![0, 3, 3, 8], 9));
        assert_eq!(world_offsets([]), (vec![], 0));
    }
}
