// Qwen3-MoE's sparse MLP on the device. Batches of up to MOE_MAX_ROWS rows (decode steps,
// decode graphs, short prefills): the routing and the experts without the host, so no
// synchronisation per sparse layer and a step a CUDA graph can record. Three launches after
// the router's GEMM (moe.rs runs the norm and that GEMM):
//
// 1. moe_route, one block: per row, the softmax over the router's logits in f32, the top_k
//    largest probabilities (the lower expert first among equal ones), renormalised to sum to 1
//    with norm_topk_prob (pd_engine::backend::moe::route's rules); then the (row, choice)
//    pairs grouped by expert: a "slot" per expert that some row chose, in ascending expert
//    order, with the pairs it serves.
// 2. moe_gate_up: a block per (slot, 8 columns of the expert's width), one warp per column,
//    computing gate and up of that column for every pair of the slot and writing
//    silu(gate) · up in the weights' type: the down projection's input, one row per pair.
//    Each chosen expert's weights are read once however many rows chose it.
// 3. moe_down: one warp per output column of the hidden state, walking the slots in order
//    and adding weight · down(act) of each pair to its row's running sum in a register, so
//    every row sums its experts in ascending expert order (the order the host path adds
//    them in), then storing the rows once: no atomics, the same bits every run.
//
// Larger batches (the grouped path, moe.rs): moe_topk (a warp per row) and moe_align (one
// block) route as above and also give each pair its position in the expert-sorted order;
// moe.rs reads the slots back (the one synchronisation), moe_gather puts each expert's input
// rows together, cuBLAS multiplies them per expert on the tensor cores (gate/up, then down),
// moe_silu makes the down GEMMs' input, and moe_combine adds each row's expert outputs in
// ascending expert order.
//
// Weights and inputs are f32, bf16 or f16 (the experts' type; the normalised input rows and
// the activations are in that type, as cuBLAS would multiply them), read 8 elements at a time
// (16-byte loads; f32 two). Requires hidden and the expert width multiples of 8 and every
// operand 16-byte aligned (moe.rs checks; otherwise the host path runs).
//
// The plan buffer (u32), for E experts and P = rows · top_k pairs:
//   [0]                  S, the number of slots
//   [1, 1 + E)           slot_expert[s]
//   [1 + E, 2 + 2E)      slot_start[s] (S + 1 entries used): the slot's pairs are
//   [2 + 2E, 2 + 2E + P) pairs[slot_start[s] .. slot_start[s + 1]], pair p = row · top_k + j

#define MOE_WARPS 8
#define MOE_MAX_ROWS 128
#define MOE_MAX_EXPERTS 512
#define MOE_MAX_TOP_K 16
#define MOE_MAX_PAIRS (MOE_MAX_ROWS * MOE_MAX_TOP_K)
#define MOE_ROUTE_THREADS 1024
// Pairs one pass over an expert's column serves; a slot with more takes more passes (the
// column is then re-read, from L2 mostly).
#define MOE_CHUNK 8

struct MoePlan {
    unsigned int* count;
    unsigned int* slot_expert;
    unsigned int* slot_start;
    unsigned int* pairs;
};

__device__ __forceinline__ MoePlan moe_plan(unsigned int* base, int experts) {
    MoePlan p;
    p.count = base;
    p.slot_expert = base + 1;
    p.slot_start = base + 1 + experts;
    p.pairs = base + 2 + 2 * experts;
    return p;
}

// The 8 elements of pack `pack` (elements 8·pack .. 8·pack + 7) of a row stored as `dtype`.
// `streamed`: a weight, read once (L1 bypassed); else an input row, which other warps read too.
__device__ __forceinline__ void load8(const void* row, unsigned long long pack, int dtype,
                                      bool streamed, float* f) {
    if (dtype == DTYPE_F32) {
        const Pack8* p = (const Pack8*)((const float*)row + 8 * pack);
        #pragma unroll
        for (int h = 0; h < 2; ++h) {
            const Pack8 v = streamed ? load_streamed(p + h) : p[h];
            #pragma unroll
            for (int i = 0; i < 4; ++i) {
                f[4 * h + i] = __uint_as_float(v.v[i]);
            }
        }
    } else {
        const Pack8* p = (const Pack8*)((const unsigned short*)row + 8 * pack);
        unpack8(streamed ? load_streamed(p) : *p, dtype, f);
    }
}

__device__ __forceinline__ unsigned long long elem_bytes(int dtype) {
    return dtype == DTYPE_F32 ? 4 : 2;
}

// Row `row` (of `width` elements) of a matrix stored as `dtype`.
__device__ __forceinline__ const void* row_at(const void* base, unsigned long long row,
                                              int width, int dtype) {
    return (const char*)base + row * (unsigned long long)width * elem_bytes(dtype);
}

// Row r's routing by one warp (every lane calls it): the softmax over its logits in f32, then
// top_k rounds of a warp argmax (equal probabilities: the lower expert first), the chosen
// probabilities summed in the chosen order (as the host sums them) and divided by that sum
// with `renorm`. Lane 0 writes the row's pairs r · top_k + j in ascending expert order, the
// order the row's expert outputs are added in: pair_expert[] and pair_weight[].
__device__ __forceinline__ void route_row(const float* logits, int r, int experts, int top_k,
                                          int renorm, unsigned int* pair_expert,
                                          float* pair_weight) {
    const int lane = threadIdx.x % WARP;
    const float* l = logits + (unsigned long long)r * experts;
    float p[MOE_MAX_EXPERTS / WARP];
    float mx = -INFINITY;
    #pragma unroll
    for (int i = 0; i < MOE_MAX_EXPERTS / WARP; ++i) {
        const int e = lane + i * WARP;
        p[i] = e < experts ? l[e] : -INFINITY;
        mx = fmaxf(mx, p[i]);
    }
    mx = warp_max(mx);
    float sum = 0.0f;
    #pragma unroll
    for (int i = 0; i < MOE_MAX_EXPERTS / WARP; ++i) {
        if (lane + i * WARP < experts) {
            p[i] = expf(p[i] - mx);
            sum += p[i];
        }
    }
    sum = warp_sum(sum);
    #pragma unroll
    for (int i = 0; i < MOE_MAX_EXPERTS / WARP; ++i) {
        // Probabilities are ≥ 0; -1 marks experts that do not exist or are chosen.
        p[i] = lane + i * WARP < experts ? p[i] / sum : -1.0f;
    }
    unsigned int chosen[MOE_MAX_TOP_K];
    float weight[MOE_MAX_TOP_K];
    float chosen_sum = 0.0f;
    for (int j = 0; j < top_k; ++j) {
        // This lane's best: its experts ascend with i, so `>` keeps the lower on ties.
        float best = -2.0f;
        int at = MOE_MAX_EXPERTS;
        #pragma unroll
        for (int i = 0; i < MOE_MAX_EXPERTS / WARP; ++i) {
            if (p[i] > best) {
                best = p[i];
                at = lane + i * WARP;
            }
        }
        #pragma unroll
        for (int o = WARP / 2; o > 0; o /= 2) {
            const float ob = __shfl_xor_sync(FULL_MASK, best, o);
            const int oat = __shfl_xor_sync(FULL_MASK, at, o);
            if (ob > best || (ob == best && oat < at)) {
                best = ob;
                at = oat;
            }
        }
        if (at >= experts) {
            at = j;  // no probability is a number (NaN logits): any expert, in range
        }
        #pragma unroll
        for (int i = 0; i < MOE_MAX_EXPERTS / WARP; ++i) {
            if (lane + i * WARP == at) {
                p[i] = -1.0f;
            }
        }
        if (lane == 0) {
            chosen[j] = (unsigned int)at;
            weight[j] = best;
            chosen_sum += best;
        }
    }
    if (lane == 0) {
        const float scale = renorm ? chosen_sum : 1.0f;
        // Insertion sort by expert (top_k ≤ 16), then the pairs in that order.
        for (int j = 1; j < top_k; ++j) {
            const unsigned int e = chosen[j];
            const float w = weight[j];
            int i = j - 1;
            while (i >= 0 && chosen[i] > e) {
                chosen[i + 1] = chosen[i];
                weight[i + 1] = weight[i];
                --i;
            }
            chosen[i + 1] = e;
            weight[i + 1] = w;
        }
        for (int j = 0; j < top_k; ++j) {
            pair_expert[r * top_k + j] = chosen[j];
            pair_weight[r * top_k + j] = renorm ? weight[j] / scale : weight[j];
        }
    }
}

// The pairs grouped by expert, by the whole block (every thread calls it): counted per
// expert, the chosen experts numbered in ascending order (slots, by one warp's ballots and
// scans), each slot's pairs listed in `plan`, and, when `pair_pos` is given, each pair's
// position in those lists. `counts` and `fill` are MOE_MAX_EXPERTS words of shared memory.
// The order within a list varies between runs on a GPU; nothing depends on it (a slot's
// pairs are distinct rows, each computed alone).
__device__ __forceinline__ void align_pairs(const unsigned int* pair_expert, int pairs,
                                            int experts, MoePlan plan, unsigned int* pair_pos,
                                            unsigned int* counts, unsigned int* fill) {
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    for (int e = threadIdx.x; e < experts; e += blockDim.x) {
        counts[e] = 0;
    }
    __syncthreads();
    for (int t = threadIdx.x; t < pairs; t += blockDim.x) {
        atomicAdd(&counts[pair_expert[t]], 1u);
    }
    __syncthreads();
    if (warp == 0) {
        unsigned int slots = 0;
        unsigned int start = 0;
        for (int base = 0; base < experts; base += WARP) {
            const int e = base + lane;
            const unsigned int c = e < experts ? counts[e] : 0u;
            const unsigned int used = __ballot_sync(FULL_MASK, c > 0);
            unsigned int inclusive = c;
            #pragma unroll
            for (int o = 1; o < WARP; o *= 2) {
                const unsigned int below = __shfl_sync(FULL_MASK, inclusive, max(lane - o, 0));
                if (lane >= o) {
                    inclusive += below;
                }
            }
            if (c > 0) {
                const unsigned int s = slots + __popc(used & ((1u << lane) - 1u));
                plan.slot_expert[s] = (unsigned int)e;
                plan.slot_start[s] = start + inclusive - c;
                fill[e] = start + inclusive - c;
            }
            slots += __popc(used);
            start += __shfl_sync(FULL_MASK, inclusive, WARP - 1);
        }
        if (lane == 0) {
            *plan.count = slots;
            plan.slot_start[slots] = start;
        }
    }
    __syncthreads();
    for (int t = threadIdx.x; t < pairs; t += blockDim.x) {
        const unsigned int at = atomicAdd(&fill[pair_expert[t]], 1u);
        plan.pairs[at] = (unsigned int)t;
        if (pair_pos != nullptr) {
            pair_pos[t] = at;
        }
    }
}

// logits: [rows, experts] f32 (the router's GEMM). Writes `plan` (above) and pair_weight[P]:
// the weight pair p's expert output is added with. One block of MOE_ROUTE_THREADS threads;
// rows ≤ MOE_MAX_ROWS, experts ≤ MOE_MAX_EXPERTS, top_k ≤ MOE_MAX_TOP_K (moe.rs checks).
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS)
moe_route(const float* logits, int rows, int experts, int top_k, int renorm,
          unsigned int* plan_base, float* pair_weight) {
    __shared__ unsigned int pair_expert[MOE_MAX_PAIRS];
    __shared__ unsigned int counts[MOE_MAX_EXPERTS];
    __shared__ unsigned int fill[MOE_MAX_EXPERTS];
    const int warps = blockDim.x / WARP;
    for (int r = threadIdx.x / WARP; r < rows; r += warps) {
        route_row(logits, r, experts, top_k, renorm, pair_expert, pair_weight);
    }
    __syncthreads();
    align_pairs(pair_expert, rows * top_k, experts, moe_plan(plan_base, experts), nullptr,
                counts, fill);
}

// Batches of any size (the grouped path, moe.rs): a warp per row, MOE_WARPS rows per block,
// writing pair_expert[P] and pair_weight[P] (route_row).
extern "C" __global__ void __launch_bounds__(MOE_WARPS * WARP)
moe_topk(const float* logits, int rows, int experts, int top_k, int renorm,
         unsigned int* pair_expert, float* pair_weight) {
    const int r = blockIdx.x * MOE_WARPS + threadIdx.x / WARP;
    if (r < rows) {  // whole warps
        route_row(logits, r, experts, top_k, renorm, pair_expert, pair_weight);
    }
}

// The grouped path's plan from moe_topk's pairs (align_pairs), and pair_pos[P]: where each
// pair's row lies in the expert-sorted order. One block of MOE_ROUTE_THREADS threads.
extern "C" __global__ void __launch_bounds__(MOE_ROUTE_THREADS)
moe_align(const unsigned int* pair_expert, int pairs, int experts, unsigned int* plan_base,
          unsigned int* pair_pos) {
    __shared__ unsigned int counts[MOE_MAX_EXPERTS];
    __shared__ unsigned int fill[MOE_MAX_EXPERTS];
    align_pairs(pair_expert, pairs, experts, moe_plan(plan_base, experts), pair_pos, counts,
                fill);
}

// xs[i] = x[pairs[i] / top_k] for every position i < P of the expert-sorted order: each
// chosen expert's input rows one after another, for one GEMM per expert. Rows of `hidden`
// elements of `dtype` (whole 16-byte packs). grid = P, 64 threads.
extern "C" __global__ void moe_gather(const void* x, void* xs, const unsigned int* plan_base,
                                      int experts, int hidden, int dtype, int top_k) {
    const MoePlan plan = moe_plan((unsigned int*)plan_base, experts);
    const unsigned int i = blockIdx.x;
    const unsigned long long packs = hidden * elem_bytes(dtype) / 16;
    const Pack8* src = (const Pack8*)x + (unsigned long long)(plan.pairs[i] / top_k) * packs;
    Pack8* dst = (Pack8*)xs + (unsigned long long)i * packs;
    for (unsigned long long k = threadIdx.x; k < packs; k += blockDim.x) {
        dst[k] = src[k];
    }
}

// act[i, c] = silu(gu[i, c]) · gu[i, inter + c] in `dtype` (the down GEMMs' input, rounded as
// silu_mul_16 rounds), for i < P, c < inter: gu holds each position's gate then up (f32, the
// gate/up GEMMs' output). One thread per element.
extern "C" __global__ void moe_silu(const float* gu, void* act, unsigned long long n, int inter,
                                    int dtype) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned long long row = i / inter;
    const unsigned long long c = i % inter;
    const float v = silu_times(gu[row * 2 * inter + c], gu[row * 2 * inter + inter + c]);
    if (dtype == DTYPE_F32) {
        ((float*)act)[i] = v;
    } else {
        ((unsigned short*)act)[i] = to_16(v, dtype);
    }
}

// x[r, c] += Σ_j pair_weight[p] · y[pair_pos[p], c] over row r's pairs p = r · top_k + j in
// order (ascending expert: the host path's order): the experts' outputs (y: [P, hidden] f32
// in the expert-sorted order) added to the residual stream. One thread per element of x.
extern "C" __global__ void moe_combine(float* x, const float* y, const unsigned int* pair_pos,
                                       const float* pair_weight, unsigned long long n,
                                       int hidden, int top_k) {
    const unsigned long long i = (unsigned long long)blockIdx.x * blockDim.x + threadIdx.x;
    if (i >= n) return;
    const unsigned long long r = i / hidden;
    const unsigned long long c = i % hidden;
    float acc = x[i];
    for (int j = 0; j < top_k; ++j) {
        const unsigned long long p = r * top_k + j;
        acc += pair_weight[p] * y[(unsigned long long)pair_pos[p] * hidden + c];
    }
    x[i] = acc;
}

// act[p, c] = silu(x_p · gate_cᵀ) · (x_p · up_cᵀ) in `dtype`, for every pair p of every slot,
// x_p = x[p / top_k] ([rows, hidden] in `dtype`: the normalised rows). w: every expert's gate
// [inter, hidden] then up [inter, hidden], expert after expert ([experts, 2 · inter, hidden]).
// grid = (ceil(inter / MOE_WARPS), most slots possible), MOE_WARPS warps; blocks past the
// routed slots return at once.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * WARP)
moe_gate_up(const void* x, const void* w, void* act, const unsigned int* plan_base, int experts,
            int dtype, int hidden, int inter, int top_k) {
    const MoePlan plan = moe_plan((unsigned int*)plan_base, experts);
    const unsigned int slot = blockIdx.y;
    if (slot >= *plan.count) {
        return;
    }
    const int lane = threadIdx.x % WARP;
    const int col = blockIdx.x * MOE_WARPS + threadIdx.x / WARP;
    if (col >= inter) {
        return;  // the whole warp; this kernel has no block barrier
    }
    const unsigned long long expert = plan.slot_expert[slot];
    const void* gate = row_at(w, expert * 2 * inter + col, hidden, dtype);
    const void* up = row_at(w, expert * 2 * inter + inter + col, hidden, dtype);
    const unsigned int end = plan.slot_start[slot + 1];
    const int packs = hidden / 8;
    for (unsigned int first = plan.slot_start[slot]; first < end; first += MOE_CHUNK) {
        const int n = (int)min((unsigned int)MOE_CHUNK, end - first);
        unsigned int pair[MOE_CHUNK];
        float g[MOE_CHUNK];
        float u[MOE_CHUNK];
        #pragma unroll
        for (int i = 0; i < MOE_CHUNK; ++i) {
            pair[i] = i < n ? plan.pairs[first + i] : 0u;
            g[i] = 0.0f;
            u[i] = 0.0f;
        }
        // Packs in the order lane, lane + WARP, ...: the order of the sums is fixed.
        for (int p = lane; p < packs; p += WARP) {
            float wg[8];
            float wu[8];
            load8(gate, p, dtype, true, wg);
            load8(up, p, dtype, true, wu);
            #pragma unroll
            for (int i = 0; i < MOE_CHUNK; ++i) {
                if (i < n) {
                    float xf[8];
                    load8(row_at(x, pair[i] / top_k, hidden, dtype), p, dtype, false, xf);
                    #pragma unroll
                    for (int k = 0; k < 8; ++k) {
                        g[i] = fmaf(wg[k], xf[k], g[i]);
                        u[i] = fmaf(wu[k], xf[k], u[i]);
                    }
                }
            }
        }
        #pragma unroll
        for (int i = 0; i < MOE_CHUNK; ++i) {
            if (i < n) {  // uniform across the warp
                const float gs = warp_sum(g[i]);
                const float us = warp_sum(u[i]);
                if (lane == 0) {
                    const unsigned long long at = (unsigned long long)pair[i] * inter + col;
                    const float v = silu_times(gs, us);
                    if (dtype == DTYPE_F32) {
                        ((float*)act)[at] = v;
                    } else {
                        ((unsigned short*)act)[at] = to_16(v, dtype);
                    }
                }
            }
        }
    }
}

// x[r, c] += Σ over r's experts, ascending: pair_weight[p] · (act_p · down_cᵀ), for every row
// r < rows and column c < hidden. act: [P, inter] in `dtype` (moe_gate_up's); w: every
// expert's down [hidden, inter], expert after expert. grid = ceil(hidden / MOE_WARPS),
// MOE_WARPS warps, one output column each; lane l keeps rows l, l + 32, ... in registers.
extern "C" __global__ void __launch_bounds__(MOE_WARPS * WARP)
moe_down(const void* act, const void* w, float* x, const unsigned int* plan_base,
         const float* pair_weight, int experts, int dtype, int hidden, int inter, int top_k,
         int rows) {
    const MoePlan plan = moe_plan((unsigned int*)plan_base, experts);
    const int lane = threadIdx.x % WARP;
    const int col = blockIdx.x * MOE_WARPS + threadIdx.x / WARP;
    if (col >= hidden) {
        return;
    }
    float acc[MOE_MAX_ROWS / WARP];
    #pragma unroll
    for (int j = 0; j < MOE_MAX_ROWS / WARP; ++j) {
        const int r = lane + j * WARP;
        acc[j] = r < rows ? x[(unsigned long long)r * hidden + col] : 0.0f;
    }
    const unsigned int slots = *plan.count;
    const int packs = inter / 8;
    for (unsigned int s = 0; s < slots; ++s) {
        const void* down = row_at(w, (unsigned long long)plan.slot_expert[s] * hidden + col,
                                  inter, dtype);
        const unsigned int end = plan.slot_start[s + 1];
        for (unsigned int first = plan.slot_start[s]; first < end; first += MOE_CHUNK) {
            const int n = (int)min((unsigned int)MOE_CHUNK, end - first);
            unsigned int pair[MOE_CHUNK];
            float y[MOE_CHUNK];
            #pragma unroll
            for (int i = 0; i < MOE_CHUNK; ++i) {
                pair[i] = i < n ? plan.pairs[first + i] : 0u;
                y[i] = 0.0f;
            }
            for (int p = lane; p < packs; p += WARP) {
                float wd[8];
                load8(down, p, dtype, true, wd);
                #pragma unroll
                for (int i = 0; i < MOE_CHUNK; ++i) {
                    if (i < n) {
                        float af[8];
                        load8(row_at(act, pair[i], inter, dtype), p, dtype, false, af);
                        #pragma unroll
                        for (int k = 0; k < 8; ++k) {
                            y[i] = fmaf(wd[k], af[k], y[i]);
                        }
                    }
                }
            }
            #pragma unroll
            for (int i = 0; i < MOE_CHUNK; ++i) {
                if (i < n) {  // uniform across the warp
                    const float sum = warp_sum(y[i]);
                    const int r = (int)(pair[i] / top_k);
                    if (lane == r % WARP) {
                        const float weight = pair_weight[pair[i]];
                        #pragma unroll
                        for (int j = 0; j < MOE_MAX_ROWS / WARP; ++j) {
                            if (j == r / WARP) {
                                acc[j] += weight * sum;
                            }
                        }
                    }
                }
            }
        }
    }
    #pragma unroll
    for (int j = 0; j < MOE_MAX_ROWS / WARP; ++j) {
        const int r = lane + j * WARP;
        if (r < rows) {
            x[(unsigned long long)r * hidden + col] = acc[j];
        }
    }
}
