//! The driver's error type: one variant per way an operation can fail, each naming what failed.

#![forbid(unsafe_code)]

use crate::device::DmaAllocError;
use crate::dma::DmaSliceError;
use crate::prp::PrpError;
use nvme_spec::Status;
use std::fmt;
use std::time::Duration;

/// Which command an error is about, for messages such as `Read nsid 1 lba 123`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Op {
    /// The command's name (the spec's name for its opcode).
    pub name: &'static str,
    /// Namespace, or 0 when the command has none.
    pub nsid: u32,
    /// Starting LBA, for commands that address blocks.
    pub lba: Option<u64>,
}

impl Op {
    /// An admin command (no namespace, no LBA).
    pub const fn admin(name: &'static str) -> Self {
        Self {
            name,
            nsid: 0,
            lba: None,
        }
    }
}

impl fmt::Display for Op {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.name)?;
        if self.nsid != 0 {
            write!(f, " nsid {}", self.nsid)?;
        }
        if let Some(lba) = self.lba {
            write!(f, " lba {lba}")?;
        }
        Ok(())
    }
}

/// Everything the driver can fail with.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The controller completed a command with an error status.
    #[error("{op}: {status}")]
    Nvme {
        /// The command.
        op: Op,
        /// The status it completed with.
        status: Status,
    },
    /// A command did not complete before its deadline. The queue pair it was on is marked failed:
    /// its command id and buffers cannot be reused safely.
    #[error("{op} timed out after {timeout:?} (queue {qid}, cid {cid})")]
    Timeout {
        /// Queue the command was submitted to.
        qid: u16,
        /// Its command id.
        cid: u16,
        /// The command.
        op: Op,
        /// The timeout that expired.
        timeout: Duration,
    },
    /// The controller reported Controller Fatal Status (CSTS.CFS = 1); it needs a reset.
    #[error("controller fatal status (CSTS {csts:#010x})")]
    ControllerFatal {
        /// The CSTS value read.
        csts: u32,
    },
    /// Registers read as all ones: the device was removed or stopped answering.
    #[error("device gone: its registers read as all ones")]
    DeviceGone,
    /// The queue pair failed earlier (timeout, fatal status or garbage from the device) and takes
    /// no more commands.
    #[error("queue {qid} has failed and accepts no more commands")]
    QueueFailed {
        /// The queue.
        qid: u16,
    },
    /// Every command slot of the queue pair is in flight.
    #[error("queue {qid} is full ({capacity} commands in flight)")]
    QueueFull {
        /// The queue.
        qid: u16,
        /// Its capacity.
        capacity: usize,
    },
    /// The controller posted a completion the driver cannot attribute (unknown or idle command
    /// id, wrong submission queue id, impossible SQ head). The queue pair is marked failed.
    #[error("queue {qid}: invalid completion from the device (cid {cid}, sqid {sqid}): {reason}")]
    InvalidCompletion {
        /// Queue the completion appeared on.
        qid: u16,
        /// The command id it carried.
        cid: u16,
        /// The submission queue id it carried.
        sqid: u16,
        /// What is wrong with it.
        reason: &'static str,
    },
    /// No active namespace has this id.
    #[error("no active namespace {nsid}")]
    NoSuchNamespace {
        /// The namespace id asked for.
        nsid: u32,
    },
    /// The namespace exists but is formatted or typed so that the driver refuses it.
    #[error("namespace {nsid} {why}")]
    NamespaceUnsupported {
        /// The namespace id asked for.
        nsid: u32,
        /// Why, in words (e.g. "is formatted with 64 bytes of metadata per block ...").
        why: String,
    },
    /// A buffer or length is not aligned as the command needs.
    #[error("{what} {value:#x} is not a multiple of {align}")]
    Unaligned {
        /// What is misaligned ("buffer length", "buffer device address", ...).
        what: &'static str,
        /// The offending value.
        value: u64,
        /// The required alignment.
        align: u64,
    },
    /// A block range extends past the end of the namespace.
    #[error("blocks {lba}..{lba}+{blocks} are outside namespace {nsid} ({capacity} blocks)")]
    OutOfRange {
        /// Namespace.
        nsid: u32,
        /// First block.
        lba: u64,
        /// Number of blocks.
        blocks: u64,
        /// Blocks in the namespace.
        capacity: u64,
    },
    /// One command may not move this many bytes.
    #[error("transfer of {len} bytes exceeds the per-command maximum of {max} bytes")]
    TransferTooLarge {
        /// Bytes asked for.
        len: usize,
        /// The limit ([`crate::ControllerInfo::max_transfer_bytes`]).
        max: usize,
    },
    /// The buffer cannot be described with PRPs.
    #[error("cannot build PRPs for the buffer")]
    Prp(#[from] PrpError),
    /// A DMA slice does not fit its buffer.
    #[error("invalid DMA slice")]
    DmaSlice(#[from] DmaSliceError),
    /// The transport could not provide DMA memory.
    #[error("cannot allocate DMA memory")]
    Dma(#[from] DmaAllocError),
    /// An argument is invalid.
    #[error("invalid argument: {0}")]
    InvalidArgument(String),
    /// The controller lacks something the driver needs, or the command is optional and the
    /// controller does not support it.
    #[error("not supported by the controller: {0}")]
    Unsupported(String),
    /// CSTS.RDY did not reach the wanted value within CAP.TO.
    #[error("controller did not become {} within {waited:?} (CSTS {csts:#010x})", if *ready { "ready" } else { "disabled" })]
    ReadyTimeout {
        /// Whether we waited for RDY = 1 (enable) or RDY = 0 (disable).
        ready: bool,
        /// How long we waited.
        waited: Duration,
        /// The last CSTS value.
        csts: u32,
    },
    /// The controller did not report shutdown complete (CSTS.SHST = 10b) in time.
    #[error("controller did not finish shutting down within {waited:?} (CSTS {csts:#010x})")]
    ShutdownTimeout {
        /// How long we waited.
        waited: Duration,
        /// The last CSTS value.
        csts: u32,
    },
    /// A queue size the controller cannot take: every queue has 2..=CAP.MQES + 1 entries.
    #[error("{queue} of {entries} entries: the controller takes 2..={max} entries (CAP.MQES + 1)")]
    InvalidQueueEntries {
        /// "submission queue" or "completion queue".
        queue: &'static str,
        /// Entries asked for.
        entries: u32,
        /// CAP.MQES + 1.
        max: u32,
    },
    /// The memory given for a queue is smaller than its entries.
    #[error("{queue} of {entries} entries needs {needed} bytes, but its memory has {len}")]
    QueueRegionTooSmall {
        /// "submission queue" or "completion queue".
        queue: &'static str,
        /// Entries asked for.
        entries: u32,
        /// Bytes the entries take.
        needed: usize,
        /// Bytes in the region given.
        len: usize,
    },
    /// All I/O queue pairs the controller granted are in use.
    #[error("all {granted} I/O queue pairs granted by the controller are in use")]
    NoQueueAvailable {
        /// Queue pairs granted by Set Features (Number of Queues).
        granted: u16,
    },
    /// The controller has been shut down.
    #[error("the controller has been shut down")]
    ShutDown,
}

impl Error {
    /// The NVMe status, if this is a command that completed with an error status.
    pub fn status(&self) -> Option<Status> {
        match self {
            Self::Nvme { status, .. } => Some(*status),
            _ => None,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_spec::status::generic;

    #[test]
    fn messages() {
        let e = Error::Nvme {
            op: Op {
                name: "Read",
                nsid: 1,
                lba: Some(123),
            },
            status: Status::generic(generic::LBA_OUT_OF_RANGE).with_dnr(true),
        };
        assert_eq!(
            e.to_string(),
            "Read nsid 1 lba 123: Generic: LBA Out of Range (sct 0x0, sc 0x80)"
        );
        assert_eq!(e.status().unwrap().sc, 0x80);
        let e = Error::Timeout {
            qid: 2,
            cid: 7,
            op: Op::admin("Identify"),
            timeout: Duration::from_millis(250),
        };
        assert_eq!(
            e.to_string(),
            "Identify timed out after 250ms (queue 2, cid 7)"
        );
        let e = Error::ReadyTimeout {
            ready: true,
            waited: Duration::from_secs(1),
            csts: 0,
        };
        assert_eq!(
            e.to_string(),
            "controller did not become ready within 1s (CSTS 0x00000000)"
        );
    }
}
