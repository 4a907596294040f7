//! End-to-end: the `gpunvme perf` engine (4 KiB random reads and writes, QD32, one queue)
//! against the software controller with a memory backend — driver, controller thread and data
//! copies included. `cargo bench --bench perf`; the `perf` command prints fio-style numbers for
//! the same path. `perf_4k_qd32_memory_4_queues` runs four queues (four host threads) against
//! 1, 2 and 4 controller threads (`EmuConfig::controller_threads`).

use std::time::Duration;

use criterion::{Criterion, Throughput, criterion_group, criterion_main};
use gpunvme::nvme::{Controller, ControllerOptions};
use gpunvme::nvme_emu::{EmuConfig, EmuDevice, NamespaceConfig};
use gpunvme_cli::perf::{PerfConfig, RwMode, Stop};

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
            interrupt: None,
        };
        group.bench_function(rw.name(), |b| {
            b.iter(|| {
                let r = gpunvme_cli::perf::run(&ctrl, &cfg).expect("perf run");
                assert_eq!(r.errors, 0);
            })
        });
    }
    group.finish();
}

/// Four queues (one host thread each) on 1, 2 and 4 controller threads.
fn scaling(c: &mut Criterion) {
    const QUEUES: usize = 4;
    let mut group = c.benchmark_group("perf_4k_qd32_memory_4_queues");
    group.throughput(Throughput::Elements(IOS * QUEUES as u64));
    group.measurement_time(Duration::from_secs(10));
    group.sample_size(10);
    for threads in [1, 2, 4] {
        let device = EmuDevice::start(EmuConfig {
            namespaces: vec![NamespaceConfig::memory(256 << 20, 512)],
            controller_threads: threads,
            ..EmuConfig::default()
        })
        .expect("software controller");
        let ctrl = Controller::new(device, ControllerOptions::default()).expect("bring-up");
        for rw in [RwMode::RandRead, RwMode::RandWrite] {
            let cfg = PerfConfig {
                rw,
                bs: 4096,
                qd: 32,
                queues: QUEUES,
                stop: Stop::Ios(IOS * QUEUES as u64),
                verify: false,
                nsid: 1,
                size: None,
                seed: Some(1),
                interrupt: None,
            };
            group.bench_function(format!("{}/{threads}_threads", rw.name()), |b| {
                b.iter(|| {
                    let r = gpunvme_cli::perf::run(&ctrl, &cfg).expect("perf run");
                    assert_eq!(r.errors, 0);
                })
            });
        }
    }
    group.finish();
}

criterion_group!(benches, perf, scaling);
criterion_main!(benches);
