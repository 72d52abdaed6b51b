// The logits processors of device sampling (penalties, logit bias, allowed ids, bad words,
// the min_tokens mask) as per-id edits made by the host (pd_engine::sampling::device::
// Reshape): reshape_copy and reshape_edit write each edited row into a buffer of its own,
// which the sampling kernels (sample.cu) choose from; log-probabilities stay those of the raw
// row. The arithmetic is TokenEdit::apply's, operation for operation, with explicit
// round-to-nearest intrinsics (no FMA), so the edited logits equal the host's bit for bit.

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
