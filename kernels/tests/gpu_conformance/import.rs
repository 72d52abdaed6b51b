//! Imports written into device KV from the puller's thread (`Backend::block_writer`): on
//! their own stream, after the work the engine had queued when it reserved the blocks, into
//! those blocks only, and safely even once the engine has dropped its KV storage.

use pd_engine::backend::Backend;
use pd_kernels::cuda::CudaTensor;

use super::blocks::{bf16_kv, pattern};

/// The engine queues kernels that write block 5 (a request that ended while they were
/// still running, say), then reserves block 5 for an import; the import, copied in from
/// another thread, lands after them, not under them, and touches no other block.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn an_import_written_from_another_thread_lands_after_the_engines_queued_work() {
    let n = 12;
    let (gpu, mut kv, bytes) = bf16_kv(n);
    let before: Vec<Vec<u8>> = (0..n).map(|b| pattern(2000 + b, bytes)).collect();
    let ids: Vec<u32> = (0..n as u32).collect();
    let src: Vec<&[u8]> = before.iter().map(Vec::as_slice).collect();
    gpu.write_blocks(&mut kv, &ids, &src);

    // Every layer's K and V of block 5's 16 slots, eight times over: hundreds of launches
    // still queued when the import starts.
    let (block, tokens, width) = (5u32, kv.layout.block_size, kv.layout.token_width());
    let ones = vec![1.0f32; tokens * width];
    let upload = || {
        let data = gpu.device().stream.clone_htod(&ones).expect("upload");
        CudaTensor::new(tokens, width, data)
    };
    let (k, v) = (upload(), upload());
    let slots: Vec<u32> = (0..tokens as u32)
        .map(|t| block * tokens as u32 + t)
        .collect();
    let writer = gpu.block_writer(&kv).expect("an import writer");
    for _ in 0..8 {
        for layer in 0..kv.layout.num_layers {
            gpu.write_kv(&mut kv, layer, &k, &v, &slots);
        }
    }
    let write = writer();
    let import = pattern(3000, bytes);
    let imported = import.clone();
    std::thread::spawn(move || write(&[block], &[&imported]))
        .join()
        .expect("the puller's thread");

    gpu.synchronize();
    let mut out = vec![0u8; bytes];
    gpu.read_block(&kv, block, &mut out);
    assert!(
        out == import,
        "block {block} holds the import, not the queued writes"
    );
    for b in (0..n as u32).filter(|&b| b != block) {
        gpu.read_block(&kv, b, &mut out);
        assert!(out == before[b as usize], "block {b} untouched");
    }
}

/// A write made before the engine dropped its KV storage (the node shutting down while a
/// pull finishes) still writes the storage it was made for, kept allocated, not whatever
/// the device lent that memory to next: here a new KV storage, which stays zero.
#[test]
#[ignore = "needs a CUDA device: scripts/gpu-check.sh (or pd-cuda-emu, scripts/cuda-check.sh) runs it"]
fn an_import_writer_keeps_kv_storage_alive_after_the_engine_drops_it() {
    let n = 4;
    let (gpu, kv, bytes) = bf16_kv(n);
    let write = gpu.block_writer(&kv).expect("an import writer")();
    let layout = kv.layout.clone();
    drop(kv);
    gpu.synchronize();
    let next = gpu.alloc_kv(&layout, n).expect("KV storage again");
    let import = pattern(4000, bytes);
    std::thread::spawn(move || write(&[3, 0], &[&import, &import]))
        .join()
        .expect("the write runs to its end");
    gpu.synchronize();
    let mut out = vec![0u8; bytes];
    for b in 0..n as u32 {
        gpu.read_block(&next, b, &mut out);
        assert!(
            out.iter().all(|&x| x == 0),
            "block {b} of the new storage is untouched"
        );
    }
}
