//! `--engine-kind auto`: which API does the engine serve? One cheap call per
//! kind, all at once, on the connection start-up just opened; a kind whose
//! service the engine does not serve answers UNIMPLEMENTED. Never a guess:
//! anything else (the engine still starting) means "try again". The call is
//! one every version of the kind's servicer has (`GetModelInfo`; OpenEngine's
//! `GetServerInfo`, part of its API from the first release), so an older
//! servicer is still found.

use std::time::Duration;

use llm_sidecar_engine_api::openengine::control_client::ControlClient;
use llm_sidecar_engine_api::sglang::sglang_scheduler_client::SglangSchedulerClient;
use llm_sidecar_engine_api::trtllm::trtllm_service_client::TrtllmServiceClient;
use llm_sidecar_engine_api::{openengine, sglang, sglang_runtime, trtllm, vllm, vllm_native};
use tonic::transport::Channel;

use super::{EngineError, EngineKind, PROFILES, bounded};

/// The call that tells each kind apart, as an operator reads it in a log line.
pub(crate) const DETECTION_CALLS: [(EngineKind, &str); 6] = [
    (
        EngineKind::OpenEngine,
        "/openengine.v1.Control/GetServerInfo",
    ),
    (EngineKind::Trtllm, "/trtllm.TrtllmService/GetModelInfo"),
    (EngineKind::VllmNative, "/vllm.Control/GetModelInfo"),
    (
        EngineKind::Vllm,
        "/vllm.grpc.engine.VllmEngine/GetModelInfo",
    ),
    (
        EngineKind::Sglang,
        "/sglang.grpc.scheduler.SglangScheduler/GetModelInfo",
    ),
    (
        EngineKind::SglangNative,
        "/sglang.runtime.v1.SglangService/GetModelInfo",
    ),
];

/// What detection found.
#[derive(Debug)]
pub(crate) enum Detected {
    /// The engine serves this API (the first one in [`PROFILES`] order when it
    /// serves several).
    Kind(EngineKind),
    /// Every call was UNIMPLEMENTED: the engine serves none of the APIs.
    NoneServed,
}

fn tried() -> String {
    DETECTION_CALLS
        .iter()
        .map(|(_, call)| *call)
        .collect::<Vec<_>>()
        .join(", ")
}

/// Why detection did not name a kind, as the start-up log says it.
pub(crate) fn none_served_message() -> String {
    format!(
        "serves none of the engine APIs llm-sidecar follows (tried {}: every one UNIMPLEMENTED)",
        tried()
    )
}

/// Calls one kind's detection RPC: `Ok(true)` it answered, `Ok(false)`
/// UNIMPLEMENTED, `Err` anything else.
async fn answers(
    kind: EngineKind,
    channel: &Channel,
    bound: Duration,
) -> Result<bool, EngineError> {
    let result = match kind {
        EngineKind::OpenEngine => bounded(
            "GetServerInfo",
            bound,
            ControlClient::new(channel.clone())
                .get_server_info(openengine::GetServerInfoRequest {}),
        )
        .await
        .map(|_| ()),
        EngineKind::Trtllm => bounded(
            "GetModelInfo",
            bound,
            TrtllmServiceClient::new(channel.clone())
                .get_model_info(trtllm::GetModelInfoRequest {}),
        )
        .await
        .map(|_| ()),
        EngineKind::Vllm => bounded(
            "GetModelInfo",
            bound,
            vllm::vllm_engine_client::VllmEngineClient::new(channel.clone())
                .get_model_info(vllm::GetModelInfoRequest {}),
        )
        .await
        .map(|_| ()),
        EngineKind::Sglang => bounded(
            "GetModelInfo",
            bound,
            SglangSchedulerClient::new(channel.clone())
                .get_model_info(sglang::GetModelInfoRequest {}),
        )
        .await
        .map(|_| ()),
        EngineKind::VllmNative => bounded(
            "GetModelInfo",
            bound,
            vllm_native::control_client::ControlClient::new(channel.clone())
                .get_model_info(vllm_native::GetModelInfoRequest {}),
        )
        .await
        .map(|_| ()),
        EngineKind::SglangNative => bounded(
            "GetModelInfo",
            bound,
            sglang_runtime::sglang_service_client::SglangServiceClient::new(channel.clone())
                .get_model_info(sglang_runtime::GetModelInfoRequest {}),
        )
        .await
        .map(|_| ()),
    };
    match result {
        Ok(()) => Ok(true),
        Err(EngineError::Call {
            code: tonic::Code::Unimplemented,
            ..
        }) => Ok(false),
        Err(e) => Err(e),
    }
}

/// Asks `kind`'s detection call once: `Ok` if the engine answered it (an
/// UNIMPLEMENTED is an error here: the engine does not serve that kind).
pub(crate) async fn answers_now(
    kind: EngineKind,
    channel: &Channel,
    bound: Duration,
) -> Result<(), EngineError> {
    match answers(kind, channel, bound).await? {
        true => Ok(()),
        false => Err(EngineError::Call {
            call: "the kind's detection call",
            code: tonic::Code::Unimplemented,
            message: format!("the engine does not serve {}", kind.profile().service),
        }),
    }
}

/// Finds the kind the engine serves, each call bounded by `bound`.
pub(crate) async fn detect(channel: &Channel, bound: Duration) -> Result<Detected, EngineError> {
    let calls = PROFILES.map(|p| answers(p.kind, channel, bound));
    let [a, b, c, d, e, f] = calls;
    let (a, b, c, d, e, f) = tokio::join!(a, b, c, d, e, f);
    let mut unknown = None;
    for (profile, answer) in PROFILES.iter().zip([a, b, c, d, e, f]) {
        match answer {
            Ok(true) => return Ok(Detected::Kind(profile.kind)),
            Ok(false) => {}
            Err(e) => unknown = unknown.or(Some(e)),
        }
    }
    match unknown {
        // Some call neither answered nor said UNIMPLEMENTED: ask again later.
        Some(e) => Err(e),
        None => Ok(Detected::NoneServed),
    }
}
