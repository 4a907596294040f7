#!/usr/bin/env python3
"""setup-costs.py: what the pieces of a GPU queue set-up cost on this machine's GPU, through the
CUDA driver API directly (ctypes on libcuda; no gpunvme build needed). One JSON line per
measurement: pinned host memory (cuMemHostAlloc) of the copy engines' sizes, one at a time, one
large, from several threads, zeroed or not; host registrations (cuMemHostRegister) of 4 KiB-page
and transparent-huge-page memory; GPU memory (cuMemAlloc, cuMemsetD8) of the queue pairs' sizes;
stream creation. Each figure is the median of --reps runs, in milliseconds.

Usage: scripts/setup-costs.py [--gpu N] [--reps R]
"""

import argparse
import ctypes
import json
import mmap
import statistics
import threading
import time

MIB = 1 << 20


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--gpu", type=int, default=0)
    ap.add_argument("--reps", type=int, default=3)
    args = ap.parse_args()

    cu = ctypes.CDLL("libcuda.so.1")
    libc = ctypes.CDLL("libc.so.6", use_errno=True)

    def check(name, rc):
        if rc != 0:
            raise RuntimeError(f"{name} failed: CUDA error {rc}")

    check("cuInit", cu.cuInit(0))
    dev = ctypes.c_int()
    check("cuDeviceGet", cu.cuDeviceGet(ctypes.byref(dev), args.gpu))
    ctx = ctypes.c_void_p()
    t = time.perf_counter()
    check("cuDevicePrimaryCtxRetain", cu.cuDevicePrimaryCtxRetain(ctypes.byref(ctx), dev))
    check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
    print(json.dumps({"what": "primary context", "ms": round((time.perf_counter() - t) * 1e3, 2)}))

    DEVICEMAP, PORTABLE = 0x02, 0x01

    def host_alloc(n):
        p = ctypes.c_void_p()
        check("cuMemHostAlloc", cu.cuMemHostAlloc(ctypes.byref(p), ctypes.c_size_t(n), DEVICEMAP | PORTABLE))
        return p

    def host_free(p):
        check("cuMemFreeHost", cu.cuMemFreeHost(p))

    def timed(fn, cleanup):
        runs = []
        for _ in range(args.reps):
            t0 = time.perf_counter()
            r = fn()
            runs.append((time.perf_counter() - t0) * 1e3)
            cleanup(r)
        return round(statistics.median(runs), 2)

    def report(what, ms, **kw):
        print(json.dumps({"what": what, "ms": ms, **kw}), flush=True)

    # Pinned memory of the copy engines' shapes (16 engines x 3 areas of 4.25 MiB).
    area = 4 * MIB + 8192 * 32
    for count, size in [(1, area), (48, area), (1, 48 * area), (48, MIB), (48, 256 << 10)]:
        report(
            "cuMemHostAlloc",
            timed(lambda: [host_alloc(size) for _ in range(count)], lambda ps: [host_free(p) for p in ps]),
            count=count,
            mib_each=round(size / MIB, 3),
        )

    def zeroed(count, size):
        ps = [host_alloc(size) for _ in range(count)]
        for p in ps:
            ctypes.memset(p, 0, size)
        return ps

    report(
        "cuMemHostAlloc + memset",
        timed(lambda: zeroed(48, area), lambda ps: [host_free(p) for p in ps]),
        count=48,
        mib_each=round(area / MIB, 3),
    )

    def parallel(threads, per_thread, size):
        out = [[] for _ in range(threads)]

        def work(i):
            check("cuCtxSetCurrent", cu.cuCtxSetCurrent(ctx))
            out[i] = [host_alloc(size) for _ in range(per_thread)]

        ts = [threading.Thread(target=work, args=(i,)) for i in range(threads)]
        for t_ in ts:
            t_.start()
        for t_ in ts:
            t_.join()
        return [p for o in out for p in o]

    report(
        "cuMemHostAlloc from threads",
        timed(lambda: parallel(16, 3, area), lambda ps: [host_free(p) for p in ps]),
        threads=16,
        count=48,
        mib_each=round(area / MIB, 3),
    )

    # Registrations of anonymous memory: 4 KiB pages, and transparent huge pages.
    libc.mmap.restype = ctypes.c_void_p
    libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
    libc.munmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t]
    libc.madvise.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    MADV_HUGEPAGE = 14
    size = 48 * area // (2 * MIB) * (2 * MIB) + 2 * MIB

    def register(huge):
        raw = libc.mmap(None, size + 2 * MIB, mmap.PROT_READ | mmap.PROT_WRITE, mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS, -1, 0)
        base = (raw + 2 * MIB - 1) // (2 * MIB) * (2 * MIB)
        if huge:
            libc.madvise(base, size, MADV_HUGEPAGE)
        ctypes.memset(base, 0, size)
        check("cuMemHostRegister", cu.cuMemHostRegister_v2(ctypes.c_void_p(base), ctypes.c_size_t(size), DEVICEMAP | PORTABLE))
        return raw, base

    def unregister(rb):
        raw, base = rb
        check("cuMemHostUnregister", cu.cuMemHostUnregister(ctypes.c_void_p(base)))
        libc.munmap(raw, size + 2 * MIB)

    for huge in (False, True):
        report("mmap + memset + cuMemHostRegister", timed(lambda: register(huge), unregister), mib=size // MIB, huge_pages=huge)

    # GPU memory of the queue pairs' shapes (63 pairs: sq, cq, PRP pages, 256 x 128 KiB slots).
    def dev_alloc(n, zero):
        p = ctypes.c_uint64()
        check("cuMemAlloc", cu.cuMemAlloc_v2(ctypes.byref(p), ctypes.c_size_t(n)))
        if zero:
            check("cuMemsetD8", cu.cuMemsetD8_v2(p, 0, ctypes.c_size_t(n)))
        return p

    def dev_free(ps):
        check("cuCtxSynchronize", cu.cuCtxSynchronize())
        for p in ps:
            check("cuMemFree", cu.cuMemFree_v2(p))

    for count, n in [(63, 32 * MIB), (63, 2 * MIB), (252, 64 << 10), (1, 63 * 32 * MIB)]:
        for zero in (False, True):
            report(
                "cuMemAlloc" + (" + cuMemsetD8" if zero else ""),
                timed(lambda: [dev_alloc(n, zero) for _ in range(count)], dev_free),
                count=count,
                mib_each=round(n / MIB, 3),
            )

    # The pre-built PRP lists: 2 MiB per pair written from pageable memory (63 pairs), against
    # only their used 248 bytes per 8 KiB row (cuMemcpy2D), and 1 MiB host-to-device as a rate.
    lists = ctypes.create_string_buffer(2 * MIB)

    def writes(count, n):
        ps = [dev_alloc(2 * MIB, True) for _ in range(count)]
        t0 = time.perf_counter()
        for p in ps:
            check("cuMemcpyHtoD", cu.cuMemcpyHtoD_v2(p, lists, ctypes.c_size_t(n)))
        ms = (time.perf_counter() - t0) * 1e3
        dev_free(ps)
        return ms

    report("cuMemcpyHtoD (pageable)", round(statistics.median(writes(63, 2 * MIB) for _ in range(args.reps)), 2), count=63, mib_each=2.0)

    class Memcpy2D(ctypes.Structure):
        _fields_ = [
            ("srcXInBytes", ctypes.c_size_t), ("srcY", ctypes.c_size_t), ("srcMemoryType", ctypes.c_int),
            ("srcHost", ctypes.c_void_p), ("srcDevice", ctypes.c_uint64), ("srcArray", ctypes.c_void_p),
            ("srcPitch", ctypes.c_size_t),
            ("dstXInBytes", ctypes.c_size_t), ("dstY", ctypes.c_size_t), ("dstMemoryType", ctypes.c_int),
            ("dstHost", ctypes.c_void_p), ("dstDevice", ctypes.c_uint64), ("dstArray", ctypes.c_void_p),
            ("dstPitch", ctypes.c_size_t),
            ("WidthInBytes", ctypes.c_size_t), ("Height", ctypes.c_size_t),
        ]

    def writes_2d(count):
        ps = [dev_alloc(2 * MIB, True) for _ in range(count)]
        t0 = time.perf_counter()
        for p in ps:
            c = Memcpy2D()
            c.srcMemoryType, c.srcHost, c.srcPitch = 1, ctypes.cast(lists, ctypes.c_void_p), 248
            c.dstMemoryType, c.dstDevice, c.dstPitch = 2, p.value, 8192
            c.WidthInBytes, c.Height = 248, 256
            check("cuMemcpy2D", cu.cuMemcpy2D_v2(ctypes.byref(c)))
        ms = (time.perf_counter() - t0) * 1e3
        dev_free(ps)
        return ms

    report("cuMemcpy2D (pageable, 256 rows of 248 B)", round(statistics.median(writes_2d(63) for _ in range(args.reps)), 2), count=63)

    def streams(n):
        ss = []
        for _ in range(n):
            s = ctypes.c_void_p()
            check("cuStreamCreate", cu.cuStreamCreate(ctypes.byref(s), 1))
            ss.append(s)
        return ss

    report("cuStreamCreate", timed(lambda: streams(32), lambda ss: [cu.cuStreamDestroy_v2(s) for s in ss]), count=32)


if __name__ == "__main__":
    main()
