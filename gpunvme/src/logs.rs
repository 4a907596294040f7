//! `gpunvme log`: the controller's Error Information log (log page 01h) and SMART / Health
//! Information (02h), read through the admin queue, for checking a controller after a run (the
//! bring-up runbook, docs/real-ssd.md, reads the error log after each step).

use std::fmt;

use crate::error::{Context, Result};
use nvme::nvme_spec::completion::CqeStatus;
use nvme::nvme_spec::{ErrorInformationLogEntry, SmartHealthLog};
use nvme::{Controller, DmaSlice};
use serde::Serialize;
use zerocopy::FromBytes;

/// Log page identifiers.
const LID_ERRORS: u8 = 0x01;
const LID_SMART: u8 = 0x02;

/// One Error Information log entry that holds an error.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorEntry {
    /// The controller's running error count when this entry was made.
    pub error_count: u64,
    /// Submission queue of the failed command (FFFFh: none).
    pub sqid: u16,
    /// Its command id (FFFFh: none).
    pub cid: u16,
    /// The status, by name (e.g. "Media and Data Integrity Error: Unrecovered Read Error").
    pub status: String,
    /// Parameter Error Location (FFFFh: none).
    pub parameter_error_location: u16,
    /// The first LBA in error, where the status concerns one.
    pub lba: u64,
    /// The namespace.
    pub nsid: u32,
}

/// The error log: its non-empty entries, newest first as the controller keeps them.
#[derive(Clone, Debug, Serialize)]
pub struct ErrorLogReport {
    /// Entries the controller keeps (ELPE + 1).
    pub capacity: usize,
    /// The entries holding errors.
    pub entries: Vec<ErrorEntry>,
}

/// Reads the Error Information log.
pub fn error_log(ctrl: &Controller) -> Result<ErrorLogReport> {
    let capacity = ctrl.identify_data().elpe as usize + 1;
    let entry = size_of::<ErrorInformationLogEntry>();
    let bytes = read_log(ctrl, LID_ERRORS, capacity * entry)?;
    let entries = bytes
        .chunks_exact(entry)
        .filter_map(|c| ErrorInformationLogEntry::read_from_bytes(c).ok())
        .filter(|e| e.error_count != 0)
        .map(|e| ErrorEntry {
            error_count: e.error_count,
            sqid: e.sqid,
            cid: e.cid,
            status: CqeStatus::from_bits(e.status).status().to_string(),
            parameter_error_location: e.parameter_error_location,
            lba: e.lba,
            nsid: e.nsid,
        })
        .collect();
    Ok(ErrorLogReport { capacity, entries })
}

impl fmt::Display for ErrorLogReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        if self.entries.is_empty() {
            return write!(f, "error log: no errors ({} entries kept)", self.capacity);
        }
        write!(
            f,
            "error log: {} entr{} ({} kept)",
            self.entries.len(),
            if self.entries.len() == 1 { "y" } else { "ies" },
            self.capacity
        )?;
        for e in &self.entries {
            write!(
                f,
                "\n  #{}: sq {:#x} cid {:#x} nsid {} lba {}: {}",
                e.error_count, e.sqid, e.cid, e.nsid, e.lba, e.status
            )?;
        }
        Ok(())
    }
}

/// SMART / Health Information, controller-wide.
#[derive(Clone, Debug, Serialize)]
pub struct SmartReport {
    /// Critical Warning bits (0: none).
    pub critical_warning: u8,
    /// Composite temperature, degrees Celsius (`None`: not reported, 0 K).
    pub temperature_c: Option<i32>,
    /// Available spare, percent.
    pub available_spare_pct: u8,
    /// Percentage of the rated endurance used.
    pub percentage_used: u8,
    /// Bytes read (from Data Units Read: thousands of 512-byte units, rounded up).
    pub data_read_bytes: u128,
    /// Bytes written, likewise.
    pub data_written_bytes: u128,
    /// Read commands completed.
    pub host_read_commands: u128,
    /// Write commands completed.
    pub host_write_commands: u128,
    /// Media and data integrity errors.
    pub media_errors: u128,
    /// Error Information log entries over the controller's life.
    pub error_log_entries: u128,
    /// Unsafe shutdowns.
    pub unsafe_shutdowns: u128,
    /// Power-on hours.
    pub power_on_hours: u128,
}

/// Reads SMART / Health Information.
pub fn smart(ctrl: &Controller) -> Result<SmartReport> {
    let bytes = read_log(ctrl, LID_SMART, size_of::<SmartHealthLog>())?;
    let s = SmartHealthLog::read_from_bytes(&bytes[..])
        .map_err(|_| crate::Error::new(crate::ErrorKind::Device, "short SMART log"))?;
    let units = |u: u128| u.saturating_mul(512_000);
    Ok(SmartReport {
        critical_warning: s.critical_warning,
        temperature_c: match s.composite_temperature.get() {
            0 => None,
            k => Some(k as i32 - 273),
        },
        available_spare_pct: s.available_spare,
        percentage_used: s.percentage_used,
        data_read_bytes: units(s.data_units_read.get()),
        data_written_bytes: units(s.data_units_written.get()),
        host_read_commands: s.host_read_commands.get(),
        host_write_commands: s.host_write_commands.get(),
        media_errors: s.media_errors.get(),
        error_log_entries: s.error_log_entries.get(),
        unsafe_shutdowns: s.unsafe_shutdowns.get(),
        power_on_hours: s.power_on_hours.get(),
    })
}

impl fmt::Display for SmartReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "critical warning:   {:#04x}", self.critical_warning)?;
        match self.temperature_c {
            Some(c) => writeln!(f, "temperature:        {c} C")?,
            None => writeln!(f, "temperature:        not reported")?,
        }
        writeln!(f, "available spare:    {}%", self.available_spare_pct)?;
        writeln!(f, "percentage used:    {}%", self.percentage_used)?;
        writeln!(f, "data read:          {} bytes", self.data_read_bytes)?;
        writeln!(f, "data written:       {} bytes", self.data_written_bytes)?;
        writeln!(
            f,
            "commands:           {} reads, {} writes",
            self.host_read_commands, self.host_write_commands
        )?;
        writeln!(f, "media errors:       {}", self.media_errors)?;
        writeln!(f, "error log entries:  {}", self.error_log_entries)?;
        writeln!(f, "unsafe shutdowns:   {}", self.unsafe_shutdowns)?;
        write!(f, "power-on hours:     {}", self.power_on_hours)
    }
}

/// Reads `len` bytes of log page `lid` (controller-wide) in pieces of at most the maximum
/// transfer.
fn read_log(ctrl: &Controller, lid: u8, len: usize) -> Result<Vec<u8>> {
    let max = ctrl.info().max_transfer_bytes.min(1 << 20);
    let mem = std::sync::Arc::new(
        ctrl.device()
            .alloc_dma(max)
            .context("DMA memory for a log page")?,
    );
    let mut out = vec![0u8; len];
    let mut at = 0;
    while at < len {
        let n = (len - at).min(max);
        ctrl.get_log_page_at(
            lid,
            0xffff_ffff,
            at as u64,
            &DmaSlice::new(mem.clone(), 0, n),
        )
        .with_context(|| format!("Get Log Page {lid:#04x} at byte {at}"))?;
        mem.read(0, &mut out[at..at + n]);
        at += n;
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn a_media_error_shows_in_the_error_log_and_smart() {
        let dev = nvme_emu::EmuDevice::start(nvme_emu::EmuConfig {
            namespaces: vec![nvme_emu::NamespaceConfig::memory(1 << 20, 512)],
            ..Default::default()
        })
        .unwrap();
        let ctrl = Controller::new(dev.clone(), nvme::ControllerOptions::default()).unwrap();
        let clean = error_log(&ctrl).unwrap();
        assert!(clean.entries.is_empty(), "{clean}");
        assert!(clean.to_string().starts_with("error log: no errors"));
        dev.faults().add_media_error(1, 42);
        let mut q = ctrl.create_io_queue_pair(8).unwrap();
        let mut buf = vec![0u8; 4096];
        assert!(q.read_to(1, 40, &mut buf).is_err());
        let log = error_log(&ctrl).unwrap();
        assert_eq!(log.entries.len(), 1, "{log}");
        let e = &log.entries[0];
        assert_eq!((e.nsid, e.lba), (1, 42));
        assert!(e.status.contains("Unrecovered Read Error"), "{}", e.status);
        let s = smart(&ctrl).unwrap();
        assert_eq!(s.media_errors, 1);
        assert!(s.error_log_entries >= 1);
        assert!(s.to_string().contains("media errors:       1"));
    }
}
