//! TensorRT-LLM through `trtllm.TrtllmService`: `GetServerInfo` +
//! `GetModelInfo` describe the engine (the API carries no instance id, so that
//! description is its identity), and `HealthCheck` answering exactly "OK" is
//! the fresh-load signal. A server older than `GetServerInfo` is described
//! by its model alone, and registered without a version.

use std::time::Duration;

use llm_sidecar_engine_api::trtllm::trtllm_service_client::TrtllmServiceClient;
use llm_sidecar_engine_api::trtllm::{
    GetModelInfoRequest, GetServerInfoRequest, HealthCheckRequest,
};
use tonic::transport::Channel;

use super::{EngineError, EngineInfo, EngineKind, Probed, UNKNOWN_VERSION, bounded, optional};
use crate::discovery::ModelRecord;

pub(super) async fn read_info(
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    let mut client = TrtllmServiceClient::new(channel.clone());
    let mut unserved = Vec::new();
    let server = optional(
        bounded(
            "GetServerInfo",
            bound,
            client.get_server_info(GetServerInfoRequest {}),
        )
        .await,
        &mut unserved,
    )?;
    let model = bounded(
        "GetModelInfo",
        bound,
        client.get_model_info(GetModelInfoRequest {}),
    )
    .await?;
    let lengths = format!(
        "model={} max_input_len={} max_seq_len={}",
        model.model_id, model.max_input_len, model.max_seq_len
    );
    let identity = match &server {
        Some(server) => format!(
            "trtllm {} backend={} tp={} pp={} cp={} world={} {lengths}",
            server.version,
            server.backend,
            server.tensor_parallel_size,
            server.pipeline_parallel_size,
            server.context_parallel_size,
            server.world_size,
        ),
        None => format!("trtllm {lengths}"),
    };
    Ok(EngineInfo {
        kind: EngineKind::Trtllm,
        display_name: EngineKind::Trtllm.profile().display_name.to_string(),
        version: server.map_or_else(|| UNKNOWN_VERSION.to_string(), |s| s.version),
        identity,
        instance_id: None,
        unserved,
        model: ModelRecord {
            name: model.model_id,
            max_input_len: i64::from(model.max_input_len),
            max_seq_len: i64::from(model.max_seq_len),
            kv_cache_tokens: None,
        },
    })
}

/// `HealthCheck` == "OK" is fresh; the identity is the description again.
pub(super) async fn probe(channel: &Channel, bound: Duration) -> Probed {
    let mut client = TrtllmServiceClient::new(channel.clone());
    let fresh = match bounded(
        "HealthCheck",
        bound,
        client.health_check(HealthCheckRequest {}),
    )
    .await
    {
        Ok(answer) if answer.status == "OK" => Ok(()),
        Ok(answer) => Err(EngineError::NotFresh {
            call: "HealthCheck",
            answer: answer.status,
        }),
        Err(e) => Err(e),
    };
    let identity = read_info(channel, bound).await.ok().map(|i| i.identity);
    Probed { fresh, identity }
}
