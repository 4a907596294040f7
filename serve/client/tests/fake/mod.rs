//! A fake `gpunvme serve` for the client's tests: a thread that plays the daemon over a
//! channel (Welcome, a controller with one namespace, memfd arenas, queue grants laid out as
//! docs/serve.md says, a doorbell page), and per granted pair a thread that plays the NVMe
//! controller: it polls the SQ tail word, fetches submission entries from the arena, runs Read
//! and Write against an in-memory disk through the PRPs, and posts completions with the phase
//! tag. Knobs make it misbehave (stop completing, post a bad command id, refuse, send events).
//!
//! The controller side parses entries by `nvme_spec::wire` offsets itself rather than through
//! the client's codec, so the two are checked against each other.

#![allow(dead_code)]

use std::collections::HashMap;
use std::os::fd::AsFd;
use std::sync::atomic::{AtomicBool, AtomicU16, AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::Duration;

use gpunvme_serve_client::{Connection, Event, PROTOCOL_VERSION, RefusalKind, SharedMemory};
use gpunvme_serve_proto::msg::{NamespaceInfo, QueueGrant};
use gpunvme_serve_proto::socket::{Channel, SocketError};
use gpunvme_serve_proto::{Frame, Message, Reply, Request};
use nvme_spec::status::generic;
use nvme_spec::wire::{
    CQE_SQHD, CQE_SQID, CQE_STATUS_DWORD, SQE_CDW0, SQE_CDW10, SQE_CDW11, SQE_CDW12, SQE_NSID,
    SQE_PRP1, SQE_PRP2,
};
use nvme_spec::{CqeStatus, Status};

/// The controller's name.
pub const CONTROLLER: &str = "fake0";
/// Its namespace.
pub const NSID: u32 = 1;
/// Bytes per block.
pub const LBA_SIZE: u32 = 512;
/// Blocks of the namespace (8 MiB).
pub const BLOCKS: u64 = 16384;
/// Where the fake's arenas start in "device" addresses.
pub const DEVICE_BASE: u64 = 0x40_0000_0000;
/// The bound of the tests' waits.
pub const BOUND: Duration = Duration::from_secs(2);

const PAGE: u64 = 4096;

/// What makes the fake misbehave, and what it saw.
#[derive(Default)]
pub struct Knobs {
    /// The controller fetches nothing and completes nothing.
    pub stop_completing: AtomicBool,
    /// The controller posts the next completion with a command id nobody sent.
    pub bad_cid: AtomicBool,
    /// The controller reports SQ head 0 in every completion (a stale head).
    pub stale_sqhd: AtomicBool,
    /// The controller reports the next completion's SQ head as the queue's depth (outside).
    pub sqhd_outside: AtomicBool,
    /// The controller completes each fetched batch in reverse order.
    pub reverse: AtomicBool,
    /// The daemon grants every pair the same SQ.
    pub overlap_grants: AtomicBool,
    /// The version the Welcome says (0: ours).
    pub welcome_version: AtomicU16,
    /// The next AllocArena is refused so.
    pub refuse_alloc: Mutex<Option<(RefusalKind, String)>>,
    /// Sent (id 0) before the next reply.
    pub events_before_reply: Mutex<Vec<Event>>,
    /// Sent (id 0) as soon as the daemon thread is idle.
    pub events_now: Mutex<Vec<Event>>,
    /// Submission entries the controllers fetched.
    pub commands: AtomicU64,
    /// Request ids, in the order received.
    pub request_ids: Mutex<Vec<u32>>,
}

/// The in-memory namespace.
pub type Disk = Arc<Mutex<Vec<u8>>>;

/// A running fake daemon.
pub struct Fake {
    /// Its knobs.
    pub knobs: Arc<Knobs>,
    /// Its namespace's bytes.
    pub disk: Disk,
    stop: Arc<AtomicBool>,
    daemon: Option<JoinHandle<()>>,
}

impl Fake {
    /// Stops the daemon (and its controllers) and closes its end of the socket.
    pub fn hang_up(&mut self) {
        self.stop.store(true, Ordering::Release);
        if let Some(t) = self.daemon.take() {
            t.join().expect("the fake daemon panicked");
        }
    }
}

impl Drop for Fake {
    fn drop(&mut self) {
        self.hang_up();
    }
}

/// A fake daemon on a new channel pair, and a client connected to it.
pub fn start() -> (Connection, Fake) {
    match start_with(Knobs::default()) {
        Ok(started) => started,
        Err((e, _)) => panic!("connecting to the fake: {e}"),
    }
}

/// A fake daemon with `knobs`, and the result of connecting a client to it.
pub fn start_with(
    knobs: Knobs,
) -> Result<(Connection, Fake), (gpunvme_serve_client::ClientError, Fake)> {
    let (ours, theirs) = Channel::pair(Duration::from_millis(20)).unwrap();
    let fake = spawn(theirs, knobs);
    // The client's channel: its own bound.
    let client = Channel::new(ours.fd().try_clone_to_owned().unwrap(), BOUND);
    drop(ours);
    match Connection::from_channel(client, "test-client", BOUND) {
        Ok(c) => Ok((c, fake)),
        Err(e) => Err((e, fake)),
    }
}

/// Serves `channel` on a new thread.
pub fn spawn(channel: Channel, knobs: Knobs) -> Fake {
    let knobs = Arc::new(knobs);
    let disk: Disk = Arc::new(Mutex::new(vec![
        0u8;
        (BLOCKS * u64::from(LBA_SIZE)) as usize
    ]));
    let stop = Arc::new(AtomicBool::new(false));
    let daemon = {
        let (knobs, disk, stop) = (knobs.clone(), disk.clone(), stop.clone());
        std::thread::spawn(move || Daemon::new(channel, knobs, disk, stop).run())
    };
    Fake {
        knobs,
        disk,
        stop,
        daemon: Some(daemon),
    }
}

struct FakeArena {
    mem: Arc<SharedMemory>,
    device_address: u64,
}

struct Daemon {
    channel: Channel,
    knobs: Arc<Knobs>,
    disk: Disk,
    stop: Arc<AtomicBool>,
    arenas: HashMap<u64, FakeArena>,
    next_arena: u64,
    next_qid: u16,
    /// Per qid: its controller thread's stop flag and handle.
    controllers: HashMap<u16, (Arc<AtomicBool>, JoinHandle<()>)>,
}

impl Daemon {
    fn new(channel: Channel, knobs: Arc<Knobs>, disk: Disk, stop: Arc<AtomicBool>) -> Self {
        Self {
            channel,
            knobs,
            disk,
            stop,
            arenas: HashMap::new(),
            next_arena: 1,
            next_qid: 1,
            controllers: HashMap::new(),
        }
    }

    fn run(mut self) {
        while !self.stop.load(Ordering::Acquire) {
            let pending: Vec<Event> = std::mem::take(&mut *self.knobs.events_now.lock().unwrap());
            for e in pending {
                self.send(0, Message::Event(e), None);
            }
            match self.channel.recv() {
                Ok((frame, _fds)) => self.handle(frame),
                Err(SocketError::Timeout { .. }) => continue,
                Err(SocketError::Closed) => break,
                Err(e) => {
                    let message = format!("a bad frame: {e}");
                    self.reply(
                        0,
                        Reply::Refused {
                            kind: RefusalKind::Protocol,
                            message,
                        },
                        None,
                    );
                }
            }
        }
        for (_, (stop, t)) in self.controllers.drain() {
            stop.store(true, Ordering::Release);
            t.join().expect("a fake controller panicked");
        }
    }

    fn send(&self, id: u32, message: Message, fd: Option<&SharedMemory>) {
        let frame = Frame {
            request_id: id,
            message,
        };
        let fds: Vec<_> = fd.iter().map(|m| m.fd()).collect();
        // A client gone is the test's business.
        let _ = self.channel.send(&frame, &fds);
    }

    fn reply(&self, id: u32, reply: Reply, fd: Option<&SharedMemory>) {
        let events: Vec<Event> =
            std::mem::take(&mut *self.knobs.events_before_reply.lock().unwrap());
        for e in events {
            self.send(0, Message::Event(e), None);
        }
        self.send(id, Message::Reply(reply), fd);
    }

    fn refuse(&self, id: u32, kind: RefusalKind, message: String) {
        self.reply(id, Reply::Refused { kind, message }, None);
    }

    fn handle(&mut self, frame: Frame) {
        let id = frame.request_id;
        self.knobs.request_ids.lock().unwrap().push(id);
        let Message::Request(request) = frame.message else {
            return self.refuse(id, RefusalKind::Protocol, "not a request".into());
        };
        let done = Reply::Done {
            status: 0,
            result: 0,
        };
        match request {
            Request::Hello { .. } => {
                let v = self.knobs.welcome_version.load(Ordering::Relaxed);
                let welcome = Reply::Welcome {
                    version: if v == 0 { PROTOCOL_VERSION } else { v },
                    daemon: "fake-serve 0".into(),
                    trust: "cooperative: a test".into(),
                    controllers: vec![CONTROLLER.into()],
                };
                self.reply(id, welcome, None);
            }
            Request::OpenController { controller } if controller == CONTROLLER => {
                let info = Reply::Controller {
                    name: controller,
                    queues_free: 32,
                    max_transfer_bytes: 2 << 20,
                    namespaces: vec![NamespaceInfo {
                        nsid: NSID,
                        blocks: BLOCKS,
                        lba_size: LBA_SIZE,
                    }],
                    controller_threads: None,
                };
                self.reply(id, info, None);
            }
            Request::OpenController { controller } => {
                self.refuse(
                    id,
                    RefusalKind::NotFound,
                    format!("no controller {controller}"),
                );
            }
            Request::AllocArena { bytes, .. } => {
                if let Some((kind, message)) = self.knobs.refuse_alloc.lock().unwrap().take() {
                    return self.refuse(id, kind, message);
                }
                let mem = Arc::new(SharedMemory::create("fake-arena", bytes as usize).unwrap());
                let arena = self.next_arena;
                self.next_arena += 1;
                let device_address = DEVICE_BASE + (arena << 36);
                let reply = Reply::Arena {
                    id: arena,
                    device_address,
                    len: bytes,
                };
                self.reply(id, reply, Some(&mem));
                self.arenas.insert(
                    arena,
                    FakeArena {
                        mem,
                        device_address,
                    },
                );
            }
            Request::CreateQueues {
                arena,
                count,
                depth,
                slot_bytes,
                ..
            } => self.create_queues(id, arena, count, depth, slot_bytes),
            Request::DeleteQueues { qids, .. } => {
                for qid in qids {
                    if let Some((stop, t)) = self.controllers.remove(&qid) {
                        stop.store(true, Ordering::Release);
                        t.join().expect("a fake controller panicked");
                    }
                }
                self.reply(id, done, None);
            }
            Request::FreeArena { arena } => match self.arenas.remove(&arena) {
                Some(_) => self.reply(id, done, None),
                None => self.refuse(id, RefusalKind::NotFound, format!("no arena {arena}")),
            },
            Request::Admin {
                arena,
                offset,
                opcode,
                ..
            } => {
                let Some(a) = self.arenas.get(&arena) else {
                    return self.refuse(id, RefusalKind::NotFound, format!("no arena {arena}"));
                };
                a.mem.write(offset as usize, &[opcode; 4096]).unwrap();
                let reply = Reply::Done {
                    status: 0,
                    result: 0x1234,
                };
                self.reply(id, reply, None);
            }
            Request::Status => {
                let json = format!("{{\"clients\": 1, \"queues\": {}}}", self.controllers.len());
                self.reply(id, Reply::Status { json }, None);
            }
            Request::FsCreate { bytes, .. } => {
                // A table of `bytes` bytes announced, in a memory file of one page: a lie
                // whenever `bytes` is over a page.
                let mem = Arc::new(SharedMemory::create("fake-table", 4096).unwrap());
                mem.write(0, b"BFXT").unwrap();
                let reply = Reply::FsReserved {
                    lease: 9,
                    table_bytes: bytes,
                };
                self.reply(id, reply, Some(&mem));
            }
            Request::FsGrow { .. } => {
                // The grown table of lease 9, whichever lease was asked for (a lie for others).
                let mem = Arc::new(SharedMemory::create("fake-table", 4096).unwrap());
                mem.write(0, b"BFXT").unwrap();
                let reply = Reply::FsReserved {
                    lease: 9,
                    table_bytes: 4096,
                };
                self.reply(id, reply, Some(&mem));
            }
            Request::FsView { .. }
            | Request::FsCommit { .. }
            | Request::FsAbort { .. }
            | Request::FsRemove { .. }
            | Request::FsRename { .. } => self.reply(id, Reply::Fs { generation: 7 }, None),
        }
    }

    fn create_queues(&mut self, id: u32, arena: u64, count: u16, depth: u32, slot_bytes: u32) {
        let Some(a) = self.arenas.get(&arena) else {
            return self.refuse(id, RefusalKind::NotFound, format!("no arena {arena}"));
        };
        let (mem, base) = (a.mem.clone(), a.device_address);
        // The protocol's layout, computed here on its own terms (SQ, CQ, two list pages per
        // slot, slots), not through the crate under test.
        let up = |n: u64| n.div_ceil(PAGE) * PAGE;
        let d = u64::from(depth);
        let mut at = 0u64;
        let mut grants = Vec::new();
        for i in 0..count {
            let mut take = |bytes: u64| {
                let start = at;
                at += up(bytes);
                start
            };
            let (sq, cq) = (take(d * 64), take(d * 16));
            let (prp_lists, slots) = (take(d * 2 * PAGE), take(d * u64::from(slot_bytes)));
            let qid = self.next_qid + i;
            grants.push(QueueGrant {
                qid,
                sq_doorbell: 8 * u32::from(qid),
                cq_doorbell: 8 * u32::from(qid) + 4,
                sq: if self.knobs.overlap_grants.load(Ordering::Relaxed) {
                    0
                } else {
                    sq
                },
                cq,
                slots,
                prp_lists,
            });
        }
        if at > mem.len() as u64 {
            let message = format!("the layout needs {at} bytes, the arena has {}", mem.len());
            return self.refuse(id, RefusalKind::InvalidArgument, message);
        }
        self.next_qid += count;
        let doorbells = Arc::new(SharedMemory::create("fake-doorbells", 4096).unwrap());
        for g in &grants {
            let stop = Arc::new(AtomicBool::new(false));
            let ctl = Controller {
                arena: mem.clone(),
                base,
                doorbells: doorbells.clone(),
                grant: *g,
                depth,
                knobs: self.knobs.clone(),
                disk: self.disk.clone(),
                stop: stop.clone(),
            };
            self.controllers
                .insert(g.qid, (stop, std::thread::spawn(move || ctl.run())));
        }
        self.reply(id, Reply::Queues { queues: grants }, Some(&doorbells));
    }
}

/// One pair's controller.
struct Controller {
    arena: Arc<SharedMemory>,
    base: u64,
    doorbells: Arc<SharedMemory>,
    grant: QueueGrant,
    depth: u32,
    knobs: Arc<Knobs>,
    disk: Disk,
    stop: Arc<AtomicBool>,
}

fn dword(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn qword(b: &[u8], at: usize) -> u64 {
    u64::from_le_bytes(b[at..at + 8].try_into().unwrap())
}

impl Controller {
    fn stopped(&self) -> bool {
        self.stop.load(Ordering::Acquire)
    }

    fn run(self) {
        let (mut head, mut cq_tail, mut phase) = (0u32, 0u32, true);
        while !self.stopped() {
            let tail = self
                .doorbells
                .load_u32(self.grant.sq_doorbell as usize, Ordering::Acquire)
                .unwrap();
            if tail >= self.depth
                || tail == head
                || self.knobs.stop_completing.load(Ordering::Acquire)
            {
                std::thread::sleep(Duration::from_micros(50));
                continue;
            }
            let mut batch = Vec::new();
            while head != tail {
                let mut sqe = [0u8; 64];
                let at = self.grant.sq + 64 * u64::from(head);
                self.arena.read(at as usize, &mut sqe).unwrap();
                batch.push(sqe);
                head = (head + 1) % self.depth;
                self.knobs.commands.fetch_add(1, Ordering::Relaxed);
            }
            if self.knobs.reverse.load(Ordering::Relaxed) {
                batch.reverse();
            }
            for sqe in batch {
                let status = self.execute(&sqe);
                let mut cid = (dword(&sqe, SQE_CDW0) >> 16) as u16;
                if self.knobs.bad_cid.swap(false, Ordering::Relaxed) {
                    cid = 0xfff0;
                }
                // Room in the CQ: the host's head must not be the next tail.
                while (cq_tail + 1) % self.depth
                    == self
                        .doorbells
                        .load_u32(self.grant.cq_doorbell as usize, Ordering::Acquire)
                        .unwrap()
                {
                    if self.stopped() {
                        return;
                    }
                    std::thread::yield_now();
                }
                let at = (self.grant.cq + 16 * u64::from(cq_tail)) as usize;
                let mut first = [0u8; 12];
                let sqhd = if self.knobs.sqhd_outside.swap(false, Ordering::Relaxed) {
                    self.depth as u16
                } else if self.knobs.stale_sqhd.load(Ordering::Relaxed) {
                    0
                } else {
                    head as u16
                };
                first[CQE_SQHD..CQE_SQHD + 2].copy_from_slice(&sqhd.to_le_bytes());
                first[CQE_SQID..CQE_SQID + 2].copy_from_slice(&self.grant.qid.to_le_bytes());
                self.arena.write(at, &first).unwrap();
                let sf = CqeStatus::from_status(status, phase).into_bits();
                let dw3 = u32::from(cid) | u32::from(sf) << 16;
                self.arena
                    .store_u32(at + CQE_STATUS_DWORD, dw3, Ordering::Release)
                    .unwrap();
                cq_tail += 1;
                if cq_tail == self.depth {
                    cq_tail = 0;
                    phase = !phase;
                }
            }
        }
    }

    /// Runs one Read or Write against the disk; its status.
    fn execute(&self, sqe: &[u8; 64]) -> Status {
        let opcode = sqe[0];
        if dword(sqe, SQE_NSID) != NSID {
            return Status::generic(generic::INVALID_NAMESPACE_OR_FORMAT);
        }
        let lba = u64::from(dword(sqe, SQE_CDW10)) | u64::from(dword(sqe, SQE_CDW11)) << 32;
        let blocks = u64::from(dword(sqe, SQE_CDW12) & 0xffff) + 1;
        if lba.checked_add(blocks).is_none_or(|end| end > BLOCKS) {
            return Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr(true);
        }
        let len = blocks * u64::from(LBA_SIZE);
        let (prp1, prp2) = (qword(sqe, SQE_PRP1), qword(sqe, SQE_PRP2));
        // PRP Entry 1 may start inside a page (dword-aligned); every later entry is a page.
        if prp1 % 4 != 0 {
            return Status::generic(generic::PRP_OFFSET_INVALID);
        }
        let pages = (prp1 % PAGE + len).div_ceil(PAGE);
        let mut addrs = vec![prp1];
        match pages {
            1 => {}
            2 => addrs.push(prp2),
            n => {
                let Some(list) = self.offset(prp2, 8 * (n - 1)) else {
                    return Status::generic(generic::DATA_TRANSFER_ERROR);
                };
                let mut raw = vec![0u8; (8 * (n - 1)) as usize];
                self.arena.read(list, &mut raw).unwrap();
                addrs.extend(
                    raw.chunks(8)
                        .map(|c| u64::from_le_bytes(c.try_into().unwrap())),
                );
            }
        }
        let mut disk = self.disk.lock().unwrap();
        let mut at = (lba * u64::from(LBA_SIZE)) as usize;
        let mut left = len;
        for (i, addr) in addrs.into_iter().enumerate() {
            let n = left.min(PAGE - addr % PAGE);
            if i > 0 && addr % PAGE != 0 {
                return Status::generic(generic::PRP_OFFSET_INVALID);
            }
            let Some(off) = self.offset(addr, n) else {
                return Status::generic(generic::DATA_TRANSFER_ERROR);
            };
            let range = at..at + n as usize;
            match opcode {
                0x02 => self.arena.write(off, &disk[range]).unwrap(),
                0x01 => self.arena.read(off, &mut disk[range]).unwrap(),
                _ => return Status::generic(generic::INVALID_COMMAND_OPCODE),
            }
            at += n as usize;
            left -= n;
        }
        Status::SUCCESS
    }

    /// The arena offset of `len` bytes at device address `addr`, if all inside.
    fn offset(&self, addr: u64, len: u64) -> Option<usize> {
        let off = addr.checked_sub(self.base)?;
        (off.checked_add(len)? <= self.arena.len() as u64).then_some(off as usize)
    }
}

/// A fake daemon on a `SOCK_SEQPACKET` listener at `path`: accepts one client and serves it.
pub fn listen(path: &std::path::Path) -> JoinHandle<Fake> {
    use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};
    let _ = std::fs::remove_file(path);
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC,
        None,
    )
    .unwrap();
    rustix::net::bind(&fd, &SocketAddrUnix::new(path).unwrap()).unwrap();
    rustix::net::listen(&fd, 4).unwrap();
    std::thread::spawn(move || {
        let conn = rustix::net::accept_with(fd.as_fd(), SocketFlags::CLOEXEC).unwrap();
        spawn(
            Channel::new(conn, Duration::from_millis(20)),
            Knobs::default(),
        )
    })
}
