//! Helpers shared by the CLI test crates: run the `gpunvme` binary and read its outcome.
// Each test crate compiles this module on its own and uses a different part of it.
#![allow(dead_code)]

use std::path::{Path, PathBuf};
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

/// The one `gpunvme: error:` line of a command that must have failed (exit status 1).
pub fn error_line(out: &Output) -> String {
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(!out.status.success(), "expected failure: {err}");
    assert_eq!(out.status.code(), Some(1), "exit status: {err}");
    let errors: Vec<_> = err
        .lines()
        .filter(|l| l.starts_with("gpunvme: error:"))
        .collect();
    assert_eq!(errors.len(), 1, "one error line expected: {err:?}");
    errors[0].to_string()
}

/// A sparse image file `name` of `bytes` bytes in `dir`.
pub fn image_file(dir: &Path, name: &str, bytes: u64) -> PathBuf {
    let p = dir.join(name);
    std::fs::File::create(&p).unwrap().set_len(bytes).unwrap();
    p
}

/// Bytes that differ from their neighbours and from other seeds.
pub fn pattern(len: usize, seed: u32) -> Vec<u8> {
    (0..len as u32)
        .map(|i| {
            (i.wrapping_add(seed.wrapping_mul(0x9e37_79b9))
                .wrapping_mul(2_654_435_761)
                >> 24) as u8
        })
        .collect()
}
