//! The control protocol of `gpunvme serve`: how a client process asks the daemon that owns a
//! controller for queue pairs and memory, and how the daemon answers.
//!
//! Nothing here crosses the socket per I/O command: a client gets queue pairs whose rings and
//! data arenas are memory the daemon allocated and passes as file descriptors, and drives them
//! itself. This crate is the part both sides share:
//! - [`frame`]: a message on the wire, a 16-byte [`frame::Header`] (`GNVS`, version, kind,
//!   request id, body length) and a JSON body, every field checked before it is believed;
//! - [`limits`] and [`error`]: the version and sizes every frame is held to, and why one was
//!   refused;
//! - [`layout`]: where a queue pair's rings, PRP lists and slots sit in an arena;
//! - [`msg`]: the messages, their limits, and the descriptors each one carries;
//! - [`socket`]: one message per `SOCK_SEQPACKET` datagram, descriptors by `SCM_RIGHTS`, every
//!   wait bounded, a truncated datagram or a surplus descriptor refused by name.
//!
//! A peer of another protocol version gets one refusal and the connection ends. The decoder
//! never panics on any input (a test feeds it random and mutated frames; `fuzz/` has a
//! cargo-fuzz target).
#![forbid(unsafe_code)]

pub mod error;
pub mod frame;
pub mod layout;
pub mod limits;
pub mod msg;
pub mod socket;

pub use error::ProtoError;

/// An error and its sources on one line, `error: source: source's source` (the errors here
/// do not repeat their source in their own message), for logs and refusals that carry words.
pub fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(c) = next {
        s.push_str(": ");
        s.push_str(&c.to_string());
        next = c.source();
    }
    s
}
pub use frame::{Frame, Header};
pub use limits::PROTOCOL_VERSION;
pub use msg::{Event, Message, Reply, Request};
