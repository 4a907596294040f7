"""gpunvme from Python: blockfs files on an NVMe namespace.

The device is a PCI function bound to vfio-pci (``"0000:01:00.0"``) or an image file served by
gpunvme's software NVMe controller (a path; ``None`` for ``./gpunvme.img``, created on first
use), as with the ``gpunvme`` CLI's ``--device``::

    import gpunvme

    with gpunvme.open("disk.img") as dev:
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


def cuda_available() -> bool:
    """Whether this machine has a CUDA driver (the GPU calls need one)."""
    return _native.cuda_available()


class Device:
    """An open device and blockfs on one of its namespaces (see :func:`open`).

    A context manager: leaving the ``with`` block closes it, which stops the controller and
    releases the device (a second process, or a second handle, is refused while it is open).
    """

    def __init__(self, native: _native.Device) -> None:
        self._d = native
        #: The last load_safetensors' figures: files, tensors, bytes, seconds, data path.
        self.last_load: Optional[Dict[str, Any]] = None

    def __enter__(self) -> "Device":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        return "<gpunvme.Device closed>" if self.closed else f"<gpunvme.Device {self.describe()}>"

    def close(self) -> None:
        """Stops the controller and releases the device (idempotent)."""
        self._d.close()

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
        """Copies host file ``src`` into the file system as ``name``. With ``force`` an
        existing ``name`` is replaced by one commit (the old version survives any failure)."""
        return json.loads(self._d.put(os.fspath(src), name, force))

    def get(self, name: str, dst: PathLike) -> Dict[str, Any]:
        """Copies ``name`` to host file ``dst``: written beside it under a temporary name and
        renamed into place once complete, so a failed get leaves ``dst`` as it was."""
        return json.loads(self._d.get(name, os.fspath(dst)))

    def stat(self, name: str) -> Dict[str, Any]:
        """``name``'s size, allocation, extents, checksum and generation."""
        return json.loads(self._d.stat(name))

    def rm(self, name: str) -> Dict[str, Any]:
        """Removes ``name``."""
        return json.loads(self._d.rm(name))

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
        one batch, and each tensor is a view into it (the allocation is freed with the last of
        them). Returns ``{name: torch.Tensor}`` like ``safetensors.torch.load_file``.

        ``controller``: ``"emu"`` (the device's own controller) or ``"gpu"`` (the GPU-resident
        controller model, with ``media`` ``"host"`` or ``"hbm"``, and optionally an SSD timing
        model such as ``"drives=4,bw=14GB/s,iops=2500000"``, the CLI's ``--ssd-model``). The
        load's figures (bytes,
        seconds, data path) are in :attr:`last_load` and logged at DEBUG on ``gpunvme``.
        torch is imported here, not at package import.
        """
        if str(device) not in ("cuda", "cuda:0"):
            raise InvalidArgumentError(f"device must be cuda:0 (GPU 0), not {device!r}")
        cap, tensors, report = self._d.load_safetensors(
            name_or_prefix, controller, media, ssd_model
        )
        import torch  # a run-time dependency of this call only

        arena = torch.from_dlpack(cap)
        out: Dict[str, Any] = {}
        for name, dtype, shape, offset, nbytes in tensors:
            t = arena[offset : offset + nbytes].view(getattr(torch, _TORCH_DTYPES[dtype]))
            out[name] = t.reshape(shape)
        self.last_load = json.loads(report)
        _log.debug("load_safetensors %s: %s", name_or_prefix, self.last_load)
        return out

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


def open(
    device: Union[None, str, List[str]] = None,
    *,
    lba_size: int = 512,
    read_only: bool = False,
    controller_threads: int = 0,
    nsid: int = 1,
    controller_queue_pairs: int = 64,
) -> Device:
    """Opens a device and brings its controller up.

    ``device``: a PCI address (bound to vfio-pci), an image file's path, or ``None`` for
    ``./gpunvme.img`` (1 GiB, sparse, created on first use unless ``read_only``); a list of
    them (or a comma-separated string) makes a striped volume, members in order.
    ``lba_size``: 512 or 4096, the block size of an image's namespace. ``read_only``: open an
    image under a shared lock with its namespace write-protected. ``controller_threads``: the
    software controller's threads (0: automatic, a quarter of the CPUs up to 4; GPU loads run
    faster with more, up to one per CPU). ``controller_queue_pairs``: I/O queue pairs the
    software controller grants (GPU loads spread over all of them). ``nsid``: the namespace
    blockfs lives on.
    Raises :class:`BusyError` when another process or handle holds the device.
    """
    if isinstance(device, (list, tuple)):
        device = ",".join(os.fspath(d) for d in device)
    elif device is not None:
        device = os.fspath(device)
    return Device(
        _native.Device(
            device, lba_size, read_only, controller_threads, nsid, controller_queue_pairs
        )
    )
