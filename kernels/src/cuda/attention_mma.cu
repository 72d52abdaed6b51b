// Paged causal grouped-query attention on tensor cores, for prefill of 16-bit models
// (flash-attention-2 style; the f32 kernel of attention.cu serves decode and f32 models):
// - grid.x: work items, each up to `rows_per_item` query rows of one sequence (the same
//   metadata as paged_attention: items, seqs, block tables); grid.y: KV heads. No key splits:
//   prefill has items enough to fill the device.
// - The block's MMA_PAIRS (query row, head) pairs of one KV head's group go 16 to a warp:
//   the m of mma.m16n8k16. Each warp keeps its queries as f16 A fragments in registers.
// - Keys and values stream through shared memory in tiles of MMA_TILE keys, converted to f16
//   (saturating) on the way in. Per tile a warp computes S = Q Kᵀ (f32 accumulators), masks
//   it causally, updates the online softmax of its rows in f32, and adds P V with P rounded
//   to f16 straight from the S accumulators (their layout is the A fragment's).
// - The output (f32 rows, or the o_proj GEMM's 16-bit input) is normalised at the end.
// The parameters are paged_attention's, so one launch serves both kernels; the split-K ones
// (part_acc, part_ml, split_counters, min_keys_per_split) are unused here.
// f16 rather than bf16 operands: 3 more mantissa bits at the same speed; scores and the
// softmax stay f32. The lane layouts are the PTX ISA's for mma.m16n8k16 (see common.cuh):
// lane = 4 * g + t holds rows g and g + 8 and columns 2t, 2t + 1 (+ 8) of each fragment.

#define MMA_WARPS 4
#define MMA_ROWS 16
#define MMA_PAIRS (MMA_WARPS * MMA_ROWS)
#define MMA_TILE 64
#define MMA_PAD 8  // halves per shared row: rows 68 words apart spread a warp's reads over all banks
#define MMA_MAX_DIM 128
#define LOG2E 1.4426950408889634f

extern "C" __global__ void __launch_bounds__(MMA_WARPS * WARP, 1)
attention_mma(const float* q, const void* kcache, const void* vcache, int kv_dtype,
              const unsigned int* block_tables, const int* items, const int* seqs, float* out,
              unsigned short* out16, int out_dtype, float* part_acc, float* part_ml,
              unsigned int* split_counters, int num_heads, int num_kv_heads, int head_dim,
              int block_size, int rows_per_item, int min_keys_per_split, float scale) {
    extern __shared__ float smem[];
    const int stride = head_dim + MMA_PAD;
    unsigned short* k_s = (unsigned short*)smem;  // [MMA_TILE][stride], key-major
    unsigned short* v_s = k_s + MMA_TILE * stride;  // [MMA_TILE][stride], key-major

    const int item = blockIdx.x;
    const int kvh = blockIdx.y;
    const int lane = threadIdx.x % WARP;
    const int warp = threadIdx.x / WARP;
    const int g = lane >> 2;
    const int t = lane & 3;
    const int group = num_heads / num_kv_heads;

    const AttnItem it = attn_item(items, seqs, block_tables, item, rows_per_item);
    const unsigned int* table = it.table;
    const int rows_here = it.rows;
    const int pairs = rows_here * group;
    const int q_width = num_heads * head_dim;
    const int first_pos = it.first_pos;
    const unsigned long long row0 = (unsigned long long)it.row;
    const int key_end = first_pos + rows_here;  // keys any row of the item may see
    const int k_steps = head_dim / 16;          // of S = Q Kᵀ
    const int dim_tiles = head_dim / 8;         // of O += P V
    const float scale_log2 = scale * LOG2E;     // softmax in base 2: exp2f of scaled scores

    // This lane's two rows: pairs p_lo and p_hi of the block. A pair past the item's end
    // sees no key (position -1), so its row stays empty and is never stored.
    const int p_lo = warp * MMA_ROWS + g;
    const int p_hi = p_lo + 8;
    const int pos_lo = p_lo < pairs ? first_pos + p_lo / group : -1;
    const int pos_hi = p_hi < pairs ? first_pos + p_hi / group : -1;
    const bool warp_busy = warp * MMA_ROWS < pairs;
    const int warp_last_pos = first_pos + (min(warp * MMA_ROWS + MMA_ROWS, pairs) - 1) / group;

    // The warp's queries as A fragments: row p's head is kvh * group + p % group.
    unsigned qa[MMA_MAX_DIM / 16][4];
    const float* q_lo = q + (row0 + p_lo / group) * q_width +
                        (kvh * group + p_lo % group) * head_dim;
    const float* q_hi = q + (row0 + p_hi / group) * q_width +
                        (kvh * group + p_hi % group) * head_dim;
    #pragma unroll
    for (int ks = 0; ks < MMA_MAX_DIM / 16; ++ks) {
        if (ks >= k_steps) break;
        const int c = ks * 16 + 2 * t;
        const bool lo = p_lo < pairs;
        const bool hi = p_hi < pairs;
        qa[ks][0] = lo ? pack_f16(q_lo[c], q_lo[c + 1]) : 0u;
        qa[ks][1] = hi ? pack_f16(q_hi[c], q_hi[c + 1]) : 0u;
        qa[ks][2] = lo ? pack_f16(q_lo[c + 8], q_lo[c + 9]) : 0u;
        qa[ks][3] = hi ? pack_f16(q_hi[c + 8], q_hi[c + 9]) : 0u;
    }

    float o[MMA_MAX_DIM / 8][4];
    #pragma unroll
    for (int dt = 0; dt < MMA_MAX_DIM / 8; ++dt) {
        o[dt][0] = o[dt][1] = o[dt][2] = o[dt][3] = 0.0f;
    }
    // Running max (base-2 scaled scores) and this lane's part of the row sums.
    float m_lo = -INFINITY, m_hi = -INFINITY;
    float l_lo = 0.0f, l_hi = 0.0f;

    // Tile loads (kv_quads): one 8-byte store of 4 f16 values of K and of V per key.
    const KvQuads lq = kv_quads(head_dim, block_size);

    for (int t0 = 0; t0 < key_end; t0 += MMA_TILE) {
        __syncthreads();  // the previous tile fully consumed
        for (int j = threadIdx.x / (head_dim / 4); lq.loader && j < MMA_TILE; j += lq.row_step) {
            float kk[4], vv[4];
            load_kv_quad(lq, kcache, vcache, kv_dtype, table, t0 + j, key_end, num_kv_heads, kvh,
                         head_dim, kk, vv);
            const int at = j * stride + lq.d4;
            store_pairs(k_s + at, pack_f16(kk[0], kk[1]), pack_f16(kk[2], kk[3]));
            store_pairs(v_s + at, pack_f16(vv[0], vv[1]), pack_f16(vv[2], vv[3]));
        }
        __syncthreads();
        if (!warp_busy || t0 > warp_last_pos) continue;  // warp-uniform: nothing visible

        // S = Q Kᵀ: n-tile nt covers keys t0 + 8 nt .. + 7; B column g is key 8 nt + g.
        float s[MMA_TILE / 8][4];
        #pragma unroll
        for (int nt = 0; nt < MMA_TILE / 8; ++nt) {
            s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
            const unsigned short* krow = k_s + (nt * 8 + g) * stride + 2 * t;
            #pragma unroll
            for (int ks = 0; ks < MMA_MAX_DIM / 16; ++ks) {
                if (ks >= k_steps) break;
                const unsigned b[2] = {load_pair(krow + ks * 16), load_pair(krow + ks * 16 + 8)};
                mma_16816_f16(s[nt], qa[ks], b);
            }
        }

        // Causal mask and scale; the new running max of each row (its 4 lanes agree).
        float mx_lo = -INFINITY, mx_hi = -INFINITY;
        #pragma unroll
        for (int nt = 0; nt < MMA_TILE / 8; ++nt) {
            #pragma unroll
            for (int e = 0; e < 2; ++e) {
                const int key = t0 + nt * 8 + 2 * t + e;
                s[nt][e] = key <= pos_lo ? s[nt][e] * scale_log2 : -INFINITY;
                s[nt][2 + e] = key <= pos_hi ? s[nt][2 + e] * scale_log2 : -INFINITY;
                mx_lo = fmaxf(mx_lo, s[nt][e]);
                mx_hi = fmaxf(mx_hi, s[nt][2 + e]);
            }
        }
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(FULL_MASK, mx_lo, 1));
        mx_lo = fmaxf(mx_lo, __shfl_xor_sync(FULL_MASK, mx_lo, 2));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(FULL_MASK, mx_hi, 1));
        mx_hi = fmaxf(mx_hi, __shfl_xor_sync(FULL_MASK, mx_hi, 2));
        const float new_lo = fmaxf(m_lo, mx_lo);
        const float new_hi = fmaxf(m_hi, mx_hi);
        // A row with no visible key yet keeps max -inf: its p are 0 and nothing rescales.
        const float base_lo = new_lo == -INFINITY ? 0.0f : new_lo;
        const float base_hi = new_hi == -INFINITY ? 0.0f : new_hi;
        const float alpha_lo = exp2f(m_lo - base_lo);
        const float alpha_hi = exp2f(m_hi - base_hi);
        m_lo = new_lo;
        m_hi = new_hi;
        float sum_lo = 0.0f, sum_hi = 0.0f;
        #pragma unroll
        for (int nt = 0; nt < MMA_TILE / 8; ++nt) {
            s[nt][0] = exp2f(s[nt][0] - base_lo);
            s[nt][1] = exp2f(s[nt][1] - base_lo);
            s[nt][2] = exp2f(s[nt][2] - base_hi);
            s[nt][3] = exp2f(s[nt][3] - base_hi);
            sum_lo += s[nt][0] + s[nt][1];
            sum_hi += s[nt][2] + s[nt][3];
        }
        l_lo = l_lo * alpha_lo + sum_lo;
        l_hi = l_hi * alpha_hi + sum_hi;
        #pragma unroll
        for (int dt = 0; dt < MMA_MAX_DIM / 8; ++dt) {
            o[dt][0] *= alpha_lo;
            o[dt][1] *= alpha_lo;
            o[dt][2] *= alpha_hi;
            o[dt][3] *= alpha_hi;
        }

        // O += P V: k-step kk covers keys 16 kk .. + 15 of the tile, i.e. S n-tiles 2 kk and
        // 2 kk + 1, whose accumulators are already laid out as A's registers 0-1 and 2-3.
        #pragma unroll
        for (int kk = 0; kk < MMA_TILE / 16; ++kk) {
            const unsigned a[4] = {
                pack_f16(s[2 * kk][0], s[2 * kk][1]),
                pack_f16(s[2 * kk][2], s[2 * kk][3]),
                pack_f16(s[2 * kk + 1][0], s[2 * kk + 1][1]),
                pack_f16(s[2 * kk + 1][2], s[2 * kk + 1][3]),
            };
            // B rows are keys 16 kk + 2t (+1, +8, +9), its column g is dimension 8 dt + g.
            const unsigned short* vrow = v_s + (kk * 16 + 2 * t) * stride + g;
            #pragma unroll
            for (int dt = 0; dt < MMA_MAX_DIM / 8; ++dt) {
                if (dt >= dim_tiles) break;
                const unsigned short* v = vrow + dt * 8;
                const unsigned b[2] = {
                    (unsigned)v[0] | ((unsigned)v[stride] << 16),
                    (unsigned)v[8 * stride] | ((unsigned)v[9 * stride] << 16),
                };
                mma_16816_f16(o[dt], a, b);
            }
        }
    }

    // Row sums over the row's 4 lanes, then each lane's columns 2t, 2t + 1 of every n-tile.
    l_lo += __shfl_xor_sync(FULL_MASK, l_lo, 1);
    l_lo += __shfl_xor_sync(FULL_MASK, l_lo, 2);
    l_hi += __shfl_xor_sync(FULL_MASK, l_hi, 1);
    l_hi += __shfl_xor_sync(FULL_MASK, l_hi, 2);
    const unsigned long long at_lo = (row0 + p_lo / group) * q_width +
                                     (kvh * group + p_lo % group) * head_dim;
    const unsigned long long at_hi = (row0 + p_hi / group) * q_width +
                                     (kvh * group + p_hi % group) * head_dim;
    const float inv_lo = 1.0f / l_lo;
    const float inv_hi = 1.0f / l_hi;
    #pragma unroll
    for (int dt = 0; dt < MMA_MAX_DIM / 8; ++dt) {
        if (dt >= dim_tiles) break;
        const int d = dt * 8 + 2 * t;
        if (p_lo < pairs) {
            store_out(out, out16, out_dtype, at_lo + d, o[dt][0] * inv_lo);
            store_out(out, out16, out_dtype, at_lo + d + 1, o[dt][1] * inv_lo);
        }
        if (p_hi < pairs) {
            store_out(out, out16, out_dtype, at_hi + d, o[dt][2] * inv_hi);
            store_out(out, out16, out_dtype, at_hi + d + 1, o[dt][3] * inv_hi);
        }
    }
}
