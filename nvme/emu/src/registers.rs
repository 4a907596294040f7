//! The controller's register window (BAR0) as the driver sees it.
//!
//! An array of atomics that implements [`nvme::RegisterIo`]. The driver's writes land here and
//! the controller threads observe them by polling, as hardware samples its registers:
//!
//! - CAP and VS are set once and read-only. CSTS is written only by the controller (with atomic
//!   read-modify-writes, so that a fault injected from another thread is never lost). Writes to
//!   read-only and reserved registers are ignored.
//! - CC, AQA, ASQ and ACQ store what the driver writes; the controller acts on CC changes. A
//!   write that clears CC.EN is also latched, so a disable that is undone before the controller
//!   thread samples CC still resets the controller.
//! - Doorbells are validated as they are written: a write to the doorbell of a queue that does
//!   not exist, or a value not below the queue's size, is not stored (so it cannot corrupt queue
//!   state) but recorded; controller thread 0 turns each record into an Error Information log
//!   entry and an asynchronous event ("Write to Invalid Doorbell Register" or "Invalid Doorbell
//!   Write Value"), as the specification describes.
//! - Writes to CC wake controller thread 0 (which runs the state machine and the admin queue);
//!   a doorbell write wakes the thread serving that queue (its owner, set with the queue).

use std::collections::VecDeque;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU32, AtomicU64, Ordering};
use std::sync::{Mutex, OnceLock};
use std::thread::Thread;

use nvme::RegisterIo;
use nvme_spec::registers::{ACQ, AQA, ASQ, CAP, CC, CSTS, Cc, DOORBELL_BASE, INTMC, INTMS, VS};

/// Most doorbell errors kept for controller thread 0 to report; later ones are only counted.
const DOORBELL_ERROR_BACKLOG: usize = 64;

/// What was wrong with a doorbell write.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum DoorbellErrorKind {
    /// The doorbell belongs to no existing queue.
    InvalidRegister,
    /// The value is not below the queue's size.
    InvalidValue,
}

/// A doorbell write the window refused.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) struct DoorbellError {
    pub(crate) kind: DoorbellErrorKind,
    /// Queue the doorbell belongs to.
    pub(crate) qid: u16,
    /// Whether it is the submission queue tail doorbell (else the completion queue head).
    pub(crate) is_sq: bool,
    /// The refused value.
    pub(crate) value: u32,
}

/// BAR0 of the software controller.
pub(crate) struct RegisterWindow {
    regs: Box<[AtomicU32]>,
    /// Highest queue id with a doorbell pair in the window.
    max_qid: u16,
    /// Entries of the queue behind each doorbell (index as in the doorbell array: `2 * qid` for
    /// the SQ tail, `2 * qid + 1` for the CQ head); 0 when the queue does not exist.
    limits: Box<[AtomicU32]>,
    /// The controller thread serving the queue behind each doorbell (index as in `limits`).
    owners: Box<[AtomicU16]>,
    /// Interrupt mask (INTMS/INTMC); kept for read-back only, no interrupts are generated.
    interrupt_mask: AtomicU32,
    /// Set when a CC write clears EN; controller thread 0 takes it.
    disable_latched: AtomicBool,
    doorbell_errors: Mutex<VecDeque<DoorbellError>>,
    doorbell_error_count: AtomicU64,
    /// The controller threads, by index: unparked on CC (thread 0) and doorbell writes (the
    /// queue's owner).
    wakers: OnceLock<Box<[Thread]>>,
    /// The controller was stopped: reads return all ones and writes are dropped, as for a
    /// PCI device that went away.
    gone: AtomicBool,
}

impl std::fmt::Debug for RegisterWindow {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("RegisterWindow")
            .field("len", &(self.regs.len() * 4))
            .field("cc", &self.load(CC))
            .field("csts", &self.load(CSTS))
            .finish()
    }
}

impl RegisterWindow {
    /// A window with doorbells for queue ids `0..=max_qid`, and the given CAP and VS values.
    pub(crate) fn new(max_qid: u16, cap: u64, vs: u32) -> Self {
        let doorbell_end = DOORBELL_BASE + (max_qid as usize + 1) * 8;
        let len = doorbell_end.next_multiple_of(4096).max(0x4000);
        let regs: Box<[AtomicU32]> = (0..len / 4).map(|_| AtomicU32::new(0)).collect();
        let limits = (0..(max_qid as usize + 1) * 2)
            .map(|_| AtomicU32::new(0))
            .collect();
        let owners = (0..(max_qid as usize + 1) * 2)
            .map(|_| AtomicU16::new(0))
            .collect();
        let window = Self {
            regs,
            max_qid,
            limits,
            owners,
            interrupt_mask: AtomicU32::new(0),
            disable_latched: AtomicBool::new(false),
            doorbell_errors: Mutex::new(VecDeque::with_capacity(DOORBELL_ERROR_BACKLOG)),
            doorbell_error_count: AtomicU64::new(0),
            wakers: OnceLock::new(),
            gone: AtomicBool::new(false),
        };
        window.store(CAP, cap as u32);
        window.store(CAP + 4, (cap >> 32) as u32);
        window.store(VS, vs);
        window
    }

    /// Registers the controller threads (index 0 first) to be woken by CC and doorbell writes.
    pub(crate) fn set_wakers(&self, threads: Box<[Thread]>) {
        let _ = self.wakers.set(threads);
    }

    /// Makes the window behave like a removed device.
    pub(crate) fn set_gone(&self) {
        self.gone.store(true, Ordering::Release);
    }

    /// Wakes controller thread 0 (state machine, admin queue, error reports) if it is parked.
    pub(crate) fn wake(&self) {
        self.wake_thread(0);
    }

    /// Wakes controller thread `index` if it is parked.
    pub(crate) fn wake_thread(&self, index: usize) {
        if let Some(t) = self.wakers.get().and_then(|w| w.get(index)) {
            t.unpark();
        }
    }

    /// Wakes every controller thread.
    pub(crate) fn wake_all(&self) {
        for t in self.wakers.get().into_iter().flatten() {
            t.unpark();
        }
    }

    fn load(&self, offset: usize) -> u32 {
        self.regs[offset / 4].load(Ordering::Acquire)
    }

    fn store(&self, offset: usize, value: u32) {
        self.regs[offset / 4].store(value, Ordering::Release)
    }

    fn load_u64(&self, offset: usize) -> u64 {
        self.load(offset) as u64 | ((self.load(offset + 4) as u64) << 32)
    }

    /// Current CC value.
    pub(crate) fn cc(&self) -> Cc {
        Cc::from(self.load(CC))
    }

    /// Takes the "EN was cleared" latch.
    pub(crate) fn take_disable_latch(&self) -> bool {
        // Load first: the common case (no disable) then does not write the cache line that
        // every driver register access reads.
        self.disable_latched.load(Ordering::Acquire)
            && self.disable_latched.swap(false, Ordering::AcqRel)
    }

    /// Current AQA value.
    pub(crate) fn aqa(&self) -> u32 {
        self.load(AQA)
    }

    /// Current ASQ value.
    pub(crate) fn asq(&self) -> u64 {
        self.load_u64(ASQ)
    }

    /// Current ACQ value.
    pub(crate) fn acq(&self) -> u64 {
        self.load_u64(ACQ)
    }

    /// Current CSTS value.
    pub(crate) fn csts(&self) -> u32 {
        self.load(CSTS)
    }

    /// Sets bits in CSTS.
    pub(crate) fn csts_set(&self, bits: u32) {
        self.regs[CSTS / 4].fetch_or(bits, Ordering::AcqRel);
    }

    /// Clears bits in CSTS.
    pub(crate) fn csts_clear(&self, bits: u32) {
        self.regs[CSTS / 4].fetch_and(!bits, Ordering::AcqRel);
    }

    /// Replaces CSTS.SHST.
    pub(crate) fn set_shst(&self, shst: u8) {
        let mask = 0b11 << 2;
        let _ = self.regs[CSTS / 4].fetch_update(Ordering::AcqRel, Ordering::Acquire, |v| {
            Some((v & !mask) | ((shst as u32 & 0b11) << 2))
        });
    }

    fn doorbell_index(qid: u16, is_sq: bool) -> usize {
        qid as usize * 2 + usize::from(!is_sq)
    }

    /// Latest SQ tail doorbell value of `qid` (Acquire: SQEs written before it are visible).
    pub(crate) fn sq_tail(&self, qid: u16) -> u32 {
        self.regs[DOORBELL_BASE / 4 + Self::doorbell_index(qid, true)].load(Ordering::Acquire)
    }

    /// Latest CQ head doorbell value of `qid`.
    pub(crate) fn cq_head(&self, qid: u16) -> u32 {
        self.regs[DOORBELL_BASE / 4 + Self::doorbell_index(qid, false)].load(Ordering::Acquire)
    }

    /// Makes a queue's doorbell accept values below `entries`, resetting it to 0, with writes
    /// waking controller thread `owner`; `entries == 0` marks the queue as nonexistent.
    pub(crate) fn set_queue(&self, qid: u16, is_sq: bool, entries: u32, owner: usize) {
        let index = Self::doorbell_index(qid, is_sq);
        self.limits[index].store(0, Ordering::Release);
        self.regs[DOORBELL_BASE / 4 + index].store(0, Ordering::Release);
        self.owners[index].store(owner as u16, Ordering::Relaxed);
        self.limits[index].store(entries, Ordering::Release);
    }

    /// Marks every queue nonexistent and zeroes every doorbell (controller reset).
    pub(crate) fn reset_queues(&self) {
        for (i, limit) in self.limits.iter().enumerate() {
            limit.store(0, Ordering::Release);
            self.regs[DOORBELL_BASE / 4 + i].store(0, Ordering::Release);
        }
    }

    /// Total doorbell writes refused so far.
    pub(crate) fn doorbell_error_count(&self) -> u64 {
        self.doorbell_error_count.load(Ordering::Acquire)
    }

    /// Takes the oldest recorded doorbell error not yet reported.
    pub(crate) fn pop_doorbell_error(&self) -> Option<DoorbellError> {
        self.doorbell_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .pop_front()
    }

    fn refuse_doorbell(&self, error: DoorbellError) {
        self.doorbell_error_count.fetch_add(1, Ordering::AcqRel);
        let mut errors = self
            .doorbell_errors
            .lock()
            .unwrap_or_else(|e| e.into_inner());
        if errors.len() < DOORBELL_ERROR_BACKLOG {
            errors.push_back(error);
        }
        drop(errors);
        self.wake();
    }

    fn write_doorbell(&self, offset: usize, value: u32) {
        let index = (offset - DOORBELL_BASE) / 4;
        let qid = index / 2;
        let is_sq = index % 2 == 0;
        let limit = if qid <= self.max_qid as usize {
            self.limits[index].load(Ordering::Acquire)
        } else {
            0
        };
        let qid = qid as u16;
        if limit == 0 {
            self.refuse_doorbell(DoorbellError {
                kind: DoorbellErrorKind::InvalidRegister,
                qid,
                is_sq,
                value,
            });
        } else if value >= limit {
            self.refuse_doorbell(DoorbellError {
                kind: DoorbellErrorKind::InvalidValue,
                qid,
                is_sq,
                value,
            });
        } else {
            // Release: the SQEs the driver wrote before ringing are visible to the controller
            // thread's Acquire load of this doorbell (the driver also fences before ringing).
            self.store(offset, value);
            self.wake_thread(self.owners[index].load(Ordering::Relaxed) as usize);
        }
    }
}

impl RegisterIo for RegisterWindow {
    fn len(&self) -> usize {
        self.regs.len() * 4
    }

    fn read_u32(&self, offset: usize) -> u32 {
        assert!(
            offset % 4 == 0 && offset + 4 <= self.len(),
            "bad register offset {offset:#x}"
        );
        if self.gone.load(Ordering::Acquire) {
            return u32::MAX;
        }
        match offset {
            INTMS | INTMC => self.interrupt_mask.load(Ordering::Acquire),
            _ => self.load(offset),
        }
    }

    fn write_u32(&self, offset: usize, value: u32) {
        assert!(
            offset % 4 == 0 && offset + 4 <= self.len(),
            "bad register offset {offset:#x}"
        );
        if self.gone.load(Ordering::Acquire) {
            return;
        }
        match offset {
            CC => {
                let old = Cc::from(self.regs[CC / 4].swap(value, Ordering::AcqRel));
                if old.en() && !Cc::from(value).en() {
                    self.disable_latched.store(true, Ordering::Release);
                }
                self.wake();
            }
            INTMS => {
                self.interrupt_mask.fetch_or(value, Ordering::AcqRel);
            }
            INTMC => {
                self.interrupt_mask.fetch_and(!value, Ordering::AcqRel);
            }
            AQA => self.store(AQA, value & 0x0fff_0fff),
            o if (ASQ..ACQ + 8).contains(&o) => self.store(o, value),
            o if o >= DOORBELL_BASE => self.write_doorbell(o, value),
            // CAP, VS, CSTS, NSSR (subsystem reset is not supported: CAP.NSSRS = 0), the
            // controller memory buffer registers and reserved space: read-only or ignored.
            _ => {}
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn read_only_registers_ignore_writes() {
        let w = RegisterWindow::new(4, 0x1234_5678_9abc_def0, 0x0001_0400);
        assert_eq!(w.len(), 0x4000);
        w.write_u32(CAP, 0);
        w.write_u32(VS, 0);
        w.write_u32(CSTS, 0xffff_ffff);
        assert_eq!(w.read_u64(CAP), 0x1234_5678_9abc_def0);
        assert_eq!(w.read_u32(VS), 0x0001_0400);
        assert_eq!(w.read_u32(CSTS), 0);
        w.write_u64(ASQ, 0x1_0000_1000);
        assert_eq!(w.asq(), 0x1_0000_1000);
        w.write_u32(INTMS, 0b101);
        w.write_u32(INTMC, 0b001);
        assert_eq!(w.read_u32(INTMS), 0b100);
    }

    #[test]
    fn doorbells_are_validated() {
        let w = RegisterWindow::new(2, 0, 0);
        // No queue yet: refused and recorded.
        w.write_u32(DOORBELL_BASE, 1);
        assert_eq!(w.sq_tail(0), 0);
        assert_eq!(
            w.pop_doorbell_error(),
            Some(DoorbellError {
                kind: DoorbellErrorKind::InvalidRegister,
                qid: 0,
                is_sq: true,
                value: 1
            })
        );
        w.set_queue(1, false, 16, 0);
        w.write_u32(DOORBELL_BASE + 12, 15);
        assert_eq!(w.cq_head(1), 15);
        w.write_u32(DOORBELL_BASE + 12, 16);
        assert_eq!(w.cq_head(1), 15);
        assert_eq!(
            w.pop_doorbell_error().unwrap().kind,
            DoorbellErrorKind::InvalidValue
        );
        // Beyond the last queue's doorbells, but inside the window.
        w.write_u32(DOORBELL_BASE + 3 * 8, 0);
        assert_eq!(w.pop_doorbell_error().unwrap().qid, 3);
        assert_eq!(w.doorbell_error_count(), 3);
        w.reset_queues();
        assert_eq!(w.cq_head(1), 0);
    }

    #[test]
    fn disable_is_latched() {
        let w = RegisterWindow::new(1, 0, 0);
        w.write_u32(CC, 1);
        assert!(!w.take_disable_latch());
        w.write_u32(CC, 0);
        w.write_u32(CC, 1);
        assert!(w.take_disable_latch());
        assert!(!w.take_disable_latch());
    }
}
