//! The socket: a listening `SOCK_SEQPACKET` Unix socket, one thread per client.
//!
//! A client's identity is the kernel's (`SO_PEERCRED` at accept), never a message field. Its
//! thread reads one request at a time, answers it, and reclaims everything the client holds
//! when the socket ends (the client exited, was killed, or closed it), when the client stops
//! reading replies (a send that cannot finish within the bound), or when the daemon stops.
//! A malformed frame gets a refusal naming what was wrong and the connection goes on; a frame
//! of another protocol version gets one refusal and the connection ends.
#![forbid(unsafe_code)]

use std::os::fd::{AsFd, OwnedFd};
use std::path::{Path, PathBuf};
use std::sync::Arc;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::thread::JoinHandle;
use std::time::Duration;

use gpunvme::open::{Backend, DeviceSpec, OpenOptions};
use gpunvme_serve_proto::msg::{Event, RefusalKind, Reply};
use gpunvme_serve_proto::socket::{Channel, SocketError};
use gpunvme_serve_proto::{Frame, Message, ProtoError};
use rustix::event::{PollFd, PollFlags, Timespec, poll};
use rustix::net::{AddressFamily, SocketAddrUnix, SocketFlags, SocketType};

use crate::ServeError;
use crate::daemon::{Budgets, ClientLedger, Daemon, Served, ServedBackend};

/// How often waiting threads look at the stop flag.
const TICK: Duration = Duration::from_millis(50);

/// What `gpunvme serve` serves and how.
#[derive(Clone, Debug)]
pub struct ServeOptions {
    /// The socket's path.
    pub socket: PathBuf,
    /// The controllers: a name for each and its device, as `--device` spells it (an image
    /// path, `vfio-user:SOCKET`, or a PCI address bound to vfio-pci).
    pub devices: Vec<(String, String)>,
    /// How each image is opened (LBA size, controller threads, queue pairs).
    pub open: OpenOptions,
    /// What each client may hold.
    pub budgets: Budgets,
    /// The bound on each send to a client (one that stops reading is disconnected after it).
    pub send_bound: Duration,
    /// Every I/O completion of the software controllers delayed by this much (tests: commands
    /// truly outstanding when a client dies).
    pub completion_delay: Option<Duration>,
    /// The group whose members may connect besides the daemon's user (socket mode 0660);
    /// `None`: the daemon's user only (0600).
    pub group: Option<u32>,
}

impl ServeOptions {
    /// Serving `devices` at `socket` with default budgets and a 2 s send bound.
    pub fn new(socket: PathBuf, devices: Vec<(String, String)>) -> Self {
        Self {
            socket,
            devices,
            open: OpenOptions::default(),
            budgets: Budgets::default(),
            send_bound: Duration::from_secs(2),
            completion_delay: None,
            group: None,
        }
    }
}

/// A running daemon: its listening thread and its clients' threads.
pub struct Server {
    daemon: Arc<Daemon>,
    socket: PathBuf,
    stop: Arc<AtomicBool>,
    accept: Option<JoinHandle<()>>,
}

fn sock_err(doing: impl Into<String>) -> impl FnOnce(rustix::io::Errno) -> ServeError {
    let doing = doing.into();
    move |e| ServeError::Socket {
        doing,
        source: e.into(),
    }
}

impl Server {
    /// Opens every device, brings its controller up, and listens at the socket. A socket
    /// path where a daemon already answers is refused; a stale one (nobody answers) is
    /// replaced.
    pub fn start(opts: ServeOptions) -> Result<Self, ServeError> {
        let mut served = Vec::new();
        for (name, device) in &opts.devices {
            let spec = DeviceSpec::parse(Some(device))?;
            let (ctrl, backend) = gpunvme::open::open_controller_and_transport(&spec, &opts.open)?;
            let backend = match backend {
                Backend::Software(emu) => {
                    if let Some(d) = opts.completion_delay {
                        emu.faults().set_completion_delay(d);
                    }
                    ServedBackend::Software(emu)
                }
                Backend::VfioUser(dev) => ServedBackend::VfioUser(dev),
                Backend::Vfio(dev) => ServedBackend::Vfio(dev),
            };
            served.push(Served::new(name.clone(), ctrl, backend)?);
        }
        let daemon = Arc::new(Daemon::new(served, opts.budgets)?);
        let listener = listen(&opts.socket, opts.group)?;
        let stop = Arc::new(AtomicBool::new(false));
        let accept = {
            let (daemon, stop, bound) = (daemon.clone(), stop.clone(), opts.send_bound);
            std::thread::Builder::new()
                .name("serve-accept".into())
                .spawn(move || accept_loop(listener, daemon, stop, bound))
                .map_err(|source| ServeError::Socket {
                    doing: "starting the accept thread".into(),
                    source,
                })?
        };
        Ok(Self {
            daemon,
            socket: opts.socket,
            stop,
            accept: Some(accept),
        })
    }

    /// The socket's path.
    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// The daemon (its status, its counters).
    pub fn daemon(&self) -> &Arc<Daemon> {
        &self.daemon
    }

    /// Asks every thread to stop: clients are told (`Shutdown`) and reclaimed.
    pub fn request_stop(&self) {
        self.stop.store(true, Ordering::Release);
    }

    /// Stops: every client told and reclaimed, the socket removed, the controllers shut down
    /// as the daemon drops.
    pub fn stop(mut self) {
        self.shutdown();
    }

    fn shutdown(&mut self) {
        self.request_stop();
        if let Some(t) = self.accept.take() {
            let _ = t.join();
        }
        let _ = std::fs::remove_file(&self.socket);
    }
}

impl Drop for Server {
    fn drop(&mut self) {
        self.shutdown();
    }
}

fn listen(path: &Path, group: Option<u32>) -> Result<OwnedFd, ServeError> {
    if path.exists() {
        // A daemon answering there keeps it; a stale socket file is replaced.
        let probe = rustix::net::socket_with(
            AddressFamily::UNIX,
            SocketType::SEQPACKET,
            SocketFlags::CLOEXEC,
            None,
        )
        .map_err(sock_err("making a socket"))?;
        let addr = SocketAddrUnix::new(path).map_err(sock_err(format!("{}", path.display())))?;
        if rustix::net::connect(&probe, &addr).is_ok() {
            return Err(ServeError::InvalidArgument(format!(
                "a daemon already serves {} (stop it first, or give another --socket)",
                path.display()
            )));
        }
        std::fs::remove_file(path).map_err(|source| ServeError::Socket {
            doing: format!("removing the stale socket {}", path.display()),
            source,
        })?;
    }
    let fd = rustix::net::socket_with(
        AddressFamily::UNIX,
        SocketType::SEQPACKET,
        SocketFlags::CLOEXEC | SocketFlags::NONBLOCK,
        None,
    )
    .map_err(sock_err("making the listening socket"))?;
    let addr = SocketAddrUnix::new(path).map_err(sock_err(format!("{}", path.display())))?;
    rustix::net::bind(&fd, &addr).map_err(sock_err(format!("binding {}", path.display())))?;
    // Who may connect is the socket file's mode: the daemon's user and, with `group`, that
    // group's members (0660); nobody else, whatever the umask.
    let mode = if group.is_some() { 0o660 } else { 0o600 };
    rustix::fs::chmod(path, rustix::fs::Mode::from_raw_mode(mode))
        .map_err(sock_err(format!("setting the mode of {}", path.display())))?;
    if let Some(gid) = group {
        rustix::fs::chown(path, None, Some(rustix::fs::Gid::from_raw(gid))).map_err(sock_err(
            format!("giving {} to group {gid}", path.display()),
        ))?;
    }
    rustix::net::listen(&fd, 64).map_err(sock_err(format!("listening at {}", path.display())))?;
    Ok(fd)
}

/// The id of group `name` (from /etc/group), or `name` itself if it is a number.
pub fn group_id(name: &str) -> Result<u32, ServeError> {
    if let Ok(gid) = name.parse() {
        return Ok(gid);
    }
    let groups = std::fs::read_to_string("/etc/group").map_err(|source| ServeError::Socket {
        doing: "reading /etc/group".into(),
        source,
    })?;
    groups
        .lines()
        .filter_map(|l| {
            let mut f = l.split(':');
            Some((f.next()?, f.nth(1)?))
        })
        .find(|(n, _)| *n == name)
        .and_then(|(_, gid)| gid.parse().ok())
        .ok_or_else(|| ServeError::InvalidArgument(format!("no group {name:?} in /etc/group")))
}

/// Waits up to [`TICK`] for `fd` to be readable; whether it is.
fn readable(fd: impl AsFd) -> bool {
    let ts = Timespec {
        tv_sec: 0,
        tv_nsec: TICK.as_nanos() as i64,
    };
    let mut fds = [PollFd::new(&fd, PollFlags::IN)];
    matches!(poll(&mut fds, Some(&ts)), Ok(n) if n > 0)
}

fn accept_loop(listener: OwnedFd, daemon: Arc<Daemon>, stop: Arc<AtomicBool>, bound: Duration) {
    let next = AtomicU64::new(1);
    let mut clients: Vec<JoinHandle<()>> = Vec::new();
    while !stop.load(Ordering::Acquire) {
        clients.retain(|t| !t.is_finished());
        if !readable(&listener) {
            continue;
        }
        let fd = match rustix::net::accept_with(&listener, SocketFlags::CLOEXEC) {
            Ok(fd) => fd,
            Err(e) => {
                tracing::debug!("accept: {e}");
                continue;
            }
        };
        let (pid, uid) = match rustix::net::sockopt::socket_peercred(&fd) {
            Ok(c) => (c.pid.as_raw_nonzero().get(), c.uid.as_raw()),
            Err(e) => {
                tracing::warn!("a client without peer credentials refused: {e}");
                continue;
            }
        };
        let id = next.fetch_add(1, Ordering::Relaxed);
        let (daemon, stop) = (daemon.clone(), stop.clone());
        let spawned = std::thread::Builder::new()
            .name(format!("serve-client-{id}"))
            .spawn(move || {
                let channel = Arc::new(Channel::new(fd, bound));
                let mut ledger = ClientLedger::new(id, pid, uid);
                daemon.connected(&ledger, channel.clone());
                serve_client(&daemon, &channel, &mut ledger, &stop);
                daemon.reclaim(&mut ledger);
            });
        match spawned {
            Ok(t) => clients.push(t),
            Err(e) => tracing::error!("no thread for client {id}: {e}"),
        }
    }
    for t in clients {
        let _ = t.join();
    }
}

fn refusal(kind: RefusalKind, message: String) -> Message {
    Message::Reply(Reply::Refused { kind, message })
}

/// Serves one client until its socket ends, it stops reading, or the daemon stops.
fn serve_client(daemon: &Daemon, channel: &Channel, ledger: &mut ClientLedger, stop: &AtomicBool) {
    loop {
        if stop.load(Ordering::Acquire) {
            let _ = channel.send(
                &Frame {
                    request_id: 0,
                    message: Message::Event(Event::Shutdown),
                },
                &[],
            );
            return;
        }
        if !readable(channel.fd()) {
            continue;
        }
        let (bytes, fds) = match channel.recv_raw() {
            Ok(got) => got,
            Err(SocketError::Closed) => return,
            Err(SocketError::Timeout { .. }) => continue,
            Err(SocketError::Proto(e)) => {
                // A datagram refused before decoding (too large, too many descriptors).
                if reply(channel, 0, refusal(RefusalKind::Protocol, e.to_string())).is_err() {
                    return;
                }
                continue;
            }
            Err(e) => {
                tracing::debug!(
                    client = ledger.id,
                    "receiving: {}",
                    gpunvme_serve_proto::chain(&e)
                );
                return;
            }
        };
        // Requests carry no descriptors: any sent are refused (by the decoder) and closed.
        let sent_fds = fds.len();
        drop(fds);
        let request_id = Frame::header(&bytes).map_or(0, |h| h.request_id.get());
        let frame = match Frame::decode(&bytes, sent_fds) {
            Ok(f) => f,
            Err(e) => {
                let end = matches!(e, ProtoError::Version { .. } | ProtoError::BadMagic(_));
                let sent = reply(
                    channel,
                    request_id,
                    refusal(RefusalKind::Protocol, e.to_string()),
                );
                if end || sent.is_err() {
                    return;
                }
                continue;
            }
        };
        let Message::Request(request) = frame.message else {
            let m = refusal(
                RefusalKind::Protocol,
                format!(
                    "a client sends requests, not {} messages",
                    frame.message.kind().name()
                ),
            );
            if reply(channel, request_id, m).is_err() {
                return;
            }
            continue;
        };
        let answer = daemon.handle(ledger, request);
        let end = matches!(
            answer.reply,
            Reply::Refused {
                kind: RefusalKind::Protocol,
                ..
            }
        );
        let frame = Frame {
            request_id,
            message: Message::Reply(answer.reply),
        };
        let sent = match &answer.fd {
            Some(m) => channel.send(&frame, &[m.fd()]),
            None => channel.send(&frame, &[]),
        };
        if let Err(e) = sent {
            tracing::info!(
                client = ledger.id,
                "disconnected: {}",
                gpunvme_serve_proto::chain(&e)
            );
            return;
        }
        if end {
            return;
        }
    }
}

fn reply(channel: &Channel, request_id: u32, message: Message) -> Result<(), SocketError> {
    channel.send(
        &Frame {
            request_id,
            message,
        },
        &[],
    )
}
