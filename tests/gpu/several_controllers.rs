//! Several controllers at once (issue 23): `perf --gpu` over several, each controller its own
//! GPU queues and perf kernel side by side, one report each and the totals; files of striped
//! volumes read on every member's GPU queues, and volumes over several GPU-resident models.
//!
//! Its tests keep the names they had at the crate root, where the scripts select them
//! (`--exact NAME`): `root_tests!` in main.rs declares each as a test and calls the function
//! here. A `#[test]` written in this file is named `several_controllers::NAME` instead.

use super::*;

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
pub(super) fn several_controllers_run_perf_gpu_at_once() {
    use gpunvme_cli::perf::{RwMode, run_several_gpu};
    let (images, opened) = open_images(&["several-a", "several-b"], 4);
    let pairs: Vec<_> = opened.iter().map(|(c, b)| (c, b)).collect();
    let names: Vec<String> = images.iter().map(|p| p.display().to_string()).collect();
    let mut args = perf_args(RwMode::RandRead, 2, 512, true, None);
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
pub(super) fn volume_files_are_read_on_every_members_queues() {
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
pub(super) fn volume_files_on_gpu_resident_models() {
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
