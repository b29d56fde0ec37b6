//! The admission gate and in-flight counter of the request plane.
//!
//! One atomic word holds both the "closed" flag and the number of admitted
//! calls still in flight, so "is the gate open?" and "count me in" are one
//! indivisible step: no call can slip in after the gate closed, and exactly one
//! party (the closer, or the last call to leave) sees the drain complete.

use crate::sync::{AtomicU64, Ordering};

const CLOSED: u64 = 1 << 63;
const COUNT: u64 = CLOSED - 1;

/// Admission gate plus in-flight counter, shared by every request task.
#[derive(Debug)]
pub struct Gate {
    word: AtomicU64,
}

/// What leaving the gate means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Left {
    /// Calls still in flight after this one left.
    pub in_flight: u64,
    /// This was the last call out of a closed gate: the drain is complete.
    pub drained: bool,
}

/// What closing the gate means.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Closed {
    /// Calls in flight at the moment of closing.
    pub in_flight: u64,
    /// No call was in flight: the drain is already complete. False if the gate
    /// was already closed (the drain is reported once).
    pub drained: bool,
}

impl Default for Gate {
    fn default() -> Self {
        Gate::new()
    }
}

impl Gate {
    /// A gate that is closed (calls are refused until [`Gate::open`]).
    pub fn new() -> Self {
        Gate {
            word: AtomicU64::new(CLOSED),
        }
    }

    /// Admits a call and counts it in flight, or refuses it if the gate is closed.
    /// Every `true` must be paired with exactly one [`Gate::leave`].
    pub fn try_enter(&self) -> bool {
        let mut current = self.word.load(Ordering::Acquire);
        loop {
            if current & CLOSED != 0 {
                return false;
            }
            // The count cannot reach 2^63 calls; saturating keeps the flag bit safe anyway.
            let next = (current & COUNT).saturating_add(1).min(COUNT);
            match self.word.compare_exchange_weak(
                current,
                next,
                Ordering::AcqRel,
                Ordering::Acquire,
            ) {
                Ok(_) => return true,
                Err(seen) => current = seen,
            }
        }
    }

    /// Ends an admitted call.
    pub fn leave(&self) -> Left {
        let before = self.word.fetch_sub(1, Ordering::AcqRel);
        let in_flight = (before & COUNT).saturating_sub(1);
        Left {
            in_flight,
            drained: before & CLOSED != 0 && in_flight == 0,
        }
    }

    /// Opens the gate for new calls.
    pub fn open(&self) {
        self.word.fetch_and(COUNT, Ordering::AcqRel);
    }

    /// Closes the gate: every later `try_enter` is refused.
    pub fn close(&self) -> Closed {
        let before = self.word.fetch_or(CLOSED, Ordering::AcqRel);
        let in_flight = before & COUNT;
        Closed {
            in_flight,
            drained: before & CLOSED == 0 && in_flight == 0,
        }
    }

    /// Calls admitted and not yet left.
    pub fn in_flight(&self) -> u64 {
        self.word.load(Ordering::Acquire) & COUNT
    }
}

#[cfg(all(test, not(loom)))]
mod tests {
    use super::*;

    #[test]
    fn closed_gate_refuses_and_open_gate_counts() {
        let gate = Gate::new();
        assert!(!gate.try_enter());
        gate.open();
        assert!(gate.try_enter());
        assert!(gate.try_enter());
        assert_eq!(gate.in_flight(), 2);
        assert_eq!(
            gate.close(),
            Closed {
                in_flight: 2,
                drained: false
            }
        );
        assert!(!gate.try_enter());
        assert_eq!(
            gate.leave(),
            Left {
                in_flight: 1,
                drained: false
            }
        );
        assert_eq!(
            gate.leave(),
            Left {
                in_flight: 0,
                drained: true
            }
        );
    }

    #[test]
    fn closing_an_idle_gate_is_drained_once() {
        let gate = Gate::new();
        gate.open();
        assert!(gate.close().drained);
        assert!(!gate.close().drained);
    }

    #[test]
    fn leaving_an_open_gate_never_reports_drained() {
        let gate = Gate::new();
        gate.open();
        assert!(gate.try_enter());
        assert_eq!(
            gate.leave(),
            Left {
                in_flight: 0,
                drained: false
            }
        );
    }
}
