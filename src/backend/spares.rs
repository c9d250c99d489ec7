//! Idle library memory kept for reuse, the one cache both backends allocate per-step memory
//! from (sparse outputs and their intermediates, coalescing maps). Sizes vary a little from step
//! to step, so fresh memory comes in size classes ([`size_class`](super::size_class)) and a
//! request takes the smallest idle block that holds it without wasting more than half of
//! itself. At most [`MAX_SPARES`] are kept; older ones *retire*, to be freed where freeing cannot
//! block anything that matters (a device backend: in `synchronize`).

/// Memory a [`Spares`] can hold.
pub(crate) trait Block {
    fn bytes(&self) -> usize;
}

/// Blocks kept for reuse at most; the oldest beyond that retire.
pub(crate) const MAX_SPARES: usize = 32;

pub(crate) struct Spares<M> {
    idle: Vec<M>,
    retired: Vec<M>,
}

impl<M> Default for Spares<M> {
    fn default() -> Self {
        Spares {
            idle: Vec::new(),
            retired: Vec::new(),
        }
    }
}

impl<M: Block> Spares<M> {
    /// The smallest idle block for which `usable` holds (the right device, say) that holds
    /// `bytes` without wasting more than half of itself (small requests take anything up to
    /// 64 KiB).
    pub(crate) fn take(&mut self, bytes: usize, usable: impl Fn(&M) -> bool) -> Option<M> {
        let most = bytes.saturating_mul(2).max(64 << 10);
        let i = (self.idle.iter().enumerate())
            .filter(|(_, m)| usable(m) && m.bytes() >= bytes && m.bytes() <= most)
            .min_by_key(|(_, m)| m.bytes())
            .map(|(i, _)| i)?;
        Some(self.idle.remove(i))
    }

    /// Takes blocks nothing uses any more.
    pub(crate) fn put(&mut self, blocks: impl IntoIterator<Item = M>) {
        self.idle.extend(blocks);
        let excess = self.idle.len().saturating_sub(MAX_SPARES);
        self.retired.extend(self.idle.drain(..excess));
    }

    /// Blocks to free later, not worth keeping for reuse.
    pub(crate) fn retire(&mut self, blocks: impl IntoIterator<Item = M>) {
        self.retired.extend(blocks);
    }

    /// The retired blocks, for the caller to free.
    pub(crate) fn take_retired(&mut self) -> Vec<M> {
        std::mem::take(&mut self.retired)
    }

    /// Every idle and retired block for which `mine` holds, for the caller to free (memory ran
    /// out on that device).
    pub(crate) fn release(&mut self, mine: impl Fn(&M) -> bool) -> Vec<M> {
        let mut out = Vec::new();
        for list in [&mut self.idle, &mut self.retired] {
            let (taken, kept): (Vec<M>, Vec<M>) = std::mem::take(list).into_iter().partition(&mine);
            *list = kept;
            out.extend(taken);
        }
        out
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    impl Block for usize {
        fn bytes(&self) -> usize {
            *self
        }
    }

    #[test]
    fn the_smallest_fitting_block_is_taken_and_the_oldest_retire() {
        let mut s = Spares::default();
        s.put([1 << 20, 300 << 10, 200 << 10, 100 << 10]);
        assert_eq!(s.take(150 << 10, |_| true), Some(200 << 10));
        assert_eq!(s.take(400 << 10, |_| true), None, "1 MiB wastes over half");
        assert_eq!(
            s.take(10, |&b| b != 100 << 10),
            None,
            "only 100 KiB is small enough"
        );
        s.put((0..MAX_SPARES).map(|i| 4096 + i));
        assert_eq!(s.take_retired(), vec![1 << 20, 300 << 10, 100 << 10]);
        assert_eq!(s.release(|&b| b < 4100).len(), 4);
    }
}
