//! Page caches over a striped volume: the layout a cache over the whole volume needs
//! ([`volume_geometry`], for [`GpuCache::on_volume`]) and a volume's files bound to one
//! ([`bind_volume_file`]).

use blockfs::StripedVolume;
use blockfs_gpu::{FilesError, VolumeFile, VolumeFiles};

use crate::{GpuCache, RangeId, VolumeGeometry};

/// The layout a page cache over `volume` needs ([`GpuCache::on_volume`]): its stripe unit, its
/// label area and each member's NVMe namespace (every member must be one).
pub fn volume_geometry(volume: &StripedVolume) -> Result<VolumeGeometry, FilesError> {
    let nsids = volume
        .member_nsids()
        .into_iter()
        .enumerate()
        .map(|(m, ns)| {
            ns.ok_or_else(|| {
                FilesError::InvalidArgument(format!(
                    "volume member {m} is not an NVMe namespace: a GPU cache cannot reach it"
                ))
            })
        })
        .collect::<Result<Vec<u32>, _>>()?;
    Ok(VolumeGeometry {
        stripe_lbas: volume.stripe_lbas(),
        label_lbas: volume.label_lbas(),
        nsids,
    })
}

/// Binds `file` of a file system on `volume` (opened by `files`, [`VolumeFiles::open`]) to
/// `cache`, a cache over the same volume ([`GpuCache::on_volume`] with
/// [`volume_geometry`] and the queues `files` uses, in member order): kernels read it as
/// range [`RangeId::index`], up to its length; each page's fill finds its volume LBAs through
/// the file's table and its member through the volume's layout. The cache keeps the file's
/// blocks pinned until it is closed or dropped. Read-only (a reservation on a volume is not
/// bound yet). Between kernels only.
pub fn bind_volume_file(
    cache: &mut GpuCache<'_>,
    files: &VolumeFiles<'_>,
    volume: &StripedVolume,
    file: &VolumeFile,
) -> Result<RangeId, FilesError> {
    match cache.volume_members() {
        Some((n, _)) if n == volume.members() => {}
        other => {
            return Err(FilesError::InvalidArgument(format!(
                "{}: a file of a volume of {} members needs a cache over that volume \
                 (GpuCache::on_volume); this one is over {}",
                file.name(),
                volume.members(),
                other.map_or("one controller".to_owned(), |(n, _)| format!("{n} members"))
            )));
        }
    }
    let whole = files.volume_table(volume, file)?;
    crate::bind_file(cache, &whole)
}
