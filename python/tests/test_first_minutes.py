"""A newcomer's first minutes from Python (issue 54): images of a given size, errors worded for
a Python caller, exceptions that cross process boundaries, the constructor, and the calls the
CLI has (``mv``, ``df``). Each test asserts what is on disk or in the exception."""

import os
import pickle

import pytest

import gpunvme


def test_the_readme_example_works_from_an_empty_directory(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    data = os.urandom(1 << 20)
    (tmp_path / "model.safetensors").write_bytes(data)
    # The README's first example, as a user runs it.
    with gpunvme.open("disk.img", create="1G") as dev:
        dev.mkfs()
        dev.put("model.safetensors", "models/a.safetensors")
        listed = dev.ls("models/")
        size = dev.stat("models/a.safetensors")["size"]
        dev.get("models/a.safetensors", "copy.safetensors")
    assert [f["name"] for f in listed] == ["models/a.safetensors"]
    assert size == len(data)
    assert (tmp_path / "copy.safetensors").read_bytes() == data
    st = os.stat(tmp_path / "disk.img")
    assert st.st_size == 1 << 30
    assert st.st_blocks * 512 < 64 << 20, "the image must be sparse"
    # Opened again with create=: the existing image (and its files) as it is.
    with gpunvme.open("disk.img", create="4G") as dev:
        assert [f["name"] for f in dev.ls()] == ["models/a.safetensors"]
    assert os.stat(tmp_path / "disk.img").st_size == 1 << 30


def test_a_missing_image_says_how_to_make_it_in_python_terms(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    with pytest.raises(gpunvme.NotFoundError) as e:
        gpunvme.open("disk.img")
    msg = str(e.value)
    assert "image disk.img does not exist" in msg
    assert "gpunvme.open(path, create=SIZE)" in msg
    assert "--" not in msg and "truncate" not in msg, msg
    assert not (tmp_path / "disk.img").exists()
    # The default image, read-only: nothing to read, and no CLI command named.
    with pytest.raises(gpunvme.NotFoundError) as e:
        gpunvme.open(None, read_only=True)
    assert "gpunvme.img does not exist" in str(e.value)
    assert "`gpunvme" not in str(e.value) and "--" not in str(e.value), str(e.value)
    assert not (tmp_path / "gpunvme.img").exists()


def test_create_image_makes_a_sparse_image_and_refuses_an_existing_file(tmp_path):
    path = tmp_path / "disk.img"
    rep = gpunvme.create_image(path, "4G", lba_size=4096)
    assert rep["bytes"] == 4 << 30 and rep["blocks"] == 1 << 20 and rep["lba_size"] == 4096
    assert rep["replaced"] is False
    assert os.stat(path).st_size == 4 << 30
    assert os.stat(path).st_blocks * 512 < 1 << 20
    with gpunvme.open(path, lba_size=4096) as dev:
        dev.mkfs()
        dev.put(__file__, "t.py")
    with pytest.raises(gpunvme.ExistsError) as e:
        gpunvme.create_image(path, 64 << 20)
    assert "force=True" in str(e.value) and "--force" not in str(e.value)
    assert os.stat(path).st_size == 4 << 30
    # Refused while open, even with force.
    with gpunvme.open(path, lba_size=4096):
        with pytest.raises(gpunvme.BusyError):
            gpunvme.create_image(path, 64 << 20, force=True)
    assert os.stat(path).st_size == 4 << 30
    rep = gpunvme.create_image(path, 64 << 20, force=True)
    assert rep["replaced"] is True and os.stat(path).st_size == 64 << 20
    with gpunvme.open(path) as dev:
        with pytest.raises(gpunvme.NoFileSystemError):
            dev.ls()
    # Bad sizes: refused, nothing made.
    for size, lba in ((1000, 512), ("4Q", 512), (512, 4096), (0, 512), (-1, 512)):
        with pytest.raises(gpunvme.InvalidArgumentError):
            gpunvme.create_image(tmp_path / "bad.img", size, lba_size=lba)
        assert not (tmp_path / "bad.img").exists()
    with pytest.raises(gpunvme.InvalidArgumentError):
        gpunvme.open(tmp_path / "bad.img", create="1000")
    assert not (tmp_path / "bad.img").exists()


@pytest.mark.parametrize("name", [
    "GpunvmeError", "BusyError", "NotFoundError", "ExistsError", "NoSpaceError",
    "ReadOnlyError", "NoFileSystemError", "CorruptError", "InvalidArgumentError",
    "HostIoError", "ImageError", "DeviceError", "RefusedError", "ClosedError",
])
def test_exceptions_are_gpunvme_classes_that_pickle(name):
    cls = getattr(gpunvme, name)
    assert cls.__module__ == "gpunvme"
    back = pickle.loads(pickle.dumps(cls("what happened")))
    assert type(back) is cls and str(back) == "what happened"


def test_a_raised_error_crosses_a_process_boundary(tmp_path):
    with pytest.raises(gpunvme.NotFoundError) as e:
        gpunvme.open(tmp_path / "missing.img")
    back = pickle.loads(pickle.dumps(e.value))
    assert type(back) is gpunvme.NotFoundError and str(back) == str(e.value)
    assert isinstance(back, gpunvme.GpunvmeError)


def test_device_constructor_opens_like_open(tmp_path):
    path = tmp_path / "disk.img"
    with gpunvme.Device(str(path), create=64 << 20) as dev:
        dev.mkfs()
        assert dev.ls() == []
        assert "disk.img" in dev.describe()
    with pytest.raises(gpunvme.NotFoundError):
        gpunvme.Device(str(tmp_path / "x.img"))


def test_a_second_handle_in_this_process_is_named_as_such(tmp_path):
    path = tmp_path / "disk.img"
    with gpunvme.open(path, create="64M"):
        with pytest.raises(gpunvme.BusyError) as e:
            gpunvme.open(path)
        msg = str(e.value)
        assert "already open in this process" in msg, msg
        assert f"process {os.getpid()}" not in msg, msg
        # The same image twice in one volume.
        with pytest.raises(gpunvme.BusyError) as e:
            gpunvme.open([path, path])
        assert "already open in this process" in str(e.value)


def test_mv_and_df(tmp_path):
    with gpunvme.open(tmp_path / "disk.img", create="64M") as dev:
        dev.mkfs()
        free = dev.df()["available_bytes"]
        assert dev.df()["files"] == 0
        dev.put(__file__, "a")
        dev.put(__file__, "b")
        assert dev.df()["files"] == 2 and dev.df()["available_bytes"] < free
        assert dev.mv("a", "c") == {"from": "a", "to": "c"}
        assert [f["name"] for f in dev.ls()] == ["b", "c"]
        with pytest.raises(gpunvme.ExistsError):
            dev.mv("b", "c")
        with pytest.raises(gpunvme.NotFoundError):
            dev.mv("nope", "d")
        dev.mv("b", "c", force=True)
        assert [f["name"] for f in dev.ls()] == ["c"]
        assert dev.read("c") == open(__file__, "rb").read()
    with gpunvme.open(tmp_path / "disk.img", read_only=True) as dev:
        with pytest.raises(gpunvme.ReadOnlyError):
            dev.mv("c", "d")
        assert dev.df()["files"] == 1


def test_a_full_host_file_system_is_no_space_error(tmp_path):
    import subprocess

    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mnt)],
                       capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here (needs root)")
    try:
        big = tmp_path / "big"
        big.write_bytes(os.urandom(16 << 20))
        with gpunvme.open(mnt / "disk.img", create="64M") as dev:
            dev.mkfs()
            with pytest.raises(gpunvme.NoSpaceError) as e:
                dev.put(big, "big")
            msg = str(e.value)
            assert "no space left on the host file system holding" in msg, msg
            assert "disk.img (ENOSPC" in msg, msg
            assert dev.ls() == []
            assert dev.fsck()["consistent"] is True
    finally:
        subprocess.run(["umount", str(mnt)])
