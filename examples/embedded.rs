//! Embedding gpunvme: bring up the software controller in memory, then drive it the way an
//! application drives a real SSD — synchronous helpers first, then the submit/poll interface
//! that keeps many commands in flight.
//!
//! Run with `cargo run --release --example embedded`. Swap the `EmuDevice` for
//! `vfio::VfioNvme::open(..)` to run the same code on a controller bound to vfio-pci.

use std::sync::Arc;

use anyhow::Result;
use gpunvme::nvme::{Controller, ControllerOptions, DmaSlice, IoCommand};
use gpunvme::nvme_emu::{EmuConfig, EmuDevice};

fn main() -> Result<()> {
    // One 64 MiB namespace of 512-byte LBAs, kept in memory.
    let device = EmuDevice::start(EmuConfig::default())?;
    let ctrl = Controller::new(device, ControllerOptions::default())?;
    let info = ctrl.info();
    println!(
        "{} {} (fw {}), {} I/O queue pairs",
        info.mn, info.sn, info.fr, info.max_io_queue_pairs
    );
    let ns = ctrl.namespace(1)?.clone();
    println!("namespace 1: {} blocks of {} bytes", ns.blocks, ns.lba_size);

    // Synchronous helpers: split at the controller's maximum transfer size, pipelined.
    let mut qp = ctrl.create_io_queue_pair(128)?;
    let data: Vec<u8> = (0..1 << 20).map(|i| (i * 7 % 251) as u8).collect();
    qp.write_from(1, 2048, &data)?;
    qp.flush(1)?;
    let mut back = vec![0u8; data.len()];
    qp.read_to(1, 2048, &mut back)?;
    assert_eq!(back, data);
    println!("1 MiB written and read back at lba 2048");

    // Submit/poll: 32 reads of 4 KiB in flight on one queue, completions matched by tag.
    let buf = Arc::new(ctrl.device().alloc_dma(32 * 4096)?);
    for i in 0..32u64 {
        let slice = DmaSlice::new(buf.clone(), i as usize * 4096, 4096);
        qp.submit(
            IoCommand::Read {
                nsid: 1,
                lba: 2048 + i * 8,
                buf: slice,
            },
            i,
        )?;
    }
    let mut done = Vec::new();
    while done.len() < 32 {
        qp.wait(&mut done, 1)?;
    }
    for c in &done {
        c.result
            .as_ref()
            .map_err(|e| anyhow::anyhow!("read {}: {e}", c.tag))?;
    }
    let mut first = [0u8; 16];
    buf.read(0, &mut first);
    assert_eq!(first, data[..16]);
    println!("32 concurrent 4 KiB reads completed");

    drop(qp);
    ctrl.shutdown()?;
    Ok(())
}
