//! `gpunvme fs get --gpu` and `fs put --gpu`: a blockfs file loaded into GPU memory by
//! GPU-issued reads, or written from GPU memory by GPU-issued writes into a device-write
//! reservation, with a CRC-32C computed on the GPU and compared with the host's
//! ([`blockfs_gpu`] does the work; this module sets the GPU up and reports).

use std::path::Path;
use std::sync::Arc;
use std::time::Instant;

use crate::error::{Context, Result, ensure};
use blockfs::{FileSystem, OpenMode};
use blockfs_gpu::{FileRange, GpuFiles, GpuFilesOptions, GpuSpan};
use gpu_emu::{GpuQueuesExt, MediaKind, SsdModel};
use gpu_queues::{Cuda, GpuId, GpuQueueOptions};
use nvme::Controller;
use serde::Serialize;

use crate::gpu::{self, GpuSetup, Serving};
use crate::gpu_io;
pub use crate::gpu_io::{GpuChecksumMismatch, data_path};
use crate::open::Backend;

/// How to bring the GPU side up.
#[derive(Clone, Debug)]
pub struct GpuFsOptions {
    /// Who serves the GPU queues.
    pub serving: Serving,
    /// GPU queue pairs (default: every one the controller granted beyond `cpu_queues`; on the
    /// software controller, a multiple of its threads: [`balanced_queues`]).
    pub queues: Option<u16>,
    /// Queue pairs the file system's own device holds (CPU queues: metadata, host checksums).
    pub cpu_queues: u16,
    /// SMs reserved for the controller's kernels.
    pub controller_sms: u32,
    /// The model's SSD timing model (with [`Serving::Model`]; `None`: untimed).
    pub ssd_model: Option<SsdModel>,
    /// Rings in host memory on the software controller (`GpuQueueOptions::host_rings`;
    /// `None`: the transport's default).
    pub host_rings: Option<bool>,
    /// Entries per GPU ring (`GpuQueueOptions::depth`; `None`: the transport's default, at most
    /// 1024). Default [`FILE_RING_DEPTH`].
    pub depth: Option<u32>,
    /// The GPU whose threads issue the I/O (default GPU 0).
    pub gpu: GpuId,
    /// GPUs that share the controller's queue pairs (default 1): without `queues`, each GPU's
    /// queues are an even share of what `cpu_queues` leaves ([`gpu_share`]).
    pub sharing_gpus: u16,
}

/// Entries per GPU ring for file loads. Each entry owns a slot buffer of one maximum transfer
/// (128 KiB on the software controller) and two PRP-list pages, so 1024 entries cost 136 MiB
/// of GPU memory per queue pair: 8.4 GiB and more set-up for the 63 pairs a load uses. 256
/// read a warm file as fast as 1024 with less set-up (the ring-depth run in
/// `benches/results/history.md`).
pub const FILE_RING_DEPTH: u32 = 256;

/// Entries per GPU ring for files on a served controller, at most: reads there are staged
/// through two bounce windows ([`crate::staged`]), so at most two windows of commands are in
/// flight (512 of 128 KiB over 16 queues: 32 a queue), and every entry costs 12 KiB of lent
/// memory (its slot and two PRP-list pages) that this process registers with CUDA at about
/// 0.3 ms per MiB: 64 entries are 12 MiB for 16 queues, 256 were 48 MiB.
pub const SERVED_FILE_DEPTH: u32 = 64;

impl Default for GpuFsOptions {
    fn default() -> Self {
        Self {
            serving: Serving::Device,
            queues: None,
            cpu_queues: 1,
            controller_sms: 8,
            ssd_model: None,
            host_rings: None,
            depth: Some(FILE_RING_DEPTH),
            gpu: GpuId::default(),
            sharing_gpus: 1,
        }
    }
}

/// What `fs get --gpu` did.
#[derive(Debug, Clone, Serialize)]
pub struct GpuGetReport {
    /// The file.
    pub name: String,
    /// Bytes loaded into GPU memory.
    pub bytes: u64,
    /// Seconds from the kernel's launch to its end.
    pub seconds: f64,
    /// Bytes per second (10^9 = GB/s).
    pub bytes_per_sec: f64,
    /// Seconds to bring the GPU side up before the timed load: the CUDA context, the GPU
    /// queues and, with the GPU-resident controller model, its start, which for `host` media
    /// maps the image and registers it with CUDA (faulting every page in: a cold page cache
    /// is read here, not in `seconds`) and for `hbm` media copies the image into GPU memory.
    pub setup_seconds: f64,
    /// The data path that ran, in words.
    pub data_path: String,
    /// The transport (or model) carrying doorbells and data.
    pub transport: String,
    /// The GPU.
    pub device: String,
    /// Chunks, grid and chunk size of the kernel.
    pub chunks: u64,
    /// Blocks × threads.
    pub grid: (u32, u32),
    /// Chunk size in bytes.
    pub chunk_bytes: u32,
    /// CRC-32C of the bytes in GPU memory, computed on the GPU.
    pub gpu_crc32c: String,
    /// CRC-32C of the file computed on the host (read through blockfs by CPU queues).
    pub host_crc32c: String,
    /// The checksum blockfs recorded for the file, if any.
    pub recorded_crc32c: Option<String>,
    /// How the software controller moved the Reads' data (absent for other controllers).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub controller_copies: Option<ControllerCopies>,
    /// On a striped volume: the members whose queues read runs (`chunks` is then the runs,
    /// one batch per member; `grid` and `chunk_bytes` are 0).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub members: Option<usize>,
    /// On a striped volume: each member's PCIe path class from the GPU (`nvidia-smi topo -m`'s
    /// names), `null` where a member has no place on PCIe (an image, a vfio-user socket).
    /// Striping puts each chunk on one member, so the GPU reads every member whatever its path:
    /// there is no nearer copy to choose.
    #[serde(skip_serializing_if = "Option::is_none")]
    pub member_paths: Option<Vec<Option<&'static str>>>,
}

/// How the software controller moved Read data into GPU memory: straight from registered
/// page-cache windows of the image by copy engines, or read into pinned staging memory and
/// scattered (`gpu_emu::image_windows`).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ControllerCopies {
    /// How Read data left the image: `mapped` (copied out of a mapping of the image into
    /// pinned staging memory, then moved), `pread` (read into the staging memory, then moved)
    /// or `registered` (copy engines from registered page-cache windows);
    /// `GPUNVME_EMU_READS` chooses.
    pub read_mode: &'static str,
    /// Bytes copied straight from registered windows.
    pub direct_bytes: u64,
    /// Copy-engine copies issued for them (adjacent ranges merged).
    pub direct_copies: u64,
    /// Bytes put into pinned staging memory first (`mapped` or `pread`), then copied to the
    /// GPU.
    pub staged_bytes: u64,
    /// Of `staged_bytes`: copied out of a mapping of the image (`mapped`: pages already in
    /// memory); the rest by `pread` or direct I/O.
    pub mapped_bytes: u64,
    /// Of `staged_bytes`: Reads none of whose pages was in the page cache, read from the disk
    /// by direct I/O (`GPUNVME_EMU_COLD_READS`).
    pub cold_direct_bytes: u64,
    /// Copy-engine copies of staged Reads (adjacent Reads of 64 KiB or more merged; smaller
    /// ones go by the scatter kernel; `GPUNVME_EMU_STAGED`).
    pub engine_copies: u64,
    /// Image windows registered.
    pub windows_registered: u64,
    /// Windows left to the staged path because their pages were not all in the page cache.
    pub windows_not_resident: u64,
    /// Where the controller threads' time went, summed over threads (milliseconds): reading
    /// image data into staging (`mapped` copies or `pread`), waiting for reads of GPU memory
    /// (SQE fetches, PRP lists), waiting for a staging area the GPU still drained.
    pub file_read_ms: f64,
    /// See `file_read_ms`.
    pub fetch_wait_ms: f64,
    /// See `file_read_ms`.
    pub drain_wait_ms: f64,
    /// Scatter kernels (one per staging area flushed).
    pub scatters: u64,
    /// Reads of GPU memory with a copy and a wait of their own (SQE fetches, mostly).
    pub sync_reads: u64,
    /// Gathers (a batch's PRP lists, a Write's data).
    pub gathers: u64,
    /// Of the reads and gathers, those not ordered after the controller's writes
    /// (`GPUNVME_EMU_FETCH`).
    pub unordered_reads: u64,
    /// Pinned bytes of the copy engines' staging and gather areas, each taken at its first
    /// use (from the engines' pool, or allocated), and the milliseconds those took, summed over
    /// the controller's threads (part of the time of the loads that first used them, not of
    /// the set-up).
    pub pinned_bytes: u64,
    /// See `pinned_bytes`.
    pub pinned_alloc_ms: f64,
    /// Bytes of the engines' pool of first areas, allocated on a thread of its own while the
    /// queues are set up (0 until it is), and the milliseconds that took there.
    pub pinned_pool_bytes: u64,
    /// See `pinned_pool_bytes`.
    pub pinned_pool_ms: f64,
}

/// What the software controller's copy engines did so far, when it serves `setup`'s queues.
pub fn controller_copies(setup: &GpuSetup) -> Option<ControllerCopies> {
    let d = setup.queues.dma_stats()?;
    let (mode, w) = setup.queues.window_stats()?;
    Some(ControllerCopies {
        read_mode: mode.name(),
        direct_bytes: d.direct_bytes,
        direct_copies: d.direct_copies,
        staged_bytes: d.staged_file_bytes,
        mapped_bytes: d.mapped_bytes,
        cold_direct_bytes: d.cold_direct_bytes,
        engine_copies: d.engine_copies,
        windows_registered: w.registered,
        windows_not_resident: w.not_resident,
        file_read_ms: d.file_ns as f64 / 1e6,
        fetch_wait_ms: d.fetch_wait_ns as f64 / 1e6,
        drain_wait_ms: d.drain_wait_ns as f64 / 1e6,
        scatters: d.scatters,
        sync_reads: d.sync_reads,
        gathers: d.gathers,
        unordered_reads: d.unordered_reads,
        pinned_bytes: d.pinned_bytes,
        pinned_alloc_ms: d.pinned_alloc_ns as f64 / 1e6,
        pinned_pool_bytes: d.pinned_pool_bytes,
        pinned_pool_ms: d.pinned_pool_ns as f64 / 1e6,
    })
}

/// One software-controller thread during a batch ([`controller_threads`]).
#[derive(Debug, Clone, Copy, Serialize)]
pub struct ControllerThread {
    /// Milliseconds from the batch's launch to the start of the thread's latest burst of
    /// staged Reads (a pause of more than 5 ms starts a new one, so a thread idle that long
    /// mid-batch shows its later start; `None`: no burst started during the batch).
    pub first_ms: Option<f64>,
    /// Milliseconds from the launch to its last staged Read's data being in staging.
    pub last_ms: Option<f64>,
    /// Bytes it has staged (since the queues came up).
    pub staged_bytes: u64,
    /// Milliseconds it has spent copying image data into staging (likewise).
    pub file_read_ms: f64,
    /// Milliseconds it has waited for staging areas to drain (likewise).
    pub drain_wait_ms: f64,
}

/// Each software-controller thread's part in a batch launched at `launched`: when it
/// started and stopped staging Reads, and its counters so far (the difference of two calls
/// is a batch's share), to tell ramp, tail and imbalance apart. `None` on other controllers.
pub fn controller_threads(setup: &GpuSetup, launched: Instant) -> Option<Vec<ControllerThread>> {
    let ms = |t: Option<Instant>| {
        t.filter(|t| *t >= launched)
            .map(|t| t.duration_since(launched).as_secs_f64() * 1e3)
    };
    let per = setup.queues.dma_stats_per_thread()?;
    Some(
        per.iter()
            .map(|d| ControllerThread {
                first_ms: ms(d.burst_start),
                last_ms: ms(d.last_staged),
                staged_bytes: d.staged_file_bytes,
                file_read_ms: d.file_ns as f64 / 1e6,
                drain_wait_ms: d.drain_wait_ns as f64 / 1e6,
            })
            .collect(),
    )
}

impl std::fmt::Display for GpuGetReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{}: {} bytes into GPU memory in {:.3} s ({:.2} GB/s)",
            self.name,
            self.bytes,
            self.seconds,
            self.bytes_per_sec / 1e9
        )?;
        writeln!(
            f,
            "setup before the load (not timed above): {:.3} s",
            self.setup_seconds
        )?;
        writeln!(f, "data path: {}", self.data_path)?;
        match self.members {
            Some(m) => writeln!(
                f,
                "kernels: {} runs, one batch on each of {m} members' GPU queues",
                self.chunks
            )?,
            None => writeln!(
                f,
                "kernel: {} chunks of {} bytes, grid {}x{}",
                self.chunks, self.chunk_bytes, self.grid.0, self.grid.1
            )?,
        }
        write!(
            f,
            "crc32c: GPU {} = host {}{}",
            self.gpu_crc32c,
            self.host_crc32c,
            match &self.recorded_crc32c {
                Some(r) => format!(" = recorded {r}"),
                None => String::new(),
            }
        )
    }
}

/// What `fs put --gpu` did.
#[derive(Debug, Clone, Serialize)]
pub struct GpuPutReport {
    /// The file.
    pub name: String,
    /// Bytes written.
    pub bytes: u64,
    /// Seconds of the GPU write kernel.
    pub seconds: f64,
    /// Bytes per second.
    pub bytes_per_sec: f64,
    /// The data path that ran, in words.
    pub data_path: String,
    /// The transport (or model).
    pub transport: String,
    /// The GPU.
    pub device: String,
    /// CRC-32C of the GPU buffer, computed on the GPU (recorded as the file's checksum).
    pub gpu_crc32c: String,
    /// CRC-32C of the host file.
    pub host_crc32c: String,
    /// Whether the file was read back through blockfs on the CPU after the commit and matched.
    pub verified: bool,
}

impl std::fmt::Display for GpuPutReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        writeln!(
            f,
            "{}: {} bytes written from GPU memory in {:.3} s ({:.2} GB/s), committed",
            self.name,
            self.bytes,
            self.seconds,
            self.bytes_per_sec / 1e9
        )?;
        writeln!(f, "data path: {}", self.data_path)?;
        write!(
            f,
            "crc32c: GPU {} = host {}; CPU read-back {}",
            self.gpu_crc32c,
            self.host_crc32c,
            if self.verified { "matches" } else { "skipped" }
        )
    }
}

fn hex(c: u32) -> String {
    format!("{c:08x}")
}

/// The I/O queue pairs a software controller should grant when the GPU-resident controller
/// model serves the GPU queues, or when GPU file commands run on it (the CLI's default
/// `--controller-queue-pairs` then, the examples' and the Python package's): each controller
/// lane (each controller thread) owns queues, so few queues leave most of the model's SMs
/// (most of the threads) idle: 8 queue pairs reach a fraction of what 32 do (the model's
/// ceilings in docs/benchmarks.md).
pub const MODEL_QUEUE_PAIRS: u16 = 64;

/// Brings the GPU queues up for a file command on `ctrl` (shared by `fs get/put --gpu` and the
/// examples): opens `opts.gpu`, starts the GPU-resident controller model when `opts` asks for it
/// (after the file system is mounted and synced, so it loads the image as blockfs left it), and
/// creates the GPU queues. With the model, do the file system's own (CPU) I/O before this or
/// after [`teardown`]: the model serves the image from its own copy meanwhile.
pub fn setup(
    ctrl: &Controller,
    backend: &Backend,
    opts: &GpuFsOptions,
) -> Result<(Arc<Cuda>, GpuSetup)> {
    check_serving(opts)?;
    let cuda = open_gpu(&opts.gpu)?;
    setup_in_group(&cuda, ctrl, backend, opts, None).map(|s| (cuda, s))
}

/// Where GPU queues come from: a controller this process brought up, or one a `gpunvme serve`
/// daemon owns (its pairs lent to this process: the served transport).
#[derive(Clone, Copy)]
pub enum QueueSource<'a> {
    /// A controller of this process and what is behind it.
    Owned(&'a Controller, &'a Backend),
    /// A daemon's controller.
    Served(&'a crate::served::ServedController),
}

impl QueueSource<'_> {
    /// GPU queues on `opts.gpu` ([`setup`]).
    pub fn setup(&self, opts: &GpuFsOptions) -> Result<(Arc<Cuda>, GpuSetup)> {
        check_serving(opts)?;
        let cuda = open_gpu(&opts.gpu)?;
        self.setup_on(&cuda, opts).map(|s| (cuda, s))
    }

    /// GPU queues on `cuda` ([`setup_on`]). On a served controller the daemon lends the pairs
    /// (`opts.queues` of them, default [`crate::served::DEFAULT_QUEUES`], `opts.depth`
    /// entries); the GPU-resident model needs an image of this process's and is refused.
    pub fn setup_on(&self, cuda: &Arc<Cuda>, opts: &GpuFsOptions) -> Result<GpuSetup> {
        match *self {
            QueueSource::Owned(ctrl, backend) => setup_on(cuda, ctrl, backend, opts),
            QueueSource::Served(served) => {
                check_serving(opts)?;
                ensure!(
                    opts.serving == Serving::Device,
                    InvalidArgument,
                    "the GPU-resident controller model takes an image's place in this process: \
                     {} is owned by a daemon",
                    served.describe()
                );
                // File reads move straight between the device and their buffers; slot
                // buffers carry only unaligned heads and tails (an LBA each), so they are
                // small here: the arena the daemon lends (and this process registers with
                // CUDA, about 0.3 ms per MiB) is 16 MiB for 16 queues of 256, not 512. One
                // queue per thread of the daemon's controller, so one client can have its
                // whole rate.
                let count = match opts.queues {
                    Some(q) => q,
                    None => served.file_queue_count()?,
                };
                let queues = crate::served::fewer_when_busy(count, opts.queues.is_none(), |n| {
                    let qopts = GpuQueueOptions {
                        queues: Some(n),
                        depth: Some(
                            opts.depth
                                .unwrap_or(SERVED_FILE_DEPTH)
                                .min(SERVED_FILE_DEPTH),
                        ),
                        slot_buffer_bytes: Some(served.file_slot_bytes()),
                        ..Default::default()
                    };
                    served.gpu_queues(cuda, &qopts)
                })?;
                Ok(GpuSetup {
                    queues,
                    model: None,
                    transport: format!("served ({})", served.describe()),
                    path: None,
                })
            }
        }
    }

    /// What ends a GPU wait on `setup`'s queues early: the controller failed, the model
    /// stopped, the daemon revoked the queues or went away.
    pub fn watchdog<'a>(
        &'a self,
        setup: &'a GpuSetup,
    ) -> Box<dyn FnMut() -> Option<String> + Send + 'a> {
        match *self {
            QueueSource::Owned(ctrl, backend) => {
                Box::new(gpu::watchdog(ctrl, backend, setup.model.as_ref()))
            }
            QueueSource::Served(served) => Box::new(served.watchdog()),
        }
    }
}

/// Refuses options that cannot go together, before any GPU is opened.
fn check_serving(opts: &GpuFsOptions) -> Result<()> {
    ensure!(
        opts.ssd_model.is_none() || matches!(opts.serving, Serving::Model(_)),
        InvalidArgument,
        "an SSD timing model times the GPU-resident controller's media: it needs the GPU-resident controller (controller `gpu`)"
    );
    Ok(())
}

/// [`setup`] on `cuda`, a GPU the caller opened (a framework's tensor's, say): `opts.gpu` is
/// not looked at.
pub fn setup_on(
    cuda: &Arc<Cuda>,
    ctrl: &Controller,
    backend: &Backend,
    opts: &GpuFsOptions,
) -> Result<GpuSetup> {
    setup_in_group(cuda, ctrl, backend, opts, None)
}

/// Opens `gpu`, saying which when it cannot.
pub fn open_gpu(gpu: &GpuId) -> Result<Arc<Cuda>> {
    gpu.open().with_context(|| format!("opening {gpu}"))
}

/// GPU queue pairs for one of `sharing` GPUs on a controller that granted `granted`, of which
/// `cpu_queues` are held for CPU queues: an even share of the rest, at least two each where the
/// controller has them (refused, naming the numbers, where it has not), made a multiple of the
/// software controller's `threads` ([`balanced_queues`]).
pub fn gpu_share(
    granted: u16,
    cpu_queues: u16,
    sharing: u16,
    threads: Option<usize>,
) -> Result<u16> {
    let sharing = sharing.max(1);
    ensure!(
        granted > cpu_queues,
        Device,
        "the controller granted {granted} I/O queue pairs and the file system holds \
         {cpu_queues}: none is left for GPU queues"
    );
    let available = granted - cpu_queues;
    let share = available / sharing;
    ensure!(
        sharing == 1 || share >= 2,
        Device,
        "the controller granted {granted} I/O queue pairs; {cpu_queues} are for CPU queues and \
         {sharing} GPUs share the other {available}: fewer than 2 each (ask the controller for \
         at least {} queue pairs, or use fewer GPUs)",
        u32::from(cpu_queues) + 2 * u32::from(sharing)
    );
    Ok(balanced_queues(share, threads))
}

/// [`setup`], the model (if `opts` asks for one) one of a [`gpu_emu::ModelGroup`] when `group`
/// is given: it launches only once every model of the group has started (call from a thread
/// per member).
fn setup_in_group(
    cuda: &Arc<Cuda>,
    ctrl: &Controller,
    backend: &Backend,
    opts: &GpuFsOptions,
    group: Option<gpu_emu::GroupMember>,
) -> Result<GpuSetup> {
    check_serving(opts)?;
    let model = match opts.serving {
        Serving::Device => None,
        Serving::Model(media) => {
            ensure!(
                media != MediaKind::Null,
                InvalidArgument,
                "the null media keeps no data: files need the hbm or host media"
            );
            Some(gpu::start_model(
                cuda,
                ctrl,
                backend,
                media,
                opts.controller_sms,
                opts.ssd_model,
                group,
            )?)
        }
    };
    let queues = match opts.queues {
        Some(q) => q,
        None => gpu_share(
            ctrl.info().max_io_queue_pairs,
            opts.cpu_queues,
            opts.sharing_gpus,
            software_threads(opts, backend),
        )?,
    };
    let qopts = GpuQueueOptions {
        queues: Some(queues),
        controller_sms: opts.controller_sms,
        host_rings: opts.host_rings,
        depth: opts.depth,
        ..Default::default()
    };
    gpu::open_queues(cuda, ctrl, backend, model, &qopts)
}

/// The software controller's threads when it serves the GPU queues (`None` otherwise).
fn software_threads(opts: &GpuFsOptions, backend: &Backend) -> Option<usize> {
    match (opts.serving, backend.emu()) {
        (Serving::Device, Some(emu)) => Some(emu.controller_threads()),
        _ => None,
    }
}

/// GPU queue pairs out of `available`: all of them, except on the software controller, whose
/// thread `t` serves the queues whose ids are `t` modulo its `threads` (consecutive ids, one
/// per thread in turn): there the largest multiple of `threads` (when there are at least that
/// many), so that each thread serves as many queues as any other. With 60 queues on 16
/// threads, 4 threads would serve 3 queues and 12 serve 4, and a load whose queues all get the
/// same work gives the 12 a third more than the 4: the load waits for the 12.
pub fn balanced_queues(available: u16, threads: Option<usize>) -> u16 {
    match threads.and_then(|t| u16::try_from(t).ok()) {
        Some(t) if t > 1 && available >= t => available / t * t,
        _ => available,
    }
}

/// Deletes the GPU queues of [`setup`], then stops the model if one ran (writing its media
/// back to the image).
pub fn teardown(setup: GpuSetup) -> Result<()> {
    let GpuSetup { queues, model, .. } = setup;
    drop(queues);
    if let Some(m) = model {
        m.stop().context("stopping the GPU controller")?;
    }
    Ok(())
}

/// CRC-32C of a blockfs file read on the host through `fs` (CPU queues).
fn host_crc(fs: &FileSystem, name: &str) -> Result<u32> {
    let f = fs.open(name, OpenMode::ReadOnly)?;
    let len = f.len()?;
    let mut buf = vec![0u8; (16u64 << 20).min(len.max(1)) as usize];
    let mut crc = 0u32;
    let mut at = 0u64;
    while at < len {
        let n = (len - at).min(buf.len() as u64) as usize;
        let got = f.read_at(at, &mut buf[..n])?;
        ensure!(got == n, Io, "short host read of {name} at {at}");
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        at += n as u64;
    }
    Ok(crc)
}

/// `fs get --gpu`: loads `name` into GPU memory with GPU-issued reads, checksums it on the GPU
/// and compares with the host's CRC-32C of the file (and the recorded one).
pub fn get(
    src: QueueSource<'_>,
    fs: &FileSystem,
    name: &str,
    opts: &GpuFsOptions,
) -> Result<GpuGetReport> {
    let file = fs.open(name, OpenMode::ReadOnly)?;
    let stat = file.stat()?;
    let started = Instant::now();
    let (cuda, setup) = src.setup(opts)?;
    let setup_seconds = started.elapsed().as_secs_f64();
    let result = (|| {
        let files = GpuFiles::new(&setup.queues, GpuFilesOptions::from_env()?);
        let gfile = files.open(&file).context("opening the file for the GPU")?;
        let size = gfile.size();
        if setup.queues.buffers_in_host_memory() {
            // The controller reaches only host memory: the file lands in GPU memory through a
            // bounce buffer ([`crate::staged`]), as a load's tensors do.
            let dest = gpu_queues::ffi::DeviceMemory::alloc_uninit(
                setup.queues.cuda(),
                size.max(1) as usize,
            )
            .context("allocating GPU memory for the file")?;
            let out =
                crate::staged::read_range(&files, &gfile, 0, size, &dest, src.watchdog(&setup))?;
            let gpu_crc = files.crc32c(dest.ptr(), size)?;
            let base = checked_report(fs, name, size, out.elapsed, setup_seconds, gpu_crc, &stat)?;
            return Ok(GpuGetReport {
                data_path: crate::gpu_io::staged_data_path(&setup),
                ..base.with_setup(&setup, cuda.name())
            });
        }
        let buf = setup
            .queues
            .alloc_buffer(size.max(1) as usize)
            .context("allocating GPU memory for the file")?;
        let span = GpuSpan::of(&buf, 0, size)?;
        let pending = files.submit(&[FileRange::read(&gfile, 0, span)])?;
        let r = pending
            .wait_watched(src.watchdog(&setup))?
            .into_first_error()?;
        let got = r.bytes();
        ensure!(got == size, Device, "the GPU read {got} of {size} bytes");
        let gpu_crc = files.crc32c(buf.ptr(), size)?;
        let base = checked_report(fs, name, size, r.elapsed, setup_seconds, gpu_crc, &stat)?;
        Ok(GpuGetReport {
            chunks: r.shape.chunks,
            grid: r.shape.grid,
            chunk_bytes: r.shape.chunk_bytes,
            ..base.with_setup(&setup, cuda.name())
        })
    })();
    let down = teardown(setup);
    let report = result?;
    down?;
    Ok(report)
}

/// Compares the CRC-32C the GPU computed of file `name` with the host's (read after the load:
/// reading the file first would warm the page cache for the GPU's reads, and a cold load would
/// not be cold) and with the one blockfs recorded (`recorded`): (host's, recorded).
fn check_crcs(
    fs: &FileSystem,
    name: &str,
    gpu_crc: u32,
    recorded: Option<u32>,
) -> Result<(u32, Option<u32>)> {
    let host = host_crc(fs, name)?;
    let mismatch = |other, what| GpuChecksumMismatch {
        name: name.to_owned(),
        gpu: gpu_crc,
        host: other,
        what,
    };
    if gpu_crc != host {
        return Err(mismatch(host, "the host's").into());
    }
    if let Some(rec) = recorded
        && rec != gpu_crc
    {
        return Err(mismatch(rec, "the recorded checksum").into());
    }
    Ok((host, recorded))
}

/// The report of a GPU load of `name` (`size` bytes in `elapsed`) whose bytes the GPU
/// checksummed as `gpu_crc`, once that matches the host's and the recorded checksum
/// ([`check_crcs`]); the kernel's shape left at zero for the caller.
fn checked_report(
    fs: &FileSystem,
    name: &str,
    size: u64,
    elapsed: std::time::Duration,
    setup_seconds: f64,
    gpu_crc: u32,
    stat: &blockfs::FileStat,
) -> Result<GpuGetReport> {
    let (host, recorded) = check_crcs(fs, name, gpu_crc, stat.data_crc)?;
    let secs = elapsed.as_secs_f64().max(1e-9);
    Ok(GpuGetReport {
        name: name.to_owned(),
        bytes: size,
        seconds: secs,
        bytes_per_sec: size as f64 / secs,
        setup_seconds,
        data_path: String::new(),
        transport: String::new(),
        device: String::new(),
        chunks: 0,
        grid: (0, 0),
        chunk_bytes: 0,
        gpu_crc32c: hex(gpu_crc),
        host_crc32c: hex(host),
        recorded_crc32c: recorded.map(hex),
        controller_copies: None,
        members: None,
        member_paths: None,
    })
}

impl GpuGetReport {
    /// The report with what `setup` says of the data path, the transport and the copies, on
    /// GPU `device`.
    fn with_setup(self, setup: &GpuSetup, device: &str) -> Self {
        Self {
            data_path: data_path(setup, false),
            transport: setup.transport.clone(),
            device: device.to_owned(),
            controller_copies: controller_copies(setup),
            ..self
        }
    }
}

/// `fs get --gpu` on a striped volume over `ctrls` (each with its `backends` entry, in member
/// order): GPU queues on every member's controller, the file read on each member's queues
/// ([`blockfs_gpu::VolumeFiles`], every member's batch in flight at once), checksummed on the
/// GPU and compared as [`get`] does. With the GPU-resident model, one model per member, each
/// on SMs of its own.
pub fn get_volume(
    ctrls: &[&Controller],
    backends: &[&Backend],
    volume: &blockfs::StripedVolume,
    fs: &FileSystem,
    name: &str,
    opts: &GpuFsOptions,
) -> Result<GpuGetReport> {
    let file = fs.open(name, OpenMode::ReadOnly)?;
    let stat = file.stat()?;
    let started = Instant::now();
    let (cuda, setups) = setup_members(ctrls, backends, opts)?;
    let setup_seconds = started.elapsed().as_secs_f64();
    let result = (|| {
        let queues: Vec<&gpu_queues::GpuQueues> = setups.iter().map(|s| &s.queues).collect();
        let vf = blockfs_gpu::VolumeFiles::new(&queues, GpuFilesOptions::from_env()?);
        let vfile = vf
            .open(volume, &file)
            .context("opening the file for the GPU")?;
        let size = vfile.size();
        let dst = Arc::new(
            gpu_queues::ffi::DeviceMemory::alloc(&cuda, size.max(1) as usize)
                .context("allocating GPU memory for the file")?,
        );
        let watch = members_watchdog(ctrls, backends, &setups);
        let r = vf.read(volume, &vfile, 0, &dst, watch)?;
        ensure!(
            r.bytes == size,
            Device,
            "the GPU read {} of {size} bytes",
            r.bytes
        );
        let q0 = queues[0];
        let gpu_crc = blockfs_gpu::crc32c_on(q0, q0.client_stream(), dst.ptr(), size)?;
        let base = checked_report(fs, name, size, r.elapsed, setup_seconds, gpu_crc, &stat)?;
        let base = base.with_setup(&setups[0], cuda.name());
        let paths: Vec<Option<&'static str>> =
            setups.iter().map(|s| s.path.map(|p| p.name())).collect();
        Ok(GpuGetReport {
            data_path: format!(
                "a striped volume over {} controllers: the file's extent table cut per member, \
                 {} runs read on the members' own GPU queues, every member's batch at once; \
                 {}; per member: {}",
                ctrls.len(),
                r.runs,
                member_paths_text(&paths),
                base.data_path
            ),
            chunks: r.runs as u64,
            controller_copies: None,
            members: Some(r.members),
            member_paths: Some(paths),
            ..base
        })
    })();
    let down = teardown_members(setups);
    let report = result?;
    down?;
    Ok(report)
}

/// What a striped volume's GPU read says about its members' paths: striping puts each chunk on
/// one member, so the GPU reads every member, near or far; the paths it has, in member order.
fn member_paths_text(paths: &[Option<&'static str>]) -> String {
    let listed: Vec<String> = paths
        .iter()
        .enumerate()
        .map(|(i, p)| format!("member {i} {}", p.unwrap_or("off PCIe")))
        .collect();
    format!(
        "striping puts each chunk on one member, so every member is read whatever its PCIe path \
         (no nearer copy to choose): {}",
        listed.join(", ")
    )
}

/// GPU queues on every member's controller (`ctrls` with their `backends`, in member order),
/// or none: what was brought up is torn down when a member fails. With the GPU-resident model
/// ([`Serving::Model`]), a model per member, each on SMs of its own (the GPU split once by
/// [`gpu_emu::ModelGroup`], the SMs left over shared by every member's clients), started on a
/// thread each: no model launches before every one has loaded its kernels.
fn setup_members(
    ctrls: &[&Controller],
    backends: &[&Backend],
    opts: &GpuFsOptions,
) -> Result<(Arc<Cuda>, Vec<GpuSetup>)> {
    let results: Vec<Result<(Arc<Cuda>, GpuSetup)>> = match opts.serving {
        Serving::Device => {
            let mut results = Vec::with_capacity(ctrls.len());
            for (c, b) in ctrls.iter().zip(backends) {
                let r = setup(c, b, opts);
                let failed = r.is_err();
                results.push(r);
                if failed {
                    break;
                }
            }
            results
        }
        Serving::Model(_) => {
            check_serving(opts)?;
            let cuda = open_gpu(&opts.gpu)?;
            let group = gpu::model_group(&cuda, ctrls.len(), opts.controller_sms)?;
            let jobs: Vec<_> = ctrls.iter().zip(backends).zip(group).collect();
            gpu::on_each(&jobs, |((c, b), g)| {
                setup_in_group(&cuda, c, b, opts, Some(g.clone())).map(|s| (cuda.clone(), s))
            })
        }
    };
    let mut setups = Vec::with_capacity(ctrls.len());
    let mut cuda = None;
    let mut first_error = None;
    for (i, r) in results.into_iter().enumerate() {
        match r {
            Ok((cu, s)) => {
                cuda.get_or_insert(cu);
                setups.push(s);
            }
            Err(e) => {
                first_error.get_or_insert(e.context(format!("volume member {i}")));
            }
        }
    }
    if let Some(e) = first_error {
        let _ = teardown_members(setups);
        return Err(e);
    }
    Ok((cuda.context("a volume without members")?, setups))
}

/// Every member's [`gpu::watchdog`] in one (each with its model, if any): the first member's
/// reason to abort.
fn members_watchdog<'a>(
    ctrls: &[&'a Controller],
    backends: &[&Backend],
    setups: &'a [GpuSetup],
) -> impl FnMut() -> Option<String> + Send + 'a {
    let mut watches: Vec<_> = ctrls
        .iter()
        .zip(backends)
        .zip(setups)
        .map(|((c, b), s)| gpu::watchdog(c, b, s.model.as_ref()))
        .collect();
    move || watches.iter_mut().find_map(|w| w())
}

/// Tears every member's GPU queues down, then stops every model (writing its media back), and
/// only then lets any model go: a model's teardown (an image unregistered, with `host` media)
/// would wait for the other models' kernels while they still ran. The first failure is the
/// result.
fn teardown_members(setups: Vec<GpuSetup>) -> Result<()> {
    let mut down = Ok(());
    let mut models = Vec::new();
    for s in setups {
        let GpuSetup { queues, model, .. } = s;
        drop(queues);
        models.extend(model);
    }
    for m in &models {
        let stopped = m.stop().context("stopping the GPU controller");
        if down.is_ok() {
            down = stopped.map(drop);
        }
    }
    drop(models);
    down
}

/// `fs put --gpu` on a striped volume over `ctrls` (each with its `backends` entry, in member
/// order): as [`put`], the file's reservation cut per member and every window written on its
/// members' GPU queues ([`gpu_io::write_pieces_volume`]); with the GPU-resident model, one model
/// per member, as [`get_volume`].
#[allow(clippy::too_many_arguments)]
pub fn put_volume(
    ctrls: &[&Controller],
    backends: &[&Backend],
    volume: &blockfs::StripedVolume,
    fs: &FileSystem,
    src: &Path,
    name: &str,
    force: bool,
    opts: &GpuFsOptions,
) -> Result<GpuPutReport> {
    let (data, len, host, target) = put_source(fs, src, name, force)?;
    let result = (|| {
        let (cuda, setups) = setup_members(ctrls, backends, opts)?;
        let pieces = [gpu_io::Piece::Host(data)];
        let refs: Vec<&GpuSetup> = setups.iter().collect();
        let watch = members_watchdog(ctrls, backends, &setups);
        let written =
            gpu_io::write_pieces_volume(&refs, volume, &target.file, &pieces, Some(host), watch);
        let down = teardown_members(setups);
        let mut written = written?;
        down?;
        written.data_path = format!(
            "a striped volume over {} controllers: the reservation's extent table cut per \
             member, each staging window's runs written on the members' own GPU queues, every \
             member's batch at once; per member: {}",
            ctrls.len(),
            written.data_path
        );
        Ok::<_, crate::Error>((written, cuda.name().to_owned()))
    })();
    let (written, device) = gpu_io::finish_target(fs, target, result)?;
    put_report(fs, name, len, host, written, device)
}

/// `fs put --gpu`: copies host file `src` into GPU memory, writes it into blockfs file `name`
/// with GPU-issued writes through a device-write reservation (no zero fill), checks the GPU's
/// CRC-32C of the buffer against the host's, commits the length with that checksum, syncs, and
/// reads the file back through blockfs on the CPU to check it. `force` replaces an existing
/// file (written under a temporary name first, then swapped in by one commit).
pub fn put(
    ctrl: &Controller,
    backend: &Backend,
    fs: &FileSystem,
    src: &Path,
    name: &str,
    force: bool,
    opts: &GpuFsOptions,
) -> Result<GpuPutReport> {
    let (data, len, host, target) = put_source(fs, src, name, force)?;
    let result = (|| {
        let (cuda, setup) = setup(ctrl, backend, opts)?;
        let pieces = [gpu_io::Piece::Host(data)];
        let watch = gpu::watchdog(ctrl, backend, setup.model.as_ref());
        let written = gpu_io::write_pieces(&setup, &target.file, &pieces, Some(host), watch);
        // The model writes its media back to the image when it stops: before blockfs commits
        // (through the software controller) what it wrote.
        let down = teardown(setup);
        let written = written?;
        down?;
        Ok::<_, crate::Error>((written, cuda.name().to_owned()))
    })();
    let (written, device) = gpu_io::finish_target(fs, target, result)?;
    put_report(fs, name, len, host, written, device)
}

/// A put's source file read into memory, its length and CRC-32C, and the file it goes to.
fn put_source(
    fs: &FileSystem,
    src: &Path,
    name: &str,
    force: bool,
) -> Result<(Vec<u8>, u64, u32, gpu_io::Target)> {
    let data = std::fs::read(src).with_context(|| format!("reading {}", src.display()))?;
    let len = data.len() as u64;
    let host = crc32c::crc32c(&data);
    let target = gpu_io::prepare_target(fs, name, len, force)?;
    Ok((data, len, host, target))
}

/// The report of a GPU put of `len` bytes whose host CRC-32C is `host`, once the CPU has read
/// the committed file back and found the same checksum.
fn put_report(
    fs: &FileSystem,
    name: &str,
    len: u64,
    host: u32,
    written: gpu_io::GpuIoReport,
    device: String,
) -> Result<GpuPutReport> {
    let secs = written.seconds.max(1e-9);
    // The CPU reads what the GPU wrote, and checks the recorded checksum.
    let back = host_crc(fs, name)?;
    if back != host {
        return Err(GpuChecksumMismatch {
            name: name.to_owned(),
            gpu: host,
            host: back,
            what: "a CPU read-back of the committed file",
        }
        .into());
    }
    Ok(GpuPutReport {
        name: name.to_owned(),
        bytes: len,
        seconds: secs,
        bytes_per_sec: len as f64 / secs,
        data_path: written.data_path,
        transport: written.transport,
        device,
        gpu_crc32c: hex(host),
        host_crc32c: hex(host),
        verified: true,
    })
}

#[cfg(test)]
mod tests {
    use super::{balanced_queues, gpu_share, member_paths_text};
    use crate::ErrorKind;

    #[test]
    fn a_striped_read_names_every_members_path_and_that_none_was_chosen() {
        let t = member_paths_text(&[Some("PIX"), Some("SYS"), None]);
        assert!(
            t.contains("member 0 PIX, member 1 SYS, member 2 off PCIe"),
            "{t}"
        );
        assert!(t.contains("no nearer copy to choose"), "{t}");
    }

    #[test]
    fn a_controllers_queues_are_split_evenly_between_the_gpus_that_share_it() {
        // One GPU: everything the CPU queues leave (balanced over the controller's threads).
        assert_eq!(gpu_share(64, 1, 1, None).unwrap(), 63);
        assert_eq!(gpu_share(64, 1, 1, Some(4)).unwrap(), 60);
        // Eight GPUs of a DGX-class box on a 64-pair controller: 7 each (4 on 4 threads).
        assert_eq!(gpu_share(64, 1, 8, None).unwrap(), 7);
        assert_eq!(gpu_share(64, 1, 8, Some(4)).unwrap(), 4);
        assert_eq!(
            gpu_share(17, 1, 8, None).unwrap(),
            2,
            "two each where there are"
        );
        // Fewer than two each: refused, with the numbers.
        let e = gpu_share(16, 1, 8, None).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Device);
        let m = e.to_string();
        assert!(
            m.contains("granted 16")
                && m.contains("8 GPUs share the other 15")
                && m.contains("at least 17"),
            "{m}"
        );
        // None left at all.
        let e = gpu_share(1, 1, 1, None).unwrap_err();
        assert!(e.to_string().contains("none is left"), "{e}");
        assert_eq!(gpu_share(2, 1, 0, None).unwrap(), 1, "0 GPUs counts as 1");
    }

    #[test]
    fn gpu_queues_on_the_software_controller_spread_evenly_over_its_threads() {
        // (queue pairs granted, CPU queues, controller threads)
        for (granted, cpu, threads) in [(64u16, 4u16, 16usize), (64, 1, 16), (64, 4, 12), (9, 1, 4)]
        {
            let n = balanced_queues(granted - cpu, Some(threads));
            assert!(
                n > 0 && n <= granted - cpu && n % threads as u16 == 0,
                "{n}"
            );
            assert!(
                granted - cpu - n < threads as u16,
                "no more dropped than needed"
            );
            // The controller's map: queue id q is served by thread (q - 1) % threads.
            let mut per = vec![0; threads];
            for q in cpu + 1..=cpu + n {
                per[(q as usize - 1) % threads] += 1;
            }
            assert!(per.iter().all(|&k| k == per[0]), "{per:?}");
        }
        assert_eq!(balanced_queues(60, Some(16)), 48);
        assert_eq!(
            balanced_queues(10, Some(16)),
            10,
            "fewer than the threads: all"
        );
        assert_eq!(balanced_queues(60, Some(1)), 60);
        assert_eq!(balanced_queues(60, None), 60, "other controllers: all");
    }
}
