//! One frame per `SOCK_SEQPACKET` datagram, descriptors by `SCM_RIGHTS`, every wait bounded.
//!
//! A datagram cut by the receive buffer (`MSG_TRUNC`) or descriptors cut by the control buffer
//! (`MSG_CTRUNC`) is refused, never half-believed; descriptors that came with a refused frame
//! are closed (they are [`OwnedFd`]s dropped with the error). A peer that stops reading makes
//! [`Channel::send`] time out; it is never waited on for longer than the channel's bound.

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{AsFd, BorrowedFd, OwnedFd};
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::io::Errno;
use rustix::net::{
    AddressFamily, RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, ReturnFlags,
    SendAncillaryBuffer, SendAncillaryMessage, SendFlags, SocketFlags, SocketType,
};

use crate::error::ProtoError;
use crate::frame::Frame;
use crate::limits::{MAX_FDS, MAX_FRAME};

/// Why a transfer failed.
#[derive(Debug, thiserror::Error)]
pub enum SocketError {
    /// The wait ran out.
    #[error("{doing} timed out after {after:?}")]
    Timeout {
        /// What was waited for.
        doing: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The peer closed the connection (or died).
    #[error("the peer closed the connection")]
    Closed,
    /// A system call failed.
    #[error("{doing}")]
    Io {
        /// What was done.
        doing: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// The frame was refused.
    #[error(transparent)]
    Proto(#[from] ProtoError),
}

/// One end of a connection.
#[derive(Debug)]
pub struct Channel {
    fd: OwnedFd,
    bound: Duration,
}

fn io(doing: &'static str, e: Errno) -> SocketError {
    SocketError::Io {
        doing,
        source: e.into(),
    }
}

impl Channel {
    /// A channel over a connected `SOCK_SEQPACKET` Unix socket, each wait bounded by `bound`.
    pub fn new(fd: OwnedFd, bound: Duration) -> Self {
        Self { fd, bound }
    }

    /// Two connected channels (tests, and a daemon's in-process clients).
    pub fn pair(bound: Duration) -> Result<(Self, Self), SocketError> {
        let (a, b) = rustix::net::socketpair(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(|e| io("creating a socket pair", e))?;
        Ok((Self::new(a, bound), Self::new(b, bound)))
    }

    /// The socket.
    pub fn fd(&self) -> BorrowedFd<'_> {
        self.fd.as_fd()
    }

    /// Waits until `deadline` for `flags` on the socket; `Closed` on a hang-up without data.
    fn wait(
        &self,
        flags: PollFlags,
        doing: &'static str,
        deadline: Instant,
    ) -> Result<(), SocketError> {
        loop {
            let left = deadline.saturating_duration_since(Instant::now());
            if left.is_zero() {
                return Err(SocketError::Timeout {
                    doing,
                    after: self.bound,
                });
            }
            let ts = Timespec {
                tv_sec: left.as_secs() as i64,
                tv_nsec: i64::from(left.subsec_nanos()),
            };
            let mut fds = [PollFd::new(&self.fd, flags)];
            match poll(&mut fds, Some(&ts)) {
                Ok(0) => continue,
                Ok(_) => {
                    let got = fds[0].revents();
                    if got.intersects(flags) {
                        return Ok(());
                    }
                    if got.intersects(PollFlags::HUP | PollFlags::ERR | PollFlags::NVAL) {
                        return Err(SocketError::Closed);
                    }
                }
                Err(Errno::INTR) => continue,
                Err(e) => return Err(io(doing, e)),
            }
        }
    }

    /// Whether the peer closed the connection or shut its sending side (a zero-time poll).
    fn peer_gone(&self) -> bool {
        let mut fds = [PollFd::new(&self.fd, PollFlags::IN | PollFlags::RDHUP)];
        let now = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        match poll(&mut fds, Some(&now)) {
            Ok(_) => fds[0]
                .revents()
                .intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR),
            // Unknowable now: the end, as a read of nothing would otherwise say.
            Err(_) => true,
        }
    }

    /// Sends `frame` with `fds` (as many as its message carries), within the bound.
    pub fn send(&self, frame: &Frame, fds: &[BorrowedFd<'_>]) -> Result<(), SocketError> {
        let want = frame.message.descriptors();
        if fds.len() != want {
            return Err(ProtoError::Descriptors {
                kind: frame.message.kind().name(),
                want,
                got: fds.len(),
            }
            .into());
        }
        let bytes = frame.encode()?;
        self.send_raw(&bytes, fds)
    }

    /// Sends `bytes` as one datagram with `fds`, unchecked (tests send malformed frames so):
    /// any length up to the socket's, any number of descriptors up to the kernel's
    /// (`SCM_MAX_FD`), more than [`MAX_FDS`] included.
    pub fn send_raw(&self, bytes: &[u8], fds: &[BorrowedFd<'_>]) -> Result<(), SocketError> {
        // One deadline for the whole send, however many times the socket is found full.
        let deadline = Instant::now() + self.bound;
        let mut space = vec![MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(fds.len()))];
        loop {
            let mut control = SendAncillaryBuffer::new(&mut space);
            if !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(fds)) {
                return Err(io("sending descriptors", Errno::TOOBIG));
            }
            // Tried before waiting: a Unix datagram socket polls writable only while less
            // than a quarter of its send buffer is queued, so with one large frame unread a
            // wait first would time out on a socket that has room.
            // NOSIGNAL: a peer that went away gives EPIPE, not SIGPIPE to this process.
            match rustix::net::sendmsg(
                &self.fd,
                &[IoSlice::new(bytes)],
                &mut control,
                SendFlags::NOSIGNAL | SendFlags::DONTWAIT,
            ) {
                Ok(_) => return Ok(()),
                Err(Errno::INTR) => continue,
                Err(Errno::AGAIN) => self.wait(PollFlags::OUT, "sending a frame", deadline)?,
                Err(Errno::PIPE | Errno::CONNRESET) => return Err(SocketError::Closed),
                Err(e) => return Err(io("sending a frame", e)),
            }
        }
    }

    /// Receives one frame and its descriptors within the bound.
    pub fn recv(&self) -> Result<(Frame, Vec<OwnedFd>), SocketError> {
        let (bytes, fds) = self.recv_raw()?;
        let frame = Frame::decode(&bytes, fds.len())?;
        Ok((frame, fds))
    }

    /// Receives one datagram and its descriptors, undecoded.
    pub fn recv_raw(&self) -> Result<(Vec<u8>, Vec<OwnedFd>), SocketError> {
        let deadline = Instant::now() + self.bound;
        let mut buf = vec![0u8; MAX_FRAME];
        loop {
            self.wait(PollFlags::IN, "awaiting a frame", deadline)?;
            let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(MAX_FDS))];
            let mut control = RecvAncillaryBuffer::new(&mut space);
            let r = rustix::net::recvmsg(
                &self.fd,
                &mut [IoSliceMut::new(&mut buf)],
                &mut control,
                RecvFlags::CMSG_CLOEXEC | RecvFlags::DONTWAIT | RecvFlags::TRUNC,
            );
            match r {
                Ok(m) => {
                    let mut fds = Vec::new();
                    for msg in control.drain() {
                        if let RecvAncillaryMessage::ScmRights(passed) = msg {
                            fds.extend(passed);
                        }
                    }
                    // A read of nothing is the peer's end only where the socket says so: an
                    // empty datagram is a (malformed) frame, left to the decoder.
                    if m.bytes == 0 && fds.is_empty() && self.peer_gone() {
                        return Err(SocketError::Closed);
                    }
                    // The control buffer holds MAX_FDS and a little alignment slack, so a
                    // surplus may arrive whole (more than MAX_FDS) or cut (CTRUNC, the rest
                    // closed by the kernel); either way the frame is refused and what came is
                    // closed with it.
                    if m.flags.contains(ReturnFlags::CTRUNC) || fds.len() > MAX_FDS {
                        return Err(ProtoError::Descriptors {
                            kind: "a frame",
                            want: MAX_FDS,
                            got: fds.len().max(MAX_FDS + 1),
                        }
                        .into());
                    }
                    if m.flags.contains(ReturnFlags::TRUNC) || m.bytes > MAX_FRAME {
                        return Err(ProtoError::TooLarge(m.bytes.max(MAX_FRAME + 1)).into());
                    }
                    buf.truncate(m.bytes);
                    return Ok((buf, fds));
                }
                Err(Errno::AGAIN | Errno::INTR) => continue,
                Err(Errno::CONNRESET) => return Err(SocketError::Closed),
                Err(e) => return Err(io("receiving a frame", e)),
            }
        }
    }
}
