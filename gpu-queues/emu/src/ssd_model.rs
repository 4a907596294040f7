//! The SSD timing model of the GPU-resident controller ([`SsdModel`]): what a namespace would
//! answer if it were `drives` SSDs striped behind one controller. **A model, not a
//! measurement**: per-command latency, IOPS and bandwidth caps per drive, and queueing.
//!
//! # The model
//! - A namespace's byte space is striped over `drives` drives in units of `stripe` bytes
//!   (unit `u` of the namespace lives on drive `u % drives`). A Read or Write is cut at stripe
//!   boundaries; each piece is one command to its drive.
//! - Each drive serves one piece at a time: a piece of `b` bytes occupies its drive for
//!   `service = max(ceil(1e9 / iops), ceil(b * 1e9 / bw))` nanoseconds, starting when the
//!   drive is free but never before the command was fetched (its busy-until time advances by
//!   each piece's service).
//! - A command completes `read_latency` (Reads) or `write_latency` (Writes) after its last
//!   piece's service ends. So at queue depth 1 a Read takes `service + read_latency`, and at
//!   high depth each drive completes at most `min(iops, bw / bytes)` commands per second
//!   (whole nanoseconds, rounded up: the rate never exceeds the caps), with queueing delay
//!   on top of the fixed latency.
//! - Flush, Write Zeroes, Dataset Management and failed commands are not timed (they complete
//!   at once); injected media errors are timed like the command they fail.
//!
//! The controller kernel (`ptx/emu/gpunvme_controller.cuh`: `service_ns`, `drive_reserve`,
//! `model_due`) does this arithmetic on the GPU with one busy-until word per drive in GPU
//! memory; [`SsdTwin`] is the same arithmetic on the CPU, and the tests below check the model's
//! shapes with it (latency flat at low depth, throughput capped at `drives × iops` at high
//! depth). The CUDA code mirrors [`service_ns`] and [`SsdTwin::reserve`] /
//! [`SsdTwin::submit`]: change them together.
//!
//! What the model leaves out: a drive's internal parallelism beyond its IOPS (the fixed
//! latency is pipelined, not serialised), garbage collection, write caches, read/write
//! interference beyond sharing the drive's time, and the PCIe link. The controller's own
//! limits add to it: each controller warp holds at most a few hundred completions
//! ([`crate::desc::pending_capacity`]), and completions are posted up to one polling pass late.
#![forbid(unsafe_code)]

use std::time::Duration;

use crate::desc::{CTRL_MAX_DRIVES, CTRL_MAX_STRIPE_SHIFT, CTRL_MIN_STRIPE_SHIFT, CtrlNsModel};

/// One namespace's SSD timing model (see the module documentation). Parse one from the
/// command line's `read_us=80,write_us=20,iops=1000000,bw=7GB/s,drives=4,stripe=128k`.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct SsdModel {
    /// Fixed latency of a Read after its service.
    pub read_latency: Duration,
    /// Fixed latency of a Write after its service.
    pub write_latency: Duration,
    /// Commands per second per drive (0: no IOPS cap).
    pub iops: u64,
    /// Bytes per second per drive (0: no bandwidth cap).
    pub bandwidth: u64,
    /// Drives striped behind the namespace (1 to [`CTRL_MAX_DRIVES`]).
    pub drives: u32,
    /// Stripe unit in bytes (a power of two, 4 KiB to 1 GiB).
    pub stripe: u64,
}

impl Default for SsdModel {
    /// One PCIe Gen4/Gen5-class drive: 80 µs reads, 20 µs writes, 1 M IOPS, 7 GB/s, 128 KiB
    /// stripes.
    fn default() -> Self {
        Self {
            read_latency: Duration::from_micros(80),
            write_latency: Duration::from_micros(20),
            iops: 1_000_000,
            bandwidth: 7_000_000_000,
            drives: 1,
            stripe: 128 << 10,
        }
    }
}

/// Service time in nanoseconds of one piece of `bytes` on a drive of `m`:
/// `max(op_ns, ceil(bytes * 1e9 / bw))` (`service_ns` in the CUDA code).
pub fn service_ns(m: &CtrlNsModel, bytes: u64) -> u64 {
    let mut s = m.op_ns as u64;
    if m.bw != 0 {
        s = s.max((bytes * 1_000_000_000).div_ceil(m.bw));
    }
    s
}

impl SsdModel {
    /// Checks the parameters the kernel can represent.
    pub fn validate(&self) -> Result<(), String> {
        if self.drives == 0 || self.drives as usize > CTRL_MAX_DRIVES {
            return Err(format!("drives={} (1 to {CTRL_MAX_DRIVES})", self.drives));
        }
        let shift_ok = self.stripe.is_power_of_two()
            && (CTRL_MIN_STRIPE_SHIFT..=CTRL_MAX_STRIPE_SHIFT)
                .contains(&self.stripe.trailing_zeros());
        if !shift_ok {
            return Err(format!(
                "stripe={} (a power of two from {} to {} bytes)",
                self.stripe,
                1u64 << CTRL_MIN_STRIPE_SHIFT,
                1u64 << CTRL_MAX_STRIPE_SHIFT
            ));
        }
        if self.bandwidth != 0 && self.bandwidth < 1_000_000 {
            return Err(format!(
                "bw={} B/s (0 for no cap, else at least 1 MB/s)",
                self.bandwidth
            ));
        }
        for (name, d) in [("read", self.read_latency), ("write", self.write_latency)] {
            if d.as_nanos() > u32::MAX as u128 {
                return Err(format!(
                    "{name} latency {d:?} (at most {} s)",
                    u32::MAX / 1_000_000_000
                ));
            }
        }
        Ok(())
    }

    /// Nanoseconds per command per drive, rounded up (0: no IOPS cap).
    pub fn op_ns(&self) -> u32 {
        if self.iops == 0 {
            0
        } else {
            1_000_000_000u64.div_ceil(self.iops).min(u32::MAX as u64) as u32
        }
    }

    /// The kernel's table entry, with the drives' busy-until words at GPU pointer `busy`.
    pub fn to_ctrl(&self, busy: u64) -> CtrlNsModel {
        CtrlNsModel {
            busy,
            bw: self.bandwidth,
            read_ns: self.read_latency.as_nanos().min(u32::MAX as u128) as u32,
            write_ns: self.write_latency.as_nanos().min(u32::MAX as u128) as u32,
            op_ns: self.op_ns(),
            drives: self.drives.min(CTRL_MAX_DRIVES as u32) as u16,
            stripe_shift: self.stripe.trailing_zeros() as u16,
        }
    }

    /// Commands per second all drives together can complete with commands of `bytes` bytes
    /// that each stay on one drive (`f64::INFINITY` without caps).
    pub fn max_iops(&self, bytes: u64) -> f64 {
        let svc = service_ns(&self.to_ctrl(0), bytes);
        if svc == 0 {
            f64::INFINITY
        } else {
            self.drives as f64 * 1e9 / svc as f64
        }
    }

    /// In words, for reports.
    pub fn describe(&self) -> String {
        let cap = |v: u64, unit: &str| {
            if v == 0 {
                format!("no {unit} cap")
            } else if unit == "bandwidth" {
                format!("{:.2} GB/s", v as f64 / 1e9)
            } else {
                format!("{v} IOPS")
            }
        };
        format!(
            "SSD model: {} drive{} striped by {} KiB, each {} and {}; latency read {} µs, \
             write {} µs",
            self.drives,
            if self.drives == 1 { "" } else { "s" },
            self.stripe >> 10,
            cap(self.iops, "IOPS"),
            cap(self.bandwidth, "bandwidth"),
            self.read_latency.as_secs_f64() * 1e6,
            self.write_latency.as_secs_f64() * 1e6,
        )
    }
}

impl std::fmt::Display for SsdModel {
    /// The command-line form, which [`str::parse`] reads back.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "read_us={},write_us={},iops={},bw={}B/s,drives={},stripe={}",
            self.read_latency.as_secs_f64() * 1e6,
            self.write_latency.as_secs_f64() * 1e6,
            self.iops,
            self.bandwidth,
            self.drives,
            self.stripe
        )
    }
}

/// Microseconds (a decimal number) as a duration.
fn parse_us(key: &str, v: &str) -> Result<Duration, String> {
    let us: f64 = v
        .parse()
        .map_err(|_| format!("{key}={v}: not a number of microseconds"))?;
    if !us.is_finite() || !(0.0..=4e6).contains(&us) {
        return Err(format!("{key}={v}: 0 to 4000000 µs"));
    }
    Ok(Duration::from_nanos((us * 1000.0).round() as u64))
}

/// A count with an optional decimal suffix (k, M, G).
fn parse_count(key: &str, v: &str) -> Result<u64, String> {
    let (num, mult) = match v.char_indices().last() {
        Some((i, 'k' | 'K')) => (&v[..i], 1e3),
        Some((i, 'm' | 'M')) => (&v[..i], 1e6),
        Some((i, 'g' | 'G')) => (&v[..i], 1e9),
        _ => (v, 1.0),
    };
    let x: f64 = num
        .parse()
        .map_err(|_| format!("{key}={v}: not a number"))?;
    if !x.is_finite() || x < 0.0 || x * mult > u64::MAX as f64 / 2.0 {
        return Err(format!("{key}={v}: out of range"));
    }
    Ok((x * mult).round() as u64)
}

/// A size or rate in bytes: a number, then an optional unit (k/M/G/T decimal, Ki/Mi/Gi/Ti
/// binary, optionally followed by `B`, and for rates `/s`).
fn parse_bytes(key: &str, v: &str, rate: bool) -> Result<u64, String> {
    let mut s = v.trim();
    if rate {
        s = s.strip_suffix("/s").unwrap_or(s);
    }
    let s = s.strip_suffix('B').unwrap_or(s);
    let split = s
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(s.len());
    let (num, unit) = s.split_at(split);
    let mult: f64 = match unit {
        "" => 1.0,
        "k" | "K" => 1e3,
        "M" => 1e6,
        "G" => 1e9,
        "T" => 1e12,
        "Ki" | "KI" => 1024.0,
        "Mi" => (1u64 << 20) as f64,
        "Gi" => (1u64 << 30) as f64,
        "Ti" => (1u64 << 40) as f64,
        other => return Err(format!("{key}={v}: unknown unit {other:?}")),
    };
    let x: f64 = num
        .parse()
        .map_err(|_| format!("{key}={v}: not a number"))?;
    if !x.is_finite() || x < 0.0 || x * mult > u64::MAX as f64 / 2.0 {
        return Err(format!("{key}={v}: out of range"));
    }
    Ok((x * mult).round() as u64)
}

impl std::str::FromStr for SsdModel {
    type Err = String;

    /// `key=value` pairs separated by commas, each key at most once; keys left out keep
    /// [`SsdModel::default`]'s values. Keys: `read_us`, `write_us` (microseconds, decimals
    /// allowed), `iops` (per drive, `k`/`M` suffixes, 0 = no cap), `bw` (per drive: `7GB/s`,
    /// `3.5GiB/s`, `900MB/s`; 0 = no cap), `drives`, `stripe` (`128k`, `1MiB`, bytes; binary
    /// units: `k` means KiB here).
    fn from_str(s: &str) -> Result<Self, String> {
        let mut m = SsdModel::default();
        let mut seen: Vec<&str> = Vec::new();
        for part in s.split(',').map(str::trim).filter(|p| !p.is_empty()) {
            let (key, value) = part
                .split_once('=')
                .ok_or_else(|| format!("{part:?}: expected key=value"))?;
            let (key, value) = (key.trim(), value.trim());
            if seen.contains(&key) {
                return Err(format!("{key} given twice"));
            }
            seen.push(key);
            match key {
                "read_us" => m.read_latency = parse_us(key, value)?,
                "write_us" => m.write_latency = parse_us(key, value)?,
                "iops" => m.iops = parse_count(key, value)?,
                "bw" => m.bandwidth = parse_bytes(key, value, true)?,
                "drives" => {
                    m.drives = value
                        .parse()
                        .map_err(|_| format!("drives={value}: not a whole number"))?
                }
                "stripe" => {
                    // Stripe units are binary: 128k is 128 KiB.
                    let v = value.trim_end_matches('B');
                    let v = match v.char_indices().last() {
                        Some((i, 'k' | 'K')) => format!("{}Ki", &v[..i]),
                        Some((i, 'm' | 'M')) => format!("{}Mi", &v[..i]),
                        Some((i, 'g' | 'G')) => format!("{}Gi", &v[..i]),
                        _ => v.to_string(),
                    };
                    m.stripe = parse_bytes(key, &v, false)?
                }
                other => {
                    return Err(format!(
                        "unknown key {other:?} (read_us, write_us, iops, bw, drives, stripe)"
                    ));
                }
            }
        }
        if seen.is_empty() {
            return Err(
                "empty SSD model (e.g. read_us=80,write_us=20,iops=1M,bw=7GB/s,drives=4)".into(),
            );
        }
        m.validate()?;
        Ok(m)
    }
}

/// The model's arithmetic on the CPU: the drives' busy-until times, advanced as the kernel
/// advances them (`model_due` in `ptx/emu/gpunvme_controller.cuh` mirrors [`SsdTwin::submit`]).
#[derive(Clone, Debug)]
pub struct SsdTwin {
    model: CtrlNsModel,
    busy: Vec<u64>,
}

impl SsdTwin {
    /// All drives idle.
    pub fn new(model: &SsdModel) -> Self {
        Self {
            model: model.to_ctrl(0),
            busy: vec![0; model.drives.max(1) as usize],
        }
    }

    /// Reserves `svc` ns of drive `drive` starting no earlier than `now`; returns the start
    /// (`drive_reserve` in the CUDA code: its CAS loop computes exactly this).
    pub fn reserve(&mut self, drive: usize, now: u64, svc: u64) -> u64 {
        let start = self.busy[drive].max(now);
        self.busy[drive] = start + svc;
        start
    }

    /// When a Read (`write` false) or Write of `len` bytes at byte `offset` of the namespace,
    /// fetched at `now`, completes.
    pub fn submit(&mut self, now: u64, write: bool, offset: u64, len: u64) -> u64 {
        let m = self.model;
        let shift = m.stripe_shift as u32;
        let mut done = now;
        let mut off = offset;
        let end = offset + len;
        while off < end {
            let unit = off >> shift;
            let piece_end = ((unit + 1) << shift).min(end);
            let drive = (unit % m.drives as u64) as usize;
            let svc = service_ns(&m, piece_end - off);
            let start = self.reserve(drive, now, svc);
            done = done.max(start + svc);
            off = piece_end;
        }
        done + if write { m.write_ns } else { m.read_ns } as u64
    }
}

/// What a closed-loop run of the twin measured ([`closed_loop`]).
#[derive(Clone, Copy, Debug)]
pub struct TwinRun {
    /// Completions per second.
    pub iops: f64,
    /// Mean latency, nanoseconds.
    pub mean_latency_ns: f64,
    /// Shortest latency, nanoseconds.
    pub min_latency_ns: u64,
}

/// Runs `depth` clients against the twin, each issuing its next command (`bytes` at a
/// pseudo-random aligned offset of a `span`-byte namespace) the moment its previous one
/// completes, until `commands` completed: the shape a queue-depth sweep on the GPU shows, with
/// the controller's own costs at zero.
pub fn closed_loop(
    model: &SsdModel,
    depth: usize,
    bytes: u64,
    write: bool,
    span: u64,
    commands: usize,
) -> TwinRun {
    use std::cmp::Reverse;
    use std::collections::BinaryHeap;
    let mut twin = SsdTwin::new(model);
    let mut rng = 0x9e37_79b9_7f4a_7c15u64;
    let mut next_offset = || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        (rng % (span / bytes)) * bytes
    };
    // (due, issued)
    let mut inflight = BinaryHeap::new();
    for _ in 0..depth {
        let due = twin.submit(0, write, next_offset(), bytes);
        inflight.push(Reverse((due, 0u64)));
    }
    let (mut done, mut sum, mut min, mut last) = (0usize, 0u128, u64::MAX, 0u64);
    while done < commands {
        let Reverse((due, issued)) = inflight.pop().expect("depth >= 1");
        done += 1;
        sum += (due - issued) as u128;
        min = min.min(due - issued);
        last = due;
        let next = twin.submit(due, write, next_offset(), bytes);
        inflight.push(Reverse((next, due)));
    }
    TwinRun {
        iops: done as f64 * 1e9 / last.max(1) as f64,
        mean_latency_ns: sum as f64 / done as f64,
        min_latency_ns: min,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gen5x4() -> SsdModel {
        "read_us=80,write_us=20,iops=1000000,bw=7GB/s,drives=4"
            .parse()
            .unwrap()
    }

    #[test]
    fn parses_the_command_line_form() {
        let m = gen5x4();
        assert_eq!(m.read_latency, Duration::from_micros(80));
        assert_eq!(m.write_latency, Duration::from_micros(20));
        assert_eq!(m.iops, 1_000_000);
        assert_eq!(m.bandwidth, 7_000_000_000);
        assert_eq!(m.drives, 4);
        assert_eq!(m.stripe, 128 << 10);
        let m: SsdModel = "read_us=7.5, iops=2.5M, bw=3.5GiB/s, stripe=1MiB, drives=64"
            .parse()
            .unwrap();
        assert_eq!(m.read_latency, Duration::from_nanos(7500));
        assert_eq!(m.write_latency, Duration::from_micros(20), "default kept");
        assert_eq!(m.iops, 2_500_000);
        assert_eq!(m.bandwidth, 3_758_096_384);
        assert_eq!(m.stripe, 1 << 20);
        assert_eq!(m.drives, 64);
        let m: SsdModel = "bw=900MB/s,stripe=64k,iops=0".parse().unwrap();
        assert_eq!((m.bandwidth, m.stripe, m.iops), (900_000_000, 64 << 10, 0));
        let m: SsdModel = "bw=0,stripe=4096".parse().unwrap();
        assert_eq!((m.bandwidth, m.stripe), (0, 4096));
        // Round trip through the printed form.
        for m in [gen5x4(), SsdModel::default(), m] {
            assert_eq!(m.to_string().parse::<SsdModel>().unwrap(), m);
        }
    }

    #[test]
    fn refuses_what_the_kernel_cannot_model() {
        for bad in [
            "",
            "read_us",
            "read_us=abc",
            "read_us=-1",
            "latency=5",
            "drives=0",
            "drives=65",
            "stripe=3000",
            "stripe=2k",
            "stripe=2GiB",
            "bw=7XB/s",
            "bw=1000",
            "iops=many",
            "drives=2,drives=4",
        ] {
            assert!(bad.parse::<SsdModel>().is_err(), "{bad:?} accepted");
        }
    }

    #[test]
    fn table_entry_rounds_rates_up() {
        let m: SsdModel = "iops=3M,bw=7GB/s,drives=4,stripe=128k".parse().unwrap();
        let c = m.to_ctrl(0x1000);
        assert_eq!(c.op_ns, 334, "1e9 / 3e6 = 333.3 ns, rounded up");
        assert_eq!((c.drives, c.stripe_shift, c.busy), (4, 17, 0x1000));
        assert_eq!((c.read_ns, c.write_ns), (80_000, 20_000));
        // 4 KiB at 7 GB/s: 585.1 ns -> 586, longer than the 334 ns IOPS slot.
        assert_eq!(service_ns(&c, 4096), 586);
        // 64 bytes: the IOPS slot.
        assert_eq!(service_ns(&c, 64), 334);
        // 128 KiB: 18724.6 ns -> 18725, the bandwidth cap dominates.
        assert_eq!(service_ns(&c, 128 << 10), 18_725);
        let uncapped = SsdModel {
            iops: 0,
            bandwidth: 0,
            ..m
        };
        assert_eq!(service_ns(&uncapped.to_ctrl(0), 1 << 20), 0);
        assert!(uncapped.max_iops(4096).is_infinite());
    }

    #[test]
    fn striping_sends_units_to_drives_in_turn() {
        let m: SsdModel = "read_us=10,iops=1M,bw=0,drives=4,stripe=128k"
            .parse()
            .unwrap();
        let mut t = SsdTwin::new(&m);
        // 512 KiB from 0 covers units 0..4: one piece per drive, all start at once.
        let due = t.submit(0, false, 0, 512 << 10);
        assert_eq!(due, 1000 + 10_000);
        assert_eq!(t.busy, vec![1000; 4]);
        // Unaligned: 8 KiB straddling units 4 and 5 -> drives 0 and 1 again.
        let due = t.submit(0, false, (5 << 17) - 4096, 8192);
        assert_eq!(due, 2000 + 10_000);
        assert_eq!(t.busy, vec![2000, 2000, 1000, 1000]);
        // An idle drive starts at `now`, not at its stale busy time.
        let due = t.submit(50_000, true, 2 << 17, 4096);
        assert_eq!(due, 51_000 + 20_000);
    }

    #[test]
    fn queue_depth_sweep_shows_fixed_latency_then_the_iops_cap() {
        let m = gen5x4();
        let cap = 4.0 * 1e6;
        let span = 1u64 << 30;
        let qd1 = closed_loop(&m, 1, 4096, false, span, 2000);
        // Depth 1: every read takes its service (the 1 µs IOPS slot) plus the 80 µs latency.
        assert_eq!(qd1.min_latency_ns, 81_000);
        assert!((qd1.mean_latency_ns - 81_000.0).abs() < 1.0, "{qd1:?}");
        assert!(
            (qd1.iops - 1e9 / 81_000.0).abs() / qd1.iops < 0.01,
            "{qd1:?}"
        );
        let mut last = 0.0;
        for depth in [1usize, 4, 16, 64, 256, 1024, 4096] {
            let r = closed_loop(&m, depth, 4096, false, span, 200_000);
            // Never above the cap (whole nanoseconds, rounded up) ...
            assert!(r.iops <= cap * 1.0001, "depth {depth}: {r:?}");
            // ... never faster than the fixed latency ...
            assert!(r.min_latency_ns >= 81_000, "depth {depth}: {r:?}");
            // ... and more depth never lowers throughput by more than noise.
            assert!(r.iops >= last * 0.98, "depth {depth}: {r:?} after {last}");
            last = r.iops;
            if depth <= 64 {
                // Latency-bound: Little's law with the fixed latency.
                let want = depth as f64 * 1e9 / 81_000.0;
                assert!((r.iops - want).abs() / want < 0.05, "depth {depth}: {r:?}");
            }
            if depth >= 1024 {
                // Drive-bound: at the cap (random offsets keep all four drives busy), and the
                // extra depth waits in the drives' queues.
                assert!(r.iops > cap * 0.9, "depth {depth}: {r:?}");
                assert!(r.mean_latency_ns > 81_000.0 * 2.0, "depth {depth}: {r:?}");
            }
        }
    }

    #[test]
    fn large_transfers_are_bandwidth_bound() {
        let m = gen5x4();
        // 128 KiB aligned reads: one stripe unit, one drive each; 18.7 µs of service.
        let r = closed_loop(&m, 512, 128 << 10, false, 1 << 30, 50_000);
        let bw = r.iops * (128 << 10) as f64;
        assert!(bw <= 4.0 * 7e9 * 1.0001, "{bw}");
        assert!(bw > 4.0 * 7e9 * 0.85, "{bw}");
        assert!((m.max_iops(128 << 10) - 4.0 * 1e9 / 18_725.0).abs() < 1e-6);
        // Writes: same drive time, the shorter fixed latency.
        let w = closed_loop(&m, 1, 128 << 10, true, 1 << 30, 100);
        assert_eq!(w.min_latency_ns, 18_725 + 20_000);
    }
}
