//! Hostile input: random commands on the admin and I/O queues must each get exactly one
//! completion, and the controller must neither panic (which would show as CSTS.CFS) nor hang.

mod common;

use common::*;
use nvme::Device;
use nvme_spec::{Command, Csts};
use zerocopy::FromBytes;

struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 << 13;
        self.0 ^= self.0 >> 7;
        self.0 ^= self.0 << 17;
        self.0
    }
    fn pick<T: Copy>(&mut self, items: &[T]) -> T {
        items[(self.next() % items.len() as u64) as usize]
    }
}

fn random_command(rng: &mut Rng, cid: u16, opcodes: &[u8], data: &[u64]) -> Command {
    let mut raw = [0u8; 64];
    for chunk in raw.chunks_mut(8) {
        chunk.copy_from_slice(&rng.next().to_le_bytes());
    }
    let mut cmd = Command::read_from_bytes(&raw[..]).unwrap();
    let mut cdw0 = cmd.cdw0.with_cid(cid).with_opcode(rng.pick(opcodes));
    // Mostly well-formed dword 0, sometimes not.
    if rng.next() % 8 != 0 {
        cdw0 = cdw0.with_fuse(0).with_psdt(0);
    }
    cmd.cdw0 = cdw0;
    if rng.next() % 4 != 0 {
        cmd.nsid = rng.pick(&[0, 1, 2, 0xffff_ffff]);
    }
    // Mostly small transfers inside the namespace, pointing into mapped memory.
    if rng.next() % 4 != 0 {
        cmd.cdw10 %= 300;
        cmd.cdw11 = 0;
        cmd.cdw12 &= 0xffff_0000 | 0x3f;
    }
    if rng.next() % 4 != 0 {
        cmd.prp1 = rng.pick(data) + (rng.next() % 4096) * (rng.next() % 2);
        cmd.prp2 = rng.pick(data);
    }
    cmd
}

#[test]
fn random_commands_all_complete_without_fatal() {
    let mut h = Host::enabled(small_config(256, 512));
    let mut q = h.create_io_pair(1, 64, 64);
    let data_buf = h.dev.alloc_dma(16 * 4096).unwrap();
    let data: Vec<u64> = (0..16)
        .map(|i| data_buf.device_address(i * 4096))
        .chain([0, 0x1000, u64::MAX - 4095])
        .collect();
    let mut rng = Rng(0x1234_5678_9abc_def1);

    // I/O queue: any opcode.
    let io_ops: Vec<u8> = (0..=0xff).collect();
    for round in 0..40u16 {
        for i in 0..32u16 {
            q.push(&random_command(&mut rng, round * 32 + i, &io_ops, &data));
        }
        q.ring(&h.dev);
        let mut seen = std::collections::HashSet::new();
        for _ in 0..32 {
            let c = q.wait(&h.dev);
            assert!(seen.insert(c.cid), "two completions for cid {}", c.cid);
        }
        assert!(q.peek().is_none());
    }

    // Admin queue: every opcode except Asynchronous Event Request (which completes only on
    // an event) and the queue deletions (which would pull the I/O queue away).
    let admin_ops: Vec<u8> = (0..=0xff)
        .filter(|o| ![0x00, 0x04, 0x0c].contains(o))
        .collect();
    for _ in 0..300 {
        let cid = h.cid();
        let cmd = random_command(&mut rng, cid, &admin_ops, &data);
        h.admin.submit(&h.dev, &cmd);
        let c = h.admin.wait(&h.dev);
        assert_eq!(c.cid, cid);
    }
    assert!(
        !Csts::from(h.csts().into_bits()).cfs(),
        "controller went fatal"
    );
    // Still healthy: a plain round trip works.
    let buf = h.dev.alloc_dma(4096).unwrap();
    buf.write(0, &pattern(512, 8));
    assert_ok(&q.run(&h.dev, &rw(0x01, 1, 3, 1, buf.device_address(0), 0)));
    let out = h.dev.alloc_dma(4096).unwrap();
    assert_ok(&q.run(&h.dev, &rw(0x02, 1, 3, 1, out.device_address(0), 0)));
    let mut back = vec![0u8; 512];
    out.read(0, &mut back);
    assert_eq!(back, pattern(512, 8));
}
