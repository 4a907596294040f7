//! Mounts arbitrary bytes as a blockfs image (512-byte LBAs), reads every file, runs fsck with
//! repair: nothing may panic. Seed corpus: `blockfs/tests/corpus/` (replayed by
//! `cargo test -p blockfs --test corpus`).
//!
//! `cargo fuzz run mount ../tests/corpus -- -max_len=262144`
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let _ = blockfs::fuzzing::exercise_image(data);
});
