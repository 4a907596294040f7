//! The two superblock slots: reading both, picking the one mount uses, and encoding the next
//! generation's (FORMAT.md, "Superblock", "Commit protocol").

use crate::device::{BlockDevice, ReadReq};
use crate::error::{DeviceResultExt, Error, Result};
use crate::format::{
    self, FORMAT_VERSION, MAX_LBA_SIZE, SUPERBLOCK_SIZE, SUPERBLOCK_SLOTS, Superblock,
    SuperblockProblem,
};
use crate::geometry::Geometry;

/// Reads both superblock slots.
pub(crate) fn read_slots(
    dev: &dyn BlockDevice,
) -> Result<[std::result::Result<Superblock, SuperblockProblem>; 2]> {
    let lba = dev.lba_size();
    if !lba.is_power_of_two() || !(512..=MAX_LBA_SIZE).contains(&lba) {
        return Err(Error::Geometry(format!(
            "LBA size {lba} (blockfs needs a power of two from 512 to {MAX_LBA_SIZE})"
        )));
    }
    let mut out = [
        Err(SuperblockProblem::BadMagic),
        Err(SuperblockProblem::BadMagic),
    ];
    for (i, &off) in SUPERBLOCK_SLOTS.iter().enumerate() {
        let slot_lba = off / lba as u64;
        if slot_lba >= dev.lba_count() {
            out[i] = Err(SuperblockProblem::Invalid(format!(
                "device of {} bytes ends before the slot",
                dev.lba_count() * lba as u64
            )));
            continue;
        }
        let mut buf = vec![0u8; lba as usize];
        dev.read(&mut [ReadReq {
            lba: slot_lba,
            buf: &mut buf,
        }])
        .during("reading the superblocks")?;
        out[i] = Superblock::decode(&buf).and_then(|sb| {
            if sb.slot as usize != i {
                Err(SuperblockProblem::Invalid(format!(
                    "superblock for slot {} found in slot {i}",
                    sb.slot
                )))
            } else {
                Ok(sb)
            }
        });
    }
    Ok(out)
}

/// Name of superblock slot `i` for messages.
pub(crate) fn slot_name(i: usize) -> String {
    format!("superblock slot {i} (byte {})", SUPERBLOCK_SLOTS[i])
}

/// Checks a pair of slots the way mount does: both valid, same file system, consecutive
/// generations. Returns the newest.
pub(crate) fn pick_superblock(
    slots: &[std::result::Result<Superblock, SuperblockProblem>; 2],
) -> Result<Superblock> {
    match slots {
        [
            Err(SuperblockProblem::BadMagic),
            Err(SuperblockProblem::BadMagic),
        ] => Err(Error::NotBlockfs(
            "neither superblock slot holds a blockfs superblock".into(),
        )),
        [Err(SuperblockProblem::Unsupported(s)), _]
        | [_, Err(SuperblockProblem::Unsupported(s))] => Err(Error::Unsupported(s.clone())),
        [Err(p), _] => Err(Error::Corrupt {
            what: slot_name(0),
            detail: p.to_string(),
        }),
        [_, Err(p)] => Err(Error::Corrupt {
            what: slot_name(1),
            detail: p.to_string(),
        }),
        [Ok(a), Ok(b)] => {
            let (new, old) = if a.generation > b.generation {
                (a, b)
            } else {
                (b, a)
            };
            if a.uuid != b.uuid
                || a.block_size != b.block_size
                || a.block_count != b.block_count
                || a.mkfs_lba_size != b.mkfs_lba_size
            {
                return Err(Error::Corrupt {
                    what: "superblock slots".into(),
                    detail: "the two slots describe different file systems".into(),
                });
            }
            if old.generation.checked_add(1) != Some(new.generation) {
                return Err(Error::Corrupt {
                    what: slot_name(old.slot as usize),
                    detail: format!(
                        "generation {} is not one before the other slot's {}",
                        old.generation, new.generation
                    ),
                });
            }
            Ok(*new)
        }
    }
}

/// Where a generation's root run is, as its superblock records it.
#[derive(Clone, Copy, Debug)]
pub(crate) struct RootRef {
    /// First block.
    pub bno: u64,
    /// Blocks in the run.
    pub blocks: u32,
    /// Bytes of the root in it.
    pub bytes: u32,
    /// CRC-32C of those bytes.
    pub crc: u32,
}

/// The superblock of generation `generation` pointing at `root`: its slot's first LBA and the
/// LBA-sized image to write there (slot `generation % 2`).
pub(crate) fn slot_image(geo: &Geometry, generation: u64, root: RootRef) -> (u64, Vec<u8>) {
    let mut sb = format::zeroed_superblock();
    sb.magic = format::SUPERBLOCK_MAGIC;
    sb.version = FORMAT_VERSION;
    sb.header_size = SUPERBLOCK_SIZE as u32;
    sb.uuid = geo.uuid;
    sb.generation = generation;
    sb.block_size = geo.block_size;
    sb.mkfs_lba_size = geo.mkfs_lba_size;
    sb.block_count = geo.block_count;
    sb.root_bno = root.bno;
    sb.root_blocks = root.blocks;
    sb.root_bytes = root.bytes;
    sb.root_crc = root.crc;
    sb.slot = (generation % 2) as u32;
    let mut slot = vec![0u8; geo.lba_size as usize];
    slot[..SUPERBLOCK_SIZE].copy_from_slice(&sb.encode());
    (
        SUPERBLOCK_SLOTS[sb.slot as usize] / geo.lba_size as u64,
        slot,
    )
}
