//! One look, for `llm-sidecar probe`: does the engine (of any kind, found as
//! start-up finds it) or a running sidecar serve right now? Every step is
//! bounded; nothing is retried. The answer is data; the caller picks the exit
//! code.

use std::time::Duration;

use tonic::transport::Channel;
use tonic_health::pb::HealthCheckRequest;
use tonic_health::pb::health_check_response::ServingStatus;
use tonic_health::pb::health_client::HealthClient;

use super::detect::{Detected, detect, none_served_message};
use super::{
    ChannelSettings, ConnectionWatch, EngineChoice, EngineError, EngineKind, StreamLimit, bounded,
    connect, endpoint,
};

/// What one look found.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Checked {
    /// It serves. `kind` is set for an engine; `service` is the health
    /// service asked (`None`: the engine has none, and answering its API's
    /// detection call is what serving means).
    Serving {
        /// The engine's kind (`None` for a sidecar).
        kind: Option<EngineKind>,
        /// The grpc.health.v1 service that said SERVING.
        service: Option<String>,
    },
    /// It answered, but not SERVING.
    NotServing {
        /// The engine's kind (`None` for a sidecar).
        kind: Option<EngineKind>,
        /// The service asked.
        service: String,
        /// The status's name (or number).
        status: String,
    },
}

/// Why a look found nothing to judge.
#[derive(Debug, thiserror::Error)]
pub enum CheckError {
    /// Nothing accepted the connection in time.
    #[error("{0}")]
    Connect(String),
    /// A call failed or did not answer in time.
    #[error("{0}")]
    Call(String),
    /// The engine serves none of the APIs llm-sidecar follows.
    #[error("{}", none_served_message())]
    NoneServed,
}

impl From<EngineError> for CheckError {
    fn from(e: EngineError) -> Self {
        match e {
            EngineError::Connect(text) => CheckError::Connect(text),
            other => CheckError::Call(other.to_string()),
        }
    }
}

fn status_name(raw: i32) -> String {
    ServingStatus::try_from(raw).map_or_else(|_| raw.to_string(), |s| s.as_str_name().to_string())
}

async fn open(address: &str, timeout: Duration) -> Result<Channel, CheckError> {
    let settings = ChannelSettings {
        connect_timeout: timeout,
        // One look does not live long enough for a ping.
        keepalive_interval: Duration::from_secs(3600),
        keepalive_timeout: timeout,
    };
    let endpoint = endpoint(address, settings)?;
    Ok(connect(
        &endpoint,
        &StreamLimit::default(),
        &ConnectionWatch::default(),
        timeout,
    )
    .await?)
}

async fn health_check(
    channel: &Channel,
    service: &str,
    timeout: Duration,
) -> Result<i32, EngineError> {
    bounded(
        "grpc.health.v1.Health/Check",
        timeout,
        HealthClient::new(channel.clone()).check(HealthCheckRequest {
            service: service.to_string(),
        }),
    )
    .await
    .map(|r| r.status)
}

/// Looks at the engine at `address`: its kind (given, or found with the four
/// detection calls), then `grpc.health.v1` Check on the kind's liveness
/// service. An engine without that service (UNIMPLEMENTED, NOT_FOUND) serves
/// if it answered its API's detection call.
pub async fn check_engine(
    address: &str,
    choice: EngineChoice,
    timeout: Duration,
) -> Result<Checked, CheckError> {
    let channel = open(address, timeout).await?;
    let kind = match choice {
        EngineChoice::Kind(kind) => kind,
        EngineChoice::Auto => match detect(&channel, timeout).await? {
            Detected::Kind(kind) => kind,
            Detected::NoneServed => return Err(CheckError::NoneServed),
        },
    };
    let service = kind.profile().liveness_service;
    match health_check(&channel, service, timeout).await {
        Ok(raw) if raw == ServingStatus::Serving as i32 => Ok(Checked::Serving {
            kind: Some(kind),
            service: Some(service.to_string()),
        }),
        Ok(raw) => Ok(Checked::NotServing {
            kind: Some(kind),
            service: service.to_string(),
            status: status_name(raw),
        }),
        Err(EngineError::Call {
            code: tonic::Code::Unimplemented | tonic::Code::NotFound,
            ..
        }) => {
            // No health service: the API answering is all there is to go on;
            // with a given kind, ask its detection call now.
            if let EngineChoice::Kind(kind) = choice {
                super::detect::answers_now(kind, &channel, timeout).await?;
            }
            Ok(Checked::Serving {
                kind: Some(kind),
                service: None,
            })
        }
        Err(e) => Err(e.into()),
    }
}

/// Looks at a running sidecar at `address` (its `--listen`): its own
/// `grpc.health.v1` for `""`, SERVING exactly while it serves.
pub async fn check_sidecar(address: &str, timeout: Duration) -> Result<Checked, CheckError> {
    let channel = open(address, timeout).await?;
    let raw = health_check(&channel, "", timeout).await?;
    if raw == ServingStatus::Serving as i32 {
        Ok(Checked::Serving {
            kind: None,
            service: Some(String::new()),
        })
    } else {
        Ok(Checked::NotServing {
            kind: None,
            service: String::new(),
            status: status_name(raw),
        })
    }
}
