//! `gpunvme image create PATH --size SIZE`: a sparse image file for the software controller.

use std::path::PathBuf;

use anyhow::Result;
use clap::Subcommand;
use gpunvme::image::{self, CreateImage};

/// `gpunvme image ...`.
#[derive(Subcommand, Debug)]
pub enum ImageCommand {
    /// Make a sparse image file of a given size for the software controller (refuses an
    /// existing file without --force). Use it with `--device PATH` and the same --lba-size.
    Create {
        /// The image file to make.
        path: PathBuf,
        /// Its size: bytes, or with a binary suffix (64M, 4G, 1T); a whole number of LBAs.
        #[arg(long, value_parser = image::parse_size_arg)]
        size: u64,
        /// Replace an existing file, discarding its contents (refused while in use).
        #[arg(long)]
        force: bool,
    },
}

/// Runs `cmd` (no device is opened: the image is the argument).
pub fn run(cmd: ImageCommand, lba_size: u32, json: bool) -> Result<()> {
    match cmd {
        ImageCommand::Create { path, size, force } => {
            let want = CreateImage {
                bytes: size,
                lba_size,
                force,
            };
            let report = image::create(&path, &want)
                .map_err(|e| image::ImageExists::explain(e, "add --force to do so"))?;
            if json {
                outln!("{}", serde_json::to_string(&report)?);
            } else {
                outln!("{report}");
            }
            Ok(())
        }
    }
}
