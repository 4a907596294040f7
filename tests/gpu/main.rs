//! The GPU suite: GPU threads drive NVMe queues in GPU memory (the runtime, `gpu_queues`) on
//! both emulated controllers (`gpu_emu`: the software controller and the GPU-resident model),
//! through the perf kernel (`gpunvme_cli::perf`) and files on the GPU (`blockfs_gpu`).
//!
//! Every test needs an NVIDIA GPU and is `#[ignore]`d with the reason "skipped: no GPU", so a
//! plain `cargo test` lists them as ignored instead of passing them. `scripts/gpu-test.sh` runs
//! them on the GPU machine with `--include-ignored` (and again under compute-sanitizer); there
//! a missing GPU is a failure, never a pass.
//!
//! One file per subject: `queues` (the runtime on the software controller), `perf` (the perf
//! kernel), `model` and `model_faults` (the GPU-resident controller model),
//! `several_controllers`, `several_gpus`, `files`, `embed` (embedders' GPU calls), `cache` (the page cache)
//! and `spdk` (SPDK's target); this file holds the rigs and helpers they share.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_emu::image_reads::ReadMode;
use gpu_emu::resident::{NamespaceSpec, STOP_TIMEOUT};
use gpu_emu::{GpuController, GpuControllerOptions, GpuQueuesExt, MediaKind, SsdModel};
use gpu_queues::desc::lat_bucket_floor;
use gpu_queues::desc::{DeviceStatus, IoReq};
use gpu_queues::ffi::{Arg, Cuda, DeviceMemory, Kernel};
use gpu_queues::kernels::IoBatch;
use gpu_queues::queues::compute_wait_bound;
use gpu_queues::{GpuQueueOptions, GpuQueues};
use gpunvme_cli::perf::kernel::{ClientStyle, GpuPerfConfig, GpuRw};
use nvme::{Controller, ControllerOptions, DmaSlice};
use nvme_emu::{EmuConfig, EmuDevice, NamespaceConfig};
use zerocopy::IntoBytes;

/// The page cache's BFS and embedding workloads, which live with the examples.
#[path = "../../examples/workloads/mod.rs"]
mod workloads;

mod cache;
mod embed;
mod files;
mod model;
mod model_faults;
mod perf;
mod queues;
mod served;
mod several_controllers;
mod several_gpus;
mod spdk;

/// Declares each `module::name` as the test `name` at the crate root, where the tests of
/// these modules were before the suite was split into files and where the scripts select
/// them (`--exact name`: scripts/host-gpu-test.sh, scripts/gpu-test.sh): ignored like every
/// GPU test, it runs the module's function of that name.
macro_rules! root_tests {
    ($($module:ident::$name:ident),* $(,)?) => {
        $(
            #[test]
            #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
            fn $name() {
                $module::$name()
            }
        )*
    };
}

root_tests!(
    queues::rings_in_host_memory_carry_every_shape_and_perf,
    queues::a_descriptor_whose_depth_is_not_a_power_of_two_is_refused,
    queues::every_transfer_shape_into_arbitrary_gpu_buffers,
    queues::wrap_around_many_queues_out_of_order,
    queues::media_error_is_a_per_command_status,
    queues::transport_probe_proves_a_read_or_says_why_not,
    queues::frees_while_a_client_waits_are_held_until_it_ends,
    queues::dropped_completion_times_out_on_the_gpu,
    queues::controller_fatal_aborts_every_gpu_waiter,
    queues::gpu_and_cpu_queues_on_one_controller,
    queues::views_and_strided_rows_land_where_asked,
    perf::perf_four_patterns_both_lba_sizes_verified,
    perf::perf_splits_ios_above_the_maximum_transfer,
    perf::perf_on_a_protection_information_namespace_sets_pract,
    model::model_moves_every_transfer_shape_and_writes_back,
    model::model_fails_bad_commands_with_the_status_the_spec_requires,
    model::model_serves_a_host_thread_client,
    model::model_hostile_modes_catch_broken_clients,
    model::model_refuses_changes_to_a_write_protected_namespace,
    model::model_wraps_many_queues_with_both_clients_on_null_media,
    model::model_without_free_sms_is_refused_not_hung,
    model_faults::model_media_error_is_a_per_command_status,
    model_faults::model_dropped_completion_times_out_on_the_gpu,
    model_faults::model_stops_at_once_with_completions_held,
    model_faults::model_ssd_timing_bounds_latency_and_rate,
    several_controllers::several_controllers_run_perf_gpu_at_once,
    several_controllers::volume_files_are_read_on_every_members_queues,
    several_controllers::volume_files_on_gpu_resident_models,
    several_gpus::gpus_are_named_by_ordinal_uuid_and_address,
    several_gpus::perf_gpu_on_every_gpu_at_once,
    several_gpus::perf_gpu_every_gpu_over_several_controllers,
    several_gpus::frees_on_one_gpu_are_not_held_by_another_gpus_kernel,
    served::served_gpu_queues_carry_every_shape_beside_a_cpu_client,
    served::served_gpu_queues_go_back_to_the_daemon_and_two_gpu_clients_share_it,
    served::served_gpu_clients_killed_at_random_points_are_reclaimed,
    served::served_device_loads_safetensors_through_the_handle,
    served::served_reads_are_staged_into_gpu_memory,
    served::served_cpu_reads_cover_many_windows_and_odd_shapes,
    served::served_page_cache_reads_and_writes_files,
);

/// `perf --gpu`'s arguments for the library calls: `rw` of 4 KiB at QD 8 on `queues` queue
/// pairs (0: the controller's share), `ios` I/Os over the first 8 MiB with [`SEED`], ring depth
/// 64, on GPU 0, served by `model` (`None`: the software controller).
fn perf_args(
    rw: gpunvme_cli::perf::RwMode,
    queues: usize,
    ios: u64,
    verify: bool,
    model: Option<MediaKind>,
) -> gpunvme_cli::perf::gpu::GpuPerfArgs {
    gpunvme_cli::perf::gpu::GpuPerfArgs {
        perf: gpunvme_cli::perf::PerfConfig {
            rw,
            bs: 4096,
            qd: 8,
            queues,
            stop: gpunvme_cli::perf::Stop::Ios(ios),
            verify,
            nsid: 1,
            size: Some(8 << 20),
            seed: Some(SEED),
            interrupt: None,
        },
        gpu_threads: None,
        style: ClientStyle::Warp,
        warp_lanes: None,
        cpu_queues: 0,
        depth: Some(64),
        controller_sms: 8,
        model,
        ssd_model: None,
        model_group: None,
        gpu: Default::default(),
        fill: true,
    }
}

const NS_BYTES: u64 = 64 << 20;
const SEED: u64 = 0x005e_ed0f_6b0b;

/// Field order is drop order: the GPU queues are deleted (through `ctrl`) before the GPU
/// controller model stops and before the controller goes.
struct Rig {
    gpu: GpuQueues,
    model: Option<Arc<GpuController>>,
    ctrl: Controller,
    /// The software controller; `None` on a controller gpunvme did not write ([`spdk`]).
    emu: Option<Arc<EmuDevice>>,
    lba: u32,
}

impl Drop for Rig {
    fn drop(&mut self) {
        // A test that already failed says why itself (a panic here would abort).
        if let Some(emu) = &self.emu
            && !std::thread::panicking()
        {
            let bad = emu.stats().invalid_doorbell_writes;
            assert_eq!(bad, 0, "invalid doorbell writes (see the controller's log)");
        }
    }
}

impl Rig {
    /// The software controller behind the rig (its faults and statistics).
    fn emu(&self) -> &Arc<EmuDevice> {
        self.emu
            .as_ref()
            .expect("this test needs the software controller")
    }

    /// Namespace 1's size in blocks.
    fn ns_blocks(&self) -> u64 {
        self.ctrl.namespace(1).expect("namespace 1").blocks
    }
}

fn cuda() -> Arc<Cuda> {
    Cuda::open(0).expect("this test needs an NVIDIA GPU and its driver")
}

/// Every hostile mode, unless `GPUNVME_TEST_HOSTILE=0` (to tell a hostile mode's catch from
/// another failure).
fn hostile() -> nvme_emu::Hostile {
    if std::env::var("GPUNVME_TEST_HOSTILE").is_ok_and(|v| v == "0") {
        nvme_emu::Hostile::default()
    } else {
        nvme_emu::Hostile::ALL
    }
}

/// GPU queues on the software controller's transport with every hostile mode on
/// (`nvme_emu::Hostile`: fetched SQEs poisoned, backward tails flagged, freed CQ entries
/// rewritten stale), so a client that rings a doorbell too early reads or submits garbage and
/// fails; the rig asserts at its end that no doorbell write was invalid.
fn rig_with(lba: u32, cfg: impl FnOnce(&mut EmuConfig), opts: GpuQueueOptions) -> Rig {
    let mut config = EmuConfig {
        namespaces: vec![NamespaceConfig::memory(NS_BYTES, lba)],
        hostile: hostile(),
        ..EmuConfig::default()
    };
    cfg(&mut config);
    let emu = EmuDevice::start(config).expect("software controller");
    let ctrl = Controller::new(emu.clone(), ControllerOptions::default()).expect("bring-up");
    let gpu = GpuQueues::on_software_controller(&cuda(), &ctrl, &emu, &opts).expect("GPU queues");
    Rig {
        emu: Some(emu),
        ctrl,
        gpu,
        model: None,
        lba,
    }
}

fn rig(lba: u32, queues: u16, depth: u32) -> Rig {
    rig_with(
        lba,
        |_| {},
        GpuQueueOptions {
            queues: Some(queues),
            depth: Some(depth),
            ..Default::default()
        },
    )
}

/// The perf pattern (src/pattern.rs) for `blocks` blocks from `lba`.
fn pattern(lba: u64, blocks: u64, lba_size: u32) -> Vec<u8> {
    let mut v = vec![0u8; (blocks * lba_size as u64) as usize];
    gpu_queues::pattern::fill(&mut v, SEED, 1, lba, lba_size as usize);
    v
}

/// Writes the pattern over the first `blocks` blocks through a CPU queue of the same controller.
fn cpu_prefill(r: &Rig, blocks: u64) {
    cpu_fill(r, blocks, |lba, n| pattern(lba, n, r.lba));
}

/// Writes `data(lba, n)` over the first `blocks` blocks, 1 MiB at a time, through a CPU queue.
fn cpu_fill(r: &Rig, blocks: u64, data: impl Fn(u64, u64) -> Vec<u8>) {
    let mut q = r.ctrl.create_io_queue_pair(64).expect("CPU queue");
    let chunk = (1u64 << 20) / r.lba as u64;
    let mut lba = 0;
    while lba < blocks {
        let n = chunk.min(blocks - lba);
        q.write_from(1, lba, &data(lba, n)).expect("CPU write");
        lba += n;
    }
}

fn cpu_read(r: &Rig, lba: u64, blocks: u64) -> Vec<u8> {
    let mut q = r.ctrl.create_io_queue_pair(64).expect("CPU queue");
    let mut out = vec![0u8; (blocks * r.lba as u64) as usize];
    q.read_to(1, lba, &mut out).expect("CPU read");
    out
}

fn perf(
    r: &Rig,
    rw: GpuRw,
    qd: u32,
    style: ClientStyle,
    ios: u64,
) -> gpunvme_cli::perf::kernel::GpuPerfResult {
    perf_bs(r, rw, qd, style, ios, 4096)
}

/// [`perf`] with I/Os of `bs` bytes.
fn perf_bs(
    r: &Rig,
    rw: GpuRw,
    qd: u32,
    style: ClientStyle,
    ios: u64,
    bs: u32,
) -> gpunvme_cli::perf::kernel::GpuPerfResult {
    perf_lanes(r, rw, qd, (style, None), ios, bs)
}

/// [`perf_bs`] with the warp client's issuing lanes per warp.
fn perf_lanes(
    r: &Rig,
    rw: GpuRw,
    qd: u32,
    (style, warp_lanes): (ClientStyle, Option<u32>),
    ios: u64,
    bs: u32,
) -> gpunvme_cli::perf::kernel::GpuPerfResult {
    let cfg = GpuPerfConfig {
        rw,
        nsid: 1,
        lba_size: r.lba,
        bs,
        qd,
        style,
        warp_lanes,
        ios,
        runtime: Duration::ZERO,
        verify: true,
        seed: SEED,
        region_blocks: NS_BYTES / r.lba as u64,
    };
    let emu = r.emu().clone();
    gpunvme_cli::perf::kernel::run(&r.gpu, &cfg, move || {
        emu.csts().cfs().then(|| "controller fatal".to_string())
    })
    .expect("perf run")
}

// ---------------------------------------------------------------------------------------------
// The client kernels that queues.rs, model.rs, model_faults.rs and spdk.rs share: one
// one rw_range kernel, every transfer shape, batches of requests and wrap-around.

/// Runs one rw_range kernel (thread or warp) and returns (status, CQE status field).
fn rw_range(
    r: &Rig,
    write: bool,
    slba: u64,
    blocks: u64,
    bus: u64,
    warp: bool,
) -> (DeviceStatus, u32) {
    rw_range_on(r, r.gpu.descriptors(), write, slba, blocks, bus, warp)
}

/// [`rw_range`] on the descriptor at GPU address `desc0`.
fn rw_range_on(
    r: &Rig,
    desc0: u64,
    write: bool,
    slba: u64,
    blocks: u64,
    bus: u64,
    warp: bool,
) -> (DeviceStatus, u32) {
    rw_on_queues(&r.gpu, r.lba, desc0, write, slba, blocks, bus, warp)
}

/// One GPU thread (or warp) writes or reads `blocks` LBAs of `lba` bytes from `slba` through
/// the queue whose descriptor is at `desc0` of `gpu`, to or from device address `bus`: the
/// `rw_range` tool kernel's status and status field.
#[allow(clippy::too_many_arguments)]
fn rw_on_queues(
    gpu: &GpuQueues,
    lba: u32,
    desc0: u64,
    write: bool,
    slba: u64,
    blocks: u64,
    bus: u64,
    warp: bool,
) -> (DeviceStatus, u32) {
    let res = DeviceMemory::alloc(gpu.cuda(), 8).unwrap();
    let lba_shift = lba.trailing_zeros();
    gpu.client_stream()
        .launch(
            gpu.kernels().tools().unwrap().rw_range,
            1,
            32,
            &[
                Arg::U64(desc0),
                Arg::U32(if write { 1 } else { 2 }),
                Arg::U32(1),
                Arg::U32(lba_shift),
                Arg::U64(slba),
                Arg::U64(blocks),
                Arg::U64(bus),
                Arg::U32(warp as u32),
                Arg::U64(res.ptr()),
            ],
        )
        .unwrap();
    gpu.client_stream().wait_idle(compute_wait_bound()).unwrap();
    let mut out = [0u8; 8];
    res.read(0, &mut out).unwrap();
    let s = u32::from_le_bytes(out[..4].try_into().unwrap());
    let sf = u32::from_le_bytes(out[4..].try_into().unwrap());
    (DeviceStatus::from_code(s), sf)
}

/// Every transfer shape (PRP1 only, PRP1 + PRP2, PRP lists, MDTS, split above MDTS, in-page
/// offsets, destinations off 16-byte alignment) written and read by both client styles into a buffer from `r`'s transport, each
/// checked against CPU queues; an unaligned pointer and a range past the end refused.
fn transfer_shapes(r: &Rig) {
    let lba = r.lba;
    let mdts = r.gpu.max_transfer() as u64;
    let buf = r.gpu.alloc_buffer(4 << 20).unwrap();
    // (byte offset into the buffer, bytes): PRP1 only, PRP1 + PRP2 across a page, a PRP
    // list, exactly MDTS, above MDTS (split), at an in-page offset.
    let shapes = [
        (0u64, lba as u64),
        (4096 - lba as u64, 2 * lba as u64),
        (0, 8192),
        (lba as u64, 64 << 10),
        (0, mdts),
        (0, 3 * mdts + 4 * lba as u64),
        (2048 / 512 * 512, 1 << 20),
        // Destinations 8 and 4 bytes past a 16-byte boundary (a tensor's read into an arena
        // when the file's data section starts at an odd multiple of 8): the software
        // controller stages such data at the same alignment and copies it in vectors.
        (8, 64 << 10),
        (4096 + 4, 2 * mdts + lba as u64),
    ];
    for (i, &(off, bytes)) in shapes.iter().enumerate() {
        if off % 4 != 0 || bytes % lba as u64 != 0 {
            continue;
        }
        for warp in [false, true] {
            let blocks = bytes / lba as u64;
            // 4 MiB of the namespace per shape, 1 block in: fits at both LBA sizes.
            let slba = 1 + i as u64 * ((4 << 20) / lba as u64);
            // GPU write of the pattern (staged from the host into the GPU buffer), CPU
            // read-back; then GPU read of CPU-written data.
            let data = pattern(slba, blocks, lba);
            buf.memory().write(off as usize, &data).unwrap();
            let (s, sf) = rw_range(r, true, slba, blocks, buf.bus() + off, warp);
            assert_eq!(
                (s, sf),
                (DeviceStatus::Ok, 0),
                "write shape {i} warp={warp} lba={lba}"
            );
            assert!(
                cpu_read(r, slba, blocks) == data,
                "shape {i} bytes on the device"
            );
            buf.memory()
                .write(off as usize, &vec![0u8; bytes as usize])
                .unwrap();
            let (s, sf) = rw_range(r, false, slba, blocks, buf.bus() + off, warp);
            assert_eq!((s, sf), (DeviceStatus::Ok, 0), "read shape {i} warp={warp}");
            let mut back = vec![0u8; bytes as usize];
            buf.memory().read(off as usize, &mut back).unwrap();
            assert!(
                back == data,
                "shape {i} warp={warp} lba={lba}: bytes in GPU memory"
            );
        }
    }
    // Unaligned data pointer and a range past the namespace end are refused.
    let (s, _) = rw_range(r, false, 0, 1, buf.bus() + 2, false);
    assert_eq!(s, DeviceStatus::InvalidArgument);
    let end = r.ns_blocks();
    let (s, sf) = rw_range(r, false, end - 1, 2, buf.bus(), false);
    assert_eq!(s, DeviceStatus::NvmeError);
    assert_eq!(
        (sf >> 1) & 0xff,
        0x80,
        "LBA Out of Range, status field {sf:#x}"
    );
}

/// Issues `reqs` through the batch kernel; returns (status, CQE status) per request.
fn batch(r: &Rig, reqs: &[IoReq], warp: bool) -> Vec<(DeviceStatus, u32)> {
    let b = IoBatch::new(r.gpu.cuda(), reqs).unwrap();
    b.launch(
        r.gpu.kernels(),
        r.gpu.client_stream(),
        r.gpu.descriptors(),
        r.gpu.len() as u32,
        warp,
    )
    .unwrap();
    r.gpu
        .client_stream()
        .wait_idle(Duration::from_secs(120))
        .unwrap();
    b.results().unwrap()
}

/// Reads of one block each into the slot-independent scratch buffer `buf`.
fn read_reqs(r: &Rig, buf_bus: u64, n: usize) -> Vec<IoReq> {
    (0..n)
        .map(|i| IoReq {
            slba: (i as u64 * 7) % r.ns_blocks(),
            prp1: buf_bus + (i as u64 % 512) * 4096,
            prp2: 0,
            nsid: 1,
            nlb_z: 0,
            opcode: 2,
            reserved: 0,
        })
        .collect()
}

/// 20 000 one-block reads through the batch kernel over `r`'s queues (8 of `depth` entries:
/// each ring wraps dozens of times), every one successful and reaped exactly once.
fn wrap_around(r: &Rig, warp: bool, depth: u32) {
    let buf = r.gpu.alloc_buffer(512 * 4096).unwrap();
    let reqs = read_reqs(r, buf.bus(), 20_000);
    let out = batch(r, &reqs, warp);
    let bad: Vec<_> = out
        .iter()
        .filter(|&&(s, sf)| s != DeviceStatus::Ok || sf != 0)
        .collect();
    assert!(
        bad.is_empty(),
        "warp={warp}: {} failed, first {:?}",
        bad.len(),
        bad.first()
    );
    let states = r.gpu.queue_states().unwrap();
    let reaped: u64 = states.iter().map(|st| st.cq_reaped as u64).sum();
    assert_eq!(reaped, 20_000, "every completion reaped exactly once");
    for st in states {
        assert_eq!(st.failed, 0);
        // About 20 000 / queues commands per queue: each ring wrapped dozens of times.
        assert!(st.cq_reaped >= depth * 20, "cq_reaped {}", st.cq_reaped);
        assert_eq!(st.sq_published, st.ticket);
    }
}

// ---------------------------------------------------------------------------------------------
// The GPU-resident controller model's rig (model.rs, model_faults.rs, cache.rs at scale): the
// same client code against a persistent controller kernel, behind the software controller's
// admin queue; and the image files in /dev/shm that its tests and others use.

/// A controller over an image file at `path` (the pattern already in it, written by the CPU
/// through the software controller), then the model with `media` and GPU queues on it.
fn model_rig(path: &std::path::Path, lba: u32, media: MediaKind, queues: u16, depth: u32) -> Rig {
    model_rig_with(path, lba, media, queues, depth, false)
}

/// `model_rig`, optionally with a write-protected namespace (then no pattern is written).
fn model_rig_with(
    path: &std::path::Path,
    lba: u32,
    media: MediaKind,
    queues: u16,
    depth: u32,
    read_only: bool,
) -> Rig {
    model_rig_opts(
        path,
        lba,
        media,
        queues,
        depth,
        ModelRigOpts {
            read_only,
            ..Default::default()
        },
    )
}

/// What `model_rig_opts` varies beyond the geometry.
#[derive(Default)]
struct ModelRigOpts {
    /// Write-protected namespace (then no pattern is written).
    read_only: bool,
    /// The namespace's SSD timing model.
    ssd_model: Option<SsdModel>,
    /// The GPU queues' bound on every wait (default 5 s).
    timeout: Option<Duration>,
    /// The model's hostile modes (default: [`hostile`], every one).
    hostile: Option<nvme_emu::Hostile>,
}

fn model_rig_opts(
    path: &std::path::Path,
    lba: u32,
    media: MediaKind,
    queues: u16,
    depth: u32,
    o: ModelRigOpts,
) -> Rig {
    let read_only = o.read_only;
    let config = EmuConfig {
        namespaces: vec![NamespaceConfig {
            backend: nvme_emu::Backend::File(path.to_path_buf()),
            blocks: NS_BYTES / lba as u64,
            lba_size: lba,
            read_only,
            format: nvme_emu::NsFormat::Plain,
        }],
        max_io_queue_pairs: 16,
        ..EmuConfig::default()
    };
    let emu = EmuDevice::start(config).expect("software controller");
    let ctrl = Controller::new(emu.clone(), ControllerOptions::default()).expect("bring-up");
    if !read_only {
        // The pattern goes to the file through a CPU queue before the model loads it.
        let mut q = ctrl.create_io_queue_pair(64).expect("CPU queue");
        let chunk = (1u64 << 20) / lba as u64;
        let blocks = NS_BYTES / lba as u64;
        let mut l = 0;
        while l < blocks {
            q.write_from(1, l, &pattern(l, chunk, lba))
                .expect("CPU write");
            l += chunk;
        }
    }
    let cuda = cuda();
    let model = GpuController::start(
        &cuda,
        &emu,
        &[NamespaceSpec {
            blocks: NS_BYTES / lba as u64,
            lba_size: lba,
            image: Some(path.to_path_buf()),
            read_only,
            ssd_model: o.ssd_model,
        }],
        16,
        ctrl.info().max_transfer_bytes as u32,
        &GpuControllerOptions {
            media,
            hostile: o.hostile.unwrap_or_else(hostile),
            ..Default::default()
        },
    )
    .expect("GPU controller");
    let gpu = GpuQueues::on_gpu_controller(
        &cuda,
        &ctrl,
        &model,
        &GpuQueueOptions {
            queues: Some(queues),
            depth: Some(depth),
            timeout: Some(o.timeout.unwrap_or(Duration::from_secs(5))),
            ..Default::default()
        },
    )
    .expect("GPU queues on the model");
    Rig {
        gpu,
        model: Some(model),
        ctrl,
        emu: Some(emu),
        lba,
    }
}

/// A test's image file in /dev/shm, removed when the test ends, passed or not (a panicking
/// test used to leave its 64 MiB behind in memory-backed tmpfs).
struct ShmImage(std::path::PathBuf);

impl std::ops::Deref for ShmImage {
    type Target = std::path::Path;
    fn deref(&self) -> &std::path::Path {
        &self.0
    }
}

impl AsRef<std::path::Path> for ShmImage {
    fn as_ref(&self) -> &std::path::Path {
        &self.0
    }
}

impl Drop for ShmImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

fn image(name: &str) -> ShmImage {
    let dir = if std::path::Path::new("/dev/shm").is_dir() {
        std::path::PathBuf::from("/dev/shm")
    } else {
        std::env::temp_dir()
    };
    let p = dir.join(format!("gpunvme-model-{name}-{}", std::process::id()));
    std::fs::File::create(&p)
        .and_then(|f| f.set_len(NS_BYTES))
        .expect("image");
    ShmImage(p)
}
