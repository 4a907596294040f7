//! NVMe over Fabrics (TCP) devices: `--device nvme-tcp://HOST:PORT/NQN`.
//!
//! The far controller is brought up by the `nvmf` host (Connect, properties, Identify, Keep
//! Alive); the device the rest of gpunvme sees is the software controller in front of it, each
//! of whose namespaces forwards to one of the far controller's ([`nvme_emu::forward`]). Every
//! controller thread opens an NVMe/TCP I/O queue of its own on first use and keeps many
//! commands in flight on it. So the driver, blockfs, volumes, GPU queues (in pinned host
//! memory, which the software controller serves) and every surface work over TCP unchanged;
//! what the path costs is one copy through the front and a thread per connection
//! (docs/nvme-tcp.md).

use std::net::{SocketAddr, ToSocketAddrs};
use std::sync::Arc;
use std::time::Duration;

use nvme_emu::{
    Backend, EmuConfig, EmuDevice, ForwardChannel, ForwardData, ForwardDone, ForwardError,
    Forwarded, Forwarder, NamespaceConfig, NsFormat,
};
use nvme_spec::Cns;
use nvmf::host::{Controller as FabricController, HostOptions, IoQueue, Target};
use nvmf::tcp::queue::Data;

use crate::error::{Context, Result, bail};

/// The scheme of an NVMe/TCP device spec.
pub const SCHEME: &str = "nvme-tcp://";

/// The NVMe/TCP port IANA assigned (and a discovery controller's usual one).
pub const DEFAULT_PORT: u16 = 4420;

/// Commands in flight per forwarding connection (SPDK grants 128 entries per queue).
const CHANNEL_DEPTH: u16 = 128;

/// Where an NVMe/TCP device is: `HOST[:PORT]` and, for an NVM subsystem, its NQN (none: the
/// discovery controller).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct TcpSpec {
    /// Host name or address, as given (an IPv6 address in brackets).
    pub host: String,
    /// TCP port.
    pub port: u16,
    /// The subsystem's NQN; `None` for the discovery controller.
    pub subnqn: Option<String>,
}

impl TcpSpec {
    /// Parses `nvme-tcp://HOST[:PORT][/NQN]`.
    pub fn parse(spec: &str) -> Result<Self> {
        let Some(rest) = spec.strip_prefix(SCHEME) else {
            bail!(InvalidArgument, "device {spec}: not an {SCHEME} spec");
        };
        let (authority, nqn) = match rest.split_once('/') {
            Some((a, n)) => (a, Some(n)),
            None => (rest, None),
        };
        let (host, port) = if let Some(v6) = authority.strip_prefix('[') {
            let Some((h, after)) = v6.split_once(']') else {
                bail!(
                    InvalidArgument,
                    "device {spec}: an IPv6 address needs its closing ]"
                );
            };
            (format!("[{h}]"), after.strip_prefix(':'))
        } else {
            match authority.rsplit_once(':') {
                Some((h, p)) => (h.to_owned(), Some(p)),
                None => (authority.to_owned(), None),
            }
        };
        if host.is_empty() || host == "[]" {
            bail!(
                InvalidArgument,
                "device {spec}: give the target's address, e.g. \
                 nvme-tcp://127.0.0.1:4420/nqn.2016-06.io.spdk:cnode1"
            );
        }
        let port = match port {
            None => DEFAULT_PORT,
            Some(p) => match p.parse::<u16>() {
                Ok(p) if p != 0 => p,
                _ => bail!(InvalidArgument, "device {spec}: port {p:?} is not 1-65535"),
            },
        };
        let subnqn = match nqn {
            None | Some("") => None,
            Some(n) if n.len() > 223 || !n.bytes().all(|b| (0x21..0x7f).contains(&b)) => bail!(
                InvalidArgument,
                "device {spec}: an NQN is at most 223 printable characters without spaces"
            ),
            Some(n) => Some(n.to_owned()),
        };
        Ok(Self { host, port, subnqn })
    }

    /// The target's socket address (the first the name resolves to).
    pub fn resolve(&self) -> Result<SocketAddr> {
        let name = format!("{}:{}", self.host, self.port);
        name.to_socket_addrs()
            .with_context(|| format!("resolving {name}"))?
            .next()
            .with_context(|| format!("{name} resolves to no address"))
    }
}

impl std::fmt::Display for TcpSpec {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "{SCHEME}{}:{}", self.host, self.port)?;
        if let Some(n) = &self.subnqn {
            write!(f, "/{n}")?;
        }
        Ok(())
    }
}

/// How long a command may take on a connection before the connection counts as failed: the
/// Linux host's default I/O timeout (a busy target on a loaded host answers seconds late).
const COMMAND_TIMEOUT: Duration = Duration::from_secs(30);

/// The host options every gpunvme connection uses.
pub fn host_options() -> HostOptions {
    HostOptions {
        timeout: COMMAND_TIMEOUT,
        ..HostOptions::default()
    }
}

/// Connects to the NVM subsystem `spec` names and brings its controller up.
pub fn connect(spec: &TcpSpec) -> Result<FabricController> {
    let Some(subnqn) = &spec.subnqn else {
        bail!(
            InvalidArgument,
            "device {spec}: name the subsystem (…/NQN); `gpunvme discover {spec}` lists them"
        );
    };
    let target = Target {
        addr: spec.resolve()?,
        subnqn: subnqn.clone(),
    };
    FabricController::connect(&target, &host_options())
        .map_err(crate::Error::from)
        .with_context(|| format!("connecting to {spec}"))
}

/// The far controller's active namespaces, ascending (Identify, Active Namespace ID list).
pub fn active_namespaces(ctrl: &FabricController) -> Result<Vec<u32>> {
    let data = ctrl
        .identify_data(Cns::ACTIVE_NAMESPACES, 0)
        .map_err(crate::Error::from)?;
    Ok(data
        .chunks_exact(4)
        .map(|c| u32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .take_while(|&n| n != 0)
        .collect())
}

/// Opens a channel per controller thread on one far controller.
struct TcpForwarder {
    ctrl: Arc<FabricController>,
    describe: String,
}

/// One NVMe/TCP I/O queue, as a controller thread's channel.
struct TcpChannel {
    q: IoQueue,
}

impl Forwarder for TcpForwarder {
    fn channel(&self) -> std::result::Result<Box<dyn ForwardChannel>, ForwardError> {
        let q = self
            .ctrl
            .io_queue(CHANNEL_DEPTH)
            .map_err(|e| ForwardError(format!("{}: {}", self.describe, chain(&e))))?;
        Ok(Box::new(TcpChannel { q }))
    }

    fn describe(&self) -> String {
        self.describe.clone()
    }
}

impl ForwardChannel for TcpChannel {
    fn has_room(&self) -> bool {
        self.q.has_room()
    }

    fn submit(
        &mut self,
        tag: u64,
        cmd: nvme_spec::Command,
        data: ForwardData,
    ) -> std::result::Result<(), ForwardError> {
        let data = match data {
            ForwardData::None => Data::None,
            ForwardData::ToController(b) => Data::ToController(b),
            ForwardData::FromController(n) => Data::FromController(n),
        };
        self.q
            .queue()
            .submit(tag, cmd, data)
            .map_err(|e| ForwardError(chain(&e)))
    }

    fn poll(
        &mut self,
        wait: Duration,
        done: &mut Vec<ForwardDone>,
    ) -> std::result::Result<(), ForwardError> {
        let finished = self
            .q
            .queue()
            .poll(wait)
            .map_err(|e| ForwardError(chain(&e)))?;
        done.extend(finished.into_iter().map(|d| ForwardDone {
            tag: d.tag,
            status: d.status,
            dw0: d.completion.dw0,
            data: d.data,
        }));
        Ok(())
    }
}

/// An error and its sources, in words.
fn chain(e: &dyn std::error::Error) -> String {
    let mut s = e.to_string();
    let mut next = e.source();
    while let Some(c) = next {
        s.push_str(": ");
        s.push_str(&c.to_string());
        next = c.source();
    }
    s
}

/// The far controller's Identify strings, made what the software controller accepts
/// (printable ASCII, trimmed, at most `max` bytes).
fn identity(raw: &[u8], max: usize) -> String {
    let s: String = raw
        .iter()
        .map(|&b| {
            if (0x20..0x7f).contains(&b) {
                b as char
            } else {
                ' '
            }
        })
        .collect();
    let t = s.trim();
    t[..t.len().min(max)].trim_end().to_owned()
}

/// Brings up the far controller `spec` names and starts the software controller in front of
/// it: one namespace per active far namespace, in order (front namespace 1 is the lowest far
/// NSID), write-protected when `read_only`.
pub fn open_front(
    spec: &TcpSpec,
    controller_threads: usize,
    queue_pairs: u16,
    read_only: bool,
) -> Result<Arc<EmuDevice>> {
    let ctrl = Arc::new(connect(spec)?);
    let max = ctrl.max_transfer();
    if max < 8192 {
        bail!(
            Device,
            "{spec}: the controller moves at most {max} bytes per command; at least 8 KiB is needed"
        );
    }
    let describe = spec.to_string();
    let nsids = active_namespaces(&ctrl).with_context(|| format!("{spec}: namespaces"))?;
    if nsids.is_empty() {
        bail!(Device, "{spec}: the subsystem has no active namespace");
    }
    let forwarder: Arc<dyn Forwarder> = Arc::new(TcpForwarder {
        ctrl: ctrl.clone(),
        describe,
    });
    let mut namespaces = Vec::with_capacity(nsids.len());
    for nsid in nsids {
        let ns = ctrl
            .namespace(nsid)
            .map_err(crate::Error::from)
            .with_context(|| format!("{spec}: namespace {nsid}"))?;
        namespaces.push(NamespaceConfig {
            backend: Backend::Forwarded(Forwarded {
                forwarder: forwarder.clone(),
                nsid,
            }),
            blocks: ns.blocks,
            lba_size: ns.lba_size,
            read_only,
            format: NsFormat::Plain,
        });
    }
    let id = ctrl.identify();
    // MDTS in 4 KiB pages, at most what the far controller moves (never 0: that is unlimited).
    let mdts = (max / 4096).ilog2().clamp(1, 15) as u8;
    let config = EmuConfig {
        namespaces,
        controller_threads,
        max_io_queue_pairs: queue_pairs,
        mdts,
        serial: identity(&id.sn, 20),
        model: identity(&id.mn, 40),
        firmware: identity(&id.fr, 8),
        vendor_id: id.vid,
        ..EmuConfig::default()
    };
    EmuDevice::start(config)
        .map_err(crate::Error::from)
        .with_context(|| format!("starting the software controller in front of {spec}"))
}

/// One entry of a discovery controller's log (`gpunvme discover`).
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize)]
pub struct DiscoveryEntry {
    /// The subsystem's NQN.
    pub subnqn: String,
    /// What it is: `nvme` (an NVM subsystem), `discovery`, or the number.
    pub subtype: String,
    /// Transport: `tcp`, `rdma`, `fc`, `loop`, or the number.
    pub trtype: String,
    /// Address and port, as the target gives them.
    pub traddr: String,
    /// Service (the TCP port).
    pub trsvcid: String,
    /// Port id.
    pub portid: u16,
    /// The device spec that opens it, for an NVM subsystem over TCP.
    pub device: Option<String>,
}

/// The discovery log of the discovery controller at `spec` (its NQN, if any, is ignored).
pub fn discover(spec: &TcpSpec) -> Result<Vec<DiscoveryEntry>> {
    let addr = spec.resolve()?;
    let entries = nvmf::discovery::discover(addr, &host_options())
        .map_err(crate::Error::from)
        .with_context(|| format!("discovering {SCHEME}{}:{}", spec.host, spec.port))?;
    Ok(entries
        .into_iter()
        .map(|e| {
            let device = e.is_tcp_subsystem().then(|| {
                let host = if e.traddr.contains(':') {
                    format!("[{}]", e.traddr)
                } else {
                    e.traddr.clone()
                };
                format!("{SCHEME}{host}:{}/{}", e.trsvcid, e.subnqn)
            });
            DiscoveryEntry {
                subtype: match e.subtype {
                    1 | 3 => "discovery".into(),
                    2 => "nvme".into(),
                    n => n.to_string(),
                },
                trtype: match e.trtype {
                    1 => "rdma".into(),
                    2 => "fc".into(),
                    3 => "tcp".into(),
                    254 => "loop".into(),
                    n => n.to_string(),
                },
                subnqn: e.subnqn,
                traddr: e.traddr,
                trsvcid: e.trsvcid,
                portid: e.portid,
                device,
            }
        })
        .collect())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn specs_parse() {
        let s = TcpSpec::parse("nvme-tcp://127.0.0.1:4421/nqn.2016-06.io.spdk:m512").unwrap();
        assert_eq!(
            s,
            TcpSpec {
                host: "127.0.0.1".into(),
                port: 4421,
                subnqn: Some("nqn.2016-06.io.spdk:m512".into())
            }
        );
        assert_eq!(
            s.to_string(),
            "nvme-tcp://127.0.0.1:4421/nqn.2016-06.io.spdk:m512"
        );
        let d = TcpSpec::parse("nvme-tcp://storage.example").unwrap();
        assert_eq!((d.port, d.subnqn), (DEFAULT_PORT, None));
        let v6 = TcpSpec::parse("nvme-tcp://[::1]:9000/nqn.x").unwrap();
        assert_eq!((v6.host.as_str(), v6.port), ("[::1]", 9000));
        assert_eq!(v6.resolve().unwrap().port(), 9000);
        for bad in [
            "nvme-tcp://",
            "nvme-tcp://:4420/nqn.x",
            "nvme-tcp://h:0/nqn.x",
            "nvme-tcp://h:99999/nqn.x",
            "nvme-tcp://h:port/nqn.x",
            "nvme-tcp://[::1/nqn.x",
            "nvme-tcp://h/nqn with space",
        ] {
            let e = TcpSpec::parse(bad).unwrap_err();
            assert_eq!(e.kind(), crate::ErrorKind::InvalidArgument, "{bad}: {e}");
        }
    }

    #[test]
    fn identity_strings_fit_the_front() {
        assert_eq!(identity(b"SPDK00000000000001  ", 20), "SPDK00000000000001");
        assert_eq!(identity(b"a\x00b\xffc", 40), "a b c");
        assert_eq!(identity(&[b'x'; 50], 40).len(), 40);
    }
}
