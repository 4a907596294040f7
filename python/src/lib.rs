//! The native module of the `gpunvme` Python package (`gpunvme._native`): a device handle
//! with the file-system calls of `gpunvme fs`, and one exception class per error kind.
//!
//! The Python layer (`python/gpunvme/__init__.py`) is the public surface: it turns the JSON
//! reports returned here (the same objects `gpunvme --json fs ...` prints) into dicts. Every
//! call that touches the device releases the GIL; a handle's calls run one at a time.
//! No Rust panic crosses into Python: PyO3 turns one into a `PanicException`, and the calls
//! here return errors for everything a caller or a device can get wrong.

use std::path::{Path, PathBuf};
use std::sync::Arc;

#[allow(unsafe_code)]
mod dlpack;

use anyhow::{Context, Result};
use gpunvme::blockfs::{
    self, FileSystem, FsckOptions, MkfsOptions, NvmeBlockDevice, NvmeDeviceOptions, OpenMode,
};
use gpunvme::copy;
use gpunvme::error_kind::ErrorKind;
use gpunvme::fs_report::{FsckView, ListReport, MkfsReport, RemoveReport, StatReport, check_data};
use gpunvme::gpu::{self, Serving};
use gpunvme::gpu_emu::MediaKind;
use gpunvme::gpu_fs::{self, GpuFsOptions};
use gpunvme::nvme::Controller;
use gpunvme::open::{self, Backend, DeviceSpec, OpenOptions};
use gpunvme::safetensors;
use parking_lot::Mutex;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    _native,
    GpunvmeError,
    PyException,
    "Base class of every gpunvme error."
);
create_exception!(
    _native,
    BusyError,
    GpunvmeError,
    "Another process or handle owns the device or image."
);
create_exception!(_native, NotFoundError, GpunvmeError, "No such file.");
create_exception!(_native, ExistsError, GpunvmeError, "The file exists.");
create_exception!(
    _native,
    NoSpaceError,
    GpunvmeError,
    "The file system is full."
);
create_exception!(
    _native,
    ReadOnlyError,
    GpunvmeError,
    "The file or device is read-only."
);
create_exception!(
    _native,
    NoFileSystemError,
    GpunvmeError,
    "The namespace holds no blockfs (make one with mkfs)."
);
create_exception!(
    _native,
    CorruptError,
    GpunvmeError,
    "On-device data failed its checks (metadata or data checksums, format)."
);
create_exception!(
    _native,
    InvalidArgumentError,
    GpunvmeError,
    "An argument is not acceptable (a name, a size, a host path's kind)."
);
create_exception!(
    _native,
    HostIoError,
    GpunvmeError,
    "A host file or stream failed."
);
create_exception!(
    _native,
    ImageError,
    GpunvmeError,
    "The image file cannot be opened, created or used."
);
create_exception!(
    _native,
    DeviceError,
    GpunvmeError,
    "The device (controller, VFIO, a command) failed."
);
create_exception!(
    _native,
    RefusedError,
    GpunvmeError,
    "Refused before anything changed: the call would destroy data (mkfs over a file system, \
     output onto the device's own image)."
);
create_exception!(_native, ClosedError, GpunvmeError, "The handle was closed.");

/// A refusal before anything changed (the CLI's `Refusal`).
#[derive(Debug)]
struct Refused(String);

impl std::fmt::Display for Refused {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&self.0)
    }
}

impl std::error::Error for Refused {}

/// The handle was closed.
#[derive(Debug)]
struct Closed;

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the device handle is closed")
    }
}

impl std::error::Error for Closed {}

/// The Python exception for `e`: its kind's class, the message with its whole chain.
fn to_py(e: anyhow::Error) -> PyErr {
    let msg = format!("{e:#}");
    if e.chain().any(|c| c.is::<Refused>()) {
        return RefusedError::new_err(msg);
    }
    if e.chain().any(|c| c.is::<Closed>()) {
        return ClosedError::new_err(msg);
    }
    match ErrorKind::of(&e) {
        ErrorKind::Busy => BusyError::new_err(msg),
        ErrorKind::NotFound => NotFoundError::new_err(msg),
        ErrorKind::Exists => ExistsError::new_err(msg),
        ErrorKind::NoSpace => NoSpaceError::new_err(msg),
        ErrorKind::ReadOnly => ReadOnlyError::new_err(msg),
        ErrorKind::NoFileSystem => NoFileSystemError::new_err(msg),
        ErrorKind::Corrupt => CorruptError::new_err(msg),
        ErrorKind::InvalidArgument => InvalidArgumentError::new_err(msg),
        ErrorKind::Io => HostIoError::new_err(msg),
        ErrorKind::Image => ImageError::new_err(msg),
        ErrorKind::Device => DeviceError::new_err(msg),
        ErrorKind::FileSystem | ErrorKind::Other => GpunvmeError::new_err(msg),
    }
}

/// An open device: its controller and the block device blockfs runs on.
struct Opened {
    spec: DeviceSpec,
    opts: OpenOptions,
    nsid: u32,
    describe: String,
    dev: Arc<NvmeBlockDevice>,
    /// I/O queue pairs the block device holds (GPU queues take the rest).
    cpu_queues: u16,
    backend: Backend,
    // Dropped after the block device (field order): its queues are the controller's.
    ctrl: Controller,
}

impl Opened {
    fn open(device: Option<&str>, opts: OpenOptions, nsid: u32) -> Result<Self> {
        let spec = DeviceSpec::parse(device)?;
        let (ctrl, backend) = open::open_controller_and_transport(&spec, &opts)?;
        let info = ctrl.info();
        let describe = format!(
            "{} serial {} (namespace {nsid}, {spec:?})",
            info.mn.trim(),
            info.sn.trim()
        );
        let dev_opts = NvmeDeviceOptions::default();
        let dev = Arc::new(
            NvmeBlockDevice::new(&ctrl, nsid, &dev_opts)
                .with_context(|| format!("opening namespace {nsid} for blockfs"))?,
        );
        Ok(Self {
            spec,
            opts,
            nsid,
            describe,
            dev,
            cpu_queues: u16::try_from(dev_opts.queues).unwrap_or(u16::MAX),
            backend,
            ctrl,
        })
    }

    fn mount(&self) -> Result<FileSystem> {
        let nsid = self.nsid;
        FileSystem::mount(self.dev.clone()).map_err(|e| match e {
            e @ blockfs::Error::NotBlockfs(_) => anyhow::Error::new(e).context(format!(
                "namespace {nsid} holds no blockfs (make one with mkfs)"
            )),
            e => anyhow::Error::new(e).context(format!(
                "mounting blockfs on namespace {nsid} (fsck says more)"
            )),
        })
    }
}

fn json<T: serde::Serialize>(v: &T) -> Result<String> {
    Ok(serde_json::to_string(v)?)
}

/// A device handle: an NVMe controller (a PCI function bound to vfio-pci, or an image file
/// served by the software controller) and blockfs on one of its namespaces.
#[pyclass(module = "gpunvme._native")]
struct Device {
    inner: Mutex<Option<Opened>>,
}

impl Device {
    /// Runs `f` on the open device with the GIL released.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&Opened) -> Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let guard = self.inner.lock();
            let opened = guard.as_ref().ok_or_else(|| anyhow::Error::new(Closed))?;
            f(opened)
        })
        .map_err(to_py)
    }
}

#[pymethods]
impl Device {
    /// Opens `device` (a PCI address, an image path, or None for ./gpunvme.img, created on
    /// first use unless read_only) and brings its controller up.
    #[new]
    #[pyo3(signature = (device=None, lba_size=512, read_only=false, controller_threads=0, nsid=1))]
    fn new(
        py: Python<'_>,
        device: Option<String>,
        lba_size: u32,
        read_only: bool,
        controller_threads: usize,
        nsid: u32,
    ) -> PyResult<Self> {
        if lba_size != 512 && lba_size != 4096 {
            return Err(InvalidArgumentError::new_err(format!(
                "lba_size must be 512 or 4096, not {lba_size}"
            )));
        }
        let opts = OpenOptions {
            lba_size,
            controller_threads,
            read_only,
            ..OpenOptions::default()
        };
        let opened = py
            .detach(|| Opened::open(device.as_deref(), opts, nsid))
            .map_err(to_py)?;
        Ok(Self {
            inner: Mutex::new(Some(opened)),
        })
    }

    /// Stops the controller and releases the device (idempotent).
    fn close(&self, py: Python<'_>) {
        let opened = py.detach(|| self.inner.lock().take());
        py.detach(move || drop(opened));
    }

    /// Whether close() was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().is_none()
    }

    /// What the device is.
    fn describe(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |o| Ok(o.describe.clone()))
    }

    /// Makes a new, empty file system; refused where one exists unless `force`.
    fn mkfs(&self, py: Python<'_>, block_size: u32, force: bool) -> PyResult<String> {
        self.with(py, |o| {
            if !force {
                let found = FileSystem::probe(o.dev.clone())
                    .context("looking for a file system to keep")?;
                if found.is_blockfs() {
                    return Err(Refused(format!(
                        "namespace {} holds {found}; mkfs would destroy it (pass force=True to do so)",
                        o.nsid
                    ))
                    .into());
                }
            }
            let opts = MkfsOptions {
                block_size,
                ..MkfsOptions::default()
            };
            let fs = FileSystem::mkfs(o.dev.clone(), &opts).context("mkfs")?;
            json(&MkfsReport::of(&fs))
        })
    }

    /// The files whose names start with `prefix`.
    fn ls(&self, py: Python<'_>, prefix: String) -> PyResult<String> {
        self.with(py, |o| json(&ListReport::of(&o.mount()?, &prefix)))
    }

    /// Copies host file `src` into the file system as `name`.
    fn put(&self, py: Python<'_>, src: PathBuf, name: String, force: bool) -> PyResult<String> {
        self.with(py, |o| {
            let fs = o.mount()?;
            let opts = copy::PutOptions { force, chunk: None };
            json(&copy::put(&fs, &src, &name, &opts, &|_| {})?)
        })
    }

    /// Copies `name` out to host file `dst` (written beside it, renamed into place).
    fn get(&self, py: Python<'_>, name: String, dst: PathBuf) -> PyResult<String> {
        self.with(py, |o| {
            refuse_own_image(o, &dst)?;
            let fs = o.mount()?;
            let dest = copy::Destination::Path(&dst);
            json(&copy::get(
                &fs,
                &name,
                dest,
                &copy::GetOptions { chunk: None },
                &|_| {},
            )?)
        })
    }

    /// `name`'s size, allocation, extents and generation.
    fn stat(&self, py: Python<'_>, name: String) -> PyResult<String> {
        self.with(py, |o| json(&StatReport::of(&o.mount()?, &name)?))
    }

    /// Removes `name`.
    fn rm(&self, py: Python<'_>, name: String) -> PyResult<String> {
        self.with(py, |o| {
            let fs = o.mount()?;
            fs.remove(&name)?;
            fs.sync()?;
            json(&RemoveReport { removed: name })
        })
    }

    /// Loads every tensor of a `.safetensors` file (or of every `.safetensors` file whose name
    /// starts with `name`) into one GPU arena by GPU-issued reads: (a `dltensor` capsule of the
    /// arena's bytes, [(name, dtype, shape, offset, bytes)], report JSON).
    #[allow(clippy::type_complexity)]
    fn load_safetensors<'py>(
        &self,
        py: Python<'py>,
        name: String,
        controller: &str,
        media: &str,
    ) -> PyResult<(
        Bound<'py, PyAny>,
        Vec<(String, &'static str, Vec<u64>, u64, u64)>,
        String,
    )> {
        let serving = match (controller, media) {
            ("emu", _) => Serving::Device,
            ("gpu", "host") => Serving::Model(MediaKind::Host),
            ("gpu", "hbm") => Serving::Model(MediaKind::Hbm),
            _ => {
                return Err(InvalidArgumentError::new_err(format!(
                    "controller must be \"emu\" or \"gpu\" and media \"host\" or \"hbm\", \
                     not {controller:?} and {media:?}"
                )));
            }
        };
        let (loaded, report) = self.with(py, |o| load(o, &name, serving))?;
        let tensors = loaded
            .tensors
            .iter()
            .map(|p| {
                (
                    p.info.name.clone(),
                    p.info.dtype.name(),
                    p.info.shape.clone(),
                    p.offset,
                    p.info.bytes(),
                )
            })
            .collect();
        let len = loaded.arena.len() as u64;
        let cap = dlpack::gpu_bytes(py, loaded.arena.ptr(), len, 0, loaded.arena.clone())?;
        Ok((cap, tensors, report))
    }

    /// Checks the file system (unmounted): (report, consistent, data_mismatches).
    fn fsck(
        &self,
        py: Python<'_>,
        repair: bool,
        data: bool,
    ) -> PyResult<(String, bool, Vec<String>)> {
        self.with(py, |o| {
            let report = blockfs::fsck(o.dev.clone(), &FsckOptions { repair })?;
            let data_report = if data && report.is_consistent() {
                Some(check_data(&FileSystem::mount(o.dev.clone())?)?)
            } else {
                None
            };
            let view = FsckView {
                report: &report,
                repair,
                data: data_report.as_ref(),
            };
            let mismatched = data_report
                .as_ref()
                .map(|d| d.mismatched.clone())
                .unwrap_or_default();
            Ok((json(&view)?, report.is_consistent(), mismatched))
        })
    }
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

/// load_safetensors on the open device: headers on the host, then one GPU batch.
fn load(o: &Opened, name: &str, serving: Serving) -> Result<(safetensors::Loaded, String)> {
    let fs = o.mount()?;
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
    // Every refusal that needs no GPU comes before the GPU is touched.
    let refs: Vec<&str> = names.iter().map(String::as_str).collect();
    safetensors::layout(&refs, &headers)?;
    if !gpunvme::gpu_queues::cuda_present() {
        anyhow::bail!("no GPU: no CUDA driver on this machine (the headers were checked)");
    }
    let opts = GpuFsOptions {
        serving,
        cpu_queues: o.cpu_queues,
        ..GpuFsOptions::default()
    };
    let (_cuda, setup) = gpu_fs::setup(&o.ctrl, &o.backend, &opts)?;
    let result = (|| {
        let pairs: Vec<_> = files.iter().zip(&headers).collect();
        let watch = gpu::watchdog(&o.ctrl, &o.backend, setup.model.as_ref());
        let loaded = safetensors::load(&setup, &refs, &pairs, watch)?;
        let report = serde_json::json!({
            "files": names,
            "tensors": loaded.tensors.len(),
            "bytes": loaded.bytes,
            "seconds": loaded.secs,
            "bytes_per_sec": if loaded.secs > 0.0 { loaded.bytes as f64 / loaded.secs } else { 0.0 },
            "arena_bytes": loaded.arena.len(),
            "transport": setup.transport,
            "data_path": gpu_fs::data_path(&setup, false),
        });
        anyhow::Ok((loaded, report.to_string()))
    })();
    let down = gpu_fs::teardown(setup);
    let out = result?;
    down?;
    Ok(out)
}

/// Refuses a host output path that is the device's own image.
fn refuse_own_image(o: &Opened, dst: &Path) -> Result<()> {
    if o.spec.is_own_image(&o.opts, dst) {
        return Err(Refused(format!(
            "{} is the device's own image file: writing the output there would destroy it",
            dst.display()
        ))
        .into());
    }
    Ok(())
}

/// Whether a CUDA driver is present (GPU calls need one).
#[pyfunction]
fn cuda_available() -> bool {
    gpunvme::gpu_queues::cuda_present()
}

/// The module.
#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    let py = m.py();
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    m.add_class::<Device>()?;
    m.add_function(wrap_pyfunction!(cuda_available, m)?)?;
    m.add("GpunvmeError", py.get_type::<GpunvmeError>())?;
    m.add("BusyError", py.get_type::<BusyError>())?;
    m.add("NotFoundError", py.get_type::<NotFoundError>())?;
    m.add("ExistsError", py.get_type::<ExistsError>())?;
    m.add("NoSpaceError", py.get_type::<NoSpaceError>())?;
    m.add("ReadOnlyError", py.get_type::<ReadOnlyError>())?;
    m.add("NoFileSystemError", py.get_type::<NoFileSystemError>())?;
    m.add("CorruptError", py.get_type::<CorruptError>())?;
    m.add(
        "InvalidArgumentError",
        py.get_type::<InvalidArgumentError>(),
    )?;
    m.add("HostIoError", py.get_type::<HostIoError>())?;
    m.add("ImageError", py.get_type::<ImageError>())?;
    m.add("DeviceError", py.get_type::<DeviceError>())?;
    m.add("RefusedError", py.get_type::<RefusedError>())?;
    m.add("ClosedError", py.get_type::<ClosedError>())?;
    Ok(())
}
