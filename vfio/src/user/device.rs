//! [`VfioUserNvme`]: an NVMe controller behind a vfio-user socket, as an [`nvme::Device`].
//!
//! No unsafe operation here; the one `unsafe` item is the DMA mapper's `map`, an unsafe trait
//! method whose caller keeps the memory alive until it is unmapped.

use std::fs::File;
use std::io;
use std::os::fd::BorrowedFd;
use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use memmap2::MmapOptions;
use vfio_bindings::bindings::vfio as b;
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use super::client::Client;
use super::proto::{self, Command};
use crate::Error;
use crate::caps::{self, RegionInfo};
use crate::device::{PCI_COMMAND, PCI_COMMAND_MASTER, PCI_COMMAND_MEMORY};
use crate::dma::{DeviceAddrs, DmaPool, DmaStats, HostMemory, Mapper};
use crate::iova::IovaAllocator;
use crate::mmio::{Bar, BarError, RegionPort};
use crate::sysfs::NVME_CLASS;

/// Size of the memfd chunks DMA memory is shared in (see the module's limits).
pub const CHUNK_SIZE: usize = 64 << 20;

/// Command register: INTx emulation disabled.
const PCI_COMMAND_INTX_DISABLE: u16 = 1 << 10;

/// Smallest BAR0 that holds the NVMe registers and one pair of doorbells.
const MIN_BAR0: u64 = 0x1000 + 8;

/// Device addresses handed to the server: it translates them through its own table of our
/// mappings, so any range works; this one keeps 0 and low addresses out of PRP entries.
const IOVA_RANGE: (u64, u64) = (2 << 20, (1 << 47) - 1);

/// Room offered for a region-info reply (structure plus capabilities).
const REGION_INFO_ROOM: u32 = 512;
/// Interrupt types asked about: VFIO PCI's five (INTx, MSI, MSI-X, error, request); a server
/// claiming more is not asked about the rest.
const MAX_IRQ_TYPES: u32 = 5;

/// How to open a controller over vfio-user.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct VfioUserOptions {
    /// Longest wait for any one reply from the server (default 10 s).
    pub timeout: Duration,
    /// Ask the server to reset the device first, if it says it can (default true).
    pub reset: bool,
}

impl Default for VfioUserOptions {
    fn default() -> Self {
        Self {
            timeout: Duration::from_secs(10),
            reset: true,
        }
    }
}

/// An NVMe controller served over vfio-user, with its doorbells mapped (where the server shares
/// them) and DMA memory shared as memfds.
///
/// Dropping it (and every DMA buffer it handed out) unmaps the memory from the server and closes
/// the socket, which the server takes as the client going away.
pub struct VfioUserNvme {
    path: PathBuf,
    bar: Bar,
    dma: DmaPool,
    mapper: Arc<UserMapper>,
    vendor: u16,
    irqs: Vec<u32>,
}

impl std::fmt::Debug for VfioUserNvme {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("VfioUserNvme")
            .field("path", &self.path)
            .field("vendor", &format_args!("0x{:04x}", self.vendor))
            .field("bar", &self.bar)
            .finish()
    }
}

/// Region reads and writes by message.
struct UserPort {
    client: Arc<Client>,
    region: u32,
}

impl RegionPort for UserPort {
    fn read(&self, offset: u64, buf: &mut [u8]) -> io::Result<()> {
        region_read(&self.client, self.region, offset, buf).map_err(io::Error::other)
    }
    fn write(&self, offset: u64, buf: &[u8]) -> io::Result<()> {
        region_write(&self.client, self.region, offset, buf).map_err(io::Error::other)
    }
}

fn region_read(client: &Client, region: u32, offset: u64, buf: &mut [u8]) -> Result<(), Error> {
    let req = proto::RegionAccess {
        offset,
        region,
        count: buf.len() as u32,
    };
    let reply = client.request(Command::RegionRead, &[req.as_bytes()], None)?;
    let head = size_of::<proto::RegionAccess>();
    if reply.payload.len() != head + buf.len() {
        return Err(Error::VfioUserProtocol {
            path: client.path().to_owned(),
            command: Command::RegionRead.name(),
            what: format!(
                "{} bytes of reply for a {}-byte read",
                reply.payload.len(),
                buf.len()
            ),
        });
    }
    buf.copy_from_slice(&reply.payload[head..]);
    Ok(())
}

fn region_write(client: &Client, region: u32, offset: u64, buf: &[u8]) -> Result<(), Error> {
    let req = proto::RegionAccess {
        offset,
        region,
        count: buf.len() as u32,
    };
    client.request(Command::RegionWrite, &[req.as_bytes(), buf], None)?;
    Ok(())
}

/// Shares memfd chunks with the server.
struct UserMapper {
    client: Arc<Client>,
    iova: Mutex<IovaAllocator>,
}

impl UserMapper {
    fn iova(&self) -> std::sync::MutexGuard<'_, IovaAllocator> {
        // Every update is one call on the allocator: a poisoned lock holds consistent data.
        self.iova.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Shares the whole of `fd` (`len` bytes) with the server at a fresh IOVA aligned to
    /// `align` (DMA_MAP by descriptor: the server maps the file itself, so nothing at any
    /// address of ours is involved).
    fn map_fd(&self, fd: BorrowedFd<'_>, len: usize, align: usize) -> Result<u64, Error> {
        let iova = self
            .iova()
            .alloc(len as u64, align as u64)
            .ok_or(Error::IovaExhausted { len })?;
        let req = proto::DmaMap {
            argsz: size_of::<proto::DmaMap>() as u32,
            flags: proto::DMA_READ | proto::DMA_WRITE,
            offset: 0,
            address: iova,
            size: len as u64,
        };
        if let Err(e) = self
            .client
            .request(Command::DmaMap, &[req.as_bytes()], Some(fd))
        {
            self.iova().free(iova, len as u64);
            return Err(e);
        }
        Ok(iova)
    }
}

/// Memory of another owner shared with the server by descriptor
/// ([`VfioUserNvme::map_shared`]): the controller reaches it at
/// [`SharedDma::device_address`] until this is dropped, which unmaps it (DMA_UNMAP).
pub struct SharedDma {
    iova: u64,
    len: usize,
    mapper: Arc<UserMapper>,
}

impl std::fmt::Debug for SharedDma {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("SharedDma")
            .field("iova", &format_args!("{:#x}", self.iova))
            .field("len", &self.len)
            .finish()
    }
}

impl SharedDma {
    /// Where the controller reaches the first byte.
    pub fn device_address(&self) -> u64 {
        self.iova
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.len
    }

    /// Never: shared memory is at least a page.
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }
}

impl Drop for SharedDma {
    fn drop(&mut self) {
        if let Err(e) = self
            .mapper
            .unmap(&DeviceAddrs::Contiguous(self.iova), self.len)
        {
            // The server may still reach the memory: its IOVA is not reused (unmap frees it
            // only on success) and the server holds its own mapping of the file.
            tracing::warn!(iova = self.iova, len = self.len, error = %e, "DMA_UNMAP of shared memory");
        }
    }
}

impl Mapper for Arc<UserMapper> {
    #[expect(
        unsafe_code,
        reason = "implements the unsafe trait method; performs no unsafe operation"
    )]
    unsafe fn map(
        &self,
        _vaddr: usize,
        len: usize,
        align: usize,
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<DeviceAddrs, Error> {
        let fd = fd.ok_or(Error::VfioUserNeedsFd)?;
        Ok(DeviceAddrs::Contiguous(self.map_fd(fd, len, align)?))
    }

    fn unmap(&self, addrs: &DeviceAddrs, len: usize) -> Result<(), Error> {
        let DeviceAddrs::Contiguous(iova) = *addrs else {
            unreachable!("vfio-user chunks are always contiguous")
        };
        let req = proto::DmaUnmap {
            argsz: size_of::<proto::DmaUnmap>() as u32,
            flags: 0,
            address: iova,
            size: len as u64,
        };
        self.client
            .request(Command::DmaUnmap, &[req.as_bytes()], None)?;
        self.iova().free(iova, len as u64);
        Ok(())
    }

    fn host_memory(&self, len: usize, _prefer_hugepages: bool) -> Result<HostMemory, Error> {
        let io = |source| Error::HostMemory { len, source };
        let fd = rustix::fs::memfd_create("gpunvme-dma", rustix::fs::MemfdFlags::CLOEXEC)
            .map_err(|e| io(e.into()))?;
        rustix::fs::ftruncate(&fd, len as u64).map_err(|e| io(e.into()))?;
        let file = File::from(fd);
        // Shared, not populated: the server maps the same pages through the descriptor, and
        // only pages that are touched take memory.
        let map = MmapOptions::new().len(len).map_raw(&file).map_err(io)?;
        Ok(HostMemory {
            map,
            hugepages: false,
            file: Some(file),
        })
    }

    fn chunk_size(&self) -> usize {
        CHUNK_SIZE
    }

    fn can_map_external(&self) -> bool {
        false
    }

    fn needs_mlock(&self) -> bool {
        // The server reaches the pages through the descriptor, not by physical address.
        false
    }
}

impl VfioUserNvme {
    /// Connects to the vfio-user server listening at `socket` and brings up its device as far
    /// as the driver needs: protocol version agreed, a PCI NVMe controller checked for, reset
    /// (if `opts.reset` and the server can), Memory Space and Bus Master set, BAR0 mapped where
    /// the server shares it.
    pub fn open(socket: &Path, opts: &VfioUserOptions) -> Result<Arc<Self>, Error> {
        let client = Arc::new(Client::connect(socket, opts.timeout)?);
        let path = socket.to_owned();
        let protocol = |command: Command, what: String| Error::VfioUserProtocol {
            path: path.clone(),
            command: command.name(),
            what,
        };

        // Version: major 0 both ways; the server's capabilities are logged, not needed (this
        // client's accesses are 4 bytes, far below any max_data_xfer_size).
        let version = proto::Version {
            major: proto::VERSION_MAJOR,
            minor: proto::VERSION_MINOR,
        };
        let mut caps_json = proto::client_capabilities().into_bytes();
        caps_json.push(0);
        let reply = client.request(Command::Version, &[version.as_bytes(), &caps_json], None)?;
        let (server, rest) = proto::Version::read_from_prefix(&reply.payload)
            .map_err(|_| protocol(Command::Version, "reply shorter than 4 bytes".into()))?;
        if server.major != proto::VERSION_MAJOR {
            return Err(protocol(
                Command::Version,
                format!(
                    "server speaks vfio-user {}.{}, this client {}.{}",
                    server.major,
                    server.minor,
                    proto::VERSION_MAJOR,
                    proto::VERSION_MINOR
                ),
            ));
        }
        tracing::debug!(
            major = server.major,
            minor = server.minor,
            capabilities = %String::from_utf8_lossy(rest).trim_end_matches('\0'),
            "vfio-user version agreed"
        );

        let req = proto::DeviceInfo {
            argsz: size_of::<proto::DeviceInfo>() as u32,
            ..Default::default()
        };
        let info: proto::DeviceInfo = exchange_struct(&client, Command::DeviceGetInfo, &req)?;
        if info.flags & b::VFIO_DEVICE_FLAGS_PCI == 0
            || info.num_regions <= b::VFIO_PCI_CONFIG_REGION_INDEX
        {
            return Err(protocol(
                Command::DeviceGetInfo,
                format!(
                    "not a PCI device (flags 0x{:x}, {} regions)",
                    info.flags, info.num_regions
                ),
            ));
        }

        // Interrupts: counted per type and reported, never enabled (the driver polls).
        let mut irqs = Vec::new();
        for index in 0..info.num_irqs.min(MAX_IRQ_TYPES) {
            let req = proto::IrqInfo {
                argsz: size_of::<proto::IrqInfo>() as u32,
                index,
                ..Default::default()
            };
            let irq: proto::IrqInfo = exchange_struct(&client, Command::DeviceGetIrqInfo, &req)?;
            if irq.index != index {
                return Err(protocol(
                    Command::DeviceGetIrqInfo,
                    format!(
                        "asked for interrupt type {index}, the reply is for {}",
                        irq.index
                    ),
                ));
            }
            irqs.push(irq.count);
        }

        let config_index = b::VFIO_PCI_CONFIG_REGION_INDEX;
        let mut id = [0u8; 12];
        region_read(&client, config_index, 0, &mut id)?;
        let vendor = u16::from_le_bytes([id[0], id[1]]);
        let class = u32::from_le_bytes([id[8], id[9], id[10], id[11]]) >> 8;
        if class != NVME_CLASS {
            return Err(Error::VfioUserNotNvme { path, class });
        }

        // (Reset first: it may clear the command register.)
        if opts.reset {
            if info.flags & b::VFIO_DEVICE_FLAGS_RESET != 0 {
                client.request(Command::DeviceReset, &[], None)?;
            } else {
                tracing::info!(socket = %path.display(), "the server cannot reset the device; continuing without");
            }
        }

        let mut cmd = [0u8; 2];
        region_read(&client, config_index, PCI_COMMAND, &mut cmd)?;
        let cmd = u16::from_le_bytes(cmd);
        // Interrupt Disable too: the driver polls, and a server that sees INTx enabled (and no
        // MSI-X) signals every completion, which without an eventfd from us SPDK treats as a
        // fatal controller error.
        let want = cmd | PCI_COMMAND_MEMORY | PCI_COMMAND_MASTER | PCI_COMMAND_INTX_DISABLE;
        if cmd != want {
            region_write(&client, config_index, PCI_COMMAND, &want.to_le_bytes())?;
        }

        let (region, bar_file) = region_info(&client, b::VFIO_PCI_BAR0_REGION_INDEX)?;
        if region.size < MIN_BAR0 || !region.readable() || !region.writable() {
            return Err(protocol(
                Command::DeviceGetRegionInfo,
                format!(
                    "BAR0 of 0x{:x} bytes with flags 0x{:x} (need a readable and writable BAR \
                     of at least 0x{MIN_BAR0:x} bytes)",
                    region.size, region.flags
                ),
            ));
        }
        let port = Box::new(UserPort {
            client: Arc::clone(&client),
            region: b::VFIO_PCI_BAR0_REGION_INDEX,
        });
        let label = format!("vfio-user {}", path.display());
        let bar = Bar::map(label, bar_file.as_ref(), &region, port).map_err(|e| match e {
            BarError::Layout(what) => protocol(Command::DeviceGetRegionInfo, what),
            BarError::Map(source) => Error::VfioUserMap {
                path: path.clone(),
                what: "BAR0",
                source,
            },
        })?;
        let mapped: Vec<(usize, usize)> = bar
            .mapped_areas()
            .iter()
            .map(|&(off, _, len)| (off, len))
            .collect();
        tracing::info!(
            socket = %path.display(),
            vendor = format_args!("0x{vendor:04x}"),
            bar0_bytes = region.size,
            ?mapped,
            interrupts = ?irqs,
            "vfio-user device open"
        );

        let mapper = Arc::new(UserMapper {
            client: Arc::clone(&client),
            iova: Mutex::new(IovaAllocator::new(&[IOVA_RANGE], 0)),
        });
        let dma = DmaPool::new(Box::new(Arc::clone(&mapper)), false);
        Ok(Arc::new(Self {
            path,
            bar,
            dma,
            mapper,
            vendor,
            irqs,
        }))
    }

    /// The server's socket.
    pub fn socket_path(&self) -> &Path {
        &self.path
    }

    /// The PCI vendor id the server reports.
    pub fn vendor_id(&self) -> u16 {
        self.vendor
    }

    /// Interrupt vectors the server offers per type (INTx, MSI, MSI-X, error, request: the
    /// VFIO PCI interrupt indices), as VFIO_USER_DEVICE_GET_IRQ_INFO reported them. None is
    /// enabled: the driver polls.
    pub fn irq_counts(&self) -> &[u32] {
        &self.irqs
    }

    /// The mapped parts of BAR0 (offset in BAR0, host pointer, length): with SPDK, the
    /// doorbell page. Never turn a pointer into a Rust reference.
    pub fn bar0_mapped_areas(&self) -> Vec<(usize, std::ptr::NonNull<u8>, usize)> {
        self.bar.mapped_areas()
    }

    /// Shares memory another party owns (a memfd of `len` bytes, whole pages, all of it)
    /// with the server as DMA memory: a daemon lends it to a client that drives queues in it.
    /// The server maps the file itself; the mapping lasts until the returned value drops.
    /// Each mapping is one of the server's regions (libvfio-user allows 16 per client).
    pub fn map_shared(&self, fd: BorrowedFd<'_>, len: usize) -> Result<SharedDma, Error> {
        if len == 0 || len % 4096 != 0 {
            return Err(Error::HostMemory {
                len,
                source: io::Error::new(io::ErrorKind::InvalidInput, "whole 4 KiB pages"),
            });
        }
        let iova = self.mapper.map_fd(fd, len, 4096)?;
        Ok(SharedDma {
            iova,
            len,
            mapper: Arc::clone(&self.mapper),
        })
    }

    /// DMA memory counters: chunks shared with the server, bytes, live buffers.
    pub fn dma_stats(&self) -> DmaStats {
        self.dma.stats()
    }
}

/// Sends `req` as `command`'s payload and reads the reply's leading structure of the same type
/// (device info, interrupt info: the server fills in the request's fields).
fn exchange_struct<T: IntoBytes + FromBytes + Immutable + KnownLayout>(
    client: &Client,
    command: Command,
    req: &T,
) -> Result<T, Error> {
    let reply = client.request(command, &[req.as_bytes()], None)?;
    T::read_from_prefix(&reply.payload)
        .map(|(t, _)| t)
        .map_err(|_| Error::VfioUserProtocol {
            path: client.path().to_owned(),
            command: command.name(),
            what: format!("{}-byte reply", reply.payload.len()),
        })
}

/// Region info, asking again with more room when the server's capabilities need it, and the
/// descriptor to mmap the region through, if the server sent one.
fn region_info(client: &Client, index: u32) -> Result<(RegionInfo, Option<File>), Error> {
    let command = Command::DeviceGetRegionInfo;
    let mut room = REGION_INFO_ROOM;
    for _ in 0..2 {
        let req = proto::RegionInfoRequest {
            argsz: room,
            index,
            ..Default::default()
        };
        let mut reply = client.request(command, &[req.as_bytes()], None)?;
        let protocol = |what: String| Error::VfioUserProtocol {
            path: client.path().to_owned(),
            command: command.name(),
            what,
        };
        let (head, _) = proto::RegionInfoRequest::read_from_prefix(&reply.payload)
            .map_err(|_| protocol(format!("{}-byte reply", reply.payload.len())))?;
        if head.argsz > room {
            room = head.argsz;
            continue;
        }
        let info = caps::parse_region_info(&reply.payload).map_err(|e| protocol(e.to_string()))?;
        if info.index != index {
            return Err(protocol(format!(
                "asked for region {index}, got region {}",
                info.index
            )));
        }
        let file = reply.fds.pop().map(File::from);
        return Ok((info, file));
    }
    Err(Error::VfioUserProtocol {
        path: client.path().to_owned(),
        command: command.name(),
        what: format!("region {index}'s info keeps growing past {room} bytes"),
    })
}

impl nvme::Device for VfioUserNvme {
    fn registers(&self) -> &dyn nvme::RegisterIo {
        &self.bar
    }

    fn write_doorbell(&self, offset: usize, value: u32) {
        nvme::RegisterIo::write_u32(&self.bar, offset, value);
    }

    fn alloc_dma(&self, len: usize) -> Result<nvme::DmaMemory, nvme::DmaAllocError> {
        self.dma.alloc(len).map_err(|e| e.into_dma_alloc_error(len))
    }

    fn describe(&self) -> String {
        format!("vfio-user {}", self.path.display())
    }
}
