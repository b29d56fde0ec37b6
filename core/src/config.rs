//! What the core needs to know about its deployment, fixed for its lifetime.

use std::time::Duration;

/// The lifecycle's settings. The IO layer builds this from checked flags, so the
/// values here are already sane; the core still behaves (never panics, never
/// arms a deadline in the past) for any value, including zero.
#[derive(Debug, Clone, PartialEq, Eq, Hash)]
pub struct Config {
    /// How the engine is named in lines until it is ready ("TensorRT-LLM",
    /// "vLLM", "SGLang"; empty while its kind is still to be found): from then
    /// on, the name it gave (`Event::EngineReady`).
    pub engine_display_name: String,
    /// This sidecar's instance id, the last segment of its discovery key.
    pub instance_id: u64,
    /// Pause between two attempts of a failed discovery write.
    pub retry_interval: Duration,
    /// How long start-up (engine ready and registered) may take before exit 3.
    pub startup_deadline: Duration,
    /// Without a fresh probe answer for this long, the engine counts as lost.
    pub stale_after: Duration,
    /// After a shutdown signal, how long calls are still admitted so that routers
    /// that have not yet seen the withdrawal do not get refusals.
    pub router_grace: Duration,
    /// How long in-flight calls may take to finish once admission is closed.
    pub drain_timeout: Duration,
    /// What follows the withdrawal and drain after an engine loss.
    pub on_engine_loss: OnEngineLoss,
    /// How long Serving may go on with its record gone from discovery (a
    /// lease expired, the record removed) and every registration since
    /// failed. Past it the worker leaves as after an engine loss (withdraw,
    /// drain, exit 1): a worker no router can see serves no one, and its
    /// supervisor should hear of it.
    pub reregister_deadline: Duration,
}

/// What the worker does once an engine loss has been withdrawn and drained.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, Default)]
pub enum OnEngineLoss {
    /// Exit 1: the supervisor restarts the worker (and, in a pod, the kubelet
    /// has restarted the engine container already).
    #[default]
    Exit,
    /// Wait for the engine again, as at start-up, and register anew under a
    /// new instance id, in the same process: for supervisors that restart the
    /// engine themselves and leave the sidecar running.
    Rejoin,
}

impl Config {
    /// The instance id as it appears in discovery keys and log lines.
    pub fn instance_hex(&self) -> String {
        format!("{:x}", self.instance_id)
    }
}
