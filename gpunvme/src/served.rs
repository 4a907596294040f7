//! Controllers a `gpunvme serve` daemon owns, used from this process (docs/serve.md): the
//! connection ([`ServedController::connect`]) and GPU queues on pairs the daemon lends
//! ([`ServedController::gpu_queues`], the served transport of `gpu_queues::transport::served`).
//! The daemon keeps the controller, its admin queue and every byte it reaches; this process
//! gets queue pairs in memory the daemon shares and drives them from GPU threads directly.
//! When the queues drop, their pairs go back to the daemon (deleted on the controller, then
//! their memory freed); when this process dies, the daemon reclaims them in the same order.

use std::path::{Path, PathBuf};
use std::sync::{Arc, Mutex};
use std::time::Duration;

use gpu_queues::transport::served::{LentMemory, ServedLease, ServedPair, ServedRings};
use gpu_queues::{Cuda, GpuBuffer, GpuError, GpuQueueOptions, GpuQueues};
use gpunvme_serve_client::{Arena, ClientError, Connection, ControllerInfo, QueuePair};

use crate::error::{Error, ErrorKind, Result};

/// The device spec's prefix: `served:SOCKET[#CONTROLLER]`.
pub const SPEC_PREFIX: &str = "served:";

/// A served device as a spec names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct ServedSpec {
    /// The daemon's socket.
    pub socket: PathBuf,
    /// The controller's name at the daemon (its only one when `None`).
    pub controller: Option<String>,
}

impl ServedSpec {
    /// Parses `served:SOCKET` or `served:SOCKET#CONTROLLER`.
    pub fn parse(s: &str) -> Result<Self> {
        let rest = s.strip_prefix(SPEC_PREFIX).ok_or_else(|| {
            Error::invalid(format!(
                "device {s}: a served device is {SPEC_PREFIX}SOCKET[#NAME]"
            ))
        })?;
        let (socket, controller) = match rest.rsplit_once('#') {
            Some((sock, name)) => (sock, Some(name)),
            None => (rest, None),
        };
        if socket.is_empty() || controller.is_some_and(str::is_empty) {
            return Err(Error::invalid(format!(
                "device {s}: give the daemon's socket and, where it serves several controllers, \
                 a name: {SPEC_PREFIX}/run/gpunvme/serve.sock#nvme0"
            )));
        }
        Ok(Self {
            socket: PathBuf::from(socket),
            controller: controller.map(str::to_owned),
        })
    }
}

impl std::fmt::Display for ServedSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{SPEC_PREFIX}{}", self.socket.display())?;
        if let Some(c) = &self.controller {
            write!(f, "#{c}")?;
        }
        Ok(())
    }
}

/// How long one request to the daemon may wait for its reply.
pub const REQUEST_BOUND: Duration = Duration::from_secs(10);

/// Entries per GPU queue on a served controller unless the options say.
pub const DEFAULT_DEPTH: u32 = 256;

/// Slot buffer bytes unless the options say (at most the controller's maximum transfer): the
/// arena holds `queues × depth` of them, so they are kept smaller than on an owned device.
pub const DEFAULT_SLOT_BYTES: u32 = 128 << 10;

/// Slot buffer bytes of the GPU queues files are read on, at least
/// ([`ServedController::file_slot_bytes`]): the slots carry only a range's unaligned head and
/// tail, one LBA each.
pub const FILE_SLOT_BYTES: u32 = 4 << 10;

/// GPU queue pairs unless the options say (at most what the daemon still grants this client).
pub const DEFAULT_QUEUES: u16 = 4;

/// One controller of a daemon, through one connection.
#[derive(Debug)]
pub struct ServedController {
    conn: Arc<Connection>,
    socket: PathBuf,
    info: ControllerInfo,
}

impl ServedController {
    /// Connects to the daemon `spec` names as `client_name` ([`ServedController::connect`]).
    pub fn open(spec: &ServedSpec, client_name: &str) -> Result<Self> {
        Self::connect(&spec.socket, spec.controller.as_deref(), client_name)
    }

    /// Connects to the daemon at `socket` as `client_name` (shown in its status) and opens
    /// `controller` (the daemon's only one when `None`; naming one is required where it
    /// serves several). Nobody listening is [`ErrorKind::NotFound`].
    pub fn connect(socket: &Path, controller: Option<&str>, client_name: &str) -> Result<Self> {
        let conn = Connection::connect(socket, client_name, REQUEST_BOUND)
            .map_err(|e| Error::from(e).context(format!("connecting to {}", socket.display())))?;
        let name = match controller {
            Some(c) => c.to_string(),
            None => match conn.welcome().controllers.as_slice() {
                [one] => one.clone(),
                many => {
                    return Err(Error::invalid(format!(
                        "the daemon at {} serves {} controllers ({}): name one",
                        socket.display(),
                        many.len(),
                        many.join(", ")
                    )));
                }
            },
        };
        let info = conn
            .controller(&name)
            .map_err(|e| Error::from(e).context(format!("opening controller {name}")))?;
        Ok(Self {
            conn: Arc::new(conn),
            socket: socket.to_path_buf(),
            info,
        })
    }

    /// The controller as the daemon describes it.
    pub fn info(&self) -> &ControllerInfo {
        &self.info
    }

    /// The connection (for CPU queue pairs, status, admin requests).
    pub fn connection(&self) -> &Arc<Connection> {
        &self.conn
    }

    /// GPU queue pairs for file reads: one per thread of the daemon's serving this controller
    /// (the software controller's threads each serve the queues whose ids are theirs modulo
    /// the count), else [`DEFAULT_QUEUES`]; at most what this client may create now (asked of
    /// the daemon again: other clients took pairs since this connection opened).
    pub fn file_queue_count(&self) -> Result<u16> {
        let now = self
            .conn
            .controller(&self.info.name)
            .map_err(|e| Error::from(e).context(format!("asking {}", self.describe())))?;
        let free = now.queues_free;
        if free == 0 {
            return Err(Error::new(
                ErrorKind::Device,
                format!(
                    "{} grants this client no more queue pairs (its budget or the controller's                      pairs are taken)",
                    self.describe()
                ),
            ));
        }
        Ok(match now.controller_threads {
            Some(t) if t > 0 => t.min(free),
            _ => DEFAULT_QUEUES.min(free),
        })
    }

    /// Slot buffer bytes for file queues: [`FILE_SLOT_BYTES`], or the largest LBA of the
    /// controller's namespaces where that is larger (a slot holds one LBA).
    pub fn file_slot_bytes(&self) -> u32 {
        let lba = self.info.namespaces.iter().map(|n| n.lba_size).max();
        FILE_SLOT_BYTES.max(lba.unwrap_or(0).next_multiple_of(4096))
    }

    /// `len` bytes of memory the daemon lends in the controller's reach, registered with CUDA
    /// on `cuda`'s GPU: a buffer GPU queues on this controller may move data to and from (a
    /// staged load's bounce, made beside the queues' set-up), given back when it drops.
    pub fn lend_buffer(&self, cuda: &Arc<Cuda>, len: usize) -> Result<GpuBuffer> {
        let lent = lend(
            &self.conn,
            &self.info.name,
            len.max(1).next_multiple_of(4096),
        )?;
        Ok(gpu_queues::transport::served::lent_buffer(cuda, lent, len)?)
    }

    /// The daemon's trust model, in words (print it).
    pub fn trust(&self) -> &str {
        &self.conn.welcome().trust
    }

    /// GPU queues on `cuda`'s GPU over pairs the daemon lends: `opts.queues` pairs
    /// ([`DEFAULT_QUEUES`] or what the daemon still grants, the fewer), `opts.depth` entries
    /// ([`DEFAULT_DEPTH`]), slot buffers of `opts.slot_buffer_bytes` ([`DEFAULT_SLOT_BYTES`],
    /// at most the maximum transfer). A request past the client's budgets is refused by the
    /// daemon with its numbers.
    pub fn gpu_queues(&self, cuda: &Arc<Cuda>, opts: &GpuQueueOptions) -> Result<GpuQueues> {
        let ctx = |e: Error| e.context(format!("GPU queues on {}", self.describe()));
        let max_transfer = self.info.max_transfer_bytes;
        let count = opts
            .queues
            .unwrap_or_else(|| DEFAULT_QUEUES.min(self.info.queues_free.max(1)));
        let depth = opts.depth.unwrap_or(DEFAULT_DEPTH);
        let slot_bytes = opts
            .slot_buffer_bytes
            .unwrap_or_else(|| DEFAULT_SLOT_BYTES.min(max_transfer / 4096 * 4096).max(4096));
        if count == 0 || depth < 2 || !depth.is_power_of_two() {
            return Err(ctx(Error::invalid(format!(
                "{count} queues of depth {depth}: at least one queue, depth a power of two of \
                 at least 2"
            ))));
        }
        let bytes = gpunvme_serve_client::layout::arena_bytes_for(count, depth, slot_bytes);
        let name = self.info.name.clone();
        let arena = Arc::new(
            self.conn
                .alloc_arena(&name, bytes)
                .map_err(|e| ctx(Error::from(e)))?,
        );
        let pairs = match self
            .conn
            .create_queues(&name, &arena, count, depth, slot_bytes)
        {
            Ok(p) => p,
            Err(e) => {
                let _ = self.conn.free_arena(arena);
                return Err(ctx(Error::from(e)));
            }
        };
        let doorbells = pairs[0].doorbell_page().clone();
        let lent: Vec<ServedPair> = pairs
            .iter()
            .map(|p| {
                let g = p.grant();
                ServedPair {
                    qid: g.qid,
                    sq: g.sq,
                    cq: g.cq,
                    prp_lists: g.prp_lists,
                    slots: g.slots,
                    sq_doorbell: g.sq_doorbell,
                    cq_doorbell: g.cq_doorbell,
                }
            })
            .collect();
        let rings = ServedRings {
            arena: arena.mem.clone(),
            device_address: arena.device_address,
            doorbells,
            pairs: lent,
            depth,
            slot_bytes,
            max_transfer,
            protection: None,
            lease: Box::new(Lease {
                conn: self.conn.clone(),
                controller: name,
                pairs: Mutex::new(Some((pairs, arena))),
            }),
        };
        gpu_queues::transport::served::build(cuda, rings, opts).map_err(|e| ctx(Error::from(e)))
    }

    /// Namespace `nsid`'s description; [`ErrorKind::NotFound`] if the controller has none.
    pub fn namespace(&self, nsid: u32) -> Result<gpunvme_serve_client::NamespaceInfo> {
        self.info.namespace(nsid).copied().ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("namespace {nsid} is not on {}", self.describe()),
            )
        })
    }

    /// The generation of the blockfs on namespace `nsid` (the daemon mounts it once); the
    /// daemon keeps every block the older of it and `held` uses until this connection's next
    /// view or its end (docs/serve.md, "Files for many clients").
    pub fn fs_view(&self, nsid: u32, held: Option<u64>) -> Result<u64> {
        Ok(self.conn.fs_view(&self.info.name, nsid, held)?)
    }

    /// A write lease on `name` for `bytes` (replacing a file of that name by its commit with
    /// `replace`): the writable extent table of the blocks reserved, checked against the
    /// namespace before anything is written through it. Nothing is visible until
    /// [`ServedWrite::commit`]; dropped uncommitted, nothing of it is stored.
    pub fn fs_create(
        &self,
        nsid: u32,
        name: &str,
        bytes: u64,
        replace: bool,
    ) -> Result<ServedWrite> {
        let ns = self.namespace(nsid)?;
        let (lease, raw) = self
            .conn
            .fs_create(&self.info.name, nsid, name, bytes, replace)?;
        match check_reservation(&raw, ns, name, bytes) {
            Ok(table) => Ok(ServedWrite {
                conn: self.conn.clone(),
                lease,
                table,
                ns,
                name: name.to_owned(),
                committed: false,
            }),
            Err(e) => {
                // Nothing is written through a table that failed its checks.
                let _ = self.conn.fs_abort(lease);
                Err(e)
            }
        }
    }

    /// Removes `name` (refused while another client's lease writes it); the generation after.
    pub fn fs_remove(&self, nsid: u32, name: &str) -> Result<u64> {
        Ok(self.conn.fs_remove(&self.info.name, nsid, name)?)
    }

    /// Renames `from` to `to`, replacing `to` with `replace`; the generation after.
    pub fn fs_rename(&self, nsid: u32, from: &str, to: &str, replace: bool) -> Result<u64> {
        Ok(self
            .conn
            .fs_rename(&self.info.name, nsid, from, to, replace)?)
    }

    /// Namespace `nsid` as a block device through one served queue pair of its own: blockfs's
    /// metadata reads (a read-only mount; the daemon writes the metadata), CPU reads, and the
    /// data of a write lease ([`ServedController::fs_create`]), written through its table.
    pub fn block_device(&self, nsid: u32) -> Result<ServedBlockDevice> {
        let ns = self.namespace(nsid)?;
        let slot = BLOCK_SLOT_BYTES
            .min(self.info.max_transfer_bytes / 4096 * 4096)
            .max(4096);
        let pairs = self
            .cpu_pairs(1, BLOCK_DEPTH, slot)
            .map_err(|e| e.context("a queue pair for blockfs"))?;
        Ok(ServedBlockDevice {
            pairs: Mutex::new(pairs),
            controller: self.info.name.clone(),
            nsid,
            lba_size: ns.lba_size,
            blocks: ns.blocks,
        })
    }

    /// `count` queue pairs of `depth` entries with `slot_bytes` slots in an arena of their
    /// own, driven by this process's CPU threads; given back (deleted on the controller, then
    /// their arena freed) when the result drops.
    pub fn cpu_pairs(&self, count: u16, depth: u32, slot_bytes: u32) -> Result<LentPairs> {
        let name = self.info.name.clone();
        let bytes = gpunvme_serve_client::layout::arena_bytes_for(count, depth, slot_bytes);
        let arena = Arc::new(self.conn.alloc_arena(&name, bytes)?);
        match self
            .conn
            .create_queues(&name, &arena, count, depth, slot_bytes)
        {
            Ok(pairs) => Ok(LentPairs {
                pairs,
                arena: Some(arena),
                conn: self.conn.clone(),
                controller: name,
            }),
            Err(e) => {
                let _ = self.conn.free_arena(arena);
                Err(Error::from(e))
            }
        }
    }

    /// `len` bytes (whole pages) of memory the daemon lends in the controller's reach, not
    /// registered with any GPU: what commands of [`ServedController::cpu_pairs`] read into
    /// ([`gpunvme_serve_client::QueuePair::submit_read_into`]); freed at the daemon when the
    /// result drops.
    pub fn lend_host(&self, len: usize) -> Result<LentArena> {
        let arena = self
            .conn
            .alloc_arena(&self.info.name, len.max(1).next_multiple_of(4096) as u64)?;
        Ok(LentArena {
            arena: Some(Arc::new(arena)),
            conn: self.conn.clone(),
        })
    }

    /// A watchdog for GPU waits on this controller's queues: the reason to abort once the
    /// daemon revoked a queue, reported the controller failed, is stopping or is gone.
    pub fn watchdog(&self) -> impl FnMut() -> Option<String> + Send + Clone + 'static {
        let conn = self.conn.clone();
        move || match conn.check_events() {
            Err(e) => Some(format!("the daemon: {}", gpunvme_serve_client::chain(&e))),
            // Every event names this connection's queues or controller.
            Ok(_) => conn.events().first().map(|e| match e {
                gpunvme_serve_client::Event::ControllerFailed { why, .. } => {
                    format!("the controller failed: {why}")
                }
                gpunvme_serve_client::Event::QueuesRevoked { why, .. } => {
                    format!("the daemon took queues back: {why}")
                }
                gpunvme_serve_client::Event::Shutdown => "the daemon is stopping".into(),
            }),
        }
    }

    /// `served:SOCKET#CONTROLLER`, for messages.
    pub fn describe(&self) -> String {
        format!("served:{}#{}", self.socket.display(), self.info.name)
    }
}

/// Runs `make` with `count` queue pairs, and where the daemon refuses that many for want of
/// pairs (clients starting together may all have counted the same free pairs) and `may_halve`,
/// again with half as many, down to one: never an error while one pair is left.
pub fn fewer_when_busy<T>(
    mut count: u16,
    may_halve: bool,
    mut make: impl FnMut(u16) -> Result<T>,
) -> Result<T> {
    loop {
        match make(count) {
            Err(e) if may_halve && count > 1 && e.kind() == ErrorKind::Busy => {
                tracing::debug!("{e}: asking for {} queue pairs", count / 2);
                count /= 2;
            }
            r => return r,
        }
    }
}

/// Entries of a served block device's queue pair.
const BLOCK_DEPTH: u32 = 16;

/// Slot bytes of a served block device's queue pair (at most the maximum transfer).
const BLOCK_SLOT_BYTES: u32 = 128 << 10;

/// The daemon's reservation table for `bytes` of `name`, checked: a valid table of one
/// writable file of at least `bytes` on the namespace's LBAs.
fn check_reservation(
    raw: &[u8],
    ns: gpunvme_serve_client::NamespaceInfo,
    name: &str,
    bytes: u64,
) -> Result<blockfs::ExtentTable> {
    let table = blockfs::ExtentTable::from_bytes(raw, ns.blocks).map_err(|why| {
        Error::new(
            ErrorKind::Device,
            format!("the daemon's reservation of {name:?}: {why}"),
        )
    })?;
    let fits = table.files().len() == 1
        && table.files()[0].alloc_bytes >= bytes
        && table.files()[0].flags & blockfs::table::TABLE_FILE_WRITABLE != 0
        && table.header().lba_shift == ns.lba_size.trailing_zeros();
    if !fits {
        return Err(Error::new(
            ErrorKind::Device,
            format!(
                "the daemon's reservation of {name:?} is not one writable file of {bytes} bytes \
                 on {}-byte LBAs",
                ns.lba_size
            ),
        ));
    }
    Ok(table)
}

/// Whether `new` (a grown reservation, checked) maps every file LBA `old` maps, of the same
/// file, to the same device LBA.
fn keeps_mapping(old: &blockfs::ExtentTable, new: &blockfs::ExtentTable) -> bool {
    let extents = |t: &blockfs::ExtentTable| {
        let f = t.files()[0];
        let first = usize::try_from(f.first_extent).unwrap_or(usize::MAX);
        let count = usize::try_from(f.extent_count).unwrap_or(usize::MAX);
        t.extents()
            .get(first..first.saturating_add(count))
            .unwrap_or(&[])
            .to_vec()
    };
    if old.files()[0].file_id != new.files()[0].file_id {
        return false;
    }
    let (o, n) = (extents(old), extents(new));
    let mut j = 0;
    for e in &o {
        let end = e.file_lba + e.nlb;
        let mut at = e.file_lba;
        while at < end {
            while n.get(j).is_some_and(|m| m.file_lba + m.nlb <= at) {
                j += 1;
            }
            let Some(m) = n.get(j) else { return false };
            if m.file_lba > at || m.lba.wrapping_sub(m.file_lba) != e.lba.wrapping_sub(e.file_lba) {
                return false;
            }
            at = (m.file_lba + m.nlb).min(end);
        }
    }
    true
}

/// A write lease of the daemon's ([`ServedController::fs_create`]): the blocks reserved for one
/// file, written by this process through [`ServedWrite::table`], then committed; dropped
/// uncommitted, the daemon drops the reservation and nothing is stored.
pub struct ServedWrite {
    conn: Arc<Connection>,
    lease: u64,
    table: blockfs::ExtentTable,
    /// The namespace the tables are checked against.
    ns: gpunvme_serve_client::NamespaceInfo,
    /// The file's name (for errors).
    name: String,
    /// Sent to be committed (the daemon ends the lease either way).
    committed: bool,
}

impl ServedWrite {
    /// The reservation's table (one file, writable up to its allocation).
    pub fn table(&self) -> &blockfs::ExtentTable {
        &self.table
    }

    /// Grows the reservation to at least `bytes` (a stream's put, whose length comes at its
    /// end): the daemon's new table is checked as the first was, and must map every byte the
    /// old one reserved where the old one did (so what was written through it stays). On an
    /// error the lease is as it was (dropped, it stores nothing).
    pub fn grow(&mut self, bytes: u64) -> Result<()> {
        let raw = self.conn.fs_grow(self.lease, bytes)?;
        let table = check_reservation(&raw, self.ns, &self.name, bytes)?;
        if !keeps_mapping(&self.table, &table) {
            return Err(Error::new(
                ErrorKind::Device,
                format!(
                    "the daemon's grown reservation of {:?} moves blocks already reserved",
                    self.name
                ),
            ));
        }
        self.table = table;
        Ok(())
    }

    /// Makes the file `len` bytes long (with `crc`, the CRC-32C of those bytes as written)
    /// and visible under its name by one commit at the daemon: the generation after it.
    pub fn commit(mut self, len: u64, crc: Option<u32>) -> Result<u64> {
        self.committed = true;
        Ok(self.conn.fs_commit(self.lease, len, crc)?)
    }
}

impl Drop for ServedWrite {
    fn drop(&mut self) {
        if !self.committed
            && let Err(e) = self.conn.fs_abort(self.lease)
        {
            tracing::warn!(error = %gpunvme_serve_client::chain(&e), "dropping a write lease");
        }
    }
}

/// A served namespace as blockfs's block device through one queue pair of its own
/// ([`ServedController::block_device`]). The pair goes back to the daemon when this drops.
pub struct ServedBlockDevice {
    pairs: Mutex<LentPairs>,
    controller: String,
    nsid: u32,
    lba_size: u32,
    blocks: u64,
}

impl std::fmt::Debug for ServedBlockDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(&blockfs::BlockDevice::describe(self))
    }
}

impl blockfs::BlockDevice for ServedBlockDevice {
    fn lba_size(&self) -> u32 {
        self.lba_size
    }

    fn lba_count(&self) -> u64 {
        self.blocks
    }

    fn read(&self, reqs: &mut [blockfs::device::ReadReq<'_>]) -> Result<(), blockfs::DeviceError> {
        let mut held = self.pairs.lock().unwrap_or_else(|e| e.into_inner());
        let pair = first_pair(&mut held, "read", reqs.first().map_or(0, |r| r.lba))?;
        let unit = self.lba_size as usize;
        let step = (pair.slot_bytes() as usize / unit).max(1) * unit;
        for r in reqs.iter_mut() {
            blockfs::device::check_request(r.lba, r.buf.len(), self.lba_size, self.blocks)?;
            for (i, chunk) in r.buf.chunks_mut(step).enumerate() {
                let lba = r.lba + (i * step / unit) as u64;
                let blocks = (chunk.len() / unit) as u32;
                pair.read(self.nsid, lba, blocks, self.lba_size, chunk)
                    .map_err(|e| blockfs::DeviceError::Io {
                        op: "read",
                        lba,
                        source: Box::new(e),
                    })?;
            }
        }
        Ok(())
    }

    fn write(&self, reqs: &[blockfs::device::WriteReq<'_>]) -> Result<(), blockfs::DeviceError> {
        let mut held = self.pairs.lock().unwrap_or_else(|e| e.into_inner());
        let pair = first_pair(&mut held, "write", reqs.first().map_or(0, |r| r.lba))?;
        let unit = self.lba_size as usize;
        let step = (pair.slot_bytes() as usize / unit).max(1) * unit;
        // Every command of the batch, cut at the slot size.
        let mut cmds = Vec::new();
        for r in reqs {
            blockfs::device::check_request(r.lba, r.buf.len(), self.lba_size, self.blocks)?;
            for (i, chunk) in r.buf.chunks(step).enumerate() {
                cmds.push((r.lba + (i * step / unit) as u64, chunk));
            }
        }
        write_pipelined(pair, self.nsid, self.lba_size, &cmds)
    }

    fn flush(&self) -> Result<(), blockfs::DeviceError> {
        // This process's writes are a lease's data: the daemon's commit flushes the namespace
        // (every queue's completed writes) before it writes the metadata naming them.
        Ok(())
    }

    fn nvme_nsid(&self) -> Option<u32> {
        Some(self.nsid)
    }

    fn describe(&self) -> String {
        format!(
            "namespace {} of {} through a served queue pair",
            self.nsid, self.controller
        )
    }
}

/// The block device's pair, unless it was given back.
fn first_pair<'a>(
    held: &'a mut LentPairs,
    op: &'static str,
    lba: u64,
) -> Result<&'a mut QueuePair, blockfs::DeviceError> {
    held.pairs
        .first_mut()
        .ok_or_else(|| blockfs::DeviceError::Io {
            op,
            lba,
            source: "the served queue pair was given back".into(),
        })
}

/// How long a served write waits for a completion before it fails naming the command.
const WRITE_BOUND: Duration = Duration::from_secs(10);

/// Writes `cmds` (LBA, whole LBAs of data up to a slot) on `pair`, as many in flight as it
/// holds: after the first failure nothing more is sent, everything sent is waited for, and
/// the first failure is the result.
fn write_pipelined(
    pair: &mut QueuePair,
    nsid: u32,
    lba_size: u32,
    cmds: &[(u64, &[u8])],
) -> Result<(), blockfs::DeviceError> {
    let io = |lba, e: ClientError| blockfs::DeviceError::Io {
        op: "write",
        lba,
        source: Box::new(e),
    };
    let mut next = 0usize;
    let mut first: Option<blockfs::DeviceError> = None;
    while (next < cmds.len() && first.is_none()) || pair.in_flight() > 0 {
        while first.is_none() && next < cmds.len() && pair.in_flight() < pair.capacity() {
            let (lba, data) = cmds[next];
            let blocks = (data.len() / lba_size as usize) as u32;
            match pair.submit_write(nsid, lba, blocks, lba_size, data) {
                Ok(_) => next += 1,
                Err(e) => first = Some(io(lba, e)),
            }
        }
        if pair.in_flight() == 0 {
            continue;
        }
        // Bounded: the pair's own timeout names the oldest command.
        match pair.reap(WRITE_BOUND) {
            Ok(done) => {
                for c in done {
                    if let Err(e) = c.check()
                        && first.is_none()
                    {
                        first = Some(io(c.lba, e));
                    }
                }
            }
            Err(e) => return Err(first.unwrap_or(io(0, e))),
        }
    }
    first.map_or(Ok(()), Err)
}

/// Queue pairs a daemon lent this process for its CPU threads, in an arena of their own
/// ([`ServedController::cpu_pairs`]): given back when this drops (deleted on the controller,
/// then the arena freed).
pub struct LentPairs {
    /// The pairs (each driven by one thread at a time: `&mut`).
    pub pairs: Vec<QueuePair>,
    arena: Option<Arc<Arena>>,
    conn: Arc<Connection>,
    controller: String,
}

impl Drop for LentPairs {
    fn drop(&mut self) {
        let pairs = std::mem::take(&mut self.pairs);
        if !pairs.is_empty()
            && let Err(e) = self.conn.delete_queues(&self.controller, pairs)
        {
            tracing::warn!(error = %gpunvme_serve_client::chain(&e), "giving served queue pairs back");
        }
        if let Some(a) = self.arena.take()
            && let Err(e) = self.conn.free_arena(a)
        {
            tracing::warn!(error = %gpunvme_serve_client::chain(&e), "freeing a served pairs' arena");
        }
    }
}

/// Memory a daemon lent this process ([`ServedController::lend_host`]), freed there when this
/// drops.
pub struct LentArena {
    arena: Option<Arc<Arena>>,
    conn: Arc<Connection>,
}

impl LentArena {
    /// The arena (its memory and device address).
    pub fn arena(&self) -> &Arc<Arena> {
        self.arena.as_ref().expect("held until drop")
    }
}

impl Drop for LentArena {
    fn drop(&mut self) {
        if let Some(a) = self.arena.take()
            && let Err(e) = self.conn.free_arena(a)
        {
            tracing::warn!(error = %gpunvme_serve_client::chain(&e), "freeing lent memory");
        }
    }
}

/// Gives lent pairs back over the connection, and lends buffers.
struct Lease {
    conn: Arc<Connection>,
    controller: String,
    pairs: Mutex<Option<(Vec<QueuePair>, Arc<Arena>)>>,
}

impl ServedLease for Lease {
    fn release(&self, kernels_idle: bool) {
        let Some((pairs, arena)) = self.pairs.lock().unwrap_or_else(|e| e.into_inner()).take()
        else {
            return;
        };
        if !kernels_idle {
            tracing::warn!(
                controller = %self.controller,
                "a GPU kernel outlived the queue teardown: the served pairs are given back and \
                 their memory stays mapped here"
            );
        }
        // The daemon deletes the pairs on the controller before it frees their memory; a
        // daemon gone already reclaimed them when the socket ended.
        if let Err(e) = self.conn.delete_queues(&self.controller, pairs) {
            tracing::warn!(error = %gpunvme_serve_client::chain(&e), "giving served GPU queue pairs back");
        }
        if let Err(e) = self.conn.free_arena(arena) {
            tracing::warn!(error = %gpunvme_serve_client::chain(&e), "freeing a served arena");
        }
    }

    fn alloc(&self, len: usize) -> Result<LentMemory, GpuError> {
        lend(&self.conn, &self.controller, len)
    }
}

/// `len` bytes the daemon lends on `conn` in `controller`'s reach, freed there when the
/// returned memory's keeper drops.
fn lend(conn: &Arc<Connection>, controller: &str, len: usize) -> Result<LentMemory, GpuError> {
    let arena = conn.alloc_arena(controller, len as u64).map_err(|e| {
        GpuError::Unsupported(format!(
            "a buffer from the daemon: {}",
            gpunvme_serve_client::chain(&e)
        ))
    })?;
    let arena = Arc::new(arena);
    let keep = LentArena {
        conn: conn.clone(),
        arena: Some(arena.clone()),
    };
    Ok(LentMemory {
        mem: arena.mem.clone(),
        device_address: arena.device_address,
        keep: Box::new(keep),
    })
}

/// The kind of a serve client's error.
pub(crate) fn client_kind(e: &ClientError) -> ErrorKind {
    use gpunvme_serve_client::RefusalKind as R;
    match e {
        ClientError::Connect { source, .. } => match source.kind() {
            std::io::ErrorKind::NotFound | std::io::ErrorKind::ConnectionRefused => {
                ErrorKind::NotFound
            }
            _ => ErrorKind::Device,
        },
        ClientError::Refused { kind, .. } => match kind {
            R::InvalidArgument => ErrorKind::InvalidArgument,
            R::PermissionDenied => ErrorKind::Refused,
            R::NotFound => ErrorKind::NotFound,
            R::Budget | R::Busy => ErrorKind::Busy,
            R::Exists => ErrorKind::Exists,
            R::NoSpace => ErrorKind::NoSpace,
            R::NoFileSystem => ErrorKind::NoFileSystem,
            R::ReadOnly => ErrorKind::ReadOnly,
            R::FileSystem => ErrorKind::FileSystem,
            R::Device | R::Protocol => ErrorKind::Device,
        },
        ClientError::InvalidArgument(_) => ErrorKind::InvalidArgument,
        ClientError::QueueFull { .. } => ErrorKind::Busy,
        _ => ErrorKind::Device,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn served_specs_name_a_socket_and_maybe_a_controller() {
        let s = ServedSpec::parse("served:/run/gpunvme/serve.sock").unwrap();
        assert_eq!(s.socket, PathBuf::from("/run/gpunvme/serve.sock"));
        assert_eq!(s.controller, None);
        let s = ServedSpec::parse("served:/tmp/a#b.sock#nvme1").unwrap();
        assert_eq!(s.socket, PathBuf::from("/tmp/a#b.sock"));
        assert_eq!(s.controller.as_deref(), Some("nvme1"));
        assert_eq!(s.to_string(), "served:/tmp/a#b.sock#nvme1");
        for bad in ["served:", "served:#nvme0", "served:/s#", "serve:/s"] {
            let e = ServedSpec::parse(bad).unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{bad}: {e}");
        }
    }

    #[test]
    fn a_grown_reservation_must_keep_every_block_it_had() {
        let t = |runs: &[(u64, u64, u64)]| blockfs::ExtentTable::of_runs(4096, 1, 0, runs);
        let old = t(&[(0, 100, 8), (8, 300, 4)]);
        // The same runs, the last one longer, or merged differently, plus new ones.
        assert!(keeps_mapping(&old, &t(&[(0, 100, 8), (8, 300, 10)])));
        assert!(keeps_mapping(
            &old,
            &t(&[(0, 100, 3), (3, 103, 5), (8, 300, 4), (12, 900, 50)])
        ));
        assert!(keeps_mapping(&old, &old));
        // A block moved, a run shifted by one, or the reservation shrunk.
        assert!(!keeps_mapping(&old, &t(&[(0, 100, 8), (8, 301, 4)])));
        assert!(!keeps_mapping(&old, &t(&[(0, 101, 8), (8, 300, 4)])));
        assert!(!keeps_mapping(&old, &t(&[(0, 100, 8), (8, 300, 3)])));
        assert!(!keeps_mapping(&old, &t(&[(0, 100, 4), (4, 500, 8)])));
    }
}
