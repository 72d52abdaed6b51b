// prompt_logprobs: prompt positions scored with the sampling kernels' log-probability and
// top-k code (sample.cuh).
#include "sample.cuh"

// Prompt log-probabilities (pd_engine::sampling::prompt_logprobs): per scored row, the raw
// log-probability of the prompt token that follows it and its `top` best alternatives, as
// sample_rows reports a sampled token's. params: 3 words per row (logits row, next prompt
// token, alternatives); out: SAMPLE_OUTPUTS words per row (token, logprob bits, 0, 0, then
// the top log-probabilities). Only columns below vocab_limit are listed; log-probabilities
// are normalized over all `cols` columns. blockDim.x: a
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
    const double lse = raw_log_sum_exp(r, n, cols, lmax, s_val, s_idx, s_sum);
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
