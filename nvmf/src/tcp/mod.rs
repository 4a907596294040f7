//! NVMe/TCP (the NVMe/TCP Transport Specification; PDU layouts in `nvme_spec::tcp`).

pub mod codec;
pub mod conn;
pub mod queue;
