// Sampling next to the logits: one block per sampled row chooses its token exactly as
// pd_engine::sampling::device::sample_row does on the host (the contract every backend
// keeps), so only token ids travel to the host. sample_rows: greedy and top-k <= 64 (then
// min-p, top-p); sample_dense: no top-k or a larger one, over the whole vocabulary;
// prompt_logprobs: scores prompt positions with the same log-probability code.
//
// Bit-exactness: the token choice repeats the host's arithmetic in the same order with the
// same rounding. Every float / double operation of the weights, top-p and the draw is an
// explicit round-to-nearest intrinsic (__fmul_rn, __dadd_rn, ...), which the compiler never
// contracts into an FMA (the Rust side has no FMA either), and exp is the host's polynomial,
// not expf. Only the log-probability (a softmax denominator summed in another order) may
// differ from the host's by rounding. Rows with logits processors are chosen from their
// edited copy (reshape.cu); the log-probability stays that of the raw row.
//
// This header holds what the sampling kernels share: the host's exp, block-wide reductions,
// the radix top-k, the log-sum-exp and the output row. The kernels are in sample.cu
// (sample_rows), sample_dense.cu and prompt.cu; each includes it (modules.rs pastes it in for
// NVRTC, which gets no include path). Functions are `inline` so that the emulator, which
// links every source into one library, may hold a copy per source.
#ifndef PD_SAMPLE_CUH
#define PD_SAMPLE_CUH

#define SAMPLE_MAX_K 64
// Per row: row index, k (0 = none / greedy), inv_temperature, top_p, uniform, min-p margin
// (-inf: none), row of the edited logits (-1: choose from the raw row), how many top
// log-probabilities to report; all exact in f64.
#define SAMPLE_PARAMS 8
// Most top log-probabilities a row reports (pd_engine's MAX_LOGPROBS).
#define SAMPLE_MAX_LOGPROBS 20
// Words per row of output: token, logprob bits, draw used, handed back to the host, the
// number of top log-probabilities, then (id, logprob bits) for each.
#define SAMPLE_OUTPUTS (5 + 2 * SAMPLE_MAX_LOGPROBS)

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
__device__ inline void block_argmax(float& v, int& i, float* sv, int* si) {
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

__device__ inline double block_sum_f64(double v, double* scratch) {
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
__device__ inline int block_prefix_count(bool flag, int* scratch) {
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

// The row a block samples, from its parameters.
struct SampleRow {
    const float* raw;  // raw logits: the log-probability's
    const float* x;    // the logits the token is chosen from (raw, or the edited copy)
    int k;
    float inv_t;
    float top_p;
    double uniform;
    float min_p_margin;
    int top_logprobs;
};

__device__ inline SampleRow sample_row_at(const float* logits, int cols, const float* shaped,
                                   int vocab_limit, const double* params) {
    const double* p = params + (unsigned long long)blockIdx.x * SAMPLE_PARAMS;
    SampleRow r;
    r.raw = logits + (unsigned long long)p[0] * cols;
    const int shaped_row = (int)p[6];
    r.x = shaped_row >= 0 ? shaped + (unsigned long long)shaped_row * vocab_limit : r.raw;
    r.k = (int)p[1];
    r.inv_t = (float)p[2];
    r.top_p = (float)p[3];
    r.uniform = p[4];
    r.min_p_margin = (float)p[5];
    r.top_logprobs = (int)p[7];
    return r;
}

// The largest logit, NaN ignored, ties to the lower id (a thread visits its ids in
// increasing order, so a strict > keeps its first maximum); id 0 when all are -inf.
__device__ inline void row_argmax(const float* x, int n, float& lmax, int& max_id, float* s_val,
                           int* s_idx) {
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
    lmax = best;
    max_id = best == -INFINITY ? 0 : best_i;
}

// log-sum-exp of the raw logits over all `cols` columns of the row (the model's whole
// vocabulary, padding rows included, as transformers and vLLM normalize), for the chosen
// token's log-probability. `lmax` is the maximum of the first `n` columns of the choice's
// logits; the raw row's own maximum is taken when the choice is made from edited logits or
// the row is wider than the candidates.
__device__ inline double raw_log_sum_exp(const SampleRow& r, int n, int cols, float lmax,
                                  float* s_val, int* s_idx, double* s_sum) {
    float raw_max = lmax;
    if (r.x != r.raw || cols != n) {
        int unused;
        row_argmax(r.raw, cols, raw_max, unused, s_val, s_idx);
    }
    double lse = (double)raw_max;
    if (raw_max > -INFINITY && raw_max < INFINITY) {
        double s = 0.0;
        for (int i = threadIdx.x; i < cols; i += blockDim.x) {
            const float l = r.raw[i];
            if (l == l) {
                s += (double)expf(l - raw_max);
            }
        }
        s = block_sum_f64(s, s_sum);
        lse = (double)raw_max + log(s);
    }
    return lse;
}

// Whether id i takes part in top-k: with weights (sample_dense) a positive weight, else a
// candidate logit (sample_candidate).
__device__ __forceinline__ bool topk_eligible(const float* x, const float* w, int i,
                                              float threshold) {
    return w != nullptr ? w[i] > 0.0f : sample_candidate(x[i], threshold);
}

// Radix select of the k-th best key among the eligible ids (8 bits at a time, most
// significant first). Returns the key; `rank` of the `equal` eligible ids with that key
// rank within the best k (the lowest ids first). Every thread gets the results.
__device__ inline unsigned int select_kth(const float* x, const float* w, float threshold, int n,
                                   int k, int& rank, int& equal, unsigned int* hist,
                                   unsigned int* s_desired, int* s_rank, int* s_equal) {
    unsigned int desired = 0;
    unsigned int mask = 0;
    rank = k;  // 1-based rank of the wanted key among those matching `desired`
    for (int shift = 24; shift >= 0; shift -= 8) {
        for (int d = threadIdx.x; d < 256; d += blockDim.x) {
            hist[d] = 0;
        }
        __syncthreads();
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (topk_eligible(x, w, i, threshold)) {
                const unsigned int key = order_key(x[i]);
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
            *s_desired = desired | ((unsigned int)d << shift);
            *s_rank = r;
            *s_equal = (int)hist[d];
        }
        __syncthreads();
        desired = *s_desired;
        rank = *s_rank;
        equal = *s_equal;
        mask |= 255u << shift;
        __syncthreads();
    }
    return desired;
}

// Shared memory of collect_top_k.
struct TopKShared {
    unsigned int* hist;  // 256 entries
    unsigned int* desired;
    int* rank;
    int* equal;
    int* idx;      // WARP entries
    double* sum;   // WARP entries
};

// The k best ids among the candidates (sample_candidate with `threshold`), logit descending
// then id ascending, into cand[0..*n_cand) unsorted: every key above the k-th best and the
// lowest ids among those equal to it; *n_cand = min(k, candidates). Every thread calls it.
__device__ inline void collect_top_k(const float* x, int n, int k, float threshold, int* cand,
                              int* n_cand, const TopKShared& sh) {
    int valid = 0;
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        valid += sample_candidate(x[i], threshold) ? 1 : 0;
    }
    valid = (int)(block_sum_f64((double)valid, sh.sum) + 0.5);
    if (threadIdx.x == 0) {
        *n_cand = 0;
    }
    __syncthreads();
    if (valid <= k) {
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            if (sample_candidate(x[i], threshold)) {
                cand[atomicAdd(n_cand, 1)] = i;
            }
        }
    } else {
        int rank;
        int equal;
        const unsigned int desired = select_kth(x, nullptr, threshold, n, k, rank, equal,
                                                sh.hist, sh.desired, sh.rank, sh.equal);
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            const float l = x[i];
            if (sample_candidate(l, threshold)) {
                const unsigned int key = order_key(l);
                if (key > desired || (key == desired && equal == rank)) {
                    cand[atomicAdd(n_cand, 1)] = i;
                }
            }
        }
        if (equal != rank) {
            // Ties straddle the k-th place: walk the ids in order, taking the first `rank`
            // equal ones.
            const int above = k - rank;
            int taken = 0;
            for (int base = 0; base < n && taken < rank; base += blockDim.x) {
                const int i = base + threadIdx.x;
                const bool eq =
                    i < n && sample_candidate(x[i], threshold) && order_key(x[i]) == desired;
                const int before = block_prefix_count(eq, sh.idx);
                if (eq && taken + before < rank) {
                    cand[above + taken + before] = i;
                }
                taken += __syncthreads_count(eq);
            }
            if (threadIdx.x == 0) {
                *n_cand = k;
            }
        }
    }
    __syncthreads();
}

// Sorts cand[0..m) by logit descending, then id ascending (one thread; m is small).
__device__ inline void sort_candidates(const float* x, int* cand, int m) {
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
}

// The row's top log-probabilities (its `top_logprobs` best raw logits, as the host's
// top_logprobs ranks them) into the output after the first five words. Every thread calls
// it; `top` holds SAMPLE_MAX_LOGPROBS ids.
__device__ inline void write_top_logprobs(unsigned int* out, const SampleRow& r, int n, double lse,
                                   int* top, int* n_top, const TopKShared& sh) {
    unsigned int* o = out + (unsigned long long)SAMPLE_OUTPUTS * blockIdx.x;
    if (r.top_logprobs <= 0) {
        if (threadIdx.x == 0) {
            o[4] = 0;
        }
        return;
    }
    __syncthreads();
    collect_top_k(r.raw, n, min(r.top_logprobs, SAMPLE_MAX_LOGPROBS), -INFINITY, top, n_top,
                  sh);
    if (threadIdx.x == 0) {
        const int m = *n_top;
        sort_candidates(r.raw, top, m);
        o[4] = (unsigned int)m;
        for (int j = 0; j < m; ++j) {
            const float l = r.raw[top[j]];
            o[5 + 2 * j] = (unsigned int)top[j];
            o[6 + 2 * j] = __float_as_uint((float)((double)l - lse));
        }
    }
}

__device__ inline void write_sample(unsigned int* out, const SampleRow& r, double lse, int token,
                             int used, int needs_host) {
    const float l = r.raw[token];
    const float logprob = (l != l || l == -INFINITY) ? -INFINITY : (float)((double)l - lse);
    unsigned int* o = out + (unsigned long long)SAMPLE_OUTPUTS * blockIdx.x;
    o[0] = (unsigned int)token;
    o[1] = __float_as_uint(logprob);
    o[2] = (unsigned int)used;
    o[3] = (unsigned int)needs_host;
}

#endif  // PD_SAMPLE_CUH
