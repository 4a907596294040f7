//! The memory the daemon lends: arenas (shared memory the software controller reaches at a
//! device address) and doorbell pages (the words a client's SQ tails and CQ heads are read
//! from).
//!
//! An [`Arena`] is registered in the controller's address map when it is made and
//! unregistered when its last holder drops it: the client's ledger holds one, and every queue
//! created in it holds one through its rings' [`nvme::DmaRegion`]s, so the memory cannot leave
//! the controller's reach while a queue in it exists. After it leaves, the region is poisoned:
//! a controller access that still reaches it (one that raced the unregistration) is refused
//! and counted ([`Poison`]), which tests assert is zero.
#![forbid(unsafe_code)]

use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};

use gpunvme_serve_shm::SharedMemory;
use nvme_emu::{DeviceAddressMap, DoorbellWord, MemoryRegion, RegionError};

/// Accesses the controller made to memory after it was taken out of its reach.
#[derive(Debug, Default)]
pub struct Poison {
    /// Reads of released arenas.
    pub late_reads: AtomicU64,
    /// Writes into released arenas.
    pub late_writes: AtomicU64,
    /// Arenas released so far.
    pub released: AtomicU64,
}

/// Shared memory as the software controller sees it.
struct ArenaRegion {
    mem: Arc<SharedMemory>,
    released: AtomicBool,
    poison: Arc<Poison>,
}

impl ArenaRegion {
    fn live(&self, write: bool) -> Result<(), RegionError> {
        // Acquire: pairs with the Release store at release, so an access that sees the flag
        // clear started before the region left the map (and is the race an IOMMU unmap
        // tolerates); one that sees it set is late.
        if self.released.load(Ordering::Acquire) {
            let c = if write {
                &self.poison.late_writes
            } else {
                &self.poison.late_reads
            };
            c.fetch_add(1, Ordering::Relaxed);
            return Err(RegionError::new(
                "the memory was released (its client is gone)",
            ));
        }
        Ok(())
    }
}

impl MemoryRegion for ArenaRegion {
    fn len(&self) -> usize {
        self.mem.len()
    }

    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        self.live(false)?;
        let offset = usize::try_from(offset).map_err(|e| RegionError::new(e.to_string()))?;
        self.mem
            .read(offset, buf)
            .map_err(|e| RegionError::new(e.to_string()))
    }

    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        self.live(true)?;
        let offset = usize::try_from(offset).map_err(|e| RegionError::new(e.to_string()))?;
        self.mem
            .write(offset, data)
            .map_err(|e| RegionError::new(e.to_string()))
    }

    fn write_last_dword_release(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        // A completion entry: everything but its last dword, then the last dword (the phase
        // tag) by a Release store, so a client that sees the new phase sees the whole entry.
        self.live(true)?;
        let at = usize::try_from(offset).map_err(|e| RegionError::new(e.to_string()))?;
        let split = data.len().saturating_sub(4);
        let err = |e: gpunvme_serve_shm::ShmError| RegionError::new(e.to_string());
        self.mem.write(at, &data[..split]).map_err(err)?;
        let mut last = [0u8; 4];
        last.copy_from_slice(&data[split..]);
        self.mem
            .store_u32(at + split, u32::from_le_bytes(last), Ordering::Release)
            .map_err(err)
    }
}

/// How an arena is in a controller's reach.
enum Reach {
    /// Registered in the software controller's address map.
    Map {
        map: Arc<DeviceAddressMap>,
        region: Arc<ArenaRegion>,
    },
    /// Shared with a vfio-user server by descriptor (its DMA_MAP).
    VfioUser(vfio::user::SharedDma),
    /// Mapped for a VFIO function through the IOMMU.
    Vfio(crate::vfio_map::Mapped),
}

/// Where a new arena is put in reach.
pub enum ArenaTarget<'a> {
    /// The software controller's address map, with the poison counters.
    Map(&'a Arc<DeviceAddressMap>, &'a Arc<Poison>),
    /// A vfio-user server.
    VfioUser(&'a vfio::VfioUserNvme),
    /// A VFIO function (type1 IOMMU: no-IOMMU mode cannot map memory of another owner).
    Vfio(&'a vfio::VfioNvme),
}

/// An arena: shared memory in a controller's reach (see the module docs).
pub struct Arena {
    /// The daemon's id for it (unique per daemon).
    pub id: u64,
    /// Where the controller reaches its first byte.
    pub device_address: u64,
    mem: Arc<SharedMemory>,
    reach: Option<Reach>,
}

impl std::fmt::Debug for Arena {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Arena")
            .field("id", &self.id)
            .field(
                "device_address",
                &format_args!("{:#x}", self.device_address),
            )
            .field("len", &self.len())
            .finish()
    }
}

impl Arena {
    /// `len` bytes of new shared memory (whole pages), put in reach of `target`.
    pub fn new(id: u64, len: usize, target: ArenaTarget<'_>) -> Result<Self, crate::ServeError> {
        let mem = Arc::new(SharedMemory::create("gpunvme-serve-arena", len)?);
        let (device_address, reach) = match target {
            ArenaTarget::Map(map, poison) => {
                let region = Arc::new(ArenaRegion {
                    mem: mem.clone(),
                    released: AtomicBool::new(false),
                    poison: poison.clone(),
                });
                let base = map
                    .register_region(region.clone())
                    .map_err(|e| crate::ServeError::Controller(e.to_string()))?;
                (
                    base,
                    Reach::Map {
                        map: map.clone(),
                        region,
                    },
                )
            }
            ArenaTarget::VfioUser(dev) => {
                let shared = dev
                    .map_shared(mem.fd(), len)
                    .map_err(|e| crate::ServeError::Controller(e.to_string()))?;
                (shared.device_address(), Reach::VfioUser(shared))
            }
            ArenaTarget::Vfio(dev) => {
                let mapped = crate::vfio_map::Mapped::new(dev, mem.clone())
                    .map_err(|e| crate::ServeError::Controller(e.to_string()))?;
                (mapped.device_address(), Reach::Vfio(mapped))
            }
        };
        Ok(Self {
            id,
            device_address,
            mem,
            reach: Some(reach),
        })
    }

    /// Bytes.
    pub fn len(&self) -> usize {
        self.mem.len()
    }

    /// Never: arenas are at least a page.
    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }

    /// The memory (to pass its descriptor, to zero a completion queue).
    pub fn memory(&self) -> &SharedMemory {
        &self.mem
    }

    /// The memory, shared (a reply carries its descriptor).
    pub fn shared(&self) -> Arc<SharedMemory> {
        self.mem.clone()
    }
}

impl Drop for Arena {
    fn drop(&mut self) {
        match self.reach.take() {
            // Out of the controller's reach first, then poisoned (a translation that raced
            // the unregistration is refused and counted), then the mapping goes with `mem`.
            Some(Reach::Map { map, region }) => {
                map.unregister_region(self.device_address);
                region.released.store(true, Ordering::Release);
                region.poison.released.fetch_add(1, Ordering::Relaxed);
            }
            // DMA_UNMAP before our mapping goes (the server holds its own meanwhile).
            Some(Reach::VfioUser(shared)) => drop(shared),
            // VFIO_IOMMU_UNMAP_DMA before the pages can go.
            Some(Reach::Vfio(mapped)) => drop(mapped),
            None => {}
        }
    }
}

/// One doorbell word in a client's doorbell page, as the controller reads it.
pub struct PageDoorbell {
    /// The page.
    pub page: Arc<SharedMemory>,
    /// Byte offset of the word.
    pub offset: usize,
}

impl DoorbellWord for PageDoorbell {
    fn load(&self) -> u32 {
        // Acquire: the entries a client wrote before its Release store of the tail are
        // visible to the controller thread that sees the new tail. A word outside the page
        // cannot happen (offsets are the daemon's); 0 is a value the controller treats as
        // "nothing new" at worst.
        self.page
            .load_u32(self.offset, Ordering::Acquire)
            .unwrap_or(0)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn an_arena_is_reachable_until_dropped_then_late_accesses_are_refused_and_counted() {
        let map = Arc::new(DeviceAddressMap::new());
        let poison = Arc::new(Poison::default());
        let arena = Arena::new(1, 8192, ArenaTarget::Map(&map, &poison)).unwrap();
        let base = arena.device_address;
        map.write(base + 4096, b"abc").unwrap();
        let mut got = [0u8; 3];
        arena.memory().read(4096, &mut got).unwrap();
        assert_eq!(&got, b"abc");
        // Held elsewhere (a translation cache would): the region outlives the arena.
        let Some(Reach::Map { region, .. }) = &arena.reach else {
            unreachable!()
        };
        let region = region.clone();
        drop(arena);
        assert!(map.write(base, b"x").is_err(), "unregistered");
        assert!(region.write(0, b"late").is_err());
        let mut buf = [0u8; 4];
        assert!(region.read(0, &mut buf).is_err());
        assert_eq!(poison.late_writes.load(Ordering::Relaxed), 1);
        assert_eq!(poison.late_reads.load(Ordering::Relaxed), 1);
        assert_eq!(poison.released.load(Ordering::Relaxed), 1);
    }
}
