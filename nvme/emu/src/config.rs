//! Configuration of the software controller: namespaces and their backing, limits, identity.

use std::fs::{File, OpenOptions};
use std::path::{Path, PathBuf};

use crate::error::EmuError;

/// Largest [`EmuConfig::external_batch`].
pub const MAX_EXTERNAL_BATCH: u32 = 4096;

/// Largest [`EmuConfig::controller_threads`].
pub const MAX_CONTROLLER_THREADS: usize = 64;

/// How the controller reads the blocks of an image file ([`Backend::File`]).
///
/// A `pread` per Read costs the controller thread more than everything else it does for a
/// 4 KiB Read (the system call and the page-cache lookup): copying from a mapping about
/// doubles a queue's 4 KiB random reads.
/// A mapping turns an I/O error of the file into `SIGBUS` rather than an error status, and
/// so does truncating the image under a running controller (which its lock forbids): hence
/// mapped reads by default only where the image lives in memory.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum ImageReads {
    /// [`ImageReads::Mapped`] for images on tmpfs or ramfs (memory: no I/O error can come
    /// out of a copy), [`ImageReads::Pread`] elsewhere; the setting
    /// `NVME_EMU_IMAGE_READS` (`mapped` or `pread`, docs/settings.md) overrides the choice.
    #[default]
    Auto,
    /// Every Read is a positioned read (`pread`) of the file: a failing disk gives an
    /// Unrecovered Read Error.
    Pread,
    /// Reads below [`MAPPED_READ_MAX`] bytes copy their blocks from a shared, read-only
    /// mapping of the image (no system call); larger ones stay positioned reads (one system
    /// call per 64 KiB or more costs little, and they reach the destination's own file path,
    /// such as a GPU transport's copy engines). Writes stay positioned writes; reads and writes
    /// of the same 2 MiB stripe exclude each other. Reading blocks of a sparse image on tmpfs
    /// that were never written allocates their pages (a `pread` of a hole does not).
    Mapped,
}

/// Reads below this many bytes go through the mapping under [`ImageReads::Mapped`].
pub const MAPPED_READ_MAX: usize = 64 << 10;

impl ImageReads {
    /// Whether reads of an image go through a mapping: `self`, with [`ImageReads::Auto`]
    /// decided by `env` (the value of `NVME_EMU_IMAGE_READS`: `mapped` or `pread`, anything
    /// else an [`EmuError::InvalidConfig`]) and else by whether the image is in memory.
    pub fn mapped(self, env: Option<&str>, in_memory: bool) -> Result<bool, EmuError> {
        Ok(match self {
            ImageReads::Pread => false,
            ImageReads::Mapped => true,
            ImageReads::Auto => match env.map(str::trim) {
                Some("mapped") => true,
                Some("pread") => false,
                None | Some("") => in_memory,
                Some(v) => {
                    return Err(EmuError::InvalidConfig {
                        reason: gpunvme_settings::EMU_IMAGE_READS.invalid(v).to_string(),
                    });
                }
            },
        })
    }
}

/// Where a namespace's blocks live.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Backend {
    /// In memory, zeroed at start, lost when the controller stops.
    Memory,
    /// In a file (a persistent disk image) of exactly `blocks * lba_size` bytes, written with
    /// positioned I/O and read with it or through a mapping ([`EmuConfig::image_reads`]); Flush (and FUA, and every write while the volatile write
    /// cache is disabled) calls `fdatasync`. The controller holds a `flock(2)` on the file while
    /// it runs: exclusive, or shared for a [`NamespaceConfig::read_only`] namespace (opened
    /// read-only). Starting a controller on an image locked in a conflicting way fails with
    /// [`EmuError::ImageBusy`].
    File(PathBuf),
    /// No storage: commands are fully validated, including walking their PRPs, but reads and
    /// writes move no data (a read leaves the host buffer as it was). For measuring per-command
    /// overhead.
    Null,
    /// On another NVMe controller, reached through the embedder's [`crate::Forwarder`] (an
    /// NVMe over Fabrics connection): reads and writes are checked here and forwarded, several
    /// in flight per controller thread ([`crate::forward`]). `blocks` and `lba_size` must be
    /// the far namespace's; its format must be plain.
    Forwarded(crate::forward::Forwarded),
}

/// One namespace.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct NamespaceConfig {
    /// Where the blocks live.
    pub backend: Backend,
    /// Size in logical blocks (NSZE).
    pub blocks: u64,
    /// Logical block size in bytes: 512 or 4096.
    pub lba_size: u32,
    /// Write protected: Write, Write Zeroes and Dataset Management with Deallocate fail with
    /// Namespace Is Write Protected, and Identify Namespace says so (NSATTR bit 0). An image
    /// file is then opened read-only under a shared lock, so several controllers (processes)
    /// can read one image together, and images the user cannot write (read-only mounts,
    /// `chattr +i`, mode 0444) can be served.
    pub read_only: bool,
    /// How the namespace is formatted and which command set it follows (default: NVM, no
    /// metadata).
    pub format: NsFormat,
}

/// A namespace's format and command set, for tests of how hosts treat each kind.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub enum NsFormat {
    /// NVM command set, no metadata.
    #[default]
    Plain,
    /// NVM with 8 bytes of metadata holding end-to-end protection information of `pi_type`
    /// (1-3; in the first 8 bytes if `first_bytes`). Reads and writes must set PRACT (the
    /// controller inserts and strips the PI, so the host moves plain data; otherwise the host
    /// would have to supply metadata, which this controller does not take): without it they
    /// fail with Invalid Field in Command. With reference tag checking (PRCHK bit 0, types 1 and
    /// 2), CDW14 must be the starting LBA's low 32 bits, else End-to-end Reference Tag Check
    /// Error.
    Pi {
        /// Protection information type, 1 to 3.
        pi_type: u8,
        /// PI in the first 8 bytes of the metadata (DPS bit 3).
        first_bytes: bool,
    },
    /// NVM with `ms` bytes of metadata per block and no protection information: every Read and
    /// Write fails with Invalid Field in Command (this controller takes no metadata).
    Metadata {
        /// Metadata bytes per block.
        ms: u16,
        /// At the end of each block (extended LBA, FLBAS bit 4), else a separate buffer.
        extended: bool,
    },
    /// A namespace of the Zoned Namespace command set (CSI 02h in its identification
    /// descriptors): reads work; Write and Write Zeroes fail with Zone Invalid Write, as they
    /// would outside a zone's write pointer.
    Zoned,
}

impl NamespaceConfig {
    /// A memory-backed namespace of `bytes` bytes (rounded down to whole blocks).
    pub fn memory(bytes: u64, lba_size: u32) -> Self {
        Self {
            backend: Backend::Memory,
            blocks: bytes / lba_size.max(1) as u64,
            lba_size,
            read_only: false,
            format: NsFormat::Plain,
        }
    }

    /// A null namespace of `bytes` bytes (rounded down to whole blocks).
    pub fn null(bytes: u64, lba_size: u32) -> Self {
        Self {
            backend: Backend::Null,
            blocks: bytes / lba_size.max(1) as u64,
            lba_size,
            read_only: false,
            format: NsFormat::Plain,
        }
    }

    /// Size in bytes.
    pub fn bytes(&self) -> u64 {
        self.blocks.saturating_mul(self.lba_size as u64)
    }
}

/// Configuration of a software controller.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct EmuConfig {
    /// Namespaces, in NSID order (NSID 1 first). May be empty.
    pub namespaces: Vec<NamespaceConfig>,
    /// Maximum Data Transfer Size: `2^mdts` memory pages (4 KiB); 0 means no limit.
    pub mdts: u8,
    /// Most I/O queue pairs the controller grants (1..=65535).
    pub max_io_queue_pairs: u16,
    /// CAP.MQES: largest queue size, zero-based (1..=65535; 1023 means 1024 entries).
    pub mqes: u16,
    /// Complete each batch of fetched commands in reverse order (completions are allowed to
    /// be out of order; this makes drivers prove they match on command id).
    pub reorder_completions: bool,
    /// Serial number (up to 20 ASCII characters).
    pub serial: String,
    /// Model number (up to 40 ASCII characters).
    pub model: String,
    /// Firmware revision (up to 8 ASCII characters).
    pub firmware: String,
    /// PCI vendor id (also used as subsystem vendor id).
    pub vendor_id: u16,
    /// Error Information log entries kept (ELPE + 1; 1..=256).
    pub error_log_entries: u16,
    /// Asynchronous Event Request commands the controller holds at once (AERL + 1; 1..=16).
    pub async_event_limit: u8,
    /// Most commands fetched from one queue with external doorbells per pass (1..=4096;
    /// queues with register-window doorbells fetch at most 64). Larger batches mean fewer,
    /// bigger copies for queue memory reached through costly transfers (GPU memory).
    pub external_batch: u32,
    /// Controller threads serving the queues (0..=64; 0 = automatic). Thread 0 runs the
    /// register state machine and the admin queue and serves I/O queues too; each I/O
    /// completion queue, with every submission queue posting to it, is served by thread
    /// `(cqid - 1) % n` alone. The count is capped at `max_io_queue_pairs` (more threads could
    /// never get a queue). Automatic: the value of the environment variable
    /// `NVME_EMU_CONTROLLER_THREADS` if set, else a quarter of the CPUs the process may use,
    /// at least 1 and at most 4 — enough to keep up with a few host threads without taking
    /// over a small machine. [`EmuConfig::resolved_controller_threads`] gives the count.
    pub controller_threads: usize,
    /// Modes that make host protocol bugs fail deterministically instead of passing by luck
    /// (off by default; tests turn them on).
    pub hostile: Hostile,
    /// How image files are read (default [`ImageReads::Auto`]).
    pub image_reads: ImageReads,
}

/// Hostile modes: each turns a host bug that a friendly controller would not notice (because
/// stale memory happens to hold the right bytes) into a failure the host cannot miss.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq)]
pub struct Hostile {
    /// Every fetched SQE is overwritten in host memory with one of a reserved opcode (7Fh) and
    /// command id FFFFh, so a tail doorbell that covers a slot the host did not rewrite submits
    /// that, not the slot's previous command: it completes with Invalid Command Opcode under a
    /// command id the host never issued.
    pub poison_sq: bool,
    /// An SQ tail doorbell that moves backwards (fewer entries outstanding than its previous
    /// value said, the controller having fetched none of them) is an invalid doorbell write,
    /// reported as such, not a smaller submission.
    pub flag_backward_tail: bool,
    /// CQ entries a head doorbell frees are rewritten at once with the phase they had and
    /// garbage (command id and SQ id FFFFh), so a host that rings the head before it has read
    /// an entry reads garbage, not the entry.
    pub stale_cq: bool,
}

impl Hostile {
    /// Every mode on.
    pub const ALL: Self = Self {
        poison_sq: true,
        flag_backward_tail: true,
        stale_cq: true,
    };
}

impl Default for EmuConfig {
    fn default() -> Self {
        Self {
            namespaces: vec![NamespaceConfig::memory(64 << 20, 512)],
            mdts: 5,
            max_io_queue_pairs: 8,
            mqes: 1023,
            reorder_completions: false,
            serial: "GPUNVME-EMU-0001".into(),
            model: "gpunvme software NVMe controller".into(),
            firmware: env!("CARGO_PKG_VERSION").into(),
            vendor_id: 0x1b36,
            error_log_entries: 16,
            async_event_limit: 4,
            external_batch: 256,
            controller_threads: 0,
            hostile: Hostile::default(),
            image_reads: ImageReads::Auto,
        }
    }
}

impl EmuConfig {
    /// One namespace backed by the image file at `path`, covering the whole file.
    ///
    /// The file is checked, not modified: it must be a regular file that can be opened for
    /// reading and writing, non-empty, and a whole number of `lba_size` blocks.
    pub fn for_image(path: impl AsRef<Path>, lba_size: u32) -> Result<EmuConfig, EmuError> {
        Self::image_config(path.as_ref(), lba_size, false)
    }

    /// Like [`EmuConfig::for_image`], with the namespace write protected
    /// ([`NamespaceConfig::read_only`]): the file needs to be readable only, and is opened
    /// read-only under a shared lock.
    pub fn for_image_read_only(
        path: impl AsRef<Path>,
        lba_size: u32,
    ) -> Result<EmuConfig, EmuError> {
        Self::image_config(path.as_ref(), lba_size, true)
    }

    fn image_config(path: &Path, lba_size: u32, read_only: bool) -> Result<EmuConfig, EmuError> {
        check_lba_size(1, lba_size)?;
        let invalid = |reason: String| EmuError::InvalidImage {
            path: path.to_owned(),
            reason,
        };
        let meta = std::fs::metadata(path).map_err(|source| EmuError::OpenImage {
            path: path.to_owned(),
            source,
        })?;
        if meta.is_dir() {
            return Err(invalid("it is a directory".into()));
        }
        if !meta.is_file() {
            return Err(invalid("it is not a regular file".into()));
        }
        // Opening without truncating or creating checks permissions and changes nothing.
        OpenOptions::new()
            .read(true)
            .write(!read_only)
            .open(path)
            .map_err(|source| EmuError::OpenImage {
                path: path.to_owned(),
                source,
            })?;
        let len = meta.len();
        if len == 0 {
            return Err(invalid("it is empty".into()));
        }
        if len % lba_size as u64 != 0 {
            return Err(invalid(format!(
                "its size, {len} bytes, is not a multiple of the {lba_size}-byte block size"
            )));
        }
        Ok(EmuConfig {
            namespaces: vec![NamespaceConfig {
                backend: Backend::File(path.to_owned()),
                blocks: len / lba_size as u64,
                lba_size,
                read_only,
                format: NsFormat::Plain,
            }],
            ..EmuConfig::default()
        })
    }

    /// Creates a new sparse image file of `bytes` bytes at `path` (which must not exist).
    pub fn create_image(path: impl AsRef<Path>, bytes: u64) -> Result<(), EmuError> {
        let path = path.as_ref();
        if bytes == 0 {
            return Err(EmuError::InvalidImage {
                path: path.to_owned(),
                reason: "an image cannot be empty".into(),
            });
        }
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .create_new(true)
            .open(path)
            .map_err(|source| EmuError::CreateImage {
                path: path.to_owned(),
                source,
            })?;
        file.set_len(bytes)
            .map_err(|source| EmuError::CreateImage {
                path: path.to_owned(),
                source,
            })?;
        Ok(())
    }

    /// Makes the existing image file at `path` a fresh sparse image of `bytes` bytes, every
    /// byte zero (same file, same inode: its contents are discarded). Refused with
    /// [`EmuError::ImageBusy`] while a controller (in any process) holds the image, and with
    /// [`EmuError::InvalidImage`] for anything but a regular file.
    pub fn recreate_image(path: impl AsRef<Path>, bytes: u64) -> Result<(), EmuError> {
        let path = path.as_ref();
        let invalid = |reason: &str| EmuError::InvalidImage {
            path: path.to_owned(),
            reason: reason.into(),
        };
        if bytes == 0 {
            return Err(invalid("an image cannot be empty"));
        }
        let create = |source| EmuError::CreateImage {
            path: path.to_owned(),
            source,
        };
        let file = OpenOptions::new()
            .read(true)
            .write(true)
            .open(path)
            .map_err(create)?;
        if !file.metadata().map_err(create)?.is_file() {
            return Err(invalid("it is not a regular file"));
        }
        // Held until `file` closes: no controller starts on it while it is emptied.
        crate::lock::lock_image(&file, path, false)?;
        file.set_len(0).map_err(create)?;
        file.set_len(bytes).map_err(create)?;
        Ok(())
    }

    /// Checks every value against what the controller supports.
    pub fn validate(&self) -> Result<(), EmuError> {
        let invalid = |reason: String| Err(EmuError::InvalidConfig { reason });
        if self.controller_threads == 0
            && let Err(e) = gpunvme_settings::EMU_CONTROLLER_THREADS
                .read_number_in(1, MAX_CONTROLLER_THREADS as u64)
        {
            return invalid(e.to_string());
        }
        if self.max_io_queue_pairs == 0 {
            return invalid("max_io_queue_pairs must be at least 1".into());
        }
        if self.mqes == 0 {
            return invalid("mqes (zero-based) must be at least 1: queues need two entries".into());
        }
        if self.mdts > 15 {
            return invalid(format!("mdts {} is too large (at most 15)", self.mdts));
        }
        if self.error_log_entries == 0 || self.error_log_entries > 256 {
            return invalid("error_log_entries must be 1..=256".into());
        }
        if self.async_event_limit == 0 || self.async_event_limit > 16 {
            return invalid("async_event_limit must be 1..=16".into());
        }
        if self.external_batch == 0 || self.external_batch > MAX_EXTERNAL_BATCH {
            return invalid(format!("external_batch must be 1..={MAX_EXTERNAL_BATCH}"));
        }
        if self.controller_threads > MAX_CONTROLLER_THREADS {
            return invalid(format!(
                "controller_threads must be 0 (automatic) to {MAX_CONTROLLER_THREADS}"
            ));
        }
        if self.namespaces.len() > 1024 {
            return invalid("at most 1024 namespaces".into());
        }
        for (field, value, max) in [
            ("serial", &self.serial, 20),
            ("model", &self.model, 40),
            ("firmware", &self.firmware, 8),
        ] {
            if value.len() > max || !value.bytes().all(|b| (0x20..0x7f).contains(&b)) {
                return invalid(format!(
                    "{field} must be at most {max} printable ASCII characters"
                ));
            }
        }
        for (i, ns) in self.namespaces.iter().enumerate() {
            let nsid = i as u32 + 1;
            check_lba_size(nsid, ns.lba_size)?;
            if ns.blocks == 0 {
                return invalid(format!("namespace {nsid} has no blocks"));
            }
            if ns
                .blocks
                .checked_mul(ns.lba_size as u64)
                .is_none_or(|b| b > i64::MAX as u64)
            {
                return invalid(format!("namespace {nsid} is too large"));
            }
            if matches!(ns.backend, Backend::Forwarded(_)) && ns.format != NsFormat::Plain {
                return invalid(format!(
                    "namespace {nsid} is forwarded: only a plain format can be"
                ));
            }
        }
        Ok(())
    }
}

impl EmuConfig {
    /// The number of controller threads this configuration runs (at least 1): `controller_threads`,
    /// or the automatic default for 0, capped at `max_io_queue_pairs`.
    pub fn resolved_controller_threads(&self) -> usize {
        let n = match self.controller_threads {
            // A bad value is refused by `validate` before a controller starts.
            0 => gpunvme_settings::EMU_CONTROLLER_THREADS
                .read_number_in(1, MAX_CONTROLLER_THREADS as u64)
                .ok()
                .flatten()
                .map(|n| n as usize)
                .unwrap_or_else(|| {
                    let cpus = std::thread::available_parallelism().map_or(1, |n| n.get());
                    (cpus / 4).clamp(1, 4)
                }),
            n => n,
        };
        n.clamp(1, MAX_CONTROLLER_THREADS)
            .min(self.max_io_queue_pairs.max(1) as usize)
    }
}

fn check_lba_size(nsid: u32, lba_size: u32) -> Result<(), EmuError> {
    match lba_size {
        512 | 4096 => Ok(()),
        _ => Err(EmuError::InvalidLbaSize { nsid, lba_size }),
    }
}

/// Opens a file namespace's image (read-only for a write-protected namespace), locks it
/// (shared for read-only, else exclusive) and checks that it holds the configured blocks.
pub(crate) fn open_image(
    nsid: u32,
    path: &Path,
    bytes: u64,
    read_only: bool,
) -> Result<File, EmuError> {
    let file = OpenOptions::new()
        .read(true)
        .write(!read_only)
        .open(path)
        .map_err(|source| EmuError::OpenImage {
            path: path.to_owned(),
            source,
        })?;
    let meta = file.metadata().map_err(|source| EmuError::OpenImage {
        path: path.to_owned(),
        source,
    })?;
    if !meta.is_file() {
        return Err(EmuError::InvalidImage {
            path: path.to_owned(),
            reason: "it is not a regular file".into(),
        });
    }
    crate::lock::lock_image(&file, path, read_only)?;
    if meta.len() < bytes {
        return Err(EmuError::InvalidImage {
            path: path.to_owned(),
            reason: format!(
                "namespace {nsid} needs {bytes} bytes but the file has only {}",
                meta.len()
            ),
        });
    }
    Ok(file)
}
