//! The statig state machine. Private: [`crate::Lifecycle`] is the public face.
//!
//! Shared storage ([`Worker`]) holds what every state needs; states carry their
//! own deadlines. Emitted actions go to the [`Step`] context's outbox, because
//! statig gives no safe `&mut` access to shared storage from outside.

use std::collections::VecDeque;

use statig::prelude::*;

use crate::action::{Action, Admission, ExitCode, Health, Level};
use crate::config::Config;
use crate::event::Event;
use crate::liveness::{self, Verdict, WatchPhase};
use crate::time::{HumanDuration, Time};

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
pub(crate) struct Ledger {
    pub(crate) outstanding: VecDeque<Op>,
    /// The record may be in the store: set by a successful register, cleared by
    /// a successful withdraw or a lost lease. A failed write leaves it as it was.
    pub(crate) maybe_present: bool,
    /// A withdraw was ever requested; no register may follow.
    pub(crate) withdraw_requested: bool,
}

impl Ledger {
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

/// A start-up that is ending before it completed, waiting for discovery to settle.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(crate) struct Abort {
    pub(crate) code: ExitCode,
    pub(crate) deadline: Time,
}

/// Shared storage of the state machine.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub(crate) struct Worker {
    pub(crate) config: Config,
    pub(crate) startup_deadline: Time,
    pub(crate) identity: Option<String>,
    pub(crate) ledger: Ledger,
    pub(crate) retry_at: Option<Time>,
    pub(crate) watch: WatchPhase,
    pub(crate) last_fresh: Time,
    pub(crate) probe_failing: bool,
    /// In Draining: the first engine loss seen, logged once and otherwise ignored.
    pub(crate) loss_during_drain: Option<String>,
    pub(crate) in_flight: u64,
    pub(crate) admission: Admission,
    /// When the current state was entered.
    pub(crate) since: Time,
    /// Why the worker is Lost, or why it exited; for `/state`.
    pub(crate) reason: Option<String>,
    /// The exit code decided when shutting down began (Draining: 0, Lost: 1).
    pub(crate) shutdown_code: ExitCode,
    /// Discovery writes are failing: the first failure of a streak is warned
    /// about, the retries are not (one line per outage, not per attempt).
    pub(crate) discovery_failing: bool,
}

impl Worker {
    pub(crate) fn new(config: Config, now: Time) -> Self {
        Worker {
            startup_deadline: now + config.startup_deadline,
            config,
            identity: None,
            ledger: Ledger::default(),
            retry_at: None,
            watch: WatchPhase::AwaitingFirst,
            last_fresh: now,
            probe_failing: false,
            loss_during_drain: None,
            in_flight: 0,
            admission: Admission::Closed,
            since: now,
            reason: None,
            shutdown_code: ExitCode::Clean,
            discovery_failing: false,
        }
    }

    fn engine(&self) -> &str {
        &self.config.engine_display_name
    }

    fn instance(&self) -> String {
        self.config.instance_hex()
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
    /// state. Other events pass through untouched.
    fn book_discovery(&mut self, step: &mut Step, event: &Event) {
        match event {
            Event::Registered => {
                if self.ledger.answer(Op::Register) {
                    self.ledger.maybe_present = true;
                    self.discovery_recovered(step);
                }
            }
            Event::RegistrationFailed { error } => {
                if self.ledger.answer(Op::Register) && !self.ledger.withdraw_requested {
                    if !self.discovery_failing {
                        self.discovery_failing = true;
                        step.log(
                            Level::Warn,
                            format!(
                                "registering instance {} failed: {error}; retrying every {}",
                                self.instance(),
                                HumanDuration(self.config.retry_interval)
                            ),
                        );
                    }
                    self.arm_retry(step.now);
                }
            }
            Event::Withdrawn => {
                if self.ledger.answer(Op::Withdraw) {
                    self.ledger.maybe_present = false;
                    self.discovery_recovered(step);
                    step.log(
                        Level::Info,
                        format!("instance {} withdrawn from discovery", self.instance()),
                    );
                }
            }
            Event::WithdrawFailed { error } => {
                if self.ledger.answer(Op::Withdraw) {
                    if !self.discovery_failing {
                        self.discovery_failing = true;
                        step.log(
                            Level::Warn,
                            format!(
                                "withdrawing instance {} failed: {error}; retrying every {}",
                                self.instance(),
                                HumanDuration(self.config.retry_interval)
                            ),
                        );
                    }
                    self.arm_retry(step.now);
                }
            }
            Event::RegistrationLost => {
                self.ledger.maybe_present = false;
            }
            Event::EngineReady { .. }
            | Event::Liveness(_)
            | Event::ProbeSucceeded
            | Event::ProbeFailed { .. }
            | Event::IdentityObserved { .. }
            | Event::ShutdownSignal
            | Event::InFlightChanged { .. }
            | Event::TimerFired => {}
        }
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
        if self.retry_due(step.now)
            && self.ledger.outstanding.is_empty()
            && self.ledger.maybe_present
        {
            self.ledger.request(Op::Withdraw, step);
        }
    }

    /// Applies a liveness, probe or identity input while the engine is watched.
    /// Returns the loss reason if the input means the engine is lost.
    fn observe_engine(&mut self, step: &mut Step, event: &Event) -> Option<String> {
        match event {
            Event::Liveness(observation) => {
                let (phase, verdict) =
                    liveness::interpret(self.watch, observation, &self.config.liveness_service);
                self.watch = phase;
                match verdict {
                    Verdict::Healthy => None,
                    Verdict::Warn(line) => {
                        step.log(Level::Warn, line);
                        None
                    }
                    Verdict::Unsupported {
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
            Event::ProbeSucceeded => {
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
            Event::ProbeFailed { error } => {
                if !self.probe_failing {
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
            Event::IdentityObserved { identity } => match &self.identity {
                Some(old) if old != identity => {
                    Some(format!("new engine identity {old} -> {identity}"))
                }
                Some(_) | None => None,
            },
            Event::TimerFired => {
                let stale_at = self.last_fresh + self.config.stale_after;
                (stale_at <= step.now).then(|| {
                    format!(
                        "routing load stale for {}",
                        HumanDuration(step.now - self.last_fresh)
                    )
                })
            }
            Event::EngineReady { .. }
            | Event::Registered
            | Event::RegistrationFailed { .. }
            | Event::RegistrationLost
            | Event::Withdrawn
            | Event::WithdrawFailed { .. }
            | Event::ShutdownSignal
            | Event::InFlightChanged { .. } => None,
        }
    }
}

#[state_machine(
    initial = "State::starting(None)",
    state(derive(Debug, Clone, PartialEq, Eq, Hash)),
    superstate(derive(Debug))
)]
impl Worker {
    /// Waiting for the engine, then for the first registration. With `abort`
    /// set, start-up is over (signal or deadline) and only discovery must settle.
    #[state]
    fn starting(
        &mut self,
        context: &mut Step,
        abort: &mut Option<Abort>,
        event: &Event,
    ) -> Outcome<State> {
        let now = context.now;
        self.book_discovery(context, event);
        if let Some(a) = abort {
            let code = a.code;
            return match event {
                Event::TimerFired if a.deadline <= now => {
                    context.log(
                        Level::Warn,
                        format!(
                            "discovery did not confirm the withdrawal of instance {} in time; \
                             exiting anyway",
                            self.instance()
                        ),
                    );
                    Transition(State::exited(code))
                }
                Event::TimerFired
                | Event::Registered
                | Event::RegistrationFailed { .. }
                | Event::Withdrawn
                | Event::WithdrawFailed { .. }
                | Event::RegistrationLost => {
                    self.retry_withdraw_if_due(context);
                    if self.ledger.maybe_present
                        && self.ledger.outstanding.is_empty()
                        && self.retry_at.is_none()
                    {
                        // A register landed after the withdraw was sent: withdraw again.
                        self.ledger.request(Op::Withdraw, context);
                    }
                    if self.ledger.settled() {
                        Transition(State::exited(code))
                    } else {
                        Handled
                    }
                }
                Event::EngineReady { .. }
                | Event::Liveness(_)
                | Event::ProbeSucceeded
                | Event::ProbeFailed { .. }
                | Event::IdentityObserved { .. }
                | Event::ShutdownSignal
                | Event::InFlightChanged { .. } => Handled,
            };
        }
        match event {
            Event::EngineReady { identity } => {
                if self.identity.is_none() {
                    self.identity = Some(identity.clone());
                    context.log(
                        Level::Info,
                        format!(
                            "{} engine ready (identity {identity}); registering instance {}",
                            self.engine(),
                            self.instance()
                        ),
                    );
                    if self.ledger.outstanding.is_empty() {
                        self.ledger.request(Op::Register, context);
                    }
                }
                Handled
            }
            Event::Registered => {
                if self.ledger.maybe_present {
                    Transition(State::serving())
                } else {
                    Handled
                }
            }
            Event::TimerFired => {
                if self.startup_deadline <= now {
                    let what = if self.identity.is_none() {
                        format!("the {} engine was not ready", self.engine())
                    } else {
                        "the worker could not be registered in discovery".to_string()
                    };
                    context.log(
                        Level::Error,
                        format!(
                            "startup deadline of {} passed: {what}",
                            HumanDuration(self.config.startup_deadline)
                        ),
                    );
                    self.reason = Some(format!("startup failed: {what}"));
                    return self.begin_abort(context, abort, ExitCode::StartupFailed);
                }
                if self.retry_due(now)
                    && self.identity.is_some()
                    && self.ledger.outstanding.is_empty()
                {
                    self.ledger.request(Op::Register, context);
                }
                Handled
            }
            Event::ShutdownSignal => {
                context.log(
                    Level::Info,
                    "shutdown signal before start-up completed; nothing was served".to_string(),
                );
                self.reason = Some("shutdown signal during start-up".to_string());
                self.begin_abort(context, abort, ExitCode::Clean)
            }
            Event::InFlightChanged { count } => {
                self.in_flight = *count;
                Handled
            }
            Event::RegistrationFailed { .. }
            | Event::RegistrationLost
            | Event::Withdrawn
            | Event::WithdrawFailed { .. }
            | Event::Liveness(_)
            | Event::ProbeSucceeded
            | Event::ProbeFailed { .. }
            | Event::IdentityObserved { .. } => Handled,
        }
    }

    /// Registered, admitting calls, watching the engine.
    #[state(entry_action = "enter_serving", exit_action = "exit_serving")]
    fn serving(&mut self, context: &mut Step, event: &Event) -> Outcome<State> {
        let now = context.now;
        self.book_discovery(context, event);
        if let Some(reason) = self.observe_engine(context, event) {
            return Transition(State::lost(reason, now + self.config.drain_timeout));
        }
        match event {
            Event::Registered => Handled,
            Event::RegistrationLost => {
                context.log(
                    Level::Warn,
                    format!(
                        "discovery dropped instance {} (lease lost); registering again",
                        self.instance()
                    ),
                );
                if !self.ledger.outstanding.contains(&Op::Register) {
                    self.ledger.request(Op::Register, context);
                }
                Handled
            }
            Event::TimerFired => {
                if self.retry_due(now)
                    && !self.ledger.maybe_present
                    && self.ledger.outstanding.is_empty()
                {
                    self.ledger.request(Op::Register, context);
                }
                Handled
            }
            Event::ShutdownSignal => {
                let closes = now + self.config.router_grace;
                Transition(State::draining(closes, closes + self.config.drain_timeout))
            }
            Event::InFlightChanged { count } => {
                self.in_flight = *count;
                Handled
            }
            Event::EngineReady { .. }
            | Event::RegistrationFailed { .. }
            | Event::Withdrawn
            | Event::WithdrawFailed { .. }
            | Event::Liveness(_)
            | Event::ProbeSucceeded
            | Event::ProbeFailed { .. }
            | Event::IdentityObserved { .. } => Handled,
        }
    }

    /// After a shutdown signal: withdrawn, admitting during the router grace, then draining.
    #[state(superstate = "shutting_down", entry_action = "enter_draining")]
    fn draining(
        &mut self,
        context: &mut Step,
        admission_closes_at: &Time,
        drain_deadline: &Time,
        event: &Event,
    ) -> Outcome<State> {
        let now = context.now;
        if self.loss_during_drain.is_none()
            && let Some(reason) = self.observe_engine(context, event)
        {
            context.log(
                Level::Warn,
                format!(
                    "{} engine lost during drain: {reason} (instance {}); exit code stays 0",
                    self.engine(),
                    self.instance()
                ),
            );
            self.loss_during_drain = Some(reason);
        }
        match event {
            Event::TimerFired
                if *admission_closes_at <= now && self.admission == Admission::Open =>
            {
                self.set_admission(Admission::Closed, context);
                context.log(
                    Level::Info,
                    format!(
                        "router grace over; admission closed with {} calls in flight, draining up to {}",
                        self.in_flight,
                        HumanDuration(*drain_deadline - now)
                    ),
                );
                Super
            }
            Event::ShutdownSignal => {
                context.log(
                    Level::Info,
                    "another shutdown signal; already draining, deadlines unchanged".to_string(),
                );
                Handled
            }
            Event::TimerFired
            | Event::EngineReady { .. }
            | Event::Registered
            | Event::RegistrationFailed { .. }
            | Event::RegistrationLost
            | Event::Withdrawn
            | Event::WithdrawFailed { .. }
            | Event::Liveness(_)
            | Event::ProbeSucceeded
            | Event::ProbeFailed { .. }
            | Event::IdentityObserved { .. }
            | Event::InFlightChanged { .. } => Super,
        }
    }

    /// After an engine loss while Serving: withdrawn, admission closed, draining.
    #[state(superstate = "shutting_down", entry_action = "enter_lost")]
    fn lost(
        &mut self,
        context: &mut Step,
        reason: &String,
        drain_deadline: &Time,
        event: &Event,
    ) -> Outcome<State> {
        let _ = (reason, drain_deadline);
        match event {
            Event::ShutdownSignal => {
                context.log(
                    Level::Info,
                    "shutdown signal while draining after engine loss; exit code stays 1"
                        .to_string(),
                );
                Handled
            }
            Event::TimerFired
            | Event::EngineReady { .. }
            | Event::Registered
            | Event::RegistrationFailed { .. }
            | Event::RegistrationLost
            | Event::Withdrawn
            | Event::WithdrawFailed { .. }
            | Event::Liveness(_)
            | Event::ProbeSucceeded
            | Event::ProbeFailed { .. }
            | Event::IdentityObserved { .. }
            | Event::InFlightChanged { .. } => Super,
        }
    }

    /// Shared by Draining and Lost: wait for discovery and in-flight calls, bounded
    /// by the drain deadline.
    #[superstate]
    fn shutting_down(
        &mut self,
        context: &mut Step,
        drain_deadline: &Time,
        event: &Event,
    ) -> Outcome<State> {
        let now = context.now;
        self.book_discovery(context, event);
        match event {
            Event::InFlightChanged { count } => self.in_flight = *count,
            Event::TimerFired => self.retry_withdraw_if_due(context),
            Event::EngineReady { .. }
            | Event::Registered
            | Event::RegistrationFailed { .. }
            | Event::RegistrationLost
            | Event::Withdrawn
            | Event::WithdrawFailed { .. }
            | Event::Liveness(_)
            | Event::ProbeSucceeded
            | Event::ProbeFailed { .. }
            | Event::IdentityObserved { .. }
            | Event::ShutdownSignal => {}
        }
        if self.ledger.maybe_present
            && self.ledger.outstanding.is_empty()
            && self.retry_at.is_none()
        {
            // A re-registration landed after our withdraw was sent: withdraw again.
            self.ledger.request(Op::Withdraw, context);
        }
        if *drain_deadline <= now {
            if self.in_flight > 0 {
                context.log(
                    Level::Warn,
                    format!(
                        "drain deadline reached with {} calls in flight; cancelling them",
                        self.in_flight
                    ),
                );
                context.emit(Action::CancelInFlight);
            }
            if !self.ledger.settled() {
                context.log(
                    Level::Warn,
                    format!(
                        "drain deadline reached before discovery confirmed the withdrawal of \
                         instance {}",
                        self.instance()
                    ),
                );
            }
            return Transition(State::exited(self.shutdown_code));
        }
        if self.admission == Admission::Closed && self.in_flight == 0 && self.ledger.settled() {
            return Transition(State::exited(self.shutdown_code));
        }
        Handled
    }

    /// The end. Absorbs every event.
    #[state(entry_action = "enter_exited")]
    fn exited(code: &ExitCode, event: &Event) -> Outcome<State> {
        let _ = (code, event);
        Handled
    }

    #[action]
    fn enter_serving(&mut self, context: &mut Step) {
        let now = context.now;
        self.since = now;
        self.retry_at = None;
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
        self.reason = Some("shutdown signal".to_string());
        self.shutdown_code = ExitCode::Clean;
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
        self.ledger.request(Op::Withdraw, context);
    }

    #[action]
    fn enter_lost(&mut self, context: &mut Step, reason: &String, drain_deadline: &Time) {
        let now = context.now;
        self.since = now;
        self.retry_at = None;
        self.reason = Some(reason.clone());
        self.shutdown_code = ExitCode::EngineLost;
        context.log(
            Level::Error,
            format!(
                "{} engine lost: {reason} (instance {})",
                self.engine(),
                self.instance()
            ),
        );
        self.ledger.request(Op::Withdraw, context);
        self.set_admission(Admission::Closed, context);
        context.emit(Action::StopMonitors);
        context.log(
            Level::Info,
            format!(
                "admission closed; draining {} calls in flight for up to {}, then exiting 1",
                self.in_flight,
                HumanDuration(*drain_deadline - now)
            ),
        );
    }

    #[action]
    fn enter_exited(&mut self, context: &mut Step, code: &ExitCode) {
        self.since = context.now;
        self.retry_at = None;
        self.set_admission(Admission::Closed, context);
        let meaning = match code {
            ExitCode::Clean => "clean shutdown",
            ExitCode::EngineLost => "engine lost; the supervisor should restart this worker",
            ExitCode::StartupFailed => "start-up failed",
        };
        context.log(Level::Info, format!("exiting {}: {meaning}", code.as_i32()));
        context.emit(Action::Exit(*code));
    }
}

impl Worker {
    /// Ends start-up: exits at once if discovery holds nothing of ours, else
    /// withdraws and waits (bounded by the drain timeout) for discovery to settle.
    fn begin_abort(
        &mut self,
        context: &mut Step,
        abort: &mut Option<Abort>,
        code: ExitCode,
    ) -> Outcome<State> {
        if self.ledger.settled() {
            return Transition(State::exited(code));
        }
        *abort = Some(Abort {
            code,
            deadline: context.now + self.config.drain_timeout,
        });
        self.retry_at = None;
        self.ledger.request(Op::Withdraw, context);
        Handled
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
            candidates.push((
                worker.last_fresh + worker.config.stale_after,
                "stale-load window",
            ));
        }
        State::Draining {
            admission_closes_at,
            drain_deadline,
        } => {
            if worker.admission == Admission::Open {
                candidates.push((*admission_closes_at, "router grace"));
            }
            if worker.loss_during_drain.is_none() {
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
