//! The VFIO transport on a real device: QEMU's NVMe controller behind an emulated Intel IOMMU
//! (and, separately, in no-IOMMU mode), driven by `examples/vfio_probe.rs` inside a guest booted
//! by `scripts/qemu-run.sh`.
//!
//! Ignored by default (it builds release binaries and boots QEMU under TCG, about 10 s a boot);
//! run with `GPUNVME_QEMU_TESTS=1 cargo test -p vfio --test qemu -- --ignored`.

use std::path::{Path, PathBuf};
use std::process::Command;

fn repo() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// Builds the probe, boots a guest with `harness_args`, runs `script` in it; returns the
/// console output, or `None` when the tests are not enabled.
fn in_guest(harness_args: &[&str], script: &str) -> Option<String> {
    if std::env::var_os("GPUNVME_QEMU_TESTS").is_none() {
        eprintln!("skipped: set GPUNVME_QEMU_TESTS=1 to boot QEMU");
        return None;
    }
    let st = Command::new(env!("CARGO"))
        .args(["build", "--release", "-p", "vfio", "--examples"])
        .current_dir(repo())
        .status()
        .unwrap();
    assert!(st.success(), "building the probe failed");
    let out = Command::new("bash")
        .arg(repo().join("scripts/qemu-run.sh"))
        .args(["--no-build", "--timeout", "300"])
        .args(harness_args)
        .arg("--")
        .arg(script)
        .current_dir(repo())
        .output()
        .unwrap();
    let text = format!(
        "{}{}",
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(
        out.status.success(),
        "guest run failed ({}):\n{text}",
        out.status
    );
    Some(text)
}

/// Every check prints `CHECK <name> ok` only when its own condition held; the host looks for
/// each line, so a check that did not run counts as failed.
const CHECKS: &str = r#"
. /usr/share/gpunvme/lib.sh
P=/opt/gpunvme/examples/vfio_probe
B=$(gn_nvme_bdfs)
check() { if eval "$2"; then echo "CHECK $1 ok"; else echo "CHECK $1 FAILED"; fi; }
out=$($P $B --identify 2>&1); echo "$out"
check identify 'echo "$out" | grep -q "identify.mn: QEMU NVMe Ctrl" && echo "$out" | grep -q "identify.sn: gpunvme-0"'
check dma_freed 'echo "$out" | grep -q "dma_stats_after_drop: DmaStats { chunks: 0, mapped_bytes: 0"'
echo 16 > /proc/sys/vm/nr_hugepages
out=$($P $B --identify --open-twice 2>&1); echo "$out"
check hugepages 'echo "$out" | grep -q "hugepage_bytes: 6291456"'
check second_open_busy 'echo "$out" | grep -q "second_open_error: /dev/vfio/.* is busy"'
check hugepage_identify 'echo "$out" | grep -q "probe: ok"'
out=$($P 0000:00:00.0 2>&1); rc=$?; echo "$out"
check not_nvme '[ $rc = 1 ] && [ "$out" = "error: 0000:00:00.0 is not an NVMe controller (class 0x060000)" ]'
out=$($P 00:1f.9 2>&1); rc=$?; echo "$out"
check malformed '[ $rc = 1 ] && echo "$out" | grep -q "is not a PCI address (function must be 0-7)"'
gn_bind $B nvme
out=$($P $B 2>&1); rc=$?; echo "$out"
check bound_to_nvme '[ $rc = 1 ] && [ "$out" = "error: $B is bound to \`nvme\`, not vfio-pci: run scripts/setup.sh bind $B" ]'
"#;

fn assert_checks(console: &str, names: &[&str]) {
    for name in names {
        assert!(
            console.contains(&format!("CHECK {name} ok")),
            "check {name} failed:\n{console}"
        );
    }
}

#[test]
#[ignore = "boots QEMU; set GPUNVME_QEMU_TESTS=1 and run with --ignored"]
fn type1_iommu() {
    let Some(console) = in_guest(&[], CHECKS) else {
        return;
    };
    assert_checks(
        &console,
        &[
            "identify",
            "dma_freed",
            "hugepages",
            "second_open_busy",
            "hugepage_identify",
            "not_nvme",
            "malformed",
            "bound_to_nvme",
        ],
    );
    let ext = in_guest(&[], r#"/opt/gpunvme/examples/vfio_probe $(. /usr/share/gpunvme/lib.sh; gn_nvme_bdfs) --identify --external"#)
        .unwrap();
    assert!(ext.contains("external_mapping: ExternalMapping"), "{ext}");
    assert!(ext.contains("identify.mn: QEMU NVMe Ctrl"), "{ext}");
}

#[test]
#[ignore = "boots QEMU (and builds a no-IOMMU vfio.ko once); set GPUNVME_QEMU_TESTS=1 and run with --ignored"]
fn no_iommu() {
    let Some(console) = in_guest(&["--noiommu"], CHECKS) else {
        return;
    };
    assert!(
        console.contains("device: vfio") && console.contains("(no-IOMMU)"),
        "{console}"
    );
    assert_checks(
        &console,
        &[
            "identify",
            "dma_freed",
            "hugepages",
            "second_open_busy",
            "not_nvme",
            "malformed",
            "bound_to_nvme",
        ],
    );
}
