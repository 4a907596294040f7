//! What the GPU file examples share: the GPU check that makes them skip visibly on a machine
//! without one, the device (an image file served by the software controller, `--device PATH`,
//! by default a new sparse file in /dev/shm or the temp dir, removed at the end; or a
//! controller, `--device vfio-user:SOCKET` or a PCI address), blockfs on it
//! (mounted, or made when the image holds none), and the GPU side brought up the way
//! `gpunvme fs get --gpu` does it ([`gpunvme::gpu_fs::setup`]).
#![allow(dead_code)]

use std::path::PathBuf;
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use gpunvme::blockfs::{
    CreateOptions, FileSystem, MkfsOptions, NvmeBlockDevice, NvmeDeviceOptions,
};
use gpunvme::gpu::{GpuSetup, Serving};
use gpunvme::gpu_emu::{MediaKind, SsdModel};
use gpunvme::gpu_fs::{self, GpuFsOptions};
use gpunvme::gpu_queues::{Cuda, GpuError, GpuId, cuda_present, pattern};
use gpunvme::nvme::Controller;
use gpunvme::nvme_emu::EmuConfig;
use gpunvme::open::{self, Backend, DeviceSpec, OpenOptions};
use gpunvme::units::parse_size;

/// Who serves the GPU queues (`--controller`, as in `gpunvme fs get --gpu`).
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum ControllerKind {
    /// The software controller's threads.
    Emu,
    /// The GPU-resident controller model, the image in GPU memory (hbm media).
    Gpu,
}

/// The device and GPU options every example takes.
#[derive(clap::Args, Debug, Clone)]
pub struct DeviceArgs {
    /// Image file served by the software controller (created sparse if missing; its blockfs is
    /// used, or one is made when it holds none), or a controller holding a blockfs:
    /// `vfio-user:SOCKET` or a PCI address. Default: a new sparse file in /dev/shm (or the temp
    /// dir), removed at the end.
    #[arg(long)]
    pub device: Option<PathBuf>,
    /// Size of an image the example creates (default: what the example needs, with room).
    #[arg(long, value_parser = parse_size)]
    pub image_size: Option<u64>,
    /// Who serves the GPU queues.
    #[arg(long, value_enum, default_value = "emu")]
    pub controller: ControllerKind,
    /// SMs reserved for the controller's kernels.
    #[arg(long, default_value_t = 8)]
    pub controller_sms: u32,
    /// GPU queue pairs (default: every one the controller grants beyond the file system's).
    #[arg(long)]
    pub gpu_queues: Option<u16>,
    /// The GPU-resident controller model's SSD timing model (with `--controller gpu`), e.g.
    /// `drives=4`.
    #[arg(long)]
    pub ssd_model: Option<SsdModel>,
    /// The GPU to run on: a CUDA ordinal, a UUID (GPU-...) or a PCI address.
    #[arg(long, default_value = "0")]
    pub gpu_id: GpuId,
}

/// `Some(gpu)` when there is GPU `gpu` to run on; otherwise prints "`name`: skipped: no GPU
/// (why)" and returns `None` (the example then exits 0). A GPU named that the machine does not
/// have is an error, not a skip.
pub fn gpu_or_skip(name: &str, gpu: &GpuId) -> Result<Option<Arc<Cuda>>> {
    if !cuda_present() {
        println!("{name}: skipped: no GPU (libcuda cannot be loaded)");
        return Ok(None);
    }
    match gpu.open() {
        Ok(c) => Ok(Some(c)),
        Err(GpuError::NoCuda { reason }) => {
            println!("{name}: skipped: no GPU ({reason})");
            Ok(None)
        }
        Err(e) => Err(anyhow::Error::new(e).context(format!("opening {gpu}"))),
    }
}

/// An image file the example created, removed when dropped.
pub struct OwnImage(PathBuf);

impl OwnImage {
    /// Takes `path` (already created) to remove when dropped.
    pub fn new(path: PathBuf) -> Self {
        Self(path)
    }
}

impl Drop for OwnImage {
    fn drop(&mut self) {
        let _ = std::fs::remove_file(&self.0);
    }
}

/// The controller, the blockfs device on namespace 1 and the file system, opened for an
/// example. Field order is drop order.
pub struct Opened {
    /// The mounted file system.
    pub fs: FileSystem,
    /// Its device (one CPU queue pair; the GPU queues take the rest).
    pub dev: Arc<NvmeBlockDevice>,
    /// The controller.
    pub ctrl: Controller,
    /// What serves it.
    pub backend: Backend,
    /// The image, when the example made it.
    pub own: Option<OwnImage>,
    /// The image's path.
    pub path: PathBuf,
}

impl Opened {
    /// Mounts the file system again from the device, as after a restart: what was not synced
    /// is gone (the old mount is dropped without unmounting).
    pub fn remount(&mut self) -> Result<()> {
        let fs = FileSystem::mount(self.dev.clone()).context("remounting blockfs")?;
        let _old = std::mem::replace(&mut self.fs, fs);
        Ok(())
    }

    /// The GPU options of `args`.
    pub fn gpu_options(args: &DeviceArgs) -> GpuFsOptions {
        GpuFsOptions {
            serving: match args.controller {
                ControllerKind::Emu => Serving::Device,
                ControllerKind::Gpu => Serving::Model(MediaKind::Hbm),
            },
            queues: args.gpu_queues,
            controller_sms: args.controller_sms,
            ssd_model: args.ssd_model,
            gpu: args.gpu_id.clone(),
            ..GpuFsOptions::default()
        }
    }

    /// Brings the GPU queues up (the file system must be synced first: with
    /// `--controller gpu` the model loads the image now).
    pub fn gpu(&self, args: &DeviceArgs) -> Result<GpuSetup> {
        let (_cuda, setup) = gpu_fs::setup(&self.ctrl, &self.backend, &Self::gpu_options(args))?;
        Ok(setup)
    }
}

/// Takes the GPU queues down (and stops the model, writing its media back to the image).
pub fn gpu_down(setup: GpuSetup) -> Result<()> {
    Ok(gpu_fs::teardown(setup)?)
}

/// Opens `args.device` (or a new image of `need` bytes plus room) and mounts blockfs on it,
/// making one when the image holds none.
pub fn open(name: &str, args: &DeviceArgs, need: u64) -> Result<Opened> {
    if args.ssd_model.is_some() && args.controller != ControllerKind::Gpu {
        bail!(
            "--ssd-model is a parameter of the GPU-resident controller model: add --controller gpu"
        );
    }
    let size = args
        .image_size
        .unwrap_or_else(|| (need + need / 4 + (256 << 20)).next_multiple_of(1 << 20));
    let mut created = true;
    // A controller named by `vfio-user:SOCKET` or a PCI address: its blockfs is used as it is.
    let controller = match args.device.as_deref().and_then(|p| p.to_str()) {
        Some(s) => match DeviceSpec::parse(Some(s))? {
            spec @ (DeviceSpec::Pci(_) | DeviceSpec::VfioUser(_)) => Some(spec),
            _ => None,
        },
        None => None,
    };
    if let (Some(_), Some(dev), ControllerKind::Gpu) = (&controller, &args.device, args.controller)
    {
        bail!(
            "--controller gpu loads an image file into GPU memory; {} is a controller: leave \
             --controller out (the GPU queues then go to that controller)",
            dev.display()
        );
    }
    let (path, own) = match &args.device {
        Some(p) if controller.is_some() || p.exists() => {
            created = false;
            (p.clone(), None)
        }
        Some(p) => {
            EmuConfig::create_image(p, size)
                .with_context(|| format!("creating {}", p.display()))?;
            (p.clone(), None)
        }
        None => {
            let dir = if std::fs::metadata("/dev/shm").is_ok_and(|m| m.is_dir()) {
                PathBuf::from("/dev/shm")
            } else {
                std::env::temp_dir()
            };
            let p = dir.join(format!("gpunvme-{name}-{}.img", std::process::id()));
            EmuConfig::create_image(&p, size)
                .with_context(|| format!("creating {}", p.display()))?;
            (p.clone(), Some(OwnImage(p)))
        }
    };
    let spec = controller.unwrap_or_else(|| DeviceSpec::Image(path.clone()));
    let mut oopts = OpenOptions::default();
    if args.controller == ControllerKind::Gpu {
        oopts.controller_queue_pairs = gpu_fs::MODEL_QUEUE_PAIRS;
    }
    let (ctrl, backend) = open::open_controller_and_transport(&spec, &oopts)?;
    let dev = Arc::new(
        NvmeBlockDevice::new(
            &ctrl,
            1,
            &NvmeDeviceOptions {
                queues: GpuFsOptions::default().cpu_queues as usize,
                ..NvmeDeviceOptions::default()
            },
        )
        .context("opening namespace 1 for blockfs")?,
    );
    let found = FileSystem::probe(dev.clone()).context("looking for blockfs")?;
    let fs = if found.is_blockfs() {
        FileSystem::mount(dev.clone()).with_context(|| format!("mounting {found}"))?
    } else if !created {
        bail!(
            "{} holds no blockfs: make one with `gpunvme fs mkfs --device {}` (this example \
             does not format an image it did not create)",
            path.display(),
            path.display()
        );
    } else {
        FileSystem::mkfs(dev.clone(), &MkfsOptions::default()).context("mkfs")?
    };
    println!(
        "device: {} ({}{})",
        path.display(),
        match &backend {
            Backend::Software(_) => "software controller",
            Backend::Vfio(_) => "vfio-pci",
            Backend::VfioUser(_) => "vfio-user",
        },
        if found.is_blockfs() {
            format!(", {found}")
        } else {
            ", new blockfs".to_string()
        }
    );
    Ok(Opened {
        fs,
        dev,
        ctrl,
        backend,
        own,
        path,
    })
}

/// Removes `name` if it exists (the examples' own files, from an earlier run).
pub fn remove_if_present(fs: &FileSystem, name: &str) -> Result<()> {
    if fs.stat(name).is_ok() {
        fs.remove(name)
            .with_context(|| format!("removing {name}"))?;
    }
    Ok(())
}

/// Fails with `what` unless `ok`.
pub fn verify(ok: bool, what: impl FnOnce() -> String) -> Result<()> {
    if !ok {
        bail!("MISMATCH: {}", what());
    }
    Ok(())
}

/// GB/s of `bytes` in `secs`.
pub fn gbps(bytes: u64, secs: f64) -> f64 {
    bytes as f64 / secs.max(1e-9) / 1e9
}

/// Bytes of the pattern blocks the examples write: block `i` of a file holds
/// `gpu_queues::pattern` block `i` of (seed, [`PATTERN_NSID`]).
pub const PATTERN_BLOCK: u64 = 4096;
/// log2 of [`PATTERN_BLOCK`].
pub const PATTERN_SHIFT: u32 = 12;
/// The namespace field of the examples' pattern.
pub const PATTERN_NSID: u32 = 1;

/// Creates `name` (replacing an earlier run's) with `size` bytes of the pattern of `seed`,
/// written by the CPU through blockfs (preallocated, in 16 MiB writes), synced; returns the file
/// and the host's CRC-32C of its bytes.
pub fn write_pattern_file(
    fs: &FileSystem,
    name: &str,
    size: u64,
    seed: u64,
) -> Result<(gpunvme::blockfs::File, u32)> {
    write_file_with(fs, name, size, &|at, buf| {
        pattern::fill(
            buf,
            seed,
            PATTERN_NSID,
            at / PATTERN_BLOCK,
            PATTERN_BLOCK as usize,
        )
    })
}

/// Creates `name` (replacing an earlier run's) with `size` bytes from `fill(offset, buf)`
/// (offsets multiples of 16 MiB; `buf` whole 4 KiB blocks, past `size` at the end), written by the CPU through blockfs (preallocated, in 16 MiB
/// writes), synced; returns the file and the host's CRC-32C of its bytes.
pub fn write_file_with(
    fs: &FileSystem,
    name: &str,
    size: u64,
    fill: &dyn Fn(u64, &mut [u8]),
) -> Result<(gpunvme::blockfs::File, u32)> {
    remove_if_present(fs, name)?;
    let file = fs.create(name, &CreateOptions { size_hint: size })?;
    let piece = 16u64 << 20;
    let mut buf = vec![0u8; piece as usize];
    let mut crc = 0u32;
    let mut at = 0u64;
    while at < size {
        let n = (size - at).min(piece) as usize;
        fill(at, &mut buf[..n.next_multiple_of(PATTERN_BLOCK as usize)]);
        file.write_at(at, &buf[..n])
            .with_context(|| format!("writing {name} at {at}"))?;
        crc = crc32c::crc32c_append(crc, &buf[..n]);
        at += n as u64;
    }
    fs.sync().context("syncing the file")?;
    println!("{name}: {size} bytes written by the CPU, crc32c {crc:08x}");
    Ok((file, crc))
}

/// `--data-path` of the cache examples (`gpunvme::gpu_cache::DataPath`).
#[derive(clap::ValueEnum, Debug, Clone, Copy)]
pub enum DataPathArg {
    /// DIRECT where the transport can map the frames, else BOUNCE.
    Auto,
    /// Commands move data straight between the device and the frames.
    Direct,
    /// Through the queues' slot buffers.
    Bounce,
}

/// The page cache options the cache examples share.
#[derive(clap::Args, Debug, Clone)]
pub struct CacheArgs {
    /// Cache capacities, each a share of the data ("25%") or a size ("2G"); one run each.
    #[arg(long, value_delimiter = ',', default_value = "25%")]
    pub cache: Vec<String>,
    /// Cache page size.
    #[arg(long, default_value = "4K", value_parser = parse_size)]
    pub page_size: u64,
    /// Where fills put the data: straight into the frames where the transport can map them
    /// (auto), always (direct), or through the queues' slot buffers (bounce: what the real-SSD
    /// transports whose GPU memory is fixed at set-up use).
    #[arg(long, value_enum, default_value = "auto")]
    pub data_path: DataPathArg,
    /// Also run the baselines: the data wholly in GPU memory, in unified memory, and in unified
    /// memory with GPU memory limited to the first capacity.
    #[arg(long)]
    pub baselines: bool,
    /// One JSON object per run on stdout (lines starting with `{`).
    #[arg(long)]
    pub json: bool,
}

impl CacheArgs {
    /// The capacities in bytes for `data` bytes of data, each with its share of the data (%).
    pub fn capacities(&self, data: u64) -> Result<Vec<(u64, f64)>> {
        self.cache
            .iter()
            .map(|c| {
                let bytes = match c.strip_suffix('%') {
                    Some(p) => {
                        let p: f64 = p
                            .trim()
                            .parse()
                            .with_context(|| format!("--cache {c}: a percentage"))?;
                        if !(p > 0.0 && p <= 1000.0) {
                            bail!("--cache {c}: a share above 0 %");
                        }
                        (data as f64 * p / 100.0) as u64
                    }
                    None => parse_size(c).map_err(|e| anyhow::anyhow!("--cache {c}: {e}"))?,
                };
                let bytes = bytes.max(4 * self.page_size) / self.page_size * self.page_size;
                Ok((bytes, bytes as f64 * 100.0 / data as f64))
            })
            .collect()
    }

    /// A cache of `capacity` bytes in `--page-size` pages on `q`'s queues.
    pub fn new_cache<'q>(
        &self,
        q: &'q gpunvme::gpu_queues::GpuQueues,
        capacity: u64,
    ) -> Result<gpunvme::gpu_cache::GpuCache<'q>> {
        Ok(gpunvme::gpu_cache::GpuCache::new(
            q,
            gpunvme::gpu_cache::CacheOptions {
                page_size: u32::try_from(self.page_size).context("--page-size")?,
                capacity,
                data_path: match self.data_path {
                    DataPathArg::Auto => gpunvme::gpu_cache::DataPath::Auto,
                    DataPathArg::Direct => gpunvme::gpu_cache::DataPath::Direct,
                    DataPathArg::Bounce => gpunvme::gpu_cache::DataPath::Bounce,
                },
                ..Default::default()
            },
        )?)
    }

    /// A cache run's JSON fields: its size and page size and its statistics after the run.
    pub fn cache_fields(
        cache: &gpunvme::gpu_cache::GpuCache<'_>,
        capacity: u64,
        pct: f64,
    ) -> Result<serde_json::Value> {
        let k = cache.stats()?.counters;
        Ok(serde_json::json!({
            "capacity_bytes": capacity, "capacity_pct": pct,
            "page_size": cache.page_size(), "frames": cache.nframes(),
            "hits": k.hits, "misses": k.misses, "waits": k.waits,
            "evictions": k.evictions, "read_cmds": k.read_cmds,
            "bytes_read": k.bytes_read, "data_path": format!("{:?}", cache.data_path()),
        }))
    }

    /// Prints a run: its JSON object with --json, else one line of its mode, its share of the
    /// `data` ("graph", "table"), its time, `rate` and its misses.
    pub fn report(&self, r: &serde_json::Value, data: &str, rate: &str) {
        if self.json {
            println!("{r}");
            return;
        }
        println!(
            "{}{}: {:.4} s, {rate}{}",
            r["mode"].as_str().unwrap_or("?"),
            r["capacity_pct"]
                .as_f64()
                .map_or(String::new(), |p| format!(" at {p:.0} % of the {data}")),
            r["seconds"].as_f64().unwrap_or(0.0),
            r["misses"]
                .as_u64()
                .map_or(String::new(), |m| format!(", {m} misses")),
        );
    }
}

/// `base` with `extra`'s fields added (both JSON objects).
pub fn with_fields(mut base: serde_json::Value, extra: serde_json::Value) -> serde_json::Value {
    if let (Some(o), serde_json::Value::Object(e)) = (base.as_object_mut(), extra) {
        o.extend(e);
    }
    base
}
