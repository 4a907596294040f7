//! `gpunvme serve`: run the daemon that owns the `--device` controllers and lends their queue
//! pairs to client processes (`gpunvme_serve`), and `serve status`, which asks a running one.

use std::path::PathBuf;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use anyhow::{Context, Result};
use clap::{Args, Subcommand};
use gpunvme::open::OpenOptions;
use gpunvme_serve::{Budgets, ServeOptions, Server};

/// The socket used without `--socket`.
pub const DEFAULT_SOCKET: &str = "/run/gpunvme/serve.sock";

/// `gpunvme serve` arguments.
#[derive(Args, Debug)]
pub struct ServeArgs {
    /// The daemon's socket.
    #[arg(long, default_value = DEFAULT_SOCKET)]
    socket: PathBuf,
    /// The group (name or id) whose members may connect besides this user: the socket is then
    /// mode 0660 and that group's (default: 0600, this user only).
    #[arg(long)]
    group: Option<String>,
    /// Queue pairs each client may hold at once (1 to 64).
    #[arg(long, default_value_t = 16)]
    client_queues: u16,
    /// Entries per queue a client may ask for.
    #[arg(long, default_value_t = 1024)]
    client_depth: u32,
    /// Arena bytes each client may hold at once (e.g. 1g, 256m).
    #[arg(long, default_value = "1g", value_parser = gpunvme::units::parse_size)]
    client_arena_bytes: u64,
    /// Seconds a send to a client may wait before the client is disconnected as not reading.
    #[arg(long, default_value_t = 2.0)]
    send_bound_s: f64,
    /// Delay every I/O completion of the software controllers by this many milliseconds
    /// (tests: commands truly outstanding when a client is killed).
    #[arg(long, hide = true)]
    emu_completion_delay_ms: Option<u64>,
    #[command(subcommand)]
    action: Option<ServeAction>,
}

/// What `serve` does besides running the daemon.
#[derive(Subcommand, Debug)]
pub enum ServeAction {
    /// Ask the daemon at --socket for its clients, their queues and arenas, budgets and
    /// counters.
    Status,
    /// A client of the daemon at --socket: write LBA-stamped data to a range through served
    /// queues driven from this process, read it back and check every byte; fails on any error.
    Check(CheckArgs),
}

/// `serve check` arguments.
#[derive(Args, Debug)]
pub struct CheckArgs {
    /// The controller's name at the daemon.
    #[arg(long, default_value = "nvme0")]
    controller: String,
    /// Namespace id.
    #[arg(long, default_value_t = 1)]
    nsid: u32,
    /// First LBA of the range this client writes.
    #[arg(long, default_value_t = 0)]
    first_lba: u64,
    /// LBAs in the range (default: to the namespace's end).
    #[arg(long, default_value_t = 0)]
    lbas: u64,
    /// Blocks per command.
    #[arg(long, default_value_t = 8)]
    blocks_per_io: u32,
    /// Queue pairs (one thread each).
    #[arg(long, default_value_t = 1)]
    queues: u16,
    /// Entries per queue.
    #[arg(long, default_value_t = 64)]
    depth: u32,
    /// Commands in flight per queue.
    #[arg(long, default_value_t = 16)]
    qd: u32,
    /// Commands in all (default: one pass over the range, or --runtime).
    #[arg(long)]
    ios: Option<u64>,
    /// Run for this long (e.g. 10s).
    #[arg(long, value_parser = gpunvme::units::parse_duration)]
    runtime: Option<Duration>,
    /// Mixed into the data written (and the random LBAs of --read-only).
    #[arg(long, default_value_t = 0)]
    seed: u64,
    /// Random reads of the range only, --qd in flight per queue, nothing written or checked:
    /// a throughput run.
    #[arg(long)]
    read_only: bool,
    /// Write even if the namespace holds a blockfs or belongs to a striped volume,
    /// destroying it.
    #[arg(long)]
    force: bool,
    /// GPU threads drive the served queues (the perf kernel: the pattern written over LBAs
    /// 0..--lbas, then random reads, every byte checked on the GPU); --qd is GPU threads per
    /// queue. Concurrent GPU writers of one range must use the same --seed.
    #[arg(long)]
    gpu: bool,
    /// With --gpu --read-only: reads are not checked (a throughput run; GPU threads then
    /// never read the data they land).
    #[arg(long, requires = "gpu")]
    no_verify: bool,
    /// The GPU: an ordinal, a UUID or a PCI address.
    #[arg(long, default_value = "0", value_parser = super::fs::parse_gpu_id, requires = "gpu")]
    gpu_id: gpunvme::gpu_queues::GpuId,
}

/// `NAME=SPEC` or `SPEC` (named `nvme0`, `nvme1`, ... in order); a SPEC is an image path or
/// `vfio-user:SOCKET`.
fn named_devices(devices: &[String]) -> Result<Vec<(String, String)>> {
    anyhow::ensure!(
        !devices.is_empty(),
        "`serve` needs --device: the image(s) to serve (NAME=PATH or PATH)"
    );
    let mut out: Vec<(String, String)> = Vec::new();
    for (i, d) in devices.iter().enumerate() {
        let (name, path) = match d.split_once('=') {
            Some((n, p)) if !n.is_empty() && !n.contains(['/', ':']) => {
                (n.to_owned(), p.to_owned())
            }
            _ => (format!("nvme{i}"), d.clone()),
        };
        anyhow::ensure!(
            !out.iter().any(|(n, _)| *n == name),
            "two devices named {name:?}"
        );
        out.push((name, path));
    }
    Ok(out)
}

static STOP: AtomicBool = AtomicBool::new(false);

/// Runs `serve` (the daemon until SIGINT or SIGTERM) or `serve status`.
pub fn run(args: ServeArgs, devices: &[String], open: OpenOptions, json: bool) -> Result<()> {
    match args.action {
        Some(ServeAction::Status) => {
            anyhow::ensure!(
                devices.is_empty(),
                "`serve status` asks the daemon at --socket; drop --device"
            );
            return status(&args.socket, json);
        }
        Some(ServeAction::Check(c)) => {
            anyhow::ensure!(
                devices.is_empty(),
                "`serve check` uses the daemon at --socket; drop --device"
            );
            return check(&args.socket, c, json);
        }
        None => {}
    }
    let devices = named_devices(devices)?;
    anyhow::ensure!(
        args.send_bound_s > 0.0 && args.send_bound_s <= 600.0,
        "--send-bound-s must be above 0 and at most 600"
    );
    if let Some(dir) = args.socket.parent()
        && !dir.as_os_str().is_empty()
    {
        std::fs::create_dir_all(dir)
            .with_context(|| format!("creating the socket's folder {}", dir.display()))?;
    }
    let opts = ServeOptions {
        socket: args.socket.clone(),
        devices: devices.clone(),
        open,
        budgets: Budgets {
            queues: args.client_queues,
            depth: args.client_depth,
            arena_bytes: args.client_arena_bytes,
            ..Budgets::default()
        },
        send_bound: Duration::from_secs_f64(args.send_bound_s),
        completion_delay: args.emu_completion_delay_ms.map(Duration::from_millis),
        group: args
            .group
            .as_deref()
            .map(gpunvme_serve::group_id)
            .transpose()?,
    };
    let _ = ctrlc::set_handler(|| STOP.store(true, Ordering::Release));
    let server = Server::start(opts)?;
    if json {
        outln!(
            "{}",
            serde_json::json!({
                "serving": server.socket(),
                "status": server.daemon().status(),
            })
        );
    } else {
        outln!("gpunvme serve: listening at {}", server.socket().display());
        for (name, spec) in &devices {
            outln!("  {name}: {spec}");
        }
        outln!("trust: {}", gpunvme_serve::TRUST);
    }
    while !STOP.load(Ordering::Acquire) {
        std::thread::sleep(Duration::from_millis(50));
    }
    let reclaimed = server.daemon().reclaimed();
    server.stop();
    if !json {
        outln!("gpunvme serve: stopped ({reclaimed} client(s) served)");
    }
    Ok(())
}

fn status(socket: &std::path::Path, json: bool) -> Result<()> {
    let conn = gpunvme_serve_client::Connection::connect(
        socket,
        "gpunvme serve status",
        Duration::from_secs(5),
    )
    .with_context(|| format!("asking the daemon at {}", socket.display()))?;
    let text = conn.status()?;
    let v: serde_json::Value = serde_json::from_str(&text).context("the daemon's status")?;
    if json {
        outln!("{v}");
        return Ok(());
    }
    outln!("daemon at {}", socket.display());
    outln!("trust: {}", v["trust"].as_str().unwrap_or("?"));
    for c in v["controllers"].as_array().into_iter().flatten() {
        outln!(
            "controller {}: {} of {} queue pairs lent{}",
            c["name"].as_str().unwrap_or("?"),
            c["lent_queue_pairs"],
            c["max_queue_pairs"],
            c["degraded"]
                .as_str()
                .map(|w| format!("; DEGRADED: {w}"))
                .unwrap_or_default()
        );
    }
    // Ourselves among the clients: say so rather than hide it.
    for c in v["clients"].as_array().into_iter().flatten() {
        let qids: Vec<String> = c["queues"]
            .as_array()
            .into_iter()
            .flatten()
            .map(|q| format!("{}:{}", q["controller"].as_str().unwrap_or("?"), q["qid"]))
            .collect();
        outln!(
            "client {} {:?} (pid {}, uid {}): queues [{}], {} arena bytes",
            c["id"],
            c["name"].as_str().unwrap_or(""),
            c["pid"],
            c["uid"],
            qids.join(", "),
            c["arena_bytes"]
        );
    }
    outln!(
        "reclaimed clients {}, late controller writes {}, quarantined arenas {}",
        v["reclaimed_clients"],
        v["late_controller_writes"],
        v["quarantined_arenas"]
    );
    Ok(())
}

fn check(socket: &std::path::Path, c: CheckArgs, json: bool) -> Result<()> {
    let t0 = std::time::Instant::now();
    let name = format!("gpunvme serve check (pid {})", std::process::id());
    let conn = gpunvme_serve_client::Connection::connect(socket, &name, Duration::from_secs(10))
        .with_context(|| format!("connecting to the daemon at {}", socket.display()))?;
    let connect_us = t0.elapsed().as_micros() as u64;
    let opts = gpunvme_serve_client::check::CheckOptions {
        controller: c.controller,
        nsid: c.nsid,
        first_lba: c.first_lba,
        lbas: c.lbas,
        blocks_per_io: c.blocks_per_io,
        queues: c.queues,
        depth: c.depth,
        qd: c.qd,
        ios: c.ios,
        runtime: c.runtime,
        seed: c.seed,
        read_only: c.read_only,
    };
    if !opts.read_only && !c.force {
        refuse_if_it_holds_data(socket, &opts.controller, opts.nsid)?;
    }
    if c.gpu {
        drop(conn);
        anyhow::ensure!(
            !c.no_verify || c.read_only,
            "--no-verify is for --read-only runs: a write pass is always followed by checked reads"
        );
        return gpu_check(socket, &c.gpu_id, !c.no_verify, opts, json);
    }
    let c_read_only = opts.read_only;
    let r = gpunvme_serve_client::check::run(&conn, &opts)?;
    let secs = r.io_us as f64 / 1e6;
    if json {
        outln!(
            "{}",
            serde_json::json!({
                "ios": r.ios,
                "bytes": r.bytes,
                "errors": r.errors,
                "mismatched_bytes": r.mismatched_bytes,
                "first_error": r.first_error,
                "connect_us": connect_us,
                "setup_us": r.setup_us,
                "io_seconds": secs,
                "iops": if secs > 0.0 { r.ios as f64 / secs } else { 0.0 },
                "bytes_per_sec": if secs > 0.0 { r.bytes as f64 / secs } else { 0.0 },
                "read_only": c_read_only,
            })
        );
    } else {
        outln!(
            "served check: {} I/Os, {} bytes, {} errors, {} bytes mismatched; connect {} us, \
             queues ready {} us later, {:.3} s of I/O",
            r.ios,
            r.bytes,
            r.errors,
            r.mismatched_bytes,
            connect_us,
            r.setup_us,
            secs
        );
    }
    if r.errors > 0 || r.mismatched_bytes > 0 {
        return Err(cli_refusal(format!(
            "served check failed: {} errors, {} bytes mismatched; first: {}",
            r.errors,
            r.mismatched_bytes,
            r.first_error.unwrap_or_default()
        )));
    }
    Ok(())
}

/// `serve check --gpu`: the check from GPU threads ([`gpunvme_cli::perf::served`]).
fn gpu_check(
    socket: &std::path::Path,
    gpu_id: &gpunvme::gpu_queues::GpuId,
    verify: bool,
    opts: gpunvme_serve_client::check::CheckOptions,
    json: bool,
) -> Result<()> {
    anyhow::ensure!(
        opts.first_lba == 0,
        "serve check --gpu covers LBAs from 0 (--lbas sets how many): --first-lba {} is for \
         CPU checks",
        opts.first_lba
    );
    let name = format!("gpunvme serve check --gpu (pid {})", std::process::id());
    let t0 = std::time::Instant::now();
    let served = gpunvme::served::ServedController::connect(socket, Some(&opts.controller), &name)?;
    let connect_us = t0.elapsed().as_micros() as u64;
    let cuda = gpunvme::gpu_fs::open_gpu(gpu_id)?;
    let lba = served
        .info()
        .namespace(opts.nsid)
        .map(|n| n.lba_size)
        .with_context(|| format!("namespace {} is not served", opts.nsid))?;
    let g = crate::perf::served::GpuCheckOptions {
        nsid: opts.nsid,
        lbas: opts.lbas,
        bs: opts.blocks_per_io * lba,
        queues: opts.queues,
        depth: opts.depth,
        qd: opts.qd,
        ios: opts.ios,
        runtime: opts.runtime,
        seed: opts.seed,
        read_only: opts.read_only,
        verify,
    };
    let r = crate::perf::served::gpu_check(&served, &cuda, &g)?;
    if json {
        let mut v = serde_json::to_value(&r)?;
        v["connect_us"] = connect_us.into();
        outln!("{v}");
    } else {
        for p in r.write.iter().chain([&r.read]) {
            outln!(
                "served GPU check ({}, {} queues x {}): {} {} I/Os, {} errors, {} mismatched, \
                 {:.3} s, {:.2} GB/s",
                r.gpu,
                r.queues,
                r.depth,
                p.pattern,
                p.ios,
                p.errors,
                p.mismatches,
                p.seconds,
                p.bytes_per_sec / 1e9
            );
        }
        outln!(
            "connect {connect_us} us, GPU queues ready {} us later",
            r.setup_us
        );
    }
    if !r.clean() {
        let first = r
            .write
            .iter()
            .chain([&r.read])
            .find_map(|p| p.first_error.clone())
            .unwrap_or_default();
        return Err(cli_refusal(format!("served GPU check failed: {first}")));
    }
    Ok(())
}

fn cli_refusal(msg: String) -> anyhow::Error {
    super::Refusal(msg).into()
}

/// Refuses a check that would write over a blockfs or a volume member on `controller`'s
/// namespace `nsid`, as every raw-LBA writer of the CLI does ([`super::fs::holds_on`]),
/// looking through a served block device of its own (a connection and a queue pair, given
/// back before the check starts).
fn refuse_if_it_holds_data(socket: &std::path::Path, controller: &str, nsid: u32) -> Result<()> {
    let name = format!("gpunvme serve check probe (pid {})", std::process::id());
    let served = gpunvme::served::ServedController::connect(socket, Some(controller), &name)?;
    let dev = std::sync::Arc::new(served.block_device(nsid)?);
    if let Some(found) = super::fs::holds_on(dev, nsid)? {
        return Err(super::Refusal(format!(
            "{controller}: namespace {nsid} holds {found}; serve check would overwrite it (use \
             another device, or --force to destroy it)"
        ))
        .into());
    }
    Ok(())
}
