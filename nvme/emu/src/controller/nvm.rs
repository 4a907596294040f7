//! NVM command set on I/O queues: Read, Write, Flush, Write Zeroes, Dataset Management
//! (NVM Command Set 1.0, section 3).

use std::os::unix::fs::FileExt;
use std::sync::atomic::Ordering;

use nvme_spec::command::{DsmCdw10, DsmCdw11, ReadWriteCdw12, WriteZeroesCdw12, prinfo};
use nvme_spec::status::{command_specific, generic, media};
use nvme_spec::{Command, DsmRange, NvmOpcode};
use zerocopy::FromBytes;

use super::worker::Worker;
use super::{CmdResult, Fail, Outcome, check_cdw0};
use crate::config::MAPPED_READ_MAX;
use crate::forward::ForwardData;
use crate::memory::{DmaError, MapCache};
use crate::prp::{Segment, copy_from_host, copy_to_host};
use crate::stats::Counters;
use crate::storage::{FileMedia, Media};
use crate::stripes::StripedBytes;

/// Byte offsets of command fields, for the Parameter Error Location.
const NSID_BYTE: u16 = 4;
const SLBA_BYTE: u16 = 40;
const CDW12_BYTE: u16 = 48;

/// Flush's broadcast namespace id.
const ALL_NAMESPACES: u32 = 0xffff_ffff;

impl Worker {
    /// Executes one I/O command.
    pub(super) fn io(&mut self, cmd: &Command) -> CmdResult {
        let op = NvmOpcode(cmd.cdw0.opcode());
        let known = matches!(
            op,
            NvmOpcode::FLUSH
                | NvmOpcode::WRITE
                | NvmOpcode::READ
                | NvmOpcode::WRITE_ZEROES
                | NvmOpcode::DATASET_MANAGEMENT
        );
        if !known {
            return Err(Fail::generic(generic::INVALID_COMMAND_OPCODE).at(0));
        }
        check_cdw0(cmd)?;
        match op {
            NvmOpcode::READ => self.read(cmd),
            NvmOpcode::WRITE => self.write(cmd),
            NvmOpcode::FLUSH => self.flush(cmd),
            NvmOpcode::WRITE_ZEROES => self.write_zeroes(cmd),
            _ => self.dataset_management(cmd),
        }
    }

    /// Index of the active namespace `nsid`, or Invalid Namespace or Format.
    fn ns_index(&self, nsid: u32) -> Result<usize, Fail> {
        match nsid as usize {
            n if n >= 1 && n <= self.namespaces.len() => Ok(n - 1),
            _ => Err(Fail::generic(generic::INVALID_NAMESPACE_OR_FORMAT).at(NSID_BYTE)),
        }
    }

    /// Checks the LBA range `slba..slba + nlb` of namespace `index`.
    fn check_range(&self, index: usize, slba: u64, nlb: u64) -> Result<(), Fail> {
        let blocks = self.namespaces[index].blocks;
        if slba.checked_add(nlb).is_none_or(|end| end > blocks) {
            let mut fail = Fail::generic(generic::LBA_OUT_OF_RANGE).at(SLBA_BYTE);
            fail.lba = slba;
            return Err(fail);
        }
        Ok(())
    }

    /// Namespace Is Write Protected for a change to a read-only namespace.
    fn check_writable(&self, index: usize) -> Result<(), Fail> {
        if self.namespaces[index].read_only {
            return Err(Fail::generic(generic::NAMESPACE_WRITE_PROTECTED).at(NSID_BYTE));
        }
        Ok(())
    }

    /// What the namespace's format asks of a Read, Write or Write Zeroes whose PRINFO field is
    /// `pi_field` (see [`crate::NsFormat`]).
    fn check_format(&self, index: usize, cmd: &Command, pi_field: u8) -> Result<(), Fail> {
        match self.namespaces[index].format {
            crate::NsFormat::Plain => Ok(()),
            crate::NsFormat::Zoned => {
                if NvmOpcode(cmd.cdw0.opcode()) == NvmOpcode::READ {
                    Ok(())
                } else {
                    Err(Fail::specific(command_specific::ZONE_INVALID_WRITE).at(SLBA_BYTE))
                }
            }
            crate::NsFormat::Metadata { .. } => {
                Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(CDW12_BYTE + 3))
            }
            crate::NsFormat::Pi { pi_type, .. } => {
                if pi_field & prinfo::PRACT == 0 {
                    return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(CDW12_BYTE + 3));
                }
                if pi_field & prinfo::PRCHK_REF != 0
                    && pi_type != 3
                    && cmd.cdw14 != cmd.slba() as u32
                {
                    return Err(Fail::media(media::REFERENCE_TAG_CHECK_ERROR, cmd.slba()));
                }
                Ok(())
            }
        }
    }

    /// The checks Read and Write share; returns (namespace index, byte offset, byte length).
    fn check_read_write(&mut self, cmd: &Command) -> Result<(usize, u64, u64), Fail> {
        let index = self.ns_index(cmd.nsid)?;
        let cdw12 = ReadWriteCdw12::from(cmd.cdw12);
        // Directives and storage tags are not supported.
        if cdw12.dtype() != 0 || cdw12.stc() {
            return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(CDW12_BYTE + 2));
        }
        let nlb = cdw12.nlb_z() as u64 + 1;
        self.check_format(index, cmd, cdw12.prinfo())?;
        let shift = self.namespaces[index].lba_shift;
        let len = nlb << shift;
        if len > self.max_transfer {
            return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(CDW12_BYTE));
        }
        let slba = cmd.slba();
        self.check_range(index, slba, nlb)?;
        self.walk_prps(cmd, len)?;
        Ok((index, slba << shift, len))
    }

    /// A hint: `cmd` runs soon; if it is a Read served from a mapped image, its blocks are
    /// prefetched into the CPU's cache now. Checks nothing beyond what keeps the hint inside
    /// the mapping (the command itself is checked when it runs).
    pub(super) fn prefetch_read(&self, cmd: &Command) {
        if NvmOpcode(cmd.cdw0.opcode()) != NvmOpcode::READ {
            return;
        }
        let Ok(index) = self.ns_index(cmd.nsid) else {
            return;
        };
        let ns = &self.namespaces[index];
        let Media::File(FileMedia { map: Some(m), .. }) = &ns.media else {
            return;
        };
        let nlb = ReadWriteCdw12::from(cmd.cdw12).nlb_z() as u64 + 1;
        let (offset, len) = (cmd.slba() << ns.lba_shift, nlb << ns.lba_shift);
        if len < MAPPED_READ_MAX as u64 && self.check_range(index, cmd.slba(), nlb).is_ok() {
            m.prefetch(offset, len as usize);
        }
    }

    fn read(&mut self, cmd: &Command) -> CmdResult {
        let (index, offset, len) = self.check_read_write(cmd)?;
        let slba = cmd.slba();
        let nlb = len >> self.namespaces[index].lba_shift;
        if let Some(lba) = self.shared.faults.media_error_in(cmd.nsid, slba, nlb) {
            return Err(Fail::media(media::UNRECOVERED_READ_ERROR, lba));
        }
        let n = len as usize;
        if self.is_forwarded(index) {
            return self.forward(index, cmd, ForwardData::FromController(n));
        }
        let moved = match &self.namespaces[index].media {
            Media::Memory(m) => read_striped(
                m,
                &mut self.cache,
                &self.segments,
                &mut self.bounce,
                offset,
                n,
            ),
            Media::File(FileMedia { map: Some(m), .. }) if n < MAPPED_READ_MAX => read_striped(
                m,
                &mut self.cache,
                &self.segments,
                &mut self.bounce,
                offset,
                n,
            ),
            Media::File(FileMedia { file: f, .. }) => {
                // Segment by segment: straight into host memory where the region takes a
                // positioned read (one copy, by the kernel), else through the bounce buffer.
                let mut file_offset = offset;
                let mut moved = Ok(());
                for &(addr, seg_len) in &self.segments {
                    let seg_len = seg_len as usize;
                    let read = match self.cache.write_from_file(addr, seg_len, f, file_offset) {
                        Ok(Some(read)) => read,
                        Ok(None) => {
                            grow(&mut self.bounce, seg_len);
                            let buf = &mut self.bounce[..seg_len];
                            match f.read_exact_at(buf, file_offset) {
                                Ok(()) => {
                                    if let Err(e) = self.cache.write(addr, buf) {
                                        moved = Err(e);
                                        break;
                                    }
                                    Ok(())
                                }
                                Err(e) => Err(e),
                            }
                        }
                        Err(e) => {
                            moved = Err(e);
                            break;
                        }
                    };
                    if read.is_err() {
                        return Err(Fail::media(media::UNRECOVERED_READ_ERROR, slba));
                    }
                    file_offset += seg_len as u64;
                }
                moved
            }
            Media::Null | Media::Forwarded(_) => Ok(()),
        };
        moved.map_err(|_| Fail::data_transfer())?;
        let c = &self.shared.counters[self.index];
        Counters::add(&c.reads, 1);
        Counters::add(&c.bytes_read, len);
        Ok(Outcome::Done(0))
    }

    fn write(&mut self, cmd: &Command) -> CmdResult {
        let (index, offset, len) = self.check_read_write(cmd)?;
        self.check_writable(index)?;
        let slba = cmd.slba();
        let nlb = len >> self.namespaces[index].lba_shift;
        if let Some(lba) = self.shared.faults.media_error_in(cmd.nsid, slba, nlb) {
            return Err(Fail::media(media::WRITE_FAULT, lba));
        }
        let durable = ReadWriteCdw12::from(cmd.cdw12).fua()
            || !self.shared.volatile_write_cache.load(Ordering::Acquire);
        let n = len as usize;
        if self.is_forwarded(index) {
            let mut data = vec![0; n];
            copy_from_host(&mut self.cache, &self.segments, &mut data)
                .map_err(|_| Fail::data_transfer())?;
            return self.forward(index, cmd, ForwardData::ToController(data));
        }
        match &self.namespaces[index].media {
            Media::Memory(m) => m
                .with_bytes_mut(offset, n, |bytes| {
                    copy_from_host(&mut self.cache, &self.segments, bytes)
                })
                .unwrap_or_else(|| {
                    // Spans stripes: gather first, then copy in under each stripe's lock.
                    grow(&mut self.bounce, n);
                    copy_from_host(&mut self.cache, &self.segments, &mut self.bounce[..n])?;
                    m.write_from(offset, &self.bounce[..n]);
                    Ok(())
                })
                .map_err(|_| Fail::data_transfer())?,
            Media::File(f) => {
                grow(&mut self.bounce, n);
                let buf = &mut self.bounce[..n];
                copy_from_host(&mut self.cache, &self.segments, buf)
                    .map_err(|_| Fail::data_transfer())?;
                if f.write_at(buf, offset).is_err() || (durable && f.sync().is_err()) {
                    return Err(Fail::media(media::WRITE_FAULT, slba));
                }
            }
            Media::Null | Media::Forwarded(_) => {}
        }
        let c = &self.shared.counters[self.index];
        Counters::add(&c.writes, 1);
        Counters::add(&c.bytes_written, len);
        Ok(Outcome::Done(0))
    }

    fn flush(&mut self, cmd: &Command) -> CmdResult {
        let result = if cmd.nsid == ALL_NAMESPACES {
            // Each forwarded namespace's far controller flushes it, one after the other.
            for index in 0..self.namespaces.len() {
                if self.is_forwarded(index) {
                    let mut one = *cmd;
                    one.nsid = index as u32 + 1;
                    self.forward_wait(index, &one, ForwardData::None)?;
                }
            }
            self.namespaces.iter().try_for_each(|ns| ns.flush())
        } else {
            let index = self.ns_index(cmd.nsid)?;
            if self.is_forwarded(index) {
                return self.forward(index, cmd, ForwardData::None);
            }
            self.namespaces[index].flush()
        };
        if result.is_err() {
            return Err(Fail::media(media::WRITE_FAULT, 0));
        }
        Counters::add(&self.shared.counters[self.index].flushes, 1);
        Ok(Outcome::Done(0))
    }

    fn write_zeroes(&mut self, cmd: &Command) -> CmdResult {
        let index = self.ns_index(cmd.nsid)?;
        let cdw12 = WriteZeroesCdw12::from(cmd.cdw12);
        if cdw12.stc() {
            return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(CDW12_BYTE + 3));
        }
        let nlb = cdw12.nlb_z() as u64 + 1;
        let slba = cmd.slba();
        self.check_range(index, slba, nlb)?;
        self.check_writable(index)?;
        self.check_format(index, cmd, cdw12.prinfo())?;
        if let Some(lba) = self.shared.faults.media_error_in(cmd.nsid, slba, nlb) {
            return Err(Fail::media(media::WRITE_FAULT, lba));
        }
        if self.is_forwarded(index) {
            return self.forward(index, cmd, ForwardData::None);
        }
        let durable = cdw12.fua() || !self.shared.volatile_write_cache.load(Ordering::Acquire);
        let ns = &self.namespaces[index];
        let shift = ns.lba_shift;
        let ok = ns.zero(slba << shift, nlb << shift).is_ok()
            && (!durable || !ns.is_file() || ns.flush().is_ok());
        if !ok {
            return Err(Fail::media(media::WRITE_FAULT, slba));
        }
        Ok(Outcome::Done(0))
    }

    /// Dataset Management: with the Deallocate attribute, the ranges read as zeroes afterwards
    /// (DLFEAT = 001b); without it the command is a hint and changes nothing.
    fn dataset_management(&mut self, cmd: &Command) -> CmdResult {
        let index = self.ns_index(cmd.nsid)?;
        let ranges = DsmCdw10::from(cmd.cdw10).nr_z() as usize + 1;
        let deallocate = DsmCdw11::from(cmd.cdw11).ad();
        let len = ranges * size_of::<DsmRange>();
        self.walk_prps(cmd, len as u64)?;
        let mut raw = [0u8; 256 * size_of::<DsmRange>()];
        copy_from_host(&mut self.cache, &self.segments, &mut raw[..len])
            .map_err(|_| Fail::data_transfer())?;
        if self.is_forwarded(index) {
            // The far controller checks the ranges; a hint without Deallocate goes on too.
            return self.forward(index, cmd, ForwardData::ToController(raw[..len].to_vec()));
        }
        if !deallocate {
            return Ok(Outcome::Done(0));
        }
        let parsed = raw[..len]
            .chunks_exact(size_of::<DsmRange>())
            .map(|c| DsmRange::read_from_bytes(c).expect("16-byte range"));
        let mut list = [DsmRange {
            context_attributes: 0,
            nlb: 0,
            slba: 0,
        }; 256];
        for (slot, r) in list.iter_mut().zip(parsed) {
            *slot = r;
        }
        let ranges = &list[..ranges];
        for r in ranges {
            self.check_range(index, r.slba, r.nlb as u64)?;
        }
        self.check_writable(index)?;
        for r in ranges {
            if let Some(lba) = self
                .shared
                .faults
                .media_error_in(cmd.nsid, r.slba, r.nlb as u64)
            {
                return Err(Fail::media(media::WRITE_FAULT, lba));
            }
        }
        let ns = &self.namespaces[index];
        let shift = ns.lba_shift;
        for r in ranges {
            if ns.zero(r.slba << shift, (r.nlb as u64) << shift).is_err() {
                return Err(Fail::media(media::WRITE_FAULT, r.slba));
            }
        }
        Ok(Outcome::Done(0))
    }
}

/// Copies the `n` bytes at `offset` of striped media to the host memory `segments` describe:
/// in place under one stripe's lock, or (spanning stripes) through `bounce`, a stripe at a time.
fn read_striped(
    m: &impl StripedBytes,
    cache: &mut MapCache,
    segments: &[Segment],
    bounce: &mut Vec<u8>,
    offset: u64,
    n: usize,
) -> Result<(), DmaError> {
    m.with_bytes(offset, n, |bytes| copy_to_host(cache, segments, bytes))
        .unwrap_or_else(|| {
            grow(bounce, n);
            m.read_into(offset, &mut bounce[..n]);
            copy_to_host(cache, segments, &bounce[..n])
        })
}

/// Makes `buf` at least `len` bytes long.
fn grow(buf: &mut Vec<u8>, len: usize) {
    if buf.len() < len {
        buf.resize(len, 0);
    }
}
