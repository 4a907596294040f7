//! Opens an NVMe controller through VFIO, reads CAP/VS through BAR0, allocates DMA memory and,
//! with `--identify`, brings the admin queue up by hand and fetches Identify Controller into a
//! DMA buffer — proof that registers and DMA (through the IOMMU, or by physical address in
//! no-IOMMU mode) work, independent of the driver crate.
//!
//! ```text
//! vfio_probe 0000:00:03.0 [--identify] [--external] [--open-twice] [--no-hugepages] [--no-reset]
//! ```
//! `--external` lands the Identify data in memory mapped with `VfioNvme::map_external` instead
//! of `alloc_dma`; `--open-twice` opens the device a second time and prints that error.
//! Exits 1 with a one-line message on any error.
// UNSAFETY: `--external` maps a buffer of ours with `VfioNvme::map_external` and copies the
// device's bytes out of it through a raw pointer.
#![expect(unsafe_code)]

use std::sync::atomic::{Ordering, fence};
use std::time::{Duration, Instant};

use anyhow::{Context, bail};
use nvme::{Device, DmaMemory, RegisterIo};
use vfio::{PciAddress, VfioNvme, VfioOptions};

// NVMe Base 2.0 §3.1.4 controller registers.
const CAP: usize = 0x00;
const VS: usize = 0x08;
const CC: usize = 0x14;
const CSTS: usize = 0x1c;
const AQA: usize = 0x24;
const ASQ: usize = 0x28;
const ACQ: usize = 0x30;
const DOORBELLS: usize = 0x1000;

const ADMIN_DEPTH: u32 = 64;

fn main() {
    tracing_subscriber::fmt()
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .with_writer(std::io::stderr)
        .init();
    if let Err(e) = run() {
        let chain: Vec<String> = e.chain().map(|c| c.to_string()).collect();
        eprintln!("error: {}", chain.join(": "));
        std::process::exit(1);
    }
}

fn run() -> anyhow::Result<()> {
    let mut addr = None;
    let mut identify = false;
    let mut external = false;
    let mut open_twice = false;
    let mut opts = VfioOptions::default();
    for arg in std::env::args().skip(1) {
        match arg.as_str() {
            "--identify" => identify = true,
            "--external" => external = true,
            "--open-twice" => open_twice = true,
            "--no-hugepages" => opts.prefer_hugepages = false,
            "--no-reset" => opts.reset = false,
            s if addr.is_none() => addr = Some(s.parse::<PciAddress>()?),
            s => bail!("unexpected argument `{s}`"),
        }
    }
    let Some(addr) = addr else {
        bail!("usage: vfio_probe DDDD:BB:DD.F [--identify] [--no-hugepages] [--no-reset]")
    };

    let dev = VfioNvme::open(&addr, &opts)?;
    let regs = dev.registers();
    let cap = regs.read_u64(CAP);
    let vs = regs.read_u32(VS);
    println!("device: {}", dev.describe());
    println!("iommu_group: {}", dev.iommu_group());
    println!("bar0_bytes: {}", regs.len());
    println!("bar0_whole_mmap: {}", dev.bar0_mapping().is_some());
    println!("CAP: 0x{cap:016x}");
    println!(
        "VS: 0x{vs:08x} ({}.{}.{})",
        vs >> 16,
        (vs >> 8) & 0xff,
        vs & 0xff
    );
    println!("CSTS: 0x{:08x}", regs.read_u32(CSTS));
    if cap == u64::MAX {
        bail!("CAP reads all-ones: device gone");
    }

    let sizes = [4096usize, 100, 64 << 10, 3 << 20];
    let bufs: Vec<DmaMemory> = sizes
        .iter()
        .map(|&n| dev.alloc_dma(n).with_context(|| format!("alloc_dma({n})")))
        .collect::<Result<_, _>>()?;
    for (n, b) in sizes.iter().zip(&bufs) {
        println!(
            "dma: asked {n} got {} device_address 0x{:x} contiguous {}",
            b.len(),
            b.device_address(0),
            b.is_device_contiguous()
        );
    }
    println!("dma_stats: {:?}", dev.dma_stats());
    drop(bufs);
    println!("dma_stats_after_drop: {:?}", dev.dma_stats());

    if open_twice {
        match VfioNvme::open(&addr, &opts) {
            Ok(_) => bail!("a second open of {addr} succeeded"),
            Err(e) => println!("second_open_error: {e}"),
        }
    }

    if identify {
        if external {
            let buf = memmap2::MmapMut::map_anon(4096).context("mmap for --external")?;
            let ptr = buf.as_ptr().cast_mut();
            // SAFETY: `buf` stays mapped until after `mapping` is dropped (end of this block).
            let mapping = unsafe { dev.map_external(ptr, 4096) }?;
            println!("external_mapping: {mapping:?}");
            identify_controller(&dev, cap, mapping.device_address(0), || {
                let mut out = vec![0u8; 4096];
                // SAFETY: `ptr` is valid for 4096 bytes; the device finished writing (its
                // completion was loaded with Acquire); no reference into the buffer exists.
                unsafe { std::ptr::copy_nonoverlapping(ptr, out.as_mut_ptr(), 4096) };
                out
            })?;
            drop(mapping);
            drop(buf);
        } else {
            let data = dev.alloc_dma(4096)?;
            identify_controller(&dev, cap, data.device_address(0), || {
                let mut out = vec![0u8; 4096];
                data.read(0, &mut out);
                out
            })?;
        }
    }
    println!("probe: ok");
    Ok(())
}

fn wait_csts(
    regs: &dyn RegisterIo,
    what: &str,
    timeout: Duration,
    done: impl Fn(u32) -> bool,
) -> anyhow::Result<u32> {
    let deadline = Instant::now() + timeout;
    loop {
        let csts = regs.read_u32(CSTS);
        if csts == u32::MAX {
            bail!("CSTS reads all-ones while waiting for {what}: device gone");
        }
        if csts & 2 != 0 {
            bail!("controller fatal status (CSTS 0x{csts:08x}) while waiting for {what}");
        }
        if done(csts) {
            return Ok(csts);
        }
        if Instant::now() > deadline {
            bail!("timed out after {timeout:?} waiting for {what} (CSTS 0x{csts:08x})");
        }
        std::thread::sleep(Duration::from_millis(1));
    }
}

/// Minimal admin bring-up (NVMe Base 2.0 §3.5.1) and one Identify Controller command.
fn identify_controller(
    dev: &VfioNvme,
    cap: u64,
    data_addr: u64,
    read_data: impl Fn() -> Vec<u8>,
) -> anyhow::Result<()> {
    let regs = dev.registers();
    let timeout = Duration::from_millis(500 * ((cap >> 24) & 0xff).max(1));
    let dstrd = ((cap >> 32) & 0xf) as usize;
    let sq_tail_db = DOORBELLS;
    let cq_head_db = DOORBELLS + (4 << dstrd);

    regs.write_u32(CC, 0);
    wait_csts(regs, "CSTS.RDY=0", timeout, |c| c & 1 == 0)?;

    let asq = dev.alloc_dma(ADMIN_DEPTH as usize * 64)?;
    let acq = dev.alloc_dma(ADMIN_DEPTH as usize * 16)?;
    regs.write_u32(AQA, ((ADMIN_DEPTH - 1) << 16) | (ADMIN_DEPTH - 1));
    regs.write_u64(ASQ, asq.device_address(0));
    regs.write_u64(ACQ, acq.device_address(0));
    // EN, CSS=NVM, MPS=0 (4 KiB), AMS=RR, IOSQES=6, IOCQES=4.
    regs.write_u32(CC, 1 | (6 << 16) | (4 << 20));
    wait_csts(regs, "CSTS.RDY=1", timeout, |c| c & 1 == 1)?;

    // Identify, CNS=1 (controller), cid 0x1234, PRP1 = data buffer.
    let mut sqe = [0u8; 64];
    sqe[0] = 0x06;
    sqe[2..4].copy_from_slice(&0x1234u16.to_le_bytes());
    sqe[24..32].copy_from_slice(&data_addr.to_le_bytes());
    sqe[40..44].copy_from_slice(&1u32.to_le_bytes());
    asq.write(0, &sqe);
    fence(Ordering::Release);
    regs.write_u32(sq_tail_db, 1);

    let deadline = Instant::now() + Duration::from_secs(5);
    let dw3 = loop {
        let dw3 = acq.load_u32(12, Ordering::Acquire);
        if (dw3 >> 16) & 1 == 1 {
            break dw3;
        }
        if Instant::now() > deadline {
            bail!(
                "Identify did not complete within 5 s (CSTS 0x{:08x})",
                regs.read_u32(CSTS)
            );
        }
        std::hint::spin_loop();
    };
    regs.write_u32(cq_head_db, 1);
    let cid = dw3 & 0xffff;
    let status = dw3 >> 17;
    if cid != 0x1234 || status != 0 {
        bail!(
            "Identify completed with cid 0x{cid:x}, status 0x{status:x} (sct {}, sc 0x{:x})",
            (status >> 8) & 7,
            status & 0xff
        );
    }

    let id = read_data();
    let text = |r: std::ops::Range<usize>| String::from_utf8_lossy(&id[r]).trim().to_owned();
    println!("identify.vid: 0x{:04x}", u16::from_le_bytes([id[0], id[1]]));
    println!("identify.sn: {}", text(4..24));
    println!("identify.mn: {}", text(24..64));
    println!("identify.fr: {}", text(64..72));
    println!("identify.mdts: {}", id[77]);
    println!("identify.data_device_address: 0x{data_addr:x}");

    // Normal shutdown (CC.SHN=01), wait for SHST=10, then disable.
    regs.write_u32(CC, regs.read_u32(CC) | (1 << 14));
    wait_csts(regs, "CSTS.SHST=complete", timeout, |c| (c >> 2) & 3 == 2)?;
    regs.write_u32(CC, 0);
    Ok(())
}
