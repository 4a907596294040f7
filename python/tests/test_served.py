"""A device a `gpunvme serve` daemon owns, opened as `served:SOCKET`: the files of its blockfs
listed and read byte for byte by this process while another handle does the same; a put
through the daemon's write lease read back by the other handle, an existing name and a
second writer refused by kind; mkfs refused as the operator's with nothing changed; and a
socket nobody listens on named. The daemon is the `gpunvme` binary named by GPUNVME_BIN
(scripts/py-test.sh sets it); without it the test says so and is skipped."""

import os
import subprocess
import time

import pytest

import gpunvme

BIN = os.environ.get("GPUNVME_BIN")


@pytest.fixture
def daemon(tmp_path):
    if not BIN or not os.access(BIN, os.X_OK):
        pytest.skip("skipped: GPUNVME_BIN does not name the gpunvme binary (scripts/py-test.sh sets it)")
    img = tmp_path / "served.img"
    with open(img, "wb") as f:
        f.truncate(64 << 20)
    files = {}
    with gpunvme.open(str(img)) as d:
        d.mkfs()
        for i, n in enumerate([1, 4096, 1 << 20, 3_000_001]):
            data = os.urandom(n)
            src = tmp_path / f"src{i}"
            src.write_bytes(data)
            d.put(src, f"f{i}")
            files[f"f{i}"] = data
    sock = tmp_path / "serve.sock"
    proc = subprocess.Popen([BIN, "--device", str(img), "serve", "--socket", str(sock)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + 20
    while not sock.exists():
        assert proc.poll() is None, "the daemon exited"
        assert time.monotonic() < deadline, "the daemon never listened"
        time.sleep(0.05)
    yield f"served:{sock}", files, tmp_path
    proc.terminate()
    try:
        proc.wait(timeout=20)
    except subprocess.TimeoutExpired:
        proc.kill()
        raise


def test_served_files_are_read_and_put_through_the_daemon(daemon):
    spec, files, tmp = daemon
    with gpunvme.open(spec) as a, gpunvme.open(spec) as b:
        assert sorted(f["name"] for f in a.ls()) == sorted(files)
        for name, data in files.items():
            for h, tag in ((a, "a"), (b, "b")):
                out = tmp / f"out-{tag}-{name}"
                h.get(name, out)
                assert out.read_bytes() == data, (tag, name)
        src = tmp / "src3"
        a.put(src, "new")
        out = tmp / "out-new"
        b.get("new", out)
        assert out.read_bytes() == files["f3"]
        with pytest.raises(gpunvme.ExistsError):
            b.put(src, "new")
        a.rm("new")
        with pytest.raises(gpunvme.ReadOnlyError):
            a.mkfs(force=True)
        assert sorted(f["name"] for f in b.ls()) == sorted(files)


def test_a_socket_nobody_listens_on_is_named(tmp_path):
    with pytest.raises(gpunvme.NotFoundError) as e:
        gpunvme.open(f"served:{tmp_path / 'nobody.sock'}")
    assert "nobody.sock" in str(e.value)


def test_who_issues_served_reads_is_a_choice_of_the_handle(daemon):
    spec, files, _ = daemon
    for choice in ("auto", "cpu", "gpu"):
        with gpunvme.open(spec, served_reads=choice) as d:
            assert d.read("f1", 0) == files["f1"], choice
    with pytest.raises(gpunvme.InvalidArgumentError, match="served reads \"fast\""):
        gpunvme.open(spec, served_reads="fast")
