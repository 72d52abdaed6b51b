// sample_dense: the host's dense sampling path (no top-k or one above 64; min-p and top-p
// over the whole vocabulary), one block per sampled row, bit-exact with the host (sample.cuh
// says how).
#include "sample.cuh"

// sample_dense: most tokens its top-p sorts (pd_engine's MAX_DEVICE_TOP_P_CANDIDATES); more
// and the row goes back to the host, which histograms them.
#define DENSE_MAX_CANDIDATES 8192
// sample_dense: weights are summed in chunks of this many (8 f32 lanes), as on the host.
#define DENSE_CHUNK 64

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
    const double lse = raw_log_sum_exp(r, n, cols, lmax, s_val, s_idx, s_sum);
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
