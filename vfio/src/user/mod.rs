//! vfio-user: an NVMe controller served by another process over a Unix socket (SPDK's NVMe-oF
//! target with its VFIOUSER transport, QEMU's vfio-user devices, libvfio-user servers), as an
//! [`nvme::Device`].
//!
//! The protocol carries what VFIO ioctls carry for a kernel device (device and region info,
//! region reads and writes, DMA map and unmap, reset) as messages on the socket
//! (`client`). Where a server offers parts of BAR0 as shared memory (SPDK offers the doorbell
//! page, which it polls), they are mmapped and written with plain volatile stores, as a PCI BAR
//! would be; the rest of BAR0 and the configuration space are reached by messages. DMA memory is
//! memfd-backed: each chunk is handed to the server with `VFIO_USER_DMA_MAP` and its
//! descriptor, at a device address this client chooses, and unmapped (`VFIO_USER_DMA_UNMAP`)
//! before it is freed, so the server's view of memory follows the same revocation rule as an
//! IOMMU's ([`crate::dma`]).
//!
//! # Why not rust-vmm's `vfio_user` crate
//! `vfio_user` 0.1.7 was read and left out, because as a client it falls short where this
//! project's rules are strict: its socket is private and has no timeouts (a server that stops
//! answering blocks the caller forever); it never checks a reply's error flag or message id
//! (`region_read` after an error reply reads the next message as register data); it ignores
//! short vectored writes; it computes `resettable` inverted; and it sends with SIGPIPE enabled,
//! which kills a Python or C host when the server goes away. The subset needed here (eight
//! commands) is ~300 lines with those waits bounded and replies checked.
//!
//! # Limits
//! - No interrupts: the driver polls completions, as it does everywhere.
//! - libvfio-user (SPDK's server side) accepts at most 16 DMA regions per client, so memory is
//!   shared in chunks of [`CHUNK_SIZE`] (64 MiB of address space each, backed by memory only
//!   where touched): about 1 GiB of DMA memory in small buffers at a time.

mod client;
mod device;
mod proto;

pub use self::device::{CHUNK_SIZE, SharedDma, VfioUserNvme, VfioUserOptions};

/// The `--device` prefix that names a vfio-user socket: `vfio-user:/path/to/cntrl`.
pub const SPEC_PREFIX: &str = "vfio-user:";
