//! `gpunvme perf`: printing a run's report.

use anyhow::Result;
use gpunvme_cli::perf::gpu::GpuPerfReport;
use gpunvme_cli::perf::{PerfReport, PerfTotals, SeveralGpuReport, SeveralReport};

/// Prints the report as fio-style text (its `Display`) or JSON. A run with errors still prints its numbers, then
/// fails so scripts notice.
pub fn print(r: &PerfReport, as_json: bool) -> Result<()> {
    if as_json {
        outln!("{}", serde_json::to_string_pretty(r)?);
    } else {
        outln!("{r}");
    }
    if let Some(e) = &r.first_error {
        anyhow::bail!("{} of {} I/Os failed; first: {e}", r.errors, r.ios);
    }
    Ok(())
}

/// Prints the totals line of a run over several controllers (`what` after "controllers").
fn print_totals(t: &PerfTotals, what: &str) -> Result<()> {
    use gpunvme::units::{format_bytes, format_ns};
    outln!(
        "total over {} controllers{what}: IOPS={:.0}, BW={}/s, ios={}, errors={}; lat mean={}, \
         worst p99={}",
        t.controllers,
        t.iops,
        format_bytes(t.bw_bytes),
        t.ios,
        t.errors,
        format_ns(t.lat_mean_ns),
        format_ns(t.lat_p99_worst_ns as f64)
    );
    Ok(())
}

/// Prints a run over several controllers: each one's report, then the totals (text), or one
/// JSON object `{controllers: [{device, ...perf's keys}], total}`. Fails when any controller
/// had errors.
pub fn print_several(r: &SeveralReport, as_json: bool) -> Result<()> {
    if as_json {
        outln!("{}", serde_json::to_string_pretty(r)?);
    } else {
        for c in &r.controllers {
            outln!("{}:", c.device);
            outln!("{}", c.report);
        }
        print_totals(&r.total, "")?;
    }
    if let Some(c) = r
        .controllers
        .iter()
        .find(|c| c.report.first_error.is_some())
    {
        anyhow::bail!(
            "{} of {} I/Os failed; first, on {}: {}",
            r.total.errors,
            r.total.ios,
            c.device,
            c.report.first_error.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}

/// Prints a `perf --gpu` run over several controllers: each one's report as `perf --gpu`
/// prints it, then the totals of the GPU threads' I/O (text), or one JSON object
/// `{controllers: [{device, ...perf --gpu's keys}], total}`. Fails when any controller had
/// errors.
pub fn print_several_gpu(r: &SeveralGpuReport, as_json: bool) -> Result<()> {
    if as_json {
        outln!("{}", serde_json::to_string_pretty(r)?);
    } else {
        if let Some(p) = &r.pairing {
            outln!("GPUs paired with controllers {}", p.how);
        }
        for c in &r.controllers {
            outln!("{}:", c.device);
            print_gpu_text(&c.report)?;
        }
        print_totals(&r.total, " (GPU threads)")?;
    }
    if let Some(c) = r
        .controllers
        .iter()
        .find(|c| c.report.report.first_error.is_some())
    {
        anyhow::bail!(
            "{} of {} GPU I/Os failed; first, on {}: {}",
            r.total.errors,
            r.total.ios,
            c.device,
            c.report.report.first_error.as_deref().unwrap_or_default()
        );
    }
    Ok(())
}

/// Prints a `perf --gpu` report: the GPU side as `perf` prints it, with the GPU configuration
/// and transport, then the CPU side when it ran. Fails when either side had errors.
pub fn print_gpu(r: &GpuPerfReport, as_json: bool) -> Result<()> {
    if as_json {
        outln!("{}", serde_json::to_string_pretty(r)?);
    } else {
        print_gpu_side(r)?;
    }
    let gpu_result = if as_json {
        report_errors(&r.report)
    } else {
        print(&r.report, false)
    };
    let cpu_result = match &r.cpu {
        Some(c) if !as_json => {
            outln!("CPU queues on the same controller:");
            print(c, false)
        }
        Some(c) => report_errors(c),
        None => Ok(()),
    };
    gpu_result.and(cpu_result)
}

/// Prints a whole `perf --gpu` report as text without judging its errors (the GPU side, the
/// GPU threads' I/O, the CPU queues'), for runs over several controllers.
fn print_gpu_text(r: &GpuPerfReport) -> Result<()> {
    print_gpu_side(r)?;
    outln!("{}", r.report);
    if let Some(c) = &r.cpu {
        outln!("CPU queues on the same controller:");
        outln!("{c}");
    }
    Ok(())
}

/// Prints how the GPU side of a `perf --gpu` run ran (text).
fn print_gpu_side(r: &GpuPerfReport) -> Result<()> {
    let g = &r.gpu;
    let lanes = g
        .warp_lanes
        .map(|l| format!(", {l} lanes per warp"))
        .unwrap_or_default();
    outln!(
        "GPU: {}, {} threads ({} submission{lanes}), {} queues x {} entries, transport: {}",
        g.device,
        g.threads,
        g.style,
        g.queues,
        g.depth,
        g.transport
    );
    if let Some(c) = &g.controller {
        outln!(
            "  software controller: {} threads; {} scatters ({} pieces), {} gathers ({} \
             pieces, {} hits), {} single reads, {:.1} ms waiting for the GPU; read data: {} \
             MiB by DMA from registered image windows ({} copies), {} MiB staged",
            c.threads,
            c.scatters,
            c.scattered_pieces,
            c.gathers,
            c.gathered_pieces,
            c.gather_hits,
            c.sync_reads,
            c.gpu_wait_ms,
            c.direct_bytes >> 20,
            c.direct_copies,
            c.staged_file_bytes >> 20
        );
    }
    if let Some(m) = &g.model {
        outln!(
            "  GPU controller model: {} media, {} blocks on {} SMs; {} commands ({} errors, \
             {} dropped, {} abandoned), {} doorbell errors, {} of {} passes idle",
            m.media,
            m.blocks,
            m.sms,
            m.commands,
            m.errors,
            m.dropped,
            m.abandoned,
            m.doorbell_errors,
            m.idle_passes,
            m.passes
        );
        match &m.ssd_model {
            Some(s) => outln!(
                "  {} (a model: --ssd-model {}); ceiling at this block size: {}",
                s.description,
                s.spec,
                match (s.max_iops_at_bs, s.max_bw_bytes_at_bs) {
                    (Some(i), Some(b)) => format!("{:.0} IOPS, {:.2} GB/s", i, b / 1e9),
                    _ => "uncapped".to_string(),
                }
            ),
            None => outln!("  SSD model: none (completions as fast as the controller goes)"),
        }
    }
    Ok(())
}

fn report_errors(r: &PerfReport) -> Result<()> {
    if let Some(e) = &r.first_error {
        anyhow::bail!("{} of {} I/Os failed; first: {e}", r.errors, r.ios);
    }
    Ok(())
}
