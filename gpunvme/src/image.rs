//! Image files for the software controller, made at a given size: what `gpunvme image create`,
//! Python's `gpunvme.open(path, create=SIZE)` and `gpunvme.create_image`, and C's
//! `gpunvme_image_create` share. An image is raw (namespace 1 spans the whole file) and sparse:
//! making one allocates nothing on the host until blocks are written.

use std::os::unix::fs::MetadataExt;
use std::path::Path;

use nvme_emu::EmuConfig;

use crate::error::InvalidArgument;
use crate::units;

pub use crate::open::ImageExists;

/// `--size` for clap: [`parse_size`] with its message.
pub fn parse_size_arg(s: &str) -> Result<u64, String> {
    parse_size(s).map_err(|e| e.0)
}

/// What to make.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CreateImage {
    /// The image's size in bytes: a whole number of LBAs.
    pub bytes: u64,
    /// The LBA size its namespace will be opened with (512 or 4096; not stored in the image,
    /// which is raw: open it with the same value).
    pub lba_size: u32,
    /// Replace an existing regular file (its contents are discarded) rather than refuse.
    pub force: bool,
}

/// What was made: `gpunvme --json image create` prints it, Python returns it as a dict.
#[derive(Debug, Clone, PartialEq, Eq, serde::Serialize)]
pub struct ImageReport {
    /// The image's path, as given.
    pub path: String,
    /// Its size in bytes.
    pub bytes: u64,
    /// The LBA size it was made for.
    pub lba_size: u32,
    /// LBAs of namespace 1 at that size.
    pub blocks: u64,
    /// Bytes the host file system allocated for it (0 or close: it is sparse).
    pub allocated_bytes: u64,
    /// Whether an existing file was replaced (`force`).
    pub replaced: bool,
}

impl std::fmt::Display for ImageReport {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "{} {}: {} ({} bytes), sparse ({} allocated); namespace 1: {} LBAs of {} bytes \
             (open it with that LBA size)",
            if self.replaced { "replaced" } else { "created" },
            units::escape_control(&self.path),
            units::format_bytes(self.bytes as f64),
            self.bytes,
            units::format_bytes(self.allocated_bytes as f64),
            self.blocks,
            self.lba_size,
        )
    }
}

/// Parses an image size as the CLI's `--size` and Python's `create=` take it: bytes, or a
/// number with a binary suffix (`64M`, `4G`, `1TiB`; [`units::parse_size`]).
pub fn parse_size(s: &str) -> Result<u64, InvalidArgument> {
    units::parse_size(s).map_err(|e| InvalidArgument(format!("image size: {e}")))
}

/// Checks what `want` asks for without touching anything: an LBA size of 512 or 4096, a size
/// of at least one LBA that is a whole number of them.
pub fn check(want: &CreateImage) -> Result<(), InvalidArgument> {
    if want.lba_size != 512 && want.lba_size != 4096 {
        return Err(InvalidArgument(format!(
            "the LBA size must be 512 or 4096, not {}",
            want.lba_size
        )));
    }
    if want.bytes == 0 || want.bytes % u64::from(want.lba_size) != 0 {
        return Err(InvalidArgument(format!(
            "an image of {} bytes is not a whole number of {}-byte LBAs (at least one)",
            want.bytes, want.lba_size
        )));
    }
    Ok(())
}

/// Makes a sparse image of `want.bytes` at `path`. An existing file is [`ImageExists`] unless
/// `want.force`, which empties it and sets its size (refused while a controller holds it:
/// [`nvme_emu::EmuError::ImageBusy`]); a directory or other non-file is refused either way.
pub fn create(path: &Path, want: &CreateImage) -> crate::Result<ImageReport> {
    check(want)?;
    let replaced = match std::fs::metadata(path) {
        Ok(m) if m.is_dir() => {
            return Err(InvalidArgument(format!(
                "{} is a directory, not an image file",
                path.display()
            ))
            .into());
        }
        Ok(_) if !want.force => return Err(ImageExists::new(path).into()),
        Ok(_) => {
            EmuConfig::recreate_image(path, want.bytes)?;
            true
        }
        Err(_) => {
            match EmuConfig::create_image(path, want.bytes) {
                Ok(()) => {}
                // Made meanwhile, or a dangling link.
                Err(nvme_emu::EmuError::CreateImage { source, .. })
                    if source.kind() == std::io::ErrorKind::AlreadyExists && !want.force =>
                {
                    return Err(ImageExists::new(path).into());
                }
                Err(e) => return Err(e.into()),
            }
            false
        }
    };
    let allocated_bytes = std::fs::metadata(path)
        .map(|m| m.blocks().saturating_mul(512))
        .unwrap_or(0);
    Ok(ImageReport {
        path: path.display().to_string(),
        bytes: want.bytes,
        lba_size: want.lba_size,
        blocks: want.bytes / u64::from(want.lba_size),
        allocated_bytes,
        replaced,
    })
}

/// Makes the image at `path` with `want` if nothing is there; an existing one is left as it is
/// (its size unchanged). For "open, creating it if missing" (Python's `create=`): whether it
/// was made.
pub fn create_if_missing(path: &Path, want: &CreateImage) -> crate::Result<bool> {
    check(want)?;
    if path.exists() {
        return Ok(false);
    }
    match create(
        path,
        &CreateImage {
            force: false,
            ..*want
        },
    ) {
        Ok(_) => Ok(true),
        // Another process made it meanwhile.
        Err(e) if e.is::<ImageExists>() => Ok(false),
        Err(e) => Err(e),
    }
}

/// For an open that creates (Python's `create=`): makes every image `device` names (as
/// [`crate::handle::DeviceHandle::open`] takes it: a path, several comma-separated, or None for
/// `opts.default_image`) that does not exist yet, as `want` says; existing ones are left as they
/// are. A PCI address or vfio-user socket among them is an [`InvalidArgument`], before anything
/// is made.
pub fn create_missing(
    device: Option<&str>,
    opts: &crate::open::OpenOptions,
    want: &CreateImage,
) -> crate::Result<()> {
    use crate::open::DeviceSpec;
    check(want)?;
    let names: Vec<&str> = match device {
        Some(d) => d.split(',').collect(),
        None => Vec::new(),
    };
    let specs = if names.is_empty() {
        vec![DeviceSpec::DefaultImage]
    } else {
        names
            .iter()
            .map(|n| DeviceSpec::parse(Some(n)))
            .collect::<crate::Result<Vec<_>>>()?
    };
    let mut paths = Vec::with_capacity(specs.len());
    for (i, spec) in specs.iter().enumerate() {
        match spec.image_path(opts) {
            Some(p) => paths.push(p),
            None => {
                return Err(InvalidArgument(format!(
                    "creating is for image files; {} is not one",
                    names.get(i).copied().unwrap_or("the device")
                ))
                .into());
            }
        }
    }
    for p in paths {
        create_if_missing(p, want)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::error::ErrorKind;

    #[test]
    fn makes_a_sparse_image_and_refuses_an_existing_one_without_force() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk.img");
        let want = CreateImage {
            bytes: 4 << 30,
            lba_size: 4096,
            force: false,
        };
        let r = create(&p, &want).unwrap();
        assert_eq!((r.bytes, r.blocks, r.replaced), (4 << 30, 1 << 20, false));
        assert!(r.allocated_bytes < 1 << 20, "{r:?}");
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4 << 30);
        std::fs::write(&p, b"data").unwrap();
        let e = create(&p, &want).unwrap_err();
        assert_eq!(e.kind(), ErrorKind::Exists, "{e:#}");
        assert_eq!(std::fs::read(&p).unwrap(), b"data");
        let r = create(
            &p,
            &CreateImage {
                force: true,
                ..want
            },
        )
        .unwrap();
        assert!(r.replaced);
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4 << 30);
        // Left alone when it exists.
        let again = CreateImage {
            bytes: 4096,
            ..want
        };
        assert!(!create_if_missing(&p, &again).unwrap());
        assert_eq!(std::fs::metadata(&p).unwrap().len(), 4 << 30);
    }

    #[test]
    fn bad_sizes_are_refused_before_anything_is_made() {
        let dir = tempfile::tempdir().unwrap();
        let p = dir.path().join("disk.img");
        for (bytes, lba_size) in [(0, 512), (1000, 512), (512, 4096), (4096, 1024)] {
            let e = create(
                &p,
                &CreateImage {
                    bytes,
                    lba_size,
                    force: false,
                },
            )
            .unwrap_err();
            assert_eq!(e.kind(), ErrorKind::InvalidArgument, "{e:#}");
            assert!(!p.exists());
        }
        assert!(parse_size("4G").is_ok_and(|n| n == 4 << 30));
        assert!(parse_size("4Q").is_err());
    }
}
