//! `gpunvme perf --gpu`: the perf patterns issued from GPU threads on queues in GPU memory,
//! optionally with CPU queues of the same controller running `perf` at the same time.
//!
//! Verification: reads check every byte on the GPU against the LBA-stamped pattern, which the
//! CPU laid down first through its own queue (so what the CPU wrote, the GPU reads). Writes
//! carry the pattern; beforehand the CPU fills the region with the pattern of another seed, and
//! afterwards reads every block back: each must hold the new pattern (written by the GPU) or
//! the old one (not chosen by the random offsets), anything else is an error — so what the GPU
//! wrote, the CPU reads.

use std::time::Duration;

use anyhow::{Context, Result, bail, ensure};
use gpu_emu::{GpuQueuesExt, MediaKind, SsdModel};
use gpu_queues::{GpuId, GpuQueueOptions};
use nvme::Controller;
use serde::Serialize;

use crate::perf::kernel::{ClientStyle, GpuPerfConfig, GpuRw};
use crate::perf::{self, DEFAULT_REGION_BYTES, Latency, PerfConfig, PerfReport, RwMode, Stop};
use gpunvme::open::Backend;
use gpunvme::pattern;

/// One `perf --gpu` run.
#[derive(Debug, Clone)]
pub struct GpuPerfArgs {
    /// The pattern, size, depth (per GPU queue), stop condition, verification, seed; `queues`
    /// is the number of GPU queues (0: every queue the controller has left).
    pub perf: PerfConfig,
    /// Total GPU threads (one command in flight each); default `qd × queues`.
    pub gpu_threads: Option<usize>,
    /// Submission style.
    pub style: ClientStyle,
    /// Lanes of each warp that issue with [`ClientStyle::Warp`] (1 to 32; `None`:
    /// [`default_warp_lanes`](crate::perf::kernel::default_warp_lanes)).
    pub warp_lanes: Option<u32>,
    /// CPU queues running `perf` beside the GPU (0: none).
    pub cpu_queues: usize,
    /// Entries per GPU ring (default: as deep as the controller allows, up to 1024).
    pub depth: Option<u32>,
    /// SMs reserved for the software controller's copy kernels, or for the GPU-resident
    /// controller model.
    pub controller_sms: u32,
    /// `Some(media)`: the I/O queues are served by the GPU-resident controller model with that
    /// media (`--controller gpu`); `None`: by the software controller's threads.
    pub model: Option<MediaKind>,
    /// The SSD timing model of every namespace of the GPU-resident controller model
    /// (`--ssd-model`; needs `--controller gpu`).
    pub ssd_model: Option<SsdModel>,
    /// The GPU-resident model's SMs and start gate when it is one of several started together
    /// ([`run_several_gpu`](super::run_several_gpu)); `None`: the GPU split for it alone.
    pub model_group: Option<gpu_emu::GroupMember>,
    /// The GPU whose threads issue the I/O (`--gpu-id`; default GPU 0).
    pub gpu: GpuId,
    /// Whether this run writes `--verify`'s read pattern first (false when a run over several
    /// GPUs wrote it once for all of them: [`run_on_gpus`](super::run_on_gpus)).
    pub fill: bool,
}

/// The GPU half of the report.
#[derive(Debug, Clone, Serialize)]
pub struct GpuSide {
    /// The GPU.
    pub device: String,
    /// The transport that carried doorbells and data, in words.
    pub transport: String,
    /// Short transport name ("software-controller").
    pub transport_kind: &'static str,
    /// GPU threads launched.
    pub threads: u32,
    /// Submission style that ran ("warp", "thread" or "lone").
    pub style: &'static str,
    /// With the warp style: lanes of each warp that issued.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub warp_lanes: Option<u32>,
    /// GPU queue pairs.
    pub queues: usize,
    /// Entries per ring.
    pub depth: u32,
    /// SMs reserved for the controller's kernels.
    pub controller_sms: u32,
    /// The software controller's side (software-controller): its threads and batched copies.
    pub controller: Option<ControllerSide>,
    /// The GPU-resident controller model's side (`--controller gpu`).
    pub model: Option<ModelSide>,
}

/// What the GPU-resident controller model did during the run.
#[derive(Debug, Clone, Serialize)]
pub struct ModelSide {
    /// Media of the namespaces: "null" or "hbm".
    pub media: &'static str,
    /// Controller blocks (one per reserved SM).
    pub blocks: u32,
    /// Distinct SMs they ran on.
    pub sms: u32,
    /// Commands the model completed (the whole run: fills and checks are not through it).
    pub commands: u64,
    /// Of which with an error status.
    pub errors: u64,
    /// Data bytes it moved.
    pub bytes: u64,
    /// Doorbell values out of range it ignored.
    pub doorbell_errors: u64,
    /// Polling passes over all controller warps, and the share that found nothing to do.
    pub passes: u64,
    /// Passes with nothing to do.
    pub idle_passes: u64,
    /// Completions dropped by fault injection.
    pub dropped: u64,
    /// Completions held by the timing model and never posted (still due at stop).
    pub abandoned: u64,
    /// Completions each controller warp can hold (the timing model's in-flight bound per
    /// warp).
    pub pending_per_warp: u32,
    /// The SSD timing model (`--ssd-model`), or null: completions as fast as the controller
    /// goes.
    pub ssd_model: Option<SsdModelReport>,
}

/// The SSD timing model's parameters, as every result prints them. A model, not a
/// measurement (gpu_emu::ssd_model).
#[derive(Debug, Clone, Serialize)]
pub struct SsdModelReport {
    /// The `--ssd-model` form (parses back to the same model).
    pub spec: String,
    /// In words.
    pub description: String,
    /// Fixed read latency after service, µs.
    pub read_us: f64,
    /// Fixed write latency after service, µs.
    pub write_us: f64,
    /// Commands per second per drive (0: no cap).
    pub iops_per_drive: u64,
    /// Bytes per second per drive (0: no cap).
    pub bw_bytes_per_drive: u64,
    /// Drives striped behind each namespace.
    pub drives: u32,
    /// Stripe unit in bytes.
    pub stripe_bytes: u64,
    /// The model's ceiling for this run's block size: commands per second, all drives (null:
    /// uncapped).
    pub max_iops_at_bs: Option<f64>,
    /// Bytes per second of that ceiling (null: uncapped).
    pub max_bw_bytes_at_bs: Option<f64>,
}

impl SsdModelReport {
    /// The report of `m` for commands of `bs` bytes.
    pub fn new(m: &SsdModel, bs: u64) -> Self {
        let max = m.max_iops(bs);
        Self {
            spec: m.to_string(),
            description: m.describe(),
            read_us: m.read_latency.as_secs_f64() * 1e6,
            write_us: m.write_latency.as_secs_f64() * 1e6,
            iops_per_drive: m.iops,
            bw_bytes_per_drive: m.bandwidth,
            drives: m.drives,
            stripe_bytes: m.stripe,
            max_iops_at_bs: max.is_finite().then_some(max),
            max_bw_bytes_at_bs: max.is_finite().then_some(max * bs as f64),
        }
    }
}

/// Where the software controller's time went while it served the GPU queues.
#[derive(Debug, Clone, Serialize)]
pub struct ControllerSide {
    /// Controller threads (each with a copy engine of its own).
    pub threads: usize,
    /// How batches moved: "kernels" (scatter/gather) or "memcpy" (GPUNVME_EMU_DMA=memcpy).
    pub copy_mode: &'static str,
    /// Where the queues' rings and slot buffers were: "host" (pinned host memory the
    /// controller reads directly) or "gpu" (GPU memory behind its copy engines);
    /// GPUNVME_EMU_RINGS chooses.
    pub rings: &'static str,
    /// Scatter kernels launched (one per batch that wrote GPU memory).
    pub scatters: u64,
    /// Pieces they moved (data ranges and completion entries).
    pub scattered_pieces: u64,
    /// Gather kernels launched (prefetched PRP lists and write data).
    pub gathers: u64,
    /// Ranges they moved.
    pub gathered_pieces: u64,
    /// Reads served from gathered bytes.
    pub gather_hits: u64,
    /// Reads that needed a copy and a wait of their own (SQE fetches among them).
    pub sync_reads: u64,
    /// Milliseconds the controller threads spent waiting for the GPU, summed over threads.
    pub gpu_wait_ms: f64,
    /// Read bytes copied straight from registered page-cache windows of the image.
    pub direct_bytes: u64,
    /// Copy-engine copies issued for them.
    pub direct_copies: u64,
    /// Read bytes from the image staged through pinned memory (`pread`) and scattered.
    pub staged_file_bytes: u64,
}

/// `perf`'s report plus the GPU configuration, and the CPU side when it ran.
#[derive(Debug, Clone, Serialize)]
pub struct GpuPerfReport {
    /// The GPU threads' I/O, with `perf`'s keys.
    #[serde(flatten)]
    pub report: PerfReport,
    /// How the GPU side ran.
    pub gpu: GpuSide,
    /// CPU queues on the same controller at the same time (`--cpu-queues`).
    pub cpu: Option<PerfReport>,
}

fn gpu_rw(rw: RwMode) -> GpuRw {
    match rw {
        RwMode::Read => GpuRw::Read,
        RwMode::Write => GpuRw::Write,
        RwMode::RandRead => GpuRw::RandRead,
        RwMode::RandWrite => GpuRw::RandWrite,
    }
}

/// Writes the pattern of `seed` over `blocks` blocks from LBA 0, through one CPU queue.
/// The seed of the contents a write run with `seed` overwrites (so the read-back tells written
/// blocks from untouched ones).
fn previous_seed(seed: u64) -> u64 {
    seed.wrapping_mul(0x9e37_79b9_7f4a_7c15) ^ 0x01d5_eed0
}

/// Writes what `--verify` checks against, through a CPU queue, over `region_blocks`: for reads
/// the pattern of `seed` the GPU checks; for writes another seed's pattern.
pub(crate) fn fill_for_verify(
    ctrl: &Controller,
    cfg: &PerfConfig,
    lba_size: usize,
    region_blocks: u64,
    seed: u64,
) -> Result<()> {
    let fill_seed = if cfg.rw.is_write() {
        previous_seed(seed)
    } else {
        seed
    };
    cpu_fill(ctrl, cfg.nsid, lba_size, region_blocks, fill_seed)
}

/// The namespace's LBA size and the blocks `cfg` touches (`--size`, default the whole
/// namespace up to [`DEFAULT_REGION_BYTES`]).
pub(crate) fn region_of(ctrl: &Controller, cfg: &PerfConfig) -> Result<(usize, u64)> {
    let ns = ctrl.namespace(cfg.nsid)?.clone();
    let lba_size = ns.lba_size as usize;
    let ns_bytes = ns.blocks * lba_size as u64;
    let region = cfg.size.unwrap_or(ns_bytes.min(DEFAULT_REGION_BYTES));
    ensure!(
        region <= ns_bytes,
        "--size {region} is larger than the namespace"
    );
    Ok((lba_size, region / lba_size as u64))
}

fn cpu_fill(ctrl: &Controller, nsid: u32, lba_size: usize, blocks: u64, seed: u64) -> Result<()> {
    let mut q = ctrl.create_io_queue_pair(64)?;
    let chunk = (4 << 20) / lba_size as u64;
    let mut buf = vec![0u8; chunk as usize * lba_size];
    let mut lba = 0;
    while lba < blocks {
        let n = chunk.min(blocks - lba);
        let bytes = &mut buf[..n as usize * lba_size];
        pattern::fill(bytes, seed, nsid, lba, lba_size);
        q.write_from(nsid, lba, bytes)
            .with_context(|| format!("CPU pattern fill at LBA {lba}"))?;
        lba += n;
    }
    Ok(())
}

/// Reads `blocks` blocks back through a CPU queue: (blocks holding `new`'s pattern, blocks
/// holding `old`'s, first block holding neither).
fn cpu_check(
    ctrl: &Controller,
    nsid: u32,
    lba_size: usize,
    blocks: u64,
    new: u64,
    old: u64,
) -> Result<(u64, u64, Option<u64>)> {
    let mut q = ctrl.create_io_queue_pair(64)?;
    let chunk = (4 << 20) / lba_size as u64;
    let mut buf = vec![0u8; chunk as usize * lba_size];
    let (mut n_new, mut n_old, mut bad) = (0, 0, None);
    let mut lba = 0;
    while lba < blocks {
        let n = chunk.min(blocks - lba);
        let bytes = &mut buf[..n as usize * lba_size];
        q.read_to(nsid, lba, bytes)
            .with_context(|| format!("CPU read-back at LBA {lba}"))?;
        for (i, block) in bytes.chunks_exact(lba_size).enumerate() {
            let b = lba + i as u64;
            if pattern::check(block, new, nsid, b, lba_size).is_none() {
                n_new += 1;
            } else if pattern::check(block, old, nsid, b, lba_size).is_none() {
                n_old += 1;
            } else if bad.is_none() {
                bad = Some(b);
            }
        }
        lba += n;
    }
    Ok((n_new, n_old, bad))
}

/// Runs `perf --gpu` on `ctrl`, whose device is `backend`.
pub fn run(ctrl: &Controller, backend: &Backend, args: &GpuPerfArgs) -> Result<GpuPerfReport> {
    let cfg = &args.perf;
    ensure!(
        args.ssd_model.is_none() || args.model.is_some(),
        "--ssd-model is a parameter of the GPU-resident controller model: add --controller gpu"
    );
    let cuda = gpunvme::gpu_fs::open_gpu(&args.gpu).context("perf --gpu")?;
    let ns = ctrl.namespace(cfg.nsid)?.clone();
    let lba_size = ns.lba_size as usize;
    ensure!(
        cfg.bs >= lba_size && cfg.bs % lba_size == 0,
        "--bs {} is not a whole number of namespace {}'s {lba_size}-byte LBAs",
        cfg.bs,
        cfg.nsid
    );
    let ns_bytes = ns.blocks * lba_size as u64;
    let region = cfg.size.unwrap_or(ns_bytes.min(DEFAULT_REGION_BYTES));
    ensure!(
        region <= ns_bytes,
        "--size {region} is larger than the namespace"
    );
    let region_blocks = region / lba_size as u64;
    let granted = ctrl.info().max_io_queue_pairs as usize;
    ensure!(
        args.cpu_queues < granted,
        "--cpu-queues {} leaves no GPU queue (the controller granted {granted})",
        args.cpu_queues
    );
    let gpu_queues = if cfg.queues == 0 {
        granted - args.cpu_queues
    } else {
        cfg.queues
    };
    ensure!(
        gpu_queues + args.cpu_queues <= granted,
        "--queues {gpu_queues} + --cpu-queues {} but the controller granted {granted}",
        args.cpu_queues
    );
    let qd = match args.gpu_threads {
        Some(t) => {
            ensure!(
                t >= gpu_queues,
                "--gpu-threads {t} is fewer than one per queue"
            );
            t / gpu_queues
        }
        None => cfg.qd,
    };
    ensure!(qd >= 1, "--qd must be at least 1");
    let model = args.model;
    if model.is_some() && !matches!(backend, Backend::Software(_)) {
        bail!(
            "--controller gpu is a model that takes the software controller's place: give an \
             image file as --device"
        );
    }
    if let Some(media) = &model {
        ensure!(
            args.cpu_queues == 0,
            "--cpu-queues with --controller gpu: CPU queues cannot reach the model's GPU media"
        );
        ensure!(
            !(cfg.verify && *media == MediaKind::Null),
            "--verify needs media that keeps data: --media hbm (null moves no data)"
        );
    }

    let seed = cfg.seed.unwrap_or_else(rand::random);
    let old_seed = previous_seed(seed);
    if cfg.verify && args.fill {
        fill_for_verify(ctrl, cfg, lba_size, region_blocks, seed)?;
    }

    let opts = GpuQueueOptions {
        queues: Some(u16::try_from(gpu_queues).context("--queues")?),
        depth: args.depth,
        controller_sms: args.controller_sms,
        // perf measures commands: on the software controller, rings in host memory (the lowest
        // latency per command; GPUNVME_EMU_RINGS=gpu for the copy-engine layout).
        host_rings: Some(true),
        ..Default::default()
    };
    // The GPU-resident controller model starts after the CPU fill (which went to the image
    // through the software controller) and loads the image; it writes it back when stopped.
    let gpu_ctrl = match model {
        None => None,
        Some(media) => Some(gpunvme::gpu::start_model(
            &cuda,
            ctrl,
            backend,
            media,
            args.controller_sms,
            args.ssd_model,
            args.model_group.clone(),
        )?),
    };
    let opts = match &gpu_ctrl {
        // Slot buffers of one command of --bs (at most the maximum transfer, above which perf
        // splits an I/O): the model's runs use many queues.
        Some(_) => GpuQueueOptions {
            slot_buffer_bytes: Some(
                u32::try_from(cfg.bs.next_multiple_of(4096))
                    .unwrap_or(u32::MAX)
                    .min(u32::try_from(ctrl.info().max_transfer_bytes).unwrap_or(u32::MAX)),
            ),
            ..opts
        },
        None => opts,
    };
    let gpunvme::gpu::GpuSetup {
        queues,
        model: gpu_ctrl,
        transport,
        ..
    } = gpunvme::gpu::open_queues(&cuda, ctrl, backend, gpu_ctrl, &opts)?;
    tracing::info!(%transport, "perf --gpu");
    let gcfg = GpuPerfConfig {
        rw: gpu_rw(cfg.rw),
        nsid: cfg.nsid,
        lba_size: lba_size as u32,
        bs: u32::try_from(cfg.bs).context("--bs")?,
        qd: u32::try_from(qd).context("--qd")?,
        style: args.style,
        warp_lanes: args.warp_lanes,
        ios: match cfg.stop {
            Stop::Ios(n) => n.max(1),
            Stop::Runtime(_) => 0,
        },
        runtime: match cfg.stop {
            Stop::Runtime(d) => d.max(Duration::from_millis(1)),
            Stop::Ios(_) => Duration::ZERO,
        },
        verify: cfg.verify,
        seed,
        region_blocks,
    };
    let cpu_cfg = PerfConfig {
        queues: args.cpu_queues,
        seed: Some(seed),
        size: Some(region),
        ..cfg.clone()
    };
    let watchdog = gpunvme::gpu::watchdog(ctrl, backend, gpu_ctrl.as_ref());
    let (gpu, cpu) = std::thread::scope(|s| {
        let cpu = (args.cpu_queues > 0)
            .then(|| s.spawn(|| perf::run(ctrl, &cpu_cfg).map_err(anyhow::Error::from)));
        let gpu = crate::perf::kernel::run(&queues, &gcfg, watchdog);
        let cpu = cpu.map(|h| {
            h.join()
                .unwrap_or_else(|_| Err(anyhow::anyhow!("CPU side panicked")))
        });
        (gpu, cpu)
    });
    let gpu = gpu.context("GPU perf run")?;
    let cpu = cpu.transpose()?;
    let dma = queues.dma_stats();
    let side = GpuSide {
        device: cuda.name().to_string(),
        transport,
        transport_kind: queues.transport().name(),
        threads: gpu.threads,
        style: gpu.style.name(),
        warp_lanes: gpu.warp_lanes,
        queues: queues.len(),
        depth: queues.depth(),
        controller_sms: args.controller_sms,
        controller: dma.map(|d| ControllerSide {
            threads: queues.controller_threads().unwrap_or(0),
            copy_mode: match queues.copy_mode() {
                Some(gpu_emu::CopyMode::Memcpy) => "memcpy",
                _ => "kernels",
            },
            rings: queues.ring_placement().map_or("gpu", |r| r.name()),
            scatters: d.scatters,
            scattered_pieces: d.pieces,
            gathers: d.gathers,
            gathered_pieces: d.gathered,
            gather_hits: d.hits,
            sync_reads: d.sync_reads,
            gpu_wait_ms: d.wait_ns as f64 / 1e6,
            direct_bytes: d.direct_bytes,
            direct_copies: d.direct_copies,
            staged_file_bytes: d.staged_file_bytes,
        }),
        model: None,
    };
    drop(queues);
    let model_side = match &gpu_ctrl {
        Some(g) => {
            let st = g.stop().context("stopping the GPU controller")?;
            Some(ModelSide {
                media: g.media().name(),
                blocks: g.blocks(),
                sms: st.sms,
                commands: st.commands,
                errors: st.errors,
                bytes: st.bytes,
                doorbell_errors: st.doorbell_errors,
                passes: st.passes,
                idle_passes: st.idle_passes,
                dropped: st.dropped,
                abandoned: st.abandoned,
                pending_per_warp: g.pending_per_warp(),
                ssd_model: g
                    .ssd_models()
                    .get(cfg.nsid as usize - 1)
                    .copied()
                    .flatten()
                    .map(|m| SsdModelReport::new(&m, cfg.bs as u64)),
            })
        }
        None => None,
    };
    drop(gpu_ctrl);
    let side = GpuSide {
        model: model_side,
        ..side
    };

    let mut errors = gpu.errors + gpu.mismatches;
    let mut verify_errors = gpu.mismatches;
    let mut verified_bytes = if cfg.verify && !cfg.rw.is_write() {
        gpu.done * cfg.bs as u64
    } else {
        0
    };
    let mut first_error = gpu
        .first_failure
        .map(|(s, sf, lba)| format!("GPU I/O at LBA {lba}: {s} (CQE status field {sf:#06x})"));
    if first_error.is_none() {
        first_error = gpu
            .first_bad_lba
            .map(|lba| format!("GPU read of LBA {lba}: bytes differ from the pattern"));
    }
    if cfg.verify && cfg.rw.is_write() {
        // A run that failed may have left the controller unable to serve a CPU queue (GPU
        // queues whose deletion a dead transport refused keep their slots): say what failed
        // first, or the read-back's own error (such as no free queue pair) hides it.
        let (n_new, _n_old, bad) =
            cpu_check(ctrl, cfg.nsid, lba_size, region_blocks, seed, old_seed).with_context(
                || match &first_error {
                    Some(e) => {
                        format!("reading the written blocks back after the run failed ({e})")
                    }
                    None => "reading the written blocks back through a CPU queue".to_string(),
                },
            )?;
        verified_bytes += n_new * lba_size as u64;
        if let Some(b) = bad {
            errors += 1;
            verify_errors += 1;
            first_error.get_or_insert(format!(
                "CPU read-back of LBA {b}: neither the GPU's pattern nor the previous contents"
            ));
        }
        if n_new == 0 && gpu.done > 0 {
            errors += 1;
            verify_errors += 1;
            first_error.get_or_insert("no block written by the GPU reads back".into());
        }
    }
    if gpu.done == 0 && errors == 0 {
        // A run that moved nothing proves nothing: never report it as a success.
        errors += 1;
        first_error.get_or_insert("no I/O completed".into());
    }
    let secs = gpu.elapsed.as_secs_f64().max(1e-9);
    let report = PerfReport {
        rw: cfg.rw,
        bs: cfg.bs,
        qd,
        queues: side.queues,
        ios: gpu.done,
        iops: gpu.done as f64 / secs,
        bw_bytes: (gpu.done * cfg.bs as u64) as f64 / secs,
        lat_ns: Latency {
            mean: gpu.latency_mean(),
            p50: gpu.latency_quantile(0.5),
            p99: gpu.latency_quantile(0.99),
            p999: gpu.latency_quantile(0.999),
            max: gpu.latency_quantile(1.0),
        },
        errors,
        verify_errors,
        verified_bytes,
        runtime_ns: gpu.elapsed.as_nanos() as u64,
        first_error,
        data_path: format!("GPU queues: {}", side.transport),
    };
    Ok(GpuPerfReport {
        report,
        gpu: side,
        cpu,
    })
}
