//! [`GpuFaults`]: fault injection on a running GPU-resident controller model (media errors,
//! dropped completions, a completion delay).
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::time::Duration;

use gpu_queues::GpuError;

use super::Shared;
use crate::desc::{CTRL_MAX_MEDIA_ERRORS, CtrlMediaError};

/// Fault injection on a running [`GpuController`] ([`GpuController::faults`]), mirroring
/// `nvme_emu::Faults`: each change is published to the kernel through the table generation
/// (bounded wait for every warp's acknowledgement) and applies to commands fetched after it
/// returns. Any fault set puts the kernel on the model's path (completions held until due);
/// clearing every fault returns it to the fast path.
pub struct GpuFaults {
    pub(super) shared: Arc<Shared>,
}

impl std::fmt::Debug for GpuFaults {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuFaults").finish_non_exhaustive()
    }
}

impl GpuFaults {
    /// Makes every read covering `lba` of namespace `nsid` fail with Unrecovered Read Error
    /// and every write covering it (Write, Write Zeroes, Dataset Management deallocate) with
    /// Write Fault (Media and Data Integrity Errors, Do Not Retry); no data moves.
    pub fn add_media_error(&self, nsid: u32, lba: u64) -> Result<(), GpuError> {
        self.add_media_error_range(nsid, lba, 1)
    }

    /// [`GpuFaults::add_media_error`] for LBAs `slba..slba + nlb` (one table entry; at most
    /// `CTRL_MAX_MEDIA_ERRORS` ranges at a time).
    pub fn add_media_error_range(&self, nsid: u32, slba: u64, nlb: u64) -> Result<(), GpuError> {
        if nsid == 0 || nlb == 0 || slba.checked_add(nlb).is_none() {
            return Err(GpuError::InvalidArgument(format!(
                "media error range nsid {nsid}, LBAs {slba}+{nlb}"
            )));
        }
        let mut t = self.shared.lock_tables();
        let e = CtrlMediaError {
            slba,
            nlb,
            nsid,
            reserved: 0,
        };
        if t.media_errors.contains(&e) {
            return Ok(());
        }
        if t.media_errors.len() >= CTRL_MAX_MEDIA_ERRORS {
            return Err(GpuError::Unsupported(format!(
                "more than {CTRL_MAX_MEDIA_ERRORS} media error ranges on the GPU controller"
            )));
        }
        t.media_errors.push(e);
        self.shared.publish_faults(&mut t)
    }

    /// Removes the media error [`GpuFaults::add_media_error`] set; returns whether it was set.
    pub fn remove_media_error(&self, nsid: u32, lba: u64) -> Result<bool, GpuError> {
        self.remove_media_error_range(nsid, lba, 1)
    }

    /// Removes a range [`GpuFaults::add_media_error_range`] set; returns whether it was set.
    pub fn remove_media_error_range(
        &self,
        nsid: u32,
        slba: u64,
        nlb: u64,
    ) -> Result<bool, GpuError> {
        let mut t = self.shared.lock_tables();
        let before = t.media_errors.len();
        t.media_errors
            .retain(|e| (e.nsid, e.slba, e.nlb) != (nsid, slba, nlb));
        if t.media_errors.len() == before {
            return Ok(false);
        }
        self.shared.publish_faults(&mut t).map(|()| true)
    }

    /// Removes every injected media error.
    pub fn clear_media_errors(&self) -> Result<(), GpuError> {
        let mut t = self.shared.lock_tables();
        t.media_errors.clear();
        self.shared.publish_faults(&mut t)
    }

    /// Executes the next `count` I/O commands (on any queue) but never posts their
    /// completions ([`DROP_ALL`]: every one, until set to 0); their clients' bounded waits
    /// time out.
    pub fn drop_completions(&self, count: u64) -> Result<(), GpuError> {
        self.set_drops(0, count)
    }

    /// [`GpuFaults::drop_completions`] for the completions of queue `qid` only (taken before
    /// the controller-wide count). Creating a queue on `qid` clears its count.
    pub fn drop_completions_on(&self, qid: u16, count: u64) -> Result<(), GpuError> {
        if qid == 0 || qid as usize > self.shared.nqueues {
            return Err(GpuError::InvalidArgument(format!("queue id {qid}")));
        }
        self.set_drops(qid, count)
    }

    /// How many more completions will be dropped on any queue ([`DROP_ALL`] for all).
    pub fn drops_remaining(&self) -> Result<u64, GpuError> {
        self.shared.drops_at(0)
    }

    /// How many more completions of queue `qid` will be dropped.
    pub fn drops_remaining_on(&self, qid: u16) -> Result<u64, GpuError> {
        if qid == 0 || qid as usize > self.shared.nqueues {
            return Err(GpuError::InvalidArgument(format!("queue id {qid}")));
        }
        self.shared.drops_at(qid)
    }

    /// Delays every I/O completion by `delay` after the command would have completed (zero
    /// turns delays off; at most ~4.29 s). Delayed completions do not block the controller.
    pub fn set_completion_delay(&self, delay: Duration) -> Result<(), GpuError> {
        let ns = u32::try_from(delay.as_nanos()).map_err(|_| {
            GpuError::InvalidArgument(format!("completion delay {delay:?} (at most 4.29 s)"))
        })?;
        let mut t = self.shared.lock_tables();
        t.delay_ns = ns;
        self.shared.publish_faults(&mut t)
    }

    /// The current completion delay.
    pub fn completion_delay(&self) -> Duration {
        Duration::from_nanos(self.shared.lock_tables().delay_ns as u64)
    }

    fn set_drops(&self, qid: u16, count: u64) -> Result<(), GpuError> {
        let mut t = self.shared.lock_tables();
        self.shared
            .drops
            .write(qid as usize * 8, &count.to_le_bytes())?;
        if count == 0 {
            t.drops_armed.remove(&qid);
        } else {
            t.drops_armed.insert(qid);
        }
        self.shared.publish_faults(&mut t)
    }
}
