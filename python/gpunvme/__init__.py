"""gpunvme from Python: blockfs files on an NVMe namespace.

The device is a PCI function bound to vfio-pci (``"0000:01:00.0"``) or an image file served by
gpunvme's software NVMe controller (a path; ``None`` for ``./gpunvme.img``, created on first
use), as with the ``gpunvme`` CLI's ``--device``::

    import gpunvme

    with gpunvme.open("disk.img", create="1G") as dev:   # made (sparse) if missing
        dev.mkfs()
        dev.put("weights.safetensors", "models/a.safetensors")
        print(dev.ls("models/"))

Every call returns the object ``gpunvme --json fs ...`` prints (as dicts and lists) and raises a
subclass of :class:`GpunvmeError` per error kind (:class:`NotFoundError`, :class:`BusyError`,
...). Calls release the GIL while they wait on the device; one handle runs one call at a time.
"""

from __future__ import annotations

import json
import logging
import os
from typing import Any, Dict, List, Optional, Union

from . import _native
from ._native import (
    BusyError,
    ClosedError,
    CorruptError,
    DeviceError,
    ExistsError,
    GpunvmeError,
    HostIoError,
    ImageError,
    InvalidArgumentError,
    NoFileSystemError,
    NoSpaceError,
    NotFoundError,
    ReadOnlyError,
    RefusedError,
)

__version__: str = _native.__version__

__all__ = [
    "Device",
    "open",
    "create_image",
    "cuda_available",
    "GpunvmeError",
    "BusyError",
    "ClosedError",
    "CorruptError",
    "DeviceError",
    "ExistsError",
    "HostIoError",
    "ImageError",
    "InvalidArgumentError",
    "NoFileSystemError",
    "NoSpaceError",
    "NotFoundError",
    "ReadOnlyError",
    "RefusedError",
]

PathLike = Union[str, "os.PathLike[str]"]

_log = logging.getLogger("gpunvme")

# safetensors dtype names -> torch dtype attribute names (as safetensors.torch maps them).
_TORCH_DTYPES = {
    "BOOL": "bool",
    "U8": "uint8",
    "I8": "int8",
    "F8_E4M3": "float8_e4m3fn",
    "F8_E5M2": "float8_e5m2",
    "U16": "uint16",
    "I16": "int16",
    "F16": "float16",
    "BF16": "bfloat16",
    "U32": "uint32",
    "I32": "int32",
    "F32": "float32",
    "U64": "uint64",
    "I64": "int64",
    "F64": "float64",
}


# CUDA array interface type strings (one byte order mark, a kind, a size) -> safetensors dtypes.
_CAI_DTYPES = {
    "b1": "BOOL",
    "u1": "U8",
    "i1": "I8",
    "u2": "U16",
    "i2": "I16",
    "f2": "F16",
    "u4": "U32",
    "i4": "I32",
    "f4": "F32",
    "u8": "U64",
    "i8": "I64",
    "f8": "F64",
}

# DLPack device types, for errors.
_DL_DEVICES = {1: "host (CPU)", 2: "CUDA", 3: "pinned host (CUDA host)", 13: "CUDA managed"}


class _GpuBytes:
    """The contiguous bytes of a CUDA array: pointer, length, the stream its producer queued
    work on (None: nothing to wait for), safetensors dtype and shape, the object that owns
    them (held for the call), and ``device``, the CUDA ordinal of the GPU they are on."""

    def __init__(self, ptr: int, nbytes: int, stream: Optional[int], dtype: Optional[str],
                 shape: List[int], owner: Any, device: int = 0) -> None:
        self.ptr, self.nbytes, self.stream = ptr, nbytes, stream
        self.dtype, self.shape, self.owner = dtype, shape, owner
        self.device = device


def _cai_device(obj: Any) -> int:
    """The CUDA ordinal of an object with ``__cuda_array_interface__``: its ``device.id`` where
    it has an int one (CuPy), else 0. The interface itself does not say which GPU; for 0 the
    driver then checks that the memory is GPU 0's, and the error names the GPU it is on."""
    dev = getattr(obj, "device", None)
    ident = getattr(dev, "id", None)
    if isinstance(ident, int) and not isinstance(ident, bool):
        return ident
    return 0


def _cuda_ordinal(device: Any) -> int:
    """The CUDA ordinal ``device`` names: ``"cuda"`` (GPU 0), ``"cuda:N"``, an int ``N`` or a
    ``torch.device("cuda", N)``. Anything else (a CPU device, a negative ordinal, a string
    that is not one of those) is :class:`InvalidArgumentError` naming it; no GPU is touched."""
    if isinstance(device, bool):
        n = None
    elif isinstance(device, int):
        n = device
    elif isinstance(device, str):
        head, sep, tail = device.partition(":")
        if device == "cuda":
            n = 0
        elif head == "cuda" and sep and tail.isascii() and tail.isdigit():
            n = int(tail)
        else:
            n = None
    else:
        # A torch.device, duck-typed: naming a GPU does not import torch.
        index = getattr(device, "index", False)
        if getattr(device, "type", None) != "cuda" or isinstance(index, bool):
            n = None
        elif index is None:
            n = 0
        else:
            n = index if isinstance(index, int) else None
    if n is None or not 0 <= n < 2**31:
        raise InvalidArgumentError(
            'device must be a CUDA device ("cuda", "cuda:N", an ordinal N >= 0 or '
            f'torch.device("cuda", N)), not {device!r}'
        )
    return n


def _gpus_named(devices: List[int]) -> str:
    """``"0 and 1"``, ``"0, 1 and 3"``: GPU ordinals for an error."""
    names = [str(d) for d in sorted(devices)]
    return names[0] if len(names) == 1 else ", ".join(names[:-1]) + " and " + names[-1]


def _c_contiguous(shape: List[int], strides: List[int], itemsize: int) -> bool:
    want = itemsize
    for dim, stride in zip(reversed(shape), reversed(strides)):
        if dim != 1 and stride != want:
            return False
        want *= dim
    return True


def _gpu_bytes(obj: Any, *, writable: bool, what: str) -> _GpuBytes:
    """``obj``'s bytes, if it is a contiguous CUDA array: a torch.Tensor (any dtype, bfloat16
    included), anything with ``__cuda_array_interface__`` (CuPy, Numba, JAX), or a CUDA object
    with only ``__dlpack__`` (imported through torch). Everything else is an
    :class:`InvalidArgumentError` that says what the object is. The GPU: a torch tensor's
    ``device.index`` (torch's current device where it has none), a CUDA-array-interface
    object's ``device.id`` (0 where it has none: see :func:`_cai_device`), a DLPack object's
    ``__dlpack_device__()`` ordinal (through torch)."""
    mod = type(obj).__module__ or ""
    if mod.startswith("torch") and hasattr(obj, "data_ptr"):
        if obj.device.type != "cuda":
            raise InvalidArgumentError(
                f"{what} is a torch tensor on {obj.device}, not on a CUDA device "
                f"(move it with .to('cuda'))"
            )
        if not obj.is_contiguous():
            raise InvalidArgumentError(f"{what} is not contiguous (make it so with .contiguous())")
        if writable and obj.requires_grad and obj.is_leaf:
            raise InvalidArgumentError(
                f"{what} requires grad: read into a tensor that does not (or its .detach())"
            )
        import torch  # already imported: obj is a torch tensor

        names = {getattr(torch, v): k for k, v in _TORCH_DTYPES.items() if hasattr(torch, v)}
        index = obj.device.index
        if index is None:
            index = torch.cuda.current_device()
        stream = torch.cuda.current_stream(obj.device).cuda_stream
        return _GpuBytes(obj.data_ptr(), obj.numel() * obj.element_size(), stream,
                         names.get(obj.dtype), list(obj.shape), obj, int(index))
    try:
        cai = obj.__cuda_array_interface__
    except AttributeError:
        cai = None
    if cai is None:
        dev = getattr(obj, "__dlpack_device__", None)
        if dev is None:
            raise InvalidArgumentError(
                f"{what} must be a CUDA array (a torch.Tensor on cuda, or an object with "
                f"__cuda_array_interface__ or __dlpack__), not {type(obj).__name__}"
            )
        kind, _ = dev()
        if kind != 2:
            raise InvalidArgumentError(
                f"{what} is in {_DL_DEVICES.get(kind, f'DLPack device type {kind}')} memory, "
                f"not CUDA device memory"
            )
        try:
            import torch
        except ImportError:
            raise InvalidArgumentError(
                f"{what} offers only __dlpack__; importing it needs torch (or pass an object "
                f"with __cuda_array_interface__)"
            ) from None
        return _gpu_bytes(torch.from_dlpack(obj), writable=writable, what=what)
    ptr, readonly = cai["data"]
    if writable and readonly:
        raise InvalidArgumentError(f"{what} is read-only")
    if cai.get("mask") is not None:
        raise InvalidArgumentError(f"{what} is a masked array")
    shape = [int(d) for d in cai["shape"]]
    typestr = cai["typestr"]
    itemsize = int(typestr[2:])
    strides = cai.get("strides")
    if strides is not None and not _c_contiguous(shape, list(strides), itemsize):
        raise InvalidArgumentError(f"{what} is not C-contiguous")
    n = itemsize
    for d in shape:
        n *= d
    stream = cai.get("stream")
    return _GpuBytes(int(ptr or 0), n, None if stream is None else int(stream),
                     _CAI_DTYPES.get(typestr[1:]), shape, obj, _cai_device(obj))


def _arena_views(torch: Any, arena: Any, tensors: List[Any]) -> Dict[str, Any]:
    """``{name: tensor}``, each tensor a view of the byte tensor ``arena``: one typed view of
    the whole arena per dtype, then one ``as_strided`` per tensor (its offset in elements; its
    strides computed by the native side). The arena's tensors start at 256-byte-aligned
    offsets and its length is a multiple of 256, so every dtype's view of it is exact. One
    torch call per tensor (not a slice, a dtype view and a reshape): a model has hundreds of
    tensors and each call costs microseconds (one ``split_with_sizes`` per dtype then a
    ``view`` per tensor makes more calls)."""
    typed: Dict[str, Any] = {}
    out: Dict[str, Any] = {}
    for name, dtype, shape, offset, _nbytes, strides in tensors:
        view = typed.get(dtype)
        if view is None:
            view = typed[dtype] = arena.view(getattr(torch, _TORCH_DTYPES[dtype]))
        out[name] = view.as_strided(shape, strides, offset // view.element_size())
    return out


def cuda_available() -> bool:
    """Whether this machine has a CUDA driver (the GPU calls need one)."""
    return _native.cuda_available()


class Device:
    """An open device and blockfs on one of its namespaces. ``Device(...)`` takes what
    :func:`open` takes and opens the device the same way.

    A context manager: leaving the ``with`` block closes it, which stops the controller and
    releases the device (a second process, or a second handle, is refused while it is open).
    """

    def __init__(
        self,
        device: Union[None, str, "os.PathLike[str]", List[str], _native.Device] = None,
        *,
        lba_size: int = 512,
        read_only: bool = False,
        controller_threads: int = 0,
        nsid: int = 1,
        controller_queue_pairs: int = 64,
        create: Union[None, int, str] = None,
        served_reads: str = "auto",
    ) -> None:
        if isinstance(device, _native.Device):
            native = device
        else:
            if isinstance(device, (list, tuple)):
                device = ",".join(os.fspath(d) for d in device)
            elif device is not None:
                device = os.fspath(device)
            native = _native.Device(
                device,
                lba_size,
                read_only,
                controller_threads,
                nsid,
                controller_queue_pairs,
                _size_arg(create, "create"),
                served_reads,
            )
        self._d = native
        #: Where the open went, in seconds: ``transport`` (an image and its software
        #: controller's threads, a VFIO function, a vfio-user socket), ``controller`` (its
        #: bring-up), ``block_devices`` (the file layer's CPU queues).
        self.open_phases: Dict[str, float] = json.loads(native.open_phases())
        #: Where :meth:`close` went, in seconds (``gpu_queues``, ``block_devices``,
        #: ``controllers``); None until it closed the device.
        self.close_phases: Optional[Dict[str, float]] = None
        #: The last load_safetensors' figures: files, tensors, bytes, seconds, data path.
        self.last_load: Optional[Dict[str, Any]] = None
        #: The last read_into's, save's or save_safetensors' figures: bytes, seconds, data path.
        self.last_io: Optional[Dict[str, Any]] = None

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<gpunvme.Device closed>" if self.closed else f"<gpunvme.Device {self.describe()}>"

    def close(self) -> None:
        """Stops the controller and releases the device (idempotent); where the close went is
        in :attr:`close_phases`."""
        phases = self._d.close()
        if phases is not None:
            self.close_phases = json.loads(phases)

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._d.closed

    def describe(self) -> str:
        """What the device is: model, serial, namespace."""
        return self._d.describe()

    def mkfs(
        self, *, block_size: int = 4096, force: bool = False, stripe: Optional[int] = None
    ) -> Dict[str, Any]:
        """Makes a new, empty file system; raises :class:`RefusedError` where one exists
        unless ``force`` (which destroys its files). On a striped volume (several devices)
        makes the volume first: ``stripe`` bytes per unit (default: the smallest maximum
        transfer of the controllers)."""
        return json.loads(self._d.mkfs(block_size, force, stripe))

    def ls(self, prefix: str = "") -> List[Dict[str, Any]]:
        """The files whose names start with ``prefix`` (all files by default)."""
        return json.loads(self._d.ls(prefix))

    def put(self, src: PathLike, name: str, *, force: bool = False) -> Dict[str, Any]:
        """Copies host file ``src`` into the file system as ``name``. An existing ``name`` is
        :class:`ExistsError` unless ``force``, which replaces it by one commit (the old version
        survives any failure). Ctrl-C stops the copy before it commits (nothing stored, the old
        version kept) and raises ``KeyboardInterrupt``."""
        return json.loads(self._d.put(os.fspath(src), name, force))

    def get(self, name: str, dst: PathLike) -> Dict[str, Any]:
        """Copies ``name`` to host file ``dst``: written beside it under a temporary name and
        renamed into place once complete, so a failed get leaves ``dst`` as it was; so does
        Ctrl-C, which then raises ``KeyboardInterrupt``."""
        return json.loads(self._d.get(name, os.fspath(dst)))

    def read(self, name: str, offset: int = 0, size: Optional[int] = None) -> bytes:
        """Up to ``size`` bytes of ``name`` from byte ``offset`` (to the end of the file when
        ``size`` is None), read into host memory through the CPU's queues: short only at the
        end of the file, ``b""`` past it. For headers and small reads: bulk data belongs on
        the GPU (``read_into``, ``load_safetensors``)."""
        if offset < 0 or (size is not None and size < 0):
            raise InvalidArgumentError(f"read of {name}: offset {offset}, size {size}")
        return self._d.read(name, offset, size)

    def stat(self, name: str) -> Dict[str, Any]:
        """``name``'s size, allocation, extents, checksum and generation."""
        return json.loads(self._d.stat(name))

    def rm(self, name: str) -> Dict[str, Any]:
        """Removes ``name``."""
        return json.loads(self._d.rm(name))

    def mv(self, old: str, new: str, *, force: bool = False) -> Dict[str, Any]:
        """Renames ``old`` to ``new`` (``gpunvme fs mv``). An existing ``new`` is
        :class:`ExistsError` unless ``force``, which replaces it by one commit. Returns
        ``{"from": old, "to": new}``."""
        return json.loads(self._d.mv(old, new, force))

    def df(self) -> Dict[str, Any]:
        """Space, as ``gpunvme --json fs df`` prints it: ``block_size``, ``total_blocks``,
        ``free_blocks``, ``available_bytes`` (what file data may take), ``files``, ..."""
        return json.loads(self._d.df())

    def load_safetensors(
        self,
        name_or_prefix: str,
        device: Any = "cuda:0",
        *,
        controller: str = "emu",
        media: str = "host",
        ssd_model: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Loads a ``.safetensors`` file (or every ``.safetensors`` file whose name starts with
        ``name_or_prefix``: a sharded model) into CUDA tensors: the headers are parsed on the
        host, then every tensor is read by GPU-issued NVMe commands into one GPU allocation in
        one batch, and each tensor is a view into it (made while the GPU reads; the allocation is
        freed with the last of them). Returns ``{name: torch.Tensor}`` like ``safetensors.torch.load_file``.

        ``device``: the GPU to load onto, ``"cuda:N"``, ``"cuda"`` (GPU 0), an ordinal ``N``
        or ``torch.device("cuda", N)``; its own GPU queues read (a handle keeps queues per GPU,
        brought up on first use on each). Anything else is :class:`InvalidArgumentError`
        before the device is touched; a GPU this process does not have is
        :class:`InvalidArgumentError` saying ``no GPU N`` and naming the GPUs there are.

        ``controller``: ``"emu"`` (the device's own controller) or ``"gpu"`` (the GPU-resident
        controller model, with ``media`` ``"host"`` or ``"hbm"``, and optionally an SSD timing
        model such as ``"drives=4,bw=14GB/s,iops=2500000"``, the CLI's ``--ssd-model``). The
        load's figures (bytes,
        seconds, data path) are in :attr:`last_load` and logged at DEBUG on ``gpunvme``.
        torch is imported here, not at package import.
        """
        ordinal = _cuda_ordinal(device)

        def views(cap: Any, tensors: List[Any]) -> Dict[str, Any]:
            # Called back once the GPU's reads are under way: the views are made while it
            # reads (they only describe the arena; nothing reads it before the call returns).
            import torch  # a run-time dependency of this call only

            return _arena_views(torch, torch.from_dlpack(cap), tensors)

        out, report = self._d.load_safetensors(
            name_or_prefix, controller, media, ssd_model, views, ordinal
        )
        self.last_load = json.loads(report)
        _log.debug("load_safetensors %s: %s", name_or_prefix, self.last_load)
        return out

    def read_into(
        self,
        name: str,
        dst: Any,
        offset: int = 0,
        *,
        controller: str = "emu",
        media: str = "host",
        ssd_model: Optional[str] = None,
    ) -> int:
        """Reads file ``name`` from byte ``offset`` into ``dst``, a contiguous CUDA array (a
        ``torch.Tensor``, a CuPy array, anything with ``__cuda_array_interface__`` or
        ``__dlpack__``) on any GPU, by NVMe reads that ``dst``'s own GPU issues straight into
        its memory (the GPU is the array's device: a torch tensor's ``device``, a CuPy array's
        ``device.id``; GPU 0 for other array-interface objects, whose memory the driver then
        checks is GPU 0's). Fills
        ``dst``'s bytes and returns how many were read: fewer only where the file ends, like
        ``readinto``. Work queued on ``dst``'s stream is waited for first; the data is in place
        when the call returns. Figures in :attr:`last_io`. ``controller``, ``media`` and
        ``ssd_model`` as for :meth:`load_safetensors`.

        The GPU queues stay up between GPU calls of this handle (:meth:`release_gpu` or
        :meth:`close` tears them down), so only the first call pays for bringing them up. A
        handle keeps queues per GPU, brought up on first use on each GPU; each GPU's are an
        even share of the controller's I/O queue pairs.
        """
        if offset < 0:
            raise InvalidArgumentError(f"offset must be >= 0, not {offset}")
        b = _gpu_bytes(dst, writable=True, what="dst")
        if b.nbytes == 0:
            return 0
        report = self._d.read_into(
            name, b.ptr, b.nbytes, offset, b.stream, controller, media, ssd_model, b.device
        )
        self.last_io = json.loads(report)
        _log.debug("read_into %s: %s", name, self.last_io)
        return int(self.last_io["bytes"])

    def save(
        self,
        name: str,
        src: Any,
        *,
        force: bool = False,
        controller: str = "emu",
        media: str = "host",
        ssd_model: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Writes the bytes of ``src`` (a contiguous CUDA array on any GPU, as for
        :meth:`read_into`; its GPU issues the writes) as file ``name`` by GPU-issued NVMe
        writes, with the CRC-32C the GPU
        computed recorded as the file's checksum, and syncs. Raises :class:`ExistsError` if
        ``name`` exists, unless ``force``, which replaces it by one commit (the old file
        survives any failure). Work queued on ``src``'s stream is waited for first. Returns the
        report (bytes, seconds, data path, crc32c)."""
        b = _gpu_bytes(src, writable=False, what="src")
        report = json.loads(
            self._d.save(
                name, b.ptr, b.nbytes, b.stream, force, controller, media, ssd_model, b.device
            )
        )
        self.last_io = report
        return report

    def save_safetensors(
        self,
        name: str,
        tensors: Dict[str, Any],
        metadata: Optional[Dict[str, str]] = None,
        *,
        force: bool = False,
        controller: str = "emu",
        media: str = "host",
        ssd_model: Optional[str] = None,
    ) -> Dict[str, Any]:
        """Saves ``{name: tensor}`` (contiguous CUDA tensors, all on one GPU, which issues the
        writes: tensors on several GPUs are :class:`InvalidArgumentError`; torch tensors of any
        safetensors dtype, bfloat16 included, or arrays with ``__cuda_array_interface__``) as
        the ``.safetensors`` file ``name``, readable by ``safetensors.torch.load_file`` and
        :meth:`load_safetensors`: the header is built on the host, the data written by
        GPU-issued NVMe writes from the tensors' memory (no copy through the host), the GPU's
        CRC-32C recorded. ``metadata``: the header's ``__metadata__`` (str to str).
        ``force`` as for :meth:`save`. Returns the report."""
        if not isinstance(tensors, dict):
            raise InvalidArgumentError("tensors must be a dict of name -> tensor")
        meta = dict(metadata or {})
        for k, v in meta.items():
            if not isinstance(k, str) or not isinstance(v, str):
                raise InvalidArgumentError("metadata must map str to str")
        entries, streams, devices, held = [], set(), set(), []
        for tname, t in tensors.items():
            if not isinstance(tname, str):
                raise InvalidArgumentError(f"tensor names must be str, not {tname!r}")
            b = _gpu_bytes(t, writable=False, what=f"tensor {tname!r}")
            if b.dtype is None:
                raise InvalidArgumentError(f"tensor {tname!r}: its dtype has no safetensors name")
            entries.append((tname, b.dtype, b.shape, b.ptr, b.nbytes))
            held.append(b.owner)
            devices.add(b.device)
            if b.stream is not None:
                streams.add(b.stream)
        if len(devices) > 1:
            raise InvalidArgumentError(
                f"the tensors are on GPUs {_gpus_named(list(devices))}: one call saves from one "
                f"GPU (move them onto one, or save each GPU's in a file of its own)"
            )
        if len(streams) > 1:
            raise InvalidArgumentError(
                "the tensors' work is on several streams: synchronize them first"
            )
        stream = next(iter(streams), None)
        report = json.loads(
            self._d.save_safetensors(
                name, entries, meta, stream, force, controller, media, ssd_model,
                next(iter(devices), 0),
            )
        )
        del held
        self.last_io = report
        return report

    def gpu_queues(self, device: Any = 0) -> Dict[str, Any]:
        """Brings this handle's queues of GPU ``device`` up now (an ordinal, ``"cuda:N"`` or
        ``torch.device("cuda", N)``, as for :meth:`load_safetensors`; every GPU call does so on
        first use on its GPU and keeps them: a handle keeps queues per GPU, each GPU's an even
        share of the controller's I/O queue pairs) and describes them: ``descriptors`` (GPU
        pointer, on that GPU, of the ``gpunvme::queue_desc`` array that kernels including
        ``ptx/include/gpunvme.cuh`` take), ``count``, ``depth``, ``max_transfer``, ``nsid``,
        ``lba_size``."""
        return json.loads(self._d.gpu_queues(_cuda_ordinal(device)))

    def release_gpu(self) -> None:
        """Tears down the GPU queues kept between GPU calls, every GPU's (the next GPU call
        brings them up again; :meth:`close` does this too)."""
        self._d.release_gpu()

    def fsck(self, *, repair: bool = False, data: bool = False) -> Dict[str, Any]:
        """Checks the file system; with ``repair`` fixes what can be fixed, with ``data`` also
        reads every file that has a recorded checksum. Raises :class:`CorruptError` (with the
        report as ``.report``) when the file system is inconsistent or file data mismatches."""
        text, consistent, mismatched = self._d.fsck(repair, data)
        report = json.loads(text)
        if not consistent:
            err = CorruptError(
                "the file system is inconsistent"
                + ("" if repair else "; run fsck(repair=True)")
            )
            err.report = report  # type: ignore[attr-defined]
            raise err
        if mismatched:
            err = CorruptError(
                "file data of "
                + ", ".join(mismatched)
                + ": the bytes do not match the CRC-32C recorded when they were written"
            )
            err.report = report  # type: ignore[attr-defined]
            raise err
        return report


def _size_arg(size: Union[None, int, str], what: str) -> Optional[str]:
    """A size argument (bytes as an int, or a string such as ``"4G"``) as the native side
    parses it."""
    if size is None:
        return None
    if isinstance(size, bool) or not isinstance(size, (int, str)):
        raise InvalidArgumentError(
            f"{what} must be a size in bytes or a string such as \"4G\", not {size!r}"
        )
    if isinstance(size, int) and size <= 0:
        raise InvalidArgumentError(f"{what} must be a positive size, not {size}")
    return str(size)


def create_image(
    path: PathLike, size: Union[int, str], *, lba_size: int = 512, force: bool = False
) -> Dict[str, Any]:
    """Makes a sparse image file for the software controller: ``size`` bytes (an int, or a
    string such as ``"64M"``, ``"4G"``), a whole number of ``lba_size``-byte LBAs (open it with
    the same ``lba_size``). An existing file is :class:`ExistsError` unless ``force``, which
    discards its contents (refused with :class:`BusyError` while it is open). Returns what
    ``gpunvme --json image create`` prints: ``path``, ``bytes``, ``lba_size``, ``blocks``,
    ``allocated_bytes``, ``replaced``."""
    return json.loads(
        _native.create_image(os.fspath(path), _size_arg(size, "size"), lba_size, force)
    )


def open(
    device: Union[None, str, List[str]] = None,
    *,
    lba_size: int = 512,
    read_only: bool = False,
    controller_threads: int = 0,
    nsid: int = 1,
    controller_queue_pairs: int = 64,
    create: Union[None, int, str] = None,
    served_reads: str = "auto",
) -> Device:
    """Opens a device and brings its controller up.

    ``device``: a PCI address (bound to vfio-pci), an image file's path, or ``None`` for
    ``./gpunvme.img`` (1 GiB, sparse, created on first use unless ``read_only``); a list of
    them (or a comma-separated string) makes a striped volume, members in order.
    ``create``: a size (bytes, or a string such as ``"4G"``): every image named that does not
    exist yet is made first, sparse, at that size (as :func:`create_image`); an existing one
    is opened as it is. Without it, a missing image is :class:`NotFoundError`.
    ``lba_size``: 512 or 4096, the block size of an image's namespace. ``read_only``: open an
    image under a shared lock with its namespace write-protected; every change (``mkfs``,
    ``put``, ``rm``, ``mv``, ``save``, ``fsck(repair=True)``) is then :class:`ReadOnlyError`
    before anything is touched (docs/python.md). ``controller_threads``: the
    software controller's threads (0: automatic, a quarter of the CPUs up to 4; GPU loads run
    faster with more, up to one per CPU). ``controller_queue_pairs``: I/O queue pairs the
    software controller grants (GPU loads spread over all of them). ``nsid``: the namespace
    blockfs lives on. ``served_reads`` (a ``served:`` device only): who issues loads' and
    ``read_into``'s reads, ``"cpu"`` (this process's CPU on lent queue pairs), ``"gpu"`` (GPU
    threads on served GPU queues) or ``"auto"`` (``GPUNVME_SERVED_READS``, else by size).
    Raises :class:`BusyError` when another process or handle holds the device.
    """
    return Device(
        device,
        lba_size=lba_size,
        read_only=read_only,
        controller_threads=controller_threads,
        nsid=nsid,
        controller_queue_pairs=controller_queue_pairs,
        create=create,
        served_reads=served_reads,
    )
