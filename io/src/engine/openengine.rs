//! TensorRT-LLM's OpenEngine server: `Control.GetServerInfo` names the engine
//! and its per-process `instance_id` (`<host>-<pid>-<ms>`), `Control.GetModelInfo`
//! the model, and `Control.GetLoad` answering at all is the fresh-load signal;
//! its `instance_id` is the identity re-read by every probe. (`LoadInfo`'s
//! timestamp is the reply's time on the engine's clock, not the sample's, so
//! it says nothing about freshness.)

use std::time::Duration;

use llm_sidecar_engine_api::openengine::control_client::ControlClient;
use llm_sidecar_engine_api::openengine::{
    GetLoadRequest, GetModelInfoRequest, GetServerInfoRequest,
};
use tonic::transport::Channel;

use super::{EngineError, EngineInfo, EngineKind, Probed, bounded};
use crate::discovery::ModelRecord;

/// How lines name an OpenEngine server: TensorRT-LLM's as TensorRT-LLM, any
/// other by the `engine_name` it gives.
fn display_name(engine_name: &str) -> String {
    match engine_name {
        "tensorrt_llm" | "" => EngineKind::OpenEngine.profile().display_name.to_string(),
        other => other.to_string(),
    }
}

pub(super) async fn read_info(
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    let mut client = ControlClient::new(channel.clone());
    let server = bounded(
        "GetServerInfo",
        bound,
        client.get_server_info(GetServerInfoRequest {}),
    )
    .await?;
    let served = server.supported_models.first().cloned().unwrap_or_default();
    let model = bounded(
        "GetModelInfo",
        bound,
        client.get_model_info(GetModelInfoRequest { model: served }),
    )
    .await?;
    let name = if model.served_model_name.is_empty() {
        model.model_id
    } else {
        model.served_model_name
    };
    // The context window bounds the prompt and the whole sequence alike.
    let context = i64::from(model.max_context_length.unwrap_or(0));
    let instance_id = (!server.instance_id.is_empty()).then(|| server.instance_id.clone());
    Ok(EngineInfo {
        kind: EngineKind::OpenEngine,
        display_name: display_name(&server.engine_name),
        identity: instance_id.clone().unwrap_or_else(|| {
            format!(
                "{} {} model={name}",
                server.engine_name, server.engine_version
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

/// `GetLoad` answering is fresh; its `instance_id` is who answers. A server
/// without `GetLoad` is asked who it is through `GetServerInfo`.
pub(super) async fn probe(channel: &Channel, bound: Duration) -> Probed {
    let mut client = ControlClient::new(channel.clone());
    match bounded(
        "GetLoad",
        bound,
        client.get_load(GetLoadRequest {
            include_per_rank: false,
        }),
    )
    .await
    {
        Err(e) if e.unserved_call().is_some() => {
            let server = bounded(
                "GetServerInfo",
                bound,
                client.get_server_info(GetServerInfoRequest {}),
            )
            .await;
            Probed {
                fresh: Err(e),
                identity: server
                    .ok()
                    .and_then(|s| (!s.instance_id.is_empty()).then_some(s.instance_id)),
            }
        }
        answer => Probed::by_instance_id(answer.map(|load| load.instance_id)),
    }
}
