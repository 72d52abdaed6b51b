//! KV blocks moved between the device and the host in batches (leases, host-tier spills and
//! restores, imports), through the page-locked buffers the backend lends.

use pd_engine::backend::Backend;
use pd_engine::kv::KvLayout;
use pd_engine::kv::handoff::block_buffers::BlockBuffers;
use pd_engine::weights::DType;
use pd_kernels::CudaBackend;

use super::{BLOCK, files};

/// A block's worth of seeded bytes, different for every `seed`.
pub(crate) fn pattern(seed: usize, len: usize) -> Vec<u8> {
    let mut state = 0x9e37_79b9_7f4a_7c15u64 ^ (seed as u64).wrapping_mul(0xd1b5_4a32_d192_ed03);
    (0..len)
        .map(|_| {
            state ^= state << 13;
            state ^= state >> 7;
            state ^= state << 17;
            state as u8
        })
        .collect()
}

/// Leases, host-tier spills and imports move many blocks per call: a batch larger than one
/// staging batch of the Qwen3-0.6B shape (36 blocks in bf16, 18 in f32) lands where it is
/// written and reads back byte for byte in any order, repeats included, and agrees with
/// the one-block calls.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn kv_blocks_move_in_batches_byte_for_byte() {
    let files = files("synthetic:qwen3-0.6b");
    let n = 40;
    for dtype in [DType::BF16, DType::F32] {
        let gpu = CudaBackend::open_with(0, 0.5, Some(dtype)).expect("cuda:0 opens");
        let layout = KvLayout::new(&files.config, BLOCK, dtype).expect("layout");
        let mut kv = gpu.alloc_kv(&layout, n).expect("KV storage");
        let bytes = layout.block_bytes();
        let sources: Vec<Vec<u8>> = (0..n).map(|b| pattern(b, bytes)).collect();
        // Source b goes to block (b * 7) % n: the ids of one batch are not consecutive.
        let ids: Vec<u32> = (0..n).map(|b| ((b * 7) % n) as u32).collect();
        let src: Vec<&[u8]> = sources.iter().map(Vec::as_slice).collect();
        gpu.write_blocks(&mut kv, &ids, &src);

        let order: Vec<usize> = (0..n).rev().chain([3, 3]).collect();
        let read_ids: Vec<u32> = order.iter().map(|&b| ids[b]).collect();
        let mut out = vec![0u8; read_ids.len() * bytes];
        gpu.read_blocks(&kv, &read_ids, &mut out);
        for (i, &b) in order.iter().enumerate() {
            assert!(
                out[i * bytes..(i + 1) * bytes] == sources[b][..],
                "{dtype:?}: block {} (read {i} of the batch) holds what was written to it",
                ids[b]
            );
        }

        let mut one = vec![0u8; bytes];
        gpu.read_block(&kv, ids[5], &mut one);
        assert!(one == sources[5], "{dtype:?}: read_block agrees");
        gpu.write_block(&mut kv, ids[5], &sources[6]);
        gpu.read_blocks(&kv, &[ids[4], ids[5]], &mut out[..2 * bytes]);
        assert!(
            out[..bytes] == sources[4][..] && out[bytes..2 * bytes] == sources[6][..],
            "{dtype:?}: write_block replaced one block and no other"
        );
    }
}

/// A GPU prefill node's lease is copied into page-locked memory lent from a pool
/// (`Backend::host_buffer`): the same bytes as a copy into heap memory, readable and
/// returned from another thread (an exporter's), and lent again to the next lease instead of
/// pinning more.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn leases_land_in_reused_page_locked_buffers() {
    let n = 40;
    let (gpu, mut kv, bytes) = bf16_kv(n);
    let sources: Vec<Vec<u8>> = (0..n).map(|b| pattern(100 + b, bytes)).collect();
    let ids: Vec<u32> = (0..n as u32).collect();
    let src: Vec<&[u8]> = sources.iter().map(Vec::as_slice).collect();
    gpu.write_blocks(&mut kv, &ids, &src);
    let lease: Vec<u32> = (0..n as u32).rev().collect();
    let mut heap = vec![0u8; n * bytes];
    gpu.read_blocks(&kv, &lease, &mut heap);

    assert_eq!(gpu.pinned_usage(), (0, 0), "nothing pinned before a lease");
    let mut buffer = gpu.host_buffer(n * bytes);
    let (lent, _) = gpu.pinned_usage();
    assert!(
        lent >= n * bytes,
        "the lease's buffer is page-locked ({lent} bytes lent)"
    );
    gpu.read_blocks(&kv, &lease, buffer.as_bytes_mut());
    let reader = std::thread::spawn(move || {
        assert!(
            buffer.as_bytes() == &heap[..],
            "the same bytes as into heap memory"
        );
        drop(buffer);
    });
    reader.join().expect("the reader thread");
    assert_eq!(
        gpu.pinned_usage(),
        (0, lent),
        "returned, and kept for the next lease"
    );
    let again = gpu.host_buffer(n * bytes - bytes);
    assert_eq!(
        gpu.pinned_usage(),
        (lent, 0),
        "a slightly shorter lease reuses it"
    );
    drop(again);
}

/// The host tier restores blocks through one page-locked batch buffer (`Backend::host_buffer`),
/// refilled for the next batch as soon as `write_blocks` returns: a copy still reading it
/// then would land the next batch's bytes in this batch's blocks.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn blocks_written_from_a_refilled_page_locked_buffer_keep_their_bytes() {
    let (n, batches) = (36, 3);
    let (gpu, mut kv, bytes) = bf16_kv(n * batches);
    let mut buffer = gpu.host_buffer(n * bytes);
    for batch in 0..batches {
        let buf = buffer.as_bytes_mut();
        for (b, dst) in buf.chunks_exact_mut(bytes).enumerate() {
            dst.copy_from_slice(&pattern(1000 * batch + b, bytes));
        }
        let ids: Vec<u32> = (0..n).map(|b| (batch * n + b) as u32).collect();
        let src: Vec<&[u8]> = buffer.as_bytes().chunks_exact(bytes).collect();
        gpu.write_blocks(&mut kv, &ids, &src);
    }
    // Overwrite the buffer once more, as the tier does for the next restore.
    buffer.as_bytes_mut().fill(0xA5);
    let mut out = vec![0u8; bytes];
    for batch in 0..batches {
        for b in 0..n {
            gpu.read_block(&kv, (batch * n + b) as u32, &mut out);
            assert!(
                out == pattern(1000 * batch + b, bytes),
                "block {b} of batch {batch} holds its own bytes, not a later batch's"
            );
        }
    }
}

/// A GPU decode node receives imported blocks straight into page-locked buffers
/// (`Backend::host_allocator`, through the engine's `BlockBuffers`), lent on the importer's
/// thread, not the engine's: they are page-locked, their blocks land where `write_blocks` puts
/// them, and given back they serve the next import without pinning more.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn imports_arrive_in_page_locked_buffers_lent_on_another_thread() {
    let n = 40;
    let (gpu, mut kv, bytes) = bf16_kv(n);
    let buffers = BlockBuffers::with_allocator(bytes, 1 << 30, gpu.host_allocator());
    let receive = |seed: usize| {
        let buffers = buffers.clone();
        std::thread::spawn(move || {
            (0..n)
                .map(|b| {
                    let mut buf = buffers.take();
                    buf.as_bytes_mut()
                        .copy_from_slice(&pattern(seed + b, bytes));
                    buf
                })
                .collect::<Vec<_>>()
        })
        .join()
        .expect("the importer's thread")
    };
    let mut first_lent = 0;
    for (round, seed) in [(0, 500), (1, 900)] {
        let got = receive(seed);
        let (lent, _) = gpu.pinned_usage();
        assert!(
            lent >= n * bytes,
            "round {round}: import buffers are page-locked ({lent} bytes lent)"
        );
        if round == 0 {
            first_lent = lent;
        } else {
            assert_eq!(lent, first_lent, "round 1 reused round 0's buffers");
        }
        let ids: Vec<u32> = (0..n as u32).rev().collect();
        let src: Vec<&[u8]> = got.iter().map(|b| b.as_bytes()).collect();
        gpu.write_blocks(&mut kv, &ids, &src);
        buffers.give_all(got);
        let mut out = vec![0u8; bytes];
        for (b, &id) in ids.iter().enumerate() {
            gpu.read_block(&kv, id, &mut out);
            assert!(
                out == pattern(seed + b, bytes),
                "round {round}: block {id} holds import buffer {b}"
            );
        }
    }
    assert_eq!(buffers.spare(), n, "all given back and kept");
}

/// cuda:0 with `blocks` blocks of Qwen3-0.6B's KV in bf16, and the bytes of one block.
pub(crate) fn bf16_kv(blocks: usize) -> (CudaBackend, pd_kernels::cuda::CudaKvStorage, usize) {
    let files = files("synthetic:qwen3-0.6b");
    let gpu = CudaBackend::open_with(0, 0.5, Some(DType::BF16)).expect("cuda:0 opens");
    let layout = KvLayout::new(&files.config, BLOCK, DType::BF16).expect("layout");
    let kv = gpu.alloc_kv(&layout, blocks).expect("KV storage");
    (gpu, kv, layout.block_bytes())
}
