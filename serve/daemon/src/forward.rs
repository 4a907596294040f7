//! Shadow doorbells for controllers whose doorbells are registers (a vfio-user server's BAR0,
//! later a VFIO function's): a client stores its SQ tails and CQ heads in its own doorbell
//! page, and one daemon thread per controller forwards each new value to the register after
//! checking it is inside the queue's ring. A client never gets the register window, so it can
//! ring no other client's queue, and a value outside its ring is refused and counted, never
//! written.
//!
//! The thread polls: without interrupts from the client's side there is nothing to wait on.
//! It spins briefly after a change and then sleeps between passes (50 microseconds, 1 ms when
//! idle for long), so an idle daemon costs little CPU and a busy client sees its doorbells
//! forwarded within tens of microseconds.
#![forbid(unsafe_code)]

use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::{Arc, Mutex, PoisonError};
use std::thread::JoinHandle;
use std::time::Duration;

use gpunvme_serve_shm::SharedMemory;

/// One queue pair's shadow words and registers.
pub struct ShadowQueue {
    /// The queue id.
    pub qid: u16,
    /// The client's doorbell page.
    pub page: Arc<SharedMemory>,
    /// Offsets of its SQ tail and CQ head words in the page.
    pub sq_word: usize,
    /// See `sq_word`.
    pub cq_word: usize,
    /// Entries in each ring.
    pub depth: u32,
    /// BAR0 offsets of its SQ tail and CQ head doorbells.
    pub sq_register: usize,
    /// See `sq_register`.
    pub cq_register: usize,
}

struct Entry {
    q: ShadowQueue,
    /// Last values seen in the words (forwarded or refused).
    seen_sq: u32,
    seen_cq: u32,
}

struct Shared {
    device: Arc<dyn nvme::Device>,
    entries: Mutex<Vec<Entry>>,
    stop: AtomicBool,
    forwarded: AtomicU64,
    refused: AtomicU64,
}

/// The forwarding thread of one controller.
pub struct Forwarder {
    shared: Arc<Shared>,
    thread: Option<JoinHandle<()>>,
}

impl Forwarder {
    /// Starts forwarding to `device`'s doorbell registers (no queue yet).
    pub fn start(device: Arc<dyn nvme::Device>, name: &str) -> std::io::Result<Self> {
        let shared = Arc::new(Shared {
            device,
            entries: Mutex::new(Vec::new()),
            stop: AtomicBool::new(false),
            forwarded: AtomicU64::new(0),
            refused: AtomicU64::new(0),
        });
        let s = shared.clone();
        let thread = std::thread::Builder::new()
            .name(format!("serve-doorbells-{name}"))
            .spawn(move || run(&s))?;
        Ok(Self {
            shared,
            thread: Some(thread),
        })
    }

    /// Forwards `q`'s doorbells from now on (its words are zero: the queue was just created).
    pub fn add(&self, q: ShadowQueue) {
        lock(&self.shared.entries).push(Entry {
            q,
            seen_sq: 0,
            seen_cq: 0,
        });
    }

    /// Stops forwarding queues `qids` of `page`'s client: once this returns, no value the
    /// client stores reaches the controller for them.
    pub fn remove(&self, page: &Arc<SharedMemory>, qids: &[u16]) {
        lock(&self.shared.entries)
            .retain(|e| !(Arc::ptr_eq(&e.q.page, page) && qids.contains(&e.q.qid)));
    }

    /// Doorbell values forwarded, and refused (outside their ring).
    pub fn counts(&self) -> (u64, u64) {
        (
            self.shared.forwarded.load(Ordering::Relaxed),
            self.shared.refused.load(Ordering::Relaxed),
        )
    }
}

impl Drop for Forwarder {
    fn drop(&mut self) {
        self.shared.stop.store(true, Ordering::Release);
        if let Some(t) = self.thread.take() {
            let _ = t.join();
        }
    }
}

fn lock<T>(m: &Mutex<T>) -> std::sync::MutexGuard<'_, T> {
    m.lock().unwrap_or_else(PoisonError::into_inner)
}

fn run(s: &Shared) {
    let mut idle = 0u32;
    while !s.stop.load(Ordering::Acquire) {
        let mut changed = false;
        {
            let mut entries = lock(&s.entries);
            for e in entries.iter_mut() {
                // Acquire: the entries a client wrote before its Release store of the tail
                // are in memory before the controller is told of them.
                for (sq, word, register) in [
                    (true, e.q.sq_word, e.q.sq_register),
                    (false, e.q.cq_word, e.q.cq_register),
                ] {
                    let Ok(v) = e.q.page.load_u32(word, Ordering::Acquire) else {
                        continue;
                    };
                    let seen = if sq { &mut e.seen_sq } else { &mut e.seen_cq };
                    if v == *seen {
                        continue;
                    }
                    *seen = v;
                    changed = true;
                    if v >= e.q.depth {
                        s.refused.fetch_add(1, Ordering::Relaxed);
                        tracing::debug!(
                            qid = e.q.qid,
                            sq,
                            value = v,
                            "doorbell outside the ring refused"
                        );
                        continue;
                    }
                    s.device.write_doorbell(register, v);
                    s.forwarded.fetch_add(1, Ordering::Relaxed);
                }
            }
        }
        if changed {
            idle = 0;
            continue;
        }
        idle = idle.saturating_add(1);
        match idle {
            0..64 => std::hint::spin_loop(),
            64..20_000 => std::thread::sleep(Duration::from_micros(50)),
            _ => std::thread::sleep(Duration::from_millis(1)),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Instant;

    /// Records every register write.
    #[derive(Default)]
    struct Recorder(Mutex<Vec<(usize, u32)>>);

    impl nvme::RegisterIo for Recorder {
        fn len(&self) -> usize {
            0x2000
        }
        fn read_u32(&self, _: usize) -> u32 {
            0
        }
        fn write_u32(&self, offset: usize, value: u32) {
            lock(&self.0).push((offset, value));
        }
    }

    struct Fake(Recorder);

    impl nvme::Device for Fake {
        fn registers(&self) -> &dyn nvme::RegisterIo {
            &self.0
        }
        fn alloc_dma(&self, len: usize) -> Result<nvme::DmaMemory, nvme::DmaAllocError> {
            Err(nvme::DmaAllocError {
                len,
                reason: "a fake".into(),
                source: None,
            })
        }
        fn describe(&self) -> String {
            "fake".into()
        }
    }

    fn wait_for(what: &str, mut f: impl FnMut() -> bool) {
        let t = Instant::now();
        while !f() {
            assert!(t.elapsed() < Duration::from_secs(5), "never: {what}");
            std::thread::sleep(Duration::from_millis(1));
        }
    }

    #[test]
    fn values_inside_the_ring_are_forwarded_others_refused_and_removal_stops_both() {
        let dev = Arc::new(Fake(Recorder::default()));
        let f = Forwarder::start(dev.clone(), "test").unwrap();
        let page = Arc::new(SharedMemory::create("test", 4096).unwrap());
        f.add(ShadowQueue {
            qid: 3,
            page: page.clone(),
            sq_word: 128,
            cq_word: 132,
            depth: 16,
            sq_register: 0x1018,
            cq_register: 0x101c,
        });
        let writes = || lock(&dev.0.0).clone();
        page.store_u32(128, 5, Ordering::Release).unwrap();
        wait_for("the tail forwarded", || writes() == [(0x1018, 5)]);
        page.store_u32(132, 4, Ordering::Release).unwrap();
        wait_for("the head forwarded", || writes().len() == 2);
        assert_eq!(writes()[1], (0x101c, 4));
        // Outside the ring: refused, counted, never written.
        page.store_u32(128, 16, Ordering::Release).unwrap();
        wait_for("the refusal counted", || f.counts().1 == 1);
        assert_eq!(writes().len(), 2);
        assert_eq!(f.counts(), (2, 1));
        // Removed: nothing more reaches the registers.
        f.remove(&page, &[3]);
        page.store_u32(128, 7, Ordering::Release).unwrap();
        std::thread::sleep(Duration::from_millis(20));
        assert_eq!(writes().len(), 2);
    }
}
