//! One oracle for many drivers.
//!
//! - [`World`]: a realistic environment for the core: discovery answering in
//!   order, calls that start only while admission is open, monitors that report
//!   only while started. It turns an [`AbstractEvent`] into a concrete input, or
//!   says the event cannot happen now.
//! - [`Checker`]: the nine invariants of the lifecycle (docs/CONTRACT.md,
//!   "Invariants"), checked after every step.
//! - [`Harness`]: a [`Lifecycle`] in a [`World`] watched by a [`Checker`].
//!
//! The proptest state-machine test, the exhaustive explorer and the fuzzer all
//! drive a [`Harness`]; none has an invariant of its own.

use std::collections::VecDeque;
use std::collections::hash_map::DefaultHasher;
use std::hash::{Hash, Hasher};
use std::time::Duration;

use arbitrary::Arbitrary;
use llm_sidecar_core::{
    Action, Admission, Config, ConnectionEnd, DiscoveryEvent, EngineEvent, Event, ExitReason,
    Health, Level, Lifecycle, LivenessObservation, OnEngineLoss, Phase, Time,
};

pub mod diagram;

/// The settings every driver uses: short enough for time jumps to matter,
/// ordered like production (retry < grace < drain < stale < re-registration
/// < startup).
pub fn test_config() -> Config {
    Config {
        engine_display_name: "TensorRT-LLM".into(),
        instance_id: 0x5eed,
        retry_interval: Duration::from_secs(1),
        startup_deadline: Duration::from_secs(60),
        stale_after: Duration::from_secs(30),
        router_grace: Duration::from_secs(5),
        drain_timeout: Duration::from_secs(20),
        reregister_deadline: Duration::from_secs(45),
        on_engine_loss: OnEngineLoss::Exit,
    }
}

/// The engine identity the world announces at start-up.
pub const IDENTITY: &str = "TensorRT-LLM 1.0 pytorch tp1 pp1 cp1 model-a";
/// A different engine answering on the same port.
pub const OTHER_IDENTITY: &str = "TensorRT-LLM 1.1 pytorch tp1 pp1 cp1 model-a";

/// Every kind of input, abstracted from its payload.
#[derive(Arbitrary, Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord)]
pub enum AbstractEvent {
    /// The engine answers its start-up calls.
    EngineReady,
    /// Discovery confirms the oldest register.
    Registered,
    /// Discovery fails the oldest register.
    RegistrationFailed,
    /// The lease behind the record expires.
    RegistrationLost,
    /// Discovery confirms the oldest withdraw.
    Withdrawn,
    /// Discovery fails the oldest withdraw.
    WithdrawFailed,
    /// Liveness reports SERVING.
    LiveServing,
    /// Liveness reports NOT_SERVING.
    LiveNotServing,
    /// Liveness reports UNKNOWN (0).
    LiveUnknown,
    /// Liveness reports SERVICE_UNKNOWN.
    LiveServiceUnknown,
    /// Liveness reports a value outside the enum.
    LiveOutOfRange,
    /// The Watch stream ends with OK.
    WatchEnded,
    /// The Watch stream fails (engine killed).
    WatchFailed,
    /// The Watch RPC is UNIMPLEMENTED.
    WatchUnimplemented,
    /// No first Watch message in time.
    WatchNotOpened,
    /// The probe gets a fresh answer.
    ProbeOk,
    /// The probe gets no fresh answer.
    ProbeFailed,
    /// The probe's load RPC is UNIMPLEMENTED (an older servicer).
    LoadUnsupported,
    /// The probe reads the same identity.
    IdentitySame,
    /// The probe reads another identity.
    IdentityChanged,
    /// The monitors' connection to an engine without an identity closed.
    ConnectionLost,
    /// A polled health Check failed.
    CheckFailed,
    /// SIGTERM.
    Shutdown,
    /// A client call is admitted.
    CallStarted,
    /// An admitted call ends.
    CallEnded,
    /// Time jumps to the core's next deadline.
    FireNextTimer,
    /// A short while passes (100 ms unless the world says otherwise).
    WaitShort,
    /// A long while passes, past several deadlines at once (7 s unless the
    /// world says otherwise).
    WaitLong,
}

impl AbstractEvent {
    /// Every kind, in declaration order.
    pub const ALL: [AbstractEvent; 28] = [
        AbstractEvent::EngineReady,
        AbstractEvent::Registered,
        AbstractEvent::RegistrationFailed,
        AbstractEvent::RegistrationLost,
        AbstractEvent::Withdrawn,
        AbstractEvent::WithdrawFailed,
        AbstractEvent::LiveServing,
        AbstractEvent::LiveNotServing,
        AbstractEvent::LiveUnknown,
        AbstractEvent::LiveServiceUnknown,
        AbstractEvent::LiveOutOfRange,
        AbstractEvent::WatchEnded,
        AbstractEvent::WatchFailed,
        AbstractEvent::WatchUnimplemented,
        AbstractEvent::WatchNotOpened,
        AbstractEvent::ProbeOk,
        AbstractEvent::ProbeFailed,
        AbstractEvent::LoadUnsupported,
        AbstractEvent::IdentitySame,
        AbstractEvent::IdentityChanged,
        AbstractEvent::ConnectionLost,
        AbstractEvent::CheckFailed,
        AbstractEvent::Shutdown,
        AbstractEvent::CallStarted,
        AbstractEvent::CallEnded,
        AbstractEvent::FireNextTimer,
        AbstractEvent::WaitShort,
        AbstractEvent::WaitLong,
    ];
}

/// What a concrete step feeds the core.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Input {
    /// `handle_event(at, event)`.
    Event(Time, Event),
    /// `handle_timeout(at)`.
    Timeout(Time),
}

/// A discovery write the world has been asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
enum Op {
    Register,
    Withdraw,
}

/// The environment of the core, as the IO layer would present it.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct World {
    now: Time,
    engine_announced: bool,
    ops: VecDeque<Op>,
    /// The record is in the store.
    pub record: bool,
    admission: Admission,
    health: Health,
    monitors: bool,
    /// Calls admitted and not yet ended.
    pub in_flight: u64,
    exited: bool,
    /// At most this many calls in flight at once: the explorer's abstraction
    /// (what the core does depends on "none" or "some", and the count only
    /// shows up in log lines), which keeps its state space finite. Unbounded
    /// for the other drivers.
    pub call_cap: u64,
    /// How long `WaitShort` and `WaitLong` last.
    pub waits: (Duration, Duration),
}

impl Default for World {
    fn default() -> Self {
        World {
            now: Time::ZERO,
            engine_announced: false,
            ops: VecDeque::new(),
            record: false,
            admission: Admission::Closed,
            health: Health::NotServing,
            monitors: false,
            in_flight: 0,
            exited: false,
            call_cap: u64::MAX,
            waits: (Duration::from_millis(100), Duration::from_secs(7)),
        }
    }
}

impl World {
    /// The input this abstract event becomes now, or `None` if it cannot happen.
    /// After the exit every event is delivered, to check that Exited absorbs it.
    pub fn concretize(&self, event: AbstractEvent, lc: &Lifecycle) -> Option<Input> {
        use AbstractEvent as A;
        let now = self.now;
        let at = |e: Event| Some(Input::Event(now, e));
        let live = |o: LivenessObservation| {
            (self.monitors || self.exited)
                .then_some(Input::Event(now, Event::Engine(EngineEvent::Liveness(o))))
        };
        let front = self.ops.front().copied();
        let answer =
            |op: Op, e: Event| (front == Some(op) || self.exited).then_some(Input::Event(now, e));
        match event {
            A::EngineReady => (!self.engine_announced || self.exited).then(|| {
                Input::Event(
                    now,
                    Event::Engine(EngineEvent::Ready {
                        identity: IDENTITY.into(),
                        name: "TensorRT-LLM".into(),
                        instance: None,
                        liveness_service: "liveness".into(),
                    }),
                )
            }),
            A::Registered => answer(Op::Register, Event::Discovery(DiscoveryEvent::Registered)),
            A::RegistrationFailed => answer(
                Op::Register,
                Event::Discovery(DiscoveryEvent::RegistrationFailed {
                    error: "store refused".into(),
                }),
            ),
            A::RegistrationLost => (self.record || self.exited).then(|| {
                Input::Event(
                    now,
                    Event::Discovery(DiscoveryEvent::RegistrationLost {
                        cause: "its lease expired".into(),
                    }),
                )
            }),
            A::Withdrawn => answer(Op::Withdraw, Event::Discovery(DiscoveryEvent::Withdrawn)),
            A::WithdrawFailed => answer(
                Op::Withdraw,
                Event::Discovery(DiscoveryEvent::WithdrawFailed {
                    error: "store refused".into(),
                }),
            ),
            A::LiveServing => live(LivenessObservation::Status(1)),
            A::LiveNotServing => live(LivenessObservation::Status(2)),
            A::LiveUnknown => live(LivenessObservation::Status(0)),
            A::LiveServiceUnknown => live(LivenessObservation::Status(3)),
            A::LiveOutOfRange => live(LivenessObservation::Status(42)),
            A::WatchEnded => live(LivenessObservation::StreamEnded),
            A::WatchFailed => live(LivenessObservation::StreamFailed {
                code: 2,
                message: "h2 protocol error: error reading a body from connection".into(),
            }),
            A::WatchUnimplemented => live(LivenessObservation::StreamFailed {
                code: 12,
                message: "unknown service grpc.health.v1.Health".into(),
            }),
            A::WatchNotOpened => live(LivenessObservation::NotOpened {
                waited: Duration::from_secs(30),
            }),
            A::ProbeOk => (self.monitors || self.exited).then_some(Input::Event(
                now,
                Event::Engine(EngineEvent::ProbeSucceeded),
            )),
            A::ProbeFailed => (self.monitors || self.exited).then(|| {
                Input::Event(
                    now,
                    Event::Engine(EngineEvent::ProbeFailed {
                        error: "HealthCheck timed out".into(),
                    }),
                )
            }),
            A::LoadUnsupported => (self.monitors || self.exited).then(|| {
                Input::Event(
                    now,
                    Event::Engine(EngineEvent::LoadUnsupported {
                        rpc: "GetLoad".into(),
                    }),
                )
            }),
            A::IdentitySame => (self.monitors || self.exited).then(|| {
                Input::Event(
                    now,
                    Event::Engine(EngineEvent::IdentityObserved {
                        identity: IDENTITY.into(),
                    }),
                )
            }),
            A::IdentityChanged => (self.monitors || self.exited).then(|| {
                Input::Event(
                    now,
                    Event::Engine(EngineEvent::IdentityObserved {
                        identity: OTHER_IDENTITY.into(),
                    }),
                )
            }),
            A::ConnectionLost => (self.monitors || self.exited).then_some(Input::Event(
                now,
                Event::Engine(EngineEvent::ConnectionLost {
                    end: ConnectionEnd::Closed,
                }),
            )),
            A::CheckFailed => live(LivenessObservation::CheckFailed {
                code: 14,
                message: "connection refused".into(),
            }),
            A::Shutdown => at(Event::ShutdownSignal),
            A::CallStarted => ((self.admission == Admission::Open
                && self.in_flight < self.call_cap)
                || self.exited)
                .then(|| {
                    Input::Event(
                        now,
                        Event::InFlightChanged {
                            count: self.in_flight + 1,
                        },
                    )
                }),
            A::CallEnded => (self.in_flight > 0).then(|| {
                Input::Event(
                    now,
                    Event::InFlightChanged {
                        count: self.in_flight - 1,
                    },
                )
            }),
            A::FireNextTimer => match lc.poll_timeout() {
                Some((t, _)) => Some(Input::Timeout(t.max(now))),
                None => self.exited.then_some(Input::Timeout(now)),
            },
            A::WaitShort => Some(Input::Timeout(now + self.waits.0)),
            A::WaitLong => Some(Input::Timeout(now + self.waits.1)),
        }
    }

    /// Takes note of an input about to be delivered.
    fn deliver(&mut self, input: &Input) {
        let (at, event) = match input {
            Input::Event(at, e) => (*at, Some(e)),
            Input::Timeout(at) => (*at, None),
        };
        self.now = self.now.max(at);
        match event {
            Some(Event::Engine(EngineEvent::Ready { .. })) => self.engine_announced = true,
            Some(Event::Discovery(DiscoveryEvent::Registered)) => {
                if self.ops.front() == Some(&Op::Register) {
                    self.ops.pop_front();
                    self.record = true;
                }
            }
            Some(Event::Discovery(DiscoveryEvent::RegistrationFailed { .. })) => {
                if self.ops.front() == Some(&Op::Register) {
                    self.ops.pop_front();
                }
            }
            Some(Event::Discovery(DiscoveryEvent::Withdrawn)) => {
                if self.ops.front() == Some(&Op::Withdraw) {
                    self.ops.pop_front();
                    self.record = false;
                }
            }
            Some(Event::Discovery(DiscoveryEvent::WithdrawFailed { .. })) => {
                if self.ops.front() == Some(&Op::Withdraw) {
                    self.ops.pop_front();
                }
            }
            Some(Event::Discovery(DiscoveryEvent::RegistrationLost { .. })) => self.record = false,
            Some(Event::InFlightChanged { count }) if !self.exited => self.in_flight = *count,
            Some(_) | None => {}
        }
    }

    /// Carries out one action the core emitted.
    fn perform(&mut self, action: &Action) {
        match action {
            Action::Register => self.ops.push_back(Op::Register),
            Action::Withdraw => self.ops.push_back(Op::Withdraw),
            Action::SetAdmission(a) => self.admission = *a,
            Action::SetHealth(h) => self.health = *h,
            Action::StartMonitors => self.monitors = true,
            Action::StopMonitors => self.monitors = false,
            Action::Log { .. } => {}
            Action::CancelInFlight => self.in_flight = 0,
            // The IO layer waits for the engine again, as at start-up.
            Action::Rejoin { .. } => self.engine_announced = false,
            Action::Exit(_) => {
                self.exited = true;
                self.monitors = false;
            }
        }
    }

    /// Every field named (no `..`): a field added later does not compile
    /// until the fingerprint accounts for it.
    fn fingerprint(&self, h: &mut DefaultHasher) {
        let World {
            // Times are taken relative to now; the world's own clock is now.
            now: _,
            engine_announced,
            ops,
            record,
            admission,
            health,
            monitors,
            in_flight,
            exited,
            call_cap,
            waits,
        } = self;
        (
            engine_announced,
            ops,
            record,
            admission,
            health,
            monitors,
            in_flight,
            exited,
            call_cap,
            waits,
        )
            .hash(h);
    }
}

/// A broken invariant: which one, and what happened.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Violation {
    /// The invariant's number in docs/CONTRACT.md (0 for "the harness itself").
    pub invariant: u8,
    /// What was seen.
    pub detail: String,
}

impl std::fmt::Display for Violation {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "invariant {} broken: {}", self.invariant, self.detail)
    }
}

/// The invariants of docs/CONTRACT.md, checked after every step from what the core
/// emitted and what the world saw. It keeps only history, never the machine's
/// internals.
#[derive(Debug, Clone, PartialEq, Eq, Hash, Default)]
pub struct Checker {
    exits: u32,
    withdraw_emitted: bool,
    /// The last discovery action emitted was a withdraw.
    last_discovery_is_withdraw: bool,
    ever_registered: bool,
    /// The exit code the first decisive event fixed.
    decided: Option<ExitReason>,
    /// Latest time the process may exit once shutting down began.
    exit_by: Option<Time>,
    /// What the first liveness observation since the monitors started was.
    liveness_first_seen: bool,
    liveness_unsupported: bool,
    liveness_warnings_in_serving: u32,
    /// The engine said it does not serve its load RPC.
    load_unsupported: bool,
    /// Warnings naming an unsupported load RPC.
    load_warnings: u32,
    /// The startup deadline of the current instance, once a rejoin moved it
    /// (`None`: the configured one, from time zero).
    startup_deadline_at: Option<Time>,
    /// A shutdown signal came after the loss: no rejoin may follow.
    signalled_since_loss: bool,
}

fn violation<T>(invariant: u8, detail: impl Into<String>) -> Result<T, Violation> {
    Err(Violation {
        invariant,
        detail: detail.into(),
    })
}

impl Checker {
    /// Checks one step: the machine went from `before` to `lc.phase()` on
    /// `input`, emitting `actions`; `world` is the world after performing them.
    #[allow(clippy::too_many_arguments, reason = "one step's whole context")]
    pub fn check_step(
        &mut self,
        config: &Config,
        before: Phase,
        before_instance: u64,
        input: &Input,
        actions: &[Action],
        lc: &Lifecycle,
        world: &World,
    ) -> Result<(), Violation> {
        let after = lc.phase();
        let now = lc.now();
        let event = match input {
            Input::Event(_, e) => Some(e),
            Input::Timeout(_) => None,
        };

        // 1. Exited absorbs; exactly one exit, last.
        if let Phase::Exited(_) = before {
            if !actions.is_empty() || after != before {
                return violation(
                    1,
                    format!("Exited reacted to {input:?} with {actions:?} -> {after:?}"),
                );
            }
            return Ok(());
        }
        for (i, action) in actions.iter().enumerate() {
            if let Action::Exit(_) = action {
                self.exits += 1;
                if i + 1 != actions.len() {
                    return violation(1, format!("exit is not the last action: {actions:?}"));
                }
            }
        }
        if self.exits > 1 {
            return violation(1, "more than one exit action");
        }

        // 9. A rejoin: only with the policy, only from Lost with no signal since
        // the loss, only with the old record confirmed gone and admission
        // closed, to Starting, under a new instance id. The history of the
        // instance that ended is then closed; the next one starts afresh.
        if matches!(event, Some(Event::ShutdownSignal)) && before == Phase::Lost {
            self.signalled_since_loss = true;
        }
        let rejoined = actions.iter().find_map(|a| match a {
            Action::Rejoin { instance_id } => Some(*instance_id),
            _ => None,
        });
        if let Some(instance_id) = rejoined {
            if config.on_engine_loss != OnEngineLoss::Rejoin {
                return violation(9, "rejoin without --on-engine-loss rejoin");
            }
            if before != Phase::Lost || after != Phase::Starting {
                return violation(9, format!("rejoin from {before:?} to {after:?}"));
            }
            if self.signalled_since_loss {
                return violation(9, "rejoin after a shutdown signal");
            }
            if world.record || !world.ops.is_empty() {
                return violation(
                    9,
                    format!(
                        "rejoin with the old record unsettled (record {}, ops {:?})",
                        world.record, world.ops
                    ),
                );
            }
            if world.admission != Admission::Closed || world.monitors {
                return violation(9, "rejoin with admission open or monitors running");
            }
            if instance_id == before_instance || instance_id != lc.instance_id() {
                return violation(
                    9,
                    format!("rejoin as {instance_id:x}, was {before_instance:x}"),
                );
            }
            *self = Checker {
                startup_deadline_at: Some(now + config.startup_deadline),
                ..Checker::default()
            };
        } else if before == Phase::Lost && after == Phase::Starting {
            return violation(9, "Lost became Starting without a rejoin");
        }
        if matches!(after, Phase::Exited(_)) != (self.exits == 1) {
            return violation(
                1,
                format!("phase {after:?} but {} exit actions", self.exits),
            );
        }

        // 4. Which decision came first. Deadlines are handled before the input,
        // so once the startup deadline has passed while Starting, nothing else can win.
        let startup_deadline = self
            .startup_deadline_at
            .unwrap_or(Time::ZERO + config.startup_deadline);
        if self.decided.is_none() && before == Phase::Starting && now >= startup_deadline {
            if after == Phase::Serving {
                return violation(4, "started serving after the startup deadline");
            }
            self.decided = Some(ExitReason::StartupFailed);
        }
        // The harness delivers due deadlines in a step of their own, so a step has
        // exactly one cause: its input.
        let signal = matches!(event, Some(Event::ShutdownSignal));
        let loss_line = format!("{} engine lost: ", config.engine_display_name);
        // Leaving for want of a record decides exit 1 the same way.
        let unregistered_line = format!(" {}: ", llm_sidecar_core::NOT_REGISTERED);
        let loss_accepted = actions.iter().any(|a| {
            matches!(a, Action::Log { level: Level::Error, message }
                if message.starts_with(&loss_line) || message.contains(&unregistered_line))
        });
        if loss_accepted && !matches!(before, Phase::Starting | Phase::Serving) {
            return violation(4, format!("engine loss accepted while {before:?}"));
        }
        if matches!(after, Phase::Lost | Phase::Exited(ExitReason::EngineLost))
            && !matches!(before, Phase::Lost)
            && !loss_accepted
        {
            return violation(4, format!("{after:?} without an accepted engine loss"));
        }
        if self.decided.is_none() {
            if loss_accepted && !signal {
                self.decided = Some(ExitReason::EngineLost);
            } else if signal {
                self.decided = Some(ExitReason::Clean);
            } else if before == Phase::Serving
                && matches!(after, Phase::Draining | Phase::Exited(ExitReason::Clean))
            {
                return violation(4, "Serving ended as if signalled, without a signal");
            }
        }
        // 2, 3, 7: discovery actions and deadlines.
        for action in actions {
            match action {
                Action::Register => {
                    if self.withdraw_emitted {
                        return violation(2, "register after a withdraw");
                    }
                    if !matches!(after, Phase::Starting | Phase::Serving) {
                        return violation(2, format!("register while {after:?}"));
                    }
                    self.last_discovery_is_withdraw = false;
                }
                Action::Withdraw => {
                    if !self.withdraw_emitted {
                        self.exit_by = Some(match after {
                            Phase::Draining => now + config.router_grace + config.drain_timeout,
                            Phase::Lost | Phase::Starting | Phase::Serving | Phase::Exited(_) => {
                                now + config.drain_timeout
                            }
                        });
                    }
                    self.withdraw_emitted = true;
                    self.last_discovery_is_withdraw = true;
                }
                Action::SetAdmission(_)
                | Action::SetHealth(_)
                | Action::StartMonitors
                | Action::StopMonitors
                | Action::Log { .. }
                | Action::CancelInFlight
                | Action::Rejoin { .. }
                | Action::Exit(_) => {}
            }
        }
        if matches!(event, Some(Event::Discovery(DiscoveryEvent::Registered))) && world.record {
            self.ever_registered = true;
        }
        if let Some((at, reason)) = lc.poll_timeout() {
            if at <= now {
                return violation(
                    7,
                    format!("deadline {reason} at {at:?} left due at {now:?}"),
                );
            }
            if let Some(bound) = self.exit_by
                && at > bound
            {
                return violation(
                    7,
                    format!("deadline {reason} at {at:?} beyond the drain bound {bound:?}"),
                );
            }
        }

        // 8. Own health SERVING exactly in Serving.
        if (world.health == Health::Serving) != (after == Phase::Serving) {
            return violation(8, format!("health {:?} while {after:?}", world.health));
        }
        if world.admission == Admission::Open && !matches!(after, Phase::Serving | Phase::Draining)
        {
            return violation(5, format!("admission open while {after:?}"));
        }

        // 6. Unsupported liveness: one warning, never a loss.
        if let Some(Event::Engine(EngineEvent::Liveness(o))) = event {
            let warnings = actions
                .iter()
                .filter(|a| {
                    matches!(
                        a,
                        Action::Log {
                            level: Level::Warn,
                            ..
                        }
                    )
                })
                .count() as u32;
            if before == Phase::Serving && after == Phase::Serving {
                self.liveness_warnings_in_serving += warnings;
            }
            if !self.liveness_first_seen && before == Phase::Serving {
                self.liveness_first_seen = true;
                if matches!(o, LivenessObservation::StreamFailed { code: 12 | 5, .. }) {
                    self.liveness_unsupported = true;
                    if warnings != 1 {
                        return violation(
                            6,
                            format!("unsupported liveness gave {warnings} warnings"),
                        );
                    }
                }
            }
            if self.liveness_unsupported {
                if before == Phase::Serving && after != Phase::Serving {
                    return violation(6, format!("unsupported liveness caused {after:?} on {o:?}"));
                }
                if self.liveness_warnings_in_serving > 1 {
                    return violation(6, "unsupported liveness warned more than once");
                }
            }
        }

        // 6. An unsupported load RPC: one warning, and never a stale-load loss.
        let load_warnings = actions
            .iter()
            .filter(|a| {
                matches!(a, Action::Log { level: Level::Warn, message }
                    if message.contains("does not serve its load RPC"))
            })
            .count() as u32;
        self.load_warnings += load_warnings;
        if matches!(
            event,
            Some(Event::Engine(EngineEvent::LoadUnsupported { .. }))
        ) && before == Phase::Serving
        {
            if !self.load_unsupported && load_warnings != 1 {
                return violation(
                    6,
                    format!("an unsupported load RPC gave {load_warnings} warnings"),
                );
            }
            if after != Phase::Serving {
                return violation(6, format!("an unsupported load RPC caused {after:?}"));
            }
            self.load_unsupported = true;
        }
        if load_warnings > 0 {
            self.load_unsupported = true;
        }
        if self.load_warnings > 1 {
            return violation(6, "an unsupported load RPC warned more than once");
        }
        if self.load_unsupported
            && actions.iter().any(
                |a| matches!(a, Action::Log { message, .. } if message.contains("routing load stale")),
            )
        {
            return violation(6, "a stale-load loss for an engine without a load RPC");
        }

        // At the exit: 1, 3, 4, 5, 7.
        if let Some(Action::Exit(code)) = actions.last() {
            if Some(*code) != self.decided {
                return violation(
                    4,
                    format!(
                        "exit {code:?} but the first decision was {:?}",
                        self.decided
                    ),
                );
            }
            let maybe_registered =
                self.ever_registered || world.record || world.ops.contains(&Op::Register);
            if maybe_registered && !self.last_discovery_is_withdraw {
                return violation(3, "exit without a withdraw after the registration");
            }
            if world.admission != Admission::Closed {
                return violation(5, "exit with admission open");
            }
            // 9. With rejoin, a loss ends the process only after a signal, or
            // when the old record could not be confirmed gone.
            if *code == ExitReason::EngineLost
                && config.on_engine_loss == OnEngineLoss::Rejoin
                && !self.signalled_since_loss
                && !world.record
                && world.ops.is_empty()
            {
                return violation(9, "exit 1 where the policy is rejoin");
            }
            let cancelled = actions.contains(&Action::CancelInFlight);
            if lc.in_flight() > 0 && !cancelled {
                return violation(
                    5,
                    format!(
                        "exit with {} calls in flight, none cancelled",
                        lc.in_flight()
                    ),
                );
            }
            if cancelled {
                match self.exit_by {
                    Some(bound) if now >= bound => {}
                    other => {
                        return violation(
                            5,
                            format!(
                                "calls cancelled at {now:?} before the drain deadline {other:?}"
                            ),
                        );
                    }
                }
            }
        }
        // 7. Once the drain bound is reached, the process is gone (a late input may
        // reach the bound after it passed; the exit then happens in that step).
        if let Some(bound) = self.exit_by
            && now >= bound
            && !matches!(after, Phase::Exited(_))
        {
            return violation(
                7,
                format!("still {after:?} at {now:?}, past the drain bound {bound:?}"),
            );
        }
        Ok(())
    }

    /// Every field named (no `..`). Once the process exited, the checker only
    /// checks that Exited absorbs; its drain bound is history then.
    fn fingerprint(&self, now: Time, h: &mut DefaultHasher) {
        let rel =
            |t: Time| t.since_origin().as_nanos() as i128 - now.since_origin().as_nanos() as i128;
        let Checker {
            exits,
            withdraw_emitted,
            last_discovery_is_withdraw,
            ever_registered,
            decided,
            exit_by,
            liveness_first_seen,
            liveness_unsupported,
            liveness_warnings_in_serving,
            load_unsupported,
            load_warnings,
            startup_deadline_at,
            signalled_since_loss,
        } = self;
        let exited = *exits > 0;
        (
            exits,
            withdraw_emitted,
            last_discovery_is_withdraw,
            ever_registered,
            decided,
            exit_by.filter(|_| !exited).map(rel),
            liveness_first_seen,
            liveness_unsupported,
            // Only "none", "one" and "more than one" are ever checked.
            (*liveness_warnings_in_serving).min(2),
            (load_unsupported, (*load_warnings).min(2)),
            // Only "passed or not" is ever read; a passed deadline stays passed.
            startup_deadline_at.map(|t| rel(t).max(0)),
            signalled_since_loss,
        )
            .hash(h);
    }
}

/// A lifecycle in its world, watched by the checker.
#[derive(Debug, Clone)]
pub struct Harness {
    /// The machine under test.
    pub lifecycle: Lifecycle,
    /// Its environment.
    pub world: World,
    /// The invariant checker.
    pub checker: Checker,
    config: Config,
}

impl Default for Harness {
    fn default() -> Self {
        Harness::new(test_config())
    }
}

impl Harness {
    /// A fresh machine at time zero.
    pub fn new(config: Config) -> Self {
        let mut lifecycle = Lifecycle::new(config.clone(), Time::ZERO);
        let mut world = World::default();
        while let Some(a) = lifecycle.poll_action() {
            world.perform(&a);
        }
        Harness {
            lifecycle,
            world,
            checker: Checker::default(),
            config,
        }
    }

    /// Applies one abstract event if the world allows it now. Returns whether it
    /// was delivered, or the invariant it broke.
    pub fn step(&mut self, event: AbstractEvent) -> Result<bool, Violation> {
        let Some(input) = self.world.concretize(event, &self.lifecycle) else {
            return Ok(false);
        };
        self.apply(input)?;
        Ok(true)
    }

    /// Feeds one concrete input and checks the invariants.
    pub fn apply(&mut self, input: Input) -> Result<(), Violation> {
        if let Input::Event(at, _) = &input {
            // Deadlines due by then are handled first, in a step of their own, as
            // the core itself would before the input.
            if self
                .lifecycle
                .poll_timeout()
                .is_some_and(|(due, _)| due <= *at)
            {
                self.apply(Input::Timeout(*at))?;
            }
        }
        let before = self.lifecycle.phase();
        let before_instance = self.lifecycle.instance_id();
        self.world.deliver(&input);
        match &input {
            Input::Event(at, e) => self.lifecycle.handle_event(*at, e.clone()),
            Input::Timeout(at) => self.lifecycle.handle_timeout(*at),
        }
        let actions: Vec<Action> = std::iter::from_fn(|| self.lifecycle.poll_action()).collect();
        let cancelled = actions.contains(&Action::CancelInFlight);
        for a in &actions {
            self.world.perform(a);
        }
        self.checker.check_step(
            &self.config,
            before,
            before_instance,
            &input,
            &actions,
            &self.lifecycle,
            &self.world,
        )?;
        if cancelled && !matches!(self.lifecycle.phase(), Phase::Exited(_)) {
            // The cancelled calls end; the IO layer reports the count.
            self.apply(Input::Event(
                self.world.now,
                Event::InFlightChanged { count: 0 },
            ))?;
        }
        Ok(())
    }

    /// A hash of the machine, the world and the checker, times relative to now.
    pub fn fingerprint(&self) -> u64 {
        let mut h = DefaultHasher::new();
        self.lifecycle.fingerprint().hash(&mut h);
        self.world.fingerprint(&mut h);
        self.checker.fingerprint(self.lifecycle.now(), &mut h);
        h.finish()
    }
}
