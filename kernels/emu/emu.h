// pd-cuda-emu, device side: what the kernel sources (kernels/src/cuda/*.cu) need from CUDA
// C++, emulated on the CPU so that the kernels themselves run in CI on machines without a GPU.
// Not a product path: the nodes never load this; scripts/cuda-emu-check.sh builds it into a
// stand-in libcuda.so / libcublas.so for the conformance suite (docs/cuda.md).
//
// One thread block runs at a time in the process (kernel execution holds one lock), each CUDA
// thread as a cooperatively scheduled fiber. A fiber runs until a barrier (__syncthreads, a
// warp shuffle / ballot) and yields; the scheduler releases a barrier once every live thread
// it covers has reached it, and stops the process with a report when none can be released (a
// divergent barrier). Hence plain globals below, not thread_local: TLS in a dlopen'ed library
// costs a call per access.
#pragma once

#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>

namespace emu {

struct dim3 {
    unsigned x = 1, y = 1, z = 1;
};

struct Thread {
    dim3 idx;
    unsigned linear = 0;
};

// The running fiber's thread index; the running block's indices.
extern Thread* t_thread;
extern dim3 t_block_idx, t_block_dim, t_grid_dim;

void syncthreads();
int syncthreads_count(int pred);
// Every lane in `mask` deposits `value`; each gets the value of lane `src(lane)`.
enum class Shuffle { Index, Xor };
uint64_t warp_shuffle(unsigned mask, uint64_t value, Shuffle kind, int arg);
unsigned warp_ballot(unsigned mask, int pred);
// PTX `mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32` with D = C: d += a · b over the
// whole warp (every lane must call it), each lane passing its own fragment registers.
void mma_m16n8k16_f16(float* d, const unsigned* a, const unsigned* b);

float f16_to_f32(unsigned short h);
unsigned short f32_to_f16(float f);

template <typename T>
T bits_as(uint64_t v) {
    T out;
    std::memcpy(&out, &v, sizeof(T));
    return out;
}

template <typename T>
uint64_t as_bits(T v) {
    uint64_t out = 0;
    std::memcpy(&out, &v, sizeof(T));
    return out;
}

}  // namespace emu

#define threadIdx (emu::t_thread->idx)
#define blockIdx (emu::t_block_idx)
#define blockDim (emu::t_block_dim)
#define gridDim (emu::t_grid_dim)

#define __global__
#define __device__
#define __forceinline__ inline
#define __launch_bounds__(...)
// Static shared arrays: one copy, as one block runs at a time.
#define __shared__ static
#define __restrict__

// Dynamic shared memory (`extern __shared__ float smem[];`): 48 KiB is the most a launch gets
// without opting in; a kernel opted in (cuFuncSetAttribute, MAX_DYNAMIC_SHARED_SIZE_BYTES)
// gets up to the device's opt-in limit, Hopper's 227 KiB (an A100's 163 KiB with
// PD_CUDA_EMU_CC=8.x).
#define EMU_DYNAMIC_SHARED_BYTES (48 * 1024)
#define EMU_OPTIN_SHARED_BYTES (227 * 1024)
#define EMU_OPTIN_SHARED_BYTES_SM80 (163 * 1024)
// 16-byte aligned, as a GPU aligns it (kernels read it in 16-byte loads).
alignas(16) extern float smem[EMU_OPTIN_SHARED_BYTES / sizeof(float)];

inline void __syncthreads() { emu::syncthreads(); }
// Blocks run one after another and memory is the host's: every write is already visible.
inline void __threadfence() {}
inline int __syncthreads_count(int pred) { return emu::syncthreads_count(pred); }

template <typename T>
inline T __shfl_xor_sync(unsigned mask, T v, int lane_mask) {
    return emu::bits_as<T>(emu::warp_shuffle(mask, emu::as_bits(v), emu::Shuffle::Xor, lane_mask));
}
template <typename T>
inline T __shfl_sync(unsigned mask, T v, int src_lane) {
    return emu::bits_as<T>(emu::warp_shuffle(mask, emu::as_bits(v), emu::Shuffle::Index, src_lane));
}
inline unsigned __ballot_sync(unsigned mask, int pred) { return emu::warp_ballot(mask, pred); }

inline float __uint_as_float(unsigned v) { return emu::bits_as<float>(v); }
inline unsigned __float_as_uint(float v) { return (unsigned)emu::as_bits(v); }
inline float __int_as_float(int v) { return emu::bits_as<float>((uint64_t)(uint32_t)v); }
inline int __float_as_int(float v) { return (int)(uint32_t)emu::as_bits(v); }
// Round-to-nearest arithmetic that is never contracted into an FMA (built -ffp-contract=off).
inline float __fmul_rn(float a, float b) { return a * b; }
inline float __fadd_rn(float a, float b) { return a + b; }
inline float __fsub_rn(float a, float b) { return a - b; }
inline float __fdiv_rn(float a, float b) { return a / b; }
inline double __dadd_rn(double a, double b) { return a + b; }
inline double __dmul_rn(double a, double b) { return a * b; }
inline double __dsub_rn(double a, double b) { return a - b; }
inline double __ddiv_rn(double a, double b) { return a / b; }
inline int __popc(unsigned v) { return __builtin_popcount(v); }
inline int __ffs(int v) { return __builtin_ffs(v); }
inline float rsqrtf(float v) { return 1.0f / std::sqrt(v); }

// Fibers interleave only at barriers, so these need not be atomic; they are anyway, to stay
// correct if blocks ever run on several OS threads.
template <typename T>
inline T atomicAdd(T* at, T v) {
    return __atomic_fetch_add(at, v, __ATOMIC_RELAXED);
}
inline float atomicAdd(float* at, float v) {
    float old = *at;
    float desired = old + v;
    while (!__atomic_compare_exchange(at, &old, &desired, false, __ATOMIC_RELAXED,
                                      __ATOMIC_RELAXED)) {
        desired = old + v;
    }
    return old;
}

using std::max;
using std::min;
