//! Verification patterns: bytes that are a pure function of (seed, namespace, LBA, offset) — the
//! same function as `gpunvme::pattern_word` in ptx/include/gpunvme.cuh, so CPU and GPU check each
//! other's bytes.
//!
//! Because a block's content depends only on where it lives, concurrent or repeated writes of
//! the same LBA always carry the same bytes, so any later read can be checked without knowing
//! which write landed last.
#![forbid(unsafe_code)]

/// SplitMix64 finaliser: a cheap, well-mixed 64-bit hash.
fn mix(mut z: u64) -> u64 {
    z = z.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// The 8-byte word `word_index` of block `lba` (little-endian on the medium).
pub fn word(seed: u64, nsid: u32, lba: u64, word_index: usize) -> u64 {
    mix(seed ^ ((nsid as u64) << 56) ^ lba.rotate_left(20) ^ word_index as u64)
}

/// Fills `buf` (whole blocks of `lba_size` bytes, `lba_size` a multiple of 8) with the pattern
/// of the blocks starting at `first_lba`.
pub fn fill(buf: &mut [u8], seed: u64, nsid: u32, first_lba: u64, lba_size: usize) {
    debug_assert_eq!(buf.len() % lba_size, 0);
    for (b, block) in buf.chunks_exact_mut(lba_size).enumerate() {
        let lba = first_lba + b as u64;
        for (w, bytes) in block.chunks_exact_mut(8).enumerate() {
            bytes.copy_from_slice(&word(seed, nsid, lba, w).to_le_bytes());
        }
    }
}

/// Checks `buf` against the pattern; returns the LBA of the first block that differs.
pub fn check(buf: &[u8], seed: u64, nsid: u32, first_lba: u64, lba_size: usize) -> Option<u64> {
    for (b, block) in buf.chunks_exact(lba_size).enumerate() {
        let lba = first_lba + b as u64;
        for (w, bytes) in block.chunks_exact(8).enumerate() {
            if bytes != word(seed, nsid, lba, w).to_le_bytes() {
                return Some(lba);
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_then_check_and_detect_corruption() {
        let mut buf = vec![0u8; 4 * 512];
        fill(&mut buf, 7, 1, 100, 512);
        assert_eq!(check(&buf, 7, 1, 100, 512), None);
        // The same blocks seen at another LBA, with another seed or namespace, do not match.
        assert_eq!(check(&buf, 7, 1, 101, 512), Some(101));
        assert_eq!(check(&buf, 8, 1, 100, 512), Some(100));
        assert_eq!(check(&buf, 7, 2, 100, 512), Some(100));
        buf[3 * 512 + 17] ^= 1;
        assert_eq!(check(&buf, 7, 1, 100, 512), Some(103));
    }
}
