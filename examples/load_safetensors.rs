//! A `.safetensors` file in blockfs loaded tensor by tensor into GPU memory: the header is
//! parsed on the host, every tensor is read by GPU-issued commands straight into a GPU buffer
//! of its own, and each is verified against the host's bytes.
//!
//! ```text
//! cargo run --release --example load_safetensors -- [--file MODEL.safetensors]
//!     [--device IMG] [--controller emu|gpu]
//! ```
//!
//! Without `--file` a small model is built on the host (tensors of several dtypes and shapes,
//! deterministic bytes, odd sizes so that tensors start and end inside LBAs). The file is put
//! into blockfs by the CPU; its header (8-byte little-endian length, then JSON with `dtype`,
//! `shape` and `data_offsets` per tensor) is read back through blockfs and parsed on the host;
//! then, in waves of at most 32 tensors (the GPU-resident controller registers each buffer as a
//! window, and has 64), one batch of `blockfs_gpu` ranges reads each tensor into its own
//! GPU buffer. Each tensor is checked twice: CRC-32C computed on the GPU against the host's
//! CRC of the original file's bytes, and a copy back compared byte for byte.
//!
//! Exits non-zero on any mismatch; without a GPU prints "skipped: no GPU" and exits 0.

mod common;

use std::os::unix::fs::FileExt;
use std::path::PathBuf;

use anyhow::{Context, Result, ensure};
use clap::Parser;
use gpunvme::blockfs::{CreateOptions, OpenMode};
use gpunvme::blockfs_gpu::{FileRange, GpuFiles, GpuFilesOptions, GpuSpan};
use gpunvme::gpu;
use gpunvme::gpu_fs;
use gpunvme::safetensors::{self, Dtype};
use serde_json::{Map, Value, json};

use common::{DeviceArgs, gbps, verify};

const NAME: &str = "examples/model.safetensors";
/// Tensors per batch (each has a buffer of its own).
const WAVE: usize = 32;

/// Loads a .safetensors file from blockfs into GPU memory, a buffer per tensor.
#[derive(Parser, Debug)]
struct Args {
    /// A real .safetensors file to load (default: a small one built here).
    #[arg(long)]
    file: Option<PathBuf>,
    #[command(flatten)]
    dev: DeviceArgs,
}

fn build_model() -> Vec<u8> {
    let specs: &[(&str, &str, &[u64])] = &[
        ("embed.weight", "F32", &[1000, 257]),
        ("layers.0.attn.q.weight", "BF16", &[257, 255]),
        ("layers.0.attn.q.bias", "BF16", &[255]),
        ("layers.0.mlp.up.weight", "F16", &[513, 1031]),
        ("layers.0.norm.weight", "F32", &[257]),
        ("layers.1.mlp.down.weight", "F16", &[1031, 513]),
        ("positions", "I64", &[4097]),
        ("mask", "U8", &[3, 5, 7]),
        ("scale", "F64", &[]),
        ("empty", "F32", &[0, 16]),
    ];
    let mut header = Map::new();
    header.insert(
        "__metadata__".into(),
        json!({"format": "pt", "source": "gpunvme example"}),
    );
    let mut data = Vec::new();
    for (i, (name, dtype, shape)) in specs.iter().enumerate() {
        let n = shape.iter().product::<u64>() * Dtype::parse(dtype).expect("known dtype").size();
        let begin = data.len() as u64;
        let mut x = 0x9e37_79b9_7f4a_7c15u64 ^ (i as u64 + 1);
        data.extend((0..n).map(|_| {
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            x as u8
        }));
        header.insert(
            (*name).into(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [begin, begin + n]}),
        );
    }
    let mut h = serde_json::to_vec(&Value::Object(header)).expect("json");
    // Pad the header with spaces to 8 bytes, as writers do.
    h.resize(h.len().next_multiple_of(8), b' ');
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend_from_slice(&h);
    out.extend_from_slice(&data);
    out
}

/// Parses a safetensors header (the JSON after the 8-byte length): the tensors, in data order.
enum Source {
    Built(Vec<u8>),
    Host(std::fs::File, u64),
}

impl Source {
    fn len(&self) -> u64 {
        match self {
            Source::Built(b) => b.len() as u64,
            Source::Host(_, n) => *n,
        }
    }

    fn read(&self, at: u64, buf: &mut [u8]) -> Result<()> {
        match self {
            Source::Built(b) => buf.copy_from_slice(&b[at as usize..at as usize + buf.len()]),
            Source::Host(f, _) => f.read_exact_at(buf, at)?,
        }
        Ok(())
    }
}

fn main() -> Result<()> {
    let args = Args::parse();
    let Some(_cuda) = common::gpu_or_skip("load_safetensors", &args.dev.gpu_id)? else {
        return Ok(());
    };
    let src = match &args.file {
        Some(p) => {
            let f = std::fs::File::open(p).with_context(|| format!("opening {}", p.display()))?;
            let n = f.metadata()?.len();
            Source::Host(f, n)
        }
        None => Source::Built(build_model()),
    };
    let len = src.len();
    ensure!(len >= 8, "not a safetensors file: {len} bytes");
    let mut opened = common::open("load_safetensors", &args.dev, len)?;

    // Into blockfs, by the CPU.
    common::remove_if_present(&opened.fs, NAME)?;
    {
        let f = opened.fs.create(NAME, &CreateOptions { size_hint: len })?;
        let mut buf = vec![0u8; (16u64 << 20).min(len) as usize];
        let mut at = 0;
        while at < len {
            let n = (len - at).min(buf.len() as u64) as usize;
            src.read(at, &mut buf[..n])?;
            f.write_at(at, &buf[..n])?;
            at += n as u64;
        }
        opened.fs.sync()?;
    }
    println!("{NAME}: {len} bytes put into blockfs by the CPU");

    // The header, read back through blockfs and parsed on the host.
    opened.remount()?;
    let file = opened.fs.open(NAME, OpenMode::ReadOnly)?;
    let header = safetensors::read_header(NAME, &file)?;
    let (base, tensors) = (header.data_start, header.tensors);
    let hlen = base - 8;
    let total: u64 = tensors.iter().map(|t| t.end - t.begin).sum();
    println!(
        "header: {hlen} bytes, {} tensors, {total} data bytes",
        tensors.len()
    );

    let setup = opened.gpu(&args.dev)?;
    let result = (|| -> Result<()> {
        let files = GpuFiles::new(&setup.queues, GpuFilesOptions::from_env()?);
        let gfile = files.open(&file).context("opening the file for the GPU")?;
        let watch = || gpu::watchdog(&opened.ctrl, &opened.backend, setup.model.as_ref());
        let (mut secs, mut bytes) = (0f64, 0u64);
        for wave in tensors.chunks(WAVE) {
            let bufs = wave
                .iter()
                .map(|t| setup.queues.alloc_buffer((t.end - t.begin).max(1) as usize))
                .collect::<Result<Vec<_>, _>>()
                .context("allocating GPU memory for the tensors")?;
            let ranges = wave
                .iter()
                .zip(&bufs)
                .map(|(t, b)| {
                    Ok(FileRange::read(
                        &gfile,
                        base + t.begin,
                        GpuSpan::of(b, 0, t.end - t.begin)?,
                    ))
                })
                .collect::<Result<Vec<_>>>()?;
            let r = files
                .submit(&ranges)?
                .wait_watched(watch())?
                .into_first_error()?;
            secs += r.elapsed.as_secs_f64();
            bytes += r.bytes();
            for ((t, b), got) in wave.iter().zip(&bufs).zip(&r.ranges) {
                let n = t.end - t.begin;
                let got = *got.as_ref().expect("no error after into_first_error");
                verify(got == n, || {
                    format!("{}: the GPU read {got} of {n} bytes", t.name)
                })?;
                let mut host = vec![0u8; n as usize];
                src.read(base + t.begin, &mut host)?;
                let host_crc = crc32c::crc32c(&host);
                let gpu_crc = files.crc32c(b.ptr(), n)?;
                verify(gpu_crc == host_crc, || {
                    format!(
                        "{}: crc32c on the GPU {gpu_crc:08x}, of the host's bytes {host_crc:08x}",
                        t.name
                    )
                })?;
                let mut back = vec![0u8; n as usize];
                b.read(0, &mut back)?;
                verify(back == host, || {
                    format!("{}: the bytes copied back differ from the host's", t.name)
                })?;
                println!(
                    "  {:<32} {:>5} {:<16} {:>10} bytes  crc32c {gpu_crc:08x} ok",
                    t.name,
                    t.dtype.name(),
                    format!("{:?}", t.shape),
                    n
                );
            }
        }
        println!(
            "{} tensors, {bytes} bytes into their own GPU buffers in {secs:.3} s of kernels \
             ({:.2} GB/s); each verified by a GPU CRC-32C and a byte compare with the host's \
             bytes",
            tensors.len(),
            gbps(bytes, secs)
        );
        println!("data path: {}", gpu_fs::data_path(&setup, false));
        Ok(())
    })();
    let down = common::gpu_down(setup);
    result?;
    down?;
    println!("load_safetensors: OK");
    Ok(())
}
