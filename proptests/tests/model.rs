//! Model-based test: a deliberately small reference model (phase, a few
//! booleans, the expected exit code) against the real statig machine, compared
//! after every step, with the invariant checker (docs/CONTRACT.md) running underneath.
//!
//! The model has no clock. Its configuration makes timer order obvious: the
//! discovery retry (1 ms) always fires before anything else, and sequences are
//! too short for retries to add up to any other window.

use std::time::Duration;

use llm_sidecar_core::{Admission, Config, ExitReason, OnEngineLoss, Phase};
use llm_sidecar_proptests::{AbstractEvent as A, Harness};
use proptest::prelude::*;
use proptest_state_machine::{ReferenceStateMachine, StateMachineTest, prop_state_machine};

fn config(rejoin: bool) -> Config {
    Config {
        engine_display_name: "TensorRT-LLM".into(),
        instance_id: 7,
        retry_interval: Duration::from_millis(1),
        startup_deadline: Duration::from_secs(1000),
        stale_after: Duration::from_secs(100),
        router_grace: Duration::from_secs(10),
        drain_timeout: Duration::from_secs(20),
        // Never the next timer: the model's Serving clock is the stale-load
        // window (the explorer and the fuzzer reach this deadline).
        reregister_deadline: Duration::from_secs(10_000),
        on_engine_loss: if rejoin {
            OnEngineLoss::Rejoin
        } else {
            OnEngineLoss::Exit
        },
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Op {
    Register,
    Withdraw,
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Watch {
    AwaitingFirst,
    NotRegistered,
    Active,
    Off,
}

#[derive(Debug, Clone)]
struct Model {
    phase: Phase,
    announced: bool,
    ops: Vec<Op>,
    record: bool,
    abort: Option<ExitReason>,
    retry: bool,
    watch: Watch,
    admission: bool,
    monitors: bool,
    in_flight: u64,
    /// `--on-engine-loss rejoin`.
    rejoin: bool,
    /// A signal came while Lost: the drain ends in the exit, not a rejoin.
    signalled: bool,
    /// Rejoins so far.
    rejoins: u32,
    /// An engine loss was seen while Draining: it closed admission at once.
    drain_loss: bool,
    /// The engine does not serve its load RPC: no stale-load window.
    stale_off: bool,
}

impl Model {
    fn exit(&mut self, code: ExitReason) {
        self.phase = Phase::Exited(code);
        self.admission = false;
        self.monitors = false;
        self.retry = false;
    }

    fn end_startup(&mut self, code: ExitReason) {
        if self.ops.is_empty() && !self.record {
            self.exit(code);
        } else {
            self.abort = Some(code);
            self.retry = false;
            self.ops.push(Op::Withdraw);
        }
    }

    /// The end of a loss's drain: exit 1, or start-up again as a new
    /// instance when the policy says so, no signal came and the old record is
    /// confirmed gone.
    fn end_loss(&mut self) {
        if self.rejoin && !self.signalled && self.ops.is_empty() && !self.record {
            self.phase = Phase::Starting;
            self.announced = false;
            self.abort = None;
            self.retry = false;
            self.watch = Watch::AwaitingFirst;
            self.in_flight = 0;
            self.stale_off = false;
            self.rejoins += 1;
        } else {
            self.exit(ExitReason::EngineLost);
        }
    }

    fn lose(&mut self) {
        self.phase = Phase::Lost;
        self.signalled = false;
        self.retry = false;
        self.ops.push(Op::Withdraw);
        self.admission = false;
        self.monitors = false;
    }

    /// A loss while Draining: the first one closes admission at once (the
    /// router grace is not served out with a dead engine); later news is not
    /// read.
    fn lose_in_drain(&mut self) {
        self.drain_loss = true;
        self.admission = false;
    }

    fn shutting_down(&self) -> bool {
        matches!(self.phase, Phase::Draining | Phase::Lost) || self.abort.is_some()
    }

    /// After every input while shutting down: withdraw again if a register landed
    /// late, and exit once everything has settled.
    fn settle(&mut self) {
        if !self.shutting_down() {
            return;
        }
        if self.record && self.ops.is_empty() && !self.retry {
            self.ops.push(Op::Withdraw);
        }
        let settled = self.ops.is_empty() && !self.record;
        match (self.phase, self.abort) {
            (Phase::Starting, Some(code)) if settled => self.exit(code),
            (Phase::Draining, _) if settled && !self.admission && self.in_flight == 0 => {
                self.exit(ExitReason::Clean)
            }
            (Phase::Lost, _) if settled && self.in_flight == 0 => self.end_loss(),
            _ => {}
        }
    }

    /// The watch's reading of a liveness input: true if it means a loss.
    fn liveness(&mut self, e: A) -> bool {
        use Watch::*;
        let (next, loss) = match (self.watch, e) {
            (Off, _) => (Off, false),
            (_, A::LiveServing) => (Active, false),
            (AwaitingFirst, A::LiveServiceUnknown) => (NotRegistered, false),
            (NotRegistered, A::LiveServiceUnknown) => (NotRegistered, false),
            (NotRegistered, A::WatchEnded) => (Off, false),
            (AwaitingFirst, A::WatchUnimplemented) => (Off, false),
            (AwaitingFirst, A::WatchNotOpened) => (Off, true),
            (w, A::WatchNotOpened) => (w, false),
            (_, _) => (Off, true),
        };
        self.watch = next;
        loss
    }
}

/// The inputs the liveness watch reads: the Watch's messages and ends, and
/// a polled Check failing.
fn reads_liveness(e: A) -> bool {
    matches!(
        e,
        A::LiveServing
            | A::LiveNotServing
            | A::LiveUnknown
            | A::LiveServiceUnknown
            | A::LiveOutOfRange
            | A::WatchEnded
            | A::WatchFailed
            | A::WatchUnimplemented
            | A::WatchNotOpened
            | A::CheckFailed
    )
}

fn deliverable(m: &Model, e: A) -> bool {
    if let Phase::Exited(_) = m.phase {
        // The process is gone; a late timer must be absorbed.
        return e == A::FireNextTimer;
    }
    match e {
        A::EngineReady => !m.announced,
        A::Registered | A::RegistrationFailed => m.ops.first() == Some(&Op::Register),
        A::Withdrawn | A::WithdrawFailed => m.ops.first() == Some(&Op::Withdraw),
        A::RegistrationLost => m.record,
        A::CallStarted => m.admission,
        A::CallEnded => m.in_flight > 0,
        A::Shutdown => true,
        // Serving's only clock is the stale-load window (and a retry).
        A::FireNextTimer => !(m.phase == Phase::Serving && m.stale_off && !m.retry),
        A::WaitShort | A::WaitLong => false,
        A::LiveServing
        | A::LiveNotServing
        | A::LiveUnknown
        | A::LiveServiceUnknown
        | A::LiveOutOfRange
        | A::WatchEnded
        | A::WatchFailed
        | A::WatchUnimplemented
        | A::WatchNotOpened
        | A::ProbeOk
        | A::ProbeFailed
        | A::LoadUnsupported
        | A::IdentitySame
        | A::IdentityChanged
        | A::ConnectionLost
        | A::CheckFailed => m.monitors,
    }
}

struct Reference;

impl ReferenceStateMachine for Reference {
    type State = Model;
    type Transition = A;

    fn init_state() -> BoxedStrategy<Model> {
        any::<bool>()
            .prop_map(|rejoin| Model {
                phase: Phase::Starting,
                announced: false,
                ops: vec![],
                record: false,
                abort: None,
                retry: false,
                watch: Watch::AwaitingFirst,
                admission: false,
                monitors: false,
                in_flight: 0,
                rejoin,
                signalled: false,
                rejoins: 0,
                drain_loss: false,
                stale_off: false,
            })
            .boxed()
    }

    fn transitions(state: &Model) -> BoxedStrategy<A> {
        // Shutdown and timers end runs; weigh them low so runs go deep.
        let choices: Vec<(u32, BoxedStrategy<A>)> = A::ALL
            .into_iter()
            .filter(|e| deliverable(state, *e))
            .map(|e| {
                let weight = match e {
                    A::Shutdown
                    | A::FireNextTimer
                    | A::IdentityChanged
                    | A::ConnectionLost
                    | A::CheckFailed
                    | A::LiveNotServing
                    | A::LiveUnknown
                    | A::LiveOutOfRange
                    | A::WatchEnded
                    | A::WatchFailed
                    | A::WatchNotOpened => 1,
                    A::WatchUnimplemented | A::LiveServiceUnknown | A::LoadUnsupported => 3,
                    _ => 10,
                };
                (weight, Just(e).boxed())
            })
            .collect();
        proptest::strategy::Union::new_weighted(choices).boxed()
    }

    fn preconditions(state: &Model, e: &A) -> bool {
        deliverable(state, *e)
    }

    fn apply(mut m: Model, e: &A) -> Model {
        let e = *e;
        // Discovery answers are booked in every state.
        match e {
            A::Registered => {
                m.ops.remove(0);
                m.record = true;
            }
            A::RegistrationFailed => {
                m.ops.remove(0);
                if !m.shutting_down() {
                    m.retry = true;
                }
            }
            A::Withdrawn => {
                m.ops.remove(0);
                m.record = false;
            }
            A::WithdrawFailed => {
                m.ops.remove(0);
                m.retry = true;
            }
            A::RegistrationLost => m.record = false,
            A::CallStarted => m.in_flight += 1,
            A::CallEnded => m.in_flight -= 1,
            _ => {}
        }
        match (m.phase, m.abort) {
            (Phase::Starting, Some(code)) => match e {
                A::FireNextTimer if m.retry => {
                    m.retry = false;
                    if m.ops.is_empty() && m.record {
                        m.ops.push(Op::Withdraw);
                    }
                }
                A::FireNextTimer => m.exit(code),
                _ => {}
            },
            (Phase::Starting, None) => match e {
                A::EngineReady => {
                    m.announced = true;
                    m.ops.push(Op::Register);
                }
                A::Registered => {
                    m.phase = Phase::Serving;
                    m.retry = false;
                    m.admission = true;
                    m.monitors = true;
                    m.watch = Watch::AwaitingFirst;
                }
                A::FireNextTimer if m.retry => {
                    m.retry = false;
                    if m.announced && m.ops.is_empty() {
                        m.ops.push(Op::Register);
                    }
                }
                A::FireNextTimer => m.end_startup(ExitReason::StartupFailed),
                A::Shutdown => m.end_startup(ExitReason::Clean),
                _ => {}
            },
            (Phase::Serving, _) => match e {
                A::RegistrationLost if !m.ops.contains(&Op::Register) => m.ops.push(Op::Register),
                A::FireNextTimer if m.retry => {
                    m.retry = false;
                    if !m.record && m.ops.is_empty() {
                        m.ops.push(Op::Register);
                    }
                }
                A::FireNextTimer | A::IdentityChanged | A::ConnectionLost => m.lose(),
                A::LoadUnsupported => m.stale_off = true,
                A::Shutdown => {
                    m.phase = Phase::Draining;
                    m.retry = false;
                    m.ops.push(Op::Withdraw);
                }
                e if reads_liveness(e) =>
                {
                    #[allow(
                        clippy::collapsible_match,
                        reason = "the watch must read every observation"
                    )]
                    if m.liveness(e) {
                        m.lose();
                    }
                }
                _ => {}
            },
            (Phase::Draining, _) => match e {
                A::FireNextTimer if m.retry => {
                    m.retry = false;
                    if m.ops.is_empty() && m.record {
                        m.ops.push(Op::Withdraw);
                    }
                }
                A::FireNextTimer if m.admission => m.admission = false,
                A::FireNextTimer => m.exit(ExitReason::Clean),
                A::IdentityChanged | A::ConnectionLost if !m.drain_loss => m.lose_in_drain(),
                A::LoadUnsupported if !m.drain_loss => m.stale_off = true,
                e if reads_liveness(e) && !m.drain_loss =>
                {
                    #[allow(
                        clippy::collapsible_match,
                        reason = "the watch must read every observation"
                    )]
                    if m.liveness(e) {
                        m.lose_in_drain();
                    }
                }
                _ => {}
            },
            (Phase::Lost, _) => match e {
                A::FireNextTimer if m.retry => {
                    m.retry = false;
                    if m.ops.is_empty() && m.record {
                        m.ops.push(Op::Withdraw);
                    }
                }
                A::FireNextTimer => m.end_loss(),
                A::Shutdown => m.signalled = true,
                _ => {}
            },
            (Phase::Exited(_), _) => {}
        }
        if matches!(m.phase, Phase::Exited(_)) {
            m.in_flight = if e == A::FireNextTimer {
                0
            } else {
                m.in_flight
            };
        } else {
            m.settle();
        }
        m
    }
}

struct Real;

static STEPS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static STEPS_BEFORE_EXIT: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
static CASES: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);
/// Steps taken after at least one rejoin.
static REJOINS: std::sync::atomic::AtomicU64 = std::sync::atomic::AtomicU64::new(0);

impl StateMachineTest for Real {
    type SystemUnderTest = Harness;
    type Reference = Reference;

    fn init_test(model: &Model) -> Harness {
        CASES.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        Harness::new(config(model.rejoin))
    }

    fn apply(mut h: Harness, model: &Model, e: A) -> Harness {
        STEPS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        if !matches!(model.phase, Phase::Exited(_)) {
            STEPS_BEFORE_EXIT.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        match h.step(e) {
            Ok(true) => {}
            Ok(false) => {
                panic!("the model could deliver {e:?} but the world could not; model {model:?}")
            }
            Err(v) => panic!("{v} (after {e:?})"),
        }
        let phase = h.lifecycle.phase();
        assert_eq!(phase, model.phase, "phase after {e:?}; model {model:?}");
        assert_eq!(
            h.lifecycle.admission() == Admission::Open,
            model.admission,
            "admission after {e:?}"
        );
        assert_eq!(
            h.world.record, model.record,
            "record in discovery after {e:?}"
        );
        if !matches!(phase, Phase::Exited(_)) {
            assert_eq!(h.world.in_flight, model.in_flight, "in flight after {e:?}");
        }
        if model.rejoins > 0 {
            REJOINS.fetch_add(1, std::sync::atomic::Ordering::Relaxed);
        }
        h
    }
}

prop_state_machine! {
    #![proptest_config(ProptestConfig {
        cases: 5000,
        .. ProptestConfig::default()
    })]

    #[test]
    fn the_machine_follows_the_reference_model(sequential 1..80 => Real);
}

#[test]
fn zz_report_the_model_run() {
    // Runs after the property in the same binary when tests run single-threaded;
    // otherwise it reports what has run so far. Informational only.
    let cases = CASES.load(std::sync::atomic::Ordering::Relaxed);
    let steps = STEPS.load(std::sync::atomic::Ordering::Relaxed);
    let live = STEPS_BEFORE_EXIT.load(std::sync::atomic::Ordering::Relaxed);
    let rejoined = REJOINS.load(std::sync::atomic::Ordering::Relaxed);
    println!(
        "model: {cases} cases (including shrinking), {steps} steps, {live} of them before the \
         exit, {rejoined} after a rejoin"
    );
}
