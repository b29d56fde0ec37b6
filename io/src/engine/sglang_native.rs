//! SGLang's native gRPC server (`sglang.runtime.v1.SglangService`, v0.5.16 and
//! later). Its info RPCs answer JSON documents: `GetModelInfo` the model path,
//! `GetServerInfo` the version, the served name and the context length. It
//! carries no per-process identity, so the monitors' connection stands for it
//! (the profile's `connection_is_identity`); `GetLoad` answering at all is the
//! fresh-load signal.

use std::time::Duration;

use llm_sidecar_engine_api::sglang_runtime::sglang_service_client::SglangServiceClient;
use llm_sidecar_engine_api::sglang_runtime::{
    GetLoadRequest, GetModelInfoRequest, GetServerInfoRequest,
};
use serde_json::Value;
use tonic::transport::Channel;

use super::{EngineError, EngineInfo, EngineKind, Probed, UNKNOWN_VERSION, bounded};
use crate::discovery::ModelRecord;

/// A JSON document the server sent, as an object; anything else reads as empty
/// (every field the sidecar takes from it has a fallback).
fn document(text: &str) -> serde_json::Map<String, Value> {
    match serde_json::from_str(text) {
        Ok(Value::Object(map)) => map,
        Ok(_) | Err(_) => serde_json::Map::new(),
    }
}

fn text(doc: &serde_json::Map<String, Value>, key: &str) -> Option<String> {
    doc.get(key)
        .and_then(Value::as_str)
        .filter(|s| !s.is_empty())
        .map(str::to_string)
}

/// A count, given as a number or as a string of one.
fn count(doc: &serde_json::Map<String, Value>, key: &str) -> Option<i64> {
    doc.get(key).and_then(|v| {
        v.as_i64()
            .or_else(|| v.as_str().and_then(|s| s.parse().ok()))
            .filter(|n| *n > 0)
    })
}

pub(super) async fn read_info(
    channel: &Channel,
    bound: Duration,
) -> Result<EngineInfo, EngineError> {
    let mut client = SglangServiceClient::new(channel.clone());
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
    let model_doc = document(&model.json_info);
    let server_doc = document(&server.json_info);
    let path = if model.model_path.is_empty() {
        text(&model_doc, "model_path").unwrap_or_default()
    } else {
        model.model_path
    };
    let name = text(&server_doc, "served_model_name").unwrap_or(path);
    let context = count(&server_doc, "context_length").unwrap_or(0);
    let max_input = count(&server_doc, "max_req_input_len").unwrap_or(context);
    let version = text(&server_doc, "version").unwrap_or_else(|| UNKNOWN_VERSION.to_string());
    Ok(EngineInfo {
        kind: EngineKind::SglangNative,
        display_name: EngineKind::SglangNative.profile().display_name.to_string(),
        identity: format!("sglang {version} model={name} context_length={context}"),
        version,
        instance_id: None,
        unserved: Vec::new(),
        model: ModelRecord {
            name,
            max_input_len: max_input,
            max_seq_len: context,
        },
    })
}

/// `GetLoad` answering is fresh; there is no identity to re-read.
pub(super) async fn probe(channel: &Channel, bound: Duration) -> Probed {
    let mut client = SglangServiceClient::new(channel.clone());
    let fresh = bounded(
        "GetLoad",
        bound,
        client.get_load(GetLoadRequest { dp_rank: None }),
    )
    .await
    .map(|_| ());
    Probed {
        fresh,
        identity: None,
    }
}
