//! A CPU mapping of GPU memory (through the GPU's BAR1) that VFIO can map for the SSD:
//! the vfio-p2p transport's way of making GPU memory DMA-able by a device under VFIO type1.
//!
//! Probed in order, each probe returning a typed reason when it cannot serve:
//! 1. GDRCopy's `gdrdrv` (`/dev/gdrdrv`): pin the range in BAR1 (`GDRDRV_IOC_PIN_BUFFER`,
//!    which calls `nvidia_p2p_get_pages`), `mmap` the pin. The ABI is gdrdrv.h's, major 2.
//! 2. The GPU's sysfs `resource1`: `mmap` of the whole BAR1 window. Meaningful only when the
//!    byte offset of the range inside BAR1 is known, and nothing here can learn it for
//!    `cuMemAlloc`'d memory (only gdrdrv or a dma-buf exporter know where the driver placed
//!    it), so without an offset supplied by the caller this probe always reports
//!    [`Bar1Unavailable::Resource1OffsetUnknown`].
//! 3. A dma-buf from `cuMemGetHandleForAddressRange(DMA_BUF_FD)`, then `mmap` of it. The
//!    NVIDIA driver exports such dma-bufs but was seen refusing `mmap` of them (H200, driver
//!    580), in which case this reports [`Bar1Unavailable::DmaBufMmap`].
#![forbid(unsafe_code)]

use std::os::fd::OwnedFd;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::GpuError;
use crate::ffi::DeviceMemory;
use crate::ffi::os::{GdrPin, Gdrdrv, Mapping};

/// GPU page size: gdrdrv pins and BAR1 mappings come in these units.
pub const GPU_PAGE: u64 = 64 << 10;

/// The ways of mapping GPU memory for the CPU, in probing order.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Bar1Method {
    /// GDRCopy's gdrdrv.
    Gdrdrv,
    /// The GPU's sysfs `resource1` at a known offset.
    SysfsResource1,
    /// A CUDA dma-buf, mmapped.
    DmaBuf,
}

impl std::fmt::Display for Bar1Method {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Self::Gdrdrv => "gdrdrv",
            Self::SysfsResource1 => "sysfs resource1",
            Self::DmaBuf => "dma-buf",
        })
    }
}

/// Why a probe could not map the range.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Bar1Unavailable {
    /// No gdrdrv device file (GDRCopy's module not loaded).
    GdrdrvAbsent {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// The device file exists but could not be opened.
    GdrdrvOpen {
        /// The file.
        path: PathBuf,
        /// The system's words.
        error: String,
    },
    /// An ioctl or mmap on gdrdrv failed (ENOTTY: the file is not gdrdrv).
    GdrdrvCall {
        /// Which call.
        call: &'static str,
        /// The system's words.
        error: String,
    },
    /// gdrdrv speaks another ABI than major version 2.
    GdrdrvVersion {
        /// `major << 16 | minor`.
        version: u32,
    },
    /// The range is not aligned to the 64 KiB GPU page.
    Unaligned {
        /// Its GPU address.
        gpu_ptr: u64,
        /// Its length.
        len: u64,
    },
    /// The GPU has no sysfs `resource1`.
    Resource1Absent {
        /// Where it was looked for.
        path: PathBuf,
    },
    /// `resource1` exists, but where the range lies in BAR1 is not known.
    Resource1OffsetUnknown {
        /// The file.
        path: PathBuf,
        /// BAR1's size.
        bar1_bytes: u64,
    },
    /// The range at the given offset does not fit in BAR1.
    Resource1TooSmall {
        /// BAR1's size.
        bar1_bytes: u64,
        /// Where the range would end.
        end: u64,
    },
    /// Mapping `resource1` failed.
    Resource1Map {
        /// The system's words.
        error: String,
    },
    /// CUDA would not export the range as a dma-buf.
    DmaBufExport {
        /// CUDA's words.
        error: String,
    },
    /// The dma-buf could not be mmapped.
    DmaBufMmap {
        /// The system's words.
        error: String,
    },
}

impl std::fmt::Display for Bar1Unavailable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::GdrdrvAbsent { path } => write!(
                f,
                "{} does not exist (install GDRCopy and load gdrdrv)",
                path.display()
            ),
            Self::GdrdrvOpen { path, error } => write!(f, "opening {}: {error}", path.display()),
            Self::GdrdrvCall { call, error } => write!(f, "gdrdrv {call}: {error}"),
            Self::GdrdrvVersion { version } => write!(
                f,
                "gdrdrv ABI {}.{} (this build speaks 2.x)",
                version >> 16,
                version & 0xffff
            ),
            Self::Unaligned { gpu_ptr, len } => write!(
                f,
                "GPU range {gpu_ptr:#x}+{len:#x} is not aligned to the 64 KiB GPU page"
            ),
            Self::Resource1Absent { path } => write!(f, "{} does not exist", path.display()),
            Self::Resource1OffsetUnknown { path, bar1_bytes } => write!(
                f,
                "{} ({bar1_bytes:#x} bytes) exists, but the offset of a cuMemAlloc'd buffer \
                 inside BAR1 cannot be learned without gdrdrv or a dma-buf",
                path.display()
            ),
            Self::Resource1TooSmall { bar1_bytes, end } => write!(
                f,
                "BAR1 is {bar1_bytes:#x} bytes, the range ends at {end:#x} (enable large BAR1 / \
                 above-4G decoding)"
            ),
            Self::Resource1Map { error } => write!(f, "mmap of resource1: {error}"),
            Self::DmaBufExport { error } => write!(f, "cuMemGetHandleForAddressRange: {error}"),
            Self::DmaBufMmap { error } => write!(
                f,
                "mmap of the CUDA dma-buf: {error} (the NVIDIA driver exports dma-bufs for \
                 devices to import, not for CPU mappings)"
            ),
        }
    }
}

/// GPU memory the probes map: its GPU address, length and a dma-buf export. Implemented by
/// [`DeviceMemory`]; tests implement it without a GPU.
pub trait GpuRange: Send + Sync {
    /// GPU address of the first byte.
    fn gpu_ptr(&self) -> u64;
    /// Length in bytes.
    fn len(&self) -> usize;
    /// Whether empty.
    fn is_empty(&self) -> bool {
        self.len() == 0
    }
    /// The whole range as a dma-buf descriptor.
    fn export_dma_buf(&self) -> Result<OwnedFd, GpuError>;
}

impl GpuRange for DeviceMemory {
    fn gpu_ptr(&self) -> u64 {
        self.ptr()
    }
    fn len(&self) -> usize {
        DeviceMemory::len(self)
    }
    fn export_dma_buf(&self) -> Result<OwnedFd, GpuError> {
        DeviceMemory::export_dma_buf(self, 0, DeviceMemory::len(self))
    }
}

/// Where the probes look.
#[derive(Clone, Debug)]
pub struct Bar1Env {
    /// `/dev` (gdrdrv).
    pub dev_root: PathBuf,
    /// `/sys` (the GPU's `resource1`).
    pub sys_root: PathBuf,
    /// The GPU's PCI address as sysfs spells it.
    pub gpu: String,
    /// The range's byte offset inside BAR1, when something outside this crate knows it; the
    /// `resource1` probe needs it.
    pub resource1_offset: Option<u64>,
}

impl Bar1Env {
    /// The real places, for GPU `gpu`.
    pub fn system(gpu: &str) -> Self {
        Self {
            dev_root: "/dev".into(),
            sys_root: "/sys".into(),
            gpu: gpu.into(),
            resource1_offset: None,
        }
    }
}

/// A CPU mapping of GPU memory, and what keeps it valid (a gdrdrv pin). Field order is drop
/// order: unmapped before unpinned.
pub struct Bar1Mapping {
    method: Bar1Method,
    map: Arc<Mapping>,
    _pin: Option<GdrPin>,
}

impl std::fmt::Debug for Bar1Mapping {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "Bar1Mapping({}, {:?})", self.method, self.map)
    }
}

impl Bar1Mapping {
    /// How it was made.
    pub fn method(&self) -> Bar1Method {
        self.method
    }
    /// The CPU mapping.
    pub fn mapping(&self) -> &Arc<Mapping> {
        &self.map
    }
}

/// Every probe that failed, in order, with its reason.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Bar1Failures(pub Vec<(Bar1Method, Bar1Unavailable)>);

impl std::fmt::Display for Bar1Failures {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        for (i, (m, r)) in self.0.iter().enumerate() {
            if i > 0 {
                f.write_str("; ")?;
            }
            write!(f, "{m}: {r}")?;
        }
        Ok(())
    }
}

fn gdrdrv(env: &Bar1Env, range: &dyn GpuRange) -> Result<Bar1Mapping, Bar1Unavailable> {
    let path = env.dev_root.join("gdrdrv");
    if !path.exists() {
        return Err(Bar1Unavailable::GdrdrvAbsent { path });
    }
    let (ptr, len) = (range.gpu_ptr(), range.len() as u64);
    if ptr % GPU_PAGE != 0 || len % GPU_PAGE != 0 {
        return Err(Bar1Unavailable::Unaligned { gpu_ptr: ptr, len });
    }
    let drv = Gdrdrv::open(&path).map_err(|e| Bar1Unavailable::GdrdrvOpen {
        path: path.clone(),
        error: e.to_string(),
    })?;
    let call = |call: &'static str| {
        move |e: std::io::Error| Bar1Unavailable::GdrdrvCall {
            call,
            error: e.to_string(),
        }
    };
    let version = drv.version().map_err(call("GET_VERSION"))?;
    if version >> 16 != 2 {
        return Err(Bar1Unavailable::GdrdrvVersion { version });
    }
    let pin = drv.pin(ptr, len).map_err(call("PIN_BUFFER"))?;
    let map = pin.map(range.len()).map_err(call("mmap"))?;
    Ok(Bar1Mapping {
        method: Bar1Method::Gdrdrv,
        map: Arc::new(map),
        _pin: Some(pin),
    })
}

fn resource1(env: &Bar1Env, range: &dyn GpuRange) -> Result<Bar1Mapping, Bar1Unavailable> {
    let path = crate::transport::iommu::gpu_dir(&env.sys_root, &env.gpu).join("resource1");
    let bar1_bytes = match std::fs::metadata(&path) {
        Ok(m) => m.len(),
        Err(_) => return Err(Bar1Unavailable::Resource1Absent { path }),
    };
    let Some(offset) = env.resource1_offset else {
        return Err(Bar1Unavailable::Resource1OffsetUnknown { path, bar1_bytes });
    };
    let end = offset.saturating_add(range.len() as u64);
    if end > bar1_bytes {
        return Err(Bar1Unavailable::Resource1TooSmall { bar1_bytes, end });
    }
    let map =
        Mapping::file(&path, offset, range.len()).map_err(|e| Bar1Unavailable::Resource1Map {
            error: e.to_string(),
        })?;
    Ok(Bar1Mapping {
        method: Bar1Method::SysfsResource1,
        map: Arc::new(map),
        _pin: None,
    })
}

fn dma_buf(range: &dyn GpuRange) -> Result<Bar1Mapping, Bar1Unavailable> {
    let fd = range
        .export_dma_buf()
        .map_err(|e| Bar1Unavailable::DmaBufExport {
            error: e.to_string(),
        })?;
    let map = Mapping::shared(fd, 0, range.len()).map_err(|e| Bar1Unavailable::DmaBufMmap {
        error: e.to_string(),
    })?;
    Ok(Bar1Mapping {
        method: Bar1Method::DmaBuf,
        map: Arc::new(map),
        _pin: None,
    })
}

/// Tries gdrdrv, then `resource1`, then a dma-buf, and returns the first mapping made, or every
/// reason in order. Each attempt is logged.
pub fn probe_bar1(env: &Bar1Env, range: &dyn GpuRange) -> Result<Bar1Mapping, Bar1Failures> {
    let mut failures = Vec::new();
    type Probe<'a> = Box<dyn Fn() -> Result<Bar1Mapping, Bar1Unavailable> + 'a>;
    let probes: [(Bar1Method, Probe<'_>); 3] = [
        (Bar1Method::Gdrdrv, Box::new(|| gdrdrv(env, range))),
        (
            Bar1Method::SysfsResource1,
            Box::new(|| resource1(env, range)),
        ),
        (Bar1Method::DmaBuf, Box::new(|| dma_buf(range))),
    ];
    for (method, probe) in probes {
        match probe() {
            Ok(m) => {
                tracing::info!(%method, mapping = ?m.map, "GPU memory mapped for the CPU");
                return Ok(m);
            }
            Err(reason) => {
                tracing::info!(%method, %reason, "BAR1 probe unavailable");
                failures.push((method, reason));
            }
        }
    }
    Err(Bar1Failures(failures))
}

/// `dev_root`/gdrdrv, for messages.
pub fn gdrdrv_path(dev_root: &Path) -> PathBuf {
    dev_root.join("gdrdrv")
}
