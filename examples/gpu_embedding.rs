//! Embedding lookups on the GPU from a table stored in blockfs, read through the GPU page cache
//! (`gpunvme::array<T>::read_range`): the skewed row traffic of recommendation and retrieval
//! models, with the table larger than the cache.
//!
//! ```text
//! cargo run --release --example gpu_embedding -- [--rows 1M] [--dim 64] [--lookups 1M]
//!     [--cache 10%,25%,50%] [--baselines] [--controller emu|gpu] [--ssd-model drives=4] [--json]
//! ```
//!
//! The table (`--rows` rows of `--dim` `u32` words) is a blockfs file whose bytes are the
//! verification pattern of their position, written by the CPU; the lookups are Zipf(0.99)
//! row indices (seeded). For each `--cache` capacity a new cache binds the file and one kernel
//! gathers every looked-up row (a warp per lookup, `gpunvme_cache_gather`); every gathered
//! word is checked against the pattern or the example fails. `--baselines` runs the same kernel
//! over the table wholly in GPU memory, in unified memory, and in unified memory with free GPU
//! memory limited to the first capacity. Without a GPU prints "skipped: no GPU" and exits 0.

mod common;
mod workloads;

use anyhow::{Context, Result, ensure};
use clap::Parser;
use gpunvme::blockfs_gpu::{GpuFiles, GpuFilesOptions};
use gpunvme::gpu_cache::bind_file;
use gpunvme::units::parse_size;
use serde_json::json;
use workloads::embedding;
use workloads::{Placement, Source};

use common::{CacheArgs, DeviceArgs, verify};

const TABLE: &str = "examples/embedding/table.u32";

/// Embedding gathers from a blockfs-resident table through the GPU page cache, checked.
#[derive(Parser, Debug)]
struct Args {
    /// Rows of the table.
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    rows: u64,
    /// `u32` words per row.
    #[arg(long, default_value_t = 64)]
    dim: u32,
    /// Rows looked up (Zipf-distributed).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    lookups: u64,
    /// Zipf exponent of the lookups.
    #[arg(long, default_value_t = 0.99)]
    zipf: f64,
    /// Table and lookup seed.
    #[arg(long, default_value_t = 7)]
    seed: u64,
    #[command(flatten)]
    cache: CacheArgs,
    #[command(flatten)]
    dev: DeviceArgs,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(_cuda) = common::gpu_or_skip("gpu_embedding", &args.dev.gpu_id)? else {
        return Ok(());
    };
    ensure!(
        args.dim > 0 && args.rows > 0,
        "--rows and --dim must be positive"
    );
    let bytes = args
        .rows
        .checked_mul(args.dim as u64 * 4)
        .context("table size")?;
    let idx = embedding::zipf_indices(
        args.rows,
        usize::try_from(args.lookups)?,
        args.zipf,
        args.seed,
    )?;
    let distinct = {
        let mut d = idx.clone();
        d.sort_unstable();
        d.dedup();
        d.len()
    };
    println!(
        "table: {} rows x {} words ({bytes} bytes); {} Zipf({}) lookups of {distinct} distinct rows",
        args.rows, args.dim, args.lookups, args.zipf
    );
    let capacities = args.cache.capacities(bytes)?;
    let opened = common::open("gpu_embedding", &args.dev, bytes)?;
    let seed = args.seed;
    let (table, _) = common::write_file_with(&opened.fs, TABLE, bytes, &|at, buf| {
        embedding::table_bytes(seed, at, buf)
    })?;
    let setup = opened.gpu(&args.dev)?;
    let q = &setup.queues;
    let row_bytes = args.dim as u64 * 4;
    let row = |mode: &str, secs: f64, extra: serde_json::Value| {
        let r = json!({
            "workload": "embedding", "mode": mode, "rows": args.rows, "dim": args.dim,
            "data_bytes": bytes, "lookups": args.lookups, "distinct_rows": distinct,
            "zipf": args.zipf, "seconds": secs,
            "lookups_per_s": args.lookups as f64 / secs,
            "gathered_gb_per_s": (args.lookups * row_bytes) as f64 / secs / 1e9,
            "controller": format!("{:?}", args.dev.controller).to_lowercase(),
            "ssd_model": args.dev.ssd_model.map(|m| m.describe()),
            "transport": setup.transport,
        });
        common::with_fields(r, extra)
    };
    let report = |r: &serde_json::Value| {
        let rate = r["lookups_per_s"].as_f64().unwrap_or(0.0);
        args.cache
            .report(r, "table", &format!("{rate:.3e} lookups/s"));
    };
    let mut rows = Vec::new();
    let result = (|| -> Result<()> {
        let files = GpuFiles::new(q, GpuFilesOptions::from_env()?);
        let gtable = files.open(&table)?;
        for &(capacity, pct) in &capacities {
            let mut cache = args.cache.new_cache(q, capacity)?;
            let range = [bind_file(&mut cache, &gtable)?];
            let run = embedding::gpu_gather(q, Source::Cache(&cache, &range), args.dim, &idx)?;
            check(
                &run,
                &idx,
                args.dim,
                seed,
                &format!("cache of {capacity} bytes"),
            )?;
            rows.push(row(
                "cache",
                run.secs,
                CacheArgs::cache_fields(&cache, capacity, pct)?,
            ));
            report(rows.last().expect("a row"));
        }
        if args.cache.baselines {
            // The run's own buffers (indices, gathered rows; 8 MiB for rounding).
            let headroom = args.lookups * (row_bytes + 8) + (8 << 20);
            for placement in [
                Placement::GpuMemory,
                Placement::Unified,
                Placement::UnifiedOversubscribed(capacities[0].0),
            ] {
                let placed = workloads::place(
                    q,
                    &[bytes],
                    &|_, at, buf| embedding::table_bytes(seed, at, buf),
                    placement,
                    headroom,
                )?;
                let run = embedding::gpu_gather(q, Source::Plain(&placed.ptrs), args.dim, &idx)?;
                check(&run, &idx, args.dim, seed, placement.name())?;
                rows.push(row(
                    placement.name(),
                    run.secs,
                    json!({ "gpu_free_bytes": placed.gpu_free_bytes }),
                ));
                report(rows.last().expect("a row"));
            }
        }
        Ok(())
    })();
    let down = common::gpu_down(setup);
    result?;
    down?;
    println!(
        "verified: every gathered word equals the table's in {} runs",
        rows.len()
    );
    println!("gpu_embedding: OK");
    Ok(())
}

/// Fails unless every gathered word is the table's.
fn check(run: &embedding::GatherRun, idx: &[u64], dim: u32, seed: u64, what: &str) -> Result<()> {
    let bad = embedding::first_mismatch(&run.out, idx, dim, seed);
    verify(bad.is_none(), || {
        let (k, w, got, want) = bad.unwrap_or_default();
        format!(
            "{what}: lookup {k} (row {}) word {w} is {got:#x}, the table holds {want:#x}",
            idx[k]
        )
    })
}
