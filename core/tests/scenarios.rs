//! The lifecycle paths of docs/CONTRACT.md, one readable scenario each. The property
//! tests, the explorer and the fuzzer check the invariants on every path; these
//! pin the exact actions and lines of the common ones.

use std::time::Duration;

use llm_sidecar_core::{
    Action, Admission, Config, ConnectionEnd, DiscoveryEvent, EngineEvent, Event, ExitReason,
    Health, Level, Lifecycle, LivenessObservation, OnEngineLoss, Phase, Time,
};

fn config() -> Config {
    Config {
        engine_display_name: "TensorRT-LLM".into(),
        instance_id: 0xabc,
        retry_interval: Duration::from_secs(1),
        startup_deadline: Duration::from_secs(60),
        stale_after: Duration::from_secs(30),
        router_grace: Duration::from_secs(5),
        drain_timeout: Duration::from_secs(20),
        reregister_deadline: Duration::from_secs(45),
        on_engine_loss: OnEngineLoss::Exit,
    }
}

fn secs(s: u64) -> Time {
    Time::from_millis(s * 1000)
}

struct Driver {
    lc: Lifecycle,
}

impl Driver {
    fn new() -> Self {
        Driver::with(config())
    }

    fn with(config: Config) -> Self {
        let mut lc = Lifecycle::new(config, Time::ZERO);
        assert_eq!(lc.poll_action(), None);
        Driver { lc }
    }

    fn feed(&mut self, at: Time, event: Event) -> Vec<Action> {
        self.lc.handle_event(at, event);
        std::iter::from_fn(|| self.lc.poll_action()).collect()
    }

    fn tick(&mut self, at: Time) -> Vec<Action> {
        self.lc.handle_timeout(at);
        std::iter::from_fn(|| self.lc.poll_action()).collect()
    }

    fn serving(&mut self) {
        self.feed(
            secs(1),
            Event::Engine(EngineEvent::Ready {
                identity: "trtllm 1.0".into(),
                name: "TensorRT-LLM".into(),
                instance: None,
                liveness_service: "liveness".into(),
            }),
        );
        self.feed(secs(1), Event::Discovery(DiscoveryEvent::Registered));
        assert_eq!(self.lc.phase(), Phase::Serving);
    }
}

fn without_logs(actions: &[Action]) -> Vec<Action> {
    actions
        .iter()
        .filter(|a| !matches!(a, Action::Log { .. }))
        .cloned()
        .collect()
}

fn lines(actions: &[Action], level: Level) -> Vec<String> {
    actions
        .iter()
        .filter_map(|a| match a {
            Action::Log { level: l, message } if *l == level => Some(message.clone()),
            _ => None,
        })
        .collect()
}

#[test]
fn engine_ready_then_registered_starts_serving() {
    let mut d = Driver::new();
    let a = d.feed(
        secs(1),
        Event::Engine(EngineEvent::Ready {
            identity: "id".into(),
            name: "TensorRT-LLM".into(),
            instance: None,
            liveness_service: "liveness".into(),
        }),
    );
    assert_eq!(without_logs(&a), vec![Action::Register]);
    assert_eq!(d.lc.phase(), Phase::Starting);
    let a = d.feed(secs(1), Event::Discovery(DiscoveryEvent::Registered));
    assert_eq!(
        without_logs(&a),
        vec![
            Action::SetAdmission(Admission::Open),
            Action::SetHealth(Health::Serving),
            Action::StartMonitors
        ]
    );
    assert_eq!(d.lc.health(), Health::Serving);
}

#[test]
fn liveness_not_serving_withdraws_at_once_and_exits_1_after_the_withdrawal() {
    let mut d = Driver::new();
    d.serving();
    let a = d.feed(
        secs(2),
        Event::Engine(EngineEvent::Liveness(LivenessObservation::Status(2))),
    );
    assert_eq!(
        lines(&a, Level::Error),
        vec!["TensorRT-LLM engine lost: liveness reported NOT_SERVING (instance abc)"]
    );
    assert_eq!(
        without_logs(&a),
        vec![
            Action::SetHealth(Health::NotServing),
            Action::Withdraw,
            Action::SetAdmission(Admission::Closed),
            Action::StopMonitors
        ]
    );
    assert_eq!(d.lc.phase(), Phase::Lost);
    let a = d.feed(secs(2), Event::Discovery(DiscoveryEvent::Withdrawn));
    assert_eq!(without_logs(&a), vec![Action::Exit(ExitReason::EngineLost)]);
}

#[test]
fn with_rejoin_a_withdrawn_and_drained_loss_starts_up_again_as_a_new_instance() {
    let mut d = Driver::with(Config {
        on_engine_loss: OnEngineLoss::Rejoin,
        ..config()
    });
    d.serving();
    let a = d.feed(
        secs(2),
        Event::Engine(EngineEvent::Liveness(LivenessObservation::StreamEnded)),
    );
    assert_eq!(d.lc.phase(), Phase::Lost);
    assert!(
        lines(&a, Level::Info)
            .iter()
            .any(|l| l.ends_with("then waiting for the engine again (--on-engine-loss rejoin)")),
        "{a:?}"
    );
    let a = d.feed(secs(3), Event::Discovery(DiscoveryEvent::Withdrawn));
    let next = d.lc.instance_id();
    assert_ne!(next, 0xabc);
    assert_eq!(without_logs(&a), vec![Action::Rejoin { instance_id: next }]);
    assert_eq!(
        lines(&a, Level::Info).last().map(String::as_str),
        Some(
            format!(
                "instance abc withdrawn and drained after the engine loss; waiting for the \
                 engine again, to register as instance {next:x} (--on-engine-loss rejoin)"
            )
            .as_str()
        )
    );
    assert_eq!(d.lc.phase(), Phase::Starting);
    assert_eq!(d.lc.engine_identity(), None);
    // Start-up again: its own deadline from now, the new id in the lines.
    assert_eq!(d.lc.poll_timeout(), Some((secs(63), "startup deadline")));
    let a = d.feed(
        secs(10),
        Event::Engine(EngineEvent::Ready {
            identity: "trtllm 1.0".into(),
            name: "TensorRT-LLM".into(),
            instance: None,
            liveness_service: "liveness".into(),
        }),
    );
    assert_eq!(without_logs(&a), vec![Action::Register]);
    d.feed(secs(10), Event::Discovery(DiscoveryEvent::Registered));
    assert_eq!(d.lc.phase(), Phase::Serving);
    // The second loss names the second instance.
    let a = d.feed(
        secs(11),
        Event::Engine(EngineEvent::Liveness(LivenessObservation::Status(2))),
    );
    assert_eq!(
        lines(&a, Level::Error),
        vec![format!(
            "TensorRT-LLM engine lost: liveness reported NOT_SERVING (instance {next:x})"
        )]
    );
}

#[test]
fn with_rejoin_a_signal_during_the_drain_still_exits_1() {
    let mut d = Driver::with(Config {
        on_engine_loss: OnEngineLoss::Rejoin,
        ..config()
    });
    d.serving();
    d.feed(
        secs(2),
        Event::Engine(EngineEvent::Liveness(LivenessObservation::StreamEnded)),
    );
    d.feed(secs(2), Event::InFlightChanged { count: 1 });
    let a = d.feed(secs(3), Event::ShutdownSignal);
    assert_eq!(
        lines(&a, Level::Info),
        vec![
            "shutdown signal while draining after engine loss; exiting 1 after the drain \
             instead of waiting for the engine again"
        ]
    );
    d.feed(secs(3), Event::Discovery(DiscoveryEvent::Withdrawn));
    let a = d.feed(secs(4), Event::InFlightChanged { count: 0 });
    assert_eq!(without_logs(&a), vec![Action::Exit(ExitReason::EngineLost)]);
}

#[test]
fn with_rejoin_an_unconfirmed_withdrawal_exits_1_rather_than_register_beside_it() {
    let mut d = Driver::with(Config {
        on_engine_loss: OnEngineLoss::Rejoin,
        ..config()
    });
    d.serving();
    d.feed(
        secs(2),
        Event::Engine(EngineEvent::Liveness(LivenessObservation::StreamEnded)),
    );
    d.feed(
        secs(2),
        Event::Discovery(DiscoveryEvent::WithdrawFailed {
            error: "etcd unreachable".into(),
        }),
    );
    let a = d.tick(secs(22));
    assert!(
        lines(&a, Level::Warn)
            .iter()
            .any(|l| l.starts_with("not rejoining: the withdrawal of instance abc is unconfirmed")),
        "{a:?}"
    );
    assert_eq!(a.last(), Some(&Action::Exit(ExitReason::EngineLost)));
}

#[test]
fn lost_waits_for_in_flight_calls_then_cancels_them_at_the_drain_deadline() {
    let mut d = Driver::new();
    d.serving();
    d.feed(secs(2), Event::InFlightChanged { count: 3 });
    d.feed(
        secs(3),
        Event::Engine(EngineEvent::Liveness(LivenessObservation::StreamEnded)),
    );
    d.feed(secs(3), Event::Discovery(DiscoveryEvent::Withdrawn));
    assert_eq!(d.lc.phase(), Phase::Lost);
    assert_eq!(d.lc.poll_timeout(), Some((secs(23), "drain deadline")));
    assert!(d.tick(secs(22)).is_empty(), "early timer is a no-op");
    let a = d.tick(secs(23));
    assert_eq!(
        without_logs(&a),
        vec![Action::CancelInFlight, Action::Exit(ExitReason::EngineLost)]
    );
}

#[test]
fn sigterm_withdraws_keeps_admitting_for_the_grace_then_drains_and_exits_0() {
    let mut d = Driver::new();
    d.serving();
    d.feed(secs(10), Event::InFlightChanged { count: 1 });
    let a = d.feed(secs(10), Event::ShutdownSignal);
    assert_eq!(
        without_logs(&a),
        vec![Action::SetHealth(Health::NotServing), Action::Withdraw]
    );
    assert_eq!(d.lc.admission(), Admission::Open);
    d.feed(secs(10), Event::Discovery(DiscoveryEvent::Withdrawn));
    assert_eq!(d.lc.poll_timeout(), Some((secs(15), "router grace")));
    let a = d.tick(secs(15));
    assert_eq!(
        without_logs(&a),
        vec![Action::SetAdmission(Admission::Closed)]
    );
    let a = d.feed(secs(16), Event::InFlightChanged { count: 0 });
    assert_eq!(without_logs(&a), vec![Action::Exit(ExitReason::Clean)]);
}

#[test]
fn a_loss_during_the_drain_is_a_warning_and_the_exit_code_stays_0() {
    let mut d = Driver::new();
    d.serving();
    d.feed(secs(10), Event::ShutdownSignal);
    let a = d.feed(
        secs(11),
        Event::Engine(EngineEvent::Liveness(LivenessObservation::Status(2))),
    );
    assert_eq!(
        lines(&a, Level::Warn),
        vec![
            "TensorRT-LLM engine lost during drain: liveness reported NOT_SERVING (instance abc); exit code stays 0"
        ]
    );
    assert_eq!(
        without_logs(&a),
        vec![Action::SetAdmission(Admission::Closed)],
        "the loss closes admission at once, inside the router grace"
    );
    assert_eq!(d.lc.phase(), Phase::Draining);
    assert_eq!(
        d.lc.poll_timeout().map(|(_, why)| why),
        Some("drain deadline")
    );
    let a = d.feed(secs(11), Event::Discovery(DiscoveryEvent::Withdrawn));
    assert_eq!(
        without_logs(&a),
        vec![Action::Exit(ExitReason::Clean)],
        "nothing in flight, the withdrawal confirmed: the drain is over"
    );
}

#[test]
fn shutdown_before_the_engine_is_ready_exits_0_with_nothing_registered() {
    let mut d = Driver::new();
    let a = d.feed(secs(1), Event::ShutdownSignal);
    assert_eq!(without_logs(&a), vec![Action::Exit(ExitReason::Clean)]);
}

#[test]
fn shutdown_while_the_first_register_is_in_flight_withdraws_before_exiting() {
    let mut d = Driver::new();
    d.feed(
        secs(1),
        Event::Engine(EngineEvent::Ready {
            identity: "id".into(),
            name: "TensorRT-LLM".into(),
            instance: None,
            liveness_service: "liveness".into(),
        }),
    );
    let a = d.feed(secs(1), Event::ShutdownSignal);
    assert_eq!(without_logs(&a), vec![Action::Withdraw]);
    assert!(
        without_logs(&d.feed(secs(1), Event::Discovery(DiscoveryEvent::Registered))).is_empty()
    );
    let a = d.feed(secs(1), Event::Discovery(DiscoveryEvent::Withdrawn));
    assert_eq!(without_logs(&a), vec![Action::Exit(ExitReason::Clean)]);
}

#[test]
fn startup_deadline_exits_3() {
    let mut d = Driver::new();
    assert_eq!(d.lc.poll_timeout(), Some((secs(60), "startup deadline")));
    let a = d.tick(secs(60));
    assert_eq!(
        lines(&a, Level::Error),
        vec!["startup deadline of 1m passed: the TensorRT-LLM engine was not ready"]
    );
    assert_eq!(
        without_logs(&a),
        vec![Action::Exit(ExitReason::StartupFailed)]
    );
}

#[test]
fn failed_registration_is_retried_every_retry_interval_until_the_deadline() {
    let mut d = Driver::new();
    d.feed(
        secs(1),
        Event::Engine(EngineEvent::Ready {
            identity: "id".into(),
            name: "TensorRT-LLM".into(),
            instance: None,
            liveness_service: "liveness".into(),
        }),
    );
    d.feed(
        secs(1),
        Event::Discovery(DiscoveryEvent::RegistrationFailed {
            error: "read-only".into(),
        }),
    );
    assert_eq!(d.lc.poll_timeout(), Some((secs(2), "discovery retry")));
    assert_eq!(without_logs(&d.tick(secs(2))), vec![Action::Register]);
    d.feed(secs(2), Event::Discovery(DiscoveryEvent::Registered));
    assert_eq!(d.lc.phase(), Phase::Serving);
}

#[test]
fn stale_load_is_a_loss_after_the_window() {
    let mut d = Driver::new();
    d.serving();
    d.feed(secs(5), Event::Engine(EngineEvent::ProbeSucceeded));
    let a = d.feed(
        secs(6),
        Event::Engine(EngineEvent::ProbeFailed {
            error: "stalled".into(),
        }),
    );
    assert_eq!(lines(&a, Level::Warn).len(), 1);
    assert!(
        lines(
            &d.feed(
                secs(7),
                Event::Engine(EngineEvent::ProbeFailed {
                    error: "stalled".into()
                })
            ),
            Level::Warn
        )
        .is_empty()
    );
    assert_eq!(d.lc.poll_timeout(), Some((secs(35), "stale-load window")));
    let a = d.tick(secs(35));
    assert_eq!(
        lines(&a, Level::Error),
        vec!["TensorRT-LLM engine lost: routing load stale for 30s (instance abc)"]
    );
}

#[test]
fn an_engine_without_a_load_rpc_warns_once_has_no_stale_window_and_is_lost_by_its_connection() {
    let mut d = Driver::new();
    d.serving();
    let a = d.feed(
        secs(2),
        Event::Engine(EngineEvent::LoadUnsupported {
            rpc: "GetLoads".into(),
        }),
    );
    assert_eq!(
        lines(&a, Level::Warn),
        vec![
            "TensorRT-LLM engine does not serve its load RPC GetLoads (an older servicer): no \
             stale-load rule for it; its connection is followed instead"
        ]
    );
    assert!(
        d.feed(
            secs(3),
            Event::Engine(EngineEvent::LoadUnsupported {
                rpc: "GetLoads".into()
            })
        )
        .is_empty()
    );
    assert_eq!(d.lc.poll_timeout(), None, "no stale-load window");
    assert!(d.tick(secs(3600)).is_empty());
    assert_eq!(d.lc.phase(), Phase::Serving);
    let a = d.feed(
        secs(3601),
        Event::Engine(EngineEvent::ConnectionLost {
            end: ConnectionEnd::Reset,
        }),
    );
    assert_eq!(d.lc.phase(), Phase::Lost);
    assert_eq!(lines(&a, Level::Error).len(), 1);
}

#[test]
fn a_new_identity_is_a_loss() {
    let mut d = Driver::new();
    d.serving();
    assert!(
        d.feed(
            secs(2),
            Event::Engine(EngineEvent::IdentityObserved {
                identity: "trtllm 1.0".into()
            })
        )
        .is_empty()
    );
    let a = d.feed(
        secs(3),
        Event::Engine(EngineEvent::IdentityObserved {
            identity: "trtllm 2.0".into(),
        }),
    );
    assert_eq!(
        lines(&a, Level::Error),
        vec![
            "TensorRT-LLM engine lost: new engine identity trtllm 1.0 -> trtllm 2.0 (instance abc)"
        ]
    );
}

#[test]
fn unsupported_liveness_warns_once_and_keeps_serving() {
    let mut d = Driver::new();
    d.serving();
    let a = d.feed(
        secs(2),
        Event::Engine(EngineEvent::Liveness(LivenessObservation::StreamFailed {
            code: 12,
            message: "unimplemented".into(),
        })),
    );
    assert_eq!(lines(&a, Level::Warn).len(), 1);
    assert_eq!(d.lc.phase(), Phase::Serving);
}

#[test]
fn lost_lease_is_registered_again() {
    let mut d = Driver::new();
    d.serving();
    let a = d.feed(
        secs(2),
        Event::Discovery(DiscoveryEvent::RegistrationLost {
            cause: "its lease expired".into(),
        }),
    );
    assert_eq!(without_logs(&a), vec![Action::Register]);
    assert_eq!(
        lines(&a, Level::Warn),
        vec!["discovery dropped instance abc (its lease expired); registering again"]
    );
    d.feed(secs(2), Event::Discovery(DiscoveryEvent::Registered));
    assert_eq!(d.lc.phase(), Phase::Serving);
}

#[test]
fn a_record_that_cannot_be_written_again_within_the_deadline_leaves_as_a_loss_and_exits_1() {
    let mut d = Driver::new();
    d.serving();
    d.feed(
        secs(2),
        Event::Discovery(DiscoveryEvent::RegistrationLost {
            cause: "the instance record left Dynamo's discovery".into(),
        }),
    );
    // Every attempt fails; each retry is one interval later. The stale-load
    // window is kept fresh, so only the new deadline can end this.
    let mut now = 2;
    while now < 46 {
        d.feed(
            secs(now),
            Event::Discovery(DiscoveryEvent::RegistrationFailed {
                error: "no answer".into(),
            }),
        );
        d.feed(secs(now), Event::Engine(EngineEvent::ProbeSucceeded));
        now += 1;
        let a = d.tick(secs(now));
        assert_eq!(d.lc.phase(), Phase::Serving, "at {now} s");
        assert_eq!(
            without_logs(&a),
            vec![Action::Register],
            "a retry at {now} s"
        );
    }
    assert_eq!(
        d.lc.poll_timeout(),
        Some((secs(47), "re-registration deadline")),
        "45 s after the record left"
    );
    d.feed(
        secs(46),
        Event::Discovery(DiscoveryEvent::RegistrationFailed {
            error: "no answer".into(),
        }),
    );
    let a = d.tick(secs(47));
    assert_eq!(d.lc.phase(), Phase::Lost);
    assert_eq!(
        lines(&a, Level::Error),
        vec![
            "instance abc is not registered in discovery: not in discovery for 45s (the \
             instance record left Dynamo's discovery), and every registration since failed; \
             leaving as after an engine loss, so that the supervisor restarts this worker"
        ]
    );
    assert!(a.contains(&Action::Withdraw) && a.contains(&Action::SetAdmission(Admission::Closed)));
    d.feed(secs(47), Event::Discovery(DiscoveryEvent::Withdrawn));
    let a = d.tick(secs(47));
    assert_eq!(d.lc.phase(), Phase::Exited(ExitReason::EngineLost), "{a:?}");
}

#[test]
fn a_record_written_again_before_the_deadline_clears_it() {
    let mut d = Driver::new();
    d.serving();
    d.feed(
        secs(2),
        Event::Discovery(DiscoveryEvent::RegistrationLost {
            cause: "its lease expired".into(),
        }),
    );
    d.feed(secs(25), Event::Engine(EngineEvent::ProbeSucceeded));
    d.feed(secs(40), Event::Discovery(DiscoveryEvent::Registered));
    d.feed(secs(50), Event::Engine(EngineEvent::ProbeSucceeded));
    // Lost again later: the deadline counts from the new loss.
    d.feed(
        secs(60),
        Event::Discovery(DiscoveryEvent::RegistrationLost {
            cause: "its lease expired".into(),
        }),
    );
    d.feed(secs(60), Event::Engine(EngineEvent::ProbeSucceeded));
    assert_eq!(d.lc.poll_timeout(), Some((secs(90), "stale-load window")));
    d.feed(secs(80), Event::Engine(EngineEvent::ProbeSucceeded));
    assert_eq!(
        d.lc.poll_timeout(),
        Some((secs(105), "re-registration deadline"))
    );
    d.feed(secs(100), Event::Discovery(DiscoveryEvent::Registered));
    d.feed(secs(100), Event::Engine(EngineEvent::ProbeSucceeded));
    assert_eq!(d.lc.poll_timeout(), Some((secs(130), "stale-load window")));
    d.tick(secs(105));
    assert_eq!(d.lc.phase(), Phase::Serving);
}

#[test]
fn exited_absorbs_everything() {
    let mut d = Driver::new();
    d.feed(secs(1), Event::ShutdownSignal);
    for e in [
        Event::ShutdownSignal,
        Event::Discovery(DiscoveryEvent::Registered),
        Event::Engine(EngineEvent::Ready {
            identity: "x".into(),
            name: "TensorRT-LLM".into(),
            instance: None,
            liveness_service: "liveness".into(),
        }),
    ] {
        assert!(d.feed(secs(2), e).is_empty());
    }
    assert_eq!(d.lc.poll_timeout(), None);
}
