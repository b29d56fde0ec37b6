//! vLLM's native gRPC server (its Rust frontend: `vllm.Inference` and
//! `vllm.Control`). `Control.GetModelInfo` names the model and
//! `Control.GetServerInfo` the version, the context length and the
//! per-process `instance_id`, which is the identity. The API has no load RPC:
//! `GetServerInfo` answering is the probe's fresh answer (it proves the server
//! process answers; a dead engine core turns the health services NOT_SERVING,
//! which the Watch reports), and it re-reads the instance id.

use std::time::Duration;

use llm_sidecar_engine_api::vllm_native::control_client::ControlClient;
use llm_sidecar_engine_api::vllm_native::{GetModelInfoRequest, GetServerInfoRequest};
use tonic::transport::Channel;

use super::{EngineError, EngineInfo, EngineKind, Probed, bounded};
use crate::discovery::ModelRecord;

pub(super) async fn read_info(
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    let mut client = ControlClient::new(channel.clone());
    let model = bounded(
        "GetModelInfo",
        bound,
        client.get_model_info(GetModelInfoRequest {}),
    )
    .await?;
    let server = bounded(
        "GetServerInfo",
        bound,
        client.get_server_info(GetServerInfoRequest {}),
    )
    .await?;
    let name = if model.served_model_name.is_empty() {
        model.model_id
    } else {
        model.served_model_name
    };
    let context = i64::from(server.max_model_len);
    let instance_id = (!server.instance_id.is_empty()).then(|| server.instance_id.clone());
    Ok(EngineInfo {
        kind: EngineKind::VllmNative,
        display_name: EngineKind::VllmNative.profile().display_name.to_string(),
        identity: instance_id.clone().unwrap_or_else(|| {
            format!(
                "vllm {} model={name} max_model_len={context}",
                server.engine_version
            )
        }),
        version: server.engine_version,
        instance_id,
        unserved: Vec::new(),
        model: ModelRecord {
            name,
            max_input_len: context,
            max_seq_len: context,
            kv_cache_tokens: None,
        },
    })
}

/// `GetServerInfo` answering is fresh; its `instance_id` is who answers.
pub(super) async fn probe(channel: &Channel, bound: Duration) -> Probed {
    let mut client = ControlClient::new(channel.clone());
    let answer = bounded(
        "GetServerInfo",
        bound,
        client.get_server_info(GetServerInfoRequest {}),
    )
    .await;
    Probed::by_instance_id(answer.map(|server| server.instance_id))
}
