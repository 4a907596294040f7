//! Whether the GPU's own DMA is translated by an IOMMU, read from sysfs (under an injectable
//! root, so tests use fake trees).
//!
//! CUDA hands the GPU the *bus* address of a registered BAR0 page. If the GPU sits in a
//! translating IOMMU domain (type `DMA` or `DMA-FQ`), that address is looked up in the GPU's
//! page table, where nothing maps it, and the doorbell write faults or silently never arrives
//! (../shared/design/hardware-paths.md). So GPU doorbells are enabled only when the GPU's group
//! is `identity` (passthrough) or there is no IOMMU in front of the GPU at all.
#![forbid(unsafe_code)]

use std::path::{Path, PathBuf};

use crate::error::GpuError;

/// How the GPU's DMA reaches the bus, as far as GPU doorbells are concerned (both are fine).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuIommu {
    /// No IOMMU groups exist on this machine: no IOMMU is enabled.
    NoIommu,
    /// IOMMU groups exist, but the GPU is in none: no IOMMU translates its DMA.
    NotInGroup,
    /// The GPU's group is identity-mapped (`iommu=pt`, or its type set to `identity`).
    Identity {
        /// The group number.
        group: u32,
    },
}

impl std::fmt::Display for GpuIommu {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::NoIommu => f.write_str("no IOMMU"),
            Self::NotInGroup => f.write_str("GPU behind no IOMMU"),
            Self::Identity { group } => write!(f, "GPU IOMMU group {group} is identity-mapped"),
        }
    }
}

/// The GPU's sysfs directory under `sys_root` (normally `/sys`).
pub fn gpu_dir(sys_root: &Path, gpu: &str) -> PathBuf {
    sys_root.join("bus/pci/devices").join(gpu)
}

fn io_err(op: String, source: std::io::Error) -> GpuError {
    GpuError::Os { op, source }
}

/// Checks that GPU `gpu` (a PCI address as sysfs spells it, `0000:3b:00.0`) may ring an SSD's
/// doorbells: its IOMMU group's `type` is `identity`, or no IOMMU translates its DMA. Every
/// refusal says how to fix it.
pub fn check_gpu_iommu(sys_root: &Path, gpu: &str) -> Result<GpuIommu, GpuError> {
    let dev = gpu_dir(sys_root, gpu);
    if !dev.exists() {
        return Err(GpuError::GpuIommuUnknown {
            gpu: gpu.into(),
            reason: format!(
                "{} does not exist (is the GPU's PCI address right, and sysfs mounted?)",
                dev.display()
            ),
        });
    }
    let link = dev.join("iommu_group");
    let target = match std::fs::read_link(&link) {
        Ok(t) => t,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            let groups = sys_root.join("kernel/iommu_groups");
            let any = match std::fs::read_dir(&groups) {
                Ok(mut d) => d.next().is_some(),
                Err(e) if e.kind() == std::io::ErrorKind::NotFound => false,
                Err(e) => return Err(io_err(format!("reading {}", groups.display()), e)),
            };
            return Ok(if any {
                GpuIommu::NotInGroup
            } else {
                GpuIommu::NoIommu
            });
        }
        Err(e) => return Err(io_err(format!("reading {}", link.display()), e)),
    };
    let group: u32 = target
        .file_name()
        .and_then(|n| n.to_str())
        .and_then(|n| n.parse().ok())
        .ok_or_else(|| GpuError::GpuIommuUnknown {
            gpu: gpu.into(),
            reason: format!(
                "{} points to {}, which names no group number",
                link.display(),
                target.display()
            ),
        })?;
    // Real sysfs links to ../../../../kernel/iommu_groups/N; read the group there, under the
    // same root (fake trees need not have valid relative links).
    let group_dir = sys_root.join("kernel/iommu_groups").join(group.to_string());
    if !group_dir.exists() {
        return Err(GpuError::GpuIommuUnknown {
            gpu: gpu.into(),
            reason: format!(
                "{} names IOMMU group {group}, which does not exist under {}",
                link.display(),
                sys_root.join("kernel/iommu_groups").display()
            ),
        });
    }
    let type_file = group_dir.join("type");
    let domain = match std::fs::read_to_string(&type_file) {
        Ok(s) => s.trim().to_string(),
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => {
            return Err(GpuError::GpuIommuUnknown {
                gpu: gpu.into(),
                reason: format!(
                    "{} is missing (kernels before 5.11 do not report the domain type); boot \
                     with `iommu=pt` so the GPU's DMA is not translated, then pass this check \
                     on a newer kernel",
                    type_file.display()
                ),
            });
        }
        Err(e) => return Err(io_err(format!("reading {}", type_file.display()), e)),
    };
    if domain == "identity" {
        Ok(GpuIommu::Identity { group })
    } else {
        Err(GpuError::GpuIommuTranslated {
            gpu: gpu.into(),
            group,
            domain,
        })
    }
}
