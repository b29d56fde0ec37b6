//! Start-up: connect and read the engine until it answers.
//!
//! A refused connection means the engine is still loading its model (engines
//! bind their port only once it is loaded), so this keeps trying every retry
//! interval, each attempt bounded, and logs a change of reason once rather than
//! every attempt. An attempt: connect; find the kind (`--engine-kind auto`);
//! read the engine's server and model info; and wait for its liveness service
//! to say SERVING (SGLang and vLLM warm up with their port open; an engine of
//! any kind may answer its API while its health says NOT_SERVING, and
//! registering it then would only lose it a moment later). It decides
//! nothing: the core's startup deadline ends it.

use std::time::Duration;

use llm_sidecar_core::HumanDuration;
use tokio::sync::mpsc;
use tokio_util::sync::CancellationToken;
use tonic::transport::{Channel, Endpoint};
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::detect::{Detected, detect, none_served_message};
use super::{
    ConnectionWatch, EngineChoice, EngineError, EngineInfo, Following, StreamLimit, bounded,
    connect, read_info, sglang_native,
};

/// The engine answered its start-up calls: what it said, the connection the
/// monitors use, and the watch on that connection.
pub(crate) struct EngineReady {
    pub(crate) info: EngineInfo,
    pub(crate) channel: Channel,
    pub(crate) connection: ConnectionWatch,
}

/// What the start-up wait needs to know.
#[derive(Clone)]
pub(crate) struct StartupWait {
    pub(crate) choice: EngineChoice,
    /// The grpc.health.v1 service to wait on (the kind's own unless
    /// `--liveness-service` says otherwise).
    pub(crate) liveness_service: Option<String>,
    /// The engine's address as the operator wrote it, for log lines.
    pub(crate) address: String,
    pub(crate) endpoint: Endpoint,
    /// Where the engine's stream limit goes once its SETTINGS arrive.
    pub(crate) limit: StreamLimit,
    /// Bound on one attempt's each step (connect, every start-up call).
    pub(crate) attempt_bound: Duration,
    pub(crate) retry_interval: Duration,
    /// The wait after a loss (a rejoin): an engine whose health still says
    /// NOT_SERVING is "not serving again yet" rather than "warming up".
    pub(crate) rejoin: bool,
}

/// Why one attempt did not get the engine ready.
#[derive(Debug, thiserror::Error)]
enum NotReady {
    #[error(transparent)]
    Engine(#[from] EngineError),
    #[error("{}", none_served_message())]
    NoKnownApi,
    #[error("{}: its health service {service:?} reports {status}", if *.rejoin { "not serving again yet" } else { "warming up" })]
    WarmingUp {
        service: String,
        status: String,
        rejoin: bool,
    },
}

/// One attempt: connected, kind found, info read, warm-up over.
async fn attempt(wait: &StartupWait) -> Result<EngineReady, NotReady> {
    let connection = ConnectionWatch::default();
    let channel = connect(&wait.endpoint, &wait.limit, &connection, wait.attempt_bound).await?;
    let kind = match wait.choice {
        EngineChoice::Kind(kind) => kind,
        EngineChoice::Auto => match detect(&channel, wait.attempt_bound).await? {
            Detected::Kind(kind) => kind,
            Detected::NoneServed => return Err(NotReady::NoKnownApi),
        },
    };
    let info = read_info(kind, &channel, wait.attempt_bound).await?;
    let profile = kind.profile();
    if profile.following == Following::EngineState && wait.liveness_service.is_none() {
        // SGLang's native server: its own HealthCheck, false through warm-up.
        match sglang_native::healthy(&channel, wait.attempt_bound).await {
            Ok(true) => {}
            Ok(false) => {
                return Err(NotReady::WarmingUp {
                    service: "sglang.runtime.v1.SglangService/HealthCheck".into(),
                    status: "healthy=false".into(),
                    rejoin: wait.rejoin,
                });
            }
            Err(e) if e.unserved_call().is_some() => {}
            Err(e) => return Err(e.into()),
        }
        return Ok(EngineReady {
            info,
            channel,
            connection,
        });
    }
    let service = wait
        .liveness_service
        .clone()
        .unwrap_or_else(|| profile.liveness_service.to_string());
    let answer = bounded(
        "grpc.health.v1.Health/Check",
        wait.attempt_bound,
        HealthClient::new(channel.clone()).check(HealthCheckRequest {
            service: service.clone(),
        }),
    )
    .await;
    match answer {
        Ok(r) if r.status == ServingStatus::Serving as i32 => {}
        Ok(r) => {
            let status = ServingStatus::try_from(r.status)
                .map_or_else(|_| r.status.to_string(), |s| s.as_str_name().to_string());
            return Err(NotReady::WarmingUp {
                service,
                status,
                rejoin: wait.rejoin,
            });
        }
        // No such health service (an engine without one, or one that has
        // not registered it): nothing to wait for; the monitors say so
        // once, or watch it register.
        Err(EngineError::Call {
            code: tonic::Code::Unimplemented | tonic::Code::NotFound,
            ..
        }) => {}
        Err(e) => return Err(e.into()),
    }
    Ok(EngineReady {
        info,
        channel,
        connection,
    })
}

/// Tries until the engine answers (then sends it on `ready`) or `cancel` fires.
pub(crate) async fn wait_for_engine(
    wait: StartupWait,
    ready: mpsc::Sender<EngineReady>,
    cancel: CancellationToken,
) {
    let mut last_error = String::new();
    let mut attempts: u64 = 0;
    loop {
        attempts += 1;
        let outcome = tokio::select! {
            () = cancel.cancelled() => return,
            outcome = attempt(&wait) => outcome,
        };
        match outcome {
            Ok(engine) => {
                let info = &engine.info;
                let profile = info.profile();
                if wait.choice == EngineChoice::Auto {
                    tracing::info!(
                        "the engine at {} serves {}: following it as --engine-kind {}",
                        wait.address,
                        profile.service,
                        profile.name
                    );
                }
                tracing::info!(
                    model = %info.model.name,
                    version = %info.version,
                    kind = profile.name,
                    "{} engine at {} answered (start-up attempt {attempts})",
                    info.display_name,
                    wait.address,
                );
                if !info.unserved.is_empty() {
                    tracing::warn!(
                        "the {} engine does not serve {} (an older servicer): registering with \
                         what its other calls said, version {:?}",
                        info.display_name,
                        info.unserved.join(", "),
                        info.version
                    );
                }
                let _ = ready.send(engine).await;
                return;
            }
            Err(e) => {
                let text = e.to_string();
                if text != last_error {
                    let engine = match wait.choice.display_name() {
                        "" => "The".to_string(),
                        name => name.to_string(),
                    };
                    tracing::info!(
                        "{engine} engine at {} not ready yet ({text}); retrying every {}",
                        wait.address,
                        HumanDuration(wait.retry_interval)
                    );
                    last_error = text;
                }
            }
        }
        tokio::select! {
            () = cancel.cancelled() => return,
            () = tokio::time::sleep(wait.retry_interval) => {}
        }
    }
}
