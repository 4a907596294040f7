"""gpunvme under fastsafetensors: its loaders read ``.safetensors`` files from a gpunvme device,
each file's data section moved by GPU-issued NVMe reads straight into the GPU buffer
fastsafetensors allocated for it; fastsafetensors then makes the tensors (and, in a process
group, shards and broadcasts them) as it does for files on a host file system.

Needs fastsafetensors (0.5) and PyTorch, imported by this module only; tensors go to CUDA
devices only. Three ways in:

- ``GpunvmeFileLoader``, fastsafetensors' ``SafeTensorsFileLoader`` for files on a gpunvme
  device::

      import gpunvme
      from gpunvme.fastsafetensors import GpunvmeFileLoader

      with gpunvme.open("models.img", read_only=True) as dev:
          loader = GpunvmeFileLoader(dev=dev, device="cuda:0")
          loader.add_filenames({0: ["llama/model-00001-of-00002.safetensors",
                                    "llama/model-00002-of-00002.safetensors"]})
          files = loader.copy_files_to_device()
          w = files.get_tensor("model.embed_tokens.weight")

- the copier type ``"gpunvme"`` (registered with fastsafetensors when this module is
  imported), for loaders built on ``BaseSafeTensorsFileLoader``;
- ``register_auto_loader()``: fastsafetensors' ``AutoLoader`` (configured by the file
  ``FASTSAFETENSORS_CONFIG`` names) then accepts ``"loader": "gpunvme"``, with a ``"gpunvme"``
  section of ``GpunvmeFileLoader``'s keyword arguments (``image``, ``prefix``, ...): a serving
  stack that loads through ``AutoLoader`` reads its weights from gpunvme by configuration plus
  this one call. With ``prefix``, the loader maps the host paths it is given
  (``/models/llama/model-00001-of-00002.safetensors``) to names on the device
  (``prefix + "model-00001-of-00002.safetensors"``).

Each file is read whole from its first 4 KiB boundary at or before the data section (its
header's tail comes along, unused), so that every Read starts on a block boundary; the tensors
are views into that buffer. Errors are gpunvme's exceptions (``NotFoundError``,
``CorruptError`` for a header fastsafetensors refuses, ...).
"""

import json
import os
from typing import Any, Dict, List, Mapping, Optional

import fastsafetensors  # noqa: F401  (ImportError: pip install fastsafetensors)
import torch
from fastsafetensors.common import SafeTensorsMetadata
from fastsafetensors.copier.base import CopierInterface, DummyDeviceBuffer
from fastsafetensors.copier.registry import register_copier_constructor
from fastsafetensors.frameworks import get_framework_op
from fastsafetensors.loader import BaseSafeTensorsFileLoader
from fastsafetensors.st_types import DeviceType, DType

import gpunvme

__all__ = ["GpunvmeFileCopier", "GpunvmeFileLoader", "register_auto_loader"]

#: Reads start at a multiple of this (the largest LBA size gpunvme formats with).
ALIGN = 4096
#: Largest header fastsafetensors itself accepts.
MAX_HEADER = 100_000_000


class GpunvmeFileCopier(CopierInterface):
    """One file's data section, read from device ``dev`` into a GPU buffer by GPU-issued
    commands (``Device.read_into`` on the buffer fastsafetensors allocates)."""

    def __init__(self, metadata, device, dev, framework, controller, media, ssd_model):
        self.metadata = metadata
        self.device = device
        self.dev = dev
        self.framework = framework
        self.serving = (controller, media, ssd_model)
        self.start = metadata.header_length - metadata.header_length % ALIGN

    def set_chunk(self, byte_ranges, names, allocation_size=None):
        """Sub-file chunks (fastsafetensors' ``max_batch_bytes``, ``device_memory_budget``)
        are not read by this copier: refused by name rather than read whole."""
        raise gpunvme.InvalidArgumentError(
            "the gpunvme copier reads whole files: unset fastsafetensors' max_batch_bytes "
            "and device_memory_budget"
        )

    def submit_io(self, use_buf_register: bool, max_copy_block_size: int):
        length = self.metadata.size_bytes - self.start
        if length == 0:
            return DummyDeviceBuffer()
        gbuf = self.framework.alloc_tensor_memory(length, self.device)
        try:
            # Work torch queued on this memory before (the caching allocator's last user)
            # runs first: the read waits for the current stream.
            stream = torch.cuda.current_stream(self.device.as_str()).cuda_stream
            controller, media, ssd_model = self.serving
            report = self.dev._d.read_into(
                self.metadata.src,
                gbuf.get_base_address(),
                length,
                self.start,
                stream,
                controller,
                media,
                ssd_model,
                getattr(self.device, "index", None) or 0,
            )
        except BaseException:
            self.framework.free_tensor_memory(gbuf, self.device)
            raise
        # Where the figures of the device's last GPU I/O always are (see Device.read_into).
        self.dev.last_io = json.loads(report)
        return gbuf

    def wait_io(self, gbuf, dtype: DType = DType.AUTO, noalign: bool = False, owner=None):
        # read_into returned with the bytes in place.
        return self.metadata.get_tensors(gbuf, self.device, self.start, dtype=dtype, owner=owner)


@register_copier_constructor("gpunvme", GpunvmeFileCopier)
def new_gpunvme_file_copier(
    device,
    gpunvme_device=None,
    controller: str = "emu",
    media: str = "host",
    ssd_model: Optional[str] = None,
    **_: Any,
):
    """fastsafetensors' factory for copier type ``"gpunvme"``: copiers reading from the open
    gpunvme device ``gpunvme_device``, served as ``controller``/``media``/``ssd_model`` say
    (as for ``Device.load_safetensors``)."""
    if gpunvme_device is None:
        raise gpunvme.InvalidArgumentError(
            "copier 'gpunvme' needs gpunvme_device=, an open gpunvme.Device"
        )

    def construct_copier(metadata, device, framework):
        return GpunvmeFileCopier(
            metadata, device, gpunvme_device, framework, controller, media, ssd_model
        )

    return construct_copier


def _metadata(dev, name: str, framework) -> SafeTensorsMetadata:
    """fastsafetensors' metadata of file ``name`` on ``dev``: its header read on the host."""
    size = int(dev.stat(name)["size"])
    head = dev.read(name, 0, 8)
    if len(head) < 8:
        raise gpunvme.CorruptError(f"{name}: {size} bytes, too short for a safetensors header")
    n = int.from_bytes(head, "little")
    if n > MAX_HEADER or n > size - 8:
        raise gpunvme.CorruptError(
            f"{name}: a header of {n} bytes in a file of {size} bytes"
        )
    raw = dev.read(name, 8, n)
    try:
        return SafeTensorsMetadata(raw.decode("utf-8"), n + 8, size, framework, src=name)
    except Exception as e:  # fastsafetensors raises bare Exceptions (and JSON/UTF-8 errors)
        raise gpunvme.CorruptError(f"{name}: {e}") from e


class GpunvmeFileLoader(BaseSafeTensorsFileLoader):
    """fastsafetensors' file loader for ``.safetensors`` files on a gpunvme device.

    ``dev``: an open ``gpunvme.Device`` (the caller closes it); or ``image``: a device spec
    to open read-only here (``open_options`` more arguments of ``gpunvme.open``; closed by
    :meth:`close`). ``prefix``: names given to :meth:`add_filenames` are host paths whose
    base names are files under this prefix on the device (without it they are device names).
    ``controller``, ``media`` and ``ssd_model`` as for ``Device.load_safetensors``. The rest
    as for fastsafetensors' loaders; ``device`` must be a CUDA device.
    """

    @classmethod
    def process_extension_config(
        cls, ext_config: Mapping[str, Any], **kwargs: Any
    ) -> Dict[str, Any]:
        """The ``"gpunvme"`` section of a fastsafetensors config: this class's keywords."""
        return dict(ext_config)

    def __init__(
        self,
        pg: Optional[Any] = None,
        device: str = "cuda:0",
        *,
        dev: Optional["gpunvme.Device"] = None,
        image: Optional[str] = None,
        prefix: str = "",
        controller: str = "emu",
        media: str = "host",
        ssd_model: Optional[str] = None,
        open_options: Optional[Mapping[str, Any]] = None,
        framework: str = "pytorch",
        debug_log: bool = False,
        set_numa: bool = False,
        disable_cache: bool = True,
        **kwargs: Any,
    ):
        if (dev is None) == (image is None):
            raise gpunvme.InvalidArgumentError(
                "GpunvmeFileLoader needs dev= (an open gpunvme.Device) or image= (a device "
                "to open read-only), not both"
            )
        if framework not in ("pytorch", "pt", "torch"):
            raise gpunvme.InvalidArgumentError(
                f"GpunvmeFileLoader loads into PyTorch tensors, not {framework!r}"
            )
        fw = get_framework_op(framework)
        target = fw.get_device(device, fw.get_process_group(pg))
        if target.type != DeviceType.CUDA:
            raise gpunvme.InvalidArgumentError(
                f"GpunvmeFileLoader reads into GPU memory: device must be cuda, not {device!r}"
            )
        self._owned = None
        if dev is None:
            dev = gpunvme.open(image, read_only=True, **dict(open_options or {}))
            self._owned = dev
        self.gpunvme_device = dev
        self.prefix = prefix
        try:
            super().__init__(
                pg,
                target,
                "gpunvme",
                set_numa=set_numa,
                disable_cache=disable_cache,
                framework=framework,
                gpunvme_device=dev,
                controller=controller,
                media=media,
                ssd_model=ssd_model,
                **kwargs,
            )
        except BaseException:
            self._close_owned()
            raise

    def device_name(self, path: str) -> str:
        """The device's name for ``path`` (see ``prefix``)."""
        return self.prefix + os.path.basename(path) if self.prefix else path

    def add_filenames(self, filenames: Dict[int, List[str]]):
        """Registers files to ranks, as fastsafetensors' loaders do; each header is read from
        the device now (so a missing file or a bad header fails here, by name)."""
        mapped = {
            rank: [self.device_name(p) for p in paths] for rank, paths in filenames.items()
        }
        for paths in mapped.values():
            for name in paths:
                if name not in self._metadata_cache:
                    self._metadata_cache[name] = _metadata(
                        self.gpunvme_device, name, self.framework
                    )
        return super().add_filenames(mapped)

    def _close_owned(self):
        if self._owned is not None:
            self._owned.close()
            self._owned = None

    def close(self):
        """Releases the loader, and the device if it opened it."""
        try:
            super().close()
        finally:
            self._close_owned()


def register_auto_loader() -> None:
    """Makes fastsafetensors' ``AutoLoader`` accept ``"loader": "gpunvme"`` (configured by a
    ``"gpunvme"`` section of ``GpunvmeFileLoader``'s keywords, e.g. ``{"image":
    "/data/models.img", "prefix": "llama/"}``). Uses AutoLoader's loader table, which
    fastsafetensors does not export: checked here, with a clear error if a later version
    changed it."""
    import fastsafetensors.auto_loader as auto

    table = getattr(auto, "_LOADER_REGISTRY", None)
    if not isinstance(table, dict):
        raise gpunvme.GpunvmeError(
            "this fastsafetensors has no AutoLoader loader table (_LOADER_REGISTRY): "
            "use GpunvmeFileLoader directly"
        )
    table["gpunvme"] = "GpunvmeFileLoader"
    auto.GpunvmeFileLoader = GpunvmeFileLoader
