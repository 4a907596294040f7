//! Proof that a transport carries data before it is chosen: one Read of LBA 0 through the new
//! queues, issued by a GPU thread (the `io_batch` kernel) into queue 0's first slot buffer
//! after that buffer was filled with a poison pattern, bounded in time, and compared with the
//! same block read through a CPU queue of the controller where one can be created.
//!
//! The vfio-p2p transport runs it before choosing itself: its set-up can succeed on a platform
//! where the SSD's writes into GPU memory never arrive (a translated IOMMU domain the checks
//! missed, a BAR1 mapping of the wrong pages), and without the probe the first user of the
//! queues would read stale bytes or wait out a 30 s timeout.
#![forbid(unsafe_code)]

use std::time::Duration;

use nvme::Controller;

use crate::desc::{DeviceStatus, IoReq};
use crate::error::GpuError;
use crate::ffi::PinnedMemory;
use crate::kernels::IoBatch;
use crate::queues::GpuQueues;

/// How long the probe's Read may take before the transport is refused (an SSD answers a 4 KiB
/// read in well under a millisecond).
pub const PROBE_BOUND: Duration = Duration::from_millis(100);

/// How long the probe kernel gets to stop after it was told to abort.
const ABORT_GRACE: Duration = Duration::from_secs(2);

/// Byte the slot buffer is filled with before the Read.
const POISON: u8 = 0xA5;

/// Why a probe failed, in words for the transport's skip reason.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error("{0}")]
pub struct ProbeFailed(pub String);

/// Reads LBA 0 of the first namespace through `queues` (queue 0) from a GPU thread within
/// `bound`; `Ok` when it completes successfully with the block's bytes. No namespace, or blocks
/// larger than a memory page, is `Ok` without a probe (logged): there is nothing to read in one
/// page.
pub fn probe_read(
    queues: &GpuQueues,
    controller: &Controller,
    bound: Duration,
) -> Result<(), ProbeFailed> {
    let fail = |what: String| ProbeFailed(what);
    let gpu = |e: GpuError| ProbeFailed(format!("the probe could not run: {e}"));
    let Some(ns) = controller.namespaces().first() else {
        tracing::info!("no namespace: GPU queues not probed with a read");
        return Ok(());
    };
    let (nsid, lba) = (ns.nsid, ns.lba_size as usize);
    if lba > 4096 || queues.is_empty() {
        tracing::info!(
            lba,
            "GPU queues not probed with a read (blocks above 4 KiB)"
        );
        return Ok(());
    }
    let desc = queues.descs()[0];
    let cuda = queues.cuda();
    let stream = queues.client_stream();

    // The slot buffer starts as poison, so that a Read whose data never arrives shows.
    let host = PinnedMemory::alloc(cuda, 4096).map_err(gpu)?;
    host.write(0, &vec![POISON; lba]);
    stream
        .copy_from_pinned(&host, 0, desc.slot_buffers, lba)
        .map_err(gpu)?;
    let req = IoReq {
        slba: 0,
        prp1: desc.slot_buffers_bus,
        prp2: 0,
        nsid,
        nlb_z: 0,
        opcode: nvme_spec::NvmOpcode::READ.0,
        reserved: 0,
    };
    let batch = IoBatch::new(cuda, &[req]).map_err(gpu)?;
    batch
        .launch(queues.kernels(), stream, queues.descriptors(), 1, false)
        .map_err(gpu)?;
    if stream.wait_idle(bound).is_err() {
        // Stop the kernel's wait; the queues are dropped with the transport.
        queues.abort();
        let stopped = stream.wait_idle(ABORT_GRACE).is_ok();
        return Err(fail(format!(
            "a Read of LBA 0 by a GPU thread did not complete within {} ms{}",
            bound.as_millis(),
            if stopped {
                ""
            } else {
                " (and the probe kernel did not stop when told to)"
            }
        )));
    }
    let (status, sf) = batch.results().map_err(gpu)?[0];
    if status != DeviceStatus::Ok || sf != 0 {
        return Err(fail(format!(
            "a Read of LBA 0 by a GPU thread ended with {status:?} (NVMe status field {sf:#x})"
        )));
    }
    stream
        .copy_to_pinned(&host, 0, desc.slot_buffers, lba)
        .map_err(gpu)?;
    stream.wait_idle(bound.max(ABORT_GRACE)).map_err(gpu)?;
    let mut got = vec![0u8; lba];
    host.read(0, &mut got);

    // The block as a CPU queue reads it, where a queue can be had.
    let want = match controller.create_io_queue_pair(2) {
        Ok(mut q) => {
            let mut want = vec![0u8; lba];
            q.read_to(nsid, 0, &mut want)
                .map_err(|e| fail(format!("the CPU read of LBA 0 to compare with failed: {e}")))?;
            Some(want)
        }
        Err(e) => {
            tracing::info!(error = %e, "no CPU queue to compare the probe read with");
            None
        }
    };
    check_bytes(&got, want.as_deref())?;
    tracing::info!(
        nsid,
        "GPU queues probed: a GPU thread's Read of LBA 0 returned its bytes"
    );
    Ok(())
}

/// Judges the bytes a successful probe Read left in the buffer: equal to a CPU queue's read of
/// the block (`want`), or, without one, at least no longer all poison.
fn check_bytes(got: &[u8], want: Option<&[u8]>) -> Result<(), ProbeFailed> {
    match want {
        Some(want) => match got.iter().zip(want).position(|(a, b)| a != b) {
            None if got.len() == want.len() => Ok(()),
            at => Err(ProbeFailed(format!(
                "a Read of LBA 0 by a GPU thread completed, but its data differs from a CPU \
                 queue's read of the same block from byte {} on (the SSD's writes into this \
                 memory do not arrive, or arrive after the completion)",
                at.unwrap_or(got.len().min(want.len()))
            ))),
        },
        None if got.iter().all(|&b| b == POISON) => Err(ProbeFailed(
            "a Read of LBA 0 by a GPU thread completed, but the buffer still holds the pattern \
             written before it (the SSD's writes into this memory do not arrive)"
                .into(),
        )),
        None => Ok(()),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn bytes_that_never_arrived_are_caught() {
        let block: Vec<u8> = (0..512u32).map(|i| (i * 7) as u8).collect();
        assert_eq!(check_bytes(&block, Some(&block)), Ok(()));
        let mut late = block.clone();
        late[300..].fill(POISON);
        let e = check_bytes(&late, Some(&block)).unwrap_err();
        assert!(e.0.contains("from byte 300 on"), "{e}");
        // Without a CPU read to compare with: all poison is refused, anything else passes.
        let e = check_bytes(&[POISON; 512], None).unwrap_err();
        assert!(e.0.contains("still holds the pattern"), "{e}");
        assert_eq!(check_bytes(&block, None), Ok(()));
        // A block of poison bytes on the SSD itself still passes when a CPU read agrees.
        assert_eq!(check_bytes(&[POISON; 512], Some(&[POISON; 512])), Ok(()));
    }
}
