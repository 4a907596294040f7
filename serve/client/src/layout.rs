//! The layout of queue pairs in an arena (docs/serve.md, "The memory a client is given";
//! `gpunvme_serve_proto::layout`): for each pair, page-aligned and in this order, the SQ
//! (`depth` × 64 bytes), the CQ (`depth` × 16 bytes), two PRP list pages per slot, and
//! `depth` slot buffers of `slot_bytes`.
//!
//! The daemon chooses the offsets; the client checks every grant against its arena before it
//! touches a byte (`check_grants`), so a wrong grant is a protocol error, never an access
//! outside the rings it names.

use gpunvme_serve_proto::layout::{PRP_PAGES_PER_SLOT, PairLayout};
use gpunvme_serve_proto::msg::QueueGrant;
use nvme_spec::wire::{CQE_SIZE, SQE_SIZE};

use crate::command::PAGE;

/// Bytes of the doorbell page passed with the queue grants.
pub const DOORBELL_PAGE: usize = 4096;

/// The four regions of one pair, in the grant's field order (`sq`, `cq`, `slots`,
/// `prp_lists`): (name, bytes).
fn regions(depth: u32, slot_bytes: u32) -> [(&'static str, u64); 4] {
    let depth = u64::from(depth);
    [
        ("submission queue", depth * SQE_SIZE as u64),
        ("completion queue", depth * CQE_SIZE as u64),
        ("slot buffers", depth * u64::from(slot_bytes)),
        ("PRP list pages", depth * PRP_PAGES_PER_SLOT * PAGE),
    ]
}

/// Bytes one pair of `depth` entries with slots of `slot_bytes` takes in an arena, each
/// region rounded up to whole pages.
pub fn pair_bytes(depth: u32, slot_bytes: u32) -> u64 {
    PairLayout::new(depth, slot_bytes).len
}

/// Bytes an arena needs for `count` pairs laid out one after the other from its start (the
/// smallest arena to ask for before [`crate::Connection::create_queues`]).
pub fn arena_bytes_for(count: u16, depth: u32, slot_bytes: u32) -> u64 {
    u64::from(count) * pair_bytes(depth, slot_bytes)
}

/// Checks the grants of one `CreateQueues` reply: as many as asked for, distinct queue ids,
/// each region page-aligned and inside the arena of `arena_len` bytes, no two regions (of any
/// pairs) overlapping, and doorbell words aligned, inside the doorbell page and distinct.
pub(crate) fn check_grants(
    grants: &[QueueGrant],
    count: u16,
    depth: u32,
    slot_bytes: u32,
    arena_len: u64,
) -> Result<(), String> {
    if grants.len() != usize::from(count) {
        return Err(format!(
            "{} queue pairs were granted, {count} were asked for",
            grants.len()
        ));
    }
    let mut spans = Vec::with_capacity(grants.len() * 4);
    let mut words = Vec::with_capacity(grants.len() * 2);
    let mut qids = Vec::with_capacity(grants.len());
    for g in grants {
        if g.qid == 0 || qids.contains(&g.qid) {
            return Err(format!(
                "queue id {} is granted twice or is the admin queue",
                g.qid
            ));
        }
        qids.push(g.qid);
        let starts = [g.sq, g.cq, g.slots, g.prp_lists];
        for (&start, (what, bytes)) in starts.iter().zip(regions(depth, slot_bytes)) {
            let end = start.checked_add(bytes).filter(|&end| end <= arena_len);
            let Some(end) = end.filter(|_| start % PAGE == 0) else {
                return Err(format!(
                    "queue {}: its {what} at offset {start:#x} ({bytes} bytes) is not a \
                     page-aligned range inside the {arena_len}-byte arena",
                    g.qid
                ));
            };
            spans.push((start, end, g.qid, what));
        }
        for (what, at) in [("SQ tail", g.sq_doorbell), ("CQ head", g.cq_doorbell)] {
            if at % 4 != 0 || at as usize + 4 > DOORBELL_PAGE || words.contains(&at) {
                return Err(format!(
                    "queue {}: its {what} doorbell at offset {at:#x} is misaligned, outside \
                     the {DOORBELL_PAGE}-byte doorbell page, or another queue's",
                    g.qid
                ));
            }
            words.push(at);
        }
    }
    spans.sort_unstable();
    for w in spans.windows(2) {
        let ((_, a_end, a_qid, a_what), (b_start, _, b_qid, b_what)) = (w[0], w[1]);
        if b_start < a_end {
            return Err(format!(
                "queue {a_qid}'s {a_what} overlaps queue {b_qid}'s {b_what} (at offset \
                 {b_start:#x})"
            ));
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    /// Grants laid out as docs/serve.md says, from offset 0.
    fn laid_out(count: u16, depth: u32, slot_bytes: u32) -> Vec<QueueGrant> {
        let l = PairLayout::new(depth, slot_bytes);
        (0..count)
            .map(|i| {
                let at = u64::from(i) * l.len;
                QueueGrant {
                    qid: i + 1,
                    sq_doorbell: 8 * u32::from(i),
                    cq_doorbell: 8 * u32::from(i) + 4,
                    sq: at + l.sq,
                    cq: at + l.cq,
                    slots: at + l.slots,
                    prp_lists: at + l.prp_lists,
                }
            })
            .collect()
    }

    #[test]
    fn sizes() {
        // depth 64: SQ 4 KiB, CQ 1 KiB (one page), 128 list pages, 64 slots of 8 KiB.
        assert_eq!(pair_bytes(64, 8192), 4096 + 4096 + 128 * 4096 + 64 * 8192);
        assert_eq!(arena_bytes_for(3, 64, 8192), 3 * pair_bytes(64, 8192));
        // depth 65536 and 2 MiB slots: no overflow in u64.
        assert!(pair_bytes(65536, 2 << 20) > 1 << 37);
    }

    #[test]
    fn a_layout_as_documented_passes() {
        let g = laid_out(4, 16, 8192);
        check_grants(&g, 4, 16, 8192, arena_bytes_for(4, 16, 8192)).unwrap();
    }

    #[test]
    fn wrong_grants_are_refused_by_name() {
        let (depth, slot) = (16, 8192);
        let len = arena_bytes_for(2, depth, slot);
        let ok = laid_out(2, depth, slot);
        let check = |g: &[QueueGrant]| check_grants(g, 2, depth, slot, len).unwrap_err();

        assert!(check(&ok[..1]).contains("1 queue pairs were granted, 2"));
        let mut g = ok.clone();
        g[1].qid = g[0].qid;
        assert!(check(&g).contains("granted twice"));
        let mut g = ok.clone();
        g[1].prp_lists = len - PAGE;
        assert!(check(&g).contains("PRP list pages"), "{}", check(&g));
        let mut g = ok.clone();
        g[0].cq += 64;
        assert!(check(&g).contains("not a page-aligned range"));
        let mut g = ok.clone();
        g[0].slots = u64::MAX - PAGE + 1;
        assert!(check(&g).contains("slot buffers"));
        let mut g = ok.clone();
        g[1].sq = g[0].slots;
        assert!(check(&g).contains("overlaps"), "{}", check(&g));
        let mut g = ok.clone();
        g[1].cq_doorbell = g[0].sq_doorbell;
        assert!(check(&g).contains("another queue's"));
        let mut g = ok.clone();
        g[0].sq_doorbell = 4094;
        assert!(check(&g).contains("SQ tail doorbell"));
        let mut g = ok;
        g[0].cq_doorbell = 4096;
        assert!(check(&g).contains("CQ head doorbell"));
    }
}
