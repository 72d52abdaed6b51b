// Paged KV writes and block pack / unpack. The cache of one layer is
// [num_blocks, block_size, num_kv_heads, head_dim] elements of `kv_dtype` (f32, bf16 or f16)
// for K and the same for V; a slot is `block * block_size + offset`, so slot s starts at
// element s * width. Blocks travel between nodes as stored (the layout fingerprint names the
// type), so pack / unpack move bytes and convert nothing.

// kcache[slots[r], :] = k[r, :] and the same for v. One block per row. Slot 0xffffffff marks
// a padding row of a captured decode graph: it has no KV. k and v rows are `k_stride` and
// `v_stride` apart (views of a wider stacked q/k/v product, or `width` when dense).
extern "C" __global__ void write_kv(void* kcache, void* vcache, int kv_dtype, const float* k,
                                    const float* v, int k_stride, int v_stride,
                                    const unsigned int* slots, int rows, int width) {
    const int r = blockIdx.x;
    if (r >= rows || slots[r] == 0xffffffffu) return;
    const unsigned long long dst = (unsigned long long)slots[r] * width;
    const float* kr = k + (unsigned long long)r * k_stride;
    const float* vr = v + (unsigned long long)r * v_stride;
    for (int c = threadIdx.x; c < width; c += blockDim.x) {
        store_kv(kcache, kv_dtype, dst + c, kr[c]);
        store_kv(vcache, kv_dtype, dst + c, vr[c]);
    }
}

// Copy one layer's K (or V) block in 8-byte words: `bytes` is a multiple of 64 (head_dim is
// a multiple of 32, every element 2 or 4 bytes) and every KV and staging buffer is a device
// allocation, aligned far beyond 8 bytes, so both ends are 8-byte aligned.
__device__ __forceinline__ void copy_part(unsigned char* dst, const unsigned char* src,
                                          unsigned long long bytes) {
    unsigned long long* d = (unsigned long long*)dst;
    const unsigned long long* s = (const unsigned long long*)src;
    for (unsigned long long i = threadIdx.x; i < bytes / 8; i += blockDim.x) d[i] = s[i];
}

// Gather blocks `blocks[0..n]` of every layer into `staging`, one after another, each laid
// out layer by layer as [K block, V block] (the order of Backend::read_block), so that one
// copy moves a whole batch of blocks to the host. grid = (num_layers, 2, n): y = 0 for K, 1
// for V, z = which of the blocks. `bases` holds each layer's K and V pointers as
// [k0, v0, k1, v1, ...]; `part_bytes` = the bytes of one layer's K (or V) block.
extern "C" __global__ void pack_blocks(const unsigned long long* bases,
                                       const unsigned int* blocks, unsigned char* staging,
                                       unsigned long long part_bytes) {
    const unsigned layer = blockIdx.x;
    const unsigned which = blockIdx.y;
    const unsigned n = blockIdx.z;
    const unsigned char* src =
        (const unsigned char*)bases[2 * layer + which] + (unsigned long long)blocks[n] * part_bytes;
    unsigned char* dst =
        staging + (((unsigned long long)n * gridDim.x + layer) * 2 + which) * part_bytes;
    copy_part(dst, src, part_bytes);
}

// The inverse of pack_blocks.
extern "C" __global__ void unpack_blocks(const unsigned long long* bases,
                                         const unsigned int* blocks,
                                         const unsigned char* staging,
                                         unsigned long long part_bytes) {
    const unsigned layer = blockIdx.x;
    const unsigned which = blockIdx.y;
    const unsigned n = blockIdx.z;
    unsigned char* dst =
        (unsigned char*)bases[2 * layer + which] + (unsigned long long)blocks[n] * part_bytes;
    const unsigned char* src =
        staging + (((unsigned long long)n * gridDim.x + layer) * 2 + which) * part_bytes;
    copy_part(dst, src, part_bytes);
}
