//! Many files on one image through the library embedders link ([`gpunvme::handle::DeviceHandle`],
//! the calls Python and C make): mkfs, then `--files` puts of host files (random sizes and
//! directory depths), a listing, every file read back and compared, a sample copied out with
//! `get`, every file removed, and fsck (clean, with every checksum read) after the puts and at
//! the end. Prints one JSON object: the operations per second of each phase.
//!
//! ```sh
//! cargo run --release --example fs_scale -- --files 100000 --image /tmp/scale.img --size 8g
//! ```

use std::io::Write as _;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{Context, Result, bail, ensure};
use gpunvme::handle::DeviceHandle;
use gpunvme::open::OpenOptions;
use rand::rngs::SmallRng;
use rand::{Rng, RngCore, SeedableRng};

struct Args {
    files: usize,
    image: PathBuf,
    size: u64,
    dir: PathBuf,
    max_size: usize,
    seed: u64,
}

fn parse() -> Result<Args> {
    let mut a = Args {
        files: 10_000,
        image: PathBuf::from("fs-scale.img"),
        size: 4 << 30,
        dir: std::env::temp_dir().join(format!("fs-scale-{}", std::process::id())),
        max_size: 32 << 10,
        seed: 1,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut v = || it.next().with_context(|| format!("{k} needs a value"));
        match k.as_str() {
            "--files" => a.files = v()?.parse()?,
            "--image" => a.image = v()?.into(),
            "--size" => a.size = gpunvme::units::parse_size(&v()?).map_err(anyhow::Error::msg)?,
            "--dir" => a.dir = v()?.into(),
            "--max-size" => {
                a.max_size = gpunvme::units::parse_size(&v()?).map_err(anyhow::Error::msg)? as usize
            }
            "--seed" => a.seed = v()?.parse()?,
            _ => bail!(
                "unknown argument {k} (--files N --image PATH --size BYTES --dir HOSTDIR --max-size BYTES --seed N)"
            ),
        }
    }
    Ok(a)
}

/// File `i`'s name and bytes (the same for a seed whenever asked).
fn file(seed: u64, i: usize, max_size: usize) -> (String, Vec<u8>) {
    let mut r = SmallRng::seed_from_u64(seed ^ (i as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15));
    let depth = r.random_range(0..4);
    let mut name = String::new();
    for _ in 0..depth {
        name.push_str(&format!("d{}/", r.random_range(0..20)));
    }
    name.push_str(&format!("f{i:07}"));
    let len = match r.random_range(0..10) {
        0 => 0,
        1..=6 => r.random_range(1..=4096),
        _ => r.random_range(4097..=max_size.max(4097)),
    };
    let mut data = vec![0u8; len];
    r.fill_bytes(&mut data);
    (name, data)
}

fn rate(n: usize, t: Instant) -> serde_json::Value {
    let s = t.elapsed().as_secs_f64();
    serde_json::json!({ "ops": n, "seconds": (s * 1000.0).round() / 1000.0, "ops_per_s": (n as f64 / s).round() })
}

fn fsck_clean(h: &DeviceHandle, what: &str) -> Result<serde_json::Value> {
    let t = Instant::now();
    let out = h.fsck(false, true)?;
    ensure!(
        out.consistent && out.mismatched.is_empty(),
        "fsck {what}: not clean: {}",
        out.json
    );
    Ok(serde_json::json!({ "seconds": (t.elapsed().as_secs_f64() * 1000.0).round() / 1000.0 }))
}

fn main() -> Result<()> {
    let a = parse()?;
    std::fs::create_dir_all(&a.dir)?;
    {
        let f = std::fs::File::create(&a.image)
            .with_context(|| format!("creating {}", a.image.display()))?;
        f.set_len(a.size)?;
    }
    let h = DeviceHandle::open(
        Some(&a.image.display().to_string()),
        OpenOptions::default(),
        1,
    )?;
    h.mkfs(4096, true, None)?;

    // Host files, written beforehand so the put phase times the puts alone.
    let src = |i: usize| a.dir.join(format!("src{i:07}"));
    let mut host_bytes = 0u64;
    for i in 0..a.files {
        let (_, data) = file(a.seed, i, a.max_size);
        host_bytes += data.len() as u64;
        std::fs::File::create(src(i))?.write_all(&data)?;
    }

    let t = Instant::now();
    for i in 0..a.files {
        let (name, _) = file(a.seed, i, a.max_size);
        h.put(&src(i), &name, false)
            .with_context(|| format!("put {i} ({name})"))?;
    }
    let put = rate(a.files, t);

    let t = Instant::now();
    let listed = h.ls("")?;
    let list = rate(1, t);
    ensure!(
        listed.0.len() == a.files,
        "listed {} files of {}",
        listed.0.len(),
        a.files
    );

    let t = Instant::now();
    for i in 0..a.files {
        let (name, data) = file(a.seed, i, a.max_size);
        let got = h.read(&name, 0, None)?;
        ensure!(got == data, "{name}: bytes differ");
    }
    let read = rate(a.files, t);

    let sample = a.files.min(1000);
    let out: &Path = &a.dir.join("out");
    let t = Instant::now();
    for i in (0..a.files).step_by((a.files / sample).max(1)).take(sample) {
        let (name, data) = file(a.seed, i, a.max_size);
        h.get(&name, out)?;
        ensure!(std::fs::read(out)? == data, "{name}: get's bytes differ");
    }
    let get = rate(sample, t);

    let fsck_full = fsck_clean(&h, "after the puts")?;

    let t = Instant::now();
    for i in 0..a.files {
        let (name, _) = file(a.seed, i, a.max_size);
        h.rm(&name).with_context(|| format!("rm {name}"))?;
    }
    let rm = rate(a.files, t);
    ensure!(h.ls("")?.0.is_empty(), "files left after rm");
    let fsck_empty = fsck_clean(&h, "at the end")?;

    std::fs::remove_dir_all(&a.dir)?;
    println!(
        "{}",
        serde_json::json!({
            "files": a.files,
            "bytes": host_bytes,
            "image": a.image.display().to_string(),
            "put": put, "list": list, "read": read, "get": get, "rm": rm,
            "fsck_full": fsck_full, "fsck_empty": fsck_empty,
            "verified": "every file read back byte-identical; fsck clean with data checksums",
        })
    );
    Ok(())
}
