//! Files for many clients: the daemon mounts blockfs once per (controller, namespace) and is
//! the only writer of its metadata; clients read through read-only mounts of their own and
//! write file data through their own queues.
//!
//! - **Views.** A client's [`Request::FsView`](gpunvme_serve_proto::Request::FsView) learns the
//!   generation and, by asking, holds it ([`blockfs::GenerationHold`]): the blocks that
//!   generation uses are not reused by any commit here until the client moves on to a newer
//!   one or goes, so its own mount reads what it mounted.
//! - **Write leases.** `FsCreate` reserves a file under a temporary name
//!   (`.gpunvme-serve-put-<lease>`) and hands out its writable extent table; the client writes
//!   the bytes through its queues; `FsCommit` sets the length (and checksum) and renames it into
//!   place by one commit. One lease per name at a time: a second is refused naming the holder.
//!   A lease dropped (`FsAbort`, or the client gone, after its queues are deleted) removes the
//!   temporary file: nothing of it is stored.
//! - Removes and renames are the daemon's, refused while a lease holds either name.
//!
//! Temporary files a previous daemon left (it stopped mid-lease) are removed at mount.

use std::collections::BTreeMap;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};

use blockfs::{
    CreateOptions, DeviceWrite, FileSystem, GenerationHold, NvmeBlockDevice, NvmeDeviceOptions,
    OpenMode,
};
use gpunvme_serve_proto::msg::RefusalKind;
use nvme::Controller;

/// The prefix of a write lease's temporary name.
const TEMP_PREFIX: &str = ".gpunvme-serve-put-";

/// A refusal: its kind and words.
pub(crate) type Refusal = (RefusalKind, String);

/// The kind of a blockfs error, for the client.
fn refusal(e: blockfs::Error, doing: impl std::fmt::Display) -> Refusal {
    use blockfs::Error as E;
    let kind = match &e {
        E::NotFound(_) => RefusalKind::NotFound,
        E::AlreadyExists(_) => RefusalKind::Exists,
        E::NoSpace { .. } => RefusalKind::NoSpace,
        E::NotBlockfs(_) => RefusalKind::NoFileSystem,
        E::ReadOnly(_) => RefusalKind::ReadOnly,
        E::InvalidName { .. }
        | E::TooLarge(_)
        | E::FutureGeneration { .. }
        | E::BeyondReservation { .. } => RefusalKind::InvalidArgument,
        E::Device { .. } => RefusalKind::Device,
        _ => RefusalKind::FileSystem,
    };
    (kind, format!("{doing}: {e}"))
}

/// Who holds a write lease.
#[derive(Clone, Debug)]
struct Holder {
    lease: u64,
    client: u64,
    name: String,
    pid: i32,
}

impl Holder {
    /// The refusal of a change to `name`, which this lease holds, asked by client `client`.
    fn busy(&self, name: &str, client: u64) -> Refusal {
        let by = if self.client == client {
            "this client's".to_owned()
        } else {
            format!(
                "client {} ({:?}, pid {})'s",
                self.client, self.name, self.pid
            )
        };
        (
            RefusalKind::Busy,
            format!("{name:?} is being written under {by} lease {}", self.lease),
        )
    }
}

/// One mounted file system.
pub(crate) struct Mounted {
    fs: FileSystem,
    /// Write leases by the file name they will commit to.
    writers: Mutex<BTreeMap<String, Holder>>,
}

impl Mounted {
    fn writers(&self) -> std::sync::MutexGuard<'_, BTreeMap<String, Holder>> {
        self.writers.lock().unwrap_or_else(PoisonError::into_inner)
    }

    /// Refuses a change of `name` while another client's lease holds it.
    fn refuse_held(&self, name: &str, client: u64) -> Result<(), Refusal> {
        match self.writers().get(name) {
            Some(h) => Err(h.busy(name, client)),
            None => Ok(()),
        }
    }

    /// Syncs, the refusal naming `doing`.
    fn sync(&self, doing: &str) -> Result<u64, Refusal> {
        self.fs.sync().map_err(|e| refusal(e, doing))?;
        Ok(self.fs.generation())
    }
}

/// A write lease, owned by its client's ledger.
pub(crate) struct WriteLease {
    mount: Arc<Mounted>,
    /// The name it commits to.
    name: String,
    temp: String,
    replace: bool,
    reservation: Option<DeviceWrite>,
}

impl WriteLease {
    /// Removes the temporary file (nothing of the lease is stored) and frees the name.
    fn drop_temp(&mut self) {
        self.reservation = None;
        if self.mount.fs.remove(&self.temp).is_ok() {
            let _ = self.mount.fs.sync();
        }
        self.mount.writers().remove(&self.name);
    }
}

impl Drop for WriteLease {
    fn drop(&mut self) {
        if self.reservation.is_some() {
            self.drop_temp();
        }
    }
}

/// One client's files: its holds and its write leases (dropped at reclaim, after its queues).
#[derive(Default)]
pub struct ClientFiles {
    holds: BTreeMap<(usize, u32), GenerationHold>,
    writes: BTreeMap<u64, WriteLease>,
}

impl ClientFiles {
    /// Write leases held.
    pub fn leases(&self) -> usize {
        self.writes.len()
    }

    /// The generations held, by (controller, namespace).
    pub fn holds(&self) -> impl Iterator<Item = (usize, u32, u64)> + '_ {
        self.holds.iter().map(|(&(c, n), h)| (c, n, h.generation()))
    }
}

/// The mounts of every served controller.
#[derive(Default)]
pub struct Files {
    mounts: Mutex<BTreeMap<(usize, u32), Arc<Mounted>>>,
    next_lease: AtomicU64,
}

/// A namespace of a served controller: its index in the daemon's list, the controller, the
/// namespace id.
pub(crate) struct Ns<'a> {
    pub index: usize,
    pub ctrl: &'a Controller,
    pub nsid: u32,
}

/// The client a request comes from.
pub(crate) struct Caller<'a> {
    pub id: u64,
    pub name: &'a str,
    pub pid: i32,
    pub files: &'a mut ClientFiles,
}

impl Files {
    /// The mount of namespace `nsid` of controller `c` (`ctrl`), made on first use.
    fn mount(&self, ns: &Ns<'_>) -> Result<Arc<Mounted>, Refusal> {
        let (c, ctrl, nsid) = (ns.index, ns.ctrl, ns.nsid);
        let mut mounts = self.mounts.lock().unwrap_or_else(PoisonError::into_inner);
        if let Some(m) = mounts.get(&(c, nsid))
            && !m.fs.is_poisoned()
        {
            return Ok(m.clone());
        }
        let opts = NvmeDeviceOptions {
            queues: 2,
            ..NvmeDeviceOptions::default()
        };
        let dev = NvmeBlockDevice::new(ctrl, nsid, &opts).map_err(|e| {
            (
                RefusalKind::Device,
                format!("namespace {nsid}: the daemon's queues for its file system: {e}"),
            )
        })?;
        let fs = FileSystem::mount(Arc::new(dev)).map_err(|e| match e {
            e @ blockfs::Error::NotBlockfs(_) => refusal(
                e,
                format!("namespace {nsid} holds no blockfs (the operator makes one)"),
            ),
            e => refusal(e, format!("mounting blockfs on namespace {nsid}")),
        })?;
        // A previous daemon's leases ended with it.
        let stale: Vec<String> = fs.list(TEMP_PREFIX).into_iter().map(|s| s.name).collect();
        if !stale.is_empty() {
            for n in &stale {
                let _ = fs.remove(n);
            }
            fs.sync()
                .map_err(|e| refusal(e, "removing a previous daemon's unfinished writes"))?;
            tracing::info!(nsid, files = stale.len(), "removed unfinished writes");
        }
        let m = Arc::new(Mounted {
            fs,
            writers: Mutex::new(BTreeMap::new()),
        });
        mounts.insert((c, nsid), m.clone());
        Ok(m)
    }

    /// `FsView`: the generation now; the caller holds the older of it and `held`.
    pub(crate) fn view(
        &self,
        ns: Ns<'_>,
        held: Option<u64>,
        caller: Caller<'_>,
    ) -> Result<u64, Refusal> {
        let m = self.mount(&ns)?;
        let (c, nsid) = (ns.index, ns.nsid);
        let now = m.fs.generation();
        let keep = held.map_or(now, |h| h.min(now));
        // A hold on a generation the daemon no longer keeps would protect nothing: the oldest
        // kept is the one this client held already.
        let keep = match caller.files.holds.get(&(c, nsid)) {
            Some(old) => keep.max(old.generation()),
            None if held.is_some_and(|h| h < now) => {
                return Err((
                    RefusalKind::InvalidArgument,
                    format!(
                        "generation {} was not held by this client (the file system is at {now})",
                        held.unwrap_or_default()
                    ),
                ));
            }
            None => keep,
        };
        let hold =
            m.fs.hold_generation(keep)
                .map_err(|e| refusal(e, "holding the generation"))?;
        caller.files.holds.insert((c, nsid), hold);
        Ok(now)
    }

    /// `FsCreate`: a write lease and its table's bytes.
    pub(crate) fn create(
        &self,
        ns: Ns<'_>,
        name: &str,
        bytes: u64,
        replace: bool,
        caller: Caller<'_>,
    ) -> Result<(u64, Vec<u8>), Refusal> {
        blockfs::check_name(name).map_err(|reason| {
            refusal(
                blockfs::Error::InvalidName {
                    name: name.to_owned(),
                    reason,
                },
                "a write lease",
            )
        })?;
        if name.starts_with(TEMP_PREFIX) {
            return Err((
                RefusalKind::InvalidArgument,
                format!("{name:?}: names starting {TEMP_PREFIX:?} are the daemon's"),
            ));
        }
        let m = self.mount(&ns)?;
        let lease = self.next_lease.fetch_add(1, Ordering::Relaxed) + 1;
        {
            let mut writers = m.writers();
            if let Some(h) = writers.get(name) {
                return Err(h.busy(name, caller.id));
            }
            match m.fs.stat(name) {
                Ok(_) if !replace => {
                    return Err(refusal(
                        blockfs::Error::AlreadyExists(name.to_owned()),
                        "a write lease (replace it with force)",
                    ));
                }
                Ok(old) if old.immutable => {
                    return Err(refusal(
                        blockfs::Error::ReadOnly(name.to_owned()),
                        "a write lease",
                    ));
                }
                _ => {}
            }
            writers.insert(
                name.to_owned(),
                Holder {
                    lease,
                    client: caller.id,
                    name: caller.name.to_owned(),
                    pid: caller.pid,
                },
            );
        }
        let mut lease_state = WriteLease {
            mount: m.clone(),
            name: name.to_owned(),
            temp: format!("{TEMP_PREFIX}{lease}"),
            replace,
            reservation: None,
        };
        let reserved =
            m.fs.create(&lease_state.temp, &CreateOptions { size_hint: bytes })
                .and_then(|f| f.reserve_device_write(bytes));
        let reservation = match reserved {
            Ok(r) => r,
            Err(e) => {
                // The temporary file, if made, goes with the lease.
                lease_state.drop_temp();
                return Err(refusal(e, format!("reserving {bytes} bytes for {name:?}")));
            }
        };
        let table = reservation.table().as_bytes().to_vec();
        lease_state.reservation = Some(reservation);
        caller.files.writes.insert(lease, lease_state);
        Ok((lease, table))
    }

    /// `FsCommit`: the lease's file `len` bytes long under its name, by one commit.
    pub(crate) fn commit(
        &self,
        lease: u64,
        len: u64,
        crc: Option<u32>,
        caller: Caller<'_>,
    ) -> Result<u64, Refusal> {
        let Some(mut w) = caller.files.writes.remove(&lease) else {
            return Err((
                RefusalKind::NotFound,
                format!("no write lease {lease} of this client's"),
            ));
        };
        let reservation = w
            .reservation
            .take()
            .expect("a live lease has its reservation");
        let committed = match crc {
            Some(crc) => reservation.commit_with_crc(len, crc),
            None => reservation.commit(len),
        };
        if let Err(e) = committed {
            w.drop_temp();
            return Err(refusal(e, format!("committing {:?}", w.name)));
        }
        let placed = if w.replace {
            w.mount.fs.rename_replace(&w.temp, &w.name)
        } else {
            w.mount.fs.rename(&w.temp, &w.name)
        };
        if let Err(e) = placed {
            w.drop_temp();
            return Err(refusal(e, format!("placing {:?}", w.name)));
        }
        let generation = w.mount.sync(&format!("committing {:?}", w.name));
        w.mount.writers().remove(&w.name);
        generation
    }

    /// `FsGrow`: the lease's reservation grown to at least `bytes` (what it had keeps its
    /// blocks; a smaller `bytes` changes nothing) and its whole new table's bytes. Refused
    /// (NoSpace and the like), the lease stays as it was.
    pub(crate) fn grow(
        &self,
        lease: u64,
        bytes: u64,
        caller: Caller<'_>,
    ) -> Result<Vec<u8>, Refusal> {
        let Some(w) = caller.files.writes.get_mut(&lease) else {
            return Err((
                RefusalKind::NotFound,
                format!("no write lease {lease} of this client's"),
            ));
        };
        let grown = w
            .mount
            .fs
            .open(&w.temp, OpenMode::ReadWrite)
            .and_then(|f| f.reserve_device_write(bytes))
            .map_err(|e| refusal(e, format!("growing {:?} to {bytes} bytes", w.name)))?;
        let table = grown.table().as_bytes().to_vec();
        // The old reservation's pin goes; the file's extents only grew.
        w.reservation = Some(grown);
        Ok(table)
    }

    /// `FsAbort`: the lease dropped, nothing stored.
    pub(crate) fn abort(&self, lease: u64, caller: Caller<'_>) -> Result<u64, Refusal> {
        let Some(w) = caller.files.writes.remove(&lease) else {
            return Err((
                RefusalKind::NotFound,
                format!("no write lease {lease} of this client's"),
            ));
        };
        let m = w.mount.clone();
        drop(w);
        Ok(m.fs.generation())
    }

    /// `FsRemove`.
    pub(crate) fn remove(
        &self,
        ns: Ns<'_>,
        name: &str,
        caller: Caller<'_>,
    ) -> Result<u64, Refusal> {
        let m = self.mount(&ns)?;
        check_not_temp(name)?;
        m.refuse_held(name, caller.id)?;
        m.fs.remove(name)
            .map_err(|e| refusal(e, format!("removing {name:?}")))?;
        m.sync(&format!("removing {name:?}"))
    }

    /// `FsRename`.
    pub(crate) fn rename(
        &self,
        ns: Ns<'_>,
        from: &str,
        to: &str,
        replace: bool,
        caller: Caller<'_>,
    ) -> Result<u64, Refusal> {
        let m = self.mount(&ns)?;
        check_not_temp(from)?;
        check_not_temp(to)?;
        m.refuse_held(from, caller.id)?;
        m.refuse_held(to, caller.id)?;
        let r = if replace {
            m.fs.rename_replace(from, to)
        } else {
            m.fs.rename(from, to)
        };
        r.map_err(|e| refusal(e, format!("renaming {from:?} to {to:?}")))?;
        m.sync(&format!("renaming {from:?}"))
    }

    /// What `status` shows: per mount, the generation, files and leases.
    pub fn status(&self, names: &[String]) -> serde_json::Value {
        let mounts = self.mounts.lock().unwrap_or_else(PoisonError::into_inner);
        mounts
            .iter()
            .map(|(&(c, nsid), m)| {
                let writers = m.writers();
                serde_json::json!({
                    "controller": names.get(c),
                    "nsid": nsid,
                    "generation": m.fs.generation(),
                    "files": m.fs.df().files,
                    "pending_blocks": m.fs.df().pending_blocks,
                    "write_leases": writers.iter().map(|(n, h)| serde_json::json!({
                        "file": n, "lease": h.lease, "client": h.client, "pid": h.pid,
                    })).collect::<Vec<_>>(),
                })
            })
            .collect()
    }
}

/// Refuses the daemon's own temporary names.
fn check_not_temp(name: &str) -> Result<(), Refusal> {
    if name.starts_with(TEMP_PREFIX) {
        return Err((
            RefusalKind::Busy,
            format!("{name:?} is a write lease's temporary file (the daemon's)"),
        ));
    }
    Ok(())
}
