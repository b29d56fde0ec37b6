//! Engine streams per caller address: every connection from one address
//! shares one budget, so a caller cannot take more of the engine by opening
//! more connections.
//!
//! The budget is what one caller connection may hold (`Plane::stream_cap`:
//! the `--max-concurrent-streams` flag, and never more than half of what the
//! engine takes through the pool). Per connection only, two connections from
//! one address held every engine stream (hardening round three, attack 6),
//! and any number of them could. A call waits for a place in its address's
//! budget before its engine stream opens, so what waits holds no engine
//! stream; its caller's deadline and reset still end it.

use std::collections::HashMap;
use std::net::IpAddr;
use std::sync::{Arc, Mutex, Weak};

use tokio::sync::Semaphore;

/// The budget of each caller address with a connection open.
#[derive(Default)]
pub(crate) struct CallerStreams {
    /// Held weakly: a budget lives as long as a connection or a call of its
    /// address holds it.
    by_address: Mutex<HashMap<IpAddr, Weak<Semaphore>>>,
}

impl CallerStreams {
    /// The budget `address` shares among its connections: the one in use,
    /// or a new one of `streams` places.
    pub(crate) fn of(&self, address: IpAddr, streams: u32) -> Arc<Semaphore> {
        let mut by_address = self.by_address.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(budget) = by_address.get(&address).and_then(Weak::upgrade) {
            return budget;
        }
        // Addresses whose last connection and call have ended go here: the
        // map holds no more than the addresses with a connection open, and
        // one.
        by_address.retain(|_, budget| budget.strong_count() > 0);
        let budget = Arc::new(Semaphore::new(streams as usize));
        by_address.insert(address, Arc::downgrade(&budget));
        budget
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn one_address_shares_one_budget_until_nothing_holds_it() {
        let streams = CallerStreams::default();
        let a: IpAddr = "10.0.0.1".parse().unwrap();
        let b: IpAddr = "10.0.0.2".parse().unwrap();
        let first = streams.of(a, 3);
        let second = streams.of(a, 3);
        assert!(Arc::ptr_eq(&first, &second), "two connections, one budget");
        let _held = first.clone().try_acquire_many_owned(3).unwrap();
        assert!(second.try_acquire().is_err(), "the address has used its 3");
        assert_eq!(
            streams.of(b, 3).available_permits(),
            3,
            "another address has its own"
        );
        drop((first, second));
        // A call still holds a place: the budget lives on with it.
        assert_eq!(streams.of(a, 3).available_permits(), 0);
        drop(_held);
        assert_eq!(streams.of(a, 3).available_permits(), 3);
        assert!(streams.by_address.lock().unwrap().len() <= 2);
    }
}
