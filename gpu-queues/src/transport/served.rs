//! The served transport: GPU queues on pairs a `gpunvme serve` daemon created and lent this
//! process (docs/serve.md). The daemon owns the controller and the memory it reaches; the
//! client receives an arena (a memfd sealed against resizing) whose pairs are laid out in the
//! GPU queue protocol's own order (SQ, CQ, two PRP list pages per slot, slot buffers: the
//! daemon's `PairLayout`, the real-SSD transports' [`QueueLayout`] at 4 KiB alignment), and a
//! doorbell page the daemon's controller reads. Both are registered here with CUDA
//! (DEVICEMAP | PORTABLE) and the descriptors point into them: GPU threads write SQEs, store
//! the SQ tail into the doorbell word and poll the CQ over PCIe with system-scope fences, as
//! for the host-memory and vfio-user transports. Nothing crosses the daemon's socket per
//! command.
//!
//! This module knows nothing of the socket: the caller (the `gpunvme` library's `served`
//! module) asks the daemon for the arena and the pairs and hands them over as a
//! [`ServedRings`], with a [`ServedLease`] that gives the pairs back when the queues drop and
//! asks for more memory for [`GpuQueues::alloc_buffer`].
//!
//! A served client runs no controller on its GPU, so no SMs need be reserved for one; the
//! green partition is split as `opts.controller_sms` says, as for the other transports.
#![forbid(unsafe_code)]

use std::sync::{Arc, Mutex};

use gpunvme_serve_shm::SharedMemory;

use crate::error::GpuError;
use crate::ffi::os::SharedRegistration;
use crate::ffi::{Cuda, GreenPartition, PinnedMemory, Placement, Stream};
use crate::kernels::Kernels;
use crate::queues::{
    DescCommon, DescParts, GpuBuffer, GpuQueueOptions, GpuQueuePair, GpuQueues, Plan,
    QueueSetParts, QueueTransport, SetupPhases, TransportKind, alloc_protocol_states,
    prebuilt_prp_lists,
};
#[cfg(doc)]
use crate::transport::QueueLayout;

/// One lent pair: its queue id, where its pieces sit in the arena (byte offsets) and where
/// its doorbell words sit in the doorbell page.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct ServedPair {
    /// Queue id (SQ and CQ alike).
    pub qid: u16,
    /// The SQ ring (`depth` × 64 bytes).
    pub sq: u64,
    /// The CQ ring (`depth` × 16 bytes), zeroed by the daemon.
    pub cq: u64,
    /// Two PRP list pages per slot.
    pub prp_lists: u64,
    /// `depth` slot buffers of the slot size.
    pub slots: u64,
    /// The SQ tail word in the doorbell page.
    pub sq_doorbell: u32,
    /// The CQ head word in the doorbell page.
    pub cq_doorbell: u32,
}

/// Memory the daemon lent for a buffer: shared memory the controller reaches at
/// `device_address` (contiguous), and whatever must live as long as it is used (the loan,
/// freed at the daemon when dropped).
pub struct LentMemory {
    /// The memory.
    pub mem: Arc<SharedMemory>,
    /// The device address of its first byte.
    pub device_address: u64,
    /// Kept until the buffer drops.
    pub keep: Box<dyn Send + Sync>,
}

/// What gives lent pairs back and lends more memory: the caller's connection to the daemon.
pub trait ServedLease: Send + Sync {
    /// Gives every pair back (the daemon deletes them on the controller, then may free their
    /// memory). Called once. `kernels_idle` is false when a client kernel may still be
    /// running: the pairs are given back all the same (the daemon's controller stops reading
    /// their doorbells), and this process keeps its mappings of their memory.
    fn release(&self, kernels_idle: bool);
    /// `len` bytes (whole pages) of shared memory the controller reaches.
    fn alloc(&self, len: usize) -> Result<LentMemory, GpuError>;
}

/// Everything the daemon lent, for [`build`].
pub struct ServedRings {
    /// The arena the pairs are laid out in.
    pub arena: Arc<SharedMemory>,
    /// The device address of the arena's first byte (page-aligned).
    pub device_address: u64,
    /// The client's doorbell page.
    pub doorbells: Arc<SharedMemory>,
    /// The pairs, in the order kernels index them.
    pub pairs: Vec<ServedPair>,
    /// Entries per ring (a power of two, at least 2).
    pub depth: u32,
    /// Bytes of each slot buffer (whole 4 KiB pages).
    pub slot_bytes: u32,
    /// The most bytes one command moves (the controller's maximum transfer).
    pub max_transfer: u32,
    /// (namespace id, PRINFO) where one namespace is formatted with protection information.
    pub protection: Option<(u32, u8)>,
    /// Gives the pairs back when the queues drop (or when building them fails).
    pub lease: Box<dyn ServedLease>,
}

/// Checks that every pair's pieces lie inside the arena, page-aligned, and its doorbell words
/// inside the doorbell page, 4-byte aligned and distinct: a daemon's mistake must be an error
/// here, never a GPU thread's store outside the memory lent.
fn check(r: &ServedRings) -> Result<(), GpuError> {
    let bad = |why: String| {
        Err(GpuError::InvalidArgument(format!(
            "served queue pairs: {why}"
        )))
    };
    if r.depth < 2 || !r.depth.is_power_of_two() {
        return bad(format!(
            "depth {} is not a power of two of at least 2",
            r.depth
        ));
    }
    if r.slot_bytes == 0 || r.slot_bytes % 4096 != 0 || r.slot_bytes > r.max_transfer {
        return bad(format!(
            "slots of {} bytes (whole pages, at most the maximum transfer of {})",
            r.slot_bytes, r.max_transfer
        ));
    }
    if r.pairs.is_empty() {
        return bad("none were lent".into());
    }
    if r.device_address % 4096 != 0 {
        return bad(format!("arena at device address {:#x}", r.device_address));
    }
    let d = u64::from(r.depth);
    let arena = r.arena.len() as u64;
    let page = r.doorbells.len() as u64;
    let mut words = Vec::new();
    for p in &r.pairs {
        let pieces = [
            ("SQ", p.sq, d * 64),
            ("CQ", p.cq, d * 16),
            ("PRP lists", p.prp_lists, d * 2 * 4096),
            ("slot buffers", p.slots, d * u64::from(r.slot_bytes)),
        ];
        for (what, off, len) in pieces {
            if off % 4096 != 0 || off.checked_add(len).is_none_or(|end| end > arena) {
                return bad(format!(
                    "pair {}'s {what} at {off:#x}+{len:#x} is not page-aligned inside the \
                     {arena:#x}-byte arena",
                    p.qid
                ));
            }
        }
        for w in [p.sq_doorbell, p.cq_doorbell] {
            if w % 4 != 0 || u64::from(w) + 4 > page || words.contains(&w) {
                return bad(format!(
                    "pair {}'s doorbell word at {w:#x} is misaligned, outside the \
                     {page:#x}-byte doorbell page, or another pair's",
                    p.qid
                ));
            }
            words.push(w);
        }
    }
    Ok(())
}

/// Builds GPU queues on the pairs in `rings`.
pub fn build(
    cuda: &Arc<Cuda>,
    rings: ServedRings,
    opts: &GpuQueueOptions,
) -> Result<GpuQueues, GpuError> {
    let mut setup = SetupPhases::start();
    check(&rings)?;
    let ServedRings {
        arena,
        device_address,
        doorbells,
        pairs,
        depth,
        slot_bytes,
        max_transfer,
        protection,
        lease,
    } = rings;
    // From here the lease is the backend's: dropped with it if anything below fails.
    let mut backend = ServedBackend {
        lease: Mutex::new(Some(lease)),
        keep_mapped: Mutex::new(Vec::new()),
    };
    let count = u16::try_from(pairs.len())
        .map_err(|_| GpuError::InvalidArgument(format!("{} served pairs", pairs.len())))?;
    let plan = Plan {
        depth,
        slot_buffer_bytes: slot_bytes,
        count,
        max_transfer,
    };
    let arena_reg = Arc::new(SharedRegistration::register(cuda, arena)?);
    let bell_reg = Arc::new(SharedRegistration::register(cuda, doorbells)?);
    backend.keep_mapped = Mutex::new(vec![arena_reg.clone(), bell_reg.clone()]);
    setup.mark("register");
    let kernels = Kernels::load(cuda)?;
    let partition = GreenPartition::split(cuda, opts.controller_sms)?;
    let client_stream = Stream::new(cuda, Placement::Client, Some(&partition))?;
    kernels.warm_up_clients(cuda, &client_stream)?;
    setup.mark("kernels");
    let host_flags = PinnedMemory::alloc(cuda, 4096)?;
    // A controller in another process, maybe a real SSD behind it: system-scope fences (no
    // QF_LOCAL_PEER) and the real-SSD bound on every wait unless the caller chose one.
    let timeout = opts.real_ssd_timeout()?;
    let mut common = DescCommon::new(&plan, &host_flags, timeout, 0);
    if let Some((nsid, prinfo)) = protection {
        common = common.with_protection_info(nsid, prinfo);
    }
    let states = alloc_protocol_states(cuda, depth, pairs.len())?;
    let (gpu, mem) = (arena_reg.gpu_ptr(), arena_reg.memory());
    let mut built = Vec::with_capacity(pairs.len());
    for (p, (state, slots)) in pairs.iter().zip(states) {
        let buf_bus = device_address + p.slots;
        if let Some(lists) = prebuilt_prp_lists(depth, slot_bytes, buf_bus) {
            let bytes: Vec<u8> = lists.iter().flat_map(|e| e.to_le_bytes()).collect();
            mem.write(p.prp_lists as usize, &bytes)
                .map_err(|e| GpuError::InvalidArgument(format!("writing PRP lists: {e}")))?;
        }
        let desc = common.desc(DescParts {
            sq: gpu + p.sq,
            cq: gpu + p.cq,
            doorbells: (
                bell_reg.verify(p.sq_doorbell as usize)?,
                bell_reg.verify(p.cq_doorbell as usize)?,
            ),
            state: state.ptr(),
            slots: slots.ptr(),
            prp_lists: (gpu + p.prp_lists, device_address + p.prp_lists),
            slot_buffers: (gpu + p.slots, buf_bus),
            qid: p.qid,
        });
        built.push(GpuQueuePair {
            created: None,
            desc,
            state: state.clone(),
            keep: vec![Box::new((state, slots))],
        });
    }
    setup.mark("descriptors");
    tracing::info!(
        queues = count,
        depth,
        slot_bytes,
        "GPU queues on served pairs"
    );
    GpuQueues::assemble(
        cuda,
        QueueSetParts {
            setup,
            kind: TransportKind::Served,
            pairs: built,
            host_flags,
            keep: Box::new((arena_reg, bell_reg)),
            client_stream,
            kernels,
            partition,
            plan,
            backend: Arc::new(backend),
        },
    )
}

/// The served transport's backend: the lease, and the registrations to keep mapped forever
/// if a kernel outlived the teardown bound.
struct ServedBackend {
    lease: Mutex<Option<Box<dyn ServedLease>>>,
    keep_mapped: Mutex<Vec<Arc<SharedRegistration>>>,
}

impl ServedBackend {
    fn release(&self, kernels_idle: bool) {
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner()).take();
        if let Some(lease) = lease {
            lease.release(kernels_idle);
        }
        if !kernels_idle {
            // A kernel may still store into the rings or the doorbell page: keep both
            // registered and mapped for the rest of the process (a small, bounded leak, and
            // the only way a straggler cannot fault the GPU context).
            let keep =
                std::mem::take(&mut *self.keep_mapped.lock().unwrap_or_else(|e| e.into_inner()));
            std::mem::forget(keep);
        }
    }
}

/// A buffer of `len` bytes (whole pages) over memory a daemon lent: registered with CUDA by
/// this process, reached by the controller at the lent device address. Memory smaller than
/// `len` or not page aligned at the controller is refused.
pub fn lent_buffer(cuda: &Arc<Cuda>, lent: LentMemory, len: usize) -> Result<GpuBuffer, GpuError> {
    let len = len.max(1).next_multiple_of(4096);
    let LentMemory {
        mem,
        device_address,
        keep,
    } = lent;
    if mem.len() < len || device_address % 4096 != 0 {
        return Err(GpuError::InvalidArgument(format!(
            "the daemon lent {:#x} bytes at device address {device_address:#x} for {len:#x}",
            mem.len()
        )));
    }
    let reg = Arc::new(SharedRegistration::register(cuda, mem)?);
    let dm = Arc::new(reg.as_device_memory(cuda, 0, len)?);
    let region = nvme::DmaRegion::contiguous(device_address, len, Box::new((reg, keep)));
    Ok(GpuBuffer::new(dm, 0, region))
}

impl Drop for ServedBackend {
    fn drop(&mut self) {
        // Building failed before any kernel ran, or the queues already gave the pairs back.
        self.release(true);
    }
}

impl QueueTransport for ServedBackend {
    fn alloc_buffer(&self, cuda: &Arc<Cuda>, len: usize) -> Result<GpuBuffer, GpuError> {
        let len = len.max(1).next_multiple_of(4096);
        let lease = self.lease.lock().unwrap_or_else(|e| e.into_inner());
        let lease = lease.as_ref().ok_or_else(|| {
            GpuError::InvalidArgument("the served queue pairs were given back".into())
        })?;
        lent_buffer(cuda, lease.alloc(len)?, len)
    }

    /// The daemon lends host memory (a memfd), registered with CUDA by this process.
    fn buffers_in_host_memory(&self) -> bool {
        true
    }

    fn queues_dropped(&self, kernels_idle: bool) {
        self.release(kernels_idle);
    }

    fn as_any(&self) -> &dyn std::any::Any {
        self
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    struct NoLease;
    impl ServedLease for NoLease {
        fn release(&self, _: bool) {}
        fn alloc(&self, _: usize) -> Result<LentMemory, GpuError> {
            Err(GpuError::Unsupported("no memory".into()))
        }
    }

    fn rings(pairs: Vec<ServedPair>) -> ServedRings {
        ServedRings {
            arena: Arc::new(SharedMemory::create("t", 1 << 20).unwrap()),
            device_address: 0x10_0000,
            doorbells: Arc::new(SharedMemory::create("d", 4096).unwrap()),
            pairs,
            depth: 16,
            slot_bytes: 8192,
            max_transfer: 128 << 10,
            protection: None,
            lease: Box::new(NoLease),
        }
    }

    const GOOD: ServedPair = ServedPair {
        qid: 1,
        sq: 0,
        cq: 4096,
        prp_lists: 8192,
        slots: 8192 + 32 * 4096,
        sq_doorbell: 0,
        cq_doorbell: 4,
    };

    #[test]
    fn lent_pairs_outside_their_memory_are_refused() {
        assert!(check(&rings(vec![GOOD])).is_ok());
        let bad = [
            ServedPair {
                slots: (1 << 20) - 4096,
                ..GOOD
            },
            ServedPair { cq: 100, ..GOOD },
            ServedPair {
                sq_doorbell: 4094,
                ..GOOD
            },
            ServedPair {
                cq_doorbell: 0,
                ..GOOD
            },
            ServedPair {
                sq: u64::MAX - 10,
                ..GOOD
            },
        ];
        for p in bad {
            let e = check(&rings(vec![p])).unwrap_err();
            assert!(matches!(e, GpuError::InvalidArgument(_)), "{p:?}: {e}");
        }
        let two = vec![
            GOOD,
            ServedPair {
                qid: 2,
                sq_doorbell: 8,
                cq_doorbell: 4,
                ..GOOD
            },
        ];
        assert!(
            check(&rings(two)).is_err(),
            "a doorbell word shared by two pairs"
        );
        let mut r = rings(vec![GOOD]);
        r.depth = 12;
        assert!(check(&r).is_err());
        let mut r = rings(vec![GOOD]);
        r.slot_bytes = 256 << 10;
        assert!(check(&r).is_err(), "slots above the maximum transfer");
        assert!(check(&rings(vec![])).is_err());
    }
}
