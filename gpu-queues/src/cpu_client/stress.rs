//! The stress run behind `gpunvme protocol-check` ([`run_stress`]): many CPU threads drive
//! [`CpuQueue`]s exactly as GPU threads drive the device header's queues — single tickets and
//! warp-like batches, random LBAs, every byte written with the pattern and checked on read —
//! and report doorbells, out-of-order completions and the first error.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Mutex, PoisonError};
use std::time::{Duration, Instant};

use nvme::Controller;

use super::{ClientError, CpuQueue, CpuQueueOptions, OPC_READ, OPC_WRITE, Ticket};
use crate::desc::IoReq;
use crate::error::GpuError;
use crate::pattern;

/// What [`run_stress`] does.
#[derive(Clone, Debug)]
pub struct StressConfig {
    /// Caller-supplied queue pairs.
    pub queues: u16,
    /// Threads sharing each queue (odd-numbered ones use the batch variant).
    pub threads_per_queue: usize,
    /// Entries per ring (a power of two).
    pub depth: u32,
    /// Commands in all, writes and reads (rounded up to an even number: each write is read
    /// back).
    pub commands: u64,
    /// Tickets per batch of the batch threads (capped at the depth).
    pub batch: u32,
    /// Namespace.
    pub nsid: u32,
    /// Bytes from LBA 0 the run touches (default: the namespace, at most 1 GiB).
    pub region_bytes: Option<u64>,
    /// Bytes of each slot buffer (default: the maximum transfer, at most 64 KiB); commands move
    /// 1 block up to a whole slot buffer, so every PRP shape is used.
    pub slot_buffer_bytes: Option<u32>,
    /// Seed of the pattern and of the offsets.
    pub seed: u64,
    /// Bound of every wait.
    pub timeout: Duration,
    /// Compare every byte read with the pattern (otherwise reads are only issued).
    pub verify: bool,
}

impl Default for StressConfig {
    fn default() -> Self {
        Self {
            queues: 2,
            threads_per_queue: 4,
            depth: 16,
            commands: 4000,
            batch: 4,
            nsid: 1,
            region_bytes: None,
            slot_buffer_bytes: None,
            seed: 0x9e37_79b9,
            timeout: Duration::from_secs(10),
            verify: true,
        }
    }
}

/// One queue's share of a [`StressReport`].
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct QueueReport {
    /// Queue id.
    pub qid: u16,
    /// Commands issued on it (completed with any status, or failed).
    pub commands: u64,
    /// SQ tail doorbell writes.
    pub sq_doorbells: u64,
    /// CQ head doorbell writes.
    pub cq_doorbells: u64,
    /// Completions that arrived out of submission order
    /// ([`CpuQueue::completions_out_of_order`]).
    pub out_of_order: u64,
    /// Why it failed, if it did.
    pub failed: Option<String>,
}

/// What [`run_stress`] saw.
#[derive(Clone, Debug, Default)]
pub struct StressReport {
    /// The transport, in words.
    pub device: String,
    /// Per queue.
    pub queues: Vec<QueueReport>,
    /// Entries per ring.
    pub depth: u32,
    /// Threads per queue.
    pub threads_per_queue: usize,
    /// Tickets per batch of the batch threads.
    pub batch: u32,
    /// Namespace.
    pub nsid: u32,
    /// LBA size of the namespace.
    pub lba_size: u32,
    /// Bytes from LBA 0 the run touched.
    pub region_bytes: u64,
    /// Bytes of each slot buffer.
    pub slot_buffer_bytes: u32,
    /// Seed of the pattern and of the offsets.
    pub seed: u64,
    /// Whether reads were compared with the pattern.
    pub verify: bool,
    /// Commands asked for.
    pub requested: u64,
    /// Commands issued (completed with any status, or failed).
    pub commands: u64,
    /// Successful writes.
    pub writes: u64,
    /// Successful reads.
    pub reads: u64,
    /// Commands issued through the batch (warp) variant.
    pub batch_commands: u64,
    /// Commands that failed (error status, timeout, abort, failed queue...).
    pub errors: u64,
    /// Reads whose bytes differed from what was written.
    pub mismatches: u64,
    /// Bytes read back and compared.
    pub verified_bytes: u64,
    /// The first error, in words.
    pub first_error: Option<String>,
    /// The first LBA that read back wrong.
    pub first_bad_lba: Option<u64>,
    /// Controller fatal status or device loss seen by the watcher (which then aborted every
    /// queue).
    pub controller_failure: Option<String>,
    /// Wall time of the run.
    pub elapsed: Duration,
}

impl StressReport {
    /// Whether everything asked for ran without an error and every byte matched.
    pub fn passed(&self) -> bool {
        self.errors == 0
            && self.mismatches == 0
            && self.commands == self.requested
            && self.controller_failure.is_none()
    }

    /// SQ doorbell writes over all queues.
    pub fn sq_doorbells(&self) -> u64 {
        self.queues.iter().map(|q| q.sq_doorbells).sum()
    }

    /// CQ doorbell writes over all queues.
    pub fn cq_doorbells(&self) -> u64 {
        self.queues.iter().map(|q| q.cq_doorbells).sum()
    }

    /// Completions out of submission order over all queues.
    pub fn out_of_order(&self) -> u64 {
        self.queues.iter().map(|q| q.out_of_order).sum()
    }
}

/// Shared counters of a run.
#[derive(Default)]
struct Tally {
    pairs_claimed: AtomicU64,
    commands: AtomicU64,
    writes: AtomicU64,
    reads: AtomicU64,
    batch_commands: AtomicU64,
    errors: AtomicU64,
    mismatches: AtomicU64,
    verified_bytes: AtomicU64,
    first_error: Mutex<Option<String>>,
    first_bad_lba: Mutex<Option<u64>>,
}

impl Tally {
    /// Claims up to `want` write+read pairs of the `total`; 0 when the run is over.
    fn claim(&self, want: u64, total: u64) -> u64 {
        let mut got = 0;
        let _ = self
            .pairs_claimed
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |c| {
                got = want.min(total.saturating_sub(c));
                (got > 0).then_some(c + got)
            });
        got
    }

    fn error(&self, e: &ClientError, lba: u64) {
        self.errors.fetch_add(1, Ordering::Relaxed);
        let mut first = self
            .first_error
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        first.get_or_insert_with(|| format!("{e} (LBA {lba})"));
    }

    fn mismatch(&self, lba: u64) {
        self.mismatches.fetch_add(1, Ordering::Relaxed);
        let mut first = self
            .first_bad_lba
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        first.get_or_insert(lba);
    }
}

/// SplitMix64 step: the offsets' random numbers.
fn next_random(state: &mut u64) -> u64 {
    *state = state.wrapping_add(0x9e37_79b9_7f4a_7c15);
    let mut z = *state;
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    z ^ (z >> 31)
}

/// One worker's fixed parameters.
struct Job<'a> {
    q: &'a CpuQueue,
    tally: &'a Tally,
    queue_commands: &'a AtomicU64,
    cfg: &'a StressConfig,
    lba_size: u32,
    region_blocks: u64,
    max_blocks: u64,
    total_pairs: u64,
}

impl Job<'_> {
    /// A random range: (first LBA, blocks).
    fn pick(&self, rng: &mut u64) -> (u64, u64) {
        let blocks = 1 + next_random(rng) % self.max_blocks;
        let lba = next_random(rng) % (self.region_blocks - blocks + 1);
        (lba, blocks)
    }

    fn bytes(&self, blocks: u64) -> usize {
        blocks as usize * self.lba_size as usize
    }

    fn request(&self, t: &Ticket, opcode: u8, lba: u64, blocks: u64) -> IoReq {
        self.q.rw_request(
            t,
            opcode,
            self.cfg.nsid,
            lba,
            self.lba_size,
            self.bytes(blocks),
        )
    }

    /// Puts the pattern of `lba..lba + blocks` into the ticket's slot buffer.
    fn stage_pattern(&self, t: &Ticket, lba: u64, blocks: u64) {
        let mut buf = vec![0u8; self.bytes(blocks)];
        pattern::fill(
            &mut buf,
            self.cfg.seed,
            self.cfg.nsid,
            lba,
            self.lba_size as usize,
        );
        self.q.write_slot_buffer(t, 0, &buf);
    }

    /// Checks a completed read in the ticket's slot buffer (before the slot is released).
    fn verify(&self, t: &Ticket, lba: u64, blocks: u64) {
        if !self.cfg.verify {
            self.tally.reads.fetch_add(1, Ordering::Relaxed);
            return;
        }
        let mut buf = vec![0u8; self.bytes(blocks)];
        self.q.read_slot_buffer(t, 0, &mut buf);
        match pattern::check(
            &buf,
            self.cfg.seed,
            self.cfg.nsid,
            lba,
            self.lba_size as usize,
        ) {
            None => {
                self.tally.reads.fetch_add(1, Ordering::Relaxed);
                self.tally
                    .verified_bytes
                    .fetch_add(buf.len() as u64, Ordering::Relaxed);
            }
            Some(bad) => self.tally.mismatch(bad),
        }
    }

    fn issued(&self, n: u64, batch: bool) {
        self.tally.commands.fetch_add(n, Ordering::Relaxed);
        self.queue_commands.fetch_add(n, Ordering::Relaxed);
        if batch {
            self.tally.batch_commands.fetch_add(n, Ordering::Relaxed);
        }
    }

    /// The thread variant: one ticket at a time. Returns false once the queue is unusable.
    fn run_single(&self, rng: &mut u64) -> bool {
        while self.tally.claim(1, self.total_pairs) == 1 {
            let (lba, blocks) = self.pick(rng);
            // Write.
            let t = match self.q.reserve() {
                Ok(t) => t,
                Err(e) => return self.failed(&e, lba),
            };
            self.stage_pattern(&t, lba, blocks);
            self.q
                .fill_slot(&t, &self.request(&t, OPC_WRITE, lba, blocks));
            self.issued(1, false);
            if let Err(e) = self.q.publish(&t) {
                return self.failed(&e, lba);
            }
            match self.q.complete(t) {
                Ok(_) => {
                    self.tally.writes.fetch_add(1, Ordering::Relaxed);
                }
                Err(e) if !e.is_fatal() => self.tally.error(&e, lba),
                Err(e) => return self.failed(&e, lba),
            }
            // Read back, verify, release.
            let t = match self.q.reserve() {
                Ok(t) => t,
                Err(e) => return self.failed(&e, lba),
            };
            self.q.fill_slot_buffer(&t, self.bytes(blocks), 0xa5);
            self.q
                .fill_slot(&t, &self.request(&t, OPC_READ, lba, blocks));
            self.issued(1, false);
            if let Err(e) = self.q.publish(&t) {
                return self.failed(&e, lba);
            }
            let cid = self.q.slot_of(&t) as u16;
            match self.q.wait_done(&t) {
                Ok(done) => {
                    if done.status_field == 0 {
                        self.verify(&t, lba, blocks);
                    }
                    self.q.release(t);
                    if let Err(e) = self.q.outcome(cid, done) {
                        self.tally.error(&e, lba);
                    }
                }
                Err(e) => return self.failed(&e, lba),
            }
        }
        true
    }

    /// The batch (warp) variant: `batch` consecutive tickets with one atomic for the writes,
    /// then again for the reads.
    fn run_batch(&self, rng: &mut u64) -> bool {
        let batch = self.cfg.batch.clamp(1, self.q.depth()) as u64;
        loop {
            let n = self.tally.claim(batch, self.total_pairs);
            if n == 0 {
                return true;
            }
            let ranges: Vec<(u64, u64)> = (0..n).map(|_| self.pick(rng)).collect();
            for opcode in [OPC_WRITE, OPC_READ] {
                let tickets = match self.q.reserve_many(n as u32) {
                    Ok(t) => t,
                    Err(e) => return self.failed(&e, ranges[0].0),
                };
                for (t, &(lba, blocks)) in tickets.iter().zip(&ranges) {
                    if opcode == OPC_WRITE {
                        self.stage_pattern(t, lba, blocks);
                    } else {
                        self.q.fill_slot_buffer(t, self.bytes(blocks), 0xa5);
                    }
                    self.q.fill_slot(t, &self.request(t, opcode, lba, blocks));
                }
                self.issued(n, true);
                // Every lane makes sure its own ticket is published (the first publish usually
                // covers the whole batch with one doorbell).
                for t in &tickets {
                    if let Err(e) = self.q.publish(t) {
                        return self.failed(&e, ranges[0].0);
                    }
                }
                for (t, &(lba, blocks)) in tickets.into_iter().zip(&ranges) {
                    let cid = self.q.slot_of(&t) as u16;
                    let done = match self.q.wait_done(&t) {
                        Ok(d) => d,
                        Err(e) => return self.failed(&e, lba),
                    };
                    if done.status_field == 0 {
                        if opcode == OPC_READ {
                            self.verify(&t, lba, blocks);
                        } else {
                            self.tally.writes.fetch_add(1, Ordering::Relaxed);
                        }
                    }
                    self.q.release(t);
                    if let Err(e) = self.q.outcome(cid, done) {
                        self.tally.error(&e, lba);
                    }
                }
            }
        }
    }

    /// Records a queue-ending error (the thread stops: its queue is failed). Returns false.
    fn failed(&self, e: &ClientError, lba: u64) -> bool {
        self.tally.error(e, lba);
        false
    }
}

/// Runs the protocol from CPU threads: creates `cfg.queues` [`CpuQueue`]s on `controller`,
/// `cfg.threads_per_queue` threads on each (sharing it: tickets, locks and out-of-order
/// completions contend), every thread writing LBA-stamped data through its slot buffers and
/// reading it back, checking every byte; odd-numbered threads use the batch (warp) variant.
/// A watcher reads CSTS every few milliseconds and aborts every queue on controller fatal
/// status or device loss, as the host does for GPU queues.
///
/// Errors of commands are counted in the report; only setting up fails the call.
pub fn run_stress(controller: &Controller, cfg: &StressConfig) -> Result<StressReport, GpuError> {
    if cfg.queues == 0 || cfg.threads_per_queue == 0 || cfg.commands == 0 {
        return Err(GpuError::InvalidArgument(format!(
            "{} queues, {} threads per queue, {} commands: each must be at least 1",
            cfg.queues, cfg.threads_per_queue, cfg.commands
        )));
    }
    let granted = controller.info().max_io_queue_pairs;
    if cfg.queues > granted {
        return Err(GpuError::InvalidArgument(format!(
            "{} queues: the controller grants {granted} I/O queue pairs",
            cfg.queues
        )));
    }
    let ns = controller.namespace(cfg.nsid)?;
    let lba_size = ns.lba_size;
    let ns_bytes = ns.blocks.saturating_mul(lba_size as u64);
    let region = cfg
        .region_bytes
        .unwrap_or(ns_bytes.min(1 << 30))
        .min(ns_bytes);
    let region_blocks = region / lba_size as u64;
    let opts = CpuQueueOptions {
        depth: cfg.depth,
        slot_buffer_bytes: cfg.slot_buffer_bytes,
        timeout: cfg.timeout,
    };
    let queues = (0..cfg.queues)
        .map(|_| CpuQueue::create(controller, &opts))
        .collect::<Result<Vec<_>, _>>()?;
    let slot_buffer_bytes = queues[0].slot_buffer_bytes();
    let max_blocks = (slot_buffer_bytes / lba_size) as u64;
    if max_blocks == 0 || region_blocks < max_blocks {
        return Err(GpuError::InvalidArgument(format!(
            "a region of {region_blocks} blocks of {lba_size} bytes with slot buffers of \
             {slot_buffer_bytes} bytes"
        )));
    }

    let tally = Tally::default();
    let per_queue: Vec<AtomicU64> = queues.iter().map(|_| AtomicU64::new(0)).collect();
    let stop = AtomicBool::new(false);
    let failure: Mutex<Option<String>> = Mutex::new(None);
    let total_pairs = cfg.commands.div_ceil(2);
    let started = Instant::now();
    std::thread::scope(|s| {
        let watcher = s.spawn(|| {
            while !stop.load(Ordering::Acquire) {
                let why = match controller.csts() {
                    Ok(c) if c.cfs() => Some(format!(
                        "controller fatal status (CSTS {:#x})",
                        u32::from(c)
                    )),
                    Ok(_) => None,
                    Err(e) => Some(e.to_string()),
                };
                if let Some(why) = why {
                    tracing::warn!(%why, "aborting the CPU client queues");
                    *failure.lock().unwrap_or_else(PoisonError::into_inner) = Some(why);
                    queues.iter().for_each(CpuQueue::abort);
                    return;
                }
                std::thread::sleep(Duration::from_millis(5));
            }
        });
        let workers: Vec<_> = queues
            .iter()
            .zip(&per_queue)
            .enumerate()
            .flat_map(|(qi, (q, counter))| {
                (0..cfg.threads_per_queue).map(move |ti| (qi, ti, q, counter))
            })
            .map(|(qi, ti, q, counter)| {
                let job = Job {
                    q,
                    tally: &tally,
                    queue_commands: counter,
                    cfg,
                    lba_size,
                    region_blocks,
                    max_blocks,
                    total_pairs,
                };
                s.spawn(move || {
                    let stream = ((qi as u64) << 32) | ti as u64;
                    let mut rng = cfg.seed ^ stream.wrapping_mul(0x2545_f491_4f6c_dd1d);
                    if ti % 2 == 1 {
                        job.run_batch(&mut rng)
                    } else {
                        job.run_single(&mut rng)
                    }
                })
            })
            .collect();
        for w in workers {
            // A worker that panicked is a bug in this module; count it as a failed thread.
            if w.join().is_err() {
                tally.errors.fetch_add(1, Ordering::Relaxed);
            }
        }
        stop.store(true, Ordering::Release);
        let _ = watcher.join();
    });
    let elapsed = started.elapsed();
    Ok(StressReport {
        device: controller.device().describe(),
        queues: queues
            .iter()
            .zip(&per_queue)
            .map(|(q, c)| {
                let (sq_doorbells, cq_doorbells) = q.doorbell_counts();
                QueueReport {
                    qid: q.qid(),
                    commands: c.load(Ordering::Relaxed),
                    sq_doorbells,
                    cq_doorbells,
                    out_of_order: q.completions_out_of_order(),
                    failed: q.failed().map(|s| s.to_string()),
                }
            })
            .collect(),
        depth: cfg.depth,
        threads_per_queue: cfg.threads_per_queue,
        batch: cfg.batch.clamp(1, cfg.depth),
        nsid: cfg.nsid,
        lba_size,
        region_bytes: region_blocks * lba_size as u64,
        slot_buffer_bytes,
        seed: cfg.seed,
        verify: cfg.verify,
        requested: total_pairs * 2,
        commands: tally.commands.load(Ordering::Relaxed),
        writes: tally.writes.load(Ordering::Relaxed),
        reads: tally.reads.load(Ordering::Relaxed),
        batch_commands: tally.batch_commands.load(Ordering::Relaxed),
        errors: tally.errors.load(Ordering::Relaxed),
        mismatches: tally.mismatches.load(Ordering::Relaxed),
        verified_bytes: tally.verified_bytes.load(Ordering::Relaxed),
        first_error: tally
            .first_error
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner),
        first_bad_lba: tally
            .first_bad_lba
            .into_inner()
            .unwrap_or_else(PoisonError::into_inner),
        controller_failure: failure.into_inner().unwrap_or_else(PoisonError::into_inner),
        elapsed,
    })
}
