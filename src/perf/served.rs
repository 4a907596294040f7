//! GPU threads through queue pairs a `gpunvme serve` daemon lends (`gpunvme serve check
//! --gpu`): the perf kernel writes the LBA-stamped pattern over a range and reads it back at
//! random, every byte checked on the GPU, on the served transport
//! (`gpu_queues::transport::served`). What shows a served controller carrying GPU clients of
//! several processes at once, each process its own queues.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpunvme::gpu_queues::{Cuda, GpuQueueOptions};
use gpunvme::served::ServedController;

use crate::perf::kernel::{ClientStyle, GpuPerfConfig, GpuPerfResult, GpuRw};

/// What to run.
#[derive(Clone, Debug)]
pub struct GpuCheckOptions {
    /// Namespace.
    pub nsid: u32,
    /// LBAs from LBA 0 the run touches (the namespace's when 0).
    pub lbas: u64,
    /// Bytes per I/O.
    pub bs: u32,
    /// GPU queue pairs.
    pub queues: u16,
    /// Entries per queue.
    pub depth: u32,
    /// I/Os in flight per queue (GPU threads per queue).
    pub qd: u32,
    /// Random reads: I/Os in all, or
    pub ios: Option<u64>,
    /// for this long (neither: as many I/Os as the range holds).
    pub runtime: Option<Duration>,
    /// The pattern's seed. GPU writers of one range at once must use the same one (they then
    /// write the same bytes).
    pub seed: u64,
    /// Reads only (no write pass), checked against the pattern of `seed` when `verify`.
    pub read_only: bool,
    /// Check every byte read.
    pub verify: bool,
}

impl Default for GpuCheckOptions {
    fn default() -> Self {
        Self {
            nsid: 1,
            lbas: 0,
            bs: 4096,
            queues: 2,
            depth: 256,
            qd: 64,
            ios: None,
            runtime: None,
            seed: 0x5e4e_d0c0,
            read_only: false,
            verify: true,
        }
    }
}

/// One pass's figures.
#[derive(Clone, Debug, serde::Serialize)]
pub struct PassReport {
    /// `write` or `randread`.
    pub pattern: &'static str,
    /// I/Os completed (and matching, with verify).
    pub ios: u64,
    /// I/Os that failed.
    pub errors: u64,
    /// Reads whose bytes did not match.
    pub mismatches: u64,
    /// The first failure or mismatch, in words.
    pub first_error: Option<String>,
    /// Seconds of the pass.
    pub seconds: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// I/Os per second.
    pub iops: f64,
}

impl PassReport {
    fn new(pattern: &'static str, bs: u32, r: &GpuPerfResult) -> Self {
        let secs = r.elapsed.as_secs_f64();
        let first_error = match (r.first_failure, r.first_bad_lba) {
            (Some((s, sf, lba)), _) => Some(format!("{s:?} (status field {sf:#x}) at LBA {lba}")),
            (None, Some(lba)) => Some(format!("bytes read at LBA {lba} are not the pattern")),
            (None, None) => None,
        };
        let per = |n: f64| if secs > 0.0 { n / secs } else { 0.0 };
        Self {
            pattern,
            ios: r.done,
            errors: r.errors,
            mismatches: r.mismatches,
            first_error,
            seconds: secs,
            bytes_per_sec: per(r.done as f64 * f64::from(bs)),
            iops: per(r.done as f64),
        }
    }

    /// Whether the pass had no error and no mismatch.
    pub fn clean(&self) -> bool {
        self.errors == 0 && self.mismatches == 0
    }
}

/// What a check did.
#[derive(Clone, Debug, serde::Serialize)]
pub struct GpuCheckReport {
    /// The GPU.
    pub gpu: String,
    /// Microseconds to build the GPU queues on lent pairs (arena, pairs, registrations,
    /// kernels).
    pub setup_us: u64,
    /// GPU queue pairs and their depth.
    pub queues: usize,
    /// Entries per queue.
    pub depth: u32,
    /// The write pass (absent with `read_only`).
    pub write: Option<PassReport>,
    /// The random-read pass.
    pub read: PassReport,
}

impl GpuCheckReport {
    /// Whether every pass was clean.
    pub fn clean(&self) -> bool {
        self.read.clean() && self.write.as_ref().is_none_or(PassReport::clean)
    }
}

/// Runs the check on `served` from `cuda`'s GPU.
pub fn gpu_check(
    served: &ServedController,
    cuda: &Arc<Cuda>,
    o: &GpuCheckOptions,
) -> anyhow::Result<GpuCheckReport> {
    use anyhow::{Context, ensure};
    let ns = *served
        .info()
        .namespace(o.nsid)
        .with_context(|| format!("namespace {} is not served", o.nsid))?;
    ensure!(
        o.bs >= ns.lba_size && o.bs % ns.lba_size == 0,
        "--bs {} is not a whole number of namespace {}'s {}-byte LBAs",
        o.bs,
        o.nsid,
        ns.lba_size
    );
    let lbas = if o.lbas == 0 { ns.blocks } else { o.lbas };
    ensure!(
        lbas <= ns.blocks,
        "--lbas {lbas}: namespace {} has {} LBAs",
        o.nsid,
        ns.blocks
    );
    let t0 = Instant::now();
    let queues = served
        .gpu_queues(
            cuda,
            &GpuQueueOptions {
                queues: Some(o.queues),
                depth: Some(o.depth),
                slot_buffer_bytes: Some(
                    o.bs.next_multiple_of(4096)
                        .min(served.info().max_transfer_bytes),
                ),
                ..Default::default()
            },
        )
        .context("GPU queues on the served controller")?;
    let setup_us = t0.elapsed().as_micros() as u64;
    let whole = lbas * u64::from(ns.lba_size) / u64::from(o.bs);
    let cfg = |rw: GpuRw, ios: u64, runtime: Duration| GpuPerfConfig {
        rw,
        nsid: o.nsid,
        lba_size: ns.lba_size,
        bs: o.bs,
        qd: o.qd,
        style: ClientStyle::Warp,
        warp_lanes: None,
        ios,
        runtime,
        verify: o.verify,
        seed: o.seed,
        region_blocks: lbas,
    };
    // The daemon's word ends a pass early: a revoked queue, a failed controller, the daemon gone.
    let watchdog = served.watchdog();
    let write = if o.read_only {
        None
    } else {
        let r = crate::perf::kernel::run(
            &queues,
            &cfg(GpuRw::Write, whole.max(1), Duration::ZERO),
            watchdog.clone(),
        )
        .context("the GPU write pass")?;
        Some(PassReport::new("write", o.bs, &r))
    };
    let (ios, runtime) = match (o.ios, o.runtime) {
        (_, Some(t)) => (0, t),
        (Some(n), None) => (n.max(1), Duration::ZERO),
        (None, None) => (whole.max(1), Duration::ZERO),
    };
    let r = crate::perf::kernel::run(&queues, &cfg(GpuRw::RandRead, ios, runtime), watchdog)
        .context("the GPU read pass")?;
    let read = PassReport::new("randread", o.bs, &r);
    Ok(GpuCheckReport {
        gpu: cuda.name().to_string(),
        setup_us,
        queues: queues.len(),
        depth: queues.depth(),
        write,
        read,
    })
}
