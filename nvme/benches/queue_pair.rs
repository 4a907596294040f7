//! Driver overhead per command: submit + complete of 4 KiB reads against the software
//! controller's null backend (no data moves, so this is driver + emulator command handling),
//! and PRP construction alone.

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use nvme::prp::{build_prp, pages_spanned};
use nvme::{Controller, ControllerOptions, Device, DmaSlice, IoCommand};
use nvme_emu::{EmuConfig, EmuDevice, NamespaceConfig};
use std::hint::black_box;
use std::sync::Arc;

fn controller() -> (Arc<EmuDevice>, Controller) {
    let cfg = EmuConfig {
        namespaces: vec![NamespaceConfig::null(1 << 30, 512)],
        ..EmuConfig::default()
    };
    let emu = EmuDevice::start(cfg).expect("start software controller");
    let dev: Arc<dyn Device> = emu.clone();
    let ctrl = Controller::new(dev, ControllerOptions::default()).expect("bring-up");
    eprintln!("data path: {} (null backend)", ctrl.device().describe());
    (emu, ctrl)
}

fn io(c: &mut Criterion) {
    let (_emu, ctrl) = controller();
    let mut qp = ctrl.create_io_queue_pair(64).expect("queue pair");
    let mem = Arc::new(ctrl.device().alloc_dma(32 * 4096).expect("dma"));
    let bufs: Vec<DmaSlice> = (0..32)
        .map(|i| DmaSlice::new(mem.clone(), i * 4096, 4096))
        .collect();
    let mut out = Vec::with_capacity(64);

    let mut g = c.benchmark_group("null_backend_4k_read");
    g.throughput(Throughput::Elements(1));
    g.bench_function("qd1_submit_wait", |b| {
        b.iter(|| {
            qp.submit(
                IoCommand::Read {
                    nsid: 1,
                    lba: 8,
                    buf: bufs[0].clone(),
                },
                0,
            )
            .expect("submit");
            out.clear();
            qp.wait(&mut out, 1).expect("wait");
            assert!(out[0].result.is_ok());
        })
    });
    g.throughput(Throughput::Elements(32));
    g.bench_function("qd32_batch", |b| {
        b.iter(|| {
            for (i, buf) in bufs.iter().enumerate() {
                let cmd = IoCommand::Read {
                    nsid: 1,
                    lba: i as u64 * 8,
                    buf: buf.clone(),
                };
                qp.submit(cmd, i as u64).expect("submit");
            }
            out.clear();
            let mut got = 0;
            while got < 32 {
                got += qp.wait(&mut out, 32 - got).expect("wait");
            }
            assert!(out.iter().all(|c| c.result.is_ok()));
        })
    });
    g.bench_function("qd32_batch_one_doorbell", |b| {
        b.iter(|| {
            for (i, buf) in bufs.iter().enumerate() {
                let cmd = IoCommand::Read {
                    nsid: 1,
                    lba: i as u64 * 8,
                    buf: buf.clone(),
                };
                qp.submit_deferred(cmd, i as u64).expect("submit");
            }
            qp.ring();
            out.clear();
            let mut got = 0;
            while got < 32 {
                got += qp.wait(&mut out, 32 - got).expect("wait");
            }
            assert!(out.iter().all(|c| c.result.is_ok()));
        })
    });
    g.finish();
}

fn prp(c: &mut Criterion) {
    let mut g = c.benchmark_group("prp_build");
    let pages: Vec<u64> = (0..513u64).map(|i| 0x1_0000_0000 + i * 4096).collect();
    let mut list = vec![0u64; 512];
    for (name, offset, len) in [
        ("4k", 0usize, 4096usize),
        ("8k", 0, 8192),
        ("128k", 0, 128 << 10),
        ("2m_offset", 512, 2 << 20),
    ] {
        let n = pages_spanned(offset, len);
        g.bench_function(name, |b| {
            b.iter(|| {
                let prp = build_prp(black_box(&pages[..n]), offset, len, 0x2000_0000, |i, a| {
                    list[i] = a
                })
                .expect("prp");
                black_box(prp)
            })
        });
    }
    g.finish();
}

criterion_group!(benches, io, prp);
criterion_main!(benches);
