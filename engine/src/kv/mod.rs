//! Paged KV cache layout and block allocation.
//!
//! KV lives in fixed-size blocks of `block_size` tokens; a sequence's block table maps its
//! logical blocks to physical ones. This module owns the layout description (which also
//! yields the fingerprint two nodes compare before moving KV) and the block table; blocks
//! are handed out by the one block pool ([`pool`]), for the serving engine and the direct
//! runner alike.
//! The storage itself belongs to the backend ([`crate::backend::Backend::KvStorage`]).

use crate::config::ModelConfig;
use crate::error::EngineError;
use crate::weights::DType;

pub mod block_buffers;
pub mod checksum;
pub mod events;
pub mod hash;
pub mod host_buffer;
pub mod host_tier;
pub mod journal;
pub mod placement;
pub mod pool;
pub mod reservation;
pub mod tier;

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
