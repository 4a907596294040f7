//! A blockfs file of 1 GiB (`--size`) loaded into GPU memory by commands GPU threads issue
//! themselves, checked on the GPU: the CRC-32C computed on the GPU must equal the host's, and
//! every 4 KiB block must hold the pattern the CPU wrote (checked by a GPU kernel).
//!
//! ```text
//! cargo run --release --example gpu_read -- [--size 1G] [--device IMG] [--controller emu|gpu]
//! ```
//!
//! The CPU writes the file (bytes: `gpu_queues::pattern`, a function of the 4 KiB block index)
//! through blockfs and syncs; the GPU side comes up as in `gpunvme fs get --gpu`; one batch
//! (`blockfs_gpu`) reads the whole file into one GPU buffer, a warp lane per chunk. Prints
//! GB/s and the data path. Exits non-zero on any mismatch; without a GPU prints
//! "skipped: no GPU" and exits 0.

mod common;

use anyhow::{Context, Result, ensure};
use clap::Parser;
use gpunvme::blockfs_gpu::{FileRange, GpuFiles, GpuFilesOptions, GpuSpan};
use gpunvme::gpu;
use gpunvme::gpu_fs;
use gpunvme::units::parse_size;

use common::{
    DeviceArgs, PATTERN_BLOCK as BLOCK, PATTERN_NSID as NSID_TAG, PATTERN_SHIFT, gbps, verify,
};

const NAME: &str = "examples/gpu_read.bin";

/// Loads a blockfs file into GPU memory by GPU-issued reads and checks it on the GPU.
#[derive(Parser, Debug)]
struct Args {
    /// File size.
    #[arg(long, default_value = "1G", value_parser = parse_size)]
    size: u64,
    /// Pattern seed.
    #[arg(long, default_value_t = 0x5eed)]
    seed: u64,
    #[command(flatten)]
    dev: DeviceArgs,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(_cuda) = common::gpu_or_skip("gpu_read", &args.dev.gpu_id)? else {
        return Ok(());
    };
    ensure!(args.size > 0, "--size must be positive");
    let opened = common::open("gpu_read", &args.dev, args.size)?;
    let fs = &opened.fs;

    // The file, written by the CPU: block i holds the pattern of block i.
    let (file, host_crc) = common::write_pattern_file(fs, NAME, args.size, args.seed)?;

    let setup = opened.gpu(&args.dev)?;
    let result = (|| -> Result<()> {
        let files = GpuFiles::new(&setup.queues, GpuFilesOptions::from_env()?);
        let gfile = files.open(&file).context("opening the file for the GPU")?;
        let size = gfile.size();
        ensure!(
            size == args.size,
            "the file is {size} bytes, not {}",
            args.size
        );
        let gbuf = setup
            .queues
            .alloc_buffer(size as usize)
            .context("allocating GPU memory for the file")?;
        // Whatever was in the buffer must not pass: fill it with another seed first.
        files.pattern_fill(
            gbuf.ptr(),
            !args.seed,
            NSID_TAG,
            0,
            gbuf.len() as u64 / BLOCK,
            PATTERN_SHIFT,
        )?;
        let r = files
            .submit(&[FileRange::read(&gfile, 0, GpuSpan::of(&gbuf, 0, size)?)])?
            .wait_watched(gpu::watchdog(
                &opened.ctrl,
                &opened.backend,
                setup.model.as_ref(),
            ))?
            .into_first_error()?;
        verify(r.bytes() == size, || {
            format!("the GPU read {} of {size} bytes", r.bytes())
        })?;
        let secs = r.elapsed.as_secs_f64();
        let gpu_crc = files.crc32c(gbuf.ptr(), size)?;
        verify(gpu_crc == host_crc, || {
            format!("CRC-32C on the GPU {gpu_crc:08x} differs from the host's {host_crc:08x}")
        })?;
        let whole = size / BLOCK;
        let bad = files.pattern_check(gbuf.ptr(), args.seed, NSID_TAG, 0, whole, PATTERN_SHIFT)?;
        verify(bad == 0, || {
            format!("{bad} of {whole} 4 KiB blocks in GPU memory differ from the pattern")
        })?;
        println!(
            "{NAME}: {size} bytes into GPU memory in {secs:.3} s ({:.2} GB/s)",
            gbps(size, secs)
        );
        println!(
            "kernel: {} chunks of {} bytes, grid {}x{}",
            r.shape.chunks, r.shape.chunk_bytes, r.shape.grid.0, r.shape.grid.1
        );
        println!("data path: {}", gpu_fs::data_path(&setup, false));
        println!(
            "verified: crc32c GPU {gpu_crc:08x} = host {host_crc:08x}; {whole} whole 4 KiB \
             blocks checked against the pattern by a GPU kernel"
        );
        Ok(())
    })();
    let down = common::gpu_down(setup);
    result?;
    down?;
    drop(file);
    opened.fs.sync()?;
    println!("gpu_read: OK");
    Ok(())
}
