//! Building the queue pairs on the software controller ([`queues`], [`open`]): kernels, the
//! SM partition, the copy engines, each pair's memory and pinned doorbells, then the queues
//! through the driver's admin queue.

use std::sync::Arc;
use std::time::Instant;

use gpu_queues::GpuError;
use gpu_queues::ffi::{Cuda, DeviceMemory, GreenPartition, PinnedMemory, Placement, Stream};
use gpu_queues::kernels::Kernels;
use gpu_queues::queues::{
    DescCommon, DescParts, GpuQueueOptions, GpuQueuePair, GpuQueues, Plan, QueueSetParts,
    SetupPhases, TransportKind, alloc_protocol_states, plan,
};
use gpu_queues::transport::{Candidate, TransportChoice, select};
use nvme::{Controller, QueueRegions};
use nvme_emu::EmuDevice;

use crate::image_reads::ColdReads;
use crate::kernels::EmuKernels;

use super::engine::GpuDma;
use super::pair_memory::{GpuPairArena, RingPlacement, host_pair_memory};
use super::readahead::{READAHEAD_WALKERS, readahead_from};
use super::regions::{PinnedDoorbell, register_region};
use super::transport::SoftwareTransport;

/// Bytes between two queues' doorbell pairs in the pinned doorbell page (a cache line each,
/// so the controller's polling of one queue does not share a line with another's writes).
const DOORBELL_STRIDE: usize = 64;

/// [`queues`], with the choice reported as [`gpu_queues::transport::open`] reports its own:
/// for callers that print which transport ran.
pub fn open(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    emu: &Arc<EmuDevice>,
    opts: &GpuQueueOptions,
) -> Result<(GpuQueues, TransportChoice), GpuError> {
    select(vec![Candidate::Try(
        TransportKind::SoftwareController,
        Box::new(|| queues(cuda, controller, emu, opts)),
    )])
}

/// Builds queue pairs in GPU memory on `controller`, whose transport is the software
/// controller `emu` (`software-controller`): GPU memory is registered in its device-address map and
/// each queue's doorbells are attached as pinned-host-page words before the queue exists.
pub fn queues(
    cuda: &Arc<Cuda>,
    controller: &Controller,
    emu: &Arc<EmuDevice>,
    opts: &GpuQueueOptions,
) -> Result<GpuQueues, GpuError> {
    let p = plan(controller.info(), opts)?;
    let Plan {
        depth,
        slot_buffer_bytes,
        count,
        ..
    } = p;

    let started = Instant::now();
    let mut setup = SetupPhases::start();
    // The clients' module loads on a thread of its own while the partition, the copy engines,
    // the pairs' memory and the queues are made (nothing of those needs it); it is joined
    // before the first client kernel is warmed up. The wait for it (usually none) is reported
    // as `kernels`, its own time as `kernels_beside`.
    std::thread::scope(|scope| {
        let loading = scope.spawn(|| {
            let t = Instant::now();
            (Kernels::load(cuda), t.elapsed())
        });
        let partition = GreenPartition::split(cuda, opts.controller_sms)?;
        let client_stream = Stream::new(cuda, Placement::Client, Some(&partition))?;
        setup.mark("partition");
        // One copy engine per controller thread, each warmed up on its own stream.
        let emu_kernels = EmuKernels::load(cuda)?;
        setup.mark("controller_kernels");
        let t_warm = started.elapsed();
        let engine = GpuDma::new(cuda, &partition, emu.controller_threads(), emu_kernels)?;
        let readahead = readahead_from(
            gpunvme_settings::EMU_READAHEAD.value().as_deref(),
            match engine.cold_reads() {
                ColdReads::Direct => 0,
                ColdReads::Buffered | ColdReads::Prefetch => READAHEAD_WALKERS,
            },
        )?;
        let prefetch_readers = crate::prefetch::readers_from_env()?;
        setup.mark("copy_engines");
        let t_engines = started.elapsed();
        let doorbells = Arc::new(PinnedMemory::alloc(cuda, count as usize * DOORBELL_STRIDE)?);
        let host_flags = PinnedMemory::alloc(cuda, 4096)?;
        let common =
            DescCommon::new(&p, &host_flags, opts.timeout()?, 0).with_protection(controller)?;
        let map = emu.address_map();
        let register_as = |mem: Arc<DeviceMemory>, sq: bool| register_region(map, &engine, mem, sq);
        let rings = RingPlacement::from_env(opts.host_rings)?;
        let arena = match rings {
            RingPlacement::Gpu => Some(GpuPairArena::alloc(cuda, &p, count as usize)?),
            RingPlacement::Host => None,
        };
        let states = alloc_protocol_states(cuda, depth, count as usize)?;
        setup.mark("pair_memory");

        // Every pair's memory and doorbell words first, then all of them created together on the
        // controller (a few admin round trips instead of two per pair), then their descriptors.
        let mut parts = Vec::with_capacity(count as usize);
        for q in 0..count as usize {
            let mem = match &arena {
                Some(arena) => arena.pair(q, register_as)?,
                None => host_pair_memory(cuda, emu, &engine, &p)?,
            };
            let sq_word = Arc::new(PinnedDoorbell::new(doorbells.clone(), q * DOORBELL_STRIDE));
            let cq_word = Arc::new(PinnedDoorbell::new(
                doorbells.clone(),
                q * DOORBELL_STRIDE + 4,
            ));
            sq_word.reset();
            cq_word.reset();
            parts.push((mem, sq_word, cq_word));
        }
        let regions = parts
            .iter()
            .map(|(mem, _, _)| QueueRegions {
                sq: mem.sq_region.clone(),
                sq_entries: depth,
                cq: mem.cq_region.clone(),
                cq_entries: depth,
            })
            .collect();
        let created = controller.create_queue_pairs_on_with(regions, |i, qid| {
            let (_, sq_word, cq_word) = &parts[i];
            emu.attach_external_doorbells(qid, sq_word.clone(), cq_word.clone())
                .map_err(|e| nvme::Error::Unsupported(format!("external doorbells: {e}")))
        })?;
        let mut pairs = Vec::with_capacity(count as usize);
        for ((created, (mem, sq_word, cq_word)), (state, slots)) in
            created.into_iter().zip(parts).zip(states)
        {
            let desc = common.desc(DescParts {
                sq: mem.sq,
                cq: mem.cq,
                doorbells: (sq_word.device_ptr(), cq_word.device_ptr()),
                state: state.ptr(),
                slots: slots.ptr(),
                prp_lists: mem.prp_lists,
                slot_buffers: mem.slot_buffers,
                qid: created.qid(),
            });
            pairs.push(GpuQueuePair {
                created: Some(created),
                desc,
                state: state.clone(),
                keep: vec![Box::new(mem.keep), Box::new(vec![state, slots])],
            });
        }
        setup.mark("queue_pairs");
        let (kernels, t_kernels) = loading
            .join()
            .unwrap_or_else(|panic| std::panic::resume_unwind(panic));
        let kernels = kernels?;
        setup.mark("kernels");
        setup.record("kernels_beside", t_kernels);
        // Every client kernel loaded before any of them spins (lazy loading: see
        // `Kernels::warm_up_clients`).
        kernels.warm_up_clients(cuda, &client_stream)?;
        setup.mark("warm_up");
        // The copy engines' first areas, pinned on a thread of their own from here: it overlaps the
        // rest of the caller's preparations (a mount, a file's extents) and, at worst, a load's
        // first milliseconds, rather than the set-up (see `GpuDma::start_pinning`).
        engine.start_pinning()?;
        tracing::info!(
            queues = count,
            depth,
            slot_buffer_bytes,
            rings = rings.name(),
            controller_sms = partition.controller_sms(),
            kernels_ms = t_kernels.as_millis() as u64,
            controller_kernels_ms = t_warm.as_millis() as u64,
            copy_engines_ms = (t_engines - t_warm).as_millis() as u64,
            queue_pairs_ms = (started.elapsed() - t_engines).as_millis() as u64,
            "GPU queues created on the software controller"
        );
        GpuQueues::assemble(
            cuda,
            QueueSetParts {
                kind: TransportKind::SoftwareController,
                setup,
                pairs,
                host_flags,
                keep: Box::new(doorbells),
                client_stream,
                kernels,
                partition,
                plan: p,
                backend: Arc::new(SoftwareTransport {
                    emu: emu.clone(),
                    engine,
                    rings,
                    readahead,
                    prefetch_readers,
                }),
            },
        )
    })
}
