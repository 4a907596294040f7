//! A queue server takes the I/O queues: the controller checks Create commands as always, then
//! hands the queues over; they are never served by the controller threads, their register
//! doorbells are refused, and deletion, reset and shutdown reach the server.

mod common;

use std::sync::{Arc, Mutex};

use common::*;
use nvme_emu::{EmuConfig, QueueServer, QueueServerRefusal};
use nvme_spec::registers::sq_tail_doorbell;
use nvme_spec::status::{StatusCodeType, command_specific, generic};
use nvme_spec::{AdminOpcode, Command, NvmOpcode};

/// Records every call; refuses queues at `refuse_addr` or SQs posting to another id.
#[derive(Default)]
struct Recorder {
    calls: Mutex<Vec<String>>,
    refuse_addr: Mutex<Option<u64>>,
}

impl Recorder {
    fn calls(&self) -> Vec<String> {
        self.calls.lock().unwrap().clone()
    }
    fn log(&self, s: String) {
        self.calls.lock().unwrap().push(s);
    }
}

impl QueueServer for Recorder {
    fn create_cq(&self, qid: u16, addr: u64, entries: u32) -> Result<(), QueueServerRefusal> {
        if *self.refuse_addr.lock().unwrap() == Some(addr) {
            return Err(QueueServerRefusal::Unreachable { addr });
        }
        self.log(format!("create_cq {qid} {entries}"));
        Ok(())
    }
    fn create_sq(
        &self,
        qid: u16,
        cqid: u16,
        _addr: u64,
        entries: u32,
    ) -> Result<(), QueueServerRefusal> {
        if qid != cqid {
            return Err(QueueServerRefusal::Unsupported(
                "SQ and CQ ids differ".into(),
            ));
        }
        self.log(format!("create_sq {qid} {cqid} {entries}"));
        Ok(())
    }
    fn delete_sq(&self, qid: u16) {
        self.log(format!("delete_sq {qid}"));
    }
    fn delete_cq(&self, qid: u16) {
        self.log(format!("delete_cq {qid}"));
    }
    fn reset(&self) {
        self.log("reset".into());
    }
    fn shutdown(&self) {
        self.log("shutdown".into());
    }
}

fn host_with_server() -> (Host, Arc<Recorder>) {
    let h = Host::enabled(EmuConfig::default());
    let rec = Arc::new(Recorder::default());
    h.dev.set_queue_server(Some(rec.clone()));
    (h, rec)
}

#[test]
fn queues_go_to_the_server_and_are_never_served_by_the_controller() {
    let (mut h, rec) = host_with_server();
    let mut qp = h.create_io_pair(1, 16, 16);
    assert_eq!(rec.calls(), ["create_cq 1 16", "create_sq 1 1 16"]);
    // A command on the handed-over queue, rung through the register window: the write is
    // refused (the server's doorbells are its own) and nothing completes.
    let mut cmd = Command::new(NvmOpcode::FLUSH.0, 0, 1);
    cmd.cdw0 = cmd.cdw0.with_cid(7);
    qp.push(&cmd);
    h.regs()
        .write_u32(sq_tail_doorbell(1, 0), qp.sq_tail as u32);
    std::thread::sleep(std::time::Duration::from_millis(50));
    assert!(
        qp.peek().is_none(),
        "the controller served a handed-over queue"
    );
    assert_eq!(
        h.dev.stats().invalid_doorbell_writes,
        1,
        "{:?}",
        h.dev.stats()
    );
    // The controller's own checks still run first: a second CQ with the same id.
    let c = h.create_cq_raw(1, 15, qp.cq.device_address(0), true, 0);
    assert_status(
        &c,
        StatusCodeType::COMMAND_SPECIFIC,
        command_specific::INVALID_QUEUE_IDENTIFIER,
    );
    // Deleting the CQ first is refused by the controller, as always.
    let c = h.delete_queue(AdminOpcode::DELETE_IO_CQ, 1);
    assert_status(
        &c,
        StatusCodeType::COMMAND_SPECIFIC,
        command_specific::INVALID_QUEUE_DELETION,
    );
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, 1));
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, 1));
    assert_eq!(
        &rec.calls()[2..],
        ["delete_sq 1", "delete_cq 1"],
        "deletions reach the server in order"
    );
    // The id is free again.
    let _again = h.create_io_pair(1, 8, 8);
    h.disable();
    assert_eq!(rec.calls().last().map(String::as_str), Some("reset"));
}

#[test]
fn refusals_complete_the_create_command_with_a_status() {
    let (mut h, rec) = host_with_server();
    let qp = QueuePair::new(&h.dev, 2, 8, 8);
    *rec.refuse_addr.lock().unwrap() = Some(qp.cq.device_address(0));
    let c = h.create_cq_raw(2, 7, qp.cq.device_address(0), true, 0);
    assert_status(&c, StatusCodeType::GENERIC, generic::DATA_TRANSFER_ERROR);
    *rec.refuse_addr.lock().unwrap() = None;
    assert_ok(&h.create_cq_raw(2, 7, qp.cq.device_address(0), true, 0));
    assert_ok(&h.create_cq_raw(3, 7, qp.cq.device_address(0), true, 0));
    // An SQ on CQ 3 with id 2: refused by the server as an unsupported shape.
    let c = h.create_sq_raw(2, 7, qp.sq.device_address(0), 3);
    assert_status(
        &c,
        StatusCodeType::GENERIC,
        generic::INVALID_FIELD_IN_COMMAND,
    );
    // Nothing was recorded as existing: the same SQ on its own CQ works.
    assert_ok(&h.create_sq_raw(2, 7, qp.sq.device_address(0), 2));
}

#[test]
fn queues_created_before_the_server_stay_with_the_controller() {
    let mut h = Host::enabled(EmuConfig::default());
    let mut before = h.create_io_pair(1, 8, 8);
    let rec = Arc::new(Recorder::default());
    h.dev.set_queue_server(Some(rec.clone()));
    let mut cmd = Command::new(NvmOpcode::FLUSH.0, 0, 1);
    cmd.cdw0 = cmd.cdw0.with_cid(3);
    let c = before.run(&h.dev, &cmd);
    assert_ok(&c);
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_SQ, 1));
    assert_ok(&h.delete_queue(AdminOpcode::DELETE_IO_CQ, 1));
    assert!(rec.calls().is_empty(), "{:?}", rec.calls());
    // Shutdown reaches the server.
    h.regs().write_u32(
        nvme_spec::registers::CC,
        Host::good_cc().with_shn(1).into_bits(),
    );
    assert!(h.wait_csts(|c| c.shst() == nvme_spec::Csts::SHST_COMPLETE));
    assert_eq!(rec.calls(), ["shutdown"]);
}
