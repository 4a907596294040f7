//! The driver's own cost per command, for instruction counting: runs `--ios N` reads of
//! `--bs B` bytes (default 4k) through one I/O queue pair in batches of `--qd Q` (default 32)
//! against the inline null device (`nvme_null`), which completes every command inside
//! the doorbell write on this thread and moves no data. What runs is the driver's submit and
//! reap path plus the null device's few loads and stores per command.
//!
//! Commands are queued with [`IoQueuePair::queue_read`] (borrowed buffer, no reference count
//! per command); `--owned` submits [`IoCommand::Read`] values with
//! [`IoQueuePair::submit_deferred`] instead (one `Arc` clone per command, dropped at
//! completion). Either way the batch gets one SQ doorbell. Completions are taken with
//! [`IoQueuePair::poll_with`] (each handed to a closure); `--vec` collects them with
//! [`IoQueuePair::poll`] into a `Vec<IoCompletion>` instead.
//!
//! Prints one line and nothing else. Count instructions with callgrind, collecting only inside
//! the measured loop (`run_ios`), so that bring-up does not count:
//!
//! ```sh
//! cargo build --release -p nvme --example driver_cost
//! valgrind --tool=callgrind --toggle-collect='*run_ios*' --callgrind-out-file=cg.out \
//!     target/release/examples/driver_cost --ios 100000 --qd 32 --bs 4k
//! # instructions per command = the "Collected" Ir / 100000 (scripts/driver-cost.sh does this)
//! ```

use anyhow::{Context, Result, bail, ensure};
use nvme::{Controller, ControllerOptions, Device, DmaSlice, IoCommand, IoCompletion, IoQueuePair};
use nvme_null::{NullDevice, NullDeviceConfig};
use std::sync::Arc;
use std::time::Instant;

/// Parsed command line.
struct Args {
    ios: u64,
    qd: usize,
    bs: usize,
    owned: bool,
    collect: bool,
}

fn parse_size(s: &str) -> Result<usize> {
    let s = s.trim().to_ascii_lowercase();
    let (digits, mult) = match s.strip_suffix(['k', 'm']) {
        Some(d) if s.ends_with('k') => (d, 1024),
        Some(d) => (d, 1024 * 1024),
        None => (s.as_str(), 1),
    };
    let n: usize = digits.parse().with_context(|| format!("bad size {s:?}"))?;
    Ok(n * mult)
}

fn parse_args() -> Result<Args> {
    let mut args = Args {
        ios: 0,
        qd: 32,
        bs: 4096,
        owned: false,
        collect: false,
    };
    let mut ios = None;
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "--owned" {
            args.owned = true;
            continue;
        }
        if flag == "--vec" {
            args.collect = true;
            continue;
        }
        let value = it.next().with_context(|| format!("{flag} needs a value"))?;
        match flag.as_str() {
            "--ios" => ios = Some(value.parse().context("--ios")?),
            "--qd" => args.qd = value.parse().context("--qd")?,
            "--bs" => args.bs = parse_size(&value)?,
            _ => bail!("usage: driver_cost --ios N [--qd Q] [--bs B] [--owned] [--vec]"),
        }
    }
    args.ios = ios.context("usage: driver_cost --ios N [--qd Q] [--bs B] [--owned] [--vec]")?;
    ensure!((1..=4095).contains(&args.qd), "--qd must be 1..=4095");
    ensure!(
        args.bs >= 512 && args.bs % 512 == 0 && args.bs <= 2 << 20,
        "--bs must be a multiple of 512 up to 2m"
    );
    Ok(args)
}

/// The measured loop: `ios` reads in batches of `bufs.len()`, each batch submitted with one
/// doorbell and reaped before the next. Not inlined, so callgrind can collect only here.
#[inline(never)]
fn run_ios(
    qp: &mut IoQueuePair,
    bufs: &[DmaSlice],
    ios: u64,
    owned: bool,
    collect: bool,
    out: &mut Vec<IoCompletion>,
) -> Result<u64> {
    let blocks = (bufs[0].len / 512) as u64;
    let mut done = 0u64;
    let mut errors = 0u64;
    while done < ios {
        let batch = (ios - done).min(bufs.len() as u64) as usize;
        for (i, buf) in bufs[..batch].iter().enumerate() {
            let lba = (done + i as u64) * blocks % (1 << 20);
            if owned {
                let cmd = IoCommand::Read {
                    nsid: 1,
                    lba,
                    buf: buf.clone(),
                };
                qp.submit_deferred(cmd, i as u64)?;
            } else {
                qp.queue_read(1, lba, buf, i as u64)?;
            }
        }
        qp.ring();
        let mut got = 0;
        while got < batch {
            if collect {
                out.clear();
                got += qp.poll(out)?;
                errors += out.iter().filter(|c| c.result.is_err()).count() as u64;
            } else {
                got += qp.poll_with(|_, r| errors += r.is_err() as u64)?;
            }
        }
        done += batch as u64;
    }
    Ok(errors)
}

fn main() -> Result<()> {
    let args = parse_args()?;
    let null = NullDevice::new(NullDeviceConfig::default());
    let dev: Arc<dyn Device> = null.clone();
    let ctrl = Controller::new(dev, ControllerOptions::default()).context("bring-up")?;
    let depth = u16::try_from(args.qd + 1)?;
    let mut qp = ctrl.create_io_queue_pair(depth).context("queue pair")?;
    ensure!(qp.capacity() >= args.qd, "queue depth {depth} not granted");
    let mem = Arc::new(ctrl.device().alloc_dma(args.qd * args.bs)?);
    let bufs: Vec<DmaSlice> = (0..args.qd)
        .map(|i| DmaSlice::new(mem.clone(), i * args.bs, args.bs))
        .collect();
    let mut out = Vec::with_capacity(args.qd);
    let start = Instant::now();
    let errors = run_ios(&mut qp, &bufs, args.ios, args.owned, args.collect, &mut out)?;
    let elapsed = start.elapsed();
    ensure!(errors == 0, "{errors} commands failed");
    println!(
        "driver_cost: {} reads of {} bytes, batches of {}, {} buffers, {:.1} ns per command \
         (inline null device)",
        args.ios,
        args.bs,
        args.qd,
        if args.owned { "owned" } else { "borrowed" },
        elapsed.as_nanos() as f64 / args.ios.max(1) as f64
    );
    Ok(())
}
