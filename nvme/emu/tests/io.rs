//! NVM command set on I/O queues: data movement, PRP walking, strict error statuses, CQ-full
//! holding, reordering, several queues from several threads.

mod common;

use std::collections::HashSet;
use std::sync::{Arc, Mutex};

use common::*;
use nvme::Device;
use nvme_emu::{EmuConfig, MemoryRegion, RegionError};
use nvme_spec::status::{StatusCodeType as Sct, generic};
use nvme_spec::{Command, NvmOpcode};

const READ: u8 = NvmOpcode::READ.0;
const WRITE: u8 = NvmOpcode::WRITE.0;

#[test]
fn write_then_read_single_page_both_lba_sizes() {
    for lba_size in [512u32, 4096] {
        let mut h = Host::enabled(small_config(1024, lba_size));
        let mut q = h.create_io_pair(1, 16, 16);
        let buf = h.dev.alloc_dma(4096).unwrap();
        let data = pattern(4096, lba_size as u64);
        buf.write(0, &data);
        let nlb = (4096 / lba_size) as u16;
        let c = q.run(&h.dev, &rw(WRITE, 1, 8, nlb, buf.device_address(0), 0));
        assert_ok(&c);
        assert_eq!(c.sqid, 1);
        let out = h.dev.alloc_dma(4096).unwrap();
        let c = q.run(&h.dev, &rw(READ, 1, 8, nlb, out.device_address(0), 0));
        assert_ok(&c);
        let mut back = vec![0u8; 4096];
        out.read(0, &mut back);
        assert_eq!(back, data, "lba size {lba_size}");
        // Unwritten blocks read as zeroes.
        let c = q.run(&h.dev, &rw(READ, 1, 0, nlb, out.device_address(0), 0));
        assert_ok(&c);
        out.read(0, &mut back);
        assert!(back.iter().all(|&b| b == 0));
        let s = h.dev.stats();
        assert_eq!((s.reads, s.writes, s.bytes_written), (2, 1, 4096));
    }
}

#[test]
fn unaligned_prp1_and_two_pages() {
    let mut h = Host::enabled(small_config(1024, 512));
    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(4 * 4096).unwrap();
    let data = pattern(4096, 7);
    // 8 blocks starting 512 bytes before the end of page 0, continuing in page 2.
    buf.write(4096 - 512, &data[..512]);
    buf.write(2 * 4096, &data[512..]);
    let c = q.run(
        &h.dev,
        &rw(
            WRITE,
            1,
            100,
            8,
            buf.device_address(4096 - 512),
            buf.device_address(8192),
        ),
    );
    assert_ok(&c);
    let out = h.dev.alloc_dma(4096).unwrap();
    assert_ok(&q.run(&h.dev, &rw(READ, 1, 100, 8, out.device_address(0), 0)));
    let mut back = vec![0u8; 4096];
    out.read(0, &mut back);
    assert_eq!(back, data);
}

/// Builds a transfer over `pages` scattered data pages with a PRP list that starts 16 bytes
/// before the end of its page, so the list chains through two more list pages.
#[test]
fn prp_list_chaining() {
    let config = EmuConfig {
        mdts: 0,
        ..small_config(4096, 4096)
    };
    let mut h = Host::enabled(config);
    let mut q = h.create_io_pair(1, 16, 16);
    let pages = 600usize; // 1 in PRP1, 599 in lists: 1 + 511 + ... entries
    // Data pages in reverse order inside one big buffer, so no two are adjacent in order.
    let data_buf = h.dev.alloc_dma(pages * 4096).unwrap();
    let page_addr = |i: usize| data_buf.device_address((pages - 1 - i) * 4096);
    let lists = h.dev.alloc_dma(3 * 4096).unwrap();
    let mut entries: Vec<u64> = (1..pages).map(page_addr).collect();
    // List 0: 2 slots at the end of page 0 (one entry + chain pointer).
    let l0 = lists.device_address(4096 - 16);
    let l1 = lists.device_address(4096);
    let l2 = lists.device_address(2 * 4096);
    let write_list = |off: usize, items: &[u64]| {
        for (i, e) in items.iter().enumerate() {
            lists.write(off + i * 8, &e.to_le_bytes());
        }
    };
    let first = entries.remove(0);
    write_list(4096 - 16, &[first, l1]);
    let mid: Vec<u64> = entries.drain(..511).collect();
    let mut page1 = mid.clone();
    page1.push(l2);
    write_list(4096, &page1);
    write_list(2 * 4096, &entries);
    assert!(entries.len() <= 512);

    let data = pattern(pages * 4096, 99);
    for i in 0..pages {
        data_buf.write((pages - 1 - i) * 4096, &data[i * 4096..(i + 1) * 4096]);
    }
    let c = q.run(&h.dev, &rw(WRITE, 1, 10, pages as u16, page_addr(0), l0));
    assert_ok(&c);
    // Read back through a contiguous buffer with an ordinary list.
    let out = h.dev.alloc_dma(pages * 4096).unwrap();
    let list = h.dev.alloc_dma(2 * 4096).unwrap();
    let plain: Vec<u64> = (1..pages).map(|i| out.device_address(i * 4096)).collect();
    // 599 entries: 511 + chain in the first page, 88 in the second.
    for (i, e) in plain[..511].iter().enumerate() {
        list.write(i * 8, &e.to_le_bytes());
    }
    list.write(511 * 8, &list.device_address(4096).to_le_bytes());
    for (i, e) in plain[511..].iter().enumerate() {
        list.write(4096 + i * 8, &e.to_le_bytes());
    }
    let c = q.run(
        &h.dev,
        &rw(
            READ,
            1,
            10,
            pages as u16,
            out.device_address(0),
            list.device_address(0),
        ),
    );
    assert_ok(&c);
    let mut back = vec![0u8; pages * 4096];
    out.read(0, &mut back);
    assert!(back == data, "data read through a chained list differs");
}

#[test]
fn strict_io_errors() {
    let config = EmuConfig {
        mdts: 1,
        ..small_config(64, 512)
    }; // 8 KiB max, 32 KiB namespace
    let mut h = Host::enabled(config);
    let mut q = h.create_io_pair(1, 32, 32);
    let buf = h.dev.alloc_dma(4 * 4096).unwrap();
    let a = buf.device_address(0);
    let check = |q: &mut QueuePair, h: &Host, cmd: Command, sct: Sct, sc: u8| {
        let c = q.run(&h.dev, &cmd);
        assert_status(&c, sct, sc);
        c
    };
    check(
        &mut q,
        &h,
        rw(READ, 0, 0, 1, a, 0),
        Sct::GENERIC,
        generic::INVALID_NAMESPACE_OR_FORMAT,
    );
    check(
        &mut q,
        &h,
        rw(READ, 2, 0, 1, a, 0),
        Sct::GENERIC,
        generic::INVALID_NAMESPACE_OR_FORMAT,
    );
    check(
        &mut q,
        &h,
        rw(WRITE, 0xffff_ffff, 0, 1, a, 0),
        Sct::GENERIC,
        generic::INVALID_NAMESPACE_OR_FORMAT,
    );
    check(
        &mut q,
        &h,
        rw(READ, 1, 60, 5, a, 0),
        Sct::GENERIC,
        generic::LBA_OUT_OF_RANGE,
    );
    check(
        &mut q,
        &h,
        rw(WRITE, 1, 64, 1, a, 0),
        Sct::GENERIC,
        generic::LBA_OUT_OF_RANGE,
    );
    check(
        &mut q,
        &h,
        rw(READ, 1, u64::MAX, 2, a, 0),
        Sct::GENERIC,
        generic::LBA_OUT_OF_RANGE,
    );
    // 17 blocks of 512 B = 8.5 KiB > MDTS (8 KiB).
    check(
        &mut q,
        &h,
        rw(READ, 1, 0, 17, a, buf.device_address(4096)),
        Sct::GENERIC,
        generic::INVALID_FIELD_IN_COMMAND,
    );
    // PRP1 not dword aligned.
    check(
        &mut q,
        &h,
        rw(READ, 1, 0, 1, a + 2, 0),
        Sct::GENERIC,
        generic::PRP_OFFSET_INVALID,
    );
    // PRP2 (second page) with an offset.
    check(
        &mut q,
        &h,
        rw(READ, 1, 0, 16, a, buf.device_address(4096) + 512),
        Sct::GENERIC,
        generic::PRP_OFFSET_INVALID,
    );
    // Unmapped data pointers: PRP1 at address 0, PRP2 in a guard gap.
    check(
        &mut q,
        &h,
        rw(READ, 1, 0, 1, 0, 0),
        Sct::GENERIC,
        generic::DATA_TRANSFER_ERROR,
    );
    let c = check(
        &mut q,
        &h,
        rw(WRITE, 1, 0, 16, a, a + 64 * 4096),
        Sct::GENERIC,
        generic::DATA_TRANSFER_ERROR,
    );
    assert!(!c.status().dnr, "a data transfer error may be retried");
    // Unknown opcode, SGL, fused.
    check(
        &mut q,
        &h,
        Command::new(0x7e, 0, 1),
        Sct::GENERIC,
        generic::INVALID_COMMAND_OPCODE,
    );
    let mut sgl = rw(READ, 1, 0, 1, a, 0);
    sgl.cdw0 = sgl.cdw0.with_psdt(1);
    check(
        &mut q,
        &h,
        sgl,
        Sct::GENERIC,
        generic::INVALID_FIELD_IN_COMMAND,
    );
    let mut fused = rw(READ, 1, 0, 1, a, 0);
    fused.cdw0 = fused.cdw0.with_fuse(1);
    check(
        &mut q,
        &h,
        fused,
        Sct::GENERIC,
        generic::INVALID_FIELD_IN_COMMAND,
    );
    // An admin opcode on an I/O queue is not an NVM opcode.
    check(
        &mut q,
        &h,
        Command::new(0x06, 0, 1),
        Sct::GENERIC,
        generic::INVALID_COMMAND_OPCODE,
    );
    assert_eq!(h.dev.stats().errors, 15);
    // The queue still works.
    assert_ok(&q.run(&h.dev, &rw(WRITE, 1, 63, 1, a, 0)));
}

#[test]
fn bad_prp_list_entries() {
    let config = EmuConfig {
        mdts: 0,
        ..small_config(64, 4096)
    };
    let mut h = Host::enabled(config);
    let mut q = h.create_io_pair(1, 16, 16);
    let data = h.dev.alloc_dma(4 * 4096).unwrap();
    let list = h.dev.alloc_dma(4096).unwrap();
    let entries = [
        data.device_address(4096),
        data.device_address(8192) + 8,
        data.device_address(12288),
    ];
    for (i, e) in entries.iter().enumerate() {
        list.write(i * 8, &e.to_le_bytes());
    }
    let cmd = rw(
        WRITE,
        1,
        0,
        4,
        data.device_address(0),
        list.device_address(0),
    );
    assert_status(
        &q.run(&h.dev, &cmd),
        Sct::GENERIC,
        generic::PRP_OFFSET_INVALID,
    );
    // A list pointer that is not qword aligned.
    let cmd = rw(
        WRITE,
        1,
        0,
        4,
        data.device_address(0),
        list.device_address(4),
    );
    assert_status(
        &q.run(&h.dev, &cmd),
        Sct::GENERIC,
        generic::PRP_OFFSET_INVALID,
    );
    // A list entry pointing nowhere.
    list.write(8, &0x2000u64.to_le_bytes());
    let cmd = rw(
        WRITE,
        1,
        0,
        4,
        data.device_address(0),
        list.device_address(0),
    );
    assert_status(
        &q.run(&h.dev, &cmd),
        Sct::GENERIC,
        generic::DATA_TRANSFER_ERROR,
    );
    // A list that was freed: late DMA hits unmapped space, not freed memory.
    let addr = list.device_address(0);
    drop(list);
    let cmd = rw(WRITE, 1, 0, 4, data.device_address(0), addr);
    assert_status(
        &q.run(&h.dev, &cmd),
        Sct::GENERIC,
        generic::DATA_TRANSFER_ERROR,
    );
}

#[test]
fn write_zeroes_and_deallocate_read_zeroes() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(8 * 4096).unwrap();
    let ones = vec![0xffu8; 32 * 1024];
    buf.write(0, &ones);
    let prp2_list = h.dev.alloc_dma(4096).unwrap();
    for i in 1..8 {
        prp2_list.write((i - 1) * 8, &buf.device_address(i * 4096).to_le_bytes());
    }
    // Fill blocks 0..64 with 0xff.
    assert_ok(&q.run(
        &h.dev,
        &rw(
            WRITE,
            1,
            0,
            64,
            buf.device_address(0),
            prp2_list.device_address(0),
        ),
    ));

    let mut wz = Command::new(NvmOpcode::WRITE_ZEROES.0, 0, 1);
    wz.set_slba(4);
    wz.cdw12 = 3; // 4 blocks
    assert_ok(&q.run(&h.dev, &wz));
    wz.set_slba(255);
    wz.cdw12 = 1;
    assert_status(&q.run(&h.dev, &wz), Sct::GENERIC, generic::LBA_OUT_OF_RANGE);

    // Dataset Management, deallocate blocks 20..30 and 40..41.
    let ranges = h.dev.alloc_dma(4096).unwrap();
    let r = |ctx: u32, nlb: u32, slba: u64| {
        let mut b = Vec::new();
        b.extend_from_slice(&ctx.to_le_bytes());
        b.extend_from_slice(&nlb.to_le_bytes());
        b.extend_from_slice(&slba.to_le_bytes());
        b
    };
    ranges.write(0, &r(0, 10, 20));
    ranges.write(16, &r(0, 1, 40));
    let mut dsm = Command::new(NvmOpcode::DATASET_MANAGEMENT.0, 0, 1);
    dsm.cdw10 = 1; // two ranges
    dsm.cdw11 = 1 << 2; // deallocate
    dsm.prp1 = ranges.device_address(0);
    assert_ok(&q.run(&h.dev, &dsm));
    // A range past the end fails and changes nothing.
    ranges.write(16, &r(0, 8, 250));
    ranges.write(0, &r(0, 1, 0));
    assert_status(
        &q.run(&h.dev, &dsm),
        Sct::GENERIC,
        generic::LBA_OUT_OF_RANGE,
    );

    let out = h.dev.alloc_dma(8 * 4096).unwrap();
    let out_list = h.dev.alloc_dma(4096).unwrap();
    for i in 1..8 {
        out_list.write((i - 1) * 8, &out.device_address(i * 4096).to_le_bytes());
    }
    assert_ok(&q.run(
        &h.dev,
        &rw(
            READ,
            1,
            0,
            64,
            out.device_address(0),
            out_list.device_address(0),
        ),
    ));
    let mut back = vec![0u8; 32 * 1024];
    out.read(0, &mut back);
    for lba in 0..64usize {
        let block = &back[lba * 512..(lba + 1) * 512];
        let zero = (4..8).contains(&lba) || (20..30).contains(&lba) || lba == 40;
        let expect = if zero { 0 } else { 0xff };
        assert!(block.iter().all(|&b| b == expect), "block {lba}");
    }
}

#[test]
fn full_cq_holds_completions() {
    let mut h = Host::enabled(small_config(256, 512));
    // 4-entry CQ (holds 3), 16-entry SQ.
    let mut q = h.create_io_pair(1, 16, 4);
    let buf = h.dev.alloc_dma(4096).unwrap();
    for i in 0..8u16 {
        let mut cmd = rw(WRITE, 1, i as u64, 1, buf.device_address(0), 0);
        cmd.cdw0 = cmd.cdw0.with_cid(100 + i);
        q.push(&cmd);
    }
    q.ring(&h.dev);
    let mut seen = HashSet::new();
    for _ in 0..3 {
        let c = q.wait_no_ring(&h.dev);
        assert_ok(&c);
        seen.insert(c.cid);
    }
    // The fourth slot must stay unwritten until the host frees space.
    std::thread::sleep(std::time::Duration::from_millis(20));
    assert!(
        peek_slot(&q.cq, 3, true).is_none(),
        "controller overwrote a full CQ"
    );
    assert!(q.peek().is_none());
    assert_eq!(
        h.dev.stats().io_commands,
        3,
        "fetched only what the CQ can take"
    );
    // Consume and ring: the rest arrive.
    q.ring_cq(&h.dev);
    while seen.len() < 8 {
        let c = q.wait(&h.dev);
        assert_ok(&c);
        assert!(seen.insert(c.cid), "duplicate completion {}", c.cid);
    }
    assert_eq!(seen, (100..108).collect());
}

#[test]
fn reorder_completes_batches_in_reverse() {
    let config = EmuConfig {
        reorder_completions: true,
        ..small_config(256, 512)
    };
    let mut h = Host::enabled(config);
    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(4096).unwrap();
    for i in 0..4u16 {
        let mut cmd = rw(READ, 1, i as u64, 1, buf.device_address(0), 0);
        cmd.cdw0 = cmd.cdw0.with_cid(10 + i);
        q.push(&cmd);
    }
    q.ring(&h.dev);
    let cids: Vec<u16> = (0..4).map(|_| q.wait(&h.dev).cid).collect();
    assert_eq!(cids, vec![13, 12, 11, 10]);
    // SQ head reports all four fetched.
    assert_eq!(peek_slot(&q.cq, 3, true).unwrap().sqhd, 4);
}

#[test]
fn queue_wraparound_flips_phase() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 4, 3);
    let buf = h.dev.alloc_dma(4096).unwrap();
    for i in 0..20u64 {
        let c = q.run(&h.dev, &rw(READ, 1, i, 1, buf.device_address(0), 0));
        assert_ok(&c);
        assert_eq!(c.sqhd as u64, (i + 1) % 4);
    }
}

#[test]
fn several_queues_from_several_threads() {
    let mut h = Host::enabled(EmuConfig {
        max_io_queue_pairs: 4,
        ..small_config(8192, 512)
    });
    let queues: Vec<QueuePair> = (1..=4).map(|qid| h.create_io_pair(qid, 64, 64)).collect();
    let dev = h.dev.clone();
    let threads: Vec<_> = queues
        .into_iter()
        .map(|mut q| {
            let dev = dev.clone();
            std::thread::spawn(move || {
                let qid = q.qid as u64;
                let bufs: Vec<_> = (0..32).map(|_| dev.alloc_dma(4096).unwrap()).collect();
                // Each queue owns LBAs qid*1024 .. +1024 (8 blocks per command).
                for round in 0..8u64 {
                    for (i, b) in bufs.iter().enumerate() {
                        b.write(0, &pattern(4096, qid << 32 | round << 8 | i as u64));
                        let mut cmd = rw(
                            WRITE,
                            1,
                            qid * 1024 + i as u64 * 8,
                            8,
                            b.device_address(0),
                            0,
                        );
                        cmd.cdw0 = cmd.cdw0.with_cid(i as u16);
                        q.push(&cmd);
                    }
                    q.ring(&dev);
                    for _ in 0..32 {
                        let c = q.wait(&dev);
                        assert_ok(&c);
                    }
                    for (i, b) in bufs.iter().enumerate() {
                        b.fill(0, 4096, 0);
                        let mut cmd = rw(
                            READ,
                            1,
                            qid * 1024 + i as u64 * 8,
                            8,
                            b.device_address(0),
                            0,
                        );
                        cmd.cdw0 = cmd.cdw0.with_cid(i as u16);
                        q.push(&cmd);
                    }
                    q.ring(&dev);
                    for _ in 0..32 {
                        assert_ok(&q.wait(&dev));
                    }
                    for (i, b) in bufs.iter().enumerate() {
                        let mut back = vec![0u8; 4096];
                        b.read(0, &mut back);
                        assert!(
                            back == pattern(4096, qid << 32 | round << 8 | i as u64),
                            "queue {qid} buffer {i}"
                        );
                    }
                }
            })
        })
        .collect();
    for t in threads {
        t.join().unwrap();
    }
    assert_eq!(h.dev.stats().io_commands, 4 * 8 * 64);
}

#[test]
fn deleting_an_sq_completes_its_dropped_commands() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(4096).unwrap();
    h.dev.faults().drop_completions(1);
    let mut cmd = rw(READ, 1, 0, 1, buf.device_address(0), 0);
    cmd.cdw0 = cmd.cdw0.with_cid(55);
    q.submit(&h.dev, &cmd);
    // Wait until the controller fetched (and dropped) it.
    let deadline = std::time::Instant::now() + WAIT;
    while h.dev.stats().completions_dropped == 0 {
        assert!(std::time::Instant::now() < deadline);
        std::thread::yield_now();
    }
    assert_ok(&h.delete_queue(nvme_spec::AdminOpcode::DELETE_IO_SQ, 1));
    let c = q.wait(&h.dev);
    assert_eq!(c.cid, 55);
    assert_status(&c, Sct::GENERIC, generic::ABORTED_SQ_DELETION);
    assert_ok(&h.delete_queue(nvme_spec::AdminOpcode::DELETE_IO_CQ, 1));
}

/// Memory that is not host DMA memory (standing in for GPU memory reached by copies).
struct ForeignRegion(Mutex<Vec<u8>>);

impl MemoryRegion for ForeignRegion {
    fn len(&self) -> usize {
        self.0.lock().unwrap().len()
    }
    fn read(&self, offset: u64, buf: &mut [u8]) -> Result<(), RegionError> {
        let m = self.0.lock().unwrap();
        buf.copy_from_slice(&m[offset as usize..offset as usize + buf.len()]);
        Ok(())
    }
    fn write(&self, offset: u64, data: &[u8]) -> Result<(), RegionError> {
        let mut m = self.0.lock().unwrap();
        m[offset as usize..offset as usize + data.len()].copy_from_slice(data);
        Ok(())
    }
}

#[test]
fn queues_and_data_in_a_registered_region() {
    let mut h = Host::enabled(small_config(256, 512));
    let region = Arc::new(ForeignRegion(Mutex::new(vec![0; 4 * 4096])));
    let map = h.dev.address_map().clone();
    let base = map.register_region(region.clone()).unwrap();
    // SQ at +0, CQ at +4096, data at +8192 and +12288, all in the foreign region.
    assert_ok(&h.create_cq_raw(1, 7, base + 4096, true, 0));
    assert_ok(&h.create_sq_raw(1, 7, base, 1));
    let data = pattern(1024, 3);
    map.write(base + 8192, &data).unwrap();
    let ring = |tail: u32| {
        h.regs()
            .write_u32(nvme_spec::registers::sq_tail_doorbell(1, 0), tail);
    };
    let wait_cqe = |slot: u64| -> nvme_spec::Completion {
        let deadline = std::time::Instant::now() + WAIT;
        loop {
            let mut raw = [0u8; 16];
            map.read(base + 4096 + slot * 16, &mut raw).unwrap();
            if raw[14] & 1 == 1 {
                return zerocopy::FromBytes::read_from_bytes(&raw[..]).unwrap();
            }
            assert!(std::time::Instant::now() < deadline, "no completion");
            std::thread::yield_now();
        }
    };
    let write = rw(WRITE, 1, 5, 2, base + 8192, 0);
    map.write(base, zerocopy::IntoBytes::as_bytes(&write))
        .unwrap();
    ring(1);
    assert_ok(&wait_cqe(0));
    let read = rw(READ, 1, 5, 2, base + 12288, 0);
    map.write(base + 64, zerocopy::IntoBytes::as_bytes(&read))
        .unwrap();
    ring(2);
    assert_ok(&wait_cqe(1));
    let mut back = vec![0u8; 1024];
    map.read(base + 12288, &mut back).unwrap();
    assert_eq!(back, data);
    // Unregistered, the region is unreachable: a command naming it gets a data transfer error.
    let mut q = h.create_io_pair(2, 8, 8);
    map.unregister_region(base);
    let c = q.run(&h.dev, &rw(READ, 1, 5, 2, base + 12288, 0));
    assert_status(&c, Sct::GENERIC, generic::DATA_TRANSFER_ERROR);
}

/// The namespace kinds a host must treat differently are strict here: a PI namespace takes
/// Reads and Writes only with PRACT (and, with reference tag checking, the LBA's low 32 bits in
/// CDW14); a metadata namespace takes none; a zoned namespace refuses ordinary writes with Zone
/// Invalid Write. Its identify pages say which is which (DPS, LBAF MS, the CSI descriptor).
#[test]
fn namespace_kinds_are_strict() {
    use nvme_emu::{NamespaceConfig, NsFormat};
    use nvme_spec::status::{command_specific, media};
    let with = |format| NamespaceConfig {
        format,
        ..NamespaceConfig::memory(1 << 20, 512)
    };
    let config = EmuConfig {
        namespaces: vec![
            with(NsFormat::Pi {
                pi_type: 1,
                first_bytes: false,
            }),
            with(NsFormat::Metadata {
                ms: 16,
                extended: true,
            }),
            with(NsFormat::Zoned),
        ],
        ..EmuConfig::default()
    };
    let mut h = Host::enabled(config);
    let (c, page) = h.identify(0, 1);
    assert_ok(&c);
    let id = <nvme_spec::IdentifyNamespace as zerocopy::FromBytes>::read_from_prefix(&page)
        .unwrap()
        .0;
    assert_eq!((id.dps, id.lbaf[0].ms), (1, 8));
    let (_, page) = h.identify(0, 2);
    let id = <nvme_spec::IdentifyNamespace as zerocopy::FromBytes>::read_from_prefix(&page)
        .unwrap()
        .0;
    assert_eq!((id.lbaf[0].ms, id.metadata_extended()), (16, true));
    let (c, page) = h.identify(3, 3);
    assert_ok(&c);
    assert_eq!(
        nvme_spec::descriptor_csi(&page),
        Some(nvme_spec::Csi::ZONED)
    );
    let (_, page) = h.identify(3, 1);
    assert_eq!(nvme_spec::descriptor_csi(&page), Some(nvme_spec::Csi::NVM));

    let mut q = h.create_io_pair(1, 16, 16);
    let buf = h.dev.alloc_dma(4096).unwrap();
    let addr = buf.device_address(0);
    let pract = |mut cmd: Command, prinfo: u32, reftag: u32| {
        cmd.cdw12 |= prinfo << 26;
        cmd.cdw14 = reftag;
        cmd
    };
    // PI: no PRACT; PRACT with the wrong reference tag; then right.
    let c = q.run(&h.dev, &rw(WRITE, 1, 70, 1, addr, 0));
    assert_status(&c, Sct::GENERIC, generic::INVALID_FIELD_IN_COMMAND);
    let c = q.run(&h.dev, &pract(rw(WRITE, 1, 70, 1, addr, 0), 0b1101, 71));
    assert_status(
        &c,
        Sct::MEDIA_AND_DATA_INTEGRITY,
        media::REFERENCE_TAG_CHECK_ERROR,
    );
    let c = q.run(&h.dev, &pract(rw(WRITE, 1, 70, 1, addr, 0), 0b1101, 70));
    assert_ok(&c);
    let c = q.run(&h.dev, &pract(rw(READ, 1, 70, 1, addr, 0), 0b1000, 0));
    assert_ok(&c);
    // Metadata: nothing moves without a metadata buffer, which this controller does not take.
    let c = q.run(&h.dev, &pract(rw(READ, 2, 0, 1, addr, 0), 0b1000, 0));
    assert_status(&c, Sct::GENERIC, generic::INVALID_FIELD_IN_COMMAND);
    // Zoned: reads work, ordinary writes do not.
    assert_ok(&q.run(&h.dev, &rw(READ, 3, 0, 1, addr, 0)));
    let c = q.run(&h.dev, &rw(WRITE, 3, 0, 1, addr, 0));
    assert_status(
        &c,
        Sct::COMMAND_SPECIFIC,
        command_specific::ZONE_INVALID_WRITE,
    );
}
