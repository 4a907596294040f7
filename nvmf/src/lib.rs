//! An NVMe over Fabrics initiator (issue: storage beyond one host). So far the NVMe/TCP
//! transport's sans-io codec ([`tcp::codec`]): PDUs encoded into bytes with their digests and
//! padding, and an incremental decoder that checks every header field a target sends before
//! anything is believed, naming the Fatal Error Status and Field to send back in an
//! H2CTermReq. Sockets, queue pairs, the controller's bring-up and discovery come next
//! (`../shared/design/nvme-tcp.md`, section 4).
#![forbid(unsafe_code)]

pub mod host;
pub mod tcp;
