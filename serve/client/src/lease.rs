//! The mark a queue pair shares with its connection: set once when the pair is taken back
//! (an event from the daemon, the connection's end, the daemon's death seen on the socket),
//! read by the pair before every call.

use std::os::fd::OwnedFd;
use std::sync::{OnceLock, Weak};

use rustix::event::{PollFd, PollFlags, Timespec, poll};

/// Whether, and why, a queue pair was revoked.
#[derive(Debug, Default)]
pub(crate) struct Lease {
    revoked: OnceLock<String>,
    /// A duplicate of the connection's socket (held by the connection, so that it closes
    /// with it), watched for the daemon's end while the pair waits for completions: commands
    /// on a dead daemon's controller never complete, and the wait then ends in milliseconds
    /// instead of at its bound.
    socket: Weak<OwnedFd>,
}

impl Lease {
    /// A lease that also watches `socket` (see [`Lease::check_peer`]).
    pub(crate) fn watching(socket: Weak<OwnedFd>) -> Self {
        Self {
            revoked: OnceLock::new(),
            socket,
        }
    }

    /// Marks the pair revoked; the first reason stays.
    pub(crate) fn revoke(&self, why: String) {
        let _ = self.revoked.set(why);
    }

    /// Why the pair was revoked, if it was.
    pub(crate) fn revoked(&self) -> Option<&str> {
        self.revoked.get().map(String::as_str)
    }

    /// Revokes the pair if the daemon's end of the socket is gone (a hang-up, without
    /// waiting and without reading: replies and events stay for the connection).
    pub(crate) fn check_peer(&self) {
        let Some(fd) = self.socket.upgrade() else {
            return;
        };
        let mut fds = [PollFd::new(&*fd, PollFlags::RDHUP)];
        let zero = Timespec {
            tv_sec: 0,
            tv_nsec: 0,
        };
        if let Ok(n) = poll(&mut fds, Some(&zero))
            && n > 0
            && fds[0]
                .revents()
                .intersects(PollFlags::HUP | PollFlags::RDHUP | PollFlags::ERR)
        {
            self.revoke("the daemon closed the connection (it stopped or died)".into());
        }
    }
}
