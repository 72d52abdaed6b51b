//! Block bookkeeping of the engine's sequences: growing a sequence's block table,
//! allocation (spilling evicted cached blocks to the host tier), freeing, registration in
//! the prefix cache, and preemption. The pool itself is [`crate::kv::pool`].

use crate::backend::Backend;
use crate::executor::Executor;
use crate::kv::handoff::host_buffer::HostBuffer;
use crate::kv::prefix::hash::BlockHash;
use crate::kv::prefix::tier::ExternalTier;
use crate::serve::request::RequestId;

use super::Engine;

/// Most bytes of blocks moved between the host tier and the backend per call: enough for a
/// device backend to move many blocks per copy, a bounded buffer on the host.
const HOST_BATCH_BYTES: usize = 16 << 20;

/// Blocks per host-tier batch, at least one.
fn host_batch_blocks(block_bytes: usize) -> usize {
    (HOST_BATCH_BYTES / block_bytes.max(1)).max(1)
}

/// The engine's host-tier batch buffer (one batch of blocks), lent by the backend on first
/// use and kept.
fn batch_buffer<'a, B: Backend>(
    buf: &'a mut Option<HostBuffer>,
    executor: &Executor<B>,
    block_bytes: usize,
) -> &'a mut [u8] {
    buf.get_or_insert_with(|| executor.host_buffer(host_batch_blocks(block_bytes) * block_bytes))
        .as_bytes_mut()
}

impl<B: Backend> Engine<B> {
    /// Make `id`'s blocks cover `tokens` tokens. False (nothing allocated) if the pool is
    /// short.
    pub(super) fn grow(&mut self, id: &RequestId, tokens: usize) -> bool {
        let bs = self.block_size();
        let have = self.seqs[id].blocks.len();
        let need = tokens.div_ceil(bs).saturating_sub(have);
        if need == 0 {
            return true;
        }
        match self.allocate(need) {
            Some(blocks) => {
                self.seqs.get_mut(id).expect("exists").blocks.extend(blocks);
                true
            }
            None => false,
        }
    }

    /// Allocate blocks, spilling evicted cached blocks to the host tier first.
    pub(super) fn allocate(&mut self, n: usize) -> Option<Vec<u32>> {
        let alloc = self.pool.allocate(n).ok()?;
        if self.config.host_cache_blocks > 0 && !alloc.evicted.is_empty() {
            let block_bytes = self.executor.block_bytes();
            let buf = batch_buffer(&mut self.block_buf, &self.executor, block_bytes);
            for batch in alloc.evicted.chunks(host_batch_blocks(block_bytes)) {
                let ids: Vec<u32> = batch.iter().map(|&(block, _)| block).collect();
                let buf = &mut buf[..ids.len() * block_bytes];
                self.executor.read_blocks(&ids, buf);
                for (&(_, hash), data) in batch.iter().zip(buf.chunks_exact(block_bytes)) {
                    self.host.offer(hash, data);
                }
            }
        }
        Some(alloc.blocks)
    }

    /// Copies the host tier's blocks of `hashes` into the blocks `fresh` (one each) and
    /// registers them, up to the first the tier no longer has; how many were restored.
    pub(super) fn restore_from_host(&mut self, hashes: &[BlockHash], fresh: &[u32]) -> usize {
        let block_bytes = self.executor.block_bytes();
        let restored = restore_in_batches(
            hashes,
            fresh,
            block_bytes,
            host_batch_blocks(block_bytes),
            batch_buffer(&mut self.block_buf, &self.executor, block_bytes),
            |hash, dst| self.host.fetch(hash, dst).is_ok(),
            |blocks, src| self.executor.write_blocks(blocks, src),
        );
        for (&block, &hash) in fresh[..restored].iter().zip(hashes) {
            self.register(block, hash);
        }
        restored
    }

    /// Free a sequence's blocks, given in logical order (the pool releases them tail first).
    pub(super) fn free_blocks(&mut self, blocks: &[u32]) {
        self.pool
            .free(blocks)
            .expect("pool invariant: the engine frees only blocks it holds");
    }

    pub(super) fn register(&mut self, block: u32, hash: BlockHash) {
        self.pool
            .register(block, hash)
            .expect("pool invariant: the engine registers only blocks it holds");
    }

    /// Put a running sequence back in front of the queue, its blocks freed (their content
    /// stays in the prefix cache where registered).
    pub(super) fn preempt(&mut self, id: &RequestId) {
        let seq = self.seqs.get_mut(id).expect("exists");
        let blocks = std::mem::take(&mut seq.blocks);
        seq.computed = 0;
        seq.registered = 0;
        self.free_blocks(&blocks);
        self.counters.preemptions += 1;
        self.waiting.push_front(id.clone());
    }
}

/// [`Engine::restore_from_host`]'s copying: `fetch` each of `hashes` into `buf`, `per_batch`
/// at a time (`buf` holds at least one batch), and `write` each batch into its `fresh` blocks,
/// stopping at the first block `fetch` cannot give; how many were written.
fn restore_in_batches(
    hashes: &[BlockHash],
    fresh: &[u32],
    block_bytes: usize,
    per_batch: usize,
    buf: &mut [u8],
    mut fetch: impl FnMut(BlockHash, &mut [u8]) -> bool,
    mut write: impl FnMut(&[u32], &[&[u8]]),
) -> usize {
    let mut restored = 0;
    for (hashes, blocks) in hashes.chunks(per_batch).zip(fresh.chunks(per_batch)) {
        let buf = &mut buf[..hashes.len() * block_bytes];
        let mut fetched = 0;
        for (&hash, dst) in hashes.iter().zip(buf.chunks_exact_mut(block_bytes)) {
            if !fetch(hash, dst) {
                break;
            }
            fetched += 1;
        }
        let src: Vec<&[u8]> = buf.chunks_exact(block_bytes).take(fetched).collect();
        write(&blocks[..fetched], &src);
        restored += fetched;
        if fetched < hashes.len() {
            break;
        }
    }
    restored
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn restores_in_batches_up_to_the_first_missing_block() {
        let hashes: Vec<BlockHash> = (0u128..7).map(BlockHash).collect();
        let fresh: Vec<u32> = (100..107).collect();
        let mut buf = vec![0; 2 * 3];
        let mut written: Vec<(Vec<u32>, Vec<Vec<u8>>)> = Vec::new();
        // The tier has blocks 0..5 (each filled with its hash), not 5 and 6.
        let restored = restore_in_batches(
            &hashes,
            &fresh,
            3,
            2,
            &mut buf,
            |hash, dst| {
                dst.fill(hash.0 as u8);
                hash.0 < 5
            },
            |blocks, src| written.push((blocks.to_vec(), src.iter().map(|s| s.to_vec()).collect())),
        );
        assert_eq!(restored, 5);
        assert_eq!(
            written,
            vec![
                (vec![100, 101], vec![vec![0; 3], vec![1; 3]]),
                (vec![102, 103], vec![vec![2; 3], vec![3; 3]]),
                (vec![104], vec![vec![4; 3]]),
            ],
            "each batch into its own fresh blocks, none past the missing one"
        );
    }
}
