//! A fio-style load generator over the driver's I/O queue pairs: one thread per queue pair,
//! `qd` I/Os in flight on each, latency recorded per I/O, optional byte-for-byte verification.
//!
//! Verification uses [`gpu_queues::pattern`]: every block's content is a function of the run's seed
//! and its LBA. Reads check every byte of every completed I/O against a region written with the
//! pattern beforehand (not timed); writes write the pattern and, after the timed phase, every
//! unit written is read back and checked.

use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Barrier};
use std::time::{Duration, Instant};

/// Why a perf run could not be made (I/O errors during a run are counted in the report, not
/// returned).
#[derive(Debug, thiserror::Error)]
pub enum PerfError {
    /// A parameter does not fit the device or the run (the message names the option).
    #[error("{0}")]
    InvalidArgument(String),
    /// The driver refused a step of setting the run up.
    #[error("{op}")]
    Driver {
        /// What perf was doing.
        op: &'static str,
        /// The driver's error.
        #[source]
        source: nvme::Error,
    },
    /// DMA memory for the I/O buffers could not be had.
    #[error("allocating DMA memory for the I/O buffers")]
    Dma(#[source] nvme::DmaAllocError),
    /// Writing the pattern a `verify` read run checks against failed.
    #[error("writing the verification pattern failed: {0}")]
    Prefill(String),
    /// [`PerfConfig::interrupt`] was set before the timed run started.
    #[error("interrupted while writing the verification pattern (before the timed run)")]
    Interrupted,
}

/// A perf run's result.
pub type Result<T, E = PerfError> = std::result::Result<T, E>;

/// `bail!` for [`PerfError::InvalidArgument`].
macro_rules! invalid {
    ($($arg:tt)*) => {
        return Err(PerfError::InvalidArgument(format!($($arg)*)))
    };
}

/// `ensure!` for [`PerfError::InvalidArgument`].
macro_rules! require {
    ($cond:expr, $($arg:tt)*) => {
        if !$cond {
            invalid!($($arg)*);
        }
    };
}
use hdrhistogram::Histogram;
use nvme::{Controller, DmaSlice, IoCompletion, IoQueuePair};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use serde::Serialize;

use gpunvme::pattern;

/// The access pattern, named as fio names it (also the `--rw` values of `gpunvme perf`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, clap::ValueEnum)]
#[serde(rename_all = "lowercase")]
pub enum RwMode {
    /// Sequential reads.
    Read,
    /// Sequential writes.
    Write,
    /// Uniformly random reads.
    #[value(name = "randread")]
    RandRead,
    /// Uniformly random writes.
    #[value(name = "randwrite")]
    RandWrite,
}

impl RwMode {
    /// Whether the pattern writes.
    pub fn is_write(self) -> bool {
        matches!(self, Self::Write | Self::RandWrite)
    }
    fn is_random(self) -> bool {
        matches!(self, Self::RandRead | Self::RandWrite)
    }
    /// fio's name for the mode.
    pub fn name(self) -> &'static str {
        match self {
            Self::Read => "read",
            Self::Write => "write",
            Self::RandRead => "randread",
            Self::RandWrite => "randwrite",
        }
    }
}

/// When a run ends.
#[derive(Debug, Clone, Copy)]
pub enum Stop {
    /// After this much time.
    Runtime(Duration),
    /// After this many I/Os in total, over all queues.
    Ios(u64),
}

/// One perf run's parameters.
#[derive(Debug, Clone)]
pub struct PerfConfig {
    /// Access pattern.
    pub rw: RwMode,
    /// Bytes per I/O (a multiple of the LBA size); split into several commands above the
    /// controller's maximum transfer size.
    pub bs: usize,
    /// I/Os in flight per queue.
    pub qd: usize,
    /// Queue pairs, one thread each.
    pub queues: usize,
    /// When to stop.
    pub stop: Stop,
    /// Write known patterns and check every byte read.
    pub verify: bool,
    /// Namespace to run on.
    pub nsid: u32,
    /// Bytes of the namespace, from LBA 0, that the run touches (`None`: the whole namespace,
    /// at most [`DEFAULT_REGION_BYTES`]).
    pub size: Option<u64>,
    /// Seed of the pattern and of random offsets (`None`: a fresh one per run, so stale data
    /// from an earlier run can never pass verification).
    pub seed: Option<u64>,
    /// Set (by a Ctrl-C handler) to end the run early: workers stop issuing, wait for what is
    /// in flight, and the report covers the I/Os done so far (a write run's written units are
    /// still read back with `verify`). Set during a `verify` read run's prefill, the run fails.
    pub interrupt: Option<&'static AtomicBool>,
}

/// Default working-set size: the whole namespace up to this many bytes.
pub const DEFAULT_REGION_BYTES: u64 = 1 << 30;

/// Latency percentiles in nanoseconds.
#[derive(Debug, Clone, Serialize)]
pub struct Latency {
    /// Mean.
    pub mean: f64,
    /// Median.
    pub p50: u64,
    /// 99th percentile.
    pub p99: u64,
    /// 99.9th percentile.
    pub p999: u64,
    /// Maximum.
    pub max: u64,
}

/// What a run measured (keys as fio names them).
#[derive(Debug, Clone, Serialize)]
pub struct PerfReport {
    /// Access pattern.
    pub rw: RwMode,
    /// Bytes per I/O.
    pub bs: usize,
    /// I/Os in flight per queue.
    pub qd: usize,
    /// Queue pairs used.
    pub queues: usize,
    /// I/Os completed in the timed phase.
    pub ios: u64,
    /// I/Os per second.
    pub iops: f64,
    /// Bytes per second.
    pub bw_bytes: f64,
    /// Latency of one I/O, submission to completion.
    pub lat_ns: Latency,
    /// Failed I/Os plus verification mismatches.
    pub errors: u64,
    /// Of `errors`, blocks whose bytes did not match the pattern.
    pub verify_errors: u64,
    /// Bytes checked against the pattern.
    pub verified_bytes: u64,
    /// Duration of the timed phase.
    pub runtime_ns: u64,
    /// First error seen, for humans.
    pub first_error: Option<String>,
    /// Which transport carried the I/O.
    pub data_path: String,
}

impl std::fmt::Display for PerfReport {
    /// fio-style text: the data path, the rates, latencies in human units and the runtime, and
    /// what verification checked.
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        use gpunvme::units::{format_bytes, format_ns};
        writeln!(f, "data path: {}", self.data_path)?;
        writeln!(
            f,
            "{}: bs={} qd={} queues={}: IOPS={:.0}, BW={}/s, ios={}, errors={}",
            self.rw.name(),
            self.bs,
            self.qd,
            self.queues,
            self.iops,
            format_bytes(self.bw_bytes),
            self.ios,
            self.errors
        )?;
        write!(
            f,
            "  lat: mean={} p50={} p99={} p99.9={} max={}; runtime {}",
            format_ns(self.lat_ns.mean),
            format_ns(self.lat_ns.p50 as f64),
            format_ns(self.lat_ns.p99 as f64),
            format_ns(self.lat_ns.p999 as f64),
            format_ns(self.lat_ns.max as f64),
            format_ns(self.runtime_ns as f64)
        )?;
        if self.verified_bytes > 0 || self.verify_errors > 0 {
            write!(
                f,
                "\n  verify: {} checked, {} mismatching I/Os",
                format_bytes(self.verified_bytes as f64),
                self.verify_errors
            )?;
        }
        Ok(())
    }
}

/// Where a worker takes its next I/O's starting unit (a unit is `bs` bytes).
#[derive(Clone)]
enum Units {
    /// `start..end`, in order, wrapping.
    Sequential { start: u64, end: u64, next: u64 },
    /// Uniform over `0..units`.
    Random { units: u64, rng: SmallRng },
    /// Exactly these units, once each.
    List(Vec<u64>),
}

impl Units {
    fn next(&mut self) -> Option<u64> {
        match self {
            Self::Sequential { start, end, next } => {
                let u = *next;
                *next = if u + 1 >= *end { *start } else { u + 1 };
                Some(u)
            }
            Self::Random { units, rng } => Some(rng.random_range(0..*units)),
            Self::List(list) => list.pop(),
        }
    }
}

/// One worker's orders.
struct Plan {
    write: bool,
    /// Check read data against the pattern.
    check: bool,
    units: Units,
    /// I/Os to issue (`None`: until `deadline`).
    ios: Option<u64>,
    deadline: Option<Instant>,
    /// Record units written (for verification afterwards).
    track_written: bool,
    /// Stop issuing once this is set.
    interrupt: Option<&'static AtomicBool>,
}

/// Shared, read-only parameters of every worker.
#[derive(Clone, Copy)]
struct Geometry {
    nsid: u32,
    lba_size: usize,
    bs: usize,
    qd: usize,
    /// Bytes per NVMe command (≤ the controller's maximum transfer).
    chunk: usize,
    seed: u64,
    total_units: u64,
}

impl Geometry {
    fn blocks_per_unit(&self) -> u64 {
        (self.bs / self.lba_size) as u64
    }
    fn commands_per_io(&self) -> usize {
        self.bs.div_ceil(self.chunk)
    }
}

#[derive(Default)]
struct WorkerResult {
    ios: u64,
    errors: u64,
    verify_errors: u64,
    verified_bytes: u64,
    first_error: Option<String>,
    written: Vec<u64>,
    hist: Option<Histogram<u64>>,
    /// When the worker passed the start barrier (before its first I/O) and when its last I/O
    /// completed.
    span: Option<(Instant, Instant)>,
}

struct Slot {
    unit: u64,
    pending: usize,
    failed: bool,
    started: Instant,
}

fn new_histogram() -> Histogram<u64> {
    // 1 ns .. 1 hour at 3 significant digits.
    Histogram::new_with_bounds(1, 3_600_000_000_000, 3).expect("valid histogram bounds")
}

/// Runs one worker to completion on its queue pair.
fn run_worker(
    qp: &mut IoQueuePair,
    buf: &Arc<nvme::DmaMemory>,
    geo: Geometry,
    mut plan: Plan,
    start: &Barrier,
) -> WorkerResult {
    let mut res = WorkerResult {
        hist: Some(new_histogram()),
        ..Default::default()
    };
    let mut staging = vec![0u8; geo.bs];
    let whole = DmaSlice::whole(buf.clone());
    let mut slots: Vec<Slot> = (0..geo.qd)
        .map(|_| Slot {
            unit: 0,
            pending: 0,
            failed: false,
            started: Instant::now(),
        })
        .collect();
    if plan.write && !plan.check {
        // Content is irrelevant without verification; fill once so writes carry real data.
        for s in 0..geo.qd {
            pattern::fill(&mut staging, geo.seed, geo.nsid, 0, geo.lba_size);
            buf.write(s * geo.bs, &staging);
        }
    }
    let mut written = if plan.track_written {
        vec![0u64; geo.total_units.div_ceil(64) as usize]
    } else {
        Vec::new()
    };
    let mut issued = 0u64;
    let mut in_flight = 0usize;
    let mut comps: Vec<IoCompletion> = Vec::with_capacity(geo.qd * geo.commands_per_io());
    let note_error = |res: &mut WorkerResult, msg: String| {
        if res.first_error.is_none() {
            res.first_error = Some(msg);
        }
    };
    start.wait();
    // Taken before this worker's first I/O; the run's clock starts at the earliest of these.
    let started = Instant::now();

    let may_issue = |issued: u64, plan: &Plan| -> bool {
        if plan.interrupt.is_some_and(|f| f.load(Ordering::Relaxed)) {
            return false;
        }
        if let Some(n) = plan.ios {
            if issued >= n {
                return false;
            }
        }
        if let Some(d) = plan.deadline {
            if Instant::now() >= d {
                return false;
            }
        }
        true
    };

    // Starts one I/O in `slot`; returns false when the unit source is exhausted or the queue
    // refused the command (the error is recorded).
    let start_io = |slot_ix: usize,
                    slots: &mut [Slot],
                    plan: &mut Plan,
                    qp: &mut IoQueuePair,
                    staging: &mut [u8],
                    res: &mut WorkerResult|
     -> std::result::Result<bool, String> {
        let Some(unit) = plan.units.next() else {
            return Ok(false);
        };
        let lba = unit * geo.blocks_per_unit();
        let off = slot_ix * geo.bs;
        if plan.write && plan.check {
            pattern::fill(staging, geo.seed, geo.nsid, lba, geo.lba_size);
            buf.write(off, staging);
        }
        let slot = &mut slots[slot_ix];
        slot.unit = unit;
        slot.failed = false;
        slot.pending = 0;
        slot.started = Instant::now();
        let mut done = 0usize;
        while done < geo.bs {
            let len = geo.chunk.min(geo.bs - done);
            let slice = whole.slice(off + done, len);
            let cmd_lba = lba + (done / geo.lba_size) as u64;
            // Queued without a doorbell: the next `wait` rings once for everything queued
            // since (the borrowed-buffer calls also spare a reference count per command).
            let queued = if plan.write {
                qp.queue_write(geo.nsid, cmd_lba, &slice, slot_ix as u64)
            } else {
                qp.queue_read(geo.nsid, cmd_lba, &slice, slot_ix as u64)
            };
            if let Err(e) = queued {
                res.errors += 1;
                return Err(format!("submitting on queue {}: {e}", qp.qid()));
            }
            slot.pending += 1;
            done += len;
        }
        Ok(true)
    };

    for s in 0..geo.qd {
        if !may_issue(issued, &plan) {
            break;
        }
        match start_io(s, &mut slots, &mut plan, qp, &mut staging, &mut res) {
            Ok(true) => {
                issued += 1;
                in_flight += 1;
            }
            Ok(false) => break,
            Err(msg) => {
                note_error(&mut res, msg);
                break;
            }
        }
    }

    let mut stopped = false;
    while in_flight > 0 {
        comps.clear();
        if let Err(e) = qp.wait(&mut comps, 1) {
            // The queue pair failed (timeout, controller fatal): whatever is in flight is lost.
            res.errors += in_flight as u64;
            note_error(&mut res, format!("queue {}: {e}", qp.qid()));
            break;
        }
        for c in comps.drain(..) {
            let s = c.tag as usize;
            if let Err(e) = c.result {
                if !slots[s].failed {
                    note_error(&mut res, e.to_string());
                }
                slots[s].failed = true;
            }
            slots[s].pending -= 1;
            if slots[s].pending > 0 {
                continue;
            }
            // The I/O in slot `s` is complete.
            in_flight -= 1;
            let lat = slots[s].started.elapsed().as_nanos() as u64;
            if let Some(h) = res.hist.as_mut() {
                h.saturating_record(lat.max(1));
            }
            res.ios += 1;
            let unit = slots[s].unit;
            if slots[s].failed {
                res.errors += 1;
            } else if plan.check && !plan.write {
                buf.read(s * geo.bs, &mut staging);
                let lba = unit * geo.blocks_per_unit();
                if let Some(bad) = pattern::check(&staging, geo.seed, geo.nsid, lba, geo.lba_size) {
                    res.verify_errors += 1;
                    res.errors += 1;
                    note_error(
                        &mut res,
                        format!(
                            "verify: nsid {} lba {bad}: data differs from what was written",
                            geo.nsid
                        ),
                    );
                } else {
                    res.verified_bytes += geo.bs as u64;
                }
            } else if plan.track_written {
                written[(unit / 64) as usize] |= 1 << (unit % 64);
            }
            if !stopped && may_issue(issued, &plan) {
                match start_io(s, &mut slots, &mut plan, qp, &mut staging, &mut res) {
                    Ok(true) => {
                        issued += 1;
                        in_flight += 1;
                    }
                    Ok(false) => stopped = true,
                    Err(msg) => {
                        note_error(&mut res, msg);
                        stopped = true;
                    }
                }
            }
        }
    }
    res.written = written;
    res.span = Some((started, Instant::now()));
    res
}

/// Runs `plans` (one per queue pair) in parallel; returns their results and the wall time from
/// the first worker's start (taken before any I/O is issued) to the last worker's last
/// completion.
fn run_workers(
    qps: &mut [IoQueuePair],
    bufs: &[Arc<nvme::DmaMemory>],
    geo: Geometry,
    plans: Vec<Plan>,
) -> (Vec<WorkerResult>, Duration) {
    let barrier = Barrier::new(plans.len());
    std::thread::scope(|scope| {
        let handles: Vec<_> = qps
            .iter_mut()
            .zip(bufs)
            .zip(plans)
            .map(|((qp, buf), plan)| {
                let barrier = &barrier;
                scope.spawn(move || run_worker(qp, buf, geo, plan, barrier))
            })
            .collect();
        let results: Vec<WorkerResult> = handles
            .into_iter()
            .map(|h| h.join().expect("perf worker panicked"))
            .collect();
        let first = results.iter().filter_map(|r| r.span).map(|s| s.0).min();
        let last = results.iter().filter_map(|r| r.span).map(|s| s.1).max();
        let elapsed = match (first, last) {
            (Some(a), Some(b)) => b.saturating_duration_since(a),
            _ => Duration::ZERO,
        };
        (results, elapsed)
    })
}

/// Runs one perf job on `ctrl` and reports what it measured.
pub fn run(ctrl: &Controller, cfg: &PerfConfig) -> Result<PerfReport> {
    let ns = ctrl
        .namespace(cfg.nsid)
        .map_err(|source| PerfError::Driver {
            op: "finding the namespace",
            source,
        })?
        .clone();
    let lba_size = ns.lba_size as usize;
    require!(cfg.qd >= 1, "--qd must be at least 1");
    match cfg.stop {
        Stop::Ios(0) => invalid!("--ios must be at least 1"),
        Stop::Runtime(d) if d.is_zero() => invalid!("--runtime must be more than 0"),
        _ => {}
    }
    require!(cfg.queues >= 1, "--queues must be at least 1");
    require!(
        cfg.bs >= lba_size && cfg.bs % lba_size == 0,
        "--bs {} is not a whole number of namespace {}'s {}-byte LBAs",
        cfg.bs,
        cfg.nsid,
        lba_size
    );
    let ns_bytes = ns.blocks * lba_size as u64;
    let region = match cfg.size {
        Some(s) => {
            require!(
                s <= ns_bytes,
                "--size {s} is larger than namespace {} ({ns_bytes} bytes)",
                cfg.nsid
            );
            s
        }
        None => ns_bytes.min(DEFAULT_REGION_BYTES),
    };
    let total_units = region / cfg.bs as u64;
    require!(
        total_units >= cfg.queues as u64,
        "the region of {region} bytes holds fewer than one {}-byte I/O per queue",
        cfg.bs
    );
    let max_queues = ctrl.info().max_io_queue_pairs as usize;
    require!(
        cfg.queues <= max_queues,
        "--queues {} but the controller granted {max_queues} I/O queue pairs",
        cfg.queues
    );
    let chunk = ctrl.info().max_transfer_bytes / lba_size * lba_size;
    let geo = Geometry {
        nsid: cfg.nsid,
        lba_size,
        bs: cfg.bs,
        qd: cfg.qd,
        chunk,
        seed: cfg.seed.unwrap_or_else(rand::random),
        total_units,
    };
    // One queue holds qd I/Os of commands_per_io commands each, plus the slot a full ring
    // leaves empty.
    let entries = (ctrl.info().mqes_entries as usize).min(u16::MAX as usize);
    let max_qd = (entries - 1) / geo.commands_per_io();
    require!(
        geo.qd <= max_qd,
        "--qd {} is out of range: 1 to {max_qd} here (queues of at most {entries} entries, {} command(s) per {}-byte I/O)",
        cfg.qd,
        geo.commands_per_io(),
        cfg.bs
    );
    let Ok(depth) = u16::try_from(geo.qd * geo.commands_per_io() + 1) else {
        invalid!("--qd × commands per I/O is too deep a queue");
    };
    let mut qps = Vec::with_capacity(cfg.queues);
    for _ in 0..cfg.queues {
        let qp = ctrl
            .create_io_queue_pair(depth)
            .map_err(|source| PerfError::Driver {
                op: "creating an I/O queue pair",
                source,
            })?;
        if qp.capacity() < geo.qd * geo.commands_per_io() {
            invalid!(
                "--qd {} needs {} commands in flight per queue (bs {} is {} command(s) of at most {} bytes), but queues hold {}",
                cfg.qd,
                geo.qd * geo.commands_per_io(),
                cfg.bs,
                geo.commands_per_io(),
                chunk,
                qp.capacity()
            );
        }
        qps.push(qp);
    }
    let bufs = (0..cfg.queues)
        .map(|_| ctrl.device().alloc_dma(geo.qd * geo.bs).map(Arc::new))
        .collect::<std::result::Result<Vec<_>, _>>()
        .map_err(PerfError::Dma)?;

    // Units each worker owns for sequential access (and for the read-verify prefill).
    let stripe = |w: usize| -> (u64, u64) {
        let per = total_units / cfg.queues as u64;
        let start = w as u64 * per;
        let end = if w + 1 == cfg.queues {
            total_units
        } else {
            start + per
        };
        (start, end)
    };

    if cfg.verify && !cfg.rw.is_write() {
        // Lay the pattern down over the whole region first (not timed).
        let plans = (0..cfg.queues)
            .map(|w| {
                let (start, end) = stripe(w);
                Plan {
                    write: true,
                    check: true,
                    units: Units::List((start..end).rev().collect()),
                    ios: None,
                    deadline: None,
                    track_written: false,
                    interrupt: cfg.interrupt,
                }
            })
            .collect();
        let (results, _) = run_workers(&mut qps, &bufs, geo, plans);
        if cfg.interrupt.is_some_and(|f| f.load(Ordering::Relaxed)) {
            return Err(PerfError::Interrupted);
        }
        for r in &results {
            if r.errors > 0 {
                return Err(PerfError::Prefill(
                    r.first_error.as_deref().unwrap_or("unknown error").into(),
                ));
            }
        }
    }

    let per_worker_ios = |w: usize| -> Option<u64> {
        match cfg.stop {
            Stop::Ios(n) => {
                let q = cfg.queues as u64;
                Some(n / q + u64::from((w as u64) < n % q))
            }
            Stop::Runtime(_) => None,
        }
    };
    let deadline = match cfg.stop {
        Stop::Runtime(d) => Some(Instant::now() + d),
        Stop::Ios(_) => None,
    };
    let plans = (0..cfg.queues)
        .map(|w| {
            let units = if cfg.rw.is_random() {
                Units::Random {
                    units: total_units,
                    rng: SmallRng::seed_from_u64(geo.seed ^ (w as u64).wrapping_mul(0x9e37_79b9)),
                }
            } else {
                let (start, end) = stripe(w);
                Units::Sequential {
                    start,
                    end,
                    next: start,
                }
            };
            Plan {
                write: cfg.rw.is_write(),
                check: cfg.verify,
                units,
                ios: per_worker_ios(w),
                deadline,
                track_written: cfg.verify && cfg.rw.is_write(),
                interrupt: cfg.interrupt,
            }
        })
        .collect();
    let (results, elapsed) = run_workers(&mut qps, &bufs, geo, plans);

    let mut hist = new_histogram();
    let mut ios = 0;
    let mut errors = 0;
    let mut verify_errors = 0;
    let mut verified_bytes = 0;
    let mut first_error = None;
    let mut written = vec![0u64; total_units.div_ceil(64) as usize];
    for r in results {
        ios += r.ios;
        errors += r.errors;
        verify_errors += r.verify_errors;
        verified_bytes += r.verified_bytes;
        if first_error.is_none() {
            first_error = r.first_error;
        }
        if let Some(h) = r.hist {
            hist.add(h).expect("histograms share bounds");
        }
        for (acc, w) in written.iter_mut().zip(&r.written) {
            *acc |= w;
        }
    }

    if cfg.verify && cfg.rw.is_write() {
        // Read back every unit written and check it (not timed).
        let units: Vec<u64> = (0..total_units)
            .filter(|u| written[(u / 64) as usize] & (1 << (u % 64)) != 0)
            .collect();
        let per = units.len().div_ceil(cfg.queues).max(1);
        let mut chunks: Vec<Vec<u64>> = units.chunks(per).map(<[u64]>::to_vec).collect();
        chunks.resize(cfg.queues, Vec::new());
        let plans = chunks
            .into_iter()
            .map(|list| Plan {
                write: false,
                check: true,
                units: Units::List(list),
                ios: None,
                deadline: None,
                track_written: false,
                interrupt: None,
            })
            .collect();
        let (results, _) = run_workers(&mut qps, &bufs, geo, plans);
        for r in results {
            errors += r.errors;
            verify_errors += r.verify_errors;
            verified_bytes += r.verified_bytes;
            if first_error.is_none() {
                first_error = r.first_error;
            }
        }
    }
    drop(qps);

    let secs = elapsed.as_secs_f64().max(1e-9);
    Ok(PerfReport {
        rw: cfg.rw,
        bs: cfg.bs,
        qd: cfg.qd,
        queues: cfg.queues,
        ios,
        iops: ios as f64 / secs,
        bw_bytes: (ios * cfg.bs as u64) as f64 / secs,
        lat_ns: Latency {
            mean: hist.mean(),
            p50: hist.value_at_quantile(0.5),
            p99: hist.value_at_quantile(0.99),
            p999: hist.value_at_quantile(0.999),
            max: hist.max(),
        },
        errors,
        verify_errors,
        verified_bytes,
        runtime_ns: elapsed.as_nanos() as u64,
        first_error,
        data_path: ctrl.device().describe(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme::ControllerOptions;
    use nvme_emu::{EmuConfig, EmuDevice, NamespaceConfig};

    fn controller() -> Controller {
        let device = EmuDevice::start(EmuConfig {
            namespaces: vec![NamespaceConfig::memory(8 << 20, 512)],
            ..EmuConfig::default()
        })
        .unwrap();
        Controller::new(device, ControllerOptions::default()).unwrap()
    }

    fn config(rw: RwMode) -> PerfConfig {
        PerfConfig {
            rw,
            bs: 4096,
            qd: 8,
            queues: 1,
            stop: Stop::Ios(200),
            verify: true,
            nsid: 1,
            size: None,
            seed: Some(3),
            interrupt: None,
        }
    }

    #[test]
    fn typed_errors_and_a_consistent_clock() {
        let ctrl = controller();
        for (cfg, want) in [
            (
                PerfConfig {
                    qd: 100_000,
                    ..config(RwMode::Read)
                },
                "--qd 100000 is out of range: 1 to ",
            ),
            (
                PerfConfig {
                    stop: Stop::Ios(0),
                    ..config(RwMode::Read)
                },
                "--ios must be at least 1",
            ),
            (
                PerfConfig {
                    bs: 1000,
                    ..config(RwMode::Read)
                },
                "not a whole number",
            ),
        ] {
            match run(&ctrl, &cfg) {
                Err(PerfError::InvalidArgument(m)) => assert!(m.contains(want), "{m}"),
                other => panic!("expected InvalidArgument({want}), got {other:?}"),
            }
        }
        assert!(matches!(
            run(
                &ctrl,
                &PerfConfig {
                    nsid: 9,
                    ..config(RwMode::Read)
                }
            ),
            Err(PerfError::Driver { .. })
        ));
        for rw in [RwMode::Read, RwMode::RandWrite] {
            let r = run(&ctrl, &config(rw)).unwrap();
            assert_eq!((r.ios, r.errors), (200, 0));
            assert!(
                r.lat_ns.max <= r.runtime_ns,
                "an I/O outlasted the run: {r:?}"
            );
        }
        // Interrupted before it starts: nothing is issued.
        static STOP: AtomicBool = AtomicBool::new(true);
        let r = run(
            &ctrl,
            &PerfConfig {
                verify: false,
                interrupt: Some(&STOP),
                ..config(RwMode::RandRead)
            },
        )
        .unwrap();
        assert_eq!(r.ios, 0);
        assert!(matches!(
            run(
                &ctrl,
                &PerfConfig {
                    interrupt: Some(&STOP),
                    ..config(RwMode::RandRead)
                }
            ),
            Err(PerfError::Interrupted)
        ));
        ctrl.shutdown().unwrap();
    }
}
