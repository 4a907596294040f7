//! The mark a queue pair shares with its connection: set once when the pair is taken back
//! (an event from the daemon, the connection's end), read by the pair before every call.

use std::sync::OnceLock;

/// Whether, and why, a queue pair was revoked.
#[derive(Debug, Default)]
pub(crate) struct Lease {
    revoked: OnceLock<String>,
}

impl Lease {
    /// Marks the pair revoked; the first reason stays.
    pub(crate) fn revoke(&self, why: String) {
        let _ = self.revoked.set(why);
    }

    /// Why the pair was revoked, if it was.
    pub(crate) fn revoked(&self) -> Option<&str> {
        self.revoked.get().map(String::as_str)
    }
}
