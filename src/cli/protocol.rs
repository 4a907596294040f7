//! `gpunvme protocol-check`: the device header's queue protocol (`ptx/include/gpunvme.cuh`) run from
//! CPU threads on queues the driver did not allocate, on whatever controller was opened
//! ([`gpu_queues::cpu_client::run_stress`] does the work); this file parses and prints.

use std::time::Duration;

use anyhow::{Context, Result, bail};
use gpu_queues::cpu_client::{StressConfig, StressReport, run_stress};
use gpunvme::units::{format_bytes, parse_duration, parse_size};
use nvme::Controller;
use serde_json::json;

/// Options of `gpunvme protocol-check`.
#[derive(clap::Args, Debug)]
pub struct ProtocolCheckArgs {
    /// Queue pairs on caller-supplied rings.
    #[arg(long, default_value_t = 2)]
    queues: u16,
    /// Entries per SQ and CQ (a power of two).
    #[arg(long, default_value_t = 32)]
    depth: u32,
    /// Threads sharing each queue (every second one submits batches with one atomic, as a
    /// warp does).
    #[arg(long, default_value_t = 4)]
    threads: usize,
    /// Commands in all: each write is read back, so this is rounded up to an even number.
    #[arg(long, default_value_t = 4000)]
    ios: u64,
    /// Commands per batch of the batch threads (at most --depth).
    #[arg(long, default_value_t = 4)]
    batch: u32,
    /// Compare every byte read with what was written (the default).
    #[arg(long, overrides_with = "no_verify")]
    verify: bool,
    /// Issue the reads without comparing their bytes.
    #[arg(long, overrides_with = "verify")]
    no_verify: bool,
    /// Namespace id.
    #[arg(long, default_value_t = 1)]
    pub nsid: u32,
    /// Bytes of the namespace (from LBA 0) to touch. Default: the whole namespace, at most
    /// 1 GiB.
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Bytes of each slot's data buffer, whole 4 KiB pages; commands move 1 block up to one
    /// buffer. Default: the maximum transfer, at most 64 KiB.
    #[arg(long, value_parser = parse_size)]
    slot_buffer: Option<u64>,
    /// Seed of the patterns and offsets (default: fresh each run).
    #[arg(long)]
    seed: Option<u64>,
    /// Bound of every wait (e.g. 10s, 500ms).
    #[arg(long, default_value = "10s", value_parser = parse_duration)]
    timeout: Duration,
    /// Run even if the namespace holds a blockfs or belongs to a striped volume: the check
    /// writes its patterns from LBA 0, destroying it.
    #[arg(long)]
    pub force: bool,
}

/// Runs the check, prints its report, and fails if any command failed, any byte differed or
/// the controller failed.
pub fn run(ctrl: &Controller, args: &ProtocolCheckArgs, as_json: bool) -> Result<()> {
    let slot_buffer_bytes = args
        .slot_buffer
        .map(|b| u32::try_from(b).context("--slot-buffer is too large"))
        .transpose()?;
    let cfg = StressConfig {
        queues: args.queues,
        threads_per_queue: args.threads,
        depth: args.depth,
        commands: args.ios,
        batch: args.batch,
        nsid: args.nsid,
        region_bytes: args.size,
        slot_buffer_bytes,
        seed: args.seed.unwrap_or_else(rand::random),
        timeout: args.timeout,
        // The last of --verify / --no-verify wins; neither means verify.
        verify: args.verify || !args.no_verify,
    };
    let r = run_stress(ctrl, &cfg).context("protocol check")?;
    if as_json {
        outln!("{}", serde_json::to_string_pretty(&to_json(&r))?);
    } else {
        print_text(&r)?;
    }
    if !r.passed() {
        let mut why = Vec::new();
        if let Some(c) = &r.controller_failure {
            why.push(format!("controller failure: {c}"));
        }
        if r.errors > 0 {
            why.push(format!(
                "{} of {} commands failed (first: {})",
                r.errors,
                r.commands,
                r.first_error.as_deref().unwrap_or("?")
            ));
        }
        if r.mismatches > 0 {
            why.push(format!(
                "{} reads differed from what was written (first at LBA {})",
                r.mismatches,
                r.first_bad_lba.map_or("?".into(), |l| l.to_string())
            ));
        }
        if r.commands != r.requested {
            why.push(format!("{} of {} commands issued", r.commands, r.requested));
        }
        bail!("protocol check failed: {}", why.join("; "));
    }
    Ok(())
}

fn to_json(r: &StressReport) -> serde_json::Value {
    let per_queue: Vec<_> = r
        .queues
        .iter()
        .map(|q| {
            json!({
                "qid": q.qid,
                "ios": q.commands,
                "sq_doorbells": q.sq_doorbells,
                "cq_doorbells": q.cq_doorbells,
                "out_of_order": q.out_of_order,
                "failed": q.failed,
            })
        })
        .collect();
    json!({
        "device": r.device,
        "passed": r.passed(),
        "ios": r.commands,
        "requested": r.requested,
        "writes": r.writes,
        "reads": r.reads,
        "batch_ios": r.batch_commands,
        "errors": r.errors,
        "mismatches": r.mismatches,
        "verify": r.verify,
        "verified_bytes": r.verified_bytes,
        "sq_doorbells": r.sq_doorbells(),
        "cq_doorbells": r.cq_doorbells(),
        "out_of_order": r.out_of_order(),
        "queues": r.queues.len(),
        "depth": r.depth,
        "threads": r.threads_per_queue,
        "threads_total": r.threads_per_queue * r.queues.len(),
        "batch": r.batch,
        "nsid": r.nsid,
        "lba_size": r.lba_size,
        "region_bytes": r.region_bytes,
        "slot_buffer_bytes": r.slot_buffer_bytes,
        "seed": r.seed,
        "elapsed_s": r.elapsed.as_secs_f64(),
        "first_error": r.first_error,
        "first_bad_lba": r.first_bad_lba,
        "controller_failure": r.controller_failure,
        "per_queue": per_queue,
    })
}

fn print_text(r: &StressReport) -> anyhow::Result<()> {
    outln!("device: {}", r.device);
    outln!(
        "protocol: {} queues x {} entries, {} threads each (half with batches of {}), \
         {}-byte LBAs, {} slot buffers, {} of namespace {}, seed {:#x}",
        r.queues.len(),
        r.depth,
        r.threads_per_queue,
        r.batch,
        r.lba_size,
        format_bytes(r.slot_buffer_bytes as f64),
        format_bytes(r.region_bytes as f64),
        r.nsid,
        r.seed
    );
    outln!(
        "  ios={} of {} (writes {}, reads {}, {} in batches), errors={}, mismatches={}, \
         verified {}, {:.2}s",
        r.commands,
        r.requested,
        r.writes,
        r.reads,
        r.batch_commands,
        r.errors,
        r.mismatches,
        if r.verify {
            format_bytes(r.verified_bytes as f64)
        } else {
            "nothing (--no-verify)".into()
        },
        r.elapsed.as_secs_f64()
    );
    let per_command = |n: u64| n as f64 / r.commands.max(1) as f64;
    outln!(
        "  doorbells: SQ {} ({:.2} per command), CQ {} ({:.2} per command); {} completions out \
         of order",
        r.sq_doorbells(),
        per_command(r.sq_doorbells()),
        r.cq_doorbells(),
        per_command(r.cq_doorbells()),
        r.out_of_order()
    );
    for q in &r.queues {
        outln!(
            "  queue {}: {} ios, SQ {} / CQ {} doorbells, {} out of order{}",
            q.qid,
            q.commands,
            q.sq_doorbells,
            q.cq_doorbells,
            q.out_of_order,
            q.failed
                .as_deref()
                .map_or(String::new(), |f| format!(", FAILED: {f}"))
        );
    }
    if let Some(c) = &r.controller_failure {
        outln!("  controller failure: {c}");
    }
    outln!("{}", if r.passed() { "PASS" } else { "FAIL" });
    Ok(())
}
