//! **Test and benchmark support only**: [`NullDevice`], an inline null NVMe controller that
//! implements [`Device`] and completes commands on the caller's thread, inside the doorbell
//! write, without moving data.
//!
//! It exists to measure the driver's own cost per command (submit + complete) with nothing else
//! in the way: no controller thread, no data copy, no cache line bouncing between cores. It is
//! not a controller to run anything real on — reads return whatever the buffer held, writes go
//! nowhere — and it checks only what it must to stay memory-safe and to let the unchanged
//! bring-up run. For a strict controller with data, use `nvme_emu`.
//!
//! What it does:
//! - Registers: CAP (MQES 4095, CQR, TO 500 ms, DSTRD 0, NVM, 4 KiB pages), VS 1.4, CC, CSTS
//!   (RDY follows CC.EN at once; CC.SHN sets SHST to complete at once), AQA/ASQ/ACQ, and the
//!   doorbells.
//! - An SQ tail doorbell write executes every newly submitted command before it returns, and
//!   posts its completion (phase tag, SQ head, SQ id, CID, status) to the CQ; when the CQ is
//!   full the rest waits for the CQ head doorbell, as on a real controller.
//! - Admin: Identify (controller, namespace 1, active namespace list), Set/Get Features (Number
//!   of Queues), Create/Delete I/O CQ and SQ. Anything else fails with Invalid Command Opcode.
//! - I/O: Read, Write, Flush, Write Zeroes and Dataset Management on namespace 1 succeed at once
//!   with no data movement; other opcodes fail with Invalid Command Opcode, other namespaces
//!   with Invalid Namespace.
//! - [`NullDevice::set_reverse_completions`] posts each doorbell's batch in reverse order, to
//!   exercise out-of-order completion.
//!
//! The admin queue has a lock (`spin::SpinMutex`); the I/O queues have none: a doorbell
//! reaches a queue's state with one pointer load and changes it with plain atomic loads and
//! stores (see `IoQueue`), so a QD 1 round trip costs no atomic read-modify-write. An SQ must
//! post to the CQ of the same id (the driver always asks for that).
//!
//! DMA memory comes from page-aligned heap allocations; device addresses are synthetic (a
//! counter, never host pointers), translated only when a queue is created or admin data is
//! written. An I/O queue's ring memory stays alive until the device is dropped (the admin
//! queue's until it is replaced), so neither a driver that frees ring memory early nor a
//! doorbell racing with a queue's deletion can make the device touch freed memory.
//!
//! A crate of its own, not part of the driver: the driver's cost benchmark (`benches/hot_path.rs`)
//! and example (`examples/driver_cost.rs`) and the tests of `nvme` reach it through a
//! dev-dependency; nothing may depend on it at run time. It uses only the driver's public
//! [`Device`] seam (and [`DmaMemory::from_raw_parts`] for its DMA memory) and carries no
//! stability promise.

// No `unsafe` here (the workspace denies it); the raw memory access lives in `region`, the
// admin queue's lock in `spin`, the lock-free I/O queue states in `published`.
mod published;
mod region;
mod spin;

use nvme::device::{Device, DmaAllocError, RegisterIo};
use nvme::dma::{DMA_PAGE_SIZE, DmaMemory};
use nvme_spec::command::{
    CreateCqCdw11, CreateQueueCdw10, CreateSqCdw11, DeleteQueueCdw10, FeaturesCdw10, IdentifyCdw10,
    NumberOfQueues,
};
use nvme_spec::identify::IDENTIFY_DATA_SIZE;
use nvme_spec::registers as reg;
use nvme_spec::status::{command_specific, generic};
use nvme_spec::wire::{CQE_SIZE, DOORBELL_BASE, SQE_SIZE};
use nvme_spec::{
    ActiveNamespaceList, AdminOpcode, Aqa, Cap, Cc, Cns, Command, CqeStatus, Csts, FeatureId,
    IdentifyController, IdentifyNamespace, LbaFormat, NvmOpcode, Oncs, Status,
};
use published::Published;
use region::{CheckedRing, Region, RingRef, complete_run};
use spin::SpinMutex;
use std::collections::BTreeMap;
use std::sync::atomic::{AtomicBool, AtomicU32, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use zerocopy::{FromZeros, IntoBytes};

/// First synthetic device address handed out.
const IOVA_BASE: u64 = 0x10_0000_0000;
/// CAP.MQES (zero-based): queues of up to 4096 entries.
const MQES_Z: u16 = 4095;
/// The Version the device reports (1.4.0).
const VERSION: u32 = 0x0001_0400;

/// What the null device looks like.
#[derive(Clone, Debug)]
pub struct NullDeviceConfig {
    /// Blocks in namespace 1.
    pub namespace_blocks: u64,
    /// Bytes per block: a power of two in 512..=4096.
    pub lba_size: u32,
    /// I/O queue pairs granted by Set Features (Number of Queues), at most 1024.
    pub max_io_queue_pairs: u16,
    /// Identify Controller MDTS (0: no limit; the driver then caps transfers at 2 MiB).
    pub mdts: u8,
}

impl Default for NullDeviceConfig {
    /// 1 GiB of 512-byte blocks, 64 queue pairs, MDTS 2 MiB.
    fn default() -> Self {
        Self {
            namespace_blocks: (1 << 30) / 512,
            lba_size: 512,
            max_io_queue_pairs: 64,
            mdts: 9,
        }
    }
}

/// The inline null controller (see the crate documentation). **For tests and benchmarks
/// only.**
pub struct NullDevice {
    regs: NullRegisters,
}

impl std::fmt::Debug for NullDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NullDevice")
            .field("config", &self.regs.config)
            .finish()
    }
}

impl NullDevice {
    /// A disabled null controller (CC.EN = 0), ready for `Controller::new`.
    ///
    /// # Panics
    /// If `lba_size` is not a power of two in 512..=4096, the namespace is empty, or more than
    /// 1024 queue pairs are asked for (caller bugs).
    pub fn new(config: NullDeviceConfig) -> Arc<Self> {
        assert!(
            config.lba_size.is_power_of_two() && (512..=4096).contains(&config.lba_size),
            "LBA size must be a power of two in 512..=4096"
        );
        assert!(config.namespace_blocks > 0, "empty namespace");
        assert!(
            (1..=1024).contains(&config.max_io_queue_pairs),
            "1..=1024 I/O queue pairs"
        );
        let io = (0..config.max_io_queue_pairs)
            .map(|_| IoQueue::default())
            .collect();
        Arc::new(Self {
            regs: NullRegisters {
                config,
                cc: AtomicU32::new(0),
                csts: AtomicU32::new(0),
                aqa: AtomicU32::new(0),
                asq: [AtomicU32::new(0), AtomicU32::new(0)],
                acq: [AtomicU32::new(0), AtomicU32::new(0)],
                granted_z: AtomicU32::new(0),
                reverse: AtomicBool::new(false),
                memory: Arc::new(Memory {
                    regions: Mutex::new(BTreeMap::new()),
                    next_iova: AtomicU64::new(IOVA_BASE),
                }),
                admin: SpinMutex::default(),
                io,
            },
        })
    }

    /// Posts each doorbell's batch of completions in reverse submission order from now on (the
    /// SQ head each completion reports is the head after the whole batch).
    pub fn set_reverse_completions(&self, on: bool) {
        self.regs.reverse.store(on, Ordering::Relaxed);
    }

    /// I/O commands (any status) completed so far on the I/O queues that still exist.
    pub fn io_commands_completed(&self) -> u64 {
        self.regs
            .io
            .iter()
            .filter(|q| q.cq.get().is_some())
            .map(|q| q.completed.load(Ordering::Relaxed))
            .sum()
    }

    /// DMA buffers currently allocated and not yet freed by the driver.
    pub fn live_dma_buffers(&self) -> usize {
        lock(&self.regs.memory.regions).len()
    }
}

impl Device for NullDevice {
    fn registers(&self) -> &dyn RegisterIo {
        &self.regs
    }

    fn write_doorbell(&self, offset: usize, value: u32) {
        self.regs.write_u32(offset, value);
    }

    fn alloc_dma(&self, len: usize) -> Result<DmaMemory, DmaAllocError> {
        let len = len.max(1).div_ceil(DMA_PAGE_SIZE) * DMA_PAGE_SIZE;
        let memory = &self.regs.memory;
        // One unmapped page between buffers, so an overrun is a translation failure.
        let iova = memory
            .next_iova
            .fetch_add(len as u64 + DMA_PAGE_SIZE as u64, Ordering::Relaxed);
        let region = Region::new(len, iova).ok_or_else(|| DmaAllocError {
            len,
            reason: "out of memory".into(),
            source: None,
        })?;
        let region = Arc::new(region);
        lock(&memory.regions).insert(iova, region.clone());
        let owner = NullDmaOwner {
            region: region.clone(),
            memory: Arc::downgrade(memory),
        };
        Ok(Region::dma_memory(&region, Box::new(owner)))
    }

    fn describe(&self) -> String {
        "inline null device (test/bench only: completes on the doorbell write, moves no data)"
            .into()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Every live DMA buffer by device address.
struct Memory {
    regions: Mutex<BTreeMap<u64, Arc<Region>>>,
    next_iova: AtomicU64,
}

impl Memory {
    /// The region holding `len` bytes at device address `addr`, and the offset in it.
    fn translate(&self, addr: u64, len: usize) -> Option<(Arc<Region>, usize)> {
        let regions = lock(&self.regions);
        let (_, region) = regions.range(..=addr).next_back()?;
        let offset = usize::try_from(addr - region.iova()).ok()?;
        (offset.checked_add(len)? <= region.len()).then(|| (region.clone(), offset))
    }
}

/// Keeps a DMA buffer's region alive and registered; unregisters it when the driver drops the
/// buffer.
struct NullDmaOwner {
    region: Arc<Region>,
    memory: Weak<Memory>,
}

impl Drop for NullDmaOwner {
    fn drop(&mut self) {
        if let Some(memory) = self.memory.upgrade() {
            lock(&memory.regions).remove(&self.region.iova());
        }
    }
}

/// A ring in DMA memory, as the device tracks it.
struct Ring {
    /// The ring's memory, checked to fit once (at creation).
    mem: CheckedRing,
    /// Byte offset of the ring in its region.
    offset: usize,
    /// SQ: next entry to fetch; CQ: head from the doorbell.
    head: u32,
    /// SQ: tail from the doorbell; CQ: next entry to post.
    tail: u32,
}

impl Ring {
    /// Number of entries.
    fn entries(&self) -> u32 {
        self.mem.view().entries()
    }

    /// The ring of `entries` entries of `stride` bytes at `offset` of `region`, or `None` if it
    /// does not fit.
    fn new(region: Arc<Region>, offset: usize, entries: u32, stride: usize) -> Option<Self> {
        Some(Self {
            mem: CheckedRing::new(region, offset, entries, stride)?,
            offset,
            head: 0,
            tail: 0,
        })
    }
}

/// I/O queue pair `qid`: its SQ and the CQ it posts to (same id), each published lock-free
/// ([`Published`]) while it exists.
///
/// Why no lock: both doorbells of a queue pair are rung by the thread driving it (the driver
/// takes `&mut` for them), once per batch and once per reap round, and an uncontended lock is
/// an atomic read-modify-write (11 ns on the GPU machine's host), which would count against
/// the driver whose cost this device exists to measure. So the heads, tails and phase are
/// atomics read and written with plain loads and stores, never read-modify-writes. Two threads
/// ringing one queue's doorbells at once is a driver bug, after which completions may be lost
/// or repeated; it is never memory-unsafe: every ring index is checked against its ring, whose
/// memory a published queue keeps alive until the device is dropped.
#[derive(Default)]
struct IoQueue {
    sq: Published<IoSq>,
    cq: Published<IoCq>,
    /// Commands completed since the CQ was created (a statistic: load and store, no
    /// read-modify-write).
    completed: AtomicU64,
}

/// An I/O submission queue, as the device tracks it. Heads and tails are below the ring's
/// entry count (every value stored is).
struct IoSq {
    /// The ring's memory, checked to fit once (at creation).
    ring: CheckedRing,
    /// Next entry to fetch.
    head: AtomicU32,
    /// The tail from the doorbell.
    tail: AtomicU32,
}

/// An I/O completion queue, as the device tracks it.
struct IoCq {
    /// The ring's memory, checked to fit once (at creation).
    ring: CheckedRing,
    /// The head from the doorbell.
    head: AtomicU32,
    /// Next entry to post.
    tail: AtomicU32,
    /// Phase tag of the next completion posted.
    phase: AtomicBool,
    /// An SQ doorbell left commands unexecuted for want of room: the next head doorbell runs
    /// them.
    full: AtomicBool,
}

/// The admin queue's state: its submission and completion queues.
#[derive(Default)]
struct AdminQueue {
    sq: Option<Ring>,
    cq: Option<Ring>,
    /// Phase tag of the next completion posted.
    phase: bool,
    completed: u64,
}

impl AdminQueue {
    /// Entries the CQ can still take.
    fn cq_room(cq: &Ring) -> u32 {
        (cq.head + cq.entries() - cq.tail - 1) % cq.entries()
    }

    /// Posts one completion (dword 3 last, with Release).
    fn post(&mut self, qid: u16, sqhd: u32, cid: u16, status: Status, dw0: u32) {
        let Some(cq) = &mut self.cq else { return };
        let st = CqeStatus::from_status(status, self.phase).into_bits();
        cq.mem.region().store_cqe(
            cq.offset + cq.tail as usize * CQE_SIZE,
            [
                dw0,
                0,
                sqhd | (qid as u32) << 16,
                cid as u32 | (st as u32) << 16,
            ],
        );
        cq.tail += 1;
        if cq.tail == cq.entries() {
            cq.tail = 0;
            self.phase = !self.phase;
        }
        self.completed += 1;
    }
}

/// How the null device completes an I/O command: success for the NVM commands it knows on
/// namespace 1 (Flush also on all namespaces), else the status a controller would give.
fn io_status(opcode: NvmOpcode, nsid: u32) -> Status {
    let known = matches!(
        opcode,
        NvmOpcode::READ
            | NvmOpcode::WRITE
            | NvmOpcode::FLUSH
            | NvmOpcode::WRITE_ZEROES
            | NvmOpcode::DATASET_MANAGEMENT
    );
    if !known {
        Status::generic(generic::INVALID_COMMAND_OPCODE)
    } else if nsid == 1 || (opcode == NvmOpcode::FLUSH && nsid == u32::MAX) {
        Status::SUCCESS
    } else {
        Status::generic(generic::INVALID_NAMESPACE_OR_FORMAT)
    }
}

/// Identify Controller of the null device.
fn identify_controller(config: &NullDeviceConfig) -> IdentifyController {
    let mut id = IdentifyController::new_zeroed();
    let field = |dst: &mut [u8], s: &str| {
        dst.fill(b' ');
        dst[..s.len()].copy_from_slice(s.as_bytes());
    };
    id.vid = 0x1b36;
    id.ssvid = 0x1b36;
    field(&mut id.sn, "NULL0001");
    field(&mut id.mn, "gpunvme inline null device");
    field(&mut id.fr, "1.0");
    id.mdts = config.mdts;
    id.cntlid = 1;
    id.ver = VERSION;
    id.cntrltype = 1;
    id.sqes = 0x66;
    id.cqes = 0x44;
    id.nn = 1;
    id.oncs = (Oncs::DATASET_MANAGEMENT | Oncs::WRITE_ZEROES).bits();
    id.vwc = 0b111;
    id
}

/// Identify Namespace of namespace 1.
fn identify_namespace(config: &NullDeviceConfig) -> IdentifyNamespace {
    let mut id = IdentifyNamespace::new_zeroed();
    id.nsze = config.namespace_blocks;
    id.ncap = config.namespace_blocks;
    id.nuse = config.namespace_blocks;
    id.lbaf[0] = LbaFormat {
        ms: 0,
        lbads: config.lba_size.trailing_zeros() as u8,
        rp: 0,
    };
    id
}

/// The register window, and the controller behind it.
struct NullRegisters {
    config: NullDeviceConfig,
    cc: AtomicU32,
    csts: AtomicU32,
    aqa: AtomicU32,
    asq: [AtomicU32; 2],
    acq: [AtomicU32; 2],
    /// Number of Queues granted (the NumberOfQueues value).
    granted_z: AtomicU32,
    reverse: AtomicBool,
    memory: Arc<Memory>,
    /// The admin queue, behind a lock (admin commands are rare and may come from any thread).
    admin: SpinMutex<AdminQueue>,
    /// I/O queue pair `qid` at index `qid - 1`.
    io: Box<[IoQueue]>,
}

type Outcome = Result<u32, Status>;

fn invalid_field() -> Status {
    Status::generic(generic::INVALID_FIELD_IN_COMMAND)
}

impl NullRegisters {
    fn cap(&self) -> u64 {
        Cap::new()
            .with_mqes_z(MQES_Z)
            .with_cqr(true)
            .with_to(1)
            .with_dstrd(0)
            .with_css(Cap::CSS_NVM)
            .with_mpsmin(0)
            .with_mpsmax(0)
            .into_bits()
    }

    fn set_cc(&self, value: u32) {
        let old = Cc::from(self.cc.swap(value, Ordering::AcqRel));
        let new = Cc::from(value);
        if old.en() && !new.en() {
            // Controller reset: every queue goes away (under the admin lock, so that no admin
            // command creates one meanwhile).
            let mut admin = self.admin.lock();
            *admin = AdminQueue::default();
            for q in self.io.iter() {
                q.sq.clear();
                q.cq.clear();
            }
            drop(admin);
            self.granted_z.store(0, Ordering::Relaxed);
            self.csts.store(0, Ordering::Release);
            return;
        }
        if !old.en() && new.en() {
            let ready = self.enable(new);
            let csts = Csts::new().with_rdy(ready).with_cfs(!ready);
            self.csts.store(csts.into(), Ordering::Release);
        }
        if new.en() && new.shn() != Cc::SHN_NONE {
            let csts = Csts::from(self.csts.load(Ordering::Acquire)).with_shst(Csts::SHST_COMPLETE);
            self.csts.store(csts.into(), Ordering::Release);
        }
    }

    /// CC.EN 0 → 1: sets up the admin queues from AQA/ASQ/ACQ. False if they are unusable.
    fn enable(&self, cc: Cc) -> bool {
        if cc.mps() != 0 || cc.iosqes() != 6 || cc.iocqes() != 4 || cc.css() != Cc::CSS_NVM {
            return false;
        }
        let aqa = Aqa::from(self.aqa.load(Ordering::Relaxed));
        let (sq_entries, cq_entries) = (aqa.asqs_z() as u32 + 1, aqa.acqs_z() as u32 + 1);
        let addr = |r: &[AtomicU32; 2]| {
            r[0].load(Ordering::Relaxed) as u64 | (r[1].load(Ordering::Relaxed) as u64) << 32
        };
        let sq = self
            .memory
            .translate(addr(&self.asq), sq_entries as usize * SQE_SIZE);
        let cq = self
            .memory
            .translate(addr(&self.acq), cq_entries as usize * CQE_SIZE);
        let (Some((sq, sq_off)), Some((cq, cq_off))) = (sq, cq) else {
            return false;
        };
        if sq_entries < 2 || cq_entries < 2 || sq_off % DMA_PAGE_SIZE != 0 {
            return false;
        }
        let (Some(sq), Some(cq)) = (
            Ring::new(sq, sq_off, sq_entries, SQE_SIZE),
            Ring::new(cq, cq_off, cq_entries, CQE_SIZE),
        ) else {
            return false;
        };
        *self.admin.lock() = AdminQueue {
            sq: Some(sq),
            cq: Some(cq),
            phase: true,
            completed: 0,
        };
        true
    }

    /// A doorbell write at `offset` (at or past `DOORBELL_BASE`). Kept small and inline in
    /// `write_u32`: the I/O CQ head doorbell, rung once per reap round, is a few loads and a
    /// store with no register spills; SQ tail and admin doorbells go out of line.
    #[inline(always)]
    fn doorbell(&self, offset: usize, value: u32) {
        let index = (offset - DOORBELL_BASE) / 4;
        let qid = index / 2;
        if offset % 4 != 0 || qid > self.io.len() {
            bad_register(offset);
        }
        if !Csts::from(self.csts.load(Ordering::Acquire)).rdy() {
            return;
        }
        let Some(q) = qid.checked_sub(1).and_then(|i| self.io.get(i)) else {
            self.admin_doorbell(index, value);
            return;
        };
        if index % 2 == 0 {
            self.io_sq_doorbell(q, qid as u16, value);
            return;
        }
        // An I/O CQ head doorbell: a store, and more only when commands wait for room. A
        // doorbell of a queue that does not exist, or a value beyond the ring, is ignored (a
        // real controller would raise an asynchronous event).
        let Some(cq) = q.cq.get() else { return };
        if value >= cq.ring.view().entries() {
            return;
        }
        cq.head.store(value, Ordering::Relaxed);
        if cq.full.load(Ordering::Relaxed) {
            self.run_waiting(q, qid as u16);
        }
    }

    /// The CQ head moved while commands wait for CQ room: runs them.
    #[cold]
    #[inline(never)]
    fn run_waiting(&self, q: &IoQueue, qid: u16) {
        if let (Some(sq), Some(cq)) = (q.sq.get(), q.cq.get()) {
            self.run_io(q, sq, cq, qid);
        }
    }

    /// An admin SQ tail or CQ head doorbell (`index` 0 or 1), under the admin queue's lock.
    #[inline(never)]
    fn admin_doorbell(&self, index: usize, value: u32) {
        let mut guard = self.admin.lock();
        let slot = &mut *guard;
        let ring = if index % 2 == 0 {
            &mut slot.sq
        } else {
            &mut slot.cq
        };
        // A doorbell of a queue that does not exist, or a value beyond the ring, is ignored
        // (a real controller would raise an asynchronous event).
        let Some(ring) = ring else { return };
        if value >= ring.entries() {
            return;
        }
        if index % 2 == 0 {
            ring.tail = value;
        } else {
            ring.head = value;
        }
        self.run_admin(slot);
    }

    /// An I/O SQ tail doorbell of `value`. The QD 1 round trip (one new command, completions
    /// in order, room in the CQ) is completed here with one SQE load and one CQE store;
    /// anything else goes to [`Self::run_io`]'s general loop.
    #[inline(never)]
    fn io_sq_doorbell(&self, q: &IoQueue, qid: u16, value: u32) {
        let (Some(sq), Some(cq)) = (q.sq.get(), q.cq.get()) else {
            return;
        };
        let sq_ring = sq.ring.view();
        let entries = sq_ring.entries();
        if value >= entries {
            return;
        }
        let head = sq.head.load(Ordering::Relaxed);
        // Nothing was pending (so no command waits for CQ room either) and exactly one is new.
        let single = sq.tail.load(Ordering::Relaxed) == head
            && value == if head + 1 == entries { 0 } else { head + 1 };
        sq.tail.store(value, Ordering::Relaxed);
        if single && !self.reverse.load(Ordering::Relaxed) {
            let cq_ring = cq.ring.view();
            let tail = cq.tail.load(Ordering::Relaxed);
            let next = if tail + 1 == cq_ring.entries() {
                0
            } else {
                tail + 1
            };
            if next != cq.head.load(Ordering::Relaxed) {
                let qw0 = sq_ring.load_u64(head);
                let phase = cq.phase.load(Ordering::Relaxed);
                let dw2 = value | (qid as u32) << 16;
                cq_ring.store_cqe(tail, Self::io_cqe(qw0, dw2, phase as u32));
                cq.tail.store(next, Ordering::Relaxed);
                if next == 0 {
                    cq.phase.store(!phase, Ordering::Relaxed);
                }
                let done = q.completed.load(Ordering::Relaxed);
                q.completed.store(done + 1, Ordering::Relaxed);
                sq.head.store(value, Ordering::Relaxed);
                return;
            }
        }
        self.run_io(q, sq, cq, qid);
    }

    /// Completes the I/O commands between the SQ head and tail, as far as the CQ has room.
    ///
    /// Out of line and with its per-command loop kept to loads, compares and stores: it runs
    /// inside every doorbell write the benchmarks make, and its cost counts against the driver's.
    #[inline(never)]
    fn run_io(&self, q: &IoQueue, sq: &IoSq, cq: &IoCq, qid: u16) {
        let (head, tail) = (
            sq.head.load(Ordering::Relaxed),
            sq.tail.load(Ordering::Relaxed),
        );
        // Nothing submitted: the usual case of a CQ head doorbell.
        if head == tail {
            return;
        }
        let (sq_ring, cq_ring) = (sq.ring.view(), cq.ring.view());
        let (sq_entries, cq_entries) = (sq_ring.entries(), cq_ring.entries());
        // Ring distances without divisions (heads and tails are below the entry counts).
        let gap = |from: u32, to: u32, entries: u32| {
            if to >= from {
                to - from
            } else {
                to + entries - from
            }
        };
        let cq_tail = cq.tail.load(Ordering::Relaxed);
        let pending = gap(head, tail, sq_entries);
        let cq_room = gap(cq_tail, cq.head.load(Ordering::Relaxed), cq_entries)
            .checked_sub(1)
            .unwrap_or(cq_entries - 1);
        let n = pending.min(cq_room);
        let full = n < pending;
        if full != cq.full.load(Ordering::Relaxed) {
            cq.full.store(full, Ordering::Relaxed);
        }
        if n == 0 {
            return;
        }
        let end = if head + n >= sq_entries {
            head + n - sq_entries
        } else {
            head + n
        };
        let sqid = (qid as u32) << 16;
        let phase = cq.phase.load(Ordering::Relaxed);
        let (new_tail, ph) = if self.reverse.load(Ordering::Relaxed) {
            Self::complete_reversed(&sq_ring, &cq_ring, head, n, end, sqid, (cq_tail, phase))
        } else {
            Self::complete_in_order(&sq_ring, &cq_ring, head, n, sqid, (cq_tail, phase))
        };
        cq.tail.store(new_tail, Ordering::Relaxed);
        cq.phase.store(ph, Ordering::Relaxed);
        let done = q.completed.load(Ordering::Relaxed);
        q.completed.store(done + n as u64, Ordering::Relaxed);
        sq.head.store(end, Ordering::Relaxed);
    }

    /// The completion of an I/O command whose SQE starts with `qw0` (CDW0 and NSID: all the
    /// null device looks at): dword 2 as given (SQ head and SQ id), dword 3 the CID and the
    /// status of [`Self::status_of`] with phase tag `ph`.
    #[inline(always)]
    fn io_cqe(qw0: u64, dw2: u32, ph: u32) -> [u32; 4] {
        let cid = (qw0 >> 16) as u16 as u32;
        [0, 0, dw2, cid | Self::status_of(qw0, ph) << 16]
    }

    /// The status field (phase tag included) of the completion for an SQE whose first quadword
    /// (CDW0 and NSID) is `qw0`: Successful Completion, a status of zero but for the phase tag,
    /// for a Read or Write on namespace 1 (one compare on the opcode byte and the NSID), else
    /// what [`io_status`] says.
    #[inline(always)]
    fn status_of(qw0: u64, ph: u32) -> u32 {
        // Opcode (bits 0..8) and NSID (bits 32..64): Write (1) or Read (2) on NSID 1.
        const OPCODE_AND_NSID: u64 = 0xffff_ffff_0000_00ff;
        const WRITE_NS1: u64 = 1 << 32 | NvmOpcode::WRITE.0 as u64;
        const _: () = assert!(NvmOpcode::READ.0 == NvmOpcode::WRITE.0 + 1);
        if (qw0 & OPCODE_AND_NSID).wrapping_sub(WRITE_NS1) < 2 {
            ph
        } else {
            let (opcode, nsid) = (NvmOpcode(qw0 as u8), (qw0 >> 32) as u32);
            CqeStatus::from_status(io_status(opcode, nsid), ph != 0).into_bits() as u32
        }
    }

    /// Completes `n` commands from SQ entry `head` on, in order; each completion reports the SQ
    /// head just past its own entry. Returns the CQ's new tail and phase. Commands are taken in
    /// runs that end where either ring wraps, so that the rings' indices are checked and
    /// wrapped once per run ([`complete_run`]).
    fn complete_in_order(
        sq: &RingRef<'_>,
        cq: &RingRef<'_>,
        head: u32,
        n: u32,
        sqid: u32,
        (mut tail, mut ph): (u32, bool),
    ) -> (u32, bool) {
        let (sq_entries, cq_entries) = (sq.entries(), cq.entries());
        let mut index = head;
        let mut left = n;
        while left > 0 {
            let run = left.min(cq_entries - tail).min(sq_entries - index);
            let phase = ph as u32;
            complete_run(sq, cq, index, tail, run, |k, qw0| {
                // CDW0 (opcode, CID) and the NSID: all the null device looks at.
                let next = index + k + 1;
                let sqhd = if next == sq_entries { 0 } else { next };
                Self::io_cqe(qw0, sqhd | sqid, phase)
            });
            left -= run;
            index += run;
            if index == sq_entries {
                index = 0;
            }
            tail += run;
            if tail == cq_entries {
                tail = 0;
                ph = !ph;
            }
        }
        (tail, ph)
    }

    /// Completes `n` commands from SQ entry `head` on, last first; every completion reports
    /// the SQ head after the whole batch (`end`). Returns the CQ's new tail and phase.
    fn complete_reversed(
        sq: &RingRef<'_>,
        cq: &RingRef<'_>,
        head: u32,
        n: u32,
        end: u32,
        sqid: u32,
        (mut tail, mut ph): (u32, bool),
    ) -> (u32, bool) {
        let entries = sq.entries();
        for k in (0..n).rev() {
            let index = if head + k >= entries {
                head + k - entries
            } else {
                head + k
            };
            let qw0 = sq.load_u64(index);
            cq.store_cqe(tail, Self::io_cqe(qw0, end | sqid, ph as u32));
            tail += 1;
            if tail == cq.entries() {
                tail = 0;
                ph = !ph;
            }
        }
        (tail, ph)
    }

    /// Executes admin commands one at a time, as far as the admin CQ has room.
    fn run_admin(&self, slot: &mut AdminQueue) {
        loop {
            let (Some(sq), Some(cq)) = (&mut slot.sq, &slot.cq) else {
                return;
            };
            if sq.head == sq.tail || AdminQueue::cq_room(cq) == 0 {
                return;
            }
            let cmd = sq
                .mem
                .region()
                .read_command(sq.offset + sq.head as usize * SQE_SIZE);
            sq.head = (sq.head + 1) % sq.entries();
            let sqhd = sq.head;
            let (status, dw0) = match self.admin(&cmd) {
                Ok(dw0) => (Status::SUCCESS, dw0),
                Err(status) => (status, 0),
            };
            slot.post(0, sqhd, cmd.cdw0.cid(), status, dw0);
        }
    }

    fn admin(&self, cmd: &Command) -> Outcome {
        match AdminOpcode(cmd.cdw0.opcode()) {
            AdminOpcode::IDENTIFY => self.identify(cmd),
            AdminOpcode::SET_FEATURES | AdminOpcode::GET_FEATURES => self.features(cmd),
            AdminOpcode::CREATE_IO_CQ => self.create_queue(cmd, false),
            AdminOpcode::CREATE_IO_SQ => self.create_queue(cmd, true),
            AdminOpcode::DELETE_IO_SQ => self.delete_queue(cmd, true),
            AdminOpcode::DELETE_IO_CQ => self.delete_queue(cmd, false),
            _ => Err(Status::generic(generic::INVALID_COMMAND_OPCODE)),
        }
    }

    fn identify(&self, cmd: &Command) -> Outcome {
        let cns = Cns(IdentifyCdw10::from(cmd.cdw10).cns());
        let invalid_ns = || Status::generic(generic::INVALID_NAMESPACE_OR_FORMAT);
        let page: Box<[u8]> = match cns {
            Cns::CONTROLLER => identify_controller(&self.config).as_bytes().into(),
            Cns::NAMESPACE if cmd.nsid == 1 => identify_namespace(&self.config).as_bytes().into(),
            Cns::NAMESPACE => return Err(invalid_ns()),
            Cns::ACTIVE_NAMESPACES if cmd.nsid >= 0xffff_fffe => return Err(invalid_ns()),
            Cns::ACTIVE_NAMESPACES => {
                let mut list = ActiveNamespaceList::new_zeroed();
                if cmd.nsid == 0 {
                    list.nsids[0] = 1;
                }
                list.as_bytes().into()
            }
            _ => return Err(invalid_field()),
        };
        self.send(cmd, &page)?;
        Ok(0)
    }

    /// Writes `data` (at most two pages' worth) to the command's PRP1/PRP2.
    fn send(&self, cmd: &Command, data: &[u8]) -> Result<(), Status> {
        debug_assert_eq!(data.len(), IDENTIFY_DATA_SIZE);
        let first = DMA_PAGE_SIZE - (cmd.prp1 % DMA_PAGE_SIZE as u64) as usize;
        let first = first.min(data.len());
        let transfer_error = || Status::generic(generic::DATA_TRANSFER_ERROR);
        let (region, offset) = self
            .memory
            .translate(cmd.prp1, first)
            .ok_or_else(transfer_error)?;
        region.write(offset, &data[..first]);
        if first < data.len() {
            let rest = &data[first..];
            let (region, offset) = self
                .memory
                .translate(cmd.prp2, rest.len())
                .ok_or_else(transfer_error)?;
            region.write(offset, rest);
        }
        Ok(())
    }

    fn features(&self, cmd: &Command) -> Outcome {
        if FeatureId(FeaturesCdw10::from(cmd.cdw10).fid()) != FeatureId::NUMBER_OF_QUEUES {
            return Err(invalid_field());
        }
        if AdminOpcode(cmd.cdw0.opcode()) == AdminOpcode::SET_FEATURES {
            let asked = NumberOfQueues::from(cmd.cdw11);
            if asked.nsq_z() == u16::MAX || asked.ncq_z() == u16::MAX {
                return Err(invalid_field());
            }
            let max_z = self.config.max_io_queue_pairs - 1;
            let granted = NumberOfQueues::new()
                .with_nsq_z(asked.nsq_z().min(max_z))
                .with_ncq_z(asked.ncq_z().min(max_z));
            self.granted_z.store(granted.into(), Ordering::Relaxed);
        }
        Ok(self.granted_z.load(Ordering::Relaxed))
    }

    fn create_queue(&self, cmd: &Command, sq: bool) -> Outcome {
        let cdw10 = CreateQueueCdw10::from(cmd.cdw10);
        let qid = cdw10.qid();
        let granted = NumberOfQueues::from(self.granted_z.load(Ordering::Relaxed));
        let limit = if sq { granted.nsq_z() } else { granted.ncq_z() };
        let invalid_qid = || Status::command_specific(command_specific::INVALID_QUEUE_IDENTIFIER);
        if qid == 0 || qid as usize > self.io.len() || qid > limit + 1 {
            return Err(invalid_qid());
        }
        if cdw10.qsize_z() == 0 || cdw10.qsize_z() > MQES_Z {
            return Err(Status::command_specific(
                command_specific::INVALID_QUEUE_SIZE,
            ));
        }
        let contiguous = if sq {
            CreateSqCdw11::from(cmd.cdw11).pc()
        } else {
            CreateCqCdw11::from(cmd.cdw11).pc()
        };
        if !contiguous || cmd.prp1 % DMA_PAGE_SIZE as u64 != 0 {
            return Err(invalid_field());
        }
        let entries = cdw10.qsize_z() as u32 + 1;
        let size = if sq { SQE_SIZE } else { CQE_SIZE };
        let ring = self
            .memory
            .translate(cmd.prp1, entries as usize * size)
            .and_then(|(region, offset)| CheckedRing::new(region, offset, entries, size))
            .ok_or(invalid_field())?;
        // Admin commands run one at a time (under the admin queue's lock), so nothing else
        // creates or deletes this queue meanwhile.
        let q = &self.io[qid as usize - 1];
        if sq {
            // Only the CQ of the same id (what the driver always creates).
            if CreateSqCdw11::from(cmd.cdw11).cqid() != qid || q.cq.get().is_none() {
                return Err(Status::command_specific(
                    command_specific::COMPLETION_QUEUE_INVALID,
                ));
            }
            if q.sq.get().is_some() {
                return Err(invalid_qid());
            }
            q.sq.set(IoSq {
                ring,
                head: AtomicU32::new(0),
                tail: AtomicU32::new(0),
            });
        } else {
            if q.cq.get().is_some() {
                return Err(invalid_qid());
            }
            q.completed.store(0, Ordering::Relaxed);
            q.cq.set(IoCq {
                ring,
                head: AtomicU32::new(0),
                tail: AtomicU32::new(0),
                phase: AtomicBool::new(true),
                full: AtomicBool::new(false),
            });
        }
        Ok(0)
    }

    fn delete_queue(&self, cmd: &Command, sq: bool) -> Outcome {
        let qid = DeleteQueueCdw10::from(cmd.cdw10).qid();
        let invalid_qid = || Status::command_specific(command_specific::INVALID_QUEUE_IDENTIFIER);
        let Some(q) = (qid as usize).checked_sub(1).and_then(|i| self.io.get(i)) else {
            return Err(invalid_qid());
        };
        // The queue's memory stays alive (see [`IoQueue`]): a doorbell racing with the deletion
        // still finds valid rings.
        if sq {
            q.sq.get().ok_or_else(invalid_qid)?;
            q.sq.clear();
        } else {
            if q.sq.get().is_some() {
                return Err(Status::command_specific(
                    command_specific::INVALID_QUEUE_DELETION,
                ));
            }
            q.cq.get().ok_or_else(invalid_qid)?;
            q.cq.clear();
        }
        Ok(0)
    }
}

impl RegisterIo for NullRegisters {
    fn len(&self) -> usize {
        DOORBELL_BASE + 2 * 4 * (self.io.len() + 1)
    }

    fn read_u32(&self, offset: usize) -> u32 {
        assert!(
            offset % 4 == 0 && offset < self.len(),
            "register {offset:#x}"
        );
        match offset {
            reg::CAP => self.cap() as u32,
            o if o == reg::CAP + 4 => (self.cap() >> 32) as u32,
            reg::VS => VERSION,
            reg::CC => self.cc.load(Ordering::Acquire),
            reg::CSTS => self.csts.load(Ordering::Acquire),
            reg::AQA => self.aqa.load(Ordering::Relaxed),
            o if o == reg::ASQ || o == reg::ASQ + 4 => {
                self.asq[(o - reg::ASQ) / 4].load(Ordering::Relaxed)
            }
            o if o == reg::ACQ || o == reg::ACQ + 4 => {
                self.acq[(o - reg::ACQ) / 4].load(Ordering::Relaxed)
            }
            _ => 0,
        }
    }

    fn write_u32(&self, offset: usize, value: u32) {
        if offset >= DOORBELL_BASE {
            self.doorbell(offset, value);
        } else {
            self.write_register(offset, value);
        }
    }
}

/// A register offset outside the window or not dword-aligned: a driver bug.
#[cold]
#[inline(never)]
fn bad_register(offset: usize) -> ! {
    panic!("register {offset:#x}")
}

impl NullRegisters {
    /// A write below the doorbells (CC, AQA, ASQ, ACQ; the rest are read-only or ignored).
    #[inline(never)]
    fn write_register(&self, offset: usize, value: u32) {
        if offset % 4 != 0 {
            bad_register(offset);
        }
        match offset {
            reg::CC => self.set_cc(value),
            reg::AQA => self.aqa.store(value, Ordering::Relaxed),
            o if o == reg::ASQ || o == reg::ASQ + 4 => {
                self.asq[(o - reg::ASQ) / 4].store(value, Ordering::Relaxed)
            }
            o if o == reg::ACQ || o == reg::ACQ + 4 => {
                self.acq[(o - reg::ACQ) / 4].store(value, Ordering::Relaxed)
            }
            _ => {}
        }
    }
}
