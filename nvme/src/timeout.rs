//! Bounded waiting: deadlines for commands and a spin → yield → sleep backoff for polls.
//!
//! No wait in the driver is unbounded: every command carries a deadline and every register
//! handshake is bounded by a timeout derived from CAP.TO, RTD3E or [`crate::ControllerOptions`].

#![forbid(unsafe_code)]

use std::time::Duration;

/// How a polling loop waits between polls: spin briefly (completions usually arrive within
/// microseconds), then yield the CPU, then sleep in short steps so a stalled device does not
/// burn a core.
#[derive(Debug)]
pub(crate) struct Backoff {
    step: u32,
    spin_steps: u32,
    yield_steps: u32,
    max_sleep: Duration,
}

impl Backoff {
    /// For I/O completion polling: long spin/yield phases, sleeps of at most 100 µs.
    pub(crate) fn for_io() -> Self {
        Self {
            step: 0,
            spin_steps: 256,
            yield_steps: 4096,
            max_sleep: Duration::from_micros(100),
        }
    }

    /// For admin commands: short spin, sleeps up to 1 ms.
    pub(crate) fn for_admin() -> Self {
        Self {
            step: 0,
            spin_steps: 64,
            yield_steps: 256,
            max_sleep: Duration::from_millis(1),
        }
    }

    /// For register handshakes (CSTS.RDY, CSTS.SHST): quick yields, then 1 ms sleeps.
    pub(crate) fn for_registers() -> Self {
        Self {
            step: 0,
            spin_steps: 16,
            yield_steps: 64,
            max_sleep: Duration::from_millis(1),
        }
    }

    /// Starts over (call after progress was made).
    pub(crate) fn reset(&mut self) {
        self.step = 0;
    }

    /// Waits a little; each call waits as long as or longer than the previous one.
    pub(crate) fn snooze(&mut self) {
        if self.step < self.spin_steps {
            for _ in 0..16 {
                std::hint::spin_loop();
            }
        } else if self.step < self.spin_steps + self.yield_steps {
            std::thread::yield_now();
        } else {
            let extra = (self.step - self.spin_steps - self.yield_steps).min(16);
            let sleep = Duration::from_micros(10 * (1 + extra as u64)).min(self.max_sleep);
            std::thread::sleep(sleep);
        }
        self.step = self.step.saturating_add(1);
    }
}

/// How often an idle queue looks at its deadlines and at CSTS, for a given command timeout:
/// an eighth of it, between 1 ms and 10 ms.
pub(crate) fn check_interval(timeout: Duration) -> Duration {
    (timeout / 8).clamp(Duration::from_millis(1), Duration::from_millis(10))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn interval_bounds() {
        assert_eq!(
            check_interval(Duration::from_secs(10)),
            Duration::from_millis(10)
        );
        assert_eq!(
            check_interval(Duration::from_millis(40)),
            Duration::from_millis(5)
        );
        assert_eq!(check_interval(Duration::ZERO), Duration::from_millis(1));
    }
}
