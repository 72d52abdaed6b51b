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

// Gather block `block` of every layer into `staging`, laid out layer by layer as
// [K block, V block] (the order of Backend::read_block), so one copy moves it to the host.
// grid = (num_layers, 2): y = 0 for K, 1 for V. `bases` holds each layer's K and V pointers
// as [k0, v0, k1, v1, ...]. `halves` = the bytes of one layer's K (or V) block / 2: every
// element is 2 or 4 bytes and every buffer is at least 2-byte aligned, so the copy moves
// 16-bit units.
extern "C" __global__ void pack_block(const unsigned long long* bases, unsigned int block,
                                      unsigned short* staging, int halves) {
    const int layer = blockIdx.x;
    const int which = blockIdx.y;
    const unsigned short* src =
        (const unsigned short*)bases[2 * layer + which] + (unsigned long long)block * halves;
    unsigned short* dst = staging + ((unsigned long long)2 * layer + which) * halves;
    for (int i = threadIdx.x; i < halves; i += blockDim.x) dst[i] = src[i];
}

// The inverse of pack_block.
extern "C" __global__ void unpack_block(const unsigned long long* bases, unsigned int block,
                                        const unsigned short* staging, int halves) {
    const int layer = blockIdx.x;
    const int which = blockIdx.y;
    unsigned short* dst =
        (unsigned short*)bases[2 * layer + which] + (unsigned long long)block * halves;
    const unsigned short* src = staging + ((unsigned long long)2 * layer + which) * halves;
    for (int i = threadIdx.x; i < halves; i += blockDim.x) dst[i] = src[i];
}
