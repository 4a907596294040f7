//! An arena: memory the daemon allocated in the controller's reach and passed to us.

use std::sync::Arc;

use gpunvme_serve_shm::SharedMemory;

/// Memory the controller reaches at `device_address .. device_address + mem.len()`, mapped
/// shared into this process (a sealed memfd from the daemon, [`crate::Connection::alloc_arena`]).
/// Queue pairs live in it ([`crate::Connection::create_queues`]); it stays mapped here until
/// the last reference to it is dropped, and the daemon frees it on
/// [`crate::Connection::free_arena`] or at the connection's end.
#[derive(Debug)]
pub struct Arena {
    /// The daemon's id for it.
    pub id: u64,
    /// The device address of its first byte (page-aligned).
    pub device_address: u64,
    /// Its memory (shared, so a GPU registration of it can hold it too).
    pub mem: Arc<SharedMemory>,
}

impl Arena {
    /// Bytes.
    pub fn len(&self) -> u64 {
        self.mem.len() as u64
    }

    /// Never: an arena is at least a page.
    pub fn is_empty(&self) -> bool {
        self.mem.is_empty()
    }
}
