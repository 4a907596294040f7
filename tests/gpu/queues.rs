//! The runtime's GPU client (`gpu_queues`) on the software controller's transport, every
//! hostile mode on: every transfer shape into GPU buffers, rings in host memory, a bad
//! descriptor refused, many queues wrapping with completions out of order, faults (media
//! errors, dropped completions, controller fatal, frees while a client waits, the transport
//! probe) and CPU queues beside the GPU ones.
//!
//! Its tests keep the names they had at the crate root, where the scripts select them
//! (`--exact NAME`): `root_tests!` in main.rs declares each as a test and calls the function
//! here. A `#[test]` written in this file is named `queues::NAME` instead.

use super::*;

/// The software controller with rings, PRP lists and slot buffers in host memory
/// (`GpuQueueOptions::host_rings`, what `perf --gpu` asks for): every transfer shape into GPU
/// buffers (their completions staged behind the data), and verified perf in four patterns by
/// both client styles with 32-entry rings wrapping many times (data in the host slot buffers).
pub(super) fn rings_in_host_memory_carry_every_shape_and_perf() {
    let host = |lba: u32, queues: u16, depth: u32| {
        let r = rig_with(
            lba,
            |_| {},
            GpuQueueOptions {
                queues: Some(queues),
                depth: Some(depth),
                host_rings: Some(true),
                ..Default::default()
            },
        );
        assert_eq!(
            r.gpu.ring_placement(),
            Some(gpu_emu::RingPlacement::Host),
            "rings in host memory"
        );
        r
    };
    for lba in [512u32, 4096] {
        transfer_shapes(&host(lba, 2, 64));
    }
    let r = host(512, 2, 32);
    cpu_prefill(&r, NS_BYTES / 512);
    for rw in [GpuRw::Read, GpuRw::RandRead, GpuRw::Write, GpuRw::RandWrite] {
        for style in [ClientStyle::Warp, ClientStyle::Thread] {
            let res = perf(&r, rw, 16, style, 2_000);
            assert_eq!(res.errors, 0, "{rw:?} {style:?}: {:?}", res.first_failure);
            assert_eq!(res.mismatches, 0, "{rw:?} {style:?}");
            assert!(res.done >= 2_000, "{rw:?} {style:?}: {} done", res.done);
        }
    }
    let blocks = NS_BYTES / 512;
    assert!(
        cpu_read(&r, 0, blocks) == pattern(0, blocks, 512),
        "CPU read-back of GPU writes through host rings"
    );
    let dma = r.gpu.dma_stats().expect("software controller");
    assert_eq!(dma.sync_reads, 0, "no SQE fetch copies: {dma:?}");
}

/// A descriptor built by hand with a depth that is not a power of two is refused on the
/// device (INVALID_ARGUMENT) before any ticket is taken; the real descriptor still works after.
pub(super) fn a_descriptor_whose_depth_is_not_a_power_of_two_is_refused() {
    let r = rig(512, 1, 64);
    let bus = r.gpu.descs()[0].slot_buffers_bus;
    let mut bad = r.gpu.descs()[0];
    bad.depth = 48;
    let mem = DeviceMemory::alloc(r.gpu.cuda(), size_of_val(&bad)).unwrap();
    mem.write(0, bad.as_bytes()).unwrap();
    for warp in [false, true] {
        let (s, _) = rw_range_on(&r, mem.ptr(), false, 0, 8, bus, warp);
        assert_eq!(s, DeviceStatus::InvalidArgument, "warp={warp}");
    }
    let (s, sf) = rw_range(&r, false, 0, 8, bus, false);
    assert_eq!((s, sf), (DeviceStatus::Ok, 0));
}

pub(super) fn every_transfer_shape_into_arbitrary_gpu_buffers() {
    for lba in [512u32, 4096] {
        transfer_shapes(&rig(lba, 2, 64));
    }
}

pub(super) fn wrap_around_many_queues_out_of_order() {
    // Per-thread submission on 16-entry rings; warp submission on 32-entry rings (the smallest
    // the warp variant allows: a warp's 32 consecutive tickets need 32 slots).
    for (warp, depth) in [(false, 16u32), (true, 32)] {
        let r = rig_with(
            512,
            |c| c.reorder_completions = true,
            GpuQueueOptions {
                queues: Some(8),
                depth: Some(depth),
                ..Default::default()
            },
        );
        wrap_around(&r, warp, depth);
    }
    // The warp variant refuses rings it could deadlock on, at once.
    let r = rig(512, 1, 16);
    let buf = r.gpu.alloc_buffer(512 * 4096).unwrap();
    let out = batch(&r, &read_reqs(&r, buf.bus(), 64), true);
    assert!(
        out.iter().all(|&(s, _)| s == DeviceStatus::InvalidArgument),
        "{out:?}"
    );
}

pub(super) fn media_error_is_a_per_command_status() {
    let r = rig(512, 2, 64);
    let buf = r.gpu.alloc_buffer(512 * 4096).unwrap();
    r.emu().faults().add_media_error(1, 7 * 3);
    let reqs = read_reqs(&r, buf.bus(), 256);
    let out = batch(&r, &reqs, true);
    for (i, (req, &(s, sf))) in reqs.iter().zip(&out).enumerate() {
        if req.slba == 21 {
            assert_eq!(s, DeviceStatus::NvmeError, "request {i}");
            assert_eq!((sf >> 9) & 7, 2, "SCT media error, status field {sf:#x}");
        } else {
            assert_eq!((s, sf), (DeviceStatus::Ok, 0), "request {i}");
        }
    }
}

/// The vfio-p2p transport's probe (`gpu_queues::transport::probe`), on the software controller's
/// queues: a GPU thread's Read of LBA 0 with the block's bytes passes; a media error and a lost
/// completion are refused, by name and within the bound.
pub(super) fn transport_probe_proves_a_read_or_says_why_not() {
    use gpu_queues::transport::probe::probe_read;
    let r = rig(512, 2, 64);
    cpu_fill(&r, 4, |lba, blocks| pattern(lba, blocks, 512));
    probe_read(&r.gpu, &r.ctrl, compute_wait_bound()).expect("a working transport");
    r.emu().faults().add_media_error(1, 0);
    let e = probe_read(&r.gpu, &r.ctrl, compute_wait_bound()).unwrap_err();
    assert!(
        e.0.contains("NvmeError") && e.0.contains("status field"),
        "{e}"
    );

    let r = rig(512, 1, 64);
    r.emu().faults().drop_completions(1);
    let start = Instant::now();
    let e = probe_read(&r.gpu, &r.ctrl, Duration::from_millis(500)).unwrap_err();
    assert!(e.0.contains("did not complete within 500 ms"), "{e}");
    assert!(start.elapsed() < Duration::from_secs(30), "bounded");
}

/// A free while a client kernel waits for the software controller is held back until that
/// kernel's stream is idle: with CUDA, `cuMemFree` would wait for the kernel and hold up every
/// other thread's launches meanwhile, the controller's copy kernels included, so the kernel
/// would never finish (the stall of docs/testing.md; `benches/probes/stream_progress.cu`).
pub(super) fn frees_while_a_client_waits_are_held_until_it_ends() {
    let r = rig(512, 1, 64);
    cpu_prefill(&r, 64);
    let buf = r.gpu.alloc_buffer(512 * 4096).unwrap();
    let doomed = DeviceMemory::alloc(r.gpu.cuda(), 1 << 20).unwrap();
    assert_eq!(gpu_queues::ffi::held_frees(), 0);
    r.emu()
        .faults()
        .set_completion_delay(Duration::from_millis(500));
    let reqs = read_reqs(&r, buf.bus(), 8);
    let b = IoBatch::new(r.gpu.cuda(), &reqs).unwrap();
    let s = r.gpu.client_stream();
    b.launch(r.gpu.kernels(), s, r.gpu.descriptors(), 1, false)
        .unwrap();
    std::thread::sleep(Duration::from_millis(50));
    assert!(
        !s.is_idle().unwrap(),
        "the kernel waits for its completions"
    );
    let start = Instant::now();
    drop(doomed);
    assert!(
        start.elapsed() < Duration::from_millis(200),
        "the free returned at once ({:?})",
        start.elapsed()
    );
    assert_eq!(gpu_queues::ffi::held_frees(), 1, "held back");
    s.wait_idle(compute_wait_bound()).unwrap();
    r.emu().faults().set_completion_delay(Duration::ZERO);
    let out = b.results().unwrap();
    assert!(
        out.iter()
            .all(|&(st, sf)| (st, sf) == (DeviceStatus::Ok, 0)),
        "{out:?}"
    );
    assert_eq!(
        gpu_queues::ffi::held_frees(),
        0,
        "freed once the stream was idle"
    );
}

pub(super) fn dropped_completion_times_out_on_the_gpu() {
    let r = rig_with(
        512,
        |_| {},
        GpuQueueOptions {
            queues: Some(1),
            depth: Some(64),
            timeout: Some(Duration::from_millis(300)),
            ..Default::default()
        },
    );
    let buf = r.gpu.alloc_buffer(512 * 4096).unwrap();
    r.emu().faults().drop_completions(1);
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
    // The queue stays failed: later calls return at once.
    let out = batch(&r, &read_reqs(&r, buf.bus(), 4), false);
    assert!(
        out.iter().all(|&(s, _)| s == DeviceStatus::QueueFailed),
        "{out:?}"
    );
}

pub(super) fn controller_fatal_aborts_every_gpu_waiter() {
    let r = rig_with(
        512,
        |_| {},
        GpuQueueOptions {
            queues: Some(2),
            depth: Some(64),
            timeout: Some(Duration::from_secs(30)),
            ..Default::default()
        },
    );
    cpu_prefill(&r, 4096);
    // Completions are held back, the controller goes fatal, and the host's watchdog aborts
    // the GPU waits long before their own 30 s bound.
    r.emu()
        .faults()
        .set_completion_delay(Duration::from_secs(60));
    let emu = r.emu().clone();
    let fired = Instant::now();
    std::thread::spawn(move || {
        std::thread::sleep(Duration::from_millis(200));
        emu.faults().fatal();
    });
    let cfg = GpuPerfConfig {
        rw: GpuRw::RandRead,
        nsid: 1,
        lba_size: 512,
        bs: 4096,
        qd: 32,
        style: ClientStyle::Warp,
        warp_lanes: None,
        ios: 100_000,
        runtime: Duration::ZERO,
        verify: false,
        seed: SEED,
        region_blocks: 4096,
    };
    let emu = r.emu().clone();
    let res = gpunvme_cli::perf::kernel::run(&r.gpu, &cfg, move || {
        emu.csts().cfs().then(|| "controller fatal".into())
    })
    .unwrap();
    assert!(
        fired.elapsed() < Duration::from_secs(15),
        "aborted promptly"
    );
    assert!(res.errors > 0);
    let (status, _, _) = res.first_failure.unwrap();
    assert!(
        matches!(status, DeviceStatus::Aborted | DeviceStatus::QueueFailed),
        "{status:?}"
    );
}

pub(super) fn gpu_and_cpu_queues_on_one_controller() {
    let r = rig(512, 2, 256);
    cpu_prefill(&r, NS_BYTES / 512);
    let ctrl = &r.ctrl;
    std::thread::scope(|s| {
        let cpu = s.spawn(|| {
            let mut q = ctrl.create_io_queue_pair(64).unwrap();
            let mem = Arc::new(ctrl.device().alloc_dma(4096).unwrap());
            let buf = DmaSlice::new(mem, 0, 4096);
            for i in 0..5000u64 {
                let lba = (i * 8 * 13) % (NS_BYTES / 512 - 8);
                q.read(1, lba, &buf).unwrap();
                let mut got = vec![0u8; 4096];
                buf.read(&mut got);
                assert!(got == pattern(lba, 8, 512), "CPU read of lba {lba}");
            }
        });
        let res = perf(&r, GpuRw::RandRead, 64, ClientStyle::Warp, 50_000);
        assert_eq!(
            (res.errors, res.mismatches),
            (0, 0),
            "{:?}",
            res.first_failure
        );
        cpu.join().unwrap();
    });
}

/// GPU memory cut into views and written as strided rows (how a queue set's memory is laid
/// out and its pre-built PRP lists written): each byte lands where asked, the rest stays zero,
/// the parent outlives a view dropped after it, and ranges outside are refused. Pinned memory
/// likewise (the copy engines' areas cut from one registered allocation): a view's bytes copy
/// to the GPU and back through it after its parent's handle is gone.
pub(super) fn views_and_strided_rows_land_where_asked() {
    let cuda = cuda();
    pinned_views_copy_where_asked(&cuda);
    let parent = Arc::new(DeviceMemory::alloc(&cuda, 64 << 10).unwrap());
    let view = DeviceMemory::view(&parent, 4096, 16 << 10).unwrap();
    assert_eq!(view.ptr(), parent.ptr() + 4096);
    let rows: Vec<u8> = (1..=48u8).collect();
    view.write_rows(8, &rows, 16, 4096).unwrap();
    drop(parent);
    let mut back = vec![0u8; 16 << 10];
    view.read(0, &mut back).unwrap();
    for (i, b) in back.iter().enumerate() {
        let (row, col) = (i / 4096, i % 4096);
        let want = if row < 3 && (8..24).contains(&col) {
            (row * 16 + col - 8 + 1) as u8
        } else {
            0
        };
        assert_eq!(*b, want, "byte {i}");
    }
    let parent = Arc::new(DeviceMemory::alloc(&cuda, 8192).unwrap());
    for (off, len) in [(4096, 8192), (8192, 1), (0, 0)] {
        let e = DeviceMemory::view(&parent, off, len).err();
        assert!(
            matches!(e, Some(gpu_queues::GpuError::InvalidArgument(_))),
            "view {off}+{len}: {e:?}"
        );
    }
    // Rows past the end, a row wider than its pitch, a length that is not whole rows.
    for (off, n, row, pitch) in [(0, 48, 16, 4096), (0, 32, 32, 16), (0, 20, 16, 32)] {
        let mem = DeviceMemory::view(&parent, 0, 4096).unwrap();
        let e = mem.write_rows(off, &vec![1u8; n], row, pitch).err();
        assert!(
            matches!(e, Some(gpu_queues::GpuError::InvalidArgument(_))),
            "{n} bytes in rows of {row} every {pitch}: {e:?}"
        );
    }
}

fn pinned_views_copy_where_asked(cuda: &Arc<Cuda>) {
    use gpu_queues::ffi::{PinnedMemory, Placement, Stream};
    let parent = Arc::new(PinnedMemory::alloc_large(cuda, 3 << 20).unwrap());
    assert!(parent.len() >= 3 << 20, "{parent:?}");
    let view = PinnedMemory::view(&parent, 8192, 12288).unwrap();
    assert_eq!(view.device_ptr(), parent.device_ptr() + 8192);
    assert_eq!(view.len(), 12288);
    let fresh = PinnedMemory::view(&parent, 1 << 20, 4096).unwrap();
    let mut zero = vec![1u8; 4096];
    fresh.read(0, &mut zero);
    assert!(
        zero.iter().all(|b| *b == 0),
        "fresh pinned memory is not zero"
    );
    drop(fresh);
    let data: Vec<u8> = (0..12288u32).map(|i| (i * 7 + 3) as u8).collect();
    view.write(0, &data);
    drop(parent);
    let dev = DeviceMemory::alloc(cuda, 12288).unwrap();
    let stream = Stream::new(cuda, Placement::Anywhere, None).unwrap();
    stream.copy_from_pinned(&view, 0, dev.ptr(), 12288).unwrap();
    stream.wait_idle(Duration::from_secs(30)).unwrap();
    let mut back = vec![0u8; 12288];
    dev.read(0, &mut back).unwrap();
    assert_eq!(back, data, "pinned view -> GPU");
    view.write(0, &vec![0u8; 12288]);
    stream.copy_to_pinned(&view, 4096, dev.ptr(), 8192).unwrap();
    stream.wait_idle(Duration::from_secs(30)).unwrap();
    let mut got = vec![0u8; 12288];
    view.read(0, &mut got);
    assert!(got[..4096].iter().all(|b| *b == 0));
    assert_eq!(&got[4096..], &data[..8192], "GPU -> pinned view");
    let parent = Arc::new(PinnedMemory::alloc(cuda, 8192).unwrap());
    for (off, len) in [(4096, 8192), (8192, 4096), (0, 0), (100, 4096), (0, 100)] {
        let e = PinnedMemory::view(&parent, off, len).err();
        assert!(
            matches!(e, Some(gpu_queues::GpuError::InvalidArgument(_))),
            "pinned view {off}+{len}: {e:?}"
        );
    }
}
