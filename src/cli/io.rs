//! `gpunvme read` and `gpunvme write`: raw namespace I/O between files and LBAs.
//!
//! Every argument is checked against the namespace before any command is sent, so a bad request
//! leaves the device untouched.

use std::io::Write as _;
use std::path::Path;

use anyhow::{Context, Result, bail};
use gpunvme::report::RawIoReport;
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

/// `gpunvme write`: writes the whole of `input` starting at `lba`.
pub fn write(ctrl: &Controller, nsid: u32, lba: u64, input: &Path, as_json: bool) -> Result<()> {
    let data = std::fs::read(input).with_context(|| format!("reading {}", input.display()))?;
    let (_, blocks) = check_range(ctrl, nsid, lba, data.len() as u64)?;
    let mut qp = ctrl.create_io_queue_pair(64)?;
    qp.write_from(nsid, lba, &data)?;
    qp.flush(nsid)?;
    let report = RawIoReport {
        op: "write",
        nsid,
        lba,
        blocks,
        bytes: data.len() as u64,
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

/// `gpunvme read`: reads `bytes` starting at `lba` into `output` (`-`: standard output).
pub fn read(
    ctrl: &Controller,
    nsid: u32,
    lba: u64,
    bytes: u64,
    output: &Path,
    as_json: bool,
) -> Result<()> {
    let (_, blocks) = check_range(ctrl, nsid, lba, bytes)?;
    let len = usize::try_from(bytes).context("--bytes is too large for this machine")?;
    let mut data = vec![0u8; len];
    let mut qp = ctrl.create_io_queue_pair(64)?;
    qp.read_to(nsid, lba, &mut data)?;
    if output == Path::new("-") {
        let mut out = std::io::stdout().lock();
        out.write_all(&data)
            .and_then(|()| out.flush())
            .map_err(crate::cli::StdoutError)?;
        return Ok(());
    }
    std::fs::write(output, &data).with_context(|| format!("writing {}", output.display()))?;
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
