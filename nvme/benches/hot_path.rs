//! The driver's own cost per command: submit + complete against the inline null device
//! (`nvme_null`), which completes every command inside the doorbell write on the
//! calling thread and moves no data, so nothing but the driver's path (and the null device's
//! few loads and stores per command) is measured.
//!
//! Groups: `qd1` (queue, one doorbell, one reap) and `batch32` (32 queued, one doorbell, reap
//! until all 32 are back), each for three data-pointer shapes of a read, queued with
//! `IoQueuePair::queue_read` (borrowed buffer) and reaped with `IoQueuePair::poll_with`;
//! `batch32_owned` is `batch32/prp1_4k` the classic way: `IoCommand::Read` values with
//! `submit_deferred` (an `Arc` clone per command) and `poll` into a `Vec<IoCompletion>`:
//! - `prp1_4k`: 4 KiB, page-aligned (PRP1 only);
//! - `prp2_8k`: 8 KiB, page-aligned (PRP1 + PRP2);
//! - `prp_list_16k`: 16 KiB, page-aligned (PRP1 + a 3-entry PRP list).
//!
//! `reference/locked_rmw` times one uncontended atomic lock and unlock on this host (see
//! [`reference`]).
//!
//! Throughput is in commands, so criterion's "elem/s" inverts to ns per command.

use criterion::{BenchmarkId, Criterion, Throughput, criterion_group, criterion_main};
use nvme::{Controller, ControllerOptions, Device, DmaSlice, IoCommand, IoCompletion, IoQueuePair};
use nvme_null::{NullDevice, NullDeviceConfig};
use std::sync::Arc;

const SHAPES: [(&str, usize); 3] = [
    ("prp1_4k", 4096),
    ("prp2_8k", 8192),
    ("prp_list_16k", 16384),
];
const BATCH: usize = 32;

fn setup() -> (Controller, IoQueuePair) {
    let dev: Arc<dyn Device> = NullDevice::new(NullDeviceConfig::default());
    let ctrl = Controller::new(dev, ControllerOptions::default()).expect("bring-up");
    let qp = ctrl
        .create_io_queue_pair(BATCH as u16 + 1)
        .expect("queue pair");
    (ctrl, qp)
}

fn lba(buf: &DmaSlice, i: usize) -> u64 {
    (i * buf.len / 512) as u64
}

fn read(buf: &DmaSlice, i: usize) -> IoCommand {
    IoCommand::Read {
        nsid: 1,
        lba: lba(buf, i),
        buf: buf.clone(),
    }
}

fn reap(qp: &mut IoQueuePair, out: &mut Vec<IoCompletion>, n: usize) {
    out.clear();
    while out.len() < n {
        qp.poll(out).expect("poll");
    }
    debug_assert!(out.iter().all(|c| c.result.is_ok()));
}

fn reap_with(qp: &mut IoQueuePair, n: usize) {
    let mut got = 0;
    while got < n {
        got += qp
            .poll_with(|_, result| debug_assert!(result.is_ok()))
            .expect("poll");
    }
}

fn hot_path(c: &mut Criterion) {
    let (ctrl, mut qp) = setup();
    let mut out = Vec::with_capacity(2 * BATCH);
    for (name, bs) in SHAPES {
        let mem = Arc::new(ctrl.device().alloc_dma(BATCH * bs).expect("dma"));
        let bufs: Vec<DmaSlice> = (0..BATCH)
            .map(|i| DmaSlice::new(mem.clone(), i * bs, bs))
            .collect();

        let mut g = c.benchmark_group("qd1");
        g.throughput(Throughput::Elements(1));
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                qp.queue_read(1, 0, &bufs[0], 0).expect("queue");
                qp.ring();
                reap_with(&mut qp, 1);
            })
        });
        g.finish();

        let mut g = c.benchmark_group("batch32");
        g.throughput(Throughput::Elements(BATCH as u64));
        g.bench_function(BenchmarkId::from_parameter(name), |b| {
            b.iter(|| {
                for (i, buf) in bufs.iter().enumerate() {
                    qp.queue_read(1, lba(buf, i), buf, i as u64).expect("queue");
                }
                qp.ring();
                reap_with(&mut qp, BATCH);
            })
        });
        g.finish();

        if bs == 4096 {
            let mut g = c.benchmark_group("batch32_owned");
            g.throughput(Throughput::Elements(BATCH as u64));
            g.bench_function(BenchmarkId::from_parameter(name), |b| {
                b.iter(|| {
                    for (i, buf) in bufs.iter().enumerate() {
                        qp.submit_deferred(read(buf, i), i as u64).expect("submit");
                    }
                    qp.ring();
                    reap(&mut qp, &mut out, BATCH);
                })
            });
            g.finish();
        }
        qp.release_buffers();
    }
}

/// Reference costs of this host, measured beside the driver so that its figures can be read:
/// `reference/locked_rmw` is an uncontended lock and unlock of the kind the null device takes
/// once per SQ doorbell (a compare-and-swap and a release store), the one atomic
/// read-modify-write in a QD 1 round trip.
fn reference(c: &mut Criterion) {
    use std::hint::black_box;
    use std::sync::atomic::{AtomicBool, Ordering};
    let flag = AtomicBool::new(false);
    let mut g = c.benchmark_group("reference");
    g.throughput(Throughput::Elements(1));
    g.bench_function("locked_rmw", |b| {
        b.iter(|| {
            let flag = black_box(&flag);
            let taken = flag
                .compare_exchange(false, true, Ordering::Acquire, Ordering::Relaxed)
                .is_ok();
            flag.store(false, Ordering::Release);
            taken
        })
    });
    g.finish();
}

criterion_group!(benches, hot_path, reference);
criterion_main!(benches);
