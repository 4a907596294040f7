//! `gpunvme fs`: placeholder until the blockfs helper lands its module.
use anyhow::Result;
use nvme::Controller;

/// blockfs commands.
#[derive(clap::Subcommand, Debug)]
pub enum FsCommand {
    /// Not yet available.
    Mkfs,
}

/// Runs a blockfs command.
pub fn run(_ctrl: &Controller, _nsid: u32, _cmd: FsCommand, _json: bool) -> Result<()> {
    anyhow::bail!("blockfs commands are not available yet")
}
