//! Forwarded namespaces: a namespace whose blocks live behind another NVMe controller that the
//! software controller reaches some other way (an NVMe over Fabrics connection; the embedder
//! supplies it as a [`Forwarder`]).
//!
//! The software controller stays the front: registers, admin queue, rings, PRPs and its GPU
//! transports are its own, so every host and GPU client works unchanged. Each controller
//! thread opens its own [`ForwardChannel`] to a forwarded namespace on first use and keeps many
//! commands in flight on it: a Read or Write is checked (fields, range, PRPs) as for any other
//! namespace, sent on, and completed when the far controller answers, the read's data copied
//! into the host's buffers then. Commands finish out of order and never hold the thread up;
//! Flush, Write Zeroes and Dataset Management are forwarded too, one at a time.
//!
//! What the far controller answers is passed on as its status. A channel that fails (the
//! connection lost, a command past its bound) fails every command in flight on it with
//! Transient Transport Error (retryable), and the next command opens a new channel (a
//! reconnect); a channel that cannot be opened puts the controller in Controller Fatal Status
//! (CSTS.CFS): the far controller is gone, as a drive's media can be.
//!
//! The controller never depends on how the channel is made: it sees only these traits, so
//! this crate knows nothing of any fabric.

use std::sync::Arc;
use std::time::Duration;

use nvme_spec::{Command, Status};

/// A forwarded command's data.
#[derive(Debug)]
pub enum ForwardData {
    /// None moves.
    None,
    /// These bytes go to the far controller (a write).
    ToController(Vec<u8>),
    /// This many bytes come back (a read).
    FromController(usize),
}

/// A forwarded command that finished.
#[derive(Debug)]
pub struct ForwardDone {
    /// The tag given at submission.
    pub tag: u64,
    /// The far controller's status (or the channel's, for a transfer that failed).
    pub status: Status,
    /// Completion Dword 0.
    pub dw0: u32,
    /// A read's data (empty otherwise).
    pub data: Vec<u8>,
}

/// Why a channel failed or could not be opened, in words (the embedder's error).
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ForwardError(pub String);

/// One controller thread's connection to a forwarded namespace's controller: commands in
/// flight, completions back. Used by one thread at a time.
pub trait ForwardChannel: Send {
    /// Whether another command can be submitted now.
    fn has_room(&self) -> bool;
    /// Sends `cmd` (its namespace id already the far one; its command id and data pointer are
    /// the channel's to set) with `data`; `tag` comes back in its [`ForwardDone`].
    fn submit(&mut self, tag: u64, cmd: Command, data: ForwardData) -> Result<(), ForwardError>;
    /// Appends to `done` the commands finished within `wait` (perhaps none; returns as soon as
    /// one is). An error fails the channel and every command in flight on it.
    fn poll(&mut self, wait: Duration, done: &mut Vec<ForwardDone>) -> Result<(), ForwardError>;
}

/// Opens channels to a far controller ([`crate::Backend::Forwarded`]).
pub trait Forwarder: Send + Sync + 'static {
    /// A new channel (a connection of its own: an NVMe/TCP I/O queue).
    fn channel(&self) -> Result<Box<dyn ForwardChannel>, ForwardError>;
    /// What the far controller is, for messages (e.g. `nvme-tcp://127.0.0.1:4420/nqn...`).
    fn describe(&self) -> String;
}

/// A namespace of a far controller ([`crate::Backend::Forwarded`]).
#[derive(Clone)]
pub struct Forwarded {
    /// Opens channels to its controller.
    pub forwarder: Arc<dyn Forwarder>,
    /// Its namespace id there.
    pub nsid: u32,
}

impl std::fmt::Debug for Forwarded {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{} namespace {}", self.forwarder.describe(), self.nsid)
    }
}

impl PartialEq for Forwarded {
    fn eq(&self, other: &Self) -> bool {
        Arc::ptr_eq(&self.forwarder, &other.forwarder) && self.nsid == other.nsid
    }
}

impl Eq for Forwarded {}
