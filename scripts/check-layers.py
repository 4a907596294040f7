#!/usr/bin/env python3
"""The project's layering rules, checked from the sources (CI runs this):

1. No import circle between the top-level modules of any crate: a file src/x.rs or src/x/...
   is module x; `crate::y` in it (outside its #[cfg(test)] tail) is an arrow x -> y.
2. Crate arrows point one way: the runtime (gpu_queues) never depends on an emulated
   controller (nvme_emu, gpu_emu) or on the file layer, except as a dev-dependency for tests;
   the driver (nvme) and the spec (nvme_spec) depend on nothing above them; test-only crates
   (nvme_null) are never a normal dependency.
3. The library embedders link (gpunvme/) never depends on the CLI (gpunvme-cli) or on a
   crate only a command needs (argument parsing, progress bars, signal handlers, latency
   histograms, log output, anyhow); the bindings (python/, capi/) depend on the library, never
   on the CLI.

Prints each violation and exits 1 if there is any."""
import glob
import os
import re
import sys

root = sys.argv[1] if len(sys.argv) > 1 else os.path.join(os.path.dirname(__file__), "..")
bad = []

# 1. Module circles (Tarjan's strongly connected components).
for cargo in sorted(glob.glob(os.path.join(root, "**/Cargo.toml"), recursive=True)):
    if "/target/" in cargo or "/fuzz/" in cargo:
        continue
    src = os.path.join(os.path.dirname(cargo), "src")
    if not os.path.isdir(src):
        continue
    edges = {}
    for f in glob.glob(os.path.join(src, "**/*.rs"), recursive=True):
        rel = os.path.relpath(f, src).split(os.sep)
        mod = rel[0][:-3] if len(rel) == 1 else rel[0]
        if mod in ("lib", "main"):
            continue
        text = open(f, errors="replace").read()
        text = re.sub(r"//[^\n]*", "", text)
        text = text.split("#[cfg(test)]", 1)[0]
        targets = set(re.findall(r"crate::([a-z_][a-z0-9_]*)", text))
        for group in re.findall(r"crate::\{([^}]*)\}", text):
            targets |= set(re.findall(r"(?:^|,)\s*([a-z_][a-z0-9_]*)", group))
        targets.discard(mod)
        edges.setdefault(mod, set()).update(targets)
    mods = set(edges) | {t for v in edges.values() for t in v}
    index, low, stack, on, n = {}, {}, [], set(), [0]

    def strong(v):
        index[v] = low[v] = n[0]
        n[0] += 1
        stack.append(v)
        on.add(v)
        for w in edges.get(v, ()):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                crate = os.path.relpath(os.path.dirname(cargo), root)
                bad.append(f"import circle in {crate}: {' <-> '.join(sorted(comp))}")

    sys.setrecursionlimit(10000)
    for v in sorted(mods):
        if v not in index:
            strong(v)


# 2. Crate dependencies ([dependencies] only; dev-dependencies may reach further for tests).
def normal_deps(path):
    deps, section = set(), None
    for line in open(path):
        line = line.strip()
        if line.startswith("["):
            section = line.strip("[]")
            continue
        if section == "dependencies":
            m = re.match(r"([A-Za-z0-9_-]+)\s*[.=]", line)
            if m:
                deps.add(m.group(1))
    return deps


# Crates only a command needs: never a normal dependency of the library or of what it uses.
CLI_ONLY = {"gpunvme-cli", "clap", "indicatif", "ctrlc", "hdrhistogram", "tracing-subscriber", "anyhow"}
TEST_ONLY = {"nvme_null"}
LIBRARY = ["gpunvme", "settings", "nvme/spec", "nvme", "nvme/emu", "vfio", "gpu-queues", "gpu-queues/emu",
           "blockfs", "blockfs/gpu", "gpu-cache"]

ALL_CRATES = {"nvme_spec", "nvme", "nvme_emu", "vfio", "gpu_queues", "gpu_emu", "blockfs",
              "blockfs_gpu", "gpunvme"}
forbidden = {
    # The settings table sits below everything.
    "settings": ALL_CRATES,
    "nvme/spec": {"nvme", "nvme_emu", "vfio", "gpu_queues", "gpu_emu", "blockfs", "blockfs_gpu"},
    "nvme": {"nvme_emu", "vfio", "gpu_queues", "gpu_emu", "blockfs", "blockfs_gpu"},
    "gpu-queues": {"nvme_emu", "gpu_emu", "blockfs", "blockfs_gpu", "gpu_cache"},
    "blockfs": {"nvme_emu", "gpu_queues", "gpu_emu", "blockfs_gpu"},
    "blockfs/gpu": {"nvme_emu", "gpu_emu", "gpu_cache"},
    # The page cache sits above the file layer (cache -> files -> queues), on no emulator.
    "gpu-cache": {"nvme_emu", "gpu_emu", "gpunvme"},
}
for crate in LIBRARY:
    forbidden[crate] = forbidden.get(crate, set()) | CLI_ONLY | TEST_ONLY
for crate in ["python", "capi"]:
    forbidden[crate] = forbidden.get(crate, set()) | {"gpunvme-cli"} | TEST_ONLY
for crate, no in forbidden.items():
    path = os.path.join(root, crate, "Cargo.toml")
    if not os.path.exists(path):
        bad.append(f"{crate}/Cargo.toml is missing")
        continue
    for dep in sorted(normal_deps(path) & no):
        bad.append(f"{crate} depends on {dep}")

for line in bad:
    print(line)
if not bad:
    print("layers: no import circle; crate arrows point one way")
sys.exit(1 if bad else 0)
