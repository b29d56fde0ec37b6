//! TensorRT-LLM: `GetServerInfo` + `GetModelInfo` describe the engine (the API
//! carries no instance id, so that description is its identity), and
//! `HealthCheck` answering exactly "OK" is the fresh-load signal.

use std::time::Duration;

use llm_sidecar_engine_api::trtllm::trtllm_service_client::TrtllmServiceClient;
use llm_sidecar_engine_api::trtllm::{
    GetModelInfoRequest, GetServerInfoRequest, HealthCheckRequest,
};
use tonic::transport::Channel;

use super::{EngineError, EngineInfo, bounded};
use crate::discovery::ModelRecord;

pub(super) async fn read_info(
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    let mut client = TrtllmServiceClient::new(channel.clone());
    let server = bounded(
        "GetServerInfo",
        bound,
        client.get_server_info(GetServerInfoRequest {}),
    )
    .await?;
    let model = bounded(
        "GetModelInfo",
        bound,
        client.get_model_info(GetModelInfoRequest {}),
    )
    .await?;
    let identity = format!(
        "trtllm {} backend={} tp={} pp={} cp={} world={} model={} max_input_len={} max_seq_len={}",
        server.version,
        server.backend,
        server.tensor_parallel_size,
        server.pipeline_parallel_size,
        server.context_parallel_size,
        server.world_size,
        model.model_id,
        model.max_input_len,
        model.max_seq_len,
    );
    Ok(EngineInfo {
        version: server.version,
        identity,
        model: ModelRecord {
            name: model.model_id,
            max_input_len: i64::from(model.max_input_len),
            max_seq_len: i64::from(model.max_seq_len),
        },
    })
}

pub(super) async fn probe(channel: &Channel, bound: Duration) -> Result<(), EngineError> {
    let mut client = TrtllmServiceClient::new(channel.clone());
    let answer = bounded(
        "HealthCheck",
        bound,
        client.health_check(HealthCheckRequest {}),
    )
    .await?;
    if answer.status == "OK" {
        Ok(())
    } else {
        Err(EngineError::NotFresh {
            call: "HealthCheck",
            answer: answer.status,
        })
    }
}
