"""gpunvme under fastsafetensors (gpunvme.fastsafetensors): a sharded model of several dtypes,
loaded through fastsafetensors' own loader machinery with gpunvme's copier, equals what was
written, byte for byte, on both controllers; fastsafetensors' AutoLoader, configured by file,
does the same from host paths; bad names, headers and arguments fail by kind. Needs torch and
fastsafetensors (the GPU machine; skipped elsewhere, saying so) and, for the loads, a GPU."""

import json
import os
import struct

import pytest

torch = pytest.importorskip("torch", reason="skipped: no torch")
pytest.importorskip("fastsafetensors", reason="skipped: no fastsafetensors")

import gpunvme  # noqa: E402
from gpunvme.fastsafetensors import GpunvmeFileLoader, register_auto_loader  # noqa: E402

needs_gpu = pytest.mark.skipif(not torch.cuda.is_available(), reason="skipped: no GPU")

DTYPES = {torch.bfloat16: "BF16", torch.float16: "F16", torch.float32: "F32", torch.int8: "I8"}


def shard_bytes(tensors):
    """A .safetensors file of {name: tensor} (CPU tensors), written by hand."""
    header, blobs, at = {"__metadata__": {"format": "pt"}}, [], 0
    for name, t in tensors.items():
        raw = t.contiguous().view(torch.uint8).numpy().tobytes()
        header[name] = {"dtype": DTYPES[t.dtype], "shape": list(t.shape),
                        "data_offsets": [at, at + len(raw)]}
        blobs.append(raw)
        at += len(raw)
    h = json.dumps(header).encode()
    h += b" " * (-len(h) % 8)
    return struct.pack("<Q", len(h)) + h + b"".join(blobs)


def model(seed=7):
    """Three shards of tensors of realistic and odd shapes, four dtypes."""
    g = torch.Generator().manual_seed(seed)
    shards = []
    for s in range(3):
        t = {}
        for i in range(12):
            shape = [64 + 17 * i + s, 3 + (i % 5)] if i % 3 else [1000 + i]
            dt = list(DTYPES)[(i + s) % 4]
            if dt == torch.int8:
                t[f"s{s}.t{i}"] = torch.randint(-128, 127, shape, generator=g, dtype=dt)
            else:
                t[f"s{s}.t{i}"] = torch.randn(shape, generator=g).to(dt)
        shards.append(t)
    return shards


def setup_device(tmp_path, shards):
    img = str(tmp_path / "dev.img")
    with open(img, "wb") as f:
        f.truncate(256 << 20)
    paths = []
    with gpunvme.open(img, lba_size=4096) as dev:
        dev.mkfs()
        for i, t in enumerate(shards):
            p = tmp_path / f"model-{i:05d}-of-{len(shards):05d}.safetensors"
            p.write_bytes(shard_bytes(t))
            dev.put(p, f"m/{p.name}")
            paths.append(str(p))
    return img, paths


def same(want, got):
    assert set(want) == set(got)
    for k, w in want.items():
        t = got[k]
        assert t.device.type == "cuda" and t.dtype == w.dtype and list(t.shape) == list(w.shape), k
        assert torch.equal(t.contiguous().view(torch.uint8).cpu(), w.view(torch.uint8)), k


@needs_gpu
@pytest.mark.parametrize("controller", ["emu", "gpu"])
def test_a_sharded_model_loads_byte_identical(tmp_path, controller):
    shards = model()
    img, paths = setup_device(tmp_path, shards)
    want = {k: v for t in shards for k, v in t.items()}
    with gpunvme.open(img, lba_size=4096, read_only=True) as dev:
        loader = GpunvmeFileLoader(dev=dev, device="cuda:0", controller=controller)
        loader.add_filenames({0: [f"m/{os.path.basename(p)}" for p in paths]})
        files = loader.copy_files_to_device()
        got = {k: files.get_tensor(k).clone() for k in loader.get_keys()}
        files.close()
        loader.close()
        assert dev.last_io["bytes"] > 0  # the last shard's read went through read_into
    same(want, got)


@needs_gpu
def test_autoloader_reads_host_paths_from_the_device_by_configuration(tmp_path, monkeypatch):
    from fastsafetensors.auto_loader import AutoLoader

    shards = model(seed=11)
    img, paths = setup_device(tmp_path, shards)
    # The host files go away: only the device holds the model now.
    for p in paths:
        os.unlink(p)
    cfg = tmp_path / "fastsafetensors.json"
    cfg.write_text(json.dumps({"loader": "gpunvme", "use_tqdm_on_load": False,
                               "gpunvme": {"image": img, "prefix": "m/",
                                           "open_options": {"lba_size": 4096}}}))
    monkeypatch.setenv("FASTSAFETENSORS_CONFIG", str(cfg))
    register_auto_loader()
    loader = AutoLoader(None, paths, device="cuda:0")
    try:
        got = {k: t.clone() for k, t in loader.iterate_weights()}
    finally:
        loader.close()
    same({k: v for t in shards for k, v in t.items()}, got)


def test_bad_names_headers_and_arguments_fail_by_kind(tmp_path):
    img, _ = setup_device(tmp_path, model()[:1])
    with gpunvme.open(img, lba_size=4096) as dev:
        p = tmp_path / "junk"
        p.write_bytes(struct.pack("<Q", 1 << 40) + b"{}")
        dev.put(p, "m/huge-header.safetensors")
        p.write_bytes(struct.pack("<Q", 2) + b"[]")
        dev.put(p, "m/not-an-object.safetensors")
    with pytest.raises(gpunvme.InvalidArgumentError, match="cuda"):
        GpunvmeFileLoader(image=img, device="cpu")
    with pytest.raises(gpunvme.InvalidArgumentError, match="not both"):
        GpunvmeFileLoader(device="cuda:0")
    if not torch.cuda.is_available():
        pytest.skip("skipped: no GPU (the header checks need a CUDA device to name)")
    with gpunvme.open(img, lba_size=4096, read_only=True) as dev:
        loader = GpunvmeFileLoader(dev=dev, device="cuda:0")
        with pytest.raises(gpunvme.NotFoundError):
            loader.add_filenames({0: ["m/missing.safetensors"]})
        with pytest.raises(gpunvme.CorruptError, match="header"):
            loader.add_filenames({0: ["m/huge-header.safetensors"]})
        with pytest.raises(gpunvme.CorruptError):
            loader.add_filenames({0: ["m/not-an-object.safetensors"]})
        # Sub-file chunks are refused by name, not read whole.
        name = "m/model-00000-of-00001.safetensors"
        loader.add_filenames({0: [name]})
        meta = loader._metadata_cache[name]
        copier = loader.copier_constructor(meta, loader.device, loader.framework)
        with pytest.raises(gpunvme.InvalidArgumentError, match="whole files"):
            copier.set_chunk([(meta.header_length, meta.size_bytes)], set(meta.tensors))
        loader.close()
