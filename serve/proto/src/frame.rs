//! Framing: a [`Header`] then a JSON body, one datagram each. The header is checked field by
//! field ([`Frame::decode`]) before the body is parsed, and the body's message must be of the
//! kind the header says, with exactly the descriptors that kind carries.

use zerocopy::byteorder::little_endian::{U16, U32};
use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

use crate::error::ProtoError;
use crate::limits::{HEADER_LEN, MAGIC, MAX_BODY, MAX_FRAME, PROTOCOL_VERSION};
use crate::msg::Message;

/// A frame's header, little-endian on the wire.
#[derive(Clone, Copy, Debug, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout)]
#[repr(C)]
pub struct Header {
    /// [`MAGIC`].
    pub magic: [u8; 4],
    /// [`PROTOCOL_VERSION`] of the sender.
    pub version: U16,
    /// The message's kind ([`Message::kind`]).
    pub kind: U16,
    /// Chosen by the client for a request; a reply carries its request's id; events carry 0.
    pub request_id: U32,
    /// Bytes of body after the header.
    pub body_len: U32,
}

const _: () = assert!(size_of::<Header>() == HEADER_LEN);

/// One message with its request id.
#[derive(Clone, Debug, PartialEq)]
pub struct Frame {
    /// The request id ([`Header::request_id`]).
    pub request_id: u32,
    /// The message.
    pub message: Message,
}

impl Frame {
    /// The frame's bytes: header and body. Fails only where the message is outside its own
    /// limits ([`Message::check`]) or its body exceeds [`MAX_BODY`], so nothing sent is one
    /// the peer would refuse for its shape.
    pub fn encode(&self) -> Result<Vec<u8>, ProtoError> {
        self.message.check()?;
        let kind = self.message.kind();
        let body = serde_json::to_vec(&self.message).map_err(|e| ProtoError::Body {
            kind: kind.name(),
            why: e.to_string(),
        })?;
        if body.len() > MAX_BODY {
            return Err(ProtoError::TooLarge(HEADER_LEN + body.len()));
        }
        let header = Header {
            magic: MAGIC,
            version: PROTOCOL_VERSION.into(),
            kind: kind.code().into(),
            request_id: self.request_id.into(),
            body_len: U32::new(body.len() as u32),
        };
        let mut out = Vec::with_capacity(HEADER_LEN + body.len());
        out.extend_from_slice(header.as_bytes());
        out.extend_from_slice(&body);
        Ok(out)
    }

    /// Reads just the header of `bytes`: magic and version checked, so a peer of another
    /// version can be told so by its request id before the body is looked at.
    pub fn header(bytes: &[u8]) -> Result<Header, ProtoError> {
        let (header, _) =
            Header::read_from_prefix(bytes).map_err(|_| ProtoError::Truncated(bytes.len()))?;
        if header.magic != MAGIC {
            return Err(ProtoError::BadMagic(header.magic));
        }
        if header.version.get() != PROTOCOL_VERSION {
            return Err(ProtoError::Version {
                got: header.version.get(),
                want: PROTOCOL_VERSION,
            });
        }
        Ok(header)
    }

    /// Decodes one datagram of `bytes` that came with `fds` descriptors: header, then the body
    /// as the header's kind, then the message's own limits and its descriptor count.
    pub fn decode(bytes: &[u8], fds: usize) -> Result<Self, ProtoError> {
        if bytes.len() > MAX_FRAME {
            return Err(ProtoError::TooLarge(bytes.len()));
        }
        let header = Self::header(bytes)?;
        let body = &bytes[HEADER_LEN..];
        if header.body_len.get() as usize != body.len() {
            return Err(ProtoError::BodyLength {
                declared: header.body_len.get(),
                actual: body.len(),
            });
        }
        let kind = crate::msg::Kind::from_code(header.kind.get())
            .ok_or(ProtoError::UnknownKind(header.kind.get()))?;
        let message: Message = serde_json::from_slice(body).map_err(|e| ProtoError::Body {
            kind: kind.name(),
            why: e.to_string(),
        })?;
        if message.kind() != kind {
            return Err(ProtoError::Body {
                kind: kind.name(),
                why: format!("the body is a {} message", message.kind().name()),
            });
        }
        message.check()?;
        let want = message.descriptors();
        if fds != want {
            return Err(ProtoError::Descriptors {
                kind: kind.name(),
                want,
                got: fds,
            });
        }
        Ok(Self {
            request_id: header.request_id.get(),
            message,
        })
    }
}
