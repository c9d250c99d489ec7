//! dpsync_plan_describe for CUDA topologies: Caffe2's seed case, pairwise trees, shared GPUs.

use super::*;

// ------------------------------------------------------------------ plan_describe (CUDA)

fn cuda_plan(ordinals: &[i32], peer: Option<&[u8]>, transport: u32) -> Value {
    let o = Options::new();
    o.set_cuda_replicas(ordinals);
    if let Some(m) = peer {
        o.set_peer_access(m, ordinals.len());
    }
    o.set_transport(transport);
    o.plan_json()
}

/// Checks "via" against the matrix and the devices; returns the plan's steps.
fn check_peer_plan(ordinals: &[i32], matrix: &[u8], what: &str) -> Vec<Step> {
    let n = ordinals.len();
    let j = cuda_plan(ordinals, Some(matrix), T_PEER_COPY);
    assert_eq!(j["transport"], "peer_copy", "{what}");
    let reps = j["replicas"].as_array().expect("replicas");
    assert_eq!(reps.len(), n, "{what}");
    for (i, r) in reps.iter().enumerate() {
        assert_eq!(r["device"], format!("cuda:{}", ordinals[i]), "{what}: {r}");
    }
    let pa: Vec<Vec<u8>> = j["peer_access"]
        .as_array()
        .expect("peer_access")
        .iter()
        .map(|row| {
            row.as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u8)
                .collect()
        })
        .collect();
    let want: Vec<Vec<u8>> = matrix
        .chunks(n)
        .map(|c| c.iter().map(|&v| (v != 0) as u8).collect())
        .collect();
    assert_eq!(pa, want, "{what}: peer_access is the override");
    let peer = |a: usize, b: usize| matrix[a * n + b] != 0 && matrix[b * n + a] != 0;
    let st = steps_of(&j);
    for s in &st {
        if s.via == "peer" {
            let (a, b) = (s.src.unwrap(), s.dst.unwrap());
            assert!(
                peer(a, b),
                "{what}: direct peer step without peer access both ways: {s:?}"
            );
        }
        if s.op == "sum" {
            let (a, b) = (s.src.unwrap(), s.dst.unwrap());
            if ordinals[a] == ordinals[b] {
                assert_eq!(s.via, "local", "{what}: {s:?}");
            } else if !peer(a, b) {
                assert_eq!(
                    s.via, "staged",
                    "{what}: sum between devices without peer access {s:?}"
                );
            }
        }
    }
    assert_plan_reduces(n, &st, what);
    st
}

#[test]
fn plan_seed_topology_pascal_and_kepler_pair() {
    // GPU0 alone (Pascal), GPU1 <-> GPU2 (Kepler pair) with peer access.
    let dev_peer = |a: i32, b: i32| a == b || (a != 0 && b != 0);
    for ordinals in [vec![0, 1], vec![0, 2], vec![1, 2], vec![0, 1, 2]] {
        let n = ordinals.len();
        let mut m = vec![0u8; n * n];
        for i in 0..n {
            for k in 0..n {
                m[i * n + k] = dev_peer(ordinals[i], ordinals[k]) as u8;
            }
        }
        let what = format!("devices {ordinals:?}");
        let st = check_peer_plan(&ordinals, &m, &what);
        let s = sums(&st);
        assert_eq!(s.len(), n - 1, "{what}: n - 1 sums: {st:?}");
        if ordinals == [1, 2] {
            assert!(
                st.iter().filter(|s| s.op == "sum").all(|s| s.via == "peer"),
                "{what}: {st:?}"
            );
        }
        if ordinals == [0, 1] || ordinals == [0, 2] {
            assert!(
                st.iter().all(|s| s.via != "peer"),
                "{what}: no peer access at all: {st:?}"
            );
        }
    }
}

fn all_peer(n: usize) -> Vec<u8> {
    vec![1u8; n * n]
}

/// Sum steps must come in these rounds (order inside a round free).
fn assert_rounds(st: &[Step], rounds: &[&[(usize, usize)]], what: &str) {
    let s = sums(st);
    let total: usize = rounds.iter().map(|r| r.len()).sum();
    assert_eq!(s.len(), total, "{what}: sum steps {s:?}");
    let mut at = 0;
    for (k, round) in rounds.iter().enumerate() {
        let got: BTreeSet<(usize, usize)> = s[at..at + round.len()].iter().copied().collect();
        let want: BTreeSet<(usize, usize)> = round.iter().copied().collect();
        assert_eq!(got, want, "{what}: round {k} (src, dst) of {s:?}");
        at += round.len();
    }
    for x in st.iter().filter(|s| s.op == "sum") {
        assert_eq!(
            x.via, "peer",
            "{what}: all-peer topology reads directly: {x:?}"
        );
    }
    // Where steps carry a round number, each expected round is one round, in increasing order.
    let summed: Vec<&Step> = st.iter().filter(|s| s.op == "sum").collect();
    if summed.iter().all(|s| s.round.is_some()) {
        let mut at = 0;
        let mut last: Option<u64> = None;
        for round in rounds {
            let nums: BTreeSet<u64> = summed[at..at + round.len()]
                .iter()
                .map(|s| s.round.unwrap())
                .collect();
            assert_eq!(
                nums.len(),
                1,
                "{what}: one round number per round: {summed:?}"
            );
            let r = *nums.iter().next().unwrap();
            assert!(
                last.is_none_or(|l| r > l),
                "{what}: rounds increase: {summed:?}"
            );
            last = Some(r);
            at += round.len();
        }
    }
}

#[test]
fn plan_pairwise_trees_like_caffe2() {
    let ord: Vec<i32> = (0..16).collect();
    let st = check_peer_plan(&ord[..4], &all_peer(4), "4 all-peer");
    assert_rounds(&st, &[&[(1, 0), (3, 2)], &[(2, 0)]], "4 all-peer");

    let st = check_peer_plan(&ord[..8], &all_peer(8), "8 all-peer");
    assert_rounds(
        &st,
        &[
            &[(1, 0), (3, 2), (5, 4), (7, 6)],
            &[(2, 0), (6, 4)],
            &[(4, 0)],
        ],
        "8 all-peer",
    );

    let st = check_peer_plan(&ord[..16], &all_peer(16), "16 all-peer");
    let r1: Vec<(usize, usize)> = (0..8).map(|k| (2 * k + 1, 2 * k)).collect();
    let r2: Vec<(usize, usize)> = (0..4).map(|k| (4 * k + 2, 4 * k)).collect();
    assert_rounds(
        &st,
        &[&r1, &r2, &[(4, 0), (12, 8)], &[(8, 0)]],
        "16 all-peer",
    );

    // other counts: a flat sum on the first replica
    for n in [2usize, 3, 5, 6, 7] {
        let what = format!("{n} all-peer");
        let st = check_peer_plan(&ord[..n], &all_peer(n), &what);
        let got: BTreeSet<(usize, usize)> = sums(&st).into_iter().collect();
        let want: BTreeSet<(usize, usize)> = (1..n).map(|r| (r, 0)).collect();
        assert_eq!(got, want, "{what}");
        assert_eq!(sums(&st).len(), n - 1, "{what}");
    }
}

#[test]
fn plan_pairwise_tree_with_partial_peer_access_never_reads_without_it() {
    // 4 replicas on 4 GPUs, peer access only within {0,1} and {2,3} (two PCIe switches).
    let mut m = vec![0u8; 16];
    for i in 0..4 {
        for k in 0..4 {
            m[i * 4 + k] = (i / 2 == k / 2) as u8;
        }
    }
    let st = check_peer_plan(&[0, 1, 2, 3], &m, "two islands");
    let s = sums(&st);
    assert_eq!(s.len(), 3, "{st:?}");
    // one-way access is not enough for a direct read
    let mut one_way = all_peer(3);
    one_way[1] = 0; // replica 0 cannot read replica 1, replica 1 can read replica 0
    let st = check_peer_plan(&[0, 1, 2], &one_way, "one-way 0<-1");
    for x in &st {
        if x.via == "peer" {
            let pair = (
                x.src.unwrap().min(x.dst.unwrap()),
                x.src.unwrap().max(x.dst.unwrap()),
            );
            assert_ne!(pair, (0, 1), "{x:?}");
        }
    }
}

#[test]
fn plan_nccl_with_replicas_sharing_a_gpu() {
    let ordinals = [0, 0, 1, 1];
    let j = cuda_plan(&ordinals, None, T_NCCL);
    assert_eq!(j["transport"], "nccl");
    let st = steps_of(&j);
    let s: Vec<&Step> = st.iter().filter(|s| s.op == "sum").collect();
    assert_eq!(s.len(), 2, "one local sum per GPU pair: {st:?}");
    let mut leaders = BTreeSet::new();
    for x in &s {
        let (a, b) = (x.src.unwrap(), x.dst.unwrap());
        assert_eq!(
            ordinals[a], ordinals[b],
            "local sums stay on one GPU: {x:?}"
        );
        assert_eq!(x.via, "local", "{x:?}");
        leaders.insert(ordinals[b]);
    }
    assert_eq!(leaders, BTreeSet::from([0, 1]));
    let nccl: Vec<&Step> = st.iter().filter(|s| s.op == "nccl_allreduce").collect();
    assert_eq!(nccl.len(), 2, "one nccl_allreduce per distinct GPU: {st:?}");
    let gpus: BTreeSet<i32> = nccl
        .iter()
        .map(|x| ordinals[x.dst.or(x.src).expect("nccl step replica")])
        .collect();
    assert_eq!(gpus, BTreeSet::from([0, 1]), "{st:?}");
    for x in &nccl {
        assert_eq!(x.via, "nccl", "{x:?}");
    }
    for x in st.iter().filter(|s| s.op == "copy") {
        assert_eq!(
            ordinals[x.src.unwrap()],
            ordinals[x.dst.unwrap()],
            "copies back stay local: {x:?}"
        );
    }
    assert_plan_reduces(4, &st, "nccl [0,0,1,1]");

    // distinct GPUs: NCCL only
    let j = cuda_plan(&[0, 1, 2], None, T_NCCL);
    let st = steps_of(&j);
    assert_eq!(
        st.iter().filter(|s| s.op == "nccl_allreduce").count(),
        3,
        "{st:?}"
    );
    assert!(sums(&st).is_empty(), "{st:?}");
    assert_plan_reduces(3, &st, "nccl [0,1,2]");
}

#[test]
fn plan_peer_copy_with_replicas_sharing_a_gpu_sums_locally() {
    let ordinals = [0, 0, 1, 1];
    let mut m = vec![0u8; 16];
    for i in 0..4 {
        for k in 0..4 {
            m[i * 4 + k] = (ordinals[i] == ordinals[k]) as u8;
        }
    }
    let st = check_peer_plan(&ordinals, &m, "peer_copy [0,0,1,1] no peer");
    assert_eq!(sums(&st).len(), 3, "{st:?}");
}
