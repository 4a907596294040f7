//! The `gpunvme` binary end to end on the software controller: identify, raw I/O across
//! restarts, perf with verification, the refusals that must leave an image untouched, and the
//! `fs` commands.

use std::path::{Path, PathBuf};
use std::process::Output;

mod common;
use common::{gpunvme, ok};

/// A failed command: non-zero exit and a one-line error on stderr containing `needle`.
fn fails_with(out: &Output, needle: &str) {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        !out.status.success(),
        "expected failure, got success: {err}"
    );
    let lines: Vec<_> = err.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "error must be one line: {err:?}");
    assert!(lines[0].contains(needle), "{:?} lacks {needle:?}", lines[0]);
}

/// `n` sparse 64 MiB images `{prefix}0.img`, `{prefix}1.img`, ... in `dir`.
fn images(dir: &Path, prefix: &str, n: usize) {
    for i in 0..n {
        std::fs::File::create(dir.join(format!("{prefix}{i}.img")))
            .unwrap()
            .set_len(64 << 20)
            .unwrap();
    }
}

fn image(dir: &Path, bytes: u64) -> PathBuf {
    let p = dir.join("disk.img");
    std::fs::File::create(&p).unwrap().set_len(bytes).unwrap();
    p
}

#[test]
fn identify_json_on_the_default_image() {
    let dir = tempfile::tempdir().unwrap();
    // A command that only reads does not create the default image...
    let out = gpunvme(dir.path(), "identify --json");
    assert!(!out.status.success());
    assert!(!dir.path().join("gpunvme.img").exists());
    // ...one that writes does.
    ok(&gpunvme(dir.path(), "fs mkfs"));
    let out = ok(&gpunvme(dir.path(), "identify --json"));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    for key in [
        "vid",
        "ssvid",
        "sn",
        "mn",
        "fr",
        "mdts_bytes",
        "max_io_queue_pairs",
    ] {
        assert!(v.get(key).is_some(), "missing {key} in {v}");
    }
    let ns = &v["namespaces"][0];
    assert_eq!(ns["nsid"], 1);
    assert_eq!(ns["lba_size"], 512);
    assert_eq!(ns["blocks"], (1u64 << 30) / 512);
    // Created by its first writer: 1 GiB, sparse.
    let meta = std::fs::metadata(dir.path().join("gpunvme.img")).unwrap();
    assert_eq!(meta.len(), 1 << 30);
}

#[test]
fn log_shows_the_error_log_and_smart() {
    let dir = tempfile::tempdir().unwrap();
    ok(&gpunvme(dir.path(), "fs mkfs"));
    let out = ok(&gpunvme(dir.path(), "log"));
    assert!(out.starts_with("error log: no errors ("), "{out}");
    let v: serde_json::Value =
        serde_json::from_str(&ok(&gpunvme(dir.path(), "log --json"))).unwrap();
    assert_eq!(v["entries"].as_array().map(|e| e.len()), Some(0), "{v}");
    assert!(v["capacity"].as_u64().unwrap() >= 1);
    let v: serde_json::Value =
        serde_json::from_str(&ok(&gpunvme(dir.path(), "log --smart --json"))).unwrap();
    // A fresh software controller each process: its counters start at zero.
    for key in [
        "host_read_commands",
        "host_write_commands",
        "media_errors",
        "error_log_entries",
    ] {
        assert_eq!(v[key], 0, "{key} in {v}");
    }
    assert!(v["temperature_c"].as_i64().is_some(), "{v}");
}

#[test]
fn data_survives_a_restart_and_4k_lbas() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), 64 << 20);
    let img = img.to_str().unwrap();
    let data: Vec<u8> = (0..300 * 1024u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    std::fs::write(dir.path().join("in.bin"), &data).unwrap();
    for lba_size in ["512", "4096"] {
        ok(&gpunvme(
            dir.path(),
            &format!("--device {img} --lba-size {lba_size} write --lba 3 --input in.bin"),
        ));
        // A new process, a new controller: the bytes come from the image file.
        ok(&gpunvme(
            dir.path(),
            &format!(
                "--device {img} --lba-size {lba_size} read --lba 3 --bytes 300k --output out.bin"
            ),
        ));
        assert_eq!(std::fs::read(dir.path().join("out.bin")).unwrap(), data);
        let raw = std::fs::read(dir.path().join("disk.img")).unwrap();
        let off = 3 * lba_size.parse::<usize>().unwrap();
        assert_eq!(
            &raw[off..off + data.len()],
            &data[..],
            "bytes at the LBA's offset in the image"
        );
    }
}

#[test]
fn refusals_are_one_line_and_leave_the_image_unchanged() {
    let dir = tempfile::tempdir().unwrap();
    let img_path = image(dir.path(), 8 << 20);
    let img = img_path.to_str().unwrap();
    std::fs::write(dir.path().join("odd.bin"), vec![0xaa; 1000]).unwrap();
    std::fs::write(dir.path().join("eight.bin"), vec![0xbb; 4096]).unwrap();
    let before = std::fs::read(&img_path).unwrap();
    let d = dir.path();
    fails_with(
        &gpunvme(d, &format!("--device {img} write --lba 0 --input odd.bin")),
        "not a whole number",
    );
    fails_with(
        &gpunvme(
            d,
            &format!("--device {img} read --lba 0 --bytes 1000 --output o"),
        ),
        "not a whole number",
    );
    fails_with(
        &gpunvme(
            d,
            &format!("--device {img} write --lba 16380 --input eight.bin"),
        ),
        "beyond the end",
    );
    fails_with(
        &gpunvme(
            d,
            &format!("--device {img} write --lba 99999999 --input eight.bin"),
        ),
        "beyond the end",
    );
    fails_with(
        &gpunvme(
            d,
            &format!("--device {img} write --nsid 2 --lba 0 --input eight.bin"),
        ),
        "namespace 2",
    );
    assert_eq!(
        std::fs::read(&img_path).unwrap(),
        before,
        "image changed by a refused command"
    );

    std::fs::create_dir(d.join("adir")).unwrap();
    fails_with(&gpunvme(d, "--device adir identify"), "directory");
    fails_with(&gpunvme(d, "--device disk.img/x identify"), "disk.img/x");
    fails_with(
        &gpunvme(d, "--device missing.img identify"),
        "does not exist",
    );
    fails_with(
        &gpunvme(d, "--device 0000:zz:00.0 identify"),
        "0000:zz:00.0",
    );
    std::fs::write(d.join("small.img"), vec![0u8; 1000]).unwrap();
    fails_with(&gpunvme(d, "--device small.img identify"), "small.img");
    assert_eq!(std::fs::read(d.join("small.img")).unwrap(), vec![0u8; 1000]);
    fails_with(
        &gpunvme(
            d,
            &format!("--device {img} --controller-threads 99 identify"),
        ),
        "thread",
    );
    fails_with(
        &gpunvme(
            d,
            &format!("--device {img} --controller-queue-pairs 0 identify"),
        ),
        "--controller-queue-pairs",
    );
}

#[test]
fn controller_options_reach_the_software_controller() {
    let dir = tempfile::tempdir().unwrap();
    let img_path = image(dir.path(), 8 << 20);
    let img = img_path.to_str().unwrap();
    let out = ok(&gpunvme(
        dir.path(),
        &format!(
            "--device {img} --controller-threads 3 --controller-queue-pairs 12 identify --json"
        ),
    ));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["max_io_queue_pairs"], 12, "{out}");
    assert!(out.contains("3 controller threads"), "{out}");
}

#[test]
fn perf_verifies_every_mode_with_zero_errors() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), 16 << 20);
    let img = img.to_str().unwrap();
    for rw in ["read", "write", "randread", "randwrite"] {
        let out = ok(&gpunvme(
            dir.path(),
            &format!(
                "--device {img} perf --rw {rw} --bs 4k --qd 8 --queues 2 --ios 3000 --verify --json"
            ),
        ));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["ios"], 3000, "{rw}: {v}");
        assert_eq!(v["errors"], 0, "{rw}: {v}");
        assert!(
            v["verified_bytes"].as_u64().unwrap() > 0,
            "{rw}: nothing verified"
        );
        for key in ["iops", "bw_bytes"] {
            assert!(v[key].as_f64().unwrap() > 0.0, "{rw}: {key}");
        }
        for key in ["mean", "p50", "p99", "p999"] {
            assert!(
                v["lat_ns"][key].as_f64().unwrap() > 0.0,
                "{rw}: lat_ns.{key}"
            );
        }
    }
}

#[test]
fn perf_verify_catches_corruption_and_bs_above_mdts_works() {
    let dir = tempfile::tempdir().unwrap();
    let img = image(dir.path(), 16 << 20);
    let img = img.to_str().unwrap();
    // 512 KiB I/Os are four 128 KiB commands each on the default controller (MDTS 128 KiB).
    let out = ok(&gpunvme(
        dir.path(),
        &format!("--device {img} perf --rw randwrite --bs 512k --qd 4 --ios 64 --verify --json"),
    ));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["errors"], 0, "{v}");
}

/// `protocol-check`: the GPU queue protocol from CPU threads on the image's controller, at
/// both LBA sizes; JSON counts, coalesced doorbells, the pattern on the image itself, and
/// refusals of impossible settings.
#[test]
fn protocol_check_on_an_image() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, 16 << 20);
    let img = img.to_str().unwrap();
    for lba_size in [512u64, 4096] {
        let out = ok(&gpunvme(
            d,
            &format!(
                "--device {img} --lba-size {lba_size} protocol-check --queues 2 --depth 16 \
                 --threads 4 --ios 2000 --size 2m --seed 7 --json"
            ),
        ));
        let v: serde_json::Value = serde_json::from_str(&out).unwrap();
        assert_eq!(v["passed"], true, "{v}");
        assert_eq!(v["ios"], 2000, "{v}");
        assert_eq!(v["errors"], 0, "{v}");
        assert_eq!(v["mismatches"], 0, "{v}");
        assert_eq!(v["queues"], 2, "{v}");
        assert_eq!(v["depth"], 16, "{v}");
        assert_eq!(v["threads"], 4, "{v}");
        assert_eq!(v["lba_size"], lba_size, "{v}");
        assert_eq!(v["per_queue"].as_array().unwrap().len(), 2, "{v}");
        assert!(v["verified_bytes"].as_u64().unwrap() >= 1000 * lba_size);
        let (sq, cq) = (
            v["sq_doorbells"].as_u64().unwrap(),
            v["cq_doorbells"].as_u64().unwrap(),
        );
        assert!(sq > 0 && sq < 2000, "SQ doorbells not coalesced: {sq}");
        assert!(cq > 0 && cq <= 2000, "{cq}");
        // The image holds the pattern of seed 7 wherever the run wrote (zeros elsewhere), and
        // nothing past the 2 MiB it was given.
        let bytes = std::fs::read(img).unwrap();
        let mut stamped = 0;
        for (lba, block) in bytes.chunks_exact(lba_size as usize).enumerate() {
            if block.iter().all(|&b| b == 0) {
                continue;
            }
            assert!((lba as u64) < (2 << 20) / lba_size, "LBA {lba} written");
            assert_eq!(
                gpunvme::pattern::check(block, 7, 1, lba as u64, lba_size as usize),
                None,
                "LBA {lba}"
            );
            stamped += 1;
        }
        assert!(stamped > 0);
        std::fs::write(img, vec![0u8; 16 << 20]).unwrap();
    }
    // Text output.
    let out = ok(&gpunvme(
        d,
        &format!("--device {img} protocol-check --ios 200 --no-verify"),
    ));
    assert!(out.contains("doorbells: SQ"), "{out}");
    assert!(out.contains("verified nothing (--no-verify)"), "{out}");
    assert_eq!(out.lines().last(), Some("PASS"), "{out}");
    // Refusals: one line, non-zero exit.
    fails_with(
        &gpunvme(d, &format!("--device {img} protocol-check --depth 12")),
        "power of two",
    );
    fails_with(
        &gpunvme(d, &format!("--device {img} protocol-check --queues 99")),
        "grants",
    );
    fails_with(
        &gpunvme(
            d,
            &format!("--device {img} protocol-check --slot-buffer 1000"),
        ),
        "slot buffer",
    );
}

/// The last line of stderr that says `gpunvme: error:` (the others are reports such as the data
/// path).
fn error_line(out: &Output) -> String {
    assert!(!out.status.success(), "expected failure");
    let err = String::from_utf8_lossy(&out.stderr);
    let errors: Vec<_> = err
        .lines()
        .filter(|l| l.starts_with("gpunvme: error:"))
        .collect();
    assert_eq!(errors.len(), 1, "one error line expected: {err:?}");
    errors[0].to_string()
}

#[test]
fn fs_commands_end_to_end() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 64 << 20);
    let fs = |cmd: &str| gpunvme(d, &format!("--device disk.img fs {cmd}"));
    ok(&fs("mkfs"));
    // A size that is not a whole number of LBAs, with every byte distinct from its neighbours.
    let data: Vec<u8> = (0..5_000_123u32)
        .map(|i| (i.wrapping_mul(2_654_435_761) >> 24) as u8)
        .collect();
    std::fs::write(d.join("src.bin"), &data).unwrap();
    let put: serde_json::Value =
        serde_json::from_str(&ok(&fs("put src.bin models/a/w.bin --json"))).unwrap();
    assert_eq!(put["bytes"], data.len());

    let ls: serde_json::Value = serde_json::from_str(&ok(&fs("ls models/ --json"))).unwrap();
    assert_eq!(ls[0]["name"], "models/a/w.bin");
    assert_eq!(ls[0]["size"], data.len());
    let ls: serde_json::Value = serde_json::from_str(&ok(&fs("ls other/ --json"))).unwrap();
    assert_eq!(ls.as_array().unwrap().len(), 0);

    // Into a regular file (positioned writes from the device lanes), over a longer file that
    // must be cut to size, in one call and in small ones, and to standard output (in order).
    std::fs::write(d.join("dst.bin"), vec![0xAAu8; 9 << 20]).unwrap();
    ok(&fs("get models/a/w.bin dst.bin"));
    assert!(std::fs::read(d.join("dst.bin")).unwrap() == data);
    ok(&fs("get models/a/w.bin dst2.bin --chunk 64k"));
    assert!(std::fs::read(d.join("dst2.bin")).unwrap() == data);
    let out = fs("get models/a/w.bin -");
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(out.stdout == data, "standard output differs");

    let st: serde_json::Value =
        serde_json::from_str(&ok(&fs("stat models/a/w.bin --json"))).unwrap();
    assert_eq!(st["size"], data.len());
    assert_eq!(st["extents"], 1);

    ok(&fs("mv models/a/w.bin models/b/w.bin"));
    assert!(error_line(&fs("stat models/a/w.bin")).contains("no such file: models/a/w.bin"));
    ok(&fs("get models/b/w.bin dst.bin"));
    assert!(std::fs::read(d.join("dst.bin")).unwrap() == data);

    // Refusals: one error line, nothing changed.
    assert!(error_line(&fs("get nothing/here out.bin")).contains("no such file"));
    assert!(
        !d.join("out.bin").exists(),
        "a failed get created its destination"
    );
    assert!(error_line(&fs("put . dir-copy")).contains("not a regular file"));
    assert!(error_line(&fs("put src.bin models/b/w.bin")).contains("exists"));
    for cmd in [
        "put src.bin c --chunk 100",
        "get models/b/w.bin out.bin --chunk 100",
    ] {
        assert!(error_line(&fs(cmd)).contains("--chunk must be at least 4k"));
    }
    assert!(
        !d.join("out.bin").exists(),
        "a refused get created its destination"
    );
    let df: serde_json::Value = serde_json::from_str(&ok(&fs("df --json"))).unwrap();
    assert_eq!(df["files"], 1);

    ok(&fs("rm models/b/w.bin"));
    let ls: serde_json::Value = serde_json::from_str(&ok(&fs("ls --json"))).unwrap();
    assert_eq!(ls.as_array().unwrap().len(), 0);
    let fsck: serde_json::Value = serde_json::from_str(&ok(&fs("fsck --json"))).unwrap();
    assert_eq!(fsck["clean"], true);
    assert_eq!(fsck["files"], 0);
    let df: serde_json::Value = serde_json::from_str(&ok(&fs("df --json"))).unwrap();
    assert_eq!(
        df["free_blocks"], fsck["free_blocks"],
        "df and fsck disagree: {df} {fsck}"
    );
}

#[test]
fn perf_gpu_without_cuda_says_so_in_one_line() {
    if gpunvme::gpu_queues::cuda_present() {
        eprintln!("skipped: libcuda is present here (scripts/gpu-test.sh covers perf --gpu)");
        return;
    }
    let dir = tempfile::tempdir().unwrap();
    let img_path = image(dir.path(), 8 << 20);
    let img = img_path.to_str().unwrap();
    let out = gpunvme(
        dir.path(),
        &format!("--device {img} perf --gpu --rw randread --bs 4k --qd 32 --ios 100"),
    );
    fails_with(&out, "no GPU");
}

#[test]
fn ssd_model_is_checked_before_any_gpu_is_needed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, 64 << 20);
    let img = img.display();
    // A parameter of the GPU-resident controller model only.
    fails_with(
        &gpunvme(
            d,
            &format!("--device {img} perf --gpu --ssd-model read_us=80,drives=4"),
        ),
        "--controller gpu",
    );
    // Malformed values are refused by the parser, naming what is wrong.
    for (value, needle) in [
        ("bogus=1", "unknown key"),
        ("drives=65", "drives=65"),
        ("stripe=3000", "stripe=3000"),
        ("bw=7XB/s", "unknown unit"),
    ] {
        let out = gpunvme(
            d,
            &format!("--device {img} perf --gpu --controller gpu --ssd-model {value}"),
        );
        assert!(!out.status.success(), "{value} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains(needle), "{value}: {err}");
    }
    // `fs get/put --gpu` take the model too, and refuse it for the software controller.
    ok(&gpunvme(d, &format!("--device {img} fs mkfs")));
    std::fs::write(d.join("f.bin"), vec![7u8; 10_000]).unwrap();
    ok(&gpunvme(d, &format!("--device {img} fs put f.bin f")));
    for cmd in ["get --gpu f", "put --gpu --force f.bin f"] {
        fails_with(
            &gpunvme(
                d,
                &format!("--device {img} fs {cmd} --ssd-model read_us=80,drives=4"),
            ),
            "needs the GPU-resident controller (controller `gpu`)",
        );
    }
    // GPU options without --gpu are refused, not ignored.
    for opt in [
        "--ssd-model drives=4",
        "--controller gpu",
        "--gpu-queues 4",
        "--gpu-id 1",
    ] {
        let flag = opt.split(' ').next().unwrap();
        fails_with(
            &gpunvme(d, &format!("--device {img} fs get f out.bin {opt}")),
            &format!("{flag} is an option of --gpu"),
        );
    }
    assert!(!d.join("out.bin").exists());
}

/// `--gpu-id` takes an ordinal, a UUID, a PCI address (and for `perf`, `all`); anything else
/// is refused by the parser, saying what it takes, before any device or GPU is opened.
#[test]
fn gpu_id_is_parsed_before_any_gpu_is_needed() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let img = image(d, 64 << 20);
    let img = img.display();
    for (cmd, bad) in [
        ("perf --gpu --ios 10", "cuda:1"),
        ("perf --gpu --ios 10", "-1"),
        ("perf --gpu --ios 10", "GPU-xyz"),
        ("fs get --gpu f", "all"),
        ("fs put --gpu f.bin f", "3b:00.9"),
    ] {
        let out = gpunvme(d, &format!("--device {img} {cmd} --gpu-id={bad}"));
        assert_eq!(out.status.code(), Some(2), "{cmd} --gpu-id={bad} accepted");
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("expected an ordinal"), "{bad}: {err}");
    }
    // `perf --gpu-id` without --gpu: refused by the parser.
    let out = gpunvme(d, &format!("--device {img} perf --gpu-id 1 --ios 10"));
    assert!(!out.status.success());
    assert!(String::from_utf8_lossy(&out.stderr).contains("--gpu"));
    if !gpunvme::gpu_queues::cuda_present() {
        // Good names get as far as the GPU, which is not here.
        for id in ["1", "all", "GPU-8f3e0b2c", "0000:3b:00.0"] {
            let out = gpunvme(
                d,
                &format!("--device {img} perf --gpu --gpu-id {id} --ios 10"),
            );
            fails_with(&out, "no GPU");
        }
    }
}

/// `fs` over several `--device`: a striped volume made by mkfs, files through it, and every
/// wrong member set refused by name with nothing changed.
#[test]
fn fs_on_a_volume_of_three_images() {
    let dir = tempfile::tempdir().unwrap();
    images(dir.path(), "m", 3);
    let data: Vec<u8> = (0..2_500_000u32).map(|i| (i * 31 / 7) as u8).collect();
    std::fs::write(dir.path().join("src.bin"), &data).unwrap();
    let all = "--device m0.img,m1.img,m2.img";
    ok(&gpunvme(dir.path(), &format!("{all} fs mkfs --stripe 64k")));
    ok(&gpunvme(
        dir.path(),
        "--device m0.img --device m1.img --device m2.img fs put src.bin d/a",
    ));
    ok(&gpunvme(dir.path(), &format!("{all} fs get d/a out.bin")));
    assert_eq!(std::fs::read(dir.path().join("out.bin")).unwrap(), data);
    // The data really is striped: 64 KiB units, member 1 holds the file's second unit.
    let m1 = std::fs::read(dir.path().join("m1.img")).unwrap();
    let unit = 64 << 10;
    assert!(
        m1.windows(64).any(|w| w == &data[unit..unit + 64]),
        "member 1 holds no piece of the file's second stripe unit"
    );
    fails_with(
        &gpunvme(dir.path(), "--device m0.img,m2.img,m1.img fs ls"),
        "device 1 is member 2",
    );
    fails_with(
        &gpunvme(dir.path(), "--device m0.img,m1.img fs ls"),
        "member(s) [2] of the 3-member volume are missing",
    );
    fails_with(
        &gpunvme(dir.path(), "--device m0.img,m1.img,m1.img fs ls"),
        "m1.img",
    );
    fails_with(
        &gpunvme(dir.path(), "--device m1.img fs ls"),
        "member 1 of a 3-member striped volume",
    );
    fails_with(
        &gpunvme(dir.path(), "--device m0.img fs mkfs"),
        "member 0 of a 3-member striped volume",
    );
    fails_with(
        &gpunvme(dir.path(), &format!("{all} fs mkfs")),
        "already make a striped volume, holding a blockfs",
    );
    fails_with(
        &gpunvme(
            dir.path(),
            &format!("{all} read --lba 0 --bytes 4096 --output x.bin"),
        ),
        "only `identify`, `perf` and `perf --gpu` (each controller at once) and `fs`",
    );
    let id = ok(&gpunvme(dir.path(), &format!("{all} --json identify")));
    let v: serde_json::Value = serde_json::from_str(&id).unwrap();
    assert_eq!(v["controllers"].as_array().map(Vec::len), Some(3), "{id}");
    assert_eq!(v["total_controllers"], 3);
    assert_eq!(v["total_bytes"], 3 * (64u64 << 20), "{id}");
    for (i, c) in v["controllers"].as_array().unwrap().iter().enumerate() {
        let dev = c["device"].as_str().unwrap();
        assert!(dev.contains(&format!("m{i}.img")), "controller {i}: {dev}");
    }
    let ls = ok(&gpunvme(dir.path(), &format!("{all} --json fs ls")));
    assert!(ls.contains("\"d/a\""), "{ls}");
    ok(&gpunvme(dir.path(), &format!("{all} fs fsck --data")));
}

/// `perf` over several controllers: the same verified job on each at once, a report per
/// controller and totals that add up; the GPU-resident model over several refused; a member
/// holding a file system protected by name.
#[test]
fn perf_runs_on_every_controller_at_once() {
    let dir = tempfile::tempdir().unwrap();
    images(dir.path(), "p", 3);
    let all = "--device p0.img,p1.img,p2.img";
    let out = ok(&gpunvme(
        dir.path(),
        &format!("{all} --json perf --rw randwrite --bs 4k --qd 4 --ios 600 --verify --size 8m"),
    ));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    let ctrls = v["controllers"].as_array().unwrap();
    let names: Vec<&str> = ctrls
        .iter()
        .map(|c| c["device"].as_str().unwrap())
        .collect();
    assert_eq!(names, ["p0.img", "p1.img", "p2.img"]);
    for c in ctrls {
        assert_eq!(c["ios"], 600);
        assert_eq!(c["errors"], 0);
        assert!(c["verified_bytes"].as_u64().unwrap() > 0);
    }
    assert_eq!(v["total"]["controllers"], 3);
    assert_eq!(v["total"]["ios"], 1800);
    let sum: f64 = ctrls.iter().map(|c| c["iops"].as_f64().unwrap()).sum();
    assert!((v["total"]["iops"].as_f64().unwrap() - sum).abs() < 1e-6 * sum);
    // Every image holds the written pattern now (nothing went to a wrong device).
    for i in 0..3 {
        let img = std::fs::read(dir.path().join(format!("p{i}.img"))).unwrap();
        assert!(
            img[..8 << 20].iter().any(|&b| b != 0),
            "p{i}.img was written"
        );
    }
    // --gpu runs on each controller too, and the GPU-resident model as one model per
    // controller (tests/gpu/ and scripts/gpu-scale-bench.sh, on a GPU); without one, both
    // say so.
    if !gpunvme::gpu_queues::cuda_present() {
        for ctl in ["emu", "gpu"] {
            fails_with(
                &gpunvme(
                    dir.path(),
                    &format!("{all} perf --gpu --controller {ctl} --ios 10"),
                ),
                "no GPU",
            );
        }
    }
    fails_with(
        &gpunvme(
            dir.path(),
            &format!("{all} perf --gpu --controller gpu --media host --ios 10"),
        ),
        "--media host over several devices is not available",
    );
    ok(&gpunvme(dir.path(), "--device p1.img fs mkfs"));
    fails_with(
        &gpunvme(dir.path(), &format!("{all} perf --rw write --ios 10")),
        "p1.img: namespace 1 holds",
    );
}

/// The error object `--json` printed on standard output.
fn json_error(out: &Output) -> serde_json::Value {
    let text = String::from_utf8_lossy(&out.stdout);
    let line = text.lines().last().unwrap_or_default();
    serde_json::from_str(line).unwrap_or_else(|e| panic!("{e}: {text:?}"))
}

#[test]
fn image_create_makes_a_sparse_image_of_the_size_asked() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = ok(&gpunvme(d, "image create disk.img --size 4G"));
    assert!(
        out.starts_with("created disk.img: 4.00 GiB (4294967296 bytes), sparse"),
        "{out}"
    );
    assert!(out.contains("8388608 LBAs of 512 bytes"), "{out}");
    let meta = std::fs::metadata(d.join("disk.img")).unwrap();
    assert_eq!(meta.len(), 4 << 30);
    use std::os::unix::fs::MetadataExt;
    assert!(meta.blocks() * 512 < 1 << 20, "not sparse: {meta:?}");
    // It serves the fs commands as it is.
    ok(&gpunvme(d, "--device disk.img fs mkfs"));
    std::fs::write(d.join("a.bin"), b"hello").unwrap();
    ok(&gpunvme(d, "--device disk.img fs put a.bin a"));
    // An existing file is refused without --force, and left as it is.
    let out = gpunvme(d, "image create disk.img --size 64M");
    fails_with(&out, "disk.img exists already");
    fails_with(&out, "add --force");
    assert_eq!(
        std::fs::metadata(d.join("disk.img")).unwrap().len(),
        4 << 30
    );
    let v = json_error(&gpunvme(d, "--json image create disk.img --size 64M"));
    assert_eq!(v["error"]["kind"], "exists", "{v}");
    ok(&gpunvme(d, "--device disk.img fs stat a"));
    // --force makes it afresh, here with 4 KiB LBAs; --json says what was made.
    let out = ok(&gpunvme(
        d,
        "--json --lba-size 4096 image create disk.img --size 64M --force",
    ));
    let v: serde_json::Value = serde_json::from_str(&out).unwrap();
    assert_eq!(v["path"], "disk.img");
    assert_eq!(v["bytes"], 64u64 << 20);
    assert_eq!(v["lba_size"], 4096);
    assert_eq!(v["blocks"], 16384);
    assert_eq!(v["replaced"], true);
    assert_eq!(
        std::fs::metadata(d.join("disk.img")).unwrap().len(),
        64 << 20
    );
    let line = error_line(&gpunvme(d, "--lba-size 4096 --device disk.img fs ls"));
    assert!(line.contains("holds no blockfs"), "{line}");
    // Sizes that are not whole LBAs, and a directory: refused, nothing made.
    fails_with(
        &gpunvme(d, "--lba-size 4096 image create odd.img --size 1000"),
        "not a whole number of 4096-byte LBAs",
    );
    assert!(!d.join("odd.img").exists());
    let out = gpunvme(d, "image create odd.img --size 4Q");
    assert_eq!(out.status.code(), Some(2));
    assert!(!d.join("odd.img").exists());
    std::fs::create_dir(d.join("adir")).unwrap();
    fails_with(
        &gpunvme(d, "image create adir --size 1M --force"),
        "is a directory",
    );
}

#[test]
fn a_missing_image_names_the_command_that_makes_it() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let out = gpunvme(d, "--json --device missing.img fs mkfs");
    let line = error_line(&out);
    assert!(
        line.contains(
            "image missing.img does not exist (create it with `gpunvme image create missing.img \
             --size 1G`"
        ),
        "{line}"
    );
    assert!(!line.contains("truncate"), "{line}");
    assert_eq!(json_error(&out)["error"]["kind"], "not_found");
    assert!(!d.join("missing.img").exists());
}

#[test]
fn a_rejected_write_creates_no_default_image() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    std::fs::write(d.join("odd.bin"), vec![7u8; 1000]).unwrap();
    fails_with(
        &gpunvme(d, "write --lba 0 --input odd.bin"),
        "length 1000 bytes is not a whole number of namespace 1's 512-byte LBAs",
    );
    fails_with(
        &gpunvme(d, "write --lba 0 --input nothing.bin"),
        "nothing.bin",
    );
    std::fs::write(d.join("empty.bin"), b"").unwrap();
    fails_with(&gpunvme(d, "write --lba 0 --input empty.bin"), "0 bytes");
    std::fs::write(d.join("ok.bin"), vec![7u8; 4096]).unwrap();
    fails_with(
        &gpunvme(d, "write --nsid 2 --lba 0 --input ok.bin"),
        "namespace 2",
    );
    assert!(
        !d.join("gpunvme.img").exists(),
        "a rejected write created the default image"
    );
    // A write that can work still creates it.
    ok(&gpunvme(d, "write --lba 0 --input ok.bin"));
    assert_eq!(
        std::fs::metadata(d.join("gpunvme.img")).unwrap().len(),
        1 << 30
    );
}

#[test]
fn the_same_image_twice_is_named_as_such() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 64 << 20);
    let line = error_line(&gpunvme(d, "--device disk.img,disk.img fs mkfs"));
    assert!(line.contains("already open in this process"), "{line}");
    assert!(!line.contains("in use by process"), "{line}");
}

#[test]
fn a_volume_opened_with_another_lba_size_says_so() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    images(d, "m", 2);
    ok(&gpunvme(d, "--device m0.img,m1.img fs mkfs"));
    let out = gpunvme(d, "--json --lba-size 4096 --device m0.img,m1.img fs ls");
    let line = error_line(&out);
    assert!(
        line.contains(
            "m0.img (member 0 of a 2-member striped volume) was made with 512-byte LBAs but is \
             open with 4096-byte LBAs"
        ),
        "{line}"
    );
    assert!(!line.contains("cannot hold"), "{line}");
    assert_eq!(json_error(&out)["error"]["kind"], "invalid_argument");
    ok(&gpunvme(d, "--device m0.img,m1.img fs ls"));
}

/// Runs `gpunvme` in `dir` with `stdin` as its standard input.
fn gpunvme_with_stdin(dir: &Path, cmdline: &str, stdin: std::process::Stdio) -> Output {
    common::bin()
        .current_dir(dir)
        .args(cmdline.split_whitespace())
        .stdin(stdin)
        .output()
        .expect("run gpunvme")
}

#[test]
fn fs_put_from_standard_input_streams_and_checksums() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    image(d, 256 << 20);
    ok(&gpunvme(d, "--device disk.img fs mkfs"));
    // Larger than the stream's buffer and not whole blocks, through a pipe.
    let data: Vec<u8> = (0..(40 << 20) + 12345u32)
        .map(|i| (i.wrapping_mul(2654435761) >> 13) as u8)
        .collect();
    let mut child = common::bin()
        .current_dir(d)
        .args("--json --device disk.img fs put - piped".split_whitespace())
        .stdin(std::process::Stdio::piped())
        .stdout(std::process::Stdio::piped())
        .stderr(std::process::Stdio::piped())
        .spawn()
        .unwrap();
    {
        use std::io::Write as _;
        let mut stdin = child.stdin.take().unwrap();
        stdin.write_all(&data).unwrap();
    }
    let out = child.wait_with_output().unwrap();
    let v: serde_json::Value = serde_json::from_str(&ok(&out)).unwrap();
    assert_eq!(v["bytes"], data.len() as u64, "{v}");
    assert_eq!(v["from"], "standard input");
    assert_eq!(v["crc32c"], u64::from(crc32c::crc32c(&data)), "{v}");
    ok(&gpunvme(d, "--device disk.img fs get piped back.bin"));
    assert_eq!(std::fs::read(d.join("back.bin")).unwrap(), data);
    let st: serde_json::Value =
        serde_json::from_str(&ok(&gpunvme(d, "--device disk.img --json fs stat piped"))).unwrap();
    assert_eq!(st["size"], data.len() as u64, "{st}");
    // An existing name is refused without --force; with it, replaced.
    let src = std::fs::File::open(d.join("back.bin")).unwrap();
    fails_with(
        &gpunvme_with_stdin(d, "--device disk.img fs put - piped", src.into()),
        "exists",
    );
    std::fs::write(d.join("small"), b"small").unwrap();
    let src = std::fs::File::open(d.join("small")).unwrap();
    ok(&gpunvme_with_stdin(
        d,
        "--device disk.img fs put --force - piped",
        src.into(),
    ));
    ok(&gpunvme(d, "--device disk.img fs get piped small.back"));
    assert_eq!(std::fs::read(d.join("small.back")).unwrap(), b"small");
    // A stream that fails to read stores nothing, and a forced one keeps the old version.
    for cmd in [
        "--device disk.img fs put - broken",
        "--device disk.img fs put --force - piped",
    ] {
        let stdin = std::fs::File::open(d).unwrap();
        fails_with(
            &gpunvme_with_stdin(d, cmd, stdin.into()),
            "reading standard input",
        );
    }
    let ls = ok(&gpunvme(d, "--device disk.img --json fs ls"));
    assert!(!ls.contains("broken"), "{ls}");
    ok(&gpunvme(d, "--device disk.img fs get piped small.back"));
    assert_eq!(std::fs::read(d.join("small.back")).unwrap(), b"small");
    ok(&gpunvme(d, "--device disk.img fs fsck --data"));
    // Empty input: an empty file.
    ok(&gpunvme_with_stdin(
        d,
        "--device disk.img fs put - empty",
        std::process::Stdio::null(),
    ));
    let st: serde_json::Value =
        serde_json::from_str(&ok(&gpunvme(d, "--device disk.img --json fs stat empty"))).unwrap();
    assert_eq!(st["size"], 0, "{st}");
}

/// `topology` on a fake sysfs tree: a GPU and an NVMe controller behind one switch, another
/// controller on a root port of its own; text and JSON, and no device opened (no image made).
#[test]
fn topology_prints_the_path_class_of_every_gpu_and_controller() {
    let dir = tempfile::tempdir().unwrap();
    let d = dir.path();
    let sys = d.join("sys");
    let add = |path: &str, addr: &str, class: &str, vendor: &str| {
        let dev = sys.join("devices").join(path).join(addr);
        std::fs::create_dir_all(&dev).unwrap();
        std::fs::write(dev.join("class"), class).unwrap();
        std::fs::write(dev.join("vendor"), vendor).unwrap();
        std::fs::write(dev.join("numa_node"), "0").unwrap();
        std::fs::create_dir_all(sys.join("bus/pci/devices")).unwrap();
        std::os::unix::fs::symlink(&dev, sys.join("bus/pci/devices").join(addr)).unwrap();
    };
    let sw = "pci0000:00/0000:00:01.0/0000:01:00.0";
    add(
        &format!("{sw}/0000:02:00.0"),
        "0000:03:00.0",
        "0x030200",
        "0x10de",
    );
    add(
        &format!("{sw}/0000:02:01.0"),
        "0000:04:00.0",
        "0x010802",
        "0x144d",
    );
    add(
        "pci0000:00/0000:00:02.0",
        "0000:05:00.0",
        "0x010802",
        "0x144d",
    );
    let root = sys.display().to_string();
    let text = ok(&gpunvme(d, &format!("topology --sys-root {root}")));
    let row = text
        .lines()
        .find(|l| l.starts_with("GPU 0000:03:00.0"))
        .unwrap();
    assert!(row.contains("PIX") && row.contains("PHB"), "{text}");
    let v: serde_json::Value = serde_json::from_str(&ok(&gpunvme(
        d,
        &format!("--json topology --sys-root {root}"),
    )))
    .unwrap();
    assert_eq!(v["classes"], serde_json::json!([["PIX", "PHB"]]), "{v}");
    assert_eq!(v["nearest"], serde_json::json!([[0]]), "{v}");
    assert_eq!(v["controllers"][1]["address"], "0000:05:00.0");
    assert!(!d.join("gpunvme.img").exists());
    fails_with(
        &gpunvme(d, &format!("--device x.img topology --sys-root {root}")),
        "opens no device",
    );
}
