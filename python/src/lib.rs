//! The native module of the `gpunvme` Python package (`gpunvme._native`): a device handle
//! with the file-system calls of `gpunvme fs`, and one exception class per error kind.
//!
//! The Python layer (`python/gpunvme/__init__.py`) is the public surface: it turns the JSON
//! reports returned here (the same objects `gpunvme --json fs ...` prints) into dicts. Every
//! call that touches the device releases the GIL; a handle's calls run one at a time.
//! No Rust panic crosses into Python: PyO3 turns one into a `PanicException`, and the calls
//! here return errors for everything a caller or a device can get wrong.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::mpsc::{RecvTimeoutError, channel};
use std::time::Duration;

#[allow(unsafe_code)]
mod dlpack;
#[allow(unsafe_code)]
mod gpu_memory;

use gpunvme::gpu::Serving;
use gpunvme::gpu_emu::{MediaKind, SsdModel};
use gpunvme::gpu_io::Piece;
use gpunvme::gpu_queues::{Cuda, GpuId};
use gpunvme::handle::{DeviceHandle, SaveTensor};
use gpunvme::image::{self, CreateImage, ImageExists};
use gpunvme::open::{MissingImage, OpenOptions};
use gpunvme::safetensors::{Dtype, TensorToWrite};
use gpunvme::{Error, ErrorKind, Result};
use parking_lot::Mutex;
use pyo3::create_exception;
use pyo3::exceptions::PyException;
use pyo3::prelude::*;

create_exception!(
    gpunvme,
    GpunvmeError,
    PyException,
    "Base class of every gpunvme error."
);
create_exception!(
    gpunvme,
    BusyError,
    GpunvmeError,
    "Another process or handle owns the device or image."
);
create_exception!(gpunvme, NotFoundError, GpunvmeError, "No such file.");
create_exception!(gpunvme, ExistsError, GpunvmeError, "The file exists.");
create_exception!(
    gpunvme,
    NoSpaceError,
    GpunvmeError,
    "The file system is full."
);
create_exception!(
    gpunvme,
    ReadOnlyError,
    GpunvmeError,
    "The file or device is read-only."
);
create_exception!(
    gpunvme,
    NoFileSystemError,
    GpunvmeError,
    "The namespace holds no blockfs (make one with mkfs)."
);
create_exception!(
    gpunvme,
    CorruptError,
    GpunvmeError,
    "On-device data failed its checks (metadata or data checksums, format)."
);
create_exception!(
    gpunvme,
    InvalidArgumentError,
    GpunvmeError,
    "An argument is not acceptable (a name, a size, a host path's kind)."
);
create_exception!(
    gpunvme,
    HostIoError,
    GpunvmeError,
    "A host file or stream failed."
);
create_exception!(
    gpunvme,
    ImageError,
    GpunvmeError,
    "The image file cannot be opened, created or used."
);
create_exception!(
    gpunvme,
    DeviceError,
    GpunvmeError,
    "The device (controller, VFIO, a command) failed."
);
create_exception!(
    gpunvme,
    RefusedError,
    GpunvmeError,
    "Refused before anything changed: the call would destroy data (mkfs over a file system, \
     output onto the device's own image)."
);
create_exception!(gpunvme, ClosedError, GpunvmeError, "The handle was closed.");

/// The handle was closed.
#[derive(Debug)]
struct Closed;

impl std::fmt::Display for Closed {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("the device handle is closed")
    }
}

impl std::error::Error for Closed {}

/// The Python exception for `e`: its kind's class, the message with its whole chain, worded
/// for a Python caller (how to make a missing image, how to replace an existing one).
fn to_py(e: Error) -> PyErr {
    let e = MissingImage::explain(e, |m| {
        if m.default {
            "nothing has written it yet: open it without read_only, or make it with \
             gpunvme.create_image(path, SIZE)"
                .into()
        } else {
            "create it with gpunvme.open(path, create=SIZE), e.g. create=\"1G\", or \
             gpunvme.create_image(path, SIZE)"
                .into()
        }
    });
    let e = ImageExists::explain(e, "pass force=True to replace it");
    let msg = e.to_string();
    if e.is::<Closed>() {
        return ClosedError::new_err(msg);
    }
    match e.kind() {
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
        ErrorKind::Refused => RefusedError::new_err(msg),
        _ => GpunvmeError::new_err(msg),
    }
}

/// Who serves a GPU call's queues, from the Python arguments.
fn serving_of(
    controller: &str,
    media: &str,
    ssd_model: Option<&str>,
) -> PyResult<(Serving, Option<SsdModel>)> {
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
    let ssd_model = ssd_model
        .map(|m| m.parse::<SsdModel>())
        .transpose()
        .map_err(|e| InvalidArgumentError::new_err(format!("ssd_model: {e}")))?;
    Ok((serving, ssd_model))
}

/// GPU `device` (the CUDA ordinal of the caller's tensor) with the caller's stream waited
/// for: what every call on a caller's tensors starts with. A negative ordinal is refused
/// before anything else; an ordinal that names no GPU of this process is an
/// `InvalidArgument` naming the GPUs there are.
fn caller_gpu(device: i32, stream: Option<u64>) -> Result<Arc<Cuda>> {
    check_device(device)?;
    if !gpunvme::gpu_queues::cuda_present() {
        return Err(Error::new(
            ErrorKind::Device,
            "no GPU: no CUDA driver on this machine",
        ));
    }
    let cuda = gpunvme::gpu_fs::open_gpu(&GpuId::Ordinal(device))?;
    if let Some(s) = stream {
        gpu_memory::wait_stream(&cuda, s)?;
    }
    Ok(cuda)
}

/// Refuses a negative CUDA device ordinal.
fn check_device(device: i32) -> Result<()> {
    if device < 0 {
        return Err(Error::new(
            ErrorKind::InvalidArgument,
            format!("device must be a CUDA device ordinal (0, 1, ...), not {device}"),
        ));
    }
    Ok(())
}

fn json<T: serde::Serialize>(v: &T) -> Result<String> {
    Ok(serde_json::to_string(v)?)
}

/// A device handle: an NVMe controller (a PCI function bound to vfio-pci, or an image file
/// served by the software controller) and blockfs on one of its namespaces.
#[pyclass(module = "gpunvme._native")]
struct Device {
    inner: Mutex<Option<DeviceHandle>>,
}

impl Device {
    /// Runs `f` on the open device with the GIL released.
    fn with<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&DeviceHandle) -> Result<T> + Send,
    ) -> PyResult<T> {
        py.detach(|| {
            let guard = self.inner.lock();
            let opened = guard
                .as_ref()
                .ok_or_else(|| Error::with_cause(ErrorKind::Other, Closed))?;
            f(opened).map_err(|e| opened.explain(e))
        })
        .map_err(to_py)
    }

    /// Runs `f` (a long copy) on the open device on a worker thread, the GIL released, while
    /// this thread checks for Python signals every [`SIGNAL_POLL`]: a Ctrl-C (or any signal
    /// whose handler raises) sets the cancel flag `f` gets, waits for `f` to stop (before it
    /// commits: the copy is left undone) and raises the handler's exception,
    /// `KeyboardInterrupt` for Ctrl-C. A signal that comes once `f` has returned is raised as
    /// Python raises it after any call.
    fn with_signals<T: Send>(
        &self,
        py: Python<'_>,
        f: impl FnOnce(&DeviceHandle, &AtomicBool) -> Result<T> + Send,
    ) -> PyResult<T> {
        let cancel = AtomicBool::new(false);
        let (inner, flag) = (&self.inner, &cancel);
        std::thread::scope(|s| {
            let (tx, rx) = channel();
            s.spawn(move || {
                let run = || {
                    let guard = inner.lock();
                    let opened = guard
                        .as_ref()
                        .ok_or_else(|| Error::with_cause(ErrorKind::Other, Closed))?;
                    f(opened, flag).map_err(|e| opened.explain(e))
                };
                let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(run)).unwrap_or_else(
                    |_| {
                        Err(Error::new(
                            ErrorKind::Other,
                            "internal error: a copy panicked",
                        ))
                    },
                );
                let _ = tx.send(r);
            });
            let mut raised: Option<PyErr> = None;
            let mut rx = rx;
            loop {
                // The receiver goes into the GIL-free wait and comes back (it is not Sync).
                let (got, back) = py.detach(move || (rx.recv_timeout(SIGNAL_POLL), rx));
                rx = back;
                match got {
                    Ok(r) => {
                        return match raised {
                            Some(e) => Err(e),
                            None => r.map_err(to_py),
                        };
                    }
                    Err(RecvTimeoutError::Timeout) => {
                        if raised.is_none()
                            && let Err(e) = py.check_signals()
                        {
                            cancel.store(true, Ordering::SeqCst);
                            raised = Some(e);
                        }
                    }
                    Err(RecvTimeoutError::Disconnected) => {
                        return Err(to_py(Error::new(
                            ErrorKind::Other,
                            "internal error: a copy thread ended without a result",
                        )));
                    }
                }
            }
        })
    }
}

/// How often a long copy's calling thread checks for Python signals (Ctrl-C).
const SIGNAL_POLL: Duration = Duration::from_millis(20);

#[pymethods]
impl Device {
    /// Opens `device` (a PCI address, an image path, or None for ./gpunvme.img, created on
    /// first use unless read_only) and brings its controller up.
    #[new]
    /// With `create` (a size: bytes, or "64M", "4G"), every image named that does not exist
    /// is made first at that size (sparse); existing ones are opened as they are.
    #[pyo3(signature = (device=None, lba_size=512, read_only=false, controller_threads=0, nsid=1, controller_queue_pairs=64, create=None, served_reads="auto"))]
    #[allow(clippy::too_many_arguments)]
    fn new(
        py: Python<'_>,
        device: Option<String>,
        lba_size: u32,
        read_only: bool,
        controller_threads: usize,
        nsid: u32,
        controller_queue_pairs: u16,
        create: Option<String>,
        served_reads: &str,
    ) -> PyResult<Self> {
        if lba_size != 512 && lba_size != 4096 {
            return Err(InvalidArgumentError::new_err(format!(
                "lba_size must be 512 or 4096, not {lba_size}"
            )));
        }
        if !(1..=1024).contains(&controller_queue_pairs) {
            return Err(InvalidArgumentError::new_err(format!(
                "controller_queue_pairs must be 1 to 1024, not {controller_queue_pairs}"
            )));
        }
        let served_reads = served_reads
            .parse()
            .map_err(|e: gpunvme::Error| InvalidArgumentError::new_err(e.to_string()))?;
        let opts = OpenOptions {
            lba_size,
            controller_threads,
            controller_queue_pairs,
            read_only,
            served_reads,
            ..OpenOptions::default()
        };
        let want = create
            .map(|size| {
                image::parse_size(&size).map(|bytes| CreateImage {
                    bytes,
                    lba_size,
                    force: false,
                })
            })
            .transpose()
            .map_err(|e| InvalidArgumentError::new_err(format!("create: {e}")))?;
        let opened = py
            .detach(|| {
                if let Some(want) = &want {
                    image::create_missing(device.as_deref(), &opts, want)?;
                }
                DeviceHandle::open(device.as_deref(), opts, nsid)
            })
            .map_err(to_py)?;
        Ok(Self {
            inner: Mutex::new(Some(opened)),
        })
    }

    /// Stops the controller and releases the device (idempotent): where the close went as
    /// JSON, or None if it was closed already.
    fn close(&self, py: Python<'_>) -> PyResult<Option<String>> {
        let opened = py.detach(|| self.inner.lock().take());
        py.detach(move || opened.map(|o| json(&o.close())).transpose())
            .map_err(to_py)
    }

    /// Where the open went, as JSON.
    fn open_phases(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |o| json(&o.open_phases()))
    }

    /// Whether close() was called.
    #[getter]
    fn closed(&self) -> bool {
        self.inner.lock().is_none()
    }

    /// What the device is.
    fn describe(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |o| Ok(o.describe().to_owned()))
    }

    /// Makes a new, empty file system; refused where one exists unless `force`.
    #[pyo3(signature = (block_size, force, stripe=None))]
    fn mkfs(
        &self,
        py: Python<'_>,
        block_size: u32,
        force: bool,
        stripe: Option<u64>,
    ) -> PyResult<String> {
        self.with(py, |o| json(&o.mkfs(block_size, force, stripe)?))
    }

    /// The files whose names start with `prefix`.
    fn ls(&self, py: Python<'_>, prefix: String) -> PyResult<String> {
        self.with(py, |o| json(&o.ls(&prefix)?))
    }

    /// Copies host file `src` into the file system as `name`. Ctrl-C stops it before it
    /// commits (nothing stored, an existing `name` as it was) and raises `KeyboardInterrupt`.
    fn put(&self, py: Python<'_>, src: PathBuf, name: String, force: bool) -> PyResult<String> {
        self.with_signals(py, |o, cancel| {
            json(&o.put_cancellable(&src, &name, force, cancel)?)
        })
    }

    /// Copies `name` out to host file `dst` (written beside it, renamed into place). Ctrl-C
    /// stops it before the rename (`dst` as it was) and raises `KeyboardInterrupt`.
    fn get(&self, py: Python<'_>, name: String, dst: PathBuf) -> PyResult<String> {
        self.with_signals(py, |o, cancel| {
            json(&o.get_cancellable(&name, &dst, cancel)?)
        })
    }

    /// Up to `size` bytes of `name` from `offset` (to its end when `None`), read on the host.
    #[pyo3(signature = (name, offset, size=None))]
    fn read<'py>(
        &self,
        py: Python<'py>,
        name: String,
        offset: u64,
        size: Option<u64>,
    ) -> PyResult<Bound<'py, pyo3::types::PyBytes>> {
        let bytes = self.with(py, |o| o.read(&name, offset, size))?;
        Ok(pyo3::types::PyBytes::new(py, &bytes))
    }

    /// `name`'s size, allocation, extents and generation.
    fn stat(&self, py: Python<'_>, name: String) -> PyResult<String> {
        self.with(py, |o| json(&o.stat(&name)?))
    }

    /// Removes `name`.
    fn rm(&self, py: Python<'_>, name: String) -> PyResult<String> {
        self.with(py, |o| json(&o.rm(&name)?))
    }

    /// Renames `old` to `new` (replacing an existing `new` by one commit with `force`).
    fn mv(&self, py: Python<'_>, old: String, new: String, force: bool) -> PyResult<String> {
        self.with(py, |o| json(&o.mv(&old, &new, force)?))
    }

    /// Space: blocks in all, free, available for file data.
    fn df(&self, py: Python<'_>) -> PyResult<String> {
        self.with(py, |o| json(&o.df()?))
    }

    /// Loads every tensor of a `.safetensors` file (or of every `.safetensors` file whose name
    /// starts with `name`) into one GPU arena by GPU-issued reads: (what `views` returned, the
    /// report JSON). Once the reads are under way, `views` is called (with the GIL, on this
    /// thread, the GPU still reading) with a `dltensor` capsule of the arena's bytes and
    /// [(name, dtype, shape, offset, bytes, strides)], and builds the caller's tensors from
    /// them, so that work overlaps the reads; it must not read the arena. An exception it raises
    /// is raised once the reads are over. The arena is in GPU `device`'s memory (a CUDA
    /// ordinal), read by that GPU's queues.
    #[pyo3(signature = (name, controller, media, ssd_model, views, device=0))]
    #[allow(clippy::too_many_arguments)]
    fn load_safetensors(
        &self,
        py: Python<'_>,
        name: String,
        controller: &str,
        media: &str,
        ssd_model: Option<&str>,
        views: Py<PyAny>,
        device: i32,
    ) -> PyResult<(Py<PyAny>, String)> {
        check_device(device).map_err(to_py)?;
        let (serving, ssd_model) = serving_of(controller, media, ssd_model)?;
        let gpu = GpuId::Ordinal(device);
        let (_, report, made) = self.with(py, |o| {
            o.load_safetensors_with(&name, &gpu, serving, ssd_model, |arena, placed| {
                let tensors: Vec<_> = placed
                    .iter()
                    .map(|p| {
                        (
                            p.info.name.clone(),
                            p.info.dtype.name(),
                            p.info.shape.clone(),
                            p.offset,
                            p.info.bytes(),
                            contiguous_strides(&p.info.shape),
                        )
                    })
                    .collect();
                Python::attach(|py| -> PyResult<Py<PyAny>> {
                    let len = arena.len() as u64;
                    let ordinal = arena.memory().cuda().ordinal();
                    let cap = dlpack::gpu_bytes(py, arena.ptr(), len, ordinal, arena.clone())?;
                    views.call1(py, (cap, tensors))
                })
            })
        })?;
        Ok((made?, report.to_string()))
    }

    /// Reads file `name` from byte `offset` into `nbytes` of the caller's GPU memory at `ptr`
    /// by GPU-issued reads, after the work queued on `stream` has finished: the report JSON
    /// (its `bytes` fewer than `nbytes` only where the file ends). `device`: the CUDA ordinal
    /// of the GPU that memory is on (the driver checks it is); that GPU's queues read.
    #[pyo3(signature = (name, ptr, nbytes, offset, stream, controller, media, ssd_model=None, device=0))]
    #[allow(clippy::too_many_arguments)]
    fn read_into(
        &self,
        py: Python<'_>,
        name: String,
        ptr: u64,
        nbytes: usize,
        offset: u64,
        stream: Option<u64>,
        controller: &str,
        media: &str,
        ssd_model: Option<&str>,
        device: i32,
    ) -> PyResult<String> {
        let (serving, ssd_model) = serving_of(controller, media, ssd_model)?;
        self.with(py, |o| {
            let cuda = caller_gpu(device, stream)?;
            let dst = gpu_memory::borrow(&cuda, ptr, nbytes)?;
            json(&o.read_into(&name, offset, dst, serving, ssd_model)?)
        })
    }

    /// Writes `nbytes` of the caller's GPU memory at `ptr` as file `name` by GPU-issued
    /// writes (replacing it with `force`), after the work queued on `stream` has finished:
    /// the report JSON. `device`: the CUDA ordinal of the GPU that memory is on.
    #[pyo3(signature = (name, ptr, nbytes, stream, force, controller, media, ssd_model=None, device=0))]
    #[allow(clippy::too_many_arguments)]
    fn save(
        &self,
        py: Python<'_>,
        name: String,
        ptr: u64,
        nbytes: usize,
        stream: Option<u64>,
        force: bool,
        controller: &str,
        media: &str,
        ssd_model: Option<&str>,
        device: i32,
    ) -> PyResult<String> {
        let (serving, ssd_model) = serving_of(controller, media, ssd_model)?;
        self.with(py, |o| {
            let cuda = caller_gpu(device, stream)?;
            let pieces = if nbytes == 0 {
                Vec::new()
            } else {
                vec![Piece::Gpu(gpu_memory::borrow(&cuda, ptr, nbytes)?)]
            };
            json(&o.save(&name, pieces, force, serving, ssd_model)?)
        })
    }

    /// Saves tensors [(name, dtype, shape, ptr, nbytes)] of the caller's GPU memory as the
    /// `.safetensors` file `name` (with `metadata`), after the work queued on `stream` has
    /// finished: the report JSON. `device`: the CUDA ordinal of the GPU every tensor is on.
    #[pyo3(signature = (name, tensors, metadata, stream, force, controller, media, ssd_model=None, device=0))]
    #[allow(clippy::too_many_arguments, clippy::type_complexity)]
    fn save_safetensors(
        &self,
        py: Python<'_>,
        name: String,
        tensors: Vec<(String, String, Vec<u64>, u64, usize)>,
        metadata: BTreeMap<String, String>,
        stream: Option<u64>,
        force: bool,
        controller: &str,
        media: &str,
        ssd_model: Option<&str>,
        device: i32,
    ) -> PyResult<String> {
        let (serving, ssd_model) = serving_of(controller, media, ssd_model)?;
        let tensors = tensors
            .into_iter()
            .map(
                |(tname, dtype, shape, ptr, nbytes)| match Dtype::parse(&dtype) {
                    Some(d) => Ok((tname, d, shape, ptr, nbytes)),
                    None => Err(InvalidArgumentError::new_err(format!(
                        "{tname}: no safetensors dtype {dtype:?}"
                    ))),
                },
            )
            .collect::<PyResult<Vec<_>>>()?;
        self.with(py, |o| {
            let cuda = caller_gpu(device, stream)?;
            let list = tensors
                .into_iter()
                .map(|(tname, dtype, shape, ptr, nbytes)| {
                    let mem = if nbytes == 0 {
                        None
                    } else {
                        Some(gpu_memory::borrow(&cuda, ptr, nbytes)?)
                    };
                    Ok(SaveTensor {
                        info: TensorToWrite {
                            name: tname,
                            dtype,
                            shape,
                            bytes: nbytes as u64,
                        },
                        mem,
                    })
                })
                .collect::<Result<Vec<_>>>()?;
            json(&o.save_safetensors(&name, list, &metadata, force, serving, ssd_model)?)
        })
    }

    /// Brings the handle's queues of GPU `device` (a CUDA ordinal) up (or finds them up):
    /// their descriptor array's GPU pointer and geometry, JSON.
    #[pyo3(signature = (device=0))]
    fn gpu_queues(&self, py: Python<'_>, device: i32) -> PyResult<String> {
        check_device(device).map_err(to_py)?;
        self.with(py, |o| json(&o.gpu_queues(&GpuId::Ordinal(device))?))
    }

    /// Tears down the GPU queues kept between GPU calls, every GPU's (the next GPU call brings
    /// them up).
    fn release_gpu(&self, py: Python<'_>) -> PyResult<()> {
        self.with(py, |o| o.release_gpu())
    }

    /// Checks the file system (unmounted): (report, consistent, data_mismatches).
    fn fsck(
        &self,
        py: Python<'_>,
        repair: bool,
        data: bool,
    ) -> PyResult<(String, bool, Vec<String>)> {
        self.with(py, |o| {
            let r = o.fsck(repair, data)?;
            Ok((r.json.to_string(), r.consistent, r.mismatched))
        })
    }
}

/// Makes a sparse image file of `size` (bytes, or "64M", "4G") at `path` for LBAs of
/// `lba_size`; an existing file is an `ExistsError` unless `force`: the report JSON.
#[pyfunction]
#[pyo3(signature = (path, size, lba_size=512, force=false))]
fn create_image(
    py: Python<'_>,
    path: PathBuf,
    size: String,
    lba_size: u32,
    force: bool,
) -> PyResult<String> {
    let bytes = image::parse_size(&size).map_err(|e| InvalidArgumentError::new_err(e.0))?;
    let want = CreateImage {
        bytes,
        lba_size,
        force,
    };
    py.detach(|| json(&image::create(&path, &want)?))
        .map_err(to_py)
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
    m.add_function(wrap_pyfunction!(create_image, m)?)?;
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

/// Row-major strides (in elements) of a tensor of `shape`, computed here rather than per
/// tensor in Python (a load hands over hundreds). The header's check bounded the element
/// count, so the products fit; they saturate rather than wrap regardless.
fn contiguous_strides(shape: &[u64]) -> Vec<u64> {
    let mut strides = vec![1u64; shape.len()];
    let mut acc = 1u64;
    for (s, d) in strides.iter_mut().zip(shape).rev() {
        *s = acc;
        acc = acc.saturating_mul(*d);
    }
    strides
}
