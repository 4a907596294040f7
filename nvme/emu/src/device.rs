//! [`EmuDevice`]: a running software controller, implementing [`nvme::Device`].

use std::sync::atomic::Ordering;
use std::sync::{Arc, Mutex};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

use nvme::{Device, DmaAllocError, DmaMemory, RegisterIo};
use nvme_spec::{Cap, Csts};

use crate::config::{Backend, EmuConfig, NamespaceConfig};
use crate::controller::pages::VERSION;
use crate::controller::worker::Worker;
use crate::controller::{Controller, Shared, thread_for_cq};
use crate::doorbells::{AttachedWords, DoorbellWord};
use crate::error::EmuError;
use crate::faults::Faults;
use crate::memory::DeviceAddressMap;
use crate::queue_server::QueueServer;
use crate::registers::RegisterWindow;
use crate::stats::{Counters, EmuStats};
use crate::storage::{HostWriteError, HostWriteErrors, Media, MediaWrites, Namespace};

/// Longest [`EmuDevice::stop`] waits for the controller threads to finish their current pass.
const STOP_TIMEOUT: Duration = Duration::from_secs(5);

/// A software NVMe controller running on its own threads
/// ([`EmuConfig::controller_threads`]).
///
/// The driver reaches it only through [`Device`]: the register window and DMA memory from
/// [`Device::alloc_dma`]. Tests and tools additionally get the fault knobs, counters and the
/// device-address map.
pub struct EmuDevice {
    /// The register window, held directly (not through `shared`) so that driver register
    /// accesses never read a cache line a controller thread writes per command.
    regs: Arc<RegisterWindow>,
    shared: Arc<Shared>,
    threads: Mutex<Vec<JoinHandle<()>>>,
    description: String,
    namespace_configs: Vec<NamespaceConfig>,
    /// Each namespace's write count where its media is an image file (NSID order).
    media_writes: Vec<Option<MediaWrites>>,
    /// Per image-file namespace, the last host error its writes met.
    host_errors: Vec<HostWriteErrors>,
}

impl std::fmt::Debug for EmuDevice {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("EmuDevice")
            .field("description", &self.description)
            .field("csts", &self.shared.regs.csts())
            .finish()
    }
}

impl EmuDevice {
    /// Validates `config`, opens or allocates every namespace, and starts the controller
    /// threads. The controller starts disabled (CC.EN = 0), as after a power-on.
    pub fn start(config: EmuConfig) -> Result<Arc<EmuDevice>, EmuError> {
        config.validate()?;
        let namespaces = config
            .namespaces
            .iter()
            .enumerate()
            .map(|(i, ns)| Namespace::open(i as u32 + 1, ns, config.image_reads))
            .collect::<Result<Arc<[_]>, _>>()?;
        let cap = Cap::new()
            .with_mqes_z(config.mqes)
            .with_cqr(true)
            .with_to(2)
            .with_dstrd(0)
            .with_css(Cap::CSS_NVM)
            .with_mpsmin(0)
            .with_mpsmax(0);
        let regs = Arc::new(RegisterWindow::new(
            config.max_io_queue_pairs,
            cap.into_bits(),
            VERSION,
        ));
        let threads = config.resolved_controller_threads();
        let shared = Arc::new(Shared::new(
            regs.clone(),
            threads,
            config.max_io_queue_pairs,
            config.error_log_entries as usize,
        ));
        let description = describe(&config, threads);
        let workers: Vec<Worker> = (1..threads)
            .map(|i| Worker::new(i, shared.clone(), &config, namespaces.clone()))
            .collect();
        let namespace_configs = config.namespaces.clone();
        let media_writes = namespaces
            .iter()
            .map(|ns| match &ns.media {
                Media::File(f) => Some(f.writes.clone()),
                Media::Memory(_) | Media::Null | Media::Forwarded(_) => None,
            })
            .collect();
        let host_errors = namespaces
            .iter()
            .filter_map(|ns| match &ns.media {
                Media::File(f) => Some(f.errors.clone()),
                Media::Memory(_) | Media::Null | Media::Forwarded(_) => None,
            })
            .collect();
        let controller = Controller::new(shared.clone(), config, namespaces);
        let device = EmuDevice {
            regs,
            shared: shared.clone(),
            threads: Mutex::new(Vec::with_capacity(threads)),
            description,
            namespace_configs,
            media_writes,
            host_errors,
        };
        let spawn = |index: usize, body: Box<dyn FnOnce() + Send>| {
            std::thread::Builder::new()
                .name(format!("nvme-emu-{index}"))
                .spawn(body)
                .map_err(|source| EmuError::SpawnThread { source })
        };
        let mut handles = Vec::with_capacity(threads);
        // On failure, `device` is dropped, which stops the threads already started.
        handles.push(spawn(0, Box::new(move || controller.run()))?);
        for worker in workers {
            let index = handles.len();
            match spawn(index, Box::new(move || worker.run())) {
                Ok(h) => handles.push(h),
                Err(e) => {
                    *device.threads.lock().unwrap_or_else(|e| e.into_inner()) = handles;
                    return Err(e);
                }
            }
        }
        shared
            .regs
            .set_wakers(handles.iter().map(|h| h.thread().clone()).collect());
        *device.threads.lock().unwrap_or_else(|e| e.into_inner()) = handles;
        Ok(Arc::new(device))
    }

    /// Number of controller threads serving this controller's queues (at least 1):
    /// [`EmuConfig::controller_threads`] resolved. [`crate::controller_thread_index`] returns
    /// `0..` this on them.
    pub fn controller_threads(&self) -> usize {
        self.shared.threads()
    }

    /// The controller thread that serves I/O completion queue `cqid`, and every submission
    /// queue posting to it: `(cqid - 1) % controller_threads()` (the admin queues, id 0,
    /// belong to thread 0).
    pub fn thread_for_cq(&self, cqid: u16) -> usize {
        thread_for_cq(cqid, self.shared.threads())
    }

    /// The fault knobs; changes apply to commands fetched afterwards.
    pub fn faults(&self) -> &Faults {
        &self.shared.faults
    }

    /// The controller's device-address map, for registering memory that is not host memory
    /// (GPU regions) and for inspecting what the controller can reach.
    pub fn address_map(&self) -> &Arc<DeviceAddressMap> {
        &self.shared.map
    }

    /// Attaches external doorbells to I/O queue id `qid`: the submission queue `qid` and the
    /// completion queue `qid` created from now on take their SQ tail and CQ head from
    /// `sq_tail` and `cq_head` instead of the register window (for example words in a pinned
    /// host page that GPU threads write).
    ///
    /// Attach before creating the queues (Create I/O Completion/Submission Queue through the
    /// admin queue, as usual), with both words zeroed: a fresh queue starts at 0, and a
    /// nonzero value found at creation is reported as an invalid doorbell value and ignored
    /// until the word changes. From creation on, every new value of a word is validated as a
    /// register-window doorbell write is (a value not below the queue size, or a CQ head that
    /// passes entries not yet posted, gets an Error Information log entry and an Invalid
    /// Doorbell Write Value asynchronous event, once per distinct value, and is ignored), and
    /// writes to the queue's register-window doorbell are refused as writes to an invalid
    /// doorbell register. While such a queue exists the controller thread serving it polls
    /// and never parks.
    ///
    /// Refused ([`EmuError::AttachDoorbells`]) for a `qid` outside
    /// `1..=max_io_queue_pairs`, while submission or completion queue `qid` exists, or while
    /// words are already attached to it. Attachments outlive the queues and controller resets
    /// (CC.EN = 0 forgets the queues but not the attachment); remove them with
    /// [`EmuDevice::detach_external_doorbells`].
    pub fn attach_external_doorbells(
        &self,
        qid: u16,
        sq_tail: Arc<dyn DoorbellWord>,
        cq_head: Arc<dyn DoorbellWord>,
    ) -> Result<(), EmuError> {
        self.shared
            .doorbells
            .attach(qid, AttachedWords { sq_tail, cq_head })
    }

    /// Removes the external doorbells attached to `qid`, if any: queues created with that id
    /// afterwards use the register window again. A queue that exists keeps the word it was
    /// created with until it is deleted (or the controller reset), so detach after deleting
    /// the queues; deleting a queue is what stops the controller reading its word.
    pub fn detach_external_doorbells(&self, qid: u16) {
        self.shared.doorbells.detach(qid);
    }

    /// The namespaces as configured (NSID order): backends, sizes, LBA sizes.
    pub fn namespace_configs(&self) -> &[NamespaceConfig] {
        &self.namespace_configs
    }

    /// How many writes namespace `nsid`'s image file took so far, as it grows ([`MediaWrites`]);
    /// `None` for a namespace that is not an image file, or no such namespace.
    pub fn media_writes(&self, nsid: u32) -> Option<MediaWrites> {
        let i = (nsid as usize).checked_sub(1)?;
        self.media_writes.get(i)?.clone()
    }

    /// The last error the host gave a write or flush of an image file (any namespace), cleared:
    /// the cause behind a command that completed with Write Fault, e.g. a full host file system
    /// ([`HostWriteError::is_no_space`]). `None` if no write failed since the last call.
    pub fn take_host_write_error(&self) -> Option<HostWriteError> {
        self.host_errors.iter().find_map(HostWriteErrors::take)
    }

    /// Installs (or with `None` removes) the [`QueueServer`] that receives every I/O queue
    /// created from now on, in place of the controller threads. Queues that exist keep being
    /// served where they are until deleted. The admin queue, registers, Identify, features and
    /// logs stay with this controller.
    pub fn set_queue_server(&self, server: Option<Arc<dyn QueueServer>>) {
        *self
            .shared
            .queue_server
            .write()
            .unwrap_or_else(|e| e.into_inner()) = server;
    }

    /// A snapshot of the controller's counters (summed over its threads).
    pub fn stats(&self) -> EmuStats {
        Counters::snapshot(
            &self.shared.counters,
            self.shared.regs.doorbell_error_count(),
        )
    }

    /// The current Controller Status register.
    pub fn csts(&self) -> Csts {
        Csts::from(self.shared.regs.read_u32(nvme_spec::registers::CSTS))
    }

    /// Stops the controller threads (waiting a bounded time for them). Afterwards the register
    /// window reads as all ones, as a removed PCI device does, and nothing is processed.
    /// Dropping the last handle does the same.
    pub fn stop(&self) {
        self.shared.stop.store(true, Ordering::Release);
        self.shared.regs.set_gone();
        self.shared.regs.wake_all();
        let handles = std::mem::take(&mut *self.threads.lock().unwrap_or_else(|e| e.into_inner()));
        let deadline = Instant::now() + STOP_TIMEOUT;
        // Every thread woken first, so they wind down together rather than one per wait.
        for handle in &handles {
            handle.thread().unpark();
        }
        for handle in handles {
            // Short pauses first (a woken thread ends within microseconds; a close costs
            // one pause per thread that is still running), up to 1 ms.
            let mut pause = Duration::from_micros(10);
            while !handle.is_finished() {
                if Instant::now() >= deadline {
                    tracing::warn!(
                        "software NVMe controller thread did not stop; leaving it behind"
                    );
                    return;
                }
                // Before the wakers are registered (a failed start) a thread notices the flag
                // within a park's length.
                handle.thread().unpark();
                std::thread::sleep(pause);
                pause = (pause * 2).min(Duration::from_millis(1));
            }
            let _ = handle.join();
        }
    }
}

impl Drop for EmuDevice {
    fn drop(&mut self) {
        self.stop();
    }
}

impl Device for EmuDevice {
    fn registers(&self) -> &dyn RegisterIo {
        &*self.regs
    }

    fn write_doorbell(&self, offset: usize, value: u32) {
        self.regs.write_u32(offset, value);
    }

    fn alloc_dma(&self, len: usize) -> Result<DmaMemory, DmaAllocError> {
        crate::host_memory::alloc_dma(&self.shared.map, len)
    }

    fn describe(&self) -> String {
        self.description.clone()
    }
}

fn describe(config: &EmuConfig, threads: usize) -> String {
    let nss: Vec<String> = config
        .namespaces
        .iter()
        .enumerate()
        .map(|(i, ns)| {
            let size = human_bytes(ns.bytes());
            let at = match &ns.backend {
                Backend::Memory => "in memory".to_string(),
                Backend::File(p) => format!("over {}", p.display()),
                Backend::Null => "null (no data)".to_string(),
                Backend::Forwarded(f) => format!("forwarded to {f:?}"),
            };
            format!("ns{} {size} {at}, {} B blocks", i + 1, ns.lba_size)
        })
        .collect();
    let threads = match threads {
        1 => "1 controller thread".to_string(),
        n => format!("{n} controller threads"),
    };
    if nss.is_empty() {
        format!("software NVMe controller (no namespaces; {threads})")
    } else {
        format!("software NVMe controller ({}; {threads})", nss.join("; "))
    }
}

fn human_bytes(b: u64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut unit = 0;
    let mut v = b;
    while unit + 1 < UNITS.len() && v >= 1024 && v % 1024 == 0 {
        v /= 1024;
        unit += 1;
    }
    format!("{v} {}", UNITS[unit])
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn descriptions() {
        assert_eq!(
            describe(&EmuConfig::default(), 1),
            "software NVMe controller (ns1 64 MiB in memory, 512 B blocks; 1 controller thread)"
        );
        assert_eq!(
            describe(&EmuConfig::default(), 4),
            "software NVMe controller (ns1 64 MiB in memory, 512 B blocks; 4 controller threads)"
        );
        assert_eq!(human_bytes(1536), "1536 B");
    }
}
