// gpunvme_host.cpp — runs the project's CUDA kernels (the runtime's
// ptx/kernels/gpunvme_kernels.cu, the tools' ptx/kernels/gpunvme_tool_kernels.cu and the
// emulated controllers' ptx/emu/gpunvme_emu_kernels.cu, compiled here by g++ against
// gpunvme_host.h) on CPU threads: the runtime behind gpu_queues' `host-gpu` feature. It stands in
// for the GPU, so every module of the project's device code is loaded in it, as a GPU can load
// any; the Rust crates still load only their own module by name. See gpunvme_host.h for what
// this harness is and is not.
//
// A launch: blocks run concurrently up to a residency limit (GPUNVME_HOST_GPU_THREADS threads
// in all, default 4096; further blocks start as earlier ones end, as on a GPU whose SMs are
// full), each block one OS thread per GPU thread. Every wait here is bounded
// (GPUNVME_HOST_GPU_WAIT_S, default 120 s): a collective or barrier that some thread never
// reaches fails the launch with a message naming the lanes, instead of hanging. Once any thread
// fails, the others stop at their next collective, barrier or __nanosleep.

#ifndef GPUNVME_HOST_BUILD
#define GPUNVME_HOST_BUILD 1
#endif
#include "gpunvme_host.h"

#include <pthread.h>
#include <sched.h>
#include <time.h>

#include <chrono>
#include <condition_variable>
#include <cstdarg>
#include <cstdio>
#include <cstdlib>
#include <map>
#include <memory>
#include <mutex>
#include <new>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

#include "../kernels/gpunvme_kernels.cu"
#include "../kernels/gpunvme_tool_kernels.cu"
#include "../emu/gpunvme_emu_kernels.cu"

namespace gpunvme_host {

thread_local thread_ctx* current = nullptr;

namespace {

/// A failure of the kernel's use of the CUDA model (a broken collective, a wait no thread
/// ends), or of another thread of the grid: unwinds the thread out of the kernel.
struct kernel_error : std::runtime_error {
    using std::runtime_error::runtime_error;
};

std::string format(const char* fmt, ...) {
    char buf[512];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(buf, sizeof buf, fmt, ap);
    va_end(ap);
    return buf;
}

unsigned env_unsigned(const char* name, unsigned fallback) {
    const char* v = getenv(name);
    if (!v || !*v) return fallback;
    char* end = nullptr;
    unsigned long x = strtoul(v, &end, 10);
    return (end && *end == 0 && x > 0 && x < 0xffffffffu) ? (unsigned)x : fallback;
}

std::chrono::steady_clock::duration wait_limit() {
    static const unsigned s = env_unsigned("GPUNVME_HOST_GPU_WAIT_S", 120);
    return std::chrono::seconds(s);
}

}  // namespace

struct grid_ctx {
    std::atomic<bool> failed{false};
    std::mutex m;
    std::string first_error;
    void fail(const std::string& why) {
        std::lock_guard<std::mutex> lk(m);
        if (first_error.empty()) first_error = why;
        failed.store(true);
    }
    void check() const {
        if (failed.load(std::memory_order_relaxed))
            throw kernel_error("stopped: another thread of the grid failed");
    }
};

struct warp_ctx {
    struct round {
        unsigned arrived = 0;
        uint64_t gen = 0;
        uint64_t vals[32] = {};
        uint64_t snap[32] = {};
    };
    std::mutex m;
    std::condition_variable cv;
    unsigned index = 0;
    unsigned present = 0;  // lanes that exist (a block's last warp may be partial)
    unsigned exited = 0;   // lanes that have left the kernel
    std::map<unsigned, round> rounds;  // one rendezvous per mask
    std::string broken;                // set once a collective failed: later ones fail too
};

struct block_ctx {
    grid_ctx* grid = nullptr;
    unsigned index = 0, sm = 0, threads = 0;
    std::mutex m;
    std::condition_variable cv;
    unsigned live = 0, arrived = 0;
    uint64_t gen = 0;
    bool or_acc = false, or_result = false;
    std::map<int, std::pair<void*, std::align_val_t>> shared;
    unsigned char* dynamic = nullptr;
    unsigned dynamic_bytes = 0;
    std::vector<std::unique_ptr<warp_ctx>> warps;
    ~block_ctx() {
        for (auto& kv : shared) ::operator delete(kv.second.first, kv.second.second);
        ::operator delete(dynamic, std::align_val_t(16));
    }
};

namespace {

[[noreturn]] void warp_fail(warp_ctx& w, std::string why) {
    const thread_ctx* t = current;
    why = format("block %u warp %u lane %u: ", t->block_idx.x, w.index, t->lane) + why;
    if (w.broken.empty()) w.broken = why;
    w.cv.notify_all();
    throw kernel_error(why);
}

}  // namespace

void warp_exchange(unsigned mask, uint64_t value, uint64_t out[32]) {
    thread_ctx* t = current;
    warp_ctx& w = *t->warp;
    const unsigned bit = 1u << t->lane;
    t->block->grid->check();
    std::unique_lock<std::mutex> lk(w.m);
    if (!w.broken.empty()) throw kernel_error(w.broken);
    if (!(mask & bit))
        warp_fail(w, format("a warp collective with mask %#x, which does not name the lane", mask));
    if (mask & ~w.present)
        warp_fail(w, format("a warp collective with mask %#x names lanes %#x that do not exist "
                            "(a block of %u threads)",
                            mask, mask & ~w.present, t->block->threads));
    if (mask & w.exited)
        warp_fail(w, format("a warp collective with mask %#x names lanes %#x that have exited",
                            mask, mask & w.exited));
    warp_ctx::round& r = w.rounds[mask];
    r.vals[t->lane] = value;
    r.arrived |= bit;
    if (r.arrived == mask) {
        std::memcpy(r.snap, r.vals, sizeof r.vals);
        r.arrived = 0;
        r.gen++;
        w.cv.notify_all();
        std::memcpy(out, r.snap, sizeof r.snap);
        return;
    }
    const uint64_t g = r.gen;
    const auto deadline = std::chrono::steady_clock::now() + wait_limit();
    while (r.gen == g) {
        if (!w.broken.empty()) throw kernel_error(w.broken);
        if (mask & w.exited)
            warp_fail(w, format("a warp collective with mask %#x: lanes %#x exited without "
                                "reaching it",
                                mask, mask & w.exited));
        if (t->block->grid->failed.load()) {
            lk.unlock();
            t->block->grid->check();
        }
        if (w.cv.wait_until(lk, deadline) == std::cv_status::timeout && r.gen == g)
            warp_fail(w, format("a warp collective with mask %#x: lanes %#x never reached it",
                                mask, mask & ~r.arrived));
    }
    std::memcpy(out, r.snap, sizeof r.snap);
}

uint64_t shuffled(unsigned mask, const uint64_t vals[32], unsigned src) {
    if (src >= 32 || !(mask >> src & 1u)) {
        std::unique_lock<std::mutex> lk(current->warp->m);
        warp_fail(*current->warp,
                  format("a shuffle reads lane %u, which mask %#x does not name", src, mask));
    }
    return vals[src];
}

bool block_barrier(bool pred) {
    thread_ctx* t = current;
    block_ctx& b = *t->block;
    b.grid->check();
    std::unique_lock<std::mutex> lk(b.m);
    b.or_acc |= pred;
    b.arrived++;
    if (b.arrived == b.live) {
        b.or_result = b.or_acc;
        b.or_acc = false;
        b.arrived = 0;
        b.gen++;
        b.cv.notify_all();
        return b.or_result;
    }
    const uint64_t g = b.gen;
    const auto deadline = std::chrono::steady_clock::now() + wait_limit();
    while (b.gen == g) {
        if (b.grid->failed.load()) {
            lk.unlock();
            b.grid->check();
        }
        if (b.cv.wait_until(lk, deadline) == std::cv_status::timeout && b.gen == g)
            throw kernel_error(format("block %u: __syncthreads: %u of %u live threads arrived "
                                      "in %lld s",
                                      b.index, b.arrived, b.live,
                                      (long long)std::chrono::duration_cast<std::chrono::seconds>(
                                          wait_limit())
                                          .count()));
    }
    return b.or_result;
}

void* block_shared_bytes(int key, size_t bytes, size_t align) {
    block_ctx& b = *current->block;
    std::lock_guard<std::mutex> lk(b.m);
    auto it = b.shared.find(key);
    if (it != b.shared.end()) return it->second.first;
    const auto a = static_cast<std::align_val_t>(std::max<size_t>(align, 16));
    void* p = ::operator new(bytes, a);
    std::memset(p, 0xcd, bytes);  // uninitialised, as on a GPU: never zero
    b.shared.emplace(key, std::make_pair(p, a));
    return p;
}

unsigned char* dynamic_shared() { return current->block->dynamic; }
unsigned dynamic_shared_size() { return current->block->dynamic_bytes; }
unsigned sm_id() { return current->block->sm; }

uint64_t global_timer_ns() {
    timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (uint64_t)ts.tv_sec * 1000000000ull + (uint64_t)ts.tv_nsec;
}

namespace {
/// Threads of every grid running now.
std::atomic<unsigned> live_threads{0};
}  // namespace

void nanosleep_ns(unsigned ns) {
    // At least GPUNVME_HOST_GPU_SLEEP_NS (default 20 us), and 2 us per kernel thread alive (at
    // most 5 ms): hundreds of polling threads must leave a few cores to the threads they wait
    // for (the software controller's among them). Waits get coarser, never shorter than asked.
    static const unsigned floor_ns = env_unsigned("GPUNVME_HOST_GPU_SLEEP_NS", 20000);
    if (current) current->block->grid->check();
    const unsigned crowd = std::min(live_threads.load(std::memory_order_relaxed) * 2000u, 5000000u);
    const unsigned d = std::max({ns, floor_ns, crowd});
    timespec ts{(time_t)(d / 1000000000u), (long)(d % 1000000000u)};
    nanosleep(&ts, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Launching.

namespace {

template <class>
struct kernel_traits;
template <class... A>
struct kernel_traits<void (*)(A...)> {
    static constexpr unsigned params = sizeof...(A);
    // Parameter i is read from args[i] as cuLaunchKernel reads kernelParams: a pointer to a
    // value of the parameter's type.
    template <auto F, size_t... I>
    static void call(void* const* args, std::index_sequence<I...>) {
        F(*static_cast<std::decay_t<A>*>(args[I])...);
    }
};

template <auto F>
void call_kernel(void* const* args) {
    using T = kernel_traits<decltype(F)>;
    T::template call<F>(args, std::make_index_sequence<T::params>{});
}

struct kernel_entry {
    const char* name;
    unsigned params;
    void (*call)(void* const*);
};

#define GPUNVME_HOST_KERNEL(f) \
    kernel_entry { #f, kernel_traits<decltype(&f)>::params, &call_kernel<&f> }

const kernel_entry KERNELS[] = {
    GPUNVME_HOST_KERNEL(gpunvme_perf),       GPUNVME_HOST_KERNEL(gpunvme_io_batch),
    GPUNVME_HOST_KERNEL(gpunvme_rw_range),   GPUNVME_HOST_KERNEL(gpunvme_pattern),
    GPUNVME_HOST_KERNEL(gpunvme_scatter),    GPUNVME_HOST_KERNEL(gpunvme_gather),
    GPUNVME_HOST_KERNEL(gpunvme_warmup),     GPUNVME_HOST_KERNEL(gpunvme_controller),
    GPUNVME_HOST_KERNEL(gpunvme_file_rw),    GPUNVME_HOST_KERNEL(gpunvme_crc32c),
    GPUNVME_HOST_KERNEL(gpunvme_crc32c_combine), GPUNVME_HOST_KERNEL(gpunvme_emu_warmup),
    GPUNVME_HOST_KERNEL(gpunvme_cache_test), GPUNVME_HOST_KERNEL(gpunvme_cache_pin_test),
    GPUNVME_HOST_KERNEL(gpunvme_cache_bench), GPUNVME_HOST_KERNEL(gpunvme_cache_flush),
    GPUNVME_HOST_KERNEL(gpunvme_cache_bfs_level), GPUNVME_HOST_KERNEL(gpunvme_cache_gather),
    GPUNVME_HOST_KERNEL(gpunvme_cache_bfs_heavy), GPUNVME_HOST_KERNEL(gpunvme_cache_bfs_up),
    GPUNVME_HOST_KERNEL(gpunvme_cache_bench_scan),
};

const kernel_entry* find_kernel(const char* name) {
    for (const kernel_entry& k : KERNELS)
        if (std::strcmp(k.name, name) == 0) return &k;
    return nullptr;
}

struct thread_start {
    thread_ctx ctx;
    const kernel_entry* kernel;
    void* const* args;
};

void* thread_main(void* p) {
    thread_start* s = static_cast<thread_start*>(p);
    current = &s->ctx;
    live_threads.fetch_add(1);
    block_ctx& b = *s->ctx.block;
    try {
        s->kernel->call(s->args);
    } catch (const kernel_error& e) {
        b.grid->fail(e.what());
    } catch (const std::exception& e) {
        b.grid->fail(format("block %u thread %u: %s", b.index, s->ctx.thread_idx.x, e.what()));
    }
    {
        // The lane has exited: collectives naming it fail, barriers stop counting it.
        std::lock_guard<std::mutex> lk(s->ctx.warp->m);
        s->ctx.warp->exited |= 1u << s->ctx.lane;
        s->ctx.warp->cv.notify_all();
    }
    {
        std::lock_guard<std::mutex> lk(b.m);
        b.live--;
        if (b.arrived > 0 && b.arrived == b.live) {
            b.or_result = b.or_acc;
            b.or_acc = false;
            b.arrived = 0;
            b.gen++;
        }
        b.cv.notify_all();
    }
    live_threads.fetch_sub(1);
    current = nullptr;
    return nullptr;
}

/// Runs block `index` on resident slot `sm`: one thread per GPU thread, joined.
void run_block(grid_ctx& g, const kernel_entry* k, void* const* args, unsigned grid,
               unsigned block, unsigned shared_bytes, unsigned index, unsigned sm) {
    block_ctx b;
    b.grid = &g;
    b.index = index;
    b.sm = sm;
    b.threads = block;
    b.live = block;
    b.dynamic_bytes = shared_bytes;
    b.dynamic = static_cast<unsigned char*>(
        ::operator new(std::max(shared_bytes, 16u), std::align_val_t(16)));
    std::memset(b.dynamic, 0xcd, std::max(shared_bytes, 16u));
    const unsigned nwarps = (block + 31) / 32;
    for (unsigned w = 0; w < nwarps; ++w) {
        auto wc = std::make_unique<warp_ctx>();
        wc->index = w;
        const unsigned lanes = std::min(32u, block - w * 32);
        wc->present = lanes == 32 ? 0xffffffffu : (1u << lanes) - 1;
        b.warps.push_back(std::move(wc));
    }
    std::vector<thread_start> starts(block);
    std::vector<pthread_t> threads;
    threads.reserve(block);
    pthread_attr_t attr;
    pthread_attr_init(&attr);
    pthread_attr_setstacksize(&attr, 1u << 20);
    for (unsigned i = 0; i < block; ++i) {
        thread_start& s = starts[i];
        s.ctx.thread_idx = uint3{i, 0, 0};
        s.ctx.block_idx = uint3{index, 0, 0};
        s.ctx.block_dim = uint3{block, 1, 1};
        s.ctx.grid_dim = uint3{grid, 1, 1};
        s.ctx.lane = i & 31u;
        s.ctx.block = &b;
        s.ctx.warp = b.warps[i / 32].get();
        s.kernel = k;
        s.args = args;
        pthread_t th;
        if (pthread_create(&th, &attr, thread_main, &s) != 0) {
            g.fail(format("block %u: cannot start thread %u of %u", index, i, block));
            // The threads that did start see the failure at their next wait and leave; the
            // ones that never started count as exited.
            std::lock_guard<std::mutex> lk(b.m);
            b.live -= block - i;
            for (unsigned j = i; j < block; ++j) b.warps[j / 32]->exited |= 1u << (j & 31u);
            b.cv.notify_all();
            break;
        }
        threads.push_back(th);
    }
    pthread_attr_destroy(&attr);
    for (pthread_t th : threads) pthread_join(th, nullptr);
}

}  // namespace
}  // namespace gpunvme_host

using namespace gpunvme_host;

extern "C" int gpunvme_host_kernel_exists(const char* name) {
    return name && find_kernel(name) ? 1 : 0;
}

extern "C" int gpunvme_host_launch(const char* name, uint32_t grid, uint32_t block,
                                   uint32_t shared_bytes, void* const* args, uint32_t nargs,
                                   char* err, size_t err_len) {
    auto say = [&](const std::string& m) {
        if (err && err_len) snprintf(err, err_len, "%s", m.c_str());
    };
    const kernel_entry* k = name ? find_kernel(name) : nullptr;
    if (!k) {
        say(format("no kernel named %s in the host build", name ? name : "(null)"));
        return 1;
    }
    if (nargs != k->params) {
        say(format("%s takes %u parameters, the launch passed %u", k->name, k->params, nargs));
        return 2;
    }
    if (grid == 0 || block == 0 || block > 1024) {
        say(format("%s: invalid launch of %u blocks of %u threads", k->name, grid, block));
        return 3;
    }
    const unsigned max_threads = env_unsigned("GPUNVME_HOST_GPU_THREADS", 4096);
    const unsigned resident = std::max(1u, std::min(grid, max_threads / block));
    grid_ctx g;
    std::atomic<unsigned> next{0};
    std::vector<std::thread> slots;
    for (unsigned sm = 0; sm < resident; ++sm) {
        slots.emplace_back([&, sm] {
            for (;;) {
                const unsigned b = next.fetch_add(1);
                if (b >= grid) return;
                run_block(g, k, args, grid, block, shared_bytes, b, sm);
            }
        });
    }
    for (std::thread& t : slots) t.join();
    if (g.failed.load()) {
        say(format("%s: %s", k->name, g.first_error.c_str()));
        return 4;
    }
    return 0;
}
