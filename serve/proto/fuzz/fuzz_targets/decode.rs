//! `Frame::decode` on arbitrary datagrams: the first byte picks how many descriptors came with
//! it (0 to 5), the rest is the datagram. Nothing may panic, and a frame that is accepted
//! re-encodes (within the frame limit) to bytes that decode to the same frame with the same
//! descriptor count. `tests/frames.rs` runs a seeded loop of the same property in CI.
//!
//! `cargo +nightly fuzz run decode -- -max_len=65600`
#![no_main]

use gpunvme_serve_proto::Frame;
use gpunvme_serve_proto::limits::MAX_FRAME;
use libfuzzer_sys::fuzz_target;

fuzz_target!(|data: &[u8]| {
    let Some((&first, bytes)) = data.split_first() else {
        return;
    };
    let fds = usize::from(first % 6);
    if let Ok(frame) = Frame::decode(bytes, fds) {
        assert_eq!(frame.message.descriptors(), fds);
        let again = frame.encode().expect("an accepted frame re-encodes");
        assert!(again.len() <= MAX_FRAME);
        assert_eq!(Frame::decode(&again, fds), Ok(frame));
    }
});
