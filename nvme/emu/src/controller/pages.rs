//! The data pages the controller returns: Identify structures and log pages.

use nvme_spec::identify::PowerStateDescriptor;
use nvme_spec::{
    ActiveNamespaceList, IdentifyController, IdentifyNamespace, LbaFormat, Oncs, SmartHealthLog,
};
use zerocopy::FromZeros;
use zerocopy::little_endian::{U16, U128};

use super::{CCTEMP_K, Controller, TEMPERATURE_K, WCTEMP_K};
use crate::prp::PAGE;
use crate::stats::Counters;

/// The Version value the controller reports (NVMe 1.4.0), in VS and Identify Controller.
pub(crate) const VERSION: u32 = 0x0001_0400;
/// Controller ID.
pub(crate) const CNTLID: u16 = 1;

/// Copies `s` into an ASCII identify field, padded with spaces.
fn ascii_field(dst: &mut [u8], s: &str) {
    dst.fill(b' ');
    let n = s.len().min(dst.len());
    dst[..n].copy_from_slice(&s.as_bytes()[..n]);
}

/// A stable 64-bit value derived from `bytes` (FNV-1a), for identifiers.
fn fnv(bytes: &[u8], seed: u64) -> u64 {
    bytes.iter().fold(0xcbf2_9ce4_8422_2325 ^ seed, |h, &b| {
        (h ^ b as u64).wrapping_mul(0x100_0000_01b3)
    })
}

impl Controller {
    /// Identify Controller (CNS 01h).
    pub(super) fn identify_controller(&self) -> IdentifyController {
        let c = &self.config;
        let mut id = IdentifyController::new_zeroed();
        id.vid = c.vendor_id;
        id.ssvid = c.vendor_id;
        ascii_field(&mut id.sn, &c.serial);
        ascii_field(&mut id.mn, &c.model);
        ascii_field(&mut id.fr, &c.firmware);
        id.rab = 0;
        id.mdts = c.mdts;
        id.cntlid = CNTLID;
        id.ver = VERSION;
        id.rtd3e = 1_000_000;
        id.cntrltype = 1; // I/O controller
        // No optional admin commands (OACS = 0): no Format NVM, firmware, namespace management.
        id.oacs = 0;
        id.acl = 3;
        id.aerl = c.async_event_limit - 1;
        // Firmware: slot 1 read-only, one slot, no activation without reset.
        id.frmw = 0b0000_0011;
        // Log page attributes: extended data (offsets) for Get Log Page.
        id.lpa = 1 << 2;
        id.elpe = (c.error_log_entries - 1) as u8;
        id.npss = 0;
        id.wctemp = WCTEMP_K;
        id.cctemp = CCTEMP_K;
        let capacity: u128 = self
            .namespaces
            .iter()
            .map(|n| n.blocks as u128 * n.lba_size as u128)
            .sum();
        id.tnvmcap = capacity.to_le_bytes();
        id.unvmcap = [0; 16];
        id.sqes = 0x66;
        id.cqes = 0x44;
        id.maxcmd = 0;
        id.nn = self.namespaces.len() as u32;
        id.oncs = (Oncs::DATASET_MANAGEMENT | Oncs::WRITE_ZEROES).bits();
        id.fuses = 0;
        id.fna = 0;
        // Volatile write cache present; Flush with NSID FFFFFFFFh supported (bits 2:1 = 11b).
        id.vwc = 0b111;
        id.awun = 0;
        id.awupf = 0;
        id.sgls = 0;
        let nqn = format!(
            "nqn.2014-08.org.nvmexpress:uuid:gpunvme-emu-{:016x}",
            fnv(c.serial.as_bytes(), 0)
        );
        id.subnqn[..nqn.len()].copy_from_slice(nqn.as_bytes());
        id.psd[0] = PowerStateDescriptor {
            mp: 2500, // 25 W in centiwatts
            enlat: 0,
            exlat: 0,
            ..PowerStateDescriptor::new_zeroed()
        };
        id
    }

    /// Identify Namespace (CNS 00h) of an active namespace.
    pub(super) fn identify_namespace(&self, nsid: u32) -> IdentifyNamespace {
        let ns = self
            .namespace(nsid)
            .expect("caller checked the namespace is active");
        let mut id = IdentifyNamespace::new_zeroed();
        id.nsze = ns.blocks;
        id.ncap = ns.blocks;
        id.nuse = ns.blocks;
        id.nsfeat = 0;
        // NSATTR bit 0: write protected.
        id.nsattr = u8::from(ns.read_only);
        id.nlbaf = 0;
        id.flbas = 0;
        let mut ms = 0;
        match ns.format {
            crate::NsFormat::Plain | crate::NsFormat::Zoned => {}
            crate::NsFormat::Pi {
                pi_type,
                first_bytes,
            } => {
                ms = 8;
                // DPC: types 1-3, PI first or last 8 bytes; DPS: the type in use (+ bit 3).
                id.dpc = 0b1_1111;
                id.dps = pi_type | u8::from(first_bytes) << 3;
                // MC: metadata in a separate buffer (the host never supplies one with PRACT).
                id.mc = 0b10;
            }
            crate::NsFormat::Metadata {
                ms: bytes,
                extended,
            } => {
                ms = bytes;
                id.mc = if extended { 0b01 } else { 0b10 };
                id.flbas = u8::from(extended) << 4;
            }
        }
        // Deallocated blocks read as zeroes (001b); Write Zeroes supports DEAC (bit 3).
        id.dlfeat = 0b1001;
        id.nvmcap = (ns.blocks as u128 * ns.lba_size as u128).to_le_bytes();
        id.nguid = self.nguid(nsid);
        id.eui64 = fnv(self.config.serial.as_bytes(), nsid as u64 ^ 0xe0).to_be_bytes();
        id.lbaf[0] = LbaFormat {
            ms,
            lbads: ns.lba_shift as u8,
            rp: 0,
        };
        id
    }

    fn nguid(&self, nsid: u32) -> [u8; 16] {
        let serial = self.config.serial.as_bytes();
        let hi = fnv(serial, nsid as u64);
        let lo = fnv(serial, (nsid as u64) << 32 | 0x9e37);
        let mut g = [0u8; 16];
        g[..8].copy_from_slice(&hi.to_be_bytes());
        g[8..].copy_from_slice(&lo.to_be_bytes());
        g
    }

    /// Active Namespace ID list (CNS 02h): active NSIDs greater than `after`.
    pub(super) fn active_namespaces(&self, after: u32) -> ActiveNamespaceList {
        let mut list = ActiveNamespaceList::new_zeroed();
        let first = after as u64 + 1;
        for (slot, nsid) in (first..=self.namespaces.len() as u64)
            .take(1024)
            .enumerate()
        {
            list.nsids[slot] = nsid as u32;
        }
        list
    }

    /// Namespace Identification Descriptor list (CNS 03h): the NGUID.
    pub(super) fn namespace_descriptors(&self, nsid: u32) -> [u8; PAGE as usize] {
        let mut page = [0u8; PAGE as usize];
        page[0] = 0x02; // NIDT: NGUID
        page[1] = 16; // NIDL
        page[4..20].copy_from_slice(&self.nguid(nsid));
        page[20] = nvme_spec::identify::NIDT_CSI;
        page[21] = 1;
        let zoned = self
            .namespace(nsid)
            .is_some_and(|ns| ns.format == crate::NsFormat::Zoned);
        page[24] = if zoned {
            nvme_spec::Csi::ZONED.0
        } else {
            nvme_spec::Csi::NVM.0
        };
        page
    }

    /// SMART / Health Information log page (controller-wide).
    pub(super) fn smart_log(&self) -> SmartHealthLog {
        let sets = &self.shared.counters;
        let sum = |f| Counters::sum(sets, f);
        let error_count = self
            .shared
            .error_log
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .count;
        let units = |bytes: u64| U128::new((bytes as u128).div_ceil(512).div_ceil(1000));
        let mut log = SmartHealthLog::new_zeroed();
        log.composite_temperature = U16::new(TEMPERATURE_K);
        log.available_spare = 100;
        log.available_spare_threshold = 10;
        log.percentage_used = 0;
        log.data_units_read = units(sum(|c| &c.bytes_read));
        log.data_units_written = units(sum(|c| &c.bytes_written));
        log.host_read_commands = U128::new(sum(|c| &c.reads) as u128);
        log.host_write_commands = U128::new(sum(|c| &c.writes) as u128);
        log.power_cycles = U128::new(1);
        log.power_on_hours = U128::new((self.started.elapsed().as_secs() / 3600) as u128);
        log.unsafe_shutdowns = U128::new(0);
        log.media_errors = U128::new(sum(|c| &c.media_errors) as u128);
        log.error_log_entries = U128::new(error_count as u128);
        log
    }

    /// Firmware Slot Information log page: slot 1 active, holding the firmware revision.
    pub(super) fn firmware_slot_log(&self) -> [u8; 512] {
        let mut page = [0u8; 512];
        page[0] = 1; // AFI: slot 1 active
        ascii_field(&mut page[8..16], &self.config.firmware);
        page
    }
}
