//! Namespace media: the bytes behind each namespace, in memory, in a file, or nowhere.
//!
//! Only the controller thread touches a namespace's media, so these are plain owned values.

use std::fs::File;
use std::os::unix::fs::FileExt;

use crate::config::{Backend, NamespaceConfig, open_image};
use crate::error::EmuError;
use crate::host_memory::try_zeroed_bytes;

/// Zeroes written per call when zeroing a range of a file.
const ZERO_CHUNK: usize = 1 << 20;

/// A namespace's media.
pub(crate) enum Media {
    /// In memory.
    Memory(Box<[u8]>),
    /// In an image file.
    File(File),
    /// Nowhere: reads and writes move no data.
    Null,
}

/// An active namespace.
pub(crate) struct Namespace {
    /// Size in logical blocks (NSZE).
    pub(crate) blocks: u64,
    /// Logical block size in bytes.
    pub(crate) lba_size: u32,
    /// log2 of `lba_size`.
    pub(crate) lba_shift: u32,
    pub(crate) media: Media,
}

impl Namespace {
    /// Opens or allocates the media for namespace `nsid` (the config is already validated).
    pub(crate) fn open(nsid: u32, config: &NamespaceConfig) -> Result<Self, EmuError> {
        let bytes = config.bytes();
        let media = match &config.backend {
            Backend::Memory => {
                let len = usize::try_from(bytes)
                    .map_err(|_| EmuError::AllocateNamespace { nsid, bytes })?;
                Media::Memory(
                    try_zeroed_bytes(len).ok_or(EmuError::AllocateNamespace { nsid, bytes })?,
                )
            }
            Backend::File(path) => Media::File(open_image(nsid, path, bytes)?),
            Backend::Null => Media::Null,
        };
        Ok(Self {
            blocks: config.blocks,
            lba_size: config.lba_size,
            lba_shift: config.lba_size.trailing_zeros(),
            media,
        })
    }

    /// Whether the media is a file (whose writes need syncing for durability).
    pub(crate) fn is_file(&self) -> bool {
        matches!(self.media, Media::File(_))
    }

    /// Makes every completed write durable.
    pub(crate) fn flush(&self) -> std::io::Result<()> {
        match &self.media {
            Media::File(f) => f.sync_data(),
            Media::Memory(_) | Media::Null => Ok(()),
        }
    }

    /// Fills `len` bytes at byte offset `offset` with zeroes (the range is inside the media).
    pub(crate) fn zero(&mut self, offset: u64, len: u64) -> std::io::Result<()> {
        match &mut self.media {
            Media::Memory(m) => {
                m[offset as usize..(offset + len) as usize].fill(0);
                Ok(())
            }
            Media::File(f) => {
                static ZEROES: [u8; ZERO_CHUNK] = [0; ZERO_CHUNK];
                let mut done = 0;
                while done < len {
                    let n = (len - done).min(ZERO_CHUNK as u64) as usize;
                    f.write_all_at(&ZEROES[..n], offset + done)?;
                    done += n as u64;
                }
                Ok(())
            }
            Media::Null => Ok(()),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn file_zero_and_flush() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, vec![0xaau8; 8192]).unwrap();
        let cfg = NamespaceConfig {
            backend: Backend::File(path.clone()),
            blocks: 16,
            lba_size: 512,
        };
        let mut ns = Namespace::open(1, &cfg).unwrap();
        assert!(ns.is_file());
        ns.zero(512, 1024).unwrap();
        ns.flush().unwrap();
        let bytes = std::fs::read(&path).unwrap();
        assert!(bytes[..512].iter().all(|&b| b == 0xaa));
        assert!(bytes[512..1536].iter().all(|&b| b == 0));
        assert!(bytes[1536..].iter().all(|&b| b == 0xaa));
        // A file shorter than the namespace is refused.
        let big = NamespaceConfig { blocks: 17, ..cfg };
        assert!(matches!(
            Namespace::open(1, &big),
            Err(EmuError::InvalidImage { .. })
        ));
    }
}
