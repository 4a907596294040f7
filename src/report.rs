//! What `gpunvme identify`, `read` and `write` report: [`Serialize`] for `--json`,
//! [`Display`](std::fmt::Display) for text.

use std::fmt;

use nvme::Controller;
use serde::Serialize;

use crate::units::{escape_control, format_bytes};

/// One namespace, as `identify` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct NamespaceEntry {
    /// Namespace id.
    pub nsid: u32,
    /// LBA size in bytes.
    pub lba_size: u32,
    /// LBAs.
    pub blocks: u64,
}

/// `identify`: the controller and its namespaces.
#[derive(Clone, Debug, Serialize)]
pub struct IdentifyReport {
    /// PCI vendor id.
    pub vid: u16,
    /// PCI subsystem vendor id.
    pub ssvid: u16,
    /// Serial number.
    pub sn: String,
    /// Model number.
    pub mn: String,
    /// Firmware revision.
    pub fr: String,
    /// Maximum data transfer size (`None`: no limit).
    pub mdts_bytes: Option<u64>,
    /// I/O queue pairs the controller grants.
    pub max_io_queue_pairs: u16,
    /// Active namespaces.
    pub namespaces: Vec<NamespaceEntry>,
    /// The device, described by its transport.
    pub device: String,
}

impl IdentifyReport {
    /// `ctrl`'s identity.
    pub fn of(ctrl: &Controller) -> Self {
        let info = ctrl.info();
        Self {
            vid: info.vid,
            ssvid: info.ssvid,
            sn: info.sn.clone(),
            mn: info.mn.clone(),
            fr: info.fr.clone(),
            mdts_bytes: info.mdts_bytes,
            max_io_queue_pairs: info.max_io_queue_pairs,
            namespaces: ctrl
                .namespaces()
                .iter()
                .map(|ns| NamespaceEntry {
                    nsid: ns.nsid,
                    lba_size: ns.lba_size,
                    blocks: ns.blocks,
                })
                .collect(),
            device: ctrl.device().describe(),
        }
    }
}

impl fmt::Display for IdentifyReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "device:             {}", self.device)?;
        writeln!(
            f,
            "vendor id:          {:#06x} (subsystem {:#06x})",
            self.vid, self.ssvid
        )?;
        // Strings from the device: escaped.
        writeln!(f, "serial number:      {}", escape_control(&self.sn))?;
        writeln!(f, "model:              {}", escape_control(&self.mn))?;
        writeln!(f, "firmware:           {}", escape_control(&self.fr))?;
        match self.mdts_bytes {
            Some(b) => writeln!(f, "max transfer:       {b} bytes")?,
            None => writeln!(f, "max transfer:       unlimited")?,
        }
        write!(f, "I/O queue pairs:    {}", self.max_io_queue_pairs)?;
        for ns in &self.namespaces {
            write!(
                f,
                "\nnamespace {}:        {} blocks of {} bytes ({})",
                ns.nsid,
                ns.blocks,
                ns.lba_size,
                format_bytes((ns.blocks * ns.lba_size as u64) as f64)
            )?;
        }
        Ok(())
    }
}

/// `identify` over several devices: each controller, then the totals.
#[derive(Clone, Debug, Serialize)]
pub struct IdentifyAllReport {
    /// Each controller, in `--device` order.
    pub controllers: Vec<IdentifyReport>,
    /// Controllers.
    pub total_controllers: usize,
    /// Active namespaces over all controllers.
    pub total_namespaces: usize,
    /// Bytes of all those namespaces.
    pub total_bytes: u64,
}

impl IdentifyAllReport {
    /// The report of `ctrls`.
    pub fn of<'a>(ctrls: impl IntoIterator<Item = &'a Controller>) -> Self {
        let controllers: Vec<IdentifyReport> = ctrls.into_iter().map(IdentifyReport::of).collect();
        let namespaces = controllers.iter().flat_map(|c| &c.namespaces);
        Self {
            total_controllers: controllers.len(),
            total_namespaces: namespaces.clone().count(),
            total_bytes: namespaces
                .map(|ns| ns.blocks.saturating_mul(ns.lba_size as u64))
                .fold(0u64, u64::saturating_add),
            controllers,
        }
    }
}

impl fmt::Display for IdentifyAllReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for (i, c) in self.controllers.iter().enumerate() {
            writeln!(f, "controller {i}:\n{c}\n")?;
        }
        write!(
            f,
            "total:              {} controllers, {} namespaces, {}",
            self.total_controllers,
            self.total_namespaces,
            format_bytes(self.total_bytes as f64)
        )
    }
}

/// `read` or `write`: raw namespace I/O.
#[derive(Clone, Debug, Serialize)]
pub struct RawIoReport {
    /// `read` or `write` (not in JSON, which keeps the keys it always had).
    #[serde(skip)]
    pub op: &'static str,
    /// Namespace id.
    pub nsid: u32,
    /// First LBA.
    pub lba: u64,
    /// LBAs moved.
    pub blocks: u64,
    /// Bytes moved.
    pub bytes: u64,
    /// The host file read into (`read`).
    #[serde(skip)]
    pub output: Option<String>,
}

impl fmt::Display for RawIoReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match (self.op, &self.output) {
            ("read", Some(out)) => write!(
                f,
                "read {} bytes ({} blocks) from nsid {} at lba {} into {out}",
                self.bytes, self.blocks, self.nsid, self.lba
            ),
            _ => write!(
                f,
                "wrote {} bytes ({} blocks) to nsid {} at lba {}",
                self.bytes, self.blocks, self.nsid, self.lba
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn identify_and_raw_io_reports() {
        let dev = nvme_emu::EmuDevice::start(nvme_emu::EmuConfig {
            namespaces: vec![nvme_emu::NamespaceConfig::memory(1 << 20, 512)],
            ..Default::default()
        })
        .unwrap();
        let ctrl = Controller::new(dev, nvme::ControllerOptions::default()).unwrap();
        let r = IdentifyReport::of(&ctrl);
        let v = serde_json::to_value(&r).unwrap();
        assert_eq!(v["namespaces"][0]["blocks"], 2048);
        assert!(
            r.to_string()
                .contains("namespace 1:        2048 blocks of 512 bytes")
        );
        ctrl.shutdown().unwrap();
        let io = RawIoReport {
            op: "read",
            nsid: 1,
            lba: 3,
            blocks: 8,
            bytes: 4096,
            output: Some("o.bin".into()),
        };
        assert_eq!(
            io.to_string(),
            "read 4096 bytes (8 blocks) from nsid 1 at lba 3 into o.bin"
        );
        assert_eq!(
            serde_json::to_value(&io).unwrap(),
            serde_json::json!({"nsid": 1, "lba": 3, "blocks": 8, "bytes": 4096})
        );
    }
}
