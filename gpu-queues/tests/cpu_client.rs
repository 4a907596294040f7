//! The device header's queue protocol, run by CPU threads ([`gpu_queues::cpu_client`]) against
//! the software controller: several threads per queue and several queues, 512 and 4096-byte
//! LBAs, rings that wrap hundreds of times, out-of-order completions, every PRP shape and the
//! split above MDTS, injected faults (media errors as per-command statuses, a dropped
//! completion as a typed timeout, controller fatal status waking every waiter), and CPU queue
//! pairs of the driver next to client queues on one controller, each reading the other's bytes.
//!
//! Every test asserts what can be seen from outside: bytes on the device (read back through
//! the driver's own queues), NVMe statuses, error kinds, the controller's counters and the
//! client's doorbell counts. No GPU is needed; `scripts/gpu-build.sh` ships this binary as
//! `cpu-client` so that the GPU machine runs it too.

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::{Duration, Instant};

use gpu_queues::cpu_client::{
    ClientError, CpuQueue, CpuQueueOptions, OPC_FLUSH, StressConfig, StressReport, run_stress,
};
use gpu_queues::desc::{DeviceStatus, IoReq};
use gpu_queues::pattern;
use nvme::nvme_spec::StatusCodeType;
use nvme::nvme_spec::status::media;
use nvme::{Controller, ControllerOptions};
use nvme_emu::{EmuConfig, EmuDevice, NamespaceConfig};

const NSID: u32 = 1;

fn options() -> ControllerOptions {
    ControllerOptions {
        admin_timeout: Duration::from_secs(3),
        io_timeout: Duration::from_secs(5),
        ..ControllerOptions::default()
    }
}

/// Starts the software controller with every hostile mode on (`nvme_emu::Hostile`): the
/// header's protocol must hold where stale ring memory would not save a mistake.
fn start(cfg: EmuConfig) -> (Arc<EmuDevice>, Controller) {
    let cfg = EmuConfig {
        hostile: nvme_emu::Hostile::ALL,
        ..cfg
    };
    let emu = EmuDevice::start(cfg).expect("software controller");
    let ctrl = Controller::new(emu.clone(), options()).expect("bring-up");
    (emu, ctrl)
}

/// One memory namespace of `bytes` with `lba` sized blocks, the rest default.
fn emu_config(bytes: u64, lba: u32) -> EmuConfig {
    EmuConfig {
        namespaces: vec![NamespaceConfig::memory(bytes, lba)],
        ..EmuConfig::default()
    }
}

fn queue(ctrl: &Controller, depth: u32, slot_buffer: Option<u32>, timeout: Duration) -> CpuQueue {
    CpuQueue::create(
        ctrl,
        &CpuQueueOptions {
            depth,
            slot_buffer_bytes: slot_buffer,
            timeout,
        },
    )
    .expect("CPU client queue")
}

/// The verification pattern of `blocks` blocks from `lba`.
fn pattern_of(seed: u64, lba: u64, blocks: u64, lba_size: u32) -> Vec<u8> {
    let mut v = vec![0u8; (blocks * lba_size as u64) as usize];
    pattern::fill(&mut v, seed, NSID, lba, lba_size as usize);
    v
}

/// Reads `blocks` blocks from `lba` through a CPU queue pair of the driver (not the client).
fn driver_read(ctrl: &Controller, lba: u64, blocks: u64, lba_size: u32) -> Vec<u8> {
    let mut qp = ctrl.create_io_queue_pair(32).expect("driver queue pair");
    let mut out = vec![0u8; (blocks * lba_size as u64) as usize];
    qp.read_to(NSID, lba, &mut out).expect("driver read");
    out
}

fn stress(queues: u16, threads: usize, depth: u32, commands: u64, region: u64) -> StressConfig {
    StressConfig {
        queues,
        threads_per_queue: threads,
        depth,
        commands,
        batch: 4,
        nsid: NSID,
        region_bytes: Some(region),
        slot_buffer_bytes: Some(16384),
        seed: 0x5eed_c0de,
        timeout: Duration::from_secs(10),
        verify: true,
    }
}

fn assert_passed(r: &StressReport) {
    assert!(
        r.passed(),
        "stress run failed: {} of {} commands, {} errors (first: {:?}), {} mismatches (first \
         LBA {:?}), controller failure {:?}, queues {:?}",
        r.commands,
        r.requested,
        r.errors,
        r.first_error,
        r.mismatches,
        r.first_bad_lba,
        r.controller_failure,
        r.queues
    );
}

/// Every block of `bytes` (read from LBA 0) is either never written (zeros) or carries the
/// pattern of its LBA; returns how many carry the pattern.
fn blocks_with_pattern(bytes: &[u8], seed: u64, lba_size: u32) -> u64 {
    let mut stamped = 0;
    for (lba, block) in bytes.chunks_exact(lba_size as usize).enumerate() {
        if block.iter().all(|&b| b == 0) {
            continue;
        }
        assert_eq!(
            pattern::check(block, seed, NSID, lba as u64, lba_size as usize),
            None,
            "block {lba} holds neither zeros nor its pattern"
        );
        stamped += 1;
    }
    stamped
}

/// Several queues, four threads on each (two with the thread variant, two with the batch
/// variant), both LBA sizes: every byte read back matches, the controller counted exactly the
/// commands the client reports, the device holds the pattern wherever anything was written,
/// and doorbells were coalesced.
#[test]
fn stress_several_threads_and_queues_512_and_4096() {
    const REGION: u64 = 4 << 20;
    for lba in [512u32, 4096] {
        let (emu, ctrl) = start(emu_config(16 << 20, lba));
        let cfg = stress(3, 4, 16, 8000, REGION);
        let r = run_stress(&ctrl, &cfg).expect("stress run");
        assert_passed(&r);
        assert_eq!(r.lba_size, lba);
        assert_eq!(r.region_bytes, REGION);
        assert_eq!(r.commands, 8000);
        assert_eq!((r.writes, r.reads), (4000, 4000));
        assert_eq!(r.mismatches, 0);
        assert!(r.verified_bytes >= 4000 * lba as u64, "{r:?}");
        assert!(
            r.batch_commands > 0 && r.batch_commands < r.commands,
            "{r:?}"
        );
        assert_eq!(r.queues.len(), 3);
        let mut qids: Vec<u16> = r.queues.iter().map(|q| q.qid).collect();
        qids.dedup();
        assert_eq!(qids.len(), 3, "distinct queue ids: {qids:?}");
        for q in &r.queues {
            assert!(q.commands > 0 && q.failed.is_none(), "{q:?}");
        }
        assert_eq!(r.queues.iter().map(|q| q.commands).sum::<u64>(), r.commands);
        // Coalescing: one tail doorbell covers several commands.
        assert!(
            r.sq_doorbells() < r.commands,
            "{} SQ doorbells for {} commands",
            r.sq_doorbells(),
            r.commands
        );
        assert!(r.cq_doorbells() <= r.commands);
        let stats = emu.stats();
        assert_eq!((stats.writes, stats.reads), (r.writes, r.reads));
        assert_eq!(stats.errors, 0);
        assert_eq!(stats.invalid_doorbell_writes, 0);
        // The device, read through the driver's own queue: the pattern wherever written.
        let bytes = driver_read(&ctrl, 0, REGION / lba as u64, lba);
        let stamped = blocks_with_pattern(&bytes, cfg.seed, lba);
        assert!(stamped > 0, "no block of the region was written");
        // Nothing past the region.
        let after = driver_read(&ctrl, REGION / lba as u64, 64, lba);
        assert!(
            after.iter().all(|&b| b == 0),
            "bytes written past the region"
        );
    }
}

/// Several threads each write and read back their own blocks through one queue of depth 16
/// (and of depth 2) until both rings have wrapped hundreds of times; the protocol state ends
/// where the arithmetic says: every ticket published and completed, the CQ head and phase after
/// an odd number of wraps, every slot released to its next ticket.
#[test]
fn rings_wrap_many_times() {
    for (depth, threads, rounds) in [(16u32, 4u64, 602u64), (2, 2, 150)] {
        let (emu, ctrl) = start(emu_config(16 << 20, 512));
        let q = queue(&ctrl, depth, Some(8192), Duration::from_secs(10));
        std::thread::scope(|s| {
            for t in 0..threads {
                let q = &q;
                s.spawn(move || {
                    for i in 0..rounds {
                        let blocks = 1 + (i % 16);
                        let lba = t * 4096 + (i % 64) * 16;
                        let data = pattern_of(t + 1, lba, blocks, 512);
                        q.write_blocks(NSID, 512, lba, &data).expect("write");
                        let mut back = vec![0u8; data.len()];
                        q.read_blocks(NSID, 512, lba, &mut back).expect("read");
                        assert!(back == data, "thread {t} round {i}: bytes differ");
                    }
                });
            }
        });
        let commands = (threads * rounds * 2) as u32;
        let st = q.state();
        assert_eq!(st.ticket, commands);
        assert_eq!(st.sq_published, commands);
        assert_eq!(st.cq_reaped, commands);
        assert_eq!(st.cq_head, commands % depth);
        let wraps = commands / depth;
        assert!(wraps >= 150, "only {wraps} wraps");
        assert_eq!(st.cq_phase, 1 ^ (wraps & 1), "phase after {wraps} wraps");
        assert_eq!((st.sq_lock, st.cq_lock, st.failed), (0, 0, 0));
        for s in 0..depth {
            let slot = q.slot_state(s);
            // Released to the first ticket at or after `commands` that maps to slot s, and
            // nothing pending in it.
            let next = commands + (s + depth - commands % depth) % depth;
            assert_eq!(slot.released, next, "slot {s}");
            assert_eq!(slot.done, 0, "slot {s}");
        }
        let (sq, cq) = q.doorbell_counts();
        assert!(
            sq <= commands as u64 && sq >= (commands / depth) as u64,
            "{sq}"
        );
        assert!(
            cq <= commands as u64 && cq >= (commands / depth) as u64,
            "{cq}"
        );
        let stats = emu.stats();
        assert_eq!(stats.writes + stats.reads, commands as u64);
        assert_eq!(stats.invalid_doorbell_writes, 0);
        q.delete().expect("delete");
    }
}

/// The deadlock rule at its edge: batches as large as the ring (depth 2 and 4), next to
/// threads holding one ticket each, on one queue.
#[test]
fn batches_as_large_as_the_ring() {
    let (_emu, ctrl) = start(emu_config(16 << 20, 512));
    for depth in [2u32, 4] {
        let mut cfg = stress(1, 4, depth, 2000, 1 << 20);
        cfg.batch = depth;
        let r = run_stress(&ctrl, &cfg).expect("stress run");
        assert_passed(&r);
        assert_eq!(r.batch, depth);
        assert!(r.batch_commands > 0, "{r:?}");
    }
}

/// With a controller that completes every batch in reverse, completions are matched by command
/// id: a 16-piece write and read through one batch each, and a stress run, both exact.
#[test]
fn out_of_order_completions_are_matched_by_command_id() {
    let cfg = EmuConfig {
        reorder_completions: true,
        ..emu_config(16 << 20, 512)
    };
    let (_emu, ctrl) = start(cfg);
    let q = queue(&ctrl, 32, Some(4096), Duration::from_secs(10));
    let data = pattern_of(3, 1000, 128, 512); // 64 KiB: 16 pieces of 4 KiB
    q.write_range(NSID, 512, 1000, &data).expect("write");
    let mut back = vec![0u8; data.len()];
    q.read_range(NSID, 512, 1000, &mut back).expect("read");
    assert!(back == data, "bytes differ");
    assert!(
        q.completions_out_of_order() > 0,
        "the controller reordered nothing"
    );
    assert!(driver_read(&ctrl, 1000, 128, 512) == data);
    drop(q);

    let r = run_stress(&ctrl, &stress(2, 4, 16, 2000, 2 << 20)).expect("stress run");
    assert_passed(&r);
    assert!(r.out_of_order() > 0, "{:?}", r.queues);
}

/// PRP1 only, PRP1 + PRP2 and a PRP list (the slot's pre-built one), at both LBA sizes, with
/// MDTS at 16 KiB; a range above MDTS goes out as one command per slot buffer; every byte is
/// read back by the client and by the driver's own queue; too large a single command is
/// refused before anything is issued.
#[test]
fn prp_shapes_and_split_above_mdts() {
    for lba in [512u32, 4096] {
        let cfg = EmuConfig {
            mdts: 2, // 16 KiB
            ..emu_config(16 << 20, lba)
        };
        let (emu, ctrl) = start(cfg);
        assert!(matches!(
            CpuQueue::create(
                &ctrl,
                &CpuQueueOptions {
                    slot_buffer_bytes: Some(32768),
                    ..Default::default()
                }
            ),
            Err(gpu_queues::GpuError::InvalidArgument(_))
        ));
        let q = queue(&ctrl, 16, None, Duration::from_secs(10));
        assert_eq!((q.slot_buffer_bytes(), q.max_transfer()), (16384, 16384));
        let b = lba as usize;
        // PRP1 only; PRP2 naming the second page (partly and fully); a list.
        let sizes = [b, 4096, 4096 + b, 8192, 8192 + b, 12288, 16384];
        let mut lba_at = 0u64;
        for (i, &bytes) in sizes.iter().enumerate() {
            if bytes % b != 0 {
                continue;
            }
            let blocks = (bytes / b) as u64;
            let data = pattern_of(i as u64, lba_at, blocks, lba);
            q.write_blocks(NSID, lba, lba_at, &data)
                .unwrap_or_else(|e| panic!("write of {bytes} bytes: {e}"));
            let mut back = vec![0u8; bytes];
            q.read_blocks(NSID, lba, lba_at, &mut back)
                .unwrap_or_else(|e| panic!("read of {bytes} bytes: {e}"));
            assert!(
                back == data,
                "{bytes} bytes, LBA size {lba}: client read differs"
            );
            assert!(
                driver_read(&ctrl, lba_at, blocks, lba) == data,
                "{bytes} bytes, LBA size {lba}: driver read differs"
            );
            lba_at += blocks + 3;
        }

        // Above MDTS: 100 KiB + one block is 7 pieces of at most 16 KiB.
        let bytes = 100 * 1024 + b;
        let blocks = (bytes / b) as u64;
        let data = pattern_of(99, lba_at, blocks, lba);
        let before = emu.stats();
        q.write_range(NSID, lba, lba_at, &data)
            .expect("split write");
        let mut back = vec![0u8; bytes];
        q.read_range(NSID, lba, lba_at, &mut back)
            .expect("split read");
        let after = emu.stats();
        assert_eq!(after.writes - before.writes, 7);
        assert_eq!(after.reads - before.reads, 7);
        assert_eq!(after.bytes_written - before.bytes_written, bytes as u64);
        assert!(back == data, "split read differs");
        assert!(driver_read(&ctrl, lba_at, blocks, lba) == data);

        // One command above the slot buffer (= MDTS): refused, nothing reserved.
        let ticket = q.state().ticket;
        let e = q
            .write_blocks(NSID, lba, 0, &vec![0u8; 16384 + b])
            .unwrap_err();
        assert!(matches!(e, ClientError::InvalidArgument(_)), "{e}");
        assert_eq!(e.device_status(), DeviceStatus::InvalidArgument);
        let e = q.write_range(NSID, lba, 0, &vec![0u8; b / 2]).unwrap_err();
        assert!(matches!(e, ClientError::InvalidArgument(_)), "{e}");
        assert_eq!(q.state().ticket, ticket);
        assert!(q.failed().is_none());
    }
}

/// An idle queue: a batch of 8 commands filled before any is published goes out with ONE SQ
/// tail doorbell; the same 8 issued one by one from one thread need 8.
#[test]
fn a_batch_is_published_with_one_doorbell() {
    let (emu, ctrl) = start(emu_config(16 << 20, 512));
    let q = queue(&ctrl, 16, Some(4096), Duration::from_secs(10));
    let flush = IoReq {
        opcode: OPC_FLUSH,
        nsid: NSID,
        ..IoReq::default()
    };
    let results = q.io_batch(&[flush; 8]);
    assert_eq!(results.len(), 8);
    assert!(results.iter().all(Result::is_ok), "{results:?}");
    let (sq, cq) = q.doorbell_counts();
    assert_eq!(sq, 1, "a batch of 8 took {sq} SQ doorbells");
    assert!((1..=8).contains(&cq), "{cq}");
    for _ in 0..8 {
        q.io(&flush).expect("flush");
    }
    assert_eq!(q.doorbell_counts().0, 9);
    assert_eq!(emu.stats().flushes, 16);
}

/// A media error is a per-command NVMe status with its code; the queue keeps working, and a
/// stress run over bad blocks counts errors without failing any queue or mismatching.
#[test]
fn media_errors_are_per_command_statuses() {
    let (emu, ctrl) = start(emu_config(16 << 20, 512));
    emu.faults().add_media_error(NSID, 100);
    let q = queue(&ctrl, 16, Some(16384), Duration::from_secs(10));
    let mut buf = vec![0u8; 8 * 512];
    let e = q.read_blocks(NSID, 512, 96, &mut buf).unwrap_err();
    match &e {
        ClientError::Nvme {
            qid,
            status,
            status_field,
            ..
        } => {
            assert_eq!(*qid, q.qid());
            assert!(
                status.is(
                    StatusCodeType::MEDIA_AND_DATA_INTEGRITY,
                    media::UNRECOVERED_READ_ERROR
                ),
                "{status}"
            );
            // SCT in bits 11:9, SC in 8:1 of the CQE status field.
            assert_eq!(
                *status_field & 0x0ffe,
                (2 << 9) | ((media::UNRECOVERED_READ_ERROR as u16) << 1)
            );
        }
        e => panic!("expected an NVMe status, got {e}"),
    }
    assert_eq!(e.device_status(), DeviceStatus::NvmeError);
    assert!(!e.is_fatal());
    let e = q.write_blocks(NSID, 512, 100, &[7u8; 512]).unwrap_err();
    assert!(
        matches!(&e, ClientError::Nvme { status, .. }
            if status.is(StatusCodeType::MEDIA_AND_DATA_INTEGRITY, media::WRITE_FAULT)),
        "{e}"
    );
    // The queue still works, next to the bad block.
    assert!(q.failed().is_none());
    let data = pattern_of(5, 101, 8, 512);
    q.write_blocks(NSID, 512, 101, &data).expect("write");
    q.read_blocks(NSID, 512, 101, &mut buf).expect("read");
    assert!(buf == data);
    drop(q);

    // Bad blocks inside a small stress region: errors, but every command ran, no queue
    // failed and nothing read back wrong.
    emu.faults().add_media_error(NSID, 30);
    let r = run_stress(&ctrl, &stress(2, 2, 16, 600, 128 * 512)).expect("stress run");
    assert!(r.errors > 0, "no command hit a bad block");
    assert_eq!(r.commands, r.requested);
    assert_eq!(r.mismatches, 0);
    assert!(r.controller_failure.is_none());
    assert!(
        r.queues.iter().all(|q| q.failed.is_none()),
        "{:?}",
        r.queues
    );
    let first = r.first_error.clone().unwrap_or_default();
    assert!(first.contains("Media and Data Integrity"), "{first}");
    assert!(!r.passed());
}

/// A dropped completion: the waiter gets a typed timeout within its bound and the queue is
/// failed; with several threads on the queue every one of them returns with an error; the
/// controller and new queues on it keep working.
#[test]
fn dropped_completion_is_a_typed_timeout() {
    let timeout = Duration::from_millis(300);
    let (emu, ctrl) = start(emu_config(16 << 20, 512));
    let q = queue(&ctrl, 16, Some(4096), timeout);
    q.write_blocks(NSID, 512, 0, &[1u8; 512]).expect("write");
    emu.faults().drop_completions(1);
    let started = Instant::now();
    let e = q.write_blocks(NSID, 512, 0, &[2u8; 512]).unwrap_err();
    assert_eq!(
        e,
        ClientError::Timeout {
            qid: q.qid(),
            timeout
        }
    );
    assert_eq!(e.device_status(), DeviceStatus::Timeout);
    assert!(e.is_fatal());
    assert!(
        started.elapsed() < Duration::from_secs(5),
        "{:?}",
        started.elapsed()
    );
    assert_eq!(q.failed(), Some(DeviceStatus::Timeout));
    assert_eq!(
        q.reserve().unwrap_err(),
        ClientError::QueueFailed {
            qid: q.qid(),
            why: DeviceStatus::Timeout
        }
    );
    drop(q);

    // Four threads on one queue; one completion is lost while they run.
    let q = queue(&ctrl, 16, Some(4096), timeout);
    let dropped = AtomicBool::new(false);
    let emu = &emu;
    let started = Instant::now();
    let outcomes: Vec<ClientError> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..4u64)
            .map(|t| {
                let (q, dropped) = (&q, &dropped);
                s.spawn(move || {
                    let mut buf = vec![0u8; 2048];
                    for i in 0.. {
                        if t == 0 && i == 20 {
                            emu.faults().drop_completions(1);
                            dropped.store(true, Ordering::Release);
                        }
                        let lba = t * 1000 + (i % 50) * 4;
                        if let Err(e) = q.read_blocks(NSID, 512, lba, &mut buf) {
                            return e;
                        }
                        assert!(i < 100_000, "thread {t} never saw the failure");
                    }
                    unreachable!()
                })
            })
            .collect();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    assert!(dropped.load(Ordering::Acquire));
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let timeouts = outcomes
        .iter()
        .filter(|e| matches!(e, ClientError::Timeout { .. }))
        .count();
    assert!(timeouts >= 1, "{outcomes:?}");
    assert_each_caused_by(&outcomes, DeviceStatus::Timeout);
    assert_eq!(emu.stats().completions_dropped, 2);
    drop(q);

    // The controller is fine: a new client queue and a driver queue both work.
    let q = queue(&ctrl, 16, Some(4096), timeout);
    let data = pattern_of(9, 500, 8, 512);
    q.write_blocks(NSID, 512, 500, &data)
        .expect("write after the fault");
    assert!(driver_read(&ctrl, 500, 8, 512) == data);
}

/// Asserts that every outcome is the error `why` itself (`ClientError::Timeout` for
/// `DeviceStatus::Timeout`, ...) or a queue that failed earlier for `why`.
fn assert_each_caused_by(outcomes: &[ClientError], why: DeviceStatus) {
    for e in outcomes {
        let failed_for = matches!(e, ClientError::QueueFailed { why: w, .. } if *w == why);
        assert!(e.device_status() == why || failed_for, "{e}");
    }
}

/// Controller fatal status while threads wait on slow completions with a long timeout: the
/// host sees CSTS.CFS and aborts the queue, and every waiter returns at once with an error;
/// `run_stress`'s own watcher does the same for all of its queues.
#[test]
fn controller_fatal_returns_every_waiter() {
    let (emu, ctrl) = start(emu_config(16 << 20, 512));
    let q = queue(&ctrl, 16, Some(4096), Duration::from_secs(60));
    emu.faults()
        .set_completion_delay(Duration::from_millis(100));
    let started = Instant::now();
    let outcomes: Vec<ClientError> = std::thread::scope(|s| {
        let workers: Vec<_> = (0..6u64)
            .map(|t| {
                let q = &q;
                s.spawn(move || {
                    let mut buf = vec![0u8; 512];
                    loop {
                        if let Err(e) = q.read_blocks(NSID, 512, t, &mut buf) {
                            return e;
                        }
                    }
                })
            })
            .collect();
        std::thread::sleep(Duration::from_millis(250));
        emu.faults().fatal();
        // The host's watcher: CSTS.CFS, then the abort word.
        let deadline = Instant::now() + Duration::from_secs(5);
        while !ctrl.csts().expect("CSTS").cfs() {
            assert!(Instant::now() < deadline, "CSTS.CFS never read 1");
            std::thread::sleep(Duration::from_millis(1));
        }
        q.abort();
        workers.into_iter().map(|w| w.join().unwrap()).collect()
    });
    // Far below the 60 s bound of each wait.
    assert!(
        started.elapsed() < Duration::from_secs(10),
        "{:?}",
        started.elapsed()
    );
    assert!(
        outcomes
            .iter()
            .any(|e| matches!(e, ClientError::Aborted { .. })),
        "{outcomes:?}"
    );
    assert_each_caused_by(&outcomes, DeviceStatus::Aborted);
    for e in &outcomes {
        assert_eq!(
            e.device_status(),
            if matches!(e, ClientError::Aborted { .. }) {
                DeviceStatus::Aborted
            } else {
                DeviceStatus::QueueFailed
            }
        );
    }
    assert_eq!(q.failed(), Some(DeviceStatus::Aborted));
    drop(q);

    // run_stress on a controller that goes fatal mid-run.
    let (emu, ctrl) = start(emu_config(16 << 20, 512));
    emu.faults().set_completion_delay(Duration::from_millis(20));
    let mut cfg = stress(2, 3, 16, 1_000_000, 1 << 20);
    cfg.timeout = Duration::from_secs(60);
    let started = Instant::now();
    let r = std::thread::scope(|s| {
        s.spawn(|| {
            std::thread::sleep(Duration::from_millis(300));
            emu.faults().fatal();
        });
        run_stress(&ctrl, &cfg).expect("stress run")
    });
    assert!(
        started.elapsed() < Duration::from_secs(20),
        "{:?}",
        started.elapsed()
    );
    let why = r.controller_failure.clone().unwrap_or_default();
    assert!(why.contains("fatal"), "{why:?}");
    assert!(!r.passed());
    assert!(r.errors > 0);
    assert!(r.commands < r.requested);
    assert!(
        r.queues.iter().all(|q| q.failed.is_some()),
        "{:?}",
        r.queues
    );
}

/// The driver's CPU queue pairs and client queues on one controller at the same time: each
/// writes its own region while a stress run hammers a third, then each reads back what the
/// other wrote.
#[test]
fn driver_queues_and_client_queues_share_a_controller() {
    const LBA: u32 = 512;
    const DRIVER_AT: u64 = 8192;
    const CLIENT_AT: u64 = 16384;
    const BLOCKS: u64 = 1024; // 512 KiB per side
    let (emu, ctrl) = start(emu_config(16 << 20, LBA));
    let client = queue(&ctrl, 32, Some(16384), Duration::from_secs(10));
    let driver_data = pattern_of(11, DRIVER_AT, BLOCKS, LBA);
    let client_data = pattern_of(22, CLIENT_AT, BLOCKS, LBA);
    let report = std::thread::scope(|s| {
        let stress_run = s.spawn(|| run_stress(&ctrl, &stress(2, 2, 16, 1000, 2 << 20)));
        s.spawn(|| {
            let mut qp = ctrl.create_io_queue_pair(32).expect("driver queue pair");
            for chunk in 0..BLOCKS / 64 {
                let at = (chunk * 64 * LBA as u64) as usize;
                qp.write_from(
                    NSID,
                    DRIVER_AT + chunk * 64,
                    &driver_data[at..at + 64 * LBA as usize],
                )
                .expect("driver write");
            }
        });
        // Two client threads share the client queue, each writing half.
        for half in 0..2u64 {
            let (client, client_data) = (&client, &client_data);
            s.spawn(move || {
                let len = client_data.len() / 2;
                let at = half as usize * len;
                client
                    .write_range(
                        NSID,
                        LBA,
                        CLIENT_AT + half * BLOCKS / 2,
                        &client_data[at..at + len],
                    )
                    .expect("client write");
            });
        }
        stress_run.join().unwrap().expect("stress run")
    });
    assert_passed(&report);
    // Cross reads: the client reads the driver's bytes, the driver reads the client's.
    let mut back = vec![0u8; driver_data.len()];
    client
        .read_range(NSID, LBA, DRIVER_AT, &mut back)
        .expect("client read");
    assert!(
        back == driver_data,
        "client read of the driver's bytes differs"
    );
    assert!(
        driver_read(&ctrl, CLIENT_AT, BLOCKS, LBA) == client_data,
        "driver read of the client's bytes differs"
    );
    assert_eq!(emu.stats().errors, 0);
}
