//! GPU kernels write a checkpoint into a preallocated blockfs file through a device-write
//! reservation; the host commits and syncs; a CPU read after a remount verifies it. And a crash
//! before the commit: a reservation that GPU threads wrote through and that was dropped without
//! a commit leaves the file's previous length and contents.
//!
//! ```text
//! cargo run --release --example gpu_write -- [--size 512M] [--device IMG] [--controller emu|gpu]
//! ```
//!
//! 1. The CPU creates `examples/checkpoint.bin` preallocated to `--size` (length 0), and
//!    `examples/crash.bin` with `--size`/4 + 123 bytes of a known pattern; syncs.
//! 2. A GPU kernel fills a GPU buffer with the checkpoint (`gpu_queues::pattern`, a function of
//!    the 4 KiB block index; `GpuFiles::pattern_fill`), its CRC-32C is computed on the GPU;
//!    `GpuFiles::reserve` hands out the writable table and one batch of 64 MiB shards writes the
//!    buffer into the file by GPU-issued commands; `GpuFile::commit_with_crc` sets the length.
//! 3. Crash before commit: `crash.bin` is reserved for more bytes, GPU threads write past its
//!    end (an unaligned start: the LBA holding the old end is read, overlaid and rewritten), and
//!    the handle is dropped without a commit.
//! 4. The GPU side goes down, the host syncs, and the file system is mounted again from the
//!    device (the old mount dropped without unmounting, as after a crash).
//! 5. CPU reads: the checkpoint has its length, its recorded checksum and every byte of the
//!    pattern; `crash.bin` has its old length and its old bytes.
//!
//! Exits non-zero on any mismatch; without a GPU prints "skipped: no GPU" and exits 0.

mod common;

use anyhow::{Context, Result, ensure};
use clap::Parser;
use gpunvme::blockfs::{CreateOptions, FileSystem, OpenMode};
use gpunvme::blockfs_gpu::{FileRange, GpuFiles, GpuFilesOptions, GpuSpan};
use gpunvme::gpu;
use gpunvme::gpu_fs;
use gpunvme::gpu_queues::pattern;
use gpunvme::units::parse_size;

use common::{DeviceArgs, PATTERN_BLOCK as BLOCK, PATTERN_NSID, PATTERN_SHIFT, gbps, verify};

const CKPT: &str = "examples/checkpoint.bin";
const CRASH: &str = "examples/crash.bin";
/// Shards of the checkpoint write (LBA-aligned, so no two ranges share an LBA).
const SHARD: u64 = 64 << 20;

/// GPU-written checkpoint through a device-write reservation, and a crash before the commit.
#[derive(Parser, Debug)]
struct Args {
    /// Checkpoint size.
    #[arg(long, default_value = "512M", value_parser = parse_size)]
    size: u64,
    /// Pattern seed.
    #[arg(long, default_value_t = 0xc4ec)]
    seed: u64,
    #[command(flatten)]
    dev: DeviceArgs,
}

/// Reads `name` on the CPU and checks it is `len` bytes of the pattern of `seed`; returns its
/// CRC-32C.
fn check_pattern_file(fs: &FileSystem, name: &str, len: u64, seed: u64) -> Result<u32> {
    let f = fs.open(name, OpenMode::ReadOnly)?;
    let got_len = f.len()?;
    verify(got_len == len, || {
        format!("{name} is {got_len} bytes after the remount, not {len}")
    })?;
    let piece = 16u64 << 20;
    let (mut got, mut want) = (vec![0u8; piece as usize], vec![0u8; piece as usize]);
    let mut crc = 0u32;
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(piece) as usize;
        let read = f.read_at(at, &mut got[..n])?;
        verify(read == n, || format!("{name}: short read at {at}"))?;
        let whole = n.next_multiple_of(BLOCK as usize);
        pattern::fill(
            &mut want[..whole],
            seed,
            PATTERN_NSID,
            at / BLOCK,
            BLOCK as usize,
        );
        if got[..n] != want[..n] {
            let first = (0..n).find(|&i| got[i] != want[i]).unwrap_or(0) as u64;
            verify(false, || {
                format!("{name}: byte {} differs from what was written", at + first)
            })?;
        }
        crc = crc32c::crc32c_append(crc, &got[..n]);
        at += n as u64;
    }
    Ok(crc)
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(_cuda) = common::gpu_or_skip("gpu_write", &args.dev.gpu_id)? else {
        return Ok(());
    };
    ensure!(args.size > 0, "--size must be positive");
    let size = args.size;
    let prev_len = size / 4 + 123;
    let extra = (size / 4).max(4096);
    let crash_seed = args.seed ^ 0x5eed;
    let mut opened = common::open("gpu_write", &args.dev, size + prev_len + extra)?;

    // 1. The preallocated checkpoint file (length 0) and the file the crash case grows.
    common::remove_if_present(&opened.fs, CKPT)?;
    let ckpt = opened.fs.create(CKPT, &CreateOptions { size_hint: size })?;
    let (crash, prev_crc) = common::write_pattern_file(&opened.fs, CRASH, prev_len, crash_seed)?;
    println!(
        "{CKPT}: preallocated {} bytes, length {}",
        ckpt.stat()?.allocated,
        ckpt.len()?
    );

    let setup = opened.gpu(&args.dev)?;
    let result = (|| -> Result<(u32, f64)> {
        let files = GpuFiles::new(&setup.queues, GpuFilesOptions::from_env()?);
        let watch = || gpu::watchdog(&opened.ctrl, &opened.backend, setup.model.as_ref());
        // 2. The checkpoint, made on the GPU and written by GPU-issued commands.
        let buf = setup
            .queues
            .alloc_buffer(size as usize)
            .context("allocating GPU memory for the checkpoint")?;
        files.pattern_fill(
            buf.ptr(),
            args.seed,
            PATTERN_NSID,
            0,
            buf.len() as u64 / BLOCK,
            PATTERN_SHIFT,
        )?;
        let gpu_crc = files.crc32c(buf.ptr(), size)?;
        let gfile = files
            .reserve(&ckpt, size)
            .context("reserving the checkpoint")?;
        let spans = (0..size.div_ceil(SHARD))
            .map(|s| {
                let at = s * SHARD;
                GpuSpan::of(&buf, at, SHARD.min(size - at)).map(|sp| (at, sp))
            })
            .collect::<Result<Vec<_>, _>>()?;
        let ranges: Vec<FileRange> = spans
            .iter()
            .map(|&(at, sp)| FileRange::write(&gfile, at, sp))
            .collect();
        let r = files
            .submit(&ranges)?
            .wait_watched(watch())?
            .into_first_error()?;
        verify(r.bytes() == size, || {
            format!("the GPU wrote {} of {size} bytes", r.bytes())
        })?;
        let secs = r.elapsed.as_secs_f64();
        drop(ranges);
        gfile
            .commit_with_crc(size, gpu_crc)
            .context("committing the checkpoint")?;
        println!(
            "{CKPT}: {size} bytes written by GPU threads in {} shards, {secs:.3} s ({:.2} GB/s), \
             committed with the GPU's crc32c {gpu_crc:08x}",
            spans.len(),
            gbps(size, secs)
        );
        drop(buf);

        // 3. A crash before the commit: write past the end, drop the reservation.
        let junk = setup.queues.alloc_buffer(extra as usize)?;
        files.pattern_fill(
            junk.ptr(),
            !crash_seed,
            PATTERN_NSID,
            0,
            junk.len() as u64 / BLOCK,
            PATTERN_SHIFT,
        )?;
        let g = files
            .reserve(&crash, prev_len + extra)
            .context("reserving the crash file")?;
        files
            .submit(&[FileRange::write(
                &g,
                prev_len,
                GpuSpan::of(&junk, 0, extra)?,
            )])?
            .wait_watched(watch())?
            .into_first_error()?;
        drop(g); // no commit
        println!(
            "{CRASH}: {extra} bytes written by GPU threads past its end ({prev_len}), \
             reservation dropped without a commit"
        );
        println!("data path: {}", gpu_fs::data_path(&setup, true));
        Ok((gpu_crc, secs))
    })();
    let down = common::gpu_down(setup);
    let (gpu_crc, _) = result?;
    down?;

    // 4. The host syncs; then a remount from the device, as after a crash.
    opened.fs.sync().context("syncing")?;
    drop((ckpt, crash));
    opened.remount()?;

    // 5. The CPU's view.
    let crc = check_pattern_file(&opened.fs, CKPT, size, args.seed)?;
    verify(crc == gpu_crc, || {
        format!("{CKPT}: the CPU's crc32c {crc:08x} differs from the GPU's {gpu_crc:08x}")
    })?;
    let recorded = opened.fs.stat(CKPT)?.data_crc;
    verify(recorded == Some(gpu_crc), || {
        format!("{CKPT}: recorded checksum {recorded:08x?}, the GPU's {gpu_crc:08x}")
    })?;
    println!(
        "{CKPT}: after the remount the CPU reads {size} bytes of the pattern, crc32c {crc:08x} (= recorded)"
    );
    let crc = check_pattern_file(&opened.fs, CRASH, prev_len, crash_seed)?;
    verify(crc == prev_crc, || {
        format!("{CRASH}: crc32c {crc:08x}, before the crash {prev_crc:08x}")
    })?;
    println!(
        "{CRASH}: after the remount still {prev_len} bytes with its old contents (crc32c \
         {crc:08x})"
    );
    opened.fs.sync()?;
    println!("gpu_write: OK");
    Ok(())
}
