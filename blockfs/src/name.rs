//! File name rules: path-like UTF-8 with `/` as separator (FORMAT.md, "Names").

use crate::error::{Error, Result};

/// Longest file name in bytes.
pub const MAX_NAME_LEN: usize = 1024;

/// Checks a file name against the naming rules, returning the broken rule.
pub fn check_name(name: &str) -> Result<(), &'static str> {
    if name.is_empty() {
        return Err("empty");
    }
    if name.len() > MAX_NAME_LEN {
        return Err("longer than 1024 bytes");
    }
    if name.contains('\0') {
        return Err("contains a NUL byte");
    }
    if name.starts_with('/') {
        return Err("starts with '/'");
    }
    if name.ends_with('/') {
        return Err("ends with '/'");
    }
    for component in name.split('/') {
        match component {
            "" => return Err("has an empty component ('//')"),
            "." | ".." => return Err("has a '.' or '..' component"),
            _ => {}
        }
    }
    Ok(())
}

/// [`check_name`] as a crate error.
pub(crate) fn validate_name(name: &str) -> Result<()> {
    check_name(name).map_err(|reason| Error::InvalidName {
        name: name.to_owned(),
        reason,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn accepts_paths_and_rejects_each_rule() {
        assert!(check_name("a").is_ok());
        assert!(check_name("dataset/train/shard-0001.bin").is_ok());
        assert!(check_name("ünïcødé/名前").is_ok());
        assert!(check_name(&"x".repeat(1024)).is_ok());
        assert_eq!(check_name(""), Err("empty"));
        assert_eq!(check_name(&"x".repeat(1025)), Err("longer than 1024 bytes"));
        assert_eq!(check_name("a\0b"), Err("contains a NUL byte"));
        assert_eq!(check_name("/a"), Err("starts with '/'"));
        assert_eq!(check_name("a/"), Err("ends with '/'"));
        assert_eq!(check_name("a//b"), Err("has an empty component ('//')"));
        assert_eq!(check_name("a/../b"), Err("has a '.' or '..' component"));
        assert_eq!(check_name("./b"), Err("has a '.' or '..' component"));
    }
}
