// Sampling next to the logits: one block per sampled row chooses its token exactly as
// pd_engine::sampling::device::sample_row does on the host (the contract every backend
// keeps), so only token ids travel to the host.
//
// Bit-exactness: the token choice repeats the host's arithmetic in the same order with the
// same rounding. Every float / double operation of the weights, top-p and the draw is an
// explicit round-to-nearest intrinsic (__fmul_rn, __dadd_rn, ...), which the compiler never
// contracts into an FMA (the Rust side has no FMA either), and exp is the host's polynomial,
// not expf. Only the log-probability (a softmax denominator summed in another order) may
// differ from the host's by rounding.
//
// The logits processors (penalties, logit bias, allowed ids, bad words, the min_tokens mask)
// come as per-id edits made by the host (pd_engine::sampling::device::Reshape):
// reshape_copy and reshape_edit write the edited rows into a buffer of their own, which
// sample_rows chooses from; the log-probability stays that of the raw row.

#define SAMPLE_MAX_K 64
// Per row: row index, k (0 = greedy), inv_temperature, top_p, uniform, min-p margin (-inf:
// none), row of the edited logits (-1: choose from the raw row); all exact in f64.
#define SAMPLE_PARAMS 7
// Per edited row: raw logits row, allowed_only, repetition penalty bits, presence bits.
#define RESHAPE_ROW 4
// Per edit: edited row, token id, ops, bias bits, frequency bits.
#define RESHAPE_EDIT 5
// The ops of an edit, applied in this order (pd_engine::sampling::device::edit).
#define EDIT_ALLOWED 1u
#define EDIT_BIAS 2u
#define EDIT_MASK 4u
#define EDIT_REPEAT 8u
#define EDIT_OUTPUT 16u

// Edited rows, dense part: each a copy of its raw row, or all -inf under allowed_only.
// grid.y: one per edited row; grid.x strides the columns.
extern "C" __global__ void reshape_copy(const float* logits, int cols, int vocab_limit,
                                        const unsigned int* rows, float* shaped) {
    const unsigned int* r = rows + (unsigned long long)blockIdx.y * RESHAPE_ROW;
    const float* x = logits + (unsigned long long)r[0] * cols;
    float* y = shaped + (unsigned long long)blockIdx.y * vocab_limit;
    const bool allowed_only = r[1] != 0;
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < vocab_limit;
         i += gridDim.x * blockDim.x) {
        y[i] = allowed_only ? -INFINITY : x[i];
    }
}

// Edited rows, sparse part (after reshape_copy): one thread per edit, at most one edit per
// (row, id), each computed from the raw logit as TokenEdit::apply does, operation for
// operation with explicit round-to-nearest intrinsics.
extern "C" __global__ void reshape_edit(const float* logits, int cols, int vocab_limit,
                                        const unsigned int* rows, const unsigned int* edits,
                                        int n_edits, float* shaped) {
    const int e = blockIdx.x * blockDim.x + threadIdx.x;
    if (e >= n_edits) {
        return;
    }
    const unsigned int* d = edits + (unsigned long long)e * RESHAPE_EDIT;
    const unsigned int j = d[0];
    const unsigned int id = d[1];
    const unsigned int ops = d[2];
    const unsigned int* r = rows + (unsigned long long)j * RESHAPE_ROW;
    float l = logits[(unsigned long long)r[0] * cols + id];
    if (r[1] != 0 && (ops & EDIT_ALLOWED) == 0) {
        l = -INFINITY;
    }
    if (ops & EDIT_BIAS) {
        l = __fadd_rn(l, __uint_as_float(d[3]));
    }
    if (ops & EDIT_MASK) {
        l = -INFINITY;
    }
    if (ops & EDIT_REPEAT) {
        const float p = __uint_as_float(r[2]);
        l = l > 0.0f ? __fdiv_rn(l, p) : __fmul_rn(l, p);
    }
    if (ops & EDIT_OUTPUT) {
        l = __fsub_rn(__fsub_rn(l, __uint_as_float(d[4])), __uint_as_float(r[3]));
    }
    shaped[(unsigned long long)j * vocab_limit + id] = l;
}

// The host's exp_nonpos (pd_engine sampler.rs): exp(x) for x <= 0 by a degree-7 polynomial
// after n ln2 range reduction; 0 below -87, for -inf and NaN. Constants as f32 bit patterns.
__device__ __forceinline__ float exp_nonpos(float x) {
    const float LN2_HI = __uint_as_float(0x3f317200u);   // 0.693_145_75
    const float LN2_LO = __uint_as_float(0x35bfbe8eu);   // 1.428_606_8e-6
    const float ROUND = __uint_as_float(0x4b400000u);    // 1.5 * 2^23
    const float LOG2_E = __uint_as_float(0x3fb8aa3bu);
    const bool valid = x >= -87.0f;  // false for NaN
    x = valid ? x : -87.0f;
    const float shifted = __fadd_rn(__fmul_rn(x, LOG2_E), ROUND);
    const unsigned int n_bits = __float_as_uint(shifted) - __float_as_uint(ROUND);
    const float n = __fsub_rn(shifted, ROUND);
    const float r = __fsub_rn(__fsub_rn(x, __fmul_rn(n, LN2_HI)), __fmul_rn(n, LN2_LO));
    // Horner, innermost first: 1/5040, 1/720, 1/120, 1/24, 1/6, 1/2, 1, 1 (f32 of each).
    float p = __uint_as_float(0x39500d01u);
    p = __fadd_rn(__uint_as_float(0x3ab60b61u), __fmul_rn(r, p));
    p = __fadd_rn(__uint_as_float(0x3c088889u), __fmul_rn(r, p));
    p = __fadd_rn(__uint_as_float(0x3d2aaaabu), __fmul_rn(r, p));
    p = __fadd_rn(__uint_as_float(0x3e2aaaabu), __fmul_rn(r, p));
    p = __fadd_rn(0.5f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    p = __fadd_rn(1.0f, __fmul_rn(r, p));
    const float scale = __uint_as_float((n_bits + 127u) << 23);
    return valid ? __fmul_rn(p, scale) : 0.0f;
}

// A logit that can be chosen by top-k: not NaN, above -inf and at or above the min-p
// threshold (-inf when there is none).
__device__ __forceinline__ bool sample_candidate(float l, float threshold) {
    return l == l && l > -INFINITY && l >= threshold;
}

// Unsigned key whose order is the float order (-0.0 made +0.0: the host ranks them equal).
__device__ __forceinline__ unsigned int order_key(float l) {
    const unsigned int b = __float_as_uint(l == 0.0f ? 0.0f : l);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}

// (value, id) ordering of argmax: larger value, then lower id.
__device__ __forceinline__ void better_pair(float& v, int& i, float ov, int oi) {
    if (ov > v || (ov == v && oi < i)) {
        v = ov;
        i = oi;
    }
}

// Block-wide argmax; every thread gets the result. `sv`/`si` hold 32 entries.
__device__ void block_argmax(float& v, int& i, float* sv, int* si) {
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    for (int o = WARP / 2; o > 0; o /= 2) {
        better_pair(v, i, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, i, o));
    }
    __syncthreads();
    if (lane == 0) {
        sv[warp] = v;
        si[warp] = i;
    }
    __syncthreads();
    v = lane < (int)(blockDim.x / WARP) ? sv[lane] : -INFINITY;
    i = lane < (int)(blockDim.x / WARP) ? si[lane] : 0x7fffffff;
    for (int o = WARP / 2; o > 0; o /= 2) {
        better_pair(v, i, __shfl_xor_sync(FULL_MASK, v, o), __shfl_xor_sync(FULL_MASK, i, o));
    }
}

__device__ double block_sum_f64(double v, double* scratch) {
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    for (int o = WARP / 2; o > 0; o /= 2) {
        v += __shfl_xor_sync(FULL_MASK, v, o);
    }
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = v;
    }
    __syncthreads();
    v = lane < (int)(blockDim.x / WARP) ? scratch[lane] : 0.0;
    for (int o = WARP / 2; o > 0; o /= 2) {
        v += __shfl_xor_sync(FULL_MASK, v, o);
    }
    return v;
}

// Number of set flags in threads below this one (block-wide exclusive prefix count).
// `scratch` holds 32 ints. Every thread must call it.
__device__ int block_prefix_count(bool flag, int* scratch) {
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    const unsigned int ballot = __ballot_sync(FULL_MASK, flag);
    __syncthreads();
    if (lane == 0) {
        scratch[warp] = __popc(ballot);
    }
    __syncthreads();
    int before = 0;
    for (int w = 0; w < warp; ++w) {
        before += scratch[w];
    }
    return before + __popc(ballot & ((1u << lane) - 1u));
}

// params: SAMPLE_PARAMS doubles per sampled row (one block each); out: per row the token id,
// the bits of its f32 log-probability, and whether the uniform draw was used. Only columns
// below vocab_limit are candidates. A row with edits chooses from its row of `shaped`
// (vocab_limit columns each; unused, possibly null, when no row has edits).
// blockDim.x: a multiple of 32, at most 1024.
extern "C" __global__ void sample_rows(const float* logits, int cols, const float* shaped,
                                       int vocab_limit, const double* params,
                                       unsigned int* out) {
    __shared__ float s_val[WARP];
    __shared__ int s_idx[WARP];
    __shared__ double s_sum[WARP];
    __shared__ unsigned int hist[256];
    __shared__ int cand[SAMPLE_MAX_K];
    __shared__ float cand_w[SAMPLE_MAX_K];
    __shared__ int n_cand;
    __shared__ unsigned int s_desired;
    __shared__ int s_rank;
    __shared__ int s_equal;

    const double* p = params + (unsigned long long)blockIdx.x * SAMPLE_PARAMS;
    const int row = (int)p[0];
    const int k = (int)p[1];
    const float inv_t = (float)p[2];
    const float top_p = (float)p[3];
    const double uniform = p[4];
    const float min_p_margin = (float)p[5];
    const int shaped_row = (int)p[6];
    const float* raw = logits + (unsigned long long)row * cols;
    // The row the token is chosen from.
    const float* x =
        shaped_row >= 0 ? shaped + (unsigned long long)shaped_row * vocab_limit : raw;
    const int n = vocab_limit;

    // 1. argmax: the largest logit, NaN ignored, ties to the lower id (a thread visits its
    //    ids in increasing order, so a strict > keeps its first maximum).
    float best = -INFINITY;
    int best_i = 0x7fffffff;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float l = x[i];
        if (l > best) {
            best = l;
            best_i = i;
        }
    }
    block_argmax(best, best_i, s_val, s_idx);
    const float lmax = best;
    const int max_id = lmax == -INFINITY ? 0 : best_i;
    const bool finite = lmax > -INFINITY && lmax < INFINITY;

    // 2. log-sum-exp of the raw logits, for the chosen token's log-probability (their own
    //    maximum first when the choice is made from edited logits).
    float raw_max = lmax;
    if (x != raw) {
        raw_max = -INFINITY;
        int unused = 0x7fffffff;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float l = raw[i];
            if (l > raw_max) {
                raw_max = l;
                unused = i;
            }
        }
        block_argmax(raw_max, unused, s_val, s_idx);
    }
    double lse = (double)raw_max;
    if (raw_max > -INFINITY && raw_max < INFINITY) {
        double s = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float l = raw[i];
            if (l == l) {
                s += (double)expf(l - raw_max);
            }
        }
        s = block_sum_f64(s, s_sum);
        lse = (double)raw_max + log(s);
    }

    int token = max_id;
    int used = 0;
    if (k > 0 && finite) {
        used = 1;
        // min-p: the host's `lmax + temperature * ln(min_p)`, the product made on the host.
        const float threshold = __fadd_rn(lmax, min_p_margin);
        // 3. The k best candidates (logit descending, id ascending). Radix-select the k-th
        //    best key (8 bits at a time, most significant first); keep every key above it and
        //    the lowest ids among those equal to it.
        int valid = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            valid += sample_candidate(x[i], threshold) ? 1 : 0;
        }
        valid = (int)(block_sum_f64((double)valid, s_sum) + 0.5);
        if (threadIdx.x == 0) {
            n_cand = 0;
        }
        __syncthreads();
        if (valid <= k) {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                if (sample_candidate(x[i], threshold)) {
                    cand[atomicAdd(&n_cand, 1)] = i;
                }
            }
        } else {
            unsigned int desired = 0;
            unsigned int mask = 0;
            int rank = k;  // 1-based rank of the wanted key among those matching `desired`
            for (int shift = 24; shift >= 0; shift -= 8) {
                for (int d = threadIdx.x; d < 256; d += blockDim.x) {
                    hist[d] = 0;
                }
                __syncthreads();
                for (int i = threadIdx.x; i < n; i += blockDim.x) {
                    const float l = x[i];
                    if (sample_candidate(l, threshold)) {
                        const unsigned int key = order_key(l);
                        if ((key & mask) == desired) {
                            atomicAdd(&hist[(key >> shift) & 255u], 1u);
                        }
                    }
                }
                __syncthreads();
                if (threadIdx.x == 0) {
                    int r = rank;
                    int d = 255;
                    for (; d > 0; --d) {
                        if ((int)hist[d] >= r) break;
                        r -= (int)hist[d];
                    }
                    s_desired = desired | ((unsigned int)d << shift);
                    s_rank = r;
                    s_equal = (int)hist[d];
                }
                __syncthreads();
                desired = s_desired;
                rank = s_rank;
                mask |= 255u << shift;
            }
            // `desired` is the k-th best key; `rank` of the `s_equal` logits with that key
            // are kept, the lowest ids first.
            const int equal = s_equal;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                const float l = x[i];
                if (sample_candidate(l, threshold)) {
                    const unsigned int key = order_key(l);
                    if (key > desired || (key == desired && equal == rank)) {
                        cand[atomicAdd(&n_cand, 1)] = i;
                    }
                }
            }
            if (equal != rank) {
                // Ties straddle the k-th place: walk the ids in order, taking the first
                // `rank` equal ones.
                const int above = k - rank;
                int taken = 0;
                for (int base = 0; base < n && taken < rank; base += blockDim.x) {
                    const int i = base + threadIdx.x;
                    const bool eq = i < n && sample_candidate(x[i], threshold) && order_key(x[i]) == desired;
                    const int before = block_prefix_count(eq, s_idx);
                    if (eq && taken + before < rank) {
                        cand[above + taken + before] = i;
                    }
                    taken += __syncthreads_count(eq);
                }
                if (threadIdx.x == 0) {
                    n_cand = k;
                }
            }
        }
        __syncthreads();

        // 4. Sort, weights, top-p and the draw: at most 64 candidates, one thread, in the
        //    host's order.
        if (threadIdx.x == 0) {
            const int m = n_cand;
            for (int a = 1; a < m; ++a) {
                const int id = cand[a];
                const float l = x[id];
                int b = a - 1;
                while (b >= 0 && (x[cand[b]] < l || (x[cand[b]] == l && cand[b] > id))) {
                    cand[b + 1] = cand[b];
                    --b;
                }
                cand[b + 1] = id;
            }
            double total = 0.0;
            for (int j = 0; j < m; ++j) {
                cand_w[j] = exp_nonpos(__fmul_rn(__fsub_rn(x[cand[j]], lmax), inv_t));
                total = __dadd_rn(total, (double)cand_w[j]);
            }
            int kept = m;
            if (top_p < 1.0f) {
                const double target = __dmul_rn((double)top_p, total);
                double cum = 0.0;
                for (int j = 0; j < m; ++j) {
                    if (cum >= target) {
                        kept = j;
                        break;
                    }
                    cum = __dadd_rn(cum, (double)cand_w[j]);
                }
            }
            double sum = 0.0;
            for (int j = 0; j < kept; ++j) {
                sum = __dadd_rn(sum, (double)cand_w[j]);
            }
            const double target = __dmul_rn(uniform, sum);
            double cum = 0.0;
            int last = -1;
            for (int j = 0; j < kept; ++j) {
                if (cand_w[j] > 0.0f) {
                    cum = __dadd_rn(cum, (double)cand_w[j]);
                    last = cand[j];
                    if (cum > target) break;
                }
            }
            token = last >= 0 ? last : max_id;
        }
    }

    if (threadIdx.x == 0) {
        const float l = raw[token];
        const float logprob = (l != l || l == -INFINITY) ? -INFINITY : (float)((double)l - lse);
        unsigned int* o = out + 3ull * blockIdx.x;
        o[0] = (unsigned int)token;
        o[1] = __float_as_uint(logprob);
        o[2] = (unsigned int)used;
    }
}
