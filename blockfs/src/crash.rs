//! [`CrashDevice`]: a memory device that records every write and flush, so a test can rebuild
//! the medium as a power cut at any point would have left it.
//!
//! The idea is redb's `CrashBackend`: run a workload once while recording, then for every prefix
//! of the log (and with the write after the prefix torn, only some of its LBAs reaching the
//! medium) rebuild the image, mount it and check invariants. Replaying prefixes treats the log as
//! if the device persisted writes in order; a test that also wants the reordering a volatile
//! write cache allows applies any subset of the writes after the last flush
//! ([`CrashDevice::replay`] takes whatever operations the caller picks).

use std::sync::Mutex;

use crate::device::{BlockDevice, DeviceError, ReadReq, WriteReq};
use crate::mem::MemDevice;

/// One recorded device operation.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum LoggedOp {
    /// A write of whole LBAs (one request of a batch).
    Write {
        /// First LBA.
        lba: u64,
        /// The bytes written.
        data: Vec<u8>,
    },
    /// A Write Zeroes of `count` LBAs.
    Zeroes {
        /// First LBA.
        lba: u64,
        /// LBAs zeroed.
        count: u64,
    },
    /// A completed flush: everything logged before it is durable.
    Flush,
}

impl LoggedOp {
    /// Number of LBAs the operation writes (0 for a flush).
    pub fn lba_len(&self, lba_size: u32) -> u64 {
        match self {
            LoggedOp::Write { data, .. } => data.len() as u64 / lba_size as u64,
            LoggedOp::Zeroes { count, .. } => *count,
            LoggedOp::Flush => 0,
        }
    }
}

/// A [`MemDevice`] that logs operations while recording is on.
#[derive(Debug)]
pub struct CrashDevice {
    inner: MemDevice,
    log: Mutex<Option<Vec<LoggedOp>>>,
}

impl CrashDevice {
    /// Wraps a memory device; recording starts off.
    pub fn new(inner: MemDevice) -> Self {
        Self {
            inner,
            log: Mutex::new(None),
        }
    }

    /// Starts (or restarts) recording with an empty log and returns a copy of the medium as it
    /// is now: the base every replay starts from.
    pub fn start_recording(&self) -> MemDevice {
        let mut log = self.log.lock().unwrap_or_else(|e| e.into_inner());
        *log = Some(Vec::new());
        self.inner.duplicate()
    }

    /// Number of operations recorded so far.
    pub fn log_len(&self) -> usize {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .as_ref()
            .map_or(0, Vec::len)
    }

    /// Stops recording and returns the log.
    pub fn take_log(&self) -> Vec<LoggedOp> {
        self.log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
            .unwrap_or_default()
    }

    /// The device underneath.
    pub fn inner(&self) -> &MemDevice {
        &self.inner
    }

    fn record(&self, op: LoggedOp) {
        if let Some(log) = self.log.lock().unwrap_or_else(|e| e.into_inner()).as_mut() {
            log.push(op);
        }
    }

    /// Applies one logged operation to `dev`.
    pub fn apply(dev: &MemDevice, op: &LoggedOp) {
        let lba_size = dev.lba_size() as u64;
        match op {
            LoggedOp::Write { lba, data } => dev.store(lba * lba_size, data),
            LoggedOp::Zeroes { lba, count } => {
                // Through the trait so whole chunks are dropped rather than stored.
                let _ = dev.write_zeroes(*lba, *count);
            }
            LoggedOp::Flush => {}
        }
    }

    /// Applies only the LBAs of `op` for which `keep(i)` is true (`i` counts LBAs from the
    /// start of the operation): a torn write.
    pub fn apply_torn(dev: &MemDevice, op: &LoggedOp, mut keep: impl FnMut(u64) -> bool) {
        let lba_size = dev.lba_size() as u64;
        match op {
            LoggedOp::Write { lba, data } => {
                for (i, sector) in data.chunks(lba_size as usize).enumerate() {
                    if keep(i as u64) {
                        dev.store((lba + i as u64) * lba_size, sector);
                    }
                }
            }
            LoggedOp::Zeroes { lba, count } => {
                for i in 0..*count {
                    if keep(i) {
                        let _ = dev.write_zeroes(lba + i, 1);
                    }
                }
            }
            LoggedOp::Flush => {}
        }
    }

    /// A copy of `base` with `ops` applied in order.
    pub fn replay<'a>(base: &MemDevice, ops: impl IntoIterator<Item = &'a LoggedOp>) -> MemDevice {
        let dev = base.duplicate();
        for op in ops {
            Self::apply(&dev, op);
        }
        dev
    }
}

impl BlockDevice for CrashDevice {
    fn lba_size(&self) -> u32 {
        self.inner.lba_size()
    }

    fn lba_count(&self) -> u64 {
        self.inner.lba_count()
    }

    fn read(&self, reqs: &mut [ReadReq<'_>]) -> Result<(), DeviceError> {
        self.inner.read(reqs)
    }

    fn write(&self, reqs: &[WriteReq<'_>]) -> Result<(), DeviceError> {
        self.inner.write(reqs)?;
        for r in reqs {
            self.record(LoggedOp::Write {
                lba: r.lba,
                data: r.buf.to_vec(),
            });
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), DeviceError> {
        self.inner.flush()?;
        self.record(LoggedOp::Flush);
        Ok(())
    }

    fn write_zeroes(&self, lba: u64, count: u64) -> Result<(), DeviceError> {
        self.inner.write_zeroes(lba, count)?;
        self.record(LoggedOp::Zeroes { lba, count });
        Ok(())
    }

    fn describe(&self) -> String {
        format!("crash-recording {}", self.inner.describe())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn records_and_replays_prefixes_and_torn_writes() {
        let dev = CrashDevice::new(MemDevice::new(512, 16));
        dev.write(&[WriteReq {
            lba: 0,
            buf: &[1u8; 512],
        }])
        .unwrap();
        let base = dev.start_recording();
        dev.write(&[
            WriteReq {
                lba: 1,
                buf: &[2u8; 1024],
            },
            WriteReq {
                lba: 4,
                buf: &[3u8; 512],
            },
        ])
        .unwrap();
        dev.flush().unwrap();
        dev.write_zeroes(0, 1).unwrap();
        let log = dev.take_log();
        assert_eq!(log.len(), 4);
        assert_eq!(log[2], LoggedOp::Flush);
        assert_eq!(log[3], LoggedOp::Zeroes { lba: 0, count: 1 });

        let img = CrashDevice::replay(&base, &log[..1]).to_image();
        assert_eq!(img[0], 1);
        assert_eq!(img[512], 2);
        assert_eq!(img[4 * 512], 0);

        let torn = CrashDevice::replay(&base, &log[..0]);
        CrashDevice::apply_torn(&torn, &log[0], |i| i == 1);
        let img = torn.to_image();
        assert_eq!((img[512], img[1024]), (0, 2));

        let all = CrashDevice::replay(&base, &log).to_image();
        assert_eq!((all[0], all[4 * 512]), (0, 3));
        assert_eq!(dev.inner().to_image(), all);
    }
}
