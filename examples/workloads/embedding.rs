//! Embedding lookups for the page cache: a table of `rows` rows of `dim` `u32` words whose
//! bytes are the verification pattern of 4 KiB blocks ([`gpunvme::pattern`] with [`TABLE_NSID`]),
//! so any gathered row can be checked without a host copy of the table; Zipf-distributed row
//! indices (the skew of real embedding traffic); and the GPU gather (`gpunvme_cache_gather`: a
//! warp per lookup, warp-wide `read_range`).

use std::time::Instant;

use anyhow::{Result, ensure};
use gpu_queues::GpuQueues;
use gpu_queues::ffi::{Arg, DeviceMemory};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use zerocopy::IntoBytes;

use super::{Source, grid_for, wait};

/// The pattern's block size for the table's bytes.
pub const TABLE_BLOCK: u64 = 4096;
/// The namespace field of the table's pattern.
pub const TABLE_NSID: u32 = 1;

/// Fills `buf` with the table's bytes from byte `first` (a multiple of [`TABLE_BLOCK`]; `buf`
/// whole blocks).
pub fn table_bytes(seed: u64, first: u64, buf: &mut [u8]) {
    gpunvme::pattern::fill(
        buf,
        seed,
        TABLE_NSID,
        first / TABLE_BLOCK,
        TABLE_BLOCK as usize,
    );
}

/// The table's `u32` word `j` (word `w` of row `r` is `j = r * dim + w`).
pub fn table_word(seed: u64, j: u64) -> u32 {
    let byte = j * 4;
    let w = gpunvme::pattern::word(
        seed,
        TABLE_NSID,
        byte / TABLE_BLOCK,
        ((byte % TABLE_BLOCK) / 8) as usize,
    );
    (w >> ((byte & 4) * 8)) as u32
}

/// `n` row indices below `rows`, Zipf-distributed with exponent `s` (rank k drawn with weight
/// `1 / k^s`), ranks spread over the table by a bijection so that the hot rows are not
/// adjacent. The same seed gives the same stream.
pub fn zipf_indices(rows: u64, n: usize, s: f64, seed: u64) -> Result<Vec<u64>> {
    ensure!(rows > 0 && rows <= 1 << 28, "rows {rows}: 1 to 2^28");
    ensure!(s >= 0.0 && s.is_finite(), "Zipf exponent {s}");
    let mut cdf = Vec::with_capacity(rows as usize);
    let mut total = 0.0f64;
    for k in 1..=rows {
        total += (k as f64).powf(-s);
        cdf.push(total);
    }
    // A multiplier coprime to rows: rank -> (rank * m) % rows is a bijection.
    let mut m = (0x9e37_79b9u64 % rows.max(2)) | 1;
    while gcd(m, rows) != 1 {
        m += 2;
    }
    let mut rng = SmallRng::seed_from_u64(seed);
    Ok((0..n)
        .map(|_| {
            let u: f64 = rng.random::<f64>() * total;
            let rank = cdf.partition_point(|&c| c < u).min(rows as usize - 1) as u64;
            (rank as u128 * m as u128 % rows as u128) as u64
        })
        .collect())
}

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

/// The outcome of a GPU gather.
#[derive(Clone, Debug)]
pub struct GatherRun {
    /// The gathered rows, lookup k at `k * dim`.
    pub out: Vec<u32>,
    /// Seconds of the gather kernel.
    pub secs: f64,
}

/// Gathers rows `idx` of a table of `dim`-word rows read from `src` (array 0) on the GPU
/// (`gpunvme_cache_gather` on the client stream). Fails if any row's read failed.
pub fn gpu_gather(q: &GpuQueues, src: Source<'_>, dim: u32, idx: &[u64]) -> Result<GatherRun> {
    ensure!(dim > 0, "dim 0");
    let cuda = q.cuda();
    let n = idx.len();
    let words = n * dim as usize;
    let idx_mem = DeviceMemory::alloc(cuda, n.max(1) * 8)?;
    idx_mem.write(0, idx.as_bytes())?;
    let out = DeviceMemory::alloc(cuda, words.max(1) * 4)?;
    let errors = DeviceMemory::alloc(cuda, 8)?;
    let (cache, range, plain) = src.array(0);
    // The tools' kernel (its module loaded at the first use, before the clock starts).
    let gather = q.kernels().tools()?.cache_gather;
    let start = Instant::now();
    q.client_stream().launch(
        gather,
        grid_for(q, n as u64),
        super::BLOCK,
        &[
            Arg::U64(cache),
            Arg::U32(range),
            Arg::U64(plain),
            Arg::U32(dim),
            Arg::U64(idx_mem.ptr()),
            Arg::U64(n as u64),
            Arg::U64(out.ptr()),
            Arg::U64(errors.ptr()),
        ],
    )?;
    wait(q, "the gather")?;
    let secs = start.elapsed().as_secs_f64();
    let mut bad = 0u64;
    errors.read(0, bad.as_mut_bytes())?;
    ensure!(
        bad == 0,
        "{bad} of {n} row reads failed on the GPU{}",
        src.failure_detail()
    );
    let mut rows = vec![0u32; words];
    out.read(0, rows.as_mut_bytes())?;
    Ok(GatherRun { out: rows, secs })
}

/// The first gathered word that is not the table's: (lookup, word, got, want).
pub fn first_mismatch(
    out: &[u32],
    idx: &[u64],
    dim: u32,
    seed: u64,
) -> Option<(usize, u32, u32, u32)> {
    for (k, &r) in idx.iter().enumerate() {
        for w in 0..dim {
            let got = out[k * dim as usize + w as usize];
            let want = table_word(seed, r * dim as u64 + w as u64);
            if got != want {
                return Some((k, w, got, want));
            }
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_words_are_the_table_bytes() {
        let mut buf = vec![0u8; 2 * TABLE_BLOCK as usize];
        table_bytes(5, TABLE_BLOCK, &mut buf);
        for j in [0u64, 1, 2, 1023, 1024, 2047] {
            let at = j as usize * 4;
            let le = u32::from_le_bytes(buf[at..at + 4].try_into().unwrap());
            assert_eq!(table_word(5, 1024 + j), le, "word {j}");
        }
    }

    #[test]
    fn zipf_is_seeded_in_range_and_skewed() {
        let a = zipf_indices(10_000, 50_000, 0.99, 3).unwrap();
        assert_eq!(a, zipf_indices(10_000, 50_000, 0.99, 3).unwrap());
        assert!(a.iter().all(|&r| r < 10_000));
        let mut count = std::collections::HashMap::new();
        for &r in &a {
            *count.entry(r).or_insert(0u32) += 1;
        }
        let hottest = *count.values().max().unwrap();
        // Rank 1 has about 1 / H(10^4, .99) ~ 10 % of the draws; uniform would be 5.
        assert!(hottest > 2_000, "hottest row drawn {hottest} times");
        assert!(count.len() > 2_000, "{} distinct rows", count.len());
        assert!(zipf_indices(0, 1, 0.99, 1).is_err());
    }
}
