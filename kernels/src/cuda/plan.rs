//! How a batch's attention is cut into thread blocks (host-side, no GPU needed): which
//! kernel runs it (f32 on CUDA cores, or f16 on tensor cores for the prefill of 16-bit
//! models), work items of up to `rows_per_item` query rows of one sequence, and key splits
//! (split-K) when there are too few items to fill the device — the usual case for decode.
//! The constants mirror `attention.cu`'s and `attention_mma.cu`'s.

use pd_engine::backend::AttentionMeta;

use crate::CudaError;

/// Which kernel computes a step's attention.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum AttentionKernel {
    /// `paged_attention`: f32 arithmetic on CUDA cores, with key splits for long contexts.
    /// Decode steps, and every step of an f32 model.
    CudaCores,
    /// `attention_mma`: f16 operands on tensor cores with f32 accumulation and softmax, no
    /// key splits. Steps of a 16-bit model with a sequence of many new tokens (prefill).
    TensorCores,
}

/// A step of a 16-bit model runs on tensor cores once one sequence has this many new
/// tokens: below it most of each warp's 16 rows would be padding.
pub const TENSOR_CORE_MIN_ROWS: usize = 16;
/// (query row, head) pairs one `attention_mma` block computes (`MMA_PAIRS`).
pub const MMA_PAIRS: usize = 64;
/// Keys per `attention_mma` shared-memory tile (`MMA_TILE`), and the padding of its rows
/// in 16-bit elements (`MMA_PAD`).
pub const MMA_TILE: usize = 64;
const MMA_PAD: usize = 8;

/// The kernel for `meta`'s step; `sixteen_bit` when the model's o_proj input is 16-bit
/// (the attention output is rounded to it anyway, so f16 operands lose nothing that
/// matters; f32 models keep f32 attention).
pub fn choose(meta: &AttentionMeta, sixteen_bit: bool) -> AttentionKernel {
    let prefill = meta.seqs.iter().any(|s| s.q_len >= TENSOR_CORE_MIN_ROWS);
    if sixteen_bit && prefill {
        AttentionKernel::TensorCores
    } else {
        AttentionKernel::CudaCores
    }
}

/// Keys per shared-memory tile (`TILE_KEYS`).
pub const TILE_KEYS: usize = 32;
/// (query row, head) pairs one block computes (`MAX_PAIRS`).
pub const MAX_PAIRS: usize = 16;
/// Largest head dimension the kernel holds in registers (`MAX_HEAD_DIM`).
pub const MAX_HEAD_DIM: usize = 128;
/// Threads per attention block (`ATTN_WARPS * 32`).
pub const THREADS: u32 = 128;
/// The default least number of keys a split takes (`CudaBackend::set_min_keys_per_split`
/// changes it for benchmarks): below it, merging is expected to cost more than it saves.
/// Chosen without a GPU; `gpu_bench` measures decode with graphs at 32, 64, 128 and 256.
pub const MIN_KEYS_PER_SPLIT: usize = 256;
/// At most this many splits per item.
const MAX_SPLITS: usize = 32;

/// The launch shape and the metadata arrays `paged_attention` reads.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct AttentionPlan {
    pub kernel: AttentionKernel,
    /// Per item: sequence index, first query row within the sequence.
    pub items: Vec<i32>,
    /// Per sequence: q_start, q_len, context_len, offset of its block table.
    pub seqs: Vec<i32>,
    /// Every sequence's block table, concatenated.
    pub block_tables: Vec<u32>,
    pub rows_per_item: usize,
    pub splits: usize,
    /// The kernel's `min_keys_per_split`: each item's split ranges are
    /// [`keys_per_split`]`(its keys, splits, this)`.
    pub min_keys_per_split: usize,
}

impl AttentionPlan {
    pub fn num_items(&self) -> usize {
        self.items.len() / 2
    }

    /// Dynamic shared memory of one block: for `paged_attention` the queries and one K and
    /// one V tile in f32, for `attention_mma` one K and one V tile in f16 (padded rows).
    pub fn shared_bytes(kernel: AttentionKernel, head_dim: usize) -> usize {
        match kernel {
            AttentionKernel::CudaCores => {
                4 * (MAX_PAIRS * head_dim + 2 * TILE_KEYS * (head_dim + 1))
            }
            AttentionKernel::TensorCores => 2 * 2 * MMA_TILE * (head_dim + MMA_PAD),
        }
    }
}

/// Check that the kernel supports this head dimension (called at KV allocation).
pub fn check_head_dim(head_dim: usize) -> Result<(), CudaError> {
    if head_dim == 0 || !head_dim.is_multiple_of(32) || head_dim > MAX_HEAD_DIM {
        return Err(CudaError::Unsupported(format!(
            "head_dim {head_dim} (it takes multiples of 32 up to {MAX_HEAD_DIM})"
        )));
    }
    Ok(())
}

/// Check that a GQA group fits one attention block.
pub fn check_group(num_heads: usize, num_kv_heads: usize) -> Result<(), CudaError> {
    if num_kv_heads == 0
        || !num_heads.is_multiple_of(num_kv_heads)
        || num_heads / num_kv_heads > MAX_PAIRS
    {
        return Err(CudaError::Unsupported(format!(
            "{num_heads} query heads over {num_kv_heads} KV heads (groups of at most {MAX_PAIRS})"
        )));
    }
    Ok(())
}

/// Key splits happen only below this many blocks (items x KV heads): 2 per multiprocessor.
/// Also the number of split-K counters the backend keeps (one per such block).
pub fn max_split_blocks(num_sms: usize) -> usize {
    2 * num_sms.max(1)
}

/// Keys each split of an item covers (`paged_attention`'s rule): the item's `keys` (causal:
/// up to its last row) spread evenly, in whole tiles, over as many of the launch's `splits`
/// as they hold `min` keys (at least one split). For the launch's longest item that is the
/// plan's own division; a shorter item uses as many splits as its own length asks, so a
/// decode graph's launch, shaped for the longest context the graph may see, does not leave
/// a short context in one long split.
pub fn keys_per_split(keys: usize, splits: usize, min: usize) -> usize {
    let used = splits.min(keys.div_ceil(min.max(1))).max(1);
    keys.div_ceil(used).div_ceil(TILE_KEYS).max(1) * TILE_KEYS
}

/// Plan `meta` for `kernel` on a device with `num_sms` multiprocessors.
pub fn plan(meta: &AttentionMeta, kernel: AttentionKernel, num_sms: usize) -> AttentionPlan {
    plan_with(meta, kernel, num_sms, MIN_KEYS_PER_SPLIT)
}

/// [`plan`] with splits of at least `min_keys_per_split` keys (not 0).
pub fn plan_with(
    meta: &AttentionMeta,
    kernel: AttentionKernel,
    num_sms: usize,
    min_keys_per_split: usize,
) -> AttentionPlan {
    let min_keys_per_split = min_keys_per_split.max(1);
    let group = meta.num_heads / meta.num_kv_heads;
    let pairs = match kernel {
        AttentionKernel::CudaCores => MAX_PAIRS,
        AttentionKernel::TensorCores => MMA_PAIRS,
    };
    let rows_per_item = (pairs / group).max(1);
    let mut items = Vec::new();
    let mut seqs = Vec::with_capacity(meta.seqs.len() * 4);
    let mut block_tables = Vec::new();
    let mut max_keys = 0;
    for (s, seq) in meta.seqs.iter().enumerate() {
        seqs.extend([
            seq.q_start as i32,
            seq.q_len as i32,
            seq.context_len as i32,
            block_tables.len() as i32,
        ]);
        block_tables.extend_from_slice(&seq.block_table);
        // Later rows see more keys: tensor-core items go latest first, so the longest
        // blocks start first and the shortest fill the tail.
        let starts = (0..seq.q_len).step_by(rows_per_item);
        let starts: Vec<usize> = match kernel {
            AttentionKernel::CudaCores => starts.collect(),
            AttentionKernel::TensorCores => starts.rev().collect(),
        };
        for r0 in starts {
            items.extend([s as i32, r0 as i32]);
        }
        max_keys = max_keys.max(seq.context_len);
    }
    let blocks = items.len() / 2 * meta.num_kv_heads;
    let target = max_split_blocks(num_sms);
    let mut splits = 1;
    if kernel == AttentionKernel::CudaCores
        && blocks > 0
        && blocks < target
        && max_keys > min_keys_per_split
    {
        splits = target
            .div_ceil(blocks)
            .min(max_keys.div_ceil(min_keys_per_split))
            .min(MAX_SPLITS);
    }
    // No split of the longest item left empty.
    let splits = max_keys
        .div_ceil(keys_per_split(max_keys, splits, min_keys_per_split))
        .max(1);
    AttentionPlan {
        kernel,
        items,
        seqs,
        block_tables,
        rows_per_item,
        splits,
        min_keys_per_split,
    }
}

#[cfg(test)]
mod tests {
    use pd_engine::backend::SeqAttention;

    use super::*;

    fn meta(seqs: Vec<SeqAttention>) -> AttentionMeta {
        AttentionMeta {
            seqs,
            num_heads: 32,
            num_kv_heads: 8,
            head_dim: 128,
            scale: 128f32.powf(-0.5),
        }
    }

    fn seq(q_start: usize, q_len: usize, context_len: usize) -> SeqAttention {
        SeqAttention {
            q_start,
            q_len,
            context_len,
            block_table: (0..context_len.div_ceil(16) as u32).collect(),
        }
    }

    #[test]
    fn prefill_is_cut_into_items_of_whole_groups_without_splits() {
        let p = plan(
            &meta(vec![seq(0, 2048, 2048)]),
            AttentionKernel::CudaCores,
            132,
        );
        assert_eq!(p.rows_per_item, 4, "16 pairs over groups of 4 heads");
        assert_eq!(p.num_items(), 512);
        assert_eq!(p.splits, 1, "4096 blocks fill the device");
        assert_eq!(&p.items[..4], &[0, 0, 0, 4]);
    }

    #[test]
    fn long_decode_is_split_and_splits_cover_every_key() {
        let p = plan(
            &meta(vec![seq(0, 1, 8192)]),
            AttentionKernel::CudaCores,
            132,
        );
        assert!(p.splits > 1);
        let kps = keys_per_split(8192, p.splits, p.min_keys_per_split);
        assert!(p.splits * kps >= 8192);
        assert!((p.splits - 1) * kps < 8192, "no split is empty");
        assert_eq!(kps % TILE_KEYS, 0);
    }

    #[test]
    fn each_item_spreads_its_own_keys_over_the_splits() {
        // A launch of 32 splits (a decode graph's, shaped for 40,960 keys): a 512-key context
        // takes two splits of 256 keys, not one of 1,280; a 40,000-key one all 32.
        let min = MIN_KEYS_PER_SPLIT;
        assert_eq!(keys_per_split(40_960, 32, min), 1280);
        assert_eq!(keys_per_split(512, 32, min), 256);
        assert_eq!(512usize.div_ceil(keys_per_split(512, 32, min)), 2);
        assert_eq!(40_000usize.div_ceil(keys_per_split(40_000, 32, min)), 32);
        // Evenly: 300 keys over 2 splits are 160 + 140, not 256 + 44.
        assert_eq!(keys_per_split(300, 2, min), 160);
        assert_eq!(keys_per_split(300, 32, min), 160);
        // Whole tiles, at least one.
        assert_eq!(keys_per_split(100, 8, 1), TILE_KEYS);
        assert_eq!(keys_per_split(1, 1, min), TILE_KEYS);
        assert_eq!(keys_per_split(33, 1, min), 2 * TILE_KEYS);
        // Every key of every length is covered by the launch's splits.
        for splits in [1, 2, 7, 32] {
            for keys in [1, 31, 32, 255, 256, 257, 1000, 40_960] {
                assert!(splits * keys_per_split(keys, splits, min) >= keys);
            }
        }
    }

    #[test]
    fn short_decode_batches_are_not_split() {
        let seqs = (0..8).map(|i| seq(i, 1, 100)).collect();
        let p = plan(&meta(seqs), AttentionKernel::CudaCores, 132);
        assert_eq!(p.splits, 1);
        assert_eq!(p.num_items(), 8);
        assert_eq!(
            p.seqs[4..8],
            [1, 1, 100, 7],
            "second sequence: row 1, table at 7"
        );
    }

    #[test]
    fn prefill_of_sixteen_bit_models_runs_on_tensor_cores() {
        use AttentionKernel::*;
        let decode = meta((0..8).map(|i| seq(i, 1, 4000)).collect());
        let short_chunk = meta(vec![seq(0, 15, 100), seq(15, 1, 50)]);
        let prefill = meta(vec![seq(0, 1, 50), seq(1, 16, 16)]);
        assert_eq!(choose(&decode, true), CudaCores);
        assert_eq!(choose(&short_chunk, true), CudaCores);
        assert_eq!(
            choose(&prefill, true),
            TensorCores,
            "one prefill in a mixed batch"
        );
        assert_eq!(
            choose(&prefill, false),
            CudaCores,
            "f32 models keep f32 attention"
        );
    }

    #[test]
    fn tensor_core_items_hold_64_pairs_latest_rows_first_without_splits() {
        // One long prompt on a device far larger than its 8 items x 8 KV heads.
        let p = plan(
            &meta(vec![seq(0, 100, 8000)]),
            AttentionKernel::TensorCores,
            132,
        );
        assert_eq!(p.rows_per_item, 16, "64 pairs over groups of 4 heads");
        assert_eq!(p.items, [0, 96, 0, 80, 0, 64, 0, 48, 0, 32, 0, 16, 0, 0]);
        assert_eq!(p.splits, 1, "attention_mma has no key splits");
        let bytes = AttentionPlan::shared_bytes(p.kernel, 128);
        assert_eq!(bytes, 2 * 2 * 64 * 136);
        assert!(bytes <= 48 * 1024, "no opt-in to more shared memory");
    }

    #[test]
    fn unsupported_heads_are_refused() {
        assert!(check_head_dim(128).is_ok());
        assert!(check_head_dim(32).is_ok());
        assert!(check_head_dim(256).is_err());
        assert!(check_head_dim(80).is_err());
        assert!(check_group(32, 8).is_ok());
        assert!(check_group(64, 2).is_err());
        assert!(check_group(6, 4).is_err());
    }
}
