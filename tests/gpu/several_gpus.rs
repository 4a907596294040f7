//! Several GPUs in one process (issue 55): GPUs named by ordinal and UUID and refused by name,
//! `perf --gpu --gpu-id all` (every GPU with its own queue pairs on one controller at once, and
//! over several controllers, paired by the PCIe topology where there is one),
//! and per-GPU state: a free on one GPU is not held back by another GPU's waiting kernel.
//!
//! On a machine with one GPU the tests that need two say "skipped: one GPU" and return; the
//! host-gpu harness stands in for two (`GPUNVME_HOST_GPU_COUNT=2`, as
//! scripts/host-gpu-test.sh runs them). Names at the crate root (`root_tests!` in main.rs).

use super::*;
use gpu_queues::{GpuId, GpuSelection};

/// A report of several runs totals their I/Os.
fn totals_are_the_sum(r: &gpunvme_cli::perf::SeveralGpuReport) {
    let sum: u64 = r.controllers.iter().map(|c| c.report.report.ios).sum();
    assert_eq!(r.total.ios, sum);
}

/// The GPUs this process sees, or `None` (printed as skipped) when there are fewer than two.
fn two_gpus(test: &str) -> Option<(Arc<Cuda>, Arc<Cuda>)> {
    let n = Cuda::count().expect("GPU count");
    if n < 2 {
        println!(
            "{test}: skipped: one GPU (this needs two; the host-gpu build stands in for two \
             with GPUNVME_HOST_GPU_COUNT=2)"
        );
        return None;
    }
    Some((Cuda::open(0).expect("GPU 0"), Cuda::open(1).expect("GPU 1")))
}

/// Every GPU is opened by its ordinal, its UUID (whole, prefixed or not, and a leading part)
/// and, on a PCI bus, its address, each the same GPU; a GPU the machine does not have is
/// refused naming the GPUs there are.
pub(super) fn gpus_are_named_by_ordinal_uuid_and_address() {
    let gpus = gpu_queues::gpus::list().expect("listing the GPUs");
    let n = Cuda::count().expect("count");
    assert_eq!(gpus.len(), n as usize);
    for g in &gpus {
        let by_ordinal = GpuId::Ordinal(g.ordinal).open().expect("by ordinal");
        assert_eq!(by_ordinal.uuid(), g.uuid);
        assert!(
            g.uuid.starts_with("GPU-") && g.uuid.len() == 40,
            "{}",
            g.uuid
        );
        for name in [
            g.uuid.clone(),
            g.uuid[4..].to_string(),
            g.uuid[..16].to_string(),
        ] {
            let id: GpuId = name.parse().expect("a UUID parses");
            assert_eq!(id.open().expect("by UUID").ordinal(), g.ordinal, "{name}");
        }
        if let Some(bus) = &g.pci_bus_id {
            let id: GpuId = bus.parse().expect("a PCI address parses");
            assert_eq!(id.open().expect("by address").ordinal(), g.ordinal);
            assert_eq!(by_ordinal.pci_bus_id().expect("bus id"), *bus);
        }
        println!("GPU {} {} {} {:?}", g.ordinal, g.name, g.uuid, g.pci_bus_id);
    }
    let e = GpuId::Ordinal(n).open().unwrap_err();
    let m = e.to_string();
    assert!(
        matches!(e, gpu_queues::GpuError::InvalidArgument(_))
            && m.contains(&format!("no GPU {n}: this process sees {n} GPU"))
            && m.contains(&gpus[0].uuid),
        "{m}"
    );
    let e = "GPU-00000000-dead-beef"
        .parse::<GpuId>()
        .unwrap()
        .open()
        .unwrap_err();
    assert!(e.to_string().contains("no GPU with UUID"), "{e}");
    assert_eq!(
        GpuSelection::All.open().expect("every GPU").len(),
        n as usize
    );
}

/// `perf --gpu --gpu-id all` on one software controller: every GPU its own queue pairs at
/// once (an even share), every I/O verified, a report per GPU named by ordinal and UUID, the
/// totals their sum; reads and a write run (whose read-back runs on the pair kept for it).
pub(super) fn perf_gpu_on_every_gpu_at_once() {
    use gpunvme::open::{self, DeviceSpec, OpenOptions};
    use gpunvme_cli::perf::{RwMode, run_on_gpus};
    let gpus = GpuSelection::All.open().expect("every GPU");
    let n = gpus.len();
    // Four pairs per GPU and one kept for a write run's read-back.
    let pairs = (4 * n + 1).min(64);
    let img = image("every-gpu");
    let opts = OpenOptions {
        controller_threads: 1,
        controller_queue_pairs: u16::try_from(pairs).expect("pairs"),
        ..OpenOptions::default()
    };
    let spec = DeviceSpec::parse(Some(img.to_str().expect("UTF-8"))).expect("spec");
    let (ctrl, backend) = open::open_controller_and_transport(&spec, &opts).expect("open");
    for rw in [RwMode::RandRead, RwMode::RandWrite] {
        let args = perf_args(rw, 0, 256, true, None);
        let r = run_on_gpus(&ctrl, &backend, &gpus, &args).expect("perf --gpu --gpu-id all");
        assert_eq!(r.controllers.len(), n);
        // An even share of the pairs (one kept for a write run's read-back).
        let share = (pairs - usize::from(rw == RwMode::RandWrite)) / n;
        for (c, cuda) in r.controllers.iter().zip(&gpus) {
            let g = &c.report.report;
            assert!(c.device.contains(cuda.uuid()), "{}", c.device);
            assert_eq!(g.errors, 0, "{}: {:?}", c.device, g.first_error);
            assert!(g.ios >= 256 && g.verified_bytes > 0, "{}: {g:?}", c.device);
            assert_eq!(c.report.gpu.queues, share, "{}", c.device);
        }
        totals_are_the_sum(&r);
    }
    // The model is one GPU's kernel: refused by name before anything runs.
    let args = perf_args(RwMode::RandRead, 0, 16, false, Some(MediaKind::Hbm));
    let e = run_on_gpus(&ctrl, &backend, &gpus, &args).unwrap_err();
    assert!(e.to_string().contains("--controller gpu"), "{e}");
    ctrl.shutdown().expect("shutdown");
}

/// `perf --gpu --gpu-id all` over two software controllers: images have no place on PCIe, so
/// every GPU drives both (and the report says why), each pair with queue pairs of its own (a
/// controller's share split among its GPUs), every I/O verified, a report per pair named by
/// GPU and device.
pub(super) fn perf_gpu_every_gpu_over_several_controllers() {
    use gpunvme::open::{self, DeviceSpec, OpenOptions};
    use gpunvme_cli::perf::{RwMode, run_gpus_on_controllers};
    let gpus = GpuSelection::All.open().expect("every GPU");
    let n = gpus.len();
    let pairs = (3 * n).min(64);
    let opts = OpenOptions {
        controller_threads: 1,
        controller_queue_pairs: u16::try_from(pairs).expect("pairs"),
        ..OpenOptions::default()
    };
    let images = [image("gpus-on-a"), image("gpus-on-b")];
    let names: Vec<String> = images
        .iter()
        .map(|i| i.to_str().expect("UTF-8").to_owned())
        .collect();
    let opened: Vec<_> = names
        .iter()
        .map(|n| {
            let spec = DeviceSpec::parse(Some(n)).expect("spec");
            open::open_controller_and_transport(&spec, &opts).expect("open")
        })
        .collect();
    let ctrls: Vec<_> = opened.iter().map(|(c, b)| (c, b)).collect();
    let args = perf_args(RwMode::RandRead, 0, 256, true, None);
    let r = run_gpus_on_controllers(&ctrls, &names, &gpus, &args, std::path::Path::new("/sys"))
        .expect("perf --gpu --gpu-id all over two controllers");
    let pairing = r.pairing.as_ref().expect("the pairing is reported");
    assert!(
        pairing.how.contains("every GPU with every controller")
            && pairing.how.contains("not a PCI device"),
        "{}",
        pairing.how
    );
    let want: Vec<(usize, usize)> = (0..n).flat_map(|g| [(g, 0), (g, 1)]).collect();
    assert_eq!(pairing.pairs, want);
    assert_eq!(r.controllers.len(), 2 * n);
    for (run, &(g, c)) in r.controllers.iter().zip(&pairing.pairs) {
        let rep = &run.report.report;
        assert!(
            run.device.contains(gpus[g].uuid()) && run.device.ends_with(&names[c]),
            "{}",
            run.device
        );
        assert_eq!(rep.errors, 0, "{}: {:?}", run.device, rep.first_error);
        assert!(
            rep.ios >= 256 && rep.verified_bytes > 0,
            "{}: {rep:?}",
            run.device
        );
        assert_eq!(run.report.gpu.queues, pairs / n, "{}", run.device);
    }
    totals_are_the_sum(&r);
    for (c, _) in opened {
        c.shutdown().expect("shutdown");
    }
}

/// A free of GPU 1's memory while a client kernel on GPU 0 waits for the software controller
/// happens at once (GPU 0's held frees are GPU 0's), and GPU 1's client launches are not held
/// by GPU 0's; GPU 0's own free is still held back until its stream is idle.
pub(super) fn frees_on_one_gpu_are_not_held_by_another_gpus_kernel() {
    let Some((_gpu0, gpu1)) = two_gpus("frees_on_one_gpu_are_not_held_by_another_gpus_kernel")
    else {
        return;
    };
    let r = rig(512, 1, 64);
    cpu_prefill(&r, 64);
    let buf = r.gpu.alloc_buffer(512 * 4096).unwrap();
    let doomed0 = DeviceMemory::alloc(r.gpu.cuda(), 1 << 20).unwrap();
    let doomed1 = DeviceMemory::alloc(&gpu1, 1 << 20).unwrap();
    let keep1 = DeviceMemory::alloc(&gpu1, 1 << 20).unwrap();
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
        "GPU 0's kernel waits for completions"
    );
    drop(doomed1);
    assert_eq!(
        gpu_queues::ffi::held_frees_on(&gpu1),
        0,
        "GPU 1's free is not held by GPU 0's kernel"
    );
    // GPU 1's own client stream launches and finishes while GPU 0's kernel still waits.
    let part1 = gpu_queues::ffi::GreenPartition::split(&gpu1, 8).unwrap();
    let s1 = gpu_queues::ffi::Stream::new(&gpu1, gpu_queues::ffi::Placement::Client, Some(&part1))
        .unwrap();
    let kernels1 = gpu_queues::kernels::Kernels::load(&gpu1).unwrap();
    kernels1.warm_up_clients(&gpu1, &s1).unwrap();
    s1.wait_idle(compute_wait_bound()).unwrap();
    assert!(!s.is_idle().unwrap(), "GPU 0's kernel still waits");
    drop(keep1);
    assert_eq!(gpu_queues::ffi::held_frees_on(&gpu1), 0);
    drop(doomed0);
    assert_eq!(
        gpu_queues::ffi::held_frees_on(r.gpu.cuda()),
        1,
        "GPU 0's free is held back while its kernel waits"
    );
    s.wait_idle(compute_wait_bound()).unwrap();
    r.emu().faults().set_completion_delay(Duration::ZERO);
    let out = b.results().unwrap();
    assert!(
        out.iter()
            .all(|&(st, sf)| (st, sf) == (DeviceStatus::Ok, 0)),
        "{out:?}"
    );
    assert_eq!(
        gpu_queues::ffi::held_frees_on(r.gpu.cuda()),
        0,
        "freed once idle"
    );
}
