//! scripts/setup.sh against a fake sysfs/procfs: refusals leave everything untouched and say
//! why in one line; bind and unbind write driver_override, unbind and drivers_probe in order.

use std::fs;
use std::os::unix::fs::symlink;
use std::path::{Path, PathBuf};
use std::process::{Command, Output};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

const NVME: &str = "0x010802";
const ADDR: &str = "0000:00:03.0";

struct Fake {
    _tmp: tempfile::TempDir,
    sys: PathBuf,
    proc_: PathBuf,
}

impl Fake {
    fn new() -> Self {
        let tmp = tempfile::tempdir().unwrap();
        let sys = tmp.path().join("sys");
        let proc_ = tmp.path().join("proc");
        for d in [
            "devices/pci0000:00",
            "bus/pci/devices",
            "kernel/iommu_groups",
            "block",
        ] {
            fs::create_dir_all(sys.join(d)).unwrap();
        }
        for drv in ["nvme", "vfio-pci", "e1000e"] {
            let d = sys.join("bus/pci/drivers").join(drv);
            fs::create_dir_all(&d).unwrap();
            fs::write(d.join("unbind"), "").unwrap();
        }
        fs::write(sys.join("bus/pci/drivers_probe"), "").unwrap();
        fs::create_dir_all(&proc_).unwrap();
        fs::write(proc_.join("mounts"), "proc /proc proc rw 0 0\n").unwrap();
        fs::write(proc_.join("swaps"), "Filename Type Size Used Priority\n").unwrap();
        let hp = sys.join("kernel/mm/hugepages/hugepages-2048kB");
        fs::create_dir_all(&hp).unwrap();
        fs::write(hp.join("nr_hugepages"), "0\n").unwrap();
        fs::write(hp.join("free_hugepages"), "0\n").unwrap();
        Self {
            _tmp: tmp,
            sys,
            proc_,
        }
    }

    fn dev(&self, addr: &str) -> PathBuf {
        self.sys.join("devices/pci0000:00").join(addr)
    }

    /// A PCI function with class, driver, IOMMU group and (for NVMe) one namespace `disk`.
    fn add(
        &self,
        addr: &str,
        class: &str,
        driver: Option<&str>,
        group: Option<u32>,
        disk: Option<&str>,
    ) {
        let d = self.dev(addr);
        fs::create_dir_all(&d).unwrap();
        fs::write(d.join("class"), format!("{class}\n")).unwrap();
        fs::write(d.join("driver_override"), "(null)\n").unwrap();
        symlink(&d, self.sys.join("bus/pci/devices").join(addr)).unwrap();
        if let Some(drv) = driver {
            self.set_driver(addr, drv);
        }
        if let Some(g) = group {
            let gd = self.sys.join("kernel/iommu_groups").join(g.to_string());
            fs::create_dir_all(gd.join("devices")).unwrap();
            symlink(&gd, d.join("iommu_group")).unwrap();
            symlink(&d, gd.join("devices").join(addr)).unwrap();
        }
        if let Some(disk) = disk {
            fs::create_dir_all(d.join("nvme/nvme0").join(disk)).unwrap();
            fs::create_dir_all(self.sys.join("block").join(disk).join("holders")).unwrap();
        }
    }

    fn set_driver(&self, addr: &str, drv: &str) {
        let link = self.dev(addr).join("driver");
        let _ = fs::remove_file(&link);
        symlink(self.sys.join("bus/pci/drivers").join(drv), link).unwrap();
    }

    fn run(&self, args: &[&str]) -> Output {
        let script = Path::new(env!("CARGO_MANIFEST_DIR")).join("../scripts/setup.sh");
        Command::new("bash")
            .arg(script)
            .args(args)
            .env("GPUNVME_SYSFS", &self.sys)
            .env("GPUNVME_PROCFS", &self.proc_)
            .env("GPUNVME_BIND_WAIT_TENTHS", "50")
            .output()
            .unwrap()
    }

    fn read(&self, p: impl AsRef<Path>) -> String {
        fs::read_to_string(self.sys.join(p)).unwrap()
    }

    /// Nothing the script writes to was written.
    fn assert_untouched(&self, addr: &str) {
        if self.dev(addr).exists() {
            assert_eq!(
                fs::read_to_string(self.dev(addr).join("driver_override")).unwrap(),
                "(null)\n"
            );
        }
        assert_eq!(self.read("bus/pci/drivers_probe"), "");
        assert_eq!(self.read("bus/pci/drivers/nvme/unbind"), "");
        assert_eq!(self.read("bus/pci/drivers/vfio-pci/unbind"), "");
    }
}

fn stderr(o: &Output) -> String {
    String::from_utf8_lossy(&o.stderr).into_owned()
}
fn stdout(o: &Output) -> String {
    String::from_utf8_lossy(&o.stdout).into_owned()
}

/// Asserts a refusal: exit 1, exactly one line on stderr containing `want`, nothing written.
fn assert_refused(f: &Fake, o: &Output, want: &str) {
    let err = stderr(o);
    assert_eq!(
        o.status.code(),
        Some(1),
        "stdout: {} stderr: {err}",
        stdout(o)
    );
    assert_eq!(err.lines().count(), 1, "not one line: {err}");
    assert!(err.contains(want), "`{err}` lacks `{want}`");
    f.assert_untouched(ADDR);
}

#[test]
fn malformed_address_is_refused() {
    let f = Fake::new();
    f.add(ADDR, NVME, Some("nvme"), Some(3), Some("nvme0n1"));
    for bad in [
        "0000:00:03",
        "00:20.0",
        "0000:00:03.8",
        "zz:00.0",
        "/dev/nvme0",
    ] {
        let o = f.run(&["bind", bad]);
        assert_refused(&f, &o, "is not a PCI address");
        assert!(stderr(&o).contains("e.g. 0000:01:00.0"));
    }
}

#[test]
fn missing_and_non_nvme_devices_are_refused() {
    let f = Fake::new();
    f.add("0000:00:02.0", "0x030000", Some("e1000e"), Some(2), None);
    let o = f.run(&["bind", "0000:00:07.0"]);
    assert_refused(&f, &o, "no PCI device at 0000:00:07.0");
    let o = f.run(&["bind", "00:02.0"]);
    assert_refused(
        &f,
        &o,
        "0000:00:02.0 is not an NVMe controller (class 0x030000)",
    );
    assert_eq!(
        fs::read_to_string(f.dev("0000:00:02.0").join("driver_override")).unwrap(),
        "(null)\n"
    );
}

#[test]
fn mounted_namespace_is_refused() {
    let f = Fake::new();
    f.add(ADDR, NVME, Some("nvme"), Some(3), Some("nvme0n1"));
    fs::create_dir_all(f.sys.join("block/nvme0n1/nvme0n1p2/holders")).unwrap();
    fs::write(f.proc_.join("mounts"), "/dev/nvme0n1p2 /data ext4 rw 0 0\n").unwrap();
    let o = f.run(&["bind", ADDR]);
    assert_refused(&f, &o, "/dev/nvme0n1p2 (mounted on /data)");
}

#[test]
fn multipath_namespace_name_and_device_mapper_holder_are_seen() {
    let f = Fake::new();
    f.add(ADDR, NVME, Some("nvme"), Some(3), Some("nvme1c1n1"));
    fs::create_dir_all(f.sys.join("block/nvme1n1/holders/dm-0")).unwrap();
    let o = f.run(&["bind", ADDR]);
    assert_refused(&f, &o, "/dev/nvme1n1 (held by dm-0)");
}

#[test]
fn swap_namespace_is_refused() {
    let f = Fake::new();
    f.add(ADDR, NVME, Some("nvme"), Some(3), Some("nvme0n1"));
    fs::write(
        f.proc_.join("swaps"),
        "Filename Type Size Used Priority\n/dev/nvme0n1 partition 1 0 -2\n",
    )
    .unwrap();
    let o = f.run(&["bind", ADDR]);
    assert_refused(&f, &o, "/dev/nvme0n1 (swap)");
}

#[test]
fn group_with_host_driver_is_refused() {
    let f = Fake::new();
    f.add(ADDR, NVME, Some("nvme"), Some(3), Some("nvme0n1"));
    f.add("0000:00:03.1", "0x020000", Some("e1000e"), Some(3), None);
    let o = f.run(&["bind", ADDR]);
    assert_refused(
        &f,
        &o,
        "IOMMU group 3 of 0000:00:03.0 is not viable: also holds 0000:00:03.1 (e1000e)",
    );
}

#[test]
fn no_iommu_is_refused() {
    let f = Fake::new();
    f.add(ADDR, NVME, Some("nvme"), None, Some("nvme0n1"));
    let o = f.run(&["bind", ADDR]);
    assert_refused(&f, &o, "no IOMMU");
    // With vfio's no-IOMMU mode on, the same device may be taken.
    fs::create_dir_all(f.sys.join("module/vfio/parameters")).unwrap();
    fs::write(
        f.sys
            .join("module/vfio/parameters/enable_unsafe_noiommu_mode"),
        "Y\n",
    )
    .unwrap();
    let (stop, h) = fake_kernel(&f, "nvme");
    let o = f.run(&["bind", ADDR]);
    stop.store(true, Ordering::Relaxed);
    h.join().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert!(
        stdout(&o).contains("bound 0000:00:03.0 to vfio-pci"),
        "{}",
        stdout(&o)
    );
}

/// Plays the kernel: when the address lands in drivers_probe, binds the device to whatever
/// driver_override names (or `fallback` when it is empty), as a real kernel would.
fn fake_kernel(f: &Fake, fallback: &'static str) -> (Arc<AtomicBool>, std::thread::JoinHandle<()>) {
    let stop = Arc::new(AtomicBool::new(false));
    let (sys, dev) = (f.sys.clone(), f.dev(ADDR));
    let s = Arc::clone(&stop);
    let h = std::thread::spawn(move || {
        while !s.load(Ordering::Relaxed) {
            if fs::read_to_string(sys.join("bus/pci/drivers_probe"))
                .unwrap()
                .trim()
                == ADDR
            {
                let ov = fs::read_to_string(dev.join("driver_override")).unwrap();
                let drv = if ov.trim().is_empty() {
                    fallback
                } else {
                    ov.trim()
                };
                let link = dev.join("driver");
                let _ = fs::remove_file(&link);
                symlink(sys.join("bus/pci/drivers").join(drv), link).unwrap();
                // vfio-pci in no-IOMMU mode gives the device a group of its own.
                if drv == "vfio-pci" && !dev.join("iommu_group").exists() {
                    let g = sys.join("kernel/iommu_groups/0");
                    fs::create_dir_all(g.join("devices")).unwrap();
                    symlink(&g, dev.join("iommu_group")).unwrap();
                }
                return;
            }
            std::thread::sleep(Duration::from_millis(20));
        }
    });
    (stop, h)
}

#[test]
fn bind_then_unbind() {
    let f = Fake::new();
    f.add(ADDR, NVME, Some("nvme"), Some(3), Some("nvme0n1"));

    let (stop, h) = fake_kernel(&f, "nvme");
    let o = f.run(&["bind", "00:03.0"]);
    stop.store(true, Ordering::Relaxed);
    h.join().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(
        fs::read_to_string(f.dev(ADDR).join("driver_override")).unwrap(),
        "vfio-pci\n"
    );
    assert_eq!(f.read("bus/pci/drivers/nvme/unbind").trim(), ADDR);
    let out = stdout(&o);
    assert!(
        out.contains("set driver_override of 0000:00:03.0 to vfio-pci"),
        "{out}"
    );
    assert!(out.contains("unbound 0000:00:03.0 from nvme"), "{out}");
    assert!(
        out.contains("bound 0000:00:03.0 to vfio-pci: IOMMU group 3"),
        "{out}"
    );

    // A second bind is a no-op.
    let o = f.run(&["bind", ADDR]);
    assert_eq!(o.status.code(), Some(0));
    assert!(stdout(&o).contains("already bound to vfio-pci"));

    fs::write(f.sys.join("bus/pci/drivers_probe"), "").unwrap();
    // While another process has the group open, unbind refuses (an unbind would block).
    let fd_dir = f.proc_.join("4242/fd");
    fs::create_dir_all(&fd_dir).unwrap();
    symlink("/dev/vfio/3", fd_dir.join("7")).unwrap();
    let o = f.run(&["unbind", ADDR]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("/dev/vfio/3 is open in process(es) 4242"),
        "{}",
        stderr(&o)
    );
    assert_eq!(
        fs::read_to_string(f.dev(ADDR).join("driver_override")).unwrap(),
        "vfio-pci\n"
    );
    fs::remove_dir_all(f.proc_.join("4242")).unwrap();

    let (stop, h) = fake_kernel(&f, "nvme");
    let o = f.run(&["unbind", ADDR]);
    stop.store(true, Ordering::Relaxed);
    h.join().unwrap();
    assert_eq!(o.status.code(), Some(0), "{}{}", stdout(&o), stderr(&o));
    assert_eq!(
        fs::read_to_string(f.dev(ADDR).join("driver_override")).unwrap(),
        "\n"
    );
    assert_eq!(f.read("bus/pci/drivers/vfio-pci/unbind").trim(), ADDR);
    let out = stdout(&o);
    assert!(out.contains("bound 0000:00:03.0 to nvme"), "{out}");
    assert!(out.contains("namespaces: nvme0n1\n"), "{out}");

    // Unbinding a controller that is not on vfio-pci is refused.
    let o = f.run(&["unbind", ADDR]);
    assert_eq!(o.status.code(), Some(1));
    assert!(
        stderr(&o).contains("is bound to nvme, not vfio-pci"),
        "{}",
        stderr(&o)
    );
}

#[test]
fn status_lists_controllers_and_hugepages() {
    let f = Fake::new();
    f.add(ADDR, NVME, Some("vfio-pci"), Some(3), None);
    f.add("0000:00:04.0", NVME, Some("nvme"), Some(4), Some("nvme0n1"));
    f.add("0000:00:02.0", "0x030000", None, Some(2), None);
    let o = f.run(&["status"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    let out = stdout(&o);
    assert!(out.contains("IOMMU: on (3 groups)"), "{out}");
    assert!(
        out.contains("0000:00:03.0 driver=vfio-pci iommu_group=3"),
        "{out}"
    );
    assert!(
        out.contains("0000:00:04.0 driver=nvme iommu_group=4 namespaces: nvme0n1"),
        "{out}"
    );
    assert!(!out.contains("0000:00:02.0"), "{out}");
    assert!(out.contains("hugepages (2 MiB): 0 free of 0"), "{out}");
}

#[test]
fn hugepages_are_reserved_and_checked() {
    let f = Fake::new();
    let o = f.run(&["hugepages", "64"]);
    assert_eq!(o.status.code(), Some(0), "{}", stderr(&o));
    assert_eq!(
        f.read("kernel/mm/hugepages/hugepages-2048kB/nr_hugepages")
            .trim(),
        "64"
    );
    assert!(stdout(&o).contains("reserved 64 2 MiB hugepages (128 MiB)"));
    let o = f.run(&["hugepages", "lots"]);
    assert_eq!(o.status.code(), Some(1));
    assert!(stderr(&o).contains("`lots` is not a number"));
}
