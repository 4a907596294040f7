"""Issue 53 from Python: a read-only handle refuses every change up front and goes on listing
what is on the medium; Ctrl-C during a put or a get stops it before it commits (nothing stored,
the old version kept, fsck clean) and raises KeyboardInterrupt; every destructive call refuses
without ``force``. Each test asserts what is on the device afterwards."""

import os
import signal
import threading
import time

import pytest

import gpunvme


def image(tmp_path, size=64 << 20, name="dev.img"):
    path = tmp_path / name
    with open(path, "wb") as f:
        f.truncate(size)
    return str(path)


def host_file(tmp_path, name, data):
    p = tmp_path / name
    p.write_bytes(data)
    return p


def names(dev):
    return [f["name"] for f in dev.ls()]


def test_a_read_only_handle_refuses_changes_up_front_and_lists_the_medium(tmp_path):
    path = image(tmp_path)
    kept = os.urandom(50_000)
    with gpunvme.open(path) as d:
        d.mkfs()
        d.put(host_file(tmp_path, "kept", kept), "kept")
    new = host_file(tmp_path, "new", os.urandom(20_000))
    with gpunvme.open(path, read_only=True) as d:
        listed = d.ls()
        # Each change is ReadOnlyError (not a device error half-way), and nothing changes in
        # what the handle lists: no 0-byte "new", "kept" not hidden.
        with pytest.raises(gpunvme.ReadOnlyError, match="read-only"):
            d.put(new, "new")
        assert d.ls() == listed
        with pytest.raises(gpunvme.NotFoundError):
            d.stat("new")
        with pytest.raises(gpunvme.ReadOnlyError):
            d.put(new, "kept", force=True)
        with pytest.raises(gpunvme.ReadOnlyError):
            d.rm("kept")
        assert d.ls() == listed
        with pytest.raises(gpunvme.ReadOnlyError):
            d.mkfs(force=True)
        with pytest.raises(gpunvme.ReadOnlyError):
            d.fsck(repair=True)
        assert names(d) == ["kept"]
        assert d.read("kept") == kept
        assert d.fsck(data=True)["consistent"] is True
    with gpunvme.open(path) as d:
        assert names(d) == ["kept"]
        assert d.read("kept") == kept


def interrupt_once_writing(img, baseline, grown=8 << 20, timeout=20.0):
    """A thread that sends this process SIGINT once the image has grown by ``grown`` bytes
    past ``baseline`` (the put is writing, and far from done), or after ``timeout``."""

    def run():
        end = time.monotonic() + timeout
        while time.monotonic() < end:
            if os.stat(img).st_blocks * 512 >= baseline + grown:
                break
            time.sleep(0.002)
        os.kill(os.getpid(), signal.SIGINT)

    t = threading.Thread(target=run, daemon=True)
    t.start()
    return t


@pytest.mark.parametrize("replace", [False, True])
def test_ctrl_c_during_put_stores_nothing_and_raises_keyboard_interrupt(tmp_path, replace):
    img = image(tmp_path, size=1 << 30)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        for _ in range(32):
            f.write(os.urandom(8 << 20))  # 256 MiB: a put of a second or more
    old = os.urandom(10_000)
    with gpunvme.open(img) as d:
        d.mkfs()
        if replace:
            d.put(host_file(tmp_path, "old", old), "f")
        before = d.ls()
        baseline = os.stat(img).st_blocks * 512
        sender = interrupt_once_writing(img, baseline)
        t0 = time.monotonic()
        with pytest.raises(KeyboardInterrupt):
            d.put(big, "f", force=replace)
        took = time.monotonic() - t0
        sender.join()
        # Stopped, not finished: the new file is not there, the old one is.
        assert d.ls() == before
        if replace:
            assert d.read("f") == old
        else:
            with pytest.raises(gpunvme.NotFoundError):
                d.stat("f")
        assert d.fsck(data=True)["consistent"] is True
        # The handle goes on.
        d.put(host_file(tmp_path, "small", b"after"), "g")
        assert d.read("g") == b"after"
    with gpunvme.open(img, read_only=True) as d:
        assert d.fsck()["consistent"] is True
        assert [n for n in names(d) if n != "g"] == [f["name"] for f in before]
    assert took < 30


def test_ctrl_c_during_get_leaves_the_destination_as_it_was(tmp_path):
    img = image(tmp_path, size=1 << 30)
    big = tmp_path / "big"
    with open(big, "wb") as f:
        for _ in range(32):
            f.write(os.urandom(8 << 20))
    out = tmp_path / "out" / "copy"
    out.parent.mkdir()
    out.write_bytes(b"the old destination")
    with gpunvme.open(img) as d:
        d.mkfs()
        d.put(big, "big")
        sender = threading.Timer(0.05, lambda: os.kill(os.getpid(), signal.SIGINT))
        sender.start()
        with pytest.raises(KeyboardInterrupt):
            d.get("big", out)
        sender.join()
        assert out.read_bytes() == b"the old destination"
        # No temporary copy left beside it.
        assert sorted(p.name for p in out.parent.iterdir()) == ["copy"]
        d.get("big", out)  # and the handle goes on
    assert os.path.getsize(out) == os.path.getsize(big)


def test_every_destructive_call_refuses_without_force(tmp_path):
    """The table in docs/python.md: mkfs over a blockfs, put over a name, a volume member as a
    plain device, get onto the device's own image (save and save_safetensors over a name need
    a GPU: test_gpu_io.py)."""
    path = image(tmp_path)
    one, two = os.urandom(9000), os.urandom(7000)
    with gpunvme.open(path) as d:
        d.mkfs()
        d.put(host_file(tmp_path, "one", one), "f")
        with pytest.raises(gpunvme.RefusedError):
            d.mkfs()
        with pytest.raises(gpunvme.ExistsError):
            d.put(host_file(tmp_path, "two", two), "f")
        with pytest.raises(gpunvme.RefusedError):
            d.get("f", path)
        assert names(d) == ["f"]
        assert d.read("f") == one
        d.put(host_file(tmp_path, "two", two), "f", force=True)
        assert d.read("f") == two
        d.mkfs(force=True)
        assert d.ls() == []


def _newest_root(path):
    """(byte offset of the newest generation's root run, its length): from the superblock
    slots at bytes 0 and 4096 (blockfs/FORMAT.md)."""
    import struct

    with open(path, "rb") as f:
        best = None
        for off in (0, 4096):
            f.seek(off)
            sb = f.read(256)
            gen, bs = struct.unpack_from("<QI", sb, 32)
            root_bno, _, root_bytes = struct.unpack_from("<QII", sb, 56)
            if sb[:8] == b"BLKFS_SB" and (best is None or gen > best[0]):
                best = (gen, root_bno * bs, root_bytes)
    return best[1], best[2]


def test_a_repair_that_rolls_back_names_the_files_it_lost(tmp_path):
    path = image(tmp_path)
    with gpunvme.open(path) as d:
        d.mkfs()
        d.put(host_file(tmp_path, "a", os.urandom(10_000)), "a")
        d.put(host_file(tmp_path, "b", os.urandom(10_000)), "b")
    # The newest root's free-run list damaged: that generation no longer mounts.
    off, length = _newest_root(path)
    with open(path, "r+b") as f:
        f.seek(off + length - 8)
        f.write(b"\xff" * 8)
    with gpunvme.open(path) as d:
        with pytest.raises(gpunvme.GpunvmeError):
            d.ls()
        report = d.fsck(repair=True)
        assert report["consistent"] is True
        # Rolled back to the commit before "b": the report names it.
        assert report["lost"] == ["b"], report
        assert report["reverted"] == []
        assert names(d) == ["a"]
