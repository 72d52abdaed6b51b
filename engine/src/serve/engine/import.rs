//! KV that arrives with a request (decode role): checked against this node's layout at
//! submit, and placed after the locally cached prefix at first admission, so only the first
//! token is computed here. Also the lookup a decode node makes before pulling: which leading
//! blocks it need not pull.

use std::time::Instant;

use crate::backend::Backend;
use crate::error::ErrorKind;
use crate::kv::handoff::reservation::Landing;
use crate::kv::prefix::hash::BlockHash;
use crate::kv::prefix::tier::TierKind;
use crate::serve::counters::PrefixOutcome;
use crate::serve::external::PerTier;
use crate::serve::request::{EngineRequest, ImportedBlocks, ImportedKv, RequestError, RequestId};

use super::Engine;

/// How imported KV in buffers was placed.
enum Placement {
    /// The sequence's blocks in logical order, and how many of them were cached here.
    Held(Vec<u32>, usize),
    /// The prefix the puller saw cached was evicted since: the imported KV no longer joins
    /// up, so the prompt is computed here instead (nothing counts as external).
    Recompute,
    /// The pool has no room now; the buffers are kept for the next try.
    NoRoom,
}

impl<B: Backend> Engine<B> {
    /// Imported KV must cover the prompt to its end in whole blocks of this node's layout.
    pub(super) fn check_imported(
        &self,
        req: &EngineRequest,
        imp: &ImportedKv,
    ) -> Result<(), RequestError> {
        let invalid = |m: String| RequestError {
            kind: ErrorKind::InvalidArgument,
            message: m,
        };
        let bs = self.block_size();
        let total = req.prompt.len().div_ceil(bs);
        if imp.first_block + imp.blocks.len() != total || imp.first_block * bs >= req.prompt.len() {
            return Err(invalid(format!(
                "imported KV covers blocks {}..{}, the prompt needs blocks ..{total}",
                imp.first_block,
                imp.first_block + imp.blocks.len()
            )));
        }
        match &imp.blocks {
            ImportedBlocks::Buffers(blocks) => {
                let len = self.executor.block_bytes();
                if let Some(b) = blocks.iter().position(|b| b.as_bytes().len() != len) {
                    return Err(invalid(format!(
                        "imported KV block {} has {} bytes; this node's layout needs {len}",
                        imp.first_block + b,
                        blocks[b].as_bytes().len()
                    )));
                }
            }
            ImportedBlocks::Placed(r) => {
                if r.first_block() != imp.first_block
                    || !self.handoff.reservations.contains_key(&r.id())
                {
                    return Err(invalid(format!(
                        "imported KV placed in reservation {:?} (from block {}), which this \
                         engine does not hold for blocks {}..",
                        r.id(),
                        r.first_block(),
                        imp.first_block
                    )));
                }
            }
        }
        let vocab = self.executor.model().config().vocab_size;
        if imp.first_token as usize >= vocab {
            return Err(invalid(format!(
                "first token {} is outside the vocabulary (size {vocab})",
                imp.first_token
            )));
        }
        Ok(())
    }

    /// Leading blocks of `tokens` (with `salt`) this node's device cache holds now: what a
    /// decode node need not pull.
    pub fn cached_prefix_blocks(&self, tokens: &[u32], salt: Option<&str>) -> usize {
        if !self.config.enable_prefix_caching || tokens.is_empty() {
            return 0;
        }
        let bs = self.block_size();
        let hashes =
            crate::kv::prefix::hash::block_hashes_with(tokens, bs, salt, self.config.hash_algo);
        // Never the block holding the last token (a prefill node computes it).
        let usable = (tokens.len() - 1) / bs;
        self.pool.cached_prefix(&hashes[..usable.min(hashes.len())])
    }

    /// First admission of a request that brings its prompt's KV: reuse the local prefix,
    /// place the imported blocks after it, compute only the first token. `None` (nothing
    /// held) if the pool cannot take it now; the imported KV is kept for the next try.
    pub(super) fn admit_imported(
        &mut self,
        id: &RequestId,
        budget: usize,
        now: Instant,
    ) -> Option<Option<usize>> {
        let bs = self.block_size();
        let seq = &self.seqs[id];
        let imp = seq.imported.as_ref()?;
        let prompt_len = seq.prompt_len;
        let full = prompt_len / bs;
        let hashes: Vec<BlockHash> = if self.config.enable_prefix_caching {
            seq.hasher.hashes()[..full].to_vec()
        } else {
            Vec::new()
        };
        let (blocks, local) = match &imp.blocks {
            ImportedBlocks::Placed(r) => {
                let landing = r.landing();
                let held = self.take_placed(id, &hashes)?;
                match landing {
                    Landing::HostInPlace => self.counters.kv_imports_in_place += 1,
                    Landing::DeviceCopy => self.counters.kv_imports_device_copy += 1,
                    Landing::HostCopy => self.counters.kv_imports_host_copy += 1,
                }
                held
            }
            ImportedBlocks::Buffers(_) => match self.place_buffers(id, &hashes) {
                Placement::Held(blocks, local) => {
                    self.counters.kv_imports_buffered += 1;
                    (blocks, local)
                }
                Placement::Recompute => return None,
                Placement::NoRoom => return Some(None),
            },
        };
        let seq = self.seqs.get_mut(id).expect("exists");
        seq.blocks = blocks;
        seq.computed = prompt_len;
        seq.registered = full;
        let n = (seq.tokens.len() - prompt_len).min(budget);
        if !self.grow(id, prompt_len + n) {
            // Keep nothing; the KV is gone, so the next try computes the prompt.
            let seq = self.seqs.get_mut(id).expect("exists");
            let blocks = std::mem::take(&mut seq.blocks);
            seq.computed = 0;
            seq.registered = 0;
            self.free_blocks(&blocks);
            return Some(None);
        }
        let lookup = self.config.enable_prefix_caching;
        let seq = self.seqs.get_mut(id).expect("exists");
        seq.admitted = true;
        seq.first_scheduled = Some(now);
        // What the local lookup left was received from the prefill node: a peer.
        seq.outcome = lookup.then(|| {
            let received = PerTier::only(TierKind::Peer, prompt_len - local * bs);
            PrefixOutcome::new(prompt_len, local * bs, received)
        });
        self.counters.on_admitted(prompt_len, seq.outcome.as_ref());
        Some(Some(n))
    }

    /// The blocks of KV pulled in place: the reservation's cached prefix and the blocks the
    /// pull filled, now the sequence's (the fresh ones join the prefix cache). Returns them
    /// in logical order with the number of cached ones. `None`: the reservation is gone
    /// (cannot happen while the request holds it), and the prompt is computed here.
    fn take_placed(&mut self, id: &RequestId, hashes: &[BlockHash]) -> Option<(Vec<u32>, usize)> {
        let seq = self.seqs.get_mut(id).expect("exists");
        let Some(ImportedKv {
            blocks: ImportedBlocks::Placed(r),
            ..
        }) = seq.imported.take()
        else {
            unreachable!("called for placed imports only");
        };
        let reserved = self.handoff.reservations.remove(&r.admit())?;
        let local = reserved.cached.len();
        for (j, &block) in reserved.fresh.iter().enumerate() {
            if let Some(&hash) = hashes.get(local + j) {
                self.register(block, hash);
            }
        }
        Some(([reserved.cached, reserved.fresh].concat(), local))
    }

    /// Imported KV in buffers: reuse the local prefix and copy the buffers into fresh blocks
    /// after it.
    fn place_buffers(&mut self, id: &RequestId, hashes: &[BlockHash]) -> Placement {
        let seq = &self.seqs[id];
        let total = seq.prompt_len.div_ceil(self.block_size());
        let first_block = seq.imported.as_ref().expect("checked").first_block;
        let local = self.pool.cached_prefix(hashes);
        if local < first_block {
            self.seqs.get_mut(id).expect("exists").imported = None;
            return Placement::Recompute;
        }
        let mut blocks = self
            .pool
            .acquire_cached(&hashes[..local])
            .expect("pool invariant: cached_prefix blocks can be acquired");
        let Some(fresh) = self.allocate(total - local) else {
            self.free_blocks(&blocks);
            return Placement::NoRoom;
        };
        let imp = self
            .seqs
            .get_mut(id)
            .expect("exists")
            .imported
            .take()
            .expect("checked");
        let ImportedBlocks::Buffers(buffers) = imp.blocks else {
            unreachable!("called for imports in buffers only");
        };
        // Buffer `i` holds logical block `first_block + i`; the fresh blocks follow the local
        // prefix. One batched write (a device backend moves many blocks per copy).
        let src: Vec<&[u8]> = buffers[local - imp.first_block..][..fresh.len()]
            .iter()
            .map(|b| b.as_bytes())
            .collect();
        self.executor.write_blocks(&fresh, &src);
        for (j, &block) in fresh.iter().enumerate() {
            if let Some(&hash) = hashes.get(local + j) {
                self.register(block, hash);
            }
        }
        self.handoff.import_buffers.give_all(buffers);
        blocks.extend(fresh);
        Placement::Held(blocks, local)
    }
}
