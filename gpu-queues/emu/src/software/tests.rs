//! Unit tests: the environment choices of the copy engines, ring placement and readahead, and a
//! readahead's walk over a cold file.

use super::modes::{CopyMode, StagedCopies, fetch_ordered_from};
use super::pair_memory::RingPlacement;
use super::readahead::readahead_from;

/// The hint's walk on a file made cold: the hinted blocks (and only they) are asked for
/// and enter the page cache; a second walk over them, now resident, asks for nothing.
#[test]
fn a_readahead_reads_the_hinted_blocks_that_are_not_cached() {
    use super::readahead::{READAHEAD_BLOCK, Readahead};
    use crate::os::{advise_dontneed, range_cached};
    use std::io::Write;
    use std::os::fd::AsFd;
    let path = std::env::temp_dir().join(format!("gpunvme-readahead-{}", std::process::id()));
    let b = READAHEAD_BLOCK;
    {
        let mut f = std::fs::File::create(&path).unwrap();
        let data: Vec<u8> = (0..4 * b).map(|i| (i * 7 % 251) as u8).collect();
        f.write_all(&data).unwrap();
        f.sync_all().unwrap();
    }
    let f = std::fs::File::open(&path).unwrap();
    advise_dontneed(f.as_fd(), 0, 4 * b).unwrap();
    let cold = |at, n| range_cached(f.as_fd(), at, n);
    match cold(0, 4 * b) {
        Err(e) => {
            eprintln!("skipped: no cachestat here ({e})");
            let _ = std::fs::remove_file(&path);
            return;
        }
        Ok(true) => {
            eprintln!("skipped: the file system kept the file's pages (tmpfs?)");
            let _ = std::fs::remove_file(&path);
            return;
        }
        Ok(false) => {}
    }
    // Blocks 0 and 2 of the four.
    let ranges = vec![(0, b), (2 * b, b)];
    let open = || std::fs::File::open(&path).unwrap();
    let (asked, threads) = Readahead::start(open(), ranges.clone(), 2)
        .unwrap()
        .finish();
    assert_eq!(asked, 2 * b, "both hinted blocks were cold");
    assert_eq!(threads, 2, "a block to read started the second walker");
    assert!(
        cold(0, b).unwrap() && cold(2 * b, b).unwrap(),
        "hinted blocks cached"
    );
    assert!(
        !cold(b, b).unwrap(),
        "a block between them was not asked for"
    );
    let again = Readahead::start(open(), ranges, 2).unwrap().finish();
    assert_eq!(
        again,
        (0, 1),
        "resident blocks: one thread's cachestats, no read"
    );
    let _ = std::fs::remove_file(&path);
}

#[test]
fn staged_copies_and_fetch_order_follow_their_variables() {
    use StagedCopies::{Engine, Kernel};
    assert_eq!(StagedCopies::choose(None).unwrap(), Engine);
    assert_eq!(StagedCopies::choose(Some(" engine ")).unwrap(), Engine);
    assert_eq!(StagedCopies::choose(Some("kernel")).unwrap(), Kernel);
    let e = StagedCopies::choose(Some("dma")).unwrap_err().to_string();
    assert!(e.contains("GPUNVME_EMU_STAGED=dma"), "{e}");
    assert!(!fetch_ordered_from(None).unwrap());
    assert!(!fetch_ordered_from(Some("unordered")).unwrap());
    assert!(fetch_ordered_from(Some("ordered")).unwrap());
    let e = fetch_ordered_from(Some("always")).unwrap_err().to_string();
    assert!(e.contains("GPUNVME_EMU_FETCH=always"), "{e}");
    use super::READAHEAD_WALKERS;
    assert_eq!(readahead_from(None, 0).unwrap(), 0, "the caller's default");
    assert_eq!(readahead_from(Some(""), 4).unwrap(), 4);
    assert_eq!(readahead_from(Some("on"), 0).unwrap(), READAHEAD_WALKERS);
    assert_eq!(readahead_from(Some(" off"), 4).unwrap(), 0);
    assert_eq!(readahead_from(Some("1"), 0).unwrap(), 1);
    assert_eq!(readahead_from(Some("16"), 0).unwrap(), 16);
    for bad in ["0", "17", "many"] {
        let e = readahead_from(Some(bad), 0).unwrap_err().to_string();
        assert!(e.contains(&format!("GPUNVME_EMU_READAHEAD={bad}")), "{e}");
        assert!(
            e.contains("from 1 to 16") && !e.contains("argument: invalid"),
            "{e}"
        );
    }
}

#[test]
fn ring_placement_follows_the_variable_then_the_caller() {
    use RingPlacement::{Gpu, Host};
    assert_eq!(RingPlacement::choose(None, None).unwrap(), Gpu);
    assert_eq!(RingPlacement::choose(None, Some(true)).unwrap(), Host);
    assert_eq!(RingPlacement::choose(Some(""), Some(false)).unwrap(), Gpu);
    assert_eq!(RingPlacement::choose(Some("gpu"), Some(true)).unwrap(), Gpu);
    assert_eq!(RingPlacement::choose(Some("host"), None).unwrap(), Host);
    assert!(RingPlacement::choose(Some("hbm"), None).is_err());
}

#[test]
fn copy_mode_follows_the_variable_then_the_sanitizer() {
    assert_eq!(CopyMode::choose(None, false).unwrap(), CopyMode::Kernels);
    assert_eq!(CopyMode::choose(None, true).unwrap(), CopyMode::Memcpy);
    assert_eq!(CopyMode::choose(Some(""), true).unwrap(), CopyMode::Memcpy);
    assert_eq!(
        CopyMode::choose(Some("kernels"), true).unwrap(),
        CopyMode::Kernels
    );
    assert_eq!(
        CopyMode::choose(Some("memcpy"), false).unwrap(),
        CopyMode::Memcpy
    );
    assert!(CopyMode::choose(Some("dma"), false).is_err());
}
