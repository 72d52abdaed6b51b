//! What the transport's integration tests share (each test file is a crate of its own, with
//! `mod support;`).

use std::sync::Arc;

use pd_engine::serve::{LeaseSecret, LeasedKv};
use pd_transport::{KvSource, SharedBlocks};

/// A KV source that holds one lease of blocks in memory and lends them shared, not copied, to
/// a pull that names the lease (and proves its secret, where it has one).
pub struct OneLease {
    id: u64,
    secret: Option<LeaseSecret>,
    kv: Arc<LeasedKv>,
}

impl OneLease {
    /// Lease `id` of `blocks`; with `secret`, only a pull that proves it is served.
    pub fn new(id: u64, secret: Option<LeaseSecret>, blocks: Vec<Vec<u8>>) -> Arc<Self> {
        Arc::new(Self {
            id,
            secret,
            kv: Arc::new(LeasedKv::new(blocks)),
        })
    }
}

impl KvSource for OneLease {
    fn read_blocks(
        &self,
        lease_id: u64,
        secret: &LeaseSecret,
        first: usize,
        count: usize,
    ) -> Option<SharedBlocks> {
        let proven = self.secret.as_ref().is_none_or(|s| secret.matches(s));
        (lease_id == self.id && proven)
            .then(|| SharedBlocks::new(Arc::clone(&self.kv), first, count))
            .flatten()
    }
}
