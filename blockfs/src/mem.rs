//! [`MemDevice`]: a block device in memory, sparse, for tests, fuzzing and the crash test.

use std::sync::RwLock;

use crate::device::{BlockDevice, DeviceError, ReadReq, WriteReq, check_request};

/// Bytes per storage chunk; chunks never written (or zeroed whole) take no memory.
const CHUNK: usize = 1 << 20;

/// A block device held in memory. Unwritten space reads as zeroes and costs nothing, so tests can
/// make devices of many GiB and write only a little of them. It has no volatile cache: a write is
/// durable once it completes, and [`BlockDevice::flush`] does nothing (see [`crate::CrashDevice`]
/// for a device that models the cache).
pub struct MemDevice {
    lba_size: u32,
    lba_count: u64,
    chunks: RwLock<Vec<Option<Box<[u8]>>>>,
}

impl std::fmt::Debug for MemDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MemDevice")
            .field("lba_size", &self.lba_size)
            .field("lba_count", &self.lba_count)
            .finish()
    }
}

impl MemDevice {
    /// A zeroed device of `lba_count` LBAs of `lba_size` bytes.
    ///
    /// # Panics
    /// If `lba_size` is not a power of two between 512 and 1 MiB (a caller bug).
    pub fn new(lba_size: u32, lba_count: u64) -> Self {
        assert!(
            lba_size.is_power_of_two() && (512..=CHUNK as u32).contains(&lba_size),
            "LBA size {lba_size} must be a power of two in 512..=1MiB"
        );
        let bytes = lba_count * lba_size as u64;
        let nchunks = bytes.div_ceil(CHUNK as u64) as usize;
        Self {
            lba_size,
            lba_count,
            chunks: RwLock::new(vec![None; nchunks]),
        }
    }

    /// A device holding `image`; a trailing partial LBA is dropped (a truncated image).
    pub fn from_image(image: &[u8], lba_size: u32) -> Self {
        let lba_count = image.len() as u64 / lba_size as u64;
        let dev = Self::new(lba_size, lba_count);
        let len = (lba_count * lba_size as u64) as usize;
        dev.store(0, &image[..len]);
        dev
    }

    /// The whole device as one byte vector.
    pub fn to_image(&self) -> Vec<u8> {
        let mut out = vec![0u8; self.byte_len() as usize];
        self.load(0, &mut out);
        out
    }

    /// Device size in bytes.
    pub fn byte_len(&self) -> u64 {
        self.lba_count * self.lba_size as u64
    }

    /// Copies the device (only the chunks that hold data).
    pub fn duplicate(&self) -> Self {
        let chunks = self
            .chunks
            .read()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        Self {
            lba_size: self.lba_size,
            lba_count: self.lba_count,
            chunks: RwLock::new(chunks),
        }
    }

    /// Reads bytes at a byte offset (inside the device), bypassing LBA checks.
    pub fn load(&self, offset: u64, out: &mut [u8]) {
        let chunks = self.chunks.read().unwrap_or_else(|e| e.into_inner());
        let mut done = 0usize;
        while done < out.len() {
            let pos = offset + done as u64;
            let ci = (pos / CHUNK as u64) as usize;
            let co = (pos % CHUNK as u64) as usize;
            let n = (CHUNK - co).min(out.len() - done);
            match &chunks[ci] {
                Some(c) => out[done..done + n].copy_from_slice(&c[co..co + n]),
                None => out[done..done + n].fill(0),
            }
            done += n;
        }
    }

    /// Writes bytes at a byte offset (inside the device), bypassing LBA checks: the crash test
    /// uses it to apply logged writes and torn sectors.
    pub fn store(&self, offset: u64, data: &[u8]) {
        let mut chunks = self.chunks.write().unwrap_or_else(|e| e.into_inner());
        let mut done = 0usize;
        while done < data.len() {
            let pos = offset + done as u64;
            let ci = (pos / CHUNK as u64) as usize;
            let co = (pos % CHUNK as u64) as usize;
            let n = (CHUNK - co).min(data.len() - done);
            let src = &data[done..done + n];
            let slot = &mut chunks[ci];
            if slot.is_none() && src.iter().all(|&b| b == 0) {
                // Zeroes into an absent chunk: nothing to store.
            } else {
                let c = slot.get_or_insert_with(|| vec![0u8; CHUNK].into_boxed_slice());
                c[co..co + n].copy_from_slice(src);
            }
            done += n;
        }
    }

    fn zero(&self, offset: u64, len: u64) {
        let mut chunks = self.chunks.write().unwrap_or_else(|e| e.into_inner());
        let mut done = 0u64;
        while done < len {
            let pos = offset + done;
            let ci = (pos / CHUNK as u64) as usize;
            let co = (pos % CHUNK as u64) as usize;
            let n = ((CHUNK - co) as u64).min(len - done) as usize;
            if co == 0 && n == CHUNK {
                chunks[ci] = None;
            } else if let Some(c) = &mut chunks[ci] {
                c[co..co + n].fill(0);
            }
            done += n as u64;
        }
    }
}

impl BlockDevice for MemDevice {
    fn lba_size(&self) -> u32 {
        self.lba_size
    }

    fn lba_count(&self) -> u64 {
        self.lba_count
    }

    fn read(&self, reqs: &mut [ReadReq<'_>]) -> Result<(), DeviceError> {
        for r in reqs.iter() {
            check_request(r.lba, r.buf.len(), self.lba_size, self.lba_count)?;
        }
        for r in reqs.iter_mut() {
            self.load(r.lba * self.lba_size as u64, r.buf);
        }
        Ok(())
    }

    fn write(&self, reqs: &[WriteReq<'_>]) -> Result<(), DeviceError> {
        for r in reqs {
            check_request(r.lba, r.buf.len(), self.lba_size, self.lba_count)?;
        }
        for r in reqs {
            self.store(r.lba * self.lba_size as u64, r.buf);
        }
        Ok(())
    }

    fn flush(&self) -> Result<(), DeviceError> {
        Ok(())
    }

    fn write_zeroes(&self, lba: u64, count: u64) -> Result<(), DeviceError> {
        let len = count
            .checked_mul(self.lba_size as u64)
            .and_then(|l| usize::try_from(l).ok())
            .ok_or(DeviceError::OutOfRange {
                lba,
                end: lba.saturating_add(count),
                blocks: self.lba_count,
            })?;
        check_request(lba, len, self.lba_size, self.lba_count)?;
        self.zero(lba * self.lba_size as u64, count * self.lba_size as u64);
        Ok(())
    }

    fn describe(&self) -> String {
        format!(
            "memory device, {} LBAs of {} bytes",
            self.lba_count, self.lba_size
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sparse_reads_zero_and_round_trips_across_chunks() {
        let dev = MemDevice::new(512, 3 * (CHUNK as u64 / 512));
        let mut buf = vec![0xAAu8; 1024];
        dev.read(&mut [ReadReq {
            lba: 5,
            buf: &mut buf,
        }])
        .unwrap();
        assert!(buf.iter().all(|&b| b == 0));
        let data: Vec<u8> = (0..3 * 512).map(|i| i as u8).collect();
        let lba = CHUNK as u64 / 512 - 1; // straddles chunks 0 and 1
        dev.write(&[WriteReq { lba, buf: &data }]).unwrap();
        let mut back = vec![0u8; data.len()];
        dev.read(&mut [ReadReq {
            lba,
            buf: &mut back,
        }])
        .unwrap();
        assert_eq!(back, data);
        dev.write_zeroes(lba + 1, 1).unwrap();
        dev.read(&mut [ReadReq {
            lba,
            buf: &mut back,
        }])
        .unwrap();
        assert_eq!(&back[..512], &data[..512]);
        assert!(back[512..1024].iter().all(|&b| b == 0));
        assert_eq!(&back[1024..], &data[1024..]);
    }

    #[test]
    fn rejects_out_of_range_and_misaligned() {
        let dev = MemDevice::new(512, 8);
        let mut buf = vec![0u8; 1024];
        assert!(matches!(
            dev.read(&mut [ReadReq {
                lba: 7,
                buf: &mut buf
            }]),
            Err(DeviceError::OutOfRange {
                lba: 7,
                end: 9,
                blocks: 8
            })
        ));
        assert!(matches!(
            dev.write(&[WriteReq {
                lba: 0,
                buf: &buf[..100]
            }]),
            Err(DeviceError::Misaligned {
                len: 100,
                lba_size: 512
            })
        ));
        assert!(matches!(
            dev.write_zeroes(u64::MAX, 2),
            Err(DeviceError::OutOfRange { .. })
        ));
    }
}
