//! The crate's error type: one variant per operation that can fail, each message one line that
//! says what went wrong and what the user can do about it.

use std::fmt::Write as _;
use std::io;
use std::path::PathBuf;

use crate::pci::PciAddress;

/// A device that shares an IOMMU group and keeps the group from being viable.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct GroupMember {
    /// The member's sysfs name (a PCI address for PCI devices).
    pub name: String,
    /// The driver it is bound to.
    pub driver: String,
}

fn describe_blockers(blockers: &[GroupMember]) -> String {
    let mut s = String::new();
    for (i, m) in blockers.iter().enumerate() {
        if i > 0 {
            s.push_str(", ");
        }
        let _ = write!(s, "{} is bound to `{}`", m.name, m.driver);
    }
    if s.is_empty() {
        s.push_str("VFIO reports it not viable");
    }
    s
}

fn describe_limit(limit: &Option<u64>) -> String {
    match limit {
        None => "unknown".to_owned(),
        Some(u64::MAX) => "unlimited".to_owned(),
        Some(n) => format!("{n} bytes"),
    }
}

/// Errors from opening and driving a device through VFIO.
///
/// Messages are single lines meant for end users; the underlying OS error, where there is one,
/// is the `source`.
#[derive(Debug, thiserror::Error)]
pub enum Error {
    /// The text given as a PCI address does not parse.
    #[error(
        "`{input}` is not a PCI address ({reason}): expected DDDD:BB:DD.F or BB:DD.F in hex, \
         e.g. 0000:01:00.0"
    )]
    MalformedAddress {
        /// What the user typed.
        input: String,
        /// Which part is wrong.
        reason: &'static str,
    },

    /// Nothing at `/sys/bus/pci/devices/ADDR`.
    #[error(
        "no PCI device at {addr} ({} does not exist): list NVMe controllers with `lspci -D -d ::0108`",
        path.display()
    )]
    NoSuchDevice {
        /// The address asked for.
        addr: PciAddress,
        /// The sysfs directory that is missing.
        path: PathBuf,
    },

    /// The function's PCI class is not NVMe (0x010802).
    #[error("{addr} is not an NVMe controller (class 0x{class:06x})")]
    NotNvme {
        /// The address asked for.
        addr: PciAddress,
        /// Its 24-bit class code.
        class: u32,
    },

    /// The function is bound to a driver other than vfio-pci.
    #[error("{addr} is bound to `{driver}`, not vfio-pci: run scripts/setup.sh bind {addr}")]
    BoundToOtherDriver {
        /// The address asked for.
        addr: PciAddress,
        /// The driver it is bound to (e.g. `nvme`).
        driver: String,
    },

    /// The function is bound to no driver at all.
    #[error("{addr} is not bound to any driver, not vfio-pci: run scripts/setup.sh bind {addr}")]
    NotBound {
        /// The address asked for.
        addr: PciAddress,
    },

    /// The function has no IOMMU group: no IOMMU and no-IOMMU mode is off.
    #[error(
        "{addr} has no IOMMU group: enable the IOMMU (intel_iommu=on or amd_iommu=on on the kernel \
         command line) or load vfio with enable_unsafe_noiommu_mode=1"
    )]
    NoIommuGroup {
        /// The address asked for.
        addr: PciAddress,
    },

    /// Another device in the same IOMMU group is bound to a host driver.
    #[error(
        "IOMMU group {group} of {addr} is not viable ({}): bind every device of the group to \
         vfio-pci (scripts/setup.sh bind ADDR) or unbind it",
        describe_blockers(.blockers)
    )]
    GroupNotViable {
        /// The address asked for.
        addr: PciAddress,
        /// The IOMMU group number.
        group: u32,
        /// Devices of the group bound to drivers VFIO does not accept (may be empty when only
        /// the kernel's status ioctl said so).
        blockers: Vec<GroupMember>,
    },

    /// `/dev/vfio/vfio` is missing.
    #[error("{} does not exist: load the VFIO modules (modprobe vfio-pci)", path.display())]
    VfioNotLoaded {
        /// The missing container device.
        path: PathBuf,
    },

    /// Neither `/dev/vfio/N` nor `/dev/vfio/noiommu-N` exists for the function's group.
    #[error(
        "no VFIO group file for IOMMU group {group} of {addr} ({} is missing): rebind it with \
         scripts/setup.sh bind {addr}",
        path.display()
    )]
    GroupFileMissing {
        /// The address asked for.
        addr: PciAddress,
        /// The IOMMU group number.
        group: u32,
        /// The group file looked for.
        path: PathBuf,
    },

    /// Opening a VFIO file was refused.
    #[error(
        "no permission to open {}: run as root, or chown the file to your user and raise the \
         memlock limit",
        path.display()
    )]
    Permission {
        /// The file that could not be opened.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// The group is already open (by another process, or another `VfioNvme` in this one).
    #[error(
        "{} is busy: another process (or another open of this group) is using IOMMU group {group}",
        path.display()
    )]
    GroupBusy {
        /// The group file.
        path: PathBuf,
        /// The IOMMU group number.
        group: u32,
    },

    /// No-IOMMU groups can only be opened with CAP_SYS_RAWIO.
    #[error("no-IOMMU mode needs root (CAP_SYS_RAWIO) to open {}", path.display())]
    NoIommuNeedsRoot {
        /// The `noiommu-N` group file.
        path: PathBuf,
    },

    /// Any other failure to open a file.
    #[error("cannot open {}", path.display())]
    Open {
        /// The file.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// Reading a sysfs attribute failed.
    #[error("cannot read {}", path.display())]
    Sysfs {
        /// The attribute.
        path: PathBuf,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A sysfs attribute held something unexpected.
    #[error("unexpected contents in {}: `{contents}`", path.display())]
    SysfsFormat {
        /// The attribute.
        path: PathBuf,
        /// What it held.
        contents: String,
    },

    /// The kernel's VFIO API version is not the one this crate speaks.
    #[error("VFIO API version {found} is not the supported version {expected}")]
    ApiVersion {
        /// What `VFIO_GET_API_VERSION` returned.
        found: i32,
        /// What this crate supports.
        expected: u32,
    },

    /// The container offers neither TYPE1v2 nor TYPE1.
    #[error(
        "the VFIO container offers no type1 IOMMU: load vfio_iommu_type1 (modprobe vfio_iommu_type1)"
    )]
    NoType1,

    /// The group is a no-IOMMU group but the container does not offer no-IOMMU mode.
    #[error(
        "the kernel's VFIO does not offer no-IOMMU mode: load vfio with enable_unsafe_noiommu_mode=1"
    )]
    NoIommuUnsupported,

    /// A VFIO ioctl failed.
    #[error("VFIO {op} failed")]
    Ioctl {
        /// The ioctl's name.
        op: &'static str,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// VFIO does not describe the function as a PCI device.
    #[error("{addr} is not a PCI device according to VFIO (device flags 0x{flags:x})")]
    NotPciDevice {
        /// The address asked for.
        addr: PciAddress,
        /// `vfio_device_info.flags`.
        flags: u32,
    },

    /// BAR0 is missing, too small or not accessible.
    #[error("BAR0 of {addr} cannot be used: {reason}")]
    Bar0 {
        /// The address asked for.
        addr: PciAddress,
        /// What is wrong with it.
        reason: String,
    },

    /// mmap of BAR0 failed.
    #[error("cannot mmap BAR0 of {addr}")]
    MapBar {
        /// The address asked for.
        addr: PciAddress,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// Reading or writing PCI configuration space failed.
    #[error("PCI config space {op} at offset 0x{offset:x} failed")]
    ConfigSpace {
        /// "read" or "write".
        op: &'static str,
        /// Offset in configuration space.
        offset: u64,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// `VFIO_DEVICE_RESET` failed.
    #[error("function reset of {addr} failed")]
    Reset {
        /// The address asked for.
        addr: PciAddress,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// Pinning memory for DMA was refused for lack of locked-memory allowance.
    #[error(
        "memlock limit too low to lock {len} more bytes for DMA (RLIMIT_MEMLOCK is {}): raise it \
         (ulimit -l unlimited, or LimitMEMLOCK=infinity) or run as root",
        describe_limit(.limit)
    )]
    MemlockTooLow {
        /// Bytes that were being mapped or locked.
        len: usize,
        /// The soft RLIMIT_MEMLOCK, if it could be read (`u64::MAX` = unlimited).
        limit: Option<u64>,
    },

    /// The container hit vfio_iommu_type1's limit on the number of mappings.
    #[error(
        "too many DMA mappings in the VFIO container (vfio_iommu_type1 dma_entry_limit, default \
         65535): raise it (modprobe vfio_iommu_type1 dma_entry_limit=N) or free DMA buffers"
    )]
    TooManyMappings,

    /// `VFIO_IOMMU_MAP_DMA` failed for another reason.
    #[error("VFIO_IOMMU_MAP_DMA of {len} bytes at IOVA 0x{iova:x} failed")]
    MapDma {
        /// IOVA asked for.
        iova: u64,
        /// Length of the mapping.
        len: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// `VFIO_IOMMU_UNMAP_DMA` failed or unmapped less than asked.
    #[error("VFIO_IOMMU_UNMAP_DMA of {len} bytes at IOVA 0x{iova:x} failed")]
    UnmapDma {
        /// IOVA of the mapping.
        iova: u64,
        /// Length of the mapping.
        len: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// No free IOVA range is large enough.
    #[error("no free IOVA range of {len} bytes left in the ranges the IOMMU accepts")]
    IovaExhausted {
        /// Bytes asked for.
        len: usize,
    },

    /// mmap of anonymous memory for DMA failed.
    #[error("cannot allocate {len} bytes of host memory for DMA")]
    HostMemory {
        /// Bytes asked for.
        len: usize,
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// Mapping memory this crate did not allocate needs an IOMMU.
    #[error(
        "mapping external memory for DMA needs the type1 IOMMU; no-IOMMU mode can only use \
         memory from alloc_dma"
    )]
    ExternalNeedsIommu,

    /// `/proc/self/pagemap` hides physical addresses from unprivileged processes.
    #[error(
        "no-IOMMU mode needs root (CAP_SYS_ADMIN) to read physical addresses from /proc/self/pagemap"
    )]
    PagemapNeedsRoot,

    /// Reading `/proc/self/pagemap` failed.
    #[error("cannot read /proc/self/pagemap")]
    Pagemap {
        /// The OS error.
        #[source]
        source: io::Error,
    },

    /// A page of locked DMA memory was not resident when translated.
    #[error("DMA page at virtual address 0x{vaddr:x} is not resident in memory")]
    PageNotPresent {
        /// Its virtual address.
        vaddr: usize,
    },

    /// The vfio-user socket cannot be reached.
    #[error(
        "cannot connect to the vfio-user socket {} (is the target running? e.g. \
         scripts/spdk-target.sh start DIR)",
        path.display()
    )]
    VfioUserConnect {
        /// The socket path given.
        path: PathBuf,
        /// What connect (or stat) said.
        #[source]
        source: io::Error,
    },

    /// The path given as a vfio-user socket is something else.
    #[error("{} is not a Unix socket: give the vfio-user server's socket (e.g. DIR/cntrl)", path.display())]
    VfioUserNotSocket {
        /// The path given.
        path: PathBuf,
    },

    /// The vfio-user server stopped answering, or the connection to it was lost.
    #[error("vfio-user server at {} is gone: {what}", path.display())]
    VfioUserGone {
        /// The socket path.
        path: PathBuf,
        /// What happened, in words.
        what: String,
    },

    /// The vfio-user server answered a request with an error.
    #[error("vfio-user server at {} refused {command}", path.display())]
    VfioUserRefused {
        /// The socket path.
        path: PathBuf,
        /// The request (`VFIO_USER_*`).
        command: &'static str,
        /// The errno it replied with.
        #[source]
        source: io::Error,
    },

    /// The vfio-user server sent something that does not follow the protocol.
    #[error("vfio-user server at {} broke the protocol in {command}: {what}", path.display())]
    VfioUserProtocol {
        /// The socket path.
        path: PathBuf,
        /// The request being answered (`VFIO_USER_*`).
        command: &'static str,
        /// What was wrong.
        what: String,
    },

    /// The device behind a vfio-user socket is not an NVMe controller.
    #[error(
        "the vfio-user device at {} is not an NVMe controller (class 0x{class:06x})",
        path.display()
    )]
    VfioUserNotNvme {
        /// The socket path.
        path: PathBuf,
        /// Its 24-bit class code.
        class: u32,
    },

    /// A mapping the vfio-user server handed over cannot be mapped here.
    #[error("cannot mmap {what} of the vfio-user device at {}", path.display())]
    VfioUserMap {
        /// The socket path.
        path: PathBuf,
        /// Which mapping.
        what: &'static str,
        /// What mmap said.
        #[source]
        source: io::Error,
    },

    /// Memory not backed by a file descriptor cannot be shared with a vfio-user server.
    #[error("a vfio-user server can only reach memory shared as a file descriptor (memfd)")]
    VfioUserNeedsFd,
}

impl Error {
    /// Splits the error into its one-line message and its underlying OS error, for
    /// [`nvme::DmaAllocError`], whose message carries the reason and whose source the cause.
    pub(crate) fn into_dma_alloc_error(self, len: usize) -> nvme::DmaAllocError {
        let reason = self.to_string();
        let source: Option<Box<dyn std::error::Error + Send + Sync>> = match self {
            Error::Permission { source, .. }
            | Error::Open { source, .. }
            | Error::Sysfs { source, .. }
            | Error::Ioctl { source, .. }
            | Error::MapBar { source, .. }
            | Error::ConfigSpace { source, .. }
            | Error::Reset { source, .. }
            | Error::MapDma { source, .. }
            | Error::UnmapDma { source, .. }
            | Error::HostMemory { source, .. }
            | Error::Pagemap { source }
            | Error::VfioUserConnect { source, .. }
            | Error::VfioUserRefused { source, .. }
            | Error::VfioUserMap { source, .. } => Some(Box::new(source)),
            _ => None,
        };
        nvme::DmaAllocError {
            len,
            reason,
            source,
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn addr() -> PciAddress {
        "0000:01:00.0".parse().unwrap()
    }

    #[test]
    fn messages_are_one_line_and_name_the_fix() {
        let errors = [
            Error::BoundToOtherDriver {
                addr: addr(),
                driver: "nvme".into(),
            },
            Error::NotNvme {
                addr: addr(),
                class: 0x020000,
            },
            Error::GroupNotViable {
                addr: addr(),
                group: 7,
                blockers: vec![GroupMember {
                    name: "0000:01:00.1".into(),
                    driver: "e1000e".into(),
                }],
            },
            Error::MemlockTooLow {
                len: 2 << 20,
                limit: Some(65536),
            },
            Error::NoIommuGroup { addr: addr() },
        ];
        for e in &errors {
            let m = e.to_string();
            assert!(!m.contains('\n'), "multi-line message: {m}");
        }
        assert_eq!(
            errors[0].to_string(),
            "0000:01:00.0 is bound to `nvme`, not vfio-pci: run scripts/setup.sh bind 0000:01:00.0"
        );
        assert_eq!(
            errors[1].to_string(),
            "0000:01:00.0 is not an NVMe controller (class 0x020000)"
        );
        assert!(
            errors[2]
                .to_string()
                .contains("0000:01:00.1 is bound to `e1000e`")
        );
        assert!(
            errors[3]
                .to_string()
                .contains("RLIMIT_MEMLOCK is 65536 bytes")
        );
        assert!(errors[3].to_string().contains("ulimit -l"));
        assert!(errors[4].to_string().contains("intel_iommu=on"));
    }

    #[test]
    fn dma_alloc_error_keeps_reason_and_cause() {
        let e = Error::MapDma {
            iova: 0x20_0000,
            len: 4096,
            source: io::Error::from_raw_os_error(libc::EINVAL),
        };
        let d = e.into_dma_alloc_error(4096);
        assert_eq!(d.len, 4096);
        assert!(d.reason.contains("IOVA 0x200000"));
        let src = d.source.expect("cause kept");
        assert_eq!(
            src.downcast_ref::<io::Error>().unwrap().raw_os_error(),
            Some(libc::EINVAL)
        );
    }
}
