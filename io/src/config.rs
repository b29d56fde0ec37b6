//! The checked settings of `llm-sidecar run`.
//!
//! Flags become these typed values at the boundary (parse, don't validate): once a
//! `RunConfig` exists, every duration is usable and every address well formed,
//! so nothing downstream re-checks them.

use std::net::SocketAddr;
use std::time::Duration;

use crate::discovery::DiscoveryUri;
use crate::engine::{ChannelSettings, EngineChoice};
use crate::parse::ConfigError;
use crate::request_plane::Limits;
use crate::tls::{EtcdTls, ServerTls};

/// Engines' gRPC servers answer HTTP/2 pings more frequent than this with
/// GOAWAY "too many pings", killing every stream on the connection.
pub const ENGINE_PING_FLOOR: Duration = Duration::from_secs(10);

/// Every timing of the lifecycle and its monitors.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Timings {
    /// Bound on one connect attempt, one start-up call, one discovery write, and
    /// the wait for the liveness Watch's first message.
    pub connect_attempt_timeout: Duration,
    /// Pause between start-up attempts and between discovery retries.
    pub retry_interval: Duration,
    /// Start-up must complete within this, or exit 3.
    pub startup_deadline: Duration,
    /// HTTP/2 keepalive ping interval on the engine connection.
    pub keepalive_interval: Duration,
    /// How long a keepalive ping may go unanswered.
    pub keepalive_timeout: Duration,
    /// How often the stale-load probe runs.
    pub probe_interval: Duration,
    /// How often liveness is polled, for kinds whose Watch ends after one message.
    pub health_poll_interval: Duration,
    /// No fresh probe answer for this long means the engine is lost.
    pub stale_after: Duration,
    /// Calls are still admitted this long after a shutdown signal.
    pub router_grace: Duration,
    /// In-flight calls may take this long once admission is closed.
    pub drain_timeout: Duration,
    /// Serving may go on this long with its record gone from discovery
    /// before the worker leaves (exit 1).
    pub reregister_deadline: Duration,
    /// TTL of the etcd lease behind the record.
    pub lease_ttl: Duration,
}

impl Default for Timings {
    fn default() -> Self {
        Timings {
            connect_attempt_timeout: Duration::from_secs(30),
            retry_interval: Duration::from_secs(1),
            startup_deadline: Duration::from_secs(30 * 60),
            keepalive_interval: Duration::from_secs(20),
            keepalive_timeout: Duration::from_secs(10),
            probe_interval: Duration::from_secs(5),
            health_poll_interval: Duration::from_millis(100),
            stale_after: Duration::from_secs(30),
            router_grace: Duration::from_secs(5),
            drain_timeout: Duration::from_secs(20),
            reregister_deadline: Duration::from_secs(60),
            lease_ttl: Duration::from_secs(10),
        }
    }
}

impl Timings {
    /// How the engine connection is set up (connect bound, keepalive).
    pub fn engine_channel(&self) -> ChannelSettings {
        ChannelSettings {
            connect_timeout: self.connect_attempt_timeout,
            keepalive_interval: self.keepalive_interval,
            keepalive_timeout: self.keepalive_timeout,
        }
    }

    /// Checks the rules that tie timings together; `Ok` means the lifecycle can run.
    pub fn check(&self) -> Result<(), ConfigError> {
        let positive = [
            ("--connect-attempt-timeout", self.connect_attempt_timeout),
            ("--retry-interval", self.retry_interval),
            ("--startup-deadline", self.startup_deadline),
            ("--keepalive-timeout", self.keepalive_timeout),
            ("--probe-interval", self.probe_interval),
            ("--health-poll-interval", self.health_poll_interval),
            ("--drain-timeout", self.drain_timeout),
        ];
        for (flag, value) in positive {
            if value.is_zero() {
                return Err(out_of_range(flag, value, "must be greater than zero"));
            }
        }
        if self.keepalive_interval <= ENGINE_PING_FLOOR {
            return Err(out_of_range(
                "--keepalive-interval",
                self.keepalive_interval,
                "must be above 10s: engines answer more frequent pings with GOAWAY \"too many \
                 pings\", which kills every call on the connection",
            ));
        }
        if self.stale_after <= self.probe_interval {
            return Err(out_of_range(
                "--stale-after",
                self.stale_after,
                "must be longer than --probe-interval, or every pause between probes would \
                 count as stale",
            ));
        }
        if self.lease_ttl < Duration::from_secs(2) {
            return Err(out_of_range(
                "--lease-ttl",
                self.lease_ttl,
                "must be at least 2s",
            ));
        }
        Ok(())
    }
}

fn out_of_range(flag: &'static str, value: Duration, message: &str) -> ConfigError {
    ConfigError::OutOfRange {
        flag,
        value: llm_sidecar_core::HumanDuration(value).to_string(),
        message: message.to_string(),
    }
}

/// Everything `llm-sidecar run` needs, checked.
#[derive(Debug, Clone)]
pub struct RunConfig {
    /// The engine's gRPC address, `host:port`.
    pub engine_endpoint: String,
    /// Which engine API to follow, or `Auto` to find out at start-up.
    pub engine: EngineChoice,
    /// Where the request plane listens.
    pub listen: SocketAddr,
    /// The address written to discovery, `host:port`.
    pub advertise: String,
    /// Where the admin HTTP server listens; `None`: no admin server (the
    /// Dynamo worker's default, so that workers on one host never collide).
    pub admin_listen: Option<SocketAddr>,
    /// Where the record goes.
    pub discovery: DiscoveryUri,
    /// Discovery key: namespace.
    pub namespace: String,
    /// Discovery key: component.
    pub component: String,
    /// Discovery key: endpoint.
    pub endpoint: String,
    /// The grpc.health.v1 service followed for liveness; `None`: the kind's own.
    pub liveness_service: Option<String>,
    /// All timings.
    pub timings: Timings,
    /// Request-plane limits.
    pub limits: Limits,
    /// TLS on the request plane; `None`: plaintext HTTP/2.
    pub tls: Option<ServerTls>,
    /// TLS towards etcd; `None`: plaintext.
    pub etcd_tls: Option<EtcdTls>,
    /// After an engine loss is withdrawn and drained: exit 1, or rejoin.
    pub on_engine_loss: llm_sidecar_core::OnEngineLoss,
    /// Threads the request plane runs callers' connections on: the
    /// sidecar's own and `worker_threads - 1` more (`request_plane::Shards`).
    pub worker_threads: usize,
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn timings_reject_pings_at_or_below_the_engine_floor() {
        let mut t = Timings {
            keepalive_interval: Duration::from_secs(10),
            ..Timings::default()
        };
        assert!(matches!(
            t.check(),
            Err(ConfigError::OutOfRange {
                flag: "--keepalive-interval",
                ..
            })
        ));
        t.keepalive_interval = Duration::from_secs(11);
        assert_eq!(t.check(), Ok(()));
        t.stale_after = t.probe_interval;
        assert!(t.check().is_err());
    }
}
