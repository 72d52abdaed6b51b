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
// sample_dense: most tokens its top-p sorts (pd_engine's MAX_DEVICE_TOP_P_CANDIDATES); more
// and the row goes back to the host, which histograms them.
#define DENSE_MAX_CANDIDATES 8192
// sample_dense: weights are summed in chunks of this many (8 f32 lanes), as on the host.
#define DENSE_CHUNK 64

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

__device__ SampleRow sample_row_at(const float* logits, int cols, const float* shaped,
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
__device__ void row_argmax(const float* x, int n, float& lmax, int& max_id, float* s_val,
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

// log-sum-exp of the raw logits, for the chosen token's log-probability (their own maximum
// first when the choice is made from edited logits).
__device__ double raw_log_sum_exp(const SampleRow& r, int n, float lmax, float* s_val,
                                  int* s_idx, double* s_sum) {
    float raw_max = lmax;
    if (r.x != r.raw) {
        int unused;
        row_argmax(r.raw, n, raw_max, unused, s_val, s_idx);
    }
    double lse = (double)raw_max;
    if (raw_max > -INFINITY && raw_max < INFINITY) {
        double s = 0.0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
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
__device__ unsigned int select_kth(const float* x, const float* w, float threshold, int n,
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
__device__ void collect_top_k(const float* x, int n, int k, float threshold, int* cand,
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
__device__ void sort_candidates(const float* x, int* cand, int m) {
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
__device__ void write_top_logprobs(unsigned int* out, const SampleRow& r, int n, double lse,
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

__device__ void write_sample(unsigned int* out, const SampleRow& r, double lse, int token,
                             int used, int needs_host) {
    const float l = r.raw[token];
    const float logprob = (l != l || l == -INFINITY) ? -INFINITY : (float)((double)l - lse);
    unsigned int* o = out + (unsigned long long)SAMPLE_OUTPUTS * blockIdx.x;
    o[0] = (unsigned int)token;
    o[1] = __float_as_uint(logprob);
    o[2] = (unsigned int)used;
    o[3] = (unsigned int)needs_host;
}

// params: SAMPLE_PARAMS doubles per sampled row (one block each, k in 0..=64); out:
// SAMPLE_OUTPUTS words per row. Only columns below vocab_limit are candidates. A row with
// edits chooses from its row of `shaped` (vocab_limit columns each; unused, possibly null,
// when no row has edits). blockDim.x: a multiple of 32, at most 1024.
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
    const TopKShared sh = {hist, &s_desired, &s_rank, &s_equal, s_idx, s_sum};

    const SampleRow r = sample_row_at(logits, cols, shaped, vocab_limit, params);
    const float* x = r.x;
    const int k = r.k;
    const int n = vocab_limit;

    // 1. argmax; 2. the raw log-sum-exp.
    float lmax;
    int max_id;
    row_argmax(x, n, lmax, max_id, s_val, s_idx);
    const bool finite = lmax > -INFINITY && lmax < INFINITY;
    const double lse = raw_log_sum_exp(r, n, lmax, s_val, s_idx, s_sum);

    int token = max_id;
    int used = 0;
    if (k > 0 && finite) {
        used = 1;
        // min-p: the host's `lmax + temperature * ln(min_p)`, the product made on the host.
        const float threshold = __fadd_rn(lmax, r.min_p_margin);
        // 3. The k best candidates (logit descending, id ascending).
        collect_top_k(x, n, k, threshold, cand, &n_cand, sh);
        // 4. Sort, weights, top-p and the draw: at most 64 candidates, one thread, in the
        //    host's order.
        if (threadIdx.x == 0) {
            const int m = n_cand;
            sort_candidates(x, cand, m);
            double total = 0.0;
            for (int j = 0; j < m; ++j) {
                cand_w[j] = exp_nonpos(__fmul_rn(__fsub_rn(x[cand[j]], lmax), r.inv_t));
                total = __dadd_rn(total, (double)cand_w[j]);
            }
            int kept = m;
            if (r.top_p < 1.0f) {
                const double target = __dmul_rn((double)r.top_p, total);
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
            const double target = __dmul_rn(r.uniform, sum);
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
        write_sample(out, r, lse, token, used, 0);
    }
    // `cand` is free again: it holds the top log-probabilities' ids.
    write_top_logprobs(out, r, n, lse, cand, &n_cand, sh);
}

// Per sampled row of sample_dense, its scratch: the weights (vocab_limit floats), the chunk
// sums (one float per DENSE_CHUNK weights), the top-p candidates and their sorted order
// (DENSE_MAX_CANDIDATES ints each).
__device__ __forceinline__ unsigned long long dense_scratch_words(int vocab_limit) {
    return (unsigned long long)vocab_limit + (vocab_limit + DENSE_CHUNK - 1) / DENSE_CHUNK +
           2ull * DENSE_MAX_CANDIDATES;
}

// Sum of one chunk of weights as the host's chunk_sum: 8 f32 lanes (weight j of each group of
// 8 into lane j, in order), then the lanes in order.
__device__ float dense_chunk_sum(const float* w, int c, int n) {
    float acc[8] = {0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f, 0.0f};
    const int base = c * DENSE_CHUNK;
    for (int e = 0; e < DENSE_CHUNK; e += 8) {
        for (int j = 0; j < 8; ++j) {
            if (base + e + j < n) {
                acc[j] = __fadd_rn(acc[j], w[base + e + j]);
            }
        }
    }
    float s = acc[0];
    for (int j = 1; j < 8; ++j) {
        s = __fadd_rn(s, acc[j]);
    }
    return s;
}

// The host's dense path (DeviceSampling::Dense): temperature sampling with no top-k or one
// above 64, min-p and top-p over the whole vocabulary. params: SAMPLE_PARAMS doubles per row
// (k: top-k, 0 = none); scratch: dense_scratch_words(vocab_limit) words per row; out:
// SAMPLE_OUTPUTS words per row. A top-p over more than DENSE_MAX_CANDIDATES tokens is handed
// back (the host histograms those). blockDim.x: a multiple of 32, at most 1024.
extern "C" __global__ void sample_dense(const float* logits, int cols, const float* shaped,
                                        int vocab_limit, const double* params,
                                        float* scratch, unsigned int* out) {
    __shared__ float s_val[WARP];
    __shared__ int s_idx[WARP];
    __shared__ double s_sum[WARP];
    __shared__ unsigned int hist[256];
    __shared__ unsigned int s_desired;
    __shared__ int s_rank;
    __shared__ int s_equal;
    __shared__ int s_kth_id;
    __shared__ int n_cand;
    __shared__ int top[SAMPLE_MAX_LOGPROBS];
    __shared__ int n_top;
    const TopKShared sh = {hist, &s_desired, &s_rank, &s_equal, s_idx, s_sum};

    const SampleRow r = sample_row_at(logits, cols, shaped, vocab_limit, params);
    const float* x = r.x;
    const int n = vocab_limit;
    const int chunks = (n + DENSE_CHUNK - 1) / DENSE_CHUNK;
    float* w = scratch + dense_scratch_words(n) * blockIdx.x;
    float* chunk_sum = w + n;
    int* cand = (int*)(chunk_sum + chunks);
    int* sorted = cand + DENSE_MAX_CANDIDATES;

    float lmax;
    int max_id;
    row_argmax(x, n, lmax, max_id, s_val, s_idx);
    const double lse = raw_log_sum_exp(r, n, lmax, s_val, s_idx, s_sum);
    if (!(lmax > -INFINITY && lmax < INFINITY)) {
        if (threadIdx.x == 0) {
            write_sample(out, r, lse, max_id, 0, 0);
        }
        write_top_logprobs(out, r, n, lse, top, &n_top, sh);
        return;
    }

    // 1. Every token's weight (Weights::of): 0 below the min-p threshold, NaN and -inf.
    const float threshold = __fadd_rn(lmax, r.min_p_margin);
    for (int i = threadIdx.x; i < n; i += blockDim.x) {
        const float l = x[i];
        const float e = __fmul_rn(__fsub_rn(l, lmax), r.inv_t);
        w[i] = exp_nonpos(l >= threshold ? e : -INFINITY);
    }
    __syncthreads();

    // 2. Top-k over the positive weights: zero every token ranked below the k-th (logit
    //    descending, id ascending), as the host's select_nth does.
    if (r.k > 0) {
        int positive = 0;
        for (int i = threadIdx.x; i < n; i += blockDim.x) {
            positive += w[i] > 0.0f ? 1 : 0;
        }
        positive = (int)(block_sum_f64((double)positive, s_sum) + 0.5);
        if (r.k < positive) {
            int rank;
            int equal;
            const unsigned int desired = select_kth(x, w, threshold, n, r.k, rank, equal, hist,
                                                    &s_desired, &s_rank, &s_equal);
            // The k-th token: the rank-th lowest id among the eligible ones with that key.
            int taken = 0;
            for (int base = 0; base < n && taken < rank; base += blockDim.x) {
                const int i = base + threadIdx.x;
                const bool eq = i < n && w[i] > 0.0f && order_key(x[i]) == desired;
                const int before = block_prefix_count(eq, s_idx);
                if (eq && taken + before == rank - 1) {
                    s_kth_id = i;
                }
                taken += __syncthreads_count(eq);
            }
            __syncthreads();
            const int kth = s_kth_id;
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                if (w[i] > 0.0f) {
                    const unsigned int key = order_key(x[i]);
                    if (key < desired || (key == desired && i > kth)) {
                        w[i] = 0.0f;
                    }
                }
            }
            __syncthreads();
        }
    }

    // 3. Chunk sums, each as the host's chunk_sum.
    for (int c = threadIdx.x; c < chunks; c += blockDim.x) {
        chunk_sum[c] = dense_chunk_sum(w, c, n);
    }
    __syncthreads();

    int token = max_id;
    int needs_host = 0;
    if (r.top_p < 1.0f) {
        // 4. Top-p as the host's top_p_dense: tokens that certainly drop go first; the rest
        //    are sorted and walked while the mass before them is below top_p.
        __shared__ double s_total;
        if (threadIdx.x == 0) {
            double total = 0.0;
            for (int c = 0; c < chunks; ++c) {
                total = __dadd_rn(total, (double)chunk_sum[c]);
            }
            s_total = total;
            n_cand = 0;
        }
        __syncthreads();
        const double total = s_total;
        const double drop_below = __ddiv_rn(__dmul_rn(__dsub_rn(1.0, (double)r.top_p), total),
                                            __dmul_rn(2.0, (double)n));
        if (!(total > 0.0)) {
            needs_host = 1;
        } else {
            for (int i = threadIdx.x; i < n; i += blockDim.x) {
                if (w[i] > 0.0f && (double)w[i] >= drop_below) {
                    const int slot = atomicAdd(&n_cand, 1);
                    if (slot < DENSE_MAX_CANDIDATES) {
                        cand[slot] = i;
                    }
                }
            }
            __syncthreads();
            const int m = n_cand;
            if (m > DENSE_MAX_CANDIDATES) {
                needs_host = 1;
            } else {
                // Rank sort (logit descending, id ascending: a total order over them).
                for (int a = threadIdx.x; a < m; a += blockDim.x) {
                    const int ia = cand[a];
                    const float la = x[ia];
                    int before = 0;
                    for (int b = 0; b < m; ++b) {
                        const int ib = cand[b];
                        const float lb = x[ib];
                        before += (lb > la || (lb == la && ib < ia)) ? 1 : 0;
                    }
                    sorted[before] = ia;
                }
                __syncthreads();
                if (threadIdx.x == 0) {
                    const double target = __dmul_rn((double)r.top_p, total);
                    double cum = 0.0;
                    int kept = m;
                    for (int j = 0; j < m; ++j) {
                        if (cum >= target) {
                            kept = j;
                            break;
                        }
                        cum = __dadd_rn(cum, (double)w[sorted[j]]);
                    }
                    // The host's draw_candidates over the kept tokens, in order.
                    double sum = 0.0;
                    for (int j = 0; j < kept; ++j) {
                        sum = __dadd_rn(sum, (double)w[sorted[j]]);
                    }
                    const double draw = __dmul_rn(r.uniform, sum);
                    double walked = 0.0;
                    int last = -1;
                    for (int j = 0; j < kept; ++j) {
                        const float wj = w[sorted[j]];
                        if (wj > 0.0f) {
                            walked = __dadd_rn(walked, (double)wj);
                            last = sorted[j];
                            if (walked > draw) break;
                        }
                    }
                    token = last >= 0 ? last : max_id;
                }
            }
        }
    } else if (threadIdx.x == 0) {
        // 5. No top-p: the host's draw_weights over every weight in id order, chunk by chunk.
        double total = 0.0;
        for (int c = 0; c < chunks; ++c) {
            total = __dadd_rn(total, (double)chunk_sum[c]);
        }
        const double target = __dmul_rn(r.uniform, total);
        double cum = 0.0;
        int last_chunk = -1;
        int found = -1;
        for (int c = 0; c < chunks && found < 0; ++c) {
            const double cs = (double)chunk_sum[c];
            if (cs <= 0.0) {
                continue;
            }
            if (__dadd_rn(cum, cs) > target) {
                double inner = cum;
                int last_positive = -1;
                for (int i = c * DENSE_CHUNK; i < n && i < (c + 1) * DENSE_CHUNK; ++i) {
                    if (w[i] > 0.0f) {
                        last_positive = i;
                        inner = __dadd_rn(inner, (double)w[i]);
                        if (inner > target) {
                            found = i;
                            break;
                        }
                    }
                }
                // Rounding (f32 chunk sum against the f64 walk): the chunk's last token.
                if (found < 0) {
                    found = last_positive;
                }
                break;
            }
            cum = __dadd_rn(cum, cs);
            last_chunk = c;
        }
        if (found < 0 && last_chunk >= 0) {
            for (int i = last_chunk * DENSE_CHUNK; i < n && i < (last_chunk + 1) * DENSE_CHUNK;
                 ++i) {
                if (w[i] > 0.0f) {
                    found = i;
                }
            }
        }
        token = found >= 0 ? found : max_id;
    }
    __shared__ int s_needs_host;
    if (threadIdx.x == 0) {
        write_sample(out, r, lse, needs_host ? 0 : token, needs_host ? 0 : 1, needs_host);
        s_needs_host = needs_host;
    }
    __syncthreads();
    // A row handed back gets its log-probabilities on the host too.
    if (!s_needs_host) {
        write_top_logprobs(out, r, n, lse, top, &n_top, sh);
    } else if (threadIdx.x == 0) {
        out[(unsigned long long)SAMPLE_OUTPUTS * blockIdx.x + 4] = 0;
    }
}

// Prompt log-probabilities (pd_engine::sampling::prompt_logprobs): per scored row, the raw
// log-probability of the prompt token that follows it and its `top` best alternatives, as
// sample_rows reports a sampled token's. params: 3 words per row (logits row, next prompt
// token, alternatives); out: SAMPLE_OUTPUTS words per row (token, logprob bits, 0, 0, then
// the top log-probabilities). Only columns below vocab_limit are scored. blockDim.x: a
// multiple of 32, at most 1024.
extern "C" __global__ void prompt_logprobs(const float* logits, int cols, int vocab_limit,
                                           const unsigned int* params, unsigned int* out) {
    __shared__ float s_val[WARP];
    __shared__ int s_idx[WARP];
    __shared__ double s_sum[WARP];
    __shared__ unsigned int hist[256];
    __shared__ unsigned int s_desired;
    __shared__ int s_rank;
    __shared__ int s_equal;
    __shared__ int top[SAMPLE_MAX_LOGPROBS];
    __shared__ int n_top;
    const TopKShared sh = {hist, &s_desired, &s_rank, &s_equal, s_idx, s_sum};

    const unsigned int* p = params + 3ull * blockIdx.x;
    SampleRow r;
    r.raw = logits + (unsigned long long)p[0] * cols;
    r.x = r.raw;
    r.k = 0;
    r.inv_t = 1.0f;
    r.top_p = 1.0f;
    r.uniform = 0.0;
    r.min_p_margin = -INFINITY;
    r.top_logprobs = (int)min(p[2], (unsigned int)SAMPLE_MAX_LOGPROBS);
    const int n = vocab_limit;

    float lmax;
    int max_id;
    row_argmax(r.raw, n, lmax, max_id, s_val, s_idx);
    const double lse = raw_log_sum_exp(r, n, lmax, s_val, s_idx, s_sum);
    if (threadIdx.x == 0) {
        const unsigned int next = p[1];
        const float l = next < (unsigned int)n ? r.raw[next] : -INFINITY;
        const float logprob = (l != l || l == -INFINITY) ? -INFINITY : (float)((double)l - lse);
        unsigned int* o = out + (unsigned long long)SAMPLE_OUTPUTS * blockIdx.x;
        o[0] = next;
        o[1] = __float_as_uint(logprob);
        o[2] = 0;
        o[3] = 0;
    }
    write_top_logprobs(out, r, n, lse, top, &n_top, sh);
}
