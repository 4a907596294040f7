//! The vfio-user message channel: one Unix stream socket to the server, one request in flight at
//! a time, every wait bounded.
//!
//! A request is sent whole (with at most one file descriptor as `SCM_RIGHTS`) and its reply read
//! whole before the next request may start, so replies cannot be confused: each must carry the
//! request's message id and command, or the channel is declared broken. The socket's send and
//! receive timeouts bound each system call, and a deadline bounds each reply as a whole, so a
//! server that stops answering costs at most the configured timeout. A channel that failed in
//! transport (timeout, closed connection, malformed reply) stays failed: later requests get the
//! first failure's reason at once instead of reading a stream whose framing is lost. A server's
//! error reply (the error flag with an errno) is a normal answer and leaves the channel usable.
#![forbid(unsafe_code)]

use std::io::{IoSlice, IoSliceMut};
use std::mem::MaybeUninit;
use std::os::fd::{BorrowedFd, OwnedFd};
use std::os::unix::fs::FileTypeExt;
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::sync::{Mutex, MutexGuard};
use std::time::{Duration, Instant};

use rustix::io::Errno;
use rustix::net::{
    RecvAncillaryBuffer, RecvAncillaryMessage, RecvFlags, SendAncillaryBuffer,
    SendAncillaryMessage, SendFlags,
};
use zerocopy::{FromBytes, IntoBytes};

use super::proto::{self, Command, HEADER_SIZE, Header};
use crate::Error;

/// A reply's payload (the bytes after the header) and the descriptors that came with it.
#[derive(Debug)]
pub(crate) struct Reply {
    /// Bytes after the header.
    pub payload: Vec<u8>,
    /// File descriptors passed with the reply (`SCM_RIGHTS`), in order.
    pub fds: Vec<OwnedFd>,
}

struct Channel {
    stream: UnixStream,
    next_id: u16,
    /// Why the channel stopped working, once it has.
    broken: Option<String>,
}

/// A connection to a vfio-user server.
pub(crate) struct Client {
    path: PathBuf,
    timeout: Duration,
    channel: Mutex<Channel>,
}

impl std::fmt::Debug for Client {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Client")
            .field("path", &self.path)
            .field("timeout", &self.timeout)
            .finish()
    }
}

/// Why an exchange failed.
enum Failure {
    /// The channel is unusable from now on.
    Transport(String),
    /// The reply is not what was asked for; the channel is unusable from now on.
    Protocol(String),
    /// The server answered with an error; the channel is fine.
    Refused(i32),
}

impl Client {
    /// Connects to the server listening at `path`. Each later request waits at most `timeout`
    /// for its reply.
    pub(crate) fn connect(path: &Path, timeout: Duration) -> Result<Self, Error> {
        let meta = std::fs::metadata(path).map_err(|source| Error::VfioUserConnect {
            path: path.to_owned(),
            source,
        })?;
        if !meta.file_type().is_socket() {
            return Err(Error::VfioUserNotSocket {
                path: path.to_owned(),
            });
        }
        let stream = UnixStream::connect(path).map_err(|source| Error::VfioUserConnect {
            path: path.to_owned(),
            source,
        })?;
        let io = |source| Error::VfioUserConnect {
            path: path.to_owned(),
            source,
        };
        stream.set_read_timeout(Some(timeout)).map_err(io)?;
        stream.set_write_timeout(Some(timeout)).map_err(io)?;
        Ok(Self {
            path: path.to_owned(),
            timeout,
            channel: Mutex::new(Channel {
                stream,
                next_id: 0,
                broken: None,
            }),
        })
    }

    /// The socket's path.
    pub(crate) fn path(&self) -> &Path {
        &self.path
    }

    fn lock(&self) -> MutexGuard<'_, Channel> {
        // A panic while holding the lock cannot leave the channel half-updated in a way that
        // matters: a half-sent or half-read message marks it broken before anything else.
        self.channel.lock().unwrap_or_else(|e| e.into_inner())
    }

    /// Sends `command` with `payload` (and `fd`, if any) and returns the server's reply.
    pub(crate) fn request(
        &self,
        command: Command,
        payload: &[&[u8]],
        fd: Option<BorrowedFd<'_>>,
    ) -> Result<Reply, Error> {
        let mut ch = self.lock();
        if let Some(why) = &ch.broken {
            return Err(Error::VfioUserGone {
                path: self.path.clone(),
                what: format!(
                    "{} not sent: an earlier request failed ({why})",
                    command.name()
                ),
            });
        }
        let id = ch.next_id;
        ch.next_id = ch.next_id.wrapping_add(1);
        let deadline = Instant::now() + self.timeout;
        match exchange(&ch.stream, command, id, payload, fd, deadline, self.timeout) {
            Ok(reply) => Ok(reply),
            Err(Failure::Refused(errno)) => Err(Error::VfioUserRefused {
                path: self.path.clone(),
                command: command.name(),
                source: std::io::Error::from_raw_os_error(errno),
            }),
            Err(Failure::Transport(what)) => {
                ch.broken = Some(what.clone());
                Err(Error::VfioUserGone {
                    path: self.path.clone(),
                    what,
                })
            }
            Err(Failure::Protocol(what)) => {
                ch.broken = Some(what.clone());
                Err(Error::VfioUserProtocol {
                    path: self.path.clone(),
                    command: command.name(),
                    what,
                })
            }
        }
    }
}

fn exchange(
    stream: &UnixStream,
    command: Command,
    id: u16,
    payload: &[&[u8]],
    fd: Option<BorrowedFd<'_>>,
    deadline: Instant,
    timeout: Duration,
) -> Result<Reply, Failure> {
    let size = HEADER_SIZE + payload.iter().map(|p| p.len()).sum::<usize>();
    let header = Header {
        message_id: id,
        command: command as u16,
        message_size: u32::try_from(size).map_err(|_| {
            Failure::Protocol(format!("a {size}-byte message is too large to send"))
        })?,
        flags: proto::FLAG_TYPE_COMMAND,
        error: 0,
    };
    let mut message = Vec::with_capacity(size);
    message.extend_from_slice(header.as_bytes());
    for p in payload {
        message.extend_from_slice(p);
    }
    send_all(stream, &message, fd, command, deadline, timeout)?;

    let mut fds = Vec::new();
    let mut head = [0u8; HEADER_SIZE];
    recv_exact(stream, &mut head, &mut fds, command, deadline, timeout)?;
    let reply = Header::read_from_bytes(&head).expect("16 bytes");
    let size = reply.message_size as usize;
    if !(HEADER_SIZE..=proto::MAX_MESSAGE).contains(&size) {
        return Err(Failure::Protocol(format!(
            "message size {size} outside {HEADER_SIZE}..={}",
            proto::MAX_MESSAGE
        )));
    }
    let mut rest = vec![0u8; size - HEADER_SIZE];
    recv_exact(stream, &mut rest, &mut fds, command, deadline, timeout)?;
    if reply.flags & proto::FLAG_TYPE_MASK != proto::FLAG_TYPE_REPLY {
        return Err(Failure::Protocol(format!(
            "the server sent command {} instead of a reply (this client serves no requests: \
             all of its DMA memory is shared as file descriptors)",
            reply.command
        )));
    }
    if reply.message_id != id || reply.command != command as u16 {
        return Err(Failure::Protocol(format!(
            "reply has message id {} and command {}, expected {id} and {}",
            reply.message_id, reply.command, command as u16
        )));
    }
    if reply.flags & proto::FLAG_ERROR != 0 {
        // errno 0 with the error flag set would read as "success"; report it as EIO.
        let errno = i32::try_from(reply.error)
            .ok()
            .filter(|&e| e > 0)
            .unwrap_or(libc::EIO);
        return Err(Failure::Refused(errno));
    }
    Ok(Reply { payload: rest, fds })
}

fn timed_out(command: Command, timeout: Duration, doing: &str) -> Failure {
    Failure::Transport(format!(
        "no progress {doing} {} within {:.1} s (the server is stuck, or another client holds \
         the device)",
        command.name(),
        timeout.as_secs_f64()
    ))
}

/// What a failed send or receive means: nothing (EINTR: try again), a timeout (EAGAIN: the
/// socket's timeout ran out) or a broken connection.
fn io_failure(e: Errno, command: Command, timeout: Duration, doing: &str) -> Option<Failure> {
    match e {
        Errno::INTR => None,
        Errno::AGAIN => Some(timed_out(command, timeout, doing)),
        e => Some(Failure::Transport(format!(
            "{doing} {}: {}",
            command.name(),
            std::io::Error::from(e)
        ))),
    }
}

fn send_all(
    stream: &UnixStream,
    mut bytes: &[u8],
    fd: Option<BorrowedFd<'_>>,
    command: Command,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), Failure> {
    let fds: Vec<BorrowedFd<'_>> = fd.into_iter().collect();
    let mut first = true;
    while !bytes.is_empty() {
        if Instant::now() > deadline {
            return Err(timed_out(command, timeout, "sending"));
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(1))];
        let mut control = SendAncillaryBuffer::new(&mut space);
        // The descriptor travels with the first bytes of the message, as the server expects.
        if first && !fds.is_empty() && !control.push(SendAncillaryMessage::ScmRights(&fds)) {
            return Err(Failure::Protocol("no room for a descriptor".into()));
        }
        // NOSIGNAL: a server that went away must give EPIPE, not kill this process with SIGPIPE
        // (which a Python or C host may not ignore).
        match rustix::net::sendmsg(
            stream,
            &[IoSlice::new(bytes)],
            &mut control,
            SendFlags::NOSIGNAL,
        ) {
            Ok(0) => {
                return Err(Failure::Transport(
                    "the server closed the connection".into(),
                ));
            }
            Ok(n) => {
                bytes = &bytes[n..];
                first = false;
            }
            Err(e) => {
                if let Some(f) = io_failure(e, command, timeout, "sending") {
                    return Err(f);
                }
            }
        }
    }
    Ok(())
}

fn recv_exact(
    stream: &UnixStream,
    buf: &mut [u8],
    fds: &mut Vec<OwnedFd>,
    command: Command,
    deadline: Instant,
    timeout: Duration,
) -> Result<(), Failure> {
    let mut got = 0;
    while got < buf.len() {
        if Instant::now() > deadline {
            return Err(timed_out(command, timeout, "awaiting the reply to"));
        }
        let mut space = [MaybeUninit::uninit(); rustix::cmsg_space!(ScmRights(8))];
        let mut control = RecvAncillaryBuffer::new(&mut space);
        let r = rustix::net::recvmsg(
            stream,
            &mut [IoSliceMut::new(&mut buf[got..])],
            &mut control,
            RecvFlags::CMSG_CLOEXEC,
        );
        match r {
            Ok(m) if m.bytes == 0 => {
                return Err(Failure::Transport(format!(
                    "the server closed the connection before replying to {}",
                    command.name()
                )));
            }
            Ok(m) => {
                got += m.bytes;
                for msg in control.drain() {
                    if let RecvAncillaryMessage::ScmRights(passed) = msg {
                        fds.extend(passed);
                    }
                }
                if m.flags.contains(rustix::net::ReturnFlags::CTRUNC) {
                    return Err(Failure::Protocol(
                        "the server passed more than 8 descriptors with one message".into(),
                    ));
                }
            }
            Err(e) => {
                if let Some(f) = io_failure(e, command, timeout, "awaiting the reply to") {
                    return Err(f);
                }
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::{Read, Write};
    use std::os::unix::net::UnixListener;

    fn listener() -> (tempfile::TempDir, PathBuf, UnixListener) {
        let dir = tempfile::tempdir().unwrap();
        let path = dir.path().join("cntrl");
        let l = UnixListener::bind(&path).unwrap();
        (dir, path, l)
    }

    fn read_request(s: &mut UnixStream) -> (Header, Vec<u8>) {
        let mut head = [0u8; HEADER_SIZE];
        s.read_exact(&mut head).unwrap();
        let h = Header::read_from_bytes(&head).unwrap();
        let mut rest = vec![0u8; h.message_size as usize - HEADER_SIZE];
        s.read_exact(&mut rest).unwrap();
        (h, rest)
    }

    fn reply(s: &mut UnixStream, to: &Header, flags: u32, error: u32, payload: &[u8]) {
        let h = Header {
            message_id: to.message_id,
            command: to.command,
            message_size: (HEADER_SIZE + payload.len()) as u32,
            flags,
            error,
        };
        s.write_all(h.as_bytes()).unwrap();
        s.write_all(payload).unwrap();
    }

    #[test]
    fn replies_are_matched_and_errors_typed() {
        let (_d, path, l) = listener();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let (h, body) = read_request(&mut s);
            assert_eq!(h.command, Command::RegionRead as u16);
            assert_eq!(body, [1, 2, 3]);
            reply(&mut s, &h, proto::FLAG_TYPE_REPLY, 0, &[9, 9]);
            let (h, _) = read_request(&mut s);
            reply(
                &mut s,
                &h,
                proto::FLAG_TYPE_REPLY | proto::FLAG_ERROR,
                libc::EINVAL as u32,
                &[],
            );
            // Still usable after an error reply; then a reply with the wrong id.
            let (h, _) = read_request(&mut s);
            let wrong = Header {
                message_id: h.message_id.wrapping_add(5),
                ..h
            };
            reply(&mut s, &wrong, proto::FLAG_TYPE_REPLY, 0, &[]);
        });
        let c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let r = c.request(Command::RegionRead, &[&[1, 2, 3]], None).unwrap();
        assert_eq!(r.payload, [9, 9]);
        let e = c.request(Command::RegionWrite, &[], None).unwrap_err();
        assert!(
            matches!(&e, Error::VfioUserRefused { source, .. } if source.raw_os_error() == Some(libc::EINVAL)),
            "{e}"
        );
        let e = c.request(Command::DeviceReset, &[], None).unwrap_err();
        assert!(matches!(e, Error::VfioUserProtocol { .. }), "{e}");
        // The channel is broken now: the next request fails without touching the socket.
        let e = c.request(Command::DeviceReset, &[], None).unwrap_err();
        assert!(
            matches!(&e, Error::VfioUserGone { what, .. } if what.contains("earlier request")),
            "{e}"
        );
        server.join().unwrap();
    }

    #[test]
    fn a_silent_server_times_out_and_a_vanished_one_is_gone() {
        let (_d, path, l) = listener();
        let server = std::thread::spawn(move || {
            let (mut s, _) = l.accept().unwrap();
            let _ = read_request(&mut s);
            // Say nothing; then, for the second client, hang up.
            std::thread::sleep(Duration::from_millis(600));
            drop(s);
            let (mut s, _) = l.accept().unwrap();
            let _ = read_request(&mut s);
        });
        let c = Client::connect(&path, Duration::from_millis(200)).unwrap();
        let t = Instant::now();
        let e = c.request(Command::DeviceReset, &[], None).unwrap_err();
        assert!(t.elapsed() < Duration::from_secs(2), "bounded wait");
        assert!(
            matches!(&e, Error::VfioUserGone { what, .. } if what.contains("within")),
            "{e}"
        );
        let c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        let e = c.request(Command::DeviceReset, &[], None).unwrap_err();
        assert!(
            matches!(&e, Error::VfioUserGone { what, .. } if what.contains("closed")),
            "{e}"
        );
        server.join().unwrap();
    }

    #[test]
    fn a_missing_socket_or_a_plain_file_is_refused_by_name() {
        let dir = tempfile::tempdir().unwrap();
        let missing = dir.path().join("nope");
        let e = Client::connect(&missing, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::VfioUserConnect { .. }), "{e}");
        assert!(e.to_string().contains("nope"), "{e}");
        let file = dir.path().join("file");
        std::fs::write(&file, b"x").unwrap();
        let e = Client::connect(&file, Duration::from_secs(1)).unwrap_err();
        assert!(matches!(e, Error::VfioUserNotSocket { .. }), "{e}");
    }

    #[test]
    fn a_descriptor_travels_with_the_request() {
        let (_d, path, l) = listener();
        let server = std::thread::spawn(move || {
            let (s, _) = l.accept().unwrap();
            let mut fds = Vec::new();
            let mut head = [0u8; HEADER_SIZE];
            let far = Instant::now() + Duration::from_secs(5);
            recv_exact(
                &s,
                &mut head,
                &mut fds,
                Command::DmaMap,
                far,
                Duration::from_secs(5),
            )
            .map_err(|_| ())
            .unwrap();
            let h = Header::read_from_bytes(&head).unwrap();
            let mut rest = vec![0u8; h.message_size as usize - HEADER_SIZE];
            recv_exact(
                &s,
                &mut rest,
                &mut fds,
                Command::DmaMap,
                far,
                Duration::from_secs(5),
            )
            .map_err(|_| ())
            .unwrap();
            assert_eq!(fds.len(), 1);
            let mut f = std::fs::File::from(fds.pop().unwrap());
            let mut text = String::new();
            f.read_to_string(&mut text).unwrap();
            assert_eq!(text, "shared");
            let mut s = s;
            reply(&mut s, &h, proto::FLAG_TYPE_REPLY, 0, &[]);
        });
        let dir = tempfile::tempdir().unwrap();
        let file_path = dir.path().join("mem");
        std::fs::write(&file_path, b"shared").unwrap();
        let file = std::fs::File::open(&file_path).unwrap();
        let c = Client::connect(&path, Duration::from_secs(5)).unwrap();
        use std::os::fd::AsFd;
        c.request(Command::DmaMap, &[&[0u8; 32]], Some(file.as_fd()))
            .unwrap();
        server.join().unwrap();
    }
}
