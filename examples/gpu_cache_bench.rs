//! The page cache's microbenchmarks (`gpu_queues::cache`, `ptx/include/gpunvme_cache.cuh`),
//! one JSON object per line on stdout, each row with the same-run baseline it is compared to.
//!
//! ```text
//! cargo run --release --example gpu_cache_bench -- --part hit [--data 256M] [--iters 1024]
//! cargo run --release --example gpu_cache_bench -- --part miss --controller gpu \
//!     --ssd-model drives=4 [--range 4G] [--cache 64M] [--threads 16K]
//! ```
//!
//! - **hit**: `--data` bytes of an LBA range (the perf pattern, written by the CPU) through a
//!   cache that holds all of it, warmed by one sequential pass; then timed passes of 4- and
//!   8-byte elements, random and sequential, by the same kernel (`gpunvme_cache_bench`) once
//!   through `gpunvme::array<T>` and once from a plain GPU buffer holding the same bytes (the
//!   denominator); warp-wide `read_range` of 4 KiB and of 64 KiB runs into per-warp
//!   scratch, beside the same copy from the plain buffer; and warps scanning runs of their own
//!   (`gpunvme_cache_bench_scan`: each warp 32 consecutive elements per load) with
//!   `array::load` and with an `array_cursor`, beside the same scan of the plain buffer. Each
//!   row: elements/s of both and their ratio; the two passes' sums must be equal and the timed
//!   pass must miss nothing, or the example fails.
//! - **miss**: random elements over `--range` bytes through a `--cache` 64 times smaller (so
//!   nearly every access misses), on the GPU-resident controller with `--ssd-model`: achieved
//!   fills (page reads) per second over the model's cap (`SsdModel::max_iops` of one page).
//!
//! The device is a new sparse image in /dev/shm (removed at the end) served by the software
//! controller, or by the GPU-resident controller model (`--controller gpu`, hbm media). Without
//! a GPU prints "skipped: no GPU" and exits 0.

mod common;

use std::sync::Arc;
use std::time::{Duration, Instant};

use anyhow::{Context, Result, ensure};
use clap::Parser;
use gpunvme::gpu::{self, Serving};
use gpunvme::gpu_cache::{CacheOptions, GpuCache};
use gpunvme::gpu_emu::{MediaKind, SsdModel};
use gpunvme::gpu_fs::MODEL_QUEUE_PAIRS;
use gpunvme::gpu_queues::GpuQueueOptions;
use gpunvme::gpu_queues::ffi::{Arg, Cuda, DeviceMemory};
use gpunvme::gpu_queues::pattern;
use gpunvme::nvme::Controller;
use gpunvme::nvme_emu::EmuConfig;
use gpunvme::open::{self, DeviceSpec, OpenOptions};
use gpunvme::units::parse_size;

use common::{ControllerKind, OwnImage, verify};

const SEED: u64 = 0xcac4e;

/// The page cache's hit and miss paths, each beside its baseline.
#[derive(Parser, Debug)]
struct Args {
    /// Which measurement.
    #[arg(long, value_enum, default_value = "hit")]
    part: Part,
    /// Hit part: bytes of data (a power of two; the cache holds all of it).
    #[arg(long, default_value = "256M", value_parser = parse_size)]
    data: u64,
    /// Miss part: bytes of the range read at random (a power of two).
    #[arg(long, default_value = "4G", value_parser = parse_size)]
    range: u64,
    /// Miss part: cache capacity.
    #[arg(long, default_value = "64M", value_parser = parse_size)]
    cache: u64,
    /// Cache page size.
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    page_size: u64,
    /// GPU threads (default: hit 2048 per client SM, miss 16 K).
    #[arg(long, value_parser = parse_size)]
    threads: Option<u64>,
    /// Element loads per thread per timed pass (default: hit 1024, miss 256).
    #[arg(long)]
    iters: Option<u64>,
    /// Who serves the GPU queues.
    #[arg(long, value_enum, default_value = "emu")]
    controller: ControllerKind,
    /// The GPU-resident controller model's SSD timing model (with `--controller gpu`).
    #[arg(long)]
    ssd_model: Option<SsdModel>,
    /// SMs reserved for the controller's kernels.
    #[arg(long, default_value_t = 8)]
    controller_sms: u32,
    /// The GPU to run on: a CUDA ordinal, a UUID (GPU-...) or a PCI address.
    #[arg(long, default_value = "0")]
    gpu_id: gpunvme::gpu_queues::GpuId,
}

#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum Part {
    Hit,
    Miss,
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(cuda) = common::gpu_or_skip("gpu_cache_bench", &args.gpu_id)? else {
        return Ok(());
    };
    ensure!(
        args.ssd_model.is_none() || args.controller == ControllerKind::Gpu,
        "--ssd-model is a parameter of the GPU-resident controller model: add --controller gpu"
    );
    let bytes = match args.part {
        Part::Hit => args.data,
        Part::Miss => args.range,
    };
    ensure!(
        bytes.is_power_of_two() && bytes >= 1 << 20,
        "--data / --range: a power of two of at least 1 MiB"
    );
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let path = dir.join(format!("gpunvme-cache-bench-{}.img", std::process::id()));
    EmuConfig::create_image(&path, bytes)
        .with_context(|| format!("creating {}", path.display()))?;
    let _own = OwnImage::new(path.clone());
    let mut oopts = OpenOptions::default();
    if args.controller == ControllerKind::Gpu {
        oopts.controller_queue_pairs = MODEL_QUEUE_PAIRS;
    }
    let (ctrl, backend) = open::open_controller_and_transport(&DeviceSpec::Image(path), &oopts)?;
    let lba = ctrl.namespace(1)?.lba_size;
    if args.part == Part::Hit {
        cpu_fill(&ctrl, lba, bytes)?;
    }
    let serving = match args.controller {
        ControllerKind::Emu => Serving::Device,
        ControllerKind::Gpu => Serving::Model(MediaKind::Hbm),
    };
    let model = match serving {
        Serving::Device => None,
        Serving::Model(media) => Some(gpu::start_model(
            &cuda,
            &ctrl,
            &backend,
            media,
            args.controller_sms,
            args.ssd_model,
            None,
        )?),
    };
    let granted = ctrl.info().max_io_queue_pairs;
    let setup = gpu::open_queues(
        &cuda,
        &ctrl,
        &backend,
        model,
        &GpuQueueOptions {
            queues: Some(granted.saturating_sub(1).max(1)),
            controller_sms: args.controller_sms,
            ..Default::default()
        },
    )?;
    let result = match args.part {
        Part::Hit => hit(&args, &cuda, &setup, lba, bytes),
        Part::Miss => miss(&args, &setup, lba, bytes),
    };
    let down = gpunvme::gpu_fs::teardown(setup);
    result.and(down.map_err(Into::into))
}

/// Writes the perf pattern over `bytes` from LBA 0 through one CPU queue.
fn cpu_fill(ctrl: &Controller, lba: u32, bytes: u64) -> Result<()> {
    let mut q = ctrl.create_io_queue_pair(64)?;
    let chunk = (4u64 << 20).min(bytes);
    let mut buf = vec![0u8; chunk as usize];
    let mut at = 0;
    while at < bytes {
        pattern::fill(&mut buf, SEED, 1, at / lba as u64, lba as usize);
        q.write_from(1, at / lba as u64, &buf)
            .with_context(|| format!("CPU pattern fill at byte {at}"))?;
        at += chunk;
    }
    Ok(())
}

/// What a timed pass runs: `gpunvme_cache_bench` in a mode (0 random, 1 sequential, 2 and 3
/// read_range of 4 KiB and 64 KiB runs), or `gpunvme_cache_bench_scan` (with an array_cursor
/// when `cursor`).
#[derive(Clone, Copy)]
enum Pass {
    Bench(u32),
    Scan { cursor: bool },
}

impl Pass {
    /// The bytes a warp reads per iteration with read_range (0 for element loads), and so its
    /// scratch.
    fn run_bytes(self) -> u64 {
        match self {
            Pass::Bench(2) => 4096,
            Pass::Bench(3) => 65536,
            _ => 0,
        }
    }
}

/// One timed launch of `pass`: (seconds, sum, failed loads).
#[allow(clippy::too_many_arguments)]
fn pass(
    setup: &gpu::GpuSetup,
    cache: Option<&GpuCache<'_>>,
    plain: Option<&DeviceMemory>,
    what: Pass,
    elem: u32,
    n: u64,
    threads: u64,
    iters: u64,
) -> Result<(f64, u64, u64)> {
    let q = &setup.queues;
    let out = DeviceMemory::alloc(q.cuda(), 16)?;
    let scratch = DeviceMemory::alloc(q.cuda(), (threads / 32 * what.run_bytes()).max(8) as usize)?;
    let block = 256u64;
    let grid = u32::try_from(threads.div_ceil(block)).context("--threads")?;
    let s = q.client_stream();
    // Both kernels take (cache, range, plain, mode, elem_bytes, n, iters, ..., out).
    let (kernel, mode, tail) = match what {
        Pass::Bench(mode) => (
            q.kernels().tools()?.cache_bench,
            mode,
            vec![Arg::U64(SEED), Arg::U64(scratch.ptr())],
        ),
        Pass::Scan { cursor } => (q.kernels().tools()?.cache_bench_scan, cursor as u32, vec![]),
    };
    let mut args = vec![
        Arg::U64(cache.map_or(0, |c| c.descriptor())),
        Arg::U32(0),
        Arg::U64(plain.map_or(0, |p| p.ptr())),
        Arg::U32(mode),
        Arg::U32(elem),
        Arg::U64(n),
        Arg::U64(iters),
    ];
    args.extend(tail);
    args.push(Arg::U64(out.ptr()));
    let start = Instant::now();
    s.launch(kernel, grid, block as u32, &args)?;
    s.wait_idle(Duration::from_secs(600))
        .context("the benchmark kernel")?;
    let secs = start.elapsed().as_secs_f64();
    let mut r = [0u8; 16];
    out.read(0, &mut r)?;
    let sum = u64::from_le_bytes(r[..8].try_into()?);
    let errors = u64::from_le_bytes(r[8..].try_into()?);
    Ok((secs, sum, errors))
}

fn hit(args: &Args, cuda: &Arc<Cuda>, setup: &gpu::GpuSetup, lba: u32, bytes: u64) -> Result<()> {
    let q = &setup.queues;
    let mut cache = GpuCache::new(
        q,
        CacheOptions {
            page_size: u32::try_from(args.page_size).context("--page-size")?,
            capacity: bytes,
            ..Default::default()
        },
    )?;
    cache.bind_lba_range(1, lba, 0, bytes / lba as u64, false)?;
    // The plain buffer: the same bytes, made on the GPU by the pattern kernel.
    let plain = DeviceMemory::alloc(cuda, bytes as usize)?;
    let bad = DeviceMemory::alloc(cuda, 8)?;
    q.client_stream().launch(
        q.kernels().pattern,
        1024,
        256,
        &[
            Arg::U64(plain.ptr()),
            Arg::U64(SEED),
            Arg::U32(1),
            Arg::U64(0),
            Arg::U64(bytes / lba as u64),
            Arg::U32(lba.trailing_zeros()),
            Arg::U32(0),
            Arg::U64(bad.ptr()),
        ],
    )?;
    q.client_stream().wait_idle(Duration::from_secs(60))?;
    let client_sms = cuda.sm_count().saturating_sub(args.controller_sms).max(1) as u64;
    let threads = args
        .threads
        .unwrap_or(client_sms * 2048)
        .next_multiple_of(256);
    let iters = args.iters.unwrap_or(1024);
    // Warm: one sequential pass over every element.
    let n4 = bytes / 4;
    pass(
        setup,
        Some(&cache),
        None,
        Pass::Bench(1),
        4,
        n4,
        threads,
        n4.div_ceil(threads),
    )?;
    let warm = cache.stats()?;
    verify(warm.counters.errors == 0 && warm.counters.full == 0, || {
        format!("warm pass: {warm:?}")
    })?;
    for elem in [4u32, 8] {
        for (what, name) in [
            (Pass::Bench(0), "random"),
            (Pass::Bench(1), "sequential"),
            (Pass::Bench(2), "warp_read_range_4k"),
            (Pass::Bench(3), "warp_read_range_64k"),
            (Pass::Scan { cursor: false }, "warp_scan"),
            (Pass::Scan { cursor: true }, "warp_scan_cursor"),
        ] {
            let n = bytes / elem as u64;
            // 64 KiB runs: a sixteenth of the iterations, the same bytes as 4 KiB runs.
            let iters = if matches!(what, Pass::Bench(3)) {
                (iters / 16).max(1)
            } else {
                iters
            };
            let before = cache.stats()?;
            let (tc, sc, ec) = pass(setup, Some(&cache), None, what, elem, n, threads, iters)?;
            let after = cache.stats()?;
            // The plain buffer's scan is the same with or without a cursor.
            let (tp, sp, _) = pass(setup, None, Some(&plain), what, elem, n, threads, iters)?;
            // Elements loaded: one per thread per iteration, or a run per warp per iteration.
            let loads = match what.run_bytes() {
                0 => threads * iters,
                run => threads / 32 * iters * (run / elem as u64),
            };
            verify(ec == 0, || format!("{ec} failed loads through the cache"))?;
            verify(sc == sp, || {
                format!(
                    "{elem}-byte {name}: the cache's sum {sc:#x} differs from the plain buffer's {sp:#x}"
                )
            })?;
            let misses = after.counters.misses - before.counters.misses;
            verify(misses == 0, || {
                format!("the timed pass missed {misses} pages")
            })?;
            let (rc, rp) = (loads as f64 / tc, loads as f64 / tp);
            println!(
                "{{\"part\":\"hit\",\"elem_bytes\":{elem},\"pattern\":\"{name}\",\"threads\":{threads},\
                 \"loads\":{loads},\"cache_elems_per_s\":{rc:.4e},\"plain_elems_per_s\":{rp:.4e},\
                 \"ratio\":{:.3},\"misses\":{misses},\"page_size\":{},\"frames\":{},\
                 \"data_bytes\":{bytes},\"transport\":{:?}}}",
                rc / rp,
                cache.page_size(),
                cache.nframes(),
                setup.transport
            );
        }
    }
    Ok(())
}

fn miss(args: &Args, setup: &gpu::GpuSetup, lba: u32, bytes: u64) -> Result<()> {
    let q = &setup.queues;
    let page = u32::try_from(args.page_size).context("--page-size")?;
    let mut cache = GpuCache::new(
        q,
        CacheOptions {
            page_size: page,
            capacity: args.cache,
            ..Default::default()
        },
    )?;
    cache.bind_lba_range(1, lba, 0, bytes / lba as u64, false)?;
    let threads = args.threads.unwrap_or(16 << 10).next_multiple_of(256);
    let iters = args.iters.unwrap_or(256);
    // One element per page: the random element stream touches pages at random.
    let n = bytes / 4;
    let before = cache.stats()?;
    let (secs, _, errors) = pass(
        setup,
        Some(&cache),
        None,
        Pass::Bench(0),
        4,
        n,
        threads,
        iters,
    )?;
    let s = cache.stats()?;
    verify(errors == 0, || format!("{errors} failed loads: {s:?}"))?;
    let misses = s.counters.misses - before.counters.misses;
    let rate = misses as f64 / secs;
    let cap = args.ssd_model.map(|m| m.max_iops(page as u64));
    println!(
        "{{\"part\":\"miss\",\"threads\":{threads},\"loads\":{},\"misses\":{misses},\
         \"hits\":{},\"waits\":{},\"seconds\":{secs:.4},\"misses_per_s\":{rate:.4e},\
         \"model_cap_iops\":{},\"ratio\":{},\"page_size\":{page},\"frames\":{},\
         \"range_bytes\":{bytes},\"ssd_model\":{},\"transport\":{:?}}}",
        threads * iters,
        s.counters.hits - before.counters.hits,
        s.counters.waits - before.counters.waits,
        cap.map_or("null".into(), |c| format!("{c:.4e}")),
        cap.map_or("null".into(), |c| format!("{:.3}", rate / c)),
        cache.nframes(),
        args.ssd_model
            .map_or("null".into(), |m| format!("{:?}", m.describe())),
        setup.transport
    );
    Ok(())
}
