//! Discovery (NVMe over Fabrics 1.1, section 5.3): the discovery controller's log page read
//! whole and consistent (the generation counter read again after the entries, the read
//! repeated when it changed, a few times at most); its entries, and the NVMe/TCP subsystems
//! among them.

use std::net::SocketAddr;

use nvme_spec::fabrics::{
    DISCOVERY_LOG_PAGE, DiscoveryLogEntry, DiscoveryLogHeader, SUBTYPE_NVME, TRTYPE_TCP,
};
use zerocopy::FromBytes;

use crate::host::{Controller, FabricsError, HostOptions};

/// Most entries read (a log of more is refused rather than read in part).
pub const MAX_ENTRIES: u64 = 1024;
/// Reads of the log before a generation counter that keeps changing is an error.
const ATTEMPTS: usize = 4;

/// One entry of the discovery log.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Entry {
    /// Transport type (3: TCP).
    pub trtype: u8,
    /// Subsystem type (2: an NVM subsystem; 1 or 3: a discovery controller).
    pub subtype: u8,
    /// The subsystem's NQN.
    pub subnqn: String,
    /// The transport address (an IP address for TCP).
    pub traddr: String,
    /// The transport service (the TCP port).
    pub trsvcid: String,
    /// The port id.
    pub portid: u16,
}

impl Entry {
    /// Whether it is an NVM subsystem reached over TCP.
    pub fn is_tcp_subsystem(&self) -> bool {
        self.trtype == TRTYPE_TCP && self.subtype == SUBTYPE_NVME
    }
}

fn text(field: &[u8]) -> String {
    let end = field.iter().position(|&b| b == 0).unwrap_or(field.len());
    String::from_utf8_lossy(&field[..end]).trim().to_string()
}

/// Every entry of the discovery log of the discovery controller at `addr`.
pub fn discover(addr: SocketAddr, opts: &HostOptions) -> Result<Vec<Entry>, FabricsError> {
    let c = Controller::connect_discovery(addr, opts)?;
    let entries = read_log(&c)?;
    // The connection ends with the controller; a failed shutdown does not undo the read.
    let _ = c.shutdown();
    Ok(entries)
}

/// The discovery log of a connected discovery controller.
pub fn read_log(c: &Controller) -> Result<Vec<Entry>, FabricsError> {
    let header = |c: &Controller| -> Result<DiscoveryLogHeader, FabricsError> {
        let b = c.get_log_page(DISCOVERY_LOG_PAGE, 0, 1024)?;
        DiscoveryLogHeader::read_from_bytes(&b[..])
            .map_err(|_| FabricsError::InvalidArgument("a short discovery log header".into()))
    };
    for _ in 0..ATTEMPTS {
        let h = header(c)?;
        if h.numrec > MAX_ENTRIES {
            return Err(FabricsError::InvalidArgument(format!(
                "the discovery log has {} entries; at most {MAX_ENTRIES} are read",
                h.numrec
            )));
        }
        let mut entries = Vec::with_capacity(h.numrec as usize);
        // In reads of at most 64 entries (64 KiB), after the header.
        let mut at = 0u64;
        while at < h.numrec {
            let n = (h.numrec - at).min(64);
            let b = c.get_log_page(DISCOVERY_LOG_PAGE, 1024 + at * 1024, n as usize * 1024)?;
            for chunk in b.chunks_exact(1024) {
                let e = DiscoveryLogEntry::read_from_bytes(chunk).map_err(|_| {
                    FabricsError::InvalidArgument("a short discovery log entry".into())
                })?;
                entries.push(Entry {
                    trtype: e.trtype,
                    subtype: e.subtype,
                    subnqn: text(&e.subnqn),
                    traddr: text(&e.traddr),
                    trsvcid: text(&e.trsvcid),
                    portid: e.portid,
                });
            }
            at += n;
        }
        if header(c)?.genctr == h.genctr {
            return Ok(entries);
        }
    }
    Err(FabricsError::InvalidArgument(format!(
        "the discovery log changed during each of {ATTEMPTS} reads"
    )))
}
