//! The public face of the state machine: inputs in, actions and deadlines out.

use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};

use statig::blocking::{IntoStateMachineExt, StateMachine};

use crate::action::{Action, Admission, ExitReason, Health};
use crate::config::Config;
use crate::event::Event;
use crate::loss::LossReason;
use crate::machine::{self, Abort, Input, RecordBook, State, Step, Worker};
use crate::time::Time;

/// The lifecycle state as operators and tests see it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Phase {
    /// Waiting for the engine and the first registration.
    Starting,
    /// Registered and admitting calls.
    Serving,
    /// Shutting down after a signal.
    Draining,
    /// Shutting down after an engine loss.
    Lost,
    /// Done; the process exits with this code.
    Exited(ExitReason),
}

impl Phase {
    /// The state's name, as in the design and the diagram.
    pub const fn name(self) -> &'static str {
        match self {
            Phase::Starting => "Starting",
            Phase::Serving => "Serving",
            Phase::Draining => "Draining",
            Phase::Lost => "Lost",
            Phase::Exited(_) => "Exited",
        }
    }
}

/// Upper bound on deadlines handled in one step; each handled deadline is
/// consumed or moved, so a correct machine needs a handful at most.
const MAX_DEADLINES_PER_STEP: usize = 32;

/// The lifecycle state machine of one sidecar worker.
///
/// Call order: `handle_event`/`handle_timeout`, then `poll_action` until
/// `None`, then `poll_timeout`. See the crate documentation.
#[derive(Clone)]
pub struct Lifecycle {
    machine: StateMachine<Worker>,
    step: Step,
}

impl std::fmt::Debug for Lifecycle {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("Lifecycle")
            .field("state", self.machine.state())
            .field("worker", self.machine.inner())
            .field("now", &self.step.now)
            .finish()
    }
}

impl Lifecycle {
    /// A worker that starts up at `now`; the startup deadline counts from here.
    pub fn new(config: Config, now: Time) -> Self {
        let mut machine = Worker::new(config, now).state_machine();
        let mut step = Step {
            now,
            outbox: Default::default(),
        };
        machine.init_with_context(&mut step);
        Lifecycle { machine, step }
    }

    /// Feeds one input that happened at `now`.
    ///
    /// `now` earlier than a previous input's is treated as that earlier time:
    /// the core's clock never runs backwards.
    pub fn handle_event(&mut self, now: Time, event: Event) {
        self.advance(now);
        self.machine
            .handle_with_context(&Input::Event(event), &mut self.step);
        self.fire_due();
    }

    /// Tells the core that time is now `now`; handles every deadline that is due.
    pub fn handle_timeout(&mut self, now: Time) {
        self.advance(now);
    }

    /// The next action to perform, oldest first.
    #[must_use = "every action must be performed, in order"]
    pub fn poll_action(&mut self) -> Option<Action> {
        self.step.outbox.pop_front()
    }

    /// The earliest deadline the core waits for, and why. `None` once exited.
    ///
    /// Always later than the time of the last input: due deadlines are handled
    /// within the step that reached them.
    #[must_use = "the driver must wake up at this deadline"]
    pub fn poll_timeout(&self) -> Option<(Time, &'static str)> {
        machine::next_deadline(self.machine.inner(), self.machine.state())
    }

    /// The current state.
    pub fn phase(&self) -> Phase {
        match self.machine.state() {
            State::Starting { .. } => Phase::Starting,
            State::Serving {} => Phase::Serving,
            State::Draining { .. } => Phase::Draining,
            State::Lost { .. } => Phase::Lost,
            State::Exited { cause } => Phase::Exited(cause.exit_reason()),
        }
    }

    /// Whether new calls are admitted.
    pub fn admission(&self) -> Admission {
        self.machine.inner().admission
    }

    /// The sidecar's own health: SERVING exactly in Serving.
    pub fn health(&self) -> Health {
        match self.phase() {
            Phase::Serving => Health::Serving,
            Phase::Starting | Phase::Draining | Phase::Lost | Phase::Exited(_) => {
                Health::NotServing
            }
        }
    }

    /// When the current state was entered.
    pub fn since(&self) -> Time {
        self.machine.inner().since
    }

    /// Why the worker is shutting down or exited (loss reason, signal,
    /// start-up failure), as `/state` shows it. `None` while starting or serving.
    pub fn reason(&self) -> Option<String> {
        let engine = &self.config().engine_display_name;
        match self.machine.state() {
            State::Starting { abort: None } | State::Serving {} => None,
            State::Starting { abort: Some(a) } => Some(a.cause.describe(engine)),
            State::Draining { .. } => Some(machine::StopCause::Signal.describe(engine)),
            State::Lost { reason, .. } => Some(reason.to_string()),
            State::Exited { cause } => Some(cause.describe(engine)),
        }
    }

    /// The engine loss being drained, while Lost.
    pub fn loss(&self) -> Option<&LossReason> {
        match self.machine.state() {
            State::Lost { reason, .. } => Some(reason),
            State::Starting { .. }
            | State::Serving {}
            | State::Draining { .. }
            | State::Exited { .. } => None,
        }
    }

    /// The engine identity read at start-up.
    pub fn engine_identity(&self) -> Option<&str> {
        self.machine.inner().identity.as_deref()
    }

    /// This worker's instance id now (a new one after every rejoin).
    pub fn instance_id(&self) -> u64 {
        self.machine.inner().instance_id
    }

    /// Calls in flight, as last reported.
    pub fn in_flight(&self) -> u64 {
        self.machine.inner().in_flight
    }

    /// The time of the last input.
    pub fn now(&self) -> Time {
        self.step.now
    }

    /// The settings this machine runs with.
    pub fn config(&self) -> &Config {
        &self.machine.inner().config
    }

    /// A hash of everything that decides future behaviour, with every stored
    /// time taken relative to [`Lifecycle::now`]. Two machines with equal
    /// fingerprints (and empty outboxes) answer the same inputs, shifted in
    /// time, with the same actions: model checkers use it to merge states.
    ///
    /// Every field of every state and of the shared storage is named here (no
    /// `..`), so a field added later does not compile until it is accounted
    /// for. A time that no state will read again (the startup deadline once
    /// start-up is over, the last fresh probe once nothing is watched) is left
    /// out: it would keep two otherwise equal states apart for ever.
    pub fn fingerprint(&self) -> u64 {
        let now = self.step.now;
        let rel = |t: Time| -> i128 {
            t.since_origin().as_nanos() as i128 - now.since_origin().as_nanos() as i128
        };
        let mut h = DefaultHasher::new();
        let state = self.machine.state();
        // Which clocks the state still reads.
        let (reads_startup_deadline, reads_last_fresh) = match state {
            State::Starting { abort } => (abort.is_none(), false),
            State::Serving {} => (false, true),
            State::Draining { engine_lost, .. } => (false, !*engine_lost),
            State::Lost { .. } | State::Exited { .. } => (false, false),
        };
        match state {
            State::Starting { abort } => {
                0u8.hash(&mut h);
                abort
                    .as_ref()
                    .map(|Abort { cause, deadline }| (cause, rel(*deadline)))
                    .hash(&mut h);
            }
            State::Serving {} => 1u8.hash(&mut h),
            State::Draining {
                admission_closes_at,
                drain_deadline,
                engine_lost,
            } => {
                2u8.hash(&mut h);
                (rel(*admission_closes_at), rel(*drain_deadline), engine_lost).hash(&mut h);
            }
            State::Lost {
                reason,
                drain_deadline,
                signalled,
            } => {
                3u8.hash(&mut h);
                (reason, rel(*drain_deadline), signalled).hash(&mut h);
            }
            State::Exited { cause } => {
                4u8.hash(&mut h);
                cause.hash(&mut h);
            }
        }
        let Worker {
            // Fixed for the machine's life: equal in every state it reaches.
            config: _,
            // A name in lines and records; no decision reads it, and every
            // rejoin makes a new one.
            instance_id: _,
            startup_deadline,
            identity,
            engine_name,
            engine_instance,
            liveness_service,
            book:
                RecordBook {
                    outstanding,
                    maybe_present,
                    withdraw_requested,
                },
            retry_at,
            watch,
            last_fresh,
            probe_failing,
            load_unsupported,
            in_flight,
            admission,
            // Only shown by `/state`; no decision reads it.
            since: _,
            discovery_failing,
            unregistered,
        } = self.machine.inner();
        reads_startup_deadline
            .then(|| rel(*startup_deadline))
            .hash(&mut h);
        (identity, engine_name, engine_instance, liveness_service).hash(&mut h);
        (outstanding, maybe_present, withdraw_requested).hash(&mut h);
        retry_at.map(rel).hash(&mut h);
        watch.hash(&mut h);
        // Without a load RPC the stale-load window is off: no clock reads it.
        (reads_last_fresh && !*load_unsupported)
            .then(|| rel(*last_fresh))
            .hash(&mut h);
        (probe_failing, load_unsupported).hash(&mut h);
        in_flight.hash(&mut h);
        admission.hash(&mut h);
        discovery_failing.hash(&mut h);
        // Set only while Serving (cleared on the way out).
        unregistered
            .as_ref()
            .map(|(since, cause)| (rel(*since), cause))
            .hash(&mut h);
        self.step.outbox.hash(&mut h);
        h.finish()
    }

    fn advance(&mut self, now: Time) {
        if now > self.step.now {
            self.step.now = now;
        }
        self.fire_due();
    }

    /// Handles every deadline at or before now, earliest first.
    fn fire_due(&mut self) {
        for _ in 0..MAX_DEADLINES_PER_STEP {
            match self.poll_timeout() {
                Some((at, _)) if at <= self.step.now => {
                    self.machine
                        .handle_with_context(&Input::Timer, &mut self.step);
                }
                Some(_) | None => return,
            }
        }
        // Every handled deadline is consumed or moved; reaching this is a bug in
        // the machine, reported by the invariant checkers (a deadline left due).
    }
}
