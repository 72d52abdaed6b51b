// pd-cuda-emu, host side shared by the stand-in driver (driver.cpp), cuBLAS (cublas.cpp) and
// the kernel translation units: the kernel registry, grid execution, device memory
// bookkeeping and the stream (immediate execution, or recording while a capture is active).
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <string>
#include <tuple>
#include <type_traits>
#include <utility>
#include <vector>

#include "emu.h"

namespace emu {

struct LaunchShape {
    dim3 grid, block;
    unsigned shared_bytes = 0;
};

// A kernel as the driver sees it: its name, launch bounds and parameter list (from the C++
// signature itself, so a launch is unpacked exactly as the kernel declares it).
struct Kernel {
    const char* name = nullptr;
    unsigned max_threads = 0;  // __launch_bounds__, 0 if none
    // Most dynamic shared memory a launch may ask for: 48 KiB unless opted in.
    mutable unsigned max_dynamic_shared = EMU_DYNAMIC_SHARED_BYTES;
    std::vector<size_t> param_sizes;
    std::vector<bool> param_is_pointer;
    virtual ~Kernel() = default;
    // `params` as cuLaunchKernel receives them: one pointer to each argument's value.
    virtual void run(void* const* params, const LaunchShape& shape) const = 0;
};

void register_kernel(Kernel* k);
const Kernel* find_kernel(const std::string& name);

// Run `body` once per thread of every block of `shape` (fibers, see emu.h).
void run_grid(const char* kernel, const LaunchShape& shape, const std::function<void()>& body);

template <typename... A>
struct KernelOf final : Kernel {
    void (*f)(A...);
    KernelOf(const char* n, unsigned bounds, void (*fn)(A...)) : f(fn) {
        name = n;
        max_threads = bounds;
        param_sizes = {sizeof(A)...};
        param_is_pointer = {std::is_pointer_v<A>...};
        register_kernel(this);
    }
    void run(void* const* params, const LaunchShape& shape) const override {
        run_with(params, shape, std::index_sequence_for<A...>{});
    }

  private:
    template <size_t... I>
    void run_with(void* const* params, const LaunchShape& shape, std::index_sequence<I...>) const {
        std::tuple<A...> args{*static_cast<const A*>(params[I])...};
        (void)params;
        run_grid(name, shape, [&] { std::apply(f, args); });
    }
};

// Device memory: every allocation is tracked, poisoned on allocation (0xff: NaN as f32) and
// followed by guard bytes checked after every operation.
bool in_device_memory(uint64_t ptr, size_t bytes);
// Stops the process with a report if an operation wrote past the end of an allocation.
void check_guards(const char* after);

// Run `op` on `stream` (a CUstream; null is the legacy default stream): at once, or recorded
// into the graph being captured on it. Returns a CUresult.
int submit(void* stream, const std::function<void()>& op);
// Whether `stream` is capturing a graph.
bool capturing(void* stream);

// What the host asked of the device, for PD_CUDA_EMU_STATS=FILE (written at exit): on a GPU
// each host-issued launch and copy costs CPU time and latency, which graphs avoid.
enum class Stat {
    LaunchIssued,    // cuLaunchKernel outside a capture
    GemmIssued,      // cublasGemmEx outside a capture
    GraphLaunch,     // cuGraphLaunch
    KernelRun,       // kernels executed, graph replays included
    CopyHtoD,        // bytes
    CopyDtoH,        // bytes
    CopyDtoD,        // bytes
    CopiesHtoD,      // calls
    CopiesDtoH,      // calls
    Sync,            // cuStreamSynchronize
    Alloc,           // cuMemAlloc / cuMemAllocAsync
    Count_,
};
void count(Stat what, uint64_t n = 1);

// Fail loudly: the emulator reports a defect in the code under test and stops the process.
[[noreturn]] void fatal(const std::string& message);

}  // namespace emu

#define EMU_KERNEL(fn, bounds) static emu::KernelOf emu_kernel_##fn(#fn, bounds, &fn);
