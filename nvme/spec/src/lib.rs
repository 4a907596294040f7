//! NVMe specification data types: controller registers, queue entries, opcodes, command dwords,
//! status codes, Identify data structures and log pages.
//!
//! Layer: the bottom of gpunvme. Data only, no I/O, `no_std`, no `unsafe`. Shared by the driver
//! (`nvme`), the software controller (`nvme_emu`) and the GPU runtime (`gpu_queues`, whose
//! device header is checked against [`wire`]).
//!
//! Spec revisions: [NVM Express Base Specification 2.0](https://nvmexpress.org/specifications/)
//! and NVM Command Set Specification 1.0. Names follow the spec's mnemonics; zero-based fields
//! carry a `_z` suffix (`nlb_z`, `qsize_z`, `mqes_z`).
//!
//! # Architecture
//! - [`registers`]: register offsets, CAP/VS/CC/CSTS/AQA bitfields, doorbell arithmetic.
//! - [`command`]: the 64-byte [`Command`] (SQE), opcodes, command dword bitfields, DSM ranges.
//! - [`completion`]: the 16-byte [`Completion`] (CQE) and its [`CqeStatus`].
//! - [`status`]: status code types, codes and names, and the decoded [`Status`].
//! - [`identify`]: Identify Controller / Namespace / Active Namespace list.
//! - [`log`]: Error Information and SMART / Health log pages.
//! - [`fabrics`]: NVMe over Fabrics commands (Connect and its data, Property Get/Set) and
//!   status codes; [`tcp`]: the NVMe/TCP PDUs' headers.
//! - [`wire`]: byte offsets and sizes of every SQE and CQE field, the doorbell base and
//!   stride: the one definition that byte-level writers (the driver's queue engine, the
//!   software controller, the GPU header) share, tested against the structs with `offset_of!`.
//!
//! Every struct that crosses the wire is `#[repr(C)]`, derives zerocopy's traits and has a size
//! assertion; the tests check field offsets against the spec's byte offsets. Multi-byte fields
//! are little endian, so the crate refuses to build for big-endian targets.
//!
//! # Not implemented
//! SGLs beyond the NVMe/TCP descriptor ([`tcp::sgl1`]), the discovery log page,
//! authentication, metadata/protection information, zoned and key-value command sets.
#![no_std]
#![forbid(unsafe_code)]

#[cfg(target_endian = "big")]
compile_error!("nvme_spec declares little-endian wire structures with native integers");

pub mod command;
pub mod completion;
pub mod fabrics;
pub mod identify;
pub mod log;
pub mod registers;
pub mod status;
pub mod tcp;
pub mod wire;

pub use command::{AdminOpcode, Cns, Command, DsmRange, FeatureId, LogPageId, NvmOpcode};
pub use completion::{Completion, CqeStatus};
pub use identify::{
    ActiveNamespaceList, Csi, IdentifyController, IdentifyNamespace, LbaFormat, Oncs, Protection,
    descriptor_csi,
};
pub use log::{ErrorInformationLogEntry, SmartHealthLog};
pub use registers::{Aqa, Cap, Cc, Csts, Vs};
pub use status::{Status, StatusCodeType, status_name};
