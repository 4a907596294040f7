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
//! Memory shared with the controller is only touched through [`DmaMemory`]'s copy and atomic
//! accessors: SQEs are copied in before a Release fence and the doorbell write; the CQE dword
//! holding the phase tag is loaded with Acquire before the rest of the entry is read.

#![forbid(unsafe_code)]

use crate::device::Device;
use crate::dma::{DMA_PAGE_SIZE, DmaMemory, DmaSlice};
use crate::error::{Error, Op};
use crate::prp::{Prp, build_prp};
use crate::queue::{CqRing, SqRing};
use crate::registers::Registers;
use crate::timeout::check_interval;
use nvme_spec::wire::{
    CQE_CID, CQE_DW0, CQE_SIZE, CQE_SQ_DWORD, CQE_SQHD, CQE_SQID, CQE_STATUS, CQE_STATUS_DWORD,
    SQE_SIZE,
};
use nvme_spec::{Command, CqeStatus};
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

#[derive(Clone, Copy, Debug, PartialEq, Eq)]
enum SlotState {
    /// Not in use.
    Free,
    /// Submitted, waiting for its completion; no deadline yet (the next deadline check gives
    /// it one, so that submitting reads no clock).
    Issued,
    /// Submitted, waiting for its completion, with a deadline.
    Busy,
    /// Reported as timed out or failed; the controller may still complete it.
    Abandoned,
}

/// Per-CID bookkeeping.
struct Slot {
    state: SlotState,
    tag: u64,
    internal: bool,
    deadline: Instant,
    op: Op,
    /// Keeps the data buffer alive while the controller may access it.
    buf: Option<DmaSlice>,
}

/// One finished command, as handed to a reap sink.
pub(crate) struct Reaped {
    /// The caller's tag.
    pub tag: u64,
    /// Whether the driver submitted it for itself (synchronous helpers).
    pub internal: bool,
    /// Dword 0 of the completion, or why the command failed.
    pub result: Result<u32, Error>,
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
    sq: DmaMemory,
    cq: DmaMemory,
    prp: DmaMemory,
    prp_pages: usize,
    sq_ring: SqRing,
    /// Tail value last written to the SQ tail doorbell.
    committed_tail: u32,
    cq_ring: CqRing,
    sq_db: usize,
    cq_db: usize,
    slots: Box<[Slot]>,
    free: Vec<u16>,
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
            .map(|_| Slot {
                state: SlotState::Free,
                tag: 0,
                internal: false,
                deadline: now,
                op: Op::admin(""),
                buf: None,
            })
            .collect();
        let free = (0..capacity as u16).rev().collect();
        Self {
            qid,
            device,
            sq: mem.sq,
            cq: mem.cq,
            prp: mem.prp,
            prp_pages,
            sq_ring: SqRing::new(depth32),
            committed_tail: 0,
            cq_ring: CqRing::new(depth32),
            sq_db: doorbells.sq_tail,
            cq_db: doorbells.cq_head,
            slots,
            free,
            in_flight: 0,
            timeout,
            failed: false,
            check_every: check_interval(timeout),
            next_check: now,
            polls_since_check: 0,
        }
    }

    /// Queue identifier.
    pub(crate) fn qid(&self) -> u16 {
        self.qid
    }

    /// Entries per ring.
    pub(crate) fn depth(&self) -> u16 {
        self.sq_ring.depth() as u16
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
        &self.sq
    }

    /// The completion queue's memory.
    pub(crate) fn cq_memory(&self) -> &DmaMemory {
        &self.cq
    }

    /// Reserves a CID for a new command.
    pub(crate) fn begin(&mut self) -> Result<u16, Error> {
        if self.failed {
            return Err(Error::QueueFailed { qid: self.qid });
        }
        self.free.pop().ok_or(Error::QueueFull {
            qid: self.qid,
            capacity: self.slots.len(),
        })
    }

    /// Gives back a CID reserved by [`QueuePair::begin`] that was not issued.
    pub(crate) fn cancel(&mut self, cid: u16) {
        debug_assert_eq!(self.slots[cid as usize].state, SlotState::Free);
        self.free.push(cid);
    }

    /// Byte offset in the PRP memory and device address of the list page for `cid`.
    fn prp_page(&self, cid: u16) -> (usize, u64) {
        let offset = (cid as usize % self.prp_pages) * DMA_PAGE_SIZE;
        (offset, self.prp.device_address(offset))
    }

    /// Builds the data pointer for `buf`, writing a PRP list into `cid`'s list page if needed.
    pub(crate) fn data_pointer(&self, cid: u16, buf: &DmaSlice) -> Result<Prp, Error> {
        let (list_offset, list_address) = self.prp_page(cid);
        let prp_mem = &self.prp;
        Ok(build_prp(
            buf.pages(),
            buf.offset % DMA_PAGE_SIZE,
            buf.len,
            list_address,
            |i, page| prp_mem.store_u64(list_offset + i * 8, page, Ordering::Relaxed),
        )?)
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
        let index = self.sq_ring.push();
        self.sq.write(index as usize * SQE_SIZE, cmd.as_bytes());
        let slot = &mut self.slots[cid as usize];
        debug_assert_eq!(slot.state, SlotState::Free);
        slot.state = SlotState::Issued;
        slot.tag = tag;
        slot.internal = internal;
        slot.op = op;
        slot.buf = buf;
        self.in_flight += 1;
        if ring {
            self.ring();
        }
    }

    /// Rings the submission queue tail doorbell if commands were queued since the last ring.
    pub(crate) fn ring(&mut self) {
        let tail = self.sq_ring.tail();
        if tail == self.committed_tail {
            return;
        }
        // Release: the SQEs, PRP lists and data written before must be visible to the
        // controller before it sees the new tail.
        fence(Ordering::Release);
        self.device.registers().write_u32(self.sq_db, tail);
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
    pub(crate) fn reap(
        &mut self,
        max: usize,
        sink: &mut dyn FnMut(Reaped),
    ) -> Result<usize, Error> {
        let mut count = 0;
        let mut consumed = 0u32;
        let mut garbage = None;
        let limit = max.min(self.slots.len());
        while count < limit {
            let head = self.cq_ring.head() as usize;
            let base = head * CQE_SIZE;
            // Acquire: the rest of the entry (and the data the command moved) is read after the
            // controller's write of this dword is seen.
            let dw3 = self.cq.load_u32(base + CQE_STATUS_DWORD, Ordering::Acquire);
            let status = CqeStatus::from((dw3 >> STATUS_SHIFT) as u16);
            if status.p() != self.cq_ring.phase() {
                break;
            }
            let cid = (dw3 >> CID_SHIFT) as u16;
            let dw0 = self.cq.load_u32(base + CQE_DW0, Ordering::Relaxed);
            let dw2 = self.cq.load_u32(base + CQE_SQ_DWORD, Ordering::Relaxed);
            let (sqhd, sqid) = ((dw2 >> SQHD_SHIFT) as u16, (dw2 >> SQID_SHIFT) as u16);
            self.cq_ring.pop();
            consumed += 1;
            if sqid != self.qid {
                garbage = Some((cid, sqid, "wrong submission queue id"));
                break;
            }
            if sqhd as u32 >= self.sq_ring.depth() {
                garbage = Some((cid, sqid, "SQ head pointer beyond the queue"));
                break;
            }
            let Some(slot) = self.slots.get_mut(cid as usize) else {
                garbage = Some((cid, sqid, "command id out of range"));
                break;
            };
            match slot.state {
                SlotState::Free => {
                    garbage = Some((cid, sqid, "command id not in flight"));
                    break;
                }
                SlotState::Abandoned => {
                    // Late completion of a command already reported (timed out): the controller
                    // is done with its buffer now.
                    slot.state = SlotState::Free;
                    slot.buf = None;
                    self.free.push(cid);
                }
                SlotState::Issued | SlotState::Busy => {
                    slot.state = SlotState::Free;
                    slot.buf = None;
                    let st = status.status();
                    let result = if st.is_success() {
                        Ok(dw0)
                    } else {
                        Err(Error::Nvme {
                            op: slot.op,
                            status: st,
                        })
                    };
                    let reaped = Reaped {
                        tag: slot.tag,
                        internal: slot.internal,
                        result,
                    };
                    self.free.push(cid);
                    self.in_flight -= 1;
                    count += 1;
                    sink(reaped);
                }
            }
        }
        if consumed > 0 {
            self.device
                .registers()
                .write_u32(self.cq_db, self.cq_ring.head());
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
                count += self.check_deadlines(limit - count, sink);
            }
        }
        Ok(count)
    }

    /// Reports expired commands (and all commands, if the controller is dead). Runs at most
    /// once per check interval.
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
            if !matches!(slot.state, SlotState::Issued | SlotState::Busy) {
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
                    op: slot.op,
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
                result: Err(error),
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
            .field("depth", &self.sq_ring.depth())
            .field("in_flight", &self.in_flight)
            .field("failed", &self.failed)
            .finish()
    }
}
