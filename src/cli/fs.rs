//! `gpunvme fs`: blockfs on a namespace — mkfs, ls, put, get, rm, mv, stat, df, fsck.
//!
//! Every command opens the namespace through [`NvmeBlockDevice`] (several I/O queue pairs, DMA
//! bounce buffers reused across calls) and mounts the file system, except `mkfs` (which makes
//! one) and `fsck` (which checks it unmounted). Changes are synced before the command returns.
//! `put` hands the host file to [`blockfs::File::write_from`], whose device lanes read it
//! command by command as they write, and `get` hands the destination to
//! [`blockfs::File::read_to`], whose lanes write each command's bytes as it completes: host-file
//! I/O overlaps device I/O without a staging copy. A destination that takes no positioned
//! writes (a pipe, standard output) gets chunks read on two threads and written in order by a
//! third. Both show a progress bar with throughput on a terminal.

use std::collections::BTreeMap;
use std::fs::File as HostFile;
use std::io::Write;
use std::path::{Path, PathBuf};
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::mpsc::sync_channel;
use std::sync::{Arc, Mutex};
use std::time::Instant;

use anyhow::{Context, Result, bail};
use blockfs::{
    BlockDevice, ChecksummedSink, ChecksummedSource, Crc32cPieces, CreateOptions, DataCheck,
    Existing, FileStat, FileSystem, FsckOptions, FsckReport, MkfsOptions, NvmeBlockDevice,
    NvmeDeviceOptions, OpenMode,
};
use gpunvme::units::{format_bytes, parse_size};

use crate::cli::{Refusal, StdoutError, escape};
use indicatif::{ProgressBar, ProgressStyle};
use nvme::Controller;
use serde_json::{Value, json};

/// `get`: threads reading from the file system at once, and buffers in circulation.
const GET_READERS: usize = 2;
const GET_BUFFERS: usize = 4;
/// `get`'s default bytes per call where the destination takes no positioned writes.
const GET_STREAM_CHUNK: u64 = 16 << 20;
/// Files at least this large get a progress bar (on a terminal).
const PROGRESS_MIN: u64 = 64 << 20;

/// blockfs commands.
#[derive(clap::Subcommand, Debug)]
pub enum FsCommand {
    /// Make a new, empty file system on the namespace (everything on it is lost).
    Mkfs {
        /// File system block size (4k to 1m, a power of two).
        #[arg(long, default_value = "4k", value_parser = parse_size)]
        block_size: u64,
        /// Make it even if the namespace holds a blockfs, destroying its files.
        #[arg(long)]
        force: bool,
    },
    /// List files whose names start with PREFIX (all files without one).
    Ls {
        /// Name prefix, e.g. `dataset/` for everything "in" that directory.
        prefix: Option<String>,
    },
    /// Copy a host file into the file system.
    Put {
        /// Host file to read.
        src: PathBuf,
        /// Name in the file system (UTF-8, `/`-separated, up to 1024 bytes).
        name: String,
        /// Replace NAME if it exists. The new version is written first and swapped in by one
        /// commit, so the old one survives any failure (room for both is needed meanwhile).
        #[arg(long)]
        force: bool,
        /// Bytes per file-system call (default: the whole file in one call). The device stays
        /// busy within a call and drains between calls, so smaller values only cost speed.
        #[arg(long, value_parser = parse_size)]
        chunk: Option<u64>,
    },
    /// Copy a file out of the file system (`-` for standard output). A regular-file destination
    /// is written under a temporary name beside it and renamed into place once complete and
    /// synced: a failed or interrupted get leaves DST as it was.
    Get {
        /// Name in the file system.
        name: String,
        /// Host file to create or truncate.
        dst: PathBuf,
        /// Bytes per file-system call (default: the whole file in one call, or 16m where the
        /// destination takes no positioned writes, e.g. a pipe). The device stays busy within a
        /// call and drains between calls, so smaller values only cost speed.
        #[arg(long, value_parser = parse_size)]
        chunk: Option<u64>,
    },
    /// Remove a file.
    Rm {
        /// Name in the file system.
        name: String,
    },
    /// Rename a file (fails if NEW exists, unless --force).
    Mv {
        /// Current name.
        old: String,
        /// New name.
        new: String,
        /// Replace NEW if it exists (the removal and the rename are one commit).
        #[arg(long)]
        force: bool,
    },
    /// Show a file's size, allocation, extents and generation.
    Stat {
        /// Name in the file system.
        name: String,
    },
    /// Show space usage.
    Df,
    /// Check the file system (unmounted); with --repair, fix what can be fixed.
    Fsck {
        /// Rebuild a consistent file system from the best surviving generation.
        #[arg(long)]
        repair: bool,
        /// Also read every file with a recorded checksum and compare (reads all file data).
        #[arg(long)]
        data: bool,
    },
}

impl FsCommand {
    /// The host file the command writes, if any.
    pub fn output_path(&self) -> Option<&Path> {
        match self {
            FsCommand::Get { dst, .. } => Some(dst),
            _ => None,
        }
    }

    /// Whether the command only reads the file system (and may share the device with other
    /// readers).
    pub fn is_read_only(&self) -> bool {
        match self {
            FsCommand::Ls { .. }
            | FsCommand::Get { .. }
            | FsCommand::Stat { .. }
            | FsCommand::Df => true,
            FsCommand::Fsck { repair, .. } => !repair,
            FsCommand::Mkfs { .. }
            | FsCommand::Put { .. }
            | FsCommand::Rm { .. }
            | FsCommand::Mv { .. } => false,
        }
    }
}

/// Runs a blockfs command on namespace `nsid` of `ctrl`.
pub fn run(ctrl: &Controller, nsid: u32, cmd: FsCommand, json: bool) -> Result<()> {
    let dev = Arc::new(
        NvmeBlockDevice::new(ctrl, nsid, &NvmeDeviceOptions::default())
            .with_context(|| format!("opening namespace {nsid} for blockfs"))?,
    );
    let path = dev.describe();
    let mount = || match FileSystem::mount(dev.clone()) {
        Ok(fs) => Ok(fs),
        Err(e @ blockfs::Error::NotBlockfs(_)) => Err(anyhow::Error::new(e).context(format!(
            "namespace {nsid} holds no blockfs (make one with `gpunvme fs mkfs`)"
        ))),
        Err(e) => Err(anyhow::Error::new(e).context(format!(
            "mounting blockfs on namespace {nsid} (`gpunvme fs fsck` says more)"
        ))),
    };
    match cmd {
        FsCommand::Mkfs { block_size, force } => {
            let opts = MkfsOptions {
                block_size: u32::try_from(block_size).context("--block-size is too large")?,
                ..MkfsOptions::default()
            };
            if !force {
                let found =
                    FileSystem::probe(dev.clone()).context("looking for a file system to keep")?;
                if found.is_blockfs() {
                    return Err(Refusal(format!(
                        "namespace {nsid} holds {found}; mkfs would destroy it (add --force to do so)"
                    ))
                    .into());
                }
            }
            let fs = FileSystem::mkfs(dev.clone(), &opts).context("mkfs")?;
            let g = fs.geometry();
            let df = fs.df();
            if json {
                outln!(
                    "{}",
                    json!({
                        "uuid": uuid(&g.uuid),
                        "block_size": g.block_size,
                        "blocks": g.block_count,
                        "free_blocks": df.free_blocks,
                        "data_path": path,
                    })
                );
            } else {
                outln!("data path: {path}");
                outln!(
                    "made blockfs {}: {} blocks of {} bytes ({}), {} free",
                    uuid(&g.uuid),
                    g.block_count,
                    g.block_size,
                    format_bytes((g.block_count * g.block_size as u64) as f64),
                    format_bytes((df.free_blocks * g.block_size as u64) as f64)
                );
            }
            Ok(())
        }
        FsCommand::Ls { prefix } => {
            let fs = mount()?;
            let files = fs.list(prefix.as_deref().unwrap_or(""));
            if json {
                let v: Vec<Value> = files.iter().map(stat_json).collect();
                outln!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                for f in &files {
                    outln!(
                        "{:>14} {:>10} {:>4} {}",
                        f.size,
                        format_bytes(f.allocated as f64),
                        f.extents,
                        escape(&f.name)
                    );
                }
                outln!("{} file(s)", files.len());
            }
            Ok(())
        }
        FsCommand::Put {
            src,
            name,
            force,
            chunk,
        } => {
            check_chunk(chunk)?;
            let fs = mount()?;
            put(&fs, &src, &name, force, chunk, json, &path)
        }
        FsCommand::Get { name, dst, chunk } => {
            check_chunk(chunk)?;
            let fs = mount()?;
            get(&fs, &name, &dst, chunk, json, &path)
        }
        FsCommand::Rm { name } => {
            let fs = mount()?;
            fs.remove(&name)?;
            fs.sync()?;
            if json {
                outln!("{}", json!({ "removed": name }));
            } else {
                outln!("removed {}", escape(&name));
            }
            Ok(())
        }
        FsCommand::Mv { old, new, force } => {
            let fs = mount()?;
            if force {
                fs.rename_replace(&old, &new)?;
            } else {
                fs.rename(&old, &new)?;
            }
            fs.sync()?;
            if json {
                outln!("{}", json!({ "from": old, "to": new }));
            } else {
                outln!("renamed {} to {}", escape(&old), escape(&new));
            }
            Ok(())
        }
        FsCommand::Stat { name } => {
            let fs = mount()?;
            let st = fs.stat(&name)?;
            let table = fs.open(&name, OpenMode::ReadOnly)?.extent_table()?;
            if json {
                let mut v = stat_json(&st);
                v["gpu_table_bytes"] = json!(table.as_bytes().len());
                v["extent_list"] = table
                    .extents()
                    .iter()
                    .map(|e| json!({ "file_lba": e.file_lba, "lba": e.lba, "nlb": e.nlb }))
                    .collect();
                outln!("{}", serde_json::to_string_pretty(&v)?);
            } else {
                outln!("name:       {}", escape(&st.name));
                outln!("file id:    {}", st.file_id);
                outln!("size:       {} ({})", st.size, format_bytes(st.size as f64));
                outln!(
                    "allocated:  {} ({})",
                    st.allocated,
                    format_bytes(st.allocated as f64)
                );
                outln!("extents:    {}", st.extents);
                outln!("generation: {}", st.generation);
                outln!("immutable:  {}", st.immutable);
                match st.data_crc {
                    Some(c) => outln!(
                        "CRC-32C:    {c:#010x} (checked by fs get and fs fsck --data; GPU reads through extent tables are not checked)"
                    ),
                    None => outln!("CRC-32C:    none recorded (reads are not checked)"),
                }
                outln!("GPU table:  {} bytes", table.as_bytes().len());
                for e in table.extents() {
                    outln!(
                        "  file LBA {:>12} -> LBA {:>12} x {}",
                        e.file_lba,
                        e.lba,
                        e.nlb
                    );
                }
            }
            Ok(())
        }
        FsCommand::Df => {
            let fs = mount()?;
            let d = fs.df();
            let bs = d.block_size as u64;
            if json {
                outln!(
                    "{}",
                    serde_json::to_string_pretty(&json!({
                        "block_size": d.block_size,
                        "total_blocks": d.total_blocks,
                        "data_blocks": d.data_blocks,
                        "metadata_blocks": d.metadata_blocks,
                        "free_blocks": d.free_blocks,
                        "available_blocks": d.available_blocks,
                        "available_bytes": d.available_blocks * bs,
                        "pending_blocks": d.pending_blocks,
                        "files": d.files,
                        "generation": d.generation,
                        "uuid": uuid(&fs.geometry().uuid),
                    }))?
                );
            } else {
                let b = |n: u64| format_bytes((n * bs) as f64);
                outln!(
                    "size:      {} ({} blocks of {bs} bytes)",
                    b(d.total_blocks),
                    d.total_blocks
                );
                outln!("data:      {}", b(d.data_blocks));
                outln!("metadata:  {}", b(d.metadata_blocks));
                outln!(
                    "free:      {} ({} bytes available for file data; the rest is kept for metadata)",
                    b(d.free_blocks),
                    d.available_blocks * bs
                );
                outln!(
                    "pending:   {} (free after the next commits)",
                    b(d.pending_blocks)
                );
                outln!("files:     {}", d.files);
                outln!("generation {}", d.generation);
            }
            Ok(())
        }
        FsCommand::Fsck { repair, data } => {
            let report = blockfs::fsck(dev.clone(), &FsckOptions { repair })?;
            let data_report = if data && report.is_consistent() {
                Some(check_data(&FileSystem::mount(dev.clone())?)?)
            } else {
                None
            };
            print_fsck(&report, repair, data_report.as_ref(), json)?;
            if !report.is_consistent() {
                bail!(
                    "the file system is inconsistent{}",
                    if repair {
                        ""
                    } else {
                        "; run `gpunvme fs fsck --repair`"
                    }
                );
            }
            if let Some(d) = &data_report
                && !d.mismatched.is_empty()
            {
                return Err(blockfs::Error::Corrupt {
                    what: format!(
                        "file data of {}",
                        d.mismatched
                            .iter()
                            .map(|n| escape(n).into_owned())
                            .collect::<Vec<_>>()
                            .join(", ")
                    ),
                    detail: "the bytes do not match the CRC-32C recorded when they were written"
                        .into(),
                }
                .into());
            }
            Ok(())
        }
    }
}

/// What `fsck --data` found.
struct DataReport {
    /// Files whose bytes match their checksum.
    verified: u64,
    /// Files without a recorded checksum (not checked).
    unchecked: u64,
    /// Files whose bytes do not match.
    mismatched: Vec<String>,
}

fn check_data(fs: &FileSystem) -> Result<DataReport> {
    let mut r = DataReport {
        verified: 0,
        unchecked: 0,
        mismatched: Vec::new(),
    };
    for f in fs.list("") {
        match fs
            .verify_data(&f.name)
            .with_context(|| format!("reading {}", escape(&f.name)))?
        {
            DataCheck::Match => r.verified += 1,
            DataCheck::NoChecksum => r.unchecked += 1,
            DataCheck::Mismatch { .. } => r.mismatched.push(f.name),
        }
    }
    Ok(r)
}

/// What namespace `nsid` of `ctrl` holds: for refusing to overwrite a file system by accident.
pub fn probe(ctrl: &Controller, nsid: u32) -> Result<Existing> {
    let dev = Arc::new(
        NvmeBlockDevice::new(ctrl, nsid, &NvmeDeviceOptions::default())
            .with_context(|| format!("opening namespace {nsid}"))?,
    );
    FileSystem::probe(dev).with_context(|| format!("looking for a blockfs on namespace {nsid}"))
}

/// `--chunk` of put and get, before anything is opened: whole-file calls when absent.
fn check_chunk(chunk: Option<u64>) -> Result<()> {
    match chunk {
        Some(c) if c < 4096 => bail!("--chunk must be at least 4k, not {c}"),
        _ => Ok(()),
    }
}

/// The streaming `get`'s chunk, which sizes its in-memory buffers: at most 1 GiB.
fn chunk_bytes(chunk: u64) -> Result<usize> {
    if !(4096..=1 << 30).contains(&chunk) {
        bail!("--chunk must be between 4k and 1g, not {chunk}");
    }
    Ok(chunk as usize)
}

fn uuid(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

fn stat_json(f: &FileStat) -> Value {
    json!({
        "name": f.name,
        "file_id": f.file_id,
        "size": f.size,
        "allocated": f.allocated,
        "extents": f.extents,
        "generation": f.generation,
        "immutable": f.immutable,
        "crc32c": f.data_crc,
    })
}

fn progress(len: u64, json: bool, verb: &str) -> ProgressBar {
    if json || len < PROGRESS_MIN {
        return ProgressBar::hidden();
    }
    let bar = ProgressBar::new(len);
    bar.set_style(
        ProgressStyle::with_template(&format!(
            "{verb} [{{bar:40}}] {{bytes}}/{{total_bytes}} {{binary_bytes_per_sec}} eta {{eta}}"
        ))
        .unwrap_or_else(|_| ProgressStyle::default_bar())
        .progress_chars("=> "),
    );
    bar
}

/// One finished `put` or `get`.
struct Transfer<'a> {
    verb: &'a str,
    from: &'a str,
    to: &'a str,
    bytes: u64,
    secs: f64,
    extents: usize,
    /// The file's CRC-32C: recorded (put), or checked against the bytes copied (get).
    crc: Option<u32>,
}

fn report_transfer(t: &Transfer<'_>, path: &str, json: bool) -> Result<()> {
    let rate = t.bytes as f64 / t.secs.max(1e-9);
    if json {
        outln!(
            "{}",
            json!({
                "op": t.verb,
                "from": t.from,
                "to": t.to,
                "bytes": t.bytes,
                "seconds": t.secs,
                "bytes_per_sec": rate,
                "extents": t.extents,
                "crc32c": t.crc,
                "verified": t.verb == "get" && t.crc.is_some(),
                "data_path": path,
            })
        );
    } else {
        outln!("data path: {path}");
        outln!(
            "{} {} -> {}: {} in {:.3} s ({}/s), {} extent(s)",
            t.verb,
            escape(t.from),
            escape(t.to),
            format_bytes(t.bytes as f64),
            t.secs,
            format_bytes(rate),
            t.extents
        );
        match (t.verb, t.crc) {
            ("put", Some(c)) => outln!("CRC-32C {c:#010x} recorded"),
            ("get", Some(c)) => outln!("CRC-32C {c:#010x} verified"),
            ("get", None) => outln!("not verified: no checksum recorded for this file"),
            _ => {}
        }
    }
    Ok(())
}

/// Buffers circulate between the file-system threads and the host-file thread in `get`: `full`
/// carries (offset, buffer, length), `empty` returns buffers for reuse.
type Full = (u64, Vec<u8>, usize);

fn put(
    fs: &FileSystem,
    src: &Path,
    name: &str,
    force: bool,
    chunk: Option<u64>,
    json: bool,
    path: &str,
) -> Result<()> {
    let input = HostFile::open(src).with_context(|| format!("opening {}", src.display()))?;
    let meta = input
        .metadata()
        .with_context(|| format!("reading {}", src.display()))?;
    if !meta.is_file() {
        // The copy reads the source by position and needs its length up front.
        bail!("{} is not a regular file", src.display());
    }
    let len = meta.len();
    blockfs::check_name(name)
        .map_err(|reason| anyhow::anyhow!("invalid file name {name:?}: {reason}"))?;
    // Replacing: write the new version under a temporary name (which never reaches the
    // medium: nothing commits before the end), then rename it over the old one in the same
    // commit that removes the old one. Any failure before that leaves the old version.
    let temp = match fs.stat(name) {
        Ok(old) if force => {
            if old.immutable {
                return Err(blockfs::Error::ReadOnly(name.to_owned()).into());
            }
            Some(temp_name(fs))
        }
        _ => None,
    };
    let file = fs.create(
        temp.as_deref().unwrap_or(name),
        &CreateOptions { size_hint: len },
    )?;
    let bar = progress(len, json, "put");
    let start = Instant::now();
    // Each call is one device batch over all queue pairs, in which every lane reads the source
    // for each command right before issuing it: source reads overlap device writes from the
    // first command to the last, with no staging copy of the file. Between calls the queues
    // drain, hence one call by default.
    let chunk = chunk.unwrap_or(len).max(1);
    // The checksum of exactly the bytes handed to the device, taken as the lanes read them.
    let pieces = Crc32cPieces::new();
    let source = ChecksummedSource::new(&input, &pieces);
    let mut off = 0u64;
    while off < len {
        let n = chunk.min(len - off);
        file.write_from(off, &source, off..off + n, &|k| bar.inc(k))
            .map_err(|e| changed_size(&input, src, len).unwrap_or_else(|| e.into()))
            .with_context(|| format!("writing {name}"))?;
        off += n;
    }
    // A source that grew while being copied has a byte past the length read at the start.
    if let Some(e) = changed_size(&input, src, len) {
        return Err(e);
    }
    let crc = pieces.finish(0, len);
    if let Some(crc) = crc {
        file.set_data_crc(crc)?;
    }
    if let Some(temp) = &temp {
        fs.rename_replace(temp, name)
            .with_context(|| format!("replacing {name}"))?;
    }
    fs.sync().context("syncing")?;
    let secs = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    let extents = file.stat()?.extents;
    let from = src.display().to_string();
    let t = Transfer {
        verb: "put",
        from: &from,
        to: name,
        bytes: len,
        secs,
        extents,
        crc,
    };
    report_transfer(&t, path, json)?;
    Ok(())
}

/// A name no file has, for a replacement being written.
fn temp_name(fs: &FileSystem) -> String {
    let base = format!(".gpunvme-put-{}", std::process::id());
    (0u32..)
        .map(|i| format!("{base}-{i}"))
        .find(|n| fs.stat(n).is_err())
        .expect("some name is free")
}

/// The error to report if `input` is no longer `len` bytes long (or cannot be read at `len`).
fn changed_size(input: &HostFile, src: &Path, len: u64) -> Option<anyhow::Error> {
    let mut probe = [0u8; 1];
    match std::os::unix::fs::FileExt::read_at(input, &mut probe, len) {
        Ok(0) => match input.metadata() {
            Ok(m) if m.len() == len => None,
            Ok(m) => Some(anyhow::anyhow!(
                "{} changed size while being copied ({len} bytes, then {})",
                src.display(),
                m.len()
            )),
            Err(e) => Some(anyhow::Error::new(e).context(format!("reading {}", src.display()))),
        },
        Ok(_) => Some(anyhow::anyhow!(
            "{} changed size while being copied (grew past {len} bytes)",
            src.display()
        )),
        Err(e) => Some(anyhow::Error::new(e).context(format!("reading {}", src.display()))),
    }
}

fn get(
    fs: &FileSystem,
    name: &str,
    dst: &Path,
    chunk: Option<u64>,
    json: bool,
    path: &str,
) -> Result<()> {
    let file = fs.open(name, OpenMode::ReadOnly)?;
    let len = file.len()?;
    let recorded = file.stat()?.data_crc;
    let to_stdout = dst == Path::new("-");
    let target = if to_stdout {
        None
    } else {
        Some(Target::create(dst)?)
    };
    let out = target.as_ref().map(|t| &t.file);
    // Positioned writes (a regular file, /dev/null) let the device lanes write the destination
    // themselves; a pipe or a terminal takes the bytes in order from one writer.
    let positioned = out.filter(|o| std::os::unix::fs::FileExt::write_at(*o, &[], 0).is_ok());
    let bar = progress(len, json || to_stdout, "get");
    let start = Instant::now();
    // The checksum of exactly the bytes the device delivered, taken as they pass.
    let pieces = Crc32cPieces::new();
    let copied_crc = match positioned {
        Some(out) => {
            let sink = ChecksummedSink::new(out, &pieces);
            if out.metadata().is_ok_and(|m| m.is_file()) {
                out.set_len(len)
                    .with_context(|| format!("sizing {}", dst.display()))?;
            }
            let chunk = chunk.unwrap_or(len).max(1);
            let mut off = 0u64;
            while off < len {
                let n = chunk.min(len - off);
                let got = file
                    .read_to(off, n, &sink, off, &|k| bar.inc(k))
                    .with_context(|| format!("reading {name} into {}", dst.display()))?;
                if got != n {
                    bail!("{name} ended at byte {} while being copied", off + got);
                }
                off += n;
            }
            pieces.finish(0, len)
        }
        None => {
            let out: Box<dyn Write + Send + '_> = match out {
                Some(f) => Box::new(f),
                None => Box::new(StdoutWriter(std::io::stdout())),
            };
            let chunk = chunk_bytes(chunk.unwrap_or(GET_STREAM_CHUNK))?;
            Some(stream_out(&file, name, len, out, chunk, &bar)?)
        }
    };
    // Checked before the copy takes the destination's name: a damaged file never replaces it.
    if let Some(recorded) = recorded
        && copied_crc != Some(recorded)
    {
        return Err(blockfs::Error::Corrupt {
            what: format!("file {}", escape(name)),
            detail: format!(
                "its bytes do not match the CRC-32C recorded when it was written ({recorded:#010x}, read {}): the data on the device is damaged{}",
                copied_crc.map_or("incompletely".into(), |c| format!("{c:#010x}")),
                if to_stdout { "; what was written to standard output is wrong" } else { "" }
            ),
        }
        .into());
    }
    if let Some(t) = target {
        t.commit()?;
    }
    let secs = start.elapsed().as_secs_f64();
    bar.finish_and_clear();
    if !to_stdout {
        let extents = file.stat()?.extents;
        let to = dst.display().to_string();
        let t = Transfer {
            verb: "get",
            from: name,
            to: &to,
            bytes: len,
            secs,
            extents,
            crc: recorded,
        };
        report_transfer(&t, path, json)?;
    }
    Ok(())
}

/// Where `get` writes: a regular file (new or existing) is written under a temporary name in
/// the same directory and renamed over the destination only when complete and synced, so the
/// destination never holds a partial copy; anything else (a device such as /dev/null, a FIFO)
/// is written in place. Dropped without [`Target::commit`], the temporary file is removed.
struct Target {
    file: HostFile,
    /// The temporary name, for a regular-file destination.
    temp: Option<PathBuf>,
    dst: PathBuf,
}

impl Target {
    fn create(dst: &Path) -> Result<Self> {
        use std::os::unix::fs::PermissionsExt;
        let existing = std::fs::metadata(dst).ok();
        if let Some(m) = existing.as_ref().filter(|m| !m.is_file()) {
            if m.is_dir() {
                bail!("{} is a directory", dst.display());
            }
            let file = std::fs::OpenOptions::new()
                .write(true)
                .open(dst)
                .with_context(|| format!("opening {}", dst.display()))?;
            return Ok(Self {
                file,
                temp: None,
                dst: dst.to_owned(),
            });
        }
        let file_name = dst
            .file_name()
            .with_context(|| format!("{} names no file", dst.display()))?;
        let mut temp_name = std::ffi::OsString::from(".");
        temp_name.push(file_name);
        temp_name.push(format!(".gpunvme-get-{}.tmp", std::process::id()));
        let temp = dst.with_file_name(temp_name);
        let file = std::fs::OpenOptions::new()
            .write(true)
            .create_new(true)
            .open(&temp)
            .with_context(|| format!("creating {}", temp.display()))?;
        let target = Self {
            file,
            temp: Some(temp),
            dst: dst.to_owned(),
        };
        if let Some(m) = existing {
            // Replace a file with one of the same permissions.
            let mode = std::fs::Permissions::from_mode(m.permissions().mode() & 0o7777);
            target
                .file
                .set_permissions(mode)
                .with_context(|| format!("creating {}", dst.display()))?;
        }
        Ok(target)
    }

    /// Syncs the copy and moves it into place.
    fn commit(mut self) -> Result<()> {
        let Some(temp) = self.temp.take() else {
            return Ok(());
        };
        let done = self
            .file
            .sync_all()
            .and_then(|()| std::fs::rename(&temp, &self.dst));
        if let Err(e) = done {
            let _ = std::fs::remove_file(&temp);
            return Err(anyhow::Error::new(e).context(format!("writing {}", self.dst.display())));
        }
        // Make the rename itself durable (best effort: some file systems refuse to sync a
        // directory).
        let dir = match self.dst.parent() {
            Some(p) if !p.as_os_str().is_empty() => p,
            _ => Path::new("."),
        };
        if let Ok(d) = HostFile::open(dir) {
            let _ = d.sync_all();
        }
        Ok(())
    }
}

impl Drop for Target {
    fn drop(&mut self) {
        if let Some(temp) = &self.temp {
            let _ = std::fs::remove_file(temp);
        }
    }
}

/// Standard output whose write errors are [`StdoutError`]s (a closed pipe ends `get -`
/// quietly).
struct StdoutWriter(std::io::Stdout);

impl Write for StdoutWriter {
    fn write(&mut self, buf: &[u8]) -> std::io::Result<usize> {
        self.0.write(buf).map_err(wrap_stdout)
    }
    fn flush(&mut self) -> std::io::Result<()> {
        self.0.flush().map_err(wrap_stdout)
    }
}

/// An I/O error that carries a [`StdoutError`], so the error chain says where it happened.
fn wrap_stdout(e: std::io::Error) -> std::io::Error {
    std::io::Error::new(e.kind(), StdoutError(e))
}

/// Copies `file` to `out` in order, `chunk` bytes per file-system call: GET_READERS threads
/// read consecutive chunks concurrently, so the device always has the next batch queued while
/// one completes, and one writer puts them back in order. Returns the CRC-32C of the bytes
/// written.
fn stream_out(
    file: &blockfs::File,
    name: &str,
    len: u64,
    mut out: Box<dyn Write + Send + '_>,
    chunk: usize,
    bar: &ProgressBar,
) -> Result<u32> {
    let chunks = len.div_ceil(chunk as u64);
    let next = AtomicU64::new(0);
    let (full_tx, full_rx) = sync_channel::<Full>(GET_BUFFERS);
    let (empty_tx, empty_rx) = sync_channel::<Vec<u8>>(GET_BUFFERS);
    for _ in 0..GET_BUFFERS {
        empty_tx.send(vec![0u8; chunk]).expect("channel has room");
    }
    let empty_rx = Mutex::new(empty_rx);
    let writer_bar = bar.clone();
    std::thread::scope(|s| -> Result<u32> {
        let bar = writer_bar;
        let writer = s.spawn(move || -> Result<u32> {
            let mut waiting: BTreeMap<u64, (Vec<u8>, usize)> = BTreeMap::new();
            let mut expect = 0u64;
            let mut crc = 0u32;
            for (off, buf, n) in full_rx.iter() {
                waiting.insert(off, (buf, n));
                while let Some((buf, n)) = waiting.remove(&expect) {
                    crc = crc32c::crc32c_append(crc, &buf[..n]);
                    out.write_all(&buf[..n])
                        .context("writing the destination file")?;
                    expect += n as u64;
                    bar.set_position(expect);
                    let _ = empty_tx.send(buf);
                }
            }
            out.flush().context("writing the destination file")?;
            if expect != len {
                bail!("copied {expect} of {len} bytes");
            }
            Ok(crc)
        });
        let readers: Vec<_> = (0..GET_READERS)
            .map(|_| {
                let (full_tx, empty_rx, next, file) = (full_tx.clone(), &empty_rx, &next, &file);
                s.spawn(move || -> blockfs::Result<()> {
                    loop {
                        // Take a buffer before a chunk number, so the lowest chunk not yet
                        // written is always being read by someone holding a buffer.
                        let Ok(mut buf) = empty_rx
                            .lock()
                            .map_err(|_| ())
                            .and_then(|r| r.recv().map_err(drop))
                        else {
                            return Ok(());
                        };
                        let i = next.fetch_add(1, Ordering::Relaxed);
                        if i >= chunks {
                            return Ok(());
                        }
                        let off = i * chunk as u64;
                        let n = file.read_at(off, &mut buf)?;
                        if full_tx.send((off, buf, n)).is_err() {
                            return Ok(());
                        }
                    }
                })
            })
            .collect();
        drop(full_tx);
        let mut result = Ok(());
        for r in readers {
            let r = r
                .join()
                .map_err(|_| anyhow::anyhow!("reader thread panicked"))?;
            if result.is_ok() {
                result = r;
            }
        }
        let written = writer
            .join()
            .map_err(|_| anyhow::anyhow!("writer thread panicked"))?;
        result.with_context(|| format!("reading {name}"))?;
        written
    })
}

fn print_fsck(r: &FsckReport, repair: bool, data: Option<&DataReport>, json: bool) -> Result<()> {
    let problems = |ps: &[blockfs::Problem]| -> Vec<Value> {
        ps.iter()
            .map(|p| json!({ "what": p.what, "detail": p.detail }))
            .collect()
    };
    if json {
        let v = json!({
            "clean": r.is_clean(),
            "consistent": r.is_consistent(),
            "generation": r.generation,
            "slots": r.slots.iter().map(|s| json!({
                "slot": s.slot,
                "byte_offset": s.byte_offset,
                "generation": s.generation,
                "problem": s.problem,
            })).collect::<Vec<_>>(),
            "problems": problems(&r.problems),
            "older_generation": r.older_generation,
            "older_problems": problems(&r.older_problems),
            "files": r.files,
            "total_blocks": r.total_blocks,
            "data_blocks": r.data_blocks,
            "metadata_blocks": r.metadata_blocks,
            "free_blocks": r.free_blocks,
            "pending_blocks": r.pending_blocks,
            "repair": repair,
            "repairs": r.repairs,
            "unrepairable": r.unrepairable,
            "remaining": problems(&r.remaining),
            "data": data.map(|d| json!({
                "verified": d.verified,
                "unchecked": d.unchecked,
                "mismatched": d.mismatched,
            })),
        });
        outln!("{}", serde_json::to_string_pretty(&v)?);
        return Ok(());
    }
    let repaired = !r.repairs.is_empty();
    for p in &r.problems {
        outln!("{}: {p}", if repaired { "found" } else { "problem" });
    }
    for line in &r.repairs {
        outln!("repaired: {line}");
    }
    if let Some(u) = &r.unrepairable {
        outln!("cannot repair: {u}");
    }
    if repaired {
        outln!("after repair:");
    }
    for s in &r.slots {
        match (&s.generation, &s.problem) {
            (Some(g), _) => outln!(
                "superblock slot {} (byte {}): generation {g}",
                s.slot,
                s.byte_offset
            ),
            (None, Some(p)) => outln!("superblock slot {} (byte {}): {p}", s.slot, s.byte_offset),
            (None, None) => {}
        }
    }
    if let Some(g) = r.generation {
        outln!(
            "generation {g}: {} file(s); {} of {} blocks used by data, {} by metadata, {} free, {} pending",
            r.files,
            r.data_blocks,
            r.total_blocks,
            r.metadata_blocks,
            r.free_blocks,
            r.pending_blocks
        );
    }
    if let Some(g) = r.older_generation {
        if r.older_problems.is_empty() {
            outln!("previous generation {g}: intact (available for rollback)");
        }
        for p in &r.older_problems {
            outln!("previous generation {g}: {p}");
        }
    }
    for p in &r.remaining {
        outln!("still wrong: {p}");
    }
    if let Some(d) = data {
        outln!(
            "file data: {} file(s) match their CRC-32C, {} have none recorded (not checked), {} do not match",
            d.verified,
            d.unchecked,
            d.mismatched.len()
        );
        for n in &d.mismatched {
            outln!("damaged data: {}", escape(n));
        }
    }
    if r.is_clean() {
        outln!("clean");
    } else if repair && r.is_consistent() {
        outln!("repaired; the file system is consistent");
    }
    Ok(())
}
