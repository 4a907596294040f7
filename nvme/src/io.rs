//! I/O queue pairs: NVM command set I/O (NVM Command Set 1.0, section 3.2) on one submission /
//! completion queue pair, asynchronously ([`IoQueuePair::submit`], [`IoQueuePair::poll`],
//! [`IoQueuePair::wait`]) or synchronously with requests split at the maximum transfer size and
//! many commands in flight ([`IoQueuePair::read`] and friends).
//!
//! The hot path takes no lock, makes no system call, reads no clock and allocates nothing:
//! validation against the namespace used last, the PRPs (PRP1 alone or PRP1 + PRP2 without a
//! loop; longer transfers copy their page addresses into the command's own list page), the SQE
//! built in place in the ring as eight quadwords, and per batch a Release fence and one
//! doorbell write. [`IoQueuePair::queue_read`] / [`IoQueuePair::queue_write`] borrow the buffer
//! and keep its memory alive with a per-buffer pin, so that they touch no shared reference
//! count; [`IoCommand`]s carry their own `Arc` clone. Reaping rings the completion doorbell
//! once per round. Measured with the inline null device of the `nvme_null` crate:
//! `benches/hot_path.rs` and `examples/driver_cost.rs`.
//!
//! An [`IoQueuePair`] is a CPU driver on top of a [`CreatedQueuePair`]: it allocates the rings
//! in host DMA memory, has [`crate::queue_lifecycle`] create the queues on their regions, and
//! drives them with the `queue_pair` engine. `Controller::create_io_queue_pair` is defined
//! here, so that the controller module does not depend on this one.

#![forbid(unsafe_code)]

use crate::controller::Controller;
use crate::device::Device;
use crate::dma::{DMA_PAGE_SIZE, DmaMemory, DmaSlice};
use crate::error::{Error, Op};
use crate::namespace::{Namespace, SkippedNamespace};
use crate::queue_lifecycle::{CreatedQueuePair, QueueRegions};
use crate::queue_pair::{Doorbells, QueueMemory, QueuePair, Reaped};
use crate::timeout::Backoff;
use nvme_spec::command::{DSM_MAX_RANGES, DsmCdw10, DsmCdw11, WriteZeroesCdw12};
use nvme_spec::{Command, DsmRange, NvmOpcode};
use std::sync::Arc;
use zerocopy::IntoBytes;

/// Most blocks one Read, Write or Write Zeroes command addresses (NLB is 16 bits, zero-based).
const MAX_BLOCKS_PER_COMMAND: u64 = 1 << 16;
/// Largest bounce buffer [`IoQueuePair::read_to`] / [`IoQueuePair::write_from`] keep.
const MAX_BOUNCE: usize = 8 * 1024 * 1024;

/// One I/O command.
#[derive(Clone, Debug)]
pub enum IoCommand {
    /// Read `buf.len` bytes (a whole number of blocks) starting at block `lba`.
    Read {
        /// Namespace.
        nsid: u32,
        /// First block.
        lba: u64,
        /// Destination.
        buf: DmaSlice,
    },
    /// Write `buf.len` bytes (a whole number of blocks) starting at block `lba`.
    Write {
        /// Namespace.
        nsid: u32,
        /// First block.
        lba: u64,
        /// Source.
        buf: DmaSlice,
    },
    /// Flush the volatile write cache.
    Flush {
        /// Namespace.
        nsid: u32,
    },
    /// Write Zeroes to `blocks` blocks (1..=65536) starting at `lba`.
    WriteZeroes {
        /// Namespace.
        nsid: u32,
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u32,
    },
    /// Dataset Management with the Deallocate attribute: 1..=256 ranges of (first block, blocks).
    Deallocate {
        /// Namespace.
        nsid: u32,
        /// (first block, number of blocks) per range.
        ranges: Vec<(u64, u32)>,
    },
}

/// A finished command: the tag given to [`IoQueuePair::submit`] and how it ended.
#[derive(Debug)]
pub struct IoCompletion {
    /// The caller's tag.
    pub tag: u64,
    /// `Ok` on Successful Completion; otherwise the NVMe status, timeout or controller failure.
    pub result: Result<(), Error>,
}

/// What checking a Read or Write needs of its namespace (NSID 0 is never a namespace, so
/// [`NsFast::NONE`] matches no command).
#[derive(Clone, Copy, Debug)]
struct NsFast {
    nsid: u32,
    /// log2 of the LBA size (a power of two, 512..=4096).
    shift: u32,
    /// LBA size - 1: the bits a buffer length must not have.
    len_mask: usize,
    blocks: u64,
    /// CDW12 bits Reads and Writes carry besides NLB: PRINFO for a PI namespace.
    cdw12: u32,
}

impl NsFast {
    const NONE: Self = Self {
        nsid: 0,
        shift: 0,
        len_mask: 0,
        blocks: 0,
        cdw12: 0,
    };
}

/// An I/O submission queue and its completion queue. `Send`; used by one thread at a time.
/// Dropping it deletes both queues on the controller.
pub struct IoQueuePair {
    // Field order matters: `pair` is dropped first, deleting the queues on the controller
    // before `qp` releases the PRP list pages and the buffers of commands still in flight.
    pair: CreatedQueuePair,
    qp: QueuePair,
    namespaces: Arc<[Namespace]>,
    /// Namespaces the driver refuses, for the error that says why.
    skipped: Arc<[SkippedNamespace]>,
    /// The namespace Reads and Writes went to last, as the hot path needs it.
    last_ns: NsFast,
    device: Arc<dyn Device>,
    write_zeroes: bool,
    dsm: bool,
    max_transfer: usize,
    stash: Vec<IoCompletion>,
    bounce: Option<Arc<DmaMemory>>,
}

impl From<Reaped> for IoCompletion {
    #[inline]
    fn from(r: Reaped) -> Self {
        match r.result {
            Ok(_) => Self {
                tag: r.tag,
                result: Ok(()),
            },
            Err(e) => Self {
                tag: r.tag,
                result: Err(*e),
            },
        }
    }
}

impl std::fmt::Debug for IoQueuePair {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("IoQueuePair").field("qp", &self.qp).finish()
    }
}

impl Controller {
    /// Creates an I/O completion queue and submission queue pair with `depth` entries each
    /// (clamped to 2..=CAP.MQES + 1), in host DMA memory, driven by the CPU; it can hold
    /// `depth - 1` commands in flight. Same as [`IoQueuePair::new`].
    pub fn create_io_queue_pair(&self, depth: u16) -> Result<IoQueuePair, Error> {
        IoQueuePair::new(self, depth)
    }
}

impl IoQueuePair {
    /// Allocates rings of `depth` entries (clamped to 2..=CAP.MQES + 1) and a PRP list page per
    /// command slot from the controller's transport, and creates the queues on them (CQ first,
    /// then SQ).
    pub fn new(ctrl: &Controller, depth: u16) -> Result<Self, Error> {
        if ctrl.is_shut_down() {
            return Err(Error::ShutDown);
        }
        let info = ctrl.info();
        let depth = depth.clamp(2, info.mqes_entries.min(u16::MAX as u32) as u16);
        let device = ctrl.device().clone();
        let mem = QueueMemory::alloc(&*device, depth, depth as usize - 1)?;
        if !mem.sq.is_device_contiguous() || !mem.cq.is_device_contiguous() {
            return Err(Error::Unsupported(format!(
                "physically discontiguous queue memory for depth {depth}; use a depth of at \
                 most 64 or a transport with an IOMMU"
            )));
        }
        let regions = QueueRegions {
            sq: Arc::clone(mem.sq.region()),
            sq_entries: depth as u32,
            cq: Arc::clone(mem.cq.region()),
            cq_entries: depth as u32,
        };
        let pair = ctrl.create_queue_pair_on(regions)?;
        let doorbells = Doorbells {
            sq_tail: pair.sq_tail_doorbell(),
            cq_head: pair.cq_head_doorbell(),
        };
        let qp = QueuePair::new(
            device.clone(),
            pair.qid(),
            depth,
            mem,
            doorbells,
            ctrl.options().io_timeout,
        );
        let (namespaces, skipped) = ctrl.namespaces_shared();
        Ok(Self {
            pair,
            qp,
            namespaces,
            skipped,
            last_ns: NsFast::NONE,
            device,
            write_zeroes: info.write_zeroes,
            dsm: info.dsm,
            max_transfer: info.max_transfer_bytes,
            stash: Vec::new(),
            bounce: None,
        })
    }

    /// Queue identifier.
    pub fn qid(&self) -> u16 {
        self.qp.qid()
    }

    /// Entries in each ring.
    pub fn depth(&self) -> u16 {
        self.qp.depth()
    }

    /// Most commands in flight at once (depth - 1).
    pub fn capacity(&self) -> usize {
        self.qp.capacity()
    }

    /// Commands submitted and not yet reaped.
    pub fn in_flight(&self) -> usize {
        self.qp.in_flight() + self.stash.len()
    }

    /// Whether the queue pair failed (timeout, controller failure, garbage completion) and
    /// accepts no more commands.
    pub fn is_failed(&self) -> bool {
        self.qp.is_failed()
    }

    /// Most bytes one Read or Write may move.
    pub fn max_transfer_bytes(&self) -> usize {
        self.max_transfer
    }

    fn namespace(&self, nsid: u32) -> Result<&Namespace, Error> {
        crate::controller::find_namespace(&self.namespaces, &self.skipped, nsid)
    }

    fn check_range(ns: &Namespace, lba: u64, blocks: u64) -> Result<(), Error> {
        if lba.checked_add(blocks).is_none_or(|end| end > ns.blocks) {
            return Err(Error::OutOfRange {
                nsid: ns.nsid,
                lba,
                blocks,
                capacity: ns.blocks,
            });
        }
        Ok(())
    }

    /// Checks a data buffer for `ns`; returns its length in blocks.
    fn check_buffer(
        &self,
        ns: &Namespace,
        lba: u64,
        buf: &DmaSlice,
        max: usize,
    ) -> Result<u64, Error> {
        // LBA sizes are powers of two (Namespace guarantees 512..=4096): masks, not divisions.
        let bs = ns.lba_size as usize;
        debug_assert!(bs.is_power_of_two());
        if buf.len == 0 {
            return Err(Error::InvalidArgument("empty data buffer".into()));
        }
        if buf.len & (bs - 1) != 0 {
            return Err(Error::Unaligned {
                what: "buffer length",
                value: buf.len as u64,
                align: bs as u64,
            });
        }
        if buf.len > max {
            return Err(Error::TransferTooLarge { len: buf.len, max });
        }
        if buf.offset % 4 != 0 {
            return Err(Error::Unaligned {
                what: "buffer offset",
                value: buf.offset as u64,
                align: 4,
            });
        }
        let blocks = (buf.len >> bs.trailing_zeros()) as u64;
        Self::check_range(ns, lba, blocks)?;
        Ok(blocks)
    }

    /// Submits one command and rings the doorbell. The command is checked against the
    /// namespace first (NSID, range, alignment, size ≤ [`IoQueuePair::max_transfer_bytes`]);
    /// a bad one fails with a typed error without reaching the device. Fails with
    /// [`Error::QueueFull`] when [`IoQueuePair::capacity`] commands are in flight.
    pub fn submit(&mut self, cmd: IoCommand, tag: u64) -> Result<(), Error> {
        self.submit_inner(cmd, tag, false)?;
        self.qp.ring();
        Ok(())
    }

    /// Like [`IoQueuePair::submit`] but leaves the doorbell alone, so that a batch of commands
    /// costs one doorbell write: call [`IoQueuePair::ring`] after the batch. [`IoQueuePair::poll`]
    /// and [`IoQueuePair::wait`] ring it too, so a forgotten ring cannot stall the queue.
    pub fn submit_deferred(&mut self, cmd: IoCommand, tag: u64) -> Result<(), Error> {
        self.submit_inner(cmd, tag, false)
    }

    /// Rings the submission queue tail doorbell if commands were queued since the last ring.
    #[inline]
    pub fn ring(&mut self) {
        self.qp.ring();
    }

    fn submit_inner(&mut self, cmd: IoCommand, tag: u64, internal: bool) -> Result<(), Error> {
        if self.pair.is_deleted() {
            return Err(Error::ShutDown);
        }
        match cmd {
            IoCommand::Read { nsid, lba, buf } => {
                self.submit_rw(NvmOpcode::READ, nsid, lba, buf, tag, internal)
            }
            IoCommand::Write { nsid, lba, buf } => {
                self.submit_rw(NvmOpcode::WRITE, nsid, lba, buf, tag, internal)
            }
            IoCommand::Flush { nsid } => {
                self.namespace(nsid)?;
                let cid = self.qp.begin()?;
                let cmd = Command::new(NvmOpcode::FLUSH.0, 0, nsid);
                let op = Op {
                    name: "Flush",
                    nsid,
                    lba: None,
                };
                self.qp.issue(cid, cmd, op, tag, internal, None, false);
                Ok(())
            }
            IoCommand::WriteZeroes { nsid, lba, blocks } => {
                if !self.write_zeroes {
                    return Err(Error::Unsupported("Write Zeroes (ONCS bit 3 clear)".into()));
                }
                let ns = self.namespace(nsid)?;
                if blocks == 0 || blocks as u64 > MAX_BLOCKS_PER_COMMAND {
                    return Err(Error::InvalidArgument(format!(
                        "Write Zeroes of {blocks} blocks (1..=65536 per command)"
                    )));
                }
                Self::check_range(ns, lba, blocks as u64)?;
                let (prinfo, reftag) = (ns.prinfo(), ns.reference_tag(lba));
                let cid = self.qp.begin()?;
                let mut cmd = Command::new(NvmOpcode::WRITE_ZEROES.0, 0, nsid);
                cmd.set_slba(lba);
                // PRACT on a PI namespace: the controller writes valid PI for the zeroes.
                cmd.cdw12 = WriteZeroesCdw12::new()
                    .with_nlb_z((blocks - 1) as u16)
                    .with_prinfo(prinfo)
                    .into();
                cmd.cdw14 = reftag;
                let op = Op {
                    name: "Write Zeroes",
                    nsid,
                    lba: Some(lba),
                };
                self.qp.issue(cid, cmd, op, tag, internal, None, false);
                Ok(())
            }
            IoCommand::Deallocate { nsid, ranges } => {
                if !self.dsm {
                    return Err(Error::Unsupported(
                        "Dataset Management (ONCS bit 2 clear)".into(),
                    ));
                }
                let ns = self.namespace(nsid)?;
                if ranges.is_empty() || ranges.len() > DSM_MAX_RANGES {
                    return Err(Error::InvalidArgument(format!(
                        "Deallocate with {} ranges (1..=256 per command)",
                        ranges.len()
                    )));
                }
                let mut table = [DsmRange {
                    context_attributes: 0,
                    nlb: 0,
                    slba: 0,
                }; DSM_MAX_RANGES];
                for (entry, &(lba, blocks)) in table.iter_mut().zip(&ranges) {
                    if blocks == 0 {
                        return Err(Error::InvalidArgument(
                            "Deallocate range of 0 blocks".into(),
                        ));
                    }
                    Self::check_range(ns, lba, blocks as u64)?;
                    *entry = DsmRange {
                        context_attributes: 0,
                        nlb: blocks,
                        slba: lba,
                    };
                }
                let cid = self.qp.begin()?;
                let address = self
                    .qp
                    .write_side_page(cid, table[..ranges.len()].as_bytes());
                let mut cmd = Command::new(NvmOpcode::DATASET_MANAGEMENT.0, 0, nsid);
                cmd.prp1 = address;
                cmd.cdw10 = DsmCdw10::new().with_nr_z((ranges.len() - 1) as u8).into();
                cmd.cdw11 = DsmCdw11::new().with_ad(true).into();
                let op = Op {
                    name: "Dataset Management",
                    nsid,
                    lba: Some(ranges[0].0),
                };
                self.qp.issue(cid, cmd, op, tag, internal, None, false);
                Ok(())
            }
        }
    }

    /// Checks a Read or Write of `buf` at `lba` on `nsid`; returns its length in blocks. The
    /// common case is a handful of compares against the namespace used last; anything wrong
    /// is diagnosed off the hot path by [`IoQueuePair::check_buffer`].
    #[inline]
    /// Checks a Read or Write and returns its CDW12 (NLB, and PRINFO for a PI namespace).
    fn rw_cdw12(&mut self, nsid: u32, lba: u64, buf: &DmaSlice) -> Result<u32, Error> {
        if nsid != self.last_ns.nsid {
            self.switch_namespace(nsid)?;
        }
        let ns = self.last_ns;
        let (len, offset) = (buf.len, buf.offset);
        let blocks = (len >> ns.shift) as u64;
        // Every check at once: length 1..=max_transfer (0 wraps around), a whole number of
        // blocks, offset dword-aligned, and the range inside the namespace.
        let (end, overflow) = lba.overflowing_add(blocks);
        let bad = (len.wrapping_sub(1) >= self.max_transfer)
            | ((len & ns.len_mask) | (offset % 4) != 0)
            | overflow
            | (end > ns.blocks);
        if bad {
            return Err(self.rw_error(nsid, lba, buf));
        }
        Ok((blocks - 1) as u32 | ns.cdw12)
    }

    #[cold]
    fn switch_namespace(&mut self, nsid: u32) -> Result<(), Error> {
        let ns = self.namespace(nsid)?;
        debug_assert!(ns.lba_size.is_power_of_two());
        self.last_ns = NsFast {
            nsid,
            shift: ns.lba_size.trailing_zeros(),
            len_mask: ns.lba_size as usize - 1,
            blocks: ns.blocks,
            cdw12: (ns.prinfo() as u32) << nvme_spec::command::prinfo::SHIFT,
        };
        Ok(())
    }

    #[cold]
    #[inline(never)]
    fn rw_error(&self, nsid: u32, lba: u64, buf: &DmaSlice) -> Error {
        let checked = self
            .namespace(nsid)
            .and_then(|ns| self.check_buffer(ns, lba, buf, self.max_transfer));
        match checked {
            Err(e) => e,
            Ok(_) => Error::InvalidArgument(format!(
                "Read or Write of {}+{} at lba {lba} on nsid {nsid}",
                buf.offset, buf.len
            )),
        }
    }

    /// A Read or Write whose buffer the caller hands over: the slot keeps it.
    fn submit_rw(
        &mut self,
        opcode: NvmOpcode,
        nsid: u32,
        lba: u64,
        buf: DmaSlice,
        tag: u64,
        internal: bool,
    ) -> Result<(), Error> {
        let cdw12 = self.rw_cdw12(nsid, lba, &buf)?;
        let cid = self
            .qp
            .issue_rw(opcode, nsid, lba, cdw12, &buf, tag, internal, false)?;
        self.qp.hold(cid, buf);
        Ok(())
    }

    /// A Read or Write whose buffer the caller keeps: the queue pair pins it.
    #[inline(always)]
    fn queue_rw(
        &mut self,
        opcode: NvmOpcode,
        nsid: u32,
        lba: u64,
        buf: &DmaSlice,
        tag: u64,
    ) -> Result<(), Error> {
        if self.pair.is_deleted() {
            return Err(Error::ShutDown);
        }
        let cdw12 = self.rw_cdw12(nsid, lba, buf)?;
        self.qp
            .issue_rw(opcode, nsid, lba, cdw12, buf, tag, false, true)?;
        Ok(())
    }

    /// Queues a Read of `buf.len` bytes from block `lba` into a buffer the caller keeps: the
    /// command is checked and written to the submission queue like [`IoQueuePair::submit`]'s,
    /// but the doorbell is left for [`IoQueuePair::ring`] (or the next poll), as with
    /// [`IoQueuePair::submit_deferred`].
    ///
    /// The fastest way to submit: the queue pair keeps the buffer's memory alive by pinning
    /// it, one reference count per distinct buffer rather than one per command, so that
    /// commands on the same few buffers touch no shared counter. A pinned buffer stays pinned
    /// (its memory allocated) after its commands complete, until the pin is needed for another
    /// buffer, [`IoQueuePair::release_buffers`] is called or the queue pair is dropped.
    #[inline]
    pub fn queue_read(
        &mut self,
        nsid: u32,
        lba: u64,
        buf: &DmaSlice,
        tag: u64,
    ) -> Result<(), Error> {
        self.queue_rw(NvmOpcode::READ, nsid, lba, buf, tag)
    }

    /// Queues a Write of `buf` to block `lba` onward; see [`IoQueuePair::queue_read`].
    #[inline]
    pub fn queue_write(
        &mut self,
        nsid: u32,
        lba: u64,
        buf: &DmaSlice,
        tag: u64,
    ) -> Result<(), Error> {
        self.queue_rw(NvmOpcode::WRITE, nsid, lba, buf, tag)
    }

    /// Drops the queue pair's pins on buffers that no command in flight uses (see
    /// [`IoQueuePair::queue_read`]), so that their memory can be freed once the caller drops
    /// its own handles; returns how many were dropped.
    pub fn release_buffers(&mut self) -> usize {
        self.qp.unpin_idle()
    }

    /// Reaps finished commands into `out` without blocking; returns how many were added.
    ///
    /// Commands past their deadline come back as [`Error::Timeout`] (and the queue pair is
    /// marked failed); when the controller reports fatal status or vanishes, every command in
    /// flight comes back with [`Error::ControllerFatal`] / [`Error::DeviceGone`]. A completion
    /// the driver cannot attribute fails the queue pair and this call with
    /// [`Error::InvalidCompletion`].
    #[inline]
    pub fn poll(&mut self, out: &mut Vec<IoCompletion>) -> Result<usize, Error> {
        self.qp.ring();
        let before = out.len();
        out.append(&mut self.stash);
        self.qp.reap(usize::MAX, |r: Reaped| {
            if !r.internal {
                out.push(IoCompletion::from(r));
            }
        })?;
        Ok(out.len() - before)
    }

    /// Like [`IoQueuePair::poll`], but hands each finished command to `f` as it is reaped
    /// (its tag and how it ended) instead of collecting them in a `Vec`; returns how many `f`
    /// was given. The same checks, deadlines and errors as [`IoQueuePair::poll`].
    #[inline]
    pub fn poll_with(&mut self, mut f: impl FnMut(u64, Result<(), Error>)) -> Result<usize, Error> {
        self.qp.ring();
        let mut n = 0;
        if !self.stash.is_empty() {
            for c in self.stash.drain(..) {
                f(c.tag, c.result);
                n += 1;
            }
        }
        self.qp.reap(usize::MAX, |r: Reaped| {
            if !r.internal {
                n += 1;
                match r.result {
                    Ok(_) => f(r.tag, Ok(())),
                    Err(e) => f(r.tag, Err(*e)),
                }
            }
        })?;
        Ok(n)
    }

    /// Reaps into `out` until at least `min` commands (or all in flight, if fewer) have
    /// finished; returns how many were added. Bounded: every command has a deadline.
    pub fn wait(&mut self, out: &mut Vec<IoCompletion>, min: usize) -> Result<usize, Error> {
        let target = min.min(self.in_flight());
        let mut got = 0;
        let mut backoff = Backoff::for_io();
        loop {
            let n = self.poll(out)?;
            got += n;
            if got >= target || self.qp.in_flight() == 0 {
                return Ok(got);
            }
            if n > 0 {
                backoff.reset();
            } else {
                backoff.snooze();
            }
        }
    }

    /// Runs `cmds` with as many in flight as the queue allows; returns the first error after
    /// everything submitted has finished. Completions of the caller's own commands that arrive
    /// meanwhile are kept for the next [`IoQueuePair::poll`].
    fn run(&mut self, mut cmds: impl Iterator<Item = IoCommand>) -> Result<(), Error> {
        let mut first_error: Option<Error> = None;
        let mut outstanding = 0usize;
        let mut pending = cmds.next();
        let mut backoff = Backoff::for_io();
        loop {
            while first_error.is_none() && self.qp.in_flight() < self.qp.capacity() {
                let Some(cmd) = pending.take() else { break };
                match self.submit_inner(cmd, 0, true) {
                    Ok(()) => outstanding += 1,
                    Err(e) => first_error = Some(e),
                }
                pending = cmds.next();
            }
            self.qp.ring();
            if outstanding == 0 && (pending.is_none() || first_error.is_some()) {
                return first_error.map_or(Ok(()), Err);
            }
            let stash = &mut self.stash;
            let mut done = 0;
            self.qp.reap(usize::MAX, |r: Reaped| {
                if r.internal {
                    done += 1;
                    if let Err(e) = r.result {
                        first_error.get_or_insert(*e);
                    }
                } else {
                    stash.push(IoCompletion::from(r));
                }
            })?;
            outstanding -= done;
            if done > 0 {
                backoff.reset();
            } else {
                backoff.snooze();
            }
        }
    }

    /// Checks a whole synchronous request up front; returns (namespace block size, chunk bytes).
    fn plan(
        &self,
        nsid: u32,
        lba: u64,
        len: usize,
        offset: usize,
    ) -> Result<(usize, usize), Error> {
        let ns = self.namespace(nsid)?;
        let bs = ns.lba_size as usize;
        if len % bs != 0 {
            return Err(Error::Unaligned {
                what: "buffer length",
                value: len as u64,
                align: bs as u64,
            });
        }
        if offset % 4 != 0 {
            return Err(Error::Unaligned {
                what: "buffer offset",
                value: offset as u64,
                align: 4,
            });
        }
        Self::check_range(ns, lba, (len / bs) as u64)?;
        Ok((bs, self.max_transfer / bs * bs))
    }

    fn rw(&mut self, write: bool, nsid: u32, lba: u64, buf: &DmaSlice) -> Result<(), Error> {
        let (bs, chunk) = self.plan(nsid, lba, buf.len, buf.offset)?;
        let buf = buf.clone();
        let cmds = (0..buf.len).step_by(chunk).map(move |pos| {
            let len = chunk.min(buf.len - pos);
            let part = DmaSlice {
                mem: buf.mem.clone(),
                offset: buf.offset + pos,
                len,
            };
            let lba = lba + (pos / bs) as u64;
            if write {
                IoCommand::Write {
                    nsid,
                    lba,
                    buf: part,
                }
            } else {
                IoCommand::Read {
                    nsid,
                    lba,
                    buf: part,
                }
            }
        });
        self.run(cmds)
    }

    /// Reads `buf.len` bytes from block `lba` into `buf`, split into commands of at most
    /// [`IoQueuePair::max_transfer_bytes`] with many in flight.
    pub fn read(&mut self, nsid: u32, lba: u64, buf: &DmaSlice) -> Result<(), Error> {
        self.rw(false, nsid, lba, buf)
    }

    /// Writes `buf` to block `lba` onward, split like [`IoQueuePair::read`].
    pub fn write(&mut self, nsid: u32, lba: u64, buf: &DmaSlice) -> Result<(), Error> {
        self.rw(true, nsid, lba, buf)
    }

    fn bounce(&mut self, len: usize) -> Result<Arc<DmaMemory>, Error> {
        let want = len.min(MAX_BOUNCE).div_ceil(DMA_PAGE_SIZE) * DMA_PAGE_SIZE;
        match &self.bounce {
            Some(b) if b.len() >= want => Ok(b.clone()),
            _ => {
                let b = Arc::new(self.device.alloc_dma(want)?);
                self.bounce = Some(b.clone());
                Ok(b)
            }
        }
    }

    /// Reads into ordinary memory through a DMA bounce buffer.
    pub fn read_to(&mut self, nsid: u32, lba: u64, out: &mut [u8]) -> Result<(), Error> {
        let (bs, _) = self.plan(nsid, lba, out.len(), 0)?;
        if out.is_empty() {
            return Ok(());
        }
        let bounce = self.bounce(out.len())?;
        let piece = bounce.len() / bs * bs;
        for (i, part) in out.chunks_mut(piece).enumerate() {
            let slice = DmaSlice {
                mem: bounce.clone(),
                offset: 0,
                len: part.len(),
            };
            self.read(nsid, lba + (i * piece / bs) as u64, &slice)?;
            bounce.read(0, part);
        }
        Ok(())
    }

    /// Writes from ordinary memory through a DMA bounce buffer.
    pub fn write_from(&mut self, nsid: u32, lba: u64, data: &[u8]) -> Result<(), Error> {
        let (bs, _) = self.plan(nsid, lba, data.len(), 0)?;
        if data.is_empty() {
            return Ok(());
        }
        let bounce = self.bounce(data.len())?;
        let piece = bounce.len() / bs * bs;
        for (i, part) in data.chunks(piece).enumerate() {
            bounce.write(0, part);
            let slice = DmaSlice {
                mem: bounce.clone(),
                offset: 0,
                len: part.len(),
            };
            self.write(nsid, lba + (i * piece / bs) as u64, &slice)?;
        }
        Ok(())
    }

    /// Flushes the namespace's volatile write cache and waits for it.
    pub fn flush(&mut self, nsid: u32) -> Result<(), Error> {
        self.run(std::iter::once(IoCommand::Flush { nsid }))
    }

    /// Writes zeroes to `blocks` blocks from `lba`, 65536 blocks per command.
    pub fn write_zeroes(&mut self, nsid: u32, lba: u64, blocks: u64) -> Result<(), Error> {
        let ns = self.namespace(nsid)?;
        Self::check_range(ns, lba, blocks)?;
        let cmds = (0..blocks)
            .step_by(MAX_BLOCKS_PER_COMMAND as usize)
            .map(move |done| {
                let n = (blocks - done).min(MAX_BLOCKS_PER_COMMAND) as u32;
                IoCommand::WriteZeroes {
                    nsid,
                    lba: lba + done,
                    blocks: n,
                }
            });
        self.run(cmds)
    }

    /// Deallocates (trims) the given (first block, blocks) ranges, 256 per command.
    pub fn deallocate(&mut self, nsid: u32, ranges: &[(u64, u32)]) -> Result<(), Error> {
        let ns = self.namespace(nsid)?;
        for &(lba, blocks) in ranges {
            Self::check_range(ns, lba, blocks as u64)?;
        }
        let cmds = ranges
            .chunks(DSM_MAX_RANGES)
            .map(|c| IoCommand::Deallocate {
                nsid,
                ranges: c.to_vec(),
            })
            .collect::<Vec<_>>();
        self.run(cmds.into_iter())
    }
}
