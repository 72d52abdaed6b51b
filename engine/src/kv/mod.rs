//! The paged KV cache. The map, one concept per folder (each `mod.rs` says what it owns):
//!
//! - layout (this file): [`KvLayout`] (block shape and stored type), [`BlockTable`];
//! - [`pool`] (`kv/pool/`): the one block allocator: reference counts, LRU free lists;
//! - [`prefix`] (`kv/prefix/`): the prefix cache: block hashes, device and host tiers, events;
//! - [`handoff`] (`kv/handoff/`): KV between nodes: leases, checksums, reservations, buffers.
//!
//! Not here: the KV storage (the backend's, [`crate::backend::Backend::KvStorage`]), the
//! scheduling and accounting around these pieces ([`crate::serve`]), the wire (pd-transport).

use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::weights::DType;

pub mod handoff;
pub mod pool;
pub mod prefix;

pub const DEFAULT_BLOCK_SIZE: usize = 16;

/// Shape and element type of the KV cache: everything that must match for KV to be
/// reusable elsewhere. A block travels between nodes in this type, as stored.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct KvLayout {
    pub num_layers: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    /// How one K or V value is stored (and sent).
    pub dtype: DType,
}

impl KvLayout {
    pub fn new(config: &ModelConfig, block_size: usize, dtype: DType) -> Result<Self, EngineError> {
        if block_size == 0 || block_size > 1024 || !block_size.is_power_of_two() {
            return Err(EngineError::InvalidRequest(format!(
                "block size {block_size} must be a power of two between 1 and 1024"
            )));
        }
        Ok(Self {
            num_layers: config.num_hidden_layers,
            num_kv_heads: config.num_key_value_heads,
            head_dim: config.head_dim,
            block_size,
            dtype,
        })
    }

    /// Values of K (or of V) for one token in one layer.
    pub fn token_width(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Bytes of K and V for one block across all layers, in [`KvLayout::dtype`]: what one
    /// block takes in KV memory and on the wire.
    pub fn block_bytes(&self) -> usize {
        2 * self.num_layers * self.block_size * self.token_width() * self.dtype.size_in_bytes()
    }

    /// Blocks needed to hold `tokens` tokens.
    pub fn blocks_for(&self, tokens: usize) -> usize {
        tokens.div_ceil(self.block_size)
    }
}

/// The physical blocks of one sequence, in logical order.
#[derive(Debug, Default, Clone, PartialEq, Eq)]
pub struct BlockTable {
    pub blocks: Vec<u32>,
}
