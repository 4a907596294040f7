//! Names of the transports and of the choice between them ([`TransportKind`],
//! [`TransportChoice`], [`Skipped`], the PCIe [`PathClass`] of a pair): plain data that errors, queues and the transport
//! selection all speak of, kept apart so that none of them imports another for it.
#![forbid(unsafe_code)]

/// Which path carries doorbells and data.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum TransportKind {
    /// The software controller: rings and data in GPU memory reached with batched CUDA
    /// copies, doorbells in pinned host memory.
    SoftwareController,
    /// A real SSD behind VFIO: rings and data in GPU memory, mapped for the SSD through a
    /// CPU mapping of the GPU's BAR1; the SSD's BAR0 doorbells registered with CUDA.
    VfioP2p,
    /// A real SSD behind VFIO: rings and data in hugepage host memory mapped for the SSD and
    /// registered with CUDA; only the doorbell write goes peer to peer.
    HostMemory,
    /// The GPU-resident controller model (`gpu_emu::resident`): rings, doorbells and media in GPU
    /// memory, served by a persistent kernel on reserved SMs.
    GpuController,
    /// A controller another process serves over vfio-user (SPDK's NVMe-oF target): rings and
    /// data in memfd memory shared with the server and registered with CUDA, doorbells in the
    /// page the server shares and polls; the host-memory layout on ordinary shared memory.
    VfioUser,
    /// Queue pairs a `gpunvme serve` daemon lends (`gpu_queues::transport::served`): rings,
    /// slot buffers and data in memory the daemon shares (sealed memfds) registered with
    /// CUDA, doorbells in the client's doorbell page that the daemon's controller reads.
    Served,
}

impl TransportKind {
    /// A short name for reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::SoftwareController => "software-controller",
            Self::VfioP2p => "vfio-p2p",
            Self::HostMemory => "host-memory",
            Self::GpuController => "gpu-controller",
            Self::VfioUser => "vfio-user",
            Self::Served => "served",
        }
    }

    /// Where the buffers `GpuQueues::alloc_buffer` hands out live, in words: GPU memory,
    /// except over vfio-user, whose controller (another process) reaches only memory shared
    /// with it, mapped into the GPU.
    pub fn buffer_memory(self) -> &'static str {
        match self {
            Self::VfioUser => "host memory shared with the controller and mapped into the GPU",
            Self::Served => "host memory the serving daemon shares, mapped into the GPU",
            _ => "GPU memory",
        }
    }
}

impl std::fmt::Display for TransportKind {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}

/// A transport that was not used, and why.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Skipped {
    /// The transport.
    pub kind: TransportKind,
    /// Why it was skipped or failed, in words a user can act on.
    pub reason: String,
}

/// `"software-controller: reason; vfio-p2p: ..."`.
pub fn list_skipped(skipped: &[Skipped]) -> String {
    skipped
        .iter()
        .map(|s| format!("{}: {}", s.kind, s.reason))
        .collect::<Vec<_>>()
        .join("; ")
}

/// Which transport runs, and why each one tried before it did not.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TransportChoice {
    /// The transport in use.
    pub chosen: TransportKind,
    /// Every transport tried before it, in order, with its reason.
    pub skipped: Vec<Skipped>,
    /// The PCIe path class between the GPU and the controller, where sysfs placed both (a real
    /// controller behind VFIO); `None` for the software controller and vfio-user.
    pub path: Option<PathClass>,
}

impl std::fmt::Display for TransportChoice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{}", self.chosen)?;
        if let Some(p) = self.path {
            write!(f, " over {p}")?;
        }
        if !self.skipped.is_empty() {
            write!(f, " (skipped {})", list_skipped(&self.skipped))?;
        }
        Ok(())
    }
}

/// How the path between two PCI devices runs, closest first (as `nvidia-smi topo -m`).
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash)]
pub enum PathClass {
    /// Through at most one PCIe switch.
    Pix,
    /// Through several PCIe switches, not through the host bridge.
    Pxb,
    /// Through a PCIe host bridge (the CPU's root complex).
    Phb,
    /// Between host bridges within one NUMA node.
    Node,
    /// Across NUMA nodes (the SMP interconnect between sockets).
    Sys,
}

impl PathClass {
    /// The name `nvidia-smi topo -m` uses: `PIX`, `PXB`, `PHB`, `NODE`, `SYS`.
    pub fn name(self) -> &'static str {
        match self {
            Self::Pix => "PIX",
            Self::Pxb => "PXB",
            Self::Phb => "PHB",
            Self::Node => "NODE",
            Self::Sys => "SYS",
        }
    }
}

impl std::fmt::Display for PathClass {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(self.name())
    }
}
