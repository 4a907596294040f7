//! Issue 53, the CLI's part: commands that wrote raw LBAs over a file system without asking
//! (docs/cli.md, "Destructive commands"), raw reads and writes whose memory grew with their
//! length, and a `fs put` that stored a torn mix of a source being rewritten. Each test
//! reproduces what happened before.

use std::io::Read as _;
use std::os::unix::fs::FileExt as _;
use std::path::{Path, PathBuf};
use std::process::{Command, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, SystemTime};

mod common;
use common::{bin, error_line, gpunvme, image_file, ok, pattern};

fn image(dir: &Path, name: &str, bytes: u64) -> PathBuf {
    image_file(dir, name, bytes)
}

/// `write` (at LBA 0 and far from the file system's metadata) and `protocol-check` refuse a
/// namespace that holds a blockfs, or a member of a striped volume (whole or with a damaged
/// label), in one line naming what it holds and `--force`, and change no byte; `--force`
/// does it. Before: both ran and exited 0, `write --lba 0` leaving a file system that no
/// longer mounts.
#[test]
fn raw_writers_refuse_a_file_system_or_a_volume_member_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, "disk.img", 32 << 20);
    ok(&gpunvme(d, "--device disk.img fs mkfs"));
    let data = pattern(10_000, 1);
    std::fs::write(d.join("a.bin"), &data).unwrap();
    ok(&gpunvme(d, "--device disk.img fs put a.bin a"));
    std::fs::write(d.join("z.bin"), vec![0u8; 4096]).unwrap();
    let before = std::fs::read(&img).unwrap();
    for cmd in [
        "write --lba 0 --input z.bin",
        "write --lba 60000 --input z.bin",
        "protocol-check --ios 200",
        "protocol-check --ios 200 --size 1m --no-verify",
    ] {
        let line = error_line(&gpunvme(d, &format!("--device disk.img {cmd}")));
        let verb = cmd.split_whitespace().next().unwrap();
        assert!(
            line.contains("namespace 1 holds a blockfs with 1 file (10000 bytes)")
                && line.contains(&format!("{verb} would overwrite it"))
                && line.contains("--force"),
            "{cmd}: {line}"
        );
    }
    // With --json, the error object says `refused`.
    let out = gpunvme(d, "--device disk.img --json write --lba 0 --input z.bin");
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["kind"], "refused", "{v}");
    assert!(
        std::fs::read(&img).unwrap() == before,
        "a refusal changed the image"
    );
    ok(&gpunvme(d, "--device disk.img fs get a back.bin"));
    assert_eq!(std::fs::read(d.join("back.bin")).unwrap(), data);

    // A member of a striped volume holds no blockfs of its own, but its label and stripes.
    image(d, "m0.img", 32 << 20);
    image(d, "m1.img", 32 << 20);
    ok(&gpunvme(d, "--device m0.img,m1.img fs mkfs"));
    ok(&gpunvme(d, "--device m0.img,m1.img fs put a.bin a"));
    let members = || {
        [
            std::fs::read(d.join("m0.img")).unwrap(),
            std::fs::read(d.join("m1.img")).unwrap(),
        ]
    };
    let before = members();
    for (dev, member) in [("m0.img", 0), ("m1.img", 1)] {
        for cmd in [
            "write --lba 5000 --input z.bin",
            "protocol-check --ios 200",
            "perf --rw randwrite --ios 100",
        ] {
            let line = error_line(&gpunvme(d, &format!("--device {dev} {cmd}")));
            assert!(
                line.contains(&format!(
                    "namespace 1 holds member {member} of a 2-member striped volume"
                )) && line.contains("--force"),
                "{dev} {cmd}: {line}"
            );
        }
    }
    // perf over both members at once: the first is named.
    let line = error_line(&gpunvme(
        d,
        "--device m0.img,m1.img perf --rw randread --verify --ios 100",
    ));
    assert!(
        line.contains("m0.img: namespace 1 holds member 0"),
        "{line}"
    );
    assert!(members() == before, "a refusal changed a member");
    // A damaged label still marks a member.
    let mut m0 = before[0].clone();
    m0[20] ^= 0x01;
    std::fs::write(d.join("m0.img"), &m0).unwrap();
    let line = error_line(&gpunvme(
        d,
        "--device m0.img write --lba 5000 --input z.bin",
    ));
    assert!(
        line.contains("holds a damaged striped-volume label") && line.contains("--force"),
        "{line}"
    );
    assert!(std::fs::read(d.join("m0.img")).unwrap() == m0);

    // --force does it.
    let zero = pattern(4096, 9);
    std::fs::write(d.join("z.bin"), &zero).unwrap();
    ok(&gpunvme(
        d,
        "--device disk.img write --lba 0 --input z.bin --force",
    ));
    assert!(std::fs::read(&img).unwrap()[..4096] == zero[..]);
    let out = ok(&gpunvme(
        d,
        "--device m1.img --json protocol-check --ios 200 --size 1m --force",
    ));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["passed"], true, "{v}");
}

/// The README's tour in order, without `--device` except where it says: nothing it does
/// destroys the file system on the default image, and `protocol-check` on that image is
/// refused. Before: the tour began with `write --lba 0` on `./gpunvme.img`, and
/// `protocol-check` overwrote it.
#[test]
fn the_readme_tour_loses_nothing() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let weights = pattern(3 * 4096, 2);
    std::fs::write(d.join("weights.bin"), &weights).unwrap();
    let model = pattern(200_000, 3);
    std::fs::write(d.join("model.safetensors"), &model).unwrap();
    let readme =
        std::fs::read_to_string(concat!(env!("CARGO_MANIFEST_DIR"), "/README.md")).unwrap();
    // The tour's raw-LBA lines name an image of their own.
    let raw: Vec<_> = readme
        .lines()
        .filter(|l| l.starts_with("gpunvme ") && l.contains(" --lba "))
        .collect();
    assert!(raw.len() >= 2, "{raw:?}");
    for line in raw {
        assert!(line.contains("--device raw.img"), "README: {line}");
    }
    assert!(readme.contains("truncate -s 1G raw.img"));
    image(d, "raw.img", 1 << 30);
    for cmd in [
        "--device raw.img write --nsid 1 --lba 0 --input weights.bin",
        "--device raw.img read --nsid 1 --lba 0 --bytes 12k --output out.bin",
        "--device raw.img identify --json",
        "--device raw.img log",
        "fs mkfs",
        "fs put model.safetensors models/llama/shard0",
        "fs ls models/ --json",
        "--device raw.img write --nsid 1 --lba 0 --input weights.bin",
        "fs get models/llama/shard0 copy.safetensors",
        "fs fsck --repair",
    ] {
        ok(&gpunvme(d, cmd));
    }
    assert_eq!(std::fs::read(d.join("out.bin")).unwrap(), weights);
    assert_eq!(std::fs::read(d.join("copy.safetensors")).unwrap(), model);
    let before = std::fs::read(d.join("gpunvme.img")).unwrap();
    for cmd in ["protocol-check", "write --lba 0 --input weights.bin"] {
        let line = error_line(&gpunvme(d, cmd));
        assert!(
            line.contains("holds a blockfs with 1 file"),
            "{cmd}: {line}"
        );
    }
    assert!(std::fs::read(d.join("gpunvme.img")).unwrap() == before);
    let fsck: serde_json::Value =
        serde_json::from_str(&ok(&gpunvme(d, "fs fsck --data --json"))).unwrap();
    assert_eq!(fsck["clean"], true, "{fsck}");
}

/// Runs `gpunvme` in `dir` under an address-space limit of `limit` bytes (`ulimit -v`), with
/// `stdout` as its standard output; `None` where the shell cannot set the limit.
fn limited(dir: &Path, limit: u64, args: &str, stdout: Stdio) -> Option<std::process::Child> {
    let probe = Command::new("sh")
        .args(["-c", &format!("ulimit -v {}", limit >> 10)])
        .status()
        .ok()?;
    if !probe.success() {
        return None;
    }
    Command::new("sh")
        .current_dir(dir)
        .arg("-c")
        .arg(format!("ulimit -v {} && exec \"$0\" {args}", limit >> 10))
        .arg(env!("CARGO_BIN_EXE_gpunvme"))
        // Image reads by pread: a mapping of the whole image would count against the limit
        // wherever the temporary directory is on tmpfs.
        .env("NVME_EMU_IMAGE_READS", "pread")
        .stdout(stdout)
        .stderr(Stdio::piped())
        .spawn()
        .ok()
}

/// `read` of 512 MiB and `write` of 320 MiB under a 256 MiB address-space limit: both stream
/// through bounded buffers, and the bytes are exactly the image's. Before: `read` allocated
/// the whole length and aborted (exit 134, "memory allocation of 536870912 bytes failed"),
/// and `write` read its whole input into memory.
#[test]
fn raw_reads_and_writes_stream_in_bounded_memory() {
    const LIMIT: u64 = 256 << 20;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, "big.img", 1 << 30);
    // A pattern at both ends of the range the reads cover, and a write larger than the limit.
    let head = pattern((1 << 20) + 3 * 512, 4);
    let tail = pattern(1 << 20, 5);
    std::fs::write(d.join("head.bin"), &head).unwrap();
    std::fs::write(d.join("tail.bin"), &tail).unwrap();
    let tail_lba = ((512u64 << 20) - (1 << 20)) / 512;
    ok(&gpunvme(
        d,
        "--device big.img write --lba 0 --input head.bin",
    ));
    ok(&gpunvme(
        d,
        &format!("--device big.img write --lba {tail_lba} --input tail.bin"),
    ));
    let big_len = 320usize << 20;
    let big_lba = (600u64 << 20) / 512;
    {
        let f = std::fs::File::create(d.join("in.bin")).unwrap();
        for (i, piece) in (0..big_len).step_by(8 << 20).enumerate() {
            f.write_all_at(&pattern(8 << 20, 100 + i as u32), piece as u64)
                .unwrap();
        }
    }
    let Some(child) = limited(
        d,
        LIMIT,
        &format!("--device big.img write --lba {big_lba} --input in.bin"),
        Stdio::piped(),
    ) else {
        eprintln!("skipped: the shell cannot limit the address space here");
        return;
    };
    ok(&child.wait_with_output().unwrap());
    let image_at = |off: u64, len: usize| {
        let mut b = vec![0u8; len];
        std::fs::File::open(&img)
            .unwrap()
            .read_exact_at(&mut b, off)
            .unwrap();
        b
    };
    for (i, piece) in (0..big_len).step_by(8 << 20).enumerate() {
        assert!(
            image_at(big_lba * 512 + piece as u64, 8 << 20) == pattern(8 << 20, 100 + i as u32),
            "piece {i} of the limited write"
        );
    }

    // 512 MiB into a file, under the limit.
    let child = limited(
        d,
        LIMIT,
        "--device big.img read --lba 0 --bytes 512m --output out.bin",
        Stdio::piped(),
    )
    .unwrap();
    ok(&child.wait_with_output().unwrap());
    let out = std::fs::File::open(d.join("out.bin")).unwrap();
    assert_eq!(out.metadata().unwrap().len(), 512 << 20);
    let mut at = 0u64;
    let mut buf = vec![0u8; 4 << 20];
    while at < 512 << 20 {
        out.read_exact_at(&mut buf, at).unwrap();
        assert!(buf == image_at(at, buf.len()), "bytes at {at}");
        at += buf.len() as u64;
    }
    let mut first = vec![0u8; head.len()];
    out.read_exact_at(&mut first, 0).unwrap();
    assert_eq!(first, head);

    // And into a pipe: an odd length from an odd LBA, so pieces end mid-pattern.
    let (lba, bytes) = (7u64, (300u64 << 20) + 5 * 512);
    let mut child = limited(
        d,
        LIMIT,
        &format!("--device big.img read --lba {lba} --bytes {bytes} --output -"),
        Stdio::piped(),
    )
    .unwrap();
    let mut stdout = child.stdout.take().unwrap();
    let mut got = 0u64;
    let mut digest = 0u32;
    loop {
        let n = stdout.read(&mut buf).unwrap();
        if n == 0 {
            break;
        }
        digest = crc32c::crc32c_append(digest, &buf[..n]);
        got += n as u64;
    }
    ok(&child.wait_with_output().unwrap());
    assert_eq!(got, bytes);
    let mut want = 0u32;
    let mut at = 0u64;
    while at < bytes {
        let n = (bytes - at).min(4 << 20) as usize;
        want = crc32c::crc32c_append(want, &image_at(lba * 512 + at, n));
        at += n as u64;
    }
    assert_eq!(digest, want, "the piped bytes are the image's");
}

/// `read`'s output through a symbolic link replaces the file the link names (the link stays),
/// with that file's permissions, and leaves no temporary file.
#[test]
fn read_output_through_a_link_replaces_the_file_it_names() {
    use std::os::unix::fs::PermissionsExt as _;
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, "raw.img", 8 << 20);
    let data = pattern(64 << 10, 11);
    std::fs::write(d.join("in.bin"), &data).unwrap();
    ok(&gpunvme(d, "--device raw.img write --lba 8 --input in.bin"));
    std::fs::write(d.join("target.bin"), b"old").unwrap();
    std::fs::set_permissions(d.join("target.bin"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::os::unix::fs::symlink("target.bin", d.join("link.bin")).unwrap();
    ok(&gpunvme(
        d,
        "--device raw.img read --lba 8 --bytes 64k --output link.bin",
    ));
    let link = std::fs::symlink_metadata(d.join("link.bin")).unwrap();
    assert!(link.file_type().is_symlink());
    assert_eq!(std::fs::read(d.join("target.bin")).unwrap(), data);
    let mode = std::fs::metadata(d.join("target.bin"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o640);
    let names: Vec<_> = std::fs::read_dir(d)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .filter(|n| n.contains("gpunvme-read"))
        .collect();
    assert!(names.is_empty(), "{names:?}");
}

/// Sets `path`'s modification time to an hour ago, so that a rewrite within the same clock
/// tick as its creation still moves it.
fn age(path: &Path) {
    std::fs::File::options()
        .write(true)
        .open(path)
        .unwrap()
        .set_modified(SystemTime::now() - Duration::from_secs(3600))
        .unwrap();
}

/// `put` of a source rewritten in place while it is copied (same length, other bytes: here
/// from the progress callback, deterministically) fails with `SourceModified` and stores
/// nothing: a replaced file keeps its old version, a new name stays absent, even after a later
/// sync of the same mount (as a Python or C handle does), and fsck is clean. Before: the put
/// returned a report with a CRC-32C over the mix.
#[test]
fn a_put_of_a_source_rewritten_meanwhile_stores_nothing() {
    use gpunvme::copy::{CopyError, PutOptions, put};
    let dev = Arc::new(blockfs::MemDevice::new(512, (64 << 20) / 512));
    let fs = blockfs::FileSystem::mkfs(dev.clone(), &blockfs::MkfsOptions::default()).unwrap();
    let dir = tempfile::tempdir().unwrap();
    let src = dir.path().join("src.bin");
    let (old, new) = (pattern(3 << 20, 6), pattern(3 << 20, 7));
    std::fs::write(&src, &old).unwrap();
    put(&fs, &src, "f", &PutOptions::default(), &|_| {}).unwrap();
    for (name, force) in [("f", true), ("g", false)] {
        std::fs::write(&src, &old).unwrap();
        age(&src);
        let rewritten = AtomicBool::new(false);
        let rewrite = |_| {
            if !rewritten.swap(true, Ordering::Relaxed) {
                // In place: same inode, same length.
                let f = std::fs::File::options().write(true).open(&src).unwrap();
                f.write_all_at(&new, 0).unwrap();
            }
        };
        let opts = PutOptions {
            force,
            chunk: Some(1 << 20),
        };
        let err = put(&fs, &src, name, &opts, &rewrite).unwrap_err();
        assert!(
            matches!(&err, CopyError::SourceModified { path } if *path == src),
            "{name}: {err}"
        );
        assert!(
            err.to_string().contains("was modified while being copied"),
            "{err}"
        );
        // A later commit of the same mount stores nothing of it either.
        fs.sync().unwrap();
        let names: Vec<String> = fs.list("").into_iter().map(|s| s.name).collect();
        assert_eq!(names, ["f"], "{name}");
    }
    let mut back = vec![0u8; old.len()];
    let f = fs.open("f", blockfs::OpenMode::ReadOnly).unwrap();
    assert_eq!(f.read_at(0, &mut back).unwrap(), old.len());
    assert!(back == old, "the old version keeps the name");
    drop(f);
    drop(fs);
    let report = blockfs::fsck(dev.clone(), &blockfs::FsckOptions { repair: false }).unwrap();
    assert!(report.is_consistent(), "{report:?}");
    let fs = blockfs::FileSystem::mount(dev).unwrap();
    assert_eq!(fs.list("").len(), 1);
    // An unchanged source still copies.
    std::fs::write(&src, &new).unwrap();
    put(&fs, &src, "g", &PutOptions::default(), &|_| {}).unwrap();
}

/// The same through the CLI, with a writer rewriting the source in place for as long as the
/// `put` runs: the put fails in one line (exit 1), the file system holds no such file and
/// fsck with data is clean. Before: exit 0 and a file whose bytes were a mix of versions.
#[test]
fn fs_put_of_a_file_being_rewritten_fails() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, "disk.img", 128 << 20);
    ok(&gpunvme(d, "--device disk.img fs mkfs"));
    let len = 32usize << 20;
    let src = d.join("src.bin");
    std::fs::write(&src, pattern(len, 8)).unwrap();
    let stop = Arc::new(AtomicBool::new(false));
    let rounds = Arc::new(AtomicU64::new(0));
    let writer = {
        let (stop, rounds, src) = (stop.clone(), rounds.clone(), src.clone());
        std::thread::spawn(move || {
            let f = std::fs::File::options().write(true).open(&src).unwrap();
            let pieces = [pattern(1 << 20, 9), pattern(1 << 20, 10)];
            let mut i = 0usize;
            while !stop.load(Ordering::Relaxed) {
                let at = (i * (1 << 20)) % len;
                f.write_all_at(&pieces[i % 2], at as u64).unwrap();
                rounds.fetch_add(1, Ordering::Relaxed);
                i += 1;
                std::thread::sleep(Duration::from_micros(200));
            }
        })
    };
    while rounds.load(Ordering::Relaxed) == 0 {
        std::thread::yield_now();
    }
    let out = bin()
        .current_dir(d)
        .args(["--device", "disk.img", "fs", "put", "src.bin", "f"])
        .output()
        .unwrap();
    stop.store(true, Ordering::Relaxed);
    writer.join().unwrap();
    let line = error_line(&out);
    assert!(
        line.contains("src.bin was modified while being copied") && line.contains("nothing"),
        "{line}"
    );
    let ls = ok(&gpunvme(d, "--device disk.img --json fs ls"));
    let v: serde_json::Value = serde_json::from_str(&ls).unwrap();
    assert_eq!(v.as_array().unwrap().len(), 0, "{v}");
    let fsck: serde_json::Value =
        serde_json::from_str(&ok(&gpunvme(d, "--device disk.img fs fsck --data --json"))).unwrap();
    assert_eq!(fsck["clean"], true, "{fsck}");
}

/// One flipped byte in one member's volume label: every command refuses the volume, and
/// `fs fsck --repair` rebuilds the label from the other members (saying so), after which every
/// file reads back. Before: the volume stayed locked and repair could not rebuild the label.
#[test]
fn fsck_repair_rebuilds_one_damaged_volume_label() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, "a.img", 32 << 20);
    let b = image(d, "b.img", 32 << 20);
    let vol = "--device a.img,b.img";
    ok(&gpunvme(d, &format!("{vol} fs mkfs")));
    let data = pattern(300_000, 7);
    std::fs::write(d.join("x.bin"), &data).unwrap();
    ok(&gpunvme(d, &format!("{vol} fs put x.bin x")));
    // A byte of b's label past its magic (byte 40 of the label at the start of the device).
    let f = std::fs::OpenOptions::new()
        .write(true)
        .read(true)
        .open(&b)
        .unwrap();
    let mut byte = [0u8; 1];
    f.read_exact_at(&mut byte, 40).unwrap();
    f.write_all_at(&[byte[0] ^ 0x5a], 40).unwrap();
    drop(f);
    error_line(&gpunvme(d, &format!("{vol} fs ls")));
    let out = gpunvme(d, &format!("{vol} --json fs fsck --repair"));
    ok(&out);
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    let repairs = v["repairs"].as_array().expect("repairs in the report");
    assert!(
        repairs
            .first()
            .and_then(|r| r.as_str())
            .is_some_and(|r| r.contains("label")),
        "the first repair names the label: {v}"
    );
    assert_eq!(v["lost"], serde_json::json!([]), "{v}");
    ok(&gpunvme(d, &format!("{vol} fs get x y.bin")));
    assert_eq!(std::fs::read(d.join("y.bin")).unwrap(), data);
    ok(&gpunvme(d, &format!("{vol} fs fsck")));
}
