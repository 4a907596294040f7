//! The block-device seam blockfs runs on: whole-LBA reads and writes, batched, plus flush.
//!
//! blockfs never sees a queue, a command id or a DMA buffer. It hands a device a batch of
//! independent requests and gets control back once all of them completed; the device decides how
//! many commands to keep in flight and on which queues ([`crate::NvmeBlockDevice`] splits a batch
//! at the controller's maximum transfer size and spreads it over several queue pairs). A write
//! batch can also take its bytes from a [`DataSource`] (a host file, say) that the device reads
//! as it issues the commands, instead of from buffers filled beforehand, and a read batch can
//! hand its bytes to a [`DataSink`] as each command completes. Three
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

/// One write whose bytes come from a [`DataSource`]: `len` bytes (whole LBAs) read from source
/// byte `src_offset` on, written from `lba` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SourceWriteReq {
    /// First LBA.
    pub lba: u64,
    /// Where in the source the bytes start.
    pub src_offset: u64,
    /// Bytes to write; a multiple of the device's LBA size.
    pub len: usize,
}

/// Bytes read by position, from several threads at once: where [`BlockDevice::write_from`] and
/// [`crate::File::write_from`] take their data, so that reading it can overlap the device's work
/// instead of being staged in a large buffer first.
pub trait DataSource: Sync {
    /// Fills `buf` with the bytes starting at `offset`. Fails with
    /// [`std::io::ErrorKind::UnexpectedEof`] if the source ends first.
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()>;
}

impl DataSource for [u8] {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        let src = usize::try_from(offset)
            .ok()
            .and_then(|start| self.get(start..start.checked_add(buf.len())?))
            .ok_or(std::io::ErrorKind::UnexpectedEof)?;
        buf.copy_from_slice(src);
        Ok(())
    }
}

impl DataSource for Vec<u8> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.as_slice().read_exact_at(buf, offset)
    }
}

impl<T: DataSource + ?Sized> DataSource for &T {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        (**self).read_exact_at(buf, offset)
    }
}

#[cfg(unix)]
impl DataSource for std::fs::File {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::read_exact_at(self, buf, offset)
    }
}

/// One read whose bytes go to a [`DataSink`]: `len` bytes (whole LBAs) read from `lba` on,
/// written to the sink from byte `dst_offset` on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SinkReadReq {
    /// First LBA.
    pub lba: u64,
    /// Where in the sink the bytes go.
    pub dst_offset: u64,
    /// Bytes to read; a multiple of the device's LBA size.
    pub len: usize,
}

/// Bytes written by position, from several threads at once: where [`BlockDevice::read_into`]
/// and [`crate::File::read_to`] put what they read, so that writing it out overlaps the
/// device's work instead of waiting for a large buffer to fill.
pub trait DataSink: Sync {
    /// Writes all of `buf` at `offset`.
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()>;
}

impl<T: DataSink + ?Sized> DataSink for &T {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        (**self).write_all_at(buf, offset)
    }
}

/// A sink in memory that grows to fit what is written (gaps read as zeroes).
impl DataSink for std::sync::Mutex<Vec<u8>> {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        let start = usize::try_from(offset).map_err(|_| std::io::ErrorKind::FileTooLarge)?;
        let end = start
            .checked_add(buf.len())
            .ok_or(std::io::ErrorKind::FileTooLarge)?;
        let mut v = self.lock().unwrap_or_else(|e| e.into_inner());
        if v.len() < end {
            v.resize(end, 0);
        }
        v[start..end].copy_from_slice(buf);
        Ok(())
    }
}

#[cfg(unix)]
impl DataSink for std::fs::File {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        std::os::unix::fs::FileExt::write_all_at(self, buf, offset)
    }
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
    /// Reading the [`DataSource`] of a [`BlockDevice::write_from`] failed; nothing was asked of
    /// the device for those bytes.
    #[error("reading the data source at byte {offset} failed")]
    ReadSource {
        /// Source offset of the failed read.
        offset: u64,
        /// What the source said.
        #[source]
        source: std::io::Error,
    },
    /// Writing to the [`DataSink`] of a [`BlockDevice::read_into`] failed; the device read
    /// those bytes without error.
    #[error("writing the destination at byte {offset} failed")]
    WriteSink {
        /// Sink offset of the failed write.
        offset: u64,
        /// What the sink said.
        #[source]
        source: std::io::Error,
    },
}

/// Bytes the default [`BlockDevice::write_from`] and [`BlockDevice::read_into`] stage per
/// device command.
pub const SOURCE_STAGE_BYTES: usize = 4 << 20;

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

    /// Writes every request of the batch with bytes read from `src` while the batch runs, and
    /// calls `progress` with the byte count of each part as it completes (from any thread).
    /// Completion and durability are as for [`BlockDevice::write`]; a failed source read fails
    /// the batch with [`DeviceError::ReadSource`] once everything started has finished.
    ///
    /// The default reads at most [`SOURCE_STAGE_BYTES`] at a time into a buffer and writes it
    /// with [`BlockDevice::write`]; [`crate::NvmeBlockDevice`] reads each command's bytes into
    /// its own small staging buffer right before the command is issued, on every lane at once,
    /// so source reads overlap the device's work.
    fn write_from(
        &self,
        reqs: &[SourceWriteReq],
        src: &dyn DataSource,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(), DeviceError> {
        let parts = reqs.iter().map(|r| (r.lba, r.src_offset, r.len));
        staged(self, parts, |lba, at, stage| {
            src.read_exact_at(stage, at)
                .map_err(|source| DeviceError::ReadSource { offset: at, source })?;
            self.write(&[WriteReq { lba, buf: stage }])?;
            progress(stage.len() as u64);
            Ok(())
        })
    }

    /// Reads every request of the batch and writes its bytes to `sink` as they arrive, calling
    /// `progress` with the byte count of each part written (from any thread). A failed sink
    /// write fails the batch with [`DeviceError::WriteSink`] once everything started has
    /// finished.
    ///
    /// The default reads at most [`SOURCE_STAGE_BYTES`] at a time into a buffer with
    /// [`BlockDevice::read`] and writes it out; [`crate::NvmeBlockDevice`] hands each command's
    /// bytes to the sink from the lane that completed it, on every lane at once.
    fn read_into(
        &self,
        reqs: &[SinkReadReq],
        sink: &dyn DataSink,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(), DeviceError> {
        let parts = reqs.iter().map(|r| (r.lba, r.dst_offset, r.len));
        staged(self, parts, |lba, at, stage| {
            self.read(&mut [ReadReq { lba, buf: stage }])?;
            sink.write_all_at(stage, at)
                .map_err(|source| DeviceError::WriteSink { offset: at, source })?;
            progress(stage.len() as u64);
            Ok(())
        })
    }

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

/// Walks `(lba, host offset, len)` requests in steps of at most [`SOURCE_STAGE_BYTES`] whole
/// LBAs, after checking all of them, calling `step(lba, host offset, stage)` with a staging
/// buffer of the step's length: the loop behind the default [`BlockDevice::write_from`] and
/// [`BlockDevice::read_into`].
fn staged<D: BlockDevice + ?Sized>(
    dev: &D,
    reqs: impl Iterator<Item = (u64, u64, usize)> + Clone,
    mut step: impl FnMut(u64, u64, &mut [u8]) -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    let lba_size = dev.lba_size() as usize;
    let mut largest = 0;
    for (lba, _, len) in reqs.clone() {
        check_request(lba, len, dev.lba_size(), dev.lba_count())?;
        largest = largest.max(len);
    }
    // Whole LBAs per step (the stage is a multiple of every supported LBA size).
    let max_step = SOURCE_STAGE_BYTES.max(lba_size);
    let mut stage = vec![0u8; largest.min(max_step)];
    for (lba, at, len) in reqs {
        let mut done = 0;
        while done < len {
            let n = (len - done).min(max_step);
            step(
                lba + (done / lba_size) as u64,
                at + done as u64,
                &mut stage[..n],
            )?;
            done += n;
        }
    }
    Ok(())
}

/// Checks a request of `len` bytes from `lba` against a device's geometry (whole LBAs, inside
/// the device): its LBA count, or the error. For implementations of [`BlockDevice`].
pub fn check_request(
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
