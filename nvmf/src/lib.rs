//! An NVMe over Fabrics initiator (issue: storage beyond one host), NVMe/TCP so far:
//! [`tcp::codec`], the sans-io codec (PDUs encoded with their digests and padding; an
//! incremental decoder that checks every header field a target sends before anything is
//! believed, naming the Fatal Error Status and Field for the H2CTermReq); [`tcp::conn`], one
//! connection (negotiation, bounded receive); [`tcp::queue`], one queue with many commands in
//! flight (C2HData, R2T/H2CData, in-capsule writes); [`host`], a controller brought up over
//! it (Connect, Property Get/Set, CSTS, Identify, Keep Alive, I/O queues, shutdown). Discovery
//! and the driver's transport seam come next (`../shared/design/nvme-tcp.md`, section 4).
#![forbid(unsafe_code)]

pub mod discovery;
pub mod host;
pub mod tcp;
