//! The GPU suite: GPU threads drive NVMe queues in GPU memory (the runtime, `gpu_queues`) on
//! both emulated controllers (`gpu_emu`: the software controller and the GPU-resident model),
//! through the perf kernel (`gpunvme_cli::perf`) and files on the GPU (`blockfs_gpu`).
//!
//! Every test needs an NVIDIA GPU and is `#[ignore]`d with the reason "skipped: no GPU", so a
//! plain `cargo test` lists them as ignored instead of passing them. `scripts/gpu-test.sh` runs
//! them on the GPU machine with `--include-ignored` (and again under compute-sanitizer); there
//! a missing GPU is a failure, never a pass.

use std::sync::Arc;
use std::time::{Duration, Instant};

use gpu_emu::image_reads::ReadMode;
use gpu_emu::model::{NamespaceSpec, STOP_TIMEOUT};
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
#[path = "../examples/workloads/mod.rs"]
mod workloads;

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

/// GPU queues on the software controller (transport (a)) with every hostile mode on
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn perf_four_patterns_both_lba_sizes_verified() {
    for lba in [512u32, 4096] {
        let r = rig(lba, 4, 256);
        cpu_prefill(&r, NS_BYTES / lba as u64);
        for rw in [GpuRw::Read, GpuRw::RandRead, GpuRw::Write, GpuRw::RandWrite] {
            // The warp client also with 16 and 8 issuing lanes: 4 and 8 warps share a queue.
            for style in [
                (ClientStyle::Warp, Some(32)),
                (ClientStyle::Warp, Some(16)),
                (ClientStyle::Warp, Some(8)),
                (ClientStyle::Thread, None),
                (ClientStyle::Lone, None),
            ] {
                let res = perf_lanes(&r, rw, 64, style, 20_000, 4096);
                assert_eq!(
                    res.errors, 0,
                    "{lba} {rw:?} {style:?}: {:?}",
                    res.first_failure
                );
                assert_eq!(res.mismatches, 0, "{lba} {rw:?} {style:?}");
                assert!(
                    res.done >= 20_000,
                    "{lba} {rw:?} {style:?}: {} done",
                    res.done
                );
            }
        }
        // What the GPU wrote (pattern, LBA-stamped), the CPU queue reads back.
        let blocks = NS_BYTES / lba as u64;
        let all = cpu_read(&r, 0, blocks);
        assert!(
            all == pattern(0, blocks, lba),
            "CPU read-back of GPU writes at {lba}"
        );
    }
}

/// The software controller with rings, PRP lists and slot buffers in host memory
/// (`GpuQueueOptions::host_rings`, what `perf --gpu` asks for): every transfer shape into GPU
/// buffers (their completions staged behind the data), and verified perf in four patterns by
/// both client styles with 32-entry rings wrapping many times (data in the host slot buffers).
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn rings_in_host_memory_carry_every_shape_and_perf() {
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

/// I/Os larger than one command moves: the perf kernel splits each into commands of the
/// maximum transfer (plus a last, shorter one) and counts it once. For each client style:
/// sequential writes over blocks zeroed first put the pattern on every I/O's blocks (read back
/// through a CPU queue); then verified reads and random writes.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn perf_splits_ios_above_the_maximum_transfer() {
    for lba in [512u32, 4096] {
        let r = rig(lba, 2, 64);
        let bs = 3 * r.gpu.max_transfer() + lba;
        let units = NS_BYTES / bs as u64;
        let blocks = units * (bs / lba) as u64;
        for style in [ClientStyle::Thread, ClientStyle::Warp, ClientStyle::Lone] {
            // Zeros first, so the read-back shows this style's writes, not the last one's.
            cpu_fill(&r, blocks, |_, n| vec![0u8; (n * lba as u64) as usize]);
            for (rw, ios) in [
                (GpuRw::Write, units),
                (GpuRw::RandRead, 64),
                (GpuRw::RandWrite, 64),
                (GpuRw::Read, units),
            ] {
                let res = perf_bs(&r, rw, 32, style, ios, bs);
                assert_eq!(
                    res.errors, 0,
                    "{lba} {rw:?} {style:?}: {:?}",
                    res.first_failure
                );
                assert_eq!(res.mismatches, 0, "{lba} {rw:?} {style:?}");
                assert!(res.done >= ios, "{lba} {rw:?} {style:?}: {} done", res.done);
            }
            assert!(
                cpu_read(&r, 0, blocks) == pattern(0, blocks, lba),
                "CPU read-back of split GPU writes at {lba}"
            );
        }
        assert_eq!(r.emu().stats().errors, 0);
    }
}

/// A descriptor built by hand with a depth that is not a power of two is refused on the
/// device (INVALID_ARGUMENT) before any ticket is taken; the real descriptor still works after.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn a_descriptor_whose_depth_is_not_a_power_of_two_is_refused() {
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

/// A namespace formatted with 8-byte protection information: GPU queues' Reads and Writes
/// carry PRACT and the reference tag (the software controller refuses them otherwise, with
/// Invalid Field and End-to-end Reference Tag Check Error), and what the GPU wrote reads back
/// through a CPU queue.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn perf_on_a_protection_information_namespace_sets_pract() {
    for (lba, pi_type) in [(512u32, 1u8), (4096, 3)] {
        let r = rig_with(
            lba,
            |c| {
                c.namespaces[0].format = nvme_emu::NsFormat::Pi {
                    pi_type,
                    first_bytes: pi_type == 3,
                }
            },
            GpuQueueOptions {
                queues: Some(2),
                depth: Some(64),
                ..Default::default()
            },
        );
        assert_eq!(r.gpu.descs()[0].pi_nsid, 1);
        for rw in [GpuRw::Write, GpuRw::RandWrite, GpuRw::Read, GpuRw::RandRead] {
            let res = perf(&r, rw, 32, ClientStyle::Warp, 600);
            assert_eq!(res.errors, 0, "{lba} {rw:?}: {:?}", res.first_failure);
            assert_eq!(res.mismatches, 0, "{lba} {rw:?}");
        }
        let blocks = 256;
        assert!(
            cpu_read(&r, 0, blocks) == pattern(0, blocks, lba),
            "CPU read-back of GPU writes on a PI namespace at {lba}"
        );
        assert_eq!(r.emu().stats().errors, 0);
    }
}

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
    let res = DeviceMemory::alloc(r.gpu.cuda(), 8).unwrap();
    let lba_shift = r.lba.trailing_zeros();
    r.gpu
        .client_stream()
        .launch(
            r.gpu.kernels().rw_range,
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
    r.gpu
        .client_stream()
        .wait_idle(compute_wait_bound())
        .unwrap();
    let mut out = [0u8; 8];
    res.read(0, &mut out).unwrap();
    let s = u32::from_le_bytes(out[..4].try_into().unwrap());
    let sf = u32::from_le_bytes(out[4..].try_into().unwrap());
    (DeviceStatus::from_code(s), sf)
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn every_transfer_shape_into_arbitrary_gpu_buffers() {
    for lba in [512u32, 4096] {
        transfer_shapes(&rig(lba, 2, 64));
    }
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn wrap_around_many_queues_out_of_order() {
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn media_error_is_a_per_command_status() {
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

/// Transport (b)'s probe (`gpu_queues::transport::probe`), on the software controller's queues:
/// a GPU thread's Read of LBA 0 with the block's bytes passes; a media error and a lost
/// completion are refused, by name and within the bound.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn transport_probe_proves_a_read_or_says_why_not() {
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
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn frees_while_a_client_waits_are_held_until_it_ends() {
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn dropped_completion_times_out_on_the_gpu() {
    let r = rig_with(
        512,
        |_| {},
        GpuQueueOptions {
            queues: Some(1),
            depth: Some(64),
            timeout: Duration::from_millis(300),
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn controller_fatal_aborts_every_gpu_waiter() {
    let r = rig_with(
        512,
        |_| {},
        GpuQueueOptions {
            queues: Some(2),
            depth: Some(64),
            timeout: Duration::from_secs(30),
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn gpu_and_cpu_queues_on_one_controller() {
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

// ---------------------------------------------------------------------------------------------
// The GPU-resident controller model: the same client code against a persistent controller
// kernel, behind the software controller's admin queue.

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
            timeout: o.timeout.unwrap_or(Duration::from_secs(5)),
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

/// Each case's outcome: success for status code 0, else an NVMe error with that generic status
/// code and Do Not Retry.
fn expect_statuses(cases: &[(&str, IoReq, u32)], out: &[(DeviceStatus, u32)]) {
    assert_eq!(cases.len(), out.len());
    for ((name, _, sc), (s, sf)) in cases.iter().zip(out) {
        if *sc == 0 {
            assert_eq!(*s, DeviceStatus::Ok, "{name}: {sf:#x}");
        } else {
            assert_eq!(*s, DeviceStatus::NvmeError, "{name}");
            assert_eq!((sf >> 1) & 0xff, *sc, "{name}: status field {sf:#x}");
            assert_eq!((sf >> 9) & 7, 0, "{name}: generic status type");
            assert_ne!(sf & 0x8000, 0, "{name}: Do Not Retry");
        }
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_moves_every_transfer_shape_and_writes_back() {
    // hbm (copied in and written back) and host (the image's pages over PCIe; /dev/shm is
    // tmpfs, where CUDA registers a writable file mapping).
    for (media, lba) in [
        (MediaKind::Hbm, 512u32),
        (MediaKind::Hbm, 4096),
        (MediaKind::Host, 512),
        (MediaKind::Host, 4096),
    ] {
        let path = image(&format!("shapes{lba}{}", media.name()));
        let r = model_rig(&path, lba, media, 4, 64);
        let mdts = r.gpu.max_transfer() as u64;
        let buf = r.gpu.alloc_buffer(4 << 20).expect("GPU buffer");
        // PRP1 only, PRP2, a PRP list, exactly MDTS, above MDTS (split), at an in-page offset;
        // destinations 8 and 4 bytes past a 16-byte boundary (a tensor's data in a model
        // load), which the model copies as 16-byte stores from two aligned loads.
        let shapes: &[(u64, u64)] = &[
            (0, 512),
            (0, 8192),
            (0, 64 << 10),
            (0, mdts),
            (0, 3 * mdts + 4096),
            (512, 12 << 10),
            (8, 64 << 10),
            (4096 + 4, 2 * mdts + 4096),
            (12, 4096 + 512),
        ];
        for (i, &(off, bytes)) in shapes.iter().enumerate() {
            if off % 4 != 0 || bytes % lba as u64 != 0 {
                continue;
            }
            let slba = 1000 + i as u64 * 777;
            let blocks = bytes / lba as u64;
            for warp in [false, true] {
                let (s, sf) = rw_range(&r, false, slba, blocks, buf.bus() + off, warp);
                assert_eq!(
                    s,
                    DeviceStatus::Ok,
                    "lba {lba} shape {i} warp {warp}: {sf:#x}"
                );
                let mut got = vec![0u8; bytes as usize];
                buf.read(off as usize, &mut got).unwrap();
                assert!(
                    got == pattern(slba, blocks, lba),
                    "lba {lba} shape {i} warp {warp}: bytes differ"
                );
            }
        }
        // Writes through the model reach the image when it stops.
        let new: Vec<u8> = (0..(256u64 << 10)).map(|i| (i * 7 + 3) as u8).collect();
        buf.write(0, &new).unwrap();
        let slba = 4096;
        let (s, sf) = rw_range(
            &r,
            true,
            slba,
            new.len() as u64 / lba as u64,
            buf.bus(),
            true,
        );
        assert_eq!(s, DeviceStatus::Ok, "write: {sf:#x}");
        let stats = r.model.as_ref().unwrap().stop().expect("stop");
        assert_eq!(stats.errors, 0, "{stats:?}");
        assert!(stats.commands > 0 && stats.bytes > 0, "{stats:?}");
        let file = std::fs::read(&path).unwrap();
        let at = (slba * lba as u64) as usize;
        assert!(file[at..at + new.len()] == new[..], "lba {lba}: write-back");
        // Beside it, the CPU's pattern is intact.
        let before = ((slba - 1) * lba as u64) as usize;
        assert!(file[before..at] == pattern(slba - 1, 1, lba)[..]);
        drop(buf);
        drop(r);
        let _ = std::fs::remove_file(&path);
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_fails_bad_commands_with_the_status_the_spec_requires() {
    let path = image("strict");
    let r = model_rig(&path, 512, MediaKind::Hbm, 2, 64);
    let buf = r.gpu.alloc_buffer(1 << 20).expect("GPU buffer");
    let good = IoReq {
        slba: 8,
        prp1: buf.bus(),
        prp2: 0,
        nsid: 1,
        nlb_z: 0,
        opcode: 2,
        reserved: 0,
    };
    let blocks = NS_BYTES / 512;
    let cases: &[(&str, IoReq, u32)] = &[
        ("good read", good, 0),
        (
            "invalid opcode",
            IoReq {
                opcode: 0x7f,
                ..good
            },
            0x01,
        ),
        ("invalid namespace", IoReq { nsid: 9, ..good }, 0x0b),
        (
            "LBA out of range",
            IoReq {
                slba: blocks,
                ..good
            },
            0x80,
        ),
        (
            "range past the end",
            IoReq {
                slba: blocks - 1,
                nlb_z: 1,
                ..good
            },
            0x80,
        ),
        (
            "PRP1 not dword aligned",
            IoReq {
                prp1: buf.bus() + 2,
                ..good
            },
            0x13,
        ),
        (
            "PRP2 not page aligned",
            IoReq {
                prp1: buf.bus() + 3584,
                prp2: buf.bus() + 4100,
                nlb_z: 1,
                ..good
            },
            0x13,
        ),
        (
            "memory outside every window",
            IoReq {
                prp1: 0x1000,
                ..good
            },
            0x04,
        ),
        (
            "above MDTS",
            IoReq {
                nlb_z: u16::MAX,
                ..good
            },
            0x02,
        ),
        ("flush", IoReq { opcode: 0, ..good }, 0),
    ];
    let reqs: Vec<IoReq> = cases.iter().map(|c| c.1).collect();
    for warp in [false, true] {
        expect_statuses(cases, &batch(&r, &reqs, warp));
    }
    let stats = r.model.as_ref().unwrap().stop().expect("stop");
    assert_eq!(
        stats.errors,
        2 * (cases.iter().filter(|c| c.2 != 0).count() as u64)
    );
    drop(buf);
    drop(r);
    let _ = std::fs::remove_file(&path);
}

/// A host thread playing the client of one of the model's queues: SQEs, the doorbell words and
/// CQEs move with `cuMemcpy` on a stream, so the controller kernel is the only kernel running.
struct HostClient {
    desc: gpu_queues::desc::QueueDesc,
    stream: gpu_queues::ffi::Stream,
    cqe: gpu_queues::ffi::PinnedMemory,
    sq_tail: u32,
    cq_head: u32,
    phase: bool,
}

impl HostClient {
    fn new(r: &Rig, queue: usize) -> Self {
        let desc = r.gpu.descs()[queue];
        let cqe = gpu_queues::ffi::PinnedMemory::alloc(r.gpu.cuda(), 16).expect("pinned CQE");
        let stream = r.gpu.new_client_stream().expect("stream");
        Self {
            desc,
            stream,
            cqe,
            sq_tail: 0,
            cq_head: 0,
            phase: true,
        }
    }

    fn copy_in(&self, dst: u64, bytes: &[u8]) {
        gpu_queues::ffi::copy_to_gpu(&self.stream, dst, bytes).expect("copy to GPU");
        self.stream
            .wait_idle(compute_wait_bound())
            .expect("copy to GPU done");
    }

    /// Writes the commands at the SQ tail, then (after the copies ran) the tail doorbell word.
    fn submit(&mut self, cmds: &[nvme_spec::Command]) {
        for c in cmds {
            self.push(c);
        }
        self.ring_sq();
    }

    /// Writes one command at the SQ tail and moves the tail past it (no doorbell).
    fn push(&mut self, c: &nvme_spec::Command) {
        self.copy_in(self.desc.sq + self.sq_tail as u64 * 64, c.as_bytes());
        self.sq_tail = (self.sq_tail + 1) % self.desc.depth;
    }

    /// Writes the SQ tail doorbell word with the tail as it stands.
    fn ring_sq(&self) {
        self.copy_in(self.desc.sq_doorbell, &self.sq_tail.to_ne_bytes());
    }

    /// The CQ entry at `slot` as it stands now (one copy, no wait).
    fn entry(&self, slot: u32) -> nvme_spec::Completion {
        use zerocopy::FromBytes;
        self.stream
            .copy_to_pinned(&self.cqe, 0, self.desc.cq + slot as u64 * 16, 16)
            .expect("copy CQE");
        self.stream
            .wait_idle(compute_wait_bound())
            .expect("CQE copied");
        let mut raw = [0u8; 16];
        self.cqe.read(0, &mut raw);
        nvme_spec::Completion::read_from_bytes(&raw).expect("16 bytes")
    }

    /// Waits (bounded) until the CQ entry at `slot` carries the current phase; returns it.
    fn posted(&self, slot: u32) -> nvme_spec::Completion {
        let deadline = Instant::now() + compute_wait_bound();
        loop {
            let c = self.entry(slot);
            if c.status.p() == self.phase {
                return c;
            }
            assert!(Instant::now() < deadline, "CQ slot {slot}: nothing posted");
            std::thread::sleep(Duration::from_micros(50));
        }
    }

    /// Reaps `n` completions (bounded), then writes the CQ head doorbell word.
    fn reap(&mut self, n: usize) -> Vec<nvme_spec::Completion> {
        use zerocopy::FromBytes;
        let mut out = Vec::new();
        let deadline = Instant::now() + compute_wait_bound();
        while out.len() < n {
            assert!(
                Instant::now() < deadline,
                "no completion within {:?}",
                compute_wait_bound()
            );
            let at = self.desc.cq + self.cq_head as u64 * 16;
            self.stream
                .copy_to_pinned(&self.cqe, 0, at, 16)
                .expect("copy CQE");
            self.stream
                .wait_idle(compute_wait_bound())
                .expect("CQE copied");
            let mut raw = [0u8; 16];
            self.cqe.read(0, &mut raw);
            let c = nvme_spec::Completion::read_from_bytes(&raw).expect("16 bytes");
            if c.status.p() != self.phase {
                std::thread::sleep(Duration::from_micros(50));
                continue;
            }
            out.push(c);
            self.cq_head += 1;
            if self.cq_head == self.desc.depth {
                self.cq_head = 0;
                self.phase = !self.phase;
            }
        }
        self.copy_in(self.desc.cq_doorbell, &self.cq_head.to_ne_bytes());
        out
    }
}

fn io_command(opcode: u8, cid: u16, slba: u64, blocks: u32, prp1: u64) -> nvme_spec::Command {
    use zerocopy::FromZeros;
    let mut c = nvme_spec::Command::new_zeroed();
    c.cdw0 = nvme_spec::command::Cdw0::new()
        .with_opcode(opcode)
        .with_cid(cid);
    c.nsid = 1;
    c.prp1 = prp1;
    c.cdw10 = slba as u32;
    c.cdw11 = (slba >> 32) as u32;
    c.cdw12 = blocks - 1;
    c
}

/// A Flush of namespace 1.
fn flush_command(cid: u16) -> nvme_spec::Command {
    use zerocopy::FromZeros;
    let mut c = nvme_spec::Command::new_zeroed();
    c.cdw0 = nvme_spec::command::Cdw0::new().with_opcode(0).with_cid(cid);
    c.nsid = 1;
    c
}

/// The GPU-resident controller serving a client that is a host thread (commands and
/// completions moved with cuMemcpy): the controller kernel is then the only kernel on the GPU,
/// which is how `scripts/gpu-test.sh` checks it under compute-sanitizer (the sanitizer runs
/// one kernel at a time, so GPU clients cannot run beside the persistent controller). Writes,
/// reads back, strict statuses, and several wraps of the rings with the phase flipping.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_serves_a_host_thread_client() {
    let path = image("hostclient");
    let lba = 512u32;
    let r = model_rig_opts(&path, lba, MediaKind::Hbm, 1, 16, ModelRigOpts::default());
    let mut c = HostClient::new(&r, 0);
    let buf = r.gpu.alloc_buffer(2 << 20).expect("GPU buffer");
    let data: Vec<u8> = (0..4096u32).map(|i| (i * 7 + 3) as u8).collect();
    buf.write(0, &data).expect("fill");
    let per = 4096 / lba;
    let slba = 1000;
    c.submit(&[io_command(1, 0, slba, per, buf.bus()), flush_command(1)]);
    let done = c.reap(2);
    for d in &done {
        assert_eq!(d.status.sc(), 0, "cid {}: status {:?}", d.cid, d.status());
    }
    // Reads of what was written, an LBA out of range and an invalid opcode, round after round
    // until both rings wrapped several times (depth 16).
    for round in 0..6u16 {
        let cmds = [
            io_command(2, 0, slba, per, buf.bus() + 4096),
            io_command(2, 1, NS_BYTES / lba as u64, 1, buf.bus() + 8192),
            io_command(0x7f, 2, slba, 1, buf.bus() + 8192),
            io_command(2, 3, slba, per, buf.bus() + 4096 * (4 + round as u64)),
            io_command(2, 4, slba + per as u64, per, buf.bus() + (1 << 20)),
        ];
        c.submit(&cmds);
        let mut done = c.reap(cmds.len());
        done.sort_by_key(|d| d.cid);
        let sc: Vec<u8> = done.iter().map(|d| d.status.sc()).collect();
        assert_eq!(sc, [0, 0x80, 0x01, 0, 0], "round {round}: statuses by CID");
        assert!(
            done[1].status.dnr() && done[2].status.dnr(),
            "round {round}: errors carry DNR"
        );
        assert!(done.iter().all(|d| d.sqid == 1), "round {round}: SQ id");
        for at in [4096, 4096 * (4 + round as usize)] {
            let mut back = vec![0u8; 4096];
            buf.read(at, &mut back).expect("read back");
            assert_eq!(back, data, "round {round}: bytes read at {at}");
        }
    }
    r.model.as_ref().unwrap().stop().expect("stop");
}

/// The GPU-resident model's hostile modes (as the software controller's, `nvme_emu::Hostile`)
/// each catch a deliberately broken client that the friendly model lets pass: run from a host
/// thread (the rings are GPU memory, reached by copies), once with every mode off and once with
/// every mode on, each bug on its own queue.
/// - A tail doorbell over a slot the client did not rewrite: friendly, the slot's old command
///   runs again; hostile, the fetched slot was poisoned and fails as Invalid Command Opcode
///   under command id FFFFh.
/// - A tail moved backwards over unfetched commands (held back by a full CQ): friendly, less is
///   submitted; hostile, one invalid doorbell write.
/// - The CQ head rung before an entry was read: friendly, the freed entry still reads right;
///   hostile, it reads garbage (command id and SQ id FFFFh).
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_hostile_modes_catch_broken_clients() {
    for hostile_on in [false, true] {
        let path = image(if hostile_on {
            "hostile-on"
        } else {
            "hostile-off"
        });
        let lba = 512u32;
        let modes = if hostile_on {
            nvme_emu::Hostile::ALL
        } else {
            nvme_emu::Hostile::default()
        };
        let r = model_rig_opts(
            &path,
            lba,
            MediaKind::Hbm,
            3,
            8,
            ModelRigOpts {
                hostile: Some(modes),
                ..ModelRigOpts::default()
            },
        );
        let buf = r.gpu.alloc_buffer(1 << 20).expect("GPU buffer");
        let read = |cid: u16, slba: u64| io_command(2, cid, slba, 1, buf.bus());

        // Queue 0: a doorbell over an unwritten slot. Every slot written once, properly.
        let mut a = HostClient::new(&r, 0);
        for i in 0..8u16 {
            a.submit(&[read(10 + i, i as u64)]);
            assert_eq!(a.reap(1)[0].status.sc(), 0, "setup read {i}");
        }
        // The bug: slot 0 rewritten, the tail moved to 2 (slot 1 still holds cid 11's read).
        a.push(&read(20, 7));
        a.sq_tail = 2;
        a.ring_sq();
        let mut done = a.reap(2);
        done.sort_by_key(|c| c.cid);
        if hostile_on {
            assert_eq!(done[0].cid, 20);
            assert_eq!(done[0].status.sc(), 0, "the rewritten slot's command");
            assert_eq!(done[1].cid, 0xffff, "hostile: the poisoned slot");
            assert_eq!(done[1].status.sc(), 0x01, "Invalid Command Opcode");
        } else {
            let cids: Vec<u16> = done.iter().map(|c| c.cid).collect();
            assert_eq!(
                cids,
                [11, 20],
                "friendly: the stale command ran again unnoticed"
            );
            assert!(done.iter().all(|c| c.status.sc() == 0));
        }

        // Queue 1: a tail moved backwards over unfetched commands. Seven completions fill the
        // CQ (8 entries, never read here); three more commands wait, then one CQ entry is
        // freed so that exactly one of them is fetched: its completion shows the model has
        // seen the tail at 2, with two commands left unfetched.
        let mut b = HostClient::new(&r, 1);
        for i in 0..7u16 {
            b.push(&read(40 + i, i as u64));
        }
        b.ring_sq();
        b.posted(6);
        for i in 0..3u16 {
            b.push(&read(50 + i, i as u64));
        }
        b.ring_sq();
        b.copy_in(b.desc.cq_doorbell, &1u32.to_ne_bytes());
        assert_eq!(
            b.posted(7).cid,
            50,
            "the one command the freed entry let through"
        );
        // The bug: tail 2 -> 1 while two commands are unfetched.
        b.sq_tail = 1;
        b.ring_sq();
        std::thread::sleep(Duration::from_millis(300));
        // Nothing more was fetched: the CQ is still full.
        assert_eq!(b.entry(1).cid, 41, "the CQ's second entry is unchanged");

        // Queue 2: the CQ head rung before the second entry was read.
        let mut c = HostClient::new(&r, 2);
        c.submit(&[read(30, 0), read(31, 1)]);
        c.posted(0);
        c.posted(1);
        c.cq_head = 2;
        c.copy_in(c.desc.cq_doorbell, &c.cq_head.to_ne_bytes());
        // Friendly: the entry must stay as it was (checked after a while); hostile: it must
        // turn to garbage within the bound (the model reads the head on its next pass; on CPU
        // threads under load, a pass can take long).
        let deadline = Instant::now() + Duration::from_secs(if hostile_on { 30 } else { 1 });
        let mut late = c.entry(1);
        while Instant::now() < deadline && late.cid == 31 {
            std::thread::sleep(Duration::from_millis(10));
            late = c.entry(1);
        }
        assert!(late.status.p() == c.phase, "the phase still says new");
        if hostile_on {
            assert_eq!((late.cid, late.sqid), (0xffff, 0xffff), "hostile: garbage");
        } else {
            assert_eq!(late.cid, 31, "friendly: the freed entry still reads right");
        }

        let stats = r.model.as_ref().unwrap().stop().expect("stop");
        assert_eq!(
            stats.doorbell_errors,
            u64::from(hostile_on),
            "the backward tail: {} invalid doorbell writes",
            if hostile_on { "one" } else { "no" }
        );
    }
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_refuses_changes_to_a_write_protected_namespace() {
    let path = image("ro");
    std::fs::write(&path, vec![0x5au8; NS_BYTES as usize]).expect("image bytes");
    let r = model_rig_with(&path, 512, MediaKind::Hbm, 2, 64, true);
    let buf = r.gpu.alloc_buffer(1 << 20).expect("GPU buffer");
    let read = IoReq {
        slba: 8,
        prp1: buf.bus(),
        prp2: 0,
        nsid: 1,
        nlb_z: 7,
        opcode: 2,
        reserved: 0,
    };
    let cases: &[(&str, IoReq, u32)] = &[
        ("write", IoReq { opcode: 1, ..read }, 0x20),
        ("write zeroes", IoReq { opcode: 8, ..read }, 0x20),
        ("read", read, 0),
        (
            "write out of range (range first, as nvme_emu checks)",
            IoReq {
                opcode: 1,
                slba: NS_BYTES / 512,
                ..read
            },
            0x80,
        ),
    ];
    let reqs: Vec<IoReq> = cases.iter().map(|c| c.1).collect();
    for warp in [false, true] {
        expect_statuses(cases, &batch(&r, &reqs, warp));
        // The read saw the image's bytes: nothing was written or zeroed.
        let mut back = vec![0u8; 4096];
        buf.read(0, &mut back).expect("read back");
        assert!(back.iter().all(|&b| b == 0x5a), "read-only media changed");
    }
    r.model.as_ref().unwrap().stop().expect("stop");
    drop(buf);
    drop(r);
    let bytes = std::fs::read(&path).expect("image");
    assert!(
        bytes.iter().all(|&b| b == 0x5a),
        "read-only image written back"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_wraps_many_queues_with_both_clients_on_null_media() {
    let path = image("null");
    let r = model_rig(&path, 4096, MediaKind::Null, 16, 64);
    for style in [ClientStyle::Thread, ClientStyle::Warp] {
        let cfg = GpuPerfConfig {
            rw: GpuRw::RandRead,
            nsid: 1,
            lba_size: 4096,
            bs: 4096,
            qd: 32,
            style,
            warp_lanes: None,
            ios: 200_000,
            runtime: Duration::ZERO,
            verify: false,
            seed: SEED,
            region_blocks: NS_BYTES / 4096,
        };
        let res = gpunvme_cli::perf::kernel::run(&r.gpu, &cfg, || None).expect("perf on the model");
        assert_eq!(res.errors, 0, "{style:?}");
        assert!(res.done >= 200_000, "{style:?}: {} done", res.done);
    }
    let stats = r.model.as_ref().unwrap().stop().expect("stop");
    assert_eq!(stats.errors, 0);
    assert_eq!(stats.doorbell_errors, 0);
    drop(r);
    let _ = std::fs::remove_file(&path);
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_without_free_sms_is_refused_not_hung() {
    let path = image("nosm");
    let config = EmuConfig {
        namespaces: vec![NamespaceConfig {
            backend: nvme_emu::Backend::File(path.to_path_buf()),
            blocks: NS_BYTES / 512,
            lba_size: 512,
            read_only: false,
            format: nvme_emu::NsFormat::Plain,
        }],
        ..EmuConfig::default()
    };
    let emu = EmuDevice::start(config).expect("software controller");
    let cuda = cuda();
    let t0 = Instant::now();
    let err = GpuController::start(
        &cuda,
        &emu,
        &[NamespaceSpec {
            blocks: NS_BYTES / 512,
            lba_size: 512,
            image: None,
            read_only: false,
            ssd_model: None,
        }],
        8,
        1 << 17,
        &GpuControllerOptions {
            controller_sms: cuda.sm_count() + 8,
            ..Default::default()
        },
    )
    .expect_err("a controller on more SMs than the GPU has");
    assert!(
        t0.elapsed() < Duration::from_secs(30),
        "refusal took {:?}",
        t0.elapsed()
    );
    eprintln!("refused as expected: {err}");
    let _ = std::fs::remove_file(&path);
}

// ---------------------------------------------------------------------------------------------
// Files on the GPU (blockfs_gpu, ptx/include/gpunvme_file.cuh): blockfs on the same controller,
// extent tables in GPU memory, byte ranges read and written by GPU-issued commands.

mod files {
    use super::*;
    use blockfs::{
        CreateOptions, FileSystem, MkfsOptions, NvmeBlockDevice, NvmeDeviceOptions, OpenMode,
    };
    use blockfs_gpu::{ChunkOrder, FileRange, GpuFiles, GpuFilesOptions, GpuSpan};

    pub(super) fn data(seed: u64, n: usize) -> Vec<u8> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x as u8
            })
            .collect()
    }

    pub(super) fn blockfs_dev(r: &Rig) -> Arc<NvmeBlockDevice> {
        let opts = NvmeDeviceOptions {
            queues: 2,
            ..NvmeDeviceOptions::default()
        };
        Arc::new(NvmeBlockDevice::new(&r.ctrl, 1, &opts).expect("blockfs device"))
    }

    /// A file system with `dir/a` and `dir/b` of `len` bytes each whose appends interleave (so
    /// both are spread over many extents); returns the bytes of `dir/a`.
    pub(super) fn fragmented(fs: &FileSystem, len: usize) -> Vec<u8> {
        let d = data(len as u64, len);
        let a = fs
            .create("dir/a", &CreateOptions::default())
            .expect("create a");
        let b = fs
            .create("dir/b", &CreateOptions::default())
            .expect("create b");
        let step = 64 * 1024 + 512;
        let mut at = 0;
        while at < len {
            let n = step.min(len - at);
            a.write_at(at as u64, &d[at..at + n]).expect("write a");
            b.write_at(at as u64, &d[at..at + n]).expect("write b");
            at += n;
        }
        fs.sync().expect("sync");
        d
    }

    fn host_bytes(buf: &gpu_queues::GpuBuffer, off: usize, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        buf.read(off, &mut v).expect("GPU buffer read");
        v
    }

    /// The software controller on the image file at `path` (4 KiB LBAs), 4 GPU queues of 256.
    /// Small Reads go by `pread` too (on tmpfs they would copy from the CPU path's own mapping,
    /// unguarded: a truncation of the image would kill the process there).
    fn image_rig(path: &std::path::Path) -> Rig {
        rig_with(
            4096,
            |c| {
                c.namespaces = vec![NamespaceConfig {
                    backend: nvme_emu::Backend::File(path.to_path_buf()),
                    blocks: NS_BYTES / 4096,
                    lba_size: 4096,
                    read_only: false,
                    format: nvme_emu::NsFormat::Plain,
                }];
                c.image_reads = nvme_emu::ImageReads::Pread;
            },
            GpuQueueOptions {
                queues: Some(4),
                depth: Some(256),
                ..Default::default()
            },
        )
    }

    /// A file system on an image file: the software controller moves Read data the way
    /// `GPUNVME_EMU_READS` says (copies out of a mapping of the image or pread into staging, or
    /// registered page-cache windows, every page
    /// being resident since the file system was just written through it), and the GPU gets the
    /// file's bytes, whole and at odd offsets. scripts/host-gpu-test.sh runs it in each mode.
    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn image_reads_take_the_chosen_path() {
        let path = image("windows");
        let r = image_rig(&path);
        let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
        let len = (3 << 20) + 4097;
        let want = fragmented(&fs, len);
        let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
        let files = GpuFiles::new(&r.gpu, GpuFilesOptions::default());
        let g = files.open(&file).expect("open for the GPU");
        // A hint of the reads to come: the controller has the kernel read what of the file is
        // not in the page cache, on a thread of its own, while the read below runs.
        let ahead = files.will_read(&[&g]);
        // Taken unless turned off: by default, off where cold Reads go by direct I/O (the
        // `mapped` mode with GPUNVME_EMU_COLD_READS=direct); with `prefetch`, taken where some
        // of the file's data is not in the page cache (never on tmpfs).
        let var = |k: &str| std::env::var(k).ok().filter(|v| !v.trim().is_empty());
        let mapped = r.gpu.window_stats().expect("software controller").0 == ReadMode::Mapped;
        let cold = var("GPUNVME_EMU_COLD_READS").map(|v| v.trim().to_owned());
        let on = if mapped && cold.as_deref() == Some("prefetch") {
            use std::os::fd::AsFd;
            let img = std::fs::File::open(&*path).expect("image");
            let lba = 1u64 << g.table().header().lba_shift;
            !blockfs_gpu::plan::read_runs(g.table(), 0)
                .iter()
                .all(|&(at, n)| {
                    gpu_queues::ffi::os::range_cached(img.as_fd(), at * lba, n * lba)
                        .expect("cachestat")
                })
        } else {
            match var(gpu_emu::software::READAHEAD_ENV)
                .as_deref()
                .map(str::trim)
            {
                Some("off") => false,
                Some(_) => true,
                None => !mapped || cold.as_deref() != Some("direct"),
            }
        };
        assert_eq!(
            ahead.is_running(),
            on,
            "an image file: the hint is taken or not"
        );
        let buf = r.gpu.alloc_buffer(len).expect("buffer");
        let got = files.read(&g, GpuSpan::all(&buf), 0).expect("GPU read");
        assert_eq!(got, len as u64);
        assert!(host_bytes(&buf, 0, len) == want, "bytes of the whole file");
        drop(ahead);
        let (off, n) = (12_345u64, 1_000_003u64);
        let odd = r.gpu.alloc_buffer(n as usize + 3).expect("buffer");
        let span = GpuSpan::of(&odd, 3, n).expect("span");
        let res = files
            .run(&[FileRange::read(&g, off, span)])
            .expect("batch")
            .into_first_error()
            .expect("range");
        assert_eq!(res.bytes(), n);
        assert!(
            host_bytes(&odd, 3, n as usize) == want[off as usize..(off + n) as usize],
            "bytes at an odd offset"
        );
        let d = r.gpu.dma_stats().expect("software controller");
        let (mode, w) = r.gpu.window_stats().expect("software controller");
        eprintln!("{}: {d:?} {w:?}", mode.name());
        // Every whole block of the file went to GPU memory by the chosen path; the partial
        // last block goes through a slot buffer, which with host rings (the default) is host
        // memory the controller fills directly, neither staged nor copied.
        let whole = len as u64 / 4096 * 4096;
        match mode {
            ReadMode::Registered => {
                assert!(w.registered >= 1, "a window was registered: {w:?}");
                assert!(d.direct_bytes >= whole, "data from the windows: {d:?}");
            }
            ReadMode::Mapped | ReadMode::Pread => {
                assert_eq!((d.direct_bytes, w.registered), (0, 0));
                assert!(d.staged_file_bytes >= whole, "data staged: {d:?}");
                // Every page is in memory (just written through the controller): `mapped`
                // copies all of them out of its mapping, `pread` none.
                if mode == ReadMode::Mapped {
                    assert!(d.mapped_bytes >= whole, "out of the mapping: {d:?}");
                } else {
                    assert_eq!(d.mapped_bytes, 0, "{d:?}");
                }
                // Reads of 64 KiB and more (the file's 128 KiB chunks) go by copy engine, unless
                // pieces are copies already (compute-sanitizer, GPUNVME_EMU_DMA=memcpy) or
                // GPUNVME_EMU_STAGED=kernel asks for the scatter kernel.
                let engine = r.gpu.copy_mode() == Some(gpu_emu::CopyMode::Kernels)
                    && std::env::var("GPUNVME_EMU_STAGED").map_or(true, |v| v.trim() != "kernel");
                if engine {
                    assert!(d.engine_copies >= 1, "staged Reads by copy engine: {d:?}");
                } else {
                    assert_eq!(d.engine_copies, 0, "no copy-engine Reads: {d:?}");
                }
            }
        }
        // The image cut short under the controller (its pages gone, as after an eviction and a
        // disk error): every Read of the lost blocks is an NVMe error (Unrecovered Read Error)
        // and the process lives on, in every mode (`mapped` sees the pages are not resident
        // and reads them by pread; a page lost during its copy would be a SIGBUS turned into
        // the same error, gpu_queues::ffi::guarded_copy's tests). Then the blocks come back
        // (as zeroes) and the same read succeeds.
        // (Registered windows pin their pages: they keep the old bytes, no error to see.)
        if mode == ReadMode::Registered {
            drop(r);
            let _ = std::fs::remove_file(&path);
            return;
        }
        let image = std::fs::OpenOptions::new()
            .write(true)
            .open(&path)
            .expect("image");
        let full = image.metadata().expect("image size").len();
        image.set_len(0).expect("truncate the image");
        let e = files
            .run(&[FileRange::read(&g, 0, GpuSpan::all(&buf))])
            .expect("batch")
            .into_first_error()
            .expect_err("a read of a truncated image");
        match &e {
            blockfs_gpu::FilesError::FileIo { nvme_status, .. } => {
                assert_eq!(
                    (nvme_status >> 1) & 0x7ff,
                    0x281,
                    "Unrecovered Read Error: {e}"
                );
            }
            other => panic!("expected a file I/O error, got {other}"),
        }
        image.set_len(full).expect("restore the image's length");
        let got = files.read(&g, GpuSpan::all(&buf), 0).expect("GPU read");
        assert_eq!(got, len as u64);
        assert!(
            host_bytes(&buf, 0, 4096).iter().all(|&b| b == 0),
            "the lost blocks read back as zeroes"
        );
        drop(r);
        let _ = std::fs::remove_file(&path);
    }

    /// An image on a disk file system, cold (written back and dropped from the page cache): the
    /// software controller reads a file's staged Reads from the disk by direct I/O with
    /// `GPUNVME_EMU_COLD_READS=direct` (none by default, `buffered`, nor in any
    /// `GPUNVME_EMU_READS` mode but `mapped`), or copies them all out of a prefetch's pool (read
    /// by direct I/O on the read's hint) with `prefetch`, leaving the page cache empty; once the image is
    /// back in the page cache it copies every staged Read out of its mapping. The GPU gets the
    /// file's bytes each time. Skipped where the file system keeps the pages (tmpfs).
    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn cold_image_reads_by_direct_io_when_chosen() {
        use gpu_queues::ffi::os::{Residency, advise_dontneed, residency};
        use std::os::fd::AsFd;
        let p = std::env::temp_dir().join(format!("gpunvme-cold-{}", std::process::id()));
        std::fs::File::create(&p)
            .and_then(|f| f.set_len(NS_BYTES))
            .expect("image");
        let path = ShmImage(p);
        let r = image_rig(&path);
        let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
        let len = (6 << 20) + 4097;
        let want = data(77, len);
        let f = fs
            .create("model", &CreateOptions::default())
            .expect("create");
        f.write_at(0, &want).expect("write");
        fs.sync().expect("sync");
        let file = fs.open("model", OpenMode::ReadOnly).expect("open");
        let files = GpuFiles::new(&r.gpu, GpuFilesOptions::default());
        let g = files.open(&file).expect("open for the GPU");
        let img = std::fs::File::open(&*path).expect("image");
        img.sync_all().expect("write the image back");
        advise_dontneed(img.as_fd(), 0, 0).expect("drop the image's pages");
        let left = residency(img.as_fd(), 0, NS_BYTES);
        if !matches!(left, Ok(Residency::None)) {
            eprintln!("skipped: the image's pages stay in memory here ({left:?})");
            return;
        }
        let read = |what: &str| {
            let before = r.gpu.dma_stats().expect("software controller");
            let buf = r.gpu.alloc_buffer(len).expect("buffer");
            // As a load does: the hint (a prefetch's start, with `prefetch`) over the reads.
            let _ahead = files.will_read(&[&g]);
            let got = files.read(&g, GpuSpan::all(&buf), 0).expect("GPU read");
            assert_eq!(got, len as u64);
            assert!(host_bytes(&buf, 0, len) == want, "bytes of the {what} file");
            let after = r.gpu.dma_stats().expect("software controller");
            (
                after.staged_file_bytes - before.staged_file_bytes,
                after.cold_direct_bytes - before.cold_direct_bytes,
                after.mapped_bytes - before.mapped_bytes,
            )
        };
        let (staged, direct, mapped) = read("cold");
        let (mode, _) = r.gpu.window_stats().expect("software controller");
        eprintln!(
            "{}: cold: staged {staged} direct {direct} mapped {mapped}",
            mode.name()
        );
        // Staged Reads of 64 KiB and more go by copy engine (as in the test above), and those
        // are the ones read direct: the file's 128 KiB chunks, all but its tail.
        let engine = r.gpu.copy_mode() == Some(gpu_emu::CopyMode::Kernels)
            && std::env::var("GPUNVME_EMU_STAGED").map_or(true, |v| v.trim() != "kernel");
        let cold = std::env::var("GPUNVME_EMU_COLD_READS").unwrap_or_default();
        if mode == ReadMode::Mapped && cold.trim() == "prefetch" {
            // Every staged Read out of the prefetch's pool, which direct I/O filled.
            assert_eq!(
                direct, staged,
                "the cold file by the prefetch: staged {staged}"
            );
            assert_eq!(mapped, 0, "nothing was in the page cache");
            let whole = residency(img.as_fd(), 1 << 20, 4 << 20).expect("cachestat");
            assert_eq!(whole, Residency::None, "direct reads bypass the page cache");
        } else if mode == ReadMode::Mapped && engine && cold.trim() == "direct" {
            assert!(
                direct >= staged - (128 << 10) && direct > 0,
                "the cold chunks by direct I/O: staged {staged}, direct {direct}"
            );
            assert_eq!(mapped, 0, "nothing was in the page cache");
            // Direct reads leave the page cache alone.
            let whole = residency(img.as_fd(), 1 << 20, 4 << 20).expect("cachestat");
            assert_eq!(whole, Residency::None, "direct reads bypass the page cache");
        } else {
            assert_eq!(direct, 0, "no direct reads in this mode");
        }
        // Back in the page cache, and kept there while the GPU reads (locked: a machine that
        // reclaims the page cache eagerly can evict a chunk between a plain read of the image
        // and the GPU's): copies out of the mapping, no direct read.
        let held = gpu_queues::ffi::os::Mapping::read_only(img.as_fd(), NS_BYTES as usize)
            .expect("map the image");
        if let Err(e) = held.lock() {
            eprintln!("skipped the warm check: the image's pages cannot be locked here ({e})");
            return;
        }
        let (staged, direct, mapped) = read("warm");
        eprintln!(
            "{}: warm: staged {staged} direct {direct} mapped {mapped}",
            mode.name()
        );
        assert_eq!(direct, 0, "a warm image is not read direct");
        if mode == ReadMode::Mapped {
            assert_eq!(mapped, staged, "every staged Read out of the mapping");
        }
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn file_of_unaligned_size_loads_with_gpu_checksum() {
        for lba in [512u32, 4096] {
            let r = rig(lba, 4, 256);
            let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
            let len = (5 << 20) + 333;
            let want = fragmented(&fs, len);
            let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            for warp in [true, false] {
                let files = GpuFiles::new(
                    &r.gpu,
                    GpuFilesOptions {
                        warp,
                        ..Default::default()
                    },
                );
                let g = files.open(&file).expect("open for the GPU");
                assert!(g.table().extents().len() > 3, "fragmented");
                let buf = r.gpu.alloc_buffer(len).expect("buffer");
                let got = match files.read(&g, GpuSpan::all(&buf), 0) {
                    Ok(got) => got,
                    // A timeout here says where every queue stood.
                    Err(e) => panic!(
                        "GPU read of the whole file (lba {lba}, warp {warp}): {e:?}\n\
                         queues: {:#?}\ncopy engines: {:?}",
                        r.gpu.queue_states(),
                        r.gpu.dma_stats()
                    ),
                };
                assert_eq!(got, len as u64);
                let crc = files.crc32c(buf.ptr(), len as u64).expect("GPU crc");
                assert_eq!(
                    crc,
                    crc32c::crc32c(&want),
                    "lba {lba} warp {warp}: GPU CRC-32C"
                );
                assert!(
                    host_bytes(&buf, 0, len) == want,
                    "lba {lba} warp {warp}: bytes"
                );
            }
        }
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn byte_ranges_at_odd_offsets_match_the_host() {
        for lba in [512u32, 4096] {
            let r = rig(lba, 2, 64);
            let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
            let len = 3 * 1024 * 1024 + 4097;
            let want = fragmented(&fs, len);
            let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            let cases: &[(u64, u64)] = &[
                (0, 1),
                (1, 1),
                (511, 2),
                (4095, 4098),
                (12_345, 1_000_000),
                (len as u64 - 1, 1),
                (len as u64 - 5000, 5000),
                (65_536 + 511, 3 * 65_536 + 3),
                (7, len as u64 - 7),
            ];
            // Warps claiming chunks (8 KiB chunks: several rounds on 2 queues) or spreading
            // them; threads alone.
            for (warp, chunk, order) in [
                (true, None, ChunkOrder::Claim),
                (false, None, ChunkOrder::Claim),
                (true, Some(8192), ChunkOrder::Claim),
                (true, Some(8192), ChunkOrder::Spread),
                (false, Some(4096), ChunkOrder::Claim),
            ] {
                let files = GpuFiles::new(
                    &r.gpu,
                    GpuFilesOptions {
                        warp,
                        chunk_bytes: chunk,
                        chunks: order,
                        ..Default::default()
                    },
                );
                let g = files.open(&file).expect("open for the GPU");
                // One batch: every range into its own place of one buffer, at addresses that
                // are aligned, odd and 2 mod 4 (those bounce through slot buffers).
                let total: u64 = cases.iter().map(|c| c.1 + 8).sum();
                let buf = r.gpu.alloc_buffer(total as usize).expect("buffer");
                let mut at = 0u64;
                let mut ranges = Vec::new();
                for (i, &(off, n)) in cases.iter().enumerate() {
                    let skew = [0u64, 1, 2, 3, 4][i % 5];
                    ranges.push((at + skew, off, n));
                    at += n + 8;
                }
                let reqs: Vec<FileRange<'_>> = ranges
                    .iter()
                    .map(|&(b, off, n)| FileRange::read(&g, off, GpuSpan::of(&buf, b, n).unwrap()))
                    .collect();
                let res = files
                    .run(&reqs)
                    .expect("batch")
                    .into_first_error()
                    .expect("ranges");
                for &(b, off, n) in &ranges {
                    assert!(
                        host_bytes(&buf, b as usize, n as usize)
                            == want[off as usize..(off + n) as usize],
                        "lba {lba} warp {warp} chunk {chunk:?} {order:?}: {off}+{n} at buffer {b}"
                    );
                }
                assert_eq!(res.bytes(), cases.iter().map(|c| c.1).sum::<u64>());
                assert_eq!(
                    res.shape.claim,
                    warp && chunk == Some(8192) && order == ChunkOrder::Claim,
                    "{:?}",
                    res.shape
                );
                // Reads stop at the length (pread): 3 bytes asked at len - 1, 1 read.
                let small = r.gpu.alloc_buffer(4096).expect("buffer");
                let got = files
                    .read(&g, GpuSpan::of(&small, 0, 3).unwrap(), len as u64 - 1)
                    .expect("read at the end");
                assert_eq!(got, 1);
                assert_eq!(host_bytes(&small, 0, 1), want[len - 1..]);
            }
        }
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn gpu_writes_into_a_preallocated_file_read_back_after_remount() {
        for lba in [512u32, 4096] {
            let r = rig(lba, 2, 64);
            let dev = blockfs_dev(&r);
            let fs = FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).expect("mkfs");
            let len = 2 * 1024 * 1024 + 1001;
            let mut want: Vec<Vec<u8>> = Vec::new();
            for (i, warp) in [true, false].into_iter().enumerate() {
                let name = format!("ckpt/{i}");
                let f = fs
                    .create(
                        &name,
                        &CreateOptions {
                            size_hint: len as u64,
                        },
                    )
                    .expect("create");
                // Old contents below 10000 bytes: the GPU's partial LBAs keep their neighbours.
                let mut expect = data(100 + i as u64, 10_000);
                f.write_at(0, &expect).expect("host write");
                fs.sync().expect("sync");
                expect.resize(len, 0);
                let files = GpuFiles::new(
                    &r.gpu,
                    GpuFilesOptions {
                        warp,
                        ..Default::default()
                    },
                );
                let g = files.reserve(&f, len as u64).expect("reserve");
                assert!(g.is_writable() && g.alloc_bytes() >= len as u64);
                let src = data(7 + i as u64, len);
                let buf = r.gpu.alloc_buffer(len + 64).expect("buffer");
                buf.write(0, &src).expect("upload");
                // The tail from an unaligned file offset, then overwrites at odd places, some
                // from odd buffer addresses.
                let writes: &[(u64, u64, u64)] = &[
                    (10_000, 10_000, len as u64 - 10_000),
                    (1, 3, 700),
                    (513, 4095, 10_000),
                    (0, 0, 1),
                    (4096, 65_536, 200_000),
                ];
                for &(b, off, n) in writes {
                    files
                        .write(&g, GpuSpan::of(&buf, b, n).unwrap(), off)
                        .unwrap_or_else(|e| panic!("write {off}+{n}: {e}"));
                    expect[off as usize..(off + n) as usize]
                        .copy_from_slice(&src[b as usize..(b + n) as usize]);
                }
                // Past the allocation: refused before anything runs.
                assert!(
                    files
                        .write(&g, GpuSpan::of(&buf, 0, 2).unwrap(), g.alloc_bytes() - 1)
                        .is_err()
                );
                g.commit(len as u64).expect("commit");
                want.push(expect);
            }
            fs.sync().expect("sync");
            fs.unmount().expect("unmount");
            let fs = FileSystem::mount(blockfs_dev(&r)).expect("remount");
            for (i, expect) in want.iter().enumerate() {
                let f = fs
                    .open(&format!("ckpt/{i}"), OpenMode::ReadOnly)
                    .expect("open");
                assert_eq!(f.len().unwrap(), len as u64);
                let mut back = vec![0u8; len];
                f.read_at(0, &mut back).expect("CPU read");
                assert!(
                    &back == expect,
                    "lba {lba} file {i}: the CPU reads what the GPU wrote"
                );
            }
        }
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn batch_open_by_prefix_reads_every_file() {
        let r = rig(512, 4, 128);
        let fs = FileSystem::mkfs(blockfs_dev(&r), &MkfsOptions::default()).expect("mkfs");
        let sizes = [
            0usize,
            1,
            511,
            512,
            4096,
            4097,
            100_000,
            1 << 20,
            (1 << 20) + 3,
            77,
        ];
        let mut want = Vec::new();
        for (i, &n) in sizes.iter().enumerate() {
            let d = data(i as u64 + 50, n);
            let f = fs
                .create(&format!("shard/{i:02}"), &CreateOptions::default())
                .expect("create");
            f.write_at(0, &d).expect("write");
            want.push(d);
        }
        fs.create("other", &CreateOptions::default())
            .expect("create");
        fs.sync().expect("sync");
        let files = GpuFiles::new(&r.gpu, GpuFilesOptions::default());
        let handles = files.open_prefix(&fs, "shard/").expect("batch open");
        assert_eq!(handles.len(), sizes.len());
        assert!(
            handles
                .iter()
                .all(|h| h.table_ptr() == handles[0].table_ptr()),
            "one table"
        );
        let total: usize = sizes.iter().map(|n| n + 1).sum();
        let buf = r.gpu.alloc_buffer(total).expect("buffer");
        let mut at = 0u64;
        let mut reqs = Vec::new();
        for h in &handles {
            reqs.push(FileRange::read(
                h,
                0,
                GpuSpan::of(&buf, at, h.size()).unwrap(),
            ));
            at += h.size() + 1;
        }
        files
            .run(&reqs)
            .expect("batch")
            .into_first_error()
            .expect("ranges");
        let mut at = 0usize;
        for (i, h) in handles.iter().enumerate() {
            assert_eq!(h.name(), format!("shard/{i:02}"));
            assert!(host_bytes(&buf, at, sizes[i]) == want[i], "shard {i}");
            at += sizes[i] + 1;
        }
    }
}

// ---------------------------------------------------------------------------------------------
// The model's faults and SSD timing (MODEL in ptx/emu/gpunvme_controller.cuh): the software
// controller's fault tests above, on the GPU-resident controller, and what the timing model
// guarantees (lower bounds on latency, upper bounds on rate: the GPU machine's timings are
// noisy, the model's bounds are not).

fn model_of(r: &Rig) -> &Arc<GpuController> {
    r.model.as_ref().expect("a rig on the GPU controller model")
}

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_media_error_is_a_per_command_status() {
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_dropped_completion_times_out_on_the_gpu() {
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
        .drop_completions_on(1, gpu_emu::model::DROP_ALL)
        .unwrap();
    assert_eq!(
        faults.drops_remaining_on(1).unwrap(),
        gpu_emu::model::DROP_ALL
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_stops_at_once_with_completions_held() {
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

#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn model_ssd_timing_bounds_latency_and_rate() {
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

// ---------------------------------------------------------------------------------------------
// perf --gpu over several controllers (issue 23): each controller its own GPU queues and perf
// kernel, side by side, one report each and the totals.

/// Image files named after `names` (64 MiB each, removed on drop), each opened as the CLI
/// opens a device (the software controller, one controller thread, `queue_pairs` I/O queue
/// pairs).
fn open_images(
    names: &[&str],
    queue_pairs: u16,
) -> (Vec<ShmImage>, Vec<(Controller, gpunvme::open::Backend)>) {
    use gpunvme::open::{self, DeviceSpec, OpenOptions};
    let images: Vec<ShmImage> = names.iter().map(|n| image(n)).collect();
    let opts = OpenOptions {
        controller_threads: 1,
        controller_queue_pairs: queue_pairs,
        ..OpenOptions::default()
    };
    let opened = images
        .iter()
        .map(|p| {
            let spec = DeviceSpec::parse(Some(p.to_str().expect("UTF-8"))).expect("spec");
            open::open_controller_and_transport(&spec, &opts).expect("open")
        })
        .collect();
    (images, opened)
}

/// Two software controllers over two images run `perf --gpu --verify` at once, each its own
/// queues: every I/O checked on both, the totals their sum; the GPU-resident model over
/// several is refused by name before anything runs.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn several_controllers_run_perf_gpu_at_once() {
    use gpunvme_cli::perf::gpu::GpuPerfArgs;
    use gpunvme_cli::perf::{PerfConfig, RwMode, Stop, run_several_gpu};
    let (images, opened) = open_images(&["several-a", "several-b"], 4);
    let pairs: Vec<_> = opened.iter().map(|(c, b)| (c, b)).collect();
    let names: Vec<String> = images.iter().map(|p| p.display().to_string()).collect();
    let mut args = GpuPerfArgs {
        perf: PerfConfig {
            rw: RwMode::RandRead,
            bs: 4096,
            qd: 8,
            queues: 2,
            stop: Stop::Ios(512),
            verify: true,
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
        model: None,
        ssd_model: None,
        model_group: None,
    };
    let r = run_several_gpu(&pairs, &names, &args).expect("perf --gpu over two controllers");
    assert_eq!(r.controllers.len(), 2);
    for c in &r.controllers {
        let g = &c.report.report;
        assert_eq!(g.errors, 0, "{}: {:?}", c.device, g.first_error);
        assert!(
            g.ios >= 512 && g.verified_bytes >= 512 * 4096,
            "{}: {g:?}",
            c.device
        );
        assert_eq!(c.report.gpu.queues, 2, "{}", c.device);
    }
    let ios: u64 = r.controllers.iter().map(|c| c.report.report.ios).sum();
    assert_eq!(
        (r.total.controllers, r.total.ios, r.total.errors),
        (2, ios, 0)
    );
    // A GPU-resident model per controller, each on SMs of its own, each namespace with its
    // own modelled drive; verified reads on both.
    // (4 SMs asked: the driver rounds up to its granularity, 8 on Hopper; on CPU threads 16
    // SMs are reported.)
    args.model = Some(MediaKind::Hbm);
    args.controller_sms = 4;
    args.ssd_model = Some(
        "read_us=20,iops=1M,bw=7GB/s"
            .parse::<SsdModel>()
            .expect("model"),
    );
    let r = run_several_gpu(&pairs, &names, &args).expect("the model on two controllers");
    for c in &r.controllers {
        let g = &c.report.report;
        assert_eq!(g.errors, 0, "{}: {:?}", c.device, g.first_error);
        assert!(g.ios >= 512 && g.verified_bytes >= 512 * 4096, "{g:?}");
        assert!(
            c.report.gpu.transport.contains("gpu-controller model"),
            "{}",
            c.report.gpu.transport
        );
    }
    // Too many partitions for the GPU's SMs: refused by name before anything starts.
    args.controller_sms = 100_000;
    let e = run_several_gpu(&pairs, &names, &args).expect_err("no SMs left for clients");
    assert!(format!("{e:#}").contains("SMs"), "{e:#}");
    for (c, _) in opened {
        c.shutdown().expect("shutdown");
    }
}

/// A file of a striped volume over three software controllers read into GPU memory by each
/// member's GPU queues at once (issue 23): the file's table cut per member, the range cut into
/// runs per member, one batch per member; whole and at odd offsets (the file ending first), the
/// bytes compared, every member's controller having served commands.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn volume_files_are_read_on_every_members_queues() {
    use blockfs::{BlockDevice, CreateOptions, FileSystem, MkfsOptions, StripedVolume};
    use blockfs_gpu::{GpuFilesOptions, VolumeFiles};
    let rigs: Vec<Rig> = (0..3).map(|_| rig(512, 2, 64)).collect();
    let members: Vec<Arc<dyn BlockDevice>> = rigs
        .iter()
        .map(|r| files::blockfs_dev(r) as Arc<dyn BlockDevice>)
        .collect();
    let volume = Arc::new(StripedVolume::create(members, 64 << 10, [23; 16]).expect("volume"));
    let fs = FileSystem::mkfs(volume.clone(), &MkfsOptions::default()).expect("mkfs");
    // Two files appended in turn: both fragmented, their extents crossing stripe units.
    let len = (3 << 20) + 1234;
    let (a, b) = (files::data(5, len), files::data(6, len));
    let fa = fs
        .create("v/a", &CreateOptions::default())
        .expect("create a");
    let fb = fs
        .create("v/b", &CreateOptions::default())
        .expect("create b");
    for at in (0..len).step_by(200_000) {
        let end = (at + 200_000).min(len);
        fa.write_at(at as u64, &a[at..end]).expect("write a");
        fb.write_at(at as u64, &b[at..end]).expect("write b");
    }
    fs.sync().expect("sync");
    let queues: Vec<&GpuQueues> = rigs.iter().map(|r| &r.gpu).collect();
    let vf = VolumeFiles::new(&queues, GpuFilesOptions::default());
    let file = vf.open(&volume, &fa).expect("open on the volume");
    assert_eq!(file.size(), len as u64);
    let before: Vec<u64> = rigs.iter().map(|r| r.emu().stats().reads).collect();
    let cuda = rigs[0].gpu.cuda().clone();
    for (offset, n) in [
        (0usize, len),
        (1, 100_000),
        (777_777, 1 << 20),
        (len - 999, 4096),
    ] {
        let dst = Arc::new(DeviceMemory::alloc(&cuda, n).expect("alloc"));
        let r = vf
            .read(&volume, &file, offset as u64, &dst, || None)
            .expect("volume read");
        let want = &a[offset..(offset + n).min(len)];
        assert_eq!(r.bytes, want.len() as u64, "offset {offset}");
        let mut got = vec![0u8; want.len()];
        dst.read(0, &mut got).expect("GPU memory read");
        assert!(got == want, "bytes at offset {offset}");
        if n >= 1 << 20 {
            assert_eq!(r.members, 3, "a long range spans every member");
        }
    }
    for (i, r) in rigs.iter().enumerate() {
        assert!(
            r.emu().stats().reads > before[i],
            "member {i} served commands"
        );
    }
    // One member's batch after the other (the default launches every member's batch before
    // waiting for any: the reads above).
    {
        let seq = VolumeFiles::new(&queues, GpuFilesOptions::default()).concurrent(false);
        let sfile = seq.open(&volume, &fa).expect("open");
        let dst = Arc::new(DeviceMemory::alloc(&cuda, len).expect("alloc"));
        let r = seq
            .read(&volume, &sfile, 0, &dst, || None)
            .expect("one-after-the-other read");
        let mut got = vec![0u8; len];
        dst.read(0, &mut got).expect("GPU memory read");
        assert!(
            r.bytes == len as u64 && r.members == 3 && got == a,
            "one after the other"
        );
    }
    // `fs get --gpu` on the volume: GPU queues of its own on every member, the GPU's CRC-32C
    // equal to the host's and the recorded one.
    let ctrls: Vec<&nvme::Controller> = rigs.iter().map(|r| &r.ctrl).collect();
    let backends: Vec<gpunvme::open::Backend> = rigs
        .iter()
        .map(|r| gpunvme::open::Backend::Software(r.emu().clone()))
        .collect();
    let b: Vec<&gpunvme::open::Backend> = backends.iter().collect();
    let opts = gpunvme::gpu_fs::GpuFsOptions {
        queues: Some(2),
        cpu_queues: 2,
        ..Default::default()
    };
    let rep = gpunvme::gpu_fs::get_volume(&ctrls, &b, &volume, &fs, "v/a", &opts)
        .expect("fs get --gpu on the volume");
    assert_eq!(rep.bytes, len as u64);
    assert_eq!(rep.gpu_crc32c, format!("{:08x}", crc32c::crc32c(&a)));
    assert_eq!(rep.members, Some(3));
    // `fs put --gpu` on the volume: the reservation cut per member, every window written on
    // its members' queues; the CPU reads the committed file back (the checksum recorded).
    let c = files::data(7, len);
    let src = std::env::temp_dir().join(format!("gpunvme-volume-put-{}", std::process::id()));
    std::fs::write(&src, &c).expect("source file");
    let wbefore: Vec<u64> = rigs.iter().map(|r| r.emu().stats().bytes_written).collect();
    let put = gpunvme::gpu_fs::put_volume(&ctrls, &b, &volume, &fs, &src, "v/put", false, &opts)
        .expect("fs put --gpu on the volume");
    std::fs::remove_file(&src).ok();
    assert!(put.verified && put.bytes == len as u64, "{put:?}");
    let back = fs
        .open("v/put", blockfs::OpenMode::ReadOnly)
        .expect("open the put file");
    let mut got = vec![0u8; len];
    assert_eq!(back.read_at(0, &mut got).expect("CPU read"), len);
    assert!(got == c, "the bytes the GPU wrote");
    for (i, r) in rigs.iter().enumerate() {
        assert!(
            r.emu().stats().bytes_written >= wbefore[i] + (len / 3 - (1 << 20)) as u64,
            "member {i} wrote its share"
        );
    }
}

/// A striped volume over two GPU-resident models (issue 23: files on several modelled
/// drives): one model per member, each on SMs of its own (one `ModelGroup`), started together;
/// `fs get --gpu` checked by the GPU's CRC-32C against the host's, `fs put --gpu` by a CPU
/// read-back after the models wrote their media back to the images.
#[test]
#[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
fn volume_files_on_gpu_resident_models() {
    use blockfs::{
        BlockDevice, CreateOptions, FileSystem, MkfsOptions, NvmeBlockDevice, NvmeDeviceOptions,
        OpenMode, StripedVolume,
    };
    use gpunvme::gpu::Serving;
    use gpunvme::gpu_fs::{GpuFsOptions, get_volume, put_volume};
    use gpunvme::open::Backend;
    let (_images, opened) = open_images(&["volume-a", "volume-b"], 8);
    let dev_opts = NvmeDeviceOptions {
        queues: 2,
        ..NvmeDeviceOptions::default()
    };
    let members: Vec<Arc<dyn BlockDevice>> = opened
        .iter()
        .map(|(c, _)| {
            Arc::new(NvmeBlockDevice::new(c, 1, &dev_opts).expect("member")) as Arc<dyn BlockDevice>
        })
        .collect();
    let volume = Arc::new(StripedVolume::create(members, 128 << 10, [29; 16]).expect("volume"));
    let fs = FileSystem::mkfs(volume.clone(), &MkfsOptions::default()).expect("mkfs");
    let len = (5 << 20) + 777;
    let a = files::data(11, len);
    let f = fs.create("m/a", &CreateOptions::default()).expect("create");
    f.write_at(0, &a).expect("write");
    drop(f);
    fs.sync().expect("sync");
    let ctrls: Vec<&Controller> = opened.iter().map(|(c, _)| c).collect();
    let b: Vec<&Backend> = opened.iter().map(|(_, b)| b).collect();
    // (4 SMs asked: the driver rounds up to its granularity, 8 on Hopper; on CPU threads 16
    // SMs are reported.)
    let gopts = GpuFsOptions {
        serving: Serving::Model(MediaKind::Hbm),
        queues: Some(4),
        cpu_queues: 2,
        controller_sms: 4,
        ..GpuFsOptions::default()
    };
    let rep = get_volume(&ctrls, &b, &volume, &fs, "m/a", &gopts)
        .expect("fs get --gpu on a volume of two models");
    assert_eq!(rep.bytes, len as u64);
    assert_eq!(rep.gpu_crc32c, format!("{:08x}", crc32c::crc32c(&a)));
    assert_eq!(rep.members, Some(2));
    assert!(rep.transport.contains("model"), "{}", rep.transport);
    let c = files::data(12, len);
    let src = std::env::temp_dir().join(format!("gpunvme-model-put-{}", std::process::id()));
    std::fs::write(&src, &c).expect("source file");
    let put = put_volume(&ctrls, &b, &volume, &fs, &src, "m/put", false, &gopts);
    std::fs::remove_file(&src).ok();
    let put = put.expect("fs put --gpu on a volume of two models");
    assert!(put.verified && put.bytes == len as u64, "{put:?}");
    let back = fs
        .open("m/put", OpenMode::ReadOnly)
        .expect("open the put file");
    let mut got = vec![0u8; len];
    assert_eq!(back.read_at(0, &mut got).expect("CPU read"), len);
    assert!(got == c, "the bytes the models wrote, read by the CPU");
    drop((back, fs, volume));
    for (c, _) in opened {
        c.shutdown().expect("shutdown");
    }
}

// ---------------------------------------------------------------------------------------------
// Embedders' GPU calls (gpunvme::handle, which the Python package and the C ABI call): file
// bytes read into GPU memory the GPU queues did not allocate, and files written from it.

mod embed {
    use super::*;
    use blockfs::{FileSystem, NvmeBlockDevice, NvmeDeviceOptions};
    use gpunvme::error::ErrorKind;
    use gpunvme::gpu::Serving;
    use gpunvme::gpu_fs::{self, GpuFsOptions};
    use gpunvme::gpu_io::{self, Piece, ReadPath};
    use gpunvme::handle::{DeviceHandle, SaveTensor};
    use gpunvme::open::{self, DeviceSpec, OpenOptions};
    use gpunvme::safetensors::{Dtype, TensorToWrite};

    fn gpu_bytes(m: &DeviceMemory, n: usize) -> Vec<u8> {
        let mut v = vec![0u8; n];
        m.read(0, &mut v).expect("GPU memory read");
        v
    }

    fn kind(r: gpunvme::Result<impl std::fmt::Debug>) -> ErrorKind {
        r.expect_err("an error").kind()
    }

    /// Reads straight into memory allocated elsewhere (whole file, an odd offset with the file
    /// ending first, refusals), saves host and GPU pieces as one file (checksum recorded, an
    /// existing name refused, then replaced with force), saves tensors as a .safetensors file
    /// that loads back byte for byte, keeps the GPU queues between calls; then the staged read
    /// path (transports that cannot map such memory) on the same file.
    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn foreign_gpu_memory_reads_and_writes_files() {
        let path = image("embed");
        let opts = OpenOptions {
            lba_size: 4096,
            controller_threads: 2,
            controller_queue_pairs: 8,
            ..OpenOptions::default()
        };
        let spec = path.to_str().expect("UTF-8 path").to_owned();
        let dev = DeviceHandle::open(Some(&spec), opts.clone(), 1).expect("open");
        dev.mkfs(4096, true, None).expect("mkfs");
        let data = files::data(7, (3 << 20) + 123);
        let host = path.with_extension("src");
        std::fs::write(&host, &data).expect("host file");
        dev.put(&host, "m/data", false).expect("put");
        let _ = std::fs::remove_file(&host);
        let cuda = Cuda::open(0).expect("GPU");
        let d = Serving::Device;

        let dst = Arc::new(DeviceMemory::alloc(&cuda, data.len()).expect("alloc"));
        let r = dev
            .read_into("m/data", 0, dst.clone(), d, None)
            .expect("read_into");
        assert_eq!(r.bytes, data.len() as u64);
        assert!(!r.staged, "{}", r.data_path);
        assert!(gpu_bytes(&dst, data.len()) == data, "whole file");
        assert!(dev.gpu_kept(), "the queues stay up for the next call");
        let q = dev.gpu_queues().expect("queues for the caller's kernels");
        assert!(q.count >= 1 && q.depth.is_power_of_two(), "{q:?}");
        assert_eq!((q.nsid, q.lba_size), (1, 4096));
        let mapped = dev.gpu_map(dst.clone()).expect("map");
        assert!(
            mapped.bus() != 0 && mapped.len() == data.len(),
            "{mapped:?}"
        );
        drop(mapped);
        let gf = dev
            .gpu_file("m/data")
            .expect("the file's table for kernels");
        assert!(gf.size() == data.len() as u64 && gf.table_ptr() != 0 && !gf.is_writable());
        assert_eq!(kind(dev.gpu_file("m/none")), ErrorKind::NotFound);
        drop(gf);

        let tail = Arc::new(DeviceMemory::alloc(&cuda, 1 << 20).expect("alloc"));
        let off = data.len() - 5003;
        let r = dev.read_into("m/data", off as u64, tail.clone(), d, None);
        assert_eq!(r.expect("short read").bytes, 5003);
        assert!(
            gpu_bytes(&tail, 5003) == data[off..],
            "the file's last bytes"
        );
        let past = data.len() as u64 + 1;
        let e = kind(dev.read_into("m/data", past, tail.clone(), d, None));
        assert_eq!(e, ErrorKind::InvalidArgument);
        let e = kind(dev.read_into("m/none", 0, tail.clone(), d, None));
        assert_eq!(e, ErrorKind::NotFound);

        let pieces = vec![Piece::Host(b"head".to_vec()), Piece::Gpu(dst.clone())];
        let w = dev.save("m/saved", pieces, false, d, None).expect("save");
        let mut want = b"head".to_vec();
        want.extend_from_slice(&data);
        assert_eq!(w.bytes, want.len() as u64);
        assert_eq!(w.crc32c, Some(format!("{:08x}", crc32c::crc32c(&want))));
        let mut back = vec![0u8; want.len() + 10];
        assert_eq!(
            dev.read_at("m/saved", 0, &mut back).expect("read"),
            want.len()
        );
        assert!(
            back[..want.len()] == want[..],
            "saved bytes read back by the CPU"
        );
        let fsck = dev.fsck(false, true).expect("fsck");
        assert!(
            fsck.consistent && fsck.mismatched.is_empty(),
            "{}",
            fsck.json
        );
        let one = || vec![Piece::Host(b"x".to_vec())];
        assert_eq!(
            kind(dev.save("m/saved", one(), false, d, None)),
            ErrorKind::Exists
        );
        dev.save("m/saved", one(), true, d, None).expect("replace");
        let mut b = [0u8; 4];
        assert_eq!(dev.read_at("m/saved", 0, &mut b).expect("read"), 1);
        assert_eq!(b[0], b'x');

        let a: Vec<u8> = (0..24u8).collect();
        let am = Arc::new(DeviceMemory::alloc(&cuda, a.len()).expect("alloc"));
        am.write(0, &a).expect("write");
        let bm = Arc::new(DeviceMemory::alloc(&cuda, 3).expect("alloc"));
        bm.write(0, &[7, 8, 9]).expect("write");
        let t = |name: &str, dtype, shape: Vec<u64>, bytes, mem| SaveTensor {
            info: TensorToWrite {
                name: name.into(),
                dtype,
                shape,
                bytes,
            },
            mem,
        };
        let meta = [("format".to_string(), "pt".to_string())].into();
        let tensors = vec![
            t("a", Dtype::F32, vec![2, 3], 24, Some(am.clone())),
            t("b", Dtype::I8, vec![3], 3, Some(bm.clone())),
            t("e", Dtype::F16, vec![0], 0, None),
        ];
        dev.save_safetensors("m/t.safetensors", tensors, &meta, false, d, None)
            .expect("save_safetensors");
        let (loaded, _) = dev
            .load_safetensors("m/t.safetensors", d, None)
            .expect("load back");
        let mut seen = 0;
        for p in &loaded.tensors {
            let mut v = vec![0u8; p.info.bytes() as usize];
            loaded.arena.read(p.offset as usize, &mut v).expect("arena");
            let want: &[u8] = match p.info.name.as_str() {
                "a" => &a,
                "b" => &[7, 8, 9],
                "e" => &[],
                other => panic!("unexpected tensor {other}"),
            };
            assert_eq!(v, want, "{}", p.info.name);
            seen += 1;
        }
        assert_eq!(seen, 3);
        // A tensor whose memory is not its shape's size: refused, nothing written.
        let bad = vec![t("a", Dtype::F32, vec![2, 4], 32, Some(am.clone()))];
        let e = kind(dev.save_safetensors("m/bad.safetensors", bad, &meta, false, d, None));
        assert_eq!(e, ErrorKind::InvalidArgument);
        assert!(dev.stat("m/bad.safetensors").is_err(), "nothing written");
        // The GPU-resident model maps such memory too (its windows are GPU pointers); an odd
        // length, so the mapping ends inside a page. Started for the call, stopped after it.
        let model = Serving::Model(MediaKind::Hbm);
        let whole = Arc::new(DeviceMemory::alloc(&cuda, 64 << 10).expect("alloc"));
        // Starting 512 bytes into a page, as a framework's small tensors do.
        #[allow(unsafe_code)]
        // SAFETY: bytes 512..10_513 of `whole`, an allocation the borrowed value keeps alive
        // (`keep`); nothing else frees it.
        let odd = unsafe {
            DeviceMemory::borrowed(&cuda, whole.ptr() + 512, 10_001, Box::new(whole.clone()))
        };
        let odd = Arc::new(odd.expect("borrow"));
        let r = dev.read_into("m/data", 3, odd.clone(), model, None);
        assert_eq!(r.expect("model read_into").bytes, 10_001);
        assert!(
            gpu_bytes(&odd, 10_001) == data[3..10_004],
            "bytes through the model"
        );
        assert!(!dev.gpu_kept(), "the model is not kept between calls");
        dev.release_gpu().expect("release");
        assert!(!dev.gpu_kept());
        drop(dev);

        // The staged path, on the same file.
        let spec = DeviceSpec::parse(Some(&spec)).expect("spec");
        let (ctrl, backend) = open::open_controller_and_transport(&spec, &opts).expect("open");
        let dev_opts = NvmeDeviceOptions::default();
        let blk = NvmeBlockDevice::new(&ctrl, 1, &dev_opts).expect("block device");
        let fs = FileSystem::mount(Arc::new(blk)).expect("mount");
        let gopts = GpuFsOptions {
            cpu_queues: dev_opts.queues as u16,
            ..GpuFsOptions::default()
        };
        let (_cuda, setup) = gpu_fs::setup(&ctrl, &backend, &gopts).expect("GPU queues");
        let staged = Arc::new(DeviceMemory::alloc(&cuda, data.len()).expect("alloc"));
        let r = gpu_io::read_into(&setup, &fs, "m/data", 0, &staged, ReadPath::Staged, || None)
            .expect("staged read");
        assert!(r.staged && r.bytes == data.len() as u64, "{r:?}");
        assert!(gpu_bytes(&staged, data.len()) == data, "staged bytes");
        gpu_fs::teardown(setup).expect("teardown");
    }
}

// ---------------------------------------------------------------------------------------------
// The page cache (gpu_queues::cache, ptx/include/gpunvme_cache.cuh): elements of an LBA range
// read through a cache in GPU memory, on the software controller. The data is the perf pattern,
// whose every 8-byte word encodes its LBA, so a stale or wrong frame shows.

mod cache {
    use super::*;
    use gpu_queues::cache::{CacheOptions, CacheStats, DataPath, GpuCache};

    /// Elements (8-byte words) per 4 KiB page.
    const PER_PAGE: u64 = 512;

    /// The pattern word of element `i` of a range that starts at LBA 0.
    fn expected(lba_size: u32, i: u64) -> u64 {
        word_of(SEED, lba_size, i)
    }

    fn cache_of(r: &Rig, frames: u64, full_wait: Option<Duration>) -> GpuCache<'_> {
        GpuCache::new(
            &r.gpu,
            CacheOptions {
                page_size: 4096,
                capacity: frames * 4096,
                full_wait,
                ..Default::default()
            },
        )
        .expect("cache")
    }

    /// A cache over the first `pages` 4 KiB pages of namespace 1, prefilled with the pattern.
    fn cached_range(r: &Rig, pages: u64, frames: u64, full_wait: Option<Duration>) -> GpuCache<'_> {
        let blocks = pages * 4096 / r.lba as u64;
        cpu_prefill(r, blocks);
        let mut c = cache_of(r, frames, full_wait);
        let id = c.bind_lba_range(1, r.lba, 0, blocks, false).expect("bind");
        assert_eq!(id.index(), 0);
        c
    }

    /// Runs `gpunvme_cache_test`: `threads` threads (whole warps launched) each read `per`
    /// elements, thread t the indices `idx[t * per..]`; returns each value and status.
    fn read_elements(
        r: &Rig,
        c: &GpuCache<'_>,
        warp: bool,
        threads: u32,
        per: u32,
        idx: &[u64],
    ) -> (Vec<u64>, Vec<DeviceStatus>) {
        access_elements(r, c, warp as u32, threads, per, idx, None)
    }

    /// Stores `vals` at `idx` (as `read_elements` reads); returns each status.
    fn store_elements(
        r: &Rig,
        c: &GpuCache<'_>,
        warp: bool,
        threads: u32,
        per: u32,
        idx: &[u64],
        vals: &[u64],
    ) -> Vec<DeviceStatus> {
        access_elements(r, c, warp as u32 | 2, threads, per, idx, Some(vals)).1
    }

    fn access_elements(
        r: &Rig,
        c: &GpuCache<'_>,
        flags: u32,
        threads: u32,
        per: u32,
        idx: &[u64],
        stores: Option<&[u64]>,
    ) -> (Vec<u64>, Vec<DeviceStatus>) {
        let (v, st) = access_elements_raw(r, c, flags, threads, per, idx, stores);
        (v, st.into_iter().map(DeviceStatus::from_code).collect())
    }

    /// `access_elements` with each status word as the kernel wrote it.
    fn access_elements_raw(
        r: &Rig,
        c: &GpuCache<'_>,
        flags: u32,
        threads: u32,
        per: u32,
        idx: &[u64],
        stores: Option<&[u64]>,
    ) -> (Vec<u64>, Vec<u32>) {
        let n = threads as usize * per as usize;
        assert_eq!(idx.len(), n);
        let cuda = r.gpu.cuda();
        let idx_mem = DeviceMemory::alloc(cuda, n * 8).unwrap();
        idx_mem.write(0, idx.as_bytes()).unwrap();
        let values = DeviceMemory::alloc(cuda, n * 8).unwrap();
        if let Some(v) = stores {
            values.write(0, v.as_bytes()).unwrap();
        }
        let statuses = DeviceMemory::alloc(cuda, n * 4).unwrap();
        let block = threads.next_multiple_of(32).min(128);
        let grid = threads.div_ceil(block);
        let s = r.gpu.client_stream();
        s.launch(
            r.gpu.kernels().cache_test,
            grid,
            block,
            &[
                Arg::U64(c.descriptor()),
                Arg::U32(0),
                Arg::U32(flags),
                Arg::U32(per),
                Arg::U64(threads as u64),
                Arg::U64(idx_mem.ptr()),
                Arg::U64(values.ptr()),
                Arg::U64(statuses.ptr()),
            ],
        )
        .unwrap();
        s.wait_idle(Duration::from_secs(300))
            .expect("cache kernel ends");
        let mut v = vec![0u64; n];
        values.read(0, v.as_mut_bytes()).unwrap();
        let mut st = vec![0u32; n];
        statuses.read(0, st.as_mut_bytes()).unwrap();
        (v, st)
    }

    fn assert_values(r: &Rig, idx: &[u64], v: &[u64], st: &[DeviceStatus]) {
        for (k, (&i, (&got, &s))) in idx.iter().zip(v.iter().zip(st)).enumerate() {
            assert_eq!(s, DeviceStatus::Ok, "access {k} (element {i})");
            assert_eq!(got, expected(r.lba, i), "access {k}: element {i}");
        }
    }

    fn invariants(c: &GpuCache<'_>) {
        if let Err(e) = c.check_invariants() {
            panic!("cache invariants: {e}");
        }
    }

    fn seeded(seed: u64, n: usize, below: u64) -> Vec<u64> {
        let mut x = seed | 1;
        (0..n)
            .map(|_| {
                x ^= x << 13;
                x ^= x >> 7;
                x ^= x << 17;
                x % below
            })
            .collect()
    }

    fn stats(c: &GpuCache<'_>) -> CacheStats {
        c.stats().expect("cache statistics")
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn concurrent_readers_of_one_page_issue_one_command() {
        let r = rig(512, 2, 64);
        let c = cached_range(&r, 64, 16, None);
        let before = r.emu().stats();
        // 256 threads in 8 warps, every lane on page 5: one lookup per warp, one fill in all.
        let idx: Vec<u64> = (0..256)
            .map(|t| 5 * PER_PAGE + (t * 7) % PER_PAGE)
            .collect();
        let (v, st) = read_elements(&r, &c, true, 256, 1, &idx);
        assert_values(&r, &idx, &v, &st);
        let s = stats(&c);
        assert_eq!((s.counters.misses, s.counters.read_cmds), (1, 1), "{s:?}");
        // Every access is a hit, a wait for another warp's fill, or one of the filling warp's.
        assert_eq!(s.counters.hits + s.counters.waits + 32, 256, "{s:?}");
        assert_eq!(
            r.emu().stats().reads - before.reads,
            1,
            "the controller saw one read"
        );
        invariants(&c);
        // Alone (thread variant), on pages 5 (cached) and 9 (not): one more command.
        let idx: Vec<u64> = (0..128)
            .map(|t| [5, 9][t as usize % 2] * PER_PAGE + t)
            .collect();
        let (v, st) = read_elements(&r, &c, false, 128, 1, &idx);
        assert_values(&r, &idx, &v, &st);
        let s = stats(&c);
        assert_eq!(
            (s.counters.misses, s.counters.read_cmds, s.counters.errors),
            (2, 2, 0),
            "{s:?}"
        );
        assert_eq!(r.emu().stats().reads - before.reads, 2);
        invariants(&c);
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn eviction_under_pressure_keeps_every_value() {
        let r = rig(512, 2, 64);
        // 256 pages through 8 frames: threads alone (each holds one page at a time), then
        // warps whose 32 lanes want up to 32 pages each (fills run in rounds: a fill without a
        // frame is given back while the warp releases what it read, so no warp holds pages
        // while it looks for frames).
        for (warp, seed) in [(false, 0x5eed), (true, 0xbeef)] {
            let c = cached_range(&r, 256, 8, None);
            let idx = seeded(seed, 64 * 32, 256 * PER_PAGE);
            let (v, st) = read_elements(&r, &c, warp, 64, 32, &idx);
            assert_values(&r, &idx, &v, &st);
            let s = stats(&c).counters;
            assert!(s.evictions > 0 && s.misses >= 256 - 8, "warp {warp}: {s:?}");
            assert_eq!((s.errors, s.full), (0, 0), "warp {warp}: {s:?}");
            invariants(&c);
        }
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn media_error_reaches_every_waiter() {
        let r = rig(512, 2, 64);
        let c = cached_range(&r, 64, 16, None);
        // Page 3 is LBAs 24..32.
        r.emu().faults().add_media_error(1, 27);
        let before = r.emu().stats();
        // 8 warps; half-warps alternate between pages 3 and 4.
        let idx: Vec<u64> = (0..256u64)
            .map(|t| [3, 4][(t / 16) as usize % 2] * PER_PAGE + t)
            .collect();
        let (v, st) = read_elements(&r, &c, true, 256, 1, &idx);
        for (k, &i) in idx.iter().enumerate() {
            if i / PER_PAGE == 3 {
                assert_eq!(st[k], DeviceStatus::NvmeError, "access {k}");
            } else {
                assert_eq!(st[k], DeviceStatus::Ok, "access {k}");
                assert_eq!(v[k], expected(r.lba, i), "access {k}");
            }
        }
        let s = stats(&c);
        let failed = r.emu().stats().errors - before.errors;
        assert!(
            failed >= 1 && s.counters.errors == failed,
            "{s:?}: {failed} failed reads"
        );
        assert_eq!(s.counters.misses, 1, "page 4 filled once: {s:?}");
        let f = s.first_failure.expect("first failure recorded");
        assert_eq!((f.status, f.range, f.page), (DeviceStatus::NvmeError, 0, 3));
        assert_eq!(
            (f.nvme_status >> 9) & 7,
            2,
            "SCT media error: {:#x}",
            f.nvme_status
        );
        invariants(&c);
        // The error is not cached: once the fault is gone, page 3 reads.
        r.emu().faults().clear_media_errors();
        let idx: Vec<u64> = (0..64).map(|t| 3 * PER_PAGE + t).collect();
        let (v, st) = read_elements(&r, &c, true, 64, 1, &idx);
        assert_values(&r, &idx, &v, &st);
        invariants(&c);
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn dropped_completion_returns_to_every_waiter() {
        let r = rig_with(
            512,
            |_| {},
            GpuQueueOptions {
                queues: Some(1),
                depth: Some(64),
                timeout: Duration::from_secs(2),
                ..Default::default()
            },
        );
        let c = cached_range(&r, 16, 16, None);
        r.emu().faults().drop_completions(nvme_emu::DROP_ALL);
        let idx: Vec<u64> = (0..64u64).map(|t| (t % 4) * PER_PAGE + t).collect();
        let start = Instant::now();
        let (_, st) = read_elements(&r, &c, true, 64, 1, &idx);
        let took = start.elapsed();
        r.emu().faults().drop_completions(0);
        assert!(took < Duration::from_secs(60), "bounded: {took:?}");
        assert!(
            st.iter().all(|s| matches!(
                s,
                DeviceStatus::Timeout | DeviceStatus::QueueFailed | DeviceStatus::Aborted
            )),
            "{st:?}"
        );
        let s = stats(&c);
        assert!(
            s.quarantined >= 1,
            "a frame a late DMA may hit is never reused: {s:?}"
        );
        assert_eq!(s.counters.misses, 0, "{s:?}");
        invariants(&c);
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn all_referenced_returns_cache_full() {
        let r = rig(512, 2, 64);
        let c = cached_range(&r, 16, 4, Some(Duration::from_secs(1)));
        let cuda = r.gpu.cuda();
        let pages = DeviceMemory::alloc(cuda, 5 * 8).unwrap();
        pages.write(0, [0u64, 1, 2, 3, 4].as_bytes()).unwrap();
        let words = DeviceMemory::alloc(cuda, 8).unwrap();
        let statuses = DeviceMemory::alloc(cuda, 5 * 4).unwrap();
        let s = r.gpu.client_stream();
        // Warps 0-3 pin pages 0-3 (every frame); warp 4 asks for page 4.
        s.launch(
            r.gpu.kernels().cache_pin_test,
            1,
            160,
            &[
                Arg::U64(c.descriptor()),
                Arg::U32(0),
                Arg::U64(pages.ptr()),
                Arg::U32(4),
                Arg::U64(words.ptr()),
                Arg::U64(statuses.ptr()),
                Arg::U64(60_000_000_000),
            ],
        )
        .unwrap();
        s.wait_idle(Duration::from_secs(300))
            .expect("pin kernel ends");
        let mut st = [0u32; 5];
        statuses.read(0, st.as_mut_bytes()).unwrap();
        let st = st.map(DeviceStatus::from_code);
        assert_eq!(
            st,
            [
                DeviceStatus::Ok,
                DeviceStatus::Ok,
                DeviceStatus::Ok,
                DeviceStatus::Ok,
                DeviceStatus::CacheFull
            ]
        );
        let stats = stats(&c);
        assert_eq!(
            (stats.counters.full, stats.counters.misses),
            (1, 4),
            "{stats:?}"
        );
        invariants(&c);
        // Nothing is held any more: page 4 reads.
        let idx: Vec<u64> = (0..32).map(|t| 4 * PER_PAGE + t).collect();
        let (v, st) = read_elements(&r, &c, true, 32, 1, &idx);
        assert_values(&r, &idx, &v, &st);
        invariants(&c);
    }

    /// The pattern word of element `i` under `seed` (a range from LBA 0).
    fn word_of(seed: u64, lba_size: u32, i: u64) -> u64 {
        let byte = i * 8;
        gpu_queues::pattern::word(
            seed,
            1,
            byte / lba_size as u64,
            ((byte % lba_size as u64) / 8) as usize,
        )
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn dirty_pages_reach_the_device_after_flush() {
        const SEED2: u64 = 0x5eed_0002;
        for warp in [true, false] {
            let r = rig(512, 2, 64);
            let blocks = 64 * 4096 / r.lba as u64;
            cpu_prefill(&r, blocks);
            let mut c = cache_of(&r, 8, None);
            c.bind_lba_range(1, r.lba, 0, blocks, true).expect("bind");
            let flushes = r.emu().stats().flushes;
            // Every element of 64 pages through 8 frames: lanes of a warp on consecutive
            // elements, so pages are written back as they are evicted.
            let n = 64 * PER_PAGE;
            let idx: Vec<u64> = (0..n).map(|k| (k % 512) * 64 + k / 512).collect();
            let vals: Vec<u64> = idx.iter().map(|&i| word_of(SEED2, r.lba, i)).collect();
            let st = store_elements(&r, &c, warp, 64, 512, &idx, &vals);
            assert!(
                st.iter().all(|&s| s == DeviceStatus::Ok),
                "warp {warp}: {st:?}"
            );
            invariants(&c);
            let dirty = c.dirty_pages().unwrap();
            assert!(
                (1..=8).contains(&dirty),
                "the last pages stored are dirty: {dirty}"
            );
            // Read your writes through the cache, from frames and from pages written back
            // (which also writes back the dirty ones as their frames are reused).
            let (v, st) = read_elements(&r, &c, warp, 64, 512, &idx);
            assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "warp {warp}");
            assert!(v == vals, "warp {warp}: loads after stores");
            // Four pages stored again stay in the cache, dirty, until the flush.
            const SEED3: u64 = 0x5eed_0003;
            let idx3: Vec<u64> = (0..4 * PER_PAGE).collect();
            let vals3: Vec<u64> = idx3.iter().map(|&i| word_of(SEED3, r.lba, i)).collect();
            let st = store_elements(&r, &c, warp, 64, 32, &idx3, &vals3);
            assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "warp {warp}");
            assert_eq!(c.dirty_pages().unwrap(), 4);
            let report = c.flush().expect("flush");
            assert_eq!(c.dirty_pages().unwrap(), 0);
            assert_eq!((report.pages_written, report.flush_cmds), (4, 1));
            let s = stats(&c).counters;
            assert!(
                s.writebacks >= 64 && s.write_cmds >= 64,
                "warp {warp}: {s:?}"
            );
            assert_eq!(s.errors, 0, "{s:?}");
            assert_eq!(r.emu().stats().flushes - flushes, 1, "one NVMe Flush");
            // What the GPU stored, a CPU queue reads.
            let mut want = vec![0u8; (blocks * r.lba as u64) as usize];
            gpu_queues::pattern::fill(&mut want, SEED2, 1, 0, r.lba as usize);
            gpu_queues::pattern::fill(&mut want[..4 * 4096], SEED3, 1, 0, r.lba as usize);
            assert!(
                cpu_read(&r, 0, blocks) == want,
                "warp {warp}: device bytes after flush"
            );
            invariants(&c);
        }
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn bounce_data_path_moves_pages_through_slot_buffers() {
        // The BOUNCE data path (transports whose GPU memory is fixed at set-up), chosen on the
        // software controller: 16 KiB pages through 4 KiB slot buffers (four commands a page),
        // reads under eviction, stores written back on eviction and by flush, and the bytes a
        // CPU queue then reads from the device.
        const SEED2: u64 = 0x5eed_0004;
        let r = rig_with(
            512,
            |_| {},
            GpuQueueOptions {
                queues: Some(2),
                depth: Some(64),
                slot_buffer_bytes: Some(4096),
                ..Default::default()
            },
        );
        let (page, pages) = (16384u64, 32u64);
        let blocks = pages * page / r.lba as u64;
        cpu_prefill(&r, blocks);
        let mut c = GpuCache::new(
            &r.gpu,
            CacheOptions {
                page_size: page as u32,
                capacity: 8 * page,
                data_path: DataPath::Bounce,
                ..Default::default()
            },
        )
        .expect("cache");
        assert_eq!(c.data_path(), DataPath::Bounce);
        c.bind_lba_range(1, r.lba, 0, blocks, true).expect("bind");
        let n = pages * page / 8;
        for warp in [true, false] {
            let idx = seeded(0xb0b + warp as u64, 64 * 32, n);
            let (v, st) = read_elements(&r, &c, warp, 64, 32, &idx);
            assert_values(&r, &idx, &v, &st);
        }
        let s = stats(&c).counters;
        assert!(s.evictions > 0, "{s:?}");
        assert_eq!(
            s.read_cmds,
            4 * s.misses,
            "four 4 KiB commands a page: {s:?}"
        );
        invariants(&c);
        // Every element stored (a warp's lanes on consecutive elements), then flushed.
        let per = (n / 64) as u32;
        let idx: Vec<u64> = (0..n)
            .map(|k| (k % per as u64) * 64 + k / per as u64)
            .collect();
        let vals: Vec<u64> = idx.iter().map(|&i| word_of(SEED2, r.lba, i)).collect();
        let st = store_elements(&r, &c, true, 64, per, &idx, &vals);
        assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "{st:?}");
        let report = c.flush().expect("flush");
        assert!(report.pages_written > 0, "{report:?}");
        assert_eq!(c.dirty_pages().unwrap(), 0);
        let s = stats(&c).counters;
        assert!(s.writebacks >= pages, "{s:?}");
        assert_eq!(
            s.write_cmds,
            4 * s.writebacks,
            "four 4 KiB commands a page: {s:?}"
        );
        assert_eq!(s.errors, 0, "{s:?}");
        let mut want = vec![0u8; (blocks * r.lba as u64) as usize];
        gpu_queues::pattern::fill(&mut want, SEED2, 1, 0, r.lba as usize);
        assert!(cpu_read(&r, 0, blocks) == want, "device bytes after flush");
        invariants(&c);
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn stores_to_a_read_only_range_are_refused() {
        let r = rig(512, 2, 64);
        let c = cached_range(&r, 16, 8, None);
        let idx: Vec<u64> = (0..64).map(|t| t * 3).collect();
        for warp in [true, false] {
            let st = store_elements(&r, &c, warp, 64, 1, &idx, &idx);
            assert!(st.iter().all(|&s| s == DeviceStatus::OutOfExtent), "{st:?}");
        }
        assert_eq!(c.dirty_pages().unwrap(), 0);
        let (v, st) = read_elements(&r, &c, true, 64, 1, &idx);
        assert_values(&r, &idx, &v, &st);
        assert_eq!(c.flush().expect("flush").pages_written, 0);
    }

    /// Little-endian u64 element `i` of `bytes`.
    fn le_word(bytes: &[u8], i: u64) -> u64 {
        let at = i as usize * 8;
        u64::from_le_bytes(bytes[at..at + 8].try_into().expect("8 bytes"))
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn file_ranges_read_and_write_through_the_extent_table() {
        use blockfs::{CreateOptions, FileSystem, MkfsOptions, OpenMode};
        use blockfs_gpu::{GpuFiles, GpuFilesOptions, cache::bind_file};
        for lba in [512u32, 4096] {
            let r = rig(lba, 2, 64);
            let fs = FileSystem::mkfs(super::files::blockfs_dev(&r), &MkfsOptions::default())
                .expect("mkfs");
            // A fragmented file whose length is not a multiple of the LBA size, in 16 KiB
            // pages (extents are 4 KiB blocks, so pages span them) through 8 frames.
            let len = 1_200_000 + 24;
            let want = super::files::fragmented(&fs, len);
            let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            let files = GpuFiles::new(&r.gpu, GpuFilesOptions::default());
            let g = files.open(&file).expect("open for the GPU");
            assert!(g.table().extents().len() > 3, "fragmented");
            let out = CacheOptions {
                page_size: 16384,
                capacity: 8 * 16384,
                ..Default::default()
            };
            let mut c = GpuCache::new(&r.gpu, out.clone()).expect("cache");
            let id = bind_file(&mut c, &g).expect("bind");
            assert_eq!((id.index(), c.range(id).unwrap().bytes), (0, len as u64));
            drop(g); // the cache keeps the table (and the pin) alive
            let n = len as u64 / 8;
            let mut idx = seeded(lba as u64, 128 * 8, n);
            idx[7] = n - 1; // the last element, in the partial last LBA
            for warp in [true, false] {
                let (v, st) = read_elements(&r, &c, warp, 128, 8, &idx);
                for (k, &i) in idx.iter().enumerate() {
                    assert_eq!(
                        st[k],
                        DeviceStatus::Ok,
                        "lba {lba} warp {warp}: element {i}"
                    );
                    assert_eq!(
                        v[k],
                        le_word(&want, i),
                        "lba {lba} warp {warp}: element {i}"
                    );
                }
            }
            let (_, st) = read_elements(&r, &c, false, 1, 1, &[n]);
            assert_eq!(st[0], DeviceStatus::OutOfExtent, "past the end");
            let k = stats(&c).counters;
            assert!(k.misses > 8 && k.evictions > 0, "{k:?}");
            assert!(k.read_cmds > k.misses, "some pages span extents: {k:?}");
            invariants(&c);
            drop(c);

            // A reservation through the cache: stores, close (write-back + NVMe Flush),
            // commit, and the CPU reads them after a remount.
            let f = fs
                .create("dir/new", &CreateOptions { size_hint: 0 })
                .expect("create");
            let new_len = 200_000u64 + 40;
            let g = files.reserve(&f, new_len).expect("reserve");
            let mut c = GpuCache::new(&r.gpu, out.clone()).expect("cache");
            let id = bind_file(&mut c, &g).expect("bind a reservation");
            let bytes = c.range(id).unwrap().bytes;
            assert!(bytes >= new_len);
            let idx: Vec<u64> = (0..new_len / 8).step_by(13).collect();
            let n = idx.len() as u64 / 64 * 64;
            let idx = &idx[..n as usize];
            let vals: Vec<u64> = idx.iter().map(|&i| word_of(99, lba, i)).collect();
            let st = store_elements(&r, &c, true, 64, (n / 64) as u32, idx, &vals);
            assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "stores");
            let report = c.close().expect("close");
            assert!(
                report.pages_written > 0 && report.flush_cmds == 1,
                "{report:?}"
            );
            g.commit(new_len).expect("commit after the cache let go");
            fs.sync().expect("sync");
            drop((f, file));
            fs.unmount().expect("unmount");
            let fs = FileSystem::mount(super::files::blockfs_dev(&r)).expect("remount");
            let back_file = fs.open("dir/new", OpenMode::ReadOnly).expect("open");
            let mut back = vec![0u8; new_len as usize];
            back_file.read_at(0, &mut back).expect("CPU read");
            for (&i, &v) in idx.iter().zip(&vals) {
                assert_eq!(le_word(&back, i), v, "lba {lba}: element {i} after remount");
            }
        }
    }

    /// A cache over a striped volume of three software controllers (issue 23): a fragmented
    /// file's pages (16 KiB, through 8 frames, so with evictions) filled from every member,
    /// each piece on its member's queues at its member LBA (the volume's layout); and a
    /// writable volume LBA range whose stores, after `flush`, are where the layout puts them on
    /// each member (read back through the volume and through each member).
    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn volume_pages_are_filled_from_every_member() {
        use blockfs::{
            BlockDevice, FileSystem, MkfsOptions, OpenMode, ReadReq, StripedVolume, WriteReq,
        };
        use blockfs_gpu::volume::{bind_volume_file, volume_geometry};
        use blockfs_gpu::{GpuFilesOptions, VolumeFiles};
        let rigs: Vec<Rig> = (0..3).map(|_| rig(512, 2, 64)).collect();
        let members: Vec<Arc<dyn BlockDevice>> = rigs
            .iter()
            .map(|r| super::files::blockfs_dev(r) as Arc<dyn BlockDevice>)
            .collect();
        let queues: Vec<&GpuQueues> = rigs.iter().map(|r| &r.gpu).collect();
        let opts = CacheOptions {
            page_size: 16384,
            capacity: 8 * 16384,
            ..Default::default()
        };
        {
            let volume = Arc::new(
                StripedVolume::create(members.clone(), 64 << 10, [31; 16]).expect("volume"),
            );
            let fs = FileSystem::mkfs(volume.clone(), &MkfsOptions::default()).expect("mkfs");
            let len = 1_200_000 + 24;
            let want = super::files::fragmented(&fs, len);
            let file = fs.open("dir/a", OpenMode::ReadOnly).expect("open");
            let vf = VolumeFiles::new(&queues, GpuFilesOptions::default());
            let vfile = vf.open(&volume, &file).expect("open on the volume");
            let geometry = volume_geometry(&volume).expect("geometry");
            assert_eq!(geometry.nsids, vec![1, 1, 1]);
            let mut c = GpuCache::on_volume(&queues, &geometry, opts.clone()).expect("cache");
            assert_eq!(c.volume_members(), Some((3, 2)));
            // A cache over one controller refuses a volume's file.
            {
                let mut one = GpuCache::new(&rigs[0].gpu, opts.clone()).expect("cache");
                let e = bind_volume_file(&mut one, &vf, &volume, &vfile).expect_err("one member");
                assert!(format!("{e}").contains("over that volume"), "{e}");
            }
            let id = bind_volume_file(&mut c, &vf, &volume, &vfile).expect("bind");
            assert_eq!(c.range(id).unwrap().bytes, len as u64);
            // The same file through a BOUNCE cache: every member's fills through its own
            // queues' slot buffers.
            let mut bounce = GpuCache::on_volume(
                &queues,
                &geometry,
                CacheOptions {
                    data_path: DataPath::Bounce,
                    ..opts.clone()
                },
            )
            .expect("BOUNCE cache");
            assert_eq!(bounce.data_path(), DataPath::Bounce);
            bind_volume_file(&mut bounce, &vf, &volume, &vfile).expect("bind");
            drop(vfile); // the caches keep the table and the pin
            let n = len as u64 / 8;
            let mut idx = seeded(77, 128 * 8, n);
            idx[5] = n - 1;
            for (cache, name) in [(&c, "DIRECT"), (&bounce, "BOUNCE")] {
                let before: Vec<u64> = rigs.iter().map(|r| r.emu().stats().reads).collect();
                for warp in [true, false] {
                    let (v, st) = read_elements(&rigs[0], cache, warp, 128, 8, &idx);
                    for (k, &i) in idx.iter().enumerate() {
                        assert_eq!(st[k], DeviceStatus::Ok, "{name}, warp {warp}: element {i}");
                        assert_eq!(v[k], le_word(&want, i), "{name}, warp {warp}: element {i}");
                    }
                }
                let k = stats(cache).counters;
                assert!(k.misses > 8 && k.evictions > 0, "{name}: {k:?}");
                for (m, r) in rigs.iter().enumerate() {
                    assert!(
                        r.emu().stats().reads > before[m],
                        "{name}: member {m} served fills"
                    );
                }
                invariants(cache);
            }
            drop(c);
            drop(bounce);
            drop(file);
            fs.unmount().expect("unmount");
        }
        // A writable range of volume LBAs (no file system: a fresh volume), 3 stripe units of
        // 8 KiB per member and a partial one; stores, flush, then the bytes where the layout
        // puts them.
        let volume = StripedVolume::create(members.clone(), 8 << 10, [32; 16]).expect("volume");
        let blocks = 3 * 3 * 16 + 5;
        let old: Vec<u8> = (0..blocks * 512).map(|i| (i * 7 + 3) as u8).collect();
        volume
            .write(&[WriteReq { lba: 0, buf: &old }])
            .expect("CPU write through the volume");
        let geometry = volume_geometry(&volume).expect("geometry");
        let mut c = GpuCache::on_volume(
            &queues,
            &geometry,
            CacheOptions {
                page_size: 4096,
                capacity: 4 * 4096,
                ..Default::default()
            },
        )
        .expect("cache");
        let id = c
            .bind_lba_range(1, 512, 0, blocks as u64, true)
            .expect("bind");
        assert_eq!(id.index(), 0);
        let words = (blocks * 512 / 8) as u64;
        let idx: Vec<u64> = (0..words).step_by(3).take(64 * 8).collect();
        let (v, st) = read_elements(&rigs[0], &c, true, 64, 8, &idx);
        for (k, &i) in idx.iter().enumerate() {
            assert_eq!(st[k], DeviceStatus::Ok, "element {i}");
            assert_eq!(v[k], le_word(&old, i), "element {i} before the stores");
        }
        let vals: Vec<u64> = idx.iter().map(|&i| i ^ 0x5eed_0000_0000).collect();
        let st = store_elements(&rigs[0], &c, true, 64, 8, &idx, &vals);
        assert!(st.iter().all(|&s| s == DeviceStatus::Ok), "stores");
        let report = c.close().expect("flush");
        assert!(
            report.pages_written > 0 && report.flush_cmds == 3,
            "{report:?}"
        );
        let mut want = old.clone();
        for (&i, &v) in idx.iter().zip(&vals) {
            want[i as usize * 8..i as usize * 8 + 8].copy_from_slice(&v.to_le_bytes());
        }
        let mut back = vec![0u8; blocks * 512];
        volume
            .read(&mut [ReadReq {
                lba: 0,
                buf: &mut back,
            }])
            .expect("CPU read through the volume");
        assert!(back == want, "the stores, read back through the volume");
        // Each member holds its units at the layout's LBAs.
        for lba in (0..blocks as u64).step_by(7) {
            let (m, mlba) = volume.locate(lba);
            let mut one = vec![0u8; 512];
            members[m]
                .read(&mut [ReadReq {
                    lba: mlba,
                    buf: &mut one,
                }])
                .expect("member read");
            let at = lba as usize * 512;
            assert!(
                one == want[at..at + 512],
                "volume LBA {lba} on member {m} at {mlba}"
            );
        }
    }

    /// Writes `bytes` (padded to whole LBAs) at `lba` through a CPU queue; returns the LBAs.
    fn cpu_write(r: &Rig, lba: u64, bytes: &[u8]) -> u64 {
        let mut buf = bytes.to_vec();
        buf.resize(bytes.len().next_multiple_of(r.lba as usize), 0);
        let mut q = r.ctrl.create_io_queue_pair(64).expect("CPU queue");
        q.write_from(1, lba, &buf).expect("CPU write");
        (buf.len() / r.lba as usize) as u64
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn bfs_and_gather_through_the_cache_match_the_cpu() {
        use crate::workloads::graph::{BfsDirection, BfsOptions, BfsSplit};
        use crate::workloads::{Source, embedding, graph};
        let r = rig(512, 2, 64);
        // A graph of 36 KiB and a table of 32 KiB through 4 frames of 4 KiB.
        let g = graph::rmat(9, 8, 11).expect("graph");
        let off_blocks = cpu_write(&r, 0, g.offsets.as_bytes());
        let col_lba = off_blocks.next_multiple_of(8);
        let col_blocks = cpu_write(&r, col_lba, g.cols.as_bytes());
        let (rows, dim) = (256u64, 32u32);
        let mut table = vec![0u8; (rows * dim as u64 * 4) as usize];
        embedding::table_bytes(SEED, 0, &mut table);
        let table_lba = (col_lba + col_blocks).next_multiple_of(8);
        let table_blocks = cpu_write(&r, table_lba, &table);
        let mut c = cache_of(&r, 4, None);
        let ranges = [
            c.bind_lba_range(1, 512, 0, off_blocks, false).unwrap(),
            c.bind_lba_range(1, 512, col_lba, col_blocks, false)
                .unwrap(),
            c.bind_lba_range(1, 512, table_lba, table_blocks, false)
                .unwrap(),
        ];
        let root = graph::root(&g, 3);
        let want = graph::cpu_bfs(&g, root);
        // Small dynamic runs: many draws of the shared counter, each block's barriers met; odd
        // levels take them from the top down.
        let through_cache = |direction| {
            graph::gpu_bfs(
                &r.gpu,
                Source::Cache(&c, &ranges[..2]),
                g.vertices(),
                root,
                BfsOptions {
                    split: BfsSplit::Dynamic(64),
                    hub_segment: Some(16),
                    alternate: true,
                    direction,
                },
            )
            .expect("BFS through the cache")
        };
        let run = through_cache(BfsDirection::TopDown);
        assert_eq!(graph::first_mismatch(&run.levels, &want), None, "levels");
        assert!(run.depth > 2 && run.reached > 400, "{run:?}");
        assert_eq!(run.level_secs.len(), run.depth as usize, "{run:?}");
        assert!(!run.bottom_up.contains(&true), "{run:?}");
        // Pieces of 16 neighbours: the graph's hubs went to the second kernel.
        assert!(run.hub_pieces > 0, "{run:?}");
        // Direction-optimising: some levels bottom-up, through the cache, same levels.
        let opt = through_cache(BfsDirection::Optimizing);
        assert_eq!(graph::first_mismatch(&opt.levels, &want), None, "{opt:?}");
        assert!(opt.bottom_up.contains(&true), "{opt:?}");
        assert!(!opt.bottom_up[0], "{opt:?}");
        let k = stats(&c).counters;
        assert!(k.evictions > 0, "the graph does not fit: {k:?}");
        invariants(&c);
        // The same kernel over plain GPU memory.
        let cuda = r.gpu.cuda();
        let po = DeviceMemory::alloc(cuda, g.offsets.len() * 8).unwrap();
        po.write(0, g.offsets.as_bytes()).unwrap();
        let pc = DeviceMemory::alloc(cuda, g.cols.len() * 4).unwrap();
        pc.write(0, g.cols.as_bytes()).unwrap();
        // The same kernel over plain GPU memory, with either split and either sweep (runs of 96
        // do not divide the vertex count: the partial run comes first going down).
        assert_ne!(g.vertices() % 96, 0);
        for (split, hub_segment, alternate, direction) in [
            (BfsSplit::Static, None, false, BfsDirection::TopDown),
            (BfsSplit::Dynamic(96), Some(8), true, BfsDirection::TopDown),
            (BfsSplit::Dynamic(32), None, false, BfsDirection::TopDown),
            (BfsSplit::Static, Some(8), false, BfsDirection::Optimizing),
            (BfsSplit::Dynamic(96), None, true, BfsDirection::Optimizing),
        ] {
            let opts = BfsOptions {
                split,
                hub_segment,
                alternate,
                direction,
            };
            let plain = graph::gpu_bfs(
                &r.gpu,
                Source::Plain(&[po.ptr(), pc.ptr()]),
                g.vertices(),
                root,
                opts,
            )
            .expect("BFS over GPU memory");
            assert_eq!(plain.levels, want, "{opts:?}");
        }
        // Embedding rows, Zipf-distributed, through the cache.
        let idx = embedding::zipf_indices(rows, 200, 0.99, 5).unwrap();
        let got = embedding::gpu_gather(&r.gpu, Source::Cache(&c, &ranges[2..]), dim, &idx)
            .expect("gather");
        assert_eq!(embedding::first_mismatch(&got.out, &idx, dim, SEED), None);
        invariants(&c);
        // A wrong seed must not pass the check.
        assert!(embedding::first_mismatch(&got.out, &idx, dim, SEED + 1).is_some());
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn read_range_copies_runs_of_every_shape() {
        use crate::workloads::{Source, embedding};
        // Warp-wide read_range of rows of `dim` 4-byte words: rows that are not whole 16-byte
        // words and straddle pages (37 words), rows of a page and a bit (1100), rows of 36 KiB
        // (9000: runs of 9 or 10 pages), and whole pages (1024). Each table through 8 frames
        // of 4 KiB (misses, waits and evictions mid-run), then through a cache that holds it,
        // where a second gather is all hits (every batch on the fast path).
        let r = rig(512, 2, 64);
        let mut lba = 0u64;
        for (dim, rows) in [(37u32, 2000u64), (1100, 64), (9000, 12), (1024, 80)] {
            // Whole 4 KiB blocks of the table's pattern (its rows end inside the last).
            let bytes = (rows * dim as u64 * 4).next_multiple_of(4096);
            let mut table = vec![0u8; bytes as usize];
            embedding::table_bytes(SEED, 0, &mut table);
            let blocks = cpu_write(&r, lba, &table);
            let idx = embedding::zipf_indices(rows, 300, 0.5, dim as u64).unwrap();
            for frames in [8, bytes / 4096] {
                let mut c = cache_of(&r, frames, None);
                let range = c.bind_lba_range(1, 512, lba, blocks, false).unwrap();
                let gather = || {
                    let got = embedding::gpu_gather(&r.gpu, Source::Cache(&c, &[range]), dim, &idx)
                        .expect("gather through the cache");
                    assert_eq!(
                        embedding::first_mismatch(&got.out, &idx, dim, SEED),
                        None,
                        "rows of {dim} words through {frames} frames"
                    );
                };
                gather();
                let before = stats(&c).counters;
                if frames == 8 {
                    assert!(before.evictions > 0, "rows of {dim} words: {before:?}");
                } else {
                    gather();
                    let after = stats(&c).counters;
                    assert_eq!(
                        after.misses, before.misses,
                        "rows of {dim} words: {after:?}"
                    );
                    assert!(after.hits > before.hits, "rows of {dim} words: {after:?}");
                }
                invariants(&c);
            }
            lba = (lba + blocks).next_multiple_of(8);
        }
    }

    /// One launch of `kernel` (a block of 64 threads) with the arguments `args(out)` makes,
    /// `out` 16 zeroed bytes of GPU memory the kernel adds (sum, failures) into: those two.
    fn bench_sums(r: &Rig, kernel: Kernel, args: impl FnOnce(u64) -> Vec<Arg>) -> (u64, u64) {
        let out = DeviceMemory::alloc(r.gpu.cuda(), 16).unwrap();
        out.write(0, &[0u8; 16]).unwrap();
        let s = r.gpu.client_stream();
        s.launch(kernel, 1, 64, &args(out.ptr())).unwrap();
        s.wait_idle(compute_wait_bound() * 5)
            .expect("benchmark kernel ends");
        let mut o = [0u64; 2];
        out.read(0, o.as_mut_bytes()).unwrap();
        (o[0], o[1])
    }

    /// One launch of `gpunvme_cache_bench` (through `c`, or from `plain`): (sum, failures).
    fn bench_sum(
        r: &Rig,
        c: Option<&GpuCache<'_>>,
        plain: Option<&DeviceMemory>,
        mode: u32,
        elem: u32,
        n: u64,
    ) -> (u64, u64) {
        let scratch = DeviceMemory::alloc(r.gpu.cuda(), 2 * 65536).unwrap();
        bench_sums(r, r.gpu.kernels().cache_bench, |out| {
            let mut args = bench_args(c, plain, mode, elem, n, 16);
            args.extend([Arg::U64(SEED), Arg::U64(scratch.ptr()), Arg::U64(out)]);
            args
        })
    }

    /// The arguments both benchmark kernels begin with: (cache, range 0, plain, mode,
    /// elem_bytes, n, iters).
    fn bench_args(
        c: Option<&GpuCache<'_>>,
        plain: Option<&DeviceMemory>,
        mode: u32,
        elem: u32,
        n: u64,
        iters: u64,
    ) -> Vec<Arg> {
        vec![
            Arg::U64(c.map_or(0, |c| c.descriptor())),
            Arg::U32(0),
            Arg::U64(plain.map_or(0, |p| p.ptr())),
            Arg::U32(mode),
            Arg::U32(elem),
            Arg::U64(n),
            Arg::U64(iters),
        ]
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn benchmark_kernel_reads_what_a_plain_buffer_holds() {
        // 64 pages through 8 frames: random elements (4 and 8 bytes) and warp-wide read_range
        // of 4 KiB and of 64 KiB runs (16 pages, twice the frames: batches end at the first page
        // that is not a hit), each sum equal to the same kernel's over a plain copy of the bytes.
        let r = rig(512, 2, 64);
        let c = cached_range(&r, 64, 8, None);
        let plain = DeviceMemory::alloc(r.gpu.cuda(), 64 * 4096).unwrap();
        plain
            .write(0, &pattern(0, 64 * 4096 / r.lba as u64, r.lba))
            .unwrap();
        for (mode, elem) in [(0, 4), (0, 8), (2, 4), (2, 8), (3, 4), (3, 8)] {
            let n = 64 * 4096 / elem as u64;
            let cached = bench_sum(&r, Some(&c), None, mode, elem, n);
            let direct = bench_sum(&r, None, Some(&plain), mode, elem, n);
            assert_eq!(cached, direct, "mode {mode}, {elem}-byte elements");
            assert_ne!(direct.0, 0);
            invariants(&c);
        }
        assert!(stats(&c).counters.evictions > 0);
        // The scan benchmark: each warp 600 x 32 consecutive elements (19-38 pages through the
        // 8 frames), by array::load and by an array_cursor, against the plain buffer.
        for elem in [4, 8] {
            let n = 64 * 4096 / elem as u64;
            let direct = scan_sum(&r, None, Some(&plain), false, elem, n);
            assert_ne!(direct.0, 0);
            for cursor in [false, true] {
                let cached = scan_sum(&r, Some(&c), None, cursor, elem, n);
                assert_eq!(
                    cached, direct,
                    "scan, cursor {cursor}, {elem}-byte elements"
                );
                invariants(&c); // the cursors gave every page back
            }
        }
    }

    /// One launch of `gpunvme_cache_bench_scan` (2 warps of 600 loads each), through `c` (with
    /// an array_cursor when `cursor`) or from `plain`: (sum, failures).
    fn scan_sum(
        r: &Rig,
        c: Option<&GpuCache<'_>>,
        plain: Option<&DeviceMemory>,
        cursor: bool,
        elem: u32,
        n: u64,
    ) -> (u64, u64) {
        bench_sums(r, r.gpu.kernels().cache_bench_scan, |out| {
            let mut args = bench_args(c, plain, cursor as u32, elem, n, 600);
            args.push(Arg::U64(out));
            args
        })
    }

    /// Warps scanning through `array_cursor`s (flag 4 of `gpunvme_cache_test`): an aligned
    /// scan, one whose lanes straddle page boundaries (two pages held at once), one that jumps
    /// half-way, one with 5 inactive lanes and an index past the range every 7th load; 64 pages
    /// through 8 frames. Every value and status checked, every page given back at the end, and
    /// one lookup per page a warp enters, not one per load.
    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn cursor_scans_keep_their_pages_between_loads() {
        let r = rig(512, 2, 64);
        let c = cached_range(&r, 64, 8, None);
        let n = 64 * PER_PAGE;
        let (threads, per) = (123u32, 64u32);
        let mut idx = vec![0u64; 128 * per as usize];
        for t in 0..128u64 {
            let (w, l) = (t / 32, t % 32);
            for j in 0..per as u64 {
                let e = match w {
                    0 => j * 32 + l,
                    1 => 700 + j * 32 + l,
                    2 if j < 32 => 4992 + j * 32 + l,
                    2 => 19968 + j * 32 + l,
                    _ if l == 3 && j % 7 == 0 => n + 5,
                    _ => 8992 + j * 32 + l,
                };
                idx[(t * per as u64 + j) as usize] = e;
            }
        }
        let idx = &idx[..(threads * per) as usize];
        let (v, raw) = access_elements_raw(&r, &c, 1 | 4, threads, per, idx, None);
        for (k, (&i, (&got, &word))) in idx.iter().zip(v.iter().zip(&raw)).enumerate() {
            let s = DeviceStatus::from_code(word & 0xffff);
            if i >= n {
                assert_eq!(s, DeviceStatus::OutOfExtent, "access {k} (element {i})");
            } else {
                assert_eq!(s, DeviceStatus::Ok, "access {k} (element {i})");
                assert_eq!(got, expected(r.lba, i), "access {k}: element {i}");
            }
            // After each load the warp holds exactly the distinct pages its lanes read.
            let (t, j) = (k / per as usize, k % per as usize);
            let warp = t / 32 * 32..(t / 32 * 32 + 32).min(threads as usize);
            let mut pages: Vec<u64> = warp
                .map(|u| idx[u * per as usize + j])
                .filter(|&e| e < n)
                .map(|e| e / PER_PAGE)
                .collect();
            pages.sort_unstable();
            pages.dedup();
            assert_eq!(word >> 16, pages.len() as u32, "access {k}: pages held");
        }
        invariants(&c); // and none after the kernel
        let s = stats(&c);
        assert_eq!((s.counters.errors, s.counters.full), (0, 0), "{s:?}");
        // Every load that did not fill or wait was a hit (reused ones counted on release), and
        // the warps filled about the 17 pages they entered.
        let served = raw.iter().filter(|&&w| w & 0xffff == 0).count() as u64;
        assert!(s.counters.misses <= 24, "{s:?}");
        assert!(
            s.counters.hits + s.counters.waits + 32 * s.counters.misses >= served,
            "{s:?}"
        );
    }

    /// The cache at GPU scale on `r`: 8192 threads reading random elements of the whole 64 MiB
    /// namespace through 1024 frames (mostly misses), the same alone, then a hot set that fits
    /// (mostly hits); every value checked.
    fn at_scale(r: &Rig) {
        let pages = NS_BYTES / 4096;
        let mut c = cache_of(r, 1024, None);
        c.bind_lba_range(1, r.lba, 0, NS_BYTES / r.lba as u64, false)
            .expect("bind");
        let (threads, per) = (8192u32, 64u32);
        let n = (threads * per) as usize;
        let idx = seeded(0x5ca1e, n, pages * PER_PAGE);
        let (v, st) = read_elements(r, &c, true, threads, per, &idx);
        assert_values(r, &idx, &v, &st);
        let s = stats(&c);
        assert_eq!(
            (s.counters.errors, s.counters.full, s.quarantined),
            (0, 0, 0),
            "{s:?}"
        );
        assert!(
            s.counters.misses > n as u64 / 2 && s.counters.evictions > 0,
            "{s:?}"
        );
        invariants(&c);
        let idx = seeded(0x5ca1f, 2048 * 64, pages * PER_PAGE);
        let (v, st) = read_elements(r, &c, false, 2048, 64, &idx);
        assert_values(r, &idx, &v, &st);
        invariants(&c);
        // A hot set of 512 pages through 1024 frames: after its first touches, hits.
        c.reset_stats().unwrap();
        let idx = seeded(0x407, n, 512 * PER_PAGE);
        let (v, st) = read_elements(r, &c, true, threads, per, &idx);
        assert_values(r, &idx, &v, &st);
        let s = stats(&c);
        assert!(
            s.counters.misses <= 1024 && s.counters.hits >= n as u64 * 9 / 10,
            "{s:?}"
        );
        assert_eq!((s.counters.errors, s.counters.full), (0, 0), "{s:?}");
        invariants(&c);
        drop(c);
        // Stores: 524 k distinct random elements (an odd multiplier permutes the indices)
        // through 1024 frames by warps, flushed; a new cache then reads them back from the
        // device, and an element nobody stored still holds the old pattern.
        const SEED4: u64 = 0x5eed_0004;
        let elems = NS_BYTES / 8;
        let idx: Vec<u64> = (0..n as u64)
            .map(|k| k.wrapping_mul(0x9e37_79b1) & (elems - 1))
            .collect();
        let vals: Vec<u64> = idx.iter().map(|&i| word_of(SEED4, r.lba, i)).collect();
        let mut w = cache_of(r, 1024, None);
        w.bind_lba_range(1, r.lba, 0, NS_BYTES / r.lba as u64, true)
            .expect("bind");
        let st = store_elements(r, &w, true, threads, per, &idx, &vals);
        assert!(st.iter().all(|&s| s == DeviceStatus::Ok));
        let report = w.flush().expect("flush");
        let s = stats(&w);
        assert_eq!((s.counters.errors, s.counters.full), (0, 0), "{s:?}");
        assert!(
            s.counters.writebacks > n as u64 / 2 / 64,
            "{s:?} {report:?}"
        );
        invariants(&w);
        drop(w);
        let mut c = cache_of(r, 1024, None);
        c.bind_lba_range(1, r.lba, 0, NS_BYTES / r.lba as u64, false)
            .expect("bind");
        let (v, st) = read_elements(r, &c, true, threads, per, &idx);
        assert!(st.iter().all(|&s| s == DeviceStatus::Ok));
        assert!(v == vals, "stored elements read back through a new cache");
        let untouched = (0..elems)
            .find(|i| !idx.contains(i))
            .expect("an element nobody stored");
        let probe = vec![untouched; 32];
        let (v, st) = read_elements(r, &c, true, 32, 1, &probe);
        assert_values(r, &probe, &v, &st);
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn at_scale_on_the_software_controller() {
        let r = rig(512, 4, 256);
        cpu_prefill(&r, NS_BYTES / 512);
        at_scale(&r);
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/gpu-test.sh runs it on the GPU machine)"]
    fn at_scale_on_the_gpu_controller_model() {
        let path = image("cache-scale");
        let r = model_rig(&path, 512, MediaKind::Hbm, 8, 256);
        at_scale(&r);
        drop(r);
        let _ = std::fs::remove_file(&path);
    }
}

/// The same transfer shapes and wrap-around on SPDK's NVMe-oF target over vfio-user (transport
/// (c')): a controller gpunvme did not write. `scripts/spdk-gpu-test.sh` starts the target and
/// runs these with `GPUNVME_TEST_SPDK_DIR` set to its state directory (sockets
/// `DIR/NAME/cntrl`); `scripts/gpu-test.sh` leaves them to it.
mod spdk {
    use super::*;

    /// GPU queues over vfio-user on the target's controller `name` (malloc512, malloc4096).
    fn spdk_rig(name: &str, queues: u16, depth: u32) -> Rig {
        let dir = std::env::var_os("GPUNVME_TEST_SPDK_DIR").expect(
            "GPUNVME_TEST_SPDK_DIR names a running spdk-target.sh state directory \
             (scripts/spdk-gpu-test.sh sets it)",
        );
        let socket = std::path::Path::new(&dir).join(name).join("cntrl");
        let dev = vfio::VfioUserNvme::open(&socket, &vfio::VfioUserOptions::default())
            .expect("connecting to SPDK's target");
        let ctrl = Controller::new(dev.clone(), ControllerOptions::default()).expect("bring-up");
        let opts = GpuQueueOptions {
            queues: Some(queues),
            depth: Some(depth),
            ..Default::default()
        };
        let (gpu, _) = gpu_queues::transport::open_vfio_user(&cuda(), &ctrl, dev, &opts)
            .expect("GPU queues over vfio-user");
        let lba = ctrl.namespace(1).expect("namespace 1").lba_size;
        Rig {
            gpu,
            model: None,
            ctrl,
            emu: None,
            lba,
        }
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/spdk-gpu-test.sh runs it on the GPU machine)"]
    fn every_transfer_shape_on_spdk() {
        for (name, lba) in [("malloc512", 512), ("malloc4096", 4096)] {
            let r = spdk_rig(name, 2, 64);
            assert_eq!(r.lba, lba, "{name}'s block size");
            transfer_shapes(&r);
        }
    }

    #[test]
    #[ignore = "skipped: no GPU (scripts/spdk-gpu-test.sh runs it on the GPU machine)"]
    fn wrap_around_many_queues_on_spdk() {
        for (warp, depth) in [(false, 16u32), (true, 32)] {
            wrap_around(&spdk_rig("malloc512", 8, depth), warp, depth);
        }
    }
}
