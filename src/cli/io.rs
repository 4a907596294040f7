//! `gpunvme read` and `gpunvme write`: raw namespace I/O between files and LBAs.
//!
//! Every argument is checked against the namespace before any command is sent, so a bad request
//! leaves the device untouched.

use std::io::Write as _;
use std::path::Path;

use anyhow::{Context, Result, anyhow, bail};
use gpunvme::copy::{CopyError, StagedFile, fill_from};
use gpunvme_cli::report::RawIoReport;
use nvme::{Controller, Namespace};

/// Checks that `bytes` at `lba` is whole LBAs inside namespace `nsid`; returns the namespace
/// and the block count.
fn check_range(ctrl: &Controller, nsid: u32, lba: u64, bytes: u64) -> Result<(Namespace, u64)> {
    let ns = ctrl.namespace(nsid)?.clone();
    let lba_size = ns.lba_size as u64;
    if bytes == 0 {
        bail!("nothing to transfer: the length is 0 bytes");
    }
    if bytes % lba_size != 0 {
        bail!(
            "length {bytes} bytes is not a whole number of namespace {nsid}'s {lba_size}-byte LBAs"
        );
    }
    let blocks = bytes / lba_size;
    if lba >= ns.blocks || blocks > ns.blocks - lba {
        bail!(
            "LBAs {lba}..{} are beyond the end of namespace {nsid} ({} blocks)",
            lba.saturating_add(blocks),
            ns.blocks
        );
    }
    Ok((ns, blocks))
}

/// Bytes per piece of `read` and `write`: the most of the data either holds in memory at a
/// time (besides the queue pair's DMA bounce buffer of at most the same size), whatever the
/// length of the transfer.
pub const PIECE: usize = 4 << 20;

/// The largest multiple of `lba_size` that is at most [`PIECE`] (at least one LBA).
fn piece_bytes(lba_size: u64) -> u64 {
    (PIECE as u64 / lba_size * lba_size).max(lba_size)
}

/// `gpunvme write`: writes the whole of `input` starting at `lba`, [`PIECE`] bytes at a time.
/// A regular file's length is checked against the namespace before anything is written, and
/// it must keep that length until the end; any other input (a pipe) is written as it arrives,
/// each piece checked before it is written, so a length that turns out not to be whole LBAs
/// or to run past the end fails after the pieces before it.
pub fn write(ctrl: &Controller, nsid: u32, lba: u64, input: &Path, as_json: bool) -> Result<()> {
    let reading = || format!("reading {}", input.display());
    let mut file = std::fs::File::open(input).with_context(reading)?;
    let meta = file.metadata().with_context(reading)?;
    let known = meta.is_file().then_some(meta.len());
    let ns = match known {
        Some(len) => check_range(ctrl, nsid, lba, len)?.0,
        None => ctrl.namespace(nsid)?.clone(),
    };
    let lba_size = ns.lba_size as u64;
    let piece = piece_bytes(lba_size);
    let mut buf = vec![0u8; known.map_or(piece, |len| len.min(piece)).max(1) as usize];
    let mut qp = ctrl.create_io_queue_pair(64)?;
    let mut done = 0u64;
    loop {
        let n = fill_from(&mut file, &mut buf).with_context(reading)? as u64;
        if n == 0 {
            break;
        }
        if let Some(len) = known
            && done + n > len
        {
            bail!(
                "{} grew while being written (from {len} bytes); the first {done} bytes are \
                 written",
                input.display()
            );
        }
        // A piece is whole LBAs unless it is the input's last.
        check_range(ctrl, nsid, lba + done / lba_size, n)?;
        qp.write_from(nsid, lba + done / lba_size, &buf[..n as usize])?;
        done += n;
    }
    if done == 0 {
        bail!("nothing to transfer: the length is 0 bytes");
    }
    if let Some(len) = known
        && done != len
    {
        bail!(
            "{} shrank while being written (from {len} bytes to {done}); the first {done} bytes \
             are written",
            input.display()
        );
    }
    qp.flush(nsid)?;
    let report = RawIoReport {
        op: "write",
        nsid,
        lba,
        blocks: done / lba_size,
        bytes: done,
        output: None,
    };
    print(&report, as_json)
}

fn print(report: &RawIoReport, as_json: bool) -> Result<()> {
    if as_json {
        outln!("{}", serde_json::to_string(report)?);
    } else {
        outln!("{report}");
    }
    Ok(())
}

/// Opens a regular-file destination of `read` as `fs get` does ([`StagedFile`]: written under
/// a temporary name beside it and renamed over it only when every byte is there and synced);
/// other destinations (`/dev/null`, a FIFO) are written in place.
fn stage(dst: &Path) -> Result<StagedFile> {
    // Through a symbolic link: the file it names is the one replaced, not the link.
    let resolved = std::fs::symlink_metadata(dst)
        .is_ok_and(|m| m.file_type().is_symlink())
        .then(|| std::fs::canonicalize(dst).ok())
        .flatten();
    let dst = resolved.as_deref().unwrap_or(dst);
    StagedFile::create(dst, "read").map_err(|e| staging_error(e, dst))
}

/// `e` from [`StagedFile`] as `read` words it: every failure names the destination `dst`.
fn staging_error(e: CopyError, dst: &Path) -> anyhow::Error {
    match e {
        CopyError::IsDirectory(_) => anyhow!("{} is a directory", dst.display()),
        CopyError::NoFileName(_) => anyhow!("{} names no file", dst.display()),
        CopyError::Host { op, source, .. } => {
            anyhow::Error::new(source).context(format!("{op} {}", dst.display()))
        }
        other => other.into(),
    }
}

/// `gpunvme read`: reads `bytes` starting at `lba` into `output` (`-`: standard output),
/// [`PIECE`] bytes at a time, so any length runs in bounded memory. A regular-file output
/// takes its name only once complete ([`stage`]).
pub fn read(
    ctrl: &Controller,
    nsid: u32,
    lba: u64,
    bytes: u64,
    output: &Path,
    as_json: bool,
) -> Result<()> {
    let (ns, blocks) = check_range(ctrl, nsid, lba, bytes)?;
    let lba_size = ns.lba_size as u64;
    let piece = piece_bytes(lba_size);
    let mut qp = ctrl.create_io_queue_pair(64)?;
    let mut buf = vec![0u8; bytes.min(piece) as usize];
    let to_stdout = output == Path::new("-");
    let staged = if to_stdout {
        None
    } else {
        Some(stage(output)?)
    };
    let mut stdout = std::io::stdout().lock();
    let mut done = 0u64;
    while done < bytes {
        let n = (bytes - done).min(piece) as usize;
        qp.read_to(nsid, lba + done / lba_size, &mut buf[..n])?;
        match &staged {
            Some(s) => (&s.file)
                .write_all(&buf[..n])
                .with_context(|| format!("writing {}", output.display()))?,
            None => stdout
                .write_all(&buf[..n])
                .map_err(crate::cli::StdoutError)?,
        }
        done += n as u64;
    }
    match staged {
        Some(s) => {
            let dst = s.path().to_owned();
            s.commit(false).map_err(|e| staging_error(e, &dst))?;
        }
        None => {
            stdout.flush().map_err(crate::cli::StdoutError)?;
            return Ok(());
        }
    }
    drop(stdout);
    let report = RawIoReport {
        op: "read",
        nsid,
        lba,
        blocks,
        bytes,
        output: Some(output.display().to_string()),
    };
    print(&report, as_json)
}
