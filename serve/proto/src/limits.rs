//! The protocol's version and the sizes every frame is held to, shared by the framing, the
//! messages' own checks and the socket.

/// The four bytes every frame starts with.
pub const MAGIC: [u8; 4] = *b"GNVS";

/// The protocol version this crate speaks. A peer of another version gets one
/// [`crate::Reply::Refused`] naming both versions, and the connection ends.
pub const PROTOCOL_VERSION: u16 = 1;

/// The largest body accepted (the control plane carries names, ids and small tables; a
/// namespace's Identify data is 4 KiB).
pub const MAX_BODY: usize = 64 << 10;

/// The largest frame: header and body.
pub const MAX_FRAME: usize = HEADER_LEN + MAX_BODY;

/// Bytes in a [`crate::Header`].
pub const HEADER_LEN: usize = 16;

/// The most descriptors one frame carries.
pub const MAX_FDS: usize = 4;
