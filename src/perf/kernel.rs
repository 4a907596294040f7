//! The GPU side of `gpunvme perf --gpu`: launch the perf kernel on the clients' SM partition,
//! wait for it (bounded, with a watchdog that aborts the device-side waits), and read back its
//! counters and latency histogram (the kernel is `gpunvme_perf` in the tools' module,
//! `ptx/kernels/gpunvme_tool_kernels.cu`: [`gpu_queues::kernels::ToolKernels`]). The run around
//! it is [`super::gpu`].
#![forbid(unsafe_code)]

use std::time::{Duration, Instant};

use zerocopy::IntoBytes;

use gpu_queues::desc::{DeviceStatus, LAT_BUCKETS, PerfCounters, PerfParams, lat_bucket_floor};
use gpu_queues::ffi::{Arg, DeviceMemory};
use gpu_queues::{GpuError, GpuQueues};

/// Access pattern (fio's names).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum GpuRw {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Uniformly random reads.
    RandRead,
    /// Uniformly random writes.
    RandWrite,
}

impl GpuRw {
    fn code(self) -> u32 {
        match self {
            Self::Read => 0,
            Self::Write => 1,
            Self::RandRead => 2,
            Self::RandWrite => 3,
        }
    }
    /// Whether it writes.
    pub fn is_write(self) -> bool {
        matches!(self, Self::Write | Self::RandWrite)
    }
}

/// How GPU threads submit.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum ClientStyle {
    /// All 32 lanes of a warp together: one ticket atomic and (usually) one doorbell per warp.
    Warp,
    /// Every thread alone (BaM-style).
    Thread,
    /// Every thread alone, one per warp (lane 0; the other lanes leave at once): clients that
    /// never share a warp, as when each warp of a kernel issues its own I/O from one lane.
    /// Thread clients in one warp diverge while they wait, and their polls and fences then
    /// take turns.
    Lone,
}

impl ClientStyle {
    /// Name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Warp => "warp",
            Self::Thread => "thread",
            Self::Lone => "lone",
        }
    }
}

/// The warp client's issuing lanes per warp for `qd` commands in flight per queue: the fewest
/// warps, but at least two where `qd` allows, that split `qd` evenly with at most 32 lanes
/// each. One warp alternates between submitting its 32 commands and waiting for all of them,
/// and its queue's controller idles meanwhile; two warps of 16 take turns, so the controller
/// always has commands (the queue-depth run in `benches/results/history.md`). QD 64 and deeper: warps
/// of 32. Where this gives one lane (QD 1 or 2, a prime depth above 32), [`run`] runs thread
/// clients instead, unless the caller asked for one lane.
pub fn default_warp_lanes(qd: u32) -> u32 {
    let min_warps = qd.clamp(1, 2);
    (min_warps..=qd.max(1))
        .find(|w| qd % w == 0 && qd / w <= 32)
        .map_or(1, |w| qd / w)
}

/// The style that runs for `cfg` with `warp_lanes` issuing lanes per warp on rings of `depth`
/// entries. Warp-cooperative submission needs whole warps per queue and rings of 32 entries or
/// more, and, unless the caller asked for it, more than one lane per warp (QD 1 or 2, or a
/// prime depth above 32, would give warps of one lane: thread clients with extra steps);
/// otherwise every thread submits alone (the report says which ran).
fn style_that_runs(cfg: &GpuPerfConfig, warp_lanes: u32, depth: u32) -> ClientStyle {
    match cfg.style {
        ClientStyle::Warp
            if cfg.qd % warp_lanes == 0
                && depth >= 32
                && (cfg.warp_lanes.is_some() || warp_lanes > 1) =>
        {
            ClientStyle::Warp
        }
        ClientStyle::Lone => ClientStyle::Lone,
        _ => ClientStyle::Thread,
    }
}

/// One GPU perf run.
#[derive(Clone, Debug)]
pub struct GpuPerfConfig {
    /// Access pattern.
    pub rw: GpuRw,
    /// Namespace.
    pub nsid: u32,
    /// Its LBA size in bytes (512 or 4096).
    pub lba_size: u32,
    /// Bytes per I/O (one command: at most the slot buffer).
    pub bs: u32,
    /// Commands in flight per queue (= GPU threads per queue).
    pub qd: u32,
    /// Submission style.
    pub style: ClientStyle,
    /// With [`ClientStyle::Warp`]: lanes of each warp that issue (1 to 32), so that `qd /
    /// warp_lanes` warps share a queue and one submits while another waits; `None`:
    /// [`default_warp_lanes`].
    pub warp_lanes: Option<u32>,
    /// I/Os to run in all (0: run for `runtime`).
    pub ios: u64,
    /// How long each thread keeps starting I/Os (with `ios == 0`).
    pub runtime: Duration,
    /// Pattern writes, checked reads.
    pub verify: bool,
    /// Pattern and offset seed.
    pub seed: u64,
    /// Blocks from LBA 0 the run may touch.
    pub region_blocks: u64,
}

/// What a run measured.
#[derive(Clone, Debug)]
pub struct GpuPerfResult {
    /// I/Os completed successfully (and matching, with verify).
    pub done: u64,
    /// I/Os that failed.
    pub errors: u64,
    /// Reads whose bytes did not match the pattern.
    pub mismatches: u64,
    /// The first failure: status, CQE status field, LBA.
    pub first_failure: Option<(DeviceStatus, u16, u64)>,
    /// LBA of the first mismatch (if any and no failure).
    pub first_bad_lba: Option<u64>,
    /// Wall time from launch to the kernel's end.
    pub elapsed: Duration,
    /// Latency histogram (log-linear buckets, see [`lat_bucket_floor`]).
    pub latency_buckets: Vec<u32>,
    /// GPU threads launched.
    pub threads: u32,
    /// Submission style that ran.
    pub style: ClientStyle,
    /// Lanes of each warp that issued, when the warp style ran.
    pub warp_lanes: Option<u32>,
}

impl GpuPerfResult {
    /// The latency below which `q` (0..1) of the successful I/Os finished, in nanoseconds.
    pub fn latency_quantile(&self, q: f64) -> u64 {
        let total: u64 = self.latency_buckets.iter().map(|&c| c as u64).sum();
        if total == 0 {
            return 0;
        }
        let want = ((total as f64) * q).ceil().max(1.0) as u64;
        let mut seen = 0;
        for (b, &c) in self.latency_buckets.iter().enumerate() {
            seen += c as u64;
            if seen >= want {
                return lat_bucket_floor(b + 1)
                    .saturating_sub(1)
                    .max(lat_bucket_floor(b));
            }
        }
        lat_bucket_floor(LAT_BUCKETS)
    }

    /// Mean latency estimate from the histogram (bucket midpoints), in nanoseconds.
    pub fn latency_mean(&self) -> f64 {
        let mut total = 0u64;
        let mut sum = 0f64;
        for (b, &c) in self.latency_buckets.iter().enumerate() {
            if c == 0 {
                continue;
            }
            let mid = (lat_bucket_floor(b) as f64 + lat_bucket_floor(b + 1) as f64) / 2.0;
            total += c as u64;
            sum += mid * c as f64;
        }
        if total == 0 { 0.0 } else { sum / total as f64 }
    }
}

/// Runs the perf kernel on `queues`. `watchdog` is called about every millisecond while the
/// kernel runs; when it returns a reason (controller fatal, device gone), every device-side
/// wait is aborted and the kernel ends with `GPUNVME_ABORTED` failures.
pub fn run(
    queues: &GpuQueues,
    cfg: &GpuPerfConfig,
    mut watchdog: impl FnMut() -> Option<String>,
) -> Result<GpuPerfResult, GpuError> {
    let lba_shift = match cfg.lba_size {
        512 => 9,
        1024 => 10,
        2048 => 11,
        4096 => 12,
        other => {
            return Err(GpuError::InvalidArgument(format!("LBA size {other}")));
        }
    };
    if cfg.bs == 0 || cfg.bs % cfg.lba_size != 0 {
        return Err(GpuError::InvalidArgument(format!(
            "--bs {} is not a whole number of {}-byte blocks",
            cfg.bs, cfg.lba_size
        )));
    }
    let bpi = cfg.bs / cfg.lba_size;
    // An I/O above what one command moves (a slot buffer: at most the controller's maximum
    // transfer) is split into commands of that size, as the header's rw_thread does.
    let bpc = (queues.slot_buffer_bytes() / cfg.lba_size).min(bpi);
    if bpc == 0 {
        return Err(GpuError::InvalidArgument(format!(
            "a {}-byte block does not fit the GPU queues' {}-byte slot buffers",
            cfg.lba_size,
            queues.slot_buffer_bytes()
        )));
    }
    let region_blocks = cfg.region_blocks / bpi as u64 * bpi as u64;
    if region_blocks == 0 {
        return Err(GpuError::InvalidArgument(
            "the region holds no whole I/O".into(),
        ));
    }
    if cfg.qd == 0 {
        return Err(GpuError::InvalidArgument("--qd 0".into()));
    }
    let warp_lanes = cfg.warp_lanes.unwrap_or_else(|| default_warp_lanes(cfg.qd));
    if !(1..=32).contains(&warp_lanes) {
        return Err(GpuError::InvalidArgument(format!(
            "--warp-lanes {warp_lanes}: a warp has 1 to 32 lanes"
        )));
    }
    let nq = queues.len() as u32;
    let style = style_that_runs(cfg, warp_lanes, queues.depth());
    // Threads launched per client (one command in flight each): a lone client is lane 0 of a
    // warp of its own; a warp of `warp_lanes` clients is 32 threads.
    let (clients, lanes) = match style {
        ClientStyle::Lone => (cfg.qd, 32),
        ClientStyle::Warp => (cfg.qd / warp_lanes, 32),
        ClientStyle::Thread => (cfg.qd, 1),
    };
    let threads = clients
        .checked_mul(nq)
        .and_then(|c| c.checked_mul(lanes))
        .filter(|&t| t <= 1 << 22)
        .ok_or_else(|| GpuError::InvalidArgument("too many GPU threads".into()))?;
    // Blocks of at most 256 threads: the perf kernel's registers do not fit a block of 1024
    // (the launch fails with CUDA_ERROR_LAUNCH_OUT_OF_RESOURCES).
    let (grid, block) = if threads <= 256 {
        (1, threads)
    } else if threads % 128 == 0 {
        (threads / 128, 128)
    } else {
        (threads.div_ceil(32), 32)
    };
    let launched = grid * block;

    let cuda = queues.cuda();
    let counters = DeviceMemory::alloc(cuda, size_of::<PerfCounters>())?;
    let hist = DeviceMemory::alloc(cuda, LAT_BUCKETS * 4)?;
    let params = PerfParams {
        queues: queues.descriptors(),
        counters: counters.ptr(),
        lat_hist: hist.ptr(),
        seed: cfg.seed,
        region_blocks,
        ios: cfg.ios,
        runtime_ns: if cfg.ios == 0 {
            cfg.runtime.as_nanos().min(u64::MAX as u128) as u64
        } else {
            0
        },
        nqueues: nq,
        rw: cfg.rw.code(),
        nsid: cfg.nsid,
        lba_shift,
        blocks_per_io: bpi,
        warp_mode: match style {
            ClientStyle::Thread => 0,
            ClientStyle::Warp => 1,
            ClientStyle::Lone => 2,
        },
        verify: cfg.verify as u32,
        blocks_per_cmd: bpc,
        warp_lanes: if style == ClientStyle::Warp {
            warp_lanes
        } else {
            32
        },
        reserved: 0,
    };
    let pmem = DeviceMemory::alloc(cuda, size_of::<PerfParams>())?;
    pmem.write(0, params.as_bytes())?;

    // The perf kernel is the tools' (its module loaded at the first run, before the clock).
    let perf = queues.kernels().tools()?.perf;
    let stream = queues.client_stream();
    let start = Instant::now();
    stream.launch(perf, grid, block, &[Arg::U64(pmem.ptr())])?;
    // Bounded: the run's own length, plus every device-side wait's bound, plus slack.
    let limit = if cfg.ios == 0 {
        cfg.runtime
    } else {
        Duration::from_secs(600)
    } + Duration::from_secs(30);
    let mut aborted = false;
    loop {
        if stream.is_idle()? {
            break;
        }
        if !aborted {
            if let Some(why) = watchdog() {
                tracing::warn!(reason = %why, "aborting GPU queues");
                queues.abort();
                aborted = true;
            }
        }
        if start.elapsed() > limit {
            queues.abort();
            stream.wait_idle(Duration::from_secs(30))?;
            return Err(GpuError::Timeout {
                what: "GPU perf kernel",
                waited: limit,
            });
        }
        std::thread::sleep(Duration::from_micros(200));
    }
    let elapsed = start.elapsed();
    let mut c = PerfCounters::default();
    counters.read(0, c.as_mut_bytes())?;
    let mut hb = vec![0u8; LAT_BUCKETS * 4];
    hist.read(0, &mut hb)?;
    let latency_buckets: Vec<u32> = hb
        .chunks_exact(4)
        .map(|b| u32::from_le_bytes(b.try_into().unwrap_or([0; 4])))
        .collect();
    Ok(GpuPerfResult {
        done: c.done,
        errors: c.errors,
        mismatches: c.mismatches,
        first_failure: (c.errors > 0).then(|| {
            (
                DeviceStatus::from_code(c.first_status),
                c.first_nvme_status as u16,
                c.first_bad_lba,
            )
        }),
        first_bad_lba: (c.errors == 0 && c.mismatches > 0).then_some(c.first_bad_lba),
        elapsed,
        latency_buckets,
        threads: launched,
        style,
        warp_lanes: (style == ClientStyle::Warp).then_some(warp_lanes),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    /// A debug build once panicked (integer overflow) summing the floors of the top buckets,
    /// which every mean visited; and an I/O slower than the histogram's range lands in the last.
    /// At least two warps per queue where the depth allows, warps of 32 from QD 64 on, and an
    /// even split always.
    #[test]
    fn default_warp_lanes_split_the_depth_over_two_warps_or_more() {
        for (qd, lanes) in [
            (1, 1),
            (2, 1),
            (8, 4),
            (32, 16),
            (48, 24),
            (64, 32),
            (96, 32),
            (256, 32),
            (37, 1),
            (66, 22),
        ] {
            assert_eq!(default_warp_lanes(qd), lanes, "qd {qd}");
        }
        for qd in 1..=1024 {
            let l = default_warp_lanes(qd);
            assert!((1..=32).contains(&l) && qd % l == 0, "qd {qd}: {l}");
            assert!(qd < 2 || qd / l >= 2, "qd {qd}: one warp of {l}");
        }
    }

    /// The warp client runs where the depth splits into warps of two lanes or more (or the
    /// caller asked for its lanes) on rings of 32 entries or more; thread clients otherwise.
    #[test]
    fn the_warp_client_needs_whole_warps_of_more_than_one_lane() {
        let cfg = |qd, warp_lanes| GpuPerfConfig {
            rw: GpuRw::RandRead,
            nsid: 1,
            lba_size: 512,
            bs: 4096,
            qd,
            style: ClientStyle::Warp,
            warp_lanes,
            ios: 1,
            runtime: Duration::ZERO,
            verify: false,
            seed: 0,
            region_blocks: 8,
        };
        let runs = |qd, lanes: Option<u32>, depth| {
            let c = cfg(qd, lanes);
            style_that_runs(&c, lanes.unwrap_or_else(|| default_warp_lanes(qd)), depth)
        };
        assert_eq!(runs(32, None, 64), ClientStyle::Warp);
        assert_eq!(runs(1, None, 64), ClientStyle::Thread);
        assert_eq!(runs(2, None, 64), ClientStyle::Thread);
        assert_eq!(runs(1, Some(1), 64), ClientStyle::Warp);
        assert_eq!(runs(32, Some(5), 64), ClientStyle::Thread);
        assert_eq!(runs(32, None, 16), ClientStyle::Thread);
        let lone = GpuPerfConfig {
            style: ClientStyle::Lone,
            ..cfg(32, None)
        };
        assert_eq!(style_that_runs(&lone, 16, 64), ClientStyle::Lone);
    }

    #[test]
    fn latency_summaries_cover_every_bucket() {
        let mut buckets = vec![0u32; LAT_BUCKETS];
        buckets[100] = 3;
        buckets[LAT_BUCKETS - 1] = 1;
        let r = GpuPerfResult {
            done: 4,
            errors: 0,
            mismatches: 0,
            first_failure: None,
            first_bad_lba: None,
            elapsed: Duration::from_millis(1),
            latency_buckets: buckets,
            threads: 1,
            style: ClientStyle::Thread,
            warp_lanes: None,
        };
        assert!(r.latency_mean() > lat_bucket_floor(100) as f64);
        assert_eq!(r.latency_quantile(0.5), lat_bucket_floor(101) - 1);
        assert!(r.latency_quantile(1.0) >= lat_bucket_floor(LAT_BUCKETS - 1));
    }
}
