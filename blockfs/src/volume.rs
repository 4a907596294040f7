//! A striped volume (RAID-0) over several block devices, itself a [`BlockDevice`], so blockfs
//! runs on it unchanged.
//!
//! Layout: every member starts with a label area of [`LABEL_BYTES`] (one 4 KiB block, or one
//! LBA where LBAs are larger) holding a [`VolumeLabel`]; the volume's LBAs follow, in stripe
//! units of `stripe_lbas`: unit `u` lives on member `u % n` at member LBA
//! `label_lbas + (u / n) * stripe_lbas`. Every member holds the same number of data LBAs (the
//! smallest member's, rounded down to whole units).
//!
//! [`StripedVolume::open`] takes the members in their order and refuses a set that is not the
//! volume's, naming the member: one without a label, one of another volume, a duplicate, a
//! missing or extra member, a member out of place. A single device needs no volume (blockfs on
//! it directly), so images made before volumes existed stay mountable.

use std::sync::Arc;

use crate::device::{BlockDevice, DeviceError, ReadReq, WriteReq};
use crate::table::{ExtentTable, TableExtent, TableFile};

/// Bytes reserved for the label at the start of every member (at least one LBA).
pub const LABEL_BYTES: u64 = 4096;

/// The label's first bytes.
pub const LABEL_MAGIC: [u8; 8] = *b"GPNVVOL1";

/// The label format's version.
pub const LABEL_VERSION: u32 = 1;

/// Bytes of its 64 in which a damaged label may differ from the one the other members imply
/// for [`StripedVolume::open_repairing`] to rebuild it.
pub const LABEL_REPAIR_MAX_BYTES: usize = 8;

/// What every member records about its volume.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct VolumeLabel {
    /// The volume's identity, the same on every member.
    pub volume_id: [u8; 16],
    /// This member's place (0-based).
    pub member: u32,
    /// Members of the volume.
    pub members: u32,
    /// Stripe unit in bytes (a multiple of the LBA size).
    pub stripe_bytes: u64,
    /// Data LBAs on each member (after the label area).
    pub member_lbas: u64,
    /// LBA size of every member.
    pub lba_size: u32,
}

impl VolumeLabel {
    /// The label's bytes (64; the rest of the label area is zero).
    pub fn encode(&self) -> [u8; 64] {
        let mut b = [0u8; 64];
        b[0..8].copy_from_slice(&LABEL_MAGIC);
        b[8..12].copy_from_slice(&LABEL_VERSION.to_le_bytes());
        b[12..16].copy_from_slice(&self.lba_size.to_le_bytes());
        b[16..32].copy_from_slice(&self.volume_id);
        b[32..36].copy_from_slice(&self.member.to_le_bytes());
        b[36..40].copy_from_slice(&self.members.to_le_bytes());
        b[40..48].copy_from_slice(&self.stripe_bytes.to_le_bytes());
        b[48..56].copy_from_slice(&self.member_lbas.to_le_bytes());
        let crc = crc32c::crc32c(&b[0..56]);
        b[56..60].copy_from_slice(&crc.to_le_bytes());
        b
    }

    /// The label in `b` (a member's first bytes): `Ok(None)` where there is no label (another
    /// magic), an error where one is damaged or from a newer format.
    pub fn decode(b: &[u8]) -> Result<Option<Self>, String> {
        if b.len() < 64 || b[0..8] != LABEL_MAGIC {
            return Ok(None);
        }
        let u32_at = |i: usize| u32::from_le_bytes(b[i..i + 4].try_into().expect("4 bytes"));
        let u64_at = |i: usize| u64::from_le_bytes(b[i..i + 8].try_into().expect("8 bytes"));
        if u32_at(56) != crc32c::crc32c(&b[0..56]) {
            return Err("the volume label fails its checksum".into());
        }
        if u32_at(8) != LABEL_VERSION {
            return Err(format!("volume label version {} is not known", u32_at(8)));
        }
        let mut volume_id = [0u8; 16];
        volume_id.copy_from_slice(&b[16..32]);
        Ok(Some(Self {
            volume_id,
            member: u32_at(32),
            members: u32_at(36),
            stripe_bytes: u64_at(40),
            member_lbas: u64_at(48),
            lba_size: u32_at(12),
        }))
    }
}

/// Why a set of devices is not a volume.
#[derive(Debug, thiserror::Error)]
pub enum VolumeError {
    /// No devices, or more than the label can count.
    #[error("a volume needs 1 to {max} members, not {got}", max = u32::MAX)]
    Count {
        /// Devices given.
        got: usize,
    },
    /// The members' geometry does not allow the volume.
    #[error("volume geometry: {0}")]
    Geometry(String),
    /// A device holds no volume label.
    #[error("device {position} holds no volume label (not a member of any volume)")]
    NotAMember {
        /// Its position in the given list.
        position: usize,
    },
    /// A device's label is damaged or from a newer format.
    #[error("device {position}: {why}")]
    BadLabel {
        /// Its position in the given list.
        position: usize,
        /// What is wrong.
        why: String,
    },
    /// A device belongs to another volume (or its label disagrees with the first member's).
    #[error("device {position} belongs to another volume than device 0 ({what})")]
    WrongVolume {
        /// Its position in the given list.
        position: usize,
        /// What differs.
        what: String,
    },
    /// Two devices are the same member.
    #[error("devices {first} and {second} are both member {member} of the volume")]
    Duplicate {
        /// The member index both hold.
        member: u32,
        /// The first device's position.
        first: usize,
        /// The second's.
        second: usize,
    },
    /// Members of the volume are not among the devices.
    #[error("member(s) {missing:?} of the {members}-member volume are missing")]
    Missing {
        /// The missing members' indices.
        missing: Vec<u32>,
        /// The volume's member count.
        members: u32,
    },
    /// A member is not in its place.
    #[error("device {position} is member {member} of the volume: give the members in order")]
    Reordered {
        /// Its position in the given list.
        position: usize,
        /// The member it is.
        member: u32,
    },
    /// A member's device failed.
    #[error("volume member {position}")]
    Device {
        /// Its position.
        position: usize,
        /// The device's error.
        #[source]
        source: DeviceError,
    },
}

/// A RAID-0 volume over member block devices.
pub struct StripedVolume {
    members: Vec<Arc<dyn BlockDevice>>,
    label: VolumeLabel,
    stripe_lbas: u64,
    label_lbas: u64,
}

impl std::fmt::Debug for StripedVolume {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("StripedVolume")
            .field("label", &self.label)
            .finish_non_exhaustive()
    }
}

/// One piece of a volume request on one member.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct Piece {
    /// The member.
    pub member: usize,
    /// First LBA on the member.
    pub member_lba: u64,
    /// LBAs.
    pub lbas: u64,
    /// LBAs of the request before this piece.
    pub offset: u64,
}

/// A run of a file's bytes that lies on one member ([`StripedVolume::member_runs`]).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct MemberRun {
    /// The member.
    pub member: usize,
    /// First byte of the file.
    pub offset: u64,
    /// Bytes.
    pub len: u64,
}

fn label_lbas(lba_size: u32) -> u64 {
    LABEL_BYTES.div_ceil(lba_size as u64).max(1)
}

fn member_err(position: usize) -> impl FnOnce(DeviceError) -> VolumeError {
    move |source| VolumeError::Device { position, source }
}

impl StripedVolume {
    /// Makes a new volume over `members` (in this order) with stripe unit `stripe_bytes`,
    /// writing every member's label (then flushing). Whatever the members held is lost.
    pub fn create(
        members: Vec<Arc<dyn BlockDevice>>,
        stripe_bytes: u64,
        volume_id: [u8; 16],
    ) -> Result<Self, VolumeError> {
        let n = u32::try_from(members.len())
            .ok()
            .filter(|&n| n > 0)
            .ok_or(VolumeError::Count { got: members.len() })?;
        let lba_size = members[0].lba_size();
        if let Some(p) = members.iter().position(|m| m.lba_size() != lba_size) {
            return Err(VolumeError::Geometry(format!(
                "device {p} has {}-byte LBAs, device 0 {lba_size}-byte",
                members[p].lba_size()
            )));
        }
        if stripe_bytes == 0 || stripe_bytes % lba_size as u64 != 0 {
            return Err(VolumeError::Geometry(format!(
                "a stripe of {stripe_bytes} bytes is not a whole number of {lba_size}-byte LBAs"
            )));
        }
        let stripe_lbas = stripe_bytes / lba_size as u64;
        let reserved = label_lbas(lba_size);
        let smallest = members.iter().map(|m| m.lba_count()).min().unwrap_or(0);
        let member_lbas = smallest.saturating_sub(reserved) / stripe_lbas * stripe_lbas;
        if member_lbas == 0 {
            return Err(VolumeError::Geometry(format!(
                "the smallest member ({smallest} LBAs) holds no whole stripe after its label"
            )));
        }
        let mut area = vec![0u8; (reserved * lba_size as u64) as usize];
        for (i, m) in members.iter().enumerate() {
            let label = VolumeLabel {
                volume_id,
                member: i as u32,
                members: n,
                stripe_bytes,
                member_lbas,
                lba_size,
            };
            area[..64].copy_from_slice(&label.encode());
            m.write(&[WriteReq { lba: 0, buf: &area }])
                .map_err(member_err(i))?;
        }
        for (i, m) in members.iter().enumerate() {
            m.flush().map_err(member_err(i))?;
        }
        Self::open(members)
    }

    /// Assembles the volume whose members are `members`, in order; refuses any other set.
    pub fn open(members: Vec<Arc<dyn BlockDevice>>) -> Result<Self, VolumeError> {
        if members.is_empty() || u32::try_from(members.len()).is_err() {
            return Err(VolumeError::Count { got: members.len() });
        }
        let mut labels = Vec::with_capacity(members.len());
        for (i, m) in members.iter().enumerate() {
            let lba_size = m.lba_size();
            let mut area = vec![0u8; (label_lbas(lba_size) * lba_size as u64) as usize];
            m.read(&mut [ReadReq {
                lba: 0,
                buf: &mut area,
            }])
            .map_err(member_err(i))?;
            let label = VolumeLabel::decode(&area)
                .map_err(|why| VolumeError::BadLabel { position: i, why })?
                .ok_or(VolumeError::NotAMember { position: i })?;
            labels.push(label);
        }
        Self::from_labels(members, labels)
    }

    /// Checks that `labels` (one per member, in order) describe one volume whose members are
    /// `members` in order, and assembles it (writes nothing).
    fn from_labels(
        members: Vec<Arc<dyn BlockDevice>>,
        labels: Vec<VolumeLabel>,
    ) -> Result<Self, VolumeError> {
        let Some(&first) = labels.first() else {
            return Err(VolumeError::Count { got: 0 });
        };
        for (i, l) in labels.iter().enumerate().skip(1) {
            let what = if l.volume_id != first.volume_id {
                "its volume id differs"
            } else if (l.members, l.stripe_bytes, l.member_lbas, l.lba_size)
                != (
                    first.members,
                    first.stripe_bytes,
                    first.member_lbas,
                    first.lba_size,
                )
            {
                "its geometry differs"
            } else {
                continue;
            };
            return Err(VolumeError::WrongVolume {
                position: i,
                what: what.into(),
            });
        }
        let mut seen: Vec<Option<usize>> = vec![None; first.members as usize];
        for (i, l) in labels.iter().enumerate() {
            let slot = seen
                .get_mut(l.member as usize)
                .ok_or_else(|| VolumeError::BadLabel {
                    position: i,
                    why: format!("member {} of a {}-member volume", l.member, l.members),
                })?;
            if let Some(f) = *slot {
                return Err(VolumeError::Duplicate {
                    member: l.member,
                    first: f,
                    second: i,
                });
            }
            *slot = Some(i);
        }
        let missing: Vec<u32> = (0..first.members)
            .filter(|&k| seen[k as usize].is_none())
            .collect();
        if !missing.is_empty() {
            return Err(VolumeError::Missing {
                missing,
                members: first.members,
            });
        }
        if let Some((i, l)) = labels
            .iter()
            .enumerate()
            .find(|(i, l)| l.member as usize != *i)
        {
            return Err(VolumeError::Reordered {
                position: i,
                member: l.member,
            });
        }
        // The label's geometry is data from a disk: checked against the members before any
        // arithmetic with it (an LBA size of 0 would divide by zero).
        for (i, m) in members.iter().enumerate() {
            let lba = m.lba_size() as u64;
            let fits = m.lba_size() == first.lba_size
                && first.stripe_bytes >= lba
                && first.stripe_bytes % lba == 0
                && label_lbas(m.lba_size())
                    .checked_add(first.member_lbas)
                    .is_some_and(|need| need <= m.lba_count());
            if !fits {
                return Err(VolumeError::Geometry(format!(
                    "device {i} ({} LBAs of {} bytes) cannot hold its part of the volume \
                     ({} data LBAs of {} bytes, {}-byte stripe)",
                    m.lba_count(),
                    m.lba_size(),
                    first.member_lbas,
                    first.lba_size,
                    first.stripe_bytes
                )));
            }
        }
        let reserved = label_lbas(first.lba_size);
        let stripe_lbas = first.stripe_bytes / first.lba_size as u64;
        Ok(Self {
            members,
            label: first,
            stripe_lbas,
            label_lbas: reserved,
        })
    }

    /// Assembles the volume like [`StripedVolume::open`], first rebuilding a member's label
    /// from the others' when exactly one member's label is damaged (fails its checksum, or lost
    /// its magic): the other members' labels carry the volume's identity and geometry, and
    /// their indices leave one place free, the damaged device's. The label is rewritten
    /// (then flushed) only if the damaged device checks out as that member: it holds the
    /// data area the other labels describe; its label area still differs from the rebuilt
    /// label in at most [`LABEL_REPAIR_MAX_BYTES`] of the label's 64 bytes (a blank device, or
    /// one of another volume, differs in the magic or the 16-byte volume id); and the volume
    /// assembled with the rebuilt label holds a valid blockfs superblock in at least one slot.
    ///
    /// Returns the volume and, if a label was rebuilt, a line saying so (for fsck's repair
    /// report). Any other damage, or a set of devices that is not the volume, is refused with
    /// [`StripedVolume::open`]'s error.
    pub fn open_repairing(
        members: Vec<Arc<dyn BlockDevice>>,
    ) -> Result<(Self, Option<String>), VolumeError> {
        let refused = match Self::open(members.clone()) {
            Ok(v) => return Ok((v, None)),
            Err(e @ (VolumeError::BadLabel { .. } | VolumeError::NotAMember { .. })) => e,
            Err(e) => return Err(e),
        };
        let n = members.len();
        let mut areas: Vec<Vec<u8>> = Vec::with_capacity(n);
        let mut labels: Vec<Option<VolumeLabel>> = Vec::with_capacity(n);
        for (i, m) in members.iter().enumerate() {
            let lba_size = m.lba_size();
            let mut area = vec![0u8; (label_lbas(lba_size) * lba_size as u64) as usize];
            m.read(&mut [ReadReq {
                lba: 0,
                buf: &mut area,
            }])
            .map_err(member_err(i))?;
            labels.push(VolumeLabel::decode(&area).ok().flatten());
            areas.push(area);
        }
        let damaged: Vec<usize> = (0..n).filter(|&i| labels[i].is_none()).collect();
        let [p] = damaged[..] else {
            return Err(refused);
        };
        let good: Vec<(usize, VolumeLabel)> = labels
            .iter()
            .enumerate()
            .filter_map(|(i, l)| l.map(|l| (i, l)))
            .collect();
        let Some(&(_, first)) = good.first() else {
            return Err(refused);
        };
        let agree = good.iter().all(|(i, l)| {
            l.member as usize == *i
                && (
                    l.volume_id,
                    l.members,
                    l.stripe_bytes,
                    l.member_lbas,
                    l.lba_size,
                ) == (
                    first.volume_id,
                    first.members,
                    first.stripe_bytes,
                    first.member_lbas,
                    first.lba_size,
                )
        });
        if !agree || first.members as usize != n {
            return Err(refused);
        }
        let rebuilt = VolumeLabel {
            member: p as u32,
            ..first
        };
        let bytes = rebuilt.encode();
        let differ = bytes
            .iter()
            .zip(&areas[p][..64])
            .filter(|(a, b)| a != b)
            .count();
        let why = match &refused {
            VolumeError::BadLabel { why, .. } => why.clone(),
            _ => "the volume label lost its magic".into(),
        };
        if differ > LABEL_REPAIR_MAX_BYTES {
            return Err(VolumeError::BadLabel {
                position: p,
                why: format!(
                    "{why}, and its label area differs from the label the other members imply in {differ} of 64 bytes: not recognizably this volume's member {p}, label not rebuilt"
                ),
            });
        }
        let mut fixed: Vec<VolumeLabel> = labels.iter().map(|l| l.unwrap_or(rebuilt)).collect();
        fixed[p] = rebuilt;
        // Geometry against the devices, and the data: the volume must hold a blockfs.
        let trial = Self::from_labels(members.clone(), fixed)?;
        let slots = crate::superblock::read_slots(&trial).map_err(|e| VolumeError::BadLabel {
            position: p,
            why: format!("{why}; reading the volume with the rebuilt label failed: {e}"),
        })?;
        if !slots.iter().any(|s| s.is_ok()) {
            return Err(VolumeError::BadLabel {
                position: p,
                why: format!(
                    "{why}; with the label the other members imply, the volume holds no valid blockfs superblock, so the label was not rebuilt"
                ),
            });
        }
        drop(trial);
        let mut area = vec![0u8; areas[p].len()];
        area[..64].copy_from_slice(&bytes);
        members[p]
            .write(&[WriteReq { lba: 0, buf: &area }])
            .map_err(member_err(p))?;
        members[p].flush().map_err(member_err(p))?;
        let v = Self::open(members)?;
        Ok((
            v,
            Some(format!(
                "volume member {p}: {why}; rebuilt its label from the other {} members' labels",
                n - 1
            )),
        ))
    }

    /// The volume's label (member 0's).
    pub fn label(&self) -> &VolumeLabel {
        &self.label
    }

    /// Members.
    pub fn members(&self) -> usize {
        self.members.len()
    }

    /// LBAs per stripe unit.
    pub fn stripe_lbas(&self) -> u64 {
        self.stripe_lbas
    }

    /// LBAs before each member's data (its label area).
    pub fn label_lbas(&self) -> u64 {
        self.label_lbas
    }

    /// Each member's NVMe namespace, in member order (`None` for a member that is not one).
    pub fn member_nsids(&self) -> Vec<Option<u32>> {
        self.members.iter().map(|m| m.nvme_nsid()).collect()
    }

    /// `table` (built on this volume: its extents at volume LBAs) naming namespace `nsid`: for
    /// a reader that finds each piece's member and member LBA itself through this layout (a GPU
    /// page cache over the whole volume), to which the table's namespace means nothing.
    pub fn table_naming(&self, table: &ExtentTable, nsid: u32) -> ExtentTable {
        ExtentTable::from_parts(self.label.lba_size, nsid, table.files(), table.extents())
    }

    /// Where volume LBA `lba` lives: (member, member LBA).
    pub fn locate(&self, lba: u64) -> (usize, u64) {
        let n = self.members.len() as u64;
        let unit = lba / self.stripe_lbas;
        let member = (unit % n) as usize;
        let member_lba = self.label_lbas + (unit / n) * self.stripe_lbas + lba % self.stripe_lbas;
        (member, member_lba)
    }

    /// The pieces of `lbas` LBAs from volume LBA `lba`, in order (each within one unit).
    pub fn pieces(&self, lba: u64, lbas: u64) -> Vec<Piece> {
        let mut out = Vec::new();
        let mut done = 0;
        while done < lbas {
            let at = lba + done;
            let n = (self.stripe_lbas - at % self.stripe_lbas).min(lbas - done);
            let (member, member_lba) = self.locate(at);
            out.push(Piece {
                member,
                member_lba,
                lbas: n,
                offset: done,
            });
            done += n;
        }
        out
    }

    /// `table`, a GPU extent table built on this volume (its extents at volume LBAs), cut at
    /// stripe units into one table per member, in member order. Every table keeps every file
    /// entry of `table` (size, allocation, flags, id) with only the pieces of its extents that
    /// lie on that member, at member LBAs and at their own file LBAs, so a kernel translating a
    /// file offset that lies on the member finds it and one on another member falls in a gap.
    /// Each table names its member's NVMe namespace (0 where the member is not one).
    pub fn member_tables(&self, table: &ExtentTable) -> Vec<ExtentTable> {
        let n = self.members.len();
        let mut files: Vec<Vec<TableFile>> = vec![Vec::new(); n];
        let mut exts: Vec<Vec<TableExtent>> = vec![Vec::new(); n];
        let all = table.extents();
        for f in table.files() {
            let firsts: Vec<u64> = exts.iter().map(|e| e.len() as u64).collect();
            let first = usize::try_from(f.first_extent).unwrap_or(usize::MAX);
            let count = usize::try_from(f.extent_count).unwrap_or(usize::MAX);
            let own = all.get(first..first.saturating_add(count)).unwrap_or(&[]);
            for e in own {
                for p in self.pieces(e.lba, e.nlb) {
                    let file_lba = e.file_lba + p.offset;
                    let list = &mut exts[p.member];
                    if list.len() as u64 > firsts[p.member]
                        && let Some(last) = list.last_mut()
                        && last.file_lba + last.nlb == file_lba
                        && last.lba + last.nlb == p.member_lba
                    {
                        last.nlb += p.lbas;
                        continue;
                    }
                    list.push(TableExtent {
                        file_lba,
                        lba: p.member_lba,
                        nlb: p.lbas,
                    });
                }
            }
            for m in 0..n {
                files[m].push(TableFile {
                    first_extent: firsts[m],
                    extent_count: exts[m].len() as u64 - firsts[m],
                    ..*f
                });
            }
        }
        (0..n)
            .map(|m| {
                let nsid = self.members[m].nvme_nsid().unwrap_or(0);
                ExtentTable::from_parts(self.label.lba_size, nsid, &files[m], &exts[m])
            })
            .collect()
    }

    /// The runs of bytes `offset..offset + len` of file `file` of `table` (built on this
    /// volume) that lie on one member each, in file order (adjacent bytes on one member make
    /// one run): the requests a reader issues on each member's queues with that member's table
    /// ([`StripedVolume::member_tables`]). Stops at the end of the file, as reads do.
    pub fn member_runs(
        &self,
        table: &ExtentTable,
        file: usize,
        offset: u64,
        len: u64,
    ) -> Vec<MemberRun> {
        let size = table.files().get(file).map_or(0, |f| f.size_bytes);
        self.runs_until(table, file, offset, len, size, ExtentTable::translate)
    }

    /// [`StripedVolume::member_runs`] for a writer: stops at the end of the file's allocation
    /// (a device-write reservation's table, whose length is still the old one), not its length.
    pub fn member_write_runs(
        &self,
        table: &ExtentTable,
        file: usize,
        offset: u64,
        len: u64,
    ) -> Vec<MemberRun> {
        let alloc = table.files().get(file).map_or(0, |f| f.alloc_bytes);
        self.runs_until(
            table,
            file,
            offset,
            len,
            alloc,
            ExtentTable::translate_write,
        )
    }

    fn runs_until(
        &self,
        table: &ExtentTable,
        file: usize,
        offset: u64,
        len: u64,
        limit: u64,
        translate: fn(&ExtentTable, usize, u64) -> Option<crate::table::Translation>,
    ) -> Vec<MemberRun> {
        let lba = self.label.lba_size as u64;
        let end = offset.saturating_add(len).min(limit);
        let mut out: Vec<MemberRun> = Vec::new();
        let mut pos = offset;
        while pos < end {
            let Some(t) = translate(table, file, pos) else {
                break;
            };
            let unit_left = self.stripe_lbas - t.lba % self.stripe_lbas;
            let lbas = t.contiguous_lbas.min(unit_left);
            let bytes = (lbas * lba - pos % lba).min(end - pos);
            let member = self.locate(t.lba).0;
            match out.last_mut() {
                Some(r) if r.member == member && r.offset + r.len == pos => r.len += bytes,
                _ => out.push(MemberRun {
                    member,
                    offset: pos,
                    len: bytes,
                }),
            }
            pos += bytes;
        }
        out
    }

    fn check(&self, lba: u64, len: usize) -> Result<u64, DeviceError> {
        let size = self.label.lba_size as usize;
        if len % size != 0 {
            return Err(DeviceError::Misaligned {
                len,
                lba_size: self.label.lba_size,
            });
        }
        let n = (len / size) as u64;
        match lba.checked_add(n) {
            Some(end) if end <= self.lba_count() => Ok(n),
            _ => Err(DeviceError::OutOfRange {
                lba,
                end: lba.saturating_add(n),
                blocks: self.lba_count(),
            }),
        }
    }

    /// Runs `f` on every member with work, one thread each; the first error after all finished.
    fn on_members<T: Send>(
        &self,
        work: Vec<Vec<T>>,
        f: impl Fn(&dyn BlockDevice, Vec<T>) -> Result<(), DeviceError> + Sync,
    ) -> Result<(), DeviceError> {
        let busy: Vec<(usize, Vec<T>)> = work
            .into_iter()
            .enumerate()
            .filter(|(_, w)| !w.is_empty())
            .collect();
        if busy.len() == 1 {
            let (i, w) = busy.into_iter().next().expect("one");
            return f(self.members[i].as_ref(), w);
        }
        std::thread::scope(|s| {
            let handles: Vec<_> = busy
                .into_iter()
                .map(|(i, w)| {
                    let m = self.members[i].as_ref();
                    let f = &f;
                    s.spawn(move || f(m, w))
                })
                .collect();
            let mut first = Ok(());
            for h in handles {
                let r = h.join().unwrap_or_else(|_| {
                    Err(DeviceError::Io {
                        op: "volume member",
                        lba: 0,
                        source: Box::new(std::io::Error::other("a member's thread panicked")),
                    })
                });
                if first.is_ok() {
                    first = r;
                }
            }
            first
        })
    }
}

impl BlockDevice for StripedVolume {
    fn lba_size(&self) -> u32 {
        self.label.lba_size
    }

    fn lba_count(&self) -> u64 {
        self.label
            .member_lbas
            .saturating_mul(self.members.len() as u64)
    }

    fn read(&self, reqs: &mut [ReadReq<'_>]) -> Result<(), DeviceError> {
        let size = self.label.lba_size as usize;
        let mut work: Vec<Vec<ReadReq<'_>>> = (0..self.members.len()).map(|_| Vec::new()).collect();
        for r in reqs.iter_mut() {
            self.check(r.lba, r.buf.len())?;
            let mut rest: &mut [u8] = &mut *r.buf;
            for p in self.pieces(r.lba, (rest.len() / size) as u64) {
                let (head, tail) = rest.split_at_mut(p.lbas as usize * size);
                work[p.member].push(ReadReq {
                    lba: p.member_lba,
                    buf: head,
                });
                rest = tail;
            }
        }
        self.on_members(work, |m, mut batch| m.read(&mut batch))
    }

    fn write(&self, reqs: &[WriteReq<'_>]) -> Result<(), DeviceError> {
        let size = self.label.lba_size as usize;
        let mut work: Vec<Vec<WriteReq<'_>>> =
            (0..self.members.len()).map(|_| Vec::new()).collect();
        for r in reqs {
            self.check(r.lba, r.buf.len())?;
            for p in self.pieces(r.lba, (r.buf.len() / size) as u64) {
                let at = p.offset as usize * size;
                work[p.member].push(WriteReq {
                    lba: p.member_lba,
                    buf: &r.buf[at..at + p.lbas as usize * size],
                });
            }
        }
        self.on_members(work, |m, batch| m.write(&batch))
    }

    fn flush(&self) -> Result<(), DeviceError> {
        let work: Vec<Vec<()>> = (0..self.members.len()).map(|_| vec![()]).collect();
        self.on_members(work, |m, _| m.flush())
    }

    fn describe(&self) -> String {
        format!(
            "striped volume of {} members ({} KiB stripe): {}",
            self.members.len(),
            self.label.stripe_bytes >> 10,
            self.members
                .iter()
                .map(|m| m.describe())
                .collect::<Vec<_>>()
                .join("; ")
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::MemDevice;
    use rand::rngs::SmallRng;
    use rand::{Rng, SeedableRng};

    fn mems(n: usize, lba: u32, lbas: u64) -> Vec<Arc<dyn BlockDevice>> {
        (0..n)
            .map(|_| Arc::new(MemDevice::new(lba, lbas)) as Arc<dyn BlockDevice>)
            .collect()
    }

    #[test]
    fn labels_round_trip_and_damage_is_seen() {
        let l = VolumeLabel {
            volume_id: [7; 16],
            member: 2,
            members: 3,
            stripe_bytes: 128 << 10,
            member_lbas: 1000,
            lba_size: 512,
        };
        let mut b = l.encode().to_vec();
        assert_eq!(VolumeLabel::decode(&b), Ok(Some(l)));
        b[40] ^= 1;
        assert!(VolumeLabel::decode(&b).unwrap_err().contains("checksum"));
        assert_eq!(VolumeLabel::decode(&[0u8; 64]), Ok(None));
    }

    /// The stripe arithmetic against a byte-by-byte reference: every volume LBA maps to the
    /// reference member and member LBA, pieces tile every request in order and never cross a
    /// unit, and no two volume LBAs share a place.
    #[test]
    fn stripe_arithmetic_matches_a_reference_model() {
        let mut rng = SmallRng::seed_from_u64(11);
        for n in 1..=5usize {
            for stripe_lbas in [1u64, 8, 256] {
                let lba = 512u32;
                let per_member = 3 * stripe_lbas + (stripe_lbas - 1) + label_lbas(lba);
                let v = StripedVolume::create(mems(n, lba, per_member), stripe_lbas * 512, [1; 16])
                    .unwrap();
                assert_eq!(v.lba_count(), n as u64 * 3 * stripe_lbas);
                let mut seen = std::collections::HashSet::new();
                for x in 0..v.lba_count() {
                    let (m, ml) = v.locate(x);
                    let unit = x / stripe_lbas;
                    assert_eq!(m as u64, unit % n as u64);
                    assert_eq!(ml, 8 + (unit / n as u64) * stripe_lbas + x % stripe_lbas);
                    assert!(ml >= label_lbas(lba) && ml < per_member);
                    assert!(seen.insert((m, ml)), "two volume LBAs share a place");
                }
                for _ in 0..200 {
                    let start = rng.random_range(0..v.lba_count());
                    let len = rng.random_range(1..=v.lba_count() - start);
                    let ps = v.pieces(start, len);
                    let mut at = 0;
                    for p in &ps {
                        assert_eq!(p.offset, at);
                        assert_eq!((p.member, p.member_lba), v.locate(start + at));
                        assert_eq!(
                            (start + at) / stripe_lbas,
                            (start + at + p.lbas - 1) / stripe_lbas,
                            "a piece crosses a unit"
                        );
                        at += p.lbas;
                    }
                    assert_eq!(at, len);
                }
            }
        }
    }

    #[test]
    fn bytes_land_where_the_layout_says() {
        let members = mems(3, 512, 8 + 64);
        let v = StripedVolume::create(members.clone(), 4096, [2; 16]).unwrap();
        let data: Vec<u8> = (0..v.lba_count() as usize * 512)
            .map(|i| (i * 7 + i / 512) as u8)
            .collect();
        v.write(&[WriteReq { lba: 0, buf: &data }]).unwrap();
        for x in 0..v.lba_count() {
            let (m, ml) = v.locate(x);
            let mut b = vec![0u8; 512];
            members[m]
                .read(&mut [ReadReq {
                    lba: ml,
                    buf: &mut b,
                }])
                .unwrap();
            assert_eq!(b, data[x as usize * 512..][..512], "volume LBA {x}");
        }
        let mut back = vec![0u8; 5 * 512];
        v.read(&mut [ReadReq {
            lba: 13,
            buf: &mut back,
        }])
        .unwrap();
        assert_eq!(back, data[13 * 512..18 * 512]);
        let mut past = vec![0u8; 1024];
        assert!(matches!(
            v.read(&mut [ReadReq {
                lba: v.lba_count() - 1,
                buf: &mut past
            }]),
            Err(DeviceError::OutOfRange { .. })
        ));
    }

    /// A label is data from a disk: a well-formed one with an impossible geometry (checksum
    /// right) is an error, never a panic.
    #[test]
    fn impossible_label_geometry_is_an_error() {
        for (lba_size, stripe, member_lbas) in [
            (0u32, 4096u64, 10u64),
            (512, 0, 10),
            (512, 700, 10),
            (512, 4096, u64::MAX),
            (4096, 512, 10),
        ] {
            let m = mems(1, 512, 64);
            let label = VolumeLabel {
                volume_id: [8; 16],
                member: 0,
                members: 1,
                stripe_bytes: stripe,
                member_lbas,
                lba_size,
            };
            let mut area = vec![0u8; 4096];
            area[..64].copy_from_slice(&label.encode());
            m[0].write(&[WriteReq { lba: 0, buf: &area }]).unwrap();
            assert!(
                matches!(StripedVolume::open(m), Err(VolumeError::Geometry(_))),
                "{label:?}"
            );
        }
    }

    #[test]
    fn every_wrong_member_set_is_refused_by_name() {
        let a = mems(3, 512, 200);
        StripedVolume::create(a.clone(), 4096, [3; 16]).unwrap();
        let b = mems(2, 512, 200);
        StripedVolume::create(b.clone(), 4096, [4; 16]).unwrap();
        let blank = mems(1, 512, 200);
        let open = |v: Vec<&Arc<dyn BlockDevice>>| {
            StripedVolume::open(v.into_iter().cloned().collect()).unwrap_err()
        };
        assert!(StripedVolume::open(a.clone()).is_ok());
        assert!(matches!(
            open(vec![&a[0], &a[1]]),
            VolumeError::Missing { ref missing, members: 3 } if missing == &[2]
        ));
        assert!(matches!(
            open(vec![&a[0], &a[1], &a[2], &a[2]]),
            VolumeError::Duplicate {
                member: 2,
                first: 2,
                second: 3
            }
        ));
        assert!(matches!(
            open(vec![&a[0], &a[2], &a[1]]),
            VolumeError::Reordered {
                position: 1,
                member: 2
            }
        ));
        assert!(matches!(
            open(vec![&a[0], &a[1], &b[1]]),
            VolumeError::WrongVolume { position: 2, .. }
        ));
        assert!(matches!(
            open(vec![&a[0], &blank[0], &a[2]]),
            VolumeError::NotAMember { position: 1 }
        ));
        assert!(matches!(
            StripedVolume::open(Vec::new()).unwrap_err(),
            VolumeError::Count { got: 0 }
        ));
        let msg = open(vec![&a[0], &a[2], &a[1]]).to_string();
        assert!(
            msg.contains("device 1") && msg.contains("member 2"),
            "{msg}"
        );
    }
}
