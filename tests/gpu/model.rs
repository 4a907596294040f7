//! The GPU-resident controller model (`gpu_emu::resident`, ptx/emu/gpunvme_controller.cuh): the
//! same client code against a persistent controller kernel, behind the software controller's
//! admin queue (the rig is `model_rig` in main.rs): every transfer shape and the write-back,
//! the statuses the spec requires, a host thread as the client, the hostile modes, a
//! write-protected namespace, null media, and the refusal without free SMs.
//!
//! Its tests keep the names they had at the crate root, where the scripts select them
//! (`--exact NAME`): `root_tests!` in main.rs declares each as a test and calls the function
//! here. A `#[test]` written in this file is named `model::NAME` instead.

use super::*;

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

pub(super) fn model_moves_every_transfer_shape_and_writes_back() {
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

pub(super) fn model_fails_bad_commands_with_the_status_the_spec_requires() {
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
pub(super) fn model_serves_a_host_thread_client() {
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
pub(super) fn model_hostile_modes_catch_broken_clients() {
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

pub(super) fn model_refuses_changes_to_a_write_protected_namespace() {
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

pub(super) fn model_wraps_many_queues_with_both_clients_on_null_media() {
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

pub(super) fn model_without_free_sms_is_refused_not_hung() {
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
