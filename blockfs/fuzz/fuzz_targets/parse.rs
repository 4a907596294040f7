//! The metadata decoders on arbitrary bytes with no checksum in the way (superblock, root run,
//! file-table chunk): nothing may panic.
#![no_main]

use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    blockfs::fuzzing::exercise_parsers(data);
});
