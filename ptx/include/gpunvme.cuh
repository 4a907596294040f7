// gpunvme.cuh — the device side of gpunvme: GPU threads build NVMe commands, ring doorbells and
// poll completions on I/O queues whose rings live in GPU memory.
//
// Header-only, one namespace (gpunvme::), no host state, nothing here traps, prints or waits
// without a bound: every call returns a gpunvme::status. Include it in your own kernels and hand
// them the `queue_desc` array that the Rust crate `gpu_queues` builds (gpu_queues::GpuQueues,
// its descriptors(): the device address of the array; from C, gpunvme_gpu_queues in
// include/gpunvme.h).
//
// Layout contract: every struct below is mirrored by a #[repr(C)] struct in
// gpu-queues/src/desc.rs, and every NVMe wire offset by nvme_spec::wire. The GPUNVME_* numbers
// are checked on this side by static_assert and on the Rust side by the tests in
// gpu-queues/src/desc.rs that parse this file (header_matches_rust_layouts,
// header_matches_nvme_spec_wire_offsets), so a change on either side fails the build. The
// protocol below is exercised on a GPU by tests/gpu/ (scripts/gpu-test.sh) and on CPU threads
// by a subset of those tests under the host-gpu harness (scripts/host-gpu-test.sh).
//
// THE QUEUE PROTOCOL (one SQ and one CQ of `depth` entries, depth a power of two):
//  * Slot reservation. A command takes a ticket t = atomicAdd(&state->ticket, 1) (one atomic per
//    warp in the _warp variants). Its SQ slot, and its command id, is s = t & (depth - 1). The
//    slot is free for ticket t once slot[s].released == t (the previous owner, ticket t - depth,
//    has seen its completion and released the slot by storing t).
//  * Submission. The owner writes the 64-byte SQE into sq[s], then publishes it with a release
//    store slot[s].ticket = t (gpu scope).
//  * Doorbell coalescing. Whoever holds state->sq_lock (try-lock, never waited for) moves
//    state->sq_published over every consecutive ticket whose SQE is in place, but never more than
//    depth - 1 past state->cq_reaped (so neither ring can overflow: at most depth - 1 commands are
//    between "published" and "completion consumed"), then issues ONE system-scope release fence
//    and ONE doorbell write with the new tail. A thread whose ticket is not yet published keeps
//    retrying that step while it waits, so no SQE is ever left behind by a lock holder that
//    looked too early.
//  * Completion. Whoever holds state->cq_lock drains the CQ in ring order: it reads the dword
//    holding the phase tag (dword 3: CID and status) first, checks the phase, issues an acquire
//    fence, and only then reads the rest of the entry (torn-CQE safe); the phase dwords of up to
//    GPUNVME_REAP_AHEAD entries are loaded together first (one PCIe round trip for a CQ in host
//    memory), the fence follows the last of them. It copies the status into
//    slot[cid].done (release) and, for a command whose completion dword 0 means something
//    (wants_dw0: not Flush, Write, Read or Write Zeroes, so one read of the entry fewer for
//    those), dw0 into slot[cid].dw0, advances the head, and rings the CQ head doorbell once per
//    drain. Completions may arrive in any order; each waiter watches only
//    its own slot. A CQE whose CID names a slot that is not in flight fails the queue
//    (GPUNVME_BAD_COMPLETION): the device is not following the protocol.
//  * Release. The waiter reads its status, clears slot[s].done and stores
//    slot[s].released = t + depth: the next owner of the slot may go.
//  * Bounds. Every wait has a deadline (desc.timeout_ns, measured with %globaltimer) and watches
//    the host's abort word (desc.host_flags, pinned host memory) every GPUNVME_ABORT_POLL spins;
//    a timeout or an abort marks the queue failed, and every later call on it returns at once.
//
// FENCE DISCIPLINE (PTX ISA 9.0, "Memory Consistency Model"):
//  submit:   SQE stores -> st.release.gpu slot.ticket -> (lock holder) ld.relaxed.gpu of the
//            tickets -> fence.acq_rel.sys (the acquire of those SQEs and their release to the
//            controller in one fence) -> st.mmio.relaxed.sys doorbell
//            (the SQ is read by the controller over PCIe or by copy engines: system scope).
//            The warp variant: each lane ld.acquire.gpu of one ticket -> __syncwarp -> lane 0
//            fence.acq_rel.sys -> doorbell.
//  complete: ld.relaxed.sys CQE dword 3 (phase) -> fence.acq_rel.sys -> ld.acquire.sys CQE
//            dword 0 (wanted commands only) and the command's data; then st.release.gpu
//            slot.done -> waiter ld.acquire.gpu slot.done. A drain that looks at one entry only
//            (one completion owed) across PCIe loads its dword 3 with ld.acquire.sys instead of
//            the relaxed load and the fence. The CQ head doorbell follows with no fence of its
//            own: every read of the entries it hands back is an acquire or precedes one, so none
//            can be performed after it (the warp variant: each lane's reads, __syncwarp, lane 0's
//            doorbell).
//  Both fences are fence.acq_rel.gpu instead when queue_desc.flags has GPUNVME_QF_LOCAL_PEER
//  (the GPU-resident controller model: its rings, doorbells and data stay in this GPU's memory).
//  The host's abort word is read over PCIe at most every GPUNVME_HOST_POLL_NS per queue.
//  The doorbell is only ever written, never read (GPU reads of NVMe BARs fail on some systems).
#pragma once

#ifdef GPUNVME_HOST_BUILD
// Compiled for the host by g++ (ptx/host/: the CPU harness of gpu_queues' host-gpu feature).
#include "../host/gpunvme_host.h"
#else
#include <cuda/atomic>
/// A device function kept out of line (g++'s spelling in the host build).
#define GPUNVME_NOINLINE __noinline__
#endif
#include <stdint.h>

// ---------------------------------------------------------------------------------------------
// NVMe wire offsets (NVMe Base 2.0, "Submission Queue Entry", "Completion Queue Entry"); the
// same numbers as nvme_spec::wire.
#define GPUNVME_SQE_SIZE 64
#define GPUNVME_SQE_OPC 0
#define GPUNVME_SQE_FLAGS 1
#define GPUNVME_SQE_CID 2
#define GPUNVME_SQE_NSID 4
#define GPUNVME_SQE_MPTR 16
#define GPUNVME_SQE_PRP1 24
#define GPUNVME_SQE_PRP2 32
#define GPUNVME_SQE_CDW10 40
#define GPUNVME_SQE_CDW11 44
#define GPUNVME_SQE_CDW12 48
#define GPUNVME_SQE_CDW13 52
#define GPUNVME_SQE_CDW14 56
#define GPUNVME_SQE_CDW15 60
#define GPUNVME_CQE_SIZE 16
#define GPUNVME_CQE_DW0 0
#define GPUNVME_CQE_DW1 4
#define GPUNVME_CQE_SQHD 8
#define GPUNVME_CQE_SQID 10
#define GPUNVME_CQE_CID 12
#define GPUNVME_CQE_STATUS 14
#define GPUNVME_PAGE_SIZE 4096

// Layout of the structs shared with Rust (gpu-queues/src/desc.rs).
#define GPUNVME_QUEUE_DESC_SIZE 128
#define GPUNVME_QD_SQ 0
#define GPUNVME_QD_CQ 8
#define GPUNVME_QD_SQ_DOORBELL 16
#define GPUNVME_QD_CQ_DOORBELL 24
#define GPUNVME_QD_STATE 32
#define GPUNVME_QD_SLOTS 40
#define GPUNVME_QD_PRP_LISTS 48
#define GPUNVME_QD_PRP_LISTS_BUS 56
#define GPUNVME_QD_SLOT_BUFFERS 64
#define GPUNVME_QD_SLOT_BUFFERS_BUS 72
#define GPUNVME_QD_HOST_FLAGS 80
#define GPUNVME_QD_TIMEOUT_NS 88
#define GPUNVME_QD_DEPTH 96
#define GPUNVME_QD_QID 100
#define GPUNVME_QD_FLAGS 102
#define GPUNVME_QD_SLOT_BUFFER_BYTES 104
#define GPUNVME_QD_MAX_TRANSFER 108
#define GPUNVME_QD_PI_NSID 112
#define GPUNVME_QD_PI_PRINFO 116
#define GPUNVME_QUEUE_STATE_SIZE 128
#define GPUNVME_QS_TICKET 0
#define GPUNVME_QS_SQ_PUBLISHED 32
#define GPUNVME_QS_SQ_LOCK 36
#define GPUNVME_QS_CQ_LOCK 64
#define GPUNVME_QS_CQ_HEAD 68
#define GPUNVME_QS_CQ_PHASE 72
#define GPUNVME_QS_CQ_REAPED 76
#define GPUNVME_QS_FAILED 96
#define GPUNVME_QS_HOST_CHECKED_NS 104
#define GPUNVME_SLOT_STATE_SIZE 16
#define GPUNVME_SS_RELEASED 0
#define GPUNVME_SS_TICKET 4
#define GPUNVME_SS_DONE 8
#define GPUNVME_SS_DW0 12
#define GPUNVME_IO_REQ_SIZE 32

// Status codes every call returns (gpu_queues::DeviceStatus on the Rust side).
//
// Buffers after TIMEOUT, ABORTED or QUEUE_FAILED: the command may still be in flight on the
// controller, which can still DMA into (or out of) its data buffer and PRP list, however late.
// The call returns, but the buffer is not the caller's again until the queue is deleted
// (GpuQueues dropped; the controller then stops all of the queue's commands) or the
// controller is reset. The queue is failed from then on (every later call: QUEUE_FAILED), so
// its command id is never matched to a newer command. Do not free or reuse such a buffer for
// other data before that; the slot buffers are the queue's own and follow its lifetime.
#define GPUNVME_OK 0
#define GPUNVME_TIMEOUT 1
#define GPUNVME_NVME_ERROR 2
#define GPUNVME_QUEUE_FAILED 3
#define GPUNVME_ABORTED 4
#define GPUNVME_INVALID_ARGUMENT 5
#define GPUNVME_BAD_COMPLETION 6
#define GPUNVME_OUT_OF_EXTENT 7

// Host flags word (desc.host_flags): bit 0 = abort (controller fatal, device gone, shutdown).
#define GPUNVME_HOST_ABORT 1u
// Spins between two looks at the clock (deadline, and whether the abort word is due).
#define GPUNVME_ABORT_POLL 256
// The host's abort word is read over PCIe at most this often per queue (by whichever waiter
// finds it due): thousands of waiters reading host memory on their own collapse PCIe reads
// (and every system-scope fence with them), see ../shared/design/gpu.md.
#define GPUNVME_HOST_POLL_NS 500000
// CQ entries a thread reaper reads ahead at once (their phase dwords loaded together; see
// try_reap): at most 8 registers, one PCIe round trip for a CQ in host memory.
#define GPUNVME_REAP_AHEAD 8
// SQE tickets the publish step (try_publish) loads together.
#define GPUNVME_PUBLISH_AHEAD 4

// queue_desc.flags: bit 0 = the controller runs on this GPU (the GPU-resident controller
// model): SQEs, CQEs and doorbells never leave GPU memory, so the protocol's fences are at GPU
// scope instead of system scope.
#define GPUNVME_QF_LOCAL_PEER 1u

// slot.done: bit 31 set when a completion is stored; bits 15:0 the CQE status field with the
// phase tag cleared (bit 0 = 0; SC in 8:1, SCT in 11:9, CRD 13:12, M 14, DNR 15).
#define GPUNVME_DONE_BIT 0x80000000u

namespace gpunvme {

typedef int32_t status;

// NVMe I/O opcodes (NVM Command Set 1.0).
enum : uint8_t { OPC_FLUSH = 0x00, OPC_WRITE = 0x01, OPC_READ = 0x02, OPC_WRITE_ZEROES = 0x08 };

/// One I/O queue pair as kernels see it. Built by the host; read-only on the GPU.
struct queue_desc {
    uint64_t sq;               // GPU pointer: SQ ring, depth * 64 B
    uint64_t cq;               // GPU pointer: CQ ring, depth * 16 B
    uint64_t sq_doorbell;      // GPU pointer: SQ tail doorbell (BAR0 page or pinned host page)
    uint64_t cq_doorbell;      // GPU pointer: CQ head doorbell
    uint64_t state;            // GPU pointer: queue_state
    uint64_t slots;            // GPU pointer: slot_state[depth]
    uint64_t prp_lists;        // GPU pointer: two 4 KiB PRP-list pages per slot (see below)
    uint64_t prp_lists_bus;    // device (bus) address of the first PRP-list page; pages contiguous
    uint64_t slot_buffers;     // GPU pointer: one data buffer per slot (0: none)
    uint64_t slot_buffers_bus; // device address of the first slot buffer; contiguous
    uint64_t host_flags;       // GPU pointer: the host's abort word (pinned, mapped)
    uint64_t timeout_ns;       // bound of every wait
    uint32_t depth;            // entries of the SQ and of the CQ; a power of two
    uint16_t qid;              // NVMe queue id
    uint16_t flags;            // GPUNVME_QF_*
    uint32_t slot_buffer_bytes; // bytes of each slot buffer; its PRP list is pre-built
    uint32_t max_transfer;      // most bytes one command may move (MDTS, capped at 2 MiB)
    uint32_t pi_nsid;           // namespace formatted with 8-byte protection information (0:
                                // none): its Reads and Writes carry pi_prinfo
    uint8_t pi_prinfo;          // PRINFO for pi_nsid (PRACT | PRCHK); with bit 0 (reference tag
                                // check) CDW14 holds the starting LBA's low 32 bits
    uint8_t pad1[3];
    uint64_t reserved1;
};

/// Per-queue protocol state, in GPU memory, zeroed by the host at creation. The words that
/// different roles hammer sit on different 32-byte sectors.
struct queue_state {
    uint32_t ticket;        // next ticket
    uint32_t pad0[7];
    uint32_t sq_published;  // tickets below this are in the SQ and the doorbell says so
    uint32_t sq_lock;       // 1 while one thread moves the tail
    uint32_t pad1[6];
    uint32_t cq_lock;       // 1 while one thread drains the CQ
    uint32_t cq_head;       // next CQ entry to look at
    uint32_t cq_phase;      // phase tag expected there (starts at 1)
    uint32_t cq_reaped;     // completions consumed so far (wraps)
    uint32_t pad2[4];
    uint32_t failed;        // 0, or the status that failed the queue
    uint32_t pad3;
    uint64_t host_checked_ns; // %globaltimer when a waiter last read the host's abort word
    uint32_t pad4[4];
};

/// Per-slot (= per command id) state, in GPU memory.
struct slot_state {
    uint32_t released; // ticket that may take the slot next (host initialises it to the slot index)
    uint32_t ticket;   // ticket whose SQE is in the slot, written after the SQE (host initialises
                       // it to slot index - depth, "the previous round", wrapping)
    uint32_t done;     // GPUNVME_DONE_BIT | status field once completed; 0 otherwise
    uint32_t dw0;      // completion dword 0; until the completion, whether the command wants
                       // it (wants_dw0: 1 or 0, written with the SQE)
};

/// A read or write of one command as kernels ask for it (the perf kernel and the suite use it).
struct io_req {
    uint64_t slba;   // first LBA
    uint64_t prp1;   // data pointer (device addresses)
    uint64_t prp2;
    uint32_t nsid;
    uint16_t nlb_z;  // blocks - 1
    uint8_t opcode;
    uint8_t reserved;
};

static_assert(sizeof(queue_desc) == GPUNVME_QUEUE_DESC_SIZE, "queue_desc size");
static_assert(offsetof(queue_desc, sq) == GPUNVME_QD_SQ, "queue_desc.sq");
static_assert(offsetof(queue_desc, cq) == GPUNVME_QD_CQ, "queue_desc.cq");
static_assert(offsetof(queue_desc, sq_doorbell) == GPUNVME_QD_SQ_DOORBELL, "sq_doorbell");
static_assert(offsetof(queue_desc, cq_doorbell) == GPUNVME_QD_CQ_DOORBELL, "cq_doorbell");
static_assert(offsetof(queue_desc, state) == GPUNVME_QD_STATE, "state");
static_assert(offsetof(queue_desc, slots) == GPUNVME_QD_SLOTS, "slots");
static_assert(offsetof(queue_desc, prp_lists) == GPUNVME_QD_PRP_LISTS, "prp_lists");
static_assert(offsetof(queue_desc, prp_lists_bus) == GPUNVME_QD_PRP_LISTS_BUS, "prp_lists_bus");
static_assert(offsetof(queue_desc, slot_buffers) == GPUNVME_QD_SLOT_BUFFERS, "slot_buffers");
static_assert(offsetof(queue_desc, slot_buffers_bus) == GPUNVME_QD_SLOT_BUFFERS_BUS, "bus");
static_assert(offsetof(queue_desc, host_flags) == GPUNVME_QD_HOST_FLAGS, "host_flags");
static_assert(offsetof(queue_desc, timeout_ns) == GPUNVME_QD_TIMEOUT_NS, "timeout_ns");
static_assert(offsetof(queue_desc, depth) == GPUNVME_QD_DEPTH, "depth");
static_assert(offsetof(queue_desc, qid) == GPUNVME_QD_QID, "qid");
static_assert(offsetof(queue_desc, flags) == GPUNVME_QD_FLAGS, "flags");
static_assert(offsetof(queue_desc, slot_buffer_bytes) == GPUNVME_QD_SLOT_BUFFER_BYTES, "sbb");
static_assert(offsetof(queue_desc, max_transfer) == GPUNVME_QD_MAX_TRANSFER, "max_transfer");
static_assert(offsetof(queue_desc, pi_nsid) == GPUNVME_QD_PI_NSID, "pi_nsid");
static_assert(offsetof(queue_desc, pi_prinfo) == GPUNVME_QD_PI_PRINFO, "pi_prinfo");
static_assert(sizeof(queue_state) == GPUNVME_QUEUE_STATE_SIZE, "queue_state size");
static_assert(offsetof(queue_state, ticket) == GPUNVME_QS_TICKET, "ticket");
static_assert(offsetof(queue_state, sq_published) == GPUNVME_QS_SQ_PUBLISHED, "sq_published");
static_assert(offsetof(queue_state, sq_lock) == GPUNVME_QS_SQ_LOCK, "sq_lock");
static_assert(offsetof(queue_state, cq_lock) == GPUNVME_QS_CQ_LOCK, "cq_lock");
static_assert(offsetof(queue_state, cq_head) == GPUNVME_QS_CQ_HEAD, "cq_head");
static_assert(offsetof(queue_state, cq_phase) == GPUNVME_QS_CQ_PHASE, "cq_phase");
static_assert(offsetof(queue_state, cq_reaped) == GPUNVME_QS_CQ_REAPED, "cq_reaped");
static_assert(offsetof(queue_state, failed) == GPUNVME_QS_FAILED, "failed");
static_assert(offsetof(queue_state, host_checked_ns) == GPUNVME_QS_HOST_CHECKED_NS, "host_chk");
static_assert(sizeof(slot_state) == GPUNVME_SLOT_STATE_SIZE, "slot_state size");
static_assert(offsetof(slot_state, released) == GPUNVME_SS_RELEASED, "released");
static_assert(offsetof(slot_state, ticket) == GPUNVME_SS_TICKET, "ticket");
static_assert(offsetof(slot_state, done) == GPUNVME_SS_DONE, "done");
static_assert(offsetof(slot_state, dw0) == GPUNVME_SS_DW0, "dw0");
static_assert(sizeof(io_req) == GPUNVME_IO_REQ_SIZE, "io_req size");

// ---------------------------------------------------------------------------------------------
// Primitives.

using dev_u32 = cuda::atomic_ref<uint32_t, cuda::thread_scope_device>;
using dev_u64 = cuda::atomic_ref<uint64_t, cuda::thread_scope_device>;
using sys_u32 = cuda::atomic_ref<uint32_t, cuda::thread_scope_system>;

/// Dword `off` of the CQ entry at `cqe`, which the controller writes: a system-scope load with
/// `order`.
__device__ __forceinline__ uint32_t cqe_dword(const uint8_t* cqe, uint32_t off,
                                              cuda::memory_order order) {
    return sys_u32(*const_cast<uint32_t*>(reinterpret_cast<const uint32_t*>(cqe + off)))
        .load(order);
}

/// Nanoseconds from the GPU's global timer.
__device__ __forceinline__ uint64_t now_ns() {
#ifdef GPUNVME_HOST_BUILD
    return gpunvme_host::global_timer_ns();
#else
    uint64_t t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
#endif
}

/// The doorbell write: an MMIO store at system scope, never merged or reordered with other
/// MMIO stores (PTX ISA 8.2+, "st.mmio"; sm_70+). Callers issue the release fence first.
__device__ __forceinline__ void doorbell_write(uint64_t addr, uint32_t value) {
#ifdef GPUNVME_HOST_BUILD
    __atomic_store_n(reinterpret_cast<uint32_t*>(addr), value, __ATOMIC_RELAXED);
#else
    asm volatile("st.mmio.relaxed.sys.global.u32 [%0], %1;" ::"l"(addr), "r"(value) : "memory");
#endif
}

/// Atomics at device scope whose old value nobody needs: PTX `red`, a reduction the issuing
/// warp does not wait for. libcu++'s atomic_ref emits `atom` with a destination register even
/// when the result is unused, and ptxas keeps it as an ATOM: an L2 round trip on the caller's
/// path (visible in the SASS). Same ordering as the atomic_ref forms.
// GPUNVME_RED(name, T, builtin, order, instruction, constraint) defines `void name(T* p, T v)`:
// the PTX instruction on the GPU, the GCC builtin with that memory order on CPU threads.
#ifdef GPUNVME_HOST_BUILD
#define GPUNVME_RED(name, T, builtin, order, insn, cons) \
    __device__ __forceinline__ void name(T* p, T v) { builtin(p, v, order); }
#else
#define GPUNVME_RED(name, T, builtin, order, insn, cons)                     \
    __device__ __forceinline__ void name(T* p, T v) {                          \
        asm volatile(insn " [%0], %1;" ::"l"(p), cons(v) : "memory");          \
    }
#endif
GPUNVME_RED(red_add_release, uint32_t, __atomic_fetch_add, __ATOMIC_RELEASE,
            "red.release.gpu.global.add.u32", "r")
GPUNVME_RED(red_or_release, uint32_t, __atomic_fetch_or, __ATOMIC_RELEASE,
            "red.release.gpu.global.or.b32", "r")
GPUNVME_RED(red_add_release, uint64_t, __atomic_fetch_add, __ATOMIC_RELEASE,
            "red.release.gpu.global.add.u64", "l")
GPUNVME_RED(red_or_release, uint64_t, __atomic_fetch_or, __ATOMIC_RELEASE,
            "red.release.gpu.global.or.b64", "l")
GPUNVME_RED(red_or_relaxed, uint32_t, __atomic_fetch_or, __ATOMIC_RELAXED,
            "red.relaxed.gpu.global.or.b32", "r")
#undef GPUNVME_RED

__device__ __forceinline__ queue_state* state_of(const queue_desc& q) {
    return reinterpret_cast<queue_state*>(q.state);
}
__device__ __forceinline__ slot_state* slot_of(const queue_desc& q, uint32_t s) {
    return reinterpret_cast<slot_state*>(q.slots) + s;
}

/// Whether the host has raised the abort word. Read over PCIe at most once per
/// GPUNVME_HOST_POLL_NS per queue: the waiter that finds the queue's last look stale claims
/// the next one (a relaxed store; two waiters racing both read, which is harmless).
__device__ __forceinline__ bool host_aborted(const queue_desc& q, uint64_t now) {
    uint64_t* checked = &state_of(q)->host_checked_ns;
    cuda::atomic_ref<uint64_t, cuda::thread_scope_device> c(*checked);
    if (now - c.load(cuda::memory_order_relaxed) < GPUNVME_HOST_POLL_NS) return false;
    c.store(now, cuda::memory_order_relaxed);
    uint32_t flags =
        sys_u32(*reinterpret_cast<uint32_t*>(q.host_flags)).load(cuda::memory_order_relaxed);
    return flags & GPUNVME_HOST_ABORT;
}

/// A bounded wait: the deadline, the host's abort word, and a short sleep between polls that
/// doubles from 32 ns to 512 ns and stays there (no reset on progress: a waiter's own completion
/// ends the wait, and a shorter sleep after someone else's would only add polls).
struct waiter {
    uint64_t deadline;
    uint32_t spins;
    uint32_t sleep_ns;
    __device__ __forceinline__ explicit waiter(const queue_desc& q)
        : deadline(now_ns() + q.timeout_ns), spins(0), sleep_ns(32) {}
    /// GPUNVME_OK to keep waiting, else why to stop.
    __device__ __forceinline__ status tick(const queue_desc& q) {
        if (++spins % GPUNVME_ABORT_POLL == 0) {
            const uint64_t now = now_ns();
            if (host_aborted(q, now)) return GPUNVME_ABORTED;
            if (now > deadline) return GPUNVME_TIMEOUT;
        }
        __nanosleep(sleep_ns);
        if (sleep_ns < 512) sleep_ns <<= 1;
        return GPUNVME_OK;
    }
};

/// The fences between this GPU and the queue's controller: system scope for a controller across
/// PCIe (an SSD, or the host-side software controller), GPU scope for the GPU-resident
/// controller model, whose rings and doorbells never leave this GPU's memory (a system-scope
/// fence costs microseconds when host memory traffic is in flight).
__device__ __forceinline__ void release_to_controller(const queue_desc& q) {
    if (q.flags & GPUNVME_QF_LOCAL_PEER)
        cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_device);
    else
        cuda::atomic_thread_fence(cuda::memory_order_release, cuda::thread_scope_system);
}
__device__ __forceinline__ void acquire_from_controller(const queue_desc& q) {
    if (q.flags & GPUNVME_QF_LOCAL_PEER)
        cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_device);
    else
        cuda::atomic_thread_fence(cuda::memory_order_acquire, cuda::thread_scope_system);
}
/// Both at once (fence.acq_rel, which is also what the release fence above compiles to): the
/// publish step's relaxed loads of SQE tickets become acquires of their SQEs, and those SQEs are
/// released to the controller before the doorbell that follows.
__device__ __forceinline__ void acq_rel_to_controller(const queue_desc& q) {
    if (q.flags & GPUNVME_QF_LOCAL_PEER)
        cuda::atomic_thread_fence(cuda::memory_order_acq_rel, cuda::thread_scope_device);
    else
        cuda::atomic_thread_fence(cuda::memory_order_acq_rel, cuda::thread_scope_system);
}

/// Marks the queue failed with `why` (the first reason sticks) and returns it.
__device__ __forceinline__ status fail_queue(const queue_desc& q, status why) {
    uint32_t expected = 0;
    dev_u32(state_of(q)->failed).compare_exchange_strong(expected, (uint32_t)why,
                                                          cuda::memory_order_relaxed);
    return why;
}

__device__ __forceinline__ status queue_failed(const queue_desc& q) {
    uint32_t f = dev_u32(state_of(q)->failed).load(cuda::memory_order_relaxed);
    return f ? GPUNVME_QUEUE_FAILED : GPUNVME_OK;
}

/// Tries to take a lock word without waiting. A plain load first: hundreds of waiters of one
/// queue retrying a compare-and-swap on a held lock would serialise on its L2 line and slow the
/// holder (test and test-and-set).
__device__ __forceinline__ bool try_lock(uint32_t& word) {
    if (dev_u32(word).load(cuda::memory_order_relaxed) != 0) return false;
    uint32_t expected = 0;
    return dev_u32(word).compare_exchange_strong(expected, 1u, cuda::memory_order_acquire,
                                                 cuda::memory_order_relaxed);
}
__device__ __forceinline__ void unlock(uint32_t& word) {
    dev_u32(word).store(0u, cuda::memory_order_release);
}

// ---------------------------------------------------------------------------------------------
// Doorbell coalescing and completion draining. Both are try-lock steps that any waiting thread
// runs; neither ever waits for the other.

/// Publishes every consecutive ready SQE (up to depth - 1 past the completions consumed) and
/// rings the SQ tail doorbell once. Returns whether this thread held the lock.
__device__ inline bool try_publish(const queue_desc& q) {
    queue_state* st = state_of(q);
    // No ticket taken past the published ones: nothing to publish, and no lock to take (the
    // waiters of an idle queue poll here on every spin). A caller whose own ticket is not yet
    // published reads a count past it (its own atomic came first), so it never skips.
    if (dev_u32(st->ticket).load(cuda::memory_order_relaxed) ==
        dev_u32(st->sq_published).load(cuda::memory_order_relaxed))
        return false;
    if (!try_lock(st->sq_lock)) return false;
    const uint32_t mask = q.depth - 1;
    // Relaxed loads, issued together: the fence below is what orders them (see the publish
    // step in FENCE DISCIPLINE).
    const uint32_t failed = dev_u32(st->failed).load(cuda::memory_order_relaxed);
    uint32_t p = dev_u32(st->sq_published).load(cuda::memory_order_relaxed);
    const uint32_t limit = dev_u32(st->cq_reaped).load(cuda::memory_order_relaxed) + mask;
    if (failed) {
        // No doorbell on a failed queue: its waiters are returning, the host may tear it down.
        unlock(st->sq_lock);
        return true;
    }
    const uint32_t start = p;
    // The tickets of the next GPUNVME_PUBLISH_AHEAD slots are loaded together (independent
    // loads: one L2 round trip, not one per ticket), and the run of those in place counted.
    for (bool more = true; more && p != limit;) {
        uint32_t tk[GPUNVME_PUBLISH_AHEAD];
#pragma unroll
        for (uint32_t i = 0; i < GPUNVME_PUBLISH_AHEAD; ++i)
            tk[i] = dev_u32(slot_of(q, (p + i) & mask)->ticket).load(cuda::memory_order_relaxed);
        uint32_t k = 0;
        while (k < GPUNVME_PUBLISH_AHEAD && p + k != limit && tk[k] == p + k) ++k;
        more = k == GPUNVME_PUBLISH_AHEAD;
        p += k;
    }
    if (p != start) {
        // Acquire and release in one fence: the SQE stores of every ticket just seen (each
        // released by its owner's st.release of the ticket, read above by a relaxed load)
        // happen before the fence, and the fence before the doorbell that says they are there.
        acq_rel_to_controller(q);
        doorbell_write(q.sq_doorbell, p & mask);
        dev_u32(st->sq_published).store(p, cuda::memory_order_relaxed);
    }
    unlock(st->sq_lock);
    return true;
}

/// Drains the CQ into the slots (see "Completion" above) and rings the CQ head doorbell once.
/// Returns GPUNVME_OK, or GPUNVME_BAD_COMPLETION after failing the queue.
__device__ inline status try_reap(const queue_desc& q) {
    queue_state* st = state_of(q);
    if (!try_lock(st->cq_lock)) return GPUNVME_OK;
    const uint32_t mask = q.depth - 1;
    uint32_t head = st->cq_head;
    uint32_t phase = st->cq_phase;
    uint32_t n = 0;
    status result = GPUNVME_OK;
    const uint8_t* cq = reinterpret_cast<const uint8_t*>(q.cq);
    // Completions owed: commands whose doorbell was rung and whose completion is not yet
    // consumed. No entry past those is read, so an idle queue costs no read over PCIe and the
    // entry after the last one owed is not looked at (a controller that posts more than it
    // owes is caught when the head reaches the extra entry with a command in flight).
    const uint32_t owed = dev_u32(st->sq_published).load(cuda::memory_order_relaxed) -
                          dev_u32(st->cq_reaped).load(cuda::memory_order_relaxed);
    bool more = true;
    while (more && n < q.depth && n < owed) {
        // The phase dword first (the device may still be writing the rest of the entry): the
        // head entry's alone while nothing is there (one read per poll), then, once it is, those
        // of the next GPUNVME_REAP_AHEAD - 1 entries as independent loads issued together (one
        // round trip over PCIe for a CQ in host memory, not one per entry; entries past the
        // first one not yet written are read and ignored).
        const uint32_t window = min((uint32_t)GPUNVME_REAP_AHEAD, min(q.depth, owed) - n);
        // One entry to look at (QD 1, or the last completion owed), across PCIe: its phase
        // dword is loaded with acquire at system scope, which orders what follows as the fence
        // below would, without that fence's wait for this thread's earlier writes (the
        // doorbell just rung), which is on a QD 1 command's path.
        const bool lone_entry = window == 1 && !(q.flags & GPUNVME_QF_LOCAL_PEER);
        uint32_t dw3[GPUNVME_REAP_AHEAD];
        dw3[0] = cqe_dword(cq + (size_t)head * GPUNVME_CQE_SIZE, GPUNVME_CQE_CID,
                           lone_entry ? cuda::memory_order_acquire : cuda::memory_order_relaxed);
        if (((dw3[0] >> 16) & 1u) != phase) break;
#pragma unroll
        for (uint32_t i = 1; i < GPUNVME_REAP_AHEAD; ++i) {
            const uint8_t* cqe = cq + (size_t)((head + i) & mask) * GPUNVME_CQE_SIZE;
            dw3[i] = i < window ? cqe_dword(cqe, GPUNVME_CQE_CID, cuda::memory_order_relaxed) : 0u;
        }
        // The ready run: consecutive entries from the head whose phase is the one expected
        // there (it flips where the ring wraps).
        uint32_t k = 1;
        while (k < window && ((dw3[k] >> 16) & 1u) == (phase ^ (uint32_t)(head + k > mask)))
            ++k;
        more = k == window;
        // ... then acquire, and only then the rest of those entries and their commands' data.
        if (!lone_entry) acquire_from_controller(q);
        for (uint32_t i = 0; i < k; ++i) {
            uint32_t cid = dw3[i] & 0xffffu;
            uint32_t status_field = (dw3[i] >> 16) & 0xfffeu;
            slot_state* slot = cid < q.depth ? slot_of(q, cid) : nullptr;
            bool in_flight = false, wants = false;
            if (slot) {
                uint32_t rel = dev_u32(slot->released).load(cuda::memory_order_relaxed);
                uint32_t tk = dev_u32(slot->ticket).load(cuda::memory_order_relaxed);
                uint32_t dn = dev_u32(slot->done).load(cuda::memory_order_relaxed);
                wants = slot->dw0 != 0u;
                in_flight = rel == tk && (tk & mask) == cid && dn == 0;
            }
            if (!in_flight) {
                result = fail_queue(q, GPUNVME_BAD_COMPLETION);
                more = false;
                break;
            }
            // Acquire: this read of the entry is done before the head doorbell below hands
            // the entry back to the controller.
            if (wants)
                slot->dw0 = cqe_dword(cq + (size_t)head * GPUNVME_CQE_SIZE, GPUNVME_CQE_DW0,
                                      cuda::memory_order_acquire);
            dev_u32(slot->done).store(GPUNVME_DONE_BIT | status_field, cuda::memory_order_release);
            ++n;
            head = (head + 1) & mask;
            if (head == 0) phase ^= 1u;
        }
    }
    if (n) {
        st->cq_head = head;
        st->cq_phase = phase;
        // No fence before the head doorbell: every read of the entries it hands back is
        // already ordered before it (the phase dwords by the acquire fence or the acquire
        // load, dword 0 by its own acquire load), and nothing else needs to reach the
        // controller first, so a fence here would only lengthen a QD 1 command's path.
        // The head doorbell before the reaped count: a publisher that sees the count may fill
        // the freed entries' worth of SQ at once, and the controller should know the CQ space
        // is free before those commands can complete into it.
        doorbell_write(q.cq_doorbell, head);
        dev_u32(st->cq_reaped).fetch_add(n, cuda::memory_order_release);
    }
    unlock(st->cq_lock);
    return result;
}

// ---------------------------------------------------------------------------------------------
// Building commands.

/// Fills the 64-byte SQE for `r` with command id `cid` in four 16-byte stores.
__device__ __forceinline__ void write_sqe(const queue_desc& q, uint32_t slot, const io_req& r) {
    uint4* sqe = reinterpret_cast<uint4*>(q.sq + (uint64_t)slot * GPUNVME_SQE_SIZE);
    // Dword 0: opcode, flags (no fusing, PRPs), command id.
    uint32_t dw0 = (uint32_t)r.opcode | (slot << 16);
    sqe[0] = make_uint4(dw0, r.nsid, 0u, 0u);                          // CDW0, NSID, CDW2, CDW3
    sqe[1] = make_uint4(0u, 0u, (uint32_t)r.prp1, (uint32_t)(r.prp1 >> 32)); // MPTR, PRP1
    sqe[2] = make_uint4((uint32_t)r.prp2, (uint32_t)(r.prp2 >> 32),      // PRP2
                        (uint32_t)r.slba, (uint32_t)(r.slba >> 32));     // CDW10, CDW11 = SLBA
    // CDW12 NLB (and PRINFO on the queue's PI namespace: the controller generates and strips
    // the protection information, PRACT), CDW13, CDW14 the initial reference tag, CDW15.
    uint32_t cdw12 = (uint32_t)r.nlb_z, cdw14 = 0u;
    if (q.pi_nsid != 0u && r.nsid == q.pi_nsid && (r.opcode == OPC_READ || r.opcode == OPC_WRITE)) {
        cdw12 |= (uint32_t)q.pi_prinfo << 26;
        if (q.pi_prinfo & 1u) cdw14 = (uint32_t)r.slba;
    }
    sqe[3] = make_uint4(cdw12, 0u, cdw14, 0u);
}

/// Data pointer for `bytes` at device address `bus` when `bus` lies in the slot's own buffer
/// (pre-built PRP list) or is at most two pages: no list building on the hot path.
/// For other buffers use build_prp_list().
__device__ __forceinline__ void slot_buffer_prps(const queue_desc& q, uint32_t slot,
                                                 uint32_t bytes, uint64_t* prp1, uint64_t* prp2) {
    uint64_t base = q.slot_buffers_bus + (uint64_t)slot * q.slot_buffer_bytes;
    *prp1 = base;
    if (bytes <= GPUNVME_PAGE_SIZE) *prp2 = 0;
    else if (bytes <= 2 * GPUNVME_PAGE_SIZE) *prp2 = base + GPUNVME_PAGE_SIZE;
    else *prp2 = q.prp_lists_bus + (uint64_t)slot * 2 * GPUNVME_PAGE_SIZE;
}

/// PRPs for `bytes` at device address `bus` (4-byte aligned, contiguous in device address
/// space), writing a PRP list into the slot's second list page when more than two pages are
/// touched (the first page holds the slot buffer's pre-built list, which must stay intact for
/// later commands on the slot).
__device__ inline status build_prps(const queue_desc& q, uint32_t slot, uint64_t bus,
                                    uint32_t bytes, uint64_t* prp1, uint64_t* prp2) {
    if (bytes == 0 || bytes > q.max_transfer || (bus & 3)) return GPUNVME_INVALID_ARGUMENT;
    *prp1 = bus;
    uint64_t first_page_end = (bus & ~(uint64_t)(GPUNVME_PAGE_SIZE - 1)) + GPUNVME_PAGE_SIZE;
    uint64_t end = bus + bytes;
    if (end <= first_page_end) { *prp2 = 0; return GPUNVME_OK; }
    if (end <= first_page_end + GPUNVME_PAGE_SIZE) { *prp2 = first_page_end; return GPUNVME_OK; }
    uint64_t scratch = ((uint64_t)slot * 2 + 1) * GPUNVME_PAGE_SIZE;
    uint64_t* list = reinterpret_cast<uint64_t*>(q.prp_lists + scratch);
    uint32_t pages = (uint32_t)((end - first_page_end + GPUNVME_PAGE_SIZE - 1) / GPUNVME_PAGE_SIZE);
    if (pages > GPUNVME_PAGE_SIZE / 8) return GPUNVME_INVALID_ARGUMENT;
    for (uint32_t i = 0; i < pages; ++i) list[i] = first_page_end + (uint64_t)i * GPUNVME_PAGE_SIZE;
    *prp2 = q.prp_lists_bus + scratch;
    return GPUNVME_OK;
}

// ---------------------------------------------------------------------------------------------
// Thread variants: any thread, alone.

/// Waits (bounded) until ticket t's slot is released to it, reaping and publishing meanwhile
/// (shared by reserve_thread and reserve_warp).
__device__ __forceinline__ status wait_released(const queue_desc& q, uint32_t t) {
    slot_state* slot = slot_of(q, t & (q.depth - 1));
    waiter w(q);
    while (dev_u32(slot->released).load(cuda::memory_order_acquire) != t) {
        status f = queue_failed(q);
        if (f) return f;
        try_reap(q);
        try_publish(q);
        status s = w.tick(q);
        if (s) return fail_queue(q, s);
    }
    return GPUNVME_OK;
}

/// Takes a ticket and waits (bounded) until its slot is free. On success *ticket is owned by
/// the caller, who must submit() it.
__device__ inline status reserve_thread(const queue_desc& q, uint32_t* ticket) {
    // Ring positions are `ticket & (depth - 1)`: a descriptor built by hand with another depth
    // would corrupt them, so it is refused before any ticket is taken.
    if (q.depth < 2u || (q.depth & (q.depth - 1u))) return GPUNVME_INVALID_ARGUMENT;
    status f = queue_failed(q);
    if (f) return f;
    uint32_t t = dev_u32(state_of(q)->ticket).fetch_add(1u, cuda::memory_order_relaxed);
    if ((f = wait_released(q, t))) return f;
    *ticket = t;
    return GPUNVME_OK;
}

/// Whether a command's completion dword 0 means anything: not for Flush, Write, Read and Write
/// Zeroes (NVM Command Set: dword 0 is not used by them), whose entries the reaper then reads
/// without it (one read fewer per drain, a PCIe round trip for a CQ in host memory); their
/// complete_thread / complete_warp dw0 is 0.
__device__ __forceinline__ bool wants_dw0(uint8_t opcode) {
    return !(opcode == OPC_FLUSH || opcode == OPC_WRITE || opcode == OPC_READ ||
             opcode == OPC_WRITE_ZEROES);
}

/// Writes the SQE of an owned ticket and makes it publishable (no doorbell yet).
__device__ __forceinline__ void fill_slot(const queue_desc& q, uint32_t t, const io_req& r) {
    uint32_t s = t & (q.depth - 1);
    write_sqe(q, s, r);
    // Read by the reaper with the ticket (ordered by the release below, as the SQE is).
    slot_of(q, s)->dw0 = wants_dw0(r.opcode) ? 1u : 0u;
    // Release: the SQE is in place before anyone sees the ticket.
    dev_u32(slot_of(q, s)->ticket).store(t, cuda::memory_order_release);
}

/// Waits (bounded) until ticket t is published, publishing it (and its neighbours) itself
/// when it can: the doorbell-coalescing step.
__device__ inline status publish_thread(const queue_desc& q, uint32_t t) {
    queue_state* st = state_of(q);
    waiter w(q);
    // The first pass goes straight to the publish step (a ticket just filled is rarely
    // published yet; try_publish rings no doorbell on a failed queue).
    for (bool first = true;; first = false) {
        uint32_t p = 0;
        status f = GPUNVME_OK;
        if (!first) {
            p = dev_u32(st->sq_published).load(cuda::memory_order_relaxed);
            if ((int32_t)(p - t) > 0) return GPUNVME_OK;
            if ((f = queue_failed(q))) return f;
        }
        if (!try_publish(q)) {
            status s = w.tick(q);
            if (s) return fail_queue(q, s);
        } else {
            // Published as far as the CQ allows; if t is still beyond that, completions must
            // be consumed first.
            p = dev_u32(st->sq_published).load(cuda::memory_order_relaxed);
            if ((int32_t)(p - t) > 0) return GPUNVME_OK;
            if ((f = try_reap(q))) return f;
            status s = w.tick(q);
            if (s) return fail_queue(q, s);
        }
    }
}

/// Hands ticket t's slot on to ticket t + depth (after its completion was read).
__device__ __forceinline__ void release_slot(const queue_desc& q, uint32_t t) {
    slot_state* slot = slot_of(q, t & (q.depth - 1));
    dev_u32(slot->done).store(0u, cuda::memory_order_relaxed);
    // Release: our reads of the data come first.
    dev_u32(slot->released).store(t + q.depth, cuda::memory_order_release);
}

/// Waits (bounded) for ticket t's completion, releases the slot and returns the outcome:
/// GPUNVME_OK, or GPUNVME_NVME_ERROR with the CQE status field in *nvme_status.
__device__ inline status complete_thread(const queue_desc& q, uint32_t t, uint32_t* nvme_status,
                                         uint32_t* dw0) {
    slot_state* slot = slot_of(q, t & (q.depth - 1));
    waiter w(q);
    uint32_t done;
    for (;;) {
        done = dev_u32(slot->done).load(cuda::memory_order_acquire);
        if (done) break;
        status f = queue_failed(q);
        if (f) return f;
        if ((f = try_reap(q))) return f;
        done = dev_u32(slot->done).load(cuda::memory_order_acquire);
        if (done) break;
        try_publish(q);
        status s = w.tick(q);
        if (s) return fail_queue(q, s);
    }
    uint32_t sf = done & 0xffffu;
    if (nvme_status) *nvme_status = sf;
    if (dw0) *dw0 = slot->dw0;
    release_slot(q, t);
    return sf ? GPUNVME_NVME_ERROR : GPUNVME_OK;
}

/// One command from one thread: reserve, fill, publish, complete.
__device__ inline status io_thread(const queue_desc& q, const io_req& r, uint32_t* nvme_status) {
    uint32_t t;
    status s = reserve_thread(q, &t);
    if (s) return s;
    fill_slot(q, t, r);
    if ((s = publish_thread(q, t))) return s;
    return complete_thread(q, t, nvme_status, nullptr);
}

// ---------------------------------------------------------------------------------------------
// Warp variants: all 32 lanes of the warp must call them together (each lane may pass its own
// request; lanes with active == false take part without issuing). One atomic reserves the
// warp's slots and one doorbell (usually) publishes them.

__device__ __forceinline__ uint32_t lane_id() { return threadIdx.x & 31u; }

/// Trailing set bits of `m` (lanes 0.. that all qualify).
__device__ __forceinline__ uint32_t leading_run(uint32_t m) { return __ffs(~m) ? __ffs(~m) - 1 : 32; }

/// try_publish with the whole warp: lane 0 takes the lock, every lane checks one ticket of
/// the next 32 at once (instead of one lock holder loading them one after another), and lane
/// 0 rings the doorbell once. All 32 lanes call it together. Returns whether the warp held
/// the lock.
__device__ inline bool try_publish_warp(const queue_desc& q) {
    const uint32_t full = 0xffffffffu, lane = lane_id();
    queue_state* st = state_of(q);
    bool held = lane == 0 && try_lock(st->sq_lock);
    if (!__shfl_sync(full, held, 0)) return false;
    const uint32_t mask = q.depth - 1;
    uint32_t p = 0, limit = 0;
    if (lane == 0) {
        p = dev_u32(st->sq_published).load(cuda::memory_order_relaxed);
        limit = dev_u32(st->cq_reaped).load(cuda::memory_order_acquire) + mask;
    }
    p = __shfl_sync(full, p, 0);
    limit = __shfl_sync(full, limit, 0);
    const uint32_t start = p;
    for (;;) {
        const uint32_t t = p + lane;
        bool ok = false;
        if (lane < limit - p) {
            // Acquire: the SQE stores of the ticket's owner happen before what follows.
            ok = dev_u32(slot_of(q, t & mask)->ticket).load(cuda::memory_order_acquire) == t;
        }
        const uint32_t n = leading_run(__ballot_sync(full, ok));
        p += n;
        if (n < 32) break;
    }
    if (p != start) {
        // Every lane's acquired SQEs are ordered before lane 0's release fence and doorbell:
        // each lane's acquire load, then the warp barrier (memory ordering among its lanes),
        // then lane 0's system-scope fence (one fence per warp, not one per lane and one more).
        __syncwarp();
        if (lane == 0) {
            release_to_controller(q);
            doorbell_write(q.sq_doorbell, p & mask);
            dev_u32(st->sq_published).store(p, cuda::memory_order_relaxed);
        }
    }
    if (lane == 0) unlock(st->sq_lock);
    __syncwarp();
    return true;
}

/// try_reap with the whole warp: lane 0 takes the lock, lane i looks at CQ entry head + i, one
/// acquire fence covers the 32 entries (instead of one per entry), each lane stores its
/// entry's completion into the slot its command id names, and lane 0 rings the CQ head
/// doorbell once. All 32 lanes call it together; every lane returns the same status.
__device__ inline status try_reap_warp(const queue_desc& q) {
    const uint32_t full = 0xffffffffu, lane = lane_id();
    queue_state* st = state_of(q);
    bool held = lane == 0 && try_lock(st->cq_lock);
    if (!__shfl_sync(full, held, 0)) return GPUNVME_OK;
    const uint32_t mask = q.depth - 1;
    uint32_t head = 0, phase = 0;
    if (lane == 0) {
        head = st->cq_head;
        phase = st->cq_phase;
    }
    head = __shfl_sync(full, head, 0);
    phase = __shfl_sync(full, phase, 0);
    const uint8_t* cq = reinterpret_cast<const uint8_t*>(q.cq);
    // Completions owed (as in try_reap): no entry past them is read.
    uint32_t owed = 0;
    if (lane == 0)
        owed = dev_u32(st->sq_published).load(cuda::memory_order_relaxed) -
               dev_u32(st->cq_reaped).load(cuda::memory_order_relaxed);
    owed = min(__shfl_sync(full, owed, 0), q.depth);
    uint32_t total = 0;
    bool bad = false;
    while (total < owed) {
        const uint32_t pos = head + lane;
        const bool wraps = pos > mask;
        const uint32_t idx = pos & mask;
        const uint32_t want = wraps ? phase ^ 1u : phase;
        const uint8_t* cqe = cq + (size_t)idx * GPUNVME_CQE_SIZE;
        bool ok = false;
        uint32_t dw3 = 0;
        if (lane < owed - total) {
            // The phase dword first (the device may still be writing the rest of the entry).
            dw3 = cqe_dword(cqe, GPUNVME_CQE_CID, cuda::memory_order_relaxed);
            ok = ((dw3 >> 16) & 1u) == want;
        }
        uint32_t n = leading_run(__ballot_sync(full, ok));
        if (n == 0) break;
        // Acquire the entries (and their commands' data); as a release fence it also orders
        // them before the slot stores below.
        acquire_from_controller(q);
        bool mine = lane < n, in_flight = false, wants = false;
        slot_state* slot = nullptr;
        const uint32_t cid = dw3 & 0xffffu;
        if (mine && cid < q.depth) {
            slot = slot_of(q, cid);
            uint32_t rel = dev_u32(slot->released).load(cuda::memory_order_relaxed);
            uint32_t tk = dev_u32(slot->ticket).load(cuda::memory_order_relaxed);
            uint32_t dn = dev_u32(slot->done).load(cuda::memory_order_relaxed);
            wants = slot->dw0 != 0u;
            in_flight = rel == tk && (tk & mask) == cid && dn == 0;
        }
        // Two entries naming one slot in a batch: the later one is not in flight.
        const uint32_t same = __match_any_sync(full, mine ? cid : 0x10000u + lane);
        if (mine && (same & ((1u << lane) - 1u))) in_flight = false;
        const uint32_t good = leading_run(__ballot_sync(full, !mine || in_flight));
        if (good < n) {
            bad = true;
            n = good;
        }
        if (lane < n) {
            // Acquire: this read of the entry is done before the head doorbell below.
            if (wants)
                slot->dw0 = cqe_dword(cqe, GPUNVME_CQE_DW0, cuda::memory_order_acquire);
            // Release: dw0 before done (the fence above ordered the entries before both).
            dev_u32(slot->done).store(GPUNVME_DONE_BIT | ((dw3 >> 16) & 0xfffeu),
                                      cuda::memory_order_release);
        }
        total += n;
        if (head + n > mask) phase ^= 1u;
        head = (head + n) & mask;
        if (bad || n < 32) break;
    }
    // Every lane's reads of its entry before lane 0 hands the entries back (after the head
    // doorbell the controller may overwrite them): the phase dwords are ordered by each lane's
    // acquire fence, dword 0 by its acquire load, and the warp barrier orders both before lane
    // 0's doorbell, which needs no fence of its own (as in try_reap).
    __syncwarp();
    if (total && lane == 0) {
        st->cq_head = head;
        st->cq_phase = phase;
        doorbell_write(q.cq_doorbell, head);
        // After the doorbell, as in try_reap.
        dev_u32(st->cq_reaped).fetch_add(total, cuda::memory_order_release);
    }
    if (lane == 0) unlock(st->cq_lock);
    __syncwarp();
    return bad ? fail_queue(q, GPUNVME_BAD_COMPLETION) : GPUNVME_OK;
}

/// The warp's next step in a wait: GPUNVME_OK to keep waiting, else why to stop (lane 0's
/// waiter decides for all lanes, so the warp stays converged).
__device__ __forceinline__ status warp_tick(const queue_desc& q, waiter& w) {
    status s = GPUNVME_OK;
    if (lane_id() == 0) s = w.tick(q);  // the other lanes wait for it: they sleep too
    return __shfl_sync(0xffffffffu, s, 0);
}

/// Waits (bounded) until every active lane's ticket t has its slot released to it, reaping
/// and publishing with the whole warp meanwhile.
__device__ inline status wait_released_warp(const queue_desc& q, bool active, uint32_t t) {
    const uint32_t full = 0xffffffffu;
    slot_state* slot = slot_of(q, t & (q.depth - 1));
    waiter w(q);
    for (;;) {
        bool ready = !active ||
                     dev_u32(slot->released).load(cuda::memory_order_acquire) == t;
        if (__all_sync(full, ready)) return GPUNVME_OK;
        status f = __shfl_sync(full, lane_id() == 0 ? queue_failed(q) : 0, 0);
        if (f) return f;
        try_reap_warp(q);
        try_publish_warp(q);
        status s = warp_tick(q, w);
        if (s) return fail_queue(q, s);
    }
}

/// Reserves one ticket per active lane with a single atomic. The queue must have at least 32
/// entries: a warp's tickets are consecutive, and lane k + depth would otherwise wait for lane
/// k's slot while lane k waits for the warp (the deadlock rule of the _thread variants, for a
/// warp).
__device__ inline status reserve_warp(const queue_desc& q, bool active, uint32_t* ticket) {
    const uint32_t full = 0xffffffffu;
    // Uniform (every lane reads the same desc): at least a warp's worth, and a power of two
    // (ring positions are `ticket & (depth - 1)`).
    if (q.depth < 32 || (q.depth & (q.depth - 1u))) return GPUNVME_INVALID_ARGUMENT;
    uint32_t want = __ballot_sync(full, active);
    uint32_t n = __popc(want);
    uint32_t leader = want ? __ffs(want) - 1 : 0;
    // The leader alone decides (failed queue or not) and takes the tickets; the lanes learn
    // both from it, so the warp stays converged whatever other warps do meanwhile.
    uint32_t base = 0;
    status f = GPUNVME_OK;
    if (n && lane_id() == leader) {
        f = queue_failed(q);
        if (!f) base = dev_u32(state_of(q)->ticket).fetch_add(n, cuda::memory_order_relaxed);
    }
    base = __shfl_sync(full, base, leader);
    f = __shfl_sync(full, f, leader);
    if (f) return active ? f : GPUNVME_OK;
    if (!n) return GPUNVME_OK;
    uint32_t t = base + __popc(want & ((1u << lane_id()) - 1u));
    f = wait_released_warp(q, active, t);
    if (!active) return GPUNVME_OK;
    if (f) return f;
    *ticket = t;
    return GPUNVME_OK;
}

/// Publishes the warp's filled tickets with the whole warp (usually one doorbell for all).
__device__ inline status publish_warp(const queue_desc& q, bool active, uint32_t t) {
    const uint32_t full = 0xffffffffu;
    __syncwarp();
    queue_state* st = state_of(q);
    waiter w(q);
    for (;;) {
        uint32_t p = 0;
        if (lane_id() == 0) p = dev_u32(st->sq_published).load(cuda::memory_order_relaxed);
        p = __shfl_sync(full, p, 0);
        if (__all_sync(full, !active || (int32_t)(p - t) > 0)) return GPUNVME_OK;
        status f = __shfl_sync(full, lane_id() == 0 ? queue_failed(q) : 0, 0);
        if (f) return active ? f : GPUNVME_OK;
        if (try_publish_warp(q)) {
            if (lane_id() == 0) p = dev_u32(st->sq_published).load(cuda::memory_order_relaxed);
            p = __shfl_sync(full, p, 0);
            if (__all_sync(full, !active || (int32_t)(p - t) > 0)) return GPUNVME_OK;
            // Held back by CQ space: completions must be consumed first.
            if ((f = try_reap_warp(q))) return active ? f : GPUNVME_OK;
        }
        status s = warp_tick(q, w);
        if (s) {
            fail_queue(q, s);
            return active ? s : GPUNVME_OK;
        }
    }
}

/// Waits (bounded) until each active lane's slot has its completion, reaping with the whole
/// warp; *done gets the slot's done word (0 for inactive lanes). The slots stay owned.
__device__ inline status wait_done_warp(const queue_desc& q, bool active, uint32_t t,
                                        uint32_t* done) {
    const uint32_t full = 0xffffffffu;
    slot_state* slot = slot_of(q, t & (q.depth - 1));
    waiter w(q);
    uint32_t d = 0;
    for (;;) {
        if (active && !d) d = dev_u32(slot->done).load(cuda::memory_order_acquire);
        if (__all_sync(full, !active || d)) break;
        status f = __shfl_sync(full, lane_id() == 0 ? queue_failed(q) : 0, 0);
        if (f) return active ? f : GPUNVME_OK;
        if ((f = try_reap_warp(q))) return active ? f : GPUNVME_OK;
        if (active && !d) d = dev_u32(slot->done).load(cuda::memory_order_acquire);
        if (__all_sync(full, !active || d)) break;
        try_publish_warp(q);
        status s = warp_tick(q, w);
        if (s) {
            fail_queue(q, s);
            return active ? s : GPUNVME_OK;
        }
    }
    *done = d;
    return GPUNVME_OK;
}

/// Waits for each active lane's ticket (the warp reaps together), releases the slots, and
/// returns each lane's outcome as complete_thread does.
__device__ inline status complete_warp(const queue_desc& q, bool active, uint32_t t,
                                       uint32_t* nvme_status, uint32_t* dw0) {
    uint32_t done = 0;
    status f = wait_done_warp(q, active, t, &done);
    if (!active) return GPUNVME_OK;
    if (f) return f;
    uint32_t sf = done & 0xffffu;
    if (nvme_status) *nvme_status = sf;
    if (dw0) *dw0 = slot_of(q, t & (q.depth - 1))->dw0;
    release_slot(q, t);
    return sf ? GPUNVME_NVME_ERROR : GPUNVME_OK;
}

// ---------------------------------------------------------------------------------------------
// Reads and writes of LBA ranges into / out of GPU memory. `bus` is the device address of the
// GPU memory (a buffer registered for the queues' controller: gpu_queues::GpuBuffer), split at
// desc.max_transfer.
//
// Deadlock rule: a thread holds at most ONE ticket at a time. Ticket t waits only on tickets
// below it (publication waits for earlier SQEs, reservation for ticket t - depth to be
// released), so the wait-for graph has no cycle as long as no thread waits for a later ticket
// of its own. A thread holding two tickets could (t2 - depth == t1). Parallelism comes from
// many threads, or from the _warp variant (one piece per lane).

/// The request for one piece on owned ticket t: `blocks` blocks at `slba`, data at device
/// address `bus`. If its PRPs cannot be built, *r is a harmless Flush instead (the ticket is
/// ours and the ring must stay consecutive) and the reason is returned.
__device__ __forceinline__ status piece_req(const queue_desc& q, uint32_t t, uint8_t opcode,
                                            uint32_t nsid, uint64_t slba, uint32_t blocks,
                                            uint64_t bus, uint32_t bytes, io_req* r) {
    r->opcode = opcode;
    r->nsid = nsid;
    r->slba = slba;
    r->nlb_z = (uint16_t)(blocks - 1);
    r->reserved = 0;
    status bad = build_prps(q, t & (q.depth - 1), bus, bytes, &r->prp1, &r->prp2);
    if (bad) {
        r->opcode = OPC_FLUSH; r->prp1 = 0; r->prp2 = 0; r->slba = 0; r->nlb_z = 0;
    }
    return bad;
}

/// One piece of a range: `blocks` blocks at `slba`, data at device address `bus`.
__device__ inline status rw_piece(const queue_desc& q, uint8_t opcode, uint32_t nsid,
                                  uint64_t slba, uint32_t blocks, uint64_t bus, uint32_t bytes,
                                  uint32_t* nvme_status) {
    uint32_t t;
    status s = reserve_thread(q, &t);
    if (s) return s;
    io_req r;
    status bad = piece_req(q, t, opcode, nsid, slba, blocks, bus, bytes, &r);
    fill_slot(q, t, r);
    if ((s = publish_thread(q, t))) return s;
    s = complete_thread(q, t, nvme_status, nullptr);
    return bad ? bad : s;
}

/// Blocks per command for this queue and LBA size.
__device__ __forceinline__ uint32_t blocks_per_command(const queue_desc& q, uint32_t lba_shift) {
    uint32_t n = q.max_transfer >> lba_shift;
    return n < 65536 ? n : 65536;
}

/// Reads (OPC_READ) or writes (OPC_WRITE) `blocks` blocks of `1 << lba_shift` bytes at `slba`
/// of namespace `nsid`, into or out of device addresses from `bus` (any thread, alone; one
/// command in flight at a time).
__device__ inline status rw_thread(const queue_desc& q, uint8_t opcode, uint32_t nsid,
                                   uint32_t lba_shift, uint64_t slba, uint64_t blocks,
                                   uint64_t bus, uint32_t* nvme_status) {
    if (blocks == 0 || lba_shift < 9 || lba_shift > 12) return GPUNVME_INVALID_ARGUMENT;
    const uint32_t per_cmd = blocks_per_command(q, lba_shift);
    if (per_cmd == 0) return GPUNVME_INVALID_ARGUMENT;
    for (uint64_t done = 0; done < blocks;) {
        uint32_t n = (uint32_t)(blocks - done < per_cmd ? blocks - done : per_cmd);
        status s = rw_piece(q, opcode, nsid, slba + done, n, bus + (done << lba_shift),
                            n << lba_shift, nvme_status);
        if (s) return s;
        done += n;
    }
    return GPUNVME_OK;
}

/// The same, with all 32 lanes of a warp cooperating: lane i moves pieces i, i + 32, ...
/// Every lane returns the warp's first error (GPUNVME_OK if none).
__device__ inline status rw_warp(const queue_desc& q, uint8_t opcode, uint32_t nsid,
                                 uint32_t lba_shift, uint64_t slba, uint64_t blocks, uint64_t bus,
                                 uint32_t* nvme_status) {
    const uint32_t full = 0xffffffffu;
    if (blocks == 0 || lba_shift < 9 || lba_shift > 12) return GPUNVME_INVALID_ARGUMENT;
    const uint32_t per_cmd = blocks_per_command(q, lba_shift);
    if (per_cmd == 0) return GPUNVME_INVALID_ARGUMENT;
    const uint64_t pieces = (blocks + per_cmd - 1) / per_cmd;
    status mine = GPUNVME_OK;
    uint32_t my_sf = 0;
    for (uint64_t round = 0; round * 32 < pieces; ++round) {
        uint64_t piece = round * 32 + lane_id();
        bool active = piece < pieces && mine == GPUNVME_OK;
        uint32_t t = 0;
        status s = reserve_warp(q, active, &t);
        if (active && s) { mine = s; active = false; }
        io_req r;
        status bad = GPUNVME_OK;
        if (active) {
            uint64_t first = piece * per_cmd;
            uint32_t n = (uint32_t)(blocks - first < per_cmd ? blocks - first : per_cmd);
            bad = piece_req(q, t, opcode, nsid, slba + first, n, bus + (first << lba_shift),
                            n << lba_shift, &r);
            fill_slot(q, t, r);
        }
        s = publish_warp(q, active, t);
        if (active && s) { mine = s; active = false; }
        uint32_t sf = 0;
        s = complete_warp(q, active, t, &sf, nullptr);
        if (active && (s || bad)) { mine = bad ? bad : s; my_sf = sf; }
        if (__any_sync(full, mine != GPUNVME_OK)) break;
    }
    // The lowest failing lane's outcome, for every lane.
    uint32_t failing = __ballot_sync(full, mine != GPUNVME_OK);
    if (!failing) return GPUNVME_OK;
    uint32_t src = __ffs(failing) - 1;
    status out = __shfl_sync(full, mine, src);
    uint32_t sf = __shfl_sync(full, my_sf, src);
    if (nvme_status) *nvme_status = sf;
    return out;
}

// ---------------------------------------------------------------------------------------------
// Copies by the lanes of a warp (file bounce buffers, cache pages).

/// Copies n bytes from src to dst with `lanes` threads, this one being `lane` (16-byte words
/// when both ends and n allow, else bytes).
__device__ __forceinline__ void copy_bytes(uint8_t* dst, const uint8_t* src, uint32_t n,
                                           uint32_t lane, uint32_t lanes) {
    if ((((uintptr_t)dst | (uintptr_t)src | n) & 15) == 0) {
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint4* s = reinterpret_cast<const uint4*>(src);
        for (uint32_t k = lane; k < n / 16; k += lanes) d[k] = s[k];
    } else if ((((uintptr_t)dst | (uintptr_t)src | n) & 3) == 0) {
        uint32_t* d = reinterpret_cast<uint32_t*>(dst);
        const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
        for (uint32_t k = lane; k < n / 4; k += lanes) d[k] = s[k];
    } else {
        for (uint32_t k = lane; k < n; k += lanes) dst[k] = src[k];
    }
}


// ---------------------------------------------------------------------------------------------
// The verification pattern of `gpunvme perf --verify` (src/pattern.rs): every 8-byte word is a
// function of (seed, nsid, lba, word index), so the CPU and the GPU check each other's bytes.

__device__ __forceinline__ uint64_t pattern_mix(uint64_t z) {
    z += 0x9e3779b97f4a7c15ull;
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}
__device__ __forceinline__ uint64_t pattern_word(uint64_t seed, uint32_t nsid, uint64_t lba,
                                                 uint64_t w) {
    uint64_t rot = (lba << 20) | (lba >> 44);
    return pattern_mix(seed ^ ((uint64_t)nsid << 56) ^ rot ^ w);
}

}  // namespace gpunvme
