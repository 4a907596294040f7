//! [`NvmeBlockDevice`]: blockfs over an NVMe namespace through the gpunvme driver's I/O queue
//! pairs.
//!
//! Each of several lanes owns a queue pair and a DMA bounce buffer cut into command-sized slots,
//! allocated once and reused. A batch is cut into commands of at most the controller's maximum
//! transfer size; small batches run on one lane from the calling thread, large ones are split
//! over all lanes, one thread per lane, each keeping as many commands in flight as it has
//! slots. Data is copied between the caller's buffers and the slots by the lane threads, so the
//! copies of different lanes run in parallel.

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use nvme::{Controller, DmaMemory, DmaSlice, IoCommand, IoCompletion, IoQueuePair};

use crate::device::{BlockDevice, DeviceError, ReadReq, WriteReq, check_request};

/// Tuning for [`NvmeBlockDevice`].
#[derive(Clone, Debug)]
pub struct NvmeDeviceOptions {
    /// Queue pairs (lanes) to create; capped at what the controller grants.
    pub queues: usize,
    /// Entries per queue.
    pub queue_depth: u16,
    /// Bytes of DMA bounce buffer per lane (rounded to whole command slots).
    pub bounce_bytes: usize,
    /// Batches smaller than this run on one lane without spawning threads.
    pub parallel_threshold: usize,
}

impl Default for NvmeDeviceOptions {
    fn default() -> Self {
        Self {
            queues: 4,
            queue_depth: 256,
            bounce_bytes: 16 << 20,
            parallel_threshold: 4 << 20,
        }
    }
}

/// One queue pair with its bounce buffer.
struct Lane {
    qp: IoQueuePair,
    bounce: Arc<DmaMemory>,
    slots: usize,
    slot_bytes: usize,
    done: Vec<IoCompletion>,
}

/// A block device over one NVMe namespace.
pub struct NvmeBlockDevice {
    nsid: u32,
    lba_size: u32,
    lba_count: u64,
    chunk: usize,
    lanes: Vec<Mutex<Lane>>,
    next_lane: AtomicUsize,
    write_zeroes: bool,
    threshold: usize,
    description: String,
}

impl std::fmt::Debug for NvmeBlockDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("NvmeBlockDevice")
            .field("nsid", &self.nsid)
            .field("lba_size", &self.lba_size)
            .field("lba_count", &self.lba_count)
            .field("lanes", &self.lanes.len())
            .finish()
    }
}

fn io_err(
    op: &'static str,
    lba: u64,
    e: impl std::error::Error + Send + Sync + 'static,
) -> DeviceError {
    DeviceError::Io {
        op,
        lba,
        source: Box::new(e),
    }
}

/// One command's worth of a request: `lba` and the byte range it covers in request `req`.
struct Piece<B> {
    lba: u64,
    buf: B,
}

impl NvmeBlockDevice {
    /// Creates the queue pairs and bounce buffers for namespace `nsid` of `ctrl`.
    pub fn new(
        ctrl: &Controller,
        nsid: u32,
        opts: &NvmeDeviceOptions,
    ) -> Result<Self, DeviceError> {
        let ns = ctrl
            .namespace(nsid)
            .map_err(|e| io_err("finding the namespace", 0, e))?
            .clone();
        let info = ctrl.info();
        let lba = ns.lba_size as usize;
        let queues = opts
            .queues
            .clamp(1, info.max_io_queue_pairs.max(1) as usize);
        let mut lanes = Vec::with_capacity(queues);
        let mut chunk = 0usize;
        for _ in 0..queues {
            let qp = match ctrl.create_io_queue_pair(opts.queue_depth) {
                Ok(qp) => qp,
                // Fewer queues than asked for is fine as long as there is one.
                Err(e) if lanes.is_empty() => {
                    return Err(io_err("creating an I/O queue pair", 0, e));
                }
                Err(_) => break,
            };
            chunk = qp.max_transfer_bytes() / lba * lba;
            if chunk == 0 {
                return Err(io_err(
                    "planning transfers",
                    0,
                    std::io::Error::other(format!(
                        "maximum transfer {} is smaller than one {lba}-byte LBA",
                        qp.max_transfer_bytes()
                    )),
                ));
            }
            let slots = (opts.bounce_bytes / chunk).clamp(1, qp.capacity().max(1));
            let bounce = ctrl
                .device()
                .alloc_dma(slots * chunk)
                .map_err(|e| io_err("allocating DMA bounce buffers", 0, e))?;
            lanes.push(Mutex::new(Lane {
                qp,
                bounce: Arc::new(bounce),
                slots,
                slot_bytes: chunk,
                done: Vec::new(),
            }));
        }
        Ok(Self {
            nsid,
            lba_size: ns.lba_size,
            lba_count: ns.blocks,
            chunk,
            write_zeroes: info.write_zeroes,
            threshold: opts.parallel_threshold,
            description: format!(
                "NVMe namespace {nsid} ({} LBAs of {} bytes) on {}, {} queue pair(s), {} KiB per command",
                ns.blocks,
                ns.lba_size,
                ctrl.device().describe(),
                lanes.len(),
                chunk / 1024
            ),
            lanes,
            next_lane: AtomicUsize::new(0),
        })
    }

    /// Number of queue pairs in use.
    pub fn queue_pairs(&self) -> usize {
        self.lanes.len()
    }

    /// Any free lane, else the next one in turn.
    fn lane(&self) -> MutexGuard<'_, Lane> {
        let start = self.next_lane.fetch_add(1, Ordering::Relaxed);
        for i in 0..self.lanes.len() {
            if let Ok(l) = self.lanes[(start + i) % self.lanes.len()].try_lock() {
                return l;
            }
        }
        self.lanes[start % self.lanes.len()]
            .lock()
            .unwrap_or_else(|e| e.into_inner())
    }

    /// Cuts requests into command-sized pieces.
    fn pieces<B, R>(&self, reqs: R, split: impl Fn(B, usize) -> (B, B)) -> Vec<Piece<B>>
    where
        R: IntoIterator<Item = (u64, B, usize)>,
    {
        let lba = self.lba_size as usize;
        let mut out = Vec::new();
        for (mut at, mut buf, mut len) in reqs {
            while len > 0 {
                let n = len.min(self.chunk);
                let (head, tail) = split(buf, n);
                out.push(Piece { lba: at, buf: head });
                buf = tail;
                len -= n;
                at += (n / lba) as u64;
            }
        }
        out
    }

    /// Runs `pieces` over the lanes: on the calling thread if the batch is small, else one
    /// thread per lane with the pieces dealt out in contiguous groups.
    fn run<B: Send>(
        &self,
        pieces: &mut [Piece<B>],
        total: usize,
        work: impl Fn(&mut Lane, &mut [Piece<B>]) -> Result<(), DeviceError> + Sync,
    ) -> Result<(), DeviceError> {
        if pieces.is_empty() {
            return Ok(());
        }
        let lanes = self.lanes.len().min(pieces.len());
        if total < self.threshold || lanes == 1 {
            return work(&mut self.lane(), pieces);
        }
        let per = pieces.len().div_ceil(lanes);
        let results: Vec<Result<(), DeviceError>> = std::thread::scope(|s| {
            let handles: Vec<_> = pieces
                .chunks_mut(per)
                .zip(&self.lanes)
                .map(|(group, lane)| {
                    let work = &work;
                    s.spawn(move || {
                        work(&mut lane.lock().unwrap_or_else(|e| e.into_inner()), group)
                    })
                })
                .collect();
            handles
                .into_iter()
                .map(|h| {
                    h.join().unwrap_or_else(|_| {
                        Err(io_err(
                            "running a lane",
                            0,
                            std::io::Error::other("lane thread panicked"),
                        ))
                    })
                })
                .collect()
        });
        results.into_iter().collect()
    }
}

/// Commands queued between doorbell writes while a lane fills its slots.
const RING_EVERY: usize = 4;

/// Keeps up to `lane.slots` commands in flight over `pieces`: `start(slot, piece)` fills the
/// slot and returns the command, `finish(slot, piece)` consumes a completed one. Returns the
/// first error after every submitted command has completed.
fn pump<B: AsLen>(
    lane: &mut Lane,
    pieces: &mut [Piece<B>],
    op: &'static str,
    mut start: impl FnMut(&DmaSlice, &Piece<B>) -> IoCommand,
    mut finish: impl FnMut(&DmaSlice, &mut Piece<B>),
) -> Result<(), DeviceError> {
    let mut slot_piece: Vec<Option<usize>> = vec![None; lane.slots];
    let mut free: Vec<usize> = (0..lane.slots).rev().collect();
    let mut next = 0usize;
    let mut in_flight = 0usize;
    let mut first_error: Option<DeviceError> = None;
    let slice = |lane: &Lane, slot: usize, len: usize| {
        DmaSlice::new(lane.bounce.clone(), slot * lane.slot_bytes, len)
    };
    loop {
        let mut unrung = 0usize;
        while first_error.is_none() && next < pieces.len() {
            let Some(slot) = free.pop() else { break };
            // Filling a slot may mean copying its data in: ring every few commands so the
            // controller starts on the first ones while the rest are copied.
            if unrung >= RING_EVERY {
                lane.qp.ring();
                unrung = 0;
            }
            let len = piece_len(&pieces[next]);
            let dma = slice(lane, slot, len);
            let cmd = start(&dma, &pieces[next]);
            if let Err(e) = lane.qp.submit_deferred(cmd, slot as u64) {
                first_error = Some(io_err(op, pieces[next].lba, e));
                free.push(slot);
                break;
            }
            slot_piece[slot] = Some(next);
            in_flight += 1;
            next += 1;
            unrung += 1;
        }
        lane.qp.ring();
        if in_flight == 0 {
            break;
        }
        let mut done = std::mem::take(&mut lane.done);
        done.clear();
        if let Err(e) = lane.qp.wait(&mut done, 1) {
            // The queue pair failed (timeout, controller failure): nothing more will complete.
            lane.done = done;
            return Err(first_error.unwrap_or(io_err(op, 0, e)));
        }
        for c in done.drain(..) {
            let slot = c.tag as usize;
            let Some(idx) = slot_piece.get_mut(slot).and_then(Option::take) else {
                continue;
            };
            in_flight -= 1;
            free.push(slot);
            match c.result {
                Ok(()) => {
                    let len = piece_len(&pieces[idx]);
                    finish(&slice(lane, slot, len), &mut pieces[idx]);
                }
                Err(e) => {
                    first_error.get_or_insert(io_err(op, pieces[idx].lba, e));
                }
            }
        }
        lane.done = done;
    }
    first_error.map_or(Ok(()), Err)
}

/// Bytes of a piece (the buffer types only share `len`).
fn piece_len<B: AsLen>(p: &Piece<B>) -> usize {
    p.buf.len_bytes()
}

trait AsLen {
    fn len_bytes(&self) -> usize;
}
impl AsLen for &mut [u8] {
    fn len_bytes(&self) -> usize {
        self.len()
    }
}
impl AsLen for &[u8] {
    fn len_bytes(&self) -> usize {
        self.len()
    }
}

impl BlockDevice for NvmeBlockDevice {
    fn lba_size(&self) -> u32 {
        self.lba_size
    }

    fn lba_count(&self) -> u64 {
        self.lba_count
    }

    fn read(&self, reqs: &mut [ReadReq<'_>]) -> Result<(), DeviceError> {
        let mut total = 0;
        for r in reqs.iter() {
            check_request(r.lba, r.buf.len(), self.lba_size, self.lba_count)?;
            total += r.buf.len();
        }
        let mut pieces = self.pieces(
            reqs.iter_mut().map(|r| {
                let len = r.buf.len();
                (r.lba, &mut *r.buf, len)
            }),
            |b: &mut [u8], n| b.split_at_mut(n),
        );
        let nsid = self.nsid;
        self.run(&mut pieces, total, |lane, group| {
            pump(
                lane,
                group,
                "read",
                |dma, p| IoCommand::Read {
                    nsid,
                    lba: p.lba,
                    buf: dma.clone(),
                },
                |dma, p| dma.read(p.buf),
            )
        })
    }

    fn write(&self, reqs: &[WriteReq<'_>]) -> Result<(), DeviceError> {
        let mut total = 0;
        for r in reqs {
            check_request(r.lba, r.buf.len(), self.lba_size, self.lba_count)?;
            total += r.buf.len();
        }
        let mut pieces = self.pieces(
            reqs.iter().map(|r| (r.lba, r.buf, r.buf.len())),
            |b: &[u8], n| b.split_at(n),
        );
        let nsid = self.nsid;
        self.run(&mut pieces, total, |lane, group| {
            pump(
                lane,
                group,
                "write",
                |dma, p| {
                    dma.write(p.buf);
                    IoCommand::Write {
                        nsid,
                        lba: p.lba,
                        buf: dma.clone(),
                    }
                },
                |_, _| {},
            )
        })
    }

    fn flush(&self) -> Result<(), DeviceError> {
        self.lane()
            .qp
            .flush(self.nsid)
            .map_err(|e| io_err("flush", 0, e))
    }

    fn write_zeroes(&self, lba: u64, count: u64) -> Result<(), DeviceError> {
        let len = count.saturating_mul(self.lba_size as u64);
        let end = lba.saturating_add(count);
        if end > self.lba_count || len > usize::MAX as u64 {
            return Err(DeviceError::OutOfRange {
                lba,
                end,
                blocks: self.lba_count,
            });
        }
        if self.write_zeroes {
            return self
                .lane()
                .qp
                .write_zeroes(self.nsid, lba, count)
                .map_err(|e| io_err("write zeroes", lba, e));
        }
        let per = (self.chunk.max(1 << 20) / self.lba_size as usize) as u64;
        let zeroes = vec![0u8; (per.min(count) * self.lba_size as u64) as usize];
        let mut done = 0;
        while done < count {
            let n = per.min(count - done);
            self.write(&[WriteReq {
                lba: lba + done,
                buf: &zeroes[..(n * self.lba_size as u64) as usize],
            }])?;
            done += n;
        }
        Ok(())
    }

    fn nvme_nsid(&self) -> Option<u32> {
        Some(self.nsid)
    }

    fn describe(&self) -> String {
        self.description.clone()
    }
}
