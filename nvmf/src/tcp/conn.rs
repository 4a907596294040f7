//! One NVMe/TCP connection (one queue pair's socket): connect within a bound, the ICReq/ICResp
//! exchange, then whole checked PDUs in and bytes out, every wait bounded. A controller that
//! breaks the protocol gets an H2CTermReq naming what it did, and the connection ends.

use std::io::{ErrorKind, Read, Write};
use std::net::{SocketAddr, TcpStream};
use std::time::{Duration, Instant};

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
    #[error("cannot connect to the NVMe/TCP target at {addr}: {source}")]
    Connect {
        /// Where.
        addr: SocketAddr,
        /// Why.
        source: std::io::Error,
    },
    /// A send or receive failed.
    #[error("NVMe/TCP {doing}: {source}")]
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
        let slice = (opts.bound / 10).max(Duration::from_millis(1));
        stream
            .set_read_timeout(Some(slice))
            .map_err(io("setting the read timeout"))?;
        stream
            .set_write_timeout(Some(opts.bound.max(Duration::from_millis(1))))
            .map_err(io("setting the write timeout"))?;
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

    /// Sends `bytes` (whole PDUs), within the bound.
    pub fn send(&mut self, bytes: &[u8]) -> Result<(), TcpError> {
        match self.stream.write_all(bytes) {
            Ok(()) => Ok(()),
            Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {
                Err(TcpError::Timeout {
                    waiting: "room to send",
                    after: self.bound,
                })
            }
            Err(e) if matches!(e.kind(), ErrorKind::BrokenPipe | ErrorKind::ConnectionReset) => {
                Err(TcpError::Closed)
            }
            Err(e) => Err(TcpError::Io {
                doing: "sending",
                source: e,
            }),
        }
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

    /// The next whole PDU if one arrives before `deadline` (a read waits at most a tenth of
    /// the bound past it), `None` if none did. A C2HTermReq is [`TcpError::Terminated`]; a PDU
    /// that breaks the protocol ends the connection ([`TcpError::Fatal`]).
    pub fn recv_until(&mut self, deadline: Instant) -> Result<Option<Pdu>, TcpError> {
        let mut buf = [0u8; 64 << 10];
        loop {
            match self.decoder.next_pdu() {
                Ok(Some(Pdu::TermReq { fes, fei })) => {
                    return Err(TcpError::Terminated { fes, fei });
                }
                Ok(Some(p)) => return Ok(Some(p)),
                Ok(None) => {}
                Err(f) => return Err(self.fail(f, &[])),
            }
            if Instant::now() >= deadline {
                return Ok(None);
            }
            match self.stream.read(&mut buf) {
                Ok(0) => return Err(TcpError::Closed),
                Ok(n) => self.decoder.push(&buf[..n]),
                Err(e) if matches!(e.kind(), ErrorKind::WouldBlock | ErrorKind::TimedOut) => {}
                Err(e) if e.kind() == ErrorKind::Interrupted => {}
                Err(e) if e.kind() == ErrorKind::ConnectionReset => return Err(TcpError::Closed),
                Err(e) => {
                    return Err(TcpError::Io {
                        doing: "receiving",
                        source: e,
                    });
                }
            }
        }
    }

    /// The bound on every wait.
    pub fn bound(&self) -> Duration {
        self.bound
    }

    /// Ends the connection for `fatal`: an H2CTermReq (best effort), then the socket closed.
    /// Returns the error to report.
    pub fn fail(&mut self, fatal: Fatal, offending: &[u8]) -> TcpError {
        let _ = self.stream.write_all(&encode::term_req(&fatal, offending));
        let _ = self.stream.shutdown(std::net::Shutdown::Both);
        TcpError::Fatal(fatal)
    }
}

fn resp_bytes(r: &IcResp) -> Vec<u8> {
    zerocopy::IntoBytes::as_bytes(r)[..24].to_vec()
}
