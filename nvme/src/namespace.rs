//! Namespaces: what Identify Namespace (NVM Command Set 1.0, section 4.1.5.1) and the
//! namespace's Command Set Identifier say about each active namespace, reduced to what I/O
//! needs, and why the ones the driver cannot drive are refused.
//!
//! Drivable: NVM namespaces without metadata, and NVM namespaces whose only metadata is 8 bytes
//! of end-to-end protection information (any PI type, first or last 8 bytes, extended LBA or
//! separate). Reads and writes on the latter set PRACT, so the controller generates the PI on
//! writes and checks and strips it on reads (guard, and the reference tag for types 1 and 2,
//! whose initial value is the LBA's low 32 bits), and the host moves plain data, as the Linux
//! driver does. Everything else (other metadata, zoned and other command sets) is refused by
//! name, never driven as a plain NVM namespace.

#![forbid(unsafe_code)]

use nvme_spec::command::prinfo;
use nvme_spec::{Csi, IdentifyNamespace, Protection};
use std::sync::Arc;

/// An active namespace the driver can do I/O on.
#[derive(Clone, Debug)]
pub struct Namespace {
    /// Namespace identifier.
    pub nsid: u32,
    /// Bytes per logical block (512 or 4096, or another power of two from 512 to 4096).
    pub lba_size: u32,
    /// Size in logical blocks (NSZE).
    pub blocks: u64,
    /// End-to-end protection information the controller inserts and strips (PRACT) on every
    /// read and write; `None` for a namespace without metadata.
    pub protection: Option<Protection>,
    /// The Identify Namespace data it was built from.
    pub identify: Arc<IdentifyNamespace>,
}

/// Why an active namespace cannot be driven.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum NamespaceUnusable {
    /// NSZE is zero: the namespace is not active.
    Inactive,
    /// The LBA format index is beyond NLBAF.
    BadFormatIndex(usize),
    /// LBADS outside 9..=12 (512 B..4 KiB).
    LbaSize(u8),
    /// The format carries metadata the driver would have to transfer.
    Metadata {
        /// Metadata bytes per block.
        ms: u16,
        /// At the end of each block (extended LBA), else in a separate buffer.
        extended: bool,
        /// Protection information within it, if formatted with PI.
        protection: Option<Protection>,
    },
    /// Not an NVM namespace.
    CommandSet(Csi),
}

impl std::fmt::Display for NamespaceUnusable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        const SUPPORTED: &str = "gpunvme reads and writes namespaces without metadata or with \
                                 8-byte protection information";
        match self {
            Self::Inactive => write!(f, "is not active (size zero)"),
            Self::BadFormatIndex(i) => write!(f, "has LBA format index {i}, beyond NLBAF"),
            Self::LbaSize(l) => write!(f, "has an LBA data size of 2^{l}, outside 512..4096"),
            Self::Metadata {
                ms,
                extended,
                protection,
            } => write!(
                f,
                "is formatted with {ms} bytes of metadata per block ({}){}; {SUPPORTED}",
                if *extended {
                    "at the end of each block"
                } else {
                    "separate buffer"
                },
                match protection {
                    Some(p) => format!(", protection information type {} within it", p.pi_type),
                    None => String::new(),
                }
            ),
            Self::CommandSet(csi) => write!(
                f,
                "uses the {csi} command set; gpunvme drives NVM namespaces only (a zoned \
                 namespace is never driven as a plain one)"
            ),
        }
    }
}

/// An active namespace the driver refuses, and why.
#[derive(Clone, Debug)]
pub struct SkippedNamespace {
    /// Namespace identifier.
    pub nsid: u32,
    /// Why it is refused.
    pub why: NamespaceUnusable,
    /// Its command set.
    pub csi: Csi,
    /// Its Identify Namespace data.
    pub identify: Arc<IdentifyNamespace>,
}

impl Namespace {
    /// Builds a namespace from its Identify data and command set, refusing what the driver
    /// cannot drive.
    pub(crate) fn from_identify(
        nsid: u32,
        id: IdentifyNamespace,
        csi: Csi,
    ) -> Result<Self, NamespaceUnusable> {
        if csi != Csi::NVM {
            return Err(NamespaceUnusable::CommandSet(csi));
        }
        if id.nsze == 0 {
            return Err(NamespaceUnusable::Inactive);
        }
        let index = id.flbas_index();
        if index > id.nlbaf as usize || index >= id.lbaf.len() {
            return Err(NamespaceUnusable::BadFormatIndex(index));
        }
        let format = id.lbaf[index];
        if !(9..=12).contains(&format.lbads) {
            return Err(NamespaceUnusable::LbaSize(format.lbads));
        }
        let protection = id.protection();
        match (format.ms, protection) {
            (0, _) => {}
            // 8 bytes that are all PI: PRACT makes the controller insert and strip them, so
            // the host moves only data, whichever the placement.
            (8, Some(_)) => {}
            (ms, protection) => {
                return Err(NamespaceUnusable::Metadata {
                    ms,
                    extended: id.metadata_extended(),
                    protection,
                });
            }
        }
        Ok(Self {
            nsid,
            lba_size: 1 << format.lbads,
            blocks: id.nsze,
            protection: if format.ms == 8 { protection } else { None },
            identify: Arc::new(id),
        })
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.blocks.saturating_mul(self.lba_size as u64)
    }

    /// The PRINFO field (CDW12 bits 29:26) every Read and Write on this namespace carries:
    /// 0 without PI; with PI, PRACT plus guard checking, and reference tag checking for types
    /// 1 and 2 (whose tag is then the LBA's low 32 bits, [`Namespace::reference_tag`]).
    pub fn prinfo(&self) -> u8 {
        match self.protection {
            None => 0,
            Some(p) if p.pi_type == 3 => prinfo::PRACT | prinfo::PRCHK_GUARD,
            Some(_) => prinfo::PRACT | prinfo::PRCHK_GUARD | prinfo::PRCHK_REF,
        }
    }

    /// CDW14 (Initial Logical Block Reference Tag) of a Read or Write starting at `lba`.
    pub fn reference_tag(&self, lba: u64) -> u32 {
        if self.prinfo() & prinfo::PRCHK_REF != 0 {
            lba as u32
        } else {
            0
        }
    }

    /// "512", "512+8 PI type 1": the format in a few characters.
    pub fn format_label(&self) -> String {
        match self.protection {
            None => self.lba_size.to_string(),
            Some(p) => format!("{}+8 PI type {}", self.lba_size, p.pi_type),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use nvme_spec::LbaFormat;
    use zerocopy::FromZeros;

    fn id(nsze: u64, lbads: u8, ms: u16) -> IdentifyNamespace {
        let mut id = IdentifyNamespace::new_zeroed();
        id.nsze = nsze;
        id.ncap = nsze;
        id.nlbaf = 1;
        id.flbas = 1;
        id.lbaf[0] = LbaFormat {
            ms: 0,
            lbads: 9,
            rp: 0,
        };
        id.lbaf[1] = LbaFormat { ms, lbads, rp: 0 };
        id
    }

    #[test]
    fn usable() {
        let ns = Namespace::from_identify(3, id(1000, 12, 0), Csi::NVM).unwrap();
        assert_eq!((ns.nsid, ns.lba_size, ns.blocks), (3, 4096, 1000));
        assert_eq!(ns.size_bytes(), 4096 * 1000);
    }

    #[test]
    fn unusable() {
        assert_eq!(
            Namespace::from_identify(1, id(0, 9, 0), Csi::NVM).unwrap_err(),
            NamespaceUnusable::Inactive
        );
        assert_eq!(
            Namespace::from_identify(1, id(8, 13, 0), Csi::NVM).unwrap_err(),
            NamespaceUnusable::LbaSize(13)
        );
        assert_eq!(
            Namespace::from_identify(1, id(8, 0, 0), Csi::NVM).unwrap_err(),
            NamespaceUnusable::LbaSize(0)
        );
        assert_eq!(
            Namespace::from_identify(1, id(8, 9, 8), Csi::NVM).unwrap_err(),
            NamespaceUnusable::Metadata {
                ms: 8,
                extended: false,
                protection: None
            }
        );
        let mut bad = id(8, 9, 0);
        bad.flbas = 5;
        assert_eq!(
            Namespace::from_identify(1, bad, Csi::NVM).unwrap_err(),
            NamespaceUnusable::BadFormatIndex(5)
        );
        let e = Namespace::from_identify(2, id(8, 12, 64), Csi::NVM).unwrap_err();
        assert_eq!(
            format!("namespace 2 {e}"),
            "namespace 2 is formatted with 64 bytes of metadata per block (separate buffer); \
             gpunvme reads and writes namespaces without metadata or with 8-byte protection \
             information"
        );
        let e = Namespace::from_identify(3, id(8, 12, 0), Csi::ZONED).unwrap_err();
        assert_eq!(e, NamespaceUnusable::CommandSet(Csi::ZONED));
        assert!(e.to_string().contains("Zoned Namespace command set"), "{e}");
    }

    #[test]
    fn eight_bytes_of_protection_information_are_left_to_the_controller() {
        let mut pi = id(100, 12, 8);
        pi.dps = 1;
        let ns = Namespace::from_identify(1, pi, Csi::NVM).unwrap();
        assert_eq!(ns.lba_size, 4096);
        assert_eq!(ns.prinfo(), 0b1101);
        assert_eq!(ns.reference_tag(0x1_2345_6789), 0x2345_6789);
        assert_eq!(ns.format_label(), "4096+8 PI type 1");
        pi.dps = 3;
        let ns = Namespace::from_identify(1, pi, Csi::NVM).unwrap();
        assert_eq!((ns.prinfo(), ns.reference_tag(77)), (0b1100, 0));
        // 16 bytes of metadata with PI in 8 of them: the host would have to supply the rest.
        let mut wide = id(100, 12, 16);
        wide.dps = 1;
        assert!(matches!(
            Namespace::from_identify(1, wide, Csi::NVM),
            Err(NamespaceUnusable::Metadata { ms: 16, .. })
        ));
        // Without PI, no PRINFO.
        let plain = Namespace::from_identify(1, id(100, 9, 0), Csi::NVM).unwrap();
        assert_eq!((plain.prinfo(), plain.reference_tag(5)), (0, 0));
    }
}
