//! Whole-file CRC-32C computed from pieces that arrive out of order, from several threads: the
//! device lanes of [`crate::File::write_from`] and [`crate::File::read_to`] each handle a part
//! of the range, so the checksum is taken per part as the bytes pass and combined afterwards
//! (`crc32c_combine`), with no second pass over the data.

use std::sync::Mutex;

use crate::device::{DataSink, DataSource};

/// CRC-32C of pieces of a byte range, each recorded once as it passes, combined in offset order
/// by [`Crc32cPieces::finish`]. As a [`DataSink`] it keeps nothing but the checksums (what
/// [`crate::FileSystem::verify_data`] reads into).
#[derive(Debug, Default)]
pub struct Crc32cPieces {
    /// `(offset, len, crc)` of each piece.
    pieces: Mutex<Vec<(u64, u64, u32)>>,
}

impl Crc32cPieces {
    /// No pieces yet.
    pub fn new() -> Self {
        Self::default()
    }

    /// Records the bytes at `offset`.
    pub fn add(&self, offset: u64, bytes: &[u8]) {
        let crc = crc32c::crc32c(bytes);
        self.pieces.lock().unwrap_or_else(|e| e.into_inner()).push((
            offset,
            bytes.len() as u64,
            crc,
        ));
    }

    /// The CRC-32C of bytes `start..start + len`, if the pieces recorded cover exactly that
    /// range (a piece recorded twice, as a retried read would, counts once); `None` if bytes
    /// are missing or pieces overlap differently.
    pub fn finish(&self, start: u64, len: u64) -> Option<u32> {
        let mut pieces = self
            .pieces
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .clone();
        pieces.sort_unstable();
        pieces.dedup();
        let mut at = start;
        let mut crc = 0u32;
        for (off, n, c) in pieces {
            if n == 0 {
                continue;
            }
            if off != at {
                return None;
            }
            crc = crc32c::crc32c_combine(crc, c, usize::try_from(n).ok()?);
            at += n;
        }
        (at == start + len).then_some(crc)
    }
}

impl DataSink for Crc32cPieces {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.add(offset, buf);
        Ok(())
    }
}

/// A [`DataSource`] that checksums what is read from it: the CRC of exactly the bytes handed to
/// the device, for [`crate::File::set_data_crc`].
pub struct ChecksummedSource<'a> {
    inner: &'a dyn DataSource,
    pieces: &'a Crc32cPieces,
}

impl<'a> ChecksummedSource<'a> {
    /// Reads from `inner`, recording every piece read in `pieces`.
    pub fn new(inner: &'a dyn DataSource, pieces: &'a Crc32cPieces) -> Self {
        Self { inner, pieces }
    }
}

impl DataSource for ChecksummedSource<'_> {
    fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
        self.inner.read_exact_at(buf, offset)?;
        self.pieces.add(offset, buf);
        Ok(())
    }
}

/// A [`DataSink`] that checksums what is written to it: the CRC of exactly the bytes the
/// device delivered, to compare with the recorded one.
pub struct ChecksummedSink<'a> {
    inner: &'a dyn DataSink,
    pieces: &'a Crc32cPieces,
}

impl<'a> ChecksummedSink<'a> {
    /// Writes to `inner`, recording every piece written in `pieces`.
    pub fn new(inner: &'a dyn DataSink, pieces: &'a Crc32cPieces) -> Self {
        Self { inner, pieces }
    }
}

impl DataSink for ChecksummedSink<'_> {
    fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
        self.pieces.add(offset, buf);
        self.inner.write_all_at(buf, offset)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pieces_in_any_order_give_the_whole_crc() {
        let data: Vec<u8> = (0..10_000u32).map(|i| (i * 7 + i / 13) as u8).collect();
        let p = Crc32cPieces::new();
        for (a, b) in [
            (4096, 9000),
            (0, 512),
            (9000, 10_000),
            (512, 4096),
            (0, 512),
        ] {
            p.add(a as u64, &data[a..b]);
        }
        assert_eq!(p.finish(0, 10_000), Some(crc32c::crc32c(&data)));
        // A gap or a short range is no checksum.
        assert_eq!(p.finish(0, 10_001), None);
        let q = Crc32cPieces::new();
        q.add(0, &data[..100]);
        q.add(200, &data[200..300]);
        assert_eq!(q.finish(0, 300), None);
        // Nothing at all is the empty range's CRC.
        assert_eq!(Crc32cPieces::new().finish(0, 0), Some(crc32c::crc32c(&[])));
        // Through a source and a sink.
        let r = Crc32cPieces::new();
        let src = ChecksummedSource::new(&data, &r);
        let mut buf = vec![0u8; 3000];
        src.read_exact_at(&mut buf, 7000).unwrap();
        src.read_exact_at(&mut buf, 0).unwrap();
        assert_eq!(
            r.finish(7000, 3000),
            None,
            "pieces outside the range are refused"
        );
        let out = std::sync::Mutex::new(Vec::new());
        let s = Crc32cPieces::new();
        let sink = ChecksummedSink::new(&out, &s);
        sink.write_all_at(&data[5000..], 5000).unwrap();
        sink.write_all_at(&data[..5000], 0).unwrap();
        assert_eq!(s.finish(0, 10_000), Some(crc32c::crc32c(&data)));
        assert_eq!(*out.lock().unwrap(), data);
    }
}
