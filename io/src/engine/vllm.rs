//! vLLM through `vllm.grpc.engine.VllmEngine`: `GetModelInfo` describes the
//! model, `GetLoads` answering at all is the fresh-load signal (and carries
//! the version). The API has no per-process identity, so the monitors'
//! connection stands for it (the profile's `connection_is_identity`).
//! Servicers older than `GetLoads` (smg-grpc-servicer before mid-2026) are
//! registered without a version, and have no stale-load rule.

use std::time::Duration;

use llm_sidecar_engine_api::vllm::vllm_engine_client::VllmEngineClient;
use llm_sidecar_engine_api::vllm::{GetLoadsRequest, GetModelInfoRequest};
use tonic::transport::Channel;

use super::{EngineError, EngineInfo, EngineKind, Probed, UNKNOWN_VERSION, bounded, optional};
use crate::discovery::ModelRecord;

fn loads() -> GetLoadsRequest {
    GetLoadsRequest {
        dp_rank: None,
        include: vec!["core".to_string()],
    }
}

pub(super) async fn read_info(
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    let mut client = VllmEngineClient::new(channel.clone());
    let model = bounded(
        "GetModelInfo",
        bound,
        client.get_model_info(GetModelInfoRequest {}),
    )
    .await?;
    let mut unserved = Vec::new();
    let version = optional(
        bounded("GetLoads", bound, client.get_loads(loads())).await,
        &mut unserved,
    )?
    .map_or_else(|| UNKNOWN_VERSION.to_string(), |load| load.version);
    let name = if model.served_model_name.is_empty() {
        model.model_path
    } else {
        model.served_model_name
    };
    let max_input = if model.max_req_input_len > 0 {
        i64::from(model.max_req_input_len)
    } else {
        i64::from(model.max_context_length)
    };
    Ok(EngineInfo {
        kind: EngineKind::Vllm,
        display_name: EngineKind::Vllm.profile().display_name.to_string(),
        identity: format!(
            "vllm {version} model={name} max_context_length={}",
            model.max_context_length
        ),
        version,
        instance_id: None,
        unserved,
        model: ModelRecord {
            name,
            max_input_len: max_input,
            max_seq_len: i64::from(model.max_context_length),
            kv_cache_tokens: None,
        },
    })
}

/// `GetLoads` answering is fresh; there is no identity to re-read.
pub(super) async fn probe(channel: &Channel, bound: Duration) -> Probed {
    let mut client = VllmEngineClient::new(channel.clone());
    let fresh = bounded("GetLoads", bound, client.get_loads(loads()))
        .await
        .map(|_| ());
    Probed {
        fresh,
        identity: None,
    }
}
