//! The perf kernel (`gpunvme_cli::perf::kernel`, what `perf --gpu` runs) on the software
//! controller: four patterns verified by every client style at both LBA sizes, I/Os above the
//! maximum transfer split into several commands, and a protection-information namespace.
//!
//! Its tests keep the names they had at the crate root, where the scripts select them
//! (`--exact NAME`): `root_tests!` in main.rs declares each as a test and calls the function
//! here. A `#[test]` written in this file is named `perf::NAME` instead.

use super::*;

pub(super) fn perf_four_patterns_both_lba_sizes_verified() {
    for lba in [512u32, 4096] {
        let r = rig(lba, 4, 256);
        cpu_prefill(&r, NS_BYTES / lba as u64);
        for rw in [GpuRw::Read, GpuRw::RandRead, GpuRw::Write, GpuRw::RandWrite] {
            // The warp client also with 16 and 8 issuing lanes: 4 and 8 warps share a queue.
            for style in [
                (ClientStyle::Warp, Some(32)),
                (ClientStyle::Warp, Some(16)),
                (ClientStyle::Warp, Some(8)),
                (ClientStyle::Thread, None),
                (ClientStyle::Lone, None),
            ] {
                let res = perf_lanes(&r, rw, 64, style, 20_000, 4096);
                assert_eq!(
                    res.errors, 0,
                    "{lba} {rw:?} {style:?}: {:?}",
                    res.first_failure
                );
                assert_eq!(res.mismatches, 0, "{lba} {rw:?} {style:?}");
                assert!(
                    res.done >= 20_000,
                    "{lba} {rw:?} {style:?}: {} done",
                    res.done
                );
            }
        }
        // What the GPU wrote (pattern, LBA-stamped), the CPU queue reads back.
        let blocks = NS_BYTES / lba as u64;
        let all = cpu_read(&r, 0, blocks);
        assert!(
            all == pattern(0, blocks, lba),
            "CPU read-back of GPU writes at {lba}"
        );
    }
}

/// I/Os larger than one command moves: the perf kernel splits each into commands of the
/// maximum transfer (plus a last, shorter one) and counts it once. For each client style:
/// sequential writes over blocks zeroed first put the pattern on every I/O's blocks (read back
/// through a CPU queue); then verified reads and random writes.
pub(super) fn perf_splits_ios_above_the_maximum_transfer() {
    for lba in [512u32, 4096] {
        let r = rig(lba, 2, 64);
        let bs = 3 * r.gpu.max_transfer() + lba;
        let units = NS_BYTES / bs as u64;
        let blocks = units * (bs / lba) as u64;
        // On CPU threads (host-gpu, 2-core CI: 457 s for all six pairs) each style once,
        // over the two LBA sizes; on a GPU every style at each size.
        let styles: &[ClientStyle] = match (cfg!(feature = "host-gpu"), lba) {
            (false, _) => &[ClientStyle::Thread, ClientStyle::Warp, ClientStyle::Lone],
            (true, 512) => &[ClientStyle::Thread, ClientStyle::Lone],
            (true, _) => &[ClientStyle::Warp],
        };
        for &style in styles {
            // Zeros first, so the read-back shows this style's writes, not the last one's.
            cpu_fill(&r, blocks, |_, n| vec![0u8; (n * lba as u64) as usize]);
            for (rw, ios) in [
                (GpuRw::Write, units),
                (GpuRw::RandRead, 64),
                (GpuRw::RandWrite, 64),
                (GpuRw::Read, units),
            ] {
                let res = perf_bs(&r, rw, 32, style, ios, bs);
                assert_eq!(
                    res.errors, 0,
                    "{lba} {rw:?} {style:?}: {:?}",
                    res.first_failure
                );
                assert_eq!(res.mismatches, 0, "{lba} {rw:?} {style:?}");
                assert!(res.done >= ios, "{lba} {rw:?} {style:?}: {} done", res.done);
            }
            assert!(
                cpu_read(&r, 0, blocks) == pattern(0, blocks, lba),
                "CPU read-back of split GPU writes at {lba}"
            );
        }
        assert_eq!(r.emu().stats().errors, 0);
    }
}

/// A namespace formatted with 8-byte protection information: GPU queues' Reads and Writes
/// carry PRACT and the reference tag (the software controller refuses them otherwise, with
/// Invalid Field and End-to-end Reference Tag Check Error), and what the GPU wrote reads back
/// through a CPU queue.
pub(super) fn perf_on_a_protection_information_namespace_sets_pract() {
    for (lba, pi_type) in [(512u32, 1u8), (4096, 3)] {
        let r = rig_with(
            lba,
            |c| {
                c.namespaces[0].format = nvme_emu::NsFormat::Pi {
                    pi_type,
                    first_bytes: pi_type == 3,
                }
            },
            GpuQueueOptions {
                queues: Some(2),
                depth: Some(64),
                ..Default::default()
            },
        );
        assert_eq!(r.gpu.descs()[0].pi_nsid, 1);
        for rw in [GpuRw::Write, GpuRw::RandWrite, GpuRw::Read, GpuRw::RandRead] {
            let res = perf(&r, rw, 32, ClientStyle::Warp, 600);
            assert_eq!(res.errors, 0, "{lba} {rw:?}: {:?}", res.first_failure);
            assert_eq!(res.mismatches, 0, "{lba} {rw:?}");
        }
        let blocks = 256;
        assert!(
            cpu_read(&r, 0, blocks) == pattern(0, blocks, lba),
            "CPU read-back of GPU writes on a PI namespace at {lba}"
        );
        assert_eq!(r.emu().stats().errors, 0);
    }
}
