//! Where GPUs and NVMe controllers sit on PCIe, read from sysfs (under an injectable root, so
//! tests use fake trees): the path class of each (GPU, controller) pair, in the classes
//! `nvidia-smi topo -m` prints, and the matrix of them (`gpunvme topology`).
//!
//! A device's place is its canonical sysfs path, `devices/pciDDDD:BB/<root port>/<switch
//! ports>.../<device>`: the first component is its host bridge, the rest the PCI bridges down to
//! it. Two devices under one host bridge meet at their deepest common bridge: a switch port
//! below the root port ([`PathClass::Pix`] when each is one hop below that switch,
//! [`PathClass::Pxb`] when either is behind a further switch), or the root port or the host
//! bridge itself ([`PathClass::Phb`]). Under different host bridges, their NUMA nodes
//! (`numa_node`) decide: the same node ([`PathClass::Node`]) or not ([`PathClass::Sys`]).
//! Peer-to-peer DMA between a GPU and an SSD works best at `PIX`/`PXB` (it stays in the
//! switches), usually at `PHB`, and is often slow or refused across host bridges.
#![forbid(unsafe_code)]

use std::fmt;
use std::path::{Path, PathBuf};

use crate::error::GpuError;

pub use crate::transport_kind::PathClass;

/// One PCI device's place: its host bridge, the bridges down to it, its NUMA node.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Place {
    /// The device's address (`0000:3b:00.0`).
    pub address: String,
    /// Its host bridge (`pci0000:3a`).
    pub host_bridge: String,
    /// The PCI bridges from the root port down to the device, the device last.
    pub chain: Vec<String>,
    /// Its NUMA node, where sysfs says one (`numa_node` is -1 on machines without).
    pub numa_node: Option<u32>,
}

fn os(op: String, source: std::io::Error) -> GpuError {
    GpuError::Os { op, source }
}

/// Where device `address` sits, from `sys_root` (normally `/sys`).
pub fn place(sys_root: &Path, address: &str) -> Result<Place, GpuError> {
    let link = sys_root.join("bus/pci/devices").join(address);
    let real =
        std::fs::canonicalize(&link).map_err(|e| os(format!("resolving {}", link.display()), e))?;
    let parts: Vec<String> = real
        .components()
        .map(|c| c.as_os_str().to_string_lossy().into_owned())
        .collect();
    let Some(at) = parts
        .iter()
        .position(|p| p.starts_with("pci") && p.contains(':'))
    else {
        return Err(GpuError::InvalidArgument(format!(
            "{}: {} is not below a PCI host bridge (pciDDDD:BB)",
            address,
            real.display()
        )));
    };
    let chain = parts[at + 1..].to_vec();
    if chain.last().map(String::as_str) != Some(address) {
        return Err(GpuError::InvalidArgument(format!(
            "{address}: sysfs resolves it to {}, which does not end in its address",
            real.display()
        )));
    }
    let numa_node = std::fs::read_to_string(real.join("numa_node"))
        .ok()
        .and_then(|s| s.trim().parse::<i64>().ok())
        .and_then(|n| u32::try_from(n).ok());
    Ok(Place {
        address: address.to_owned(),
        host_bridge: parts[at].clone(),
        chain,
        numa_node,
    })
}

/// The path class between two placed devices.
pub fn classify(a: &Place, b: &Place) -> PathClass {
    if a.host_bridge != b.host_bridge {
        return match (a.numa_node, b.numa_node) {
            (Some(x), Some(y)) if x != y => PathClass::Sys,
            _ => PathClass::Node,
        };
    }
    // The bridges both paths share, from the root port down.
    let common = a
        .chain
        .iter()
        .zip(&b.chain)
        .take_while(|(x, y)| x == y)
        .count();
    // Sharing nothing (different root ports) or only the root port: through the host bridge.
    if common <= 1 {
        return PathClass::Phb;
    }
    // Below a switch port: one switch when each device is one hop under the shared port (a
    // downstream port of the shared switch, then the device).
    let below = |p: &Place| p.chain.len() - common;
    if below(a) <= 2 && below(b) <= 2 {
        PathClass::Pix
    } else {
        PathClass::Pxb
    }
}

/// The path class between a GPU and a controller (PCI addresses) under `sys_root`.
pub fn pair_class(sys_root: &Path, gpu: &str, controller: &str) -> Result<PathClass, GpuError> {
    Ok(classify(
        &place(sys_root, gpu)?,
        &place(sys_root, controller)?,
    ))
}

/// Whether an SSD's DMA into GPU memory (the vfio-p2p transport: the SSD reads its commands
/// from GPU memory and writes data there) is worth trying over a path of `class`: `Err` with
/// the reason where it is not. Across sockets (`SYS`) peer-to-peer reads through the CPUs'
/// interconnect are refused or slow on most platforms (NVIDIA's GPUDirect RDMA guide asks for
/// devices under one PCIe switch or root complex), so such a pair keeps its rings and data in
/// host memory; every nearer class is tried, and the transport's probe read decides.
pub fn p2p_verdict(class: PathClass) -> Result<(), String> {
    match class {
        PathClass::Sys => Err(format!(
            "the GPU and the SSD are on different sockets ({class}): an SSD's peer-to-peer reads \
             of GPU memory across the CPUs' interconnect are refused or slow on most platforms"
        )),
        _ => Ok(()),
    }
}

/// PCI devices of one kind found in sysfs: NVIDIA display or 3D controllers (GPUs), or NVMe
/// controllers (class 01:08:02).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum DeviceKind {
    /// NVIDIA GPUs (vendor 0x10de, class 0x03xxxx).
    NvidiaGpu,
    /// NVMe controllers (class 0x010802), whatever driver holds them.
    Nvme,
}

/// The addresses of every device of `kind` under `sys_root`, sorted.
pub fn find(sys_root: &Path, kind: DeviceKind) -> Result<Vec<String>, GpuError> {
    let dir = sys_root.join("bus/pci/devices");
    let entries = match std::fs::read_dir(&dir) {
        Ok(e) => e,
        Err(e) if e.kind() == std::io::ErrorKind::NotFound => return Ok(Vec::new()),
        Err(e) => return Err(os(format!("listing {}", dir.display()), e)),
    };
    let read = |p: PathBuf| std::fs::read_to_string(p).map(|s| s.trim().to_owned()).ok();
    let mut out = Vec::new();
    for e in entries {
        let e = e.map_err(|e| os(format!("listing {}", dir.display()), e))?;
        let p = e.path();
        let class = read(p.join("class")).unwrap_or_default();
        let vendor = read(p.join("vendor")).unwrap_or_default();
        let hit = match kind {
            DeviceKind::NvidiaGpu => vendor == "0x10de" && class.starts_with("0x03"),
            DeviceKind::Nvme => class == "0x010802",
        };
        if hit {
            out.push(e.file_name().to_string_lossy().into_owned());
        }
    }
    out.sort();
    Ok(out)
}

/// The path class of every (GPU, controller) pair.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Matrix {
    /// The GPUs (rows).
    pub gpus: Vec<Place>,
    /// The controllers (columns).
    pub controllers: Vec<Place>,
    /// `classes[g][c]`: GPU `g` to controller `c`.
    pub classes: Vec<Vec<PathClass>>,
}

impl Matrix {
    /// The matrix of `gpus` against `controllers` (PCI addresses) under `sys_root`.
    pub fn of(sys_root: &Path, gpus: &[String], controllers: &[String]) -> Result<Self, GpuError> {
        let gpus = gpus
            .iter()
            .map(|a| place(sys_root, a))
            .collect::<Result<Vec<_>, _>>()?;
        let controllers = controllers
            .iter()
            .map(|a| place(sys_root, a))
            .collect::<Result<Vec<_>, _>>()?;
        let classes = gpus
            .iter()
            .map(|g| controllers.iter().map(|c| classify(g, c)).collect())
            .collect();
        Ok(Self {
            gpus,
            controllers,
            classes,
        })
    }

    /// For each GPU, the controllers nearest to it (all of its best class).
    pub fn nearest(&self) -> Vec<Vec<usize>> {
        self.classes
            .iter()
            .map(|row| match row.iter().min() {
                Some(best) => (0..row.len()).filter(|&c| row[c] == *best).collect(),
                None => Vec::new(),
            })
            .collect()
    }

    /// Which GPUs drive which controllers when every GPU works on the controllers at once
    /// (`perf --gpu --gpu-id all` over several `--device`): (GPU, controller) pairs, in GPU
    /// then controller order. A pair is made where the controller is among the GPU's nearest,
    /// or the GPU among the controller's nearest: so every GPU drives at least one controller
    /// and every controller is driven by at least one GPU; under a PCIe switch with two GPUs
    /// and two drives each GPU drives those two, and where all paths are alike (a flat VM, or
    /// every drive on the other socket) every GPU drives every controller.
    pub fn pairs(&self) -> Vec<(usize, usize)> {
        let near_gpu = self.nearest();
        let columns = self.controllers.len();
        let near_ctrl: Vec<Option<PathClass>> = (0..columns)
            .map(|c| self.classes.iter().map(|row| row[c]).min())
            .collect();
        let mut out = Vec::new();
        for (g, row) in self.classes.iter().enumerate() {
            for (c, class) in row.iter().enumerate() {
                if near_gpu[g].contains(&c) || near_ctrl[c] == Some(*class) {
                    out.push((g, c));
                }
            }
        }
        out
    }
}

impl fmt::Display for Matrix {
    /// One row per GPU, one column per controller, then the legend.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.gpus.is_empty() || self.controllers.is_empty() {
            writeln!(
                f,
                "{} GPU(s), {} NVMe controller(s): no pair to classify",
                self.gpus.len(),
                self.controllers.len()
            )?;
            // Still say where each device is: the host bridge and NUMA node decide the class
            // once the other side appears.
            for (what, list) in [("GPU", &self.gpus), ("NVMe", &self.controllers)] {
                for p in list.iter() {
                    let numa = p.numa_node.map_or("-".to_owned(), |n| n.to_string());
                    writeln!(
                        f,
                        "{what} {} under host bridge {}, NUMA node {numa}",
                        p.address, p.host_bridge
                    )?;
                }
            }
            return Ok(());
        }
        write!(f, "{:<16}", "")?;
        for c in &self.controllers {
            write!(f, " {:>13}", c.address)?;
        }
        writeln!(f, "  NUMA")?;
        for (g, row) in self.gpus.iter().zip(&self.classes) {
            write!(f, "{:<16}", format!("GPU {}", g.address))?;
            for class in row {
                write!(f, " {:>13}", class.name())?;
            }
            let numa = g.numa_node.map_or("-".to_owned(), |n| n.to_string());
            writeln!(f, "  {numa}")?;
        }
        writeln!(
            f,
            "PIX: at most one PCIe switch; PXB: several switches; PHB: through the host bridge; \
             NODE: between host bridges of one NUMA node; SYS: across NUMA nodes"
        )
    }
}
