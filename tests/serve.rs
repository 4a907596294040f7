//! `gpunvme serve` with client processes: several verifying at once, clients killed with
//! SIGKILL at random points while others verify, and the daemon itself killed and restarted.
//! Every wait is bounded.

mod common;

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Output, Stdio};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::time::{Duration, Instant};

use common::{bin, error_line, gpunvme, ok};
use rand::{Rng, SeedableRng};

const LBA: usize = 512;

struct Daemon {
    child: Child,
    socket: PathBuf,
}

impl Daemon {
    /// `gpunvme serve` over `image` at `dir/serve.sock`, once it answers `status`.
    fn start(dir: &Path, image: &Path, extra: &[&str]) -> Self {
        let socket = dir.join("serve.sock");
        let child = bin()
            .current_dir(dir)
            .args(["--device", image.to_str().unwrap(), "serve", "--socket"])
            .arg(&socket)
            .args(extra)
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .expect("start gpunvme serve");
        let d = Self { child, socket };
        let t = Instant::now();
        loop {
            if d.socket.exists() && status_of(&d.socket).is_some() {
                return d;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the daemon never answered"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }

    fn status(&self) -> serde_json::Value {
        status_of(&self.socket).expect("status")
    }

    /// SIGTERM, then a bounded wait for a clean exit.
    fn stop(mut self) {
        let _ = Command::new("kill")
            .args(["-TERM", &self.child.id().to_string()])
            .status();
        let t = Instant::now();
        loop {
            if let Some(s) = self.child.try_wait().unwrap() {
                assert!(s.success(), "the daemon exited {s}");
                return;
            }
            assert!(
                t.elapsed() < Duration::from_secs(20),
                "the daemon did not stop"
            );
            std::thread::sleep(Duration::from_millis(20));
        }
    }
}

impl Drop for Daemon {
    fn drop(&mut self) {
        let _ = self.child.kill();
        let _ = self.child.wait();
    }
}

fn status_of(socket: &Path) -> Option<serde_json::Value> {
    let out = bin()
        .args(["serve", "--socket"])
        .arg(socket)
        .args(["status", "--json"])
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| serde_json::from_slice(&out.stdout).ok())
        .flatten()
}

fn check_cmd(socket: &Path, args: &str) -> Command {
    let mut c = bin();
    c.args(["serve", "--socket"])
        .arg(socket)
        .arg("check")
        .arg("--json")
        .args(args.split_whitespace());
    c
}

/// A `serve check` that must have passed: its report.
fn passed(out: &Output) -> serde_json::Value {
    let v: serde_json::Value = serde_json::from_str(&ok(out)).expect("check's JSON");
    assert_eq!(v["errors"], 0, "{v}");
    assert_eq!(v["mismatched_bytes"], 0, "{v}");
    v
}

fn image(dir: &Path, size: &str) -> PathBuf {
    let img = dir.join("serve.img");
    ok(&gpunvme(
        dir,
        &format!("image create {} --size {size}", img.display()),
    ));
    img
}

/// Waits (bounded) until the daemon holds nothing for any client but the one asking.
fn settled(d: &Daemon, reclaimed: u64) -> serde_json::Value {
    let t = Instant::now();
    loop {
        let s = d.status();
        let quiet = s["controllers"][0]["lent_queue_pairs"] == 0
            && s["clients"].as_array().is_some_and(|c| c.len() == 1)
            && s["reclaimed_clients"].as_u64().unwrap_or(0) >= reclaimed;
        if quiet {
            return s;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "never settled: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}

#[test]
fn four_client_processes_verify_their_ranges_at_once_and_the_bytes_are_on_the_image() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "64M");
    let d = Daemon::start(dir.path(), &img, &[]);
    let range = 16384u64;
    let kids: Vec<Child> = (0..4u64)
        .map(|i| {
            check_cmd(
                &d.socket,
                &format!(
                    "--first-lba {} --lbas {range} --queues 2 --qd 16 --seed {}",
                    i * range,
                    100 + i
                ),
            )
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap()
        })
        .collect();
    for k in kids {
        let r = passed(&k.wait_with_output().unwrap());
        // One pass: every block written once and read back once, 8 blocks per command.
        assert_eq!(r["ios"], 2 * range / 8, "{r}");
    }
    let s = settled(&d, 4);
    assert_eq!(s["late_controller_writes"], 0, "{s}");
    assert_eq!(s["quarantined_arenas"], 0, "{s}");
    // A throughput run reads only: exactly the reads asked for, nothing written.
    let r = passed(
        &check_cmd(&d.socket, "--read-only --ios 2000 --queues 2 --qd 32")
            .output()
            .unwrap(),
    );
    assert_eq!(r["ios"], 2000, "{r}");
    assert_eq!(r["read_only"], true, "{r}");
    d.stop();
    // The bytes each client wrote are on the image, where it wrote them.
    let bytes = std::fs::read(&img).unwrap();
    let mut want = vec![0u8; 8 * LBA];
    for i in 0..4u64 {
        for lba in [i * range, i * range + range / 2, (i + 1) * range - 8] {
            gpunvme_serve_client::check::stamp(&mut want, lba, LBA, 100 + i, 0);
            let at = lba as usize * LBA;
            assert!(
                bytes[at..at + want.len()] == want[..],
                "LBA {lba} of client {i}"
            );
        }
    }
}

#[test]
fn clients_killed_at_random_points_never_hurt_the_daemon_or_the_others() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "64M");
    // Completions held 20 ms: a killed client has commands truly outstanding.
    let d = Daemon::start(dir.path(), &img, &["--emu-completion-delay-ms", "20"]);
    let stop = Arc::new(AtomicBool::new(false));
    let honest_runs = Arc::new(AtomicU64::new(0));
    let honest: Vec<_> = (0..2u64)
        .map(|i| {
            let (socket, stop, runs) = (d.socket.clone(), stop.clone(), honest_runs.clone());
            std::thread::spawn(move || {
                let mut n = 0u64;
                while !stop.load(Ordering::Relaxed) {
                    let out = check_cmd(
                        &socket,
                        &format!(
                            "--first-lba {} --lbas 8192 --qd 8 --runtime 1s --seed {n}",
                            i * 8192
                        ),
                    )
                    .output()
                    .unwrap();
                    passed(&out);
                    n += 1;
                    runs.fetch_add(1, Ordering::Relaxed);
                }
                n
            })
        })
        .collect();
    let mut rng = rand::rngs::StdRng::seed_from_u64(56);
    let iterations = 100;
    for _ in 0..iterations {
        let mut victim = check_cmd(
            &d.socket,
            "--first-lba 65536 --lbas 32768 --queues 2 --qd 16 --runtime 30s",
        )
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
        // Anywhere from before its connect to the middle of its I/O; every other one within
        // the first 10 ms, where it connects, gets its arena and queues and sends Identify.
        let most = if rng.random_bool(0.5) { 10_000 } else { 60_000 };
        std::thread::sleep(Duration::from_micros(rng.random_range(0..most)));
        victim.kill().unwrap();
        victim.wait().unwrap();
    }
    stop.store(true, Ordering::Relaxed);
    let runs: u64 = honest.into_iter().map(|h| h.join().unwrap()).sum();
    assert!(runs >= 2, "the honest clients ran {runs} times");
    let s = settled(&d, runs);
    assert_eq!(s["late_controller_writes"], 0, "{s}");
    assert_eq!(s["late_controller_reads"], 0, "{s}");
    assert_eq!(s["quarantined_arenas"], 0, "{s}");
    assert!(s["controllers"][0]["degraded"].is_null(), "{s}");
    // The kills landed at different points: many with queues and commands outstanding
    // (honest clients give theirs back before they go, so these are victims).
    let with_queues = s["reclaimed_holding_queues"].as_u64().unwrap();
    eprintln!(
        "reclaims: {} in all, {} holding arenas, {with_queues} holding queues",
        s["reclaimed_clients"], s["reclaimed_holding_arenas"]
    );
    assert!(
        with_queues >= 30,
        "only {with_queues} kills came with queues held: {s}"
    );
    // The daemon still serves: a fresh client verifies.
    passed(&check_cmd(&d.socket, "--lbas 4096").output().unwrap());
    d.stop();
}

#[test]
fn a_killed_daemon_ends_its_clients_calls_quickly_and_a_restarted_one_serves() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "64M");
    let mut d = Daemon::start(dir.path(), &img, &["--emu-completion-delay-ms", "5"]);
    let client = check_cmd(&d.socket, "--lbas 32768 --qd 16 --runtime 60s")
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    std::thread::sleep(Duration::from_millis(800));
    d.child.kill().unwrap();
    d.child.wait().unwrap();
    let t = Instant::now();
    let out = client.wait_with_output().unwrap();
    let took = t.elapsed();
    assert!(!out.status.success(), "the client's run cannot succeed");
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("closed") || err.contains("revoked"),
        "the error names the daemon's end: {err}"
    );
    // Seen on the socket, not at the 10 s bound.
    assert!(
        took < Duration::from_secs(5),
        "the client took {took:?} to notice"
    );
    // The stale socket is replaced; the image's lock died with the daemon.
    let d = Daemon::start(dir.path(), &img, &[]);
    passed(&check_cmd(&d.socket, "--lbas 4096").output().unwrap());
    d.stop();
}

#[test]
fn a_check_refuses_to_write_over_a_blockfs_unless_forced() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "64M");
    ok(&gpunvme(
        dir.path(),
        &format!("--device {} fs mkfs", img.display()),
    ));
    let d = Daemon::start(dir.path(), &img, &[]);
    let out = check_cmd(&d.socket, "--lbas 4096").output().unwrap();
    let err = common::error_line(&out);
    assert!(err.contains("namespace 1 holds a blockfs"), "{err}");
    assert!(err.contains("--force"), "{err}");
    // The probe's queue and arena are given back.
    let s = d.status();
    assert_eq!(
        s["controllers"][0]["lent_queue_pairs"], 0,
        "the probe's queue given back: {s}"
    );
    // Reading only needs no --force; --force writes.
    passed(
        &check_cmd(&d.socket, "--read-only --ios 100")
            .output()
            .unwrap(),
    );
    passed(
        &check_cmd(&d.socket, "--lbas 4096 --force")
            .output()
            .unwrap(),
    );
    d.stop();
    let out = gpunvme(dir.path(), &format!("--device {} fs fsck", img.display()));
    assert!(
        !out.status.success(),
        "the forced check overwrote the file system"
    );
}

/// Files on a served device (`--device served:SOCKET`): several client processes list and read
/// the files of the blockfs the daemon's image holds, byte for byte and at once, through queue
/// pairs lent to each; `put`, `mv` and `rm` go through the daemon's write leases; mkfs and
/// repairs are refused as the operator's and change nothing; a controller the daemon does not
/// serve and a socket nobody listens on are named.
#[test]
fn served_devices_read_and_write_files_for_several_processes() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "256M");
    let imgs = img.to_str().unwrap();
    ok(&gpunvme(dir.path(), &format!("--device {imgs} fs mkfs")));
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x51e5);
    let mut files = Vec::new();
    for (i, len) in [1usize, 4095, 4096, 1 << 20, 3_000_001]
        .into_iter()
        .enumerate()
    {
        let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let src = dir.path().join(format!("src{i}"));
        std::fs::write(&src, &data).unwrap();
        ok(&gpunvme(
            dir.path(),
            &format!("--device {imgs} fs put {} f{i}", src.display()),
        ));
        files.push(data);
    }
    let d = Daemon::start(dir.path(), &img, &[]);
    let dev = format!("served:{}", d.socket.display());
    let listing = ok(&gpunvme(
        dir.path(),
        &format!("--json --device {dev} fs ls"),
    ));
    let v: serde_json::Value = serde_json::from_str(&listing).unwrap();
    assert_eq!(v.as_array().map(Vec::len), Some(files.len()), "{v}");
    // Four processes read every file at once.
    let readers: Vec<_> = (0..4)
        .map(|p| {
            let dir = dir.path().to_path_buf();
            let dev = dev.clone();
            let n = files.len();
            std::thread::spawn(move || {
                for i in 0..n {
                    let dst = dir.join(format!("out{p}-{i}"));
                    ok(&gpunvme(
                        &dir,
                        &format!("--device {dev} fs get f{i} {}", dst.display()),
                    ));
                }
            })
        })
        .collect();
    for r in readers {
        r.join().unwrap();
    }
    for p in 0..4 {
        for (i, data) in files.iter().enumerate() {
            let got = std::fs::read(dir.path().join(format!("out{p}-{i}"))).unwrap();
            assert!(got == *data, "process {p}, file f{i}: bytes differ");
        }
    }
    let fsck = ok(&gpunvme(
        dir.path(),
        &format!("--json --device {dev} fs fsck"),
    ));
    assert!(
        fsck.contains("\"consistent\":true") || fsck.contains("\"consistent\": true"),
        "{fsck}"
    );
    // A put through a write lease, read back by another process, renamed and removed.
    let src = dir.path().join("src4");
    ok(&gpunvme(
        dir.path(),
        &format!("--device {dev} fs put {} g", src.display()),
    ));
    let back = dir.path().join("back-g");
    let got = ok(&gpunvme(
        dir.path(),
        &format!("--json --device {dev} fs get g {}", back.display()),
    ));
    assert!(got.contains("\"verified\":true"), "{got}");
    assert!(
        std::fs::read(&back).unwrap() == files[4],
        "g's bytes differ"
    );
    let out = gpunvme(
        dir.path(),
        &format!("--device {dev} fs put {} g", src.display()),
    );
    assert!(error_line(&out).contains("exists"), "{}", error_line(&out));
    ok(&gpunvme(dir.path(), &format!("--device {dev} fs mv g h")));
    ok(&gpunvme(dir.path(), &format!("--device {dev} fs rm h")));
    // A stream (standard input, no length up front): a lease grown chunk by chunk (64 KiB,
    // about 45 times), committed with the CRC-32C of the bytes read, read back verified.
    let mut put = bin()
        .current_dir(dir.path())
        .args([
            "--json", "--device", &dev, "fs", "put", "-", "s", "--chunk", "64k",
        ])
        .stdin(Stdio::piped())
        .stdout(Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let mut stdin = put.stdin.take().unwrap();
        for piece in files[4].chunks(10_007) {
            stdin.write_all(piece).unwrap();
        }
    }
    let out = put.wait_with_output().unwrap();
    assert!(out.status.success(), "fs put -");
    let report: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(report["bytes"], files[4].len() as u64, "{report}");
    let back = dir.path().join("back-s");
    let got = ok(&gpunvme(
        dir.path(),
        &format!("--json --device {dev} fs get s {}", back.display()),
    ));
    assert!(got.contains("\"verified\":true"), "{got}");
    assert!(
        std::fs::read(&back).unwrap() == files[4],
        "s's bytes differ"
    );
    // A stream whose writer is killed mid-way stores nothing.
    let mut put = bin()
        .current_dir(dir.path())
        .args(["--device", &dev, "fs", "put", "-", "t", "--chunk", "64k"])
        .stdin(Stdio::piped())
        .stdout(Stdio::null())
        .stderr(Stdio::null())
        .spawn()
        .unwrap();
    {
        use std::io::Write;
        let stdin = put.stdin.as_mut().unwrap();
        stdin.write_all(&files[3]).unwrap();
        stdin.flush().unwrap();
    }
    std::thread::sleep(Duration::from_millis(300));
    put.kill().unwrap();
    put.wait().unwrap();
    settled_files(&d, 0);
    ok(&gpunvme(dir.path(), &format!("--device {dev} fs rm s")));
    // What the operator alone does is refused and changes nothing.
    for cmd in ["fs mkfs --force", "fs fsck --repair"] {
        let out = gpunvme(dir.path(), &format!("--device {dev} {cmd}"));
        let line = error_line(&out);
        assert!(line.contains("operator"), "{cmd}: {line}");
    }
    let after: serde_json::Value = serde_json::from_str(&ok(&gpunvme(
        dir.path(),
        &format!("--json --device {dev} fs ls"),
    )))
    .unwrap();
    assert_eq!(
        after, v,
        "g and s came and went, t never came; the refusals changed nothing"
    );
    let out = gpunvme(dir.path(), &format!("--device {dev}#nvme7 fs ls"));
    assert!(error_line(&out).contains("no controller \"nvme7\""));
    let nobody = dir.path().join("nobody.sock");
    let out = gpunvme(
        dir.path(),
        &format!("--json --device served:{} fs ls", nobody.display()),
    );
    assert!(!out.status.success());
    let v: serde_json::Value = serde_json::from_slice(&out.stdout).unwrap();
    assert_eq!(v["error"]["kind"], "not_found", "{v}");
    let s = settled(&d, 0);
    assert_eq!(s["late_controller_writes"], 0, "{s}");
    d.stop();
    // The image's file system is as the owner left it.
    let out = ok(&gpunvme(
        dir.path(),
        &format!("--json --device {imgs} fs fsck --data"),
    ));
    assert!(out.contains("true"), "{out}");
}

/// Write leases through the library, several clients at once: a put is read back by another
/// handle (which mounts afresh once the generation moved), an existing name needs force, one
/// writer per name (the second refused as busy, naming the holder's pid), a lease dropped or
/// its client gone stores nothing, and two clients putting 300 files each at once leave every
/// file readable and the file system consistent.
#[test]
fn served_write_leases_give_one_writer_per_name_and_nothing_of_a_dead_one() {
    use gpunvme::ErrorKind;
    use gpunvme::handle::DeviceHandle;
    use gpunvme::open::OpenOptions;
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), "256M");
    let imgs = img.to_str().unwrap();
    ok(&gpunvme(dir.path(), &format!("--device {imgs} fs mkfs")));
    let d = Daemon::start(dir.path(), &img, &[]);
    let dev = format!("served:{}", d.socket.display());
    let open = || DeviceHandle::open(Some(&dev), OpenOptions::default(), 1).unwrap();
    let (h1, h2) = (open(), open());
    let mut rng = rand::rngs::StdRng::seed_from_u64(0x1ea5e);
    let mut src = |name: &str, len: usize| {
        let data: Vec<u8> = (0..len).map(|_| rng.random()).collect();
        let p = dir.path().join(name);
        std::fs::write(&p, &data).unwrap();
        (p, data)
    };
    assert!(h2.ls("").unwrap().0.is_empty());
    let (a, a_data) = src("a", 3_000_001);
    let r = h1.put(&a, "w", false).unwrap();
    assert!(r.crc32c.is_some(), "{r:?}");
    assert!(
        h2.read("w", 0, None).unwrap() == a_data,
        "h2 reads h1's put"
    );
    let (b, b_data) = src("b", 70_000);
    let e = h1.put(&b, "w", false).unwrap_err();
    assert_eq!(e.kind(), ErrorKind::Exists, "{e}");
    h1.put(&b, "w", true).unwrap();
    assert!(h2.read("w", 0, None).unwrap() == b_data, "the replacement");
    // One writer per name: a lease held by another connection refuses h2, naming it.
    let spec = gpunvme::served::ServedSpec::parse(&dev).unwrap();
    let holder = gpunvme::served::ServedController::open(&spec, "the holder").unwrap();
    let lease = holder.fs_create(1, "x", 8192, false).unwrap();
    assert!(lease.table().files()[0].alloc_bytes >= 8192);
    for e in [h2.put(&b, "x", true).unwrap_err(), h2.rm("x").unwrap_err()] {
        assert_eq!(e.kind(), ErrorKind::Busy, "{e}");
        let text = format!("{e:#}");
        assert!(
            text.contains("the holder") && text.contains(&std::process::id().to_string()),
            "{text}"
        );
    }
    drop(lease);
    let names = |h: &DeviceHandle| -> Vec<String> {
        h.ls("").unwrap().0.into_iter().map(|f| f.name).collect()
    };
    assert_eq!(names(&h2), ["w"], "an aborted lease stores nothing");
    drop(holder);
    // A client gone mid-lease: its lease ends with its connection, after its queues.
    let raw =
        gpunvme_serve_client::Connection::connect(&d.socket, "leaver", Duration::from_secs(10))
            .unwrap();
    let (_lease, table) = raw.fs_create("nvme0", 1, "y", 1 << 20, false).unwrap();
    assert!(!table.is_empty());
    drop(raw);
    let t = Instant::now();
    loop {
        let s = d.status();
        if s["file_systems"][0]["write_leases"]
            .as_array()
            .is_some_and(Vec::is_empty)
        {
            break;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "lease kept: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
    assert_eq!(names(&h2), ["w"], "a dead client's lease stores nothing");
    h2.put(&a, "y", false).unwrap();
    // `fs put` processes killed at random points: the file is there whole or not at all.
    let (big, big_data) = src("big", 24 << 20);
    for k in 0..4u64 {
        let name = format!("k{k}");
        let mut child = bin()
            .current_dir(dir.path())
            .args(["--device", &dev, "fs", "put", big.to_str().unwrap(), &name])
            .stdout(Stdio::null())
            .stderr(Stdio::null())
            .spawn()
            .unwrap();
        std::thread::sleep(Duration::from_millis(30 + 60 * k));
        let _ = child.kill();
        let _ = child.wait();
        settled_files(&d, 2);
        let there = names(&h2);
        assert!(!there.iter().any(|n| n.starts_with('.')), "{there:?}");
        if there.contains(&name) {
            assert!(
                h2.read(&name, 0, None).unwrap() == big_data,
                "{name} is whole"
            );
            h2.rm(&name).unwrap();
        }
    }
    // Two clients, 300 files each, at once.
    let mut sets = Vec::new();
    for c in 0..2 {
        let files: Vec<(PathBuf, Vec<u8>)> = (0..300)
            .map(|i| {
                let len = 1 + (i * 7919 + c * 104_729) % 40_000;
                src(&format!("s{c}-{i}"), len)
            })
            .collect();
        sets.push(files);
    }
    let writers: Vec<_> = sets
        .iter()
        .cloned()
        .enumerate()
        .map(|(c, files)| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let h = DeviceHandle::open(Some(&dev), OpenOptions::default(), 1).unwrap();
                for (i, (p, _)) in files.iter().enumerate() {
                    h.put(p, &format!("c{c}/f{i}"), false).unwrap();
                }
            })
        })
        .collect();
    for w in writers {
        w.join().unwrap();
    }
    assert_eq!(h1.ls("").unwrap().0.len(), 602, "w, y and 600");
    for (c, files) in sets.iter().enumerate() {
        for (i, (_, data)) in files.iter().enumerate().step_by(7) {
            let got = h2.read(&format!("c{c}/f{i}"), 0, None).unwrap();
            assert!(got == *data, "c{c}/f{i}: bytes differ");
        }
    }
    drop((h1, h2));
    let s = settled_files(&d, 0);
    assert_eq!(s["late_controller_writes"], 0, "{s}");
    d.stop();
    let out = ok(&gpunvme(
        dir.path(),
        &format!("--json --device {imgs} fs fsck --data"),
    ));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["consistent"], true, "{v}");
}

/// Waits (bounded) until `others` clients and the one asking are connected and no lease is
/// held.
fn settled_files(d: &Daemon, others: usize) -> serde_json::Value {
    let t = Instant::now();
    loop {
        let s = d.status();
        let quiet = s["clients"]
            .as_array()
            .is_some_and(|c| c.len() == others + 1)
            && s["file_systems"][0]["write_leases"]
                .as_array()
                .is_some_and(Vec::is_empty);
        if quiet {
            return s;
        }
        assert!(t.elapsed() < Duration::from_secs(20), "never settled: {s}");
        std::thread::sleep(Duration::from_millis(20));
    }
}
