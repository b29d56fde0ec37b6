//! Start-up: connect and read the engine until it answers.
//!
//! A refused connection means the engine is still loading its model (engines
//! bind their port only once it is loaded), so this keeps trying every retry
//! interval, each attempt bounded, and logs a change of reason once rather than
//! every attempt. It decides nothing: the core's startup deadline ends it.

use std::time::Duration;

use llm_sidecar_core::HumanDuration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};

use super::{EngineError, EngineInfo, EngineProfile, StreamLimit, connect, read_info};

/// The engine answered its start-up calls; its connection is handed over.
pub(crate) type EngineReady = (EngineInfo, Channel);

/// What the start-up wait needs to know.
pub(crate) struct StartupWait {
    pub(crate) profile: EngineProfile,
    /// The engine's address as the operator wrote it, for log lines.
    pub(crate) address: String,
    pub(crate) endpoint: Endpoint,
    /// Where the engine's stream limit goes once its SETTINGS arrive.
    pub(crate) limit: StreamLimit,
    /// Bound on one attempt (connect plus the start-up calls).
    pub(crate) attempt_bound: Duration,
    pub(crate) retry_interval: Duration,
}

/// Tries until the engine answers (then sends it on `ready`) or `cancel` fires.
pub(crate) async fn wait_for_engine(
    wait: StartupWait,
    ready: mpsc::Sender<EngineReady>,
    cancel: CancellationToken,
) {
    let StartupWait {
        profile,
        address,
        endpoint,
        limit,
        attempt_bound,
        retry_interval,
    } = wait;
    let mut last_error = String::new();
    let mut attempts: u64 = 0;
    loop {
        attempts += 1;
        let attempt = async {
            let channel = connect(&endpoint, &limit, attempt_bound).await?;
            let info = read_info(&profile, &channel, attempt_bound).await?;
            Ok::<_, EngineError>((info, channel))
        };
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            outcome = attempt => outcome,
        };
        match outcome {
            Ok((info, channel)) => {
                tracing::info!(
                    model = %info.model.name,
                    version = %info.version,
                    "{} engine at {address} answered (start-up attempt {attempts})",
                    profile.display_name(),
                );
                let _ = ready.send((info, channel)).await;
                return;
            }
            Err(e) => {
                let text = e.to_string();
                if text != last_error {
                    tracing::info!(
                        "{} engine at {address} not ready yet ({text}); retrying every {}",
                        profile.display_name(),
                        HumanDuration(retry_interval)
                    );
                    last_error = text;
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(retry_interval) => {}
        }
    }
}
