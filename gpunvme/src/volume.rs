//! Striped volumes over several controllers, for the CLI and embedders: one namespace of each
//! controller as a member, made (`mkfs`) or assembled, with the refusals that keep data safe.
//! The volume itself is [`blockfs::StripedVolume`].

use std::sync::Arc;

use crate::error::{Context, Result};
use blockfs::device::ReadReq;
use blockfs::{
    BlockDevice, FileSystem, NvmeBlockDevice, NvmeDeviceOptions, StripedVolume, VolumeLabel,
};
use nvme::Controller;

use crate::error::{InvalidArgument, Refused};

/// Namespace `nsid` of each controller as a member block device (`names` name them in errors).
pub fn members(
    ctrls: &[&Controller],
    names: &[String],
    nsid: u32,
) -> Result<Vec<Arc<dyn BlockDevice>>> {
    ctrls
        .iter()
        .zip(names)
        .map(|(c, name)| {
            NvmeBlockDevice::new(c, nsid, &NvmeDeviceOptions::default())
                .map(|d| Arc::new(d) as Arc<dyn BlockDevice>)
                .with_context(|| format!("opening namespace {nsid} of {name}"))
        })
        .collect()
}

/// The default stripe unit: the smallest maximum transfer of the controllers, a power of two
/// from 4 KiB to 1 MiB.
pub fn default_stripe(ctrls: &[&Controller]) -> u64 {
    ctrls
        .iter()
        .map(|c| c.info().max_transfer_bytes as u64)
        .min()
        .unwrap_or(128 << 10)
        .clamp(4096, 1 << 20)
        .next_power_of_two()
        .min(1 << 20)
}

fn listed(names: &[String]) -> String {
    names
        .iter()
        .enumerate()
        .map(|(i, s)| format!("{i} = {s}"))
        .collect::<Vec<_>>()
        .join(", ")
}

/// Makes a new volume over `members` (labels written; a file system is the caller's next
/// step). Without `force`, refuses ([`Refused`]) members that already make a volume, belong to
/// one, or hold a blockfs.
pub fn make(
    members: Vec<Arc<dyn BlockDevice>>,
    names: &[String],
    stripe: u64,
    force: bool,
) -> Result<StripedVolume> {
    if !force {
        if let Ok(v) = StripedVolume::open(members.clone()) {
            let found = FileSystem::probe(Arc::new(v))
                .context("looking for a file system to keep on the volume")?;
            return Err(Refused(format!(
                "{} already make a striped volume, holding {found}; mkfs would destroy it \
                 (force it to do so)",
                names.join(",")
            ))
            .into());
        }
        for (m, name) in members.iter().zip(names) {
            refuse_member(m.as_ref(), name)?;
            let found = FileSystem::probe(m.clone())
                .with_context(|| format!("looking for a file system to keep on {name}"))?;
            if found.is_blockfs() {
                return Err(Refused(format!(
                    "{name} holds {found}; mkfs would destroy it (force it to do so)"
                ))
                .into());
            }
        }
    }
    let id: [u8; 16] = rand::random();
    StripedVolume::create(members, stripe, id)
        .with_context(|| format!("making a volume of {}", listed(names)))
}

/// Assembles the volume `members` make, in order; a wrong set is refused naming the device.
pub fn assemble(members: Vec<Arc<dyn BlockDevice>>, names: &[String]) -> Result<StripedVolume> {
    refuse_other_lba_size(&members, names)?;
    StripedVolume::open(members)
        .with_context(|| format!("assembling the volume of {}", listed(names)))
}

/// [`assemble`] for fsck's repair: a member whose label alone is damaged gets it rebuilt from
/// the others ([`StripedVolume::open_repairing`]); the line saying so, if one was, goes first
/// in the repair report.
pub fn assemble_repairing(
    members: Vec<Arc<dyn BlockDevice>>,
    names: &[String],
) -> Result<(StripedVolume, Option<String>)> {
    refuse_other_lba_size(&members, names)?;
    StripedVolume::open_repairing(members)
        .with_context(|| format!("assembling the volume of {}", listed(names)))
}

/// Refuses ([`InvalidArgument`]) a member opened with another LBA size than the volume was
/// made on (an image does not record its LBA size): said as such, rather than as a member too
/// small for its part. Members without a readable label are left to the volume's own checks.
fn refuse_other_lba_size(members: &[Arc<dyn BlockDevice>], names: &[String]) -> Result<()> {
    for (i, dev) in members.iter().enumerate() {
        let name = names.get(i).map_or("a device", String::as_str);
        if let Ok(Some(l)) = read_label(dev.as_ref(), name)
            && l.lba_size != dev.lba_size()
        {
            return Err(InvalidArgument(format!(
                "{name} (member {} of a {}-member striped volume) was made with {}-byte LBAs \
                 but is open with {}-byte LBAs: open every member with the LBA size the volume \
                 was made with ({}; images do not record it)",
                l.member,
                l.members,
                l.lba_size,
                dev.lba_size(),
                l.lba_size
            ))
            .into());
        }
    }
    Ok(())
}

/// The volume label at the start of `dev`, if it holds a valid one.
fn read_label(dev: &dyn BlockDevice, what: &str) -> Result<Option<VolumeLabel>> {
    let lba = dev.lba_size() as usize;
    let mut area = vec![0u8; (blockfs::volume::LABEL_BYTES as usize).max(lba)];
    dev.read(&mut [ReadReq {
        lba: 0,
        buf: &mut area,
    }])
    .with_context(|| format!("looking for a volume label on {what}"))?;
    Ok(VolumeLabel::decode(&area).ok().flatten())
}

/// Refuses ([`Refused`]) a device that is a member of a volume, used alone: mkfs would break
/// the volume, anything else would find no file system.
pub fn refuse_member(dev: &dyn BlockDevice, what: &str) -> Result<()> {
    if let Some(l) = read_label(dev, what)? {
        return Err(Refused(format!(
            "{what} is member {} of a {}-member striped volume: give all its devices in order \
             (A,B,...), or make a new file system by force to destroy it",
            l.member, l.members
        ))
        .into());
    }
    Ok(())
}
