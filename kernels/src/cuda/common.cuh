// Shared helpers of every kernel source. Prepended to each .cu file before NVRTC compiles it
// (see kernels/src/cuda/modules.rs), so the sources need no include path and no CUDA headers:
// bf16 / f16 are handled as raw 16-bit patterns and converted with bit operations or PTX.

// Weight dtypes, as the Rust side numbers them (pd_kernels::cuda::tensor::dtype_code).
#define DTYPE_F32 0
#define DTYPE_F16 1
#define DTYPE_BF16 2

#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif

#define WARP 32
#define FULL_MASK 0xffffffffu

__device__ __forceinline__ float bf16_to_f32(unsigned short v) {
    return __uint_as_float(((unsigned int)v) << 16);
}

// Round to nearest even, as torch and the `half` crate do; NaN stays a (quiet) NaN.
__device__ __forceinline__ unsigned short f32_to_bf16(float f) {
    unsigned int u = __float_as_uint(f);
    if ((u & 0x7fffffffu) > 0x7f800000u) {
        return (unsigned short)((u >> 16) | 0x40u);
    }
    u += 0x7fffu + ((u >> 16) & 1u);
    return (unsigned short)(u >> 16);
}

// PD_CUDA_EMU: the CPU emulation used by CI (kernels/emu/), which has no PTX.
__device__ __forceinline__ float f16_to_f32(unsigned short v) {
#ifdef PD_CUDA_EMU
    return emu::f16_to_f32(v);
#else
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(v));
    return f;
#endif
}

__device__ __forceinline__ unsigned short f32_to_f16(float f) {
#ifdef PD_CUDA_EMU
    return emu::f32_to_f16(f);
#else
    unsigned short h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
#endif
}

// A GEMM input element in the weight's 16-bit type, rounded as cast_bf16 / cast_f16 round.
__device__ __forceinline__ unsigned short to_16(float v, int dtype) {
    return dtype == DTYPE_BF16 ? f32_to_bf16(v) : f32_to_f16(v);
}

// SiLU(g) · u, as silu_mul, silu_mul_16 and the gate/up GEMV's epilogue compute it.
__device__ __forceinline__ float silu_times(float g, float u) { return g / (1.0f + expf(-g)) * u; }

// Element `i` of a weight stored as `dtype`.
__device__ __forceinline__ float load_weight(const void* w, int dtype, unsigned long long i) {
    if (dtype == DTYPE_BF16) {
        return bf16_to_f32(((const unsigned short*)w)[i]);
    } else if (dtype == DTYPE_F16) {
        return f16_to_f32(((const unsigned short*)w)[i]);
    }
    return ((const float*)w)[i];
}

// Programmatic dependent launch (sm_90 and later; elsewhere, and on pd-cuda-emu, nothing):
// a kernel launched with the programmatic-stream-serialization attribute may start before
// the kernel ahead of it in the stream has finished, once every block of that one has called
// allow_dependents_to_launch (or exited); it must call wait_for_inputs before it reads what
// an earlier kernel writes, or writes anything. Kernels launched without it, and kernels with
// no dependent launched so, are unaffected by either (gemv.cu, pdl.rs).
__device__ __forceinline__ void allow_dependents_to_launch() {
#if !defined(PD_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.launch_dependents;");
#endif
}

__device__ __forceinline__ void wait_for_inputs() {
#if !defined(PD_CUDA_EMU) && defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
#endif
}

__device__ __forceinline__ float warp_sum(float v) {
    #pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) {
        v += __shfl_xor_sync(FULL_MASK, v, o);
    }
    return v;
}

__device__ __forceinline__ float warp_max(float v) {
    #pragma unroll
    for (int o = WARP / 2; o > 0; o /= 2) {
        v = fmaxf(v, __shfl_xor_sync(FULL_MASK, v, o));
    }
    return v;
}

// Sum over a block of up to 1024 threads (blockDim.x a multiple of 32). `scratch` holds 32
// floats of shared memory. Every thread gets the total.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    const int warps = blockDim.x / WARP;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < warps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}

// 1 / sqrt(mean(xs^2) + eps) over `group` values, for every thread of the block: the RMSNorm
// scale of rms_norm / rms_norm_16 (elementwise.cu) and of the norm-fused GEMVs (gemv.cu),
// one function so that they compute the same bits.
__device__ __forceinline__ float rms_inv(const float* xs, int group, float eps, float* scratch) {
    float ss = 0.0f;
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        ss += xs[i] * xs[i];
    }
    ss = block_sum(ss, scratch);
    return 1.0f / sqrtf(ss / (float)group + eps);
}

// Tensor cores: d += a · b for one warp, PTX mma.m16n8k16 with f16 A (16 x 16, row-major) and
// B (16 x 8, column-major) and f32 C / D (16 x 8), each lane holding its fragment registers
// in the layout the PTX ISA specifies (sm_80 and later). Every lane of the warp must call it.
__device__ __forceinline__ void mma_16816_f16(float* d, const unsigned* a, const unsigned* b) {
#ifdef PD_CUDA_EMU
    emu::mma_m16n8k16_f16(d, a, b);
#else
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
#endif
}

// An f16 mma operand: saturated to ±65504 rather than rounded to infinity (NaN stays NaN).
__device__ __forceinline__ unsigned short f16_operand(float v) {
    if (v == v) v = fminf(fmaxf(v, -65504.0f), 65504.0f);
    return f32_to_f16(v);
}

// Two f16 operands in one register, `lo` in the low half (the lower column / row index).
__device__ __forceinline__ unsigned pack_f16(float lo, float hi) {
    return (unsigned)f16_operand(lo) | ((unsigned)f16_operand(hi) << 16);
}

// Two consecutive 16-bit values (4-byte aligned) as one register.
__device__ __forceinline__ unsigned load_pair(const unsigned short* p) {
#ifdef PD_CUDA_EMU
    unsigned v;
    memcpy(&v, p, sizeof v);
    return v;
#else
    return *(const unsigned*)p;
#endif
}

// Four consecutive f32 (16-byte aligned) in one load.
__device__ __forceinline__ void load4(const float* p, float* v) {
#ifdef PD_CUDA_EMU
    memcpy(v, p, 4 * sizeof(float));
#else
    const float4 f = *(const float4*)p;
    v[0] = f.x;
    v[1] = f.y;
    v[2] = f.z;
    v[3] = f.w;
#endif
}

// Two registers of packed 16-bit values (8-byte aligned) in one store.
__device__ __forceinline__ void store_pairs(unsigned short* p, unsigned lo, unsigned hi) {
#ifdef PD_CUDA_EMU
    const unsigned v[2] = {lo, hi};
    memcpy(p, v, sizeof v);
#else
    *(uint2*)p = make_uint2(lo, hi);
#endif
}

// KV cache elements stored as `dtype` (DTYPE_F32, DTYPE_BF16 or DTYPE_F16: the CUDA
// backend's --kv-cache-dtype). Values are f32 everywhere else. f16 saturates at ±65504.
__device__ __forceinline__ void store_kv(void* cache, int dtype, unsigned long long i, float v) {
    if (dtype == DTYPE_F32) {
        ((float*)cache)[i] = v;
    } else {
        ((unsigned short*)cache)[i] = dtype == DTYPE_BF16 ? f32_to_bf16(v) : f16_operand(v);
    }
}

// Four consecutive KV elements from `i` (a multiple of 4) as f32, in one load.
__device__ __forceinline__ void load_kv4(const void* cache, int dtype, unsigned long long i,
                                         float* v) {
    if (dtype == DTYPE_F32) {
        load4((const float*)cache + i, v);
        return;
    }
    const unsigned short* p = (const unsigned short*)cache + i;
    unsigned h[2];
#ifdef PD_CUDA_EMU
    memcpy(h, p, sizeof h);
#else
    const uint2 u = *(const uint2*)p;
    h[0] = u.x;
    h[1] = u.y;
#endif
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
        const unsigned short x = (unsigned short)(h[e / 2] >> (16 * (e % 2)));
        v[e] = dtype == DTYPE_BF16 ? bf16_to_f32(x) : f16_to_f32(x);
    }
}

// One attention work item, decoded from the launch metadata both attention kernels read
// (int32): items[2 * i] = sequence, items[2 * i + 1] = first query row of the item within its
// sequence; seqs[4 * s ..] = q_start (batch row of the sequence's first new token), q_len,
// context_len, offset of its block table in `block_tables`.
struct AttnItem {
    int row;                    // batch row of the item's first query row
    int rows;                   // its query rows, at most rows_per_item
    int first_pos;              // position of its first row; its rows see keys < first_pos + rows
    const unsigned int* table;  // its sequence's block table
};

__device__ __forceinline__ AttnItem attn_item(const int* items, const int* seqs,
                                              const unsigned int* block_tables, int item,
                                              int rows_per_item) {
    const int seq = items[2 * item];
    const int r0 = items[2 * item + 1];
    const int q_len = seqs[4 * seq + 1];
    AttnItem it;
    it.row = seqs[4 * seq] + r0;
    it.rows = min(rows_per_item, q_len - r0);
    it.first_pos = seqs[4 * seq + 2] - q_len + r0;
    it.table = block_tables + seqs[4 * seq + 3];
    return it;
}

// How a block loads K/V tiles: each loading thread owns 4 dimensions (`d4` ..) of every
// `row_step`-th key of a tile, one 16-byte load of K and of V (8 bytes for 16-bit storage),
// the key's slot found with shifts (KV block sizes are powers of two). All threads load
// unless head_dim is 96 (then blockDim.x is no multiple of the quads per key).
struct KvQuads {
    int row_step;
    int d4;
    bool loader;
    int block_shift;
};

__device__ __forceinline__ KvQuads kv_quads(int head_dim, int block_size) {
    const int quads = head_dim / 4;
    KvQuads q;
    q.row_step = blockDim.x / quads;
    q.d4 = 4 * (threadIdx.x % quads);
    q.loader = (int)threadIdx.x < q.row_step * quads;
    q.block_shift = __ffs(block_size) - 1;
    return q;
}

// This thread's 4 dimensions of K and of V at position `key` of the sequence whose block
// table is `table` (KV head `kvh`), as f32; zeros when `key` is not below `end`.
__device__ __forceinline__ void load_kv_quad(const KvQuads& lq, const void* kcache,
                                             const void* vcache, int kv_dtype,
                                             const unsigned int* table, int key, int end,
                                             int num_kv_heads, int kvh, int head_dim,
                                             float* k, float* v) {
    if (key >= end) {
        #pragma unroll
        for (int e = 0; e < 4; ++e) k[e] = v[e] = 0.0f;
        return;
    }
    const int mask = (1 << lq.block_shift) - 1;
    const unsigned long long slot =
        ((unsigned long long)table[key >> lq.block_shift] << lq.block_shift) + (key & mask);
    const unsigned long long at = (slot * num_kv_heads + kvh) * head_dim + lq.d4;
    load_kv4(kcache, kv_dtype, at, k);
    load_kv4(vcache, kv_dtype, at, v);
}

// One attention output element: f32 in `out`, or, when `out16` is given, the o_proj GEMM's
// 16-bit input (rounded as cast_bf16 / cast_f16 would round the f32 value).
__device__ __forceinline__ void store_out(float* out, unsigned short* out16, int out_dtype,
                                          unsigned long long at, float v) {
    if (out16 != nullptr) {
        out16[at] = to_16(v, out_dtype);
    } else {
        out[at] = v;
    }
}

// Eight 16-bit elements, one 16-byte load.
struct alignas(16) Pack8 {
    unsigned int v[4];
};

// A weight load (gemv.cu, moe.cu): read once, so it bypasses L1 (`L1::no_allocate`) and
// leaves L1 to the input rows, which every warp of the SM reads again.
__device__ __forceinline__ Pack8 load_streamed(const Pack8* p) {
#ifdef PD_CUDA_EMU
    return *p;
#else
    Pack8 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.v[0]), "=r"(v.v[1]), "=r"(v.v[2]), "=r"(v.v[3])
        : "l"(p));
    return v;
#endif
}

__device__ __forceinline__ void unpack8(const Pack8& p, int dtype, float* f) {
    #pragma unroll
    for (int i = 0; i < 4; ++i) {
        const unsigned short lo = (unsigned short)(p.v[i] & 0xffffu);
        const unsigned short hi = (unsigned short)(p.v[i] >> 16);
        if (dtype == DTYPE_BF16) {
            f[2 * i] = bf16_to_f32(lo);
            f[2 * i + 1] = bf16_to_f32(hi);
        } else {
            f[2 * i] = f16_to_f32(lo);
            f[2 * i + 1] = f16_to_f32(hi);
        }
    }
}
