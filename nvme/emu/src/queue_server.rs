//! [`QueueServer`]: I/O queues served by something other than the controller's own threads.
//!
//! The software controller keeps the admin queue, the registers, Identify, features and the
//! queue bookkeeping; a queue server installed with [`crate::EmuDevice::set_queue_server`]
//! receives every I/O queue created afterwards (after the controller's own checks of the
//! Create command) and serves its commands itself — the GPU-resident controller model of
//! `gpu_queues` does, with rings and doorbells in GPU memory. Queues handed to a server never
//! reach the controller threads, and their register-window doorbells are refused as writes to
//! an invalid doorbell register (the server's doorbells are its own).

/// Why a queue server refused a Create I/O Completion/Submission Queue command. The command
/// fails with the status the variant names.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum QueueServerRefusal {
    /// The queue's memory is not memory the server reaches: Data Transfer Error.
    #[error("queue memory at {addr:#x} is not reachable by the queue server")]
    Unreachable {
        /// The queue's base address (PRP1 of the Create command).
        addr: u64,
    },
    /// A shape the server does not support (for example a submission queue posting to a
    /// completion queue of another id): Invalid Field in Command.
    #[error("unsupported by the queue server: {0}")]
    Unsupported(String),
}

/// Something that serves I/O queues in place of the controller threads.
///
/// Calls come from the controller's admin thread, one at a time, in the order of the admin
/// commands; each returns when the change is in effect (a deletion: when the server no longer
/// touches the queue's memory), within a bound the server guarantees.
pub trait QueueServer: Send + Sync {
    /// Completion queue `qid` of `entries` entries at device address `addr` now exists.
    fn create_cq(&self, qid: u16, addr: u64, entries: u32) -> Result<(), QueueServerRefusal>;
    /// Submission queue `qid` of `entries` entries at `addr`, posting to completion queue
    /// `cqid` (created earlier through this server), now exists.
    fn create_sq(
        &self,
        qid: u16,
        cqid: u16,
        addr: u64,
        entries: u32,
    ) -> Result<(), QueueServerRefusal>;
    /// Submission queue `qid` is deleted: stop fetching from it. Commands it had fetched are
    /// completed or dropped, as the server documents.
    fn delete_sq(&self, qid: u16);
    /// Completion queue `qid` is deleted: stop posting to it.
    fn delete_cq(&self, qid: u16);
    /// A controller reset (CC.EN cleared): forget every queue.
    fn reset(&self);
    /// A normal shutdown (CC.SHN): make what the queues wrote durable.
    fn shutdown(&self);
}
