// Row-wise and element-wise ops of the Qwen3 forward: embedding gather, RMSNorm (layer norms
// and the per-head q/k norms), rotary embedding, SiLU-and-multiply, residual add, row
// selection and the activation casts that feed cuBLAS. Activations are row-major f32.

// out[r, :] = table[ids[r], :]  (one block per row)
extern "C" __global__ void embedding(const void* table, int dtype, const unsigned int* ids,
                                     float* out, int rows, int cols) {
    const int r = blockIdx.x;
    if (r >= rows) return;
    const unsigned long long base = (unsigned long long)ids[r] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        out[(unsigned long long)r * cols + c] = load_weight(table, dtype, base + c);
    }
}

// RMSNorm over each group of `group` consecutive features (one block per group):
// out = x * rsqrt(mean(x^2) + eps) * w. Same order of operations as the CPU backend.
extern "C" __global__ void rms_norm(const float* x, const float* w, float* out, int groups,
                                    int group, float eps) {
    __shared__ float scratch[WARP];
    const int g = blockIdx.x;
    if (g >= groups) return;
    const float* xs = x + (unsigned long long)g * group;
    float* os = out + (unsigned long long)g * group;
    const float inv = rms_inv(xs, group, eps, scratch);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        os[i] = xs[i] * inv * w[i];
    }
}

// Rotate-half RoPE in place on [rows, heads * head_dim]; one thread per (row, head, j < half).
// inv_freq[j] = theta^(-2j/head_dim) in f32, as transformers (and the CPU backend) compute it.
extern "C" __global__ void rope(float* x, const unsigned int* positions, int rows, int cols,
                                int head_dim, float theta) {
    const int half = head_dim / 2;
    const int per_row = cols / 2;
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= (unsigned long long)rows * per_row) return;
    const int r = (int)(i / per_row);
    const int rem = (int)(i % per_row);
    const int head = rem / half;
    const int j = rem % half;
    const float inv_freq = 1.0f / powf(theta, (float)(2 * j) / (float)head_dim);
    const float a = (float)positions[r] * inv_freq;
    float s, c;
    sincosf(a, &s, &c);
    float* h = x + (unsigned long long)r * cols + head * head_dim;
    const float lo = h[j];
    const float hi = h[j + half];
    h[j] = lo * c - hi * s;
    h[j + half] = hi * c + lo * s;
}

// Qwen3's q/k step fused: per-head RMSNorm (weights wq / wk of head_dim) then rotate-half RoPE,
// from q [rows, q_heads * head_dim] and k [rows, k_heads * head_dim] into q_out / k_out. One
// block per (row, head) of q then k; thread j owns the pair (j, j + head_dim / 2). The same
// arithmetic as rms_norm followed by rope, without the round trip through memory.
//
// With `kcache` (not null) it is also the step's KV write, as write_kv does it: each rotated k
// row goes to its slot in kcache (then k_out may be null), and k_heads more blocks per row copy
// v into vcache. Slot 0xffffffff (a padding row of a decode graph) writes no KV.
extern "C" __global__ void qk_norm_rope(const float* q, const float* k, int q_stride,
                                        int k_stride, const float* wq, const float* wk,
                                        float* q_out, float* k_out,
                                        const unsigned int* positions, int rows, int q_heads,
                                        int k_heads, int head_dim, float eps, float theta,
                                        void* kcache, void* vcache, int kv_dtype,
                                        const float* v, int v_stride,
                                        const unsigned int* slots) {
    __shared__ float scratch[WARP];
    // PD_CUDA_PDL (common.cuh): the attention after this kernel may launch at once (it waits
    // for these results), and this one waits for the q/k/v product before it reads it.
    allow_dependents_to_launch();
    wait_for_inputs();
    const int heads = q_heads + k_heads + (kcache != nullptr ? k_heads : 0);
    const int r = blockIdx.x / heads;
    const int h = blockIdx.x % heads;
    if (r >= rows) return;  // uniform across the block
    const unsigned long long width = (unsigned long long)k_heads * head_dim;
    const unsigned int slot = kcache != nullptr ? slots[r] : 0xffffffffu;
    if (h >= q_heads + k_heads) {
        // A v head: copied as it is (no barrier on this path; uniform across the block).
        if (slot == 0xffffffffu) return;
        const int head = h - q_heads - k_heads;
        const float* src = v + (unsigned long long)r * v_stride + head * head_dim;
        const unsigned long long dst = slot * width + head * head_dim;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
            store_kv(vcache, kv_dtype, dst + i, src[i]);
        }
        return;
    }
    const bool is_q = h < q_heads;
    const int head = is_q ? h : h - q_heads;
    // Inputs may be views of a wider stacked q/k/v product (row stride); outputs are dense.
    const float* x = (is_q ? q : k) + (unsigned long long)r * (is_q ? q_stride : k_stride) +
                     head * head_dim;
    float* out = is_q ? q_out : k_out;
    float* o = out == nullptr ? nullptr
                              : out + (unsigned long long)r * (is_q ? q_heads : k_heads) * head_dim +
                                    head * head_dim;
    const bool to_cache = !is_q && slot != 0xffffffffu;
    const unsigned long long at = to_cache ? slot * width + head * head_dim : 0;
    const float* w = is_q ? wq : wk;
    const int half = head_dim / 2;
    const int j = threadIdx.x;
    float lo = 0.0f;
    float hi = 0.0f;
    if (j < half) {
        lo = x[j];
        hi = x[j + half];
    }
    const float ss = block_sum(lo * lo + hi * hi, scratch);
    if (j >= half) return;
    const float inv = 1.0f / sqrtf(ss / (float)head_dim + eps);
    lo = lo * inv * w[j];
    hi = hi * inv * w[j + half];
    const float inv_freq = 1.0f / powf(theta, (float)(2 * j) / (float)head_dim);
    const float a = (float)positions[r] * inv_freq;
    float s, c;
    sincosf(a, &s, &c);
    const float first = lo * c - hi * s;
    const float second = hi * c + lo * s;
    if (o != nullptr) {
        o[j] = first;
        o[j + half] = second;
    }
    if (to_cache) {
        store_kv(kcache, kv_dtype, at + j, first);
        store_kv(kcache, kv_dtype, at + j + half, second);
    }
}

// rms_norm written straight as the 16-bit input of the GEMMs that are its only reader: the
// same f32 value, rounded as the cast would round it, without the f32 round trip.
extern "C" __global__ void rms_norm_16(const float* x, const float* w, unsigned short* out,
                                       int groups, int group, float eps, int dtype) {
    __shared__ float scratch[WARP];
    const int g = blockIdx.x;
    if (g >= groups) return;
    const float* xs = x + (unsigned long long)g * group;
    unsigned short* os = out + (unsigned long long)g * group;
    const float inv = rms_inv(xs, group, eps, scratch);
    for (int i = threadIdx.x; i < group; i += blockDim.x) {
        os[i] = to_16(xs[i] * inv * w[i], dtype);
    }
}

// silu_mul written straight as the 16-bit input of the down projection.
extern "C" __global__ void silu_mul_16(const float* gate, const float* up, unsigned short* out,
                                       unsigned long long n, int cols, int gate_stride,
                                       int up_stride, int dtype) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned long long r = i / cols;
    const unsigned long long c = i % cols;
    out[i] = to_16(silu_times(gate[r * gate_stride + c], up[r * up_stride + c]), dtype);
}

// out = silu(gate) * up; gate and up rows are `gate_stride` / `up_stride` apart (the two halves
// of one stacked gate/up product, or `cols` when dense). The same for silu_mul_16 above.
extern "C" __global__ void silu_mul(const float* gate, const float* up, float* out,
                                    unsigned long long n, int cols, int gate_stride,
                                    int up_stride) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned long long r = i / cols;
    const unsigned long long c = i % cols;
    out[i] = silu_times(gate[r * gate_stride + c], up[r * up_stride + c]);
}

// x += y
extern "C" __global__ void add_assign(float* x, const float* y, unsigned long long n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    x[i] += y[i];
}

// x[rows[i], :] += scales[i] * y[i, :]  (one block per row of y; rows distinct): a
// Qwen3-MoE expert's output added to the rows routed to it.
extern "C" __global__ void add_rows_scaled(float* x, const float* y, const unsigned int* rows,
                                           const float* scales, int n, int cols) {
    const int i = blockIdx.x;
    if (i >= n) return;
    const unsigned long long dst = (unsigned long long)rows[i] * cols;
    const float s = scales[i];
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        x[dst + c] += s * y[(unsigned long long)i * cols + c];
    }
}

// out[i, :] = x[rows[i], :]  (one block per output row)
extern "C" __global__ void select_rows(const float* x, const unsigned int* rows, float* out,
                                       int n, int cols) {
    const int i = blockIdx.x;
    if (i >= n) return;
    const unsigned long long src = (unsigned long long)rows[i] * cols;
    for (int c = threadIdx.x; c < cols; c += blockDim.x) {
        out[(unsigned long long)i * cols + c] = x[src + c];
    }
}

// The GEMM input in the weight's 16-bit type (cuBLAS multiplies bf16 x bf16 or f16 x f16
// with f32 accumulation; it has no bf16 x f32 mode).
extern "C" __global__ void cast_bf16(const float* x, unsigned short* out, unsigned long long n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void cast_f16(const float* x, unsigned short* out, unsigned long long n) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    out[i] = f32_to_f16(x[i]);
}
