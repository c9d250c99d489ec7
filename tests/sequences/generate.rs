//! The random call generator: which operation comes next, and its random arguments (mostly
//! valid, sometimes not).

use crate::common::{abi::*, buf::*};
use crate::model::{Sim, NAMES, ROLES};

/// One kind of random operation.
pub(crate) type Op = fn(&mut Sim);

impl Sim {
    pub(crate) fn chance(&mut self, p: f64) -> bool {
        self.g.unit() < p
    }

    pub(crate) fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[self.g.below(items.len() as u64) as usize]
    }

    pub(crate) fn random_op(&mut self) {
        let weights: [(u32, Op); 21] = [
            (8, Sim::op_register),
            (4, Sim::op_repair),
            (9, Sim::op_register_all),
            (3, Sim::op_complete),
            (4, Sim::op_unregister),
            (2, Sim::op_reattach),
            (10, Sim::op_refill),
            (8, Sim::op_allreduce_grads),
            (5, Sim::op_allreduce),
            (5, Sim::op_broadcast),
            (5, Sim::op_average),
            (5, Sim::op_grad_ready),
            (4, Sim::op_backward),
            (3, Sim::op_bmuf_init),
            (4, Sim::op_bmuf_step),
            (2, Sim::op_sparse_register),
            (2, Sim::op_sparse_register_all),
            (5, Sim::op_sparse_set_all),
            (3, Sim::op_sparse_get),
            (3, Sim::op_describe),
            (3, Sim::op_misc),
        ];
        let total: u32 = weights.iter().map(|w| w.0).sum();
        let mut x = self.g.below(total as u64) as u32;
        for (w, f) in weights {
            if x < w {
                f(self);
                return;
            }
            x -= w;
        }
    }

    /// A name: mostly one the library knows, sometimes a free one, sometimes "".
    pub(crate) fn pick_name(&mut self) -> String {
        let x = self.g.below(100);
        if x < 45 && !self.tensors.is_empty() {
            let i = self.g.below(self.tensors.len() as u64) as usize;
            return self.tensors[i].name.clone();
        }
        if x < 60 && !self.sparse.is_empty() {
            let i = self.g.below(self.sparse.len() as u64) as usize;
            return self.sparse[i].name.clone();
        }
        if x < 63 {
            return String::new();
        }
        self.pick(&NAMES).to_owned()
    }

    /// A name neither a dense tensor nor a sparse gradient has.
    pub(crate) fn free_name(&mut self) -> Option<String> {
        let free: Vec<&str> = (NAMES.iter().copied())
            .filter(|n| self.find(n).is_none() && self.find_sparse(n).is_none())
            .collect();
        if free.is_empty() {
            return None;
        }
        Some(self.pick(&free).to_owned())
    }

    pub(crate) fn pick_replica(&mut self) -> usize {
        if self.chance(0.05) {
            self.n + self.g.below(3) as usize
        } else {
            self.g.below(self.n as u64) as usize
        }
    }

    pub(crate) fn pick_role(&mut self) -> u32 {
        if self.chance(0.04) {
            self.pick(&[0, 3, 16, 0x8000_0000])
        } else {
            self.pick(&ROLES)
        }
    }

    pub(crate) fn pick_dtype(&mut self) -> u32 {
        if self.chance(0.04) {
            self.pick(&[6, 7, 255])
        } else {
            self.pick(&DType::ALL).code()
        }
    }

    pub(crate) fn pick_count(&mut self) -> usize {
        match self.g.below(100) {
            0..=2 => 0,
            3 => usize::MAX / 2 + 1, // byte size overflows
            4..=24 => 13 + self.g.below(50) as usize,
            _ => 1 + self.g.below(12) as usize,
        }
    }

    pub(crate) fn pick_op(&mut self) -> u32 {
        if self.chance(0.05) {
            self.pick(&[2, 3, u32::MAX])
        } else {
            self.pick(&[SUM, AVG])
        }
    }

    pub(crate) fn pick_roles(&mut self) -> u32 {
        if self.chance(0.06) {
            self.pick(&[0, 16, 0x11, 0xFFFF_FFFF])
        } else {
            1 + self.g.below(15) as u32
        }
    }
}
