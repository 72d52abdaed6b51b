// Paged causal grouped-query attention, flash-attention style: keys and values stream through
// shared memory in tiles of TILE_KEYS with an online softmax, so no score matrix is ever
// materialised. One kernel serves prefill and decode:
// - grid.x: work items, each up to `rows_per_item` query rows of one sequence;
// - grid.y: KV heads; the block computes every query head of that KV head's group (GQA), so
//   a K/V tile loaded once serves group * rows (query row, head) pairs;
// - grid.z: key splits (split-K). Long contexts with few work items (decode) are cut into
//   ranges: each item spreads its own keys evenly, in whole tiles, over as many of the
//   launch's splits as its length has `min_keys_per_split` keys (plan.rs `keys_per_split`),
//   so a short context in a launch shaped for a long one (a decode graph's) is split as its
//   own length asks; the last split
//   of an (item, KV head) to finish merges the partial results of all of them
//   (merge_splits), so split-K costs no second launch.
// Within a tile each lane owns one key for the q.k dot products, then owns head_dim / 32
// output dimensions for the p.V accumulation. Arithmetic is f32 on CUDA cores. The work
// items' metadata: `attn_item` (common.cuh).

#define TILE_KEYS 32
#define ATTN_WARPS 4
#define PAIRS_PER_WARP 4
#define MAX_PAIRS (ATTN_WARPS * PAIRS_PER_WARP)
#define MAX_HEAD_DIM 128
#define DIMS_PER_LANE (MAX_HEAD_DIM / WARP)

// A float another block of this launch wrote: read from L2, past this SM's L1 (not coherent).
__device__ __forceinline__ float load_cg(const float* p) {
#ifdef PD_CUDA_EMU
    return *p;
#else
    float v;
    asm volatile("ld.global.cg.f32 %0, [%1];" : "=f"(v) : "l"(p));
    return v;
#endif
}

// Split-K: count this split of (item, KV head) done; the last one to finish merges every
// split, out = sum_s acc_s e^(m_s - M) / sum_s l_s e^(m_s - M), and re-arms the counter for the
// next launch (graph replays included). Empty splits (l = 0) are skipped rather than
// multiplied by zero, since their accumulators were never written. Every thread of the
// block calls it.
__device__ __forceinline__ void merge_splits(const float* part_acc, const float* part_ml,
                                             unsigned int* counter, unsigned long long base,
                                             int splits, int pairs, int head_dim, int group,
                                             int kvh, unsigned long long out_row, int q_width,
                                             float* out, unsigned short* out16,
                                             int out_dtype) {
    __shared__ int last;
    __threadfence();  // this block's partials are visible device-wide before it is counted
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(counter, 1u) == (unsigned int)(splits - 1);
    __syncthreads();
    if (!last) return;
    __threadfence();
    for (int i = threadIdx.x; i < pairs * head_dim; i += blockDim.x) {
        const int p = i / head_dim;
        const int d = i % head_dim;
        float mx = -INFINITY;
        for (int s = 0; s < splits; ++s) {
            const unsigned long long at = (base + s) * MAX_PAIRS + p;
            if (load_cg(part_ml + 2 * at + 1) > 0.0f) mx = fmaxf(mx, load_cg(part_ml + 2 * at));
        }
        float num = 0.0f;
        float den = 0.0f;
        for (int s = 0; s < splits; ++s) {
            const unsigned long long at = (base + s) * MAX_PAIRS + p;
            const float ls = load_cg(part_ml + 2 * at + 1);
            if (ls > 0.0f) {
                const float w = expf(load_cg(part_ml + 2 * at) - mx);
                num += load_cg(part_acc + at * head_dim + d) * w;
                den += ls * w;
            }
        }
        const int r = p / group;
        const int h = kvh * group + p % group;
        store_out(out, out16, out_dtype, (out_row + r) * q_width + h * head_dim + d, num / den);
    }
    if (threadIdx.x == 0) *counter = 0u;
}

extern "C" __global__ void __launch_bounds__(ATTN_WARPS * WARP)
paged_attention(const float* q, const void* kcache, const void* vcache, int kv_dtype,
                const unsigned int* block_tables, const int* items, const int* seqs,
                float* out, unsigned short* out16, int out_dtype, float* part_acc,
                float* part_ml, unsigned int* split_counters, int num_heads, int num_kv_heads,
                int head_dim, int block_size, int rows_per_item, int min_keys_per_split,
                float scale) {
    // The o_proj GEMV after it may start streaming its weights (PD_CUDA_PDL, common.cuh);
    // this kernel waits for the q/k norm kernel's q and KV write before reading either.
    allow_dependents_to_launch();
    wait_for_inputs();
    extern __shared__ float smem[];
    const int item = blockIdx.x;
    const int kvh = blockIdx.y;
    const int split = blockIdx.z;
    const int splits = gridDim.z;
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    const int group = num_heads / num_kv_heads;

    const AttnItem it = attn_item(items, seqs, block_tables, item, rows_per_item);
    const unsigned int* table = it.table;
    const int rows_here = it.rows;
    const int pairs = rows_here * group;
    const int q_width = num_heads * head_dim;
    const int stride = head_dim + 1;  // padded: lanes reading different keys hit different banks
    const int first_pos = it.first_pos;

    // Keys this block may need: causal up to the item's last row, within this split.
    const int key_end_item = first_pos + rows_here;
    const int used = min(splits, max(1, (key_end_item + min_keys_per_split - 1) /
                                            max(1, min_keys_per_split)));
    const int keys_per_split =
        ((key_end_item + used - 1) / used + TILE_KEYS - 1) / TILE_KEYS * TILE_KEYS;
    const int k_begin = split * keys_per_split;
    const int k_end = min(key_end_item, k_begin + keys_per_split);
    const unsigned long long split_base = ((unsigned long long)item * num_kv_heads + kvh) * splits;
    const unsigned long long part_base = split_base + split;
    unsigned int* counter = split_counters + item * num_kv_heads + kvh;
    const unsigned long long out_row = (unsigned long long)it.row;

    if (k_begin >= k_end) {
        // Nothing for this split (only when splits > 1): mark it empty for the merge.
        for (int p = threadIdx.x; p < MAX_PAIRS; p += blockDim.x) {
            part_ml[2 * ((part_base * MAX_PAIRS) + p)] = -INFINITY;
            part_ml[2 * ((part_base * MAX_PAIRS) + p) + 1] = 0.0f;
        }
        merge_splits(part_acc, part_ml, counter, split_base, splits, pairs, head_dim, group, kvh,
                     out_row, q_width, out, out16, out_dtype);
        return;
    }

    float* q_s = smem;
    float* k_s = q_s + MAX_PAIRS * head_dim;
    float* v_s = k_s + TILE_KEYS * stride;

    for (int i = threadIdx.x; i < pairs * head_dim; i += blockDim.x) {
        const int p = i / head_dim;
        const int d = i % head_dim;
        const int r = p / group;
        const int h = kvh * group + p % group;
        q_s[i] = q[(out_row + r) * q_width + h * head_dim + d];
    }

    float m[PAIRS_PER_WARP];
    float l[PAIRS_PER_WARP];
    float acc[PAIRS_PER_WARP][DIMS_PER_LANE];
    #pragma unroll
    for (int pp = 0; pp < PAIRS_PER_WARP; ++pp) {
        m[pp] = -INFINITY;
        l[pp] = 0.0f;
        #pragma unroll
        for (int i = 0; i < DIMS_PER_LANE; ++i) acc[pp][i] = 0.0f;
    }

    const KvQuads lq = kv_quads(head_dim, block_size);  // tile loads, 4 dimensions a thread

    for (int t0 = k_begin; t0 < k_end; t0 += TILE_KEYS) {
        __syncthreads();  // q_s written / the previous tile fully consumed
        for (int j = threadIdx.x / (head_dim / 4); lq.loader && j < TILE_KEYS; j += lq.row_step) {
            float kv_k[4], kv_v[4];
            load_kv_quad(lq, kcache, vcache, kv_dtype, table, t0 + j, k_end, num_kv_heads, kvh,
                         head_dim, kv_k, kv_v);
            #pragma unroll
            for (int e = 0; e < 4; ++e) {
                k_s[j * stride + lq.d4 + e] = kv_k[e];
                v_s[j * stride + lq.d4 + e] = kv_v[e];
            }
        }
        __syncthreads();

        #pragma unroll
        for (int pp = 0; pp < PAIRS_PER_WARP; ++pp) {
            const int p = warp + pp * ATTN_WARPS;
            if (p >= pairs) continue;  // uniform across the warp
            const int pos = first_pos + p / group;
            const int t = t0 + lane;
            float s = -INFINITY;
            if (t < k_end && t <= pos) {
                const float* qp = q_s + p * head_dim;
                const float* kp = k_s + lane * stride;
                float dot = 0.0f;
                for (int d = 0; d < head_dim; ++d) dot += qp[d] * kp[d];
                s = dot * scale;
            }
            const float m_new = fmaxf(m[pp], warp_max(s));
            if (m_new == -INFINITY) continue;  // no visible key yet (uniform: a warp max)
            const float pj = s == -INFINITY ? 0.0f : expf(s - m_new);
            const float alpha = expf(m[pp] - m_new);
            l[pp] = l[pp] * alpha + warp_sum(pj);
            #pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) acc[pp][i] *= alpha;
            for (int j = 0; j < TILE_KEYS; ++j) {
                const float pjj = __shfl_sync(FULL_MASK, pj, j);
                const float* vp = v_s + j * stride;
                #pragma unroll
                for (int i = 0; i < DIMS_PER_LANE; ++i) {
                    const int d = lane + i * WARP;
                    if (d < head_dim) acc[pp][i] += pjj * vp[d];
                }
            }
            m[pp] = m_new;
        }
    }

    #pragma unroll
    for (int pp = 0; pp < PAIRS_PER_WARP; ++pp) {
        const int p = warp + pp * ATTN_WARPS;
        if (p >= pairs) continue;
        const int r = p / group;
        const int h = kvh * group + p % group;
        if (splits == 1) {
            const float inv = 1.0f / l[pp];
            const unsigned long long o =
                (out_row + r) * q_width + h * head_dim;
            #pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) {
                const int d = lane + i * WARP;
                if (d < head_dim) store_out(out, out16, out_dtype, o + d, acc[pp][i] * inv);
            }
        } else {
            const unsigned long long at = part_base * MAX_PAIRS + p;
            #pragma unroll
            for (int i = 0; i < DIMS_PER_LANE; ++i) {
                const int d = lane + i * WARP;
                if (d < head_dim) part_acc[at * head_dim + d] = acc[pp][i];
            }
            if (lane == 0) {
                part_ml[2 * at] = m[pp];
                part_ml[2 * at + 1] = l[pp];
            }
        }
    }
    if (splits > 1) {
        merge_splits(part_acc, part_ml, counter, split_base, splits, pairs, head_dim, group, kvh,
                     out_row, q_width, out, out16, out_dtype);
    }
}
