// pd-cuda-emu: a stand-in for cuBLAS (libcublas.so), as much as pd-kernels calls: a handle
// bound to a stream and cublasGemmEx with f32 / f16 / bf16 inputs, f32 output and f32
// accumulation. Arguments are checked as cuBLAS checks them, and every matrix must lie in
// device memory.
#include <algorithm>
#include <cstdio>
#include <cstring>
#include <string>
#include <thread>

#include "runtime.h"

#define API extern "C" __attribute__((visibility("default")))

typedef int cublasStatus_t;
enum : int {
    CUBLAS_STATUS_SUCCESS = 0,
    CUBLAS_STATUS_INVALID_VALUE = 7,
    CUBLAS_STATUS_EXECUTION_FAILED = 13,
    CUBLAS_STATUS_NOT_SUPPORTED = 15,
};
enum : int { CUBLAS_OP_N = 0, CUBLAS_OP_T = 1 };
enum : int { CUDA_R_32F = 0, CUDA_R_16F = 2, CUDA_R_16BF = 14 };
enum : int { CUBLAS_COMPUTE_32F = 68 };

namespace {

struct Handle {
    void* stream = nullptr;
};

cublasStatus_t fail(cublasStatus_t code, const std::string& why) {
    std::fprintf(stderr, "pd-cuda-emu: cublas status %d: %s\n", code, why.c_str());
    return code;
}

size_t type_size(int t) { return t == CUDA_R_32F ? 4 : 2; }


// `n` elements of a 16/32-bit type from `base`, `stride` elements apart, as f32.
void load_run(const void* base, int type, size_t first, size_t stride, size_t n, float* out) {
    if (type == CUDA_R_32F) {
        const float* p = static_cast<const float*>(base) + first;
        for (size_t i = 0; i < n; ++i) out[i] = p[i * stride];
    } else if (type == CUDA_R_16BF) {
        const unsigned short* p = static_cast<const unsigned short*>(base) + first;
        for (size_t i = 0; i < n; ++i) {
            const unsigned bits = (unsigned)p[i * stride] << 16;
            std::memcpy(&out[i], &bits, 4);
        }
    } else {
        const unsigned short* p = static_cast<const unsigned short*>(base) + first;
        for (size_t i = 0; i < n; ++i) out[i] = emu::f16_to_f32(p[i * stride]);
    }
}

// Element (row, col) of op(M) for column-major M with leading dimension ld.
size_t at(int op, size_t row, size_t col, size_t ld) {
    return op == CUBLAS_OP_N ? row + col * ld : col + row * ld;
}

float dot(const float* a, const float* b, size_t k) {
    float s[8] = {0, 0, 0, 0, 0, 0, 0, 0};
    size_t l = 0;
    for (; l + 8 <= k; l += 8) {
        for (int j = 0; j < 8; ++j) s[j] += a[l + j] * b[l + j];
    }
    for (; l < k; ++l) s[0] += a[l] * b[l];
    return ((s[0] + s[1]) + (s[2] + s[3])) + ((s[4] + s[5]) + (s[6] + s[7]));
}

}  // namespace

API cublasStatus_t cublasCreate_v2(void** handle) {
    *handle = new Handle();
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasDestroy_v2(void* handle) {
    delete static_cast<Handle*>(handle);
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasSetStream_v2(void* handle, void* stream) {
    static_cast<Handle*>(handle)->stream = stream;
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasGetStream_v2(void* handle, void** stream) {
    *stream = static_cast<Handle*>(handle)->stream;
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasSetWorkspace_v2(void*, void* ws, size_t bytes) {
    if (bytes > 0 && !emu::in_device_memory((uint64_t)ws, bytes)) {
        return fail(CUBLAS_STATUS_INVALID_VALUE, "workspace is not device memory");
    }
    return CUBLAS_STATUS_SUCCESS;
}
API cublasStatus_t cublasSetMathMode(void*, int) { return CUBLAS_STATUS_SUCCESS; }

// C = alpha op(A) op(B) + beta C, column-major, C m x n, op(A) m x k, op(B) k x n.
API cublasStatus_t cublasGemmEx(void* handle, int transa, int transb, int m, int n, int k,
                                const void* alpha, const void* A, int atype, int lda,
                                const void* B, int btype, int ldb, const void* beta, void* C,
                                int ctype, int ldc, int compute, int /*algo*/) {
    auto* h = static_cast<Handle*>(handle);
    if (h == nullptr) return fail(CUBLAS_STATUS_INVALID_VALUE, "null handle");
    if ((transa != CUBLAS_OP_N && transa != CUBLAS_OP_T) ||
        (transb != CUBLAS_OP_N && transb != CUBLAS_OP_T) || m < 0 || n < 0 || k < 0 ||
        lda < std::max(1, transa == CUBLAS_OP_N ? m : k) ||
        ldb < std::max(1, transb == CUBLAS_OP_N ? k : n) || ldc < std::max(1, m)) {
        return fail(CUBLAS_STATUS_INVALID_VALUE,
                    "cublasGemmEx m=" + std::to_string(m) + " n=" + std::to_string(n) +
                        " k=" + std::to_string(k) + " lda=" + std::to_string(lda) +
                        " ldb=" + std::to_string(ldb) + " ldc=" + std::to_string(ldc));
    }
    const bool ok_type = atype == btype &&
                         (atype == CUDA_R_32F || atype == CUDA_R_16F || atype == CUDA_R_16BF);
    if (!ok_type || ctype != CUDA_R_32F || compute != CUBLAS_COMPUTE_32F) {
        return fail(CUBLAS_STATUS_NOT_SUPPORTED, "cublasGemmEx type combination");
    }
    if (m == 0 || n == 0) return CUBLAS_STATUS_SUCCESS;
    // Extents: the last element of each matrix must be in the same allocation as the first.
    const size_t a_cols = transa == CUBLAS_OP_N ? k : m;
    const size_t b_cols = transb == CUBLAS_OP_N ? n : k;
    const size_t a_rows = transa == CUBLAS_OP_N ? m : k;
    const size_t b_rows = transb == CUBLAS_OP_N ? k : n;
    const size_t a_bytes = ((a_cols - 1) * lda + a_rows) * type_size(atype);
    const size_t b_bytes = ((b_cols - 1) * ldb + b_rows) * type_size(btype);
    const size_t c_bytes = ((size_t)(n - 1) * ldc + m) * 4;
    if ((k > 0 && !emu::in_device_memory((uint64_t)A, a_bytes)) ||
        (k > 0 && !emu::in_device_memory((uint64_t)B, b_bytes)) ||
        !emu::in_device_memory((uint64_t)C, c_bytes)) {
        return fail(CUBLAS_STATUS_EXECUTION_FAILED,
                    "cublasGemmEx: a matrix is not (wholly) in device memory");
    }
    const float al = *static_cast<const float*>(alpha);
    const float be = *static_cast<const float*>(beta);
    if (!emu::capturing(h->stream)) emu::count(emu::Stat::GemmIssued);
    const int status = emu::submit(h->stream, [=] {
        // op(B) column j and op(A) row i as contiguous f32 vectors, then dot products.
        std::vector<float> bt((size_t)n * k);
        // Column j of op(B) starts at at(transb, 0, j) and steps by at(transb, 1, 0).
        for (size_t j = 0; j < (size_t)n; ++j) {
            load_run(B, btype, at(transb, 0, j, ldb), at(transb, 1, 0, ldb), k, &bt[j * k]);
        }
        auto rows = [&](size_t i0, size_t i1) {
            std::vector<float> a(k);
            for (size_t i = i0; i < i1; ++i) {
                load_run(A, atype, at(transa, i, 0, lda), at(transa, 0, 1, lda), k, a.data());
                for (size_t j = 0; j < (size_t)n; ++j) {
                    float* c = static_cast<float*>(C) + i + j * (size_t)ldc;
                    const float v = al * dot(a.data(), &bt[j * k], k);
                    *c = be == 0.0f ? v : v + be * *c;  // beta 0: C is not read (may be NaN)
                }
            }
        };
        const size_t work = (size_t)m * n * std::max(k, 1);
        const size_t threads =
            work < (1u << 20) ? 1 : std::max(1u, std::min(8u, std::thread::hardware_concurrency()));
        std::vector<std::thread> pool;
        for (size_t t = 1; t < threads; ++t) {
            pool.emplace_back(rows, m * t / threads, m * (t + 1) / threads);
        }
        rows(0, m / threads);
        for (auto& t : pool) t.join();
        emu::check_guards("cublasGemmEx");
    });
    return status == 0 ? CUBLAS_STATUS_SUCCESS : CUBLAS_STATUS_EXECUTION_FAILED;
}
