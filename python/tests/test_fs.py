"""The file-system calls and every error kind, on the software controller over image files
(no GPU needed). Each test asserts what is on the device afterwards, not only return values."""

import os
import threading

import pytest

import gpunvme


def image(tmp_path, size=64 << 20, name="dev.img"):
    path = tmp_path / name
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


@pytest.fixture
def dev(tmp_path):
    with gpunvme.open(image(tmp_path)) as d:
        d.mkfs()
        yield d


def host_file(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def test_put_get_ls_stat_rm_round_trip(dev, tmp_path):
    data = os.urandom(3 * 1024 * 1024 + 123)
    rep = dev.put(host_file(tmp_path, "src", data), "dir/a.bin")
    assert rep["bytes"] == len(data)
    names = [f["name"] for f in dev.ls()]
    assert names == ["dir/a.bin"]
    assert [f["name"] for f in dev.ls("dir/")] == ["dir/a.bin"]
    assert dev.ls("other/") == []
    st = dev.stat("dir/a.bin")
    assert st["size"] == len(data)
    out = tmp_path / "out"
    dev.get("dir/a.bin", out)
    assert out.read_bytes() == data
    dev.rm("dir/a.bin")
    assert dev.ls() == []
    with pytest.raises(gpunvme.NotFoundError):
        dev.stat("dir/a.bin")


def test_read_returns_bytes_like_a_file(dev, tmp_path):
    data = os.urandom(70_000)
    dev.put(host_file(tmp_path, "src", data), "a.bin")
    assert dev.read("a.bin", 0, 8) == data[:8]
    assert dev.read("a.bin", 65_530, 100) == data[65_530:65_630]  # across blocks
    assert dev.read("a.bin") == data
    assert dev.read("a.bin", 69_990) == data[69_990:]
    assert dev.read("a.bin", 69_990, 1 << 40) == data[69_990:]  # short at the end
    assert dev.read("a.bin", 70_000) == b""
    assert dev.read("a.bin", 1 << 50, 8) == b""
    with pytest.raises(gpunvme.NotFoundError):
        dev.read("missing", 0, 8)
    with pytest.raises(gpunvme.InvalidArgumentError):
        dev.read("a.bin", -1, 8)
    with pytest.raises(gpunvme.InvalidArgumentError):
        dev.read("a.bin", 0, -8)


def test_files_survive_close_and_reopen(tmp_path):
    path = image(tmp_path)
    data = os.urandom(100_000)
    with gpunvme.open(path, lba_size=4096) as d:
        d.mkfs()
        d.put(host_file(tmp_path, "src", data), "kept")
    with gpunvme.open(path, lba_size=4096, read_only=True) as d:
        d.get("kept", tmp_path / "back")
        assert d.fsck(data=True)["consistent"] is True
    assert (tmp_path / "back").read_bytes() == data


def test_not_found(dev, tmp_path):
    with pytest.raises(gpunvme.NotFoundError) as e:
        dev.get("missing", tmp_path / "x")
    assert "missing" in str(e.value)
    assert not (tmp_path / "x").exists()
    with pytest.raises(gpunvme.NotFoundError):
        dev.rm("missing")


def test_exists_unless_forced(dev, tmp_path):
    dev.put(host_file(tmp_path, "one", b"first"), "f")
    with pytest.raises(gpunvme.ExistsError):
        dev.put(host_file(tmp_path, "two", b"second"), "f")
    dev.get("f", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == b"first"
    dev.put(tmp_path / "two", "f", force=True)
    dev.get("f", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == b"second"


def test_no_space_loses_nothing(tmp_path):
    with gpunvme.open(image(tmp_path, size=8 << 20)) as d:
        d.mkfs()
        d.put(host_file(tmp_path, "small", b"x" * 1000), "small")
        with pytest.raises(gpunvme.NoSpaceError):
            d.put(host_file(tmp_path, "big", os.urandom(16 << 20)), "big")
        assert [f["name"] for f in d.ls()] == ["small"]
        assert d.fsck()["consistent"] is True


def test_busy_while_another_handle_holds_the_image(tmp_path):
    path = image(tmp_path)
    with gpunvme.open(path) as d:
        d.mkfs()
        with pytest.raises(gpunvme.BusyError):
            gpunvme.open(path)
    # Released on close: a new handle opens it.
    with gpunvme.open(path) as d:
        assert d.ls() == []


def test_no_file_system_and_refused_mkfs(tmp_path):
    path = image(tmp_path)
    with gpunvme.open(path) as d:
        with pytest.raises(gpunvme.NoFileSystemError):
            d.ls()
        d.mkfs()
        d.put(host_file(tmp_path, "src", b"keep me"), "k")
        with pytest.raises(gpunvme.RefusedError):
            d.mkfs()
        assert [f["name"] for f in d.ls()] == ["k"]
        d.mkfs(force=True)
        assert d.ls() == []


def test_corrupt_metadata_is_reported(tmp_path):
    path = image(tmp_path)
    with gpunvme.open(path) as d:
        d.mkfs()
        d.put(host_file(tmp_path, "src", b"data" * 1000), "f")
    # Flip bytes inside both superblock slots (blocks 0 and 1 of 4 KiB), past their magic.
    with open(path, "r+b") as f:
        for slot in (0, 4096):
            f.seek(slot + 64)
            old = f.read(16)
            f.seek(slot + 64)
            f.write(bytes(b ^ 0xFF for b in old))
    with gpunvme.open(path) as d:
        with pytest.raises((gpunvme.CorruptError, gpunvme.NoFileSystemError)) as e:
            d.ls()
        assert isinstance(e.value, gpunvme.GpunvmeError)


def test_invalid_arguments(dev, tmp_path):
    src = host_file(tmp_path, "src", b"abc")
    with pytest.raises(gpunvme.InvalidArgumentError):
        dev.put(src, "")
    with pytest.raises(gpunvme.InvalidArgumentError):
        dev.put(tmp_path, "a-directory")
    with pytest.raises(gpunvme.InvalidArgumentError):
        gpunvme.open(image(tmp_path, name="other.img"), lba_size=1000)
    with pytest.raises(gpunvme.InvalidArgumentError, match="controller_queue_pairs"):
        gpunvme.open(image(tmp_path, name="other.img"), controller_queue_pairs=0)
    assert dev.ls() == []


def test_host_errors_and_missing_images(dev, tmp_path):
    with pytest.raises(gpunvme.HostIoError):
        dev.put(tmp_path / "no-such-host-file", "x")
    with pytest.raises(gpunvme.GpunvmeError):
        gpunvme.open(str(tmp_path / "no-such.img"))


def test_get_onto_the_own_image_is_refused(tmp_path):
    path = image(tmp_path)
    with gpunvme.open(path) as d:
        d.mkfs()
        d.put(host_file(tmp_path, "src", b"x" * 5000), "f")
        with pytest.raises(gpunvme.RefusedError):
            d.get("f", path)
        assert d.fsck()["consistent"] is True


def test_closed_handle(tmp_path):
    d = gpunvme.open(image(tmp_path))
    # Where the open and the close went: every phase named, none negative, the first close's
    # figures kept by the second (which finds nothing to close).
    assert set(d.open_phases) == {"transport", "controller", "block_devices"}
    assert all(v >= 0 for v in d.open_phases.values()) and d.open_phases["transport"] > 0
    assert d.close_phases is None
    d.close()
    first = dict(d.close_phases)
    assert set(first) == {"gpu_queues", "block_devices", "controllers"}
    assert all(v >= 0 for v in first.values()) and first["controllers"] > 0
    d.close()
    assert d.close_phases == first
    assert d.closed
    with pytest.raises(gpunvme.ClosedError):
        d.ls()


def test_calls_release_the_gil(dev, tmp_path):
    # A Python thread keeps running while a call waits on the device.
    data = os.urandom(32 << 20)
    src = host_file(tmp_path, "big", data)
    ticks = []
    stop = threading.Event()

    def tick():
        while not stop.is_set():
            ticks.append(1)
            stop.wait(0.001)

    t = threading.Thread(target=tick)
    t.start()
    try:
        before = len(ticks)
        dev.put(src, "big")
        during = len(ticks) - before
    finally:
        stop.set()
        t.join()
    assert during > 0
    dev.get("big", tmp_path / "back")
    assert (tmp_path / "back").read_bytes() == data


def test_exceptions_form_one_hierarchy():
    for cls in (
        gpunvme.BusyError,
        gpunvme.NotFoundError,
        gpunvme.ExistsError,
        gpunvme.NoSpaceError,
        gpunvme.CorruptError,
        gpunvme.NoFileSystemError,
        gpunvme.InvalidArgumentError,
        gpunvme.HostIoError,
        gpunvme.RefusedError,
        gpunvme.ClosedError,
    ):
        assert issubclass(cls, gpunvme.GpunvmeError)
    assert issubclass(gpunvme.GpunvmeError, Exception)


def test_a_striped_volume_over_three_images(tmp_path):
    paths = [image(tmp_path, size=32 << 20, name=f"m{i}.img") for i in range(3)]
    data = os.urandom(5 * 1024 * 1024 + 77)
    with gpunvme.open(paths) as dev:
        dev.mkfs(stripe=65536)
        dev.put(host_file(tmp_path, "src", data), "v/data")
    # Assembled again, also from a comma-separated string.
    with gpunvme.open(",".join(paths), read_only=True) as dev:
        dev.get("v/data", tmp_path / "back")
        assert dev.fsck(data=True)["consistent"] is True
    assert (tmp_path / "back").read_bytes() == data
    # A member alone, the members out of order, one missing: refused by name, nothing written.
    with gpunvme.open(paths[0]) as one:
        with pytest.raises(gpunvme.RefusedError, match="member 0 of a 3-member"):
            one.ls()
    with gpunvme.open([paths[1], paths[0], paths[2]]) as wrong:
        with pytest.raises(gpunvme.InvalidArgumentError, match="device 0 is member 1"):
            wrong.ls()
    with gpunvme.open(paths[:2]) as short:
        with pytest.raises(gpunvme.InvalidArgumentError, match="missing"):
            short.ls()
    with gpunvme.open(paths) as dev:
        assert [f["name"] for f in dev.ls()] == ["v/data"]
