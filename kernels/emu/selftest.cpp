// pd-cuda-emu's own test: the device semantics the kernels rely on, each checked against
// what CUDA specifies (warp shuffles, ballot, __syncthreads_count, shared memory ordered by
// barriers, thread and block indices, f16 rounding, the tensor-core mma's fragment
// layouts), in both schedule orders, and that a divergent __syncthreads stops the process
// instead of passing. Built and run by
// kernels/emu/build.sh's caller (scripts/cuda-check.sh).
#include <sys/wait.h>
#include <unistd.h>

#include <cstdio>
#include <cstdlib>
#include <csignal>
#include <string>
#include <vector>

#include "runtime.h"

#define FULL_MASK 0xffffffffu

extern "C" __global__ void shuffles(unsigned* out) {
    const unsigned lane = threadIdx.x % 32;
    unsigned sum = lane + 1;
    for (int o = 16; o > 0; o /= 2) sum += __shfl_xor_sync(FULL_MASK, sum, o);
    const unsigned from5 = __shfl_sync(FULL_MASK, lane * 10, 5);
    const unsigned ballot = __ballot_sync(FULL_MASK, lane % 3 == 0);
    const int below = __syncthreads_count(threadIdx.x < 37);
    out[4 * threadIdx.x] = sum;
    out[4 * threadIdx.x + 1] = from5;
    out[4 * threadIdx.x + 2] = ballot;
    out[4 * threadIdx.x + 3] = (unsigned)below;
}

extern "C" __global__ void rotate(const unsigned* in, unsigned* out) {
    __shared__ unsigned s[256];
    const unsigned t = threadIdx.x;
    for (int round = 0; round < 3; ++round) {
        s[t] = (round == 0 ? in[blockIdx.x * blockDim.x + t] : s[t]) + 1;
        __syncthreads();
        const unsigned next = s[(t + 1) % blockDim.x];
        __syncthreads();
        s[t] = next;
        __syncthreads();
    }
    out[blockIdx.x * blockDim.x + t] = s[t];
}

extern "C" __global__ void indices(unsigned* out) {
    const unsigned block = blockIdx.y * gridDim.x + blockIdx.x;
    const unsigned thread = threadIdx.y * blockDim.x + threadIdx.x;
    out[block * blockDim.x * blockDim.y + thread] = block * 1000 + thread;
}

extern "C" __global__ void divergent(unsigned* out) {
    if (threadIdx.x < 16) __syncthreads();
    out[threadIdx.x] = 1;
}

// Fragments filled per the PTX ISA's formulas for mma.m16n8k16 (.f16 A / B, .f32 C / D),
// written out independently of the emulator's own tables: a lane's A element i, B element i
// and C element i, for groupID g = lane >> 2 and threadID_in_group t = lane % 4.
extern "C" __global__ void mma(const unsigned short* a_rows, const unsigned short* b_cols,
                               float* d_rows) {
    const int lane = threadIdx.x, g = lane >> 2, t = lane % 4;
    unsigned a[4] = {0, 0, 0, 0}, b[2] = {0, 0};
    for (int i = 0; i < 8; ++i) {
        const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
        const int col = t * 2 + (i & 1) + (i >= 4 ? 8 : 0);
        a[i / 2] |= (unsigned)a_rows[row * 16 + col] << (16 * (i % 2));
    }
    for (int i = 0; i < 4; ++i) {
        const int row = t * 2 + (i & 1) + (i >= 2 ? 8 : 0);
        b[i / 2] |= (unsigned)b_cols[g * 16 + row] << (16 * (i % 2));
    }
    float d[4];
    for (int i = 0; i < 4; ++i) d[i] = (float)(i < 2 ? g : g + 8);  // C: the row index
    emu::mma_m16n8k16_f16(d, a, b);
    for (int i = 0; i < 4; ++i) d_rows[(i < 2 ? g : g + 8) * 8 + t * 2 + (i & 1)] = d[i];
}

EMU_KERNEL(shuffles, 0)
EMU_KERNEL(mma, 0)
EMU_KERNEL(rotate, 0)
EMU_KERNEL(indices, 0)
EMU_KERNEL(divergent, 0)

static int failures = 0;

static void expect(bool ok, const std::string& what) {
    if (!ok) {
        std::fprintf(stderr, "FAILED: %s\n", what.c_str());
        ++failures;
    }
}

template <typename... A>
static void launch(const char* name, emu::dim3 grid, emu::dim3 block, A... args) {
    void* params[] = {&args...};
    emu::find_kernel(name)->run(params, emu::LaunchShape{grid, block, 0});
}

static void run_all(const char* order) {
    const std::string o = std::string(" (") + order + ")";
    std::vector<unsigned> out(4 * 64);
    launch("shuffles", {1, 1, 1}, {64, 1, 1}, out.data());
    for (unsigned t = 0; t < 64; ++t) {
        expect(out[4 * t] == 528, "xor butterfly sums lanes 1..32" + o);
        expect(out[4 * t + 1] == 50, "__shfl_sync reads lane 5" + o);
        expect(out[4 * t + 2] == 0x49249249u, "__ballot_sync sets lanes 0, 3, 6, ..." + o);
        expect(out[4 * t + 3] == 37, "__syncthreads_count counts the block" + o);
    }
    const unsigned n = 2 * 96;
    std::vector<unsigned> in(n), rotated(n);
    for (unsigned i = 0; i < n; ++i) in[i] = i * 7;
    launch("rotate", {2, 1, 1}, {96, 1, 1}, (const unsigned*)in.data(), rotated.data());
    for (unsigned b = 0; b < 2; ++b) {
        for (unsigned t = 0; t < 96; ++t) {
            // Three rounds: +1, then take the right neighbour's value.
            expect(rotated[b * 96 + t] == in[b * 96 + (t + 3) % 96] + 3,
                   "shared memory ordered by __syncthreads" + o);
        }
    }
    // D = A B + C with small integers (exact in f16 and f32): A[r][k] = r - k,
    // B[k][n] = k + 2n, C[r][n] = r.
    std::vector<unsigned short> a(16 * 16), b(8 * 16);
    for (int r = 0; r < 16; ++r) {
        for (int k = 0; k < 16; ++k) a[r * 16 + k] = emu::f32_to_f16((float)(r - k));
    }
    for (int n = 0; n < 8; ++n) {
        for (int k = 0; k < 16; ++k) b[n * 16 + k] = emu::f32_to_f16((float)(k + 2 * n));
    }
    std::vector<float> d(16 * 8, -1.0f);
    launch("mma", {1, 1, 1}, {32, 1, 1}, (const unsigned short*)a.data(),
           (const unsigned short*)b.data(), d.data());
    for (int r = 0; r < 16; ++r) {
        for (int n = 0; n < 8; ++n) {
            float want = (float)r;
            for (int k = 0; k < 16; ++k) want += (float)((r - k) * (k + 2 * n));
            expect(d[r * 8 + n] == want, "mma.m16n8k16 D[" + std::to_string(r) + "][" +
                                             std::to_string(n) + "] = (A B + C)" + o);
        }
    }
    std::vector<unsigned> idx(3 * 2 * 8 * 4);
    launch("indices", {3, 2, 1}, {8, 4, 1}, idx.data());
    for (unsigned block = 0; block < 6; ++block) {
        for (unsigned t = 0; t < 32; ++t) {
            expect(idx[block * 32 + t] == block * 1000 + t, "blockIdx / threadIdx in 2D" + o);
        }
    }
}

int main() {
    run_all(std::getenv("PD_CUDA_EMU_SCHEDULE") ? std::getenv("PD_CUDA_EMU_SCHEDULE") : "forward");
    expect(emu::f32_to_f16(1.0f) == 0x3c00 && emu::f16_to_f32(0x3c00) == 1.0f, "f16 of 1.0");
    expect(emu::f32_to_f16(65520.0f) == 0x7c00, "f16 rounds 65520 to +inf (nearest even)");
    expect(emu::f32_to_f16(1.0f + 1.0f / 2048) == 0x3c00, "f16 ties round to even");
    // A divergent barrier must stop the process (in a child, to survive it).
    std::fflush(nullptr);
    const pid_t child = fork();
    if (child == 0) {
        std::freopen("/dev/null", "w", stderr);
        std::vector<unsigned> out(32);
        launch("divergent", {1, 1, 1}, {32, 1, 1}, out.data());
        std::_Exit(0);
    }
    int status = 0;
    waitpid(child, &status, 0);
    expect(WIFSIGNALED(status) && WTERMSIG(status) == SIGABRT,
           "a __syncthreads reached by half the block stops the process");
    if (failures > 0) {
        std::fprintf(stderr, "pd-cuda-emu self-test: %d failures\n", failures);
        return 1;
    }
    std::printf("pd-cuda-emu self-test: ok\n");
    return 0;
}
