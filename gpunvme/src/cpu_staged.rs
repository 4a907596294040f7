//! Staged reads issued by this process's CPU on a controller a `gpunvme serve` daemon owns:
//! file ranges read by Read commands on lent CPU queue pairs straight into lent host memory
//! (a bounce cut in [`Windows`]), and a copy engine moving each window into GPU memory.
//!
//! Why a CPU issues these and not GPU threads (docs/serve.md): behind a daemon the bytes
//! cross host memory either way (the controller reaches only what the daemon lends), so GPU
//! threads issuing the commands save nothing, and without MPS the file kernels of several
//! processes on one GPU are time-sliced, one process's at a time, while copy engines of
//! several processes run side by side. A CPU-issued load also needs no GPU queues, kernels or
//! queue memory registered with CUDA before its first read.
//!
//! Each window is filled by its commands, then copied out on a stream of its own with an
//! event behind the copy; a window is filled again only once its event has passed. The
//! bounce's registration with CUDA and the destination's allocation run beside the first
//! reads (the caller's `ready`, asked for when the first window is full). Every wait is
//! bounded: a command that does not complete within [`STALL`] of the last progress fails the
//! job, and the watchdog is asked every millisecond.

use std::sync::Arc;
use std::time::{Duration, Instant};

use blockfs::table::ExtentTable;
use gpu_queues::ffi::{DeviceMemory, Event, Placement, Stream};

use gpunvme_serve_client::{Arena, QueuePair};

use crate::error::{Error, ErrorKind, Result};
use crate::open::ServedReads;
use crate::staged::{Piece, StagedOutcome, StagedRead, plan_windows};

/// How the bounce is cut: `count` windows of `bytes` each. While some are copied out, the
/// others are read into; each window is registered with CUDA on its own, beside the reads
/// (about 0.3-0.6 ms per MiB), so the first copy waits for one window's registration, not the
/// whole bounce's.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Windows {
    /// Windows (2 to 64).
    pub count: usize,
    /// Bytes of each (whole pages, 8 KiB to 256 MiB).
    pub bytes: u64,
}

impl Default for Windows {
    fn default() -> Self {
        Self {
            count: 4,
            bytes: 4 << 20,
        }
    }
}

impl Windows {
    /// `GPUNVME_SERVED_WINDOWS=COUNTxMIB` (e.g. `4x4`, the default), bounded; anything else is
    /// refused by name.
    pub fn from_env() -> Result<Self> {
        let setting = gpunvme_settings::SERVED_WINDOWS;
        match setting.value() {
            None => Ok(Self::default()),
            Some(v) => {
                Self::parse(&v).ok_or_else(|| Error::invalid(setting.invalid(&v).to_string()))
            }
        }
    }

    /// `COUNTxMIB`, bounded as [`Windows::from_env`] says.
    pub fn parse(v: &str) -> Option<Self> {
        let (c, m) = v.split_once('x')?;
        let (c, m) = (
            c.trim().parse::<usize>().ok()?,
            m.trim().parse::<u64>().ok()?,
        );
        ((2..=64).contains(&c) && (1..=256).contains(&m)).then_some(Self {
            count: c,
            bytes: m << 20,
        })
    }

    /// The bounce bytes a job of `total` bytes uses: `count` windows of `bytes`, or smaller
    /// windows for a small job.
    pub fn bounce_bytes(self, total: u64) -> u64 {
        self.count as u64 * self.window_for(total)
    }

    fn window_for(self, total: u64) -> u64 {
        // Room for a read's rounding to whole LBAs at both ends and one alignment gap.
        self.bytes
            .min((total + 3 * ALIGN).next_multiple_of(ALIGN))
            .max(2 * ALIGN)
    }
}

/// How long the job may go without a command completing or a copy passing.
pub const STALL: Duration = Duration::from_secs(10);

/// The largest transfer one command is given (one PRP list page describes 2 MiB and a page).
const PRP_LIMIT: u64 = 2 << 20;

/// File offsets keep this alignment in the bounce (as in [`crate::staged`]).
const ALIGN: u64 = 4096;

/// How a served load's data path reads, in words (reports).
pub const DATA_PATH: &str = "a CPU thread of this process issues NVMe reads on queue pairs a \
    daemon lent, data into a lent bounce in host memory by PRPs, then by copy engines into GPU \
    memory (four windows, reads of some beside the copy of another); extents from blockfs on \
    the host";

/// Who issues a served device's loads and `read_into` reads: this process's CPU on lent
/// queue pairs ([`read_staged_cpu`]) or GPU threads on served GPU queues
/// ([`crate::staged::read_staged`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Issuer {
    /// This process's CPU.
    Cpu,
    /// GPU threads.
    Gpu,
}

/// Jobs of fewer bytes than this are CPU-issued unless `GPUNVME_SERVED_READS` says otherwise.
/// Measured on a lent H100 (docs/serve.md): CPU-issued reads set up in 1.2-2.5 ms but read at
/// 20-25 GB/s, GPU-issued ones take 38-53 ms to set up and read at 39-47 GB/s, so the GPU
/// pays off from about 1.8 GB on.
pub const CPU_BELOW: u64 = 2 << 30;

impl Issuer {
    /// Who issues a job of `bytes` bytes: `choice` where it names one; else
    /// `GPUNVME_SERVED_READS` (`cpu`, `gpu`, or `auto`, the default: the CPU below
    /// [`CPU_BELOW`], else the GPU); another value of the setting is refused by name.
    pub fn for_job(bytes: u64, choice: ServedReads) -> Result<Self> {
        match choice {
            ServedReads::Cpu => return Ok(Self::Cpu),
            ServedReads::Gpu => return Ok(Self::Gpu),
            ServedReads::Auto => {}
        }
        let setting = gpunvme_settings::SERVED_READS;
        match setting.value().as_deref() {
            None | Some("auto") if bytes < CPU_BELOW => Ok(Self::Cpu),
            None | Some("auto") => Ok(Self::Gpu),
            Some("cpu") => Ok(Self::Cpu),
            Some("gpu") => Ok(Self::Gpu),
            Some(other) => Err(Error::invalid(setting.invalid(other).to_string())),
        }
    }
}

/// What the job reads with: lent CPU queue pairs, the namespace, and the lent host memory the
/// commands read into.
pub struct CpuIo<'a> {
    /// The pairs (commands go round them).
    pub pairs: &'a mut [QueuePair],
    /// The namespace the files are on.
    pub nsid: u32,
    /// Its LBA size.
    pub lba_size: u32,
    /// The controller's largest transfer.
    pub max_transfer: u32,
    /// Lent host memory, at least [`Windows::bounce_bytes`] of the job.
    pub bounce: &'a Arena,
    /// Windows the bounce is cut in (each `bounce.len() / windows` bytes, whole pages).
    pub windows: usize,
}

/// Where a served read's set-up went (seconds): lending the queue pairs and the bounce, and
/// (beside the reads) registering the bounce's windows with CUDA and allocating the
/// destination where the caller did.
#[derive(Clone, Copy, Debug, Default)]
pub struct ServedPhases {
    /// Queue pairs and bounce lent by the daemon.
    pub lend: f64,
    /// Every window of the bounce registered with CUDA (beside the reads).
    pub register: f64,
    /// The destination allocated (beside the reads; the caller's).
    pub arena: f64,
    /// Queue pairs used.
    pub queues: u16,
}

/// Entries of each CPU queue pair a served read uses.
const CPU_DEPTH: u32 = 64;

/// The queue pairs a CPU-issued served read takes: [`gpunvme_settings::SERVED_PAIRS`], else the
/// controller's threads (one pair each) but at most half this host's CPUs. On a lent H100 (16
/// CPUs) a 7B-shaped load read at 16 GB/s through a daemon of 16 controller threads and at
/// 30-32 GB/s through one of 8 (`benches/results/served-cpu-threads-2026-12-07-h100.json`):
/// software-controller threads that outnumber the cores slow each other's copies down. Taking
/// fewer pairs than the daemon has threads leaves the rest idle (they nap); that this reads as
/// fast as a daemon of fewer threads is the reasoning, not yet a measurement.
fn cpu_pair_count(served: &crate::served::ServedController) -> Result<u16> {
    let setting = gpunvme_settings::SERVED_PAIRS;
    if let Some(v) = setting.value() {
        return match v.trim().parse::<u16>() {
            Ok(n) if (1..=64).contains(&n) => Ok(n),
            _ => Err(Error::invalid(setting.invalid(&v).to_string())),
        };
    }
    let cpus = std::thread::available_parallelism().map_or(2, |n| n.get());
    let half = u16::try_from((cpus / 2).max(1)).unwrap_or(u16::MAX);
    Ok(served.file_queue_count()?.min(half).max(1))
}

/// Reads `reads` of the files whose extent tables are `tables` on namespace `nsid` of
/// `served` into the GPU memory `dest` gives (called once, when the first window is full: a
/// caller may allocate it meanwhile) on `cuda`'s GPU: lent CPU queue pairs (as many as
/// `cpu_pair_count` says, fewer when the daemon has fewer free), a lent bounce cut as
/// [`Windows::from_env`] says, each window registered with CUDA on a thread of its own in
/// order, and [`read_staged_cpu`] on this thread. The pairs go back before the bounce.
pub fn read_served(
    served: &crate::served::ServedController,
    nsid: u32,
    cuda: &Arc<gpu_queues::Cuda>,
    tables: &[&ExtentTable],
    reads: &[StagedRead],
    dest: impl FnOnce() -> Result<Arc<DeviceMemory>>,
) -> Result<(StagedOutcome, ServedPhases)> {
    let ns = served.namespace(nsid)?;
    let want: u64 = reads.iter().map(|r| r.len).sum();
    let windows = Windows::from_env()?;
    let t_lend = Instant::now();
    let mut pairs = crate::served::fewer_when_busy(cpu_pair_count(served)?, true, |n| {
        served.cpu_pairs(n, CPU_DEPTH, served.file_slot_bytes())
    })?;
    let bounce = served.lend_host(windows.bounce_bytes(want) as usize)?;
    let lend = t_lend.elapsed().as_secs_f64();
    let queues = pairs.pairs.len() as u16;
    let window = bounce.arena().len() as usize / windows.count / 4096 * 4096;
    let out = std::thread::scope(|scope| {
        let (to_copier, registered) =
            std::sync::mpsc::channel::<(usize, Result<Arc<DeviceMemory>>)>();
        let registrar = {
            let cuda = cuda.clone();
            let mem = bounce.arena().mem.clone();
            scope.spawn(move || {
                let t = Instant::now();
                for s in 0..windows.count {
                    let r = gpu_queues::ffi::os::SharedRegistration::register_range(
                        &cuda,
                        mem.clone(),
                        s * window,
                        window,
                    )
                    .and_then(|reg| Arc::new(reg).as_device_memory(&cuda, 0, window))
                    .map(Arc::new)
                    .map_err(Error::from);
                    let failed = r.is_err();
                    // The reader gone (done, or failed) ends the registrations.
                    if to_copier.send((s, r)).is_err() || failed {
                        break;
                    }
                }
                t.elapsed().as_secs_f64()
            })
        };
        let mut early = std::collections::HashMap::new();
        let window_memory = |s: usize| -> Result<Arc<DeviceMemory>> {
            loop {
                if let Some(m) = early.remove(&s) {
                    return m;
                }
                match registered.recv_timeout(STALL) {
                    Ok((k, r)) => {
                        early.insert(k, r);
                    }
                    Err(_) => {
                        return Err(Error::new(
                            ErrorKind::Device,
                            format!("window {s} of the bounce was not registered with CUDA"),
                        ));
                    }
                }
            }
        };
        let io = CpuIo {
            pairs: &mut pairs.pairs,
            nsid,
            lba_size: ns.lba_size,
            max_transfer: served.info().max_transfer_bytes,
            bounce: bounce.arena(),
            windows: windows.count,
        };
        let out = read_staged_cpu(io, tables, reads, dest, window_memory, served.watchdog());
        drop(registered);
        let register = registrar.join().unwrap_or(0.0);
        (out, register)
    });
    // The pairs go back before the bounce (commands may be in flight after an error).
    drop(pairs);
    drop(bounce);
    let (out, register) = out;
    Ok((
        out?,
        ServedPhases {
            lend,
            register,
            arena: 0.0,
            queues,
        },
    ))
}

/// One command still to send: `blocks` LBAs from `lba` into bounce byte `at`.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
struct Cmd {
    lba: u64,
    blocks: u32,
    at: u64,
}

/// A window's commands and copies, planned before anything is sent.
#[derive(Debug, Default, PartialEq, Eq)]
struct WindowPlan {
    cmds: Vec<Cmd>,
    /// (window offset, destination offset, bytes).
    copies: Vec<(u64, u64, u64)>,
}

/// Rounds each read out to whole LBAs (`lba` bytes), so every command moves whole blocks
/// straight into the bounce; the copies take only the bytes asked for.
fn rounded(reads: &[StagedRead], lba: u64) -> Vec<StagedRead> {
    reads
        .iter()
        .map(|r| {
            let start = r.offset / lba * lba;
            let end = (r.offset + r.len).next_multiple_of(lba);
            StagedRead {
                offset: start,
                len: if r.len == 0 { 0 } else { end - start },
                ..*r
            }
        })
        .collect()
}

/// The commands and copies of one window of `pieces` (planned on [`rounded`] reads; `reads`
/// are the caller's). A file offset the table does not hold fails.
fn plan_window(
    pieces: &[Piece],
    reads: &[StagedRead],
    tables: &[&ExtentTable],
    lba: u64,
    max_blocks: u64,
) -> Result<WindowPlan> {
    let mut plan = WindowPlan::default();
    for p in pieces {
        let (po, pl) = (p.read.offset, p.read.len);
        let table = tables[p.read.file];
        let mut off = po;
        while off < po + pl {
            let t = table.translate(0, off).filter(|t| t.contiguous_lbas > 0);
            let Some(t) = t else {
                return Err(Error::new(
                    ErrorKind::Corrupt,
                    format!(
                        "file {} has no extent holding byte {off} (a read of {pl} bytes from \
                         {po})",
                        p.read.file
                    ),
                ));
            };
            let blocks = ((po + pl - off) / lba)
                .min(t.contiguous_lbas)
                .min(max_blocks);
            plan.cmds.push(Cmd {
                lba: t.lba,
                blocks: blocks as u32,
                at: p.at + (off - po),
            });
            off += blocks * lba;
        }
        // The bytes of the caller's read inside this piece.
        let r = reads[p.origin];
        let (from, to) = (po.max(r.offset), (po + pl).min(r.offset + r.len));
        if to > from {
            let (at, dest, len) = (p.at + (from - po), r.dest + (from - r.offset), to - from);
            match plan.copies.last_mut() {
                Some((a, d, l)) if *a + *l == at && *d + *l == dest => *l += len,
                _ => plan.copies.push((at, dest, len)),
            }
        }
    }
    Ok(plan)
}

/// Reads `reads` (of files whose extent tables are `tables`, indexed by `StagedRead::file`;
/// each table's file 0) into GPU memory through `io`'s bounce. `dest` is called once, when
/// the first window is full (or at once when the job is empty), for the destination the reads'
/// `dest` offsets point into; `window_memory(s)` once per window `s`, before its first copy,
/// for that window of the bounce as GPU memory (its registration with CUDA); `watch` ends the
/// job early with its reason. Every read's bytes are in the destination when this returns
/// `Ok`. Every copy queued has passed when this returns (or its bounded wait failed); after a
/// failed command the others are waited for, but after a stall or a GPU error commands may
/// still be in flight: the caller gives the pairs back before the bounce, so the daemon
/// deletes them before their memory goes.
pub fn read_staged_cpu(
    io: CpuIo<'_>,
    tables: &[&ExtentTable],
    reads: &[StagedRead],
    dest: impl FnOnce() -> Result<Arc<DeviceMemory>>,
    mut window_memory: impl FnMut(usize) -> Result<Arc<DeviceMemory>>,
    mut watch: impl FnMut() -> Option<String>,
) -> Result<StagedOutcome> {
    let lba = u64::from(io.lba_size);
    let nw = io.windows;
    if io.pairs.is_empty() || lba == 0 || !lba.is_power_of_two() || lba > ALIGN || nw == 0 {
        return Err(Error::invalid(format!(
            "{} queue pairs, {nw} windows and {lba}-byte LBAs: at least one pair and one \
             window, LBAs of a power of two up to {ALIGN} bytes",
            io.pairs.len()
        )));
    }
    if let Some(r) = reads.iter().find(|r| r.file >= tables.len()) {
        return Err(Error::invalid(format!(
            "a read of file {} of {}",
            r.file,
            tables.len()
        )));
    }
    for r in reads {
        let size = tables[r.file].files().first().map_or(0, |f| f.size_bytes);
        if r.offset.checked_add(r.len).is_none_or(|end| end > size) {
            return Err(Error::invalid(format!(
                "a read of {} bytes from byte {} of file {}, which has {size}",
                r.len, r.offset, r.file
            )));
        }
    }
    let window = io.bounce.len() / nw as u64 / ALIGN * ALIGN;
    if window < 2 * ALIGN {
        return Err(Error::invalid(format!(
            "a bounce of {} bytes in {nw} windows: at least {} are needed",
            io.bounce.len(),
            nw as u64 * 2 * ALIGN
        )));
    }
    let max_blocks = (u64::from(io.max_transfer).min(PRP_LIMIT) / lba)
        .clamp(1, u64::from(gpunvme_serve_client::command::MAX_BLOCKS));
    let windows = plan_windows(&rounded(reads, lba), window);
    let started = Instant::now();
    let mut dest = Some(dest);
    let check_dest = |d: Arc<DeviceMemory>| {
        let room = d.len() as u64;
        match reads
            .iter()
            .find(|x| x.dest.checked_add(x.len).is_none_or(|e| e > room))
        {
            Some(x) => Err(Error::invalid(format!(
                "a read of {} bytes for destination byte {}: the destination has {room}",
                x.len, x.dest
            ))),
            None => Ok(d),
        }
    };
    if windows.is_empty() {
        check_dest((dest.take().expect("asked once"))()?)?;
        return Ok(StagedOutcome {
            bytes: 0,
            elapsed: started.elapsed(),
            windows: 0,
        });
    }
    // Per window slot: the window in it (being read) with its commands not yet sent (from
    // `next_cmd`) and in flight, its GPU memory once registered, and whether its last copy
    // may still be running.
    let mut held: Vec<Option<(usize, WindowPlan)>> = (0..nw).map(|_| None).collect();
    let mut next_cmd = vec![0usize; nw];
    let mut in_flight = vec![0usize; nw];
    let mut copy_queued = vec![false; nw];
    let mut slot_mem: Vec<Option<Arc<DeviceMemory>>> = vec![None; nw];
    let mut gpu: Option<(Arc<DeviceMemory>, Vec<Stream>, Vec<Event>)> = None;
    // Which slot each command id of each pair reads for.
    let mut owner: Vec<Vec<usize>> = io
        .pairs
        .iter()
        .map(|p| vec![usize::MAX; p.depth() as usize])
        .collect();
    let (mut next_window, mut copied, mut bytes) = (0usize, 0usize, 0u64);
    let mut first_error: Option<Error> = None;
    let mut last_progress = Instant::now();
    let mut last_watch = Instant::now();
    let mut idle = 0u32;
    let mut run = || -> Result<()> {
        loop {
            let mut progressed = false;
            // Take the next window into its slot once the slot's last copy has passed.
            if first_error.is_none() && next_window < windows.len() {
                let s = next_window % nw;
                let free = held[s].is_none()
                    && (!copy_queued[s]
                        || gpu
                            .as_ref()
                            .map_or(Ok(true), |(_, _, ev)| ev[s].is_done())?);
                if free {
                    let plan = plan_window(&windows[next_window], reads, tables, lba, max_blocks)?;
                    held[s] = Some((next_window, plan));
                    next_cmd[s] = 0;
                    copy_queued[s] = false;
                    next_window += 1;
                    progressed = true;
                }
            }
            // Send what the held windows still have, oldest first, each command to the pair
            // with the fewest in flight: a pair whose controller thread is slow (it shares a
            // CPU) gets fewer, so no window waits on one pair's backlog.
            if first_error.is_none() {
                // Window `w` sits in slot `w % nw`, so the held ones are among the last `nw`
                // taken, oldest first.
                'send: for w in next_window.saturating_sub(nw)..next_window {
                    let s = w % nw;
                    let Some((_, plan)) = held[s].as_ref().filter(|(hw, _)| *hw == w) else {
                        continue;
                    };
                    while next_cmd[s] < plan.cmds.len() {
                        let p = (0..io.pairs.len())
                            .min_by_key(|&k| io.pairs[k].in_flight())
                            .filter(|&k| io.pairs[k].in_flight() < io.pairs[k].capacity());
                        let Some(p) = p else { break 'send };
                        let c = plan.cmds[next_cmd[s]];
                        let at = s as u64 * window + c.at;
                        let sent = io.pairs[p].submit_read_into(
                            io.nsid,
                            c.lba,
                            c.blocks,
                            io.lba_size,
                            io.bounce,
                            at,
                        );
                        match sent {
                            Ok(cid) => {
                                owner[p][usize::from(cid)] = s;
                                in_flight[s] += 1;
                                next_cmd[s] += 1;
                                progressed = true;
                            }
                            Err(e) => {
                                first_error = Some(Error::from(e).context("a staged read"));
                                break 'send;
                            }
                        }
                    }
                }
            }
            // Completions.
            for (p, pair) in io.pairs.iter_mut().enumerate() {
                if pair.in_flight() == 0 {
                    continue;
                }
                let done = match pair.poll() {
                    Ok(d) => d,
                    Err(e) => {
                        first_error.get_or_insert(Error::from(e).context("a staged read"));
                        continue;
                    }
                };
                for c in done {
                    let s = std::mem::replace(&mut owner[p][usize::from(c.slot)], usize::MAX);
                    if s >= nw {
                        first_error.get_or_insert(Error::new(
                            ErrorKind::Device,
                            format!("a completion of command {} nobody sent", c.slot),
                        ));
                        continue;
                    }
                    in_flight[s] -= 1;
                    progressed = true;
                    if let Err(e) = c.check() {
                        first_error.get_or_insert(
                            Error::from(e)
                                .context(format!("reading LBA {} for a staged read", c.lba)),
                        );
                    }
                }
            }
            // Full windows are copied out.
            for s in 0..nw {
                let full = matches!(&held[s], Some((_, plan)) if next_cmd[s] == plan.cmds.len())
                    && in_flight[s] == 0;
                if !full || first_error.is_some() {
                    continue;
                }
                if gpu.is_none() {
                    let d = (dest.take().expect("asked once"))().and_then(check_dest);
                    let d = match d {
                        Ok(d) => d,
                        Err(e) => {
                            // The others are waited for before the error goes up.
                            first_error.get_or_insert(e);
                            continue;
                        }
                    };
                    let cuda = d.cuda().clone();
                    let streams = (0..nw)
                        .map(|_| Stream::new(&cuda, Placement::Anywhere, None))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    let events = (0..nw)
                        .map(|_| Event::new(&cuda))
                        .collect::<std::result::Result<Vec<_>, _>>()?;
                    gpu = Some((d, streams, events));
                }
                if slot_mem[s].is_none() {
                    match window_memory(s) {
                        Ok(m) if m.len() as u64 >= window => slot_mem[s] = Some(m),
                        Ok(m) => {
                            first_error.get_or_insert(Error::invalid(format!(
                                "window {s} of the bounce as {} bytes of GPU memory, not {window}",
                                m.len()
                            )));
                            continue;
                        }
                        Err(e) => {
                            first_error.get_or_insert(e);
                            continue;
                        }
                    }
                }
                let (_, plan) = held[s].take().expect("held");
                let (d, streams, events) = gpu.as_ref().expect("set above");
                let src = slot_mem[s].as_ref().expect("set above");
                for &(at, to, len) in &plan.copies {
                    streams[s].copy_device(d, to as usize, src, at as usize, len as usize)?;
                    bytes += len;
                }
                events[s].record(&streams[s])?;
                copy_queued[s] = true;
                copied += 1;
                progressed = true;
            }
            let none_in_flight = in_flight.iter().all(|&n| n == 0);
            if (copied == windows.len() || first_error.is_some()) && none_in_flight {
                return Ok(());
            }
            // Bounded: progress, the watchdog, and a backoff that soon yields the CPU to the
            // controller's threads (a software controller's share the machine's CPUs).
            let now = Instant::now();
            if progressed {
                last_progress = now;
                idle = 0;
            } else {
                idle = idle.saturating_add(1);
                if now - last_progress > STALL {
                    let left: usize = in_flight.iter().sum();
                    return Err(Error::new(
                        ErrorKind::Device,
                        format!(
                            "a staged read made no progress for {STALL:?}: {left} commands in \
                             flight, {copied} of {} windows copied",
                            windows.len()
                        ),
                    ));
                }
                if now - last_progress > Duration::from_millis(2) {
                    std::thread::sleep(Duration::from_micros(20));
                } else if idle > 32 {
                    std::thread::yield_now();
                } else {
                    std::hint::spin_loop();
                }
            }
            if now - last_watch > Duration::from_millis(1) {
                last_watch = now;
                if let Some(why) = watch() {
                    first_error.get_or_insert(Error::new(ErrorKind::Device, why));
                }
            }
        }
    };
    let ran = run();
    // Every copy queued has passed before the destination or the bounce may go.
    let mut waited = Ok(());
    if let Some((_, _, events)) = &gpu {
        for (s, ev) in events.iter().enumerate() {
            if copy_queued[s]
                && let Err(e) = ev.wait(STALL)
            {
                waited = Err(Error::from(e));
            }
        }
    }
    ran?;
    waited?;
    if let Some(e) = first_error {
        return Err(e);
    }
    Ok(StagedOutcome {
        bytes,
        elapsed: started.elapsed(),
        windows: windows.len(),
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn window_settings_parse_within_their_bounds() {
        assert_eq!(
            Windows::parse("8x16"),
            Some(Windows {
                count: 8,
                bytes: 16 << 20
            })
        );
        for bad in ["", "8", "x16", "1x4", "65x4", "4x0", "4x257", "4x-1", "ax4"] {
            assert_eq!(Windows::parse(bad), None, "{bad}");
        }
        // A small job gets small windows (whole pages, room for rounding at both ends).
        let w = Windows::default();
        assert_eq!(w.bounce_bytes(1000), 4 * 16384);
        assert_eq!(w.bounce_bytes(1 << 30), 4 * (4 << 20));
    }

    #[test]
    fn a_windows_commands_follow_the_extents_and_stop_at_the_largest_transfer() {
        // One file of 3 extents: file LBAs 0..8 at 100, 8..9 at 500, 9..64 at 1000 (512-byte
        // LBAs, 32 KiB).
        let table =
            ExtentTable::of_runs(512, 1, 32 << 10, &[(0, 100, 8), (8, 500, 1), (9, 1000, 55)]);
        let reads = [StagedRead {
            file: 0,
            offset: 3000,
            len: 20_000,
            dest: 7,
        }];
        let r = rounded(&reads, 512);
        let windows = plan_windows(&r, 1 << 20);
        assert_eq!(windows.len(), 1);
        let plan = plan_window(&windows[0], &reads, &[&table], 512, 16).unwrap();
        let at0 = windows[0][0].at;
        // Bytes 2560..23040: LBAs 5..8 (at 105), 8 (at 500), 9..25 in two commands of at most
        // 16 blocks (at 1000 and 1016), 25..45 (16 then 4).
        let cmds: Vec<(u64, u32, u64)> = plan
            .cmds
            .iter()
            .map(|c| (c.lba, c.blocks, c.at - at0))
            .collect();
        assert_eq!(
            cmds,
            vec![
                (105, 3, 0),
                (500, 1, 1536),
                (1000, 16, 2048),
                (1016, 16, 2048 + 8192),
                (1032, 4, 2048 + 16384)
            ]
        );
        // One copy of exactly the bytes asked for.
        assert_eq!(plan.copies, vec![(at0 + 440, 7, 20_000)]);
    }

    #[test]
    fn reads_round_out_to_whole_lbas_and_copies_take_only_theirs() {
        let reads = [
            StagedRead {
                file: 0,
                offset: 100,
                len: 900,
                dest: 0,
            },
            StagedRead {
                file: 0,
                offset: 1000,
                len: 4000,
                dest: 900,
            },
            StagedRead {
                file: 0,
                offset: 8192,
                len: 0,
                dest: 4900,
            },
        ];
        let r = rounded(&reads, 512);
        assert_eq!((r[0].offset, r[0].len), (0, 1024));
        assert_eq!((r[1].offset, r[1].len), (512, 4608));
        assert_eq!(r[2].len, 0);
    }
}
