// x · Wᵀ for a few rows (decode batches), 16-bit weights and inputs, f32 accumulation: the
// cuBLAS GEMM's job (gemm.rs) for `rows` ≤ GEMV_MAX_ROWS, written as a weight stream. At
// batch 1 a decode step reads every weight once and does two flops per 2-byte weight, so its
// speed is the share of the card's memory bandwidth the linear layers reach; these kernels
// exist to be measured against cuBLAS there (`PD_CUDA_GEMV`, docs/cuda.md).
//
// One warp per output column: its 32 lanes stream the column's weights in 16-byte loads (8
// elements), each multiplied with the same 8 elements of every input row (the rows are small
// and stay in L1 / shared memory), then a warp sum. Each lane keeps two rounds of two loads in
// flight: the next round is issued before the current one is multiplied. Requires `k` a
// multiple of 8 and `x`, `w` 16-byte aligned (the Rust side checks and otherwise uses cuBLAS).
//
// Programmatic dependent launch (Hopper; `PD_CUDA_PDL=on`): launched so, a GEMV kernel may
// start while the kernel before it in the stream is still finishing (once every block of
// that kernel has started and said so: `allow_dependents_to_launch`, which the GEMV kernels
// and paged_attention do first). Its weights do not depend on that kernel, so each warp
// issues its first weight loads at once and only then waits for the previous kernel's
// results (`wait_for_inputs`) before it reads its input rows or writes anything. Launched
// without the attribute, both are no-ops.
//
// Two fused forms save a launch each in every layer of a decode step (at batch 1 a small
// model's step is otherwise bound by its ~9 launches per layer, not by its weights):
// - gemv16_norm: the input is the residual stream `h` (f32); the block first computes the
//   layer's RMSNorm into shared memory in the 16-bit type, with rms_norm_16's arithmetic in
//   its order (so the same bits), while the first weight loads are already in flight.
// - gemv16_norm_silu: the same, for the stacked gate / up weights; a warp computes gate
//   column j and up column j together and writes silu(gate) · up in the 16-bit type: the down
//   projection's input, as silu_mul_16 would have written it.

#define GEMV_WARPS 8
#define GEMV_MAX_ROWS 8

// acc[r] += w8 · (row r's 8 elements at pack p), for every row.
__device__ __forceinline__ void gemv_pack(const Pack8& wp, const Pack8* x, int rows,
                                          int row_packs, int p, int dtype, float* acc) {
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

// x16[r, :] = rms_norm(h[r, :]) · gamma in the 16-bit type, for every row, by the whole block
// (every thread must call it): rms_norm_16's arithmetic (elementwise.cu: the same rms_inv
// over the same 256 threads, the same expression), so the same bits.
__device__ __forceinline__ void norm_rows_16(const float* h, const float* gamma, float eps,
                                             int rows, int k, int dtype, unsigned short* x16) {
    __shared__ float scratch[WARP];
    #pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r < rows) {  // uniform across the block
            const float* xs = h + (unsigned long long)r * k;
            unsigned short* os = x16 + r * k;
            const float inv = rms_inv(xs, k, eps, scratch);
            for (int i = threadIdx.x; i < k; i += blockDim.x) {
                os[i] = to_16(xs[i] * inv * gamma[i], dtype);
            }
        }
    }
    __syncthreads();
}

// The common body. COLS weight columns per warp: 1, or 2 for gate column j and up column
// j + n_out (SILU). NORM: the input is normalised from `h` into shared memory first; else it
// is `x` ([rows, k], 16-bit). Output: f32 `out` [rows, n_out] (+= with `accumulate`), or
// with SILU 16-bit `out16` [rows, n_out].
template <int COLS, bool NORM, bool SILU>
__device__ __forceinline__ void gemv_body(const unsigned short* x, const float* h,
                                          const float* gamma, float eps, const unsigned short* w,
                                          float* out, unsigned short* out16, int dtype, int rows,
                                          int n_out, int k, int accumulate) {
    // Every block of this grid has started: the next GEMV may be scheduled into the SMs as
    // this one's blocks finish, and stream its weights meanwhile.
    allow_dependents_to_launch();
    const int lane = threadIdx.x % WARP;
    const int col = blockIdx.x * GEMV_WARPS + threadIdx.x / WARP;
    const bool active = col < n_out;
    const int packs = k / 8;
    const Pack8* wcol[COLS];
    #pragma unroll
    for (int c = 0; c < COLS; ++c) {
        wcol[c] = (const Pack8*)(w + (unsigned long long)(col + c * n_out) * k);
    }
    // This round's two loads per column (packs p and p + WARP), issued before the norm.
    Pack8 a[COLS] = {};
    Pack8 b[COLS] = {};
    int p = lane;
    if (active) {
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            if (p < packs) a[c] = load_streamed(wcol[c] + p);
            if (p + WARP < packs) b[c] = load_streamed(wcol[c] + p + WARP);
        }
    }
    // Nothing above reads what an earlier kernel writes, nor writes anything.
    wait_for_inputs();
    const Pack8* xp = (const Pack8*)x;
    if (NORM) {
        extern __shared__ float smem[];
        norm_rows_16(h, gamma, eps, rows, k, dtype, (unsigned short*)smem);
        xp = (const Pack8*)smem;
    }
    if (!active) {
        return;  // the whole warp, after the block's last barrier
    }
    float acc[COLS][GEMV_MAX_ROWS];
    #pragma unroll
    for (int c = 0; c < COLS; ++c) {
        #pragma unroll
        for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
            acc[c][r] = 0.0f;
        }
    }
    // Packs in the order p, p + WARP, p + 2 WARP, ...: the order of the sums is fixed.
    while (p < packs) {
        const int q = p + 2 * WARP;
        Pack8 na[COLS] = {};
        Pack8 nb[COLS] = {};
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            if (q < packs) na[c] = load_streamed(wcol[c] + q);
            if (q + WARP < packs) nb[c] = load_streamed(wcol[c] + q + WARP);
        }
        #pragma unroll
        for (int c = 0; c < COLS; ++c) {
            gemv_pack(a[c], xp, rows, packs, p, dtype, acc[c]);
            if (p + WARP < packs) gemv_pack(b[c], xp, rows, packs, p + WARP, dtype, acc[c]);
            a[c] = na[c];
            b[c] = nb[c];
        }
        p = q;
    }
    #pragma unroll
    for (int r = 0; r < GEMV_MAX_ROWS; ++r) {
        if (r < rows) {
            const float s = warp_sum(acc[0][r]);
            if (SILU) {
                const float u = warp_sum(acc[COLS - 1][r]);
                if (lane == 0) {
                    out16[(unsigned long long)r * n_out + col] = to_16(silu_times(s, u), dtype);
                }
            } else if (lane == 0) {
                float* o = out + (unsigned long long)r * n_out + col;
                *o = accumulate ? *o + s : s;
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
    gemv_body<1, false, false>(x, nullptr, nullptr, 0.0f, w, out, nullptr, dtype, rows, n, k,
                               accumulate);
}

// out = rms_norm(h) · gamma · wᵀ: h [rows, k] f32, gamma [k] f32, w [n, k], out [rows, n] f32.
// Dynamic shared memory: rows · k 16-bit values. Same grid and block as gemv16.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP)
gemv16_norm(const float* h, const float* gamma, float eps, const unsigned short* w, float* out,
            int dtype, int rows, int n, int k) {
    gemv_body<1, true, false>(nullptr, h, gamma, eps, w, out, nullptr, dtype, rows, n, k, 0);
}

// out16 = silu(x · gateᵀ) · (x · upᵀ) with x = rms_norm(h) · gamma: w is gate [n_out, k] then
// up [n_out, k] in one buffer (as load_stacked uploads them), out16 [rows, n_out] in `dtype`.
// grid.x = ceil(n_out / GEMV_WARPS); dynamic shared memory as gemv16_norm.
extern "C" __global__ void __launch_bounds__(GEMV_WARPS * WARP)
gemv16_norm_silu(const float* h, const float* gamma, float eps, const unsigned short* w,
                 unsigned short* out16, int dtype, int rows, int n_out, int k) {
    gemv_body<2, true, true>(nullptr, h, gamma, eps, w, nullptr, out16, dtype, rows, n_out, k, 0);
}
