//! Injected faults: media errors, dropped and delayed completions with Abort, fatal status.

mod common;

use std::time::Duration;

use common::*;
use nvme::Device;
use nvme_spec::status::{StatusCodeType as Sct, generic, media};
use nvme_spec::{AdminOpcode, Command, ErrorInformationLogEntry, NvmOpcode, SmartHealthLog};
use zerocopy::FromBytes;

const READ: u8 = NvmOpcode::READ.0;
const WRITE: u8 = NvmOpcode::WRITE.0;

fn abort(h: &mut Host, sqid: u16, cid: u16) -> nvme_spec::Completion {
    let mut cmd = Command::new(AdminOpcode::ABORT.0, 0, 0);
    cmd.cdw10 = sqid as u32 | (cid as u32) << 16;
    h.admin(cmd)
}

#[test]
fn media_errors_on_chosen_lbas() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(4096).unwrap();
    h.dev.faults().add_media_error(1, 10);
    let c = q.run(&h.dev, &rw(READ, 1, 8, 4, buf.device_address(0), 0));
    assert_status(
        &c,
        Sct::MEDIA_AND_DATA_INTEGRITY,
        media::UNRECOVERED_READ_ERROR,
    );
    assert!(c.status().more, "details are in the error log");
    let c = q.run(&h.dev, &rw(WRITE, 1, 10, 1, buf.device_address(0), 0));
    assert_status(&c, Sct::MEDIA_AND_DATA_INTEGRITY, media::WRITE_FAULT);
    let mut wz = Command::new(NvmOpcode::WRITE_ZEROES.0, 0, 1);
    wz.set_slba(9);
    wz.cdw12 = 1;
    assert_status(
        &q.run(&h.dev, &wz),
        Sct::MEDIA_AND_DATA_INTEGRITY,
        media::WRITE_FAULT,
    );
    // Neighbours are fine.
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 0, 8, buf.device_address(0), 0)));
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 11, 8, buf.device_address(0), 0)));
    // The error log names the LBA, namespace and queue.
    let (c, raw) = h.get_log(0x01, 0, 64 * 3, 0, false);
    assert_ok(&c);
    let read_err = ErrorInformationLogEntry::read_from_bytes(&raw[128..192]).unwrap();
    assert_eq!((read_err.lba, read_err.nsid, read_err.sqid), (10, 1, 1));
    let (_, raw) = h.get_log(0x02, 0, 512, 0, false);
    let smart = SmartHealthLog::read_from_bytes(&raw[..]).unwrap();
    assert_eq!(smart.media_errors.get(), 3);
    assert_eq!(smart.host_read_commands.get(), 2);
    // Clearing the fault heals the block.
    h.dev.faults().clear_media_errors();
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 8, 4, buf.device_address(0), 0)));
}

#[test]
fn dropped_completion_is_reported_by_abort() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(4096).unwrap();
    h.dev.faults().drop_completions(1);
    let mut cmd = rw(WRITE, 1, 0, 1, buf.device_address(0), 0);
    cmd.cdw0 = cmd.cdw0.with_cid(42);
    q.submit(&h.dev, &cmd);
    // The next command completes normally; the dropped one never does.
    let mut cmd2 = rw(READ, 1, 0, 1, buf.device_address(0), 0);
    cmd2.cdw0 = cmd2.cdw0.with_cid(43);
    q.submit(&h.dev, &cmd2);
    let c = q.wait(&h.dev);
    assert_eq!(c.cid, 43);
    assert!(q.peek().is_none());
    assert_eq!(h.dev.stats().completions_dropped, 1);
    // Abort: the dropped command completes with Command Abort Requested, the Abort says
    // "aborted" (dword 0 bit 0 clear).
    let a = abort(&mut h, 1, 42);
    assert_ok(&a);
    assert_eq!(a.dw0 & 1, 0);
    let c = q.wait(&h.dev);
    assert_eq!(c.cid, 42);
    assert_status(&c, Sct::GENERIC, generic::COMMAND_ABORT_REQUESTED);
    // Aborting something already complete: not aborted.
    let a = abort(&mut h, 1, 43);
    assert_ok(&a);
    assert_eq!(a.dw0 & 1, 1);
}

#[test]
fn delayed_completions_arrive_and_can_be_aborted() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(4096).unwrap();
    h.dev
        .faults()
        .set_completion_delay(Duration::from_millis(5));
    assert_eq!(h.dev.faults().completion_delay(), Duration::from_millis(5));
    let c = q.run(&h.dev, &rw(READ, 1, 0, 1, buf.device_address(0), 0));
    assert_ok(&c);
    // A long delay: abort it instead of waiting.
    h.dev
        .faults()
        .set_completion_delay(Duration::from_secs(3600));
    let mut cmd = rw(READ, 1, 0, 1, buf.device_address(0), 0);
    cmd.cdw0 = cmd.cdw0.with_cid(9);
    q.submit(&h.dev, &cmd);
    let deadline = std::time::Instant::now() + WAIT;
    while h.dev.stats().io_commands < 2 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::yield_now();
    }
    let a = abort(&mut h, 1, 9);
    assert_eq!(a.dw0 & 1, 0);
    let c = q.wait(&h.dev);
    assert_eq!(c.cid, 9);
    assert_status(&c, Sct::GENERIC, generic::COMMAND_ABORT_REQUESTED);
    // Admin commands are never delayed.
    let (c, _) = h.identify(1, 0);
    assert_ok(&c);
    h.dev.faults().set_completion_delay(Duration::ZERO);
}

#[test]
fn fatal_during_io_then_reset_and_recover() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(4096).unwrap();
    buf.write(0, &pattern(512, 1));
    assert_ok(&q.run(&h.dev, &rw(WRITE, 1, 3, 1, buf.device_address(0), 0)));
    h.dev.faults().fatal();
    assert!(h.csts().cfs());
    q.submit(&h.dev, &rw(READ, 1, 3, 1, buf.device_address(0), 0));
    std::thread::sleep(Duration::from_millis(20));
    assert!(q.peek().is_none(), "a fatal controller posts nothing");
    h.disable();
    assert!(!h.csts().cfs());
    h.enable();
    // I/O queues are gone after the reset; recreate and read the data written before.
    let mut q = h.create_io_pair(1, 16, 16);
    let out = h.dev.alloc_dma(4096).unwrap();
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 3, 1, out.device_address(0), 0)));
    let mut back = vec![0u8; 512];
    out.read(0, &mut back);
    assert_eq!(back, pattern(512, 1));
}

#[test]
fn unmapped_io_queue_memory_is_fatal() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 16, 16);
    // The host frees its SQ memory while the queue exists, then rings: the fetch is a DMA
    // error on queue memory.
    let sq = std::mem::replace(&mut q.sq, h.dev.alloc_dma(4096).unwrap());
    drop(sq);
    q.sq_tail = 1;
    q.ring(&h.dev);
    assert!(h.wait_csts(|c| c.cfs()));
}

#[test]
fn abort_completion_waits_for_room_in_a_full_cq() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 16, 4); // the CQ holds 3 entries
    let buf = h.dev.alloc_dma(4096).unwrap();
    h.dev.faults().drop_completions(1);
    let mut lost = rw(READ, 1, 0, 1, buf.device_address(0), 0);
    lost.cdw0 = lost.cdw0.with_cid(42);
    q.submit(&h.dev, &lost);
    for cid in 1..=3u16 {
        let mut cmd = rw(READ, 1, cid as u64, 1, buf.device_address(0), 0);
        cmd.cdw0 = cmd.cdw0.with_cid(cid);
        q.push(&cmd);
    }
    q.ring(&h.dev);
    let mut cids: Vec<u16> = (0..3).map(|_| q.wait_no_ring(&h.dev).cid).collect();
    cids.sort();
    assert_eq!(cids, vec![1, 2, 3]);
    // The CQ is full (host has not rung its head): the aborted command's completion is held.
    let a = abort(&mut h, 1, 42);
    assert_eq!(a.dw0 & 1, 0);
    assert!(
        peek_slot(&q.cq, 3, true).is_none(),
        "a full CQ was overwritten"
    );
    assert!(h.dev.stats().cq_full_waits >= 1);
    q.ring_cq(&h.dev);
    let c = q.wait(&h.dev);
    assert_eq!(c.cid, 42);
    assert_status(&c, Sct::GENERIC, generic::COMMAND_ABORT_REQUESTED);
}
