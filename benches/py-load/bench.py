"""Model loads into CUDA tensors, gpunvme against the loaders users pick instead (issue 22).

Run on the GPU machine by scripts/py-load-bench.sh (which installs the carried wheels). For
each model shape it writes a synthetic model as `.safetensors` shards on one disk, puts the same
files into a blockfs image on that disk, then loads it into CUDA tensors with

  - gpunvme, software controller (GPU-issued reads, `controller="emu"`), call to call (open,
    GPU queues, load, close) and on a handle kept open with its GPU queues up ("-kept": what a
    process that keeps gpunvme open pays per model);
  - gpunvme, GPU-resident controller model with HBM media and an SSD timing model of 1 and 4
    Gen5-like drives (the figure to read is the fraction of the modelled drives' cap);
  - fastsafetensors' loader reading from gpunvme (gpunvme.fastsafetensors), handle kept open;
  - safetensors.torch.load_file(device="cuda:0"), fastsafetensors (no GDS), InstantTensor
    (its default direct I/O, BackendPolicy.BUFFERED, Backend.MMAP);
  - and the ceilings: one pinned host buffer copied to the GPU; the `.safetensors` files read
    into host memory, a thread per file in 16 MiB buffered `pread`s ("disk-read": what the
    disk or page cache gives a plain reader in that run, beside the loads; not a loader, so
    never the best baseline; fastsafetensors 0.5 reads by O_DIRECT, 512 KiB blocks in file
    order on 16 threads).

warm (files read once before), warm2 (read twice before: the pages' second access, which moves
them to the kernel's active LRU list, is not the load's; a load through read/pread after a
single warm read pays that move, an mmap load does not) and cold (evicted with posix_fadvise
DONTNEED, then checked with mincore: a cold figure whose eviction did not happen is dropped).
Each load runs in a process of its own (a loader's lingering mappings would keep the next
one's files cached; and no loader inherits another's state), timed from the call to the last
tensor on the GPU; then the same process loads a reference with safetensors and compares every
tensor bitwise. A loader that fails is a row with "error"; the run goes on. Prints one JSON
object on stdout; progress on stderr.
"""

import argparse
import ctypes
import gc
import json
import mmap
import os
import sys
import time

import torch

MODELS = {
    # Qwen3-0.6B-shaped: 28 layers of 11 tensors, tied embeddings; ~1.19 GB bf16, one file.
    "0.6b": dict(hidden=1024, inter=3072, layers=28, q=2048, kv=1024, vocab=151936, norms=True,
                 lm_head=False, shards=1),
    # Llama-7B-shaped: 32 layers of 9 tensors, untied lm_head; ~13.5 GB bf16 in 4 shards.
    "7b": dict(hidden=4096, inter=11008, layers=32, q=4096, kv=4096, vocab=32000, norms=False,
               lm_head=True, shards=4),
}


def say(*a):
    print("py-load-bench:", *a, file=sys.stderr, flush=True)


def shapes(m):
    h, i = m["hidden"], m["inter"]
    out = [("model.embed_tokens.weight", [m["vocab"], h])]
    for l in range(m["layers"]):
        p = f"model.layers.{l}."
        out += [
            (p + "self_attn.q_proj.weight", [m["q"], h]),
            (p + "self_attn.k_proj.weight", [m["kv"], h]),
            (p + "self_attn.v_proj.weight", [m["kv"], h]),
            (p + "self_attn.o_proj.weight", [h, m["q"]]),
            (p + "mlp.gate_proj.weight", [i, h]),
            (p + "mlp.up_proj.weight", [i, h]),
            (p + "mlp.down_proj.weight", [h, i]),
            (p + "input_layernorm.weight", [h]),
            (p + "post_attention_layernorm.weight", [h]),
        ]
        if m["norms"]:
            out += [(p + "self_attn.q_norm.weight", [128]), (p + "self_attn.k_norm.weight", [128])]
    out.append(("model.norm.weight", [h]))
    if m["lm_head"]:
        out.append(("lm_head.weight", [m["vocab"], h]))
    return out


def write_model(dirname, m, seed):
    """Random bf16 tensors (generated on the GPU), sharded by bytes; returns the file paths."""
    from safetensors.torch import save_file

    os.makedirs(dirname, exist_ok=True)
    specs = shapes(m)
    total = sum(2 * n for n in (int(torch.tensor(s).prod()) for _, s in specs))
    per = -(-total // m["shards"])
    g = torch.Generator(device="cuda").manual_seed(seed)
    files, cur, size = [], {}, 0

    def flush():
        nonlocal cur, size
        if cur:
            path = os.path.join(dirname, f"model-{len(files) + 1:05d}-of-{m['shards']:05d}.safetensors")
            save_file(cur, path)
            files.append(path)
            cur, size = {}, 0

    for name, shape in specs:
        n = int(torch.tensor(shape).prod())
        raw = torch.randint(0, 256, (2 * n,), dtype=torch.uint8, device="cuda", generator=g)
        cur[name] = raw.view(torch.bfloat16).view(shape).cpu()
        size += 2 * n
        if size >= per:
            flush()
    flush()
    return files, total


# --- the page cache ---------------------------------------------------------------------------

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int,
                      ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


PAGE = os.sysconf("SC_PAGE_SIZE")


def is_ours(method):
    """Whether a method reads gpunvme's image (rather than the `.safetensors` files)."""
    return method.startswith("gpunvme") or method.endswith("-gpunvme")


def resident_fraction(paths):
    """Fraction of the files' pages in the page cache (mincore on a fresh mapping)."""
    have = tot = 0
    for p in paths:
        n = os.path.getsize(p)
        if n == 0:
            continue
        fd = os.open(p, os.O_RDONLY)
        try:
            addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
            if addr in (None, ctypes.c_void_p(-1).value):
                raise OSError(ctypes.get_errno(), "mmap")
            vec = ctypes.create_string_buffer((n + PAGE - 1) // PAGE)
            if libc.mincore(addr, n, vec) != 0:
                raise OSError(ctypes.get_errno(), "mincore")
            have += sum(b & 1 for b in vec.raw)
            tot += len(vec.raw)
            libc.munmap(addr, n)
        finally:
            os.close(fd)
    return have / max(tot, 1)


def evict(paths):
    gc.collect()  # a loader's mapping of the files keeps their pages in the cache
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return resident_fraction(paths)


class CachestatRange(ctypes.Structure):
    """`struct cachestat_range` of cachestat(2)."""
    _fields_ = [("off", ctypes.c_uint64), ("len", ctypes.c_uint64)]


class Cachestat(ctypes.Structure):
    """`struct cachestat` of cachestat(2)."""
    _fields_ = [(n, ctypes.c_uint64) for n in
                ("nr_cache", "nr_dirty", "nr_writeback", "nr_evicted", "nr_recently_evicted")]


class ResidencyTrace:
    """How many bytes of `paths` are in the page cache, sampled every `period` seconds on a
    thread of its own during a load (cachestat(2), Linux 6.5; ctypes lets the GIL go during
    the call): when the disk delivered a cold load's data, to compare methods by the rate of
    the disk itself rather than by the whole call."""

    def __init__(self, paths, period=0.05):
        import threading

        self.fds = [os.open(p, os.O_RDONLY) for p in paths]
        self.period = period
        self.samples = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def resident_bytes(self):
        pages = 0
        for fd in self.fds:
            r, st = CachestatRange(0, 0), Cachestat()  # len 0: to the end of the file
            if libc.syscall(451, fd, ctypes.byref(r), ctypes.byref(st), 0) != 0:
                raise OSError(ctypes.get_errno(), "cachestat")
            pages += st.nr_cache
        return pages * PAGE

    def _run(self):
        while True:
            self.samples.append((time.perf_counter() - self.t0, self.resident_bytes()))
            if self.done.wait(self.period):
                self.samples.append((time.perf_counter() - self.t0, self.resident_bytes()))
                return

    def start(self):
        self.base = self.resident_bytes()
        self.t0 = time.perf_counter()
        self.thread.start()

    def stop(self):
        """The figures for a row: the samples (ms, MB read in since the start), the times at
        which 10, 50, 90 and 100 % of what was read in had arrived, and the rate between 10
        and 90 %."""
        self.done.set()
        self.thread.join()
        for fd in self.fds:
            os.close(fd)
        got = [(t, max(b - self.base, 0)) for t, b in self.samples]
        end = got[-1][1] if got else 0
        out = {"residency_mb": [[round(t * 1e3), round(b / 1e6)] for t, b in got]}
        if end > 0:
            at = {}
            for q in (10, 50, 90, 100):
                at[q] = next(t for t, b in got if b >= end * q / 100)
                out[f"residency_t{q}_ms"] = round(at[q] * 1e3)
            if at[90] > at[10]:
                out["residency_gbytes_per_s_10_90"] = round(0.8 * end / (at[90] - at[10]) / 1e9, 3)
        return out


class DiskTrace:
    """What the block device under `path` and the CPUs did during a load: /proc/diskstats of
    that device and /proc/stat before and after, and the device's I/Os in flight sampled every
    `period` seconds on a thread of its own. For a cold load it tells the read paths apart by
    how they drive the disk (request size, depth, latency) and what CPU they spend."""

    def __init__(self, path, period=0.01):
        import threading

        st = os.stat(path)
        self.dev = (os.major(st.st_dev), os.minor(st.st_dev))
        if self._disk() is None:
            raise OSError(f"no /proc/diskstats line for device {self.dev[0]}:{self.dev[1]}")
        self.period = period
        self.inflight = []
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)

    def _disk(self):
        with open("/proc/diskstats") as f:
            for line in f:
                v = line.split()
                if (int(v[0]), int(v[1])) == self.dev:
                    self.name = v[2]
                    return [int(x) for x in v[3:14]]
        return None

    @staticmethod
    def _cpu():
        with open("/proc/stat") as f:
            v = [int(x) for x in f.readline().split()[1:]]
        return sum(v) - v[3] - v[4], sum(v)  # busy (not idle, not iowait), all: in ticks

    def _run(self):
        while not self.done.wait(self.period):
            self.inflight.append(self._disk()[8])

    def start(self):
        self.d0, self.c0, self.p0 = self._disk(), self._cpu(), os.times()
        self.t0 = time.perf_counter()
        self.thread.start()

    def stop(self):
        secs = time.perf_counter() - self.t0
        self.done.set()
        self.thread.join()
        d1, c1, p1 = self._disk(), self._cpu(), os.times()
        d = [b - a for a, b in zip(self.d0, d1)]
        reads, merged, sectors, read_ms = d[0], d[1], d[2], d[3]
        tick = os.sysconf("SC_CLK_TCK")
        out = {
            "disk": self.name,
            "disk_read_mb": round(sectors * 512 / 1e6),
            "disk_reads": reads,
            "disk_merged": merged,
            "disk_avg_read_kib": round(sectors * 512 / 1024 / max(reads, 1), 1),
            "disk_avg_read_ms": round(read_ms / max(reads, 1), 3),
            # Time-weighted I/Os in flight over the load, and the fraction of it with any.
            "disk_queue_depth": round(d[10] / 1e3 / secs, 2),
            "disk_busy": round(d[9] / 1e3 / secs, 3),
            "cpu_process_s": round((p1.user - self.p0.user) + (p1.system - self.p0.system), 2),
            "cpu_process_sys_s": round(p1.system - self.p0.system, 2),
            "cpu_busy_cores": round((c1[0] - self.c0[0]) / tick / secs, 2),
        }
        if self.inflight:
            out["disk_inflight_mean"] = round(sum(self.inflight) / len(self.inflight), 1)
            out["disk_inflight_max"] = max(self.inflight)
        return out


def warm(paths):
    for p in paths:
        with open(p, "rb", buffering=0) as f:
            while f.read(64 << 20):
                pass
    return resident_fraction(paths)


# --- loaders ------------------------------------------------------------------------------------

def load_safetensors(files, **_):
    from safetensors.torch import load_file

    out = {}
    for f in files:
        out.update(load_file(f, device="cuda:0"))
    return out, {}


def load_fastsafetensors(files, **_):
    from fastsafetensors import fastsafe_open

    out = {}
    with fastsafe_open(filenames=files, framework="pt", device="cuda:0", nogds=True) as f:
        for k in f.keys():
            out[k] = f.get_tensor(k)
    return out, {}


def load_instanttensor(files, backend=None, **_):
    from instanttensor import Backend, BackendPolicy, safe_open

    b = {"direct": None, "buffered": BackendPolicy.BUFFERED, "mmap": Backend.MMAP}[backend]
    out = {}
    with safe_open(files, framework="pt", device=0, backend=b) as f:
        for name, t in f.tensors():
            out[name] = t
    return out, {}


def open_gpunvme(image, threads):
    import gpunvme

    return gpunvme.open(image, lba_size=4096, read_only=True, controller_threads=threads,
                        controller_queue_pairs=64)


def load_gpunvme(files, image=None, prefix=None, controller="emu", ssd_model=None, threads=0,
                 dev=None, **_):
    """A load call to call: open, GPU queues, the load, close; or, given `dev` (an open handle
    whose GPU queues are up: a server that keeps gpunvme open), only the load."""
    if dev is not None:
        out = dev.load_safetensors(prefix)
        return out, dev.last_load
    t0 = time.perf_counter()
    dev = open_gpunvme(image, threads)
    t1 = time.perf_counter()
    try:
        out = dev.load_safetensors(prefix, controller=controller,
                                   media="hbm" if controller == "gpu" else "host",
                                   ssd_model=ssd_model)
        info = dict(dev.last_load)
    finally:
        t2 = time.perf_counter()
        dev.close()
    # The call's own ends, beside the load's phases: gpunvme.open (the image, the controller
    # and its threads) and close (queues deleted, threads joined, memory freed).
    info["open_s"] = round(t1 - t0, 6)
    info["close_s"] = round(time.perf_counter() - t2, 6)
    info["open_phases"] = dev.open_phases
    info["close_phases"] = dev.close_phases
    return out, info


def load_served(files, image=None, spec=None, **kw):
    """A load call to call (as gpunvme-emu) through a `gpunvme serve` daemon that owns the image
    (`served:SOCKET`, started by main for the model): what each process of a serving stack that
    shares one controller pays."""
    return load_gpunvme(files, image=spec, **kw)


def load_served_gpu(files, image=None, spec=None, **kw):
    """gpunvme-served with its reads issued by GPU threads on served GPU queues
    (GPUNVME_SERVED_READS=gpu) instead of this process's CPU: the two issuers side by side."""
    os.environ["GPUNVME_SERVED_READS"] = "gpu"
    try:
        return load_gpunvme(files, image=spec, **kw)
    finally:
        del os.environ["GPUNVME_SERVED_READS"]


def load_fastsafetensors_gpunvme(files, prefix=None, dev=None, **_):
    """fastsafetensors' loader reading from gpunvme (gpunvme.fastsafetensors: its copier reads
    each shard by GPU-issued commands), on a handle kept open with its GPU queues up."""
    from gpunvme.fastsafetensors import GpunvmeFileLoader

    loader = GpunvmeFileLoader(dev=dev, device="cuda:0")
    try:
        loader.add_filenames({0: [prefix + os.path.basename(f) for f in files]})
        fb = loader.copy_files_to_device()
        out = {k: fb.get_tensor(k) for k in loader.get_keys()}
        fb.close()
    finally:
        loader.close()
    return out, {}


def read_files(files, **_):
    """The files' bytes into host memory, a thread per file, 16 MiB `pread`s (no GPU)."""
    import threading

    done = [0] * len(files)

    def one_file(i):
        fd = os.open(files[i], os.O_RDONLY)
        try:
            buf = bytearray(16 << 20)
            while True:
                n = os.preadv(fd, [buf], done[i])
                if n <= 0:
                    break
                done[i] += n
        finally:
            os.close(fd)

    ts = [threading.Thread(target=one_file, args=(i,)) for i in range(len(files))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    return None, {"disk_bytes": sum(done)}


def verify(ref, got):
    if set(ref) != set(got):
        return f"names differ: {len(set(ref) ^ set(got))} not in both"
    for k, r in ref.items():
        t = got[k]
        if t.device.type != "cuda" or t.dtype != r.dtype or list(t.shape) != list(r.shape):
            return f"{k}: {t.device} {t.dtype} {list(t.shape)} vs {r.dtype} {list(r.shape)}"
        if not torch.equal(t.contiguous().view(torch.uint8), r.view(torch.uint8)):
            return f"{k}: bytes differ"
    return None


def pinned_ceiling(nbytes=1 << 30, reps=3):
    h = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    h.fill_(7)
    d = torch.empty(nbytes, dtype=torch.uint8, device="cuda")
    best = 0.0
    for _ in range(reps):
        torch.cuda.synchronize()
        t = time.perf_counter()
        d.copy_(h, non_blocking=True)
        torch.cuda.synchronize()
        best = max(best, nbytes / (time.perf_counter() - t) / 1e9)
    del h, d
    return round(best, 2)


LOADERS = {
    "gpunvme-emu": load_gpunvme,
    "gpunvme-emu-kept": load_gpunvme,
    "gpunvme-served": load_served,
    "gpunvme-served-gpu": load_served_gpu,
    "gpunvme-model-1xgen5": load_gpunvme,
    "gpunvme-model-4xgen5": load_gpunvme,
    "safetensors": load_safetensors,
    "fastsafetensors": load_fastsafetensors,
    "fastsafetensors-gpunvme": load_fastsafetensors_gpunvme,
    "instanttensor-direct": load_instanttensor,
    "instanttensor-buffered": load_instanttensor,
    "instanttensor-mmap": load_instanttensor,
    "disk-read": read_files,
}


def thread_cpu(pid="self"):
    """CPU seconds (user + system) of each thread of process `pid` so far, by thread id:
    {tid: (name, seconds)} from /proc (empty where it cannot be read)."""
    tick = os.sysconf("SC_CLK_TCK")
    out = {}
    base = f"/proc/{pid}/task"
    try:
        tids = os.listdir(base)
    except OSError:
        return out
    for tid in tids:
        try:
            stat = open(f"{base}/{tid}/stat").read()
        except OSError:
            continue
        # The name is in parentheses and may hold spaces: fields follow the last ')'.
        name = stat[stat.index("(") + 1:stat.rindex(")")]
        f = stat[stat.rindex(")") + 2:].split()
        out[tid] = (name, (int(f[11]) + int(f[12])) / tick)
    return out


def cpu_between(before, after, top=6):
    """The CPU each thread used between two `thread_cpu` samples, summed by thread name:
    total seconds and the busiest names (threads that started in between count from 0)."""
    by = {}
    for tid, (name, secs) in after.items():
        used = secs - before.get(tid, (name, 0.0))[1]
        by[name] = by.get(name, 0.0) + used
    busiest = sorted(by.items(), key=lambda kv: -kv[1])[:top]
    return {"total_s": round(sum(by.values()), 3),
            "busiest": {k: round(v, 3) for k, v in busiest if v > 0}}


def one(job):
    """One timed load in this fresh process, then the reference and the comparison."""
    job = json.loads(job)
    torch.cuda.init()
    torch.empty(1, device="cuda")  # the CUDA context exists before the clock starts
    # A variant ("gpunvme-emu-kept+KEY=VAL[+KEY2=VAL2]", --variant) is its method with variables set.
    method = job["method"].split("+")[0]
    fn = LOADERS[method]
    row = {}
    kw = dict(job["kw"])
    kw.pop("daemon_threads", None)  # the daemon's, set where it was started
    if method in ("gpunvme-emu-kept", "fastsafetensors-gpunvme"):
        # Untimed: the handle opened and its GPU queues up, as in a process that keeps them.
        kw["dev"] = open_gpunvme(job["image"], kw.get("threads", 0))
        kw["dev"].gpu_queues()
    paths = [job["image"]] if is_ours(method) else job["files"]
    trace = ResidencyTrace(paths) if job.get("trace") else None
    disk = DiskTrace(paths[0]) if job.get("trace_disk") else None
    for tr in (trace, disk):
        if tr:
            tr.start()
    torch.cuda.synchronize()
    cpu0 = thread_cpu()
    t = time.perf_counter()
    try:
        out, info = fn(job["files"], image=job["image"], prefix=job["prefix"], **kw)
        torch.cuda.synchronize()
    except Exception as e:  # a baseline that cannot run here is a row, not a stop
        row["error"] = f"{type(e).__name__}: {e}"[:400]
        row["verified"] = False
        print(json.dumps(row))
        return
    secs = time.perf_counter() - t
    # This process's threads during the load (at 100 Hz ticks: a whole-load figure only).
    row["client_cpu"] = cpu_between(cpu0, thread_cpu())
    for tr in (trace, disk):
        if tr:
            row.update(tr.stop())
    total = job["total"]
    if method == "disk-read":
        # Every byte of every file, headers included; checked by count, not by content.
        n = info["disk_bytes"]
        row["seconds"] = round(secs, 4)
        row["gbytes_per_s"] = round(n / secs / 1e9, 3)
        row["verified"] = n == sum(os.path.getsize(f) for f in job["files"])
        print(json.dumps(row))
        return
    row["seconds"] = round(secs, 4)
    row["gbytes_per_s"] = round(total / secs / 1e9, 3)
    if info:
        row["load_seconds"] = info.get("seconds")
        row["load_gbytes_per_s"] = round(info.get("bytes_per_sec", 0) / 1e9, 3)
        row["controller_copies"] = info.get("controller_copies")
        row["controller_threads"] = info.get("controller_threads")
        row["phases"] = info.get("phases")
        for k in ("open_s", "close_s", "open_phases", "close_phases"):
            if k in info:
                row[k] = info[k]
        cap = info.get("model_cap_bytes_per_sec")
        if cap:
            # The model's HBM media is filled from the image before the load: the fraction of
            # the drives' cap is the load's own time.
            row["model_cap_gbytes_per_s"] = round(cap / 1e9, 2)
            row["fraction_of_cap"] = round(info.get("bytes_per_sec", 0) / cap, 3)
    ref, _ = load_safetensors(job["files"])
    err = verify(ref, out)
    row["verified"] = err is None
    if err:
        row["error"] = err
    print(json.dumps(row))


def serve(g, img, sock, threads):
    """`gpunvme serve` owning `img` at `sock` (its software controller on `threads` threads),
    once the socket is there."""
    import subprocess

    if os.path.exists(sock):
        os.unlink(sock)
    daemon = subprocess.Popen(
        [g, "--device", img, "--lba-size", "4096", "--controller-threads", str(threads),
         "--controller-queue-pairs", "64", "serve", "--socket", sock, "--client-queues", "32",
         "--client-arena-bytes", str(1 << 30)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    t = time.time()
    while not os.path.exists(sock) and daemon.poll() is None and time.time() - t < 30:
        time.sleep(0.05)
    return daemon


def main():
    if len(sys.argv) == 3 and sys.argv[1] == "--one":
        return one(sys.argv[2])
    ap = argparse.ArgumentParser()
    ap.add_argument("--dir", default="/tmp/gpunvme-pyload")
    ap.add_argument("--models", default="0.6b,7b")
    ap.add_argument("--caches", default="warm,cold", help="warm, warm2, cold (comma-separated)")
    ap.add_argument("--threads", type=int, default=os.cpu_count() or 4,
                    help="software controller threads for gpunvme (default: one per CPU)")
    ap.add_argument("--limit", type=int, default=240, help="seconds one load may take")
    ap.add_argument("--reps", type=int, default=1,
                    help="loads per method, model and cache (the summary takes each method's median)")
    ap.add_argument("--variant", action="append", default=[], metavar="KEY=VAL[+KEY=VAL]",
                    help="also run gpunvme-emu-kept with these environment variables set (a row "
                         "method 'gpunvme-emu-kept+KEY=VAL'; 'threads=N' sets its controller "
                         "threads instead; repeatable)")
    ap.add_argument("--keep", action="store_true",
                    help="leave each model's files and image in --dir (for a look at them after)")
    ap.add_argument("--served-variant", action="append", default=[], metavar="KEY=VAL[+KEY=VAL]",
                    help="another gpunvme-served row with these variables (e.g. "
                         "GPUNVME_SERVED_WINDOWS=8x8; threads=N sets the daemon's "
                         "controller threads)")
    ap.add_argument("--methods", default="",
                    help="comma-separated loaders to run (default: all)")
    ap.add_argument("--trace-residency", action="store_true",
                    help="cold loads: sample the page cache's hold of the files read every 50 ms "
                         "(cachestat) and report when the data arrived and the rate between 10 "
                         "and 90 %% of it")
    ap.add_argument("--trace-disk", action="store_true",
                    help="cold loads: the block device's reads (count, size, latency, depth; "
                         "/proc/diskstats) and the CPU time spent (/proc/stat, the process's)")
    ap.add_argument("--gpunvme", default=os.environ.get("GPUNVME_BIN", ""),
                    help="the gpunvme CLI (mkfs and put of the image)")
    args = ap.parse_args()
    bad = [c for c in args.caches.split(",") if c not in ("warm", "warm2", "cold")]
    if bad:
        ap.error(f"--caches: {', '.join(bad)}: each must be warm, warm2 or cold")
    import subprocess

    rows = []
    jit_warm = False
    ceiling = pinned_ceiling()
    say(f"pinned host->GPU ceiling {ceiling} GB/s")
    gen5 = "read_us=80,iops=2500000,bw=14GB/s"
    for model in args.models.split(","):
        m = MODELS[model]
        d = os.path.join(args.dir, model)
        say(f"{model}: writing the model")
        files, total = write_model(d, m, seed=22)
        img = os.path.join(args.dir, f"{model}.img")
        if os.path.exists(img):
            os.unlink(img)
        with open(img, "wb") as f:
            f.truncate((total + total // 8 + (1 << 30)) // 4096 * 4096)
        g = args.gpunvme
        subprocess.run([g, "--device", img, "--lba-size", "4096", "fs", "mkfs"], check=True,
                       stdout=subprocess.DEVNULL)
        for p in files:
            subprocess.run([g, "--device", img, "--lba-size", "4096", "fs", "put", p,
                            f"{model}/{os.path.basename(p)}"], check=True,
                           stdout=subprocess.DEVNULL)
        say(f"{model}: {len(files)} files, {total / 1e9:.2f} GB")
        ntensors = len(shapes(m))
        sock = os.path.join(args.dir, f"{model}.sock")
        loaders = [
            ("gpunvme-emu", dict(controller="emu", threads=args.threads)),
            ("gpunvme-emu-kept", dict(controller="emu", threads=args.threads)),
            ("gpunvme-served", dict(controller="emu", spec="served:" + sock)),
            ("gpunvme-served-gpu", dict(controller="emu", spec="served:" + sock)),
            ("gpunvme-model-1xgen5", dict(controller="gpu", ssd_model=gen5 + ",drives=1")),
            ("gpunvme-model-4xgen5", dict(controller="gpu", ssd_model=gen5 + ",drives=4")),
            ("safetensors", {}),
            ("fastsafetensors", {}),
            ("fastsafetensors-gpunvme", dict(threads=args.threads)),
            ("instanttensor-direct", dict(backend="direct")),
            ("instanttensor-buffered", dict(backend="buffered")),
            ("instanttensor-mmap", dict(backend="mmap")),
            ("disk-read", {}),
        ]
        if args.methods:
            keep = set(args.methods.split(","))
            unknown = keep - set(LOADERS)
            if unknown:
                raise SystemExit(f"unknown --methods: {sorted(unknown)}")
            loaders = [(n, kw) for n, kw in loaders if n in keep]
        for v in args.variant:
            # "threads=N" among a variant's parts sets its controller threads, not a variable.
            threads = args.threads
            for kv in v.split("+"):
                k, _, val = kv.partition("=")
                if k == "threads":
                    threads = int(val)
            loaders.append((f"gpunvme-emu-kept+{v}", dict(controller="emu", threads=threads)))
        for v in args.served_variant:
            # "threads=N" among its parts: the daemon's controller threads for this row.
            kw = dict(controller="emu", spec="served:" + sock)
            for kv in v.split("+"):
                k, _, val = kv.partition("=")
                if k == "threads":
                    kw["daemon_threads"] = int(val)
            loaders.append((f"gpunvme-served+{v}", kw))
        if not jit_warm:
            # CUDA compiles gpunvme's PTX on a machine's first use (about 11 s on the lent
            # H100, then cached on disk): once, untimed, before any row.
            say("untimed first gpunvme load (CUDA's JIT cache)")
            job = dict(method="gpunvme-emu", files=files, image=img, prefix=f"{model}/",
                       total=total, kw=loaders[0][1])
            subprocess.run([sys.executable, __file__, "--one", json.dumps(job)],
                           capture_output=True, timeout=args.limit)
            jit_warm = True
        for cache in args.caches.split(","):
            # Round robin: rep 0 of every method, then rep 1, ...: a disk or host whose speed
            # drifts during the run (a cold disk's rate does) shifts every method alike. Each
            # round starts one method further on, so no method always follows the same one
            # (or always runs first after the model was written).
            def rotated(rep):
                k = rep % max(len(loaders), 1)
                return loaders[k:] + loaders[:k]

            for (name, kw), rep in ((lk, rep) for rep in range(args.reps) for lk in rotated(rep)):
                ours = is_ours(name)
                if ours and cache == "cold" and "model" in name:
                    continue  # HBM media: the image is copied in before the load; nothing cold
                paths = [img] if ours else files
                row = {"model": model, "tensors": ntensors, "bytes": total, "cache": cache,
                       "method": name, "rep": rep}
                if cache == "warm2":
                    warm(paths)  # the pages' second access happens here, not in the load
                resident = warm(paths) if cache in ("warm", "warm2") else evict(paths)
                row["resident_before"] = round(resident, 3)
                if cache == "cold" and resident > 0.05:
                    row["error"] = f"eviction did not happen ({resident:.0%} resident): dropped"
                else:
                    job = dict(method=name, files=files, image=img, prefix=f"{model}/",
                               total=total, kw=kw,
                               trace=args.trace_residency and cache == "cold",
                               trace_disk=args.trace_disk and cache == "cold")
                    # gpunvme-served: a daemon owns the image (exclusively) for its row only,
                    # started before and stopped after, untimed (a daemon runs long).
                    daemon = (serve(g, img, sock, kw.get("daemon_threads", args.threads))
                              if name.startswith("gpunvme-served") else None)
                    try:
                        env = dict(os.environ)
                        # A variant's variables: "method+K=V" or "method+K=V+K2=V2".
                        for kv in name.split("+")[1:]:
                            k, _, v = kv.partition("=")
                            if k != "threads":
                                env[k] = v
                        d0 = thread_cpu(daemon.pid) if daemon is not None else None
                        r = subprocess.run([sys.executable, __file__, "--one", json.dumps(job)],
                                           capture_output=True, text=True, timeout=args.limit,
                                           env=env)
                        if d0 is not None:
                            # The daemon's threads over the child's whole life (start-up,
                            # load, reference load): where a served load's CPU goes.
                            row["daemon_cpu"] = cpu_between(d0, thread_cpu(daemon.pid), top=24)
                        last = r.stdout.strip().splitlines()[-1] if r.stdout.strip() else ""
                        if r.returncode == 0 and last.startswith("{"):
                            row.update(json.loads(last))
                        else:
                            row["error"] = f"exit {r.returncode}: {r.stderr.strip()[-400:]}"
                            row["verified"] = False
                    except subprocess.TimeoutExpired:
                        row["error"] = f"took longer than {args.limit} s"
                        row["verified"] = False
                    finally:
                        if daemon is not None:
                            daemon.terminate()
                            daemon.wait(timeout=30)
                rows.append(row)
                say(json.dumps(row))
        if not args.keep:
            os.unlink(img)
            for p in files:
                os.unlink(p)

    summary = {}
    for model in args.models.split(","):
        for cache in args.caches.split(","):
            ok = [r for r in rows if r["model"] == model and r["cache"] == cache
                  and r.get("verified")]
            # One row per method: its median load (of --reps), with every figure beside it.
            by = {}
            for r in ok:
                by.setdefault(r["method"], []).append(r)
            ok = []
            for rs in by.values():
                rs = sorted(rs, key=lambda r: r["gbytes_per_s"])
                ok.append(dict(rs[(len(rs) - 1) // 2], all_gbytes_per_s=[r["gbytes_per_s"] for r in rs]))
            base = [r for r in ok if not r["method"].startswith("gpunvme")
                    and r["method"] != "disk-read"]
            disk = next((r for r in ok if r["method"] == "disk-read"), None)
            best = max(base, key=lambda r: r["gbytes_per_s"], default=None)
            served = next((r for r in ok if r["method"] == "gpunvme-served"), None)
            if served and best:
                s_served = round(served["gbytes_per_s"] / best["gbytes_per_s"], 3)
            else:
                s_served = None
            emu = next((r for r in ok if r["method"] == "gpunvme-emu"), None)
            kept = next((r for r in ok if r["method"] == "gpunvme-emu-kept"), None)
            s = {"best_baseline": best and best["method"],
                 "best_baseline_gbytes_per_s": best and best["gbytes_per_s"]}
            if emu:
                s["gpunvme_emu_gbytes_per_s"] = emu["gbytes_per_s"]
                if best:
                    s["gpunvme_emu_over_best"] = round(emu["gbytes_per_s"] / best["gbytes_per_s"], 3)
                if cache != "cold":
                    s["gpunvme_emu_over_pinned_ceiling"] = round(emu["gbytes_per_s"] / ceiling, 3)
            if served:
                s["gpunvme_served_gbytes_per_s"] = served["gbytes_per_s"]
                s["gpunvme_served_over_best"] = s_served
            if kept:
                s["gpunvme_emu_kept_gbytes_per_s"] = kept["gbytes_per_s"]
                if best:
                    s["gpunvme_emu_kept_over_best"] = round(kept["gbytes_per_s"] / best["gbytes_per_s"], 3)
                s["gpunvme_emu_kept_over_pinned_ceiling"] = round(kept["gbytes_per_s"] / ceiling, 3)
                if best:
                    # Round by round (a drifting disk moves every method of a round alike):
                    # the kept handle over the best baseline's load of the same round.
                    rate = {(r["method"], r["rep"]): r["gbytes_per_s"] for r in rows
                            if r["model"] == model and r["cache"] == cache and r.get("verified")}
                    s["gpunvme_emu_kept_over_best_by_round"] = [
                        round(rate[("gpunvme-emu-kept", k)] / rate[(best["method"], k)], 3)
                        for k in range(args.reps)
                        if ("gpunvme-emu-kept", k) in rate and (best["method"], k) in rate]
            if disk:
                s["disk_read_gbytes_per_s"] = disk["gbytes_per_s"]
                s["disk_read_all_gbytes_per_s"] = disk["all_gbytes_per_s"]
                if kept:
                    s["gpunvme_emu_kept_over_disk_read"] = round(
                        kept["gbytes_per_s"] / disk["gbytes_per_s"], 3)
            for r in base:
                s[r["method"] + "_all_gbytes_per_s"] = r["all_gbytes_per_s"]
            for r in ok:
                if "fraction_of_cap" in r:
                    s[r["method"] + "_fraction_of_cap"] = r["fraction_of_cap"]
            summary[f"{model}/{cache}"] = s
    print(json.dumps({
        "machine": torch.cuda.get_device_name(0),
        "date": time.strftime("%Y-%m-%d"),
        "pinned_ceiling_gbytes_per_s": ceiling,
        "gpunvme_controller_threads": args.threads,
        "rows": rows,
        "summary": summary,
    }, indent=1))


if __name__ == "__main__":
    main()
