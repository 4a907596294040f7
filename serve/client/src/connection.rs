//! One connection to the daemon ([`Connection`]): the control plane. Requests are sequential
//! (one at a time under a lock), their ids increase from 1, and every wait is bounded. Events
//! the daemon sends meanwhile (request id 0) are kept ([`Connection::events`]) and revoke the
//! queue pairs they name.

use std::collections::VecDeque;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::path::Path;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};
use std::time::{Duration, Instant};

use gpunvme_serve_proto::msg::{MAX_QUEUES_PER_REQUEST, NamespaceInfo, allowed_admin};
use gpunvme_serve_proto::socket::{Channel, SocketError};
use gpunvme_serve_proto::{Event, Frame, Message, PROTOCOL_VERSION, ProtoError, Reply, Request};
use gpunvme_serve_shm::SharedMemory;
use nvme_spec::CqeStatus;
use nvme_spec::status::Status;
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::arena::Arena;
use crate::command::PAGE;
use crate::error::ClientError;
use crate::layout::{DOORBELL_PAGE, check_grants};
use crate::lease::Lease;
use crate::queue_pair::{PairParts, QueuePair};

/// The most events kept for [`Connection::events`]; older ones are dropped first.
pub const MAX_KEPT_EVENTS: usize = 256;

/// Connection ids, so that a pair is only handed back to the connection it came from.
static NEXT_CONNECTION: AtomicU64 = AtomicU64::new(1);

/// The daemon's answer to `Hello`.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Welcome {
    /// The daemon's protocol version (ours: [`PROTOCOL_VERSION`]).
    pub version: u16,
    /// The daemon's name and version.
    pub daemon: String,
    /// Its trust model, in words (print it).
    pub trust: String,
    /// The controllers it serves.
    pub controllers: Vec<String>,
}

/// A controller as the daemon describes it (`OpenController`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ControllerInfo {
    /// Its name.
    pub name: String,
    /// I/O queue pairs this client may still create.
    pub queues_free: u16,
    /// The largest transfer in bytes.
    pub max_transfer_bytes: u32,
    /// Its namespaces.
    pub namespaces: Vec<NamespaceInfo>,
    /// The daemon's threads serving its commands, where it has such (the software controller):
    /// a client wanting the controller's whole rate takes this many queue pairs.
    pub controller_threads: Option<u16>,
}

impl ControllerInfo {
    /// Namespace `nsid`, if the controller has it.
    pub fn namespace(&self, nsid: u32) -> Option<&NamespaceInfo> {
        self.namespaces.iter().find(|n| n.nsid == nsid)
    }
}

/// A pair's mark, by the names events use.
struct LeaseEntry {
    controller: String,
    qid: u16,
    lease: Weak<Lease>,
}

/// What the lock guards.
struct Inner {
    channel: Channel,
    /// The last request id used.
    last_id: u32,
    events: VecDeque<Event>,
    leases: Vec<LeaseEntry>,
    /// Set once the daemon closed the connection.
    closed: bool,
    /// A duplicate of the socket the pairs watch for the daemon's end ([`Lease`]).
    watch: Option<Arc<std::os::fd::OwnedFd>>,
}

impl Inner {
    fn next_id(&mut self) -> u32 {
        // 0 is the events' id.
        self.last_id = self.last_id.checked_add(1).unwrap_or(1);
        self.last_id
    }

    /// Revokes every pair whose entry `hit` selects.
    fn revoke(&mut self, why: &str, hit: impl Fn(&LeaseEntry) -> bool) {
        self.leases.retain(|e| e.lease.strong_count() > 0);
        for e in self.leases.iter().filter(|e| hit(e)) {
            if let Some(lease) = e.lease.upgrade() {
                lease.revoke(why.to_string());
            }
        }
    }

    fn event(&mut self, event: Event) {
        match &event {
            Event::QueuesRevoked {
                controller,
                qids,
                why,
            } => {
                self.revoke(&format!("the daemon took the queue back: {why}"), |e| {
                    e.controller == *controller && qids.contains(&e.qid)
                });
            }
            Event::ControllerFailed { controller, why } => {
                self.revoke(&format!("controller {controller} failed: {why}"), |e| {
                    e.controller == *controller
                });
            }
            Event::Shutdown => self.revoke("the daemon is shutting down", |_| true),
        }
        if self.events.len() == MAX_KEPT_EVENTS {
            self.events.pop_front();
        }
        self.events.push_back(event);
    }

    /// The error for a failed transfer while `doing`; the connection's end revokes every pair.
    fn socket_error(&mut self, doing: &'static str, e: SocketError) -> ClientError {
        match e {
            SocketError::Closed => {
                self.closed = true;
                self.revoke("the daemon closed the connection", |_| true);
                ClientError::Closed { doing }
            }
            SocketError::Proto(ProtoError::Version { got, want }) => ClientError::Version {
                daemon: got,
                client: want,
            },
            SocketError::Proto(e) => {
                ClientError::Protocol(format!("{doing}: the daemon sent a bad frame: {e}"))
            }
            source => ClientError::Socket { doing, source },
        }
    }

    fn send(
        &mut self,
        doing: &'static str,
        bytes: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(), ClientError> {
        if self.closed {
            return Err(ClientError::Closed { doing });
        }
        self.channel
            .send_raw(bytes, fds)
            .map_err(|e| self.socket_error(doing, e))
    }

    /// Receives the next frame that is not an event (events are kept), before `deadline`.
    fn recv(
        &mut self,
        doing: &'static str,
        deadline: Instant,
        bound: Duration,
    ) -> Result<(Frame, Vec<OwnedFd>), ClientError> {
        loop {
            if self.closed {
                return Err(ClientError::Closed { doing });
            }
            let (frame, fds) = self
                .channel
                .recv()
                .map_err(|e| self.socket_error(doing, e))?;
            match frame {
                Frame {
                    request_id: 0,
                    message: Message::Event(event),
                } => {
                    self.event(event);
                    if Instant::now() >= deadline {
                        return Err(ClientError::Socket {
                            doing,
                            source: SocketError::Timeout {
                                doing: "awaiting a reply among events",
                                after: bound,
                            },
                        });
                    }
                }
                frame => return Ok((frame, fds)),
            }
        }
    }

    /// Sends `request` and waits for its reply (events meanwhile kept; a late reply to an
    /// earlier request that timed out skipped).
    fn request(
        &mut self,
        request: Request,
        bound: Duration,
    ) -> Result<(Reply, Vec<OwnedFd>), ClientError> {
        let doing = Message::Request(request.clone()).kind().name();
        let id = self.next_id();
        let frame = Frame {
            request_id: id,
            message: Message::Request(request),
        };
        // Our own request outside its limits is the caller's argument.
        let bytes = frame
            .encode()
            .map_err(|e| ClientError::InvalidArgument(e.to_string()))?;
        self.send(doing, &bytes, &[])?;
        let deadline = Instant::now() + bound;
        loop {
            let (frame, fds) = self.recv(doing, deadline, bound)?;
            match frame.message {
                Message::Reply(reply) if frame.request_id == id => return Ok((reply, fds)),
                // Ids increase: one below ours answers a request given up on.
                Message::Reply(_) if frame.request_id != 0 && frame.request_id < id => {
                    if Instant::now() >= deadline {
                        return Err(ClientError::Socket {
                            doing,
                            source: SocketError::Timeout {
                                doing: "awaiting a reply among stale ones",
                                after: bound,
                            },
                        });
                    }
                }
                other => {
                    return Err(ClientError::Protocol(format!(
                        "{doing} request {id} was answered by a {} message with request id {}",
                        other.kind().name(),
                        frame.request_id
                    )));
                }
            }
        }
    }
}

/// One connection to `gpunvme serve` (see the module documentation). Shared by threads:
/// every method takes `&self`.
pub struct Connection {
    id: u64,
    bound: Duration,
    welcome: Welcome,
    inner: Mutex<Inner>,
}

impl std::fmt::Debug for Connection {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Connection")
            .field("id", &self.id)
            .field("daemon", &self.welcome.daemon)
            .field("bound", &self.bound)
            .finish()
    }
}

/// The reply a request did not expect, as an error (a refusal mapped to its kind).
fn unexpected(doing: &'static str, reply: Reply) -> ClientError {
    match reply {
        Reply::Refused { kind, message } => ClientError::Refused { kind, message },
        other => ClientError::Protocol(format!(
            "{doing} was answered by a {} reply",
            Message::Reply(other).kind().name()
        )),
    }
}

/// The one descriptor a reply carries (the decoder checked the count).
fn one_fd(doing: &'static str, fds: Vec<OwnedFd>) -> Result<OwnedFd, ClientError> {
    fds.into_iter()
        .next()
        .ok_or_else(|| ClientError::Protocol(format!("{doing}: the reply carried no descriptor")))
}

/// A `Done` reply's status as a decoded NVMe status (its phase bit is not a status bit).
fn done_status(request: &'static str, status: u16) -> Result<(), ClientError> {
    let status: Status = CqeStatus::from_bits(status & !1).status();
    if status.is_success() {
        return Ok(());
    }
    Err(ClientError::DeviceStatus { request, status })
}

impl Connection {
    /// Connects to the daemon's `SOCK_SEQPACKET` socket at `socket`, says `Hello` as `name`
    /// and expects `Welcome`. Every wait of the connection, and of the queue pairs' `read` and
    /// `write`, is bounded by `bound`.
    pub fn connect(socket: &Path, name: &str, bound: Duration) -> Result<Self, ClientError> {
        let connect_error = |e: rustix::io::Errno| ClientError::Connect {
            path: socket.to_path_buf(),
            source: e.into(),
        };
        let addr = SocketAddrUnix::new(socket).map_err(connect_error)?;
        let fd = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(connect_error)?;
        // A listener with a full backlog makes connect wait: for the bound (SO_SNDTIMEO),
        // then EAGAIN.
        rustix::net::sockopt::set_socket_timeout(
            &fd,
            rustix::net::sockopt::Timeout::Send,
            Some(bound.max(Duration::from_millis(1))),
        )
        .map_err(connect_error)?;
        loop {
            match rustix::net::connect(&fd, &addr) {
                Ok(()) => break,
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => return Err(connect_error(e)),
            }
        }
        Self::from_channel(Channel::new(fd, bound), name, bound)
    }

    /// A connection over a channel already connected to a daemon (an in-process daemon, or a
    /// test playing one over [`Channel::pair`]): says `Hello` as `name` and expects `Welcome`,
    /// as [`Connection::connect`] does. `bound` bounds the waits for replies and the queue
    /// pairs' `read` and `write` (each socket transfer is bounded by the channel's own).
    pub fn from_channel(
        channel: Channel,
        name: &str,
        bound: Duration,
    ) -> Result<Self, ClientError> {
        let watch = channel.fd().try_clone_to_owned().ok().map(Arc::new);
        let mut inner = Inner {
            channel,
            last_id: 0,
            events: VecDeque::new(),
            leases: Vec::new(),
            closed: false,
            watch,
        };
        let hello = Request::Hello {
            version: PROTOCOL_VERSION,
            name: name.to_string(),
        };
        let (reply, _) = inner.request(hello, bound)?;
        let welcome = match reply {
            Reply::Welcome {
                version,
                daemon,
                trust,
                controllers,
            } => {
                if version != PROTOCOL_VERSION {
                    return Err(ClientError::Version {
                        daemon: version,
                        client: PROTOCOL_VERSION,
                    });
                }
                Welcome {
                    version,
                    daemon,
                    trust,
                    controllers,
                }
            }
            other => return Err(unexpected("hello", other)),
        };
        Ok(Self {
            id: NEXT_CONNECTION.fetch_add(1, Ordering::Relaxed),
            bound,
            welcome,
            inner: Mutex::new(inner),
        })
    }

    fn lock(&self) -> MutexGuard<'_, Inner> {
        self.inner.lock().unwrap_or_else(|e| e.into_inner())
    }

    fn request(&self, request: Request) -> Result<(Reply, Vec<OwnedFd>), ClientError> {
        self.lock().request(request, self.bound)
    }

    /// The daemon's `Welcome`: its version, name, trust model and controllers.
    pub fn welcome(&self) -> &Welcome {
        &self.welcome
    }

    /// The bound of every wait.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Describes controller `name` (`OpenController`).
    pub fn controller(&self, name: &str) -> Result<ControllerInfo, ClientError> {
        let (reply, _) = self.request(Request::OpenController {
            controller: name.to_string(),
        })?;
        match reply {
            Reply::Controller {
                name: got,
                queues_free,
                max_transfer_bytes,
                namespaces,
                controller_threads,
            } => {
                if got != name {
                    return Err(ClientError::Protocol(format!(
                        "open-controller {name:?} was answered for controller {got:?}"
                    )));
                }
                Ok(ControllerInfo {
                    name: got,
                    queues_free,
                    max_transfer_bytes,
                    namespaces,
                    controller_threads,
                })
            }
            other => Err(unexpected("open-controller", other)),
        }
    }

    /// `bytes` (whole pages) of memory in `controller`'s reach (`AllocArena`), mapped here.
    pub fn alloc_arena(&self, controller: &str, bytes: u64) -> Result<Arena, ClientError> {
        let doing = "alloc-arena";
        let (reply, fds) = self.request(Request::AllocArena {
            controller: controller.to_string(),
            bytes,
        })?;
        let (id, device_address, len) = match reply {
            Reply::Arena {
                id,
                device_address,
                len,
            } => (id, device_address, len),
            other => return Err(unexpected(doing, other)),
        };
        let fd = one_fd(doing, fds)?;
        if len < bytes || device_address % PAGE != 0 || device_address.checked_add(len).is_none() {
            return Err(ClientError::Protocol(format!(
                "an arena of {len} bytes at device address {device_address:#x} was granted for \
                 {bytes} bytes: too small, misaligned, or past the address space"
            )));
        }
        let len = usize::try_from(len).map_err(|_| {
            ClientError::Protocol(format!("an arena of {len} bytes does not fit this process"))
        })?;
        let mem = SharedMemory::from_fd(fd, len).map_err(|source| ClientError::Shm {
            what: "mapping an arena",
            source,
        })?;
        Ok(Arena {
            id,
            device_address,
            mem: Arc::new(mem),
        })
    }

    /// `count` queue pairs of `depth` entries with slot buffers of `slot_bytes` (whole pages)
    /// in `arena` (`CreateQueues`). The grants are checked against the arena before any pair
    /// is made; the pairs share one doorbell page.
    pub fn create_queues(
        &self,
        controller: &str,
        arena: &Arc<Arena>,
        count: u16,
        depth: u32,
        slot_bytes: u32,
    ) -> Result<Vec<QueuePair>, ClientError> {
        let doing = "create-queues";
        let (reply, fds) = self.request(Request::CreateQueues {
            controller: controller.to_string(),
            arena: arena.id,
            count,
            depth,
            slot_bytes,
        })?;
        let queues = match reply {
            Reply::Queues { queues } => queues,
            other => return Err(unexpected(doing, other)),
        };
        let fd = one_fd(doing, fds)?;
        check_grants(&queues, count, depth, slot_bytes, arena.len())
            .map_err(|why| ClientError::Protocol(format!("{doing}: {why}")))?;
        let doorbells = SharedMemory::from_fd(fd, DOORBELL_PAGE)
            .map(Arc::new)
            .map_err(|source| ClientError::Shm {
                what: "mapping the doorbell page",
                source,
            })?;
        let mut inner = self.lock();
        let socket = inner.watch.as_ref().map_or_else(Weak::new, Arc::downgrade);
        let pairs = queues
            .into_iter()
            .map(|grant| {
                let lease = Arc::new(Lease::watching(socket.clone()));
                inner.leases.push(LeaseEntry {
                    controller: controller.to_string(),
                    qid: grant.qid,
                    lease: Arc::downgrade(&lease),
                });
                QueuePair::new(PairParts {
                    grant,
                    controller: controller.to_string(),
                    depth,
                    slot_bytes,
                    arena: Arc::clone(arena),
                    doorbells: Arc::clone(&doorbells),
                    lease,
                    connection: self.id,
                    bound: self.bound,
                })
            })
            .collect();
        Ok(pairs)
    }

    /// Deletes `pairs` on `controller` (`DeleteQueues`, in requests of at most
    /// [`MAX_QUEUES_PER_REQUEST`]). The pairs are consumed either way; commands still in
    /// flight are aborted by the controller. Pairs of another connection or controller are
    /// refused before anything is sent.
    pub fn delete_queues(
        &self,
        controller: &str,
        pairs: Vec<QueuePair>,
    ) -> Result<(), ClientError> {
        if let Some(p) = pairs
            .iter()
            .find(|p| p.connection() != self.id || p.controller() != controller)
        {
            return Err(ClientError::InvalidArgument(format!(
                "queue {} is on controller {:?} of {} connection",
                p.qid(),
                p.controller(),
                if p.connection() == self.id {
                    "this"
                } else {
                    "another"
                }
            )));
        }
        for chunk in pairs.chunks(MAX_QUEUES_PER_REQUEST) {
            let qids: Vec<u16> = chunk.iter().map(QueuePair::qid).collect();
            let (reply, _) = self.request(Request::DeleteQueues {
                controller: controller.to_string(),
                qids: qids.clone(),
            })?;
            match reply {
                Reply::Done { status, .. } => done_status("delete-queues", status)?,
                other => return Err(unexpected("delete-queues", other)),
            }
            for p in chunk {
                p.revoke("the queue was deleted".to_string());
            }
            self.lock()
                .leases
                .retain(|e| !(e.controller == controller && qids.contains(&e.qid)));
        }
        Ok(())
    }

    /// Releases `arena` on the daemon (`FreeArena`; refused there while queues live in it).
    /// This process's mapping goes with the last reference to it.
    pub fn free_arena(&self, arena: Arc<Arena>) -> Result<(), ClientError> {
        let (reply, _) = self.request(Request::FreeArena { arena: arena.id })?;
        match reply {
            Reply::Done { status, .. } => done_status("free-arena", status),
            other => Err(unexpected("free-arena", other)),
        }
    }

    /// An admin command from the allowlist (Identify, Get Log Page, Get Features) on
    /// `controller`, its data landing in `arena` at `offset` (page-aligned): the completion's
    /// status field (0 for success; an NVMe status, [`nvme_spec::Status`] decodes it) and
    /// Dword 0. Another opcode is refused before anything is sent.
    pub fn admin(
        &self,
        controller: &str,
        opcode: u8,
        nsid: u32,
        cdw: [u32; 6],
        arena: &Arena,
        offset: u64,
    ) -> Result<(u16, u32), ClientError> {
        allowed_admin(opcode).map_err(ClientError::InvalidArgument)?;
        if offset % PAGE != 0 || offset >= arena.len() {
            return Err(ClientError::InvalidArgument(format!(
                "admin data at offset {offset} of a {}-byte arena: a page inside it",
                arena.len()
            )));
        }
        let (reply, _) = self.request(Request::Admin {
            controller: controller.to_string(),
            opcode,
            nsid,
            cdw,
            arena: arena.id,
            offset,
        })?;
        match reply {
            Reply::Done { status, result } => Ok((status, result)),
            other => Err(unexpected("admin", other)),
        }
    }

    /// The generation of the blockfs on namespace `nsid` of `controller` (`FsView`, the daemon
    /// mounting it on first use); from then on the daemon keeps the blocks of the older of it
    /// and `held` (the oldest generation this client still reads through) until the next
    /// view or the connection's end.
    pub fn fs_view(
        &self,
        controller: &str,
        nsid: u32,
        held: Option<u64>,
    ) -> Result<u64, ClientError> {
        self.fs_request(
            "fs-view",
            Request::FsView {
                controller: controller.to_string(),
                nsid,
                held,
            },
        )
    }

    /// A write lease on `name` for `bytes` (`FsCreate`): the lease and the bytes of its
    /// writable extent table (blockfs's flat table; the caller checks it before writing).
    pub fn fs_create(
        &self,
        controller: &str,
        nsid: u32,
        name: &str,
        bytes: u64,
        replace: bool,
    ) -> Result<(u64, Vec<u8>), ClientError> {
        let doing = "fs-create";
        self.reservation(
            doing,
            Request::FsCreate {
                controller: controller.to_string(),
                nsid,
                name: name.to_string(),
                bytes,
                replace,
            },
        )
    }

    /// Grows write lease `lease` to at least `bytes` (`FsGrow`): the bytes of its whole new
    /// table (what was reserved keeps its blocks; the caller checks it before writing).
    pub fn fs_grow(&self, lease: u64, bytes: u64) -> Result<Vec<u8>, ClientError> {
        let (got, table) = self.reservation("fs-grow", Request::FsGrow { lease, bytes })?;
        if got != lease {
            return Err(ClientError::Protocol(format!(
                "fs-grow of lease {lease} answered for lease {got}"
            )));
        }
        Ok(table)
    }

    /// A request answered by `FsReserved`: the lease and its table, read from the memory file.
    fn reservation(
        &self,
        doing: &'static str,
        req: Request,
    ) -> Result<(u64, Vec<u8>), ClientError> {
        let (reply, fds) = self.request(req)?;
        let (lease, table_bytes) = match reply {
            Reply::FsReserved { lease, table_bytes } => (lease, table_bytes),
            other => return Err(unexpected(doing, other)),
        };
        let fd = one_fd(doing, fds)?;
        let len = usize::try_from(table_bytes.next_multiple_of(PAGE))
            .map_err(|_| ClientError::Protocol(format!("a table of {table_bytes} bytes")))?;
        let mem = SharedMemory::from_fd(fd, len).map_err(|source| ClientError::Shm {
            what: "mapping a reservation's extent table",
            source,
        })?;
        let mut table = vec![0u8; table_bytes as usize];
        mem.read(0, &mut table).map_err(|source| ClientError::Shm {
            what: "reading a reservation's extent table",
            source,
        })?;
        Ok((lease, table))
    }

    /// Commits write lease `lease` as `len` bytes (with their CRC-32C): the file under its
    /// name by one commit; the generation after it.
    pub fn fs_commit(&self, lease: u64, len: u64, crc: Option<u32>) -> Result<u64, ClientError> {
        self.fs_request("fs-commit", Request::FsCommit { lease, len, crc })
    }

    /// Drops write lease `lease`: nothing of it is stored.
    pub fn fs_abort(&self, lease: u64) -> Result<u64, ClientError> {
        self.fs_request("fs-abort", Request::FsAbort { lease })
    }

    /// Removes `name`; the generation after it.
    pub fn fs_remove(&self, controller: &str, nsid: u32, name: &str) -> Result<u64, ClientError> {
        self.fs_request(
            "fs-remove",
            Request::FsRemove {
                controller: controller.to_string(),
                nsid,
                name: name.to_string(),
            },
        )
    }

    /// Renames `from` to `to` (replacing `to` with `replace`); the generation after it.
    pub fn fs_rename(
        &self,
        controller: &str,
        nsid: u32,
        from: &str,
        to: &str,
        replace: bool,
    ) -> Result<u64, ClientError> {
        self.fs_request(
            "fs-rename",
            Request::FsRename {
                controller: controller.to_string(),
                nsid,
                from: from.to_string(),
                to: to.to_string(),
                replace,
            },
        )
    }

    fn fs_request(&self, doing: &'static str, request: Request) -> Result<u64, ClientError> {
        let (reply, _) = self.request(request)?;
        match reply {
            Reply::Fs { generation } => Ok(generation),
            other => Err(unexpected(doing, other)),
        }
    }

    /// The daemon's state as JSON text (`Status`), checked to be JSON.
    pub fn status(&self) -> Result<String, ClientError> {
        let (reply, _) = self.request(Request::Status)?;
        match reply {
            Reply::Status { json } => {
                serde_json::from_str::<serde_json::Value>(&json)
                    .map_err(|e| ClientError::Protocol(format!("the status is not JSON: {e}")))?;
                Ok(json)
            }
            other => Err(unexpected("status", other)),
        }
    }

    /// Sends `frame_bytes` as one datagram, unchecked, and returns the next frame that is not
    /// an event, with its descriptors: for tests of lying clients. The request id counter is
    /// not used.
    pub fn request_raw(&self, frame_bytes: &[u8]) -> Result<(Frame, Vec<OwnedFd>), ClientError> {
        self.request_raw_with_fds(frame_bytes, &[])
    }

    /// [`Connection::request_raw`] with descriptors sent along (any number).
    pub fn request_raw_with_fds(
        &self,
        frame_bytes: &[u8],
        fds: &[BorrowedFd<'_>],
    ) -> Result<(Frame, Vec<OwnedFd>), ClientError> {
        let doing = "a raw request";
        let mut inner = self.lock();
        inner.send(doing, frame_bytes, fds)?;
        inner.recv(doing, Instant::now() + self.bound, self.bound)
    }

    /// Takes in, without waiting, the events the daemon sent since the last request (each
    /// revokes the pairs it names; late replies to requests given up on are dropped); returns
    /// how many events came. A daemon that closed the connection
    /// revokes every pair and gives [`ClientError::Closed`].
    pub fn check_events(&self) -> Result<usize, ClientError> {
        let doing = "checking for events";
        let mut inner = self.lock();
        let mut n = 0;
        loop {
            if inner.closed {
                return Err(ClientError::Closed { doing });
            }
            let now = Timespec {
                tv_sec: 0,
                tv_nsec: 0,
            };
            let ready = {
                let fd = inner.channel.fd();
                poll(&mut [PollFd::new(&fd, PollFlags::IN)], Some(&now))
            };
            match ready {
                Ok(0) => return Ok(n),
                Ok(_) => {}
                Err(rustix::io::Errno::INTR) => continue,
                Err(e) => {
                    return Err(ClientError::Socket {
                        doing,
                        source: SocketError::Io {
                            doing: "polling the socket",
                            source: e.into(),
                        },
                    });
                }
            }
            let (frame, _) = inner
                .channel
                .recv()
                .map_err(|e| inner.socket_error(doing, e))?;
            match frame {
                Frame {
                    request_id: 0,
                    message: Message::Event(event),
                } => {
                    inner.event(event);
                    n += 1;
                }
                // A late reply to a request given up on.
                Frame {
                    request_id,
                    message: Message::Reply(_),
                } if request_id != 0 && request_id <= inner.last_id => {}
                Frame {
                    request_id,
                    message,
                } => {
                    return Err(ClientError::Protocol(format!(
                        "an unasked {} message with request id {request_id}",
                        message.kind().name()
                    )));
                }
            }
        }
    }

    /// The events kept since the last call (at most [`MAX_KEPT_EVENTS`], the latest), oldest
    /// first. They are taken in while a request awaits its reply, or by
    /// [`Connection::check_events`].
    pub fn events(&self) -> Vec<Event> {
        self.lock().events.drain(..).collect()
    }
}

impl Drop for Connection {
    /// The daemon reclaims everything of a connection at its end: the pairs are revoked.
    fn drop(&mut self) {
        self.lock().revoke("the connection was closed", |_| true);
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_spec::StatusCodeType;

    #[test]
    fn a_done_status_is_decoded_without_its_phase_bit() {
        done_status("x", 0).unwrap();
        done_status("x", 1).unwrap();
        // Invalid Queue Identifier: SCT 1, SC 1.
        let e = done_status("delete-queues", (1 << 1) | (1 << 9)).unwrap_err();
        let ClientError::DeviceStatus { status, .. } = &e else {
            panic!("{e}")
        };
        assert!(status.is(StatusCodeType::COMMAND_SPECIFIC, 1));
        assert!(e.to_string().contains("Invalid Queue Identifier"), "{e}");
    }
}
