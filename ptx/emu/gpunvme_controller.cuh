// gpunvme_controller.cuh — the GPU-resident NVMe controller model: a persistent kernel on SMs
// reserved for it (a green context) that serves NVMe I/O queues whose rings and doorbells live
// in GPU memory, at GPU speed. Not for embedders: kernels that do I/O include gpunvme.cuh only.
// The host side (admin queue, Identify, queue creation) is the software controller, which hands
// every I/O queue it creates to this model (gpu-queues/src/gpu_controller.rs).
//
// ROLES. Controller warp w of C*W (C blocks of W warps) owns queue ids 1 + w + C*W*lane, one per
// lane; a lane keeps its queue's SQ head and CQ tail in registers. Each pass, every owning lane
// reads its SQ tail and CQ head doorbells; the warp then serves each queue with work, up to 32
// commands at a time: lane i fetches and checks SQE i, the warp moves each command's data
// together (32 lanes per 4 KiB page), and lane i posts CQE i.
//
// TABLES. Queues, address windows and namespaces are described by the host in pinned host
// memory (ctrl_tables) and changed only between generations: the host edits, bumps
// control.generation (release), and waits until every warp has acknowledged it in ack[warp]. A
// warp reloads its queues (registers) and windows and namespaces (its slice of shared memory)
// when it sees a new generation, so its hot path never reads host memory. A queue deleted by
// the host is forgotten by every warp before its deletion completes. The namespaces' timing
// models, the media error ranges and the fault bits (MODEL) travel the same way; the drives'
// busy-until words and the drop counters are GPU memory the kernel updates itself.
//
// STRICTNESS. Commands are checked as the host-side controller checks them (nvme_emu
// controller/nvm.rs and prp.rs): unknown opcode, fused or SGL commands, a namespace that does not
// exist, reserved CDW12 features, transfers above MDTS, LBA ranges past the namespace, PRP
// offsets and lists, and every data page inside a registered window (else Data Transfer
// Error). A doorbell value out of range (SQ tail >= entries, a CQ head that passes what was
// posted) is counted as a controller error and ignored, as the host-side controller does.
//
// FENCES (PTX ISA 9.0 memory model).
//   fetch:    ld.relaxed.gpu SQ tail doorbell -> fence.acq_rel.gpu -> SQE loads and, for writes,
//             the command's data (the client wrote them before its release fence + doorbell).
//   complete: data stores and CQE dwords 0-2 -> fence.acq_rel.gpu (one per batch of 32) ->
//             st.relaxed.sys CQE dword 3 (phase tag). A client that sees the phase (relaxed),
//             then fences (acquire), reads a whole entry and the data. Held completions (MODEL)
//             are posted the same way: their data was stored in an earlier pass by the same
//             warp, before the posting batch's fence.acq_rel.gpu + __syncwarp + fence.
//   tables:   (warp 0, lane 0 of block 0, every GPUNVME_CTRL_HOST_POLL_NS) ld.relaxed.sys
//             generation -> fence.acq_rel.sys -> shared-memory copy and st.relaxed.gpu mirror;
//             (warp 0, lane 0 of the other blocks) ld.relaxed.gpu mirror -> fence.acq_rel.sys
//             -> shared-memory copy; (each warp) shared copy -> fence.acq_rel.sys -> table
//             loads; ack after reload.
//   model:    drive busy-until words (GPU memory): atomicCAS / atomicMax / atomicAdd, relaxed at
//             GPU scope; they order nothing but themselves (they only carry model time). Drop
//             counters (GPU memory, written by the host with cuMemcpyHtoD before it publishes
//             the GPUNVME_FAULT_DROPS bit through the generation): ld.relaxed.gpu + atomicCAS.
//             Pending completions live in the warp's own shared memory (__syncwarp between
//             lanes' writes and reads).
//
// HOST WORDS. One lane of the whole controller (block 0, warp 0, lane 0) reads the host's stop
// and generation words, every GPUNVME_CTRL_HOST_POLL_NS, and mirrors them into GPU memory; the
// other blocks' leaders read the mirror. No other controller load touches host memory during
// a run. A few hundred warps polling host memory made each pass ~30 µs and slowed clients'
// system-scope fences to ~10 µs (an H100 run; benches/results/history.md); with one host reader per block, 16 blocks
// (800 k small PCIe reads a second) were ~30x slower than 8 — the suspected cause, not yet
// confirmed on a GPU, is that rate of non-posted reads, which stalls the reading warps, one of
// which serves queue 1.
//
// MODEL (optional; nothing of it runs while no namespace has a timing model and no fault is
// set: the warp's `slow` flag is off and every command completes in the pass that fetched it).
//   SSD timing: a namespace may carry a ctrl_ns_model: `drives` drives striped by LBA in units
//   of 1 << stripe_shift bytes, each with a busy-until time in GPU memory. A Read or Write is
//   cut at stripe boundaries; each piece reserves service = max(op_ns, ceil(bytes * 1e9 / bw))
//   of its drive's time, starting no earlier than now (model_due: CAS loop, bounded, then a
//   wait-free atomicMax + atomicAdd); the completion is due when its last piece's service ends
//   plus the fixed read or write latency. gpu_emu::ssd_model::SsdTwin is the same
//   arithmetic on the CPU, with the tests of the model's shapes. The warp moves the data when it
//   fetches (a model: only the completion waits).
//   Held completions: in model mode every completion goes to the warp's pending list (dynamic
//   shared memory: GPUNVME_CTRL_SEL_BYTES of selection slots, then ctrl_pending entries) with
//   its due time; its CQ entry was reserved at fetch (cq_pending), its CQ slot and phase are
//   taken when it is posted, and its SQ head is the queue's as of posting. Each pass, once
//   %globaltimer passes the earliest due time, the warp posts up to 32 overdue entries sorted
//   by due time (then fetch order); more than 32 overdue at once (the warp is behind) are
//   posted 32 per pass, the batch's choice among them is not by due time. A full list stops
//   fetching until entries are posted (back-pressure: at most `cap` commands in flight per
//   controller warp). Posting precision: one pass, at most idle_ns plus a pass late.
//   Faults (mirroring nvme_emu::Faults): media errors (LBA ranges of a namespace: Read ->
//   Unrecovered Read Error, Write / Write Zeroes / DSM deallocate -> Write Fault, SCT 2, DNR;
//   no data moves), dropped completions (per queue and controller-wide counters in GPU memory,
//   DROP_ALL = ~0: the command executes, its completion is never posted), and a completion
//   delay added to every due time.
//   Stop: the warp leaves at once; completions still pending are never posted (counted as
//   abandoned), so they cannot delay the stop; clients still waiting time out (bounded
//   waits) or are aborted by the host. A queue deleted or replaced while completions are
//   pending for it has them discarded at the warp's reload (also counted as abandoned).
//
// PLACEMENT. One block per SM: the host asks for enough dynamic shared memory that two blocks
// cannot share an SM, and checks the SM ids the blocks report (ack area).
#pragma once

#include "gpunvme.cuh"

#define GPUNVME_CTRL_MAX_WINDOWS 64
#define GPUNVME_CTRL_MAX_NS 16
#define GPUNVME_CTRL_WARPS 16           // warps per controller block
#define GPUNVME_CTRL_HOST_POLL_NS 20000 // one read of the host's control words per block per 20 µs
#define GPUNVME_CTRL_DOORBELL_STRIDE 32 // bytes between two queues' doorbell pairs
#define GPUNVME_CTRL_QUEUE_SIZE 32
#define GPUNVME_CTRL_WINDOW_SIZE 16
#define GPUNVME_CTRL_NS_SIZE 32
#define GPUNVME_CTRL_CONTROL_SIZE 136
#define GPUNVME_CTRL_COUNTERS_SIZE 64
#define GPUNVME_CC_STOP 0
#define GPUNVME_CC_GENERATION 4
#define GPUNVME_CC_QUEUES 32
#define GPUNVME_CC_ACK 72
#define GPUNVME_CC_LIFETIME_NS 80
#define GPUNVME_CC_MIRROR 120
#define GPUNVME_CC_NMEDIA_ERRORS 28
#define GPUNVME_CC_MODELS 88
#define GPUNVME_CC_MEDIA_ERRORS 96
#define GPUNVME_CC_DROPS 104
#define GPUNVME_CC_FAULTS 112
#define GPUNVME_CC_DELAY_NS 116
#define GPUNVME_CC_HOSTILE 128
#define GPUNVME_CTRL_NS_MODEL_SIZE 32
#define GPUNVME_CTRL_MEDIA_ERROR_SIZE 24
#define GPUNVME_CTRL_PENDING_SIZE 16
#define GPUNVME_CTRL_MAX_MEDIA_ERRORS 16
#define GPUNVME_CTRL_MAX_DRIVES 64
#define GPUNVME_CTRL_DRIVE_STRIDE 32     // bytes between two drives' busy-until words
#define GPUNVME_CTRL_SEL_BYTES 128       // per warp, before its pending entries
#define GPUNVME_CTRL_MIN_STRIPE_SHIFT 12
#define GPUNVME_CTRL_MAX_STRIPE_SHIFT 30

// Fault bits (ctrl_control.faults): any of them, or a namespace with a timing model, puts the
// warps on the model's path (MODEL).
#define GPUNVME_FAULT_DROPS 1u  // drop counters may be non-zero
#define GPUNVME_FAULT_DELAY 2u  // ctrl_control.delay_ns is added to every completion
#define GPUNVME_FAULT_MEDIA 4u  // media error ranges are set

// Hostile modes (ctrl_control.hostile), mirroring nvme_emu::Hostile: each turns a client bug
// that stale memory would hide into a failure the client cannot miss. None slows the friendly
// path (the model's `slow` flag is unaffected).
#define GPUNVME_HOSTILE_POISON_SQ 1u      // a fetched SQE is overwritten: opcode 7Fh, CID FFFFh
#define GPUNVME_HOSTILE_BACKWARD_TAIL 2u  // an SQ tail that moves back over unfetched entries
                                          //   is an invalid doorbell write (counted, ignored)
#define GPUNVME_HOSTILE_STALE_CQ 4u       // CQ entries a head doorbell frees are rewritten at
                                          //   once with their phase and garbage (CID, SQ id FFFFh)
#define GPUNVME_POISON_OPCODE 0x7fu
#define GPUNVME_POISON_CID 0xffffu

// Media kinds (ctrl_ns.kind).
#define GPUNVME_MEDIA_NULL 0
#define GPUNVME_MEDIA_HBM 1
#define GPUNVME_MEDIA_HOST 2

// Namespace flags (ctrl_ns.flags).
#define GPUNVME_NS_READ_ONLY 1u

namespace gpunvme {
namespace ctrl {

/// One I/O queue pair (SQ qid posting to CQ qid), indexed by qid - 1. Host-written.
struct ctrl_queue {
    uint64_t sq;          // GPU pointer of the SQ ring (0: no SQ)
    uint64_t cq;          // GPU pointer of the CQ ring (0: no CQ)
    uint32_t sq_entries;
    uint32_t cq_entries;
    uint32_t serial;      // changes whenever the entry describes a new queue
    uint32_t reserved;
};

/// A range of device addresses the controller may move data to or from. Device addresses are
/// GPU pointers (identity), so a window is a GPU allocation (or a mapped host one).
struct ctrl_window {
    uint64_t base;
    uint64_t len;
};

/// One namespace, indexed by nsid - 1.
struct ctrl_ns {
    uint64_t blocks;      // namespace size in logical blocks
    uint64_t media;       // GPU pointer of the media (0 for null media)
    uint32_t lba_shift;   // 9 or 12
    uint32_t kind;        // GPUNVME_MEDIA_*
    uint32_t flags;       // GPUNVME_NS_*
    uint32_t reserved;
};

/// The host's control block, pinned host memory mapped into the GPU.
struct ctrl_control {
    uint32_t stop;          // host: 1 = stop now
    uint32_t generation;    // host: bumped (release) after any table change
    uint32_t nqueues;       // queue ids 1..=nqueues may exist
    uint32_t nwindows;
    uint32_t nns;
    uint32_t idle_ns;       // longest sleep after a pass that found nothing to do
    uint32_t max_transfer;  // MDTS in bytes
    uint32_t nmedia_errors; // entries of media_errors in use
    uint64_t queues;        // GPU pointer (mapped host): ctrl_queue[nqueues]
    uint64_t windows;       // GPU pointer (mapped host): ctrl_window[GPUNVME_CTRL_MAX_WINDOWS]
    uint64_t namespaces;    // GPU pointer (mapped host): ctrl_ns[GPUNVME_CTRL_MAX_NS]
    uint64_t doorbells;     // GPU pointer (GPU memory): queue qid's SQ tail at
                            //   (qid - 1) * GPUNVME_CTRL_DOORBELL_STRIDE, its CQ head 4 B later
    uint64_t counters;      // GPU pointer (GPU memory): ctrl_counters per warp
    uint64_t ack;           // GPU pointer (mapped host): uint32 per warp, last generation seen;
                            //   (uint32 per block from ack + 4 * warps: the block's SM id + 1)
    uint64_t lifetime_ns;   // the kernel stops by itself after this long (a bound, never 0)
    uint64_t models;        // GPU pointer (mapped host): ctrl_ns_model[GPUNVME_CTRL_MAX_NS]
    uint64_t media_errors;  // GPU pointer (mapped host): ctrl_media_error[..MAX_MEDIA_ERRORS]
    uint64_t drops;         // GPU pointer (GPU memory): uint64 per queue id, completions still
                            //   to drop ([0]: on any queue; ~0: every one)
    uint32_t faults;        // GPUNVME_FAULT_*
    uint32_t delay_ns;      // added to every completion's due time (GPUNVME_FAULT_DELAY)
    uint64_t mirror;        // GPU pointer (GPU memory): uint32 stop, uint32 generation as
                            //   block 0 last read them (HOST WORDS); the host initialises (0, 1)
    uint32_t hostile;       // GPUNVME_HOSTILE_* (read at start and at each reload)
    uint32_t reserved;
};

/// A namespace's SSD timing model (MODEL), indexed by nsid - 1. Host-written.
struct ctrl_ns_model {
    uint64_t busy;          // GPU pointer: per drive the %globaltimer ns until which it is
                            //   busy, GPUNVME_CTRL_DRIVE_STRIDE bytes apart
    uint64_t bw;            // bytes per second per drive (0: no bandwidth cap)
    uint32_t read_ns;       // fixed latency of a Read after its service
    uint32_t write_ns;      // of a Write
    uint32_t op_ns;         // ns per command per drive, ceil(1e9 / IOPS) (0: no IOPS cap)
    uint16_t drives;        // drives striped behind the namespace (0: no timing model)
    uint16_t stripe_shift;  // log2 of the stripe unit in bytes
};

/// An injected media error: LBAs slba..slba + nlb of namespace nsid. Host-written.
struct ctrl_media_error {
    uint64_t slba;
    uint64_t nlb;
    uint32_t nsid;
    uint32_t reserved;
};

/// A completion held by the model until it is due (per-warp dynamic shared memory).
struct ctrl_pending {
    unsigned long long due;  // %globaltimer ns from which it may be posted (0: being removed)
    uint32_t dw3;            // CID | status field << 16, without the phase tag
    uint32_t meta;           // owning lane (its queue) in bits 4:0, fetch sequence above
};

/// What one controller warp did, written when it stops.
struct ctrl_counters {
    unsigned long long commands;        // commands completed (any status)
    unsigned long long errors;          // of which with a non-zero status
    unsigned long long bytes;           // data bytes moved
    unsigned long long doorbell_errors; // doorbell values out of range, ignored
    unsigned long long passes;          // polling passes
    unsigned long long idle_passes;     // passes that found no work
    unsigned long long reloads;         // table generations taken
    uint32_t dropped;                   // completions dropped (fault injection)
    uint32_t abandoned;                 // held completions never posted (stop, queue deleted)
};

static_assert(sizeof(ctrl_queue) == GPUNVME_CTRL_QUEUE_SIZE, "ctrl_queue size");
static_assert(sizeof(ctrl_window) == GPUNVME_CTRL_WINDOW_SIZE, "ctrl_window size");
static_assert(sizeof(ctrl_ns) == GPUNVME_CTRL_NS_SIZE, "ctrl_ns size");
static_assert(sizeof(ctrl_control) == GPUNVME_CTRL_CONTROL_SIZE, "ctrl_control size");
static_assert(sizeof(ctrl_counters) == GPUNVME_CTRL_COUNTERS_SIZE, "ctrl_counters size");
static_assert(offsetof(ctrl_control, stop) == GPUNVME_CC_STOP, "stop");
static_assert(offsetof(ctrl_control, generation) == GPUNVME_CC_GENERATION, "generation");
static_assert(offsetof(ctrl_control, queues) == GPUNVME_CC_QUEUES, "queues");
static_assert(offsetof(ctrl_control, ack) == GPUNVME_CC_ACK, "ack");
static_assert(offsetof(ctrl_control, lifetime_ns) == GPUNVME_CC_LIFETIME_NS, "lifetime_ns");
static_assert(offsetof(ctrl_control, mirror) == GPUNVME_CC_MIRROR, "mirror");
static_assert(offsetof(ctrl_control, nmedia_errors) == GPUNVME_CC_NMEDIA_ERRORS, "nmedia_errors");
static_assert(offsetof(ctrl_control, models) == GPUNVME_CC_MODELS, "models");
static_assert(offsetof(ctrl_control, media_errors) == GPUNVME_CC_MEDIA_ERRORS, "media_errors");
static_assert(offsetof(ctrl_control, drops) == GPUNVME_CC_DROPS, "drops");
static_assert(offsetof(ctrl_control, faults) == GPUNVME_CC_FAULTS, "faults");
static_assert(offsetof(ctrl_control, delay_ns) == GPUNVME_CC_DELAY_NS, "delay_ns");
static_assert(offsetof(ctrl_control, hostile) == GPUNVME_CC_HOSTILE, "hostile");
static_assert(sizeof(ctrl_ns_model) == GPUNVME_CTRL_NS_MODEL_SIZE, "ctrl_ns_model size");
static_assert(sizeof(ctrl_media_error) == GPUNVME_CTRL_MEDIA_ERROR_SIZE, "ctrl_media_error size");
static_assert(sizeof(ctrl_pending) == GPUNVME_CTRL_PENDING_SIZE, "ctrl_pending size");
static_assert(GPUNVME_CTRL_MAX_NS <= 32 && GPUNVME_CTRL_MAX_MEDIA_ERRORS <= 32,
              "one lane per entry in reload");

// NVMe status codes the model returns (NVMe Base 2.0 Figure 102, NVM Command Set Figure 24).
enum : uint32_t {
    SC_SUCCESS = 0x00,
    SC_INVALID_OPCODE = 0x01,
    SC_INVALID_FIELD = 0x02,
    SC_DATA_TRANSFER_ERROR = 0x04,
    SC_INVALID_NAMESPACE = 0x0b,
    SC_PRP_OFFSET_INVALID = 0x13,
    SC_NAMESPACE_WRITE_PROTECTED = 0x20,
    SC_LBA_OUT_OF_RANGE = 0x80,
    // Media and Data Integrity Errors (SCT 2).
    SC_WRITE_FAULT = 0x80 | (2u << 8),
    SC_UNRECOVERED_READ_ERROR = 0x81 | (2u << 8),
};
enum : uint32_t { SCT_MEDIA = 2 };
enum : uint8_t { OPC_DSM = 0x09 };

/// Per-warp shared-memory copy of the windows and namespaces.
struct warp_tables {
    ctrl_window windows[GPUNVME_CTRL_MAX_WINDOWS];
    ctrl_ns ns[GPUNVME_CTRL_MAX_NS];
    uint32_t nwindows;
    uint32_t nns;
    uint32_t max_transfer;
    uint32_t hostile;   // GPUNVME_HOSTILE_*
    // MODEL: timing models and faults (copied like the rest at each generation).
    ctrl_ns_model models[GPUNVME_CTRL_MAX_NS];
    ctrl_media_error errs[GPUNVME_CTRL_MAX_MEDIA_ERRORS];
    uint64_t drops;     // GPU pointer of the drop counters
    uint32_t nerrs;
    uint32_t faults;
    uint32_t delay_ns;
    uint32_t slow;      // model path: a namespace has a timing model or a fault is set
};

#ifdef GPUNVME_HOST_BUILD
// The CPU harness (ptx/host/): relaxed atomic accesses and full fences.
__device__ __forceinline__ uint32_t ld_sys(const uint32_t* p) {
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}
__device__ __forceinline__ uint64_t ld_sys64(const void* p) {
    return __atomic_load_n(static_cast<const uint64_t*>(p), __ATOMIC_RELAXED);
}
__device__ __forceinline__ uint32_t ld_gpu(const uint32_t* p) {
    return __atomic_load_n(p, __ATOMIC_RELAXED);
}
__device__ __forceinline__ unsigned long long ld_gpu64(const void* p) {
    return __atomic_load_n(static_cast<const unsigned long long*>(p), __ATOMIC_RELAXED);
}
__device__ __forceinline__ void st_gpu(uint32_t* p, uint32_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
__device__ __forceinline__ void st_sys(uint32_t* p, uint32_t v) {
    __atomic_store_n(p, v, __ATOMIC_RELAXED);
}
__device__ __forceinline__ uint4 ld_gpu4(const void* p) {
    const uint32_t* w = static_cast<const uint32_t*>(p);
    return make_uint4(__atomic_load_n(w, __ATOMIC_RELAXED), __atomic_load_n(w + 1, __ATOMIC_RELAXED),
                      __atomic_load_n(w + 2, __ATOMIC_RELAXED),
                      __atomic_load_n(w + 3, __ATOMIC_RELAXED));
}
__device__ __forceinline__ void fence_gpu() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
__device__ __forceinline__ void fence_sys() { __atomic_thread_fence(__ATOMIC_SEQ_CST); }
#else
__device__ __forceinline__ uint32_t ld_sys(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint64_t ld_sys64(const void* p) {
    uint64_t v;
    asm volatile("ld.relaxed.sys.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ uint32_t ld_gpu(const uint32_t* p) {
    uint32_t v;
    asm volatile("ld.relaxed.gpu.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned long long ld_gpu64(const void* p) {
    unsigned long long v;
    asm volatile("ld.relaxed.gpu.global.u64 %0, [%1];" : "=l"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ void st_gpu(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.gpu.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ void st_sys(uint32_t* p, uint32_t v) {
    asm volatile("st.relaxed.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ uint4 ld_gpu4(const void* p) {
    uint4 v;
    asm volatile("ld.relaxed.gpu.global.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p)
                 : "memory");
    return v;
}
__device__ __forceinline__ void fence_gpu() { asm volatile("fence.acq_rel.gpu;" ::: "memory"); }
__device__ __forceinline__ void fence_sys() { asm volatile("fence.acq_rel.sys;" ::: "memory"); }
#endif

/// The CQE status field (bits 15:1 of CQE dword 3's upper half; bit 0, the phase, left 0) of a
/// status SC | SCT << 8: Do Not Retry on every failure (retrying cannot help).
__device__ __forceinline__ uint32_t status_field(uint32_t status) {
    return status ? ((status & 0xffu) << 1) | (((status >> 8) & 7u) << 9) | 0x8000u : 0u;
}

/// Whether [addr, addr + len) lies in one window.
__device__ __forceinline__ bool in_window(const warp_tables& t, uint64_t addr, uint64_t len) {
    for (uint32_t i = 0; i < t.nwindows; ++i) {
        const ctrl_window w = t.windows[i];
        if (addr >= w.base && addr - w.base <= w.len && len <= w.len - (addr - w.base)) return true;
    }
    return false;
}

/// A checked command, as the lane that fetched it decoded it.
struct decoded {
    uint32_t cid;
    uint32_t status;   // SC | SCT << 8 (0: success so far)
    uint32_t opcode;
    uint32_t ns;       // namespace index (nsid - 1) when it has one
    uint64_t slba;
    uint64_t nlb;      // blocks (Read, Write, Write Zeroes)
    uint64_t prp1, prp2;
    uint32_t len;      // data bytes through the PRPs (Read, Write, DSM ranges)
    uint32_t dsm_ad;   // DSM: deallocate
};

/// Checks a command's PRPs for `len` bytes (NVMe Base 2.0, 4.1.1; nvme_emu prp.rs): PRP1
/// dword aligned, PRP2 page aligned or a qword-aligned list, list entries page aligned, list
/// pages chained through their last entry, and every page and list inside a window. List
/// entries are plain loads: the client wrote them before the release fence of its doorbell.
__device__ __forceinline__ uint32_t prp_walk_check(const warp_tables& t, uint64_t prp1,
                                                   uint64_t prp2, uint32_t len) {
    if (len == 0) return SC_SUCCESS;
    if (prp1 & 3) return SC_PRP_OFFSET_INVALID;
    uint32_t first = GPUNVME_PAGE_SIZE - (uint32_t)(prp1 % GPUNVME_PAGE_SIZE);
    if (first > len) first = len;
    if (!in_window(t, prp1, first)) return SC_DATA_TRANSFER_ERROR;
    uint32_t remaining = len - first;
    if (remaining == 0) return SC_SUCCESS;
    if (remaining <= GPUNVME_PAGE_SIZE) {
        if (prp2 % GPUNVME_PAGE_SIZE) return SC_PRP_OFFSET_INVALID;
        if (!in_window(t, prp2, remaining)) return SC_DATA_TRANSFER_ERROR;
        return SC_SUCCESS;
    }
    if (prp2 & 7) return SC_PRP_OFFSET_INVALID;
    uint64_t list = prp2;
    for (;;) {
        uint32_t slots = (uint32_t)((GPUNVME_PAGE_SIZE - list % GPUNVME_PAGE_SIZE) / 8);
        uint32_t pages_left = (remaining + GPUNVME_PAGE_SIZE - 1) / GPUNVME_PAGE_SIZE;
        bool chained = pages_left > slots;
        uint32_t entries = chained ? slots : pages_left;
        if (!in_window(t, list, (uint64_t)entries * 8)) return SC_DATA_TRANSFER_ERROR;
        const uint64_t* e = reinterpret_cast<const uint64_t*>(list);
        uint32_t data_entries = chained ? entries - 1 : entries;
        for (uint32_t i = 0; i < data_entries; ++i) {
            uint64_t page = e[i];
            if (page % GPUNVME_PAGE_SIZE) return SC_PRP_OFFSET_INVALID;
            uint32_t n = remaining < GPUNVME_PAGE_SIZE ? remaining : GPUNVME_PAGE_SIZE;
            if (!in_window(t, page, n)) return SC_DATA_TRANSFER_ERROR;
            remaining -= n;
        }
        if (!chained) return SC_SUCCESS;
        uint64_t next = e[entries - 1];
        if (next % GPUNVME_PAGE_SIZE) return SC_PRP_OFFSET_INVALID;
        list = next;
    }
}

/// Fetches and checks SQE `sqe` (one lane), as nvme_emu's Worker::io does.
__device__ inline decoded decode_and_check(const warp_tables& t, const uint8_t* sqe) {
    decoded d{};
    uint4 w0 = ld_gpu4(sqe), w1 = ld_gpu4(sqe + 16), w2 = ld_gpu4(sqe + 32), w3 = ld_gpu4(sqe + 48);
    const uint32_t cdw0 = w0.x;
    d.cid = cdw0 >> 16;
    d.opcode = cdw0 & 0xffu;
    const uint32_t nsid = w0.y;
    d.prp1 = ((uint64_t)w1.w << 32) | w1.z;
    d.prp2 = ((uint64_t)w2.y << 32) | w2.x;
    d.slba = ((uint64_t)w2.w << 32) | w2.z;
    const uint32_t cdw10 = w2.z, cdw11 = w2.w, cdw12 = w3.x;
    const uint32_t op = d.opcode;
    if (op != OPC_READ && op != OPC_WRITE && op != OPC_FLUSH && op != OPC_WRITE_ZEROES &&
        op != OPC_DSM) {
        d.status = SC_INVALID_OPCODE;
        return d;
    }
    // Fused operations and SGLs are not supported (CDW0 FUSE, PSDT).
    if (((cdw0 >> 8) & 3u) || ((cdw0 >> 14) & 3u)) { d.status = SC_INVALID_FIELD; return d; }
    if (op == OPC_FLUSH) {
        if (nsid != 0xffffffffu && (nsid == 0 || nsid > t.nns)) d.status = SC_INVALID_NAMESPACE;
        return d;
    }
    if (nsid == 0 || nsid > t.nns) { d.status = SC_INVALID_NAMESPACE; return d; }
    d.ns = nsid - 1;
    const ctrl_ns& ns = t.ns[d.ns];
    if (op == OPC_READ || op == OPC_WRITE) {
        // Directives (DTYPE, CDW12 23:20) and storage tags (STC, bit 24) are not supported.
        if ((cdw12 >> 20) & 0x1fu) { d.status = SC_INVALID_FIELD; return d; }
        d.nlb = (uint64_t)(cdw12 & 0xffffu) + 1;
        uint64_t len = d.nlb << ns.lba_shift;
        if (len > t.max_transfer) { d.status = SC_INVALID_FIELD; return d; }
        if (d.slba + d.nlb < d.slba || d.slba + d.nlb > ns.blocks) {
            d.status = SC_LBA_OUT_OF_RANGE;
            return d;
        }
        if (op == OPC_WRITE && (ns.flags & GPUNVME_NS_READ_ONLY)) {
            d.status = SC_NAMESPACE_WRITE_PROTECTED;
            return d;
        }
        d.len = (uint32_t)len;
        d.status = prp_walk_check(t, d.prp1, d.prp2, d.len);
        return d;
    }
    if (op == OPC_WRITE_ZEROES) {
        if ((cdw12 >> 24) & 1u) { d.status = SC_INVALID_FIELD; return d; }
        d.nlb = (uint64_t)(cdw12 & 0xffffu) + 1;
        if (d.slba + d.nlb < d.slba || d.slba + d.nlb > ns.blocks) d.status = SC_LBA_OUT_OF_RANGE;
        else if (ns.flags & GPUNVME_NS_READ_ONLY) d.status = SC_NAMESPACE_WRITE_PROTECTED;
        return d;
    }
    // Dataset Management: NR ranges of 16 bytes through the PRPs; AD (CDW11 bit 2) deallocates.
    d.len = ((cdw10 & 0xffu) + 1) * 16;
    d.dsm_ad = (cdw11 >> 2) & 1u;
    // Its ranges are checked by the warp before anything is deallocated (warp_execute).
    d.status = prp_walk_check(t, d.prp1, d.prp2, d.len);
    return d;
}

/// The device address of byte `off` of a command's data (PRPs already checked).
__device__ inline uint64_t prp_addr(uint64_t prp1, uint64_t prp2, uint32_t len, uint32_t off) {
    uint32_t first = GPUNVME_PAGE_SIZE - (uint32_t)(prp1 % GPUNVME_PAGE_SIZE);
    if (off < first) return prp1 + off;
    uint32_t rest = len - first;
    uint32_t page = (off - first) / GPUNVME_PAGE_SIZE;
    uint32_t in_page = (off - first) % GPUNVME_PAGE_SIZE;
    if (rest <= GPUNVME_PAGE_SIZE) return prp2 + in_page;
    uint64_t list = prp2;
    for (;;) {
        uint32_t slots = (uint32_t)((GPUNVME_PAGE_SIZE - list % GPUNVME_PAGE_SIZE) / 8);
        uint32_t pages_left = (rest + GPUNVME_PAGE_SIZE - 1) / GPUNVME_PAGE_SIZE;
        const uint64_t* e = reinterpret_cast<const uint64_t*>(list);
        if (pages_left <= slots || page < slots - 1) return e[page] + in_page;
        // Chained: the last slot points to the next list page.
        page -= slots - 1;
        rest -= (slots - 1) * GPUNVME_PAGE_SIZE;
        list = e[slots - 1];
    }
}

/// Range `i` of a DSM command (after its PRPs were checked).
__device__ __forceinline__ void dsm_range(const decoded& d, uint32_t i, uint64_t* slba,
                                          uint32_t* nlb) {
    const uint32_t* r = reinterpret_cast<const uint32_t*>(prp_addr(d.prp1, d.prp2, d.len, i * 16));
    *nlb = r[1];
    *slba = ((uint64_t)r[3] << 32) | r[2];
}

/// The warp copies n 16-byte words from `src` to `dst` (both 16-byte aligned).
__device__ __forceinline__ void warp_copy16(uint4* d, const uint4* s, uint32_t n, uint32_t lane) {
    uint32_t k = lane;
    // Eight loads in flight per lane before their stores (host media is read over PCIe).
    for (; k + 7 * 32 < n; k += 8 * 32) {
        uint4 v[8];
#pragma unroll
        for (int x = 0; x < 8; ++x) v[x] = __ldcg(s + k + x * 32);
#pragma unroll
        for (int x = 0; x < 8; ++x) __stcg(d + k + x * 32, v[x]);
    }
    for (; k < n; k += 32) __stcg(d + k, __ldcg(s + k));
}

/// The 16 bytes that start `W` 4-byte words into `a` and run on into `b`.
template <uint32_t W>
__device__ __forceinline__ uint4 funnel16(const uint4& a, const uint4& b) {
    if (W == 1) return make_uint4(a.y, a.z, a.w, b.x);
    if (W == 2) return make_uint4(a.z, a.w, b.x, b.y);
    return make_uint4(a.w, b.x, b.y, b.z);
}

/// The warp copies n 16-byte words to `d` (16-byte aligned) from `s`, which lies W 4-byte
/// words past the 16-byte boundary `a`: each word from the two aligned words it straddles
/// (both hold bytes of the copy, so nothing past the source is read).
template <uint32_t W>
__device__ __forceinline__ void warp_copy16_shifted(uint4* d, const uint4* a, uint32_t n,
                                                    uint32_t lane) {
    uint32_t k = lane;
    for (; k + 3 * 32 < n; k += 4 * 32) {
        uint4 lo[4], hi[4];
#pragma unroll
        for (int x = 0; x < 4; ++x) {
            lo[x] = __ldcg(a + k + x * 32);
            hi[x] = __ldcg(a + k + x * 32 + 1);
        }
#pragma unroll
        for (int x = 0; x < 4; ++x) __stcg(d + k + x * 32, funnel16<W>(lo[x], hi[x]));
    }
    for (; k < n; k += 32) __stcg(d + k, funnel16<W>(__ldcg(a + k), __ldcg(a + k + 1)));
}

/// The warp copies `len` bytes (a multiple of 4) from `src` to `dst` (both 4-byte aligned).
/// When their offsets in a 16-byte word differ (a PRP page that starts 8 bytes into one, as a
/// safetensors tensor's data does), the bytes up to dst's next 16-byte boundary go as 4-byte
/// words and the rest as 16-byte stores assembled from aligned 16-byte loads, so that a shifted
/// copy keeps 16-byte loads in flight (4-byte copies with one load in flight per lane cannot
/// keep up with several modelled drives; figures in benches/results/history.md).
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, uint32_t len,
                                          uint32_t lane) {
    const uint32_t head = ((16u - ((uint32_t)(uintptr_t)dst & 15u)) & 15u) < len
                              ? (16u - ((uint32_t)(uintptr_t)dst & 15u)) & 15u
                              : len;
    if (lane < head / 4)
        reinterpret_cast<uint32_t*>(dst)[lane] = reinterpret_cast<const uint32_t*>(src)[lane];
    dst += head;
    src += head;
    len -= head;
    const uint32_t n = len / 16, w = ((uint32_t)(uintptr_t)src & 15u) / 4;
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4* a = reinterpret_cast<const uint4*>(src - 4 * w);
    if (w == 0) warp_copy16(d, a, n, lane);
    else if (w == 1) warp_copy16_shifted<1>(d, a, n, lane);
    else if (w == 2) warp_copy16_shifted<2>(d, a, n, lane);
    else warp_copy16_shifted<3>(d, a, n, lane);
    const uint32_t tail = len - 16 * n;
    if (lane < tail / 4)
        reinterpret_cast<uint32_t*>(dst + 16 * n)[lane] =
            reinterpret_cast<const uint32_t*>(src + 16 * n)[lane];
}

/// The warp zeroes `len` bytes at `dst` (512-byte aligned, a multiple of 512).
__device__ __forceinline__ void warp_zero(uint8_t* dst, uint64_t len, uint32_t lane) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (uint64_t k = lane; k < len / 16; k += 32) __stcg(d + k, z);
}

/// Whether LBAs slba..slba + nlb of namespace `nsid` meet an injected media error (MODEL).
__device__ __forceinline__ bool media_error_in(const warp_tables& t, uint32_t nsid,
                                               uint64_t slba, uint64_t nlb) {
    if (nlb == 0) return false;
    for (uint32_t i = 0; i < t.nerrs; ++i) {
        const ctrl_media_error& e = t.errs[i];
        if (e.nsid == nsid && slba < e.slba + e.nlb && e.slba < slba + nlb) return true;
    }
    return false;
}

/// An injected media error's status for a checked Read, Write or Write Zeroes (nvme_emu
/// nvm.rs: Unrecovered Read Error for reads, Write Fault for the others), else `d.status`.
__device__ __forceinline__ uint32_t media_error_status(const warp_tables& t, const decoded& d) {
    if (d.status || t.nerrs == 0) return d.status;
    if (d.opcode != OPC_READ && d.opcode != OPC_WRITE && d.opcode != OPC_WRITE_ZEROES)
        return d.status;
    if (!media_error_in(t, d.ns + 1, d.slba, d.nlb)) return d.status;
    return d.opcode == OPC_READ ? SC_UNRECOVERED_READ_ERROR : SC_WRITE_FAULT;
}

/// The warp moves command d's data between its PRPs and the media (Read, Write), or zeroes
/// (Write Zeroes, DSM deallocate). Returns the status after execution.
__device__ inline uint32_t warp_execute(const warp_tables& t, decoded d, uint32_t lane,
                                        unsigned long long* bytes) {
    if (d.status) return d.status;
    if (d.opcode == OPC_FLUSH) return SC_SUCCESS;
    const ctrl_ns& ns = t.ns[d.ns];
    const bool has_media = ns.kind != GPUNVME_MEDIA_NULL && ns.media != 0;
    if (d.opcode == OPC_READ || d.opcode == OPC_WRITE) {
        if (has_media) {
            uint8_t* media = reinterpret_cast<uint8_t*>(ns.media) + (d.slba << ns.lba_shift);
            uint32_t off = 0;
            while (off < d.len) {
                uint64_t addr = prp_addr(d.prp1, d.prp2, d.len, off);
                uint32_t n = GPUNVME_PAGE_SIZE - (uint32_t)(addr % GPUNVME_PAGE_SIZE);
                if (n > d.len - off) n = d.len - off;
                uint8_t* host = reinterpret_cast<uint8_t*>(addr);
                if (d.opcode == OPC_READ) warp_copy(host, media + off, n, lane);
                else warp_copy(media + off, host, n, lane);
                off += n;
            }
        }
        *bytes += d.len;
        return SC_SUCCESS;
    }
    if (d.opcode == OPC_WRITE_ZEROES) {
        if (has_media)
            warp_zero(reinterpret_cast<uint8_t*>(ns.media) + (d.slba << ns.lba_shift),
                      d.nlb << ns.lba_shift, lane);
        return SC_SUCCESS;
    }
    // DSM: check every range first, then deallocate (reads as zeroes afterwards).
    const uint32_t nr = d.len / 16;
    bool ok = true;
    for (uint32_t i = lane; i < nr; i += 32) {
        uint64_t slba;
        uint32_t nlb;
        dsm_range(d, i, &slba, &nlb);
        if (slba + nlb < slba || slba + nlb > ns.blocks) ok = false;
    }
    if (!__all_sync(0xffffffffu, ok)) return SC_LBA_OUT_OF_RANGE;
    if (ns.flags & GPUNVME_NS_READ_ONLY) return SC_NAMESPACE_WRITE_PROTECTED;
    if (d.dsm_ad && t.nerrs) {
        // Injected media errors (MODEL): deallocating a range that meets one is a Write Fault.
        bool hit = false;
        for (uint32_t i = lane; i < nr; i += 32) {
            uint64_t slba;
            uint32_t nlb;
            dsm_range(d, i, &slba, &nlb);
            hit |= media_error_in(t, d.ns + 1, slba, nlb);
        }
        if (__any_sync(0xffffffffu, hit)) return SC_WRITE_FAULT;
    }
    if (!d.dsm_ad || !has_media) return SC_SUCCESS;
    for (uint32_t i = 0; i < nr; ++i) {
        uint64_t slba;
        uint32_t nlb;
        dsm_range(d, i, &slba, &nlb);
        warp_zero(reinterpret_cast<uint8_t*>(ns.media) + (slba << ns.lba_shift),
                  (uint64_t)nlb << ns.lba_shift, lane);
    }
    return SC_SUCCESS;
}

/// One controller lane's queue, in registers.
struct lane_queue {
    const uint8_t* sq;
    uint8_t* cq;
    uint32_t* sq_db;
    uint32_t* cq_db;
    uint32_t sq_entries, cq_entries;
    uint32_t serial;
    uint32_t sq_head;   // next SQE to fetch
    uint32_t cq_tail;   // next CQE to post
    uint32_t cq_phase;  // phase tag of the next CQE (starts at 1)
    uint32_t cq_head;   // last valid CQ head doorbell value
    uint32_t sq_tail;   // last valid SQ tail doorbell value
    uint32_t qid;       // 0: none
    uint32_t cq_pending; // CQ entries reserved for held completions (MODEL; else 0)
};

/// Reloads the warp's queues (each lane its own) and tables from the host's tables. Returns
/// whether this lane's queue changed (a new queue on its id, or deleted): held completions of
/// the old queue must then be discarded.
__device__ inline bool reload(const ctrl_control* c, warp_tables* t, lane_queue* q,
                              uint32_t lane) {
    // Every lane's reads of the tables (since the last reload) come before this reload's
    // writes (compute-sanitizer racecheck: a lane could still be reading `t->slow`).
    __syncwarp();
    fence_sys();  // acquire: the tables the host wrote before bumping the generation
    const uint32_t nwin = ld_sys(&c->nwindows), nns = ld_sys(&c->nns);
    const ctrl_window* w = reinterpret_cast<const ctrl_window*>(ld_sys64(&c->windows));
    const ctrl_ns* n = reinterpret_cast<const ctrl_ns*>(ld_sys64(&c->namespaces));
    const ctrl_ns_model* m = reinterpret_cast<const ctrl_ns_model*>(ld_sys64(&c->models));
    const ctrl_media_error* me =
        reinterpret_cast<const ctrl_media_error*>(ld_sys64(&c->media_errors));
    for (uint32_t i = lane; i < GPUNVME_CTRL_MAX_WINDOWS; i += 32) {
        if (i < nwin) {
            t->windows[i].base = ld_sys64(&w[i].base);
            t->windows[i].len = ld_sys64(&w[i].len);
        }
    }
    bool timed = false;
    for (uint32_t i = lane; i < GPUNVME_CTRL_MAX_NS; i += 32) {
        if (i < nns) {
            t->ns[i].blocks = ld_sys64(&n[i].blocks);
            t->ns[i].media = ld_sys64(&n[i].media);
            t->ns[i].lba_shift = ld_sys(&n[i].lba_shift);
            t->ns[i].kind = ld_sys(&n[i].kind);
            t->ns[i].flags = ld_sys(&n[i].flags);
            ctrl_ns_model mm{};
            if (m) {
                mm.busy = ld_sys64(&m[i].busy);
                mm.bw = ld_sys64(&m[i].bw);
                mm.read_ns = ld_sys(&m[i].read_ns);
                mm.write_ns = ld_sys(&m[i].write_ns);
                mm.op_ns = ld_sys(&m[i].op_ns);
                const uint32_t ds = ld_sys(reinterpret_cast<const uint32_t*>(&m[i].drives));
                uint32_t drives = ds & 0xffffu, shift = ds >> 16;
                if (drives > GPUNVME_CTRL_MAX_DRIVES || !mm.busy) drives = 0;
                if (shift < GPUNVME_CTRL_MIN_STRIPE_SHIFT) shift = GPUNVME_CTRL_MIN_STRIPE_SHIFT;
                if (shift > GPUNVME_CTRL_MAX_STRIPE_SHIFT) shift = GPUNVME_CTRL_MAX_STRIPE_SHIFT;
                mm.drives = (uint16_t)drives;
                mm.stripe_shift = (uint16_t)shift;
            }
            t->models[i] = mm;
            timed |= mm.drives != 0;
        }
    }
    uint32_t nerr = me ? ld_sys(&c->nmedia_errors) : 0;
    if (nerr > GPUNVME_CTRL_MAX_MEDIA_ERRORS) nerr = GPUNVME_CTRL_MAX_MEDIA_ERRORS;
    for (uint32_t i = lane; i < GPUNVME_CTRL_MAX_MEDIA_ERRORS; i += 32) {
        if (i < nerr) {
            t->errs[i].slba = ld_sys64(&me[i].slba);
            t->errs[i].nlb = ld_sys64(&me[i].nlb);
            t->errs[i].nsid = ld_sys(&me[i].nsid);
            // Past the end of the LBA space: as far as it goes (no wrap in the overlap test).
            if (t->errs[i].slba + t->errs[i].nlb < t->errs[i].slba)
                t->errs[i].nlb = ~0ull - t->errs[i].slba;
        }
    }
    const bool any_timed = __any_sync(0xffffffffu, timed);
    if (lane == 0) {
        t->nwindows = nwin < GPUNVME_CTRL_MAX_WINDOWS ? nwin : GPUNVME_CTRL_MAX_WINDOWS;
        t->nns = nns < GPUNVME_CTRL_MAX_NS ? nns : GPUNVME_CTRL_MAX_NS;
        t->max_transfer = ld_sys(&c->max_transfer);
        t->hostile = ld_sys(&c->hostile);
        t->nerrs = nerr;
        t->drops = ld_sys64(&c->drops);
        t->faults = ld_sys(&c->faults);
        t->delay_ns = (t->faults & GPUNVME_FAULT_DELAY) ? ld_sys(&c->delay_ns) : 0;
        if (!t->drops) t->faults &= ~GPUNVME_FAULT_DROPS;
        t->slow = any_timed || t->faults != 0 || nerr != 0;
    }
    bool changed = false;
    if (q->qid) {
        const ctrl_queue* e = reinterpret_cast<const ctrl_queue*>(ld_sys64(&c->queues)) + (q->qid - 1);
        const uint32_t serial = ld_sys(&e->serial);
        const uint64_t sq = ld_sys64(&e->sq), cq = ld_sys64(&e->cq);
        const uint32_t sqe = ld_sys(&e->sq_entries), cqe = ld_sys(&e->cq_entries);
        const bool live = sq && cq && sqe >= 2 && cqe >= 2;
        if (!live) {
            changed = q->sq != nullptr;
            q->sq = nullptr;
            q->serial = serial;
            q->cq_pending = 0;
        } else if (serial != q->serial || !q->sq) {
            // A new queue on this id: both rings start empty, the CQ's first phase is 1.
            changed = true;
            q->sq = reinterpret_cast<const uint8_t*>(sq);
            q->cq = reinterpret_cast<uint8_t*>(cq);
            q->sq_entries = sqe;
            q->cq_entries = cqe;
            q->serial = serial;
            q->sq_head = q->cq_tail = q->cq_head = q->sq_tail = 0;
            q->cq_phase = 1;
            q->cq_pending = 0;
        }
    }
    __syncwarp();
    return changed;
}

// ---------------------------------------------------------------------------------------------
// HOSTILE (mirroring nvme_emu's worker; the owning lane, on its own queue).

/// GPUNVME_HOSTILE_POISON_SQ: overwrites the SQE at `sqe` (just decoded) with the reserved
/// opcode and command id, so that a tail doorbell covering this slot before the client rewrote
/// it submits the poison, not the slot's old command. Plain stores before the fetch's completion
/// fence: a client learns the slot is free only from a completion, whose phase dword the
/// release fence orders after them.
__device__ __forceinline__ void poison_sqe(const uint8_t* sqe) {
    uint4* p = reinterpret_cast<uint4*>(const_cast<uint8_t*>(sqe));
    p[0] = make_uint4(GPUNVME_POISON_OPCODE | (GPUNVME_POISON_CID << 16), 0u, 0u, 0u);
    p[1] = make_uint4(0u, 0u, 0u, 0u);
    p[2] = make_uint4(0u, 0u, 0u, 0u);
    p[3] = make_uint4(0u, 0u, 0u, 0u);
}

/// GPUNVME_HOSTILE_STALE_CQ: rewrites CQ entries [from, to) of `q`, just freed by a head
/// doorbell, with the phase each was posted with (entries before the tail were posted in the
/// current phase, the others in the previous one) and garbage: a client that rang the head
/// before reading an entry reads a command id it never issued. Bounded by the ring's size. The
/// warp's __syncwarp after the doorbells orders these stores before any later post to the same
/// slots by other lanes (it runs in every pass where a lane rewrote entries).
__device__ inline void stale_cq_entries(const lane_queue& q, uint32_t from, uint32_t to) {
    for (uint32_t slot = from, n = 0; slot != to && n < q.cq_entries; ++n) {
        const uint32_t ph = slot < q.cq_tail ? q.cq_phase : (q.cq_phase ^ 1u);
        uint32_t* e = reinterpret_cast<uint32_t*>(q.cq + (size_t)slot * 16);
        *reinterpret_cast<uint4*>(e) =
            make_uint4(0xdeadbeefu, 0xdeadbeefu, 0xffffu | (0xffffu << 16),
                       GPUNVME_POISON_CID | ((0x7ffeu | ph) << 16));
        slot = slot + 1 == q.cq_entries ? 0 : slot + 1;
    }
}

// ---------------------------------------------------------------------------------------------
// MODEL: SSD timing, held completions, dropped completions.

/// Service time in ns of one command piece of `bytes` on a drive: max(op_ns, ceil(bytes * 1e9 /
/// bw)). Mirrors gpu_emu::ssd_model::service_ns.
__device__ __forceinline__ uint64_t service_ns(const ctrl_ns_model& m, uint64_t bytes) {
    uint64_t s = m.op_ns;
    if (m.bw) {
        const uint64_t b = (bytes * 1000000000ull + m.bw - 1) / m.bw;
        if (b > s) s = b;
    }
    return s;
}

/// Reserves `svc` ns of a drive's time starting no earlier than `now`; returns the start.
/// Intervals never overlap and never start before `now` (a CAS loop of at most 8 tries, then
/// the wait-free atomicMax + atomicAdd, whose start may be later than the exact one by the
/// other lanes' skew, never earlier). Mirrors gpu_emu::ssd_model::SsdTwin::reserve.
__device__ __forceinline__ uint64_t drive_reserve(unsigned long long* busy, uint64_t now,
                                                  uint64_t svc) {
    unsigned long long old = ld_gpu64(busy);
    for (int i = 0; i < 8; ++i) {
        const unsigned long long start = old > now ? old : now;
        const unsigned long long prev = atomicCAS(busy, old, start + svc);
        if (prev == old) return start;
        old = prev;
    }
    atomicMax(busy, (unsigned long long)now);
    return atomicAdd(busy, (unsigned long long)svc);
}

/// When a timed Read or Write of `len` bytes at byte `offset` of its namespace is due: each
/// stripe piece reserves its drive (drive = stripe unit % drives), the completion is due when
/// the last piece's service ends, plus the read or write latency. Mirrors
/// gpu_emu::ssd_model::SsdTwin::submit (which takes one `now`; here each piece reads the
/// clock just before its reservation). Bounded: len <= MDTS, pieces >= 4 KiB.
__device__ inline uint64_t model_due(const ctrl_ns_model& m, bool write, uint64_t offset,
                                     uint64_t len) {
    const uint32_t shift = m.stripe_shift;
    uint64_t done = now_ns();
    uint64_t off = offset;
    const uint64_t end = offset + len;
    while (off < end) {
        const uint64_t unit = off >> shift;
        uint64_t piece_end = (unit + 1) << shift;
        if (piece_end > end) piece_end = end;
        const uint32_t drive = (uint32_t)(unit % m.drives);
        unsigned long long* busy = reinterpret_cast<unsigned long long*>(
            m.busy + (uint64_t)drive * GPUNVME_CTRL_DRIVE_STRIDE);
        const uint64_t svc = service_ns(m, piece_end - off);
        const uint64_t start = drive_reserve(busy, now_ns(), svc);
        if (start + svc > done) done = start + svc;
        off = piece_end;
    }
    return done + (write ? m.write_ns : m.read_ns);
}

/// Takes up to `want` drops from a drop counter (~0: drop everything, never decremented).
/// Bounded: gives up (drops none) after 32 contended tries.
__device__ inline uint32_t take_drops(unsigned long long* w, uint32_t want) {
    unsigned long long v = ld_gpu64(w);
    for (int i = 0; i < 32 && v != 0 && want != 0; ++i) {
        if (v == ~0ull) return want;
        const unsigned long long take = v < want ? v : want;
        const unsigned long long prev = atomicCAS(w, v, v - take);
        if (prev == v) return (uint32_t)take;
        v = prev;
    }
    return 0;
}

__device__ __forceinline__ unsigned long long warp_min64(unsigned long long v) {
    for (int o = 16; o > 0; o >>= 1) {
        const unsigned long long x = __shfl_xor_sync(0xffffffffu, v, o);
        if (x < v) v = x;
    }
    return v;
}

/// A controller warp's held completions: entries [0, count) of its dynamic shared memory slice.
/// Every field is warp-uniform.
struct pending_list {
    ctrl_pending* e;
    uint32_t* sel;                 // GPUNVME_CTRL_SEL_BYTES: the entries a post takes
    uint32_t cap;
    uint32_t count;
    uint32_t seq;                  // fetch sequence of the next entry
    unsigned long long next_due;   // no entry is due before this
};

/// Removes the entries marked due == 0 from index `from` on, keeping the others' order.
__device__ inline void pending_compact(pending_list& pl, uint32_t from, uint32_t lane) {
    const uint32_t lt = (1u << lane) - 1u;
    uint32_t out = from;
    for (uint32_t base = from; base < pl.count; base += 32) {
        const uint32_t i = base + lane;
        ctrl_pending p{};
        bool keep = false;
        if (i < pl.count) {
            p = pl.e[i];
            keep = p.due != 0;
        }
        const uint32_t m = __ballot_sync(0xffffffffu, keep);
        __syncwarp();  // every lane read its entry before any is overwritten (out <= base)
        if (keep) pl.e[out + __popc(m & lt)] = p;
        out += __popc(m);
        __syncwarp();
    }
    if (from < pl.count) pl.count = out;
}

/// Discards the held completions of the queues of `lanes` (bit per owning lane); returns how
/// many.
__device__ inline uint32_t pending_purge(pending_list& pl, uint32_t lanes, uint32_t lane) {
    uint32_t n = 0;
    for (uint32_t i = lane; i < pl.count; i += 32) {
        if ((lanes >> (pl.e[i].meta & 31u)) & 1u) {
            pl.e[i].due = 0;
            ++n;
        }
    }
    n = __reduce_add_sync(0xffffffffu, n);
    __syncwarp();
    if (n) pending_compact(pl, 0, lane);
    return n;
}

/// Entry (due, meta) a is posted before b: earlier due time, then earlier fetch (sequence
/// numbers compared modulo 2^27).
__device__ __forceinline__ bool posted_before(unsigned long long ad, uint32_t am,
                                              unsigned long long bd, uint32_t bm) {
    if (ad != bd) return ad < bd;
    return (((am >> 5) - (bm >> 5)) & 0x7ffffffu) >= 0x4000000u;
}

/// Posts up to 32 held completions that are due (MODEL), in due order, each in its queue's next
/// CQ slot with the queue's SQ head as of now; the first ones of a queue are dropped instead
/// while its drop counters say so. Returns how many were taken (uniform).
__device__ inline uint32_t pending_post(pending_list& pl, lane_queue& q, const warp_tables& t,
                                        uint32_t lane, ctrl_counters& k) {
    const uint32_t full = 0xffffffffu;
    if (pl.count == 0) return 0;
    const unsigned long long now = __shfl_sync(full, (unsigned long long)now_ns(), 0);
    if (now < pl.next_due) return 0;
    // Overdue entries per lane (strided), and the earliest due time of the others.
    uint32_t mine = 0;
    unsigned long long rest = ~0ull;
    for (uint32_t i = lane; i < pl.count; i += 32) {
        const unsigned long long d = pl.e[i].due;
        if (d <= now) ++mine;
        else if (d < rest) rest = d;
    }
    uint32_t incl = mine;
    for (int o = 1; o < 32; o <<= 1) {
        const uint32_t v = __shfl_up_sync(full, incl, o);
        if (lane >= (uint32_t)o) incl += v;
    }
    const uint32_t total = __shfl_sync(full, incl, 31);
    if (total == 0) {
        pl.next_due = warp_min64(rest);
        return 0;
    }
    // The first 32 overdue entries (lane order) go to the selection slots.
    uint32_t r = incl - mine;
    if (mine && r < 32) {
        for (uint32_t i = lane; i < pl.count && r < 32; i += 32)
            if (pl.e[i].due <= now) pl.sel[r++] = i;
    }
    __syncwarp();
    const uint32_t nsel = total < 32 ? total : 32;
    const bool act = lane < nsel;
    unsigned long long due = ~0ull;
    uint32_t dw3 = 0, meta = 0, idx = 0xffffffffu;
    if (act) {
        idx = pl.sel[lane];
        const ctrl_pending p = pl.e[idx];
        due = p.due;
        dw3 = p.dw3;
        meta = p.meta;
    }
    __syncwarp();
    if (act) pl.e[idx].due = 0;  // taken: removed by the compaction below
    // Bitonic sort of the 32 lanes by (due, sequence); idle lanes (due ~0) sort last.
    for (uint32_t kk = 2; kk <= 32; kk <<= 1) {
        for (uint32_t j = kk >> 1; j > 0; j >>= 1) {
            const unsigned long long od = __shfl_xor_sync(full, due, j);
            const uint32_t o3 = __shfl_xor_sync(full, dw3, j);
            const uint32_t om = __shfl_xor_sync(full, meta, j);
            const bool ascending = (lane & kk) == 0;
            const bool lower = (lane & j) == 0;
            const bool take = lower == ascending ? posted_before(od, om, due, meta)
                                                 : posted_before(due, meta, od, om);
            if (take) {
                due = od;
                dw3 = o3;
                meta = om;
            }
        }
    }
    // Lanes 0..nsel-1 now hold the batch in posting order. Group them by queue (owning lane).
    const uint32_t owner = act ? (meta & 31u) : 32u + lane;
    const uint32_t grp = __match_any_sync(full, owner);
    const uint32_t lt = (1u << lane) - 1u;
    const uint32_t rank = __popc(grp & lt), cnt = __popc(grp);
    const uint32_t leader = __ffs(grp) - 1;
    const uint32_t src = act ? owner : lane;
    const uint64_t cq = __shfl_sync(full, (uint64_t)q.cq, src);
    const uint32_t cqe_n = __shfl_sync(full, q.cq_entries, src);
    const uint32_t tail = __shfl_sync(full, q.cq_tail, src);
    const uint32_t phase = __shfl_sync(full, q.cq_phase, src);
    const uint32_t sqhd = __shfl_sync(full, q.sq_head, src);
    const uint32_t qid = __shfl_sync(full, q.qid, src);
    const uint32_t live = __shfl_sync(full, q.sq != nullptr ? 1u : 0u, src);
    // Dropped completions: the first `take` of each queue's group.
    uint32_t take = 0;
    if (t.faults & GPUNVME_FAULT_DROPS) {
        if (act && rank == 0 && live) {
            unsigned long long* w = reinterpret_cast<unsigned long long*>(t.drops);
            take = take_drops(w + qid, cnt);
            if (take < cnt) take += take_drops(w, cnt - take);
        }
        take = __shfl_sync(full, take, leader);
    }
    const bool post = act && live && rank >= take;
    uint32_t* cqe = nullptr;
    uint32_t w3 = 0;
    if (post) {
        // Reserved at fetch: tail + cnt - take never passes the CQ head.
        const uint32_t pos = tail + rank - take;
        const uint32_t wrapped = pos >= cqe_n;
        const uint32_t slot = wrapped ? pos - cqe_n : pos;
        const uint32_t ph = wrapped ? phase ^ 1u : phase;
        cqe = reinterpret_cast<uint32_t*>(cq + (size_t)slot * 16);
        *reinterpret_cast<uint2*>(cqe) = make_uint2(0u, 0u);
        cqe[2] = sqhd | (qid << 16);
        w3 = dw3 | (ph << 16);
        if (dw3 >> 17) k.errors++;
    }
    fence_gpu();
    __syncwarp();
    fence_gpu();  // release: data (stored when fetched) and entries before any phase dword
    if (post) st_sys(cqe + 3, w3);
    // Each queue's owner lane: its CQ tail past what was posted, its reservations released.
    uint32_t leaders = __ballot_sync(full, act && rank == 0);
    while (leaders) {
        const uint32_t l = __ffs(leaders) - 1;
        leaders &= leaders - 1;
        const uint32_t o = __shfl_sync(full, owner, l);
        const uint32_t c = __shfl_sync(full, cnt, l);
        const uint32_t tk = __shfl_sync(full, take, l);
        if (lane == o) {
            if (q.sq) {
                const uint32_t pos = q.cq_tail + (c - tk);
                if (pos >= q.cq_entries) {
                    q.cq_tail = pos - q.cq_entries;
                    q.cq_phase ^= 1u;
                } else {
                    q.cq_tail = pos;
                }
            }
            q.cq_pending = q.cq_pending > c ? q.cq_pending - c : 0;
        }
    }
    k.dropped += __reduce_add_sync(full, (act && rank == 0) ? take : 0u);
    k.commands += nsel;
    // Remove the taken entries; the next post is due at once if overdue ones were left.
    const uint32_t from = __reduce_min_sync(full, idx);
    pending_compact(pl, from, lane);
    pl.next_due = total > nsel ? now : warp_min64(rest);
    return nsel;
}

/// Holds the completions of this chunk of a queue's commands (lanes with `mine`), fetched for
/// queue lane `src`, until due (MODEL). The caller leaves room: count + chunk <= cap.
__device__ inline void pending_hold(pending_list& pl, const warp_tables& t, const decoded& d,
                                    bool mine, uint32_t src, uint32_t lane) {
    const uint32_t full = 0xffffffffu;
    unsigned long long due = ~0ull;
    if (mine) {
        due = now_ns();
        const bool timed = (d.opcode == OPC_READ || d.opcode == OPC_WRITE) &&
                           (d.status == 0 || (d.status >> 8) == SCT_MEDIA) &&
                           t.models[d.ns].drives != 0;
        if (timed)
            due = model_due(t.models[d.ns], d.opcode == OPC_WRITE,
                            d.slba << t.ns[d.ns].lba_shift, d.len);
        due += t.delay_ns;
    }
    const uint32_t m = __ballot_sync(full, mine);
    if (mine) {
        const uint32_t before = __popc(m & ((1u << lane) - 1u));
        ctrl_pending p;
        p.due = due;
        p.dw3 = d.cid | (status_field(d.status) << 16);
        p.meta = src | ((pl.seq + before) << 5);
        pl.e[pl.count + before] = p;
    }
    __syncwarp();
    pl.count += __popc(m);
    pl.seq += __popc(m);
    const unsigned long long first = warp_min64(due);
    if (first < pl.next_due) pl.next_due = first;
}

}  // namespace ctrl
}  // namespace gpunvme
