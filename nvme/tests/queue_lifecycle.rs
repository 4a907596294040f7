//! Queue pairs on caller-supplied rings against the software controller: creation with
//! `Controller::create_queue_pair_on`, a Read and a Write driven by hand at `nvme_spec::wire`
//! offsets, the typed refusals, queue id exhaustion and reuse, the undo of refused and lost
//! creations, shutdown, and CPU queue pairs on the same controller.

use anyhow::{Context, Result, bail, ensure};
use nvme::nvme_spec::NvmOpcode;
use nvme::nvme_spec::registers::CAP;
use nvme::nvme_spec::wire::{
    CQE_SIZE, CQE_SQ_DWORD, CQE_STATUS_DWORD, CQE_STATUS_DWORD_PHASE_BIT, SQE_CDW10, SQE_CDW11,
    SQE_CDW12, SQE_CID, SQE_FLAGS, SQE_NSID, SQE_OPC, SQE_PRP1, SQE_PRP2, SQE_SIZE,
    sq_tail_doorbell,
};
use nvme::{
    Controller, ControllerOptions, CreatedQueuePair, DMA_PAGE_SIZE, Device, DmaAllocError,
    DmaMemory, DmaRegion, Error, QueueRegions, RegisterIo,
};
use nvme_emu::{EmuConfig, EmuDevice};
use std::sync::Arc;
use std::sync::atomic::{AtomicU32, Ordering, fence};
use std::time::{Duration, Instant};

fn fast_opts() -> ControllerOptions {
    ControllerOptions {
        admin_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(5),
        ..ControllerOptions::default()
    }
}

fn start(cfg: EmuConfig) -> Result<(Arc<EmuDevice>, Controller)> {
    let emu = EmuDevice::start(cfg).context("starting the software controller")?;
    let dev: Arc<dyn Device> = emu.clone();
    let ctrl = Controller::new(dev, fast_opts()).context("bringing the controller up")?;
    Ok((emu, ctrl))
}

fn pattern(seed: u8, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u8).wrapping_mul(31).wrapping_add(seed))
        .collect()
}

/// Rings in host DMA memory, handed to the controller as regions.
fn rings(ctrl: &Controller, sq_entries: u32, cq_entries: u32) -> Result<(DmaMemory, DmaMemory)> {
    let dev = ctrl.device();
    Ok((
        dev.alloc_dma(sq_entries as usize * SQE_SIZE)?,
        dev.alloc_dma(cq_entries as usize * CQE_SIZE)?,
    ))
}

fn regions(sq: &DmaMemory, sq_entries: u32, cq: &DmaMemory, cq_entries: u32) -> QueueRegions {
    QueueRegions {
        sq: Arc::clone(sq.region()),
        sq_entries,
        cq: Arc::clone(cq.region()),
        cq_entries,
    }
}

/// One completion, decoded from the raw entry.
#[derive(Debug)]
struct RawCompletion {
    cid: u16,
    sqid: u16,
    /// Status field without the phase tag (0: Successful Completion).
    status: u16,
}

/// A queue pair created on caller-supplied rings and driven by hand, the way a GPU thread or
/// another process would: SQEs written at wire offsets, doorbells written through BAR0.
struct HandDriven {
    pair: CreatedQueuePair,
    sq: DmaMemory,
    cq: DmaMemory,
    regs: Arc<dyn Device>,
    tail: u32,
    head: u32,
    phase: bool,
}

impl HandDriven {
    fn create(ctrl: &Controller, entries: u32) -> Result<Self> {
        let (sq, cq) = rings(ctrl, entries, entries)?;
        let pair = ctrl.create_queue_pair_on(regions(&sq, entries, &cq, entries))?;
        Ok(Self {
            pair,
            sq,
            cq,
            regs: ctrl.device().clone(),
            tail: 0,
            head: 0,
            phase: true,
        })
    }

    /// Writes one Read or Write of `blocks` blocks at `lba` into the SQ and rings the doorbell.
    fn submit(&mut self, opcode: NvmOpcode, cid: u16, lba: u64, blocks: u16, buf: &DmaMemory) {
        let base = self.tail as usize * SQE_SIZE;
        let sq = &self.sq;
        sq.fill(base, SQE_SIZE, 0);
        sq.write(base + SQE_OPC, &[opcode.0]);
        sq.write(base + SQE_FLAGS, &[0]); // FUSE = 0, PSDT = 0 (PRPs)
        sq.write(base + SQE_CID, &cid.to_le_bytes());
        sq.store_u32(base + SQE_NSID, 1, Ordering::Relaxed);
        sq.store_u64(base + SQE_PRP1, buf.device_address(0), Ordering::Relaxed);
        sq.store_u64(base + SQE_PRP2, 0, Ordering::Relaxed);
        sq.store_u32(base + SQE_CDW10, lba as u32, Ordering::Relaxed);
        sq.store_u32(base + SQE_CDW11, (lba >> 32) as u32, Ordering::Relaxed);
        sq.store_u32(base + SQE_CDW12, (blocks - 1) as u32, Ordering::Relaxed);
        self.tail = (self.tail + 1) % self.pair.sq_entries();
        // Release: the entry is visible to the controller before the new tail.
        fence(Ordering::Release);
        self.regs
            .registers()
            .write_u32(self.pair.sq_tail_doorbell(), self.tail);
    }

    /// Polls the CQ's phase dword (Acquire) until the next entry arrives, consumes it and rings
    /// the CQ head doorbell.
    fn complete(&mut self) -> Result<RawCompletion> {
        let base = self.head as usize * CQE_SIZE;
        let deadline = Instant::now() + Duration::from_secs(5);
        let dword = loop {
            let dw = self.cq.load_u32(base + CQE_STATUS_DWORD, Ordering::Acquire);
            if (dw & CQE_STATUS_DWORD_PHASE_BIT != 0) == self.phase {
                break dw;
            }
            ensure!(Instant::now() < deadline, "no completion within 5 s");
            std::thread::yield_now();
        };
        let sq_dword = self.cq.load_u32(base + CQE_SQ_DWORD, Ordering::Relaxed);
        self.head = (self.head + 1) % self.pair.cq_entries();
        if self.head == 0 {
            self.phase = !self.phase;
        }
        self.regs
            .registers()
            .write_u32(self.pair.cq_head_doorbell(), self.head);
        Ok(RawCompletion {
            cid: dword as u16,
            sqid: (sq_dword >> 16) as u16,
            status: (dword >> 17) as u16,
        })
    }

    /// Runs one command to completion and checks its CQE.
    fn run(&mut self, opcode: NvmOpcode, cid: u16, lba: u64, buf: &DmaMemory) -> Result<()> {
        let blocks = (buf.len() / 512) as u16;
        self.submit(opcode, cid, lba, blocks, buf);
        let c = self.complete()?;
        ensure!(
            c.cid == cid,
            "completion for cid {} instead of {cid}",
            c.cid
        );
        ensure!(c.sqid == self.pair.qid(), "completion from SQ {}", c.sqid);
        ensure!(c.status == 0, "status {:#x}", c.status);
        Ok(())
    }
}

#[test]
fn hand_driven_write_and_read_on_caller_supplied_rings() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default())?;
    let mut q = HandDriven::create(&ctrl, 16)?;
    assert_eq!(q.pair.qid(), 1);
    assert_eq!((q.pair.sq_entries(), q.pair.cq_entries()), (16, 16));
    assert_eq!(
        q.pair.sq_tail_doorbell(),
        sq_tail_doorbell(1, ctrl.info().dstrd)
    );
    assert_eq!(q.pair.sq_tail_doorbell(), 0x1008);
    assert_eq!(q.pair.cq_head_doorbell(), 0x100c);
    assert_eq!(ctrl.doorbell_stride(), 4);
    assert!(!q.pair.is_deleted());
    assert_eq!(q.pair.sq_region().device_address(0), q.sq.device_address(0));

    let data = pattern(7, 4096);
    let wbuf = ctrl.device().alloc_dma(4096)?;
    wbuf.write(0, &data);
    let rbuf = ctrl.device().alloc_dma(4096)?;
    rbuf.fill(0, 4096, 0xa5);
    // More commands than entries, so both rings wrap and the phase flips.
    for i in 0..20u16 {
        let lba = 8 * i as u64;
        q.run(NvmOpcode::WRITE, 2 * i, lba, &wbuf)?;
        q.run(NvmOpcode::READ, 2 * i + 1, lba, &rbuf)?;
        let mut back = vec![0u8; 4096];
        rbuf.read(0, &mut back);
        ensure!(back == data, "read back differs at lba {lba}");
        rbuf.fill(0, 4096, 0xa5);
    }
    let stats = emu.stats();
    assert_eq!((stats.reads, stats.writes), (20, 20));

    // A command past the namespace's end completes with an error status.
    let blocks = ctrl.namespace(1)?.blocks;
    q.submit(NvmOpcode::READ, 99, blocks, 8, &rbuf);
    let c = q.complete()?;
    assert_eq!(c.cid, 99);
    assert_eq!(c.status & 0xff, 0x80, "LBA Out of Range expected: {c:?}");

    let qid = q.pair.qid();
    q.pair.delete()?;
    // The queue id is free again.
    let again = HandDriven::create(&ctrl, 16)?;
    assert_eq!(again.pair.qid(), qid);
    Ok(())
}

#[test]
fn entries_out_of_range_are_refused_without_reaching_the_controller() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default())?;
    let max = ctrl.info().mqes_entries;
    assert_eq!(max, 1024);
    let (sq, cq) = rings(&ctrl, max + 1, max + 1)?;
    let admin_before = emu.stats().admin_commands;
    for (sq_entries, cq_entries, which, bad) in [
        (1, 16, "submission queue", 1),
        (16, 1, "completion queue", 1),
        (max + 1, 16, "submission queue", max + 1),
        (16, max + 1, "completion queue", max + 1),
        (0, 16, "submission queue", 0),
    ] {
        let e = ctrl
            .create_queue_pair_on(regions(&sq, sq_entries, &cq, cq_entries))
            .unwrap_err();
        match e {
            Error::InvalidQueueEntries {
                queue,
                entries,
                max: m,
            } => {
                assert_eq!((queue, entries, m), (which, bad, max));
            }
            e => bail!("unexpected error {e}"),
        }
    }
    assert_eq!(emu.stats().admin_commands, admin_before);
    // The largest size is accepted.
    let pair = ctrl.create_queue_pair_on(regions(&sq, max, &cq, max))?;
    assert_eq!(pair.qid(), 1, "refusals consumed a queue id");
    Ok(())
}

#[test]
fn regions_that_cannot_hold_the_queue_are_refused() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default())?;
    let admin_before = emu.stats().admin_commands;
    // One page holds 64 SQEs and 256 CQEs.
    let (sq, cq) = rings(&ctrl, 64, 256)?;
    let e = ctrl
        .create_queue_pair_on(regions(&sq, 65, &cq, 16))
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::QueueRegionTooSmall {
                queue: "submission queue",
                entries: 65,
                needed: 4160,
                len: 4096
            }
        ),
        "{e}"
    );
    let e = ctrl
        .create_queue_pair_on(regions(&sq, 64, &cq, 257))
        .unwrap_err();
    assert!(
        matches!(
            e,
            Error::QueueRegionTooSmall {
                queue: "completion queue",
                ..
            }
        ),
        "{e}"
    );
    // Discontiguous device addresses: refused (PC = 1 queues only), checked before anything is
    // sent, so the made-up addresses never reach the controller.
    let scattered = Arc::new(DmaRegion::new(
        2 * DMA_PAGE_SIZE,
        vec![0x7000_0000, 0x7000_2000],
        Box::new(()),
    ));
    let e = ctrl
        .create_queue_pair_on(QueueRegions {
            sq: scattered.clone(),
            sq_entries: 128,
            cq: Arc::clone(cq.region()),
            cq_entries: 16,
        })
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert!(e.to_string().contains("CAP.CQR = 1"), "{e}");
    // Discontiguous beyond what the queue uses is fine: 64 entries fit the first page, which is
    // real memory (the region owns the allocation); the second page is never used.
    let real = Arc::clone(sq.region());
    let tail_scattered = Arc::new(DmaRegion::new(
        2 * DMA_PAGE_SIZE,
        vec![real.device_address(0), real.device_address(0) + 0x10_0000],
        Box::new(real),
    ));
    let pair = ctrl.create_queue_pair_on(QueueRegions {
        sq: tail_scattered,
        sq_entries: 64,
        cq: Arc::clone(cq.region()),
        cq_entries: 16,
    })?;
    pair.delete()?;
    assert_eq!(emu.stats().admin_commands, admin_before + 4);
    Ok(())
}

#[test]
fn queue_ids_run_out_and_are_reused() -> Result<()> {
    let cfg = EmuConfig {
        max_io_queue_pairs: 3,
        ..EmuConfig::default()
    };
    let (_emu, ctrl) = start(cfg)?;
    assert_eq!(ctrl.info().max_io_queue_pairs, 3);
    let cpu = ctrl.create_io_queue_pair(8)?;
    let a = HandDriven::create(&ctrl, 8)?;
    let b = HandDriven::create(&ctrl, 8)?;
    let mut qids = vec![cpu.qid(), a.pair.qid(), b.pair.qid()];
    qids.sort();
    assert_eq!(qids, [1, 2, 3]);
    let e = HandDriven::create(&ctrl, 8)
        .err()
        .context("a fourth pair")?;
    assert!(
        matches!(
            e.downcast_ref::<Error>(),
            Some(Error::NoQueueAvailable { granted: 3 })
        ),
        "{e}"
    );
    assert!(matches!(
        ctrl.create_io_queue_pair(8).unwrap_err(),
        Error::NoQueueAvailable { granted: 3 }
    ));
    // Dropping a caller-supplied pair deletes its queues and frees its id...
    let a_qid = a.pair.qid();
    drop(a);
    let mut c = HandDriven::create(&ctrl, 8)?;
    assert_eq!(c.pair.qid(), a_qid);
    let buf = ctrl.device().alloc_dma(4096)?;
    c.run(NvmOpcode::READ, 1, 0, &buf)?;
    // ...and so does delete(), for a CPU pair to take.
    let b_qid = b.pair.qid();
    b.pair.delete()?;
    let mut cpu2 = ctrl.create_io_queue_pair(8)?;
    assert_eq!(cpu2.qid(), b_qid);
    cpu2.flush(1)?;
    // A pair deleted with its id retired: the queues go, the id is never handed out again.
    let c_qid = c.pair.qid();
    c.pair.delete_retiring_qid()?;
    drop(cpu);
    let d = HandDriven::create(&ctrl, 8)?;
    assert_ne!(d.pair.qid(), c_qid, "a retired id came back");
    assert!(matches!(
        HandDriven::create(&ctrl, 8)
            .err()
            .context("no id left")?
            .downcast_ref::<Error>(),
        Some(Error::NoQueueAvailable { granted: 3 })
    ));
    Ok(())
}

/// Many pairs deleted together ([`CreatedQueuePair::delete_all`]): more pairs than the admin
/// queue has slots, two deletions each reaching the controller, every pair retired and its id
/// free again (or, retiring, never handed out again); shutdown deletes the live ones the same
/// way.
#[test]
fn many_pairs_are_deleted_together_and_free_their_ids() -> Result<()> {
    let cfg = EmuConfig {
        max_io_queue_pairs: 48,
        ..EmuConfig::default()
    };
    let (emu, ctrl) = start(cfg)?;
    let pairs: Vec<HandDriven> = (0..40)
        .map(|_| HandDriven::create(&ctrl, 8))
        .collect::<Result<_>>()?;
    let mut qids: Vec<u16> = pairs.iter().map(|p| p.pair.qid()).collect();
    qids.sort();
    let before = emu.stats().admin_commands;
    let mut rings = Vec::new();
    let created: Vec<CreatedQueuePair> = pairs
        .into_iter()
        .map(|p| {
            rings.push((p.sq, p.cq));
            p.pair
        })
        .collect();
    CreatedQueuePair::delete_all(created, false)?;
    assert_eq!(emu.stats().admin_commands, before + 80);
    // Every id is free: 48 pairs fit again, the 40 among them.
    let again: Vec<HandDriven> = (0..48)
        .map(|_| HandDriven::create(&ctrl, 8))
        .collect::<Result<_>>()?;
    let mut got: Vec<u16> = again.iter().map(|p| p.pair.qid()).collect();
    got.sort();
    assert_eq!(got, (1..=48).collect::<Vec<u16>>());
    // A retiring batch: the queues go, the ids never come back.
    let (retire, keep): (Vec<HandDriven>, Vec<HandDriven>) =
        again.into_iter().partition(|p| p.pair.qid() <= 10);
    let before = emu.stats().admin_commands;
    let retire: Vec<CreatedQueuePair> = retire.into_iter().map(|p| p.pair).collect();
    CreatedQueuePair::delete_all(retire, true)?;
    assert_eq!(emu.stats().admin_commands, before + 20);
    assert!(matches!(
        HandDriven::create(&ctrl, 8)
            .err()
            .context("no id left")?
            .downcast_ref::<Error>(),
        Some(Error::NoQueueAvailable { granted: 48 })
    ));
    // Shutdown deletes the 38 live pairs, two commands each.
    let before = emu.stats().admin_commands;
    ctrl.shutdown()?;
    assert_eq!(emu.stats().admin_commands, before + 76);
    assert!(keep.iter().all(|p| p.pair.is_deleted()));
    drop(rings);
    Ok(())
}

#[test]
fn shutdown_retires_caller_supplied_pairs() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default())?;
    let mut q = HandDriven::create(&ctrl, 8)?;
    let mut cpu = ctrl.create_io_queue_pair(8)?;
    let buf = ctrl.device().alloc_dma(4096)?;
    q.run(NvmOpcode::WRITE, 3, 0, &buf)?;
    let other = HandDriven::create(&ctrl, 8)?;
    let admin_before = emu.stats().admin_commands;
    ctrl.shutdown()?;
    // Two deletions per pair, three pairs.
    assert_eq!(emu.stats().admin_commands, admin_before + 6);
    assert!(q.pair.is_deleted() && other.pair.is_deleted());
    assert!(matches!(cpu.flush(1).unwrap_err(), Error::ShutDown));
    q.pair.delete()?;
    drop(other);
    drop(cpu);
    assert_eq!(emu.stats().admin_commands, admin_before + 6);
    Ok(())
}

#[test]
fn dropping_the_controller_retires_pairs_too() -> Result<()> {
    let (_emu, ctrl) = start(EmuConfig::default())?;
    let q = HandDriven::create(&ctrl, 8)?;
    drop(ctrl);
    assert!(q.pair.is_deleted());
    q.pair.delete()?;
    Ok(())
}

#[test]
fn cpu_and_caller_supplied_pairs_share_a_controller() -> Result<()> {
    let (_emu, ctrl) = start(EmuConfig::default())?;
    let mut cpu = ctrl.create_io_queue_pair(32)?;
    let mut q = HandDriven::create(&ctrl, 32)?;
    let mut cpu2 = ctrl.create_io_queue_pair(16)?;
    assert_ne!(cpu.qid(), q.pair.qid());
    assert_ne!(cpu2.qid(), q.pair.qid());
    let buf = ctrl.device().alloc_dma(4096)?;
    for round in 0..4u8 {
        let lba = 64 * round as u64;
        // CPU writes, hand-driven pair reads.
        let data = pattern(round, 4096);
        cpu.write_from(1, lba, &data)?;
        q.run(NvmOpcode::READ, round as u16, lba, &buf)?;
        let mut back = vec![0u8; 4096];
        buf.read(0, &mut back);
        ensure!(back == data, "hand-driven read of a CPU write differs");
        // Hand-driven pair writes, the other CPU pair reads.
        let data = pattern(round + 100, 4096);
        buf.write(0, &data);
        q.run(NvmOpcode::WRITE, 100 + round as u16, lba + 8, &buf)?;
        let mut back = vec![0u8; 4096];
        cpu2.read_to(1, lba + 8, &mut back)?;
        ensure!(back == data, "CPU read of a hand-driven write differs");
    }
    drop(cpu);
    let buf2 = ctrl.device().alloc_dma(4096)?;
    q.run(NvmOpcode::READ, 500, 0, &buf2)?;
    Ok(())
}

#[test]
fn prepare_hook_sees_the_qid_and_can_refuse() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default())?;
    let (sq, cq) = rings(&ctrl, 8, 8)?;
    let admin_before = emu.stats().admin_commands;
    let e = ctrl
        .create_queue_pair_on_with(regions(&sq, 8, &cq, 8), |qid| {
            assert_eq!(qid, 1);
            Err(Error::Unsupported("no doorbell for this queue".into()))
        })
        .unwrap_err();
    assert!(matches!(e, Error::Unsupported(_)), "{e}");
    assert_eq!(emu.stats().admin_commands, admin_before);
    let mut seen = None;
    let pair = ctrl.create_queue_pair_on_with(regions(&sq, 8, &cq, 8), |qid| {
        seen = Some(qid);
        Ok(())
    })?;
    assert_eq!(seen, Some(1), "the refused attempt kept its queue id");
    assert_eq!(pair.qid(), 1);
    Ok(())
}

/// A transport around the software controller that overstates CAP.MQES (so the driver sends
/// queue sizes the controller refuses) and can lose one admin doorbell write.
struct Meddling {
    emu: Arc<EmuDevice>,
    fake_mqes_z: Option<u16>,
    /// Swallow the admin SQ doorbell write this many writes from now (0: none).
    swallow_admin_write_in: AtomicU32,
}

impl RegisterIo for Meddling {
    fn len(&self) -> usize {
        self.emu.registers().len()
    }
    fn read_u32(&self, offset: usize) -> u32 {
        let v = self.emu.registers().read_u32(offset);
        match (offset, self.fake_mqes_z) {
            (CAP, Some(m)) => (v & !0xffff) | m as u32,
            _ => v,
        }
    }
    fn write_u32(&self, offset: usize, value: u32) {
        if offset == sq_tail_doorbell(0, 0) {
            let n = self.swallow_admin_write_in.load(Ordering::Acquire);
            if n > 0 {
                self.swallow_admin_write_in.store(n - 1, Ordering::Release);
                if n == 1 {
                    return;
                }
            }
        }
        self.emu.registers().write_u32(offset, value)
    }
}

impl Device for Meddling {
    fn registers(&self) -> &dyn RegisterIo {
        self
    }
    fn alloc_dma(&self, len: usize) -> Result<DmaMemory, DmaAllocError> {
        self.emu.alloc_dma(len)
    }
    fn describe(&self) -> String {
        format!("meddling wrapper around {}", self.emu.describe())
    }
}

fn start_meddling(
    fake_mqes_z: Option<u16>,
    opts: ControllerOptions,
) -> Result<(Arc<Meddling>, Controller)> {
    start_meddling_with(2, fake_mqes_z, opts)
}

/// [`start_meddling`] on a controller of `pairs` I/O queue pairs.
fn start_meddling_with(
    pairs: u16,
    fake_mqes_z: Option<u16>,
    opts: ControllerOptions,
) -> Result<(Arc<Meddling>, Controller)> {
    let cfg = EmuConfig {
        mqes: 63,
        max_io_queue_pairs: pairs,
        ..EmuConfig::default()
    };
    let wrapper = Arc::new(Meddling {
        emu: EmuDevice::start(cfg)?,
        fake_mqes_z,
        swallow_admin_write_in: AtomicU32::new(0),
    });
    let dev: Arc<dyn Device> = wrapper.clone();
    Ok((wrapper, Controller::new(dev, opts)?))
}

#[test]
fn refused_creations_are_undone_and_free_the_qid() -> Result<()> {
    // The driver believes queues may have 1024 entries; the controller takes 64.
    let (_w, ctrl) = start_meddling(Some(1023), fast_opts())?;
    assert_eq!(ctrl.info().mqes_entries, 1024);
    let (sq, cq) = rings(&ctrl, 128, 128)?;
    let qid_of = |sq_entries, cq_entries| {
        let mut seen = 0;
        let r = ctrl.create_queue_pair_on_with(regions(&sq, sq_entries, &cq, cq_entries), |q| {
            seen = q;
            Ok(())
        });
        (seen, r)
    };
    // Create I/O CQ refused (Invalid Queue Size): nothing exists, the qid is free again.
    let (qid, r) = qid_of(16, 128);
    let e = r.unwrap_err();
    assert_eq!(e.status().map(|s| (s.sct.0, s.sc)), Some((1, 0x02)), "{e}");
    assert_eq!(qid, 1);
    // CQ created, Create I/O SQ refused: the CQ is deleted again and the qid freed.
    let (qid, r) = qid_of(128, 16);
    let e = r.unwrap_err();
    assert_eq!(e.status().map(|s| (s.sct.0, s.sc)), Some((1, 0x02)), "{e}");
    assert_eq!(qid, 1, "the refused CQ creation leaked its queue id");
    // Same qid once more: this succeeds only if the CQ of the failed attempt was deleted (the
    // controller refuses to create a CQ whose id exists).
    let (qid, r) = qid_of(64, 64);
    let pair = r?;
    assert_eq!((qid, pair.qid()), (1, 1));
    Ok(())
}

#[test]
fn lost_creations_keep_the_qid_reserved() -> Result<()> {
    let opts = ControllerOptions {
        admin_timeout: Duration::from_millis(200),
        ..fast_opts()
    };
    // Lose Create I/O CQ (write 1), then, on a fresh controller, Create I/O SQ (write 2).
    for lost in [1, 2] {
        let (w, ctrl) = start_meddling(None, opts.clone())?;
        let (sq, cq) = rings(&ctrl, 16, 16)?;
        w.swallow_admin_write_in.store(lost, Ordering::Release);
        let mut first = 0;
        let e = ctrl
            .create_queue_pair_on_with(regions(&sq, 16, &cq, 16), |q| {
                first = q;
                Ok(())
            })
            .unwrap_err();
        assert!(matches!(e, Error::Timeout { qid: 0, .. }), "{e}");
        assert_eq!(first, 1);
        // The controller may hold queues with id 1 (the command may have run before it was
        // lost): the next attempt gets another id, and fails because the admin queue is no
        // longer trusted, which surely sent nothing, so that id is freed again.
        for _ in 0..2 {
            let mut next = 0;
            let e = ctrl
                .create_queue_pair_on_with(regions(&sq, 16, &cq, 16), |q| {
                    next = q;
                    Ok(())
                })
                .unwrap_err();
            assert!(matches!(e, Error::QueueFailed { qid: 0 }), "{e}");
            assert_eq!(next, 2, "lost command {lost}");
        }
    }
    Ok(())
}

/// Many pairs created together ([`Controller::create_queue_pairs_on_with`]): every pair made,
/// `prepare` seeing each one's id, I/O on them; all or none: one pair the controller refuses
/// undoes the others (their queues deleted, every id free again, as the next batch's creation
/// of the same ids proves) and is the error; a `prepare` that fails sends nothing.
#[test]
fn many_pairs_are_created_together_all_or_none() -> Result<()> {
    // The driver believes queues may have 1024 entries; the controller takes 64.
    let (w, ctrl) = start_meddling_with(40, Some(1023), fast_opts())?;
    let mut rings: Vec<(DmaMemory, DmaMemory)> = (0..40)
        .map(|_| rings(&ctrl, 128, 128))
        .collect::<Result<_>>()?;
    let batch = |entries: &dyn Fn(usize) -> u32| -> Vec<QueueRegions> {
        rings
            .iter()
            .enumerate()
            .map(|(i, (sq, cq))| regions(sq, entries(i), cq, entries(i)))
            .collect()
    };
    let admin = || w.emu.stats().admin_commands;
    // Pair 25 asks for 128 entries: refused (Invalid Queue Size) after the others' CQs exist.
    let before = admin();
    let mut seen = Vec::new();
    let e = ctrl
        .create_queue_pairs_on_with(batch(&|i| if i == 25 { 128 } else { 16 }), |i, q| {
            seen.push((i, q));
            Ok(())
        })
        .unwrap_err();
    assert_eq!(e.status().map(|s| (s.sct.0, s.sc)), Some((1, 0x02)), "{e}");
    assert_eq!(seen, (0..40).map(|i| (i, i as u16 + 1)).collect::<Vec<_>>());
    // 40 CQ creations, 39 SQ creations, then 39 pairs undone (two deletions each).
    assert_eq!(admin(), before + 40 + 39 + 2 * 39);
    // A prepare that fails: its error, nothing sent, the ids free.
    let before = admin();
    let e = ctrl
        .create_queue_pairs_on_with(batch(&|_| 16), |i, _| {
            if i == 3 {
                Err(Error::Unsupported("no doorbell for you".into()))
            } else {
                Ok(())
            }
        })
        .unwrap_err();
    assert!(e.to_string().contains("no doorbell for you"), "{e}");
    assert_eq!(admin(), before);
    // Every id free and no queue left behind: the same 40 ids are created again.
    let before = admin();
    let pairs = ctrl.create_queue_pairs_on_with(batch(&|_| 16), |_, _| Ok(()))?;
    assert_eq!(admin(), before + 80);
    let qids: Vec<u16> = pairs.iter().map(|p| p.qid()).collect();
    assert_eq!(qids, (1..=40).collect::<Vec<u16>>());
    // The last pair carries I/O.
    let last = pairs.into_iter().last().context("a pair")?;
    let (sq, cq) = rings.pop().context("rings")?;
    let mut q = HandDriven {
        pair: last,
        sq,
        cq,
        regs: ctrl.device().clone(),
        tail: 0,
        head: 0,
        phase: true,
    };
    let buf = ctrl.device().alloc_dma(4096)?;
    q.run(NvmOpcode::READ, 7, 0, &buf)?;
    Ok(())
}
