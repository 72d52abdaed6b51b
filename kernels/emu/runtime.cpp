// pd-cuda-emu: thread blocks as cooperatively scheduled fibers (see emu.h), the kernel
// registry and the f16 conversions the kernels use.
#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>

#include "runtime.h"

alignas(16) float smem[EMU_OPTIN_SHARED_BYTES / sizeof(float)];

namespace emu {

Thread* t_thread = nullptr;
dim3 t_block_idx, t_block_dim, t_grid_dim;

// --- context switch (x86-64 System V): save the callee-saved registers on the current
// stack, store its pointer, load the other stack and restore its registers.
extern "C" void pd_emu_switch(void** save_sp, void* load_sp);
asm(R"(
    .text
    .globl pd_emu_switch
    .hidden pd_emu_switch
    .type pd_emu_switch, @function
pd_emu_switch:
    pushq %rbp
    pushq %rbx
    pushq %r12
    pushq %r13
    pushq %r14
    pushq %r15
    movq %rsp, (%rdi)
    movq %rsi, %rsp
    popq %r15
    popq %r14
    popq %r13
    popq %r12
    popq %rbx
    popq %rbp
    ret
    .size pd_emu_switch, .-pd_emu_switch
)");

namespace {

enum class Wait { Ready, Block, Warp, Done };
enum class WarpOp { Shuffle, Ballot, Mma };

constexpr size_t kStack = 64 * 1024;

struct Fiber {
    Thread thread;
    void* sp = nullptr;
    Wait wait = Wait::Ready;
    // The barrier the fiber waits at.
    int pred = 0;
    WarpOp op = WarpOp::Shuffle;
    unsigned mask = 0;
    uint64_t value = 0;
    Shuffle kind = Shuffle::Index;
    int arg = 0;
    // What the barrier gave back.
    uint64_t result = 0;
};

// One lane's registers of an mma (on its fiber's stack, which stays put while it waits).
struct MmaLane {
    float* d;
    const unsigned* a;
    const unsigned* b;
};

float half_of(unsigned reg, int which) { return f16_to_f32((unsigned short)(reg >> (16 * which))); }

// The fragment layouts of PTX's mma.m16n8k16 with .f16 A / B and .f32 C / D (PTX ISA,
// "Matrix Fragments for mma.m16n8k16 with floating point type"), lane = 4 * groupID +
// threadID_in_group; register j of A and B holds elements 2j (low half) and 2j + 1:
//   A a_i: row groupID for i in {0, 1, 4, 5}, else groupID + 8;
//          col 2 * threadID_in_group + (i & 1), plus 8 for i >= 4;
//   B b_i: row 2 * threadID_in_group + (i & 1), plus 8 for i >= 2; col groupID;
//   C c_i: row groupID for i < 2, else groupID + 8; col 2 * threadID_in_group + (i & 1).
void mma_warp(Fiber* lanes) {
    float a[16][16], b[16][8];
    for (int lane = 0; lane < 32; ++lane) {
        const auto* op = reinterpret_cast<const MmaLane*>(lanes[lane].value);
        const int g = lane >> 2, t = lane & 3;
        for (int i = 0; i < 8; ++i) {
            const int row = (i < 2 || (i >= 4 && i < 6)) ? g : g + 8;
            const int col = 2 * t + (i & 1) + (i >= 4 ? 8 : 0);
            a[row][col] = half_of(op->a[i / 2], i & 1);
        }
        for (int i = 0; i < 4; ++i) {
            b[2 * t + (i & 1) + (i >= 2 ? 8 : 0)][g] = half_of(op->b[i / 2], i & 1);
        }
    }
    for (int lane = 0; lane < 32; ++lane) {
        const auto* op = reinterpret_cast<const MmaLane*>(lanes[lane].value);
        const int g = lane >> 2, t = lane & 3;
        for (int i = 0; i < 4; ++i) {
            const int row = i < 2 ? g : g + 8;
            const int col = 2 * t + (i & 1);
            float acc = op->d[i];
            for (int k = 0; k < 16; ++k) acc += a[row][k] * b[k][col];
            op->d[i] = acc;
        }
    }
}

struct Scheduler {
    std::vector<Fiber> fibers;
    std::vector<std::unique_ptr<char[]>> stacks;
    void* sp = nullptr;
    Fiber* current = nullptr;
    const std::function<void()>* body = nullptr;
    const char* kernel = "";
    bool reverse = false;
    std::vector<unsigned> ready;         // fibers to run next round, in order
    std::vector<unsigned> warp_waiting;  // per warp: lanes waiting at a warp op
    size_t done = 0, at_block = 0;
};

Scheduler g_sched;
// Kernel execution is one block at a time in the whole process (see emu.h).
std::mutex g_kernel_lock;

const char* wait_name(Wait w) {
    switch (w) {
        case Wait::Ready: return "running";
        case Wait::Block: return "__syncthreads";
        case Wait::Warp: return "warp op";
        case Wait::Done: return "exited";
    }
    return "?";
}

void fiber_main() {
    Fiber* f = g_sched.current;
    (*g_sched.body)();
    f->wait = Wait::Done;
    pd_emu_switch(&f->sp, g_sched.sp);
    __builtin_trap();  // a finished fiber is never resumed
}

Fiber& current() {
    if (g_sched.current == nullptr) fatal("a device function ran outside a kernel launch");
    return *g_sched.current;
}

void yield() {
    Fiber& f = current();
    pd_emu_switch(&f.sp, g_sched.sp);
}

[[noreturn]] void block_fatal(const std::string& what) {
    Scheduler& s = g_sched;
    std::string states;
    for (size_t i = 0; i < s.fibers.size(); ++i) {
        if (i == 0 || s.fibers[i].wait != s.fibers[i - 1].wait) {
            states += "\n  thread " + std::to_string(i) + "..: " + wait_name(s.fibers[i].wait);
        }
    }
    fatal(std::string("kernel ") + s.kernel + ", block (" + std::to_string(t_block_idx.x) +
          "," + std::to_string(t_block_idx.y) + "," + std::to_string(t_block_idx.z) +
          "): " + what + states);
}

// Release the lanes of the warp starting at fiber `first` that wait at a warp op, if every
// lane of their mask is there (else they wait for the rest).
void release_warp(size_t first, size_t lanes) {
    Scheduler& s = g_sched;
    Fiber* lead = nullptr;
    for (size_t l = 0; l < lanes; ++l) {
        if (s.fibers[first + l].wait == Wait::Warp) {
            lead = &s.fibers[first + l];
            break;
        }
    }
    if (lead == nullptr) return;
    const unsigned mask = lead->mask;
    for (size_t l = 0; l < 32; ++l) {
        if (!(mask >> l & 1u)) continue;
        if (l >= lanes) {
            block_fatal("a warp op's mask names lane " + std::to_string(l) +
                        ", which this block does not have");
        }
        const Fiber& f = s.fibers[first + l];
        if (f.wait == Wait::Done) {
            block_fatal("lane " + std::to_string(l) + " of warp " + std::to_string(first / 32) +
                        " exited before a warp op whose mask names it");
        }
        if (f.wait != Wait::Warp) return;  // at __syncthreads: a deadlock, found later
        if (f.mask != mask || f.op != lead->op) {
            block_fatal("lanes of warp " + std::to_string(first / 32) +
                        " are at different warp ops (masks or kinds differ)");
        }
    }
    if (lead->op == WarpOp::Mma) {
        if (mask != 0xffffffffu || lanes != 32) block_fatal("an mma needs a full warp");
        mma_warp(&s.fibers[first]);
    }
    unsigned ballot = 0;
    for (size_t l = 0; l < lanes; ++l) {
        const Fiber& f = s.fibers[first + l];
        if ((mask >> l & 1u) && f.pred) ballot |= 1u << l;
    }
    for (size_t l = 0; l < lanes; ++l) {
        if (!(mask >> l & 1u)) continue;
        Fiber& f = s.fibers[first + l];
        if (f.op == WarpOp::Ballot) {
            f.result = ballot;
        } else {
            size_t src = f.kind == Shuffle::Xor ? (l ^ (unsigned)f.arg) : ((unsigned)f.arg % 32);
            // Out of the warp (xor only): the lane keeps its own value, as on the device.
            if (src >= 32 || !(mask >> src & 1u)) src = l;
            f.result = s.fibers[first + src].value;
        }
        f.wait = Wait::Ready;
        s.ready.push_back((unsigned)(first + l));
        --s.warp_waiting[first / 32];
    }
}

void run_block(size_t threads) {
    Scheduler& s = g_sched;
    if (s.fibers.size() < threads) s.fibers.resize(threads);
    while (s.stacks.size() < threads) s.stacks.emplace_back(new char[kStack]);
    for (size_t i = 0; i < threads; ++i) {
        Fiber& f = s.fibers[i];
        f = Fiber{};
        f.thread.linear = (unsigned)i;
        f.thread.idx.x = (unsigned)(i % t_block_dim.x);
        f.thread.idx.y = (unsigned)(i / t_block_dim.x % t_block_dim.y);
        f.thread.idx.z = (unsigned)(i / (t_block_dim.x * t_block_dim.y));
        // A fresh stack whose first `ret` (in pd_emu_switch) enters fiber_main, with the
        // alignment a called function expects (rsp + 8 a multiple of 16).
        auto top = reinterpret_cast<uintptr_t>(s.stacks[i].get() + kStack) & ~uintptr_t{15};
        auto* sp = reinterpret_cast<uintptr_t*>(top);
        *--sp = 0;
        *--sp = reinterpret_cast<uintptr_t>(&fiber_main);
        for (int r = 0; r < 6; ++r) *--sp = 0;
        f.sp = sp;
    }
    s.fibers.resize(threads);
    const size_t warps = (threads + 31) / 32;
    s.warp_waiting.assign(warps, 0);
    s.done = 0;
    s.at_block = 0;
    auto all_ready = [&] {
        s.ready.clear();
        for (size_t k = 0; k < threads; ++k) {
            s.ready.push_back((unsigned)(s.reverse ? threads - 1 - k : k));
        }
    };
    all_ready();
    for (;;) {
        for (unsigned i : s.ready) {
            Fiber& f = s.fibers[i];
            s.current = &f;
            t_thread = &f.thread;
            pd_emu_switch(&s.sp, f.sp);
            switch (f.wait) {
                case Wait::Done: ++s.done; break;
                case Wait::Block: ++s.at_block; break;
                case Wait::Warp: ++s.warp_waiting[i / 32]; break;
                case Wait::Ready: fatal("a fiber yielded without waiting");
            }
        }
        s.current = nullptr;
        t_thread = nullptr;
        s.ready.clear();
        if (s.done == threads) return;
        for (size_t w = 0; w < warps; ++w) {
            if (s.warp_waiting[w] > 0) {
                release_warp(w * 32, std::min<size_t>(32, threads - w * 32));
            }
        }
        if (!s.ready.empty()) {
            if (s.reverse) std::reverse(s.ready.begin(), s.ready.end());
            continue;
        }
        if (s.at_block + s.done == threads) {
            if (s.done > 0) {
                block_fatal("__syncthreads reached while " + std::to_string(s.done) +
                            " threads of the block had exited");
            }
            int count = 0;
            for (const Fiber& f : s.fibers) count += f.pred;
            for (Fiber& f : s.fibers) {
                f.result = (uint64_t)count;
                f.wait = Wait::Ready;
            }
            s.at_block = 0;
            all_ready();
            continue;
        }
        block_fatal("no barrier can be released (divergent __syncthreads or warp op)");
    }
}

std::map<std::string, Kernel*>& registry() {
    static std::map<std::string, Kernel*> kernels;
    return kernels;
}

}  // namespace

void syncthreads() { syncthreads_count(0); }

int syncthreads_count(int pred) {
    Fiber& f = current();
    f.wait = Wait::Block;
    f.pred = pred != 0;
    yield();
    return (int)f.result;
}

uint64_t warp_shuffle(unsigned mask, uint64_t value, Shuffle kind, int arg) {
    Fiber& f = current();
    f.wait = Wait::Warp;
    f.op = WarpOp::Shuffle;
    f.mask = mask;
    f.value = value;
    f.kind = kind;
    f.arg = arg;
    yield();
    return f.result;
}

unsigned warp_ballot(unsigned mask, int pred) {
    Fiber& f = current();
    f.wait = Wait::Warp;
    f.op = WarpOp::Ballot;
    f.mask = mask;
    f.pred = pred != 0;
    yield();
    return (unsigned)f.result;
}

void mma_m16n8k16_f16(float* d, const unsigned* a, const unsigned* b) {
    MmaLane lane{d, a, b};
    Fiber& f = current();
    f.wait = Wait::Warp;
    f.op = WarpOp::Mma;
    f.mask = 0xffffffffu;
    f.value = reinterpret_cast<uint64_t>(&lane);
    yield();
}

float f16_to_f32(unsigned short h) {
    _Float16 v;
    std::memcpy(&v, &h, 2);
    return (float)v;
}

unsigned short f32_to_f16(float f) {
    _Float16 v = (_Float16)f;  // round to nearest even, as cvt.rn.f16.f32
    unsigned short h;
    std::memcpy(&h, &v, 2);
    return h;
}

void register_kernel(Kernel* k) { registry()[k->name] = k; }

const Kernel* find_kernel(const std::string& name) {
    auto it = registry().find(name);
    return it == registry().end() ? nullptr : it->second;
}

void run_grid(const char* kernel, const LaunchShape& shape, const std::function<void()>& body) {
    std::lock_guard<std::mutex> lock(g_kernel_lock);
    Scheduler& s = g_sched;
    static const bool reverse = [] {
        const char* v = std::getenv("PD_CUDA_EMU_SCHEDULE");
        return v != nullptr && std::string(v) == "reverse";
    }();
    s.reverse = reverse;
    s.kernel = kernel;
    s.body = &body;
    t_grid_dim = shape.grid;
    t_block_dim = shape.block;
    const size_t threads = (size_t)shape.block.x * shape.block.y * shape.block.z;
    // Dynamic shared memory starts as NaN, as garbage would: a read before a write shows; a
    // write up to 4 KiB past the launch's size shows in the bytes after it.
    const size_t watched = std::min<size_t>(shape.shared_bytes + 4096, sizeof(smem));
    auto* bytes = reinterpret_cast<unsigned char*>(smem);
    // In reverse order the blocks run last to first as well, so work that one block of a
    // launch hands to another (the split-K merge: whichever split arrives last) is done by
    // a different block than in the forward order.
    auto at = [&](unsigned i, unsigned n) { return reverse ? n - 1 - i : i; };
    for (unsigned zi = 0; zi < shape.grid.z; ++zi) {
        for (unsigned yi = 0; yi < shape.grid.y; ++yi) {
            for (unsigned xi = 0; xi < shape.grid.x; ++xi) {
                t_block_idx = dim3{at(xi, shape.grid.x), at(yi, shape.grid.y), at(zi, shape.grid.z)};
                std::memset(bytes, 0xff, watched);
                run_block(threads);
                for (size_t i = shape.shared_bytes; i < watched; ++i) {
                    if (bytes[i] != 0xff) {
                        fatal(std::string("kernel ") + kernel +
                              " wrote dynamic shared memory byte " + std::to_string(i) +
                              ", past the " + std::to_string(shape.shared_bytes) +
                              " bytes its launch asked for");
                    }
                }
            }
        }
    }
    s.body = nullptr;
}

void fatal(const std::string& message) {
    std::fprintf(stderr, "pd-cuda-emu: %s\n", message.c_str());
    std::fflush(stderr);
    std::abort();
}

}  // namespace emu
