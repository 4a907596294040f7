// gpunvme_file.cuh — files on the GPU: blockfs extent tables (blockfs/src/table.rs, FORMAT.md
// "GPU extent table") walked by GPU threads, and reads / writes of any byte range of a file into
// / out of GPU memory on the queues of gpunvme.cuh; plus CRC-32C of GPU memory (the checksum
// blockfs records), computed in parallel and combined.
//
// Header-only, namespace gpunvme::fs, built only on gpunvme.cuh's calls: every wait is bounded
// by the queue's timeout and abort word, nothing traps or prints. The host side is the Rust
// module blockfs_gpu (GpuFiles), which uploads the tables, plans the grid and checks the
// results; its pure functions (plan_piece, chunk_of, warp_span, claim_size, crc32c_*) are the Rust twins of the
// functions below and are unit-tested on machines without a GPU.
//
// Layout contract: table_header / table_file / table_extent are blockfs's TableHeader /
// TableFile / TableExtent byte for byte; the GPUNVME_TABLE_* numbers below are checked here by
// static_assert and on the Rust side against blockfs's constants by the test that parses the
// CUDA sources (gpu-queues/src/desc.rs, header_matches_rust_layouts).
//
// HOW A BYTE RANGE IS MOVED. A range [start, end) of file f is cut into pieces (plan_piece):
//  * DIRECT: whole LBAs at an LBA-aligned file offset whose GPU address is 4-byte aligned:
//    one command straight between the device and the caller's GPU memory (PRPs built by
//    build_prps in the slot's list page), at most one extent and max_transfer long;
//  * BOUNCE: an unaligned head or tail (one LBA), or whole LBAs whose GPU address is not 4-byte
//    aligned (up to one slot buffer): the command moves the LBAs through the slot buffer of its
//    own ticket (the queue's per-slot buffer, pre-built PRPs); a read copies the wanted bytes
//    out of it before the slot is released, a write copies the data in before the SQE is
//    published;
//  * RMW (writes only): a partial LBA is read into the slot buffer of one ticket, copied to a
//    caller-provided scratch LBA and the slot released; then the scratch, overlaid with the new
//    bytes, is written through the slot buffer of a second ticket. A thread never holds two
//    tickets (the deadlock rule of gpunvme.cuh).
//  Reads stop at the file's size_bytes: a range past it fails with GPUNVME_OUT_OF_EXTENT before
//  any command. Writes need a table entry with GPUNVME_TABLE_FILE_WRITABLE (a device-write
//  reservation) and stay below alloc_bytes: past it, GPUNVME_OUT_OF_EXTENT. Concurrent writes
//  of two ranges that share an LBA race in their read-modify-write: callers give each LBA one
//  writer.
//
// FENCE DISCIPLINE (on top of gpunvme.cuh's):
//  bounce in (write data into a slot buffer, any lane of the warp copying):
//     copies -> fence.acq_rel.gpu (every lane) -> __syncwarp -> owner's st.release.gpu
//     slot.ticket (fill_slot) -> publisher's ld.acquire + fence.acq_rel.sys -> doorbell.
//  bounce out (read data out of a slot buffer):
//     reaper's fence (sys) -> st.release slot.done -> owner's ld.acquire slot.done -> __syncwarp
//     -> fence.acq_rel.gpu (every lane) -> copies -> fence.acq_rel.gpu -> __syncwarp -> owner's
//     st.release slot.released (release_slot): no lane reads the slot buffer after its next
//     owner may have it refilled.
//  The data of DIRECT reads is in the caller's memory when the command's completion is seen
//  (the reaper's acquire fence); it is visible to later kernels on the stream once this one ends.
#pragma once

#include "gpunvme.cuh"

// Extent table layout (blockfs/src/table.rs: TABLE_*; the same numbers).
#define GPUNVME_TABLE_MAGIC 0x54584642u
#define GPUNVME_TABLE_VERSION 2
#define GPUNVME_TABLE_HEADER_SIZE 64
#define GPUNVME_TABLE_FILE_SIZE 48
#define GPUNVME_TABLE_EXTENT_SIZE 24
#define GPUNVME_TH_LBA_SHIFT 8
#define GPUNVME_TH_NSID 12
#define GPUNVME_TH_FILE_COUNT 16
#define GPUNVME_TH_EXTENT_COUNT 24
#define GPUNVME_TH_FILES_OFFSET 32
#define GPUNVME_TH_EXTENTS_OFFSET 40
#define GPUNVME_TH_TOTAL_BYTES 48
#define GPUNVME_TF_SIZE_BYTES 0
#define GPUNVME_TF_FIRST_EXTENT 8
#define GPUNVME_TF_EXTENT_COUNT 16
#define GPUNVME_TF_FILE_ID 24
#define GPUNVME_TF_ALLOC_BYTES 32
#define GPUNVME_TF_FLAGS 40
#define GPUNVME_TE_FILE_LBA 0
#define GPUNVME_TE_LBA 8
#define GPUNVME_TE_NLB 16
// table_file.flags: the device may write below alloc_bytes (a device-write reservation).
#define GPUNVME_TABLE_FILE_WRITABLE 1u

// Piece kinds (blockfs_gpu::plan::PieceKind).
#define GPUNVME_PIECE_DIRECT 0
#define GPUNVME_PIECE_BOUNCE 1
#define GPUNVME_PIECE_RMW 2

// CRC-32C (Castagnoli, reflected; init and final XOR 0xffffffff): blockfs's data checksum.
#define GPUNVME_CRC32C_POLY 0x82f63b78u

namespace gpunvme {
namespace fs {

/// blockfs TableHeader.
struct table_header {
    uint32_t magic;
    uint16_t version;
    uint16_t header_bytes;
    uint32_t lba_shift;
    uint32_t nsid;
    uint32_t file_count;
    uint16_t file_entry_bytes;
    uint16_t extent_entry_bytes;
    uint64_t extent_count;
    uint64_t files_offset;
    uint64_t extents_offset;
    uint64_t total_bytes;
    uint64_t reserved;
};

/// blockfs TableFile: one file of a table.
struct table_file {
    uint64_t size_bytes;    // reads stop here
    uint64_t first_extent;  // index into the table's extents
    uint64_t extent_count;
    uint64_t file_id;
    uint64_t alloc_bytes;   // extents cover this much (writes stop here)
    uint32_t flags;         // GPUNVME_TABLE_FILE_*
    uint32_t reserved;
};

/// blockfs TableExtent: file LBAs file_lba..file_lba+nlb live at device LBAs lba..lba+nlb.
struct table_extent {
    uint64_t file_lba;
    uint64_t lba;
    uint64_t nlb;
};

static_assert(sizeof(table_header) == GPUNVME_TABLE_HEADER_SIZE, "table_header size");
static_assert(offsetof(table_header, lba_shift) == GPUNVME_TH_LBA_SHIFT, "lba_shift");
static_assert(offsetof(table_header, nsid) == GPUNVME_TH_NSID, "nsid");
static_assert(offsetof(table_header, file_count) == GPUNVME_TH_FILE_COUNT, "file_count");
static_assert(offsetof(table_header, extent_count) == GPUNVME_TH_EXTENT_COUNT, "extent_count");
static_assert(offsetof(table_header, files_offset) == GPUNVME_TH_FILES_OFFSET, "files_offset");
static_assert(offsetof(table_header, extents_offset) == GPUNVME_TH_EXTENTS_OFFSET, "ext_off");
static_assert(offsetof(table_header, total_bytes) == GPUNVME_TH_TOTAL_BYTES, "total_bytes");
static_assert(sizeof(table_file) == GPUNVME_TABLE_FILE_SIZE, "table_file size");
static_assert(offsetof(table_file, size_bytes) == GPUNVME_TF_SIZE_BYTES, "size_bytes");
static_assert(offsetof(table_file, first_extent) == GPUNVME_TF_FIRST_EXTENT, "first_extent");
static_assert(offsetof(table_file, extent_count) == GPUNVME_TF_EXTENT_COUNT, "extent_count");
static_assert(offsetof(table_file, file_id) == GPUNVME_TF_FILE_ID, "file_id");
static_assert(offsetof(table_file, alloc_bytes) == GPUNVME_TF_ALLOC_BYTES, "alloc_bytes");
static_assert(offsetof(table_file, flags) == GPUNVME_TF_FLAGS, "flags");
static_assert(sizeof(table_extent) == GPUNVME_TABLE_EXTENT_SIZE, "table_extent size");
static_assert(offsetof(table_extent, file_lba) == GPUNVME_TE_FILE_LBA, "file_lba");
static_assert(offsetof(table_extent, lba) == GPUNVME_TE_LBA, "lba");
static_assert(offsetof(table_extent, nlb) == GPUNVME_TE_NLB, "nlb");

/// A table as kernels use it: pointers into the table in GPU memory (read-only).
struct table {
    const table_header* h;
    const table_file* files;
    const table_extent* extents;
    uint64_t extent_count;
    uint32_t lba_shift;
    uint32_t nsid;
    uint32_t file_count;
};

/// Checks the table at GPU pointer `p` (magic, version, entry sizes, LBA size 512..4096, a
/// namespace) and fills *t. GPUNVME_INVALID_ARGUMENT if it is not a usable table.
__device__ inline status table_open(const void* p, table* t) {
    if (!p || ((uintptr_t)p & 7)) return GPUNVME_INVALID_ARGUMENT;
    const table_header* h = reinterpret_cast<const table_header*>(p);
    if (h->magic != GPUNVME_TABLE_MAGIC || h->version != GPUNVME_TABLE_VERSION ||
        h->header_bytes != GPUNVME_TABLE_HEADER_SIZE ||
        h->file_entry_bytes != GPUNVME_TABLE_FILE_SIZE ||
        h->extent_entry_bytes != GPUNVME_TABLE_EXTENT_SIZE || h->lba_shift < 9 ||
        h->lba_shift > 12 || h->nsid == 0 || (h->files_offset & 7) || (h->extents_offset & 7))
        return GPUNVME_INVALID_ARGUMENT;
    t->h = h;
    t->files = reinterpret_cast<const table_file*>(reinterpret_cast<const uint8_t*>(p) +
                                                   h->files_offset);
    t->extents = reinterpret_cast<const table_extent*>(reinterpret_cast<const uint8_t*>(p) +
                                                       h->extents_offset);
    t->extent_count = h->extent_count;
    t->lba_shift = h->lba_shift;
    t->nsid = h->nsid;
    t->file_count = h->file_count;
    return GPUNVME_OK;
}

/// File `i` of the table, checked (its extents lie inside the table).
__device__ inline status table_file_at(const table& t, uint32_t i, const table_file** f) {
    if (i >= t.file_count) return GPUNVME_INVALID_ARGUMENT;
    const table_file* e = &t.files[i];
    if (e->first_extent > t.extent_count || e->extent_count > t.extent_count - e->first_extent)
        return GPUNVME_INVALID_ARGUMENT;
    *f = e;
    return GPUNVME_OK;
}

/// The extent lookup (blockfs ExtentTable::lookup): byte `offset` of file f, which must be
/// below `limit`, lives at device LBA *lba, and *contig LBAs from there are contiguous (to the
/// end of its extent). A binary search for the last extent whose file_lba is at most
/// offset >> lba_shift. false: past `limit`, or in no extent.
__device__ inline bool lookup(const table& t, const table_file& f, uint64_t offset,
                              uint64_t limit, uint64_t* lba, uint64_t* contig) {
    if (offset >= limit || f.extent_count == 0) return false;
    const uint64_t flba = offset >> t.lba_shift;
    const table_extent* ext = t.extents + f.first_extent;
    uint64_t lo = 0, hi = f.extent_count;
    // Invariant: ext[lo].file_lba <= flba < ext[hi].file_lba (hi == count: +infinity).
    while (hi - lo > 1) {
        const uint64_t mid = lo + (hi - lo) / 2;
        if (ext[mid].file_lba <= flba) lo = mid;
        else hi = mid;
    }
    const table_extent e = ext[lo];
    if (flba < e.file_lba || flba - e.file_lba >= e.nlb) return false;
    *lba = e.lba + (flba - e.file_lba);
    *contig = e.nlb - (flba - e.file_lba);
    return true;
}

/// Translation for a read (blockfs ExtentTable::translate): below size_bytes only, and
/// *contig stops at the LBA holding the file's last byte.
__device__ inline bool translate_read(const table& t, const table_file& f, uint64_t offset,
                                      uint64_t* lba, uint64_t* contig) {
    if (!lookup(t, f, offset, f.size_bytes, lba, contig)) return false;
    const uint64_t eof_lba = (f.size_bytes + (1ull << t.lba_shift) - 1) >> t.lba_shift;
    const uint64_t left = eof_lba - (offset >> t.lba_shift);
    if (*contig > left) *contig = left;
    return true;
}

/// Translation for a write (blockfs ExtentTable::translate_write): only through a WRITABLE
/// entry, below alloc_bytes.
__device__ inline bool translate_write(const table& t, const table_file& f, uint64_t offset,
                                       uint64_t* lba, uint64_t* contig) {
    if (!(f.flags & GPUNVME_TABLE_FILE_WRITABLE)) return false;
    return lookup(t, f, offset, f.alloc_bytes, lba, contig);
}

/// Whether [offset, offset + len) may be read (write == false) or written through f.
__device__ inline status check_range(const table_file& f, bool write, uint64_t offset,
                                     uint64_t len) {
    const uint64_t limit = write ? f.alloc_bytes : f.size_bytes;
    if (write && !(f.flags & GPUNVME_TABLE_FILE_WRITABLE)) return GPUNVME_OUT_OF_EXTENT;
    if (offset > limit || len > limit - offset) return GPUNVME_OUT_OF_EXTENT;
    return GPUNVME_OK;
}

/// One command's worth of a file range (see "HOW A BYTE RANGE IS MOVED").
struct piece {
    uint64_t lba;     // first device LBA
    uint32_t blocks;  // LBAs the command moves
    uint32_t bytes;   // bytes of the range it covers (from the range position)
    uint32_t skip;    // where those bytes start in its first LBA (BOUNCE / RMW)
    uint32_t kind;    // GPUNVME_PIECE_*
};

/// The piece of [pos, end) of file f that starts at pos (blockfs_gpu::plan::plan_piece is its
/// twin). `aligned`: the GPU address of byte pos is 4-byte aligned (PRPs can point at it);
/// `max_blocks`: LBAs per command (blocks_per_command); `bounce_blocks`: LBAs a slot buffer
/// holds. GPUNVME_OUT_OF_EXTENT past the readable (or writable) part of the file.
__device__ inline status plan_piece(const table& t, const table_file& f, bool write,
                                    uint64_t pos, uint64_t end, bool aligned,
                                    uint32_t max_blocks, uint32_t bounce_blocks, piece* p) {
    if (pos >= end) return GPUNVME_INVALID_ARGUMENT;
    uint64_t lba = 0, contig = 0;
    const bool ok = write ? translate_write(t, f, pos, &lba, &contig)
                          : translate_read(t, f, pos, &lba, &contig);
    if (!ok) return GPUNVME_OUT_OF_EXTENT;
    const uint64_t lsize = 1ull << t.lba_shift;
    const uint32_t skip = (uint32_t)(pos & (lsize - 1));
    const uint64_t left = end - pos;
    p->lba = lba;
    p->skip = skip;
    if (skip || left < lsize) {
        p->blocks = 1;
        p->bytes = (uint32_t)(lsize - skip < left ? lsize - skip : left);
        p->kind = write ? GPUNVME_PIECE_RMW : GPUNVME_PIECE_BOUNCE;
        return GPUNVME_OK;
    }
    uint64_t n = left >> t.lba_shift;
    if (n > contig) n = contig;
    const uint32_t cap = aligned ? max_blocks : bounce_blocks;
    if (n > cap) n = cap;
    if (n == 0) return GPUNVME_INVALID_ARGUMENT;
    p->blocks = (uint32_t)n;
    p->bytes = (uint32_t)(n << t.lba_shift);
    p->kind = aligned ? GPUNVME_PIECE_DIRECT : GPUNVME_PIECE_BOUNCE;
    return GPUNVME_OK;
}

/// Chunk k of the range [offset, offset + len) cut at multiples of chunk_bytes of the file
/// offset (a multiple of the LBA size, so a partial LBA never spans two chunks):
/// [*cs, *ce). Chunks per range: (offset + len - 1) / chunk_bytes - offset / chunk_bytes + 1.
__device__ __forceinline__ void chunk_of(uint64_t offset, uint64_t len, uint32_t chunk_bytes,
                                         uint64_t k, uint64_t* cs, uint64_t* ce) {
    const uint64_t c = offset / chunk_bytes + k;
    const uint64_t s = c * chunk_bytes, e = s + chunk_bytes;
    *cs = s > offset ? s : offset;
    *ce = e < offset + len ? e : offset + len;
}

/// The chunks warp `warp` of `warps` takes in the round of the batch file kernel that starts at
/// chunk `start` and holds `n` chunks (n <= 32 * warps): [*lo, *hi), at most 32, one per lane.
/// The round's chunks are cut evenly over the warps (their counts differ by at most one), so
/// queues given equal numbers of warps get equal work.
__device__ __forceinline__ void warp_span(uint64_t start, uint64_t n, uint64_t warps,
                                          uint64_t warp, uint64_t* lo, uint64_t* hi) {
    *lo = start + warp * n / warps;
    *hi = start + (warp + 1) * n / warps;
}

/// How many chunks a warp of the batch file kernel claims when `seen` of `total` chunks were
/// claimed as far as it knows (a relaxed read of the claims' counter, so possibly stale: the
/// fetch_add that follows still hands every chunk out once), `warps` warps claiming: a warp's
/// share of what is left, so claims shrink in the batch's last round (guided self-scheduling:
/// when the chunks run out, no warp holds a large claim its queue must still serve while
/// others idle), at least `least` (1 to 32) and at most 32, one per lane.
__device__ __forceinline__ uint64_t claim_size(uint64_t total, uint64_t seen, uint64_t warps,
                                               uint64_t least) {
    const uint64_t left = seen < total ? total - seen : 0;
    const uint64_t lo = least < 1 ? 1 : (least > 32 ? 32 : least);
    const uint64_t n = left / (warps ? warps : 1);
    return n < lo ? lo : (n > 32 ? 32 : n);
}

__device__ __forceinline__ void fence_gpu_acq_rel() {
    cuda::atomic_thread_fence(cuda::memory_order_acq_rel, cuda::thread_scope_device);
}

/// The slot buffer (GPU pointer) of ticket t.
__device__ __forceinline__ uint8_t* slot_buffer(const queue_desc& q, uint32_t t) {
    return reinterpret_cast<uint8_t*>(q.slot_buffers +
                                      (uint64_t)(t & (q.depth - 1)) * q.slot_buffer_bytes);
}

/// LBAs of `1 << lba_shift` bytes one of q's slot buffers holds (0: the queue has none).
__device__ __forceinline__ uint32_t slot_blocks(const queue_desc& q, uint32_t lba_shift) {
    return q.slot_buffers ? q.slot_buffer_bytes >> lba_shift : 0;
}

/// The request for `blocks` blocks at `slba` of namespace `nsid` whose data is owned ticket t's
/// slot buffer (the bounce paths: the file layer's BOUNCE and RMW pieces, the page cache's
/// BOUNCE fills and write-backs).
__device__ __forceinline__ void slot_req(const queue_desc& q, uint32_t t, uint8_t opcode,
                                         uint32_t nsid, uint64_t slba, uint32_t blocks,
                                         uint32_t lba_shift, io_req* r) {
    r->opcode = opcode;
    r->nsid = nsid;
    r->slba = slba;
    r->nlb_z = (uint16_t)(blocks - 1);
    r->reserved = 0;
    slot_buffer_prps(q, t & (q.depth - 1), blocks << lba_shift, &r->prp1, &r->prp2);
}

/// The request of a piece on owned ticket t. `phase` 0 is a RMW's read, 1 its write.
/// A DIRECT piece whose PRPs cannot be built becomes a Flush (piece_req) and the reason is
/// returned.
__device__ inline status piece_request(const queue_desc& q, const table& t, const piece& p,
                                       bool write, uint32_t phase, uint32_t tk, uint64_t bus,
                                       io_req* r) {
    const uint8_t opc = (write && !(p.kind == GPUNVME_PIECE_RMW && phase == 0)) ? OPC_WRITE
                                                                                 : OPC_READ;
    if (p.kind == GPUNVME_PIECE_DIRECT)
        return piece_req(q, tk, opc, t.nsid, p.lba, p.blocks, bus, p.bytes, r);
    slot_req(q, tk, opc, t.nsid, p.lba, p.blocks, t.lba_shift, r);
    return GPUNVME_OK;
}

/// Waits (bounded) for ticket t's completion without releasing the slot (the thread variant
/// of wait_done_warp): *done gets the slot's done word.
__device__ inline status wait_done_thread(const queue_desc& q, uint32_t t, uint32_t* done) {
    slot_state* slot = slot_of(q, t & (q.depth - 1));
    waiter w(q);
    for (;;) {
        uint32_t d = dev_u32(slot->done).load(cuda::memory_order_acquire);
        if (d) { *done = d; return GPUNVME_OK; }
        status f = queue_failed(q);
        if (f) return f;
        if ((f = try_reap(q))) return f;
        d = dev_u32(slot->done).load(cuda::memory_order_acquire);
        if (d) { *done = d; return GPUNVME_OK; }
        try_publish(q);
        status s = w.tick(q);
        if (s) return fail_queue(q, s);
    }
}

/// Reads (write == false) or writes bytes [start, end) of file f into / out of GPU memory at
/// `ptr` (GPU pointer of byte `start`) / `bus` (its device address, for PRPs): any thread,
/// alone, one command in flight at a time. `scratch`: one LBA of GPU memory for a write's
/// partial LBAs (unused by reads; may be null when the range is LBA-aligned). Returns
/// GPUNVME_OK or why it stopped (*nvme_status: the CQE status field of an NVMe error).
__device__ inline status rw_file_thread(const queue_desc& q, const table& t, const table_file& f,
                                        bool write, uint64_t start, uint64_t end, uint64_t ptr,
                                        uint64_t bus, uint8_t* scratch, uint32_t* nvme_status) {
    if (end <= start) return GPUNVME_OK;
    status s = check_range(f, write, start, end - start);
    if (s) return s;
    const uint32_t max_blocks = blocks_per_command(q, t.lba_shift);
    const uint32_t bounce_blocks = slot_blocks(q, t.lba_shift);
    if (max_blocks == 0) return GPUNVME_INVALID_ARGUMENT;
    const uint32_t lsize = 1u << t.lba_shift;
    uint64_t pos = start;
    uint32_t phase = 0;
    while (pos < end) {
        piece p;
        const uint64_t at = pos - start;
        if ((s = plan_piece(t, f, write, pos, end, ((bus + at) & 3) == 0, max_blocks,
                            bounce_blocks, &p)))
            return s;
        if (p.kind != GPUNVME_PIECE_DIRECT && p.blocks > bounce_blocks)
            return GPUNVME_INVALID_ARGUMENT;  // no slot buffers to bounce through
        if (p.kind == GPUNVME_PIECE_RMW && !scratch) return GPUNVME_INVALID_ARGUMENT;
        uint32_t tk;
        if ((s = reserve_thread(q, &tk))) return s;
        uint8_t* sbuf = slot_buffer(q, tk);
        uint8_t* data = reinterpret_cast<uint8_t*>(ptr + at);
        if (write && p.kind == GPUNVME_PIECE_BOUNCE) {
            copy_bytes(sbuf, data, p.bytes, 0, 1);
        } else if (p.kind == GPUNVME_PIECE_RMW && phase == 1) {
            copy_bytes(sbuf, scratch, lsize, 0, 1);
            copy_bytes(sbuf + p.skip, data, p.bytes, 0, 1);
        }
        io_req r;
        const status bad = piece_request(q, t, p, write, phase, tk, bus + at, &r);
        fill_slot(q, tk, r);  // its release store orders the copies above before the SQE
        if ((s = publish_thread(q, tk))) return s;
        uint32_t done = 0;
        if ((s = wait_done_thread(q, tk, &done))) return s;
        const uint32_t sf = done & 0xffffu;
        if (!sf && !bad) {
            if (!write && p.kind == GPUNVME_PIECE_BOUNCE)
                copy_bytes(data, sbuf + p.skip, p.bytes, 0, 1);
            else if (p.kind == GPUNVME_PIECE_RMW && phase == 0)
                copy_bytes(scratch, sbuf, lsize, 0, 1);
        }
        release_slot(q, tk);  // release: the copies out of sbuf come first
        if (sf) {
            if (nvme_status) *nvme_status = sf;
            return GPUNVME_NVME_ERROR;
        }
        if (bad) return bad;
        if (p.kind == GPUNVME_PIECE_RMW && phase == 0) {
            phase = 1;
        } else {
            phase = 0;
            pos += p.bytes;
        }
    }
    return GPUNVME_OK;
}

/// The same with all 32 lanes of a warp calling together, each lane with its OWN range
/// (active lanes only; file, direction, table and memory may differ per lane, the queue is the
/// warp's): every round each busy lane issues the next command of its range, with one ticket
/// atomic and (usually) one doorbell for the warp, and the bounce copies are done by the whole
/// warp together. Each lane returns its own range's outcome. Needs q.depth >= 32.
__device__ inline status rw_file_warp(const queue_desc& q, const table& t, const table_file* f,
                                      bool write, bool active, uint64_t start, uint64_t end,
                                      uint64_t ptr, uint64_t bus, uint8_t* scratch,
                                      uint32_t* nvme_status) {
    const uint32_t full = 0xffffffffu;
    status mine = GPUNVME_OK;
    uint32_t my_sf = 0;
    uint32_t max_blocks = 0, bounce_blocks = 0, lsize = 0;
    if (active && end <= start) active = false;
    if (active) {
        mine = check_range(*f, write, start, end - start);
        max_blocks = blocks_per_command(q, t.lba_shift);
        bounce_blocks = slot_blocks(q, t.lba_shift);
        lsize = 1u << t.lba_shift;
        if (!mine && max_blocks == 0) mine = GPUNVME_INVALID_ARGUMENT;
    }
    uint64_t pos = start;
    uint32_t phase = 0;
    for (;;) {
        bool busy = active && mine == GPUNVME_OK && pos < end;
        if (!__any_sync(full, busy)) break;
        piece p{};
        const uint64_t at = pos - start;
        if (busy) {
            status s = plan_piece(t, *f, write, pos, end, ((bus + at) & 3) == 0, max_blocks,
                                  bounce_blocks, &p);
            if (!s && p.kind != GPUNVME_PIECE_DIRECT && p.blocks > bounce_blocks)
                s = GPUNVME_INVALID_ARGUMENT;
            if (!s && p.kind == GPUNVME_PIECE_RMW && !scratch) s = GPUNVME_INVALID_ARGUMENT;
            if (s) { mine = s; busy = false; }
        }
        uint32_t tk = 0;
        status s = reserve_warp(q, busy, &tk);
        if (busy && s) { mine = s; busy = false; }
        uint8_t* sbuf = busy ? slot_buffer(q, tk) : nullptr;
        uint8_t* data = reinterpret_cast<uint8_t*>(ptr + at);
        // Bounce in: the warp copies each staging lane's write data into its slot buffer.
        const bool stage = busy && write &&
                           (p.kind == GPUNVME_PIECE_BOUNCE ||
                            (p.kind == GPUNVME_PIECE_RMW && phase == 1));
        uint32_t todo = __ballot_sync(full, stage);
        if (todo) {
            while (todo) {
                const uint32_t j = __ffs(todo) - 1;
                todo &= todo - 1;
                uint8_t* d = reinterpret_cast<uint8_t*>(__shfl_sync(full, (uint64_t)sbuf, j));
                const uint8_t* src =
                    reinterpret_cast<const uint8_t*>(__shfl_sync(full, (uint64_t)data, j));
                const uint32_t kind = __shfl_sync(full, p.kind, j);
                const uint32_t n = __shfl_sync(full, p.bytes, j);
                if (kind == GPUNVME_PIECE_RMW) {
                    const uint8_t* sc =
                        reinterpret_cast<const uint8_t*>(__shfl_sync(full, (uint64_t)scratch, j));
                    const uint32_t ls = __shfl_sync(full, lsize, j);
                    const uint32_t skip = __shfl_sync(full, p.skip, j);
                    copy_bytes(d, sc, ls, lane_id(), 32);
                    __syncwarp();
                    copy_bytes(d + skip, src, n, lane_id(), 32);
                } else {
                    copy_bytes(d, src, n, lane_id(), 32);
                }
                __syncwarp();
            }
            fence_gpu_acq_rel();  // every lane's copies before the owners' SQE release below
            __syncwarp();
        }
        io_req r;
        status bad = GPUNVME_OK;
        if (busy) {
            bad = piece_request(q, t, p, write, phase, tk, bus + at, &r);
            fill_slot(q, tk, r);
        }
        s = publish_warp(q, busy, tk);
        if (busy && s) { mine = s; busy = false; }
        uint32_t done = 0;
        s = wait_done_warp(q, busy, tk, &done);
        if (busy && s) { mine = s; busy = false; }  // no completion: the slot stays owned
        const uint32_t sf = done & 0xffffu;
        const bool ok = busy && !sf && !bad;
        // Bounce out: read data to the caller, a RMW's LBA to its scratch.
        const bool unstage = ok && ((!write && p.kind == GPUNVME_PIECE_BOUNCE) ||
                                    (p.kind == GPUNVME_PIECE_RMW && phase == 0));
        todo = __ballot_sync(full, unstage);
        if (todo) {
            fence_gpu_acq_rel();  // after the owners' acquire of slot.done (wait_done_warp)
            while (todo) {
                const uint32_t j = __ffs(todo) - 1;
                todo &= todo - 1;
                const uint8_t* sb =
                    reinterpret_cast<const uint8_t*>(__shfl_sync(full, (uint64_t)sbuf, j));
                const uint32_t kind = __shfl_sync(full, p.kind, j);
                if (kind == GPUNVME_PIECE_RMW) {
                    uint8_t* sc = reinterpret_cast<uint8_t*>(__shfl_sync(full, (uint64_t)scratch, j));
                    copy_bytes(sc, sb, __shfl_sync(full, lsize, j), lane_id(), 32);
                } else {
                    uint8_t* d = reinterpret_cast<uint8_t*>(__shfl_sync(full, (uint64_t)data, j));
                    copy_bytes(d, sb + __shfl_sync(full, p.skip, j), __shfl_sync(full, p.bytes, j),
                               lane_id(), 32);
                }
            }
            fence_gpu_acq_rel();  // every lane's reads of the slot buffers before the releases
            __syncwarp();
        }
        if (busy) release_slot(q, tk);
        if (busy && !ok) {
            mine = bad ? bad : GPUNVME_NVME_ERROR;
            my_sf = sf;
        } else if (ok) {
            if (p.kind == GPUNVME_PIECE_RMW && phase == 0) {
                phase = 1;
            } else {
                phase = 0;
                pos += p.bytes;
            }
        }
    }
    if (active && nvme_status && mine == GPUNVME_NVME_ERROR) *nvme_status = my_sf;
    return active ? mine : GPUNVME_OK;
}

// ---------------------------------------------------------------------------------------------
// CRC-32C of GPU memory. A buffer is cut into segments; each thread computes its segment's CRC
// (crc32c_bytes), and the CRCs are combined: crc(A || B) = shift(crc(A), |B|) ^ crc(B), where
// shift multiplies by x^(8|B|) modulo the polynomial (zlib's crc32_combine, reflected).

/// a * b modulo the CRC-32C polynomial (reflected representation; x^0 is bit 31).
__device__ __forceinline__ uint32_t crc32c_multmodp(uint32_t a, uint32_t b) {
    if (a == 0) return 0;
    uint32_t m = 1u << 31, p = 0;
    for (;;) {
        if (a & m) {
            p ^= b;
            if ((a & (m - 1)) == 0) break;
        }
        m >>= 1;
        b = (b & 1) ? (b >> 1) ^ GPUNVME_CRC32C_POLY : b >> 1;
    }
    return p;
}

/// x^(8n) modulo the polynomial.
__device__ __forceinline__ uint32_t crc32c_x8n(uint64_t n) {
    uint32_t p = 1u << 31;    // x^0
    uint32_t sq = 1u << 23;   // x^8
    while (n) {
        if (n & 1) p = crc32c_multmodp(sq, p);
        sq = crc32c_multmodp(sq, sq);
        n >>= 1;
    }
    return p;
}

/// The CRC-32C of A || B from crc(A), crc(B) and |B|.
__device__ __forceinline__ uint32_t crc32c_combine(uint32_t crc_a, uint32_t crc_b,
                                                   uint64_t len_b) {
    return crc32c_multmodp(crc32c_x8n(len_b), crc_a) ^ crc_b;
}

/// Fills the 256-entry byte table (for one block: call from all its threads, then sync).
__device__ __forceinline__ void crc32c_table_init(uint32_t* table) {
    for (uint32_t i = threadIdx.x; i < 256; i += blockDim.x) {
        uint32_t c = i;
        for (int k = 0; k < 8; ++k) c = (c & 1) ? (c >> 1) ^ GPUNVME_CRC32C_POLY : c >> 1;
        table[i] = c;
    }
}

/// The CRC-32C (standard: init and final XOR 0xffffffff) of n bytes at p.
__device__ inline uint32_t crc32c_bytes(const uint32_t* table, const uint8_t* p, uint64_t n) {
    uint32_t c = 0xffffffffu;
    uint64_t i = 0;
    // Bytes up to a 16-byte boundary, then 16-byte loads, then the rest.
    for (; i < n && ((uintptr_t)(p + i) & 15); ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
    for (; i + 16 <= n; i += 16) {
        const uint4 v = *reinterpret_cast<const uint4*>(p + i);
        const uint32_t w[4] = {v.x, v.y, v.z, v.w};
        for (int k = 0; k < 4; ++k) {
            uint32_t x = w[k];
            for (int b = 0; b < 4; ++b) {
                c = table[(c ^ x) & 0xff] ^ (c >> 8);
                x >>= 8;
            }
        }
    }
    for (; i < n; ++i) c = table[(c ^ p[i]) & 0xff] ^ (c >> 8);
    return c ^ 0xffffffffu;
}

}  // namespace fs
}  // namespace gpunvme
