//! PCI function addresses (`DDDD:BB:DD.F`) as sysfs and lspci write them.

use std::fmt;
use std::str::FromStr;

use crate::Error;

/// The address of a PCI function: domain (segment), bus, device and function.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub struct PciAddress {
    /// PCI domain (segment group).
    pub domain: u16,
    /// Bus number.
    pub bus: u8,
    /// Device number, 0..=31.
    pub device: u8,
    /// Function number, 0..=7.
    pub function: u8,
}

impl PciAddress {
    /// Largest device number.
    pub const MAX_DEVICE: u8 = 0x1f;
    /// Largest function number.
    pub const MAX_FUNCTION: u8 = 7;
}

impl fmt::Display for PciAddress {
    /// Writes the canonical sysfs form, `0000:01:00.0`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "{:04x}:{:02x}:{:02x}.{:x}",
            self.domain, self.bus, self.device, self.function
        )
    }
}

fn hex_field(s: &str, max_digits: usize, what: &'static str) -> Result<u32, &'static str> {
    if s.is_empty() || s.len() > max_digits || !s.bytes().all(|b| b.is_ascii_hexdigit()) {
        return Err(what);
    }
    // Cannot fail: at most 4 hex digits, all checked above.
    Ok(u32::from_str_radix(s, 16).unwrap_or(u32::MAX))
}

impl FromStr for PciAddress {
    type Err = Error;

    /// Parses `DDDD:BB:DD.F` or `BB:DD.F` (domain 0), hexadecimal, either case.
    fn from_str(input: &str) -> Result<Self, Error> {
        let bad = |reason| Error::MalformedAddress {
            input: input.to_owned(),
            reason,
        };
        let (rest, function) = input
            .rsplit_once('.')
            .ok_or_else(|| bad("no `.F` function part"))?;
        let parts: Vec<&str> = rest.split(':').collect();
        let (domain, bus, device) = match parts.as_slice() {
            [bus, device] => ("0", *bus, *device),
            [domain, bus, device] => (*domain, *bus, *device),
            _ => {
                return Err(bad(
                    "expected two or three `:`-separated fields before the `.`",
                ));
            }
        };
        let domain = hex_field(domain, 4, "domain must be 1-4 hex digits").map_err(bad)?;
        let bus = hex_field(bus, 2, "bus must be 1-2 hex digits").map_err(bad)?;
        let device = hex_field(device, 2, "device must be 1-2 hex digits").map_err(bad)?;
        let function = hex_field(function, 1, "function must be one digit 0-7").map_err(bad)?;
        if device > u32::from(Self::MAX_DEVICE) {
            return Err(bad("device must be 00-1f"));
        }
        if function > u32::from(Self::MAX_FUNCTION) {
            return Err(bad("function must be 0-7"));
        }
        Ok(Self {
            domain: domain as u16,
            bus: bus as u8,
            device: device as u8,
            function: function as u8,
        })
    }
}

/// Whether `s` has the shape of a PCI address (hex digits, `:` and `.`, with at least one `:`
/// and a `.`), so a CLI can route it to VFIO rather than treat it as an image path.
///
/// Shape only: `0000:01:00.9` looks like an address (and then fails to parse with a message
/// saying why), while `disk.img` and `./01:00.0` do not.
pub fn looks_like_pci_address(s: &str) -> bool {
    let Some((rest, func)) = s.rsplit_once('.') else {
        return false;
    };
    let colons = rest.matches(':').count();
    (1..=2).contains(&colons)
        && !func.is_empty()
        && rest.split(':').all(|p| !p.is_empty())
        && rest
            .chars()
            .chain(func.chars())
            .all(|c| c.is_ascii_hexdigit() || c == ':')
        && !func.contains(':')
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_full_and_short_forms() {
        let a: PciAddress = "0000:01:00.0".parse().unwrap();
        assert_eq!(
            a,
            PciAddress {
                domain: 0,
                bus: 1,
                device: 0,
                function: 0
            }
        );
        let b: PciAddress = "3a:1F.7".parse().unwrap();
        assert_eq!(
            b,
            PciAddress {
                domain: 0,
                bus: 0x3a,
                device: 0x1f,
                function: 7
            }
        );
        let c: PciAddress = "ABCD:ff:1e.3".parse().unwrap();
        assert_eq!(
            c,
            PciAddress {
                domain: 0xabcd,
                bus: 0xff,
                device: 0x1e,
                function: 3
            }
        );
    }

    #[test]
    fn displays_canonical_form() {
        let a: PciAddress = "1:2.3".parse().unwrap();
        assert_eq!(a.to_string(), "0000:01:02.3");
        let b: PciAddress = "ABCD:ff:1e.3".parse().unwrap();
        assert_eq!(b.to_string(), "abcd:ff:1e.3");
        assert_eq!(b.to_string().parse::<PciAddress>().unwrap(), b);
    }

    #[test]
    fn rejects_malformed_addresses_with_reason() {
        let cases = [
            ("", "no `.F`"),
            ("0000:01:00", "no `.F`"),
            ("01.0", "two or three"),
            ("0:0:0:0.0", "two or three"),
            ("0000:01:20.0", "device must be 00-1f"),
            ("0000:01:00.8", "function must be 0-7"),
            ("0000:01:00.10", "one digit"),
            ("00000:01:00.0", "domain must be"),
            ("0000:100:00.0", "bus must be"),
            ("0000:0g:00.0", "bus must be"),
            ("0000::00.0", "bus must be"),
            ("0000:01:00.", "function"),
        ];
        for (input, reason) in cases {
            let err = input.parse::<PciAddress>().expect_err(input);
            let msg = err.to_string();
            assert!(
                matches!(err, Error::MalformedAddress { .. }),
                "{input}: {msg}"
            );
            assert!(msg.contains(reason), "{input}: `{msg}` lacks `{reason}`");
            assert!(msg.contains("e.g. 0000:01:00.0"), "{msg}");
            assert!(!msg.contains('\n'));
        }
    }

    #[test]
    fn tells_addresses_from_paths() {
        for s in ["0000:01:00.0", "01:00.0", "0000:01:00.9", "00:1f.7"] {
            assert!(looks_like_pci_address(s), "{s}");
        }
        for s in [
            "disk.img",
            "./01:00.0",
            "/dev/nvme0n1",
            "gpunvme.img",
            "a:b",
            "",
            ":.",
            "x:00.0",
            "01:.0",
        ] {
            assert!(!looks_like_pci_address(s), "{s}");
        }
    }
}
