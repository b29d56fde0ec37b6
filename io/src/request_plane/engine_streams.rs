//! Engine streams, shared among caller addresses by need, not by quota.
//!
//! Every call takes an engine stream here before its request reaches the
//! engine. A router is one address and may want every stream the engine
//! takes, so nothing here caps an address that nobody else competes with;
//! fairness starts only when the streams run short:
//!
//! 1. While fewer than `open` streams are held, a call gets one at once.
//! 2. Past that, a call whose address holds less than its fair share
//!    (`open` divided among the addresses holding or wanting streams) still
//!    gets one at once, up to `2 × open` in all: an address that took every
//!    stream while it was alone cannot make a newcomer wait for its calls to
//!    end, which for a caller that never reads is never.
//! 3. Every other call waits. Waiting calls are admitted round-robin across
//!    addresses, in arrival order within one, as streams end or shares grow.
//!
//! `open` is what the sidecar lets callers take without competing. What an
//! engine stream may make the sidecar hold is one engine stream window
//! (docs/RELIABILITY.md, "Flow control"), so `2 × open` bounds those bytes;
//! the engine pool opens connections on demand up to what `2 × open` needs.
//! Before hardening round three's attack 6 was closed this way, one address
//! could hold every engine stream and starve the rest; closed by a fixed
//! per-address budget instead, a lone router got at most half the engine.

use std::collections::{HashMap, VecDeque};
use std::net::IpAddr;
use std::sync::{Arc, Mutex};

use tokio::sync::oneshot;

/// The engine streams the request plane may hold, and the calls waiting for
/// one.
pub(crate) struct EngineStreams {
    queue: Mutex<Queue>,
    /// `open`, read when a call asks (the engine's per-connection limit, on
    /// which an explicit `--engine-connections` makes it depend, is learned
    /// from its first SETTINGS).
    open: Box<dyn Fn() -> usize + Send + Sync>,
}

/// One call's engine stream; given back when dropped.
pub(crate) struct EngineStream {
    streams: Arc<EngineStreams>,
    address: IpAddr,
}

#[derive(Default)]
struct Queue {
    /// Streams held by every address.
    held: usize,
    /// Addresses holding or waiting for a stream; no others.
    addresses: HashMap<IpAddr, Address>,
    /// Addresses with a call waiting, in turn order.
    turns: VecDeque<IpAddr>,
    /// Said that calls wait, until none do.
    saturated_said: bool,
}

#[derive(Default)]
struct Address {
    held: usize,
    waiting: VecDeque<oneshot::Sender<EngineStream>>,
}

/// Why the queue may give a stream now.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Room {
    /// Fewer than `open` are held.
    Free,
    /// The address is under its fair share, and fewer than `2 × open` are held.
    Share,
}

impl Queue {
    /// Whether a call of `address` may take a stream now, and why. Its fair
    /// share is `open` divided among the addresses holding or wanting
    /// streams, itself included (rounded up, at least one).
    fn room(&self, address: &IpAddr, open: usize) -> Option<Room> {
        if self.held < open {
            return Some(Room::Free);
        }
        let own = self.addresses.get(address);
        let competing = self.addresses.len() + usize::from(own.is_none());
        let share = open.div_ceil(competing.max(1)).max(1);
        let held = own.map_or(0, |a| a.held);
        (held < share && self.held < 2 * open).then_some(Room::Share)
    }

    fn take(&mut self, address: IpAddr) {
        self.held += 1;
        self.addresses.entry(address).or_default().held += 1;
    }

    fn forget_if_idle(&mut self, address: &IpAddr) {
        if self
            .addresses
            .get(address)
            .is_some_and(|a| a.held == 0 && a.waiting.is_empty())
        {
            self.addresses.remove(address);
        }
    }

    /// Admits waiting calls round-robin across addresses while there is
    /// room for them; returns whom to hand their streams to, which happens
    /// after the lock is let go (a stream nobody takes any more is given
    /// back through the lock).
    fn admit_waiting(&mut self, open: usize) -> Vec<(oneshot::Sender<EngineStream>, IpAddr)> {
        let mut admitted = Vec::new();
        let mut passed = 0;
        while passed < self.turns.len() {
            let Some(address) = self.turns.pop_front() else {
                break;
            };
            // Calls given up while waiting leave here.
            if let Some(a) = self.addresses.get_mut(&address) {
                while a.waiting.front().is_some_and(|w| w.is_closed()) {
                    a.waiting.pop_front();
                }
            }
            let waiting = self
                .addresses
                .get(&address)
                .is_some_and(|a| !a.waiting.is_empty());
            if !waiting {
                self.forget_if_idle(&address);
                continue;
            }
            if self.room(&address, open).is_some() {
                self.take(address);
                if let Some(w) = self
                    .addresses
                    .get_mut(&address)
                    .and_then(|a| a.waiting.pop_front())
                {
                    admitted.push((w, address));
                }
                passed = 0;
            } else {
                passed += 1;
            }
            if self
                .addresses
                .get(&address)
                .is_some_and(|a| !a.waiting.is_empty())
            {
                self.turns.push_back(address);
            }
        }
        if self.turns.is_empty() {
            self.saturated_said = false;
        }
        admitted
    }
}

impl EngineStreams {
    /// Streams shared as the module says, with `open` read at each ask.
    pub(crate) fn new(open: impl Fn() -> usize + Send + Sync + 'static) -> Arc<Self> {
        Arc::new(EngineStreams {
            queue: Mutex::default(),
            open: Box::new(open),
        })
    }

    fn lock(&self) -> std::sync::MutexGuard<'_, Queue> {
        self.queue.lock().unwrap_or_else(|p| p.into_inner())
    }

    fn open(&self) -> usize {
        (self.open)().max(1)
    }

    /// An engine stream for a call of `address`: at once when there is room
    /// for it, else when its turn comes. Dropping the future gives up its
    /// place.
    pub(crate) async fn acquire(self: &Arc<Self>, address: IpAddr) -> Option<EngineStream> {
        let open = self.open();
        let waiting = {
            let mut queue = self.lock();
            let own_waiting = queue
                .addresses
                .get(&address)
                .is_some_and(|a| !a.waiting.is_empty());
            // A call that finds calls waiting takes no free stream before
            // them: free ones go round the turns.
            let room = queue.room(&address, open);
            let ahead = match room {
                Some(Room::Free) => !queue.turns.is_empty(),
                Some(Room::Share) => own_waiting,
                None => true,
            };
            if !ahead {
                queue.take(address);
                drop(queue);
                return Some(self.stream(address));
            }
            let (sender, receiver) = oneshot::channel();
            queue
                .addresses
                .entry(address)
                .or_default()
                .waiting
                .push_back(sender);
            if !own_waiting {
                queue.turns.push_back(address);
            }
            if !queue.saturated_said {
                queue.saturated_said = true;
                tracing::info!(
                    held = queue.held,
                    open,
                    addresses = queue.addresses.len(),
                    "request plane: engine streams are short; calls from callers holding more \
                     than their share wait and are admitted in turn as streams end"
                );
            }
            receiver
        };
        waiting.await.ok()
    }

    fn stream(self: &Arc<Self>, address: IpAddr) -> EngineStream {
        EngineStream {
            streams: self.clone(),
            address,
        }
    }

    /// Engine streams held now.
    #[cfg(test)]
    fn held(&self) -> usize {
        self.lock().held
    }
}

impl Drop for EngineStream {
    fn drop(&mut self) {
        let open = self.streams.open();
        let admitted = {
            let mut queue = self.streams.lock();
            queue.held = queue.held.saturating_sub(1);
            if let Some(a) = queue.addresses.get_mut(&self.address) {
                a.held = a.held.saturating_sub(1);
            }
            queue.forget_if_idle(&self.address);
            queue.admit_waiting(open)
        };
        for (waiter, address) in admitted {
            // A waiter gone since: its stream comes back here at once.
            let _ = waiter.send(self.streams.stream(address));
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    fn addr(last: u8) -> IpAddr {
        IpAddr::from([10, 0, 0, last])
    }

    async fn take(streams: &Arc<EngineStreams>, address: IpAddr, n: usize) -> Vec<EngineStream> {
        let mut held = Vec::new();
        for _ in 0..n {
            held.push(streams.acquire(address).await.expect("a stream"));
        }
        held
    }

    /// Whether a call of `address` gets a stream before the (paused) clock
    /// has moved a second.
    async fn at_once(streams: &Arc<EngineStreams>, address: IpAddr) -> Option<EngineStream> {
        tokio::time::timeout(Duration::from_secs(1), streams.acquire(address))
            .await
            .ok()
            .flatten()
    }

    #[tokio::test(start_paused = true)]
    async fn a_lone_address_takes_every_stream_there_is() {
        let streams = EngineStreams::new(|| 8);
        let held = take(&streams, addr(1), 8).await;
        assert_eq!(streams.held(), 8);
        assert!(
            at_once(&streams, addr(1)).await.is_none(),
            "past `open`, an address over its share waits"
        );
        drop(held);
        assert_eq!(streams.held(), 0);
        assert!(streams.lock().addresses.is_empty(), "nothing kept");
    }

    #[tokio::test(start_paused = true)]
    async fn a_newcomer_gets_its_share_at_once_beside_an_address_holding_everything() {
        let streams = EngineStreams::new(|| 8);
        let _hog = take(&streams, addr(1), 8).await;
        // Two addresses: a share is 4, and the newcomer holds none.
        let mut late = Vec::new();
        for n in 0..4 {
            late.push(
                at_once(&streams, addr(2))
                    .await
                    .unwrap_or_else(|| panic!("the newcomer's call {n} waited")),
            );
        }
        assert!(
            at_once(&streams, addr(2)).await.is_none(),
            "past its share it waits like anyone"
        );
        assert_eq!(streams.held(), 12, "at most 2 × open");
    }

    #[tokio::test(start_paused = true)]
    async fn never_more_than_twice_open_whatever_the_addresses() {
        let streams = EngineStreams::new(|| 8);
        let mut held = take(&streams, addr(1), 8).await;
        for last in 2..40 {
            if let Some(s) = at_once(&streams, addr(last)).await {
                held.push(s);
            }
        }
        assert!(streams.held() <= 16, "held {}", streams.held());
    }

    #[tokio::test(start_paused = true)]
    async fn waiting_calls_are_admitted_in_turn_across_addresses() {
        let streams = EngineStreams::new(|| 4);
        // Two addresses at their share (2 of 4 each): every call waits.
        let mut a = take(&streams, addr(1), 2).await;
        let mut b = take(&streams, addr(2), 2).await;
        let order = Arc::new(Mutex::new(Vec::new()));
        let mut tasks = Vec::new();
        // Three calls of a wait first, then two of b.
        for (who, n) in [(1u8, 3), (2, 2)] {
            for _ in 0..n {
                let (streams, order) = (streams.clone(), order.clone());
                tasks.push(tokio::spawn(async move {
                    let s = streams.acquire(addr(who)).await.expect("admitted");
                    order.lock().unwrap().push(who);
                    s
                }));
                tokio::task::yield_now().await;
            }
        }
        tokio::time::sleep(Duration::from_millis(10)).await;
        assert!(order.lock().unwrap().is_empty(), "all five wait");
        // Streams end, one at a time.
        for _ in 0..2 {
            drop(a.pop());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        for _ in 0..2 {
            drop(b.pop());
            tokio::time::sleep(Duration::from_millis(10)).await;
        }
        let order = order.lock().unwrap().clone();
        // In arrival order it would be a, a, a, b.
        assert_eq!(order.len(), 4, "{order:?}");
        assert_eq!(&order[..2], &[1, 2], "round-robin, not arrival order");
        let of = |who| order.iter().filter(|w| **w == who).count();
        assert_eq!((of(1), of(2)), (2, 2), "{order:?}");
        for t in tasks {
            t.abort();
        }
    }

    #[tokio::test(start_paused = true)]
    async fn a_call_given_up_while_waiting_leaves_no_stream_behind() {
        let streams = EngineStreams::new(|| 2);
        let held = take(&streams, addr(1), 2).await;
        assert!(at_once(&streams, addr(1)).await.is_none());
        drop(held);
        assert_eq!(streams.held(), 0, "the abandoned waiter's stream came back");
        assert!(streams.lock().addresses.is_empty());
    }
}
