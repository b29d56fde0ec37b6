//! Why an engine counts as lost, as data.
//!
//! The text an operator reads in the loss line and the label `/metrics` counts
//! it under both come from the variant, so rewording a message can never move a
//! loss to another metric (there is no prefix matching anywhere).

use std::fmt;
use std::time::Duration;

use crate::codes::{grpc_code_name, http2_error_name, serving_status_name};
use crate::event::ConnectionEnd;
use crate::time::HumanDuration;

/// One way the engine can be lost (docs/CONTRACT.md, "What counts as a loss").
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub enum LossReason {
    /// The liveness Watch reported a status other than SERVING (raw value, so
    /// values outside the enum are shown as numbers).
    LivenessReported(i32),
    /// The liveness service went back to SERVICE_UNKNOWN after a known status.
    LivenessDeregistered,
    /// The liveness Watch ended (OK, or without trailers) after a known status.
    LivenessStreamEnded,
    /// The liveness Watch failed with this gRPC status.
    LivenessStreamFailed {
        /// The gRPC status code as a number.
        code: i32,
        /// The status message.
        message: String,
    },
    /// No first message on the liveness Watch within this long.
    LivenessNotOpened {
        /// How long the IO layer waited.
        waited: Duration,
    },
    /// No fresh answer from the stale-load probe for this long.
    StaleLoad {
        /// Time since the last fresh answer.
        stale_for: Duration,
    },
    /// A polled health `Check` failed.
    HealthCheckFailed {
        /// The gRPC status code as a number.
        code: i32,
        /// The status message.
        message: String,
    },
    /// The connection to an engine that has no identity of its own ended.
    EngineConnectionLost {
        /// How.
        end: ConnectionEnd,
    },
    /// Another engine answers on the engine's port.
    IdentityChanged {
        /// The identity read at start-up.
        old: String,
        /// The identity answering now.
        new: String,
    },
    /// Not the engine: the worker's record left discovery while it served and
    /// could not be written again within the re-registration deadline. The
    /// worker leaves as after a loss, so that its supervisor restarts it.
    NotRegistered {
        /// How long the record had been gone.
        unregistered_for: Duration,
        /// Why it went, as discovery said.
        cause: String,
    },
}

impl LossReason {
    /// Every metric label, in the order `/metrics` lists them.
    pub const LABELS: [&'static str; 14] = [
        "liveness_status",
        "liveness_deregistered",
        "liveness_stream_ended",
        "liveness_stream_failed",
        "liveness_not_opened",
        "stale_load",
        "identity_changed",
        "health_check_failed",
        "engine_goaway",
        "engine_closed_connection",
        "engine_connection_reset",
        "engine_connection_failed",
        "keepalive_timeout",
        "not_registered",
    ];

    /// The `reason` label of `llm_sidecar_engine_losses_total`.
    pub const fn label(&self) -> &'static str {
        match self {
            LossReason::LivenessReported(_) => Self::LABELS[0],
            LossReason::LivenessDeregistered => Self::LABELS[1],
            LossReason::LivenessStreamEnded => Self::LABELS[2],
            LossReason::LivenessStreamFailed { .. } => Self::LABELS[3],
            LossReason::LivenessNotOpened { .. } => Self::LABELS[4],
            LossReason::StaleLoad { .. } => Self::LABELS[5],
            LossReason::IdentityChanged { .. } => Self::LABELS[6],
            LossReason::HealthCheckFailed { .. } => Self::LABELS[7],
            LossReason::EngineConnectionLost { end } => match end {
                ConnectionEnd::GoAway { .. } => Self::LABELS[8],
                ConnectionEnd::Closed => Self::LABELS[9],
                ConnectionEnd::Reset => Self::LABELS[10],
                ConnectionEnd::Failed { .. } => Self::LABELS[11],
                ConnectionEnd::KeepaliveTimeout => Self::LABELS[12],
            },
            LossReason::NotRegistered { .. } => Self::LABELS[13],
        }
    }
}

impl fmt::Display for LossReason {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            LossReason::LivenessReported(raw) => {
                write!(f, "liveness reported {}", serving_status_name(*raw))
            }
            LossReason::LivenessDeregistered => f.write_str("liveness service deregistered"),
            LossReason::LivenessStreamEnded => f.write_str("liveness stream ended"),
            LossReason::LivenessStreamFailed { code, message } if message.is_empty() => {
                write!(f, "liveness stream failed: {}", grpc_code_name(*code))
            }
            LossReason::LivenessStreamFailed { code, message } => {
                write!(
                    f,
                    "liveness stream failed: {}: {message}",
                    grpc_code_name(*code)
                )
            }
            LossReason::LivenessNotOpened { waited } => {
                write!(
                    f,
                    "liveness watch did not open in {}",
                    HumanDuration(*waited)
                )
            }
            LossReason::StaleLoad { stale_for } => {
                write!(f, "routing load stale for {}", HumanDuration(*stale_for))
            }
            LossReason::IdentityChanged { old, new } => {
                write!(f, "new engine identity {old} -> {new}")
            }
            LossReason::HealthCheckFailed { code, message } if message.is_empty() => {
                write!(f, "health check failed: {}", grpc_code_name(*code))
            }
            LossReason::HealthCheckFailed { code, message } => {
                write!(
                    f,
                    "health check failed: {}: {message}",
                    grpc_code_name(*code)
                )
            }
            LossReason::EngineConnectionLost { end } => match end {
                ConnectionEnd::GoAway { code: 0 } => {
                    f.write_str("engine stopped: it said GOAWAY (NO_ERROR), a graceful stop")
                }
                ConnectionEnd::GoAway { code } => write!(
                    f,
                    "engine connection lost: the engine said GOAWAY ({})",
                    http2_error_name(*code)
                ),
                ConnectionEnd::Closed => {
                    f.write_str("engine connection lost: the engine closed the connection")
                }
                ConnectionEnd::Reset => {
                    f.write_str("engine connection lost: the connection was reset")
                }
                ConnectionEnd::Failed { error } => {
                    write!(f, "engine connection lost: connection error: {error}")
                }
                ConnectionEnd::KeepaliveTimeout => {
                    f.write_str("engine connection lost: a keepalive ping went unanswered")
                }
            },
            LossReason::NotRegistered {
                unregistered_for,
                cause,
            } => write!(
                f,
                "not in discovery for {} ({cause}), and every registration since failed",
                HumanDuration(*unregistered_for)
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn every_reason_reads_as_before_and_has_its_own_label() {
        let cases = [
            (
                LossReason::LivenessReported(2),
                "liveness reported NOT_SERVING",
                "liveness_status",
            ),
            (
                LossReason::LivenessReported(7),
                "liveness reported 7",
                "liveness_status",
            ),
            (
                LossReason::LivenessDeregistered,
                "liveness service deregistered",
                "liveness_deregistered",
            ),
            (
                LossReason::LivenessStreamEnded,
                "liveness stream ended",
                "liveness_stream_ended",
            ),
            (
                LossReason::LivenessStreamFailed {
                    code: 14,
                    message: "Cancelling all calls".into(),
                },
                "liveness stream failed: UNAVAILABLE: Cancelling all calls",
                "liveness_stream_failed",
            ),
            (
                LossReason::LivenessStreamFailed {
                    code: 2,
                    message: String::new(),
                },
                "liveness stream failed: UNKNOWN",
                "liveness_stream_failed",
            ),
            (
                LossReason::LivenessNotOpened {
                    waited: Duration::from_secs(30),
                },
                "liveness watch did not open in 30s",
                "liveness_not_opened",
            ),
            (
                LossReason::StaleLoad {
                    stale_for: Duration::from_millis(1500),
                },
                "routing load stale for 1.5s",
                "stale_load",
            ),
            (
                LossReason::IdentityChanged {
                    old: "a".into(),
                    new: "b".into(),
                },
                "new engine identity a -> b",
                "identity_changed",
            ),
            (
                LossReason::HealthCheckFailed {
                    code: 14,
                    message: "connection refused".into(),
                },
                "health check failed: UNAVAILABLE: connection refused",
                "health_check_failed",
            ),
            (
                LossReason::EngineConnectionLost {
                    end: ConnectionEnd::GoAway { code: 0 },
                },
                "engine stopped: it said GOAWAY (NO_ERROR), a graceful stop",
                "engine_goaway",
            ),
            (
                LossReason::EngineConnectionLost {
                    end: ConnectionEnd::GoAway { code: 11 },
                },
                "engine connection lost: the engine said GOAWAY (ENHANCE_YOUR_CALM)",
                "engine_goaway",
            ),
            (
                LossReason::EngineConnectionLost {
                    end: ConnectionEnd::Closed,
                },
                "engine connection lost: the engine closed the connection",
                "engine_closed_connection",
            ),
            (
                LossReason::EngineConnectionLost {
                    end: ConnectionEnd::Reset,
                },
                "engine connection lost: the connection was reset",
                "engine_connection_reset",
            ),
            (
                LossReason::EngineConnectionLost {
                    end: ConnectionEnd::Failed {
                        error: "broken pipe".into(),
                    },
                },
                "engine connection lost: connection error: broken pipe",
                "engine_connection_failed",
            ),
            (
                LossReason::EngineConnectionLost {
                    end: ConnectionEnd::KeepaliveTimeout,
                },
                "engine connection lost: a keepalive ping went unanswered",
                "keepalive_timeout",
            ),
            (
                LossReason::NotRegistered {
                    unregistered_for: Duration::from_secs(60),
                    cause: "its lease expired".into(),
                },
                "not in discovery for 1m (its lease expired), and every registration since failed",
                "not_registered",
            ),
        ];
        let mut labels = std::collections::BTreeSet::new();
        for (reason, text, label) in cases {
            assert_eq!(reason.to_string(), text);
            assert_eq!(reason.label(), label);
            labels.insert(reason.label());
        }
        assert_eq!(labels.len(), LossReason::LABELS.len(), "one label per kind");
    }
}
