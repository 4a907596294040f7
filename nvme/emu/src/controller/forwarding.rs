//! A controller thread's forwarded commands ([`crate::forward`]): one channel per forwarded
//! namespace, opened on first use; commands in flight on it by tag; their completions posted
//! as the far controller answers, a read's data copied into the host's buffers then (its PRPs
//! walked again: they were checked when the command was sent, and the host keeps them until
//! the completion, as for any controller).
//!
//! A queue deleted (or the controller reset, or a command aborted) while its commands are in
//! flight forgets them at once, completing them as aborted where the host still waits: what
//! the far controller answers later is dropped and never touches host memory.

use std::collections::HashMap;
use std::time::Duration;

use nvme_spec::status::generic;
use nvme_spec::{Command, CqeStatus, Status};

use super::worker::Worker;
use super::{CmdResult, Fail, Outcome};
use crate::forward::{ForwardChannel, ForwardData, ForwardDone, ForwardError};
use crate::prp::copy_to_host;
use crate::queues::PendingCompletion;
use crate::stats::Counters;
use crate::storage::Media;

/// How long an idle thread with commands in flight waits on one channel per pass: a new
/// command the host rings for meanwhile waits up to this long.
pub(super) const IDLE_WAIT: Duration = Duration::from_micros(100);

/// How long a thread waits for room on a full channel per look.
const ROOM_WAIT: Duration = Duration::from_millis(1);

/// A command in flight on a channel.
struct InFlight {
    /// Namespace index (its channel).
    ns: usize,
    sqid: u16,
    cqid: u16,
    /// The command as the host sent it (its PRPs, CID, NSID).
    cmd: Command,
    /// A read's length in bytes.
    read_len: Option<usize>,
    /// Waited for by the thread itself ([`Worker::forward_wait`]) rather than posted.
    sync: bool,
}

/// A thread's forwarding state.
#[derive(Default)]
pub(crate) struct Forwarding {
    /// Per namespace index: this thread's channel, once opened.
    channels: Vec<Option<Box<dyn ForwardChannel>>>,
    /// Commands in flight per namespace index (including forgotten ones still owed a reply).
    sent: Vec<usize>,
    pending: HashMap<u64, InFlight>,
    next_tag: u64,
    done: Vec<ForwardDone>,
    /// Results of commands waited for ([`InFlight::sync`]).
    sync_results: Vec<(u64, Result<Status, ()>)>,
}

impl Forwarding {
    /// Commands this thread has in flight on any channel.
    pub(super) fn in_flight(&self) -> usize {
        self.sent.iter().sum()
    }

    /// Forgets every command (a controller reset): replies still owed are dropped.
    pub(super) fn forget_all(&mut self) {
        self.pending.clear();
        self.sync_results.clear();
    }
}

/// Transient Transport Error, retryable: the channel failed or could not be opened.
fn transport_fail() -> Fail {
    Fail::generic(generic::TRANSIENT_TRANSPORT_ERROR).retryable()
}

impl Worker {
    /// Whether namespace `index` is forwarded.
    pub(super) fn is_forwarded(&self, index: usize) -> bool {
        matches!(self.namespaces[index].media, Media::Forwarded(_))
    }

    /// The far namespace id of forwarded namespace `index`.
    fn far_nsid(&self, index: usize) -> u32 {
        match &self.namespaces[index].media {
            Media::Forwarded(f) => f.nsid,
            _ => 0,
        }
    }

    /// This thread's channel to namespace `index`'s controller, opened if need be.
    fn channel(&mut self, index: usize) -> Result<&mut Box<dyn ForwardChannel>, Fail> {
        if self.fwd.channels.len() < self.namespaces.len() {
            self.fwd
                .channels
                .resize_with(self.namespaces.len(), || None);
            self.fwd.sent.resize(self.namespaces.len(), 0);
        }
        if self.fwd.channels[index].is_none() {
            let Media::Forwarded(f) = &self.namespaces[index].media else {
                return Err(transport_fail());
            };
            match f.forwarder.channel() {
                Ok(c) => self.fwd.channels[index] = Some(c),
                Err(e) => {
                    // The far controller cannot be reached again (its channel failed before, or
                    // it never opened): as a controller whose media is gone, this one enters
                    // Controller Fatal Status, so hosts stop at once rather than retry forever.
                    tracing::error!(thread = self.index, namespace = index + 1, error = %e,
                        "a forwarded namespace's controller is unreachable; controller fatal");
                    self.enter_fatal("a forwarded namespace's far controller is unreachable");
                    return Err(transport_fail());
                }
            }
        }
        Ok(self.fwd.channels[index].as_mut().expect("opened"))
    }

    /// Sends `cmd` of namespace `index` on with `data`; the command completes when the far
    /// controller answers ([`Outcome::Forwarded`]).
    pub(super) fn forward(&mut self, index: usize, cmd: &Command, data: ForwardData) -> CmdResult {
        let read_len = match data {
            ForwardData::FromController(n) => Some(n),
            _ => None,
        };
        let tag = self.submit_forward(index, cmd, data)?;
        Ok(Outcome::Forwarded {
            tag,
            ns: index,
            read_len,
        })
    }

    /// Submits `cmd` (its NSID made the far one) on namespace `index`'s channel, waiting for
    /// room first; returns its tag.
    fn submit_forward(
        &mut self,
        index: usize,
        cmd: &Command,
        data: ForwardData,
    ) -> Result<u64, Fail> {
        let mut far = *cmd;
        far.nsid = self.far_nsid(index);
        loop {
            if self.channel(index)?.has_room() {
                break;
            }
            // Completes others (posting them) until one slot is free, or the channel fails.
            if !self.poll_channel(index, ROOM_WAIT) {
                return Err(transport_fail());
            }
        }
        self.fwd.next_tag += 1;
        let tag = self.fwd.next_tag;
        let sent = self.channel(index)?.submit(tag, far, data);
        match sent {
            Ok(()) => {
                self.fwd.sent[index] += 1;
                Ok(tag)
            }
            Err(e) => {
                self.fail_channel(index, &e);
                Err(transport_fail())
            }
        }
    }

    /// Records a forwarded command sent for submission queue `sqid` (from
    /// [`Worker::conclude`]).
    pub(super) fn track_forwarded(
        &mut self,
        sqid: u16,
        cqid: u16,
        cmd: &Command,
        (tag, ns, read_len): (u64, usize, Option<usize>),
    ) {
        self.fwd.pending.insert(
            tag,
            InFlight {
                ns,
                sqid,
                cqid,
                cmd: *cmd,
                read_len,
                sync: false,
            },
        );
    }

    /// Forwards `cmd` of namespace `index` and waits for its answer (Flush of every
    /// namespace, which may need several far controllers); other commands complete
    /// meanwhile. Bounded by the channel, which fails a command past its bound.
    pub(super) fn forward_wait(
        &mut self,
        index: usize,
        cmd: &Command,
        data: ForwardData,
    ) -> Result<(), Fail> {
        let tag = self.submit_forward(index, cmd, data)?;
        self.fwd.pending.insert(
            tag,
            InFlight {
                ns: index,
                sqid: 0,
                cqid: 0,
                cmd: *cmd,
                read_len: None,
                sync: true,
            },
        );
        loop {
            if let Some(at) = self.fwd.sync_results.iter().position(|r| r.0 == tag) {
                let (_, r) = self.fwd.sync_results.swap_remove(at);
                return match r {
                    Ok(s) if s.is_success() => Ok(()),
                    Ok(s) => Err(Fail::new(s).retryable().with_dnr_of(s)),
                    Err(()) => Err(transport_fail()),
                };
            }
            if !self.poll_channel(index, ROOM_WAIT) && !self.fwd.pending.contains_key(&tag) {
                // The channel failed: its commands (this one among them) were failed.
                if !self.fwd.sync_results.iter().any(|r| r.0 == tag) {
                    return Err(transport_fail());
                }
            }
        }
    }

    /// Takes in the answers of every channel with commands in flight, waiting up to `wait` on
    /// the first; returns whether anything completed or failed.
    pub(super) fn poll_forwarded(&mut self, wait: Duration) -> bool {
        let mut worked = false;
        let mut wait = wait;
        for index in 0..self.fwd.channels.len() {
            if self.fwd.sent[index] == 0 {
                continue;
            }
            worked |= self.poll_channel_once(index, wait);
            wait = Duration::ZERO;
        }
        worked
    }

    /// Polls namespace `index`'s channel once; returns whether the channel is still open.
    fn poll_channel(&mut self, index: usize, wait: Duration) -> bool {
        self.poll_channel_once(index, wait);
        self.fwd.channels.get(index).is_some_and(|c| c.is_some())
    }

    /// Polls namespace `index`'s channel once, completing what finished; returns whether
    /// anything did (or the channel failed).
    fn poll_channel_once(&mut self, index: usize, wait: Duration) -> bool {
        let Some(Some(channel)) = self.fwd.channels.get_mut(index) else {
            return false;
        };
        let mut done = std::mem::take(&mut self.fwd.done);
        let polled = channel.poll(wait, &mut done);
        let worked = !done.is_empty();
        self.fwd.sent[index] = self.fwd.sent[index].saturating_sub(done.len());
        for d in done.drain(..) {
            self.forwarded_done(d);
        }
        self.fwd.done = done;
        if let Err(e) = polled {
            self.fail_channel(index, &e);
            return true;
        }
        worked
    }

    /// Completes the command `d` answers, if it is still wanted.
    fn forwarded_done(&mut self, d: ForwardDone) {
        let Some(f) = self.fwd.pending.remove(&d.tag) else {
            // Its queue was deleted, it was aborted, or the controller was reset.
            return;
        };
        if f.sync {
            self.fwd.sync_results.push((d.tag, Ok(d.status)));
            return;
        }
        let result = if !d.status.is_success() {
            let mut fail = Fail::new(d.status).with_dnr_of(d.status);
            fail.lba = f.cmd.slba();
            Err(fail)
        } else if let Some(len) = f.read_len {
            self.land_read(&f.cmd, len, &d.data)
        } else {
            Ok(())
        };
        let (dw0, status) = match result {
            Ok(()) => {
                let c = &self.shared.counters[self.index];
                match f.read_len {
                    Some(len) => {
                        Counters::add(&c.reads, 1);
                        Counters::add(&c.bytes_read, len as u64);
                    }
                    None if nvme_spec::NvmOpcode(f.cmd.cdw0.opcode())
                        == nvme_spec::NvmOpcode::WRITE =>
                    {
                        Counters::add(&c.writes, 1);
                        let len =
                            ((f.cmd.cdw12 & 0xffff) as u64 + 1) << self.namespaces[f.ns].lba_shift;
                        Counters::add(&c.bytes_written, len);
                    }
                    None => {}
                }
                (d.dw0, 0)
            }
            Err(fail) => (0, self.log_error(f.sqid, &f.cmd, fail)),
        };
        let pc = PendingCompletion {
            sqid: f.sqid,
            cid: f.cmd.cdw0.cid(),
            dw0,
            status,
        };
        self.finish(f.cqid, pc);
    }

    /// Copies a read's data (`len` bytes expected) into the host buffers of `cmd`.
    fn land_read(&mut self, cmd: &Command, len: usize, data: &[u8]) -> Result<(), Fail> {
        if data.len() != len {
            return Err(transport_fail());
        }
        self.walk_prps(cmd, len as u64)?;
        copy_to_host(&mut self.cache, &self.segments, data).map_err(|_| Fail::data_transfer())
    }

    /// Fails namespace `index`'s channel: every command in flight on it completes with
    /// Transient Transport Error, and the next command opens a new channel.
    fn fail_channel(&mut self, index: usize, e: &ForwardError) {
        tracing::warn!(thread = self.index, namespace = index + 1, error = %e,
            "a forwarded namespace's channel failed; its commands fail (retryable)");
        if let Some(c) = self.fwd.channels.get_mut(index) {
            *c = None;
        }
        if let Some(s) = self.fwd.sent.get_mut(index) {
            *s = 0;
        }
        let tags: Vec<u64> = self
            .fwd
            .pending
            .iter()
            .filter(|(_, f)| f.ns == index)
            .map(|(&t, _)| t)
            .collect();
        for tag in tags {
            let f = self.fwd.pending.remove(&tag).expect("listed");
            if f.sync {
                self.fwd.sync_results.push((tag, Err(())));
                continue;
            }
            let status = self.log_error(f.sqid, &f.cmd, transport_fail());
            let pc = PendingCompletion {
                sqid: f.sqid,
                cid: f.cmd.cdw0.cid(),
                dw0: 0,
                status,
            };
            self.finish(f.cqid, pc);
        }
    }

    /// Forgets the forwarded commands of submission queue `sqid` (being deleted), completing
    /// them as aborted by the deletion.
    pub(super) fn forget_forwarded_of(&mut self, sqid: u16, cqid: u16) {
        let aborted = CqeStatus::from_status(Status::generic(generic::ABORTED_SQ_DELETION), false);
        let cids: Vec<(u64, u16)> = self
            .fwd
            .pending
            .iter()
            .filter(|(_, f)| !f.sync && f.sqid == sqid)
            .map(|(&t, f)| (t, f.cmd.cdw0.cid()))
            .collect();
        for (tag, cid) in cids {
            self.fwd.pending.remove(&tag);
            let pc = PendingCompletion {
                sqid,
                cid,
                dw0: 0,
                status: aborted.into_bits(),
            };
            self.finish(cqid, pc);
        }
    }

    /// Abort of a forwarded command: it completes now with Command Abort Requested (the far
    /// controller may still carry it out; its answer is dropped). Returns whether there was
    /// one.
    pub(super) fn abort_forwarded(&mut self, sqid: u16, cid: u16, status: u16) -> bool {
        let Some(tag) = self
            .fwd
            .pending
            .iter()
            .find(|(_, f)| !f.sync && f.sqid == sqid && f.cmd.cdw0.cid() == cid)
            .map(|(&t, _)| t)
        else {
            return false;
        };
        let f = self.fwd.pending.remove(&tag).expect("found");
        let pc = PendingCompletion {
            sqid,
            cid,
            dw0: 0,
            status,
        };
        self.finish(f.cqid, pc);
        true
    }
}

impl Fail {
    /// Do Not Retry as `s` has it.
    fn with_dnr_of(mut self, s: Status) -> Self {
        self.status = self.status.with_dnr(s.dnr);
        self
    }
}
