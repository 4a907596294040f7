//! Why a client call failed ([`ClientError`]).

use std::path::PathBuf;
use std::time::Duration;

use gpunvme_serve_proto::msg::RefusalKind;
use gpunvme_serve_proto::socket::SocketError;
use gpunvme_serve_shm::ShmError;
use nvme_spec::Status;

/// Why a call of this crate failed. Each variant names what was being done and the numbers
/// involved; nothing read from the socket or from shared memory makes the library panic, it
/// becomes one of these.
#[derive(Debug, thiserror::Error)]
pub enum ClientError {
    /// The daemon's socket could not be reached.
    #[error("connecting to {path:?}")]
    Connect {
        /// The socket's path.
        path: PathBuf,
        /// The error.
        source: std::io::Error,
    },
    /// The daemon speaks another protocol version.
    #[error("the daemon speaks protocol version {daemon}, this client speaks {client}")]
    Version {
        /// The daemon's version.
        daemon: u16,
        /// Ours ([`gpunvme_serve_proto::PROTOCOL_VERSION`]).
        client: u16,
    },
    /// The daemon refused the request; nothing changed on its side.
    #[error("the daemon refused ({kind:?}): {message}")]
    Refused {
        /// Why, by kind.
        kind: RefusalKind,
        /// Why, in the daemon's words (with its numbers).
        message: String,
    },
    /// The daemon closed the connection (or died). Every queue pair of the connection is
    /// revoked with it.
    #[error("the daemon closed the connection ({doing})")]
    Closed {
        /// What was being done.
        doing: &'static str,
    },
    /// A transfer on the socket failed (a bounded wait ran out, a system call failed).
    #[error("{doing}")]
    Socket {
        /// What was being done.
        doing: &'static str,
        /// The error.
        source: SocketError,
    },
    /// The daemon or the controller broke the protocol: a reply of the wrong kind or id, a
    /// malformed frame, a grant outside its arena, a completion for a command not in flight.
    #[error("protocol violation: {0}")]
    Protocol(String),
    /// Shared memory could not be mapped or reached.
    #[error("{what}")]
    Shm {
        /// What was being done.
        what: &'static str,
        /// The error.
        source: ShmError,
    },
    /// A call's arguments were wrong; nothing was sent or written.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// Every command slot of the pair is in flight (at most `depth - 1` are); reap first.
    #[error("queue {qid}: all {in_flight} command slots are in flight")]
    QueueFull {
        /// The queue pair.
        qid: u16,
        /// Commands in flight.
        in_flight: usize,
    },
    /// A command did not complete within the bound.
    #[error("queue {qid}: command {cid} did not complete within {after:?}")]
    Timeout {
        /// The queue pair.
        qid: u16,
        /// The command id (the oldest in flight where several were awaited).
        cid: u16,
        /// The bound.
        after: Duration,
    },
    /// A command completed with an error status.
    #[error("queue {qid}: command {cid} ({op} of lba {lba}) failed: {status}")]
    Command {
        /// The queue pair.
        qid: u16,
        /// The command id.
        cid: u16,
        /// The command ("Read", "Write").
        op: &'static str,
        /// Its starting LBA.
        lba: u64,
        /// The completion's status: its `Display` names the status code type and code.
        status: Status,
    },
    /// A request the daemon ran on the controller for us ended with an error status.
    #[error("{request}: the controller answered {status}")]
    DeviceStatus {
        /// The request.
        request: &'static str,
        /// The status the daemon passed on.
        status: Status,
    },
    /// The queue pair was taken back (an event from the daemon, the connection's end); its
    /// commands in flight are lost.
    #[error("queue {qid} was revoked: {why}")]
    Revoked {
        /// The queue pair.
        qid: u16,
        /// Why.
        why: String,
    },
}
