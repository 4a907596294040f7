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

    /// Namespace `nsid` as a block device read through one served queue pair of its own
    /// (blockfs's metadata and CPU reads). Writes are refused: the daemon serves no write
    /// leases yet, so nothing would keep two processes from changing one file system at once.
    pub fn block_device(&self, nsid: u32) -> Result<ServedBlockDevice> {
        let ns = *self.info.namespace(nsid).ok_or_else(|| {
            Error::new(
                ErrorKind::NotFound,
                format!("namespace {nsid} is not on {}", self.describe()),
            )
        })?;
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

/// A served namespace as blockfs's block device: reads through one queue pair of its own,
/// writes refused ([`ServedController::block_device`]). The pair goes back to the daemon when
/// this drops.
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
        let Some(pair) = held.pairs.first_mut() else {
            return Err(blockfs::DeviceError::Io {
                op: "read",
                lba: reqs.first().map_or(0, |r| r.lba),
                source: "the served queue pair was given back".into(),
            });
        };
        let unit = self.lba_size as usize;
        let step = (pair.slot_bytes() as usize / unit).max(1) * unit;
        for r in reqs.iter_mut() {
            let len = r.buf.len();
            if len % unit != 0 {
                return Err(blockfs::DeviceError::Misaligned {
                    len,
                    lba_size: self.lba_size,
                });
            }
            let end = r
                .lba
                .checked_add((len / unit) as u64)
                .filter(|&e| e <= self.blocks);
            let Some(_) = end else {
                return Err(blockfs::DeviceError::OutOfRange {
                    lba: r.lba,
                    end: r.lba.saturating_add((len / unit) as u64),
                    blocks: self.blocks,
                });
            };
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
        Err(blockfs::DeviceError::Io {
            op: "write",
            lba: reqs.first().map_or(0, |r| r.lba),
            source: "a served device is read here: the daemon serves no write leases yet, so \
                     writes go through the process that owns the device"
                .into(),
        })
    }

    fn flush(&self) -> Result<(), blockfs::DeviceError> {
        // Nothing is written through this device.
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
            R::Budget => ErrorKind::Busy,
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
}
