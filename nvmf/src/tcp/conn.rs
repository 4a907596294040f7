//! One NVMe/TCP connection (one queue pair's socket): connect within a bound, the ICReq/ICResp
//! exchange, then whole checked PDUs in and bytes out, every wait bounded. A controller that
//! breaks the protocol gets an H2CTermReq naming what it did, and the connection ends.
//!
//! The socket is non-blocking: a look for PDUs reads what is there without waiting (a queue
//! polled between other work costs a system call, not a wait), and waits are `poll(2)` on the
//! socket up to their deadline. Capsules submitted together may be sent together
//! ([`Connection::send_later`]): whatever is buffered goes out before any wait for a reply.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::os::fd::AsFd;
use std::time::{Duration, Instant};

use rustix::event::{PollFd, PollFlags, Timespec, poll};

use nvme_spec::tcp::{DigestFlags, Fes, IcReq, IcResp};
use zerocopy::FromBytes;

use super::codec::{Decoder, Fatal, Negotiated, Pdu, encode};

/// How a connection is made.
#[derive(Clone, Copy, Debug)]
pub struct ConnectOptions {
    /// The digests to ask for.
    pub digests: DigestFlags,
    /// The host's data alignment: data from the controller at multiples of (HPDA + 1) * 4.
    pub hpda: u8,
    /// The most data bytes one PDU from the controller may carry.
    pub max_data: u32,
    /// The bound on connecting and on every wait for bytes.
    pub bound: Duration,
}

impl Default for ConnectOptions {
    fn default() -> Self {
        Self {
            digests: DigestFlags::new(),
            hpda: 0,
            max_data: 1 << 20,
            bound: Duration::from_secs(10),
        }
    }
}

/// Why a connection or a command failed. After any of these but [`TcpError::QueueFull`] and
/// [`TcpError::TooLarge`] the connection is gone.
#[derive(Debug, thiserror::Error)]
pub enum TcpError {
    /// Nobody answered at the address (no listener, refused, unreachable) within the bound.
    #[error("cannot connect to the NVMe/TCP target at {addr}")]
    Connect {
        /// Where.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// A send or receive failed.
    #[error("NVMe/TCP {doing}")]
    Io {
        /// What was being done.
        doing: &'static str,
        /// The error.
        source: std::io::Error,
    },
    /// Nothing came within the bound.
    #[error("NVMe/TCP: no {waiting} from the target within {after:?}")]
    Timeout {
        /// What was awaited.
        waiting: &'static str,
        /// The bound.
        after: Duration,
    },
    /// The target closed the connection.
    #[error("NVMe/TCP: the target closed the connection")]
    Closed,
    /// The target broke the protocol; an H2CTermReq was sent.
    #[error(transparent)]
    Fatal(#[from] Fatal),
    /// As many commands as the queue holds are in flight (nothing was sent).
    #[error("NVMe/TCP: the queue has {depth} commands in flight already")]
    QueueFull {
        /// Its depth.
        depth: usize,
    },
    /// A command's data is longer than one command can carry (nothing was sent).
    #[error("NVMe/TCP: {len} bytes of data for one command is more than 4 GiB")]
    TooLarge {
        /// The length asked for.
        len: usize,
    },
    /// The target ended the connection with a C2HTermReq.
    #[error("NVMe/TCP: the target ended the connection: {} (FEI {fei})", .fes.name())]
    Terminated {
        /// Its Fatal Error Status.
        fes: Fes,
        /// Its Fatal Error Information.
        fei: u32,
    },
}

/// One live connection, negotiated.
#[derive(Debug)]
pub struct Connection {
    stream: TcpStream,
    decoder: Decoder,
    neg: Negotiated,
    bound: Duration,
    /// Bytes to send, not sent yet ([`Connection::send_later`]).
    out: Vec<u8>,
    /// Receive buffer.
    rbuf: Box<[u8]>,
}

/// Buffered bytes beyond which [`Connection::send_later`] sends at once.
const SEND_BATCH: usize = 256 << 10;

/// Waits until `stream` is readable (`POLLIN`) or writable (`POLLOUT`), or `timeout` passed;
/// errors and hang-ups count as ready (the read or write that follows reports them).
fn wait_ready(stream: &TcpStream, flags: PollFlags, timeout: Duration) {
    let fd = stream.as_fd();
    let mut fds = [PollFd::new(&fd, flags)];
    let ts = Timespec {
        tv_sec: timeout.as_secs().min(i64::MAX as u64) as i64,
        tv_nsec: i64::from(timeout.subsec_nanos()),
    };
    // EINTR and the like: the caller looks again and re-checks its deadline.
    let _ = poll(&mut fds, Some(&ts));
}

fn io(doing: &'static str) -> impl FnOnce(std::io::Error) -> TcpError {
    move |source| TcpError::Io { doing, source }
}

impl Connection {
    /// Connects to `addr` and negotiates (ICReq, then the ICResp checked).
    pub fn connect(addr: SocketAddr, opts: &ConnectOptions) -> Result<Self, TcpError> {
        let stream = TcpStream::connect_timeout(&addr, opts.bound)
            .map_err(|source| TcpError::Connect { addr, source })?;
        stream
            .set_nodelay(true)
            .map_err(io("setting TCP_NODELAY"))?;
        // Each read waits at most a slice of the bound, so a silent target is noticed at the
        // bound without a read that outlives it.
        stream
            .set_nonblocking(true)
            .map_err(io("making the socket non-blocking"))?;
        let mut c = Self {
            stream,
            decoder: Decoder::new(opts.max_data),
            neg: Negotiated {
                hdgst: false,
                ddgst: false,
                cpda: 0,
                hpda: opts.hpda,
                maxh2cdata: 4096,
            },
            bound: opts.bound,
            out: Vec::new(),
            rbuf: vec![0; 64 << 10].into_boxed_slice(),
        };
        let req = encode::icreq(opts.hpda, opts.digests);
        c.send(&req)?;
        let resp = match c.recv_within("ICResp")? {
            Pdu::IcResp(r) => r,
            other => {
                // The decoder admits only ICResp or a TermReq before negotiation.
                return Err(TcpError::Io {
                    doing: "negotiating",
                    source: std::io::Error::other(format!("unexpected {other:?}")),
                });
            }
        };
        let icreq = IcReq::read_from_bytes(&req[..])
            .unwrap_or_else(|_| IcReq::new(0, DigestFlags::new(), 0));
        let neg = match Negotiated::from_exchange(&icreq, &resp) {
            Ok(n) => n,
            Err(f) => return Err(c.fail(f, &resp_bytes(&resp))),
        };
        c.decoder.negotiated(neg);
        c.neg = neg;
        Ok(c)
    }

    /// What the exchange settled.
    pub fn negotiated(&self) -> Negotiated {
        self.neg
    }

    /// Runs one command that moves no data or carries its data in the capsule
    /// (`in_capsule`, at most the in-capsule size: 8 KiB on the admin queue): SGL1 is set
    /// here (an in-capsule Data Block, or none), the capsule sent, and the completion with the
    /// command's CID returned. Completions of other commands meanwhile are a protocol error
    /// here (one command at a time), as is read data.
    pub fn command(
        &mut self,
        mut sqe: nvme_spec::Command,
        in_capsule: &[u8],
    ) -> Result<nvme_spec::Completion, TcpError> {
        use nvme_spec::tcp::{SGL_DATA_BLOCK_OFFSET, sgl1};
        let (a, b) = if in_capsule.is_empty() {
            (0, 0)
        } else {
            sgl1(0, in_capsule.len() as u32, SGL_DATA_BLOCK_OFFSET)
        };
        sqe.prp1 = a;
        sqe.prp2 = b;
        let cid = sqe.cdw0.cid();
        let pdu = encode::capsule(&self.neg, &sqe, in_capsule);
        self.send(&pdu)?;
        match self.recv()? {
            Pdu::CapsuleResp(c) if c.cid == cid => Ok(c),
            other => {
                let f = Fatal {
                    fes: Fes::PDU_SEQUENCE_ERROR,
                    fei: 0,
                    why: format!("awaiting the completion of command {cid}, got {other:?}"),
                };
                Err(self.fail(f, &[]))
            }
        }
    }

    /// Sends `bytes` (whole PDUs) and anything buffered before them, within the bound.
    pub fn send(&mut self, bytes: &[u8]) -> Result<(), TcpError> {
        self.out.extend_from_slice(bytes);
        self.flush()
    }

    /// Buffers `bytes` (whole PDUs) to go out with the next send, the next wait for a reply
    /// or [`Connection::flush`], whichever comes first (at once past a few hundred KiB).
    pub fn send_later(&mut self, bytes: &[u8]) -> Result<(), TcpError> {
        self.out.extend_from_slice(bytes);
        if self.out.len() >= SEND_BATCH {
            return self.flush();
        }
        Ok(())
    }

    /// Sends what is buffered, within the bound.
    pub fn flush(&mut self) -> Result<(), TcpError> {
        let deadline = Instant::now() + self.bound;
        let mut sent = 0;
        let result = loop {
            if sent == self.out.len() {
                break Ok(());
            }
            match self.stream.write(&self.out[sent..]) {
                Ok(0) => break Err(TcpError::Closed),
                Ok(n) => sent += n,
                Err(e) if e.kind() == ErrorKind::WouldBlock => {
                    let now = Instant::now();
                    if now >= deadline {
                        break Err(TcpError::Timeout {
                            waiting: "room to send",
                            after: self.bound,
                        });
                    }
                    wait_ready(&self.stream, PollFlags::OUT, deadline - now);
                }
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e)
                    if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) =>
                {
                    break Err(TcpError::Closed);
                }
                Err(e) => {
                    break Err(TcpError::Io {
                        doing: "sending",
                        source: e,
                    });
                }
            }
        };
        self.out.drain(..sent);
        if result.is_err() {
            self.out.clear();
        }
        result
    }

    /// The next whole PDU, within the bound.
    pub fn recv(&mut self) -> Result<Pdu, TcpError> {
        self.recv_within("PDU")
    }

    fn recv_within(&mut self, waiting: &'static str) -> Result<Pdu, TcpError> {
        match self.recv_until(Instant::now() + self.bound)? {
            Some(p) => Ok(p),
            None => Err(TcpError::Timeout {
                waiting,
                after: self.bound,
            }),
        }
    }

    /// The next whole PDU if one arrives before `deadline` (what is already there is taken
    /// even past it), `None` if none did; buffered sends go out first. A C2HTermReq is
    /// [`TcpError::Terminated`]; a PDU that breaks the protocol ends the connection
    /// ([`TcpError::Fatal`]).
    pub fn recv_until(&mut self, deadline: Instant) -> Result<Option<Pdu>, TcpError> {
        if !self.out.is_empty() {
            self.flush()?;
        }
        loop {
            match self.decoder.next_pdu() {
                Ok(Some(Pdu::TermReq { fes, fei })) => {
                    return Err(TcpError::Terminated { fes, fei });
                }
                Ok(Some(p)) => return Ok(Some(p)),
                Ok(None) => {}
                Err(f) => return Err(self.fail(f, &[])),
            }
            match self.stream.read(&mut self.rbuf) {
                Ok(0) => return Err(TcpError::Closed),
                Ok(n) => {
                    self.decoder.push(&self.rbuf[..n]);
                    continue;
                }
                Err(e) if e.kind() == ErrorKind::WouldBlock => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => continue,
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return Err(TcpError::Closed),
                Err(e) => {
                    return Err(TcpError::Io {
                        doing: "receiving",
                        source: e,
                    });
                }
            }
            let now = Instant::now();
            if now >= deadline {
                return Ok(None);
            }
            wait_ready(&self.stream, PollFlags::IN, deadline - now);
        }
    }

    /// The bound on every wait.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Ends the connection for `fatal`: an H2CTermReq (best effort), then the socket closed.
    /// Returns the error to report.
    pub fn fail(&mut self, fatal: Fatal, offending: &[u8]) -> TcpError {
        self.out.clear();
        // Best effort on the non-blocking socket: a full send buffer drops it.
        let _ = self.stream.write_all(&encode::term_req(&fatal, offending));
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        TcpError::Fatal(fatal)
    }
}

fn resp_bytes(r: &IcResp) -> Vec<u8> {
    zerocopy::IntoBytes::as_bytes(r)[..24].to_vec()
}
