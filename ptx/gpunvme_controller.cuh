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
// the host is forgotten by every warp before its deletion completes.
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
//             then fences (acquire), reads a whole entry and the data.
//   tables:   (warp 0, lane 0 of each block, every GPUNVME_CTRL_HOST_POLL_NS) ld.relaxed.sys
//             generation -> fence.acq_rel.sys -> shared-memory copy; (each warp) shared copy ->
//             fence.acq_rel.sys -> table loads; ack after reload.
//   No other controller load touches host memory: a few hundred warps polling host memory
//   made each pass ~30 µs and slowed clients' system-scope fences to ~10 µs (measured, H100).
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
#define GPUNVME_CTRL_CONTROL_SIZE 128
#define GPUNVME_CTRL_COUNTERS_SIZE 64
#define GPUNVME_CC_STOP 0
#define GPUNVME_CC_GENERATION 4
#define GPUNVME_CC_QUEUES 32
#define GPUNVME_CC_ACK 72
#define GPUNVME_CC_LIFETIME_NS 80

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
    uint32_t reserved0;
    uint64_t queues;        // GPU pointer (mapped host): ctrl_queue[nqueues]
    uint64_t windows;       // GPU pointer (mapped host): ctrl_window[GPUNVME_CTRL_MAX_WINDOWS]
    uint64_t namespaces;    // GPU pointer (mapped host): ctrl_ns[GPUNVME_CTRL_MAX_NS]
    uint64_t doorbells;     // GPU pointer (GPU memory): queue qid's SQ tail at
                            //   (qid - 1) * GPUNVME_CTRL_DOORBELL_STRIDE, its CQ head 4 B later
    uint64_t counters;      // GPU pointer (GPU memory): ctrl_counters per warp
    uint64_t ack;           // GPU pointer (mapped host): uint32 per warp, last generation seen;
                            //   (uint32 per block from ack + 4 * warps: the block's SM id + 1)
    uint64_t lifetime_ns;   // the kernel stops by itself after this long (a bound, never 0)
    uint64_t reserved1[5];
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
    unsigned long long reserved;
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
};
enum : uint8_t { OPC_DSM = 0x09 };

/// Per-warp shared-memory copy of the windows and namespaces.
struct warp_tables {
    ctrl_window windows[GPUNVME_CTRL_MAX_WINDOWS];
    ctrl_ns ns[GPUNVME_CTRL_MAX_NS];
    uint32_t nwindows;
    uint32_t nns;
    uint32_t max_transfer;
    uint32_t pad;
};

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

/// The warp copies `len` bytes from `src` to `dst` (both 4-byte aligned).
__device__ __forceinline__ void warp_copy(uint8_t* dst, const uint8_t* src, uint32_t len,
                                          uint32_t lane) {
    if ((((uintptr_t)src | (uintptr_t)dst | len) & 15) == 0) {
        const uint4* s = reinterpret_cast<const uint4*>(src);
        uint4* d = reinterpret_cast<uint4*>(dst);
        const uint32_t n = len / 16;
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
    } else {
        const uint32_t* s = reinterpret_cast<const uint32_t*>(src);
        uint32_t* d = reinterpret_cast<uint32_t*>(dst);
        for (uint32_t k = lane; k < len / 4; k += 32) d[k] = s[k];
    }
}

/// The warp zeroes `len` bytes at `dst` (512-byte aligned, a multiple of 512).
__device__ __forceinline__ void warp_zero(uint8_t* dst, uint64_t len, uint32_t lane) {
    uint4* d = reinterpret_cast<uint4*>(dst);
    const uint4 z = make_uint4(0, 0, 0, 0);
    for (uint64_t k = lane; k < len / 16; k += 32) __stcg(d + k, z);
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
};

/// Reloads the warp's queues (each lane its own) and tables from the host's tables.
__device__ inline void reload(const ctrl_control* c, warp_tables* t, lane_queue* q,
                              uint32_t lane) {
    fence_sys();  // acquire: the tables the host wrote before bumping the generation
    const uint32_t nwin = ld_sys(&c->nwindows), nns = ld_sys(&c->nns);
    const ctrl_window* w = reinterpret_cast<const ctrl_window*>(ld_sys64(&c->windows));
    const ctrl_ns* n = reinterpret_cast<const ctrl_ns*>(ld_sys64(&c->namespaces));
    for (uint32_t i = lane; i < GPUNVME_CTRL_MAX_WINDOWS; i += 32) {
        if (i < nwin) {
            t->windows[i].base = ld_sys64(&w[i].base);
            t->windows[i].len = ld_sys64(&w[i].len);
        }
    }
    for (uint32_t i = lane; i < GPUNVME_CTRL_MAX_NS; i += 32) {
        if (i < nns) {
            t->ns[i].blocks = ld_sys64(&n[i].blocks);
            t->ns[i].media = ld_sys64(&n[i].media);
            t->ns[i].lba_shift = ld_sys(&n[i].lba_shift);
            t->ns[i].kind = ld_sys(&n[i].kind);
            t->ns[i].flags = ld_sys(&n[i].flags);
        }
    }
    if (lane == 0) {
        t->nwindows = nwin < GPUNVME_CTRL_MAX_WINDOWS ? nwin : GPUNVME_CTRL_MAX_WINDOWS;
        t->nns = nns < GPUNVME_CTRL_MAX_NS ? nns : GPUNVME_CTRL_MAX_NS;
        t->max_transfer = ld_sys(&c->max_transfer);
    }
    if (q->qid) {
        const ctrl_queue* e = reinterpret_cast<const ctrl_queue*>(ld_sys64(&c->queues)) + (q->qid - 1);
        const uint32_t serial = ld_sys(&e->serial);
        const uint64_t sq = ld_sys64(&e->sq), cq = ld_sys64(&e->cq);
        const uint32_t sqe = ld_sys(&e->sq_entries), cqe = ld_sys(&e->cq_entries);
        const bool live = sq && cq && sqe >= 2 && cqe >= 2;
        if (!live) {
            q->sq = nullptr;
            q->serial = serial;
        } else if (serial != q->serial || !q->sq) {
            // A new queue on this id: both rings start empty, the CQ's first phase is 1.
            q->sq = reinterpret_cast<const uint8_t*>(sq);
            q->cq = reinterpret_cast<uint8_t*>(cq);
            q->sq_entries = sqe;
            q->cq_entries = cqe;
            q->serial = serial;
            q->sq_head = q->cq_tail = q->cq_head = q->sq_tail = 0;
            q->cq_phase = 1;
        }
    }
    __syncwarp();
}

}  // namespace ctrl
}  // namespace gpunvme
