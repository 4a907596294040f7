//! Admin command set: queue management, Identify, Get Log Page, Set/Get Features, Abort and
//! Asynchronous Event Request (NVMe Base 2.0, section 5).

use nvme_spec::command::{
    CreateCqCdw11, CreateQueueCdw10, CreateSqCdw11, DeleteQueueCdw10, FeaturesCdw10,
    GetLogPageCdw10, GetLogPageCdw11, IdentifyCdw10, NumberOfQueues,
};
use nvme_spec::status::{command_specific, generic};
use nvme_spec::{AdminOpcode, Cns, Command, FeatureId, LogPageId};
use zerocopy::IntoBytes;

use std::sync::atomic::Ordering;

use super::handoff::Request;
use super::{CmdResult, Controller, Fail, Features, Outcome, check_cdw0};
use crate::prp::PAGE;
use crate::queue_server::QueueServerRefusal;
use crate::queues::{CompQueue, SubQueue};

/// Error Recovery feature (not named in `nvme_spec`).
const ERROR_RECOVERY: FeatureId = FeatureId(0x05);
/// Interrupt Vector Configuration feature.
const INTERRUPT_VECTOR_CONFIG: FeatureId = FeatureId(0x09);
/// Write Atomicity Normal feature.
const WRITE_ATOMICITY: FeatureId = FeatureId(0x0a);

/// Largest admin data transfer, even when MDTS is unlimited: log pages are small, and the
/// controller builds the whole transfer in memory.
const ADMIN_DATA_MAX: u64 = 2 << 20;

/// Byte offsets of command fields, for the Parameter Error Location.
const NSID_BYTE: u16 = 4;
const PRP1_BYTE: u16 = 24;
const CDW10_BYTE: u16 = 40;
const CDW11_BYTE: u16 = 44;
const CDW12_BYTE: u16 = 48;
const CDW14_BYTE: u16 = 56;

fn invalid_field(byte: u16) -> Fail {
    Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(byte)
}

impl Controller {
    /// Executes one admin command.
    pub(super) fn admin(&mut self, cmd: &Command) -> CmdResult {
        let op = AdminOpcode(cmd.cdw0.opcode());
        let known = matches!(
            op,
            AdminOpcode::DELETE_IO_SQ
                | AdminOpcode::CREATE_IO_SQ
                | AdminOpcode::GET_LOG_PAGE
                | AdminOpcode::DELETE_IO_CQ
                | AdminOpcode::CREATE_IO_CQ
                | AdminOpcode::IDENTIFY
                | AdminOpcode::ABORT
                | AdminOpcode::SET_FEATURES
                | AdminOpcode::GET_FEATURES
                | AdminOpcode::ASYNC_EVENT_REQUEST
        );
        if !known {
            return Err(Fail::generic(generic::INVALID_COMMAND_OPCODE).at(0));
        }
        check_cdw0(cmd)?;
        let delay = self.shared.faults.admin_delay();
        if !delay.is_zero() {
            std::thread::sleep(delay);
        }
        match op {
            AdminOpcode::DELETE_IO_SQ => self.delete_io_sq(cmd),
            AdminOpcode::CREATE_IO_SQ => self.create_io_sq(cmd),
            AdminOpcode::GET_LOG_PAGE => self.get_log_page(cmd),
            AdminOpcode::DELETE_IO_CQ => self.delete_io_cq(cmd),
            AdminOpcode::CREATE_IO_CQ => self.create_io_cq(cmd),
            AdminOpcode::IDENTIFY => self.identify(cmd),
            AdminOpcode::ABORT => self.abort(cmd),
            AdminOpcode::SET_FEATURES => self.set_features(cmd),
            AdminOpcode::GET_FEATURES => self.get_features(cmd),
            _ => self.async_event_request(cmd),
        }
    }

    fn identify(&mut self, cmd: &Command) -> CmdResult {
        let cdw10 = IdentifyCdw10::from(cmd.cdw10);
        let nsid = cmd.nsid;
        let invalid_ns = || Fail::generic(generic::INVALID_NAMESPACE_OR_FORMAT).at(NSID_BYTE);
        match Cns(cdw10.cns()) {
            Cns::NAMESPACE => {
                // Every allocated namespace is active; 0 and FFFFFFFFh (no namespace
                // management) are invalid.
                self.namespace(nsid).ok_or_else(invalid_ns)?;
                let page = self.identify_namespace(nsid);
                self.core.send(cmd, page.as_bytes())?;
            }
            Cns::CONTROLLER => {
                let page = self.identify_controller();
                self.core.send(cmd, page.as_bytes())?;
            }
            Cns::ACTIVE_NAMESPACES => {
                if nsid >= 0xffff_fffe {
                    return Err(invalid_ns());
                }
                let page = self.active_namespaces(nsid);
                self.core.send(cmd, page.as_bytes())?;
            }
            Cns::NAMESPACE_DESCRIPTORS => {
                self.namespace(nsid).ok_or_else(invalid_ns)?;
                let page = self.namespace_descriptors(nsid);
                self.core.send(cmd, &page)?;
            }
            _ => return Err(invalid_field(CDW10_BYTE)),
        }
        Ok(Outcome::Done(0))
    }

    fn get_log_page(&mut self, cmd: &Command) -> CmdResult {
        let cdw10 = GetLogPageCdw10::from(cmd.cdw10);
        let cdw11 = GetLogPageCdw11::from(cmd.cdw11);
        let numd = ((cdw11.numdu() as u64) << 16 | cdw10.numdl_z() as u64) + 1;
        let len = numd * 4;
        let offset = cmd.cdw12 as u64 | (cmd.cdw13 as u64) << 32;
        if len > self.core.max_transfer.min(ADMIN_DATA_MAX) {
            return Err(invalid_field(CDW10_BYTE + 2));
        }
        if cdw10.lsp() != 0 || cdw11.lsi() != 0 {
            return Err(invalid_field(CDW10_BYTE + 1));
        }
        if offset % 4 != 0 {
            return Err(invalid_field(CDW12_BYTE));
        }
        if cmd.cdw14 != 0 {
            // UUID index and index-based offsets are not supported.
            return Err(invalid_field(CDW14_BYTE));
        }
        let lid = LogPageId(cdw10.lid());
        let page: Vec<u8> = match lid {
            LogPageId::ERROR_INFORMATION => {
                let mut page = vec![0u8; self.config.error_log_entries as usize * 64];
                let log = self
                    .shared
                    .error_log
                    .lock()
                    .unwrap_or_else(|e| e.into_inner());
                for (slot, entry) in log.entries.iter().enumerate() {
                    page[slot * 64..(slot + 1) * 64].copy_from_slice(entry.as_bytes());
                }
                page
            }
            LogPageId::SMART_HEALTH => {
                // Only controller-wide SMART data (LPA bit 0 clear).
                if cmd.nsid != 0 && cmd.nsid != 0xffff_ffff {
                    return Err(invalid_field(NSID_BYTE));
                }
                self.smart_log().as_bytes().to_vec()
            }
            LogPageId::FIRMWARE_SLOT => self.firmware_slot_log().to_vec(),
            _ => {
                return Err(Fail::specific(command_specific::INVALID_LOG_PAGE).at(CDW10_BYTE));
            }
        };
        if offset >= page.len() as u64 {
            return Err(invalid_field(CDW12_BYTE));
        }
        // The host may ask for less than the page, or more (the rest reads as zeroes).
        let mut data = vec![0u8; len as usize];
        let avail = &page[offset as usize..];
        let n = avail.len().min(data.len());
        data[..n].copy_from_slice(&avail[..n]);
        self.core.send(cmd, &data)?;
        if lid == LogPageId::ERROR_INFORMATION && !cdw10.rae() {
            // Reading the log without Retain Asynchronous Event unmasks Error status events.
            self.events.error_masked = false;
            self.deliver_events();
        }
        Ok(Outcome::Done(0))
    }

    fn create_io_cq(&mut self, cmd: &Command) -> CmdResult {
        let cdw10 = CreateQueueCdw10::from(cmd.cdw10);
        let cdw11 = CreateCqCdw11::from(cmd.cdw11);
        let qid = cdw10.qid();
        if qid == 0 || qid > self.features.ncqa_z + 1 || self.queues.cq_exists(qid) {
            return Err(Fail::specific(command_specific::INVALID_QUEUE_IDENTIFIER).at(CDW10_BYTE));
        }
        if cdw10.qsize_z() == 0 || cdw10.qsize_z() > self.config.mqes {
            return Err(Fail::specific(command_specific::INVALID_QUEUE_SIZE).at(CDW10_BYTE + 2));
        }
        if !cdw11.pc() {
            // CAP.CQR = 1: queues must be physically contiguous.
            return Err(invalid_field(CDW11_BYTE));
        }
        if cmd.cdw11 & 0xfffc != 0 {
            return Err(invalid_field(CDW11_BYTE));
        }
        // One interrupt vector (0); interrupts are accepted but never raised.
        if cdw11.iv() != 0 {
            return Err(
                Fail::specific(command_specific::INVALID_INTERRUPT_VECTOR).at(CDW11_BYTE + 2)
            );
        }
        if self.shared.regs.cc().iocqes() != 4 {
            return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND));
        }
        if cmd.prp1 % PAGE != 0 {
            return Err(Fail::generic(generic::PRP_OFFSET_INVALID).at(PRP1_BYTE));
        }
        let entries = cdw10.qsize_z() as u32 + 1;
        if let Some(server) = self.shared.queue_server() {
            server
                .create_cq(qid, cmd.prp1, entries)
                .map_err(refusal_to_fail)?;
            self.queues.cq_sqs[qid as usize] = Some(0);
            self.queues.served[qid as usize] = true;
            self.queues.io_cqs += 1;
            // The server's doorbells replace the register: writes to it are refused.
            self.shared.regs.set_queue(qid, false, 0, 0);
            return Ok(Outcome::Done(0));
        }
        let mut cq = CompQueue::new(cmd.prp1, entries);
        cq.doorbell = self.shared.doorbells.set_live(qid, false, true);
        let stale = cq.doorbell.as_ref().map_or(0, |word| word.load());
        cq.seen_doorbell = stale;
        let external = cq.doorbell.is_some();
        let owner = self.owner(qid);
        self.give(owner, Request::AddCq { qid, cq });
        self.queues.cq_sqs[qid as usize] = Some(0);
        self.queues.io_cqs += 1;
        // An external doorbell replaces the register: writes to it are refused.
        self.shared
            .regs
            .set_queue(qid, false, if external { 0 } else { entries }, owner);
        if stale != 0 {
            // The host must zero the word before creating the queue; the value is ignored.
            self.invalid_doorbell_value(qid, false, stale);
        }
        Ok(Outcome::Done(0))
    }

    fn create_io_sq(&mut self, cmd: &Command) -> CmdResult {
        let cdw10 = CreateQueueCdw10::from(cmd.cdw10);
        let cdw11 = CreateSqCdw11::from(cmd.cdw11);
        let qid = cdw10.qid();
        if qid == 0 || qid > self.features.nsqa_z + 1 || self.queues.sq_cq(qid).is_some() {
            return Err(Fail::specific(command_specific::INVALID_QUEUE_IDENTIFIER).at(CDW10_BYTE));
        }
        if cdw10.qsize_z() == 0 || cdw10.qsize_z() > self.config.mqes {
            return Err(Fail::specific(command_specific::INVALID_QUEUE_SIZE).at(CDW10_BYTE + 2));
        }
        if !cdw11.pc() {
            return Err(invalid_field(CDW11_BYTE));
        }
        if cmd.cdw11 & 0xfff8 != 0 {
            return Err(invalid_field(CDW11_BYTE));
        }
        let cqid = cdw11.cqid();
        if cqid == 0 || !self.queues.cq_exists(cqid) {
            return Err(
                Fail::specific(command_specific::COMPLETION_QUEUE_INVALID).at(CDW11_BYTE + 2)
            );
        }
        if cmd.cdw12 & 0xffff != 0 {
            // NVM Set Identifier: NVM sets are not supported.
            return Err(invalid_field(CDW12_BYTE));
        }
        if self.shared.regs.cc().iosqes() != 6 {
            return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND));
        }
        if cmd.prp1 % PAGE != 0 {
            return Err(Fail::generic(generic::PRP_OFFSET_INVALID).at(PRP1_BYTE));
        }
        let entries = cdw10.qsize_z() as u32 + 1;
        if self.queues.is_served(cqid) {
            // The completion queue went to the queue server: so does this queue.
            let Some(server) = self.shared.queue_server() else {
                return Err(Fail::generic(generic::INVALID_FIELD_IN_COMMAND).at(CDW11_BYTE + 2));
            };
            server
                .create_sq(qid, cqid, cmd.prp1, entries)
                .map_err(refusal_to_fail)?;
            self.queues.sq_cq[qid as usize] = Some(cqid);
            if let Some(n) = self.queues.cq_sqs[cqid as usize].as_mut() {
                *n += 1;
            }
            self.queues.io_sqs += 1;
            self.shared.regs.set_queue(qid, true, 0, 0);
            return Ok(Outcome::Done(0));
        }
        let doorbell = self.shared.doorbells.set_live(qid, true, true);
        let external = doorbell.is_some();
        let mut sq = SubQueue::new(cmd.prp1, entries, cqid, doorbell);
        let stale = sq.doorbell.as_ref().map_or(0, |word| word.load());
        sq.seen_doorbell = stale;
        // The submission queue goes to the thread serving its completion queue.
        let owner = self.owner(cqid);
        self.give(owner, Request::AddSq { qid, sq });
        self.queues.sq_cq[qid as usize] = Some(cqid);
        if let Some(n) = self.queues.cq_sqs[cqid as usize].as_mut() {
            *n += 1;
        }
        self.queues.io_sqs += 1;
        // An external doorbell replaces the register: writes to it are refused.
        self.shared
            .regs
            .set_queue(qid, true, if external { 0 } else { entries }, owner);
        if stale != 0 {
            // The host must zero the word before creating the queue: a nonzero value is not
            // taken as a tail (it would make stale entries look submitted) but reported, and
            // ignored until the word changes.
            self.invalid_doorbell_value(qid, true, stale);
        }
        Ok(Outcome::Done(0))
    }

    fn delete_io_sq(&mut self, cmd: &Command) -> CmdResult {
        let qid = DeleteQueueCdw10::from(cmd.cdw10).qid();
        let Some(cqid) = self.queues.sq_cq(qid).filter(|_| qid != 0) else {
            return Err(Fail::specific(command_specific::INVALID_QUEUE_IDENTIFIER).at(CDW10_BYTE));
        };
        if self.queues.is_served(cqid) {
            // The server stops fetching from it before the deletion completes.
            if let Some(server) = self.shared.queue_server() {
                server.delete_sq(qid);
            }
        } else {
            // The owner completes the queue's outstanding commands (delayed ones with their
            // result, dropped ones as aborted by the deletion) and forgets the queue before
            // the deletion completes. Dropping the queue drops its external word: the
            // controller stops reading it.
            self.give(self.owner(cqid), Request::DeleteSq(qid));
        }
        self.shared.regs.set_queue(qid, true, 0, 0);
        self.shared.doorbells.set_live(qid, true, false);
        self.queues.sq_cq[qid as usize] = None;
        if let Some(n) = self.queues.cq_sqs[cqid as usize].as_mut() {
            *n -= 1;
        }
        self.queues.io_sqs -= 1;
        Ok(Outcome::Done(0))
    }

    fn delete_io_cq(&mut self, cmd: &Command) -> CmdResult {
        let qid = DeleteQueueCdw10::from(cmd.cdw10).qid();
        let Some(Some(sqs)) = self.queues.cq_sqs.get(qid as usize).filter(|_| qid != 0) else {
            return Err(Fail::specific(command_specific::INVALID_QUEUE_IDENTIFIER).at(CDW10_BYTE));
        };
        if *sqs > 0 {
            return Err(Fail::specific(command_specific::INVALID_QUEUE_DELETION).at(CDW10_BYTE));
        }
        if self.queues.is_served(qid) {
            if let Some(server) = self.shared.queue_server() {
                server.delete_cq(qid);
            }
            self.queues.served[qid as usize] = false;
        } else {
            self.give(self.owner(qid), Request::DeleteCq(qid));
        }
        self.shared.regs.set_queue(qid, false, 0, 0);
        self.shared.doorbells.set_live(qid, false, false);
        self.queues.cq_sqs[qid as usize] = None;
        self.queues.io_cqs -= 1;
        Ok(Outcome::Done(0))
    }

    /// Abort: a command whose completion was dropped or is being delayed completes now with
    /// Command Abort Requested (posted by the thread serving its queue, before the Abort's own
    /// completion), and the Abort reports it aborted (Dword 0 bit 0 clear). Anything else has
    /// already completed: "not aborted" (bit 0 set).
    fn abort(&mut self, cmd: &Command) -> CmdResult {
        let sqid = cmd.cdw10 as u16;
        let cid = (cmd.cdw10 >> 16) as u16;
        let Some(cqid) = self.queues.sq_cq(sqid) else {
            return Ok(Outcome::Done(1));
        };
        let aborted = self.give(self.owner(cqid), Request::Abort { sqid, cid });
        Ok(Outcome::Done(if aborted { 0 } else { 1 }))
    }

    fn async_event_request(&mut self, cmd: &Command) -> CmdResult {
        if self.events.outstanding.len() >= self.config.async_event_limit as usize {
            return Err(Fail::specific(
                command_specific::ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED,
            ));
        }
        self.events.outstanding.push(cmd.cdw0.cid());
        self.deliver_events();
        Ok(Outcome::Deferred)
    }

    fn set_features(&mut self, cmd: &Command) -> CmdResult {
        let cdw10 = FeaturesCdw10::from(cmd.cdw10);
        if cdw10.sv() {
            return Err(Fail::specific(command_specific::FEATURE_NOT_SAVEABLE)
                .at((CDW10_BYTE + 3) | (7 << 8)));
        }
        let v = cmd.cdw11;
        let f = &mut self.features;
        let dw0 = match FeatureId(cdw10.fid()) {
            FeatureId::ARBITRATION => {
                f.arbitration = v;
                0
            }
            FeatureId::POWER_MANAGEMENT => {
                // One power state (NPSS = 0).
                if v & 0x1f != 0 {
                    return Err(invalid_field(CDW11_BYTE));
                }
                f.power_management = v & 0xff;
                0
            }
            FeatureId::TEMPERATURE_THRESHOLD => {
                let (tmpsel, thsel) = ((v >> 16) & 0xf, (v >> 20) & 0x3);
                if tmpsel != 0 || thsel > 1 {
                    return Err(invalid_field(CDW11_BYTE + 2));
                }
                if thsel == 0 {
                    f.temp_over = v as u16;
                } else {
                    f.temp_under = v as u16;
                }
                0
            }
            ERROR_RECOVERY => {
                // DULBE: deallocated blocks read as zeroes, never as errors.
                if v & (1 << 16) != 0 {
                    return Err(invalid_field(CDW11_BYTE + 2));
                }
                f.error_recovery = v & 0xffff;
                0
            }
            FeatureId::VOLATILE_WRITE_CACHE => {
                f.volatile_write_cache = v & 1 != 0;
                self.shared
                    .volatile_write_cache
                    .store(f.volatile_write_cache, Ordering::Release);
                0
            }
            FeatureId::NUMBER_OF_QUEUES => {
                let nq = NumberOfQueues::from(v);
                if nq.nsq_z() == 0xffff || nq.ncq_z() == 0xffff {
                    return Err(invalid_field(CDW11_BYTE));
                }
                if self.queues.io_sqs > 0 || self.queues.io_cqs > 0 {
                    return Err(Fail::generic(generic::COMMAND_SEQUENCE_ERROR));
                }
                let max_z = self.config.max_io_queue_pairs - 1;
                f.nsqa_z = nq.nsq_z().min(max_z);
                f.ncqa_z = nq.ncq_z().min(max_z);
                u32::from(
                    NumberOfQueues::new()
                        .with_nsq_z(f.nsqa_z)
                        .with_ncq_z(f.ncqa_z),
                )
            }
            FeatureId::INTERRUPT_COALESCING => {
                f.interrupt_coalescing = v & 0xffff;
                0
            }
            INTERRUPT_VECTOR_CONFIG => {
                if v & 0xffff != 0 {
                    return Err(invalid_field(CDW11_BYTE));
                }
                f.interrupt_vector_cd = v & (1 << 16) != 0;
                0
            }
            WRITE_ATOMICITY => {
                f.write_atomicity = v & 1;
                0
            }
            FeatureId::ASYNC_EVENT_CONFIG => {
                f.async_event_config = v;
                0
            }
            _ => return Err(invalid_field(CDW10_BYTE)),
        };
        Ok(Outcome::Done(dw0))
    }

    fn get_features(&mut self, cmd: &Command) -> CmdResult {
        let cdw10 = FeaturesCdw10::from(cmd.cdw10);
        let fid = FeatureId(cdw10.fid());
        let supported = matches!(
            fid,
            FeatureId::ARBITRATION
                | FeatureId::POWER_MANAGEMENT
                | FeatureId::TEMPERATURE_THRESHOLD
                | ERROR_RECOVERY
                | FeatureId::VOLATILE_WRITE_CACHE
                | FeatureId::NUMBER_OF_QUEUES
                | FeatureId::INTERRUPT_COALESCING
                | INTERRUPT_VECTOR_CONFIG
                | WRITE_ATOMICITY
                | FeatureId::ASYNC_EVENT_CONFIG
        );
        if !supported {
            return Err(invalid_field(CDW10_BYTE));
        }
        let f = match cdw10.sel() {
            0 => self.features,
            // Nothing is saveable, so "saved" reads as the default.
            1 | 2 => Features::defaults(self.config.max_io_queue_pairs),
            // Capabilities: changeable, not namespace specific, not saveable.
            3 => return Ok(Outcome::Done(0b100)),
            _ => return Err(invalid_field(CDW10_BYTE + 1)),
        };
        let v = cmd.cdw11;
        let dw0 = match fid {
            FeatureId::ARBITRATION => f.arbitration,
            FeatureId::POWER_MANAGEMENT => f.power_management,
            FeatureId::TEMPERATURE_THRESHOLD => {
                let (tmpsel, thsel) = ((v >> 16) & 0xf, (v >> 20) & 0x3);
                if tmpsel != 0 || thsel > 1 {
                    return Err(invalid_field(CDW11_BYTE + 2));
                }
                let t = if thsel == 0 {
                    f.temp_over
                } else {
                    f.temp_under
                };
                t as u32 | (v & 0x003f_0000)
            }
            ERROR_RECOVERY => f.error_recovery,
            FeatureId::VOLATILE_WRITE_CACHE => f.volatile_write_cache as u32,
            FeatureId::NUMBER_OF_QUEUES => u32::from(
                NumberOfQueues::new()
                    .with_nsq_z(f.nsqa_z)
                    .with_ncq_z(f.ncqa_z),
            ),
            FeatureId::INTERRUPT_COALESCING => f.interrupt_coalescing,
            INTERRUPT_VECTOR_CONFIG => {
                if v & 0xffff != 0 {
                    return Err(invalid_field(CDW11_BYTE));
                }
                (f.interrupt_vector_cd as u32) << 16
            }
            WRITE_ATOMICITY => f.write_atomicity,
            _ => f.async_event_config,
        };
        Ok(Outcome::Done(dw0))
    }
}

/// The status a queue server's refusal of a Create command completes with.
fn refusal_to_fail(refusal: QueueServerRefusal) -> Fail {
    tracing::debug!(%refusal, "queue server refused a queue");
    match refusal {
        QueueServerRefusal::Unreachable { .. } => Fail::data_transfer(),
        QueueServerRefusal::Unsupported(_) => invalid_field(CDW11_BYTE),
    }
}
