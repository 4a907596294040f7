//! Read-only checks against sysfs and `/dev/vfio` made before any device file is opened.
//!
//! Everything here only reads attributes and symlinks, so a wrong address, a controller still
//! bound to `nvme`, or a non-NVMe function is reported without touching the device. The roots
//! are injectable ([`SysRoots`]) so these checks are unit-tested against a fake tree.
#![forbid(unsafe_code)]

use std::fs;
use std::io;
use std::path::{Path, PathBuf};

use crate::error::GroupMember;
use crate::{Error, IommuMode, PciAddress};

/// PCI class code of an NVMe controller: mass storage (01), non-volatile memory (08), NVM
/// Express programming interface (02).
pub const NVME_CLASS: u32 = 0x01_08_02;

/// Drivers VFIO accepts on the other members of a group: its own, and drivers that never do DMA
/// for the host (`pci-stub`) or manage DMA ownership themselves (`pcieport`, Linux 5.19+).
const DRIVERS_ALLOWED_IN_GROUP: &[&str] = &["vfio-pci", "pci-stub", "pcieport"];

/// Where sysfs and device files live. Tests point these at a temporary directory.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SysRoots {
    /// Root of sysfs (normally `/sys`).
    pub sys: PathBuf,
    /// Root of device files (normally `/dev`).
    pub dev: PathBuf,
}

impl Default for SysRoots {
    fn default() -> Self {
        Self {
            sys: PathBuf::from("/sys"),
            dev: PathBuf::from("/dev"),
        }
    }
}

impl SysRoots {
    /// `/sys/bus/pci/devices/ADDR`.
    pub fn device_dir(&self, addr: &PciAddress) -> PathBuf {
        self.sys.join("bus/pci/devices").join(addr.to_string())
    }

    /// `/dev/vfio/vfio`, the container device.
    pub fn container_file(&self) -> PathBuf {
        self.dev.join("vfio/vfio")
    }
}

/// What the read-only checks found out about a function that VFIO can open.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Preflight {
    /// The function.
    pub addr: PciAddress,
    /// Its IOMMU group number.
    pub group: u32,
    /// `/dev/vfio/N` or `/dev/vfio/noiommu-N`.
    pub group_file: PathBuf,
    /// Which kind of group it is.
    pub mode: IommuMode,
}

fn read_attr(path: &Path) -> Result<String, Error> {
    fs::read_to_string(path)
        .map(|s| s.trim().to_owned())
        .map_err(|source| Error::Sysfs {
            path: path.to_owned(),
            source,
        })
}

/// The last component of the target of symlink `path`, or `None` if there is no such link.
fn link_name(path: &Path) -> Result<Option<String>, Error> {
    match fs::read_link(path) {
        Ok(target) => match target.file_name() {
            Some(name) => Ok(Some(name.to_string_lossy().into_owned())),
            None => Err(Error::SysfsFormat {
                path: path.to_owned(),
                contents: target.display().to_string(),
            }),
        },
        Err(e) if e.kind() == io::ErrorKind::NotFound => Ok(None),
        Err(source) => Err(Error::Sysfs {
            path: path.to_owned(),
            source,
        }),
    }
}

/// Parses a sysfs hex attribute such as `0x010802`.
fn parse_hex(path: &Path, s: &str) -> Result<u32, Error> {
    let digits = s.strip_prefix("0x").unwrap_or(s);
    u32::from_str_radix(digits, 16).map_err(|_| Error::SysfsFormat {
        path: path.to_owned(),
        contents: s.to_owned(),
    })
}

/// The driver `addr` is bound to, if any.
pub fn bound_driver(roots: &SysRoots, addr: &PciAddress) -> Result<Option<String>, Error> {
    link_name(&roots.device_dir(addr).join("driver"))
}

/// The members of IOMMU group `group` bound to drivers that keep the group from being viable.
pub fn group_blockers(roots: &SysRoots, group: u32) -> Result<Vec<GroupMember>, Error> {
    let dir = roots
        .sys
        .join("kernel/iommu_groups")
        .join(group.to_string())
        .join("devices");
    let entries = fs::read_dir(&dir).map_err(|source| Error::Sysfs {
        path: dir.clone(),
        source,
    })?;
    let mut blockers = Vec::new();
    for entry in entries {
        let entry = entry.map_err(|source| Error::Sysfs {
            path: dir.clone(),
            source,
        })?;
        let name = entry.file_name().to_string_lossy().into_owned();
        // The entry is a symlink to the device directory; its `driver` link resolves through it.
        if let Some(driver) = link_name(&entry.path().join("driver"))? {
            if !DRIVERS_ALLOWED_IN_GROUP.contains(&driver.as_str()) {
                blockers.push(GroupMember { name, driver });
            }
        }
    }
    blockers.sort_by(|a, b| a.name.cmp(&b.name));
    Ok(blockers)
}

/// Checks, reading only sysfs and `/dev`, that `addr` is an NVMe controller bound to vfio-pci in
/// a viable IOMMU group with a group file, and says which group file and IOMMU mode to use.
///
/// The checks run in the order a user would fix things: existence, class, driver, IOMMU group,
/// group viability, VFIO files.
pub fn preflight(roots: &SysRoots, addr: &PciAddress) -> Result<Preflight, Error> {
    let dir = roots.device_dir(addr);
    if !dir.exists() {
        return Err(Error::NoSuchDevice {
            addr: *addr,
            path: dir,
        });
    }

    let class_path = dir.join("class");
    let class = parse_hex(&class_path, &read_attr(&class_path)?)?;
    if class != NVME_CLASS {
        return Err(Error::NotNvme { addr: *addr, class });
    }

    match bound_driver(roots, addr)? {
        Some(d) if d == "vfio-pci" => {}
        Some(driver) => {
            return Err(Error::BoundToOtherDriver {
                addr: *addr,
                driver,
            });
        }
        None => return Err(Error::NotBound { addr: *addr }),
    }

    let group_link = dir.join("iommu_group");
    let Some(group_name) = link_name(&group_link)? else {
        return Err(Error::NoIommuGroup { addr: *addr });
    };
    let group: u32 = group_name.parse().map_err(|_| Error::SysfsFormat {
        path: group_link.clone(),
        contents: group_name.clone(),
    })?;

    let blockers = group_blockers(roots, group)?;
    if !blockers.is_empty() {
        return Err(Error::GroupNotViable {
            addr: *addr,
            group,
            blockers,
        });
    }

    let vfio_dir = roots.dev.join("vfio");
    let type1 = vfio_dir.join(group.to_string());
    let noiommu = vfio_dir.join(format!("noiommu-{group}"));
    let (group_file, mode) = if type1.exists() {
        (type1, IommuMode::Type1)
    } else if noiommu.exists() {
        (noiommu, IommuMode::NoIommu)
    } else if !roots.container_file().exists() {
        return Err(Error::VfioNotLoaded {
            path: roots.container_file(),
        });
    } else {
        return Err(Error::GroupFileMissing {
            addr: *addr,
            group,
            path: type1,
        });
    };
    Ok(Preflight {
        addr: *addr,
        group,
        group_file,
        mode,
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::os::unix::fs::symlink;

    /// A fake `/sys` + `/dev` tree.
    struct FakeSys {
        _tmp: tempfile::TempDir,
        roots: SysRoots,
    }

    impl FakeSys {
        fn new() -> Self {
            let tmp = tempfile::tempdir().unwrap();
            let roots = SysRoots {
                sys: tmp.path().join("sys"),
                dev: tmp.path().join("dev"),
            };
            for d in [
                "sys/devices/pci0000:00",
                "sys/bus/pci/devices",
                "sys/bus/pci/drivers",
                "dev/vfio",
            ] {
                fs::create_dir_all(tmp.path().join(d)).unwrap();
            }
            fs::write(roots.dev.join("vfio/vfio"), "").unwrap();
            Self { _tmp: tmp, roots }
        }

        /// Adds a PCI function like the kernel lays it out: the real directory under
        /// `devices/`, a link from `bus/pci/devices`, optional `driver` and `iommu_group` links.
        fn add(&self, addr: &str, class: u32, driver: Option<&str>, group: Option<u32>) {
            let real = self.roots.sys.join("devices/pci0000:00").join(addr);
            fs::create_dir_all(&real).unwrap();
            fs::write(real.join("class"), format!("0x{class:06x}\n")).unwrap();
            symlink(&real, self.roots.sys.join("bus/pci/devices").join(addr)).unwrap();
            if let Some(d) = driver {
                let drv = self.roots.sys.join("bus/pci/drivers").join(d);
                fs::create_dir_all(&drv).unwrap();
                symlink(&drv, real.join("driver")).unwrap();
            }
            if let Some(g) = group {
                let gdir = self
                    .roots
                    .sys
                    .join("kernel/iommu_groups")
                    .join(g.to_string());
                fs::create_dir_all(gdir.join("devices")).unwrap();
                symlink(&gdir, real.join("iommu_group")).unwrap();
                symlink(&real, gdir.join("devices").join(addr)).unwrap();
            }
        }

        fn add_group_file(&self, name: &str) {
            fs::write(self.roots.dev.join("vfio").join(name), "").unwrap();
        }
    }

    fn addr(s: &str) -> PciAddress {
        s.parse().unwrap()
    }

    #[test]
    fn accepts_vfio_bound_nvme_in_type1_group() {
        let f = FakeSys::new();
        f.add("0000:00:03.0", NVME_CLASS, Some("vfio-pci"), Some(4));
        f.add_group_file("4");
        let p = preflight(&f.roots, &addr("00:03.0")).unwrap();
        assert_eq!(p.group, 4);
        assert_eq!(p.mode, IommuMode::Type1);
        assert_eq!(p.group_file, f.roots.dev.join("vfio/4"));
    }

    #[test]
    fn detects_noiommu_group() {
        let f = FakeSys::new();
        f.add("0000:00:03.0", NVME_CLASS, Some("vfio-pci"), Some(0));
        f.add_group_file("noiommu-0");
        let p = preflight(&f.roots, &addr("0000:00:03.0")).unwrap();
        assert_eq!(p.mode, IommuMode::NoIommu);
        assert_eq!(p.group_file, f.roots.dev.join("vfio/noiommu-0"));
    }

    #[test]
    fn missing_device() {
        let f = FakeSys::new();
        let e = preflight(&f.roots, &addr("0000:05:00.0")).unwrap_err();
        assert!(matches!(e, Error::NoSuchDevice { .. }), "{e}");
        assert!(
            e.to_string().starts_with("no PCI device at 0000:05:00.0"),
            "{e}"
        );
    }

    #[test]
    fn non_nvme_device_reports_class() {
        let f = FakeSys::new();
        f.add("0000:00:02.0", 0x030000, Some("vfio-pci"), Some(1));
        let e = preflight(&f.roots, &addr("0000:00:02.0")).unwrap_err();
        assert_eq!(
            e.to_string(),
            "0000:00:02.0 is not an NVMe controller (class 0x030000)"
        );
    }

    #[test]
    fn bound_to_nvme_driver() {
        let f = FakeSys::new();
        f.add("0000:00:03.0", NVME_CLASS, Some("nvme"), Some(4));
        f.add_group_file("4");
        let e = preflight(&f.roots, &addr("0000:00:03.0")).unwrap_err();
        assert!(matches!(&e, Error::BoundToOtherDriver { driver, .. } if driver == "nvme"));
        assert_eq!(
            e.to_string(),
            "0000:00:03.0 is bound to `nvme`, not vfio-pci: run scripts/setup.sh bind 0000:00:03.0"
        );
    }

    #[test]
    fn unbound_device() {
        let f = FakeSys::new();
        f.add("0000:00:03.0", NVME_CLASS, None, Some(4));
        let e = preflight(&f.roots, &addr("0000:00:03.0")).unwrap_err();
        assert!(matches!(e, Error::NotBound { .. }), "{e}");
    }

    #[test]
    fn no_iommu_group() {
        let f = FakeSys::new();
        f.add("0000:00:03.0", NVME_CLASS, Some("vfio-pci"), None);
        let e = preflight(&f.roots, &addr("0000:00:03.0")).unwrap_err();
        assert!(matches!(e, Error::NoIommuGroup { .. }), "{e}");
    }

    #[test]
    fn group_with_host_driver_is_not_viable() {
        let f = FakeSys::new();
        f.add("0000:01:00.0", NVME_CLASS, Some("vfio-pci"), Some(9));
        f.add("0000:01:00.1", 0x020000, Some("e1000e"), Some(9));
        f.add("0000:00:01.0", 0x060400, Some("pcieport"), Some(9));
        f.add("0000:01:00.2", 0x0c0330, None, Some(9));
        f.add_group_file("9");
        let e = preflight(&f.roots, &addr("0000:01:00.0")).unwrap_err();
        match &e {
            Error::GroupNotViable {
                group, blockers, ..
            } => {
                assert_eq!(*group, 9);
                assert_eq!(
                    blockers,
                    &[GroupMember {
                        name: "0000:01:00.1".into(),
                        driver: "e1000e".into()
                    }]
                );
            }
            other => panic!("unexpected {other}"),
        }
        assert!(
            e.to_string().contains("0000:01:00.1 is bound to `e1000e`"),
            "{e}"
        );
    }

    #[test]
    fn missing_group_file_and_missing_vfio() {
        let f = FakeSys::new();
        f.add("0000:00:03.0", NVME_CLASS, Some("vfio-pci"), Some(4));
        let e = preflight(&f.roots, &addr("0000:00:03.0")).unwrap_err();
        assert!(matches!(e, Error::GroupFileMissing { group: 4, .. }), "{e}");
        fs::remove_file(f.roots.container_file()).unwrap();
        let e = preflight(&f.roots, &addr("0000:00:03.0")).unwrap_err();
        assert!(matches!(e, Error::VfioNotLoaded { .. }), "{e}");
        assert!(e.to_string().contains("modprobe vfio-pci"));
    }

    #[test]
    fn garbage_class_attribute_is_an_error() {
        let f = FakeSys::new();
        f.add("0000:00:03.0", NVME_CLASS, Some("vfio-pci"), Some(4));
        fs::write(
            f.roots.device_dir(&addr("0000:00:03.0")).join("class"),
            "zzz\n",
        )
        .unwrap();
        let e = preflight(&f.roots, &addr("0000:00:03.0")).unwrap_err();
        assert!(
            matches!(&e, Error::SysfsFormat { contents, .. } if contents == "zzz"),
            "{e}"
        );
    }
}
