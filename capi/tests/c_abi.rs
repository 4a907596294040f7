//! The C ABI from C (issue 53): builds libgpunvme (`cargo build -p gpunvme_capi`, the profile
//! of this test), compiles `capi/tests/abi.c` against `include/gpunvme.h` with `-Werror`, and
//! runs it on a fresh 64 MiB image: error names of codes out of range, double closes, junk and
//! wrong-kind handles, a read-only handle's refusals, destructive calls without `force`; where
//! it may mount a small tmpfs, a put that fills the host file system is `GPUNVME_ERROR_NO_SPACE`.
//! `scripts/c-test.sh` runs the same program.

use std::path::{Path, PathBuf};
use std::process::Command;

fn target_dir(crate_dir: &Path) -> PathBuf {
    std::env::var_os("CARGO_TARGET_DIR")
        .map(PathBuf::from)
        .unwrap_or_else(|| crate_dir.join("../target"))
}

#[test]
fn misuse_from_c_is_an_error_code_never_a_crash() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let Some(cc) = ["cc", "gcc", "clang"].into_iter().find(|c| {
        Command::new(c)
            .arg("--version")
            .output()
            .is_ok_and(|o| o.status.success())
    }) else {
        eprintln!("no C compiler (cc, gcc, clang): skipped");
        return;
    };
    let release = !cfg!(debug_assertions);
    let cargo = std::env::var_os("CARGO").unwrap_or_else(|| "cargo".into());
    let mut build = Command::new(cargo);
    build
        .args(["build", "-q", "-p", "gpunvme_capi"])
        .current_dir(crate_dir);
    if release {
        build.arg("--release");
    }
    let status = build.status().expect("running cargo build");
    assert!(status.success(), "cargo build -p gpunvme_capi failed");
    let lib = target_dir(crate_dir).join(if release { "release" } else { "debug" });
    let work = tempfile::tempdir().expect("a temporary directory");
    let exe = work.path().join("abi");
    let out = Command::new(cc)
        .args([
            "-std=c11",
            "-D_DEFAULT_SOURCE",
            "-Wall",
            "-Wextra",
            "-Werror",
        ])
        .arg(crate_dir.join("tests/abi.c"))
        .arg(format!("-I{}", crate_dir.join("../include").display()))
        .arg(format!("-L{}", lib.display()))
        .arg(format!("-Wl,-rpath,{}", lib.display()))
        .arg("-lgpunvme")
        .arg("-o")
        .arg(&exe)
        .output()
        .expect("running the C compiler");
    assert!(
        out.status.success(),
        "compiling abi.c failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let image = work.path().join("c.img");
    std::fs::File::create(&image)
        .and_then(|f| f.set_len(64 << 20))
        .expect("an image");
    // A small tmpfs for the no-space checks, where this process may mount one (root).
    let mnt = work.path().join("small");
    std::fs::create_dir(&mnt).expect("a mount point");
    let mounted = Command::new("mount")
        .args(["-t", "tmpfs", "-o", "size=8m", "tmpfs"])
        .arg(&mnt)
        .output()
        .is_ok_and(|o| o.status.success());
    let mut cmd = Command::new(&exe);
    cmd.arg(&image).current_dir(work.path());
    if mounted {
        let full = mnt.join("full.img");
        std::fs::File::create(&full)
            .and_then(|f| f.set_len(64 << 20))
            .expect("an image on the tmpfs");
        cmd.arg(&full);
    } else {
        eprintln!("no-space checks skipped: cannot mount a tmpfs here (needs root)");
    }
    let run = cmd.output();
    if mounted {
        let _ = Command::new("umount").arg(&mnt).status();
    }
    let run = run.expect("running abi");
    let stdout = String::from_utf8_lossy(&run.stdout);
    let stderr = String::from_utf8_lossy(&run.stderr);
    assert!(
        run.status.success() && stdout.contains("c abi: OK"),
        "abi exited {:?}\n--- stdout\n{stdout}\n--- stderr\n{stderr}",
        run.status
    );
}
