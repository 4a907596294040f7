//! What `gpunvme identify`, `read` and `write` report: [`Serialize`] for `--json`,
//! [`Display`](std::fmt::Display) for text.

use std::fmt;

use nvme::Controller;
use serde::Serialize;

use gpunvme::units::{escape_control, format_bytes};

/// One namespace, as `identify` shows it.
#[derive(Clone, Debug, Serialize)]
pub struct NamespaceEntry {
    /// Namespace id.
    pub nsid: u32,
    /// LBA size in bytes (data only).
    pub lba_size: u32,
    /// LBAs.
    pub blocks: u64,
    /// I/O command set: "NVM", "Zoned Namespace", ...
    pub command_set: String,
    /// Metadata bytes per block as formatted (0: none).
    pub metadata_bytes: u16,
    /// Where metadata travels: "separate" buffer or "extended" LBA (`None` without metadata).
    pub metadata_placement: Option<&'static str>,
    /// End-to-end protection information type (1-3), `None` without PI.
    pub pi_type: Option<u8>,
    /// PI in the first 8 bytes of the metadata (else the last), with PI.
    pub pi_first_bytes: Option<bool>,
    /// Whether gpunvme drives it: with PI, the controller generates and strips it (PRACT).
    pub usable: bool,
    /// Why gpunvme refuses it, when it does.
    pub refused: Option<String>,
}

impl NamespaceEntry {
    fn new(
        nsid: u32,
        id: &nvme::nvme_spec::IdentifyNamespace,
        csi: nvme::nvme_spec::Csi,
        refused: Option<String>,
    ) -> Self {
        let format = id.current_lba_format();
        let pi = id.protection();
        Self {
            nsid,
            lba_size: 1u32.checked_shl(format.lbads as u32).unwrap_or(0),
            blocks: id.nsze,
            command_set: csi.to_string(),
            metadata_bytes: format.ms,
            metadata_placement: (format.ms != 0).then_some(if id.metadata_extended() {
                "extended"
            } else {
                "separate"
            }),
            pi_type: pi.map(|p| p.pi_type),
            pi_first_bytes: pi.map(|p| p.first_bytes),
            usable: refused.is_none(),
            refused,
        }
    }

    /// ", NVM", ", NVM, 8 bytes of metadata (separate): PI type 1, controller-generated".
    fn kind(&self) -> String {
        let mut s = format!(", {}", self.command_set);
        if self.metadata_bytes != 0 {
            s.push_str(&format!(
                ", {} bytes of metadata ({})",
                self.metadata_bytes,
                self.metadata_placement.unwrap_or("separate")
            ));
        }
        if let Some(t) = self.pi_type {
            s.push_str(&format!(
                ": PI type {t} in its {} 8 bytes",
                if self.pi_first_bytes == Some(true) {
                    "first"
                } else {
                    "last"
                }
            ));
            if self.usable {
                s.push_str(", generated and checked by the controller (PRACT)");
            }
        }
        s
    }
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
            namespaces: {
                let mut all: Vec<NamespaceEntry> = ctrl
                    .namespaces()
                    .iter()
                    .map(|ns| {
                        NamespaceEntry::new(ns.nsid, &ns.identify, nvme::nvme_spec::Csi::NVM, None)
                    })
                    .chain(ctrl.skipped_namespaces().iter().map(|s| {
                        NamespaceEntry::new(s.nsid, &s.identify, s.csi, Some(s.why.to_string()))
                    }))
                    .collect();
                all.sort_by_key(|n| n.nsid);
                all
            },
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
                "\nnamespace {}:        {} blocks of {} bytes ({}){}",
                ns.nsid,
                ns.blocks,
                ns.lba_size,
                format_bytes(ns.blocks.saturating_mul(ns.lba_size as u64) as f64),
                ns.kind()
            )?;
            if let Some(why) = &ns.refused {
                write!(f, "\n  refused: namespace {} {why}", ns.nsid)?;
            }
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
    fn identify_names_every_namespace_kind() {
        use nvme_emu::{NamespaceConfig, NsFormat};
        let with = |format| NamespaceConfig {
            format,
            ..NamespaceConfig::memory(1 << 20, 4096)
        };
        let dev = nvme_emu::EmuDevice::start(nvme_emu::EmuConfig {
            namespaces: vec![
                with(NsFormat::Pi {
                    pi_type: 2,
                    first_bytes: true,
                }),
                with(NsFormat::Metadata {
                    ms: 64,
                    extended: true,
                }),
                with(NsFormat::Zoned),
            ],
            ..Default::default()
        })
        .unwrap();
        let ctrl = Controller::new(dev, nvme::ControllerOptions::default()).unwrap();
        let r = IdentifyReport::of(&ctrl);
        let v = serde_json::to_value(&r).unwrap();
        let ns = &v["namespaces"];
        assert_eq!(ns.as_array().unwrap().len(), 3);
        assert_eq!(ns[0]["pi_type"], 2);
        assert_eq!(ns[0]["metadata_bytes"], 8);
        assert_eq!(ns[0]["usable"], true);
        assert_eq!(ns[1]["metadata_placement"], "extended");
        assert_eq!(ns[1]["usable"], false);
        assert_eq!(ns[2]["command_set"], "Zoned Namespace");
        assert_eq!(ns[2]["usable"], false);
        let text = r.to_string();
        assert!(
            text.contains(
                "PI type 2 in its first 8 bytes, generated and checked by the controller (PRACT)"
            ),
            "{text}"
        );
        assert!(
            text.contains("refused: namespace 2 is formatted with 64 bytes of metadata per block (at the end of each block)"),
            "{text}"
        );
        assert!(
            text.contains("refused: namespace 3 uses the Zoned Namespace command set"),
            "{text}"
        );
    }

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
