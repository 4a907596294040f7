"""Which GPU a call uses (issue 55): the tensor's own device for read_into, save and
save_safetensors, ``device=`` for load_safetensors and gpu_queues. Everywhere: how devices are
named and refused (before any GPU is needed); on a GPU machine (torch installed): explicit GPUs
work, a GPU the machine does not have is InvalidArgumentError saying "no GPU N", and on a
machine with two or more GPUs each GPU reads into its own tensors."""

import os
from types import SimpleNamespace

import pytest

import gpunvme
from gpunvme import _cuda_ordinal, _gpu_bytes
from test_safetensors import safetensors_bytes


def image(tmp_path, size=256 << 20):
    path = tmp_path / "dev.img"
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


class Cai:
    """An object with a CUDA array interface, and (as CuPy's arrays) ``device.id`` when
    ``device`` is given; no GPU behind it unless ``ptr`` is a real one."""

    def __init__(self, ptr=0x7F0000000000, nbytes=16, device=None, owner=None):
        self.__cuda_array_interface__ = {
            "data": (ptr, False),
            "shape": (nbytes,),
            "typestr": "<u1",
            "strides": None,
            "version": 3,
        }
        if device is not None:
            self.device = SimpleNamespace(id=device)
        self.owner = owner


class TorchLikeDevice:
    """What torch.device offers (type, index), without torch."""

    def __init__(self, type, index=None):
        self.type, self.index = type, index

    def __repr__(self):
        return f"device(type={self.type!r}, index={self.index!r})"


def test_the_gpu_of_an_array_interface_object_is_its_device_id_else_0():
    assert _gpu_bytes(Cai(device=3), writable=True, what="dst").device == 3
    assert _gpu_bytes(Cai(), writable=True, what="dst").device == 0
    # A device without an int id (a method, a bool, a string) says nothing: GPU 0.
    odd = Cai()
    odd.device = SimpleNamespace(id="1")
    assert _gpu_bytes(odd, writable=True, what="dst").device == 0
    odd.device = SimpleNamespace(id=True)
    assert _gpu_bytes(odd, writable=True, what="dst").device == 0


def test_device_names_parse_to_ordinals_and_everything_else_is_refused():
    assert _cuda_ordinal("cuda") == 0
    assert _cuda_ordinal("cuda:0") == 0
    assert _cuda_ordinal("cuda:7") == 7
    assert _cuda_ordinal(2) == 2
    assert _cuda_ordinal(TorchLikeDevice("cuda", 3)) == 3
    assert _cuda_ordinal(TorchLikeDevice("cuda")) == 0
    for bad in ("cuda:x", "cpu", "cpu:0", "cuda:", "cuda:-1", "cuda:1.0", " cuda:1", "cuda:١",
                "", -1, True, None, 1.0, 1 << 40, TorchLikeDevice("cpu"),
                TorchLikeDevice("cuda", -1)):
        with pytest.raises(gpunvme.InvalidArgumentError, match="device must be a CUDA device"):
            _cuda_ordinal(bad)
    with pytest.raises(gpunvme.InvalidArgumentError, match="'cuda:x'"):
        _cuda_ordinal("cuda:x")


def test_a_bad_device_is_refused_before_the_load_touches_a_gpu(tmp_path):
    with gpunvme.open(image(tmp_path)) as dev:
        dev.mkfs()
        p = tmp_path / "ok.safetensors"
        p.write_bytes(safetensors_bytes({"a": ("F32", [2], os.urandom(8))}))
        dev.put(p, "ok.safetensors")
        for bad in ("cuda:x", "cpu", -1, "cuda:-1"):
            # InvalidArgumentError, not "no GPU" (without a GPU) nor a load (with one).
            with pytest.raises(gpunvme.InvalidArgumentError, match="device must be a CUDA device"):
                dev.load_safetensors("ok.safetensors", device=bad)
            with pytest.raises(gpunvme.InvalidArgumentError, match="device must be a CUDA device"):
                dev.gpu_queues(bad)
        assert dev.last_load is None


def test_tensors_on_several_gpus_are_refused_by_save_safetensors(tmp_path):
    with gpunvme.open(image(tmp_path)) as dev:
        dev.mkfs()
        with pytest.raises(gpunvme.InvalidArgumentError, match="on GPUs 0 and 1"):
            dev.save_safetensors("m.safetensors", {"a": Cai(device=0), "b": Cai(device=1)})
        with pytest.raises(gpunvme.InvalidArgumentError, match="on GPUs 0, 1 and 3"):
            dev.save_safetensors(
                "m.safetensors", {"a": Cai(device=3), "b": Cai(), "c": Cai(device=1)}
            )
        with pytest.raises(gpunvme.NotFoundError):
            dev.stat("m.safetensors")


def test_the_native_calls_refuse_a_negative_device_first(tmp_path):
    with gpunvme.open(image(tmp_path)) as dev:
        dev.mkfs()
        d = dev._d
        ptr = 0x7F0000000000
        match = "device must be a CUDA device ordinal .*not -1"
        with pytest.raises(gpunvme.InvalidArgumentError, match=match):
            d.read_into("f", ptr, 16, 0, None, "emu", "host", None, -1)
        with pytest.raises(gpunvme.InvalidArgumentError, match=match):
            d.read_into("f", ptr, 16, 0, None, "emu", "host", device=-1)
        with pytest.raises(gpunvme.InvalidArgumentError, match=match):
            d.save("g", ptr, 16, None, False, "emu", "host", None, -1)
        with pytest.raises(gpunvme.InvalidArgumentError, match=match):
            d.save_safetensors("m.safetensors", [("a", "U8", [16], ptr, 16)], {}, None, False,
                               "emu", "host", None, -1)
        with pytest.raises(gpunvme.InvalidArgumentError, match=match):
            d.load_safetensors("m.safetensors", "emu", "host", None, lambda c, t: None, -1)
        with pytest.raises(gpunvme.InvalidArgumentError, match=match):
            d.gpu_queues(-1)
        # An array-interface object claiming GPU -1 reaches the native check.
        with pytest.raises(gpunvme.InvalidArgumentError, match=match):
            dev.read_into("f", Cai(device=-1))
        with pytest.raises(gpunvme.NotFoundError):
            dev.stat("g")


def torch_cuda():
    if not gpunvme.cuda_available():
        pytest.skip("skipped: no GPU")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("skipped: no GPU (torch sees none)")
    return torch


def test_explicit_gpus_work_and_a_missing_gpu_is_named(tmp_path):
    torch = torch_cuda()
    missing = torch.cuda.device_count()
    blob = os.urandom((1 << 20) + 5)
    with gpunvme.open(image(tmp_path)) as dev:
        dev.mkfs()
        p = tmp_path / "blob"
        p.write_bytes(blob)
        dev.put(p, "blob")
        want = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        dst = torch.empty(len(blob), dtype=torch.uint8, device="cuda:0")
        assert dev.read_into("blob", dst) == len(blob)
        assert torch.equal(dst.cpu(), want)
        # A CuPy-like object claiming a GPU the machine does not have, over real memory.
        fake = Cai(ptr=dst.data_ptr(), nbytes=len(blob), device=missing, owner=dst)
        with pytest.raises(gpunvme.InvalidArgumentError, match=f"no GPU {missing}"):
            dev.read_into("blob", fake)
        with pytest.raises(gpunvme.InvalidArgumentError, match=f"no GPU {missing}"):
            dev.save("copy", fake)
        with pytest.raises(gpunvme.NotFoundError):
            dev.stat("copy")
        with pytest.raises(gpunvme.InvalidArgumentError, match=f"no GPU {missing}"):
            dev.gpu_queues(missing)
        assert dev.gpu_queues(0)["count"] > 0

        st = safetensors_bytes({"w": ("U8", [4096], os.urandom(4096))})
        p.write_bytes(st)
        dev.put(p, "m.safetensors")
        first = None
        for device in ("cuda:0", 0, torch.device("cuda", 0), "cuda"):
            got = dev.load_safetensors("m.safetensors", device=device)
            assert got["w"].device == torch.device("cuda", 0), device
            if first is None:
                first = got["w"].cpu()
            assert torch.equal(got["w"].cpu(), first), device
        with pytest.raises(gpunvme.InvalidArgumentError, match="no GPU"):
            dev.load_safetensors("m.safetensors", device=f"cuda:{missing}")
        dev.release_gpu()


def test_each_gpu_reads_and_writes_its_own_tensors(tmp_path):
    torch = torch_cuda()
    n = torch.cuda.device_count()
    if n < 2:
        pytest.skip(f"skipped: needs two GPUs, this machine has {n}")
    blob = os.urandom((2 << 20) + 11)
    with gpunvme.open(image(tmp_path)) as dev:
        dev.mkfs()
        p = tmp_path / "blob"
        p.write_bytes(blob)
        dev.put(p, "blob")
        want = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        for g in range(n):
            dst = torch.empty(len(blob), dtype=torch.uint8, device=f"cuda:{g}")
            assert dev.read_into("blob", dst) == len(blob), g
            assert torch.equal(dst.cpu(), want), g
            dev.save(f"copy{g}", dst)
            assert dev.read(f"copy{g}") == blob, g
        # Memory of GPU 1 said to be GPU 0's: the driver names the GPU it is on.
        on1 = torch.empty(4096, dtype=torch.uint8, device="cuda:1")
        with pytest.raises(gpunvme.InvalidArgumentError, match="memory of GPU 1, not of GPU 0"):
            dev.read_into("blob", Cai(ptr=on1.data_ptr(), nbytes=4096, owner=on1))
        with pytest.raises(gpunvme.InvalidArgumentError, match="on GPUs 0 and 1"):
            dev.save_safetensors("m.safetensors", {"a": want.to("cuda:0"), "b": on1})
        p.write_bytes(safetensors_bytes({"w": ("U8", [4096], os.urandom(4096))}))
        dev.put(p, "m.safetensors")
        got0 = dev.load_safetensors("m.safetensors", device="cuda:0")["w"]
        got1 = dev.load_safetensors("m.safetensors", device=torch.device("cuda", 1))["w"]
        assert got1.device == torch.device("cuda", 1)
        assert torch.equal(got0.cpu(), got1.cpu())
        dev.release_gpu()
