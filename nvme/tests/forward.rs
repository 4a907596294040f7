//! The driver against the software controller with forwarded namespaces (`nvme_emu::forward`):
//! a far controller faked in memory behind the `Forwarder` seam, answering out of order.
//! Bytes land on the far media and come back; many commands are in flight on one channel at
//! once; the far controller's statuses reach the host; a failed channel fails its commands
//! with Transient Transport Error (retryable) and the next command opens a new one; Flush,
//! Write Zeroes and Dataset Management are forwarded; a queue deleted with commands in flight
//! forgets them (their late answers never touch host memory); a far controller that cannot be
//! reached again makes the controller fatal (CSTS.CFS), so hosts stop rather than retry.

use std::sync::atomic::{AtomicBool, AtomicUsize, Ordering};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use anyhow::{Context, Result, ensure};
use nvme::nvme_spec::status::{generic, media};
use nvme::nvme_spec::{Command, NvmOpcode, Status};
use nvme::{Controller, ControllerOptions, Device, DmaMemory, DmaSlice, IoCommand, IoCompletion};
use nvme_emu::{
    Backend, EmuConfig, EmuDevice, ForwardChannel, ForwardData, ForwardDone, ForwardError,
    Forwarded, Forwarder, NamespaceConfig,
};

const LBA: u32 = 512;
const BLOCKS: u64 = 8192;
/// The far namespace id (not 1, so a forgotten NSID rewrite shows).
const FAR_NSID: u32 = 7;

/// The far controller: its media, and knobs and counts for the tests.
#[derive(Default)]
struct Far {
    media: Mutex<Vec<u8>>,
    opened: AtomicUsize,
    max_in_flight: AtomicUsize,
    /// The next poll fails the channel.
    fail_next_poll: AtomicBool,
    /// Answers nothing (commands stay in flight).
    hold: AtomicBool,
    /// No channel opens (the far controller is gone).
    refuse: AtomicBool,
    /// Reads of this LBA fail with Unrecovered Read Error.
    bad_lba: Mutex<Option<u64>>,
    /// Opcodes and NSIDs seen.
    seen: Mutex<Vec<(u8, u32)>>,
}

struct FarLink(Arc<Far>);

struct FarChannel {
    far: Arc<Far>,
    answers: Vec<ForwardDone>,
}

impl Forwarder for FarLink {
    fn channel(&self) -> Result<Box<dyn ForwardChannel>, ForwardError> {
        if self.0.refuse.load(Ordering::SeqCst) {
            return Err(ForwardError("connection refused".into()));
        }
        self.0.opened.fetch_add(1, Ordering::SeqCst);
        Ok(Box::new(FarChannel {
            far: self.0.clone(),
            answers: Vec::new(),
        }))
    }

    fn describe(&self) -> String {
        "a far controller in memory".into()
    }
}

impl ForwardChannel for FarChannel {
    fn has_room(&self) -> bool {
        self.answers.len() < 128
    }

    fn submit(&mut self, tag: u64, cmd: Command, data: ForwardData) -> Result<(), ForwardError> {
        let far = &self.far;
        far.seen.lock().unwrap().push((cmd.cdw0.opcode(), cmd.nsid));
        let op = NvmOpcode(cmd.cdw0.opcode());
        let at = (cmd.slba() * LBA as u64) as usize;
        let len = ((cmd.cdw12 & 0xffff) as usize + 1) * LBA as usize;
        let mut status = Status::SUCCESS;
        let mut out = Vec::new();
        let mut m = far.media.lock().unwrap();
        if cmd.nsid != FAR_NSID && op != NvmOpcode::FLUSH {
            status = Status::generic(generic::INVALID_NAMESPACE_OR_FORMAT);
        } else if op == NvmOpcode::READ {
            let bad = *far.bad_lba.lock().unwrap();
            if bad.is_some_and(|b| {
                (cmd.slba()..cmd.slba() + (len / LBA as usize) as u64).contains(&b)
            }) {
                status = Status::media(media::UNRECOVERED_READ_ERROR);
            } else {
                out = m[at..at + len].to_vec();
            }
            assert!(matches!(data, ForwardData::FromController(n) if n == len));
        } else if op == NvmOpcode::WRITE {
            let ForwardData::ToController(bytes) = data else {
                panic!("a write without data");
            };
            assert_eq!(bytes.len(), len);
            m[at..at + len].copy_from_slice(&bytes);
        } else if op == NvmOpcode::WRITE_ZEROES {
            m[at..at + len].fill(0);
        }
        drop(m);
        self.answers.push(ForwardDone {
            tag,
            status,
            dw0: 0,
            data: out,
        });
        far.max_in_flight
            .fetch_max(self.answers.len(), Ordering::SeqCst);
        Ok(())
    }

    fn poll(&mut self, wait: Duration, done: &mut Vec<ForwardDone>) -> Result<(), ForwardError> {
        if self.far.fail_next_poll.swap(false, Ordering::SeqCst) {
            return Err(ForwardError(
                "connection reset by the far controller".into(),
            ));
        }
        if self.far.hold.load(Ordering::SeqCst) || self.answers.is_empty() {
            std::thread::sleep(wait.min(Duration::from_millis(1)));
            return Ok(());
        }
        // Newest first: out of order.
        done.extend(self.answers.drain(..).rev());
        Ok(())
    }
}

fn start(far: &Arc<Far>) -> Result<(Arc<EmuDevice>, Controller)> {
    *far.media.lock().unwrap() = vec![0; (BLOCKS * LBA as u64) as usize];
    let cfg = EmuConfig {
        namespaces: vec![NamespaceConfig {
            backend: Backend::Forwarded(Forwarded {
                forwarder: Arc::new(FarLink(far.clone())),
                nsid: FAR_NSID,
            }),
            ..NamespaceConfig::memory(BLOCKS * LBA as u64, LBA)
        }],
        controller_threads: 2,
        hostile: nvme_emu::Hostile::ALL,
        ..EmuConfig::default()
    };
    let emu = EmuDevice::start(cfg).context("starting the software controller")?;
    let dev: Arc<dyn Device> = emu.clone();
    let opts = ControllerOptions {
        admin_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(5),
        ..ControllerOptions::default()
    };
    Ok((emu, Controller::new(dev, opts)?))
}

fn pattern(seed: u64, len: usize) -> Vec<u8> {
    (0..len)
        .map(|i| (i as u64).wrapping_mul(2654435761).wrapping_add(seed) as u8 ^ (i >> 9) as u8)
        .collect()
}

fn dma(ctrl: &Controller, len: usize) -> Result<Arc<DmaMemory>> {
    Ok(Arc::new(ctrl.device().alloc_dma(len)?))
}

/// Submits `n` 4 KiB commands of `op` at LBA 8*i, all at once, and waits for them all.
fn many(
    qp: &mut nvme::IoQueuePair,
    buf: &Arc<DmaMemory>,
    n: usize,
    write: bool,
) -> Result<Vec<IoCompletion>> {
    for i in 0..n {
        let slice = DmaSlice::new(buf.clone(), i * 4096, 4096);
        let lba = i as u64 * 8;
        let cmd = if write {
            IoCommand::Write {
                nsid: 1,
                lba,
                buf: slice,
            }
        } else {
            IoCommand::Read {
                nsid: 1,
                lba,
                buf: slice,
            }
        };
        qp.submit(cmd, i as u64)?;
    }
    let mut out = Vec::new();
    qp.wait(&mut out, n)?;
    Ok(out)
}

#[test]
fn bytes_round_trip_through_the_far_controller_with_many_in_flight() -> Result<()> {
    let far = Arc::new(Far::default());
    let (_emu, ctrl) = start(&far)?;
    let mut qp = ctrl.create_io_queue_pair(64)?;
    let n = 48;
    let data = pattern(3, n * 4096);
    let wbuf = dma(&ctrl, n * 4096)?;
    wbuf.write(0, &data);
    for c in many(&mut qp, &wbuf, n, true)? {
        c.result?;
    }
    ensure!(
        far.media.lock().unwrap()[..n * 4096] == data[..],
        "the far media holds what was written"
    );
    let rbuf = dma(&ctrl, n * 4096)?;
    for c in many(&mut qp, &rbuf, n, false)? {
        c.result?;
    }
    let mut back = vec![0; n * 4096];
    rbuf.read(0, &mut back);
    ensure!(back == data, "the bytes read back are the bytes written");
    let most = far.max_in_flight.load(Ordering::SeqCst);
    ensure!(
        most >= 8,
        "only {most} commands were in flight on the channel at once"
    );
    ensure!(
        far.seen
            .lock()
            .unwrap()
            .iter()
            .all(|&(_, nsid)| nsid == FAR_NSID),
        "every command carried the far namespace id"
    );
    // Odd shapes through the driver's helpers: a PRP list, unaligned host offsets.
    let big = pattern(9, 256 * 1024);
    let buf = dma(&ctrl, 256 * 1024 + 512)?;
    buf.write(512, &big);
    qp.write(1, 4000, &DmaSlice::new(buf.clone(), 512, big.len()))?;
    let back_buf = dma(&ctrl, big.len())?;
    qp.read(1, 4000, &DmaSlice::new(back_buf.clone(), 0, big.len()))?;
    let mut back = vec![0; big.len()];
    back_buf.read(0, &mut back);
    ensure!(back == big, "a 256 KiB round trip through a PRP list");
    Ok(())
}

#[test]
fn far_statuses_reach_the_host_and_a_failed_channel_is_retryable() -> Result<()> {
    let far = Arc::new(Far::default());
    let (_emu, ctrl) = start(&far)?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let buf = dma(&ctrl, 4096)?;
    *far.bad_lba.lock().unwrap() = Some(17);
    let e = qp
        .read(1, 16, &DmaSlice::new(buf.clone(), 0, 4096))
        .unwrap_err();
    let s = e.status().context("a status")?;
    ensure!(
        (s.sct.0, s.sc) == (2, media::UNRECOVERED_READ_ERROR),
        "the far controller's media error: {e}"
    );
    *far.bad_lba.lock().unwrap() = None;
    // Out of range is refused on this side (by the driver, or the controller in front),
    // before anything is sent on.
    let before = far.seen.lock().unwrap().len();
    let e = qp
        .read(1, BLOCKS, &DmaSlice::new(buf.clone(), 0, 512))
        .unwrap_err();
    ensure!(
        e.status().is_none_or(|s| s.sc == generic::LBA_OUT_OF_RANGE),
        "out of range: {e}"
    );
    ensure!(
        far.seen.lock().unwrap().len() == before,
        "an invalid command was sent on"
    );

    // The channel fails: the command in flight fails, retryable; the next one reconnects.
    far.fail_next_poll.store(true, Ordering::SeqCst);
    far.hold.store(true, Ordering::SeqCst);
    let opened = far.opened.load(Ordering::SeqCst);
    let e = qp
        .read(1, 0, &DmaSlice::new(buf.clone(), 0, 4096))
        .unwrap_err();
    let s = e.status().context("a status")?;
    ensure!(
        (s.sct.0, s.sc, s.dnr) == (0, generic::TRANSIENT_TRANSPORT_ERROR, false),
        "a failed channel is a retryable Transient Transport Error: {e}"
    );
    far.hold.store(false, Ordering::SeqCst);
    qp.read(1, 0, &DmaSlice::new(buf.clone(), 0, 4096))?;
    ensure!(
        far.opened.load(Ordering::SeqCst) == opened + 1,
        "the next command opened a new channel"
    );
    Ok(())
}

#[test]
fn flush_write_zeroes_and_deallocate_are_forwarded() -> Result<()> {
    let far = Arc::new(Far::default());
    let (_emu, ctrl) = start(&far)?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let buf = dma(&ctrl, 8192)?;
    buf.write(0, &[0xa5; 8192]);
    qp.write(1, 100, &DmaSlice::new(buf.clone(), 0, 8192))?;
    qp.flush(1)?;
    qp.write_zeroes(1, 100, 8)?;
    ensure!(
        far.media.lock().unwrap()[100 * 512..116 * 512]
            .iter()
            .enumerate()
            .all(|(i, &b)| b == if i < 4096 { 0 } else { 0xa5 }),
        "Write Zeroes zeroed the far blocks, and only those"
    );
    qp.deallocate(1, &[(200, 8)])?;
    let seen: Vec<u8> = far.seen.lock().unwrap().iter().map(|s| s.0).collect();
    for op in [
        NvmOpcode::FLUSH,
        NvmOpcode::WRITE_ZEROES,
        NvmOpcode::DATASET_MANAGEMENT,
    ] {
        ensure!(seen.contains(&op.0), "opcode {:#x} was not forwarded", op.0);
    }
    Ok(())
}

#[test]
fn a_queue_deleted_with_commands_in_flight_forgets_them() -> Result<()> {
    let far = Arc::new(Far::default());
    let (emu, ctrl) = start(&far)?;
    far.hold.store(true, Ordering::SeqCst);
    {
        let mut qp = ctrl.create_io_queue_pair(16)?;
        let buf = dma(&ctrl, 4 * 4096)?;
        for i in 0..4 {
            qp.submit(
                IoCommand::Read {
                    nsid: 1,
                    lba: i * 8,
                    buf: DmaSlice::new(buf.clone(), i as usize * 4096, 4096),
                },
                i,
            )?;
        }
        // Dropped with 4 reads in flight: the driver deletes the queue.
    }
    far.hold.store(false, Ordering::SeqCst);
    // The controller goes on: a new queue reads and writes.
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let buf = dma(&ctrl, 4096)?;
    buf.write(0, &[7; 4096]);
    qp.write(1, 64, &DmaSlice::new(buf.clone(), 0, 4096))?;
    qp.read(1, 64, &DmaSlice::new(buf.clone(), 0, 4096))?;
    let mut back = [0; 4096];
    buf.read(0, &mut back);
    ensure!(back == [7; 4096]);
    ensure!(emu.stats().completions_posted > 0);
    Ok(())
}

#[test]
fn an_unreachable_far_controller_makes_the_controller_fatal() -> Result<()> {
    let far = Arc::new(Far::default());
    let (emu, ctrl) = start(&far)?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let buf = dma(&ctrl, 4096)?;
    qp.read(1, 0, &DmaSlice::new(buf.clone(), 0, 4096))?;
    // The far controller dies: the command in flight fails, and no channel opens again.
    far.fail_next_poll.store(true, Ordering::SeqCst);
    far.hold.store(true, Ordering::SeqCst);
    far.refuse.store(true, Ordering::SeqCst);
    ensure!(qp.read(1, 0, &DmaSlice::new(buf.clone(), 0, 4096)).is_err());
    let e = qp
        .read(1, 0, &DmaSlice::new(buf.clone(), 0, 4096))
        .unwrap_err();
    // Failed with Transient Transport Error, or (the driver saw CSTS first) as fatal.
    ensure!(
        e.status()
            .is_some_and(|s| s.sc == generic::TRANSIENT_TRANSPORT_ERROR)
            || e.to_string().contains("fatal"),
        "the reconnect that failed: {e}"
    );
    let csts =
        nvme::nvme_spec::Csts::from(emu.registers().read_u32(nvme::nvme_spec::registers::CSTS));
    ensure!(
        csts.cfs(),
        "CSTS.CFS after the far controller became unreachable ({csts:?})"
    );
    ensure!(
        qp.read(1, 0, &DmaSlice::new(buf.clone(), 0, 4096)).is_err(),
        "a fatal controller served a command"
    );
    Ok(())
}
