//! A verified I/O run through served queues (`gpunvme serve check`): write LBA-stamped data
//! to a range of the namespace, read it back, and compare every byte, with many commands in
//! flight on each queue. What tests and operators use to show a served controller works for
//! one client while others use it (each on its own range).

use std::sync::Arc;
use std::time::{Duration, Instant};

use crate::{ClientError, Connection, layout};

/// What to run.
#[derive(Clone, Debug)]
pub struct CheckOptions {
    /// The controller's name at the daemon.
    pub controller: String,
    /// The namespace.
    pub nsid: u32,
    /// The first LBA of this client's range.
    pub first_lba: u64,
    /// LBAs in the range (the namespace's from `first_lba` when 0).
    pub lbas: u64,
    /// Blocks per command.
    pub blocks_per_io: u32,
    /// Queue pairs (one thread each).
    pub queues: u16,
    /// Entries per queue.
    pub depth: u32,
    /// Commands in flight per queue (at most `depth - 1`).
    pub qd: u32,
    /// Stop after this many commands in all (writes and reads), or
    pub ios: Option<u64>,
    /// after this long (whichever comes first; neither: one pass over the range).
    pub runtime: Option<Duration>,
    /// Mixed into the stamps, so that two runs over one range write different bytes (and,
    /// reading only, into the random LBAs).
    pub seed: u64,
    /// Random reads of the range only, `qd` in flight per queue, nothing written or checked:
    /// a throughput run (`gpunvme serve check --read-only`).
    pub read_only: bool,
}

impl Default for CheckOptions {
    fn default() -> Self {
        Self {
            controller: "nvme0".into(),
            nsid: 1,
            first_lba: 0,
            lbas: 0,
            blocks_per_io: 8,
            queues: 1,
            depth: 64,
            qd: 16,
            ios: None,
            runtime: None,
            seed: 0,
            read_only: false,
        }
    }
}

/// What a run did.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct CheckReport {
    /// Commands completed (writes and reads).
    pub ios: u64,
    /// Bytes written and read.
    pub bytes: u64,
    /// Bytes read back that differed from what was written.
    pub mismatched_bytes: u64,
    /// Commands that failed (a status, a timeout).
    pub errors: u64,
    /// The first failure, in words.
    pub first_error: Option<String>,
    /// Microseconds from connect-complete to queues ready.
    pub setup_us: u64,
    /// Microseconds of I/O.
    pub io_us: u64,
}

/// Fills `buf` (whole blocks of `lba_size` bytes from `lba`) with what a run seeded `seed`
/// writes there in pass `pass` (the first pass is 0): what a test compares the device with.
pub fn stamp(buf: &mut [u8], lba: u64, lba_size: usize, seed: u64, pass: u64) {
    for (b, block) in buf.chunks_mut(lba_size).enumerate() {
        let tag = (lba + b as u64) ^ seed.rotate_left(17) ^ pass.rotate_left(41);
        for (i, w) in block.chunks_mut(8).enumerate() {
            let v = tag
                .wrapping_mul(0x9e37_79b9_7f4a_7c15)
                .wrapping_add(i as u64);
            w.copy_from_slice(&v.to_le_bytes()[..w.len()]);
        }
    }
}

/// Runs the check on `conn` (see the module documentation).
pub fn run(conn: &Connection, opts: &CheckOptions) -> Result<CheckReport, ClientError> {
    let bad = |why: String| Err(ClientError::InvalidArgument(why));
    if opts.queues == 0 || opts.blocks_per_io == 0 || opts.qd == 0 || opts.qd >= opts.depth {
        return bad(format!(
            "queues {}, blocks per I/O {}, qd {} with depth {}: each at least 1, qd below \
             the depth",
            opts.queues, opts.blocks_per_io, opts.qd, opts.depth
        ));
    }
    let t0 = Instant::now();
    let info = conn.controller(&opts.controller)?;
    let Some(ns) = info.namespace(opts.nsid).copied() else {
        return bad(format!("no namespace {} on {}", opts.nsid, opts.controller));
    };
    let lba_size = ns.lba_size as usize;
    let lbas = if opts.lbas == 0 {
        ns.blocks.saturating_sub(opts.first_lba)
    } else {
        opts.lbas
    };
    let per_io = u64::from(opts.blocks_per_io);
    if opts
        .first_lba
        .checked_add(lbas)
        .is_none_or(|end| end > ns.blocks)
        || lbas < per_io
    {
        return bad(format!(
            "LBAs {}..+{lbas} in namespace {} of {} blocks: out of range or under one I/O of \
             {per_io} blocks",
            opts.first_lba, opts.nsid, ns.blocks
        ));
    }
    let io_bytes = per_io * ns.lba_size as u64;
    let slot_bytes = u32::try_from(io_bytes.next_multiple_of(4096))
        .map_err(|_| ClientError::InvalidArgument(format!("{io_bytes}-byte I/Os")))?;
    // The queues, then a page for the admin command's data.
    let queue_bytes = layout::arena_bytes_for(opts.queues, opts.depth, slot_bytes);
    let arena = Arc::new(conn.alloc_arena(&opts.controller, queue_bytes + 4096)?);
    let pairs = conn.create_queues(
        &opts.controller,
        &arena,
        opts.queues,
        opts.depth,
        slot_bytes,
    )?;
    // Identify Controller (CNS 01h) through the daemon: its model number must be there.
    conn.admin(
        &opts.controller,
        0x06,
        0,
        [1, 0, 0, 0, 0, 0],
        &arena,
        queue_bytes,
    )?;
    let mut model = [0u8; 40];
    arena
        .mem
        .read(queue_bytes as usize + 24, &mut model)
        .map_err(|source| ClientError::Shm {
            what: "reading Identify data",
            source,
        })?;
    if model.iter().all(|&b| b == 0 || b == b' ') {
        return Err(ClientError::Protocol(
            "Identify Controller through the daemon returned no model number".into(),
        ));
    }
    let setup_us = t0.elapsed().as_micros() as u64;
    // Each queue its own share of the range, in whole I/Os.
    let units = lbas / per_io;
    let share = (units / u64::from(opts.queues)).max(1);
    let deadline = opts.runtime.map(|d| Instant::now() + d);
    let ios_each = opts.ios.map(|n| n.div_ceil(u64::from(opts.queues)));
    let t_io = Instant::now();
    let results: Vec<(CheckReport, crate::QueuePair)> = std::thread::scope(|s| {
        let handles: Vec<_> = pairs
            .into_iter()
            .enumerate()
            .map(|(q, mut pair)| {
                let first_unit = q as u64 * share;
                let n_units = if q + 1 == usize::from(opts.queues) {
                    units.saturating_sub(first_unit)
                } else {
                    share
                }
                .min(units.saturating_sub(first_unit));
                s.spawn(move || {
                    let mut r = CheckReport::default();
                    let share = Share {
                        first: opts.first_lba + first_unit * per_io,
                        units: n_units,
                        lba_size,
                        deadline,
                        ios: ios_each,
                    };
                    if opts.read_only {
                        read_queue(&mut pair, opts, &share, &mut r);
                    } else {
                        one_queue(&mut pair, opts, &share, &mut r);
                    }
                    (r, pair)
                })
            })
            .collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    });
    let mut total = CheckReport {
        setup_us,
        io_us: t_io.elapsed().as_micros() as u64,
        ..CheckReport::default()
    };
    let mut pairs = Vec::new();
    for (r, p) in results {
        total.ios += r.ios;
        total.bytes += r.bytes;
        total.mismatched_bytes += r.mismatched_bytes;
        total.errors += r.errors;
        if total.first_error.is_none() {
            total.first_error = r.first_error;
        }
        pairs.push(p);
    }
    // Given back in order: queues, then the arena (the daemon would at disconnect anyway).
    conn.delete_queues(&opts.controller, pairs)?;
    conn.free_arena(arena)?;
    Ok(total)
}

/// One queue's share of a run: `units` I/Os from LBA `first`, until `deadline` or `ios`.
struct Share {
    first: u64,
    units: u64,
    lba_size: usize,
    deadline: Option<Instant>,
    ios: Option<u64>,
}

/// Random reads of the share's units, `qd` in flight, until the deadline or `ios` (neither:
/// one read per unit).
fn read_queue(
    pair: &mut crate::QueuePair,
    opts: &CheckOptions,
    share: &Share,
    r: &mut CheckReport,
) {
    let Share {
        first,
        units,
        lba_size,
        deadline,
        ios,
    } = *share;
    let per_io = u64::from(opts.blocks_per_io);
    let len = (per_io as usize * lba_size) as u64;
    let total = match (deadline, ios) {
        (None, None) => Some(units),
        _ => ios,
    };
    let mut x = opts.seed ^ first.wrapping_mul(0x9e37_79b9_7f4a_7c15) | 1;
    let mut next = || {
        // xorshift64: a uniform unit of the range.
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        first + (x % units.max(1)) * per_io
    };
    let mut sent = 0u64;
    let mut in_flight = 0u32;
    let reap_bound = pair.bound();
    loop {
        let more = total.is_none_or(|t| sent < t) && deadline.is_none_or(|d| Instant::now() < d);
        while more && in_flight < opts.qd && total.is_none_or(|t| sent < t) {
            match pair.submit_read(opts.nsid, next(), opts.blocks_per_io, lba_size as u32) {
                Ok(_) => {
                    sent += 1;
                    in_flight += 1;
                }
                Err(e) => {
                    r.errors += 1;
                    r.first_error.get_or_insert(e.to_string());
                    return;
                }
            }
        }
        if in_flight == 0 {
            return;
        }
        match pair.reap(reap_bound) {
            Ok(done) => {
                for c in done {
                    in_flight -= 1;
                    r.ios += 1;
                    r.bytes += len;
                    if let Err(e) = c.check() {
                        r.errors += 1;
                        r.first_error.get_or_insert(e.to_string());
                    }
                }
            }
            Err(e) => {
                r.errors += 1;
                r.first_error.get_or_insert(e.to_string());
                return;
            }
        }
    }
}

/// Writes then reads back and compares the share's units, `qd` at a time, pass after pass
/// until the deadline or `ios` (neither: one pass).
fn one_queue(pair: &mut crate::QueuePair, opts: &CheckOptions, share: &Share, r: &mut CheckReport) {
    let Share {
        first,
        units,
        lba_size,
        deadline,
        ios,
    } = *share;
    let per_io = u64::from(opts.blocks_per_io);
    let len = per_io as usize * lba_size;
    let mut data = vec![0u8; len];
    let mut got = vec![0u8; len];
    let fail = |r: &mut CheckReport, e: String| {
        r.errors += 1;
        r.first_error.get_or_insert(e);
    };
    let reap_bound = pair.bound();
    let mut pass = 0u64;
    'run: loop {
        let mut unit = 0;
        while unit < units {
            let batch = u64::from(opts.qd).min(units - unit);
            // Writes, all in flight, then reads of the same LBAs, all in flight.
            for write in [true, false] {
                let mut slots = Vec::new();
                for k in 0..batch {
                    let lba = first + (unit + k) * per_io;
                    let sent = if write {
                        stamp(&mut data, lba, lba_size, opts.seed, pass);
                        pair.submit_write(
                            opts.nsid,
                            lba,
                            opts.blocks_per_io,
                            lba_size as u32,
                            &data,
                        )
                    } else {
                        pair.submit_read(opts.nsid, lba, opts.blocks_per_io, lba_size as u32)
                    };
                    match sent {
                        Ok(slot) => slots.push((slot, lba)),
                        Err(e) => {
                            fail(r, e.to_string());
                            break 'run;
                        }
                    }
                }
                let mut left = slots.len();
                while left > 0 {
                    let done = match pair.reap(reap_bound) {
                        Ok(d) => d,
                        Err(e) => {
                            fail(r, e.to_string());
                            break 'run;
                        }
                    };
                    for c in done {
                        left = left.saturating_sub(1);
                        r.ios += 1;
                        r.bytes += len as u64;
                        if let Err(e) = c.check() {
                            fail(r, e.to_string());
                            continue;
                        }
                        if !write {
                            if let Err(e) = pair.slot_data(c.slot, &mut got) {
                                fail(r, e.to_string());
                                continue;
                            }
                            stamp(&mut data, c.lba, lba_size, opts.seed, pass);
                            let diff = data.iter().zip(&got).filter(|(a, b)| a != b).count();
                            if diff > 0 {
                                r.mismatched_bytes += diff as u64;
                                r.first_error.get_or_insert_with(|| {
                                    format!("LBA {}: {diff} bytes differ from those written", c.lba)
                                });
                            }
                        }
                    }
                }
            }
            unit += batch;
            let out_of_time = deadline.is_some_and(|d| Instant::now() >= d);
            let out_of_ios = ios.is_some_and(|n| r.ios >= n);
            if out_of_time || out_of_ios {
                break 'run;
            }
        }
        pass += 1;
        if deadline.is_none() && ios.is_none() {
            break;
        }
    }
}
