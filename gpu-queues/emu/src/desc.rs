//! The structs the emulated controllers share with their kernels, byte for byte: `#[repr(C)]`
//! mirrors of `ptx/emu/gpunvme_emu_kernels.cu` (the software controller's copy descriptors) and
//! `ptx/emu/gpunvme_controller.cuh` (the GPU-resident controller model's tables), checked
//! against their `GPUNVME_*` numbers by the tests below.
#![forbid(unsafe_code)]

use zerocopy::{FromBytes, Immutable, IntoBytes, KnownLayout};

/// The GPU-resident controller model's device code, as committed.
pub const CONTROLLER_CUH: &str = include_str!("../../../ptx/emu/gpunvme_controller.cuh");
/// The emulated controllers' kernels' source, as committed.
pub const EMU_KERNELS_CU: &str = include_str!("../../../ptx/emu/gpunvme_emu_kernels.cu");
/// The emulated controllers' kernels' PTX (nvcc 13.0, compute_80), embedded and JIT-loaded.
pub const EMU_KERNELS_PTX: &str = include_str!("../../../ptx/emu/gpunvme_emu_kernels.ptx");

/// One piece of the software controller's batched copies (`copy_desc`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CopyDesc {
    /// GPU pointer (destination of a scatter, source of a gather).
    pub dst: u64,
    /// Offset in the staging area.
    pub src: u32,
    /// Bytes, with [`COPY_LATE`] for pieces written after all others.
    pub len: u32,
}
const _: () = assert!(size_of::<CopyDesc>() == 16);

/// `CopyDesc::len` flag: written by the scatter's last block, after every other piece.
pub const COPY_LATE: u32 = 0x8000_0000;
/// One queue pair of the GPU-resident controller's table (`gpunvme::ctrl::ctrl_queue`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlQueue {
    /// GPU pointer of the SQ ring (0: no SQ).
    pub sq: u64,
    /// GPU pointer of the CQ ring.
    pub cq: u64,
    /// SQ entries.
    pub sq_entries: u32,
    /// CQ entries.
    pub cq_entries: u32,
    /// Changes whenever the entry describes a new queue.
    pub serial: u32,
    /// Reserved.
    pub reserved: u32,
}
const _: () = assert!(size_of::<CtrlQueue>() == 32);

/// A range of device addresses (= GPU pointers) the controller may move data through.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlWindow {
    /// First address.
    pub base: u64,
    /// Bytes.
    pub len: u64,
}

/// One namespace of the GPU-resident controller (`gpunvme::ctrl::ctrl_ns`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlNs {
    /// Size in logical blocks.
    pub blocks: u64,
    /// GPU pointer of the media (0: null media).
    pub media: u64,
    /// log2 of the LBA size.
    pub lba_shift: u32,
    /// `MEDIA_*`.
    pub kind: u32,
    /// `NS_*` bits.
    pub flags: u32,
    /// Reserved.
    pub reserved: u32,
}

/// [`CtrlNs::flags`]: write protected (`GPUNVME_NS_READ_ONLY`).
pub const NS_READ_ONLY: u32 = 1;

/// Media kinds (`GPUNVME_MEDIA_*`).
pub const MEDIA_NULL: u32 = 0;
/// Media in GPU memory.
pub const MEDIA_HBM: u32 = 1;
/// Media in host memory registered with CUDA.
pub const MEDIA_HOST: u32 = 2;

/// The GPU-resident controller's control block (`gpunvme::ctrl::ctrl_control`), in pinned
/// host memory.
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlControl {
    /// Host: 1 = stop.
    pub stop: u32,
    /// Host: bumped after any table change.
    pub generation: u32,
    /// Queue ids 1..=nqueues may exist.
    pub nqueues: u32,
    /// Windows in use.
    pub nwindows: u32,
    /// Namespaces.
    pub nns: u32,
    /// Longest idle sleep, nanoseconds.
    pub idle_ns: u32,
    /// MDTS in bytes.
    pub max_transfer: u32,
    /// Entries of the media error table in use.
    pub nmedia_errors: u32,
    /// Mapped pointer: `[CtrlQueue; nqueues]`.
    pub queues: u64,
    /// Mapped pointer: `[CtrlWindow; CTRL_MAX_WINDOWS]`.
    pub windows: u64,
    /// Mapped pointer: `[CtrlNs; CTRL_MAX_NS]`.
    pub namespaces: u64,
    /// GPU pointer: doorbell pairs, `CTRL_DOORBELL_STRIDE` bytes apart.
    pub doorbells: u64,
    /// GPU pointer: `[CtrlCounters; warps]`.
    pub counters: u64,
    /// Mapped pointer: generation acknowledged per warp, then SM id + 1 per block.
    pub ack: u64,
    /// The kernel stops by itself after this long.
    pub lifetime_ns: u64,
    /// Mapped pointer: `[CtrlNsModel; CTRL_MAX_NS]`.
    pub models: u64,
    /// Mapped pointer: `[CtrlMediaError; CTRL_MAX_MEDIA_ERRORS]`.
    pub media_errors: u64,
    /// GPU pointer: completions still to drop, `u64` per queue id (`[0]`: on any queue;
    /// `u64::MAX`: every one).
    pub drops: u64,
    /// `FAULT_*` bits.
    pub faults: u32,
    /// Added to every completion's due time, nanoseconds ([`FAULT_DELAY`]).
    pub delay_ns: u32,
    /// GPU pointer: `[stop, generation]` (u32 each) as block 0's leader last read them.
    pub mirror: u64,
    /// `HOSTILE_*` bits.
    pub hostile: u32,
    /// Reserved.
    pub reserved: u32,
}

/// A namespace's SSD timing model as the controller kernel takes it
/// (`gpunvme::ctrl::ctrl_ns_model`); built by [`crate::ssd_model::SsdModel::to_ctrl`].
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct CtrlNsModel {
    /// GPU pointer: per drive the `%globaltimer` nanosecond until which it is busy,
    /// [`CTRL_DRIVE_STRIDE`] bytes apart.
    pub busy: u64,
    /// Bytes per second per drive (0: no bandwidth cap).
    pub bw: u64,
    /// Fixed latency of a Read after its service, nanoseconds.
    pub read_ns: u32,
    /// Fixed latency of a Write after its service, nanoseconds.
    pub write_ns: u32,
    /// Nanoseconds per command per drive, `ceil(1e9 / IOPS)` (0: no IOPS cap).
    pub op_ns: u32,
    /// Drives striped behind the namespace (0: no timing model).
    pub drives: u16,
    /// log2 of the stripe unit in bytes.
    pub stripe_shift: u16,
}

/// An injected media error of the GPU-resident controller (`gpunvme::ctrl::ctrl_media_error`).
#[repr(C)]
#[derive(
    Clone, Copy, Debug, Default, PartialEq, Eq, FromBytes, IntoBytes, Immutable, KnownLayout,
)]
pub struct CtrlMediaError {
    /// First LBA.
    pub slba: u64,
    /// LBAs.
    pub nlb: u64,
    /// Namespace.
    pub nsid: u32,
    /// Reserved.
    pub reserved: u32,
}

/// A completion the model holds until it is due (`gpunvme::ctrl::ctrl_pending`, in the
/// controller warps' shared memory; mirrored for its size only).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlPending {
    /// `%globaltimer` nanosecond from which it may be posted.
    pub due: u64,
    /// CID and status field, without the phase tag.
    pub dw3: u32,
    /// Owning lane and fetch sequence.
    pub meta: u32,
}

/// What one controller warp did (`gpunvme::ctrl::ctrl_counters`).
#[repr(C)]
#[derive(Clone, Copy, Debug, Default, FromBytes, IntoBytes, Immutable, KnownLayout)]
pub struct CtrlCounters {
    /// Commands completed (any status).
    pub commands: u64,
    /// Of which failed.
    pub errors: u64,
    /// Data bytes moved.
    pub bytes: u64,
    /// Doorbell values out of range, ignored.
    pub doorbell_errors: u64,
    /// Polling passes.
    pub passes: u64,
    /// Passes with nothing to do.
    pub idle_passes: u64,
    /// Table generations taken.
    pub reloads: u64,
    /// Completions dropped (fault injection).
    pub dropped: u32,
    /// Held completions never posted (the model stopped, or their queue was deleted).
    pub abandoned: u32,
}

/// Windows per controller (`GPUNVME_CTRL_MAX_WINDOWS`).
pub const CTRL_MAX_WINDOWS: usize = 64;
/// Namespaces per controller (`GPUNVME_CTRL_MAX_NS`).
pub const CTRL_MAX_NS: usize = 16;
/// Warps per controller block (`GPUNVME_CTRL_WARPS`).
pub const CTRL_WARPS: u32 = 16;
/// Bytes between two queues' doorbell pairs (`GPUNVME_CTRL_DOORBELL_STRIDE`).
pub const CTRL_DOORBELL_STRIDE: usize = 32;
/// Injected media error ranges per controller (`GPUNVME_CTRL_MAX_MEDIA_ERRORS`).
pub const CTRL_MAX_MEDIA_ERRORS: usize = 16;
/// Drives of one namespace's timing model (`GPUNVME_CTRL_MAX_DRIVES`).
pub const CTRL_MAX_DRIVES: usize = 64;
/// Bytes between two drives' busy-until words (`GPUNVME_CTRL_DRIVE_STRIDE`).
pub const CTRL_DRIVE_STRIDE: usize = 32;
/// Bytes of selection slots before each warp's held completions (`GPUNVME_CTRL_SEL_BYTES`).
pub const CTRL_SEL_BYTES: usize = 128;
/// Smallest stripe unit, log2 bytes (`GPUNVME_CTRL_MIN_STRIPE_SHIFT`).
pub const CTRL_MIN_STRIPE_SHIFT: u32 = 12;
/// Largest stripe unit, log2 bytes (`GPUNVME_CTRL_MAX_STRIPE_SHIFT`).
pub const CTRL_MAX_STRIPE_SHIFT: u32 = 30;
/// [`CtrlControl::faults`]: drop counters may be non-zero (`GPUNVME_FAULT_DROPS`).
pub const FAULT_DROPS: u32 = 1;
/// [`CtrlControl::faults`]: [`CtrlControl::delay_ns`] applies (`GPUNVME_FAULT_DELAY`).
pub const FAULT_DELAY: u32 = 2;
/// [`CtrlControl::faults`]: media error ranges are set (`GPUNVME_FAULT_MEDIA`).
pub const FAULT_MEDIA: u32 = 4;
/// [`CtrlControl::hostile`]: fetched SQEs poisoned (`GPUNVME_HOSTILE_POISON_SQ`).
pub const HOSTILE_POISON_SQ: u32 = 1;
/// [`CtrlControl::hostile`]: a backward SQ tail is an invalid doorbell write.
pub const HOSTILE_BACKWARD_TAIL: u32 = 2;
/// [`CtrlControl::hostile`]: freed CQ entries rewritten with garbage.
pub const HOSTILE_STALE_CQ: u32 = 4;

/// The controller kernel's `HOSTILE_*` bits for `h`.
pub fn hostile_bits(h: nvme_emu::Hostile) -> u32 {
    (if h.poison_sq { HOSTILE_POISON_SQ } else { 0 })
        | (if h.flag_backward_tail {
            HOSTILE_BACKWARD_TAIL
        } else {
            0
        })
        | (if h.stale_cq { HOSTILE_STALE_CQ } else { 0 })
}

/// Held completions per controller warp when the kernel gets `dynamic_bytes` of dynamic shared
/// memory per block (the kernel's own arithmetic: its slice, less the selection slots).
pub fn pending_capacity(dynamic_bytes: u32) -> u32 {
    let slice = (dynamic_bytes / CTRL_WARPS) & !15;
    slice.saturating_sub(CTRL_SEL_BYTES as u32) / size_of::<CtrlPending>() as u32
}

#[cfg(test)]
mod tests {
    use super::*;
    use gpu_queues::desc::check_defines;
    use std::mem::offset_of;

    #[test]
    fn sources_match_rust_layouts() {
        let want: &[(&str, usize)] = &[
            ("COPY_DESC_SIZE", size_of::<CopyDesc>()),
            ("COPY_LATE", COPY_LATE as usize),
            ("CTRL_QUEUE_SIZE", size_of::<CtrlQueue>()),
            ("CTRL_WINDOW_SIZE", size_of::<CtrlWindow>()),
            ("CTRL_NS_SIZE", size_of::<CtrlNs>()),
            ("CTRL_CONTROL_SIZE", size_of::<CtrlControl>()),
            ("CTRL_COUNTERS_SIZE", size_of::<CtrlCounters>()),
            ("CC_STOP", offset_of!(CtrlControl, stop)),
            ("CC_GENERATION", offset_of!(CtrlControl, generation)),
            ("CC_QUEUES", offset_of!(CtrlControl, queues)),
            ("CC_ACK", offset_of!(CtrlControl, ack)),
            ("CC_LIFETIME_NS", offset_of!(CtrlControl, lifetime_ns)),
            ("CC_MIRROR", offset_of!(CtrlControl, mirror)),
            ("CC_NMEDIA_ERRORS", offset_of!(CtrlControl, nmedia_errors)),
            ("CC_MODELS", offset_of!(CtrlControl, models)),
            ("CC_MEDIA_ERRORS", offset_of!(CtrlControl, media_errors)),
            ("CC_DROPS", offset_of!(CtrlControl, drops)),
            ("CC_FAULTS", offset_of!(CtrlControl, faults)),
            ("CC_DELAY_NS", offset_of!(CtrlControl, delay_ns)),
            ("CC_HOSTILE", offset_of!(CtrlControl, hostile)),
            ("HOSTILE_POISON_SQ", HOSTILE_POISON_SQ as usize),
            ("HOSTILE_BACKWARD_TAIL", HOSTILE_BACKWARD_TAIL as usize),
            ("HOSTILE_STALE_CQ", HOSTILE_STALE_CQ as usize),
            ("CTRL_NS_MODEL_SIZE", size_of::<CtrlNsModel>()),
            ("CTRL_MEDIA_ERROR_SIZE", size_of::<CtrlMediaError>()),
            ("CTRL_PENDING_SIZE", size_of::<CtrlPending>()),
            ("CTRL_MAX_MEDIA_ERRORS", CTRL_MAX_MEDIA_ERRORS),
            ("CTRL_MAX_DRIVES", CTRL_MAX_DRIVES),
            ("CTRL_DRIVE_STRIDE", CTRL_DRIVE_STRIDE),
            ("CTRL_SEL_BYTES", CTRL_SEL_BYTES),
            ("CTRL_MIN_STRIPE_SHIFT", CTRL_MIN_STRIPE_SHIFT as usize),
            ("CTRL_MAX_STRIPE_SHIFT", CTRL_MAX_STRIPE_SHIFT as usize),
            ("FAULT_DROPS", FAULT_DROPS as usize),
            ("FAULT_DELAY", FAULT_DELAY as usize),
            ("FAULT_MEDIA", FAULT_MEDIA as usize),
            ("CTRL_MAX_WINDOWS", CTRL_MAX_WINDOWS),
            ("CTRL_MAX_NS", CTRL_MAX_NS),
            ("CTRL_WARPS", CTRL_WARPS as usize),
            ("CTRL_DOORBELL_STRIDE", CTRL_DOORBELL_STRIDE),
            ("MEDIA_NULL", MEDIA_NULL as usize),
            ("MEDIA_HBM", MEDIA_HBM as usize),
            ("MEDIA_HOST", MEDIA_HOST as usize),
            ("NS_READ_ONLY", NS_READ_ONLY as usize),
        ];
        check_defines(&[CONTROLLER_CUH, EMU_KERNELS_CU], want, "Rust layout").unwrap();
    }

    #[test]
    fn model_tables_have_the_kernels_layout() {
        // reload() reads drives and stripe_shift as one 32-bit word at `drives`.
        assert_eq!(offset_of!(CtrlNsModel, drives), 28);
        assert_eq!(offset_of!(CtrlNsModel, stripe_shift), 30);
        assert_eq!(offset_of!(CtrlMediaError, nsid), 16);
        assert_eq!(size_of::<CtrlControl>(), 136);
        assert_eq!(size_of::<CtrlCounters>(), 64);
        // H100: 227 KiB per block less ~39 KiB of tables, or just over half of 228 KiB.
        assert_eq!(pending_capacity(232_448 - 39_568), 745);
        assert_eq!(pending_capacity(117_760 - 39_568), 297);
        assert_eq!(pending_capacity(0), 0);
        assert_eq!(pending_capacity(100), 0);
    }

    #[test]
    fn ptx_is_embedded_with_every_kernel() {
        for k in [
            "gpunvme_scatter",
            "gpunvme_gather",
            "gpunvme_emu_warmup",
            "gpunvme_controller",
        ] {
            assert!(
                EMU_KERNELS_PTX.contains(&format!(".entry {k}(")),
                "{k} missing from the PTX"
            );
        }
        assert!(EMU_KERNELS_PTX.contains(".target sm_80"));
        // The model's held completions use the kernel's dynamic shared memory.
        assert!(EMU_KERNELS_PTX.contains("%dynamic_smem_size"));
    }
}
