//! The fixed fuzz corpus (`tests/corpus/`, also the seed corpus of `fuzz/`) and the golden image
//! (`tests/golden/`), replayed by every normal test run.
//!
//! Regenerate both after an intentional format change with
//! `BLOCKFS_REGENERATE=1 cargo test -p blockfs --test corpus -- --ignored regenerate`.

mod common;

use std::path::{Path, PathBuf};
use std::sync::Arc;

use blockfs::format::{SUPERBLOCK_SLOTS, Superblock};
use blockfs::fuzzing::{Outcome, exercise_image, exercise_parsers};
use blockfs::{CreateOptions, FileSystem, MemDevice, MkfsOptions, OpenMode};
use common::*;
use rand::RngCore;

fn dir(sub: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests")
        .join(sub)
}

fn make(bytes: u64, build: impl FnOnce(&FileSystem)) -> Vec<u8> {
    let dev = Arc::new(MemDevice::new(512, bytes / 512));
    let fs = FileSystem::mkfs(
        dev.clone(),
        &MkfsOptions {
            uuid: Some(*b"blockfs-golden-1"),
            ..Default::default()
        },
    )
    .unwrap();
    build(&fs);
    fs.sync().unwrap();
    drop(fs);
    dev.to_image()
}

/// The golden image: a few files over two commits, on a 64 KiB device.
fn golden() -> Vec<u8> {
    make(64 << 10, |fs| {
        put(fs, "hello.txt", b"hello, blockfs\n");
        let f = fs
            .create(
                "data/seq.bin",
                &CreateOptions {
                    size_hint: 16 << 10,
                },
            )
            .unwrap();
        let seq: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
        f.write_at(0, &seq).unwrap();
        fs.sync().unwrap();
        fs.rename("hello.txt", "docs/hello.txt").unwrap();
        fs.set_immutable("docs/hello.txt", true).unwrap();
    })
}

fn corpus() -> Vec<(String, Vec<u8>)> {
    let mut out = Vec::new();
    let empty = make(64 << 10, |_| {});
    let files = golden();
    let many = make(128 << 10, |fs| {
        for i in 0..20 {
            put(
                fs,
                &format!("many/{i:02}/f{}", "x".repeat(i * 9)),
                &vec![i as u8; 100 * i + 1],
            );
        }
        fs.sync().unwrap();
        for i in (0..20).step_by(3) {
            fs.remove(&format!("many/{i:02}/f{}", "x".repeat(i * 9)))
                .unwrap();
        }
    });
    out.push(("ok-empty.bfs".into(), empty.clone()));
    out.push(("ok-files.bfs".into(), files.clone()));
    out.push(("ok-many.bfs".into(), many.clone()));
    let sb = |img: &[u8], slot: usize| {
        Superblock::decode(&img[SUPERBLOCK_SLOTS[slot] as usize..][..256]).unwrap()
    };
    let newest = |img: &[u8]| {
        let (a, b) = (sb(img, 0), sb(img, 1));
        if a.generation > b.generation { a } else { b }
    };
    let flip = |img: &[u8], at: usize| {
        let mut v = img.to_vec();
        v[at] ^= 0x04;
        v
    };
    for (name, img) in [("files", &files), ("many", &many)] {
        let n = newest(img);
        out.push((format!("bad-{name}-sb0.bfs"), flip(img, 33)));
        out.push((format!("bad-{name}-sb1.bfs"), flip(img, 4096 + 49)));
        out.push((
            format!("bad-{name}-root.bfs"),
            flip(img, n.root_bno as usize * 4096 + 70),
        ));
        let root = blockfs::format::decode_root(
            &img[n.root_bno as usize * 4096..][..n.root_bytes as usize],
            &n,
        )
        .unwrap();
        let chunk = root.chunks.last().unwrap();
        out.push((
            format!("bad-{name}-chunk.bfs"),
            flip(img, chunk.bno as usize * 4096 + 40),
        ));
        out.push((
            format!("bad-{name}-truncated.bfs"),
            img[..img.len() / 2].to_vec(),
        ));
    }
    out.push(("bad-zeroes.bfs".into(), vec![0u8; 16 << 10]));
    let mut noise = vec![0u8; 32 << 10];
    rng(99).fill_bytes(&mut noise);
    out.push(("bad-noise.bfs".into(), noise.clone()));
    noise[..8].copy_from_slice(&blockfs::format::SUPERBLOCK_MAGIC);
    out.push(("bad-noise-magic.bfs".into(), noise));
    out
}

#[test]
#[ignore = "writes tests/corpus and tests/golden; run with BLOCKFS_REGENERATE=1 after a format change"]
fn regenerate() {
    if std::env::var_os("BLOCKFS_REGENERATE").is_none() {
        return;
    }
    for (sub, files) in [
        ("corpus", corpus()),
        ("golden", vec![("v1.bfs".to_string(), golden())]),
    ] {
        std::fs::create_dir_all(dir(sub)).unwrap();
        for (name, data) in files {
            std::fs::write(dir(sub).join(name), data).unwrap();
        }
    }
}

#[test]
fn corpus_replays_without_panics() {
    let mut entries: Vec<PathBuf> = std::fs::read_dir(dir("corpus"))
        .unwrap()
        .map(|e| e.unwrap().path())
        .collect();
    entries.sort();
    assert!(entries.len() >= 15, "corpus has {} files", entries.len());
    for path in entries {
        let data = std::fs::read(&path).unwrap();
        let name = path.file_name().unwrap().to_string_lossy().into_owned();
        exercise_parsers(&data);
        let outcome = exercise_image(&data);
        if name.starts_with("ok-") {
            assert_eq!(outcome, Outcome::Mounted, "{name}");
        } else if name.starts_with("bad-") {
            assert_eq!(outcome, Outcome::Refused, "{name}");
        }
    }
}

#[test]
fn the_checked_in_corpus_is_what_the_generator_makes() {
    for (name, data) in corpus() {
        let on_disk = std::fs::read(dir("corpus").join(&name)).unwrap_or_default();
        assert!(
            on_disk == data,
            "tests/corpus/{name} is stale: regenerate it (see this file's docs)"
        );
    }
}

#[test]
fn golden_image_pins_the_format() {
    let checked_in = std::fs::read(dir("golden").join("v1.bfs")).unwrap();
    // Reading: this build mounts the version-1 image and finds its files.
    let fs = FileSystem::mount(Arc::new(MemDevice::from_image(&checked_in, 512))).unwrap();
    let names: Vec<String> = fs.list("").into_iter().map(|s| s.name).collect();
    assert_eq!(names, ["data/seq.bin", "docs/hello.txt"]);
    assert_eq!(read_all(&fs, "docs/hello.txt"), b"hello, blockfs\n");
    let seq: Vec<u8> = (0..10_000u32).map(|i| (i % 251) as u8).collect();
    assert_eq!(read_all(&fs, "data/seq.bin"), seq);
    assert!(fs.stat("docs/hello.txt").unwrap().immutable);
    assert!(fs.open("docs/hello.txt", OpenMode::ReadWrite).is_err());
    assert_eq!(fs.geometry().uuid, *b"blockfs-golden-1");
    // Writing: the same operations produce the same bytes, so any layout change shows up here
    // (and must come with a FORMAT.md update and a version decision).
    let fresh = golden();
    assert_eq!(fresh.len(), checked_in.len());
    if let Some(i) = fresh.iter().zip(&checked_in).position(|(a, b)| a != b) {
        panic!(
            "byte {i} (block {}) differs from tests/golden/v1.bfs",
            i / 4096
        );
    }
}
