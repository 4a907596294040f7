//! The messages of `gpunvme serve` and their limits.
//!
//! A client sends [`Request`]s; the daemon answers each with one [`Reply`] of the same request
//! id, and may send an [`Event`] at any time (id 0). Every field has a limit ([`Message::check`],
//! run by both [`crate::Frame::encode`] and [`crate::Frame::decode`]), and every message carries
//! a fixed number of descriptors ([`Message::descriptors`]). The client's identity is never in
//! a message: the daemon takes it from the socket (peer credentials).

use serde::{Deserialize, Serialize};

use crate::error::ProtoError;

/// The longest name (a client's, a controller's).
pub const MAX_NAME: usize = 128;
/// The longest text in a refusal or an event.
pub const MAX_TEXT: usize = 4096;
/// The most queue pairs one request creates or deletes.
pub const MAX_QUEUES_PER_REQUEST: usize = 64;
/// The most controllers a daemon lists.
pub const MAX_CONTROLLERS: usize = 64;
/// The most namespaces a controller's description lists.
pub const MAX_NAMESPACES: usize = 1024;
/// The largest arena one request asks for (1 TiB).
pub const MAX_ARENA_BYTES: u64 = 1 << 40;
/// Arenas and slot buffers come in whole 4 KiB pages.
pub const PAGE: u64 = 4096;
/// The largest slot buffer of a queue slot (2 MiB: its PRP list is one page of 512 entries).
pub const MAX_SLOT_BYTES: u32 = 2 << 20;

/// The longest file name (blockfs's own limit).
pub const MAX_FILE_NAME: usize = 1024;
/// The largest extent table a reservation hands out (256 MiB: about 11 million extents).
pub const MAX_TABLE_BYTES: u64 = 256 << 20;

/// The admin commands a client may send (Get Log Page, Identify, Get Features); every other
/// admin command (Format, Sanitize, namespace management, firmware) is the operator's.
pub const ADMIN_ALLOWLIST: [(u8, &str); 3] = [
    (0x02, "Get Log Page"),
    (0x06, "Identify"),
    (0x0a, "Get Features"),
];

/// What a client asks.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Request {
    /// The first message of a connection.
    Hello {
        /// The client's version of the protocol (also in every header).
        version: u16,
        /// A name for `serve status` (the identity is the socket's peer credentials).
        name: String,
    },
    /// Describe a controller the daemon serves.
    OpenController {
        /// Its name (`serve status` lists them).
        controller: String,
    },
    /// Memory the controller can reach, for the caller's rings and data: a memory file passed
    /// back with the [`Reply::Arena`].
    AllocArena {
        /// The controller whose reach the memory is in.
        controller: String,
        /// Bytes, whole pages.
        bytes: u64,
    },
    /// Queue pairs in an arena of the caller's.
    CreateQueues {
        /// The controller.
        controller: String,
        /// The arena (from [`Reply::Arena`]).
        arena: u64,
        /// Queue pairs.
        count: u16,
        /// Entries per queue.
        depth: u32,
        /// Bytes of slot buffer per queue entry, whole pages.
        slot_bytes: u32,
    },
    /// Delete queue pairs of the caller's.
    DeleteQueues {
        /// The controller.
        controller: String,
        /// Their ids.
        qids: Vec<u16>,
    },
    /// Release an arena of the caller's (after its queues are deleted).
    FreeArena {
        /// The arena.
        arena: u64,
    },
    /// An admin command from [`ADMIN_ALLOWLIST`]; its data lands in an arena of the caller's.
    Admin {
        /// The controller.
        controller: String,
        /// The opcode.
        opcode: u8,
        /// Namespace id.
        nsid: u32,
        /// Command dwords 10 to 15.
        cdw: [u32; 6],
        /// The arena and offset the data goes to.
        arena: u64,
        /// Offset in the arena, whole pages.
        offset: u64,
    },
    /// The daemon's state: clients, their queues and arenas, budgets.
    Status,
    /// The blockfs on namespace `nsid` of a controller (the daemon mounts it once): its
    /// generation now, answered by [`Reply::Fs`]. From then on the daemon keeps every block the
    /// older of `held` and that generation uses (the caller reads through a read-only mount of
    /// its own at that generation), until the caller's next `FsView` of the namespace or its
    /// end.
    FsView {
        /// The controller.
        controller: String,
        /// The namespace.
        nsid: u32,
        /// The oldest generation the caller still reads through, if any.
        held: Option<u64>,
    },
    /// A write lease: file `name` reserved for `bytes`, which the caller writes through its
    /// own queues into the blocks of the [`Reply::FsReserved`] table. Nothing is visible until
    /// [`Request::FsCommit`]; one writer per name at a time.
    FsCreate {
        /// The controller.
        controller: String,
        /// The namespace.
        nsid: u32,
        /// The file.
        name: String,
        /// Its length to reserve.
        bytes: u64,
        /// Replace a file of that name by the commit (else an existing one is refused).
        replace: bool,
    },
    /// Makes a write lease's file `len` bytes long (with `crc`, the CRC-32C of them, if the
    /// caller computed it) and visible under its name by one commit.
    FsCommit {
        /// The lease (from [`Reply::FsReserved`]).
        lease: u64,
        /// The file's length, at most the reservation.
        len: u64,
        /// The CRC-32C of its bytes.
        crc: Option<u32>,
    },
    /// Grows a write lease's reservation to at least `bytes` (a stream's put, whose length
    /// comes only at its end), answered by [`Reply::FsReserved`] with the whole new table:
    /// what was reserved before keeps its blocks, so bytes written through the old table stay.
    FsGrow {
        /// The lease.
        lease: u64,
        /// The length to reserve, at least the reservation's now.
        bytes: u64,
    },
    /// Drops a write lease: nothing of it is stored.
    FsAbort {
        /// The lease.
        lease: u64,
    },
    /// Removes a file.
    FsRemove {
        /// The controller.
        controller: String,
        /// The namespace.
        nsid: u32,
        /// The file.
        name: String,
    },
    /// Renames a file (replacing `to` by the commit with `replace`).
    FsRename {
        /// The controller.
        controller: String,
        /// The namespace.
        nsid: u32,
        /// The file.
        from: String,
        /// Its new name.
        to: String,
        /// Replace a file named `to`.
        replace: bool,
    },
}

/// Why the daemon refused a request, by kind (the client maps each to its error kind).
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub enum RefusalKind {
    /// A field out of range, or a request out of order.
    InvalidArgument,
    /// Not the caller's, or not allowed to clients.
    PermissionDenied,
    /// No such controller, arena or queue.
    NotFound,
    /// Past a budget (the message gives the numbers).
    Budget,
    /// Held by another client (a write lease of that name; the message names the holder).
    Busy,
    /// The file exists.
    Exists,
    /// The file system is full.
    NoSpace,
    /// The namespace holds no blockfs.
    NoFileSystem,
    /// The file or the file system takes no changes (immutable, mounted read-only).
    ReadOnly,
    /// Another refusal of the file system (its message says which).
    FileSystem,
    /// The controller failed or refused the command.
    Device,
    /// The frame itself was refused ([`ProtoError`]), e.g. another protocol version.
    Protocol,
}

/// One namespace of a controller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct NamespaceInfo {
    /// Namespace id.
    pub nsid: u32,
    /// Logical blocks.
    pub blocks: u64,
    /// Bytes per block.
    pub lba_size: u32,
}

/// A queue pair granted to the caller.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct QueueGrant {
    /// Queue id (SQ and CQ alike).
    pub qid: u16,
    /// Offset of the SQ tail doorbell word in the doorbell page passed with the reply.
    pub sq_doorbell: u32,
    /// Offset of the CQ head doorbell word.
    pub cq_doorbell: u32,
    /// Offsets in the arena of the SQ, the CQ and the first slot buffer.
    pub sq: u64,
    /// See `sq`.
    pub cq: u64,
    /// See `sq`.
    pub slots: u64,
    /// Offset in the arena of the first slot's PRP list pages (two 4 KiB pages per slot,
    /// [`crate::layout::PRP_PAGES_PER_SLOT`]), for transfers of more than two pages.
    pub prp_lists: u64,
}

/// What the daemon answers.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Reply {
    /// To [`Request::Hello`].
    Welcome {
        /// The daemon's protocol version.
        version: u16,
        /// The daemon's name and version.
        daemon: String,
        /// Its trust model, in words (printed by clients).
        trust: String,
        /// The controllers it serves.
        controllers: Vec<String>,
    },
    /// To [`Request::OpenController`].
    Controller {
        /// Its name.
        name: String,
        /// I/O queue pairs the caller may still create.
        queues_free: u16,
        /// Largest transfer in bytes.
        max_transfer_bytes: u32,
        /// Its namespaces.
        namespaces: Vec<NamespaceInfo>,
        /// For a controller whose commands are served by threads of the daemon's (the
        /// software controller), how many: queue pairs go to threads by queue id modulo this,
        /// so a client wanting the controller's whole rate takes this many pairs.
        #[serde(default, skip_serializing_if = "Option::is_none")]
        controller_threads: Option<u16>,
    },
    /// To [`Request::AllocArena`], with the arena's memory file.
    Arena {
        /// The arena's id.
        id: u64,
        /// The address the controller reaches its first byte at.
        device_address: u64,
        /// Bytes.
        len: u64,
    },
    /// To [`Request::CreateQueues`], with the doorbell page's memory file.
    Queues {
        /// The pairs, in order.
        queues: Vec<QueueGrant>,
    },
    /// To a request that returns nothing else (delete, free, admin).
    Done {
        /// The completion's status field (0 for success) where a command ran.
        status: u16,
        /// The completion's Dword 0 where a command ran (Get Features' value), else 0.
        result: u32,
    },
    /// The request was refused; nothing changed.
    Refused {
        /// Why, by kind.
        kind: RefusalKind,
        /// Why, in words with the numbers.
        message: String,
    },
    /// To [`Request::Status`]: the daemon's state as JSON text (`serve status --json`).
    Status {
        /// The JSON text.
        json: String,
    },
    /// To a file request: the file system's generation after it.
    Fs {
        /// The generation.
        generation: u64,
    },
    /// To [`Request::FsCreate`] and [`Request::FsGrow`], with a memory file holding the reservation's extent table
    /// (blockfs's flat table, one file, writable; `table_bytes` long).
    FsReserved {
        /// The lease, for [`Request::FsCommit`] or [`Request::FsAbort`].
        lease: u64,
        /// Bytes of the table.
        table_bytes: u64,
    },
}

/// What the daemon tells a client unasked.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Event {
    /// These queues of the caller's were taken back: the client stops using them (its pairs
    /// fail from then on).
    QueuesRevoked {
        /// The controller whose queues they are.
        controller: String,
        /// Their ids.
        qids: Vec<u16>,
        /// Why.
        why: String,
    },
    /// The controller failed or is degraded; every queue on it ends.
    ControllerFailed {
        /// The controller.
        controller: String,
        /// Why.
        why: String,
    },
    /// The daemon is stopping.
    Shutdown,
}

/// Any message.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub enum Message {
    /// Client to daemon.
    Request(Request),
    /// Daemon to client, answering a request.
    Reply(Reply),
    /// Daemon to client, unasked.
    Event(Event),
}

macro_rules! kinds {
    ($($kind:ident = $code:literal, $name:literal;)*) => {
        /// A message's kind, as the header's `kind` field numbers it.
        #[derive(Clone, Copy, Debug, PartialEq, Eq)]
        pub enum Kind { $(
            #[doc = $name]
            $kind,
        )* }

        impl Kind {
            /// The header's number for it.
            pub fn code(self) -> u16 {
                match self { $(Self::$kind => $code,)* }
            }
            /// The kind of header number `code`, if any.
            pub fn from_code(code: u16) -> Option<Self> {
                match code { $($code => Some(Self::$kind),)* _ => None }
            }
            /// Its name in errors.
            pub fn name(self) -> &'static str {
                match self { $(Self::$kind => $name,)* }
            }
        }
    };
}

kinds! {
    Hello = 1, "hello";
    OpenController = 2, "open-controller";
    AllocArena = 3, "alloc-arena";
    CreateQueues = 4, "create-queues";
    DeleteQueues = 5, "delete-queues";
    FreeArena = 6, "free-arena";
    Admin = 7, "admin";
    StatusRequest = 8, "status";
    FsView = 9, "fs-view";
    FsCreate = 10, "fs-create";
    FsCommit = 11, "fs-commit";
    FsAbort = 12, "fs-abort";
    FsRemove = 13, "fs-remove";
    FsRename = 14, "fs-rename";
    FsGrow = 15, "fs-grow";
    Welcome = 101, "welcome";
    Controller = 102, "controller";
    Arena = 103, "arena";
    Queues = 104, "queues";
    Done = 105, "done";
    Refused = 106, "refused";
    StatusReply = 107, "status-reply";
    Fs = 108, "fs";
    FsReserved = 109, "fs-reserved";
    QueuesRevoked = 201, "queues-revoked";
    ControllerFailed = 202, "controller-failed";
    Shutdown = 203, "shutdown";
}

/// The name of an admin opcode a client may send, or the refusal.
pub fn allowed_admin(opcode: u8) -> Result<&'static str, String> {
    ADMIN_ALLOWLIST
        .iter()
        .find(|(op, _)| *op == opcode)
        .map(|(_, name)| *name)
        .ok_or_else(|| {
            let allowed: Vec<String> = ADMIN_ALLOWLIST
                .iter()
                .map(|(op, n)| format!("{n} ({op:#04x})"))
                .collect();
            format!(
                "admin opcode {opcode:#04x} is the operator's (`gpunvme serve admin`); clients \
                 may send {}",
                allowed.join(", ")
            )
        })
}

impl Message {
    /// Its kind.
    pub fn kind(&self) -> Kind {
        match self {
            Self::Request(r) => match r {
                Request::Hello { .. } => Kind::Hello,
                Request::OpenController { .. } => Kind::OpenController,
                Request::AllocArena { .. } => Kind::AllocArena,
                Request::CreateQueues { .. } => Kind::CreateQueues,
                Request::DeleteQueues { .. } => Kind::DeleteQueues,
                Request::FreeArena { .. } => Kind::FreeArena,
                Request::Admin { .. } => Kind::Admin,
                Request::Status => Kind::StatusRequest,
                Request::FsView { .. } => Kind::FsView,
                Request::FsCreate { .. } => Kind::FsCreate,
                Request::FsCommit { .. } => Kind::FsCommit,
                Request::FsAbort { .. } => Kind::FsAbort,
                Request::FsGrow { .. } => Kind::FsGrow,
                Request::FsRemove { .. } => Kind::FsRemove,
                Request::FsRename { .. } => Kind::FsRename,
            },
            Self::Reply(r) => match r {
                Reply::Welcome { .. } => Kind::Welcome,
                Reply::Controller { .. } => Kind::Controller,
                Reply::Arena { .. } => Kind::Arena,
                Reply::Queues { .. } => Kind::Queues,
                Reply::Done { .. } => Kind::Done,
                Reply::Refused { .. } => Kind::Refused,
                Reply::Status { .. } => Kind::StatusReply,
                Reply::Fs { .. } => Kind::Fs,
                Reply::FsReserved { .. } => Kind::FsReserved,
            },
            Self::Event(e) => match e {
                Event::QueuesRevoked { .. } => Kind::QueuesRevoked,
                Event::ControllerFailed { .. } => Kind::ControllerFailed,
                Event::Shutdown => Kind::Shutdown,
            },
        }
    }

    /// How many descriptors it carries: the arena's memory file, the doorbell page's; none
    /// for any other.
    pub fn descriptors(&self) -> usize {
        match self {
            Self::Reply(Reply::Arena { .. } | Reply::Queues { .. } | Reply::FsReserved { .. }) => 1,
            _ => 0,
        }
    }

    /// Every field within its limits; the error names the field and the limit.
    pub fn check(&self) -> Result<(), ProtoError> {
        let kind = self.kind().name();
        let bad = |why: String| Err(ProtoError::Body { kind, why });
        let name = |what: &str, s: &str| -> Result<(), ProtoError> {
            if s.is_empty() || s.len() > MAX_NAME || s.chars().any(char::is_control) {
                return Err(ProtoError::Body {
                    kind,
                    why: format!(
                        "{what} must be 1 to {MAX_NAME} bytes without control characters \
                         ({} bytes)",
                        s.len()
                    ),
                });
            }
            Ok(())
        };
        let text = |what: &str, s: &str| -> Result<(), ProtoError> {
            if s.len() > MAX_TEXT {
                return Err(ProtoError::Body {
                    kind,
                    why: format!("{what} of {} bytes is over {MAX_TEXT}", s.len()),
                });
            }
            Ok(())
        };
        // A file name's own rules are the file system's (the daemon applies them); here only
        // its size and that it is text.
        let file = |s: &str| -> Result<(), ProtoError> {
            if s.is_empty() || s.len() > MAX_FILE_NAME {
                return Err(ProtoError::Body {
                    kind,
                    why: format!("a file name of {} bytes; 1 to {MAX_FILE_NAME}", s.len()),
                });
            }
            Ok(())
        };
        let qids = |q: &[u16]| -> Result<(), ProtoError> {
            if q.is_empty() || q.len() > MAX_QUEUES_PER_REQUEST {
                return Err(ProtoError::Body {
                    kind,
                    why: format!(
                        "{} queue ids; one message names 1 to {MAX_QUEUES_PER_REQUEST}",
                        q.len()
                    ),
                });
            }
            if q.contains(&0) {
                return Err(ProtoError::Body {
                    kind,
                    why: "queue id 0 is the admin queue, the daemon's".into(),
                });
            }
            Ok(())
        };
        match self {
            Self::Request(r) => match r {
                Request::Hello { name: n, .. } => name("the client's name", n),
                Request::OpenController { controller } => name("the controller", controller),
                Request::AllocArena { controller, bytes } => {
                    name("the controller", controller)?;
                    if *bytes == 0 || *bytes > MAX_ARENA_BYTES || bytes % PAGE != 0 {
                        return bad(format!(
                            "an arena of {bytes} bytes; arenas are whole {PAGE}-byte pages, at \
                             most {MAX_ARENA_BYTES}"
                        ));
                    }
                    Ok(())
                }
                Request::CreateQueues {
                    controller,
                    count,
                    depth,
                    slot_bytes,
                    ..
                } => {
                    name("the controller", controller)?;
                    if *count == 0 || *count as usize > MAX_QUEUES_PER_REQUEST {
                        return bad(format!(
                            "{count} queue pairs; one request creates 1 to \
                             {MAX_QUEUES_PER_REQUEST}"
                        ));
                    }
                    if !(2..=65536).contains(depth) {
                        return bad(format!("a depth of {depth}; NVMe queues hold 2 to 65536"));
                    }
                    if *slot_bytes == 0
                        || *slot_bytes > MAX_SLOT_BYTES
                        || u64::from(*slot_bytes) % PAGE != 0
                    {
                        return bad(format!(
                            "slot buffers of {slot_bytes} bytes; whole {PAGE}-byte pages, at \
                             most {MAX_SLOT_BYTES}"
                        ));
                    }
                    Ok(())
                }
                Request::DeleteQueues {
                    controller,
                    qids: q,
                } => {
                    name("the controller", controller)?;
                    qids(q)
                }
                Request::FreeArena { .. }
                | Request::Status
                | Request::FsCommit { .. }
                | Request::FsGrow { .. }
                | Request::FsAbort { .. } => Ok(()),
                Request::FsView { controller, .. } => name("the controller", controller),
                Request::FsCreate {
                    controller,
                    name: f,
                    ..
                }
                | Request::FsRemove {
                    controller,
                    name: f,
                    ..
                } => {
                    name("the controller", controller)?;
                    file(f)
                }
                Request::FsRename {
                    controller,
                    from,
                    to,
                    ..
                } => {
                    name("the controller", controller)?;
                    file(from)?;
                    file(to)
                }
                Request::Admin {
                    controller,
                    opcode,
                    offset,
                    ..
                } => {
                    name("the controller", controller)?;
                    allowed_admin(*opcode).map_err(|why| ProtoError::Body { kind, why })?;
                    if offset % PAGE != 0 {
                        return bad(format!("data offset {offset} is not page-aligned"));
                    }
                    Ok(())
                }
            },
            Self::Reply(r) => match r {
                Reply::Welcome {
                    daemon,
                    trust,
                    controllers,
                    ..
                } => {
                    name("the daemon's name", daemon)?;
                    text("the trust model", trust)?;
                    if controllers.len() > MAX_CONTROLLERS {
                        return bad(format!(
                            "{} controllers; at most {MAX_CONTROLLERS}",
                            controllers.len()
                        ));
                    }
                    controllers
                        .iter()
                        .try_for_each(|c| name("a controller's name", c))
                }
                Reply::Controller {
                    name: n,
                    namespaces,
                    ..
                } => {
                    name("the controller", n)?;
                    if namespaces.len() > MAX_NAMESPACES {
                        return bad(format!(
                            "{} namespaces; at most {MAX_NAMESPACES}",
                            namespaces.len()
                        ));
                    }
                    Ok(())
                }
                Reply::Arena { len, .. } => {
                    if *len == 0 || len % PAGE != 0 || *len > MAX_ARENA_BYTES {
                        return bad(format!("an arena of {len} bytes"));
                    }
                    Ok(())
                }
                Reply::Queues { queues } => {
                    let q: Vec<u16> = queues.iter().map(|g| g.qid).collect();
                    qids(&q)
                }
                Reply::Done { .. } | Reply::Fs { .. } => Ok(()),
                Reply::FsReserved { table_bytes, .. } => {
                    if *table_bytes == 0 || *table_bytes > MAX_TABLE_BYTES {
                        return bad(format!(
                            "an extent table of {table_bytes} bytes; at most {MAX_TABLE_BYTES}"
                        ));
                    }
                    Ok(())
                }
                Reply::Refused { message, .. } => text("the refusal", message),
                Reply::Status { json } => {
                    if json.len() > crate::limits::MAX_BODY / 2 {
                        return bad(format!("a status of {} bytes", json.len()));
                    }
                    Ok(())
                }
            },
            Self::Event(e) => match e {
                Event::QueuesRevoked {
                    controller,
                    qids: q,
                    why,
                } => {
                    name("the controller", controller)?;
                    qids(q)?;
                    text("the reason", why)
                }
                Event::ControllerFailed { controller, why } => {
                    name("the controller", controller)?;
                    text("the reason", why)
                }
                Event::Shutdown => Ok(()),
            },
        }
    }
}
