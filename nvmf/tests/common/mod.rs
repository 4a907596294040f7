//! A small NVMe/TCP target in threads (a loopback listener on a free port), strict where the
//! spec allows it and able to take the paths SPDK never takes by itself: no SUCCESS flag, no
//! in-capsule data, read data cut into many C2HData PDUs, a write's data asked for by several
//! R2Ts, a small MAXH2CDATA, CPDA padding, digests; and faults (a C2HData for a command not in
//! flight or outside its buffer, a TermReq, silence, the socket closed mid-command).
#![allow(dead_code)]

use std::io::{Read, Write};
use std::net::{SocketAddr, TcpListener, TcpStream};
use std::sync::{Arc, Mutex};
use std::time::Duration;

/// How the target behaves.
#[derive(Clone, Debug)]
pub struct Knobs {
    /// The last C2HData of a read carries SUCCESS (no CapsuleResp follows).
    pub success_flag: bool,
    /// Writes travel in the capsule up to this many bytes (IOCCSZ); 0: none.
    pub in_capsule: usize,
    /// Bytes per C2HData PDU.
    pub c2h_piece: usize,
    /// Bytes per R2T.
    pub r2t_piece: usize,
    /// MAXH2CDATA in the ICResp.
    pub maxh2cdata: u32,
    /// CPDA in the ICResp.
    pub cpda: u8,
    /// Digests granted when asked.
    pub digests: bool,
    /// MDTS (2^MDTS pages of 4 KiB).
    pub mdts: u8,
    /// Namespace 1: blocks and block size.
    pub blocks: u64,
    pub lba_size: u32,
    /// A fault to commit at the first Read of an I/O queue.
    pub fault: Option<Fault>,
    /// The discovery log's entries: (trtype, subtype, NQN, address, port).
    pub discovery: Vec<(u8, u8, String, String, String)>,
    /// Log reads after which the discovery log's generation counter changes (once).
    pub genctr_changes_after: Option<usize>,
}

impl Default for Knobs {
    fn default() -> Self {
        Self {
            success_flag: true,
            in_capsule: 4096,
            c2h_piece: 128 << 10,
            r2t_piece: 128 << 10,
            maxh2cdata: 128 << 10,
            cpda: 0,
            digests: true,
            mdts: 5,
            blocks: 4096,
            lba_size: 512,
            fault: None,
            discovery: Vec::new(),
            genctr_changes_after: None,
        }
    }
}

/// What goes wrong at the first Read of an I/O queue.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Fault {
    /// A C2HData for a CID not in flight.
    UnknownCid,
    /// A C2HData past the end of the command's data.
    OutOfRange,
    /// A C2HTermReq.
    TermReq,
    /// Nothing more is sent.
    Silent,
    /// The socket is closed.
    Close,
    /// The read's data arrives with a wrong data digest (with data digests on).
    BadDigest,
}

/// What the target saw, for the tests to check.
#[derive(Debug, Default)]
pub struct Seen {
    /// H2CData PDUs received and the largest one's data.
    pub h2c_pdus: usize,
    pub largest_h2c: usize,
    /// R2Ts sent.
    pub r2ts: usize,
    /// Writes whose data came in the capsule.
    pub in_capsule_writes: usize,
    /// Keep Alive commands.
    pub keep_alives: usize,
    /// Connects, by queue id.
    pub connects: Vec<u16>,
    /// The last CC written.
    pub cc: u32,
    /// Get Log Page commands of the discovery log.
    pub log_reads: usize,
}

pub struct Target {
    pub addr: SocketAddr,
    pub seen: Arc<Mutex<Seen>>,
    pub media: Arc<Mutex<Vec<u8>>>,
}

pub fn start(k: Knobs) -> Target {
    let l = TcpListener::bind("127.0.0.1:0").unwrap();
    let addr = l.local_addr().unwrap();
    let seen = Arc::new(Mutex::new(Seen::default()));
    let media = Arc::new(Mutex::new(vec![
        0u8;
        (k.blocks * k.lba_size as u64) as usize
    ]));
    let state = Arc::new(Mutex::new((0u32, 0u32))); // CC, and whether a shutdown was asked
    let (s2, m2) = (seen.clone(), media.clone());
    std::thread::spawn(move || {
        for stream in l.incoming() {
            let Ok(stream) = stream else { return };
            let (k, seen, media, state) = (k.clone(), s2.clone(), m2.clone(), state.clone());
            std::thread::spawn(move || {
                let _ = serve(stream, &k, &seen, &media, &state);
            });
        }
    });
    Target { addr, seen, media }
}

fn crc(b: &[u8]) -> [u8; 4] {
    crc32c::crc32c(b).to_le_bytes()
}

struct Conn {
    s: TcpStream,
    hd: bool,
    dd: bool,
    cpda: u8,
    hpda: u8,
    /// The next data digest sent is wrong.
    corrupt_digest: bool,
}

impl Conn {
    fn read_pdu(&mut self) -> std::io::Result<Vec<u8>> {
        let mut ch = [0u8; 8];
        self.s.read_exact(&mut ch)?;
        let plen = u32::from_le_bytes(ch[4..8].try_into().unwrap()) as usize;
        let mut rest = vec![0u8; plen - 8];
        self.s.read_exact(&mut rest)?;
        Ok([ch.to_vec(), rest].concat())
    }

    /// A PDU of `header` (its CH's PLEN, PDO and digest flags filled in here) and `data`.
    fn send(&mut self, mut header: Vec<u8>, data: &[u8]) -> std::io::Result<()> {
        let hlen = header.len();
        let hd = if self.hd { 4 } else { 0 };
        let dd = if self.dd && !data.is_empty() { 4 } else { 0 };
        let align = (usize::from(self.hpda) + 1) * 4;
        let pdo = if data.is_empty() {
            0
        } else {
            (hlen + hd).next_multiple_of(align)
        };
        let plen = if data.is_empty() {
            hlen + hd
        } else {
            pdo + data.len() + dd
        };
        header[1] |= u8::from(self.hd) | if dd == 4 { 2 } else { 0 };
        header[3] = pdo as u8;
        header[4..8].copy_from_slice(&(plen as u32).to_le_bytes());
        let mut out = header.clone();
        if self.hd {
            out.extend_from_slice(&crc(&header));
        }
        out.resize(if data.is_empty() { out.len() } else { pdo }, 0);
        out.extend_from_slice(data);
        if dd == 4 {
            let mut d = crc(data);
            if std::mem::take(&mut self.corrupt_digest) {
                d[0] ^= 0xff;
            }
            out.extend_from_slice(&d);
        }
        self.s.write_all(&out)
    }

    fn capsule_resp(&mut self, cid: u16, sqid: u16, dw0: u32, sc: u8) -> std::io::Result<()> {
        let mut h = vec![0x05, 0, 24, 0, 0, 0, 0, 0];
        h.extend_from_slice(&dw0.to_le_bytes());
        h.extend_from_slice(&0u32.to_le_bytes());
        h.extend_from_slice(&0u16.to_le_bytes());
        h.extend_from_slice(&sqid.to_le_bytes());
        h.extend_from_slice(&cid.to_le_bytes());
        h.extend_from_slice(&(u16::from(sc) << 1).to_le_bytes());
        self.send(h, &[])
    }

    fn c2h(&mut self, cid: u16, datao: u32, data: &[u8], flags: u8) -> std::io::Result<()> {
        let mut h = vec![0x07, flags, 24, 0, 0, 0, 0, 0];
        h.extend_from_slice(&cid.to_le_bytes());
        h.extend_from_slice(&[0, 0]);
        h.extend_from_slice(&datao.to_le_bytes());
        h.extend_from_slice(&(data.len() as u32).to_le_bytes());
        h.extend_from_slice(&[0; 4]);
        self.send(h, data)
    }

    fn r2t(&mut self, cid: u16, ttag: u16, off: u32, len: u32) -> std::io::Result<()> {
        let mut h = vec![0x09, 0, 24, 0, 0, 0, 0, 0];
        h.extend_from_slice(&cid.to_le_bytes());
        h.extend_from_slice(&ttag.to_le_bytes());
        h.extend_from_slice(&off.to_le_bytes());
        h.extend_from_slice(&len.to_le_bytes());
        h.extend_from_slice(&[0; 4]);
        self.send(h, &[])
    }

    /// The data part of a host PDU (after the header, its digest and the padding).
    fn data_of<'a>(&self, pdu: &'a [u8]) -> &'a [u8] {
        let pdo = usize::from(pdu[3]);
        if pdo == 0 {
            return &[];
        }
        let end = pdu.len() - if self.dd { 4 } else { 0 };
        &pdu[pdo..end]
    }
}

fn u32_at(b: &[u8], at: usize) -> u32 {
    u32::from_le_bytes(b[at..at + 4].try_into().unwrap())
}

fn serve(
    s: TcpStream,
    k: &Knobs,
    seen: &Mutex<Seen>,
    media: &Mutex<Vec<u8>>,
    state: &Mutex<(u32, u32)>,
) -> std::io::Result<()> {
    s.set_read_timeout(Some(Duration::from_secs(30)))?;
    let mut c = Conn {
        s,
        hd: false,
        dd: false,
        cpda: k.cpda,
        hpda: 0,
        corrupt_digest: false,
    };
    let mut req = [0u8; 128];
    c.s.read_exact(&mut req)?;
    c.hpda = req[10];
    let dgst = if k.digests { req[11] & 3 } else { 0 };
    let mut resp = vec![0x01, 0, 128, 0, 128, 0, 0, 0, 0, 0, k.cpda, dgst];
    resp.extend_from_slice(&k.maxh2cdata.to_le_bytes());
    resp.resize(128, 0);
    c.s.write_all(&resp)?;
    (c.hd, c.dd) = (dgst & 1 != 0, dgst & 2 != 0);
    let mut qid = 0u16;
    let mut faulted = false;
    // Capsules that arrived while a write's data was awaited (a host may pipeline them).
    let mut backlog = std::collections::VecDeque::new();
    loop {
        let pdu = match backlog.pop_front() {
            Some(p) => p,
            None => c.read_pdu()?,
        };
        if pdu[0] != 0x04 {
            // A TermReq from the host, or something this target does not take: stop.
            return Ok(());
        }
        let sqe = pdu[8..72].to_vec();
        let opcode = sqe[0];
        let cid = u16::from_le_bytes([sqe[2], sqe[3]]);
        let nsid = u32_at(&sqe, 4);
        let (cdw10, cdw11, cdw12) = (u32_at(&sqe, 40), u32_at(&sqe, 44), u32_at(&sqe, 48));
        let capsule_data = c.data_of(&pdu).to_vec();
        if opcode == 0x7f {
            match nsid as u8 {
                0x01 => {
                    qid = (cdw10 >> 16) as u16;
                    seen.lock().unwrap().connects.push(qid);
                    c.capsule_resp(cid, 0, 1, 0)?;
                }
                0x04 => {
                    let (cc, _) = *state.lock().unwrap();
                    let v: u64 = match cdw11 {
                        // CAP: MQES 127, CQR, TO 1 (500 ms), CSS NVM.
                        0x0 => 127 | 1 << 16 | 1 << 24 | 1 << 37,
                        0x8 => 0x0001_0300,
                        0x14 => u64::from(cc),
                        // CSTS: RDY follows EN; SHST complete once SHN was written.
                        0x1c => u64::from(cc & 1) | if (cc >> 14) & 3 != 0 { 2 << 2 } else { 0 },
                        _ => 0,
                    };
                    let mut h = vec![0x05, 0, 24, 0, 0, 0, 0, 0];
                    h.extend_from_slice(&v.to_le_bytes());
                    h.extend_from_slice(&0u16.to_le_bytes());
                    h.extend_from_slice(&0u16.to_le_bytes());
                    h.extend_from_slice(&cid.to_le_bytes());
                    h.extend_from_slice(&0u16.to_le_bytes());
                    c.send(h, &[])?;
                }
                0x00 => {
                    state.lock().unwrap().0 = cdw12;
                    seen.lock().unwrap().cc = cdw12;
                    c.capsule_resp(cid, 0, 0, 0)?;
                }
                _ => c.capsule_resp(cid, 0, 0, 0x01)?,
            }
            continue;
        }
        if qid == 0 {
            match opcode {
                0x06 => {
                    let mut id = vec![0u8; 4096];
                    if cdw10 & 0xff == 1 {
                        id[4..12].copy_from_slice(b"FAKE0001");
                        id[24..36].copy_from_slice(b"gpunvme fake");
                        id[77] = k.mdts;
                        let ioccsz = (64 + k.in_capsule as u32) / 16;
                        id[1792..1796].copy_from_slice(&ioccsz.to_le_bytes());
                    } else {
                        id[0..8].copy_from_slice(&k.blocks.to_le_bytes());
                        id[8..16].copy_from_slice(&k.blocks.to_le_bytes());
                        id[130] = k.lba_size.trailing_zeros() as u8;
                    }
                    send_read(&mut c, k, cid, qid, &id)?;
                }
                0x02 if cdw10 & 0xff == 0x70 => {
                    let reads = {
                        let mut s = seen.lock().unwrap();
                        s.log_reads += 1;
                        s.log_reads
                    };
                    let genctr: u64 = match k.genctr_changes_after {
                        Some(n) if reads > n => 8,
                        _ => 7,
                    };
                    let mut log = vec![0u8; 1024 * (1 + k.discovery.len())];
                    log[0..8].copy_from_slice(&genctr.to_le_bytes());
                    log[8..16].copy_from_slice(&(k.discovery.len() as u64).to_le_bytes());
                    for (i, (trtype, subtype, nqn, addr, port)) in k.discovery.iter().enumerate() {
                        let e = &mut log[1024 * (i + 1)..1024 * (i + 2)];
                        (e[0], e[1], e[2]) = (*trtype, 1, *subtype);
                        e[32..32 + port.len()].copy_from_slice(port.as_bytes());
                        e[256..256 + nqn.len()].copy_from_slice(nqn.as_bytes());
                        e[512..512 + addr.len()].copy_from_slice(addr.as_bytes());
                    }
                    let len = (((cdw10 >> 16) | (cdw11 & 0xffff) << 16) as usize + 1) * 4;
                    let off = (u64::from(cdw12) | u64::from(u32_at(&sqe, 52)) << 32) as usize;
                    let mut part = log.get(off..).unwrap_or(&[]).to_vec();
                    part.resize(len, 0);
                    send_read(&mut c, k, cid, qid, &part)?;
                }
                0x09 => c.capsule_resp(cid, 0, 3 | 3 << 16, 0)?,
                0x18 => {
                    seen.lock().unwrap().keep_alives += 1;
                    c.capsule_resp(cid, 0, 0, 0)?;
                }
                _ => c.capsule_resp(cid, 0, 0, 0x01)?,
            }
            continue;
        }
        let lba = u64::from(cdw10) | u64::from(cdw11) << 32;
        let len = ((cdw12 & 0xffff) as usize + 1) * k.lba_size as usize;
        let at = lba as usize * k.lba_size as usize;
        if at + len > media.lock().unwrap().len() {
            c.capsule_resp(cid, qid, 0, 0x80)?;
            continue;
        }
        match opcode {
            0x02 => {
                if let (Some(f), false) = (k.fault, faulted) {
                    faulted = true;
                    match f {
                        Fault::UnknownCid => c.c2h(cid ^ 0x200, 0, &[0; 512], 0x04)?,
                        Fault::OutOfRange => c.c2h(cid, len as u32, &[0; 512], 0x04)?,
                        Fault::TermReq => {
                            let mut h = vec![0x03, 0, 24, 0, 24, 0, 0, 0, 0x01, 0];
                            h.resize(24, 0);
                            c.s.write_all(&h)?;
                        }
                        Fault::Silent => {
                            std::thread::sleep(Duration::from_secs(5));
                        }
                        Fault::Close => return Ok(()),
                        Fault::BadDigest => {
                            c.corrupt_digest = true;
                            let data = media.lock().unwrap()[at..at + len].to_vec();
                            send_read(&mut c, k, cid, qid, &data)?;
                        }
                    }
                    continue;
                }
                let data = media.lock().unwrap()[at..at + len].to_vec();
                send_read(&mut c, k, cid, qid, &data)?;
            }
            0x01 => {
                if !capsule_data.is_empty() {
                    seen.lock().unwrap().in_capsule_writes += 1;
                    media.lock().unwrap()[at..at + len].copy_from_slice(&capsule_data[..len]);
                } else {
                    let mut got = 0;
                    let mut ttag = 0u16;
                    while got < len {
                        let n = (len - got).min(k.r2t_piece);
                        c.r2t(cid, ttag, got as u32, n as u32)?;
                        seen.lock().unwrap().r2ts += 1;
                        let mut recv = 0;
                        while recv < n {
                            let p = c.read_pdu()?;
                            if p[0] == 0x04 {
                                backlog.push_back(p);
                                continue;
                            }
                            assert_eq!(p[0], 0x06, "H2CData expected");
                            let hd = c.data_of(&p).to_vec();
                            let datao = u32_at(&p, 12) as usize;
                            assert_eq!(u16::from_le_bytes([p[10], p[11]]), ttag);
                            assert!(
                                hd.len() <= k.maxh2cdata as usize,
                                "H2CData above MAXH2CDATA"
                            );
                            // CPDA: the data starts at a multiple of (CPDA + 1) * 4.
                            assert_eq!(usize::from(p[3]) % ((usize::from(k.cpda) + 1) * 4), 0);
                            let mut s = seen.lock().unwrap();
                            s.h2c_pdus += 1;
                            s.largest_h2c = s.largest_h2c.max(hd.len());
                            drop(s);
                            media.lock().unwrap()[at + datao..at + datao + hd.len()]
                                .copy_from_slice(&hd);
                            recv += hd.len();
                        }
                        got += n;
                        ttag = ttag.wrapping_add(1);
                    }
                }
                c.capsule_resp(cid, qid, 0, 0)?;
            }
            _ => c.capsule_resp(cid, qid, 0, 0x01)?,
        }
    }
}

/// A command's read data in C2HData PDUs of `c2h_piece` bytes, then a CapsuleResp unless
/// the last PDU carried SUCCESS.
fn send_read(c: &mut Conn, k: &Knobs, cid: u16, qid: u16, data: &[u8]) -> std::io::Result<()> {
    let mut off = 0;
    while off < data.len() {
        let n = (data.len() - off).min(k.c2h_piece);
        let last = off + n == data.len();
        let flags = if last {
            0x04 | if k.success_flag { 0x08 } else { 0 }
        } else {
            0
        };
        c.c2h(cid, off as u32, &data[off..off + n], flags)?;
        off += n;
    }
    if !k.success_flag {
        c.capsule_resp(cid, qid, 0, 0)?;
    }
    Ok(())
}
