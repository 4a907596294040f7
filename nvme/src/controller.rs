//! Controller bring-up and shutdown (NVMe Base 2.0, section 3.5 "Controller Initialization"
//! and section 3.6 "Shutdown Processing"), and the handle everything else hangs off.
//!
//! Bring-up: read CAP (all ones: device gone), disable (CC.EN = 0, wait CSTS.RDY = 0 within
//! CAP.TO), program AQA/ASQ/ACQ, enable with 4 KiB pages and 64/16-byte entries, wait
//! CSTS.RDY = 1 within CAP.TO, then Identify Controller, the active namespace list, Identify
//! Namespace for each, and Set Features (Number of Queues).
//!
//! Shutdown: delete the I/O queues still alive ([`crate::queue_lifecycle`]), set CC.SHN = 01b
//! (normal) and wait for CSTS.SHST = 10b within RTD3E (or 10 s, or the configured timeout).
//!
//! I/O queue pairs are made on top of this handle: [`Controller::create_queue_pair_on`] forwards
//! to [`crate::queue_lifecycle`], and [`crate::io`] adds `Controller::create_io_queue_pair`
//! (this module does not depend on `io`).

#![forbid(unsafe_code)]

use crate::admin::{AdminChannel, AdminQueue};
use crate::device::Device;
use crate::dma::DmaSlice;
use crate::error::Error;
use crate::namespace::{Namespace, NamespaceUnusable, SkippedNamespace};
use crate::prp::MAX_PRP_TRANSFER;
use crate::queue_lifecycle::{CreatedQueuePair, QueueLifecycle, QueueLimits, QueueRegions};
use crate::registers::Registers;
use nvme_spec::command::{NumberOfQueues, SQE_SIZE_LOG2};
use nvme_spec::completion::CQE_SIZE_LOG2;
use nvme_spec::identify::trim_identify_string;
use nvme_spec::wire::doorbell_stride;
use nvme_spec::{
    ActiveNamespaceList, Aqa, Cap, Cc, Cns, Csi, Csts, FeatureId, IdentifyController,
    IdentifyNamespace, Oncs,
};
use std::sync::Arc;
use std::time::Duration;

/// Most namespaces the driver identifies at bring-up.
const MAX_NAMESPACES: usize = 1024;
/// Shortest wait for CSTS.RDY, whatever CAP.TO says.
const MIN_READY_TIMEOUT: Duration = Duration::from_millis(500);
/// Shutdown wait when RTD3E is zero and no timeout is configured.
const DEFAULT_SHUTDOWN_TIMEOUT: Duration = Duration::from_secs(10);

/// How to bring a controller up.
#[derive(Clone, Debug)]
pub struct ControllerOptions {
    /// Entries in each admin queue (clamped to 2..=min(4096, CAP.MQES + 1)).
    pub admin_queue_depth: u16,
    /// Bound on each admin command.
    pub admin_timeout: Duration,
    /// Bound on each I/O command.
    pub io_timeout: Duration,
    /// Bound on the shutdown handshake; `None` uses RTD3E when the controller reports it, else
    /// 10 s.
    pub shutdown_timeout: Option<Duration>,
    /// I/O queue pairs to ask for with Set Features (Number of Queues).
    pub io_queue_pairs_wanted: u16,
}

impl Default for ControllerOptions {
    fn default() -> Self {
        Self {
            admin_queue_depth: 32,
            admin_timeout: Duration::from_secs(10),
            io_timeout: Duration::from_secs(30),
            shutdown_timeout: None,
            io_queue_pairs_wanted: 64,
        }
    }
}

/// What bring-up learned about the controller.
#[derive(Clone, Debug)]
pub struct ControllerInfo {
    /// PCI Vendor ID.
    pub vid: u16,
    /// PCI Subsystem Vendor ID.
    pub ssvid: u16,
    /// Serial number, trimmed.
    pub sn: String,
    /// Model number, trimmed.
    pub mn: String,
    /// Firmware revision, trimmed.
    pub fr: String,
    /// Controller ID.
    pub cntlid: u16,
    /// Version from the VS register: (major, minor, tertiary).
    pub version: (u16, u8, u8),
    /// Maximum Data Transfer Size in bytes; `None` when the controller sets no limit.
    pub mdts_bytes: Option<u64>,
    /// What the driver allows per command: MDTS capped at 2 MiB (one PRP list page).
    pub max_transfer_bytes: usize,
    /// I/O queue pairs granted by the controller (and usable at once).
    pub max_io_queue_pairs: u16,
    /// Maximum entries per queue (CAP.MQES + 1).
    pub mqes_entries: u32,
    /// Doorbell stride exponent (CAP.DSTRD): doorbells are `4 << dstrd` bytes apart, queue
    /// `qid`'s SQ tail at `0x1000 + 2 * qid * (4 << dstrd)` (see [`nvme_spec::wire`]).
    pub dstrd: u8,
    /// Number of namespaces (Identify Controller NN).
    pub nn: u32,
    /// A volatile write cache is present (Flush matters).
    pub vwc: bool,
    /// Write Zeroes is supported.
    pub write_zeroes: bool,
    /// Dataset Management (deallocate) is supported.
    pub dsm: bool,
    /// RTD3 Entry Latency in microseconds (0 = not reported).
    pub rtd3e_us: u32,
    /// The CAP register.
    pub cap: Cap,
    /// CAP.TO as a duration (how long CSTS.RDY may take to change).
    pub ready_timeout: Duration,
}

/// An initialized NVMe controller: admin queue, identify data, namespaces. `Send + Sync`; I/O
/// goes through [`crate::IoQueuePair`]s created from it, or through rings someone else drives,
/// created with [`Controller::create_queue_pair_on`].
pub struct Controller {
    device: Arc<dyn Device>,
    opts: ControllerOptions,
    info: ControllerInfo,
    identify: Box<IdentifyController>,
    namespaces: Arc<[Namespace]>,
    skipped: Arc<[SkippedNamespace]>,
    admin: Arc<AdminChannel>,
    queues: Arc<QueueLifecycle>,
    done: bool,
}

impl std::fmt::Debug for Controller {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Controller")
            .field("device", &self.device.describe())
            .field("info", &self.info)
            .finish()
    }
}

impl Controller {
    /// Resets and enables the controller behind `device`, identifies it and its namespaces, and
    /// negotiates the number of I/O queues.
    pub fn new(device: Arc<dyn Device>, opts: ControllerOptions) -> Result<Self, Error> {
        let regs = Registers::new(device.registers());
        let cap = regs.cap()?;
        if cap.css() & Cap::CSS_NVM == 0 {
            return Err(Error::Unsupported(format!(
                "the NVM command set (CAP.CSS {:#x})",
                cap.css()
            )));
        }
        if cap.mpsmin() != 0 {
            return Err(Error::Unsupported(format!(
                "4 KiB memory pages (CAP.MPSMIN {} = {} bytes)",
                cap.mpsmin(),
                cap.min_page_size()
            )));
        }
        if cap.mqes_z() == 0 {
            return Err(Error::Unsupported(
                "queues of at least 2 entries (CAP.MQES = 0)".into(),
            ));
        }
        let ready_timeout = Duration::from_millis(cap.timeout_ms()).max(MIN_READY_TIMEOUT);
        let vs = regs.vs()?;

        disable(&regs, ready_timeout)?;

        let admin_depth = opts
            .admin_queue_depth
            .clamp(2, cap.max_queue_entries().min(4096) as u16);
        let admin = AdminQueue::new(device.clone(), admin_depth, cap.dstrd(), opts.admin_timeout)?;
        regs.set_aqa(
            Aqa::new()
                .with_asqs_z(admin.depth() - 1)
                .with_acqs_z(admin.depth() - 1),
        );
        regs.set_asq(admin.sq_address());
        regs.set_acq(admin.cq_address());
        let cc = Cc::new()
            .with_en(true)
            .with_css(Cc::CSS_NVM)
            .with_mps(0)
            .with_ams(0)
            .with_shn(Cc::SHN_NONE)
            .with_iosqes(SQE_SIZE_LOG2)
            .with_iocqes(CQE_SIZE_LOG2);
        regs.set_cc(cc);
        let (csts, ready) = regs.wait_csts(ready_timeout, |c| c.rdy() || c.cfs())?;
        if csts.cfs() || !ready {
            regs.set_cc(cc.with_en(false));
        }
        if csts.cfs() {
            return Err(Error::ControllerFatal { csts: csts.into() });
        }
        if !ready {
            return Err(Error::ReadyTimeout {
                ready: true,
                waited: ready_timeout,
                csts: csts.into(),
            });
        }

        let mut admin = admin;
        let identified = identify_all(&mut admin, opts.io_queue_pairs_wanted);
        let (identify, (namespaces, skipped), granted) = match identified {
            Ok(v) => v,
            Err(e) => {
                // Leave the controller disabled, so it stops using the admin queue memory
                // that is about to be freed.
                regs.set_cc(cc.with_en(false));
                return Err(e);
            }
        };
        let wanted = opts.io_queue_pairs_wanted.clamp(1, u16::MAX - 1);
        let max_io_queue_pairs = (granted.nsq_z() as u32 + 1)
            .min(granted.ncq_z() as u32 + 1)
            .min(wanted as u32) as u16;

        let mdts_bytes = match identify.mdts {
            0 => None,
            m if m as u32 + 12 + (cap.mpsmin() as u32) >= 63 => None,
            m => Some(cap.min_page_size() << m),
        };
        let max_transfer_bytes =
            mdts_bytes.map_or(MAX_PRP_TRANSFER, |m| (m as usize).min(MAX_PRP_TRANSFER));
        let oncs = identify.oncs_flags();
        let info = ControllerInfo {
            vid: identify.vid,
            ssvid: identify.ssvid,
            sn: ascii(&identify.sn),
            mn: ascii(&identify.mn),
            fr: ascii(&identify.fr),
            cntlid: identify.cntlid,
            version: (vs.mjr(), vs.mnr(), vs.ter()),
            mdts_bytes,
            max_transfer_bytes,
            max_io_queue_pairs,
            mqes_entries: cap.max_queue_entries(),
            dstrd: cap.dstrd(),
            nn: identify.nn,
            vwc: identify.has_volatile_write_cache(),
            write_zeroes: oncs.contains(Oncs::WRITE_ZEROES),
            dsm: oncs.contains(Oncs::DATASET_MANAGEMENT),
            rtd3e_us: identify.rtd3e,
            cap,
            ready_timeout,
        };
        tracing::debug!(?info, namespaces = namespaces.len(), "controller ready");
        let admin = Arc::new(AdminChannel::new(admin));
        let queues = Arc::new(QueueLifecycle::new(
            admin.clone(),
            QueueLimits {
                granted: max_io_queue_pairs,
                max_entries: cap.max_queue_entries(),
                cqr: cap.cqr(),
                dstrd: cap.dstrd(),
            },
        ));
        Ok(Self {
            device,
            opts,
            info,
            identify,
            namespaces: namespaces.into(),
            skipped: skipped.into(),
            admin,
            queues,
            done: false,
        })
    }

    /// What bring-up learned.
    pub fn info(&self) -> &ControllerInfo {
        &self.info
    }

    /// The Identify Controller data the controller was brought up with.
    pub fn identify_data(&self) -> &IdentifyController {
        &self.identify
    }

    /// The Identify Controller data.
    pub fn identify_controller(&self) -> &IdentifyController {
        &self.identify
    }

    /// The active namespaces the driver can use, in NSID order.
    pub fn namespaces(&self) -> &[Namespace] {
        &self.namespaces
    }

    /// The active namespaces the driver refuses (metadata formats, other command sets), with
    /// the reason, in NSID order.
    pub fn skipped_namespaces(&self) -> &[SkippedNamespace] {
        &self.skipped
    }

    /// The namespaces, shared (for queue pairs that validate commands against them).
    pub(crate) fn namespaces_shared(&self) -> (Arc<[Namespace]>, Arc<[SkippedNamespace]>) {
        (self.namespaces.clone(), self.skipped.clone())
    }

    /// The namespace `nsid`: [`Error::NamespaceUnsupported`] (with the reason) for one the
    /// driver refuses, [`Error::NoSuchNamespace`] for one that is not there.
    pub fn namespace(&self, nsid: u32) -> Result<&Namespace, Error> {
        find_namespace(&self.namespaces, &self.skipped, nsid)
    }

    /// The options the controller was brought up with.
    pub fn options(&self) -> &ControllerOptions {
        &self.opts
    }

    /// Raises the admin command timeout to `at_least` from the next command on (never lowers
    /// it; [`ControllerOptions::admin_timeout`] was the first value) and returns the timeout in
    /// force: for a controller whose admin commands wait on something slower than a
    /// controller's own processing, such as a GPU-resident controller model taking a queue
    /// change only when all its warps have seen it.
    pub fn raise_admin_timeout(&self, at_least: Duration) -> Duration {
        self.admin.raise_timeout(at_least)
    }

    /// The transport.
    pub fn device(&self) -> &Arc<dyn Device> {
        &self.device
    }

    /// Distance in bytes between doorbell registers in BAR0 (`4 << CAP.DSTRD`), for transports
    /// that ring doorbells themselves.
    pub fn doorbell_stride(&self) -> usize {
        doorbell_stride(self.info.dstrd)
    }

    /// Whether shutdown has begun.
    pub(crate) fn is_shut_down(&self) -> bool {
        self.admin.is_shut_down()
    }

    /// Reads CSTS now (all ones → [`Error::DeviceGone`]).
    pub fn csts(&self) -> Result<Csts, Error> {
        Registers::new(self.device.registers()).csts()
    }

    /// Creates an I/O queue pair on rings the caller supplies and will drive itself: allocates a
    /// queue id, then Create I/O Completion Queue and Create I/O Submission Queue (PC = 1,
    /// interrupts off, the SQ posting to the CQ of the same id).
    ///
    /// Checked before anything reaches the controller, each with a typed error: entries in
    /// 2..=CAP.MQES + 1 ([`Error::InvalidQueueEntries`]), each region at least
    /// `entries * entry size` bytes ([`Error::QueueRegionTooSmall`]) and contiguous in device
    /// address space over them ([`Error::Unsupported`]), a queue id free
    /// ([`Error::NoQueueAvailable`]). If the SQ cannot be created the CQ is deleted again.
    ///
    /// The returned pair holds the regions, names the doorbells, and deletes both queues when
    /// dropped; [`Controller::shutdown`] deletes it too and marks it deleted.
    pub fn create_queue_pair_on(&self, regions: QueueRegions) -> Result<CreatedQueuePair, Error> {
        self.queues.create(regions, |_| Ok(()))
    }

    /// Like [`Controller::create_queue_pair_on`], and runs `prepare(qid)` once the queue id is
    /// chosen, before the queues are created: for transports that must set something up per
    /// queue id first (a doorbell mapping, say). If `prepare` fails, its error is returned and
    /// the queue id freed; nothing reached the controller. `prepare` runs under no lock of the
    /// controller, so it may use the controller, but a shutdown meanwhile makes the creation
    /// fail with [`Error::ShutDown`].
    pub fn create_queue_pair_on_with(
        &self,
        regions: QueueRegions,
        prepare: impl FnOnce(u16) -> Result<(), Error>,
    ) -> Result<CreatedQueuePair, Error> {
        self.queues.create(regions, prepare)
    }

    /// Creates a queue pair on each of `all` like [`Controller::create_queue_pair_on_with`]
    /// (`prepare(i, qid)` for the `i`th), all or none, the creations in flight together on the
    /// admin queue: a few round trips for any number of pairs instead of two each. If any
    /// fails, the ones created are deleted again and the first failure is returned (queue ids
    /// freed where the controller surely has no queue with them, as for one pair).
    pub fn create_queue_pairs_on_with(
        &self,
        all: Vec<QueueRegions>,
        prepare: impl FnMut(usize, u16) -> Result<(), Error>,
    ) -> Result<Vec<CreatedQueuePair>, Error> {
        self.queues.create_many(all, prepare)
    }

    /// Reads log page `lid` for namespace `nsid` (0xFFFF_FFFF: controller-wide; 0 when the
    /// log is not namespace specific) into `buf`, whose length (a multiple of 4) sets the
    /// number of bytes read.
    pub fn get_log_page(&self, lid: u8, nsid: u32, buf: &DmaSlice) -> Result<(), Error> {
        self.get_log_page_at(lid, nsid, 0, buf)
    }

    /// Like [`Controller::get_log_page`], starting `offset` bytes into the log.
    pub fn get_log_page_at(
        &self,
        lid: u8,
        nsid: u32,
        offset: u64,
        buf: &DmaSlice,
    ) -> Result<(), Error> {
        if buf.len > self.info.max_transfer_bytes {
            return Err(Error::TransferTooLarge {
                len: buf.len,
                max: self.info.max_transfer_bytes,
            });
        }
        self.admin.run(|a| a.get_log_page(lid, nsid, offset, buf))
    }

    /// Get Features (current value) for `fid` with the given CDW11; returns Dword 0 of the
    /// completion.
    pub fn get_features(&self, fid: FeatureId, cdw11: u32) -> Result<u32, Error> {
        self.admin.run(|a| a.get_features(fid, cdw11))
    }

    /// Set Features for `fid` with the given CDW11; returns Dword 0 of the completion.
    pub fn set_features(&self, fid: FeatureId, cdw11: u32) -> Result<u32, Error> {
        self.admin.run(|a| a.set_features(fid, cdw11))
    }

    /// Identify Namespace `nsid` again (e.g. to see current utilization).
    pub fn identify_namespace(&self, nsid: u32) -> Result<Box<IdentifyNamespace>, Error> {
        self.admin.run(|a| a.identify(Cns::NAMESPACE, nsid))
    }

    /// Orderly shutdown: deletes the I/O queues still alive, CPU [`crate::IoQueuePair`]s and
    /// caller-supplied [`CreatedQueuePair`]s alike, and marks each one deleted (held elsewhere,
    /// they then refuse work; [`CreatedQueuePair::delete`] returns `Ok`); sets CC.SHN to normal
    /// and waits for CSTS.SHST = complete. The first error is returned after the handshake.
    pub fn shutdown(mut self) -> Result<(), Error> {
        self.done = true;
        self.shut_down()
    }

    fn shut_down(&self) -> Result<(), Error> {
        let Some(queues) = self.queues.shutdown() else {
            return Ok(());
        };
        let regs = Registers::new(self.device.registers());
        let cc = regs.cc()?;
        if !cc.en() {
            return queues;
        }
        regs.set_cc(cc.with_shn(Cc::SHN_NORMAL));
        let timeout = self
            .opts
            .shutdown_timeout
            .unwrap_or(if self.info.rtd3e_us != 0 {
                Duration::from_micros(self.info.rtd3e_us as u64).max(Duration::from_secs(1))
            } else {
                DEFAULT_SHUTDOWN_TIMEOUT
            });
        let (csts, done) =
            regs.wait_csts(timeout, |c| c.shst() == Csts::SHST_COMPLETE || c.cfs())?;
        if csts.cfs() {
            return Err(Error::ControllerFatal { csts: csts.into() });
        }
        if !done {
            return Err(Error::ShutdownTimeout {
                waited: timeout,
                csts: csts.into(),
            });
        }
        queues
    }
}

impl Drop for Controller {
    fn drop(&mut self) {
        if !self.done {
            if let Err(e) = self.shut_down() {
                tracing::warn!(error = %e, "controller shutdown on drop failed");
            }
        }
    }
}

/// The namespace `nsid` among `usable`, or the error that says why not.
pub(crate) fn find_namespace<'a>(
    usable: &'a [Namespace],
    skipped: &[SkippedNamespace],
    nsid: u32,
) -> Result<&'a Namespace, Error> {
    if let Some(ns) = usable.iter().find(|n| n.nsid == nsid) {
        return Ok(ns);
    }
    match skipped.iter().find(|n| n.nsid == nsid) {
        Some(s) => Err(Error::NamespaceUnsupported {
            nsid,
            why: s.why.to_string(),
        }),
        None => Err(Error::NoSuchNamespace { nsid }),
    }
}

/// The namespaces the driver drives, and those it refuses.
type NamespaceLists = (Vec<Namespace>, Vec<SkippedNamespace>);

/// Identify Controller, the namespaces, and Set Features (Number of Queues); returns the
/// identify data, the namespaces and the queue counts the controller allocated.
fn identify_all(
    admin: &mut AdminQueue,
    wanted: u16,
) -> Result<(Box<IdentifyController>, NamespaceLists, NumberOfQueues), Error> {
    let identify: Box<IdentifyController> = admin.identify(Cns::CONTROLLER, 0)?;
    let namespaces = identify_namespaces(admin, identify.nn)?;
    let wanted = wanted.clamp(1, u16::MAX - 1);
    let request = NumberOfQueues::new()
        .with_nsq_z(wanted - 1)
        .with_ncq_z(wanted - 1);
    let granted = match admin.set_features(FeatureId::NUMBER_OF_QUEUES, request.into()) {
        Ok(dw0) => dw0,
        Err(e @ Error::Nvme { .. }) => {
            tracing::warn!(error = %e, "Set Features (Number of Queues) failed; asking Get Features");
            admin.get_features(FeatureId::NUMBER_OF_QUEUES, 0)?
        }
        Err(e) => return Err(e),
    };
    Ok((identify, namespaces, NumberOfQueues::from(granted)))
}

/// CC.EN = 0 and wait for CSTS.RDY = 0 (NVMe Base 2.0, section 3.5.1).
fn disable(regs: &Registers<'_>, timeout: Duration) -> Result<(), Error> {
    let cc = regs.cc()?;
    let csts = regs.csts()?;
    if cc.en() && !csts.rdy() && !csts.cfs() {
        // An enable is in progress: the spec asks the host to let it finish before clearing EN.
        regs.wait_csts(timeout, |c| c.rdy() || c.cfs())?;
    }
    if cc.en() || csts.rdy() {
        regs.set_cc(cc.with_en(false).with_shn(Cc::SHN_NONE));
    }
    let (csts, done) = regs.wait_csts(timeout, |c| !c.rdy())?;
    if !done {
        return Err(Error::ReadyTimeout {
            ready: false,
            waited: timeout,
            csts: csts.into(),
        });
    }
    if csts.cfs() {
        return Err(Error::ControllerFatal { csts: csts.into() });
    }
    Ok(())
}

/// The active namespace list (CNS 02h, paged 1024 at a time), Identify Namespace for each and
/// its command set (CNS 03h's CSI descriptor; NVM where the controller gives none). Namespaces
/// the driver cannot use are returned apart, with the reason, and logged.
fn identify_namespaces(admin: &mut AdminQueue, nn: u32) -> Result<NamespaceLists, Error> {
    let mut nsids = Vec::new();
    let mut start = 0u32;
    'pages: loop {
        let list: Box<ActiveNamespaceList> = match admin.identify(Cns::ACTIVE_NAMESPACES, start) {
            Ok(l) => l,
            Err(Error::Nvme { status, .. }) if start == 0 => {
                // Pre-1.1 controllers lack CNS 02h: probe 1..=NN instead.
                tracing::debug!(%status, "no active namespace list; probing 1..=NN");
                nsids = (1..=nn.min(MAX_NAMESPACES as u32)).collect();
                break;
            }
            Err(e) => return Err(e),
        };
        let mut count = 0;
        for nsid in list.iter() {
            count += 1;
            if nsid <= start || nsid == u32::MAX {
                tracing::warn!(
                    nsid,
                    "active namespace list not increasing; ignoring the rest"
                );
                break 'pages;
            }
            nsids.push(nsid);
            start = nsid;
            if nsids.len() == MAX_NAMESPACES {
                break 'pages;
            }
        }
        if count < list.nsids.len() {
            break;
        }
    }
    let mut namespaces = Vec::with_capacity(nsids.len());
    let mut skipped = Vec::new();
    for nsid in nsids {
        let id: Box<IdentifyNamespace> = admin.identify(Cns::NAMESPACE, nsid)?;
        let csi = match admin.identify::<[u8; 4096]>(Cns::NAMESPACE_DESCRIPTORS, nsid) {
            Ok(page) => nvme_spec::descriptor_csi(&page[..]).unwrap_or(Csi::NVM),
            // Before NVMe 1.3 there is no descriptor list: every namespace is NVM.
            Err(Error::Nvme { .. }) => Csi::NVM,
            Err(e) => return Err(e),
        };
        let identify = Arc::new(*id);
        match Namespace::from_identify(nsid, *identify, csi) {
            Ok(ns) => namespaces.push(ns),
            Err(NamespaceUnusable::Inactive) => {
                tracing::debug!(nsid, "listed as active but of size zero; ignored");
            }
            Err(why) => {
                tracing::warn!(nsid, %why, "namespace refused");
                skipped.push(SkippedNamespace {
                    nsid,
                    why,
                    csi,
                    identify,
                });
            }
        }
    }
    Ok((namespaces, skipped))
}

fn ascii(bytes: &[u8]) -> String {
    String::from_utf8_lossy(trim_identify_string(bytes)).into_owned()
}
