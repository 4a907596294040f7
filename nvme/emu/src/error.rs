//! Errors of the software controller: starting it, configuring it, and its device-address map.

use std::path::PathBuf;

/// Why the software controller could not be configured or started.
#[derive(Debug, thiserror::Error)]
pub enum EmuError {
    /// A configuration value is outside what the controller supports.
    #[error("invalid controller configuration: {reason}")]
    InvalidConfig {
        /// What is wrong, in words a user can act on.
        reason: String,
    },
    /// A namespace's LBA size is neither 512 nor 4096 bytes.
    #[error("namespace {nsid}: LBA size {lba_size} is not supported (use 512 or 4096)")]
    InvalidLbaSize {
        /// The namespace (1-based).
        nsid: u32,
        /// The LBA size asked for.
        lba_size: u32,
    },
    /// An image file cannot be used as a namespace.
    #[error("cannot use {path:?} as a disk image: {reason}")]
    InvalidImage {
        /// The image path.
        path: PathBuf,
        /// What is wrong with it.
        reason: String,
    },
    /// Opening a namespace's image file failed.
    #[error("cannot open disk image {path:?}")]
    OpenImage {
        /// The image path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Another open controller holds the image: an image serves one writer or any number of
    /// readers at a time (`flock(2)`, held for the life of the controller). When the holder is
    /// this very process (a second handle on the image, or the image given twice), the message
    /// says so rather than naming our own pid.
    #[error("{}", busy_message(path, *holder, *wanted_exclusive))]
    ImageBusy {
        /// The image path.
        path: PathBuf,
        /// The process holding the conflicting lock, when the kernel's lock table tells.
        holder: Option<u32>,
        /// Whether the lock wanted was exclusive (a writable namespace).
        wanted_exclusive: bool,
    },
    /// Locking an image file failed for another reason than a conflicting lock.
    #[error("cannot lock disk image {path:?}")]
    LockImage {
        /// The image path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Creating (or sizing) a new image file failed.
    #[error("cannot create disk image {path:?}")]
    CreateImage {
        /// The image path.
        path: PathBuf,
        /// The I/O error.
        #[source]
        source: std::io::Error,
    },
    /// Allocating a namespace's memory backing failed.
    #[error("cannot allocate {bytes} bytes of memory for namespace {nsid}")]
    AllocateNamespace {
        /// The namespace (1-based).
        nsid: u32,
        /// Bytes asked for.
        bytes: u64,
    },
    /// Spawning a controller thread failed.
    #[error("cannot start a controller thread")]
    SpawnThread {
        /// The I/O error from the OS.
        #[source]
        source: std::io::Error,
    },
    /// External doorbells cannot be attached to this queue id
    /// ([`crate::EmuDevice::attach_external_doorbells`]).
    #[error("cannot attach external doorbells to queue {qid}: {reason}")]
    AttachDoorbells {
        /// The queue id asked for.
        qid: u16,
        /// Why it was refused.
        reason: AttachRefusal,
    },
    /// The device-address space of the controller is exhausted (only after about 2^63 bytes of
    /// allocations, since addresses are never reused).
    #[error("device address space exhausted: cannot map {len} more bytes")]
    AddressSpaceExhausted {
        /// Bytes asked for.
        len: u64,
    },
}

/// Why [`crate::EmuDevice::attach_external_doorbells`] refused a queue id.
#[derive(Clone, Copy, Debug, PartialEq, Eq, thiserror::Error)]
pub enum AttachRefusal {
    /// The id is not an I/O queue id the controller can grant (`1..=max`).
    #[error("not an I/O queue id (1..={max})")]
    InvalidQueueId {
        /// The largest I/O queue id (the configuration's `max_io_queue_pairs`).
        max: u16,
    },
    /// The submission or completion queue with this id exists: attach before creating it.
    #[error("the queue exists; attach before creating it")]
    QueueExists,
    /// Words are already attached to this id; detach them first.
    #[error("external doorbells are already attached")]
    AlreadyAttached,
}

/// The words of [`EmuError::ImageBusy`]: who holds the image, and what the rule is.
fn busy_message(path: &std::path::Path, holder: Option<u32>, wanted_exclusive: bool) -> String {
    if holder == Some(std::process::id()) {
        return format!(
            "{} is already open in this process (another handle, or the same image given twice, \
             holds it; close that one first: an image serves one process that changes it, or \
             any number that only read it)",
            path.display()
        );
    }
    format!(
        "{} {} {} (an image serves one process that changes it, or any number that only read it)",
        path.display(),
        if wanted_exclusive {
            "is in use by"
        } else {
            "is being changed by"
        },
        match holder {
            Some(pid) => format!("process {pid}"),
            None => "another process".to_string(),
        }
    )
}
