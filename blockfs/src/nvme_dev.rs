//! [`NvmeBlockDevice`]: blockfs over an NVMe namespace through the gpunvme driver's I/O queue
//! pairs.
//!
//! Each of several lanes owns a queue pair and a DMA bounce buffer cut into command-sized slots,
//! allocated once and reused. A batch is cut into commands of at most the controller's maximum
//! transfer size; small batches run on one lane from the calling thread, large ones over all
//! lanes, one thread per lane, each taking the batch's commands one at a time from a shared
//! queue and keeping as many in flight as it has slots (at most its share of the batch). Data is
//! copied between the caller's buffers and the slots by the lane threads, so the copies of
//! different lanes run in parallel. [`BlockDevice::write_from`] reads each command's bytes from
//! its source on the lane thread, right before the command is issued, and
//! [`BlockDevice::read_into`] writes each command's bytes to its sink on the lane thread as soon
//! as the command completes: no batch-sized staging buffer, and host-file I/O overlaps the
//! device's work from the first command to the last.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex, MutexGuard};

use nvme::{Controller, DmaMemory, DmaSlice, IoCommand, IoCompletion, IoQueuePair};

use crate::device::{
    BlockDevice, DataSink, DataSource, DeviceError, ReadReq, SinkReadReq, SourceWriteReq, WriteReq,
    check_request,
};

/// Tuning for [`NvmeBlockDevice`].
#[derive(Clone, Debug)]
pub struct NvmeDeviceOptions {
    /// Queue pairs (lanes) to create; capped at what the controller grants.
    pub queues: usize,
    /// Entries per queue.
    pub queue_depth: u16,
    /// Bytes of DMA bounce buffer per lane (rounded to whole command slots): the most a lane
    /// keeps in flight. Deep enough to keep a controller busy, shallow enough that data copied
    /// into a slot is still in the CPU cache when the controller reads it (and data it wrote
    /// when the lane copies it out): with 128 KiB commands, 32 slots per lane.
    pub bounce_bytes: usize,
    /// Batches smaller than this run on one lane without spawning threads.
    pub parallel_threshold: usize,
}

impl Default for NvmeDeviceOptions {
    fn default() -> Self {
        Self {
            queues: 4,
            queue_depth: 256,
            bounce_bytes: 4 << 20,
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
    /// One command's bytes on their way between a slot and a [`DataSource`] or [`DataSink`]
    /// (empty until the lane's first [`BlockDevice::write_from`] or [`BlockDevice::read_into`]).
    stage: Vec<u8>,
}

impl Lane {
    /// Runs `f` with the lane and its staging buffer of one command's size.
    fn with_stage<R>(&mut self, f: impl FnOnce(&mut Lane, &mut [u8]) -> R) -> R {
        let mut stage = std::mem::take(&mut self.stage);
        stage.resize(self.slot_bytes, 0);
        let r = f(self, &mut stage);
        self.stage = stage;
        r
    }
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

/// One command's worth of a request: its first LBA and its part of the request's data.
struct Piece<B> {
    lba: u64,
    buf: B,
}

/// Where a [`BlockDevice::write_from`] or [`BlockDevice::read_into`] command's bytes are in
/// the source or sink.
#[derive(Clone, Copy)]
struct HostRange {
    offset: u64,
    len: usize,
}

impl HostRange {
    /// The first `n` bytes and the rest.
    fn split_at(self, n: usize) -> (Self, Self) {
        let head = HostRange {
            offset: self.offset,
            len: n,
        };
        let tail = HostRange {
            offset: self.offset + n as u64,
            len: self.len - n,
        };
        (head, tail)
    }
}

/// The pieces of one batch that no lane has started yet, handed out one at a time so that a
/// lane that gets ahead takes more of them, plus a flag that stops every lane from starting
/// more once one of them failed.
struct Work<B> {
    queue: Mutex<std::vec::IntoIter<Piece<B>>>,
    failed: AtomicBool,
}

impl<B> Work<B> {
    fn new(pieces: Vec<Piece<B>>) -> Self {
        Self {
            queue: Mutex::new(pieces.into_iter()),
            failed: AtomicBool::new(false),
        }
    }

    /// The next piece to start, if any is left and no lane has failed.
    fn take(&self) -> Option<Piece<B>> {
        if self.failed.load(Ordering::Relaxed) {
            return None;
        }
        self.queue.lock().unwrap_or_else(|e| e.into_inner()).next()
    }

    /// Stops every lane from starting more pieces (a command or a source read failed).
    fn fail(&self) {
        self.failed.store(true, Ordering::Relaxed);
    }
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
                stage: Vec::new(),
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

    /// Checks `(lba, host offset, len)` requests against the namespace and cuts them into
    /// command-sized pieces that remember where their bytes are on the host; returns them with
    /// the batch's byte count.
    fn host_pieces(
        &self,
        reqs: impl Iterator<Item = (u64, u64, usize)> + Clone,
    ) -> Result<(Vec<Piece<HostRange>>, usize), DeviceError> {
        let mut total = 0;
        for (lba, _, len) in reqs.clone() {
            check_request(lba, len, self.lba_size, self.lba_count)?;
            total += len;
        }
        let pieces = self.pieces(
            reqs.map(|(lba, offset, len)| (lba, HostRange { offset, len }, len)),
            HostRange::split_at,
        );
        Ok((pieces, total))
    }

    /// Runs `pieces` over the lanes: on the calling thread if the batch is small, else one
    /// thread per lane. Lanes take pieces as they have room for them, each keeping at most its
    /// share of the batch (and at most its slots) in flight, so all lanes start at once and one
    /// that gets ahead (or a slow one) does not leave the others idle at the end.
    fn run<B: Send>(
        &self,
        pieces: Vec<Piece<B>>,
        total: usize,
        work: impl Fn(&mut Lane, &Work<B>, usize) -> Result<(), DeviceError> + Sync,
    ) -> Result<(), DeviceError> {
        if pieces.is_empty() {
            return Ok(());
        }
        let lanes = self.lanes.len().min(pieces.len());
        let share = pieces.len().div_ceil(lanes);
        let queue = Work::new(pieces);
        if total < self.threshold || lanes == 1 {
            return work(&mut self.lane(), &queue, usize::MAX);
        }
        let results: Vec<Result<(), DeviceError>> = std::thread::scope(|s| {
            let handles: Vec<_> = self.lanes[..lanes]
                .iter()
                .map(|lane| {
                    let (work, queue) = (&work, &queue);
                    s.spawn(move || {
                        work(
                            &mut lane.lock().unwrap_or_else(|e| e.into_inner()),
                            queue,
                            share,
                        )
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

/// Keeps up to `lane.slots` (and at most `cap`) commands in flight over the pieces in `work`:
/// `start(slot, piece)` fills the slot and returns the command, `finish(slot, piece)` consumes
/// a completed one (an error from either stops the batch). Returns the first error after every
/// submitted command has completed.
fn pump<B: AsLen>(
    lane: &mut Lane,
    work: &Work<B>,
    cap: usize,
    op: &'static str,
    mut start: impl FnMut(&DmaSlice, &Piece<B>) -> Result<IoCommand, DeviceError>,
    mut finish: impl FnMut(&DmaSlice, Piece<B>) -> Result<(), DeviceError>,
) -> Result<(), DeviceError> {
    let mut slot_piece: Vec<Option<Piece<B>>> = (0..lane.slots).map(|_| None).collect();
    let mut free: Vec<usize> = (0..lane.slots).rev().collect();
    let mut in_flight = 0usize;
    let mut first_error: Option<DeviceError> = None;
    let mut exhausted = false;
    let slice = |lane: &Lane, slot: usize, len: usize| {
        DmaSlice::new(lane.bounce.clone(), slot * lane.slot_bytes, len)
    };
    loop {
        let mut unrung = 0usize;
        while first_error.is_none() && !exhausted && in_flight < cap {
            let Some(&slot) = free.last() else { break };
            let Some(piece) = work.take() else {
                exhausted = true;
                break;
            };
            free.pop();
            let dma = slice(lane, slot, piece.buf.len_bytes());
            let submitted = start(&dma, &piece).and_then(|cmd| {
                lane.qp
                    .submit_deferred(cmd, slot as u64)
                    .map_err(|e| io_err(op, piece.lba, e))
            });
            if let Err(e) = submitted {
                work.fail();
                first_error = Some(e);
                free.push(slot);
                break;
            }
            slot_piece[slot] = Some(piece);
            in_flight += 1;
            unrung += 1;
            // Filling a slot may mean copying its data in: ring at once when the queue was
            // empty, then every few commands, so the controller starts on the first ones while
            // the rest are filled.
            if in_flight == 1 || unrung >= RING_EVERY {
                lane.qp.ring();
                unrung = 0;
            }
        }
        lane.qp.ring();
        if in_flight == 0 {
            break;
        }
        let mut done = std::mem::take(&mut lane.done);
        done.clear();
        if let Err(e) = lane.qp.wait(&mut done, 1) {
            // The queue pair failed (timeout, controller failure): nothing more will complete.
            work.fail();
            lane.done = done;
            return Err(first_error.unwrap_or(io_err(op, 0, e)));
        }
        for c in done.drain(..) {
            let slot = c.tag as usize;
            let Some(piece) = slot_piece.get_mut(slot).and_then(Option::take) else {
                continue;
            };
            in_flight -= 1;
            free.push(slot);
            match c.result {
                Ok(()) => {
                    let dma = slice(lane, slot, piece.buf.len_bytes());
                    if let Err(e) = finish(&dma, piece) {
                        work.fail();
                        first_error.get_or_insert(e);
                    }
                }
                Err(e) => {
                    work.fail();
                    first_error.get_or_insert(io_err(op, piece.lba, e));
                }
            }
        }
        lane.done = done;
    }
    first_error.map_or(Ok(()), Err)
}

trait AsLen {
    /// Bytes of a piece (the buffer types only share `len`).
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
impl AsLen for HostRange {
    fn len_bytes(&self) -> usize {
        self.len
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
        let pieces = self.pieces(
            reqs.iter_mut().map(|r| {
                let len = r.buf.len();
                (r.lba, &mut *r.buf, len)
            }),
            |b: &mut [u8], n| b.split_at_mut(n),
        );
        let nsid = self.nsid;
        self.run(pieces, total, |lane, work, cap| {
            pump(
                lane,
                work,
                cap,
                "read",
                |dma, p| {
                    Ok(IoCommand::Read {
                        nsid,
                        lba: p.lba,
                        buf: dma.clone(),
                    })
                },
                |dma, p| {
                    dma.read(p.buf);
                    Ok(())
                },
            )
        })
    }

    fn write(&self, reqs: &[WriteReq<'_>]) -> Result<(), DeviceError> {
        let mut total = 0;
        for r in reqs {
            check_request(r.lba, r.buf.len(), self.lba_size, self.lba_count)?;
            total += r.buf.len();
        }
        let pieces = self.pieces(
            reqs.iter().map(|r| (r.lba, r.buf, r.buf.len())),
            |b: &[u8], n| b.split_at(n),
        );
        let nsid = self.nsid;
        self.run(pieces, total, |lane, work, cap| {
            pump(
                lane,
                work,
                cap,
                "write",
                |dma, p| {
                    dma.write(p.buf);
                    Ok(IoCommand::Write {
                        nsid,
                        lba: p.lba,
                        buf: dma.clone(),
                    })
                },
                |_, _| Ok(()),
            )
        })
    }

    fn write_from(
        &self,
        reqs: &[SourceWriteReq],
        src: &dyn DataSource,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(), DeviceError> {
        let (pieces, total) =
            self.host_pieces(reqs.iter().map(|r| (r.lba, r.src_offset, r.len)))?;
        let nsid = self.nsid;
        self.run(pieces, total, |lane, work, cap| {
            // Each command's bytes go source -> a staging buffer of one command (which stays
            // in this core's cache) -> its DMA slot, right before the command is issued: DMA
            // memory is only ever reached through its copy accessors.
            lane.with_stage(|lane, stage| {
                pump(
                    lane,
                    work,
                    cap,
                    "write",
                    |dma, p| {
                        let buf = &mut stage[..p.buf.len];
                        src.read_exact_at(buf, p.buf.offset).map_err(|source| {
                            DeviceError::ReadSource {
                                offset: p.buf.offset,
                                source,
                            }
                        })?;
                        dma.write(buf);
                        Ok(IoCommand::Write {
                            nsid,
                            lba: p.lba,
                            buf: dma.clone(),
                        })
                    },
                    |_, p| {
                        progress(p.buf.len as u64);
                        Ok(())
                    },
                )
            })
        })
    }

    fn read_into(
        &self,
        reqs: &[SinkReadReq],
        sink: &dyn DataSink,
        progress: &(dyn Fn(u64) + Sync),
    ) -> Result<(), DeviceError> {
        let (pieces, total) =
            self.host_pieces(reqs.iter().map(|r| (r.lba, r.dst_offset, r.len)))?;
        let nsid = self.nsid;
        self.run(pieces, total, |lane, work, cap| {
            // Each completed command's bytes go slot -> a staging buffer of one command -> the
            // sink, on this lane's thread, while the lane's other commands are in flight.
            lane.with_stage(|lane, stage| {
                pump(
                    lane,
                    work,
                    cap,
                    "read",
                    |dma, p| {
                        Ok(IoCommand::Read {
                            nsid,
                            lba: p.lba,
                            buf: dma.clone(),
                        })
                    },
                    |dma, p| {
                        let buf = &mut stage[..p.buf.len];
                        dma.read(buf);
                        sink.write_all_at(buf, p.buf.offset).map_err(|source| {
                            DeviceError::WriteSink {
                                offset: p.buf.offset,
                                source,
                            }
                        })?;
                        progress(p.buf.len as u64);
                        Ok(())
                    },
                )
            })
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

#[cfg(test)]
mod tests {
    use std::io::ErrorKind;
    use std::sync::atomic::AtomicU64;

    use nvme::ControllerOptions;
    use nvme_emu::config::NamespaceConfig;
    use nvme_emu::{EmuConfig, EmuDevice};

    use super::*;

    const LBA: u32 = 512;

    fn controller(bytes: u64) -> (Arc<EmuDevice>, Controller) {
        let cfg = EmuConfig {
            namespaces: vec![NamespaceConfig::memory(bytes, LBA)],
            ..EmuConfig::default()
        };
        let emu = EmuDevice::start(cfg).expect("software controller");
        let ctrl = Controller::new(emu.clone(), ControllerOptions::default()).expect("bring-up");
        (emu, ctrl)
    }

    /// Small bounce buffers, so a batch reuses every slot many times over.
    fn device(ctrl: &Controller) -> NvmeBlockDevice {
        let opts = NvmeDeviceOptions {
            bounce_bytes: 1 << 20,
            ..NvmeDeviceOptions::default()
        };
        NvmeBlockDevice::new(ctrl, 1, &opts).expect("NVMe block device")
    }

    fn source(len: usize, seed: u64) -> Vec<u8> {
        (0..len as u64)
            .map(|i| ((i ^ seed).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 56) as u8)
            .collect()
    }

    fn read(dev: &NvmeBlockDevice, lba: u64, len: usize) -> Vec<u8> {
        let mut buf = vec![0u8; len];
        dev.read(&mut [ReadReq { lba, buf: &mut buf }]).unwrap();
        buf
    }

    /// A source whose reads of byte `bad` fail.
    struct Failing<'a> {
        data: &'a [u8],
        bad: u64,
    }

    impl DataSource for Failing<'_> {
        fn read_exact_at(&self, buf: &mut [u8], offset: u64) -> std::io::Result<()> {
            if (offset..offset + buf.len() as u64).contains(&self.bad) {
                return Err(std::io::Error::other("injected source failure"));
            }
            self.data.read_exact_at(buf, offset)
        }
    }

    #[test]
    fn write_from_spreads_over_the_lanes_and_lands_every_byte() {
        let (_emu, ctrl) = controller(96 << 20);
        let dev = device(&ctrl);
        assert!(dev.queue_pairs() > 1, "{}", dev.describe());
        let src = source(40 << 20, 1);
        // Requests of odd lengths at scattered LBAs, from scattered source offsets: a large
        // batch (all lanes) and a small one (the calling thread).
        for reqs in [
            vec![
                SourceWriteReq {
                    lba: 8,
                    src_offset: 512 * 3,
                    len: 30 << 20,
                },
                SourceWriteReq {
                    lba: 80_000,
                    src_offset: 17,
                    len: 7 * 512,
                },
                SourceWriteReq {
                    lba: 100_000,
                    src_offset: (30 << 20) + 5,
                    len: (9 << 20) + 512,
                },
            ],
            vec![SourceWriteReq {
                lba: 150_000,
                src_offset: 1000,
                len: 64 << 10,
            }],
        ] {
            let seen = AtomicU64::new(0);
            dev.write_from(&reqs, &src, &|n| {
                seen.fetch_add(n, Ordering::Relaxed);
            })
            .unwrap();
            let total: usize = reqs.iter().map(|r| r.len).sum();
            assert_eq!(seen.into_inner(), total as u64);
            for r in &reqs {
                let want = &src[r.src_offset as usize..][..r.len];
                assert!(read(&dev, r.lba, r.len) == want, "request {r:?}");
            }
        }
        // Whole-LBA requests only.
        let e = dev
            .write_from(
                &[SourceWriteReq {
                    lba: 0,
                    src_offset: 0,
                    len: 100,
                }],
                &src,
                &|_| {},
            )
            .unwrap_err();
        assert!(matches!(e, DeviceError::Misaligned { len: 100, .. }), "{e}");
    }

    #[test]
    fn write_from_failures_stop_the_batch_and_leave_the_lanes_usable() {
        let (emu, ctrl) = controller(64 << 20);
        let dev = device(&ctrl);
        let src = source(32 << 20, 3);
        let whole = [SourceWriteReq {
            lba: 0,
            src_offset: 0,
            len: 32 << 20,
        }];
        // A source read fails: reported with its offset, as a source error.
        let bad = (20 << 20) + 12_345;
        let failing = Failing { data: &src, bad };
        match dev.write_from(&whole, &failing, &|_| {}) {
            Err(DeviceError::ReadSource { offset, source }) => {
                assert!(offset <= bad && bad < offset + dev.chunk as u64, "{offset}");
                assert_eq!(source.kind(), ErrorKind::Other);
            }
            other => panic!("{other:?}"),
        }
        // The source ends early.
        let short = &src[..1 << 20];
        match dev.write_from(&whole, &short, &|_| {}) {
            Err(DeviceError::ReadSource { source, .. }) => {
                assert_eq!(source.kind(), ErrorKind::UnexpectedEof)
            }
            other => panic!("{other:?}"),
        }
        // The controller fails a command: a device error naming its LBA range.
        let bad_lba = 40_000;
        emu.faults().add_media_error(1, bad_lba);
        match dev.write_from(&whole, &src, &|_| {}) {
            Err(DeviceError::Io {
                op: "write", lba, ..
            }) => {
                assert!(
                    lba <= bad_lba && bad_lba < lba + (dev.chunk / 512) as u64,
                    "{lba}"
                )
            }
            other => panic!("{other:?}"),
        }
        emu.faults().clear_media_errors();
        // Every lane still works: the whole batch again, then a plain write and a read.
        dev.write_from(&whole, &src, &|_| {}).unwrap();
        assert!(read(&dev, 0, 32 << 20) == src);
        let other = source(8 << 20, 4);
        dev.write(&[WriteReq {
            lba: 2048,
            buf: &other,
        }])
        .unwrap();
        assert!(read(&dev, 2048, 8 << 20) == other);
    }

    /// A sink whose writes touching byte `bad` fail; the rest land in memory.
    struct FailingSink {
        inner: Mutex<Vec<u8>>,
        bad: u64,
    }

    impl DataSink for FailingSink {
        fn write_all_at(&self, buf: &[u8], offset: u64) -> std::io::Result<()> {
            if (offset..offset + buf.len() as u64).contains(&self.bad) {
                return Err(std::io::Error::other("injected sink failure"));
            }
            self.inner.write_all_at(buf, offset)
        }
    }

    #[test]
    fn read_into_spreads_over_the_lanes_and_delivers_every_byte() {
        let (_emu, ctrl) = controller(96 << 20);
        let dev = device(&ctrl);
        assert!(dev.queue_pairs() > 1, "{}", dev.describe());
        let data = source(80 << 20, 5);
        dev.write(&[WriteReq { lba: 0, buf: &data }]).unwrap();
        // Scattered LBA ranges to scattered, disjoint sink offsets: a large batch (all lanes) and a small
        // one (the calling thread).
        for reqs in [
            vec![
                SinkReadReq {
                    lba: 8,
                    dst_offset: 512 * 3,
                    len: 30 << 20,
                },
                SinkReadReq {
                    lba: 80_000,
                    dst_offset: (50 << 20) + 17,
                    len: 7 * 512,
                },
                SinkReadReq {
                    lba: 100_000,
                    dst_offset: (31 << 20) + 5,
                    len: (9 << 20) + 512,
                },
            ],
            vec![SinkReadReq {
                lba: 150_000,
                dst_offset: 1000,
                len: 64 << 10,
            }],
        ] {
            let sink = Mutex::new(Vec::new());
            let seen = AtomicU64::new(0);
            dev.read_into(&reqs, &sink, &|n| {
                seen.fetch_add(n, Ordering::Relaxed);
            })
            .unwrap();
            let total: usize = reqs.iter().map(|r| r.len).sum();
            assert_eq!(seen.into_inner(), total as u64);
            let got = sink.into_inner().unwrap();
            for r in &reqs {
                let want = &data[r.lba as usize * 512..][..r.len];
                assert!(&got[r.dst_offset as usize..][..r.len] == want, "{r:?}");
            }
        }
        // Whole-LBA requests only.
        let e = dev
            .read_into(
                &[SinkReadReq {
                    lba: 0,
                    dst_offset: 0,
                    len: 100,
                }],
                &Mutex::new(Vec::new()),
                &|_| {},
            )
            .unwrap_err();
        assert!(matches!(e, DeviceError::Misaligned { len: 100, .. }), "{e}");
    }

    #[test]
    fn read_into_failures_stop_the_batch_and_leave_the_lanes_usable() {
        let (emu, ctrl) = controller(64 << 20);
        let dev = device(&ctrl);
        let data = source(32 << 20, 6);
        dev.write(&[WriteReq { lba: 0, buf: &data }]).unwrap();
        let whole = [SinkReadReq {
            lba: 0,
            dst_offset: 0,
            len: 32 << 20,
        }];
        // A sink write fails: reported with its offset, as a sink error.
        let bad = (20 << 20) + 12_345;
        let failing = FailingSink {
            inner: Mutex::new(Vec::new()),
            bad,
        };
        match dev.read_into(&whole, &failing, &|_| {}) {
            Err(DeviceError::WriteSink { offset, source }) => {
                assert!(offset <= bad && bad < offset + dev.chunk as u64, "{offset}");
                assert_eq!(source.kind(), ErrorKind::Other);
            }
            other => panic!("{other:?}"),
        }
        // The controller fails a command: a device error naming its LBA range.
        let bad_lba = 40_000;
        emu.faults().add_media_error(1, bad_lba);
        match dev.read_into(&whole, &Mutex::new(Vec::new()), &|_| {}) {
            Err(DeviceError::Io {
                op: "read", lba, ..
            }) => {
                assert!(
                    lba <= bad_lba && bad_lba < lba + (dev.chunk / 512) as u64,
                    "{lba}"
                )
            }
            other => panic!("{other:?}"),
        }
        emu.faults().clear_media_errors();
        // Every lane still works.
        let sink = Mutex::new(Vec::new());
        dev.read_into(&whole, &sink, &|_| {}).unwrap();
        assert!(sink.into_inner().unwrap() == data);
    }
}
