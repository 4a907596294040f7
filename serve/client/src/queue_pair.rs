//! One queue pair lent by the daemon, driven by this process: Read and Write commands through
//! the pair's slot buffers, written straight into its rings in the arena.
//!
//! The ring protocol (docs/serve.md): submission entry `i` is at arena offset `sq + 64 * i`,
//! completion entry `i` at `cq + 16 * i`; slot `s` is the buffer at `slots + s * slot_bytes`
//! and command id `s`; a transfer of more than two pages puts its page list in the slot's PRP
//! list page `prp_lists + s * 2 * 4096` (the first of its two). After writing an entry the host stores the new SQ tail
//! in its doorbell word with Release ordering; it polls a completion's last dword with
//! Acquire ordering until the phase tag (bit 16) is the one expected (1 on the first pass,
//! flipped at every wrap), and after consuming entries stores the CQ head with Release.
//!
//! Everything read from the rings is the controller's word, and the controller (or the
//! daemon) may be buggy: a completion for a command id not in flight, for another queue, or
//! with an SQ head outside the ring breaks the pair with [`ClientError::Protocol`]; nothing
//! read panics. Every wait is bounded. Which submission entries are free is learned from the
//! completions' SQ head field and, since a controller fetches in order, from the entry of
//! each completed command; a stale SQ head is ignored.

use std::collections::VecDeque;
use std::sync::Arc;
use std::sync::atomic::Ordering;
use std::time::{Duration, Instant};

use gpunvme_serve_proto::msg::QueueGrant;
use gpunvme_serve_shm::SharedMemory;
use nvme_spec::Status;
use nvme_spec::wire::{CQE_SIZE, CQE_STATUS_DWORD, CQE_STATUS_DWORD_PHASE_BIT, SQE_SIZE};

use crate::arena::Arena;
use crate::command::{self, IoOp, PAGE};
use crate::error::ClientError;
use crate::lease::Lease;
use crate::ring::{CompletionRing, SubmissionRing};

/// A finished command, as [`QueuePair::reap`] returns it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Completion {
    /// The queue pair.
    pub qid: u16,
    /// The slot and command id ([`QueuePair::submit_read`]'s value); a Read's data is in the
    /// slot's buffer ([`QueuePair::slot_data`]).
    pub slot: u16,
    /// Read or Write.
    pub op: IoOp,
    /// The namespace.
    pub nsid: u32,
    /// The starting LBA.
    pub lba: u64,
    /// Logical blocks moved.
    pub blocks: u32,
    /// The completion's status (without the phase tag).
    pub status: Status,
    /// The completion's Dword 0.
    pub dw0: u32,
}

impl Completion {
    /// Whether the command succeeded.
    pub fn is_success(&self) -> bool {
        self.status.is_success()
    }

    /// `Ok` for a success, else [`ClientError::Command`] naming the status.
    pub fn check(&self) -> Result<(), ClientError> {
        if self.is_success() {
            return Ok(());
        }
        Err(ClientError::Command {
            qid: self.qid,
            cid: self.slot,
            op: self.op.name(),
            lba: self.lba,
            status: self.status,
        })
    }
}

/// Where a command's data is: a slot buffer (with the bytes to write into it first, for a
/// Write), or memory at a device address the caller checked.
#[derive(Clone, Copy)]
enum Data<'a> {
    Slot(Option<&'a [u8]>),
    At(u64),
}

/// A command in flight in a slot.
#[derive(Clone, Copy, Debug)]
struct InFlight {
    op: IoOp,
    /// The submission queue entry it was written to.
    sq_index: u32,
    nsid: u32,
    lba: u64,
    blocks: u32,
    submitted: Instant,
}

/// Waits between polls of the completion queue: spins first, then yields, then sleeps a
/// little, so a quick controller is seen at once and a slow one costs little CPU.
struct Backoff(u32);

impl Backoff {
    fn wait(&mut self) {
        self.0 = self.0.saturating_add(1);
        if self.0 < 64 {
            std::hint::spin_loop();
        } else if self.0 < 2048 {
            std::thread::yield_now();
        } else {
            std::thread::sleep(Duration::from_micros(20));
        }
    }
}

fn shm(what: &'static str) -> impl FnOnce(gpunvme_serve_shm::ShmError) -> ClientError {
    move |source| ClientError::Shm { what, source }
}

/// One queue pair granted by the daemon ([`crate::Connection::create_queues`]), driven by this
/// process alone (`&mut self`): up to `depth - 1` commands in flight, one per slot.
///
/// Two ways to use it: [`QueuePair::read`] and [`QueuePair::write`] move one transfer and wait
/// for it; [`QueuePair::submit_read`], [`QueuePair::submit_write`] and [`QueuePair::reap`]
/// keep many in flight. Both may be mixed: completions of submitted commands that a `read`
/// or `write` sees while it waits are kept for the next `reap`.
#[derive(Debug)]
pub struct QueuePair {
    grant: QueueGrant,
    controller: String,
    depth: u32,
    slot_bytes: u32,
    arena: Arc<Arena>,
    doorbells: Arc<SharedMemory>,
    lease: Arc<Lease>,
    connection: u64,
    bound: Duration,
    sq: SubmissionRing,
    cq: CompletionRing,
    /// Index: slot (command id).
    slots: Vec<Option<InFlight>>,
    /// Free slots, oldest freed first (so a completed slot's data stays longest).
    free: VecDeque<u16>,
    in_flight: usize,
    /// Completions seen but not yet returned by `reap`.
    ready: VecDeque<Completion>,
    /// Set when the controller broke the ring protocol: no more submissions.
    broken: Option<String>,
    /// A PRP list being built.
    list: Vec<u8>,
}

/// What [`QueuePair::new`] needs, from the connection.
pub(crate) struct PairParts {
    pub(crate) grant: QueueGrant,
    pub(crate) controller: String,
    pub(crate) depth: u32,
    pub(crate) slot_bytes: u32,
    pub(crate) arena: Arc<Arena>,
    pub(crate) doorbells: Arc<SharedMemory>,
    pub(crate) lease: Arc<Lease>,
    pub(crate) connection: u64,
    pub(crate) bound: Duration,
}

impl QueuePair {
    /// A pair over a grant already checked against its arena (`layout::check_grants`).
    pub(crate) fn new(p: PairParts) -> Self {
        Self {
            grant: p.grant,
            controller: p.controller,
            depth: p.depth,
            slot_bytes: p.slot_bytes,
            arena: p.arena,
            doorbells: p.doorbells,
            lease: p.lease,
            connection: p.connection,
            bound: p.bound,
            sq: SubmissionRing::new(p.depth),
            cq: CompletionRing::new(p.depth),
            slots: vec![None; p.depth as usize],
            free: (0..p.depth).map(|s| s as u16).collect(),
            in_flight: 0,
            ready: VecDeque::new(),
            broken: None,
            list: Vec::new(),
        }
    }

    /// The queue id (SQ and CQ alike).
    pub fn qid(&self) -> u16 {
        self.grant.qid
    }

    /// The grant: offsets of the rings, slots and PRP list pages in the arena, and of the
    /// doorbell words in the doorbell page.
    pub fn grant(&self) -> &QueueGrant {
        &self.grant
    }

    /// The controller the pair is on.
    pub fn controller(&self) -> &str {
        &self.controller
    }

    /// Entries per queue.
    pub fn depth(&self) -> u32 {
        self.depth
    }

    /// Bytes of each slot buffer: the largest transfer of one command.
    pub fn slot_bytes(&self) -> u32 {
        self.slot_bytes
    }

    /// The arena the pair lives in.
    pub fn arena(&self) -> &Arc<Arena> {
        &self.arena
    }

    /// The doorbell page the pair's words are in ([`QueueGrant::sq_doorbell`] and
    /// [`QueueGrant::cq_doorbell`] give the offsets), shared by the pairs of one grant.
    pub fn doorbell_page(&self) -> &Arc<SharedMemory> {
        &self.doorbells
    }

    /// The most commands in flight at once (`depth - 1`).
    pub fn capacity(&self) -> usize {
        self.depth as usize - 1
    }

    /// Commands submitted and not yet completed.
    pub fn in_flight(&self) -> usize {
        self.in_flight
    }

    /// How long [`QueuePair::read`] and [`QueuePair::write`] wait for their command (the
    /// connection's bound unless set).
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Sets [`QueuePair::bound`].
    pub fn set_bound(&mut self, bound: Duration) {
        self.bound = bound;
    }

    /// Why the pair was revoked, if it was (its calls then fail with
    /// [`ClientError::Revoked`]).
    pub fn revoked(&self) -> Option<&str> {
        self.lease.revoked()
    }

    /// The id of the connection that created the pair.
    pub(crate) fn connection(&self) -> u64 {
        self.connection
    }

    /// Marks the pair revoked (its queues are gone on the controller).
    pub(crate) fn revoke(&self, why: String) {
        self.lease.revoke(why);
    }

    fn usable(&self) -> Result<(), ClientError> {
        if let Some(why) = self.lease.revoked() {
            return Err(ClientError::Revoked {
                qid: self.qid(),
                why: why.to_string(),
            });
        }
        if let Some(why) = &self.broken {
            return Err(ClientError::Protocol(why.clone()));
        }
        Ok(())
    }

    /// The bytes of a transfer of `blocks` blocks of `lba_size`, checked against the slots.
    fn transfer_len(&self, lba: u64, blocks: u32, lba_size: u32) -> Result<u64, ClientError> {
        let len = block_len(lba, blocks, lba_size)?;
        if len > u64::from(self.slot_bytes) {
            return Err(ClientError::InvalidArgument(format!(
                "{blocks} blocks of {lba_size} bytes ({len} bytes) do not fit queue {}'s \
                 {}-byte slots",
                self.qid(),
                self.slot_bytes
            )));
        }
        Ok(len)
    }

    /// The transfer's length, for a usable pair and a `have`-byte `what` (buffer or data) of
    /// exactly `blocks` blocks of `lba_size` bytes that fits a slot.
    fn sized(
        &self,
        lba: u64,
        blocks: u32,
        lba_size: u32,
        have: usize,
        what: &str,
    ) -> Result<u64, ClientError> {
        self.usable()?;
        let len = self.transfer_len(lba, blocks, lba_size)?;
        if have as u64 != len {
            return Err(ClientError::InvalidArgument(format!(
                "{have} bytes of {what} for {blocks} blocks of {lba_size} bytes ({len})"
            )));
        }
        Ok(len)
    }

    /// Arena offset of slot `slot`'s buffer.
    fn slot_offset(&self, slot: u16) -> u64 {
        self.grant.slots + u64::from(slot) * u64::from(self.slot_bytes)
    }

    /// Submits a Read of `blocks` blocks of `lba_size` bytes from `lba` on `nsid` into a free
    /// slot's buffer; returns the slot (also the command id). Its data is there once
    /// [`QueuePair::reap`] returns its completion ([`QueuePair::slot_data`]).
    pub fn submit_read(
        &mut self,
        nsid: u32,
        lba: u64,
        blocks: u32,
        lba_size: u32,
    ) -> Result<u16, ClientError> {
        self.usable()?;
        let len = self.transfer_len(lba, blocks, lba_size)?;
        self.submit(IoOp::Read, nsid, lba, blocks, len, Data::Slot(None))
    }

    /// Submits a Read of `blocks` blocks of `lba_size` bytes from `lba` on `nsid` straight into
    /// `arena` (memory of this connection the controller reaches) from byte `offset` on, not
    /// into a slot; returns the slot (also the command id), whose PRP list page the command
    /// uses. The range must lie inside the arena, start dword-aligned and span at most the
    /// pages one PRP list describes (2 MiB and a page); the controller's maximum transfer is
    /// the caller's to keep. The bytes are there once [`QueuePair::reap`] or
    /// [`QueuePair::poll`] returns the completion.
    pub fn submit_read_into(
        &mut self,
        nsid: u32,
        lba: u64,
        blocks: u32,
        lba_size: u32,
        arena: &Arena,
        offset: u64,
    ) -> Result<u16, ClientError> {
        self.usable()?;
        let len = block_len(lba, blocks, lba_size)?;
        let inside = offset
            .checked_add(len)
            .is_some_and(|end| end <= arena.len());
        let addr = arena.device_address.checked_add(offset);
        match addr {
            Some(addr) if inside && command::buffer_prps(addr, 0, len).is_some() => {
                self.submit(IoOp::Read, nsid, lba, blocks, len, Data::At(addr))
            }
            _ => Err(ClientError::InvalidArgument(format!(
                "a read of {len} bytes into arena {} at byte {offset}: outside its {} bytes, \
                 not dword-aligned, or more than one PRP list of pages",
                arena.id,
                arena.len()
            ))),
        }
    }

    /// Submits a Write of `data` (`blocks * lba_size` bytes) to `lba` on `nsid`, copied into a
    /// free slot's buffer first; returns the slot (also the command id).
    pub fn submit_write(
        &mut self,
        nsid: u32,
        lba: u64,
        blocks: u32,
        lba_size: u32,
        data: &[u8],
    ) -> Result<u16, ClientError> {
        let len = self.sized(lba, blocks, lba_size, data.len(), "data")?;
        self.submit(IoOp::Write, nsid, lba, blocks, len, Data::Slot(Some(data)))
    }

    /// Takes a free slot and submits a transfer of `len` bytes; arguments already checked.
    fn submit(
        &mut self,
        op: IoOp,
        nsid: u32,
        lba: u64,
        blocks: u32,
        len: u64,
        data: Data<'_>,
    ) -> Result<u16, ClientError> {
        if self.in_flight >= self.capacity() || self.sq.is_full() {
            return Err(ClientError::QueueFull {
                qid: self.qid(),
                in_flight: self.in_flight,
            });
        }
        let Some(slot) = self.free.pop_front() else {
            return Err(ClientError::QueueFull {
                qid: self.qid(),
                in_flight: self.in_flight,
            });
        };
        match self.issue(slot, op, nsid, lba, blocks, len, data) {
            Ok(sq_index) => {
                self.slots[slot as usize] = Some(InFlight {
                    op,
                    sq_index,
                    nsid,
                    lba,
                    blocks,
                    submitted: Instant::now(),
                });
                self.in_flight += 1;
                Ok(slot)
            }
            Err(e) => {
                self.free.push_front(slot);
                Err(e)
            }
        }
    }

    /// Writes slot `slot`'s data, PRP list and submission entry, then rings the doorbell;
    /// returns the entry's index. The ring moves only once the doorbell is stored.
    #[expect(clippy::too_many_arguments)]
    fn issue(
        &mut self,
        slot: u16,
        op: IoOp,
        nsid: u32,
        lba: u64,
        blocks: u32,
        len: u64,
        data: Data<'_>,
    ) -> Result<u32, ClientError> {
        let mem = &self.arena.mem;
        let buffer = self.slot_offset(slot);
        if let Data::Slot(Some(data)) = data {
            mem.write(buffer as usize, data)
                .map_err(shm("copying data into a slot"))?;
        }
        // The first of the slot's list pages (one holds the 512 entries a slot can need).
        let list_page = self.grant.prp_lists
            + u64::from(slot) * gpunvme_serve_proto::layout::PRP_PAGES_PER_SLOT * PAGE;
        let base = self.arena.device_address;
        let device = |offset: u64| base.checked_add(offset);
        let buffer_addr = match data {
            Data::Slot(_) => device(buffer),
            Data::At(addr) => Some(addr),
        };
        let (Some(buffer_addr), Some(list_addr)) = (buffer_addr, device(list_page)) else {
            return Err(ClientError::Protocol(format!(
                "queue {}: slot {slot}'s device addresses overflow",
                self.qid()
            )));
        };
        let Some(prps) = command::buffer_prps(buffer_addr, list_addr, len) else {
            return Err(ClientError::InvalidArgument(format!(
                "a transfer of {len} bytes has no PRPs from a slot"
            )));
        };
        if prps.list_entries > 0 {
            self.list.clear();
            for i in 0..prps.list_entries {
                let entry = command::prp_list_entry(buffer_addr, i);
                self.list.extend_from_slice(&entry.to_le_bytes());
            }
            mem.write(list_page as usize, &self.list)
                .map_err(shm("writing a PRP list"))?;
        }
        let Some(mut cmd) = command::rw_command(op, slot, nsid, lba, blocks) else {
            return Err(ClientError::InvalidArgument(format!("{blocks} blocks")));
        };
        cmd.prp1 = prps.prp1;
        cmd.prp2 = prps.prp2;
        let entry = self.grant.sq + u64::from(self.sq.tail()) * SQE_SIZE as u64;
        mem.write(entry as usize, &command::encode_sqe(&cmd))
            .map_err(shm("writing a submission entry"))?;
        // Release: the entry, the list and the data above are visible before the new tail.
        self.doorbells
            .store_u32(
                self.grant.sq_doorbell as usize,
                self.sq.next_tail(),
                Ordering::Release,
            )
            .map_err(shm("ringing the SQ tail doorbell"))?;
        Ok(self.sq.push())
    }

    /// Looks at the completion queue once: every new entry is checked and its completion
    /// kept; the CQ head doorbell is rung once for all. Returns how many were consumed. A
    /// completion that breaks the protocol breaks the pair (after the good ones before it
    /// are kept and the entry itself consumed).
    fn collect(&mut self) -> Result<usize, ClientError> {
        let mut got = 0;
        let mut result = Ok(());
        // At most a queue's worth: a controller cannot post more before the head moves.
        while got < self.depth as usize {
            let entry = self.grant.cq + u64::from(self.cq.head()) * CQE_SIZE as u64;
            let dw3 = self
                .arena
                .mem
                .load_u32(entry as usize + CQE_STATUS_DWORD, Ordering::Acquire)
                .map_err(shm("polling the completion queue"))?;
            if (dw3 & CQE_STATUS_DWORD_PHASE_BIT != 0) != self.cq.phase() {
                break;
            }
            let mut raw = [0u8; CQE_SIZE];
            self.arena
                .mem
                .read(entry as usize, &mut raw[..CQE_STATUS_DWORD])
                .map_err(shm("reading a completion entry"))?;
            // The dword loaded with Acquire, not a second read of it.
            raw[CQE_STATUS_DWORD..].copy_from_slice(&dw3.to_le_bytes());
            let checked = self.complete(&command::decode_cqe(&raw));
            self.cq.advance();
            got += 1;
            match checked {
                Ok(c) => self.ready.push_back(c),
                Err(why) => {
                    let why = format!("queue {}: {why}", self.qid());
                    self.broken = Some(why.clone());
                    result = Err(ClientError::Protocol(why));
                    break;
                }
            }
        }
        if got > 0 {
            self.doorbells
                .store_u32(
                    self.grant.cq_doorbell as usize,
                    self.cq.head(),
                    Ordering::Release,
                )
                .map_err(shm("ringing the CQ head doorbell"))?;
        }
        result.map(|()| got)
    }

    /// Checks one new completion entry against the commands in flight and frees its slot.
    fn complete(&mut self, cqe: &nvme_spec::Completion) -> Result<Completion, String> {
        if cqe.sqid != self.qid() {
            return Err(format!(
                "a completion for submission queue {} (command id {})",
                cqe.sqid, cqe.cid
            ));
        }
        let Some(Some(cmd)) = self.slots.get(cqe.cid as usize).copied() else {
            return Err(format!(
                "a completion for command id {}, which is not in flight",
                cqe.cid
            ));
        };
        self.sq.advance_head(cqe.sqhd)?;
        self.sq.fetched(cmd.sq_index);
        self.slots[cqe.cid as usize] = None;
        self.free.push_back(cqe.cid);
        self.in_flight -= 1;
        Ok(Completion {
            qid: self.qid(),
            slot: cqe.cid,
            op: cmd.op,
            nsid: cmd.nsid,
            lba: cmd.lba,
            blocks: cmd.blocks,
            status: cqe.status(),
            dw0: cqe.dw0,
        })
    }

    /// The oldest command in flight, for a timeout's message.
    fn oldest(&self) -> u16 {
        self.slots
            .iter()
            .enumerate()
            .filter_map(|(s, c)| c.map(|c| (c.submitted, s as u16)))
            .min()
            .map_or(0, |(_, s)| s)
    }

    /// The completions that arrived, without waiting (those kept by an earlier wait first).
    pub fn poll(&mut self) -> Result<Vec<Completion>, ClientError> {
        self.usable_or_ready()?;
        let collected = self.collect();
        if !self.ready.is_empty() {
            // Completions before a broken entry are returned; the error comes next call.
            return Ok(self.ready.drain(..).collect());
        }
        collected.map(|_| Vec::new())
    }

    /// Revocation fails every call; a broken pair still hands out what completed before.
    fn usable_or_ready(&self) -> Result<(), ClientError> {
        match self.usable() {
            Err(ClientError::Protocol(_)) if !self.ready.is_empty() => Ok(()),
            other => other,
        }
    }

    /// Waits up to `timeout` for at least one completion and returns every one that arrived
    /// (an empty list at once when nothing is in flight). [`ClientError::Timeout`] names the
    /// oldest command in flight when none completed in time; those commands stay in flight
    /// (their slots are not reused until they complete).
    pub fn reap(&mut self, timeout: Duration) -> Result<Vec<Completion>, ClientError> {
        let deadline = Instant::now() + timeout;
        let mut backoff = Backoff(0);
        loop {
            let got = self.poll()?;
            if !got.is_empty() || self.in_flight == 0 {
                return Ok(got);
            }
            if Instant::now() >= deadline {
                return Err(ClientError::Timeout {
                    qid: self.qid(),
                    cid: self.oldest(),
                    after: timeout,
                });
            }
            self.lease.check_peer();
            backoff.wait();
        }
    }

    /// Waits, within the bound, for command `cid`'s completion; others seen meanwhile are kept.
    fn wait_for(&mut self, cid: u16) -> Result<Completion, ClientError> {
        let deadline = Instant::now() + self.bound;
        let mut backoff = Backoff(0);
        loop {
            if let Some(at) = self.ready.iter().position(|c| c.slot == cid) {
                if let Some(c) = self.ready.remove(at) {
                    return Ok(c);
                }
            }
            self.usable()?;
            if self.collect()? == 0 {
                if Instant::now() >= deadline {
                    return Err(ClientError::Timeout {
                        qid: self.qid(),
                        cid,
                        after: self.bound,
                    });
                }
                self.lease.check_peer();
                backoff.wait();
            }
        }
    }

    /// Makes room for one command, waiting within the bound for a completion (kept for the
    /// next `reap`) when every slot is in flight.
    fn make_room(&mut self) -> Result<(), ClientError> {
        let deadline = Instant::now() + self.bound;
        let mut backoff = Backoff(0);
        while self.in_flight >= self.capacity() || self.sq.is_full() {
            self.usable()?;
            if self.collect()? == 0 {
                if Instant::now() >= deadline {
                    return Err(ClientError::Timeout {
                        qid: self.qid(),
                        cid: self.oldest(),
                        after: self.bound,
                    });
                }
                self.lease.check_peer();
                backoff.wait();
            }
        }
        Ok(())
    }

    /// Reads `blocks` blocks of `lba_size` bytes from `lba` on `nsid` into `buf` (exactly
    /// `blocks * lba_size` bytes, at most the slot size) and waits for it within the bound
    /// ([`QueuePair::bound`]). On [`ClientError::Timeout`] the command stays in flight: its
    /// slot is not reused until it completes, and its completion, if it comes, is returned by
    /// a later [`QueuePair::reap`].
    pub fn read(
        &mut self,
        nsid: u32,
        lba: u64,
        blocks: u32,
        lba_size: u32,
        buf: &mut [u8],
    ) -> Result<(), ClientError> {
        let len = self.sized(lba, blocks, lba_size, buf.len(), "buffer")?;
        self.make_room()?;
        let cid = self.submit(IoOp::Read, nsid, lba, blocks, len, Data::Slot(None))?;
        self.wait_for(cid)?.check()?;
        self.slot_data(cid, buf)
    }

    /// Writes `data` (exactly `blocks * lba_size` bytes, at most the slot size) to `lba` on
    /// `nsid` and waits for it within the bound, as [`QueuePair::read`] does.
    pub fn write(
        &mut self,
        nsid: u32,
        lba: u64,
        blocks: u32,
        lba_size: u32,
        data: &[u8],
    ) -> Result<(), ClientError> {
        let len = self.sized(lba, blocks, lba_size, data.len(), "data")?;
        self.make_room()?;
        let cid = self.submit(IoOp::Write, nsid, lba, blocks, len, Data::Slot(Some(data)))?;
        self.wait_for(cid)?.check()
    }

    /// Copies the first `buf.len()` bytes of slot `slot`'s buffer out: a Read's data after its
    /// completion was reaped. Refused while the slot's command is in flight. The data stays
    /// until the slot is used again; free slots are reused oldest-freed first.
    pub fn slot_data(&self, slot: u16, buf: &mut [u8]) -> Result<(), ClientError> {
        match self.slots.get(slot as usize) {
            None => Err(ClientError::InvalidArgument(format!(
                "slot {slot} of queue {}, which has {}",
                self.qid(),
                self.depth
            ))),
            Some(Some(_)) => Err(ClientError::InvalidArgument(format!(
                "slot {slot} of queue {} is in flight",
                self.qid()
            ))),
            Some(None) if buf.len() as u64 > u64::from(self.slot_bytes) => {
                Err(ClientError::InvalidArgument(format!(
                    "{} bytes from a {}-byte slot",
                    buf.len(),
                    self.slot_bytes
                )))
            }
            Some(None) => self
                .arena
                .mem
                .read(self.slot_offset(slot) as usize, buf)
                .map_err(shm("copying data out of a slot")),
        }
    }
}

/// The bytes of `blocks` blocks of `lba_size` from `lba`, checked: a block count one command
/// carries, a block size of whole dwords, and no LBA past the last.
fn block_len(lba: u64, blocks: u32, lba_size: u32) -> Result<u64, ClientError> {
    let bad = |why: String| Err(ClientError::InvalidArgument(why));
    if blocks == 0 || blocks > command::MAX_BLOCKS {
        return bad(format!(
            "{blocks} blocks; one command moves 1 to {}",
            command::MAX_BLOCKS
        ));
    }
    if lba_size == 0 || lba_size % 4 != 0 {
        return bad(format!("a block size of {lba_size} bytes"));
    }
    if lba.checked_add(u64::from(blocks)).is_none() {
        return bad(format!("{blocks} blocks from lba {lba} pass the last LBA"));
    }
    Ok(u64::from(blocks) * u64::from(lba_size))
}
