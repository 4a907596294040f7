//! include/gpunvme.h is what cbindgen makes of capi/src/lib.rs today (GPUNVME_BLESS=1
//! rewrites it).

use std::path::Path;

#[test]
fn the_committed_header_is_fresh() {
    let crate_dir = Path::new(env!("CARGO_MANIFEST_DIR"));
    let config = cbindgen::Config::from_file(crate_dir.join("cbindgen.toml")).expect("config");
    let mut fresh = Vec::new();
    cbindgen::Builder::new()
        .with_crate(crate_dir)
        .with_config(config)
        .generate()
        .expect("cbindgen")
        .write(&mut fresh);
    let path = crate_dir.join("../include/gpunvme.h");
    if std::env::var_os("GPUNVME_BLESS").is_some() {
        std::fs::write(&path, &fresh).expect("writing the header");
    }
    let committed = std::fs::read(&path).unwrap_or_default();
    assert!(
        committed == fresh,
        "include/gpunvme.h is stale: run `GPUNVME_BLESS=1 cargo test -p gpunvme_capi --test header`"
    );
}
