//! A controller of an NVMe/TCP target, brought up the way the spec orders it (NVMe over
//! Fabrics 1.1, section 3.5; NVMe Base 2.0, section 3.5.1): the admin queue's connection
//! and Fabrics Connect (a dynamic controller, Keep Alive Timeout asked), CAP read by Property
//! Get, CC written (I/O entry sizes, EN) by Property Set, CSTS.RDY awaited within CAP.TO,
//! Identify Controller (its in-capsule size for I/O queues), the number of I/O queues set;
//! Keep Alive sent at half the timeout by a thread of its own; I/O queues connected one
//! connection each; a normal shutdown (CC.SHN, CSTS.SHST awaited) when it is dropped.
//!
//! Every wait is bounded: connecting and each response by the connection's bound, CSTS by
//! CAP.TO, a command by the queue timeout.

use std::net::SocketAddr;
use std::sync::atomic::{AtomicU16, Ordering};
use std::sync::mpsc::{self, RecvTimeoutError};
use std::sync::{Arc, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvme_spec::fabrics::{self, CNTLID_DYNAMIC, ConnectData};
use nvme_spec::{
    AdminOpcode, Cap, Cc, Cns, Command, Csts, FeatureId, IdentifyController, IdentifyNamespace,
    NvmOpcode, Status,
};
use zerocopy::{FromBytes, FromZeros, IntoBytes};

use crate::tcp::conn::{ConnectOptions, Connection, TcpError};
use crate::tcp::queue::{Data, Done, Queue};

/// Register offsets read and written by Property Get/Set.
const CAP: u32 = 0x0;
const VS: u32 = 0x8;
const CC: u32 = 0x14;
const CSTS: u32 = 0x1c;
/// In-capsule data on the admin queue (the spec's fixed 8 KiB).
const ADMIN_IN_CAPSULE: usize = 8192;

/// Where a subsystem is: a TCP address and the subsystem's NQN.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Target {
    /// The listener.
    pub addr: SocketAddr,
    /// The subsystem's NQN.
    pub subnqn: String,
}

/// How the host connects.
#[derive(Clone, Debug)]
pub struct HostOptions {
    /// The host's NQN.
    pub hostnqn: String,
    /// The host's identifier (the same on every connection).
    pub hostid: [u8; 16],
    /// Each connection's negotiation and bound.
    pub connect: ConnectOptions,
    /// Keep Alive Timeout asked for (zero: none; Keep Alive is then never sent).
    pub kato: Duration,
    /// Admin queue entries.
    pub admin_depth: u16,
    /// A command not done within this fails its queue.
    pub timeout: Duration,
}

impl Default for HostOptions {
    fn default() -> Self {
        Self {
            hostnqn: "nqn.2014-08.org.nvmexpress:uuid:6770756e-766d-6500-0000-000000000001".into(),
            hostid: *b"gpunvme-host-id\0",
            connect: ConnectOptions::default(),
            kato: Duration::from_secs(10),
            admin_depth: 32,
            timeout: Duration::from_secs(10),
        }
    }
}

/// Why a controller could not be used.
#[derive(Debug, thiserror::Error)]
pub enum FabricsError {
    /// The connection failed (see [`TcpError`]).
    #[error(transparent)]
    Tcp(#[from] TcpError),
    /// The target refused the Connect (a wrong NQN, a host not allowed, a queue it will not
    /// make).
    #[error("{target}: Connect of queue {qid} refused: {}", connect_status(status))]
    ConnectRefused {
        /// Where.
        target: String,
        /// The queue.
        qid: u16,
        /// The target's status.
        status: Status,
    },
    /// A command failed.
    #[error("{what} failed: {status}")]
    Command {
        /// Which.
        what: &'static str,
        /// Its status.
        status: Status,
    },
    /// CSTS did not reach the state awaited within CAP.TO.
    #[error("the controller did not {what} within {after:?} (CSTS {csts:#x})")]
    NotReady {
        /// What was awaited.
        what: &'static str,
        /// The bound.
        after: Duration,
        /// CSTS last read.
        csts: u32,
    },
    /// The controller reports a fatal status (CSTS.CFS).
    #[error("the controller reports fatal status (CSTS {csts:#x})")]
    ControllerFatal {
        /// CSTS.
        csts: u32,
    },
    /// A request the host cannot make.
    #[error("{0}")]
    InvalidArgument(String),
}

/// A Connect's status in words: the Fabrics names for Command Specific codes (0x82 is Connect
/// Invalid Parameters there, not the NVM command set's meaning).
fn connect_status(s: &Status) -> String {
    match fabrics::status::name(s.sc) {
        Some(n) if s.sct == nvme_spec::StatusCodeType::COMMAND_SPECIFIC => {
            format!("{n} (sct {:#x}, sc {:#x})", s.sct.0, s.sc)
        }
        _ => s.to_string(),
    }
}

/// A namespace as Identify Namespace describes it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Namespace {
    /// Its id.
    pub nsid: u32,
    /// Logical blocks.
    pub blocks: u64,
    /// Bytes per logical block.
    pub lba_size: u32,
}

/// A connected, enabled controller (see the module documentation).
pub struct Controller {
    target: Target,
    opts: HostOptions,
    admin: Arc<Mutex<Queue>>,
    cntlid: u16,
    cap: Cap,
    vs: u32,
    identify: Box<IdentifyController>,
    io_in_capsule: usize,
    max_transfer: usize,
    io_queues: u16,
    next_qid: AtomicU16,
    /// Queue ids of I/O queues dropped (their connections closed), for reuse once every id
    /// was used once.
    freed_qids: Arc<Mutex<Vec<u16>>>,
    keep_alive: Option<(mpsc::Sender<()>, JoinHandle<()>)>,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("target", &self.target)
            .field("cntlid", &self.cntlid)
            .finish_non_exhaustive()
    }
}

fn check(what: &'static str, d: &Done) -> Result<(), FabricsError> {
    if d.status.is_success() {
        Ok(())
    } else {
        Err(FabricsError::Command {
            what,
            status: d.status,
        })
    }
}

/// Connects one queue: a connection, then Fabrics Connect; returns the queue and the
/// Connect's DW0 (the controller id on the admin queue).
fn connect_queue(
    target: &Target,
    opts: &HostOptions,
    qid: u16,
    cntlid: u16,
    depth: u16,
    in_capsule: usize,
) -> Result<(Queue, u32), FabricsError> {
    let conn = Connection::connect(target.addr, &opts.connect)?;
    // The Connect's 1024 bytes always travel in the capsule; the controller's in-capsule
    // size applies from the next command on.
    let mut q = Queue::new(conn, qid, depth, 1024, opts.timeout);
    let data = ConnectData::new(opts.hostid, cntlid, &target.subnqn, &opts.hostnqn)
        .map_err(|e| FabricsError::InvalidArgument(format!("an NQN of {} bytes", e.len)))?;
    let kato_ms = if qid == 0 {
        u32::try_from(opts.kato.as_millis()).unwrap_or(u32::MAX)
    } else {
        0
    };
    let sqsize_z = depth.saturating_sub(1).max(1);
    let d = q.run(
        fabrics::connect(0, qid, sqsize_z, 0, kato_ms),
        Data::ToController(data.as_bytes().to_vec()),
    )?;
    if !d.status.is_success() {
        return Err(FabricsError::ConnectRefused {
            target: format!("{} {}", target.addr, target.subnqn),
            qid,
            status: d.status,
        });
    }
    q.set_in_capsule_max(in_capsule);
    Ok((q, d.completion.dw0))
}

fn lock(q: &Mutex<Queue>) -> MutexGuard<'_, Queue> {
    q.lock().unwrap_or_else(|e| e.into_inner())
}

fn lock_ids(ids: &Mutex<Vec<u16>>) -> MutexGuard<'_, Vec<u16>> {
    ids.lock().unwrap_or_else(|e| e.into_inner())
}

impl Controller {
    /// Connects to `target` and brings its controller up (see the module documentation).
    pub fn connect(target: &Target, opts: &HostOptions) -> Result<Self, FabricsError> {
        Self::bring_up(target, opts, false)
    }

    /// Connects to the discovery controller at `addr` (the well-known discovery NQN) and
    /// brings it up: no I/O queues, no Keep Alive (the connection is short-lived).
    pub fn connect_discovery(addr: SocketAddr, opts: &HostOptions) -> Result<Self, FabricsError> {
        let target = Target {
            addr,
            subnqn: fabrics::DISCOVERY_NQN.into(),
        };
        let opts = HostOptions {
            kato: Duration::ZERO,
            ..opts.clone()
        };
        Self::bring_up(&target, &opts, true)
    }

    fn bring_up(
        target: &Target,
        opts: &HostOptions,
        discovery: bool,
    ) -> Result<Self, FabricsError> {
        let depth = opts.admin_depth.clamp(2, 4096);
        let (admin, dw0) = connect_queue(target, opts, 0, CNTLID_DYNAMIC, depth, ADMIN_IN_CAPSULE)?;
        let cntlid = (dw0 & 0xffff) as u16;
        let admin = Arc::new(Mutex::new(admin));
        let prop = |cmd: Command, what: &'static str| -> Result<u64, FabricsError> {
            let d = lock(&admin).run(cmd, Data::None)?;
            check(what, &d)?;
            Ok(u64::from(d.completion.dw0) | (u64::from(d.completion.dw1) << 32))
        };
        let cap = Cap::from_bits(prop(
            fabrics::property_get(0, CAP, true),
            "Property Get CAP",
        )?);
        let vs = prop(fabrics::property_get(0, VS, false), "Property Get VS")? as u32;
        let to = Duration::from_millis(cap.timeout_ms().max(500));
        // Enable: NVM command set, 4 KiB pages, 64-byte SQEs and 16-byte CQEs.
        let cc = Cc::new()
            .with_en(true)
            .with_css(Cc::CSS_NVM)
            .with_iosqes(6)
            .with_iocqes(4);
        prop(
            fabrics::property_set(0, CC, u64::from(cc.into_bits()), false),
            "Property Set CC",
        )?;
        wait_csts(&admin, to, "become ready", |c| c.rdy())?;
        let mut c = Self {
            target: target.clone(),
            opts: opts.clone(),
            admin,
            cntlid,
            cap,
            vs,
            identify: Box::new(IdentifyController::new_zeroed()),
            io_in_capsule: 0,
            max_transfer: 0,
            io_queues: 0,
            next_qid: AtomicU16::new(1),
            freed_qids: Arc::default(),
            keep_alive: None,
        };
        let id = c.identify_data(Cns::CONTROLLER, 0)?;
        c.identify = Box::new(IdentifyController::read_from_bytes(&id[..]).map_err(|_| {
            FabricsError::InvalidArgument("Identify Controller returned short data".into())
        })?);
        // IOCCSZ (bytes 1792-1795 of Identify Controller: the NVMe over Fabrics attributes),
        // in 16-byte units, counts the 64-byte SQE too.
        let ioccsz = u32::from_le_bytes(c.identify.nvmeof[0..4].try_into().unwrap_or([0; 4]));
        c.io_in_capsule = (ioccsz as usize * 16).saturating_sub(64);
        // MDTS: 2^MDTS units of the smallest page size (0: no limit; one command then carries
        // at most 4 MiB here).
        let page = c.cap.min_page_size().min(1 << 16) as usize;
        c.max_transfer = match c.identify.mdts {
            0 => 4 << 20,
            m => page << u32::from(m).min(10),
        }
        .min(4 << 20);
        if discovery {
            return Ok(c);
        }
        // Number of Queues: ask for as many as the queue ids allow; keep what is granted.
        let mut set = Command::new(AdminOpcode::SET_FEATURES.0, 0, 0);
        set.cdw10 = u32::from(FeatureId::NUMBER_OF_QUEUES.0);
        set.cdw11 = 0xfffe_fffe;
        let d = lock(&c.admin).run(set, Data::None)?;
        check("Set Features (Number of Queues)", &d)?;
        let granted = (d.completion.dw0 & 0xffff).min(d.completion.dw0 >> 16) + 1;
        c.io_queues = u16::try_from(granted).unwrap_or(u16::MAX);
        c.start_keep_alive();
        Ok(c)
    }

    fn start_keep_alive(&mut self) {
        if self.opts.kato.is_zero() {
            return;
        }
        let (tx, rx) = mpsc::channel::<()>();
        let admin = self.admin.clone();
        let every = self.opts.kato / 2;
        let spawned = std::thread::Builder::new()
            .name("nvmf-keep-alive".into())
            .spawn(move || {
                loop {
                    match rx.recv_timeout(every) {
                        Err(RecvTimeoutError::Timeout) => {}
                        _ => return,
                    }
                    let ka = Command::new(AdminOpcode::KEEP_ALIVE.0, 0, 0);
                    if lock(&admin).run(ka, Data::None).is_err() {
                        // The admin queue failed: the next command on it says so.
                        return;
                    }
                }
            });
        if let Ok(h) = spawned {
            self.keep_alive = Some((tx, h));
        }
    }

    /// The Identify data for `cns` / `nsid` (4096 bytes).
    pub fn identify_data(&self, cns: Cns, nsid: u32) -> Result<Vec<u8>, FabricsError> {
        let mut cmd = Command::new(AdminOpcode::IDENTIFY.0, 0, nsid);
        cmd.cdw10 = u32::from(cns.0);
        let d = lock(&self.admin).run(cmd, Data::FromController(4096))?;
        check("Identify", &d)?;
        Ok(d.data)
    }

    /// Reads `len` bytes (a multiple of 4, at most 64 KiB) of log page `lid` from byte
    /// `offset` (namespace: all).
    pub fn get_log_page(&self, lid: u8, offset: u64, len: usize) -> Result<Vec<u8>, FabricsError> {
        if len == 0 || len % 4 != 0 || len > 64 << 10 {
            return Err(FabricsError::InvalidArgument(format!(
                "a log page read of {len} bytes (a multiple of 4, 4 to 65536)"
            )));
        }
        let numd = (len / 4 - 1) as u32;
        let mut cmd = Command::new(AdminOpcode::GET_LOG_PAGE.0, 0, 0xffff_ffff);
        cmd.cdw10 = u32::from(lid) | (numd & 0xffff) << 16;
        cmd.cdw11 = numd >> 16;
        cmd.cdw12 = offset as u32;
        cmd.cdw13 = (offset >> 32) as u32;
        let d = lock(&self.admin).run(cmd, Data::FromController(len))?;
        check("Get Log Page", &d)?;
        Ok(d.data)
    }

    /// Identify Controller, as read at bring-up.
    pub fn identify(&self) -> &IdentifyController {
        &self.identify
    }

    /// Namespace `nsid`: its size and LBA size (Identify Namespace).
    pub fn namespace(&self, nsid: u32) -> Result<Namespace, FabricsError> {
        let data = self.identify_data(Cns::NAMESPACE, nsid)?;
        let ns = IdentifyNamespace::read_from_bytes(&data[..]).map_err(|_| {
            FabricsError::InvalidArgument("Identify Namespace returned short data".into())
        })?;
        let lbads = ns.current_lba_format().lbads;
        if ns.nsze == 0 || !(9..=16).contains(&lbads) {
            return Err(FabricsError::InvalidArgument(format!(
                "namespace {nsid} is not active (NSZE {}, LBADS {lbads})",
                ns.nsze
            )));
        }
        Ok(Namespace {
            nsid,
            blocks: ns.nsze,
            lba_size: 1 << lbads,
        })
    }

    /// The controller id the target gave this host.
    pub fn cntlid(&self) -> u16 {
        self.cntlid
    }

    /// CAP as read at bring-up.
    pub fn cap(&self) -> Cap {
        self.cap
    }

    /// VS (major << 16 | minor << 8 | tertiary).
    pub fn version(&self) -> u32 {
        self.vs
    }

    /// I/O queues the controller granted.
    pub fn io_queues(&self) -> u16 {
        self.io_queues
    }

    /// Bytes of write data an I/O command carries in its capsule (IOCCSZ less the SQE).
    pub fn io_in_capsule(&self) -> usize {
        self.io_in_capsule
    }

    /// Most bytes one command moves (MDTS; at most 4 MiB).
    pub fn max_transfer(&self) -> usize {
        self.max_transfer
    }

    /// Where it is.
    pub fn target(&self) -> &Target {
        &self.target
    }

    /// A new I/O queue of `depth` entries (2 to CAP.MQES + 1) on a connection of its own. Its
    /// queue id is a fresh one while there are, else one of a queue dropped since (so a host
    /// that reconnects queues does not run out).
    pub fn io_queue(&self, depth: u16) -> Result<IoQueue, FabricsError> {
        let fresh = self
            .next_qid
            .fetch_update(Ordering::Relaxed, Ordering::Relaxed, |q| {
                (q <= self.io_queues).then_some(q + 1)
            })
            .ok();
        let Some(qid) = fresh.or_else(|| lock_ids(&self.freed_qids).pop()) else {
            return Err(FabricsError::InvalidArgument(format!(
                "the controller granted {} I/O queues; all are connected",
                self.io_queues
            )));
        };
        let freed = self.freed_qids.clone();
        let mqes = u16::try_from(self.cap.max_queue_entries()).unwrap_or(u16::MAX);
        let depth = depth.clamp(2, mqes.max(2));
        let (q, _) = connect_queue(
            &self.target,
            &self.opts,
            qid,
            self.cntlid,
            depth,
            self.io_in_capsule,
        )
        .inspect_err(|_| lock_ids(&freed).push(qid))?;
        Ok(IoQueue {
            q,
            max_transfer: self.max_transfer,
            freed,
        })
    }

    /// Shuts the controller down (CC.SHN normal, CSTS.SHST complete awaited within CAP.TO);
    /// the connections close when it is dropped.
    pub fn shutdown(&self) -> Result<(), FabricsError> {
        let cc = Cc::new()
            .with_en(true)
            .with_css(Cc::CSS_NVM)
            .with_iosqes(6)
            .with_iocqes(4)
            .with_shn(Cc::SHN_NORMAL);
        let d = lock(&self.admin).run(
            fabrics::property_set(0, CC, u64::from(cc.into_bits()), false),
            Data::None,
        )?;
        check("Property Set CC (shutdown)", &d)?;
        let to = Duration::from_millis(self.cap.timeout_ms().max(500));
        wait_csts(&self.admin, to, "finish shutting down", |c| {
            c.shst() == Csts::SHST_COMPLETE
        })
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if let Some((tx, h)) = self.keep_alive.take() {
            drop(tx);
            let _ = h.join();
        }
    }
}

/// Reads CSTS (Property Get) until `done` holds or CFS is set, within `bound`.
fn wait_csts(
    admin: &Mutex<Queue>,
    bound: Duration,
    what: &'static str,
    done: impl Fn(Csts) -> bool,
) -> Result<(), FabricsError> {
    let start = Instant::now();
    let mut pause = Duration::from_micros(100);
    loop {
        let d = lock(admin).run(fabrics::property_get(0, CSTS, false), Data::None)?;
        check("Property Get CSTS", &d)?;
        let csts = Csts::from_bits(d.completion.dw0);
        if csts.cfs() {
            return Err(FabricsError::ControllerFatal {
                csts: d.completion.dw0,
            });
        }
        if done(csts) {
            return Ok(());
        }
        if start.elapsed() >= bound {
            return Err(FabricsError::NotReady {
                what,
                after: bound,
                csts: d.completion.dw0,
            });
        }
        std::thread::sleep(pause);
        pause = (pause * 2).min(Duration::from_millis(20));
    }
}

/// One I/O queue (one connection) of a [`Controller`].
#[derive(Debug)]
pub struct IoQueue {
    q: Queue,
    max_transfer: usize,
    freed: Arc<Mutex<Vec<u16>>>,
}

impl Drop for IoQueue {
    fn drop(&mut self) {
        // The connection closes with the queue: the target frees the id with it.
        lock_ids(&self.freed).push(self.q.qid());
    }
}

impl IoQueue {
    /// Whether another command can be submitted without waiting.
    pub fn has_room(&self) -> bool {
        self.q.has_room()
    }

    /// The queue under it, for many commands in flight ([`Queue::submit`], [`Queue::poll`]).
    pub fn queue(&mut self) -> &mut Queue {
        &mut self.q
    }

    /// Most bytes one command moves.
    pub fn max_transfer(&self) -> usize {
        self.max_transfer
    }

    /// Runs `cmds` (tag = index), as many in flight at once as the queue holds; the first
    /// failure is returned once nothing of the batch is in flight any more.
    fn batch(
        &mut self,
        cmds: Vec<(Command, Data)>,
        what: &'static str,
    ) -> Result<Vec<Done>, FabricsError> {
        let n = cmds.len();
        let mut out: Vec<Option<Done>> = (0..n).map(|_| None).collect();
        let mut pending = cmds.into_iter().enumerate();
        let (mut sent, mut finished) = (0usize, 0usize);
        let mut first_error = None;
        while finished < n {
            while sent < n && self.q.has_room() && first_error.is_none() {
                let (i, (cmd, data)) = pending.next().expect("counted");
                self.q.submit(i as u64, cmd, data)?;
                sent += 1;
            }
            if first_error.is_some() && finished == sent {
                break;
            }
            for d in self.q.poll(Duration::from_millis(100))? {
                finished += 1;
                if !d.status.is_success() && first_error.is_none() {
                    first_error = Some(FabricsError::Command {
                        what,
                        status: d.status,
                    });
                }
                let i = d.tag as usize;
                if let Some(slot) = out.get_mut(i) {
                    *slot = Some(d);
                }
            }
        }
        if let Some(e) = first_error {
            return Err(e);
        }
        Ok(out.into_iter().flatten().collect())
    }

    /// Reads `blocks` logical blocks of `lba_size` bytes from `lba` of namespace `nsid`, in
    /// commands of at most [`IoQueue::max_transfer`] bytes, several in flight.
    pub fn read(
        &mut self,
        nsid: u32,
        lba: u64,
        blocks: u32,
        lba_size: u32,
    ) -> Result<Vec<u8>, FabricsError> {
        let per = self.blocks_per_command(lba_size)?;
        let mut cmds = Vec::new();
        let mut at = 0u32;
        while at < blocks {
            let n = (blocks - at).min(per);
            cmds.push((
                rw(NvmOpcode::READ, nsid, lba + u64::from(at), n)?,
                Data::FromController(n as usize * lba_size as usize),
            ));
            at += n;
        }
        let done = self.batch(cmds, "Read")?;
        Ok(done.into_iter().flat_map(|d| d.data).collect())
    }

    /// Writes `data` (whole logical blocks of `lba_size` bytes) at `lba` of namespace `nsid`,
    /// in commands of at most [`IoQueue::max_transfer`] bytes, several in flight.
    pub fn write(
        &mut self,
        nsid: u32,
        lba: u64,
        data: &[u8],
        lba_size: u32,
    ) -> Result<(), FabricsError> {
        let size = lba_size.max(1) as usize;
        if data.is_empty() || data.len() % size != 0 {
            return Err(FabricsError::InvalidArgument(format!(
                "a write of {} bytes is not whole {size}-byte blocks",
                data.len()
            )));
        }
        let per = self.blocks_per_command(lba_size)? as usize;
        let mut cmds = Vec::new();
        for (i, chunk) in data.chunks(per * size).enumerate() {
            let at = lba + (i * per) as u64;
            let n = (chunk.len() / size) as u32;
            cmds.push((
                rw(NvmOpcode::WRITE, nsid, at, n)?,
                Data::ToController(chunk.to_vec()),
            ));
        }
        self.batch(cmds, "Write").map(|_| ())
    }

    fn blocks_per_command(&self, lba_size: u32) -> Result<u32, FabricsError> {
        if !lba_size.is_power_of_two() || lba_size < 512 {
            return Err(FabricsError::InvalidArgument(format!(
                "an LBA size of {lba_size} bytes"
            )));
        }
        Ok(((self.max_transfer / lba_size as usize).max(1) as u32).min(65536))
    }
}

/// A Read or Write of `blocks` (1 to 65536) at `lba`.
pub fn rw(op: NvmOpcode, nsid: u32, lba: u64, blocks: u32) -> Result<Command, FabricsError> {
    if !(1..=65536).contains(&blocks) {
        return Err(FabricsError::InvalidArgument(format!(
            "{blocks} blocks in one command (1 to 65536)"
        )));
    }
    let mut c = Command::new(op.0, 0, nsid);
    c.cdw10 = lba as u32;
    c.cdw11 = (lba >> 32) as u32;
    c.cdw12 = blocks - 1;
    Ok(c)
}
