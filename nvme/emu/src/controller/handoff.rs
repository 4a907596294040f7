//! Handing queues between controller thread 0 (which runs the admin command set) and the
//! thread that serves them: one mailbox per thread, one request at a time, and thread 0 waits
//! for the answer, so when an admin command completes its effect on the serving thread is done.

use std::sync::Mutex;
use std::sync::atomic::{AtomicBool, Ordering};
use std::time::Duration;

use super::Shared;
use crate::queues::{CompQueue, SubQueue};

/// How many times thread 0 looks for an answer before it starts parking between looks.
const SPINS: u32 = 2000;
/// Longest thread 0 parks between looks (the serving thread unparks it when it answers).
const PARK: Duration = Duration::from_micros(200);

/// What thread 0 asks of a serving thread.
pub(crate) enum Request {
    /// Serve this completion queue (created by the admin command set).
    AddCq { qid: u16, cq: CompQueue },
    /// Serve this submission queue; its completion queue is already served by the thread.
    AddSq { qid: u16, sq: SubQueue },
    /// Delete submission queue `qid`: complete its delayed commands with their results and its
    /// dropped ones as aborted by the deletion, then forget it.
    DeleteSq(u16),
    /// Forget completion queue `qid` (no submission queue posts to it any more).
    DeleteCq(u16),
    /// Complete command `cid` of submission queue `sqid` with Command Abort Requested if its
    /// completion was dropped or is being delayed; the answer says whether it was.
    Abort { sqid: u16, cid: u16 },
    /// Forget every queue and outstanding command (controller reset).
    Reset,
}

/// One thread's mailbox.
#[derive(Default)]
pub(crate) struct Mailbox {
    /// A request is waiting, or being handled (cleared with the answer).
    pending: AtomicBool,
    request: Mutex<Option<Request>>,
    answer: Mutex<Option<bool>>,
}

impl Mailbox {
    /// Takes the waiting request, if any (one atomic load when there is none).
    pub(crate) fn take(&self) -> Option<Request> {
        if !self.pending.load(Ordering::Acquire) {
            return None;
        }
        self.request
            .lock()
            .unwrap_or_else(|e| e.into_inner())
            .take()
    }

    /// Answers the request taken.
    pub(crate) fn answer(&self, answer: bool) {
        *self.answer.lock().unwrap_or_else(|e| e.into_inner()) = Some(answer);
        self.pending.store(false, Ordering::Release);
    }
}

/// Sends `request` to thread `thread` (not 0) and waits for its answer. Gives up (answering
/// `false`) only when the controller is stopping, so a dead thread cannot hang thread 0.
pub(crate) fn call(shared: &Shared, thread: usize, request: Request) -> bool {
    let mailbox = &shared.mailboxes[thread];
    *mailbox.request.lock().unwrap_or_else(|e| e.into_inner()) = Some(request);
    mailbox.pending.store(true, Ordering::Release);
    shared.regs.wake_thread(thread);
    let mut looks = 0u32;
    loop {
        if !mailbox.pending.load(Ordering::Acquire) {
            return mailbox
                .answer
                .lock()
                .unwrap_or_else(|e| e.into_inner())
                .take()
                .unwrap_or(false);
        }
        if shared.stop.load(Ordering::Acquire) {
            return false;
        }
        looks += 1;
        if looks < SPINS {
            std::hint::spin_loop();
        } else {
            std::thread::park_timeout(PARK);
        }
    }
}
