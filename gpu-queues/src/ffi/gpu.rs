//! The GPU and its work, defined once for both backends: [`Cuda`], [`Library`] and [`Kernel`],
//! [`GreenPartition`], [`Stream`], [`Event`] and [`copy_to_gpu`]. Here is what the backends
//! share: the public API and its documentation, argument checks, the shared-memory arithmetic
//! of [`Kernel::reserve_whole_sm`] and the polling waits. Each type holds its backend's raw part
//! (`backend::RawStream`, ...: CUDA driver handles in `cuda.rs`, the host runtime's state in
//! `host_gpu.rs`), which makes the driver's or the host runtime's calls. Raw parts that need no
//! context release themselves when dropped; the others are destroyed by their owner's `Drop`
//! here, which holds the [`Cuda`] they need.
// UNSAFETY: copies between pinned memory and the GPU, and destroying a stream or an event, are
// unsafe backend calls whose preconditions (a checked range, a single destroy) are met here.
#![expect(unsafe_code)]

use std::ffi::CString;
use std::sync::Arc;
use std::time::Duration;

use super::{
    Arg, DeviceMemory, HostRegistration, PinnedMemory, Placement, backend, memory, poll_until,
};
use crate::error::GpuError;

/// An opened GPU: what it reports, and the backend's handle (with CUDA, the device and its
/// retained primary context; with `host-gpu`, the stand-in, which reports fixed numbers).
pub struct Cuda {
    /// The backend's part.
    pub(super) raw: backend::RawCuda,
    pub(super) ordinal: i32,
    pub(super) name: String,
    pub(super) sm_count: u32,
    pub(super) compute_capability: (i32, i32),
    /// Shared memory of one SM, and the most one block may opt in to (bytes).
    pub(super) shared_per_sm: u32,
    pub(super) shared_per_block: u32,
    /// The GPU's UUID as `nvidia-smi -L` prints it (`GPU-` and 32 hex digits in 8-4-4-4-12).
    pub(super) uuid: String,
    /// This GPU's frees held back and its launch gate (shared by every `Cuda` of the ordinal).
    pub(super) holds: Arc<memory::GpuHolds>,
}

impl std::fmt::Debug for Cuda {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Cuda")
            .field("ordinal", &self.ordinal)
            .field("name", &self.name)
            .field("sm_count", &self.sm_count)
            .field("uuid", &self.uuid)
            .finish()
    }
}

impl Cuda {
    /// Opens GPU `ordinal`. With CUDA: loads libcuda (error if absent), initialises the driver
    /// with eager module loading (lazy loading deadlocks next to spinning kernels), and retains
    /// the primary context. With `host-gpu`: opens the stand-in (`ordinal` 0 only), whose SM
    /// count is 16 unless the environment variable `GPUNVME_HOST_GPU_SMS` gives another (a
    /// positive integer).
    pub fn open(ordinal: i32) -> Result<Arc<Cuda>, GpuError> {
        backend::open(ordinal).map(Arc::new)
    }

    /// Makes the primary context current on the calling thread (cheap when it already is;
    /// nothing to do with `host-gpu`, which has no context).
    pub fn make_current(&self) -> Result<(), GpuError> {
        self.raw.make_current()
    }

    /// The GPU's name ("NVIDIA H100 80GB HBM3"; the `host-gpu` stand-in's says that it is not a
    /// GPU).
    pub fn name(&self) -> &str {
        &self.name
    }

    /// Streaming multiprocessors (`host-gpu`: 16, or `GPUNVME_HOST_GPU_SMS`).
    pub fn sm_count(&self) -> u32 {
        self.sm_count
    }

    /// Compute capability (major, minor) (`host-gpu`: (9, 0)).
    pub fn compute_capability(&self) -> (i32, i32) {
        self.compute_capability
    }

    /// Free and total bytes of GPU memory now (`cuMemGetInfo`; refused by `host-gpu`).
    pub fn memory_info(&self) -> Result<(u64, u64), GpuError> {
        backend::memory_info(self)
    }

    /// Device ordinal (as CUDA numbers the GPUs this process sees: `CUDA_VISIBLE_DEVICES`
    /// changes it; the UUID does not).
    pub fn ordinal(&self) -> i32 {
        self.ordinal
    }

    /// The GPU's UUID as `nvidia-smi -L` prints it (`GPU-` and 32 hex digits in 8-4-4-4-12;
    /// the `host-gpu` stand-ins have made-up ones): the name that means the same GPU in every
    /// process.
    pub fn uuid(&self) -> &str {
        &self.uuid
    }

    /// GPUs this process can open (`cuDeviceGetCount`; `host-gpu`: `GPUNVME_HOST_GPU_COUNT`,
    /// default 1).
    pub fn count() -> Result<i32, GpuError> {
        backend::device_count()
    }

    /// What GPU `ordinal` is (name, UUID, PCI bus id) without opening it (no context is made).
    pub fn identify(ordinal: i32) -> Result<super::GpuIdentity, GpuError> {
        backend::identify(ordinal)
    }

    /// The GPU's PCI address as sysfs spells it (`0000:3b:00.0`: lower case), from
    /// `cuDeviceGetPCIBusId`. Refused by `host-gpu`: the stand-in is on no PCI bus, so the
    /// real-SSD transports (vfio-p2p, host-memory) skip it.
    pub fn pci_bus_id(&self) -> Result<String, GpuError> {
        self.raw.pci_bus_id()
    }

    /// The GPU's ordering of peer-to-peer (GPUDirect RDMA) writes into its memory,
    /// `CU_DEVICE_ATTRIBUTE_GPU_DIRECT_RDMA_WRITES_ORDERING`: 0 none, 100 owner (the GPU's own
    /// threads see a device's writes in the order it made them), 200 all devices. Refused by
    /// `host-gpu`.
    pub fn p2p_write_ordering(&self) -> Result<i32, GpuError> {
        self.raw.p2p_write_ordering()
    }
}

/// A context-independent library of kernels: with CUDA, loaded from PTX text
/// (`cuLibraryLoadData`); with `host-gpu`, the kernels compiled into the build. Unloaded on
/// drop, or later, once no kernel may be waiting for a controller (an unload waits for a
/// running persistent kernel and holds other threads' CUDA calls meanwhile: see the memory
/// module's frees).
pub struct Library {
    raw: backend::RawLibrary,
    cuda: Arc<Cuda>,
}

impl Drop for Library {
    fn drop(&mut self) {
        if let Some(unload) = self.raw.unload_later() {
            memory::free_or_defer(&self.cuda, unload);
        }
    }
}

/// A kernel of a [`Library`].
#[derive(Clone, Copy, Debug)]
pub struct Kernel {
    /// With CUDA, the `CUkernel`; with `host-gpu`, its name as the host runtime knows it.
    pub(super) raw: backend::RawKernel,
}

impl Library {
    /// JIT-loads PTX text (`host-gpu` ignores it: the kernels are compiled into that build from
    /// the CUDA sources).
    pub fn load_ptx(cuda: &Arc<Cuda>, ptx: &str) -> Result<Self, GpuError> {
        Ok(Self {
            raw: backend::RawLibrary::load_ptx(cuda, ptx)?,
            cuda: cuda.clone(),
        })
    }

    /// The kernel named `name` (an `extern "C"` entry point of the library's PTX); with
    /// `host-gpu`, `CUDA_ERROR_NOT_FOUND` from `cuLibraryGetKernel` where the host build has no
    /// kernel of that name, as CUDA says.
    pub fn kernel(&self, name: &str) -> Result<Kernel, GpuError> {
        let c = CString::new(name).map_err(|_| GpuError::InvalidArgument(name.into()))?;
        Ok(Kernel {
            raw: self.raw.kernel(name, c)?,
        })
    }
}

impl Kernel {
    /// Makes one block of this kernel take an SM to itself: sets its dynamic shared memory to
    /// more than half of an SM's (with what it declares statically), so that no second block
    /// of any kernel that needs shared memory fits beside it. With `all`, asks for all the
    /// shared memory a block may have instead (the controller model's held completions use
    /// it). Returns the dynamic bytes to pass at launch. (`host-gpu` computes the same from the
    /// sizes it reports, kernels declaring no shared memory statically there.)
    pub fn reserve_whole_sm(&self, cuda: &Cuda, all: bool) -> Result<u32, GpuError> {
        let static_bytes = self.raw.static_shared_bytes(cuda)?;
        let want = if all {
            cuda.shared_per_block.saturating_sub(static_bytes)
        } else {
            (cuda.shared_per_sm / 2 + 1024).saturating_sub(static_bytes)
        };
        if want + static_bytes > cuda.shared_per_block {
            return Err(GpuError::Unsupported(format!(
                "cannot reserve an SM by shared memory ({} B per SM, {} B per block)",
                cuda.shared_per_sm, cuda.shared_per_block
            )));
        }
        self.raw.set_max_dynamic_shared(cuda, want)?;
        Ok(want)
    }
}

/// SM partitions (green contexts): one for the controller's own kernels, the rest for clients,
/// so that a client kernel that fills its partition can never keep the controller's kernels
/// from running (../shared/design/gpu.md, "Deadlocks seen"). With `host-gpu`, the split by
/// count only: the host runs every launch on threads of its own, so nothing is reserved.
pub struct GreenPartition {
    raw: backend::RawPartition,
    controller_sms: u32,
    client_sms: u32,
    _cuda: Arc<Cuda>,
}

impl std::fmt::Debug for GreenPartition {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GreenPartition")
            .field("controller_sms", &self.controller_sms)
            .field("client_sms", &self.client_sms)
            .finish()
    }
}

impl GreenPartition {
    /// Splits the GPU's SMs: at least `controller_sms` (at least 1, rounded up by the driver to
    /// its partition granularity) for the controller, the rest for clients; refused if none
    /// would be left for clients.
    pub fn split(cuda: &Arc<Cuda>, controller_sms: u32) -> Result<Arc<Self>, GpuError> {
        let (raw, controller_sms, client_sms) = backend::RawPartition::split(cuda, controller_sms)?;
        Ok(Arc::new(Self {
            raw,
            controller_sms,
            client_sms,
            _cuda: cuda.clone(),
        }))
    }

    /// `groups` partitions whose controller sides are disjoint, at least `controller_sms` SMs
    /// each (rounded up by the driver), and whose client sides are the SMs none of them has:
    /// for several controllers whose kernels run on the GPU at once (one GPU-resident model
    /// each). Refused if the GPU has too few SMs for them and some clients.
    pub fn split_several(
        cuda: &Arc<Cuda>,
        groups: u32,
        controller_sms: u32,
    ) -> Result<Vec<Arc<Self>>, GpuError> {
        Ok(
            backend::RawPartition::split_several(cuda, groups, controller_sms)?
                .into_iter()
                .map(|(raw, controller_sms, client_sms)| {
                    Arc::new(Self {
                        raw,
                        controller_sms,
                        client_sms,
                        _cuda: cuda.clone(),
                    })
                })
                .collect(),
        )
    }

    /// SMs reserved for the controller.
    pub fn controller_sms(&self) -> u32 {
        self.controller_sms
    }

    /// SMs left for client kernels.
    pub fn client_sms(&self) -> u32 {
        self.client_sms
    }
}

/// A stream: work (launches, copies, event records) run in order. With CUDA, a non-blocking
/// stream (never synchronises with the legacy default stream); with `host-gpu`, a worker
/// thread running its queue of jobs, a failed launch making the stream's error sticky as a
/// CUDA context's is.
pub struct Stream {
    raw: Arc<backend::RawStream>,
    /// Its id among the client streams frees wait for (`memory::track_client_stream`).
    client: Option<u64>,
    cuda: Arc<Cuda>,
    /// Kept alive while the stream lives (with CUDA, the stream's green context is its).
    _partition: Option<Arc<GreenPartition>>,
}

impl Stream {
    /// A new stream whose kernels run where `placement` says (`partition` is required for the
    /// green-context placements; with `host-gpu` it is checked and otherwise has no effect).
    pub fn new(
        cuda: &Arc<Cuda>,
        placement: Placement,
        partition: Option<&Arc<GreenPartition>>,
    ) -> Result<Self, GpuError> {
        let green = match placement {
            Placement::Anywhere => None,
            Placement::Controller | Placement::Client => {
                let p = partition.ok_or_else(|| {
                    GpuError::InvalidArgument("a green-context stream needs a partition".into())
                })?;
                Some((&p.raw, placement))
            }
        };
        let raw = Arc::new(backend::RawStream::new(cuda, green)?);
        // Kernels that drive GPU queues run on client streams: frees wait while one has work
        // in flight (see `memory::Holds` for why).
        let client =
            (placement == Placement::Client).then(|| memory::track_client_stream(cuda, &raw));
        Ok(Self {
            raw,
            client,
            cuda: cuda.clone(),
            _partition: partition.cloned(),
        })
    }

    /// Launches `kernel` with `args` (each passed by value).
    pub fn launch(
        &self,
        kernel: Kernel,
        grid: u32,
        block: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        self.launch_with_shared(kernel, grid, block, 0, args)
    }

    /// Launches `kernel` with `shared` bytes of dynamic shared memory per block.
    pub fn launch_with_shared(
        &self,
        kernel: Kernel,
        grid: u32,
        block: u32,
        shared: u32,
        args: &[Arg],
    ) -> Result<(), GpuError> {
        let slots = args.iter().map(|a| a.slot()).collect();
        // No free may start between its check that client streams are idle and its end.
        let _gate = self.client.map(|_| memory::client_launch_gate(&self.cuda));
        self.raw
            .launch(&self.cuda, kernel.raw, grid, block, shared, slots)
    }

    /// Queues a copy of `len` bytes from GPU address `src` into pinned memory at `offset`.
    pub fn copy_to_pinned(
        &self,
        dst: &PinnedMemory,
        offset: usize,
        src: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        let p = dst.at(offset, len);
        // SAFETY: `at` checked that `p..p + len` lies in `dst`, which outlives the copy (a free
        // of pinned memory waits for queued work: CUDA's synchronises, host-gpu's is held back
        // while jobs are in flight); the source is a GPU address the caller vouches for (an
        // allocation or a registered region).
        unsafe { self.raw.copy_to_host(p, src, len) }
    }

    /// Queues a copy of `len` bytes from pinned memory at `offset` to GPU address `dst`. The
    /// caller keeps those pinned bytes unchanged until the copy has run (an event after it).
    pub fn copy_from_pinned(
        &self,
        src: &PinnedMemory,
        offset: usize,
        dst: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        let p = src.at(offset, len);
        // SAFETY: `at` checked that `p..p + len` lies in `src`, kept alive (as in
        // `copy_to_pinned`) and unchanged (the caller) until the stream passes the copy; the
        // destination is a GPU address the caller vouches for.
        unsafe { self.raw.copy_from_host(p.cast_const(), dst, len) }
    }

    /// Queues a copy of `len` bytes at `offset` of a registered host range to GPU address
    /// `dst` (a DMA by a copy engine, reading the host pages over PCIe). The caller keeps the
    /// registration alive until the copy has run (an event after it, or the stream idle).
    pub fn copy_from_registered(
        &self,
        src: &HostRegistration,
        offset: usize,
        dst: u64,
        len: usize,
    ) -> Result<(), GpuError> {
        if offset.checked_add(len).is_none_or(|end| end > src.len) {
            return Err(GpuError::InvalidArgument(format!(
                "copy of {offset:#x}+{len:#x} outside a registration of {:#x} bytes",
                src.len
            )));
        }
        let p = src.host.wrapping_add(offset);
        // SAFETY: `p..p + len` lies in the registered, still mapped range (checked above; the
        // caller keeps it registered and mapped until the stream passes the copy); the
        // destination is a GPU address the caller vouches for.
        unsafe { self.raw.copy_from_host(p.cast_const(), dst, len) }
    }

    /// Queues a copy of `len` bytes from `src` at `src_offset` to `dst` at `dst_offset`, both
    /// GPU memory (ranges checked). The caller keeps both alive until the copy has run (an
    /// event after it, or the stream idle).
    pub fn copy_device(
        &self,
        dst: &DeviceMemory,
        dst_offset: usize,
        src: &DeviceMemory,
        src_offset: usize,
        len: usize,
    ) -> Result<(), GpuError> {
        let to = dst.range(dst_offset, len)?;
        let from = src.range(src_offset, len)?;
        // SAFETY: `range` checked that both lie in their allocations, which the caller keeps
        // alive until the stream passes the copy.
        unsafe { self.raw.copy_device(to, from, len) }
    }

    /// Whether all work queued so far has finished (an error if any of it failed).
    pub fn is_idle(&self) -> Result<bool, GpuError> {
        let idle = self.raw.is_idle()?;
        if idle && self.client.is_some() {
            // The frees held back while this stream's kernels ran may be due now.
            memory::release_held(&self.cuda);
        }
        Ok(idle)
    }

    /// Waits for the stream, at most `timeout`, polling (never an unbounded driver wait).
    pub fn wait_idle(&self, timeout: Duration) -> Result<(), GpuError> {
        poll_until("GPU stream", timeout, || self.is_idle())
    }
}

impl Drop for Stream {
    fn drop(&mut self) {
        if let Some(id) = self.client {
            memory::untrack_stream(&self.cuda, id);
        }
        // SAFETY: destroys the stream created in `new`, once; pending work still runs (with
        // `host-gpu`, the worker leaves once its queue is drained).
        unsafe { self.raw.destroy(&self.cuda) }
    }
}

/// Copies `data` into GPU memory at `dst` on `stream`: the bytes are taken (staged) before the
/// call returns, so the caller may reuse `data` at once; the copy runs in stream order.
pub fn copy_to_gpu(stream: &Stream, dst: u64, data: &[u8]) -> Result<(), GpuError> {
    stream.raw.upload(&stream.cuda, dst, data)
}

/// A completion marker on a stream (with CUDA, `cuEventCreate` without timing).
pub struct Event {
    raw: backend::RawEvent,
    cuda: Arc<Cuda>,
}

impl Event {
    /// A new event (not yet recorded: it counts as complete).
    pub fn new(cuda: &Arc<Cuda>) -> Result<Self, GpuError> {
        Ok(Self {
            raw: backend::RawEvent::new(cuda)?,
            cuda: cuda.clone(),
        })
    }

    /// Marks the point in `stream` reached by the work queued so far.
    pub fn record(&self, stream: &Stream) -> Result<(), GpuError> {
        self.raw.record(&stream.raw)
    }

    /// Marks the point reached by the work queued so far on a stream another library created
    /// (a PyTorch or CuPy stream, from a `__cuda_array_interface__`'s `stream` or a C
    /// caller's `cudaStream_t`), so its work can be waited for, bounded ([`Event::wait`]).
    ///
    /// # Safety
    /// `stream` is a live `CUstream` of the primary context of this event's GPU, or 1 (the
    /// legacy default stream) or 2 (the per-thread default stream).
    pub unsafe fn record_foreign(&self, stream: u64) -> Result<(), GpuError> {
        // SAFETY: forwarded: the caller's promise.
        unsafe { self.raw.record_foreign(&self.cuda, stream) }
    }

    /// Waits, at most `timeout`, for the work queued so far on a stream another library
    /// created ([`Event::record_foreign`]'s `stream`): what a call on a caller's memory does
    /// first, so the work that produced it has finished.
    ///
    /// # Safety
    /// As for [`Event::record_foreign`].
    pub unsafe fn wait_foreign(
        cuda: &Arc<Cuda>,
        stream: u64,
        timeout: Duration,
    ) -> Result<(), GpuError> {
        let ev = Self::new(cuda)?;
        // SAFETY: forwarded: the caller's promise.
        unsafe { ev.record_foreign(stream)? };
        ev.wait(timeout)
    }

    /// Whether the work before the last `record` has finished (an error if it failed).
    pub fn is_done(&self) -> Result<bool, GpuError> {
        self.raw.is_done()
    }

    /// Waits for it, at most `timeout`, polling.
    pub fn wait(&self, timeout: Duration) -> Result<(), GpuError> {
        poll_until("GPU event", timeout, || self.is_done())
    }
}

impl Drop for Event {
    fn drop(&mut self) {
        // SAFETY: destroys the event created in `new`, once.
        unsafe { self.raw.destroy(&self.cuda) }
    }
}
