// pd-cuda-emu: a stand-in for the CUDA driver API (libcuda.so), as much of it as cudarc and
// pd-kernels call. One emulated device, "compute capability 9.0 with 132 multiprocessors"
// (an H100/H200's figures, so launch planning takes the same decisions as there;
// PD_CUDA_EMU_CC changes the first). Device
// memory is host memory; every operation runs synchronously on the calling thread, or is
// recorded while its stream captures a graph. Launches are validated as the driver does
// (block and grid limits, shared memory, __launch_bounds__), and more strictly: every pointer
// argument must lie in live device memory, and guard bytes after each allocation are checked
// after every operation.
#include <atomic>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <map>
#include <memory>
#include <mutex>
#include <set>
#include <string>

#include "runtime.h"

#define API extern "C" __attribute__((visibility("default")))

typedef int CUresult;
typedef unsigned long long CUdeviceptr;

enum : int {
    CUDA_SUCCESS = 0,
    CUDA_ERROR_INVALID_VALUE = 1,
    CUDA_ERROR_OUT_OF_MEMORY = 2,
    CUDA_ERROR_INVALID_DEVICE = 101,
    CUDA_ERROR_INVALID_IMAGE = 200,
    CUDA_ERROR_INVALID_HANDLE = 400,
    CUDA_ERROR_NOT_FOUND = 500,
    CUDA_ERROR_ILLEGAL_ADDRESS = 700,
    CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES = 701,
    CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED = 900,
};

namespace emu {
namespace {

constexpr size_t kGuard = 256;
constexpr unsigned char kGuardByte = 0xa5;

struct Alloc {
    size_t size;
    bool graph_owned;
};

struct Graph {
    std::vector<std::function<void()>> nodes;
    std::vector<uint64_t> memory;  // allocations made while capturing: the graph's
};

struct Stream {
    Graph* capture = nullptr;
};

struct Event {
    std::chrono::steady_clock::time_point at;
};

struct Module {
    std::set<std::string> entries;
};

std::recursive_mutex g_lock;
std::map<uint64_t, Alloc>& allocations() {
    static std::map<uint64_t, Alloc> m;
    return m;
}
size_t g_used = 0;

size_t total_memory() {
    static const size_t total = [] {
        const char* v = std::getenv("PD_CUDA_EMU_MEMORY_MIB");
        size_t mib = v != nullptr ? std::strtoull(v, nullptr, 10) : 4096;
        return (mib == 0 ? 4096 : mib) << 20;
    }();
    return total;
}

// 9.0 unless PD_CUDA_EMU_CC says otherwise (e.g. "7.5", to see an old device refused).
std::pair<int, int> compute_capability() {
    static const std::pair<int, int> cc = [] {
        const char* v = std::getenv("PD_CUDA_EMU_CC");
        int major = 9, minor = 0;
        if (v != nullptr && std::sscanf(v, "%d.%d", &major, &minor) != 2) {
            fatal(std::string("PD_CUDA_EMU_CC=") + v + ": expected MAJOR.MINOR");
        }
        return std::make_pair(major, minor);
    }();
    return cc;
}

// Dynamic shared memory a block may have once opted in: Hopper's, or an A100's on 8.x.
int optin_shared_bytes() {
    return compute_capability().first >= 9 ? EMU_OPTIN_SHARED_BYTES
                                           : EMU_OPTIN_SHARED_BYTES_SM80;
}

CUresult fail(CUresult code, const std::string& why) {
    std::fprintf(stderr, "pd-cuda-emu: error %d: %s\n", code, why.c_str());
    return code;
}

std::string hex(uint64_t v) {
    char buf[32];
    std::snprintf(buf, sizeof buf, "0x%llx", (unsigned long long)v);
    return buf;
}

CUresult allocate(CUdeviceptr* out, size_t bytes, bool graph_owned) {
    std::lock_guard<std::recursive_mutex> g(g_lock);
    count(Stat::Alloc);
    if (out == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (bytes == 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuMemAlloc of 0 bytes");
    if (g_used + bytes > total_memory()) return CUDA_ERROR_OUT_OF_MEMORY;
    const size_t padded = (bytes + kGuard + 255) / 256 * 256;
    void* p = std::aligned_alloc(256, padded);
    if (p == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    std::memset(p, 0xff, bytes);  // NaN as f32: what reads memory nothing wrote shows up
    std::memset(static_cast<char*>(p) + bytes, kGuardByte, padded - bytes);
    allocations()[(uint64_t)p] = Alloc{bytes, graph_owned};
    g_used += bytes;
    *out = (CUdeviceptr)p;
    return CUDA_SUCCESS;
}

void release(uint64_t p) {
    auto it = allocations().find(p);
    check_guards("a free");
    g_used -= it->second.size;
    allocations().erase(it);
    std::free(reinterpret_cast<void*>(p));
}

Stream* stream_of(void* s) {
    static Stream legacy;
    return s == nullptr ? &legacy : static_cast<Stream*>(s);
}


}  // namespace

bool in_device_memory(uint64_t ptr, size_t bytes) {
    std::lock_guard<std::recursive_mutex> g(g_lock);
    auto it = allocations().upper_bound(ptr);
    if (it == allocations().begin()) return false;
    --it;
    return ptr >= it->first && ptr + bytes <= it->first + it->second.size;
}

void check_guards(const char* after) {
    std::lock_guard<std::recursive_mutex> g(g_lock);
    static const std::vector<unsigned char> pattern(kGuard, kGuardByte);
    for (const auto& [base, a] : allocations()) {
        const auto* tail = reinterpret_cast<const unsigned char*>(base + a.size);
        if (std::memcmp(tail, pattern.data(), kGuard) == 0) continue;
        for (size_t i = 0; i < kGuard; ++i) {
            if (tail[i] != kGuardByte) {
                fatal(std::string("after ") + after + ": byte " + std::to_string(i) +
                      " past the end of the " + std::to_string(a.size) +
                      "-byte allocation at " + hex(base) + " was written");
            }
        }
    }
}

namespace {

std::atomic<uint64_t> g_stats[(size_t)Stat::Count_];

// Writes the counters at exit when PD_CUDA_EMU_STATS names a file.
struct StatsAtExit {
    ~StatsAtExit() {
        const char* path = std::getenv("PD_CUDA_EMU_STATS");
        if (path == nullptr || *path == 0) return;
        static const char* names[] = {"launches_issued", "gemms_issued", "graph_launches",
                                      "kernels_run",     "htod_bytes",   "dtoh_bytes",
                                      "dtod_bytes",      "htod_copies",  "dtoh_copies",
                                      "syncs",           "allocs"};
        static_assert(sizeof(names) / sizeof(names[0]) == (size_t)Stat::Count_);
        FILE* f = std::fopen(path, "w");
        if (f == nullptr) return;
        std::fprintf(f, "{");
        for (size_t i = 0; i < (size_t)Stat::Count_; ++i) {
            std::fprintf(f, "%s\"%s\": %llu", i ? ", " : "", names[i],
                         (unsigned long long)g_stats[i].load());
        }
        std::fprintf(f, "}\n");
        std::fclose(f);
    }
} g_stats_at_exit;

}  // namespace

void count(Stat what, uint64_t n) { g_stats[(size_t)what] += n; }

bool capturing(void* stream) { return stream_of(stream)->capture != nullptr; }

int submit(void* stream, const std::function<void()>& op) {
    Stream* s = stream_of(stream);
    if (s->capture != nullptr) {
        s->capture->nodes.push_back(op);
        return CUDA_SUCCESS;
    }
    op();
    return CUDA_SUCCESS;
}

}  // namespace emu

using namespace emu;

// --- initialisation, device, context ---------------------------------------------------

API CUresult cuInit(unsigned) { return CUDA_SUCCESS; }
API CUresult cuDriverGetVersion(int* v) {
    *v = 13000;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetCount(int* n) {
    *n = 1;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGet(int* dev, int ordinal) {
    if (ordinal != 0) return CUDA_ERROR_INVALID_DEVICE;
    *dev = 0;
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetName(char* name, int len, int) {
    std::snprintf(name, (size_t)len, "pd-cuda-emu (CPU emulation, not a GPU)");
    return CUDA_SUCCESS;
}
API CUresult cuDeviceTotalMem_v2(size_t* bytes, int) {
    *bytes = total_memory();
    return CUDA_SUCCESS;
}
API CUresult cuDeviceGetAttribute(int* v, int attribute, int) {
    switch (attribute) {
        case 1: *v = 1024; break;            // max threads per block
        case 2: case 3: *v = 1024; break;    // max block dim x, y
        case 4: *v = 64; break;              // max block dim z
        case 5: *v = 2147483647; break;      // max grid dim x
        case 6: case 7: *v = 65535; break;   // max grid dim y, z
        case 8: *v = 49152; break;           // max shared memory per block
        case 10: *v = 32; break;             // warp size
        case 16: *v = 132; break;            // multiprocessors
        case 81: *v = optin_shared_bytes() + 1024; break;  // shared memory per multiprocessor
        case 97: *v = optin_shared_bytes(); break;         // per block, opted in
        case 75: *v = compute_capability().first; break;
        case 76: *v = compute_capability().second; break;
        case 115: *v = 1; break;             // memory pools
        default:
            std::fprintf(stderr, "pd-cuda-emu: device attribute %d read as 0\n", attribute);
            *v = 0;
    }
    return CUDA_SUCCESS;
}
static int g_context_token;
API CUresult cuDevicePrimaryCtxRetain(void** ctx, int) {
    *ctx = &g_context_token;
    return CUDA_SUCCESS;
}
API CUresult cuDevicePrimaryCtxRelease_v2(int) { return CUDA_SUCCESS; }
API CUresult cuCtxSetCurrent(void*) { return CUDA_SUCCESS; }
API CUresult cuCtxGetCurrent(void** ctx) {
    *ctx = &g_context_token;
    return CUDA_SUCCESS;
}
API CUresult cuCtxPushCurrent_v2(void*) { return CUDA_SUCCESS; }
API CUresult cuCtxPopCurrent_v2(void** ctx) {
    if (ctx != nullptr) *ctx = &g_context_token;
    return CUDA_SUCCESS;
}
API CUresult cuCtxSynchronize() { return CUDA_SUCCESS; }
API CUresult cuCtxGetDevice(int* dev) {
    *dev = 0;
    return CUDA_SUCCESS;
}
static int g_pool_token;
API CUresult cuDeviceGetDefaultMemPool(void** pool, int) {
    *pool = &g_pool_token;
    return CUDA_SUCCESS;
}
API CUresult cuMemPoolSetAttribute(void*, int, void*) { return CUDA_SUCCESS; }

API CUresult cuGetErrorName(CUresult e, const char** s) {
    static thread_local std::string name;
    name = "CUDA_ERROR_" + std::to_string(e) + " (pd-cuda-emu)";
    *s = name.c_str();
    return CUDA_SUCCESS;
}
API CUresult cuGetErrorString(CUresult e, const char** s) {
    switch (e) {
        case CUDA_ERROR_INVALID_VALUE: *s = "invalid argument (pd-cuda-emu)"; break;
        case CUDA_ERROR_OUT_OF_MEMORY: *s = "out of memory (pd-cuda-emu)"; break;
        case CUDA_ERROR_NOT_FOUND: *s = "named symbol not found (pd-cuda-emu)"; break;
        case CUDA_ERROR_ILLEGAL_ADDRESS: *s = "an illegal memory access (pd-cuda-emu)"; break;
        case CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES:
            *s = "too many resources requested for launch (pd-cuda-emu)";
            break;
        case CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED:
            *s = "operation not permitted when stream is capturing (pd-cuda-emu)";
            break;
        default: *s = "error (pd-cuda-emu)";
    }
    return CUDA_SUCCESS;
}

// --- memory --------------------------------------------------------------------------

API CUresult cuMemGetInfo_v2(size_t* free_bytes, size_t* total) {
    std::lock_guard<std::recursive_mutex> g(g_lock);
    *free_bytes = total_memory() - g_used;
    *total = total_memory();
    return CUDA_SUCCESS;
}
API CUresult cuMemAlloc_v2(CUdeviceptr* p, size_t bytes) { return allocate(p, bytes, false); }
API CUresult cuMemAllocAsync(CUdeviceptr* p, size_t bytes, void* stream) {
    Stream* s = stream_of(stream);
    CUresult r = allocate(p, bytes, s->capture != nullptr);
    if (r == CUDA_SUCCESS && s->capture != nullptr) s->capture->memory.push_back(*p);
    return r;
}
static CUresult free_device(CUdeviceptr p, void* stream) {
    std::lock_guard<std::recursive_mutex> g(g_lock);
    auto it = allocations().find(p);
    if (it == allocations().end()) {
        return fail(CUDA_ERROR_INVALID_VALUE, "free of " + hex(p) + ", not an allocation");
    }
    if (it->second.graph_owned) return CUDA_SUCCESS;  // lives as long as its graph
    if (stream_of(stream)->capture != nullptr) {
        fatal("an allocation made before a capture (" + hex(p) +
              ") was freed inside it: replaying the graph would free it again");
    }
    release(p);
    return CUDA_SUCCESS;
}
API CUresult cuMemFree_v2(CUdeviceptr p) { return free_device(p, nullptr); }
// Page-locked host memory: plain host memory here (the emulated device reads and writes host
// memory anyway); never device memory, so copies treat it as the host side.
API CUresult cuMemHostAlloc(void** p, size_t bytes, unsigned int /*flags*/) {
    if (p == nullptr) return CUDA_ERROR_INVALID_VALUE;
    if (bytes == 0) return fail(CUDA_ERROR_INVALID_VALUE, "cuMemHostAlloc of 0 bytes");
    void* q = std::aligned_alloc(256, (bytes + 255) / 256 * 256);
    if (q == nullptr) return CUDA_ERROR_OUT_OF_MEMORY;
    *p = q;
    return CUDA_SUCCESS;
}
API CUresult cuMemFreeHost(void* p) {
    std::free(p);
    return CUDA_SUCCESS;
}
API CUresult cuMemFreeAsync(CUdeviceptr p, void* stream) { return free_device(p, stream); }

static CUresult copy(const char* what, void* stream, void* dst, const void* src, size_t n,
                     bool dst_device, bool src_device) {
    if (dst_device && !in_device_memory((uint64_t)dst, n)) {
        return fail(CUDA_ERROR_INVALID_VALUE, std::string(what) + ": destination " +
                                                  hex((uint64_t)dst) + " + " +
                                                  std::to_string(n) + " is not device memory");
    }
    if (src_device && !in_device_memory((uint64_t)src, n)) {
        return fail(CUDA_ERROR_INVALID_VALUE, std::string(what) + ": source " +
                                                  hex((uint64_t)src) + " + " +
                                                  std::to_string(n) + " is not device memory");
    }
    if (stream_of(stream)->capture != nullptr && !(dst_device && src_device)) {
        // Host memory in a graph would be read or written at every replay.
        return fail(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED,
                    std::string(what) + " of pageable host memory while capturing");
    }
    if (!src_device) {
        count(Stat::CopiesHtoD);
        count(Stat::CopyHtoD, n);
    } else if (!dst_device) {
        count(Stat::CopiesDtoH);
        count(Stat::CopyDtoH, n);
    } else {
        count(Stat::CopyDtoD, n);
    }
    return submit(stream, [=] { std::memmove(dst, src, n); });
}
API CUresult cuMemcpyHtoD_v2(CUdeviceptr dst, const void* src, size_t n) {
    return copy("cuMemcpyHtoD", nullptr, (void*)dst, src, n, true, false);
}
API CUresult cuMemcpyHtoDAsync_v2(CUdeviceptr dst, const void* src, size_t n, void* s) {
    return copy("cuMemcpyHtoDAsync", s, (void*)dst, src, n, true, false);
}
API CUresult cuMemcpyDtoH_v2(void* dst, CUdeviceptr src, size_t n) {
    return copy("cuMemcpyDtoH", nullptr, dst, (const void*)src, n, false, true);
}
API CUresult cuMemcpyDtoHAsync_v2(void* dst, CUdeviceptr src, size_t n, void* s) {
    return copy("cuMemcpyDtoHAsync", s, dst, (const void*)src, n, false, true);
}
API CUresult cuMemcpyDtoD_v2(CUdeviceptr dst, CUdeviceptr src, size_t n) {
    return copy("cuMemcpyDtoD", nullptr, (void*)dst, (const void*)src, n, true, true);
}
API CUresult cuMemcpyDtoDAsync_v2(CUdeviceptr dst, CUdeviceptr src, size_t n, void* s) {
    return copy("cuMemcpyDtoDAsync", s, (void*)dst, (const void*)src, n, true, true);
}
static CUresult memset_device(CUdeviceptr dst, uint32_t value, size_t elem, size_t n, void* s) {
    if (!in_device_memory(dst, n * elem)) {
        return fail(CUDA_ERROR_INVALID_VALUE, "cuMemset of " + hex(dst) + ", not device memory");
    }
    return submit(s, [=] {
        auto* p = reinterpret_cast<unsigned char*>(dst);
        for (size_t i = 0; i < n; ++i) std::memcpy(p + i * elem, &value, elem);
    });
}
API CUresult cuMemsetD8_v2(CUdeviceptr d, unsigned char v, size_t n) {
    return memset_device(d, v, 1, n, nullptr);
}
API CUresult cuMemsetD8Async(CUdeviceptr d, unsigned char v, size_t n, void* s) {
    return memset_device(d, v, 1, n, s);
}
API CUresult cuMemsetD32Async(CUdeviceptr d, unsigned v, size_t n, void* s) {
    return memset_device(d, v, 4, n, s);
}

// --- streams, events, graphs ------------------------------------------------------------

API CUresult cuStreamCreate(void** s, unsigned) {
    *s = new Stream();
    return CUDA_SUCCESS;
}
API CUresult cuStreamDestroy_v2(void* s) {
    delete static_cast<Stream*>(s);
    return CUDA_SUCCESS;
}
API CUresult cuStreamSynchronize(void* s) {
    count(Stat::Sync);
    if (stream_of(s)->capture != nullptr) {
        return fail(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "cuStreamSynchronize while capturing");
    }
    return CUDA_SUCCESS;
}
API CUresult cuStreamWaitEvent(void*, void*, unsigned) { return CUDA_SUCCESS; }
API CUresult cuStreamBeginCapture_v2(void* s, int) {
    Stream* st = stream_of(s);
    if (s == nullptr) {
        return fail(CUDA_ERROR_STREAM_CAPTURE_UNSUPPORTED, "capture on the legacy stream");
    }
    if (st->capture != nullptr) return fail(CUDA_ERROR_INVALID_VALUE, "capture already active");
    st->capture = new Graph();
    return CUDA_SUCCESS;
}
API CUresult cuStreamEndCapture(void* s, void** graph) {
    Stream* st = stream_of(s);
    if (st->capture == nullptr) return fail(CUDA_ERROR_INVALID_VALUE, "no capture active");
    *graph = st->capture;
    st->capture = nullptr;
    return CUDA_SUCCESS;
}
API CUresult cuStreamIsCapturing(void* s, int* status) {
    *status = stream_of(s)->capture != nullptr ? 1 : 0;
    return CUDA_SUCCESS;
}
struct GraphExec {
    std::vector<std::function<void()>> nodes;
};
API CUresult cuGraphInstantiateWithFlags(void** exec, void* graph, unsigned long long) {
    *exec = new GraphExec{static_cast<Graph*>(graph)->nodes};
    return CUDA_SUCCESS;
}
API CUresult cuGraphLaunch(void* exec, void* stream) {
    auto* e = static_cast<GraphExec*>(exec);
    count(Stat::GraphLaunch);
    return submit(stream, [e] {
        for (const auto& node : e->nodes) node();
    });
}
API CUresult cuGraphUpload(void*, void*) { return CUDA_SUCCESS; }
API CUresult cuGraphExecDestroy(void* exec) {
    delete static_cast<GraphExec*>(exec);
    return CUDA_SUCCESS;
}
API CUresult cuGraphDestroy(void* graph) {
    auto* g = static_cast<Graph*>(graph);
    {
        std::lock_guard<std::recursive_mutex> lock(g_lock);
        for (uint64_t p : g->memory) release(p);
    }
    delete g;
    return CUDA_SUCCESS;
}
API CUresult cuEventCreate(void** e, unsigned) {
    *e = new Event();
    return CUDA_SUCCESS;
}
API CUresult cuEventDestroy_v2(void* e) {
    delete static_cast<Event*>(e);
    return CUDA_SUCCESS;
}
API CUresult cuEventRecord(void* e, void* s) {
    auto* ev = static_cast<Event*>(e);
    return submit(s, [ev] { ev->at = std::chrono::steady_clock::now(); });
}
API CUresult cuEventSynchronize(void*) { return CUDA_SUCCESS; }
// Profiler range markers (gpu_bench --profile-decode, for Nsight Compute on a GPU): no
// profiler attaches to the emulator.
API CUresult cuProfilerStart() { return CUDA_SUCCESS; }
API CUresult cuProfilerStop() { return CUDA_SUCCESS; }
API CUresult cuEventQuery(void*) { return CUDA_SUCCESS; }
API CUresult cuEventElapsedTime(float* ms, void* a, void* b) {
    *ms = std::chrono::duration<float, std::milli>(static_cast<Event*>(b)->at -
                                                   static_cast<Event*>(a)->at)
              .count();
    return CUDA_SUCCESS;
}
API CUresult cuEventElapsedTime_v2(float* ms, void* a, void* b) {
    return cuEventElapsedTime(ms, a, b);
}

// --- modules and launches -----------------------------------------------------------------

API CUresult cuModuleLoadData(void** module, const void* image) {
    // The image is NVRTC's PTX: its `.entry` names are the module's kernels.
    const std::string ptx(static_cast<const char*>(image));
    auto* m = new Module();
    for (size_t at = ptx.find(".entry "); at != std::string::npos;
         at = ptx.find(".entry ", at + 1)) {
        size_t begin = at + 7;
        size_t end = ptx.find_first_of("( \n\t", begin);
        m->entries.insert(ptx.substr(begin, end - begin));
    }
    if (m->entries.empty()) {
        delete m;
        return fail(CUDA_ERROR_INVALID_IMAGE, "module image without .entry (not PTX?)");
    }
    *module = m;
    return CUDA_SUCCESS;
}
API CUresult cuModuleUnload(void* module) {
    delete static_cast<Module*>(module);
    return CUDA_SUCCESS;
}
API CUresult cuModuleGetFunction(void** f, void* module, const char* name) {
    auto* m = static_cast<Module*>(module);
    if (m->entries.count(name) == 0) return CUDA_ERROR_NOT_FOUND;
    const Kernel* k = find_kernel(name);
    if (k == nullptr) {
        fatal(std::string("kernel ") + name +
              " is in the PTX but not in the emulator (kernels/emu/build.sh registers each "
              "`extern \"C\" __global__` function)");
    }
    *f = const_cast<Kernel*>(k);
    return CUDA_SUCCESS;
}
// Attribute 0: max threads per block; 8: max dynamic shared memory; any other reads 0
// (static shared memory, registers, ...: nothing the emulator knows).
API CUresult cuFuncGetAttribute(int* v, int attribute, void* f) {
    auto* k = static_cast<Kernel*>(f);
    switch (attribute) {
        case 0: *v = k->max_threads ? (int)k->max_threads : 1024; break;
        case 8: *v = (int)k->max_dynamic_shared; break;
        default: *v = 0;
    }
    return CUDA_SUCCESS;
}
// Only the dynamic shared memory limit (attribute 8) can be set, up to the device's opt-in
// limit, as the driver refuses more.
API CUresult cuFuncSetAttribute(void* f, int attribute, int value) {
    auto* k = static_cast<Kernel*>(f);
    if (attribute != 8) {
        return fail(CUDA_ERROR_INVALID_VALUE, std::string(k->name) + ": function attribute " +
                                                  std::to_string(attribute) + " unsupported");
    }
    if (value < 0 || value > optin_shared_bytes()) {
        return fail(CUDA_ERROR_INVALID_VALUE,
                    std::string(k->name) + ": " + std::to_string(value) +
                        " bytes of dynamic shared memory over the device's opt-in limit " +
                        std::to_string(optin_shared_bytes()));
    }
    k->max_dynamic_shared = (unsigned)value;
    return CUDA_SUCCESS;
}

API CUresult cuLaunchKernel(void* f, unsigned gx, unsigned gy, unsigned gz, unsigned bx,
                            unsigned by, unsigned bz, unsigned shared, void* stream,
                            void** params, void** extra) {
    auto* k = static_cast<Kernel*>(f);
    const std::string name = k->name;
    if (extra != nullptr) return fail(CUDA_ERROR_INVALID_VALUE, name + ": `extra` unsupported");
    const unsigned long long threads = (unsigned long long)bx * by * bz;
    if (gx == 0 || gy == 0 || gz == 0 || gy > 65535 || gz > 65535 || gx > 2147483647u ||
        bx == 0 || by == 0 || bz == 0 || bx > 1024 || by > 1024 || bz > 64 || threads > 1024) {
        return fail(CUDA_ERROR_INVALID_VALUE,
                    name + ": invalid launch grid (" + std::to_string(gx) + "," +
                        std::to_string(gy) + "," + std::to_string(gz) + ") block (" +
                        std::to_string(bx) + "," + std::to_string(by) + "," +
                        std::to_string(bz) + ")");
    }
    if (k->max_threads != 0 && threads > k->max_threads) {
        return fail(CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES,
                    name + ": " + std::to_string(threads) + " threads over __launch_bounds__ " +
                        std::to_string(k->max_threads));
    }
    if (shared > k->max_dynamic_shared) {
        return fail(CUDA_ERROR_INVALID_VALUE,
                    name + ": " + std::to_string(shared) +
                        " bytes of dynamic shared memory over the kernel's limit of " +
                        std::to_string(k->max_dynamic_shared) +
                        " (48 KiB unless opted in with cuFuncSetAttribute)");
    }
    if (k->param_sizes.size() > 0 && params == nullptr) {
        return fail(CUDA_ERROR_INVALID_VALUE, name + ": no kernel parameters given");
    }
    // Copy the arguments now, as the driver does: the caller may reuse its values at once.
    auto values = std::make_shared<std::vector<std::vector<char>>>();
    for (size_t i = 0; i < k->param_sizes.size(); ++i) {
        const char* v = static_cast<const char*>(params[i]);
        values->emplace_back(v, v + k->param_sizes[i]);
    }
    const LaunchShape shape{dim3{gx, gy, gz}, dim3{bx, by, bz}, shared};
    if (stream_of(stream)->capture == nullptr) count(Stat::LaunchIssued);
    return submit(stream, [k, values, shape, name] {
        count(Stat::KernelRun);
        std::vector<void*> ptrs;
        for (size_t i = 0; i < values->size(); ++i) {
            void* v = (*values)[i].data();
            ptrs.push_back(v);
            if (k->param_is_pointer[i]) {
                uint64_t p;
                std::memcpy(&p, v, sizeof p);
                if (p != 0 && !in_device_memory(p, 0)) {
                    fatal("kernel " + name + ": parameter " + std::to_string(i) + " (" + hex(p) +
                          ") points into no live device allocation");
                }
            }
        }
        k->run(ptrs.data(), shape);
        check_guards(name.c_str());
    });
}

// The launch with attributes. Only programmatic stream serialization (attribute 6, Hopper's
// programmatic dependent launch) is accepted: the GEMV kernels ask for it with
// PD_CUDA_PDL=on. Kernels run one after another here, so the attribute changes nothing but
// is checked, and the launch is otherwise cuLaunchKernel's.
struct LaunchAttribute {
    int id;
    int pad;
    int value[16];  // CUlaunchAttributeValue: a 64-byte union
};
struct LaunchConfig {
    unsigned gx, gy, gz, bx, by, bz, shared;
    void* stream;
    LaunchAttribute* attrs;
    unsigned num_attrs;
};
static_assert(sizeof(LaunchAttribute) == 72, "CUlaunchAttribute's layout");
API CUresult cuLaunchKernelEx(const LaunchConfig* c, void* f, void** params, void** extra) {
    const std::string name = static_cast<Kernel*>(f)->name;
    for (unsigned i = 0; i < c->num_attrs; ++i) {
        const LaunchAttribute& a = c->attrs[i];
        if (a.id != 6 || (a.value[0] != 0 && a.value[0] != 1)) {
            return fail(CUDA_ERROR_INVALID_VALUE,
                        name + ": launch attribute " + std::to_string(a.id) + " = " +
                            std::to_string(a.value[0]) + " unsupported");
        }
    }
    return cuLaunchKernel(f, c->gx, c->gy, c->gz, c->bx, c->by, c->bz, c->shared, c->stream,
                          params, extra);
}
