//! Helpers shared by the CLI test crates: run the `gpunvme` binary and read its outcome.
// Each test crate compiles this module on its own and uses a different part of it.
#![allow(dead_code)]

use std::path::Path;
use std::process::{Command, Output};

/// A `gpunvme` command, not started yet.
pub fn bin() -> Command {
    Command::new(env!("CARGO_BIN_EXE_gpunvme"))
}

/// Runs `gpunvme` in `dir` with a command line split at whitespace.
pub fn gpunvme(dir: &Path, cmdline: &str) -> Output {
    bin()
        .current_dir(dir)
        .args(cmdline.split_whitespace())
        .output()
        .expect("run gpunvme")
}

/// The stdout of a command that must have succeeded.
pub fn ok(out: &Output) -> String {
    assert!(
        out.status.success(),
        "gpunvme failed: {}",
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8(out.stdout.clone()).unwrap()
}
