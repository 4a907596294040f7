//! `gpunvme`, the command: identify, raw namespace I/O, perf (CPU and GPU queues) and file
//! operations (CPU and GPU) on an NVMe controller reached through VFIO or the built-in software
//! controller. It parses and prints; the logic lives in the `gpunvme` library and the crates
//! below it.

use std::path::PathBuf;
use std::process::ExitCode;

use anyhow::{Context, Result};
use clap::{Parser, Subcommand, ValueEnum};
use gpunvme::open::{
    DEFAULT_IMAGE, DeviceSpec, MissingImage, OpenOptions, PERF_DEFAULT_IMAGE,
    open_controller_and_transport,
};
use gpunvme::units::{parse_duration, parse_size};
use gpunvme_cli::perf::{self, PerfConfig, RwMode, Stop};

mod cli;

/// Userspace NVMe driver: talk to an SSD bound to vfio-pci, or to the built-in software
/// controller over an image file.
#[derive(Parser, Debug)]
#[command(name = "gpunvme", version, about)]
struct Args {
    /// The controller: a PCI address bound to vfio-pci (0000:01:00.0), or an image file served
    /// by the software controller. Default: ./gpunvme.img (perf: ./gpunvme-perf.img, its own
    /// scratch image), created by the first command that writes (1 GiB, sparse). Several
    /// (repeated, or comma-separated): a striped volume for `fs` (without --gpu), the same job
    /// on every controller at once for `perf` (without --gpu), each controller for `identify`.
    #[arg(long, global = true, value_name = "SPEC", value_delimiter = ',')]
    device: Vec<String>,

    /// Print machine-readable JSON instead of text.
    #[arg(long, global = true)]
    json: bool,

    /// LBA size of the namespace the software controller makes of an image (512 or 4096).
    /// Images are raw and do not record it: use the same value every time.
    #[arg(long, global = true, default_value_t = 512, value_name = "BYTES")]
    lba_size: u32,

    /// Threads of the software controller serving I/O queues (0..=64; 0: automatic, a quarter
    /// of the CPUs, 1 to 4). Ignored for a PCI device. The count in use is shown as part of the
    /// device description (`identify`, and `data_path` in `perf`).
    #[arg(long, global = true, default_value_t = 0, value_name = "N")]
    controller_threads: usize,

    /// I/O queue pairs the software controller grants (1..=1024; default 8, and 64 for `fs
    /// get/put --gpu` and for GPU commands served by the GPU-resident controller model
    /// (`--controller gpu`): a queue is served by one controller thread or warp, so few queues
    /// leave most of them idle). Ignored for a PCI device.
    #[arg(long, global = true, value_name = "N")]
    controller_queue_pairs: Option<u16>,

    #[command(subcommand)]
    command: Command,
}

#[derive(Subcommand, Debug)]
enum Command {
    /// Show the controller and its namespaces.
    Identify,
    /// Show the controller's Error Information log (log page 01h), or with --smart its SMART /
    /// Health Information (02h).
    Log {
        /// SMART / Health Information instead of the error log.
        #[arg(long)]
        smart: bool,
    },
    /// Write a file's bytes to a namespace (the length must be whole LBAs), streamed in
    /// pieces of at most 4 MiB.
    Write {
        /// Namespace id.
        #[arg(long, default_value_t = 1)]
        nsid: u32,
        /// First LBA.
        #[arg(long)]
        lba: u64,
        /// File to write.
        #[arg(long)]
        input: PathBuf,
        /// Write even if the namespace holds a blockfs or belongs to a striped volume,
        /// destroying it.
        #[arg(long)]
        force: bool,
    },
    /// Read bytes from a namespace into a file (the length must be whole LBAs), streamed in
    /// pieces of at most 4 MiB.
    Read {
        /// Namespace id.
        #[arg(long, default_value_t = 1)]
        nsid: u32,
        /// First LBA.
        #[arg(long)]
        lba: u64,
        /// Bytes to read (e.g. 4096, 4k, 1m).
        #[arg(long, value_parser = parse_size)]
        bytes: u64,
        /// File to create (`-` for standard output).
        #[arg(long)]
        output: PathBuf,
    },
    /// Measure IOPS, bandwidth and latency, fio-style (one thread per queue).
    Perf(PerfArgs),
    /// Run the GPU queue protocol (ptx/include/gpunvme.cuh) from CPU threads on queues whose rings
    /// this command allocates: write, read back and check LBA-stamped data; fails on any error.
    /// Refuses a namespace holding a blockfs or a volume member without --force.
    ProtocolCheck(cli::protocol::ProtocolCheckArgs),
    /// Where the NVIDIA GPUs and NVMe controllers sit on PCIe: the path class of every pair
    /// (PIX, PXB, PHB, NODE, SYS, as `nvidia-smi topo -m`), read from sysfs; opens no device.
    Topology {
        /// The sysfs root to read (tests point it at a fake tree).
        #[arg(long, default_value = "/sys", hide = true)]
        sys_root: std::path::PathBuf,
    },
    /// List the subsystems an NVMe/TCP target's discovery controller reports (TARGET:
    /// nvme-tcp://HOST[:PORT], port 4420 by default), each with the --device spec that opens
    /// it; opens no device.
    Discover {
        /// The target, e.g. nvme-tcp://192.0.2.7:4420.
        target: String,
    },
    /// Run the daemon that owns the --device images' controllers and lends their I/O queue
    /// pairs to client processes over a Unix socket (`serve status` asks a running one).
    Serve(cli::serve::ServeArgs),
    /// Image files for the software controller (`image create PATH --size 4G`).
    Image {
        #[command(subcommand)]
        cmd: cli::image::ImageCommand,
    },
    /// File operations on blockfs.
    Fs {
        /// Namespace holding the file system.
        #[arg(long, default_value_t = 1)]
        nsid: u32,
        #[command(subcommand)]
        cmd: cli::fs::FsCommand,
    },
}

impl Command {
    /// The I/O queue pairs the software controller grants when `--controller-queue-pairs` is
    /// not given: more for GPU file commands, whose batches spread over every queue, and for
    /// the GPU-resident controller model, which serves each queue from one controller lane
    /// (few queues leave most lanes idle). On the software controller a queue is served by one
    /// thread: 8 pairs (7 for the GPU) would keep 9 of 16 threads idle.
    fn default_queue_pairs(&self) -> u16 {
        let many = match self {
            Command::Perf(p) => p.gpu && p.controller == ControllerArg::Gpu,
            Command::Fs { cmd, .. } => cmd.on_gpu(),
            _ => false,
        };
        if many {
            gpunvme::gpu_fs::MODEL_QUEUE_PAIRS
        } else {
            OpenOptions::default().controller_queue_pairs
        }
    }

    /// Whether the command only reads the device: it then opens an image read-only under a
    /// shared lock (docs/cli.md, "One process per device").
    fn is_read_only(&self) -> bool {
        match self {
            Command::Identify | Command::Log { .. } | Command::Read { .. } => true,
            Command::Write { .. } | Command::ProtocolCheck(_) => false,
            Command::Perf(p) => !p.rw.is_write() && !p.verify,
            Command::Fs { cmd, .. } => cmd.is_read_only(),
            Command::Image { .. }
            | Command::Topology { .. }
            | Command::Discover { .. }
            | Command::Serve(_) => false,
        }
    }

    /// The host file the command writes its output to, if any.
    fn output_path(&self) -> Option<&std::path::Path> {
        match self {
            Command::Read { output, .. } => Some(output),
            Command::Fs { cmd, .. } => cmd.output_path(),
            _ => None,
        }
    }
}

#[derive(clap::Args, Debug)]
struct PerfArgs {
    /// Access pattern.
    #[arg(long, value_enum, default_value = "randread")]
    rw: RwMode,
    /// Bytes per I/O.
    #[arg(long, default_value = "4k", value_parser = parse_size)]
    bs: u64,
    /// I/Os in flight per queue.
    #[arg(long, default_value_t = 32)]
    qd: usize,
    /// I/O queue pairs (CPU: one thread each, default 1; --gpu: GPU queues, default every
    /// queue the controller grants beyond --cpu-queues).
    #[arg(long)]
    queues: Option<usize>,
    /// Run for this long (e.g. 10s, 500ms).
    #[arg(long, value_parser = parse_duration, conflicts_with = "ios")]
    runtime: Option<std::time::Duration>,
    /// Run this many I/Os in total (at least 1). Default when neither is given: --runtime 5s.
    #[arg(long, value_parser = clap::value_parser!(u64).range(1..))]
    ios: Option<u64>,
    /// Write known patterns and check every byte read.
    #[arg(long)]
    verify: bool,
    /// Namespace id.
    #[arg(long, default_value_t = 1)]
    nsid: u32,
    /// Bytes of the namespace (from LBA 0) to touch. Default: the whole namespace, at most 1 GiB.
    #[arg(long, value_parser = parse_size)]
    size: Option<u64>,
    /// Seed for offsets and patterns (default: fresh each run).
    #[arg(long)]
    seed: Option<u64>,
    /// Issue the I/O from GPU threads on queues in GPU memory (needs an NVIDIA GPU).
    #[arg(long)]
    gpu: bool,
    /// Which GPU: a CUDA ordinal (0, 1, ...; as CUDA_VISIBLE_DEVICES numbers them), a UUID
    /// (GPU-..., as `nvidia-smi -L` prints it; a unique leading part will do), a PCI address
    /// (0000:3b:00.0), or `all`: the job on every GPU at once, each with its own queue pairs
    /// (an even share of the controller's; --queues is then per GPU), a report per GPU and
    /// totals.
    #[arg(long, default_value = "0", value_parser = parse_gpu_selection, requires = "gpu")]
    gpu_id: gpunvme::gpu_queues::GpuSelection,
    /// GPU threads in all, one command in flight each (default: --qd per GPU queue).
    #[arg(long, requires = "gpu")]
    gpu_threads: Option<usize>,
    /// How GPU threads submit: `warp` (one atomic and one doorbell per warp; needs --qd a
    /// multiple of --warp-lanes, else per thread), `thread` (BaM-style) or `lone` (per thread, one
    /// thread per warp).
    #[arg(long, value_enum, default_value = "warp", requires = "gpu")]
    client: ClientArg,
    /// With `--client warp`: lanes of each warp that issue (1 to 32; --qd a multiple of it),
    /// so that --qd / N warps share each queue and one submits while another waits. Default:
    /// the fewest warps, at least two, that split --qd evenly (QD 32: two warps of 16; QD 64
    /// and deeper: warps of 32); where that leaves one lane per warp (QD 1, 2), thread clients.
    #[arg(long, value_parser = clap::value_parser!(u32).range(1..=32), requires = "gpu")]
    warp_lanes: Option<u32>,
    /// CPU queues running the same job on the same controller at the same time.
    #[arg(long, default_value_t = 0, requires = "gpu")]
    cpu_queues: usize,
    /// Entries per GPU ring (rounded down to a power of two; default: the controller's
    /// maximum, at most 1024).
    #[arg(long, requires = "gpu")]
    gpu_depth: Option<u32>,
    /// SMs reserved (green context) for the software controller's copy kernels, or for the
    /// GPU-resident controller (--controller gpu).
    #[arg(long, default_value_t = 8, requires = "gpu")]
    controller_sms: u32,
    /// Who serves the GPU queues: `emu`, the software controller's threads, or `gpu`, the
    /// GPU-resident controller model (a persistent kernel on --controller-sms SMs).
    #[arg(long, value_enum, default_value = "emu", requires = "gpu")]
    controller: ControllerArg,
    /// Media of the GPU-resident controller: `hbm` (the image loaded into GPU memory, written
    /// back at the end), `host` (the image file mapped and registered with CUDA, read and
    /// written over PCIe; writable only on tmpfs, e.g. /dev/shm) or `null` (no data moves: the
    /// protocol ceiling).
    #[arg(long, value_enum, default_value = "hbm", requires = "gpu")]
    media: MediaArg,
    /// SSD timing model of the GPU-resident controller's namespaces (--controller gpu), e.g.
    /// `read_us=80,write_us=20,iops=1M,bw=7GB/s,drives=4,stripe=128k`: per drive a fixed read
    /// and write latency after service, IOPS and bandwidth caps, drives striped by LBA. A
    /// model, printed with every result; keys left out keep those defaults (drives=1).
    #[arg(long, requires = "gpu", value_parser = parse_ssd_model)]
    ssd_model: Option<gpunvme::gpu_emu::SsdModel>,
    /// Run a write pattern or --verify (which writes its patterns first) even on a namespace
    /// that holds a blockfs, destroying it.
    #[arg(long)]
    force: bool,
}

#[derive(ValueEnum, Clone, Copy, Debug, PartialEq, Eq)]
enum ControllerArg {
    Emu,
    Gpu,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum MediaArg {
    Null,
    Hbm,
    Host,
}

#[derive(ValueEnum, Clone, Copy, Debug)]
enum ClientArg {
    Warp,
    Thread,
    Lone,
}

/// `--gpu-id`'s value (gpu_queues::gpus: ordinal, UUID, PCI address, `all`).
fn parse_gpu_selection(s: &str) -> Result<gpunvme::gpu_queues::GpuSelection, String> {
    s.parse()
        .map_err(|e: gpunvme::gpu_queues::GpuError| e.to_string())
}

/// `--ssd-model`'s value (gpu_emu::ssd_model: keys, units and defaults).
fn parse_ssd_model(s: &str) -> Result<gpunvme::gpu_emu::SsdModel, String> {
    s.parse()
}

fn main() -> ExitCode {
    let args = match Args::try_parse() {
        Ok(a) => a,
        Err(e) => {
            use clap::error::ErrorKind;
            let json = std::env::args_os().any(|a| a == "--json");
            if json && !matches!(e.kind(), ErrorKind::DisplayHelp | ErrorKind::DisplayVersion) {
                let msg = e.kind().as_str().unwrap_or("invalid command line");
                print_json_error(&cli::json_error("usage", msg));
            }
            e.exit();
        }
    };
    tracing_subscriber::fmt()
        .with_writer(std::io::stderr)
        .with_env_filter(
            tracing_subscriber::EnvFilter::try_from_default_env()
                .unwrap_or_else(|_| tracing_subscriber::EnvFilter::new("warn")),
        )
        .init();
    let json = args.json;
    let result = run(args).and_then(|()| {
        use std::io::Write as _;
        std::io::stdout()
            .flush()
            .map_err(|e| cli::StdoutError(e).into())
    });
    match result {
        Ok(()) if INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) => ExitCode::from(130),
        Ok(()) => ExitCode::SUCCESS,
        Err(e) => {
            // The reader of our output went away (`| head`): a normal end.
            if cli::stdout_error(&e).is_some_and(cli::StdoutError::is_broken_pipe) {
                return ExitCode::SUCCESS;
            }
            let message = cli::escape(&format!("{e:#}")).into_owned();
            if json {
                print_json_error(&cli::json_error(cli::error_kind(&e), &message));
            }
            use std::io::Write as _;
            let _ = writeln!(std::io::stderr(), "gpunvme: error: {message}");
            if INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) {
                ExitCode::from(130)
            } else {
                ExitCode::FAILURE
            }
        }
    }
}

/// Set by the first Ctrl-C during `perf`, which then stops issuing I/O and reports what it
/// measured; a second one ends the process.
static INTERRUPTED: std::sync::atomic::AtomicBool = std::sync::atomic::AtomicBool::new(false);

/// Prints an error object on standard output, where `--json` output goes (best effort: the
/// text line on standard error follows anyway).
fn print_json_error(v: &serde_json::Value) {
    use std::io::Write as _;
    let _ = writeln!(std::io::stdout(), "{v}");
    let _ = std::io::stdout().flush();
}

fn run(args: Args) -> Result<()> {
    anyhow::ensure!(
        args.lba_size == 512 || args.lba_size == 4096,
        "--lba-size must be 512 or 4096, not {}",
        args.lba_size
    );
    let controller_queue_pairs = args
        .controller_queue_pairs
        .unwrap_or_else(|| args.command.default_queue_pairs());
    anyhow::ensure!(
        (1..=1024).contains(&controller_queue_pairs),
        "--controller-queue-pairs must be 1 to 1024, not {controller_queue_pairs}"
    );
    if let Command::Perf(p) = &args.command {
        // clap refuses --ios 0 and --runtime 0s alike, as invalid values.
        anyhow::ensure!(p.qd >= 1, "--qd must be at least 1");
        // Ctrl-C stops the run and prints what it measured; a second one ends the process.
        // Installed before the device is opened, so it is in place whenever the run is.
        let _ = ctrlc::set_handler(|| {
            if INTERRUPTED.swap(true, std::sync::atomic::Ordering::Relaxed) {
                std::process::exit(130);
            }
        });
    }
    if let Command::Discover { target } = &args.command {
        anyhow::ensure!(
            args.device.is_empty(),
            "`discover` names its target itself and opens no device: drop --device"
        );
        return cli::discover::run(target, args.json);
    }
    if let Command::Topology { sys_root } = &args.command {
        anyhow::ensure!(
            args.device.is_empty(),
            "`topology` reads sysfs and opens no device: drop --device"
        );
        return cli::topology::run(sys_root, args.json);
    }
    if let Command::Serve(serve) = args.command {
        let open = OpenOptions {
            lba_size: args.lba_size,
            controller_threads: args.controller_threads,
            controller_queue_pairs,
            ..Default::default()
        };
        return cli::serve::run(serve, &args.device, open, args.json);
    }
    if let Command::Image { cmd } = args.command {
        anyhow::ensure!(
            args.device.is_empty(),
            "`image` commands take the image's path as their argument, not --device"
        );
        return cli::image::run(cmd, args.lba_size, args.json);
    }
    if args.device.len() > 1 {
        return run_volume(args, controller_queue_pairs);
    }
    let spec = DeviceSpec::parse(args.device.first().map(String::as_str))?;
    let opts = OpenOptions {
        lba_size: args.lba_size,
        controller_threads: args.controller_threads,
        controller_queue_pairs,
        read_only: args.command.is_read_only(),
        default_image: match args.command {
            Command::Perf(_) => PERF_DEFAULT_IMAGE,
            _ => DEFAULT_IMAGE,
        }
        .into(),
        ..Default::default()
    };
    if let Some(out) = args.command.output_path()
        && spec.is_own_image(&opts, out)
    {
        return Err(cli::Refusal(format!(
            "{} is the device's own image file: writing the output there would destroy it",
            out.display()
        ))
        .into());
    }
    if let Command::Write {
        nsid, ref input, ..
    } = args.command
        && spec == DeviceSpec::DefaultImage
        && !opts.default_image.exists()
    {
        // Before the default image is created, so a write that cannot work creates none.
        check_write_input(input, nsid, args.lba_size)?;
    }
    if let (DeviceSpec::Served(served), Command::Fs { nsid, cmd }) = (&spec, &args.command) {
        return cli::fs::run_served(served, *nsid, cmd.clone(), args.json);
    }
    let perf = matches!(args.command, Command::Perf(_));
    let (ctrl, backend) = open_controller_and_transport(&spec, &opts)
        .map_err(|e| MissingImage::explain(e, |m| missing_image_hint(m, perf)))?;
    let result = match args.command {
        Command::Identify => cli::identify::run(&ctrl, args.json),
        Command::Write {
            nsid,
            lba,
            input,
            force,
        } => cli::fs::refuse_raw_write(&ctrl, nsid, "write", force, None)
            .and_then(|()| cli::io::write(&ctrl, nsid, lba, &input, args.json)),
        Command::Read {
            nsid,
            lba,
            bytes,
            output,
        } => cli::io::read(&ctrl, nsid, lba, bytes, &output, args.json),
        Command::Perf(p) => (|| {
            refuse_perf_over_a_file_system(&ctrl, &p, None)?;
            let cfg = perf_config(&p)?;
            if p.gpu {
                let gargs = gpu_perf_args(&p, cfg);
                if p.gpu_id == gpunvme::gpu_queues::GpuSelection::All {
                    let gpus = p.gpu_id.open().context("--gpu-id all")?;
                    return perf::run_on_gpus(&ctrl, &backend, &gpus, &gargs)
                        .and_then(|report| cli::perf::print_several_gpu(&report, args.json));
                }
                gpunvme_cli::perf::gpu::run(&ctrl, &backend, &gargs)
                    .and_then(|report| cli::perf::print_gpu(&report, args.json))
            } else {
                let result = perf::run(&ctrl, &cfg)
                    .map_err(anyhow::Error::from)
                    .and_then(|report| cli::perf::print(&report, args.json));
                if INTERRUPTED.load(std::sync::atomic::Ordering::Relaxed) {
                    use std::io::Write as _;
                    let _ = writeln!(
                        std::io::stderr(),
                        "gpunvme: interrupted: the numbers cover the I/Os done before Ctrl-C"
                    );
                }
                result
            }
        })(),
        Command::ProtocolCheck(p) => {
            cli::fs::refuse_raw_write(&ctrl, p.nsid, "protocol-check", p.force, None)
                .and_then(|()| cli::protocol::run(&ctrl, &p, args.json))
        }
        Command::Log { smart } => cli::log::run(&ctrl, smart, args.json),
        Command::Fs { nsid, cmd } => cli::fs::run(&ctrl, &backend, nsid, cmd, args.json),
        Command::Image { .. }
        | Command::Topology { .. }
        | Command::Discover { .. }
        | Command::Serve(_) => Err(anyhow::anyhow!(
            "internal error: an image command reached a device"
        )),
    };
    // A write the host refused (a full host file system) is named for its cause.
    let result = result.map_err(|e| cli::explain_host_error(e, [&backend]));
    // Shut the controller down in order whatever happened, but report the command's error first.
    let shutdown = ctrl.shutdown().context("shutting the controller down");
    result.and(shutdown)
}

/// What `write` can check of its input before the default image is created for it:
/// it is readable, and a regular file's length is whole LBAs of the image's namespace 1 (the
/// only one an image has). The same words as the checks after opening.
fn check_write_input(input: &std::path::Path, nsid: u32, lba_size: u32) -> Result<()> {
    let meta = std::fs::metadata(input).with_context(|| format!("reading {}", input.display()))?;
    if nsid != 1 {
        anyhow::bail!("namespace {nsid} does not exist (an image has namespace 1 only)");
    }
    if meta.is_file() {
        let len = meta.len();
        anyhow::ensure!(len > 0, "nothing to transfer: the length is 0 bytes");
        anyhow::ensure!(
            len % u64::from(lba_size) == 0,
            "length {len} bytes is not a whole number of namespace {nsid}'s {lba_size}-byte LBAs"
        );
    }
    Ok(())
}

/// How to make a missing image, in the CLI's terms: the default image is made by a command
/// that writes (for `perf`, its own scratch image, by a run that writes), a named one by
/// `gpunvme image create`.
fn missing_image_hint(m: &MissingImage, perf: bool) -> String {
    let path = m.path.display();
    if m.default && perf {
        format!(
            "a perf run that writes creates it: `gpunvme perf --rw randwrite` or `--verify`; or \
             `gpunvme image create {path} --size 1G`"
        )
    } else if m.default {
        "commands that write create it, e.g. `gpunvme fs mkfs`".into()
    } else {
        format!(
            "create it with `gpunvme image create {path} --size 1G`, or omit --device to use \
             ./{DEFAULT_IMAGE}"
        )
    }
}

/// The GPU job that `perf --gpu`'s arguments describe, around the CPU engine's `cfg`.
fn gpu_perf_args(p: &PerfArgs, cfg: PerfConfig) -> gpunvme_cli::perf::gpu::GpuPerfArgs {
    gpunvme_cli::perf::gpu::GpuPerfArgs {
        perf: cfg,
        gpu_threads: p.gpu_threads,
        style: match p.client {
            ClientArg::Warp => gpunvme_cli::perf::kernel::ClientStyle::Warp,
            ClientArg::Thread => gpunvme_cli::perf::kernel::ClientStyle::Thread,
            ClientArg::Lone => gpunvme_cli::perf::kernel::ClientStyle::Lone,
        },
        warp_lanes: p.warp_lanes,
        cpu_queues: p.cpu_queues,
        depth: p.gpu_depth,
        controller_sms: p.controller_sms,
        model: (p.controller == ControllerArg::Gpu).then_some(match p.media {
            MediaArg::Null => gpunvme::gpu_emu::MediaKind::Null,
            MediaArg::Hbm => gpunvme::gpu_emu::MediaKind::Hbm,
            MediaArg::Host => gpunvme::gpu_emu::MediaKind::Host,
        }),
        ssd_model: p.ssd_model,
        model_group: None,
        gpu: match &p.gpu_id {
            gpunvme::gpu_queues::GpuSelection::One(id) => id.clone(),
            gpunvme::gpu_queues::GpuSelection::All => gpunvme::gpu_queues::GpuId::default(),
        },
        fill: true,
    }
}

/// The CPU engine's job that `perf`'s arguments describe.
fn perf_config(p: &PerfArgs) -> Result<PerfConfig> {
    Ok(PerfConfig {
        rw: p.rw,
        bs: usize::try_from(p.bs).context("--bs is too large")?,
        qd: p.qd,
        queues: p.queues.unwrap_or(if p.gpu { 0 } else { 1 }),
        stop: match (p.runtime, p.ios) {
            (_, Some(n)) => Stop::Ios(n),
            (Some(d), None) => Stop::Runtime(d),
            (None, None) => Stop::Runtime(std::time::Duration::from_secs(5)),
        },
        verify: p.verify,
        nsid: p.nsid,
        size: p.size,
        seed: p.seed,
        interrupt: Some(&INTERRUPTED),
    })
}

/// Refuses a `perf` that writes (a write mode, or `--verify`'s pattern) over a blockfs file
/// system or a volume member without `--force` ([`cli::fs::refuse_raw_write`]); `device`
/// names the device when there are several.
fn refuse_perf_over_a_file_system(
    ctrl: &nvme::Controller,
    p: &PerfArgs,
    device: Option<&str>,
) -> Result<()> {
    if !(p.rw.is_write() || p.verify) {
        return Ok(());
    }
    let what = if p.verify {
        "perf --verify"
    } else {
        "perf in a write mode"
    };
    cli::fs::refuse_raw_write(ctrl, p.nsid, what, p.force, device)
}

/// Several --device: `identify` of each controller, `perf` on every one at once, or `fs` on a
/// striped volume; one controller per device (each under its own lock), shut down in order
/// whatever happened.
fn run_volume(args: Args, controller_queue_pairs: u16) -> Result<()> {
    enum Several {
        Identify,
        Perf(Box<PerfArgs>),
        Fs(u32, cli::fs::FsCommand),
    }
    let read_only = args.command.is_read_only();
    let job = match args.command {
        Command::Fs { nsid, cmd } => Several::Fs(nsid, cmd),
        Command::Identify => Several::Identify,
        Command::Perf(p) => Several::Perf(Box::new(p)),
        _ => {
            return Err(cli::Refusal(
                "several --device: only `identify`, `perf` and `perf --gpu` (each controller at \
                 once) and `fs` (a striped volume) take them so far"
                    .into(),
            )
            .into());
        }
    };
    let opts = OpenOptions {
        lba_size: args.lba_size,
        controller_threads: args.controller_threads,
        controller_queue_pairs,
        read_only,
        ..Default::default()
    };
    let cmd = match &job {
        Several::Fs(_, cmd) => Some(cmd),
        _ => None,
    };
    let specs = args
        .device
        .iter()
        .map(|d| DeviceSpec::parse(Some(d)))
        .collect::<gpunvme::Result<Vec<_>>>()?;
    if let Some(out) = cmd.as_ref().and_then(|c| c.output_path())
        && let Some(s) = specs.iter().find(|s| s.is_own_image(&opts, out))
    {
        return Err(cli::Refusal(format!(
            "{} is a device's own image file ({s:?}): writing the output there would destroy it",
            out.display()
        ))
        .into());
    }
    let mut ctrls = Vec::with_capacity(specs.len());
    let mut backends = Vec::with_capacity(specs.len());
    for (spec, name) in specs.iter().zip(&args.device) {
        match open_controller_and_transport(spec, &opts)
            .map_err(|e| MissingImage::explain(e, |m| missing_image_hint(m, false)))
        {
            Ok((c, b)) => {
                ctrls.push(c);
                backends.push(b);
            }
            Err(e) => {
                for c in ctrls {
                    let _ = c.shutdown();
                }
                return Err(anyhow::Error::from(e).context(format!("opening --device {name}")));
            }
        }
    }
    let result = match job {
        Several::Fs(nsid, cmd) => {
            cli::fs::run_volume(&ctrls, &backends, &args.device, nsid, cmd, args.json)
        }
        Several::Identify => cli::identify::run_all(&ctrls, args.json),
        Several::Perf(p) => (|| {
            for (c, name) in ctrls.iter().zip(&args.device) {
                refuse_perf_over_a_file_system(c, &p, Some(name))?;
            }
            let cfg = perf_config(&p)?;
            if p.gpu {
                let pairs: Vec<_> = ctrls.iter().zip(&backends).collect();
                let gargs = gpu_perf_args(&p, cfg);
                let report = if p.gpu_id == gpunvme::gpu_queues::GpuSelection::All {
                    let gpus = p.gpu_id.open().context("--gpu-id all")?;
                    perf::run_gpus_on_controllers(
                        &pairs,
                        &args.device,
                        &gpus,
                        &gargs,
                        std::path::Path::new("/sys"),
                    )?
                } else {
                    perf::run_several_gpu(&pairs, &args.device, &gargs)?
                };
                return cli::perf::print_several_gpu(&report, args.json);
            }
            let refs: Vec<&nvme::Controller> = ctrls.iter().collect();
            let report = perf::run_several(&refs, &args.device, &cfg)?;
            cli::perf::print_several(&report, args.json)
        })(),
    };
    let result = result.map_err(|e| cli::explain_host_error(e, &backends));
    let mut shutdown = Ok(());
    for (c, name) in ctrls.into_iter().zip(&args.device) {
        let r = c
            .shutdown()
            .with_context(|| format!("shutting the controller of {name} down"));
        if shutdown.is_ok() {
            shutdown = r;
        }
    }
    result.and(shutdown)
}

#[cfg(test)]
mod tests {
    use super::{Args, Parser};

    fn default_pairs(argv: &[&str]) -> (Option<u16>, u16) {
        let args = Args::try_parse_from(argv).expect("arguments");
        (
            args.controller_queue_pairs,
            args.command.default_queue_pairs(),
        )
    }

    #[test]
    fn commands_on_the_gpu_controller_default_to_more_queue_pairs() {
        let model = gpunvme::gpu_fs::MODEL_QUEUE_PAIRS;
        let emu = gpunvme::open::OpenOptions::default().controller_queue_pairs;
        assert!(model > emu);
        for (argv, want) in [
            (&["gpunvme", "perf"][..], emu),
            (&["gpunvme", "perf", "--gpu"][..], emu),
            (
                &["gpunvme", "perf", "--gpu", "--controller", "gpu"][..],
                model,
            ),
            (&["gpunvme", "fs", "get", "a", "out"][..], emu),
            (&["gpunvme", "fs", "get", "--gpu", "a"][..], model),
            (
                &["gpunvme", "fs", "get", "--gpu", "a", "--controller", "gpu"][..],
                model,
            ),
            (
                &[
                    "gpunvme",
                    "fs",
                    "put",
                    "--gpu",
                    "in",
                    "a",
                    "--controller",
                    "gpu",
                ][..],
                model,
            ),
            (&["gpunvme", "identify"][..], emu),
        ] {
            assert_eq!(default_pairs(argv), (None, want), "{argv:?}");
        }
        // Given explicitly, the flag wins.
        let args = Args::try_parse_from([
            "gpunvme",
            "--controller-queue-pairs",
            "3",
            "perf",
            "--gpu",
            "--controller",
            "gpu",
        ])
        .expect("arguments");
        assert_eq!(args.controller_queue_pairs, Some(3));
    }
}
