//! Issue 11, process-level: what two `gpunvme` processes on one image, read-only images, and
//! the other everyday hazards (docs/cli.md, "One process per device", "What is refused, and what `--force` does") do.
//! Each test reproduces a way data was lost or corrupted before.

use std::collections::BTreeMap;
use std::io::Read;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::time::{Duration, Instant};

mod common;
use common::{bin, error_line, gpunvme, image_file, ok, pattern};

fn image(dir: &Path, bytes: u64) -> PathBuf {
    image_file(dir, "disk.img", bytes)
}

/// A `gpunvme fs get NAME -` that holds the image (shared lock) until killed: its standard
/// output is a pipe nobody reads, so it blocks once the pipe is full.
struct BlockedReader(Child);

impl BlockedReader {
    fn start(dir: &Path, name: &str) -> Self {
        let mut child = bin()
            .current_dir(dir)
            .args(["--device", "disk.img", "fs", "get", name, "-"])
            .stdout(Stdio::piped())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        // Its first bytes on the pipe mean the controller (and the lock) is up.
        let mut first = [0u8; 1];
        child
            .stdout
            .as_mut()
            .unwrap()
            .read_exact(&mut first)
            .unwrap();
        Self(child)
    }

    fn pid(&self) -> u32 {
        self.0.id()
    }
}

impl Drop for BlockedReader {
    fn drop(&mut self) {
        let _ = self.0.kill();
        let _ = self.0.wait();
    }
}

#[test]
fn a_second_writer_is_refused_naming_the_holder_and_readers_share() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 64 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    ok(&fs("mkfs"));
    let big = pattern(8 << 20, 1);
    std::fs::write(d.join("big.bin"), &big).unwrap();
    std::fs::write(d.join("small.bin"), pattern(5000, 2)).unwrap();
    ok(&fs("put big.bin big"));
    ok(&fs("put small.bin keep1"));

    let reader = BlockedReader::start(d, "big");
    // Every command that changes the image is refused, in one line naming the reader's pid,
    // and changes nothing.
    for cmd in [
        "fs put small.bin other",
        "fs rm keep1",
        "fs mv keep1 keep2",
        "fs mkfs",
        "fs fsck --repair",
        "write --lba 0 --input small.bin",
        "perf --rw randwrite --ios 100",
        "perf --rw randread --ios 100 --verify",
    ] {
        let line = error_line(&gpunvme(d, &format!("--device disk.img {cmd}")));
        assert!(
            line.contains(&format!("disk.img is in use by process {}", reader.pid())),
            "{cmd}: {line}"
        );
    }
    // Readers run beside it.
    let ls: serde_json::Value = serde_json::from_str(&ok(&fs("ls --json"))).unwrap();
    let names: Vec<_> = ls
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].clone())
        .collect();
    assert_eq!(names, ["big", "keep1"]);
    ok(&fs("get keep1 k.bin"));
    assert_eq!(std::fs::read(d.join("k.bin")).unwrap(), pattern(5000, 2));
    ok(&fs("stat big"));
    ok(&fs("df"));
    ok(&fs("fsck"));
    ok(&gpunvme(d, "--device disk.img identify"));
    ok(&gpunvme(
        d,
        "--device disk.img perf --rw randread --ios 100",
    ));
    ok(&gpunvme(
        d,
        "--device disk.img read --lba 0 --bytes 4k --output raw.bin",
    ));

    // A writer holds an image exclusively: readers are refused too (a raw image here, so the
    // writes destroy nothing).
    drop(reader);
    std::fs::File::create(d.join("raw.img"))
        .unwrap()
        .set_len(8 << 20)
        .unwrap();
    // `write` opens the device, then reads its input: from a FIFO, it holds the image until
    // the test writes to the FIFO, and it has the lock once it has opened the FIFO.
    let fifo = d.join("fifo");
    assert!(
        Command::new("mkfifo")
            .arg(&fifo)
            .status()
            .unwrap()
            .success()
    );
    let mut writer = bin()
        .current_dir(d)
        .args([
            "--device", "raw.img", "write", "--lba", "0", "--input", "fifo",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let pid = writer.id();
    let mut input = std::fs::OpenOptions::new().write(true).open(&fifo).unwrap();
    let line = error_line(&gpunvme(d, "--device raw.img identify"));
    assert!(
        line.contains(&format!("raw.img is being changed by process {pid}")),
        "{line}"
    );
    std::io::Write::write_all(&mut input, &[0x5a; 4096]).unwrap();
    drop(input);
    assert!(writer.wait().unwrap().success());
    // Gone with its process.
    ok(&gpunvme(d, "--device raw.img identify"));
}

/// What a successful command does to a worker's model of its names.
type ModelChange = Box<dyn Fn(&mut BTreeMap<String, Vec<u8>>)>;

/// A lock refusal, as opposed to any other failure.
fn is_lock_error(out: &Output) -> bool {
    let err = String::from_utf8_lossy(&out.stderr);
    !out.status.success()
        && err.lines().filter(|l| !l.trim().is_empty()).count() == 1
        && (err.contains("disk.img is in use by") || err.contains("disk.img is being changed by"))
}

#[test]
fn processes_racing_on_one_image_never_corrupt_it() {
    const WORKERS: usize = 4;
    const RUN: Duration = Duration::from_secs(3);
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path().to_owned();
    image(&d, 64 << 20);
    ok(&gpunvme(&d, "--device disk.img fs mkfs"));
    let start = Instant::now();
    let workers: Vec<_> = (0..WORKERS)
        .map(|w| {
            let d = d.clone();
            std::thread::spawn(move || {
                // What this worker's successful commands say its names hold.
                let mut model: BTreeMap<String, Vec<u8>> = BTreeMap::new();
                let (mut done, mut refused) = (0u32, 0u32);
                let mut step = 0u32;
                let mut round = 0u32;
                let src = d.join(format!("src{w}.bin"));
                let dst = d.join(format!("dst{w}.bin"));
                let (a, b) = (format!("w{w}/a"), format!("w{w}/b"));
                while start.elapsed() < RUN {
                    let seed = (w as u32) << 24 | round << 4 | step;
                    let (cmd, new_state): (String, Option<ModelChange>) = match step {
                        // put a fresh file under `a`, and every third round one to keep
                        0 | 4 => {
                            let name = if step == 0 {
                                a.clone()
                            } else {
                                format!("w{w}/keep{round}")
                            };
                            let data = pattern(1000 + (seed as usize * 7919) % 300_000, seed);
                            std::fs::write(&src, &data).unwrap();
                            let n = name.clone();
                            (
                                format!("fs put {} {name}", src.display()),
                                Some(Box::new(move |m| {
                                    m.insert(n.clone(), data.clone());
                                })),
                            )
                        }
                        1 => (format!("fs get {a} {}", dst.display()), None),
                        2 => {
                            let (a2, b2) = (a.clone(), b.clone());
                            (
                                format!("fs mv {a} {b}"),
                                Some(Box::new(move |m| {
                                    let v = m.remove(&a2).unwrap();
                                    m.insert(b2.clone(), v);
                                })),
                            )
                        }
                        _ => {
                            let b2 = b.clone();
                            (
                                format!("fs rm {b}"),
                                Some(Box::new(move |m| {
                                    m.remove(&b2);
                                })),
                            )
                        }
                    };
                    let out = gpunvme(&d, &format!("--device disk.img {cmd}"));
                    if out.status.success() {
                        done += 1;
                        if let Some(f) = new_state {
                            f(&mut model);
                        } else {
                            assert!(
                                std::fs::read(&dst).unwrap() == model[&a],
                                "worker {w}: {a} read back different bytes"
                            );
                        }
                        step = match step {
                            3 if round % 3 == 0 => 4,
                            3 | 4 => {
                                round += 1;
                                0
                            }
                            s => s + 1,
                        };
                    } else {
                        assert!(
                            is_lock_error(&out),
                            "worker {w}: `{cmd}` failed otherwise: {}",
                            String::from_utf8_lossy(&out.stderr)
                        );
                        refused += 1;
                    }
                }
                (model, done, refused)
            })
        })
        .collect();
    let mut expected = BTreeMap::new();
    let (mut done, mut refused) = (0, 0);
    for w in workers {
        let (model, n, r) = w.join().unwrap();
        expected.extend(model);
        done += n;
        refused += r;
    }
    eprintln!("{done} commands done, {refused} refused by the lock");
    assert!(done > 0);
    let fsck: serde_json::Value =
        serde_json::from_str(&ok(&gpunvme(&d, "--device disk.img fs fsck --json"))).unwrap();
    assert_eq!(fsck["clean"], true, "{fsck}");
    let ls: serde_json::Value =
        serde_json::from_str(&ok(&gpunvme(&d, "--device disk.img fs ls --json"))).unwrap();
    let names: Vec<String> = ls
        .as_array()
        .unwrap()
        .iter()
        .map(|f| f["name"].as_str().unwrap().to_owned())
        .collect();
    assert_eq!(names, expected.keys().cloned().collect::<Vec<_>>());
    for (name, data) in &expected {
        ok(&gpunvme(
            &d,
            &format!("--device disk.img fs get {name} check.bin"),
        ));
        assert!(
            std::fs::read(d.join("check.bin")).unwrap() == *data,
            "{name} reads back different bytes"
        );
    }
}

#[test]
fn read_only_image_files_serve_read_only_commands() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, 32 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    ok(&fs("mkfs"));
    let data = pattern(300_000, 3);
    std::fs::write(d.join("in.bin"), &data).unwrap();
    ok(&fs("put in.bin f"));
    let before = std::fs::read(&img).unwrap();
    // Unwritable even for root where `chattr +i` works, else by mode for other users.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(&img, std::fs::Permissions::from_mode(0o444)).unwrap();
    struct Undo<'a>(&'a Path);
    impl Drop for Undo<'_> {
        fn drop(&mut self) {
            let _ = Command::new("chattr").arg("-i").arg(self.0).output();
        }
    }
    let _undo = Undo(&img);
    let writable = || std::fs::OpenOptions::new().write(true).open(&img).is_ok();
    if writable() {
        let _ = Command::new("chattr").arg("+i").arg(&img).output();
    }
    if writable() {
        eprintln!("skipped: cannot make a file unwritable here");
        return;
    }
    ok(&gpunvme(d, "--device disk.img identify"));
    ok(&gpunvme(
        d,
        "--device disk.img read --lba 0 --bytes 4k --output raw.bin",
    ));
    ok(&gpunvme(
        d,
        "--device disk.img perf --rw randread --ios 1000",
    ));
    assert!(ok(&fs("ls")).contains(" f\n"));
    ok(&fs("stat f"));
    ok(&fs("df"));
    ok(&fs("fsck"));
    ok(&fs("get f out.bin"));
    assert_eq!(std::fs::read(d.join("out.bin")).unwrap(), data);
    // Commands that change it fail in one line.
    for cmd in [
        "fs put in.bin g",
        "fs rm f",
        "write --lba 0 --input raw.bin",
    ] {
        let line = error_line(&gpunvme(d, &format!("--device disk.img {cmd}")));
        assert!(line.contains("disk.img"), "{cmd}: {line}");
    }
    assert!(std::fs::read(&img).unwrap() == before, "the image changed");
}

#[test]
fn mkfs_and_perf_refuse_to_destroy_a_file_system_without_force() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, 32 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    // A device with no blockfs needs no --force.
    ok(&fs("mkfs"));
    std::fs::write(d.join("a.bin"), pattern(10_000, 4)).unwrap();
    ok(&fs("put a.bin a"));
    ok(&fs("put a.bin b"));
    let before = std::fs::read(&img).unwrap();
    let line = error_line(&fs("mkfs"));
    assert!(
        line.contains("holds a blockfs with 2 files (20000 bytes); mkfs would destroy it"),
        "{line}"
    );
    for cmd in [
        "perf --rw randwrite --ios 100",
        "perf --rw write --ios 100",
        "perf --rw randread --ios 100 --verify",
    ] {
        let line = error_line(&gpunvme(d, &format!("--device disk.img {cmd}")));
        assert!(
            line.contains("holds a blockfs with 2 files") && line.contains("--force"),
            "{cmd}: {line}"
        );
    }
    assert!(
        std::fs::read(&img).unwrap() == before,
        "a refusal changed the image"
    );
    // Reading perf is harmless and runs.
    ok(&gpunvme(
        d,
        "--device disk.img perf --rw randread --ios 100",
    ));
    // A damaged one counts too.
    let mut damaged = before.clone();
    damaged[100] ^= 0xff;
    std::fs::write(&img, &damaged).unwrap();
    assert!(error_line(&fs("mkfs")).contains("holds a damaged blockfs"));
    // --force does it.
    ok(&gpunvme(
        d,
        "--device disk.img perf --rw randwrite --ios 100 --size 1m --force",
    ));
    ok(&fs("mkfs --force"));
    let ls: serde_json::Value = serde_json::from_str(&ok(&fs("ls --json"))).unwrap();
    assert_eq!(ls.as_array().unwrap().len(), 0);
}

#[test]
fn the_readme_sequence_loses_nothing() {
    // The README's `fs` examples on the default image, then its main job, also without
    // --device: perf has a scratch image of its own.
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let data = pattern(100_000, 5);
    std::fs::write(d.join("model.bin"), &data).unwrap();
    ok(&gpunvme(d, "fs mkfs"));
    ok(&gpunvme(d, "fs put model.bin models/m"));
    ok(&gpunvme(
        d,
        "perf --rw randread --bs 4k --qd 32 --ios 2000 --verify",
    ));
    ok(&gpunvme(d, "perf --rw randwrite --ios 2000"));
    assert!(d.join("gpunvme-perf.img").exists());
    ok(&gpunvme(d, "fs get models/m back.bin"));
    assert_eq!(std::fs::read(d.join("back.bin")).unwrap(), data);
    let fsck: serde_json::Value = serde_json::from_str(&ok(&gpunvme(d, "fs fsck --json"))).unwrap();
    assert_eq!(fsck["clean"], true);
}

#[test]
fn output_onto_the_image_itself_is_refused() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, 16 << 20);
    ok(&gpunvme(d, "--device disk.img fs mkfs"));
    std::fs::write(d.join("a.bin"), pattern(5000, 6)).unwrap();
    ok(&gpunvme(d, "--device disk.img fs put a.bin a"));
    std::fs::hard_link(&img, d.join("hard.img")).unwrap();
    std::os::unix::fs::symlink("disk.img", d.join("sym.img")).unwrap();
    let before = std::fs::read(&img).unwrap();
    for out in ["disk.img", "./disk.img", "hard.img", "sym.img"] {
        for cmd in [
            format!("--device disk.img fs get a {out}"),
            format!("--device disk.img read --lba 0 --bytes 4k --output {out}"),
            format!("--device sym.img fs get a {out}"),
        ] {
            let line = error_line(&gpunvme(d, &cmd));
            assert!(
                line.contains("is the device's own image file"),
                "{cmd}: {line}"
            );
        }
    }
    // The default image too.
    std::fs::rename(&img, d.join("gpunvme.img")).unwrap();
    let line = error_line(&gpunvme(d, "fs get a gpunvme.img"));
    assert!(line.contains("own image"), "{line}");
    assert!(
        std::fs::read(d.join("gpunvme.img")).unwrap() == before,
        "the image changed"
    );
}

#[test]
fn an_interrupted_get_leaves_the_destination_as_it_was() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 64 << 20);
    ok(&gpunvme(d, "--device disk.img fs mkfs"));
    let data = pattern(16 << 20, 7);
    std::fs::write(d.join("big.bin"), &data).unwrap();
    ok(&gpunvme(d, "--device disk.img fs put big.bin big"));
    std::fs::write(d.join("dst.bin"), b"the old contents").unwrap();
    // Small calls make the copy long; kill it once its temporary file exists.
    let mut get = bin()
        .current_dir(d)
        .args([
            "--device", "disk.img", "fs", "get", "big", "dst.bin", "--chunk", "4k",
        ])
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    let deadline = Instant::now() + Duration::from_secs(60);
    let temp = loop {
        let found = std::fs::read_dir(d)
            .unwrap()
            .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
            .find(|n| n.contains(".gpunvme-get-"));
        if let Some(t) = found {
            break t;
        }
        assert!(
            get.try_wait().unwrap().is_none(),
            "get ended before being caught"
        );
        assert!(Instant::now() < deadline, "no temporary file appeared");
        std::thread::sleep(Duration::from_millis(1));
    };
    get.kill().unwrap();
    get.wait().unwrap();
    assert!(temp.starts_with(".dst.bin."), "{temp}");
    assert_eq!(
        std::fs::read(d.join("dst.bin")).unwrap(),
        b"the old contents",
        "the destination was touched"
    );
    // A complete get replaces it, keeping its permissions, and leaves no temporary file.
    use std::os::unix::fs::PermissionsExt;
    std::fs::set_permissions(d.join("dst.bin"), std::fs::Permissions::from_mode(0o640)).unwrap();
    std::fs::remove_file(d.join(&temp)).unwrap();
    ok(&gpunvme(d, "--device disk.img fs get big dst.bin"));
    assert!(std::fs::read(d.join("dst.bin")).unwrap() == data);
    let mode = std::fs::metadata(d.join("dst.bin"))
        .unwrap()
        .permissions()
        .mode();
    assert_eq!(mode & 0o777, 0o640);
    assert!(
        !std::fs::read_dir(d).unwrap().any(|e| e
            .unwrap()
            .file_name()
            .to_string_lossy()
            .contains(".gpunvme-get-")),
        "a temporary file was left behind"
    );
}

#[test]
fn a_forced_put_that_fails_keeps_the_old_file() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 16 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    ok(&fs("mkfs"));
    let a = pattern(10 << 20, 8);
    std::fs::write(d.join("a.bin"), &a).unwrap();
    std::fs::write(d.join("r40.bin"), pattern(8 << 20, 9)).unwrap();
    ok(&fs("put a.bin A"));
    // No room for the replacement beside the old version: an error, and A is still A.
    let line = error_line(&fs("put --force r40.bin A"));
    assert!(line.contains("no space"), "{line}");
    ok(&fs("get A back.bin"));
    assert!(
        std::fs::read(d.join("back.bin")).unwrap() == a,
        "A was lost"
    );
    let fsck: serde_json::Value = serde_json::from_str(&ok(&fs("fsck --json"))).unwrap();
    assert_eq!(fsck["clean"], true, "{fsck}");
    assert_eq!(fsck["files"], 1);
    // A replacement that fits replaces it, in one commit, leaving one file.
    std::fs::write(d.join("small.bin"), pattern(1000, 10)).unwrap();
    ok(&fs("put --force small.bin A"));
    ok(&fs("get A back.bin"));
    assert_eq!(
        std::fs::read(d.join("back.bin")).unwrap(),
        pattern(1000, 10)
    );
    let ls: serde_json::Value = serde_json::from_str(&ok(&fs("ls --json"))).unwrap();
    assert_eq!(ls.as_array().unwrap().len(), 1);
    // mv --force replaces too; plain mv refuses.
    std::fs::write(d.join("b.bin"), pattern(3000, 13)).unwrap();
    ok(&fs("put b.bin B"));
    assert!(error_line(&fs("mv B A")).contains("exists"));
    ok(&fs("mv --force B A"));
    ok(&fs("get A back.bin"));
    assert_eq!(
        std::fs::read(d.join("back.bin")).unwrap(),
        pattern(3000, 13)
    );
    let ls: serde_json::Value = serde_json::from_str(&ok(&fs("ls --json"))).unwrap();
    assert_eq!(ls.as_array().unwrap().len(), 1);
}

#[test]
fn an_interrupted_forced_put_keeps_the_old_file_or_the_new_one() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 64 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    ok(&fs("mkfs"));
    let old = pattern(8192, 11);
    let new = pattern(24 << 20, 12);
    std::fs::write(d.join("old.bin"), &old).unwrap();
    std::fs::write(d.join("new.bin"), &new).unwrap();
    ok(&fs("put old.bin big"));
    // SIGINT at several points of a slow forced put (small calls): whenever it lands, `big`
    // is the old file or the new one, never gone or mixed.
    let mut interrupted = 0;
    for delay_ms in [30, 100, 250, 500, 1000] {
        let mut put = bin()
            .current_dir(d)
            .args([
                "--device", "disk.img", "fs", "put", "--force", "--chunk", "4k", "new.bin", "big",
            ])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(delay_ms));
        let _ = Command::new("kill")
            .args(["-INT", &put.id().to_string()])
            .status();
        let status = put.wait().unwrap();
        if !status.success() {
            interrupted += 1;
        }
        ok(&fs("get big back.bin"));
        let back = std::fs::read(d.join("back.bin")).unwrap();
        assert!(
            back == old || back == new,
            "after SIGINT at {delay_ms} ms: {} bytes, neither version",
            back.len()
        );
        if back == new {
            ok(&fs("put --force old.bin big"));
        }
        let fsck: serde_json::Value = serde_json::from_str(&ok(&fs("fsck --json"))).unwrap();
        assert_eq!(fsck["clean"], true, "{fsck}");
        assert_eq!(fsck["files"], 1, "{fsck}");
    }
    eprintln!("{interrupted} of 5 puts interrupted");
}

/// Runs `gpunvme` in `dir` with `args` and standard output closed before it writes anything.
fn with_closed_stdout(dir: &Path, args: &[&str]) -> Output {
    let mut child = bin()
        .current_dir(dir)
        .args(args)
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    drop(child.stdout.take());
    child.wait_with_output().unwrap()
}

#[test]
fn a_closed_or_full_stdout_is_no_panic() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 64 << 20);
    ok(&gpunvme(d, "--device disk.img fs mkfs"));
    std::fs::write(d.join("big.bin"), pattern(8 << 20, 14)).unwrap();
    ok(&gpunvme(d, "--device disk.img fs put big.bin big"));
    let dev = ["--device", "disk.img"];
    // A reader that went away is a normal end: exit 0, nothing on stderr.
    for args in [
        &["fs", "ls"][..],
        &["fs", "get", "big", "-"],
        &["identify"],
        &["read", "--lba", "0", "--bytes", "1m", "--output", "-"],
        &["perf", "--rw", "randread", "--ios", "100"],
        &["fs", "put", "big.bin", "other"],
    ] {
        let out = with_closed_stdout(d, &[&dev[..], args].concat());
        assert!(
            out.status.success() && out.stderr.is_empty(),
            "{args:?}: {:?} {}",
            out.status,
            String::from_utf8_lossy(&out.stderr)
        );
    }
    // The put happened (and was committed) although nobody read its report.
    assert!(ok(&gpunvme(d, "--device disk.img fs ls")).contains(" other\n"));
    // A full disk is an error, in one line.
    for cmd in [
        "identify",
        "fs ls",
        "fs stat big",
        "perf --rw randread --ios 100",
    ] {
        let out = bin()
            .current_dir(d)
            .args(["--device", "disk.img"])
            .args(cmd.split_whitespace())
            .stdout(std::fs::File::create("/dev/full").unwrap())
            .output()
            .unwrap();
        assert_eq!(out.status.code(), Some(1), "{cmd}");
        let line = error_line(&out);
        assert!(line.contains("writing to standard output"), "{cmd}: {line}");
    }
}

#[test]
fn with_json_every_outcome_is_json() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 32 << 20);
    let json_err = |out: &Output| -> (String, String) {
        assert!(!out.status.success());
        let v: serde_json::Value = serde_json::from_slice(&out.stdout)
            .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
        let e = &v["error"];
        (
            e["kind"].as_str().unwrap().to_owned(),
            e["message"].as_str().unwrap().to_owned(),
        )
    };
    let (kind, msg) = json_err(&gpunvme(d, "--device disk.img --json fs ls"));
    assert_eq!(kind, "no_file_system");
    assert!(msg.contains("gpunvme fs mkfs"), "{msg}");
    ok(&gpunvme(d, "--device disk.img fs mkfs"));
    let (kind, msg) = json_err(&gpunvme(d, "--device disk.img --json fs get nope out.bin"));
    assert_eq!(
        (kind.as_str(), msg.as_str()),
        ("not_found", "no such file: nope")
    );
    let (kind, _) = json_err(&gpunvme(d, "--device disk.img --json fs mkfs"));
    assert_eq!(kind, "refused");
    let out = gpunvme(d, "--device disk.img --json fs frobnicate");
    assert_eq!(out.status.code(), Some(2));
    assert_eq!(json_err(&out).0, "usage");
    let reader = {
        std::fs::write(d.join("a.bin"), pattern(1 << 20, 15)).unwrap();
        ok(&gpunvme(d, "--device disk.img fs put a.bin a"));
        BlockedReader::start(d, "a")
    };
    let (kind, msg) = json_err(&gpunvme(d, "--device disk.img --json fs rm a"));
    assert_eq!(kind, "busy");
    assert!(msg.contains(&reader.pid().to_string()), "{msg}");
    // The text line is on stderr as well.
    assert!(error_line(&gpunvme(d, "--device disk.img --json fs rm a")).contains("in use"));
}

#[test]
fn names_with_control_characters_are_printed_escaped() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 32 << 20);
    ok(&gpunvme(d, "--device disk.img fs mkfs"));
    std::fs::write(d.join("a.bin"), b"abc").unwrap();
    let evil = "evil\nname\u{1b}[2J";
    let run = |args: &[&str]| {
        bin()
            .current_dir(d)
            .args(["--device", "disk.img", "fs"])
            .args(args)
            .output()
            .unwrap()
    };
    let put = ok(&run(&["put", "a.bin", evil]));
    assert!(put.contains("evil\\nname\\u{1b}[2J"), "{put}");
    let ls = ok(&run(&["ls"]));
    assert!(ls.contains(" evil\\nname\\u{1b}[2J\n"), "{ls}");
    assert!(!ls.contains('\u{1b}'));
    let stat = ok(&run(&["stat", evil]));
    assert!(
        stat.contains("name:       evil\\nname\\u{1b}[2J\n"),
        "{stat}"
    );
    // JSON carries the name exactly.
    let v: serde_json::Value = serde_json::from_str(&ok(&run(&["ls", "--json"]))).unwrap();
    assert_eq!(v[0]["name"], evil);
    // Errors stay one line.
    let line = error_line(&run(&["get", "no\nsuch", "out.bin"]));
    assert!(line.contains("no such file: no\\nsuch"), "{line}");
    ok(&run(&["rm", evil]));
}

#[test]
fn perf_reports_and_refusals() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 16 << 20);
    let perf = |args: &str| gpunvme(d, &format!("--device disk.img perf {args}"));
    // --ios 0 and --runtime 0s are refused alike, as invalid values, before anything runs.
    for (args, needle) in [
        ("--ios 0", "invalid value '0' for '--ios <IOS>'"),
        (
            "--runtime 0s",
            "invalid value '0s' for '--runtime <RUNTIME>'",
        ),
    ] {
        let out = perf(args);
        assert_eq!(out.status.code(), Some(2), "{args}");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.lines().next().unwrap().contains(needle),
            "{args}: {err}"
        );
    }
    let line = error_line(&perf("--qd 100000 --ios 10"));
    assert!(
        line.contains("--qd 100000 is out of range: 1 to "),
        "{line}"
    );
    // Human units and the runtime in text.
    let text = ok(&perf("--rw randread --ios 500"));
    assert!(text.contains("runtime "), "{text}");
    assert!(text.contains("s ") || text.contains("s\n"), "{text}");
    assert!(!text.contains("lat (ns)"), "{text}");
    // The clock covers every I/O: no I/O took longer than the run it belongs to.
    for _ in 0..5 {
        let v: serde_json::Value =
            serde_json::from_str(&ok(&perf("--rw randread --ios 64 --qd 32 --json"))).unwrap();
        let runtime = v["runtime_ns"].as_u64().unwrap();
        assert!(
            v["lat_ns"]["max"].as_u64().unwrap() <= runtime,
            "an I/O outlasted the run: {v}"
        );
        let iops = v["iops"].as_f64().unwrap();
        assert!((iops - 64e9 / runtime as f64).abs() <= iops * 1e-6, "{v}");
    }
}

#[test]
fn ctrl_c_during_perf_prints_the_partial_result() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 16 << 20);
    let child = bin()
        .current_dir(d)
        .args([
            "--device",
            "disk.img",
            "--json",
            "perf",
            "--rw",
            "randwrite",
            "--runtime",
            "60s",
        ])
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Once it holds the image (exclusively), its Ctrl-C handler is in place. Watched in the
    // kernel's lock table, not by trying the image: a probing `identify` holding its shared
    // lock at the moment perf starts would make perf refuse the image and exit.
    let deadline = Instant::now() + Duration::from_secs(30);
    let pid = child.id().to_string();
    if std::path::Path::new("/proc/locks").exists() {
        while !std::fs::read_to_string("/proc/locks")
            .unwrap_or_default()
            .lines()
            .any(|l| l.split_whitespace().nth(4) == Some(pid.as_str()))
        {
            assert!(Instant::now() < deadline, "perf never took the image");
            std::thread::sleep(Duration::from_millis(10));
        }
    } else {
        std::thread::sleep(Duration::from_secs(3));
    }
    let started = Instant::now();
    assert!(
        Command::new("kill")
            .args(["-INT", &child.id().to_string()])
            .status()
            .unwrap()
            .success()
    );
    let out = child.wait_with_output().unwrap();
    assert!(started.elapsed() < Duration::from_secs(50), "it ran on");
    assert_eq!(out.status.code(), Some(130));
    let v: serde_json::Value = serde_json::from_slice(&out.stdout)
        .unwrap_or_else(|e| panic!("{e}: {}", String::from_utf8_lossy(&out.stdout)));
    assert!(v["runtime_ns"].as_u64().unwrap() < 60_000_000_000, "{v}");
    assert_eq!(v["errors"], 0, "{v}");
    assert!(String::from_utf8_lossy(&out.stderr).contains("interrupted"));
}

#[test]
fn read_only_commands_create_no_default_image() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    for cmd in ["fs ls", "fs df", "identify"] {
        let line = error_line(&gpunvme(d, cmd));
        assert!(line.contains("does not exist"), "{cmd}: {line}");
        assert!(line.contains("gpunvme fs mkfs"), "{cmd}: {line}");
    }
    // perf's own image is made by a perf that writes, not by `fs mkfs` (which makes another).
    let line = error_line(&gpunvme(d, "perf --rw randread --ios 10"));
    assert!(line.contains("gpunvme-perf.img does not exist"), "{line}");
    assert!(!line.contains("fs mkfs"), "{line}");
    assert!(
        line.contains("`gpunvme perf --rw randwrite` or `--verify`"),
        "{line}"
    );
    assert!(
        line.contains("`gpunvme image create gpunvme-perf.img --size 1G`"),
        "{line}"
    );
    assert!(!d.join("gpunvme.img").exists());
    assert!(!d.join("gpunvme-perf.img").exists());
    // A device without a file system says how to make one.
    image(d, 8 << 20);
    let line = error_line(&gpunvme(d, "--device disk.img fs ls"));
    assert!(
        line.contains("holds no blockfs (make one with `gpunvme fs mkfs`)"),
        "{line}"
    );
}

#[test]
fn space_freed_on_a_full_file_system_is_usable_at_once() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 8 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    let df = || -> serde_json::Value { serde_json::from_str(&ok(&fs("df --json"))).unwrap() };
    ok(&fs("mkfs"));
    std::fs::write(d.join("small.bin"), pattern(3000, 16)).unwrap();
    ok(&fs("put small.bin keep"));
    // A file of exactly the bytes df says are available fits.
    let avail = df()["available_bytes"].as_u64().unwrap();
    let full = pattern(avail as usize, 17);
    std::fs::write(d.join("full.bin"), &full).unwrap();
    ok(&fs("put full.bin full"));
    assert_eq!(df()["available_bytes"], 0);
    // One byte more than available does not, and says so before writing anything.
    std::fs::write(d.join("one.bin"), [1u8]).unwrap();
    assert!(error_line(&fs("put one.bin one")).contains("no space"));
    // rm frees the space for the very next put (no second rm, no repair).
    ok(&fs("rm full"));
    let v = df();
    assert!(v["available_bytes"].as_u64().unwrap() >= avail, "{v}");
    assert!(v["pending_blocks"].as_u64().unwrap() < 8, "{v}");
    ok(&fs("put full.bin again"));
    ok(&fs("mv again full"));
    ok(&fs("get full back.bin"));
    assert!(std::fs::read(d.join("back.bin")).unwrap() == full);
    let fsck: serde_json::Value = serde_json::from_str(&ok(&fs("fsck --json"))).unwrap();
    assert_eq!(fsck["clean"], true, "{fsck}");
}

#[test]
fn repair_rebuilds_both_damaged_superblocks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, 32 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    ok(&fs("mkfs"));
    let files: Vec<(String, Vec<u8>)> = (0..3)
        .map(|i| (format!("f{i}"), pattern(10_000 + i * 777, 20 + i as u32)))
        .collect();
    for (name, data) in &files {
        std::fs::write(d.join("in.bin"), data).unwrap();
        ok(&fs(&format!("put in.bin {name}")));
    }
    // One byte in each slot's reserved area (bytes 104..252 of the superblock).
    let mut bytes = std::fs::read(&img).unwrap();
    bytes[150] ^= 1;
    bytes[4096 + 150] ^= 1;
    std::fs::write(&img, &bytes).unwrap();
    assert!(!fs("ls").status.success());
    let out = ok(&fs("fsck --repair"));
    assert!(out.contains("neither superblock slot was valid"), "{out}");
    for (name, data) in &files {
        ok(&fs(&format!("get {name} out.bin")));
        assert_eq!(&std::fs::read(d.join("out.bin")).unwrap(), data, "{name}");
    }
    assert!(ok(&fs("fsck")).contains("clean"));
}

#[test]
fn flipped_data_bytes_are_caught_by_get_and_fsck_data() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, 32 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    ok(&fs("mkfs"));
    let data = pattern(1_000_003, 30);
    std::fs::write(d.join("w.bin"), &data).unwrap();
    let put: serde_json::Value =
        serde_json::from_str(&ok(&fs("put w.bin weights --json"))).unwrap();
    assert_eq!(put["crc32c"], crc32c::crc32c(&data));
    let st: serde_json::Value = serde_json::from_str(&ok(&fs("stat weights --json"))).unwrap();
    assert_eq!(st["crc32c"], crc32c::crc32c(&data));
    let first_lba = st["extent_list"][0]["lba"].as_u64().unwrap();
    let out = ok(&fs("get weights ok.bin"));
    assert!(out.contains("verified"), "{out}");
    let pristine = std::fs::read(&img).unwrap();
    for (trial, at) in [0usize, 4095, 77_777, 500_000, 1_000_002]
        .into_iter()
        .enumerate()
    {
        let mut bytes = pristine.clone();
        bytes[first_lba as usize * 512 + at] ^= 1 << (trial % 8);
        std::fs::write(&img, &bytes).unwrap();
        let line = error_line(&fs("get weights bad.bin"));
        assert!(
            line.contains("do not match the CRC-32C"),
            "byte {at}: {line}"
        );
        assert!(!d.join("bad.bin").exists(), "a damaged copy took the name");
        let out = fs("get weights -");
        assert_eq!(out.status.code(), Some(1), "byte {at}");
        // Metadata is intact: plain fsck is clean; --data finds the file.
        ok(&fs("fsck"));
        let line = error_line(&fs("fsck --data"));
        assert!(line.contains("weights"), "byte {at}: {line}");
        // The report, then the error: a stream of two JSON values.
        let out = fs("fsck --data --json");
        let values: Vec<serde_json::Value> = serde_json::Deserializer::from_slice(&out.stdout)
            .into_iter()
            .collect::<Result<_, _>>()
            .unwrap();
        assert_eq!(values.len(), 2, "{values:?}");
        assert_eq!(values[0]["data"]["mismatched"][0], "weights");
        assert_eq!(values[1]["error"]["kind"], "corrupt");
    }
    std::fs::write(&img, &pristine).unwrap();
    let out = ok(&fs("fsck --data"));
    assert!(out.contains("1 file(s) match"), "{out}");
}

#[test]
fn small_files_share_metadata_chunks() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 64 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    ok(&fs("mkfs --block-size 1m"));
    std::fs::write(d.join("ten.bin"), b"0123456789").unwrap();
    for i in 0..30 {
        ok(&fs(&format!("put ten.bin f{i:02}")));
    }
    let df: serde_json::Value = serde_json::from_str(&ok(&fs("df --json"))).unwrap();
    assert_eq!(df["files"], 30);
    // The superblock area, one root block and one chunk block (was 32 MiB: a chunk a file).
    assert!(df["metadata_blocks"].as_u64().unwrap() <= 3, "{df}");
    assert!(ok(&fs("fsck")).contains("clean"));
}

/// Runs `f` with a tmpfs of `bytes` mounted on a fresh directory, when this process may mount
/// one (root); otherwise says so and returns false.
fn with_small_tmpfs(bytes: u64, f: impl FnOnce(&Path)) -> bool {
    let dir = tempfile::tempdir().unwrap();
    let mnt = dir.path().join("mnt");
    std::fs::create_dir(&mnt).unwrap();
    let mounted = std::process::Command::new("mount")
        .args(["-t", "tmpfs", "-o", &format!("size={bytes}"), "tmpfs"])
        .arg(&mnt)
        .output()
        .is_ok_and(|o| o.status.success());
    if !mounted {
        eprintln!("skipped: cannot mount a tmpfs here (needs root)");
        return false;
    }
    let r = std::panic::catch_unwind(std::panic::AssertUnwindSafe(|| f(&mnt)));
    let _ = std::process::Command::new("umount").arg(&mnt).status();
    if let Err(p) = r {
        std::panic::resume_unwind(p);
    }
    true
}

#[test]
fn a_full_host_file_system_is_no_space_not_a_write_fault() {
    with_small_tmpfs(8 << 20, |mnt| {
        // A 64 MiB sparse image on an 8 MiB file system: a 16 MiB put runs it out of space.
        std::fs::File::create(mnt.join("disk.img"))
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
        ok(&gpunvme(mnt, "--device disk.img fs mkfs"));
        std::fs::write(mnt.join("small"), vec![1u8; 4096]).unwrap();
        ok(&gpunvme(mnt, "--device disk.img fs put small small"));
        let big = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(big.path(), vec![7u8; 16 << 20]).unwrap();
        let out = gpunvme(
            mnt,
            &format!(
                "--json --device disk.img fs put {} big",
                big.path().display()
            ),
        );
        let line = error_line(&out);
        assert!(
            line.contains("no space left on the host file system holding disk.img (ENOSPC"),
            "{line}"
        );
        assert!(!line.starts_with("gpunvme: error: writing big"), "{line}");
        let text = String::from_utf8_lossy(&out.stdout);
        let v: serde_json::Value = serde_json::from_str(text.lines().last().unwrap()).unwrap();
        assert_eq!(v["error"]["kind"], "no_space", "{v}");
        // The same from standard input: no space, nothing stored.
        let out = bin()
            .current_dir(mnt)
            .args("--device disk.img fs put - streamed".split_whitespace())
            .stdin(std::fs::File::open(big.path()).unwrap())
            .output()
            .unwrap();
        let line = error_line(&out);
        assert!(
            line.contains("no space left on the host file system"),
            "{line}"
        );
        // Nothing stored, the file system intact.
        let ls = ok(&gpunvme(mnt, "--device disk.img --json fs ls"));
        assert!(!ls.contains("\"big\"") && !ls.contains("streamed"), "{ls}");
        ok(&gpunvme(mnt, "--device disk.img fs fsck"));
    });
}
