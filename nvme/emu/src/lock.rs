//! One process per image: advisory `flock(2)` locks on image files, and who holds them.
//!
//! A namespace backed by an image file holds a lock on its open file for as long as the
//! controller runs: exclusive when the namespace is writable, shared when it is read-only, so
//! one writer or any number of readers use an image at a time. Locks are taken without waiting;
//! a busy image is an error ([`EmuError::ImageBusy`]) naming the holder's process id when the
//! kernel's lock table (`/proc/locks`) shows it.
//!
//! A `flock` belongs to the open file, not the process: a child forked by the process holding
//! it shares it until the child execs (Rust opens files close-on-exec) or exits, so a lock can
//! outlive the controller by that long in a process that spawns children.

use std::fs::File;
use std::os::unix::fs::MetadataExt;
use std::path::Path;

use rustix::fs::{FlockOperation, flock};

use crate::error::EmuError;

/// Tries at taking a lock whose holder the lock table does not show (it let go meanwhile).
const LOCK_ATTEMPTS: usize = 3;

/// Locks `file` (the image at `path`): exclusive, or shared when `shared`. Fails at once with
/// [`EmuError::ImageBusy`] when another open file holds a conflicting lock (another process, or
/// another controller of this one).
pub(crate) fn lock_image(file: &File, path: &Path, shared: bool) -> Result<(), EmuError> {
    let op = if shared {
        FlockOperation::NonBlockingLockShared
    } else {
        FlockOperation::NonBlockingLockExclusive
    };
    // A holder that is gone by the time the lock table is read has just released the lock:
    // try again rather than report nobody.
    let mut holder = None;
    for _ in 0..LOCK_ATTEMPTS {
        match flock(file, op) {
            Ok(()) => return Ok(()),
            Err(rustix::io::Errno::WOULDBLOCK) => {
                holder = file
                    .metadata()
                    .ok()
                    .and_then(|m| std::fs::read_to_string("/proc/locks").ok().map(|t| (m, t)))
                    .and_then(|(m, table)| flock_holder(&table, m.dev(), m.ino(), !shared));
                if holder.is_some() {
                    break;
                }
            }
            Err(e) => {
                return Err(EmuError::LockImage {
                    path: path.to_owned(),
                    source: e.into(),
                });
            }
        }
    }
    Err(EmuError::ImageBusy {
        path: path.to_owned(),
        holder,
        wanted_exclusive: !shared,
    })
}

/// The process id holding a `flock` on the file `dev`/`ino` that conflicts with the lock
/// wanted (any lock when `exclusive`, a write lock otherwise), from the text of `/proc/locks`.
///
/// Lines look like `1: FLOCK  ADVISORY  WRITE 7240 fe:00:10231846 0 EOF`: the device's major
/// and minor numbers in hex, the inode in decimal. Waiters (`1: -> FLOCK ...`) are skipped, and
/// so is anything that does not parse.
pub(crate) fn flock_holder(table: &str, dev: u64, ino: u64, exclusive: bool) -> Option<u32> {
    let (major, minor) = split_dev(dev);
    table.lines().find_map(|line| {
        let mut f = line.split_whitespace().skip(1);
        if f.next()? != "FLOCK" {
            return None;
        }
        let _advisory = f.next()?;
        let kind = f.next()?;
        let pid: u32 = f.next()?.parse().ok()?;
        let mut id = f.next()?.split(':');
        let maj = u64::from_str_radix(id.next()?, 16).ok()?;
        let min = u64::from_str_radix(id.next()?, 16).ok()?;
        let inode: u64 = id.next()?.parse().ok()?;
        let conflicts = exclusive || kind == "WRITE";
        (maj == major && min == minor && inode == ino && conflicts).then_some(pid)
    })
}

/// Linux's `dev_t` encoding (glibc's `gnu_dev_major`/`gnu_dev_minor`).
fn split_dev(dev: u64) -> (u64, u64) {
    let major = ((dev >> 8) & 0xfff) | ((dev >> 32) & !0xfff);
    let minor = (dev & 0xff) | ((dev >> 12) & !0xff);
    (major, minor)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn holder_from_the_lock_table() {
        let table = "1: FLOCK  ADVISORY  WRITE 7240 fe:00:10231846 0 EOF\n\
                     2: -> FLOCK  ADVISORY  WRITE 99 fe:00:55 0 EOF\n\
                     3: FLOCK  ADVISORY  READ 7241 fe:00:55 0 EOF\n\
                     4: POSIX  ADVISORY  WRITE 12 fe:00:77 0 EOF\n\
                     garbage\n";
        let dev = 0xfe << 8; // fe:00
        assert_eq!(flock_holder(table, dev, 10231846, true), Some(7240));
        assert_eq!(flock_holder(table, dev, 10231846, false), Some(7240));
        // A reader conflicts with a writer only.
        assert_eq!(flock_holder(table, dev, 55, true), Some(7241));
        assert_eq!(flock_holder(table, dev, 55, false), None);
        // POSIX locks are someone else's business; unknown inodes have no holder.
        assert_eq!(flock_holder(table, dev, 77, true), None);
        assert_eq!(flock_holder(table, dev, 1, true), None);
        // Minor numbers above 255 (e.g. 259:65536 for an NVMe partition) round-trip.
        let big = (259u64 << 8) | ((65536u64 & !0xff) << 12);
        assert_eq!(split_dev(big), (259, 65536));
    }

    #[test]
    fn exclusive_and_shared() {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("img");
        std::fs::write(&path, [0u8; 512]).unwrap();
        let open = || File::open(&path).unwrap();
        let (a, b, c) = (open(), open(), open());
        lock_image(&a, &path, true).unwrap();
        lock_image(&b, &path, true).unwrap();
        let err = lock_image(&c, &path, false).unwrap_err();
        match &err {
            EmuError::ImageBusy { holder, .. } => {
                // This process holds it, when /proc/locks can tell.
                if let Some(pid) = holder {
                    assert_eq!(*pid, std::process::id());
                }
            }
            e => panic!("unexpected error {e}"),
        }
        drop((a, b));
        lock_image(&c, &path, false).unwrap();
        assert!(matches!(
            lock_image(&open(), &path, true),
            Err(EmuError::ImageBusy { .. })
        ));
    }
}
