// x · Wᵀ for a few rows (decode batches), 16-bit weights and inputs, f32 accumulation: the
// cuBLAS GEMM's job (gemm.rs) for `rows` ≤ GEMV_MAX_ROWS, written as a weight stream. At
// batch 1 a decode step reads every weight once and does two flops per 2-byte weight, so its
// speed is the share of the card's memory bandwidth the linear layers reach; this kernel
// exists to be measured against cuBLAS there (`PD_CUDA_GEMV`, docs/cuda.md).
//
// One warp per output column: its 32 lanes stream the column's weights in 16-byte loads (8
// elements), two loads in flight per lane, each multiplied with the same 8 elements of every
// input row (the rows are small and stay in L1 / L2), then a warp sum. Requires `k` a multiple
// of 8 and `x`, `w` 16-byte aligned (the Rust side checks and otherwise uses cuBLAS).

#define GEMV_WARPS 8
#define GEMV_MAX_ROWS 8

// Eight 16-bit elements, one 16-byte load.
struct alignas(16) Pack8 {
    unsigned int v[4];
};

// A weight load: read once, so it bypasses L1 (`L1::no_allocate`) and leaves L1 to the input
// rows, which every warp of the SM reads again.
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

// acc[r] += w8 · (row r's 8 elements at pack p), for every row.
__device__ __forceinline__ void gemv_pack(const Pack8& wp, const Pack8* x, int rows,
                                          unsigned long long row_packs, int p, int dtype,
                                          float* acc) {
    float wf[8];
    unpack8(wp, dtype, wf);
    #pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r < rows) {
            float xf[8];
            unpack8(x[r * row_packs + p], dtype, xf);
            #pragma unroll
            for (int i = 0; i < 8; ++i) {
                acc[r] = fmaf(wf[i], xf[i], acc[r]);
            }
        }
    }
}

// out[r, j] = (accumulate ? out[r, j] : 0) + Σ_k x[r, k] · w[j, k] for r < rows, j < n.
// x: [rows, k], w: [n, k], both `dtype` (DTYPE_BF16 or DTYPE_F16); out: [rows, n] f32.
// grid.x = ceil(n / GEMV_WARPS), block = GEMV_WARPS warps.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP)
gemv16(const unsigned short* x, const unsigned short* w, float* out, int dtype, int rows, int n,
       int k, int accumulate) {
    const int lane = threadIdx.x % WARP;
    const int col = blockIdx.x * GEMV_WARPS + threadIdx.x / WARP;
    if (col >= n) {
        return;  // the whole warp: no block-wide synchronization follows
    }
    const unsigned long long packs = (unsigned long long)k / 8;
    const Pack8* wcol = (const Pack8*)(w + (unsigned long long)col * k);
    const Pack8* xp = (const Pack8*)x;
    float acc[GEMV_MAX_ROWS];
    #pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        acc[r] = 0.0f;
    }
    int p = lane;
    // Two weight loads issued before either is used: more bytes in flight per lane.
    for (; p + WARP < (int)packs; p += 2 * WARP) {
        const Pack8 w0 = load_streamed(wcol + p);
        const Pack8 w1 = load_streamed(wcol + p + WARP);
        gemv_pack(w0, xp, rows, packs, p, dtype, acc);
        gemv_pack(w1, xp, rows, packs, p + WARP, dtype, acc);
    }
    if (p < (int)packs) {
        gemv_pack(load_streamed(wcol + p), xp, rows, packs, p, dtype, acc);
    }
    #pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r < rows) {
            const float s = warp_sum(acc[r]);
            if (lane == 0) {
                float* o = out + (unsigned long long)r * n + col;
                *o = accumulate ? *o + s : s;
            }
        }
    }
}
