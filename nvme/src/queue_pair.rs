//! A queue pair: one submission queue, its completion queue, the command-id table, PRP list
//! pages, submit and reap (NVMe Base 2.0, sections 3.3 and 4.6).
//!
//! `QueuePair` is the engine under both the admin queue and [`crate::IoQueuePair`]; it drives
//! rings whose creation on the controller is someone else's job (AQA/ASQ/ACQ for the admin
//! queue, [`crate::queue_lifecycle`] for I/O queues). Commands are identified by their slot
//! index (the CID); completions are matched by CID and may arrive in any order. At most
//! `depth - 1` commands are in flight, so neither the submission queue nor the completion queue
//! can overflow. Every command has a deadline; an expired one is reported as
//! [`Error::Timeout`] and the queue pair is marked failed, because the controller may still own
//! its CID and buffers.
//!
//! Clocks are read per poll round, never per command: submitting marks a command `Issued`, and
//! the next deadline check (at most one clock read, at most once per check interval, see
//! the `timeout` module) gives every `Issued` command the deadline `now + timeout`. That deadline
//! is never earlier than one counted from the submission, and at most one check interval later;
//! a command is therefore reported no sooner than the timeout after it was submitted and, while
//! the caller keeps polling, no later than the timeout plus two check intervals.
//!
//! Memory shared with the controller is only touched through [`DmaMemory`]'s and
//! `DmaRing`'s copy and atomic accessors: SQEs are copied in before a Release fence and the
//! doorbell write; the CQE dword holding the phase tag is loaded with Acquire before the rest of
//! the entry is read. The rings are `DmaRing` views, checked once to fit their memory, so that
//! an entry access costs one index compare (none for the SQ tail, which the view keeps below
//! the entry count itself). Free CIDs form a list threaded through the CID table, so that a
//! submission finds its slot with one lookup and a completion frees its CID with two stores.

#![forbid(unsafe_code)]

use crate::device::Device;
use crate::dma::{DMA_PAGE_SIZE, DmaMemory, DmaRing, DmaSlice};
use crate::error::{Error, Op};
use crate::prp::{PRP_ENTRIES_PER_LIST, Prp, PrpError};
use crate::queue::CqRing;
use crate::registers::Registers;
use crate::timeout::check_interval;
use nvme_spec::command::prinfo;
use nvme_spec::wire::{
    CQE_CID, CQE_SIZE, CQE_SQ_DWORD, CQE_SQHD, CQE_SQID, CQE_STATUS, CQE_STATUS_DWORD, SQE_SIZE,
};
use nvme_spec::{Command, CqeStatus, NvmOpcode};
use std::sync::Arc;
use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};
use zerocopy::IntoBytes;

/// Bit positions of the 16-bit CQE fields inside the two dwords the reaper loads.
const CID_SHIFT: usize = 8 * (CQE_CID - CQE_STATUS_DWORD);
const STATUS_SHIFT: usize = 8 * (CQE_STATUS - CQE_STATUS_DWORD);
const SQHD_SHIFT: usize = 8 * (CQE_SQHD - CQE_SQ_DWORD);
const SQID_SHIFT: usize = 8 * (CQE_SQID - CQE_SQ_DWORD);

/// How often (in polls that found completions) a busy queue still checks its deadlines.
const BUSY_CHECK_EVERY: u32 = 1024;
/// How often (in polls that found nothing) an idle queue looks at the clock.
const IDLE_CHECK_EVERY: u32 = 16;

/// A CID's state. The two states of a command in flight are the odd values, so that a
/// completion tells them from the rest with one bit test.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
#[repr(u8)]
enum SlotState {
    /// Not in use.
    Free = 0,
    /// Submitted, waiting for its completion; no deadline yet (the next deadline check gives
    /// it one, so that submitting reads no clock).
    Issued = 1,
    /// Reported as timed out or failed; the controller may still complete it.
    Abandoned = 2,
    /// Submitted, waiting for its completion, with a deadline.
    Busy = 3,
}

impl SlotState {
    /// Issued or Busy.
    #[inline(always)]
    fn in_flight(self) -> bool {
        self as u8 & 1 != 0
    }
}

/// Per-CID bookkeeping (the CID table is a flat array of these, indexed by CID).
///
/// What an error message needs of the command ([`Op`]) is kept compact and rebuilt only when
/// an error is reported ([`Slot::op`]): a Read or Write from [`QueuePair::issue_rw`] stores its
/// opcode byte, namespace and LBA, not a 40-byte `Op`.
struct Slot {
    tag: u64,
    /// Starting LBA, for error messages (when `has_lba`).
    lba: u64,
    /// Namespace, for error messages.
    nsid: u32,
    state: SlotState,
    internal: bool,
    /// Index into [`Pins`] of the pin keeping the data buffer alive, or [`NO_PIN`].
    pin: u8,
    /// The NVM opcode of a Read or Write (its name is the opcode's), or [`NAMED`]: the
    /// command's name is in `name`.
    rw_opcode: u8,
    has_lba: bool,
    /// The next free CID while this one is free (the free CIDs are a list through the table).
    next_free: u16,
    /// The command's name when `rw_opcode` is [`NAMED`].
    name: &'static str,
    deadline: Instant,
    /// Keeps the data buffer alive while the controller may access it, when no pin does.
    buf: Option<DmaSlice>,
}

/// [`Slot::rw_opcode`] of a command whose name is in [`Slot::name`].
const NAMED: u8 = u8::MAX;
/// The end of the free list ([`QueuePair::free_head`] when every CID is in use). Never a CID:
/// a queue has at most 65535 entries, so at most 65534 commands in flight.
const NO_CID: u16 = u16::MAX;

impl Slot {
    /// Which command the slot holds, for an error message.
    #[cold]
    fn op(&self) -> Op {
        let name = match self.rw_opcode {
            NAMED => self.name,
            opcode => NvmOpcode(opcode).name().unwrap_or("I/O command"),
        };
        Op {
            name,
            nsid: self.nsid,
            lba: self.has_lba.then_some(self.lba),
        }
    }
}

/// [`Slot::pin`] when no pin is used.
const NO_PIN: u8 = u8::MAX;
/// Buffers a queue pair keeps pinned (see [`QueuePair::issue_rw`] and [`Pins::pin_or_hold`]); a power of two.
const PINS: usize = 4;

/// Buffers pinned for commands submitted with a borrowed buffer, and how many commands in
/// flight (or abandoned) use each. A pin with no users stays until it is replaced or the queue
/// pair is dropped.
struct Pins {
    mems: [Option<Arc<DmaMemory>>; PINS],
    /// Users of each pin, indexed by [`Slot::pin`]: entries from [`PINS`] on are never a
    /// pin's, and [`NO_PIN`]'s absorbs the releases of slots without a pin (see
    /// [`Pins::unpin`]); indexing by a `u8` needs no bounds check.
    users: [u32; 256],
    /// The pin used last (looked at first); below [`PINS`].
    last: usize,
}

impl Default for Pins {
    fn default() -> Self {
        Self {
            mems: Default::default(),
            users: [0; 256],
            last: 0,
        }
    }
}

impl Pins {
    /// Keeps `buf`'s memory alive for the command in `slot` when it is not the buffer pinned
    /// last (which [`QueuePair::issue_rw`] looks at itself): with another pin, a new one, or,
    /// when every pin is in use by other buffers, a clone of the buffer kept in the slot.
    #[cold]
    #[inline(never)]
    fn pin_or_hold(&mut self, slot: &mut Slot, buf: &DmaSlice) {
        match self.pin_slow(&buf.mem) {
            Some(index) => slot.pin = index,
            None => slot.buf = Some(buf.clone()),
        }
    }

    /// Pins `mem` for a command in flight: returns the index of its pin, taking the reference
    /// count only when the buffer is not pinned already. `None` when every pin is in use by
    /// other buffers.
    fn pin_slow(&mut self, mem: &Arc<DmaMemory>) -> Option<u8> {
        let hit = |p: &Option<Arc<DmaMemory>>| p.as_ref().is_some_and(|p| Arc::ptr_eq(p, mem));
        let index = match self.mems.iter().position(hit) {
            Some(i) => i,
            None => {
                let i = self.users[..PINS].iter().position(|&u| u == 0)?;
                self.mems[i] = Some(mem.clone());
                i
            }
        };
        self.last = index;
        self.users[index] += 1;
        Some(index as u8)
    }

    /// Ends what `slot` holds for its buffer once the controller is done with it: a pin's
    /// user, or the buffer clone kept in the slot ([`NO_PIN`]; its release lands in the spare
    /// counter, so that the common case takes no branch).
    #[inline(always)]
    fn unpin(&mut self, slot: &mut Slot) {
        let users = &mut self.users[slot.pin as usize];
        debug_assert!(
            slot.pin == NO_PIN || *users > 0,
            "pin released more than taken"
        );
        *users = users.wrapping_sub(1);
        if slot.pin == NO_PIN {
            slot.buf = None;
        }
    }

    /// Drops the pins no command uses; returns how many were dropped.
    fn unpin_idle(&mut self) -> usize {
        let mut n = 0;
        for (pin, &users) in self.mems.iter_mut().zip(&self.users) {
            if users == 0 && pin.take().is_some() {
                n += 1;
            }
        }
        n
    }
}

/// One finished command, as handed to a reap sink.
pub(crate) struct Reaped {
    /// The caller's tag.
    pub tag: u64,
    /// Whether the driver submitted it for itself (synchronous helpers).
    pub internal: bool,
    /// Dword 0 of the completion, or why the command failed (boxed, so that a success is
    /// two words to hand over, not a whole [`Error`]).
    pub result: Result<u32, Box<Error>>,
}

impl Reaped {
    /// Dword 0 of the completion, or why the command failed.
    pub(crate) fn into_result(self) -> Result<u32, Error> {
        self.result.map_err(|e| *e)
    }
}

/// Host memory for a queue pair the driver drives itself: both rings and the PRP list pages.
pub(crate) struct QueueMemory {
    /// The submission queue ring.
    pub(crate) sq: DmaMemory,
    /// The completion queue ring.
    pub(crate) cq: DmaMemory,
    /// One PRP list page per command slot (or fewer, shared round-robin).
    pub(crate) prp: DmaMemory,
}

impl QueueMemory {
    /// Allocates rings of `depth` entries each and `prp_pages` PRP list pages.
    pub(crate) fn alloc(device: &dyn Device, depth: u16, prp_pages: usize) -> Result<Self, Error> {
        assert!(prp_pages >= 1);
        Ok(Self {
            sq: device.alloc_dma(depth as usize * SQE_SIZE)?,
            cq: device.alloc_dma(depth as usize * CQE_SIZE)?,
            prp: device.alloc_dma(prp_pages * DMA_PAGE_SIZE)?,
        })
    }
}

/// Where a queue pair's doorbells are in BAR0.
#[derive(Clone, Copy, Debug)]
pub(crate) struct Doorbells {
    /// Submission queue tail doorbell.
    pub(crate) sq_tail: usize,
    /// Completion queue head doorbell.
    pub(crate) cq_head: usize,
}

/// The submission/completion queue engine.
pub(crate) struct QueuePair {
    qid: u16,
    device: Arc<dyn Device>,
    sq: DmaRing<SQE_SIZE>,
    cq: DmaRing<CQE_SIZE>,
    prp: DmaMemory,
    prp_pages: usize,
    /// Entries per ring (both rings have as many).
    depth: u32,
    /// Tail value last written to the SQ tail doorbell.
    committed_tail: u32,
    cq_ring: CqRing,
    sq_db: usize,
    cq_db: usize,
    slots: Box<[Slot]>,
    /// The first free CID, or [`NO_CID`]; the rest follow through [`Slot::next_free`].
    free_head: u16,
    pins: Pins,
    in_flight: usize,
    timeout: Duration,
    failed: bool,
    check_every: Duration,
    next_check: Instant,
    polls_since_check: u32,
}

impl QueuePair {
    /// Drives the rings in `mem` (`depth` entries each, already known to the controller or about
    /// to be) through the given doorbells.
    pub(crate) fn new(
        device: Arc<dyn Device>,
        qid: u16,
        depth: u16,
        mem: QueueMemory,
        doorbells: Doorbells,
        timeout: Duration,
    ) -> Self {
        assert!(depth >= 2, "queue depth must be at least 2");
        assert!(
            mem.sq.len() >= depth as usize * SQE_SIZE,
            "SQ memory too small"
        );
        assert!(
            mem.cq.len() >= depth as usize * CQE_SIZE,
            "CQ memory too small"
        );
        let prp_pages = mem.prp.len() / DMA_PAGE_SIZE;
        assert!(prp_pages >= 1, "no PRP list page");
        let depth32 = depth as u32;
        let capacity = depth as usize - 1;
        let now = Instant::now();
        let slots = (0..capacity)
            .map(|cid| Slot {
                tag: 0,
                lba: 0,
                nsid: 0,
                state: SlotState::Free,
                internal: false,
                pin: NO_PIN,
                rw_opcode: NAMED,
                has_lba: false,
                next_free: if cid + 1 < capacity {
                    (cid + 1) as u16
                } else {
                    NO_CID
                },
                name: "",
                deadline: now,
                buf: None,
            })
            .collect();
        Self {
            qid,
            device,
            sq: DmaRing::new(mem.sq, depth32),
            cq: DmaRing::new(mem.cq, depth32),
            prp: mem.prp,
            prp_pages,
            depth: depth32,
            committed_tail: 0,
            cq_ring: CqRing::new(depth32),
            sq_db: doorbells.sq_tail,
            cq_db: doorbells.cq_head,
            slots,
            free_head: 0,
            pins: Pins::default(),
            in_flight: 0,
            timeout,
            failed: false,
            check_every: check_interval(timeout),
            next_check: now,
            polls_since_check: 0,
        }
    }

    /// Commands submitted from now on are reported no sooner than `timeout` after submission
    /// (commands in flight keep the deadline they have).
    pub(crate) fn set_timeout(&mut self, timeout: Duration) {
        self.timeout = timeout;
        self.check_every = check_interval(timeout);
    }

    /// The command timeout.
    pub(crate) fn timeout(&self) -> Duration {
        self.timeout
    }

    /// Queue identifier.
    pub(crate) fn qid(&self) -> u16 {
        self.qid
    }

    /// Entries per ring.
    pub(crate) fn depth(&self) -> u16 {
        self.depth as u16
    }

    /// Most commands in flight at once.
    pub(crate) fn capacity(&self) -> usize {
        self.slots.len()
    }

    /// Commands submitted and not yet reported.
    pub(crate) fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// Whether the queue pair has failed.
    pub(crate) fn is_failed(&self) -> bool {
        self.failed
    }

    /// The submission queue's memory.
    pub(crate) fn sq_memory(&self) -> &DmaMemory {
        self.sq.memory()
    }

    /// The completion queue's memory.
    pub(crate) fn cq_memory(&self) -> &DmaMemory {
        self.cq.memory()
    }

    /// Reserves a CID for a new command.
    pub(crate) fn begin(&mut self) -> Result<u16, Error> {
        if self.failed {
            return Err(self.failed_error());
        }
        let cid = self.free_head;
        let Some(slot) = self.slots.get(cid as usize) else {
            return Err(Self::full_error_of(self.qid, self.slots.len()));
        };
        self.free_head = slot.next_free;
        Ok(cid)
    }

    #[cold]
    fn failed_error(&self) -> Error {
        Error::QueueFailed { qid: self.qid }
    }

    #[cold]
    fn full_error_of(qid: u16, capacity: usize) -> Error {
        Error::QueueFull { qid, capacity }
    }

    /// Gives back a CID reserved by [`QueuePair::begin`] that was not issued.
    pub(crate) fn cancel(&mut self, cid: u16) {
        let slot = &mut self.slots[cid as usize];
        debug_assert_eq!(slot.state, SlotState::Free);
        slot.next_free = self.free_head;
        self.free_head = cid;
    }

    /// Byte offset in the PRP memory and device address of the list page for `cid`.
    fn prp_page(&self, cid: u16) -> (usize, u64) {
        let offset = (cid as usize % self.prp_pages) * DMA_PAGE_SIZE;
        (offset, self.prp.device_address(offset))
    }

    /// Builds the data pointer for `buf`, writing a PRP list into `cid`'s list page if needed.
    ///
    /// The common shapes cost no loop: one page gives PRP1 alone, two pages PRP1 and PRP2; a
    /// longer transfer copies its page addresses into the list page in one go. Page addresses
    /// need no check: [`crate::DmaRegion`] refuses unaligned ones when it is built.
    #[inline]
    pub(crate) fn data_pointer(&self, cid: u16, buf: &DmaSlice) -> Result<Prp, Error> {
        if buf.len == 0 || buf.offset % 4 != 0 {
            return Err(Self::prp_error(buf));
        }
        Self::data_pointer_in(&self.prp, self.prp_pages, cid, buf)
    }

    /// [`QueuePair::data_pointer`] on the queue pair's PRP list memory, so that the hot path
    /// can call it while it holds a slot, for a buffer already known to be non-empty and
    /// dword-aligned. A transfer inside one page (PRP1) or two (PRP1 + PRP2) costs one bounds
    /// check on the buffer's page table; anything else takes the general path.
    #[inline(always)]
    fn data_pointer_in(
        prp: &DmaMemory,
        prp_pages: usize,
        cid: u16,
        buf: &DmaSlice,
    ) -> Result<Prp, Error> {
        debug_assert!(buf.len > 0 && buf.offset % 4 == 0, "checked by the caller");
        let in_page = buf.offset % DMA_PAGE_SIZE;
        let pages = buf.mem.page_addresses();
        let first = buf.offset / DMA_PAGE_SIZE;
        // Bytes left in the first page (1..=4096): no sum that could overflow.
        let room = DMA_PAGE_SIZE - in_page;
        if buf.len <= room {
            if let Some(&page) = pages.get(first) {
                return Ok(Prp {
                    prp1: page + in_page as u64,
                    prp2: 0,
                    list_entries: 0,
                });
            }
        } else if buf.len - room <= DMA_PAGE_SIZE
            && let Some(&[page, next]) = pages.get(first..first + 2)
        {
            return Ok(Prp {
                prp1: page + in_page as u64,
                prp2: next,
                list_entries: 0,
            });
        }
        Self::prp_list(prp, prp_pages, cid, buf)
    }

    /// The general case: PRP1 and, for more than two pages, a list of the pages after the
    /// first in `cid`'s list page. (Also any slice whose range does not fit its buffer, which
    /// `DmaSlice::pages` refuses.)
    #[inline(never)]
    fn prp_list(prp: &DmaMemory, prp_pages: usize, cid: u16, buf: &DmaSlice) -> Result<Prp, Error> {
        let pages = buf.pages();
        let prp1 = pages[0] + (buf.offset % DMA_PAGE_SIZE) as u64;
        if pages.len() <= 2 {
            return Ok(Prp {
                prp1,
                prp2: pages.get(1).copied().unwrap_or(0),
                list_entries: 0,
            });
        }
        if pages.len() > PRP_ENTRIES_PER_LIST + 1 {
            return Err(PrpError::TooLarge { pages: pages.len() }.into());
        }
        let list_offset = (cid as usize % prp_pages) * DMA_PAGE_SIZE;
        prp.write_u64s(list_offset, &pages[1..]);
        Ok(Prp {
            prp1,
            prp2: prp.device_address(list_offset),
            list_entries: pages.len() - 1,
        })
    }

    #[cold]
    fn prp_error(buf: &DmaSlice) -> Error {
        let offset = buf.offset % DMA_PAGE_SIZE;
        if buf.len == 0 {
            PrpError::Empty.into()
        } else {
            PrpError::Unaligned { offset }.into()
        }
    }

    /// Drops the pins no command uses; returns how many were dropped.
    pub(crate) fn unpin_idle(&mut self) -> usize {
        self.pins.unpin_idle()
    }

    /// Reserves a CID and issues a Read or Write (`opcode`) of `buf` on `nsid` at `lba`
    /// (`cdw12`: NLB, blocks - 1, and PRINFO), building the SQE in place in the ring; rings no doorbell;
    /// returns the CID. The hot path: no clock, no allocation, no atomic read-modify-write for
    /// a pinned buffer; the slot is looked up once (the free list's head), and filled only
    /// once nothing can fail any more.
    ///
    /// With `pin`, the queue pair keeps `buf`'s memory alive itself (a pin, or a clone in the
    /// slot when every pin is taken); without, the caller must hand the slot the buffer with
    /// [`QueuePair::hold`] before anything else touches the queue pair.
    ///
    /// The caller has checked the command against its namespace: `buf` is non-empty and
    /// dword-aligned, and `cdw12`'s NLB matches its length.
    #[expect(clippy::too_many_arguments)]
    #[inline(always)]
    pub(crate) fn issue_rw(
        &mut self,
        opcode: NvmOpcode,
        nsid: u32,
        lba: u64,
        cdw12: u32,
        buf: &DmaSlice,
        tag: u64,
        internal: bool,
        pin: bool,
    ) -> Result<u16, Error> {
        if self.failed {
            return Err(self.failed_error());
        }
        let cid = self.free_head;
        let Some(slot) = self.slots.get_mut(cid as usize) else {
            return Err(Self::full_error_of(self.qid, self.slots.len()));
        };
        let prp = Self::data_pointer_in(&self.prp, self.prp_pages, cid, buf)?;
        // The SQE as eight quadwords (NVMe Base 2.0, Figure 88; NVM Command Set 1.0, Figure
        // 34 for Read and Write): CDW0 (opcode, CID) and NSID; CDW2-3 and MPTR 0; PRP1; PRP2;
        // CDW10-11 the SLBA; CDW12 NLB (zero-based) and PRINFO; CDW13 0; CDW14 the initial
        // reference tag (the LBA's low 32 bits) when PRINFO checks it; CDW15 0.
        let reftag = if cdw12 & (prinfo::PRCHK_REF as u32) << prinfo::SHIFT != 0 {
            lba as u32 as u64
        } else {
            0
        };
        let sqe = [
            opcode.0 as u64 | (cid as u64) << 16 | (nsid as u64) << 32,
            0,
            0,
            prp.prp1,
            prp.prp2,
            lba,
            cdw12 as u64,
            reftag,
        ];
        self.sq.push_u64s(&sqe);
        debug_assert_eq!(slot.state, SlotState::Free);
        debug_assert!(slot.buf.is_none(), "a free slot holds no buffer");
        self.free_head = slot.next_free;
        slot.state = SlotState::Issued;
        slot.internal = internal;
        slot.rw_opcode = opcode.0;
        slot.has_lba = true;
        slot.tag = tag;
        slot.nsid = nsid;
        slot.lba = lba;
        slot.pin = NO_PIN;
        if pin {
            // The buffer pinned last, or the slow path (another pin, a new pin, or a clone of
            // the buffer kept in the slot).
            let last = self.pins.last % PINS;
            if self.pins.mems[last]
                .as_ref()
                .is_some_and(|p| Arc::ptr_eq(p, &buf.mem))
            {
                self.pins.users[last] += 1;
                slot.pin = last as u8;
            } else {
                self.pins.pin_or_hold(slot, buf);
            }
        }
        self.in_flight += 1;
        Ok(cid)
    }

    /// Hands slot `cid` (just issued by [`QueuePair::issue_rw`] without `pin`) the buffer that
    /// keeps its data memory alive until the command completes.
    #[inline(always)]
    pub(crate) fn hold(&mut self, cid: u16, buf: DmaSlice) {
        self.slots[cid as usize].buf = Some(buf);
    }

    /// Copies `bytes` (at most one page) into `cid`'s list page and returns its device address;
    /// used for Dataset Management ranges, which need no PRP list.
    pub(crate) fn write_side_page(&self, cid: u16, bytes: &[u8]) -> u64 {
        assert!(bytes.len() <= DMA_PAGE_SIZE);
        let (offset, address) = self.prp_page(cid);
        self.prp.write(offset, bytes);
        address
    }

    /// Issues the command in slot `cid`: copies the SQE in and, if `ring`, rings the
    /// submission queue tail doorbell (see [`QueuePair::ring`]).
    #[expect(clippy::too_many_arguments)]
    pub(crate) fn issue(
        &mut self,
        cid: u16,
        mut cmd: Command,
        op: Op,
        tag: u64,
        internal: bool,
        buf: Option<DmaSlice>,
        ring: bool,
    ) {
        cmd.cdw0.set_cid(cid);
        let index = self.sq.advance();
        self.sq
            .memory()
            .write(index as usize * SQE_SIZE, cmd.as_bytes());
        let slot = &mut self.slots[cid as usize];
        debug_assert_eq!(slot.state, SlotState::Free);
        slot.state = SlotState::Issued;
        slot.tag = tag;
        slot.internal = internal;
        slot.rw_opcode = NAMED;
        slot.name = op.name;
        slot.nsid = op.nsid;
        slot.has_lba = op.lba.is_some();
        slot.lba = op.lba.unwrap_or(0);
        slot.pin = NO_PIN;
        slot.buf = buf;
        self.in_flight += 1;
        if ring {
            self.ring();
        }
    }

    /// Rings the submission queue tail doorbell if commands were queued since the last ring.
    #[inline]
    pub(crate) fn ring(&mut self) {
        let tail = self.sq.tail();
        if tail == self.committed_tail {
            return;
        }
        // Release: the SQEs, PRP lists and data written before must be visible to the
        // controller before it sees the new tail.
        fence(Ordering::Release);
        self.device.write_doorbell(self.sq_db, tail);
        self.committed_tail = tail;
    }

    /// Reaps up to `max` completions, handing each to `sink`, and rings the completion queue
    /// head doorbell once. When the queue is idle (nothing new) and commands are in flight it
    /// also checks deadlines and CSTS at most every few milliseconds, reporting expired commands
    /// as [`Error::Timeout`] and all of them as [`Error::ControllerFatal`] /
    /// [`Error::DeviceGone`] when the controller is dead.
    ///
    /// Returns the number handed to `sink`. A completion the driver cannot attribute marks the
    /// queue failed and returns [`Error::InvalidCompletion`] (after the ones before it were
    /// handed over).
    #[inline]
    pub(crate) fn reap(
        &mut self,
        max: usize,
        mut sink: impl FnMut(Reaped),
    ) -> Result<usize, Error> {
        let mut count = 0;
        let mut garbage = None;
        let limit = max.min(self.slots.len());
        let depth = self.depth;
        // Dword 2 of a completion of this queue's, but for its SQ head: SQID in the top half.
        let own_sqid = (self.qid as u32) << SQID_SHIFT;
        // The ring's head and phase live in registers for the round, the phase as the value of
        // the phase tag's bit in dword 3; stored back once.
        const PHASE_BIT: u32 = 1 << STATUS_SHIFT;
        let cq_depth = self.cq_ring.depth();
        let start = self.cq_ring.head();
        let mut head = start;
        let mut phase = if self.cq_ring.phase() { PHASE_BIT } else { 0 };
        while count < limit {
            // Dword 3 (phase tag, CID, status) is loaded first with Acquire: the rest of the
            // entry, and the data the command moved, are read after the controller's write of
            // it is seen.
            let [dw0, dw2, dw3] = self.cq.load_cqe(head);
            if dw3 & PHASE_BIT != phase {
                break;
            }
            head += 1;
            if head == cq_depth {
                (head, phase) = Self::wrap(phase);
            }
            let cid = (dw3 >> CID_SHIFT) as u16;
            // One compare for SQID and SQ head: with the right SQID the difference is the SQ
            // head alone, which must be below the depth; with a wrong one it is 65536 or more.
            let sq_ok = (dw2 ^ own_sqid) < depth;
            let slot = match self.slots.get_mut(cid as usize) {
                Some(slot) if sq_ok => slot,
                _ => {
                    garbage = Some(Self::garbage(self.qid, depth, cid, dw2));
                    break;
                }
            };
            if slot.state.in_flight() {
                slot.state = SlotState::Free;
                self.pins.unpin(slot);
                // Status Code and Status Code Type (bits 1..=11 of the status field) zero:
                // Successful Completion, whatever CRD, More and DNR say.
                let result = if (dw3 >> (STATUS_SHIFT + 1)) & 0x7ff == 0 {
                    Ok(dw0)
                } else {
                    Err(Box::new(Self::status_error(slot.op(), dw3)))
                };
                let reaped = Reaped {
                    tag: slot.tag,
                    internal: slot.internal,
                    result,
                };
                slot.next_free = self.free_head;
                self.free_head = cid;
                count += 1;
                sink(reaped);
            } else if slot.state == SlotState::Abandoned {
                // Late completion of a command already reported (timed out): the controller is
                // done with its buffer now.
                slot.state = SlotState::Free;
                self.pins.unpin(slot);
                slot.next_free = self.free_head;
                self.free_head = cid;
            } else {
                garbage = Some((cid, (dw2 >> SQID_SHIFT) as u16, "command id not in flight"));
                break;
            }
        }
        self.cq_ring.set_position(head, phase != 0);
        self.in_flight -= count;
        // Every entry consumed in a round but a last, garbage one completes a distinct command
        // in flight or abandoned (at most `depth - 1`), so without garbage the head moved if
        // and only if something was consumed.
        if head != start || garbage.is_some() {
            self.device.write_doorbell(self.cq_db, head);
        }
        if let Some((cid, sqid, reason)) = garbage {
            self.failed = true;
            return Err(Error::InvalidCompletion {
                qid: self.qid,
                cid,
                sqid,
                reason,
            });
        }
        if self.in_flight > 0 && count < limit {
            self.polls_since_check += 1;
            let every = if count == 0 {
                IDLE_CHECK_EVERY
            } else {
                BUSY_CHECK_EVERY
            };
            if self.polls_since_check >= every {
                self.polls_since_check = 0;
                count += self.check_deadlines(limit - count, &mut sink);
            }
        }
        Ok(count)
    }

    /// The head and phase after the head wrapped: entry 0 and the other phase. Out of line, so
    /// that the common case is a compare and a branch not taken.
    #[cold]
    #[inline(never)]
    fn wrap(phase: u32) -> (u32, u32) {
        (0, phase ^ (1 << STATUS_SHIFT))
    }

    /// The CID, SQID and reason of a completion that cannot be attributed (one of its fields
    /// is wrong).
    #[cold]
    fn garbage(qid: u16, depth: u32, cid: u16, dw2: u32) -> (u16, u16, &'static str) {
        let (sqhd, sqid) = ((dw2 >> SQHD_SHIFT) as u16, (dw2 >> SQID_SHIFT) as u16);
        (cid, sqid, Self::garbage_reason(qid, depth, sqid, sqhd))
    }

    /// Why a completion with these fields cannot be attributed (one of them is wrong).
    #[cold]
    fn garbage_reason(qid: u16, depth: u32, sqid: u16, sqhd: u16) -> &'static str {
        if sqid != qid {
            "wrong submission queue id"
        } else if sqhd as u32 >= depth {
            "SQ head pointer beyond the queue"
        } else {
            "command id out of range"
        }
    }

    /// The error for a completion whose dword 3 carries a status other than success.
    #[cold]
    fn status_error(op: Op, dw3: u32) -> Error {
        Error::Nvme {
            op,
            status: CqeStatus::from((dw3 >> STATUS_SHIFT) as u16).status(),
        }
    }

    /// Reports expired commands (and all commands, if the controller is dead). Runs at most
    /// once per check interval.
    #[cold]
    fn check_deadlines(&mut self, max: usize, sink: &mut dyn FnMut(Reaped)) -> usize {
        let now = Instant::now();
        if now < self.next_check {
            return 0;
        }
        self.next_check = now + self.check_every;
        let fatal = Registers::new(self.device.registers()).check_fatal().err();
        let mut count = 0;
        for (cid, slot) in self.slots.iter_mut().enumerate() {
            if count == max {
                break;
            }
            if !slot.state.in_flight() {
                continue;
            }
            let error = match &fatal {
                Some(Error::DeviceGone) => Error::DeviceGone,
                Some(Error::ControllerFatal { csts }) => Error::ControllerFatal { csts: *csts },
                _ if slot.state == SlotState::Issued => {
                    // Issued since the last check, so at or before `now`: a deadline counted
                    // from here is never earlier than one counted from the submission.
                    slot.deadline = now + self.timeout;
                    slot.state = SlotState::Busy;
                    continue;
                }
                _ if now >= slot.deadline => Error::Timeout {
                    qid: self.qid,
                    cid: cid as u16,
                    op: slot.op(),
                    timeout: self.timeout,
                },
                _ => continue,
            };
            slot.state = SlotState::Abandoned;
            self.failed = true;
            self.in_flight -= 1;
            count += 1;
            sink(Reaped {
                tag: slot.tag,
                internal: slot.internal,
                result: Err(Box::new(error)),
            });
        }
        if count > 0 {
            tracing::warn!(
                qid = self.qid,
                count,
                "commands abandoned (timeout or dead controller)"
            );
        }
        count
    }
}

impl std::fmt::Debug for QueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("QueuePair")
            .field("qid", &self.qid)
            .field("depth", &self.depth)
            .field("in_flight", &self.in_flight)
            .field("failed", &self.failed)
            .finish()
    }
}
