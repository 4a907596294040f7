//! [`GpuController`]: the GPU-resident NVMe controller model. A persistent kernel
//! (`ptx/emu/gpunvme_controller.cuh`) on SMs reserved for it serves I/O queues whose rings and
//! doorbells live in GPU memory; the software controller keeps the admin queue, Identify,
//! features and queue bookkeeping, and hands every I/O queue it creates to this model through
//! [`nvme_emu::QueueServer`]. So the `nvme` driver brings it up unchanged and creates GPU
//! queues the normal way ([`queues`], or `GpuQueues::on_gpu_controller` through
//! [`crate::GpuQueuesExt`]).
//!
//! Media per namespace: `null` (no data moves: the protocol ceiling), `hbm` (the namespace's
//! image file loaded into GPU memory at start and written back at shutdown and when the model
//! stops). Device addresses are GPU pointers; the controller moves data only inside windows
//! registered with [`GpuController::register_window`], and fails anything else with Data
//! Transfer Error.
//!
//! Lifetime and bounds: the kernel is launched before any client and before any queue exists,
//! with every client kernel already loaded ([`gpu_queues::kernels::Kernels::warm_up_clients`],
//! and the tools' [`gpu_queues::kernels::ToolKernels::warm_up_clients`]);
//! start fails (and the kernel is stopped) unless every controller warp reports in within
//! [`GpuControllerOptions::start_timeout`]; table changes wait as long, at most, for every warp
//! to acknowledge them; [`GpuController::stop`] (and drop) stops the kernel within
//! [`STOP_TIMEOUT`], and the kernel stops by itself after
//! [`GpuControllerOptions::lifetime`] whatever the host does.
//!
//! The model (optional): a namespace may carry an [`SsdModel`] (latency, IOPS and bandwidth
//! caps of `drives` striped drives; see [`crate::ssd_model`]), and [`GpuController::faults`]
//! injects media errors, dropped completions and a completion delay while the kernel runs,
//! with `nvme_emu::Faults`' names. With neither, the kernel's fast path is unchanged: each
//! command completes in the pass that fetched it. With either, completions are held in the
//! controller warps' shared memory until due; at stop the ones still held are never posted
//! (counted in [`GpuControllerStats::abandoned`]) and do not delay the stop.
#![forbid(unsafe_code)]

use std::path::PathBuf;
use std::sync::{Arc, Mutex};
use std::time::{Duration, Instant};

use nvme_emu::{EmuDevice, QueueServer, QueueServerRefusal};
use zerocopy::{FromZeros, IntoBytes};

use crate::desc::{
    CTRL_DOORBELL_STRIDE, CTRL_DRIVE_STRIDE, CTRL_MAX_DRIVES, CTRL_MAX_MEDIA_ERRORS, CTRL_MAX_NS,
    CTRL_MAX_WINDOWS, CTRL_WARPS, CtrlControl, CtrlCounters, CtrlMediaError, CtrlNs, CtrlNsModel,
    CtrlQueue, CtrlWindow, FAULT_DELAY, FAULT_DROPS, FAULT_MEDIA, MEDIA_HBM, MEDIA_HOST,
    MEDIA_NULL, NS_READ_ONLY, pending_capacity,
};
use crate::os::MappedImage;
use gpu_queues::GpuError;
use gpu_queues::ffi::{
    self, Arg, Cuda, DeviceMemory, GreenPartition, PinnedMemory, Placement, Stream,
};
use gpu_queues::kernels::Kernels;

use crate::kernels::EmuKernels;
pub use crate::ssd_model::SsdModel;

mod faults;
mod queues;
pub use faults::GpuFaults;
pub use queues::{ModelTransport, queues};

/// How long [`GpuController::stop`] waits for the kernel.
pub const STOP_TIMEOUT: Duration = Duration::from_secs(10);
/// Fewest held completions per controller warp the model starts with (it needs room for at
/// least one 32-command batch; a few hundred fit beside the tables on Ampere and Hopper).
const MIN_PENDING: u32 = 64;
/// [`GpuFaults::drop_completions`] count meaning "every completion, until cleared"
/// (`nvme_emu::DROP_ALL`).
pub const DROP_ALL: u64 = u64::MAX;

/// Where a namespace's blocks live.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MediaKind {
    /// No data moves; reads return whatever the buffer held. The protocol ceiling.
    Null,
    /// The image in GPU memory (loaded at start, written back at shutdown and stop).
    Hbm,
    /// The image file itself, mapped and registered with CUDA: the controller reads (and
    /// writes) its page-cache pages over PCIe. Writable namespaces need the image on tmpfs
    /// (CUDA refuses read-write registration of ext4 file mappings); read-only ones work on
    /// any file system.
    Host,
}

impl MediaKind {
    /// The name used on the command line and in reports.
    pub fn name(self) -> &'static str {
        match self {
            Self::Null => "null",
            Self::Hbm => "hbm",
            Self::Host => "host",
        }
    }
}

impl std::str::FromStr for MediaKind {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "null" => Ok(Self::Null),
            "hbm" => Ok(Self::Hbm),
            "host" => Ok(Self::Host),
            other => Err(format!("unknown media {other:?} (null, hbm or host)")),
        }
    }
}

/// One namespace as the model serves it: the same geometry the software controller reports.
#[derive(Clone, Debug, Default)]
pub struct NamespaceSpec {
    /// Logical blocks.
    pub blocks: u64,
    /// LBA size in bytes (512 or 4096).
    pub lba_size: u32,
    /// The image file behind it (read at start and written back, for `hbm`).
    pub image: Option<PathBuf>,
    /// Write protected: Write, Write Zeroes and Dataset Management fail with Namespace Is
    /// Write Protected, and `hbm` media is never written back.
    pub read_only: bool,
    /// The SSD timing model of the namespace (None: completions as fast as the controller
    /// goes).
    pub ssd_model: Option<SsdModel>,
}

/// How to run the model.
#[derive(Clone, Debug)]
pub struct GpuControllerOptions {
    /// SMs reserved for the controller kernel (green context; default 8, the minimum
    /// partition on Hopper). One block of `CTRL_WARPS` warps runs per SM.
    pub controller_sms: u32,
    /// Media of every namespace.
    pub media: MediaKind,
    /// Longest sleep after a polling pass that found nothing (doubling from 32 ns): without
    /// backoff, polling SMs collapsed throughput (../shared/design/gpu.md).
    pub idle_ns: u32,
    /// The kernel stops by itself after this long.
    pub lifetime: Duration,
    /// How long to wait for every controller warp to start. `None` (the default): the GPU
    /// queues' default device-wait bound ([`gpu_queues::GpuQueueOptions::timeout`]: 10 s unless
    /// `GPUNVME_GPU_TIMEOUT_S` or compute-sanitizer makes it longer), at least 5 s: on CPU
    /// threads (the `host-gpu` build) 128 warps of 32 threads on a 2-core machine can take more
    /// than 5 s to all run.
    pub start_timeout: Option<Duration>,
    /// For one of several models started together ([`ModelGroup::split`]): the SMs it runs on
    /// and the gate its launch waits at; `None` splits the GPU for this model alone
    /// (`controller_sms` for it, the rest for clients).
    pub group: Option<GroupMember>,
    /// Hostile modes, as the software controller has them (`nvme_emu::Hostile`; off by
    /// default, on in the tests): fetched SQEs poisoned, backward SQ tails refused as invalid
    /// doorbell writes, CQ entries freed by a head doorbell rewritten with garbage.
    pub hostile: nvme_emu::Hostile,
}

/// Several GPU-resident models started together, one per controller: the GPU's SMs split once
/// ([`GreenPartition::split_several`]: disjoint controller sides, the rest shared by clients)
/// and one [`StartGate`] that holds every model's launch until all of them have loaded and
/// warmed up their kernels. A module load while a model's persistent kernel runs would wait
/// for that kernel, and hold every other thread's CUDA launches meanwhile
/// (`benches/probes/stream_progress.cu`): the models would stall each other's start until
/// their lifetime ran out.
pub struct ModelGroup;

impl ModelGroup {
    /// `n` members, each with `controller_sms` SMs (rounded up by the driver) of its own.
    pub fn split(
        cuda: &Arc<Cuda>,
        n: u32,
        controller_sms: u32,
    ) -> Result<Vec<GroupMember>, GpuError> {
        let gate = Arc::new(StartGate::new(n as usize));
        Ok(GreenPartition::split_several(cuda, n, controller_sms)?
            .into_iter()
            .map(|partition| GroupMember {
                partition,
                gate: gate.clone(),
            })
            .collect())
    }
}

/// One model of a [`ModelGroup`].
#[derive(Clone, Debug)]
pub struct GroupMember {
    /// The SMs it runs on (its controller side is its own).
    pub partition: Arc<GreenPartition>,
    /// Where its launch waits for the others.
    pub gate: Arc<StartGate>,
}

/// How long a model's launch waits at a [`StartGate`] for the other models of its group.
const GATE_TIMEOUT: Duration = Duration::from_secs(60);

/// Holds the launches of a [`ModelGroup`]'s models until every model has arrived (loaded and
/// warmed up everything it launches), bounded; a model that fails before arriving releases the
/// others with an error.
#[derive(Debug)]
pub struct StartGate {
    parties: usize,
    /// (arrived, a member failed before arriving)
    state: Mutex<(usize, bool)>,
    cv: std::sync::Condvar,
}

impl StartGate {
    fn new(parties: usize) -> Self {
        Self {
            parties,
            state: Mutex::new((0, false)),
            cv: std::sync::Condvar::new(),
        }
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, (usize, bool)> {
        self.state.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Arrives and waits (at most `timeout`) for every other member.
    fn arrive_and_wait(&self, timeout: Duration) -> Result<(), GpuError> {
        let start = Instant::now();
        let mut st = self.lock();
        st.0 += 1;
        self.cv.notify_all();
        loop {
            if st.1 {
                return Err(GpuError::Unsupported(
                    "another GPU-resident model of the group failed to start".into(),
                ));
            }
            if st.0 >= self.parties {
                return Ok(());
            }
            let left = timeout.saturating_sub(start.elapsed());
            if left.is_zero() {
                st.1 = true;
                self.cv.notify_all();
                return Err(GpuError::Timeout {
                    what: "the other GPU-resident models of the group to start",
                    waited: timeout,
                });
            }
            st = self
                .cv
                .wait_timeout(st, left)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// Tells the others this member will not arrive.
    fn fail(&self) {
        self.lock().1 = true;
        self.cv.notify_all();
    }
}

/// A member's promise to arrive at its gate: failing (dropped) before it did releases the
/// others with an error.
struct Arrival<'a> {
    gate: &'a StartGate,
    arrived: bool,
}

impl Drop for Arrival<'_> {
    fn drop(&mut self) {
        if !self.arrived {
            self.gate.fail();
        }
    }
}

impl Default for GpuControllerOptions {
    fn default() -> Self {
        Self {
            controller_sms: 8,
            media: MediaKind::Null,
            idle_ns: 1024,
            lifetime: Duration::from_secs(600),
            start_timeout: None,
            group: None,
            hostile: nvme_emu::Hostile::default(),
        }
    }
}

/// What the controller kernel did, summed over its warps (read after it stopped).
#[derive(Clone, Copy, Debug, Default)]
pub struct GpuControllerStats {
    /// Commands completed (any status).
    pub commands: u64,
    /// Of which with an error status.
    pub errors: u64,
    /// Data bytes moved.
    pub bytes: u64,
    /// Doorbell values out of range, ignored.
    pub doorbell_errors: u64,
    /// Polling passes.
    pub passes: u64,
    /// Passes that found nothing to do.
    pub idle_passes: u64,
    /// Distinct SMs the controller's blocks ran on.
    pub sms: u32,
    /// Completions dropped by [`GpuFaults::drop_completions`] (their commands executed).
    pub dropped: u64,
    /// Completions the model held and never posted: still due when it stopped, or for a
    /// queue deleted meanwhile.
    pub abandoned: u64,
}

/// Offsets in the pinned control area.
struct Layout {
    queues: usize,
    windows: usize,
    namespaces: usize,
    models: usize,
    media_errors: usize,
    ack: usize,
    blocks: usize,
    len: usize,
}

impl Layout {
    fn new(nqueues: usize, warps: usize, blocks: usize) -> Self {
        let queues = size_of::<CtrlControl>();
        let windows = queues + nqueues * size_of::<CtrlQueue>();
        let namespaces = windows + CTRL_MAX_WINDOWS * size_of::<CtrlWindow>();
        let models = namespaces + CTRL_MAX_NS * size_of::<CtrlNs>();
        let media_errors = models + CTRL_MAX_NS * size_of::<CtrlNsModel>();
        let ack = media_errors + CTRL_MAX_MEDIA_ERRORS * size_of::<CtrlMediaError>();
        let len = ack + (warps + blocks) * 4;
        Self {
            queues,
            windows,
            namespaces,
            models,
            media_errors,
            ack,
            blocks,
            len,
        }
    }
}

/// Host-side bookkeeping of the tables, under one lock.
struct Tables {
    generation: u32,
    serial: u32,
    windows: Vec<CtrlWindow>,
    /// Completion queues created, waiting for their submission queue: (addr, entries).
    cqs: Vec<Option<(u64, u32)>>,
    failed: Option<String>,
    /// Injected media errors, as the kernel's table holds them.
    media_errors: Vec<CtrlMediaError>,
    /// Drop counters the host armed (index 0: any queue), not known to have run out.
    drops_armed: std::collections::BTreeSet<u16>,
    /// Completion delay, nanoseconds.
    delay_ns: u32,
}

/// The state the software controller's admin thread and the owner share.
struct Shared {
    cuda: Arc<Cuda>,
    control: PinnedMemory,
    layout: Layout,
    doorbells: DeviceMemory,
    warps: usize,
    nqueues: usize,
    tables: Mutex<Tables>,
    /// Per namespace: its media (None: null media).
    media: Vec<Option<NsMedia>>,
    /// The drives' busy-until words of every namespace's timing model.
    _busy: DeviceMemory,
    /// Completions still to drop, u64 per queue id (index 0: on any queue).
    drops: DeviceMemory,
    /// How long a table change waits for every controller warp to acknowledge it: the start's
    /// bound (`GpuControllerOptions::start_timeout`), which waits for the same thing. A fixed
    /// 5 s was too short on CPU threads (the `host-gpu` build: 1 of 128 warps missed it on the
    /// 2-core CI machine, 2026-11-27), where the device-wait bound is raised for that reason.
    ack_timeout: Duration,
}

/// The GPU-resident controller model, running.
pub struct GpuController {
    shared: Arc<Shared>,
    emu: Arc<EmuDevice>,
    stream: Stream,
    client_stream: Stream,
    kernels: Arc<Kernels>,
    _emu_kernels: Arc<EmuKernels>,
    partition: Arc<GreenPartition>,
    counters: DeviceMemory,
    /// Block 0's mirror of the host's words (read by the kernel while it runs).
    _mirror: DeviceMemory,
    blocks: u32,
    media: MediaKind,
    ssd_models: Vec<Option<SsdModel>>,
    pending_per_warp: u32,
    faults: GpuFaults,
    stopped: Mutex<Option<GpuControllerStats>>,
    /// Whether the kernel still counts as a running persistent kernel (frees held back): set at
    /// the launch, cleared exactly once when the kernel is seen ended, even if `stop` then
    /// fails and is called again (a second count down would let frees through while another
    /// model runs).
    counted: std::sync::atomic::AtomicBool,
}

impl std::fmt::Debug for GpuController {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GpuController")
            .field("blocks", &self.blocks)
            .field("media", &self.media)
            .finish_non_exhaustive()
    }
}

impl GpuController {
    /// Loads the media, starts the controller kernel on its own SMs, waits until every warp
    /// runs, and installs the model as `emu`'s queue server (I/O queues created afterwards are
    /// the model's). `namespaces` must match what `emu` reports; `max_transfer` is its MDTS
    /// in bytes; `nqueues` the queue ids it grants.
    pub fn start(
        cuda: &Arc<Cuda>,
        emu: &Arc<EmuDevice>,
        namespaces: &[NamespaceSpec],
        nqueues: u16,
        max_transfer: u32,
        opts: &GpuControllerOptions,
    ) -> Result<Arc<Self>, GpuError> {
        if namespaces.is_empty() || namespaces.len() > CTRL_MAX_NS {
            return Err(GpuError::InvalidArgument(format!(
                "{} namespaces (the GPU controller serves 1 to {CTRL_MAX_NS})",
                namespaces.len()
            )));
        }
        let start_timeout = match opts.start_timeout {
            Some(t) => t,
            None => gpu_queues::GpuQueueOptions::default()
                .timeout()?
                .max(Duration::from_secs(5)),
        };
        // A member of a group arrives at its gate before launching, whatever happens first.
        let mut arrival = opts.group.as_ref().map(|g| Arrival {
            gate: &g.gate,
            arrived: false,
        });
        let kernels = Kernels::load(cuda)?;
        let emu_kernels = EmuKernels::load(cuda)?;
        let partition = match &opts.group {
            Some(g) => g.partition.clone(),
            None => GreenPartition::split(cuda, opts.controller_sms)?,
        };
        let stream = Stream::new(cuda, Placement::Controller, Some(&partition))?;
        let client_stream = Stream::new(cuda, Placement::Client, Some(&partition))?;
        // Every kernel loaded in both partitions before anything spins.
        emu_kernels.warm_up(&stream)?;
        kernels.warm_up(&stream)?;
        kernels.warm_up_clients(cuda, &client_stream)?;
        // The tools' kernels too (perf, the tests', benchmarks' and examples'): loaded at a
        // first use while this controller spins, they might never run.
        kernels.tools()?.warm_up_clients(cuda, &client_stream)?;

        let blocks = partition.controller_sms();
        let warps = (blocks * CTRL_WARPS) as usize;
        let nq = nqueues as usize;
        let layout = Layout::new(nq, warps, blocks as usize);
        let control = PinnedMemory::alloc(cuda, layout.len)?;
        control.write(0, &vec![0u8; layout.len]);
        let doorbells = DeviceMemory::alloc(cuda, nq.max(1) * CTRL_DOORBELL_STRIDE)?;
        let counters = DeviceMemory::alloc(cuda, warps * size_of::<CtrlCounters>())?;
        // Block 0's mirror of (stop, generation) for the other blocks, starting as the header
        // below says.
        let mirror = DeviceMemory::alloc(cuda, 64)?;
        mirror.write(0, [0u32, 1u32].as_bytes())?;
        let drive_bytes = CTRL_MAX_DRIVES * CTRL_DRIVE_STRIDE;
        let busy = DeviceMemory::alloc(cuda, CTRL_MAX_NS * drive_bytes)?;
        let drops = DeviceMemory::alloc(cuda, (nq + 1) * 8)?;
        let mut models = vec![CtrlNsModel::default(); CTRL_MAX_NS];
        for (i, ns) in namespaces.iter().enumerate() {
            if let Some(m) = &ns.ssd_model {
                m.validate().map_err(|e| {
                    GpuError::InvalidArgument(format!("namespace {}: SSD model: {e}", i + 1))
                })?;
                models[i] = m.to_ctrl(busy.ptr() + (i * drive_bytes) as u64);
            }
        }

        let mut media = Vec::with_capacity(namespaces.len());
        let mut ns_table = vec![CtrlNs::default(); CTRL_MAX_NS];
        for (i, ns) in namespaces.iter().enumerate() {
            let shift = match ns.lba_size {
                512 => 9,
                4096 => 12,
                other => {
                    return Err(GpuError::InvalidArgument(format!(
                        "namespace {}: {other}-byte LBAs (512 or 4096)",
                        i + 1
                    )));
                }
            };
            let loaded = match opts.media {
                MediaKind::Null => None,
                MediaKind::Hbm => {
                    let (mem, path) = load_image(cuda, ns, i + 1)?;
                    Some(NsMedia::Hbm {
                        mem,
                        write_back: (!ns.read_only).then_some(path),
                    })
                }
                MediaKind::Host => {
                    let path = ns.image.as_ref().ok_or_else(|| {
                        GpuError::InvalidArgument(format!(
                            "namespace {}: host media needs an image file",
                            i + 1
                        ))
                    })?;
                    let len = usize::try_from(ns.blocks * ns.lba_size as u64).map_err(|_| {
                        GpuError::InvalidArgument(format!("namespace {} too large", i + 1))
                    })?;
                    Some(NsMedia::Host(MappedImage::open(
                        cuda,
                        path,
                        len,
                        !ns.read_only,
                    )?))
                }
            };
            ns_table[i] = CtrlNs {
                blocks: ns.blocks,
                media: loaded.as_ref().map_or(0, NsMedia::device_ptr),
                lba_shift: shift,
                kind: match &loaded {
                    None => MEDIA_NULL,
                    Some(NsMedia::Hbm { .. }) => MEDIA_HBM,
                    Some(NsMedia::Host(_)) => MEDIA_HOST,
                },
                flags: if ns.read_only { NS_READ_ONLY } else { 0 },
                reserved: 0,
            };
            media.push(loaded);
        }
        control.write(layout.namespaces, ns_table.as_bytes());
        control.write(layout.models, models.as_bytes());
        let header = CtrlControl {
            stop: 0,
            generation: 1,
            nqueues: nqueues as u32,
            nwindows: 0,
            nns: namespaces.len() as u32,
            idle_ns: opts.idle_ns.max(32),
            max_transfer,
            queues: control.device_ptr() + layout.queues as u64,
            windows: control.device_ptr() + layout.windows as u64,
            namespaces: control.device_ptr() + layout.namespaces as u64,
            doorbells: doorbells.ptr(),
            counters: counters.ptr(),
            ack: control.device_ptr() + layout.ack as u64,
            lifetime_ns: opts.lifetime.as_nanos().clamp(1, u64::MAX as u128) as u64,
            mirror: mirror.ptr(),
            models: control.device_ptr() + layout.models as u64,
            media_errors: control.device_ptr() + layout.media_errors as u64,
            drops: drops.ptr(),
            hostile: crate::desc::hostile_bits(opts.hostile),
            ..CtrlControl::new_zeroed()
        };
        control.write(0, header.as_bytes());
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);

        let shared = Arc::new(Shared {
            cuda: cuda.clone(),
            control,
            layout,
            doorbells,
            warps,
            nqueues: nq,
            tables: Mutex::new(Tables {
                generation: 1,
                serial: 0,
                windows: Vec::new(),
                cqs: vec![None; nq + 1],
                failed: None,
                media_errors: Vec::new(),
                drops_armed: Default::default(),
                delay_ns: 0,
            }),
            media,
            _busy: busy,
            drops,
            ack_timeout: start_timeout,
        });
        // One block per SM (a second block on an SM would halve both blocks' polling rate).
        // With a timing model, all the shared memory a block may have: the held completions
        // live there (MODEL in gpunvme_controller.cuh); without, just over half an SM's.
        let timed = namespaces.iter().any(|n| n.ssd_model.is_some());
        let shared_bytes = emu_kernels.controller.reserve_whole_sm(cuda, timed)?;
        let pending_per_warp = pending_capacity(shared_bytes);
        if pending_per_warp < MIN_PENDING {
            return Err(GpuError::Unsupported(format!(
                "the GPU controller's warps would hold {pending_per_warp} completions each \
                 ({shared_bytes} B of dynamic shared memory per block); the model needs {MIN_PENDING}"
            )));
        }
        // Every model of a group has loaded and warmed up what it launches before any of them
        // launches its persistent kernel (see `ModelGroup`).
        if let Some(a) = arrival.as_mut() {
            a.arrived = true;
            a.gate.arrive_and_wait(GATE_TIMEOUT)?;
        }
        // From the launch until the kernel has ended, frees are held back (they would wait for
        // it): counted before the launch, so no free can start in between.
        ffi::persistent_kernel_started(cuda);
        if let Err(e) = stream.launch_with_shared(
            emu_kernels.controller,
            blocks,
            CTRL_WARPS * 32,
            shared_bytes,
            &[Arg::U64(shared.control.device_ptr())],
        ) {
            ffi::persistent_kernel_ended(cuda);
            return Err(e);
        }
        let ctrl = Arc::new(Self {
            faults: GpuFaults {
                shared: shared.clone(),
            },
            shared,
            emu: emu.clone(),
            stream,
            client_stream,
            kernels,
            _emu_kernels: emu_kernels,
            partition,
            counters,
            _mirror: mirror,
            blocks,
            media: opts.media,
            ssd_models: namespaces.iter().map(|n| n.ssd_model).collect(),
            pending_per_warp,
            stopped: Mutex::new(None),
            counted: std::sync::atomic::AtomicBool::new(true),
        });
        // Every warp must report in: a block that never became resident (no free SMs) would
        // leave its queues unserved.
        let started = ctrl.shared.wait_acks(1, start_timeout);
        if let Err(running) = started {
            let _ = ctrl.stop();
            return Err(GpuError::Unsupported(format!(
                "the GPU controller did not start: {running} of {warps} controller warps \
                 running after {:?} (are {} SMs free for it?)",
                start_timeout, blocks
            )));
        }
        let sms = ctrl.shared.block_sms();
        let distinct: std::collections::BTreeSet<u32> = sms.iter().copied().collect();
        if distinct.len() != sms.len() {
            let _ = ctrl.stop();
            return Err(GpuError::Unsupported(format!(
                "the GPU controller's {} blocks landed on {} SMs ({sms:?}): they must have one \
                 SM each",
                sms.len(),
                distinct.len()
            )));
        }
        emu.set_queue_server(Some(ctrl.shared.clone()));
        tracing::info!(
            blocks,
            warps,
            media = opts.media.name(),
            pending_per_warp,
            timed,
            "GPU-resident controller started"
        );
        Ok(ctrl)
    }

    /// Lets the controller move data through `len` bytes of GPU memory at `base` (device
    /// address = GPU pointer). The window stays registered while the returned guard lives; the
    /// caller keeps the memory alive longer than the guard.
    pub fn register_window(&self, base: u64, len: u64) -> Result<WindowGuard, GpuError> {
        self.shared.add_window(base, len)?;
        Ok(WindowGuard {
            shared: self.shared.clone(),
            base,
        })
    }

    /// GPU pointers of queue `qid`'s SQ tail and CQ head doorbells.
    pub fn doorbells(&self, qid: u16) -> Result<(u64, u64), GpuError> {
        if qid == 0 || qid as usize > self.shared.nqueues {
            return Err(GpuError::InvalidArgument(format!("queue id {qid}")));
        }
        let sq = self.shared.doorbells.ptr() + (qid as u64 - 1) * CTRL_DOORBELL_STRIDE as u64;
        Ok((sq, sq + 4))
    }

    /// The SM partition (controller and clients).
    pub fn partition(&self) -> &Arc<GreenPartition> {
        &self.partition
    }

    /// The stream client kernels run on (every kernel already loaded there).
    pub fn client_stream(&self) -> &Stream {
        &self.client_stream
    }

    /// The runtime's kernels, loaded and warmed up for clients before the controller started.
    pub fn kernels(&self) -> &Arc<Kernels> {
        &self.kernels
    }

    /// The media in use.
    pub fn media(&self) -> MediaKind {
        self.media
    }

    /// Each namespace's SSD timing model (index nsid - 1).
    pub fn ssd_models(&self) -> &[Option<SsdModel>] {
        &self.ssd_models
    }

    /// How many completions each controller warp can hold (timing model or faults): at most
    /// this many commands of the queues a warp owns are in flight inside the model.
    pub fn pending_per_warp(&self) -> u32 {
        self.pending_per_warp
    }

    /// Fault injection while the kernel runs (media errors, dropped completions, a completion
    /// delay), with `nvme_emu::Faults`' names.
    pub fn faults(&self) -> &GpuFaults {
        &self.faults
    }

    /// Controller blocks (one per SM of the partition).
    pub fn blocks(&self) -> u32 {
        self.blocks
    }

    /// How long a queue change may wait for every controller warp to take it: the admin
    /// commands that create or delete this model's queues wait that long, at most, inside the
    /// software controller, so the host's admin timeout must be longer
    /// (`nvme::Controller::raise_admin_timeout`).
    pub fn queue_change_bound(&self) -> Duration {
        self.shared.ack_timeout
    }

    /// Whether the kernel is still running.
    pub fn is_running(&self) -> bool {
        matches!(self.stream.is_idle(), Ok(false))
    }

    /// Stops the kernel (bounded), detaches from the software controller, writes `hbm` media
    /// back to the images, and returns what the kernel did. Idempotent.
    pub fn stop(&self) -> Result<GpuControllerStats, GpuError> {
        let mut stopped = self.stopped.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(s) = *stopped {
            return Ok(s);
        }
        self.emu.set_queue_server(None);
        self.shared.control.store_u32(0, 1);
        self.stream.wait_idle(STOP_TIMEOUT)?;
        if self
            .counted
            .swap(false, std::sync::atomic::Ordering::AcqRel)
        {
            ffi::persistent_kernel_ended(&self.shared.cuda);
        }
        let mut all = vec![CtrlCounters::default(); self.shared.warps];
        self.counters.read(0, all.as_mut_bytes())?;
        let mut s = GpuControllerStats::default();
        for c in &all {
            s.commands += c.commands;
            s.errors += c.errors;
            s.bytes += c.bytes;
            s.doorbell_errors += c.doorbell_errors;
            s.passes += c.passes;
            s.idle_passes += c.idle_passes;
            s.dropped += c.dropped as u64;
            s.abandoned += c.abandoned as u64;
        }
        let mut sms: Vec<u32> = (0..self.blocks as usize)
            .map(|b| {
                self.shared
                    .control
                    .load_u32(self.shared.layout.ack + (self.shared.warps + b) * 4)
            })
            .filter(|&v| v != 0)
            .collect();
        sms.sort_unstable();
        sms.dedup();
        s.sms = sms.len() as u32;
        self.shared.write_back()?;
        *stopped = Some(s);
        tracing::info!(?s, "GPU-resident controller stopped");
        Ok(s)
    }
}

impl Drop for GpuController {
    fn drop(&mut self) {
        if let Err(e) = self.stop() {
            tracing::warn!(error = %e, "stopping the GPU-resident controller");
        }
    }
}

/// Keeps a window registered with the controller; unregisters it when dropped.
pub struct WindowGuard {
    shared: Arc<Shared>,
    base: u64,
}

impl Drop for WindowGuard {
    fn drop(&mut self) {
        if let Err(e) = self.shared.remove_window(self.base) {
            tracing::warn!(error = %e, "unregistering a GPU controller window");
        }
    }
}

/// A namespace's media.
#[derive(Debug)]
enum NsMedia {
    /// In GPU memory, written back to the image unless the namespace is read-only.
    Hbm {
        mem: DeviceMemory,
        write_back: Option<PathBuf>,
    },
    /// The image's pages, mapped and registered.
    Host(MappedImage),
}

impl NsMedia {
    fn device_ptr(&self) -> u64 {
        match self {
            Self::Hbm { mem, .. } => mem.ptr(),
            Self::Host(m) => m.device_ptr(),
        }
    }
}

/// Reads a namespace's image into GPU memory.
fn load_image(
    cuda: &Arc<Cuda>,
    ns: &NamespaceSpec,
    nsid: usize,
) -> Result<(DeviceMemory, PathBuf), GpuError> {
    use std::os::unix::fs::FileExt;
    let path = ns.image.clone().ok_or_else(|| {
        GpuError::InvalidArgument(format!("namespace {nsid}: hbm media needs an image file"))
    })?;
    let bytes = ns.blocks * ns.lba_size as u64;
    let mem = DeviceMemory::alloc(cuda, bytes as usize)?;
    let file = std::fs::File::open(&path).map_err(|e| {
        GpuError::Unsupported(format!("opening {} for hbm media: {e}", path.display()))
    })?;
    let mut buf = vec![0u8; 64 << 20];
    let mut off = 0u64;
    while off < bytes {
        let n = (bytes - off).min(buf.len() as u64) as usize;
        file.read_exact_at(&mut buf[..n], off).map_err(|e| {
            GpuError::Unsupported(format!("reading {} at {off}: {e}", path.display()))
        })?;
        mem.write(off as usize, &buf[..n])?;
        off += n as u64;
    }
    Ok((mem, path))
}

impl Shared {
    fn lock_tables(&self) -> std::sync::MutexGuard<'_, Tables> {
        self.tables.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Writes the fault tables and bits of `t` and publishes them.
    fn publish_faults(&self, t: &mut Tables) -> Result<(), GpuError> {
        self.control
            .write(self.layout.media_errors, t.media_errors.as_bytes());
        let mut faults = 0;
        if !t.media_errors.is_empty() {
            faults |= FAULT_MEDIA;
        }
        if !t.drops_armed.is_empty() {
            faults |= FAULT_DROPS;
        }
        if t.delay_ns != 0 {
            faults |= FAULT_DELAY;
        }
        self.control.store_u32(
            std::mem::offset_of!(CtrlControl, nmedia_errors),
            t.media_errors.len() as u32,
        );
        self.control
            .store_u32(std::mem::offset_of!(CtrlControl, delay_ns), t.delay_ns);
        self.control
            .store_u32(std::mem::offset_of!(CtrlControl, faults), faults);
        self.publish(t)
    }

    fn drops_at(&self, qid: u16) -> Result<u64, GpuError> {
        let mut b = [0u8; 8];
        self.drops.read(qid as usize * 8, &mut b)?;
        Ok(u64::from_le_bytes(b))
    }

    /// The SM each controller block runs on (reported once it started).
    fn block_sms(&self) -> Vec<u32> {
        (0..self.layout.blocks)
            .map(|b| {
                self.control
                    .load_u32(self.layout.ack + (self.warps + b) * 4)
                    .wrapping_sub(1)
            })
            .collect()
    }

    /// Waits until every warp acknowledged `generation`; on timeout returns how many had.
    fn wait_acks(&self, generation: u32, timeout: Duration) -> Result<(), usize> {
        let start = Instant::now();
        loop {
            let seen = (0..self.warps)
                .filter(|w| {
                    self.control
                        .load_u32(self.layout.ack + w * 4)
                        .wrapping_sub(generation)
                        < u32::MAX / 2
                })
                .count();
            if seen == self.warps {
                return Ok(());
            }
            if start.elapsed() > timeout {
                return Err(seen);
            }
            std::thread::sleep(Duration::from_micros(20));
        }
    }

    /// Publishes the table changes made under `tables`: bump the generation (after the
    /// tables, Release), then wait for every warp to take it.
    fn publish(&self, tables: &mut Tables) -> Result<(), GpuError> {
        if let Some(why) = &tables.failed {
            return Err(GpuError::Unsupported(format!(
                "GPU controller failed: {why}"
            )));
        }
        tables.generation = tables.generation.wrapping_add(1);
        std::sync::atomic::fence(std::sync::atomic::Ordering::SeqCst);
        self.control.store_u32(4, tables.generation);
        if let Err(seen) = self.wait_acks(tables.generation, self.ack_timeout) {
            let why = format!(
                "{seen} of {} controller warps took a table change within {:?}",
                self.warps, self.ack_timeout
            );
            tables.failed = Some(why.clone());
            return Err(GpuError::Unsupported(why));
        }
        Ok(())
    }

    fn write_windows(&self, t: &Tables) {
        self.control
            .write(self.layout.windows, t.windows.as_bytes());
        self.control.store_u32(12, t.windows.len() as u32);
    }

    fn add_window(&self, base: u64, len: u64) -> Result<(), GpuError> {
        let mut t = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if t.windows.len() >= CTRL_MAX_WINDOWS {
            return Err(GpuError::Unsupported(format!(
                "more than {CTRL_MAX_WINDOWS} memory windows on the GPU controller"
            )));
        }
        t.windows.push(CtrlWindow { base, len });
        self.write_windows(&t);
        self.publish(&mut t)
    }

    fn remove_window(&self, base: u64) -> Result<(), GpuError> {
        let mut t = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        t.windows.retain(|w| w.base != base);
        self.write_windows(&t);
        self.publish(&mut t)
    }

    fn reachable(t: &Tables, addr: u64, len: u64) -> bool {
        t.windows
            .iter()
            .any(|w| addr >= w.base && addr - w.base <= w.len && len <= w.len - (addr - w.base))
    }

    fn write_queue(&self, qid: u16, q: &CtrlQueue) {
        self.control.write(
            self.layout.queues + (qid as usize - 1) * size_of::<CtrlQueue>(),
            q.as_bytes(),
        );
    }

    fn write_back(&self) -> Result<(), GpuError> {
        use std::os::unix::fs::FileExt;
        for media in self.media.iter().flatten() {
            let (mem, path) = match media {
                NsMedia::Hbm {
                    mem,
                    write_back: Some(path),
                } => (mem, path),
                NsMedia::Hbm { .. } => continue,
                NsMedia::Host(map) => {
                    map.flush()?;
                    continue;
                }
            };
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(path)
                .map_err(|e| GpuError::Unsupported(format!("{}: {e}", path.display())))?;
            let mut buf = vec![0u8; (64 << 20).min(mem.len())];
            let mut off = 0usize;
            while off < mem.len() {
                let n = (mem.len() - off).min(buf.len());
                mem.read(off, &mut buf[..n])?;
                file.write_all_at(&buf[..n], off as u64)
                    .map_err(|e| GpuError::Unsupported(format!("{}: {e}", path.display())))?;
                off += n;
            }
            file.sync_data()
                .map_err(|e| GpuError::Unsupported(format!("{}: {e}", path.display())))?;
        }
        Ok(())
    }
}

impl QueueServer for Shared {
    fn create_cq(&self, qid: u16, addr: u64, entries: u32) -> Result<(), QueueServerRefusal> {
        let mut t = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if qid as usize > self.nqueues {
            return Err(QueueServerRefusal::Unsupported(format!("queue id {qid}")));
        }
        if !Self::reachable(&t, addr, entries as u64 * 16) {
            return Err(QueueServerRefusal::Unreachable { addr });
        }
        t.cqs[qid as usize] = Some((addr, entries));
        Ok(())
    }

    fn create_sq(
        &self,
        qid: u16,
        cqid: u16,
        addr: u64,
        entries: u32,
    ) -> Result<(), QueueServerRefusal> {
        let mut t = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if qid != cqid {
            return Err(QueueServerRefusal::Unsupported(format!(
                "submission queue {qid} posting to completion queue {cqid} (the GPU \
                 controller pairs each SQ with the CQ of the same id)"
            )));
        }
        let Some((cq, cq_entries)) = t.cqs.get(qid as usize).copied().flatten() else {
            return Err(QueueServerRefusal::Unsupported(format!("no CQ {qid}")));
        };
        if !Self::reachable(&t, addr, entries as u64 * 64) {
            return Err(QueueServerRefusal::Unreachable { addr });
        }
        // A fresh queue's doorbells read 0 before the controller takes it, and it drops no
        // completions an earlier queue on its id was told to.
        let off = (qid as usize - 1) * CTRL_DOORBELL_STRIDE;
        if let Err(e) = self
            .doorbells
            .write(off, &[0u8; 8])
            .and_then(|()| self.drops.write(qid as usize * 8, &[0u8; 8]))
        {
            return Err(QueueServerRefusal::Unsupported(format!(
                "zeroing doorbells: {e}"
            )));
        }
        t.drops_armed.remove(&qid);
        t.serial = t.serial.wrapping_add(1);
        let entry = CtrlQueue {
            sq: addr,
            cq,
            sq_entries: entries,
            cq_entries,
            serial: t.serial,
            reserved: 0,
        };
        self.write_queue(qid, &entry);
        self.publish(&mut t)
            .map_err(|e| QueueServerRefusal::Unsupported(e.to_string()))
    }

    fn delete_sq(&self, qid: u16) {
        let mut t = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        t.serial = t.serial.wrapping_add(1);
        let entry = CtrlQueue {
            serial: t.serial,
            ..CtrlQueue::default()
        };
        self.write_queue(qid, &entry);
        if let Err(e) = self.publish(&mut t) {
            tracing::error!(qid, error = %e, "GPU controller did not let go of a deleted queue");
        }
    }

    fn delete_cq(&self, qid: u16) {
        let mut t = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(c) = t.cqs.get_mut(qid as usize) {
            *c = None;
        }
    }

    fn reset(&self) {
        let mut t = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        for qid in 1..=self.nqueues as u16 {
            t.serial = t.serial.wrapping_add(1);
            let entry = CtrlQueue {
                serial: t.serial,
                ..CtrlQueue::default()
            };
            self.write_queue(qid, &entry);
        }
        t.cqs.fill(None);
        if let Err(e) = self.publish(&mut t) {
            tracing::error!(error = %e, "GPU controller reset");
        }
    }

    fn shutdown(&self) {
        let _t = self.tables.lock().unwrap_or_else(|e| e.into_inner());
        if let Err(e) = self.cuda.make_current().and_then(|()| self.write_back()) {
            tracing::error!(error = %e, "writing GPU controller media back at shutdown");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_start_gate_opens_when_everyone_arrives() {
        let gate = Arc::new(StartGate::new(3));
        let others: Vec<_> = (0..2)
            .map(|_| {
                let g = gate.clone();
                std::thread::spawn(move || g.arrive_and_wait(Duration::from_secs(30)))
            })
            .collect();
        gate.arrive_and_wait(Duration::from_secs(30))
            .expect("the last arrival opens it");
        for t in others {
            t.join().unwrap().expect("opened for everyone");
        }
    }

    #[test]
    fn a_member_that_fails_before_arriving_releases_the_others() {
        let gate = Arc::new(StartGate::new(2));
        let g = gate.clone();
        let waiter = std::thread::spawn(move || {
            let t = Instant::now();
            (g.arrive_and_wait(Duration::from_secs(30)), t.elapsed())
        });
        std::thread::sleep(Duration::from_millis(50));
        drop(Arrival {
            gate: &gate,
            arrived: false,
        });
        let (r, waited) = waiter.join().unwrap();
        assert!(
            matches!(r, Err(GpuError::Unsupported(ref m)) if m.contains("failed to start")),
            "{r:?}"
        );
        assert!(waited < Duration::from_secs(10), "released at once");
    }

    #[test]
    fn a_start_gate_wait_is_bounded() {
        let gate = StartGate::new(2);
        let t = Instant::now();
        let r = gate.arrive_and_wait(Duration::from_millis(100));
        assert!(matches!(r, Err(GpuError::Timeout { .. })), "{r:?}");
        assert!(t.elapsed() >= Duration::from_millis(100));
        // A later arrival finds the group failed rather than waiting again.
        assert!(gate.arrive_and_wait(Duration::from_secs(30)).is_err());
    }
}
