//! The cache's host-side logic without a GPU: geometry, bindings, statistics.

use super::*;
use gpu_queues::desc::FS_REF;

#[test]
fn bounce_needs_slot_buffers_on_every_queue() {
    let with = QueueDesc {
        slot_buffers: 0x1000,
        slot_buffer_bytes: 4096,
        ..Default::default()
    };
    assert!(check_bounce(&[with, with]).is_ok());
    let none = QueueDesc {
        slot_buffers: 0,
        ..with
    };
    let e = check_bounce(&[with, none]).unwrap_err();
    assert!(
        matches!(e, GpuError::Unsupported(ref m) if m.contains("queue 1")),
        "{e}"
    );
    let small = QueueDesc {
        slot_buffer_bytes: 2048,
        ..with
    };
    assert!(matches!(
        check_bounce(&[small]),
        Err(GpuError::Unsupported(_))
    ));
}

fn opts(page_size: u32, capacity: u64) -> CacheOptions {
    CacheOptions {
        page_size,
        capacity,
        ..Default::default()
    }
}

#[test]
fn plan_accepts_the_documented_options_and_refuses_the_rest() {
    let p = plan(&opts(4096, 1 << 20), 1 << 20, 4, 7).unwrap();
    assert_eq!(
        p,
        CachePlan {
            nframes: 256,
            page_shift: 12,
            queues: 0..4,
            full_wait_ns: 7
        }
    );
    let p = plan(
        &CacheOptions {
            queues: Some(1..3),
            full_wait: Some(Duration::from_millis(2)),
            ..opts(65536, (1 << 20) + 5)
        },
        1 << 20,
        4,
        7,
    )
    .unwrap();
    assert_eq!(
        (p.nframes, p.page_shift, p.queues, p.full_wait_ns),
        (16, 16, 1..3, 2_000_000)
    );
    let refused = |o: CacheOptions, mt: u32| {
        assert!(
            matches!(plan(&o, mt, 4, 7), Err(GpuError::InvalidArgument(_))),
            "{o:?}"
        )
    };
    refused(opts(2048, 1 << 20), 1 << 20); // below 4 KiB
    refused(opts(12288, 1 << 20), 1 << 20); // not a power of two
    refused(opts(131072, 1 << 20), 1 << 20); // above 64 KiB
    refused(opts(65536, 1 << 20), 32768); // more than one command
    refused(opts(4096, 4095), 1 << 20); // no whole page
    refused(
        CacheOptions {
            queues: Some(2..2),
            ..opts(4096, 1 << 20)
        },
        1 << 20,
    );
    refused(
        CacheOptions {
            queues: Some(3..5),
            ..opts(4096, 1 << 20)
        },
        1 << 20,
    );
    refused(
        CacheOptions {
            max_ranges: 0,
            ..opts(4096, 1 << 20)
        },
        1 << 20,
    );
    refused(opts(4096, 4096 * (FRAME_EMPTY as u64)), 1 << 20);
}

#[test]
fn range_geometry_counts_a_partial_last_page_and_refuses_bad_ranges() {
    assert_eq!(range_geometry(4096, 512, 0, 8).unwrap(), (1, 4096));
    assert_eq!(range_geometry(4096, 512, 100, 9).unwrap(), (2, 4608));
    assert_eq!(range_geometry(65536, 4096, 7, 17).unwrap(), (2, 17 * 4096));
    for (page, lba, first, blocks) in [
        (4096, 1024 * 3, 0, 1),        // LBA size not a power of two
        (4096, 256, 0, 1),             // below 512
        (4096, 8192, 0, 1),            // above 4096 (and above the page)
        (4096, 512, 0, 0),             // empty
        (4096, 512, u64::MAX, 2),      // past LBA space
        (4096, 4096, 0, u64::MAX / 2), // bytes overflow
    ] {
        assert!(
            matches!(
                range_geometry(page, lba, first, blocks),
                Err(GpuError::InvalidArgument(_))
            ),
            "{page} {lba} {first} {blocks}"
        );
    }
}

fn range(npages: u64) -> RangeDesc {
    RangeDesc {
        npages,
        ..Default::default()
    }
}

#[test]
fn invariants_catch_held_pages_locked_frames_and_crossed_owners() {
    let ranges = [range(4)];
    let empty = FrameState {
        flags: 0,
        range: FRAME_EMPTY,
        page: 0,
    };
    let mut entries = vec![vec![PageEntry::default(); 4]];
    let mut frames = vec![empty; 2];
    assert!(invariant_problems(&ranges, &entries, &frames).is_empty());
    // Page 2 valid in frame 1, both naming each other: fine.
    entries[0][2] = PageEntry {
        state: PS_VALID,
        frame: 1,
    };
    frames[1] = FrameState {
        flags: FS_REF,
        range: 0,
        page: 2,
    };
    assert!(invariant_problems(&ranges, &entries, &frames).is_empty());
    // A reference left behind.
    entries[0][2].state = PS_VALID | 1;
    assert_eq!(invariant_problems(&ranges, &entries, &frames).len(), 1);
    entries[0][2].state = PS_VALID;
    // A frame left locked, and one naming a page that is not valid in it.
    frames[0] = FrameState {
        flags: FS_LOCKED,
        range: 0,
        page: 3,
    };
    assert_eq!(invariant_problems(&ranges, &entries, &frames).len(), 2);
    frames[0] = empty;
    // A valid page whose frame names another page.
    entries[0][3] = PageEntry {
        state: PS_VALID,
        frame: 1,
    };
    assert!(!invariant_problems(&ranges, &entries, &frames).is_empty());
}
