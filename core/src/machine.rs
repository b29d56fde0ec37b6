//! The statig state machine. Private: [`crate::Lifecycle`] is the public face.
//!
//! Shared storage ([`Worker`]) holds what every state needs; each state carries
//! its own data (deadlines, the loss reason, why it ends). Emitted actions go to
//! the [`Step`] context's outbox, because statig gives no safe `&mut` access to
//! shared storage from outside.
//!
//! Draining and Lost share their drain (discovery answers, in-flight counting,
//! the drain deadline) through one method, [`Worker::drain_step`], rather than a
//! statig superstate: each of them ends in an `Exited` state of its own (a clean
//! shutdown, or the loss with its reason), and a superstate cannot know which
//! substate it is serving without a field in both that says so again.

use std::collections::VecDeque;

use statig::prelude::*;

use crate::action::{Action, Admission, ExitReason, Health, Level};
use crate::config::{Config, OnEngineLoss};
use crate::event::{DiscoveryEvent, EngineEvent, Event};
use crate::liveness::{self, Verdict, WatchPhase};
use crate::loss::LossReason;
use crate::time::{HumanDuration, Time};

/// The words of the ERROR line that says the worker leaves because its
/// record could not be written again (`"instance <id> <these words>: …"`).
pub const NOT_REGISTERED: &str = "is not registered in discovery";

/// What the machine reacts to (statig's event type; handlers must call their
/// parameter `event`): an event from the world, or time reaching a deadline. The timer is internal: the world tells the core the time through
/// `Lifecycle::handle_timeout` and never fires a timer of its own.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum Input {
    Event(Event),
    /// A deadline from `next_deadline` may have passed. Early firings are no-ops.
    Timer,
}

/// Per-step context: the input's time and the actions emitted so far.
#[derive(Debug, Default, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Step {
    pub(crate) now: Time,
    pub(crate) outbox: VecDeque<Action>,
}

impl Step {
    fn emit(&mut self, action: Action) {
        self.outbox.push_back(action);
    }

    fn log(&mut self, level: Level, message: String) {
        self.emit(Action::Log { level, message });
    }
}

/// A discovery write the IO layer has been asked for and has not answered yet.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum Op {
    Register,
    Withdraw,
}

/// What the core knows of its discovery record. Discovery actions run one at a
/// time, in order, and each is answered exactly once, so answers match the
/// oldest outstanding action; an answer that matches nothing is ignored.
#[derive(Debug, Default, Clone, PartialEq, Eq, Hash)]
pub(crate) struct RecordBook {
    pub(crate) outstanding: VecDeque<Op>,
    /// The record may be in the store: set by a successful register, cleared by
    /// a successful withdraw or a lost lease. A failed write leaves it as it was.
    pub(crate) maybe_present: bool,
    /// A withdraw was ever requested; no register may follow.
    pub(crate) withdraw_requested: bool,
}

impl RecordBook {
    /// Nothing in flight and nothing in the store: safe to exit.
    pub(crate) fn settled(&self) -> bool {
        self.outstanding.is_empty() && !self.maybe_present
    }

    /// Pops the oldest outstanding op if it is `op`; false for an unsolicited answer.
    fn answer(&mut self, op: Op) -> bool {
        if self.outstanding.front() == Some(&op) {
            self.outstanding.pop_front();
            true
        } else {
            false
        }
    }

    fn request(&mut self, op: Op, step: &mut Step) {
        if op == Op::Withdraw {
            self.withdraw_requested = true;
        }
        self.outstanding.push_back(op);
        step.emit(match op {
            Op::Register => Action::Register,
            Op::Withdraw => Action::Withdraw,
        });
    }
}

/// What start-up did not get done before its deadline.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) enum StartupFailure {
    /// The engine never answered its start-up calls.
    EngineNotReady,
    /// The engine answered, but no registration succeeded.
    NotRegistered,
}

/// Why the worker stopped serving, or never started: what `/state` shows as
/// the reason, and what decides the exit code.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) enum StopCause {
    /// A shutdown signal while Serving.
    Signal,
    /// A shutdown signal before start-up completed.
    SignalDuringStartup,
    /// The startup deadline passed.
    StartupFailed(StartupFailure),
    /// The engine was lost while Serving.
    EngineLost(LossReason),
}

impl StopCause {
    pub(crate) fn exit_reason(&self) -> ExitReason {
        match self {
            StopCause::Signal | StopCause::SignalDuringStartup => ExitReason::Clean,
            StopCause::StartupFailed(_) => ExitReason::StartupFailed,
            StopCause::EngineLost(_) => ExitReason::EngineLost,
        }
    }

    /// The reason as `/state` shows it; `engine` is the engine's display name.
    pub(crate) fn describe(&self, engine: &str) -> String {
        match self {
            StopCause::Signal => "shutdown signal".to_string(),
            StopCause::SignalDuringStartup => "shutdown signal during start-up".to_string(),
            StopCause::StartupFailed(failure) => {
                format!("startup failed: {}", failure_text(*failure, engine))
            }
            StopCause::EngineLost(reason) => reason.to_string(),
        }
    }
}

fn failure_text(failure: StartupFailure, engine: &str) -> String {
    match failure {
        // An engine kind found at start-up has no name until it answered.
        StartupFailure::EngineNotReady if engine.is_empty() => {
            "the engine was not ready".to_string()
        }
        StartupFailure::EngineNotReady => format!("the {engine} engine was not ready"),
        StartupFailure::NotRegistered => {
            "the worker could not be registered in discovery".to_string()
        }
    }
}

/// A start-up that is ending before it completed, waiting for discovery to settle.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Abort {
    pub(crate) cause: StopCause,
    pub(crate) deadline: Time,
}

/// Shared storage of the state machine.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Worker {
    pub(crate) config: Config,
    /// This worker's instance id: the configured one, then a new one at every
    /// rejoin.
    pub(crate) instance_id: u64,
    pub(crate) startup_deadline: Time,
    pub(crate) identity: Option<String>,
    /// How lines name the engine: the configured name until it is ready, then
    /// the name it gave.
    pub(crate) engine_name: String,
    /// The engine's own instance id, for the loss line, once it is ready.
    pub(crate) engine_instance: Option<String>,
    /// The liveness service, for warnings, once the engine is ready.
    pub(crate) liveness_service: String,
    pub(crate) book: RecordBook,
    pub(crate) retry_at: Option<Time>,
    pub(crate) watch: WatchPhase,
    pub(crate) last_fresh: Time,
    pub(crate) probe_failing: bool,
    /// The engine does not serve its load RPC: no stale-load rule for it
    /// (its connection is followed instead, by the IO layer).
    pub(crate) load_unsupported: bool,
    pub(crate) in_flight: u64,
    pub(crate) admission: Admission,
    /// When the current state was entered.
    pub(crate) since: Time,
    /// Discovery writes are failing: the first failure of a streak is warned
    /// about, the retries are not (one line per outage, not per attempt).
    pub(crate) discovery_failing: bool,
    /// While Serving: when the record left discovery on its own, and why
    /// (what discovery said), until a registration succeeds again.
    pub(crate) unregistered: Option<(Time, String)>,
}

impl Worker {
    pub(crate) fn new(config: Config, now: Time) -> Self {
        Worker {
            instance_id: config.instance_id,
            startup_deadline: now + config.startup_deadline,
            engine_name: config.engine_display_name.clone(),
            config,
            identity: None,
            engine_instance: None,
            liveness_service: String::new(),
            book: RecordBook::default(),
            retry_at: None,
            watch: WatchPhase::AwaitingFirst,
            last_fresh: now,
            probe_failing: false,
            load_unsupported: false,
            in_flight: 0,
            admission: Admission::Closed,
            since: now,
            discovery_failing: false,
            unregistered: None,
        }
    }

    fn engine(&self) -> &str {
        &self.engine_name
    }

    fn instance(&self) -> String {
        format!("{:x}", self.instance_id)
    }

    fn rejoins(&self) -> bool {
        self.config.on_engine_loss == OnEngineLoss::Rejoin
    }

    /// After a loss was withdrawn and drained: back to start-up as a new
    /// instance. Only with the old record confirmed gone (`book.settled()`),
    /// so two records of this worker never exist at once.
    fn rejoin(&mut self, step: &mut Step) {
        let old = self.instance();
        self.instance_id = next_instance_id(self.instance_id);
        self.startup_deadline = step.now + self.config.startup_deadline;
        self.identity = None;
        self.engine_name = self.config.engine_display_name.clone();
        self.engine_instance = None;
        self.liveness_service = String::new();
        self.book = RecordBook::default();
        self.retry_at = None;
        self.watch = WatchPhase::AwaitingFirst;
        self.probe_failing = false;
        self.load_unsupported = false;
        self.discovery_failing = false;
        self.unregistered = None;
        step.log(
            Level::Info,
            format!(
                "instance {old} withdrawn and drained after the engine loss; waiting for the \
                 engine again, to register as instance {} (--on-engine-loss rejoin)",
                self.instance()
            ),
        );
        step.emit(Action::Rejoin {
            instance_id: self.instance_id,
        });
    }

    /// The instance a loss line names: the engine's own where it has one.
    fn lost_instance(&self) -> String {
        self.engine_instance
            .clone()
            .unwrap_or_else(|| self.instance())
    }

    fn arm_retry(&mut self, now: Time) {
        self.retry_at = Some(now + self.config.retry_interval);
    }

    /// Takes the discovery retry timer if it is due.
    fn retry_due(&mut self, now: Time) -> bool {
        match self.retry_at {
            Some(at) if at <= now => {
                self.retry_at = None;
                true
            }
            Some(_) | None => false,
        }
    }

    fn set_admission(&mut self, admission: Admission, step: &mut Step) {
        if self.admission != admission {
            self.admission = admission;
            step.emit(Action::SetAdmission(admission));
        }
    }

    /// Books answers to discovery writes (and a lost lease); shared by every
    /// state. Other inputs pass through untouched.
    fn book_discovery(&mut self, step: &mut Step, input: &Input) {
        let Input::Event(event) = input else { return };
        match event {
            Event::Discovery(DiscoveryEvent::Registered) => {
                if self.book.answer(Op::Register) {
                    self.book.maybe_present = true;
                    self.unregistered = None;
                    self.discovery_recovered(step);
                }
            }
            Event::Discovery(DiscoveryEvent::RegistrationFailed { error }) => {
                if self.book.answer(Op::Register) && !self.book.withdraw_requested {
                    self.discovery_failed(step, "registering", error);
                }
            }
            Event::Discovery(DiscoveryEvent::Withdrawn) => {
                if self.book.answer(Op::Withdraw) {
                    self.book.maybe_present = false;
                    self.discovery_recovered(step);
                    step.log(
                        Level::Info,
                        format!("instance {} withdrawn from discovery", self.instance()),
                    );
                }
            }
            Event::Discovery(DiscoveryEvent::WithdrawFailed { error }) => {
                if self.book.answer(Op::Withdraw) {
                    self.discovery_failed(step, "withdrawing", error);
                }
            }
            Event::Discovery(DiscoveryEvent::RegistrationLost { .. }) => {
                self.book.maybe_present = false;
            }
            Event::Engine(_) | Event::ShutdownSignal | Event::InFlightChanged { .. } => {}
        }
    }

    /// A discovery write failed: warn at the start of a streak, retry later.
    fn discovery_failed(&mut self, step: &mut Step, what: &str, error: &str) {
        if !self.discovery_failing {
            self.discovery_failing = true;
            step.log(
                Level::Warn,
                format!(
                    "{what} instance {} failed: {error}; retrying every {}",
                    self.instance(),
                    HumanDuration(self.config.retry_interval)
                ),
            );
        }
        self.arm_retry(step.now);
    }

    /// While Serving: the loss to leave with when the record has been gone
    /// from discovery for the re-registration deadline.
    fn unregistered_too_long(&self, now: Time) -> Option<LossReason> {
        let (since, cause) = self.unregistered.as_ref()?;
        let deadline = *since + self.config.reregister_deadline;
        (deadline <= now && !self.book.maybe_present).then(|| LossReason::NotRegistered {
            unregistered_for: now - *since,
            cause: cause.clone(),
        })
    }

    /// A discovery write succeeded after failures: say so once.
    fn discovery_recovered(&mut self, step: &mut Step) {
        if self.discovery_failing {
            self.discovery_failing = false;
            step.log(Level::Info, "discovery writes succeed again".to_string());
        }
    }

    /// While shutting down: re-sends a withdraw whose earlier attempt failed.
    fn retry_withdraw_if_due(&mut self, step: &mut Step) {
        if self.retry_due(step.now) && self.book.outstanding.is_empty() && self.book.maybe_present {
            self.book.request(Op::Withdraw, step);
        }
    }

    /// While shutting down: a register landed after the withdraw was sent (it
    /// was in flight when shutting down began), so withdraw again.
    fn withdraw_again_if_registered(&mut self, step: &mut Step) {
        if self.book.maybe_present && self.book.outstanding.is_empty() && self.retry_at.is_none() {
            self.book.request(Op::Withdraw, step);
        }
    }

    /// Applies a liveness, probe or identity input while the engine is watched.
    /// Returns the loss reason if the input means the engine is lost.
    fn observe_engine(&mut self, step: &mut Step, input: &Input) -> Option<LossReason> {
        let event = match input {
            Input::Timer => {
                if self.load_unsupported {
                    return None;
                }
                let stale_at = self.last_fresh + self.config.stale_after;
                return (stale_at <= step.now).then(|| LossReason::StaleLoad {
                    stale_for: step.now - self.last_fresh,
                });
            }
            Input::Event(event) => event,
        };
        match event {
            Event::Engine(EngineEvent::Liveness(observation)) => {
                let (phase, verdict) =
                    liveness::interpret(self.watch, observation, &self.liveness_service);
                self.watch = phase;
                match verdict {
                    Verdict::Healthy => None,
                    Verdict::Warn(line)
                    | Verdict::Unsupported {
                        warning: Some(line),
                    } => {
                        step.log(Level::Warn, line);
                        None
                    }
                    Verdict::Unsupported { warning: None } => {
                        step.log(
                            Level::Info,
                            "liveness Watch ended before the service registered; liveness is \
                             not watched, the other monitors still are"
                                .to_string(),
                        );
                        None
                    }
                    Verdict::Loss(reason) => Some(reason),
                }
            }
            Event::Engine(EngineEvent::ProbeSucceeded) => {
                self.last_fresh = step.now;
                if self.probe_failing {
                    self.probe_failing = false;
                    step.log(
                        Level::Info,
                        "stale-load probe answers fresh again".to_string(),
                    );
                }
                None
            }
            Event::Engine(EngineEvent::ProbeFailed { error }) => {
                if !self.probe_failing && !self.load_unsupported {
                    self.probe_failing = true;
                    step.log(
                        Level::Warn,
                        format!(
                            "stale-load probe got no fresh answer: {error}; the engine counts as \
                             lost if this lasts {} since the last fresh answer",
                            HumanDuration(self.config.stale_after)
                        ),
                    );
                }
                None
            }
            Event::Engine(EngineEvent::LoadUnsupported { rpc }) => {
                if !self.load_unsupported {
                    self.load_unsupported = true;
                    self.probe_failing = false;
                    step.log(
                        Level::Warn,
                        format!(
                            "{} engine does not serve its load RPC {rpc} (an older servicer): \
                             no stale-load rule for it; its connection is followed instead",
                            self.engine()
                        ),
                    );
                }
                None
            }
            Event::Engine(EngineEvent::IdentityObserved { identity }) => match &self.identity {
                Some(old) if old != identity => Some(LossReason::IdentityChanged {
                    old: old.clone(),
                    new: identity.clone(),
                }),
                Some(_) | None => None,
            },
            Event::Engine(EngineEvent::ConnectionLost { end }) => {
                Some(LossReason::EngineConnectionLost { end: end.clone() })
            }
            Event::Engine(EngineEvent::Ready { .. })
            | Event::Discovery(_)
            | Event::ShutdownSignal
            | Event::InFlightChanged { .. } => None,
        }
    }

    /// What Draining and Lost share: book discovery answers and the in-flight
    /// count, retry the withdrawal, and decide whether the drain is over (the
    /// drain deadline, or admission closed with nothing in flight and discovery
    /// settled). True means: exit now.
    fn drain_step(&mut self, step: &mut Step, drain_deadline: Time, input: &Input) -> bool {
        let now = step.now;
        self.book_discovery(step, input);
        match input {
            Input::Event(Event::InFlightChanged { count }) => self.in_flight = *count,
            Input::Timer => self.retry_withdraw_if_due(step),
            Input::Event(Event::Engine(_) | Event::Discovery(_) | Event::ShutdownSignal) => {}
        }
        self.withdraw_again_if_registered(step);
        if drain_deadline <= now {
            if self.in_flight > 0 {
                step.log(
                    Level::Warn,
                    format!(
                        "drain deadline reached with {} calls in flight; cancelling them",
                        self.in_flight
                    ),
                );
                step.emit(Action::CancelInFlight);
            }
            if !self.book.settled() {
                step.log(
                    Level::Warn,
                    format!(
                        "drain deadline reached before discovery confirmed the withdrawal of \
                         instance {}",
                        self.instance()
                    ),
                );
            }
            return true;
        }
        self.admission == Admission::Closed && self.in_flight == 0 && self.book.settled()
    }
}

#[state_machine(
    initial = "State::starting(None)",
    state(derive(Debug, Clone, PartialEq, Eq, Hash))
)]
impl Worker {
    /// Waiting for the engine, then for the first registration. With `abort`
    /// set, start-up is over (signal or deadline) and only discovery must settle.
    #[state]
    fn starting(
        &mut self,
        context: &mut Step,
        abort: &mut Option<Abort>,
        event: &Input,
    ) -> Outcome<State> {
        let now = context.now;
        self.book_discovery(context, event);
        if let Some(a) = abort {
            return self.settle_aborted_startup(context, a, event);
        }
        let happened = match event {
            Input::Timer => {
                if self.startup_deadline <= now {
                    let failure = if self.identity.is_none() {
                        StartupFailure::EngineNotReady
                    } else {
                        StartupFailure::NotRegistered
                    };
                    context.log(
                        Level::Error,
                        format!(
                            "startup deadline of {} passed: {}",
                            HumanDuration(self.config.startup_deadline),
                            failure_text(failure, self.engine())
                        ),
                    );
                    return self.begin_abort(context, abort, StopCause::StartupFailed(failure));
                }
                if self.retry_due(now)
                    && self.identity.is_some()
                    && self.book.outstanding.is_empty()
                {
                    self.book.request(Op::Register, context);
                }
                return Handled;
            }
            Input::Event(happened) => happened,
        };
        match happened {
            Event::Engine(EngineEvent::Ready {
                identity,
                name,
                instance,
                liveness_service,
            }) => {
                if self.identity.is_none() {
                    self.identity = Some(identity.clone());
                    self.engine_name = name.clone();
                    self.engine_instance = instance.clone();
                    self.liveness_service = liveness_service.clone();
                    context.log(
                        Level::Info,
                        format!(
                            "{} engine ready (identity {identity}); registering instance {}",
                            self.engine(),
                            self.instance()
                        ),
                    );
                    if self.book.outstanding.is_empty() {
                        self.book.request(Op::Register, context);
                    }
                }
                Handled
            }
            Event::Discovery(DiscoveryEvent::Registered) => {
                if self.book.maybe_present {
                    Transition(State::serving())
                } else {
                    Handled
                }
            }
            Event::ShutdownSignal => {
                context.log(
                    Level::Info,
                    "shutdown signal before start-up completed; nothing was served".to_string(),
                );
                self.begin_abort(context, abort, StopCause::SignalDuringStartup)
            }
            Event::InFlightChanged { count } => {
                self.in_flight = *count;
                Handled
            }
            // The monitors' news: none runs before Serving. Discovery's other
            // answers: booked above.
            Event::Engine(_) | Event::Discovery(_) => Handled,
        }
    }

    /// Registered, admitting calls, watching the engine.
    #[state(entry_action = "enter_serving", exit_action = "exit_serving")]
    fn serving(&mut self, context: &mut Step, event: &Input) -> Outcome<State> {
        let now = context.now;
        self.book_discovery(context, event);
        if let Some(reason) = self.observe_engine(context, event) {
            return Transition(State::lost(reason, now + self.config.drain_timeout, false));
        }
        let happened = match event {
            Input::Timer => {
                if let Some(reason) = self.unregistered_too_long(now) {
                    return Transition(State::lost(reason, now + self.config.drain_timeout, false));
                }
                if self.retry_due(now)
                    && !self.book.maybe_present
                    && self.book.outstanding.is_empty()
                {
                    self.book.request(Op::Register, context);
                }
                return Handled;
            }
            Input::Event(happened) => happened,
        };
        match happened {
            Event::Discovery(DiscoveryEvent::Registered) => Handled,
            Event::Discovery(DiscoveryEvent::RegistrationLost { cause }) => {
                if self.unregistered.is_none() {
                    self.unregistered = Some((now, cause.clone()));
                }
                context.log(
                    Level::Warn,
                    format!(
                        "discovery dropped instance {} ({cause}); registering again",
                        self.instance()
                    ),
                );
                if !self.book.outstanding.contains(&Op::Register) {
                    self.book.request(Op::Register, context);
                }
                Handled
            }
            Event::ShutdownSignal => {
                let closes = now + self.config.router_grace;
                Transition(State::draining(
                    closes,
                    closes + self.config.drain_timeout,
                    false,
                ))
            }
            Event::InFlightChanged { count } => {
                self.in_flight = *count;
                Handled
            }
            // The engine's news went to `observe_engine`, discovery's
            // answers to `book_discovery`, above.
            Event::Engine(_) | Event::Discovery(_) => Handled,
        }
    }

    /// After a shutdown signal: withdrawn, admitting during the router grace,
    /// then draining. `engine_lost`: a loss was seen (and logged) during the
    /// drain; it closed admission at once, the monitors' later news is
    /// ignored and the exit code stays 0.
    #[state(entry_action = "enter_draining")]
    fn draining(
        &mut self,
        context: &mut Step,
        admission_closes_at: &Time,
        drain_deadline: &Time,
        engine_lost: &mut bool,
        event: &Input,
    ) -> Outcome<State> {
        let now = context.now;
        if !*engine_lost && let Some(reason) = self.observe_engine(context, event) {
            context.log(
                Level::Warn,
                format!(
                    "{} engine lost during drain: {reason} (instance {}); exit code stays 0",
                    self.engine(),
                    self.lost_instance()
                ),
            );
            *engine_lost = true;
            // Serving out the router grace with a dead engine helps no one:
            // new calls go elsewhere now, and the drain ends with the calls
            // in flight.
            if self.admission == Admission::Open {
                self.set_admission(Admission::Closed, context);
                context.log(
                    Level::Info,
                    format!(
                        "admission closed at once: the engine is gone; draining {} calls in \
                         flight for up to {}",
                        self.in_flight,
                        HumanDuration(*drain_deadline - now)
                    ),
                );
            }
        }
        match event {
            Input::Timer if *admission_closes_at <= now && self.admission == Admission::Open => {
                self.set_admission(Admission::Closed, context);
                context.log(
                    Level::Info,
                    format!(
                        "router grace over; admission closed with {} calls in flight, draining up to {}",
                        self.in_flight,
                        HumanDuration(*drain_deadline - now)
                    ),
                );
            }
            Input::Event(Event::ShutdownSignal) => {
                context.log(
                    Level::Info,
                    "another shutdown signal; already draining, deadlines unchanged".to_string(),
                );
                return Handled;
            }
            Input::Timer
            | Input::Event(
                Event::Engine(_) | Event::Discovery(_) | Event::InFlightChanged { .. },
            ) => {}
        }
        if self.drain_step(context, *drain_deadline, event) {
            Transition(State::exited(StopCause::Signal))
        } else {
            Handled
        }
    }

    /// After an engine loss while Serving: withdrawn, admission closed,
    /// draining; then the exit, or (rejoin, no signal since) start-up again.
    /// `signalled`: a shutdown signal came during the drain.
    #[state(entry_action = "enter_lost")]
    fn lost(
        &mut self,
        context: &mut Step,
        reason: &LossReason,
        drain_deadline: &Time,
        signalled: &mut bool,
        event: &Input,
    ) -> Outcome<State> {
        match event {
            Input::Event(Event::ShutdownSignal) => {
                let line = if self.rejoins() && !*signalled {
                    "shutdown signal while draining after engine loss; exiting 1 after the \
                     drain instead of waiting for the engine again"
                } else {
                    "shutdown signal while draining after engine loss; exit code stays 1"
                };
                *signalled = true;
                context.log(Level::Info, line.to_string());
                return Handled;
            }
            Input::Timer
            | Input::Event(
                Event::Engine(_) | Event::Discovery(_) | Event::InFlightChanged { .. },
            ) => {}
        }
        if !self.drain_step(context, *drain_deadline, event) {
            return Handled;
        }
        if self.rejoins() && !*signalled {
            if self.book.settled() {
                self.rejoin(context);
                return Transition(State::starting(None));
            }
            context.log(
                Level::Warn,
                format!(
                    "not rejoining: the withdrawal of instance {} is unconfirmed, and a new \
                     record beside a lingering one would send routers to a dead worker; \
                     exiting 1",
                    self.instance()
                ),
            );
        }
        Transition(State::exited(StopCause::EngineLost(reason.clone())))
    }

    /// The end. Absorbs every input.
    #[state(entry_action = "enter_exited")]
    fn exited(cause: &StopCause, event: &Input) -> Outcome<State> {
        let _ = (cause, event);
        Handled
    }

    #[action]
    fn enter_serving(&mut self, context: &mut Step) {
        let now = context.now;
        self.since = now;
        self.retry_at = None;
        self.unregistered = None;
        self.last_fresh = now;
        self.watch = WatchPhase::AwaitingFirst;
        context.log(
            Level::Info,
            format!("instance {} registered; serving", self.instance()),
        );
        self.set_admission(Admission::Open, context);
        context.emit(Action::SetHealth(Health::Serving));
        context.emit(Action::StartMonitors);
    }

    #[action]
    fn exit_serving(&mut self, context: &mut Step) {
        self.unregistered = None;
        context.emit(Action::SetHealth(Health::NotServing));
    }

    #[action]
    fn enter_draining(
        &mut self,
        context: &mut Step,
        admission_closes_at: &Time,
        drain_deadline: &Time,
    ) {
        let now = context.now;
        self.since = now;
        self.retry_at = None;
        context.log(
            Level::Info,
            format!(
                "shutdown signal: withdrawing instance {}; admitting calls for the router grace \
                 of {}, then draining up to {}",
                self.instance(),
                HumanDuration(*admission_closes_at - now),
                HumanDuration(*drain_deadline - *admission_closes_at)
            ),
        );
        self.book.request(Op::Withdraw, context);
    }

    #[action]
    fn enter_lost(&mut self, context: &mut Step, reason: &LossReason, drain_deadline: &Time) {
        let now = context.now;
        self.since = now;
        self.retry_at = None;
        // NotRegistered: the engine is fine; the worker is invisible.
        let line = if matches!(reason, LossReason::NotRegistered { .. }) {
            format!(
                "instance {} {NOT_REGISTERED}: {reason}; leaving as after an engine loss, so \
                 that the supervisor restarts this worker",
                self.instance()
            )
        } else {
            format!(
                "{} engine lost: {reason} (instance {})",
                self.engine(),
                self.lost_instance()
            )
        };
        context.log(Level::Error, line);
        self.book.request(Op::Withdraw, context);
        self.set_admission(Admission::Closed, context);
        context.emit(Action::StopMonitors);
        context.log(
            Level::Info,
            format!(
                "admission closed; draining {} calls in flight for up to {}, then {}",
                self.in_flight,
                HumanDuration(*drain_deadline - now),
                if self.rejoins() {
                    "waiting for the engine again (--on-engine-loss rejoin)"
                } else {
                    "exiting 1"
                }
            ),
        );
    }

    #[action]
    fn enter_exited(&mut self, context: &mut Step, cause: &StopCause) {
        self.since = context.now;
        self.retry_at = None;
        self.set_admission(Admission::Closed, context);
        let code = cause.exit_reason();
        let meaning = match code {
            ExitReason::Clean => "clean shutdown",
            ExitReason::EngineLost
                if matches!(
                    cause,
                    StopCause::EngineLost(LossReason::NotRegistered { .. })
                ) =>
            {
                "not in discovery; the supervisor should restart this worker"
            }
            ExitReason::EngineLost => "engine lost; the supervisor should restart this worker",
            ExitReason::StartupFailed => "start-up failed",
        };
        context.log(Level::Info, format!("exiting {}: {meaning}", code.as_i32()));
        context.emit(Action::Exit(code));
    }
}

impl Worker {
    /// Ends start-up: exits at once if discovery holds nothing of ours, else
    /// withdraws and waits (bounded by the drain timeout) for discovery to settle.
    fn begin_abort(
        &mut self,
        context: &mut Step,
        abort: &mut Option<Abort>,
        cause: StopCause,
    ) -> Outcome<State> {
        if self.book.settled() {
            return Transition(State::exited(cause));
        }
        *abort = Some(Abort {
            cause,
            deadline: context.now + self.config.drain_timeout,
        });
        self.retry_at = None;
        self.book.request(Op::Withdraw, context);
        Handled
    }

    /// A start-up that ended early: withdraw what a late register may have
    /// written, exit once discovery settled or its deadline passed.
    fn settle_aborted_startup(
        &mut self,
        context: &mut Step,
        abort: &Abort,
        input: &Input,
    ) -> Outcome<State> {
        match input {
            Input::Timer if abort.deadline <= context.now => {
                context.log(
                    Level::Warn,
                    format!(
                        "discovery did not confirm the withdrawal of instance {} in time; \
                         exiting anyway",
                        self.instance()
                    ),
                );
                Transition(State::exited(abort.cause.clone()))
            }
            Input::Timer | Input::Event(Event::Discovery(_)) => {
                self.retry_withdraw_if_due(context);
                self.withdraw_again_if_registered(context);
                if self.book.settled() {
                    Transition(State::exited(abort.cause.clone()))
                } else {
                    Handled
                }
            }
            Input::Event(
                Event::Engine(_) | Event::ShutdownSignal | Event::InFlightChanged { .. },
            ) => Handled,
        }
    }
}

/// The next instance id after `id`: splitmix64's finaliser, a bijection on
/// u64, so ids spread like the random first one and a rejoin never reuses the
/// id it leaves.
fn next_instance_id(id: u64) -> u64 {
    let mut z = id.wrapping_add(0x9e37_79b9_7f4a_7c15);
    z = (z ^ (z >> 30)).wrapping_mul(0xbf58_476d_1ce4_e5b9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94d0_49bb_1331_11eb);
    let next = z ^ (z >> 31);
    if next == id {
        next.wrapping_add(1)
    } else {
        next
    }
}

/// The earliest deadline a state waits for, with its reason.
pub(crate) fn next_deadline(worker: &Worker, state: &State) -> Option<(Time, &'static str)> {
    let mut candidates: Vec<(Time, &'static str)> = Vec::with_capacity(4);
    if let Some(at) = worker.retry_at {
        candidates.push((at, "discovery retry"));
    }
    match state {
        State::Starting { abort: None } => {
            candidates.push((worker.startup_deadline, "startup deadline"));
        }
        State::Starting { abort: Some(a) } => {
            candidates.push((a.deadline, "discovery settle deadline"));
        }
        State::Serving {} => {
            if !worker.load_unsupported {
                candidates.push((
                    worker.last_fresh + worker.config.stale_after,
                    "stale-load window",
                ));
            }
            if let Some((since, _)) = &worker.unregistered {
                candidates.push((
                    *since + worker.config.reregister_deadline,
                    "re-registration deadline",
                ));
            }
        }
        State::Draining {
            admission_closes_at,
            drain_deadline,
            engine_lost,
        } => {
            if worker.admission == Admission::Open {
                candidates.push((*admission_closes_at, "router grace"));
            }
            if !*engine_lost && !worker.load_unsupported {
                candidates.push((
                    worker.last_fresh + worker.config.stale_after,
                    "stale-load window",
                ));
            }
            candidates.push((*drain_deadline, "drain deadline"));
        }
        State::Lost { drain_deadline, .. } => {
            candidates.push((*drain_deadline, "drain deadline"));
        }
        State::Exited { .. } => return None,
    }
    candidates.into_iter().min_by_key(|(at, _)| *at)
}
