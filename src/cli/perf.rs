//! `gpunvme perf`: printing a run's report.

use anyhow::Result;
use gpunvme::perf::PerfReport;
use gpunvme::units::format_bytes;

/// Prints the report as fio-style text or JSON. A run with errors still prints its numbers, then
/// fails so scripts notice.
pub fn print(r: &PerfReport, as_json: bool) -> Result<()> {
    if as_json {
        println!("{}", serde_json::to_string_pretty(r)?);
    } else {
        println!("data path: {}", r.data_path);
        println!(
            "{}: bs={} qd={} queues={}: IOPS={:.0}, BW={}/s, ios={}, errors={}",
            r.rw.name(),
            r.bs,
            r.qd,
            r.queues,
            r.iops,
            format_bytes(r.bw_bytes),
            r.ios,
            r.errors
        );
        println!(
            "  lat (ns): mean={:.0} p50={} p99={} p99.9={} max={}",
            r.lat_ns.mean, r.lat_ns.p50, r.lat_ns.p99, r.lat_ns.p999, r.lat_ns.max
        );
        if r.verified_bytes > 0 || r.verify_errors > 0 {
            println!(
                "  verify: {} checked, {} mismatching I/Os",
                format_bytes(r.verified_bytes as f64),
                r.verify_errors
            );
        }
    }
    if let Some(e) = &r.first_error {
        anyhow::bail!("{} of {} I/Os failed; first: {e}", r.errors, r.ios);
    }
    Ok(())
}
