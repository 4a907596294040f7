//! The lifetime of an I/O queue pair on the controller, whoever drives its rings: queue id
//! allocation, Create I/O Completion Queue then Create I/O Submission Queue on memory the caller
//! supplies (NVMe Base 2.0, sections 5.4 and 5.5), and Delete I/O Submission Queue then Delete
//! I/O Completion Queue (sections 5.6 and 5.7), by the owner or by controller shutdown.
//!
//! The CPU queue pairs ([`crate::IoQueuePair`]) sit on top of this, and so can rings driven by
//! someone else (GPU threads, another process): [`crate::Controller::create_queue_pair_on`]
//! takes the rings as [`DmaRegion`]s, device addresses only, and returns a [`CreatedQueuePair`]
//! that says which queue id and doorbells to use and deletes the queues when dropped.
//!
//! Rules kept here:
//! - A queue id is reused only when the controller surely has no queue with it: after both
//!   deletions succeeded, or after a creation that surely did not take effect.
//! - Creation, deletion and shutdown take the queue table's lock first, then the admin queue's,
//!   so shutdown sees every pair either fully created or not at all, and retires each one
//!   exactly once.
//! - A pair holds its regions until it is dropped, so the ring memory outlives the queues on the
//!   controller (and, once the pair is dropped, the region owners revoke the device's access).

#![forbid(unsafe_code)]

use crate::admin::{self, AdminChannel};
use crate::dma::{DMA_PAGE_SIZE, DmaRegion};
use crate::error::Error;
use nvme_spec::AdminOpcode;
use nvme_spec::wire::{CQE_SIZE, SQE_SIZE, cq_head_doorbell, sq_tail_doorbell};
use std::fmt;
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::{Arc, Mutex, MutexGuard, Weak};

/// Memory for one I/O queue pair, as device addresses: what
/// [`crate::Controller::create_queue_pair_on`] creates the queues on.
///
/// Each ring must be at least `entries * entry size` bytes (64-byte SQEs, 16-byte CQEs),
/// start on a 4 KiB page and be contiguous in device address space over those bytes (the driver
/// creates queues with PC = 1 only); entries are 2..=CAP.MQES + 1.
#[derive(Clone, Debug)]
pub struct QueueRegions {
    /// Submission queue ring.
    pub sq: Arc<DmaRegion>,
    /// Entries in the submission queue.
    pub sq_entries: u32,
    /// Completion queue ring.
    pub cq: Arc<DmaRegion>,
    /// Entries in the completion queue.
    pub cq_entries: u32,
}

/// What queue creation is checked against.
#[derive(Clone, Copy, Debug)]
pub(crate) struct QueueLimits {
    /// I/O queue pairs the controller granted (qids 1..=granted).
    pub(crate) granted: u16,
    /// CAP.MQES + 1.
    pub(crate) max_entries: u32,
    /// CAP.CQR: the controller requires physically contiguous queues.
    pub(crate) cqr: bool,
    /// CAP.DSTRD.
    pub(crate) dstrd: u8,
}

/// A pair of [`QueueLifecycle::create_many`] that was not made, or was undone because another
/// was not.
struct Undone {
    /// Why it was not made (`None`: undone for another pair's error).
    error: Option<Error>,
    /// Whether the controller surely has no queue with its id, which may be handed out again.
    id_free: bool,
}

/// Shared between a [`CreatedQueuePair`] and the queue table: whether the pair was retired.
#[derive(Debug)]
struct QueueHandle {
    qid: u16,
    /// Set once the pair's deletion was attempted (by its owner or by shutdown); from then on
    /// nothing deletes it again and its rings must not be used.
    deleted: AtomicBool,
}

/// I/O queue identifiers in use, and the live queue pairs (for shutdown).
struct QueueTable {
    /// `in_use[qid - 1]`.
    in_use: Vec<bool>,
    live: Vec<Weak<QueueHandle>>,
}

/// Every I/O queue pair's lifetime on one controller: the queue table and the admin channel it
/// issues creations and deletions on.
pub(crate) struct QueueLifecycle {
    admin: Arc<AdminChannel>,
    table: Mutex<QueueTable>,
    limits: QueueLimits,
}

impl fmt::Debug for QueueLifecycle {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("QueueLifecycle")
            .field("limits", &self.limits)
            .finish_non_exhaustive()
    }
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    // Every update under this lock leaves consistent state, so poisoning is ignored.
    m.lock().unwrap_or_else(|e| e.into_inner())
}

/// Whether a failed admin command surely never took effect on the controller: it completed
/// with an error status, or it was never submitted.
fn surely_not_executed(e: &Error) -> bool {
    matches!(
        e,
        Error::Nvme { .. } | Error::QueueFailed { .. } | Error::QueueFull { .. } | Error::ShutDown
    )
}

impl QueueLifecycle {
    /// Queue management for a controller that granted `limits.granted` I/O queue pairs.
    pub(crate) fn new(admin: Arc<AdminChannel>, limits: QueueLimits) -> Self {
        Self {
            admin,
            table: Mutex::new(QueueTable {
                in_use: vec![false; limits.granted as usize],
                live: Vec::new(),
            }),
            limits,
        }
    }

    /// Checks one ring of `regions` before anything reaches the controller.
    fn check_ring(
        &self,
        queue: &'static str,
        region: &DmaRegion,
        entries: u32,
        entry_size: usize,
    ) -> Result<(), Error> {
        let max = self.limits.max_entries;
        if !(2..=max).contains(&entries) {
            return Err(Error::InvalidQueueEntries {
                queue,
                entries,
                max,
            });
        }
        let needed = entries as usize * entry_size;
        if region.len() < needed {
            return Err(Error::QueueRegionTooSmall {
                queue,
                entries,
                needed,
                len: region.len(),
            });
        }
        let pages = &region.page_addresses()[..needed.div_ceil(DMA_PAGE_SIZE)];
        let contiguous = pages
            .windows(2)
            .all(|w| w[1] == w[0] + DMA_PAGE_SIZE as u64);
        if !contiguous {
            return Err(Error::Unsupported(if self.limits.cqr {
                format!(
                    "a {queue} in discontiguous device memory: the controller requires \
                     physically contiguous queues (CAP.CQR = 1)"
                )
            } else {
                format!(
                    "a {queue} in discontiguous device memory (the driver creates queues with \
                     PC = 1 only)"
                )
            }));
        }
        let base = pages[0];
        if base % DMA_PAGE_SIZE as u64 != 0 {
            return Err(Error::Unaligned {
                what: "queue base device address",
                value: base,
                align: DMA_PAGE_SIZE as u64,
            });
        }
        Ok(())
    }

    /// Allocates a queue id, runs `prepare(qid)` (without holding any lock), and creates the
    /// completion queue, then the submission queue, on `regions`
    /// ([`QueueLifecycle::create_many`] of one pair).
    pub(crate) fn create(
        self: &Arc<Self>,
        regions: QueueRegions,
        prepare: impl FnOnce(u16) -> Result<(), Error>,
    ) -> Result<CreatedQueuePair, Error> {
        let mut prepare = Some(prepare);
        let mut pairs = self.create_many(vec![regions], |_, qid| match prepare.take() {
            Some(p) => p(qid),
            None => Ok(()),
        })?;
        pairs.pop().ok_or(Error::ShutDown)
    }

    /// Creates a queue pair on each of `all`, all or none: allocates their queue ids, runs
    /// `prepare(i, qid)` for each (without holding any lock), then creates every completion
    /// queue, then every submission queue, each batch in flight together on the admin queue
    /// (a few round trips for any number of pairs). If any fails, undoes what it can and
    /// returns the first pair's error: frees the ids if a `prepare` fails (nothing reached the
    /// controller), deletes the queues that were created, and frees a queue id only when the
    /// controller surely has no queue with it (a creation lost on the way, or an admin queue
    /// that failed in the middle, keeps its id reserved).
    pub(crate) fn create_many(
        self: &Arc<Self>,
        all: Vec<QueueRegions>,
        mut prepare: impl FnMut(usize, u16) -> Result<(), Error>,
    ) -> Result<Vec<CreatedQueuePair>, Error> {
        if self.admin.is_shut_down() {
            return Err(Error::ShutDown);
        }
        for regions in &all {
            self.check_ring(
                "submission queue",
                &regions.sq,
                regions.sq_entries,
                SQE_SIZE,
            )?;
            self.check_ring(
                "completion queue",
                &regions.cq,
                regions.cq_entries,
                CQE_SIZE,
            )?;
        }
        let indices: Vec<usize> = {
            let mut table = lock(&self.table);
            let free: Vec<usize> = (0..table.in_use.len())
                .filter(|&i| !table.in_use[i])
                .take(all.len())
                .collect();
            if free.len() < all.len() {
                return Err(Error::NoQueueAvailable {
                    granted: self.limits.granted,
                });
            }
            for &i in &free {
                table.in_use[i] = true;
            }
            free
        };
        let qids: Vec<u16> = indices.iter().map(|&i| i as u16 + 1).collect();
        let free_ids = |table: &mut QueueTable, which: &mut dyn Iterator<Item = u16>| {
            for qid in which {
                table.in_use[qid as usize - 1] = false;
            }
        };
        for (i, &qid) in qids.iter().enumerate() {
            if let Err(e) = prepare(i, qid) {
                free_ids(&mut lock(&self.table), &mut qids.iter().copied());
                return Err(e);
            }
        }
        let mut table = lock(&self.table);
        if self.admin.is_shut_down() {
            free_ids(&mut table, &mut qids.iter().copied());
            return Err(Error::ShutDown);
        }
        // What each pair came to (`None`: made).
        let mut failed: Vec<Option<Undone>> = (0..all.len()).map(|_| None).collect();
        let outcome = self.admin.run(|a| {
            let cqs: Vec<_> = qids
                .iter()
                .zip(&all)
                .map(|(&q, r)| admin::create_cq(q, r.cq_entries, r.cq.device_address(0)))
                .collect();
            let with_cq: Vec<usize> = a
                .execute_many(&cqs)?
                .into_iter()
                .enumerate()
                .filter_map(|(i, r)| match r {
                    Ok(_) => Some(i),
                    Err(e) => {
                        // The CQ exists only if the command was lost after the controller
                        // acted on it.
                        let id_free = surely_not_executed(&e);
                        failed[i] = Some(Undone {
                            error: Some(e),
                            id_free,
                        });
                        None
                    }
                })
                .collect();
            let sqs: Vec<_> = with_cq
                .iter()
                .map(|&i| {
                    admin::create_sq(
                        qids[i],
                        all[i].sq_entries,
                        all[i].sq.device_address(0),
                        qids[i],
                    )
                })
                .collect();
            let sq_results = a.execute_many(&sqs)?;
            let mut cq_only = Vec::new();
            let mut both = Vec::new();
            for (&i, r) in with_cq.iter().zip(sq_results) {
                match r {
                    Ok(_) => both.push(i),
                    Err(e) => {
                        let id_free = surely_not_executed(&e);
                        failed[i] = Some(Undone {
                            error: Some(e),
                            id_free,
                        });
                        cq_only.push(i);
                    }
                }
            }
            if failed.iter().all(Option::is_none) {
                return Ok(());
            }
            // Undo: the pairs made whole, and the CQs whose SQ failed.
            let whole: Vec<u16> = both.iter().map(|&i| qids[i]).collect();
            for (&i, r) in both.iter().zip(a.delete_io_pairs(&whole)?) {
                failed[i] = Some(Undone {
                    error: None,
                    id_free: r.is_ok(),
                });
            }
            let dels: Vec<_> = cq_only
                .iter()
                .map(|&i| admin::delete_queue(AdminOpcode::DELETE_IO_CQ, qids[i]))
                .collect();
            for (&i, r) in cq_only.iter().zip(a.execute_many(&dels)?) {
                if let Some(u) = &mut failed[i] {
                    u.id_free &= r.is_ok();
                }
            }
            Ok(())
        });
        // The admin queue failed in the middle: which queues exist is unknown, so every id
        // stays reserved.
        outcome?;
        if failed.iter().any(Option::is_some) {
            free_ids(
                &mut table,
                &mut qids
                    .iter()
                    .zip(&failed)
                    .filter(|(_, f)| f.as_ref().is_some_and(|u| u.id_free))
                    .map(|(&q, _)| q),
            );
            let first = failed.into_iter().flatten().find_map(|u| u.error);
            return Err(first.unwrap_or(Error::ShutDown));
        }
        table.live.retain(|w| w.strong_count() > 0);
        let mut out = Vec::with_capacity(all.len());
        for (regions, qid) in all.into_iter().zip(qids) {
            let handle = Arc::new(QueueHandle {
                qid,
                deleted: AtomicBool::new(false),
            });
            table.live.push(Arc::downgrade(&handle));
            tracing::debug!(
                qid,
                sq_entries = regions.sq_entries,
                cq_entries = regions.cq_entries,
                sq_address = regions.sq.device_address(0),
                cq_address = regions.cq.device_address(0),
                "I/O queue pair created"
            );
            out.push(CreatedQueuePair {
                lifecycle: Arc::clone(self),
                handle,
                regions,
            });
        }
        Ok(out)
    }

    /// Deletes the pairs `handles` (each SQ then its CQ, all in flight together on the admin
    /// queue), skipping any whose deletion was attempted already (by its owner or by shutdown).
    /// A pair's queue id goes back to the pool when both its deletions succeed, unless
    /// `retire_qid`, in which case no later pair on this controller gets it. Returns the first
    /// error; every pair is retired either way.
    fn delete_many(&self, handles: &[&QueueHandle], retire_qid: bool) -> Result<(), Error> {
        let mut table = lock(&self.table);
        let todo: Vec<&QueueHandle> = handles
            .iter()
            .copied()
            .filter(|h| !h.deleted.load(Ordering::Acquire))
            .collect();
        if todo.is_empty() {
            return Ok(());
        }
        let qids: Vec<u16> = todo.iter().map(|h| h.qid).collect();
        let results = self.admin.run(|a| a.delete_io_pairs(&qids));
        for h in &todo {
            h.deleted.store(true, Ordering::Release);
        }
        let results = results?;
        let mut first_error = None;
        for (h, r) in todo.iter().zip(results) {
            match r {
                Ok(()) if !retire_qid => table.in_use[h.qid as usize - 1] = false,
                Ok(()) => {}
                Err(e) => {
                    first_error.get_or_insert(e);
                }
            }
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Marks the controller shut down and retires every live pair, deleting its queues while
    /// the admin queue still works. Returns `None` if shutdown had already begun, else the first
    /// deletion error (the caller goes on with the shutdown handshake either way).
    pub(crate) fn shutdown(&self) -> Option<Result<(), Error>> {
        let table = lock(&self.table);
        let mut admin = self.admin.begin_shutdown()?;
        let qids: Vec<u16> = table
            .live
            .iter()
            .filter_map(Weak::upgrade)
            .filter(|h| !h.deleted.swap(true, Ordering::AcqRel))
            .map(|h| h.qid)
            .collect();
        if qids.is_empty() || admin.is_failed() {
            return Some(Ok(()));
        }
        let mut first_error = None;
        match admin.delete_io_pairs(&qids) {
            Ok(results) => {
                for (qid, r) in qids.iter().zip(results) {
                    if let Err(e) = r {
                        tracing::warn!(qid, error = %e, "deleting I/O queue pair at shutdown");
                        first_error.get_or_insert(e);
                    }
                }
            }
            Err(e) => {
                tracing::warn!(error = %e, "deleting I/O queue pairs at shutdown");
                first_error = Some(e);
            }
        }
        Some(first_error.map_or(Ok(()), Err))
    }
}

/// An I/O queue pair that exists on the controller, on rings the creator supplied
/// ([`crate::Controller::create_queue_pair_on`]). `Send + Sync`.
///
/// It owns the queues' lifetime on the controller, not their use: whoever drives the rings
/// writes SQEs, rings [`CreatedQueuePair::sq_tail_doorbell`], polls the CQ's phase tags and
/// rings [`CreatedQueuePair::cq_head_doorbell`] (BAR0 byte offsets). It keeps the two regions
/// alive until it is dropped, and dropping it deletes the queues first (logging a warning if
/// that fails) unless [`CreatedQueuePair::delete`] or controller shutdown already did.
pub struct CreatedQueuePair {
    lifecycle: Arc<QueueLifecycle>,
    handle: Arc<QueueHandle>,
    regions: QueueRegions,
}

impl fmt::Debug for CreatedQueuePair {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("CreatedQueuePair")
            .field("qid", &self.handle.qid)
            .field("sq_entries", &self.regions.sq_entries)
            .field("cq_entries", &self.regions.cq_entries)
            .field("deleted", &self.is_deleted())
            .finish()
    }
}

impl CreatedQueuePair {
    /// Queue identifier of both the SQ and the CQ (the SQ posts to the CQ with the same id).
    pub fn qid(&self) -> u16 {
        self.handle.qid
    }

    /// Entries in the submission queue.
    pub fn sq_entries(&self) -> u32 {
        self.regions.sq_entries
    }

    /// Entries in the completion queue.
    pub fn cq_entries(&self) -> u32 {
        self.regions.cq_entries
    }

    /// The submission queue's memory.
    pub fn sq_region(&self) -> &Arc<DmaRegion> {
        &self.regions.sq
    }

    /// The completion queue's memory.
    pub fn cq_region(&self) -> &Arc<DmaRegion> {
        &self.regions.cq
    }

    /// BAR0 byte offset of the SQ Tail Doorbell (`0x1000 + 2 * qid * (4 << CAP.DSTRD)`).
    pub fn sq_tail_doorbell(&self) -> usize {
        sq_tail_doorbell(self.handle.qid, self.lifecycle.limits.dstrd)
    }

    /// BAR0 byte offset of the CQ Head Doorbell (`0x1000 + (2 * qid + 1) * (4 << CAP.DSTRD)`).
    pub fn cq_head_doorbell(&self) -> usize {
        cq_head_doorbell(self.handle.qid, self.lifecycle.limits.dstrd)
    }

    /// Whether the pair is retired: [`CreatedQueuePair::delete`] ran, or
    /// [`crate::Controller::shutdown`] (or the controller's drop) deleted its queues, or would
    /// have but for a failed admin queue. Its rings must not be used any more.
    #[inline]
    pub fn is_deleted(&self) -> bool {
        self.handle.deleted.load(Ordering::Acquire)
    }

    /// Deletes the submission queue, then the completion queue, and frees the queue id if both
    /// succeed. `Ok` at once if the pair was already retired (by shutdown, say). Whatever
    /// happens, the pair is retired afterwards; after an error its queue id stays reserved.
    pub fn delete(self) -> Result<(), Error> {
        self.lifecycle.delete_many(&[&self.handle], false)
    }

    /// Deletes `pairs` like [`CreatedQueuePair::delete`] (or
    /// [`CreatedQueuePair::delete_retiring_qid`] if `retire_qids`), the pairs of one controller
    /// together: their deletions in flight at once on its admin queue, a few round trips for
    /// any number of pairs instead of two each. Returns the first error; every pair is retired
    /// either way.
    pub fn delete_all(pairs: Vec<CreatedQueuePair>, retire_qids: bool) -> Result<(), Error> {
        let mut first_error = None;
        let mut rest: Vec<&CreatedQueuePair> = pairs.iter().collect();
        while let Some(one) = rest.first() {
            let (same, other): (Vec<&CreatedQueuePair>, Vec<&CreatedQueuePair>) = rest
                .iter()
                .partition(|p| Arc::ptr_eq(&p.lifecycle, &one.lifecycle));
            let handles: Vec<&QueueHandle> = same.iter().map(|p| &*p.handle).collect();
            if let Err(e) = one.lifecycle.delete_many(&handles, retire_qids) {
                first_error.get_or_insert(e);
            }
            rest = other;
        }
        first_error.map_or(Ok(()), Err)
    }

    /// Deletes the queue pair like [`CreatedQueuePair::delete`], but never hands its queue id
    /// out again on this controller: for rings whose users (GPU kernels, say) may still be
    /// running, so that a straggler's doorbell write can never reach a newer pair that took
    /// the same id.
    pub fn delete_retiring_qid(self) -> Result<(), Error> {
        self.lifecycle.delete_many(&[&self.handle], true)
    }
}

impl Drop for CreatedQueuePair {
    fn drop(&mut self) {
        if self.is_deleted() || self.lifecycle.admin.is_shut_down() {
            return;
        }
        if let Err(e) = self.lifecycle.delete_many(&[&self.handle], false) {
            tracing::warn!(qid = self.handle.qid, error = %e, "deleting I/O queue pair");
        }
    }
}
