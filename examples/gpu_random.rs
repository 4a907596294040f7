//! Random 4 KiB reads of a blockfs file by many GPU threads, embedding/graph style: at least
//! 1 M reads (`--reads`), every block verified.
//!
//! ```text
//! cargo run --release --example gpu_random -- [--size 1G] [--reads 1M] [--gather 16K]
//!     [--device IMG] [--controller emu|gpu]
//! ```
//!
//! The CPU writes the file: 4 KiB block `i` holds `gpu_queues::pattern` block `i`. Then, through
//! `blockfs_gpu` (one batch of ranges per kernel, a warp lane per 4 KiB range):
//! - **scatter rounds**: each round reads every block of the file once, in a random order, block
//!   `i` into slot `i` of a GPU buffer the size of the file (poisoned with another seed first);
//!   a GPU kernel (`GpuFiles::pattern_check`) then checks every slot against the pattern of its
//!   index. Rounds repeat until at least `--reads` blocks were read.
//! - **gather**: `--gather` random block indices (repeats allowed) read into consecutive slots
//!   of a dense buffer, as an embedding lookup does; copied back to the host in chunks and each
//!   slot checked on the CPU against the pattern of the index it was asked for.
//!
//! Exits non-zero on any mismatch; without a GPU prints "skipped: no GPU" and exits 0.

mod common;

use anyhow::{Context, Result, ensure};
use clap::Parser;
use gpunvme::blockfs_gpu::{FileRange, GpuFiles, GpuFilesOptions, GpuSpan};
use gpunvme::gpu;
use gpunvme::gpu_fs;
use gpunvme::gpu_queues::pattern;
use gpunvme::units::parse_size;
use rand::rngs::SmallRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};

use common::{DeviceArgs, PATTERN_BLOCK as BLOCK, PATTERN_NSID, PATTERN_SHIFT, gbps, verify};

const NAME: &str = "examples/gpu_random.bin";

/// Random 4 KiB reads of a blockfs file by GPU threads, every block verified.
#[derive(Parser, Debug)]
struct Args {
    /// File size (a multiple of 4 KiB).
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: u64,
    /// Fewest 4 KiB reads of the scatter rounds (whole rounds of the file's block count).
    #[arg(long, default_value = "1M", value_parser = parse_size)]
    reads: u64,
    /// Random reads of the gather batch (checked on the CPU).
    #[arg(long, default_value = "16K", value_parser = parse_size)]
    gather: u64,
    /// Pattern and order seed.
    #[arg(long, default_value_t = 0xb10c)]
    seed: u64,
    #[command(flatten)]
    dev: DeviceArgs,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(_cuda) = common::gpu_or_skip("gpu_random", &args.dev.gpu_id)? else {
        return Ok(());
    };
    ensure!(
        args.size >= BLOCK && args.size % BLOCK == 0,
        "--size must be a positive multiple of 4 KiB"
    );
    let nblocks = args.size / BLOCK;
    let rounds = args.reads.div_ceil(nblocks).max(1);
    let opened = common::open("gpu_random", &args.dev, args.size)?;
    let (file, _) = common::write_pattern_file(&opened.fs, NAME, args.size, args.seed)?;
    let mut rng = SmallRng::seed_from_u64(args.seed);

    let setup = opened.gpu(&args.dev)?;
    let result = (|| -> Result<()> {
        let files = GpuFiles::new(&setup.queues, GpuFilesOptions::from_env()?);
        let gfile = files.open(&file).context("opening the file for the GPU")?;
        let watch = || gpu::watchdog(&opened.ctrl, &opened.backend, setup.model.as_ref());

        // Scatter rounds: every block once per round, in random order, into its own slot.
        let slots = setup
            .queues
            .alloc_buffer(args.size as usize)
            .context("allocating GPU memory for the slots")?;
        let mut order: Vec<u64> = (0..nblocks).collect();
        let (mut secs, mut done) = (0f64, 0u64);
        let mut shape = None;
        for round in 0..rounds {
            files.pattern_fill(
                slots.ptr(),
                !args.seed,
                PATTERN_NSID,
                0,
                nblocks,
                PATTERN_SHIFT,
            )?;
            order.shuffle(&mut rng);
            let ranges = order
                .iter()
                .map(|&i| {
                    Ok(FileRange::read(
                        &gfile,
                        i * BLOCK,
                        GpuSpan::of(&slots, i * BLOCK, BLOCK)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            let r = files
                .submit(&ranges)?
                .wait_watched(watch())?
                .into_first_error()?;
            verify(r.bytes() == args.size, || {
                format!(
                    "round {round}: the GPU read {} of {} bytes",
                    r.bytes(),
                    args.size
                )
            })?;
            secs += r.elapsed.as_secs_f64();
            done += nblocks;
            shape = Some(r.shape);
            let bad = files.pattern_check(
                slots.ptr(),
                args.seed,
                PATTERN_NSID,
                0,
                nblocks,
                PATTERN_SHIFT,
            )?;
            verify(bad == 0, || {
                format!("round {round}: {bad} of {nblocks} blocks read differ from the pattern")
            })?;
        }
        drop(slots);
        let shape = shape.expect("at least one round");
        println!(
            "scatter: {done} random 4 KiB reads in {rounds} rounds, {secs:.3} s of kernels: \
             {:.0} K IOPS, {:.2} GB/s; every block checked by a GPU kernel (pattern of its \
             index)",
            done as f64 / secs.max(1e-9) / 1e3,
            gbps(done * BLOCK, secs)
        );
        println!(
            "kernel: {} chunks of up to {} bytes, grid {}x{}",
            shape.chunks, shape.chunk_bytes, shape.grid.0, shape.grid.1
        );

        // Gather: random indices (repeats allowed) into consecutive slots.
        if args.gather > 0 {
            let n = args.gather;
            let dense = setup
                .queues
                .alloc_buffer((n * BLOCK) as usize)
                .context("allocating GPU memory for the gather")?;
            files.pattern_fill(dense.ptr(), !args.seed, PATTERN_NSID, 0, n, PATTERN_SHIFT)?;
            let index: Vec<u64> = (0..n).map(|_| rng.random_range(0..nblocks)).collect();
            let ranges = index
                .iter()
                .enumerate()
                .map(|(k, &i)| {
                    Ok(FileRange::read(
                        &gfile,
                        i * BLOCK,
                        GpuSpan::of(&dense, k as u64 * BLOCK, BLOCK)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            let r = files
                .submit(&ranges)?
                .wait_watched(watch())?
                .into_first_error()?;
            verify(r.bytes() == n * BLOCK, || {
                format!("gather: the GPU read {} of {} bytes", r.bytes(), n * BLOCK)
            })?;
            let gsecs = r.elapsed.as_secs_f64();
            let per = 4096usize; // slots per copy back: 16 MiB
            let mut host = vec![0u8; per * BLOCK as usize];
            for first in (0..n as usize).step_by(per) {
                let m = per.min(n as usize - first);
                let bytes = &mut host[..m * BLOCK as usize];
                dense.read(first * BLOCK as usize, bytes)?;
                for (k, block) in bytes.chunks_exact(BLOCK as usize).enumerate() {
                    let want = index[first + k];
                    let bad = pattern::check(block, args.seed, PATTERN_NSID, want, BLOCK as usize);
                    verify(bad.is_none(), || {
                        format!("gather slot {}: not block {want} of the file", first + k)
                    })?;
                }
            }
            println!(
                "gather: {n} random 4 KiB reads into a dense buffer in {gsecs:.3} s ({:.0} K \
                 IOPS); every slot copied back and checked on the CPU",
                n as f64 / gsecs.max(1e-9) / 1e3
            );
        }
        println!("data path: {}", gpu_fs::data_path(&setup, false));
        Ok(())
    })();
    let down = common::gpu_down(setup);
    result?;
    down?;
    println!("gpu_random: OK");
    Ok(())
}
