#!/usr/bin/env python3
"""Runs the README's examples as a new user would: each fenced block, verbatim, in one new
empty directory (CI runs this; doctests do the same for Rust documentation).

A block's info string says what it needs:
  sh, python, rust   runs here: sh with `gpunvme` on PATH, python with the package installed,
                     rust as the main.rs of a new crate depending on the gpunvme library
  sh checkout        runs from the checkout (the main job)
  sh ci              a step CI runs anyway (`cargo test --workspace`): not run again here
  ... gpu            needs a GPU: runs only with --gpu (on the GPU machine)
  ... root           needs root and an SSD bound to vfio-pci: never runs here
  sh example         built and run by its own script (scripts/cuda-example.sh): not here
  (no info string)   not code (the layout table)

The directory starts with the files the tour names as the user's own: weights.bin (three 4 KiB
blocks), model.safetensors (a small valid checkpoint) and ckpt.bin (1 MiB). A rust block is
skipped, saying so, on a machine without cargo (the GPU machine).

  scripts/readme-examples.py [--bin DIR] [--python PY] [--gpu] [--keep]

--bin: where the gpunvme binary is (default target/release, built first if missing);
--python: a Python with the gpunvme package (default target/py-venv/bin/python, which
scripts/py-test.sh makes). Prints one JSON object (ran, skipped, failed) and exits 1 if a block
failed."""
import argparse
import json
import os
import re
import shutil
import struct
import subprocess
import sys
import tempfile

ROOT = os.path.abspath(os.path.join(os.path.dirname(__file__), ".."))


def blocks(text):
    """(line, heading, info words, body) of every fenced block."""
    out, heading, lines = [], "", text.split("\n")
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.startswith("#"):
            heading = line.lstrip("#").strip()
        m = re.match(r"^```(.*)$", line)
        if m:
            start, info, body = i + 1, m.group(1).split(), []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            out.append((start, heading, info, "\n".join(body) + "\n"))
        i += 1
    return out


def safetensors(n):
    header = json.dumps({"w": {"dtype": "U8", "shape": [n], "data_offsets": [0, n]}}).encode()
    header += b" " * (-len(header) % 8)
    return struct.pack("<Q", len(header)) + header + os.urandom(n)


def rust_crate(work, body):
    crate = os.path.join(work, ".readme-rust")
    os.makedirs(os.path.join(crate, "src"), exist_ok=True)
    with open(os.path.join(crate, "Cargo.toml"), "w") as f:
        f.write(
            '[package]\nname = "readme-example"\nversion = "0.0.0"\nedition = "2024"\n\n'
            f'[dependencies]\ngpunvme = {{ path = "{ROOT}/gpunvme" }}\n\n[workspace]\n'
        )
    with open(os.path.join(crate, "src", "main.rs"), "w") as f:
        f.write(body)
    # The checkout's lock file and target directory: the same dependency versions, built once.
    shutil.copy(os.path.join(ROOT, "Cargo.lock"), crate)
    return crate


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--bin", default=os.path.join(ROOT, "target", "release"))
    ap.add_argument("--python", default=os.path.join(ROOT, "target", "py-venv", "bin", "python"))
    ap.add_argument("--gpu", action="store_true")
    ap.add_argument("--keep", action="store_true")
    ap.add_argument("--readme", default=os.path.join(ROOT, "README.md"))
    a = ap.parse_args()
    binary = os.path.join(a.bin, "gpunvme")
    if not os.path.exists(binary) and shutil.which("cargo"):
        subprocess.run(["cargo", "build", "--release", "-q", "-p", "gpunvme-cli"], cwd=ROOT, check=True)
    work = tempfile.mkdtemp(prefix="gpunvme-readme.")
    with open(os.path.join(work, "weights.bin"), "wb") as f:
        f.write(os.urandom(3 * 4096))
    with open(os.path.join(work, "model.safetensors"), "wb") as f:
        f.write(safetensors(200_000))
    with open(os.path.join(work, "ckpt.bin"), "wb") as f:
        f.write(os.urandom(1 << 20))
    env = dict(os.environ, PATH=os.path.abspath(a.bin) + os.pathsep + os.environ["PATH"])
    env.setdefault("CARGO_TARGET_DIR", os.path.join(ROOT, "target"))
    ran, skipped, failed = [], [], []
    for line, heading, info, body in blocks(open(a.readme).read()):
        where = f"README.md:{line} ({heading})"
        if not info:
            continue
        lang, needs = info[0], set(info[1:])
        if "ci" in needs:
            skipped.append({"block": where, "why": "CI runs it as a step of its own"})
            continue
        if "example" in needs:
            skipped.append({"block": where, "why": "built and run by scripts/cuda-example.sh"})
            continue
        if "root" in needs:
            skipped.append({"block": where, "why": "needs root and an SSD bound to vfio-pci"})
            continue
        if "gpu" in needs and not a.gpu:
            skipped.append({"block": where, "why": "skipped: no GPU (run with --gpu on the GPU machine)"})
            continue
        if lang == "sh" and re.search(r"^cargo ", body, re.M) and shutil.which("cargo") is None:
            skipped.append({"block": where, "why": "skipped: no cargo on this machine"})
            continue
        cwd = ROOT if "checkout" in needs else work
        if lang == "sh":
            cmd = ["bash", "-euo", "pipefail", "-c", body]
        elif lang == "python":
            cmd = [a.python, "-c", body]
        elif lang == "rust" and shutil.which("cargo") is None:
            skipped.append({"block": where, "why": "skipped: no cargo on this machine"})
            continue
        elif lang == "rust":
            crate = rust_crate(work, body)
            cmd = ["cargo", "run", "-q", "--release", "--manifest-path", os.path.join(crate, "Cargo.toml")]
        else:
            skipped.append({"block": where, "why": f"not a runnable language ({lang})"})
            continue
        p = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True, timeout=1800)
        if p.returncode == 0:
            ran.append(where)
        else:
            failed.append({"block": where, "rc": p.returncode, "stdout": p.stdout[-2000:], "stderr": p.stderr[-2000:]})
    print(json.dumps({"dir": work, "ran": ran, "skipped": skipped, "failed": failed}, indent=1))
    if not a.keep:
        shutil.rmtree(work, ignore_errors=True)
    sys.exit(1 if failed or not ran else 0)


if __name__ == "__main__":
    main()
