//! An open device for embedders (the Python package, the C ABI): a controller brought up the
//! way the CLI does it, blockfs on one namespace, and the file-system calls of `gpunvme fs`
//! returning the CLI's report types. Refusals that protect data are [`Refused`] errors.

use std::collections::BTreeMap;
use std::path::Path;
use std::sync::atomic::AtomicBool;
use std::sync::{Arc, Mutex, PoisonError};
use std::time::Instant;

use crate::error::{Context, Result, bail, ensure};
use blockfs::{
    BlockDevice, FileSystem, FsckOptions, MkfsOptions, NvmeBlockDevice, NvmeDeviceOptions, OpenMode,
};
use gpu_queues::ffi::DeviceMemory;
use gpu_queues::{Cuda, GpuId};
use nvme::Controller;

use crate::copy;
use crate::fs_report::{
    DfReport, FsckView, ListReport, MkfsReport, RemoveReport, RenameReport, StatReport, check_data,
};
use crate::gpu::{GpuSetup, Serving};
use crate::gpu_fs::{self, GpuFsOptions};
use crate::gpu_io::{self, GpuIoReport, Piece, ReadPath};
use crate::open::{self, Backend, DeviceSpec, OpenOptions};
use crate::safetensors;
use crate::volume;

pub use crate::error::{InvalidArgument, Refused};

/// An fsck's outcome.
pub struct FsckOutcome {
    /// The report as `gpunvme --json fs fsck` prints it.
    pub json: serde_json::Value,
    /// Whether the file system is consistent.
    pub consistent: bool,
    /// Files whose data did not match their recorded CRC-32C (with `data`).
    pub mismatched: Vec<String>,
}

/// Who owns the controllers behind a handle.
enum Owner {
    /// This process: the controllers it brought up (the first serves the GPU calls) and what
    /// is behind each.
    Local {
        /// Dropped first: the transports outlive their controllers.
        ctrls: Vec<Controller>,
        backend: Backend,
        backends: Vec<Backend>,
    },
    /// A `gpunvme serve` daemon: one of its controllers, through this handle's connection.
    Served(crate::served::ServedController),
}

impl Owner {
    /// The controllers this process brought up (none for a served device).
    fn ctrls(&self) -> &[Controller] {
        match self {
            Owner::Local { ctrls, .. } => ctrls,
            Owner::Served(_) => &[],
        }
    }

    /// The software controller, where the handle owns one.
    fn emu(&self) -> Option<&Arc<nvme_emu::EmuDevice>> {
        match self {
            Owner::Local { backend, .. } => backend.emu(),
            Owner::Served(_) => None,
        }
    }

    /// Where the handle's GPU queues come from.
    fn queues(&self) -> gpu_fs::QueueSource<'_> {
        match self {
            Owner::Local { ctrls, backend, .. } => gpu_fs::QueueSource::Owned(&ctrls[0], backend),
            Owner::Served(served) => gpu_fs::QueueSource::Served(served),
        }
    }
}

/// An open device: its controller and the block device blockfs runs on; or several devices,
/// one controller each, making a striped volume; or a controller a daemon owns.
pub struct DeviceHandle {
    /// GPU queues kept up between GPU calls, per GPU (by ordinal; dropped first: before the
    /// controllers).
    gpu: Mutex<BTreeMap<i32, GpuSession>>,
    specs: Vec<DeviceSpec>,
    names: Vec<String>,
    opts: OpenOptions,
    nsid: u32,
    describe: String,
    /// One device: its block device; several: the volume's members.
    members: Vec<Arc<dyn BlockDevice>>,
    /// I/O queue pairs the block device holds (GPU queues take the rest).
    cpu_queues: u16,
    /// Blockfs as [`DeviceHandle::mount`] keeps it between calls.
    mounted: Mutex<Option<Arc<FileSystem>>>,
    /// On a served device, earlier mounts some call may still read through: the daemon keeps
    /// the oldest one's blocks ([`DeviceHandle::mount`]).
    old_mounts: Mutex<Vec<std::sync::Weak<FileSystem>>>,
    // Dropped after the block devices (field order): their queues are the controllers'.
    owner: Owner,
    opened: OpenPhases,
}

/// Where a handle's open went, in seconds, summed over its devices
/// ([`DeviceHandle::open_phases`]).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct OpenPhases {
    /// The transports: an image and its software controller's threads, a VFIO function, a
    /// vfio-user socket.
    pub transport: f64,
    /// The controllers' bring-up: reset, enable, Identify, queue counts.
    pub controller: f64,
    /// Blockfs's block devices (their CPU I/O queue pairs).
    pub block_devices: f64,
}

/// Where a handle's close went, in seconds ([`DeviceHandle::close`]).
#[derive(Clone, Copy, Debug, Default, serde::Serialize)]
pub struct ClosePhases {
    /// GPU queues deleted, their kernels stopped and memory freed, per GPU.
    pub gpu_queues: f64,
    /// The mounted file system and the block devices (their CPU queue pairs deleted).
    pub block_devices: f64,
    /// The controllers shut down and the transports closed (a software controller's threads
    /// joined).
    pub controllers: f64,
}

/// What a kernel including `gpunvme.cuh` needs to use a handle's GPU queues
/// ([`DeviceHandle::gpu_queues`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GpuQueuesInfo {
    /// GPU pointer of the `gpunvme::queue_desc` array.
    pub descriptors: u64,
    /// Queues in it.
    pub count: u32,
    /// Entries per queue (a power of two).
    pub depth: u32,
    /// Most bytes one command moves.
    pub max_transfer: u32,
    /// The handle's namespace.
    pub nsid: u32,
    /// Its LBA size in bytes.
    pub lba_size: u32,
}

/// GPU queues of one GPU on the device's own controller, kept between GPU calls of one handle
/// so that only the first call on that GPU pays for bringing them up (the GPU-resident model is started per call: it
/// serves the image from a copy of its own while it runs).
struct GpuSession {
    setup: GpuSetup,
}

/// A tensor to save ([`DeviceHandle::save_safetensors`]): its header entry and its bytes.
pub struct SaveTensor {
    /// Name, dtype, shape and byte count.
    pub info: safetensors::TensorToWrite,
    /// Its bytes, in GPU memory allocated elsewhere (`info.bytes` of them; none for an empty
    /// tensor).
    pub mem: Option<Arc<gpu_queues::ffi::DeviceMemory>>,
}

impl DeviceHandle {
    /// Opens `device` (as `--device`: a PCI address, an image path, None for the default
    /// image, or several of them comma-separated for a striped volume) and blockfs's block
    /// device on namespace `nsid` of each.
    pub fn open(device: Option<&str>, opts: OpenOptions, nsid: u32) -> Result<Self> {
        let names: Vec<String> = match device {
            Some(d) => d.split(',').map(str::to_owned).collect(),
            None => vec![opts.default_image.display().to_string()],
        };
        let specs = match device {
            Some(_) => names
                .iter()
                .map(|n| DeviceSpec::parse(Some(n)))
                .collect::<Result<Vec<_>>>()?,
            None => vec![DeviceSpec::parse(None)?],
        };
        if let Some(served) = specs.iter().find_map(|s| match s {
            DeviceSpec::Served(s) => Some(s.clone()),
            _ => None,
        }) {
            ensure!(
                specs.len() == 1,
                InvalidArgument,
                "{served} cannot be a volume member: a striped volume of served devices is not \
                 supported yet"
            );
            return Self::open_served(&served, names, specs, opts, nsid);
        }
        let mut ctrls = Vec::with_capacity(specs.len());
        let mut backends = Vec::with_capacity(specs.len());
        let mut opened = OpenPhases::default();
        for (spec, name) in specs.iter().zip(&names) {
            let (c, b, [transport, controller]) =
                open::open_controller_and_transport_timed(spec, &opts)
                    .with_context(|| format!("opening {name}"))?;
            opened.transport += transport.as_secs_f64();
            opened.controller += controller.as_secs_f64();
            ctrls.push(c);
            backends.push(b);
        }
        let t = Instant::now();
        let backend = backends.first().cloned().context("no device")?;
        let describe = ctrls
            .iter()
            .zip(&names)
            .map(|(c, n)| {
                let info = c.info();
                format!(
                    "{} serial {} ({n}, namespace {nsid})",
                    info.mn.trim(),
                    info.sn.trim()
                )
            })
            .collect::<Vec<_>>()
            .join("; ");
        let dev_opts = NvmeDeviceOptions::default();
        let members = ctrls
            .iter()
            .zip(&names)
            .map(|(c, n)| {
                NvmeBlockDevice::new(c, nsid, &dev_opts)
                    .map(|d| Arc::new(d) as Arc<dyn BlockDevice>)
                    .with_context(|| format!("opening namespace {nsid} of {n} for blockfs"))
            })
            .collect::<Result<Vec<_>>>()?;
        opened.block_devices = t.elapsed().as_secs_f64();
        let mounted = Mutex::new(None);
        Ok(Self {
            gpu: Mutex::new(BTreeMap::new()),
            specs,
            names,
            opts,
            nsid,
            describe,
            members,
            cpu_queues: u16::try_from(dev_opts.queues).unwrap_or(u16::MAX),
            mounted,
            old_mounts: Mutex::new(Vec::new()),
            owner: Owner::Local {
                ctrls,
                backend,
                backends,
            },
            opened,
        })
    }

    /// Opens a device a daemon owns: a connection, the controller's description, a served
    /// queue pair for blockfs (read through a read-only mount; the daemon writes the metadata).
    fn open_served(
        spec: &crate::served::ServedSpec,
        names: Vec<String>,
        specs: Vec<DeviceSpec>,
        opts: OpenOptions,
        nsid: u32,
    ) -> Result<Self> {
        let t = Instant::now();
        let client = format!("gpunvme library (pid {})", std::process::id());
        let served = crate::served::ServedController::open(spec, &client)?;
        let transport = t.elapsed().as_secs_f64();
        let dev = served.block_device(nsid)?;
        let describe = format!(
            "{} (namespace {nsid}; {})",
            served.describe(),
            served.trust()
        );
        Ok(Self {
            gpu: Mutex::new(BTreeMap::new()),
            specs,
            names,
            opts,
            nsid,
            describe,
            members: vec![Arc::new(dev)],
            cpu_queues: 1,
            mounted: Mutex::new(None),
            old_mounts: Mutex::new(Vec::new()),
            owner: Owner::Served(served),
            opened: OpenPhases {
                transport,
                controller: 0.0,
                block_devices: t.elapsed().as_secs_f64() - transport,
            },
        })
    }

    /// Whether the device is one a daemon owns (`served:`).
    pub fn is_served(&self) -> bool {
        matches!(self.owner, Owner::Served(_))
    }

    /// Where this handle's open went.
    pub fn open_phases(&self) -> OpenPhases {
        self.opened
    }

    /// Closes the handle in the order a drop does (GPU queues, then the file system and the
    /// block devices, then the controllers and transports) and says how long each part took.
    pub fn close(self) -> ClosePhases {
        let Self {
            gpu,
            mounted,
            members,
            owner,
            ..
        } = self;
        let t = Instant::now();
        drop(gpu);
        let gpu_queues = t.elapsed();
        drop((mounted, members));
        let block_devices = t.elapsed() - gpu_queues;
        drop(owner);
        ClosePhases {
            gpu_queues: gpu_queues.as_secs_f64(),
            block_devices: block_devices.as_secs_f64(),
            controllers: (t.elapsed() - gpu_queues - block_devices).as_secs_f64(),
        }
    }

    /// `e` (an error of one of this handle's calls) named for its cause when the host refused
    /// a write to an image meanwhile: [`open::HostWriteFailed`], a full host file system as
    /// [`crate::error::ErrorKind::NoSpace`] rather than the Write Fault the device
    /// reported. The bindings pass every error through it.
    pub fn explain(&self, e: crate::Error) -> crate::Error {
        match &self.owner {
            Owner::Local { backends, .. } => open::explain_host_error(e, backends),
            Owner::Served(_) => e,
        }
    }

    /// Whether the handle is a striped volume over several devices.
    pub fn is_volume(&self) -> bool {
        self.members.len() > 1
    }

    /// The block device blockfs runs on: the one device (refused if it is a volume member), or
    /// the volume assembled from the members (refused if they are not one).
    fn block(&self) -> Result<Arc<dyn BlockDevice>> {
        if self.is_volume() {
            Ok(Arc::new(volume::assemble(
                self.members.clone(),
                &self.names,
            )?))
        } else {
            volume::refuse_member(self.members[0].as_ref(), &self.names[0])?;
            Ok(self.members[0].clone())
        }
    }

    /// What the device is: model, serial, namespace.
    pub fn describe(&self) -> &str {
        &self.describe
    }

    /// Mounts blockfs once and keeps the result for the handle's later calls: nothing else
    /// changes the device while the handle is open (an image is locked, exclusively for a
    /// writable handle; a PCI function's VFIO group is one process's), so a call costs no
    /// remount, which at 100,000 files would be most of its time. A controller served over
    /// vfio-user may have other clients, so there every call mounts afresh. A failed mount is
    /// not kept, and a poisoned file system (a commit failed where its outcome is unknown) is
    /// dropped and mounted afresh by the next call.
    pub fn mount(&self) -> Result<Arc<FileSystem>> {
        if let Owner::Served(served) = &self.owner {
            return self.mount_served(served);
        }
        if self
            .specs
            .iter()
            .any(|s| matches!(s, DeviceSpec::VfioUser(_)))
        {
            return self.mount_afresh().map(Arc::new);
        }
        let mut held = self.mounted.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(fs) = held.as_ref()
            && !fs.is_poisoned()
        {
            return Ok(fs.clone());
        }
        *held = None;
        let fs = Arc::new(self.mount_afresh()?);
        *held = Some(fs.clone());
        Ok(fs)
    }

    /// Drops the kept mount: the device is about to change under it (mkfs, fsck's repair) or
    /// be checked unmounted (fsck).
    fn unmount(&self) {
        *self.mounted.lock().unwrap_or_else(PoisonError::into_inner) = None;
    }

    /// [`DeviceHandle::mount`] on a served device: the daemon mounts blockfs and writes its
    /// metadata, so this process mounts it read-only and mounts afresh whenever the daemon's
    /// generation moved (another client committed). Each view tells the daemon the oldest
    /// generation a mount still alive here may read through, and the daemon keeps that
    /// generation's blocks until a later view lets it go.
    fn mount_served(&self, served: &crate::served::ServedController) -> Result<Arc<FileSystem>> {
        let mut held = self.mounted.lock().unwrap_or_else(PoisonError::into_inner);
        let mut old = self
            .old_mounts
            .lock()
            .unwrap_or_else(PoisonError::into_inner);
        old.retain(|w| w.strong_count() > 0);
        let oldest = old
            .iter()
            .filter_map(std::sync::Weak::upgrade)
            .chain(held.clone())
            .map(|fs| fs.generation())
            .min();
        let now = served.fs_view(self.nsid, oldest)?;
        if let Some(fs) = held.as_ref()
            && fs.generation() == now
        {
            return Ok(fs.clone());
        }
        // A mount that races a commit of the daemon's may read a superblock or table being
        // replaced; its checks refuse that, and a second look finds the new generation.
        let mut tries = 0;
        let fs = loop {
            match self.mount_afresh() {
                Ok(fs) => break Arc::new(fs),
                Err(e) if tries < 4 && e.kind() == crate::error::ErrorKind::Corrupt => {
                    tries += 1;
                    std::thread::sleep(std::time::Duration::from_millis(2));
                }
                Err(e) => return Err(e),
            }
        };
        if let Some(prev) = held.replace(fs.clone()) {
            old.push(Arc::downgrade(&prev));
        }
        Ok(fs)
    }

    fn mount_afresh(&self) -> Result<FileSystem> {
        let nsid = self.nsid;
        let mounted = if self.opts.read_only || self.is_served() {
            FileSystem::mount_read_only(self.block()?)
        } else {
            FileSystem::mount(self.block()?)
        };
        mounted.map_err(|e| match e {
            e @ blockfs::Error::NotBlockfs(_) => crate::Error::from(e).context(format!(
                "namespace {nsid} holds no blockfs (make one with mkfs)"
            )),
            e => crate::Error::from(e).context(format!(
                "mounting blockfs on namespace {nsid} (fsck says more)"
            )),
        })
    }

    /// Whether the handle was opened read-only: every call that would change the device
    /// (mkfs, put, rm, save, fsck's repair) is refused up front with a
    /// [`blockfs::Error::ReadOnly`] ([`crate::error::ErrorKind::ReadOnly`]), and blockfs is
    /// mounted read-only ([`FileSystem::mount_read_only`]).
    pub fn is_read_only(&self) -> bool {
        self.opts.read_only
    }

    /// Refuses `what` of `name` on a read-only handle, before anything is read or changed.
    fn refuse_read_only(&self, what: &str, name: &str) -> Result<()> {
        if self.opts.read_only {
            return Err(
                crate::Error::from(blockfs::Error::ReadOnly(name.to_owned()))
                    .context(format!("{what} refused: the handle was opened read-only")),
            );
        }
        Ok(())
    }

    /// Refuses `what`, which a client of a daemon may not do: the daemon alone writes the
    /// file system's metadata, so mkfs and repairs are the operator's (on the device unserved).
    fn refuse_served(&self, what: &str, name: &str) -> Result<()> {
        if let Owner::Served(served) = &self.owner {
            return Err(
                crate::Error::from(blockfs::Error::ReadOnly(name.to_owned())).context(format!(
                    "{what} refused on {}: a daemon's clients put, save, remove and rename \
                     files; {what} is the operator's (run it where the device is owned)",
                    served.describe()
                )),
            );
        }
        Ok(())
    }

    /// Makes a new, empty file system; [`Refused`] where one exists unless `force`. On a
    /// volume, makes the volume first (labels on every member; `stripe` bytes per unit, by
    /// default the smallest maximum transfer of the controllers).
    pub fn mkfs(&self, block_size: u32, force: bool, stripe: Option<u64>) -> Result<MkfsReport> {
        self.refuse_read_only("mkfs", "(every file)")?;
        self.refuse_served("mkfs", "(every file)")?;
        self.unmount();
        let dev: Arc<dyn BlockDevice> = if self.is_volume() {
            let refs: Vec<&Controller> = self.owner.ctrls().iter().collect();
            let stripe = stripe.unwrap_or_else(|| volume::default_stripe(&refs));
            Arc::new(volume::make(
                self.members.clone(),
                &self.names,
                stripe,
                force,
            )?)
        } else {
            ensure!(
                stripe.is_none(),
                InvalidArgument,
                "a stripe is for a volume over several devices"
            );
            if !force {
                volume::refuse_member(self.members[0].as_ref(), &self.names[0])?;
            }
            self.members[0].clone()
        };
        if !force {
            let found =
                FileSystem::probe(dev.clone()).context("looking for a file system to keep")?;
            if found.is_blockfs() {
                return Err(Refused(format!(
                    "namespace {} holds {found}; mkfs would destroy it (force it to do so)",
                    self.nsid
                ))
                .into());
            }
        }
        let opts = MkfsOptions {
            block_size,
            ..MkfsOptions::default()
        };
        let fs = FileSystem::mkfs(dev, &opts).context("mkfs")?;
        Ok(MkfsReport::of(&fs))
    }

    /// The files whose names start with `prefix`.
    pub fn ls(&self, prefix: &str) -> Result<ListReport> {
        Ok(ListReport::of(&*self.mount()?, prefix))
    }

    /// Copies host file `src` in as `name` (replacing it by one commit with `force`).
    pub fn put(&self, src: &Path, name: &str, force: bool) -> Result<copy::TransferReport> {
        self.put_cancellable(src, name, force, &AtomicBool::new(false))
    }

    /// Copies a stream (a pipe, standard input: no length known up front) into the file
    /// system as `name` ([`copy::put_stream`]; on a served device through a write lease grown
    /// as the stream goes, [`copy::put_stream_served`]): `chunk` bytes held at a time, the
    /// file committed with its CRC-32C only at the end of the stream; a failure or `cancel`
    /// before then stores nothing. `from` names the stream in the report and errors.
    #[allow(clippy::too_many_arguments)]
    pub fn put_stream(
        &self,
        input: &mut dyn std::io::Read,
        from: &str,
        name: &str,
        force: bool,
        chunk: Option<u64>,
        progress: &(dyn Fn(u64) + Sync),
        cancel: &AtomicBool,
    ) -> Result<copy::TransferReport> {
        self.refuse_read_only("put", name)?;
        if let Owner::Served(served) = &self.owner {
            return copy::put_stream_served(
                self.members[0].as_ref(),
                input,
                from,
                name,
                chunk,
                |len| served.fs_create(self.nsid, name, len, force),
                progress,
                cancel,
            );
        }
        let fs = self.mount()?;
        let opts = copy::PutOptions { force, chunk };
        Ok(copy::put_stream(
            &fs, input, from, name, &opts, progress, cancel,
        )?)
    }

    /// [`DeviceHandle::put`], stopped before it commits once `cancel` is set (from another
    /// thread): [`copy::CopyError::Cancelled`], nothing stored.
    pub fn put_cancellable(
        &self,
        src: &Path,
        name: &str,
        force: bool,
        cancel: &AtomicBool,
    ) -> Result<copy::TransferReport> {
        self.refuse_read_only("put", name)?;
        if let Owner::Served(served) = &self.owner {
            return copy::put_served(
                self.members[0].as_ref(),
                src,
                name,
                |len| served.fs_create(self.nsid, name, len, force),
                &|_| {},
                cancel,
            );
        }
        let fs = self.mount()?;
        let opts = copy::PutOptions {
            force,
            ..copy::PutOptions::default()
        };
        Ok(copy::put_cancellable(
            &fs,
            src,
            name,
            &opts,
            &|_| {},
            cancel,
        )?)
    }

    /// Copies `name` out to host file `dst`; [`Refused`] onto the device's own image.
    pub fn get(&self, name: &str, dst: &Path) -> Result<copy::TransferReport> {
        self.get_cancellable(name, dst, &AtomicBool::new(false))
    }

    /// [`DeviceHandle::get`], stopped before the copy takes `dst`'s name once `cancel` is set
    /// (from another thread): [`copy::CopyError::Cancelled`], `dst` as it was.
    pub fn get_cancellable(
        &self,
        name: &str,
        dst: &Path,
        cancel: &AtomicBool,
    ) -> Result<copy::TransferReport> {
        if self.specs.iter().any(|s| s.is_own_image(&self.opts, dst)) {
            return Err(Refused(format!(
                "{} is the device's own image file: writing the output there would destroy it",
                dst.display()
            ))
            .into());
        }
        let fs = self.mount()?;
        let dest = copy::Destination::Path(dst);
        Ok(copy::get_cancellable(
            &fs,
            name,
            dest,
            &copy::GetOptions::default(),
            &|_| {},
            cancel,
        )?)
    }

    /// `name`'s size, allocation, extents and generation.
    pub fn stat(&self, name: &str) -> Result<StatReport> {
        Ok(StatReport::of(&*self.mount()?, name)?)
    }

    /// Up to `size` bytes of `name` from `offset` (to the end of the file when `None`), read
    /// into host memory through the CPU's queues: short only at the end of the file, empty
    /// from there on. For headers and other small reads; bulk data goes to the GPU.
    pub fn read(&self, name: &str, offset: u64, size: Option<u64>) -> Result<Vec<u8>> {
        let fs = self.mount()?;
        let f = fs.open(name, OpenMode::ReadOnly)?;
        let avail = f.len()?.saturating_sub(offset);
        let n = size.map_or(avail, |s| s.min(avail));
        let n = usize::try_from(n)
            .map_err(|_| InvalidArgument(format!("a read of {n} bytes into host memory")))?;
        let mut buf = Vec::new();
        buf.try_reserve_exact(n).map_err(|_| {
            InvalidArgument(format!(
                "a read of {n} bytes of {name}: no host memory for it"
            ))
        })?;
        buf.resize(n, 0);
        let got = f.read_at(offset, &mut buf)?;
        buf.truncate(got);
        Ok(buf)
    }

    /// Reads up to `buf.len()` bytes of `name` from `offset` into host memory: the count read
    /// (short only at the end of the file).
    pub fn read_at(&self, name: &str, offset: u64, buf: &mut [u8]) -> Result<usize> {
        let fs = self.mount()?;
        let f = fs.open(name, OpenMode::ReadOnly)?;
        Ok(f.read_at(offset, buf)?)
    }

    /// Removes `name`.
    pub fn rm(&self, name: &str) -> Result<RemoveReport> {
        self.refuse_read_only("rm", name)?;
        if let Owner::Served(served) = &self.owner {
            served.fs_remove(self.nsid, name)?;
            return Ok(RemoveReport {
                removed: name.to_owned(),
            });
        }
        let fs = self.mount()?;
        fs.remove(name)?;
        fs.sync()?;
        Ok(RemoveReport {
            removed: name.to_owned(),
        })
    }

    /// Renames `old` to `new`: an existing `new` is [`blockfs::Error::AlreadyExists`] unless
    /// `force`, which replaces it by one commit (`gpunvme fs mv [--force]`).
    pub fn mv(&self, old: &str, new: &str, force: bool) -> Result<RenameReport> {
        self.refuse_read_only("mv", old)?;
        if let Owner::Served(served) = &self.owner {
            served.fs_rename(self.nsid, old, new, force)?;
            return Ok(RenameReport {
                from: old.to_owned(),
                to: new.to_owned(),
            });
        }
        let fs = self.mount()?;
        if force {
            fs.rename_replace(old, new)?;
        } else {
            fs.rename(old, new)?;
        }
        fs.sync()?;
        Ok(RenameReport {
            from: old.to_owned(),
            to: new.to_owned(),
        })
    }

    /// Space: blocks in all, free, and the bytes available for file data (`gpunvme fs df`).
    pub fn df(&self) -> Result<DfReport> {
        Ok(DfReport::of(&*self.mount()?))
    }

    /// Checks the file system (unmounted); `repair` fixes what can be fixed, `data` also reads
    /// every file with a recorded checksum.
    pub fn fsck(&self, repair: bool, data: bool) -> Result<FsckOutcome> {
        if repair {
            self.refuse_read_only("fsck with repair", "(every file)")?;
            self.refuse_served("fsck with repair", "(every file)")?;
        }
        self.unmount();
        let (dev, label_repair): (Arc<dyn BlockDevice>, _) = if repair && self.is_volume() {
            let (v, line) = volume::assemble_repairing(self.members.clone(), &self.names)?;
            (Arc::new(v), line)
        } else {
            (self.block()?, None)
        };
        let mut report = blockfs::fsck(dev.clone(), &FsckOptions { repair })?;
        // A volume label rebuilt before the check is the first repair.
        report.repairs.splice(0..0, label_repair);
        let data_report = if data && report.is_consistent() {
            Some(check_data(&FileSystem::mount(dev)?)?)
        } else {
            None
        };
        let view = FsckView {
            report: &report,
            repair,
            data: data_report.as_ref(),
        };
        Ok(FsckOutcome {
            json: serde_json::to_value(&view)?,
            consistent: report.is_consistent(),
            mismatched: data_report.map(|d| d.mismatched).unwrap_or_default(),
        })
    }

    /// Refuses GPU calls this handle cannot make (before anything is changed).
    fn gpu_ready(&self, serving: Serving, ssd_model: Option<gpu_emu::SsdModel>) -> Result<()> {
        self.gpu_arguments(serving, ssd_model)?;
        ensure!(
            gpu_queues::cuda_present(),
            Device,
            "no GPU: no CUDA driver on this machine"
        );
        Ok(())
    }

    /// Refuses GPU arguments this handle cannot take (a striped volume; an SSD model without
    /// the model), before anything is read or changed.
    fn gpu_arguments(&self, serving: Serving, ssd_model: Option<gpu_emu::SsdModel>) -> Result<()> {
        ensure!(
            !self.is_volume(),
            InvalidArgument,
            "GPU reads and writes on a striped volume are not supported yet"
        );
        if ssd_model.is_some() && !matches!(serving, Serving::Model(_)) {
            return Err(InvalidArgument(
                "an SSD timing model needs the GPU-resident controller model (controller \"gpu\")"
                    .into(),
            )
            .into());
        }
        Ok(())
    }

    /// Runs `f` on `cuda`'s GPU queues served as `serving` says: the handle's kept queues of
    /// that GPU on the device's own controller (brought up by the first GPU call on it), or the
    /// GPU-resident model started for this call and stopped after it. Queues that saw an error
    /// are torn down (the next call brings fresh ones up). Also the seconds spent bringing
    /// queues up (exactly 0 when kept ones served). Each GPU's queues are an even share of the
    /// controller's ([`gpu_fs::gpu_share`] among the GPUs this process sees), so that every
    /// GPU can have its own at once.
    fn with_gpu<T>(
        &self,
        cuda: &Arc<Cuda>,
        serving: Serving,
        ssd_model: Option<gpu_emu::SsdModel>,
        f: impl FnOnce(&GpuSetup) -> Result<T>,
    ) -> Result<(T, f64)> {
        self.gpu_ready(serving, ssd_model)?;
        let mut kept = self.gpu.lock().unwrap_or_else(PoisonError::into_inner);
        let t0 = Instant::now();
        let keep = serving == Serving::Device;
        if !keep {
            // The model serves the image from a copy of its own: no kept queue may write to it
            // meanwhile (any GPU's).
            for (_, s) in std::mem::take(&mut *kept) {
                gpu_fs::teardown(s.setup)?;
            }
        }
        let (session, fresh) = match kept.remove(&cuda.ordinal()) {
            Some(s) => (s, false),
            None => {
                let opts = GpuFsOptions {
                    serving,
                    cpu_queues: self.cpu_queues,
                    ssd_model,
                    sharing_gpus: u16::try_from(Cuda::count()?.max(1)).unwrap_or(u16::MAX),
                    ..GpuFsOptions::default()
                };
                let setup = self.owner.queues().setup_on(cuda, &opts)?;
                (GpuSession { setup }, true)
            }
        };
        let setup_secs = if fresh {
            t0.elapsed().as_secs_f64()
        } else {
            0.0
        };
        let result = f(&session.setup);
        if keep && result.is_ok() {
            kept.insert(cuda.ordinal(), session);
        } else {
            let down = gpu_fs::teardown(session.setup);
            if result.is_ok() {
                down?;
            }
        }
        Ok((result?, setup_secs))
    }

    /// The GPUs (ordinals) whose queues are kept up from an earlier GPU call.
    pub fn gpus_kept(&self) -> Vec<i32> {
        self.gpu
            .lock()
            .unwrap_or_else(PoisonError::into_inner)
            .keys()
            .copied()
            .collect()
    }

    /// Whether GPU queues of any GPU are kept up from an earlier GPU call.
    pub fn gpu_kept(&self) -> bool {
        !self.gpus_kept().is_empty()
    }

    /// Tears down the GPU queues kept between GPU calls, every GPU's (the next GPU call brings
    /// them up again; closing the handle does this too). The first teardown error, after all
    /// of them ran.
    pub fn release_gpu(&self) -> Result<()> {
        let kept = std::mem::take(&mut *self.gpu.lock().unwrap_or_else(PoisonError::into_inner));
        let mut first = Ok(());
        for (_, s) in kept {
            let r = gpu_fs::teardown(s.setup);
            if first.is_ok() {
                first = r;
            }
        }
        first
    }

    /// The handle's queues of GPU `gpu` on its own controller for the caller's kernels on
    /// that GPU (brought up and kept, as by the first GPU call): what a kernel that includes
    /// `gpunvme.cuh` needs. Valid until [`DeviceHandle::release_gpu`] or the handle's end, and
    /// shared with this handle's own GPU calls on that GPU (the queue protocol lets any number
    /// of clients share a queue).
    pub fn gpu_queues(&self, gpu: &GpuId) -> Result<GpuQueuesInfo> {
        self.gpu_ready(Serving::Device, None)?;
        let cuda = gpu_fs::open_gpu(gpu)?;
        let (info, _) = self.with_gpu(&cuda, Serving::Device, None, |setup| {
            let q = &setup.queues;
            let lba_size = self.members[0].lba_size();
            Ok(GpuQueuesInfo {
                descriptors: q.descriptors(),
                count: u32::try_from(q.len()).unwrap_or(u32::MAX),
                depth: q.depth(),
                max_transfer: q.max_transfer(),
                nsid: self.nsid,
                lba_size,
            })
        })?;
        Ok(info)
    }

    /// `mem` (GPU memory allocated elsewhere) made reachable by the handle's GPU queues'
    /// controller while the returned buffer lives: its `bus()` is the device address commands
    /// carry, for the queues of `mem`'s GPU ([`DeviceHandle::gpu_queues`] of that GPU).
    /// [`gpu_queues::GpuError::Unsupported`] where the transport cannot map such memory. The
    /// buffer must be dropped before [`DeviceHandle::release_gpu`].
    pub fn gpu_map(
        &self,
        mem: Arc<gpu_queues::ffi::DeviceMemory>,
    ) -> Result<gpu_queues::GpuBuffer> {
        let cuda = mem.cuda().clone();
        let (buf, _) = self.with_gpu(&cuda, Serving::Device, None, |setup| {
            Ok(setup.queues.map_memory(mem)?)
        })?;
        Ok(buf)
    }

    /// File `name`'s extent table in GPU memory, for the caller's kernels that include
    /// `gpunvme_file.cuh` (`table_open` on [`blockfs_gpu::GpuFile::table_ptr`], file
    /// [`blockfs_gpu::GpuFile::index`]) and read it on the handle's GPU queues
    /// ([`DeviceHandle::gpu_queues`] of the same `gpu`), in that GPU's memory. The table is the
    /// file as it is now: its blocks stay pinned while the returned value lives, but removing
    /// or replacing the file through another call of this handle is not stopped and leaves the
    /// table describing the old blocks (do not, while kernels use it).
    pub fn gpu_file(&self, name: &str, gpu: &GpuId) -> Result<blockfs_gpu::GpuFile> {
        self.gpu_ready(Serving::Device, None)?;
        let fs = self.mount()?;
        let file = fs.open(name, OpenMode::ReadOnly)?;
        let cuda = gpu_fs::open_gpu(gpu)?;
        let (gfile, _) = self.with_gpu(&cuda, Serving::Device, None, |setup| {
            let files = blockfs_gpu::GpuFiles::new(&setup.queues, Default::default());
            Ok(files.open(&file)?)
        })?;
        Ok(gfile)
    }

    /// Reads file `name` from byte `offset` into `dst`, GPU memory allocated elsewhere (a
    /// framework's tensor; [`gpu_queues::ffi::DeviceMemory::borrowed`]), by GPU-issued reads on
    /// the queues of `dst`'s GPU: `dst.len()` bytes, fewer only where the file ends
    /// ([`gpu_io::read_into`]).
    pub fn read_into(
        &self,
        name: &str,
        offset: u64,
        dst: Arc<gpu_queues::ffi::DeviceMemory>,
        serving: Serving,
        ssd_model: Option<gpu_emu::SsdModel>,
    ) -> Result<GpuIoReport> {
        self.gpu_ready(serving, ssd_model)?;
        let fs = self.mount()?;
        if let Owner::Served(served) = &self.owner
            && crate::cpu_staged::Issuer::for_job(dst.len() as u64, self.opts.served_reads)?
                == crate::cpu_staged::Issuer::Cpu
        {
            return gpu_io::read_into_served(served, self.nsid, &fs, name, offset, &dst);
        }
        let cuda = dst.cuda().clone();
        let (report, _) = self.with_gpu(&cuda, serving, ssd_model, |setup| {
            let src = self.owner.queues();
            let watch = src.watchdog(setup);
            gpu_io::read_into(setup, &fs, name, offset, &dst, ReadPath::Direct, watch)
        })?;
        Ok(report)
    }

    /// Writes `pieces` (host bytes and GPU memory allocated elsewhere, in order) as file
    /// `name` by GPU-issued writes, records the CRC-32C the GPU computed and syncs. An
    /// existing `name` is [`blockfs::Error::AlreadyExists`] unless `force`, which replaces it
    /// by one commit (the old file survives any failure). The writes are issued by the GPU
    /// that holds the GPU pieces (GPU 0 when there are none; pieces on several GPUs are an
    /// [`InvalidArgument`]).
    pub fn save(
        &self,
        name: &str,
        pieces: Vec<Piece>,
        force: bool,
        serving: Serving,
        ssd_model: Option<gpu_emu::SsdModel>,
    ) -> Result<GpuIoReport> {
        self.refuse_read_only("save", name)?;
        if let Owner::Served(served) = &self.owner {
            return self.save_served(served, name, &pieces, force);
        }
        self.gpu_ready(serving, ssd_model)?;
        let cuda = pieces_gpu(&pieces)?;
        let fs = self.mount()?;
        let len = pieces.iter().map(Piece::len).sum();
        let target = gpu_io::prepare_target(&fs, name, len, force)?;
        let written = self
            .with_gpu(&cuda, serving, ssd_model, |setup| {
                let src = self.owner.queues();
                let watch = src.watchdog(setup);
                gpu_io::write_pieces(setup, &target.file, &pieces, None, watch)
            })
            .map(|(r, _)| r);
        gpu_io::finish_target(&fs, target, written)
    }

    /// [`DeviceHandle::save`] on a served device: a write lease from the daemon, the pieces
    /// copied out of GPU memory window by window and written through the lease's table by this
    /// process's served queue pair, then committed with the CRC-32C of the bytes written. The
    /// daemon's controller reaches only memory it lends, so the bytes cross host memory.
    fn save_served(
        &self,
        served: &crate::served::ServedController,
        name: &str,
        pieces: &[Piece],
        force: bool,
    ) -> Result<GpuIoReport> {
        let len: u64 = pieces.iter().map(Piece::len).sum();
        let lease = served.fs_create(self.nsid, name, len, force)?;
        let t = Instant::now();
        let source = gpu_io::PiecesSource::new(pieces);
        let (crc, _) = copy::write_lease(
            self.members[0].as_ref(),
            &lease,
            &source,
            len,
            name,
            &|_| {},
            &AtomicBool::new(false),
        )?;
        lease.commit(len, crc)?;
        let seconds = t.elapsed().as_secs_f64();
        Ok(GpuIoReport {
            name: name.to_owned(),
            bytes: len,
            seconds,
            bytes_per_sec: len as f64 / seconds.max(1e-9),
            staged: true,
            data_path: "GPU memory copied to host memory, then written through the daemon's \
                        write lease by this process's served CPU queue pair"
                .into(),
            transport: served.describe(),
            crc32c: crc.map(|c| format!("{c:08x}")),
        })
    }

    /// Saves `tensors` (in GPU memory allocated elsewhere) as a `.safetensors` file `name`:
    /// the header built on the host ([`safetensors::file_header`], with `metadata`), the data
    /// written by GPU-issued writes as [`DeviceHandle::save`] writes. A tensor whose memory
    /// does not hold its shape's bytes, a name given twice and a tensor named `__metadata__`
    /// are [`InvalidArgument`]s, refused before anything is written.
    pub fn save_safetensors(
        &self,
        name: &str,
        tensors: Vec<SaveTensor>,
        metadata: &BTreeMap<String, String>,
        force: bool,
        serving: Serving,
        ssd_model: Option<gpu_emu::SsdModel>,
    ) -> Result<GpuIoReport> {
        self.refuse_read_only("save_safetensors", name)?;
        let infos: Vec<_> = tensors.iter().map(|t| t.info.clone()).collect();
        let head = safetensors::file_header(name, &infos, metadata)
            .map_err(|e| InvalidArgument(e.to_string()))?;
        let mut pieces = vec![Piece::Host(head)];
        for t in tensors {
            let held = t.mem.as_ref().map_or(0, |m| m.len() as u64);
            if held != t.info.bytes {
                return Err(InvalidArgument(format!(
                    "{}: the tensor's memory holds {held} bytes, its {} {:?} needs {}",
                    t.info.name,
                    t.info.dtype.name(),
                    t.info.shape,
                    t.info.bytes
                ))
                .into());
            }
            pieces.extend(t.mem.map(Piece::Gpu));
        }
        self.save(name, pieces, force, serving, ssd_model)
    }

    /// Loads every tensor of the `.safetensors` file `name` (or of every `.safetensors` file
    /// under the prefix `name`) into one arena in GPU `gpu`'s memory by that GPU's reads on
    /// queues served as `serving` says (with the GPU-resident model, `ssd_model` times its media); also the
    /// load's report (files, tensors, bytes, seconds, data path, how the controller copied).
    /// Every refusal that needs no GPU (names, headers, duplicates) comes before the GPU.
    pub fn load_safetensors(
        &self,
        name: &str,
        gpu: &GpuId,
        serving: Serving,
        ssd_model: Option<gpu_emu::SsdModel>,
    ) -> Result<(safetensors::Loaded, serde_json::Value)> {
        self.load_safetensors_with(name, gpu, serving, ssd_model, |_, _| ())
            .map(|(loaded, report, ())| (loaded, report))
    }

    /// [`DeviceHandle::load_safetensors`], running `while_reading` once the reads are under way
    /// ([`safetensors::load_with`]: what the caller builds on the arena while the GPU fills it).
    pub fn load_safetensors_with<R>(
        &self,
        name: &str,
        gpu: &GpuId,
        serving: Serving,
        ssd_model: Option<gpu_emu::SsdModel>,
        while_reading: impl FnOnce(&Arc<crate::staged::GpuTarget>, &[safetensors::Placed]) -> R,
    ) -> Result<(safetensors::Loaded, serde_json::Value, R)> {
        self.gpu_arguments(serving, ssd_model)?;
        let t0 = Instant::now();
        let fs = self.mount()?;
        let names = safetensors_files(&fs, name)?;
        let files = names
            .iter()
            .map(|n| fs.open(n, OpenMode::ReadOnly))
            .collect::<Result<Vec<_>, _>>()?;
        let headers = names
            .iter()
            .zip(&files)
            .map(|(n, f)| safetensors::read_header(n, f))
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&str> = names.iter().map(String::as_str).collect();
        let (_, total) = safetensors::layout(&refs, &headers)?;
        let arena_len = safetensors::arena_len(total)?;
        if !gpu_queues::cuda_present() {
            bail!(
                Device,
                "no GPU: no CUDA driver on this machine (the headers were checked)"
            );
        }
        let t_headers = t0.elapsed().as_secs_f64();
        let cuda = gpu_fs::open_gpu(gpu)?;
        let t_opened = t0.elapsed().as_secs_f64();
        if let Owner::Served(served) = &self.owner
            && crate::cpu_staged::Issuer::for_job(total, self.opts.served_reads)?
                == crate::cpu_staged::Issuer::Cpu
        {
            // Read by this process's CPU on lent pairs and copied into the arena: no GPU
            // queues (crate::cpu_staged says why).
            let pairs: Vec<_> = files.iter().zip(&headers).collect();
            let (loaded, made, p) =
                safetensors::load_served(served, self.nsid, &cuda, &refs, &pairs, while_reading)?;
            let t_loaded = t0.elapsed().as_secs_f64();
            let report = merged(
                load_report(&names, &loaded),
                serde_json::json!({
                    "transport": format!("served ({}), {} CPU queue pairs", served.describe(), p.queues),
                    "ssd_model": serde_json::Value::Null,
                    "model_cap_bytes_per_sec": serde_json::Value::Null,
                    "data_path": crate::cpu_staged::DATA_PATH,
                    "phases": {
                        "mount_and_headers": t_headers,
                        "gpu_open": t_opened - t_headers,
                        // No GPU queues: the set-up is the daemon's loans; the arena's allocation
                        // and the bounce's registration run beside the first reads.
                        "gpu_setup": p.lend,
                        "gpu_setup_phases": { "lend": p.lend, "register_beside": p.register },
                        "load": t_loaded - t_opened - p.lend,
                        "load_arena": 0.0,
                        "arena_beside_setup": p.arena,
                        "load_tables": loaded.tables_secs,
                        "load_tables_open": loaded.open_secs,
                        "load_reads": loaded.secs,
                        "teardown": 0.0,
                    },
                }),
            );
            return Ok((loaded, report, made));
        }
        let mut t_loaded = 0.0;
        let mut arena_ahead_secs = 0.0;
        let mut setup_phases = serde_json::Map::new();
        // The arena needs only the GPU, not its queues: on the software controller (whose
        // transport maps memory allocated elsewhere) and on a served controller (whose reads
        // are staged into plain GPU memory) it is allocated on a thread of its own while the
        // queues are set up (13.5 GB takes 16-19 ms on the lent H200, about what a fresh
        // process's set-up takes). Another transport stages through memory of its own, so
        // nothing is allocated ahead for it.
        let ahead = self.owner.emu().is_some() || self.is_served();
        std::thread::scope(|scope| {
            let early = ahead.then(|| {
                let cuda = cuda.clone();
                scope.spawn(move || {
                    let t = Instant::now();
                    (
                        DeviceMemory::alloc_uninit(&cuda, arena_len),
                        t.elapsed().as_secs_f64(),
                    )
                })
            });
            // A served load's bounce buffer too: lent by the daemon and registered with CUDA
            // (about 0.3 ms per MiB), beside the set-up rather than after it.
            let early_bounce = match &self.owner {
                Owner::Served(served) => {
                    let cuda = cuda.clone();
                    let len = crate::staged::bounce_bytes(total) as usize;
                    Some(scope.spawn(move || served.lend_buffer(&cuda, len)))
                }
                Owner::Local { .. } => None,
            };
            let (mut out, setup_secs) = self.with_gpu(&cuda, serving, ssd_model, |setup| {
                let pairs: Vec<_> = files.iter().zip(&headers).collect();
                let src = self.owner.queues();
                let watch = src.watchdog(setup);
                for (name, secs) in setup.queues.setup_phases().phases() {
                    setup_phases.insert((*name).to_owned(), serde_json::json!(secs));
                }
                let (arena, early_secs) = match early.map(|h| h.join()) {
                    Some(Ok((Ok(mem), secs))) => (Some(mem), secs),
                    // A failed early allocation (out of memory beside the queues) is retried by
                    // the load, which reports it; a panic there is not this call's to resume.
                    Some(Ok((Err(_), secs))) => (None, secs),
                    Some(Err(_)) | None => (None, 0.0),
                };
                // A failed early loan is retried by the load likewise.
                let bounce = early_bounce
                    .and_then(|h| h.join().ok())
                    .and_then(|r| r.ok());
                let (loaded, made) = safetensors::load_into_with(
                    setup,
                    &refs,
                    &pairs,
                    safetensors::Ahead { arena, bounce },
                    watch,
                    while_reading,
                )?;
                arena_ahead_secs = early_secs;
                t_loaded = t0.elapsed().as_secs_f64();
                let report = merged(
                    load_report(&names, &loaded),
                    serde_json::json!({
                        "transport": setup.transport,
                        "ssd_model": ssd_model.map(|m| m.to_string()),
                        // What the modelled drives can move for large reads (bandwidth, all drives).
                        "model_cap_bytes_per_sec": ssd_model.map(|m| m.bandwidth * m.drives as u64),
                        "data_path": if loaded.arena.buffer().is_some() {
                            gpu_fs::data_path(setup, false)
                        } else {
                            crate::gpu_io::staged_data_path(setup)
                        },
                        "controller_copies": gpu_fs::controller_copies(setup),
                        "controller_threads": gpu_fs::controller_threads(setup, loaded.launched),
                    }),
                );
                Ok::<_, crate::Error>((loaded, report, made))
            })?;
            // Where the call's time went (seconds): mount and headers, opening the GPU (the
            // driver and the primary context, in a fresh process), GPU setup (queues, unless kept
            // from an earlier call, with where their bring-up went; the model's start and media),
            // the load with its arena (of which: allocating the arena, the extent tables, the
            // reads), teardown (the model's; kept queues stay up).
            out.1["phases"] = serde_json::json!({
                "mount_and_headers": t_headers,
                "gpu_open": t_opened - t_headers,
                "gpu_setup": setup_secs,
                "gpu_setup_phases": if setup_secs > 0.0 {
                    serde_json::Value::Object(setup_phases)
                } else {
                    serde_json::Value::Null
                },
                "load": t_loaded - t_opened - setup_secs,
                "load_arena": out.0.arena_secs,
                // The arena allocated beside the set-up (its own time, hidden behind the set-up's).
                "arena_beside_setup": arena_ahead_secs,
                "load_tables": out.0.tables_secs,
                "load_tables_open": out.0.open_secs,
                "load_reads": out.0.secs,
                "teardown": t0.elapsed().as_secs_f64() - t_loaded,
            });
            Ok(out)
        })
    }
}

/// What every load's report says of it: files, tensors, bytes and rate, the arena's size.
fn load_report(names: &[String], loaded: &safetensors::Loaded) -> serde_json::Value {
    serde_json::json!({
        "files": names,
        "tensors": loaded.tensors.len(),
        "bytes": loaded.bytes,
        "seconds": loaded.secs,
        "bytes_per_sec": if loaded.secs > 0.0 { loaded.bytes as f64 / loaded.secs } else { 0.0 },
        "arena_bytes": loaded.arena.len(),
    })
}

/// `base` with `more`'s fields added (both JSON objects).
fn merged(mut base: serde_json::Value, more: serde_json::Value) -> serde_json::Value {
    if let (Some(b), serde_json::Value::Object(m)) = (base.as_object_mut(), more) {
        b.extend(m);
    }
    base
}

/// The GPU of `pieces`' GPU memory (GPU 0 when there is none), refused when they are on
/// several.
fn pieces_gpu(pieces: &[Piece]) -> Result<Arc<Cuda>> {
    let mut gpus = pieces.iter().filter_map(|p| match p {
        Piece::Gpu(m) => Some(m.cuda()),
        Piece::Host(_) => None,
    });
    let Some(first) = gpus.next() else {
        return gpu_fs::open_gpu(&GpuId::default());
    };
    if let Some(other) = gpus.find(|c| c.ordinal() != first.ordinal()) {
        bail!(
            InvalidArgument,
            "the data to save is on GPU {} and GPU {}: one call writes from one GPU",
            first.ordinal(),
            other.ordinal()
        );
    }
    Ok(first.clone())
}

/// The files `name` means: itself if it exists, else every `.safetensors` file under it.
fn safetensors_files(fs: &FileSystem, name: &str) -> Result<Vec<String>> {
    if fs.stat(name).is_ok() {
        return Ok(vec![name.to_owned()]);
    }
    let mut names: Vec<String> = fs
        .list(name)
        .into_iter()
        .map(|st| st.name)
        .filter(|n| n.ends_with(".safetensors"))
        .collect();
    names.sort();
    if names.is_empty() {
        return Err(
            blockfs::Error::NotFound(format!("{name} (nor any {name}*.safetensors)")).into(),
        );
    }
    Ok(names)
}
