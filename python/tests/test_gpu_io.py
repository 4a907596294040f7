"""read_into, save and save_safetensors: every refusal of a wrong destination or source
everywhere (no GPU needed: they are refused before any GPU call); on a GPU machine (torch and
safetensors installed) bytes read straight into torch and CuPy memory, files written from it,
and a saved model that safetensors.torch.load_file reads back bit for bit, on both controllers."""

import os

import pytest

import gpunvme


def image(tmp_path, size=256 << 20):
    path = tmp_path / "dev.img"
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


class FakeCai:
    """An object with a CUDA array interface of our choosing (no GPU behind it)."""

    def __init__(self, ptr=0x7F0000000000, shape=(16,), typestr="<u1", strides=None, readonly=False):
        self.__cuda_array_interface__ = {
            "data": (ptr, readonly),
            "shape": shape,
            "typestr": typestr,
            "strides": strides,
            "version": 3,
        }


class HostDlpack:
    """An object that says, through DLPack, that it lives in host memory."""

    def __dlpack_device__(self):
        return (1, 0)

    def __dlpack__(self, stream=None):
        raise AssertionError("never consumed")


def test_wrong_destinations_and_sources_are_refused_by_name(tmp_path):
    with gpunvme.open(image(tmp_path)) as dev:
        dev.mkfs()
        p = tmp_path / "f"
        p.write_bytes(os.urandom(5000))
        dev.put(p, "f")
        with pytest.raises(gpunvme.InvalidArgumentError, match="must be a CUDA array.*bytearray"):
            dev.read_into("f", bytearray(10))
        with pytest.raises(gpunvme.InvalidArgumentError, match="host \\(CPU\\) memory"):
            dev.read_into("f", HostDlpack())
        with pytest.raises(gpunvme.InvalidArgumentError, match="not C-contiguous"):
            dev.read_into("f", FakeCai(shape=(4, 4), strides=(1, 4)))
        with pytest.raises(gpunvme.InvalidArgumentError, match="read-only"):
            dev.read_into("f", FakeCai(readonly=True))
        with pytest.raises(gpunvme.InvalidArgumentError, match="offset"):
            dev.read_into("f", FakeCai(), -1)
        # An empty destination reads nothing and needs no GPU.
        assert dev.read_into("f", FakeCai(shape=(0,))) == 0
        with pytest.raises(gpunvme.InvalidArgumentError, match="must be a dict"):
            dev.save_safetensors("m.safetensors", [FakeCai()])
        with pytest.raises(gpunvme.InvalidArgumentError, match="str to str"):
            dev.save_safetensors("m.safetensors", {"a": FakeCai()}, {"k": 1})
        with pytest.raises(gpunvme.InvalidArgumentError, match="no safetensors name"):
            dev.save_safetensors("m.safetensors", {"a": FakeCai(typestr="<c8")})
        with pytest.raises(gpunvme.InvalidArgumentError, match="controller must be"):
            dev.save("g", FakeCai(), controller="fpga")
        if not gpunvme.cuda_available():
            # Well-formed: refused only because there is no GPU, with the file system untouched.
            with pytest.raises(gpunvme.GpunvmeError, match="no GPU"):
                dev.read_into("f", FakeCai())
            with pytest.raises(gpunvme.GpunvmeError, match="no GPU"):
                dev.save("g", FakeCai())
            with pytest.raises(gpunvme.NotFoundError):
                dev.stat("g")


def torch_cuda():
    if not gpunvme.cuda_available():
        pytest.skip("skipped: no GPU")
    torch = pytest.importorskip("torch")
    if not torch.cuda.is_available():
        pytest.skip("skipped: no GPU (torch sees none)")
    return torch


# As in test_safetensors.py: the GPU-resident model with hbm media (host media needs tmpfs).
CONTROLLERS = [("emu", "host"), ("gpu", "hbm")]


@pytest.mark.parametrize("controller,media", CONTROLLERS)
def test_read_into_and_save_move_bytes_straight_to_and_from_gpu_memory(tmp_path, controller, media):
    torch = torch_cuda()
    blob = os.urandom((3 << 20) + 77)
    kw = {"controller": controller, "media": media}
    with gpunvme.open(image(tmp_path)) as dev:
        dev.mkfs()
        p = tmp_path / "blob"
        p.write_bytes(blob)
        dev.put(p, "d/blob")
        want = torch.frombuffer(bytearray(blob), dtype=torch.uint8)
        dst = torch.empty(len(blob), dtype=torch.uint8, device="cuda")
        assert dev.read_into("d/blob", dst, **kw) == len(blob)
        assert torch.equal(dst.cpu(), want)
        assert dev.last_io["staged"] is False, dev.last_io
        # bfloat16 (no __cuda_array_interface__ in torch), an odd offset, the file ending first.
        tail = torch.zeros(4096, dtype=torch.bfloat16, device="cuda")
        off = len(blob) - 1001
        assert dev.read_into("d/blob", tail, off, **kw) == 1001
        assert torch.equal(tail.view(torch.uint8)[:1001].cpu(), want[off:])
        assert torch.count_nonzero(tail.view(torch.uint8)[1001:]).item() == 0
        with pytest.raises(gpunvme.InvalidArgumentError, match="past the end"):
            dev.read_into("d/blob", tail, len(blob) + 1, **kw)
        # Wrong tensors: on the CPU, not contiguous, needing grad, memory that is not GPU
        # memory, a range past its allocation.
        with pytest.raises(gpunvme.InvalidArgumentError, match="cpu"):
            dev.read_into("d/blob", torch.empty(10, dtype=torch.uint8), **kw)
        with pytest.raises(gpunvme.InvalidArgumentError, match="contiguous"):
            dev.read_into("d/blob", torch.empty(8, 8, device="cuda").t(), **kw)
        with pytest.raises(gpunvme.InvalidArgumentError, match="grad"):
            dev.read_into("d/blob", torch.empty(8, device="cuda", requires_grad=True), **kw)
        with pytest.raises(gpunvme.InvalidArgumentError, match="not CUDA memory"):
            dev.read_into("d/blob", FakeCai(ptr=0x10000), **kw)
        with pytest.raises(gpunvme.InvalidArgumentError, match="past their allocation"):
            dev.read_into("d/blob", FakeCai(ptr=dst.data_ptr(), shape=(1 << 40,)), **kw)

        # A tensor computed on torch's stream just before: saved as it ends up.
        src = (torch.arange(1 << 20, device="cuda", dtype=torch.int32) * 3).to(torch.bfloat16)
        r = dev.save("d/saved", src, **kw)
        assert r["bytes"] == src.numel() * 2
        back = torch.empty_like(src)
        assert dev.read_into("d/saved", back, **kw) == r["bytes"]
        assert torch.equal(back.view(torch.int16), src.view(torch.int16))
        with pytest.raises(gpunvme.ExistsError):
            dev.save("d/saved", src, **kw)
        dev.save("d/saved", src[:10], force=True, **kw)
        assert dev.stat("d/saved")["size"] == 20
        report = dev.fsck(data=True)
        assert report is not None

        cupy = None
        try:
            import cupy  # noqa: F401
        except ImportError:
            pass
        if cupy is not None:
            c = cupy.zeros(len(blob), dtype=cupy.uint8)
            assert dev.read_into("d/blob", c, **kw) == len(blob)
            assert bytes(cupy.asnumpy(c)) == blob
        dev.release_gpu()


@pytest.mark.parametrize("controller,media", CONTROLLERS)
def test_saved_model_loads_back_in_safetensors_and_gpunvme(tmp_path, controller, media):
    torch = torch_cuda()
    st = pytest.importorskip("safetensors.torch")
    from test_safetensors import synthetic_model

    kw = {"controller": controller, "media": media}
    shards = synthetic_model(torch)
    tensors = {k: v.to("cuda") for s in shards for k, v in s.items()}
    with gpunvme.open(image(tmp_path, size=512 << 20)) as dev:
        dev.mkfs()
        r = dev.save_safetensors("m/model.safetensors", tensors, {"format": "pt"}, **kw)
        assert r["bytes"] == dev.stat("m/model.safetensors")["size"]
        # Over an existing name only with force (issue 53's list of destructive calls).
        first = tensors[sorted(tensors)[0]]
        with pytest.raises(gpunvme.ExistsError):
            dev.save_safetensors("m/model.safetensors", {"x": first}, {}, **kw)
        assert r["bytes"] == dev.stat("m/model.safetensors")["size"]
        out = tmp_path / "model.safetensors"
        dev.get("m/model.safetensors", out)
        by_safetensors = st.load_file(str(out), device="cuda:0")
        by_gpunvme = dev.load_safetensors("m/model.safetensors", **kw)
        assert sorted(by_safetensors) == sorted(tensors) == sorted(by_gpunvme)
        for name, want in tensors.items():
            wb = want.contiguous().reshape(-1).view(torch.uint8)
            for got in (by_safetensors[name], by_gpunvme[name]):
                assert got.dtype == want.dtype and got.shape == want.shape, name
                assert torch.equal(got.contiguous().reshape(-1).view(torch.uint8), wb), name
        from safetensors import safe_open

        with safe_open(str(out), framework="pt") as f:
            assert f.metadata() == {"format": "pt"}
