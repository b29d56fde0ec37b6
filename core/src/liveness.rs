//! What an observation on the liveness Watch means (docs/CONTRACT.md, "The
//! liveness table"), as a pure function.
//!
//! The IO layer reports raw observations; [`interpret`] turns each one, given what
//! the watch has shown so far, into nothing, a one-time warning, "unsupported", or
//! an engine loss with its exact reason text.

use crate::event::LivenessObservation;
use crate::loss::LossReason;

pub use crate::codes::{grpc_code, grpc_code_name, serving_status, serving_status_name};

/// What the watch has shown so far.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum WatchPhase {
    /// Opened (or about to be); no message yet.
    #[default]
    AwaitingFirst,
    /// Only SERVICE_UNKNOWN so far: the engine has not registered the service (yet).
    NotRegistered,
    /// A known status has been seen; from now on any departure from SERVING is a loss.
    Active,
    /// The engine does not serve liveness; the watch stays idle for good.
    Unsupported,
    /// A loss was reported; later observations are ignored.
    Concluded,
}

/// The meaning of one observation.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum Verdict {
    /// Nothing to do.
    Healthy,
    /// Warn once; no loss.
    Warn(String),
    /// Liveness cannot be watched on this engine. `warning` is `None` when the
    /// operator was already warned (so the warning is given exactly once).
    Unsupported {
        /// The one warning line, unless already given.
        warning: Option<String>,
    },
    /// The engine is lost, for this reason.
    Loss(LossReason),
}

/// Interprets `observation` given the watch's `phase`; returns the next phase and the verdict.
///
/// `service` is the watched service name, used only in warning texts.
pub fn interpret(
    phase: WatchPhase,
    observation: &LivenessObservation,
    service: &str,
) -> (WatchPhase, Verdict) {
    use WatchPhase::*;
    use serving_status::*;
    match phase {
        Unsupported | Concluded => return (phase, Verdict::Healthy),
        AwaitingFirst | NotRegistered | Active => {}
    }
    match observation {
        LivenessObservation::Status(SERVING) => (Active, Verdict::Healthy),
        LivenessObservation::Status(SERVICE_UNKNOWN) => match phase {
            AwaitingFirst => (
                NotRegistered,
                Verdict::Warn(format!(
                    "liveness service \"{service}\" is not registered on the engine yet \
                     (SERVICE_UNKNOWN); no loss is declared until it reports a status"
                )),
            ),
            NotRegistered => (NotRegistered, Verdict::Healthy),
            Active | Unsupported | Concluded => {
                (Concluded, Verdict::Loss(LossReason::LivenessDeregistered))
            }
        },
        LivenessObservation::Status(raw) => {
            (Concluded, Verdict::Loss(LossReason::LivenessReported(*raw)))
        }
        LivenessObservation::StreamEnded => match phase {
            NotRegistered => (Unsupported, Verdict::Unsupported { warning: None }),
            AwaitingFirst | Active | Unsupported | Concluded => {
                (Concluded, Verdict::Loss(LossReason::LivenessStreamEnded))
            }
        },
        LivenessObservation::StreamFailed { code, message } => {
            let unsupported_code =
                *code == grpc_code::UNIMPLEMENTED || *code == grpc_code::NOT_FOUND;
            if phase == AwaitingFirst && unsupported_code {
                let warning = format!(
                    "engine does not serve grpc.health.v1 Watch for \"{service}\" ({}: {message}); \
                     liveness is not watched, the stale-load, identity and keepalive monitors still are",
                    grpc_code_name(*code)
                );
                (
                    Unsupported,
                    Verdict::Unsupported {
                        warning: Some(warning),
                    },
                )
            } else {
                (
                    Concluded,
                    Verdict::Loss(LossReason::LivenessStreamFailed {
                        code: *code,
                        message: message.clone(),
                    }),
                )
            }
        }
        LivenessObservation::CheckFailed { code, message } => {
            let unsupported_code =
                *code == grpc_code::UNIMPLEMENTED || *code == grpc_code::NOT_FOUND;
            if phase == AwaitingFirst && unsupported_code {
                let warning = format!(
                    "engine does not serve grpc.health.v1 Check for \"{service}\" ({}: {message}); \
                     liveness is not polled, the stale-load, identity and connection monitors still are",
                    grpc_code_name(*code)
                );
                (
                    Unsupported,
                    Verdict::Unsupported {
                        warning: Some(warning),
                    },
                )
            } else {
                (
                    Concluded,
                    Verdict::Loss(LossReason::HealthCheckFailed {
                        code: *code,
                        message: message.clone(),
                    }),
                )
            }
        }
        LivenessObservation::NotOpened { waited } => match phase {
            AwaitingFirst => (
                Concluded,
                Verdict::Loss(LossReason::LivenessNotOpened { waited: *waited }),
            ),
            // A message did arrive, so the watch did open: a late timer is stale news.
            NotRegistered | Active | Unsupported | Concluded => (phase, Verdict::Healthy),
        },
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use LivenessObservation as O;
    use WatchPhase::*;
    use std::time::Duration;

    fn run(observations: &[O]) -> Vec<Verdict> {
        let mut phase = AwaitingFirst;
        observations
            .iter()
            .map(|o| {
                let (next, v) = interpret(phase, o, "liveness");
                phase = next;
                v
            })
            .collect()
    }

    /// The verdicts as the operator reads them: a loss by its exact text.
    fn texts(verdicts: Vec<Verdict>) -> Vec<String> {
        verdicts
            .into_iter()
            .map(|v| match v {
                Verdict::Loss(reason) => format!("loss: {reason}"),
                other @ (Verdict::Healthy | Verdict::Warn(_) | Verdict::Unsupported { .. }) => {
                    format!("{other:?}")
                }
            })
            .collect()
    }

    fn loss(s: &str) -> String {
        format!("loss: {s}")
    }

    fn healthy() -> String {
        format!("{:?}", Verdict::Healthy)
    }

    #[test]
    fn serving_then_not_serving_is_a_loss_and_repeats_are_ignored() {
        let v = run(&[O::Status(1), O::Status(1), O::Status(2), O::Status(2)]);
        assert_eq!(
            texts(v),
            vec![
                healthy(),
                healthy(),
                loss("liveness reported NOT_SERVING"),
                healthy()
            ]
        );
    }

    #[test]
    fn unknown_and_out_of_range_values_are_losses_by_name_or_number() {
        assert_eq!(
            texts(run(&[O::Status(0)])),
            vec![loss("liveness reported UNKNOWN")]
        );
        assert_eq!(
            texts(run(&[O::Status(1), O::Status(7)])).pop(),
            Some(loss("liveness reported 7"))
        );
        assert_eq!(
            texts(run(&[O::Status(-1)])),
            vec![loss("liveness reported -1")]
        );
    }

    #[test]
    fn unimplemented_or_not_found_before_any_message_is_unsupported_once() {
        for code in [grpc_code::UNIMPLEMENTED, grpc_code::NOT_FOUND] {
            let v = run(&[
                O::StreamFailed {
                    code,
                    message: "x".into(),
                },
                O::Status(2),
                O::StreamEnded,
            ]);
            assert!(matches!(&v[0], Verdict::Unsupported { warning: Some(_) }));
            assert_eq!(&v[1..], &[Verdict::Healthy, Verdict::Healthy]);
        }
    }

    #[test]
    fn unimplemented_after_a_message_is_a_stream_failure() {
        let v = texts(run(&[
            O::Status(1),
            O::StreamFailed {
                code: 12,
                message: "gone".into(),
            },
        ]));
        assert_eq!(v[1], loss("liveness stream failed: UNIMPLEMENTED: gone"));
    }

    #[test]
    fn service_unknown_warns_once_then_serving_activates_the_watch() {
        let v = run(&[O::Status(3), O::Status(3), O::Status(1), O::Status(3)]);
        assert!(matches!(&v[0], Verdict::Warn(_)));
        assert_eq!(v[1], Verdict::Healthy);
        assert_eq!(v[2], Verdict::Healthy);
        assert_eq!(texts(v)[3], loss("liveness service deregistered"));
    }

    #[test]
    fn stream_end_while_not_registered_is_unsupported_without_a_second_warning() {
        let v = run(&[O::Status(3), O::StreamEnded]);
        assert_eq!(v[1], Verdict::Unsupported { warning: None });
    }

    #[test]
    fn stream_end_after_known_status_is_a_loss() {
        assert_eq!(
            texts(run(&[O::Status(1), O::StreamEnded]))[1],
            loss("liveness stream ended")
        );
    }

    #[test]
    fn stream_failure_carries_the_status() {
        let v = texts(run(&[
            O::Status(1),
            O::StreamFailed {
                code: 14,
                message: "Cancelling all calls".into(),
            },
        ]));
        assert_eq!(
            v[1],
            loss("liveness stream failed: UNAVAILABLE: Cancelling all calls")
        );
    }

    #[test]
    fn a_polled_check_failing_is_a_loss_unless_the_service_is_missing_from_the_start() {
        let v = texts(run(&[
            O::Status(1),
            O::CheckFailed {
                code: 14,
                message: "gone".into(),
            },
        ]));
        assert_eq!(v[1], loss("health check failed: UNAVAILABLE: gone"));
        let v = run(&[O::CheckFailed {
            code: grpc_code::UNIMPLEMENTED,
            message: "no health".into(),
        }]);
        assert!(matches!(&v[0], Verdict::Unsupported { warning: Some(_) }));
    }

    #[test]
    fn no_first_message_in_time_is_a_loss_with_the_duration() {
        let v = run(&[O::NotOpened {
            waited: Duration::from_secs(30),
        }]);
        assert_eq!(texts(v), vec![loss("liveness watch did not open in 30s")]);
    }
}
