//! The KV handoff between nodes, on the engine's side: what a prefill node lends and what a
//! decode node sets aside to receive.
//!
//! - Export: [`lease_store`] (leased blocks, readable without the engine thread),
//!   [`lease_secret`] (what makes a lease a capability), [`checksum`] (each block's
//!   integrity checksum, computed once when the lease is made).
//! - Import: [`reservation`] (blocks set aside for one pull; written from the puller's thread
//!   on a GPU), [`placement`] (host KV memory a pull fills in place).
//! - Memory: [`host_buffer`] (host memory blocks are copied into), [`block_buffers`]
//!   (recycled buffers for blocks that arrive).
//!
//! Not here: the wire and the transfers (pd-transport), the decision what to lease or pull
//! and the block bookkeeping (`crate::serve`, [`crate::kv::pool`]).

pub mod block_buffers;
pub mod checksum;
pub mod host_buffer;
pub mod lease_secret;
pub mod lease_store;
pub mod placement;
pub mod reservation;
