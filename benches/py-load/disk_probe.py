"""How a host's disk reads a cold ~13.6 GB file set under several patterns (issue 22's cold loads).

    python3 benches/py-load/disk_probe.py DIR      # PROBE_SZ=BYTES per file (default 3.4 GB)
                                                   # ONLY=0,3 runs those patterns only

Writes four files and one file holding all four (as gpunvme's image holds the shards) under DIR
(kept for reruns), then for each pattern evicts the files it reads (posix_fadvise DONTNEED,
checked with mincore), reads everything and prints one JSON line: the bench's disk-read
pattern (a thread per file, 16 MiB buffered preads), fastsafetensors 0.5's (O_DIRECT 512 KiB
blocks in file order on 16 threads), the software controller's (posix_fadvise WILLNEED walkers
of 8 MiB blocks ahead of 16 readers of 128 KiB; and 16 threads each reading its own part of the
image, buffered or O_DIRECT, as its threads' Reads are spread over the file), and buffered and
O_DIRECT reads of the one file at several block sizes and thread counts. No GPU; the figures are the
disk's under each pattern, to read beside a load benchmark's cold rows.
"""
import mmap, os, sys, threading, time, json, ctypes

D = sys.argv[1]
NF = 4
SZ = int(os.environ.get("PROBE_SZ", 3_400_000_000)) // 4096 * 4096
os.makedirs(D, exist_ok=True)
files = [os.path.join(D, f"f{i}") for i in range(NF)]
img = os.path.join(D, "img")


POOL = [os.urandom(64 << 20) for _ in range(4)]


def write(path, n):
    # Random 64 MB blocks cycled (no disk here dedupes or compresses).
    with open(path, "wb") as f:
        left, i = n, 0
        while left:
            k = min(left, 64 << 20)
            f.write(POOL[i % 4][:k])
            left -= k
            i += 1


t = time.time()
for p in files:
    if not os.path.exists(p) or os.path.getsize(p) != SZ:
        write(p, SZ)
if not os.path.exists(img) or os.path.getsize(img) != SZ * NF:
    # one file the size of all four (our image is one file)
    with open(img, "wb") as o:
        for p in files:
            with open(p, "rb") as f:
                while b := f.read(256 << 20):
                    o.write(b)
os.sync()
print(f"# written in {time.time()-t:.1f}s", flush=True)

libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
libc.mincore.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p]


def resident(paths):
    have = tot = 0
    for p in paths:
        n = os.path.getsize(p)
        fd = os.open(p, os.O_RDONLY)
        addr = libc.mmap(None, n, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        vec = ctypes.create_string_buffer((n + 4095) // 4096)
        libc.mincore(addr, n, vec)
        have += sum(b & 1 for b in vec.raw)
        tot += len(vec.raw)
        libc.munmap(addr, n)
        os.close(fd)
    return have / tot


def evict(paths):
    for p in paths:
        fd = os.open(p, os.O_RDONLY)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        os.close(fd)
    return resident(paths)


def run_threads(n, fn):
    ts = [threading.Thread(target=fn, args=(i,)) for i in range(n)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()


def per_file_sequential(paths, chunk, direct=False):
    def go(i):
        fd = os.open(paths[i], os.O_RDONLY | (os.O_DIRECT if direct else 0))
        buf = mmap.mmap(-1, chunk)
        off = 0
        n = os.path.getsize(paths[i])
        while off < n:
            k = os.preadv(fd, [memoryview(buf)[: min(chunk, n - off)]], off)
            if k <= 0:
                break
            off += k
        os.close(fd)
    run_threads(len(paths), go)


def blocks_of(paths, block):
    out = []
    for p in paths:
        n = os.path.getsize(p)
        out += [(p, a, min(block, n - a)) for a in range(0, n, block)]
    return out


def taker(items):
    """A function handing out `items` in order, each once, to whichever thread asks (None
    once they are all taken)."""
    nxt = [0]
    lk = threading.Lock()

    def take():
        with lk:
            j = nxt[0]
            nxt[0] += 1
        return items[j] if j < len(items) else None
    return take


def up(k):
    """`k` rounded up to direct I/O's 4 KiB (a file's last block: the read stops at the end)."""
    return -(-k // 4096) * 4096


def shared_queue(paths, block, threads, direct=False, shared_fd=True):
    take = taker(blocks_of(paths, block))
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fds = {p: os.open(p, flags) for p in paths}

    def go(i):
        my = fds if shared_fd else {p: os.open(p, flags) for p in paths}
        buf = mmap.mmap(-1, block)
        while (b := take()) is not None:
            p, a, k = b
            os.preadv(my[p], [memoryview(buf)[:up(k) if direct else k]], a)
        if not shared_fd:
            for f in my.values():
                os.close(f)
    run_threads(threads, go)
    for f in fds.values():
        os.close(f)


def fadvise_walk_then_read(paths, block, walkers, readers, rblock=128 << 10):
    """Our readahead (walkers posix_fadvise WILLNEED 8 MB blocks in order) with readers
    preading small pieces in order behind it, like the controller threads."""
    fds = {p: os.open(p, os.O_RDONLY) for p in paths}
    next_block = taker(blocks_of(paths, block))
    next_piece = taker(blocks_of(paths, rblock))

    def walk(i):
        while (b := next_block()) is not None:
            p, a, k = b
            os.posix_fadvise(fds[p], a, k, os.POSIX_FADV_WILLNEED)

    def read(i):
        buf = bytearray(rblock)
        while (b := next_piece()) is not None:
            p, a, k = b
            os.preadv(fds[p], [memoryview(buf)[:k]], a)
    ts = [threading.Thread(target=walk, args=(i,)) for i in range(walkers)]
    ts += [threading.Thread(target=read, args=(i,)) for i in range(readers)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    for f in fds.values():
        os.close(f)


def quarters_of_one_file(path, parts, chunk, shared_fd, direct=False):
    n = os.path.getsize(path)
    per = -(-n // parts) // 4096 * 4096 + 4096
    flags = os.O_RDONLY | (os.O_DIRECT if direct else 0)
    fd0 = os.open(path, flags)

    def go(i):
        fd = fd0 if shared_fd else os.open(path, flags)
        buf = mmap.mmap(-1, chunk)
        off, end = i * per, min(n, (i + 1) * per)
        while off < end:
            k = min(chunk, end - off)
            k = os.preadv(fd, [memoryview(buf)[: up(k) if direct else k]], off)
            if k <= 0:
                break
            off += k
        if not shared_fd:
            os.close(fd)
    run_threads(parts, go)
    os.close(fd0)


M = 1 << 20
patterns = [
    ("disk-read: 4 files x 1 thread, 16MB buffered", files, lambda: per_file_sequential(files, 16 * M)),
    ("img: 4 quarters, own fds, 16MB buffered", [img], lambda: quarters_of_one_file(img, 4, 16 * M, False)),
    ("img: 4 quarters, shared fd, 16MB buffered", [img], lambda: quarters_of_one_file(img, 4, 16 * M, True)),
    ("img: fadvise 4 walkers 8MB + 16 readers 128K (ours)", [img], lambda: fadvise_walk_then_read([img], 8 * M, 4, 16)),
    ("img: 16 readers 128K only (no readahead)", [img], lambda: fadvise_walk_then_read([img], 8 * M, 0, 16)),
    ("img: queue 8MB blocks, 8 thr buffered shared fd", [img], lambda: shared_queue([img], 8 * M, 8)),
    ("img: queue 8MB blocks, 4 thr buffered shared fd", [img], lambda: shared_queue([img], 8 * M, 4)),
    ("img: queue 16MB blocks, 16 thr buffered", [img], lambda: shared_queue([img], 16 * M, 16)),
    ("img: O_DIRECT queue 8MB, 4 thr", [img], lambda: shared_queue([img], 8 * M, 4, direct=True)),
    ("img: O_DIRECT queue 8MB, 8 thr", [img], lambda: shared_queue([img], 8 * M, 8, direct=True)),
    ("img: O_DIRECT queue 2MB, 16 thr", [img], lambda: shared_queue([img], 2 * M, 16, direct=True)),
    ("img: O_DIRECT queue 16MB, 16 thr", [img], lambda: shared_queue([img], 16 * M, 16, direct=True)),
    ("disk-read again", files, lambda: per_file_sequential(files, 16 * M)),
    ("fastsafetensors 0.5: O_DIRECT 512K blocks in file order, 16 thr", files,
     lambda: shared_queue(files, 512 << 10, 16, direct=True)),
    ("img: O_DIRECT 16 parts x 1 thread, 4MB (controller threads, spread)", [img],
     lambda: quarters_of_one_file(img, 16, 4 * M, True, direct=True)),
    ("img: 16 parts x 1 thread, 4MB buffered (spread)", [img],
     lambda: quarters_of_one_file(img, 16, 4 * M, True)),
    ("img: O_DIRECT queue 512K, 16 thr", [img], lambda: shared_queue([img], 512 << 10, 16, direct=True)),
]
only = os.environ.get("ONLY")
for i, (name, paths, fn) in enumerate(patterns):
    if only and str(i) not in only.split(","):
        continue
    r = evict(paths)
    if r > 0.02:
        print(f"# {name}: eviction failed {r:.2f}")
        continue
    t = time.perf_counter()
    fn()
    s = time.perf_counter() - t
    tot = sum(os.path.getsize(p) for p in paths)
    print(json.dumps({"i": i, "pattern": name, "seconds": round(s, 3), "gbytes_per_s": round(tot / s / 1e9, 3)}), flush=True)
evict(files + [img])
