//! The model the sequence is checked against: what is registered (dense tensors, sparse
//! gradients and their slices), this step's `dpsync_grad_ready` marks and the fusion buckets they
//! belong to, and the bookkeeping over it.

use std::collections::{HashSet, VecDeque};

use crate::bmuf::Bmuf;
use crate::common::{abi::*, buf::*, context::*, errors::*, lcg::*, reference::*};
use dpsync::*;

/// Statuses the contract defines: 0..=9; 9 (PANIC) must never be seen.
pub(crate) const PANIC: u32 = dpsync_status::DPSYNC_STATUS_PANIC as u32;
pub(crate) const LAST_STATUS: u32 = dpsync_status::DPSYNC_STATUS_RANK_LOST as u32;
pub(crate) const ROLES: [u32; 4] = [PARAM, GRAD, COMPUTED, STATE];
/// docs/API.md "Options": 25 MiB buckets by default.
pub(crate) const DEFAULT_FUSION: usize = 25 << 20;
/// Names are drawn from this pool for dense tensors and sparse gradients alike, so that names
/// collide across kinds and registrations meet earlier ones.
pub(crate) const NAMES: [&str; 11] = [
    "fc_w", "fc_b", "conv", "bn_mean", "bn_var", "mom", "iter", "emb", "emb2", "h0", "h1",
];
pub(crate) const LOG_LINES: usize = 12;

pub(crate) struct Slot {
    pub(crate) role: u32,
    pub(crate) dtype: DType,
    pub(crate) buf: Buf,
}

/// One dense name: per replica, what was registered (None: nothing on that replica).
pub(crate) struct Tensor {
    pub(crate) name: String,
    pub(crate) slots: Vec<Option<Slot>>,
}

impl Tensor {
    /// (role, dtype, count) when every replica registered the same.
    pub(crate) fn spec(&self) -> Option<(u32, DType, usize)> {
        let mut spec = None;
        for s in &self.slots {
            let s = s.as_ref()?;
            let this = (s.role, s.dtype, s.buf.len());
            if *spec.get_or_insert(this) != this {
                return None;
            }
        }
        spec
    }

    /// The first registration (what a consistent completion copies).
    pub(crate) fn reference(&self) -> Option<(u32, DType, usize)> {
        (self.slots.iter().flatten())
            .next()
            .map(|s| (s.role, s.dtype, s.buf.len()))
    }

    pub(crate) fn role_bits(&self) -> u32 {
        self.slots.iter().flatten().fold(0, |acc, s| acc | s.role)
    }

    pub(crate) fn buf(&self, r: usize) -> &Buf {
        &self.slots[r].as_ref().expect("registered").buf
    }
}

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct Spec {
    pub(crate) row_len: usize,
    pub(crate) values: DType,
    pub(crate) indices: DType,
    pub(crate) num_embeddings: usize,
}

/// One replica's slice for the coming step; the buffers live here until it is consumed.
pub(crate) struct SliceM {
    /// The indices as set (a copy when the memory is another slice's: shared indices).
    pub(crate) indices: Buf,
    pub(crate) values: Buf,
    pub(crate) rows: usize,
    /// The indices pointer given to the library (slices sharing it share one index gather).
    pub(crate) indices_ptr: usize,
}

pub(crate) struct Gathered {
    pub(crate) indices: Vec<i64>,
    pub(crate) values: Buf,
    pub(crate) rows: usize,
    /// Per replica, the (indices pointer, rows) set: gradients with equal keys share one index
    /// gather and get the same indices pointer back.
    pub(crate) share_key: Vec<(usize, usize)>,
}

pub(crate) struct SparseM {
    pub(crate) name: String,
    pub(crate) specs: Vec<Option<Spec>>,
    pub(crate) slices: Vec<Option<SliceM>>,
    pub(crate) gathered: Option<Gathered>,
}

impl SparseM {
    pub(crate) fn spec(&self) -> Option<Spec> {
        let first = self.specs[0]?;
        self.specs
            .iter()
            .all(|s| *s == Some(first))
            .then_some(first)
    }
}

#[derive(Clone, Debug, PartialEq, Eq)]
pub(crate) struct BucketM {
    pub(crate) dtype: DType,
    pub(crate) names: Vec<String>,
    pub(crate) elements: usize,
}

/// This step's `dpsync_grad_ready` marks (forgotten when a registration changes the buckets).
#[derive(Clone)]
pub(crate) struct Marks {
    pub(crate) buckets: Vec<BucketM>,
    pub(crate) ready: HashSet<(String, usize)>,
    pub(crate) reduced: Vec<bool>,
}

/// Predicted contents of every registered buffer, per tensor (model order) per replica.
pub(crate) type Pred = Vec<Vec<Option<Buf>>>;

pub(crate) enum Want {
    Ok(Pred),
    Err(Vec<dpsync_status>),
}

pub(crate) struct Sim {
    // Declared first: dropped (destroyed) before any buffer it may still point to.
    pub(crate) ctx: Context,
    pub(crate) seed: u64,
    pub(crate) g: Lcg,
    pub(crate) n: usize,
    pub(crate) fusion: usize,
    pub(crate) fusion_set: Option<usize>,
    pub(crate) coalesce: bool,
    pub(crate) tensors: Vec<Tensor>,
    /// Unregistered tensors whose memory the test keeps (to register them again identically);
    /// the library must not write it.
    pub(crate) detached: Vec<Tensor>,
    pub(crate) sparse: Vec<SparseM>,
    /// Memory the library may have seen but no longer owns; kept alive until the end.
    pub(crate) graveyard: Vec<Buf>,
    pub(crate) marks: Option<Marks>,
    pub(crate) last_op: Option<u32>,
    pub(crate) last_step_early: usize,
    pub(crate) bmuf: Option<Bmuf>,
    pub(crate) log: VecDeque<String>,
    pub(crate) calls: usize,
    pub(crate) last_fail: Option<(dpsync_status, String)>,
    pub(crate) trace: bool,
}

pub(crate) fn op_name(op: u32) -> String {
    match op {
        SUM => "SUM".into(),
        AVG => "AVG".into(),
        _ => format!("op {op}"),
    }
}

pub(crate) fn status_str(st: dpsync_status) -> String {
    status_name(st as u32)
}

impl Sim {
    pub(crate) fn new(seed: u64) -> Sim {
        let mut g = Lcg::new(0x5EC0_0000 + seed);
        let n = 1 + g.below(5) as usize;
        let fusion_set = match g.below(3) {
            0 => Some(0),
            1 => Some([8, 16, 24, 48, 64, 100][g.below(6) as usize]),
            _ => None,
        };
        let coalesce = g.below(3) == 0;
        let o = Options::host(n);
        if let Some(f) = fusion_set {
            o.set_fusion_bytes(f);
        }
        if coalesce {
            o.set_sparse_coalesce(true);
        }
        let ctx = Context::new(&o);
        Sim {
            ctx,
            seed,
            g,
            n,
            fusion: fusion_set.unwrap_or(DEFAULT_FUSION),
            fusion_set,
            coalesce,
            tensors: Vec::new(),
            detached: Vec::new(),
            sparse: Vec::new(),
            graveyard: Vec::new(),
            marks: None,
            last_op: None,
            last_step_early: 0,
            bmuf: None,
            log: VecDeque::new(),
            calls: 0,
            last_fail: None,
            trace: std::env::var("DPSYNC_SEQ_TRACE").as_deref() == Ok("1"),
        }
    }

    pub(crate) fn find(&self, name: &str) -> Option<usize> {
        self.tensors.iter().position(|t| t.name == name)
    }

    pub(crate) fn find_sparse(&self, name: &str) -> Option<usize> {
        self.sparse.iter().position(|s| s.name == name)
    }

    pub(crate) fn contents(&self) -> Pred {
        (self.tensors.iter())
            .map(|t| {
                (t.slots.iter())
                    .map(|s| s.as_ref().map(|s| s.buf.clone()))
                    .collect()
            })
            .collect()
    }

    pub(crate) fn unchanged(&self) -> Want {
        Want::Ok(self.contents())
    }

    /// Success with no byte changed, or one of `errs`.
    pub(crate) fn unchanged_unless(&self, errs: Vec<dpsync_status>) -> Want {
        if errs.is_empty() {
            self.unchanged()
        } else {
            Want::Err(errs)
        }
    }

    /// Bytes of memory the library must never write: unregistered tensors and sparse slices.
    pub(crate) fn frozen(&self) -> Vec<Vec<u8>> {
        let mut out = Vec::new();
        for t in &self.detached {
            out.extend(t.slots.iter().flatten().map(|s| s.buf.bytes()));
        }
        for s in &self.sparse {
            for sl in s.slices.iter().flatten() {
                out.push(sl.indices.bytes());
                out.push(sl.values.bytes());
            }
        }
        out
    }

    /// Whether `dpsync_grad_ready` reduced a bucket of this step.
    pub(crate) fn mid_step(&self) -> bool {
        (self.marks.as_ref()).is_some_and(|m| m.reduced.iter().any(|&r| r))
    }

    /// Some name with a role in `mask` on some replica is inconsistent.
    pub(crate) fn inconsistent(&self, mask: u32) -> bool {
        (self.tensors.iter()).any(|t| t.role_bits() & mask != 0 && t.spec().is_none())
    }

    /// Consistent tensors whose role is in `mask`, by model index.
    pub(crate) fn selected(&self, mask: u32) -> Vec<usize> {
        (0..self.tensors.len())
            .filter(|&i| (self.tensors[i].spec()).is_some_and(|(role, _, _)| role & mask != 0))
            .collect()
    }

    pub(crate) fn reduce(&self, t: usize, op: u32) -> Buf {
        let bufs: Vec<&Buf> = (0..self.n).map(|r| self.tensors[t].buf(r)).collect();
        reference_allreduce(&bufs, op)
    }

    pub(crate) fn set_all(pred: &mut Pred, t: usize, b: &Buf) {
        for slot in &mut pred[t] {
            *slot = Some(b.clone());
        }
    }

    /// The plan's fusion buckets as docs/API.md describes them: consistent GRADs last registered
    /// first, packed per dtype into buckets of at most fusion_bytes (an oversized tensor alone,
    /// 0 = one tensor per bucket), in the order of their first tensor.
    pub(crate) fn buckets(&self) -> Vec<BucketM> {
        let mut done: Vec<(usize, BucketM)> = Vec::new();
        let mut open: Vec<(usize, BucketM)> = Vec::new();
        let grads = (self.tensors.iter().rev()).filter_map(|t| match t.spec() {
            Some((GRAD, dtype, count)) => Some((t.name.clone(), dtype, count)),
            _ => None,
        });
        for (pos, (name, dtype, count)) in grads.enumerate() {
            if let Some(i) = open.iter().position(|(_, b)| b.dtype == dtype) {
                if (open[i].1.elements + count) * dtype.size() <= self.fusion {
                    open[i].1.names.push(name);
                    open[i].1.elements += count;
                    continue;
                }
                done.push(open.swap_remove(i));
            }
            let bucket = BucketM {
                dtype,
                names: vec![name],
                elements: count,
            };
            open.push((pos, bucket));
        }
        done.extend(open);
        done.sort_by_key(|(pos, _)| *pos);
        done.into_iter().map(|(_, b)| b).collect()
    }
}
