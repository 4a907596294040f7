//! The block-device seam blockfs runs on: whole-LBA reads and writes, batched, plus flush.
//!
//! blockfs never sees a queue, a command id or a DMA buffer. It hands a device a batch of
//! independent requests and gets control back once all of them completed; the device decides how
//! many commands to keep in flight and on which queues ([`crate::NvmeBlockDevice`] splits a batch
//! at the controller's maximum transfer size and spreads it over several queue pairs). Three
//! implementations exist: [`crate::MemDevice`] (memory, for tests and fuzzing),
//! [`crate::CrashDevice`] (records every write and flush for the crash-consistency test) and
//! [`crate::NvmeBlockDevice`].
//!
//! Durability model (the one FORMAT.md's commit protocol relies on): a completed write may sit
//! in a volatile cache until the next completed [`BlockDevice::flush`]; writes of one batch may
//! reach the medium in any order; a write of a single LBA is atomic across power loss (NVMe's
//! AWUPF is at least one LBA), a longer one may be torn at LBA boundaries.

use std::error::Error as StdError;

/// One read of whole LBAs: `buf.len()` must be a multiple of the device's LBA size.
#[derive(Debug)]
pub struct ReadReq<'a> {
    /// First LBA.
    pub lba: u64,
    /// Destination; its length gives the number of LBAs.
    pub buf: &'a mut [u8],
}

/// One write of whole LBAs: `buf.len()` must be a multiple of the device's LBA size.
#[derive(Debug, Clone, Copy)]
pub struct WriteReq<'a> {
    /// First LBA.
    pub lba: u64,
    /// Source; its length gives the number of LBAs.
    pub buf: &'a [u8],
}

/// Why a block device operation failed.
#[derive(Debug, thiserror::Error)]
pub enum DeviceError {
    /// A request reaches past the end of the device.
    #[error("LBAs {lba}..{end} are outside the device ({blocks} LBAs)")]
    OutOfRange {
        /// First LBA asked for.
        lba: u64,
        /// One past the last LBA asked for.
        end: u64,
        /// LBAs the device has.
        blocks: u64,
    },
    /// A buffer is not a whole number of LBAs.
    #[error("buffer of {len} bytes is not a multiple of the {lba_size}-byte LBA size")]
    Misaligned {
        /// Buffer length.
        len: usize,
        /// The device's LBA size.
        lba_size: u32,
    },
    /// The transport or the medium reported a failure.
    #[error("{op} at LBA {lba} failed")]
    Io {
        /// What was being done ("read", "write", "flush", "write zeroes").
        op: &'static str,
        /// First LBA of the failed request (0 for flush).
        lba: u64,
        /// What the transport said.
        #[source]
        source: Box<dyn StdError + Send + Sync>,
    },
}

/// A device of fixed-size LBAs that blockfs stores a file system on.
///
/// Requests in one batch are independent: they never overlap (blockfs guarantees it) and may be
/// carried out concurrently and in any order. A batch call returns once every request in it
/// completed, or with the first error seen after all requests that were started have finished
/// (so no buffer is still in use by the device when the call returns).
pub trait BlockDevice: Send + Sync {
    /// Bytes per LBA (a power of two, at least 512).
    fn lba_size(&self) -> u32;

    /// Number of LBAs.
    fn lba_count(&self) -> u64;

    /// Reads every request of the batch.
    fn read(&self, reqs: &mut [ReadReq<'_>]) -> Result<(), DeviceError>;

    /// Writes every request of the batch. Completed writes are durable only after a later
    /// [`BlockDevice::flush`] completes.
    fn write(&self, reqs: &[WriteReq<'_>]) -> Result<(), DeviceError>;

    /// Makes every completed write durable (NVMe Flush).
    fn flush(&self) -> Result<(), DeviceError>;

    /// Sets `count` LBAs starting at `lba` to zeroes. Like a write, durable after the next flush.
    ///
    /// The default writes zero-filled buffers; devices with a cheaper way (NVMe Write Zeroes)
    /// override it.
    fn write_zeroes(&self, lba: u64, count: u64) -> Result<(), DeviceError> {
        const CHUNK: usize = 1 << 20;
        let lba_size = self.lba_size() as u64;
        let per_chunk = (CHUNK as u64 / lba_size).max(1);
        let zeroes = vec![0u8; (per_chunk * lba_size) as usize];
        let mut done = 0;
        while done < count {
            let n = per_chunk.min(count - done);
            self.write(&[WriteReq {
                lba: lba + done,
                buf: &zeroes[..(n * lba_size) as usize],
            }])?;
            done += n;
        }
        Ok(())
    }

    /// The NVMe namespace id behind this device, if there is one (recorded in GPU extent tables
    /// so kernels can build commands without asking the host).
    fn nvme_nsid(&self) -> Option<u32> {
        None
    }

    /// One line for humans saying what this device is.
    fn describe(&self) -> String;
}

/// Checks a batch against the device's geometry; shared by the implementations in this crate.
pub(crate) fn check_request(
    lba: u64,
    len: usize,
    lba_size: u32,
    lba_count: u64,
) -> Result<u64, DeviceError> {
    if len % lba_size as usize != 0 {
        return Err(DeviceError::Misaligned { len, lba_size });
    }
    let n = (len / lba_size as usize) as u64;
    match lba.checked_add(n) {
        Some(end) if end <= lba_count => Ok(n),
        _ => Err(DeviceError::OutOfRange {
            lba,
            end: lba.saturating_add(n),
            blocks: lba_count,
        }),
    }
}
