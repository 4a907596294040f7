"""Where a kept handle's model load spends its time, load after load in one process (issue 22).

Run on the GPU machine after scripts/py-load-bench.sh's set-up (the carried wheel installed in
a folder on PYTHONPATH, the CLI unpacked), from the checkout:

    python3 benches/py-load/phases.py SITE WORKDIR GPUNVME_CLI

It writes the 0.6B-shaped model (benches/py-load/bench.py's), puts it into a blockfs image,
reads the image once (bench.warm), opens one handle with its GPU queues up, then loads the
model REPS times, printing per load: the call's time and GB/s, the native phases (mount and
headers, arena, extent tables, reads), the DLPack and tensor-view times, and the controller's
pread time summed over its threads, and per controller thread when it started and stopped
staging the load's Reads and how many bytes it staged. The first load is checked against safetensors. Knobs
(environment): THREADS (controller threads; default one per CPU), QP (queue pairs, 64), REPS
(6), MODEL (0.6b or 7b), RESETUP=1 (tear the GPU queues down and bring them up before every
load after the first), WARMAGAIN=1 (bench.warm the image again before every load after the
first), SYNC=1 (os.sync() after writing the image), PREREAD=MiB (read that much of the first
shard through read_into before the first load; with PREOTHER=1, of a file of its own in the
image instead), WARMTWICE=1 (the image read twice before the handle opens), PERF=/path/to/perf
(a `perf record` of this process around loads 0 and 1, into /tmp/perf0.data and
/tmp/perf1.data; root). Every GPU wait is gpunvme's (bounded).
"""

import gc
import json
import os
import resource
import signal
import subprocess
import sys
import time

site, work, cli = sys.argv[1], sys.argv[2], sys.argv[3]
sys.path.insert(0, site)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch  # noqa: E402

import bench  # noqa: E402
import gpunvme  # noqa: E402

env = os.environ.get
torch.cuda.init()
torch.empty(1, device="cuda")
model = env("MODEL", "0.6b")
files, total = bench.write_model(os.path.join(work, model), bench.MODELS[model], seed=22)
img = os.path.join(work, "phases.img")
if os.path.exists(img):
    os.unlink(img)
with open(img, "wb") as f:
    f.truncate((total + total // 8 + (1 << 30)) // 4096 * 4096)


def fs(*args):
    """`gpunvme fs ARGS...` on the image."""
    subprocess.run([cli, "--device", img, "--lba-size", "4096", "fs", *args], check=True,
                   stdout=subprocess.DEVNULL)


fs("mkfs")
for p in files:
    fs("put", p, f"{model}/{os.path.basename(p)}")
other = None
if env("PREOTHER") and int(env("PREREAD", "0")) > 0:
    # PREREAD reads a file of its own instead (not the model's pages).
    other = os.path.join(work, "other.bin")
    with open(other, "wb") as f:
        f.write(os.urandom(int(env("PREREAD")) << 20))
    fs("put", other, "other.bin")
if env("SYNC"):
    t = time.perf_counter()
    os.sync()
    print(f"sync {time.perf_counter() - t:.2f} s", flush=True)
print("model", len(files), "files", total, "bytes; pinned copy", bench.pinned_ceiling(), "GB/s",
      flush=True)
bench.warm([img])
if env("WARMTWICE"):
    bench.warm([img])  # a second buffered pass: the pages' second access
dev = gpunvme.open(img, lba_size=4096, read_only=True,
                   controller_threads=int(env("THREADS", str(os.cpu_count()))),
                   controller_queue_pairs=int(env("QP", "64")))
t = time.perf_counter()
dev.gpu_queues()
print(f"gpu_queues {time.perf_counter() - t:.3f} s", flush=True)
if int(env("PREREAD", "0")) > 0:
    # A read through the data path before the first load (the first shard's first PREREAD MiB).
    src = other or files[0]
    n = min(int(env("PREREAD")) << 20, os.path.getsize(src)) // 4096 * 4096
    buf = torch.empty(n, dtype=torch.uint8, device="cuda")
    t = time.perf_counter()
    dev.read_into("other.bin" if other else f"{model}/{os.path.basename(src)}", buf)
    print(f"preread {n >> 20} MiB {time.perf_counter() - t:.3f} s", flush=True)
    del buf
last = dict((getattr(dev, "last_io", None) or {}).get("controller_copies") or {})
file_ms = last.get("file_read_ms", 0.0)
last_bytes = {}
for i in range(int(env("REPS", "6"))):
    if i > 0 and env("WARMAGAIN"):
        t = time.perf_counter()
        bench.warm([img])
        print(f"warm again {time.perf_counter() - t:.3f} s", flush=True)
    if i > 0 and env("RESETUP"):
        dev.release_gpu()
        t = time.perf_counter()
        dev.gpu_queues()
        print(f"queues again {time.perf_counter() - t:.3f} s", flush=True)
    torch.cuda.synchronize()
    prof = None
    if env("PERF") and i < 2:
        prof = subprocess.Popen([env("PERF"), "record", "-q", "-F", "4000", "-o",
                                 f"/tmp/perf{i}.data", "-p", str(os.getpid())],
                                stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(0.5)
    ru0 = resource.getrusage(resource.RUSAGE_SELF)
    t0 = time.perf_counter()
    marks = {}

    def views(cap, tensors):
        # Called back while the GPU reads (as the public call does): dlpack, then the views.
        marks["t1"] = time.perf_counter()
        x = torch.from_dlpack(cap)
        marks["t2"] = time.perf_counter()
        v = gpunvme._arena_views(torch, x, tensors)
        marks["t3"] = time.perf_counter()
        return v

    out, rep = dev._d.load_safetensors(f"{model}/", "emu", "host", None, views)
    tn = time.perf_counter()
    t1, t2, t3 = marks["t1"], marks["t2"], marks["t3"]
    torch.cuda.synchronize()
    t4 = time.perf_counter()
    if prof is not None:
        prof.send_signal(signal.SIGINT)
        prof.wait(timeout=30)
    ru1 = resource.getrusage(resource.RUSAGE_SELF)
    r = json.loads(rep)
    ph = {k: v * 1e3 for k, v in r["phases"].items() if isinstance(v, (int, float))}
    copies = r.get("controller_copies") or {}
    # The controller's counters run over the handle's life (reset with its queues).
    pread_ms = copies.get("file_read_ms", 0.0) - (0.0 if env("RESETUP") else file_ms)
    file_ms = copies.get("file_read_ms", 0.0)
    native = sum(ph.get(k, 0.0) for k in ("mount_and_headers", "gpu_open", "gpu_setup", "load",
                                             "teardown"))
    print(f"load {i}: {(t4 - t0) * 1e3:.2f} ms ({total / (t4 - t0) / 1e9:.1f} GB/s); native call "
          f"{(tn - t0) * 1e3:.2f} (its phases {native:.2f}: load {ph.get('load', 0.0):.2f}); "
          f"mount+headers {ph['mount_and_headers']:.2f}, arena {ph['load_arena']:.2f}, "
          f"tables {ph['load_tables']:.2f}, reads {ph['load_reads']:.2f}; during the reads: "
          f"dlpack {(t2 - t1) * 1e3:.2f}, views {(t3 - t2) * 1e3:.2f}; pread {pread_ms:.0f} ms "
          f"over the controller's threads; process: {ru1.ru_minflt - ru0.ru_minflt} minor "
          f"faults, {ru1.ru_majflt - ru0.ru_majflt} major, "
          f"{(ru1.ru_stime - ru0.ru_stime) * 1e3:.0f} ms system and "
          f"{(ru1.ru_utime - ru0.ru_utime) * 1e3:.0f} ms user CPU, "
          f"{ru1.ru_nivcsw - ru0.ru_nivcsw} involuntary switches", flush=True)
    # Every counter's change over this load (the counters run over the handle's life).
    delta = {k: round(v - last.get(k, 0), 2) for k, v in copies.items()
             if isinstance(v, (int, float)) and v != last.get(k, 0)}
    last = dict(copies)
    print(f"  controller: {json.dumps(delta)}", flush=True)
    # Each controller thread: first and last staged Read of this load (ms after the launch),
    # and the bytes it staged in this load (the counters run over the handle's life).
    threads = r.get("controller_threads") or []
    if threads:
        mb = [(t["staged_bytes"] - last_bytes.get(k, 0)) / 1e6 for k, t in enumerate(threads)]
        last_bytes = {k: t["staged_bytes"] for k, t in enumerate(threads)}
        firsts = sorted(t["first_ms"] for t in threads if t["first_ms"] is not None)
        lasts = sorted(t["last_ms"] for t in threads if t["last_ms"] is not None)
        if firsts and lasts:
            print(f"  threads: first staged {firsts[0]:.2f} / {firsts[len(firsts) // 2]:.2f} / "
                  f"{firsts[-1]:.2f} ms (min/median/max), last {lasts[0]:.2f} / "
                  f"{lasts[len(lasts) // 2]:.2f} / {lasts[-1]:.2f} ms; MB per thread "
                  f"{min(mb):.0f}..{max(mb):.0f} (mean {sum(mb) / len(mb):.0f}); "
                  f"per thread first/last/MB: "
                  + " ".join(f"{t['first_ms'] or 0:.1f}/{t['last_ms'] or 0:.1f}/{m:.0f}"
                             for t, m in zip(threads, mb)), flush=True)
    if i == 0:
        ref, _ = bench.load_safetensors(files)
        print("verify:", bench.verify(ref, out) or "every tensor equal", flush=True)
        del ref
    del out
    gc.collect()
# One more load through the public call, as scripts/py-load-bench.sh times it.
torch.cuda.synchronize()
t0 = time.perf_counter()
out = dev.load_safetensors(f"{model}/")
torch.cuda.synchronize()
t1 = time.perf_counter()
ph = {k: round(v * 1e3, 2) for k, v in dev.last_load["phases"].items()}
print(f"public load_safetensors: {(t1 - t0) * 1e3:.2f} ms; native phases {ph}", flush=True)
del out
dev.close()
