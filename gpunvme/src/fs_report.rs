//! What each `gpunvme fs` command reports: one type per command, [`Serialize`] for `--json`
//! and [`Display`](std::fmt::Display) for text, built from the blockfs types by the functions here so the CLI only
//! prints. Names are escaped in text ([`escape_control`]); JSON carries them exactly.

use std::fmt;

use blockfs::{DataCheck, FileStat, FileSystem, FsStats, FsckReport, Geometry};
use serde::Serialize;

use crate::units::{escape_control, format_bytes};

/// A UUID in its usual text form.
pub fn uuid_text(u: &[u8; 16]) -> String {
    let h: String = u.iter().map(|b| format!("{b:02x}")).collect();
    format!(
        "{}-{}-{}-{}-{}",
        &h[..8],
        &h[8..12],
        &h[12..16],
        &h[16..20],
        &h[20..]
    )
}

/// `fs mkfs`.
#[derive(Clone, Debug, Serialize)]
pub struct MkfsReport {
    /// The new file system's UUID.
    pub uuid: String,
    /// Block size in bytes.
    pub block_size: u32,
    /// Blocks in the file system.
    pub blocks: u64,
    /// Blocks free after mkfs.
    pub free_blocks: u64,
    /// Which transport carried the I/O.
    pub data_path: String,
}

impl MkfsReport {
    /// The report of a file system just made.
    pub fn of(fs: &FileSystem) -> Self {
        let g: Geometry = fs.geometry();
        Self {
            uuid: uuid_text(&g.uuid),
            block_size: g.block_size,
            blocks: g.block_count,
            free_blocks: fs.df().free_blocks,
            data_path: fs.device().describe(),
        }
    }
}

impl fmt::Display for MkfsReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        writeln!(f, "data path: {}", self.data_path)?;
        write!(
            f,
            "made blockfs {}: {} blocks of {} bytes ({}), {} free",
            self.uuid,
            self.blocks,
            self.block_size,
            format_bytes((self.blocks * self.block_size as u64) as f64),
            format_bytes((self.free_blocks * self.block_size as u64) as f64)
        )
    }
}

/// One file, as `fs ls` and `fs stat` show it.
#[derive(Clone, Debug, Serialize)]
pub struct FileEntry {
    /// Name.
    pub name: String,
    /// Unique file id.
    pub file_id: u64,
    /// Size in bytes.
    pub size: u64,
    /// Bytes allocated.
    pub allocated: u64,
    /// Extents.
    pub extents: usize,
    /// Generation of the commit that last changed it.
    pub generation: u64,
    /// Immutable flag.
    pub immutable: bool,
    /// Recorded CRC-32C of its bytes.
    pub crc32c: Option<u32>,
    /// Whether its bytes were last written by a device (a GPU kernel) through an extent table
    /// and committed without a checksum.
    pub device_written: bool,
}

impl From<&FileStat> for FileEntry {
    fn from(s: &FileStat) -> Self {
        Self {
            name: s.name.clone(),
            file_id: s.file_id,
            size: s.size,
            allocated: s.allocated,
            extents: s.extents,
            generation: s.generation,
            immutable: s.immutable,
            crc32c: s.data_crc,
            device_written: s.device_written,
        }
    }
}

/// `fs ls`: the files, in name order (JSON: an array of [`FileEntry`]).
#[derive(Clone, Debug, Serialize)]
#[serde(transparent)]
pub struct ListReport(pub Vec<FileEntry>);

impl ListReport {
    /// Files whose names start with `prefix`.
    pub fn of(fs: &FileSystem, prefix: &str) -> Self {
        Self(fs.list(prefix).iter().map(FileEntry::from).collect())
    }
}

impl fmt::Display for ListReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        for e in &self.0 {
            writeln!(
                f,
                "{:>14} {:>10} {:>4} {}",
                e.size,
                format_bytes(e.allocated as f64),
                e.extents,
                escape_control(&e.name)
            )?;
        }
        write!(f, "{} file(s)", self.0.len())
    }
}

/// `fs rm`.
#[derive(Clone, Debug, Serialize)]
pub struct RemoveReport {
    /// The name removed.
    pub removed: String,
}

impl fmt::Display for RemoveReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "removed {}", escape_control(&self.removed))
    }
}

/// `fs mv`.
#[derive(Clone, Debug, Serialize)]
pub struct RenameReport {
    /// The old name.
    pub from: String,
    /// The new name.
    pub to: String,
}

impl fmt::Display for RenameReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(
            f,
            "renamed {} to {}",
            escape_control(&self.from),
            escape_control(&self.to)
        )
    }
}

/// One extent of a file's GPU table.
#[derive(Clone, Debug, Serialize)]
pub struct ExtentEntry {
    /// First file LBA.
    pub file_lba: u64,
    /// First device LBA.
    pub lba: u64,
    /// LBAs.
    pub nlb: u64,
}

/// `fs stat`.
#[derive(Clone, Debug, Serialize)]
pub struct StatReport {
    /// The file.
    #[serde(flatten)]
    pub file: FileEntry,
    /// Bytes of its GPU extent table.
    pub gpu_table_bytes: usize,
    /// Its extents as the GPU table maps them.
    pub extent_list: Vec<ExtentEntry>,
}

impl StatReport {
    /// File `name` of `fs`.
    pub fn of(fs: &FileSystem, name: &str) -> blockfs::Result<Self> {
        let st = fs.stat(name)?;
        let table = fs.open(name, blockfs::OpenMode::ReadOnly)?.extent_table()?;
        Ok(Self {
            file: FileEntry::from(&st),
            gpu_table_bytes: table.as_bytes().len(),
            extent_list: table
                .extents()
                .iter()
                .map(|e| ExtentEntry {
                    file_lba: e.file_lba,
                    lba: e.lba,
                    nlb: e.nlb,
                })
                .collect(),
        })
    }
}

impl fmt::Display for StatReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let s = &self.file;
        writeln!(f, "name:       {}", escape_control(&s.name))?;
        writeln!(f, "file id:    {}", s.file_id)?;
        writeln!(
            f,
            "size:       {} ({})",
            s.size,
            format_bytes(s.size as f64)
        )?;
        writeln!(
            f,
            "allocated:  {} ({})",
            s.allocated,
            format_bytes(s.allocated as f64)
        )?;
        writeln!(f, "extents:    {}", s.extents)?;
        writeln!(f, "generation: {}", s.generation)?;
        writeln!(f, "immutable:  {}", s.immutable)?;
        match s.crc32c {
            Some(c) => writeln!(
                f,
                "CRC-32C:    {c:#010x} (checked by fs get and fs fsck --data; GPU reads through extent tables are not checked)"
            )?,
            None if s.device_written => writeln!(
                f,
                "CRC-32C:    none: written by a device through an extent table, the host never saw the bytes (reads are not checked)"
            )?,
            None => writeln!(f, "CRC-32C:    none recorded (reads are not checked)")?,
        }
        write!(f, "GPU table:  {} bytes", self.gpu_table_bytes)?;
        for e in &self.extent_list {
            write!(
                f,
                "\n  file LBA {:>12} -> LBA {:>12} x {}",
                e.file_lba, e.lba, e.nlb
            )?;
        }
        Ok(())
    }
}

/// `fs df`.
#[derive(Clone, Debug, Serialize)]
pub struct DfReport {
    /// Block size in bytes.
    pub block_size: u32,
    /// Blocks in the file system.
    pub total_blocks: u64,
    /// Blocks of file data.
    pub data_blocks: u64,
    /// Blocks of metadata (superblock area included).
    pub metadata_blocks: u64,
    /// Free blocks.
    pub free_blocks: u64,
    /// Of those, blocks file data may take.
    pub available_blocks: u64,
    /// `available_blocks` in bytes.
    pub available_bytes: u64,
    /// Blocks freed by the last commits, free after the next ones.
    pub pending_blocks: u64,
    /// Files.
    pub files: u64,
    /// Generation of the last commit.
    pub generation: u64,
    /// The file system's UUID.
    pub uuid: String,
}

impl DfReport {
    /// `fs`'s space accounting.
    pub fn of(fs: &FileSystem) -> Self {
        let d: FsStats = fs.df();
        Self {
            block_size: d.block_size,
            total_blocks: d.total_blocks,
            data_blocks: d.data_blocks,
            metadata_blocks: d.metadata_blocks,
            free_blocks: d.free_blocks,
            available_blocks: d.available_blocks,
            available_bytes: d.available_blocks * d.block_size as u64,
            pending_blocks: d.pending_blocks,
            files: d.files,
            generation: d.generation,
            uuid: uuid_text(&fs.geometry().uuid),
        }
    }
}

impl fmt::Display for DfReport {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let bs = self.block_size as u64;
        let b = |n: u64| format_bytes((n * bs) as f64);
        writeln!(
            f,
            "size:      {} ({} blocks of {bs} bytes)",
            b(self.total_blocks),
            self.total_blocks
        )?;
        writeln!(f, "data:      {}", b(self.data_blocks))?;
        writeln!(f, "metadata:  {}", b(self.metadata_blocks))?;
        writeln!(
            f,
            "free:      {} ({} bytes available for file data; the rest is kept for metadata)",
            b(self.free_blocks),
            self.available_bytes
        )?;
        writeln!(
            f,
            "pending:   {} (free after the next commits)",
            b(self.pending_blocks)
        )?;
        writeln!(f, "files:     {}", self.files)?;
        write!(f, "generation {}", self.generation)
    }
}

/// What `fs fsck --data` found.
#[derive(Clone, Debug, Default, Serialize)]
pub struct DataReport {
    /// Files whose bytes match their recorded CRC-32C.
    pub verified: u64,
    /// Files without a recorded CRC-32C (not checked), device-written ones included.
    pub unchecked: u64,
    /// Of the unchecked files, those written by a device through an extent table, whose
    /// commit recorded no checksum.
    pub device_written: u64,
    /// Files whose bytes do not match.
    pub mismatched: Vec<String>,
}

/// Reads every file of `fs` and compares it with its recorded CRC-32C.
pub fn check_data(fs: &FileSystem) -> blockfs::Result<DataReport> {
    let mut r = DataReport::default();
    for f in fs.list("") {
        match fs.verify_data(&f.name)? {
            DataCheck::Match => r.verified += 1,
            DataCheck::NoChecksum => r.unchecked += 1,
            DataCheck::DeviceWritten => {
                r.unchecked += 1;
                r.device_written += 1;
            }
            DataCheck::Mismatch { .. } => r.mismatched.push(f.name),
        }
    }
    Ok(r)
}

/// `fs fsck`: the check (and repair) report, with `--data`'s findings.
pub struct FsckView<'a> {
    /// What fsck found and did.
    pub report: &'a FsckReport,
    /// Whether repair was asked for.
    pub repair: bool,
    /// `--data`'s findings, when asked for.
    pub data: Option<&'a DataReport>,
}

impl FsckView<'_> {
    fn to_json(&self) -> serde_json::Value {
        use serde_json::json;
        let r = self.report;
        let problems = |ps: &[blockfs::Problem]| -> Vec<serde_json::Value> {
            ps.iter()
                .map(|p| json!({ "what": p.what, "detail": p.detail }))
                .collect()
        };
        json!({
            "clean": r.is_clean(),
            "consistent": r.is_consistent(),
            "generation": r.generation,
            "slots": r.slots.iter().map(|s| json!({
                "slot": s.slot,
                "byte_offset": s.byte_offset,
                "generation": s.generation,
                "problem": s.problem,
            })).collect::<Vec<_>>(),
            "problems": problems(&r.problems),
            "older_generation": r.older_generation,
            "older_problems": problems(&r.older_problems),
            "files": r.files,
            "total_blocks": r.total_blocks,
            "data_blocks": r.data_blocks,
            "metadata_blocks": r.metadata_blocks,
            "free_blocks": r.free_blocks,
            "pending_blocks": r.pending_blocks,
            "repair": self.repair,
            "repairs": r.repairs,
            "lost": r.lost,
            "reverted": r.reverted,
            "lost_unknown": r.lost_unknown,
            "unrepairable": r.unrepairable,
            "remaining": problems(&r.remaining),
            "data": self.data,
        })
    }
}

impl Serialize for FsckView<'_> {
    fn serialize<S: serde::Serializer>(&self, s: S) -> Result<S::Ok, S::Error> {
        self.to_json().serialize(s)
    }
}

impl fmt::Display for FsckView<'_> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let r = self.report;
        let mut lines: Vec<String> = Vec::new();
        let repaired = !r.repairs.is_empty();
        for p in &r.problems {
            lines.push(format!(
                "{}: {p}",
                if repaired { "found" } else { "problem" }
            ));
        }
        for line in &r.repairs {
            lines.push(format!("repaired: {line}"));
        }
        // What the repair cost, by name: files gone, and files now an older version.
        for n in &r.lost {
            lines.push(format!("lost: {n}"));
        }
        for n in &r.reverted {
            lines.push(format!("reverted to an older version: {n}"));
        }
        if let Some(why) = &r.lost_unknown {
            lines.push(format!("lost files may be missing from this list: {why}"));
        }
        if let Some(u) = &r.unrepairable {
            lines.push(format!("cannot repair: {u}"));
        }
        if repaired {
            lines.push("after repair:".into());
        }
        for s in &r.slots {
            match (&s.generation, &s.problem) {
                (Some(g), _) => lines.push(format!(
                    "superblock slot {} (byte {}): generation {g}",
                    s.slot, s.byte_offset
                )),
                (None, Some(p)) => lines.push(format!(
                    "superblock slot {} (byte {}): {p}",
                    s.slot, s.byte_offset
                )),
                (None, None) => {}
            }
        }
        if let Some(g) = r.generation {
            lines.push(format!(
                "generation {g}: {} file(s); {} of {} blocks used by data, {} by metadata, {} free, {} pending",
                r.files,
                r.data_blocks,
                r.total_blocks,
                r.metadata_blocks,
                r.free_blocks,
                r.pending_blocks
            ));
        }
        if let Some(g) = r.older_generation {
            if r.older_problems.is_empty() {
                lines.push(format!(
                    "previous generation {g}: intact (available for rollback)"
                ));
            }
            for p in &r.older_problems {
                lines.push(format!("previous generation {g}: {p}"));
            }
        }
        for p in &r.remaining {
            lines.push(format!("still wrong: {p}"));
        }
        if let Some(d) = self.data {
            lines.push(format!(
                "file data: {} file(s) match their CRC-32C, {} have none recorded (not checked; {} of them written by a device through an extent table), {} do not match",
                d.verified,
                d.unchecked,
                d.device_written,
                d.mismatched.len()
            ));
            for n in &d.mismatched {
                lines.push(format!("damaged data: {n}"));
            }
        }
        if r.is_clean() {
            lines.push("clean".into());
        } else if self.repair && r.is_consistent() {
            lines.push("repaired; the file system is consistent".into());
        }
        // Problems quote names from the device: escape each line, then join.
        let text: Vec<String> = lines
            .iter()
            .map(|l| escape_control(l).into_owned())
            .collect();
        write!(f, "{}", text.join("\n"))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::sync::Arc;

    #[test]
    fn reports_print_and_serialize() {
        let dev = Arc::new(blockfs::MemDevice::new(512, 16384));
        let fs = FileSystem::mkfs(dev, &blockfs::MkfsOptions::default()).unwrap();
        let mk = MkfsReport::of(&fs);
        assert!(mk.to_string().starts_with("data path: "), "{mk}");
        let f = fs
            .create("a\nb", &blockfs::CreateOptions { size_hint: 5000 })
            .unwrap();
        f.write_at(0, &[1u8; 5000]).unwrap();
        fs.sync().unwrap();
        let ls = ListReport::of(&fs, "");
        assert!(ls.to_string().contains(" a\\nb\n1 file(s)"), "{ls}");
        let v = serde_json::to_value(&ls).unwrap();
        assert_eq!(v[0]["name"], "a\nb");
        assert_eq!(v[0]["size"], 5000);
        let st = StatReport::of(&fs, "a\nb").unwrap();
        let v = serde_json::to_value(&st).unwrap();
        assert_eq!(v["name"], "a\nb", "flattened");
        assert_eq!(
            v["extent_list"][0]["nlb"], 16,
            "LBAs of the allocation: two 4 KiB blocks for the 5000 bytes"
        );
        assert!(st.to_string().contains("name:       a\\nb\n"));
        let df = DfReport::of(&fs);
        assert_eq!(df.files, 1);
        assert!(df.to_string().contains("files:     1\n"));
        assert_eq!(
            RenameReport {
                from: "x".into(),
                to: "y\u{1b}".into()
            }
            .to_string(),
            "renamed x to y\\u{1b}"
        );
        assert_eq!(uuid_text(&[0xab; 16]).len(), 36);
        let data = check_data(&fs).unwrap();
        assert_eq!((data.verified, data.unchecked), (0, 1));
        drop(fs);
        let dev2 = Arc::new(blockfs::MemDevice::new(512, 16384));
        let fs2 = FileSystem::mkfs(dev2.clone(), &blockfs::MkfsOptions::default()).unwrap();
        drop(fs2);
        let report = blockfs::fsck(dev2, &blockfs::FsckOptions::default()).unwrap();
        let view = FsckView {
            report: &report,
            repair: false,
            data: Some(&data),
        };
        assert!(view.to_string().ends_with("do not match\nclean"), "{view}");
        let v = serde_json::to_value(&view).unwrap();
        assert_eq!(v["clean"], true);
        assert_eq!(v["data"]["unchecked"], 1);
        assert_eq!(v["lost"], serde_json::json!([]));
        assert_eq!(v["lost_unknown"], serde_json::Value::Null);

        // A repair's losses, by name, in text and JSON.
        let mut repaired = report.clone();
        repaired.repairs = vec!["rolled back".into()];
        repaired.lost = vec!["gone\n1".into()];
        repaired.reverted = vec!["older".into()];
        repaired.lost_unknown = Some("the root run of generation 7 does not read".into());
        let view = FsckView {
            report: &repaired,
            repair: true,
            data: None,
        };
        let text = view.to_string();
        assert!(
            text.contains(
                "repaired: rolled back\nlost: gone\\n1\nreverted to an older version: older\nlost files may be missing from this list: the root run of generation 7 does not read\n"
            ),
            "{text}"
        );
        let v = serde_json::to_value(&view).unwrap();
        assert_eq!(v["lost"][0], "gone\n1");
        assert_eq!(v["reverted"][0], "older");
        assert_eq!(
            v["lost_unknown"],
            "the root run of generation 7 does not read"
        );
    }
}
