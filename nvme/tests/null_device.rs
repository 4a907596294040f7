//! The inline null device of `nvme_null` (what the driver-cost benchmark and example
//! run on): the unchanged bring-up works on it, commands complete inside the doorbell write, in
//! order or reversed, and the queue pair's rings wrap many times without losing a command.

use anyhow::{Context, Result, ensure};
use nvme::{Controller, ControllerOptions, Device, DmaSlice, Error, IoCommand, IoCompletion};
use nvme_null::{NullDevice, NullDeviceConfig};
use std::collections::HashSet;
use std::sync::Arc;

fn start() -> Result<(Arc<NullDevice>, Controller)> {
    let null = NullDevice::new(NullDeviceConfig::default());
    let dev: Arc<dyn Device> = null.clone();
    let ctrl = Controller::new(dev, ControllerOptions::default()).context("bring-up")?;
    Ok((null, ctrl))
}

/// `n` 4 KiB buffers, one per page of one DMA allocation.
fn page_buffers(ctrl: &Controller, n: usize) -> Result<Vec<DmaSlice>> {
    let mem = Arc::new(ctrl.device().alloc_dma(n * 4096)?);
    Ok((0..n)
        .map(|i| DmaSlice::new(mem.clone(), i * 4096, 4096))
        .collect())
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

#[test]
fn borrowed_buffers_are_pinned_once_and_released_on_request() -> Result<()> {
    let (_null, ctrl) = start()?;
    let mut qp = ctrl.create_io_queue_pair(64)?;
    // Six distinct buffers: more than the queue pair's pins, so some commands fall back to a
    // reference count of their own.
    let mems: Vec<_> = (0..6)
        .map(|_| ctrl.device().alloc_dma(8192).map(Arc::new))
        .collect::<Result<_, _>>()?;
    let bufs: Vec<DmaSlice> = mems.iter().map(|m| DmaSlice::whole(m.clone())).collect();
    let base: Vec<usize> = mems.iter().map(Arc::strong_count).collect();
    for round in 0..3u64 {
        for (i, buf) in bufs.iter().enumerate() {
            qp.queue_read(1, 0, buf, round * 10 + i as u64)?;
        }
    }
    assert_eq!(qp.in_flight(), 18);
    // In flight, every buffer is kept alive by the queue pair, pinned or not.
    for (m, b) in mems.iter().zip(&base) {
        assert!(Arc::strong_count(m) > *b);
    }
    // Nothing is released while commands use the pins.
    assert_eq!(qp.release_buffers(), 0);
    let mut out = Vec::new();
    qp.wait(&mut out, 18)?;
    assert_eq!(out.len(), 18);
    assert!(out.iter().all(|c| c.result.is_ok()));
    let tags: HashSet<u64> = out.iter().map(|c| c.tag).collect();
    assert_eq!(tags.len(), 18);
    // Done: at most the pins remain (four buffers), and releasing them gives every count back.
    let extra: usize = mems
        .iter()
        .zip(&base)
        .map(|(m, b)| Arc::strong_count(m) - b)
        .sum();
    assert!((1..=4).contains(&extra), "{extra} references left");
    assert_eq!(qp.release_buffers(), extra);
    for (m, b) in mems.iter().zip(&base) {
        assert_eq!(Arc::strong_count(m), *b);
    }
    Ok(())
}

#[test]
fn borrowed_commands_are_checked_like_owned_ones() -> Result<()> {
    let (_null, ctrl) = start()?;
    let mut qp = ctrl.create_io_queue_pair(8)?;
    let mem = Arc::new(ctrl.device().alloc_dma(8192)?);
    let blocks = NullDeviceConfig::default().namespace_blocks;
    let e = qp.queue_read(1, 0, &DmaSlice::new(mem.clone(), 0, 100), 0);
    assert!(
        matches!(
            e,
            Err(Error::Unaligned {
                what: "buffer length",
                ..
            })
        ),
        "{e:?}"
    );
    let e = qp.queue_read(1, 0, &DmaSlice::new(mem.clone(), 2, 512), 0);
    assert!(
        matches!(
            e,
            Err(Error::Unaligned {
                what: "buffer offset",
                ..
            })
        ),
        "{e:?}"
    );
    let e = qp.queue_write(1, blocks - 1, &DmaSlice::new(mem.clone(), 0, 1024), 0);
    assert!(matches!(e, Err(Error::OutOfRange { .. })), "{e:?}");
    let e = qp.queue_write(1, u64::MAX, &DmaSlice::new(mem.clone(), 0, 512), 0);
    assert!(matches!(e, Err(Error::OutOfRange { .. })), "{e:?}");
    let e = qp.queue_read(7, 0, &DmaSlice::new(mem.clone(), 0, 512), 0);
    assert!(
        matches!(e, Err(Error::NoSuchNamespace { nsid: 7 })),
        "{e:?}"
    );
    let e = qp.queue_read(1, 0, &DmaSlice::new(mem.clone(), 0, 0), 0);
    assert!(matches!(e, Err(Error::InvalidArgument(_))), "{e:?}");
    assert_eq!(qp.in_flight(), 0, "a refused command reaches no slot");
    // The last good namespace is still used correctly after a refused one.
    qp.queue_read(1, blocks - 1, &DmaSlice::new(mem, 512, 512), 9)?;
    let mut out = Vec::new();
    qp.wait(&mut out, 1)?;
    assert_eq!(out.len(), 1);
    assert_eq!(out[0].tag, 9);
    assert!(out[0].result.is_ok());
    Ok(())
}

#[test]
fn poll_with_hands_over_every_completion_including_stashed_ones() -> Result<()> {
    let (null, ctrl) = start()?;
    let mut qp = ctrl.create_io_queue_pair(16)?;
    let bufs = page_buffers(&ctrl, 4)?;
    null.set_reverse_completions(true);
    for (i, buf) in bufs.iter().enumerate() {
        qp.queue_read(1, i as u64 * 8, buf, 100 + i as u64)?;
    }
    // A synchronous Flush reaps the four reads on its way and keeps them for the caller.
    qp.flush(1)?;
    for (i, buf) in bufs.iter().enumerate() {
        qp.queue_read(1, i as u64 * 8, buf, 200 + i as u64)?;
    }
    let mut seen = Vec::new();
    let mut n = 0;
    while seen.len() < 8 {
        n += qp.poll_with(|tag, result| seen.push((tag, result.is_ok())))?;
    }
    assert_eq!(n, 8);
    let mut tags: Vec<u64> = seen.iter().map(|&(t, _)| t).collect();
    tags.sort_unstable();
    assert_eq!(tags, [100, 101, 102, 103, 200, 201, 202, 203]);
    assert!(seen.iter().all(|&(_, ok)| ok));
    assert_eq!(qp.in_flight(), 0);
    Ok(())
}

#[test]
fn single_commands_complete_at_once_across_many_ring_wraps() -> Result<()> {
    // One command per doorbell (the null device's QD 1 fast path) on a 4-entry queue pair:
    // 50 rounds wrap both rings and flip the CQ phase a dozen times, with a batch now and then
    // (its general path) and reversed completions in between.
    let (null, ctrl) = start()?;
    let mut qp = ctrl.create_io_queue_pair(4)?;
    let bufs = page_buffers(&ctrl, 3)?;
    let before = null.io_commands_completed();
    let mut expected = 0u64;
    for round in 0..50u64 {
        null.set_reverse_completions(round % 7 == 3);
        let batch = if round % 5 == 4 { 3 } else { 1 };
        for (i, buf) in bufs[..batch].iter().enumerate() {
            qp.queue_read(1, round * 8, buf, round * 10 + i as u64)?;
        }
        qp.ring();
        // Completed inside the doorbell write: one poll finds them all.
        let mut tags = Vec::new();
        qp.poll_with(|tag, result| tags.push((tag, result.is_ok())))?;
        tags.sort_unstable();
        let want: Vec<_> = (0..batch as u64).map(|i| (round * 10 + i, true)).collect();
        assert_eq!(tags, want, "round {round}");
        expected += batch as u64;
        assert_eq!(null.io_commands_completed() - before, expected);
    }
    assert_eq!(qp.in_flight(), 0);
    Ok(())
}
