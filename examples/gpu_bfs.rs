//! Breadth-first search on the GPU over a graph stored in blockfs, read through the GPU page
//! cache (`gpunvme::array<T>`): BaM's programming model on data larger than the cache.
//!
//! ```text
//! cargo run --release --example gpu_bfs -- [--scale 20] [--cache 10%,25%,50%] [--baselines]
//!     [--split dynamic|dynamic:N|static] [--hub-segment 16384|0] [--sweep alternate|up]
//!     [--direction optimizing|top-down] [--controller emu|gpu] [--ssd-model drives=4] [--json]
//! ```
//!
//! A seeded R-MAT graph (Graph500's a, b, c = .57, .19, .19; `2^scale` vertices, edge factor
//! 16, undirected) is built on the CPU and stored as two blockfs files in CSR form: `u64` row
//! offsets and `u32` column indices. For each `--cache` capacity a new cache binds both files
//! and one kernel per level runs the BFS from a seeded root (a warp per frontier vertex,
//! `gpunvme_cache_bfs_level`; late levels bottom-up, `gpunvme_cache_bfs_up`: each unvisited
//! vertex looks for a neighbour in the frontier); every vertex's level must equal the CPU BFS's or the example
//! fails. `--baselines` runs the same kernel over plain pointers: the graph wholly in GPU
//! memory (the upper bound), in unified memory written by the CPU, and in unified memory with
//! free GPU memory limited to the first capacity (BaM's comparison). Times are the level
//! kernels' from the root's launch to the last level's end; the cache starts empty. Without a
//! GPU prints "skipped: no GPU" and exits 0.

mod common;
mod workloads;

use std::time::Instant;

use anyhow::{Result, ensure};
use clap::Parser;
use gpunvme::blockfs_gpu::{GpuFiles, GpuFilesOptions};
use gpunvme::gpu_cache::bind_file;
use serde_json::json;
use workloads::graph::{self, BfsDirection, BfsOptions, BfsSplit, Csr};
use workloads::{Placement, Source};
use zerocopy::IntoBytes;

use common::{CacheArgs, DeviceArgs, verify};

const OFFSETS: &str = "examples/bfs/offsets.u64";
const COLS: &str = "examples/bfs/cols.u32";

/// BFS over a blockfs-resident graph through the GPU page cache, checked against the CPU.
#[derive(Parser, Debug)]
struct Args {
    /// log2 of the vertex count.
    #[arg(long, default_value_t = 20)]
    scale: u32,
    /// Edges per vertex (each stored both ways).
    #[arg(long, default_value_t = 16)]
    edge_factor: u32,
    /// Graph and root seed.
    #[arg(long, default_value_t = 1)]
    seed: u64,
    /// How a level's vertices are split among blocks: `dynamic` (runs of 1024 vertices drawn
    /// from a shared counter), `dynamic:N` (runs of N), or `static` (one equal run per block).
    #[arg(long, default_value = "dynamic", value_parser = parse_split)]
    split: BfsSplit,
    /// Vertices of more than this many neighbours are cut into pieces of this many that the
    /// blocks of a second kernel per level take in turn; 0: each vertex expanded by the warp
    /// that found it.
    #[arg(long, default_value_t = 16384)]
    hub_segment: u32,
    /// `alternate`: with the dynamic split, odd levels take their runs from the last vertex
    /// down, starting on the pages the level before left in the cache; `up`: every level from
    /// vertex 0 up.
    #[arg(long, default_value = "alternate", value_parser = ["alternate", "up"])]
    sweep: String,
    /// `optimizing`: a level runs bottom-up (unvisited vertices look for a neighbour in the
    /// frontier) when fewer vertices with neighbours are left unvisited than the frontier
    /// holds; `top-down`: every level expands its frontier.
    #[arg(long, default_value = "optimizing", value_parser = parse_direction)]
    direction: BfsDirection,
    #[command(flatten)]
    cache: CacheArgs,
    #[command(flatten)]
    dev: DeviceArgs,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(_cuda) = common::gpu_or_skip("gpu_bfs", &args.dev.gpu_id)? else {
        return Ok(());
    };
    let t = Instant::now();
    let g = graph::rmat(args.scale, args.edge_factor, args.seed)?;
    let root = graph::root(&g, args.seed);
    let want = graph::cpu_bfs(&g, root);
    let cpu_secs = t.elapsed().as_secs_f64();
    let reached = want.iter().filter(|&&l| l != graph::UNVISITED).count();
    // Edges the BFS traverses: every reached vertex's row (the GTEPS numerator).
    let traversed: u64 = (0..g.vertices())
        .filter(|&v| want[v as usize] != graph::UNVISITED)
        .map(|v| g.degree(v))
        .sum();
    println!(
        "graph: R-MAT scale {} edge factor {} seed {}: {} vertices, {} stored edges, {} bytes; \
         root {root} reaches {reached} (CPU generation and BFS {cpu_secs:.1} s)",
        args.scale,
        args.edge_factor,
        args.seed,
        g.vertices(),
        g.cols.len(),
        g.bytes()
    );
    let capacities = args.cache.capacities(g.bytes())?;
    let opened = common::open("gpu_bfs", &args.dev, g.bytes())?;
    let (offsets_file, _) = write_array(&opened.fs, OFFSETS, g.offsets.as_bytes())?;
    let (cols_file, _) = write_array(&opened.fs, COLS, g.cols.as_bytes())?;
    let setup = opened.gpu(&args.dev)?;
    let q = &setup.queues;
    let row = |mode: &str, secs: f64, extra: serde_json::Value| {
        let r = json!({
            "workload": "bfs", "mode": mode, "scale": args.scale,
            "edge_factor": args.edge_factor, "vertices": g.vertices(), "data_bytes": g.bytes(),
            "root": root, "reached": reached, "traversed_edges": traversed,
            "split": format!("{:?}", args.split).to_lowercase(),
            "hub_segment": args.hub_segment,
            "sweep": args.sweep,
            "direction": args.direction.name(),
            "seconds": secs, "gteps": traversed as f64 / secs / 1e9,
            "controller": format!("{:?}", args.dev.controller).to_lowercase(),
            "ssd_model": args.dev.ssd_model.map(|m| m.describe()),
            "transport": setup.transport,
        });
        common::with_fields(r, extra)
    };
    let report = |r: &serde_json::Value| {
        let gteps = r["gteps"].as_f64().unwrap_or(0.0);
        args.cache.report(r, "graph", &format!("{gteps:.3} GTEPS"));
    };
    let bfs_opts = BfsOptions {
        split: args.split,
        hub_segment: (args.hub_segment > 0).then_some(args.hub_segment),
        alternate: args.sweep == "alternate",
        direction: args.direction,
    };
    let mut rows = Vec::new();
    let result = (|| -> Result<()> {
        let files = GpuFiles::new(q, GpuFilesOptions::from_env()?);
        let gfiles = [files.open(&offsets_file)?, files.open(&cols_file)?];
        for &(capacity, pct) in &capacities {
            let mut cache = args.cache.new_cache(q, capacity)?;
            let ranges = [
                bind_file(&mut cache, &gfiles[0])?,
                bind_file(&mut cache, &gfiles[1])?,
            ];
            let run = graph::gpu_bfs(
                q,
                Source::Cache(&cache, &ranges),
                g.vertices(),
                root,
                bfs_opts,
            )?;
            check(&run, &want, &format!("cache of {capacity} bytes"))?;
            let fields = CacheArgs::cache_fields(&cache, capacity, pct)?;
            rows.push(row(
                "cache",
                run.secs,
                common::with_fields(
                    fields,
                    json!({
                        "depth": run.depth,
                        "level_ms": level_ms(&run),
                        "bottom_up": run.bottom_up,
                        "hub_pieces": run.hub_pieces,
                    }),
                ),
            ));
            report(rows.last().expect("a row"));
        }
        if args.cache.baselines {
            // The run's own buffers (levels, two frontiers; 8 MiB for counters and rounding)
            // beside the oversubscribed limit.
            let headroom = g.vertices() as u64 * 12 + (8 << 20);
            for placement in [
                Placement::GpuMemory,
                Placement::Unified,
                Placement::UnifiedOversubscribed(capacities[0].0),
            ] {
                let placed = place(q, &g, placement, headroom)?;
                let run =
                    graph::gpu_bfs(q, Source::Plain(&placed.ptrs), g.vertices(), root, bfs_opts)?;
                check(&run, &want, placement.name())?;
                rows.push(row(
                    placement.name(),
                    run.secs,
                    json!({
                        "depth": run.depth,
                        "level_ms": level_ms(&run),
                        "bottom_up": run.bottom_up,
                        "gpu_free_bytes": placed.gpu_free_bytes,
                        "limit_bytes": match placement {
                            Placement::UnifiedOversubscribed(l) => Some(l),
                            _ => None,
                        },
                    }),
                ));
                report(rows.last().expect("a row"));
            }
            let mem = rows
                .iter()
                .find(|r| r["mode"] == "gpu_memory")
                .and_then(|r| r["seconds"].as_f64());
            if let Some(mem) = mem {
                for r in rows.iter().filter(|r| r["mode"] == "cache") {
                    println!(
                        "cache of {:.0} %: {:.2} x the time with the graph in GPU memory",
                        r["capacity_pct"].as_f64().unwrap_or(0.0),
                        r["seconds"].as_f64().unwrap_or(0.0) / mem
                    );
                }
            }
        }
        Ok(())
    })();
    let down = common::gpu_down(setup);
    result?;
    down?;
    println!(
        "verified: every vertex's level equals the CPU BFS's in {} runs",
        rows.len()
    );
    println!("gpu_bfs: OK");
    Ok(())
}

/// `--split`: `static`, `dynamic` or `dynamic:N`.
fn parse_split(s: &str) -> Result<BfsSplit, String> {
    match s.split_once(':') {
        None if s == "static" => Ok(BfsSplit::Static),
        None if s == "dynamic" => Ok(BfsSplit::default()),
        Some(("dynamic", n)) => match n.parse::<u32>() {
            Ok(n) if n > 0 => Ok(BfsSplit::Dynamic(n)),
            _ => Err(format!("dynamic:{n}: a run of at least one vertex")),
        },
        _ => Err(format!("{s}: static, dynamic or dynamic:N")),
    }
}

/// `--direction`: a [`BfsDirection`] by its name.
fn parse_direction(s: &str) -> Result<BfsDirection, String> {
    [BfsDirection::Optimizing, BfsDirection::TopDown]
        .into_iter()
        .find(|d| d.name() == s)
        .ok_or_else(|| format!("{s}: optimizing or top-down"))
}

/// Each level's milliseconds, rounded to microseconds.
fn level_ms(run: &graph::BfsRun) -> Vec<f64> {
    run.level_secs
        .iter()
        .map(|s| (s * 1e6).round() / 1e3)
        .collect()
}

/// Writes one CSR array as a blockfs file.
fn write_array(
    fs: &gpunvme::blockfs::FileSystem,
    name: &str,
    bytes: &[u8],
) -> Result<(gpunvme::blockfs::File, u32)> {
    common::write_file_with(fs, name, bytes.len() as u64, &|at, buf| {
        copy_padded(bytes, at, buf)
    })
}

/// Copies `src[at..]` into `buf`, zeros past its end.
fn copy_padded(src: &[u8], at: u64, buf: &mut [u8]) {
    let from = (at as usize).min(src.len());
    let n = (src.len() - from).min(buf.len());
    buf[..n].copy_from_slice(&src[from..from + n]);
    buf[n..].fill(0);
}

/// The graph's two arrays placed for a baseline.
fn place(
    q: &gpunvme::gpu_queues::GpuQueues,
    g: &Csr,
    placement: Placement,
    headroom: u64,
) -> Result<workloads::Placed> {
    let arrays = [g.offsets.as_bytes(), g.cols.as_bytes()];
    workloads::place(
        q,
        &arrays.map(|a| a.len() as u64),
        &|i, at, buf| copy_padded(arrays[i], at, buf),
        placement,
        headroom,
    )
}

/// Fails unless the GPU's levels are the CPU's.
fn check(run: &graph::BfsRun, want: &[u32], what: &str) -> Result<()> {
    ensure!(run.levels.len() == want.len(), "{what}: level count");
    verify(graph::first_mismatch(&run.levels, want).is_none(), || {
        let (v, got, exp) = graph::first_mismatch(&run.levels, want).unwrap_or_default();
        format!("{what}: vertex {v} at level {got} on the GPU, {exp} on the CPU")
    })
}
