//! The table is the one place: every library reads the environment only through it, and
//! `docs/settings.md` is the table as `gpunvme_settings::markdown` writes it.

use std::path::{Path, PathBuf};

fn root() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join("..")
}

/// The source files of the library crates (not their tests, benches, examples or build
/// scripts, and not the binaries and bindings, which may read variables of their own).
fn library_sources() -> Vec<PathBuf> {
    let crates = [
        "gpunvme",
        "nvme/spec",
        "nvme",
        "nvme/emu",
        "vfio",
        "gpu-queues",
        "gpu-queues/emu",
        "blockfs",
        "blockfs/gpu",
        "gpu-cache",
    ];
    let mut out = Vec::new();
    for c in crates {
        let mut stack = vec![root().join(c).join("src")];
        while let Some(d) = stack.pop() {
            for e in std::fs::read_dir(&d).unwrap_or_else(|e| panic!("{}: {e}", d.display())) {
                let p = e.unwrap().path();
                if p.is_dir() {
                    stack.push(p);
                } else if p.extension().is_some_and(|x| x == "rs") {
                    out.push(p);
                }
            }
        }
    }
    assert!(out.len() > 50, "found only {} library sources", out.len());
    out
}

#[test]
fn libraries_read_the_environment_only_through_the_table() {
    // Reads that are not settings, each for its reason.
    let allowed = [
        // CUDA's own variable, set to EAGER before the driver starts unless the user set it.
        (
            "gpu-queues/src/ffi/cuda.rs",
            "std::env::var_os(\"CUDA_MODULE_LOADING\")",
        ),
    ];
    let mut bad = Vec::new();
    for p in library_sources() {
        let text = std::fs::read_to_string(&p).unwrap();
        // Unit tests at the end of a file may set and read what they like.
        let code = text.split("#[cfg(test)]").next().unwrap();
        let rel = p
            .strip_prefix(root())
            .unwrap()
            .to_string_lossy()
            .replace('\\', "/");
        for (n, line) in code.lines().enumerate() {
            let l = line.trim_start();
            if l.starts_with("//") {
                continue;
            }
            if ["env::var(", "env::var_os(", "env::vars(", "env::vars_os("]
                .iter()
                .any(|r| l.contains(r))
                && !allowed
                    .iter()
                    .any(|(f, what)| rel == *f && l.contains(what))
            {
                bad.push(format!("{rel}:{}: {l}", n + 1));
            }
        }
    }
    assert!(
        bad.is_empty(),
        "environment read outside gpunvme_settings (declare it in settings/src/lib.rs and read \
         it with Setting::value):\n{}",
        bad.join("\n")
    );
}

#[test]
fn the_host_gpu_harness_reads_only_variables_of_the_table() {
    // The C++ harness (ptx/host/) reads its variables with getenv through env_unsigned.
    let names: Vec<&str> = gpunvme_settings::ALL.iter().map(|s| s.name).collect();
    let mut found = 0;
    for e in std::fs::read_dir(root().join("ptx/host")).unwrap() {
        let p = e.unwrap().path();
        let text = std::fs::read_to_string(&p).unwrap_or_default();
        for (i, _) in text.match_indices("getenv(") {
            let rest = &text[i..];
            let line = rest.lines().next().unwrap();
            assert!(
                line.contains("getenv(name)"),
                "{}: getenv outside env_unsigned: {line}",
                p.display()
            );
        }
        for (i, _) in text.match_indices("env_unsigned(\"") {
            let name: String = text[i + 14..].chars().take_while(|&c| c != '"').collect();
            assert!(
                names.contains(&name.as_str()),
                "{}: {name} is not in the table",
                p.display()
            );
            found += 1;
        }
    }
    assert!(found >= 3, "found {found} harness variables");
}

#[test]
fn docs_settings_md_is_the_table() {
    let path = root().join("docs/settings.md");
    let want = gpunvme_settings::markdown();
    let have = std::fs::read_to_string(&path).unwrap_or_default();
    if have != want && std::env::var_os("GPUNVME_BLESS").is_some() {
        std::fs::write(&path, &want).unwrap();
        return;
    }
    assert!(
        have == want,
        "docs/settings.md is not the table in settings/src/lib.rs: rerun this test with \
         GPUNVME_BLESS=1 to write it"
    );
}

#[test]
fn every_setting_named_in_the_docs_is_in_the_table() {
    // A variable the docs or scripts tell users to set must be one the libraries read (or one
    // of the scripts' and CLI's own, which say so where they are used).
    let mut text = String::new();
    for f in [
        "README.md",
        "docs/gpu.md",
        "docs/python.md",
        "docs/cli.md",
        "docs/architecture.md",
    ] {
        text += &std::fs::read_to_string(root().join(f)).unwrap_or_default();
    }
    let names: Vec<&str> = gpunvme_settings::ALL.iter().map(|s| s.name).collect();
    let mut unknown = Vec::new();
    for (i, _) in text
        .match_indices("GPUNVME_EMU_")
        .chain(text.match_indices("GPUNVME_FILE_"))
    {
        let word: String = text[i..]
            .chars()
            .take_while(|c| c.is_ascii_uppercase() || c.is_ascii_digit() || *c == '_')
            .collect();
        if !names.contains(&word.as_str()) && !unknown.contains(&word) {
            unknown.push(word);
        }
    }
    assert!(
        unknown.is_empty(),
        "settings the docs name that no library reads: {unknown:?}"
    );
}
