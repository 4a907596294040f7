//! Human-friendly sizes ("4k", "1MiB") and durations ("10s", "500ms") for the command line.

use std::time::Duration;

/// Parses a byte size: a number with an optional binary suffix (`k`, `m`, `g`, `t`, each
/// optionally followed by `b`, `ib` or `iB`; case-insensitive). `"4k"` is 4096.
pub fn parse_size(s: &str) -> Result<u64, String> {
    let t = s.trim();
    let split = t.find(|c: char| !c.is_ascii_digit()).unwrap_or(t.len());
    let (num, suffix) = t.split_at(split);
    let n: u64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a size (examples: 4096, 4k, 128KiB, 1m, 2G)"))?;
    let shift = match suffix.to_ascii_lowercase().as_str() {
        "" | "b" => 0,
        "k" | "kb" | "kib" => 10,
        "m" | "mb" | "mib" => 20,
        "g" | "gb" | "gib" => 30,
        "t" | "tb" | "tib" => 40,
        _ => {
            return Err(format!(
                "`{s}` has an unknown size suffix (use k, m, g or t)"
            ));
        }
    };
    n.checked_mul(1u64 << shift)
        .ok_or_else(|| format!("`{s}` is too large"))
}

/// Parses a duration: a number with a unit `ns`, `us`, `ms`, `s`, `m` or `h`; a bare number is
/// seconds.
pub fn parse_duration(s: &str) -> Result<Duration, String> {
    let t = s.trim();
    let split = t
        .find(|c: char| !(c.is_ascii_digit() || c == '.'))
        .unwrap_or(t.len());
    let (num, unit) = t.split_at(split);
    let n: f64 = num
        .parse()
        .map_err(|_| format!("`{s}` is not a duration (examples: 10s, 500ms, 2m)"))?;
    let secs = match unit {
        "ns" => n / 1e9,
        "us" => n / 1e6,
        "ms" => n / 1e3,
        "" | "s" => n,
        "m" | "min" => n * 60.0,
        "h" => n * 3600.0,
        _ => {
            return Err(format!(
                "`{s}` has an unknown unit (use ns, us, ms, s, m or h)"
            ));
        }
    };
    if !(secs.is_finite() && secs > 0.0) {
        return Err(format!("`{s}` must be a positive duration"));
    }
    Ok(Duration::from_secs_f64(secs))
}

/// Formats a byte count with a binary unit, e.g. `1.50 GiB`.
pub fn format_bytes(bytes: f64) -> String {
    const UNITS: [&str; 5] = ["B", "KiB", "MiB", "GiB", "TiB"];
    let mut v = bytes;
    let mut i = 0;
    while v >= 1024.0 && i + 1 < UNITS.len() {
        v /= 1024.0;
        i += 1;
    }
    if i == 0 {
        format!("{v:.0} {}", UNITS[i])
    } else {
        format!("{v:.2} {}", UNITS[i])
    }
}

/// `text` with control characters escaped (`\n`, `\t`, `\u{1b}`, ...), for printing names and
/// messages that come from a device: a name cannot break a line or send terminal escapes.
pub fn escape_control(text: &str) -> std::borrow::Cow<'_, str> {
    if !text.chars().any(char::is_control) {
        return std::borrow::Cow::Borrowed(text);
    }
    std::borrow::Cow::Owned(
        text.chars()
            .map(|c| {
                if c.is_control() {
                    c.escape_default().to_string()
                } else {
                    c.to_string()
                }
            })
            .collect(),
    )
}

/// A duration in nanoseconds in the unit that suits it: `850 ns`, `72.3 µs`, `1.25 ms`,
/// `3.20 s`.
pub fn format_ns(ns: f64) -> String {
    if ns < 1e3 {
        format!("{ns:.0} ns")
    } else if ns < 1e6 {
        format!("{:.1} µs", ns / 1e3)
    } else if ns < 1e9 {
        format!("{:.2} ms", ns / 1e6)
    } else {
        format!("{:.2} s", ns / 1e9)
    }
}

#[cfg(test)]
mod tests {
    #[test]
    fn durations_in_human_units() {
        assert_eq!(super::format_ns(850.0), "850 ns");
        assert_eq!(super::format_ns(72_340.0), "72.3 µs");
        assert_eq!(super::format_ns(1_250_000.0), "1.25 ms");
        assert_eq!(super::format_ns(3.2e9), "3.20 s");
    }

    use super::*;

    #[test]
    fn sizes() {
        assert_eq!(parse_size("4096").unwrap(), 4096);
        assert_eq!(parse_size("4k").unwrap(), 4096);
        assert_eq!(parse_size("128KiB").unwrap(), 128 << 10);
        assert_eq!(parse_size("1M").unwrap(), 1 << 20);
        assert_eq!(parse_size("2g").unwrap(), 2 << 30);
        assert!(parse_size("4x").is_err());
        assert!(parse_size("k").is_err());
        assert!(parse_size("99999999999999999999t").is_err());
    }

    #[test]
    fn durations() {
        assert_eq!(parse_duration("10s").unwrap(), Duration::from_secs(10));
        assert_eq!(parse_duration("500ms").unwrap(), Duration::from_millis(500));
        assert_eq!(parse_duration("2m").unwrap(), Duration::from_secs(120));
        assert_eq!(parse_duration("3").unwrap(), Duration::from_secs(3));
        assert!(parse_duration("0s").is_err());
        assert!(parse_duration("5 parsecs").is_err());
    }

    #[test]
    fn bytes() {
        assert_eq!(format_bytes(512.0), "512 B");
        assert_eq!(format_bytes(1536.0 * 1024.0 * 1024.0), "1.50 GiB");
    }
}
