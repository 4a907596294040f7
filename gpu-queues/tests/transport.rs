//! The real-SSD transports (vfio-p2p, host-memory) without the hardware: the GPU's IOMMU check
//! on fake sysfs trees, the BAR1 probes' order and reasons with fake devices, the selection
//! policy (never silent), the page touching of the BAR0 registration on plain mappings, and
//! clear errors without libcuda.
//! Nothing here registers memory with CUDA or maps anything for an SSD: that needs root, an SSD
//! under VFIO and a GPU on one machine.

use std::cell::Cell;
use std::fs;
use std::os::fd::OwnedFd;
use std::os::unix::fs::symlink;
use std::path::Path;

use gpu_queues::ffi::os::{Mapping, touch_offsets};
use gpu_queues::transport::bar1::{
    Bar1Env, Bar1Method, Bar1Unavailable, GPU_PAGE, GpuRange, probe_bar1,
};
use gpu_queues::transport::iommu::{GpuIommu, check_gpu_iommu};
use gpu_queues::transport::{Candidate, QueueLayout, select};
use gpu_queues::{GpuError, TransportKind};

const GPU: &str = "0000:3b:00.0";

/// A fake /sys with the GPU's device directory; `group`: its iommu_group link target group
/// and that group's `type` (None: no type file); `other_groups`: groups that exist anyway.
fn fake_sys(
    link: Option<u32>,
    group_type: Option<(u32, Option<&str>)>,
    other: &[u32],
) -> tempfile::TempDir {
    let root = tempfile::tempdir().unwrap();
    let dev = root.path().join("bus/pci/devices").join(GPU);
    fs::create_dir_all(&dev).unwrap();
    let groups = root.path().join("kernel/iommu_groups");
    for g in other {
        fs::create_dir_all(groups.join(g.to_string())).unwrap();
    }
    if let Some((g, ty)) = group_type {
        fs::create_dir_all(groups.join(g.to_string())).unwrap();
        if let Some(ty) = ty {
            fs::write(groups.join(g.to_string()).join("type"), format!("{ty}\n")).unwrap();
        }
    }
    if let Some(g) = link {
        symlink(
            format!("../../../../kernel/iommu_groups/{g}"),
            dev.join("iommu_group"),
        )
        .unwrap();
    }
    root
}

#[test]
fn iommu_identity_group_is_accepted() {
    let root = fake_sys(Some(7), Some((7, Some("identity"))), &[1, 2]);
    assert_eq!(
        check_gpu_iommu(root.path(), GPU).unwrap(),
        GpuIommu::Identity { group: 7 }
    );
}

#[test]
fn iommu_translated_group_is_refused_with_the_fix() {
    for ty in ["DMA", "DMA-FQ", "unmanaged", "blocked"] {
        let root = fake_sys(Some(7), Some((7, Some(ty))), &[]);
        let err = check_gpu_iommu(root.path(), GPU).unwrap_err();
        assert!(
            matches!(&err, GpuError::GpuIommuTranslated { group: 7, domain, .. } if domain == ty),
            "{ty}: {err:?}"
        );
        let msg = err.to_string();
        assert!(msg.contains("iommu=pt"), "{msg}");
        assert!(
            msg.contains("echo identity > /sys/kernel/iommu_groups/7/type"),
            "{msg}"
        );
        assert!(msg.contains(GPU), "{msg}");
    }
}

#[test]
fn no_iommu_at_all_is_accepted() {
    let root = fake_sys(None, None, &[]);
    assert_eq!(
        check_gpu_iommu(root.path(), GPU).unwrap(),
        GpuIommu::NoIommu
    );
}

#[test]
fn gpu_outside_every_group_is_accepted_as_such() {
    let root = fake_sys(None, None, &[3, 4]);
    assert_eq!(
        check_gpu_iommu(root.path(), GPU).unwrap(),
        GpuIommu::NotInGroup
    );
}

#[test]
fn link_to_a_missing_group_is_an_error() {
    let root = fake_sys(Some(9), None, &[3]);
    let err = check_gpu_iommu(root.path(), GPU).unwrap_err();
    assert!(matches!(err, GpuError::GpuIommuUnknown { .. }), "{err:?}");
    assert!(err.to_string().contains("group 9"), "{err}");
}

#[test]
fn group_without_type_file_is_an_error_naming_the_fix() {
    let root = fake_sys(Some(5), Some((5, None)), &[]);
    let err = check_gpu_iommu(root.path(), GPU).unwrap_err();
    assert!(matches!(err, GpuError::GpuIommuUnknown { .. }), "{err:?}");
    assert!(err.to_string().contains("iommu=pt"), "{err}");
}

#[test]
fn unknown_gpu_address_is_an_error() {
    let root = fake_sys(None, None, &[]);
    let err = check_gpu_iommu(root.path(), "0000:99:00.0").unwrap_err();
    assert!(matches!(err, GpuError::GpuIommuUnknown { .. }), "{err:?}");
    assert!(err.to_string().contains("does not exist"), "{err}");
}

/// GPU memory stand-in: an aligned address, a length, and a dma-buf export that counts calls.
struct FakeRange {
    len: usize,
    export: Box<dyn Fn() -> Result<OwnedFd, GpuError> + Send + Sync>,
    exports: std::sync::atomic::AtomicUsize,
}

impl GpuRange for FakeRange {
    fn gpu_ptr(&self) -> u64 {
        0x7f00_0000_0000
    }
    fn len(&self) -> usize {
        self.len
    }
    fn export_dma_buf(&self) -> Result<OwnedFd, GpuError> {
        self.exports
            .fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        (self.export)()
    }
}

fn range(export: impl Fn() -> Result<OwnedFd, GpuError> + Send + Sync + 'static) -> FakeRange {
    FakeRange {
        len: GPU_PAGE as usize,
        export: Box::new(export),
        exports: Default::default(),
    }
}

fn unsupported() -> Result<OwnedFd, GpuError> {
    Err(GpuError::Unsupported("dma-buf export (fake)".into()))
}

fn env(dev: &Path, sys: &Path, offset: Option<u64>) -> Bar1Env {
    Bar1Env {
        dev_root: dev.into(),
        sys_root: sys.into(),
        gpu: GPU.into(),
        resource1_offset: offset,
    }
}

fn file_of(dir: &Path, name: &str, len: u64, writable: bool) -> OwnedFd {
    let p = dir.join(name);
    fs::File::create(&p).unwrap().set_len(len).unwrap();
    fs::OpenOptions::new()
        .read(true)
        .write(writable)
        .open(&p)
        .unwrap()
        .into()
}

#[test]
fn bar1_probes_run_in_order_and_say_why() {
    let dev = tempfile::tempdir().unwrap();
    let sys = fake_sys(None, None, &[]);
    let r = range(unsupported);
    let f = probe_bar1(&env(dev.path(), sys.path(), None), &r).unwrap_err();
    let methods: Vec<_> = f.0.iter().map(|(m, _)| *m).collect();
    assert_eq!(
        methods,
        [
            Bar1Method::Gdrdrv,
            Bar1Method::SysfsResource1,
            Bar1Method::DmaBuf
        ]
    );
    assert!(
        matches!(&f.0[0].1, Bar1Unavailable::GdrdrvAbsent { path } if path.ends_with("gdrdrv"))
    );
    assert!(
        matches!(&f.0[1].1, Bar1Unavailable::Resource1Absent { path } if path.ends_with("resource1"))
    );
    assert!(matches!(&f.0[2].1, Bar1Unavailable::DmaBufExport { error } if error.contains("fake")));
    let text = f.to_string();
    assert!(text.contains("load gdrdrv"), "{text}");
    assert_eq!(r.exports.load(std::sync::atomic::Ordering::Relaxed), 1);
}

#[test]
fn gdrdrv_that_is_not_gdrdrv_fails_at_its_first_ioctl() {
    let dev = tempfile::tempdir().unwrap();
    fs::write(dev.path().join("gdrdrv"), b"").unwrap();
    let sys = fake_sys(None, None, &[]);
    let f = probe_bar1(&env(dev.path(), sys.path(), None), &range(unsupported)).unwrap_err();
    assert!(
        matches!(
            &f.0[0].1,
            Bar1Unavailable::GdrdrvCall {
                call: "GET_VERSION",
                ..
            }
        ),
        "{f}"
    );
}

#[test]
fn unaligned_range_is_refused_by_gdrdrv_probe() {
    let dev = tempfile::tempdir().unwrap();
    fs::write(dev.path().join("gdrdrv"), b"").unwrap();
    let sys = fake_sys(None, None, &[]);
    let mut r = range(unsupported);
    r.len = 4096;
    let f = probe_bar1(&env(dev.path(), sys.path(), None), &r).unwrap_err();
    assert!(
        matches!(&f.0[0].1, Bar1Unavailable::Unaligned { .. }),
        "{f}"
    );
}

#[test]
fn resource1_without_an_offset_says_so() {
    let dev = tempfile::tempdir().unwrap();
    let sys = fake_sys(None, None, &[]);
    let gpu_dir = sys.path().join("bus/pci/devices").join(GPU);
    drop(file_of(&gpu_dir, "resource1", 1 << 20, true));
    let f = probe_bar1(&env(dev.path(), sys.path(), None), &range(unsupported)).unwrap_err();
    assert!(
        matches!(&f.0[1].1, Bar1Unavailable::Resource1OffsetUnknown { bar1_bytes, .. } if *bar1_bytes == 1 << 20),
        "{f}"
    );
    assert!(f.to_string().contains("cannot be learned"), "{f}");
}

#[test]
fn resource1_with_an_offset_maps_and_stops_probing() {
    let dev = tempfile::tempdir().unwrap();
    let sys = fake_sys(None, None, &[]);
    let gpu_dir = sys.path().join("bus/pci/devices").join(GPU);
    drop(file_of(&gpu_dir, "resource1", 1 << 20, true));
    let r = range(unsupported);
    let m = probe_bar1(&env(dev.path(), sys.path(), Some(GPU_PAGE)), &r).unwrap();
    assert_eq!(m.method(), Bar1Method::SysfsResource1);
    assert_eq!(m.mapping().len(), GPU_PAGE as usize);
    assert_eq!(r.exports.load(std::sync::atomic::Ordering::Relaxed), 0);

    // The same range past BAR1's end.
    let f = probe_bar1(&env(dev.path(), sys.path(), Some(1 << 20)), &r).unwrap_err();
    assert!(
        matches!(&f.0[1].1, Bar1Unavailable::Resource1TooSmall { end, .. } if *end == (1 << 20) + GPU_PAGE),
        "{f}"
    );
}

#[test]
fn dma_buf_is_mmapped_when_it_can_be_and_refused_with_reason_when_not() {
    let dev = tempfile::tempdir().unwrap();
    let sys = fake_sys(None, None, &[]);
    let files = tempfile::tempdir().unwrap();
    let dir = files.path().to_path_buf();
    let ok = range(move || Ok(file_of(&dir, "buf", GPU_PAGE, true)));
    let m = probe_bar1(&env(dev.path(), sys.path(), None), &ok).unwrap();
    assert_eq!(m.method(), Bar1Method::DmaBuf);

    // A descriptor that cannot be mapped read-write (as the NVIDIA driver's dma-bufs were seen).
    let dir = files.path().to_path_buf();
    let ro = range(move || Ok(file_of(&dir, "ro", GPU_PAGE, false)));
    let f = probe_bar1(&env(dev.path(), sys.path(), None), &ro).unwrap_err();
    assert!(
        matches!(&f.0[2].1, Bar1Unavailable::DmaBufMmap { .. }),
        "{f}"
    );
}

#[test]
fn selection_takes_the_first_that_works_and_lists_every_skip() {
    let c_ran = Cell::new(false);
    let (v, choice) = select(vec![
        Candidate::Unavailable(TransportKind::SoftwareController, "not an emulator".into()),
        Candidate::Try(
            TransportKind::VfioP2p,
            Box::new(|| Err(GpuError::Unsupported("no BAR1 mapping".into()))),
        ),
        Candidate::Try(TransportKind::HostMemory, Box::new(|| Ok(42))),
        Candidate::Try(
            TransportKind::HostMemory,
            Box::new(|| {
                c_ran.set(true);
                Ok(0)
            }),
        ),
    ])
    .unwrap();
    assert_eq!(v, 42);
    assert!(!c_ran.get(), "a candidate after the chosen one ran");
    assert_eq!(choice.chosen, TransportKind::HostMemory);
    let kinds: Vec<_> = choice.skipped.iter().map(|s| s.kind).collect();
    assert_eq!(
        kinds,
        [TransportKind::SoftwareController, TransportKind::VfioP2p]
    );
    let shown = choice.to_string();
    assert!(shown.starts_with("host-memory"), "{shown}");
    assert!(
        shown.contains("software-controller: not an emulator"),
        "{shown}"
    );
    assert!(
        shown.contains("vfio-p2p: unsupported: no BAR1 mapping"),
        "{shown}"
    );
}

#[test]
fn selection_with_nothing_working_names_every_reason() {
    let err = select::<()>(vec![
        Candidate::Unavailable(TransportKind::SoftwareController, "not an emulator".into()),
        Candidate::Try(
            TransportKind::VfioP2p,
            Box::new(|| Err(GpuError::Unsupported("reason b".into()))),
        ),
        Candidate::Try(
            TransportKind::HostMemory,
            Box::new(|| Err(GpuError::Unsupported("reason c".into()))),
        ),
    ])
    .unwrap_err();
    let GpuError::NoTransport { skipped } = &err else {
        panic!("{err:?}")
    };
    assert_eq!(skipped.len(), 3);
    let msg = err.to_string();
    for want in [
        "software-controller: not an emulator",
        "vfio-p2p",
        "reason b",
        "host-memory",
        "reason c",
    ] {
        assert!(msg.contains(want), "{want} missing from {msg}");
    }
}

#[test]
fn the_first_transport_that_works_is_chosen_with_nothing_skipped() {
    let (_, choice) = select(vec![Candidate::Try(
        TransportKind::SoftwareController,
        Box::new(|| Ok(())),
    )])
    .unwrap();
    assert!(choice.skipped.is_empty());
    assert_eq!(choice.to_string(), "software-controller");
}

#[test]
fn touching_reads_one_word_of_every_page_partial_last_page_included() {
    assert_eq!(touch_offsets(0).count(), 0);
    assert_eq!(touch_offsets(1).collect::<Vec<_>>(), [0]);
    assert_eq!(touch_offsets(3 * 4096).collect::<Vec<_>>(), [0, 4096, 8192]);
    assert_eq!(
        touch_offsets(3 * 4096 + 4).collect::<Vec<_>>(),
        [0, 4096, 8192, 12288]
    );
    let m = Mapping::anonymous(16 * 4096 + 8).unwrap();
    assert_eq!(m.touch_pages(), 17);
}

#[test]
fn touching_faults_in_every_page_of_a_mapping() {
    // A shared file mapping of a sparse file: nothing resident until read, every page after.
    let dir = tempfile::tempdir().unwrap();
    let p = dir.path().join("bar");
    fs::File::create(&p).unwrap().set_len(32 * 4096).unwrap();
    let m = Mapping::file(&p, 0, 32 * 4096).unwrap();
    assert_eq!(
        m.resident_pages().unwrap(),
        0,
        "pages resident before touching"
    );
    assert_eq!(m.touch_pages(), 32);
    assert_eq!(m.resident_pages().unwrap(), 32);
}

#[test]
fn layouts_align_every_piece_and_fit_it() {
    for align in [4096usize, 64 << 10] {
        for (depth, slot) in [(2u32, 4096u32), (64, 131072), (1024, 4096), (1024, 524288)] {
            let l = QueueLayout::new(depth, slot, align);
            for off in [l.sq, l.cq, l.prp, l.bufs, l.len] {
                assert_eq!(off % align, 0, "{l:?}");
            }
            assert!(l.sq + depth as usize * 64 <= l.cq, "{l:?}");
            assert!(l.cq + depth as usize * 16 <= l.prp, "{l:?}");
            assert!(l.prp + depth as usize * 2 * 4096 <= l.bufs, "{l:?}");
            assert!(l.bufs + (depth * slot) as usize <= l.len, "{l:?}");
        }
    }
}

#[test]
fn transport_names_and_labels() {
    assert_eq!(
        TransportKind::SoftwareController.to_string(),
        "software-controller"
    );
    assert_eq!(TransportKind::VfioP2p.to_string(), "vfio-p2p");
    assert_eq!(TransportKind::HostMemory.to_string(), "host-memory");
}

#[test]
fn without_libcuda_gpu_work_is_a_clear_error() {
    if gpu_queues::cuda_present() {
        eprintln!("libcuda is present on this machine: the no-CUDA error path is not exercised");
        return;
    }
    let err = gpu_queues::Cuda::open(0).unwrap_err();
    assert!(matches!(err, GpuError::NoCuda { .. }), "{err:?}");
    assert!(err.to_string().contains("libcuda"), "{err}");
}
