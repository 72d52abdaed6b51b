//! A lease's KV copied out of and into device memory, batched against one block per call.

use cudarc::driver::CudaSlice;
use pd_engine::executor::Executor;
use pd_engine::kv::handoff::block_buffers::BlockBuffers;
use pd_kernels::CudaBackend;
use serde_json::{Value, json};

use super::{BLOCK, median_ms, timed_ms};

/// A `len`-token lease's KV between device and host memory, as a prefill node copies it out
/// (`read_blocks` into the page-locked buffer `host_buffer` lends: batches of blocks per
/// gather kernel and copy; and the same into heap memory) and a decode node copies it in
/// (`write_blocks`, from the page-locked buffers its imports arrive in, and from heap memory),
/// against the same blocks one call per block (a launch, a copy and, out, a
/// synchronization each): median ms of `reps` and GB/s of each.
pub(crate) fn bench_kv_transfer(
    exec: &mut Executor<CudaBackend>,
    len: usize,
    reps: usize,
) -> Value {
    let blocks: Vec<u32> = (0..len.div_ceil(BLOCK) as u32).collect();
    let block_bytes = exec.block_bytes();
    let bytes = blocks.len() * block_bytes;
    let mut host = vec![0u8; bytes];
    // A call returns once its copies are done (read) or queued (write): each is timed to the
    // device's synchronization.
    let mut lent = exec.host_buffer(bytes);
    let out_batched = median_ms(reps, || {
        exec.read_blocks(&blocks, lent.as_bytes_mut());
        exec.backend().synchronize();
    });
    drop(lent);
    let out_batched_heap = median_ms(reps, || {
        exec.read_blocks(&blocks, &mut host);
        exec.backend().synchronize();
    });
    let out_single = median_ms(reps, || {
        for (&b, dst) in blocks.iter().zip(host.chunks_exact_mut(block_bytes)) {
            exec.read_block(b, dst);
        }
        exec.backend().synchronize();
    });
    let staged: Vec<Vec<u8>> = host.chunks_exact(block_bytes).map(<[u8]>::to_vec).collect();
    let src: Vec<&[u8]> = staged.iter().map(Vec::as_slice).collect();
    let in_batched = median_ms(reps, || {
        exec.write_blocks(&blocks, &src);
        exec.backend().synchronize();
    });
    // As a decode node's import arrives: one buffer per block from the engine's recycled
    // buffers, page-locked ones lent by the backend (`host_allocator`).
    let imports = BlockBuffers::with_allocator(block_bytes, bytes, exec.host_allocator());
    let received: Vec<_> = staged
        .iter()
        .map(|b| {
            let mut buf = imports.take();
            buf.as_bytes_mut().copy_from_slice(b);
            buf
        })
        .collect();
    let received_src: Vec<&[u8]> = received.iter().map(|b| b.as_bytes()).collect();
    let in_batched_pinned = median_ms(reps, || {
        exec.write_blocks(&blocks, &received_src);
        exec.backend().synchronize();
    });
    // The same buffers as a decode node's puller writes them: through the import stream
    // (`block_writer`), from another thread, beside the engine's stream.
    let writer = exec.block_writer().expect("an import writer");
    let in_import_stream = median_ms(reps, || {
        let write = writer();
        std::thread::scope(|s| {
            s.spawn(|| write(&blocks, &received_src));
        });
    });
    drop(received_src);
    drop(received);
    let in_single = median_ms(reps, || {
        for (&b, data) in blocks.iter().zip(&src) {
            exec.write_block(b, data);
        }
        exec.backend().synchronize();
    });
    // The copy alone, device -> host, into pageable and into page-locked memory: the link's
    // speed either way, without the gather kernel.
    let backend = exec.backend();
    let dev = backend.device();
    let device_bytes: CudaSlice<u8> = dev.stream.alloc_zeros(bytes.max(1)).expect("alloc");
    let pageable_ms = timed_ms(backend, reps, || {
        dev.stream
            .memcpy_dtoh(&device_bytes, &mut host[..])
            .expect("copy");
    });
    // SAFETY: written by the copies below before anything reads it. Flags 0: cached memory
    // (the default write-combined memory is slow for the CPU to read, as a lease is read).
    let mut pinned = unsafe { dev.ctx.alloc_pinned_with_flags::<u8>(bytes.max(1), 0) }
        .expect("page-locked host memory");
    let pinned_ms = timed_ms(backend, reps, || {
        dev.stream
            .memcpy_dtoh(&device_bytes, &mut pinned)
            .expect("copy");
    });
    let gb_s = |ms: f64| bytes as f64 / (ms / 1e3) / 1e9;
    json!({
        "dtoh_pageable_gb_s": gb_s(pageable_ms),
        "dtoh_pinned_gb_s": gb_s(pinned_ms),
        "tokens": len,
        "blocks": blocks.len(),
        "bytes": bytes,
        "out_batched_ms": out_batched,
        "out_batched_heap_ms": out_batched_heap,
        "out_batched_heap_gb_s": gb_s(out_batched_heap),
        "out_per_block_ms": out_single,
        "in_batched_ms": in_batched,
        "in_per_block_ms": in_single,
        "out_batched_gb_s": gb_s(out_batched),
        "out_per_block_gb_s": gb_s(out_single),
        "in_batched_gb_s": gb_s(in_batched),
        "in_batched_pinned_ms": in_batched_pinned,
        "in_batched_pinned_gb_s": gb_s(in_batched_pinned),
        "in_import_stream_ms": in_import_stream,
        "in_import_stream_gb_s": gb_s(in_import_stream),
        "in_per_block_gb_s": gb_s(in_single),
    })
}
