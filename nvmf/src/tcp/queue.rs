//! One NVMe/TCP queue (the admin queue or an I/O queue, one connection each) with many
//! commands in flight: capsules out, and what the controller sends back matched to them —
//! C2HData into a read's buffer (in order, inside it; with the SUCCESS flag the command is
//! complete without a CapsuleResp), R2T answered with H2CData cut at the negotiated
//! MAXH2CDATA, CapsuleResp completing the command. Writes up to the controller's in-capsule
//! size travel in the capsule. Every wait is bounded; a command that outlives the bound
//! fails the queue (NVMe/TCP has no way to take a command back but to end the connection).
//!
//! A controller that names a command not in flight, sends data outside a command's buffer
//! or out of order, or asks for data a command does not have breaks the protocol: an
//! H2CTermReq names the fault and the queue ends ([`TcpError::Fatal`]). A data digest that
//! does not match fails only its command (Transient Transport Error).

use std::time::{Duration, Instant};

use nvme_spec::tcp::{Fes, SGL_DATA_BLOCK_OFFSET, SGL_TRANSPORT_DATA_BLOCK, sgl1};
use nvme_spec::{Command, Completion, CqeStatus, Status, status::generic};

use super::codec::{Fatal, Pdu, encode};
use super::conn::{Connection, TcpError};

/// A command's data.
#[derive(Debug)]
pub enum Data {
    /// None moves.
    None,
    /// These bytes go to the controller (a write).
    ToController(Vec<u8>),
    /// This many bytes come from the controller (a read).
    FromController(usize),
}

/// A finished command.
#[derive(Debug)]
pub struct Done {
    /// The tag given at submission.
    pub tag: u64,
    /// Its completion (synthesised as success, CID and SQID filled in, when the last
    /// C2HData carried the SUCCESS flag).
    pub completion: Completion,
    /// The status to act on: the completion's, or Transient Transport Error when a data
    /// digest did not match or a read's data was short.
    pub status: Status,
    /// A read's data (empty for other commands).
    pub data: Vec<u8>,
    /// A write's buffer, given back.
    pub written: Vec<u8>,
}

#[derive(Debug)]
struct InFlight {
    tag: u64,
    /// Write data (what R2Ts ask for), or empty.
    out: Vec<u8>,
    /// Whether `out` travelled in the capsule.
    in_capsule: bool,
    /// Read data, sized at submission; `received` of it arrived.
    data: Vec<u8>,
    reads: bool,
    received: usize,
    digest_failed: bool,
    deadline: Instant,
}

/// Commands one queue can hold in flight at most (CIDs are slot indices).
pub const MAX_DEPTH: u16 = 1024;

/// One queue on one connection (see the module documentation).
#[derive(Debug)]
pub struct Queue {
    conn: Connection,
    qid: u16,
    slots: Vec<Option<InFlight>>,
    free: Vec<u16>,
    in_capsule_max: usize,
    timeout: Duration,
    failed: bool,
}

impl Queue {
    /// A queue of `depth` commands in flight at most (1 to [`MAX_DEPTH`]) on `conn`, for
    /// queue `qid`, whose controller takes writes of up to `in_capsule_max` bytes in the
    /// capsule; a command not done within `timeout` fails the queue.
    pub fn new(
        conn: Connection,
        qid: u16,
        depth: u16,
        in_capsule_max: usize,
        timeout: Duration,
    ) -> Self {
        let depth = depth.clamp(1, MAX_DEPTH);
        Self {
            conn,
            qid,
            slots: (0..depth).map(|_| None).collect(),
            free: (0..depth).rev().collect(),
            in_capsule_max,
            timeout,
            failed: false,
        }
    }

    /// Writes of up to `bytes` travel in the capsule from the next command on.
    pub fn set_in_capsule_max(&mut self, bytes: usize) {
        self.in_capsule_max = bytes;
    }

    /// The queue's id.
    pub fn qid(&self) -> u16 {
        self.qid
    }

    /// Commands in flight.
    pub fn in_flight(&self) -> usize {
        self.slots.len() - self.free.len()
    }

    /// Room for more commands.
    pub fn has_room(&self) -> bool {
        !self.free.is_empty()
    }

    /// The connection under it.
    pub fn connection(&self) -> &Connection {
        &self.conn
    }

    fn check_live(&self) -> Result<(), TcpError> {
        if self.failed {
            Err(TcpError::Closed)
        } else {
            Ok(())
        }
    }

    /// Sends `sqe` (its CID and SGL1 set here) with `data`; `tag` comes back in its
    /// [`Done`]. [`TcpError::QueueFull`] when `depth` commands are in flight.
    pub fn submit(&mut self, tag: u64, mut sqe: Command, data: Data) -> Result<(), TcpError> {
        self.check_live()?;
        let Some(cid) = self.free.pop() else {
            return Err(TcpError::QueueFull {
                depth: self.slots.len(),
            });
        };
        sqe.cdw0.set_cid(cid);
        // PSDT 01b: SGLs (the only data pointer NVMe/TCP has).
        sqe.cdw0.set_psdt(1);
        let mut flight = InFlight {
            tag,
            out: Vec::new(),
            in_capsule: false,
            data: Vec::new(),
            reads: false,
            received: 0,
            digest_failed: false,
            deadline: Instant::now() + self.timeout,
        };
        let too_large = |len: usize| TcpError::TooLarge { len };
        match data {
            Data::None => (sqe.prp1, sqe.prp2) = (0, 0),
            Data::ToController(bytes) => {
                let len = u32::try_from(bytes.len()).map_err(|_| too_large(bytes.len()))?;
                flight.in_capsule = bytes.len() <= self.in_capsule_max;
                let kind = if flight.in_capsule {
                    SGL_DATA_BLOCK_OFFSET
                } else {
                    SGL_TRANSPORT_DATA_BLOCK
                };
                (sqe.prp1, sqe.prp2) = sgl1(0, len, kind);
                flight.out = bytes;
            }
            Data::FromController(len) => {
                let l = u32::try_from(len).map_err(|_| too_large(len))?;
                (sqe.prp1, sqe.prp2) = sgl1(0, l, SGL_TRANSPORT_DATA_BLOCK);
                flight.data = vec![0; len];
                flight.reads = true;
            }
        }
        let in_capsule: &[u8] = if flight.in_capsule { &flight.out } else { &[] };
        let pdu = encode::capsule(&self.conn.negotiated(), &sqe, in_capsule);
        self.slots[cid as usize] = Some(flight);
        // Sent with the next wait for replies, so a batch of submissions goes out together.
        if let Err(e) = self.conn.send_later(&pdu) {
            self.failed = true;
            return Err(e);
        }
        Ok(())
    }

    /// Handles what arrives until at least one command is done or `wait` passed (bounded by
    /// it, and by the oldest command's deadline); returns the commands done, perhaps none.
    pub fn poll(&mut self, wait: Duration) -> Result<Vec<Done>, TcpError> {
        self.check_live()?;
        let mut done = Vec::new();
        let until = Instant::now() + wait;
        while done.is_empty() {
            let pdu = match self.conn.recv_until(until) {
                Ok(Some(p)) => p,
                Ok(None) => break,
                Err(e) => {
                    self.failed = true;
                    return Err(e);
                }
            };
            if let Err(e) = self.handle(pdu, &mut done) {
                self.failed = true;
                return Err(e);
            }
            // Whatever else is already here, without waiting.
            loop {
                match self.conn.recv_until(Instant::now()) {
                    Ok(Some(p)) => {
                        if let Err(e) = self.handle(p, &mut done) {
                            self.failed = true;
                            return Err(e);
                        }
                    }
                    Ok(None) => break,
                    Err(e) => {
                        self.failed = true;
                        return Err(e);
                    }
                }
            }
        }
        // Every call, so that a command stuck behind others that keep completing is noticed.
        self.check_deadlines()?;
        Ok(done)
    }

    /// Runs one command to its end (every other command in flight is completed meanwhile
    /// and dropped: use it on a queue with nothing else in flight).
    pub fn run(&mut self, sqe: Command, data: Data) -> Result<Done, TcpError> {
        const TAG: u64 = u64::MAX;
        self.submit(TAG, sqe, data)?;
        loop {
            for d in self.poll(self.timeout)? {
                if d.tag == TAG {
                    return Ok(d);
                }
            }
        }
    }

    fn check_deadlines(&mut self) -> Result<(), TcpError> {
        let now = Instant::now();
        if self.slots.iter().flatten().any(|f| now >= f.deadline) {
            self.failed = true;
            return Err(TcpError::Timeout {
                waiting: "completion of a command",
                after: self.timeout,
            });
        }
        Ok(())
    }

    fn fatal(&mut self, fes: Fes, fei: u32, why: String) -> TcpError {
        self.conn.fail(Fatal { fes, fei, why }, &[])
    }

    fn in_flight_slot(&mut self, cid: u16, what: &str) -> Result<&mut InFlight, TcpError> {
        let live = self.slots.get(cid as usize).is_some_and(|s| s.is_some());
        if !live {
            return Err(self.fatal(
                Fes::PDU_SEQUENCE_ERROR,
                8,
                format!("a {what} for command {cid}, which is not in flight"),
            ));
        }
        Ok(self.slots[cid as usize].as_mut().expect("checked above"))
    }

    fn handle(&mut self, pdu: Pdu, done: &mut Vec<Done>) -> Result<(), TcpError> {
        match pdu {
            Pdu::CapsuleResp(c) => {
                self.in_flight_slot(c.cid, "CapsuleResp")?;
                let f = self.slots[c.cid as usize].take().expect("checked");
                self.free.push(c.cid);
                done.push(Self::finish(f, c));
            }
            Pdu::C2hData {
                header,
                data,
                digest_ok,
            } => {
                let cid = header.cccid;
                let f = self.in_flight_slot(cid, "C2HData")?;
                let (at, len) = (header.datao as usize, data.len());
                let fits = f.reads && at == f.received && at + len <= f.data.len();
                if !fits {
                    let why = format!(
                        "C2HData for command {cid} at {at}+{len}: it expects {} bytes, {} received{}",
                        f.data.len(),
                        f.received,
                        if f.reads { "" } else { " (it reads nothing)" }
                    );
                    return Err(self.fatal(Fes::DATA_OUT_OF_RANGE, 12, why));
                }
                f.data[at..at + len].copy_from_slice(&data);
                f.received += len;
                f.digest_failed |= !digest_ok;
                if header.ch.flags.success() {
                    if f.received != f.data.len() {
                        let why = format!(
                            "SUCCESS on command {cid} after {} of its {} bytes",
                            f.received,
                            f.data.len()
                        );
                        return Err(self.fatal(Fes::PDU_SEQUENCE_ERROR, 1, why));
                    }
                    let f = self.slots[cid as usize].take().expect("checked");
                    self.free.push(cid);
                    let c = Completion {
                        dw0: 0,
                        dw1: 0,
                        sqhd: 0,
                        sqid: self.qid,
                        cid,
                        status: CqeStatus::new(),
                    };
                    done.push(Self::finish(f, c));
                }
            }
            Pdu::R2t(r) => {
                let cid = r.cccid;
                let maxh2c = self.conn.negotiated().maxh2cdata as usize;
                let neg = self.conn.negotiated();
                let f = self.in_flight_slot(cid, "R2T")?;
                let (at, len) = (r.r2to as usize, r.r2tl as usize);
                if f.in_capsule || len == 0 || at + len > f.out.len() {
                    let why = format!(
                        "an R2T for {at}+{len} of command {cid}, which has {} bytes to send{}",
                        f.out.len(),
                        if f.in_capsule {
                            " (all of them in its capsule)"
                        } else {
                            ""
                        }
                    );
                    return Err(self.fatal(Fes::DATA_OUT_OF_RANGE, 12, why));
                }
                // H2CData PDUs of at most MAXH2CDATA bytes, the last flagged.
                let mut pdus = Vec::new();
                let mut off = at;
                while off < at + len {
                    let n = (at + len - off).min(maxh2c);
                    let last = off + n == at + len;
                    pdus.push(encode::h2c_data(
                        &neg,
                        cid,
                        r.ttag,
                        off as u32,
                        &f.out[off..off + n],
                        last,
                    ));
                    off += n;
                }
                for p in pdus {
                    self.conn.send(&p)?;
                }
            }
            Pdu::IcResp(_) => {
                return Err(self.fatal(
                    Fes::PDU_SEQUENCE_ERROR,
                    0,
                    "an ICResp on a live connection".into(),
                ));
            }
            Pdu::TermReq { fes, fei } => return Err(TcpError::Terminated { fes, fei }),
        }
        Ok(())
    }

    fn finish(f: InFlight, completion: Completion) -> Done {
        let mut status = completion.status.status();
        if status.is_success() && (f.digest_failed || f.received < f.data.len()) {
            status = Status::generic(generic::TRANSIENT_TRANSPORT_ERROR);
        }
        Done {
            tag: f.tag,
            completion,
            status,
            data: f.data,
            written: f.out,
        }
    }
}
