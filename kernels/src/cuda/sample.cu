// sample_rows: greedy and top-k <= 64 sampling (then min-p, top-p), one block per sampled
// row, bit-exact with the host (sample.cuh says how).
#include "sample.cuh"

// params: SAMPLE_PARAMS doubles per sampled row (one block each, k in 0..=64); out:
// SAMPLE_OUTPUTS words per row. Only columns below vocab_limit are candidates (log-probabilities
// are normalized over all `cols` columns). A row with
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
    const double lse = raw_log_sum_exp(r, n, cols, lmax, s_val, s_idx, s_sum);

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
