//! Choosing how GPU queues reach the controller, at run time, always saying why.
//!
//! Transports, in the order tried:
//! - [`TransportKind::SoftwareController`]: the software controller, an emulator (the
//!   `gpu_emu` crate builds its queues, and reports its choice through [`select`] too); never
//!   a choice for a real controller.
//! - [`TransportKind::VfioP2p`] ([`p2p`]): a real SSD behind VFIO; its BAR0 doorbells
//!   registered with CUDA ([`crate::ffi::os::Bar0Doorbells`]), rings and data in GPU memory that VFIO maps
//!   for the SSD through a CPU mapping of the GPU's BAR1 ([`bar1`]). Needs VFIO type1.
//! - [`TransportKind::HostMemory`] ([`host`]): rings and data in the SSD's hugepage host
//!   memory registered with CUDA; only the doorbell write crosses PCIe peer to peer.
//! - [`TransportKind::VfioUser`] ([`vfio_user`]): a controller served by another process
//!   over vfio-user; the host-memory layout in memory shared with that process, doorbells
//!   included. The only transport for such a controller ([`open_vfio_user`]).
//! - [`TransportKind::Served`] ([`served`]): pairs a `gpunvme serve` daemon created and lent
//!   this process, in memory it shares; the daemon's controller (any of the above behind it)
//!   reads the doorbells from the client's page. The only transport for a served device.
//!
//! The real-SSD transports (vfio-p2p and host-memory) both refuse unless the GPU's own DMA is
//! untranslated ([`iommu`]): a GPU in a translating IOMMU domain never lands its doorbell
//! writes. [`select`] tries the candidates in order and returns the first that works with a
//! [`TransportChoice`] naming every transport skipped before it and why, or
//! [`GpuError::NoTransport`] with every reason: never a silent fallback.
//!
//! Unsafe code (mmap, ioctls, touching pages, VFIO and CUDA registrations of raw ranges) lives
//! only in `crate::ffi` (its `os` and backend modules); every module here forbids it.

pub mod bar1;
mod build;
pub use build::QueueLayout;
pub mod host;
pub mod iommu;
pub mod p2p;
pub mod probe;
pub mod served;
pub mod topology;
pub mod vfio_user;

use std::path::PathBuf;
use std::sync::Arc;

use nvme::Controller;

use crate::error::GpuError;
use crate::ffi::Cuda;
use crate::queues::{GpuQueueOptions, GpuQueues, TransportKind};
pub use crate::transport_kind::{Skipped, TransportChoice, list_skipped};
use topology::PathClass;

/// One entry of the order [`select`] walks.
pub enum Candidate<'a, T> {
    /// Known not to apply here, with the reason.
    Unavailable(TransportKind, String),
    /// Try it.
    Try(TransportKind, Box<dyn FnOnce() -> Result<T, GpuError> + 'a>),
}

/// Walks `candidates` in order: the first `Try` that succeeds wins; everything before it is
/// recorded with its reason (and logged). If none succeeds: [`GpuError::NoTransport`] with
/// every reason.
pub fn select<T>(candidates: Vec<Candidate<'_, T>>) -> Result<(T, TransportChoice), GpuError> {
    let mut skipped = Vec::new();
    for c in candidates {
        let (kind, reason) = match c {
            Candidate::Unavailable(kind, reason) => (kind, reason),
            Candidate::Try(kind, attempt) => match attempt() {
                Ok(t) => {
                    let choice = TransportChoice {
                        chosen: kind,
                        skipped,
                        path: None,
                    };
                    tracing::info!(transport = %choice, "GPU queue transport chosen");
                    return Ok((t, choice));
                }
                Err(e) => (kind, error_chain(&e)),
            },
        };
        tracing::info!(transport = %kind, %reason, "GPU queue transport skipped");
        skipped.push(Skipped { kind, reason });
    }
    tracing::warn!(tried = %list_skipped(&skipped), "no GPU queue transport works");
    Err(GpuError::NoTransport { skipped })
}

/// An error and its sources, one line.
fn error_chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        s.push_str(": ");
        s.push_str(&c.to_string());
        cur = c.source();
    }
    s
}

/// Where the real-SSD transports look on the system (tests and containers point elsewhere).
#[derive(Clone, Debug)]
pub struct TransportOptions {
    /// `/sys`.
    pub sys_root: PathBuf,
    /// `/dev`.
    pub dev_root: PathBuf,
    /// Offset of GPU memory inside BAR1 for the `resource1` probe, when known (see [`bar1`]).
    pub resource1_offset: Option<u64>,
}

impl Default for TransportOptions {
    fn default() -> Self {
        Self {
            sys_root: "/sys".into(),
            dev_root: "/dev".into(),
            resource1_offset: None,
        }
    }
}

/// Builds GPU queues on `controller`, served over vfio-user by `dev`'s server: the vfio-user
/// transport, the only one that applies (software-controller serves only the software
/// controller; vfio-p2p and host-memory need a PCI function).
pub fn open_vfio_user(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    dev: Arc<vfio::VfioUserNvme>,
    opts: &GpuQueueOptions,
) -> Result<(GpuQueues, TransportChoice), GpuError> {
    let socket = dev.socket_path().display().to_string();
    let not_pci = format!("{socket} is served over vfio-user, not a PCI function");
    select(vec![
        Candidate::Unavailable(
            TransportKind::SoftwareController,
            format!("{socket} is served over vfio-user, not the software controller"),
        ),
        Candidate::Unavailable(TransportKind::VfioP2p, not_pci.clone()),
        Candidate::Unavailable(TransportKind::HostMemory, not_pci),
        Candidate::Try(
            TransportKind::VfioUser,
            Box::new(|| vfio_user::build(cuda, controller, dev, opts)),
        ),
    ])
}

/// Builds GPU queues on `controller`, a real controller bound to vfio-pci (`dev`), with the
/// first transport that works: vfio-p2p, then host-memory. The choice is logged and returned
/// for the caller to print; software-controller is listed as skipped (it serves only its own
/// emulated controller).
pub fn open(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    dev: Arc<vfio::VfioNvme>,
    opts: &GpuQueueOptions,
    topts: &TransportOptions,
) -> Result<(GpuQueues, TransportChoice), GpuError> {
    let not_emu = format!(
        "{} is a real controller behind VFIO, not the software controller",
        dev.address()
    );
    let only = only_transport(gpunvme_settings::GPU_TRANSPORT.value().as_deref())?;
    let path = pair_path(cuda, &dev.address().to_string(), topts);
    let d2 = dev.clone();
    fn candidate<'a>(
        only: Option<TransportKind>,
        kind: TransportKind,
        c: Candidate<'a, GpuQueues>,
    ) -> Candidate<'a, GpuQueues> {
        match only {
            Some(o) if o != kind => Candidate::Unavailable(
                kind,
                format!("{TRANSPORT_ENV}={} asks for {o} only", o.name()),
            ),
            _ => c,
        }
    }
    let p2p = match p2p_skip(only, path) {
        Some(why) => Candidate::Unavailable(TransportKind::VfioP2p, why),
        None => Candidate::Try(
            TransportKind::VfioP2p,
            Box::new(|| p2p::build(cuda, controller, dev, opts, topts)),
        ),
    };
    let (queues, mut choice) = select(vec![
        Candidate::Unavailable(TransportKind::SoftwareController, not_emu),
        candidate(only, TransportKind::VfioP2p, p2p),
        candidate(
            only,
            TransportKind::HostMemory,
            Candidate::Try(
                TransportKind::HostMemory,
                Box::new(|| host::build(cuda, controller, d2, opts, topts)),
            ),
        ),
    ])?;
    choice.path = path;
    Ok((queues, choice))
}

/// The PCIe path class between `cuda`'s GPU and the controller at `controller` (a PCI
/// address), from `topts.sys_root`; `None`, logged, where either cannot be placed (the choice
/// then rests on the transports' own checks and the probe read).
fn pair_path(cuda: &Cuda, controller: &str, topts: &TransportOptions) -> Option<PathClass> {
    let placed = cuda
        .pci_bus_id()
        .and_then(|gpu| topology::pair_class(&topts.sys_root, &gpu, controller));
    match placed {
        Ok(class) => Some(class),
        Err(e) => {
            tracing::info!(%controller, error = %e, "GPU-SSD path class unknown");
            None
        }
    }
}

/// Why vfio-p2p is not tried for this (GPU, controller) pair, if it is not: the pair's path
/// class rules it out ([`topology::p2p_verdict`]), unless the setting asks for vfio-p2p alone
/// (then it is tried whatever the path, and its probe read decides). Each pair is judged on its
/// own: one GPU may use vfio-p2p with the SSD behind its switch and host memory with an SSD on
/// the other socket.
fn p2p_skip(only: Option<TransportKind>, path: Option<PathClass>) -> Option<String> {
    if only == Some(TransportKind::VfioP2p) {
        return None;
    }
    let verdict = topology::p2p_verdict(path?).err()?;
    Some(format!(
        "{verdict}; host-memory keeps rings and data in host memory ({TRANSPORT_ENV}={} tries \
         vfio-p2p anyway)",
        TransportKind::VfioP2p.name()
    ))
}

/// The setting that restricts a VFIO device's GPU queues to one transport (`vfio-p2p` or
/// `host-memory`), e.g. to bring the host-memory rings up before P2P on a new SSD.
const TRANSPORT_ENV: &str = gpunvme_settings::GPU_TRANSPORT.name;

/// The transport `GPUNVME_GPU_TRANSPORT` names, if set; anything but a real-SSD transport's name is
/// an error (a typo must not silently try every transport).
fn only_transport(var: Option<&str>) -> Result<Option<TransportKind>, GpuError> {
    match var.map(str::trim) {
        None | Some("") => Ok(None),
        Some(v) if v == TransportKind::VfioP2p.name() => Ok(Some(TransportKind::VfioP2p)),
        Some(v) if v == TransportKind::HostMemory.name() => Ok(Some(TransportKind::HostMemory)),
        Some(v) => Err(GpuError::InvalidArgument(format!(
            "{TRANSPORT_ENV}={v:?}: expected {} or {}",
            TransportKind::VfioP2p.name(),
            TransportKind::HostMemory.name()
        ))),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_transport_variable_names_one_real_ssd_transport_or_is_refused() {
        assert_eq!(only_transport(None).unwrap(), None);
        assert_eq!(only_transport(Some("")).unwrap(), None);
        assert_eq!(
            only_transport(Some("host-memory")).unwrap(),
            Some(TransportKind::HostMemory)
        );
        assert_eq!(
            only_transport(Some(" vfio-p2p ")).unwrap(),
            Some(TransportKind::VfioP2p)
        );
        assert!(only_transport(Some("hostmemory")).is_err());
        assert!(only_transport(Some("software-controller")).is_err());
    }

    #[test]
    fn the_path_class_rules_vfio_p2p_out_only_across_sockets_and_the_setting_overrides() {
        for near in [
            PathClass::Pix,
            PathClass::Pxb,
            PathClass::Phb,
            PathClass::Node,
        ] {
            assert_eq!(p2p_skip(None, Some(near)), None, "{near}");
        }
        assert_eq!(p2p_skip(None, None), None, "an unknown path is tried");
        let why = p2p_skip(None, Some(PathClass::Sys)).unwrap();
        assert!(why.contains("SYS") && why.contains("host-memory"), "{why}");
        assert!(why.contains(TRANSPORT_ENV), "{why}");
        assert_eq!(
            p2p_skip(Some(TransportKind::VfioP2p), Some(PathClass::Sys)),
            None
        );
        assert!(p2p_skip(Some(TransportKind::HostMemory), Some(PathClass::Sys)).is_some());
    }
}
