//! End-to-end: the `gpunvme perf` engine (4 KiB random reads and writes, QD32, one queue)
//! against the software controller with a memory backend — driver, controller thread and data
//! copies included. `cargo bench --bench perf`; the `perf` command prints fio-style numbers for
//! the same path.

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpunvme::nvme::{Controller, ControllerOptions};
use gpunvme::nvme_emu::{EmuConfig, EmuDevice};
use gpunvme::perf::{PerfConfig, RwMode, Stop};

const IOS: u64 = 20_000;

fn perf(c: &mut Criterion) {
    let device = EmuDevice::start(EmuConfig::default()).expect("software controller");
    let ctrl = Controller::new(device, ControllerOptions::default()).expect("bring-up");
    let mut group = c.benchmark_group("perf_4k_qd32_memory");
    group.throughput(Throughput::Elements(IOS));
    group.measurement_time(Duration::from_secs(10));
    group.sample_size(10);
    for rw in [RwMode::RandRead, RwMode::RandWrite] {
        let cfg = PerfConfig {
            rw,
            bs: 4096,
            qd: 32,
            queues: 1,
            stop: Stop::Ios(IOS),
            verify: false,
            nsid: 1,
            size: None,
            seed: Some(1),
        };
        group.bench_function(rw.name(), |b| {
            b.iter(|| {
                let r = gpunvme::perf::run(&ctrl, &cfg).expect("perf run");
                assert_eq!(r.errors, 0);
            })
        });
    }
    group.finish();
}

criterion_group!(benches, perf);
criterion_main!(benches);
