//! The admin queue (queue 0) and the admin commands the driver issues (NVMe Base 2.0,
//! section 5): Identify, Set/Get Features, Get Log Page, Create/Delete I/O queues.
//!
//! Admin commands run one at a time (the caller holds the admin queue's mutex, in
//! [`AdminChannel`]), polled on the CPU, each bounded by the admin timeout. The channel also
//! carries whether the controller was shut down, checked under that mutex, so that no admin
//! command starts after shutdown began.

#![forbid(unsafe_code)]

use crate::device::Device;
use crate::dma::{DMA_PAGE_SIZE, DmaMemory, DmaSlice};
use crate::error::{Error, Op};
use crate::queue_pair::{Doorbells, QueueMemory, QueuePair, Reaped};
use crate::timeout::Backoff;
use nvme_spec::command::{
    CreateCqCdw11, CreateQueueCdw10, CreateSqCdw11, DeleteQueueCdw10, FeaturesCdw10,
    GetLogPageCdw10, GetLogPageCdw11, IdentifyCdw10,
};
use nvme_spec::wire::{cq_head_doorbell, sq_tail_doorbell};
use nvme_spec::{AdminOpcode, Cns, Command, FeatureId};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};
use std::time::Duration;
use zerocopy::FromBytes;

/// The admin queue as shared by the controller handle and every queue pair's lifecycle: a
/// mutex (one admin command at a time) and the shut-down flag.
#[derive(Debug)]
pub(crate) struct AdminChannel {
    queue: Mutex<AdminQueue>,
    shut_down: AtomicBool,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under these locks leaves consistent state, so poisoning is ignored.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl AdminChannel {
    /// Wraps an admin queue the controller has been enabled with.
    pub(crate) fn new(queue: AdminQueue) -> Self {
        Self {
            queue: Mutex::new(queue),
            shut_down: AtomicBool::new(false),
        }
    }

    /// Runs `f` on the admin queue, unless the controller was shut down.
    pub(crate) fn run<R>(
        &self,
        f: impl FnOnce(&mut AdminQueue) -> Result<R, Error>,
    ) -> Result<R, Error> {
        let mut admin = lock(&self.queue);
        if self.shut_down.load(Ordering::Acquire) {
            return Err(Error::ShutDown);
        }
        f(&mut admin)
    }

    /// Raises the admin command timeout to `at_least` (never lowers it); returns the timeout
    /// in force.
    pub(crate) fn raise_timeout(&self, at_least: Duration) -> Duration {
        let mut admin = lock(&self.queue);
        if admin.qp.timeout() < at_least {
            admin.qp.set_timeout(at_least);
        }
        admin.qp.timeout()
    }

    /// Whether the controller was shut down.
    pub(crate) fn is_shut_down(&self) -> bool {
        self.shut_down.load(Ordering::Acquire)
    }

    /// Locks the admin queue and marks the controller shut down, so that no other admin command
    /// starts; returns the locked queue for the last commands, or `None` if shutdown had already
    /// begun.
    pub(crate) fn begin_shutdown(&self) -> Option<MutexGuard<'_, AdminQueue>> {
        let admin = lock(&self.queue);
        if self.shut_down.swap(true, Ordering::AcqRel) {
            return None;
        }
        Some(admin)
    }
}

/// The admin submission/completion queue pair.
#[derive(Debug)]
pub(crate) struct AdminQueue {
    qp: QueuePair,
    scratch: Arc<DmaMemory>,
    next_tag: u64,
}

impl AdminQueue {
    /// Allocates the admin queues (`depth` entries) and a 4 KiB buffer for Identify data.
    pub(crate) fn new(
        device: Arc<dyn Device>,
        depth: u16,
        dstrd: u8,
        timeout: Duration,
    ) -> Result<Self, Error> {
        let scratch = Arc::new(device.alloc_dma(DMA_PAGE_SIZE)?);
        let mem = QueueMemory::alloc(&*device, depth, 1)?;
        let doorbells = Doorbells {
            sq_tail: sq_tail_doorbell(0, dstrd),
            cq_head: cq_head_doorbell(0, dstrd),
        };
        let qp = QueuePair::new(device, 0, depth, mem, doorbells, timeout);
        Ok(Self {
            qp,
            scratch,
            next_tag: 0,
        })
    }

    /// Entries per admin queue.
    pub(crate) fn depth(&self) -> u16 {
        self.qp.depth()
    }

    /// Device address of the admin submission queue (for ASQ).
    pub(crate) fn sq_address(&self) -> u64 {
        self.qp.sq_memory().device_address(0)
    }

    /// Device address of the admin completion queue (for ACQ).
    pub(crate) fn cq_address(&self) -> u64 {
        self.qp.cq_memory().device_address(0)
    }

    /// Whether the admin queue has failed (a command timed out or the device sent garbage).
    pub(crate) fn is_failed(&self) -> bool {
        self.qp.is_failed()
    }

    /// Runs one admin command to completion and returns Dword 0 of its completion.
    pub(crate) fn execute(
        &mut self,
        mut cmd: Command,
        data: Option<&DmaSlice>,
    ) -> Result<u32, Error> {
        let op = op_of(&cmd);
        let cid = self.qp.begin()?;
        if let Some(buf) = data {
            match self.qp.data_pointer(cid, buf) {
                Ok(prp) => {
                    cmd.prp1 = prp.prp1;
                    cmd.prp2 = prp.prp2;
                }
                Err(e) => {
                    self.qp.cancel(cid);
                    return Err(e);
                }
            }
        }
        self.next_tag += 1;
        let tag = self.next_tag;
        self.qp.issue(cid, cmd, op, tag, true, data.cloned(), true);
        let mut backoff = Backoff::for_admin();
        let mut result = None;
        loop {
            self.qp.reap(usize::MAX, |r: Reaped| {
                if r.tag == tag {
                    result = Some(r.into_result());
                }
            })?;
            if let Some(r) = result {
                return r;
            }
            backoff.snooze();
        }
    }

    /// Runs `cmds` (commands without data) together: as many in flight at once as the queue
    /// has slots, one doorbell write per round, and returns each one's Dword 0 or error, in
    /// order. Queue deletions and creations of many pairs cost a few round trips to the
    /// controller this way instead of one each. A command the queue could not take (a failed
    /// queue) has that error and was surely not submitted. `Err` if a completion could not be
    /// attributed (the queue is failed; which of the commands in flight ran is unknown).
    pub(crate) fn execute_many(
        &mut self,
        cmds: &[Command],
    ) -> Result<Vec<Result<u32, Error>>, Error> {
        let mut results: Vec<Option<Result<u32, Error>>> = (0..cmds.len()).map(|_| None).collect();
        // Tags are consecutive: a completion's tag less the first is its command's index.
        let first_tag = self.next_tag + 1;
        let (mut next, mut done) = (0, 0);
        let mut backoff = Backoff::for_admin();
        while done < cmds.len() {
            while next < cmds.len() {
                let cid = match self.qp.begin() {
                    Ok(cid) => cid,
                    Err(Error::QueueFull { .. }) => break,
                    // Never submitted (a failed queue): this command's error, and the next
                    // one's the same way.
                    Err(e) => {
                        results[next] = Some(Err(e));
                        (next, done) = (next + 1, done + 1);
                        continue;
                    }
                };
                let cmd = cmds[next];
                let op = op_of(&cmd);
                self.next_tag += 1;
                self.qp
                    .issue(cid, cmd, op, self.next_tag, true, None, false);
                next += 1;
            }
            self.qp.ring();
            let mut reaped = 0;
            self.qp.reap(usize::MAX, |r: Reaped| {
                let i = r.tag.wrapping_sub(first_tag) as usize;
                if let Some(slot @ None) = results.get_mut(i) {
                    *slot = Some(r.into_result());
                    reaped += 1;
                }
            })?;
            done += reaped;
            if reaped == 0 {
                backoff.snooze();
            } else {
                backoff.reset();
            }
        }
        Ok(results.into_iter().flatten().collect())
    }

    /// Identify with the given CNS and NSID; returns the 4 KiB data structure decoded as `T`.
    pub(crate) fn identify<T: FromBytes>(&mut self, cns: Cns, nsid: u32) -> Result<Box<T>, Error> {
        self.scratch.fill(0, DMA_PAGE_SIZE, 0);
        let mut cmd = Command::new(AdminOpcode::IDENTIFY.0, 0, nsid);
        cmd.cdw10 = IdentifyCdw10::new().with_cns(cns.0).into();
        let buf = DmaSlice::whole(self.scratch.clone());
        self.execute(cmd, Some(&buf))?;
        let mut bytes = vec![0u8; DMA_PAGE_SIZE];
        self.scratch.read(0, &mut bytes);
        // `read_from_bytes` copies into a properly aligned value; the size matches by type.
        let value = T::read_from_bytes(&bytes[..size_of::<T>()])
            .unwrap_or_else(|_| unreachable!("identify structures are 4096 bytes"));
        Ok(Box::new(value))
    }

    /// Set Features; returns Dword 0 of the completion.
    pub(crate) fn set_features(&mut self, fid: FeatureId, cdw11: u32) -> Result<u32, Error> {
        let mut cmd = Command::new(AdminOpcode::SET_FEATURES.0, 0, 0);
        cmd.cdw10 = FeaturesCdw10::new().with_fid(fid.0).into();
        cmd.cdw11 = cdw11;
        self.execute(cmd, None)
    }

    /// Get Features (current value); returns Dword 0 of the completion.
    pub(crate) fn get_features(&mut self, fid: FeatureId, cdw11: u32) -> Result<u32, Error> {
        let mut cmd = Command::new(AdminOpcode::GET_FEATURES.0, 0, 0);
        cmd.cdw10 = FeaturesCdw10::new().with_fid(fid.0).into();
        cmd.cdw11 = cdw11;
        self.execute(cmd, None)
    }

    /// Get Log Page into `buf` (a multiple of 4 bytes), starting `offset` bytes into the log.
    pub(crate) fn get_log_page(
        &mut self,
        lid: u8,
        nsid: u32,
        offset: u64,
        buf: &DmaSlice,
    ) -> Result<(), Error> {
        if buf.len == 0 || buf.len % 4 != 0 {
            return Err(Error::Unaligned {
                what: "log page length",
                value: buf.len as u64,
                align: 4,
            });
        }
        if offset % 4 != 0 {
            return Err(Error::Unaligned {
                what: "log page offset",
                value: offset,
                align: 4,
            });
        }
        let numd_z = (buf.len / 4 - 1) as u32;
        let mut cmd = Command::new(AdminOpcode::GET_LOG_PAGE.0, 0, nsid);
        cmd.cdw10 = GetLogPageCdw10::new()
            .with_lid(lid)
            .with_numdl_z(numd_z as u16)
            .into();
        cmd.cdw11 = GetLogPageCdw11::new()
            .with_numdu((numd_z >> 16) as u16)
            .into();
        cmd.cdw12 = offset as u32;
        cmd.cdw13 = (offset >> 32) as u32;
        self.execute(cmd, Some(buf)).map(drop)
    }

    /// Deletes the pairs `qids` (each SQ, then its CQ), all SQs in flight together, then all
    /// CQs of the SQs deleted: each qid's result, in order (a CQ whose SQ could not be deleted
    /// is left, as deleting one pair would).
    /// `Err` if the admin queue failed on the way.
    pub(crate) fn delete_io_pairs(
        &mut self,
        qids: &[u16],
    ) -> Result<Vec<Result<(), Error>>, Error> {
        let sq: Vec<Command> = qids
            .iter()
            .map(|&q| delete_queue(AdminOpcode::DELETE_IO_SQ, q))
            .collect();
        let mut out: Vec<Result<(), Error>> = self
            .execute_many(&sq)?
            .into_iter()
            .map(|r| r.map(drop))
            .collect();
        let sq_gone: Vec<usize> = (0..qids.len()).filter(|&i| out[i].is_ok()).collect();
        let cq: Vec<Command> = sq_gone
            .iter()
            .map(|&i| delete_queue(AdminOpcode::DELETE_IO_CQ, qids[i]))
            .collect();
        for (i, r) in sq_gone.into_iter().zip(self.execute_many(&cq)?) {
            out[i] = r.map(drop);
        }
        Ok(out)
    }
}

/// How an admin command is named in errors: its opcode's name and namespace.
fn op_of(cmd: &Command) -> Op {
    Op {
        name: AdminOpcode(cmd.cdw0.opcode())
            .name()
            .unwrap_or("Admin command"),
        nsid: cmd.nsid,
        lba: None,
    }
}

/// A Delete I/O Submission or Completion Queue command for `qid`.
pub(crate) fn delete_queue(op: AdminOpcode, qid: u16) -> Command {
    let mut cmd = Command::new(op.0, 0, 0);
    cmd.cdw10 = DeleteQueueCdw10::new().with_qid(qid).into();
    cmd
}

/// A Create I/O Completion Queue command: `entries` (2..=65536) at `address`, physically
/// contiguous, interrupts disabled.
pub(crate) fn create_cq(qid: u16, entries: u32, address: u64) -> Command {
    let cdw11 = CreateCqCdw11::new().with_pc(true).with_ien(false).into();
    create_queue(AdminOpcode::CREATE_IO_CQ, qid, entries, address, cdw11)
}

/// A Create I/O Submission Queue command: `entries` (2..=65536) at `address`, bound to CQ
/// `cqid`, physically contiguous, priority ignored (round robin arbitration).
pub(crate) fn create_sq(qid: u16, entries: u32, address: u64, cqid: u16) -> Command {
    let cdw11 = CreateSqCdw11::new().with_pc(true).with_cqid(cqid).into();
    create_queue(AdminOpcode::CREATE_IO_SQ, qid, entries, address, cdw11)
}

/// A Create I/O CQ or SQ command: its queue id and size, its ring at `address`, and `cdw11`.
fn create_queue(op: AdminOpcode, qid: u16, entries: u32, address: u64, cdw11: u32) -> Command {
    debug_assert!((2..=1 << 16).contains(&entries));
    let mut cmd = Command::new(op.0, 0, 0);
    cmd.prp1 = address;
    cmd.cdw10 = CreateQueueCdw10::new()
        .with_qid(qid)
        .with_qsize_z((entries - 1) as u16)
        .into();
    cmd.cdw11 = cdw11;
    cmd
}
