//! Why a frame or a message was refused ([`ProtoError`]).

use crate::limits::MAX_FRAME;

/// Why a frame was refused. Each names what was wrong with the numbers involved.
#[derive(Debug, thiserror::Error, PartialEq, Eq)]
pub enum ProtoError {
    /// Fewer bytes than a header.
    #[error("a frame of {0} bytes is shorter than its 16-byte header")]
    Truncated(usize),
    /// Not a gpunvme serve frame.
    #[error("not a gpunvme serve frame (magic {0:02x?}, want \"GNVS\")")]
    BadMagic([u8; 4]),
    /// The peer speaks another version.
    #[error("protocol version {got}, this side speaks {want}")]
    Version {
        /// The peer's.
        got: u16,
        /// Ours.
        want: u16,
    },
    /// The header's body length is not the datagram's.
    #[error("the header declares a {declared}-byte body, the frame carries {actual}")]
    BodyLength {
        /// From the header.
        declared: u32,
        /// In the datagram.
        actual: usize,
    },
    /// Larger than [`MAX_FRAME`] (or a datagram cut at the receive buffer).
    #[error("a frame of {0} bytes or more is larger than the {MAX_FRAME}-byte limit")]
    TooLarge(usize),
    /// A kind number no message has.
    #[error("unknown message kind {0}")]
    UnknownKind(u16),
    /// The body is not the message its kind says, or a field is out of its limits.
    #[error("malformed {kind} body: {why}")]
    Body {
        /// The kind's name.
        kind: &'static str,
        /// What was wrong.
        why: String,
    },
    /// Descriptors other than the message carries.
    #[error("{kind} carries {want} descriptor(s), the frame had {got}")]
    Descriptors {
        /// The kind's name.
        kind: &'static str,
        /// How many the message carries.
        want: usize,
        /// How many came.
        got: usize,
    },
}
