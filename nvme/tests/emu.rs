//! The driver against the software controller (`nvme_emu`): bring-up, data round trips over
//! every PRP shape, splitting above MDTS, several queues and threads, out-of-order completions,
//! error statuses, injected faults surfacing as typed errors, queue lifetime and shutdown.

use anyhow::{Context, Result, ensure};
use nvme::nvme_spec::registers::CSTS;
use nvme::nvme_spec::status::{command_specific, generic, media};
use nvme::nvme_spec::{Csts, FeatureId, SmartHealthLog, StatusCodeType};
use nvme::{
    Controller, ControllerOptions, Device, DmaAllocError, DmaMemory, DmaSlice, Error, IoCommand,
    IoCompletion, RegisterIo,
};
use nvme_emu::{EmuConfig, EmuDevice, NamespaceConfig};
use rand::rngs::SmallRng;
use rand::{Rng, SeedableRng};
use std::collections::HashSet;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};
use zerocopy::FromBytes;

/// Starts the software controller with every hostile mode on (`nvme_emu::Hostile`): a driver
/// bug that stale queue memory would hide fails here instead.
fn start(cfg: EmuConfig, opts: ControllerOptions) -> Result<(Arc<EmuDevice>, Controller)> {
    let cfg = EmuConfig {
        hostile: nvme_emu::Hostile::ALL,
        ..cfg
    };
    let emu = EmuDevice::start(cfg).context("starting the software controller")?;
    let dev: Arc<dyn Device> = emu.clone();
    let ctrl = Controller::new(dev, opts).context("bringing the controller up")?;
    Ok((emu, ctrl))
}

fn fast_opts() -> ControllerOptions {
    ControllerOptions {
        admin_timeout: Duration::from_secs(5),
        io_timeout: Duration::from_secs(5),
        ..ControllerOptions::default()
    }
}

fn dma(ctrl: &Controller, len: usize) -> Result<Arc<DmaMemory>> {
    Ok(Arc::new(ctrl.device().alloc_dma(len)?))
}

/// Deterministic, position-dependent bytes.
fn pattern(seed: u64, len: usize) -> Vec<u8> {
    let mut rng = SmallRng::seed_from_u64(seed);
    (0..len).map(|_| rng.random()).collect()
}

fn status_of(e: &Error) -> Option<(u8, u8)> {
    e.status().map(|s| (s.sct.0, s.sc))
}

#[test]
fn bring_up_and_identify() -> Result<()> {
    let cfg = EmuConfig {
        namespaces: vec![
            NamespaceConfig::memory(8 << 20, 512),
            NamespaceConfig::memory(16 << 20, 4096),
        ],
        ..EmuConfig::default()
    };
    let (_emu, ctrl) = start(cfg.clone(), fast_opts())?;
    let info = ctrl.info();
    assert_eq!(info.sn, cfg.serial);
    assert_eq!(info.mn, cfg.model);
    assert_eq!(info.fr, cfg.firmware);
    assert_eq!(info.vid, cfg.vendor_id);
    assert_eq!(info.mdts_bytes, Some(4096 << cfg.mdts));
    assert_eq!(info.max_transfer_bytes, 4096 << cfg.mdts);
    assert_eq!(info.max_io_queue_pairs, cfg.max_io_queue_pairs);
    assert_eq!(info.mqes_entries, cfg.mqes as u32 + 1);
    assert_eq!(info.version.0, 1);
    assert!(info.write_zeroes && info.dsm);
    let ns: Vec<_> = ctrl
        .namespaces()
        .iter()
        .map(|n| (n.nsid, n.lba_size, n.blocks))
        .collect();
    assert_eq!(
        ns,
        vec![(1, 512, (8 << 20) / 512), (2, 4096, (16 << 20) / 4096)]
    );
    assert_eq!(ctrl.namespace(2)?.lba_size, 4096);
    assert!(matches!(
        ctrl.namespace(3),
        Err(Error::NoSuchNamespace { nsid: 3 })
    ));
    assert_eq!(ctrl.identify_controller().nn, 2);
    let csts = ctrl.csts()?;
    assert!(csts.rdy() && !csts.cfs());
    ctrl.shutdown()?;
    Ok(())
}

#[test]
fn fewer_queues_when_asking_for_fewer() -> Result<()> {
    let opts = ControllerOptions {
        io_queue_pairs_wanted: 3,
        ..fast_opts()
    };
    let (_emu, ctrl) = start(EmuConfig::default(), opts)?;
    assert_eq!(ctrl.info().max_io_queue_pairs, 3);
    Ok(())
}

/// Writes `len` bytes at `lba` from a buffer at `offset`, reads them back into a buffer at a
/// different offset and compares.
#[expect(clippy::too_many_arguments)]
fn round_trip(
    ctrl: &Controller,
    qp: &mut nvme::IoQueuePair,
    nsid: u32,
    lba: u64,
    len: usize,
    woff: usize,
    roff: usize,
    seed: u64,
) -> Result<()> {
    let data = pattern(seed, len);
    let wbuf = dma(ctrl, woff + len)?;
    let rbuf = dma(ctrl, roff + len)?;
    rbuf.fill(0, rbuf.len(), 0xa5);
    wbuf.write(woff, &data);
    qp.write(nsid, lba, &DmaSlice::new(wbuf, woff, len))
        .with_context(|| format!("write {len} bytes at lba {lba} offset {woff}"))?;
    qp.read(nsid, lba, &DmaSlice::new(rbuf.clone(), roff, len))
        .with_context(|| format!("read {len} bytes at lba {lba} offset {roff}"))?;
    let mut back = vec![0u8; len];
    rbuf.read(roff, &mut back);
    ensure!(
        back == data,
        "data mismatch: {len} bytes at lba {lba}, offsets {woff}/{roff}"
    );
    Ok(())
}

#[test]
fn prp_shapes_round_trip() -> Result<()> {
    let (_emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(64)?;
    // (len, write offset, read offset): PRP1 only, PRP1 to the page end, PRP2, list, split.
    let cases = [
        (512, 0, 0),
        (512, 3584, 4),
        (4096, 0, 0),
        (4096, 4, 8),
        (8192, 0, 1024),
        (8192, 12, 0),
        (12288, 0, 4092),
        (64 * 1024, 100, 0),
        (128 * 1024, 0, 0),       // exactly MDTS
        (128 * 1024 + 512, 4, 0), // just above: two commands
        (1024 * 1024, 0, 2048),   // eight commands in flight
    ];
    for (i, &(len, woff, roff)) in cases.iter().enumerate() {
        round_trip(
            &ctrl,
            &mut qp,
            1,
            (i as u64) * 4096,
            len,
            woff,
            roff,
            i as u64,
        )?;
    }
    Ok(())
}

#[test]
fn random_round_trips_512_and_4096() -> Result<()> {
    for (lba_size, mdts) in [(512u32, 5u8), (4096, 3), (4096, 0)] {
        let cfg = EmuConfig {
            namespaces: vec![NamespaceConfig::memory(32 << 20, lba_size)],
            mdts,
            ..EmuConfig::default()
        };
        let (_emu, ctrl) = start(cfg, fast_opts())?;
        let ns = ctrl.namespace(1)?.clone();
        let mut qp = ctrl.create_io_queue_pair(32)?;
        let mut rng = SmallRng::seed_from_u64(lba_size as u64 + mdts as u64);
        let max_blocks = (3 << 20) / lba_size as u64; // up to 3 MiB: above any MDTS and 2 MiB
        for i in 0..12 {
            let blocks = rng.random_range(1..=max_blocks);
            let lba = rng.random_range(0..ns.blocks - blocks);
            let woff = rng.random_range(0..1024usize) * 4;
            let roff = rng.random_range(0..1024usize) * 4;
            let len = (blocks * lba_size as u64) as usize;
            round_trip(&ctrl, &mut qp, 1, lba, len, woff, roff, i)
                .with_context(|| format!("lba size {lba_size}, mdts {mdts}"))?;
        }
        if mdts == 0 {
            assert_eq!(ctrl.info().mdts_bytes, None);
            assert_eq!(ctrl.info().max_transfer_bytes, 2 << 20);
        }
    }
    Ok(())
}

#[test]
fn bounce_helpers_round_trip() -> Result<()> {
    let (_emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let data = pattern(7, 300 * 512);
    qp.write_from(1, 10, &data)?;
    qp.flush(1)?;
    let mut back = vec![0u8; data.len()];
    qp.read_to(1, 10, &mut back)?;
    assert_eq!(back, data);
    Ok(())
}

#[test]
fn many_queues_many_threads() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let ctrl = Arc::new(ctrl);
    let threads: Vec<_> = (0..4u64)
        .map(|t| {
            let ctrl = ctrl.clone();
            std::thread::spawn(move || -> Result<()> {
                let mut qp = ctrl.create_io_queue_pair(32)?;
                for i in 0..8u64 {
                    let lba = t * 16384 + i * 512;
                    round_trip(
                        &ctrl,
                        &mut qp,
                        1,
                        lba,
                        64 * 1024,
                        (i * 4) as usize,
                        0,
                        t * 100 + i,
                    )?;
                }
                Ok(())
            })
        })
        .collect();
    for t in threads {
        t.join().expect("thread panicked")?;
    }
    assert!(emu.stats().writes >= 32);
    Ok(())
}

#[test]
fn async_out_of_order_completions() -> Result<()> {
    let cfg = EmuConfig {
        reorder_completions: true,
        ..EmuConfig::default()
    };
    let (_emu, ctrl) = start(cfg, fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(64)?;
    let n = 48usize;
    let wbuf = dma(&ctrl, n * 4096)?;
    let data = pattern(42, n * 4096);
    wbuf.write(0, &data);
    let mut out: Vec<IoCompletion> = Vec::with_capacity(n);
    for i in 0..n {
        let buf = DmaSlice::new(wbuf.clone(), i * 4096, 4096);
        qp.submit(
            IoCommand::Write {
                nsid: 1,
                lba: i as u64 * 8,
                buf,
            },
            i as u64,
        )?;
    }
    assert_eq!(qp.in_flight(), n);
    qp.wait(&mut out, n)?;
    assert_eq!(out.len(), n);
    let tags: HashSet<u64> = out.iter().map(|c| c.tag).collect();
    assert_eq!(tags.len(), n);
    for c in out.drain(..) {
        c.result?;
    }
    // Read back in reverse LBA order, also asynchronously.
    let rbuf = dma(&ctrl, n * 4096)?;
    for i in (0..n).rev() {
        let buf = DmaSlice::new(rbuf.clone(), i * 4096, 4096);
        qp.submit(
            IoCommand::Read {
                nsid: 1,
                lba: i as u64 * 8,
                buf,
            },
            1000 + i as u64,
        )?;
    }
    let mut order = Vec::new();
    while out.len() < n {
        qp.wait(&mut out, 1)?;
    }
    for c in &out {
        order.push(c.tag);
        assert!(c.result.is_ok(), "{:?}", c.result);
    }
    assert_eq!(qp.in_flight(), 0);
    let mut back = vec![0u8; n * 4096];
    rbuf.read(0, &mut back);
    assert_eq!(back, data);
    Ok(())
}

#[test]
fn queue_full_and_capacity() -> Result<()> {
    let (_emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(4)?;
    assert_eq!(qp.capacity(), 3);
    for tag in 0..3 {
        qp.submit(IoCommand::Flush { nsid: 1 }, tag)?;
    }
    let e = qp.submit(IoCommand::Flush { nsid: 1 }, 3).unwrap_err();
    assert!(matches!(e, Error::QueueFull { capacity: 3, .. }), "{e}");
    let mut out = Vec::new();
    qp.wait(&mut out, 3)?;
    assert_eq!(out.len(), 3);
    // Depth is clamped to CAP.MQES + 1.
    let cfg = EmuConfig {
        mqes: 15,
        ..EmuConfig::default()
    };
    let (_emu2, ctrl2) = start(cfg, fast_opts())?;
    assert_eq!(ctrl2.create_io_queue_pair(1000)?.capacity(), 15);
    Ok(())
}

#[test]
fn invalid_requests_are_typed_errors() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(8)?;
    let blocks = ctrl.namespace(1)?.blocks;
    let buf = dma(&ctrl, 256 * 1024)?;
    let before = emu.stats().io_commands;
    let slice = |off, len| DmaSlice::new(buf.clone(), off, len);
    let e = qp.read(9, 0, &slice(0, 512)).unwrap_err();
    assert!(matches!(e, Error::NoSuchNamespace { nsid: 9 }), "{e}");
    let e = qp.read(1, blocks - 1, &slice(0, 1024)).unwrap_err();
    assert!(
        matches!(e, Error::OutOfRange { lba, blocks: 2, .. } if lba == blocks - 1),
        "{e}"
    );
    let e = qp.read(1, u64::MAX, &slice(0, 512)).unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
    let e = qp.read(1, 0, &slice(0, 100)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Unaligned {
                what: "buffer length",
                ..
            }
        ),
        "{e}"
    );
    let e = qp.read(1, 0, &slice(2, 512)).unwrap_err();
    assert!(
        matches!(
            e,
            Error::Unaligned {
                what: "buffer offset",
                ..
            }
        ),
        "{e}"
    );
    let e = qp
        .submit(
            IoCommand::Read {
                nsid: 1,
                lba: 0,
                buf: slice(0, 256 * 1024),
            },
            0,
        )
        .unwrap_err();
    assert!(
        matches!(e, Error::TransferTooLarge { max: 131072, .. }),
        "{e}"
    );
    let e = qp
        .submit(
            IoCommand::WriteZeroes {
                nsid: 1,
                lba: 0,
                blocks: 0,
            },
            0,
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    let e = qp
        .submit(
            IoCommand::Deallocate {
                nsid: 1,
                ranges: vec![],
            },
            0,
        )
        .unwrap_err();
    assert!(matches!(e, Error::InvalidArgument(_)), "{e}");
    assert!(DmaSlice::try_new(buf.clone(), 256 * 1024 - 4, 8).is_err());
    assert!(DmaSlice::try_new(buf.clone(), usize::MAX, 2).is_err());
    // None of these reached the device, and the queue is still healthy.
    assert_eq!(emu.stats().io_commands, before);
    assert!(!qp.is_failed());
    qp.read(1, 0, &slice(0, 512))?;
    Ok(())
}

#[test]
fn controller_statuses_surface() -> Result<()> {
    let (_emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    // An unknown log page: Command Specific / Invalid Log Page.
    let page = DmaSlice::whole(dma(&ctrl, 4096)?);
    let e = ctrl.get_log_page(0x7e, 0xffff_ffff, &page).unwrap_err();
    assert_eq!(
        status_of(&e),
        Some((
            StatusCodeType::COMMAND_SPECIFIC.0,
            command_specific::INVALID_LOG_PAGE
        )),
        "{e}"
    );
    assert!(e.to_string().contains("Invalid Log Page"), "{e}");
    // An unknown feature: Invalid Field in Command.
    let e = ctrl.get_features(FeatureId(0x7d), 0).unwrap_err();
    assert_eq!(
        status_of(&e),
        Some((0, generic::INVALID_FIELD_IN_COMMAND)),
        "{e}"
    );
    // Admin failures leave the admin queue usable.
    let smart = DmaSlice::whole(dma(&ctrl, 4096)?).slice(0, 512);
    ctrl.get_log_page(0x02, 0xffff_ffff, &smart)?;
    Ok(())
}

#[test]
fn media_errors_surface_as_status() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    emu.faults().add_media_error(1, 100);
    let buf = DmaSlice::whole(dma(&ctrl, 64 * 1024)?);
    let e = qp.read(1, 64, &buf).unwrap_err();
    assert_eq!(
        status_of(&e),
        Some((
            StatusCodeType::MEDIA_AND_DATA_INTEGRITY.0,
            media::UNRECOVERED_READ_ERROR
        )),
        "{e}"
    );
    assert!(
        e.to_string()
            .starts_with("Read nsid 1 lba 64: Media and Data Integrity"),
        "{e}"
    );
    let e = qp.write(1, 100, &buf.slice(0, 512)).unwrap_err();
    assert_eq!(
        status_of(&e),
        Some((
            StatusCodeType::MEDIA_AND_DATA_INTEGRITY.0,
            media::WRITE_FAULT
        )),
        "{e}"
    );
    // An error status does not fail the queue; other blocks still work.
    assert!(!qp.is_failed());
    qp.read(1, 101, &buf.slice(0, 512))?;
    emu.faults().clear_media_errors();
    qp.read(1, 64, &buf)?;
    Ok(())
}

#[test]
fn dropped_completion_times_out() -> Result<()> {
    let opts = ControllerOptions {
        io_timeout: Duration::from_millis(200),
        ..fast_opts()
    };
    let (emu, ctrl) = start(EmuConfig::default(), opts)?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let buf = DmaSlice::whole(dma(&ctrl, 4096)?);
    emu.faults().drop_completions(1);
    let started = Instant::now();
    let e = qp.read(1, 0, &buf).unwrap_err();
    assert!(
        matches!(e, Error::Timeout { cid: _, qid, .. } if qid == qp.qid()),
        "{e}"
    );
    // Never before the timeout (deadlines are set lazily, at the first check after the
    // submission, but counted from no earlier than it).
    assert!(started.elapsed() >= Duration::from_millis(200));
    // Bounded: far less than a hang (the generous bound avoids flakiness on busy machines).
    assert!(started.elapsed() < Duration::from_secs(30));
    assert!(qp.is_failed());
    let e = qp.read(1, 0, &buf).unwrap_err();
    assert!(matches!(e, Error::QueueFailed { .. }), "{e}");
    // Other queue pairs and the admin queue keep working.
    let mut qp2 = ctrl.create_io_queue_pair(16)?;
    qp2.read(1, 0, &buf)?;
    drop(qp);
    Ok(())
}

#[test]
fn controller_fatal_fails_commands() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let buf = DmaSlice::whole(dma(&ctrl, 4096)?);
    qp.read(1, 0, &buf)?;
    emu.faults().fatal();
    let started = Instant::now();
    let e = qp.read(1, 0, &buf).unwrap_err();
    assert!(
        matches!(e, Error::ControllerFatal { csts } if Csts::from(csts).cfs()),
        "{e}"
    );
    // Detected through CSTS, well before the 5 s I/O timeout.
    assert!(
        started.elapsed() < Duration::from_secs(4),
        "{:?}",
        started.elapsed()
    );
    assert!(matches!(
        qp.read(1, 0, &buf).unwrap_err(),
        Error::QueueFailed { .. }
    ));
    Ok(())
}

#[test]
fn write_zeroes_and_deallocate() -> Result<()> {
    let (_emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let data = pattern(3, 64 * 512);
    qp.write_from(1, 0, &data)?;
    qp.write_zeroes(1, 8, 8)?;
    qp.deallocate(1, &[(32, 4), (40, 8)])?;
    let mut back = vec![0u8; data.len()];
    qp.read_to(1, 0, &mut back)?;
    let mut expect = data.clone();
    for (lba, n) in [(8usize, 8usize), (32, 4), (40, 8)] {
        expect[lba * 512..(lba + n) * 512].fill(0);
    }
    assert_eq!(back, expect);
    let e = qp
        .write_zeroes(1, ctrl.namespace(1)?.blocks - 1, 2)
        .unwrap_err();
    assert!(matches!(e, Error::OutOfRange { .. }), "{e}");
    // Larger than one command: 65536 blocks per Write Zeroes.
    qp.write_zeroes(1, 0, 70_000)?;
    qp.read_to(1, 0, &mut back)?;
    assert!(back.iter().all(|&b| b == 0));
    Ok(())
}

#[test]
fn smart_log_counts_io() -> Result<()> {
    let (_emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    qp.write_from(1, 0, &pattern(1, 4096))?;
    let mut back = vec![0u8; 4096];
    qp.read_to(1, 0, &mut back)?;
    let page = DmaSlice::whole(dma(&ctrl, 4096)?).slice(0, 512);
    ctrl.get_log_page(0x02, 0xffff_ffff, &page)?;
    let mut raw = vec![0u8; 512];
    page.read(&mut raw);
    let smart = SmartHealthLog::read_from_bytes(&raw).expect("512 bytes");
    assert!(smart.host_write_commands.get() >= 1);
    assert!(smart.host_read_commands.get() >= 1);
    Ok(())
}

#[test]
fn queue_ids_are_reused_after_drop() -> Result<()> {
    let cfg = EmuConfig {
        max_io_queue_pairs: 2,
        ..EmuConfig::default()
    };
    let (_emu, ctrl) = start(cfg, fast_opts())?;
    let a = ctrl.create_io_queue_pair(8)?;
    let b = ctrl.create_io_queue_pair(8)?;
    assert_ne!(a.qid(), b.qid());
    assert!(matches!(
        ctrl.create_io_queue_pair(8).unwrap_err(),
        Error::NoQueueAvailable { granted: 2 }
    ));
    let qid = a.qid();
    drop(a);
    let mut c = ctrl.create_io_queue_pair(8)?;
    assert_eq!(c.qid(), qid);
    c.flush(1)?;
    Ok(())
}

#[test]
fn orderly_shutdown() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(8)?;
    qp.write_from(1, 0, &pattern(5, 4096))?;
    ctrl.shutdown()?;
    let csts = Csts::from(emu.registers().read_u32(CSTS));
    assert_eq!(csts.shst(), Csts::SHST_COMPLETE, "CSTS {csts:?}");
    // The queue pair outlived the controller: it refuses work instead of hanging.
    let e = qp.flush(1).unwrap_err();
    assert!(matches!(e, Error::ShutDown), "{e}");
    drop(qp);
    // Dropping a controller also shuts it down.
    let (emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    drop(ctrl);
    let csts = Csts::from(emu.registers().read_u32(CSTS));
    assert_eq!(csts.shst(), Csts::SHST_COMPLETE);
    // And a new controller can be brought up on the same device afterwards.
    let dev: Arc<dyn Device> = emu.clone();
    let ctrl = Controller::new(dev, fast_opts())?;
    ctrl.create_io_queue_pair(8)?.flush(1)?;
    Ok(())
}

/// A transport wrapped around the software controller that can lose the admin doorbell,
/// pretend the device vanished (registers read all ones), and remembers its DMA allocations.
struct Flaky {
    emu: Arc<EmuDevice>,
    swallow_admin_doorbell: AtomicBool,
    gone: AtomicBool,
    allocs: Mutex<Vec<(u64, usize)>>,
}

impl Flaky {
    fn new(emu: Arc<EmuDevice>) -> Arc<Self> {
        Arc::new(Self {
            emu,
            swallow_admin_doorbell: AtomicBool::new(false),
            gone: AtomicBool::new(false),
            allocs: Mutex::new(Vec::new()),
        })
    }
}

impl RegisterIo for Flaky {
    fn len(&self) -> usize {
        self.emu.registers().len()
    }
    fn read_u32(&self, offset: usize) -> u32 {
        if self.gone.load(Ordering::Acquire) {
            return u32::MAX;
        }
        self.emu.registers().read_u32(offset)
    }
    fn write_u32(&self, offset: usize, value: u32) {
        if self.gone.load(Ordering::Acquire)
            || (offset == 0x1000 && self.swallow_admin_doorbell.load(Ordering::Acquire))
        {
            return;
        }
        self.emu.registers().write_u32(offset, value)
    }
}

impl Device for Flaky {
    fn registers(&self) -> &dyn RegisterIo {
        self
    }
    fn alloc_dma(&self, len: usize) -> Result<DmaMemory, DmaAllocError> {
        let mem = self.emu.alloc_dma(len)?;
        self.allocs
            .lock()
            .unwrap()
            .push((mem.device_address(0), mem.len()));
        Ok(mem)
    }
    fn describe(&self) -> String {
        format!("flaky wrapper around {}", self.emu.describe())
    }
}

fn start_flaky(opts: ControllerOptions) -> Result<(Arc<Flaky>, Controller)> {
    let flaky = Flaky::new(EmuDevice::start(EmuConfig::default())?);
    let dev: Arc<dyn Device> = flaky.clone();
    Ok((flaky, Controller::new(dev, opts)?))
}

#[test]
fn lost_admin_command_times_out() -> Result<()> {
    let opts = ControllerOptions {
        admin_timeout: Duration::from_millis(200),
        ..fast_opts()
    };
    let (flaky, ctrl) = start_flaky(opts)?;
    flaky.swallow_admin_doorbell.store(true, Ordering::Release);
    let page = DmaSlice::whole(dma(&ctrl, 4096)?).slice(0, 512);
    let e = ctrl.get_log_page(0x02, 0xffff_ffff, &page).unwrap_err();
    assert!(matches!(e, Error::Timeout { qid: 0, .. }), "{e}");
    assert!(e.to_string().starts_with("Get Log Page"), "{e}");
    flaky.swallow_admin_doorbell.store(false, Ordering::Release);
    // The admin queue cannot be trusted any more: it refuses further commands.
    let e = ctrl.get_log_page(0x02, 0xffff_ffff, &page).unwrap_err();
    assert!(matches!(e, Error::QueueFailed { qid: 0 }), "{e}");
    Ok(())
}

#[test]
fn vanished_device_is_reported() -> Result<()> {
    let (flaky, ctrl) = start_flaky(fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(8)?;
    let buf = DmaSlice::whole(dma(&ctrl, 4096)?);
    flaky.gone.store(true, Ordering::Release);
    let e = qp.read(1, 0, &buf).unwrap_err();
    assert!(matches!(e, Error::DeviceGone), "{e}");
    assert!(matches!(ctrl.csts().unwrap_err(), Error::DeviceGone));
    // Bring-up on a device that reads all ones fails cleanly.
    let dev: Arc<dyn Device> = flaky.clone();
    assert!(matches!(
        Controller::new(dev, fast_opts()).unwrap_err(),
        Error::DeviceGone
    ));
    drop(qp);
    Ok(())
}

#[test]
fn garbage_completions_fail_the_queue() -> Result<()> {
    for (cid, sqid_delta, sqhd, reason) in [
        (500u16, 0u16, 0u16, "command id out of range"),
        (3, 0, 0, "command id not in flight"),
        (0, 1, 0, "wrong submission queue id"),
        (0, 0, 16, "SQ head pointer beyond the queue"),
        (0, 0, u16::MAX, "SQ head pointer beyond the queue"),
    ] {
        let (flaky, ctrl) = start_flaky(fast_opts())?;
        let mut qp = ctrl.create_io_queue_pair(16)?;
        // Queue pair allocations are SQ, CQ, PRP lists, in that order.
        let allocs = flaky.allocs.lock().unwrap().clone();
        let (cq_address, _) = allocs[allocs.len() - 2];
        let mut cqe = [0u8; 16];
        cqe[8..10].copy_from_slice(&sqhd.to_le_bytes());
        cqe[10..12].copy_from_slice(&(qp.qid() + sqid_delta).to_le_bytes());
        cqe[12..14].copy_from_slice(&cid.to_le_bytes());
        cqe[14..16].copy_from_slice(&1u16.to_le_bytes()); // phase 1, success
        flaky
            .emu
            .address_map()
            .write(cq_address, &cqe)
            .expect("CQ is mapped");
        let mut out = Vec::new();
        let e = qp.poll(&mut out).unwrap_err();
        assert!(
            matches!(e, Error::InvalidCompletion { cid: c, reason: r, .. } if c == cid && r == reason),
            "{e}"
        );
        assert!(out.is_empty());
        assert!(qp.is_failed());
        let buf = DmaSlice::whole(dma(&ctrl, 4096)?);
        assert!(matches!(
            qp.read(1, 0, &buf).unwrap_err(),
            Error::QueueFailed { .. }
        ));
    }
    Ok(())
}

#[test]
fn deferred_doorbell_batches() -> Result<()> {
    let (emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(32)?;
    let buf = dma(&ctrl, 16 * 4096)?;
    let before = emu.stats().io_commands;
    for i in 0..16 {
        let slice = DmaSlice::new(buf.clone(), i * 4096, 4096);
        qp.submit_deferred(
            IoCommand::Read {
                nsid: 1,
                lba: i as u64 * 8,
                buf: slice,
            },
            i as u64,
        )?;
    }
    // Without a doorbell write the controller cannot know about them.
    std::thread::sleep(Duration::from_millis(20));
    assert_eq!(emu.stats().io_commands, before);
    qp.ring();
    let mut out = Vec::new();
    qp.wait(&mut out, 16)?;
    assert_eq!(out.len(), 16);
    assert_eq!(emu.stats().io_commands, before + 16);
    Ok(())
}

#[test]
fn sync_helpers_keep_async_completions() -> Result<()> {
    let (_emu, ctrl) = start(EmuConfig::default(), fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(8)?;
    let buf = DmaSlice::whole(dma(&ctrl, 4096)?);
    qp.submit(
        IoCommand::Read {
            nsid: 1,
            lba: 0,
            buf,
        },
        77,
    )?;
    // A synchronous write larger than the queue's capacity runs meanwhile.
    qp.write_from(1, 100, &pattern(9, 1 << 20))?;
    let mut out = Vec::new();
    qp.wait(&mut out, 1)?;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].tag, 77);
    assert!(out[0].result.is_ok());
    assert_eq!(qp.in_flight(), 0);
    Ok(())
}

#[test]
fn slow_completions_succeed_within_the_timeout_and_time_out_beyond_it() -> Result<()> {
    let opts = ControllerOptions {
        io_timeout: Duration::from_millis(400),
        ..fast_opts()
    };
    let (emu, ctrl) = start(EmuConfig::default(), opts)?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let data = pattern(11, 8192);
    qp.write_from(1, 64, &data)?;

    // Slow but inside the deadline: the data still arrives intact.
    emu.faults().set_completion_delay(Duration::from_millis(50));
    let mut back = vec![0u8; data.len()];
    qp.read_to(1, 64, &mut back)?;
    ensure!(back == data, "slow read returned other bytes");

    // Slower than the deadline: a typed timeout, not a hang, and the queue is fenced off.
    emu.faults().set_completion_delay(Duration::from_secs(3));
    let started = Instant::now();
    let e = qp.read_to(1, 64, &mut back).unwrap_err();
    ensure!(
        matches!(e, Error::Timeout { .. }),
        "expected Timeout, got {e}"
    );
    ensure!(
        started.elapsed() < Duration::from_secs(30),
        "wait was not bounded"
    );
    ensure!(qp.is_failed(), "queue must be failed after a timeout");
    emu.faults().set_completion_delay(Duration::ZERO);
    Ok(())
}

#[test]
fn borrowed_buffer_round_trip_over_every_prp_shape() -> Result<()> {
    let cfg = EmuConfig {
        namespaces: vec![NamespaceConfig::memory(8 << 20, 512)],
        ..EmuConfig::default()
    };
    let (_emu, ctrl) = start(cfg, fast_opts())?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let out_mem = dma(&ctrl, 64 << 10)?;
    let in_mem = dma(&ctrl, 64 << 10)?;
    // (offset, length): PRP1 only, PRP1 + PRP2, a PRP list, a PRP list at an offset.
    let shapes = [
        (0, 4096),
        (4096, 8192),
        (16384, 16384),
        (32768 + 512, 12288),
    ];
    let data = pattern(21, 64 << 10);
    out_mem.write(0, &data);
    for (i, &(off, len)) in shapes.iter().enumerate() {
        let lba = (i * 64) as u64;
        qp.queue_write(1, lba, &DmaSlice::new(out_mem.clone(), off, len), i as u64)?;
    }
    let mut done = Vec::new();
    qp.wait(&mut done, shapes.len())?;
    ensure!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    for (i, &(off, len)) in shapes.iter().enumerate() {
        let lba = (i * 64) as u64;
        qp.queue_read(
            1,
            lba,
            &DmaSlice::new(in_mem.clone(), off, len),
            10 + i as u64,
        )?;
    }
    qp.ring();
    done.clear();
    qp.wait(&mut done, shapes.len())?;
    ensure!(done.iter().all(|c| c.result.is_ok()), "{done:?}");
    for &(off, len) in &shapes {
        let mut back = vec![0u8; len];
        in_mem.read(off, &mut back);
        ensure!(back == data[off..off + len], "bytes at {off}+{len} differ");
    }
    Ok(())
}

#[test]
fn a_timed_out_borrowed_buffer_stays_pinned() -> Result<()> {
    let opts = ControllerOptions {
        io_timeout: Duration::from_millis(200),
        ..fast_opts()
    };
    let (emu, ctrl) = start(EmuConfig::default(), opts)?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let mem = dma(&ctrl, 4096)?;
    let base = Arc::strong_count(&mem);
    emu.faults().drop_completions(1);
    qp.queue_read(1, 0, &DmaSlice::whole(mem.clone()), 7)?;
    let mut out = Vec::new();
    let started = Instant::now();
    qp.wait(&mut out, 1)?;
    assert!(started.elapsed() >= Duration::from_millis(200));
    assert_eq!(out.len(), 1);
    assert!(
        matches!(out[0].result, Err(Error::Timeout { .. })),
        "{:?}",
        out[0]
    );
    assert!(qp.is_failed());
    // The controller may still write into the buffer: the queue pair keeps it pinned, even when
    // asked to let go of idle pins.
    assert_eq!(qp.release_buffers(), 0);
    assert_eq!(Arc::strong_count(&mem), base + 1);
    drop(qp);
    assert_eq!(Arc::strong_count(&mem), base);
    Ok(())
}

/// Every namespace kind the issue names: plain NVM and 8-byte PI are driven (PI with PRACT and
/// the LBA as reference tag, which the controller checks), metadata and zoned namespaces are
/// refused by name before any command reaches them.
#[test]
fn namespace_kinds_are_driven_or_refused_by_name() -> Result<()> {
    use nvme_emu::NsFormat;
    let with = |format, lba| NamespaceConfig {
        format,
        ..NamespaceConfig::memory(8 << 20, lba)
    };
    let cfg = EmuConfig {
        namespaces: vec![
            with(NsFormat::Plain, 512),
            with(
                NsFormat::Pi {
                    pi_type: 1,
                    first_bytes: false,
                },
                4096,
            ),
            with(
                NsFormat::Metadata {
                    ms: 64,
                    extended: false,
                },
                4096,
            ),
            with(NsFormat::Zoned, 4096),
            with(
                NsFormat::Pi {
                    pi_type: 3,
                    first_bytes: true,
                },
                512,
            ),
        ],
        ..EmuConfig::default()
    };
    let (_emu, ctrl) = start(cfg, fast_opts())?;
    let usable: Vec<(u32, String)> = ctrl
        .namespaces()
        .iter()
        .map(|n| (n.nsid, n.format_label()))
        .collect();
    assert_eq!(
        usable,
        [
            (1, "512".to_string()),
            (2, "4096+8 PI type 1".to_string()),
            (5, "512+8 PI type 3".to_string())
        ]
    );
    let skipped: Vec<u32> = ctrl.skipped_namespaces().iter().map(|s| s.nsid).collect();
    assert_eq!(skipped, [3, 4]);
    let e = ctrl.namespace(3).unwrap_err();
    assert_eq!(
        e.to_string(),
        "namespace 3 is formatted with 64 bytes of metadata per block (separate buffer); \
         gpunvme reads and writes namespaces without metadata or with 8-byte protection \
         information"
    );
    let e = ctrl.namespace(4).unwrap_err();
    assert!(
        matches!(e, Error::NamespaceUnsupported { nsid: 4, .. }),
        "{e}"
    );
    assert!(e.to_string().contains("Zoned Namespace"), "{e}");
    assert!(matches!(
        ctrl.namespace(6).unwrap_err(),
        Error::NoSuchNamespace { nsid: 6 }
    ));

    let mut qp = ctrl.create_io_queue_pair(16)?;
    // PI namespaces: plain data both ways, at LBAs whose low 32 bits the controller checks.
    for (nsid, lba) in [(2, 0), (2, 1), (2, 2046), (5, 7), (5, 16000)] {
        let bs = ctrl.namespace(nsid)?.lba_size as usize;
        round_trip(&ctrl, &mut qp, nsid, lba, 2 * bs, 0, 512, lba + 3)?;
    }
    // Write Zeroes carries PRACT too.
    qp.write_zeroes(2, 10, 2)?;
    let zeros = dma(&ctrl, 8192)?;
    zeros.fill(0, 8192, 0xee);
    qp.read(2, 10, &DmaSlice::new(zeros.clone(), 0, 8192))?;
    let mut back = vec![1u8; 8192];
    zeros.read(0, &mut back);
    ensure!(
        back.iter().all(|&b| b == 0),
        "write zeroes on a PI namespace"
    );
    // Refused namespaces: typed errors before any command is sent.
    let buf = dma(&ctrl, 4096)?;
    for nsid in [3, 4] {
        let e = qp
            .read(nsid, 0, &DmaSlice::new(buf.clone(), 0, 4096))
            .unwrap_err();
        assert!(
            matches!(e, Error::NamespaceUnsupported { nsid: n, .. } if n == nsid),
            "{e}"
        );
    }
    Ok(())
}

#[test]
fn a_raised_admin_timeout_lets_slow_admin_commands_finish() -> Result<()> {
    let opts = ControllerOptions {
        admin_timeout: Duration::from_millis(200),
        ..fast_opts()
    };
    // Raised past the controller's delay: the command completes.
    let (emu, ctrl) = start(EmuConfig::default(), opts.clone())?;
    ensure!(ctrl.raise_admin_timeout(Duration::from_secs(3)) == Duration::from_secs(3));
    ensure!(
        ctrl.raise_admin_timeout(Duration::from_millis(1)) == Duration::from_secs(3),
        "never lowered"
    );
    emu.faults().set_admin_delay(Duration::from_millis(600));
    ctrl.get_features(FeatureId::NUMBER_OF_QUEUES, 0)?;
    emu.faults().set_admin_delay(Duration::ZERO);
    // The same delay at the first timeout: a typed timeout, and the admin queue is gone.
    let (emu, ctrl) = start(EmuConfig::default(), opts)?;
    emu.faults().set_admin_delay(Duration::from_millis(600));
    let e = ctrl
        .get_features(FeatureId::NUMBER_OF_QUEUES, 0)
        .unwrap_err();
    ensure!(
        matches!(e, Error::Timeout { .. }),
        "expected Timeout, got {e}"
    );
    emu.faults().set_admin_delay(Duration::ZERO);
    Ok(())
}
