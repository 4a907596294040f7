// gpunvme_cache_fill.cuh — a part of gpunvme_cache.cuh (include that header, not this one):
// replacement and fills: the data paths of a page's commands (direct and BOUNCE), page_io,
// write_back, the clock search (find_frame), fill_page and its out-of-line call, and a page
// waiter's bound. Included by gpunvme_cache.cuh after the layout and the parts before it; the
// protocol, fence discipline and waiting rules it implements are described there.
#pragma once

#ifndef GPUNVME_CACHE_CUH
#error "gpunvme_cache_fill.cuh is a part of gpunvme_cache.cuh: include gpunvme_cache.cuh"
#endif

namespace gpunvme {
namespace cache {

// ---------------------------------------------------------------------------------------------
// Replacement and fills.

/// Whether a command that ended with status `s` may still be in flight and move data to or
/// from its frame later: anything but a completion or a refusal before submission (review M3),
/// and never on the BOUNCE data path, where commands reach only slot buffers.
__device__ __forceinline__ bool late_dma_possible(const cache_desc& c, status s) {
    return !(c.flags & GPUNVME_CF_BOUNCE) && s != GPUNVME_OK && s != GPUNVME_NVME_ERROR &&
           s != GPUNVME_INVALID_ARGUMENT;
}

/// The part of page `page` of range `r` that exists: bytes [*pos, *end) of the range (the
/// whole page, or the range's tail).
__device__ __forceinline__ void page_span(const cache_desc& c, const range_desc& r,
                                          uint64_t page, uint64_t* pos, uint64_t* end) {
    *pos = page << c.page_shift;
    const uint64_t e = *pos + (1ull << c.page_shift);
    *end = e < r.bytes ? e : r.bytes;
}

/// LBAs per command through queue q's slot buffers (the BOUNCE data path): what one slot
/// buffer holds, at most a command's; 0 when the queue has none.
__device__ __forceinline__ uint32_t bounce_blocks(const queue_desc& q, uint32_t lba_shift) {
    const uint32_t per = blocks_per_command(q, lba_shift);
    const uint32_t fit = fs::slot_blocks(q, lba_shift);
    return fit < per ? fit : per;
}

/// rw_thread for the BOUNCE data path (frames the controller cannot reach: transports whose
/// GPU memory is fixed at set-up): `blocks` LBAs from `slba` move through the slot buffer of
/// each command's ticket, copied from `data` (GPU memory) before a write's submission and to
/// it after a read's completion, one command in flight at a time (the thread holds one
/// ticket). *cmds counts the commands. Fence discipline (gpunvme_file.cuh's bounce in and out,
/// for one thread): copies -> fill_slot's st.release of the ticket -> publication; and the
/// completion's ld.acquire (wait_done_thread) -> copies -> release_slot's st.release, so no
/// copy reads the slot buffer after its next owner may refill it. A command that does not end
/// (a timeout, an abort) moves data to or from the slot buffer, never the frame. Out of line:
/// one copy in the module (frames_rw calls it for a namespace and for each volume member).
__device__ GPUNVME_NOINLINE inline status rw_thread_bounce(const queue_desc& q, uint8_t opcode,
                                                         uint32_t nsid, uint32_t lba_shift,
                                                         uint64_t slba, uint64_t blocks,
                                                         uint8_t* data, uint32_t* nvme_status,
                                                         uint64_t* cmds) {
    if (blocks == 0 || lba_shift < 9 || lba_shift > 12) return GPUNVME_INVALID_ARGUMENT;
    const uint32_t per = bounce_blocks(q, lba_shift);
    if (per == 0) return GPUNVME_INVALID_ARGUMENT;  // no slot buffers to bounce through
    for (uint64_t done = 0; done < blocks;) {
        const uint32_t n = (uint32_t)(blocks - done < per ? blocks - done : per);
        const uint32_t bytes = n << lba_shift;
        uint8_t* at = data + (done << lba_shift);
        uint32_t t;
        status s = reserve_thread(q, &t);
        if (s) return s;
        uint8_t* sbuf = fs::slot_buffer(q, t);
        if (opcode == OPC_WRITE) copy_bytes(sbuf, at, bytes, 0, 1);
        io_req r;
        fs::slot_req(q, t, opcode, nsid, slba + done, n, lba_shift, &r);
        fill_slot(q, t, r);  // its release orders the copies above before the SQE
        ++*cmds;
        if ((s = publish_thread(q, t))) return s;
        uint32_t word = 0;
        if ((s = fs::wait_done_thread(q, t, &word))) return s;
        const uint32_t sf = word & 0xffffu;
        if (!sf && opcode == OPC_READ) copy_bytes(at, sbuf, bytes, 0, 1);
        release_slot(q, t);  // release: the copies out of sbuf come first
        if (sf) {
            if (nvme_status) *nvme_status = sf;
            return GPUNVME_NVME_ERROR;
        }
        done += n;
    }
    return GPUNVME_OK;
}

/// Moves `blocks` LBAs from `lba` (of namespace `nsid`; on a volume, volume LBAs) to or from
/// the frames' bytes from `frame_off` on, on queue `q` (rw_thread: one command per maximum
/// transfer; on the BOUNCE data path, rw_thread_bounce: one per slot buffer). On a volume
/// (c.volume) the run is cut at stripe units and each piece goes to the member that holds it:
/// that member's namespace and LBA, the queue in the same place among its queues as `q` among
/// the first member's (the warp's lane of queues), and the frames at that member's device
/// address. *cmds counts the commands.
/// Not inlined (as fill_page and write_back): the miss path is one copy in the module, so the
/// kernels' PTX stays small enough for a fresh machine's driver to JIT-compile quickly (inlined
/// into every acquire variant it multiplied the PTX); a call costs nothing beside a command.
__device__ GPUNVME_NOINLINE inline status frames_rw(const cache_desc& c, const queue_desc& q,
                                                uint8_t opcode, uint32_t nsid, uint32_t lba_shift,
                                                uint64_t lba, uint64_t blocks, uint64_t frame_off,
                                                uint32_t* sf, uint64_t* cmds) {
    const bool bounce = (c.flags & GPUNVME_CF_BOUNCE) != 0;
    uint8_t* frames = reinterpret_cast<uint8_t*>(c.frames);
    const uint32_t per_cmd = blocks_per_command(q, lba_shift);
    if (per_cmd == 0) return GPUNVME_INVALID_ARGUMENT;
    if (!c.volume) {
        if (bounce)
            return rw_thread_bounce(q, opcode, nsid, lba_shift, lba, blocks, frames + frame_off,
                                    sf, cmds);
        *cmds += (blocks + per_cmd - 1) / per_cmd;
        return rw_thread(q, opcode, nsid, lba_shift, lba, blocks, c.frames_bus + frame_off, sf);
    }
    const volume_desc& v = *reinterpret_cast<const volume_desc*>(c.volume);
    if (v.stripe_lbas == 0 || v.nmembers == 0 || v.nmembers > GPUNVME_VOLUME_MAX_MEMBERS ||
        v.queues_per_member == 0 || (uint64_t)v.nmembers * v.queues_per_member > c.nqueues)
        return GPUNVME_INVALID_ARGUMENT;
    // q's place among the cache's queues (queue_for's choice); another queue: the first lane.
    const uint64_t at = (reinterpret_cast<uint64_t>(&q) - c.queues) / sizeof(queue_desc);
    const uint32_t lane = at < c.nqueues ? (uint32_t)(at % v.queues_per_member) : 0;
    const queue_desc* all = reinterpret_cast<const queue_desc*>(c.queues);
    for (uint64_t done = 0; done < blocks;) {
        const uint64_t vlba = lba + done;
        const uint64_t unit = vlba / v.stripe_lbas, within = vlba % v.stripe_lbas;
        uint64_t n = v.stripe_lbas - within;
        if (n > blocks - done) n = blocks - done;
        const uint32_t m = (uint32_t)(unit % v.nmembers);
        const uint64_t mlba = v.label_lbas + (unit / v.nmembers) * v.stripe_lbas + within;
        const queue_desc& mq = all[m * v.queues_per_member + lane];
        const uint64_t off = frame_off + (done << lba_shift);
        status s;
        if (bounce) {
            s = rw_thread_bounce(mq, opcode, v.nsid[m], lba_shift, mlba, n, frames + off, sf,
                                 cmds);
        } else {
            const uint32_t mper = blocks_per_command(mq, lba_shift);
            if (mper == 0) return GPUNVME_INVALID_ARGUMENT;
            *cmds += (n + mper - 1) / mper;
            s = rw_thread(mq, opcode, v.nsid[m], lba_shift, mlba, n, v.frames_bus[m] + off, sf);
        }
        if (s) return s;
        done += n;
    }
    return GPUNVME_OK;
}

/// page_io for a blockfs file range: the page's LBAs found through the file's extent table
/// (GPU memory, pinned by the host for the cache's lifetime), one command per run of
/// contiguous LBAs (a page inside one extent: one command). The last LBA of a file may hold
/// bytes past its end; the caller zeroes them in the frame after a read.
__device__ inline status file_page_io(const cache_desc& c, const queue_desc& q,
                                      const range_desc& r, uint64_t page, uint32_t f,
                                      uint8_t opcode, uint32_t* sf, uint64_t* bytes) {
    fs::table t;
    const fs::table_file* tf = nullptr;
    status s = fs::table_open(reinterpret_cast<const void*>(r.table), &t);
    if (!s) s = fs::table_file_at(t, r.file, &tf);
    if (s) return s;
    if (t.lba_shift != r.lba_shift || t.nsid != r.nsid) return GPUNVME_INVALID_ARGUMENT;
    const uint32_t per_cmd = blocks_per_command(q, r.lba_shift);
    if (per_cmd == 0) return GPUNVME_INVALID_ARGUMENT;
    uint64_t pos, end;
    page_span(c, r, page, &pos, &end);
    const uint64_t frame_off = (uint64_t)f << c.page_shift;
    uint64_t cmds = 0, moved = 0;
    for (uint64_t off = pos; off < end && !s;) {
        // r.bytes is at most the file's readable (or, writable, allocated) length: the
        // lookup's limit. A hole is a corrupt table: refused, like the file reads refuse it.
        uint64_t lba = 0, contig = 0;
        if (!fs::lookup(t, *tf, off, r.bytes, &lba, &contig)) {
            s = GPUNVME_OUT_OF_EXTENT;
            break;
        }
        uint64_t n = (end - off + (1ull << r.lba_shift) - 1) >> r.lba_shift;
        if (n > contig) n = contig;
        if (n > per_cmd) n = per_cmd;
        s = frames_rw(c, q, opcode, r.nsid, r.lba_shift, lba, n, frame_off + (off - pos), sf,
                      &cmds);
        moved += n << r.lba_shift;
        off += n << r.lba_shift;
    }
    count(opcode == OPC_READ ? stats_of(c)->read_cmds : stats_of(c)->write_cmds, cmds);
    *bytes = moved;
    return s;
}

/// Reads (OPC_READ) or writes (OPC_WRITE) page `page` of range `r` between the device and
/// frame f: the whole page, or the range's tail (bytes of the frame past the range's end are
/// never written to the device; after a read they are zero). *bytes gets the bytes moved.
__device__ inline status page_io(const cache_desc& c, const queue_desc& q, const range_desc& r,
                                 uint64_t page, uint32_t f, uint8_t opcode, uint32_t* sf,
                                 uint64_t* bytes) {
    status s;
    if (r.flags & GPUNVME_RF_FILE) {
        s = file_page_io(c, q, r, page, f, opcode, sf, bytes);
    } else {
        const uint32_t shift = c.page_shift - r.lba_shift;
        const uint64_t first = page << shift;
        const uint64_t range_blocks = r.bytes >> r.lba_shift;
        uint64_t blocks = range_blocks - first;
        if (blocks > (1ull << shift)) blocks = 1ull << shift;
        uint64_t cmds = 0;
        *bytes = blocks << r.lba_shift;
        s = frames_rw(c, q, opcode, r.nsid, r.lba_shift, r.first_lba + first, blocks,
                      (uint64_t)f << c.page_shift, sf, &cmds);
        count(opcode == OPC_READ ? stats_of(c)->read_cmds : stats_of(c)->write_cmds, cmds);
    }
    if (s == GPUNVME_OK && opcode == OPC_READ) {
        // The range's end inside the page: the bytes after it are zero, not what the last LBA
        // (or the frame's previous page) held. Plain stores after the completion was seen
        // (acquire), published with the page by transition 3's release.
        uint64_t pos, end;
        page_span(c, r, page, &pos, &end);
        uint8_t* d = frame_data(c, f);
        uint64_t i = end - pos;
        const uint64_t size = 1ull << c.page_shift;
        for (; i < size && (i & 7); ++i) d[i] = 0;
        for (; i < size; i += 8) *reinterpret_cast<uint64_t*>(d + i) = 0;
    }
    return s;
}

/// Writes back the VALID|BUSY page in frame f (its owner, which the caller has locked): the
/// write, then on success clears BUSY only (transition 10; the caller may try 11 first), on
/// failure makes the page DIRTY again and not BUSY (12), records the failure, and quarantines
/// the frame when the write may still be in flight (the frame keeps the page, which stays
/// served and dirty). Returns the write's status.
__device__ GPUNVME_NOINLINE inline status write_back(const cache_desc& c, const queue_desc& q,
                                                 uint32_t owner, uint64_t page, uint32_t f,
                                                 page_entry* e) {
    cache_stats* k = stats_of(c);
    uint32_t sf = 0;
    uint64_t bytes = 0;
    const status w = page_io(c, q, range_of(c, owner), page, f, OPC_WRITE, &sf, &bytes);
    if (w == GPUNVME_OK) {
        count(k->writebacks, 1);
        count(k->bytes_written, bytes);
        return w;
    }
    uint64_t cur = word_of(e).load(cuda::memory_order_relaxed);
    while (!word_of(e).compare_exchange_weak(cur, (cur | GPUNVME_PS_DIRTY) & ~(uint64_t)GPUNVME_PS_BUSY,
                                             cuda::memory_order_relaxed)) {
    }
    count(k->errors, 1);
    record_failure(c, w, sf, owner, page);
    if (late_dma_possible(c, w)) {
        dev_u32(frame_of(c, f)->flags).fetch_or(GPUNVME_FS_QUARANTINED, cuda::memory_order_relaxed);
        dev_u32(state_of(c)->quarantined).fetch_add(1u, cuda::memory_order_relaxed);
    }
    return w;
}

/// Finds a frame for a fill and returns it LOCKED (*frame), evicting its clean, unreferenced
/// page (a dirty one is written back first, on the caller's queue); bounded by `deadline` (%globaltimer ns) and the host's abort word
/// (GPUNVME_CACHE_FULL, ABORTED). At least GPUNVME_ABORT_POLL steps are tried.
__device__ inline status find_frame(const cache_desc& c, const queue_desc& q, uint32_t* frame,
                                    uint64_t* evictions, uint64_t deadline) {
    cache_state* st = state_of(c);
    cuda::atomic_ref<uint64_t, cuda::thread_scope_device> hand(st->hand);
    const uint64_t n = c.nframes;
    uint32_t sleep_ns = 32;
    for (uint64_t step = 1;; ++step) {
        const uint64_t f = hand.fetch_add(1, cuda::memory_order_relaxed) % n;
        frame_state* fs = frame_of(c, f);
        uint32_t fl = dev_u32(fs->flags).load(cuda::memory_order_relaxed);
        if (!(fl & (GPUNVME_FS_LOCKED | GPUNVME_FS_QUARANTINED))) {
            if (fl & GPUNVME_FS_REF) {
                // Second chance: used since the hand last passed.
                dev_u32(fs->flags).fetch_and(~GPUNVME_FS_REF, cuda::memory_order_relaxed);
            } else if (dev_u32(fs->flags).compare_exchange_strong(
                           fl, fl | GPUNVME_FS_LOCKED, cuda::memory_order_acquire,
                           cuda::memory_order_relaxed)) {
                // Ours: the owner fields are stable until we unlock.
                const uint32_t owner = fs->range;
                if (owner == GPUNVME_FRAME_EMPTY) {
                    *frame = (uint32_t)f;
                    return GPUNVME_OK;
                }
                if (owner < c.nranges && fs->page < range_of(c, owner).npages) {
                    page_entry* v = entry_of(range_of(c, owner), fs->page);
                    const uint64_t in_f = frame_bits((uint32_t)f);
                    // Transition 8: only a VALID page nobody holds or waits for.
                    uint64_t expected = GPUNVME_PS_VALID | in_f;
                    if (word_of(v).compare_exchange_strong(expected, 0ull,
                                                           cuda::memory_order_acq_rel,
                                                           cuda::memory_order_relaxed)) {
                        ++*evictions;
                        *frame = (uint32_t)f;
                        return GPUNVME_OK;
                    }
                    // Transition 9: a dirty page nobody holds is written back first (the
                    // acquire orders the writers' stores, published by their release of
                    // DIRTY, before the write's DMA). Readers and writers may come meanwhile:
                    // VALID stays set.
                    expected = GPUNVME_PS_VALID | GPUNVME_PS_DIRTY | in_f;
                    if (word_of(v).compare_exchange_strong(
                            expected, GPUNVME_PS_VALID | GPUNVME_PS_BUSY | in_f,
                            cuda::memory_order_acquire, cuda::memory_order_relaxed)) {
                        if (write_back(c, q, owner, fs->page, (uint32_t)f, v) == GPUNVME_OK) {
                            // Transition 11, or 10 when someone came meanwhile.
                            expected = GPUNVME_PS_VALID | GPUNVME_PS_BUSY | in_f;
                            if (word_of(v).compare_exchange_strong(
                                    expected, 0ull, cuda::memory_order_acq_rel,
                                    cuda::memory_order_relaxed)) {
                                ++*evictions;
                                *frame = (uint32_t)f;
                                return GPUNVME_OK;
                            }
                            word_of(v).fetch_sub(GPUNVME_PS_BUSY, cuda::memory_order_release);
                        }
                        fl = dev_u32(fs->flags).load(cuda::memory_order_relaxed) &
                             ~GPUNVME_FS_LOCKED;  // QUARANTINED, when write_back set it
                    }
                }
                dev_u32(fs->flags).store(fl, cuda::memory_order_release);
            }
        }
        if (step % GPUNVME_ABORT_POLL == 0) {
            const uint64_t now = now_ns();
            if (host_aborted(q, now)) return GPUNVME_ABORTED;
            if (now > deadline ||
                dev_u32(st->quarantined).load(cuda::memory_order_relaxed) >= n)
                return GPUNVME_CACHE_FULL;
        }
        if (step >= 2 * n) {
            // A whole sweep found nothing: every frame is held, locked or just used. Back
            // off so that holders run.
            __nanosleep(sleep_ns);
            if (sleep_ns < 4096) sleep_ns <<= 1;
        }
    }
}

/// What fill_page returns when it gave the fill back (`give_back`): no frame was free by the
/// deadline; the page is no longer BUSY and its holders keep their references. Never a
/// status any public call returns.
#define GPUNVME_CACHE_FILL_GIVEN_BACK (-1)

/// The fill of page `page` of range `range` by the thread that owns it (BUSY): a frame (looked
/// for until `deadline`), the read, then transition 3 (VALID) or 4 (ERROR with the status).
/// Returns the outcome; on success *frame holds the page. With `give_back`, a fill that
/// finds no frame drops BUSY instead of failing the page (GPUNVME_CACHE_FILL_GIVEN_BACK), so
/// that a warp can release what it holds and retry (array::load).
__device__ GPUNVME_NOINLINE inline status fill_page(const cache_desc& c, const queue_desc& q,
                                                uint32_t range, uint64_t page, page_entry* e,
                                                uint32_t* frame, uint64_t deadline,
                                                bool give_back = false) {
    const range_desc& r = range_of(c, range);
    cache_stats* k = stats_of(c);
    uint64_t evictions = 0;
    uint32_t sf = 0, f = 0;
    // A failed queue takes no command: fail before taking (and quarantining) a frame.
    status s = queue_failed(q);
    if (!s) s = find_frame(c, q, &f, &evictions, deadline);
    count(k->evictions, evictions);
    if (s == GPUNVME_CACHE_FULL && give_back) {
        word_of(e).fetch_sub(GPUNVME_PS_BUSY, cuda::memory_order_relaxed);
        return GPUNVME_CACHE_FILL_GIVEN_BACK;
    }
    if (!s) {
        frame_state* fs = frame_of(c, f);
        fs->range = range;
        fs->page = page;
        uint64_t bytes = 0;
        s = page_io(c, q, r, page, f, OPC_READ, &sf, &bytes);
        if (!s) {
            count(k->misses, 1);
            count(k->bytes_read, bytes);
            // Transition 3 (the frame bits were 0: the add sets them); then unlock with the
            // clock bit set (the new page's second chance).
            word_of(e).fetch_add(GPUNVME_PS_VALID - GPUNVME_PS_BUSY + frame_bits(f),
                                 cuda::memory_order_release);
            dev_u32(fs->flags).store(GPUNVME_FS_REF, cuda::memory_order_release);
            *frame = f;
            return GPUNVME_OK;
        }
        // The frame holds no page. After a timeout, an abort or a failed queue the command may
        // still be in flight and write the frame later (review M3): never reuse it.
        fs->range = GPUNVME_FRAME_EMPTY;
        fs->page = 0;
        if (!late_dma_possible(c, s)) {
            dev_u32(fs->flags).store(0u, cuda::memory_order_release);
        } else {
            dev_u32(fs->flags).store(GPUNVME_FS_QUARANTINED, cuda::memory_order_release);
            dev_u32(state_of(c)->quarantined).fetch_add(1u, cuda::memory_order_relaxed);
        }
    }
    count(s == GPUNVME_CACHE_FULL ? k->full : k->errors, 1);
    record_failure(c, s, sf, range, page);
    // Transition 4 (wrapping arithmetic: BUSY is set, ERROR and the status bits are clear, so
    // nothing borrows from or carries into the frame bits, which are 0).
    const uint64_t code = (uint64_t)s & 15u;
    word_of(e).fetch_add((uint64_t)GPUNVME_PS_ERROR + (code << GPUNVME_PS_STATUS_SHIFT) -
                             (uint64_t)GPUNVME_PS_BUSY,
                         cuda::memory_order_release);
    return s;
}

/// A device variable of the header: inline where the compilation allows it (separate
/// compilation, the host build), else one definition per module.
#if defined(GPUNVME_HOST_BUILD) || defined(__CUDACC_RDC__)
#define GPUNVME_PTR_VAR inline __device__
#else
// Whole-program compilation allows no inline device variable, and a static one gets a name
// that depends on the build path (the committed PTX must not): one module, one definition.
#define GPUNVME_PTR_VAR __device__
#endif

/// fill_page as the access paths call it: through a pointer the compiler cannot see through,
/// so that the call follows the ABI (the fill saves the registers it takes, on the miss path).
/// Called directly, ptxas allocated the caller and the fill (and the queue code below it)
/// together, and as they take every register a __launch_bounds__(256, 2) kernel has (128),
/// the values the caller kept across the call lived in local memory on the hit path too (the
/// profile: benches/results/history.md). Called through this pointer the fill follows the ABI and
/// saves what it uses, on the miss path. Volatile, so that the pointer is not folded back into a
/// direct call.
GPUNVME_PTR_VAR status (*volatile fill_page_abi)(const cache_desc&, const queue_desc&,
                                                   uint32_t, uint64_t, page_entry*, uint32_t*,
                                                   uint64_t, bool) = fill_page;

/// A page waiter's bound: twice the queue's, so that the filler's own bounded outcome (an
/// ERROR page with TIMEOUT or QUEUE_FAILED) normally reaches the waiter first.
__device__ __forceinline__ waiter page_waiter(const queue_desc& q) {
    waiter w(q);
    w.deadline += q.timeout_ns;
    return w;
}

}  // namespace cache
}  // namespace gpunvme
