//! `gpunvme serve`: a daemon that owns NVMe controllers and lends their I/O queue pairs to
//! client processes over a Unix socket (`docs/serve.md` has the decisions).
//!
//! - [`memory`]: arenas (shared memory the controller reaches) and doorbell words, poisoned
//!   once released so that a late controller access is refused and counted;
//! - [`daemon`]: the controllers served, each client's ledger and budgets, the requests, and
//!   the reclaim order when a client goes (its queues deleted on the controller, their
//!   doorbells detached, then its memory out of the controller's reach, then freed);
//! - [`forward`]: shadow doorbells forwarded to a register controller (SPDK's target) after
//!   each value is checked against its ring;
//! - [`server`]: the socket: one thread per client, identity from the kernel (peer
//!   credentials), every wait bounded, a client that stops reading disconnected.
//!
//! What is served so far: images (through the software controller) and vfio-user servers
//! (SPDK's NVMe-oF target), to clients that drive their queues from CPU threads
//! (`gpunvme_serve_client`).
#![deny(unsafe_code)]

pub mod daemon;
pub mod files;
pub mod forward;
pub mod memory;
pub mod server;
mod vfio_map;

pub use daemon::{Budgets, Daemon, TRUST};
pub use server::{ServeOptions, Server, group_id};

/// Why the daemon could not start or serve.
#[derive(Debug, thiserror::Error)]
pub enum ServeError {
    /// Opening or bringing up a controller failed.
    #[error("{0}")]
    Open(#[from] gpunvme::Error),
    /// The controller refused or failed.
    #[error("controller: {0}")]
    Controller(String),
    /// Shared memory could not be made.
    #[error(transparent)]
    Shm(#[from] gpunvme_serve_shm::ShmError),
    /// The socket.
    #[error("{doing}: {source}")]
    Socket {
        /// What was being done.
        doing: String,
        /// The error.
        source: std::io::Error,
    },
    /// A setting out of range.
    #[error("{0}")]
    InvalidArgument(String),
}
