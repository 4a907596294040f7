//! The inline null device of `nvme::bench_support` (what the driver-cost benchmark and example
//! run on): the unchanged bring-up works on it, commands complete inside the doorbell write, in
//! order or reversed, and the queue pair's rings wrap many times without losing a command.

use anyhow::{Context, Result, ensure};
use nvme::bench_support::{NullDevice, NullDeviceConfig};
use nvme::{Controller, ControllerOptions, Device, DmaSlice, Error, IoCommand, IoCompletion};
use std::collections::HashSet;
use std::sync::Arc;

fn start() -> Result<(Arc<NullDevice>, Controller)> {
    let null = NullDevice::new(NullDeviceConfig::default());
    let dev: Arc<dyn Device> = null.clone();
    let ctrl = Controller::new(dev, ControllerOptions::default()).context("bring-up")?;
    Ok((null, ctrl))
}

#[test]
fn bring_up_reports_the_configured_namespace() -> Result<()> {
    let (_null, ctrl) = start()?;
    let cfg = NullDeviceConfig::default();
    let ns: Vec<_> = ctrl
        .namespaces()
        .iter()
        .map(|n| (n.nsid, n.lba_size, n.blocks))
        .collect();
    assert_eq!(ns, vec![(1, cfg.lba_size, cfg.namespace_blocks)]);
    assert_eq!(ctrl.info().max_io_queue_pairs, cfg.max_io_queue_pairs);
    Ok(())
}

/// Runs `rounds` batches of `bufs.len()` reads; returns every tag seen, checking each batch
/// comes back whole and successful.
fn batches(qp: &mut nvme::IoQueuePair, bufs: &[DmaSlice], rounds: usize) -> Result<Vec<Vec<u64>>> {
    let mut seen = Vec::new();
    let mut out: Vec<IoCompletion> = Vec::new();
    for round in 0..rounds {
        for (i, buf) in bufs.iter().enumerate() {
            let cmd = IoCommand::Read {
                nsid: 1,
                lba: (i * 64) as u64,
                buf: buf.clone(),
            };
            qp.submit_deferred(cmd, (round * 1000 + i) as u64)?;
        }
        ensure!(qp.in_flight() == bufs.len());
        qp.ring();
        out.clear();
        // Completed inside the doorbell write: one poll finds them all.
        let n = qp.poll(&mut out)?;
        ensure!(n == bufs.len(), "round {round}: {n} of {} back", bufs.len());
        for c in &out {
            ensure!(c.result.is_ok(), "tag {}: {:?}", c.tag, c.result);
        }
        seen.push(out.iter().map(|c| c.tag).collect());
    }
    Ok(seen)
}

#[test]
fn completes_every_prp_shape_in_order_and_reversed() -> Result<()> {
    let (null, ctrl) = start()?;
    let mut qp = ctrl.create_io_queue_pair(8)?;
    // 4 KiB (PRP1), 8 KiB (PRP1 + PRP2), 16 KiB and 12 KiB at an offset (PRP lists).
    let mem = Arc::new(ctrl.device().alloc_dma(64 << 10)?);
    let bufs = vec![
        DmaSlice::new(mem.clone(), 0, 4096),
        DmaSlice::new(mem.clone(), 4096, 8192),
        DmaSlice::new(mem.clone(), 16384, 16384),
        DmaSlice::new(mem.clone(), 32768 + 512, 12288),
    ];
    // 100 rounds of 4 on a 7-entry queue: SQ and CQ wrap (and the phase flips) many times.
    let forward = batches(&mut qp, &bufs, 100)?;
    for tags in &forward {
        let want: Vec<u64> = (0..4).map(|i| tags[0] / 1000 * 1000 + i).collect();
        assert_eq!(tags, &want);
    }
    null.set_reverse_completions(true);
    let reversed = batches(&mut qp, &bufs, 100)?;
    for tags in &reversed {
        let base = tags[3];
        assert_eq!(tags, &[base + 3, base + 2, base + 1, base]);
    }
    assert_eq!(null.io_commands_completed(), 800);
    assert!(!qp.is_failed());
    Ok(())
}

#[test]
fn a_full_queue_and_bad_commands_are_typed_errors() -> Result<()> {
    let (_null, ctrl) = start()?;
    let mut qp = ctrl.create_io_queue_pair(4)?;
    let mem = Arc::new(ctrl.device().alloc_dma(4096)?);
    let buf = DmaSlice::whole(mem);
    let read = |nsid| IoCommand::Read {
        nsid,
        lba: 0,
        buf: buf.clone(),
    };
    for tag in 0..3 {
        qp.submit_deferred(read(1), tag)?;
    }
    assert!(matches!(
        qp.submit_deferred(read(1), 3),
        Err(Error::QueueFull { capacity: 3, .. })
    ));
    assert!(matches!(
        qp.submit(read(2), 4),
        Err(Error::NoSuchNamespace { nsid: 2 })
    ));
    let mut out = Vec::new();
    qp.wait(&mut out, 3)?;
    let tags: HashSet<u64> = out.iter().map(|c| c.tag).collect();
    assert_eq!(tags, HashSet::from([0, 1, 2]));
    qp.flush(1)?;
    Ok(())
}

#[test]
fn dma_memory_is_returned() -> Result<()> {
    let (null, ctrl) = start()?;
    let before = null.live_dma_buffers();
    {
        let mut qp = ctrl.create_io_queue_pair(16)?;
        let mem = Arc::new(ctrl.device().alloc_dma(8192)?);
        qp.read(1, 0, &DmaSlice::whole(mem))?;
        assert!(null.live_dma_buffers() > before);
    }
    assert_eq!(null.live_dma_buffers(), before);
    Ok(())
}
