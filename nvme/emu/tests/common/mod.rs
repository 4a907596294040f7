//! A tiny raw host for testing the software controller directly: writes registers, builds
//! SQEs by hand in DMA memory, rings doorbells and reads CQEs. Every wait is bounded.
#![allow(dead_code)]

use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use nvme::{Device, DmaMemory};
use nvme_emu::{EmuConfig, EmuDevice};
use nvme_spec::command::{CreateCqCdw11, CreateQueueCdw10, CreateSqCdw11};
use nvme_spec::registers::{self, ACQ, AQA, ASQ, CC};
use nvme_spec::status::StatusCodeType;
use nvme_spec::{AdminOpcode, Aqa, Cc, Command, Completion, Csts, Status};
use zerocopy::{FromBytes, IntoBytes};

/// How long any wait in these tests may take before the test fails.
pub const WAIT: Duration = Duration::from_secs(10);

/// One submission/completion queue pair as the host sees it.
pub struct QueuePair {
    pub qid: u16,
    pub sq: DmaMemory,
    pub cq: DmaMemory,
    pub sq_entries: u16,
    pub cq_entries: u16,
    pub sq_tail: u16,
    pub cq_head: u16,
    pub phase: bool,
}

impl QueuePair {
    pub fn new(dev: &EmuDevice, qid: u16, sq_entries: u16, cq_entries: u16) -> Self {
        Self {
            qid,
            sq: dev.alloc_dma(sq_entries as usize * 64).unwrap(),
            cq: dev.alloc_dma(cq_entries as usize * 16).unwrap(),
            sq_entries,
            cq_entries,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
        }
    }

    /// Writes a command into the next SQ slot without ringing.
    pub fn push(&mut self, cmd: &Command) {
        self.sq.write(self.sq_tail as usize * 64, cmd.as_bytes());
        self.sq_tail = (self.sq_tail + 1) % self.sq_entries;
    }

    /// Rings the SQ tail doorbell.
    pub fn ring(&self, dev: &EmuDevice) {
        std::sync::atomic::fence(Ordering::Release);
        dev.registers().write_u32(
            registers::sq_tail_doorbell(self.qid, 0),
            self.sq_tail as u32,
        );
    }

    pub fn submit(&mut self, dev: &EmuDevice, cmd: &Command) {
        self.push(cmd);
        self.ring(dev);
    }

    /// The entry at the CQ head if its phase says it is new (does not consume it).
    pub fn peek(&self) -> Option<Completion> {
        peek_slot(&self.cq, self.cq_head, self.phase)
    }

    /// Takes the completion at the head without ringing the CQ head doorbell.
    pub fn take(&mut self) -> Option<Completion> {
        let c = self.peek()?;
        self.cq_head += 1;
        if self.cq_head == self.cq_entries {
            self.cq_head = 0;
            self.phase = !self.phase;
        }
        Some(c)
    }

    pub fn ring_cq(&self, dev: &EmuDevice) {
        dev.registers().write_u32(
            registers::cq_head_doorbell(self.qid, 0),
            self.cq_head as u32,
        );
    }

    /// Waits (bounded) for the next completion, consumes it and rings the CQ head.
    pub fn wait(&mut self, dev: &EmuDevice) -> Completion {
        let c = self.wait_no_ring(dev);
        self.ring_cq(dev);
        c
    }

    pub fn wait_no_ring(&mut self, dev: &EmuDevice) -> Completion {
        let deadline = Instant::now() + WAIT;
        loop {
            if let Some(c) = self.take() {
                return c;
            }
            assert!(
                Instant::now() < deadline,
                "no completion on queue {} (csts {:?})",
                self.qid,
                dev.csts()
            );
            std::thread::yield_now();
        }
    }

    pub fn run(&mut self, dev: &EmuDevice, cmd: &Command) -> Completion {
        self.submit(dev, cmd);
        self.wait(dev)
    }
}

/// Reads CQ slot `index` if its phase tag equals `phase`.
pub fn peek_slot(cq: &DmaMemory, index: u16, phase: bool) -> Option<Completion> {
    let off = index as usize * 16;
    let dw3 = cq.load_u32(off + 12, Ordering::Acquire);
    if (dw3 >> 16) & 1 != phase as u32 {
        return None;
    }
    let mut raw = [0u8; 16];
    cq.read(off, &mut raw);
    Some(Completion::read_from_bytes(&raw).unwrap())
}

/// A host driving one controller.
pub struct Host {
    pub dev: Arc<EmuDevice>,
    pub admin: QueuePair,
    next_cid: u16,
}

impl Host {
    /// Starts a controller (not enabled) with admin queues of 32 entries allocated.
    pub fn new(config: EmuConfig) -> Self {
        let dev = EmuDevice::start(config).unwrap();
        let admin = QueuePair::new(&dev, 0, 32, 32);
        Self {
            dev,
            admin,
            next_cid: 1,
        }
    }

    /// Starts and enables a controller.
    pub fn enabled(config: EmuConfig) -> Self {
        let mut h = Self::new(config);
        h.enable();
        h
    }

    pub fn regs(&self) -> &dyn nvme::RegisterIo {
        self.dev.registers()
    }

    pub fn csts(&self) -> Csts {
        Csts::from(self.regs().read_u32(registers::CSTS))
    }

    /// Waits (bounded) until `f(csts)` holds; returns whether it did.
    pub fn wait_csts(&self, f: impl Fn(Csts) -> bool) -> bool {
        let deadline = Instant::now() + WAIT;
        while Instant::now() < deadline {
            if f(self.csts()) {
                return true;
            }
            std::thread::sleep(Duration::from_micros(100));
        }
        false
    }

    pub fn good_cc() -> Cc {
        Cc::new().with_en(true).with_iosqes(6).with_iocqes(4)
    }

    /// Programs the admin queue registers and sets CC.
    pub fn write_enable(&mut self, cc: Cc) {
        self.admin.sq_tail = 0;
        self.admin.cq_head = 0;
        self.admin.phase = true;
        self.admin.cq.fill(0, self.admin.cq.len(), 0);
        let aqa = Aqa::new()
            .with_asqs_z(self.admin.sq_entries - 1)
            .with_acqs_z(self.admin.cq_entries - 1);
        self.regs().write_u32(AQA, aqa.into_bits());
        self.regs().write_u64(ASQ, self.admin.sq.device_address(0));
        self.regs().write_u64(ACQ, self.admin.cq.device_address(0));
        self.regs().write_u32(CC, cc.into_bits());
    }

    pub fn enable(&mut self) {
        self.write_enable(Self::good_cc());
        assert!(
            self.wait_csts(|c| c.rdy()),
            "controller did not become ready: {:?}",
            self.csts()
        );
    }

    /// Clears CC.EN and waits for RDY to drop.
    pub fn disable(&mut self) {
        self.regs().write_u32(CC, 0);
        assert!(
            self.wait_csts(|c| !c.rdy() && !c.cfs()),
            "controller did not reset: {:?}",
            self.csts()
        );
    }

    pub fn cid(&mut self) -> u16 {
        self.next_cid = self.next_cid.wrapping_add(1);
        self.next_cid
    }

    /// Runs one admin command to completion.
    pub fn admin(&mut self, mut cmd: Command) -> Completion {
        let cid = self.cid();
        cmd.cdw0 = cmd.cdw0.with_cid(cid);
        let c = self.admin.run(&self.dev, &cmd);
        assert_eq!(c.cid, cid, "admin completion for another command");
        c
    }

    /// Runs an admin command with a data buffer of `len` bytes (PRP1 at its start, PRP2 at
    /// its second page); returns the completion and the buffer.
    pub fn admin_data(&mut self, mut cmd: Command, len: usize) -> (Completion, DmaMemory) {
        let buf = self.dev.alloc_dma(len).unwrap();
        cmd.prp1 = buf.device_address(0);
        if buf.len() > 4096 {
            cmd.prp2 = buf.device_address(4096);
        }
        (self.admin(cmd), buf)
    }

    pub fn identify(&mut self, cns: u8, nsid: u32) -> (Completion, Vec<u8>) {
        let mut cmd = Command::new(AdminOpcode::IDENTIFY.0, 0, nsid);
        cmd.cdw10 = cns as u32;
        let (c, buf) = self.admin_data(cmd, 4096);
        let mut out = vec![0u8; 4096];
        buf.read(0, &mut out);
        (c, out)
    }

    /// Creates an I/O completion queue and submission queue with id `qid`.
    pub fn create_io_pair(&mut self, qid: u16, sq_entries: u16, cq_entries: u16) -> QueuePair {
        let qp = QueuePair::new(&self.dev, qid, sq_entries, cq_entries);
        let c = self.create_cq_raw(qid, cq_entries - 1, qp.cq.device_address(0), true, 0);
        assert_ok(&c);
        let c = self.create_sq_raw(qid, sq_entries - 1, qp.sq.device_address(0), qid);
        assert_ok(&c);
        qp
    }

    pub fn create_cq_raw(
        &mut self,
        qid: u16,
        qsize_z: u16,
        base: u64,
        pc: bool,
        iv: u16,
    ) -> Completion {
        let mut cmd = Command::new(AdminOpcode::CREATE_IO_CQ.0, 0, 0);
        cmd.prp1 = base;
        cmd.cdw10 = CreateQueueCdw10::new()
            .with_qid(qid)
            .with_qsize_z(qsize_z)
            .into_bits();
        cmd.cdw11 = CreateCqCdw11::new().with_pc(pc).with_iv(iv).into_bits();
        self.admin(cmd)
    }

    pub fn create_sq_raw(&mut self, qid: u16, qsize_z: u16, base: u64, cqid: u16) -> Completion {
        let mut cmd = Command::new(AdminOpcode::CREATE_IO_SQ.0, 0, 0);
        cmd.prp1 = base;
        cmd.cdw10 = CreateQueueCdw10::new()
            .with_qid(qid)
            .with_qsize_z(qsize_z)
            .into_bits();
        cmd.cdw11 = CreateSqCdw11::new()
            .with_pc(true)
            .with_cqid(cqid)
            .into_bits();
        self.admin(cmd)
    }

    pub fn delete_queue(&mut self, opcode: AdminOpcode, qid: u16) -> Completion {
        let mut cmd = Command::new(opcode.0, 0, 0);
        cmd.cdw10 = qid as u32;
        self.admin(cmd)
    }

    /// Get Log Page of `len` bytes (a multiple of 4) at `offset`.
    pub fn get_log(
        &mut self,
        lid: u8,
        nsid: u32,
        len: usize,
        offset: u64,
        rae: bool,
    ) -> (Completion, Vec<u8>) {
        let cmd = log_cmd(lid, nsid, len, offset, rae);
        let (c, buf) = self.admin_data(cmd, len.max(4096));
        let mut out = vec![0u8; len];
        buf.read(0, &mut out);
        (c, out)
    }
}

impl Drop for Host {
    fn drop(&mut self) {
        self.dev.stop();
    }
}

/// A Get Log Page command for `len` bytes (a multiple of 4) at `offset`, without PRPs.
pub fn log_cmd(lid: u8, nsid: u32, len: usize, offset: u64, rae: bool) -> Command {
    let mut cmd = Command::new(AdminOpcode::GET_LOG_PAGE.0, 0, nsid);
    let numd_z = (len / 4 - 1) as u32;
    cmd.cdw10 = lid as u32 | (rae as u32) << 15 | (numd_z & 0xffff) << 16;
    cmd.cdw11 = numd_z >> 16;
    cmd.cdw12 = offset as u32;
    cmd.cdw13 = (offset >> 32) as u32;
    cmd
}

/// Asserts a completion succeeded.
#[track_caller]
pub fn assert_ok(c: &Completion) {
    assert!(
        c.status().is_success(),
        "expected success, got {} ({c:?})",
        c.status()
    );
}

/// Asserts a completion's status type and code.
#[track_caller]
pub fn assert_status(c: &Completion, sct: StatusCodeType, sc: u8) {
    let s: Status = c.status();
    assert!(
        s.is(sct, sc),
        "expected sct {:#x} sc {:#x}, got {s} ({c:?})",
        sct.0,
        sc
    );
}

/// A Read or Write command.
pub fn rw(opcode: u8, nsid: u32, slba: u64, nlb: u16, prp1: u64, prp2: u64) -> Command {
    let mut cmd = Command::new(opcode, 0, nsid);
    cmd.set_slba(slba);
    cmd.cdw12 = (nlb - 1) as u32;
    cmd.prp1 = prp1;
    cmd.prp2 = prp2;
    cmd
}

/// Deterministic test bytes.
pub fn pattern(len: usize, seed: u64) -> Vec<u8> {
    let mut x = seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    (0..len)
        .map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        })
        .collect()
}

/// Small memory config: one namespace of `blocks` blocks of `lba_size`.
pub fn small_config(blocks: u64, lba_size: u32) -> EmuConfig {
    EmuConfig {
        namespaces: vec![nvme_emu::NamespaceConfig {
            backend: nvme_emu::Backend::Memory,
            blocks,
            lba_size,
            read_only: false,
            format: nvme_emu::NsFormat::Plain,
        }],
        ..EmuConfig::default()
    }
}
