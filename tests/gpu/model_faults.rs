//! The model's faults and SSD timing (MODEL in ptx/emu/gpunvme_controller.cuh): the software
//! controller's fault tests (queues.rs) on the GPU-resident controller, and what the timing
//! model guarantees (lower bounds on latency, upper bounds on rate: the GPU machine's timings
//! are noisy, the model's bounds are not).
//!
//! Its tests keep the names they had at the crate root, where the scripts select them
//! (`--exact NAME`): `root_tests!` in main.rs declares each as a test and calls the function
//! here. A `#[test]` written in this file is named `model_faults::NAME` instead.

use super::*;

fn model_of(r: &Rig) -> &Arc<GpuController> {
    r.model.as_ref().expect("a rig on the GPU controller model")
}

pub(super) fn model_media_error_is_a_per_command_status() {
    let path = image("media");
    let r = model_rig(&path, 512, MediaKind::Hbm, 2, 64);
    let buf = r.gpu.alloc_buffer(512 * 4096).unwrap();
    let faults = model_of(&r).faults();
    // Set while the kernel runs: the warps take it with the next table generation.
    faults.add_media_error(1, 7 * 3).expect("media error");
    faults
        .add_media_error_range(1, 7 * 100, 14)
        .expect("media error range");
    let reqs = read_reqs(&r, buf.bus(), 256);
    let bad = |slba: u64| slba == 21 || (700..714).contains(&slba);
    for warp in [false, true] {
        let out = batch(&r, &reqs, warp);
        for (i, (req, &(s, sf))) in reqs.iter().zip(&out).enumerate() {
            if bad(req.slba) {
                assert_eq!(s, DeviceStatus::NvmeError, "warp {warp} request {i}");
                assert_eq!((sf >> 9) & 7, 2, "SCT media error, status field {sf:#x}");
                assert_eq!((sf >> 1) & 0xff, 0x81, "Unrecovered Read Error {sf:#x}");
                assert_ne!(sf & 0x8000, 0, "Do Not Retry {sf:#x}");
            } else {
                assert_eq!((s, sf), (DeviceStatus::Ok, 0), "warp {warp} request {i}");
            }
        }
    }
    // Writes covering a bad LBA: Write Fault, and the media is left alone.
    let write = IoReq {
        slba: 20,
        prp1: buf.bus(),
        prp2: 0,
        nsid: 1,
        nlb_z: 3,
        opcode: 1,
        reserved: 0,
    };
    let out = batch(&r, &[write, IoReq { opcode: 8, ..write }], true);
    for (s, sf) in out {
        assert_eq!(s, DeviceStatus::NvmeError);
        assert_eq!(
            ((sf >> 9) & 7, (sf >> 1) & 0xff),
            (2, 0x80),
            "Write Fault {sf:#x}"
        );
    }
    // Removed and cleared like nvme_emu's: reads succeed again, on the fast path.
    assert!(faults.remove_media_error(1, 21).unwrap());
    assert!(!faults.remove_media_error(1, 21).unwrap());
    faults.clear_media_errors().unwrap();
    let out = batch(&r, &reqs, true);
    assert!(out.iter().all(|&o| o == (DeviceStatus::Ok, 0)), "{out:?}");
    let mut got = vec![0u8; 512];
    let (s, _) = rw_range(&r, false, 20, 1, buf.bus(), true);
    assert_eq!(s, DeviceStatus::Ok);
    buf.read(0, &mut got).unwrap();
    assert!(
        got == pattern(20, 1, 512),
        "a failed write changed the media"
    );
    let stats = model_of(&r).stop().expect("stop");
    let failed = 2 * (reqs.iter().filter(|q| bad(q.slba)).count() as u64) + 2;
    assert_eq!(stats.errors, failed, "{stats:?}");
    assert_eq!((stats.dropped, stats.abandoned), (0, 0), "{stats:?}");
    drop(buf);
    drop(r);
    let _ = std::fs::remove_file(&path);
}

pub(super) fn model_dropped_completion_times_out_on_the_gpu() {
    let path = image("drop");
    let r = model_rig_opts(
        &path,
        512,
        MediaKind::Hbm,
        1,
        64,
        ModelRigOpts {
            timeout: Some(Duration::from_millis(300)),
            ..Default::default()
        },
    );
    let buf = r.gpu.alloc_buffer(512 * 4096).unwrap();
    let faults = model_of(&r).faults();
    faults.drop_completions(1).expect("drop");
    assert_eq!(faults.drops_remaining().unwrap(), 1);
    let start = Instant::now();
    let out = batch(&r, &read_reqs(&r, buf.bus(), 32), false);
    assert!(start.elapsed() < Duration::from_secs(20), "bounded");
    assert!(
        out.iter().any(|&(s, _)| s == DeviceStatus::Timeout),
        "one waiter times out: {out:?}"
    );
    assert!(out.iter().all(|&(s, _)| matches!(
        s,
        DeviceStatus::Ok | DeviceStatus::Timeout | DeviceStatus::QueueFailed
    )));
    assert_eq!(
        faults.drops_remaining().unwrap(),
        0,
        "the one drop was taken"
    );
    // The queue stays failed: later calls return at once.
    let out = batch(&r, &read_reqs(&r, buf.bus(), 4), false);
    assert!(
        out.iter().all(|&(s, _)| s == DeviceStatus::QueueFailed),
        "{out:?}"
    );
    // DROP_ALL on one queue id, then cleared: the counters take their values as nvme_emu's.
    faults
        .drop_completions_on(1, gpu_emu::resident::DROP_ALL)
        .unwrap();
    assert_eq!(
        faults.drops_remaining_on(1).unwrap(),
        gpu_emu::resident::DROP_ALL
    );
    faults.drop_completions_on(1, 0).unwrap();
    faults.drop_completions(0).unwrap();
    let t0 = Instant::now();
    let stats = model_of(&r).stop().expect("stop");
    assert!(t0.elapsed() < STOP_TIMEOUT, "stop took {:?}", t0.elapsed());
    assert_eq!(stats.dropped, 1, "{stats:?}");
    drop(buf);
    drop(r);
    let _ = std::fs::remove_file(&path);
}

pub(super) fn model_stops_at_once_with_completions_held() {
    // A 3 s completion delay holds every completion far past the clients' 300 ms bound; the
    // model stops with them held (never posted), well within its stop bound.
    let path = image("held");
    let r = model_rig_opts(
        &path,
        512,
        MediaKind::Null,
        2,
        64,
        ModelRigOpts {
            timeout: Some(Duration::from_millis(300)),
            ..Default::default()
        },
    );
    let buf = r.gpu.alloc_buffer(512 * 4096).unwrap();
    let faults = model_of(&r).faults();
    faults
        .set_completion_delay(Duration::from_secs(3))
        .expect("delay");
    assert_eq!(faults.completion_delay(), Duration::from_secs(3));
    let out = batch(&r, &read_reqs(&r, buf.bus(), 64), false);
    assert!(
        out.iter()
            .all(|&(s, _)| matches!(s, DeviceStatus::Timeout | DeviceStatus::QueueFailed)),
        "{out:?}"
    );
    let t0 = Instant::now();
    let stats = model_of(&r).stop().expect("stop");
    assert!(
        t0.elapsed() < Duration::from_secs(1),
        "stop took {:?}",
        t0.elapsed()
    );
    assert!(stats.abandoned >= 1, "{stats:?}");
    assert_eq!(stats.dropped, 0, "{stats:?}");
    drop(buf);
    drop(r);
    let _ = std::fs::remove_file(&path);
}

/// A perf run on the model rig's namespace 1 without verification.
fn model_perf(
    r: &Rig,
    rw: GpuRw,
    qd: u32,
    style: ClientStyle,
    ios: u64,
) -> gpunvme_cli::perf::kernel::GpuPerfResult {
    let cfg = GpuPerfConfig {
        rw,
        nsid: 1,
        lba_size: r.lba,
        bs: 4096,
        qd,
        style,
        warp_lanes: None,
        ios,
        runtime: Duration::ZERO,
        verify: false,
        seed: SEED,
        region_blocks: NS_BYTES / r.lba as u64,
    };
    gpunvme_cli::perf::kernel::run(&r.gpu, &cfg, || None).expect("perf on the model")
}

/// The floor of the lowest latency bucket with a sample: at most the shortest latency.
fn min_latency_floor(res: &gpunvme_cli::perf::kernel::GpuPerfResult) -> u64 {
    let b = res
        .latency_buckets
        .iter()
        .position(|&c| c != 0)
        .expect("latency samples");
    lat_bucket_floor(b)
}

pub(super) fn model_ssd_timing_bounds_latency_and_rate() {
    // Two drives of 100 K IOPS (10 µs of service per 4 KiB command, far slower than the
    // controller), 80 µs reads, 20 µs writes. The model guarantees: no command completes
    // sooner than its service plus its latency after it was fetched (so the latency bucket
    // floors stay above the fixed latency: 4 KiB buckets there, 10 µs of service), and no
    // drive completes more than one command per 10 µs (so the rate stays under 200 K/s).
    let model: SsdModel = "read_us=80,write_us=20,iops=100k,bw=0,drives=2"
        .parse()
        .unwrap();
    let cap = model.max_iops(4096);
    assert!((cap - 200_000.0).abs() < 1.0);
    let path = image("timing");
    let r = model_rig_opts(
        &path,
        4096,
        MediaKind::Null,
        4,
        128,
        ModelRigOpts {
            ssd_model: Some(model),
            ..Default::default()
        },
    );
    for (rw, fixed) in [(GpuRw::RandRead, 80_000u64), (GpuRw::RandWrite, 20_000)] {
        let qd1 = model_perf(&r, rw, 1, ClientStyle::Thread, 2_000);
        assert_eq!(qd1.errors, 0, "{rw:?}");
        let floor = min_latency_floor(&qd1);
        eprintln!(
            "{rw:?} QD1: mean {:.1} µs, shortest >= {:.1} µs",
            qd1.latency_mean() / 1e3,
            floor as f64 / 1e3
        );
        assert!(
            floor >= fixed,
            "{rw:?}: a command took less than {fixed} ns ({floor})"
        );
    }
    // Depth: 4 queues x 64 in flight; the rate stays under the drives' cap (2 % slack for the
    // host's clock around the kernel, which only lowers the measured rate).
    for style in [ClientStyle::Thread, ClientStyle::Warp] {
        let res = model_perf(&r, GpuRw::RandRead, 64, style, 100_000);
        assert_eq!(res.errors, 0, "{style:?}");
        let iops = res.done as f64 / res.elapsed.as_secs_f64();
        eprintln!(
            "{style:?} QD64 x 4 queues: {iops:.0} IOPS (cap {cap:.0}), mean latency {:.1} µs",
            res.latency_mean() / 1e3
        );
        assert!(
            iops <= cap * 1.02,
            "{style:?}: {iops:.0} IOPS above the model's {cap:.0}"
        );
        // Not a guarantee of the model but of a working one: far below the cap means held
        // completions are posted late (a generous bound for a noisy machine).
        assert!(iops >= cap * 0.1, "{style:?}: {iops:.0} IOPS, cap {cap:.0}");
        assert!(min_latency_floor(&res) >= 80_000, "{style:?}");
    }
    let stats = model_of(&r).stop().expect("stop");
    assert_eq!(stats.errors, 0, "{stats:?}");
    assert_eq!(stats.abandoned, 0, "{stats:?}");
    assert_eq!(stats.doorbell_errors, 0, "{stats:?}");
    drop(r);
    let _ = std::fs::remove_file(&path);
}
