//! `perf` over several controllers at once (`--device a,b,...`): the same job on every
//! controller, each on its own queues and threads, started together; a report per controller
//! and the totals.

use nvme::Controller;
use serde::Serialize;

use super::cpu::{PerfConfig, PerfError, PerfReport, run};

/// The totals of a run over several controllers.
#[derive(Debug, Clone, Serialize, PartialEq)]
pub struct PerfTotals {
    /// Controllers that ran the job.
    pub controllers: usize,
    /// I/Os completed, all controllers.
    pub ios: u64,
    /// I/Os per second, the controllers' rates added.
    pub iops: f64,
    /// Bytes per second, the controllers' rates added.
    pub bw_bytes: f64,
    /// Mean latency over every I/O (each controller's mean weighted by its I/Os), ns.
    pub lat_mean_ns: f64,
    /// The highest of the controllers' 99th percentiles, ns.
    pub lat_p99_worst_ns: u64,
    /// Failed I/Os plus verification mismatches, all controllers.
    pub errors: u64,
    /// Of `errors`, mismatching blocks.
    pub verify_errors: u64,
    /// Bytes checked against the pattern.
    pub verified_bytes: u64,
    /// The longest controller's timed phase, ns.
    pub runtime_ns: u64,
}

impl PerfTotals {
    /// The totals of `reports`.
    pub fn of(reports: &[PerfReport]) -> Self {
        let ios: u64 = reports.iter().map(|r| r.ios).sum();
        let weighted: f64 = reports.iter().map(|r| r.lat_ns.mean * r.ios as f64).sum();
        Self {
            controllers: reports.len(),
            ios,
            iops: reports.iter().map(|r| r.iops).sum(),
            bw_bytes: reports.iter().map(|r| r.bw_bytes).sum(),
            lat_mean_ns: if ios > 0 { weighted / ios as f64 } else { 0.0 },
            lat_p99_worst_ns: reports.iter().map(|r| r.lat_ns.p99).max().unwrap_or(0),
            errors: reports.iter().map(|r| r.errors).sum(),
            verify_errors: reports.iter().map(|r| r.verify_errors).sum(),
            verified_bytes: reports.iter().map(|r| r.verified_bytes).sum(),
            runtime_ns: reports.iter().map(|r| r.runtime_ns).max().unwrap_or(0),
        }
    }
}

/// A run over several controllers: each one's report (in the order given), then the totals.
#[derive(Debug, Clone, Serialize)]
pub struct SeveralReport {
    /// Per controller, with the name it was given.
    pub controllers: Vec<NamedReport>,
    /// Over all of them.
    pub total: PerfTotals,
}

/// One controller's report and its name.
#[derive(Debug, Clone, Serialize)]
pub struct NamedReport {
    /// The device as given (`--device`).
    pub device: String,
    /// What ran on it.
    #[serde(flatten)]
    pub report: PerfReport,
}

/// Why a run over several controllers failed: which controller, and its error.
#[derive(Debug, thiserror::Error)]
#[error("{device}: {source}")]
pub struct SeveralError {
    /// The device as given.
    pub device: String,
    /// Its run's error.
    #[source]
    pub source: PerfError,
}

/// A `perf --gpu` run over several controllers or GPUs: each run's report (in the order given),
/// then the totals of their GPU sides.
#[derive(Debug, Clone, Serialize)]
pub struct SeveralGpuReport {
    /// Per run (a controller, a GPU, or a GPU on a controller), with its name.
    pub controllers: Vec<NamedGpuReport>,
    /// Over all of them (the GPU threads' I/O).
    pub total: PerfTotals,
    /// Which GPU drove which controller and why, for a run of several GPUs over several
    /// controllers ([`run_gpus_on_controllers`]).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub pairing: Option<gpunvme::gpu::GpuPairing>,
}

/// One controller's `perf --gpu` report and its name.
#[derive(Debug, Clone, Serialize)]
pub struct NamedGpuReport {
    /// The device as given (`--device`).
    pub device: String,
    /// What ran on it.
    #[serde(flatten)]
    pub report: super::gpu::GpuPerfReport,
}

/// Runs `perf --gpu` with `args` on every controller of `ctrls` (each with its backend, named
/// by `names`) at once: a thread each, which brings that controller's GPU queues up and runs
/// the perf kernel on them (kernels of several controllers run side by side on the GPU). The
/// first controller whose run fails (in the order given) is the error, named; the others
/// still finish first. With the GPU-resident model (`args.model`), each controller's model
/// runs on SMs of its own: the GPU is split once into one partition per controller of
/// `args.controller_sms` (rounded up by the driver: 8 on Hopper), the SMs left over shared by
/// every controller's clients (refused, before anything starts, when too few are left), and
/// no model launches before all of them have loaded their kernels ([`gpu_emu::ModelGroup`]).
pub fn run_several_gpu(
    ctrls: &[(&Controller, &gpunvme::open::Backend)],
    names: &[String],
    args: &super::gpu::GpuPerfArgs,
) -> anyhow::Result<SeveralGpuReport> {
    anyhow::ensure!(
        ctrls.len() < 2 || args.model != Some(gpu_emu::MediaKind::Host),
        "--media host over several devices is not available: a model's host media is \
         unregistered from CUDA when its run ends, which waits for the other models' kernels \
         (docs/testing.md); --media hbm or null run a model per device"
    );
    let per_controller: Vec<super::gpu::GpuPerfArgs> = match args.model {
        None => vec![args.clone(); ctrls.len()],
        Some(_) => {
            let cuda = gpunvme::gpu_fs::open_gpu(&args.gpu)?;
            gpunvme::gpu::model_group(&cuda, ctrls.len(), args.controller_sms)?
                .into_iter()
                .map(|g| super::gpu::GpuPerfArgs {
                    model_group: Some(g),
                    ..args.clone()
                })
                .collect()
        }
    };
    let jobs: Vec<_> = ctrls.iter().zip(&per_controller).collect();
    let results = gpunvme::gpu::on_each(&jobs, |((c, b), a)| super::gpu::run(c, b, a));
    named_gpu_reports(results, names.iter().cloned())
}

/// The reports of runs side by side, each named (in order), and their totals; the first run
/// that failed (in order) is the error, named.
fn named_gpu_reports(
    results: Vec<anyhow::Result<super::gpu::GpuPerfReport>>,
    names: impl Iterator<Item = String>,
) -> anyhow::Result<SeveralGpuReport> {
    let mut controllers = Vec::with_capacity(results.len());
    for (r, name) in results.into_iter().zip(names) {
        let report = r.map_err(|e| e.context(format!("perf --gpu on {name}")))?;
        controllers.push(NamedGpuReport {
            device: name,
            report,
        });
    }
    let reports: Vec<PerfReport> = controllers
        .iter()
        .map(|c| c.report.report.clone())
        .collect();
    Ok(SeveralGpuReport {
        total: PerfTotals::of(&reports),
        controllers,
        pairing: None,
    })
}

/// Runs `perf --gpu` with `args` on every GPU of `gpus` at once against one controller
/// (`--gpu-id all`): each GPU with queue pairs of its own on `ctrl` (an even share of what the
/// CPU queues leave, at least two each: [`gpunvme::gpu_fs::gpu_share`]; `--queues` is per GPU)
/// and its own thread, kernels on every GPU running side by side; a report per GPU (named by
/// ordinal and UUID) and the totals. `--verify`'s pattern is written once for all of them,
/// with one seed, so every GPU checks the same bytes; a write run's read-back runs on one
/// queue pair kept for it. The GPU-resident controller model is refused here: it is one GPU's
/// persistent kernel over an image of its own.
pub fn run_on_gpus(
    ctrl: &Controller,
    backend: &gpunvme::open::Backend,
    gpus: &[std::sync::Arc<gpu_queues::Cuda>],
    args: &super::gpu::GpuPerfArgs,
) -> anyhow::Result<SeveralGpuReport> {
    anyhow::ensure!(!gpus.is_empty(), "no GPU to run on");
    let cfg = several_gpus_config(&[ctrl], &[gpus.len()], args)?.remove(0);
    let per_gpu: Vec<super::gpu::GpuPerfArgs> = gpus
        .iter()
        .map(|c| super::gpu::GpuPerfArgs {
            perf: cfg.clone(),
            gpu: gpu_queues::GpuId::Ordinal(c.ordinal()),
            fill: false,
            ..args.clone()
        })
        .collect();
    let results = gpunvme::gpu::on_each(&per_gpu, |a| super::gpu::run(ctrl, backend, a));
    named_gpu_reports(results, gpus.iter().map(|c| gpu_name(c)))
}

/// A GPU as reports name it: ordinal and UUID.
fn gpu_name(c: &gpu_queues::Cuda) -> String {
    format!("GPU {} ({})", c.ordinal(), c.uuid())
}

/// The shape checks and `--verify` pattern shared by runs of several GPUs: refuses the
/// GPU-resident model, fixes the seed, and gives each controller's queue count per GPU
/// (`--queues`, or an even share among the `sharing[i]` GPUs on controller `i`, at least two
/// each, after the CPU queues and a write check's read-back pair), writing the pattern once per
/// controller.
fn several_gpus_config(
    ctrls: &[&Controller],
    sharing: &[usize],
    args: &super::gpu::GpuPerfArgs,
) -> anyhow::Result<Vec<PerfConfig>> {
    anyhow::ensure!(
        args.model.is_none(),
        "--gpu-id all with --controller gpu: the GPU-resident controller model is one GPU's \
         kernel over a copy of the image; give one --gpu-id"
    );
    let mut cfg = args.perf.clone();
    cfg.seed = Some(cfg.seed.unwrap_or_else(rand::random));
    let write_check = cfg.verify && cfg.rw.is_write();
    let mut out = Vec::with_capacity(ctrls.len());
    for (ctrl, &gpus) in ctrls.iter().zip(sharing) {
        let mut c = cfg.clone();
        if c.queues == 0 {
            let held = args.cpu_queues * gpus + usize::from(write_check);
            let share = gpunvme::gpu_fs::gpu_share(
                ctrl.info().max_io_queue_pairs,
                u16::try_from(held).unwrap_or(u16::MAX),
                u16::try_from(gpus).unwrap_or(u16::MAX),
                None,
            )?;
            c.queues = usize::from(share);
        }
        if c.verify {
            let (lba_size, region_blocks) = super::gpu::region_of(ctrl, &c)?;
            super::gpu::fill_for_verify(ctrl, &c, lba_size, region_blocks, c.seed.unwrap_or(0))?;
        }
        out.push(c);
    }
    Ok(out)
}

/// Runs `perf --gpu` with `args` on every GPU of `gpus` over every controller of `ctrls` at
/// once (`--gpu-id all` with several `--device`): GPUs paired with controllers by the PCIe
/// topology under `sys_root` ([`gpunvme::gpu::pair_gpus`]: each GPU drives its nearest
/// controllers, each controller is driven by its nearest GPUs; every GPU drives every
/// controller where there is no topology to read, as for images), one run per pair on a thread
/// of its own, each with queue pairs of its own (a controller's share split among its GPUs;
/// `--queues` is per pair); a report per pair (named "GPU n (UUID) on DEVICE"), the totals,
/// and the pairing with how it was chosen.
pub fn run_gpus_on_controllers(
    ctrls: &[(&Controller, &gpunvme::open::Backend)],
    names: &[String],
    gpus: &[std::sync::Arc<gpu_queues::Cuda>],
    args: &super::gpu::GpuPerfArgs,
    sys_root: &std::path::Path,
) -> anyhow::Result<SeveralGpuReport> {
    anyhow::ensure!(!gpus.is_empty(), "no GPU to run on");
    let pairing = gpunvme::gpu::pair_gpus(gpus, names, sys_root);
    let sharing: Vec<usize> = (0..ctrls.len())
        .map(|c| pairing.pairs.iter().filter(|p| p.1 == c).count())
        .collect();
    let plain: Vec<&Controller> = ctrls.iter().map(|(c, _)| *c).collect();
    let cfgs = several_gpus_config(&plain, &sharing, args)?;
    let jobs: Vec<(usize, super::gpu::GpuPerfArgs)> = pairing
        .pairs
        .iter()
        .map(|&(g, c)| {
            let a = super::gpu::GpuPerfArgs {
                perf: cfgs[c].clone(),
                gpu: gpu_queues::GpuId::Ordinal(gpus[g].ordinal()),
                fill: false,
                ..args.clone()
            };
            (c, a)
        })
        .collect();
    let results =
        gpunvme::gpu::on_each(&jobs, |(c, a)| super::gpu::run(ctrls[*c].0, ctrls[*c].1, a));
    let run_names: Vec<String> = pairing
        .pairs
        .iter()
        .enumerate()
        .map(|(i, &(g, c))| {
            let class = match &pairing.classes {
                Some(k) => format!(" ({})", k[i]),
                None => String::new(),
            };
            format!("{} on {}{class}", gpu_name(&gpus[g]), names[c])
        })
        .collect();
    let mut report = named_gpu_reports(results, run_names.into_iter())?;
    report.pairing = Some(pairing);
    Ok(report)
}

/// Runs `cfg` on every controller of `ctrls` (named by `names`) at once, a thread each (which
/// starts the job's own queue threads), and waits for all of them. The first controller whose
/// run fails (in the order given) is the error; the others still finish first.
pub fn run_several(
    ctrls: &[&Controller],
    names: &[String],
    cfg: &PerfConfig,
) -> Result<SeveralReport, SeveralError> {
    let results = gpunvme::gpu::on_each(ctrls, |c| run(c, cfg));
    let mut controllers = Vec::with_capacity(results.len());
    for (r, name) in results.into_iter().zip(names) {
        match r {
            Ok(report) => controllers.push(NamedReport {
                device: name.clone(),
                report,
            }),
            Err(source) => {
                return Err(SeveralError {
                    device: name.clone(),
                    source,
                });
            }
        }
    }
    let reports: Vec<PerfReport> = controllers.iter().map(|c| c.report.clone()).collect();
    Ok(SeveralReport {
        total: PerfTotals::of(&reports),
        controllers,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::perf::{Latency, RwMode};

    fn report(
        ios: u64,
        iops: f64,
        mean: f64,
        p99: u64,
        errors: u64,
        runtime_ns: u64,
    ) -> PerfReport {
        PerfReport {
            rw: RwMode::RandRead,
            bs: 4096,
            qd: 8,
            queues: 1,
            ios,
            iops,
            bw_bytes: iops * 4096.0,
            lat_ns: Latency {
                mean,
                p50: p99 / 2,
                p99,
                p999: p99 * 2,
                max: p99 * 3,
            },
            errors,
            verify_errors: errors / 2,
            verified_bytes: ios * 4096,
            runtime_ns,
            first_error: None,
            data_path: "test".into(),
        }
    }

    #[test]
    fn totals_add_rates_weight_the_mean_and_keep_the_worst_tail() {
        let t = PerfTotals::of(&[
            report(100, 1000.0, 10.0, 50, 0, 7),
            report(300, 3000.0, 30.0, 20, 4, 9),
        ]);
        assert_eq!(t.controllers, 2);
        assert_eq!(t.ios, 400);
        assert_eq!(t.iops, 4000.0);
        assert_eq!(t.bw_bytes, 4000.0 * 4096.0);
        assert_eq!(t.lat_mean_ns, 25.0);
        assert_eq!(t.lat_p99_worst_ns, 50);
        assert_eq!((t.errors, t.verify_errors), (4, 2));
        assert_eq!(t.verified_bytes, 400 * 4096);
        assert_eq!(t.runtime_ns, 9);
        let none = PerfTotals::of(&[]);
        assert_eq!((none.ios, none.lat_mean_ns, none.runtime_ns), (0, 0.0, 0));
    }
}
