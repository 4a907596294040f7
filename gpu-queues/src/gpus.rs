//! Which GPU: the names a user gives one (`--gpu-id`, Python's `device="cuda:N"`, C's
//! ordinal) and how they become opened [`Cuda`]s.
//!
//! A GPU is named by its CUDA ordinal in this process (`0`, `3`: what `cuda:3` means, and
//! what `CUDA_VISIBLE_DEVICES` renumbers), by its UUID (`GPU-8f3e...` as `nvidia-smi -L`
//! prints it, with or without the `GPU-` prefix, or any unambiguous leading part of it: the
//! name that means the same GPU in every process), or by its PCI address (`0000:3b:00.0`, or
//! `3b:00.0`). [`GpuSelection::All`] is every GPU this process sees. Resolution reads each
//! GPU's identity without opening it ([`Cuda::identify`]), so naming GPU 7 does not make a
//! context on GPUs 0 to 6.
#![forbid(unsafe_code)]

use std::fmt;
use std::str::FromStr;
use std::sync::Arc;

use crate::error::GpuError;
use crate::ffi::{Cuda, GpuIdentity};

/// One GPU, as a user names it.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuId {
    /// CUDA's ordinal in this process.
    Ordinal(i32),
    /// A UUID or an unambiguous leading part of one, lower case, without `GPU-`.
    Uuid(String),
    /// A PCI address, normalised to sysfs's spelling (`0000:3b:00.0`).
    PciBusId(String),
}

impl Default for GpuId {
    /// GPU 0.
    fn default() -> Self {
        GpuId::Ordinal(0)
    }
}

impl fmt::Display for GpuId {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            GpuId::Ordinal(n) => write!(f, "GPU {n}"),
            GpuId::Uuid(u) => write!(f, "GPU with UUID GPU-{u}"),
            GpuId::PciBusId(b) => write!(f, "GPU at PCI address {b}"),
        }
    }
}

/// What a GPU name must look like, for errors.
const EXPECTED: &str = "an ordinal (0, 1, ...), a UUID as nvidia-smi -L prints it \
                        (GPU-xxxxxxxx-...; a unique leading part will do) or a PCI address \
                        (0000:3b:00.0)";

impl FromStr for GpuId {
    type Err = GpuError;

    fn from_str(s: &str) -> Result<Self, GpuError> {
        let t = s.trim();
        let bad = || GpuError::InvalidArgument(format!("GPU {s:?}: expected {EXPECTED}"));
        if t.is_empty() {
            return Err(bad());
        }
        if t.bytes().all(|b| b.is_ascii_digit()) {
            return t.parse::<i32>().map(GpuId::Ordinal).map_err(|_| bad());
        }
        if let Some(bus) = pci_address(t) {
            return Ok(GpuId::PciBusId(bus));
        }
        let lower = t.to_ascii_lowercase();
        let uuid = lower.strip_prefix("gpu-").unwrap_or(&lower);
        // A UUID's hex digits and dashes; at least 8 characters, so that a short typo is not
        // taken for a prefix.
        if uuid.len() >= 8
            && uuid.len() <= 36
            && uuid.bytes().all(|b| b.is_ascii_hexdigit() || b == b'-')
        {
            return Ok(GpuId::Uuid(uuid.to_owned()));
        }
        Err(bad())
    }
}

/// `0000:3b:00.0` or `3b:00.0` (hex, any case) as sysfs spells it, else `None`.
fn pci_address(s: &str) -> Option<String> {
    let lower = s.to_ascii_lowercase();
    let parts: Vec<&str> = lower.split(':').collect();
    let (domain, bus, devfn) = match parts.as_slice() {
        [d, b, df] => (*d, *b, *df),
        [b, df] => ("0000", *b, *df),
        _ => return None,
    };
    let (dev, func) = devfn.split_once('.')?;
    let hex = |x: &str, max: usize| {
        !x.is_empty() && x.len() <= max && x.bytes().all(|b| b.is_ascii_hexdigit())
    };
    if !(hex(domain, 8) && hex(bus, 2) && hex(dev, 2) && hex(func, 1)) {
        return None;
    }
    let n = |x: &str| u32::from_str_radix(x, 16).ok();
    let (d, b, v, f) = (n(domain)?, n(bus)?, n(dev)?, n(func)?);
    (v < 32 && f < 8).then(|| format!("{d:04x}:{b:02x}:{v:02x}.{f:x}"))
}

impl GpuId {
    /// The ordinal this name means among `gpus` (every GPU the process sees), or an error that
    /// names what was asked and what there is.
    pub fn resolve(&self, gpus: &[GpuIdentity]) -> Result<i32, GpuError> {
        let found: Vec<&GpuIdentity> = match self {
            GpuId::Ordinal(n) => gpus.iter().filter(|g| g.ordinal == *n).collect(),
            GpuId::Uuid(u) => gpus
                .iter()
                .filter(|g| {
                    g.uuid
                        .to_ascii_lowercase()
                        .strip_prefix("gpu-")
                        .is_some_and(|have| have.starts_with(u.as_str()))
                })
                .collect(),
            GpuId::PciBusId(b) => gpus
                .iter()
                .filter(|g| g.pci_bus_id.as_deref() == Some(b.as_str()))
                .collect(),
        };
        match found.as_slice() {
            [one] => Ok(one.ordinal),
            [] => Err(GpuError::InvalidArgument(format!(
                "no {self}: this process sees {}",
                describe(gpus)
            ))),
            many => Err(GpuError::InvalidArgument(format!(
                "{self} is ambiguous: it names GPUs {} (give more of the UUID)",
                many.iter()
                    .map(|g| g.ordinal.to_string())
                    .collect::<Vec<_>>()
                    .join(", ")
            ))),
        }
    }

    /// Opens the GPU this names: [`GpuError::NoCuda`] where there is no driver,
    /// [`GpuError::InvalidArgument`] naming the GPUs there are where none has this name.
    pub fn open(&self) -> Result<Arc<Cuda>, GpuError> {
        let count = Cuda::count()?;
        match self {
            GpuId::Ordinal(n) if (0..count).contains(n) => Cuda::open(*n),
            _ => Cuda::open(self.resolve(&list()?)?),
        }
    }
}

/// Every GPU this process sees, in ordinal order, read without opening any.
pub fn list() -> Result<Vec<GpuIdentity>, GpuError> {
    (0..Cuda::count()?).map(Cuda::identify).collect()
}

/// `gpus` for an error: how many, and each one's ordinal, name and UUID.
fn describe(gpus: &[GpuIdentity]) -> String {
    if gpus.is_empty() {
        return "no GPU".into();
    }
    let each: Vec<String> = gpus
        .iter()
        .map(|g| format!("{} {} {}", g.ordinal, g.name, g.uuid))
        .collect();
    format!(
        "{} GPU{} ({})",
        gpus.len(),
        if gpus.len() == 1 { "" } else { "s" },
        each.join("; ")
    )
}

/// One GPU or all of them (`--gpu-id all`).
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum GpuSelection {
    /// One GPU.
    One(GpuId),
    /// Every GPU this process sees.
    All,
}

impl Default for GpuSelection {
    /// GPU 0.
    fn default() -> Self {
        GpuSelection::One(GpuId::default())
    }
}

impl FromStr for GpuSelection {
    type Err = GpuError;

    fn from_str(s: &str) -> Result<Self, GpuError> {
        if s.trim().eq_ignore_ascii_case("all") {
            Ok(GpuSelection::All)
        } else {
            s.parse().map(GpuSelection::One).map_err(|e| match e {
                GpuError::InvalidArgument(m) => GpuError::InvalidArgument(format!("{m}, or all")),
                e => e,
            })
        }
    }
}

impl GpuSelection {
    /// Opens the GPUs selected, in ordinal order.
    pub fn open(&self) -> Result<Vec<Arc<Cuda>>, GpuError> {
        match self {
            GpuSelection::One(id) => Ok(vec![id.open()?]),
            GpuSelection::All => (0..Cuda::count()?).map(Cuda::open).collect(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gpu(ordinal: i32, uuid: &str, bus: Option<&str>) -> GpuIdentity {
        GpuIdentity {
            ordinal,
            name: "NVIDIA H200".into(),
            uuid: uuid.into(),
            pci_bus_id: bus.map(Into::into),
        }
    }

    fn eight() -> Vec<GpuIdentity> {
        (0..8)
            .map(|i| {
                gpu(
                    i,
                    &format!("GPU-{i}f3e0b2c-1a2b-3c4d-5e6f-00000000000{i}"),
                    Some(&format!("0000:{:02x}:00.0", 0x18 + 0x10 * i)),
                )
            })
            .collect()
    }

    #[test]
    fn parses_ordinals_uuids_and_pci_addresses() {
        assert_eq!("3".parse::<GpuId>().unwrap(), GpuId::Ordinal(3));
        assert_eq!(" 0 ".parse::<GpuId>().unwrap(), GpuId::Ordinal(0));
        assert_eq!(
            "GPU-8F3E0B2C-1a2b-3c4d-5e6f-0123456789ab"
                .parse::<GpuId>()
                .unwrap(),
            GpuId::Uuid("8f3e0b2c-1a2b-3c4d-5e6f-0123456789ab".into())
        );
        assert_eq!(
            "8f3e0b2c".parse::<GpuId>().unwrap(),
            GpuId::Uuid("8f3e0b2c".into())
        );
        assert_eq!(
            "0000:3B:00.0".parse::<GpuId>().unwrap(),
            GpuId::PciBusId("0000:3b:00.0".into())
        );
        assert_eq!(
            "3b:00.0".parse::<GpuId>().unwrap(),
            GpuId::PciBusId("0000:3b:00.0".into())
        );
        for bad in [
            "",
            "-1",
            "cuda:1",
            "gpu",
            "abc",
            "99999999999",
            "3b:20.0",
            "3b:00.8",
            "GPU-xyz",
        ] {
            let e = bad.parse::<GpuId>().unwrap_err();
            assert!(
                matches!(&e, GpuError::InvalidArgument(m) if m.contains("expected an ordinal")),
                "{bad:?}: {e}"
            );
        }
        assert_eq!("all".parse::<GpuSelection>().unwrap(), GpuSelection::All);
        assert_eq!("ALL".parse::<GpuSelection>().unwrap(), GpuSelection::All);
        assert_eq!(
            "2".parse::<GpuSelection>().unwrap(),
            GpuSelection::One(GpuId::Ordinal(2))
        );
        let e = "every".parse::<GpuSelection>().unwrap_err();
        assert!(e.to_string().ends_with(", or all"), "{e}");
        assert_eq!(
            GpuSelection::default(),
            GpuSelection::One(GpuId::Ordinal(0))
        );
    }

    #[test]
    fn resolves_among_the_gpus_a_process_sees_and_names_them_when_it_cannot() {
        let gpus = eight();
        assert_eq!(GpuId::Ordinal(5).resolve(&gpus).unwrap(), 5);
        let u: GpuId = "gpu-3F3E0B2C-1A2B-3C4D-5E6F-000000000003".parse().unwrap();
        assert_eq!(u.resolve(&gpus).unwrap(), 3);
        let prefix: GpuId = "6f3e0b2c".parse().unwrap();
        assert_eq!(prefix.resolve(&gpus).unwrap(), 6);
        let bus: GpuId = "58:00.0".parse().unwrap();
        assert_eq!(bus.resolve(&gpus).unwrap(), 4);

        let e = GpuId::Ordinal(8).resolve(&gpus).unwrap_err();
        let m = e.to_string();
        assert!(matches!(e, GpuError::InvalidArgument(_)), "{m}");
        assert!(
            m.contains("no GPU 8: this process sees 8 GPUs (0 NVIDIA H200 GPU-0f3e"),
            "{m}"
        );
        let e = "deadbeef"
            .parse::<GpuId>()
            .unwrap()
            .resolve(&gpus)
            .unwrap_err();
        assert!(
            e.to_string()
                .contains("no GPU with UUID GPU-deadbeef: this process sees 8"),
            "{e}"
        );
        let e = "0000:ff:00.0"
            .parse::<GpuId>()
            .unwrap()
            .resolve(&gpus)
            .unwrap_err();
        assert!(
            e.to_string().contains("no GPU at PCI address 0000:ff:00.0"),
            "{e}"
        );

        // Two GPUs whose UUIDs share the prefix given: refused, naming both.
        let twins = vec![
            gpu(0, "GPU-abcdef01-0000-0000-0000-000000000000", None),
            gpu(1, "GPU-abcdef01-1111-0000-0000-000000000000", None),
        ];
        let e = "abcdef01"
            .parse::<GpuId>()
            .unwrap()
            .resolve(&twins)
            .unwrap_err();
        assert!(
            matches!(&e, GpuError::InvalidArgument(m) if m.contains("ambiguous") && m.contains("0, 1")),
            "{e}"
        );
        // A stand-in has no PCI address: never matched by one.
        let e = "0000:00:00.0"
            .parse::<GpuId>()
            .unwrap()
            .resolve(&twins)
            .unwrap_err();
        assert!(matches!(e, GpuError::InvalidArgument(_)));
        assert!(
            GpuId::Ordinal(0)
                .resolve(&[])
                .unwrap_err()
                .to_string()
                .contains("sees no GPU")
        );
    }
}
