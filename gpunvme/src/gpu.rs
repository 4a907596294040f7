//! Bringing GPU queues up on an opened controller, shared by `perf --gpu` and `fs get/put
//! --gpu`: the transport (software-controller, or vfio-p2p / host-memory over VFIO) chosen at
//! run time, or the GPU-resident controller model in the software controller's place; the line
//! saying which ran; and the watchdog that aborts device-side waits when the controller dies.

use std::sync::Arc;

use crate::error::{Context, Result, bail};
use gpu_emu::resident::NamespaceSpec;
use gpu_emu::{
    GpuController, GpuControllerOptions, GpuQueuesExt, GroupMember, MediaKind, SsdModel,
};
use gpu_queues::transport::{self, TransportOptions};
use gpu_queues::{Cuda, GpuQueueOptions, GpuQueues};
use nvme::Controller;

use crate::open::Backend;

/// GPU queues and, for the model, the controller serving them. Field order is drop order: the
/// queues are deleted before the model stops.
pub struct GpuSetup {
    /// The queues.
    pub queues: GpuQueues,
    /// The GPU-resident controller model, when it serves them.
    pub model: Option<Arc<GpuController>>,
    /// Which transport (or the model) carries doorbells and data, in words.
    pub transport: String,
    /// The PCIe path class between the GPU and the controller, where both have a place on PCIe
    /// (a real controller behind VFIO); `None` for images and vfio-user sockets.
    pub path: Option<gpu_queues::transport::topology::PathClass>,
}

/// Which controller serves GPU queues.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Serving {
    /// The device's own: the software controller's threads (software-controller), or a
    /// real SSD through VFIO (vfio-p2p, host-memory).
    Device,
    /// The GPU-resident controller model with this media, in the software controller's place.
    Model(MediaKind),
}

/// The GPU split once for `n` GPU-resident models started together, one per controller, each
/// on `controller_sms` SMs of its own ([`gpu_emu::ModelGroup`]; the SMs left over shared by
/// every controller's clients): one member each, for [`start_model`].
pub fn model_group(cuda: &Arc<Cuda>, n: usize, controller_sms: u32) -> Result<Vec<GroupMember>> {
    let n = u32::try_from(n).context("controllers")?;
    gpu_emu::ModelGroup::split(cuda, n, controller_sms)
        .with_context(|| format!("splitting the GPU's SMs for {n} GPU-resident controller models"))
}

/// Which GPUs drive which controllers when several GPUs work on several controllers at once
/// ([`pair_gpus`]).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct GpuPairing {
    /// (GPU index, controller index) pairs, in GPU then controller order (indices into the
    /// lists given).
    pub pairs: Vec<(usize, usize)>,
    /// Each pair's PCIe path class (`nvidia-smi topo -m`'s names), where the topology was read.
    pub classes: Option<Vec<&'static str>>,
    /// How the pairs were chosen, in words.
    pub how: String,
}

/// Pairs `gpus` with the controllers `devices` (as given to `--device`) by the PCIe topology
/// under `sys_root` ([`gpu_queues::transport::topology::Matrix::pairs`]: each GPU drives its
/// nearest controllers, each controller is driven by its nearest GPUs), when every device is
/// a PCI function and every GPU is on a PCI bus. Otherwise (an image, a vfio-user socket, a
/// GPU stand-in, or a topology that cannot be read) every GPU drives every controller, and
/// `how` says why.
pub fn pair_gpus(gpus: &[Arc<Cuda>], devices: &[String], sys_root: &std::path::Path) -> GpuPairing {
    let every = |why: String| GpuPairing {
        pairs: (0..gpus.len())
            .flat_map(|g| (0..devices.len()).map(move |c| (g, c)))
            .collect(),
        classes: None,
        how: format!("every GPU with every controller: {why}"),
    };
    let mut ctrl_addrs = Vec::with_capacity(devices.len());
    for d in devices {
        match crate::open::DeviceSpec::parse(Some(d)) {
            Ok(crate::open::DeviceSpec::Pci(a)) => ctrl_addrs.push(a.to_string()),
            _ => {
                return every(format!(
                    "{d} is not a PCI device, so it has no place on PCIe"
                ));
            }
        }
    }
    let mut gpu_addrs = Vec::with_capacity(gpus.len());
    for g in gpus {
        match g.pci_bus_id() {
            Ok(a) => gpu_addrs.push(a.to_ascii_lowercase()),
            Err(e) => return every(format!("GPU {} has no PCI address ({e})", g.ordinal())),
        }
    }
    match gpu_queues::transport::topology::Matrix::of(sys_root, &gpu_addrs, &ctrl_addrs) {
        Ok(m) => {
            let pairs = m.pairs();
            GpuPairing {
                classes: Some(pairs.iter().map(|&(g, c)| m.classes[g][c].name()).collect()),
                pairs,
                how: "by the PCIe topology: each GPU with its nearest controllers, each \
                      controller with its nearest GPUs"
                    .into(),
            }
        }
        Err(e) => every(format!("the PCIe topology could not be read ({e})")),
    }
}

/// Runs `f` on every item at once, a thread each (one per controller), and waits for all: the
/// results in order (a panic in one is resumed here, after all joined).
pub fn on_each<I: Sync, T: Send>(items: &[I], f: impl Fn(&I) -> T + Sync) -> Vec<T> {
    std::thread::scope(|s| {
        let handles: Vec<_> = items.iter().map(|i| s.spawn(|| f(i))).collect();
        handles
            .into_iter()
            .map(|h| h.join().unwrap_or_else(|p| std::panic::resume_unwind(p)))
            .collect()
    })
}

/// Starts the GPU-resident controller model in place of `backend`'s software controller's I/O
/// threads, over the same namespaces (an image namespace is loaded into the model's media and
/// written back when it stops, unless read-only). `group`: its SMs and start gate when it is one
/// of several models started together ([`gpu_emu::ModelGroup`]); `None` splits the GPU for it
/// alone.
pub fn start_model(
    cuda: &Arc<Cuda>,
    ctrl: &Controller,
    backend: &Backend,
    media: MediaKind,
    controller_sms: u32,
    ssd_model: Option<SsdModel>,
    group: Option<GroupMember>,
) -> Result<Arc<GpuController>> {
    let Backend::Software(emu) = backend else {
        bail!(
            InvalidArgument,
            "the GPU-resident controller model takes the software controller's place: it needs \
             an image file as the device"
        );
    };
    let specs: Vec<NamespaceSpec> = emu
        .namespace_configs()
        .iter()
        .map(|c| NamespaceSpec {
            blocks: c.blocks,
            lba_size: c.lba_size,
            image: match &c.backend {
                nvme_emu::Backend::File(p) => Some(p.clone()),
                _ => None,
            },
            read_only: c.read_only,
            ssd_model,
        })
        .collect();
    let info = ctrl.info();
    let model = GpuController::start(
        cuda,
        emu,
        &specs,
        info.max_io_queue_pairs,
        u32::try_from(info.max_transfer_bytes).unwrap_or(u32::MAX),
        &GpuControllerOptions {
            controller_sms,
            media,
            group,
            ..Default::default()
        },
    )
    .context("starting the GPU-resident controller")?;
    // Creating or deleting the model's queues is an admin command that waits for all its
    // warps (bounded): the host must not give up on it sooner, or the admin queue is lost
    // for good (a 2-core CI machine running the model on CPU threads took over 10 s).
    ctrl.raise_admin_timeout(model.queue_change_bound() + std::time::Duration::from_secs(5));
    Ok(model)
}

/// Creates GPU queues on `ctrl`: on `model` when given (started by [`start_model`]), else on
/// the software controller's GPU transport (`gpu_emu::software`) for an image, or the
/// transport [`transport::open`] picks for a VFIO device.
pub fn open_queues(
    cuda: &Arc<Cuda>,
    ctrl: &Controller,
    backend: &Backend,
    model: Option<Arc<GpuController>>,
    opts: &GpuQueueOptions,
) -> Result<GpuSetup> {
    match model {
        Some(g) => {
            let queues = GpuQueues::on_gpu_controller(cuda, ctrl, &g, opts)
                .context("creating GPU queues on the GPU controller")?;
            let ssd: Vec<String> = g
                .ssd_models()
                .iter()
                .flatten()
                .map(|m| m.describe())
                .collect();
            let transport = format!(
                "gpu-controller model ({} media{}) on {} ({} SMs for the controller, {} for \
                 clients)",
                g.media().name(),
                if ssd.is_empty() {
                    String::new()
                } else {
                    format!(", {}", ssd.join("; "))
                },
                cuda.name(),
                g.partition().controller_sms(),
                g.partition().client_sms()
            );
            Ok(GpuSetup {
                queues,
                model: Some(g),
                transport,
                path: None,
            })
        }
        None => {
            let (queues, choice) = match backend {
                Backend::Software(emu) => gpu_emu::software::open(cuda, ctrl, emu, opts),
                Backend::Vfio(v) => {
                    transport::open(cuda, ctrl, v.clone(), opts, &TransportOptions::default())
                }
                Backend::VfioUser(v) => transport::open_vfio_user(cuda, ctrl, v.clone(), opts),
            }
            .context("creating GPU queues")?;
            let mut transport = queues.describe();
            if let Some(p) = choice.path {
                transport.push_str(&format!("; GPU to controller over {p}"));
            }
            if !choice.skipped.is_empty() {
                transport.push_str(&format!(
                    "; skipped {}",
                    transport::list_skipped(&choice.skipped)
                ));
            }
            Ok(GpuSetup {
                queues,
                model: None,
                transport,
                path: choice.path,
            })
        }
    }
}

/// A watchdog for device-side waits: a reason to abort once the model's kernel stopped or the
/// controller reports fatal status (or cannot be read).
pub fn watchdog<'a>(
    ctrl: &'a Controller,
    backend: &Backend,
    model: Option<&'a Arc<GpuController>>,
) -> impl FnMut() -> Option<String> + Send + 'a {
    let watched = backend.emu().cloned();
    move || match &watched {
        _ if model.is_some_and(|g| !g.is_running()) => {
            Some("the GPU controller kernel stopped".to_string())
        }
        Some(emu) => emu
            .csts()
            .cfs()
            .then(|| "the controller reported fatal status".to_string()),
        None => match ctrl.csts() {
            Ok(csts) => csts
                .cfs()
                .then(|| "the controller reported fatal status".to_string()),
            Err(e) => Some(format!("reading CSTS: {e}")),
        },
    }
}
