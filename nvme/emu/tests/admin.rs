//! Admin command set: Identify bytes, queue management errors, features, log pages, AER.

mod common;

use common::*;
use nvme::Device;
use nvme_emu::{Backend, EmuConfig, NamespaceConfig};
use nvme_spec::registers::sq_tail_doorbell;
use nvme_spec::status::{StatusCodeType as Sct, command_specific as cs, generic};
use nvme_spec::{
    AdminOpcode, Command, ErrorInformationLogEntry, IdentifyController, IdentifyNamespace,
    SmartHealthLog,
};
use zerocopy::FromBytes;

fn three_namespaces() -> EmuConfig {
    EmuConfig {
        namespaces: vec![
            NamespaceConfig {
                backend: Backend::Memory,
                blocks: 2048,
                lba_size: 512,
                read_only: false,
                format: nvme_emu::NsFormat::Plain,
            },
            NamespaceConfig {
                backend: Backend::Null,
                blocks: 1 << 20,
                lba_size: 4096,
                read_only: false,
                format: nvme_emu::NsFormat::Plain,
            },
            NamespaceConfig {
                backend: Backend::Memory,
                blocks: 16,
                lba_size: 4096,
                read_only: false,
                format: nvme_emu::NsFormat::Plain,
            },
        ],
        serial: "SN-TEST-42".into(),
        model: "emu model".into(),
        firmware: "fw1.2".into(),
        vendor_id: 0x1234,
        mdts: 3,
        ..EmuConfig::default()
    }
}

#[test]
fn identify_controller_bytes() {
    let mut h = Host::enabled(three_namespaces());
    let (c, raw) = h.identify(1, 0);
    assert_ok(&c);
    // Raw offsets from the specification, then the decoded view.
    assert_eq!(&raw[0..2], &0x1234u16.to_le_bytes());
    assert_eq!(&raw[4..24], b"SN-TEST-42          ");
    assert_eq!(&raw[24..33], b"emu model");
    assert!(raw[33..64].iter().all(|&b| b == b' '));
    assert_eq!(&raw[64..72], b"fw1.2   ");
    assert_eq!(raw[77], 3, "MDTS");
    assert_eq!(&raw[80..84], &0x0001_0400u32.to_le_bytes(), "VER");
    assert_eq!(raw[512], 0x66, "SQES");
    assert_eq!(raw[513], 0x44, "CQES");
    assert_eq!(&raw[516..520], &3u32.to_le_bytes(), "NN");
    let id = IdentifyController::read_from_bytes(&raw[..]).unwrap();
    assert!(
        id.oncs_flags()
            .contains(nvme_spec::Oncs::WRITE_ZEROES | nvme_spec::Oncs::DATASET_MANAGEMENT)
    );
    assert!(id.has_volatile_write_cache());
    assert_eq!(id.elpe, 15);
    assert_eq!(id.aerl, 3);
    assert!(raw[768..].starts_with(b"nqn.2014-08.org.nvmexpress:"));
}

#[test]
fn identify_namespaces_and_lists() {
    let mut h = Host::enabled(three_namespaces());
    let (c, raw) = h.identify(0, 2);
    assert_ok(&c);
    let ns = IdentifyNamespace::read_from_bytes(&raw[..]).unwrap();
    assert_eq!(ns.nsze, 1 << 20);
    assert_eq!(ns.ncap, 1 << 20);
    assert_eq!(ns.current_lba_format().lbads, 12);
    assert_eq!(ns.dlfeat & 0x7, 1, "deallocated blocks read zeroes");
    let (_, raw1) = h.identify(0, 1);
    assert_eq!(
        IdentifyNamespace::read_from_bytes(&raw1[..])
            .unwrap()
            .current_lba_format()
            .lbads,
        9
    );

    let (c, raw) = h.identify(2, 0);
    assert_ok(&c);
    assert_eq!(
        &raw[..16],
        &[1, 0, 0, 0, 2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]
    );
    let (_, raw) = h.identify(2, 1);
    assert_eq!(&raw[..12], &[2, 0, 0, 0, 3, 0, 0, 0, 0, 0, 0, 0]);
    let (_, raw) = h.identify(2, 3);
    assert!(raw.iter().all(|&b| b == 0));

    let (c, raw) = h.identify(3, 1);
    assert_ok(&c);
    assert_eq!((raw[0], raw[1]), (2, 16), "an NGUID descriptor");

    for nsid in [0, 4, 0xffff_ffff] {
        let (c, _) = h.identify(0, nsid);
        assert_status(&c, Sct::GENERIC, generic::INVALID_NAMESPACE_OR_FORMAT);
    }
    let (c, _) = h.identify(2, 0xffff_fffe);
    assert_status(&c, Sct::GENERIC, generic::INVALID_NAMESPACE_OR_FORMAT);
    let (c, _) = h.identify(0x10, 0);
    assert_status(&c, Sct::GENERIC, generic::INVALID_FIELD_IN_COMMAND);
}

#[test]
fn identify_with_offset_prp1_uses_prp2() {
    let mut h = Host::enabled(EmuConfig::default());
    let buf = h.dev.alloc_dma(3 * 4096).unwrap();
    let mut cmd = Command::new(AdminOpcode::IDENTIFY.0, 0, 0);
    cmd.cdw10 = 1;
    cmd.prp1 = buf.device_address(2048);
    cmd.prp2 = buf.device_address(8192);
    let c = h.admin(cmd);
    assert_ok(&c);
    let mut first = [0u8; 24];
    buf.read(2048, &mut first);
    assert_eq!(&first[4..20], b"GPUNVME-EMU-0001");
    // The second half went to the page PRP2 named, not the adjacent one.
    let mut second = [0u8; 2048];
    buf.read(8192, &mut second);
    let mut adjacent = [0u8; 2048];
    buf.read(4096, &mut adjacent);
    assert!(adjacent.iter().all(|&b| b == 0));
    // Bytes 2048.. of the page: power state descriptor 0 starts there (MP = 2500).
    assert_eq!(&second[0..2], &2500u16.to_le_bytes());
}

#[test]
fn unknown_opcode_and_unsupported_fields() {
    let mut h = Host::enabled(EmuConfig::default());
    let c = h.admin(Command::new(0x7f, 0, 0));
    assert_status(&c, Sct::GENERIC, generic::INVALID_COMMAND_OPCODE);
    assert!(c.status().dnr);
    let c = h.admin(Command::new(AdminOpcode::FORMAT_NVM.0, 0, 1));
    assert_status(&c, Sct::GENERIC, generic::INVALID_COMMAND_OPCODE);
    // SGLs (PSDT = 01b) and fused operations are not supported.
    let mut cmd = Command::new(AdminOpcode::IDENTIFY.0, 0, 0);
    cmd.cdw10 = 1;
    cmd.cdw0 = cmd.cdw0.with_psdt(1);
    let c = h.admin(cmd);
    assert_status(&c, Sct::GENERIC, generic::INVALID_FIELD_IN_COMMAND);
    let mut cmd = Command::new(AdminOpcode::IDENTIFY.0, 0, 0);
    cmd.cdw10 = 1;
    cmd.cdw0 = cmd.cdw0.with_fuse(1);
    let c = h.admin(cmd);
    assert_status(&c, Sct::GENERIC, generic::INVALID_FIELD_IN_COMMAND);
    // Identify into unmapped memory.
    let mut cmd = Command::new(AdminOpcode::IDENTIFY.0, 0, 0);
    cmd.cdw10 = 1;
    cmd.prp1 = 0x4000;
    let c = h.admin(cmd);
    assert_status(&c, Sct::GENERIC, generic::DATA_TRANSFER_ERROR);
}

#[test]
fn queue_creation_errors() {
    let config = EmuConfig {
        max_io_queue_pairs: 4,
        mqes: 63,
        ..EmuConfig::default()
    };
    let mut h = Host::enabled(config);
    let mem = h.dev.alloc_dma(64 * 64).unwrap();
    let base = mem.device_address(0);
    let invalid_qid = |c| assert_status(&c, Sct::COMMAND_SPECIFIC, cs::INVALID_QUEUE_IDENTIFIER);

    invalid_qid(h.create_cq_raw(0, 15, base, true, 0));
    invalid_qid(h.create_cq_raw(5, 15, base, true, 0));
    let c = h.create_cq_raw(1, 0, base, true, 0);
    assert_status(&c, Sct::COMMAND_SPECIFIC, cs::INVALID_QUEUE_SIZE);
    let c = h.create_cq_raw(1, 64, base, true, 0);
    assert_status(&c, Sct::COMMAND_SPECIFIC, cs::INVALID_QUEUE_SIZE);
    let c = h.create_cq_raw(1, 15, base, false, 0);
    assert_status(&c, Sct::GENERIC, generic::INVALID_FIELD_IN_COMMAND);
    let c = h.create_cq_raw(1, 15, base, true, 1);
    assert_status(&c, Sct::COMMAND_SPECIFIC, cs::INVALID_INTERRUPT_VECTOR);
    let c = h.create_cq_raw(1, 15, base + 16, true, 0);
    assert_status(&c, Sct::GENERIC, generic::PRP_OFFSET_INVALID);
    assert_ok(&h.create_cq_raw(1, 63, base, true, 0));
    invalid_qid(h.create_cq_raw(1, 15, base, true, 0));

    let sq_mem = h.dev.alloc_dma(64 * 64).unwrap();
    let sq_base = sq_mem.device_address(0);
    let c = h.create_sq_raw(1, 15, sq_base, 2);
    assert_status(&c, Sct::COMMAND_SPECIFIC, cs::COMPLETION_QUEUE_INVALID);
    let c = h.create_sq_raw(1, 15, sq_base, 0);
    assert_status(&c, Sct::COMMAND_SPECIFIC, cs::COMPLETION_QUEUE_INVALID);
    invalid_qid(h.create_sq_raw(0, 15, sq_base, 1));
    let c = h.create_sq_raw(1, 64, sq_base, 1);
    assert_status(&c, Sct::COMMAND_SPECIFIC, cs::INVALID_QUEUE_SIZE);
    assert_ok(&h.create_sq_raw(1, 15, sq_base, 1));
    invalid_qid(h.create_sq_raw(1, 15, sq_base, 1));

    // Number of Queues cannot change once I/O queues exist.
    let mut cmd = Command::new(AdminOpcode::SET_FEATURES.0, 0, 0);
    cmd.cdw10 = 0x07;
    cmd.cdw11 = 0x0001_0001;
    let c = h.admin(cmd);
    assert_status(&c, Sct::GENERIC, generic::COMMAND_SEQUENCE_ERROR);

    // Deleting a CQ with an SQ attached; deleting queues that do not exist.
    let c = h.delete_queue(AdminOpcode::DELETE_IO_CQ, 1);
    assert_status(&c, Sct::COMMAND_SPECIFIC, cs::INVALID_QUEUE_DELETION);
    invalid_qid(h.delete_queue(AdminOpcode::DELETE_IO_SQ, 2));
    invalid_qid(h.delete_queue(AdminOpcode::DELETE_IO_SQ, 0));
    invalid_qid(h.delete_queue(AdminOpcode::DELETE_IO_CQ, 0));
    invalid_qid(h.delete_queue(AdminOpcode::DELETE_IO_CQ, 3));
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, 1));
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, 1));
    invalid_qid(h.delete_queue(AdminOpcode::DELETE_IO_CQ, 1));
}

#[test]
fn number_of_queues_grants_at_most_the_maximum() {
    let mut h = Host::enabled(EmuConfig {
        max_io_queue_pairs: 4,
        ..EmuConfig::default()
    });
    let mut cmd = Command::new(AdminOpcode::SET_FEATURES.0, 0, 0);
    cmd.cdw10 = 0x07;
    cmd.cdw11 = (15 << 16) | 1; // 16 CQs, 2 SQs requested
    let c = h.admin(cmd);
    assert_ok(&c);
    assert_eq!(c.dw0, (3 << 16) | 1);
    let mut get = Command::new(AdminOpcode::GET_FEATURES.0, 0, 0);
    get.cdw10 = 0x07;
    assert_eq!(h.admin(get).dw0, (3 << 16) | 1);
    // Only two SQs were granted: SQ id 3 is now invalid.
    let qp = h.create_io_pair(1, 16, 16);
    let c = h.create_sq_raw(3, 15, qp.sq.device_address(0), 1);
    assert_status(&c, Sct::COMMAND_SPECIFIC, cs::INVALID_QUEUE_IDENTIFIER);
    let mut cmd = Command::new(AdminOpcode::SET_FEATURES.0, 0, 0);
    cmd.cdw10 = 0x07;
    cmd.cdw11 = 0xffff;
    assert_status(
        &h.admin(cmd),
        Sct::GENERIC,
        generic::INVALID_FIELD_IN_COMMAND,
    );
}

#[test]
fn features() {
    let mut h = Host::enabled(EmuConfig::default());
    let get = |h: &mut Host, fid: u32, sel: u32| {
        let mut cmd = Command::new(AdminOpcode::GET_FEATURES.0, 0, 0);
        cmd.cdw10 = fid | sel << 8;
        h.admin(cmd)
    };
    let set = |h: &mut Host, cdw10: u32, cdw11: u32| {
        let mut cmd = Command::new(AdminOpcode::SET_FEATURES.0, 0, 0);
        cmd.cdw10 = cdw10;
        cmd.cdw11 = cdw11;
        h.admin(cmd)
    };
    assert_eq!(get(&mut h, 0x06, 0).dw0, 1, "write cache on by default");
    assert_ok(&set(&mut h, 0x06, 0));
    assert_eq!(get(&mut h, 0x06, 0).dw0, 0);
    assert_eq!(get(&mut h, 0x06, 1).dw0, 1, "default stays on");
    assert_eq!(
        get(&mut h, 0x04, 0).dw0 & 0xffff,
        343,
        "temperature threshold"
    );
    assert_status(
        &set(&mut h, 0x02, 1),
        Sct::GENERIC,
        generic::INVALID_FIELD_IN_COMMAND,
    );
    assert_status(
        &set(&mut h, 0x06 | 1 << 31, 1),
        Sct::COMMAND_SPECIFIC,
        cs::FEATURE_NOT_SAVEABLE,
    );
    assert_status(
        &get(&mut h, 0x7e, 0),
        Sct::GENERIC,
        generic::INVALID_FIELD_IN_COMMAND,
    );
    assert_status(
        &set(&mut h, 0x7e, 0),
        Sct::GENERIC,
        generic::INVALID_FIELD_IN_COMMAND,
    );
    assert_status(
        &get(&mut h, 0x06, 4),
        Sct::GENERIC,
        generic::INVALID_FIELD_IN_COMMAND,
    );
    // A reset restores defaults.
    h.disable();
    h.enable();
    assert_eq!(get(&mut h, 0x06, 0).dw0, 1);
}

#[test]
fn log_pages() {
    let mut h = Host::enabled(EmuConfig::default());
    let (c, raw) = h.get_log(0x02, 0xffff_ffff, 512, 0, false);
    assert_ok(&c);
    let smart = SmartHealthLog::read_from_bytes(&raw[..]).unwrap();
    assert_eq!(smart.available_spare, 100);
    assert!(smart.composite_temperature.get() > 273);
    let (c, _) = h.get_log(0x02, 1, 512, 0, false);
    assert_status(&c, Sct::GENERIC, generic::INVALID_FIELD_IN_COMMAND);
    let (c, raw) = h.get_log(0x03, 0, 512, 0, false);
    assert_ok(&c);
    assert_eq!(raw[0], 1);
    let (c, _) = h.get_log(0x42, 0, 512, 0, false);
    assert_status(&c, Sct::COMMAND_SPECIFIC, cs::INVALID_LOG_PAGE);
    // Offset past the end; offset inside with a short read.
    let (c, _) = h.get_log(0x02, 0, 64, 512, false);
    assert_status(&c, Sct::GENERIC, generic::INVALID_FIELD_IN_COMMAND);
    let (c, tail) = h.get_log(0x02, 0, 16, 496, false);
    assert_ok(&c);
    assert_eq!(tail.len(), 16);

    // Errors so far (3) are in the Error Information log, newest first.
    let (c, raw) = h.get_log(0x01, 0, 4 * 64, 0, false);
    assert_ok(&c);
    let newest = ErrorInformationLogEntry::read_from_bytes(&raw[..64]).unwrap();
    let older = ErrorInformationLogEntry::read_from_bytes(&raw[64..128]).unwrap();
    assert_eq!(newest.error_count, 3);
    assert_eq!(older.error_count, 2);
    assert_eq!(newest.sqid, 0);
    assert_eq!(
        newest.status >> 1 & 0xff,
        generic::INVALID_FIELD_IN_COMMAND as u16
    );
    assert_eq!(newest.parameter_error_location, 48, "the offset in CDW12");
    let (_, raw) = h.get_log(0x02, 0, 512, 0, false);
    assert_eq!(
        SmartHealthLog::read_from_bytes(&raw[..])
            .unwrap()
            .error_log_entries
            .get(),
        3
    );
}

#[test]
fn invalid_doorbell_writes_raise_async_events() {
    let mut h = Host::enabled(EmuConfig::default());
    // Two Asynchronous Event Requests outstanding.
    let cid_a = h.cid();
    let cid_b = h.cid();
    let aer = |cid| Command::new(AdminOpcode::ASYNC_EVENT_REQUEST.0, cid, 0);
    h.admin.submit(&h.dev, &aer(cid_a));
    h.admin.submit(&h.dev, &aer(cid_b));
    // Ring the doorbell of an SQ that does not exist.
    h.regs().write_u32(sq_tail_doorbell(5, 0), 1);
    let c = h.admin.wait(&h.dev);
    assert_ok(&c);
    assert_eq!(c.cid, cid_a);
    assert_eq!(
        c.dw0, 0x0001_0000,
        "Error status, Write to Invalid Doorbell Register, log 01h"
    );
    // A value not below the admin SQ's size: masked until the log is read.
    h.regs().write_u32(sq_tail_doorbell(0, 0), 32);
    let (c, raw) = h.get_log(0x01, 0, 64, 0, true);
    assert_ok(&c);
    let entry = ErrorInformationLogEntry::read_from_bytes(&raw[..]).unwrap();
    assert_eq!((entry.sqid, entry.cid), (0xffff, 0xffff));
    assert_eq!(
        entry.csi,
        1 << 16 | 32 << 32,
        "SQ 0 tail doorbell, value 32"
    );
    assert!(
        h.admin.peek().is_none(),
        "still masked: the log was read with RAE"
    );
    // Reading without RAE unmasks: the second AER completes too (in either order).
    let buf = h.dev.alloc_dma(4096).unwrap();
    let log_cid = h.cid();
    let mut cmd = log_cmd(0x01, 0, 64, 0, false);
    cmd.cdw0 = cmd.cdw0.with_cid(log_cid);
    cmd.prp1 = buf.device_address(0);
    h.admin.submit(&h.dev, &cmd);
    let mut got = [h.admin.wait(&h.dev), h.admin.wait(&h.dev)];
    got.sort_by_key(|c| c.cid != cid_b);
    assert_eq!(got[0].cid, cid_b);
    assert_eq!(got[0].dw0, 0x0001_0100, "Invalid Doorbell Write Value");
    assert_eq!(got[1].cid, log_cid);
    assert_ok(&got[1]);
    assert!(h.dev.stats().invalid_doorbell_writes >= 2);
    // The bad writes did not disturb the admin queue.
    let (c, _) = h.identify(1, 0);
    assert_ok(&c);
}

#[test]
fn async_event_request_limit() {
    let mut h = Host::enabled(EmuConfig {
        async_event_limit: 2,
        ..EmuConfig::default()
    });
    for _ in 0..2 {
        let cid = h.cid();
        h.admin.submit(
            &h.dev,
            &Command::new(AdminOpcode::ASYNC_EVENT_REQUEST.0, cid, 0),
        );
    }
    let c = h.admin(Command::new(AdminOpcode::ASYNC_EVENT_REQUEST.0, 0, 0));
    assert_status(
        &c,
        Sct::COMMAND_SPECIFIC,
        cs::ASYNC_EVENT_REQUEST_LIMIT_EXCEEDED,
    );
}
