//! The flags that shape the lifecycle — how the engine is followed and how the
//! worker stops — taken alike by `llm-sidecar run` and `llm-sidecar-dynamo`, so
//! an operator reads one name, one default and one explanation for each.

#![warn(missing_docs, unreachable_pub)]

use std::time::Duration;

use clap::Args;
use llm_sidecar_io::Timings;

/// How the engine is followed, and how the worker stops.
#[derive(Debug, Clone, Args)]
pub struct LifecycleFlags {
    /// HTTP/2 keepalive ping interval on the engine connection. Must be above
    /// 10s: engines answer more frequent pings with GOAWAY "too many pings".
    #[arg(long, env = "SIDECAR_KEEPALIVE_INTERVAL", default_value = "20s", value_parser = duration)]
    pub keepalive_interval: Duration,
    /// How long a keepalive ping may go unanswered before the connection (and
    /// the engine) counts as dead.
    #[arg(long, env = "SIDECAR_KEEPALIVE_TIMEOUT", default_value = "10s", value_parser = duration)]
    pub keepalive_timeout: Duration,
    /// How often the stale-load probe (the kind's load RPC: HealthCheck, GetLoad,
    /// GetLoads) and the identity re-read run.
    #[arg(long, env = "SIDECAR_PROBE_INTERVAL", default_value = "5s", value_parser = duration)]
    pub probe_interval: Duration,
    /// No fresh probe answer for this long means the engine is lost (wedged).
    #[arg(long, env = "SIDECAR_STALE_AFTER", default_value = "30s", value_parser = duration)]
    pub stale_after: Duration,
    /// After SIGTERM, keep admitting calls this long (routers may not yet have
    /// seen the withdrawal).
    #[arg(long, env = "SIDECAR_ROUTER_GRACE", default_value = "5s", value_parser = duration)]
    pub router_grace: Duration,
    /// Once admission is closed, in-flight calls may take this long; the rest are cut.
    #[arg(long, env = "SIDECAR_DRAIN_TIMEOUT", default_value = "20s", value_parser = duration)]
    pub drain_timeout: Duration,
    /// While serving, the worker's record may be gone from discovery (a lease
    /// expired, the record removed) this long, every registration since
    /// failing, before the worker leaves as after an engine loss (withdraw,
    /// drain, exit 1): a worker no router can see serves no one.
    #[arg(long, env = "SIDECAR_REREGISTER_DEADLINE", default_value = "60s", value_parser = duration)]
    pub reregister_deadline: Duration,
}

impl LifecycleFlags {
    /// `base` with these flags' timings in place (still to be checked).
    pub fn timings(&self, base: Timings) -> Timings {
        Timings {
            keepalive_interval: self.keepalive_interval,
            keepalive_timeout: self.keepalive_timeout,
            probe_interval: self.probe_interval,
            stale_after: self.stale_after,
            router_grace: self.router_grace,
            drain_timeout: self.drain_timeout,
            reregister_deadline: self.reregister_deadline,
            ..base
        }
    }
}

/// A duration flag: `300ms`, `5s`, `2m`.
pub fn duration(s: &str) -> Result<Duration, String> {
    llm_sidecar_io::parse_duration(s)
}
