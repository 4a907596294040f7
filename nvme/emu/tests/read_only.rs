//! Read-only namespaces over image files the process cannot write. In a test binary of their
//! own: making a file unwritable runs `chattr`, and a forked child holds copies of the
//! parent's descriptors (and so its image locks) until it execs, which would disturb the lock
//! tests of `backends.rs` running beside it.

mod common;

use common::*;
use nvme::Device;
use nvme_emu::{EmuConfig, EmuError};
use nvme_spec::status::{StatusCodeType as Sct, generic};
use nvme_spec::{Command, NvmOpcode};

const READ: u8 = NvmOpcode::READ.0;
const WRITE: u8 = NvmOpcode::WRITE.0;

/// Makes a file one that even root cannot open for writing (`chattr +i`), or one the current
/// user cannot (mode 0444) when that is enough; undone on drop. `None` when neither works here.
struct Unwritable(std::path::PathBuf);

impl Unwritable {
    fn new(path: &std::path::Path) -> Option<Self> {
        use std::os::unix::fs::PermissionsExt;
        std::fs::set_permissions(path, std::fs::Permissions::from_mode(0o444)).unwrap();
        let guard = Self(path.to_owned());
        let writable = || std::fs::OpenOptions::new().write(true).open(path).is_ok();
        if writable() {
            let _ = std::process::Command::new("chattr")
                .arg("+i")
                .arg(path)
                .output();
        }
        (!writable()).then_some(guard)
    }
}

impl Drop for Unwritable {
    fn drop(&mut self) {
        let _ = std::process::Command::new("chattr")
            .arg("-i")
            .arg(&self.0)
            .output();
    }
}

#[test]
fn read_only_namespace_serves_reads_and_refuses_changes() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("ro.img");
    let data = pattern(64 * 512, 9);
    std::fs::write(&path, &data).unwrap();
    let Some(_guard) = Unwritable::new(&path) else {
        eprintln!("skipped: cannot make a file unwritable here");
        return;
    };
    // The writable configuration cannot open it...
    assert!(matches!(
        EmuConfig::for_image(&path, 512),
        Err(EmuError::OpenImage { .. })
    ));
    // ...the read-only one serves it.
    let mut h = Host::enabled(EmuConfig::for_image_read_only(&path, 512).unwrap());
    let (c, page) = h.identify(0, 1);
    assert_ok(&c);
    assert_eq!(page[99] & 1, 1, "NSATTR says write protected");
    let mut q = h.create_io_pair(1, 8, 8);
    let buf = h.dev.alloc_dma(4096).unwrap();
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 8, 8, buf.device_address(0), 0)));
    let mut back = vec![0u8; 4096];
    buf.read(0, &mut back);
    assert_eq!(back, data[8 * 512..16 * 512]);
    assert_status(
        &q.run(&h.dev, &rw(WRITE, 1, 8, 8, buf.device_address(0), 0)),
        Sct::GENERIC,
        generic::NAMESPACE_WRITE_PROTECTED,
    );
    let mut wz = Command::new(NvmOpcode::WRITE_ZEROES.0, 0, 1);
    wz.cdw10 = 0;
    wz.cdw12 = 7;
    assert_status(
        &q.run(&h.dev, &wz),
        Sct::GENERIC,
        generic::NAMESPACE_WRITE_PROTECTED,
    );
    assert_ok(&q.run(&h.dev, &Command::new(NvmOpcode::FLUSH.0, 0, 1)));
    drop(h);
    assert_eq!(
        std::fs::read(&path).unwrap(),
        data,
        "the image is unchanged"
    );
}
