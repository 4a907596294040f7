//! The client library of `gpunvme serve` (docs/serve.md): a process connects to the daemon
//! that owns an NVMe controller, gets memory in the controller's reach (an [`Arena`]) and
//! queue pairs laid out in it, and drives the pairs itself. Nothing crosses the socket per
//! I/O command: a [`QueuePair`] writes submission entries into its ring, stores the SQ tail in
//! its doorbell word, polls the completion ring and stores the CQ head.
//!
//! - [`Connection`]: the socket and its requests (`Hello`, `OpenController`, `AllocArena`,
//!   `CreateQueues`, `DeleteQueues`, `FreeArena`, `Admin`, `Status`), sequential and bounded,
//!   with the daemon's events kept and acted on (a revoked pair fails with
//!   [`ClientError::Revoked`]).
//! - [`QueuePair`]: Read and Write through the pair's slot buffers, one at a time
//!   ([`QueuePair::read`], [`QueuePair::write`]) or many in flight ([`QueuePair::submit_read`],
//!   [`QueuePair::submit_write`], [`QueuePair::reap`]).
//! - [`command`]: the submission and completion entries' bytes and the PRPs of a slot
//!   (`nvme_spec`'s types at `nvme_spec::wire`'s offsets); [`layout`]: where a pair's rings
//!   and slots sit in its arena, and the checks every grant passes before it is used.
//!
//! All shared memory is reached through [`SharedMemory`] (raw copies and atomics), and
//! everything read from it or from the socket is checked: a buggy or hostile daemon or
//! controller gives a [`ClientError`], never a panic, and every wait ends within its bound.
//!
//! The trust model is the daemon's and is cooperative: print [`Welcome::trust`].
#![forbid(unsafe_code)]

mod arena;
pub mod check;
pub mod command;
mod connection;
mod error;
pub mod layout;
mod lease;
mod queue_pair;
mod ring;

pub use arena::Arena;
pub use command::IoOp;
pub use connection::{Connection, ControllerInfo, MAX_KEPT_EVENTS, Welcome};
pub use error::ClientError;
pub use gpunvme_serve_proto::msg::{NamespaceInfo, QueueGrant, RefusalKind};
pub use gpunvme_serve_proto::socket::{Channel, SocketError};
pub use gpunvme_serve_proto::{Event, PROTOCOL_VERSION, chain};
pub use gpunvme_serve_shm::SharedMemory;
pub use nvme_spec::Status;
pub use queue_pair::{Completion, QueuePair};

#[cfg(test)]
mod tests {
    /// Connections are shared by threads; a queue pair may move to the thread that drives it.
    #[test]
    fn connections_are_sync_and_pairs_send() {
        fn send_sync<T: Send + Sync>() {}
        send_sync::<super::Connection>();
        send_sync::<super::QueuePair>();
        send_sync::<super::Arena>();
    }
}
