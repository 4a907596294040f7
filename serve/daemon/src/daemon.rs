//! The controllers served, each client's ledger and budgets, the requests, and reclaim.
//!
//! A client's state ([`ClientLedger`]) is owned by the thread that serves its socket; the
//! daemon ([`Daemon`]) holds what all clients share: the controllers, the queue ids lent on
//! each, the poison counters, a view of every client for `status`, and each client's channel
//! for events. Reclaim ([`Daemon::reclaim`]) runs on the client's thread when its socket ends.
#![forbid(unsafe_code)]

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use gpunvme_serve_proto::msg::{
    ADMIN_ALLOWLIST, Event, MAX_QUEUES_PER_REQUEST, NamespaceInfo, PAGE, QueueGrant, RefusalKind,
    Reply, Request,
};
use gpunvme_serve_proto::socket::Channel;
use gpunvme_serve_proto::{Frame, Message, PROTOCOL_VERSION};
use gpunvme_serve_shm::SharedMemory;
use nvme::nvme_spec::FeatureId;
use nvme::{Controller, CreatedQueuePair, DmaRegion, DmaSlice, QueueRegions};
use nvme_emu::EmuDevice;
use zerocopy::IntoBytes;

use crate::ServeError;
use crate::files::{Caller, ClientFiles, Files, Ns, Refusal};
use crate::forward::{Forwarder, ShadowQueue};
use crate::memory::{Arena, ArenaTarget, PageDoorbell, Poison};

/// What the daemon says about trust, at start and in `status`.
pub const TRUST: &str = "cooperative: clients share one NVMe function, so any client that \
    can write a command can make the controller read or write any memory this daemon mapped \
    for any client, and any LBA. Clients cannot send admin commands outside the allowlist, \
    use another client's queues or arenas through the protocol, exceed their budgets, or \
    ring a doorbell they were not given. No isolation between clients is claimed.";

/// Bytes between two queues' doorbell pairs in a client's doorbell page (a cache line each).
const DOORBELL_STRIDE: usize = 64;
/// Queue pairs one doorbell page holds.
const DOORBELLS_PER_PAGE: usize = PAGE as usize / DOORBELL_STRIDE;

/// What one client may hold.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Budgets {
    /// Queue pairs at once (at most 64: one doorbell page).
    pub queues: u16,
    /// Entries per queue.
    pub depth: u32,
    /// Arena bytes at once.
    pub arena_bytes: u64,
    /// Arenas at once.
    pub arenas: usize,
}

impl Default for Budgets {
    fn default() -> Self {
        Self {
            queues: 16,
            depth: 1024,
            arena_bytes: 1 << 30,
            arenas: 16,
        }
    }
}

/// What is behind a served controller: where arenas go and how doorbells reach it.
pub enum ServedBackend {
    /// The software controller: arenas in its address map, doorbells read from the clients'
    /// pages by its own threads.
    Software(Arc<EmuDevice>),
    /// A vfio-user server (SPDK's target): arenas shared by descriptor, doorbells forwarded
    /// from the clients' pages to its registers by the daemon ([`Forwarder`]).
    VfioUser(Arc<vfio::VfioUserNvme>),
    /// A PCI function bound to vfio-pci: arenas mapped through the IOMMU, doorbells forwarded
    /// to BAR0 as for vfio-user.
    Vfio(Arc<vfio::VfioNvme>),
}

/// A controller the daemon serves.
pub struct Served {
    /// Its name in the protocol.
    pub name: String,
    ctrl: Controller,
    backend: ServedBackend,
    forwarder: Option<Forwarder>,
    state: Mutex<ServedState>,
    /// Held across a creation with its doorbells' attachment and across a deletion with their
    /// detachment: a deleted pair's queue id goes back to the driver's pool at its delete, and
    /// another client's creation must not take it before its doorbells are detached.
    queue_ids: Mutex<()>,
}

#[derive(Default)]
struct ServedState {
    /// Queue pairs lent now.
    lent: u16,
    /// Why the controller is degraded (a delete failed): no new queues then.
    degraded: Option<String>,
}

impl Served {
    /// Serves `ctrl` (behind `backend`) as `name`; a controller whose doorbells are registers
    /// gets its forwarding thread.
    pub fn new(name: String, ctrl: Controller, backend: ServedBackend) -> Result<Self, ServeError> {
        let forwarder = match &backend {
            ServedBackend::Software(_) => None,
            ServedBackend::VfioUser(_) | ServedBackend::Vfio(_) => Some(
                Forwarder::start(ctrl.device().clone(), &name).map_err(|source| {
                    ServeError::Socket {
                        doing: "starting the doorbell thread".into(),
                        source,
                    }
                })?,
            ),
        };
        Ok(Self {
            name,
            ctrl,
            backend,
            forwarder,
            state: Mutex::new(ServedState::default()),
            queue_ids: Mutex::new(()),
        })
    }

    fn state(&self) -> std::sync::MutexGuard<'_, ServedState> {
        self.state.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// The controller.
    pub fn controller(&self) -> &Controller {
        &self.ctrl
    }

    /// The software controller behind it, if that is what it is.
    pub fn emu(&self) -> Option<&Arc<EmuDevice>> {
        match &self.backend {
            ServedBackend::Software(e) => Some(e),
            ServedBackend::VfioUser(_) | ServedBackend::Vfio(_) => None,
        }
    }
}

/// A queue pair lent to a client.
struct Lent {
    pair: CreatedQueuePair,
    controller: usize,
    arena: u64,
    /// Index of its words in the client's doorbell page.
    slot: usize,
}

/// One client's holdings; owned by its thread.
pub struct ClientLedger {
    /// The daemon's id for the client.
    pub id: u64,
    /// The name it gave (for `status`).
    pub name: String,
    /// Its process id and user id, from the socket's peer credentials.
    pub pid: i32,
    /// See `pid`.
    pub uid: u32,
    hello: bool,
    arenas: BTreeMap<u64, Arc<Arena>>,
    /// Bytes past the last queue laid out in each arena.
    arena_used: BTreeMap<u64, u64>,
    queues: BTreeMap<u16, Lent>,
    doorbells: Option<Arc<SharedMemory>>,
    slots: [bool; DOORBELLS_PER_PAGE],
    /// Its generation holds and write leases.
    files: ClientFiles,
}

impl ClientLedger {
    /// A client that has not said Hello yet.
    pub fn new(id: u64, pid: i32, uid: u32) -> Self {
        Self {
            id,
            name: String::new(),
            pid,
            uid,
            hello: false,
            arenas: BTreeMap::new(),
            arena_used: BTreeMap::new(),
            queues: BTreeMap::new(),
            doorbells: None,
            slots: [false; DOORBELLS_PER_PAGE],
            files: ClientFiles::default(),
        }
    }

    fn arena_bytes(&self) -> u64 {
        self.arenas.values().map(|a| a.len() as u64).sum()
    }
}

/// What `status` shows of a client.
#[derive(Clone, Debug, Default)]
struct ClientView {
    name: String,
    pid: i32,
    uid: u32,
    queues: Vec<(String, u16)>,
    arenas: Vec<(u64, u64)>,
}

/// What answers a request: the reply, and the descriptor it carries (if any).
pub struct Answer {
    /// The reply.
    pub reply: Reply,
    /// The memory whose descriptor goes with it.
    pub fd: Option<Arc<SharedMemory>>,
}

fn refuse(kind: RefusalKind, message: impl Into<String>) -> Answer {
    Answer {
        reply: Reply::Refused {
            kind,
            message: message.into(),
        },
        fd: None,
    }
}

fn done(status: u16, result: u32) -> Answer {
    Answer {
        reply: Reply::Done { status, result },
        fd: None,
    }
}

/// The daemon: controllers and what every client thread shares.
pub struct Daemon {
    controllers: Vec<Served>,
    budgets: Budgets,
    poison: Arc<Poison>,
    next_arena: AtomicU64,
    clients: Mutex<BTreeMap<u64, ClientView>>,
    channels: Mutex<BTreeMap<u64, Arc<Channel>>>,
    /// Arenas kept mapped forever because a delete of a queue in them failed.
    quarantine: Mutex<Vec<Arc<Arena>>>,
    reclaimed: AtomicU64,
    /// Of those, clients that still held queues (killed mid-I/O, say) and arenas.
    reclaimed_queues: AtomicU64,
    reclaimed_arenas: AtomicU64,
    /// The file systems, mounted once each.
    files: Files,
}

/// A file request's answer.
fn fs_answer(r: Result<u64, Refusal>) -> Answer {
    match r {
        Ok(generation) => Answer {
            reply: Reply::Fs { generation },
            fd: None,
        },
        Err((kind, message)) => refuse(kind, message),
    }
}

impl Daemon {
    /// A daemon serving `controllers` with per-client `budgets`.
    pub fn new(controllers: Vec<Served>, budgets: Budgets) -> Result<Self, ServeError> {
        if budgets.queues == 0 || usize::from(budgets.queues) > DOORBELLS_PER_PAGE {
            return Err(ServeError::InvalidArgument(format!(
                "a budget of {} queue pairs per client; 1 to {DOORBELLS_PER_PAGE}",
                budgets.queues
            )));
        }
        if controllers.is_empty() {
            return Err(ServeError::InvalidArgument(
                "nothing to serve: give at least one device".into(),
            ));
        }
        Ok(Self {
            controllers,
            budgets,
            poison: Arc::new(Poison::default()),
            next_arena: AtomicU64::new(1),
            clients: Mutex::new(BTreeMap::new()),
            channels: Mutex::new(BTreeMap::new()),
            quarantine: Mutex::new(Vec::new()),
            reclaimed: AtomicU64::new(0),
            reclaimed_queues: AtomicU64::new(0),
            reclaimed_arenas: AtomicU64::new(0),
            files: Files::default(),
        })
    }

    /// The controllers served.
    pub fn controllers(&self) -> &[Served] {
        &self.controllers
    }

    /// The poison counters (late controller accesses to released memory).
    pub fn poison(&self) -> &Poison {
        &self.poison
    }

    /// Clients reclaimed so far.
    pub fn reclaimed(&self) -> u64 {
        self.reclaimed.load(Ordering::Relaxed)
    }

    /// Registers a connected client's channel (for events) and view.
    pub fn connected(&self, ledger: &ClientLedger, channel: Arc<Channel>) {
        lock(&self.channels).insert(ledger.id, channel);
        lock(&self.clients).insert(
            ledger.id,
            ClientView {
                pid: ledger.pid,
                uid: ledger.uid,
                ..ClientView::default()
            },
        );
    }

    /// Sends `event` to every client but `except`, best effort (a client that cannot take it
    /// finds out at its next request).
    fn tell_all(&self, event: Event, except: u64) {
        let channels: Vec<(u64, Arc<Channel>)> = lock(&self.channels)
            .iter()
            .map(|(id, c)| (*id, c.clone()))
            .collect();
        let frame = Frame {
            request_id: 0,
            message: Message::Event(event),
        };
        for (id, c) in channels {
            if id != except {
                let _ = c.send(&frame, &[]);
            }
        }
    }

    fn update_view(&self, ledger: &ClientLedger) {
        let view = ClientView {
            name: ledger.name.clone(),
            pid: ledger.pid,
            uid: ledger.uid,
            queues: ledger
                .queues
                .iter()
                .map(|(qid, l)| (self.controllers[l.controller].name.clone(), *qid))
                .collect(),
            arenas: ledger
                .arenas
                .iter()
                .map(|(id, a)| (*id, a.len() as u64))
                .collect(),
        };
        lock(&self.clients).insert(ledger.id, view);
    }

    fn find(&self, name: &str) -> Result<usize, Answer> {
        self.controllers
            .iter()
            .position(|c| c.name == name)
            .ok_or_else(|| {
                let names: Vec<&str> = self.controllers.iter().map(|c| c.name.as_str()).collect();
                refuse(
                    RefusalKind::NotFound,
                    format!(
                        "no controller {name:?} here; this daemon serves {}",
                        names.join(", ")
                    ),
                )
            })
    }

    /// Answers one request of `ledger`'s client.
    pub fn handle(&self, ledger: &mut ClientLedger, request: Request) -> Answer {
        let answer = match request {
            Request::Hello { version, name } => {
                if ledger.hello {
                    return refuse(RefusalKind::InvalidArgument, "Hello was already said");
                }
                if version != PROTOCOL_VERSION {
                    return refuse(
                        RefusalKind::Protocol,
                        format!(
                            "protocol version {version}, this daemon speaks {PROTOCOL_VERSION}"
                        ),
                    );
                }
                ledger.hello = true;
                ledger.name = name;
                Answer {
                    reply: Reply::Welcome {
                        version: PROTOCOL_VERSION,
                        daemon: format!("gpunvme serve {}", env!("CARGO_PKG_VERSION")),
                        trust: TRUST.into(),
                        controllers: self.controllers.iter().map(|c| c.name.clone()).collect(),
                    },
                    fd: None,
                }
            }
            _ if !ledger.hello => {
                return refuse(
                    RefusalKind::InvalidArgument,
                    "the first request of a connection is Hello",
                );
            }
            Request::OpenController { controller } => match self.find(&controller) {
                Err(a) => a,
                Ok(c) => self.describe(c, ledger),
            },
            Request::AllocArena { controller, bytes } => match self.find(&controller) {
                Err(a) => a,
                Ok(c) => self.alloc_arena(c, ledger, bytes),
            },
            Request::CreateQueues {
                controller,
                arena,
                count,
                depth,
                slot_bytes,
            } => match self.find(&controller) {
                Err(a) => a,
                Ok(c) => self.create_queues(c, ledger, arena, count, depth, slot_bytes),
            },
            Request::DeleteQueues { controller, qids } => match self.find(&controller) {
                Err(a) => a,
                Ok(c) => self.delete_queues(c, ledger, &qids),
            },
            Request::FreeArena { arena } => self.free_arena(ledger, arena),
            Request::Admin {
                controller,
                opcode,
                nsid,
                cdw,
                arena,
                offset,
            } => match self.find(&controller) {
                Err(a) => a,
                Ok(c) => self.admin(c, ledger, opcode, nsid, cdw, arena, offset),
            },
            Request::FsView {
                controller,
                nsid,
                held,
            } => match self.find(&controller) {
                Err(a) => a,
                Ok(c) => fs_answer(
                    self.files
                        .view(self.ns(c, nsid), held, Self::caller(ledger)),
                ),
            },
            Request::FsCreate {
                controller,
                nsid,
                name,
                bytes,
                replace,
            } => match self.find(&controller) {
                Err(a) => a,
                Ok(c) => self.fs_create(c, ledger, nsid, &name, bytes, replace),
            },
            Request::FsCommit { lease, len, crc } => {
                fs_answer(self.files.commit(lease, len, crc, Self::caller(ledger)))
            }
            Request::FsAbort { lease } => fs_answer(self.files.abort(lease, Self::caller(ledger))),
            Request::FsGrow { lease, bytes } => self.fs_grow(ledger, lease, bytes),
            Request::FsRemove {
                controller,
                nsid,
                name,
            } => match self.find(&controller) {
                Err(a) => a,
                Ok(c) => fs_answer(self.files.remove(
                    self.ns(c, nsid),
                    &name,
                    Self::caller(ledger),
                )),
            },
            Request::FsRename {
                controller,
                nsid,
                from,
                to,
                replace,
            } => match self.find(&controller) {
                Err(a) => a,
                Ok(c) => fs_answer(self.files.rename(
                    self.ns(c, nsid),
                    &from,
                    &to,
                    replace,
                    Self::caller(ledger),
                )),
            },
            Request::Status => {
                let mut json = self.status();
                let mut text = json.to_string();
                if text.len() > gpunvme_serve_proto::limits::MAX_BODY / 2 {
                    // Too many clients for one reply: their counts, not their lists.
                    let n = json["clients"].as_array().map_or(0, Vec::len);
                    json["clients"] = serde_json::json!([]);
                    json["clients_omitted"] = serde_json::json!(n);
                    text = json.to_string();
                }
                Answer {
                    reply: Reply::Status { json: text },
                    fd: None,
                }
            }
        };
        self.update_view(ledger);
        answer
    }

    /// Namespace `nsid` of controller `c`, for the file service.
    fn ns(&self, c: usize, nsid: u32) -> Ns<'_> {
        Ns {
            index: c,
            ctrl: &self.controllers[c].ctrl,
            nsid,
        }
    }

    /// The file service's view of `ledger`'s client.
    fn caller(ledger: &mut ClientLedger) -> Caller<'_> {
        Caller {
            id: ledger.id,
            name: &ledger.name,
            pid: ledger.pid,
            files: &mut ledger.files,
        }
    }

    /// `FsCreate`: the lease, its table in a memory file of its own.
    fn fs_create(
        &self,
        c: usize,
        ledger: &mut ClientLedger,
        nsid: u32,
        name: &str,
        bytes: u64,
        replace: bool,
    ) -> Answer {
        match self
            .files
            .create(self.ns(c, nsid), name, bytes, replace, Self::caller(ledger))
        {
            Ok((lease, table)) => self.reserved(lease, &table, ledger),
            Err((kind, message)) => refuse(kind, message),
        }
    }

    /// `FsGrow`: the lease's whole new table in a memory file of its own.
    fn fs_grow(&self, ledger: &mut ClientLedger, lease: u64, bytes: u64) -> Answer {
        match self.files.grow(lease, bytes, Self::caller(ledger)) {
            Ok(table) => self.reserved(lease, &table, ledger),
            Err((kind, message)) => refuse(kind, message),
        }
    }

    /// `FsReserved` with `table` in a sealed memory file; where none can be made, the lease is
    /// dropped (nothing can be written through a table the client never got).
    fn reserved(&self, lease: u64, table: &[u8], ledger: &mut ClientLedger) -> Answer {
        let len = (table.len() as u64).next_multiple_of(PAGE) as usize;
        let mem = SharedMemory::create("gpunvme-serve-table", len).and_then(|m| {
            m.write(0, table)?;
            Ok(m)
        });
        match mem {
            Ok(m) => Answer {
                reply: Reply::FsReserved {
                    lease,
                    table_bytes: table.len() as u64,
                },
                fd: Some(Arc::new(m)),
            },
            Err(e) => {
                let _ = self.files.abort(lease, Self::caller(ledger));
                refuse(
                    RefusalKind::Device,
                    format!("a memory file for the extent table: {e}"),
                )
            }
        }
    }

    fn describe(&self, c: usize, ledger: &ClientLedger) -> Answer {
        let served = &self.controllers[c];
        let info = served.ctrl.info();
        let free = info.max_io_queue_pairs.saturating_sub(served.state().lent);
        let mine = self
            .budgets
            .queues
            .saturating_sub(ledger.queues.len() as u16);
        Answer {
            reply: Reply::Controller {
                name: served.name.clone(),
                queues_free: free.min(mine),
                max_transfer_bytes: u32::try_from(info.max_transfer_bytes).unwrap_or(u32::MAX),
                namespaces: served
                    .ctrl
                    .namespaces()
                    .iter()
                    .map(|n| NamespaceInfo {
                        nsid: n.nsid,
                        blocks: n.blocks,
                        lba_size: n.lba_size,
                    })
                    .collect(),
                controller_threads: match &served.backend {
                    ServedBackend::Software(emu) => u16::try_from(emu.controller_threads()).ok(),
                    ServedBackend::VfioUser(_) | ServedBackend::Vfio(_) => None,
                },
            },
            fd: None,
        }
    }

    fn alloc_arena(&self, c: usize, ledger: &mut ClientLedger, bytes: u64) -> Answer {
        let have = ledger.arena_bytes();
        if ledger.arenas.len() >= self.budgets.arenas {
            return refuse(
                RefusalKind::Budget,
                format!(
                    "{} arenas held, the budget is {} per client",
                    ledger.arenas.len(),
                    self.budgets.arenas
                ),
            );
        }
        if have.saturating_add(bytes) > self.budgets.arena_bytes {
            return refuse(
                RefusalKind::Budget,
                format!(
                    "an arena of {bytes} bytes beside the {have} held passes the budget of {} \
                     bytes per client",
                    self.budgets.arena_bytes
                ),
            );
        }
        let Ok(len) = usize::try_from(bytes) else {
            return refuse(RefusalKind::InvalidArgument, "an arena larger than memory");
        };
        let id = self.next_arena.fetch_add(1, Ordering::Relaxed);
        let target = match &self.controllers[c].backend {
            ServedBackend::Software(emu) => ArenaTarget::Map(emu.address_map(), &self.poison),
            ServedBackend::VfioUser(dev) => ArenaTarget::VfioUser(dev),
            ServedBackend::Vfio(dev) => ArenaTarget::Vfio(dev),
        };
        match Arena::new(id, len, target) {
            Err(e) => {
                let hint = match &self.controllers[c].backend {
                    ServedBackend::VfioUser(_) => {
                        " (a vfio-user server such as SPDK's maps at most 16 regions per client: \
                         the daemon's own memory and every client's arenas count)"
                    }
                    ServedBackend::Vfio(_) => " (VFIO maps arenas through a type1 IOMMU only)",
                    ServedBackend::Software(_) => "",
                };
                refuse(
                    RefusalKind::Device,
                    format!("allocating an arena: {e}{hint}"),
                )
            }
            Ok(arena) => {
                let arena = Arc::new(arena);
                let reply = Reply::Arena {
                    id,
                    device_address: arena.device_address,
                    len: bytes,
                };
                ledger.arenas.insert(id, arena.clone());
                ledger.arena_used.insert(id, 0);
                Answer {
                    reply,
                    fd: Some(arena_memory(&arena)),
                }
            }
        }
    }

    fn create_queues(
        &self,
        c: usize,
        ledger: &mut ClientLedger,
        arena_id: u64,
        count: u16,
        depth: u32,
        slot_bytes: u32,
    ) -> Answer {
        let served = &self.controllers[c];
        let Some(arena) = ledger.arenas.get(&arena_id).cloned() else {
            return refuse(
                RefusalKind::NotFound,
                format!("arena {arena_id} is not one of this client's"),
            );
        };
        let held = ledger.queues.len();
        if held + usize::from(count) > usize::from(self.budgets.queues) {
            return refuse(
                RefusalKind::Budget,
                format!(
                    "{count} more queue pairs beside the {held} held pass the budget of {} per \
                     client",
                    self.budgets.queues
                ),
            );
        }
        let max_entries = served.ctrl.info().mqes_entries;
        if depth > self.budgets.depth || depth > max_entries {
            return refuse(
                RefusalKind::Budget,
                format!(
                    "a depth of {depth}; the budget is {} entries and the controller takes {}",
                    self.budgets.depth, max_entries
                ),
            );
        }
        // Layout per pair (the protocol's, which is the GPU queues'): SQ, CQ, PRP list
        // pages, slot buffers, each page-aligned.
        let layout = gpunvme_serve_proto::layout::PairLayout::new(depth, slot_bytes);
        let (sq_bytes, cq_bytes) = (layout.sq_len, layout.cq_len);
        let per_pair = layout.len;
        let used = ledger.arena_used.get(&arena_id).copied().unwrap_or(0);
        let need = per_pair * u64::from(count);
        if used + need > arena.len() as u64 {
            return refuse(
                RefusalKind::InvalidArgument,
                format!(
                    "{count} pairs of depth {depth} with {slot_bytes}-byte slots need {need} \
                     bytes of arena {arena_id}; {} of its {} are free",
                    arena.len() as u64 - used,
                    arena.len()
                ),
            );
        }
        {
            let st = served.state();
            if let Some(why) = &st.degraded {
                return refuse(
                    RefusalKind::Device,
                    format!(
                        "controller {} is degraded ({why}): no new queues",
                        served.name
                    ),
                );
            }
            let free = served
                .ctrl
                .info()
                .max_io_queue_pairs
                .saturating_sub(st.lent);
            if count > free {
                return refuse(
                    RefusalKind::Budget,
                    format!(
                        "{count} queue pairs asked, controller {} has {free} of {} free",
                        served.name,
                        served.ctrl.info().max_io_queue_pairs
                    ),
                );
            }
        }
        let page = match &ledger.doorbells {
            Some(p) => p.clone(),
            None => match SharedMemory::create("gpunvme-serve-doorbells", PAGE as usize) {
                Ok(p) => {
                    let p = Arc::new(p);
                    ledger.doorbells = Some(p.clone());
                    p
                }
                Err(e) => {
                    return refuse(
                        RefusalKind::Device,
                        format!("a doorbell page: {}", gpunvme_serve_proto::chain(&e)),
                    );
                }
            },
        };
        let free_slots: Vec<usize> = (0..DOORBELLS_PER_PAGE)
            .filter(|&s| !ledger.slots[s])
            .take(usize::from(count))
            .collect();
        // The budget keeps the page from running out; the check keeps a bug from panicking.
        if free_slots.len() < usize::from(count) {
            return refuse(RefusalKind::Budget, "the client's doorbell page is full");
        }
        let mut regions = Vec::with_capacity(usize::from(count));
        let mut places = Vec::with_capacity(usize::from(count));
        for i in 0..u64::from(count) {
            let base = used + i * per_pair;
            let (sq, cq) = (base + layout.sq, base + layout.cq);
            let (slots, prp_lists) = (base + layout.slots, base + layout.prp_lists);
            // Rings start empty: zeroed here (the arena may hold an earlier pair's entries).
            let zeroed = arena
                .memory()
                .zero(sq as usize, (sq_bytes + cq_bytes) as usize);
            if let Err(e) = zeroed {
                return refuse(RefusalKind::Device, e.to_string());
            }
            let region = |off: u64, len: u64| {
                Arc::new(DmaRegion::contiguous(
                    arena.device_address + off,
                    len as usize,
                    Box::new(arena.clone()),
                ))
            };
            regions.push(QueueRegions {
                sq: region(sq, sq_bytes),
                sq_entries: depth,
                cq: region(cq, cq_bytes),
                cq_entries: depth,
            });
            places.push((sq, cq, slots, prp_lists));
        }
        for &s in &free_slots {
            let _ = page.store_u32(s * DOORBELL_STRIDE, 0, Ordering::Relaxed);
            let _ = page.store_u32(s * DOORBELL_STRIDE + 4, 0, Ordering::Relaxed);
        }
        let attached = Mutex::new(Vec::new());
        let ids = lock(&served.queue_ids);
        let created = served.ctrl.create_queue_pairs_on_with(regions, |i, qid| {
            // The software controller reads the words itself, from creation on; a register
            // controller's are forwarded once the pairs exist (below).
            let ServedBackend::Software(emu) = &served.backend else {
                return Ok(());
            };
            let word = |off: usize| -> Arc<dyn nvme_emu::DoorbellWord> {
                Arc::new(PageDoorbell {
                    page: page.clone(),
                    offset: free_slots[i] * DOORBELL_STRIDE + off,
                })
            };
            emu.attach_external_doorbells(qid, word(0), word(4))
                .map_err(|e| {
                    nvme::Error::Unsupported(format!(
                        "external doorbells: {}",
                        gpunvme_serve_proto::chain(&e)
                    ))
                })?;
            lock(&attached).push(qid);
            Ok(())
        });
        let pairs = match created {
            Ok(p) => p,
            Err(e) => {
                if let Some(emu) = served.emu() {
                    for qid in lock(&attached).drain(..) {
                        emu.detach_external_doorbells(qid);
                    }
                }
                // Every pair the controller granted is lent: a limit, as a budget is (the
                // client may ask for fewer), not a fault of the controller's.
                let kind = match e {
                    nvme::Error::NoQueueAvailable { .. } => RefusalKind::Budget,
                    _ => RefusalKind::Device,
                };
                return refuse(kind, format!("creating queues: {e}"));
            }
        };
        drop(ids);
        if let Some(f) = &served.forwarder {
            for (pair, &slot) in pairs.iter().zip(&free_slots) {
                f.add(ShadowQueue {
                    qid: pair.qid(),
                    page: page.clone(),
                    sq_word: slot * DOORBELL_STRIDE,
                    cq_word: slot * DOORBELL_STRIDE + 4,
                    depth,
                    sq_register: pair.sq_tail_doorbell(),
                    cq_register: pair.cq_head_doorbell(),
                });
            }
        }
        served.state().lent += count;
        ledger.arena_used.insert(arena_id, used + need);
        let mut grants = Vec::with_capacity(pairs.len());
        for ((pair, slot), (sq, cq, slots, prp_lists)) in
            pairs.into_iter().zip(free_slots).zip(places)
        {
            ledger.slots[slot] = true;
            grants.push(QueueGrant {
                qid: pair.qid(),
                sq_doorbell: (slot * DOORBELL_STRIDE) as u32,
                cq_doorbell: (slot * DOORBELL_STRIDE + 4) as u32,
                sq,
                cq,
                slots,
                prp_lists,
            });
            ledger.queues.insert(
                pair.qid(),
                Lent {
                    pair,
                    controller: c,
                    arena: arena_id,
                    slot,
                },
            );
        }
        Answer {
            reply: Reply::Queues { queues: grants },
            fd: Some(page),
        }
    }

    fn delete_queues(&self, c: usize, ledger: &mut ClientLedger, qids: &[u16]) -> Answer {
        for q in qids {
            match ledger.queues.get(q) {
                Some(l) if l.controller == c => {}
                _ => {
                    return refuse(
                        RefusalKind::NotFound,
                        format!(
                            "queue {q} on {} is not one of this client's",
                            self.controllers[c].name
                        ),
                    );
                }
            }
        }
        let lent: Vec<Lent> = qids
            .iter()
            .filter_map(|q| ledger.queues.remove(q))
            .collect();
        match self.delete_lent(lent, ledger) {
            Ok(()) => done(0, 0),
            Err(why) => refuse(RefusalKind::Device, why),
        }
    }

    /// Deletes lent queue pairs (SQ then CQ each, all in flight together), then detaches
    /// their doorbells and frees their slots. A failed delete degrades the controller, keeps
    /// the arenas in the controller's reach for good and tells every client.
    fn delete_lent(&self, lent: Vec<Lent>, ledger: &mut ClientLedger) -> Result<(), String> {
        let mut by_ctrl: BTreeMap<usize, Vec<Lent>> = BTreeMap::new();
        for l in lent {
            by_ctrl.entry(l.controller).or_default().push(l);
        }
        let mut first_error = None;
        for (c, lent) in by_ctrl {
            let served = &self.controllers[c];
            let qids: Vec<u16> = lent.iter().map(|l| l.pair.qid()).collect();
            let arenas: Vec<u64> = lent.iter().map(|l| l.arena).collect();
            let slots: Vec<usize> = lent.iter().map(|l| l.slot).collect();
            let pairs = lent.into_iter().map(|l| l.pair).collect();
            // Forwarded doorbells stop before the queues go: the client rings them no more.
            if let (Some(f), Some(page)) = (&served.forwarder, &ledger.doorbells) {
                f.remove(page, &qids);
            }
            let ids = lock(&served.queue_ids);
            let result = CreatedQueuePair::delete_all(pairs, false);
            match result {
                Ok(()) => {
                    if let Some(emu) = served.emu() {
                        for &qid in &qids {
                            emu.detach_external_doorbells(qid);
                        }
                    }
                    drop(ids);
                    for s in slots {
                        ledger.slots[s] = false;
                    }
                    let mut st = served.state();
                    st.lent = st.lent.saturating_sub(qids.len() as u16);
                }
                Err(e) => {
                    let why = format!(
                        "deleting queues {qids:?} of client {} ({}) failed: {e}",
                        ledger.id, ledger.name
                    );
                    tracing::error!("{why}; controller {} degraded", served.name);
                    served.state().degraded = Some(why.clone());
                    // The controller may still reach these arenas: they stay mapped.
                    let mut q = lock(&self.quarantine);
                    for a in arenas {
                        if let Some(arena) = ledger.arenas.get(&a)
                            && !q.iter().any(|held| Arc::ptr_eq(held, arena))
                        {
                            q.push(arena.clone());
                        }
                    }
                    drop(q);
                    self.tell_all(
                        Event::ControllerFailed {
                            controller: served.name.clone(),
                            why: why.clone(),
                        },
                        ledger.id,
                    );
                    first_error.get_or_insert(why);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    fn free_arena(&self, ledger: &mut ClientLedger, id: u64) -> Answer {
        if !ledger.arenas.contains_key(&id) {
            return refuse(
                RefusalKind::NotFound,
                format!("arena {id} is not one of this client's"),
            );
        }
        let inside: Vec<u16> = ledger
            .queues
            .iter()
            .filter(|(_, l)| l.arena == id)
            .map(|(q, _)| *q)
            .collect();
        if !inside.is_empty() {
            return refuse(
                RefusalKind::InvalidArgument,
                format!("arena {id} still holds queues {inside:?}: delete them first"),
            );
        }
        ledger.arenas.remove(&id);
        ledger.arena_used.remove(&id);
        done(0, 0)
    }

    #[expect(clippy::too_many_arguments)]
    fn admin(
        &self,
        c: usize,
        ledger: &mut ClientLedger,
        opcode: u8,
        nsid: u32,
        cdw: [u32; 6],
        arena_id: u64,
        offset: u64,
    ) -> Answer {
        if !ADMIN_ALLOWLIST.iter().any(|(op, _)| *op == opcode) {
            // The decoder refuses these already; kept so that the rule lives here too.
            return refuse(
                RefusalKind::PermissionDenied,
                format!("admin opcode {opcode:#04x} is the operator's"),
            );
        }
        let ctrl = &self.controllers[c].ctrl;
        let Some(arena) = ledger.arenas.get(&arena_id) else {
            return refuse(
                RefusalKind::NotFound,
                format!("arena {arena_id} is not one of this client's"),
            );
        };
        let put = |data: &[u8]| -> Answer {
            match usize::try_from(offset)
                .ok()
                .filter(|o| o.checked_add(data.len()).is_some_and(|e| e <= arena.len()))
            {
                None => refuse(
                    RefusalKind::InvalidArgument,
                    format!(
                        "{} bytes of data at offset {offset} do not fit arena {arena_id} of {} \
                         bytes",
                        data.len(),
                        arena.len()
                    ),
                ),
                Some(o) => match arena.memory().write(o, data) {
                    Ok(()) => done(0, 0),
                    Err(e) => refuse(RefusalKind::Device, e.to_string()),
                },
            }
        };
        let device = |e: nvme::Error| refuse(RefusalKind::Device, e.to_string());
        match opcode {
            0x06 => match cdw[0] & 0xff {
                0x00 => match ctrl.identify_namespace(nsid) {
                    Ok(ns) => put(ns.as_bytes()),
                    Err(e) => device(e),
                },
                0x01 => put(ctrl.identify_data().as_bytes()),
                cns => refuse(
                    RefusalKind::InvalidArgument,
                    format!(
                        "Identify CNS {cns:#04x}: clients get 0x00 (namespace) and 0x01 (controller)"
                    ),
                ),
            },
            0x0a => match ctrl.get_features(FeatureId((cdw[0] & 0xff) as u8), cdw[1]) {
                Ok(v) => done(0, v),
                Err(e) => device(e),
            },
            _ => {
                // Get Log Page: NUMD from CDW10 (lower) and CDW11 (upper), 0's based.
                let numd = ((cdw[1] & 0xffff) << 16 | (cdw[0] >> 16)) as usize + 1;
                let len = (numd * 4).min(PAGE as usize);
                let mem = match ctrl.device().alloc_dma(PAGE as usize) {
                    Ok(m) => Arc::new(m),
                    Err(e) => return refuse(RefusalKind::Device, e.to_string()),
                };
                let slice = DmaSlice::whole(mem.clone()).slice(0, len);
                match ctrl.get_log_page(cdw[0] as u8, nsid, &slice) {
                    Ok(()) => {
                        let mut data = vec![0u8; len];
                        mem.read(0, &mut data);
                        put(&data)
                    }
                    Err(e) => device(e),
                }
            }
        }
    }

    /// Takes back everything `ledger`'s client holds, in the safe order: its queues deleted
    /// on the controller (SQ, then CQ) and their doorbells detached, then its arenas out of
    /// the controller's reach and freed (their last holders gone), then its view removed.
    /// A queue whose delete failed keeps its arena mapped for good (see [`Daemon::new`]'s
    /// degraded state).
    pub fn reclaim(&self, ledger: &mut ClientLedger) {
        lock(&self.channels).remove(&ledger.id);
        let lent: Vec<Lent> = std::mem::take(&mut ledger.queues).into_values().collect();
        let n = lent.len();
        if let Err(why) = self.delete_lent(lent, ledger) {
            tracing::error!("reclaiming client {}: {why}", ledger.id);
        }
        // Its queues are gone, so nothing of its can write a leased file's blocks: its
        // unfinished writes are dropped and its generations let go.
        let leases = ledger.files.leases();
        ledger.files = ClientFiles::default();
        if leases > 0 {
            tracing::info!(client = ledger.id, leases, "unfinished writes dropped");
        }
        // The queues are gone (or their arenas quarantined): the memory may leave now.
        let arenas = std::mem::take(&mut ledger.arenas);
        let bytes: u64 = arenas.values().map(|a| a.len() as u64).sum();
        if n > 0 {
            self.reclaimed_queues.fetch_add(1, Ordering::Relaxed);
        }
        if !arenas.is_empty() {
            self.reclaimed_arenas.fetch_add(1, Ordering::Relaxed);
        }
        drop(arenas);
        ledger.arena_used.clear();
        ledger.doorbells = None;
        lock(&self.clients).remove(&ledger.id);
        self.reclaimed.fetch_add(1, Ordering::Relaxed);
        tracing::info!(
            client = ledger.id,
            name = %ledger.name,
            pid = ledger.pid,
            queues = n,
            arena_bytes = bytes,
            "client gone: its queues deleted, then its memory released"
        );
    }

    /// The daemon's state (`gpunvme serve status --json`).
    pub fn status(&self) -> serde_json::Value {
        let clients: Vec<serde_json::Value> = lock(&self.clients)
            .iter()
            .map(|(id, v)| {
                serde_json::json!({
                    "id": id,
                    "name": v.name,
                    "pid": v.pid,
                    "uid": v.uid,
                    "queues": v.queues.iter().map(|(c, q)| serde_json::json!({"controller": c, "qid": q})).collect::<Vec<_>>(),
                    "arenas": v.arenas.iter().map(|(a, b)| serde_json::json!({"id": a, "bytes": b})).collect::<Vec<_>>(),
                    "arena_bytes": v.arenas.iter().map(|(_, b)| b).sum::<u64>(),
                })
            })
            .collect();
        let controllers: Vec<serde_json::Value> = self
            .controllers
            .iter()
            .map(|s| {
                let st = s.state();
                let info = s.ctrl.info();
                serde_json::json!({
                    "name": s.name,
                    "model": info.mn,
                    "max_queue_pairs": info.max_io_queue_pairs,
                    "lent_queue_pairs": st.lent,
                    "degraded": st.degraded,
                    "backend": match &s.backend {
                        ServedBackend::Software(_) => "software controller",
                        ServedBackend::VfioUser(_) => "vfio-user",
                        ServedBackend::Vfio(_) => "vfio",
                    },
                    "address_map_regions": s.emu().map(|e| e.address_map().region_count()),
                    // Doorbell values refused (a tail outside its ring; on the software
                    // controller also a head past what it posted): a client's lie fails only
                    // its own queue.
                    "invalid_doorbell_writes": match (s.emu(), &s.forwarder) {
                        (Some(e), _) => e.stats().invalid_doorbell_writes,
                        (None, Some(f)) => f.counts().1,
                        (None, None) => 0,
                    },
                    "forwarded_doorbells": s.forwarder.as_ref().map(|f| f.counts().0),
                    "io_commands": s.emu().map(|e| e.stats().io_commands),
                })
            })
            .collect();
        serde_json::json!({
            "trust": TRUST,
            "budgets": {
                "queues": self.budgets.queues,
                "depth": self.budgets.depth,
                "arena_bytes": self.budgets.arena_bytes,
                "arenas": self.budgets.arenas,
            },
            "controllers": controllers,
            "clients": clients,
            "reclaimed_clients": self.reclaimed(),
            "reclaimed_holding_queues": self.reclaimed_queues.load(Ordering::Relaxed),
            "reclaimed_holding_arenas": self.reclaimed_arenas.load(Ordering::Relaxed),
            "quarantined_arenas": lock(&self.quarantine).len(),
            "late_controller_reads": self.poison.late_reads.load(Ordering::Relaxed),
            "late_controller_writes": self.poison.late_writes.load(Ordering::Relaxed),
            "released_arenas": self.poison.released.load(Ordering::Relaxed),
            "max_queues_per_request": MAX_QUEUES_PER_REQUEST,
            "file_systems": self.files.status(
                &self.controllers.iter().map(|c| c.name.clone()).collect::<Vec<_>>()
            ),
        })
    }
}

/// The arena's memory as an `Arc` for the reply's descriptor.
fn arena_memory(arena: &Arc<Arena>) -> Arc<SharedMemory> {
    arena.shared()
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}
