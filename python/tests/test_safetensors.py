"""load_safetensors: header checks and argument errors everywhere; on a GPU machine (torch
and safetensors installed), a sharded synthetic model whose every tensor must equal
safetensors.torch.load_file's, byte for byte, on both controllers."""

import json
import os
import struct

import pytest

import gpunvme


def image(tmp_path, size=256 << 20):
    path = tmp_path / "dev.img"
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


def safetensors_bytes(tensors):
    """A .safetensors file of {name: (dtype, shape, raw bytes)}, written by hand (no torch)."""
    header, data = {"__metadata__": {"format": "pt"}}, b""
    for name, (dtype, shape, raw) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [len(data), len(data) + len(raw)]}
        data += raw
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + data


def put(dev, tmp_path, name, blob):
    p = tmp_path / "blob"
    p.write_bytes(blob)
    dev.put(p, name, force=True)


def test_argument_and_header_errors_need_no_gpu(tmp_path):
    with gpunvme.open(image(tmp_path)) as dev:
        dev.mkfs()
        with pytest.raises(gpunvme.NotFoundError):
            dev.load_safetensors("models/missing")
        with pytest.raises(gpunvme.InvalidArgumentError):
            dev.load_safetensors("x", device="cpu")
        put(dev, tmp_path, "ok.safetensors", safetensors_bytes({"a": ("F32", [2], os.urandom(8))}))
        with pytest.raises(gpunvme.InvalidArgumentError):
            dev.load_safetensors("ok.safetensors", controller="fpga")
        # An SSD timing model that does not parse, or on a controller that cannot time.
        with pytest.raises(gpunvme.InvalidArgumentError, match="ssd_model"):
            dev.load_safetensors("ok.safetensors", controller="gpu", ssd_model="drives=0")
        with pytest.raises(gpunvme.InvalidArgumentError, match="GPU-resident"):
            dev.load_safetensors("ok.safetensors", ssd_model="drives=2")
        # Offsets past the data section, a shape that disagrees with them, not JSON at all.
        bad = safetensors_bytes({"a": ("F32", [4], os.urandom(8))})
        put(dev, tmp_path, "bad/shape.safetensors", bad)
        with pytest.raises(gpunvme.CorruptError, match="is 16 bytes"):
            dev.load_safetensors("bad/shape.safetensors")
        put(dev, tmp_path, "bad/json.safetensors", struct.pack("<Q", 8) + b"not json")
        with pytest.raises(gpunvme.CorruptError, match="header JSON"):
            dev.load_safetensors("bad/json.safetensors")
        put(dev, tmp_path, "bad/len.safetensors", struct.pack("<Q", 1 << 40) + b"{}")
        with pytest.raises(gpunvme.CorruptError, match="header of"):
            dev.load_safetensors("bad/len.safetensors")
        # Two shards that hold one name.
        one = safetensors_bytes({"w": ("U8", [3], b"abc")})
        put(dev, tmp_path, "dup/a.safetensors", one)
        put(dev, tmp_path, "dup/b.safetensors", one)
        with pytest.raises(gpunvme.InvalidArgumentError, match="in both"):
            dev.load_safetensors("dup/")
        if not gpunvme.cuda_available():
            with pytest.raises(gpunvme.GpunvmeError, match="no GPU"):
                dev.load_safetensors("ok.safetensors")


def synthetic_model(torch):
    """Many tensors of realistic shapes and dtypes (bf16, fp16, fp32, int8 and a few odd ones),
    deterministic, in three shards."""
    g = torch.Generator().manual_seed(7)
    shards = [{}, {}, {}]
    hidden, inter, vocab = 256, 704, 1000
    shards[0]["model.embed_tokens.weight"] = torch.randn(vocab, hidden, generator=g).to(torch.bfloat16)
    for layer in range(12):
        s = shards[1 + layer % 2]
        p = f"model.layers.{layer}."
        for proj, shape in [("q", (hidden, hidden)), ("k", (64, hidden)), ("v", (64, hidden)), ("o", (hidden, hidden))]:
            s[p + f"self_attn.{proj}_proj.weight"] = torch.randn(*shape, generator=g).to(torch.bfloat16)
        s[p + "self_attn.q_proj.bias"] = torch.randn(hidden, generator=g).to(torch.float16)
        for proj, shape in [("gate", (inter, hidden)), ("up", (inter, hidden)), ("down", (hidden, inter))]:
            s[p + f"mlp.{proj}_proj.weight"] = torch.randn(*shape, generator=g).to(torch.bfloat16)
        s[p + "input_layernorm.weight"] = torch.randn(hidden, generator=g)
        s[p + "mlp.down_proj.qweight"] = torch.randint(-128, 127, (hidden, 33), generator=g, dtype=torch.int8)
    shards[0]["model.norm.weight"] = torch.randn(hidden, generator=g)
    shards[0]["lm_head.weight"] = torch.randn(vocab, hidden, generator=g).to(torch.float16)
    shards[0]["rope.inv_freq"] = torch.randn(33, generator=g, dtype=torch.float64)
    shards[0]["position_ids"] = torch.arange(1, 4097, dtype=torch.int64).reshape(1, 4096)
    shards[0]["attention.mask"] = torch.rand(3, 5, 7, generator=g) > 0.5
    shards[0]["scale"] = torch.tensor(0.125)
    shards[0]["empty"] = torch.zeros(0, 16)
    return shards


def gpu_torch():
    """(torch, safetensors.torch) on a GPU machine; skips visibly elsewhere."""
    if not gpunvme.cuda_available():
        pytest.skip("skipped: no GPU")
    torch = pytest.importorskip("torch")
    st = pytest.importorskip("safetensors.torch")
    if not torch.cuda.is_available():
        pytest.skip("skipped: no GPU (torch sees none)")
    return torch, st


# The GPU-resident model with hbm media: the image copied into GPU memory when it starts
# (host media needs an image on tmpfs: CUDA does not register writable ext4 mappings).
@pytest.mark.parametrize("controller,media", [("emu", "host"), ("gpu", "hbm")])
def test_sharded_model_matches_safetensors_load_file(tmp_path, controller, media):
    torch, st = gpu_torch()
    shards = synthetic_model(torch)
    with gpunvme.open(image(tmp_path, size=512 << 20)) as dev:
        dev.mkfs()
        paths = []
        for i, s in enumerate(shards):
            p = tmp_path / f"model-{i + 1:05d}-of-00003.safetensors"
            st.save_file(s, str(p))
            dev.put(p, f"models/m/{p.name}")
            paths.append(p)
        dev.put(paths[0], "single.safetensors")
        got = dev.load_safetensors("models/m/", controller=controller, media=media)
        want = {}
        for p in paths:
            want.update(st.load_file(str(p), device="cuda:0"))
        assert sorted(got) == sorted(want)
        for name, w in want.items():
            g = got[name]
            assert g.device.type == "cuda", name
            assert g.dtype == w.dtype and g.shape == w.shape, name
            # Bit for bit (NaNs included): both as bytes.
            gb, wb = (t.contiguous().reshape(-1).view(torch.uint8) for t in (g, w))
            assert torch.equal(gb, wb), name
        report = dev.last_load
        assert report["tensors"] == len(want)
        assert report["bytes"] == sum(t.numel() * t.element_size() for t in want.values())
        # One file by its name; the tensors outlive the handle's GPU queues and each other.
        one = dev.load_safetensors("single.safetensors", controller=controller, media=media)
        assert sorted(one) == sorted(shards[0])
        del got
        torch.cuda.synchronize()
        assert torch.equal(one["model.embed_tokens.weight"].cpu(), shards[0]["model.embed_tokens.weight"])


def test_a_failure_while_the_gpu_reads_is_raised_after_the_reads_and_the_handle_goes_on(tmp_path):
    """The views are built by a callback while the GPU reads into the arena: an exception there
    comes out of the call once the reads are over, and the next load on the handle works."""
    torch, st = gpu_torch()
    shard = synthetic_model(torch)[1]
    with gpunvme.open(image(tmp_path, size=256 << 20)) as dev:
        dev.mkfs()
        p = tmp_path / "m.safetensors"
        st.save_file(shard, str(p))
        dev.put(p, "m.safetensors")
        seen = []

        def views(cap, tensors):
            seen.append(len(tensors))
            raise KeyError("made up while the GPU reads")

        with pytest.raises(KeyError, match="made up"):
            dev._d.load_safetensors("m.safetensors", "emu", "host", None, views)
        assert seen == [len(shard)]
        got = dev.load_safetensors("m.safetensors")
        for name, w in shard.items():
            assert torch.equal(got[name].cpu().view(torch.uint8), w.view(torch.uint8)), name


def test_arena_views_match_slices_of_every_dtype_and_shape():
    """The views load_safetensors hands out, built over a CPU byte arena (torch needed, no
    GPU): each equals the slice of the arena at its offset, viewed as its dtype and shape,
    for every dtype, scalars, empty tensors and the last tensor ending at the arena's end."""
    torch = pytest.importorskip("torch", reason="skipped: torch not installed")
    from gpunvme import _TORCH_DTYPES, _arena_views

    shapes = [[3, 5, 7], [], [0, 4], [64], [2, 1, 3, 1]]
    tensors, at = [], 0
    for i, dtype in enumerate(sorted(_TORCH_DTYPES)):
        if not hasattr(torch, _TORCH_DTYPES[dtype]):
            continue
        td = getattr(torch, _TORCH_DTYPES[dtype])
        shape = shapes[i % len(shapes)]
        nbytes = torch.empty(shape, dtype=td).numel() * torch.empty((), dtype=td).element_size()
        strides = [1] * len(shape)  # C order, in elements, as the native side gives them
        for d in range(len(shape) - 2, -1, -1):
            strides[d] = strides[d + 1] * shape[d + 1]
        tensors.append((f"t{i}", dtype, shape, at, nbytes, strides))
        at += -(-nbytes // 256) * 256
    arena = torch.randint(0, 256, (max(at, 256),), dtype=torch.uint8)
    views = _arena_views(torch, arena, tensors)
    assert list(views) == [t[0] for t in tensors]
    for name, dtype, shape, offset, nbytes, _ in tensors:
        v = views[name]
        want = arena[offset : offset + nbytes].view(getattr(torch, _TORCH_DTYPES[dtype])).reshape(shape)
        assert v.dtype == want.dtype and list(v.shape) == shape, name
        assert v.is_contiguous(), name
        raw = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731 (0-dim too)
        assert torch.equal(raw(v), raw(want)), name
        # A view, not a copy: the tensor's bytes are the arena's.
        if nbytes:
            assert v.data_ptr() == arena.data_ptr() + offset, name


class _FakeTorch:
    """Just enough of torch for gpunvme._arena_views: tensors that remember their byte offset
    in the arena, element size and shape, so the views' arithmetic is checked without torch."""

    float16, float32, int8 = 2, 4, 1

    class Tensor:
        def __init__(self, offset, count, size, shape=None):
            self.offset, self.count, self.size = offset, count, size
            self.shape = [count] if shape is None else shape

        def numel(self):
            return self.count

        def element_size(self):
            return self.size

        def view(self, what):
            if isinstance(what, int):  # a dtype: the whole (byte) tensor retyped
                assert self.offset == 0 and self.size == 1 and self.count % what == 0
                return _FakeTorch.Tensor(0, self.count // what, what)
            n = 1
            for d in what:
                n *= d
            assert n == self.count, f"view {what} of {self.count} elements"
            return _FakeTorch.Tensor(self.offset, self.count, self.size, list(what))

        def as_strided(self, shape, strides, offset):
            n, want = 1, []
            for d in reversed(shape):
                want.insert(0, n)
                n *= d
            assert list(strides) == want, f"strides {strides} of {shape}"
            assert (offset + n) * self.size <= self.count * self.size, "inside the arena"
            return _FakeTorch.Tensor(offset * self.size, n, self.size, list(shape))


def test_arena_views_land_on_each_tensor_in_the_given_order():
    # (name, dtype, shape, offset, nbytes, strides) as the native loader hands them over:
    # 256-aligned, dtypes interleaved, a scalar, an empty tensor, gaps between them.
    tensors = [
        ("b.weight", "F32", [3, 5], 512, 60, [5, 1]),
        ("a.norm", "F16", [7], 0, 14, [1]),
        ("c.scalar", "F32", [], 768, 4, []),
        ("d.empty", "F16", [0, 4], 1024, 0, [4, 1]),
        ("e.q", "I8", [2, 2, 8], 1024, 32, [16, 8, 1]),
        ("f.last", "F16", [64], 1280, 128, [1]),
    ]
    arena = _FakeTorch.Tensor(0, 1536, 1)
    out = gpunvme._arena_views(_FakeTorch, arena, tensors)
    assert list(out) == [t[0] for t in tensors]
    sizes = {"F16": 2, "F32": 4, "I8": 1}
    for name, dtype, shape, offset, nbytes, _strides in tensors:
        v = out[name]
        assert (v.offset, v.size, v.shape) == (offset, sizes[dtype], shape), name
        assert v.count * v.size == nbytes, name
