//! Backends: image files (persistence, validation, flush) and the null backend.

mod common;

use common::*;
use nvme::Device;
use nvme_emu::{Backend, EmuConfig, EmuError, ImageReads, NamespaceConfig};
use nvme_spec::status::{StatusCodeType as Sct, generic};
use nvme_spec::{Command, NvmOpcode};

const READ: u8 = NvmOpcode::READ.0;
const WRITE: u8 = NvmOpcode::WRITE.0;

#[test]
fn image_persists_across_controllers() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    EmuConfig::create_image(&path, 1 << 20).unwrap();
    assert_eq!(std::fs::metadata(&path).unwrap().len(), 1 << 20);
    assert!(matches!(
        EmuConfig::create_image(&path, 1 << 20),
        Err(EmuError::CreateImage { .. })
    ));
    let data = pattern(8192, 5);
    {
        let config = EmuConfig::for_image(&path, 4096).unwrap();
        assert_eq!(config.namespaces[0].blocks, 256);
        let mut h = Host::enabled(config);
        assert!(h.dev.describe().contains("disk.img"));
        let mut q = h.create_io_pair(1, 8, 8);
        let buf = h.dev.alloc_dma(8192).unwrap();
        buf.write(0, &data);
        let c = q.run(
            &h.dev,
            &rw(
                WRITE,
                1,
                255 - 1,
                2,
                buf.device_address(0),
                buf.device_address(4096),
            ),
        );
        assert_ok(&c);
        assert_ok(&q.run(&h.dev, &Command::new(NvmOpcode::FLUSH.0, 0, 1)));
        assert_ok(&q.run(&h.dev, &Command::new(NvmOpcode::FLUSH.0, 0, 0xffff_ffff)));
        assert_status(
            &q.run(&h.dev, &Command::new(NvmOpcode::FLUSH.0, 0, 2)),
            Sct::GENERIC,
            generic::INVALID_NAMESPACE_OR_FORMAT,
        );
        assert_eq!(h.dev.stats().flushes, 2);
    }
    // The bytes are in the file, at the right offset.
    let bytes = std::fs::read(&path).unwrap();
    assert_eq!(&bytes[254 * 4096..], &data[..]);
    // A new controller over the same image reads them back, with 512-byte blocks this time.
    let mut h = Host::enabled(EmuConfig::for_image(&path, 512).unwrap());
    let mut q = h.create_io_pair(1, 8, 8);
    let out = h.dev.alloc_dma(8192).unwrap();
    let c = q.run(
        &h.dev,
        &rw(
            READ,
            1,
            254 * 8,
            16,
            out.device_address(0),
            out.device_address(4096),
        ),
    );
    assert_ok(&c);
    let mut back = vec![0u8; 8192];
    out.read(0, &mut back);
    assert_eq!(back, data);
}

#[test]
fn write_through_when_cache_disabled_and_fua() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("wt.img");
    EmuConfig::create_image(&path, 64 * 512).unwrap();
    let mut h = Host::enabled(EmuConfig::for_image(&path, 512).unwrap());
    let mut set = Command::new(nvme_spec::AdminOpcode::SET_FEATURES.0, 0, 0);
    set.cdw10 = 0x06;
    assert_ok(&h.admin(set));
    let mut q = h.create_io_pair(1, 8, 8);
    let buf = h.dev.alloc_dma(4096).unwrap();
    buf.write(0, &[0xab; 512]);
    let mut cmd = rw(WRITE, 1, 1, 1, buf.device_address(0), 0);
    cmd.cdw12 |= 1 << 30; // FUA
    assert_ok(&q.run(&h.dev, &cmd));
    let bytes = std::fs::read(&path).unwrap();
    assert!(bytes[512..1024].iter().all(|&b| b == 0xab));
}

#[test]
fn for_image_refuses_bad_files() {
    let dir = tempfile::tempdir().unwrap();
    let err = EmuConfig::for_image(dir.path(), 512).unwrap_err();
    assert!(matches!(err, EmuError::InvalidImage { .. }), "{err}");
    assert!(err.to_string().contains("directory"));

    let missing = dir.path().join("missing.img");
    assert!(matches!(
        EmuConfig::for_image(&missing, 512),
        Err(EmuError::OpenImage { .. })
    ));

    let empty = dir.path().join("empty.img");
    std::fs::write(&empty, b"").unwrap();
    let err = EmuConfig::for_image(&empty, 512).unwrap_err();
    assert!(err.to_string().contains("empty"), "{err}");

    let odd = dir.path().join("odd.img");
    std::fs::write(&odd, vec![7u8; 4096 + 512]).unwrap();
    let err = EmuConfig::for_image(&odd, 4096).unwrap_err();
    assert!(err.to_string().contains("not a multiple"), "{err}");
    // Checking did not modify the file.
    assert_eq!(std::fs::read(&odd).unwrap(), vec![7u8; 4096 + 512]);
    // ...but it is fine with 512-byte blocks.
    assert_eq!(
        EmuConfig::for_image(&odd, 512).unwrap().namespaces[0].blocks,
        9
    );

    assert!(matches!(
        EmuConfig::for_image(&odd, 1024),
        Err(EmuError::InvalidLbaSize { lba_size: 1024, .. })
    ));

    use std::os::unix::fs::PermissionsExt;
    let ro = dir.path().join("ro.img");
    std::fs::write(&ro, vec![0u8; 4096]).unwrap();
    std::fs::set_permissions(&ro, std::fs::Permissions::from_mode(0o444)).unwrap();
    // Root can open read-only files for writing; only check when the OS refuses.
    if std::fs::OpenOptions::new().write(true).open(&ro).is_err() {
        assert!(matches!(
            EmuConfig::for_image(&ro, 512),
            Err(EmuError::OpenImage { .. })
        ));
    }
}

#[test]
fn invalid_configs_are_refused() {
    let bad = |c: EmuConfig| {
        matches!(
            EmuDevice::start(c),
            Err(EmuError::InvalidConfig { .. } | EmuError::InvalidLbaSize { .. })
        )
    };
    use nvme_emu::EmuDevice;
    assert!(bad(EmuConfig {
        max_io_queue_pairs: 0,
        ..EmuConfig::default()
    }));
    assert!(bad(EmuConfig {
        mqes: 0,
        ..EmuConfig::default()
    }));
    assert!(bad(EmuConfig {
        serial: "x".repeat(21),
        ..EmuConfig::default()
    }));
    assert!(bad(EmuConfig {
        namespaces: vec![NamespaceConfig::memory(4096, 1000)],
        ..EmuConfig::default()
    }));
    assert!(bad(EmuConfig {
        namespaces: vec![NamespaceConfig::memory(0, 512)],
        ..EmuConfig::default()
    }));
    // A file namespace larger than its file.
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("small.img");
    EmuConfig::create_image(&path, 4096).unwrap();
    let config = EmuConfig {
        namespaces: vec![NamespaceConfig {
            backend: Backend::File(path),
            blocks: 16,
            lba_size: 512,
            read_only: false,
            format: nvme_emu::NsFormat::Plain,
        }],
        ..EmuConfig::default()
    };
    assert!(matches!(
        EmuDevice::start(config),
        Err(EmuError::InvalidImage { .. })
    ));
}

#[test]
fn null_backend_moves_no_data_but_checks_everything() {
    let config = EmuConfig {
        namespaces: vec![NamespaceConfig::null(1 << 30, 4096)],
        ..EmuConfig::default()
    };
    let mut h = Host::enabled(config);
    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(4096).unwrap();
    buf.write(0, &[0x5a; 4096]);
    assert_ok(&q.run(&h.dev, &rw(WRITE, 1, 7, 1, buf.device_address(0), 0)));
    buf.write(0, &[0xa5; 4096]);
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 7, 1, buf.device_address(0), 0)));
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back);
    assert!(
        back.iter().all(|&b| b == 0xa5),
        "a null read leaves the buffer alone"
    );
    assert_status(
        &q.run(&h.dev, &rw(READ, 1, 1 << 18, 1, buf.device_address(0), 0)),
        Sct::GENERIC,
        generic::LBA_OUT_OF_RANGE,
    );
    assert_status(
        &q.run(&h.dev, &rw(READ, 1, 0, 1, buf.device_address(0) + 1, 0)),
        Sct::GENERIC,
        generic::PRP_OFFSET_INVALID,
    );
    let list = h.dev.alloc_dma(4096).unwrap();
    // The list is walked even though no data moves: an entry with an offset is caught.
    list.write(0, &(buf.device_address(0) + 8).to_le_bytes());
    list.write(8, &0x4000u64.to_le_bytes());
    assert_status(
        &q.run(
            &h.dev,
            &rw(READ, 1, 0, 3, buf.device_address(0), list.device_address(0)),
        ),
        Sct::GENERIC,
        generic::PRP_OFFSET_INVALID,
    );
}

#[test]
fn one_writer_or_many_readers_per_image() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("disk.img");
    EmuConfig::create_image(&path, 1 << 20).unwrap();
    let writer = nvme_emu::EmuDevice::start(EmuConfig::for_image(&path, 512).unwrap()).unwrap();
    // A second controller, writable or not, is refused while the first runs, knowing this
    // process as the holder (when /proc/locks is there to tell) and saying it is open in this
    // process rather than naming our own pid.
    for config in [
        EmuConfig::for_image(&path, 512).unwrap(),
        EmuConfig::for_image_read_only(&path, 512).unwrap(),
    ] {
        let err = nvme_emu::EmuDevice::start(config).unwrap_err();
        match &err {
            EmuError::ImageBusy { holder, .. } => {
                if std::path::Path::new("/proc/locks").exists() {
                    assert_eq!(*holder, Some(std::process::id()), "{err}");
                    let msg = err.to_string();
                    assert!(msg.contains("is already open in this process"), "{msg}");
                    assert!(
                        !msg.contains(&format!("process {}", std::process::id())),
                        "{msg}"
                    );
                }
            }
            e => panic!("expected ImageBusy, got {e}"),
        }
    }
    drop(writer);
    // Readers share; a writer waits for all of them to go.
    let r1 =
        nvme_emu::EmuDevice::start(EmuConfig::for_image_read_only(&path, 512).unwrap()).unwrap();
    let r2 =
        nvme_emu::EmuDevice::start(EmuConfig::for_image_read_only(&path, 512).unwrap()).unwrap();
    assert!(matches!(
        nvme_emu::EmuDevice::start(EmuConfig::for_image(&path, 512).unwrap()),
        Err(EmuError::ImageBusy { .. })
    ));
    drop((r1, r2));
    nvme_emu::EmuDevice::start(EmuConfig::for_image(&path, 512).unwrap()).unwrap();
}

#[test]
fn image_reads_land_in_host_memory_through_every_prp_shape() {
    prp_shapes(ImageReads::Pread);
    prp_shapes(ImageReads::Mapped);
}

fn prp_shapes(reads: ImageReads) {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("shapes.img");
    let data = pattern(64 << 10, 9);
    std::fs::write(&path, &data).unwrap();
    let mut h = Host::enabled(EmuConfig {
        image_reads: reads,
        ..EmuConfig::for_image(&path, 512).unwrap()
    });
    let mut q = h.create_io_pair(1, 8, 8);
    let buf = h.dev.alloc_dma(5 * 4096).unwrap();
    let list = h.dev.alloc_dma(4096).unwrap();
    let page = |i: usize| buf.device_address(i * 4096);
    // PRP1 alone, at an offset inside its page.
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 3, 2, page(0) + 1024, 0)));
    let mut back = vec![0u8; 1024];
    buf.read(1024, &mut back);
    assert_eq!(back, data[3 * 512..5 * 512]);
    // PRP1 + PRP2: the second page out of order.
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 16, 16, page(1), page(4))));
    let mut back = vec![0u8; 4096];
    buf.read(4096, &mut back);
    assert_eq!(back, data[16 * 512..24 * 512]);
    buf.read(4 * 4096, &mut back);
    assert_eq!(back, data[24 * 512..32 * 512]);
    // A PRP list of discontiguous pages after a partial first page.
    let entries = [page(3), page(1), page(2)];
    list.write(
        0,
        &entries
            .iter()
            .flat_map(|e| e.to_le_bytes())
            .collect::<Vec<_>>(),
    );
    assert_ok(&q.run(
        &h.dev,
        &rw(READ, 1, 40, 24, page(0) + 3072, list.device_address(0)),
    ));
    let at = |buf_off: usize, len: usize, lba: usize| {
        let mut got = vec![0u8; len];
        buf.read(buf_off, &mut got);
        assert_eq!(got, data[lba * 512..lba * 512 + len], "at {buf_off:#x}");
    };
    at(3072, 1024, 40);
    at(3 * 4096, 4096, 42);
    at(4096, 4096, 50);
    at(2 * 4096, 4096 - 1024, 58);
    // A page nobody mapped: Data Transfer Error, not a crash or a stray write.
    assert_status(
        &q.run(&h.dev, &rw(READ, 1, 0, 8, 0x10, 0)),
        Sct::GENERIC,
        generic::DATA_TRANSFER_ERROR,
    );
}

/// Reads of an image through a mapping return what Write, Write Zeroes and Deallocate left
/// there, in one stripe and across the 2 MiB boundary between two, and what another process
/// wrote before the controller started; positioned reads return the same bytes.
#[test]
fn mapped_and_positioned_reads_agree_after_writes() {
    const STRIPE_LBA: u64 = (2 << 20) / 4096;
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("mapped.img");
    let before = pattern(3 << 20, 11);
    std::fs::write(&path, &before).unwrap();
    let mut seen = Vec::new();
    for reads in [ImageReads::Mapped, ImageReads::Pread] {
        std::fs::write(&path, &before).unwrap();
        let mut h = Host::enabled(EmuConfig {
            image_reads: reads,
            ..EmuConfig::for_image(&path, 4096).unwrap()
        });
        let mut q = h.create_io_pair(1, 8, 8);
        let buf = h.dev.alloc_dma(2 * 4096).unwrap();
        let read = |q: &mut QueuePair, lba: u64| {
            assert_ok(&q.run(
                &h.dev,
                &rw(
                    READ,
                    1,
                    lba,
                    2,
                    buf.device_address(0),
                    buf.device_address(4096),
                ),
            ));
            let mut back = vec![0u8; 8192];
            buf.read(0, &mut back);
            back
        };
        // The bytes the file held.
        let at = STRIPE_LBA as usize * 4096 - 4096;
        assert_eq!(read(&mut q, STRIPE_LBA - 1), before[at..at + 8192]);
        assert_eq!(read(&mut q, 3), before[3 * 4096..5 * 4096]);
        // A Write across the boundary, then reads of it, whole and in halves.
        let data = pattern(8192, 12);
        buf.write(0, &data);
        assert_ok(&q.run(
            &h.dev,
            &rw(
                WRITE,
                1,
                STRIPE_LBA - 1,
                2,
                buf.device_address(0),
                buf.device_address(4096),
            ),
        ));
        assert_eq!(read(&mut q, STRIPE_LBA - 1), data);
        assert_eq!(read(&mut q, STRIPE_LBA)[..4096], data[4096..]);
        // Write Zeroes of one block, Deallocate of another.
        let mut wz = Command::new(NvmOpcode::WRITE_ZEROES.0, 0, 1);
        wz.set_slba(STRIPE_LBA);
        assert_ok(&q.run(&h.dev, &wz));
        assert_eq!(read(&mut q, STRIPE_LBA - 1)[..4096], data[..4096]);
        assert!(read(&mut q, STRIPE_LBA)[..4096].iter().all(|&b| b == 0));
        let ranges = h.dev.alloc_dma(4096).unwrap();
        let mut range = Vec::new();
        range.extend_from_slice(&0u32.to_le_bytes());
        range.extend_from_slice(&1u32.to_le_bytes());
        range.extend_from_slice(&4u64.to_le_bytes());
        ranges.write(0, &range);
        let mut dsm = Command::new(NvmOpcode::DATASET_MANAGEMENT.0, 0, 1);
        dsm.cdw11 = 1 << 2; // deallocate
        dsm.prp1 = ranges.device_address(0);
        assert_ok(&q.run(&h.dev, &dsm));
        let after = read(&mut q, 3);
        assert_eq!(after[..4096], before[3 * 4096..4 * 4096]);
        assert!(after[4096..].iter().all(|&b| b == 0));
        seen.push((read(&mut q, STRIPE_LBA - 1), read(&mut q, 3)));
    }
    assert_eq!(seen[0], seen[1]);
}
