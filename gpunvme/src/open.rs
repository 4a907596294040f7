//! Choosing the device a command runs on: a PCI address (VFIO), a vfio-user socket (a controller
//! served by another process, e.g. SPDK's NVMe-oF target) or an image file (software
//! controller), and bringing its controller up.

use std::path::{Path, PathBuf};
use std::sync::Arc;

use crate::error::{Context, Result, bail};
use nvme::{Controller, ControllerOptions, Device};
use nvme_emu::{EmuConfig, EmuDevice};

/// The image the software controller uses when no `--device` is given.
pub const DEFAULT_IMAGE: &str = "gpunvme.img";

/// The image `perf` uses when no `--device` is given: its own scratch space, since a write
/// pattern or a `--verify` prefill overwrites whatever the image holds.
pub const PERF_DEFAULT_IMAGE: &str = "gpunvme-perf.img";

/// Size of the default image when it is created on first use (sparse).
pub const DEFAULT_IMAGE_BYTES: u64 = 1 << 30;

/// The image to open does not exist ([`crate::error::ErrorKind::NotFound`]). The library
/// says only that; each surface names its own way of making one in `hint` (the CLI its
/// command, Python and C their calls), so nobody is told about another surface's flags.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}{}", self.what(), self.hint.as_ref().map(|h| format!(" ({h})")).unwrap_or_default())]
pub struct MissingImage {
    /// The image's path.
    pub path: PathBuf,
    /// Whether it is the default image (no device named), which a writing open creates: only a
    /// read-only open finds it missing.
    pub default: bool,
    /// How to make it, in the caller's terms; none from the library.
    pub hint: Option<String>,
}

impl MissingImage {
    fn what(&self) -> String {
        if self.default {
            format!(
                "{} does not exist: there is nothing to read yet",
                self.path.display()
            )
        } else {
            format!("image {} does not exist", self.path.display())
        }
    }

    /// Sets the hint of the [`MissingImage`] in `e`'s chain, if there is one, to what
    /// `hint(missing)` says; `e` otherwise unchanged.
    pub fn explain(
        mut e: crate::Error,
        hint: impl FnOnce(&MissingImage) -> String,
    ) -> crate::Error {
        if let Some(m) = e.cause_mut::<MissingImage>() {
            let h = hint(m);
            m.hint = Some(h);
        }
        e
    }
}

/// A write to an image failed on the host: the software controller could only complete the
/// command with Write Fault, and this names the host's reason. When the host file system holding
/// the image is full (ENOSPC, or EDQUOT) it is [`crate::error::ErrorKind::NoSpace`],
/// otherwise [`crate::error::ErrorKind::Io`].
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{}", self.describe())]
pub struct HostWriteFailed {
    /// The image file.
    pub path: PathBuf,
    /// Whether the host file system was full.
    pub no_space: bool,
    /// The host's error, in words.
    pub host: String,
    /// The error the command met (the device's status and what was being done).
    pub device: String,
}

impl HostWriteFailed {
    fn describe(&self) -> String {
        if self.no_space {
            format!(
                "no space left on the host file system holding {} (ENOSPC: {}); the image is \
                 sparse and takes host space as blocks are written: free space there or move \
                 the image (the device reported: {})",
                self.path.display(),
                self.host,
                self.device
            )
        } else {
            format!(
                "the host failed a write to the image {} ({}); the device reported: {}",
                self.path.display(),
                self.host,
                self.device
            )
        }
    }
}

/// `e`, named for its cause when a software controller among `backends` saw the host refuse a
/// write to its image since the last call ([`HostWriteFailed`]); otherwise `e` unchanged.
pub fn explain_host_error<'a>(
    e: crate::Error,
    backends: impl IntoIterator<Item = &'a Backend>,
) -> crate::Error {
    let at_device = e.is::<nvme::Error>();
    match host_write_failure(backends, at_device, || e.to_string()) {
        Some(h) => h.into(),
        None => e,
    }
}

/// The [`HostWriteFailed`] that explains an error (`at_device`: whether the error is a command
/// the device failed; `describe`: the error in words), if a software controller among
/// `backends` saw the host refuse a write to its image since the last call. For callers with
/// their own error type (the CLI's); [`explain_host_error`] for an [`crate::Error`].
pub fn host_write_failure<'a>(
    backends: impl IntoIterator<Item = &'a Backend>,
    at_device: bool,
    describe: impl FnOnce() -> String,
) -> Option<HostWriteFailed> {
    // Taken (cleared) whatever the error is, so a refusal is never blamed on a later error.
    let found = backends
        .into_iter()
        .filter_map(Backend::emu)
        .find_map(|emu| emu.take_host_write_error());
    // Only a command that failed at the device is what the host's refusal explains.
    match found {
        Some(h) if at_device => Some(HostWriteFailed {
            no_space: h.is_no_space(),
            path: h.path,
            host: h.message,
            device: describe(),
        }),
        _ => None,
    }
}

/// The image file exists and replacing it was not asked for
/// ([`crate::error::ErrorKind::Exists`]). Each surface says how to force it in `hint`.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "{} exists already: making a new image there would discard its contents{}",
    path.display(),
    hint.as_ref().map(|h| format!(" ({h})")).unwrap_or_default()
)]
pub struct ImageExists {
    /// The file.
    pub path: PathBuf,
    /// How to replace it anyway, in the caller's terms; none from the library.
    pub hint: Option<String>,
}

impl ImageExists {
    /// The error for `path`, with no hint.
    pub fn new(path: &Path) -> Self {
        Self {
            path: path.to_owned(),
            hint: None,
        }
    }

    /// Sets the hint of the [`ImageExists`] in `e`'s chain, if there is one.
    pub fn explain(mut e: crate::Error, hint: &str) -> crate::Error {
        if let Some(x) = e.cause_mut::<ImageExists>() {
            x.hint = Some(hint.to_owned());
        }
        e
    }
}

/// What `--device` named.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum DeviceSpec {
    /// A PCI function bound to vfio-pci.
    Pci(vfio::PciAddress),
    /// A controller served over vfio-user at this socket (`vfio-user:PATH`).
    VfioUser(PathBuf),
    /// An NVM subsystem over NVMe/TCP (`nvme-tcp://HOST:PORT/NQN`), served through the software
    /// controller in front of it ([`crate::fabric`]).
    NvmeTcp(crate::fabric::TcpSpec),
    /// A controller a `gpunvme serve` daemon owns (`served:SOCKET`, or `served:SOCKET#NAME`
    /// where it serves several): used through queue pairs it lends ([`crate::served`]), never
    /// brought up here. Only [`crate::handle::DeviceHandle`] opens one.
    Served(crate::served::ServedSpec),
    /// An image file served by the software controller.
    Image(PathBuf),
    /// No `--device`: the software controller over [`OpenOptions::default_image`]
    /// (`./gpunvme.img`, or `./gpunvme-perf.img` for `perf`), created on first use by a command
    /// that writes ([`OpenOptions::read_only`] false).
    DefaultImage,
}

impl DeviceSpec {
    /// Interprets the `--device` argument: anything shaped like a PCI address is one (and must
    /// parse as one), everything else is an image path.
    pub fn parse(arg: Option<&str>) -> Result<Self> {
        match arg {
            None => Ok(Self::DefaultImage),
            Some(s) if s.starts_with(crate::fabric::SCHEME) => {
                let spec = crate::fabric::TcpSpec::parse(s)?;
                if spec.subnqn.is_none() {
                    bail!(
                        InvalidArgument,
                        "device {s}: name the subsystem (nvme-tcp://HOST:PORT/NQN); \
                         `gpunvme discover {s}` lists a target's subsystems"
                    );
                }
                Ok(Self::NvmeTcp(spec))
            }
            Some(s) if s.starts_with(crate::served::SPEC_PREFIX) => {
                Ok(Self::Served(crate::served::ServedSpec::parse(s)?))
            }
            Some(s) if s.starts_with(vfio::user::SPEC_PREFIX) => {
                let path = &s[vfio::user::SPEC_PREFIX.len()..];
                if path.is_empty() {
                    bail!(
                        InvalidArgument,
                        "device {s}: give the server's socket, e.g. vfio-user:/tmp/spdk/malloc512/cntrl"
                    );
                }
                Ok(Self::VfioUser(PathBuf::from(path)))
            }
            // A PCI address, or something meant as one (a colon, no slash, no such file): parse
            // it as one so a typo gets a PCI address error rather than "no such image".
            Some(s)
                if vfio::looks_like_pci_address(s)
                    || (s.contains(':') && !s.contains('/') && !Path::new(s).exists()) =>
            {
                Ok(Self::Pci(s.parse().map_err(|e| {
                    crate::Error::invalid(format!("device {s}: {e}"))
                })?))
            }
            Some(s) => Ok(Self::Image(PathBuf::from(s))),
        }
    }

    /// The image file the software controller serves, if it is one.
    pub fn image_path<'a>(&'a self, opts: &'a OpenOptions) -> Option<&'a Path> {
        match self {
            Self::Pci(_) | Self::VfioUser(_) | Self::NvmeTcp(_) | Self::Served(_) => None,
            Self::Image(p) => Some(p),
            Self::DefaultImage => Some(&opts.default_image),
        }
    }

    /// Whether `path` names the device's own image file (the same file, through any name: a
    /// link, a relative path). A command writing its output there would overwrite the device
    /// under itself.
    pub fn is_own_image(&self, opts: &OpenOptions, path: &Path) -> bool {
        use std::os::unix::fs::MetadataExt;
        let (Some(image), Ok(out)) = (self.image_path(opts), std::fs::metadata(path)) else {
            return false;
        };
        std::fs::metadata(image).is_ok_and(|m| m.dev() == out.dev() && m.ino() == out.ino())
    }
}

/// How to open a device.
#[derive(Debug, Clone)]
pub struct OpenOptions {
    /// Logical block size of the namespace the software controller makes of an image (512 or
    /// 4096). Images are raw, like QEMU's `format=raw`, so this is not stored in them.
    pub lba_size: u32,
    /// Threads of the software controller (`EmuConfig::controller_threads`; 0: automatic).
    /// Ignored for a PCI device.
    pub controller_threads: usize,
    /// I/O queue pairs the software controller grants (`EmuConfig::max_io_queue_pairs`).
    /// Ignored for a PCI device.
    pub controller_queue_pairs: u16,
    /// Open an image read-only, under a shared lock, with its namespace write protected: for
    /// commands that only read, so several can run on one image at once and images the user
    /// cannot write still serve them. Otherwise the image is locked exclusively and a second
    /// process is refused ([`nvme_emu::EmuError::ImageBusy`]). Ignored for a PCI device, whose
    /// VFIO group is exclusive to one process anyway.
    pub read_only: bool,
    /// The image used without `--device` ([`DeviceSpec::DefaultImage`]).
    pub default_image: PathBuf,
    /// Driver options (queue depths, timeouts).
    pub controller: ControllerOptions,
    /// Who issues a served device's loads and `read_into` reads (ignored for a device this
    /// process owns).
    pub served_reads: ServedReads,
}

/// Who issues a served device's loads and `read_into` reads: this process's CPU on lent queue
/// pairs, or GPU threads on served GPU queues (`gpunvme::cpu_staged` says how each reads).
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ServedReads {
    /// As `GPUNVME_SERVED_READS` says, else by the job's size.
    #[default]
    Auto,
    /// This process's CPU, whatever the setting.
    Cpu,
    /// GPU threads, whatever the setting.
    Gpu,
}

impl std::str::FromStr for ServedReads {
    type Err = crate::error::Error;

    fn from_str(s: &str) -> Result<Self> {
        match s {
            "auto" => Ok(Self::Auto),
            "cpu" => Ok(Self::Cpu),
            "gpu" => Ok(Self::Gpu),
            other => Err(crate::error::Error::invalid(format!(
                "served reads {other:?}: expected auto, cpu or gpu"
            ))),
        }
    }
}

impl Default for OpenOptions {
    fn default() -> Self {
        Self {
            lba_size: 512,
            controller_threads: 0,
            controller_queue_pairs: EmuConfig::default().max_io_queue_pairs,
            read_only: false,
            default_image: PathBuf::from(DEFAULT_IMAGE),
            controller: ControllerOptions::default(),
            served_reads: ServedReads::Auto,
        }
    }
}

/// What is behind the driver's device handle, for code that needs more than the driver's seam
/// (GPU queues register GPU memory and doorbells with the software controller, or map BAR0 and
/// GPU memory through VFIO).
#[derive(Clone)]
pub enum Backend {
    /// The software controller.
    Software(Arc<EmuDevice>),
    /// A controller bound to vfio-pci.
    Vfio(Arc<vfio::VfioNvme>),
    /// A controller served over vfio-user.
    VfioUser(Arc<vfio::VfioUserNvme>),
}

impl Backend {
    /// The software controller's handle, when that is what the device is.
    pub fn emu(&self) -> Option<&Arc<EmuDevice>> {
        match self {
            Self::Software(e) => Some(e),
            Self::Vfio(_) | Self::VfioUser(_) => None,
        }
    }
}

/// An opened transport.
pub struct Opened {
    /// The device, as the driver sees it.
    pub device: Arc<dyn Device>,
    /// The same device, as what it is.
    pub backend: Backend,
}

/// Opens the transport named by `spec` (without bringing the controller up).
pub fn open_device(spec: &DeviceSpec, opts: &OpenOptions) -> Result<Arc<dyn Device>> {
    Ok(open_transport(spec, opts)?.device)
}

/// Opens the transport named by `spec`, keeping the software controller's handle.
pub fn open_transport(spec: &DeviceSpec, opts: &OpenOptions) -> Result<Opened> {
    let emu = match spec {
        DeviceSpec::Pci(addr) => {
            // vfio's errors already name the address and say what to do.
            let dev = vfio::VfioNvme::open(addr, &vfio::VfioOptions::default())?;
            return Ok(Opened {
                device: dev.clone(),
                backend: Backend::Vfio(dev),
            });
        }
        DeviceSpec::VfioUser(path) => {
            // vfio's errors name the socket and say what to do.
            let dev = vfio::VfioUserNvme::open(path, &vfio::VfioUserOptions::default())?;
            return Ok(Opened {
                device: dev.clone(),
                backend: Backend::VfioUser(dev),
            });
        }
        DeviceSpec::NvmeTcp(tcp) => crate::fabric::open_front(
            tcp,
            opts.controller_threads,
            opts.controller_queue_pairs,
            opts.read_only,
        )?,
        DeviceSpec::Served(s) => bail!(
            InvalidArgument,
            "{s} is a controller the daemon owns: open it with the library's handle (fs \
             commands, Python, C), or check it with `gpunvme serve --socket {} check`; this \
             command brings a controller up itself",
            s.socket.display()
        ),
        DeviceSpec::Image(path) => open_image(path, opts)?,
        DeviceSpec::DefaultImage => {
            let path = opts.default_image.as_path();
            if !path.exists() && opts.read_only {
                // A command that only reads has nothing to read there: creating 1 GiB as its
                // side effect would surprise.
                return Err(MissingImage {
                    path: path.to_owned(),
                    default: true,
                    hint: None,
                }
                .into());
            }
            if !path.exists() {
                match EmuConfig::create_image(path, DEFAULT_IMAGE_BYTES) {
                    Ok(()) => tracing::info!(
                        "created {} ({} bytes, sparse)",
                        path.display(),
                        DEFAULT_IMAGE_BYTES
                    ),
                    // Another process created it meanwhile.
                    Err(nvme_emu::EmuError::CreateImage { source, .. })
                        if source.kind() == std::io::ErrorKind::AlreadyExists => {}
                    Err(e) => {
                        return Err(crate::Error::from(e)
                            .context(format!("creating the default image {}", path.display())));
                    }
                }
            }
            open_image(path, opts)?
        }
    };
    Ok(Opened {
        device: emu.clone(),
        backend: Backend::Software(emu),
    })
}

fn open_image(path: &Path, opts: &OpenOptions) -> Result<Arc<EmuDevice>> {
    if !path.exists() {
        return Err(MissingImage {
            path: path.to_owned(),
            default: false,
            hint: None,
        }
        .into());
    }
    let base = if opts.read_only {
        EmuConfig::for_image_read_only(path, opts.lba_size)
    } else {
        EmuConfig::for_image(path, opts.lba_size)
    };
    let config = EmuConfig {
        controller_threads: opts.controller_threads,
        max_io_queue_pairs: opts.controller_queue_pairs,
        ..base.with_context(|| format!("image {}", path.display()))?
    };
    // The controller locks the image for as long as it runs; a busy image's error names the
    // holder and needs no more context.
    match EmuDevice::start(config) {
        Ok(dev) => Ok(dev),
        Err(e @ nvme_emu::EmuError::ImageBusy { .. }) => Err(e.into()),
        Err(e) => Err(crate::Error::from(e).context("starting the software controller")),
    }
}

/// Opens the device and brings its controller up.
pub fn open_controller(spec: &DeviceSpec, opts: &OpenOptions) -> Result<Controller> {
    Ok(open_controller_and_transport(spec, opts)?.0)
}

/// Like [`open_controller`], also returning what the device is.
pub fn open_controller_and_transport(
    spec: &DeviceSpec,
    opts: &OpenOptions,
) -> Result<(Controller, Backend)> {
    open_controller_and_transport_timed(spec, opts).map(|(c, b, _)| (c, b))
}

/// [`open_controller_and_transport`], and how long its two halves took: the transport (an
/// image and its software controller's threads, a VFIO function, a vfio-user socket) and the
/// controller's bring-up (reset, enable, Identify, queue counts).
pub fn open_controller_and_transport_timed(
    spec: &DeviceSpec,
    opts: &OpenOptions,
) -> Result<(Controller, Backend, [std::time::Duration; 2])> {
    let t = std::time::Instant::now();
    let Opened { device, backend } = open_transport(spec, opts)?;
    let transport = t.elapsed();
    let describe = device.describe();
    let mut copts = opts.controller.clone();
    if matches!(backend, Backend::Software(_)) {
        // Ask for every queue pair the software controller was configured to grant (the
        // driver's default request is 64).
        copts.io_queue_pairs_wanted = copts.io_queue_pairs_wanted.max(opts.controller_queue_pairs);
    }
    let ctrl = Controller::new(device, copts)
        .with_context(|| format!("bringing up the controller ({describe})"))?;
    Ok((ctrl, backend, [transport, t.elapsed() - transport]))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_parsing() {
        assert_eq!(DeviceSpec::parse(None).unwrap(), DeviceSpec::DefaultImage);
        assert_eq!(
            DeviceSpec::parse(Some("disk.img")).unwrap(),
            DeviceSpec::Image(PathBuf::from("disk.img"))
        );
        assert!(matches!(
            DeviceSpec::parse(Some("0000:01:00.0")).unwrap(),
            DeviceSpec::Pci(_)
        ));
        assert_eq!(
            DeviceSpec::parse(Some("vfio-user:/run/spdk/cntrl")).unwrap(),
            DeviceSpec::VfioUser(PathBuf::from("/run/spdk/cntrl"))
        );
        assert!(DeviceSpec::parse(Some("vfio-user:")).is_err());
        assert!(matches!(
            DeviceSpec::parse(Some("nvme-tcp://127.0.0.1:4420/nqn.2016-06.io.spdk:m512")).unwrap(),
            DeviceSpec::NvmeTcp(t) if t.port == 4420
        ));
        // The discovery controller holds no namespace to open.
        let e = DeviceSpec::parse(Some("nvme-tcp://127.0.0.1:4420")).unwrap_err();
        assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument);
    }
}
