//! Namespaces: what Identify Namespace (NVM Command Set 1.0, section 4.1.5.1) says about each
//! active namespace, reduced to what I/O needs.

#![forbid(unsafe_code)]

use nvme_spec::IdentifyNamespace;
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
    /// The Identify Namespace data it was built from.
    pub identify: Arc<IdentifyNamespace>,
}

/// Why an Identify Namespace page cannot be used for I/O by this driver.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub(crate) enum Unusable {
    /// NSZE is zero: the namespace is not active.
    Inactive,
    /// The LBA format index is beyond NLBAF.
    BadFormatIndex(usize),
    /// LBADS outside 9..=12 (512 B..4 KiB).
    LbaSize(u8),
    /// The format carries metadata, which the driver does not transfer.
    Metadata(u16),
}

impl std::fmt::Display for Unusable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match self {
            Self::Inactive => write!(f, "namespace size is zero"),
            Self::BadFormatIndex(i) => write!(f, "LBA format index {i} is beyond NLBAF"),
            Self::LbaSize(l) => write!(f, "LBA data size 2^{l} is outside 512..4096"),
            Self::Metadata(ms) => write!(f, "format has {ms} bytes of metadata per block"),
        }
    }
}

impl Namespace {
    /// Builds a namespace from its Identify data, refusing formats the driver cannot use.
    pub(crate) fn from_identify(nsid: u32, id: IdentifyNamespace) -> Result<Self, Unusable> {
        if id.nsze == 0 {
            return Err(Unusable::Inactive);
        }
        let index = id.flbas_index();
        if index > id.nlbaf as usize || index >= id.lbaf.len() {
            return Err(Unusable::BadFormatIndex(index));
        }
        let format = id.lbaf[index];
        if !(9..=12).contains(&format.lbads) {
            return Err(Unusable::LbaSize(format.lbads));
        }
        if format.ms != 0 {
            return Err(Unusable::Metadata(format.ms));
        }
        Ok(Self {
            nsid,
            lba_size: 1 << format.lbads,
            blocks: id.nsze,
            identify: Arc::new(id),
        })
    }

    /// Size in bytes.
    pub fn size_bytes(&self) -> u64 {
        self.blocks.saturating_mul(self.lba_size as u64)
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
        let ns = Namespace::from_identify(3, id(1000, 12, 0)).unwrap();
        assert_eq!((ns.nsid, ns.lba_size, ns.blocks), (3, 4096, 1000));
        assert_eq!(ns.size_bytes(), 4096 * 1000);
    }

    #[test]
    fn unusable() {
        assert_eq!(
            Namespace::from_identify(1, id(0, 9, 0)).unwrap_err(),
            Unusable::Inactive
        );
        assert_eq!(
            Namespace::from_identify(1, id(8, 13, 0)).unwrap_err(),
            Unusable::LbaSize(13)
        );
        assert_eq!(
            Namespace::from_identify(1, id(8, 0, 0)).unwrap_err(),
            Unusable::LbaSize(0)
        );
        assert_eq!(
            Namespace::from_identify(1, id(8, 9, 8)).unwrap_err(),
            Unusable::Metadata(8)
        );
        let mut bad = id(8, 9, 0);
        bad.flbas = 5;
        assert_eq!(
            Namespace::from_identify(1, bad).unwrap_err(),
            Unusable::BadFormatIndex(5)
        );
    }
}
