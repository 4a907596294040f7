//! Stripes: namespace media cut into pieces of [`STRIPE`] bytes, each behind its own lock, so
//! that controller threads read and write different parts of one namespace at once (memory
//! namespaces, and image files read through a mapping).

/// Bytes per lock (and per mapping) of a memory namespace.
pub(crate) const STRIPE: usize = 2 << 20;

/// The stripe holding all of `offset..offset + len`, and the offset in it; `None` when the
/// range spans stripes.
pub(crate) fn stripe_single(offset: u64, len: usize) -> Option<(usize, usize)> {
    let (i, at) = (
        (offset / STRIPE as u64) as usize,
        (offset % STRIPE as u64) as usize,
    );
    (at + len <= STRIPE).then_some((i, at))
}

/// Calls `f(stripe index, offset in the stripe, offset in the range, length)` for each piece
/// of `offset..offset + len` that lies in one stripe, in order.
pub(crate) fn stripe_pieces(offset: u64, len: u64, mut f: impl FnMut(usize, usize, usize, usize)) {
    let mut done = 0u64;
    while done < len {
        let at = offset + done;
        let (i, off) = ((at / STRIPE as u64) as usize, (at % STRIPE as u64) as usize);
        let n = (len - done).min((STRIPE - off) as u64) as usize;
        f(i, off, done as usize, n);
        done += n as u64;
    }
}

/// Media whose bytes are read in place, a stripe at a time under its lock (memory, and
/// mapped images).
pub(crate) trait StripedBytes {
    /// Calls `f` with the bytes at `offset..offset + len` (inside the media) under its
    /// stripe's read lock; `None` (without calling `f`) when the range spans stripes.
    fn with_bytes<R>(&self, offset: u64, len: usize, f: impl FnOnce(&[u8]) -> R) -> Option<R>;

    /// Copies the bytes at `offset` (inside the media) into `out`, a stripe at a time.
    fn read_into(&self, offset: u64, out: &mut [u8]);
}
