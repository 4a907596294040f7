//! `gpunvme fs`: blockfs on a namespace — mkfs, ls, put, get, rm, mv, stat, df, fsck.
//!
//! Every command opens the namespace through [`NvmeBlockDevice`] (several I/O queue pairs, DMA
//! bounce buffers reused across calls) and mounts the file system, except `mkfs` (which makes
//! one) and `fsck` (which checks it unmounted). Changes are synced before the command returns.
//! `put` and `get` are [`gpunvme::copy`]; this module adds the progress bar (on a terminal) and
//! the printing.

use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use anyhow::{Context, Result, bail};
use blockfs::{
    BlockDevice, FileSystem, FsckOptions, MkfsOptions, NvmeBlockDevice, NvmeDeviceOptions,
};
use gpunvme::copy;
use gpunvme::fs_report::{
    DfReport, FsckView, ListReport, MkfsReport, RemoveReport, RenameReport, StatReport, check_data,
};
use gpunvme::gpu::Serving;
use gpunvme::gpu_fs::{self, GpuFsOptions};
use gpunvme::open::Backend;
use gpunvme::units::parse_size;
use gpunvme::volume;

use crate::cli::{Refusal, StdoutError, escape};
use indicatif::{ProgressBar, ProgressStyle};
use nvme::Controller;

/// Files at least this large get a progress bar (on a terminal).
const PROGRESS_MIN: u64 = 64 << 20;

/// blockfs commands.
#[derive(clap::Subcommand, Debug, Clone)]
pub enum FsCommand {
    /// Make a new, empty file system on the namespace (everything on it is lost).
    Mkfs {
        /// File system block size (4k to 1m, a power of two).
        #[arg(long, default_value = "4k", value_parser = parse_size)]
        block_size: u64,
        /// Stripe unit of a volume over several --device (default: the smallest maximum
        /// transfer of the controllers, at most 1m).
        #[arg(long, value_parser = parse_size)]
        stripe: Option<u64>,
        /// Make it even if the namespace holds a blockfs, destroying its files.
        #[arg(long)]
        force: bool,
    },
    /// List files whose names start with PREFIX (all files without one).
    Ls {
        /// Name prefix, e.g. `dataset/` for everything "in" that directory.
        prefix: Option<String>,
    },
    /// Copy a host file into the file system (`-` for standard input: streamed through one
    /// bounded buffer, committed at its end; a read error stores nothing).
    Put {
        /// Host file to read (`-`: standard input; not with --gpu).
        src: PathBuf,
        /// Name in the file system (UTF-8, `/`-separated, up to 1024 bytes).
        name: String,
        /// Replace NAME if it exists. The new version is written first and swapped in by one
        /// commit, so the old one survives any failure (room for both is needed meanwhile).
        #[arg(long)]
        force: bool,
        /// Bytes per file-system call (default: the whole file in one call). The device stays
        /// busy within a call and drains between calls, so smaller values only cost speed.
        #[arg(long, value_parser = parse_size, conflicts_with = "gpu")]
        chunk: Option<u64>,
        /// GPU data path: the file goes into GPU memory, GPU threads write it into a
        /// device-write reservation, the length is committed with the GPU's CRC-32C.
        #[command(flatten)]
        gpu: GpuFsArgs,
    },
    /// Copy a file out of the file system (`-` for standard output). A regular-file destination
    /// is written under a temporary name beside it and renamed into place once complete and
    /// synced: a failed or interrupted get leaves DST as it was.
    Get {
        /// Name in the file system.
        name: String,
        /// Host file to create or truncate (not with --gpu).
        #[arg(required_unless_present = "gpu", conflicts_with = "gpu")]
        dst: Option<PathBuf>,
        /// Bytes per file-system call (default: the whole file in one call, or 16m where the
        /// destination takes no positioned writes, e.g. a pipe). The device stays busy within a
        /// call and drains between calls, so smaller values only cost speed.
        #[arg(long, value_parser = parse_size, conflicts_with = "gpu")]
        chunk: Option<u64>,
        /// GPU data path: load the file into GPU memory with GPU-issued reads, print GB/s, the
        /// path that ran and a CRC-32C computed on the GPU (checked against the host's).
        #[command(flatten)]
        gpu: GpuFsArgs,
    },
    /// Remove a file.
    Rm {
        /// Name in the file system.
        name: String,
    },
    /// Rename a file (fails if NEW exists, unless --force).
    Mv {
        /// Current name.
        old: String,
        /// New name.
        new: String,
        /// Replace NEW if it exists (the removal and the rename are one commit).
        #[arg(long)]
        force: bool,
    },
    /// Show a file's size, allocation, extents and generation.
    Stat {
        /// Name in the file system.
        name: String,
    },
    /// Show space usage.
    Df,
    /// Check the file system (unmounted); with --repair, fix what can be fixed.
    Fsck {
        /// Rebuild a consistent file system from the best surviving generation.
        #[arg(long)]
        repair: bool,
        /// Also read every file with a recorded checksum and compare (reads all file data).
        #[arg(long)]
        data: bool,
    },
}

/// The GPU options of `fs get` and `fs put`.
#[derive(clap::Args, Debug, Clone)]
pub struct GpuFsArgs {
    /// Move the data between the file and GPU memory with commands GPU threads issue on NVMe
    /// queues in GPU memory (needs an NVIDIA GPU).
    #[arg(long)]
    pub gpu: bool,
    /// Who serves the GPU queues: `emu`, the software controller's threads, or `gpu`, the
    /// GPU-resident controller model (with --media).
    #[arg(long, value_enum, default_value = "emu", requires = "gpu")]
    pub controller: FsController,
    /// Media of the GPU-resident controller: `host` (the image's page-cache pages, read over
    /// PCIe by the controller kernel; writable only for an image on tmpfs) or `hbm` (the image
    /// copied into GPU memory when the model starts, written back when it stops: the load
    /// itself is then not what is timed).
    #[arg(long, value_enum, default_value = "host", requires = "gpu")]
    pub media: FsMedia,
    /// SMs reserved for the controller's kernels.
    #[arg(long, default_value_t = 8, requires = "gpu")]
    pub controller_sms: u32,
    /// SSD timing model of the GPU-resident controller (`--controller gpu`), as for `perf`:
    /// e.g. `read_us=80,iops=2500000,bw=14GB/s,drives=4` (the modelled drives' cap is then
    /// drives x bw).
    #[arg(long, requires = "gpu", value_parser = crate::parse_ssd_model)]
    pub ssd_model: Option<gpunvme::gpu_emu::SsdModel>,
    /// GPU queue pairs (default: every one the controller grants beyond the file system's;
    /// on the software controller, a multiple of its threads).
    #[arg(long, requires = "gpu")]
    pub gpu_queues: Option<u16>,
    /// Which GPU: a CUDA ordinal (0, 1, ...), a UUID (GPU-..., as `nvidia-smi -L` prints it;
    /// a unique leading part will do) or a PCI address (0000:3b:00.0).
    #[arg(long, default_value = "0", value_parser = parse_gpu_id, requires = "gpu")]
    pub gpu_id: gpunvme::gpu_queues::GpuId,
    /// Entries per GPU ring (rounded down to a power of two, at most the controller's
    /// maximum; each entry holds a slot buffer of one maximum transfer in GPU memory).
    #[arg(long, default_value_t = gpunvme::gpu_fs::FILE_RING_DEPTH, requires = "gpu")]
    pub gpu_depth: u32,
}

/// `--gpu-id`'s value (gpu_queues::gpus: ordinal, UUID or PCI address).
pub(crate) fn parse_gpu_id(s: &str) -> Result<gpunvme::gpu_queues::GpuId, String> {
    s.parse()
        .map_err(|e: gpunvme::gpu_queues::GpuError| e.to_string())
}

/// `--media` of the GPU file commands.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsMedia {
    /// The image file's pages, mapped and registered with CUDA.
    Host,
    /// The image in GPU memory.
    Hbm,
}

/// `--controller` of the GPU file commands.
#[derive(clap::ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
pub enum FsController {
    /// The software controller's threads (or a real SSD through VFIO).
    Emu,
    /// The GPU-resident controller model.
    Gpu,
}

impl GpuFsArgs {
    /// Refuses GPU options given without `--gpu` (clap's `requires` does not catch them next
    /// to a flag that defaults to false): an option left at its default cannot be told from
    /// one not given, and is harmless.
    fn check(&self) -> Result<()> {
        if self.gpu {
            return Ok(());
        }
        let given = [
            ("--ssd-model", self.ssd_model.is_some()),
            ("--gpu-queues", self.gpu_queues.is_some()),
            ("--controller", self.controller != FsController::Emu),
            ("--media", self.media != FsMedia::Host),
            ("--controller-sms", self.controller_sms != 8),
            (
                "--gpu-depth",
                self.gpu_depth != gpunvme::gpu_fs::FILE_RING_DEPTH,
            ),
            (
                "--gpu-id",
                self.gpu_id != gpunvme::gpu_queues::GpuId::default(),
            ),
        ];
        if let Some((flag, _)) = given.iter().find(|(_, g)| *g) {
            bail!("{flag} is an option of --gpu: add --gpu, or leave it out");
        }
        Ok(())
    }

    fn options(&self) -> GpuFsOptions {
        GpuFsOptions {
            serving: match self.controller {
                FsController::Emu => Serving::Device,
                FsController::Gpu => Serving::Model(match self.media {
                    FsMedia::Host => gpunvme::gpu_emu::MediaKind::Host,
                    FsMedia::Hbm => gpunvme::gpu_emu::MediaKind::Hbm,
                }),
            },
            queues: self.gpu_queues,
            controller_sms: self.controller_sms,
            ssd_model: self.ssd_model,
            depth: Some(self.gpu_depth),
            gpu: self.gpu_id.clone(),
            ..GpuFsOptions::default()
        }
    }
}

impl FsCommand {
    /// The host file the command writes, if any.
    pub fn output_path(&self) -> Option<&Path> {
        match self {
            FsCommand::Get { dst, .. } => dst.as_deref(),
            _ => None,
        }
    }

    /// Whether the command moves data with GPU-issued commands (`fs get/put --gpu`).
    pub fn on_gpu(&self) -> bool {
        match self {
            FsCommand::Get { gpu, .. } | FsCommand::Put { gpu, .. } => gpu.gpu,
            _ => false,
        }
    }

    /// Whether the command only reads the file system (and may share the device with other
    /// readers).
    pub fn is_read_only(&self) -> bool {
        match self {
            FsCommand::Ls { .. }
            | FsCommand::Get { .. }
            | FsCommand::Stat { .. }
            | FsCommand::Df => true,
            FsCommand::Fsck { repair, .. } => !repair,
            FsCommand::Mkfs { .. }
            | FsCommand::Put { .. }
            | FsCommand::Rm { .. }
            | FsCommand::Mv { .. } => false,
        }
    }
}

/// [`GpuFsArgs::check`] for the commands that have GPU options.
fn check_gpu_args(cmd: &FsCommand) -> Result<()> {
    if let FsCommand::Put { src, gpu, .. } = cmd
        && gpu.gpu
        && src == Path::new("-")
    {
        bail!("fs put --gpu reads a regular file; standard input (`-`) goes without --gpu");
    }
    match cmd {
        FsCommand::Get { gpu, .. } | FsCommand::Put { gpu, .. } => gpu.check(),
        _ => Ok(()),
    }
}

/// Runs a blockfs command on namespace `nsid` of `ctrl`.
pub fn run(
    ctrl: &Controller,
    backend: &Backend,
    nsid: u32,
    cmd: FsCommand,
    json: bool,
) -> Result<()> {
    check_gpu_args(&cmd)?;
    // With --gpu the file system's own device takes one queue pair (metadata and the host's
    // checksum); the GPU queues take the rest.
    let gpu = matches!(&cmd, FsCommand::Get { gpu, .. } | FsCommand::Put { gpu, .. } if gpu.gpu);
    let dev_opts = NvmeDeviceOptions {
        queues: if gpu {
            GpuFsOptions::default().cpu_queues as usize
        } else {
            NvmeDeviceOptions::default().queues
        },
        ..NvmeDeviceOptions::default()
    };
    let dev = Arc::new(
        NvmeBlockDevice::new(ctrl, nsid, &dev_opts)
            .with_context(|| format!("opening namespace {nsid} for blockfs"))?,
    );
    if let FsCommand::Mkfs {
        stripe: Some(_), ..
    } = &cmd
    {
        bail!("--stripe is for a volume over several --device");
    }
    // A member of a volume alone: mkfs would break the volume, anything else finds no blockfs.
    if !matches!(&cmd, FsCommand::Mkfs { force: true, .. }) {
        volume::refuse_member(dev.as_ref(), &format!("namespace {nsid}"))?;
    }
    run_on(
        dev,
        Some(gpu_fs::QueueSource::Owned(ctrl, backend)),
        nsid,
        cmd,
        json,
        None,
    )
}

/// Runs a blockfs command on namespace `nsid` of a controller a `gpunvme serve` daemon owns
/// (`--device served:SOCKET[#NAME]`): reads through a served queue pair (a read-only mount;
/// the daemon writes the metadata), `get --gpu` on GPU queues the daemon lends; `put` of a
/// host file, `rm` and `mv` through the daemon's write leases and renames
/// ([`gpunvme::DeviceHandle`]). mkfs and repairs are the operator's, where the device is owned.
pub fn run_served(
    spec: &gpunvme::served::ServedSpec,
    nsid: u32,
    cmd: FsCommand,
    json: bool,
) -> Result<()> {
    check_gpu_args(&cmd)?;
    let handle = || {
        gpunvme::handle::DeviceHandle::open(
            Some(&spec.to_string()),
            gpunvme::open::OpenOptions::default(),
            nsid,
        )
    };
    match cmd {
        FsCommand::Put { gpu, .. } if gpu.gpu => {
            return Err(Refusal(format!(
                "fs put --gpu on {spec}: a served put's bytes cross host memory either way (the \
                 daemon's controller reaches only what it lends); put the file without --gpu"
            ))
            .into());
        }
        FsCommand::Put {
            src,
            name,
            force,
            chunk,
            ..
        } if src == Path::new("-") => {
            let bar = progress(0, json, "put");
            let report = handle()?.put_stream(
                &mut std::io::stdin().lock(),
                "standard input",
                &name,
                force,
                chunk,
                &|k| bar.inc(k),
                &std::sync::atomic::AtomicBool::new(false),
            )?;
            bar.finish_and_clear();
            return print_report(&report, json, false);
        }
        FsCommand::Put {
            src, name, force, ..
        } => {
            let report = handle()?.put(&src, &name, force)?;
            return print_report(&report, json, false);
        }
        FsCommand::Rm { name } => {
            let report = handle()?.rm(&name)?;
            return print_report(&report, json, false);
        }
        FsCommand::Mv { old, new, force } => {
            let report = handle()?.mv(&old, &new, force)?;
            return print_report(&report, json, false);
        }
        ref c if !c.is_read_only() => {
            return Err(Refusal(format!(
                "{spec}: mkfs and fsck --repair are the operator's (the daemon's clients share \
                 the file system); run them where the device is owned"
            ))
            .into());
        }
        _ => {}
    }
    let client = format!("gpunvme fs (pid {})", std::process::id());
    let served = gpunvme::served::ServedController::open(spec, &client)?;
    let dev = Arc::new(served.block_device(nsid)?);
    volume::refuse_member(dev.as_ref(), &format!("namespace {nsid}"))?;
    run_on(
        dev,
        Some(gpu_fs::QueueSource::Served(&served)),
        nsid,
        cmd,
        json,
        None,
    )
}

/// Runs a blockfs command on a striped volume over namespace `nsid` of each of `ctrls` (in
/// order; `specs` name them in errors): `mkfs` makes the volume (its labels) and the file
/// system, every other command assembles it first, refusing a wrong set of members.
pub fn run_volume(
    ctrls: &[Controller],
    backends: &[Backend],
    specs: &[String],
    nsid: u32,
    cmd: FsCommand,
    json: bool,
) -> Result<()> {
    check_gpu_args(&cmd)?;
    let refs: Vec<&Controller> = ctrls.iter().collect();
    let members = volume::members(&refs, specs, nsid)?;
    let mut label_repair = None;
    let volume = if let FsCommand::Mkfs { force, stripe, .. } = &cmd {
        let stripe = stripe.unwrap_or_else(|| volume::default_stripe(&refs));
        volume::make(members, specs, stripe, *force)?
    } else if let FsCommand::Fsck { repair: true, .. } = &cmd {
        let (v, line) = volume::assemble_repairing(members, specs)?;
        label_repair = line;
        v
    } else {
        volume::assemble(members, specs)?
    };
    let volume = Arc::new(volume);
    // The members' block devices hold their queue pairs (volume::members); the GPU queues
    // take the rest of each controller's.
    let gpu_opts = |gpu: &GpuFsArgs| GpuFsOptions {
        cpu_queues: u16::try_from(NvmeDeviceOptions::default().queues).unwrap_or(u16::MAX),
        ..gpu.options()
    };
    let b: Vec<&Backend> = backends.iter().collect();
    let mount = || FileSystem::mount(volume.clone()).context("mounting blockfs on the volume");
    match &cmd {
        FsCommand::Get { name, gpu, .. } if gpu.gpu => {
            let fs = mount()?;
            let report = gpu_fs::get_volume(&refs, &b, &volume, &fs, name, &gpu_opts(gpu))?;
            return print_report(&report, json, false);
        }
        FsCommand::Put {
            src,
            name,
            force,
            gpu,
            ..
        } if gpu.gpu => {
            let fs = mount()?;
            let report =
                gpu_fs::put_volume(&refs, &b, &volume, &fs, src, name, *force, &gpu_opts(gpu))?;
            return print_report(&report, json, false);
        }
        _ => {}
    }
    run_on(volume, None, nsid, cmd, json, label_repair)
}

/// Runs a blockfs command on `dev`; GPU commands need the controller (`gpu`).
fn run_on(
    dev: Arc<dyn BlockDevice>,
    gpu_ctrl: Option<gpu_fs::QueueSource<'_>>,
    nsid: u32,
    cmd: FsCommand,
    json: bool,
    label_repair: Option<String>,
) -> Result<()> {
    let mount = || match FileSystem::mount(dev.clone()) {
        Ok(fs) => Ok(fs),
        Err(e @ blockfs::Error::NotBlockfs(_)) => Err(anyhow::Error::new(e).context(format!(
            "namespace {nsid} holds no blockfs (make one with `gpunvme fs mkfs`)"
        ))),
        Err(e) => Err(anyhow::Error::new(e).context(format!(
            "mounting blockfs on namespace {nsid} (`gpunvme fs fsck` says more)"
        ))),
    };
    match cmd {
        FsCommand::Mkfs {
            block_size, force, ..
        } => {
            let opts = MkfsOptions {
                block_size: u32::try_from(block_size).context("--block-size is too large")?,
                ..MkfsOptions::default()
            };
            if !force {
                let found =
                    FileSystem::probe(dev.clone()).context("looking for a file system to keep")?;
                if found.is_blockfs() {
                    return Err(Refusal(format!(
                        "namespace {nsid} holds {found}; mkfs would destroy it (add --force to do so)"
                    ))
                    .into());
                }
            }
            let fs = FileSystem::mkfs(dev.clone(), &opts).context("mkfs")?;
            print_report(&MkfsReport::of(&fs), json, false)
        }
        FsCommand::Ls { prefix } => {
            let fs = mount()?;
            print_report(
                &ListReport::of(&fs, prefix.as_deref().unwrap_or("")),
                json,
                true,
            )
        }
        FsCommand::Put {
            src,
            name,
            force,
            gpu,
            ..
        } if gpu.gpu => {
            let Some(gpu_fs::QueueSource::Owned(ctrl, backend)) = gpu_ctrl else {
                bail!("fs put --gpu needs one controller this process owns");
            };
            let fs = mount()?;
            let report = gpu_fs::put(ctrl, backend, &fs, &src, &name, force, &gpu.options())?;
            print_report(&report, json, false)
        }
        FsCommand::Get { name, gpu, .. } if gpu.gpu => {
            let src = gpu_ctrl.context("--gpu needs one controller")?;
            let fs = mount()?;
            let report = gpu_fs::get(src, &fs, &name, &gpu.options())?;
            print_report(&report, json, false)
        }
        FsCommand::Put {
            src,
            name,
            force,
            chunk,
            ..
        } if src == Path::new("-") => {
            let fs = mount()?;
            let bar = progress(0, json, "put");
            let report = copy::put_stream(
                &fs,
                &mut std::io::stdin().lock(),
                "standard input",
                &name,
                &copy::PutOptions { force, chunk },
                &|k| bar.inc(k),
                &std::sync::atomic::AtomicBool::new(false),
            )?;
            bar.finish_and_clear();
            print_report(&report, json, false)
        }
        FsCommand::Put {
            src,
            name,
            force,
            chunk,
            ..
        } => {
            copy::check_chunk(chunk)?;
            let fs = mount()?;
            let len = std::fs::metadata(&src).map_or(0, |m| m.len());
            let bar = progress(len, json, "put");
            let report = copy::put(&fs, &src, &name, &copy::PutOptions { force, chunk }, &|k| {
                bar.inc(k)
            })?;
            bar.finish_and_clear();
            print_report(&report, json, false)
        }
        FsCommand::Get {
            name, dst, chunk, ..
        } => {
            let dst = dst.context("a destination file (or --gpu)")?;
            copy::check_chunk(chunk)?;
            let fs = mount()?;
            let to_stdout = dst == Path::new("-");
            let len = fs.stat(&name).map_or(0, |st| st.size);
            let bar = progress(len, json || to_stdout, "get");
            let dest = if to_stdout {
                copy::Destination::Stream(Box::new(StdoutWriter(std::io::stdout())))
            } else {
                copy::Destination::Path(&dst)
            };
            let report = copy::get(&fs, &name, dest, &copy::GetOptions { chunk }, &|k| {
                bar.inc(k)
            })?;
            bar.finish_and_clear();
            if to_stdout {
                Ok(())
            } else {
                print_report(&report, json, false)
            }
        }
        FsCommand::Rm { name } => {
            let fs = mount()?;
            fs.remove(&name)?;
            fs.sync()?;
            print_report(&RemoveReport { removed: name }, json, false)
        }
        FsCommand::Mv { old, new, force } => {
            let fs = mount()?;
            if force {
                fs.rename_replace(&old, &new)?;
            } else {
                fs.rename(&old, &new)?;
            }
            fs.sync()?;
            print_report(&RenameReport { from: old, to: new }, json, false)
        }
        FsCommand::Stat { name } => {
            let fs = mount()?;
            print_report(&StatReport::of(&fs, &name)?, json, true)
        }
        FsCommand::Df => {
            let fs = mount()?;
            print_report(&DfReport::of(&fs), json, true)
        }
        FsCommand::Fsck { repair, data } => {
            let mut report = blockfs::fsck(dev.clone(), &FsckOptions { repair })?;
            // A volume label rebuilt before the check is the first repair.
            report.repairs.splice(0..0, label_repair);
            let data_report = if data && report.is_consistent() {
                Some(check_data(&FileSystem::mount(dev.clone())?)?)
            } else {
                None
            };
            print_report(
                &FsckView {
                    report: &report,
                    repair,
                    data: data_report.as_ref(),
                },
                json,
                true,
            )?;
            if !report.is_consistent() {
                bail!(
                    "the file system is inconsistent{}",
                    if repair {
                        ""
                    } else {
                        "; run `gpunvme fs fsck --repair`"
                    }
                );
            }
            if let Some(d) = &data_report
                && !d.mismatched.is_empty()
            {
                return Err(blockfs::Error::Corrupt {
                    what: format!(
                        "file data of {}",
                        d.mismatched
                            .iter()
                            .map(|n| escape(n).into_owned())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    detail: "the bytes do not match the CRC-32C recorded when they were written"
                        .into(),
                }
                .into());
            }
            Ok(())
        }
    }
}

/// What namespace `nsid` of `ctrl` holds that writing its LBAs would destroy: a striped
/// volume's member label (whole or damaged), a blockfs (whole or damaged), or nothing
/// (`None`). Reads only.
pub fn holds(ctrl: &Controller, nsid: u32) -> Result<Option<String>> {
    let dev = Arc::new(
        NvmeBlockDevice::new(ctrl, nsid, &NvmeDeviceOptions::default())
            .with_context(|| format!("opening namespace {nsid}"))?,
    );
    holds_on(dev, nsid)
}

/// [`holds`] for namespace `nsid` reached as `dev` (a served controller's, say).
pub fn holds_on(dev: Arc<dyn BlockDevice>, nsid: u32) -> Result<Option<String>> {
    let lba = dev.lba_size() as usize;
    let mut label = vec![0u8; (blockfs::volume::LABEL_BYTES as usize).max(lba)];
    dev.read(&mut [blockfs::device::ReadReq {
        lba: 0,
        buf: &mut label,
    }])
    .with_context(|| format!("looking for a volume label on namespace {nsid}"))?;
    match blockfs::VolumeLabel::decode(&label) {
        Ok(Some(l)) => {
            return Ok(Some(format!(
                "member {} of a {}-member striped volume",
                l.member, l.members
            )));
        }
        Err(why) => return Ok(Some(format!("a damaged striped-volume label ({why})"))),
        Ok(None) => {}
    }
    let found = FileSystem::probe(dev)
        .with_context(|| format!("looking for a blockfs on namespace {nsid}"))?;
    Ok(found.is_blockfs().then(|| found.to_string()))
}

/// Refuses ([`Refusal`]) a command that writes raw LBAs of namespace `nsid` (`what`: the
/// command, e.g. `write`) when the namespace holds a blockfs or a volume member
/// ([`holds`]), unless `force`; `device` names the device when there are several. The one
/// check behind every raw-LBA writer of the CLI (docs/cli.md, "Destructive commands").
pub fn refuse_raw_write(
    ctrl: &Controller,
    nsid: u32,
    what: &str,
    force: bool,
    device: Option<&str>,
) -> Result<()> {
    if force {
        return Ok(());
    }
    if let Some(found) = holds(ctrl, nsid)? {
        return Err(Refusal(format!(
            "{}namespace {nsid} holds {found}; {what} would overwrite it (use another --device, \
             or --force to destroy it)",
            device.map(|d| format!("{d}: ")).unwrap_or_default(),
        ))
        .into());
    }
    Ok(())
}

fn progress(len: u64, json: bool, verb: &str) -> ProgressBar {
    if json || len < PROGRESS_MIN {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{verb} [{{bar:40}}] {{bytes}}/{{total_bytes}} {{binary_bytes_per_sec}} eta {{eta}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar
}

/// Standard output whose write errors are [`StdoutError`]s (a closed pipe ends `get -`
/// quietly).
struct StdoutWriter(std::io::Stdout);

impl Write for StdoutWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf).map_err(wrap_stdout)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush().map_err(wrap_stdout)
    }
}

/// An I/O error that carries a [`StdoutError`], so the error chain says where it happened.
fn wrap_stdout(e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), StdoutError(e))
}

/// Prints a report as text (its `Display`) or JSON (its `Serialize`; `pretty` for the longer
/// ones).
fn print_report<R: serde::Serialize + std::fmt::Display>(
    report: &R,
    json: bool,
    pretty: bool,
) -> Result<()> {
    if json && pretty {
        outln!("{}", serde_json::to_string_pretty(report)?);
    } else if json {
        outln!("{}", serde_json::to_string(report)?);
    } else {
        outln!("{report}");
    }
    Ok(())
}
